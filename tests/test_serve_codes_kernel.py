"""TurboQuant and integer blocks attended in one C call per layer (kernels/paged.c kvlab_tq_attention,
kvlab_paged_int_attention) against the pools' torch reference (gather, dequantize, grouped_attention per
sequence), and the int pools' open key group across a fork.

The random pools hold several sequences of different lengths (one past a flash-decoding key chunk of 256), with
blocks shared between them (a cached prefix, a fork's whole table), and a step that mixes prefill chunks with
single decode tokens.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from kvlab.cache import CacheGeometry, make_cache
from kvlab.errors import ConfigError
from kvlab.cache.tq_kernel import CodedLayers
from kvlab.kernels.paged import paged_int_attention, tq_attention
from kvlab.serve import coded
from kvlab.serve.attention import RaggedLayout
from kvlab.serve.blocks import BlockManager, CapacityPlan
from kvlab.serve.coded import IntPool, TurboPool
from kvlab.serve.formats import block_format
from kvlab.serve.runner import BatchView

from .kernel_checks import require_kernel
from .test_serve_compressed import calibrated


class Seq:
    """What the block manager and the pool's rows need of a sequence."""

    def __init__(self):
        self.token_ids, self.block_table, self.num_computed, self.num_hashed = [], [], 0, 0


def random_turbo_pool(name: str, block_size: int, heads: int, kv_heads: int, d: int, window: int | None, seed: int):
    """A one-layer TurboPool of ~600 tokens whose every slot holds the codes of random K/V."""
    gen = torch.Generator().manual_seed(seed)
    geometry = CacheGeometry(n_layers=1, n_kv_heads=kv_heads, head_dim=d, n_heads=heads, capacity=64, window=window)
    plan = replace(CapacityPlan.build(geometry, name, 10**9, block_size, max_batch=8), n_blocks=600 // block_size)
    fmt = block_format(name, geometry, block_size)
    pool = TurboPool(geometry, plan, fmt, calibrated(geometry, fmt.config, gen))
    slots = torch.arange(pool.slots)
    k = torch.randn(pool.slots, kv_heads, d, generator=gen) + 2.0          # (slots, Hkv, D) with a common component
    v = torch.randn(pool.slots, kv_heads, d, generator=gen)
    pool.append(0, BatchView(pool, slots, None, d ** -0.5, window, False), k, v)
    return pool


def random_step(rng: random.Random, block_size: int, n_blocks: int) -> tuple[list[list[int]], list[int], list[int]]:
    """Block tables (a cached prefix and a forked table shared), queries and context lengths of five sequences:
    prefill chunks and decode tokens, one context past a 256-key chunk."""
    free = list(range(n_blocks))
    rng.shuffle(free)
    blocks = lambda n: -(-n // block_size)                                      # noqa: E731
    lengths = [rng.randint(260, 300), rng.randint(1, 40), 0, 0, rng.randint(2, 70)]
    tables = [[free.pop() for _ in range(blocks(lengths[0]))], [free.pop() for _ in range(blocks(lengths[1]))]]
    shared = rng.randint(1, 2)                                                  # a cached prefix of sequence 0
    lengths[2] = shared * block_size + rng.randint(1, 2 * block_size)
    tables.append(tables[0][:shared] + [free.pop() for _ in range(blocks(lengths[2]) - shared)])
    lengths[3] = rng.randint(1, lengths[1])                                     # a fork of sequence 1
    tables.append(tables[1][:blocks(lengths[3])])
    tables.append([free.pop() for _ in range(blocks(lengths[4]))])
    queries = [1, lengths[1], rng.randint(2, lengths[2]), 1, rng.choice([1, lengths[4]])]
    return tables, queries, lengths


CASES = [  # format, block size, query heads, KV heads, head dim, sliding window
    ("tq-k4v4", 16, 9, 3, 64, None),        # SmolLM2's GQA
    ("tq-k4v4", 6, 8, 1, 128, None),        # MQA, a block size that is not a power of two
    ("tq-k4v4+bf16norms", 16, 4, 2, 64, 37),
    ("tq-k3v3", 16, 4, 1, 128, None),
    ("tq-k3v3", 6, 9, 3, 64, 20),           # a window shorter than the prefill chunks
    ("tq3.5", 16, 6, 2, 128, None),
    ("tq3.5", 6, 4, 4, 64, None),       # MHA
    ("tq-k4v3", 16, 9, 3, 64, 300),
    ("tq-k4v4+halloc=k354v444", 16, 9, 3, 64, None),            # a width per KV head: each head's own layout
    ("tq-k3v3+halloc=k2434v3332+norms8", 6, 8, 4, 64, 20),
]


@pytest.mark.parametrize("seed,case", list(enumerate(CASES)))
def test_the_ragged_code_kernel_equals_the_torch_reference(seed, case, monkeypatch):
    require_kernel()
    name, block_size, heads, kv_heads, d, window = case
    rng = random.Random(seed)
    pool = random_turbo_pool(name, block_size, heads, kv_heads, d, window, seed)
    calls = []

    def counted(*args, **kw):
        calls.append(1)
        return tq_attention(*args, **kw)

    monkeypatch.setattr(coded, "tq_attention", counted)
    for _ in range(2):
        tables, queries, lengths = random_step(rng, block_size, pool.plan.n_blocks)
        layout = RaggedLayout.build(tables, queries, lengths, block_size)
        q = torch.randn(sum(queries), heads, d, generator=torch.Generator().manual_seed(rng.randint(0, 1 << 30)))
        on_codes = pool.attend(0, BatchView(pool, None, layout, d ** -0.5, window, True), q)
        reference = pool.attend(0, BatchView(pool, None, layout, d ** -0.5, window, False), q)
        torch.testing.assert_close(on_codes, reference, atol=1e-5, rtol=1e-5)
    assert len(calls) == 2                      # one call per layer and step: the kernel ran, not a fallback


def test_the_ragged_code_kernel_checks_every_buffer():
    kernel = require_kernel()
    pool = random_turbo_pool("tq-k4v4", 16, 4, 2, 64, None, 0)
    layout = RaggedLayout.build([[3, 5], [7]], [2, 1], [20, 9], 16)
    layer = pool._coder_at(0, 0)                                                     # the layer as C reads it
    q = torch.randn(3, 4, 64)
    args = dict(block_tables=layout.block_tables, query_start=layout.query_start, context_len=layout.context_len,
                step=pool.step_struct(layout, None), scale=0.125)
    assert tq_attention(kernel, layer, q, **args).shape == (3, 4, 64)
    bad = [
        dict(block_tables=layout.block_tables.long()),
        dict(block_tables=torch.tensor([[3, 99], [7, 0]], dtype=torch.int32)),      # a block id past the pool
        dict(context_len=torch.tensor([40, 9], dtype=torch.int32)),                 # longer than its table
        dict(query_start=torch.tensor([0, 2, 4], dtype=torch.int32)),               # rows that are not q's
        dict(step=pool.step_struct(RaggedLayout.build([[3]], [1], [4], 16), None)),  # a step of another layout
        dict(first_key=-1),
    ]
    for change in bad:
        with pytest.raises(ConfigError) as info:
            tq_attention(kernel, layer, q, **{**args, **change})
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError):
        tq_attention(kernel, layer, q[:, :3], **args)                               # 3 heads over 2 KV heads
    at = layer.heads[0][1].at
    layer.heads[0][1].at = layer.block_bytes[0] - layer.slot_bytes[0]               # head 1's rows past its block's end
    with pytest.raises(ConfigError, match="refused") as info:
        tq_attention(kernel, layer, q, **args)
    assert "\n" not in str(info.value)
    layer.heads[0][1].at = at
    # the layer's buffers are checked where C's description of them is made
    buffers = pool.blocks.layer(0)
    bad_buffers = [
        dict(k_codes=buffers["k_codes"][..., :-1]),                                 # rows shorter than the layout's
        dict(k_norm=buffers["k_norm"].float()),                                     # norms not 16-bit
        dict(v_norm=buffers["v_norm"].to(torch.bfloat16)),                          # K and V norms differ
        dict(v_codes=buffers["v_codes"][:, :, :8]),                                 # blocks of other rows than the norms'
        dict(k_norm=buffers["k_norm"][..., None]),                                  # not (n_blocks, Hkv, rows)
    ]
    for change in bad_buffers:
        with pytest.raises(ConfigError) as info:
            CodedLayers("test").layer(pool.codec, 0, {**buffers, **change}, (pool.plan.n_blocks, 16))
        assert "\n" not in str(info.value)


# -- int pools -------------------------------------------------------------------------------------------------
INT_CASES = [  # format, block size, query heads, KV heads, head dim, sliding window, value head dim (0: the head dim)
    ("int4", 16, 9, 3, 64, None, 0),
    ("int8", 16, 8, 1, 128, 30, 0),        # MQA, a window
    ("int4+g4", 12, 4, 2, 128, None, 0),   # a block size that is not a power of two, key groups of 4
    ("int3", 16, 6, 6, 64, None, 0),       # MHA, a width that is two bit planes
    ("int4", 16, 4, 2, 64, 40, 32),        # value heads narrower than key heads, a window
]


@pytest.mark.parametrize("seed,case", list(enumerate(INT_CASES)))
def test_the_ragged_int_kernel_equals_the_torch_reference(seed, case, monkeypatch):
    """Sequences prefilled in chunks and decoded together, one of them forked mid-group (its blocks shared, its open
    key group copied): every step's attention on the codes equals the reference."""
    require_kernel()
    name, block_size, heads, kv_heads, d, window, dv = case
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    geometry = CacheGeometry(n_layers=1, n_kv_heads=kv_heads, head_dim=d, n_heads=heads, capacity=64, window=window,
                             head_dim_v=dv)
    plan = replace(CapacityPlan.build(geometry, name, 10**9, block_size, max_batch=8), n_blocks=900 // block_size)
    pool = IntPool(geometry, plan, block_format(name, geometry, block_size))
    manager = BlockManager(plan.n_blocks, block_size, prefix_caching=False, on_copy=pool.copy_block,
                           on_free=pool.release, on_fork=pool.fork)
    lengths = {Seq(): n for n in (rng.randint(260, 300), rng.randint(20, 60), rng.randint(1, 30))}
    calls = []
    monkeypatch.setattr(coded, "paged_int_attention", lambda *a, **kw: calls.append(1) or paged_int_attention(*a, **kw))
    forked = False
    while any(s.num_computed < n for s, n in lengths.items()):
        seqs = [s for s, n in lengths.items() if s.num_computed < n]
        chunks = [min(lengths[s] - s.num_computed, rng.choice([1, rng.randint(1, 3 * block_size), 100, 100])) for s in seqs]
        slots = torch.tensor(sum((manager.reserve(s, n) for s, n in zip(seqs, chunks)), []))
        layout = RaggedLayout.build([s.block_table for s in seqs], chunks, [s.num_computed + n for s, n in zip(seqs, chunks)],
                                    block_size)
        k = torch.randn(len(slots), kv_heads, d, generator=gen) + 1.0
        v = torch.randn(len(slots), kv_heads, geometry.head_dim_v, generator=gen)
        q = torch.randn(len(slots), heads, d, generator=gen)
        rows = pool.rows_for(seqs)
        pool.append(0, BatchView(pool, slots, layout, d ** -0.5, window, True, rows), k, v)
        on_codes = pool.attend(0, BatchView(pool, slots, layout, d ** -0.5, window, True, rows), q)
        reference = pool.attend(0, BatchView(pool, slots, layout, d ** -0.5, window, False, rows), q)
        torch.testing.assert_close(on_codes, reference, atol=1e-5, rtol=1e-5)
        for s, n in zip(seqs, chunks):
            s.num_computed += n
        parent = next(iter(lengths))
        if not forked and parent.num_computed % block_size and parent.num_computed < lengths[parent]:
            child = Seq()
            manager.fork(parent, child)           # shares every block, a partly filled tail included
            lengths[child] = lengths[parent] + rng.randint(0, 20)
            forked = True
    assert forked and len(calls) > 3


def test_the_ragged_int_kernel_checks_every_buffer():
    kernel = require_kernel()
    geometry = CacheGeometry(n_layers=1, n_kv_heads=2, head_dim=16, n_heads=4, capacity=64)
    plan = replace(CapacityPlan.build(geometry, "int4", 10**9, 8, max_batch=4), n_blocks=6)
    pool = IntPool(geometry, plan, block_format("int4", geometry, 8))
    codes = pool.blocks.layer(0)                                            # (n_blocks, Hkv, block_size, ...) each
    layout = RaggedLayout.build([[1, 4], [2]], [3, 1], [11, 5], 8)       # sequence 0 opens its group at 8, 1 at 0
    args = dict(q=torch.randn(4, 4, 16), bits=4, **codes,
                exact=torch.randn(3 + 5, 2, 16), exact_start=torch.tensor([0, 3, 8]), block_tables=layout.block_tables,
                query_start=layout.query_start, context_len=layout.context_len, key_group=8, scale=0.25)
    assert paged_int_attention(kernel, **args).shape == (4, 4, 16)
    bad = [
        dict(bits=9), dict(key_group=3),                                          # no such codes; groups straddle blocks
        dict(k_scale=codes["k_scale"].float()),                                   # scales not fp16
        dict(v_zero=codes["v_zero"][..., :1]),                                    # value groups that differ
        dict(k_codes=codes["k_codes"][..., :-1]),                                 # rows shorter than 16 int4 codes
        dict(exact=torch.randn(8, 2, 15)),
        dict(exact_start=torch.tensor([0, 3, 8], dtype=torch.int32)),
        dict(exact=torch.randn(3 + 4, 2, 16), exact_start=torch.tensor([0, 3, 7])),  # too few exact keys for a query
        dict(exact=torch.randn(2 + 5, 2, 16), exact_start=torch.tensor([0, 2, 7])),
        dict(block_tables=torch.tensor([[1, 77], [2, 0]], dtype=torch.int32)),    # a block id past the pool
        dict(value_dim=32),                                                       # value rows of 16 codes
    ]
    for change in bad:
        with pytest.raises(ConfigError) as info:
            paged_int_attention(kernel, **{**args, **change})
        assert "\n" not in str(info.value)


# -- int pools: a fork carries the parent's open key group ----------------------------------------------------
def test_a_fork_copies_the_open_key_group_of_an_int_pool():
    gen = torch.Generator().manual_seed(0)
    geometry = CacheGeometry(n_layers=1, n_kv_heads=2, head_dim=16, n_heads=4, capacity=64)
    plan = replace(CapacityPlan.build(geometry, "int4", 10**9, 8, max_batch=4), n_blocks=12)
    pool = IntPool(geometry, plan, block_format("int4", geometry, 8))
    manager = BlockManager(plan.n_blocks, 8, prefix_caching=False, on_copy=pool.copy_block, on_free=pool.release,
                           on_fork=pool.fork)
    other, parent, child = Seq(), Seq(), Seq()

    def step(seqs, n, k, v, q):
        """n new tokens for each of seqs (the same K/V/queries for all) -> each one's attention output."""
        slots = [manager.reserve(s, n) for s in seqs]
        layout = RaggedLayout.build([s.block_table for s in seqs], [n] * len(seqs), [s.num_computed + n for s in seqs], 8)
        view = BatchView(pool, torch.tensor(sum(slots, [])), layout, 0.25, None, False, pool.rows_for(seqs))
        pool.append(0, view, k.repeat(len(seqs), 1, 1), v.repeat(len(seqs), 1, 1))
        out = pool.attend(0, view, q.repeat(len(seqs), 1, 1))
        for s in seqs:
            s.num_computed += n
        return out.split(n)

    def tokens(n):
        return torch.randn(n, 2, 16, generator=gen), torch.randn(n, 2, 16, generator=gen), torch.randn(n, 4, 16, generator=gen)

    step([other], 5, *tokens(5))                 # another sequence's row holds other keys
    step([parent], 13, *tokens(13))              # one key group coded, 5 keys open in the parent's stage row
    manager.fork(parent, child)
    k, v, q = tokens(2)
    from_parent, from_child = step([parent, child], 2, k, v, q)
    torch.testing.assert_close(from_child, from_parent, atol=0, rtol=0)
    single = make_cache("int4+g8", replace(geometry, capacity=16))
    gen.manual_seed(0)
    tokens(5)
    for n in (13, 2):
        kn, vn, qn = tokens(n)
        single.append(0, kn.transpose(0, 1)[None], vn.transpose(0, 1)[None])
        want = single.attend(0, qn.transpose(0, 1)[None])[0].transpose(0, 1)
    torch.testing.assert_close(from_child, want, atol=2e-5, rtol=1e-4)
    manager.free(child)
    manager.free(parent)
    assert parent not in pool.rows and child not in pool.rows
