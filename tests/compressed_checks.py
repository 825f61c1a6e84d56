"""Checks every compressed cache must pass (used by test_quantized_cache.py and test_turboquant.py)."""

from __future__ import annotations

import pytest
import torch

from .kernel_checks import require_kernel
from kvlab.cache import CacheGeometry, expected_nbytes, make_cache
from kvlab.cache.attention import grouped_attention
from kvlab.errors import NonFiniteError

GEOMETRY = CacheGeometry(n_layers=3, n_kv_heads=2, head_dim=64, capacity=96, n_heads=6)
CHUNKS = (5, 1, 1, 32, 3, 17)   # prefill, decode steps, chunks: crosses key groups and windows


def feed(name: str, geometry: CacheGeometry = GEOMETRY, chunks=CHUNKS, dtype=torch.float32, seed: int = 0, scale: float = 1.0):
    """Append random K/V in `chunks` to every layer; yield (cache, q, k_all, v_all) after each chunk."""
    gen = torch.Generator().manual_seed(seed)
    cache = make_cache(name, geometry, dtype)
    g = geometry
    ks, vs = [], []
    for T in chunks:
        k = torch.randn(g.batch, g.n_kv_heads, T, g.head_dim, generator=gen) * scale
        v = torch.randn(g.batch, g.n_kv_heads, T, g.head_dim_v, generator=gen) * scale
        q = torch.randn(g.batch, g.n_heads, T, g.head_dim, generator=gen)
        ks.append(k)
        vs.append(v)
        for layer in range(g.n_layers):
            cache.append(layer, k.to(dtype), v.to(dtype))
        yield cache, q.to(dtype), torch.cat(ks, dim=2), torch.cat(vs, dim=2)


def check_attend_is_exact_to_storage(name: str, geometry: CacheGeometry = GEOMETRY, attend_first: bool = False,
                                     chunks=CHUNKS) -> None:
    """attend() == dense grouped attention over the cache's own dequantized K/V, at every step of `chunks`.

    attend_first: read through attend() before dequantized() (a cache may code a chunk at its first read); a first
    chunk that waits for its queries (TurboQuant's key weights) is read exactly by them, so that read is held to the
    attention over every K/V appended so far (nothing is coded before that chunk).
    """
    for cache, q, k_all, v_all in feed(name, geometry, chunks):
        for layer in range(geometry.n_layers):
            first_read = attend_first and getattr(cache, "awaits_queries", lambda _: False)(layer)
            out = cache.attend(layer, q) if attend_first else None
            k, v = cache.dequantized(layer)
            assert k.shape[2] == cache.layer_length(layer)
            out = cache.attend(layer, q) if out is None else out
            if first_read:
                k, v = k_all, v_all
            ref = grouped_attention(q.float(), k, v, cache.scale, window=geometry.window)
            torch.testing.assert_close(out.float(), ref, atol=2e-5, rtol=1e-4)


def check_attend_is_exact_chunked_and_token_by_token(name: str, geometry: CacheGeometry = GEOMETRY) -> None:
    """check_attend_is_exact_to_storage for a prefill, decode steps and chunks (CHUNKS), and for 12 single tokens."""
    for chunks in (CHUNKS, (1,) * 12):
        check_attend_is_exact_to_storage(name, geometry, chunks=chunks)


def check_attend_is_token_by_token(name: str, geometry: CacheGeometry = GEOMETRY, chunks=CHUNKS) -> None:
    """attend() over each chunk of `chunks`, row by row == dense grouped attention over the K/V that the same
    cache fed one token at a time holds (dequantized) right after that row's token: a chunk reads, for
    every query, exactly what token-by-token decoding reads (no query sees a later token's influence)."""
    twin = make_cache(name, geometry)
    for cache, q, k_all, v_all in feed(name, geometry, chunks):
        T = q.shape[2]
        for layer in range(geometry.n_layers):
            out = cache.attend(layer, q)                                             # (B, H, T, Dv)
            assert cache.dequantized(layer)[0].shape[2] == cache.layer_length(layer)
            for t in range(T):
                pos = k_all.shape[2] - T + t
                twin.append(layer, k_all[:, :, pos:pos + 1], v_all[:, :, pos:pos + 1])
                k, v = twin.dequantized(layer)
                ref = grouped_attention(q[:, :, t:t + 1].float(), k, v, cache.scale, window=geometry.window)
                torch.testing.assert_close(out[:, :, t:t + 1].float(), ref, atol=2e-5, rtol=1e-4)


def check_non_finite_is_a_one_line_error(name: str, bad: float, where: str) -> None:
    """NaN or Inf in the keys (where="k") or values ("v") appended to a layer: a one-line NonFiniteError naming it."""
    cache = make_cache(name, GEOMETRY)
    k, v = torch.randn(1, 2, 3, 64), torch.randn(1, 2, 3, 64)
    (k if where == "k" else v)[0, 1, 2, 5] = bad
    with pytest.raises(NonFiniteError) as err:
        cache.append(2, k, v)
    assert "\n" not in str(err.value) and "layer 2" in str(err.value)


def relative_error(name: str, geometry: CacheGeometry = GEOMETRY, scale: float = 1.0) -> tuple[float, float]:
    """‖K̂ - K‖/‖K‖ and the same for V over the whole fed sequence (layer 1)."""
    for cache, _, k, v in feed(name, geometry, scale=scale):
        pass
    k_hat, v_hat = cache.dequantized(1)
    return ((k_hat - k).norm() / k.norm()).item(), ((v_hat - v).norm() / v.norm()).item()


def check_nbytes(name: str, geometry: CacheGeometry = GEOMETRY, dtype=torch.bfloat16) -> None:
    """nbytes == expected_nbytes at several token counts (the buffers are preallocated)."""
    formula = expected_nbytes(name, geometry, dtype, 0)
    cache = make_cache(name, geometry, dtype)
    assert cache.nbytes == formula
    for cache, _, k, _ in feed(name, geometry, dtype=dtype):
        assert cache.nbytes == formula == expected_nbytes(name, geometry, dtype, k.shape[2])


def check_code_kernel_equals_the_torch_path(name: str, seed: int) -> None:
    """Attention from the packed codes in C (`cache.code_kernel`) against the torch path (`code_kernel = None`,
    dequantize or decode, then matmul): batch 2, GQA, a 45-token prompt (leaves a key group open), single
    tokens and a 7-token chunk, every layer; within 1e-5, and the same bytes."""
    geometry = CacheGeometry(n_layers=2, n_kv_heads=2, head_dim=64, batch=2, capacity=128, n_heads=6)
    direct, reference = make_cache(name, geometry), make_cache(name, geometry)
    if direct.code_kernel is None:
        require_kernel()  # skips without a compiler, fails when one is here but the build does not load
    reference.code_kernel = None
    if hasattr(direct, "codes_in_c"):   # the same codes in both (by torch), read in C and in torch
        direct.codes_in_c = False
    gen = torch.Generator().manual_seed(seed)
    for T in (45, 1, 1, 7, 1):
        for layer in range(2):
            k, v = torch.randn(2, 2, T, 64, generator=gen), torch.randn(2, 2, T, 64, generator=gen)
            q = torch.randn(2, 6, T, 64, generator=gen)
            direct.append(layer, k, v)
            reference.append(layer, k, v)
            assert (direct.attend(layer, q) - reference.attend(layer, q)).abs().max().item() < 1e-5
    assert direct.nbytes == reference.nbytes
