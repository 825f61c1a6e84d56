"""Lloyd-Max codebooks for the rotated-coordinate law, and bit packing."""

import json
import math

import pytest
import torch

from kvlab.cache import codebook
from kvlab.cache.codebook import lloyd_max
from kvlab.cache.packing import pack, packed_nbytes, unpack
from kvlab.errors import ConfigError

# the paper's reported distortions of TurboQuant_mse at d = 128 (Table/Thm. 1 discussion)
PAPER_MSE = {1: 0.36, 2: 0.117, 3: 0.034, 4: 0.009}


@pytest.fixture(autouse=True)
def _private_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path))


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_expected_mse_matches_paper_and_bounds(bits):
    book = lloyd_max(128, bits)
    assert 4.0 ** -bits <= book.vector_mse <= math.sqrt(3) * math.pi / 2 * 4.0 ** -bits
    assert book.vector_mse == pytest.approx(PAPER_MSE[bits], rel=0.05)


def test_uniform_law_at_d3_has_the_uniform_quantizer():
    # at d = 3 a coordinate is uniform on [-1, 1]: levels at the cell midpoints, MSE = 1/(3·4^b) per coordinate
    book = lloyd_max(3, 2)
    assert book.centroids == pytest.approx((-0.75, -0.25, 0.25, 0.75), abs=1e-6)
    assert book.coord_mse == pytest.approx(1 / (3 * 16), rel=1e-4)


@pytest.mark.parametrize("dim", [2, 16, 64])
def test_codebook_is_symmetric_sorted_and_has_midpoint_boundaries(dim):
    book = lloyd_max(dim, 3)
    c = torch.tensor(book.centroids, dtype=torch.float64)
    assert torch.all(c[1:] > c[:-1])
    assert torch.allclose(c, -c.flip(0), atol=1e-12)
    assert torch.allclose(torch.tensor(book.boundaries, dtype=torch.float64), (c[1:] + c[:-1]) / 2)
    assert -1 < book.centroids[0] and book.centroids[-1] < 1


def test_codebook_is_saved_as_json_and_reused(tmp_path):
    codebook._cached.cache_clear()
    first = lloyd_max(32, 2)
    files = list((tmp_path / "codebooks").glob("*.json"))
    assert len(files) == 1
    record = json.loads(files[0].read_text())
    assert record["centroids"] == list(first.centroids)
    codebook._cached.cache_clear()
    record["centroids"][0] = -0.5  # a reload reads the file, not a recomputation
    files[0].write_text(json.dumps(record))
    assert lloyd_max(32, 2).centroids[0] == -0.5
    codebook._cached.cache_clear()


def test_bad_codebook_arguments_are_one_line_errors():
    with pytest.raises(ConfigError, match="1..8 bits"):
        lloyd_max(64, 9)
    with pytest.raises(ConfigError, match=">= 2"):
        lloyd_max(1, 2)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [1, 7, 8, 64, 67])
def test_pack_roundtrip_and_size(bits, n):
    codes = torch.randint(0, 1 << bits, (3, 2, n))
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (3, 2, packed_nbytes(n, bits))
    if n % 8 == 0:
        assert packed_nbytes(n, bits) == n * bits // 8
    assert torch.equal(unpack(packed, bits, n), codes)


def test_int4_packs_two_codes_per_byte_low_nibble_first():
    packed = pack(torch.tensor([1, 2, 15, 0]), 4)
    assert packed.tolist() == [0x21, 0x0F]


def test_three_bit_codes_are_a_two_bit_and_a_one_bit_plane():
    codes = torch.tensor([5, 3, 7, 0, 1, 2, 6, 4])            # high 2 bits: 2 1 3 0 0 1 3 2; low bit: 1 1 1 0 1 0 0 0
    packed = pack(codes, 3)
    assert packed.tolist() == [0b00_11_01_10, 0b10_11_01_00, 0b00010111]
    assert packed_nbytes(64, 3) == 24
