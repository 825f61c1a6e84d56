"""CacheSpec: a cache format as one immutable description, parsed from its name (no torch: the planner reads it).

    spec = CacheSpec.parse("tq-k3v3+recent64")      # base, widths and every option
    spec.name                                    # the canonical name, parsed back to the same spec
    spec.bytes(geometry, tokens, dtype)          # the bytes formula: a cache's nbytes, the pool's blocks, the plan
    spec.supports("pool")                        # (ok, reason): torch, fused, pool, transformers, from one table

The grammar (a name always tells the bytes it costs):

    name    := "dense" | "dense-f16" | "dense-bf16" | "concat" | "none"
             | base ("+" option)*
    base    := "int" B                  integer codes, B = 1..8 bits (int8, int4): KIVI-style
             | "tq" W                   TurboQuant, keys and values at W bits
             | "tq-k" W "v" W           TurboQuant, separate key / value widths (tq-k4v3)
    W       := 1..8, with an optional fraction (tq3.5, tq2.5): that share of the rotated
               channels gets one more bit
    option  := "recent" N               the N newest tokens of every layer kept in the cache dtype
             | "sink" N                 the N first tokens of every layer kept in the cache dtype
             | "fp-first-last"          the first and last layers kept whole in the cache dtype
             | "fp-layers=" I("." I)*   these layers kept whole in the cache dtype (fp-layers=0.29)
             | "qjl"                    (tq) keys: W-1 bits of codes + the 1-bit QJL residual
                                        sketch + a 16-bit residual norm
             | "g" N                    (int) group size: tokens per key group, channels per value
                                        group (default 32; a pool's block size in the serving pool)
             | "center=" C              (tq) which of K/V get a per-layer offset: none, k (default),
                                        v, kv — 1 float8 per channel per layer and KV head each
             | "kweights=none"          (tq) no query-aware key channel weights (default: on, 4 bits
                                        per channel per layer and KV head)
             | "prerope"                (tq) keys coded before RoPE, RoPE applied when reading
                                        (KVQuant; + the d/2 float32 RoPE frequencies per cache)
             | "ropemean"               (tq) keys coded after RoPE around their offset turned to their
                                        position: +prerope's offset and pair-wise weights, read on the
                                        codes (+ the d/2 float32 RoPE frequencies per cache)
             | "rot=" R                 (tq) rotation: hadamard (default: randomized Hadamard for powers
                                        of two) or haar (per layer Q·diag(s), one d×d float32 Q per cache)
             | "alloc" [N]              (tq) a key and a value width per layer (W-N..W+N, N = 1 (default)
                                        or 2) at the uniform total, calibrated for the model the cache
                                        is made for
             | "alloc" [N] "=k" D+ "v" D+   (tq) that recipe spelled out, one digit per layer (allocation.py)
             | "halloc" [N]             (tq) a key and a value width per layer and KV head at the uniform
                                        total, calibrated for the model (one uint8 each, counted); with a
                                        fractional base (tq-k3v2.95) the widths spread around the nearest
                                        whole ones and sum to the total rounded down (so does +alloc)
             | "halloc" [N] "=k" D+ "v" D+  (tq) that recipe spelled out, n_layers·n_kv_heads digits each,
                                        layer 0's heads first
             | "vq"                     (tq) 2- and 3-bit codes in blocks of 4 coordinates: 4 signs and an
                                        index into sign-symmetric magnitude points (vector_codebook.py), the
                                        scalar codes' bytes (+ the points, 4 KiB at 3 bits, counted)
             | "norms8"                 (tq) each vector's scale as an 8-bit log code (16 steps per octave, at
                                        most 2.2% off, ±8 octaves around a float16 centre per layer, KV
                                        head and K/V set by the first coded chunk): 1 byte per vector, not 2
             | "outliers" N             (tq) dense-and-sparse keys: the N (1..head dim) largest-magnitude
                                        entries of every key vector kept exactly, each as its channel
                                        (uint8) + its value (float16), 3 bytes, the rest coded; pay for
                                        them with a fractional width (tq-k4v3.625+outliers1 costs tq-k4v4's bytes)
    options that change no byte (numerics, for ablations):
             | "kscale=" M | "vscale=" M   how the 16-bit per-vector scale is chosen
                                        (tq; M in norm (the paper), renorm (default), lsq, unbiased)
             | "bf16norms"              (tq) store the 16-bit scales as bfloat16 instead of float16
             | "seed" N                 (tq) rotation / QJL seed (default 0)

A plain name (int4, tq-k3v3, tq-k4v4) keeps nothing in full precision. Examples: int8, int4+g64, int4+recent128,
tq3.5, tq2.5, tq-k4v3, tq-k4v4+qjl, tq-k3v3+recent64, tq-k3v3+fp-first-last. The canonical name leaves out options at
their defaults and spells the options in one order (the table OPTIONS), so every spelling of a format prints alike.

Presets. `tq4` and `tq3` are kvlab's recommended recipes, not the bare method: each name stands for PRESETS[name],
    tq4 = tq-k4v4+ropemean+norms8+sink1+kscale=lsq+vscale=lsq
keys coded after RoPE around their offset turned to each position, the first token kept in the cache dtype, 8-bit log
scales, least-squares scales: no calibration pass, and the serving pool holds it (6,004 B/token on SmolLM2 at 511
tokens where the bare method is 6,149; +1.22% perplexity over three rotation seeds, 16 windows, passkey as dense).
Its keys and values are read on their codes, in registers, at one width: 1.35x `dense-f16`'s decode at 4k tokens
(1 thread). Keys coded before RoPE (`+prerope`) stay a little closer to dense (KL 0.0145 against 0.0157, +1.30%
perplexity) but each key is rebuilt and turned when read: the same recipe with +prerope decodes at 0.88x dense-f16
at 4k tokens, and `tq4.125+prerope+norms8+sink1+kscale=lsq+vscale=lsq` (an eighth of the channels at 5 bits, 6,184
B/token, +1.04%) at 0.79x (docs/benchmarks.md);
    tq3 = tq-k3.5v3+ropemean+vq+norms8+sink1+kscale=lsq+vscale=lsq
the same levers at ~3 bits: half the key channels at 4 bits, the other half and all the values at 3 bits in blocks of
4 coordinates (+vq): 4,938 B/token (4.67x smaller than bf16), +2.80% perplexity over three seeds, passkey as dense,
no calibration. Options after a preset apply to the expansion (`tq4+seed1`, `tq3+halloc` - the calibrated 3-bit
recipe -, `tq4+kscale=renorm`), and every report spells the expansion out (the spec's `name`). The bare method prints
as `tq-k4v4`, `tq-k3v3`. transformers hands a cache keys after RoPE, so there a preset stands for a recipe without
+prerope (TRANSFORMERS_PRESETS): `tq4` for tq4.125+norms8+sink1+kscale=lsq+vscale=lsq, `tq3` for
tq-k4v3+vq+norms8+sink1: keys after RoPE need their 4 bits (+2.4% where the 3.5-bit keys give +7.1%, 4 windows), so
there `tq3` is 4.36x smaller than bf16, not 4.67x.

Bytes (`bytes`), every buffer preallocated to the capacity (the caches' `nbytes` equal it):
  dense             2·L·B·Hkv·capacity·D·elem (concat: `tokens` instead of the capacity)
  compressed        fp layers: 2·B·Hkv·capacity·D·elem each (a DenseCache of one layer)
                    other layers: sink + window: B·Hkv·(S + W)·(Dk+Dv)·elem, S = min(sink, capacity),
                    W = min(recent, capacity - S), + the codes of slots = capacity - S - W tokens (below)
                    + the state every token shares (rotations, codebooks, ...)
  int (quantized.py), per compressed layer:
    keys   B·Hkv·[slots·⌈Dk·b/8⌉ + ⌈slots/G⌉·Dk·2·2 + G·Dk·elem]     (fp16 scale + zero per channel per G tokens,
    values B·Hkv·slots·[⌈Dv·b/8⌉ + (Dv/Gv)·2·2], Gv = min(G, Dv)       and the stage of G full-precision keys)
  tq (turboquant.py), n16 = 2 bytes (1 with +norms8, plus 2·B·Hkv float16 centres per layer):
    keys   B·Hkv·slots·(codes(d, bk) + n16 [+ ⌈d/8⌉ + n16 with qjl] [+ N·(1 + 2) with +outliersN])
    values B·Hkv·slots·(codes(d, bv) + n16)       codes(d, b) = Σ over channel splits ⌈n·b/8⌉ (sizes.py)
    +alloc / +halloc: budget·d/8 bytes of codes per token (the recipe's widths sum to the budget) + the norms
    fixed  per compressed layer the rotation state (d int8 signs; d² float32 if d is not a power of two) and the key
           offsets (B·Hkv·d float8), per cache the codebooks of every width held (centroids + boundaries (+ byte
           tables), float32) and, with qjl, S (d² float32); the key channel weights (B·Hkv·d/2 bytes of 4-bit codes
           per compressed layer); +prerope, +ropemean the d/2 float32 RoPE frequencies; +rot=haar the d² float32 Haar matrix;
           +alloc the recipe (one uint8 key and value width per unit).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from typing import Callable

from ..errors import ConfigError
from .allocation import SPREADS, budget, centre, check_geometry, check_recipe, format_recipe, held_widths, parse_recipe
from .sizes import codes_nbytes, is_power_of_two, packed_nbytes, table_nbytes

#: names that stand for a recipe (see the module docstring): the head of a name, expanded before it is read
PRESETS = {"tq4": "tq-k4v4+ropemean+norms8+sink1+kscale=lsq+vscale=lsq",
           "tq3": "tq-k3.5v3+ropemean+vq+norms8+sink1+kscale=lsq+vscale=lsq"}
#: the presets as a transformers cache holds them: keys come after RoPE there, so without +prerope; after RoPE, 3.5-bit
#: keys lose 7% perplexity on SmolLM2 (4 windows) where 4-bit keys with 3-bit values lose 2.4%: there tq3 keeps 4-bit keys.
#: tq4 keeps an eighth of its channels at 5 bits there: a transformers cache dequantizes its tokens every step, so mixed
#: widths cost it no read speed (+2.3% perplexity measured that way)
TRANSFORMERS_PRESETS = {"tq4": "tq4.125+norms8+sink1+kscale=lsq+vscale=lsq", "tq3": "tq-k4v3+vq+norms8+sink1"}
#: examples of the compressed names (the CLI's help lists them)
EXAMPLES = ["int8", "int4", "int4+g64", "int4+recent128", "tq4", "tq3", "tq-k5v3", "tq3.5", "tq-k3v3", "tq2.5", "tq2",
            "tq-k4v3", "tq-k4v4+qjl", "tq-k3v3+recent64", "tq-k3v3+fp-first-last"]
#: the block formats the serving pool names in its errors
POOL_EXAMPLES = ["dense", "dense-f16", "dense-bf16", "int8", "int4", "tq4", "tq3", "tq-k4v4", "tq-k3v3", "tq3.5", "tq-k4v3",
                 "tq-k4v4+qjl"]
#: the names without options: dense (K/V stored in the run's dtype, or f16 / bf16 whatever the run's dtype), concat, none
PLAIN = {"dense": ("dense", ""), "dense-f16": ("dense", "float16"), "dense-bf16": ("dense", "bfloat16"),
         "concat": ("concat", ""), "none": ("none", "")}
#: every name without options, then the compressed examples: what "choose one of" lists
NAMES = [*PLAIN, *EXAMPLES]
#: the paths a format may run on
PATHS = ("torch", "fused", "pool", "layered-pool", "transformers")  # layered-pool: a pool of Gemma 3 / Qwen3.5 layers
#: how the 16-bit per-vector scale of a TurboQuant vector is chosen (turboquant.py SCALE_MODES explains each)
SCALE_MODES = ("norm", "renorm", "lsq", "unbiased")
#: bytes of an element of the dtypes a run or a dense cache stores in (torch dtypes answer `itemsize` themselves)
ITEMSIZE = {"float32": 4, "f32": 4, "fp32": 4, "float16": 2, "f16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2}
#: the planner's --kv-type dtypes: `int8@bf16`, and a bare f32 / f16 / bf16 for the dense cache in that dtype
DTYPES = {"f32": "float32", "float32": "float32", "f16": "float16", "float16": "float16",
          "bf16": "bfloat16", "bfloat16": "bfloat16"}
#: what the compressed formats keep in full precision in the serving pool (the int formats' open key group, sink rows)
POOL_DTYPE = "float32"

# TurboQuant's stored state, in bytes (turboquant.py holds the buffers)
OFFSET_BYTES = 1                  # a key / value offset entry: float8
WEIGHT_BITS = 4                   # a key channel weight code
#: Key channel weights w = 2^((code - WEIGHT_ZERO) / WEIGHT_STEPS) for 4-bit codes: 1/4 .. 3.4 in quarter octaves.
WEIGHT_ZERO, WEIGHT_STEPS = 8, 4
OUTLIER_BYTES = 1 + 2             # +outliersN: a kept key entry's channel (uint8) and value (float16)
META_BYTES = 2                    # the integer caches' float16 scales and zero points


@dataclass(frozen=True)
class FullPrecision:
    """What a compressed cache keeps uncompressed, in the cache dtype. Both are part of the name."""

    recent: int = 0             # newest tokens of every compressed layer kept in full precision
    sink: int = 0               # first tokens of every compressed layer kept in full precision
    first_last: bool = False    # layers 0 and L-1 kept whole in full precision
    layer_list: tuple[int, ...] = ()  # more layers kept whole (for per-layer studies)

    def layers(self, n_layers: int) -> frozenset[int]:
        chosen = set(self.layer_list) | ({0, n_layers - 1} if self.first_last else set())
        return frozenset(layer for layer in chosen if 0 <= layer < n_layers)

    @property
    def suffix(self) -> str:
        """The name options, e.g. "+recent64+fp-first-last" (empty for a plain name)."""
        listed = "+fp-layers=" + ".".join(str(l) for l in sorted(self.layer_list)) if self.layer_list else ""
        return ((f"+sink{self.sink}" if self.sink else "") + (f"+recent{self.recent}" if self.recent else "")
                + ("+fp-first-last" if self.first_last else "") + listed)

    def split(self, capacity: int) -> tuple[int, int, int]:
        """(sink, window, compressed slots) per compressed layer for a cache of `capacity` tokens."""
        sink = min(self.sink, capacity)
        window = min(self.recent, capacity - sink)
        return sink, window, capacity - sink - window


@dataclass(frozen=True)
class PoolBytes:
    """What the serving pool holds for a block format (serve/formats.py, cache/capacity.py)."""

    name: str                   # the block format's canonical name: dense-f16, int4+g16, tq4's recipe
    block: int                  # one block of block_size tokens, every layer, K and V
    shared: int = 0             # once per pool: TurboQuant's rotations, codebooks, calibration
    sequence: int = 0           # per running sequence (batch slot): the int formats' open key group, +sinkN rows


@dataclass(frozen=True)
class CacheSpec:
    """One cache format. Fields past `storage` are the compressed formats' options, named as their configs'
    (QuantizedConfig, TurboQuantConfig), at the configs' defaults unless the name sets them."""

    base: str                          # dense | concat | none | int | tq
    storage: str = ""                  # dense: the storage dtype ("": the run's, float16, bfloat16)
    key_bits: float = 0                # int: the width of keys and values; tq: the key width
    value_bits: float = 0
    full: FullPrecision = FullPrecision()
    group_size: int | None = None      # int +gN (None: 32 in a single cache, the block size in the pool)
    qjl: bool = False
    seed: int = 0
    key_scale: str = "renorm"
    value_scale: str = "renorm"
    norm_dtype: str = "float16"        # +bf16norms: bfloat16
    center: str = "k"
    key_weights: bool = True
    pre_rope: bool = False
    rope_mean: bool = False
    rotation: str = "hadamard"
    alloc: int = 0
    key_alloc: tuple[int, ...] = ()
    value_alloc: tuple[int, ...] = ()
    outliers: int = 0
    alloc_heads: bool = False
    vector: bool = False
    log_norms: bool = False
    spelled: str = field(default="", compare=False, repr=False)   # the name it was parsed from (error messages)

    def __post_init__(self) -> None:
        if (self.key_alloc or self.value_alloc or self.alloc_heads) and not self.alloc:
            object.__setattr__(self, "alloc", 1)
        if self.base == "int":
            if not isinstance(self.key_bits, int) or not 1 <= self.key_bits <= 8:
                raise ConfigError(f"integer cache width must be 1..8 bits, got {self.key_bits!r}")
            if self.group_size is not None and self.group_size <= 0:
                raise ConfigError(f"group size must be positive, got {self.group_size}")
        if self.base == "tq":
            self._check_turboquant()

    def _check_turboquant(self) -> None:
        for what, bits in (("key", self.key_bits), ("value", self.value_bits)):
            if not 1 <= bits <= 8:
                raise ConfigError(f"TurboQuant {what} width must be 1..8 bits, got {bits:g}")
        if self.qjl and self.key_bits < 2:
            raise ConfigError(f"+qjl needs at least 2 key bits (1 of them is the QJL sign), got {self.key_bits:g}")
        for mode in (self.key_scale, self.value_scale):
            if mode not in SCALE_MODES:
                raise ConfigError(f"unknown TurboQuant scale mode {mode!r}; choose one of {', '.join(SCALE_MODES)}")
        if self.center not in ("", "k", "v", "kv"):
            raise ConfigError(f"TurboQuant centering is none, k, v or kv, got {self.center!r}")
        if self.rotation not in ("hadamard", "haar"):
            raise ConfigError(f"TurboQuant rotations are hadamard or haar, got {self.rotation!r}")
        if self.log_norms and (self.qjl or self.norm_dtype != "float16"):
            raise ConfigError("+norms8 codes the scales in 8 bits; use it without +qjl and +bf16norms")
        if self.vector and self.qjl:
            raise ConfigError("+vq codes the Lloyd-Max part in blocks; use it without +qjl")
        if self.outliers < 0:
            raise ConfigError(f"+outliersN keeps N ≥ 1 key entries per vector, got {self.outliers}")
        if self.rope_mean and self.pre_rope:
            raise ConfigError("+ropemean and +prerope are two ways to code keys around RoPE; use one")
        if self.rope_mean and self.outliers:
            raise ConfigError("+ropemean codes whole keys turned to their positions; use it without +outliersN")
        if self.norm_dtype not in ("float16", "bfloat16"):
            raise ConfigError(f"TurboQuant norms are 16-bit floats, got {self.norm_dtype}")
        if not self.alloc:
            return
        option = self.alloc_option
        if self.alloc not in SPREADS:
            spreads = " or ".join(map(str, SPREADS))
            raise ConfigError(f"{option} spreads the widths by {spreads} bits ({option}, {option}2), got {self.alloc}")
        if self.qjl:
            raise ConfigError(f"{option} takes Lloyd-Max codes only: use it without +qjl (tq4, tq-k4v3, tq-k3v2.95, ...)")
        if self.full.first_last or self.full.layer_list:
            raise ConfigError(f"{option} spreads the bits over every layer: use it without +fp-first-last / +fp-layers=")
        if self.key_alloc or self.value_alloc:
            check_recipe(self.key_alloc, self.value_alloc, self.key_bits, self.value_bits, self.alloc, option)

    # -- names ------------------------------------------------------------------------------------------------
    @staticmethod
    @lru_cache(maxsize=1024)
    def parse(name: str, path: str = "torch") -> "CacheSpec":
        """'tq-k3v3+recent64' -> its spec; a one-line ConfigError for anything the grammar does not accept. `path` picks
        the presets (transformers: TRANSFORMERS_PRESETS) and the choices an unknown name's error lists."""
        key = str(name).strip().lower()
        if key in PLAIN:
            base, storage = PLAIN[key]
            return CacheSpec(base, storage, spelled=key)
        head, sep, rest = key.partition("+")
        presets = TRANSFORMERS_PRESETS if path == "transformers" else PRESETS
        if head in presets:
            head, sep, rest = (presets[head] + sep + rest).partition("+")
        for pattern, base in _BASES:
            match = pattern.fullmatch(head)
            if match:
                break
        else:
            raise ConfigError(unknown_name(name, path))
        if base == "int":
            settings: dict = {"key_bits": int(match.group(1)), "value_bits": int(match.group(1))}
        else:
            kb = float(match.group(1))
            settings = {"key_bits": kb, "value_bits": float(match.group(2)) if match.group(2) else kb}
        full: dict = {}
        for option in rest.split("+") if sep else ():
            if not option:
                raise ConfigError(f"empty option in cache name {key!r}")
            for entry in OPTIONS:
                m = re.fullmatch(entry.pattern, option)
                if m and base in entry.bases:
                    read = entry.read(m, key, settings)
                    full.update({k: v for k, v in read.items() if k in _FULL_FIELDS})
                    settings.update({k: v for k, v in read.items() if k not in _FULL_FIELDS})
                    break
            else:
                raise ConfigError(_UNKNOWN_OPTION[base].format(option=option, name=key))
        return CacheSpec(base, full=FullPrecision(**full), spelled=key, **settings)

    @staticmethod
    def parse_with_dtype(text: str | None) -> tuple["CacheSpec", str]:
        """The planner's --kv-type: 'int8@bf16' -> (int8, "bfloat16"); a bare 'f16' -> (dense, "float16"); no dtype
        -> float32. 'dense-f16' is the dense cache storing f16 in a (float32) run: the same bytes as dense@f16."""
        key = (text or "dense").strip().lower()
        cache, at, dtype = key.partition("@")
        if cache in DTYPES and not at:
            return CacheSpec.parse("dense"), DTYPES[cache]
        if at and dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {dtype!r} in --kv-type {text!r}; use f32, f16 or bf16")
        return CacheSpec.parse(cache), DTYPES[dtype or "f32"]

    @classmethod
    def from_config(cls, config) -> "CacheSpec":
        """The spec of a QuantizedConfig or TurboQuantConfig (the caches' own configs)."""
        if hasattr(config, "group_size"):   # QuantizedConfig: its default group prints as no +gN
            group = None if config.group_size == 32 else config.group_size
            return cls("int", key_bits=config.bits, value_bits=config.bits, full=config.full, group_size=group)
        settings = {f.name: getattr(config, f.name) for f in fields(config)}
        settings["norm_dtype"] = str(settings["norm_dtype"]).removeprefix("torch.")
        return cls("tq", **settings)

    @property
    def name(self) -> str:
        """The canonical name: options at their defaults left out, the rest in the order of OPTIONS."""
        if self.base in ("dense", "concat", "none"):
            return next(key for key, plain in PLAIN.items() if plain == (self.base, self.storage))
        if self.base == "int":
            head = f"int{self.key_bits}"
        else:
            kb, vb = _width(self.key_bits), _width(self.value_bits)
            head = f"tq{kb}" if kb == vb and f"tq{kb}" not in PRESETS else f"tq-k{kb}v{vb}"   # tq4, tq3 name presets
        return head + "".join(entry.write(self) for entry in OPTIONS if self.base in entry.bases)

    def __str__(self) -> str:
        return self.name

    @property
    def cache_name(self) -> str:
        """The name of the single-sequence cache that stores this format: an integer format's group of 32, its
        default there, unspelled (the serving pool's int4 at 32-token blocks is the single cache int4)."""
        return replace(self, group_size=None).name if self.group_size == 32 else self.name

    @property
    def label(self) -> str:
        """The name as the user spelled it (lower-cased), else the canonical one."""
        return self.spelled or self.name

    @property
    def preset(self) -> str:
        """The preset this spec was spelled with ("tq4"), or ""."""
        head = self.spelled.partition("+")[0]
        return head if head in PRESETS else ""

    @property
    def plain_name(self) -> str:
        """The base without options: int4, tq-k3v3, tq-k4v3 (a spelled preset: its own head)."""
        return self.spelled.partition("+")[0] or replace(self, full=FullPrecision(), **{f.name: f.default for f in _OPTION_FIELDS}).name

    @property
    def compressed(self) -> bool:
        return self.base in ("int", "tq")

    @property
    def alloc_option(self) -> str:
        """"+alloc" (a width per layer) or "+halloc" (per layer and KV head): how the name spells the recipe."""
        return "+halloc" if self.alloc_heads else "+alloc"

    def with_dtype(self, dtype: str) -> str:
        """The planner's label: 'tq4@float32' (the spelled name and the run's dtype)."""
        return f"{self.label}@{dtype}"

    # -- what runs it -----------------------------------------------------------------------------------------
    def supports(self, path: str, block_size: int | None = None) -> tuple[bool, str]:
        """(True, "") if `path` runs this format, else (False, the one-line reason every refusal gives). The pool's
        checks that depend on its block size are made when `block_size` is given."""
        if path not in PATHS:
            raise ConfigError(f"unknown path {path!r}; choose one of {', '.join(PATHS)}")
        for each in ("layered-pool", "pool") if path == "layered-pool" else (path,):   # a layered pool is a pool too
            for where, refused, message in REFUSALS:
                if where == each and refused(self, block_size):
                    return False, message.format(**self._facts(block_size))
        return True, ""

    def check(self, path: str, block_size: int | None = None) -> "CacheSpec":
        """This spec, or the ConfigError of supports()'s reason."""
        ok, reason = self.supports(path, block_size)
        if not ok:
            raise ConfigError(reason)
        return self

    def _facts(self, block_size: int | None) -> dict:
        return {"name": repr(self.label), "plain": self.plain_name, "kept": self.full.suffix.lstrip("+"),
                "sink": self.full.sink, "block_size": block_size, "group": self.pool_group(block_size or 0),
                "choices": ", ".join(POOL_EXAMPLES)}

    # -- bytes ------------------------------------------------------------------------------------------------
    def bytes(self, geometry, tokens: int, dtype="float32") -> int:
        """The bytes a cache of this format holds for `geometry` (its batch and capacity) after `tokens` tokens per
        sequence, in a run of `dtype` (a torch dtype or its name): the caches preallocate to their capacity, so only
        concat depends on `tokens`."""
        g, elem = geometry, itemsize(dtype)
        if self.base == "none":
            return 0
        if self.base in ("dense", "concat"):
            held = g.capacity if self.base == "dense" else tokens
            return dense_rows_bytes(g, g.batch * held, self.storage or dtype)
        n_fp = len(self.full.layers(g.n_layers))
        sink, window, _ = self.full.split(g.capacity)
        per_token_dense = g.n_kv_heads * (g.head_dim + g.head_dim_v) * elem * g.batch
        n_comp = g.n_layers - n_fp
        rows = self.coded_rows(g.capacity)
        store = self._int_bytes(g, elem, rows, n_comp) if self.base == "int" else self._tq_bytes(g, rows, n_comp)
        return n_fp * per_token_dense * g.capacity + n_comp * per_token_dense * (sink + window) + store

    def token_bytes(self, geometry, dtype="float32") -> float:
        """What one more token of capacity costs one sequence, over the geometry's layers: the codes (and, with
        +fp-first-last, the whole layers) a token adds past the full-precision first and newest tokens; the integer
        formats' key scales are shared by G tokens, so the mean over a group."""
        g = replace(geometry, batch=1, capacity=self.full.sink + self.full.recent + 1)
        step = (self.group_size or 32) if self.base == "int" else 1
        more = replace(g, capacity=g.capacity + step)
        return (self.bytes(more, more.capacity, dtype) - self.bytes(g, g.capacity, dtype)) / step

    def _int_bytes(self, g, elem: int, slots: int, n_layers: int) -> int:
        b, G = self.key_bits, self.group_size or 32
        keys = slots * packed_nbytes(g.head_dim, b) + -(-slots // G) * g.head_dim * 2 * META_BYTES + G * g.head_dim * elem
        values = slots * (packed_nbytes(g.head_dim_v, b) + g.head_dim_v // self.value_group(g.head_dim_v) * 2 * META_BYTES)
        return n_layers * g.batch * g.n_kv_heads * (keys + values)

    def _tq_bytes(self, g, slots: int, n_layers: int) -> int:
        d = g.head_dim
        self.check_outliers(d)
        if self.alloc:  # the recipe's widths sum to the budget: budget·d/8 code bytes per token (allocation.py)
            units = self.alloc_units(g.n_layers, g.n_kv_heads)
            heads_per_unit = 1 if self.alloc_heads else g.n_kv_heads
            vectors = n_layers * g.n_kv_heads * (2 * self.norm_bytes + self.outliers * OUTLIER_BYTES)  # norms, outliers
            per_token = g.batch * slots * (budget(units, self.key_bits, self.value_bits) * heads_per_unit * d // 8 + vectors)
        else:
            per_vector_k, per_vector_v = self.vector_bytes(d)
            per_token = n_layers * g.batch * g.n_kv_heads * slots * (per_vector_k + per_vector_v)
        haar = self.rotation == "haar"
        rotation = d if is_power_of_two(d) or haar else d * d * 4                 # signs, or a matrix per layer
        fixed = n_layers * rotation + sum(table_nbytes(d, b, not self.alloc, self.vector) for b in self.codebook_widths())
        if self.alloc:  # the recipe is one byte per width
            check_geometry(self.key_alloc, units, d, self.alloc_option)
            fixed += units * 2
        if self.qjl:
            fixed += d * d * 4
        fixed += len(self.center) * n_layers * g.batch * g.n_kv_heads * d * OFFSET_BYTES
        if self.key_weights:
            fixed += n_layers * g.batch * g.n_kv_heads * packed_nbytes(d, WEIGHT_BITS)
        if self.pre_rope or self.rope_mean:
            fixed += d // 2 * 4                                                   # float32 RoPE frequencies
        if self.log_norms:
            fixed += 2 * n_layers * g.batch * g.n_kv_heads * 2                    # float16 K and V centres per head
        if haar:
            fixed += d * d * 4                                                    # the shared Haar matrix
        return per_token + fixed

    def pool_spec(self, block_size: int) -> "CacheSpec":
        """The format a serving pool of `block_size`-token blocks holds (ConfigError if it holds none): an integer
        format's key group is the block size unless the name gives one."""
        self.check("pool", block_size)
        return replace(self, group_size=self.pool_group(block_size)) if self.base == "int" else self

    def pool_group(self, block_size: int) -> int | None:
        return (self.group_size or block_size) if self.base == "int" else None

    def pool_bytes(self, geometry, block_size: int) -> PoolBytes:
        """A pool's block, shared and per-sequence bytes by the caches' formula at batch 1: a cache's bytes at a
        capacity of c tokens are c·per_token + rest, so a block is f(2·bs) - f(bs) and the rest is f(bs) - block.
        With +sinkN a sequence's first N slots stay unwritten (their tokens are in its sink rows, float32)."""
        spec = self.pool_spec(block_size)
        one = replace(geometry, batch=1, capacity=block_size)
        if spec.base == "dense":
            return PoolBytes(spec.name, spec.bytes(one, block_size, "float32"))
        name = spec.cache_name
        spec.value_group(geometry.head_dim_v)            # the value groups must tile the head dim
        coded = replace(spec, full=FullPrecision())      # the blocks' codes (+sinkN rows apart)
        one_block = coded.bytes(one, block_size, POOL_DTYPE)
        block = coded.bytes(replace(one, capacity=2 * block_size), 2 * block_size, POOL_DTYPE) - one_block
        rest = one_block - block
        if spec.base == "int":
            return PoolBytes(name, block, sequence=rest)
        g, sink = geometry, spec.full.sink
        rows = g.n_layers * sink * g.n_kv_heads * (g.head_dim + g.head_dim_v) * ITEMSIZE[POOL_DTYPE]
        return PoolBytes(name, block, shared=rest, sequence=rows)

    # -- the compressed formats' arithmetic -------------------------------------------------------------------
    def coded_rows(self, capacity: int) -> int:
        """Rows of codes a compressed cache of `capacity` tokens holds per sequence and layer: its compressed slots,
        and for TurboQuant one more for each sink position (never written: the sink keeps those tokens exact), as the
        serving pool's positional blocks keep one, so that one formula counts the single cache and the pool."""
        sink, _, slots = self.full.split(capacity)
        return slots + sink if self.base == "tq" else slots

    def value_group(self, head_dim_v: int) -> int:
        """An integer format's channels per value group: min(G, Dv), which must divide Dv."""
        group = min(self.group_size or 32, head_dim_v)
        if head_dim_v % group:
            raise ConfigError(f"value head dim {head_dim_v} is not a multiple of the group size {group}")
        return group

    @property
    def code_bits(self) -> float:
        """Bits of Lloyd-Max codes per key coordinate (one fewer with qjl)."""
        return self.key_bits - 1 if self.qjl else self.key_bits

    @property
    def norm_bytes(self) -> int:
        """Bytes of each vector's stored scale: 2 (float16 / bfloat16), 1 with +norms8."""
        return 1 if self.log_norms else 2

    def vector_bytes(self, dim: int) -> tuple[int, int]:
        """Bytes stored per key vector and per value vector (at the base widths: +alloc spends its budget instead)."""
        n16 = self.norm_bytes
        k = codes_nbytes(dim, self.code_bits) + n16
        if self.qjl:
            k += packed_nbytes(dim, 1) + n16
        k += self.outliers * OUTLIER_BYTES
        return k, codes_nbytes(dim, self.value_bits) + n16

    def alloc_units(self, n_layers: int, n_kv_heads: int) -> int:
        """How many widths a recipe of this cache holds for keys (and for values): one per layer, or per layer and head."""
        return n_layers * n_kv_heads if self.alloc_heads else n_layers

    def held_widths(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """The key and value widths whose codebooks a cache holds (all a recipe may use, with +alloc)."""
        if self.alloc:
            return held_widths(centre(self.key_bits), self.alloc), held_widths(centre(self.value_bits), self.alloc)
        return (self.code_bits,), (self.value_bits,)

    def codebook_widths(self) -> list[float]:
        """One entry per codebook the cache holds: the key and the value width, or with +alloc every held
        width once (keys and values share them)."""
        if self.alloc:
            return sorted(set(self.held_widths()[0]) | set(self.held_widths()[1]))
        return [self.code_bits, self.value_bits]

    def check_outliers(self, dim: int) -> None:
        """+outliersN fits a head dim of `dim`: N ≤ dim, and channel indices that fit a uint8 (one-line ConfigError)."""
        if self.outliers > dim:
            raise ConfigError(f"+outliers{self.outliers} keeps more entries than a key vector has (head dim {dim})")
        if self.outliers and dim > 256:
            raise ConfigError(f"+outliersN stores channel indices as uint8, so head dims up to 256; got {dim}")


def dense_rows_bytes(geometry, rows: int, dtype) -> int:
    """Bytes of `rows` token rows of K and V in full precision: 2 (K and V) × layers × kv_heads × head_dim × `rows` ×
    the bytes of `dtype` (the dense formats' one formula: cache/blocks.py's storage holds exactly this)."""
    g = geometry
    return g.n_layers * g.n_kv_heads * (g.head_dim + g.head_dim_v) * itemsize(dtype) * rows


def itemsize(dtype) -> int:
    """Bytes of one element of `dtype`: a torch dtype, or a name like float16 / bf16."""
    if isinstance(dtype, str):
        key = dtype.removeprefix("torch.")
        if key not in ITEMSIZE:
            raise ConfigError(f"unknown dtype {dtype!r}; use float32, float16 or bfloat16")
        return ITEMSIZE[key]
    return dtype.itemsize


def unknown_name(name: str, path: str = "torch") -> str:
    """The one line an unknown name gets on `path`, with the names it could have been."""
    if path == "pool":
        return f"unknown block format {name!r}; choose one of: {', '.join(POOL_EXAMPLES)}"
    choices = [n for n in NAMES if not (path == "transformers" and n == "none")]
    return f"unknown cache {name!r}; choose one of: {', '.join(choices)}"


def _width(bits: float) -> str:
    """A width as a name spells it: 4, 3.5, 4.125 (every digit it needs to parse back to the same float)."""
    short = f"{bits:g}"
    return short if float(short) == bits else repr(float(bits))


# -- the grammar: bases and options ----------------------------------------------------------------------------
_WIDTH = r"(\d+(?:\.\d+)?)"
_BASES = [(re.compile(r"int(\d+)"), "int"), (re.compile(rf"tq-k{_WIDTH}v{_WIDTH}"), "tq"),
          (re.compile(rf"tq{_WIDTH}()"), "tq")]
_FULL_FIELDS = {f.name for f in fields(FullPrecision)}
_INT, _TQ, _BOTH = ("int",), ("tq",), ("int", "tq")


@dataclass(frozen=True)
class Option:
    """One option of the grammar: how it reads (a regex over the text after "+") and prints, and which bases take it.
    `spell` and `values` let a test generate it: spell.format(value) for each value (no values: a flag)."""

    pattern: str
    bases: tuple[str, ...]
    read: Callable[[re.Match, str, dict], dict]     # (match, the name, the settings so far) -> the fields it sets
    write: Callable[[CacheSpec], str]               # the spec -> its spelling ("" at the default)
    spell: str
    values: tuple = ()


def _flag(field_name: str, value=True) -> Callable[[re.Match, str, dict], dict]:
    return lambda m, name, settings: {field_name: value}


def _number(field_name: str) -> Callable[[re.Match, str, dict], dict]:
    return lambda m, name, settings: {field_name: int(m.group(1))}


def _outliers(m: re.Match, name: str, settings: dict) -> dict:
    if not int(m.group(1)):
        raise ConfigError(f"+outliers0 in cache {name!r} keeps no key entry; use +outliersN with N ≥ 1, or leave it out")
    return {"outliers": int(m.group(1))}


def _alloc(m: re.Match, name: str, settings: dict) -> dict:
    if settings.get("alloc"):
        raise ConfigError(f"cache {name!r} asks for two bit allocations; use one +alloc or +halloc")
    heads = bool(m.group(1))
    read = {"alloc": int(m.group(2) or 1), "alloc_heads": heads}
    if m.group(3):
        read["key_alloc"], read["value_alloc"] = parse_recipe(m.group(3)[1:], name, "+halloc" if heads else "+alloc")
    return read


def _write_alloc(s: CacheSpec) -> str:
    if not s.alloc:
        return ""
    return (s.alloc_option + (str(s.alloc) if s.alloc > 1 else "")
            + (f"={format_recipe(s.key_alloc, s.value_alloc)}" if s.key_alloc else ""))


#: every option, in the order the canonical name prints them
OPTIONS = [
    Option(r"qjl", _TQ, _flag("qjl"), lambda s: "+qjl" if s.qjl else "", "qjl"),
    Option(r"prerope", _TQ, _flag("pre_rope"), lambda s: "+prerope" if s.pre_rope else "", "prerope"),
    Option(r"ropemean", _TQ, _flag("rope_mean"), lambda s: "+ropemean" if s.rope_mean else "", "ropemean"),
    Option(r"rot=(hadamard|haar)", _TQ, lambda m, name, st: {"rotation": m.group(1)},
           lambda s: "+rot=haar" if s.rotation == "haar" else "", "rot={}", ("hadamard", "haar")),
    Option(r"vq", _TQ, _flag("vector"), lambda s: "+vq" if s.vector else "", "vq"),
    Option(r"norms8", _TQ, _flag("log_norms"), lambda s: "+norms8" if s.log_norms else "", "norms8"),
    Option(r"outliers(\d+)", _TQ, _outliers, lambda s: f"+outliers{s.outliers}" if s.outliers else "", "outliers{}",
           (1, 2, 8)),
    Option(r"(h?)alloc(\d?)(=.*)?", _TQ, _alloc, _write_alloc, "{}", ("alloc", "alloc2", "halloc", "halloc2")),
    Option(r"g(\d+)", _INT, _number("group_size"), lambda s: f"+g{s.group_size}" if s.group_size is not None else "",
           "g{}", (8, 16, 32, 64)),
    Option(r"sink(\d+)", _BOTH, _number("sink"), lambda s: f"+sink{s.full.sink}" if s.full.sink else "", "sink{}",
           (0, 1, 4)),
    Option(r"recent(\d+)", _BOTH, _number("recent"), lambda s: f"+recent{s.full.recent}" if s.full.recent else "",
           "recent{}", (0, 16, 64)),
    Option(r"fp-first-last", _BOTH, _flag("first_last"), lambda s: "+fp-first-last" if s.full.first_last else "",
           "fp-first-last"),
    Option(r"fp-layers=(\d+(?:\.\d+)*)", _BOTH,
           lambda m, name, st: {"layer_list": tuple(sorted({int(i) for i in m.group(1).split(".")}))},
           lambda s: "+fp-layers=" + ".".join(map(str, s.full.layer_list)) if s.full.layer_list else "",
           "fp-layers={}", ("0", "1.0", "0.29")),
    Option(r"center=(none|k|v|kv)", _TQ, lambda m, name, st: {"center": "" if m.group(1) == "none" else m.group(1)},
           lambda s: f"+center={s.center or 'none'}" if s.center != "k" else "", "center={}", ("none", "k", "v", "kv")),
    Option(r"kweights=none", _TQ, _flag("key_weights", False), lambda s: "" if s.key_weights else "+kweights=none",
           "kweights=none"),
    Option(r"kscale=(\w+)", _TQ, lambda m, name, st: {"key_scale": m.group(1)},
           lambda s: f"+kscale={s.key_scale}" if s.key_scale != "renorm" else "", "kscale={}", SCALE_MODES),
    Option(r"vscale=(\w+)", _TQ, lambda m, name, st: {"value_scale": m.group(1)},
           lambda s: f"+vscale={s.value_scale}" if s.value_scale != "renorm" else "", "vscale={}", SCALE_MODES),
    Option(r"bf16norms", _TQ, _flag("norm_dtype", "bfloat16"), lambda s: "+bf16norms" if s.norm_dtype == "bfloat16" else "",
           "bf16norms"),
    Option(r"seed(\d+)", _TQ, _number("seed"), lambda s: f"+seed{s.seed}" if s.seed else "", "seed{}", (0, 1, 7)),
]
#: the spec fields the options set (the base's widths and the storage apart)
_OPTION_FIELDS = [f for f in fields(CacheSpec) if f.name not in ("base", "storage", "key_bits", "value_bits", "full",
                                                                  "spelled")]
_UNKNOWN_OPTION = {
    "int": "unknown option {option!r} in cache {name!r}; integer caches take +gN, +recentN, +fp-first-last",
    "tq": ("unknown option {option!r} in cache {name!r}; TurboQuant caches take +qjl, +recentN, +fp-first-last, "
           "+center=C, +kweights=none, +prerope, +ropemean, +rot=R, +vq, +norms8, +alloc[N][=recipe], +halloc[N][=recipe], "
           "+outliersN, +kscale=M, +vscale=M, +bf16norms, +seedN"),
}


def _keeps_full(s: CacheSpec, block_size) -> bool:
    """Full-precision tokens or layers the pool's blocks do not hold (TurboQuant's +sinkN lives in sink rows)."""
    return bool(s.full.recent or s.full.first_last or s.full.layer_list or (s.full.sink and s.base == "int"))


#: What each path refuses: (path, refused(spec, block size), the one-line reason). Every path checks a name here
#: (hf.py, serve/formats.py, model/fused_codes.py, plan/engines/kvlab.py); a path not listed for a format runs it.
REFUSALS: list[tuple[str, Callable[[CacheSpec, int | None], bool], str]] = [
    ("transformers", lambda s, bs: s.base == "none",
     "cache 'none' keeps nothing between forward passes; a transformers cache must (use dense, int8, tq4, ...)"),
    ("transformers", lambda s, bs: s.base == "dense" and bool(s.storage),
     "cache {name}: transformers reads K/V in the model's dtype; use dense (or the model's dtype)"),
    ("transformers", lambda s, bs: s.pre_rope or s.rope_mean,
     "cache {name}: +prerope and +ropemean turn keys by their positions, but transformers hands a cache keys after RoPE "
     "without them; use it in kvlab's own engine, or drop the option"),
    ("transformers", lambda s, bs: bool(s.alloc) and not s.key_alloc,
     "cache {name} has no recipe: kvlab's engine calibrates +alloc/+halloc for its model; in transformers spell the "
     "recipe out (+alloc=k<digits>v<digits>, as `kvlab eval` prints it)"),
    ("pool", lambda s, bs: s.base in ("concat", "none"), "unknown block format {name}; choose one of: {choices}"),
    ("pool", lambda s, bs: _keeps_full(s, bs) and s.base == "int",
     "block format {name} keeps full-precision tokens or layers ({kept}), which blocks do not hold; use a plain name "
     "like {plain}"),
    ("pool", lambda s, bs: _keeps_full(s, bs) and s.base == "tq",
     "block format {name} keeps full-precision tokens or layers ({kept}), which blocks do not hold; use a plain name "
     "like {plain} (TurboQuant blocks hold +sinkN)"),
    ("pool", lambda s, bs: bs is not None and s.full.sink > bs,
     "block format {name}: a sink of {sink} tokens is more than a block of {block_size}"),
    ("pool", lambda s, bs: bs is not None and s.base == "int" and bool(bs % s.pool_group(bs)),
     "block format {name}: the key group of {group} tokens must divide the block size of {block_size} (use "
     "+g{block_size} or a block size that is a multiple)"),
    ("layered-pool", lambda s, bs: s.base == "tq" and (s.pre_rope or s.rope_mean or bool(s.full.sink) or bool(s.alloc)),
     "block format {name}: the serving pool of a model whose layers differ in kind (Gemma 3, Qwen3.5, Qwen3-Next) "
     "holds TurboQuant blocks without +prerope, +sinkN or +alloc/+halloc, and without +ropemean (one codec over every "
     "layer group: its layers differ in RoPE, and sink rows and recipes are per pool layer); use tq-k4v4, tq-k3v3, int8 or dense (the "
     "torch path runs {name} on these models: kvlab generate)"),
    ("fused", lambda s, bs: s.base in ("concat", "none"),
     "cache {name}: the fused decode step writes preallocated caches (the modules run it)"),
]
