"""Several rows against one block matrix: the block GEMM kernel, dequantize + F.linear and int8 activations, by row count.

    .venv/bin/python bench/block_gemm.py                  # writes bench/results/block_gemm.json
    .venv/bin/python bench/block_gemm.py --out FILE       # elsewhere (a smoke run on a busy machine)

The rows are what a multi-row forward multiplies: a batched decode step (one row per running sequence,
4-32) or a prefill chunk (hundreds). SmolLM2's gate|up matrix (3072×576, Q4_1), 1 thread, the paths
interleaved in each repeat: the block GEMM kernel (kernels/blockgemm.c, fp32 activations; one row: the GEMV's
row dot), dequantize + F.linear (what BlockQuantLinear does past GEMM_MAX_ROWS rows), and the int8-activation
kernel (kernels/q8gemm.c, the opt-in weights="native-q8"; not exact: activations rounded to int8 per 32-block).
The table gives the median ms per call, GMAC/s, and each path's speed against dequantize + F.linear.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from block_gemv import random_q4_1  # noqa: E402

from kvlab.fileio import write_json  # noqa: E402
from kvlab.kernels import block_kernel, kernel_status  # noqa: E402
from kvlab.kernels.q8gemm import q8_kernel_for  # noqa: E402
from kvlab.model.blockquant import BlockMatrix, BlockQuantLinear  # noqa: E402

OUT = ROOT / "bench" / "results" / "block_gemm.json"
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
REPEATS = 7
N, K = 3072, 576


def ms_per_call(fn) -> float:
    """CPU milliseconds per call (this process's CPU time, 1 thread: a busy machine's time slicing does not count),
    over enough calls for ~0.1 s."""
    fn()                                                                     # warm-up
    calls, start = 0, time.process_time()
    while time.process_time() - start < 0.1:
        fn()
        calls += 1
    return (time.process_time() - start) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(OUT), help="where the JSON goes")
    out = Path(parser.parse_args().out)
    kernel, q8 = block_kernel(), q8_kernel_for(torch.device("cpu"))
    if kernel is None or q8 is None:
        raise SystemExit(f"no block kernel: {kernel_status()}")
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    linear = BlockQuantLinear(BlockMatrix("Q4_1", random_q4_1(N, K, gen), K))
    paths = {
        "block_gemm": lambda x: kernel.gemm("Q4_1", linear.blocks, x),
        "dequantize_linear": lambda x: F.linear(x, linear.dequantized()),
        "int8_activations": lambda x: q8.gemm("Q4_1", linear.blocks, x),
    }
    results = []
    print(f"{'rows':>5} {'block GEMM ms':>14} {'dequantize ms':>14} {'int8 ms':>9}   GMAC/s: {'GEMM':>6} {'deq':>6} {'int8':>6}"
          f"   × deq: {'GEMM':>5} {'int8':>5}")
    for rows in ROWS:
        x = torch.randn(rows, K, generator=gen)                              # (rows, K)
        times = {name: [] for name in paths}
        for _ in range(REPEATS):                                             # interleaved
            for name, fn in paths.items():
                times[name].append(ms_per_call(lambda: fn(x)))
        ms = {name: statistics.median(t) for name, t in times.items()}
        gmacs = {name: rows * N * K / (m * 1e-3) / 1e9 for name, m in ms.items()}
        ref = ms["dequantize_linear"]
        results.append({"rows": rows, **{f"{name}_ms": round(m, 4) for name, m in ms.items()},
                        **{f"{name}_gmac_s": round(g, 1) for name, g in gmacs.items()},
                        "speedup": round(ref / ms["block_gemm"], 3), "int8_speedup": round(ref / ms["int8_activations"], 3)})
        g, d, i = ms["block_gemm"], ms["dequantize_linear"], ms["int8_activations"]
        print(f"{rows:>5} {g:>14.3f} {d:>14.3f} {i:>9.3f}           {gmacs['block_gemm']:>6.1f} {gmacs['dequantize_linear']:>6.1f} "
              f"{gmacs['int8_activations']:>6.1f}          {d / g:>5.2f} {d / i:>5.2f}")
    write_json(out, {"what": __doc__.splitlines()[0], "threads": 1, "matrix": f"{N}x{K} Q4_1", "repeats": REPEATS,
                     "statistic": "median", "int8_variant": q8.variant, "load_average": list(os.getloadavg()[:2]),
                     "rows": results}, indent=1)


if __name__ == "__main__":
    main()
