"""kernels/codebook.c's reads of TurboQuant codes in registers: a query's scores and sums are the same bits whichever
queries share its call. A call of a few queries (a decode step's) unpacks a row's codes once per four queries and folds
lane sums; a call of many (a prompt chunk's) decodes each sixteen rows once for all of them and scores tq4's and tq3's
keys with the keys in lanes, adding the lane sums in the fold's order. The serving pool and the single cache group a
chunk's queries differently, so both must give each query what it gets read alone; and both match a plain torch
decode-then-matmul.
"""

from __future__ import annotations

import pytest
import torch

from kvlab.cache import CacheGeometry, make_cache

from .kernel_checks import one_thread, require_kernel  # noqa: F401  (one_thread: autouse)

#: RoPE frequencies of a head dim of 64 (+ropemean turns the keys' offset by them)
INV_FREQ = tuple(10000.0 ** (-i / 32) for i in range(32))
QUERIES, START, ROWS = 20, 3, 45   # a call of many queries; rows [3, 48): two whole tiles and thirteen rows, unaligned


def _coded_cache(name: str):
    g = CacheGeometry(n_layers=1, n_kv_heads=2, head_dim=64, batch=1, capacity=80, n_heads=6, rope_inv_freq=INV_FREQ)
    cache = make_cache(name, g)
    if cache.code_kernel is None:
        require_kernel()
    gen = torch.Generator().manual_seed(5)
    cache.append(0, torch.randn(1, 2, 60, 64, generator=gen), torch.randn(1, 2, 60, 64, generator=gen))
    cache.attend(0, torch.randn(1, 6, 60, 64, generator=gen))   # the first chunk is coded after its first read
    assert cache._n_comp[0] >= START + ROWS
    return cache, gen


@pytest.mark.parametrize("name", ["tq4", "tq3", "tq-k4v4", "tq-k3v3+vq"])
def test_a_querys_scores_and_sums_do_not_depend_on_the_queries_read_with_it(name):
    cache, gen = _coded_cache(name)
    kernel = cache.code_kernel
    for codes, layout in ((cache.k_codes[0], cache.codec.layer_key_codes[0].layout), (cache.v_codes[0], cache.codec.layer_value_codes[0].layout)):
        rows = kernel.decode(codes, START, ROWS, layout)                         # (1, Hkv, ROWS, d) the plain reference
        q = torch.randn(1, 2, QUERIES, 64, generator=gen)
        scores = kernel.dots(codes, START, ROWS, layout, q)                     # (1, Hkv, QUERIES, ROWS)
        alone = torch.cat([kernel.dots(codes, START, ROWS, layout, q[:, :, i:i + 1]) for i in range(QUERIES)], dim=2)
        assert torch.equal(scores, alone), (name, (scores - alone).abs().max())
        torch.testing.assert_close(scores, q @ rows.transpose(-1, -2), atol=1e-4, rtol=1e-4)
        w = torch.softmax(torch.randn(1, 2, QUERIES, ROWS, generator=gen), dim=-1)
        sums = kernel.mix(codes, START, ROWS, layout, w)                        # (1, Hkv, QUERIES, d)
        alone = torch.cat([kernel.mix(codes, START, ROWS, layout, w[:, :, i:i + 1]) for i in range(QUERIES)], dim=2)
        assert torch.equal(sums, alone), (name, (sums - alone).abs().max())
        torch.testing.assert_close(sums, w @ rows, atol=1e-5, rtol=1e-4)
