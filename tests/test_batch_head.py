"""The engine's sampled rows through the fused head (kernels/batchstep.c kvlab_batch_head) equal the modules' head.

FusedBatchStep.head runs the final norm, the output head and each row's argmax in one C call; the model's logits()
(the modules: RMSNorm, then the head's Linear / BlockQuantLinear) is its reference. The head's product is the
module's own kernel, so the logits differ only by the C norm's rounding (fp32 heads: also the dot order): within
1e-5 of the largest logit; with int8 activations an activation an ulp apart may round to a neighbouring code:
within 5e-3. The argmax equals torch.argmax exactly (ties, nan, -inf, every tail length), and switching the fused
step off routes the head through the modules again.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvlab.errors import ConfigError
from kvlab.model.blockquant import set_activations
from kvlab.model.fused import fused_decode_step
from kvlab.serve import Engine, SamplingParams
from kvlab.serve.fused_batch import FusedBatchStep, fused_batch_for, fused_batch_off

from .conftest import tiny_model
from .kernel_checks import one_thread, require_kernel  # noqa: F401  (one_thread: autouse)
from .test_fused_batch import fused_model, prompts_of
from .test_fused_decode import quantize_matrices


@pytest.fixture(scope="module", autouse=True)
def kernel():
    return require_kernel()


def step_of(model) -> FusedBatchStep:
    with torch.inference_mode():                                              # autograd on: the modules
        step = fused_batch_for(Engine(model, kv_budget="1MiB", block_size=4).runner, 1)
    assert isinstance(step, FusedBatchStep)
    return step


def assert_head_equals_modules(model, rows: int, rel: float, seed: int = 0) -> None:
    x = torch.randn(rows, model.config.d_model, generator=torch.Generator().manual_seed(seed)) * 3   # (R, C)
    with torch.inference_mode():
        logits, tokens = step_of(model).head(x)
        want = model.logits(x[None])[0]                                                 # (R, vocab)
    assert logits.shape == want.shape and tokens.shape == (rows,)
    assert (logits - want).abs().max().item() <= rel * want.abs().max().item() + 1e-6, f"{rows} rows"
    assert torch.equal(tokens, logits.argmax(dim=-1))


@pytest.mark.parametrize("tied", [True, False])
def test_fp32_head_equals_the_modules(tied):
    model = fused_model(tie_embeddings=tied)
    for rows in (1, 3, 16):
        assert_head_equals_modules(model, rows, rel=1e-6)


@pytest.mark.parametrize("block_type", ["Q4_0", "Q4_1", "Q8_0"])
def test_block_head_equals_the_modules(block_type):
    """A head of GGUF blocks: the GEMV (1 row), the block GEMM, and with int8 activations q8gemm.c (its row dots for a
    few rows, its packed kernel for more)."""
    model = tiny_model(n_heads=4, n_kv_heads=2, d_model=64, d_ff=544, tie_embeddings=False)
    quantize_matrices(model, block_type)
    model.fused = fused_decode_step(model)
    for rows in (1, 5, 8, 19):
        assert_head_equals_modules(model, rows, rel=1e-6)
    set_activations(model, "int8")
    for rows in (1, 3, 4, 8, 19):
        assert_head_equals_modules(model, rows, rel=5e-3)


def test_smollm2_head_equals_the_modules(smollm2):
    """The real tied head: 49,152 rows of Q8_0 blocks, fp32 and int8 activations."""
    model = smollm2.model
    assert_head_equals_modules(model, 16, rel=1e-6)
    before = model.lm_head.activations
    try:
        set_activations(model, "int8")
        assert_head_equals_modules(model, 16, rel=5e-3)
    finally:
        set_activations(model, before)


def test_argmax_equals_torch():
    step = step_of(fused_model())
    nan, inf = float("nan"), float("inf")
    gen = torch.Generator().manual_seed(0)
    for width in (1, 15, 16, 17, 33, 1000):
        x = torch.randn(9, width, generator=gen)                                                 # (R, V)
        x[1] = x[1].round()                                   # ties: the first of equal largest values
        x[2] = -inf
        x[3, -1] = inf
        x[4, width // 2] = nan                                # a nan wins, the first one
        x[4, -1] = nan
        x[5] = 0.0
        x[5, width // 3] = -0.0
        x[6, 0] = nan
        x[7] = 7.0
        x[8, (width * 2) // 3:] = x[8].max() + 1              # a run of equal largest values in the tail
        assert torch.equal(step.argmax(x), x.argmax(dim=-1)), f"width {width}"
    for bad in (torch.zeros(2, 0), torch.zeros(3), torch.zeros(2, 4, dtype=torch.float64), torch.zeros(4, 2).t()):
        with pytest.raises(ConfigError) as err:
            step.argmax(bad)
        assert "\n" not in str(err.value)


def test_bad_head_rows_are_one_line_errors():
    step = step_of(fused_model())
    C = step.config.d_model
    for bad in (torch.zeros(2, C + 1), torch.zeros(2, C, dtype=torch.float64), torch.zeros(C, 2).t(), torch.zeros(C)):
        with pytest.raises(ConfigError, match="head rows") as err:
            step.head(bad)
        assert "\n" not in str(err.value)


def run_engine(model, off: bool, counts: list[int]) -> list[list[int]]:
    """Greedy, seeded-sampling and top-k requests together, with the fused step on or off."""
    engine = Engine(model, kv_budget="1MiB", block_size=4, max_batch=4, max_step_tokens=11)
    params = [SamplingParams(max_tokens=7), SamplingParams(max_tokens=5, temperature=0.8, seed=3),
              SamplingParams(max_tokens=9, temperature=1.2, top_k=5, top_p=0.9, seed=11),
              SamplingParams(max_tokens=4), SamplingParams(max_tokens=6, temperature=0.7, seed=5)]
    heads = []
    head = FusedBatchStep.head
    with pytest.MonkeyPatch.context() as patch, fused_batch_off(engine.runner, off):
        patch.setattr(FusedBatchStep, "head", lambda self, x: heads.append(x.shape[0]) or head(self, x))
        outputs = engine.generate(prompts_of(6), params, progress=False)
    counts.append(len(heads))
    return [out.token_ids for out in outputs]


def test_engine_tokens_through_the_fused_head_equal_the_modules(monkeypatch):
    """Every step's sampled rows take the fused head; switched off (flag or KVLAB_NO_FUSED_BATCH) none does, and
    greedy and seeded tokens are the same both ways."""
    model = fused_model(7, n_heads=4, n_kv_heads=2)
    counts: list[int] = []
    fused = run_engine(model, off=False, counts=counts)
    modules = run_engine(model, off=True, counts=counts)
    monkeypatch.setenv("KVLAB_NO_FUSED_BATCH", "1")
    by_env = run_engine(model, off=False, counts=counts)
    assert counts[0] > 0 and counts[1:] == [0, 0]
    assert fused == modules == by_env


def test_vector_exp_is_close_to_torch_and_keeps_nan(kernel):
    """decode.c's exponentials, which the batch step's SwiGLU and the paged softmax use (kvlab_exp_shifted): within a
    few ulp of torch.exp over the softmax's and the gate's range, 0 far below, nan where the input is nan."""
    fn = kernel.lib.kvlab_exp_shifted
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_float]
    fn.restype = ctypes.c_float
    x = torch.cat([torch.linspace(-87.0, 88.0, 4001), torch.tensor([-200.0, -90.0, 0.0, float("nan"), -1e-30])])
    top = 0.0
    got = x.clone()
    total = fn(got.data_ptr(), got.numel(), top)
    want = torch.exp(x.double() - top)
    finite = ~x.isnan()
    assert torch.allclose(got[finite].double(), want[finite], rtol=4e-7, atol=1e-38)
    assert got[~finite].isnan().all() and got[-5:].isnan().sum() == 1
    assert total != total                                                     # the nan reaches the sum too
