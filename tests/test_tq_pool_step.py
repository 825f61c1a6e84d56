"""A TurboQuant pool layer in one C call (kernels/paged.c kvlab_tq_pool_layer): the step's K/V coded into their slots
(sink positions into the sink rows), every row attended over its sequence's codes, turned back to the model's domain
and merged with the sink rows, against the path it replaces (the C coder, kvlab_tq_attention, then the
inverse rotation, the value offset, q·μ and the sink merge in torch).

Two pools with one codec run the same steps, one each way: after every step their buffers are bitwise equal and the
outputs agree to fp32 rounding. The steps mix decode rows with prefill chunks, and chunks that cross the sink.

Then the engine's fused step (kernels/batchstep.c, every layer in one call) over a TurboQuant pool against the module
path: every step's logits to fp32 rounding, the codes as the modules write them, and the same greedy tokens.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from kvlab.cache import CacheGeometry
from kvlab.errors import ConfigError
from kvlab.serve import Engine, SamplingParams
from kvlab.kernels.paged import TqStep, tq_pool_layer
from kvlab.serve import coded
from kvlab.serve.attention import RaggedLayout
from kvlab.serve.blocks import CapacityPlan
from kvlab.serve.coded import TurboPool
from kvlab.serve.fused_batch import FusedBatchStep, fused_batch_for, fused_batch_off
from kvlab.serve.formats import block_format
from kvlab.serve.runner import BatchView
from kvlab.serve.sequence import Sequence

from .kernel_checks import require_kernel
from .test_fused_batch import fused_model, prompts_of
from .test_serve_compressed import calibrated

TQ4 = "tq-k4v4+ropemean+norms8+sink1+kscale=lsq+vscale=lsq"       # the tq4 preset
PREROPE = "tq4.125+prerope+norms8+sink1+kscale=lsq+vscale=lsq"      # keys before RoPE, an eighth of the channels at 5 bits
TQ3 = "tq-k3.5v3+ropemean+vq+norms8+sink1+kscale=lsq+vscale=lsq"    # the tq3 preset
PREROPE_VQ = "tq-k3.5v3.125+prerope+vq+norms8+sink1"                # keys before RoPE, 3-bit parts in blocks of 4
HALLOC = "tq-k4v4+prerope+halloc=k3553v4444+sink1"                  # 2 layers x 2 KV heads, a width per head
CASES = [  # format, block size, query heads, KV heads, sliding window
    ("tq-k4v4", 8, 6, 2, None),
    (TQ4, 8, 6, 2, None),
    (TQ4, 4, 4, 1, 5),              # MQA, a window shorter than the chunks
    (PREROPE, 8, 6, 2, None),       # two widths in a row: each part read on its own
    (TQ3, 8, 6, 2, None),
    (TQ4, 16, 6, 2, None),          # blocks of 16 rows: each read one pass through the block table
    (TQ3, 16, 6, 2, None),
    (PREROPE_VQ, 8, 6, 2, None),
    (HALLOC, 8, 4, 2, None),
    ("tq-k4v3+prerope+qjl+outliers2+sink1", 8, 6, 2, None),   # a residual's sketch, exact key entries
    ("tq-k4v4+center=kv+sink2", 4, 6, 3, None),   # K, V coded less their offsets: q·μ joins the coded keys' lse
]
D, LAYERS = 64, 2
INV_FREQ = tuple(10000.0 ** (-i / (D // 2)) for i in range(D // 2))


def pools(name: str, block_size: int, heads: int, kv_heads: int, window, seed: int) -> tuple[TurboPool, TurboPool]:
    """Two pools of one calibrated codec: one runs each layer in one C call, the other the path it replaces."""
    geometry = CacheGeometry(n_layers=LAYERS, n_kv_heads=kv_heads, head_dim=D, n_heads=heads, capacity=64, window=window,
                             rope_inv_freq=INV_FREQ)
    plan = replace(CapacityPlan.build(geometry, name, 10**9, block_size, max_batch=4), n_blocks=96 // block_size)
    fmt = block_format(name, geometry, block_size)
    codec = calibrated(geometry, fmt.config, torch.Generator().manual_seed(seed))
    fused, apart = TurboPool(geometry, plan, fmt, codec), TurboPool(geometry, plan, fmt, codec)
    apart.layers_in_c = False
    return fused, apart


def buffers(pool: TurboPool) -> dict[str, torch.Tensor]:
    held = {f"{name}.{i}": t for name, layers in pool.blocks.buffers.items() for i, t in layers.items()}
    if pool.sinks:
        held.update({"sink.k": pool.sinks.k, "sink.v": pool.sinks.v})
    return held


@pytest.mark.parametrize("seed,case", list(enumerate(CASES)))
def test_a_layer_in_one_call_writes_and_reads_as_the_path_it_replaces(seed, case, monkeypatch):
    require_kernel()
    name, block_size, heads, kv_heads, window = case
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    fused, apart = pools(name, block_size, heads, kv_heads, window, seed)
    calls = []
    monkeypatch.setattr(coded, "tq_pool_layer", lambda *a, **kw: calls.append(1) or tq_pool_layer(*a, **kw))
    lengths = [rng.randint(30, 40), rng.randint(12, 20), rng.randint(5, 9)]
    free = list(range(fused.plan.n_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lengths]
    seqs = [Sequence(str(i), [100 + i]) for i in range(len(lengths))]      # first tokens apart: a sink entry each
    done = [0] * len(lengths)
    # chunks per step: a prefill chunk crossing the sink beside a lone first token, then decodes beside chunks
    plan = [[5, 1, 0], [1, 1, 3], [1, 6, 1], [20, 1, 1], [1, 1, 1]]
    for chunks in plan:
        active = [s for s, n in enumerate(chunks) if n and done[s] < lengths[s]]
        sizes = [min(chunks[s], lengths[s] - done[s]) for s in active]
        layout = RaggedLayout.build([tables[s] for s in active], sizes, [done[s] + n for s, n in zip(active, sizes)],
                                    block_size)
        slots = torch.cat([layout.slots(i)[done[s]:] for i, s in enumerate(active)])
        N = len(slots)
        outs = {}
        for pool in (fused, apart):
            view = BatchView(pool, slots, layout, D ** -0.5, window, True, pool.rows_for([seqs[s] for s in active]))
            layer_gen = torch.Generator().manual_seed(1000 * seed + sum(done))
            outs[pool] = []
            for layer in range(LAYERS):
                k = torch.randn(N, kv_heads, D, generator=layer_gen) + 1.5     # (N, Hkv, D) with a common component
                v = torch.randn(N, kv_heads, D, generator=layer_gen)
                q = torch.randn(N, heads, D, generator=layer_gen)
                pool.append(layer, view, k, v)
                outs[pool].append(pool.attend(layer, view, q))                # (N, H, D)
        for want, got in zip(outs[apart], outs[fused]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        for key, t in buffers(apart).items():
            assert torch.equal(buffers(fused)[key], t), key
        for s, n in zip(active, sizes):
            done[s] += n
    assert len(calls) == LAYERS * len(plan)                                   # every layer of every step in one call
    if fused.sinks:
        assert fused.sinks.written == apart.sinks.written and max(fused.sinks.written) == fused.sink


def test_bad_sizes_are_one_line_errors_before_c_writes():
    kernel = require_kernel()
    fused, _ = pools(TQ4, 8, 6, 2, None, 0)
    seqs = [Sequence("0", [1]), Sequence("1", [2])]
    layout = RaggedLayout.build([[0, 1], [2]], [3, 1], [9, 4], 8)
    slots = torch.cat([layout.slots(0)[6:], layout.slots(1)[3:]])
    view = BatchView(fused, slots, layout, D ** -0.5, None, True, fused.rows_for(seqs))
    layer = fused.pool_layer(0, view)
    step = fused.step_struct(layout, view.rows)
    q, k, v = torch.randn(4, 6, D), torch.randn(4, 2, D), torch.randn(4, 2, D)
    before = {key: t.clone() for key, t in buffers(fused).items()}
    args = (layout.block_tables, layout.query_start, layout.context_len, 8)
    bad = [
        ((q[:, :5], k, v, *args, step), "query heads"),
        ((q, k[:, :1], v, *args, step), "keys"),
        ((q, k, v.double(), *args, step), "values"),
        ((q, k, v, layout.block_tables.long(), *args[1:], step), "block_tables"),
        ((q, k, v, *args, TqStep.of(torch.zeros(3, dtype=torch.int32), None, 3, D)), "checked for"),   # another step's
        ((q, k, v, *args, step.__class__.of(torch.zeros(2, dtype=torch.int32), (torch.zeros(4, D), torch.zeros(4, D)), 2, D)),
         "refused"),                                                           # RoPE rows short of the context
        ((q, k, v, *args, step.__class__.of(torch.tensor([0, 9], dtype=torch.int32), step.held[1], 2, D)), "refused"),
        ((q, k, v, torch.tensor([[0, 99], [2, 0]], dtype=torch.int32), *args[1:], step), "refused"),   # a block past the pool
    ]
    for call, match in bad:
        with pytest.raises(ConfigError, match=match) as info:
            tq_pool_layer(kernel, layer, *call, D ** -0.5)
        assert "\n" not in str(info.value)
    assert all(torch.equal(t, before[key]) for key, t in buffers(fused).items())
    with pytest.raises(ConfigError, match="sink rows must be"):
        fused._c_layers.pool_layer(layer.coded_by, fused.sinks.k[0][:, :, :1], fused.sinks.v[0])
    assert tq_pool_layer(kernel, layer, q, k, v, *args, step, D ** -0.5).shape == (4, 6, D)


# -- every layer of a step in one C call (the engine's fused step) -------------------------------------------------
STEP_FORMATS = ["tq-k4v4", TQ4, TQ3, HALLOC, "tq-k4v3+qjl+outliers1+sink1"]


def engine_of(name: str, seed: int = 0) -> Engine:
    """Blocks of 4 tokens over a tiny model of 2 layers, 4 / 2 heads of 16 dims (+prerope rebuilds rows of 16)."""
    return Engine(fused_model(seed, n_heads=4, n_kv_heads=2, d_model=64), cache=name, kv_budget="1MiB", block_size=4,
                  max_batch=4, max_step_tokens=11)


def every_step_both_ways(engine: Engine, buffers, exact, logits_rel: float, byte_share: int, apart=None) -> None:
    """Each step of an engine run, both ways from the same pool state: the modules (and inside them `apart(pool,
    True)` ... `apart(pool, False)`, where given) and the fused step. The rows' logits agree to `logits_rel` of their
    scale, the buffers `exact(key)` names (full-precision rows) to fp32 rounding, and the other buffers (codes and
    scales) are the ones the modules write but for at most 1 byte in `byte_share`: an fp32 ulp of a product may move
    a coordinate across a code boundary. buffers(pool) -> {key: tensor}. The run has lone decodes and mixed stacks."""
    runner, pool, model = engine.runner, engine.pool, engine.model
    rows_per_step, changed, written = [], 0, 0

    @torch.inference_mode()
    def run(chunks):
        nonlocal changed, written
        n = sum(c.n_tokens for c in chunks)
        assert fused_batch_for(runner, n) is not None, f"a step of {n} rows did not take the fused path"
        before = {key: t.clone() for key, t in buffers(pool).items()}
        with fused_batch_off(runner):
            if apart:
                apart(pool, True)
            want = runner.hidden(chunks)                                       # (1, N, C)
            if apart:
                apart(pool, False)
        wanted = {key: t.clone() for key, t in buffers(pool).items()}
        for key, t in buffers(pool).items():
            t.copy_(before[key])
        got = runner.hidden(chunks)                                            # (1, N, C)
        want_logits, got_logits = model.logits(want), model.logits(got)
        assert (got_logits - want_logits).abs().max().item() <= logits_rel * want_logits.abs().max().item() + 1e-6
        for key, t in buffers(pool).items():
            if exact(key):
                torch.testing.assert_close(t, wanted[key], rtol=1e-5, atol=1e-5 * wanted[key].abs().max().item())
            else:
                changed += int((t != wanted[key]).sum())
                written += int((wanted[key] != before[key]).sum())
        rows_per_step.append(n)
        return runner.sample(chunks, want)

    runner.run = run
    engine.generate(prompts_of(0), [SamplingParams(max_tokens=n) for n in (7, 3, 9, 5, 4)], progress=False)
    assert 1 in rows_per_step and max(rows_per_step) == 11                   # lone decodes and mixed stacks
    assert written > 0 and changed <= written // byte_share


def greedy_tokens_both_ways(make_engine, apart=None) -> tuple[Engine, Engine]:
    """Greedy tokens of six requests through the modules (`apart(pool, True)` first, where given) and through the
    fused step, every step of it fused: the same tokens. -> (the modules' engine, the fused one)."""
    prompts = prompts_of(1, (3, 17, 8, 30, 1, 12))
    params = [SamplingParams(max_tokens=n) for n in (9, 4, 12, 6, 10, 7)]
    modules = make_engine()
    if apart:
        apart(modules.pool, True)
    with fused_batch_off(modules.runner):
        want = [out.token_ids for out in modules.generate(prompts, params, progress=False)]
    fused, calls = make_engine(), []
    step_call = FusedBatchStep.__call__
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(FusedBatchStep, "__call__", lambda self, *a: calls.append(1) or step_call(self, *a))
        got = [out.token_ids for out in fused.generate(prompts, params, progress=False)]
    assert len(calls) == fused.stats().steps and got == want                 # every step fused, the same tokens
    return modules, fused


def layers_apart(pool: TurboPool, apart: bool) -> None:
    """The modules with each layer's parts apart (the C coder, the paged codes attention, the rest in torch)."""
    pool.layers_in_c = not apart


@pytest.mark.parametrize("name", STEP_FORMATS)
def test_every_fused_step_equals_the_modules(name):
    """Against the modules with each layer's parts apart; the logits as the dense test's (1e-5 of their scale), the
    sink rows (fp32 K/V) to fp32 rounding, the codes and scales but for 1 byte in 1000."""
    every_step_both_ways(engine_of(name), buffers, lambda key: key.startswith("sink."), 1e-5, 1000, layers_apart)


@pytest.mark.parametrize("name", STEP_FORMATS)
def test_fused_greedy_tokens_equal_the_modules(name):
    modules, fused = greedy_tokens_both_ways(lambda: engine_of(name, 1), layers_apart)
    if fused.pool.sinks:
        assert fused.pool.sinks.written == modules.pool.sinks.written


def test_when_the_fused_step_takes_turboquant_blocks():
    require_kernel()
    engine = engine_of(TQ4)
    runner = engine.runner
    with torch.inference_mode():
        assert isinstance(fused_batch_for(runner, 1), FusedBatchStep)
        engine.pool.layers_in_c = False                                        # the pool's layers apart: the modules
        assert fused_batch_for(runner, 1) is None
        engine.pool.layers_in_c = True
        step = fused_batch_for(runner, 1)
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
        (chunk,) = engine.scheduler.schedule()
        layout = RaggedLayout.build([chunk.seq.block_table], [3], [3], 4)
        x = engine.model.embed(torch.tensor([[1, 2, 3]]))
        cos, sin = engine.model.rope_at(torch.arange(3), torch.float32)
        before = {key: t.clone() for key, t in buffers(engine.pool).items()}
        with pytest.raises(ConfigError, match="each sequence's entry") as info:   # sink rows need the entries
            step(x, cos, sin, engine.pool, layout, runner.scale, None)
        assert "\n" not in str(info.value)
        with pytest.raises(ConfigError, match="refused"):                   # an entry past the sink rows'
            step(x, cos, sin, engine.pool, layout, runner.scale, None, [99])
        bad = RaggedLayout(layout.query_start, layout.context_len, torch.full_like(layout.block_tables, 10**6), 4)
        with pytest.raises(ConfigError, match="refused"):
            step(x, cos, sin, engine.pool, bad, runner.scale, None, [0])
        assert all(torch.equal(t, before[key]) for key, t in buffers(engine.pool).items())
        assert step(x, cos, sin, engine.pool, layout, runner.scale, None, [0]).shape == x.shape
