"""The formats' one storage (cache/blocks.py DenseBlocks, IntBlocks): the single-sequence cache is those blocks with one
block per sequence, the serving pool the same blocks with many sequences in small ones; both hold and read a
sequence's tokens the same, in the planner's bytes."""

from __future__ import annotations

import random

import pytest
import torch

from kvlab.cache import CacheGeometry, CacheSpec, DenseCache, make_cache
from kvlab.cache.blocks import DenseBlocks, IntBlocks, TqBlocks
from kvlab.cache.capacity import CapacityPlan
from kvlab.serve.attention import RaggedLayout, ragged_attention, ragged_attention_reference, sequence_rows
from kvlab.serve.blocks import BlockPool
from kvlab.cache.turboquant import TurboQuantCache
from kvlab.serve.coded import IntPool, TurboPool
from kvlab.serve.formats import block_format
from kvlab.serve.runner import BatchView
from kvlab.serve.sequence import Sequence

from .test_serve_compressed import calibrated

GEOMETRY = CacheGeometry(n_layers=2, n_kv_heads=2, head_dim=8, n_heads=4, capacity=40)
STORAGE = {"dense": torch.float32, "dense-f16": torch.float16, "dense-bf16": torch.bfloat16}


@pytest.mark.parametrize("name", list(STORAGE))
def test_the_single_cache_and_the_pool_are_one_storage_in_the_formats_bytes(name):
    spec = CacheSpec.parse(name)
    cache = DenseCache(GEOMETRY, storage=STORAGE[name])
    assert isinstance(cache.blocks, DenseBlocks) and issubclass(BlockPool, DenseBlocks)
    assert (cache.blocks.n_blocks, cache.blocks.block_size) == (GEOMETRY.batch, GEOMETRY.capacity)
    assert cache.k is cache.blocks.k and cache.k.shape == (2, 1, 2, 40, 8)   # (L, B, Hkv, capacity, D)
    assert cache.nbytes == spec.bytes(GEOMETRY, 0) == DenseBlocks.bytes_for(GEOMETRY, 1, 40, STORAGE[name])
    plan = CapacityPlan.build(GEOMETRY, name, 1 << 16, 4)
    pool = BlockPool(GEOMETRY, plan)
    assert pool.k.shape == (2, plan.n_blocks, 2, 4, 8)                       # (L, n_blocks, Hkv, block_size, D)
    assert pool.nbytes == plan.pool_bytes == plan.n_blocks * spec.pool_bytes(GEOMETRY, 4).block


@pytest.mark.parametrize("name", list(STORAGE))
@pytest.mark.parametrize("seed", range(3))
def test_a_sequence_reads_the_same_from_its_one_block_and_from_scattered_pool_blocks(name, seed):
    """The same chunks appended to a DenseCache and written into shuffled blocks of a pool: every token's K/V read
    back equal, and each chunk's attention equal to the single cache's (reference and kernel)."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    G = GEOMETRY
    cache = DenseCache(G, storage=STORAGE[name])
    pool = BlockPool(G, CapacityPlan.build(G, name, 1 << 16, 4))
    table = rng.sample(range(pool.n_blocks), G.capacity // 4)                 # the sequence's blocks, scattered
    n = 0
    while n < G.capacity:
        T = min(rng.choice([1, 1, 3, 7]), G.capacity - n)
        k = torch.randn(1, G.n_kv_heads, T, G.head_dim, generator=g)
        v = torch.randn(1, G.n_kv_heads, T, G.head_dim_v, generator=g)
        q = torch.randn(1, G.n_heads, T, G.head_dim, generator=g)
        layout = RaggedLayout.build([table], [T], [n + T], 4)
        positions = torch.arange(n, n + T)
        slots = torch.tensor(table)[positions // 4] * 4 + positions % 4
        for layer in range(G.n_layers):
            cache.append(layer, k, v)
            pool.write_slots(layer, slots, k[0].transpose(0, 1), v[0].transpose(0, 1))     # (T, Hkv, D)
            one_k, one_v = cache.blocks.rows(layer, n + T)
            assert torch.equal(sequence_rows(pool.k[layer], layout, 0), one_k[0])          # (Hkv, n + T, D)
            assert torch.equal(sequence_rows(pool.v[layer], layout, 0), one_v[0])
            want = cache.attend(layer, q)[0].transpose(0, 1)                               # (T, H, Dv)
            flat_q = q[0].transpose(0, 1).contiguous()                                    # (T, H, D)
            for got in (ragged_attention_reference(flat_q, pool.k[layer], pool.v[layer], layout, cache.scale),
                        ragged_attention(flat_q, pool.k[layer], pool.v[layer], layout, cache.scale)):
                torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
        n += T


@pytest.mark.parametrize("name,use_kernel", [("int4", True), ("int8+g4", True), ("int3+g8", False), ("int4", False)])
def test_an_integer_sequence_holds_the_same_codes_in_its_one_block_and_in_pool_blocks(name, use_kernel):
    """The same chunks into a QuantizedCache (its torch coder) and into scattered blocks of an IntPool (the C coder
    or its torch reference): every token's codes and value scales, and every complete key group's scales, are the
    same bits in both, and the attention each reads is the same (the pool's C read is the single cache's, bitwise)."""
    G = CacheSpec.parse(name).group_size or 32
    geometry = CacheGeometry(n_layers=2, n_kv_heads=2, head_dim=32, n_heads=4, capacity=64)
    cache = make_cache(name, geometry)
    cache.code_kernel = None                                                   # the torch coder and read: the reference
    bs = 16 if G <= 16 else G                                                  # key groups tile the pool's blocks
    plan = CapacityPlan.build(geometry, name, 10**9, bs, max_batch=2)
    assert block_format(name, geometry, bs).config.group_size == G
    pool = IntPool(geometry, plan, block_format(name, geometry, bs))
    assert isinstance(cache.blocks, IntBlocks) and isinstance(pool.blocks, IntBlocks)
    assert cache.blocks.k_codes.shape[1:3] == (1, 2) and cache.blocks.block_size == cache.slots == 64
    rng, gen = random.Random(G), torch.Generator().manual_seed(G)
    table = rng.sample(range(plan.n_blocks), 64 // bs)
    seq, n = Sequence("a", [1]), 0
    while n < 64:
        T = min(rng.choice([1, 5, 13, 20]), 64 - n)
        k = torch.randn(1, 2, T, 32, generator=gen) * 2 + 1                    # (B, Hkv, T, D)
        v = torch.randn(1, 2, T, 32, generator=gen)
        q = torch.randn(1, 4, T, 32, generator=gen)
        layout = RaggedLayout.build([table], [T], [n + T], bs)
        slots = layout.slots(0)[n:]
        view = BatchView(pool, slots, layout, cache.scale, None, use_kernel, pool.rows_for([seq]))
        flat = [t[0].transpose(0, 1).contiguous() for t in (k, v, q)]         # (T, Hkv or H, D)
        for layer in range(2):
            cache.append(layer, k, v)
            want = cache.attend(layer, q)[0].transpose(0, 1)                   # (T, H, Dv)
            pool.append(layer, view, flat[0], flat[1])
            torch.testing.assert_close(pool.attend(layer, view, flat[2]), want, rtol=1e-5, atol=1e-5)
        n += T
    positions = torch.arange(64)
    block, row = torch.tensor(table)[positions // bs], positions % bs
    for layer in range(2):
        for part in ("k_codes", "v_codes", "v_scale", "v_zero"):               # per token
            assert torch.equal(getattr(pool.blocks, part)[layer][block, :, row], getattr(cache.blocks, part)[layer][0, :, :64].transpose(0, 1)), part
        groups = positions[::G]                                                # per key group (all complete at 64)
        for part in ("k_scale", "k_zero"):
            single = getattr(cache.blocks, part)[layer][0, :, groups // G].transpose(0, 1)
            assert torch.equal(getattr(pool.blocks, part)[layer][block[::G], :, row[::G] // G], single), part
    assert pool.blocks.nbytes == plan.n_blocks * CacheSpec.parse(name).pool_bytes(geometry, bs).block


@pytest.mark.parametrize("name", ["tq-k4v4", "tq-k3v3+prerope+sink1+norms8", "tq-k4v4+halloc=k354v444", "tq-k4v3+qjl",
                                  "tq-k3v3+vq+bf16norms"])
def test_a_turboquant_sequence_holds_the_same_codes_in_its_one_block_and_in_pool_blocks(name):
    """The same chunks into a TurboQuantCache given the pool's calibration and into scattered blocks of a TurboPool
    (both through the torch coder, the reference the C coder is held to in tests/test_tq_kernel.py): every coded
    token's codes and scales are the same bits in the cache's one block and in the pool's blocks (with +sinkN the
    pool's position p is the cache's slot p - N), and the attention each reads is the same."""
    bs = 8
    geometry = CacheGeometry(n_layers=1, n_kv_heads=3, head_dim=16, n_heads=6, capacity=48,
                             rope_inv_freq=tuple(10000.0 ** (-i / 8) for i in range(8)))
    plan = CapacityPlan.build(geometry, name, 10**9, bs, max_batch=2)
    fmt = block_format(name, geometry, bs)
    gen, rng = torch.Generator().manual_seed(3), random.Random(3)
    codec = calibrated(geometry, fmt.config, gen)
    pool = TurboPool(geometry, plan, fmt, codec)
    cache = TurboQuantCache(geometry, config=fmt.config)
    cache.use_calibration(codec)
    assert isinstance(cache.blocks, TqBlocks) and isinstance(pool.blocks, TqBlocks)
    sink, n = fmt.config.full.sink, 0
    assert (cache.blocks.n_blocks, cache.blocks.block_size) == (1, cache.slots + sink)   # rows for the sink too (unused)
    assert cache.blocks.shapes() == pool.blocks.shapes()                        # the same rows, in blocks of other sizes
    table = rng.sample(range(plan.n_blocks), geometry.capacity // bs)
    seq = Sequence("a", [1])
    while n < geometry.capacity:
        T = min(rng.choice([1, 3, 11]), geometry.capacity - n)
        k = torch.randn(T, 3, 16, generator=gen) + 2.0                          # (T, Hkv, D)
        v = torch.randn(T, 3, 16, generator=gen)
        q = torch.randn(T, 6, 16, generator=gen)
        layout = RaggedLayout.build([table], [T], [n + T], bs)
        view = BatchView(pool, layout.slots(0)[n:], layout, 16 ** -0.5, None, False, pool.rows_for([seq]))
        pool.append(0, view, k, v)
        got = pool.attend(0, view, q)                                           # (T, H, D)
        cache.append(0, k.transpose(0, 1)[None], v.transpose(0, 1)[None])
        want = cache.attend(0, q.transpose(0, 1)[None])[0].transpose(0, 1)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
        n += T
    coded = n - sink
    in_pool = pool.blocks.gather(0, layout.slots(0)[sink:])                     # (1, H', coded[, bytes]) each
    in_cache = {name: t[:, :, :coded] for name, t in cache.blocks.layer(0).items()}
    assert in_pool.keys() == in_cache.keys()
    for part in in_pool:
        assert torch.equal(in_pool[part], in_cache[part]), part
    assert pool.blocks.nbytes == plan.n_blocks * CacheSpec.parse(name).pool_bytes(geometry, bs).block
