"""`kvlab lab all --out DIR`: every experiment in one run, one progress bar, one Markdown report.

DIR receives report.md (tables, plots, the machine, the exact commands), lab.json (every record),
invariance.png, counts.png, gqa.png and speed.png.
"""

from __future__ import annotations

import shlex
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .common import Ticker, progress_bar
from ..fileio import check_writable_folder, write_text
from ..measure import machine_info, write_json
from .counts import COUNTS_CONFIG, counts_markdown, plot_counts, run_counts
from .gqa import TrainSettings, gqa_markdown, plot_gqa, run_gqa
from .invariance import INVARIANCE_CONFIG, invariance_markdown, plot_invariance, run_invariance
from .speed import LENGTHS, MODELS, QUICK_LENGTHS, checks_markdown, plot_speed, run_speed, speed_markdown, summary_markdown

#: Share of the whole-run bar each experiment fills (roughly its share of the time of a full run).
WEIGHTS = {"invariance": 1, "counts": 9, "gqa": 50, "speed": 40}


@dataclass(frozen=True)
class AllSettings:
    out: Path
    quick: bool = False
    threads: int = 0
    counts_n: tuple[int, ...] = (100, 1000)
    lengths: tuple[int, ...] = LENGTHS
    models: tuple[str, ...] = MODELS
    repeats: int = 3
    weights_dir: Path | None = None
    retrain: bool = False

    @classmethod
    def make(cls, out, quick: bool = False, **overrides) -> "AllSettings":
        base = dict(out=Path(out), quick=quick)
        if quick:
            base.update(counts_n=(10, 30), lengths=QUICK_LENGTHS, models=("lab",), repeats=1)
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)

    def train_settings(self) -> TrainSettings:
        return TrainSettings().quick() if self.quick else TrainSettings()

    def command(self) -> str:
        parts = ["kvlab", "lab", "all", "--out", str(self.out)]
        if self.quick:
            parts.append("--quick")
        if self.threads:
            parts += ["--threads", str(self.threads)]
        parts += ["--models", ",".join(self.models)]
        if self.weights_dir:
            parts += ["--weights-dir", str(self.weights_dir)]
        return shlex.join(parts)


def run_all(settings: AllSettings, console=None, show_progress: bool = True) -> dict:
    """Run the four experiments; write the report, plots and JSON into settings.out; return the JSON payload."""
    out = check_writable_folder(settings.out, "--out")  # before the long run, not after it
    machine = machine_info()
    timings: dict[str, float] = {}
    if show_progress:
        with progress_bar(console, transient=False) as progress:
            overall = progress.add_task("[bold]kvlab lab all[/]", total=sum(WEIGHTS.values()))

            def ticker(name: str) -> Ticker:
                return Ticker(progress, progress.add_task(name, total=1), overall, WEIGHTS[name])

            results = _run(settings, ticker, timings)
            progress.update(overall, completed=sum(WEIGHTS.values()))
    else:
        results = _run(settings, lambda name: Ticker(), timings)
    inv, counts, gqa, speed = results
    plot_invariance(inv, out / "invariance.png")
    plot_counts(counts, out / "counts.png")
    plot_gqa(gqa, out / "gqa.png")
    plot_speed(speed, out / "speed.png")
    payload = {
        "command": settings.command(),
        "machine": machine,
        "seconds": timings,
        "train_settings": asdict(settings.train_settings()),
        "invariance": inv.record(),
        "counts": [r.record() for r in counts],
        "gqa": [r.record() for r in gqa],
        "speed": speed.json_records(),
    }
    write_json(out / "lab.json", payload)
    write_text(out / "report.md", render_report(settings, payload, inv, counts, gqa, speed))
    return payload


def _run(settings: AllSettings, ticker, timings: dict):
    def timed(name, fn):
        t0 = time.perf_counter()
        result = fn(ticker(name))
        timings[name] = round(time.perf_counter() - t0, 2)
        return result

    inv = timed("invariance", lambda t: run_invariance(ticker=t))
    counts = timed("counts", lambda t: run_counts(list(settings.counts_n), ticker=t))
    gqa = timed("gqa", lambda t: run_gqa(settings.train_settings(), new_tokens=16 if settings.quick else 256,
                                         repeats=settings.repeats, weights_dir=settings.weights_dir,
                                         retrain=settings.retrain, ticker=t))
    speed = timed("speed", lambda t: run_speed(settings.models, settings.lengths, settings.repeats,
                                               quick=settings.quick, weights_dir=settings.weights_dir, ticker=t))
    return inv, counts, gqa, speed


def machine_markdown(machine: dict) -> str:
    rows = [("CPU", machine["cpu"]), ("logical CPUs", machine["cpu_count"]), ("torch threads", machine["torch_threads"]),
            ("memory", f"{machine['memory_gib']} GiB"), ("OS", machine["os"]), ("Python", machine["python"]),
            ("torch", machine["torch"]), ("load average at start (1, 5, 15 min)", machine["load_average"])]
    return "\n".join(["| machine | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])


def speed_analysis(speed) -> str:
    """The paragraph the numbers support: measured speed-up against the MAC ratio, and where the gap comes from."""
    lines = []
    for s in speed.summaries:
        ops = f"{s.ops_per_cached_step:,} torch ops" if s.ops_per_cached_step else "its torch ops"
        lines.append(
            f"- **{s.model}** at {s.new_tokens:,} tokens: the cache is **{s.measured_speedup:,.1f}×** faster"
            f"{' (estimated: a real run of that length did not fit the run budget)' if s.speedup_method == 'estimated' else ''}; the "
            f"multiply-adds predict **{s.predicted_speedup:,.1f}×** ({s.efficiency * 100:.1f}% of the ideal). "
            f"Without the cache the passes run {s.gmacs_per_s_no_cache:.2f} GMAC/s (big matrix products); with it "
            f"{s.gmacs_per_s_cache:.3f} GMAC/s. A cached step costs {s.cache_step_ms_first:.2f} ms at the start and "
            f"{s.cache_step_ms_last:.2f} ms at the end, of which its MACs explain almost nothing: it reads "
            f"{s.weight_bytes / 1e6:.1f} MB of weights (≥ {s.weights_read_ms:.2f} ms at the measured "
            f"{s.read_gb_per_s:.1f} GB/s) plus the cache, and dispatches {ops}, each with a fixed cost. "
            f"Charging every pass the fixed {s.fixed_step_ms:.2f} ms (shortest cached step minus its MAC time) "
            f"predicts {s.predicted_speedup_with_fixed_cost:,.1f}×."
        )
    return "\n".join(lines)


def render_report(settings: AllSettings, payload: dict, inv, counts, gqa, speed) -> str:
    ts = settings.train_settings()
    machine = payload["machine"]
    secs = payload["seconds"]
    inv_cfg, cnt_cfg = INVARIANCE_CONFIG, COUNTS_CONFIG
    parts = [
        "# kvlab lab: the textbook experiments, measured",
        "",
        f"Generated by `{settings.command()}` in {sum(secs.values()):.0f} s "
        f"({', '.join(f'{k} {v:.0f} s' for k, v in secs.items())}).",
        "",
        machine_markdown(machine),
        "",
        "Each experiment alone: `kvlab lab invariance`, `kvlab lab counts --n "
        + " ".join(str(n) for n in settings.counts_n)
        + f"`, `kvlab lab gqa`, `kvlab lab speed --models {','.join(settings.models)} --lengths {','.join(map(str, settings.lengths))}`"
        + (" with `--quick`" if settings.quick else "")
        + (f" and `--threads {settings.threads}`" if settings.threads else "")
        + "; each takes `--json`.",
        "",
        "## 1. Appending a token leaves the earlier outputs unchanged (with the mask)",
        "",
        f"A pre-norm decoder of {inv_cfg.n_layers} blocks, width {inv_cfg.d_model} ({inv_cfg.n_heads} heads, random weights, "
        f"seed {inv.seed}). Outputs are the final norm's {inv_cfg.d_model}-wide hidden states. 'No mask' is the same model "
        "read through a cache whose attention has causal=False.",
        "",
        invariance_markdown(inv),
        "",
        "Without the mask block 0's keys are still equal (they come from the embeddings alone) but every later "
        "block's keys change when a token is appended, so a cache built from the first tokens is stale.",
        "",
        "![invariance](invariance.png)",
        "",
        "## 2. Work of generating n tokens, counted while the engine runs",
        "",
        f"A {cnt_cfg.n_layers}-block, {cnt_cfg.n_heads}-head model generates n tokens from a 1-token prompt "
        "(n forward passes over 1..n tokens) through a counting wrapper around the real cache.",
        "",
        counts_markdown(counts),
        "",
        "![counts](counts.png)",
        "",
        "## 3. GQA: cache bytes, speed and loss against n_kv_head",
        "",
        f"Byte-level GPT, d_model 256, 8 query heads (head_dim 32), {ts.n_layers} block{'s' if ts.n_layers != 1 else ''}, SwiGLU d_ff {ts.d_ff}; "
        f"trained {ts.steps} steps of {ts.batch}×{ts.seq_len} bytes of Shakespeare (AdamW, lr {ts.lr}, seed {ts.seed}) "
        "with the same batches for every variant. Cache bytes after a 16-byte prompt and "
        f"{16 if settings.quick else 256} generated bytes (fp32).",
        "",
        gqa_markdown(gqa),
        "",
        "Training time per variant (n_kv_head 8, 4, 2, 1): "
        + ", ".join(f"{r.train_seconds:.0f} s" for r in gqa)
        + (" — in an earlier run; this run loaded the saved weights." if all(r.resumed for r in gqa) else "."),
        "",
        "![gqa](gqa.png)",
        "",
        "## 4. Speed with and without the cache",
        "",
        "tokens/s = n / the wall time of real `generate()` runs (median, after a warm-up run). A cell whose real runs "
        "would exceed the run budget is estimated (the prompt pass + the measured time of each step at its length, "
        "sampled and interpolated) and marked ≈; every real run is set beside its estimate:",
        "",
        checks_markdown(speed),
        "",
        speed_markdown(speed),
        "",
        summary_markdown(speed),
        "",
        speed_analysis(speed),
        "",
        "![speed](speed.png)",
        "",
    ]
    return "\n".join(parts)
