"""The formats' storage as blocks read through block tables: DenseBlocks (dense, dense-f16, dense-bf16), IntBlocks
(int1..int8) and TqBlocks (TurboQuant), each the one storage of its formats for the single-sequence cache and the
serving pool alike.

    DenseBlocks k (L, n_blocks, Hkv, block_size, D), v (L, n_blocks, Hkv, block_size, Dv), in the storage dtype
    token t of a sequence whose block table is T: block T[t // block_size], row t % block_size of each head
    slot = block · block_size + row: a token's place in the whole storage, what the serving step writes to

Head-major inside a block: one head's rows of a block are contiguous, so reading a head's keys walks memory in order
(the C readers, kernels/decode.c, intcache.c and paged.c, all do). The single-sequence caches (`DenseCache`,
`QuantizedCache`, `TurboQuantCache`) are this storage holding B sequences in one block of `capacity` (or `slots`) rows
each (sequence b's table is [b]); the serving pools (serve/blocks.py `BlockPool`, serve/coded.py `IntPool`,
`TurboPool`) are the same storage holding many sequences in small blocks.
"""

from __future__ import annotations

import torch

from ..errors import NonFiniteError
from .base import tensors_nbytes
from .format import dense_rows_bytes
from .int_codes import code_key_groups, code_values
from .packing import pack, packed_nbytes, unpack
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


class IntBlocks:
    """The integer formats' codes (cache/quantized.py: keys coded per channel over groups of G tokens, values per group
    of Gv channels of a token) in blocks, head-major inside a block like DenseBlocks:

        k_codes (L, n_blocks, Hkv, block_size, ⌈Dk·b/8⌉) uint8   k_scale, k_zero (L, n_blocks, Hkv, ⌈block_size/G⌉, Dk) fp16
        v_codes (L, n_blocks, Hkv, block_size, ⌈Dv·b/8⌉) uint8   v_scale, v_zero (L, n_blocks, Hkv, block_size, Dv/Gv) fp16

    A key group never straddles two blocks (the pool's block size is a multiple of G). QuantizedCache holds its coded
    layers' tokens here, one block of its `slots` rows per sequence; the serving pool (serve/coded.py IntPool) many
    blocks. The slot methods are the pool's torch reference: they write and read tokens by slot, as the C coder and
    reader (kernels/decode.c int_store, kernels/intcache.h) do, and QuantizedCache's torch path codes and reads by them."""

    BUFFERS = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")

    def __init__(self, geometry: CacheGeometry, n_layers: int, bits: int, group: int, value_group: int, n_blocks: int,
                 block_size: int, device="cpu"):
        g = geometry
        self.geometry, self.bits, self.group, self.value_group = g, bits, group, value_group
        self.n_blocks, self.block_size = n_blocks, block_size
        blocks = (n_layers, n_blocks, g.n_kv_heads)
        meta, n_groups = torch.float16, -(-block_size // group)

        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*blocks, *shape, dtype=dtype, device=device)

        self.k_codes = zeros(block_size, packed_nbytes(g.head_dim, bits), dtype=torch.uint8)
        self.k_scale, self.k_zero = zeros(n_groups, g.head_dim, dtype=meta), zeros(n_groups, g.head_dim, dtype=meta)
        self.v_codes = zeros(block_size, packed_nbytes(g.head_dim_v, bits), dtype=torch.uint8)
        n_vg = g.head_dim_v // value_group
        self.v_scale, self.v_zero = zeros(block_size, n_vg, dtype=meta), zeros(block_size, n_vg, dtype=meta)

    def buffers(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.BUFFERS}

    def layer(self, layer: int) -> dict[str, torch.Tensor]:
        """Layer `layer`'s buffers: views (n_blocks, Hkv, ...)."""
        return {name: t[layer] for name, t in self.buffers().items()}

    # -- tokens by slot (block · block_size + row): the torch reference of the C coder and readers -------------
    def _at(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return slots // self.block_size, slots % self.block_size

    def code_values(self, layer: int, slots: torch.Tensor, v: torch.Tensor) -> None:
        """Values v (N, Hkv, Dv) of N tokens coded per group of Gv channels (int_codes.py) into their slots (N,)."""
        codes, scale, zero = code_values(v, self.value_group, self.bits)                 # (N, Hkv, Dv), (N, Hkv, Dv/Gv)
        block, row = self._at(slots)
        self.v_codes[layer][block, :, row] = pack(codes, self.bits)   # (blocks, Hkv, rows, ...)[block_i, :, row_i] = x_i
        self.v_scale[layer][block, :, row] = scale
        self.v_zero[layer][block, :, row] = zero

    def code_key_groups(self, layer: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
        """Keys (n, Hkv, Dk) of n = whole groups' tokens coded per channel over each group's G tokens (int_codes.py)
        into their slots (n,): each group's G slots consecutive, from a multiple of G."""
        G, (n, Hkv, Dk) = self.group, keys.shape
        codes, scale, zero = code_key_groups(keys.float().reshape(n // G, G, Hkv, Dk), 1, self.bits)   # (n/G, Hkv, Dk) scales
        block, row = self._at(slots)
        self.k_codes[layer][block, :, row] = pack(codes.reshape(n, Hkv, Dk), self.bits)
        block, group = block[::G], row[::G] // G                                                      # (n/G,) each
        self.k_scale[layer][block, :, group] = scale
        self.k_zero[layer][block, :, group] = zero

    @staticmethod
    def open_keys(stage: torch.Tensor, have: int, keys: torch.Tensor) -> torch.Tensor:
        """(S, have + T, Hkv, Dk): S sequences' keys from their open group on, the group's first `have` keys from their
        stages (S, G, Hkv, Dk), then the new keys (S, T, Hkv, Dk)."""
        return torch.cat([stage[:, :have], keys.to(stage.dtype)], dim=1) if have else keys.to(stage.dtype)

    def code_open_keys(self, layer: int, stage: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor) -> None:
        """S sequences' keys from their open group on (S, n, Hkv, Dk, `open_keys`), their slots (S, n): the whole groups
        coded (`code_key_groups`), the rest staged in the stages (S, G, Hkv, Dk) for the group they open."""
        n = keys.shape[1]
        complete = n // self.group * self.group
        if complete:
            self.code_key_groups(layer, slots[:, :complete].flatten(), keys[:, :complete].flatten(0, 1))
        stage[:, :n - complete] = keys[:, complete:]

    def keys(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """(n, Hkv, Dk) float32 of the slots of n tokens in complete groups: zero + code·scale, their group's."""
        block, row = self._at(slots)
        codes = unpack(self.k_codes[layer][block, :, row], self.bits, self.geometry.head_dim).float()     # (n, Hkv, Dk)
        group = row // self.group                                                                     # (n,) its key group
        return self.k_zero[layer][block, :, group].float() + codes * self.k_scale[layer][block, :, group].float()

    def values(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """(n, Hkv, Dv) float32 of the slots: zero + code·scale per value group of each token."""
        block, row = self._at(slots)
        codes = unpack(self.v_codes[layer][block, :, row], self.bits, self.geometry.head_dim_v).float()
        n, Hkv, Dv = codes.shape
        codes = codes.reshape(n, Hkv, Dv // self.value_group, self.value_group)                    # (n, Hkv, nvg, Gv)
        out = self.v_zero[layer][block, :, row].float()[..., None] + codes * self.v_scale[layer][block, :, row].float()[..., None]
        return out.reshape(n, Hkv, Dv)

    # -- blocks -----------------------------------------------------------------------------------------------
    def copy_block(self, src: int, dst: int) -> None:
        """Every layer's codes of block `src` into block `dst` (copy-on-write)."""
        for t in self.buffers().values():
            t[:, dst] = t[:, src]

    def block_parts(self, block: int) -> list[tuple[str, torch.Tensor]]:
        """Views of every buffer's part of `block`, in a fixed order (what the KV store writes and reads back)."""
        return [(name, t[:, block]) for name, t in self.buffers().items()]                       # (L, Hkv, ...) each

    @property
    def nbytes(self) -> int:
        return tensors_nbytes(*self.buffers().values())


class TqBlocks:
    """TurboQuant's per-token buffers (cache/turboquant.py) in blocks, head-major inside a block like DenseBlocks; per
    buffer, one tensor per layer (the layers' rows may differ in length: +alloc, +halloc):

        k_codes, v_codes  (n_blocks, Hkv, block_size, bytes) uint8, or +halloc (n_blocks, 1, block_size, Σ_h bytes_h):
                          a row of every head's codes side by side at their widths
        k_norm, v_norm    (n_blocks, Hkv, block_size) 16-bit scales, or uint8 log codes (+norms8)
        k_signs, k_rnorm  +qjl: (n_blocks, Hkv, block_size, d/8) sign bits, (n_blocks, Hkv, block_size) residual norms
        k_out_idx, k_out_val  +outliers: (n_blocks, Hkv, block_size, N) the kept key channels and their values

    `shapes`: {name: (dtype, {layer: (H', *row)})}, H' = Hkv or 1. TurboQuantCache holds its tokens here, one block of
    its `slots` rows per sequence; the serving pool (serve/coded.py TurboPool) many blocks. The C coder and readers
    address a slot as (block, row) (kernels/tqcodes.h Coded); the slot methods are the pool's torch reference."""

    def __init__(self, shapes: dict[str, tuple[torch.dtype, dict[int, tuple[int, ...]]]], n_blocks: int, block_size: int,
                 device="cpu"):
        self.n_blocks, self.block_size = n_blocks, block_size
        self.buffers = {name: {layer: torch.zeros(n_blocks, shape[0], block_size, *shape[1:], dtype=dtype, device=device)
                               for layer, shape in layers.items()}
                        for name, (dtype, layers) in shapes.items()}

    def shapes(self, layers=None) -> dict[str, tuple[torch.dtype, dict[int, tuple[int, ...]]]]:
        """What this storage was made of (the `shapes` argument), for the given layers (None: all)."""
        return {name: (next(iter(held.values())).dtype,
                       {l: (t.shape[1], *t.shape[3:]) for l, t in held.items() if layers is None or l in layers})
                for name, held in self.buffers.items()}

    def layer(self, layer: int) -> dict[str, torch.Tensor]:
        """Layer `layer`'s buffers: (n_blocks, H', block_size[, bytes]) each."""
        return {name: held[layer] for name, held in self.buffers.items()}

    # -- the pool's torch reference: tokens by slot (block · block_size + row) ------------------------------
    def write_slots(self, layer: int, slots: torch.Tensor, coded: dict[str, torch.Tensor]) -> None:
        """Each buffer's rows (N, H'[, bytes]) of N tokens into their slots (N,)."""
        block, row = slots // self.block_size, slots % self.block_size
        for name, rows in coded.items():
            self.buffers[name][layer][block, :, row] = rows      # indexed (N, H'[, bytes])

    def gather(self, layer: int, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """The rows of n slots as one sequence's buffers, as TurboQuantCache's reads take them: (1, H', n[, bytes])."""
        block, row = slots // self.block_size, slots % self.block_size
        return {name: held[layer][block, :, row].transpose(0, 1)[None].contiguous() for name, held in self.buffers.items()}

    # -- blocks -----------------------------------------------------------------------------------------------
    def copy_block(self, src: int, dst: int) -> None:
        """Every layer's codes of block `src` into block `dst` (copy-on-write)."""
        for held in self.buffers.values():
            for t in held.values():
                t[dst] = t[src]

    def block_parts(self, block: int) -> list[tuple[str, torch.Tensor]]:
        """Views of every buffer's part of `block`, in a fixed order (what the KV store writes and reads back)."""
        return [(f"{name}.{layer}", t[block]) for name, held in self.buffers.items() for layer, t in held.items()]

    @property
    def nbytes(self) -> int:
        return tensors_nbytes(*(t for held in self.buffers.values() for t in held.values()))
