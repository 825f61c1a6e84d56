"""A TurboQuant layer as the C code codes and reads it (kernels/decode.c `Coded`, `HeadCodes`), for a single cache
and for the serving pool alike.

`Coded` describes one layer: the codec's state (the rotation Π as a (d, d) matrix, float8 offsets, 4-bit key
weights, each KV head's packing with its boundaries, the scale modes, +norms8 centres, +prerope's inverse rotation,
+ropemean's flag, +qjl's sketch matrix and buffers, +outliersN's buffers)
and where its codes and scales lie: in blocks (cache/blocks.py TqBlocks), codes (n_blocks, Hkv, block_rows, bytes)
(+halloc: (n_blocks, 1, block_rows, Σ bytes)), scales (n_blocks, Hkv, block_rows); a single cache's sequence is one
block of all its slots, a serving pool's blocks hold its block size each.
`code_tokens` codes a step's K/V into it with kvlab_tq_code_tokens, the one coder of a token's K/V that the fused
decode step uses too; TqCodec.code is its torch reference (tests/test_tq_kernel.py). `CodedLayers.pool_layer`
adds a serving pool layer's sink rows (kernels/tqcodes.h TqPoolLayer): what kvlab_tq_pool_layer codes and reads a
whole step's layer with (kernels/paged.py tq_pool_layer), and the engine's fused step every layer.
"""

from __future__ import annotations

import ctypes
from ctypes import c_int32, c_int64, c_void_p

import torch

from ..errors import ConfigError
from ..kernels import check_buffer
from ..kernels.paged import POOL_DTYPES, TqPoolLayer
from .format import WEIGHT_STEPS, WEIGHT_ZERO

KV_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # decode.c's KV_F32, KV_F16, KV_BF16
SCALE_MODES = {"norm": 0, "renorm": 1, "lsq": 2, "unbiased": 3}       # decode.c's SCALE_*
TURN_STEPS = 32                                                      # tqcodes.h TQ_TURN_STEPS
NORM_LOG8 = 3                                                          # decode.c's NORM_LOG8: +norms8 scales


class HeadCodes(ctypes.Structure):
    _fields_ = [("at", c_int64), ("row_bytes", c_int64), ("n_parts", c_int32), ("spec", c_void_p), ("tables", c_void_p),
                ("bounds", c_void_p)]


class Coded(ctypes.Structure):
    _fields_ = [("slots", c_int32), ("norm_type", c_int32), ("codes", c_void_p * 2), ("norms", c_void_p * 2),
                ("norm_centres", c_void_p * 2), ("slot_bytes", c_int64 * 2), ("heads", ctypes.POINTER(HeadCodes) * 2),
                ("scale_mode", c_int32 * 2), ("rotation", c_void_p), ("offset", c_void_p * 2),
                ("weight_codes", c_void_p), ("fp8_values", c_void_p), ("weight_values", c_void_p),
                ("rope_cos", c_void_p), ("rope_sin", c_void_p), ("unrotation", c_void_p), ("unrotation_signs", c_void_p),
                ("block_rows", c_int64), ("block_bytes", c_int64 * 2), ("norm_head_stride", c_int64),
                ("norm_block_stride", c_int64), ("rope_mean", c_int32),
                ("rope_steps", c_void_p), ("qjl_matrix", c_void_p), ("qjl_signs", c_void_p), ("qjl_norms", c_void_p),
                ("outliers", c_int32), ("outlier_channels", c_void_p), ("outlier_values", c_void_p)]


def fp8_values() -> torch.Tensor:
    """The value of each float8 e4m3 byte, (256,) float32 (made per view: the first float8 conversion touches
    ~3 MiB of torch's code, which a dense run need not page in)."""
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def weight_values() -> torch.Tensor:
    """The value of each 4-bit key weight code, (16,) float32, as TqCodec.key_weights computes it."""
    return key_weight(torch.arange(16))


def key_weight(codes: torch.Tensor) -> torch.Tensor:
    """The key channel weight w of each 4-bit weight code (any integer tensor), float32 (format.py's law)."""
    return torch.exp2((codes.float() - WEIGHT_ZERO) / WEIGHT_STEPS)


class CodedLayers:
    """`Coded` structs of a codec's layers over given buffers. They point into the buffers without holding them and
    hold what they made themselves (rotations, boundaries, tables), checked once here: the C code trusts them."""

    def __init__(self, what: str):
        self.what = what
        self._keep: list = []
        self._bounds: dict[int, torch.Tensor] = {}                          # each width's boundaries, by codebook
        self._tables: tuple[int, int] | None = None                         # fp8 and key weight values

    def ptr(self, t: torch.Tensor, shape: tuple[int, ...], what: str, dtype: torch.dtype, own: bool = False) -> int:
        """The address of `t` after checking its dtype, shape and contiguity; `own`: a tensor made here, kept."""
        check_buffer(self.what, what, t, dtype, shape)
        if own:
            self._keep.append(t)
        return t.data_ptr()

    def layer(self, codec, layer: int, buffers: dict[str, torch.Tensor], blocks: tuple[int, int],
              slot_rope: tuple[torch.Tensor, torch.Tensor] | None = None, state_row: int = 0) -> Coded:
        """Layer `layer` of TqCodec `codec` over `buffers` {k_codes, k_norm, v_codes, v_norm [+qjl: k_signs,
        k_rnorm] [+outliersN: k_out_idx, k_out_val]} in blocks =
        (n_blocks, block_rows), as TqBlocks holds a layer: codes (n_blocks, Hkv, block_rows, bytes), or +halloc
        (n_blocks, 1, block_rows, Σ bytes), scales (n_blocks, Hkv, block_rows). slot_rope: +prerope's, +ropemean's (slots, d) cos / sin
        of each slot's position, which the fused step reads (None where the caller passes each token's own to
        code_tokens). state_row: the codec's batch row whose calibration (offsets, key weights, +norms8 centres) made
        the codes."""
        H, hd = codec.geometry.n_kv_heads, codec.geometry.head_dim
        at, config = f"layer {layer}", codec.config
        n_blocks, rows = blocks
        slots = n_blocks * rows
        c = Coded()
        c.made_by = self   # what it points at lives as long as it does
        c.checked = (H, hd)   # what its buffers were checked for: KV heads, head dim
        log_norms = config.log_norms
        c.slots, c.norm_type = slots, NORM_LOG8 if log_norms else KV_TYPES[config.norm_dtype]
        c.block_rows, c.norm_head_stride, c.norm_block_stride = rows, rows, H * rows
        norm_dtype = torch.uint8 if log_norms else config.norm_dtype
        for i, (name, layer_codes, mode) in enumerate((("k", codec.layer_key_codes[layer], codec.key_scale_mode),
                                                       ("v", codec.layer_value_codes[layer], config.value_scale))):
            if config.alloc_heads:   # +halloc: one row of every head's codes side by side
                books, starts, row = layer_codes.heads, [a for a, _ in layer_codes.spans], layer_codes.row_bytes
                shape, c.slot_bytes[i] = (n_blocks, 1, rows, row), row
            else:                    # one width, each head's rows of a block in turn
                books, row = [layer_codes] * H, layer_codes.layout.row_bytes
                starts, shape, c.slot_bytes[i] = [h * rows * row for h in range(H)], (n_blocks, H, rows, row), row
            c.block_bytes[i] = shape[1] * rows * row
            c.codes[i] = self.ptr(buffers[f"{name}_codes"], shape, f"{at} {name} codes", torch.uint8)
            c.norms[i] = self.ptr(buffers[f"{name}_norm"], (n_blocks, H, rows), f"{at} {name} norms", norm_dtype)
            if log_norms:   # +norms8: each head's log2 centre (a single cache's first coded chunk sets it in place)
                centres = codec.norm_centres[f"{name}_norm"][layer][state_row]
                c.norm_centres[i] = self.ptr(centres, (H,), f"{at} {name} norm centres", torch.float16)
            heads = (HeadCodes * H)()
            for h, (book, start) in enumerate(zip(books, starts)):
                heads[h] = self._head_codes(book, start, name)
            self._keep.append(heads)
            c.heads[i] = ctypes.cast(heads, ctypes.POINTER(HeadCodes))
            c.scale_mode[i] = SCALE_MODES[mode]
            offsets = getattr(codec, f"{name}_offset")
            if offsets:  # float8 bytes, read through fp8_values
                c.offset[i] = self.ptr(offsets[layer][state_row].view(torch.uint8), (H, hd), f"{at} {name} offset", torch.uint8)
        rotation = codec.rotations[layer].apply(torch.eye(hd, device=codec.device)).contiguous()  # (D, D): y = x M
        c.rotation = self.ptr(rotation, (hd, hd), f"{at} rotation", torch.float32, own=True)
        if codec.k_weight_codes:
            c.weight_codes = self.ptr(codec.k_weight_codes[layer][state_row], (H, hd // 2), f"{at} key weights", torch.uint8)
        if self._tables is None:
            self._tables = (self.ptr(fp8_values(), (256,), "float8 values", torch.float32, own=True),
                            self.ptr(weight_values(), (16,), "key weight values", torch.float32, own=True))
        c.fp8_values, c.weight_values = self._tables
        if config.turns_keys and slot_rope is not None:
            c.rope_cos = self.ptr(slot_rope[0], (slots, hd), "slot RoPE cos", torch.float32)
            c.rope_sin = self.ptr(slot_rope[1], (slots, hd), "slot RoPE sin", torch.float32)
        c.rope_mean = int(config.rope_mean)
        if config.rope_mean:   # (d, TURN_STEPS): column r = [cos rθ | sin rθ], the turn of r positions (the reads' runs)
            angles = torch.outer(torch.arange(TURN_STEPS, dtype=torch.float32), codec.rope_inv_freq.float().cpu())   # (K, d/2)
            steps = torch.cat((angles.cos(), angles.sin()), dim=-1).T.contiguous()
            c.rope_steps = self.ptr(steps, (hd, TURN_STEPS), f"{at} RoPE steps", torch.float32, own=True)
        if config.qjl:         # the residual's sketch: S, each token's signs and ‖r‖ (as its scales)
            c.qjl_matrix = self.ptr(codec.qjl_matrix.float().cpu().contiguous(), (hd, hd), "QJL matrix", torch.float32,
                                    own=True)
            c.qjl_signs = self.ptr(buffers["k_signs"], (n_blocks, H, rows, (hd + 7) // 8), f"{at} QJL signs", torch.uint8)
            c.qjl_norms = self.ptr(buffers["k_rnorm"], (n_blocks, H, rows), f"{at} QJL norms", config.norm_dtype)
        if config.outliers:    # each token's kept key entries: channels and float16 values
            c.outliers = config.outliers
            shape = (n_blocks, H, rows, config.outliers)
            c.outlier_channels = self.ptr(buffers["k_out_idx"], shape, f"{at} outlier channels", torch.uint8)
            c.outlier_values = self.ptr(buffers["k_out_val"], shape, f"{at} outlier values", torch.float16)
        if config.pre_rope:
            if codec.rotations[layer].hadamard:   # Mᵀy = s ⊙ (H y)/√d: a Hadamard transform in C, not the d x d product
                signs = codec.rotations[layer].signs.float() * hd ** -0.5                    # (D,) s/√d
                c.unrotation_signs = self.ptr(signs, (hd,), f"{at} rotation signs", torch.float32, own=True)
            else:
                c.unrotation = self.ptr(rotation.T.contiguous(), (hd, hd), f"{at} inverse rotation", torch.float32, own=True)
        return c

    def pool_layer(self, coded: Coded, sink_k: torch.Tensor | None, sink_v: torch.Tensor | None) -> TqPoolLayer:
        """`coded` (a serving pool's layer) with its sink rows: sink_k, sink_v (entries, sink, Hkv, d) fp32, fp16 or bf16
        (+sinkN), else None. It holds `coded`; C trusts the sizes checked here, layer.checked = (Hkv, d, slots)."""
        H, hd = coded.checked
        layer = TqPoolLayer(ctypes.addressof(coded))
        layer.made_by, layer.coded_by = self, coded
        layer.checked = (H, hd, coded.slots)
        if sink_k is not None:
            dtype = sink_k.dtype if isinstance(sink_k, torch.Tensor) and sink_k.dtype in POOL_DTYPES else torch.float32
            shape = tuple(sink_k.shape) if isinstance(sink_k, torch.Tensor) and sink_k.dim() == 4 else (0, 1, H, hd)
            if shape[0] < 1 or shape[1] < 1 or shape[2:] != (H, hd):
                raise ConfigError(f"{self.what}: sink rows must be (entries, sink, {H}, {hd}), got {shape}")
            check_buffer(self.what, "sink keys", sink_k, dtype, shape)
            check_buffer(self.what, "sink values", sink_v, dtype, shape)
            layer.sink, layer.sink_type, layer.sink_entries = shape[1], POOL_DTYPES[dtype], shape[0]
            layer.sink_k, layer.sink_v = sink_k.data_ptr(), sink_v.data_ptr()
        return layer

    def _head_codes(self, book, start: int, name: str) -> HeadCodes:
        """One KV head's packing: its width's layout and boundaries (made once per width), its bytes from `start`."""
        layout = book.layout
        bounds = self._bounds.get(id(book))
        if bounds is None:   # each part's 2^bits - 1 boundaries in turn
            held = [b.float().cpu() for b in book.boundaries if b is not None]   # none for a +vq block part
            bounds = self._bounds[id(book)] = (torch.cat(held) if held else torch.zeros(1)).contiguous()
            self._keep.append(bounds)
        return HeadCodes(start, layout.row_bytes, layout.spec.shape[0],
                         self.ptr(layout.spec, tuple(layout.spec.shape), f"{name} layout", torch.int32),
                         self.ptr(layout.tables, tuple(layout.tables.shape), f"{name} centroids", torch.float32),
                         self.ptr(bounds, tuple(bounds.shape), f"{name} boundaries", torch.float32))


def code_tokens(kernel, coded: Coded, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> bool:
    """Code k, v (n, Hkv, d) (keys after RoPE) into slots (n,) of the layer `coded` describes; +prerope, +ropemean:
    rope, each token's (n, d) cos / sin, turns its key back first (+ropemean: and its centred key forward again). True when stored, False when a scale is not finite (the
    caller's torch reference then names it)."""
    cos, sin = (None, None) if rope is None else (t.float().contiguous() for t in rope)
    status = kernel.tq_code_tokens(coded, k.float().contiguous(), v.float().contiguous(), slots.to(torch.int64).contiguous(),
                                   cos, sin)
    if status < 0:   # a layout the C code does not take, a slot out of range, RoPE missing or not wanted
        raise ConfigError("TurboQuant coding: kvlab_tq_code_tokens refused the layer's description")
    return status == 0
