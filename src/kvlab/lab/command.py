"""`kvlab lab invariance | counts | gqa | speed | all`: the textbook experiments as commands.

Every command prints a rich table (and a progress bar while it works), or with `--json` one JSON
list of records; `--plot FILE.png` saves its plot; `--threads N` sets torch's intra-op threads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ..errors import ConfigError
from ..fileio import PLOT_SUFFIXES, check_writable
from ..limits import MAX_REPEATS
from ..terminal import console, one_line_errors

THREADS_HELP = "torch intra-op threads (0: torch's default). On a busy machine 1 can be much faster."


def _ints(text: str, option: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.replace(",", " ").split())
    except ValueError:
        raise ConfigError(f"{option} takes whole numbers separated by commas, got {text!r}") from None
    if not values:
        raise ConfigError(f"{option} needs at least one number")
    return values


def _png(path: Optional[str]) -> Optional[Path]:
    if path is None:
        return None
    return check_writable(path, "--plot", PLOT_SUFFIXES)  # before the experiment runs, not after


def _print_json(records: list[dict]) -> None:
    print(json.dumps(records, indent=2))


def register(app: typer.Typer) -> None:
    lab = typer.Typer(no_args_is_help=True, help="The textbook KV-cache experiments, reproduced and measured.")
    app.add_typer(lab, name="lab")

    @lab.command("invariance")
    @one_line_errors
    def invariance(
        tokens: int = typer.Option(8, "--tokens", min=1, help="Tokens before the appended one."),
        steps: int = typer.Option(8, "--steps", min=1, help="Tokens decoded from the cache for the stale-cache check."),
        seed: int = typer.Option(0, "--seed"),
        plot: Optional[str] = typer.Option(None, "--plot", help="Save the plot (PNG)."),
        json_out: bool = typer.Option(False, "--json"),
        threads: int = typer.Option(0, "--threads", min=0, help=THREADS_HELP),
    ):
        """Append one token: do the earlier outputs change, with and without the causal mask? And a stale cache."""
        from ..measure import torch_threads
        from .invariance import invariance_table, plot_invariance, run_invariance

        path = _png(plot)
        with torch_threads(threads):
            result = run_invariance(tokens, steps, seed)
        if path:
            plot_invariance(result, path)
        if json_out:
            _print_json([result.record()])
        else:
            console.print(invariance_table(result))

    @lab.command("counts")
    @one_line_errors
    def counts(
        n: Optional[str] = typer.Option(None, "--n", help="Generated tokens: --n 100 1000 or --n 100,1000 (default 100 1000)."),
        more: Optional[list[int]] = typer.Argument(None, metavar="[N]...", help="More token counts (so that --n 100 1000 works)."),
        quick: bool = typer.Option(False, "--quick", help="n = 10 and 30."),
        plot: Optional[str] = typer.Option(None, "--plot"),
        json_out: bool = typer.Option(False, "--json"),
        threads: int = typer.Option(0, "--threads", min=0, help=THREADS_HELP),
    ):
        """Count (query, key) scores and K/V projections while generating n tokens, with and without a cache."""
        from .common import ticker_for
        from ..measure import torch_threads
        from .counts import counts_table, plot_counts, run_counts

        path = _png(plot)
        ns = list(_ints(n, "--n") if n else ()) + list(more or [])
        ns = [10, 30] if quick else ns or [100, 1000]
        with torch_threads(threads), ticker_for(console, not json_out, "counts") as ticker:
            records = run_counts(ns, ticker)
        if path:
            plot_counts(records, path)
        if json_out:
            _print_json([r.record() for r in records])
        else:
            console.print(counts_table(records))
            if not all(r.matches for r in records):
                raise typer.Exit(1)

    @lab.command("gqa")
    @one_line_errors
    def gqa(
        steps: Optional[int] = typer.Option(None, "--steps", min=1, help="Training steps per variant (default 200)."),
        new_tokens: int = typer.Option(256, "--new-tokens", min=2, help="Tokens generated for the bytes and tokens/s columns."),
        repeats: int = typer.Option(3, "--repeats", min=1, max=MAX_REPEATS),
        weights_dir: Optional[str] = typer.Option(None, "--weights-dir", help="Where trained weights are saved and resumed from."),
        retrain: bool = typer.Option(False, "--retrain", help="Train again even when saved weights exist."),
        quick: bool = typer.Option(False, "--quick", help="A 1-block model, 3 steps: for tests."),
        plot: Optional[str] = typer.Option(None, "--plot"),
        json_out: bool = typer.Option(False, "--json"),
        threads: int = typer.Option(0, "--threads", min=0, help=THREADS_HELP),
    ):
        """The record table: n_kv_head 8/4/2/1, cache bytes measured vs theory, ratio to MHA, tokens/s, val loss."""
        from dataclasses import replace

        from .common import ticker_for
        from ..measure import torch_threads
        from .gqa import TrainSettings, gqa_table, plot_gqa, run_gqa

        path = _png(plot)
        settings = TrainSettings().quick() if quick else TrainSettings()
        if steps:
            settings = replace(settings, steps=steps, warmup=min(settings.warmup, steps))
        if quick:
            new_tokens = min(new_tokens, 16)
        with torch_threads(threads), ticker_for(console, not json_out, "gqa") as ticker:
            records = run_gqa(settings, new_tokens, repeats, Path(weights_dir) if weights_dir else None, retrain, ticker=ticker)
        if path:
            plot_gqa(records, path)
        if json_out:
            _print_json([r.record() for r in records])
        else:
            console.print(gqa_table(records, settings))

    @lab.command("speed")
    @one_line_errors
    def speed(
        models: str = typer.Option("lab,smollm2", "--models", help="lab (the lab GPT) and/or smollm2."),
        lengths: str = typer.Option("64,256,512,1024,2048", "--lengths", help="Generated tokens after a 16-token prompt."),
        repeats: int = typer.Option(3, "--repeats", min=1, max=MAX_REPEATS),
        run_budget: float = typer.Option(150.0, "--run-budget", min=0.0,
                                         help="Seconds of real generate() runs one (length, cache) cell may take; "
                                              "a cell over it is estimated from sampled steps and marked ≈."),
        weights_dir: Optional[str] = typer.Option(None, "--weights-dir"),
        quick: bool = typer.Option(False, "--quick", help="Lengths 8, 16; the lab GPT only; 1 repeat."),
        plot: Optional[str] = typer.Option(None, "--plot"),
        json_out: bool = typer.Option(False, "--json"),
        threads: int = typer.Option(0, "--threads", min=0, help=THREADS_HELP),
    ):
        """Tokens/s with and without the cache, against the speed-up the operation counts predict."""
        from .common import ticker_for
        from ..measure import torch_threads
        from .report import speed_analysis
        from .speed import QUICK_LENGTHS, plot_speed, run_speed, speed_table

        path = _png(plot)
        model_keys = tuple(m.strip() for m in models.split(",") if m.strip())
        lens = _ints(lengths, "--lengths")
        if quick:
            lens, repeats = QUICK_LENGTHS, 1
            if models == "lab,smollm2":
                model_keys = ("lab",)
        with torch_threads(threads), ticker_for(console, not json_out, "speed") as ticker:
            result = run_speed(model_keys, lens, repeats, quick, Path(weights_dir) if weights_dir else None, ticker,
                               run_budget_s=run_budget)
        if path:
            plot_speed(result, path)
        if json_out:
            _print_json(result.json_records())
        else:
            from rich.markdown import Markdown

            console.print(speed_table(result))   # its caption marks estimates and estimates > 10% off a real run
            console.print(Markdown(speed_analysis(result)))

    @lab.command("all")
    @one_line_errors
    def all_(
        out: str = typer.Option("lab-report", "--out", help="Folder for report.md, lab.json and the plots."),
        quick: bool = typer.Option(False, "--quick", help="Small versions of every experiment (seconds)."),
        models: Optional[str] = typer.Option(None, "--models", help="Speed models (default lab,smollm2; --quick: lab)."),
        weights_dir: Optional[str] = typer.Option(None, "--weights-dir"),
        retrain: bool = typer.Option(False, "--retrain"),
        json_out: bool = typer.Option(False, "--json", help="Print lab.json instead of the summary."),
        threads: int = typer.Option(0, "--threads", min=0, help=THREADS_HELP),
    ):
        """Run every experiment with one progress bar; write report.md, lab.json and PNG plots into --out."""
        from ..measure import torch_threads
        from .report import AllSettings, run_all

        model_keys = tuple(m.strip() for m in models.split(",") if m.strip()) if models else None
        settings = AllSettings.make(out, quick, threads=threads, models=model_keys,
                                    weights_dir=Path(weights_dir) if weights_dir else None, retrain=retrain)
        with torch_threads(threads):
            payload = run_all(settings, console, show_progress=not json_out)
        if json_out:
            print(json.dumps(payload, indent=2))
        else:
            console.print(f"report: {Path(out) / 'report.md'} · records: {Path(out) / 'lab.json'} · "
                          f"{sum(payload['seconds'].values()):.0f} s")
