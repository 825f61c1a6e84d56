"""TurboQuant +norms8: each vector's scale as an 8-bit log code around a per-layer, per-head centre.

The codes read back within half a step (2^(1/32), 2.2%) of the float32 scale the coder chose, a zero scale stays zero,
scales past ±8 octaves clamp; the centre is the first coded chunk's median log2 scale; attention is exact to what the
cache stores and causal; a grown copy keeps the centres; the bytes are the planner's formula (1 byte per vector, the
float16 centres counted); bad combinations are one-line errors; the fused step and the serving pool hold it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvlab.cache import expected_nbytes, make_cache
from kvlab.cache.tq_codec import LOG_NORM_STEPS, _log_centre, _log_norm_codes, _log_norm_values
from kvlab.errors import ConfigError

from .compressed_checks import GEOMETRY, check_attend_is_exact_chunked_and_token_by_token, check_nbytes, feed
from .test_key_levers import ROPED

NAMES = ["tq-k3v3+norms8", "tq-k4v4+norms8+prerope+sink1", "tq-k3v3+vq+norms8+halloc=k233344v333332+recent8"]   # 3 layers × 2 heads


def test_a_code_reads_back_as_one_float_exactly_whatever_the_vector_length():
    """2^(centre + (c-128)/16) as a float32 step times a power of two: the float64 value rounded once, and the same for
    a slice of any length (exp2's SIMD and scalar paths differ by an ulp; a grown hf cache read back other floats)."""
    centre = torch.tensor([[2.1875, -3.0625], [0.0, 17.5]], dtype=torch.float16)      # (B, H) multiples of 1/16
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).expand(2, 2, 256)     # (B, H, 256) every code
    full = _log_norm_values(codes, centre)
    exact = torch.tensor([[[2.0 ** (c.item() + (k - 128) / 16) if k else 0.0 for k in range(256)] for c in row] for row in centre],
                         dtype=torch.float64).float()
    assert torch.equal(full, exact)
    for n in (1, 7, 15, 16, 17, 33):
        assert torch.equal(_log_norm_values(codes[..., :n], centre), full[..., :n])


def test_codes_read_back_within_half_a_step_and_zero_stays_zero():
    scales = torch.exp2(torch.empty(2, 3, 500).uniform_(-7.0, 7.0, generator=torch.Generator().manual_seed(0)) + 3.0)
    scales[0, 0, :5] = 0.0
    centre = _log_centre(scales)                                                   # (2, 3)
    assert torch.equal(centre * LOG_NORM_STEPS, (centre * LOG_NORM_STEPS).round())
    back = _log_norm_values(_log_norm_codes(scales, centre), centre)
    live = scales > 0
    ratio = back[live] / scales[live]
    assert ratio.max() <= 2 ** (0.5 / LOG_NORM_STEPS) * (1 + 1e-6) and ratio.min() >= 2 ** (-0.5 / LOG_NORM_STEPS) * (1 - 1e-6)
    assert (back[~live] == 0).all()


def test_scales_past_eight_octaves_clamp_to_the_last_code():
    centre = torch.zeros(1, 1, dtype=torch.float16)
    codes = _log_norm_codes(torch.tensor([[[2.0 ** 20, 2.0 ** -20, 1.0]]]), centre)
    assert codes.tolist() == [[[255, 1, 128]]]


@pytest.mark.parametrize("name", NAMES)
def test_attention_is_exact_to_what_is_stored_in_the_formulas_bytes(name):
    """One byte per scale, the float16 centres counted."""
    check_attend_is_exact_chunked_and_token_by_token(name, ROPED)
    check_nbytes(name, ROPED)
    config = make_cache(name, ROPED).config
    g = replace(ROPED, capacity=64)
    with16 = expected_nbytes(replace(config, log_norms=False).name, g, torch.bfloat16, 1)
    vectors = g.n_layers * g.n_kv_heads * 2                                        # K and V per layer and head
    assert with16 - expected_nbytes(name, g, torch.bfloat16, 1) == vectors * config.spec.coded_rows(g.capacity) - vectors * 2


def test_the_centre_is_the_first_coded_chunks_median_and_a_grown_copy_keeps_it():
    *_, (cache, _, _, _) = feed("tq-k3v3+norms8", ROPED, chunks=(20, 5))
    stored = cache._buffers(0)                                                     # scales decoded, float32
    centre = cache.codec.norm_centres["k_norm"][0].float()                              # (B, H)
    first = stored["k_norm"][:, :, :20]
    assert (centre - first.log2().median(dim=-1).values).abs().max() <= 0.5 / LOG_NORM_STEPS + 1e-3
    bigger = cache.grown(cache.geometry.capacity + 8)
    assert torch.equal(bigger.codec.norm_centres["v_norm"][1], cache.codec.norm_centres["v_norm"][1])
    assert torch.equal(bigger.dequantized(0)[1], cache.dequantized(0)[1])


@pytest.mark.parametrize("name, match", [("tq-k4v4+norms8+qjl", r"\+norms8 .* without \+qjl"),
                                         ("tq-k4v4+norms8+bf16norms", r"\+norms8 .* \+bf16norms")])
def test_bad_combinations_are_one_line_errors(name, match):
    with pytest.raises(ConfigError, match=match) as err:
        make_cache(name, GEOMETRY)
    assert "\n" not in str(err.value)


def test_the_fused_step_and_the_serving_pool_hold_it_a_byte_per_scale():
    """The fused step reads the log codes in C (tests/test_fused_codes.py holds it to the modules); the pool's blocks
    hold a byte per scale, the centres in the shared state (its attention against the single cache:
    tests/test_serve_compressed.py)."""
    from kvlab.cache import CacheGeometry
    from kvlab.model.fused_codes import serves_codes
    from kvlab.serve.formats import block_format
    from .conftest import tiny_model

    model = tiny_model(n_heads=4, n_kv_heads=2, d_model=256)
    assert serves_codes(make_cache("tq-k3v3+norms8", CacheGeometry.for_model(model.config, capacity=16)), model.config)
    g = GEOMETRY
    vectors = g.n_layers * g.n_kv_heads * 2 * 16                                   # K and V of 16 tokens
    assert block_format("tq-k3v3", g, 16).block_bytes - block_format("tq-k3v3+norms8", g, 16).block_bytes == vectors
    assert block_format("tq-k3v3+norms8", g, 16).shared_bytes - block_format("tq-k3v3", g, 16).shared_bytes == g.n_layers * g.n_kv_heads * 2 * 2
