"""The budget: weights + KV + recurrent state + overheads against a GPU, and the solvers.

`make_plan` answers: does it fit; the longest context that fits; the most sequences at the asked
context. With --tp N every figure is per GPU (vLLM splits KV heads; llama.cpp splits layers).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from ..spec import ModelSpec
from .components import Component
from .engines import Engine
from .gpus import GPU
from .layout import KVLayout
from .settings import PlanSettings
from .vision import Projector
from .weights import WeightsEstimate

MAX_SEARCH_CONTEXT = 1 << 24


@dataclass(frozen=True)
class Plan:
    spec: ModelSpec
    engine: Engine
    settings: PlanSettings
    layout: KVLayout
    weights: WeightsEstimate
    components: tuple[Component, ...]
    gpu: GPU | None = None
    budget_bytes: int | None = None
    max_context: int | None = None
    max_sequences: int | None = None
    alias_of: str | None = None   # the name asked for, when the catalog planned another model under it
    model_ref: str | None = None  # the model as the user named it (for the launch line)
    weights_quant: str | None = None   # --weights-quant as asked (None: as the source stores them)
    gguf_repo: str | None = None  # a Hub GGUF repo the plan stands for (llama-server -hf REPO:QUANT)
    offload: object | None = None  # llama.cpp's split between GPU and host (offload.Offload), None: all on the GPU
    mmproj: Projector | None = None  # a vision projector (--mmproj), None: text only
    extras: tuple[Component, ...] = ()   # fixed lines beside the model (the projector and its image buffer)
    headroom_bytes: int = 0       # kept free by the solvers (--ctx max, the longest context, most sequences)
    hints: tuple[str, ...] = ()   # what to change when it does not fit (a quant that would)

    @property
    def context_cap(self) -> int:
        """The longest context the solver may answer: the model's own maximum (or the search bound)."""
        return self.spec.context_length or MAX_SEARCH_CONTEXT

    @property
    def context_limited_by_model(self) -> bool:
        """The longest context stopped at the model's maximum, not at the memory."""
        return bool(self.max_context) and self.max_context >= self.context_cap and bool(self.spec.context_length)

    @property
    def alias_note(self) -> str | None:
        """One line saying which model was planned when the name asked for was a catalog alias."""
        if not self.alias_of:
            return None
        return (f"note: {self.alias_of} is not in the catalog under its own name; planned {self.spec.name}, "
                f"its catalog alias (same architecture)")

    @property
    def per_gpu(self) -> bool:
        return self.settings.tp > 1

    @property
    def total_bytes(self) -> int:
        return sum(c.bytes for c in self.components)

    @property
    def fits(self) -> bool | None:
        return None if self.budget_bytes is None else self.total_bytes <= self.budget_bytes

    def component(self, name: str) -> Component | None:
        return next((c for c in self.components if c.name == name), None)


def _split(nbytes: int, tp: int) -> int:
    return -(-nbytes // tp)


def _cache_formulas(spec: ModelSpec, layout: KVLayout, part: str) -> str:
    """'8 full × 4096 cells × 1088 B' per group of identical layers, for K or V."""
    terms = []
    for kind, count, rep in layout.groups():
        layer = spec.layers[rep.index]
        if part == "k" and rep.k_bytes:
            elems = layer.k_elements_per_token
            what = f"({layer.kv_lora_rank}+{layer.rope_dim})" if kind == "mla" else f"{layer.n_kv_heads}×{layer.head_dim_k}"
            size = f"{rep.cells:,} cells × {rep.k_row} B" if rep.k_row else f"{rep.k_bytes:,} B"
            terms.append(f"{count} {kind} × {size} [{what}={elems} {layout.kv_type_k}]")
        if part == "v" and rep.v_bytes:
            what = f"{layer.n_kv_heads}×{layer.head_dim_v}"
            size = f"{rep.cells:,} cells × {rep.v_row} B" if rep.v_row else f"{rep.v_bytes:,} B"
            terms.append(f"{count} {kind} × {size} [{what} {layout.kv_type_v}]")
        if part == "r" and rep.state_bytes:
            terms.append(f"{count} × {layer.state_elements:,} values × {rep.state_bytes // layer.state_elements:,} B")
    return " + ".join(terms) or "0"


def plan_components(spec: ModelSpec, engine: Engine, settings: PlanSettings, weights: WeightsEstimate,
                    extras: tuple[Component, ...] = ()) -> tuple[KVLayout, tuple[Component, ...]]:
    """The budget's lines; `extras` are fixed lines beside the model (a vision projector and its image buffer)."""
    layout = engine.layout(spec, settings)
    tp = settings.tp
    kv_split = 1 if engine.name == "vllm" else tp   # vLLM's layout is already per GPU
    tail = f" / {tp} GPUs" if tp > 1 else ""
    parts = [
        Component("weights", weights.formula + tail, _split(weights.bytes, tp), weights.exact, tp > 1),
        Component("K cache", _cache_formulas(spec, layout, "k") + (tail if kv_split > 1 else ""), _split(layout.k_bytes, kv_split)),
        Component("V cache", _cache_formulas(spec, layout, "v") + (tail if kv_split > 1 else ""), _split(layout.v_bytes, kv_split)),
    ]
    if layout.recurrent_bytes:
        parts.append(Component("recurrent state", _cache_formulas(spec, layout, "r") + (tail if kv_split > 1 else ""),
                               _split(layout.recurrent_bytes, kv_split)))
    parts.extend(extras)
    parts.extend(engine.overheads(spec, settings, layout))
    return layout, tuple(parts)


def _largest(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """Largest n in [lo, hi] with fits(n), assuming fits is monotone (lo-1 if none)."""
    if not fits(lo):
        return lo - 1
    if fits(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def make_plan(spec: ModelSpec, engine: Engine, settings: PlanSettings, weights_quant: str | None = None,
              gpu: GPU | None = None, solve: bool = True, weights: WeightsEstimate | None = None,
              extras: tuple[Component, ...] = (), headroom: int = 0) -> Plan:
    """Plan one configuration; with a GPU also solve for the longest context and most sequences, keeping
    `headroom` bytes free (the verdict at the asked settings compares against the whole budget).

    `weights`: a stated size (--weights-bytes / --weights-file) instead of the engine's own estimate."""
    weights = weights or engine.weights(spec, weights_quant)
    layout, components = plan_components(spec, engine, settings, weights, extras)
    budget = engine.budget_bytes(gpu.vram_bytes, gpu.usable_bytes, settings) if gpu and weights.known else None
    max_context = max_sequences = None
    if budget is not None and solve:
        def total(ctx: int, seqs: int) -> int:
            return sum(c.bytes for c in plan_components(spec, engine, replace(settings, context=ctx, parallel=seqs,
                                                                              n_ctx_total=None), weights, extras)[1])
        cap = spec.context_length or MAX_SEARCH_CONTEXT
        room = budget - headroom
        max_context = max(0, _largest(lambda c: total(c, settings.parallel) <= room, 1, cap))
        max_sequences = max(0, _largest(lambda p: total(settings.context, p) <= room, 1, engine.max_parallel))
    return Plan(spec, engine, settings, layout, weights, components, gpu, budget, max_context, max_sequences,
                extras=extras, headroom_bytes=headroom)


def kv_bytes_at(spec: ModelSpec, engine: Engine, settings: PlanSettings, contexts: list[int]) -> list[int]:
    """KV + recurrent bytes at each context (for plots)."""
    return [engine.layout(spec, replace(settings, context=c)).total_bytes for c in contexts]


__all__ = ["Plan", "make_plan", "plan_components", "kv_bytes_at"]
