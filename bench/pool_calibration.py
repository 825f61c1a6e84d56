"""Quality of TurboQuant caches calibrated as the serving pool calibrates them (serve/coded.py calibrated_codec: once,
on CALIBRATION_TEXT in the chat template) against each cache calibrating on its own first chunk (the default), on
`kvlab eval`'s protocol (16 windows, seeds 0/1/2). Writes bench/results/pool_calibration.json, or OUT.

    .venv/bin/python bench/pool_calibration.py                       # ~8 min on 2 cores
    .venv/bin/python bench/pool_calibration.py NAME,... [OUT.json]   # other caches (tq4+halloc: calibrated first)
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from kvlab.backends import KvlabRuntime
from kvlab.cache import CacheGeometry
from kvlab.cache.turboquant import TurboQuantCache
from kvlab.quality.perplexity import WindowProtocol
from kvlab.eval import suite
from kvlab.eval.suite import perplexity_suite
from kvlab.serve.coded import calibrated_codec
from kvlab.session import cached_model

NAMES = ["tq-k4v4", "tq-k4v4+prerope+sink1", "tq4"]   # tq4: the preset (cache/format.py), tq-k4v4: the bare method
POOL = "pool:"   # a name's prefix: the cache given the pool's calibration


class PoolCalibrated(KvlabRuntime):
    """kvlab's engine, where "pool:NAME" is NAME given the pool's shared calibration (use_calibration)."""

    codecs: dict = {}

    def make_cache(self, name: str, capacity: int):
        if not name.startswith(POOL):
            return super().make_cache(name, capacity)
        cache = super().make_cache(name[len(POOL):], capacity)
        assert isinstance(cache, TurboQuantCache)
        key = cache.config.name
        if key not in self.codecs:
            geometry = CacheGeometry.for_model(self.loaded.config, batch=1, capacity=capacity)
            self.codecs[key] = calibrated_codec(self.loaded.model, geometry, cache.config, self.loaded.device,
                                                self.loaded.tokenizer)
        cache.use_calibration(self.codecs[key])
        return cache

    def bytes_per_token(self, name: str, *args, **kwargs):
        return super().bytes_per_token(name.removeprefix(POOL), *args, **kwargs)


def pool_seed_variants(name: str, seeds: tuple[int, ...], plain=suite.seed_variants) -> list[tuple[int | None, str]]:
    """suite.seed_variants, the "pool:" prefix kept on each seed's name."""
    prefix = POOL if name.startswith(POOL) else ""
    return [(seed, prefix + built) for seed, built in plain(name.removeprefix(POOL), seeds)]


def main() -> None:
    torch.set_num_threads(2)
    suite.seed_variants = pool_seed_variants
    loaded = cached_model(None, "fp32", "cpu", "auto")
    chosen = sys.argv[1].split(",") if len(sys.argv) > 1 else NAMES
    out = Path(sys.argv[2] if len(sys.argv) > 2 else "bench/results/pool_calibration.json")
    names = [n for name in chosen for n in (name, POOL + name)]
    records = perplexity_suite(loaded, names, WindowProtocol(), seeds=(0, 1, 2), engine=PoolCalibrated(loaded))
    rows = [asdict(r) for r in records]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print(f"{'cache':75s} {'ΔPPL':>8s} {'sd':>5s} {'KL':>7s} {'top-1':>6s}")
    for r in rows:
        print(f"{r['cache']:75s} {r['ppl_delta_pct']:+7.2f}% {r['ppl_delta_sd'] or 0:5.2f} {r['kl']:7.4f} {r['top1_agreement']:6.1%}")


if __name__ == "__main__":
    main()
