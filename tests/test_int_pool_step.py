"""An integer pool in the engine's fused step (kernels/batchstep.c, each layer through paged.c kvlab_int_pool_layer:
the step's exact keys from each sequence's stage and rows, the C coder, the paged read) against the module path
(serve/coded.py IntPool: the same coder and read, called layer by layer from the Blocks).

Every step of an engine run is computed both ways from the same pool state (test_tq_pool_step's harness): the stages
agree to fp32 rounding, the codes and scales are the ones the modules write, the rows' logits agree within what a
code moved by that rounding makes of them; greedy tokens are the modules'; bad stage rows and K/V beyond float16 are
one-line errors.
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
from .test_fused_batch import fused_model
from .test_tq_pool_step import every_step_both_ways, greedy_tokens_both_ways

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
    """The stages to fp32 rounding; the codes and scales the modules write but for 1 byte in 200 (an fp32 ulp of the
    K/V moves a value across a code boundary more often among int8's 256 levels); the logits to 2e-4 of their scale
    (a moved 4-bit code moves its value by a step of its group's range: up to 5e-5 here, 1e-6 without)."""
    engine = engine_of(name, heads, kv_heads, window)
    assert isinstance(engine.pool, IntPool)
    every_step_both_ways(engine, buffers, lambda key: key == "stage", 2e-4, 200)


@pytest.mark.parametrize("name,heads,kv_heads,window", CASES[:2])
def test_fused_greedy_tokens_equal_the_modules(name, heads, kv_heads, window):
    greedy_tokens_both_ways(lambda: engine_of(name, heads, kv_heads, window, 1))


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
