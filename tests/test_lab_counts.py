"""Lab experiment 2: the instrumented counts equal Σk², n(n+1)/2 and n."""

from __future__ import annotations

import pytest
import torch

from kvlab.measure import torch_threads
from kvlab.lab.counts import (COUNTS_CONFIG, CountingCache, forward_macs, generation_macs, run_counts, sum_squares,
                              triangle)
from .conftest import tiny_model


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def test_the_seed_numbers():
    assert sum_squares(100) == 338_350 and sum_squares(1000) == 333_833_500
    assert triangle(100) == 5_050 and triangle(1000) == 500_500


@pytest.mark.parametrize("n", [1, 2, 7, 64])
def test_counted_equals_formulas(n):
    (record,) = run_counts([n])
    assert COUNTS_CONFIG.n_layers == 1 and COUNTS_CONFIG.n_heads == 1
    assert record.forward_passes == n
    assert record.scores_no_cache == sum_squares(n)
    assert record.scores_cache == triangle(n)
    assert record.kv_proj_no_cache == triangle(n)
    assert record.kv_proj_cache == n
    assert record.matches and record.record()["matches_formula"]


def test_per_block_per_head_on_a_gqa_model():
    model = tiny_model(n_heads=4, n_kv_heads=2)            # 2 blocks, 4 query heads, 2 KV heads
    (record,) = run_counts([12], model=model)
    assert record.matches
    assert record.scores_total_no_cache == sum_squares(12) * 2 * 4
    assert record.scores_total_cache == triangle(12) * 2 * 4


def test_counting_cache_delegates_storage():
    model = tiny_model()
    from kvlab.cache import CacheGeometry, make_cache

    cache = CountingCache(make_cache("dense", CacheGeometry.for_model(model.config, capacity=8)))
    with torch.inference_mode():
        model(torch.arange(5)[None], cache)
    assert cache.length == 5 and cache.nbytes == cache.inner.nbytes
    assert cache.scores == [1 * 4 * 5 * 5] * 2                 # B × H × T × S per layer


def test_forward_macs_attention_term_is_the_counted_scores():
    cfg = tiny_model().config
    T, S = 3, 10
    attention = forward_macs(cfg, T, S) - forward_macs(cfg, T, 0)
    assert attention == cfg.n_layers * cfg.n_heads * T * S * 2 * cfg.head_dim
    cached = generation_macs(cfg, 16, 5, cached=True)
    assert len(cached) == 5 and cached[0] == forward_macs(cfg, 16, 16) and cached[1] == forward_macs(cfg, 1, 17)
