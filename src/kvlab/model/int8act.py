"""Int8 activations against GGUF blocks: the torch reference of kernels/q8gemm.c (an opt-in speed path).

Each 32-element block of an activation row becomes int8 codes with one fp32 scale (llama.cpp's Q8_1 recipe):
    amax = max |x|,  d = amax / 127,  q = round-half-even(x · (127 / amax)) ∈ [-127, 127],  s = Σ q
(amax < 2^-100: all zeros with d = 0; a block holding inf or nan: zeros with d = nan, so its outputs are nan).
A weight block is integer codes too (Q4_0: q - 8, Q4_1: q with its min m, Q8_0: q), so each block's product
is an exact integer dot isum; the output sums d_w · d_a · isum (+ m_w · d_a · s for Q4_1) over the blocks.

Accuracy: the activation rounding (≤ half a step, d_a / 2, per element) makes the result differ from the fp32
product by about 0.3 % of the row's magnitude — like llama.cpp's CPU path, and why this is never the default.
"""

from __future__ import annotations

import torch

from .blockquant import block_fields

QK = 32
TINY = 2.0 ** -100  # a block with a smaller amax quantizes to zeros (q8gemm.c's TINY)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (M, K) fp32 -> codes (M, K) int8, scales (M, K/32) fp32, sums (M, K/32) int32: q8gemm.c's bits exactly.

    Divisions are tensor / tensor (IEEE division, as in C): torch turns `127.0 / t` into a reciprocal times 127."""
    m, k = x.shape
    blocks = x.reshape(m, k // QK, QK)                                            # (M, B, 32)
    amax = blocks.abs().amax(-1)                                                  # (M, B)
    finite = torch.isfinite(blocks).all(-1)                                      # (M, B)
    live = finite & (amax >= TINY)                                               # (M, B)
    n127 = torch.full_like(amax, 127.0)
    inv = torch.where(live, n127 / torch.where(live, amax, n127), torch.zeros_like(amax))  # (M, B)
    scaled = torch.where(live[..., None], blocks * inv[..., None], torch.zeros_like(blocks))  # (M, B, 32)
    codes = torch.round(scaled).to(torch.int8)                                    # (M, B, 32), half to even
    scales = torch.where(live, amax / n127, torch.where(finite, torch.zeros_like(amax), torch.full_like(amax, float("nan"))))
    return codes.reshape(m, k), scales, codes.sum(-1, dtype=torch.int32)


def integer_dots(block_type: str, data: torch.Tensor, cols: int, codes: torch.Tensor) -> torch.Tensor:
    """Exact per-block integer dots: codes (M, K) int8 -> (M, N, B) int64 = Σ_c weight code · activation code."""
    w, _, _ = block_fields(block_type, data, cols)                                # (N, B, 32)
    a = codes.reshape(codes.shape[0], cols // QK, QK)                             # (M, B, 32)
    # float64 holds these sums exactly (|·| < 2^20), and einsum in float64 is far faster than in int64
    return torch.einsum("mbc,nbc->mnb", a.double(), w.double()).round().long()   # (M, N, B)


def int8_linear_reference(block_type: str, data: torch.Tensor, cols: int, x: torch.Tensor) -> torch.Tensor:
    """x (M, K) fp32 -> (M, N) float64: the quantized product, summed exactly (float64) over the blocks.

    The kernel sums the same fp32 terms in fp32 (one rounding per block), so it is within
    blocks × 2^-24 × Σ_b |term_b| of this; `term_magnitudes` gives that Σ."""
    terms = _block_terms(block_type, data, cols, x)                               # (M, N, B)
    return terms.sum(-1)


def term_magnitudes(block_type: str, data: torch.Tensor, cols: int, x: torch.Tensor) -> torch.Tensor:
    """Σ_b |term_b| (M, N) float64: the scale the kernel's fp32 summation error is measured against."""
    return _block_terms(block_type, data, cols, x, absolute=True).sum(-1)


def _block_terms(block_type: str, data: torch.Tensor, cols: int, x: torch.Tensor, absolute: bool = False) -> torch.Tensor:
    codes, scales, sums = quantize_rows(x)
    isum = integer_dots(block_type, data, cols, codes).double()                  # (M, N, B)
    _, d_w, m_w = block_fields(block_type, data, cols)                           # (N, B)
    scale = (d_w[None] * scales[:, None]).double()                                # (M, N, B): d_w · d_a rounded in fp32
    parts = [isum * scale]
    if m_w is not None:
        parts.append(m_w[None].double() * (scales * sums.float())[:, None].double())  # m_w · (d_a · s rounded in fp32)
    if absolute:
        return sum(p.abs() for p in parts)
    return sum(parts)
