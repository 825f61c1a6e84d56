"""The integer formats' arithmetic (int1..int8, cache/quantized.py describes them): x ≈ zero + code·scale, with code in
[0, 2^b), scale = (max - min)/(2^b - 1) and zero = min in float16; keys per channel over a group of tokens, values per
group of channels of a token. The storage that holds the codes (cache/blocks.py IntBlocks) codes and reads through
these, for the single-sequence cache and the serving pool alike; kernels/intcodes.h is the same arithmetic in C.
"""

from __future__ import annotations

import torch

from ..errors import NonFiniteError

META = torch.float16           # scales and zero points
META_MAX = torch.finfo(META).max


def check_range(x: torch.Tensor, what: str) -> None:
    """A one-line error for entries beyond float16, where the scales and zero points cannot follow."""
    biggest = x.abs().max().item() if x.numel() else 0.0
    if biggest > META_MAX:
        raise NonFiniteError(f"{what} magnitude {biggest:.3g} exceeds the float16 range of the integer cache's scales")


def code_values(v: torch.Tensor, value_group: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values (..., Dv) coded per group of `value_group` channels of each token: codes (..., Dv) uint8 (unpacked), float16
    scales and zero points (..., Dv / value_group)."""
    vg = v.float().reshape(*v.shape[:-1], v.shape[-1] // value_group, value_group)    # (..., nvg, Gv)
    scale, zero = _affine(vg.amin(dim=-1), vg.amax(dim=-1), bits, "value")           # (..., nvg)
    return _encode(vg, scale[..., None], zero[..., None], bits).reshape(v.shape), scale, zero


def code_key_groups(groups: torch.Tensor, token_dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys coded per channel over each group's tokens (along `token_dim` of `groups`): codes shaped as `groups` uint8
    (unpacked), float16 scales and zero points shaped as `groups` without `token_dim`."""
    scale, zero = _affine(groups.amin(dim=token_dim), groups.amax(dim=token_dim), bits, "key")
    return _encode(groups, scale.unsqueeze(token_dim), zero.unsqueeze(token_dim), bits), scale, zero


def _affine(lo: torch.Tensor, hi: torch.Tensor, bits: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """float16 (scale, zero) for the range [lo, hi] with 2^bits levels."""
    check_range(lo, what)
    check_range(hi, what)
    zero = lo.to(META)
    scale = ((hi - zero.float()) / ((1 << bits) - 1)).to(META)
    return scale, zero


def _encode(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """round((x - zero)/scale) clamped to [0, 2^bits); a zero scale (constant group) gives code 0."""
    s = scale.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.round((x - zero.float()) / safe).clamp_(0, (1 << bits) - 1)
    return torch.where(s > 0, codes, torch.zeros_like(codes)).to(torch.uint8)
