"""Rotary position embeddings (RoPE): the inverse frequencies of a decoder's config and the rotation itself.

On the ground floor: the model rotates queries and keys with it, and the caches that code keys before RoPE
(TurboQuant +prerope) turn keys back and rebuild them with the same frequencies.
"""

from __future__ import annotations

import math

import torch


def rope_inv_freq(cfg) -> torch.Tensor:
    """(head_dim/2,) fp32 inverse frequencies of a decoder config (its rope_theta, head_dim, rope_scaling and
    rope_freq_factors), with Llama 3's scaling (config) or frequency factors (GGUF).
    Computed on the CPU whatever the default device: on the meta device (the loader's) these few ops would
    import torch's Python decompositions (sympy included, ~70 MiB resident)."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64, device="cpu") / cfg.head_dim))
    scaling = cfg.rope_scaling
    if scaling is not None:
        low_wavelen = scaling.original_max_position / scaling.low_freq_factor
        high_wavelen = scaling.original_max_position / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq, scaled)
    if cfg.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(cfg.rope_freq_factors, dtype=torch.float64, device="cpu")
    return inv_freq.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + D/2) of each head: x (B, H, T, D), cos/sin (T, D)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


# -- per layer kind (the hybrid decoders, model/hybrid.py, and their +prerope caches) ------------------------------

def inv_freq(theta: float, dim: int, linear_factor: float = 0.0) -> torch.Tensor:
    """(dim/2,) fp32 RoPE inverse frequencies for `dim` rotated dims, divided by a linear scaling factor when given.
    Computed on the CPU in fp64 (as rope_inv_freq)."""
    freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
    if linear_factor:
        freq = freq / linear_factor
    return freq.float()


def kind_frequencies(cfg) -> dict[str, torch.Tensor]:
    """{"full": ..., "sliding": ...}: each attention kind's (rope_dim/2,) frequencies (Gemma 3: bases and scaling differ)."""
    return {"full": inv_freq(cfg.rope_theta, cfg.rope_dim, cfg.rope_linear_factor),
            "sliding": inv_freq(cfg.rope_theta_local or cfg.rope_theta, cfg.rope_dim)}
