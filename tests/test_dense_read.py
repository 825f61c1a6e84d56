"""The single dense cache reads through the serving pool's C entry point (kernels/paged.c kvlab_paged_attention): its
output equals torch's attention over the same stored rows (the reference, `read_kernel = None`), for prompt chunks
(tiles of query rows sharing each key's read, a causal diagonal, a window shorter or longer than a tile) and single
tokens, every storage dtype, grouped, multi-head and multi-query heads, and batches."""

import pytest
import torch

from kvlab.cache import CacheGeometry
from kvlab.cache.dense import DenseCache
from kvlab.kernels import kernel_for

pytestmark = pytest.mark.skipif(kernel_for(torch.device("cpu")) is None, reason="no C kernel library on this machine")

CHUNKS = (23, 40, 1, 9, 1)   # tokens appended per step: tiles of 32 / G rows, their tails, single tokens


def _pair(heads: int, kv_heads: int, head_dim: int, storage: torch.dtype, window: int, batch: int):
    geometry = CacheGeometry(n_layers=2, batch=batch, n_kv_heads=kv_heads, head_dim=head_dim, capacity=96, window=window)
    in_c = DenseCache(geometry, torch.float32, storage=storage)
    in_torch = DenseCache(geometry, torch.float32, storage=storage)
    in_torch.read_kernel = None
    assert in_c.read_kernel is not None
    return in_c, in_torch


@pytest.mark.parametrize("storage", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,window", [(6, 2, None), (6, 2, 7), (4, 4, None), (4, 4, 50), (12, 1, 3), (8, 2, None)])
def test_the_c_read_equals_torch(storage, heads, kv_heads, window):
    gen = torch.Generator().manual_seed(heads * 31 + kv_heads * 7 + (window or 0))
    batch, head_dim = 2, 16
    in_c, in_torch = _pair(heads, kv_heads, head_dim, storage, window, batch)
    for step, T in enumerate(CHUNKS):
        for layer in range(2):
            k = torch.randn(batch, kv_heads, T, head_dim, generator=gen)
            v = torch.randn(batch, kv_heads, T, head_dim, generator=gen)
            q = torch.randn(batch, heads, T, head_dim, generator=gen)
            in_c.append(layer, k, v)
            in_torch.append(layer, k, v)
            got, want = in_c.attend(layer, q), in_torch.attend(layer, q)
            assert got.shape == want.shape == (batch, heads, T, head_dim)
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5, msg=lambda m: f"step {step} layer {layer}: {m}")


def test_a_head_dim_off_the_blocked_path_reads_the_same():
    """d = 24 (not a multiple of 16): the many-query tile takes the one-query-at-a-time read, with the same result."""
    gen = torch.Generator().manual_seed(5)
    in_c, in_torch = _pair(9, 3, 24, torch.float16, None, 1)
    for T in (37, 1):
        k, v = torch.randn(1, 3, T, 24, generator=gen), torch.randn(1, 3, T, 24, generator=gen)
        q = torch.randn(1, 9, T, 24, generator=gen)
        in_c.append(0, k, v)
        in_torch.append(0, k, v)
        torch.testing.assert_close(in_c.attend(0, q), in_torch.attend(0, q), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("storage", [torch.float32, torch.float16])
def test_a_sliding_window_cache_reads_in_c_like_torch(storage):
    """SlidingWindowCache's rows (the newest tokens, moved to the front as the window slides) and a chunk wider than its
    block (read from a temporary copy) go through the same C read."""
    from kvlab.model.layer_caches import SlidingWindowCache

    gen = torch.Generator().manual_seed(11)
    geometry = CacheGeometry(n_layers=1, batch=2, n_kv_heads=2, head_dim=16, capacity=200, window=6)
    in_c = SlidingWindowCache(geometry, torch.float32, block=8, storage=storage)
    in_torch = SlidingWindowCache(geometry, torch.float32, block=8, storage=storage)
    in_torch.read_kernel = None
    assert in_c.read_kernel is not None
    for T in (23, 1, 3, 7, 1, 12, 1):   # wider than the block, then rows that move to the front
        k, v = torch.randn(2, 2, T, 16, generator=gen), torch.randn(2, 2, T, 16, generator=gen)
        q = torch.randn(2, 6, T, 16, generator=gen)
        in_c.append(0, k, v)
        in_torch.append(0, k, v)
        torch.testing.assert_close(in_c.attend(0, q), in_torch.attend(0, q), rtol=2e-5, atol=2e-5)
