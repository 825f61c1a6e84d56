"""kvlab's own caches: exactly the bytes their format's formula (CacheSpec.bytes) says they hold.

--kv-type names a cache of the kvlab registry (dense, concat, and the compressed caches: int8, int4, tq4, ...),
optionally with its element dtype: `dense@f16`. A bare f32 / f16 / bf16 means the dense cache in that dtype
(CacheSpec.parse_with_dtype). Layers with the same geometry share one formula call. No torch is imported here.

A model whose layers differ in kind (Gemma 3, Qwen3.5, Qwen3-Next) runs on model/layer_caches.LayeredCache: its
dense sliding layers keep min(context, window - 1 + WINDOW_BLOCK) rows, and each recurrent layer a fixed fp32 state
of state_elements values per sequence, whatever the cache and the run's dtype.
"""

from __future__ import annotations

from dataclasses import replace

from ...cache import CacheGeometry, CacheSpec
from ...cache.capacity import CapacityPlan, LayerGroups
from ...cache.geometry import WINDOW_BLOCK
from ...cache.format import DTYPES
from ...errors import ConfigError
from ...spec import ModelSpec
from ..components import Component
from ..layout import KVLayout, LayerBytes
from ..settings import PlanSettings
from ..weights import WeightsEstimate
from .base import RuleSet


class KvlabRules(RuleSet):
    name = "kvlab"
    version = "kvlab (this package)"

    def layout(self, spec: ModelSpec, settings: PlanSettings) -> KVLayout:
        if settings.kv_type_k and settings.kv_type_v and settings.kv_type_v != settings.kv_type_k:
            raise ConfigError("kvlab caches hold K and V in one cache: give --kv-type, not separate K and V types")
        cache, dtype = CacheSpec.parse_with_dtype(settings.kv_type_k or settings.kv_type_v)  # one alone names the cache
        cache.check("torch")
        groups: dict[tuple, list[int]] = {}
        layered = len({layer.kind for layer in spec.layers}) > 1       # LayeredCache: a cache per layer kind
        rows: dict[int, LayerBytes] = {}
        for i, layer in enumerate(spec.layers):
            if layer.kind == "mla":
                raise ConfigError(f"kvlab's caches hold full and sliding-window attention and recurrent state; layer {i} is mla")
            if layer.kind == "recurrent":
                rows[i] = LayerBytes(i, "recurrent", state_bytes=layer.state_elements * 4 * settings.parallel)   # fp32
            if layer.kind in ("none", "recurrent"):
                continue
            groups.setdefault((layer.n_kv_heads, layer.head_dim_k, layer.head_dim_v, layer.window, layer.n_heads), []).append(i)
        total = per_token = 0
        for (kv_heads, dim_k, dim_v, window, heads), indices in groups.items():
            held = settings.context
            if layered and window and cache.base == "dense":           # SlidingWindowCache: the window and a block
                held = min(settings.context, window - 1 + WINDOW_BLOCK)
            geometry = CacheGeometry(n_layers=len(indices), n_kv_heads=kv_heads, head_dim=dim_k, batch=settings.parallel,
                                     capacity=held, n_heads=heads, head_dim_v=dim_v, window=window)
            nbytes = cache.bytes(geometry, held, dtype)
            total += nbytes
            per_token += cache.token_bytes(geometry, dtype)          # what one more token of one sequence adds
            per_layer = nbytes // len(indices)
            k_share = per_layer * dim_k // (dim_k + dim_v)
            for i in indices:
                rows[i] = LayerBytes(i, spec.layers[i].kind, settings.context * settings.parallel,
                                     k_total=k_share, v_total=per_layer - k_share)
        per_token = round(per_token)
        layers = tuple(rows.get(i, LayerBytes(i, layer.kind)) for i, layer in enumerate(spec.layers))
        label = cache.with_dtype(dtype)
        notes = ("K/V split by head dims (kvlab caches report them together)",) if cache.base != "dense" else ()
        layout = KVLayout(self.name, layers, per_token, label, label, notes)
        remainder = total - layout.kv_bytes   # integer division across layers: give the rest to the first layer
        if remainder and groups:
            first = min(i for indices in groups.values() for i in indices)
            rows[first] = replace(rows[first], v_total=rows[first].v_total + remainder)
            layout = KVLayout(self.name, tuple(rows.get(i, LayerBytes(i, layer.kind)) for i, layer in enumerate(spec.layers)),
                              per_token, label, label, notes)
        return layout

    def weights(self, spec: ModelSpec, quant: str | None) -> WeightsEstimate:
        """What kvlab holds. A GGUF file with no --weights-quant: its native weights (`--weights auto`, fp32 on
        CPU), i.e. the block bytes of the Q4_0/Q4_1/Q8_0 matrices kept as blocks + fp32 for every other
        tensor — if the block kernel is expected here (kernels.kernel_expected: loaded, built, or a compiler
        to build it; the planner never compiles), the test `auto` makes. Otherwise every tensor dequantized
        into the compute dtype: parameters × 4 (fp32) or × 2."""
        from ...kernels import kernel_expected

        held = spec.extra.get("native_weight_bytes")   # read with the file's tensor table (sources/native.py)
        if quant is None and spec.extra.get("dtype") == "gguf" and held is not None and kernel_expected():
            return WeightsEstimate(held, "GGUF blocks of the Q4_0/Q4_1/Q8_0 matrices + fp32 for the rest (native weights)", True)
        key = (quant or "f32").strip().lower()
        if key not in DTYPES:
            raise ConfigError(f"--engine kvlab holds weights in f32, bf16 or f16, not {quant!r}")
        if not spec.n_params:
            raise ConfigError(f"{spec.name}: parameter count unknown, so kvlab's weight bytes cannot be computed")
        size = 4 if DTYPES[key] == "float32" else 2
        return WeightsEstimate(spec.n_params * size, f"{spec.n_params:,} params × {size} B ({key}, dequantized)", True)

    def overheads(self, spec: ModelSpec, settings: PlanSettings, layout: KVLayout) -> list[Component]:
        n_ub = settings.ubatch or settings.context
        logits = spec.vocab_size * settings.parallel * n_ub * 4
        return [Component("activations", f"logits {spec.vocab_size}×{settings.parallel}×{n_ub}×4 (prefill)", logits, exact=False)]


def engine_admission(spec: ModelSpec, settings: PlanSettings, kv_budget: str, max_batch: int = 16,
                     step_tokens: int = 512) -> dict:
    """How many sequences of `settings.context` tokens the serving engine (kvlab.serve) admits in a KV budget:
    the engine's own CapacityPlan (cache/capacity.py: blocks sized by the format's formula, a block table per layer
    group, sliding groups capped at their window, recurrent state slots), so the planner and the engine agree.
    Dense and compressed block formats (int4, tq4, ...; for models whose layers differ in kind, TurboQuant without
    +prerope, +sinkN or +alloc); per-sequence state is sized for the engine's defaults (max_batch 16, 512 tokens a step)."""
    cache, dtype = CacheSpec.parse_with_dtype(settings.kv_type_k)
    if cache.base == "dense":   # dense-f16 / dense-bf16 keep their storage dtype whatever the run's; dense@f16 is dense-f16
        block_format = cache.name if cache.storage else {"float32": "dense", "float16": "dense-f16",
                                                         "bfloat16": "dense-bf16"}[dtype]
    elif dtype == "float32":                          # a compressed block format: int4, tq4, ... (serve/formats.py)
        block_format = cache.label
    else:
        raise ConfigError(f"--kv-budget: compressed blocks keep their full-precision state in f32, not {settings.kv_type_k!r}")
    kinds = [layer.kind for layer in spec.layers]
    if "mla" in kinds or "none" in kinds:
        raise ConfigError(f"--kv-budget: the serving engine runs full, sliding and recurrent layers; {spec.name} has "
                          f"{'mla' if 'mla' in kinds else 'none'} layers")
    if len(set(kinds)) > 1:
        CacheSpec.parse(block_format, "pool").check("layered-pool")
    layers = [layer for layer in spec.layers if layer.kind in ("full", "sliding")]
    shapes = {(layer.n_kv_heads, layer.head_dim_k, layer.head_dim_v, layer.n_heads) for layer in layers}
    windows = {layer.window for layer in layers if layer.kind == "sliding"}
    if len(shapes) != 1 or len(windows) > 1:
        raise ConfigError(f"--kv-budget: the serving engine runs models whose attention layers share one shape and "
                          f"window; {spec.name} does not")
    (kv_heads, dim_k, dim_v, heads), = shapes
    groups = LayerGroups.build(kinds, windows.pop() if windows else None)
    geometry = CacheGeometry(n_layers=groups.size, n_kv_heads=kv_heads, head_dim=dim_k, head_dim_v=dim_v, n_heads=heads)
    state = sum(layer.state_elements for layer in spec.layers if layer.kind == "recurrent") * 4   # fp32, per sequence
    plan = CapacityPlan.build(geometry, block_format, kv_budget, settings.block_size, max_batch, groups, state, step_tokens)
    return {"format": plan.format, "budget_bytes": plan.budget, "block_size": plan.block_size, "block_bytes": plan.block_bytes,
            "blocks": plan.n_blocks, "layer_groups": len(groups.members), "layers_per_block": groups.size,
            "sliding_window_freed": groups.freeing, "state_bytes_per_sequence": state, "pool_bytes": plan.pool_bytes,
            "context": settings.context, "blocks_per_sequence": plan.blocks_for(settings.context),
            "max_concurrent": plan.max_concurrent(settings.context)}
