"""Prompt prefill on SmolLM2 (native Q4_1 weights, fp32, 1 thread): the block GEMM kernel against the path it
replaced (dequantize each whole matrix to fp32, then F.linear; KVLAB_NO_GEMM=1), and the peak RSS a user sees.
A third path is the opt-in int8 activations (weights="native-q8", kernels/q8gemm.c; not exact).

    .venv/bin/python bench/prefill.py [--repeats 3] [--lengths 512,2048,4000] [--out FILE]   # bench/results/prefill.json

Speed: prompts of 512 / 2,048 / 4,000 random token ids, each prefilled into a fresh dense cache by
kvlab.generate.prefill (its default chunking, the same for both paths); the two paths alternate, `repeats`
times, and the table shows the median tokens/s. Memory: a fresh Python process per row loads the model,
prefills a 4,000-token prompt and decodes 64 tokens at 1 thread, then reports its peak RSS and where
it went, phase by phase (import torch, import kvlab, load, make the cache, prefill, decode: the RSS after each
and the peak during each): with the GEMM (a dense fp32 cache, and a dense-f16 one: f16 K/V, what llama.cpp
stores), with the dequantize path, with the GEMM and the prompt in one pass (chunk = prompt), and with int8
activations. On a shared machine the times are noisy: the load average is recorded next to them.

    .venv/bin/python bench/prefill.py --memory-only [--memory-cases gemm,f16] [--llama-cpp PYTHON] [--src DIR]
                                                                             # writes bench/results/prefill_memory.json

The memory rows alone (RSS does not depend on timing). `--llama-cpp PYTHON` (an interpreter with
llama-cpp-python, as for `kvlab bench decode`) adds llama.cpp's row for the same run: the same GGUF and the
same 4,000 token ids, f16 K/V, n_ctx = 4,064, 64 greedy tokens, 1 thread (through bench's llama_worker), and
each kvlab row's peak as a multiple of it.

    .venv/bin/python bench/prefill.py --caches dense,int8,int4,tq4,tq4+prerope [--tokens 8000] [--src DIR]
                                                                             # writes bench/results/prefill_caches.json

Caches: a fresh process per cache (1 thread) loads the model, takes the first `tokens` tokens of the Shakespeare
evaluation text, prefills them (kvlab.generate.prefill, its default chunking) into a new cache of that name
made as `kvlab generate --cache` makes it, and reports the prefill's seconds (wall clock, and the process's CPU
time: the steadier of the two on a busy machine, one thread) and the process's peak RSS (and
the prefill's own peak: the high-water mark over the RSS before it, reset by /proc/self/clear_refs); each cache's
time and peaks are also given as ratios to the dense cache's.
`--src` runs another checkout's kvlab (its src folder) for a before/after comparison (--caches, --memory-only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

OUT = ROOT / "bench" / "results" / "prefill.json"
MEMORY_OUT = ROOT / "bench" / "results" / "prefill_memory.json"
MEMORY_TITLE = "peak RSS of a fresh process: load, 4,000-token prompt, 64 new tokens, 1 thread"
PATHS = {"block GEMM": "", "dequantize + F.linear": "1", "int8 activations": ""}    # value of KVLAB_NO_GEMM
INT8 = "int8 activations"                                   # the path run with set_activations(model, "int8")
# The memory run (a fresh process per row): peak RSS by phase. After each phase: the RSS now and the peak
# during the phase (VmHWM, whose high-water mark /proc/self/clear_refs resets to the current RSS). The process's
# peak is the largest phase peak: after a reset ru_maxrss reports only the peak since then, like VmHWM.
PHASES = """
import json, sys
def status_mib(field):
    line = next(l for l in open("/proc/self/status") if l.startswith(field + ":"))
    return round(int(line.split()[1]) / 1024, 1)
phases = []
def mark(phase):
    phases.append({"phase": phase, "rss_mib": status_mib("VmRSS"), "peak_mib": status_mib("VmHWM")})
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
mark("python")
"""
MEMORY_RUN = PHASES + """
import torch
mark("import torch")
torch.set_num_threads(1)
from kvlab.session import cached_model
from kvlab.cache import CacheGeometry, make_cache
from kvlab.generate import generate_stream
mark("import kvlab")
HEAVY = ("transformers", "matplotlib", "scipy", "sympy", "pandas", "numpy", "rich", "typer", "gguf", "tokenizers", "jinja2")
heavy = [name for name in HEAVY if name in sys.modules]
loaded = cached_model(None, weights=sys.argv[2])
mark("load model + tokenizer")
prompt, new, chunk, cache_name = 4000, 64, int(sys.argv[1]) or None, sys.argv[3]
ids = torch.randint(0, loaded.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
cache = make_cache(cache_name, CacheGeometry.for_model(loaded.config, 1, prompt + new), dtype=torch.float32)
mark("make cache")
steps = generate_stream(loaded.model, ids, cache, new, chunk_size=chunk)
tokens = [next(steps)]
mark("prefill 4,000 tokens")
tokens += list(steps)
mark(f"decode {new} tokens")
print(json.dumps({"peak_rss_mib": round(max(p["peak_mib"] for p in phases)), "new_tokens": len(tokens),
                  "weights": loaded.weights, "cache": cache_name, "cache_mib": round(cache.nbytes / 2**20, 1),
                  "modules_after_import": heavy, "phases": phases}))
"""
# The same run in llama.cpp (llama-cpp-python in another interpreter, through bench's llama_worker.Worker):
# load with f16 K/V, prefill the same 4,000 ids, 64 greedy tokens, 1 thread. argv[1]: llama_worker.py's folder.
LLAMA_MEMORY_RUN = PHASES + """
sys.path.insert(0, sys.argv[1])
request = json.loads(sys.stdin.read())
from llama_worker import Worker
mark("import llama_cpp")
worker = Worker()
worker.load(request["model"], request["n_ctx"], 1, "f16")
mark("load model + tokenizer")
token = worker.prefill(request["tokens"])["token"]
mark("prefill 4,000 tokens")
worker.steps(token, request["new"] - 1)
mark(f"decode {request['new']} tokens")
print(json.dumps({"peak_rss_mib": round(max(p["peak_mib"] for p in phases)), "new_tokens": request["new"],
                  "n_ctx": worker.llm.n_ctx(), "phases": phases}))
"""
# key -> (case, KVLAB_NO_GEMM, chunk (0: the default), cache, weights)
MEMORY_CASES = {"gemm": ("block GEMM", "", 0, "dense", "native"),
                "f16": ("block GEMM, dense-f16 cache", "", 0, "dense-f16", "native"),
                "dequant": ("dequantize + F.linear", "1", 0, "dense", "native"),
                "one-pass": ("block GEMM, prompt in one pass", "", 4000, "dense", "native"),
                "int8": ("int8 activations (native-q8)", "", 0, "dense", "native-q8")}
LLAMA_CASE = "llama.cpp (f16 K/V)"
CACHES_OUT = ROOT / "bench" / "results" / "prefill_caches.json"
CACHE_RUN = """
import json, resource, sys, time, torch
torch.set_num_threads(1)
from kvlab.backends import load_runtime
from kvlab.quality.corpus import corpus_text
from kvlab.generate import prefill
name, tokens = sys.argv[1], int(sys.argv[2])
engine = load_runtime("kvlab", None)
loaded = engine.loaded
ids = loaded.tokenizer.encode(corpus_text(), add_special=False)[:tokens]
def status_mib(field):
    line = next(l for l in open("/proc/self/status") if l.startswith(field + ":"))
    return int(line.split()[1]) / 1024
load_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
before = status_mib("VmRSS")
with open("/proc/self/clear_refs", "w") as f:   # the high-water mark from here on: the prefill's own peak
    f.write("5")
cache = engine.make_cache(name, len(ids))
start, cpu_start = time.perf_counter(), time.process_time()
prefill(loaded.model, torch.tensor([ids]), cache)
seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
print(json.dumps({"cache": getattr(cache, "name", name), "prompt_tokens": len(ids), "seconds": round(seconds, 2),
                  "cpu_seconds": round(cpu_seconds, 2),
                  "peak_rss_mib": round(max(load_peak, status_mib("VmHWM"))),   # ru_maxrss restarts at the reset too
                  "load_peak_rss_mib": round(load_peak), "rss_before_prefill_mib": round(before),
                  "prefill_peak_mib": round(status_mib("VmHWM") - before), "cache_mib": round(cache.nbytes / 2**20, 1),
                  "weights": loaded.weights}))
"""


def prefill_seconds(loaded, n_tokens: int, no_gemm: str, activations: str = "fp32") -> float:
    from kvlab.cache import CacheGeometry, make_cache
    from kvlab.generate import prefill
    from kvlab.model.blockquant import set_activations

    os.environ["KVLAB_NO_GEMM"] = no_gemm
    set_activations(loaded.model, activations)
    ids = torch.randint(0, loaded.config.vocab_size, (1, n_tokens), generator=torch.Generator().manual_seed(n_tokens))
    cache = make_cache("dense", CacheGeometry.for_model(loaded.config, 1, n_tokens), dtype=torch.float32)
    start = time.perf_counter()
    prefill(loaded.model, ids, cache)
    seconds = time.perf_counter() - start
    set_activations(loaded.model, "fp32")
    return seconds


def memory_run(no_gemm: str, chunk: int, weights: str = "native", cache: str = "dense", src: Path = ROOT / "src") -> dict:
    """One fresh process running kvlab from `src`: load, a 4,000-token prompt, 64 new tokens at 1 thread; its peak
    RSS and phases."""
    env = dict(os.environ, PYTHONPATH=str(src), KVLAB_NO_GEMM=no_gemm, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-c", MEMORY_RUN, str(chunk), weights, cache], env=env, capture_output=True,
                         text=True, timeout=1800)
    if run.returncode != 0:
        sys.exit(f"memory run failed: {(run.stderr or run.stdout).strip().splitlines()[-1]}")
    result = json.loads(run.stdout.strip().splitlines()[-1])
    if result["weights"] not in ("native", "native-q8"):
        sys.exit(f"memory run used {result['weights']} weights, not native: no block kernel here?")
    return result


def llama_memory_run(python: str, new: int = 64) -> dict:
    """The same run in llama.cpp (f16 K/V, n_ctx = prompt + new tokens, 1 thread), in interpreter `python`."""
    from kvlab.bench.llama_peer import WORKER, check_python, peer_environment
    from kvlab.model.loader import default_model_path
    from kvlab.sources import load_spec

    from kvlab.errors import KvlabError

    try:
        check_python(python)
    except KvlabError as exc:
        sys.exit(str(exc))
    path = default_model_path()
    vocab = load_spec(str(path)).vocab_size  # the ids are the kvlab run's (torch.randint, seed 0)
    ids = torch.randint(0, vocab, (1, 4000), generator=torch.Generator().manual_seed(0))[0].tolist()
    request = {"model": str(path), "n_ctx": len(ids) + new, "tokens": ids, "new": new}
    env = dict(peer_environment(), OMP_NUM_THREADS="1")
    run = subprocess.run([python, "-c", LLAMA_MEMORY_RUN, str(WORKER.parent)], input=json.dumps(request), env=env,
                         capture_output=True, text=True, timeout=1800)
    if run.returncode != 0:
        sys.exit(f"llama.cpp memory run failed: {(run.stderr or run.stdout).strip().splitlines()[-1]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def memory_table(llama_python: str | None, src: Path = ROOT / "src", cases: list[str] | None = None) -> list[dict]:
    """The memory rows: the MEMORY_CASES named in `cases` (default all) and llama.cpp's when `llama_python` is given,
    each with its peak by phase; printed as they come."""
    rows = []
    for key in MEMORY_CASES if cases is None else cases:
        name, no_gemm, chunk, cache, weights = MEMORY_CASES[key]
        result = memory_run(no_gemm, chunk, weights, cache, src)
        rows.append({"case": name, "prompt_tokens": 4000, **result})
        print_memory_row(rows[-1])
    if llama_python:
        rows.append({"case": LLAMA_CASE, "prompt_tokens": 4000, **llama_memory_run(llama_python)})
        print_memory_row(rows[-1])
        for row in rows[:-1]:
            row["peak_vs_llama_cpp"] = round(row["peak_rss_mib"] / rows[-1]["peak_rss_mib"], 2)
    return rows


def print_memory_row(row: dict) -> None:
    """One case: its peak, then each phase's RSS after it and peak during it (MiB)."""
    extra = f" (cache {row['cache_mib']} MiB)" if "cache_mib" in row else f" (n_ctx {row.get('n_ctx')})"
    print(f"  {row['case']:<34} {row['peak_rss_mib']:>5} MiB peak{extra}", flush=True)
    for phase in row.get("phases", []):
        print(f"      {phase['phase']:<26} RSS after {phase['rss_mib']:>7.1f}   peak during {phase['peak_mib']:>7.1f}")
    if row.get("modules_after_import"):
        print(f"      modules after import kvlab: {', '.join(row['modules_after_import'])}")


def cache_prefill(name: str, tokens: int, src: Path) -> dict:
    """One fresh process (1 thread): `tokens` tokens of Shakespeare prefilled into cache `name`; its seconds and RSS."""
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-c", CACHE_RUN, name, str(tokens)], env=env, capture_output=True, text=True, timeout=3600)
    if run.returncode != 0:
        sys.exit(f"prefill of {name} failed: {(run.stderr or run.stdout).strip().splitlines()[-1]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def compare_caches(names: list[str], tokens: int, src: Path, out: Path = CACHES_OUT) -> None:
    """The --caches table: each cache's prefill time and peak RSS, and their ratios to the dense cache's."""
    load_before = os.getloadavg()[0]
    rows = []
    for name in names:
        rows.append(cache_prefill(name, tokens, src))
        print(f"  {rows[-1]['cache']:<14} {rows[-1]['seconds']:>8.1f} s ({rows[-1]['cpu_seconds']:.1f} s CPU) "
              f"{rows[-1]['peak_rss_mib']:>6} MiB peak", flush=True)
    dense = next((r for r in rows if r["cache"] == "dense"), None)
    for row in rows:
        if dense is not None:
            row["time_vs_dense"] = round(row["seconds"] / dense["seconds"], 2)
            row["cpu_time_vs_dense"] = round(row["cpu_seconds"] / dense["cpu_seconds"], 2)
            row["peak_rss_vs_dense"] = round(row["peak_rss_mib"] / dense["peak_rss_mib"], 2)
            row["prefill_peak_vs_dense"] = round(row["prefill_peak_mib"] / max(dense["prefill_peak_mib"], 1), 2)
    record = {"threads": 1, "src": str(src), "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
              "cpu_count": os.cpu_count(), "caches": rows,
              "note": "one fresh process per cache, one run each (a smoke measurement on a shared machine: times are noisy)"}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"{'cache':<14} {'seconds':>8} {'x dense':>8} {'CPU s':>8} {'x dense':>8} {'peak MiB':>9} {'x dense':>8} "
          f"{'prefill MiB':>12} {'x dense':>8}")
    for row in rows:
        print(f"{row['cache']:<14} {row['seconds']:>8.1f} {row.get('time_vs_dense', float('nan')):>8.2f} "
              f"{row['cpu_seconds']:>8.1f} {row.get('cpu_time_vs_dense', float('nan')):>8.2f} "
              f"{row['peak_rss_mib']:>9} {row.get('peak_rss_vs_dense', float('nan')):>8.2f} "
              f"{row['prefill_peak_mib']:>12} {row.get('prefill_peak_vs_dense', float('nan')):>8.2f}")
    print(f"wrote {out}")


def memory_only(llama_python: str | None, out: Path, src: Path, cases: list[str] | None) -> None:
    """--memory-only: the memory rows alone (RSS does not depend on timing: fine on a busy machine)."""
    print(MEMORY_TITLE)
    record = {"threads": 1, "prompt_tokens": 4000, "new_tokens": 64, "src": str(src),
              "memory": memory_table(llama_python, src, cases),
              "note": "peak RSS of a fresh process per row (the largest phase peak); phases: RSS after, and VmHWM during "
                      "(reset by clear_refs)"}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lengths", default="512,2048,4000")
    parser.add_argument("--skip-memory", action="store_true", help="only the speed table (a quick smoke run)")
    parser.add_argument("--caches", help="instead: prefill time and peak RSS per cache, e.g. dense,int8,int4,tq4,tq4+prerope")
    parser.add_argument("--tokens", type=int, default=8000, help="with --caches: prompt tokens of Shakespeare (default 8000)")
    parser.add_argument("--src", type=Path, default=ROOT / "src", help="with --caches or --memory-only: the kvlab source folder to run")
    parser.add_argument("--memory-only", action="store_true", help=f"only the memory rows (written to {MEMORY_OUT.name})")
    parser.add_argument("--memory-cases", help=f"with --memory-only: which rows, of {','.join(MEMORY_CASES)} (default all)")
    parser.add_argument("--llama-cpp", metavar="PYTHON", help="a Python with llama-cpp-python: add llama.cpp's peak (f16 K/V) "
                        "for the same run as a memory row")
    parser.add_argument("--out", type=Path, help=f"the JSON file written (default {OUT.name}; with --caches {CACHES_OUT.name})")
    args = parser.parse_args()
    if args.memory_only:
        cases = None if args.memory_cases is None else [key.strip() for key in args.memory_cases.split(",") if key.strip()]
        unknown = sorted(set(cases or ()) - set(MEMORY_CASES))
        if unknown:
            sys.exit(f"unknown memory case {', '.join(unknown)}; choose from {', '.join(MEMORY_CASES)}")
        memory_only(args.llama_cpp, args.out or MEMORY_OUT, args.src.resolve(), cases)
        return
    if args.caches:
        compare_caches([name.strip() for name in args.caches.split(",") if name.strip()], args.tokens, args.src.resolve(), args.out or CACHES_OUT)
        return
    out = args.out or OUT
    lengths = [int(n) for n in args.lengths.split(",")]
    torch.set_num_threads(1)
    from kvlab.kernels import block_kernel, kernel_status
    from kvlab.session import cached_model

    if block_kernel() is None:
        sys.exit(f"no block kernel: {kernel_status()}")
    loaded = cached_model(None)
    load_before = os.getloadavg()[0]
    seconds: dict[tuple[int, str], list[float]] = {(n, p): [] for n in lengths for p in PATHS}
    for n in lengths:
        prefill_seconds(loaded, min(n, 64), "")                               # warm-up
        for _ in range(args.repeats):
            for path, no_gemm in PATHS.items():                               # interleaved
                seconds[(n, path)].append(prefill_seconds(loaded, n, no_gemm, "int8" if path == INT8 else "fp32"))
    os.environ.pop("KVLAB_NO_GEMM", None)
    speed = []
    for n in lengths:
        rates = {p: n / statistics.median(seconds[(n, p)]) for p in PATHS}
        speed.append({"prompt_tokens": n, **{f"{p} tokens/s": round(r, 1) for p, r in rates.items()},
                      "speedup": round(rates["block GEMM"] / rates["dequantize + F.linear"], 3),
                      "int8_speedup": round(rates[INT8] / rates["block GEMM"], 3),
                      "seconds": {p: [round(s, 3) for s in seconds[(n, p)]] for p in PATHS}})
    if not args.skip_memory:
        print(MEMORY_TITLE)
    memory = [] if args.skip_memory else memory_table(args.llama_cpp)
    record = {"model": loaded.path.name, "threads": 1, "repeats": args.repeats, "statistic": "median",
              "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)], "cpu_count": os.cpu_count(),
              "prefill": speed, "memory": memory,
              "note": "shared machine: other processes ran during the measurement; times are noisy"}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"prefill, 1 thread, median of {args.repeats} (load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}; noisy)")
    print(f"{'prompt':>7} {'GEMM tok/s':>11} {'dequant tok/s':>14} {'speedup':>8} {'int8 tok/s':>11} {'int8/GEMM':>10}")
    for row in speed:
        print(f"{row['prompt_tokens']:>7} {row['block GEMM tokens/s']:>11.1f} {row['dequantize + F.linear tokens/s']:>14.1f} "
              f"{row['speedup']:>7.2f}× {row[INT8 + ' tokens/s']:>11.1f} {row['int8_speedup']:>9.2f}×")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
