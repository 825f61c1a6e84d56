"""Run fuzz cases in worker subprocesses under time and memory limits, and classify what happened.

Outcomes, best to worst: ok | error (a one-line `error:` / KvlabError) | unclear-error (non-zero exit without
one `error:` line) | traceback | hang (a step over the time limit) | memory (RSS over the limit, or an
allocation failure) | signal (the process died) | asan (an AddressSanitizer report). Only ok and error pass.

Cases run in batches: one worker process runs every step of every case of a batch (a Python import of
torch costs seconds; a tiny case milliseconds) and is restarted after the step that killed it.
With `asan=True` the worker loads a kernel library built with -fsanitize=address (KVLAB_KERNEL_SANITIZE)
and runs with libasan preloaded, since an instrumented library cannot be dlopen'ed into a plain CPython.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .mutate import Case, Seeds, materialize

SEVERITY = ("ok", "error", "unclear-error", "traceback", "hang", "memory", "signal", "asan")
PASSING = ("ok", "error")
STARTUP_TIMEOUT = 600.0  # a worker's imports, and the first (ASan) kernel build


class FuzzSetupError(RuntimeError):
    """The fuzzer cannot do what it was asked (e.g. no AddressSanitizer build): never a silent pass."""


@dataclass
class FuzzConfig:
    work_dir: Path
    asan: bool = False
    step_timeout: float = 60.0
    rss_limit_mb: int = 2048
    address_limit_mb: int = 6144   # RLIMIT_AS for plain runs (torch reserves ~1.5 GB of address space)
    parallel: int = 1
    batch_size: int = 8
    python: str = sys.executable


@dataclass
class CaseResult:
    case: Case
    steps: dict[str, dict] = field(default_factory=dict)

    @property
    def worst_step(self) -> str:
        return max(self.steps, key=lambda s: SEVERITY.index(self.steps[s]["kind"]))

    @property
    def kind(self) -> str:
        return self.steps[self.worst_step]["kind"] if self.steps else "ok"

    @property
    def passed(self) -> bool:
        return all(r["kind"] in PASSING for r in self.steps.values())

    def to_json(self) -> dict:
        return {"case": self.case.to_json(), "kind": self.kind, "worst_step": self.worst_step, "steps": self.steps}


# -- the worker's environment ----------------------------------------------------------------------------------

def asan_preload() -> str:
    """LD_PRELOAD for an instrumented kernel in CPython: the compiler's libasan, which must come first, and
    libstdc++, without which ASan's __cxa_throw interceptor aborts on torch's first C++ exception.
    FuzzSetupError when the compiler has no libasan."""
    compiler = shutil.which(os.environ.get("CC") or "cc")
    if compiler is None:
        raise FuzzSetupError("no C compiler: the AddressSanitizer kernel cannot be built")
    libs = []
    for name in ("libasan.so", "libstdc++.so"):
        found = subprocess.run([compiler, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
        if not found or not os.path.isabs(found) or not os.path.exists(found):
            raise FuzzSetupError(f"{compiler} has no {name} (-print-file-name gave {found!r})")
        libs.append(os.path.realpath(found))
    return ":".join(libs)


def worker_env(cfg: FuzzConfig) -> dict[str, str]:
    import kvlab
    from ..paths import cache_dir

    env = dict(os.environ)
    src = str(Path(kvlab.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    env.pop("KVLAB_NO_KERNEL", None)
    # converted weights of mutated files go to a throwaway cache; the kernel builds are shared
    cache = cfg.work_dir / "cache"
    (cache / "weights").mkdir(parents=True, exist_ok=True)
    kernels = cache_dir() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    if not (cache / "kernels").exists():
        (cache / "kernels").symlink_to(kernels.resolve(), target_is_directory=True)
    env["KVLAB_CACHE_DIR"] = str(cache)
    if cfg.asan:
        env["KVLAB_KERNEL_SANITIZE"] = "address"
        env["LD_PRELOAD"] = asan_preload()
        # leaks: CPython never frees everything; abort: faulthandler then prints the Python stack;
        # a failed huge allocation returns NULL like plain malloc (torch raises, the runner says "memory")
        env["ASAN_OPTIONS"] = "detect_leaks=0:abort_on_error=1:allocator_may_return_null=1:quarantine_size_mb=64"
    else:
        env.pop("KVLAB_KERNEL_SANITIZE", None)
    return env


def _limits(address_mb: int | None):
    def apply():
        os.setsid()  # the runner kills the whole group on a timeout
        if address_mb:
            limit = address_mb << 20
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return apply


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


# -- one worker over a list of jobs ----------------------------------------------------------------------------

def run_jobs(jobs: list[dict], cfg: FuzzConfig, folder: Path) -> tuple[list[dict], list[dict]]:
    """Each job's outcome (in order), restarting the worker after a job that ended it; and the workers' facts."""
    folder.mkdir(parents=True, exist_ok=True)
    jobs_file = folder / "jobs.json"
    jobs_file.write_text(json.dumps(jobs))
    outcomes: list[dict | None] = [None] * len(jobs)
    workers: list[dict] = []
    env = worker_env(cfg)
    start = 0
    while start < len(jobs):
        attempt = len(workers)
        results_file, stderr_file = folder / f"results-{attempt}.jsonl", folder / f"stderr-{attempt}.txt"
        with open(stderr_file, "wb") as err:
            proc = subprocess.Popen(
                [cfg.python, "-m", "kvlab.fuzz.worker", str(jobs_file), str(results_file), str(start), str(cfg.step_timeout)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=env,
                preexec_fn=_limits(None if cfg.asan else cfg.address_limit_mb))
            killed = _watch(proc, results_file, cfg)
        events = _read_events(results_file)
        worker = next((e for e in events if e.get("event") == "worker"), {"event": "worker", "kernel": "did not start"})
        workers.append(worker)
        ended = {e["i"]: e for e in events if e.get("event") == "end"}
        started = [e["i"] for e in events if e.get("event") == "start"]
        for i, record in ended.items():
            outcomes[i] = {k: v for k, v in record.items() if k not in ("event", "i")}
        dying = started[-1] if started and started[-1] not in ended else None
        if dying is None and proc.returncode == 0:
            break
        stderr = stderr_file.read_text(errors="replace")
        late = dying is None
        if late:  # died between jobs (a corrupted heap fails at the next free): blame the last job it ran
            if not ended:
                raise FuzzSetupError(f"fuzz worker failed to start (exit {proc.returncode}): {_tail(stderr)}")
            dying = max(ended)
        outcomes[dying] = death_record(proc.returncode, killed, _job_stderr(stderr, dying))
        if late:
            outcomes[dying]["message"] += " (after the step had ended)"
        start = dying + 1
    return [o or {"kind": "ok"} for o in outcomes], workers


def _watch(proc: subprocess.Popen, results_file: Path, cfg: FuzzConfig) -> str | None:
    """Poll until the worker exits; kill it (and its group) on a step over time or RSS over the limit."""
    step_started, limit = time.time(), STARTUP_TIMEOUT  # the first event comes after imports (and a kernel build)
    seen = 0
    while proc.poll() is None:
        time.sleep(0.05)
        try:
            size = results_file.stat().st_size
        except OSError:
            size = 0
        if size != seen:
            seen, step_started, limit = size, time.time(), cfg.step_timeout + 3
        reason = None
        if time.time() - step_started > limit:
            reason = "hang"
        elif _rss_mb(proc.pid) > cfg.rss_limit_mb:
            reason = "memory"
        if reason:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            return reason
    return None


def _read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    events = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut by the kill
    return events


def _job_stderr(stderr: str, i: int) -> str:
    marker = f"=== fuzz job {i} ==="
    return stderr.split(marker, 1)[1] if marker in stderr else stderr


def _tail(text: str, n: int = 3) -> str:
    return " | ".join([line for line in text.splitlines() if line.strip()][-n:])[:400]


_ASAN_MEMORY = ("requested allocation size", "allocation-size-too-big", "out-of-memory", "rss-limit-exceeded",
                "allocator is out of memory")
_PY_FRAME = re.compile(r'File "([^"]+)", line (\d+) in (\S+)')
_C_FRAME = re.compile(r"#\d+ 0x[0-9a-f]+ in (\S+) (\S+)")


def death_record(returncode: int, killed: str | None, stderr: str) -> dict:
    """What killed a worker in the middle of a job: the runner's limits, AddressSanitizer, or a signal."""
    record = {"python_where": _python_where(stderr)}
    if "ERROR: AddressSanitizer" in stderr:
        summary = next((line for line in stderr.splitlines() if line.startswith("SUMMARY: AddressSanitizer")), "")
        frames = _C_FRAME.findall(stderr.split("ERROR: AddressSanitizer", 1)[1])
        kind = "memory" if any(m in stderr for m in _ASAN_MEMORY) else "asan"
        record.update(kind=kind, message=summary[:300], where=" <- ".join(f"{fn} {loc.strip('()').rsplit('/', 1)[-1]}" for fn, loc in frames[:3]))
    elif killed == "hang":
        record.update(kind="hang", message="step ran past the time limit (the stack is where it was)")
    elif killed == "memory":
        record.update(kind="memory", message="RSS went past the limit")
    else:
        name = signal.Signals(-returncode).name if returncode < 0 and -returncode in signal.valid_signals() else f"exit {returncode}"
        fatal = next((line for line in stderr.splitlines() if line.startswith("Fatal Python error")), "")
        record.update(kind="signal", message=f"{name} {fatal}".strip()[:300])
    record["where"] = record.get("where") or record["python_where"]
    return record


def _python_where(stderr: str) -> str | None:
    """The innermost kvlab frame of faulthandler's dump (it lists the most recent call first)."""
    dump = stderr.split("Current thread", 1)[-1] if "Current thread" in stderr else stderr.split("Thread 0x", 1)[-1]
    for path, line, fn in _PY_FRAME.findall(dump):
        if "/kvlab/" in path and "/kvlab/fuzz/" not in path:
            return f"{path.split('/src/', 1)[-1]}:{fn}:{line}"
    return None


# -- cases -------------------------------------------------------------------------------------------------------

def run_cases(cases: list[Case], seeds: Seeds, cfg: FuzzConfig, progress=None) -> list[CaseResult]:
    """Every case's outcome; `progress(n_done)` is called as batches finish."""
    cfg.work_dir.mkdir(parents=True, exist_ok=True)
    batches, batch, weight = [], [], 0
    for case in cases:  # SmolLM2 cases (100 MB files, seconds to load) run one per batch
        cost = cfg.batch_size if case.target == "smollm2" else 1
        if batch and weight + cost > cfg.batch_size:
            batches.append(batch)
            batch, weight = [], 0
        batch.append(case)
        weight += cost
    if batch:
        batches.append(batch)
    done = [0]
    lock = threading.Lock()

    def one(numbered):
        number, batch = numbered
        results = run_batch(batch, seeds, cfg, cfg.work_dir / f"batch-{number}")
        with lock:
            done[0] += len(batch)
            if progress:
                progress(done[0])
        return results

    with ThreadPoolExecutor(max_workers=max(1, cfg.parallel)) as pool:
        return [r for rs in pool.map(one, enumerate(batches)) for r in rs]


def run_batch(cases: list[Case], seeds: Seeds, cfg: FuzzConfig, folder: Path) -> list[CaseResult]:
    folder.mkdir(parents=True, exist_ok=True)
    jobs, results = [], [CaseResult(case) for case in cases]
    try:
        for n, case in enumerate(cases):
            path = materialize(case, seeds, folder / f"case-{n}")
            jobs += [{"case": n, "step": step, "path": str(path), "chat": case.chat} for step in case.steps]
        outcomes, workers = run_jobs(jobs, cfg, folder)
        if cfg.asan:
            require_asan_kernel(workers)
        for job, outcome in zip(jobs, outcomes):
            results[job["case"]].steps[job["step"]] = outcome
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return results


def require_asan_kernel(workers: list[dict]) -> None:
    """An ASan run whose worker fell back to dense weights would report nothing and mean nothing."""
    for worker in workers:
        if "-fsanitize=address" not in worker.get("flags", "") or not worker.get("kernel", "").startswith("loaded"):
            raise FuzzSetupError(f"the AddressSanitizer kernel did not load: {worker.get('kernel')} (flags {worker.get('flags')})")


def prepare(cfg: FuzzConfig) -> dict:
    """Start one worker with no jobs: imports, and the kernel build (instrumented with asan=True), happen here
    once instead of inside the first case's time limit. Returns the worker's kernel facts."""
    folder = Path(tempfile.mkdtemp(prefix="prepare-", dir=_work(cfg)))
    try:
        (folder / "jobs.json").write_text("[]")
        with open(folder / "stderr.txt", "wb") as err:
            run = subprocess.run([cfg.python, "-m", "kvlab.fuzz.worker", str(folder / "jobs.json"), str(folder / "results.jsonl"),
                                  "0", str(cfg.step_timeout)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                 env=worker_env(cfg), timeout=STARTUP_TIMEOUT)
        facts = next((e for e in _read_events(folder / "results.jsonl") if e.get("event") == "worker"), None)
        if run.returncode != 0 or facts is None:
            raise FuzzSetupError(f"fuzz worker failed to start (exit {run.returncode}): "
                                 f"{_tail((folder / 'stderr.txt').read_text(errors='replace'))}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if cfg.asan:
        require_asan_kernel([facts])
    return facts


def _work(cfg: FuzzConfig) -> Path:
    cfg.work_dir.mkdir(parents=True, exist_ok=True)
    return cfg.work_dir


def run_canary(cfg: FuzzConfig) -> dict:
    """The deliberate out-of-bounds write (kvlab.fuzz.worker.run_canary) in an ASan worker: must come back 'asan'."""
    folder = Path(tempfile.mkdtemp(prefix="canary-", dir=_work(cfg)))
    try:
        outcomes, workers = run_jobs([{"case": 0, "step": "canary"}], cfg, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if cfg.asan:
        require_asan_kernel(workers)
    return outcomes[0]


# -- reports -----------------------------------------------------------------------------------------------------

def signature(result: CaseResult) -> tuple:
    """What makes two failures the same bug: kind, step, exception type and where it came from."""
    step = result.worst_step
    r = result.steps[step]
    return (result.case.target.replace("tiny-gguf", "gguf").replace("smollm2", "gguf"), result.kind, step,
            r.get("exception"), r.get("where"))


def save_corpus(results: list[CaseResult], folder: Path, per_signature: int = 1) -> list[Path]:
    """Descriptors (edits, not files) of failing cases, `per_signature` per distinct failure."""
    folder.mkdir(parents=True, exist_ok=True)
    counts: dict[tuple, int] = {}
    written = []
    for result in sorted(results, key=lambda r: (r.case.target != "tiny-gguf", r.case.target, r.case.index or 0)):
        if result.passed:
            continue
        sig = signature(result)
        counts[sig] = counts.get(sig, 0) + 1
        if counts[sig] > per_signature:
            continue
        case = result.case
        path = folder / f"{case.target}-{case.kind}-s{case.seed}-i{case.index}.json"
        step = result.worst_step
        found = {"kind": result.kind, "step": step, **{k: result.steps[step].get(k) for k in ("exception", "message", "where")}}
        path.write_text(json.dumps({**case.to_json(), "found": found}, indent=1) + "\n")
        written.append(path)
    return written


def load_corpus(folder: Path) -> list[Case]:
    return [Case.from_json(json.loads(p.read_text())) for p in sorted(folder.glob("*.json"))]


def write_json(results: list[CaseResult], path: Path, meta: dict) -> None:
    counts: dict[str, int] = {}
    for r in results:
        counts[r.kind] = counts.get(r.kind, 0) + 1
    doc = {**meta, "counts": counts, "cases": [r.to_json() for r in results]}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def report_tables(results: list[CaseResult], worst: int = 25):
    """Rich tables: outcomes per target and mutation kind, then the worst cases with what replays them."""
    from rich.table import Table

    kinds = [k for k in SEVERITY if any(r.kind == k for r in results)]
    counts = Table(title="fuzz outcomes (worst step per case)")
    counts.add_column("target")
    counts.add_column("mutation")
    for k in kinds:
        counts.add_column(k, justify="right")
    groups: dict[tuple[str, str], dict[str, int]] = {}
    for r in results:
        row = groups.setdefault((r.case.target, r.case.kind), {})
        row[r.kind] = row.get(r.kind, 0) + 1
    for (target, kind), row in sorted(groups.items()):
        counts.add_row(target, kind, *[str(row.get(k, "")) for k in kinds])
    totals = {k: sum(1 for r in results if r.kind == k) for k in kinds}
    counts.add_row("[bold]all", "", *[f"[bold]{totals[k]}" for k in kinds])

    bad = sorted((r for r in results if not r.passed), key=lambda r: -SEVERITY.index(r.kind))
    seen, shown = set(), []
    for r in bad:  # one row per distinct failure first
        if signature(r) not in seen:
            seen.add(signature(r))
            shown.append(r)
    table = Table(title=f"worst cases ({len(bad)} failing, {len(seen)} distinct; replay: seed, index)")
    for col in ("kind", "target", "seed", "index", "mutation", "step", "what", "where"):
        table.add_column(col, overflow="fold")
    for r in shown[:worst]:
        s = r.steps[r.worst_step]
        what = " ".join(filter(None, [s.get("exception"), s.get("message")]))[:90]
        table.add_row(r.kind, r.case.target, str(r.case.seed), str(r.case.index), r.case.label[:60], r.worst_step, what,
                      str(s.get("where") or ""))
    return counts, table
