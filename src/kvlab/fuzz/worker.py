"""The fuzz worker: `python -m kvlab.fuzz.worker JOBS.json RESULTS.jsonl START` runs jobs[START:] in this process.

A job is one step of one case: `info`, `plan`, `generate` (the real CLI commands, called in-process with
their output captured) or `api` (load_spec + load_model with dense weights + 4 tokens through an int8
cache), or `canary` (a deliberate out-of-bounds write in the kernel library, to prove AddressSanitizer
is live). Each job appends a "start" and an "end" line to RESULTS; a job that never ends took the process
down, and the runner (kvlab.fuzz.run) classifies it from the exit status and stderr, then restarts the
worker at the next job. faulthandler prints where a crash or a hang happened.
"""

from __future__ import annotations

import faulthandler
import gc
import io
import json
import sys
import time
import traceback
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

MEMORY_MESSAGES = ("can't allocate memory", "not enough memory", "out of memory", "std::bad_alloc")


def where(tb) -> dict:
    """The innermost frame inside kvlab (file:function:line) and the innermost frame of all."""
    frames = traceback.extract_tb(tb)
    ours = [f for f in frames if "/kvlab/" in f.filename and "/kvlab/fuzz/" not in f.filename]

    def fmt(f):
        path = f.filename.split("/src/", 1)[-1] if "/src/" in f.filename else f.filename
        return f"{path}:{f.name}:{f.lineno}"

    return {"where": fmt(ours[-1]) if ours else None, "innermost": fmt(frames[-1]) if frames else None}


def exception_record(exc: BaseException) -> dict:
    text = str(exc).strip().splitlines()
    message = text[0][:300] if text else ""
    memory = isinstance(exc, MemoryError) or any(m in str(exc) for m in MEMORY_MESSAGES)
    return {"kind": "memory" if memory else "traceback", "exception": type(exc).__name__, "message": message,
            **where(exc.__traceback__)}


def classify_exit(code, stderr: str) -> dict:
    """A CLI step that returned: ok, a one-line error, or an unclear error (no single `error:` line)."""
    if code in (0, None):
        return {"kind": "ok"}
    lines = [line for line in stderr.splitlines() if line.strip()]
    if "Traceback" in stderr or not lines or not lines[-1].startswith("error:"):
        return {"kind": "unclear-error", "exit": code, "message": " | ".join(lines[-3:])[:300]}
    return {"kind": "error", "exit": code, "message": lines[-1][:300]}


def run_cli(args: list[str]) -> dict:
    from ..cli import app

    out, err = io.StringIO(), io.StringIO()
    try:
        with redirect_stdout(out), redirect_stderr(err):
            code = app(args, prog_name="kvlab", standalone_mode=False)
    except SystemExit as exc:
        code = exc.code
    except Exception as exc:  # noqa: BLE001 - a traceback the user would see: that is the finding
        return exception_record(exc)
    return classify_exit(code, err.getvalue())


def run_api(path: str) -> dict:
    """The Python API a library user calls: load_spec, load_model (dense weights), 4 tokens through int8."""
    import torch

    from ..cache import CacheGeometry, make_cache
    from ..errors import KvlabError
    from ..generate import generate
    from ..model.loader import load_model
    from ..sources import load_spec

    try:
        load_spec(path)
        loaded = load_model(path, weights="dense")
        ids = loaded.tokenizer.encode("hi")
        geometry = CacheGeometry.for_model(loaded.config, batch=1, capacity=len(ids) + 4)
        kv = make_cache("int8", geometry, dtype=loaded.dtype, device=loaded.device)
        generate(loaded.model, torch.tensor([ids]), kv, 4, eos_ids=loaded.tokenizer.eos_ids)
    except (KvlabError, OSError) as exc:
        return {"kind": "error", "message": f"{type(exc).__name__}: {str(exc)[:300]}"}
    except Exception as exc:  # noqa: BLE001
        return exception_record(exc)
    return {"kind": "ok"}


def run_canary() -> dict:
    """Call the kernel's block GEMV with an output one float too short, bypassing the Python checks: an
    instrumented library must abort here with an AddressSanitizer report."""
    import torch

    from ..kernels import BLOCK_TYPES, block_kernel, kernel_status

    kernel = block_kernel()
    if kernel is None:
        return {"kind": "unclear-error", "message": f"no kernel to test: {kernel_status()}"}
    type_id, per_block, block_bytes = BLOCK_TYPES["Q4_1"]
    rows = 8
    blocks = torch.zeros(rows, block_bytes, dtype=torch.uint8)    # (rows, one block) of zeros
    x = torch.ones(per_block)                                     # (cols,)
    y = torch.empty(rows - 1)                                     # one row short: the write past the end
    kernel.lib.kvlab_block_gemv(type_id, blocks.data_ptr(), rows, per_block, x.data_ptr(), y.data_ptr(), 1)
    return {"kind": "ok", "message": "the out-of-bounds write went unnoticed"}


def run_job(job: dict) -> dict:
    path = job.get("path", "")
    step = job["step"]
    if step == "info":
        return run_cli(["info", path])
    if step == "plan":
        return run_cli(["plan", path])
    if step == "generate":
        return run_cli(["generate", "hi", "--model", path, "--max-new-tokens", "4", *(["--chat"] if job.get("chat") else [])])
    if step == "api":
        return run_api(path)
    if step == "canary":
        return run_canary()
    raise ValueError(f"unknown step {step!r}")


def kernel_facts() -> dict:
    from ..kernels import FLAGS, block_kernel, kernel_status

    block_kernel()
    return {"kernel": kernel_status(), "flags": " ".join(FLAGS)}


def main(jobs_file: str, results_file: str, start: int, step_timeout: float) -> None:
    jobs = json.loads(Path(jobs_file).read_text())
    faulthandler.enable()
    with open(results_file, "a", buffering=1) as results:
        results.write(json.dumps({"event": "worker", **kernel_facts()}) + "\n")
        previous_case = None
        for i in range(start, len(jobs)):
            job = jobs[i]
            if job["case"] != previous_case:  # a fresh model for every case
                from ..session import cached_model

                cached_model.cache_clear()
                gc.collect()
                previous_case = job["case"]
            sys.stderr.write(f"\n=== fuzz job {i} ===\n")
            sys.stderr.flush()
            results.write(json.dumps({"event": "start", "i": i, "t": time.time()}) + "\n")
            faulthandler.dump_traceback_later(step_timeout, exit=False)  # the runner kills a little later
            began = time.perf_counter()
            record = run_job(job)
            faulthandler.cancel_dump_traceback_later()
            record["seconds"] = round(time.perf_counter() - began, 3)
            results.write(json.dumps({"event": "end", "i": i, **record}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
