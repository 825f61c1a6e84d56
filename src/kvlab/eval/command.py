"""`kvlab eval`: perplexity, KL, top-1 agreement and passkey retrieval for a list of caches."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

DEFAULT_CACHES = "int8,int4,int4+g64,tq5,tq4,tq-k4v4,tq-k4v4+sink1,tq-k5v3,tq3.5,tq3,tq2.5,tq-k4v4+qjl"
QUICK_WINDOWS = 4


def register(app: typer.Typer) -> None:
    from ..fileio import PLOT_SUFFIXES, check_writable, write_json
    from ..terminal import console, one_line_errors

    @app.command("eval")
    @one_line_errors
    def eval_command(
        caches: str = typer.Option(DEFAULT_CACHES, "--caches", help="Comma-separated cache names (dense is always the reference)."),
        quick: bool = typer.Option(False, "--quick", help=f"{QUICK_WINDOWS} windows, one rotation seed, passkey trials at the first length only."),
        windows: Optional[int] = typer.Option(None, "--windows", min=1, help="Windows of 512 tokens (default 16)."),
        passkey: bool = typer.Option(True, "--passkey/--no-passkey", help="Run the passkey retrieval test."),
        text: bool = typer.Option(True, "--text/--no-text", help="Greedy continuations of 54 fixed prompts (--quick: 8, 16 tokens) against dense's: first difference, chat answers, repetition."),
        passkey_lengths: str = typer.Option("1000,3000,6000", "--passkey-lengths", help="Filler tokens per passkey prompt."),
        passkey_repeats: int = typer.Option(1, "--passkey-repeats", min=1, help="Trials per (length, depth), each with its own key (the seeds cycle over them)."),
        passkey_prime: bool = typer.Option(True, "--passkey-prime/--no-passkey-prime", help="Open the answer with 'The pass key is' (the original test's prompt), or let the model phrase it."),
        model: Optional[str] = typer.Option(None, "--model", help="GGUF file or Hugging Face folder (default: embedded SmolLM2)."),
        backend: str = typer.Option("kvlab", "--backend", help="kvlab | transformers (any causal LM it loads from local files; adds hf:dynamic, hf:quanto-int4+r128, ... caches)."),
        threads: Optional[int] = typer.Option(None, "--threads", min=1, help="torch CPU threads."),
        json_out: bool = typer.Option(False, "--json", help="Print one JSON record per cache (a JSON list) instead of the table."),
        out: Optional[Path] = typer.Option(None, "--out", help="Also write the JSON records to this file (rewritten as results arrive)."),
        plot: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG of quality against bits per value."),
        seeds: Optional[str] = typer.Option(None, "--seeds", help="Rotation seeds each TurboQuant cache runs with (default 0,1,2; --quick: 0)."),
    ):
        """Quality of compressed caches against the dense cache on Shakespeare (the ANCHORS.md protocol)."""
        from .run import EvalSettings, run_eval

        settings = EvalSettings.build(caches, quick, windows, passkey, passkey_lengths, model, threads, seeds=seeds,
                                      backend=backend, passkey_repeats=passkey_repeats, passkey_prime=passkey_prime,
                                      text=text)
        if out:
            check_writable(out, "--out")  # before the run: a typo must not cost the whole evaluation
        if plot:
            check_writable(plot, "--plot", PLOT_SUFFIXES)
        def save(records):  # rewritten as results arrive: an interrupted run keeps what it measured
            write_json(out, [r.to_json() for r in records], indent=1)

        records = run_eval(settings, console=None if json_out else console, checkpoint=save if out else None)
        if plot:
            from .plot import plot_quality

            plot_quality(records, plot)
        if json_out:
            print(json.dumps([r.to_json() for r in records]))
