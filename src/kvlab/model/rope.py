"""RoPE frequencies per layer kind of the hybrid decoders (model/hybrid.py), also given to caches that code keys
before RoPE (+prerope, model/layer_caches.py)."""

from __future__ import annotations

import torch

from .config import DecoderConfig


def inv_freq(theta: float, dim: int, linear_factor: float = 0.0) -> torch.Tensor:
    """(dim/2,) fp32 RoPE inverse frequencies for `dim` rotated dims, divided by a linear scaling factor when given.
    Computed on the CPU in fp64 (see llama.rope_inv_freq)."""
    freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
    if linear_factor:
        freq = freq / linear_factor
    return freq.float()


def kind_frequencies(cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    """{"full": ..., "sliding": ...}: each attention kind's (rope_dim/2,) frequencies (Gemma 3: bases and scaling differ)."""
    return {"full": inv_freq(cfg.rope_theta, cfg.rope_dim, cfg.rope_linear_factor),
            "sliding": inv_freq(cfg.rope_theta_local or cfg.rope_theta, cfg.rope_dim)}
