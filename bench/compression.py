"""Compressed KV caches on SmolLM2: quality, bytes, where the error comes from, and decode speed.

    .venv/bin/python bench/compression.py                    # every part, writes bench/results/compression.json
    .venv/bin/python bench/compression.py --parts quality     # one part (quality | passkey | layers | speed)

Each part updates its own section of bench/results/compression.json, so parts can run separately.
  quality  the `kvlab eval` perplexity suite (16 windows × 512 tokens, ANCHORS.md protocol) for CACHES
  passkey  passkey retrieval at 1k/3k/6k filler tokens × depths 25/50/75% for PASSKEY_CACHES
  layers   where the error comes from: one window, only layer l's keys (or values) compressed at 3 bits,
           every other layer and the other half of that layer exact (tq-k3v8 / tq-k8v3 with fp-layers);
           mean KL against dense per layer (--layer-options +prerope+sink1: of that recipe, its own section)
  speed    decode tokens/s and bandwidth at 512, 2k, 4k and 8k tokens of context (kvlab bench decode --contexts)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvlab.cache import CacheGeometry, make_cache
from kvlab.quality.agreement import kl_divergence
from kvlab.eval.needle import PasskeyProtocol, passkey_trials
from kvlab.quality.perplexity import WindowProtocol, run_window
from kvlab.eval.plot import plot_quality
from kvlab.eval.suite import corpus_windows, perplexity_suite
from kvlab.fileio import write_json
from kvlab.session import cached_model

OUT = Path(__file__).parent / "results" / "compression.json"
PLOT = Path(__file__).parent / "results" / "compression.png"
CACHES = [
    "int8", "int4", "int4+g64", "int4+recent128",
    "tq4", "tq-k5v3", "tq3.5", "tq-k4v3", "tq3", "tq-k4v2", "tq2.5", "tq2",
    "tq4+qjl", "tq3+recent64", "tq4+fp-first-last",
    # the first token kept in full precision (the attention sink); more bits
    "tq4+sink1", "tq3+sink1", "tq-k5v3+sink1", "tq-k4v3+sink1", "tq4.5", "tq5",
    # ablations: without the query-aware key weights; the paper's recipe (no key offset, no norm
    # correction, no key weights)
    "tq4+kweights=none", "tq3+kweights=none",
    "tq4+center=none+kweights=none+kscale=norm+vscale=norm", "tq3+center=none+kweights=none+kscale=norm+vscale=norm",
]
PASSKEY_CACHES = ["dense", "int4", "tq4", "tq3"]
PASSKEY = PasskeyProtocol(lengths=(1000, 3000, 6000))   # kvlab eval's default lengths
SPEED_CACHES = ["dense", "dense-f16", "int8", "int4", "tq4", "tq3"]


def part_quality(loaded) -> dict:
    records = perplexity_suite(loaded, CACHES, WindowProtocol())
    plot_quality(records, PLOT)
    return {"protocol": "16 windows × 512 tokens of Hamlet+Macbeth+Tempest+Julius Caesar; fresh cache per window; "
                        "64-token prefill then 32-token chunks; fp32; bytes at 511 tokens in a bf16 run",
            "records": [r.to_json() for r in records], "plot": str(PLOT.name)}


def part_passkey(loaded) -> dict:
    protocol = PASSKEY
    out = {"protocol": f"filler tokens {protocol.lengths} × depths {protocol.depths}, greedy, 12 new tokens"}
    for name in PASSKEY_CACHES:
        trials = passkey_trials(loaded, name, protocol)
        out[name] = {"accuracy": sum(t["found"] for t in trials) / len(trials), "trials": trials}
        print(name, out[name]["accuracy"], flush=True)
    return out


def part_layers(loaded, options: str = "") -> dict:
    """`options` (e.g. "+prerope+sink1") go on both names: where the loss of that recipe sits."""
    model, config = loaded.model, loaded.config
    protocol = WindowProtocol(n_windows=1)
    tokens = corpus_windows(loaded.tokenizer, WindowProtocol(n_windows=16))[5]
    geometry = CacheGeometry.for_model(config, 1, protocol.length)
    reference, _ = run_window(model, tokens, lambda: make_cache("dense", geometry), protocol)
    rows = []
    for layer in range(config.n_layers):
        exact = ".".join(str(l) for l in range(config.n_layers) if l != layer)
        row = {"layer": layer}
        for part, base in (("keys", "tq-k3v8"), ("values", "tq-k8v3")):
            name = f"{base}{options}+fp-layers={exact}"
            logits, _ = run_window(model, tokens, lambda: make_cache(name, geometry), protocol)
            row[f"kl_{part}"] = kl_divergence(reference, logits).mean().item()
        rows.append(row)
        print(row, flush=True)
    return {"what": f"mean KL vs dense on one window when only this layer's keys (tq-k3v8{options}) or values "
                    f"(tq-k8v3{options}) are compressed", "rows": rows}


def part_speed(loaded) -> dict:
    """`kvlab bench decode --contexts 512,2k,4k,8k --caches SPEED_CACHES` (kvlab/bench/contexts.py, the one
    implementation): decode tokens/s and achieved bandwidth per cache and context, interleaved, fused steps
    where they exist."""
    from rich.console import Console

    from kvlab.bench.contexts import run_context_bench

    return run_context_bench(None, [512, 2048, 4096, 8192], SPEED_CACHES, repeats=3, steps=16, warmup=2, threads=0,
                             weights=loaded.weights, out=None, json_out=False, console=Console())


PARTS = {"quality": part_quality, "passkey": part_passkey, "layers": part_layers, "speed": part_speed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--layer-options", default="", help='options of both names in --parts layers, e.g. "+prerope+sink1"')
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = cached_model(None, "fp32", "cpu")
    for part in args.parts.split(","):
        started = time.perf_counter()
        extra = {"options": args.layer_options} if part == "layers" else {}
        section = PARTS[part](loaded, **extra)
        section["seconds"] = round(time.perf_counter() - started, 1)
        section["threads"] = torch.get_num_threads()
        data = json.loads(OUT.read_text()) if OUT.exists() else {}
        data[part + extra.get("options", "")] = section
        write_json(OUT, data, indent=1)
        print(f"{part}: {section['seconds']} s -> {OUT}", flush=True)


if __name__ == "__main__":
    main()
