"""Decode speed and bytes of kvlab's caches inside transformers (kvlab.hf.KVLabCache) against DynamicCache.

    .venv/bin/python bench/hf_cache.py                          # SmolLM2, 512-token context, 64 new tokens
    .venv/bin/python bench/hf_cache.py --context 2048 --caches dense,int8,int4,tq4,tq4+sink1 --repeats 5
    PYTHONPATH=DIR .venv/bin/python bench/hf_cache.py --caches dense,tq4,hf:quanto-int4+r0,hf:hqq-4+r128   # DIR: quanto, hqq

The model is the embedded SmolLM2-135M GGUF, loaded by transformers itself (dequantized to fp32), so
every contender runs transformers' modeling code; only the cache object differs. Per round the
contenders run interleaved (the machine is shared and noisy): prefill the same prompt, then `--new`
greedy decode steps fed one token at a time; tok/s is the median over rounds of new / decode seconds.
`hf:` names are transformers' own caches (kvlab/hf_baselines.py: quanto, HQQ, fp8; their packages installed).
Bytes: a KVLabCache's `nbytes` (every buffer it holds, kvlab's formula), preallocated for context + new tokens so
it never grows while timed; for DynamicCache and the `hf:` caches a walk over every tensor the object holds
(hf_baselines.held_nbytes), after the last step.
Writes bench/results/hf_cache.json.
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

from kvlab.measure import machine_info, torch_threads, write_json  # noqa: E402
from kvlab.model.loader import default_model_path  # noqa: E402

OUT = ROOT / "bench" / "results" / "hf_cache.json"
BASELINE = "DynamicCache"


def load(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    return model, tokenizer


def prompt_ids(tokenizer, n_tokens: int) -> torch.Tensor:
    """(1, n_tokens) ids of a plain English text, repeated to length."""
    text = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
            "foolishness, it was the epoch of belief, it was the epoch of incredulity. ")
    ids = tokenizer(text).input_ids
    return torch.tensor([(ids * (n_tokens // len(ids) + 1))[:n_tokens]])


def new_cache(name: str, model, capacity: int):
    from transformers import DynamicCache

    from kvlab.hf import KVLabCache
    from kvlab.hf_baselines import Baseline, is_baseline_name

    if name == BASELINE:
        return DynamicCache(config=model.config)
    if is_baseline_name(name):
        return Baseline.parse(name).build(model.config)
    return KVLabCache.from_name(name, model.config, initial_capacity=capacity)


def cache_bytes(cache) -> int:
    from kvlab.hf_baselines import held_nbytes

    return cache.nbytes if hasattr(cache, "nbytes") else held_nbytes(cache)


@torch.no_grad()
def run(model, ids: torch.Tensor, cache, n_new: int) -> tuple[float, float, list[int]]:
    """(prefill seconds, decode seconds, generated ids): greedy, one token per step."""
    start = time.perf_counter()
    token = model(ids, cache=cache).logits[:, -1:].argmax(-1)          # (1, 1)
    prefill = time.perf_counter() - start
    out = [token.item()]
    start = time.perf_counter()
    for _ in range(n_new - 1):
        token = model(token, cache=cache).logits[:, -1:].argmax(-1)
        out.append(token.item())
    return prefill, time.perf_counter() - start, out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=512, help="prompt tokens")
    parser.add_argument("--new", type=int, default=64, help="decode steps timed")
    parser.add_argument("--caches", default="dense,int8,tq4", help="kvlab cache names and hf: baselines, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's choice)")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)

    model, tokenizer = load(default_model_path())
    ids = prompt_ids(tokenizer, args.context)
    names = [BASELINE] + [n.strip() for n in args.caches.split(",") if n.strip()]
    capacity = args.context + args.new - 1                 # what prefill + new-1 decode steps store
    timings: dict[str, list[float]] = {name: [] for name in names}
    prefills: dict[str, list[float]] = {name: [] for name in names}
    facts: dict[str, dict] = {}
    with torch_threads(args.threads):
        for _ in range(args.repeats):
            for name in names:
                cache = new_cache(name, model, capacity)
                prefill, decode, tokens = run(model, ids, cache, args.new)
                prefills[name].append(prefill)
                timings[name].append(decode)
                facts[name] = {"bytes": cache_bytes(cache), "tokens": cache.get_seq_length(), "first_tokens": tokens[:8]}
    base = statistics.median(timings[BASELINE])
    rows = []
    print(f"{'cache':18s} {'decode tok/s':>12s} {'vs Dynamic':>10s} {'prefill s':>9s} {'bytes':>12s} {'bytes/token':>11s}")
    for name in names:
        decode = statistics.median(timings[name])
        row = {"cache": name, "decode_tok_s": round((args.new - 1) / decode, 2), "speed_vs_dynamic": round(base / decode, 3),
               "prefill_s": round(statistics.median(prefills[name]), 4), **facts[name],
               "bytes_per_token": round(facts[name]["bytes"] / facts[name]["tokens"], 1)}
        rows.append(row)
        print(f"{name:18s} {row['decode_tok_s']:12.1f} {row['speed_vs_dynamic']:9.2f}× {row['prefill_s']:9.3f} "
              f"{row['bytes']:12,d} {row['bytes_per_token']:11,.1f}")
    write_json(args.out, {"what": __doc__.splitlines()[0], "model": default_model_path().name, "context": args.context,
                          "new_tokens": args.new, "repeats": args.repeats, "machine": machine_info(), "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
