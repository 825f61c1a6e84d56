"""Bit packing: n codes of b bits (b = 1..8) stored in ceil(n·b/8) bytes of uint8.

Codes are packed little-endian along the last axis: code i occupies bits [i·b, (i+1)·b) of the
byte string, bit 0 being the least significant bit of byte 0. Widths that divide 8 (1, 2, 4, 8)
use shifts on bytes; the others (3, 5, 6, 7) go through groups of 8 codes = b bytes held in an
int64, so every width costs exactly n·b bits (rounded up to a whole byte at the end of a row).
"""

from __future__ import annotations

import torch

from ..errors import ConfigError


def packed_nbytes(n_codes: int, bits: int) -> int:
    """Bytes that hold `n_codes` codes of `bits` bits: ceil(n·b / 8)."""
    _check_bits(bits)
    return (n_codes * bits + 7) // 8


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., n) integer codes in [0, 2^bits) -> (..., ceil(n·bits/8)) uint8."""
    _check_bits(bits)
    n = codes.shape[-1]
    lead = codes.shape[:-1]
    if bits == 8:
        return codes.to(torch.uint8)
    if 8 % bits == 0:
        per_byte = 8 // bits
        padded = _pad_last(codes.to(torch.uint8), per_byte)                       # (..., n')
        grouped = padded.reshape(*lead, -1, per_byte)                              # (..., n'/k, k)
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)  # (k,)
        return (grouped << shifts).sum(dim=-1, dtype=torch.uint8)[..., : packed_nbytes(n, bits)]
    padded = _pad_last(codes.to(torch.int64), 8)                                   # (..., n') n' % 8 == 0
    grouped = padded.reshape(*lead, -1, 8)                                         # (..., n'/8, 8)
    shifts = torch.arange(0, 8 * bits, bits, dtype=torch.int64, device=codes.device)
    words = (grouped << shifts).sum(dim=-1)                                        # (..., n'/8) 8·b bits each
    byte_shifts = torch.arange(0, 8 * bits, 8, dtype=torch.int64, device=codes.device)
    out = ((words[..., None] >> byte_shifts) & 0xFF).to(torch.uint8)               # (..., n'/8, b)
    return out.reshape(*lead, -1)[..., : packed_nbytes(n, bits)]


def unpack(packed: torch.Tensor, bits: int, n_codes: int) -> torch.Tensor:
    """(..., ceil(n·bits/8)) uint8 -> (..., n) int64 codes; the inverse of `pack`."""
    _check_bits(bits)
    lead = packed.shape[:-1]
    if bits == 8:
        return packed[..., :n_codes].to(torch.int64)
    if 8 % bits == 0:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)  # (k,)
        codes = (packed[..., None] >> shifts) & ((1 << bits) - 1)                   # (..., bytes, k)
        return codes.reshape(*lead, -1)[..., :n_codes].to(torch.int64)
    padded = _pad_last(packed, bits)                                                # (..., 8·m/… ) whole words
    grouped = padded.reshape(*lead, -1, bits).to(torch.int64)                      # (..., words, b)
    byte_shifts = torch.arange(0, 8 * bits, 8, dtype=torch.int64, device=packed.device)
    words = (grouped << byte_shifts).sum(dim=-1)                                   # (..., words)
    shifts = torch.arange(0, 8 * bits, bits, dtype=torch.int64, device=packed.device)
    codes = (words[..., None] >> shifts) & ((1 << bits) - 1)                       # (..., words, 8)
    return codes.reshape(*lead, -1)[..., :n_codes]


def _pad_last(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero-pad the last axis up to a multiple of `multiple`."""
    extra = (-x.shape[-1]) % multiple
    if extra == 0:
        return x
    return torch.cat([x, x.new_zeros(*x.shape[:-1], extra)], dim=-1)


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ConfigError(f"code width must be an integer number of bits in 1..8, got {bits!r}")
