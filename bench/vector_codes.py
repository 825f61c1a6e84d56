"""Scalar Lloyd-Max codes against `+vq` block codes on the law they code: unit vectors after the rotation.

    .venv/bin/python bench/vector_codes.py      # writes bench/results/vector_codes.json

For each head dim and width: the mean squared error per vector ‖y - ŷ‖² of seeded random unit vectors coded by
TurboQuant's RotatedCodes, scalar and with vector=True (blocks of 4 coordinates, sign-symmetric magnitude points,
the same bytes), and the bytes of codebook each holds. This is what `+vq` changes inside a cache before any model
sees it; the perplexity it buys is `kvlab eval` (docs/benchmarks.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from kvlab.cache.tq_codec import RotatedCodes  # noqa: E402
from kvlab.fileio import write_json  # noqa: E402

OUT = Path(__file__).parent / "results" / "vector_codes.json"
DIMS = (64, 128)
WIDTHS = (2, 2.5, 3, 3.5, 4)
VECTORS = 20_000


def unit_vectors(n: int, dim: int, seed: int) -> torch.Tensor:
    x = torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))
    return x / x.norm(dim=1, keepdim=True)                                       # (n, d)


def main() -> None:
    rows = []
    for dim in DIMS:
        y = unit_vectors(VECTORS, dim, seed=dim)
        for bits in WIDTHS:
            errors = {}
            for label, vector in (("scalar", False), ("vq", True)):
                codes = RotatedCodes(dim, bits, vector=vector)
                errors[label] = (((y - codes.encode(y)[1]) ** 2).sum(1).mean().item(), codes.nbytes)
            rows.append({"dim": dim, "bits": bits, "bytes_per_vector": RotatedCodes.packed_bytes(dim, bits),
                         "scalar_mse": errors["scalar"][0], "vq_mse": errors["vq"][0],
                         "change_pct": 100 * (errors["vq"][0] / errors["scalar"][0] - 1),
                         "scalar_codebook_bytes": errors["scalar"][1], "vq_codebook_bytes": errors["vq"][1]})
    table = Table(title=f"mean ‖y - ŷ‖² of {VECTORS:,} random unit vectors: scalar Lloyd-Max vs +vq block codes")
    for column in ("d", "bits", "bytes/vector", "scalar", "+vq", "change", "codebook bytes (scalar / +vq)"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(str(r["dim"]), f"{r['bits']:g}", str(r["bytes_per_vector"]), f"{r['scalar_mse']:.5f}",
                      f"{r['vq_mse']:.5f}", f"{r['change_pct']:+.1f}%", f"{r['scalar_codebook_bytes']:,} / {r['vq_codebook_bytes']:,}")
    Console().print(table)
    write_json(OUT, {"benchmark": "vector_codes", "vectors": VECTORS, "results": rows}, indent=2)
    print(f"results in {OUT}")


if __name__ == "__main__":
    main()
