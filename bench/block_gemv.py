"""The block GEMV kernel alone: GB/s of Q4_1 blocks read per second, one thread, cache-hot and cache-cold.

    .venv/bin/python bench/block_gemv.py      # writes bench/results/block_gemv.json

Cache-hot: one matrix of SmolLM2's shapes multiplied again and again (it stays in L2/L3), so the rate
is the kernel's arithmetic. Cache-cold: 30 distinct 3072×576 matrices in turn (33 MB), like a decode
step walking the layers. If the two are close, the kernel is compute-bound, not memory-bound.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from kvlab.kernels import BLOCK_TYPES, block_kernel, kernel_status  # noqa: E402
from kvlab.fileio import write_json  # noqa: E402
from kvlab.measure import machine_info  # noqa: E402
from kvlab.model.blockquant import split_rows  # noqa: E402

OUT = ROOT / "bench" / "results" / "block_gemv.json"
SHAPES = [(960, 576), (3072, 576), (576, 1536), (49152, 576)]   # q|k|v, gate|up, down, vocab head (rows, cols)
SCALE_BYTES = torch.tensor([0x00, 0x2C], dtype=torch.uint8)     # fp16 0.0625 for d and m


def random_q4_1(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """(rows, cols/32 × 20) uint8 Q4_1 blocks with random nibbles and small finite d, m, in kvlab's row layout."""
    _, per_block, block_bytes = BLOCK_TYPES["Q4_1"]
    blocks = torch.randint(0, 256, (rows, cols // per_block, block_bytes), dtype=torch.uint8, generator=gen)
    blocks[..., 0:2] = SCALE_BYTES
    blocks[..., 2:4] = SCALE_BYTES
    return split_rows("Q4_1", blocks.reshape(rows, -1))


def rate(kernel, matrices: list[torch.Tensor], x: torch.Tensor, seconds: float = 1.0) -> float:
    """GB/s of blocks read: passes over `matrices` for about `seconds`, after a warm-up pass."""
    for m in matrices:
        kernel.gemv("Q4_1", m, x)
    total, passes, start = sum(m.nbytes for m in matrices), 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for m in matrices:
            kernel.gemv("Q4_1", m, x)
        passes += 1
    return total * passes / (time.perf_counter() - start) / 1e9


def main() -> None:
    torch.set_num_threads(1)
    kernel = block_kernel()
    if kernel is None:
        sys.exit(f"no block kernel: {kernel_status()}")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n, k in SHAPES:
        rows.append({"case": f"hot {n}×{k}", "gb_s": round(rate(kernel, [random_q4_1(n, k, gen)], torch.randn(k)), 2)})
    cold = [random_q4_1(3072, 576, gen) for _ in range(30)]
    rows.append({"case": "cold 30 × 3072×576", "gb_s": round(rate(kernel, cold, torch.randn(576)), 2)})
    for row in rows:
        print(f"{row['case']:22s} {row['gb_s']:6.2f} GB/s")
    write_json(OUT, {"what": __doc__.splitlines()[0], "threads": 1, "machine": machine_info(), "rows": rows}, indent=1)


if __name__ == "__main__":
    main()
