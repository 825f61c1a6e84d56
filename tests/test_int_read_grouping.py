"""kvlab_int_attend (kernels/intcache.c), the one read of integer codes: a query's output is the same bits whichever
queries share its call (intcache.h). The tile read scores two queries at a time and mixes values four at a time, and
a call of many queries scores transposed tiles where one of few folds lane sums, so a prompt chunk read in one call
must give each row what it gets read alone or beside other rows (the serving pool and the single cache group a
chunk's rows differently). int4 rows are read in twos (a call whose queries all read the same positions takes the
register read, rounded apart by design); int8 rows also alone.
"""

from __future__ import annotations

import pytest
import torch

from kvlab.cache import CacheGeometry, make_cache

from .kernel_checks import one_thread, require_kernel  # noqa: F401  (one_thread: autouse)


def _read(cache, q: torch.Tensor, T: int, first_count: int):
    """the coded part's attention of q (1, Hkv, G·T, d), rows g·T + i at the chunk's token i, through the C read"""
    n, G = cache._n_comp[0], cache.config.group_size
    first = max(0, first_count) // G * G
    exact = cache._fresh_keys(0, first, n).contiguous()
    return cache.code_kernel.int_attention(cache.config.bits, cache.k_codes[0], cache.k_scale[0], cache.k_zero[0],
                                           cache.v_codes[0], cache.v_scale[0], cache.v_zero[0], n,
                                           cache.geometry.head_dim_v, G, exact, q.contiguous(), T, first_count,
                                           -n - T, cache.scale)


def check_rows_alone_and_together(name: str, head_dim: int, run: int, kernel=None) -> None:
    """A 72-token chunk after 150 tokens read in one call per KV head, then `run` positions at a time: the same bits
    (with `kernel`, a build of intcache.c, instead of the library's)."""
    heads, kv_heads, before, T = 6, 2, 150, 72
    g = CacheGeometry(n_layers=1, n_kv_heads=kv_heads, head_dim=head_dim, batch=1, capacity=before + T, n_heads=heads)
    cache = make_cache(name, g)
    if cache.code_kernel is None:
        require_kernel()
    if kernel is not None:
        cache.code_kernel = kernel
    gen = torch.Generator().manual_seed(11)
    cache.append(0, torch.randn(1, kv_heads, before, head_dim, generator=gen),
                 torch.randn(1, kv_heads, before, head_dim, generator=gen))
    cache.append(0, torch.randn(1, kv_heads, T, head_dim, generator=gen),
                 torch.randn(1, kv_heads, T, head_dim, generator=gen))
    group = heads // kv_heads
    q = torch.randn(1, kv_heads, group, T, head_dim, generator=gen)            # (1, Hkv, G, T, d)
    first_count = cache._n_comp[0] - T + 1
    whole, whole_lse = _read(cache, q.reshape(1, kv_heads, group * T, head_dim), T, first_count)
    whole = whole.reshape(1, kv_heads, group, T, -1)
    whole_lse = whole_lse.reshape(1, kv_heads, group, T)
    assert torch.isfinite(whole).all()
    for i in range(0, T, run):                                                  # the same rows, a few at a time
        t = min(run, T - i)
        part, part_lse = _read(cache, q[:, :, :, i:i + t].reshape(1, kv_heads, group * t, head_dim), t, first_count + i)
        assert torch.equal(part.reshape(1, kv_heads, group, t, -1), whole[:, :, :, i:i + t]), (name, i)
        assert torch.equal(part_lse.reshape(1, kv_heads, group, t), whole_lse[:, :, :, i:i + t]), (name, i)


@pytest.mark.parametrize("name, head_dim, run", [("int8", 64, 1), ("int8+g8", 40, 1), ("int4", 64, 2),
                                                 ("int4+g16", 48, 3)])
def test_a_rows_output_does_not_depend_on_the_rows_read_with_it(name, head_dim, run):
    check_rows_alone_and_together(name, head_dim, run)
