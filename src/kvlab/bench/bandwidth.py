"""The machine's memory-read bandwidth: the ceiling for batch-1 decode, which reads every weight each step."""

from __future__ import annotations

import time

import torch


def measure_read_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Best-of-`repeats` bytes/s of summing a buffer far larger than the caches (a streaming read)."""
    buffer = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    buffer.sum()  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.nbytes / best
