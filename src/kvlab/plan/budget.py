"""The budget: weights + KV + recurrent state + overheads against a GPU, and the solvers.

`make_plan` answers: does it fit; the longest context that fits; the most sequences at the asked
context. With --tp N every figure is per GPU (vLLM splits KV heads; llama.cpp splits layers).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from ..spec import ModelSpec
from .components import Component
from .rules import RuleSet
from .gpus import GPU
from .layout import KVLayout
from .offload import Offload, WeightSplit
from .settings import PlanSettings
from .vision import Projector
from .weights import WeightsEstimate

MAX_SEARCH_CONTEXT = 1 << 24


@dataclass(frozen=True)
class Placement:
    """An offload and the weight split it acts on."""

    offload: Offload
    split: WeightSplit


@dataclass(frozen=True)
class Plan:
    spec: ModelSpec
    engine: RuleSet
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
    offload: Offload | None = None  # llama.cpp's split between GPU and host, None: all on the GPU
    host: tuple[Component, ...] = ()   # what an offloaded plan keeps in host RAM
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
    def host_bytes(self) -> int:
        return sum(c.bytes for c in self.host)

    @property
    def fits(self) -> bool | None:
        if self.budget_bytes is None:
            return None
        ram = self.offload.ram_bytes if self.offload else None
        return self.total_bytes <= self.budget_bytes and (ram is None or self.host_bytes <= ram)

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


def plan_components(spec: ModelSpec, engine: RuleSet, settings: PlanSettings, weights: WeightsEstimate,
                    extras: tuple[Component, ...] = (), offload: Placement | None = None
                    ) -> tuple[KVLayout, tuple[Component, ...]]:
    """The GPU's budget lines; `extras` are fixed lines beside the model (a vision projector and its image buffer);
    `offload`: llama.cpp's placement, whose host side host_components() lists."""
    layout = engine.layout(spec, settings)
    if offload is not None:
        return layout, _offloaded(spec, engine, settings, weights, layout, extras, offload)[0]
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


def host_components(spec: ModelSpec, engine: RuleSet, settings: PlanSettings, weights: WeightsEstimate,
                    offload: Placement) -> tuple[Component, ...]:
    """What an offloaded llama.cpp plan keeps in host RAM."""
    return _offloaded(spec, engine, settings, weights, engine.layout(spec, settings), (), offload)[1]


def _offloaded(spec, engine, settings, weights, layout, extras, placement: Placement):
    """(GPU lines, host lines) of llama.cpp's placement: layers by -ngl, experts by --n-cpu-moe, the embedding on the host."""
    offload, split = placement.offload, placement.split
    n = spec.n_layers
    on_gpu = [offload.layer_on_gpu(i, n) for i in range(n)]
    moved = [split.experts[i] if i < offload.cpu_moe_layers else 0 for i in range(n)]
    moved_weights = sum(split.layers[i] - moved[i] for i in range(n) if on_gpu[i]) + (split.output if offload.output_on_gpu(n) else 0)
    scale = weights.bytes / split.total if split.total else 1.0   # a stated size spreads like the estimate
    moved_weights = int(moved_weights * scale)
    copy = int(split.embedding * scale) if split.tied and offload.output_on_gpu(n) else 0   # the tied output's own copy
    gpu_weights = moved_weights + copy
    host_weights = weights.bytes - moved_weights
    where = offload.describe(n)

    def part(attr: str, gpu: bool) -> int:
        return sum(getattr(row, attr) for row in layout.layers if on_gpu[row.index] == gpu)

    copy_text = " + a copy of the tied token_embd for the output layer" if copy else ""
    gpu = [Component("weights", f"{where} (token_embd stays on the host{copy_text}): {weights.formula}", gpu_weights,
                     weights.exact),
           Component("K cache", f"K of the layers on the GPU ({sum(on_gpu)} of {n})", part("k_bytes", True)),
           Component("V cache", f"V of the layers on the GPU ({sum(on_gpu)} of {n})", part("v_bytes", True))]
    if layout.recurrent_bytes:
        gpu.append(Component("recurrent state", f"state of the layers on the GPU ({sum(on_gpu)} of {n})", part("state_bytes", True)))
    gpu += [*extras, *engine.overheads(spec, settings, layout)]
    host = [Component("weights (host)", f"token_embd + what is not on the GPU ({where})", host_weights, weights.exact and split.exact)]
    kv_host = part("k_bytes", False) + part("v_bytes", False) + part("state_bytes", False)
    if kv_host:
        host.append(Component("KV + state (host)", f"caches of the {n - sum(on_gpu)} layers on the host", kv_host))
    if not all(on_gpu) or offload.cpu_moe_layers:
        compute = engine.compute_buffer(spec, settings, logits=not offload.output_on_gpu(n))
        host.append(Component("compute buffer (host)", f"the CPU's share of the graph (estimated like the GPU's): {compute.formula}",
                              compute.bytes, exact=False))
    return tuple(gpu), tuple(host)


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


def make_plan(spec: ModelSpec, engine: RuleSet, settings: PlanSettings, weights_quant: str | None = None,
              gpu: GPU | None = None, solve: bool = True, weights: WeightsEstimate | None = None,
              extras: tuple[Component, ...] = (), headroom: int = 0, placement: Placement | None = None) -> Plan:
    """Plan one configuration; with a GPU also solve for the longest context and most sequences, keeping
    `headroom` bytes free (the verdict at the asked settings compares against the whole budget).

    `weights`: a stated size (--weights-bytes / --weights-file) instead of the engine's own estimate."""
    weights = weights or engine.weights(spec, weights_quant)
    layout, components = plan_components(spec, engine, settings, weights, extras, placement)
    host = host_components(spec, engine, settings, weights, placement) if placement else ()
    ram = placement.offload.ram_bytes if placement else None
    budget = engine.budget_bytes(gpu.vram_bytes, gpu.usable_bytes, settings) if gpu and weights.known else None
    max_context = max_sequences = None
    if budget is not None and solve:
        def fits(ctx: int, seqs: int) -> bool:
            trial = replace(settings, context=ctx, parallel=seqs, n_ctx_total=None)
            on_gpu = sum(c.bytes for c in plan_components(spec, engine, trial, weights, extras, placement)[1])
            if on_gpu > room:
                return False
            return ram is None or sum(c.bytes for c in host_components(spec, engine, trial, weights, placement)) <= ram
        cap = spec.context_length or MAX_SEARCH_CONTEXT
        room = budget - headroom
        max_context = max(0, _largest(lambda c: fits(c, settings.parallel), 1, cap))
        max_sequences = max(0, _largest(lambda p: fits(settings.context, p), 1, engine.max_parallel))
    return Plan(spec, engine, settings, layout, weights, components, gpu, budget, max_context, max_sequences,
                extras=extras, headroom_bytes=headroom, offload=placement.offload if placement else None, host=host)


__all__ = ["Plan", "make_plan", "plan_components"]
