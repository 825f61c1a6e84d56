"""tq+prerope: keys coded before RoPE, RoPE applied when reading (exact to storage, causal, bytes counted)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvlab.cache import CacheGeometry, expected_nbytes, make_cache
from kvlab.errors import ConfigError
from kvlab.model.llama import apply_rope

from .compressed_checks import GEOMETRY, check_attend_is_exact_to_storage, check_nbytes
from .test_causal_caches import CHUNKS, SAME, chunked_logits, two_sequences

INV_FREQ = tuple((1.0 / 10000 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)).float().tolist())
ROPED = replace(GEOMETRY, rope_inv_freq=INV_FREQ)


def rope_at(x: torch.Tensor, start: int) -> torch.Tensor:
    """The model's RoPE for positions start .. start+T. x: (B, H, T, 64)."""
    angles = torch.outer(torch.arange(start, start + x.shape[2], dtype=torch.float32), torch.tensor(INV_FREQ))
    angles = torch.cat((angles, angles), dim=-1)
    return apply_rope(x, angles.cos(), angles.sin())


@pytest.mark.parametrize("name", ["tq4+prerope", "tq3+prerope+sink2", "tq4+prerope+recent8"])
def test_attention_is_exact_to_the_stored_keys(name):
    check_attend_is_exact_to_storage(name, ROPED)
    check_attend_is_exact_to_storage(name, ROPED, attend_first=True)


def test_bytes_are_the_formula_and_the_frequencies_are_counted():
    check_nbytes("tq4+prerope", ROPED)
    plain = expected_nbytes("tq4", ROPED, torch.bfloat16, 10)
    assert expected_nbytes("tq4+prerope", GEOMETRY, torch.bfloat16, 10) == plain + 32 * 4   # d/2 float32
    assert make_cache("tq4+prerope", ROPED).config.name == "tq4+prerope"


def test_without_the_models_rope_frequencies_it_is_a_one_line_error():
    with pytest.raises(ConfigError, match="prerope needs the model's RoPE frequencies"):
        make_cache("tq4+prerope", GEOMETRY)


def test_a_common_key_direction_turned_by_rope_is_coded_far_better_before_rope():
    """Keys = RoPE(m + noise) with one large common m (SmolLM2's keys are like this): the offset removes m
    whole only before RoPE."""
    gen = torch.Generator().manual_seed(4)
    common = 3 * torch.randn(1, 2, 1, 64, generator=gen)
    errors = {}
    for name in ("tq4", "tq4+prerope"):
        cache = make_cache(name, ROPED)
        keys, start = [], 0
        for T in (40, 1, 1, 20):
            k = rope_at(common + 0.5 * torch.randn(1, 2, T, 64, generator=gen), start)
            v = torch.randn(1, 2, T, 64, generator=gen)
            cache.append(0, k, v)
            cache.attend(0, torch.randn(1, 6, T, 64, generator=gen))
            keys.append(k)
            start += T
        k_all = torch.cat(keys, dim=2)
        errors[name] = ((cache.dequantized(0)[0] - k_all).norm() / k_all.norm()).item()
        gen = torch.Generator().manual_seed(4)
        common = 3 * torch.randn(1, 2, 1, 64, generator=gen)
    assert errors["tq4+prerope"] < errors["tq4"] / 2, errors


@pytest.fixture(scope="module")
def model():
    from .conftest import tiny_model
    from .test_causal_caches import SEQ

    return tiny_model(seed=3, n_heads=4, n_kv_heads=2, d_model=256, max_seq_len=SEQ)


def test_later_tokens_never_change_earlier_logits(model):
    tokens = two_sequences()
    a = chunked_logits(model, tokens[:1], "tq4+prerope", CHUNKS)
    b = chunked_logits(model, tokens[1:], "tq4+prerope", CHUNKS)
    assert torch.equal(a[:, :SAME], b[:, :SAME]) and not torch.equal(a[:, SAME:], b[:, SAME:])
    geometry = CacheGeometry.for_model(model.config, 1, 16)
    assert geometry.rope_inv_freq is not None and len(geometry.rope_inv_freq) == model.config.head_dim // 2
