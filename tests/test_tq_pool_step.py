"""A TurboQuant pool layer in one C call (kernels/paged.c kvlab_tq_pool_layer): the step's K/V coded into their slots
(sink positions into the sink rows), every row attended over its sequence's codes, turned back to the model's domain
and merged with the sink rows, against the path it replaces (the C coder, kvlab_paged_codes_attention, then the
inverse rotation, the value offset, q·μ and the sink merge in torch).

Two pools with one codec run the same steps, one each way: after every step their buffers are bitwise equal and the
outputs agree to fp32 rounding. The steps mix decode rows with prefill chunks, and chunks that cross the sink.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from kvlab.cache import CacheGeometry
from kvlab.errors import ConfigError
from kvlab.kernels.paged import TqStep, tq_pool_layer
from kvlab.serve import coded
from kvlab.serve.attention import RaggedLayout
from kvlab.serve.blocks import CapacityPlan
from kvlab.serve.coded import TurboPool
from kvlab.serve.formats import block_format
from kvlab.serve.runner import BatchView
from kvlab.serve.sequence import Sequence

from .kernel_checks import require_kernel
from .test_serve_compressed import calibrated

TQ4 = "tq4.125+prerope+norms8+sink1+kscale=lsq+vscale=lsq"        # the tq4 preset
TQ3 = "tq-k3.5v3.125+prerope+vq+norms8+sink1"                       # the tq3 preset
HALLOC = "tq-k4v4+prerope+halloc=k3553v4444+sink1"                  # 2 layers x 2 KV heads, a width per head
CASES = [  # format, block size, query heads, KV heads, sliding window
    ("tq-k4v4", 8, 6, 2, None),
    (TQ4, 8, 6, 2, None),
    (TQ4, 4, 4, 1, 5),              # MQA, a window shorter than the chunks
    (TQ3, 8, 6, 2, None),
    (HALLOC, 8, 4, 2, None),
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
    held = {f"{name}.{i}": t for name, layers in pool.token_buffers.items() for i, t in enumerate(layers)}
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
