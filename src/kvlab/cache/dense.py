"""DenseCache: K/V preallocated to a capacity and written in place (the gpt-fast static cache).

Its storage is the dense formats' blocks (cache/blocks.py), holding the batch's B sequences in one block of
`capacity` rows each: the serving pool is the same storage with many sequences in small blocks.
The storage dtype may be narrower than the run's compute dtype (`dense-f16`, `dense-bf16` in a fp32 run:
what llama.cpp and vLLM store by default): K/V are rounded to it when written, and attention reads them
back chunk by chunk, upcast to the compute dtype, never as a whole-context copy.

Reading: on the CPU with kvlab's C library, an fp32 query reads the rows in place through the serving pool's entry
point (kernels/paged.c kvlab_paged_attention: the B sequences are B blocks of `capacity` rows, each query row's causal
and window mask as the pool's), for a prompt chunk as for one token; elsewhere, or with `read_kernel` set to None (the
reference the C read is tested against), torch's attention.grouped_attention (attention.chunked_attention when the
storage is narrower than the query).
"""

from __future__ import annotations

import torch

from .attention import chunked_attention, grouped_attention
from .base import CacheGeometry, KVCache, copy_prefix
from .blocks import DenseBlocks
from ..kernels import kernel_for
from ..kernels.paged import sequences_attention

class DenseCache(KVCache):
    """DenseBlocks of B blocks × `capacity` rows: k, v (layers, B, Hkv, capacity, D); token t of layer l of sequence
    b lives at [l, b, :, t]. `storage`: the dtype of those buffers (default: `dtype`, the compute dtype)."""

    kernel_format = "dense"   # the fused C steps read and write it in place

    def __init__(self, geometry: CacheGeometry, dtype: torch.dtype = torch.float32, device="cpu",
                 storage: torch.dtype | None = None):
        super().__init__(geometry, dtype, device)
        g = geometry
        self.storage = storage or dtype
        self.blocks = DenseBlocks(g, g.batch, g.capacity, self.storage, self.device)
        self.k, self.v = self.blocks.k, self.blocks.v
        self.read_kernel = kernel_for(self.device)   # None: torch reads the rows

    @staticmethod
    def bytes_per_token(geometry: CacheGeometry, dtype: torch.dtype) -> int:
        """Per token of capacity, per sequence: 2 (K and V) × layers × kv_heads × head_dim × bytes of the
        storage dtype (the blocks' formula for one block of one token)."""
        return DenseBlocks.bytes_for(geometry, 1, 1, dtype)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n_new = self._check_append(layer, k, v)
        k, v = self.blocks.stored(layer, k, v)         # rounded as stored: beyond float16's range is refused
        start = self._lengths[layer]
        self.blocks.write_rows(layer, start, k, v)     # (B, Hkv, T, D) into rows [start, start + T), in place
        self._lengths[layer] = start + n_new

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        self._check_attend(layer, q)
        n = self._lengths[layer]
        out = sequences_attention(self.read_kernel, q, self.k[layer], self.v[layer], n, self.scale, self.geometry.window)
        if out is not None:
            return out
        k, v = self.blocks.rows(layer, n)   # (B, Hkv, S, D) views, no copy
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
        return self.blocks.nbytes
