"""The bytes of codes, as plain integer arithmetic (no torch): what the formats' bytes formula (format.py) and the
caches that hold the codes (packing.py, turboquant.py, vector_codebook.py) share.

    packed_nbytes(n, b)      n codes of b bits, bit-sliced into power-of-two planes (packing.py)
    width_split(d, b)        a fractional width b: (⌊b⌋, the channels at ⌊b⌋+1 bits)
    codes_nbytes(d, b)       one rotated vector of d coordinates at width b (TurboQuant's RotatedCodes)
    table_nbytes(d, b, ...)  the float32 codebook (or block-code points) one width holds
"""

from __future__ import annotations

import math

from ..errors import ConfigError
from ..bitplanes import packed_nbytes, planes  # noqa: F401  (the bit-plane layout C reads)

#: +vq: coordinates coded together, and the part widths coded in blocks (others stay scalar)
BLOCK = 4
VECTOR_BITS = (2, 3)


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def width_split(dim: int, bits: float) -> tuple[int, int]:
    """(⌊b⌋, the channels at ⌊b⌋+1 bits); a ConfigError (one line) when b does not split d into whole channels."""
    low = math.floor(bits)
    n_high = round((bits - low) * dim)
    if not math.isclose(n_high, (bits - low) * dim, abs_tol=1e-9):
        raise ConfigError(f"{bits:g} bits does not split a head dim of {dim} into whole channels")
    return low, n_high


def codes_nbytes(dim: int, bits: float) -> int:
    """Bytes of one vector's codes at a possibly fractional width (its high and low parts packed apart)."""
    low, n_high = width_split(dim, bits)
    return (packed_nbytes(n_high, low + 1) if n_high else 0) + packed_nbytes(dim - n_high, low)


def magnitude_points(bits: int) -> int:
    """K: the magnitude points of a b-bit block code (4b bits = 4 sign bits + log2 K)."""
    return 1 << (BLOCK * bits - BLOCK)


def is_vector_part(channels: int, bits: int) -> bool:
    """Whether +vq codes a part of `channels` coordinates at `bits` in blocks (2 or 3 bits, whole blocks of 4)."""
    return bits in VECTOR_BITS and channels % BLOCK == 0


def table_nbytes(dim: int, bits: float, byte_tables: bool = True, vector: bool = False) -> int:
    """Bytes of the float32 centroids + boundaries (+ byte tables for 1, 2, 4, 8 bits) held for this width, or of
    a block-coded part's points (K·4 float32)."""
    low, n_high = width_split(dim, bits)
    parts = ([(n_high, low + 1)] if n_high else []) + ([(dim - n_high, low)] if dim > n_high else [])
    return sum(4 * magnitude_points(b) * BLOCK if vector and is_vector_part(n, b)
               else 4 * ((1 << b) + (1 << b) - 1 + (256 * (8 // b) if byte_tables and 8 % b == 0 else 0))
               for n, b in parts)
