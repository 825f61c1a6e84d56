"""`python -m kvlab.fuzz`: mutate model files, run kvlab on them, print what happened (`make fuzz`).

    python -m kvlab.fuzz --cases 300 --smollm2 14 --asan --json fuzz.json --save-corpus tests/fuzz_corpus
    python -m kvlab.fuzz --replay tests/fuzz_corpus          # the saved failures, again
    python -m kvlab.fuzz --case tiny-gguf:0:17                # one case, from its target, seed and index

Exit status: 0 when every step of every case ended ok or in a one-line error, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .mutate import Seeds, make_case
from .run import FuzzConfig, load_corpus, prepare, report_tables, run_canary, run_cases, save_corpus, write_json


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvlab.fuzz", description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=280, help="cases on the tiny GGUF and the tiny HF folder (half each)")
    p.add_argument("--smollm2", type=int, default=14, help="cases on the embedded SmolLM2 GGUF (100 MB, seconds each)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start", type=int, default=0, help="first case index")
    p.add_argument("--case", action="append", default=[], help="TARGET:SEED:INDEX, repeatable (instead of --cases)")
    p.add_argument("--replay", type=Path, help="run the descriptors saved in this folder instead")
    p.add_argument("--asan", action="store_true", help="kernel built with -fsanitize=address, libasan preloaded")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per step")
    p.add_argument("--rss-mb", type=int, default=2048)
    p.add_argument("--parallel", type=int, default=1, help="workers at once")
    p.add_argument("--json", type=Path, help="write every case's outcome here")
    p.add_argument("--save-corpus", type=Path, help="save a descriptor per distinct failure here")
    p.add_argument("--work-dir", type=Path, help="where mutated files are written (default: a temporary folder)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    console = Console(width=None if os.isatty(1) else 200)  # tables stay whole when piped to a log
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="kvlab-fuzz-"))
    cfg = FuzzConfig(work, asan=args.asan, step_timeout=args.timeout, rss_limit_mb=args.rss_mb, parallel=args.parallel)
    if args.replay:
        cases = load_corpus(args.replay)
    elif args.case:
        cases = [(target, int(seed), int(index)) for target, seed, index in (spec.split(":") for spec in args.case)]
    else:
        cases = [("tiny-gguf" if i % 2 == 0 else "tiny-hf", args.seed, i // 2)
                 for i in range(2 * args.start, 2 * args.start + args.cases)]
        cases += [("smollm2", args.seed, i) for i in range(args.start, args.start + args.smollm2)]
    seeds = Seeds.build(work / "seeds", with_smollm2=any(_target(c) == "smollm2" for c in cases))
    cases = [make_case(*c, seeds) if isinstance(c, tuple) else c for c in cases]

    facts = prepare(cfg)
    console.print(f"kernel: {facts['kernel']}  flags: {facts['flags']}", highlight=False)
    if args.asan:
        canary = run_canary(cfg)
        verdict = "caught" if canary["kind"] == "asan" else "NOT CAUGHT"
        console.print(f"ASan canary (a deliberate out-of-bounds write in blockgemv.c): {verdict}: {canary.get('message')}",
                      highlight=False)
        if canary["kind"] != "asan":
            return 1
    with Progress(TextColumn("fuzz"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("cases", total=len(cases))
        results = run_cases(cases, seeds, cfg, progress=lambda n: bar.update(task, completed=n))
    for table in report_tables(results):
        console.print(table)
    meta = {"seed": args.seed, "asan": args.asan, "kernel": facts}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_json(results, args.json, meta)
        console.print(f"wrote {args.json}")
    if args.save_corpus:
        written = save_corpus(results, args.save_corpus)
        console.print(f"saved {len(written)} descriptors to {args.save_corpus}")
    if not args.work_dir:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r.passed for r in results) else 1


def _target(case) -> str:
    return case[0] if isinstance(case, tuple) else case.target


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    raise SystemExit(main())
