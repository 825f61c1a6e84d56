"""Crafted model files and hostile buffers: every one ends in a one-line KvlabError (or correct output), never a
traceback, a crash, a hang or a memory blow-up, and nothing reaches the C kernels with the wrong size.

GGUFs are a tiny llama (2 layers, d_model 64, 4 query / 2 KV heads of 16, Q4_1 matrices, a Q8_0 embedding,
SmolLM2's tokenizer) written here and then edited: metadata keys, tensor shapes, or raw header bytes.
HF folders are a config.json and a safetensors file written by the test.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter, quants

from kvlab import kernels
from kvlab.cache import CacheGeometry, make_cache
from kvlab.errors import ConfigError, KvlabError, ModelFileError
from kvlab.model.loader import load_model
from kvlab.plan import PlanSettings, rules_for, make_plan
from kvlab.plan.report import plan_json
from kvlab.sources import load_spec
from kvlab.sources.gguf import gguf_metadata, open_gguf

from .kernel_checks import require_kernel

D, HEADS, KV_HEADS, HEAD_DIM, FF, LAYERS = 64, 4, 2, 16, 128, 2


@pytest.fixture(scope="module")
def tokenizer_meta(smollm2):
    meta = gguf_metadata(open_gguf(smollm2.path))
    return {k: v for k, v in meta.items() if k.startswith("tokenizer.ggml.")}


def tiny_tensors(vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """The tiny llama's tensors in PyTorch (rows, cols) order, fp32."""
    rng = np.random.default_rng(seed)
    w = lambda *shape: (rng.standard_normal(shape) * 0.1).astype(np.float32)  # noqa: E731
    tensors = {"token_embd.weight": w(vocab, D), "output_norm.weight": np.ones(D, np.float32)}
    for i in range(LAYERS):
        tensors.update({
            f"blk.{i}.attn_norm.weight": np.ones(D, np.float32), f"blk.{i}.ffn_norm.weight": np.ones(D, np.float32),
            f"blk.{i}.attn_q.weight": w(HEADS * HEAD_DIM, D), f"blk.{i}.attn_k.weight": w(KV_HEADS * HEAD_DIM, D),
            f"blk.{i}.attn_v.weight": w(KV_HEADS * HEAD_DIM, D), f"blk.{i}.attn_output.weight": w(D, HEADS * HEAD_DIM),
            f"blk.{i}.ffn_gate.weight": w(FF, D), f"blk.{i}.ffn_up.weight": w(FF, D), f"blk.{i}.ffn_down.weight": w(D, FF),
        })
    return tensors


def write_tiny_gguf(path, tokenizer_meta: dict, meta: dict | None = None, tensors: dict | None = None,
                    drop: tuple[str, ...] = ()):
    """The tiny llama with metadata `meta` over the defaults (None deletes a key) and `tensors` replacing its own."""
    vocab = len(tokenizer_meta["tokenizer.ggml.tokens"])
    keys = {"llama.block_count": LAYERS, "llama.context_length": 256, "llama.embedding_length": D,
            "llama.feed_forward_length": FF, "llama.attention.head_count": HEADS, "llama.attention.head_count_kv": KV_HEADS,
            "llama.rope.freq_base": 10000.0, "llama.attention.layer_norm_rms_epsilon": 1e-5, **tokenizer_meta, **(meta or {})}
    all_tensors = {**tiny_tensors(vocab), **(tensors or {})}
    writer = GGUFWriter(str(path), "llama")
    for key, value in keys.items():
        if value is None:
            continue
        if isinstance(value, list):
            item = GGUFValueType.STRING if value and isinstance(value[0], str) else GGUFValueType.INT32
            writer.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=item)
        elif isinstance(value, bool):
            writer.add_key_value(key, value, GGUFValueType.BOOL)
        elif isinstance(value, int):
            writer.add_key_value(key, value, GGUFValueType.UINT32 if 0 <= value < 1 << 32 else GGUFValueType.INT64)
        elif isinstance(value, float):
            writer.add_key_value(key, value, GGUFValueType.FLOAT32)
        else:
            writer.add_key_value(key, value, GGUFValueType.STRING)
    for name, array in all_tensors.items():
        if name in drop:
            continue
        if array.ndim == 2 and array.shape[1] % 32 == 0:
            qtype = GGMLQuantizationType.Q8_0 if name == "token_embd.weight" else GGMLQuantizationType.Q4_1
            writer.add_tensor(name, quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def one_line_error(call, error=KvlabError, match: str | None = None) -> str:
    with pytest.raises(error) as err:
        call()
    text = str(err.value)
    assert "\n" not in text and len(text) < 600, text
    if match is not None:
        assert match in text, text
    return text


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory, tokenizer_meta):
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", tokenizer_meta)


def test_the_untouched_tiny_gguf_loads_and_runs(tiny_path):
    loaded = load_model(tiny_path)
    ids = torch.tensor([loaded.tokenizer.encode("one two")])
    cache = make_cache("dense", CacheGeometry.for_model(loaded.config, capacity=ids.shape[1] + 2))
    with torch.no_grad():
        logits = loaded.model(ids, cache)
        step = loaded.model(ids[:, -1:], cache)
    assert torch.isfinite(logits).all() and torch.isfinite(step).all()


V = "blk.0"  # the layer the shape edits hit
SHAPE_CASES = {
    # the heap corruptions of issue 10: sizes in the file that the config contradicts
    "q rows doubled": (dict(tensors={f"{V}.attn_q.weight": np.zeros((2 * HEADS * HEAD_DIM, D), np.float32)}), "attn_q.weight"),
    "ffn_down swapped": (dict(tensors={f"{V}.ffn_down.weight": np.zeros((FF, D), np.float32)}), "ffn_down.weight"),
    "head count 8": (dict(meta={"llama.attention.head_count": 8}), "attn_"),
    "head count 9.5": (dict(meta={"llama.attention.head_count": 9.5}), "head_count must be an integer"),
    "head count 0": (dict(meta={"llama.attention.head_count": 0}), "head"),
    "head count a string": (dict(meta={"llama.attention.head_count": "nine"}), "head_count must be an integer"),
    "head count list of 3": (dict(meta={"llama.attention.head_count": [4, 4, 4]}), "lists 3 values for 2 layers"),
    "head count per layer differs": (dict(meta={"llama.attention.head_count": [4, 2]}), "layers differ"),
    "feed forward 1000": (dict(meta={"llama.feed_forward_length": 1000}), "ffn_gate.weight"),
    "key_length 32": (dict(meta={"llama.attention.key_length": 32}), "key head dim 32"),
    "key and value length 32": (dict(meta={"llama.attention.key_length": 32, "llama.attention.value_length": 32}), "attn_q.weight"),
    "attn_output wide": (dict(tensors={f"{V}.attn_output.weight": np.zeros((D, 2 * HEADS * HEAD_DIM), np.float32)}),
                         "attn_output.weight"),
    "k 1-D": (dict(tensors={f"{V}.attn_k.weight": np.zeros(KV_HEADS * HEAD_DIM * D, np.float32)}), "attn_k.weight"),
    "k 3-D": (dict(tensors={f"{V}.attn_k.weight": np.zeros((2, KV_HEADS * HEAD_DIM // 2, D), np.float32)}), "attn_k.weight"),
    "norm 2-D": (dict(tensors={f"{V}.attn_norm.weight": np.ones((2, D // 2), np.float32)}), "attn_norm.weight"),
    "embedding short of the vocab": (dict(tensors={"token_embd.weight": np.zeros((1000, D), np.float32)}), "token_embd.weight"),
    "missing ffn_up": (dict(drop=(f"{V}.ffn_up.weight",)), "ffn_up.weight' is missing"),
    "bos beyond the vocab": (dict(meta={"tokenizer.ggml.bos_token_id": 10_000_000}), "bos_token_id"),
    "eos negative": (dict(meta={"tokenizer.ggml.eos_token_id": -5}), "eos_token_id"),
    "vocab_size below the tokens": (dict(meta={"llama.vocab_size": 100}), "vocab_size"),
    "block count 2^31": (dict(meta={"llama.block_count": 1 << 31}), "block_count"),
    "block count a list": (dict(meta={"llama.block_count": [1, 2]}), "block_count"),
    "rms eps a string": (dict(meta={"llama.attention.layer_norm_rms_epsilon": "tiny"}), "layer_norm_rms_epsilon"),
    "rope theta negative": (dict(meta={"llama.rope.freq_base": -1.0}), "freq_base"),
    "partial rotary": (dict(meta={"llama.rope.dimension_count": 8}), "RoPE over 8"),
    "rope scaling yarn": (dict(meta={"llama.rope.scaling.type": "yarn"}), "yarn"),
    "no tokens": (dict(meta={"tokenizer.ggml.tokens": None, "tokenizer.ggml.merges": None}), "vocabulary 0"),
    "tokens not strings": (dict(meta={"tokenizer.ggml.tokens": [1, 2, 3]}), "tokenizer.ggml.tokens must be an array of strings"),
}


@pytest.mark.parametrize("case", SHAPE_CASES)
def test_crafted_gguf_is_a_one_line_error(tmp_path, tokenizer_meta, case):
    edits, message = SHAPE_CASES[case]
    path = write_tiny_gguf(tmp_path / "bad.gguf", tokenizer_meta, **edits)
    one_line_error(lambda: load_model(path), match=message)


def _tensor_dims_offset(raw: bytes, name: str) -> int:
    """Byte offset of the first dimension of tensor `name` in the header's tensor table."""
    key = struct.pack("<Q", len(name)) + name.encode()
    at = raw.index(key) + len(key)
    return at + 4  # after n_dims (uint32)


def _edited(tmp_path, raw: bytes, at: int, fmt: str, value) -> str:
    data = bytearray(raw)
    struct.pack_into(fmt, data, at, value)
    path = tmp_path / "edited.gguf"
    path.write_bytes(bytes(data))
    return str(path)


@pytest.mark.parametrize("dims, message", [
    ((1 << 62, 1 << 62), "more than the whole file"),          # the element count overflows 64 bits
    ((1 << 40, 64), "more than the whole file"),
    ((48, 64), "not whole 32-value blocks"),                   # Q4_1 rows of 48 values
])
def test_tensor_dims_out_of_range(tmp_path, tiny_path, dims, message):
    raw = tiny_path.read_bytes()
    at = _tensor_dims_offset(raw, f"{V}.attn_q.weight")
    data = bytearray(raw)
    struct.pack_into("<QQ", data, at, *dims)
    path = tmp_path / "dims.gguf"
    path.write_bytes(bytes(data))
    one_line_error(lambda: open_gguf(path), ModelFileError, message)
    one_line_error(lambda: load_model(path), ModelFileError, message)


def test_tensor_data_outside_the_file(tmp_path, tiny_path):
    raw = tiny_path.read_bytes()
    at = _tensor_dims_offset(raw, f"{V}.attn_q.weight") + 2 * 8 + 4  # after two dims and the type: the offset
    path = _edited(tmp_path, raw, at, "<Q", 1 << 40)
    one_line_error(lambda: load_model(path), ModelFileError, "truncated")
    path = _edited(tmp_path, raw, at, "<Q", 7)                      # inside the file, but not aligned
    one_line_error(lambda: load_model(path), ModelFileError, "alignment")


def test_counts_beyond_the_file(tmp_path, tiny_path):
    raw = tiny_path.read_bytes()
    for at in (8, 16):  # tensor count, metadata key count
        path = _edited(tmp_path, raw, at, "<Q", 1 << 31)
        one_line_error(lambda: open_gguf(path), ModelFileError, "does not fit")


def test_truncated_anywhere(tmp_path, tiny_path):
    raw = tiny_path.read_bytes()
    for cut in (5, 23, 40, 300, 2_000, 600_000, len(raw) // 2, len(raw) - 1):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(raw[:cut])
        one_line_error(lambda: load_model(path), ModelFileError)


def _raw_gguf(kv: bytes, n_kv: int = 1) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, 0, n_kv) + kv


def _key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


def test_arrays_nested_deep(tmp_path):
    depth = 2000
    value = struct.pack("<I", 9) + (struct.pack("<IQ", 9, 1) * depth) + struct.pack("<IQ", 4, 0)
    path = tmp_path / "nested.gguf"
    path.write_bytes(_raw_gguf(_key("general.nested") + value))
    one_line_error(lambda: open_gguf(path), ModelFileError, "nested more than")


def test_huge_string_and_array_counts(tmp_path):
    string = struct.pack("<I", 8) + struct.pack("<Q", 1 << 50) + b"abc"
    array = struct.pack("<I", 9) + struct.pack("<IQ", 8, 1 << 40) + b"x" * 16
    for i, value in enumerate((string, array)):
        path = tmp_path / f"count{i}.gguf"
        path.write_bytes(_raw_gguf(_key("general.thing") + value) + b"\0" * 64)
        one_line_error(lambda: open_gguf(path), ModelFileError, "does not fit")


# -- Hugging Face folders ------------------------------------------------------------------------------
HF = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
      "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 256, "tie_word_embeddings": True}


def write_hf(folder, config, tensors: dict | None = None) -> str:
    from safetensors.numpy import save_file

    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if tensors is not None:
        save_file(tensors, str(folder / "model.safetensors"))
    return str(folder)


def hf_tensors(config=HF, **replace) -> dict[str, np.ndarray]:
    d, ff, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q, kv = d, config["num_key_value_heads"] * d // config["num_attention_heads"]
    out = {"model.embed_tokens.weight": np.zeros((v, d), np.float32), "model.norm.weight": np.ones(d, np.float32)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": np.ones(d, np.float32), p + "post_attention_layernorm.weight": np.ones(d, np.float32),
                    p + "self_attn.q_proj.weight": np.zeros((q, d), np.float32), p + "self_attn.k_proj.weight": np.zeros((kv, d), np.float32),
                    p + "self_attn.v_proj.weight": np.zeros((kv, d), np.float32), p + "self_attn.o_proj.weight": np.zeros((d, q), np.float32),
                    p + "mlp.gate_proj.weight": np.zeros((ff, d), np.float32), p + "mlp.up_proj.weight": np.zeros((ff, d), np.float32),
                    p + "mlp.down_proj.weight": np.zeros((d, ff), np.float32)})
    out.update(replace)
    return out


@pytest.mark.parametrize("config, message", [
    ("[1, 2, 3]", "must be a JSON object, got list"),
    ("null", "must be a JSON object, got NoneType"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"a": ' * 50_000 + "1" + "}" * 50_000, "nested too deeply"),
    ({**HF, "num_attention_heads": "4"}, "num_attention_heads must be an integer"),
    ({**HF, "hidden_size": [64]}, "hidden_size must be an integer"),
    ({**HF, "num_hidden_layers": 1 << 31}, "num_hidden_layers"),
    ({**HF, "num_hidden_layers": 2.5}, "num_hidden_layers"),
    ({**HF, "rope_theta": "big"}, "rope_theta"),
    ({**HF, "rms_norm_eps": None, "rope_scaling": "llama3"}, "rope_scaling must be an object"),
    ({**HF, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks"),
    ({**HF, "tie_word_embeddings": "yes"}, "tie_word_embeddings"),
    ({**HF, "bos_token_id": 5000}, "bos_token_id=5000"),
    ({**HF, "num_key_value_heads": {"a": 1}}, "num_key_value_heads"),
])
def test_hostile_hf_configs(tmp_path, config, message):
    folder = write_hf(tmp_path / "m", config)
    one_line_error(lambda: load_spec(folder), match=message)
    one_line_error(lambda: load_model(folder), match=message)


def test_safetensors_shapes_that_contradict_the_config(tmp_path):
    k_rows = "model.layers.1.self_attn.k_proj.weight"
    folder = write_hf(tmp_path / "k", HF, hf_tensors(**{k_rows: np.zeros((64, 64), np.float32)}))
    one_line_error(lambda: load_spec(folder), ModelFileError, k_rows)       # the planner's cache would be wrong
    one_line_error(lambda: load_model(folder), ModelFileError, k_rows)
    down = "model.layers.0.mlp.down_proj.weight"
    folder = write_hf(tmp_path / "down", HF, hf_tensors(**{down: np.zeros((128, 64), np.float32)}))
    one_line_error(lambda: load_model(folder), ModelFileError, down)
    embed = "model.embed_tokens.weight"
    folder = write_hf(tmp_path / "embed", HF, hf_tensors(**{embed: np.zeros((99, 64), np.float32)}))
    one_line_error(lambda: load_model(folder), ModelFileError, embed)
    folder = write_hf(tmp_path / "int", HF, hf_tensors(**{down: np.zeros((64, 128), np.int32)}))
    one_line_error(lambda: load_model(folder), ModelFileError, "type I32")


def test_tokenizer_larger_than_the_vocabulary(tmp_path, smollm2):
    config = {**HF, "vocab_size": 1000}
    folder = write_hf(tmp_path / "m", config, hf_tensors(config))
    smollm2.tokenizer.backend.save(str(tmp_path / "m" / "tokenizer.json"))
    one_line_error(lambda: load_model(folder), ModelFileError, "the tokenizer has 49,152 tokens")


def test_safetensors_header_entries_are_checked(tmp_path):
    from kvlab.sources.hf_folder import read_safetensors_header

    def write(header: dict, data: bytes = b"\0" * 16):
        raw = json.dumps(header).encode()
        path = tmp_path / "x.safetensors"
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
        return path

    cases = [
        ({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 1 << 40]}}, "outside"),
        ({"w": {"dtype": "F32", "shape": [3, 2], "data_offsets": [0, 16]}}, "does not fill"),
        ({"w": {"dtype": "F32", "shape": ["2", 2], "data_offsets": [0, 16]}}, "shape"),
        ({"w": {"dtype": "X99", "shape": [2, 2], "data_offsets": [0, 16]}}, "dtype"),
        ({"w": [1, 2]}, "dtype"),
    ]
    for header, message in cases:
        one_line_error(lambda: read_safetensors_header(write(header)), ModelFileError, message)


# -- one reader: the planner and the engine agree on the three points they used to disagree on -------------
def test_gguf_sliding_window_is_ignored_for_llama_as_llama_cpp_does(tmp_path, tokenizer_meta):
    path = write_tiny_gguf(tmp_path / "w.gguf", tokenizer_meta, meta={"llama.attention.sliding_window": 8})
    spec, loaded = load_spec(str(path)), load_model(path)
    assert {layer.kind for layer in spec.layers} == {"full"} and loaded.config.sliding_window is None


@pytest.mark.parametrize("keys, kinds, window", [
    ({"model_type": "qwen2", "sliding_window": 8}, {"full"}, None),                        # use_sliding_window: false
    ({"model_type": "qwen2", "sliding_window": 8, "use_sliding_window": True, "max_window_layers": 0}, {"sliding"}, 8),
    ({"model_type": "mistral", "sliding_window": 8}, {"sliding"}, 8),                        # mistral: no switch
    ({"model_type": "mistral", "sliding_window": None}, {"full"}, None),
])
def test_hf_sliding_window_defaults_follow_transformers(tmp_path, keys, kinds, window):
    config = {**HF, **keys}
    tensors = hf_tensors(config)
    if config["model_type"] == "qwen2":
        tensors.update({f"model.layers.{i}.self_attn.{p}_proj.bias": np.zeros(n, np.float32)
                        for i in range(2) for p, n in (("q", 64), ("k", 32), ("v", 32))})
    folder = write_hf(tmp_path / "m", config, tensors)
    spec = load_spec(folder)
    assert {layer.kind for layer in spec.layers} == kinds
    assert {layer.window for layer in spec.layers} == {window}
    from kvlab.model.config import decoder_config

    assert decoder_config(spec).sliding_window == window


def test_qwen2_window_on_upper_layers_only_is_refused_by_the_engine(tmp_path):
    config = {**HF, "model_type": "qwen2", "sliding_window": 8, "use_sliding_window": True, "max_window_layers": 1}
    assert [layer.kind for layer in load_spec(write_hf(tmp_path / "m", config)).layers] == ["full", "sliding"]


def test_kv_head_aliases_are_read_only_where_transformers_reads_them():
    from kvlab.sources import spec_from_config

    llama = {**HF, "num_key_value_heads": None, "num_kv_heads": 1}   # LlamaConfig ignores num_kv_heads: MHA
    assert {layer.n_kv_heads for layer in spec_from_config(llama).layers} == {4}
    falcon = {**HF, "model_type": "falcon", "num_key_value_heads": None, "num_kv_heads": 1}
    assert {layer.n_kv_heads for layer in spec_from_config(falcon).layers} == {1}


# -- the kernels: wrappers check every buffer, the library is verified, the planner never compiles -------
def test_kernel_wrappers_refuse_buffers_of_the_wrong_size():
    kernel = require_kernel()
    codes = torch.zeros(1, 2, 8, 64, dtype=torch.uint8)
    meta = torch.zeros(1, 2, 1, 64, dtype=torch.float16)
    q = torch.zeros(1, 2, 3, 64)
    value_meta = torch.zeros(1, 2, 8, 2, dtype=torch.float16)
    exact = torch.zeros(1, 2, 8, 64)                       # the 8 tokens' keys: the open group is all of them

    def attention(exact=exact, dv=64, T=3, n=8, q=q, bits=8, scales=meta, first_count=6):
        return kernel.int_attention(bits, codes, scales, meta, codes, value_meta, value_meta, n, dv, 32, exact, q, T,
                                    first_count, -n, 1.0)

    out, lse = attention()
    assert out.shape == (1, 2, 3, 64) and lse.shape == (1, 2, 3)
    bad = {
        "attention short of exact keys": lambda: attention(exact=exact[:, :, 4:]),
        "attention value heads of another width": lambda: attention(dv=32),
        "attention rows not whole tokens": lambda: attention(T=2),
        "attention of queries past the tokens": lambda: attention(first_count=9),
        "wider query": lambda: attention(q=torch.zeros(1, 2, 3, 128)),
        "query of another batch": lambda: attention(q=torch.zeros(2, 2, 3, 64)),
        "fp16 query": lambda: attention(q=q.half()),
        "n past the slots": lambda: attention(n=9),
        "short scales": lambda: attention(scales=meta[:, :, :0]),
        "int4 codes as int8": lambda: attention(bits=4),
        "gemv row too short": lambda: kernel.gemv("Q4_1", torch.zeros(4, 40, dtype=torch.uint8), torch.zeros(32)),
        "gemv blocks of int32": lambda: kernel.gemv("Q4_1", torch.zeros(4, 10, dtype=torch.int32), torch.zeros(64)),
        "gemv partial block": lambda: kernel.gemv("Q8_0", torch.zeros(4, 35, dtype=torch.uint8), torch.zeros(32)),
        "dequantize 3-D": lambda: kernel.dequantize("Q8_0", torch.zeros(2, 2, 34, dtype=torch.uint8)),
    }
    for name, call in bad.items():
        one_line_error(call, ConfigError)


@pytest.mark.parametrize("cache_name", ["int8", "int4"])
def test_integer_cache_given_a_wrongly_shaped_query(cache_name):
    require_kernel()
    geometry = CacheGeometry(n_layers=1, n_kv_heads=2, head_dim=64, capacity=64, n_heads=4)
    cache = make_cache(cache_name, geometry)
    k = torch.randn(1, 2, 40, 64)
    cache.append(0, k, k)
    assert cache.code_kernel is not None
    for q in (torch.randn(1, 4, 1, 128), torch.randn(1, 4, 1, 32)):
        one_line_error(lambda: cache.attend(0, q), ConfigError)


def test_fused_step_refuses_buffers_that_do_not_match_the_config(tiny_path):
    from kvlab.model.fused import FusedDecodeStep

    kernel = require_kernel()
    loaded = load_model(tiny_path)
    model = loaded.model
    down = model.blocks[1].ffn.down
    model.blocks[1].ffn.down = model.blocks[1].ffn.gate_up       # (2·d_ff, d) where (d, d_ff) belongs
    try:
        one_line_error(lambda: FusedDecodeStep(model, kernel.lib), ConfigError, "layer 1 ffn down")
    finally:
        model.blocks[1].ffn.down = down
    step = FusedDecodeStep(model, kernel.lib)
    cache = make_cache("dense", CacheGeometry.for_model(loaded.config, capacity=4))
    cache.k = cache.k[:, :, :, :2]                               # a cache whose buffers are smaller than its geometry
    with torch.no_grad():
        one_line_error(lambda: step(torch.tensor([[1]]), cache), ConfigError, "layer 0 keys")


@pytest.fixture
def fresh_kernel_state(monkeypatch, tmp_path):
    """A kernel cache folder of its own, and the loaded library forgotten before and after."""
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path / "cache"))
    kernels._loaded_kernel.cache_clear()
    yield tmp_path
    kernels._loaded_kernel.cache_clear()


def test_a_damaged_library_is_rebuilt_not_mapped(fresh_kernel_state):
    if not kernels.compiler_available():
        pytest.skip("no C compiler")
    target = kernels.library_path(kernels._compiler())
    target.parent.mkdir(parents=True)
    target.write_bytes(b"\x7fELF" + b"\0" * 60)                  # a truncated build: mapping it would SIGBUS
    assert kernels.block_kernel() is not None
    assert kernels.verified(target) and target.stat().st_size > 64


def test_an_unusable_cache_folder_builds_into_a_private_one(fresh_kernel_state, monkeypatch, capfd):
    if not kernels.compiler_available():
        pytest.skip("no C compiler")
    blocker = fresh_kernel_state / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(blocker / "cache"))  # mkdir fails whoever runs the test
    kernel = kernels.block_kernel()
    assert kernel is not None and not str(kernel.path).startswith(str(blocker))
    warnings = [line for line in capfd.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "unusable" in warnings[0] and str(kernel.path.parent) in warnings[0]


def test_plan_never_compiles(fresh_kernel_state, monkeypatch, smollm2):
    def no_build(*args):
        raise AssertionError("kvlab plan compiled the kernels")

    monkeypatch.setattr(kernels, "compile_library", no_build)
    plan = plan_json(make_plan(load_spec(str(smollm2.path)), rules_for("kvlab"), PlanSettings(context=64)))
    expected_native = kernels.compiler_available()
    assert (plan["weights_bytes"] == smollm2.weight_bytes) == (expected_native and smollm2.weights == "native")


# -- the planner's --engine kvlab bytes are the running cache's nbytes, for every test model -------------
def _running_nbytes(path, cache_name: str, context: int) -> int:
    loaded = load_model(path)
    cache = make_cache(cache_name, CacheGeometry.for_model(loaded.config, capacity=context))
    ids = torch.tensor([(loaded.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 8))[:context]])
    assert ids.shape[1] == context
    with torch.no_grad():
        loaded.model(ids, cache)
    return cache.nbytes


@pytest.mark.parametrize("cache_name", ["dense", "int4"])
def test_plan_bytes_equal_the_running_cache(tmp_path, tiny_path, smollm2, cache_name):
    config = {**HF, "model_type": "mistral", "sliding_window": 16, "vocab_size": smollm2.tokenizer.vocab_size}
    folder = write_hf(tmp_path / "mistral", config, hf_tensors(config))
    smollm2.tokenizer.backend.save(str(tmp_path / "mistral" / "tokenizer.json"))
    context = 40
    for path in (smollm2.path, tiny_path, folder):
        settings = PlanSettings(context=context, kv_type_k=cache_name)
        planned = plan_json(make_plan(load_spec(str(path)), rules_for("kvlab"), settings))["kv_bytes"]
        assert planned == _running_nbytes(path, cache_name, context), path
