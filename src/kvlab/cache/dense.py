"""DenseCache: K/V preallocated to a capacity and written in place (the gpt-fast static cache).

The storage dtype may be narrower than the run's compute dtype (`dense-f16`, `dense-bf16` in a fp32 run:
what llama.cpp and vLLM store by default): K/V are rounded to it when written, and attention reads them
back chunk by chunk, upcast to the compute dtype (attention.chunked_attention), never as a whole-context copy.
"""

from __future__ import annotations

import torch

from ..errors import NonFiniteError
from .attention import chunked_attention, grouped_attention
from .base import CacheGeometry, KVCache, copy_prefix, tensors_nbytes

class DenseCache(KVCache):
    """Two buffers of (layers, B, Hkv, capacity, D); token t of layer l lives at [l, :, :, t].
    `storage`: the dtype of those buffers (default: `dtype`, the compute dtype)."""

    kernel_format = "dense"   # the fused C steps read and write it in place

    def __init__(self, geometry: CacheGeometry, dtype: torch.dtype = torch.float32, device="cpu",
                 storage: torch.dtype | None = None):
        super().__init__(geometry, dtype, device)
        g = geometry
        self.storage = storage or dtype
        self.k = torch.zeros(g.n_layers, g.batch, g.n_kv_heads, g.capacity, g.head_dim, dtype=self.storage, device=self.device)
        self.v = torch.zeros(g.n_layers, g.batch, g.n_kv_heads, g.capacity, g.head_dim_v, dtype=self.storage, device=self.device)

    @staticmethod
    def bytes_per_token(geometry: CacheGeometry, dtype: torch.dtype) -> int:
        """Per token of capacity, per sequence: 2 (K and V) × layers × kv_heads × head_dim × bytes of the
        storage dtype."""
        g = geometry
        return g.n_layers * g.n_kv_heads * (g.head_dim + g.head_dim_v) * torch.empty(0, dtype=dtype).element_size()

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n_new = self._check_append(layer, k, v)
        if self.storage != k.dtype:  # rounded as stored: a value beyond float16's range would be stored as Inf
            k, v = k.to(self.storage), v.to(self.storage)
            if not (torch.isfinite(k).all() and torch.isfinite(v).all()):
                raise NonFiniteError(f"NaN or Inf in the keys/values appended to layer {layer}")
        start = self._lengths[layer]
        self.k[layer, :, :, start:start + n_new] = k   # (B, Hkv, T, D) written in place
        self.v[layer, :, :, start:start + n_new] = v
        self._lengths[layer] = start + n_new

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        self._check_attend(layer, q)
        n = self._lengths[layer]
        k = self.k[layer, :, :, :n]                    # (B, Hkv, S, D) view, no copy
        v = self.v[layer, :, :, :n]
        if self.storage != q.dtype:
            return chunked_attention(q, k, v, self.scale, window=self.geometry.window)
        return grouped_attention(q, k, v, self.scale, window=self.geometry.window)

    def record_written(self, layers, n_new: int) -> None:
        """Count `n_new` tokens a kernel wrote in place into `layers` (the fused decode step, model/fused.py)."""
        for layer in layers:
            self._lengths[layer] += n_new

    def _empty(self, geometry: CacheGeometry) -> "DenseCache":
        return type(self)(geometry, self.dtype, self.device, storage=self.storage)   # dense-f16 grows as dense-f16

    def _copy_into(self, bigger: "DenseCache") -> None:
        super()._copy_into(bigger)
        copy_prefix(self.k, bigger.k)                  # (L, B, Hkv, capacity, D): tokens along the slot axis
        copy_prefix(self.v, bigger.v)

    @property
    def nbytes(self) -> int:
        return tensors_nbytes(self.k, self.v)
