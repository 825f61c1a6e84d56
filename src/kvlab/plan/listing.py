"""`kvlab plan --list [FILTER]`: the catalog as a table (name, repo, parameters, layers, context, KV per token)."""

from __future__ import annotations

from rich.table import Table

from ..sources import catalog
from ..sources.layers import kinds_summary
from .rules import rules_for
from .settings import PlanSettings


def catalog_rows(text: str | None = None) -> list[dict]:
    """One row per catalog model whose name, repo, architecture or alias contains `text` (case-insensitive)."""
    needle = (text or "").strip().lower()
    rows = []
    engine = rules_for("llama.cpp")
    for entry in catalog().values():
        spec = entry.spec()
        haystack = " ".join([entry.name, entry.repo, spec.arch, *entry.aliases]).lower()
        if needle and needle not in haystack:
            continue
        layout = engine.layout(spec, PlanSettings(context=4096))
        rows.append({"name": entry.name, "repo": entry.repo, "n_params": int(entry.n_params), "arch": spec.arch,
                     "layers": kinds_summary([layer.kind for layer in spec.layers]), "context": spec.context_length,
                     "kv_bytes_per_token_f16": layout.bytes_per_token, "vision": bool(entry.vision)})
    return rows


def catalog_table(rows: list[dict], text: str | None = None) -> Table:
    title = f"catalog ({len(rows)} models{f' matching {text!r}' if text else ''}; KV per token: llama.cpp f16, full layers)"
    table = Table(title=title, title_justify="left")
    for column in ("name", "repo", "params", "arch", "layers", "max context", "KV/token"):
        table.add_column(column, justify="right" if column in ("params", "max context", "KV/token") else "left")
    for r in rows:
        table.add_row(r["name"] + (" (+vision)" if r["vision"] else ""), r["repo"], f"{r['n_params'] / 1e9:.2f} B", r["arch"],
                      r["layers"], f"{r['context']:,}", f"{r['kv_bytes_per_token_f16']:,} B")
    return table
