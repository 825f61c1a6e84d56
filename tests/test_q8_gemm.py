"""Int8 activations x GGUF blocks (kernels/q8gemm.c) against the torch reference (kvlab.model.int8act).

What is exact and what is not:
- The activation quantization (codes, scales, code sums) is the same bits in C and torch.
- Each block's product is an exact integer dot, so the kernel's only rounding is its fp32 sum over the blocks:
  it stays within blocks × 2^-24 × Σ_b |term_b| of the float64 sum of the same terms (`assert_close_to_reference`),
  and is exactly the integer when every scale is 1. Every build variant (AVX-512 VNNI, AVX-512BW, AVX2, plain C)
  and every thread count gives the same bits.
- Against the fp32 model the result is not close to 1e-4: each activation is rounded to a step of
  max|x_block| / 127, so SmolLM2's logits move by a few percent of their range (test_int8_model_*).
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvlab import kernels
from kvlab.errors import ConfigError
from kvlab.kernels.q8gemm import Q8Kernel, q8_kernel_for
from kvlab.model import blockquant, int8act
from kvlab.model.blockquant import BlockMatrix, BlockQuantLinear, block_fields, set_activations

from .kernel_checks import MARCH, build_variant, one_thread, require_kernel  # noqa: F401  (one_thread: autouse)
from .test_blockquant import TYPES, random_blocks

#: each build variant of q8gemm.c: its -march flags and the CPU flag it needs to run here
VARIANT_FLAGS = {"avx512-vnni": (["-march=x86-64-v4", "-mavx512vnni"], "avx512_vnni"), "avx512": ([MARCH["avx512"]], "avx512bw"),
                 "avx2": ([MARCH["avx2"]], "avx2"), "plain": ([MARCH["plain"]], "")}
#: (M rows of X, N weight rows, K columns): a few rows (row dots), a group less one / exactly / plus one, two groups plus a tail
SHAPES = [(1, 1, 32), (2, 3, 64), (3, 40, 1536), (15, 33, 96), (16, 8, 576), (17, 77, 128), (40, 9, 1536), (70, 64, 320)]


@pytest.fixture(scope="module")
def q8() -> Q8Kernel:
    require_kernel()
    return q8_kernel_for(torch.device("cpu"))



@pytest.fixture(scope="module", params=list(VARIANT_FLAGS))
def variant(request, tmp_path_factory) -> Q8Kernel:
    """q8gemm.c built alone for one instruction set (skipped only where that build cannot run here)."""
    name = request.param
    march, needs = VARIANT_FLAGS[name]
    target = build_variant("q8gemm.c", name, march, needs, tmp_path_factory.mktemp("q8gemm"))
    kernel = Q8Kernel(ctypes.CDLL(str(target)), target)
    assert kernel.variant == name
    return kernel


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows of mixed magnitudes (as hidden states are), with an all-zero and a tiny block where there is room."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen).mul(8).exp2()   # (M, K)
    if k >= 96:
        x[0, 32:64] = 0.0
        x[-1, 64:96] *= 1e-36
    return x


FEW_ROWS = 4   # q8gemm.c Q8_FEW_ROWS: below it, every output is one row dot


def row_dot_magnitudes(block_type: str, data: torch.Tensor, k: int, x: torch.Tensor) -> torch.Tensor:
    """(M, N) float64: the scale of the row dot's fp32 sums. It adds each block's eight lane sums (codes of the
    unsigned operand: Q4 nibbles as they are, Q8_0's signed codes) times d_w·d_a, and beside them m·(d_a·s) (Q4_0: m =
    -8 d_w), so its rounding is measured against Σ_b |d_w·d_a| Σ_c |w_c·a_c| + |m_b·d_a·s_b|, not the net terms."""
    codes, scales, sums = int8act.quantize_rows(x)
    w, d_w, m_w = block_fields(block_type, data, k)                                      # (N, B, 32), (N, B)
    w = w + 8 if block_type == "Q4_0" else w
    a = codes.reshape(codes.shape[0], k // 32, 32).double().abs()                       # (M, B, 32)
    lanes = torch.einsum("mbc,nbc->mnb", a, w.double().abs())                           # (M, N, B)
    scale = (d_w[None] * scales[:, None]).double().abs()                                # (M, N, B)
    total = (lanes * scale).sum(-1)
    m = m_w if block_type == "Q4_1" else -8 * d_w if block_type == "Q4_0" else None
    if m is not None:
        total += (m[None].double() * (scales * sums.float())[:, None].double()).abs().sum(-1)
    return total


def assert_close_to_reference(y: torch.Tensor, block_type: str, data: torch.Tensor, x: torch.Tensor) -> None:
    """Within the fp32 summation's rounding of the exact sum: the packed kernel rounds once per block, the row dots
    of a few rows once per block in each of eight lanes, then over the lanes."""
    k = x.shape[1]
    exact = int8act.int8_linear_reference(block_type, data, k, x)                       # (M, N) float64
    if x.shape[0] < FEW_ROWS:
        bound = (k // 32 + 8) * 2.0 ** -24 * row_dot_magnitudes(block_type, data, k, x) + 1e-30
    else:
        bound = (k // 32) * 2.0 ** -24 * int8act.term_magnitudes(block_type, data, k, x) + 1e-30
    assert y.shape == exact.shape
    err = (y.double() - exact).abs()
    assert (err <= bound).all(), float((err / bound).max())


# -- the activation quantization ---------------------------------------------------------------------------
def test_quantize_equals_the_torch_reference_bit_for_bit(q8):
    x = activations(37, 320, seed=1)
    x[3, :32] = (torch.arange(-16, 16) + 0.5) / 8              # with amax 127/8 (127/amax = 8): x · 8 = k + 0.5, ties
    x[3, 16] = 127 / 8
    x[4, 32:64] = float("inf")
    x[5, 0] = float("nan")
    codes, scales, sums = q8.quantize(x)
    ref = int8act.quantize_rows(x)
    for got, want in zip((codes, scales, sums), ref):
        assert torch.equal(got, want) or torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert codes[3, :4].tolist() == [-16, -14, -14, -12]                                  # ties to even
    assert codes.abs().max() <= 127 and torch.equal(sums, codes.reshape(37, 10, 32).sum(-1, dtype=torch.int32))
    assert scales[4, 1].isnan() and scales[5, 0].isnan() and not codes[4, 32:64].any()
    assert scales[0, 1] == 0 and scales[-1, 2] == 0                                       # zero and tiny blocks
    live = scales.isfinite() & (scales > 0)
    deq = (codes.reshape(37, 10, 32).float() * scales[..., None]).reshape(37, 320)
    step = scales.repeat_interleave(32, dim=1)
    assert ((deq - x).abs() <= step / 2 * 1.0001)[live.repeat_interleave(32, dim=1)].all()   # ≤ half a step


def test_variants_quantize_alike(variant, q8):
    x = activations(19, 96, seed=2)
    for got, want in zip(variant.quantize(x), q8.quantize(x)):
        assert torch.equal(got, want)


# -- the product ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_type", TYPES)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_gemm_equals_the_reference(q8, block_type, m, n, k):
    data, _ = random_blocks(block_type, n, k, seed=m + n + k)
    x = activations(m, k, seed=m * k)
    assert_close_to_reference(q8.gemm(block_type, data, x), block_type, data, x)


@pytest.mark.parametrize("block_type", TYPES)
def test_integer_part_is_exact(q8, block_type):
    """Unit scales (d_w = 1, every activation block's amax = 127) leave only the integer dots: equal exactly."""
    data, _ = random_blocks(block_type, 21, 256, seed=5)                                # 8 blocks a row, scales first
    data[:, 0:16].view(torch.float16)[:] = 1.0                                          # d_w = 1
    if block_type == "Q4_1":
        data[:, 16:32] = 0                                                              # m_w = 0
    gen = torch.Generator().manual_seed(6)
    x = torch.randint(-127, 128, (35, 256), generator=gen).float()
    x.view(35, 8, 32)[..., 0] = 127.0                                                   # amax 127: d_a = 1, codes = x
    codes = int8act.quantize_rows(x)[0]
    assert torch.equal(codes.float(), x)
    exact = int8act.integer_dots(block_type, data, 256, codes).sum(-1)                  # (M, N) int64
    assert torch.equal(q8.gemm(block_type, data, x), exact.float())
    assert torch.equal(q8.gemm(block_type, data, x[:FEW_ROWS - 1]), exact[:FEW_ROWS - 1].float())   # the row dots


@pytest.mark.parametrize("block_type", TYPES)
def test_every_variant_gives_the_same_bits(variant, q8, block_type):
    for m, n, k in [(1, 9, 576), (3, 5, 96), (5, 7, 64), (33, 20, 320)]:
        data, _ = random_blocks(block_type, n, k, seed=m)
        x = activations(m, k, seed=k)
        assert torch.equal(variant.gemm(block_type, data, x), q8.gemm(block_type, data, x))


@pytest.mark.parametrize("block_type", TYPES)
def test_thread_count_does_not_change_the_result(q8, block_type):
    data, _ = random_blocks(block_type, 99, 576, seed=7)
    for x in (activations(40, 576, seed=8), activations(1, 576, seed=9)):
        torch.set_num_threads(1)
        one = q8.gemm(block_type, data, x)
        torch.set_num_threads(2)
        assert torch.equal(q8.gemm(block_type, data, x), one)


def test_non_finite_activations_give_nan_rows_only(q8):
    data, _ = random_blocks("Q4_1", 12, 128, seed=9)
    x = activations(20, 128, seed=10)
    clean = q8.gemm("Q4_1", data, x)
    x[7, 40] = float("inf")
    y = q8.gemm("Q4_1", data, x)
    assert y[7].isnan().all()
    assert torch.equal(torch.cat([y[:7], y[8:]]), torch.cat([clean[:7], clean[8:]]))
    few = q8.gemm("Q4_1", data, x[6:9])                                                 # the row dots
    assert few[1].isnan().all() and not few[0].isnan().any() and not few[2].isnan().any()


def test_bad_buffers_are_one_line_errors(q8):
    data, _ = random_blocks("Q4_0", 4, 64, seed=0)
    for args in [("Q5_0", data, torch.zeros(2, 64)), ("Q4_0", data, torch.zeros(2, 32)),
                 ("Q4_0", data, torch.zeros(2, 64, dtype=torch.float64)), ("Q4_0", data, torch.zeros(64)),
                 ("Q4_0", data, torch.zeros(64, 2).T), ("Q4_0", data[:, :17], torch.zeros(2, 64))]:
        with pytest.raises(ConfigError) as err:
            q8.gemm(*args)
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError):
        q8.quantize(torch.zeros(3, 40))


# -- the layer and the model -------------------------------------------------------------------------------------
def test_layer_uses_int8_activations_only_when_asked(q8):
    data, _ = random_blocks("Q4_1", 45, 128, seed=11)
    layer = BlockQuantLinear(BlockMatrix("Q4_1", data, 128), bias=torch.randn(45))
    x = activations(20, 128, seed=12).view(2, 10, 128)
    fp32 = layer(x)
    layer.activations = "int8"
    assert torch.equal(layer(x), q8.gemm("Q4_1", data, x.reshape(20, 128)).view(2, 10, 45) + layer.bias)
    one = x[:1, :1]                                                                    # a decode token: int8 too
    assert torch.equal(layer(one), q8.gemm("Q4_1", data, one.reshape(1, 128)).view(1, 1, 45) + layer.bias)
    assert not torch.equal(layer(x), fp32)
    layer.activations = "fp32"
    assert torch.equal(layer(x), fp32)
    with pytest.raises(ConfigError):
        BlockQuantLinear(BlockMatrix("Q4_1", data, 128), activations="int4")


def _logits(loaded, ids: torch.Tensor) -> torch.Tensor:
    from kvlab.cache import CacheGeometry, make_cache

    cache = make_cache("dense", CacheGeometry.for_model(loaded.config, capacity=ids.shape[1]))
    with torch.inference_mode():
        return loaded.model(ids, cache)                                                # (1, T, vocab)


@pytest.fixture
def int8_smollm2(smollm2, q8):
    """The shared SmolLM2 fixture with int8 activations for this test only."""
    set_activations(smollm2.model, "int8")
    yield smollm2
    set_activations(smollm2.model, "fp32")


def test_int8_model_logits_stay_close_to_fp32(smollm2, int8_smollm2):
    """A 25-token prompt: per position the logits move by < 10 % of their largest magnitude, the mean KL
    divergence stays < 0.02 nats and the top token agrees at ≥ 90 % of the positions (measured: 4.8 %, 0.006,
    96 %). Activation rounding, not an error: each hidden-state block is rounded to steps of max|x| / 127."""
    text = "The quick brown fox jumps over the lazy dog, and then it runs into the forest where the old king lives"
    ids = torch.tensor([smollm2.tokenizer.encode(text)])
    set_activations(smollm2.model, "fp32")
    fp32 = _logits(smollm2, ids)[0]                                                    # (T, vocab)
    set_activations(smollm2.model, "int8")
    int8 = _logits(smollm2, ids)[0]
    assert ((int8 - fp32).abs().amax(-1) < 0.1 * fp32.abs().amax(-1)).all()
    logp, logq = fp32.log_softmax(-1), int8.log_softmax(-1)
    assert (logp.exp() * (logp - logq)).sum(-1).mean() < 0.02
    assert (int8.argmax(-1) == fp32.argmax(-1)).float().mean() >= 0.9


def test_int8_model_greedy_text_is_sensible(int8_smollm2):
    """Greedy by full recompute (every matrix product takes int8 activations)."""
    ids = torch.tensor([int8_smollm2.tokenizer.encode("The capital of France is")])
    for _ in range(4):
        ids = torch.cat([ids, _logits(int8_smollm2, ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert "Paris" in int8_smollm2.tokenizer.decode(ids[0].tolist())


def test_loader_native_q8_weights(smollm2):
    from kvlab.model.loader import load_model, resolve_weights

    assert resolve_weights("native-q8", smollm2.path, torch.float32, "cpu") == "native-q8"
    with pytest.raises(ConfigError):
        resolve_weights("native-q8", smollm2.path, torch.bfloat16, "cpu")
    loaded = load_model(smollm2.path, weights="native-q8")
    layers = [m for m in loaded.model.modules() if isinstance(m, BlockQuantLinear)]
    assert loaded.weights == "native-q8" and layers and all(m.activations == "int8" for m in layers)
    assert all(m.activations == "fp32" for m in smollm2.model.modules() if isinstance(m, BlockQuantLinear))
