"""From per-model facts to per-layer LayerSpecs: the one place both GGUF and config.json meet.

A source (GGUF metadata, HF config.json, catalog entry) reduces its keys to a `LayerFacts`:
how many layers, which kind each layer is, per-layer head counts, head dims, the window, the
MLA latent and the recurrent state. `build_layers` turns that into LayerSpecs, validating as it goes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import math

from ..errors import ConfigError
from ..spec import MAX_LAYERS, LayerSpec


@dataclass
class LayerFacts:
    """Everything a source knows about the layers, before validation."""

    n_layers: int
    kinds: list[str]                       # per layer: full | sliding | mla | recurrent | none
    n_heads: list[int]
    n_kv_heads: list[int]
    head_dim_k: int
    head_dim_v: int
    window: int | None = None
    head_dim_k_swa: int | None = None      # sliding layers may use other head dims (Gemma 4)
    head_dim_v_swa: int | None = None
    kv_lora_rank: int = 0
    rope_dim: int = 0
    state_elements: int = 0
    notes: list[str] = field(default_factory=list)


#: Architectures (GGUF names) whose llama.cpp loader fixes the sliding window whatever the file says, unless it says
#: 0 (no window): Llama 4's chunked attention is 8,192 tokens (models/llama4.cpp; a 0 marks MobileLLM, all full).
FIXED_WINDOWS = {"llama4": 8192}

def short(value, limit: int = 60) -> str:
    """repr(value) cut to `limit` characters (error messages stay one short line whatever the file holds)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def as_int(value, what: str, minimum: int = 0) -> int:
    """An integer count from a file: ints and integral floats; anything else (9.5, a string, a list, a bool)
    or a value below `minimum` is a ConfigError naming `what`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not (math.isfinite(value) and value.is_integer())):
        raise ConfigError(f"{what} must be an integer, got {short(value)}")
    if value < minimum:
        bound = "positive" if minimum == 1 else "non-negative" if minimum == 0 else f"at least {minimum}"
        raise ConfigError(f"{what} must be {bound}, got {short(value)}")
    return int(value)


def as_float(value, what: str, positive: bool = True) -> float:
    """A finite number from a file (a positive one when `positive`), else a ConfigError naming `what`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (positive and value <= 0):
        raise ConfigError(f"{what} must be a finite {'positive ' if positive else ''}number, got {short(value)}")
    return float(value)


def check_number_keys(values: dict, int_keys: dict[str, bool], float_keys, source: str, prefix: str = "") -> None:
    """Every number key present holds a number: as_int for `int_keys` (each maps to whether a per-layer list
    is allowed), as_float for `float_keys`; keys are looked up as prefix + key. One line naming the key otherwise."""
    for suffix, listable in int_keys.items():
        key = prefix + suffix
        value = values.get(key)
        if value is None:
            continue
        for item in (value if isinstance(value, list) and listable else [value]):
            as_int(item, f"{source}: {key}")
    for suffix in float_keys:
        key = prefix + suffix
        if values.get(key) is not None:
            as_float(values[key], f"{source}: {key}")


def layer_count(value, what: str) -> int:
    """The number of layers: a positive integer no larger than MAX_LAYERS (checked before any per-layer list)."""
    n = as_int(value, what, minimum=1)
    if n > MAX_LAYERS:
        raise ConfigError(f"{what}={n:,} is more layers than any model has (at most {MAX_LAYERS:,})")
    return n


def per_layer(value, n_layers: int, what: str) -> list[int]:
    """A scalar repeated for every layer, or a per-layer list checked for length; non-negative integers."""
    if isinstance(value, (list, tuple)):
        if len(value) != n_layers:
            raise ConfigError(f"{what} lists {len(value)} values for {n_layers} layers")
        return [as_int(v, what) for v in value]
    return [as_int(value, what)] * n_layers


def per_layer_flags(value, n_layers: int, what: str) -> list[bool]:
    """A per-layer list of flags (bools or 0/1 integers), checked for length and kind."""
    if not isinstance(value, (list, tuple)) or len(value) != n_layers:
        raise ConfigError(f"{what} must list one flag for each of the {n_layers} layers, got {short(value)}")
    if not all(isinstance(v, (bool, int)) for v in value):
        raise ConfigError(f"{what} must hold booleans, got {short(value)}")
    return [bool(v) for v in value]


def pattern_kinds(n_layers: int, period: int, dense_first: bool = False) -> list[str]:
    """Sliding-window pattern of period n: n-1 sliding layers then one full (or full first)."""
    if period <= 0:
        return ["sliding"] * n_layers
    if dense_first:
        return ["full" if i % period == 0 else "sliding" for i in range(n_layers)]
    return ["full" if i % period == period - 1 else "sliding" for i in range(n_layers)]


def interval_kinds(n_layers: int, interval: int, other: str = "recurrent") -> list[str]:
    """Every `interval`-th layer is full attention, the others `other` (Qwen3-Next: 3 linear + 1 full)."""
    if interval <= 0:
        raise ConfigError(f"full_attention_interval must be positive, got {interval}")
    return ["full" if (i + 1) % interval == 0 else other for i in range(n_layers)]


def ssm_state_elements(conv_kernel: int, d_inner: int, d_state: int, n_groups: int) -> int:
    """Values of recurrent state per layer and sequence (conv window + SSM/delta state).

    conv: (kernel - 1) × (d_inner + 2 × n_groups × d_state)   (the first column is shifted out)
    ssm:  d_state × d_inner
    Mamba-1 has n_groups = 0; gated DeltaNet has n_groups = key heads, d_state = key head dim.
    """
    conv = max(conv_kernel - 1, 0) * (d_inner + 2 * n_groups * d_state)
    return conv + d_state * d_inner


def build_layers(facts: LayerFacts, source: str) -> tuple[LayerSpec, ...]:
    """Validate facts and build one LayerSpec per layer; errors name the source."""
    f = facts
    if f.n_layers <= 0:
        raise ConfigError(f"{source}: number of layers must be positive, got {f.n_layers}")
    for what, values in (("layer kinds", f.kinds), ("head counts", f.n_heads), ("KV head counts", f.n_kv_heads)):
        if len(values) != f.n_layers:
            raise ConfigError(f"{source}: {len(values)} {what} for {f.n_layers} layers")
    layers = []
    for i, kind in enumerate(f.kinds):
        sliding = kind == "sliding"
        dim_k = f.head_dim_k_swa if sliding and f.head_dim_k_swa else f.head_dim_k
        dim_v = f.head_dim_v_swa if sliding and f.head_dim_v_swa else f.head_dim_v
        try:
            layers.append(LayerSpec(
                kind=kind,
                n_heads=f.n_heads[i],
                n_kv_heads=f.n_kv_heads[i] if kind != "recurrent" else 0,
                head_dim_k=dim_k,
                head_dim_v=dim_v,
                window=f.window if sliding else None,
                kv_lora_rank=f.kv_lora_rank if kind == "mla" else 0,
                rope_dim=f.rope_dim if kind == "mla" else 0,
                state_elements=f.state_elements if kind == "recurrent" else 0,
            ))
        except ConfigError as exc:
            raise ConfigError(f"{source}: layer {i}: {exc}") from None
    if not any(layer.kind != "none" for layer in layers):
        raise ConfigError(f"{source}: no layer keeps any cache or state; is this a decoder-only LLM?")
    if any(layer.kind == "recurrent" for layer in layers) and f.state_elements <= 0:
        raise ConfigError(f"{source}: recurrent layers but no state size (ssm/linear-attention keys missing)")
    return tuple(layers)


def kinds_summary(kinds: Sequence[str]) -> str:
    """'8 full + 24 recurrent' style summary."""
    counts: dict[str, int] = {}
    for kind in kinds:
        counts[kind] = counts.get(kind, 0) + 1
    return " + ".join(f"{n} {kind}" for kind, n in counts.items())


def layer_pattern(layers: Sequence) -> str:
    """The layer kinds as their shortest repeating pattern: '8 × (3 recurrent + 1 full)', '4 × (5 sliding (window 512)
    + 1 full) + 2 sliding (window 512)', or '30 full'. `layers`: LayerSpecs."""
    names = [f"{layer.kind} (window {layer.window:,})" if layer.kind == "sliding" else layer.kind for layer in layers]
    n = len(names)
    if len(set(names)) <= 1:
        return kinds_summary(names)
    for period in range(2, n // 2 + 1):
        repeats, rest = divmod(n, period)
        if names == (names[:period] * (repeats + 1))[:n]:
            text = f"{repeats} × ({kinds_summary(names[:period])})"
            return text + (f" + {kinds_summary(names[:rest])}" if rest else "")
    return kinds_summary(names)
