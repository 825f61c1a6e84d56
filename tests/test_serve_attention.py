"""Ragged attention over block tables: the C kernel (kernels/paged.c) equals the torch reference, and the
reference equals plain causal attention over each sequence's contiguous K/V."""

from __future__ import annotations

import random

import pytest
import torch

from kvlab.cache.attention import grouped_attention
from kvlab.errors import ConfigError
from kvlab.kernels import block_kernel
from kvlab.kernels.paged import paged_attention
from kvlab.serve.attention import RaggedLayout, ragged_attention, ragged_attention_reference

needs_kernel = pytest.mark.skipif(block_kernel() is None, reason="no C compiler: the kernel cannot be built here")


def random_batch(rng: random.Random, heads: int, kv_heads: int, d: int, dv: int, block_size: int, dtype: torch.dtype):
    """Sequences with random cached lengths and random chunk sizes, their blocks scattered over a shuffled pool."""
    n_seqs = rng.randint(1, 5)
    contexts = [rng.randint(1, 70) for _ in range(n_seqs)]
    n_queries = [rng.choice([1, 1, rng.randint(1, c)]) if c > 1 else 1 for c in contexts]
    n_queries = [min(n, c) for n, c in zip(n_queries, contexts)]
    need = [(c + block_size - 1) // block_size for c in contexts]
    ids = list(range(sum(need) + 3))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at:at + n])
        at += n
    g = torch.Generator().manual_seed(rng.randint(0, 1 << 30))
    k_pool = torch.randn(len(ids), kv_heads, block_size, d, generator=g).to(dtype)   # (n_blocks, Hkv, block_size, D)
    v_pool = torch.randn(len(ids), kv_heads, block_size, dv, generator=g).to(dtype)
    q = torch.randn(sum(n_queries), heads, d, generator=g)
    return q, k_pool, v_pool, RaggedLayout.build(tables, n_queries, contexts, block_size)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("heads,kv_heads,d,dv", [(9, 3, 64, 64), (4, 1, 16, 16), (2, 2, 8, 8), (6, 2, 7, 5)])
def test_the_reference_is_causal_attention_over_each_sequence(seed, heads, kv_heads, d, dv):
    q, k_pool, v_pool, layout = random_batch(random.Random(seed), heads, kv_heads, d, dv, 16, torch.float32)
    out = ragged_attention_reference(q, k_pool, v_pool, layout, d ** -0.5)
    for s in range(layout.context_len.numel()):
        lo, hi, n = int(layout.query_start[s]), int(layout.query_start[s + 1]), int(layout.context_len[s])
        slots = layout.slots(s)
        assert len(set(slots.tolist())) == n
        block, row = slots // 16, slots % 16                                  # token t: row t % 16 of its block
        k = k_pool[block, :, row].transpose(0, 1)[None]                       # (1, Hkv, S, D)
        v = v_pool[block, :, row].transpose(0, 1)[None]
        # every query again, one at a time, over exactly the keys up to its position
        for row in range(lo, hi):
            pos = n - (hi - lo) + (row - lo)
            qr = q[row][None, :, None]                       # (1, H, 1, D)
            want = grouped_attention(qr, k[:, :, :pos + 1], v[:, :, :pos + 1], d ** -0.5)[0, :, 0]
            torch.testing.assert_close(out[row], want, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,d,dv,block_size,window", [
    (9, 3, 64, 64, 16, None),     # SmolLM2's GQA
    (4, 1, 32, 32, 16, None),     # MQA
    (3, 3, 17, 9, 5, None),       # MHA, odd dims, odd block size
    (8, 2, 16, 16, 1, None),      # one token per block
    (4, 2, 16, 16, 8, 7),         # sliding window
])
def test_the_kernel_equals_the_reference(seed, dtype, heads, kv_heads, d, dv, block_size, window):
    q, k_pool, v_pool, layout = random_batch(random.Random(seed * 7 + heads), heads, kv_heads, d, dv, block_size, dtype)
    want = ragged_attention_reference(q, k_pool, v_pool, layout, d ** -0.5, window)
    got = ragged_attention(q, k_pool, v_pool, layout, d ** -0.5, window)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("variant", ["avx2", "plain"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_each_isa_build_reads_16_bit_pools_like_the_reference(variant, dtype):
    """The fp16 rows convert 16 lanes at a time with AVX-512, 8 with F16C (Haswell) and one by one in plain C: head
    dims 72 and 17 take every one of those paths in one row."""
    from types import SimpleNamespace

    from .kernel_checks import library_variant

    kernel = SimpleNamespace(path=library_variant(variant))
    for d in (72, 17):
        q, k_pool, v_pool, layout = random_batch(random.Random(d), 4, 2, d, d, 16, dtype)
        want = ragged_attention_reference(q, k_pool, v_pool, layout, d ** -0.5)
        got = paged_attention(kernel, q, k_pool, v_pool, layout.block_tables, layout.query_start, layout.context_len,
                              d ** -0.5)
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@needs_kernel
def test_the_kernel_checks_every_buffer():
    q, k_pool, v_pool, layout = random_batch(random.Random(0), 4, 2, 8, 8, 4, torch.float32)
    kernel, args = block_kernel(), (layout.block_tables, layout.query_start, layout.context_len, 4, 0.3)
    with pytest.raises(ConfigError, match="fp32"):
        paged_attention(kernel, q.double(), k_pool, v_pool, *args)
    with pytest.raises(ConfigError, match="contiguous"):
        paged_attention(kernel, q, k_pool.transpose(0, 1).contiguous().transpose(0, 1), v_pool, *args)
    with pytest.raises(ConfigError, match="int32"):
        paged_attention(kernel, q, k_pool, v_pool, layout.block_tables.long(), *args[1:])
    with pytest.raises(ConfigError, match="multiple"):
        paged_attention(kernel, q[:, :3].contiguous(), k_pool, v_pool, *args)
    bad_table = layout.block_tables.clone()
    bad_table[0, 0] = k_pool.shape[0]                   # a block id past the pool
    with pytest.raises(ConfigError, match="out of range"):
        paged_attention(kernel, q, k_pool, v_pool, bad_table, *args[1:])
    too_long = layout.context_len.clone()
    too_long[0] = layout.block_tables.shape[1] * 4 + 1  # longer than its table
    with pytest.raises(ConfigError, match="out of range"):
        paged_attention(kernel, q, k_pool, v_pool, layout.block_tables, layout.query_start, too_long, 0.3)
    with pytest.raises(ConfigError, match="offsets"):
        paged_attention(kernel, q, k_pool, v_pool, layout.block_tables, layout.query_start[:-1], layout.context_len, 0.3)
