"""An integer pool in the engine's fused step (kernels/batchstep.c, each layer through paged.c kvlab_int_pool_layer:
the step's exact keys from each sequence's stage and rows, the C coder, the paged read) against the module path
(serve/coded.py IntPool: the same coder and read, called layer by layer from the Blocks).

Every step of an engine run is computed both ways from the same pool state: the rows' logits agree to fp32 rounding
and the codes, scales and stages are the ones the modules write; greedy tokens are the modules'; bad stage rows and
K/V beyond float16 are one-line errors.
"""

from __future__ import annotations

import pytest
import torch

from kvlab.errors import ConfigError, NonFiniteError
from kvlab.serve import Engine, SamplingParams
from kvlab.serve.attention import RaggedLayout
from kvlab.serve.coded import IntPool
from kvlab.serve.fused_batch import FusedBatchStep, fused_batch_for, fused_batch_off

from .kernel_checks import require_kernel
from .test_fused_batch import fused_model, prompts_of

CASES = [  # format, query heads, KV heads, sliding window
    ("int4", 4, 2, None),           # groups of the block size (4 tokens)
    ("int8+g2", 4, 2, None),        # two key groups a block
    ("int3+g4", 6, 2, None),        # bit planes (3 = 2 + 1)
    ("int4+g4", 4, 1, 5),           # MQA, a window across groups
]


def engine_of(name: str, heads: int, kv_heads: int, window, seed: int = 0) -> Engine:
    """Blocks of 4 tokens over a tiny model of 2 layers, 16-dim heads."""
    model = fused_model(seed, n_heads=heads, n_kv_heads=kv_heads, d_model=16 * heads, sliding_window=window)
    return Engine(model, cache=name, kv_budget="1MiB", block_size=4, max_batch=4, max_step_tokens=11)


def buffers(pool: IntPool) -> dict[str, torch.Tensor]:
    return {**pool.blocks.buffers(), "stage": pool.stage}


@pytest.fixture(scope="module", autouse=True)
def kernel():
    return require_kernel()


@pytest.mark.parametrize("name,heads,kv_heads,window", CASES)
def test_every_fused_step_equals_the_modules(name, heads, kv_heads, window):
    """Each step both ways from the same pool state: the stages to fp32 rounding, the codes and scales the modules write
    (an fp32 ulp of the K/V may move a value across a code boundary, more often among int8's 256 levels: at most 1
    byte in 200), and the logits to 2e-4 of
    their scale (a moved 4-bit code moves its value by a step of its group's range: up to 5e-5 here, 1e-6 without)."""
    engine = engine_of(name, heads, kv_heads, window)
    runner, pool, model = engine.runner, engine.pool, engine.model
    assert isinstance(pool, IntPool)
    rows_per_step, changed, written = [], 0, 0

    @torch.inference_mode()
    def run(chunks):
        nonlocal changed, written
        n = sum(c.n_tokens for c in chunks)
        assert fused_batch_for(runner, n) is not None, f"a step of {n} rows did not take the fused path"
        before = {key: t.clone() for key, t in buffers(pool).items()}
        with fused_batch_off(runner):
            want = runner.hidden(chunks)                                       # (1, N, C)
        wanted = {key: t.clone() for key, t in buffers(pool).items()}
        for key, t in buffers(pool).items():
            t.copy_(before[key])
        got = runner.hidden(chunks)                                            # (1, N, C)
        want_logits, got_logits = model.logits(want), model.logits(got)
        assert (got_logits - want_logits).abs().max().item() <= 2e-4 * want_logits.abs().max().item() + 1e-6
        for key, t in buffers(pool).items():
            if key == "stage":
                torch.testing.assert_close(t, wanted[key], rtol=1e-5, atol=1e-5 * wanted[key].abs().max().item())
            else:
                changed += int((t != wanted[key]).sum())
                written += int((wanted[key] != before[key]).sum())
        rows_per_step.append(n)
        return runner.sample(chunks, want)

    runner.run = run
    engine.generate(prompts_of(0), [SamplingParams(max_tokens=n) for n in (7, 3, 9, 5, 4)], progress=False)
    assert 1 in rows_per_step and max(rows_per_step) == 11                   # lone decodes and mixed stacks
    assert written > 0 and changed <= written // 200


@pytest.mark.parametrize("name,heads,kv_heads,window", CASES[:2])
def test_fused_greedy_tokens_equal_the_modules(name, heads, kv_heads, window):
    prompts = prompts_of(1, (3, 17, 8, 30, 1, 12))
    params = [SamplingParams(max_tokens=n) for n in (9, 4, 12, 6, 10, 7)]
    modules = engine_of(name, heads, kv_heads, window, 1)
    with fused_batch_off(modules.runner):
        want = [out.token_ids for out in modules.generate(prompts, params, progress=False)]
    fused, calls = engine_of(name, heads, kv_heads, window, 1), []
    step_call = FusedBatchStep.__call__
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(FusedBatchStep, "__call__", lambda self, *a: calls.append(1) or step_call(self, *a))
        got = [out.token_ids for out in fused.generate(prompts, params, progress=False)]
    assert len(calls) == fused.stats().steps and got == want                 # every step fused, the same tokens


def test_bad_rows_and_keys_beyond_float16_are_one_line_errors():
    engine = engine_of("int4", 4, 2, None)
    runner, pool = engine.runner, engine.pool
    with torch.inference_mode():
        step = fused_batch_for(runner, 3)
        assert isinstance(step, FusedBatchStep)
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
        (chunk,) = engine.scheduler.schedule()
        layout = RaggedLayout.build([chunk.seq.block_table], [3], [3], 4)
        x = engine.model.embed(torch.tensor([[1, 2, 3]]))
        cos, sin = engine.model.rope_at(torch.arange(3), torch.float32)
        before = {key: t.clone() for key, t in buffers(pool).items()}
        for rows, match in ((None, "stage row"), ([99], "refused"), ([-1], "refused")):
            with pytest.raises(ConfigError, match=match) as info:
                step(x, cos, sin, pool, layout, runner.scale, None, rows)
            assert "\n" not in str(info.value)
        assert all(torch.equal(t, before[key]) for key, t in buffers(pool).items())
        with pytest.raises(NonFiniteError, match="not finite") as info:
            step(x * float("nan"), cos, sin, pool, layout, runner.scale, None, [0])
        assert "\n" not in str(info.value)
        norm = engine.model.blocks[1].attn_norm.weight                         # the C step reads it in place
        norm.mul_(1e6)
        with pytest.raises(NonFiniteError) as fused:                           # layer 1's K/V past float16
            step(x, cos, sin, pool, layout, runner.scale, None, [0])
        with fused_batch_off(runner), pytest.raises(NonFiniteError) as modules:
            runner.hidden([chunk])
        for error in (fused.value, modules.value):    # C checks each key as it comes, torch a key group when complete
            assert "exceeds the float16 range of the integer cache's scales" in str(error) and "\n" not in str(error)
        norm.div_(1e6)
        assert step(x, cos, sin, pool, layout, runner.scale, None, [0]).shape == x.shape
