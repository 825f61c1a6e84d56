"""Bit packing: n codes of b bits (b = 1..8) stored in uint8, ⌈n·b/8⌉ bytes when 8 divides n.

A width that divides 8 (1, 2, 4, 8) packs 8/b codes per byte, low bits first: code i of a byte
sits at bits [i·b, (i+1)·b). Other widths are bit-sliced into power-of-two planes, high bits first
(3 = 2 + 1, 5 = 4 + 1, 6 = 4 + 2, 7 = 4 + 2 + 1): the plane of width p holds bits [s, s+p) of every
code, packed like a p-bit code, and the planes follow each other in the byte string. Every width
then unpacks with byte shifts only (no wide-integer arithmetic), which keeps reading a long cache
cheap; a plane costs ⌈n·p/8⌉ bytes, so the total is exactly n·b/8 bytes when 8 divides n.
"""

from __future__ import annotations

import torch

from ..bitplanes import packed_nbytes, planes  # noqa: F401  (packed_nbytes: the row bytes, importable from here)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., n) integer codes in [0, 2^bits) -> (..., packed_nbytes(n, bits)) uint8."""
    codes = codes.to(torch.uint8)
    parts = [_pack_plane((codes >> shift) & ((1 << width) - 1), width) for width, shift in planes(bits)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def unpack(packed: torch.Tensor, bits: int, n_codes: int) -> torch.Tensor:
    """(..., packed_nbytes(n, bits)) uint8 -> (..., n) int64 codes; the inverse of `pack`."""
    codes, offset = None, 0
    for width, shift in planes(bits):
        size = (n_codes * width + 7) // 8
        plane = _unpack_plane(packed[..., offset:offset + size], width, n_codes) << shift  # (..., n) uint8
        codes = plane if codes is None else codes | plane
        offset += size
    return codes.to(torch.int64)


def _pack_plane(codes: torch.Tensor, width: int) -> torch.Tensor:
    """(..., n) uint8 codes of `width` | 8 bits -> (..., ⌈n·width/8⌉) uint8, low bits first."""
    if width == 8:
        return codes
    per_byte = 8 // width
    n = codes.shape[-1]
    extra = (-n) % per_byte
    if extra:
        codes = torch.cat([codes, codes.new_zeros(*codes.shape[:-1], extra)], dim=-1)
    grouped = codes.reshape(*codes.shape[:-1], -1, per_byte)                      # (..., bytes, 8/w)
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=codes.device)
    return (grouped << shifts).sum(dim=-1, dtype=torch.uint8)


def _unpack_plane(packed: torch.Tensor, width: int, n_codes: int) -> torch.Tensor:
    """(..., bytes) uint8 -> (..., n) uint8 codes of `width` | 8 bits."""
    if width == 8:
        return packed[..., :n_codes]
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=packed.device)
    codes = (packed[..., None] >> shifts) & ((1 << width) - 1)                    # (..., bytes, 8/w)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * (8 // width))[..., :n_codes]   # (no -1: any row count, 0 too)
