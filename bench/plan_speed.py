"""Planner speed: every catalog model, and GGUF headers of growing (sparse) files.

    .venv/bin/python bench/plan_speed.py        # writes bench/results/plan_speed.json

1. Catalog: load_spec + make_plan with a GPU (so both solvers run: longest context, most
   sequences) for every bundled model; median of 7 runs each, interleaved.
2. GGUF: SmolLM2-135M's real metadata (49k-token vocabulary included) and tensor table (as f16,
   0.26 GiB), plus one padding tensor that makes the file 4, 40 or 400 GiB. The files are sparse: the data is
   never written, and never read. Planning time must not grow with the size. Baseline: the gguf
   package's GGUFReader opening the same files.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from kvlab.model.loader import default_model_path  # noqa: E402
from kvlab.plan import PlanSettings, find_gpu, rules_for, make_plan  # noqa: E402
from kvlab.fileio import write_json  # noqa: E402
from kvlab.sources import catalog, load_spec, open_gguf  # noqa: E402

RUNS = 7
SIZES = {"0.26 GiB": 0, "4 GiB": 4 << 30, "40 GiB": 40 << 30, "400 GiB": 400 << 30}


def timed(fn, runs: int = RUNS) -> list[float]:
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1000)
    return out


def plan_catalog_model(name: str) -> None:
    make_plan(load_spec(name), rules_for("llama.cpp"), PlanSettings(context=32768, kv_type_k="q8_0", kv_type_v="q8_0"),
              "q4_k_m", find_gpu("RTX 3060"))


def write_sparse_like(source: Path, path: Path, size: int) -> None:
    """SmolLM2's metadata and tensor table (as f16) plus a padding tensor up to `size` bytes, data unwritten."""
    import gguf

    real = open_gguf(source)
    writer = gguf.GGUFWriter(path, real.architecture)
    for key, value in real.metadata.items():
        if key == "general.architecture":
            continue
        if isinstance(value, list):
            sub = gguf.GGUFValueType.get_type(value[0])
            writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=sub)
        else:
            writer.add_key_value(key, value, gguf.GGUFValueType.get_type(value) if not isinstance(value, int)
                                 else gguf.GGUFValueType.UINT32)
    used = 0
    for t in real.tensors:
        shape = tuple(reversed(t.shape))
        writer.add_tensor_info(t.name, shape, np.dtype(np.float16), t.n_elements * 2)
        used += t.n_elements * 2
    pad = max(0, size - used - (8 << 20)) // 4
    writer.add_tensor_info("padding.weight", (pad,), np.dtype(np.float32), pad * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    with open(path, "r+b") as fh:
        header = fh.seek(0, os.SEEK_END)
        fh.truncate(max(size, header + used + pad * 4 + 64))


def main() -> None:
    import gguf

    names = list(catalog())
    for name in names:  # warm imports and caches
        plan_catalog_model(name)
    per_model = {name: [] for name in names}
    for _ in range(RUNS):
        for name in names:
            per_model[name].extend(timed(lambda n=name: plan_catalog_model(n), 1))
    medians = {name: statistics.median(v) for name, v in per_model.items()}
    print(f"catalog: {len(names)} models, median {statistics.median(medians.values()):.1f} ms, "
          f"slowest {max(medians, key=medians.get)} {max(medians.values()):.1f} ms (limit 200 ms)")

    gguf_rows = []
    source = default_model_path()
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVLAB_BENCH_TMP")) as tmp:
        files = {"SmolLM2 (real, 94 MiB)": source}
        for label, size in SIZES.items():
            path = Path(tmp) / f"sparse-{label.replace(' ', '')}.gguf"
            write_sparse_like(source, path, size)
            files[f"sparse {label}"] = path
        for label, path in files.items():
            plan = lambda p=path: make_plan(load_spec(str(p)), rules_for("llama.cpp"), PlanSettings(context=8192),  # noqa: E731
                                            None, find_gpu("RTX 3060"))
            plan()
            ours = statistics.median(timed(plan))
            baseline = statistics.median(timed(lambda p=path: gguf.GGUFReader(p), 2))
            st = os.stat(path)
            row = {"file": label, "size_bytes": st.st_size, "allocated_bytes": st.st_blocks * 512,
                   "kvlab_plan_ms": round(ours, 2), "gguf_reader_open_ms": round(baseline, 2),
                   "speedup_vs_gguf_reader": round(baseline / ours, 1)}
            gguf_rows.append(row)
            print(f"{label:24s} size {st.st_size / 2**30:8.2f} GiB  on disk {st.st_blocks * 512 / 2**20:6.1f} MiB  "
                  f"kvlab plan {ours:7.1f} ms   GGUFReader open {baseline:7.1f} ms   ({baseline / ours:.1f}x)")

    result = {
        "machine": {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()},
        "catalog": {"models": len(names), "median_ms": round(statistics.median(medians.values()), 2),
                    "max_ms": round(max(medians.values()), 2), "slowest": max(medians, key=medians.get),
                    "per_model_median_ms": {k: round(v, 2) for k, v in medians.items()}},
        "gguf_header": gguf_rows,
    }
    out = ROOT / "bench" / "results" / "plan_speed.json"
    write_json(out, result, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
