"""GGUF blocks kept as weights: the C kernel and BlockQuantLinear against gguf's own dequantizer, and
SmolLM2 with native weights against SmolLM2 with dequantized fp32 weights.

Tolerances. Dequantization is exact: d·q (+ m) of an fp16 scale and a 4- or 8-bit integer fits fp32's
24-bit mantissa, so the kernel, the torch fallback and gguf.quants.dequantize agree bit for bit. The GEMV
computes Σ_b d_b·(q_b·x_b) + m_b·Σx_b in fp32 in another order than Σ_j w_j·x_j, so each output may differ
from the float64 reference by a few fp32 roundings of the magnitudes it sums: we allow
2e-6 × Σ_j (|d_b q_j| + |m_b|)·|x_j| (≈ 16 ulps of that scale; the worst case over cols ≤ 1536 stays below).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from kvlab.errors import ConfigError, ModelFileError
from kvlab import kernels
from kvlab.model.blockquant import BlockMatrix, BlockQuantEmbedding, BlockQuantLinear, _dequantize_torch, split_rows
from .kernel_checks import require_kernel

TYPES = ["Q4_0", "Q4_1", "Q8_0"]
SHAPES = [(1, 32), (3, 64), (7, 96), (33, 576), (577, 1536)]  # odd row counts: not divisible by the thread count


def random_blocks(block_type: str, rows: int, cols: int, seed: int = 0):
    """Random blocks (rows, row_bytes) uint8 in kvlab's row layout (split_rows of GGUF rows) plus the per-weight
    |d·q| + |m| (rows, cols) for tolerances."""
    rng = np.random.default_rng(seed)
    n = rows * cols // 32
    d = rng.uniform(0.001, 0.05, n).astype(np.float16) * rng.choice([-1, 1], n).astype(np.float16)
    if block_type == "Q8_0":
        q = rng.integers(-128, 128, (n, 32)).astype(np.int8)
        blocks = np.concatenate([d.view(np.uint8).reshape(n, 2), q.view(np.uint8)], axis=1)
        scale = np.abs(d.astype(np.float32)[:, None] * q)
    else:
        q = rng.integers(0, 16, (n, 32)).astype(np.uint8)
        packed = q[:, :16] | (q[:, 16:] << 4)                       # byte j: weight j low, weight j + 16 high
        head = [d.view(np.uint8).reshape(n, 2)]
        if block_type == "Q4_1":
            m = rng.uniform(-0.4, 0.0, n).astype(np.float16)
            head.append(m.view(np.uint8).reshape(n, 2))
            scale = np.abs(d.astype(np.float32)[:, None] * q) + np.abs(m.astype(np.float32))[:, None]
        else:
            scale = np.abs(d.astype(np.float32)[:, None] * (q.astype(np.float32) - 8))
        blocks = np.concatenate([*head, packed], axis=1)
    data = split_rows(block_type, torch.from_numpy(np.ascontiguousarray(blocks.reshape(rows, -1))))
    return data, torch.from_numpy(scale.reshape(rows, cols).astype(np.float64))


def gguf_rows(block_type: str, data: torch.Tensor) -> np.ndarray:
    """kvlab's rows back to the file's: each block's d (and m) put back before its quants."""
    n = data.shape[1] // {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[block_type]
    head = 4 if block_type == "Q4_1" else 2
    rows = data.numpy().reshape(data.shape[0], -1)
    fields = [rows[:, 2 * f * n:2 * (f + 1) * n].reshape(-1, n, 2) for f in range(head // 2)]
    return np.concatenate([*fields, rows[:, head * n:].reshape(-1, n, (data.shape[1] - head * n) // max(n, 1))], axis=2)


def reference(block_type: str, data: torch.Tensor, cols: int) -> torch.Tensor:
    """gguf's own dequantizer on the file's bytes of these rows"""
    values = quants.dequantize(gguf_rows(block_type, data).reshape(data.shape[0], -1), GGMLQuantizationType[block_type])
    return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(data.shape[0], cols))


@pytest.mark.parametrize("block_type", TYPES)
def test_split_rows_puts_each_rows_scales_first(block_type):
    """Row of 3 blocks: [d0 d1 d2 | m0 m1 m2 (Q4_1) | quants0 quants1 quants2], the bytes of the file's row."""
    _, _, size = kernels.BLOCK_TYPES[block_type]
    head = 4 if block_type == "Q4_1" else 2
    file_row = torch.arange(3 * size, dtype=torch.uint8)[None, :]               # block b's bytes: b*size .. b*size+size-1
    row = split_rows(block_type, file_row)[0].tolist()
    blocks = [list(range(b * size, (b + 1) * size)) for b in range(3)]
    expected = sum((blk[0:2] for blk in blocks), [])
    if head == 4:
        expected += sum((blk[2:4] for blk in blocks), [])
    expected += sum((blk[head:] for blk in blocks), [])
    assert row == expected
    assert np.array_equal(gguf_rows(block_type, split_rows(block_type, file_row)).reshape(1, -1), file_row.numpy())


@pytest.fixture(scope="module")
def kernel():
    return require_kernel()


@pytest.mark.parametrize("block_type", TYPES)
@pytest.mark.parametrize("rows,cols", SHAPES)
def test_kernel_dequantize_is_exact(kernel, block_type, rows, cols):
    data, _ = random_blocks(block_type, rows, cols)
    expected = reference(block_type, data, cols)
    assert torch.equal(kernel.dequantize(block_type, data), expected)
    assert torch.equal(_dequantize_torch(block_type, data, cols), expected)


@pytest.mark.parametrize("block_type", TYPES)
@pytest.mark.parametrize("rows,cols", SHAPES)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_kernel_gemv_matches_dequantized_product(kernel, block_type, rows, cols, threads):
    data, scale = random_blocks(block_type, rows, cols, seed=rows)
    x = torch.randn(cols)
    w = reference(block_type, data, cols).double()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = kernel.gemv(block_type, data, x)
    finally:
        torch.set_num_threads(previous)
    exact = w @ x.double()
    bound = 2e-6 * (scale @ x.double().abs()) + 1e-30
    assert ((y.double() - exact).abs() <= bound).all()


def test_kernel_shares_torchs_openmp_runtime(kernel):
    """One OpenMP runtime in the process (torch's), and torch.set_num_threads sizes the kernel's regions."""
    runtimes = kernels.openmp_runtimes()
    assert len(runtimes) <= 1, runtimes
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert kernel.openmp_threads(torch.get_num_threads()) == 1
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("block_type", TYPES)
def test_block_quant_linear_equals_linear_on_dequantized_weight(block_type):
    data, scale = random_blocks(block_type, 45, 128, seed=3)
    bias = torch.randn(45)
    layer = BlockQuantLinear(BlockMatrix(block_type, data, 128), bias)
    w = reference(block_type, data, 128)
    one = torch.randn(1, 1, 128)
    many = torch.randn(2, 5, 128)
    many_diff = (layer(many).double() - F.linear(many.double(), w.double(), bias.double())).abs()   # multi-row: block GEMM
    assert (many_diff <= 2e-6 * (many.double().abs() @ scale.T) + 1e-6 * bias.abs().double() + 1e-7).all()
    bound = 2e-6 * (scale @ one.reshape(-1).double().abs()) + 1e-6 * bias.abs().double()
    diff = (layer(one).reshape(-1).double() - F.linear(one.double(), w.double(), bias.double()).reshape(-1)).abs()
    assert layer(one).shape == (1, 1, 45)
    assert (diff <= bound + 1e-7).all()


def test_block_quant_embedding_gathers_dequantized_rows():
    data, _ = random_blocks("Q8_0", 50, 64, seed=4)
    embed = BlockQuantEmbedding(BlockMatrix("Q8_0", data, 64))
    tokens = torch.tensor([[3, 49, 0], [7, 7, 1]])
    assert torch.equal(embed(tokens), F.embedding(tokens, reference("Q8_0", data, 64)))
    head = embed.as_linear()
    assert head.blocks.data_ptr() == embed.blocks.data_ptr()                          # tied: one buffer


def test_block_buffer_of_wrong_size_is_one_line_error():
    with pytest.raises(ModelFileError, match="does not hold rows") as err:
        BlockMatrix("Q4_1", torch.zeros(4, 19, dtype=torch.uint8), 32)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="block type"):
        BlockMatrix("Q6_K", torch.zeros(4, 210, dtype=torch.uint8), 256)


@pytest.fixture(scope="module")
def smollm2_dense():
    from kvlab.session import cached_model

    return cached_model(None, "fp32", "cpu", "dense")


@pytest.fixture(scope="module")
def smollm2_native(kernel):
    from kvlab.session import cached_model

    loaded = cached_model(None, "fp32", "cpu", "native")
    assert loaded.weights == "native"
    return loaded


def test_auto_weights_pick_native_for_the_gguf(smollm2, kernel):
    assert smollm2.weights == "native"


def test_native_weights_hold_the_files_block_bytes(smollm2_native, smollm2_dense):
    from kvlab.sources.gguf import open_gguf

    assert smollm2_native.weight_bytes == open_gguf(smollm2_native.path).tensor_bytes   # all blocks + fp32 norms
    assert smollm2_dense.weight_bytes == 134_515_008 * 4


def test_native_logits_equal_dense_logits(smollm2_native, smollm2_dense):
    """Same weight values, other summation orders: prefill (the block GEMM) and one-row steps (the GEMV) give
    logits (magnitude ~35) within 1e-4 over 30 layers, and the same argmax."""
    from kvlab.cache import CacheGeometry, make_cache

    ids = torch.tensor([smollm2_dense.tokenizer.encode("The capital of France is")])
    outputs = []
    for loaded in (smollm2_native, smollm2_dense):
        cache = make_cache("dense", CacheGeometry.for_model(loaded.config, capacity=ids.shape[1] + 4))
        with torch.no_grad():
            prefill = loaded.model(ids, cache)
            step = loaded.model(ids[:, -1:], cache)
        outputs.append((prefill, step))
    (native_prefill, native_step), (dense_prefill, dense_step) = outputs
    assert (native_prefill - dense_prefill).abs().max().item() < 1e-4
    assert torch.equal(native_prefill.argmax(-1), dense_prefill.argmax(-1))
    assert (native_step - dense_step).abs().max().item() < 1e-4
    assert torch.equal(native_step.argmax(-1), dense_step.argmax(-1))


def test_native_greedy_64_tokens_identical_to_dense(smollm2_native, smollm2_dense):
    from kvlab.cache import CacheGeometry, make_cache
    from kvlab.generate import generate

    ids = torch.tensor([smollm2_dense.tokenizer.encode("Once upon a time, in a small village,")])
    tokens = []
    for loaded in (smollm2_native, smollm2_dense):
        cache = make_cache("dense", CacheGeometry.for_model(loaded.config, capacity=ids.shape[1] + 64))
        tokens.append(generate(loaded.model, ids, cache, 64).token_ids[0])
    assert tokens[0] == tokens[1]


def test_no_compiler_falls_back_to_dense_weights(monkeypatch, tmp_path):
    """A failing build: the kernel is None with a reason, auto picks dense, native still runs (torch path)."""
    from kvlab.model.loader import resolve_weights

    def broken(compiler, target):
        raise OSError("cc failed: simulated")

    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "compile_library", broken)
    kernels._loaded_kernel.cache_clear()
    try:
        assert kernels.block_kernel() is None
        assert "simulated" in kernels.kernel_status()
        from kvlab.model.loader import default_model_path

        assert resolve_weights("auto", default_model_path(), torch.float32, "cpu") == "dense"
        data, _ = random_blocks("Q4_1", 9, 64)
        layer = BlockQuantLinear(BlockMatrix("Q4_1", data, 64))
        x = torch.randn(1, 64)
        expected = F.linear(x, reference("Q4_1", data, 64))
        assert torch.equal(layer(x), expected)                                        # no kernel: dequantize + F.linear
    finally:
        kernels._loaded_kernel.cache_clear()


def test_scalar_and_avx2_builds_agree_with_native_build(kernel):
    """CI machines may lack AVX-512: the AVX2 and plain-C versions of the kernel give the same results."""
    import ctypes

    from .kernel_checks import library_variant

    data, scale = random_blocks("Q4_1", 37, 256, seed=9)
    x = torch.randn(256)
    exact = reference("Q4_1", data, 256).double() @ x.double()
    for variant in ("avx2", "plain"):
        target = library_variant(variant)
        other = kernels.BlockKernel(ctypes.CDLL(str(target)), target)
        for block_type in TYPES:
            blocks, _ = random_blocks(block_type, 37, 256, seed=9)
            assert torch.equal(other.dequantize(block_type, blocks), kernel.dequantize(block_type, blocks))
        assert ((other.gemv("Q4_1", data, x).double() - exact).abs() <= 2e-6 * (scale @ x.double().abs())).all()
        # every fp16 bit pattern as a Q8_0 scale (q = 1): the plain-C fp16 conversion is exact, subnormals included
        h = np.arange(65536, dtype=np.uint16)
        blocks = np.zeros((65536, 34), np.uint8)
        blocks[:, :2] = h.view(np.uint8).reshape(-1, 2)
        blocks[:, 2] = 1
        got = other.dequantize("Q8_0", torch.from_numpy(blocks))[:, 0].numpy()
        want = h.view(np.float16).astype(np.float32)
        assert ((got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))).all()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_native_weights_on_a_quantized_tiny_gguf(tmp_path, smollm2, kernel, monkeypatch, arch):
    """A tiny GGUF whose matrices are Q4_1 (embedding and untied output Q8_0): llama permutes Q/K rows,
    qwen2 adds q/k/v biases. Native and dense loads agree: prefill exactly, a one-row step within fp32 rounding."""
    import gguf
    import transformers

    from kvlab.cache import CacheGeometry, make_cache
    from kvlab.model.loader import load_model
    from kvlab.sources.gguf import gguf_metadata, open_gguf
    from tests.test_gguf_archs import ARCHS, write_gguf

    add_tensor = gguf.GGUFWriter.add_tensor

    def add_quantized(self, name, tensor, *args, **kwargs):
        if tensor.ndim == 2 and tensor.shape[1] % 32 == 0:
            qtype = GGMLQuantizationType.Q8_0 if name in ("token_embd.weight", "output.weight") else GGMLQuantizationType.Q4_1
            return add_tensor(self, name, quants.quantize(tensor, qtype), raw_dtype=qtype)
        return add_tensor(self, name, tensor, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", add_quantized)
    meta = gguf_metadata(open_gguf(smollm2.path))
    config_cls, model_cls, extra = ARCHS[arch]
    config = getattr(transformers, config_cls)(
        vocab_size=len(meta["tokenizer.ggml.tokens"]), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, **extra,
    )
    torch.manual_seed(2)
    path = tmp_path / f"tiny-{arch}-q.gguf"
    write_gguf(path, arch, getattr(transformers, model_cls)(config).eval(), meta)
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path / "cache"))  # the dense load's conversion goes here

    native, dense = load_model(path, weights="native"), load_model(path, weights="dense")
    assert native.weights == "native" and native.weight_bytes == open_gguf(path).tensor_bytes
    assert isinstance(native.model.lm_head, BlockQuantLinear) and native.model.lm_head.block_type == "Q8_0"
    ids = torch.tensor([native.tokenizer.encode("Rotary embeddings, pairwise or by halves?")])
    outs = []
    for loaded in (native, dense):
        cache = make_cache("dense", CacheGeometry.for_model(loaded.config, capacity=ids.shape[1] + 1))
        with torch.no_grad():
            outs.append((loaded.model(ids, cache), loaded.model(ids[:, -1:], cache)))
    for got, want in zip(outs[0], outs[1]):                    # the prompt (block GEMM rows), then one decode row (GEMV)
        assert (got - want).abs().max().item() < 1e-5 * want.abs().max().item() + 1e-6


def test_the_native_rule_names_the_kernels_block_types():
    from kvlab.kernels import BLOCK_TYPES
    from kvlab.sources.native import BLOCK_TYPE_NAMES

    assert set(BLOCK_TYPE_NAMES) == set(BLOCK_TYPES)
