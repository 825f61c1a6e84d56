"""The fused decode step's view of a cache (kernels/decode.c `LayerKV`, `Coded`, `Fill`): what each layer holds and
where the new token goes, for the dense caches, TurboQuant caches and integer caches (their codes: model/fused_int.py).

A TurboQuant layer is read in C straight from its codes: the stored rows are decoded one key chunk at a time into
a per-thread tile of centroid values (rotated domain), scored against q' = Π(q⊙w)·scale and scaled by their 16-bit
norms; q·μ·scale, the same for every coded key, shifts the chunk's softmax; the coded chunks' value sum turns back
with Πᵀ once per query head (+ the value offset). The new token is coded in C as `TqCodec.code` codes it.
The C code gets Π as a (d, d) matrix (`Rotation.apply` of the identity: Hadamard, Haar and non-power-of-two alike),
the cache's own offset and key-weight buffers (float8 and 4-bit codes, read through two small tables), and each
width's layout (kernels/codebook.py `CodeLayout`) with its boundaries.

+prerope (keys coded before RoPE): the new key is turned back at its slot's position before it is coded, and a chunk's
keys are rebuilt a sub-tile at a time (ŷ Mᵀ · scale ⊙ w + μ), turned to their positions and scored against q itself,
as TqCodec.keys does; the view holds each coded slot's cos and sin, (slots, d) each, made once. With the
randomized Hadamard rotation (every power-of-two head dim unless +rot=haar) ŷ Mᵀ is a fast Walsh-Hadamard transform
and a sign per channel (d log d additions), the view passing s/√d; otherwise the C code multiplies by Mᵀ (d²).
+ropemean: the new key is turned back, centred and weighted, then turned forward again at its slot's position before it
is coded; a chunk is read on the codes like the bare method, plus each key's q·R_t μ from the same cos / sin table.

Served: every width (3/5-bit, fractional, mixed K/V), +alloc / +halloc (a width per layer / per KV head: each head
gets its own packing, `HeadCodes`, and with +halloc its bytes' place in the layer's shared row), +sinkN, +recentN,
+fp-first-last (dense layers in the same step), +center=…, +kweights=none, +rot=haar, +prerope, every scale mode,
f16/bf16 norms, +norms8 (8-bit log scales: decode.c NORM_LOG8, each head's centre read in place), +vq (block parts:
kernels/codebook.c), +qjl (each key's residual sketch coded and read in C) and +outliersN (each key's kept entries).
Not served (the modules run them): a sliding-window model, batches, other dtypes and devices, and a step that would
calibrate a layer (its first coded token) or find a layer's first chunk still waiting for its queries.

The compressed formats' modules are imported where a compressed cache is met, never for a dense cache: a dense
run does not load them (cache/__init__.py).
"""

from __future__ import annotations

import ctypes
import weakref
from ctypes import c_int32, c_void_p

import torch

from ..cache.tq_kernel import KV_TYPES, Coded, CodedLayers
from . import fused_int
from .fused_int import Quantized

WRITE_FIRST, WRITE_CODED, WRITE_RECENT, WRITE_SPILL = range(4)        # decode.c's WRITE_*

WHAT = "fused decode"


class LayerKV(ctypes.Structure):
    _fields_ = [("type", c_int32), ("capacity", c_int32), ("k", c_void_p), ("v", c_void_p),
                ("coded", ctypes.POINTER(Coded)), ("window", c_int32), ("win_k", c_void_p), ("win_v", c_void_p),
                ("quant", ctypes.POINTER(Quantized))]


class Fill(ctypes.Structure):
    _fields_ = [("first", c_int32), ("coded", c_int32), ("recent", c_int32), ("write", c_int32)]


class CacheView:
    """The C structs for one cache, built once and kept while its buffers stay where they were (`fits`). They
    point into the cache's buffers without holding them (a finished cache is freed as before; the step keeps its
    view only as long as the cache lives) and hold what they made themselves (rotations, boundaries)."""

    def __init__(self, cache, cfg):
        self._c = CodedLayers(WHAT)                                          # checks and keeps what the structs point at
        self._slot_rope: tuple[torch.Tensor, torch.Tensor] | None = None   # +prerope: made at the first coded layer
        held = held_buffers(cache)
        self.buffers = tuple(_layout(t) for t in held)
        self._held = [weakref.ref(t) for t in held]   # the same tensor objects: nothing to check again (`fits`)
        L, hd = cfg.n_layers, cfg.head_dim
        self.layers = (LayerKV * L)()
        if cache.kernel_format == "dense":
            for layer in range(L):
                self.layers[layer] = self._dense(cache, layer)
            return
        self.coded, self.quant = {}, {}
        for layer in range(L):
            if layer in cache.fp_layers:
                self.layers[layer] = self._dense(cache.full_layer(layer), 0)
            else:
                if cache.kernel_format == "int":
                    self.quant[layer] = fused_int.quantized(cache, layer, hd, self._ptr)
                else:
                    self.coded[layer] = self._coded(cache, layer)
                self.layers[layer] = self._coded_layer(cache, layer, hd)

    def _ptr(self, t: torch.Tensor, shape: tuple[int, ...], what: str, dtype: torch.dtype, own: bool = False) -> int:
        """The address of `t` after checking its dtype, shape and contiguity; `own`: a tensor the view made, kept."""
        return self._c.ptr(t, shape, what, dtype, own)

    def fits(self, cache) -> bool:
        """Whether the cache's buffers are still the ones this view points into, with the dtypes, shapes and strides
        it checked (a buffer replaced by a smaller one at a reused address is not the one it checked). The same
        tensor objects as last time fit without a look at each (a cache replaces a buffer, never resizes one in
        place); a buffer replaced by another object is checked again."""
        held = held_buffers(cache)
        if len(held) == len(self._held) and all(ref() is t for ref, t in zip(self._held, held)):
            return True
        if tuple(_layout(t) for t in held) != self.buffers:
            return False
        self._held = [weakref.ref(t) for t in held]
        return True

    def _dense(self, cache, layer: int) -> LayerKV:
        """Layer `layer` of a DenseCache (a dense cache's, or a TurboQuant cache's full-precision layer)."""
        g = cache.geometry
        shape = (g.n_kv_heads, g.capacity, g.head_dim)
        k, v = cache.k[layer, 0], cache.v[layer, 0]                         # (Hkv, capacity, D) views
        return LayerKV(KV_TYPES[cache.storage], g.capacity, self._ptr(k, shape, f"layer {layer} keys", cache.storage),
                       self._ptr(v, shape, f"layer {layer} values", cache.storage))

    def _coded_layer(self, cache, layer: int, hd: int) -> LayerKV:
        """A TurboQuant or integer layer: its sink (fp32 rows), codes and recent window (fp32 rows)."""
        H = cache.geometry.n_kv_heads
        at = f"layer {layer}"
        sink_k, sink_v, win_k, win_v = (rows[0] for rows in cache.full_precision_rows(layer))   # (Hkv, sink|window, D)
        return LayerKV(
            KV_TYPES[torch.float32], cache.sink,
            self._ptr(sink_k, (H, cache.sink, hd), f"{at} sink keys", torch.float32),
            self._ptr(sink_v, (H, cache.sink, hd), f"{at} sink values", torch.float32),
            ctypes.pointer(self.coded[layer]) if layer in self.coded else None, cache.window,
            self._ptr(win_k, (H, cache.window, hd), f"{at} window keys", torch.float32),
            self._ptr(win_v, (H, cache.window, hd), f"{at} window values", torch.float32),
            ctypes.pointer(self.quant[layer]) if layer in self.quant else None,
        )

    def _coded(self, cache, layer: int) -> Coded:
        """Layer `layer` of a TurboQuant cache over its own blocks: the first sequence's one block of S rows
        (1, Hkv, S, ...); +prerope: with each slot's RoPE, one table for every layer."""
        if cache.config.turns_keys and self._slot_rope is None:
            self._slot_rope = tuple(t.contiguous() for t in cache.codec.slot_rope(0, cache.blocks.block_size))   # (S, hd) cos, sin
        buffers = {name: t[:1] for name, t in cache.blocks.layer(layer).items()}
        return self._c.layer(cache.codec, layer, buffers, (1, cache.blocks.block_size), slot_rope=self._slot_rope)


def held_buffers(cache) -> list[torch.Tensor]:
    """The buffers a view points into (a view is rebuilt, and its buffers checked again, if one was replaced or
    reshaped)."""
    return [cache.k, cache.v] if cache.kernel_format == "dense" else cache.kernel_buffers()


def _layout(t: torch.Tensor) -> tuple:
    """Where a buffer lies, and its dtype, shape and strides."""
    return t.data_ptr(), t.dtype, tuple(t.shape), t.stride()


def serves_codes(cache, cfg) -> bool:
    """Whether the fused step reads this TurboQuant cache (see the module docstring) or integer cache (fused_int) in C."""
    if cache.kernel_format == "int":
        return fused_int.serves_int(cache, cfg)
    g = cache.geometry
    return (
        cache.kernel_format == "tq" and cache.dtype == torch.float32 and cache.device.type == "cpu"
        and cache.config.spec.supports("fused")[0]            # the format's refusals (cache/format.py REFUSALS)
        and g.window is None and cfg.sliding_window is None
        and cfg.head_dim % 2 == 0 and cfg.head_dim <= 1024
        and (g.batch, g.n_layers, g.n_kv_heads, g.head_dim, g.head_dim_v) == (1, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.head_dim)
    )


#: decode.c's WRITE_* for each place a cache's next token goes (cache/compressed.py NextSlot.goes)
WRITES = {"sink": WRITE_FIRST, "coded": WRITE_CODED, "recent": WRITE_RECENT, "spill": WRITE_SPILL}


def fill(cache) -> Fill | None:
    """Where the next token goes in every compressed layer (they are level), or None when only the modules can
    take it (the cache's `next_slot` says why: its layers' parts differ, or a TurboQuant layer's first chunk still
    waits for its queries, or the token would be a TurboQuant layer's first coded one, its calibration)."""
    if not getattr(cache, "compressed_layers", ()):   # a dense cache (or no compressed layer) writes at its length
        return Fill(cache.length, 0, 0, WRITE_FIRST)
    slot = cache.next_slot()
    return None if slot is None else Fill(slot.sink, slot.coded, slot.recent, WRITES[slot.goes])
