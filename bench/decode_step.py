"""Where one decode step's time goes: the fused step against the Python modules, by context length.

    .venv/bin/python bench/decode_step.py [--threads N]     # writes bench/results/decode_step.json

SmolLM2 with native weights, a dense cache filled to each context length, then one-token steps: median
milliseconds per step with the fused step (one C call) and with the modules, and how much of the modules'
step is spent inside the block GEMV calls (the rest is the ~40 small torch ops per layer). The two paths
alternate so the machine's drift hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from kvlab.cache import CacheGeometry, make_cache  # noqa: E402
from kvlab.fileio import write_json  # noqa: E402
from kvlab.measure import read_bandwidth_gb_s  # noqa: E402
from kvlab.model.fused import fused_step_off  # noqa: E402
from kvlab.kernels import block_kernel  # noqa: E402
from kvlab.session import cached_model  # noqa: E402

OUT = ROOT / "bench" / "results" / "decode_step.json"
CONTEXTS = (128, 1024, 4000)
STEPS = 16


class GemvClock:
    """Wraps the kernel's gemv to add up the seconds spent inside it."""

    def __init__(self, kernel):
        self.kernel, self.inner, self.seconds = kernel, kernel.gemv, 0.0

    def __enter__(self):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return self.inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        self.kernel.gemv = timed
        return self

    def __exit__(self, *exc):
        self.kernel.gemv = self.inner


def step_ms(model, cache, context: int) -> float:
    """Median ms of STEPS one-token steps, each at position `context` (the cache is rewound between them)."""
    token = torch.tensor([[42]])
    times = []
    for _ in range(STEPS):
        cache.reset()
        cache.record_written(range(model.config.n_layers), context)
        start = time.perf_counter()
        model(token, cache)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = cached_model(None, "fp32", "cpu", "native")
    model, kernel = loaded.model, block_kernel()
    if model.fused is None or kernel is None:
        sys.exit("needs the C kernels (a C compiler) for native weights and the fused step")
    rows = []
    with torch.inference_mode():
        for context in CONTEXTS:
            cache = make_cache("dense", CacheGeometry.for_model(loaded.config, capacity=context + 1))
            model(torch.randint(100, 10000, (1, context)), cache)        # real K/V in the first `context` slots
            fused_ms, module_ms, gemv_share = [], [], []
            for _ in range(3):
                fused_ms.append(step_ms(model, cache, context))
                with fused_step_off(model), GemvClock(kernel) as clock:
                    module_ms.append(step_ms(model, cache, context))
                gemv_share.append(clock.seconds * 1e3 / STEPS / module_ms[-1])
            kv_mb = 2 * loaded.config.n_layers * loaded.config.n_kv_heads * loaded.config.head_dim * 4 * context / 1e6
            row = {"context": context, "kv_mb_read": round(kv_mb, 1), "fused_ms": round(min(fused_ms), 2),
                   "modules_ms": round(min(module_ms), 2), "modules_gemv_share": round(statistics.median(gemv_share), 2)}
            rows.append(row)
            print(row, flush=True)
    record = {"what": __doc__.splitlines()[0], "threads": torch.get_num_threads(), "weight_mb": round(loaded.weight_bytes / 1e6, 1),
              "read_bandwidth_gb_s": round(read_bandwidth_gb_s(), 1), "rows": rows}
    write_json(OUT, record, indent=1)
    print(f"-> {OUT}")


if __name__ == "__main__":
    main()
