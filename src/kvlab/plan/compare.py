"""`kvlab plan A B C --gpu ...`: candidate models side by side for one card and workload, ranked.

Ranking: what fits at the asked context and sequences first, by the memory left (with --ctx max: by the
longest context, with --parallel max: by the most sequences); then what does not, by how much it is short. One line each: weights, KV, total, free (or short), the longest context and most sequences.
"""

from __future__ import annotations

from rich.table import Table

from .budget import Plan
from .report import human


def ranked(plans: list[Plan], by: str = "free") -> list[Plan]:
    """by: 'free' (memory left), 'context' (longest context) or 'sequences' (most sequences), after the verdict."""
    def key(plan: Plan):
        free = (plan.budget_bytes or 0) - plan.total_bytes
        solved = {"context": plan.max_context or 0, "sequences": plan.max_sequences or 0}.get(by, 0)
        return (0 if plan.fits else 1, -solved, -free)
    return sorted(plans, key=key)


def rank_by(ctx: str | None, parallel: str | None) -> str:
    if str(ctx).strip().lower() == "max":
        return "context"
    return "sequences" if str(parallel).strip().lower() == "max" else "free"


def compare_rows(plans: list[Plan], by: str = "free") -> list[dict]:
    from .launch import launch_line

    rows = []
    for rank, plan in enumerate(ranked(plans, by), 1):
        c = {comp.name: comp.bytes for comp in plan.components}
        rows.append({"rank": rank, "model": plan.spec.name, "asked": plan.alias_of or plan.model_ref or plan.spec.name,
                     "weights_bytes": c["weights"], "kv_bytes": c["K cache"] + c["V cache"] + c.get("recurrent state", 0),
                     "total_bytes": plan.total_bytes, "budget_bytes": plan.budget_bytes, "fits": plan.fits,
                     "free_bytes": None if plan.budget_bytes is None else plan.budget_bytes - plan.total_bytes,
                     "max_context": plan.max_context, "max_sequences": plan.max_sequences, "launch": launch_line(plan)})
    return rows


def compare_table(plans: list[Plan], ctx: str | None = None, parallel: str | None = None) -> Table:
    """`ctx` / `parallel`: as asked ('max' solves each model for its own)."""
    first = plans[0]
    s = first.settings
    where = f" on {first.gpu.name} ({human(first.budget_bytes)} usable)" if first.gpu else ""
    context = "max" if str(ctx).strip().lower() == "max" else f"{s.context:,}"
    sequences = "max" if str(parallel).strip().lower() == "max" else f"{s.parallel}"
    table = Table(title=f"{len(plans)} candidates{where} · {first.engine.name} · ctx {context} × {sequences} seq",
                  title_justify="left")
    for column in ("#", "model", "weights", "KV + state", "total", "verdict", "longest ctx", "most seqs"):
        table.add_column(column, justify="left" if column in ("model", "verdict") else "right")
    for row in compare_rows(plans, rank_by(ctx, parallel)):
        if row["fits"] is None:
            verdict = "—"
        else:
            verdict = f"fits, {human(row['free_bytes'])} free" if row["fits"] else f"short by {human(-row['free_bytes'])}"
        table.add_row(str(row["rank"]), row["model"], human(row["weights_bytes"]), human(row["kv_bytes"]),
                      human(row["total_bytes"]), verdict, "" if row["max_context"] is None else f"{row['max_context']:,}",
                      "" if row["max_sequences"] is None else str(row["max_sequences"]))
    return table
