"""A PNG of quality (ΔPPL and mean KL, with their bootstrap intervals) against bits per cached value."""

from __future__ import annotations

from pathlib import Path

from ..cache import CacheSpec
from ..fileio import save_figure
from ..hf_baselines import is_baseline_name
from .suite import CacheQuality


def _family(name: str) -> str:
    if name == "hf:dynamic":
        return "dense"
    if is_baseline_name(name):
        return "transformers' caches"
    return {"dense": "dense", "int": "int (KIVI-style)"}.get(CacheSpec.parse(name).base, "TurboQuant")


def plot_quality(records: list[CacheQuality], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"dense": "black", "int (KIVI-style)": "tab:blue", "TurboQuant": "tab:red", "transformers' caches": "tab:green"}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric, label in ((axes[0], "ppl_delta_pct", "ΔPPL vs dense (%)"), (axes[1], "kl", "mean KL vs dense (nats)")):
        seen = set()
        for r in records:
            family = _family(r.cache)
            value = getattr(r, metric)
            ax.scatter(r.bits_per_value, value, color=colors[family], label=None if family in seen else family, zorder=3)
            interval = r.ppl_delta_ci if metric == "ppl_delta_pct" else r.kl_ci
            if interval is not None:  # the bootstrap interval over windows
                ax.errorbar(r.bits_per_value, value, yerr=[[max(0.0, value - interval[0])], [max(0.0, interval[1] - value)]],
                            color=colors[family], capsize=3, linewidth=1, zorder=2)
            seen.add(family)
            ax.annotate(r.cache, (r.bits_per_value, value), textcoords="offset points", xytext=(4, 3), fontsize=7)
        ax.set_xlabel("bits per cached value (all metadata, 511 tokens)")
        ax.set_ylabel(label)
        ax.set_yscale("symlog", linthresh=1.0 if metric == "ppl_delta_pct" else 0.01)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M KV cache quality against bits (Shakespeare, fp32 compute)")
    fig.tight_layout()
    path = Path(path)
    save_figure(fig, path, dpi=120)
    plt.close(fig)
    return path
