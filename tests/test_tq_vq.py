"""TurboQuant +vq: 2- and 3-bit codes in blocks of 4 rotated coordinates (sign-symmetric magnitude points).

The block codes cost the scalar codes' bytes, read back exactly what the coder chose, and have less error than the
scalar Lloyd-Max codes on the law they code (unit vectors after the rotation); the magnitude points are found once,
deterministically, kept as JSON and retrained when the file is damaged; a cache's attention is exact to what it stores
(chunked and token by token) and causal; its bytes are the planner's formula with the points counted; the C code
kernel decodes block codes exactly as torch does (the fused step codes and reads them too: tests/test_fused_codes.py),
and the serving pool holds them in the scalar codes' bytes."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from kvlab.cache import CacheGeometry, expected_nbytes, make_cache
from kvlab.cache import vector_codebook
from kvlab.cache.tq_codec import RotatedCodes
from kvlab.cache.vector_codebook import magnitude_codebook, magnitude_points
from kvlab.errors import ConfigError
from kvlab.kernels.codebook import codebook_kernel_for

from .compressed_checks import GEOMETRY, check_attend_is_exact_chunked_and_token_by_token, check_nbytes
from .kernel_checks import require_kernel
from .test_key_levers import ROPED
from .test_turboquant import SMOLLM2

NAMES = ["tq-k3v3+vq", "tq-k3v2+vq+sink1", "tq2.5+vq+prerope+recent8", "tq-k4v4+vq+halloc=k355344v444444"]   # ROPED: 3 layers × 2 KV heads


def unit_vectors(n: int, dim: int, seed: int = 0) -> torch.Tensor:
    x = torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))
    return x / x.norm(dim=1, keepdim=True)                                       # (n, d)


@pytest.mark.parametrize("bits, most", [(3, 0.85), (2, 0.95), (2.5, 0.95)])
def test_block_codes_cost_the_scalar_bytes_read_back_exactly_and_err_less(bits, most):
    y = unit_vectors(4000, 64)
    vector, scalar = RotatedCodes(64, bits, vector=True), RotatedCodes(64, bits)
    codes, values = vector.encode(y)
    assert codes.dtype == torch.uint8 and codes.shape == (4000, RotatedCodes.packed_bytes(64, bits))
    assert torch.equal(vector.decode(codes), values)
    mse = ((y - values) ** 2).sum(1).mean()
    scalar_mse = ((y - scalar.encode(y)[1]) ** 2).sum(1).mean()
    assert mse < most * scalar_mse, (mse, scalar_mse)
    assert vector.nbytes == RotatedCodes.table_bytes(64, bits, True, True)
    kernel = require_kernel()   # C reads the block parts from the layout: the same values, bit for bit
    decoded = codebook_kernel_for(torch.device("cpu")).decode(codes[None, None], 0, 4000, vector.layout)   # (1, 1, n, d)
    assert kernel is not None and torch.equal(decoded[0, 0], values)


def test_each_block_reads_back_as_its_signs_times_the_nearest_magnitude_point():
    y = unit_vectors(50, 32, seed=3)
    codes = RotatedCodes(32, 3, vector=True)
    values = codes.decode(codes.encode(y)[0]).reshape(50, 8, 4)                  # (n, blocks, 4)
    points = magnitude_codebook(32, 3)                                           # (K, 4)
    blocks = y.reshape(50, 8, 4)
    nearest = torch.cdist(blocks.abs().reshape(-1, 4), points).argmin(1)
    assert torch.equal(values.abs().reshape(-1, 4), points[nearest])
    assert torch.equal(values < 0, (blocks < 0) & (values != 0))


def test_4_bit_and_odd_parts_stay_scalar():
    assert not RotatedCodes(64, 4, vector=True).vector                           # 4 bits: scalar codes, C layout kept
    assert RotatedCodes(64, 4, vector=True).layout is not None
    mixed = RotatedCodes(64, 3.5, vector=True)                                   # 32 channels at 4 bits, 32 at 3
    assert [p is None for p in mixed.points] == [True, False]


def test_the_points_are_deterministic_kept_as_json_and_retrained_when_damaged(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path))
    magnitude_codebook.cache_clear()
    try:
        first = magnitude_codebook(16, 2)
        assert first.shape == (magnitude_points(2), 4) and (first >= 0).all()
        path = next((tmp_path / "codebooks").glob("vector_*_d16_b2.json"))
        assert json.loads(path.read_text())["points"] == first.tolist()
        path.write_text('{"format": 1, "points": [[1, 2]]}')                     # damaged: the wrong shape
        magnitude_codebook.cache_clear()
        assert torch.equal(magnitude_codebook(16, 2), first)                     # retrained, the same points
    finally:
        magnitude_codebook.cache_clear()


@pytest.mark.parametrize("name", NAMES)
def test_attention_is_exact_to_what_the_cache_stores(name):
    check_attend_is_exact_chunked_and_token_by_token(name, ROPED)


@pytest.mark.parametrize("name", NAMES)
def test_bytes_are_the_formula_with_the_points_counted(name):
    check_nbytes(name, ROPED)
    without = replace(make_cache(name, ROPED).config, vector=False).name
    points = expected_nbytes(name, ROPED, torch.bfloat16, 1) - expected_nbytes(without, ROPED, torch.bfloat16, 1)
    assert points != 0                                                           # the same codes, other tables


def test_the_tq3_class_recipe_with_block_codes_fits_the_issue_budget_on_smollm2():
    g = replace(SMOLLM2, rope_inv_freq=ROPED.rope_inv_freq)
    # floor(90 · 5.93) = 533 unit-bits: 90 key heads at 3 bits, 83 value heads at 3 and 7 at 2; the points (4 KiB at
    # 3 bits, 256 bytes at 2) and the sink position's unused row of codes cost 17.6 B/token at 511 tokens, which the
    # 0.02 bits less pays for
    name = "tq-k3v2.93+prerope+sink1+halloc=k" + "3" * 90 + "v" + "2" * 7 + "3" * 83
    assert 4690 < expected_nbytes(name + "+vq", g, torch.bfloat16, 511) / 511 <= 4702


@pytest.mark.parametrize("name, match", [("tq-k4v4+vq+qjl", r"\+vq .* without \+qjl"), ("tq-k4v4+vqq", "unknown option 'vqq'")])
def test_bad_names_are_one_line_errors(name, match):
    with pytest.raises(ConfigError, match=match) as err:
        make_cache(name, GEOMETRY)
    assert "\n" not in str(err.value)


def test_the_fused_step_and_the_serving_pool_hold_it_in_the_scalar_codes_bytes():
    """The pool's blocks hold +vq codes in tq-k3v3's bytes (its attention against the single cache: test_serve_compressed)."""
    from kvlab.model.fused_codes import serves_codes
    from kvlab.serve.formats import block_format
    from .conftest import tiny_model

    model = tiny_model(n_heads=4, n_kv_heads=2, d_model=256)
    assert serves_codes(make_cache("tq-k3v3+vq", CacheGeometry.for_model(model.config, capacity=16)), model.config)
    assert block_format("tq-k3v3+vq", GEOMETRY, 16).block_bytes == block_format("tq-k3v3", GEOMETRY, 16).block_bytes
    assert vector_codebook.VECTOR_BITS == (2, 3)


def test_a_vq_recipe_is_stored_under_its_codebooks_format():
    """A +vq recipe calibrated with other block codes (an older codebook format) is not found, so it is calibrated
    again; other recipes' paths do not change."""
    from kvlab.cache.vector_codebook import CODEBOOK_FORMAT
    from kvlab.quality.calibrate import recipe_path

    vq = recipe_path("ab" * 32, "tq-k3v3+vq+halloc")
    assert vq.name.endswith(f"-tq-k3v3+vq+halloc-vq{CODEBOOK_FORMAT}.json")
    assert recipe_path("ab" * 32, "tq-k3v3+halloc").name.endswith("-tq-k3v3+halloc.json")
