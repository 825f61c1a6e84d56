"""TurboQuant pools with +sinkN: the first N tokens' K/V exact beside the blocks (serve/sinks.py).

Sequences that start with the same N tokens share an entry; an entry nobody holds keeps its rows until it is the
least recently used one a new sequence needs; cached prefix blocks are handed out only while the entry of their
first tokens holds all N rows (else the sequence computes its prompt from the start); the pool's bytes are the blocks,
the shared state and one entry per batch slot. Attention against the single cache: tests/test_serve_compressed.py.
"""

from __future__ import annotations

import pytest
import torch

from kvlab.cache import CacheGeometry
from kvlab.serve import Engine, SamplingParams
from kvlab.serve.sequence import Sequence
from kvlab.serve.sinks import SinkRows

from .test_serve_engine import ids_of

GEOMETRY = CacheGeometry(n_layers=2, n_kv_heads=2, head_dim=8, n_heads=4, capacity=64)


def written(rows: SinkRows, seq: Sequence, n: int) -> int:
    """Write positions 0..n of every layer for the sequence (as the pool's append does); returns its entry."""
    entry = rows.entry_for(seq)
    for layer in range(GEOMETRY.n_layers):
        rows.write(layer, entry, 0, torch.ones(n, 2, 8) * seq.token_ids[0], torch.ones(n, 2, 8))
    return entry


def test_entries_are_shared_by_first_tokens_kept_when_idle_and_reused_least_recent_first():
    rows = SinkRows(GEOMETRY, entries=2, sink=2, dtype=torch.float32, device="cpu")
    a, b, c, d = (Sequence(x, ids) for x, ids in (("a", [5, 6, 7]), ("b", [5, 6, 9]), ("c", [8, 1]), ("d", [3, 4])))
    assert written(rows, a, 2) == rows.entry_for(b)                   # the same first two tokens: one entry
    assert rows.holds(b) and not rows.holds(Sequence("x", [5, 7]))
    entry_c = written(rows, c, 1)                                     # only one of its two sink rows so far
    assert not rows.holds(Sequence("y", [8, 1, 2]))                   # cached blocks would miss its second row
    with pytest.raises(RuntimeError, match="sink rows"):
        rows.entry_for(d)                                             # both entries held
    for seq in (a, b):
        rows.release(seq)
    assert rows.holds(Sequence("z", [5, 6]))                          # idle, rows kept: a prefix may use it
    rows.release(c)
    # z holds the [5, 6] entry now; d takes the least recently used idle one: c's
    assert rows.entry_for(d) == entry_c and not rows.holds(Sequence("w", [8, 1]))


def test_a_forked_child_holds_its_parents_entry():
    rows = SinkRows(GEOMETRY, entries=1, sink=1, dtype=torch.float32, device="cpu")
    parent, child = Sequence("p", [4, 2]), Sequence("c", [4, 2])
    entry = written(rows, parent, 1)
    rows.fork(parent, child)
    rows.release(parent)
    assert rows.entry_for(child) == entry and not rows.idle           # still held by the child


def test_pool_bytes_are_blocks_shared_state_and_a_sink_entry_per_batch_slot(smollm2):
    engine = Engine(smollm2, cache="tq-k4v4+prerope+sink1", kv_budget="6MiB", max_batch=3)
    cap, cfg = engine.capacity, smollm2.config
    entry = cfg.n_layers * 1 * cfg.n_kv_heads * 2 * cfg.head_dim * 4          # one fp32 token, K and V, every layer
    assert cap.sequence_bytes == entry and cap.block_bytes == Engine(smollm2, cache="tq-k4v4", kv_budget="6MiB").capacity.block_bytes
    assert engine.pool.nbytes == cap.n_blocks * cap.block_bytes + cap.shared_bytes + 3 * entry == cap.pool_bytes


def test_cached_prefix_blocks_are_used_only_while_their_sink_rows_are_held(smollm2):
    """A one-entry pool: the second prompt with the first's opening takes its cached blocks; once a third prompt with
    another opening took the entry, the same prompt computes from the start (and gives the same tokens)."""
    engine = Engine(smollm2, cache="tq-k4v4+sink1", kv_budget="8MiB", max_batch=1)
    system = ids_of(smollm2, 37)

    def run(prompt):
        rid = engine.add_request(prompt, SamplingParams(max_tokens=3))
        tokens, cached = [], None
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
                cached = out.cached_prompt_tokens if out.request_id == rid else cached
        return tokens, cached

    first, cached = run(system + ids_of(smollm2, 4, 9))
    assert cached == 0
    again, cached = run(system + ids_of(smollm2, 4, 9))
    assert cached == 32 and again == first                           # two full blocks of the system prompt
    run(ids_of(smollm2, 9, 20))                                       # another opening takes the only entry
    recomputed, cached = run(system + ids_of(smollm2, 4, 9))
    assert cached == 0 and recomputed == first
    assert engine.stats().blocks_used == 0 and not engine.pool.sinks.holders


def test_a_prompt_shorter_than_the_sink_keeps_an_entry_of_its_own():
    """Two one-token prompts under +sink2: their second sink rows come from their own sampled tokens, so they do not
    share (nor does a prefix lookup find them)."""
    rows = SinkRows(GEOMETRY, entries=2, sink=2, dtype=torch.float32, device="cpu")
    a, b = Sequence("a", [5]), Sequence("b", [5])
    assert rows.entry_for(a) != rows.entry_for(b)
    assert not rows.holds(Sequence("c", [5]))


def test_rows_that_read_no_coded_key_take_the_sink_rows_alone():
    """A sink longer than a key chunk of the C kernel (300 > 256): a 200-token prompt is all sink, the coded part reads
    no key, and attention is the exact attention over the sink rows (C path and torch path)."""
    from dataclasses import replace as with_

    from kvlab.cache.attention import grouped_attention
    from kvlab.serve.attention import RaggedLayout
    from kvlab.serve.blocks import CapacityPlan
    from kvlab.serve.coded import TurboPool
    from kvlab.serve.formats import block_format
    from kvlab.serve.runner import BatchView

    from .test_serve_compressed import calibrated

    g = CacheGeometry(n_layers=1, n_kv_heads=2, head_dim=16, n_heads=4, capacity=512)
    gen = torch.Generator().manual_seed(0)
    fmt = block_format("tq-k4v4+sink300", g, 512)
    plan = with_(CapacityPlan.build(g, "tq-k4v4+sink300", 10**9, 512, max_batch=1), n_blocks=2)
    k, v, q = (torch.randn(200, h, 16, generator=gen) for h in (2, 2, 4))      # (T, Hkv|H, D)
    want = grouped_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], 0.25)[0].transpose(0, 1)
    for use_kernel in (True, False):
        pool = TurboPool(g, plan, fmt, calibrated(g, fmt.config, gen))
        layout = RaggedLayout.build([[1]], [200], [200], 512)
        view = BatchView(pool, layout.slots(0), layout, 0.25, None, use_kernel, pool.rows_for([Sequence("s", [7] * 200)]))
        pool.append(0, view, k, v)
        torch.testing.assert_close(pool.attend(0, view, q), want, atol=1e-5, rtol=1e-4)
