"""ConcatCache: the textbook cache that grows with torch.cat every step (kept as a reference)."""

from __future__ import annotations

import torch

from .attention import grouped_attention
from .base import CacheGeometry, KVCache, tensors_nbytes


class ConcatCache(KVCache):
    """Per layer a (K, V) pair of (B, Hkv, S, D) tensors, reallocated by torch.cat on every append."""

    def __init__(self, geometry: CacheGeometry, dtype: torch.dtype = torch.float32, device="cpu"):
        super().__init__(geometry, dtype, device)
        self.k: list[torch.Tensor | None] = [None] * geometry.n_layers
        self.v: list[torch.Tensor | None] = [None] * geometry.n_layers

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n_new = self._check_append(layer, k, v)
        k, v = k.to(self.dtype), v.to(self.dtype)
        old_k, old_v = self.k[layer], self.v[layer]
        self.k[layer] = k if old_k is None else torch.cat([old_k, k], dim=2)  # (B, Hkv, S+T, D)
        self.v[layer] = v if old_v is None else torch.cat([old_v, v], dim=2)
        self._lengths[layer] += n_new

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        self._check_attend(layer, q)
        return grouped_attention(q, self.k[layer], self.v[layer], self.scale, window=self.geometry.window)

    def _copy_into(self, bigger: "ConcatCache") -> None:
        super()._copy_into(bigger)
        bigger.k, bigger.v = list(self.k), list(self.v)  # no preallocation: the tensors are shared, never written in place

    def reset(self) -> None:
        super().reset()
        self.k = [None] * self.geometry.n_layers
        self.v = [None] * self.geometry.n_layers

    @property
    def nbytes(self) -> int:
        return tensors_nbytes(*self.k, *self.v)


class NoCache(KVCache):
    """The baseline without a cache: K/V live only for the forward pass that made them.

    `persistent = False` tells generation to feed the whole sequence at every step, so every
    step recomputes all previous tokens' keys and values (the seed's "no cache" run).
    """

    persistent = False

    def __init__(self, geometry: CacheGeometry, dtype: torch.dtype = torch.float32, device="cpu"):
        super().__init__(geometry, dtype, device)
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._check_append(layer, k, v)
        self._pending[layer] = (k, v)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        self._check_attend(layer, q)
        k, v = self._pending.pop(layer)  # dropped as soon as it is read: nothing outlives the pass
        return grouped_attention(q, k, v, self.scale, window=self.geometry.window)

    @property
    def length(self) -> int:
        return 0  # every forward pass starts from position 0

    def reset(self) -> None:
        super().reset()
        self._pending.clear()

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self._pending.values())
