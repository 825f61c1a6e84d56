"""TurboQuantCache: random rotation + Lloyd-Max codes per coordinate, attention computed on the codes.

Zandieh, Daliri, Hadian, Mirrokni, "TurboQuant: Online Vector Quantization with Near-optimal
Distortion Rate" (arXiv 2504.19874). Per layer, a seeded rotation Π (rotation.py). A K or V vector
x, minus its layer's offset μ (keys only by default, see below), is stored as
    a 16-bit scale  ‖x-μ‖·c  (c from SCALE_MODES)  and
    codes           the Lloyd-Max codes (codebook.py, the exact law for the head dim d) of the
                    unit vector y = Π(x-μ)/‖x-μ‖, bit-packed (packing.py)
so μ + ‖x-μ‖·c·Πᵀŷ reconstructs it. Nothing else is stored per token.

Attention never rebuilds K/V in the original domain: with ŷ the codebook values (rotated domain)
    scores_i = (Πq)·ŷ_i · ‖k_i-μ‖c_i · scale  +  q·μ·scale       (q·Πᵀŷ = Πq·ŷ)
    out      = Πᵀ( Σ_i p_i ‖v_i‖c_i ŷ_i )                          (one inverse rotation per query)

What kvlab adds to the paper (both measured in docs/benchmarks.md; `+center=none+kscale=norm+vscale=norm`
gives the paper's recipe):
  * key offset μ: SmolLM2's keys have a large common component (‖mean‖ ≈ 0.8‖k‖) that a rotation
    spreads over every coordinate, so each key's quantization error scales with it. Each layer and
    KV head keeps μ = the mean key of the first append (≥ 8 tokens; the prefill), in float8: 64 bytes
    per layer and head, counted. Any μ is exact — the stored value is subtracted when coding and
    added back when reading — and q·μ is the same for every key, so it costs one dot per query.
  * renormalized scale c = 1/‖ŷ‖: the reconstruction keeps the vector's exact norm (the paper's
    c = 1 shrinks every vector by √(1-D), D the distortion, which biases attention logits).
  * key channel weights w (query-aware): a key's error e only matters through q·e. Coding
    k' = (k-μ)/w and reading with q' = q⊙w leaves q·(k-μ) unchanged, and with isotropic coding
    error the expected (q·e)² is ∝ (Σ_c w_c² E[q_c²])·(Σ_c E[(k_c-μ_c)²]/w_c²), smallest for
    w_c = (E[(k_c-μ_c)²] / E[q_c²])^¼. Each layer and KV head measures both on its first chunk
    (the prefill: its keys, and the queries that first read it — so that chunk is coded when it is
    first attended; those queries read it exactly, uncoded, so no query of the prefill reads codes
    whose μ and w came from later tokens: the cache stays causal) and keeps w as 4-bit codes of log2 w
    in quarter octaves (32 bytes per layer and head, counted). Like μ, any stored w is exact: coding
    and reading use the same value.

`+prerope` (KVQuant's pre-RoPE keys): keys are coded before RoPE. The cache undoes RoPE at the
token's position (sink + slot) before the offset, weights and rotation, and applies it again to the
rebuilt keys when reading (so scores go through the decoded keys, not the code lookups: ATTEND_KEYS keys
at a time, decoded in C, a chunk's transient; long chunks attend span by span like the other widths). Without
RoPE the common key component is one constant vector that the offset removes whole; after RoPE it
turns with the position (SmolLM2: the energy left after the offset is 0.22 of ‖k‖² pre-RoPE, 0.50
post-RoPE, one window). The key weights then use each RoPE pair's mean query energy. Costs the
d/2 float32 RoPE frequencies (the model's, from CacheGeometry.rope_inv_freq), counted.

`+ropemean`: keys coded after RoPE around their offset turned to their position. The offset μ is +prerope's (the
mean key before RoPE) and the key weights w are one per RoPE pair (each pair's mean energy, keys and queries), so
RoPE commutes with them: the cache codes x = (k - R_t μ)/w = R_t((k_pre - μ)/w), R_t RoPE at the key's position t,
and reads
    scores_i = Π(q⊙w)·ŷ_i · ‖x_i‖c_i · scale  +  q·R_t μ · scale
on the codes like the bare method, where q·R_t μ = Σ_j A_j cos(tθ_j) + B_j sin(tθ_j) over the d/2 RoPE pairs j
(A_j = q_j μ_j + q_j' μ_j', B_j = q_j' μ_j - q_j μ_j', j' = j + d/2): a d-wide dot per key and query, where +prerope
rebuilds and turns every key. The energy left to code is +prerope's. Costs the d/2 float32 RoPE frequencies, counted.

`+rot=haar`: the per-layer rotations are Q·diag(s_l), Q one seeded Haar matrix shared by the layers
(d² float32 per cache, counted) and s_l each layer's ±1 signs, instead of the randomized Hadamard
(which misses the paper's worst-case bound for inputs along a basis vector).

`+outliersN` (dense-and-sparse keys, as in KVQuant / SqueezeLLM): each key vector's N entries of largest
magnitude, as the coder sees the vector (x = (k-μ)/w, pre-RoPE with +prerope, where KVQuant finds stable outlier
channels), are taken out before the rotation and kept exactly: their channel (uint8) and their value k_c-μ_c
(float16). The rest, with those channels zeroed, is rotated and coded as usual, so its norm — and the coding error
that scales with it — no longer carries the largest entries. Reading adds the sparse part back: the rebuilt keys
get k_c-μ_c at each kept channel (`_keys`, so +prerope, `decode` and the span reads), and scores on the codes add
q·k_sparse, the N query entries at the kept channels times the kept values (`scores`). Costs N·(1+2) bytes per
key vector; the fused C step and the serving pool do not read it (the modules do).

`+alloc` (allocation.py): each layer codes its keys and its values at its own whole width, b-N..b+N,
from a recipe at the uniform total (spelled `+alloc=k…v…`, or calibrated for the model, quality/calibrate.py):
the per-token bytes are the uniform cache's (a fractional base b spends the total rounded down, around the
nearest whole widths: budget·d/8 bytes of codes per token); the recipe (L·2 uint8) and every held width's
codebook count (shared by keys and values, without the torch path's byte tables, so tq-k3v3+alloc stays within tq-k3v3's budget).
Every read takes the layer's RotatedCodes (`layer_key_codes`, `layer_value_codes`).

`+halloc` (allocation.py): the same per (layer, KV head) unit, spelled `+halloc=k…v…` with n_layers·n_kv_heads
digits each (layer-major) or calibrated for the model. A layer's codes buffer then holds each head's codes side by
side in one row, (B, 1, slots, Σ_h bytes_h), read by `HeadCodes` (per head, its own width's RotatedCodes); the
per-token bytes are again the uniform cache's and the recipe costs L·Hkv·2 uint8. It is read in C by the one read
of TurboQuant codes, each head its own packing (kernels/paged.c; model/fused_codes.py), the torch path decoding per
head.

Coding in C: `code` is the reference of kernels/decode.c's kvlab_tq_code_tokens (cache/tq_kernel.py), the one C
coder of a token's K/V, which the fused decode step, the serving pool and this cache's chunks (`_coded_in_c`) call;
torch codes a +norms8 layer's first chunk (its float scales set the centres) and every chunk without the kernel.
Reading in C: `attend` reads the coded tokens through kernels/paged.c's kvlab_tq_attention (`_coded_read`: each batch
row a sequence of one block), the serving pool's read, and merges the sink and recent window by log-sum-exp; the
fused step's coded chunks are the same kvlab_tq_read, +qjl's sketch and +outliersN's kept entries included. The
torch path (`code_kernel` None, other devices) is the reference.

`+vq` (vector_codebook.py): 2- and 3-bit parts are coded in blocks of 4 rotated coordinates, 4·b bits per block in
the scalar codes' bytes (4 signs + an index into sign-symmetric magnitude points): a quarter less error at 3 bits.
`+norms8`: each vector's scale is an 8-bit log code (16 steps per octave, ±8 octaves) around a float16 centre per
layer, KV head and K/V that the layer's first coded chunk sets (`_encode`); reads decode them in `_buffers`. The C code
kernel (block parts, kernels/codebook.c), the fused decode step (model/fused_codes.py) and the serving pool
(serve/coded.py, kernels/paged.c) read both.

Fractional widths (tq3.5, tq2.5): after the rotation all d coordinates follow the same law, so no
channel is an outlier any more; "outlier channels" are simply the first ⌊frac·d⌉ rotated
coordinates, quantized at ⌊b⌋+1 bits, the rest at ⌊b⌋ bits (both with the d-dimensional codebook).
`+qjl` (the paper's inner-product variant, keys only): b-1 bits of codes, plus the 1-bit QJL
sketch sign(S·r) of the residual r = y - ŷ (S: seeded d×d Gaussian, one per cache) and ‖r‖ in 16
bits; ⟨q, r⟩ is estimated without bias by √(π/2)/d·‖r‖·⟨Sq, sign(Sr)⟩ (keys then use c = 1).

Bytes: every buffer above is counted in `nbytes`, which equals the format's formula (format.py CacheSpec.bytes).
The Sylvester Hadamard matrix and the codebooks' source are constants of d shared by all caches.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F

from ..errors import ConfigError, NonFiniteError
from ..kernels import kernel_for
from ..kernels.codebook import CodeLayout, codebook_kernel_for
from ..kernels.paged import TqStep, tq_attention
from ..rope import apply_rope
from .allocation import budget, centre, check_geometry
from .base import CacheGeometry, copy_prefix, tensors_nbytes
from .blocks import TqBlocks
from .codebook import lloyd_max
from .format import OUTLIER_BYTES, WEIGHT_BITS, WEIGHT_STEPS, WEIGHT_ZERO, CacheSpec, FullPrecision  # noqa: F401  (OUTLIER_BYTES: importable from here)
from .sizes import BLOCK, codes_nbytes, is_power_of_two, is_vector_part, packed_nbytes, table_nbytes, width_split
from .vector_codebook import magnitude_codebook, nearest_point
from . import compressed
from .attention import attend_with_lse
from .compressed import CompressedCache
from .packing import pack, unpack
from .rotation import Rotation, haar_matrix
from .tq_kernel import CodedLayers, code_tokens, key_weight

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
#: The first append to a layer sets its offset and key weights only if it brings at least this many tokens.
MIN_CALIBRATION_TOKENS = 8
#: Each vector's 16-bit scale (float16 or bfloat16), or with +norms8 its 8-bit log code: code c > 0 is the scale
#: 2^(centre + (c - 128)/LOG_NORM_STEPS), 16 steps per octave (at most ±2.2% off), ±8 octaves around a centre per layer,
#: KV head and K/V (the median log2 scale of the layer's first coded chunk, float16, counted); code 0 is a zero scale.
LOG_NORM_STEPS, _LOG_NORM_ZERO = 16, 128
#: 2^(j/16) for j < 16 in float32 (decode.h KVLAB_LOG_STEP_POWERS, the same literals): the steps of an octave
LOG_STEP_POWERS = torch.tensor([float.fromhex(h) for h in (
    "0x1p+0", "0x1.0b5586p+0", "0x1.172b84p+0", "0x1.2387a6p+0", "0x1.306fep+0", "0x1.3dea64p+0", "0x1.4bfdaep+0", "0x1.5ab07ep+0",
    "0x1.6a09e6p+0", "0x1.7a1148p+0", "0x1.8ace54p+0", "0x1.9c4918p+0", "0x1.ae89fap+0", "0x1.c199bep+0", "0x1.d5818ep+0", "0x1.ea4afap+0")], dtype=torch.float32)
_OUTLIER_VALUE = torch.float16


@dataclass(frozen=True)
class TurboQuantConfig:
    """`tq<b>` or `tq-k<bk>v<bv>`, then `+qjl`, `+recentN`, `+fp-first-last`."""

    key_bits: float = 4
    value_bits: float = 4
    qjl: bool = False                  # keys: (key_bits - 1)-bit codes + 1-bit QJL residual + 16-bit ‖r‖
    full: FullPrecision = field(default_factory=FullPrecision)
    seed: int = 0
    key_scale: str = "renorm"          # see SCALE_MODES ("norm" is the paper's)
    value_scale: str = "renorm"
    norm_dtype: torch.dtype = torch.float16
    center: str = "k"                  # "", "k" or "kv": which of K/V get a per-layer, per-head offset (OFFSETS)
    key_weights: bool = True           # query-aware key channel weights (see the module docstring)
    pre_rope: bool = False             # keys coded before RoPE, RoPE applied when reading (+prerope)
    rope_mean: bool = False            # keys coded after RoPE around their offset turned to their position (+ropemean)
    rotation: str = "hadamard"         # "hadamard" (randomized, powers of two) or "haar" (+rot=haar, shared Q)
    alloc: int = 0                     # +allocN: per-layer key / value widths within N bits of the base (allocation.py)
    key_alloc: tuple[int, ...] = ()    # the recipe's key widths, layer 0 first (): not spelled out yet
    value_alloc: tuple[int, ...] = ()
    outliers: int = 0                  # +outliersN: each key vector's N largest entries kept exactly (index + fp16)
    alloc_heads: bool = False          # +hallocN: the recipe has a width per (layer, KV head), layer-major
    vector: bool = False               # +vq: 2- and 3-bit codes in blocks of 4 coordinates (vector_codebook.py)
    log_norms: bool = False            # +norms8: 8-bit log-coded scales around a per-layer, per-head centre

    def __post_init__(self) -> None:
        if (self.key_alloc or self.value_alloc or self.alloc_heads) and not self.alloc:
            object.__setattr__(self, "alloc", 1)
        self.spec  # the format's checks (format.py), one line each

    @cached_property
    def spec(self) -> CacheSpec:
        """This config as its format: the name, the bytes formula and the width arithmetic live there."""
        return CacheSpec.from_config(self)

    @property
    def turns_keys(self) -> bool:
        """Keys turned back from their positions before the offset and weights (+prerope, +ropemean): coding needs
        each key's position, and reads take the plain queries."""
        return self.pre_rope or self.rope_mean

    @property
    def alloc_option(self) -> str:
        """"+alloc" (a width per layer) or "+halloc" (per layer and KV head): how the name spells the recipe."""
        return self.spec.alloc_option

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def code_bits(self) -> float:
        """Bits of Lloyd-Max codes per key coordinate (one fewer with qjl)."""
        return self.spec.code_bits

    def alloc_units(self, n_layers: int, n_kv_heads: int) -> int:
        """How many widths a recipe of this cache holds for keys (and for values): one per layer, or per layer and head."""
        return self.spec.alloc_units(n_layers, n_kv_heads)

    def head_widths(self, layer: int, n_kv_heads: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(key code bits, value bits) of each KV head of `layer`: the recipe's with +alloc / +halloc, else the base
        widths."""
        if self.alloc and not self.key_alloc:
            raise ConfigError(f"cache {self.name!r} has no recipe yet: build it through an engine that calibrates it for "
                              f"its model (kvlab eval / generate), or spell the recipe as {self.alloc_option}=k<digits>v<digits>")
        if self.alloc_heads:
            span = slice(layer * n_kv_heads, (layer + 1) * n_kv_heads)
            return self.key_alloc[span], self.value_alloc[span]
        if self.key_alloc:
            return (self.key_alloc[layer],) * n_kv_heads, (self.value_alloc[layer],) * n_kv_heads
        return (self.code_bits,) * n_kv_heads, (self.value_bits,) * n_kv_heads

    def check_outliers(self, dim: int) -> None:
        """+outliersN fits a head dim of `dim`: N ≤ dim, and channel indices that fit a uint8 (one-line ConfigError)."""
        self.spec.check_outliers(dim)

    def held_widths(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """The key and value widths whose codebooks a cache holds (all a recipe may use, with +alloc)."""
        return self.spec.held_widths()

    def codebook_widths(self) -> list[float]:
        """One entry per codebook the cache holds (format.py CacheSpec.codebook_widths)."""
        return self.spec.codebook_widths()


def config_fields(spec: CacheSpec) -> dict:
    """A TurboQuant spec's options as TurboQuantConfig's keyword arguments (the same names; torch's norm dtype)."""
    settings = {f.name: getattr(spec, f.name) for f in dataclasses.fields(TurboQuantConfig)}
    settings["norm_dtype"] = getattr(torch, spec.norm_dtype)
    return settings


def norm_bytes(config: TurboQuantConfig) -> int:
    """Bytes of each vector's stored scale: 2 (float16 / bfloat16), 1 with +norms8."""
    return config.spec.norm_bytes


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


class TurboQuantCache(CompressedCache):
    """Rotated, Lloyd-Max-coded K/V with 16-bit per-vector scales; attention on the codes."""

    kernel_format = "tq"   # the fused C steps read and write it in place

    def __init__(self, geometry: CacheGeometry, dtype: torch.dtype = torch.float32, device="cpu",
                 config: TurboQuantConfig | None = None):
        config = config or TurboQuantConfig()
        super().__init__(geometry, dtype, device, config.full)
        self.config = config
        g = geometry
        if g.head_dim != g.head_dim_v:
            raise ConfigError(f"TurboQuant needs equal key and value head dims, got {g.head_dim} and {g.head_dim_v}")
        d, dev = g.head_dim, self.device
        config.check_outliers(d)
        if config.alloc:
            check_geometry(config.key_alloc, config.alloc_units(g.n_layers, g.n_kv_heads), d, config.alloc_option)
        # the codebooks of every width held (one each without +alloc), and each layer's (RotatedCodes per width)
        key_held, value_held = config.held_widths()
        # +alloc: the held widths' codebooks, shared by keys and values, without byte tables (allocation.py)
        vq = config.vector
        shared = {b: RotatedCodes(d, b, dev, byte_tables=False, vector=vq) for b in config.codebook_widths()} if config.alloc else {}
        self.key_books = {b: shared.get(b) or RotatedCodes(d, b, dev, vector=vq) for b in key_held}
        self.value_books = {b: shared.get(b) or RotatedCodes(d, b, dev, vector=vq) for b in value_held}
        widths = {l: config.head_widths(l, g.n_kv_heads) for l in range(g.n_layers)}    # per layer: (keys, values) per head

        def layer_codes(books: dict, heads: tuple[float, ...]) -> "RotatedCodes | HeadCodes":
            return HeadCodes([books[b] for b in heads]) if config.alloc_heads else books[heads[0]]

        self.layer_key_codes = {l: layer_codes(self.key_books, widths[l][0]) for l in self.compressed_layers}
        self.layer_value_codes = {l: layer_codes(self.value_books, widths[l][1]) for l in self.compressed_layers}
        base = (centre(config.code_bits), centre(config.value_bits)) if config.alloc else (config.code_bits, config.value_bits)
        self.key_codes, self.value_codes = self.key_books[base[0]], self.value_books[base[1]]  # the base widths
        # +alloc / +halloc: the recipe is state the cache holds, one uint8 key and value width per layer (and KV head)
        self.recipe = None
        if config.alloc:
            recipe = [[list(pair) for pair in zip(*widths[l])] for l in range(g.n_layers)]   # (L, Hkv, 2)
            self.recipe = torch.tensor(recipe if config.alloc_heads else [row[0] for row in recipe], dtype=torch.uint8,
                                       device=dev)                                           # (L, Hkv, 2) or (L, 2)
        # the C kernels on CPU: attention read from the codes (`_coded_read`) and one width's rows decoded (kernels/
        # codebook.c, `_rows_in_c`); None: torch decodes (the reference)
        self.code_kernel = codebook_kernel_for(self.device)
        self.haar_basis = None                                                               # (d, d) Q shared by the layers
        if config.rotation == "haar":
            self.haar_basis = haar_matrix(d, torch.Generator().manual_seed(_layer_seed(config.seed, -2))).to(dev)
        self.rotations = {l: Rotation(d, _layer_seed(config.seed, l), dev, self.haar_basis) for l in self.compressed_layers}
        B, H = g.batch, g.n_kv_heads
        # the per-token buffers: B sequences, one block of `slots` rows each (cache/blocks.py TqBlocks); per layer
        # k_codes, v_codes (B, H, S, bytes) (+halloc (B, 1, S, Σ bytes)), k_norm, v_norm (B, H, S) [+ qjl, outliers]
        self.blocks = TqBlocks(self._token_shapes(), B, self.slots, dev)
        for name, layers in self.blocks.buffers.items():
            setattr(self, name, layers)
        # offsets: the mean of the first tokens each layer stores, subtracted before and added after coding
        def offsets(which: str) -> dict[int, torch.Tensor]:
            return {l: torch.zeros(B, H, d, dtype=_OFFSET, device=dev) for l in self.compressed_layers} if which in config.center else {}

        self.k_offset, self.v_offset = offsets("k"), offsets("v")                            # (B, H, d) fp8
        # key channel weights, 4-bit codes of log2 w; code WEIGHT_ZERO is w = 1
        self.k_weight_codes = {
            l: torch.full((B, H, packed_nbytes(d, WEIGHT_BITS)), _NEUTRAL_WEIGHT_BYTE, dtype=torch.uint8, device=dev)
            for l in self.compressed_layers
        } if config.key_weights else {}                                                      # (B, H, d/2) uint8
        # +norms8: each layer's log2 centre per KV head for its key and value scales, set by its first coded chunk
        # (or given by use_calibration: then `_given_centres` and no chunk moves them)
        self.norm_centres = {name: {l: torch.zeros(B, H, dtype=torch.float16, device=dev) for l in self.compressed_layers}
                             for name in ("k_norm", "v_norm")} if config.log_norms else {}   # (B, H) float16
        self._given_centres = False
        self._calibrated: set[int] = set()
        self._pending: dict[int, tuple] = {}   # first chunk (k as coded, v, start, k as appended), until attended
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
        # the coded tokens read in C (`_coded_read`): each (layer, batch row)'s Coded and step, made at its first read
        self._c_structs = CodedLayers("TurboQuant cache read")
        self._c_reads: dict[tuple[int, int], tuple] = {}
        self._c_slot_rope: tuple[torch.Tensor, torch.Tensor] | None = None
        # chunks coded by kvlab_tq_code_tokens (`_coded_in_c`) where the C kernel is at hand; False: by `code` (the reference:
        # the tests that compare the C read with torch's give both caches the same codes so)
        self.codes_in_c = self.code_kernel is not None

    def _token_shapes(self) -> dict[str, tuple[torch.dtype, dict[int, tuple[int, ...]]]]:
        """Each per-token buffer's dtype and, per compressed layer, a token's (H', *row) (TqBlocks' `shapes`), in the
        order of `token_buffer_names`."""
        config, H, d = self.config, self.geometry.n_kv_heads, self.geometry.head_dim
        layers = self.compressed_layers
        norm = torch.uint8 if config.log_norms else config.norm_dtype

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

    def reset(self) -> None:
        super().reset()
        self._calibrated.clear()
        self._pending.clear()
        self._given_centres = False
        for state in (*self.k_offset.values(), *self.v_offset.values(), *(c for cs in self.norm_centres.values() for c in cs.values())):
            state.zero_()
        for codes in self.k_weight_codes.values():
            codes.fill_(_NEUTRAL_WEIGHT_BYTE)

    def _copy_into(self, bigger: "TurboQuantCache") -> None:
        """Codes, norms and the calibration (offsets, key weights, which layers have them, a first chunk still
        waiting for its queries); the rotations and the QJL matrix are rebuilt identically from the seed."""
        super()._copy_into(bigger)
        for name in self.token_buffer_names() + ["k_offset", "v_offset", "k_weight_codes"]:
            copy_prefix(getattr(self, name), getattr(bigger, name))
        for name, centres in self.norm_centres.items():
            copy_prefix(centres, bigger.norm_centres[name])
        bigger._calibrated = set(self._calibrated)
        bigger._pending = dict(self._pending)
        bigger._given_centres = self._given_centres

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """With `layer`'s first chunk still waiting for its queries, these queries read that chunk as it was appended
        (exact K/V, `_first_keys` / `_first_values`: each sees only the keys before it, never codes shaped by a
        calibration over later tokens), and the chunk is coded after, with the key weights these queries call for."""
        out = super().attend(layer, q)
        self.calibrate(layer, q)
        return out

    def calibrate(self, layer: int, q: torch.Tensor) -> None:
        """Code `layer`'s first chunk, if it still waits for its queries, with the key weights the queries
        q (B, H, T, d) call for: what `attend` does after its exact first read (kvlab.hf calls it where transformers
        attends, before transformers reads the chunk, so there the prefill reads codes calibrated on all of it)."""
        self._check_attend(layer, q)       # before the calibration reads q
        if layer in self._pending:
            self._calibrate_and_store(layer, q)

    def awaits_queries(self, layer: int) -> bool:
        """True while `layer`'s first chunk is held uncoded until queries read it (key weights need them)."""
        return layer in self._pending

    # -- calibration: offsets and key weights from a layer's first chunk ---------------------------------
    def _calibrate_and_store(self, layer: int, q: torch.Tensor | None) -> None:
        """Set `layer`'s key weights from its pending first chunk and the queries reading it, then code it.

        q: (B, H, T, d), or None (a read without queries, e.g. `dequantized`): the weights then use the
        keys alone, as if every query channel had the same energy.
        """
        k, v, start, appended = self._pending.pop(layer)                               # k: before RoPE (`_before_rope`)
        B, Hkv, _, d = k.shape
        key_energy = (k.float() - self._key_offset(layer)).square().mean(dim=2)    # (B, Hkv, d) E[(k-μ)²]
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
        self._encode(layer, appended, v, start, k)

    def _key_weights(self, layer: int) -> torch.Tensor | None:
        """(B, Hkv, 1, d) float32 w, or None without key weights."""
        if not self.k_weight_codes:
            return None
        return key_weight(unpack(self.k_weight_codes[layer], WEIGHT_BITS, self.geometry.head_dim))[:, :, None]

    def _key_offset(self, layer: int) -> torch.Tensor | float:
        return self.k_offset[layer][:, :, None].float() if self.k_offset else 0.0  # (B, Hkv, 1, d)

    # -- storing ------------------------------------------------------------------------------------
    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        if layer in self._pending:  # a second chunk before the first was read: fix the weights now
            self._calibrate_and_store(layer, None)
        before_rope = None   # computed where the calibration needs it, else only if torch codes the chunk
        if layer not in self._calibrated:
            self._calibrated.add(layer)
            if k.shape[2] >= MIN_CALIBRATION_TOKENS:  # too few tokens: no offset, neutral weights
                before_rope = self._before_rope(k, start)
                for offsets, x in ((self.k_offset, before_rope), (self.v_offset, v)):
                    if offsets:
                        offsets[layer][:] = x.float().mean(dim=2).clamp(-_OFFSET_MAX, _OFFSET_MAX)  # (B, H, d)
                if self.k_weight_codes:  # the weights need the queries: code this chunk when it is first read
                    self._pending[layer] = (before_rope, v, start, k)
                    return
        self._encode(layer, k, v, start, before_rope)

    def _before_rope(self, k: torch.Tensor, start: int) -> torch.Tensor:
        """Keys (B, H, T, d) of compressed slots [start, start+T) as `code` and the calibration take them: turned back
        by RoPE with +prerope and +ropemean, else as appended."""
        return self._rope(k, start, inverse=True) if self.config.turns_keys else k

    def _encode(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int,
                before_rope: torch.Tensor | None = None) -> None:
        """Code tokens [start, start+T) of `layer` into its buffers: k (B, H, T, d) as appended (after RoPE), before_rope
        the keys as `code` takes them where the caller has them (`_before_rope`). In C where `_coded_in_c` can, else
        by `code`."""
        if self._coded_in_c(layer, k, v, start):
            return
        if before_rope is None:
            before_rope = self._before_rope(k, start)
        end = start + k.shape[2]
        coded = self.code(layer, before_rope, v, self.slot_rope(start, k.shape[2]) if self.config.rope_mean else None)
        if start == 0 and not self._given_centres:   # +norms8: the layer's first coded chunk sets its centres
            for name, centres in self.norm_centres.items():
                centres[layer][:] = _log_centre(coded[name])
        for name, value in self.stored_scales(layer, coded).items():
            getattr(self, name)[layer][:, :, start:end] = value

    def _coded_in_c(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> bool:
        """Code tokens [start, start+T) of `layer` (k after RoPE, v: (B, H, T, d)) with kvlab_tq_code_tokens, the coder of
        the fused step and of the serving pool, each batch row into its block: True when stored. False where `code`
        codes them: no C kernel or `codes_in_c` off (the torch path is the reference), a layer's first chunk under
        +norms8 (its float scales set the centres that C codes against), a description the C coder refuses (then
        `codes_in_c` turns off), or a scale that is not finite (`code` then names it)."""
        if self.code_kernel is None or not self.codes_in_c or (self.norm_centres and start == 0 and not self._given_centres):
            return False
        T, kernel = k.shape[2], kernel_for(self.device)
        rope = self.slot_rope(start, T) if self.config.turns_keys else None          # (T, d) cos, sin
        try:
            for b in range(self.geometry.batch):
                coded = self._c_read_structs(layer, b)[0]
                slots = torch.arange(b * self.slots + start, b * self.slots + start + T)   # row b's block, from `start`
                if not code_tokens(kernel, coded, k[b].transpose(0, 1), v[b].transpose(0, 1), slots, rope):
                    return False
        except ConfigError:
            self.codes_in_c = False
            return False
        return True

    def token_buffer_names(self) -> list[str]:
        """The per-token buffers: what `code` returns and `decode` reads."""
        return list(self.blocks.buffers)

    def code(self, layer: int, k: torch.Tensor, v: torch.Tensor,
             rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """What this cache stores for T tokens of `layer`, without storing it: k, v (B, H, T, d) ->
        {buffer name: (B, H, T[, bytes])} for each of `token_buffer_names()` (the serving pool writes them); with
        +norms8 the scales stay float32 here (`_encode` codes them against the layer's centres). Keys before RoPE
        with +prerope and +ropemean; +ropemean: rope, the tokens' cos, sin (T, d), turns them to their positions again
        after the offset and weights."""
        rot = self.rotations[layer]
        centered = k.float() - self._key_offset(layer)                           # (B, H, T, d) k - μ
        weights = self._key_weights(layer)
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

    # -- reading ------------------------------------------------------------------------------------
    # Every read takes `stored`: {buffer name: (B, H, slots[, bytes])}, this cache's own buffers or the codes a
    # serving pool gathered for one sequence (serve/coded.py), and reads its rows [lo, hi) or its first n.
    def stored_scales(self, layer: int, coded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`code`'s output as the buffers hold it: with +norms8 its float32 scales as uint8 log codes against the
        layer's centres (the serving pool stores it too)."""
        return {**coded, **{name: _log_norm_codes(coded[name], centres[layer]) for name, centres in self.norm_centres.items()}}

    def read_scales(self, layer: int, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Buffers (B, H, n[, bytes]) as the reads take them: with +norms8 the log codes decoded to float32 scales."""
        return {**stored, **{name: _log_norm_values(stored[name], centres[layer]) for name, centres in self.norm_centres.items()}}

    def _buffers(self, layer: int) -> dict[str, torch.Tensor]:
        """The layer's buffers as the reads take them (+norms8: its scales decoded to float32)."""
        return self.read_scales(layer, {name: getattr(self, name)[layer] for name in self.token_buffer_names()})

    def slot_rope(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (n, d) of compressed slots [start, start+n) (+prerope): positions sink + slot, as the model's rope()
        computes them (the fused step reads the same table, model/fused_codes.py)."""
        return self.position_rope(self.sink + start, n)

    def position_rope(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (n, d) of positions [start, start+n) (+prerope; the serving pool's slots are positions)."""
        positions = torch.arange(start, start + n, device=self.rope_inv_freq.device, dtype=torch.float32)
        angles = torch.outer(positions, self.rope_inv_freq)                       # (n, d/2)
        angles = torch.cat((angles, angles), dim=-1)                              # (n, d)
        return angles.cos(), angles.sin()

    def _rope(self, k: torch.Tensor, start: int, inverse: bool = False) -> torch.Tensor:
        """RoPE (or its inverse) for compressed slots [start, start+T). k: (B, H, T, d)."""
        cos, sin = self.slot_rope(start, k.shape[2])
        return apply_rope(k.float(), cos, -sin if inverse else sin)

    def _qjl_coef(self, stored: dict[str, torch.Tensor], lo: int, hi: int) -> torch.Tensor:
        """√(π/2)/m·‖r‖ per key, (B, H, hi-lo)."""
        return math.sqrt(math.pi / 2) / self.qjl_matrix.shape[0] * stored["k_rnorm"][:, :, lo:hi].float()

    def _qjl_term(self, stored: dict[str, torch.Tensor], lo: int, hi: int) -> torch.Tensor:
        """The QJL residual estimate per key in the rotated domain: √(π/2)/m·‖r‖·Sᵀsign(Sr), (B, H, hi-lo, d)."""
        if self.code_kernel is None:
            signs = unpack(stored["k_signs"][:, :, lo:hi], 1, self.qjl_matrix.shape[0]).float() * 2 - 1  # (B, H, n, m) ±1
        else:
            signs = self.code_kernel.decode(stored["k_signs"], lo, hi - lo, self.sign_layout)
        return (signs @ self.qjl_matrix) * self._qjl_coef(stored, lo, hi)[..., None]

    # A layer's first chunk waits uncoded (`_pending`) until the queries of its first `attend` arrive; the reads below
    # give those queries the chunk as it was appended, and `attend` codes it after them.
    def _first_keys(self, layer: int, lo: int, hi: int) -> torch.Tensor:
        """Keys of slots [lo, hi) of `layer`'s pending first chunk as attention reads them (after RoPE), (B, H, hi-lo, d)."""
        k, _, start, _ = self._pending[layer]
        k = k[:, :, lo:hi].float()
        return self._rope(k, start + lo) if self.config.turns_keys else k        # _store turned it back

    def _first_values(self, layer: int, lo: int, hi: int) -> torch.Tensor:
        return self._pending[layer][1][:, :, lo:hi].float()                       # (B, H, hi-lo, d)

    def _scores(self, layer: int, qg: torch.Tensor, n: int) -> torch.Tensor:
        if layer in self._pending:
            return (qg @ self._first_keys(layer, 0, n).transpose(-1, -2)) * self.scale   # (B, H, G·T, n)
        if self.config.turns_keys:  # each key turns by its own position: score the rebuilt keys, a key chunk at a time
            stored, step = self._buffers(layer), compressed.ATTEND_KEYS
            scores = qg.new_empty(*qg.shape[:3], n)                                # (B, H, G·T, n)
            for lo in range(0, n, step):
                hi = min(n, lo + step)
                scores[..., lo:hi] = qg @ self._keys(layer, stored, lo, hi).transpose(-1, -2)  # a chunk's transient
            return scores.mul_(self.scale)
        return self.scores(layer, qg, self._buffers(layer), n)

    def _mix(self, layer: int, p: torch.Tensor, n: int) -> torch.Tensor:
        if layer in self._pending:
            return p @ self._first_values(layer, 0, n)                             # (B, H, G·T, d)
        return self.mix(layer, p, self._buffers(layer), n)

    def scores(self, layer: int, qg: torch.Tensor, stored: dict[str, torch.Tensor], n: int) -> torch.Tensor:
        """Scaled logits of qg (B, H, G·T, d) against the first n tokens of `stored` -> (B, H, G·T, n), on the codes
        (the torch path; kernels/decode.c kvlab_tq_read reads them so in C)."""
        q_rot = self.rotated_queries(layer, qg) * self.scale                      # (B, H, G·T, d)
        norms = stored["k_norm"][:, :, None, :n]                                   # (B, H, 1, n) 16-bit
        y_hat = self._decoded(stored["k_codes"], self.layer_key_codes[layer], 0, n)        # (B, H, n, d) codebook values
        if self.config.qjl:
            y_hat = y_hat + self._qjl_term(stored, 0, n)                          # unbiased residual estimate
        scores = q_rot @ (y_hat * norms.transpose(-1, -2)).transpose(-1, -2)      # (B, H, G·T, n)
        if self.k_offset:
            scores += (qg @ self.k_offset[layer][..., None].float()) * self.scale  # (B, H, G·T, 1) q·μ
        if self.config.outliers:
            scores += self._outlier_dots(qg, stored, 0, n) * self.scale          # q·k_sparse
        return scores

    def mix(self, layer: int, p: torch.Tensor, stored: dict[str, torch.Tensor], n: int) -> torch.Tensor:
        """Σ_i p_i·v_i over the first n tokens of `stored` (see `scores`); p (B, H, G·T, n) -> (B, H, G·T, d)."""
        norms = stored["v_norm"][:, :, None, :n]                                   # (B, H, 1, n) 16-bit
        mixed = p @ (self._decoded(stored["v_codes"], self.layer_value_codes[layer], 0, n) * norms.transpose(-1, -2))
        out = self.rotations[layer].invert(mixed)                                  # (B, H, G·T, d)
        if self.v_offset:
            out = out + p.sum(dim=-1, keepdim=True) * self.v_offset[layer][:, :, None].float()
        return out

    @staticmethod
    def _outlier_dots(qg: torch.Tensor, stored: dict[str, torch.Tensor], lo: int, hi: int) -> torch.Tensor:
        """q·k_sparse for stored keys [lo, hi): Σ over each key's kept entries of q_c·(k_c-μ_c), (B, H, R, hi-lo)."""
        channels = stored["k_out_idx"][:, :, lo:hi].long()                         # (B, H, n, N)
        B, H, n, N = channels.shape
        R = qg.shape[2]
        picked = qg.gather(-1, channels.reshape(B, H, 1, n * N).expand(B, H, R, n * N))  # (B, H, R, n·N) q_c
        return (picked.reshape(B, H, R, n, N) * stored["k_out_val"][:, :, None, lo:hi].float()).sum(dim=-1)

    def _sparse_keys(self, stored: dict[str, torch.Tensor], lo: int, hi: int) -> torch.Tensor:
        """The kept entries of stored keys [lo, hi) as dense vectors, k_c-μ_c at their channels and 0 elsewhere,
        (B, H, hi-lo, d) float32."""
        channels = stored["k_out_idx"][:, :, lo:hi].long()                         # (B, H, n, N)
        sparse = torch.zeros(*channels.shape[:3], self.geometry.head_dim, device=channels.device)
        return sparse.scatter_(-1, channels, stored["k_out_val"][:, :, lo:hi].float())

    #: long chunks in blocks over spans of codes (compressed.py)
    reads_spans = True

    def _span_attend(self, layer: int, qg: torch.Tensor, lo: int, hi: int, mask: torch.Tensor | None,
                     first_query: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of [lo, hi) decoded (in C, a chunk's transient) in the rotated domain with their
        norms, one fused attention there, one inverse rotation of its output; q·μ shifts the log-sum-exp.
        +prerope, +outliersN: the span's keys rebuilt (and turned by RoPE, `_keys`), attended with the plain queries.
        The pending first chunk, read by the queries that first attend it: its exact K/V."""
        if layer in self._pending:
            return attend_with_lse(qg, self._first_keys(layer, lo, hi), self._first_values(layer, lo, hi), self.scale, mask)
        stored = self._buffers(layer)
        values = self._decoded(stored["v_codes"], self.layer_value_codes[layer], lo, hi) * stored["v_norm"][:, :, lo:hi, None].float()
        if self.config.turns_keys or self.config.outliers:
            out, lse = attend_with_lse(qg, self._keys(layer, stored, lo, hi), values, self.scale, mask)  # (B, H, R, d), (B, H, R)
        else:
            keys = self._decoded(stored["k_codes"], self.layer_key_codes[layer], lo, hi)        # (B, H, n, d) codebook values
            if self.config.qjl:
                keys = keys + self._qjl_term(stored, lo, hi)
            keys = keys * stored["k_norm"][:, :, lo:hi, None].float()
            out, lse = attend_with_lse(self.rotated_queries(layer, qg), keys, values, self.scale, mask)
            if self.k_offset:
                lse = lse + (qg @ self.k_offset[layer][..., None].float())[..., 0] * self.scale  # q·μ, the same for every key
        out = self.rotations[layer].invert(out)
        if self.v_offset:
            out = out + self.v_offset[layer][:, :, None].float()                  # the output is normalized: Σp = 1
        return out, lse

    def _coded_read(self, layer: int, qg: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The coded tokens' attention through the one C read of TurboQuant codes (kernels/paged.c kvlab_tq_attention,
        the serving pool's): each batch row is a sequence whose one block is its table, its coded token j at position j
        (the queries' positions counted from the first coded one), keys below the recent window's. qg (B, Hkv, G·T, d)
        -> normalized output (B, Hkv, G·T, d) and log-sum-exp (B, Hkv, G·T) (-inf: a row before every coded token).
        None where the torch path reads them: no C kernel (`code_kernel` None, the reference), or the layer's first chunk
        still exact."""
        config = self.config
        if self.code_kernel is None or layer in self._pending:
            return None
        B, Hkv, rows, d = qg.shape
        G, n = rows // T, self._n_comp[layer]
        context = n + self._held(layer)                       # the last query's position, counted from the first coded
        read = min(T, context)                                # query rows at or after the first coded position
        queries = qg if config.turns_keys else self.rotated_queries(layer, qg)      # (B, Hkv, G·T, d) as C takes them
        queries = queries.reshape(B, Hkv, G, T, d)[:, :, :, T - read:]               # (B, Hkv, G, read, d)
        plain = qg.reshape(B, Hkv, G, T, d)[:, :, :, T - read:]
        out = qg.new_zeros(B, Hkv, G, T, d)
        lse = qg.new_full((B, Hkv, G, T), float("-inf"))
        query_start, context_len = torch.tensor([0, read], dtype=torch.int32), torch.tensor([context], dtype=torch.int32)
        for b in range(B):
            coded, step, table = self._c_read_structs(layer, b)
            q = queries[b].permute(2, 0, 1, 3).reshape(read, Hkv * G, d).contiguous()             # (read, H, d)
            rotated, row_lse = tq_attention(self.code_kernel, coded, q, table, query_start, context_len, step, self.scale,
                                            self.geometry.window or 0, key_end=n, with_lse=True)    # (read, H, d), (read, H)
            o = self.rotations[layer].invert(rotated).reshape(read, Hkv, G, d).permute(1, 2, 0, 3)  # (Hkv, G, read, d)
            row_lse = row_lse.reshape(read, Hkv, G).permute(1, 2, 0)                                # (Hkv, G, read)
            if self.v_offset:
                o = o + self.v_offset[layer][b].float()[:, None, None]           # the output is normalized: Σp = 1
            if self.k_offset and not config.turns_keys:   # q·μ·scale, the same for every coded key of a query
                row_lse = row_lse + (plain[b] @ self.k_offset[layer][b].float()[:, None, :, None])[..., 0] * self.scale
            out[b, :, :, T - read:], lse[b, :, :, T - read:] = o, row_lse
        return out.reshape(B, Hkv, rows, d), lse.reshape(B, Hkv, rows)

    def _c_read_structs(self, layer: int, row: int) -> tuple:
        """Layer `layer`'s Coded over every batch row's block with row `row`'s calibration, its step (+prerope: each
        slot's RoPE) and its one-block table, made once: the buffers and the state they point at stay in place."""
        structs = self._c_reads.get((layer, row))
        if structs is None:
            if self.config.turns_keys and self._c_slot_rope is None:   # (slots, d) cos, sin: every layer's
                self._c_slot_rope = tuple(t.contiguous() for t in self.slot_rope(0, self.slots))
            coded = self._c_structs.layer(self, layer, self.blocks.layer(layer), (self.geometry.batch, self.slots),
                                          state_row=row)
            step = TqStep.of(None, self._c_slot_rope, 1, self.geometry.head_dim)
            structs = self._c_reads[(layer, row)] = (coded, step, torch.tensor([[row]], dtype=torch.int32))
        return structs

    @property
    def _rows_in_c(self) -> bool:
        """Whether kernels/codebook.c decodes rows of one width (`decode`, `_keys`): with a C kernel and one width
        per layer (+halloc's per-head widths: torch; attention reads them through `_coded_read`)."""
        return self.code_kernel is not None and not self.config.alloc_heads

    def rotated_queries(self, layer: int, qg: torch.Tensor) -> torch.Tensor:
        """Π(q⊙w): the queries as the codes are read, (B, H, R, d)."""
        weights = self._key_weights(layer)
        return self.rotations[layer].apply(qg if weights is None else qg * weights)

    def _decoded(self, buffer: torch.Tensor, codes: RotatedCodes, lo: int, hi: int) -> torch.Tensor:
        """Codebook values of stored rows [lo, hi), (B, H, hi-lo, d): in C (a chunk's transient) or by torch."""
        if not self._rows_in_c:
            return codes.decode(buffer[:, :, lo:hi])
        return self.code_kernel.decode(buffer, lo, hi - lo, codes.layout)

    def _keys(self, layer: int, stored: dict[str, torch.Tensor], lo: int, hi: int) -> torch.Tensor:
        """Stored keys [lo, hi) as attention reads them (after RoPE with +prerope, +ropemean), (B, H, hi-lo, d) float32."""
        k_rot = self._decoded(stored["k_codes"], self.layer_key_codes[layer], lo, hi)
        if self.config.qjl:
            k_rot = k_rot + self._qjl_term(stored, lo, hi)
        k = self.rotations[layer].invert(k_rot * stored["k_norm"][:, :, lo:hi].float()[..., None])
        if self.config.rope_mean:   # (k - μ)/w before RoPE, which the weights (per pair) and the offset then meet
            k = self._rope(k, lo, inverse=True)
        weights = self._key_weights(layer)
        if weights is not None:
            k = k * weights
        if self.k_offset:
            k = k + self.k_offset[layer][:, :, None].float()
        if self.config.outliers:
            k = k + self._sparse_keys(stored, lo, hi)                             # the kept entries, exact
        return self._rope(k, lo) if self.config.turns_keys else k

    def _restore(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if layer in self._pending:
            self._calibrate_and_store(layer, None)
        return self.decode(layer, self._buffers(layer), n)

    def decode(self, layer: int, stored: dict[str, torch.Tensor], n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The inverse of `code`: the first n (default: all) tokens of `stored` -> k, v (B, H, n, d) float32 as
        attention reads them."""
        n = stored["k_codes"].shape[2] if n is None else n
        v = self._decoded(stored["v_codes"], self.layer_value_codes[layer], 0, n) * stored["v_norm"][:, :, :n].float()[..., None]
        v = self.rotations[layer].invert(v)
        if self.v_offset:
            v = v + self.v_offset[layer][:, :, None].float()
        return self._keys(layer, stored, 0, n), v

    # -- a calibration shared by many sequences (the serving pool) ------------------------------------
    def use_calibration(self, other: "TurboQuantCache | None",
                        layers: "dict[int, tuple[TurboQuantCache, int]] | None" = None) -> None:
        """Code every token from now on with `other`'s per-layer offsets, key weights and +norms8 centres (its first
        batch row), instead of calibrating on this cache's first chunk; `reset` forgets them. `layers`: where each
        of this cache's layers takes its state instead, (a cache, its layer) (a pool of several caches' layers)."""
        for layer in self.compressed_layers:
            source, at = layers[layer] if layers is not None else (other, layer)
            for mine, theirs in ((self.k_offset, source.k_offset), (self.v_offset, source.v_offset),
                                 (self.k_weight_codes, source.k_weight_codes),
                                 *((self.norm_centres[name], source.norm_centres[name]) for name in self.norm_centres)):
                if mine:
                    mine[layer][:] = theirs[at][0]
        self._given_centres = bool(self.norm_centres)
        self._pending.clear()
        self._calibrated = set(self.compressed_layers)

    def calibrated_state(self) -> list[torch.Tensor]:
        """What `use_calibration` takes from a calibrated cache: per-layer offsets, key weights, +norms8 centres
        (stored codes read right only against the same state)."""
        return [*self.k_offset.values(), *self.v_offset.values(), *self.k_weight_codes.values(),
                *(c for centres in self.norm_centres.values() for c in centres.values())]

    # -- bytes --------------------------------------------------------------------------------------
    def _store_nbytes(self) -> int:
        per_token = tensors_nbytes(*(buf for name in self.token_buffer_names() for buf in getattr(self, name).values()))
        return per_token + self.state_nbytes()

    def _store_buffers(self) -> list[torch.Tensor]:
        names = [*self.token_buffer_names(), "k_offset", "v_offset", "k_weight_codes"]
        return [t for name in names for t in getattr(self, name).values()] + [
            t for centres in self.norm_centres.values() for t in centres.values()]

    def _writes_in_place(self, goes: str) -> bool:
        """Not while a layer's first chunk waits for its queries, nor a layer's first coded token (its calibration)."""
        if self._pending:
            return False
        return goes not in ("coded", "spill") or self._calibrated.issuperset(self.compressed_layers)

    def state_nbytes(self) -> int:
        """Bytes of the state every token shares: rotations, codebooks, offsets, key weights, the QJL matrix."""
        fixed = sum(r.nbytes for r in self.rotations.values())
        books = {id(book): book for book in (*self.key_books.values(), *self.value_books.values())}  # shared ones once
        fixed += sum(book.nbytes for book in books.values())
        fixed += tensors_nbytes(self.recipe)
        fixed += tensors_nbytes(self.qjl_matrix, *self.k_offset.values(), *self.v_offset.values(), *self.k_weight_codes.values())
        fixed += tensors_nbytes(*(c for centres in self.norm_centres.values() for c in centres.values()))
        if self.rope_inv_freq is not None:
            fixed += tensors_nbytes(self.rope_inv_freq)
        if self.haar_basis is not None:
            fixed += tensors_nbytes(self.haar_basis)
        return fixed

    @classmethod
    def describe(cls, config: TurboQuantConfig, geometry: CacheGeometry, dtype: torch.dtype) -> str:
        d = geometry.head_dim
        scale = "8-bit log scale" if config.log_norms else "16-bit norm"
        key = f"per key vector: {d}×{config.code_bits:g}-bit codes{' in blocks of 4' if config.vector else ''} + {scale}"
        if config.qjl:
            key += f" + {d}×1-bit QJL signs + 16-bit residual norm"
        if config.outliers:
            key += f" + {config.outliers} exact outlier entr{'y' if config.outliers == 1 else 'ies'} (uint8 channel + float16 value each)"
        fixed = f"; per layer: {d}-entry rotation sign vector" if is_power_of_two(d) else f"; per layer: {d}×{d} float32 rotation"
        if config.rotation == "haar":
            fixed = f"; per cache: one {d}×{d} float32 Haar matrix; per layer: {d}-entry rotation sign vector"
        if config.center:
            fixed += f", float8 {'/'.join(config.center.upper())} offset per KV head ({d} B each)"
        if config.key_weights:
            fixed += f", 4-bit key channel weights per KV head ({packed_nbytes(d, WEIGHT_BITS)} B each)"
        if config.pre_rope:
            fixed += f"; keys coded before RoPE (per cache: {d // 2} float32 RoPE frequencies)"
        if config.rope_mean:
            fixed += f"; keys coded around their offset turned to their position (per cache: {d // 2} float32 RoPE frequencies)"
        if config.log_norms:
            fixed += "; a float16 log2 centre of the key and of the value scales per layer and KV head"
        if config.vector:
            fixed += "; 2- and 3-bit codes in blocks of 4 coordinates (per cache: their float32 magnitude points)"
        if not config.alloc:   # (a fractional base of +alloc need not split d: its budget is spent instead)
            k, v = config.spec.vector_bytes(d)
            return f"{key} = {k} B; per value vector: {d}×{config.value_bits:g}-bit codes + {scale} = {v} B{fixed}"
        key_held, value_held = config.held_widths()
        unit = "layer and KV head" if config.alloc_heads else "layer"
        units = config.alloc_units(geometry.n_layers, geometry.n_kv_heads)
        total = budget(units, config.key_bits, config.value_bits)
        heads = 1 if config.alloc_heads else geometry.n_kv_heads
        vectors = (f"per token: {total * d // 8 * heads} B of codes (the recipe's key and value widths sum to {total} "
                   f"bits over its {units} units ({unit}), each width coding {d} coordinates"
                   f"{'' if config.alloc_heads else ' of every KV head'}) + a {scale} per key and per value vector")
        if config.outliers:
            vectors += f" + {config.outliers} exact key outlier entr{'y' if config.outliers == 1 else 'ies'} (3 B each)"
        fixed += (f"; {config.alloc_option}: each {unit}'s key ({key_held[0]}..{key_held[-1]}) and value "
                  f"({value_held[0]}..{value_held[-1]}) widths from a calibration recipe (1 B each per {unit}, every "
                  f"width's codebook held)")
        return vectors + fixed


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

