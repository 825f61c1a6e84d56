"""The dense formats' one storage (cache/blocks.py DenseBlocks): the single-sequence cache is those blocks with one
block per sequence, the serving pool the same blocks with many sequences in small ones, and both read a sequence's
tokens back the same, in the planner's bytes."""

from __future__ import annotations

import random

import pytest
import torch

from kvlab.cache import CacheGeometry, CacheSpec, DenseCache
from kvlab.cache.blocks import DenseBlocks
from kvlab.cache.capacity import CapacityPlan
from kvlab.serve.attention import RaggedLayout, ragged_attention, ragged_attention_reference, sequence_rows
from kvlab.serve.blocks import BlockPool

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
