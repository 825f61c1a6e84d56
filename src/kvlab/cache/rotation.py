"""Seeded random rotations Π of R^d: randomized Hadamard for powers of two, random orthogonal otherwise.

Power of two:  Π = H·diag(s)/√d with H the Sylvester Hadamard matrix and s a seeded ±1 vector.
               The per-rotation state is s (d bytes of int8); H is a constant of d, built once per
               (d, device) and shared (a fused kernel would apply it as a fast Walsh-Hadamard transform).
Otherwise:     Π = Q from the QR decomposition of a seeded Gaussian matrix (sign-fixed so the law is
               Haar); the state is Q itself (d² float32).
Shared basis:  Π = Q·diag(s) with Q a Haar matrix (`haar_matrix`) that several rotations share and s
               their own seeded ±1 vector: each Π is Haar-distributed (the law is invariant under an
               orthogonal factor), the state is s (d bytes); Q is its owner's to count, once. For powers
               of two where a randomized Hadamard is not wanted: it misses the paper's worst-case bound
               on inputs along a basis vector, a Haar rotation meets it.
`nbytes` counts the per-rotation state, so a cache that holds rotations can report them.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .sizes import is_power_of_two


class Rotation:
    """An orthogonal map of the last axis: `apply(x)` = Πx, `invert(y)` = Πᵀy."""

    def __init__(self, dim: int, seed: int, device: torch.device | str = "cpu", basis: torch.Tensor | None = None):
        """basis: a shared (d, d) Haar matrix Q (see the module docstring); None: Hadamard or a matrix of its own."""
        self.dim = dim
        self.seed = seed
        gen = torch.Generator().manual_seed(seed)
        self.basis = basis
        self.hadamard = basis is None and is_power_of_two(dim)
        if basis is not None or self.hadamard:
            signs = torch.randint(0, 2, (dim,), generator=gen, dtype=torch.int8) * 2 - 1
            self.signs = signs.to(device)                                          # (d,) ±1 int8: the state
        if self.hadamard:
            self._h = _hadamard(dim, str(torch.device(device)))                    # (d, d) shared constant
        elif basis is None:
            self.matrix = haar_matrix(dim, gen).to(device)                          # (d, d) Π: the state

    @property
    def nbytes(self) -> int:
        """Bytes of the per-rotation state (sign vector, or the orthogonal matrix; a shared basis is not counted here)."""
        return self.matrix.nbytes if self.basis is None and not self.hadamard else self.signs.nbytes

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Πx for x: (..., d) (computed in float32)."""
        if self.hadamard:
            return ((x.float() * self.signs) @ self._h) * self.dim ** -0.5         # H(s ⊙ x)/√d, H = Hᵀ
        if self.basis is not None:
            return (x.float() * self.signs) @ self.basis.T                         # Q(s ⊙ x)
        return x.float() @ self.matrix.T                                           # (..., d)

    def invert(self, y: torch.Tensor) -> torch.Tensor:
        """Πᵀy for y: (..., d) (computed in float32)."""
        if self.hadamard:
            return ((y.float() @ self._h) * self.signs) * self.dim ** -0.5         # s ⊙ (Hy)/√d
        if self.basis is not None:
            return (y.float() @ self.basis) * self.signs                           # s ⊙ (Qᵀy)
        return y.float() @ self.matrix                                             # (..., d)


def haar_matrix(dim: int, gen: torch.Generator) -> torch.Tensor:
    """A Haar-distributed (d, d) float32 orthogonal matrix: QR of a Gaussian matrix, columns sign-fixed."""
    gauss = torch.randn(dim, dim, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(gauss)
    return (q * torch.sign(torch.diagonal(r))[None, :]).to(torch.float32)


@lru_cache(maxsize=None)
def _hadamard(dim: int, device: str) -> torch.Tensor:
    """Sylvester Hadamard matrix of order dim (entries ±1), float32; H = Hᵀ, H·H = d·I."""
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return h.to(device)
