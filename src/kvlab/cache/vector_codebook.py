"""Sign-symmetric 4-D vector codebooks for blocks of a rotated unit vector's coordinates (TurboQuant `+vq`).

A b-bit scalar code spends b bits on each coordinate alone; coding four coordinates together with 4b bits can place
its 2^(4b) points where the 4-D law puts its mass (a packing and shape gain no scalar code has). The law of a block is
symmetric under a sign flip of each coordinate, so the codebook is too: 4 bits of signs and a (4b-4)-bit index into
K = 2^(4b-4) magnitude points of the positive orthant (k-means on |block|): a block x codes as s = sign(x) and the
magnitude point m nearest |x|, and reads back as s ⊙ m. That keeps the codebook small (K·4 float32: 4 KiB at 3 bits,
256 bytes at 2) and the search a K-way argmax.

Measured on blocks of unit vectors in 64 dimensions (mean squared error per vector, ×d): 3 bits 0.0256 against the
scalar Lloyd-Max codes' 0.0333 (-23%), 2 bits 0.101 against 0.115 (-12%). Used for 2- and 3-bit parts: blocks of 4 at
4 bits would need 4,096 magnitude points (64 KiB, more bytes than they save at these lengths), and pairs at 4 bits
(-15% error) made SmolLM2's perplexity worse, not better (bench/vector_codes.py).

The magnitude points are found once per (d, b) by Lloyd's k-means in float64 on samples of the exact law (blocks of
seeded random unit vectors in d dimensions), started from seeded samples, and kept as JSON beside the scalar
codebooks (codebook.cache_dir), never pickled.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch

from .codebook import cache_dir, save_json
from .sizes import BLOCK, VECTOR_BITS, magnitude_points  # noqa: F401  (VECTOR_BITS: importable from here)

CODEBOOK_FORMAT = 1            # bump when the training changes: old files (and +vq recipes, quality/calibrate.py) are then ignored
_SAMPLE_VECTORS = 40_000       # unit vectors drawn per codebook (d/4 blocks each)
_ITERS = 40
_CHUNK = 1 << 16


@lru_cache(maxsize=None)
def magnitude_codebook(dim: int, bits: int) -> torch.Tensor:
    """(K, 4) float32 magnitude points for blocks of a unit vector in `dim` dimensions coded at `bits` per coordinate."""
    path = cache_dir() / f"vector_v{CODEBOOK_FORMAT}_d{dim}_b{bits}.json"
    points = _load(path, bits)
    if points is None:
        points = _train(dim, bits)
        save_json(path, {"format": CODEBOOK_FORMAT, "dim": dim, "bits": bits, "points": points.tolist()})
    return points


def _load(path: Path, bits: int) -> torch.Tensor | None:
    try:
        data = json.loads(path.read_text())
        points = torch.tensor(data["points"], dtype=torch.float32)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError):
        return None
    if data.get("format") != CODEBOOK_FORMAT or tuple(points.shape) != (magnitude_points(bits), BLOCK) or not torch.isfinite(points).all():
        return None
    return points


def _train(dim: int, bits: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * dim + bits)
    x = torch.randn(_SAMPLE_VECTORS, dim, generator=gen, dtype=torch.float64)
    x = (x / x.norm(dim=1, keepdim=True)).reshape(-1, BLOCK).abs()                # (N, 4) |blocks| of unit vectors
    k = magnitude_points(bits)
    points = x[torch.randperm(len(x), generator=gen)[:k]].clone()                  # (K, 4)
    for _ in range(_ITERS):
        nearest = torch.cat([nearest_point(x[i:i + _CHUNK], points) for i in range(0, len(x), _CHUNK)])
        sums = torch.zeros_like(points).index_add_(0, nearest, x)
        counts = torch.bincount(nearest, minlength=k).to(x.dtype)
        empty = counts == 0                                                         # reseed from the samples
        reseed = x[torch.randint(len(x), (k,), generator=gen)]
        points = torch.where(empty[:, None], reseed, sums / counts.clamp(min=1)[:, None])
    return points.float()


def nearest_point(magnitudes: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """(..., 4) |blocks| -> (...,) index of the nearest of the (K, 4) points (argmax of 2⟨m, p⟩ - ‖p‖²)."""
    score = 2 * magnitudes @ points.T - (points * points).sum(-1)                    # (..., K)
    return score.argmax(-1)
