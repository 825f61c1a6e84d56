"""TqCodec: TurboQuant's coding state of a set of layers and the arithmetic on it, apart from any token buffers.

cache/turboquant.py describes the method (rotation, Lloyd-Max codes, offsets, key weights, +prerope, +ropemean,
+qjl, +outliersN, +alloc, +halloc, +vq, +norms8). This module holds what codes and reads a vector: `RotatedCodes` (the
codes of one width), `HeadCodes` (+halloc: a width per KV head), and `TqCodec`, each layer's rotation, codebooks and
calibration with `code`, `decode`, `scores`, `mix` over a sequence's stored rows. The single-sequence cache
(TurboQuantCache) and the serving pool (serve/coded.py TurboPool) each hold a TqCodec beside their blocks
(cache/blocks.py TqBlocks); the C coder and readers take its state through cache/tq_kernel.py.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from ..errors import ConfigError, NonFiniteError
from ..kernels.codebook import CodeLayout, codebook_kernel_for
from ..rope import apply_rope
from .allocation import centre, check_geometry
from .base import copy_prefix, tensors_nbytes
from .codebook import lloyd_max
from .format import WEIGHT_BITS, WEIGHT_STEPS, WEIGHT_ZERO
from .geometry import CacheGeometry
from .packing import pack, unpack
from .rotation import Rotation, haar_matrix
from .sizes import BLOCK, codes_nbytes, is_vector_part, packed_nbytes, table_nbytes, width_split
from .tq_kernel import key_weight
from .vector_codebook import magnitude_codebook, nearest_point

#: How the stored 16-bit scale of a vector x (y = Πx/‖x‖, ŷ its codes) is chosen; the reconstruction
#: is scale·Πᵀŷ. All cost the same bytes.
SCALE_MODES = {
    "norm": "‖x‖ (the paper)",
    "renorm": "‖x‖/‖ŷ‖: the reconstruction keeps the exact norm",
    "lsq": "‖x‖·⟨y,ŷ⟩/‖ŷ‖²: least squares, the smallest error for this vector",
    "unbiased": "‖x‖/⟨y,ŷ⟩: the projection of the reconstruction on x is exact",
}
_TINY = 1e-30
#: Offsets are stored in float8 (e4m3): any offset is exact — the same stored value is subtracted
#: before coding and added back when reading — so it only needs to be near the mean.
_OFFSET = torch.float8_e4m3fn
_OFFSET_MAX = 448.0
#: Each vector's 16-bit scale (float16 or bfloat16), or with +norms8 its 8-bit log code: code c > 0 is the scale
#: 2^(centre + (c - 128)/LOG_NORM_STEPS), 16 steps per octave (at most ±2.2% off), ±8 octaves around a centre per layer,
#: KV head and K/V (the median log2 scale of the layer's first coded chunk, float16, counted); code 0 is a zero scale.
LOG_NORM_STEPS, _LOG_NORM_ZERO = 16, 128
#: 2^(j/16) for j < 16 in float32 (decode.h KVLAB_LOG_STEP_POWERS, the same literals): the steps of an octave
LOG_STEP_POWERS = torch.tensor([float.fromhex(h) for h in (
    "0x1p+0", "0x1.0b5586p+0", "0x1.172b84p+0", "0x1.2387a6p+0", "0x1.306fep+0", "0x1.3dea64p+0", "0x1.4bfdaep+0", "0x1.5ab07ep+0",
    "0x1.6a09e6p+0", "0x1.7a1148p+0", "0x1.8ace54p+0", "0x1.9c4918p+0", "0x1.ae89fap+0", "0x1.c199bep+0", "0x1.d5818ep+0", "0x1.ea4afap+0")], dtype=torch.float32)
_OUTLIER_VALUE = torch.float16


def _log_centre(scales: torch.Tensor) -> torch.Tensor:
    """(B, H, T) float32 scales -> (B, H) the median log2 of the positive ones in 1/16 octaves (0 where none is)."""
    logs = scales.clamp_min(_TINY).log2().where(scales > _TINY, torch.nan)
    centre = (logs.nanmedian(dim=-1).values * LOG_NORM_STEPS).round() / LOG_NORM_STEPS
    return centre.nan_to_num(0.0).clamp(-1000, 1000).to(torch.float16)


def _log_norm_codes(scales: torch.Tensor, centre: torch.Tensor) -> torch.Tensor:
    """(B, H, T) float32 scales -> uint8 codes against the (B, H) centres: round((log2 s - c)·16) + 128 in 1..255
    (clamped past ±8 octaves), 0 for a zero scale."""
    steps = ((scales.clamp_min(_TINY).log2() - centre.float()[..., None]) * LOG_NORM_STEPS).round() + _LOG_NORM_ZERO
    return torch.where(scales > _TINY, steps.clamp(1, 255), 0).to(torch.uint8)


def _log_norm_values(codes: torch.Tensor, centre: torch.Tensor) -> torch.Tensor:
    """The scales uint8 `codes` (B, H, ...) stand for against the (B, H) centres (multiples of 1/16), float32: with
    e = 16·centre + code - 128, LOG_STEP_POWERS[e mod 16] · 2^floor(e/16), exact (decode.h kvlab_log_scale: the same
    floats in C, and for any vector length, where exp2 differs by an ulp between its SIMD and scalar paths); octaves
    past float32's normal range (scales beyond 2^±126) are clamped to it."""
    centre = (centre.float() * LOG_NORM_STEPS).round().int().reshape(*centre.shape, *(1,) * (codes.dim() - 2))
    e = centre + codes.int() - _LOG_NORM_ZERO
    octave = torch.div(e, LOG_NORM_STEPS, rounding_mode="floor")
    step = LOG_STEP_POWERS.to(codes.device)[e - octave * LOG_NORM_STEPS]
    power = ((octave.clamp(-126, 127) + 127) << 23).view(torch.float32)    # 2^octave, its bits built (a normal float)
    return torch.where(codes > 0, step * power, 0.0)


class RotatedCodes:
    """Coordinate-wise Lloyd-Max codes of rotated unit vectors at a possibly fractional width.

    Width b = ⌊b⌋ + f: the first round(f·d) coordinates get ⌊b⌋+1 bits, the others ⌊b⌋ bits.
    byte_tables: also hold, for 1, 2, 4 and 8 bits, the codebook values of every byte (the torch path's
    lookup; without them it unpacks the codes, same values).
    vector (+vq): 2- and 3-bit parts whose channels split into blocks of 4 code each block with 4·b bits, 4 signs and
    an index into the sign-symmetric magnitude points (vector_codebook.py), in the scalar code's bytes; such a part
    holds its points instead of the scalar centroids and boundaries (C reads them too: kernels/codebook.c block parts).
    """

    def __init__(self, dim: int, bits: float, device: torch.device | str = "cpu", byte_tables: bool = True,
                 vector: bool = False):
        low, n_high = self.split(dim, bits)
        self.dim, self.bits = dim, bits
        self.parts: list[tuple[int, int, int]] = [(lo, hi, b) for lo, hi, b in ((0, n_high, low + 1), (n_high, dim, low)) if hi > lo]
        # per part: scalar centroids (2^b,), boundaries (2^b-1,) and byte table, or the block code's points (K, 4)
        self.centroids, self.boundaries, self.byte_tables, self.points = [], [], [], []
        for lo, hi, b in self.parts:
            if vector and is_vector_part(hi - lo, b):
                self.points.append(magnitude_codebook(dim, b).to(device))
                self.centroids.append(None), self.boundaries.append(None), self.byte_tables.append(None)
                continue
            book = lloyd_max(dim, b)
            cent = torch.tensor(book.centroids, dtype=torch.float32, device=device)                # (2^b,)
            self.centroids.append(cent)
            self.boundaries.append(torch.tensor(book.boundaries, dtype=torch.float32, device=device))  # (2^b-1,)
            self.byte_tables.append(_byte_table(cent, b) if byte_tables and 8 % b == 0 else None)  # (256, 8/b)
            self.points.append(None)
        self.vector = any(p is not None for p in self.points)
        # what the C kernels read (a block part's points as its table)
        self.layout = CodeLayout.of(self.parts, self.centroids, self.packed_bytes(dim, bits), self.points)

    @staticmethod
    def split(dim: int, bits: float) -> tuple[int, int]:
        """(⌊b⌋, the channels at ⌊b⌋+1 bits); a ConfigError (one line) when b does not split d into whole channels."""
        return width_split(dim, bits)

    @staticmethod
    def packed_bytes(dim: int, bits: float) -> int:
        return codes_nbytes(dim, bits)

    @staticmethod
    def table_bytes(dim: int, bits: float, byte_tables: bool = True, vector: bool = False) -> int:
        """Bytes of the float32 codebook held for this width (sizes.py table_nbytes)."""
        return table_nbytes(dim, bits, byte_tables, vector)

    @property
    def nbytes(self) -> int:
        held = [t for t in (*self.centroids, *self.boundaries, *self.byte_tables, *self.points) if t is not None]
        return tensors_nbytes(*held)

    def encode(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """y: (..., d) float32 -> (packed codes (..., bytes) uint8, ŷ (..., d) float32 codebook values)."""
        packed, values = [], []
        for (lo, hi, b), cent, bound, points in zip(self.parts, self.centroids, self.boundaries, self.points):
            part = y[..., lo:hi].contiguous()                                      # (..., n)
            if points is not None:
                codes, value = _block_encode(part, points, b)
                packed.append(codes)
                values.append(value)
                continue
            codes = torch.bucketize(part, bound)                                   # (..., n) nearest level
            packed.append(pack(codes, b))
            values.append(cent[codes])
        return torch.cat(packed, dim=-1), torch.cat(values, dim=-1)

    def decode(self, packed: torch.Tensor) -> torch.Tensor:
        """(..., bytes) uint8 -> ŷ (..., d) float32: codebook values in the rotated domain."""
        values, offset = [], 0
        for (lo, hi, b), cent, table, points in zip(self.parts, self.centroids, self.byte_tables, self.points):
            width = packed_nbytes(hi - lo, b)
            part = packed[..., offset:offset + width]                              # (..., width) uint8
            if points is not None:
                values.append(_block_decode(part, points, b, hi - lo))
            elif table is not None:  # one lookup per byte gives its 8/b codebook values
                looked = F.embedding(part.int(), table)                            # (..., width, 8/b)
                values.append(looked.reshape(*part.shape[:-1], -1)[..., : hi - lo])
            else:
                values.append(cent[unpack(part, b, hi - lo)])                      # (..., hi-lo)
            offset += width
        return torch.cat(values, dim=-1) if len(values) > 1 else values[0]


#: the sign bit of each coordinate of a block, low bits of its index: (4,)
_SIGN_BITS = torch.tensor([1, 2, 4, 8])


def _block_encode(part: torch.Tensor, points: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., n) coordinates -> (codes (..., packed_nbytes(n, bits)) uint8, values (..., n)): each block of 4 as the index
    (nearest magnitude point << 4 | its sign bits), 4·bits bits; 12-bit indices are stored as two 6-bit codes."""
    blocks = part.reshape(*part.shape[:-1], -1, BLOCK)                             # (..., n/4, 4)
    negative = blocks < 0
    nearest = nearest_point(blocks.abs(), points)                                  # (..., n/4)
    index = (nearest << BLOCK) | (negative.long() * _SIGN_BITS.to(part.device)).sum(-1)
    value = points[nearest] * torch.where(negative, -1.0, 1.0)                     # (..., n/4, 4)
    if bits == 3:
        halves = torch.stack([index >> 6, index & 63], dim=-1).reshape(*index.shape[:-1], -1)  # (..., n/2)
        return pack(halves, 6), value.reshape(part.shape)
    return pack(index, BLOCK * bits), value.reshape(part.shape)


def _block_decode(codes: torch.Tensor, points: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The inverse of _block_encode's codes: (..., bytes) uint8 -> (..., n) values."""
    if bits == 3:
        halves = unpack(codes, 6, n // 2).reshape(*codes.shape[:-1], -1, 2)
        index = (halves[..., 0] << 6) | halves[..., 1]                             # (..., n/4)
    else:
        index = unpack(codes, BLOCK * bits, n // BLOCK)
    signs = torch.where((index[..., None] & _SIGN_BITS.to(codes.device)) != 0, -1.0, 1.0)   # (..., n/4, 4)
    return (points[index >> BLOCK] * signs).reshape(*codes.shape[:-1], n)


class HeadCodes:
    """One layer's codes when each KV head has its own width (+halloc): the heads' packed codes side by side in one
    row, (..., 1, T, Σ_h bytes_h), head 0 first; head h reads and writes its bytes with its own width's RotatedCodes."""

    def __init__(self, heads: list[RotatedCodes]):
        self.heads = heads
        self.bits = tuple(codes.bits for codes in heads)
        ends = list(itertools.accumulate(RotatedCodes.packed_bytes(c.dim, c.bits) for c in heads))
        self.spans = list(zip([0] + ends[:-1], ends))                             # each head's bytes in the row
        self.row_bytes = ends[-1]

    def encode(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """y: (..., H, T, d) float32 -> (packed codes (..., 1, T, row_bytes) uint8, ŷ (..., H, T, d) float32)."""
        packed, values = zip(*(codes.encode(y[..., h, :, :]) for h, codes in enumerate(self.heads)))
        return torch.cat(packed, dim=-1).unsqueeze(-3), torch.stack(values, dim=-3)

    def decode(self, packed: torch.Tensor) -> torch.Tensor:
        """(..., 1, n, row_bytes) uint8 -> ŷ (..., H, n, d) float32: each head's codebook values, rotated domain."""
        row = packed[..., 0, :, :]                                                # (..., n, row_bytes)
        return torch.stack([codes.decode(row[..., a:b]) for codes, (a, b) in zip(self.heads, self.spans)], dim=-3)




class TqCodec:
    """TurboQuant's coding state of a set of layers and the arithmetic on it, apart from any tokens: per layer the
    rotation Π and the codebooks (data-independent, from the seed) and the calibration (float8 offsets, 4-bit key
    weights, +norms8 centres), one row of calibration per sequence that sets its own (`rows`). TurboQuantCache holds
    one (a row per batch row, each calibrated on its first chunk); the serving pool holds one with a single row,
    calibrated once on the model and shared by every sequence (serve/coded.py calibrated_codec).

    The methods take and give a sequence's per-token buffers as `stored`: {buffer name: (B, H', n[, bytes])} (the
    cache's own rows, or the slots a pool gathered for one sequence); row j of `stored` is the token at position
    sink + j (the first `sink` positions are kept exact, apart)."""

    def __init__(self, config, geometry: CacheGeometry, layers, rows: int, device, sink: int = 0):
        g = geometry
        if g.head_dim != g.head_dim_v:
            raise ConfigError(f"TurboQuant needs equal key and value head dims, got {g.head_dim} and {g.head_dim_v}")
        self.config, self.geometry, self.layers, self.rows, self.sink = config, g, list(layers), rows, sink
        self.device = dev = torch.device(device)
        d, H = g.head_dim, g.n_kv_heads
        config.spec.check_outliers(d)
        if config.alloc:
            check_geometry(config.key_alloc, config.spec.alloc_units(g.n_layers, H), d, config.spec.alloc_option)
        # the codebooks of every width held (one each without +alloc), and each layer's (RotatedCodes per width)
        key_held, value_held = config.spec.held_widths()
        # +alloc: the held widths' codebooks, shared by keys and values, without byte tables (allocation.py)
        vq = config.vector
        shared = ({b: RotatedCodes(d, b, dev, byte_tables=False, vector=vq) for b in config.spec.codebook_widths()}
                  if config.alloc else {})
        self.key_books = {b: shared.get(b) or RotatedCodes(d, b, dev, vector=vq) for b in key_held}
        self.value_books = {b: shared.get(b) or RotatedCodes(d, b, dev, vector=vq) for b in value_held}
        widths = {l: config.head_widths(l, H) for l in range(g.n_layers)}    # per layer: (keys, values) per head

        def layer_codes(books: dict, heads: tuple[float, ...]) -> "RotatedCodes | HeadCodes":
            return HeadCodes([books[b] for b in heads]) if config.alloc_heads else books[heads[0]]

        self.layer_key_codes = {l: layer_codes(self.key_books, widths[l][0]) for l in self.layers}
        self.layer_value_codes = {l: layer_codes(self.value_books, widths[l][1]) for l in self.layers}
        key_bits = config.spec.code_bits
        base = (centre(key_bits), centre(config.value_bits)) if config.alloc else (key_bits, config.value_bits)
        self.key_codes, self.value_codes = self.key_books[base[0]], self.value_books[base[1]]  # the base widths
        # +alloc / +halloc: the recipe is state the codec holds, one uint8 key and value width per layer (and KV head)
        self.recipe = None
        if config.alloc:
            recipe = [[list(pair) for pair in zip(*widths[l])] for l in range(g.n_layers)]   # (L, Hkv, 2)
            self.recipe = torch.tensor(recipe if config.alloc_heads else [row[0] for row in recipe], dtype=torch.uint8,
                                       device=dev)                                           # (L, Hkv, 2) or (L, 2)
        # the C kernels on CPU: one width's rows decoded (kernels/codebook.c, `rows_in_c`) and the reads in C of the
        # caches that hold this codec; None: torch decodes (the reference)
        self.code_kernel = codebook_kernel_for(dev)
        self.haar_basis = None                                                               # (d, d) Q shared by the layers
        if config.rotation == "haar":
            self.haar_basis = haar_matrix(d, torch.Generator().manual_seed(_layer_seed(config.seed, -2))).to(dev)
        self.rotations = {l: Rotation(d, _layer_seed(config.seed, l), dev, self.haar_basis) for l in self.layers}

        # offsets: the mean of a layer's first tokens, subtracted before and added after coding
        def offsets(which: str) -> dict[int, torch.Tensor]:
            return {l: torch.zeros(rows, H, d, dtype=_OFFSET, device=dev) for l in self.layers} if which in config.center else {}

        self.k_offset, self.v_offset = offsets("k"), offsets("v")                            # (rows, H, d) fp8
        # key channel weights, 4-bit codes of log2 w; code WEIGHT_ZERO is w = 1
        self.k_weight_codes = {
            l: torch.full((rows, H, packed_nbytes(d, WEIGHT_BITS)), _NEUTRAL_WEIGHT_BYTE, dtype=torch.uint8, device=dev)
            for l in self.layers
        } if config.key_weights else {}                                                      # (rows, H, d/2) uint8
        # +norms8: each layer's log2 centre per KV head for its key and value scales
        self.norm_centres = {name: {l: torch.zeros(rows, H, dtype=torch.float16, device=dev) for l in self.layers}
                             for name in ("k_norm", "v_norm")} if config.log_norms else {}   # (rows, H) float16
        self.qjl_matrix = None
        if config.qjl:
            gen = torch.Generator().manual_seed(_layer_seed(config.seed, -1))
            self.qjl_matrix = torch.randn(d, d, generator=gen).to(dev)                       # (m=d, d) S
            # the signs as 1-bit codes whose two centroids are -1 and +1, for the C kernels
            self.sign_layout = CodeLayout.of([(0, d, 1)], [torch.tensor([-1.0, 1.0])], packed_nbytes(d, 1))
        self.rope_inv_freq = None
        if config.turns_keys:
            if g.rope_inv_freq is None or len(g.rope_inv_freq) != d // 2:
                option = "+prerope" if config.pre_rope else "+ropemean"
                raise ConfigError(f"{option} needs the model's RoPE frequencies (a cache geometry from CacheGeometry.for_model)")
            self.rope_inv_freq = torch.tensor(g.rope_inv_freq, dtype=torch.float32, device=dev)  # (d/2,)

    def token_shapes(self, layers=None) -> dict[str, tuple[torch.dtype, dict[int, tuple[int, ...]]]]:
        """Each per-token buffer's dtype and, per layer (of `layers`; None: all), a token's (H', *row) (cache/blocks.py
        TqBlocks' `shapes`): what `code` returns and the reads take, in that order."""
        config, H, d = self.config, self.geometry.n_kv_heads, self.geometry.head_dim
        norm = torch.uint8 if config.log_norms else config.norm_dtype
        layers = self.layers if layers is None else list(layers)

        def codes(books: dict) -> dict[int, tuple[int, ...]]:   # +halloc: one row of every head's codes side by side
            if config.alloc_heads:
                return {l: (1, books[l].row_bytes) for l in layers}
            return {l: (H, RotatedCodes.packed_bytes(d, books[l].bits)) for l in layers}

        def per_token(*row: int) -> dict[int, tuple[int, ...]]:
            return {l: (H, *row) for l in layers}

        shapes = {"k_codes": (torch.uint8, codes(self.layer_key_codes)), "k_norm": (norm, per_token()),
                  "v_codes": (torch.uint8, codes(self.layer_value_codes)), "v_norm": (norm, per_token())}
        if config.qjl:       # the residual's sign bits and norm
            shapes.update(k_signs=(torch.uint8, per_token(packed_nbytes(d, 1))), k_rnorm=(norm, per_token()))
        if config.outliers:  # the kept key entries: channel and exact value k_c - μ_c
            shapes.update(k_out_idx=(torch.uint8, per_token(config.outliers)),
                          k_out_val=(_OUTLIER_VALUE, per_token(config.outliers)))
        return shapes

    @property
    def key_scale_mode(self) -> str:
        """With QJL the key scale is the plain norm: the residual correction is unbiased only then."""
        return "norm" if self.config.qjl else self.config.key_scale

    # -- the calibration: offsets, key weights, +norms8 centres --------------------------------------
    def calibration(self) -> dict[str, dict[int, torch.Tensor]]:
        """The calibrated state by name, {layer: (rows, H, ...)} each (empty for what the format has not)."""
        return {"k_offset": self.k_offset, "v_offset": self.v_offset, "k_weight_codes": self.k_weight_codes,
                **{f"{name}_centre": centres for name, centres in self.norm_centres.items()}}

    def calibrated_state(self) -> list[torch.Tensor]:
        """The calibration's tensors (stored codes read right only against the same state)."""
        return [t for held in self.calibration().values() for t in held.values()]

    def reset(self) -> None:
        """Every row back to no calibration: zero offsets and centres, neutral key weights."""
        for name, held in self.calibration().items():
            for state in held.values():
                if name == "k_weight_codes":
                    state.fill_(_NEUTRAL_WEIGHT_BYTE)
                else:
                    state.zero_()

    def copy_calibration(self, other: "TqCodec") -> None:
        """This codec's calibration into `other` (more rows or the same: copy_prefix)."""
        theirs = other.calibration()
        for name, held in self.calibration().items():
            copy_prefix(held, theirs[name])

    def take_calibration(self, source: "TqCodec | None", layers: "dict[int, tuple[TqCodec, int]] | None" = None) -> None:
        """Every row of every layer from row 0 of `source`'s same layer, or with `layers` from (a codec, its layer)."""
        for layer in self.layers:
            codec, at = layers[layer] if layers is not None else (source, layer)
            theirs = codec.calibration()
            for name, held in self.calibration().items():
                if held:
                    held[layer][:] = theirs[name][at][0]

    def set_offsets(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer `layer`'s offsets from a first chunk, k (as `code` takes it), v (B, H, T, d): each row's mean token."""
        for offsets, x in ((self.k_offset, k), (self.v_offset, v)):
            if offsets:
                offsets[layer][:] = x.float().mean(dim=2).clamp(-_OFFSET_MAX, _OFFSET_MAX)  # (B, H, d)

    def set_key_weights(self, layer: int, k: torch.Tensor, q: torch.Tensor | None) -> None:
        """Layer `layer`'s key weights w = (E[(k-μ)²] / E[q²])^¼ from a first chunk's keys k (B, Hkv, T, d, as `code`
        takes them) and the queries q (B, H, T', d) that first read it, or None (a read without queries: the weights
        then use the keys alone, as if every query channel had the same energy)."""
        B, Hkv, _, d = k.shape
        key_energy = (k.float() - self.key_offset(layer)).square().mean(dim=2)     # (B, Hkv, d) E[(k-μ)²]
        if self.config.rope_mean:  # one weight per RoPE pair, so that RoPE turns the weighted key as the key
            key_energy = _pair_mean(key_energy)
        if q is None:
            query_energy = torch.ones_like(key_energy)
        else:
            qg = q.float().reshape(B, Hkv, -1, d)                                      # (B, Hkv, G·T, d)
            query_energy = qg.square().mean(dim=2)                                     # (B, Hkv, d) E[q²]
            if self.config.turns_keys:  # RoPE turns each pair (i, i+d/2) of the query: both see its mean
                query_energy = _pair_mean(query_energy)
        log_w = 0.25 * (key_energy.clamp_min(_TINY).log2() - query_energy.clamp_min(_TINY).log2())
        log_w = log_w - log_w.mean(dim=-1, keepdim=True)                              # only ratios matter
        codes = (log_w * WEIGHT_STEPS).round() + WEIGHT_ZERO
        codes = codes.clamp(0, (1 << WEIGHT_BITS) - 1).to(torch.uint8)                # (B, Hkv, d)
        self.k_weight_codes[layer][:] = pack(codes, WEIGHT_BITS)

    def set_centres(self, layer: int, coded: dict[str, torch.Tensor]) -> None:
        """+norms8: layer `layer`'s centres from a first coded chunk (`code`'s float32 scales)."""
        for name, centres in self.norm_centres.items():
            centres[layer][:] = _log_centre(coded[name])

    def key_weights(self, layer: int) -> torch.Tensor | None:
        """(rows, Hkv, 1, d) float32 w, or None without key weights."""
        if not self.k_weight_codes:
            return None
        return key_weight(unpack(self.k_weight_codes[layer], WEIGHT_BITS, self.geometry.head_dim))[:, :, None]

    def key_offset(self, layer: int) -> torch.Tensor | float:
        return self.k_offset[layer][:, :, None].float() if self.k_offset else 0.0  # (rows, Hkv, 1, d)

    # -- coding -------------------------------------------------------------------------------------
    def code(self, layer: int, k: torch.Tensor, v: torch.Tensor,
             rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """What is stored for T tokens of `layer`: k, v (B, H, T, d) -> {buffer name: (B, H, T[, bytes])} for each of
        `token_shapes()` (B = rows, or 1 with one row of state); with +norms8 the scales stay float32 here
        (`stored_scales` codes them against the layer's centres). Keys before RoPE with +prerope and +ropemean;
        +ropemean: rope, the tokens' cos, sin (T, d), turns them to their positions again after the offset and
        weights. kernels/decode.c kvlab_tq_code_tokens codes as this does (cache/tq_kernel.py)."""
        rot = self.rotations[layer]
        centered = k.float() - self.key_offset(layer)                            # (B, H, T, d) k - μ
        weights = self.key_weights(layer)
        k = centered if weights is None else centered / weights
        if self.config.rope_mean:                                                 # R_t((k - μ)/w) = (k_t - R_t μ)/w
            if rope is None:
                raise ConfigError("+ropemean codes keys at their positions: give code() their RoPE rows")
            k = apply_rope(k, rope[0], rope[1])
        if self.v_offset:
            v = v.float() - self.v_offset[layer][:, :, None].float()
        out = {}
        if self.config.outliers:
            k, out["k_out_idx"], out["k_out_val"] = self._split_outliers(centered, k)
        y, norm = self._unit(rot, k)                                              # (B, H, T, d), (B, H, T)
        out["k_codes"], y_hat = self.layer_key_codes[layer].encode(y)
        out["k_norm"] = self._to_norm(norm * _scale_factor(self.key_scale_mode, y, y_hat), "key")
        if self.config.qjl:
            r = y - y_hat                                                         # (B, H, T, d) residual
            sketch = r @ self.qjl_matrix.T                                        # (B, H, T, m) S·r
            out["k_signs"] = pack((sketch >= 0).to(torch.uint8), 1)
            out["k_rnorm"] = self._to_norm(r.norm(dim=-1), "key residual")
        y, norm = self._unit(rot, v)
        out["v_codes"], y_hat = self.layer_value_codes[layer].encode(y)
        out["v_norm"] = self._to_norm(norm * _scale_factor(self.config.value_scale, y, y_hat), "value")
        return out

    def _split_outliers(self, centered: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """centered = k-μ and x = (k-μ)/w, the vector the coder sees (B, H, T, d) -> (x without its N largest-magnitude
        entries, their channels (B, H, T, N) uint8, their exact values k_c-μ_c (B, H, T, N) float16)."""
        channels = x.abs().topk(self.config.outliers, dim=-1).indices                    # (B, H, T, N)
        kept = centered.gather(-1, channels)                                            # (B, H, T, N) k_c - μ_c
        stored = kept.to(_OUTLIER_VALUE)
        if not torch.isfinite(stored).all():
            raise NonFiniteError(f"key outlier {kept.abs().max().item():.3g} overflows the float16 outliers of the TurboQuant cache")
        return x.scatter(-1, channels, 0.0), channels.to(torch.uint8), stored

    @staticmethod
    def _unit(rot: Rotation, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(Πx/‖x‖, ‖x‖); a zero vector gives y = 0 (any codes) and norm 0."""
        x = x.float()
        norm = x.norm(dim=-1)                                                     # (B, H, T)
        return rot.apply(x) / norm.clamp_min(_TINY)[..., None], norm

    def _to_norm(self, value: torch.Tensor, what: str) -> torch.Tensor:
        stored = value.to(torch.float32 if self.config.log_norms else self.config.norm_dtype)
        if not torch.isfinite(stored).all():
            raise NonFiniteError(
                f"{what} norm {value.max().item():.3g} overflows the {self.config.norm_dtype} norms of the TurboQuant cache"
            )
        return stored

    def stored_scales(self, layer: int, coded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`code`'s output as the buffers hold it: with +norms8 its float32 scales as uint8 log codes against the
        layer's centres."""
        return {**coded, **{name: _log_norm_codes(coded[name], centres[layer]) for name, centres in self.norm_centres.items()}}

    def read_scales(self, layer: int, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Buffers (B, H, n[, bytes]) as the reads take them: with +norms8 the log codes decoded to float32 scales."""
        return {**stored, **{name: _log_norm_values(stored[name], centres[layer]) for name, centres in self.norm_centres.items()}}

    # -- positions (+prerope, +ropemean) ----------------------------------------------------------------
    def slot_rope(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (n, d) of stored rows [start, start+n): positions sink + row, as the model's rope() computes them
        (the fused step reads the same table, model/fused_codes.py)."""
        return self.position_rope(self.sink + start, n)

    def position_rope(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (n, d) of positions [start, start+n) (the serving pool's slots are positions)."""
        positions = torch.arange(start, start + n, device=self.rope_inv_freq.device, dtype=torch.float32)
        angles = torch.outer(positions, self.rope_inv_freq)                       # (n, d/2)
        angles = torch.cat((angles, angles), dim=-1)                              # (n, d)
        return angles.cos(), angles.sin()

    def rope(self, k: torch.Tensor, start: int, inverse: bool = False) -> torch.Tensor:
        """RoPE (or its inverse) of stored rows [start, start+T). k: (B, H, T, d)."""
        cos, sin = self.slot_rope(start, k.shape[2])
        return apply_rope(k.float(), cos, -sin if inverse else sin)

    # -- reading ------------------------------------------------------------------------------------
    @property
    def rows_in_c(self) -> bool:
        """Whether kernels/codebook.c decodes rows of one width (`decoded`): with a C kernel and one width per layer
        (+halloc's per-head widths: torch; the C attention reads them)."""
        return self.code_kernel is not None and not self.config.alloc_heads

    def decoded(self, buffer: torch.Tensor, codes: "RotatedCodes | HeadCodes", lo: int, hi: int) -> torch.Tensor:
        """Codebook values of stored rows [lo, hi), (B, H, hi-lo, d): in C (a chunk's transient) or by torch."""
        if not self.rows_in_c:
            return codes.decode(buffer[:, :, lo:hi])
        return self.code_kernel.decode(buffer, lo, hi - lo, codes.layout)

    def _qjl_coef(self, stored: dict[str, torch.Tensor], lo: int, hi: int) -> torch.Tensor:
        """√(π/2)/m·‖r‖ per key, (B, H, hi-lo)."""
        return math.sqrt(math.pi / 2) / self.qjl_matrix.shape[0] * stored["k_rnorm"][:, :, lo:hi].float()

    def qjl_term(self, stored: dict[str, torch.Tensor], lo: int, hi: int) -> torch.Tensor:
        """The QJL residual estimate per key in the rotated domain: √(π/2)/m·‖r‖·Sᵀsign(Sr), (B, H, hi-lo, d)."""
        if self.code_kernel is None:
            signs = unpack(stored["k_signs"][:, :, lo:hi], 1, self.qjl_matrix.shape[0]).float() * 2 - 1  # (B, H, n, m) ±1
        else:
            signs = self.code_kernel.decode(stored["k_signs"], lo, hi - lo, self.sign_layout)
        return (signs @ self.qjl_matrix) * self._qjl_coef(stored, lo, hi)[..., None]

    def rotated_queries(self, layer: int, qg: torch.Tensor) -> torch.Tensor:
        """Π(q⊙w): the queries as the codes are read, (B, H, R, d)."""
        weights = self.key_weights(layer)
        return self.rotations[layer].apply(qg if weights is None else qg * weights)

    def rotated_keys(self, layer: int, stored: dict[str, torch.Tensor], lo: int, hi: int) -> torch.Tensor:
        """Stored keys [lo, hi) in the rotated domain, as the rotated queries read them: codebook values (+ the QJL
        residual estimate) times their scales, (B, H, hi-lo, d) float32."""
        k_rot = self.decoded(stored["k_codes"], self.layer_key_codes[layer], lo, hi)
        if self.config.qjl:
            k_rot = k_rot + self.qjl_term(stored, lo, hi)
        return k_rot * stored["k_norm"][:, :, lo:hi, None].float()

    def keys(self, layer: int, stored: dict[str, torch.Tensor], lo: int, hi: int) -> torch.Tensor:
        """Stored keys [lo, hi) as attention reads them (after RoPE with +prerope, +ropemean), (B, H, hi-lo, d) float32."""
        k = self.rotations[layer].invert(self.rotated_keys(layer, stored, lo, hi))
        if self.config.rope_mean:   # (k - μ)/w before RoPE, which the weights (per pair) and the offset then meet
            k = self.rope(k, lo, inverse=True)
        weights = self.key_weights(layer)
        if weights is not None:
            k = k * weights
        if self.k_offset:
            k = k + self.k_offset[layer][:, :, None].float()
        if self.config.outliers:
            k = k + self.sparse_keys(stored, lo, hi)                              # the kept entries, exact
        return self.rope(k, lo) if self.config.turns_keys else k

    def values(self, layer: int, stored: dict[str, torch.Tensor], lo: int, hi: int) -> torch.Tensor:
        """Stored values [lo, hi) in the rotated domain, (B, H, hi-lo, d) float32: codebook values times their scales
        (no inverse rotation, no offset: a read mixes them first)."""
        return self.decoded(stored["v_codes"], self.layer_value_codes[layer], lo, hi) * stored["v_norm"][:, :, lo:hi, None].float()

    def decode(self, layer: int, stored: dict[str, torch.Tensor], n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The inverse of `code`: the first n (default: all) tokens of `stored` -> k, v (B, H, n, d) float32 as
        attention reads them."""
        n = stored["k_codes"].shape[2] if n is None else n
        v = self.rotations[layer].invert(self.values(layer, stored, 0, n))
        if self.v_offset:
            v = v + self.v_offset[layer][:, :, None].float()
        return self.keys(layer, stored, 0, n), v

    def scores(self, layer: int, qg: torch.Tensor, stored: dict[str, torch.Tensor], n: int, scale: float) -> torch.Tensor:
        """Scaled logits of qg (B, H, G·T, d) against the first n tokens of `stored` -> (B, H, G·T, n), on the codes
        (the torch path; kernels/decode.c kvlab_tq_read reads them so in C)."""
        q_rot = self.rotated_queries(layer, qg) * scale                           # (B, H, G·T, d)
        scores = q_rot @ self.rotated_keys(layer, stored, 0, n).transpose(-1, -2)  # (B, H, G·T, n)
        if self.k_offset:
            scores += (qg @ self.k_offset[layer][..., None].float()) * scale      # (B, H, G·T, 1) q·μ
        if self.config.outliers:
            scores += self.outlier_dots(qg, stored, 0, n) * scale                # q·k_sparse
        return scores

    def mix(self, layer: int, p: torch.Tensor, stored: dict[str, torch.Tensor], n: int) -> torch.Tensor:
        """Σ_i p_i·v_i over the first n tokens of `stored` (see `scores`); p (B, H, G·T, n) -> (B, H, G·T, d)."""
        norms = stored["v_norm"][:, :, None, :n]                                   # (B, H, 1, n) 16-bit
        mixed = p @ (self.decoded(stored["v_codes"], self.layer_value_codes[layer], 0, n) * norms.transpose(-1, -2))
        out = self.rotations[layer].invert(mixed)                                  # (B, H, G·T, d)
        if self.v_offset:
            out = out + p.sum(dim=-1, keepdim=True) * self.v_offset[layer][:, :, None].float()
        return out

    @staticmethod
    def outlier_dots(qg: torch.Tensor, stored: dict[str, torch.Tensor], lo: int, hi: int) -> torch.Tensor:
        """q·k_sparse for stored keys [lo, hi): Σ over each key's kept entries of q_c·(k_c-μ_c), (B, H, R, hi-lo)."""
        channels = stored["k_out_idx"][:, :, lo:hi].long()                         # (B, H, n, N)
        B, H, n, N = channels.shape
        R = qg.shape[2]
        picked = qg.gather(-1, channels.reshape(B, H, 1, n * N).expand(B, H, R, n * N))  # (B, H, R, n·N) q_c
        return (picked.reshape(B, H, R, n, N) * stored["k_out_val"][:, :, None, lo:hi].float()).sum(dim=-1)

    def sparse_keys(self, stored: dict[str, torch.Tensor], lo: int, hi: int) -> torch.Tensor:
        """The kept entries of stored keys [lo, hi) as dense vectors, k_c-μ_c at their channels and 0 elsewhere,
        (B, H, hi-lo, d) float32."""
        channels = stored["k_out_idx"][:, :, lo:hi].long()                         # (B, H, n, N)
        sparse = torch.zeros(*channels.shape[:3], self.geometry.head_dim, device=channels.device)
        return sparse.scatter_(-1, channels, stored["k_out_val"][:, :, lo:hi].float())

    def read_output(self, layer: int, rotated: torch.Tensor, queries: torch.Tensor, scale: float,
                    lse: torch.Tensor | None = None, row: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What kvlab_tq_attention gives, in the model's domain: rotated (N, H, d) the normalized mix in the rotated
        domain, queries (N, H, d) the plain ones, lse (N, H) the coded keys' log-sum-exp or None; row: the
        calibration row that coded them. -> out (N, H, d) (one inverse rotation, plus the value offset: the output is
        normalized, Σp = 1) and the lse plus q·μ·scale (the key offset's score, the same for every coded key of a
        query, which C leaves out where it reads Π(q⊙w))."""
        N, H, d = rotated.shape
        Hkv = self.geometry.n_kv_heads
        out = self.rotations[layer].invert(rotated)                                # (N, H, d)
        if self.v_offset:
            offset = self.v_offset[layer][row].float()                             # (Hkv, d)
            out = (out.reshape(N, Hkv, H // Hkv, d) + offset[:, None]).reshape(N, H, d)
        if lse is not None and self.k_offset and not self.config.turns_keys:
            mu = self.k_offset[layer][row].float().repeat_interleave(H // Hkv, dim=0)      # (H, d)
            lse = lse + (queries * mu).sum(-1) * scale
        return out, lse

    # -- bytes --------------------------------------------------------------------------------------
    def state_nbytes(self) -> int:
        """Bytes of the state every token shares: rotations, codebooks, the recipe, offsets, key weights, centres, the
        QJL matrix, the RoPE frequencies, the Haar matrix."""
        fixed = sum(r.nbytes for r in self.rotations.values())
        books = {id(book): book for book in (*self.key_books.values(), *self.value_books.values())}  # shared ones once
        fixed += sum(book.nbytes for book in books.values())
        fixed += tensors_nbytes(self.recipe, self.qjl_matrix, *self.calibrated_state())
        if self.rope_inv_freq is not None:
            fixed += tensors_nbytes(self.rope_inv_freq)
        if self.haar_basis is not None:
            fixed += tensors_nbytes(self.haar_basis)
        return fixed


def _pair_mean(energy: torch.Tensor) -> torch.Tensor:
    """(..., d) per-channel energies -> each RoPE pair's (channels i and i + d/2) mean in both of its channels."""
    return (energy + energy.roll(energy.shape[-1] // 2, dims=-1)) / 2


def _byte_table(centroids: torch.Tensor, bits: int) -> torch.Tensor:
    """(256, 8/bits): row v holds the codebook values of the 8/bits codes packed in byte v (low bits first)."""
    byte = torch.arange(256, device=centroids.device)
    shifts = torch.arange(0, 8, bits, device=centroids.device)
    return centroids[(byte[:, None] >> shifts) & ((1 << bits) - 1)]


def _scale_factor(mode: str, y: torch.Tensor, y_hat: torch.Tensor) -> torch.Tensor:
    """The factor c in the stored scale ‖x‖·c (see SCALE_MODES); y, ŷ: (..., d) -> (...)."""
    if mode == "norm":
        return torch.ones(y.shape[:-1], device=y.device)
    dot = (y * y_hat).sum(dim=-1)
    sq = (y_hat * y_hat).sum(dim=-1).clamp_min(_TINY)
    if mode == "renorm":
        return sq.rsqrt()
    if mode == "lsq":
        return dot / sq
    return 1.0 / torch.where(dot.abs() > _TINY, dot, torch.ones_like(dot))   # unbiased


#: A byte holding two neutral weight codes (w = 1).
_NEUTRAL_WEIGHT_BYTE = WEIGHT_ZERO | (WEIGHT_ZERO << 4)


def _layer_seed(seed: int, layer: int) -> int:
    """Independent, reproducible seeds per layer (layer -1: the cache-wide QJL matrix, -2: the shared Haar matrix)."""
    return (seed * 1_000_003 + layer + 1) % (2**63 - 1)

