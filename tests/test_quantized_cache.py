"""QuantizedCache (int8 / int4, KIVI-style) and the behaviour shared by every compressed cache."""

import pytest
import torch
from .compressed_checks import (GEOMETRY, check_attend_is_token_by_token, check_code_kernel_equals_the_torch_path, check_nbytes,
                              check_non_finite_is_a_one_line_error, feed, relative_error)

from kvlab.cache import CacheGeometry, DenseCache, cache_names, describe_formula, expected_nbytes, make_cache
from kvlab.cache.names import PRESETS, parse
from kvlab.errors import CacheCapacityError, ConfigError, NonFiniteError

SMOLLM2 = CacheGeometry(n_layers=30, n_kv_heads=3, head_dim=64, capacity=512, n_heads=9)


@pytest.mark.parametrize("name", ["int8", "int4", "int4+g16", "int3+g8", "int4+recent8", "int8+fp-first-last+recent40",
                                  "int4+sink3", "int4+sink5+recent8"])
def test_attend_equals_dense_attention_over_what_token_by_token_decoding_stored(name):
    check_attend_is_token_by_token(name)


def test_sliding_window_geometry_is_respected():
    check_attend_is_token_by_token("int4+recent4", CacheGeometry(2, 2, 64, capacity=96, n_heads=4, window=20))


def test_int8_is_close_to_the_dense_cache():
    dense = DenseCache(GEOMETRY)
    for cache, q, k, v in feed("int8"):
        dense.reset()
        for layer in range(GEOMETRY.n_layers):
            dense.append(layer, k, v)
        torch.testing.assert_close(cache.attend(1, q), dense.attend(1, q), atol=2e-2, rtol=0)
    k_err, v_err = relative_error("int8")
    assert k_err < 0.01 and v_err < 0.01


def test_int4_error_is_that_of_16_levels():
    k_err, v_err = relative_error("int4")
    assert 0.03 < k_err < 0.12 and 0.03 < v_err < 0.12


@pytest.mark.parametrize("name", ["int8", "int4", "int4+g64", "int4+recent128", "int2+fp-first-last", "int4+recent600", "int4+fp-layers=1.2",
                                  "int4+sink1", "int4+sink3+recent40"])
def test_nbytes_equals_formula(name):
    check_nbytes(name)
    check_nbytes(name, SMOLLM2, torch.float32)


def test_int4_smollm2_bytes_per_token():
    # codes 32 B + key scale/zero 64 ch × 4 B / 32 tokens + value scale/zero 2 groups × 4 B, per vector
    per_token = 30 * 3 * 2 * (32 + 8)
    stage = 30 * 3 * 32 * 64 * 2  # the incomplete key group, bf16
    assert expected_nbytes("int4", SMOLLM2, torch.bfloat16, 512) == per_token * 512 + stage
    assert "32 tokens" in describe_formula("int4", SMOLLM2, torch.bfloat16)


def test_zero_constant_and_large_inputs():
    g = GEOMETRY
    cache = make_cache("int4", g)
    # one key group (32 tokens) each: keys share a scale per channel over a group
    zeros = torch.zeros(1, g.n_kv_heads, 32, g.head_dim)
    const = torch.full((1, g.n_kv_heads, 32, g.head_dim), 3.25)
    big = torch.randn(1, g.n_kv_heads, 32, g.head_dim) * 1e4
    cache.append(0, zeros, const)
    cache.append(0, const, zeros)
    cache.append(0, big, big)
    k, v = cache.dequantized(0)
    assert torch.equal(k[:, :, :32], zeros) and torch.equal(v[:, :, 32:64], zeros)
    torch.testing.assert_close(k[:, :, 32:64], const, atol=2e-3, rtol=0)
    torch.testing.assert_close(v[:, :, :32], const, atol=2e-3, rtol=0)
    assert ((k[:, :, 64:] - big).norm() / big.norm()) < 0.12
    out = cache.attend(0, torch.randn(1, g.n_heads, 32, g.head_dim))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_is_a_one_line_error(bad):
    check_non_finite_is_a_one_line_error("int4", bad, "k")


def test_beyond_float16_scales_is_a_clear_error():
    cache = make_cache("int8", GEOMETRY)
    with pytest.raises(NonFiniteError, match="float16"):
        cache.append(0, torch.full((1, 2, 1, 64), 1e6), torch.zeros(1, 2, 1, 64))


def test_capacity_and_reset():
    cache = make_cache("int4+recent8", CacheGeometry(1, 2, 64, capacity=10, n_heads=2))
    cache.append(0, torch.randn(1, 2, 10, 64), torch.randn(1, 2, 10, 64))
    with pytest.raises(CacheCapacityError):
        cache.append(0, torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64))
    cache.reset()
    assert cache.length == 0
    cache.append(0, torch.randn(1, 2, 4, 64), torch.randn(1, 2, 4, 64))
    assert cache.dequantized(0)[0].shape[2] == 4


def test_names_round_trip_and_errors():
    for name in cache_names():
        if name in ("dense", "dense-f16", "dense-bf16", "concat", "none"):
            continue
        _, config = parse(name)
        assert config.name == PRESETS.get(name, name)          # a preset prints as its recipe
    for bad, match in [("int9", "1..8"), ("int4+qjl", "unknown option"), ("tq-k4v4+g32", "unknown option"),
                       ("tq9", "1..8"), ("tq-k4v4+", "empty option"), ("int4+g48", "multiple")]:
        with pytest.raises(ConfigError, match=match):
            make_cache(bad, GEOMETRY)


@pytest.mark.parametrize("name", ["int8", "int4", "int4+g64", "int8+g16", "int4+sink2+recent8"])
def test_code_kernel_equals_the_torch_path(name):
    """Attention straight from the packed integer codes (C) against dequantize-then-matmul (torch)."""
    check_code_kernel_equals_the_torch_path(name, seed=11)
