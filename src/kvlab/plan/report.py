"""Plan → rich table, per-layer table, verdict, and the JSON document."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from .budget import Plan
from .launch import launch_line
from .offload import weight_split

GiB = 1 << 30
MiB = 1 << 20


def human(nbytes: int | float) -> str:
    """2.00 GiB / 72.0 MiB / 147,456 B."""
    if abs(nbytes) >= GiB:
        return f"{nbytes / GiB:.2f} GiB"
    if abs(nbytes) >= MiB:
        return f"{nbytes / MiB:.1f} MiB"
    return f"{int(nbytes):,} B"


def plan_json(plan: Plan) -> dict[str, Any]:
    layout, s = plan.layout, plan.settings
    c = {comp.name: comp for comp in plan.components}
    return {
        "model": plan.spec.name,
        "alias": {"requested": plan.alias_of, "planned": plan.spec.name, "note": plan.alias_note} if plan.alias_of else None,
        "n_params": plan.spec.n_params or None,
        "n_params_source": plan.spec.extra.get("n_params_source", "model file or catalog" if plan.spec.n_params else None),
        "source": plan.spec.source,
        "engine": plan.engine.name,
        "engine_version": plan.engine.version,
        "context": s.context,
        "parallel": s.parallel,
        "tp": s.tp,
        "per_gpu": plan.per_gpu,
        "kv_type_k": layout.kv_type_k,
        "kv_type_v": layout.kv_type_v,
        "flash_attn": s.flash_attn,
        "layers": {kind: sum(1 for layer in plan.spec.layers if layer.kind == kind)
                   for kind in dict.fromkeys(layer.kind for layer in plan.spec.layers)},
        "kv_bytes_per_token": layout.bytes_per_token,
        "kv_bytes_per_token_by_kind": layout.per_token_by_kind(),
        "sliding_kv_bytes_per_token": layout.sliding_bytes_per_token,
        "sliding_kv_bytes": layout.sliding_kv_bytes,
        "kv_bytes": c["K cache"].bytes + c["V cache"].bytes,
        "k_bytes": c["K cache"].bytes,
        "v_bytes": c["V cache"].bytes,
        "recurrent_bytes": c["recurrent state"].bytes if "recurrent state" in c else 0,
        "weights_bytes": c["weights"].bytes,
        "weights_exact": plan.weights.exact,
        "weights_known": plan.weights.known,
        "weights_by_type": plan.weights.scheme.by_type if plan.weights.scheme else None,
        "overhead_bytes": sum(comp.bytes for comp in plan.components
                              if comp.name not in ("weights", "K cache", "V cache", "recurrent state")),
        "total_bytes": plan.total_bytes,
        "offload": None if plan.offload is None else {
            "gpu_layers": plan.offload.gpu_layers, "cpu_moe_layers": plan.offload.cpu_moe_layers,
            "ram_bytes": plan.offload.ram_bytes, "where": plan.offload.describe(plan.spec.n_layers)},
        "host_bytes": plan.host_bytes,
        "host_components": [{"name": comp.name, "formula": comp.formula, "bytes": comp.bytes, "exact": comp.exact}
                            for comp in plan.host],
        "components": [{"name": comp.name, "formula": comp.formula, "bytes": comp.bytes, "exact": comp.exact}
                       for comp in plan.components],
        "gpu": plan.gpu.name if plan.gpu else None,
        "budget_bytes": plan.budget_bytes,
        "fits": plan.fits,
        "max_context": plan.max_context,
        "max_sequences": plan.max_sequences,
        "max_context_limited_by": None if not plan.max_context else "model" if plan.context_limited_by_model else "memory",
        "headroom_bytes": plan.headroom_bytes,
        "hints": list(plan.hints),
        "notes": list(layout.notes),
        "launch": launch_line(plan),
    }


def components_table(plan: Plan) -> Table:
    spec, s, layout = plan.spec, plan.settings, plan.layout
    per_gpu = " per GPU" if plan.per_gpu else ""
    title = (f"{spec.name} · {plan.engine.name} · ctx {s.context:,} × {s.parallel} seq · "
             f"KV {layout.kv_type_k}/{layout.kv_type_v}{per_gpu}")
    table = Table(title=title, title_justify="left")
    table.add_column("component")
    table.add_column("formula", overflow="fold")
    table.add_column("bytes", justify="right")
    table.add_column("", justify="right")
    for comp in plan.components:
        approx = "" if comp.exact else "≈ "
        table.add_row(comp.name, comp.formula, f"{approx}{comp.bytes:,}", human(comp.bytes))
    table.add_section()
    table.add_row("total", "", f"{plan.total_bytes:,}", human(plan.total_bytes), style="bold")
    return table


def layers_table(plan: Plan) -> Table:
    table = Table(title="per layer", title_justify="left")
    for col in ("layer", "kind", "KV heads", "head dim K/V", "window", "cells", "K bytes", "V bytes", "state bytes"):
        table.add_column(col, justify="right" if col not in ("kind",) else "left")
    for row in plan.layout.layers:
        layer = plan.spec.layers[row.index]
        dims = f"{layer.kv_lora_rank}+{layer.rope_dim}" if layer.kind == "mla" else f"{layer.head_dim_k}/{layer.head_dim_v}"
        table.add_row(str(row.index), row.kind, str(layer.n_kv_heads or ""), dims if layer.kind != "recurrent" else "",
                      str(layer.window or ""), f"{row.cells:,}" if row.cells else "", f"{row.k_bytes:,}",
                      f"{row.v_bytes:,}", f"{row.state_bytes:,}")
    return table


def per_token_line(plan: Plan) -> str:
    """KV per token split by layer kind: what grows with the context, and the sliding layers' constant."""
    layout = plan.layout
    counts: dict[str, int] = {}
    for row in layout.layers:
        counts[row.kind] = counts.get(row.kind, 0) + 1
    split = layout.per_token_by_kind()
    growing = [f"{counts[k]} {k}" for k in ("full", "mla") if split.get(k)]
    text = f"KV per token: {layout.bytes_per_token:,} B" + (f" ({' + '.join(growing)} layers, grows with the context)" if growing else "")
    if layout.sliding_bytes_per_token:
        windows = sorted({plan.spec.layers[r.index].window for r in layout.layers if r.kind == "sliding"})
        text += (f" + {layout.sliding_bytes_per_token:,} B in {counts['sliding']} sliding layers only while a token is in "
                 f"their window ({', '.join(f'{w:,}' for w in windows)} tokens): a constant {human(layout.sliding_kv_bytes)}")
    return text + f"  ·  KV {human(layout.kv_bytes)}" + (f"  ·  recurrent {human(layout.recurrent_bytes)}" if layout.recurrent_bytes else "")


def context_line(plan: Plan) -> str:
    s = plan.settings
    if not plan.max_context:
        return "nothing fits, even at 1 token of context"
    kept = f", keeping {human(plan.headroom_bytes)} free" if plan.headroom_bytes else ""
    if plan.context_limited_by_model:
        why = f"the model's own maximum ({plan.context_cap:,}); memory would allow more"
    else:
        why = f"limited by memory{kept}"
    return f"longest context that fits ({s.parallel} seq): {plan.max_context:,} tokens ({why})"


def where_line(plan: Plan) -> str:
    """What runs where, for an offloaded llama.cpp plan: the GPU's share and the host's, against --ram."""
    parts = " + ".join(f"{c.name.removesuffix(' (host)')} {human(c.bytes)}" for c in plan.host)
    ram = plan.offload.ram_bytes
    against = ""
    if ram is not None:
        against = (f", within the {human(ram)} of --ram" if plan.host_bytes <= ram
                   else f", [red]more than the {human(ram)} of --ram[/red] (short by {human(plan.host_bytes - ram)})")
    return (f"where: {plan.offload.describe(plan.spec.n_layers)}; GPU {human(plan.total_bytes)}; "
            f"host RAM {human(plan.host_bytes)} ({parts or 'nothing'}){against}")


def verdict(plan: Plan) -> str:
    s = plan.settings
    lines = [per_token_line(plan), f"launch: {launch_line(plan)}"]
    if plan.offload is not None:
        lines.append(where_line(plan))
    if not plan.weights.known:
        lines.append(f"[yellow]total without the weights {human(plan.total_bytes)}; the weights are unknown for "
                     f"{plan.spec.arch!r}: give --params N or --weights-bytes SIZE for a verdict[/yellow]")
        return "\n".join(lines)
    if plan.budget_bytes is None:
        lines.append(f"total {human(plan.total_bytes)} (give --gpu or --vram for a verdict)")
        return "\n".join(lines)
    where = f"{human(plan.budget_bytes)} usable on {plan.gpu.name}" + (" (per GPU)" if plan.per_gpu else "")
    free = plan.budget_bytes - plan.total_bytes
    if plan.fits:
        margin = plan.engine.default_headroom
        tight = (f" (less than the {human(margin)} headroom {plan.engine.name} users keep: "
                 f"{plan.engine.headroom_reason})") if free < margin else ""
        lines.append(f"[green]fits[/green]: {human(plan.total_bytes)} of {where}, {human(free)} free{tight}")
    else:
        lines.append(f"[red]does not fit[/red]: {human(plan.total_bytes)} > {where}, short by {human(-free)}")
    if plan.max_context is not None:
        lines.append(context_line(plan))
    if plan.max_sequences is not None:
        lines.append(f"most sequences at {s.context:,} tokens: {plan.max_sequences}"
                     + (f" (keeping {human(plan.headroom_bytes)} free)" if plan.headroom_bytes else ""))
    for hint in plan.hints:
        lines.append(f"[yellow]{hint}[/yellow]")
    for note in (*plan.layout.notes, *_placement_notes(plan)):
        lines.append(f"[dim]{note}[/dim]")
    return "\n".join(lines)


def _placement_notes(plan: Plan) -> tuple[str, ...]:
    """A llama.cpp plan without offload counts every weight on the GPU; llama.cpp keeps the token embedding on the host."""
    if plan.engine.name != "llama.cpp" or plan.offload is not None or not plan.weights.known:
        return ()
    embedding = weight_split(plan.spec, plan.weights).embedding
    if embedding < (64 << 20):
        return ()
    note = (f"weights counted on the GPU in full: llama.cpp keeps token_embd ({human(embedding)}) in host memory, so the "
            "card has that much more room (--gpu-layers all plans the exact placement)")
    return (note,)


def print_plan(plan: Plan, console: Console, layers: bool = False) -> None:
    console.print(components_table(plan))
    if layers:
        console.print(layers_table(plan))
    console.print(verdict(plan), soft_wrap=True)   # the launch line stays one line, whatever the width
