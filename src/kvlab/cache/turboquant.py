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
get k_c-μ_c at each kept channel (`TqCodec.keys`, so +prerope, `decode` and the span reads), and scores on the codes add
q·k_sparse, the N query entries at the kept channels times the kept values (`scores`). Costs N·(1+2) bytes per
key vector; the fused C step and the serving pool do not read it (the modules do).

`+alloc` (allocation.py): each layer codes its keys and its values at its own whole width, b-N..b+N,
from a recipe at the uniform total (spelled `+alloc=k…v…`, or calibrated for the model, quality/calibrate.py):
the per-token bytes are the uniform cache's (a fractional base b spends the total rounded down, around the
nearest whole widths: budget·d/8 bytes of codes per token); the recipe (L·2 uint8) and every held width's
codebook count (shared by keys and values, without the torch path's byte tables, so tq-k3v3+alloc stays within tq-k3v3's budget).
Every read takes the layer's RotatedCodes (`TqCodec.layer_key_codes`, `layer_value_codes`).

`+halloc` (allocation.py): the same per (layer, KV head) unit, spelled `+halloc=k…v…` with n_layers·n_kv_heads
digits each (layer-major) or calibrated for the model. A layer's codes buffer then holds each head's codes side by
side in one row, (B, 1, slots, Σ_h bytes_h), read by `HeadCodes` (per head, its own width's RotatedCodes); the
per-token bytes are again the uniform cache's and the recipe costs L·Hkv·2 uint8. It is read in C by the one read
of TurboQuant codes, each head its own packing (kernels/paged.c; model/fused_codes.py), the torch path decoding per
head.

The arithmetic (rotations, codebooks, calibration; `code`, `decode`, `scores`, `mix`) is cache/tq_codec.py's `TqCodec`,
which this cache and the serving pool each hold. Coding in C: `TqCodec.code` is the reference of kernels/decode.c's
kvlab_tq_code_tokens (cache/tq_kernel.py), the one C coder of a token's K/V, which the fused decode step, the serving
pool and this cache's chunks (`_coded_in_c`) call; torch codes a +norms8 layer's first chunk (its float scales set
the centres) and every chunk without the kernel.
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
from dataclasses import dataclass, field
from functools import cached_property

import torch

from ..errors import ConfigError
from ..kernels import kernel_for
from ..kernels.paged import TqStep, tq_attention
from .allocation import budget
from .base import CacheGeometry, copy_prefix, tensors_nbytes
from .blocks import TqBlocks
from .format import OUTLIER_BYTES, WEIGHT_BITS, CacheSpec, FullPrecision  # noqa: F401  (OUTLIER_BYTES: importable from here)
from .sizes import is_power_of_two, packed_nbytes
from . import compressed
from .attention import attend_with_lse
from .compressed import CompressedCache
from .tq_codec import TqCodec
from .tq_kernel import CodedLayers, code_tokens

#: The first append to a layer sets its offset and key weights only if it brings at least this many tokens.
MIN_CALIBRATION_TOKENS = 8


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
    def name(self) -> str:
        return self.spec.name

    def head_widths(self, layer: int, n_kv_heads: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(key code bits, value bits) of each KV head of `layer`: the recipe's with +alloc / +halloc, else the base
        widths."""
        if self.alloc and not self.key_alloc:
            raise ConfigError(f"cache {self.name!r} has no recipe yet: build it through an engine that calibrates it for "
                              f"its model (kvlab eval / generate), or spell the recipe as "
                              f"{self.spec.alloc_option}=k<digits>v<digits>")
        if self.alloc_heads:
            span = slice(layer * n_kv_heads, (layer + 1) * n_kv_heads)
            return self.key_alloc[span], self.value_alloc[span]
        if self.key_alloc:
            return (self.key_alloc[layer],) * n_kv_heads, (self.value_alloc[layer],) * n_kv_heads
        return (self.spec.code_bits,) * n_kv_heads, (self.value_bits,) * n_kv_heads


def config_fields(spec: CacheSpec) -> dict:
    """A TurboQuant spec's options as TurboQuantConfig's keyword arguments (the same names; torch's norm dtype)."""
    settings = {f.name: getattr(spec, f.name) for f in dataclasses.fields(TurboQuantConfig)}
    settings["norm_dtype"] = getattr(torch, spec.norm_dtype)
    return settings


class TurboQuantCache(CompressedCache):
    """Rotated, Lloyd-Max-coded K/V with 16-bit per-vector scales; attention on the codes."""

    kernel_format = "tq"   # the fused C steps read and write it in place

    def __init__(self, geometry: CacheGeometry, dtype: torch.dtype = torch.float32, device="cpu",
                 config: TurboQuantConfig | None = None):
        config = config or TurboQuantConfig()
        super().__init__(geometry, dtype, device, config.full)
        self.config = config
        g = geometry
        # the coding state (tq_codec.py): rotations, codebooks and one row of calibration per batch row, which each
        # sequence sets from its first chunk (or `use_calibration` gives)
        self.codec = TqCodec(config, g, self.compressed_layers, g.batch, self.device, self.sink)
        # the per-token buffers: B sequences, one block of S rows each (cache/blocks.py TqBlocks); per layer k_codes,
        # v_codes (B, H, S, bytes) (+halloc (B, 1, S, Σ bytes)), k_norm, v_norm (B, H, S) [+ qjl, outliers]. Coded token
        # j is row j; S = slots + sink: the last `sink` rows are never written, kept as the pool keeps them (format.py
        # CacheSpec.coded_rows)
        self.blocks = TqBlocks(self.codec.token_shapes(), g.batch, config.spec.coded_rows(g.capacity), self.device)
        for name, layers in self.blocks.buffers.items():
            setattr(self, name, layers)
        self._given_centres = False   # +norms8 centres from `use_calibration`: no chunk moves them
        self._calibrated: set[int] = set()
        self._pending: dict[int, tuple] = {}   # first chunk (k as coded, v, start, k as appended), until attended
        # the coded tokens read in C (`_coded_read`): each (layer, batch row)'s Coded and step, made at its first read
        self._c_structs = CodedLayers("TurboQuant cache read")
        self._c_reads: dict[tuple, tuple] = {}
        self._c_slot_rope: tuple[torch.Tensor, torch.Tensor] | None = None
        # chunks coded by kvlab_tq_code_tokens (`_coded_in_c`) where the C kernel is at hand; False: by `code` (the reference:
        # the tests that compare the C read with torch's give both caches the same codes so)
        self.codes_in_c = self.codec.code_kernel is not None

    @property
    def code_kernel(self):
        """The C kernels that code and read this cache's codes (its codec's; QuantizedCache has the same switch); None:
        the torch path, the reference."""
        return self.codec.code_kernel

    @code_kernel.setter
    def code_kernel(self, kernel) -> None:
        self.codec.code_kernel = kernel

    def reset(self) -> None:
        super().reset()
        self._calibrated.clear()
        self._pending.clear()
        self._given_centres = False
        self.codec.reset()

    def _copy_into(self, bigger: "TurboQuantCache") -> None:
        """Codes, norms and the calibration (offsets, key weights, which layers have them, a first chunk still
        waiting for its queries); the rotations and the QJL matrix are rebuilt identically from the seed."""
        super()._copy_into(bigger)
        for name in self.token_buffer_names():
            copy_prefix(getattr(self, name), getattr(bigger, name))
        self.codec.copy_calibration(bigger.codec)
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
        """Set `layer`'s key weights from its pending first chunk and the queries reading it (q (B, H, T, d), or None:
        a read without queries, e.g. `dequantized`), then code it."""
        k, v, start, appended = self._pending.pop(layer)                               # k: before RoPE (`_before_rope`)
        self.codec.set_key_weights(layer, k, q)
        self._encode(layer, appended, v, start, k)

    # -- storing ------------------------------------------------------------------------------------
    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        if layer in self._pending:  # a second chunk before the first was read: fix the weights now
            self._calibrate_and_store(layer, None)
        before_rope = None   # computed where the calibration needs it, else only if torch codes the chunk
        if layer not in self._calibrated:
            self._calibrated.add(layer)
            if k.shape[2] >= MIN_CALIBRATION_TOKENS:  # too few tokens: no offset, neutral weights
                before_rope = self._before_rope(k, start)
                self.codec.set_offsets(layer, before_rope, v)
                if self.codec.k_weight_codes:  # the weights need the queries: code this chunk when it is first read
                    self._pending[layer] = (before_rope, v, start, k)
                    return
        self._encode(layer, k, v, start, before_rope)

    def _before_rope(self, k: torch.Tensor, start: int) -> torch.Tensor:
        """Keys (B, H, T, d) of compressed slots [start, start+T) as `code` and the calibration take them: turned back
        by RoPE with +prerope and +ropemean, else as appended."""
        return self.codec.rope(k, start, inverse=True) if self.config.turns_keys else k

    def _encode(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int,
                before_rope: torch.Tensor | None = None) -> None:
        """Code tokens [start, start+T) of `layer` into its buffers: k (B, H, T, d) as appended (after RoPE), before_rope
        the keys as `code` takes them where the caller has them (`_before_rope`). In C where `_coded_in_c` can, else
        by the codec's `code`."""
        if self._coded_in_c(layer, k, v, start):
            return
        if before_rope is None:
            before_rope = self._before_rope(k, start)
        end = start + k.shape[2]
        codec = self.codec
        coded = codec.code(layer, before_rope, v, codec.slot_rope(start, k.shape[2]) if self.config.rope_mean else None)
        if start == 0 and not self._given_centres:   # +norms8: the layer's first coded chunk sets its centres
            codec.set_centres(layer, coded)
        for name, value in codec.stored_scales(layer, coded).items():
            getattr(self, name)[layer][:, :, start:end] = value

    def _coded_in_c(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> bool:
        """Code tokens [start, start+T) of `layer` (k after RoPE, v: (B, H, T, d)) with kvlab_tq_code_tokens, the coder of
        the fused step and of the serving pool, each batch row into its block: True when stored. False where `code`
        codes them: no C kernel or `codes_in_c` off (the torch path is the reference), a layer's first chunk under
        +norms8 (its float scales set the centres that C codes against), a description the C coder refuses (then
        `codes_in_c` turns off), or a scale that is not finite (`code` then names it)."""
        codec = self.codec
        if codec.code_kernel is None or not self.codes_in_c or (codec.norm_centres and start == 0 and not self._given_centres):
            return False
        T, kernel = k.shape[2], kernel_for(self.device)
        rope = codec.slot_rope(start, T) if self.config.turns_keys else None          # (T, d) cos, sin
        try:
            for b in range(self.geometry.batch):
                coded = self._c_read_structs(layer, b)[0]
                first = b * self.blocks.block_size + start                                # row b's block, from `start`
                slots = torch.arange(first, first + T)
                if not code_tokens(kernel, coded, k[b].transpose(0, 1), v[b].transpose(0, 1), slots, rope):
                    return False
        except ConfigError:
            self.codes_in_c = False
            return False
        return True

    def token_buffer_names(self) -> list[str]:
        """The per-token buffers: what the codec's `code` returns and `decode` reads."""
        return list(self.blocks.buffers)

    # -- reading ------------------------------------------------------------------------------------
    def _buffers(self, layer: int) -> dict[str, torch.Tensor]:
        """The layer's buffers as the codec's reads take them (+norms8: its scales decoded to float32)."""
        return self.codec.read_scales(layer, {name: getattr(self, name)[layer] for name in self.token_buffer_names()})

    # A layer's first chunk waits uncoded (`_pending`) until the queries of its first `attend` arrive; the reads below
    # give those queries the chunk as it was appended, and `attend` codes it after them.
    def _first_keys(self, layer: int, lo: int, hi: int) -> torch.Tensor:
        """Keys of slots [lo, hi) of `layer`'s pending first chunk as attention reads them (after RoPE), (B, H, hi-lo, d)."""
        k, _, start, _ = self._pending[layer]
        k = k[:, :, lo:hi].float()
        return self.codec.rope(k, start + lo) if self.config.turns_keys else k   # _store turned it back

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
                scores[..., lo:hi] = qg @ self.codec.keys(layer, stored, lo, hi).transpose(-1, -2)  # a chunk's transient
            return scores.mul_(self.scale)
        return self.codec.scores(layer, qg, self._buffers(layer), n, self.scale)

    def _mix(self, layer: int, p: torch.Tensor, n: int) -> torch.Tensor:
        if layer in self._pending:
            return p @ self._first_values(layer, 0, n)                             # (B, H, G·T, d)
        return self.codec.mix(layer, p, self._buffers(layer), n)

    #: long chunks in blocks over spans of codes (compressed.py)
    reads_spans = True

    def _span_attend(self, layer: int, qg: torch.Tensor, lo: int, hi: int, mask: torch.Tensor | None,
                     first_query: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of [lo, hi) decoded (in C, a chunk's transient) in the rotated domain with their
        norms, one fused attention there, one inverse rotation of its output; q·μ shifts the log-sum-exp.
        +prerope, +outliersN: the span's keys rebuilt (and turned by RoPE, `keys`), attended with the plain queries.
        The pending first chunk, read by the queries that first attend it: its exact K/V."""
        if layer in self._pending:
            return attend_with_lse(qg, self._first_keys(layer, lo, hi), self._first_values(layer, lo, hi), self.scale, mask)
        codec, stored = self.codec, self._buffers(layer)
        values = codec.values(layer, stored, lo, hi)
        if self.config.turns_keys or self.config.outliers:
            out, lse = attend_with_lse(qg, codec.keys(layer, stored, lo, hi), values, self.scale, mask)  # (B, H, R, d), (B, H, R)
        else:
            keys = codec.rotated_keys(layer, stored, lo, hi)                       # (B, H, n, d)
            out, lse = attend_with_lse(codec.rotated_queries(layer, qg), keys, values, self.scale, mask)
            if codec.k_offset:
                lse = lse + (qg @ codec.k_offset[layer][..., None].float())[..., 0] * self.scale  # q·μ, the same for every key
        out = codec.rotations[layer].invert(out)
        if codec.v_offset:
            out = out + codec.v_offset[layer][:, :, None].float()                 # the output is normalized: Σp = 1
        return out, lse

    def _coded_read(self, layer: int, qg: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The coded tokens' attention through the one C read of TurboQuant codes (kernels/paged.c kvlab_tq_attention,
        the serving pool's): each batch row is a sequence whose one block is its table, its coded token j at position j
        (the queries' positions counted from the first coded one), keys below the recent window's. qg (B, Hkv, G·T, d)
        -> normalized output (B, Hkv, G·T, d) and log-sum-exp (B, Hkv, G·T) (-inf: a row before every coded token).
        None where the torch path reads them: no C kernel (`code_kernel` None, the reference), or the layer's first chunk
        still exact."""
        codec = self.codec
        if codec.code_kernel is None or layer in self._pending:
            return None
        B, Hkv, rows, d = qg.shape
        G, n = rows // T, self._n_comp[layer]
        context = n + self._held(layer)                       # the last query's position, counted from the first coded
        read = min(T, context)                                # query rows at or after the first coded position

        def by_row(x: torch.Tensor) -> torch.Tensor:          # (B, Hkv, G·T, d) -> (B, read, H, d): the rows read
            return x.reshape(B, Hkv, G, T, d)[:, :, :, T - read:].permute(0, 3, 1, 2, 4).reshape(B, read, Hkv * G, d)

        plain = by_row(qg)                                    # the queries as C takes them where it turns the keys
        queries = plain if self.config.turns_keys else by_row(codec.rotated_queries(layer, qg))
        out = qg.new_zeros(B, Hkv, G, T, d)
        lse = qg.new_full((B, Hkv, G, T), float("-inf"))
        query_start, context_len = torch.tensor([0, read], dtype=torch.int32), torch.tensor([context], dtype=torch.int32)
        for b in range(B):
            coded, step, table = self._c_read_structs(layer, b)
            rotated, row_lse = tq_attention(codec.code_kernel, coded, queries[b].contiguous(), table, query_start,
                                            context_len, step, self.scale, self.geometry.window or 0, key_end=n,
                                            with_lse=True)                                 # (read, H, d), (read, H)
            o, row_lse = codec.read_output(layer, rotated, plain[b], self.scale, row_lse, row=b)
            out[b, :, :, T - read:] = o.reshape(read, Hkv, G, d).permute(1, 2, 0, 3)       # (Hkv, G, read, d)
            lse[b, :, :, T - read:] = row_lse.reshape(read, Hkv, G).permute(1, 2, 0)       # (Hkv, G, read)
        return out.reshape(B, Hkv, rows, d), lse.reshape(B, Hkv, rows)

    def _c_read_structs(self, layer: int, row: int) -> tuple:
        """Layer `layer`'s Coded over every batch row's block with row `row`'s calibration, its step (+prerope: each
        slot's RoPE) and its one-block table, made once: the buffers and the state they point at stay in place."""
        held = (layer, row, self.k_codes[layer].data_ptr())   # (a copy of the cache has buffers of its own)
        structs = self._c_reads.get(held)
        if structs is None:
            if self.config.turns_keys and self._c_slot_rope is None:   # (slots, d) cos, sin: every layer's
                self._c_slot_rope = tuple(t.contiguous() for t in self.codec.slot_rope(0, self.blocks.block_size))
            coded = self._c_structs.layer(self.codec, layer, self.blocks.layer(layer),
                                          (self.geometry.batch, self.blocks.block_size), state_row=row)
            step = TqStep.of(None, self._c_slot_rope, 1, self.geometry.head_dim)
            structs = self._c_reads[held] = (coded, step, torch.tensor([[row]], dtype=torch.int32))
        return structs

    def _restore(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if layer in self._pending:
            self._calibrate_and_store(layer, None)
        return self.codec.decode(layer, self._buffers(layer), n)

    # -- a calibration shared by many sequences (the serving pool) ------------------------------------
    def use_calibration(self, codec: TqCodec | None, layers: "dict[int, tuple[TqCodec, int]] | None" = None) -> None:
        """Code every token from now on with `codec`'s per-layer offsets, key weights and +norms8 centres (its first
        row), instead of calibrating on this cache's first chunk; `reset` forgets them. `layers`: where each of this
        cache's layers takes its state instead, (a codec, its layer) (a pool of several caches' layers)."""
        self.codec.take_calibration(codec, layers)
        self._given_centres = bool(self.codec.norm_centres)
        self._pending.clear()
        self._calibrated = set(self.compressed_layers)

    def continue_calibration(self, earlier: "TurboQuantCache") -> None:
        """Code with the calibration `earlier` measured on its first tokens, in the layers it calibrated (kvlab.hf: a
        fresh segment that one decode token starts could not measure it; any stored offset or weight is exact)."""
        earlier.codec.copy_calibration(self.codec)
        self._calibrated = set(earlier._calibrated)

    # -- bytes --------------------------------------------------------------------------------------
    def _store_nbytes(self) -> int:
        per_token = tensors_nbytes(*(buf for name in self.token_buffer_names() for buf in getattr(self, name).values()))
        return per_token + self.codec.state_nbytes()

    def _store_buffers(self) -> list[torch.Tensor]:
        return [t for name in self.token_buffer_names() for t in getattr(self, name).values()] + self.codec.calibrated_state()

    def _writes_in_place(self, goes: str) -> bool:
        """Not while a layer's first chunk waits for its queries, nor a layer's first coded token (its calibration)."""
        if self._pending:
            return False
        return goes not in ("coded", "spill") or self._calibrated.issuperset(self.compressed_layers)

    @classmethod
    def describe(cls, config: TurboQuantConfig, geometry: CacheGeometry, dtype: torch.dtype) -> str:
        d = geometry.head_dim
        scale = "8-bit log scale" if config.log_norms else "16-bit norm"
        blocks = " in blocks of 4" if config.vector else ""
        key = f"per key vector: {d}×{config.spec.code_bits:g}-bit codes{blocks} + {scale}"
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
        key_held, value_held = config.spec.held_widths()
        unit = "layer and KV head" if config.alloc_heads else "layer"
        units = config.spec.alloc_units(geometry.n_layers, geometry.n_kv_heads)
        total = budget(units, config.key_bits, config.value_bits)
        heads = 1 if config.alloc_heads else geometry.n_kv_heads
        vectors = (f"per token: {total * d // 8 * heads} B of codes (the recipe's key and value widths sum to {total} "
                   f"bits over its {units} units ({unit}), each width coding {d} coordinates"
                   f"{'' if config.alloc_heads else ' of every KV head'}) + a {scale} per key and per value vector")
        if config.outliers:
            vectors += f" + {config.outliers} exact key outlier entr{'y' if config.outliers == 1 else 'ies'} (3 B each)"
        fixed += (f"; {config.spec.alloc_option}: each {unit}'s key ({key_held[0]}..{key_held[-1]}) and value "
                  f"({value_held[0]}..{value_held[-1]}) widths from a calibration recipe (1 B each per {unit}, every "
                  f"width's codebook held)")
        return vectors + fixed

