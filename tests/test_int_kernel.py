"""The C coder of integer tokens in the serving pool and in a single cache (kernels/decode.c kvlab_int_code_tokens,
cache/int_kernel.py): on random chunks of several sequences, with groups that complete inside a chunk, across chunks
and at its end, the codes, scales and open groups' staged keys it writes are bit for bit those of the torch reference
(int_codes.py through IntBlocks); K/V beyond float16's range leave the C path to the reference's one-line error.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from kvlab.cache import CacheGeometry
from kvlab.cache import int_kernel
from kvlab.errors import ConfigError, NonFiniteError
from kvlab.serve.attention import RaggedLayout
from kvlab.serve.blocks import CapacityPlan
from kvlab.serve.coded import IntPool
from kvlab.serve.formats import block_format
from kvlab.serve.runner import BatchView
from kvlab.serve.sequence import Sequence

from .kernel_checks import one_thread, require_kernel  # noqa: F401  (one_thread: autouse)


def pool_for(name: str, block_size: int, kv_heads: int, head_dim: int = 32) -> IntPool:
    geometry = CacheGeometry(n_layers=2, n_kv_heads=kv_heads, head_dim=head_dim, n_heads=2 * kv_heads, capacity=64)
    plan = replace(CapacityPlan.build(geometry, name, 10**9, block_size, max_batch=4), n_blocks=24)
    return IntPool(geometry, plan, block_format(name, geometry, block_size))


@pytest.mark.parametrize("name,block_size,kv_heads", [("int4", 16, 3), ("int8+g4", 8, 1), ("int3+g8", 16, 2),
                                                      ("int4+g2", 8, 2)])
def test_c_coded_pool_equals_the_torch_reference_bit_for_bit(name, block_size, kv_heads):
    require_kernel()
    rng, gen = random.Random(block_size * kv_heads), torch.Generator().manual_seed(kv_heads)
    pools = [pool_for(name, block_size, kv_heads) for _ in range(2)]                  # C, torch
    lengths = [rng.randint(1, 40) for _ in range(3)]
    free = list(range(24))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lengths]
    seqs = [Sequence(str(i), [100 + i]) for i in range(3)]
    done = [0] * 3
    while any(d < n for d, n in zip(done, lengths)):
        active = [s for s in range(3) if done[s] < lengths[s]]
        chunk = {s: min(lengths[s] - done[s], rng.choice([1, rng.randint(1, 2 * block_size)])) for s in active}
        layout = RaggedLayout.build([tables[s] for s in active], [chunk[s] for s in active],
                                    [done[s] + chunk[s] for s in active], block_size)
        slots = torch.cat([layout.slots(i)[done[s]:] for i, s in enumerate(active)])
        k = torch.randn(len(slots), kv_heads, 32, generator=gen) * 2 + 1
        v = torch.randn(len(slots), kv_heads, 32, generator=gen)
        for pool, use_kernel in zip(pools, (True, False)):
            view = BatchView(pool, slots, layout, 32 ** -0.5, None, use_kernel, pool.rows_for([seqs[s] for s in active]))
            for layer in range(2):
                pool.append(layer, view, k * (layer + 1), v)
        for s in active:
            done[s] += chunk[s]
    c, ref = pools
    for name_, want in ref.blocks.buffers().items():
        assert torch.equal(c.blocks.buffers()[name_], want), name_
    for s, seq in enumerate(seqs):   # each sequence's open group: the stage rows that hold keys (the rest are scratch)
        row, open_keys = c.rows[seq], lengths[s] % c.group
        assert torch.equal(c.stage[:, row, :open_keys], ref.stage[:, ref.rows[seq], :open_keys])
    assert [(first, keys.shape) for first, keys in c._fresh] == [(first, keys.shape) for first, keys in ref._fresh]


def test_kv_beyond_float16_take_the_references_error():
    require_kernel()
    pool = pool_for("int4", 16, 1)
    layout = RaggedLayout.build([[0]], [1], [1], 16)
    view = BatchView(pool, layout.slots(0), layout, 1.0, None, True, pool.rows_for([Sequence("a", [1])]))
    huge = torch.full((1, 1, 32), 1e6)
    with pytest.raises(NonFiniteError, match="float16"):
        pool.append(0, view, huge, huge)


def test_the_coder_refuses_what_its_description_was_not_checked_for():
    kernel = require_kernel()
    pool = pool_for("int4", 16, 2)
    layout = RaggedLayout.build([[0]], [2], [2], 16)
    view = BatchView(pool, layout.slots(0), layout, 1.0, None, True, pool.rows_for([Sequence("a", [1])]))
    coder = pool._coder(0, view)
    positions, rows = torch.arange(2), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ConfigError, match="keys"):                                     # a KV head more than checked
        int_kernel.code_tokens(kernel, coder, torch.randn(2, 3, 32), torch.randn(2, 3, 32), view.slots, positions, rows)
    with pytest.raises(ConfigError, match="refused"):                                  # a stage row past the stages
        int_kernel.code_tokens(kernel, coder, torch.randn(2, 2, 32), torch.randn(2, 2, 32), view.slots, positions, rows + 99)
    assert not pool.blocks.v_codes.any()


@pytest.mark.parametrize("name,batch,capacity", [("int4", 2, 64), ("int8+g8", 1, 61), ("int3+g4", 3, 40),
                                                 ("int4+sink2+recent8", 2, 66)])
def test_a_single_cache_codes_its_chunks_in_c_bit_for_bit(name, batch, capacity):
    """QuantizedCache's chunks through the same C coder (each sequence into its one block, its stage heads first):
    codes, scales and the open groups' staged keys bit for bit those of its torch path, and `kvlab_int_code_tokens`
    really ran; a cache of several sequences in blocks that key groups do not tile codes in torch."""
    require_kernel()
    from kvlab.cache import make_cache

    geometry = CacheGeometry(n_layers=2, n_kv_heads=2, head_dim=32, n_heads=4, batch=batch, capacity=capacity)
    c, ref = make_cache(name, geometry), make_cache(name, geometry)
    ref.codes_in_c = False
    gen = torch.Generator().manual_seed(batch)
    for T in (13, 1, 1, 9, 1, 20):
        if c.length + T > capacity:
            break
        for layer in range(2):
            k, v = torch.randn(batch, 2, T, 32, generator=gen) * 3, torch.randn(batch, 2, T, 32, generator=gen)
            c.append(layer, k, v)
            ref.append(layer, k, v)
    assert c.length > c.config.group_size
    for name_, want in ref.blocks.buffers().items():
        assert torch.equal(c.blocks.buffers()[name_], want), name_
    open_keys = c._n_comp[0] % c.config.group_size
    for layer in range(2):
        assert torch.equal(c.k_stage[layer][:, :open_keys], ref.k_stage[layer][:, :open_keys])   # (B, G, Hkv, D)
    assert bool(c._coders) == (batch == 1 or c.slots % c.config.group_size == 0)
