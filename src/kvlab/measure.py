"""Measuring on a shared machine and recording the result: threads, median timings, read bandwidth,
what the machine was, JSON files and matplotlib figures."""

from __future__ import annotations

import os
import platform
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch

from .limits import check_threads


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run with n intra-op threads (0: leave torch's choice), then restore the previous number.

    On a shared machine fewer threads than cores can be much faster: every parallel op waits for
    all its threads, and one descheduled thread stalls the op."""
    check_threads(n)
    before = torch.get_num_threads()
    if n > 0:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def median_time(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall seconds of `fn()` over `repeats` calls after `warmup` discarded calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def read_bandwidth_gb_s(mib: int = 256, repeats: int = 5) -> float:
    """Memory read bandwidth with the current threads: sum a `mib` MiB fp32 tensor (median of repeats)."""
    x = torch.ones(mib * 2**20 // 4)
    seconds = median_time(lambda: x.sum(), repeats, warmup=1)
    return x.nbytes / seconds / 1e9


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    """The machine a table was measured on (load average included: timings on a shared box are noisy)."""
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        mem_gib = None
    return {
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": mem_gib,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average": load,
    }


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_json(path: str | Path, payload) -> Path:
    """Indented JSON, written atomically (kvlab.fileio)."""
    from .fileio import write_json as write_atomically

    return write_atomically(path, payload, indent=2)
