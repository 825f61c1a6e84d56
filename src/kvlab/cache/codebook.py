"""Lloyd-Max codebooks for one coordinate of a uniformly random unit vector in d dimensions.

After a random rotation, every coordinate x of a unit vector in R^d follows the same law,
    f_d(x) ∝ (1 - x²)^((d-3)/2)   on [-1, 1]
(arcsine at d = 2, uniform at d = 3, → N(0, 1/d) as d grows). TurboQuant quantizes each rotated
coordinate with the mean-squared-error-optimal scalar quantizer for f_d: 2^b levels (centroids)
and the midpoints between them (boundaries), found by Lloyd's iteration
    boundaries = midpoints of centroids;  centroid_i = E[x | x in cell i]
started from the high-resolution optimum (cells of equal mass under f^(1/3)).

The integrals are done on a fine grid in x = sin(φ), where the density becomes cos(φ)^(d-2) dφ
(smooth even at d = 2); cell masses and first moments come from cumulative sums interpolated at the
boundaries, so each Lloyd step costs O(2^b · log grid). A codebook depends only on (d, b): it is
computed once per process (lru_cache) and stored as JSON under the user cache directory
($KVLAB_CACHE_DIR, else $XDG_CACHE_HOME/kvlab, else ~/.cache/kvlab), never pickled.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from .. import paths
from ..errors import ConfigError

_FORMAT = 1             # bump when the algorithm changes: old files are then ignored
_GRID = 1 << 18         # integration points over the support
_MAX_ITERS = 20000
_TOL = 1e-13


@dataclass(frozen=True)
class Codebook:
    """The b-bit Lloyd-Max quantizer for one coordinate of a random unit vector in `dim` dims."""

    dim: int
    bits: int
    centroids: tuple[float, ...]    # 2^b increasing reconstruction levels
    boundaries: tuple[float, ...]   # 2^b - 1 decision thresholds (midpoints)
    coord_mse: float                # E[(x - q(x))²] for one coordinate

    @property
    def vector_mse(self) -> float:
        """Expected ‖y - ŷ‖² for a unit vector y: dim × the per-coordinate error."""
        return self.dim * self.coord_mse


def lloyd_max(dim: int, bits: int) -> Codebook:
    """The codebook for (dim, bits), from memory, the on-disk cache, or computed (then saved)."""
    if not isinstance(dim, int) or dim < 2:
        raise ConfigError(f"codebook dimension must be an integer >= 2, got {dim!r}")
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ConfigError(f"codebook width must be 1..8 bits, got {bits!r}")
    return _cached(dim, bits)


@lru_cache(maxsize=None)
def _cached(dim: int, bits: int) -> Codebook:
    path = cache_dir() / f"lloyd_max_v{_FORMAT}_d{dim}_b{bits}.json"
    book = _load(path, dim, bits)
    if book is None:
        book = _solve(dim, bits)
        _save(path, book)
    return book


def cache_dir() -> Path:
    """Where computed codebooks are kept between runs."""
    return paths.cache_dir() / "codebooks"


def _load(path: Path, dim: int, bits: int) -> Codebook | None:
    try:
        data = json.loads(path.read_text())
        book = Codebook(dim, bits, tuple(data["centroids"]), tuple(data["boundaries"]), float(data["coord_mse"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if data.get("format") != _FORMAT or len(book.centroids) != 1 << bits or len(book.boundaries) != (1 << bits) - 1:
        return None
    return book


def _save(path: Path, book: Codebook) -> None:
    save_json(path, {"format": _FORMAT, "dim": book.dim, "bits": book.bits, "centroids": list(book.centroids),
                     "boundaries": list(book.boundaries), "coord_mse": book.coord_mse})


def save_json(path: Path, record: dict) -> None:
    """Atomic write (tmp + rename); a read-only cache directory only costs a recomputation next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(path)
    except OSError:
        pass


class _Law:
    """f_d on a grid, with cumulative mass F, first moment M and second moment S (all at grid points)."""

    def __init__(self, dim: int, log_density_exponent: float = 1.0):
        # the support that matters: |x| up to ~14 standard deviations (1/√d), never past ±1
        phi_max = math.asin(min(1.0, 14.0 / math.sqrt(dim)))
        phi = np.linspace(-phi_max, phi_max, _GRID)                                # (N,)
        # density in φ: f(sin φ)·cos φ ∝ cos(φ)^(d-2); with an exponent p: f^p·cos φ ∝ cos^(p(d-3)+1)
        power = log_density_exponent * (dim - 3) + 1.0
        with np.errstate(divide="ignore"):
            log_w = power * np.log(np.cos(phi))
        log_w[~np.isfinite(log_w)] = -np.inf
        w = np.exp(log_w - log_w[np.isfinite(log_w)].max())
        w /= w.sum()
        self.x = np.sin(phi)                                                       # (N,) increasing
        self.F = np.concatenate([[0.0], np.cumsum(w)])                             # (N+1,)
        self.M = np.concatenate([[0.0], np.cumsum(w * self.x)])
        self.S = np.concatenate([[0.0], np.cumsum(w * self.x * self.x)])
        # cumulative sums are indexed by cell edges: edge j sits halfway between grid points j-1 and j
        mid = (self.x[1:] + self.x[:-1]) / 2
        self.edges = np.concatenate([[-1.0 - 1e-12], mid, [1.0 + 1e-12]])         # (N+1,)

    def cumulative(self, t: np.ndarray, table: np.ndarray) -> np.ndarray:
        return np.interp(t, self.edges, table)


def _solve(dim: int, bits: int) -> Codebook:
    levels = 1 << bits
    law = _Law(dim)
    # start: equal-mass cells under f^(1/3) (the high-resolution optimum), centroid = conditional mean
    companded = _Law(dim, log_density_exponent=1.0 / 3.0)
    quantiles = np.interp(np.arange(1, levels) / levels, companded.F[1:], companded.x)
    centroids = _centroids(law, quantiles)
    for _ in range(_MAX_ITERS):
        boundaries = (centroids[1:] + centroids[:-1]) / 2
        new = _centroids(law, boundaries)
        done = np.max(np.abs(new - centroids)) < _TOL
        centroids = new
        if done:
            break
    centroids = (centroids - centroids[::-1]) / 2        # the law is symmetric: make the codebook exactly so
    boundaries = (centroids[1:] + centroids[:-1]) / 2
    return Codebook(dim, bits, tuple(float(c) for c in centroids), tuple(float(b) for b in boundaries),
                    _mse(law, centroids, boundaries))


def _centroids(law: _Law, boundaries: np.ndarray) -> np.ndarray:
    """Conditional means of the cells cut by `boundaries` (a cell of zero mass keeps its midpoint)."""
    t = np.concatenate([[-1.0], boundaries, [1.0]])
    mass = np.diff(law.cumulative(t, law.F))
    moment = np.diff(law.cumulative(t, law.M))
    fallback = (t[1:] + t[:-1]) / 2
    return np.where(mass > 1e-300, moment / np.maximum(mass, 1e-300), fallback)


def _mse(law: _Law, centroids: np.ndarray, boundaries: np.ndarray) -> float:
    """Σ_cells ∫ (x - c)² f = S - 2cM + c²F over each cell."""
    t = np.concatenate([[-1.0], boundaries, [1.0]])
    mass = np.diff(law.cumulative(t, law.F))
    first = np.diff(law.cumulative(t, law.M))
    second = np.diff(law.cumulative(t, law.S))
    return float(np.sum(second - 2 * centroids * first + centroids * centroids * mass))
