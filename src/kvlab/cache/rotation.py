"""Seeded random rotations Π of R^d: randomized Hadamard for powers of two, random orthogonal otherwise.

Power of two:  Π = H·diag(s)/√d with H the Sylvester Hadamard matrix and s a seeded ±1 vector.
               The per-rotation state is s (d bytes of int8); H is a constant of d, built once per
               (d, device) and shared (a fused kernel would apply it as a fast Walsh-Hadamard transform).
Otherwise:     Π = Q from the QR decomposition of a seeded Gaussian matrix (sign-fixed so the law is
               Haar); the state is Q itself (d² float32).
`nbytes` counts the per-rotation state, so a cache that holds rotations can report them.
"""

from __future__ import annotations

from functools import lru_cache

import torch


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class Rotation:
    """An orthogonal map of the last axis: `apply(x)` = Πx, `invert(y)` = Πᵀy."""

    def __init__(self, dim: int, seed: int, device: torch.device | str = "cpu"):
        self.dim = dim
        self.seed = seed
        gen = torch.Generator().manual_seed(seed)
        self.hadamard = is_power_of_two(dim)
        if self.hadamard:
            signs = torch.randint(0, 2, (dim,), generator=gen, dtype=torch.int8) * 2 - 1
            self.signs = signs.to(device)                                          # (d,) ±1 int8: the state
            self._h = _hadamard(dim, str(torch.device(device)))                    # (d, d) shared constant
        else:
            gauss = torch.randn(dim, dim, generator=gen, dtype=torch.float64)
            q, r = torch.linalg.qr(gauss)
            q = q * torch.sign(torch.diagonal(r))[None, :]                         # Haar-distributed
            self.matrix = q.to(torch.float32).to(device)                           # (d, d) Π: the state

    @property
    def nbytes(self) -> int:
        """Bytes of the per-rotation state (sign vector, or the orthogonal matrix)."""
        return self.signs.nbytes if self.hadamard else self.matrix.nbytes

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Πx for x: (..., d) (computed in float32)."""
        if self.hadamard:
            return ((x.float() * self.signs) @ self._h) * self.dim ** -0.5         # H(s ⊙ x)/√d, H = Hᵀ
        return x.float() @ self.matrix.T                                           # (..., d)

    def invert(self, y: torch.Tensor) -> torch.Tensor:
        """Πᵀy for y: (..., d) (computed in float32)."""
        if self.hadamard:
            return ((y.float() @ self._h) * self.signs) * self.dim ** -0.5         # s ⊙ (Hy)/√d
        return y.float() @ self.matrix                                             # (..., d)


@lru_cache(maxsize=None)
def _hadamard(dim: int, device: str) -> torch.Tensor:
    """Sylvester Hadamard matrix of order dim (entries ±1), float32; H = Hᵀ, H·H = d·I."""
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return h.to(device)
