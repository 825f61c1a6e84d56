"""DenseCache: K/V preallocated to a capacity and written in place (the gpt-fast static cache)."""

from __future__ import annotations

import torch

from .attention import grouped_attention
from .base import CacheGeometry, KVCache, copy_prefix, tensors_nbytes


class DenseCache(KVCache):
    """Two buffers of (layers, B, Hkv, capacity, D); token t of layer l lives at [l, :, :, t]."""

    def __init__(self, geometry: CacheGeometry, dtype: torch.dtype = torch.float32, device="cpu"):
        super().__init__(geometry, dtype, device)
        g = geometry
        self.k = torch.zeros(g.n_layers, g.batch, g.n_kv_heads, g.capacity, g.head_dim, dtype=dtype, device=self.device)
        self.v = torch.zeros(g.n_layers, g.batch, g.n_kv_heads, g.capacity, g.head_dim_v, dtype=dtype, device=self.device)

    @staticmethod
    def bytes_per_token(geometry: CacheGeometry, dtype: torch.dtype) -> int:
        """Per token of capacity, per sequence: 2 (K and V) × layers × kv_heads × head_dim × bytes."""
        g = geometry
        return g.n_layers * g.n_kv_heads * (g.head_dim + g.head_dim_v) * torch.empty(0, dtype=dtype).element_size()

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n_new = self._check_append(layer, k, v)
        start = self._lengths[layer]
        self.k[layer, :, :, start:start + n_new] = k   # (B, Hkv, T, D) written in place
        self.v[layer, :, :, start:start + n_new] = v
        self._lengths[layer] = start + n_new

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        self._check_attend(layer, q)
        n = self._lengths[layer]
        k = self.k[layer, :, :, :n]                    # (B, Hkv, S, D) view, no copy
        v = self.v[layer, :, :, :n]
        return grouped_attention(q, k, v, self.scale, window=self.geometry.window)

    def record_written(self, layers, n_new: int) -> None:
        """Count `n_new` tokens a kernel wrote in place into `layers` (the fused decode step, model/fused.py)."""
        for layer in layers:
            self._lengths[layer] += n_new

    def _copy_into(self, bigger: "DenseCache") -> None:
        super()._copy_into(bigger)
        copy_prefix(self.k, bigger.k)                  # (L, B, Hkv, capacity, D): tokens along the slot axis
        copy_prefix(self.v, bigger.v)

    @property
    def nbytes(self) -> int:
        return tensors_nbytes(self.k, self.v)
