"""The block GEMM kernel (kernels/blockgemm.c): Y = X Wᵀ for several rows straight from GGUF blocks, against
the reference it replaces (dequantize the whole matrix, then multiply), and BlockQuantLinear's multi-row path.

Tolerance. The GEMM multiplies the exact dequantized weights in fp32, summing each output over k in order;
the reference sums in another order. Both are within a few fp32 roundings of the float64 product, so each
output may differ from it by at most 1e-5 × Σ_k |x_k|·|w_k| (K ≤ 1536 roundings of 6e-8 stay far below): the
relative 1e-4 of the brief, measured against the magnitudes summed so that cancellation cannot hide an error.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from kvlab import kernels
from kvlab.errors import ConfigError
from kvlab.model.blockquant import BlockMatrix, BlockQuantLinear
from .kernel_checks import library_variant
from .test_blockquant import TYPES, random_blocks, reference

ROWS = [1, 2, 7, 12, 33, 256]  # rows of X: < 8 take the GEMV's row dots; then odd, 8 + 4, panels plus one, many
SHAPES = [(1, 32), (33, 96), (77, 576), (9, 1536)]  # (N odd: weight rows, K: columns, multiple of 32)


@pytest.fixture(scope="module")
def kernel():
    k = kernels.block_kernel()
    if k is None:
        pytest.skip(f"no block kernel here: {kernels.kernel_status()}")
    return k


def assert_close_to_reference(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y (M, N) fp32 against x (M, K) @ w (N, K)ᵀ in float64, within 1e-5 of Σ|x||w| per output."""
    exact = x.double() @ w.double().T
    bound = 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-30
    assert y.shape == exact.shape
    assert ((y.double() - exact).abs() <= bound).all(), float(((y.double() - exact).abs() / bound).max())


@pytest.mark.parametrize("block_type", TYPES)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", ROWS)
def test_gemm_equals_dequantized_product(kernel, block_type, m, n, k):
    data, _ = random_blocks(block_type, n, k, seed=m * n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    w = reference(block_type, data, k)
    y = kernel.gemm(block_type, data, x)
    assert_close_to_reference(y, x, w)
    torch.testing.assert_close(y, x @ w.T, rtol=1e-4, atol=1e-4 * float((x.abs() @ w.abs().T).max()))  # the fp32 path


@pytest.mark.parametrize("block_type", TYPES)
def test_one_row_equals_the_gemv_bit_for_bit(kernel, block_type):
    """A single row through the GEMM entry point is the GEMV's row dot, exactly."""
    data, _ = random_blocks(block_type, 77, 576, seed=8)
    x = torch.randn(1, 576)
    assert torch.equal(kernel.gemm(block_type, data, x)[0], kernel.gemv(block_type, data, x[0].contiguous()))


@pytest.mark.parametrize("block_type", TYPES)
@pytest.mark.parametrize("k", [576, 1536])
def test_one_w_row_against_two_groups_sums_as_the_pair_kernel(kernel, block_type, k):
    """More than 8 rows with K <= 640 take one W row against two groups of 8 (row_kernel), otherwise W row pairs
    against one group: every output is the same sum in the same order, so a row's outputs do not depend on how
    many rows are multiplied with it (K = 1536: the pair kernel throughout)."""
    data, _ = random_blocks(block_type, 77, k, seed=k)
    x = torch.randn(13, k, generator=torch.Generator().manual_seed(2))
    together = kernel.gemm(block_type, data, x)                                 # (13, 77): 8 + 5 rows
    apart = torch.cat([kernel.gemm(block_type, data, x[:8]), kernel.gemm(block_type, data, x[8:12]),
                       kernel.gemm(block_type, data, x[11:])[1:]])              # groups of 8, 4 and 2 rows
    assert torch.equal(together, apart)


@pytest.mark.parametrize("block_type", TYPES)
@pytest.mark.parametrize("m", [3, 97])
def test_gemm_is_bit_identical_for_any_thread_count(kernel, block_type, m):
    """Each output is the same sum whichever thread computes its tile: 1, 2 and 3 threads agree bit for bit."""
    data, _ = random_blocks(block_type, 203, 576, seed=5)    # 102 row pairs, the last one single: uneven splits
    x = torch.randn(m, 576)
    previous = torch.get_num_threads()
    try:
        outputs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outputs.append(kernel.gemm(block_type, data, x))
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])


def test_gemm_writes_into_a_given_output_and_handles_empty_inputs(kernel):
    data, _ = random_blocks("Q8_0", 5, 64)
    x = torch.randn(3, 64)
    out = torch.full((3, 5), float("nan"))
    assert kernel.gemm("Q8_0", data, x, out=out) is out
    assert_close_to_reference(out, x, reference("Q8_0", data, 64))
    assert kernel.gemm("Q8_0", data, torch.empty(0, 64)).shape == (0, 5)


def test_gemm_bad_arguments_are_one_line_errors(kernel):
    data, _ = random_blocks("Q4_1", 6, 64)
    x = torch.randn(4, 64)
    bad_calls = {
        "unknown block type": lambda: kernel.gemm("Q6_K", data, x),
        "uint8": lambda: kernel.gemm("Q4_1", data.to(torch.int16), x),
        "blocks not 2-D": lambda: kernel.gemm("Q4_1", data.reshape(-1), x),
        "blocks not contiguous": lambda: kernel.gemm("Q4_1", data[:, :20], x),
        "row bytes not whole blocks": lambda: kernel.gemm("Q4_1", data[:, :30].contiguous(), x),
        "fp64 input": lambda: kernel.gemm("Q4_1", data, x.double()),
        "input of the wrong width": lambda: kernel.gemm("Q4_1", data, torch.randn(4, 96)),
        "input not 2-D": lambda: kernel.gemm("Q4_1", data, x.reshape(2, 2, 64)),
        "input not contiguous": lambda: kernel.gemm("Q4_1", data, torch.randn(64, 4).T),
        "output of the wrong shape": lambda: kernel.gemm("Q4_1", data, x, out=torch.empty(4, 7)),
        "output of the wrong dtype": lambda: kernel.gemm("Q4_1", data, x, out=torch.empty(4, 6, dtype=torch.float64)),
        "output not contiguous": lambda: kernel.gemm("Q4_1", data, x, out=torch.empty(6, 4).T),
    }
    for what, call in bad_calls.items():
        with pytest.raises(ConfigError) as err:
            call()
        assert "\n" not in str(err.value), what


@pytest.mark.parametrize("block_type", TYPES)
def test_block_quant_linear_several_rows_use_the_gemm(kernel, block_type, monkeypatch):
    """(B, T, C) inputs with a bias: the GEMM path equals the dequantize + F.linear reference (KVLAB_NO_GEMM=1),
    which stays exact; one row still takes the GEMV."""
    data, _ = random_blocks(block_type, 45, 128, seed=3)
    bias = torch.randn(45)
    layer = BlockQuantLinear(BlockMatrix(block_type, data, 128), bias)
    w = reference(block_type, data, 128)
    many = torch.randn(2, 5, 128)
    y = layer(many)
    assert y.shape == (2, 5, 45)
    assert_close_to_reference((y - bias).reshape(10, 45), many.reshape(10, 128), w)
    monkeypatch.setenv("KVLAB_NO_GEMM", "1")
    assert torch.equal(layer(many), F.linear(many, w, bias))
    one = torch.randn(1, 1, 128)
    assert torch.equal(layer(one), kernel.gemv(block_type, data, one.reshape(-1)).view(1, 1, 45) + bias)


def test_block_quant_linear_takes_torch_gemm_beyond_the_crossover(kernel):
    """Past GEMM_MAX_ROWS rows (prompt chunks) the layer dequantizes and uses F.linear: exactly the reference."""
    from kvlab.model.blockquant import GEMM_MAX_ROWS

    data, _ = random_blocks("Q4_1", 40, 64, seed=4)
    layer = BlockQuantLinear(BlockMatrix("Q4_1", data, 64))
    w = reference("Q4_1", data, 64)
    x = torch.randn(1, GEMM_MAX_ROWS + 1, 64)
    assert torch.equal(layer(x), F.linear(x, w))
    batch = x[:, :GEMM_MAX_ROWS]                                   # at the crossover: still the block GEMM
    assert torch.equal(layer(batch).reshape(GEMM_MAX_ROWS, 40), kernel.gemm("Q4_1", data, batch.reshape(GEMM_MAX_ROWS, 64).contiguous()))


def test_native_prefill_logits_match_the_dequantize_path(smollm2, kernel, monkeypatch):
    """SmolLM2's prompt through the GEMM and through dequantize + F.linear: logits within 1e-4, same argmax."""
    from kvlab.cache import CacheGeometry, make_cache

    ids = torch.tensor([smollm2.tokenizer.encode("The quick brown fox jumps over the lazy dog, and then it")])
    logits = []
    for no_gemm in ("", "1"):
        monkeypatch.setenv("KVLAB_NO_GEMM", no_gemm)
        cache = make_cache("dense", CacheGeometry.for_model(smollm2.config, capacity=ids.shape[1]))
        with torch.inference_mode():
            logits.append(smollm2.model(ids, cache))
    assert (logits[0] - logits[1]).abs().max().item() < 1e-4
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))


@pytest.mark.parametrize("variant", ["avx2", "plain"])
def test_avx2_and_plain_c_builds_compute_the_same_gemm(kernel, variant):
    """CI machines may lack AVX-512: the AVX2 and plain-C micro-kernels sum in the same k order, so they
    agree with the reference as closely (not bit for bit: only AVX-512 and AVX2 are sure to fuse multiply-adds)."""
    target = library_variant(variant)
    other = kernels.BlockKernel(ctypes.CDLL(str(target)), target)
    for block_type in TYPES:
        data, _ = random_blocks(block_type, 41, 320, seed=11)
        x = torch.randn(35, 320)
        assert_close_to_reference(other.gemm(block_type, data, x), x, reference(block_type, data, 320))
