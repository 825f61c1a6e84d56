"""The names of the compressed caches: a name always tells the bytes it costs.

    name    := base ("+" option)*
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
                                        group (default 32)
             | "center=" C              (tq) which of K/V get a per-layer offset: none, k (default),
                                        v, kv — 1 float8 per channel per layer and KV head each
             | "kweights=none"          (tq) no query-aware key channel weights (default: on, 4 bits
                                        per channel per layer and KV head)
             | "prerope"                (tq) keys coded before RoPE, RoPE applied when reading
                                        (KVQuant; + the d/2 float32 RoPE frequencies per cache)
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

A plain name (int4, tq3, tq-k4v4) keeps nothing in full precision. Examples: int8, int4+g64, int4+recent128,
tq4, tq3.5, tq2.5, tq-k4v3, tq-k4v4+qjl, tq3+recent64, tq3+fp-first-last.

Presets. `tq4` is kvlab's recommended 4-bit recipe, not the bare method: the name stands for PRESETS["tq4"],
    tq4.125+prerope+norms8+sink1+kscale=lsq+vscale=lsq
keys coded before RoPE, the first token kept in the cache dtype, 8-bit log scales whose freed byte per vector buys 1/8
bit more codes (an eighth of the channels at 5 bits), least-squares scales: no calibration pass, and the serving pool
holds it (6,184 B/token on SmolLM2 at 511 tokens where the bare method is 6,149; +1.11% perplexity over six rotation
seeds, +1.50% served; docs/benchmarks.md, issue 13). Options after it apply to the expansion (`tq4+seed1`,
`tq4+halloc`, `tq4+kscale=renorm`), and every report spells the expansion out (a config's `name`). The bare method at
4 bits is `tq-k4v4` (what `tq4` meant before session 14), and that is how its name prints.
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch

from ..errors import ConfigError

EXAMPLES = ["int8", "int4", "int4+g64", "int4+recent128", "tq4", "tq-k5v3", "tq3.5", "tq3", "tq2.5", "tq2", "tq-k4v3",
            "tq-k4v4+qjl", "tq3+recent64", "tq3+fp-first-last"]

#: names that stand for a recipe (see the module docstring): the head of a name, expanded before it is read
PRESETS = {"tq4": "tq4.125+prerope+norms8+sink1+kscale=lsq+vscale=lsq"}

_WIDTH = r"(\d+(?:\.\d+)?)"
_BASES = [
    (re.compile(r"int(\d+)"), "int"),
    (re.compile(rf"tq-k{_WIDTH}v{_WIDTH}"), "tq-kv"),
    (re.compile(rf"tq{_WIDTH}"), "tq"),
]


def is_compressed_name(name: str) -> bool:
    head = name.strip().lower().split("+", 1)[0]
    return any(pattern.fullmatch(head) for pattern, _ in _BASES)


def expand(name: str) -> str:
    """'tq4+seed1' -> the preset's recipe + '+seed1'; a name whose head is no preset comes back lower-cased."""
    head, sep, rest = name.strip().lower().partition("+")
    return PRESETS[head] + sep + rest if head in PRESETS else head + sep + rest


def parse(name: str) -> tuple[type, object]:
    """'tq3+recent64' -> (TurboQuantCache, TurboQuantConfig(...)); ConfigError for anything else."""
    from .allocation import parse_recipe                  # the formats load here, on the first compressed name
    from .quantized import QuantizedCache, QuantizedConfig
    from .turboquant import TurboQuantCache, TurboQuantConfig

    key = expand(name)
    head, *options = key.split("+")
    for pattern, kind in _BASES:
        match = pattern.fullmatch(head)
        if match:
            break
    else:
        raise ConfigError(f"unknown cache {name!r}; compressed caches are named like {', '.join(EXAMPLES)}")
    full, extra = _full_precision(name, options)
    if kind == "int":
        bits = int(match.group(1))
        config = QuantizedConfig(bits=bits)
        for option in extra:
            if m := re.fullmatch(r"g(\d+)", option):
                config = replace(config, group_size=int(m.group(1)))
            else:
                raise ConfigError(f"unknown option {option!r} in cache {name!r}; integer caches take +gN, +recentN, +fp-first-last")
        return QuantizedCache, replace(config, full=full)
    kb = float(match.group(1))
    vb = float(match.group(2)) if kind == "tq-kv" else kb
    settings: dict = {"key_bits": kb, "value_bits": vb, "full": full}
    for option in extra:
        if option == "qjl":
            settings["qjl"] = True
        elif option == "bf16norms":
            settings["norm_dtype"] = torch.bfloat16
        elif m := re.fullmatch(r"([kv])scale=(\w+)", option):
            settings["key_scale" if m.group(1) == "k" else "value_scale"] = m.group(2)
        elif m := re.fullmatch(r"center=(none|k|v|kv)", option):
            settings["center"] = "" if m.group(1) == "none" else m.group(1)
        elif option == "kweights=none":
            settings["key_weights"] = False
        elif option == "prerope":
            settings["pre_rope"] = True
        elif option == "vq":
            settings["vector"] = True
        elif option == "norms8":
            settings["log_norms"] = True
        elif m := re.fullmatch(r"rot=(hadamard|haar)", option):
            settings["rotation"] = m.group(1)
        elif m := re.fullmatch(r"outliers(\d+)", option):
            settings["outliers"] = int(m.group(1))
            if not settings["outliers"]:
                raise ConfigError(f"+outliers0 in cache {name!r} keeps no key entry; use +outliersN with N ≥ 1, or leave it out")
        elif m := re.fullmatch(r"seed(\d+)", option):
            settings["seed"] = int(m.group(1))
        elif m := re.fullmatch(r"(h?)alloc(\d?)(=.*)?", option):
            if settings.get("alloc"):
                raise ConfigError(f"cache {name!r} asks for two bit allocations; use one +alloc or +halloc")
            heads = bool(m.group(1))
            settings["alloc"], settings["alloc_heads"] = int(m.group(2) or 1), heads
            if m.group(3):
                settings["key_alloc"], settings["value_alloc"] = parse_recipe(m.group(3)[1:], name,
                                                                              "+halloc" if heads else "+alloc")
        else:
            raise ConfigError(
                f"unknown option {option!r} in cache {name!r}; TurboQuant caches take +qjl, +recentN, +fp-first-last, "
                "+center=C, +kweights=none, +prerope, +rot=R, +vq, +norms8, +alloc[N][=recipe], +halloc[N][=recipe], +outliersN, +kscale=M, "
                "+vscale=M, +bf16norms, +seedN"
            )
    return TurboQuantCache, TurboQuantConfig(**settings)


def _full_precision(name: str, options: list[str]) -> tuple[FullPrecision, list[str]]:
    """Take the +recentN / +sinkN / +fp-first-last / +fp-layers options out of `options`."""
    from .compressed import FullPrecision

    recent, sink, first_last, listed, rest = 0, 0, False, (), []
    for option in options:
        if m := re.fullmatch(r"recent(\d+)", option):
            recent = int(m.group(1))
        elif m := re.fullmatch(r"sink(\d+)", option):
            sink = int(m.group(1))
        elif option == "fp-first-last":
            first_last = True
        elif m := re.fullmatch(r"fp-layers=(\d+(?:\.\d+)*)", option):
            listed = tuple(sorted({int(i) for i in m.group(1).split(".")}))
        elif option:
            rest.append(option)
        else:
            raise ConfigError(f"empty option in cache name {name!r}")
    return FullPrecision(recent=recent, sink=sink, first_last=first_last, layer_list=listed), rest
