"""DenseBlocks: the one storage of the dense formats (dense, dense-f16, dense-bf16), as blocks read through tables.

    k (L, n_blocks, Hkv, block_size, D), v (L, n_blocks, Hkv, block_size, Dv), in the storage dtype
    token t of a sequence whose block table is T: block T[t // block_size], row t % block_size of each head
    slot = block · block_size + row: a token's place in the whole storage, what the serving step writes to

Head-major inside a block: one head's rows of a block are contiguous, so reading a head's keys walks memory in order
(the C readers, kernels/decode.c and kernels/paged.c, both do). The single-sequence cache (`DenseCache`) is this
storage holding B sequences in one block of `capacity` rows each (sequence b's table is [b]); the serving pool
(serve/blocks.py `BlockPool`) is the same storage holding many sequences in small blocks.
"""

from __future__ import annotations

import torch

from ..errors import NonFiniteError
from .base import tensors_nbytes
from .format import dense_rows_bytes
from .geometry import CacheGeometry


class DenseBlocks:
    """n_blocks blocks of block_size token rows per layer and KV head, preallocated (zeros) in `storage`."""

    def __init__(self, geometry: CacheGeometry, n_blocks: int, block_size: int, storage: torch.dtype, device="cpu"):
        g = geometry
        self.geometry, self.n_blocks, self.block_size, self.storage = g, n_blocks, block_size, storage
        self.k = torch.zeros(g.n_layers, n_blocks, g.n_kv_heads, block_size, g.head_dim, dtype=storage, device=device)
        self.v = torch.zeros(g.n_layers, n_blocks, g.n_kv_heads, block_size, g.head_dim_v, dtype=storage, device=device)

    @staticmethod
    def bytes_for(geometry: CacheGeometry, n_blocks: int, block_size: int, storage: torch.dtype) -> int:
        """Bytes of the two buffers: n_blocks × block_size token rows of the format's formula (dense_rows_bytes)."""
        return dense_rows_bytes(geometry, n_blocks * block_size, storage)

    @property
    def device(self) -> torch.device:
        return self.k.device

    def stored(self, layer: int, k: torch.Tensor, v: torch.Tensor, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v rounded to the storage dtype as they will be stored; with `check`, a value beyond a 16-bit dtype's
        range (stored as Inf) or a NaN is refused with NonFiniteError instead."""
        if self.storage == k.dtype and self.storage == v.dtype:
            return k, v
        k, v = k.to(self.storage), v.to(self.storage)
        if check and not (torch.isfinite(k).all() and torch.isfinite(v).all()):
            raise NonFiniteError(f"NaN or Inf in the keys/values appended to layer {layer}")
        return k, v

    def write_rows(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k (n_blocks, Hkv, T, D), v (n_blocks, Hkv, T, Dv): rows [start, start + T) of every block, in place (a
        storage of one block per sequence, each sequence's T new tokens)."""
        T = k.shape[2]
        self.k[layer, :, :, start:start + T] = k
        self.v[layer, :, :, start:start + T] = v

    def write_slots(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k (N, Hkv, D), v (N, Hkv, Dv) of N tokens into their slots (N,) int64, rounded to the storage dtype."""
        block, row = slots // self.block_size, slots % self.block_size
        k, v = self.stored(layer, k, v, check=False)
        self.k[layer][block, :, row] = k    # (blocks, Hkv, rows, D)[block_i, :, row_i] = k_i: indexed (N, Hkv, D)
        self.v[layer][block, :, row] = v

    def rows(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(n_blocks, Hkv, n, D), (n_blocks, Hkv, n, Dv): views of every block's first n rows (no copy)."""
        return self.k[layer, :, :, :n], self.v[layer, :, :, :n]

    def copy_block(self, src: int, dst: int) -> None:
        """Every layer's K/V of block `src` into block `dst` (copy-on-write)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def block_parts(self, block: int) -> list[tuple[str, torch.Tensor]]:
        """Views of every buffer's part of `block`, in a fixed order (what the KV store writes and reads back)."""
        return [("k", self.k[:, block]), ("v", self.v[:, block])]          # (L, Hkv, block_size, D) each

    @property
    def nbytes(self) -> int:
        return tensors_nbytes(self.k, self.v)
