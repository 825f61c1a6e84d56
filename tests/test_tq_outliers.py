"""TurboQuant +outliersN (dense-and-sparse keys): each key vector's N largest entries kept exactly, the rest coded."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvlab.cache import CacheGeometry, describe_formula, expected_nbytes, make_cache
from kvlab.cache.turboquant import OUTLIER_BYTES, TurboQuantCache
from kvlab.errors import ConfigError

from .compressed_checks import (GEOMETRY, check_attend_is_exact_chunked_and_token_by_token, check_attend_is_exact_to_storage,
                               check_code_kernel_equals_the_torch_path, check_nbytes)
from .test_key_levers import ROPED, rope_at
from .test_turboquant import SMOLLM2

NAMES = ["tq-k4v4+outliers2", "tq-k4v3.625+outliers1+sink2", "tq-k3v3+outliers3+center=none+kweights=none+recent8",
         "tq-k4v4+prerope+outliers1", "tq-k3v3+prerope+sink1+outliers2+recent8", "tq-k4v4+qjl+outliers1", "tq-k4v4+rot=haar+outliers1"]


@pytest.mark.parametrize("name", NAMES)
def test_attention_is_exact_to_the_stored_keys_with_their_outliers(name):
    """Chunked and token-by-token appends: attend() == softmax attention over dequantized() keys, i.e. the codes
    decoded plus the kept entries added back (the scores on the codes add q·k_sparse)."""
    check_attend_is_exact_chunked_and_token_by_token(name, ROPED)
    check_attend_is_exact_to_storage(name, ROPED, attend_first=True)


@pytest.mark.parametrize("name", ["tq-k4v4+outliers2", "tq-k3v3+outliers1+sink1"])
def test_scores_from_the_codes_in_c_equal_the_torch_path(name):
    check_code_kernel_equals_the_torch_path(name, seed=2)


def _stored(cache: TurboQuantCache, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return cache.k_out_idx[layer][:, :, :n].long(), cache.k_out_val[layer][:, :, :n]


def test_the_outliers_are_exactly_the_largest_entries():
    """Without offset and weights the coder sees k itself: the kept channels are top-N of |k|, the values k_c in
    float16; with them (the default) top-N of |(k-μ)/w| and the values k_c-μ_c."""
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(1, 2, 20, 64, generator=gen), torch.randn(1, 2, 20, 64, generator=gen)
    plain = make_cache("tq-k4v4+outliers3+center=none+kweights=none", GEOMETRY)
    plain.append(0, k, v)
    channels, values = _stored(plain, 0, 20)
    expected = k.abs().topk(3, dim=-1).indices
    assert torch.equal(channels.sort(-1).values, expected.sort(-1).values)
    assert torch.equal(values, k.gather(-1, channels).half())

    cache = make_cache("tq-k4v4+outliers3", GEOMETRY)
    cache.append(0, k, v)
    cache.attend(0, torch.randn(1, 6, 20, 64, generator=gen))                # codes the first chunk (key weights)
    centered = k - cache.codec.key_offset(0)                                          # (1, 2, 20, 64) k - μ
    channels, values = _stored(cache, 0, 20)
    expected = (centered / cache.codec.key_weights(0)).abs().topk(3, dim=-1).indices
    assert torch.equal(channels.sort(-1).values, expected.sort(-1).values)
    assert torch.equal(values, centered.gather(-1, channels).half())


def test_with_prerope_the_outliers_are_channels_of_the_keys_before_rope():
    """Keys = RoPE(x) with one huge pre-RoPE channel (a per-token sign: no offset removes it): +prerope keeps that
    channel for every token; without key weights (which already shrink such a channel) the coded vectors lose it
    from their norm, and the stored keys are far closer."""
    gen = torch.Generator().manual_seed(2)
    pre = torch.randn(1, 2, 40, 64, generator=gen)
    pre[..., 9] += 25.0 * torch.sign(torch.randn(1, 2, 40, generator=gen))
    k, v, q = rope_at(pre, 0), torch.randn(1, 2, 40, 64, generator=gen), torch.randn(1, 6, 40, 64, generator=gen)
    errors = {}
    for name in ("tq-k4v4+prerope+outliers1", "tq-k4v4+prerope+kweights=none+outliers1", "tq-k4v4+prerope+kweights=none"):
        cache = make_cache(name, ROPED)
        cache.append(0, k, v)
        cache.attend(0, q)
        errors[name] = ((cache.dequantized(0)[0] - k).norm() / k.norm()).item()
        if cache.config.outliers:
            assert (cache.k_out_idx[0][:, :, :40] == 9).all(), name
    assert errors["tq-k4v4+prerope+kweights=none+outliers1"] < errors["tq-k4v4+prerope+kweights=none"] / 2, errors


@pytest.mark.parametrize("name", ["tq-k4v4+outliers2", "tq-k4v3.625+prerope+outliers1+sink1"])
def test_bytes_are_the_formula_with_three_bytes_per_kept_entry(name):
    check_nbytes(name, ROPED)
    check_nbytes(name, replace(SMOLLM2, rope_inv_freq=ROPED.rope_inv_freq))
    base = make_cache(name, ROPED).config
    assert base.name == name
    without = replace(base, outliers=0).name
    g = ROPED
    assert (expected_nbytes(name, g, torch.bfloat16, 1) - expected_nbytes(without, g, torch.bfloat16, 1)
            == g.n_layers * g.n_kv_heads * base.spec.coded_rows(g.capacity) * base.outliers * OUTLIER_BYTES)   # coded rows
    assert "exact outlier entr" in describe_formula(name, g, torch.bfloat16)


def test_one_outlier_paid_by_values_at_3_625_bits_costs_exactly_tq4s_bytes_on_smollm2():
    g = replace(SMOLLM2, rope_inv_freq=ROPED.rope_inv_freq)
    ours = expected_nbytes("tq-k4v3.625+prerope+outliers1+sink1", g, torch.bfloat16, 511)
    tq4 = expected_nbytes("tq-k4v4+prerope+sink1", g, torch.bfloat16, 511)
    held_codebook_difference = ours - tq4                                      # one 3-bit codebook more, no more per token
    assert 0 < held_codebook_difference < 100 and ours / 511 <= 6227


@pytest.mark.parametrize("name, match", [
    ("tq-k4v4+outliers0", "keeps no key entry"),
    ("tq-k4v4+outliers65", "more entries than a key vector has"),
    ("tq-k4v4+outliers", "unknown option 'outliers'"),
])
def test_bad_outlier_counts_are_one_line_errors(name, match):
    with pytest.raises(ConfigError, match=match) as err:
        make_cache(name, GEOMETRY)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=match):
        expected_nbytes(name, GEOMETRY, torch.bfloat16, 1)


def test_head_dims_past_a_byte_refuse_it():
    with pytest.raises(ConfigError, match="uint8") as err:
        make_cache("tq-k4v4+outliers1", CacheGeometry(1, 1, 320, capacity=4))
    assert "\n" not in str(err.value)
