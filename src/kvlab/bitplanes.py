"""The bit planes of a packed code row: the layout the C readers (kernels/) and cache/packing.py share (no torch).

A width that divides 8 (1, 2, 4, 8) is one plane; other widths are bit-sliced into power-of-two planes, high
bits first (3 = 2 + 1, 5 = 4 + 1, 6 = 4 + 2, 7 = 4 + 2 + 1). Pure arithmetic, no tensors.
"""

from __future__ import annotations

from .errors import ConfigError


def planes(bits: int) -> list[tuple[int, int]]:
    """(width, shift) of each plane of a `bits`-bit code, widest first: 7 -> [(4, 3), (2, 1), (1, 0)]."""
    _check_bits(bits)
    out, shift = [], bits
    for width in (8, 4, 2, 1):
        if bits & width:
            shift -= width
            out.append((width, shift))
    return out


def packed_nbytes(n_codes: int, bits: int) -> int:
    """Bytes that hold `n_codes` codes of `bits` bits (Σ over planes of ⌈n·p/8⌉)."""
    return sum((n_codes * width + 7) // 8 for width, _ in planes(bits))


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ConfigError(f"code width must be an integer number of bits in 1..8, got {bits!r}")
