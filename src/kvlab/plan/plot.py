"""Memory against context for several KV types, with the GPU's usable line (matplotlib, Agg)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..errors import KvlabError
from ..fileio import PLOT_SUFFIXES, check_writable, save_figure
from .budget import Plan, plan_components

GiB = 1 << 30
PLOT_TYPES = {"llama.cpp": ("f16", "q8_0", "q4_0"), "vllm": ("bf16", "fp8"), "kvlab": ("dense@f32", "dense@f16")}


def plot_plan(plan: Plan, path: str | Path, points: int = 48) -> Path:
    from ..measure import (
        pyplot,  # matplotlib (and measure's torch) only when a plot is asked for
    )

    plt = pyplot()
    path = check_writable(path, "--plot", PLOT_SUFFIXES)
    top = max(plan.settings.context, plan.max_context or 0, plan.spec.context_length or 0, 1024)
    contexts = sorted({max(1, int(top * i / points)) for i in range(1, points + 1)} | {plan.settings.context})
    kinds = list(dict.fromkeys((plan.layout.kv_type_k, *PLOT_TYPES.get(plan.engine.name, ()))))
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for kind in kinds:
        settings = replace(plan.settings, kv_type_k=kind, kv_type_v=kind)
        try:
            totals = [sum(c.bytes for c in plan_components(plan.spec, plan.engine, replace(settings, context=ctx), plan.weights, plan.extras)[1])
                      for ctx in contexts]
        except KvlabError:
            continue  # a type this engine or model cannot store
        ax.plot(contexts, [t / GiB for t in totals], label=f"total, KV {kind}")
    if plan.budget_bytes is not None:
        ax.axhline(plan.budget_bytes / GiB, color="red", linestyle="--", label=f"{plan.gpu.name} usable")
    ax.axvline(plan.settings.context, color="gray", linestyle=":", linewidth=1)
    ax.set_xlabel("context (tokens per sequence)")
    ax.set_ylabel("total memory, GiB" + (" per GPU" if plan.per_gpu else ""))
    ax.set_title(f"{plan.spec.name} · {plan.engine.name} · {plan.settings.parallel} seq")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return path
