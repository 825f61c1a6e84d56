"""Several rows against one block matrix: the block GEMM kernel against dequantize + F.linear, by row count.

    .venv/bin/python bench/block_gemm.py      # writes bench/results/block_gemm.json

The rows are what a multi-row forward multiplies: a batched decode step (one row per running sequence,
4-32) or a prefill chunk (hundreds). SmolLM2's gate|up matrix (3072×576, Q4_1) through BlockQuantLinear,
1 thread, the two paths interleaved in each repeat; the table gives the median ms per call and the ratio.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from block_gemv import random_q4_1  # noqa: E402

from kvlab.fileio import write_json  # noqa: E402
from kvlab.kernels import block_kernel, kernel_status  # noqa: E402
from kvlab.model.blockquant import BlockMatrix, BlockQuantLinear  # noqa: E402

OUT = ROOT / "bench" / "results" / "block_gemm.json"
ROWS = (2, 4, 8, 16, 32, 64, 128, 256, 512)
REPEATS = 7


def ms_per_call(linear: BlockQuantLinear, x: torch.Tensor, reference: bool) -> float:
    """CPU milliseconds per forward (this process's CPU time, 1 thread: a busy machine's time slicing does not count),
    over enough calls for ~0.1 s; `reference` selects dequantize + F.linear."""
    if reference:
        os.environ["KVLAB_NO_GEMM"] = "1"
    try:
        linear(x)                                                            # warm-up
        calls, start = 0, time.process_time()
        while time.process_time() - start < 0.1:
            linear(x)
            calls += 1
        return (time.process_time() - start) / calls * 1e3
    finally:
        os.environ.pop("KVLAB_NO_GEMM", None)


def main() -> None:
    if block_kernel() is None:
        raise SystemExit(f"no block kernel: {kernel_status()}")
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    linear = BlockQuantLinear(BlockMatrix("Q4_1", random_q4_1(3072, 576, gen), 576))
    results = []
    print(f"{'rows':>5} {'block GEMM ms':>14} {'dequantize ms':>14} {'ratio':>6}")
    for rows in ROWS:
        x = torch.randn(rows, 576, generator=gen)                            # (rows, 576)
        gemm, ref = [], []
        for _ in range(REPEATS):                                             # interleaved
            gemm.append(ms_per_call(linear, x, reference=False))
            ref.append(ms_per_call(linear, x, reference=True))
        g, r = statistics.median(gemm), statistics.median(ref)
        results.append({"rows": rows, "block_gemm_ms": round(g, 4), "dequantize_linear_ms": round(r, 4),
                        "speedup": round(r / g, 3)})
        print(f"{rows:>5} {g:>14.3f} {r:>14.3f} {r / g:>6.2f}")
    write_json(OUT, {"what": __doc__.splitlines()[0], "threads": 1, "matrix": "3072x576 Q4_1", "repeats": REPEATS,
                     "statistic": "median", "load_average": list(os.getloadavg()[:2]), "rows": results}, indent=1)


if __name__ == "__main__":
    main()
