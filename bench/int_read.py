"""The integer caches' attention read: the C read of the codes (kvlab_int_attend) against torch over decoded spans.

    .venv/bin/python bench/int_read.py                  # writes bench/results/int_read.json
    .venv/bin/python bench/int_read.py --out FILE       # elsewhere (a smoke run on a busy machine)

SmolLM2's attention shape (3 KV heads of 64 channels, 9 query heads), one layer of an int8 or int4 cache holding a
context of random K/V, 1 thread, the paths interleaved in each repeat:
- a prompt chunk of CHUNK tokens at the end of the context (every query row reads its own causal range):
  `C read` is kvlab_int_attend (how the single cache and the serving pool's integer blocks read a chunk), `torch
  spans` the torch path's read of a long chunk, span by span (codes decoded in C, attention in torch), and
  dense-f16's torch attention over the same shape for scale;
- a decode step's read (one token, its 9 query heads) through kvlab_int_attend.
Times are CPU time per call, medians; the table gives nanoseconds per query-key pair (query heads x keys read).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from block_gemm import ms_per_call  # noqa: E402

from kvlab.cache import CacheGeometry, make_cache  # noqa: E402
from kvlab.cache.quantized import QuantizedCache  # noqa: E402
from kvlab.fileio import write_json  # noqa: E402
from kvlab.kernels import kernel_status  # noqa: E402
from kvlab.measure import machine_info  # noqa: E402

OUT = ROOT / "bench" / "results" / "int_read.json"
CONTEXTS = (1024, 4096)
CHUNK = 512
REPEATS = 5
KV_HEADS, HEADS, HEAD_DIM = 3, 9, 64


def filled(name: str, context: int, gen: torch.Generator):
    """a one-layer cache of `name` holding `context` tokens of random K/V"""
    g = CacheGeometry(n_layers=1, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM, batch=1, capacity=context, n_heads=HEADS)
    cache = make_cache(name, g)
    for n in (context - CHUNK, CHUNK):                                       # the chunk last, as a prompt's would be
        cache.append(0, torch.randn(1, KV_HEADS, n, HEAD_DIM, generator=gen),
                     torch.randn(1, KV_HEADS, n, HEAD_DIM, generator=gen))
    return cache


def chunk_read(cache, q: torch.Tensor, spans: bool):
    """the chunk's attention, read the way `spans` says (False: every row through the C read)"""
    def read():
        coded_read = QuantizedCache._coded_read
        if spans:
            QuantizedCache._coded_read = lambda self, layer, qg, T: None   # the torch path, in spans
        try:
            return cache.attend(0, q)
        finally:
            QuantizedCache._coded_read = coded_read
    return read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(OUT), help="where the JSON goes")
    out = Path(parser.parse_args().out)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'cache':>9} {'context':>8}   ns per query-key pair: {'C read':>7} {'torch spans':>11} {'dense-f16':>9}"
          f"   decode C read")
    for context in CONTEXTS:
        dense = filled("dense-f16", context, gen)
        for name in ("int8", "int4"):
            cache = filled(name, context, gen)
            if cache.code_kernel is None:
                raise SystemExit(f"no C kernel for the integer read: {kernel_status()}")
            q = torch.randn(1, HEADS, CHUNK, HEAD_DIM, generator=gen)
            step = torch.randn(1, HEADS, 1, HEAD_DIM, generator=gen)
            paths = {"c_read": chunk_read(cache, q, spans=False), "torch_spans": chunk_read(cache, q, spans=True),
                     "dense_f16": lambda: dense.attend(0, q)}
            times = {p: [] for p in paths}
            decode = []
            for _ in range(REPEATS):                                         # interleaved
                for p, fn in paths.items():
                    times[p].append(ms_per_call(fn))
                decode.append(ms_per_call(lambda: cache.attend(0, step)))
            pairs = HEADS * CHUNK * (context - CHUNK + (CHUNK + 1) / 2)      # causal: row i reads context - CHUNK + i + 1
            ns = {p: statistics.median(t) * 1e6 / pairs for p, t in times.items()}
            ns_decode = statistics.median(decode) * 1e6 / (HEADS * context)
            rows.append({"cache": name, "context": context, "chunk": CHUNK, **{f"{p}_ns_pair": round(v, 3) for p, v in ns.items()},
                         "decode_ns_pair": round(ns_decode, 3)})
            print(f"{name:>9} {context:>8}   {'':>22} {ns['c_read']:>7.2f} {ns['torch_spans']:>11.2f} {ns['dense_f16']:>9.2f}"
                  f"   {ns_decode:>13.2f}")
    write_json(out, {"what": __doc__.splitlines()[0], "threads": 1, "machine": machine_info(), "repeats": REPEATS,
                     "statistic": "median", "load_average": list(os.getloadavg()[:2]), "rows": rows}, indent=1)


if __name__ == "__main__":
    main()
