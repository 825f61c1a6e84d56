"""The files the fuzzer mutates: the embedded SmolLM2 GGUF, and a tiny llama written here as a GGUF (Q4_1/Q8_0
matrices, so kvlab's native block kernels run) and as a Hugging Face folder (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json). Tiny files load in milliseconds: most fuzz cases use them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .formats import HFFolder, SafetensorsFile

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = ("h i",)  # "hi" is one token, as in SmolLM2: `generate hi` goes straight to the fused C decode step
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "<|im_start|>assistant\n")


@dataclass(frozen=True)
class TinyLlama:
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 128
    context: int = 128

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def byte_vocab() -> list[str]:
    """The 256 byte-level BPE symbols, the merged tokens, then the special tokens."""
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet()) + [m.replace(" ", "") for m in MERGES] + list(SPECIALS)


def tiny_matrices(cfg: TinyLlama, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Hugging Face names -> random fp32 weights (numpy layout: (out, in))."""
    rng = np.random.default_rng(seed)
    kv_dim = cfg.n_kv_heads * cfg.head_dim

    def w(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    out = {"model.embed_tokens.weight": w(vocab, cfg.d_model), "model.norm.weight": np.ones(cfg.d_model, np.float32)}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": np.ones(cfg.d_model, np.float32),
            p + "post_attention_layernorm.weight": np.ones(cfg.d_model, np.float32),
            p + "self_attn.q_proj.weight": w(cfg.d_model, cfg.d_model),
            p + "self_attn.k_proj.weight": w(kv_dim, cfg.d_model),
            p + "self_attn.v_proj.weight": w(kv_dim, cfg.d_model),
            p + "self_attn.o_proj.weight": w(cfg.d_model, cfg.d_model),
            p + "mlp.gate_proj.weight": w(cfg.d_ff, cfg.d_model),
            p + "mlp.up_proj.weight": w(cfg.d_ff, cfg.d_model),
            p + "mlp.down_proj.weight": w(cfg.d_model, cfg.d_ff),
        })
    return out


_GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module = rest.rsplit(".", 1)[0]
    return f"blk.{layer}.{_GGUF_NAMES[module]}.weight"


def write_tiny_gguf(path: Path, cfg: TinyLlama = TinyLlama()) -> Path:
    """A runnable tiny llama GGUF: embedding in Q8_0, layer matrices in Q4_1, norms in F32, tied output."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    tokens = byte_vocab()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("fuzz-tiny-llama")
    writer.add_context_length(cfg.context)
    writer.add_embedding_length(cfg.d_model)
    writer.add_block_count(cfg.n_layers)
    writer.add_feed_forward_length(cfg.d_ff)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.n_kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges(list(MERGES))
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, array in tiny_matrices(cfg, len(tokens)).items():
        if array.ndim == 1:
            writer.add_tensor(gguf_name(name), array)
            continue
        kind = Q.Q8_0 if name == "model.embed_tokens.weight" else Q.Q4_1
        writer.add_tensor(gguf_name(name), quantize(array, kind), raw_dtype=kind)  # byte rows of blocks
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_hf_folder(cfg: TinyLlama = TinyLlama()) -> HFFolder:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens = byte_vocab()
    merges = [tuple(m.split(" ")) for m in MERGES]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIALS))
    import json

    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "num_hidden_layers": cfg.n_layers, "vocab_size": len(tokens), "max_position_embeddings": cfg.context,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True, "torch_dtype": "float32",
        "bos_token_id": tokens.index("<|im_start|>"), "eos_token_id": tokens.index("<|im_end|>"),
    }
    tokenizer_config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}
    return HFFolder(
        json_files={"config.json": config, "tokenizer.json": json.loads(backend.to_str()),
                    "tokenizer_config.json": tokenizer_config},
        weights=SafetensorsFile.build(tiny_matrices(cfg, len(tokens))),
    )


def smollm2_path() -> Path:
    """The embedded SmolLM2-135M-Instruct GGUF, found the way kvlab finds it."""
    from ..model.loader import default_model_path

    return default_model_path()

