"""`kvlab serve --kv-store`: bytes on disk per 1,000 tokens in each pool format, and how soon a restarted server
answers the next turn of a saved 4,000-token conversation against prefilling it afresh.

    PYTHONPATH=src python bench/kv_store.py [--caches dense-f16,int8,tq4] [--history 4000] [--repeats 3] [--threads 2]

Size: one engine per format writes a conversation of --size-tokens through its store; the block files' bytes (their
small headers included) per 1,000 tokens, beside the pool's own bytes for those tokens.
Restart: an engine with a store answers the history (its blocks are written when the request finishes); then, per
repeat and interleaved, (a) a new engine on that store (its start: identity hash, folder scan) answers the next turn
(the history + a new question) and (b) a new engine without a store answers the same turn from scratch. Time to first
token = engine start + the request until its first token. The model is loaded once before (both pay it alike). The
files are read from the page cache (they were just written): a cold disk adds its read time (~90 MB for dense-f16).

Writes bench/results/kv_store.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

PROSE = ("The library opens at nine in the morning and closes at six in the evening. Visitors can borrow up to five "
         "books at a time, and most of them return within two weeks. On rainy days the reading room is full. ")


def history_ids(tokenizer, n: int) -> list[int]:
    """A chat of about n tokens: a long user message through the chat template, cut to n tokens."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROSE * (n // 30 + 1)}])
    return tokenizer.encode(text, add_special=False)[:n]


def first_token_s(engine, ids: list[int]) -> tuple[float, int]:
    """Seconds until the request's first token, and its cached prompt tokens."""
    from kvlab.serve import SamplingParams

    started = time.perf_counter()
    engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0))
    while True:
        for out in engine.step():
            if out.new_token_ids:
                seconds = time.perf_counter() - started
                while engine.has_unfinished():
                    engine.step()
                return seconds, out.cached_prompt_tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--caches", default="dense-f16,int8,tq4")
    parser.add_argument("--restart-caches", default="dense-f16,tq4")
    parser.add_argument("--size-tokens", type=int, default=1024)
    parser.add_argument("--history", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="bench/results/kv_store.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from kvlab.serve import Engine
    from kvlab.session import cached_model

    loaded = cached_model(None, "fp32", "cpu")
    tokenizer = loaded.tokenizer
    history = history_ids(tokenizer, args.history)
    turn = history + tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "And then?"}])[-40:],
                                      add_special=False)
    sizes, restarts = [], []
    work = Path(tempfile.mkdtemp(prefix="kvlab-kv-store-bench-"))
    try:
        for cache in args.caches.split(","):
            folder = work / f"size-{cache}"
            engine = Engine(loaded, cache=cache, kv_budget="256MiB", kv_store=str(folder))
            first_token_s(engine, history[:args.size_tokens + 1])
            engine.close()
            stored = sum(p.stat().st_size for p in engine.store.folder.glob("*.kvb"))
            tokens = len(engine.store.files) * engine.capacity.block_size
            sizes.append({"cache": cache, "format": engine.capacity.format, "tokens": tokens,
                          "store_bytes_per_1000_tokens": round(stored / tokens * 1000),
                          "pool_bytes_per_1000_tokens": round(engine.capacity.block_bytes / engine.capacity.block_size * 1000),
                          "files": len(engine.store.files)})
            print(json.dumps(sizes[-1]), flush=True)
        for cache in args.restart_caches.split(","):
            folder = work / f"restart-{cache}"
            engine = Engine(loaded, cache=cache, kv_budget="256MiB", kv_store=str(folder))
            first_token_s(engine, history)
            engine.close()
            runs = {"restart": [], "fresh": [], "restart_start": [], "cached": set()}
            for i in range(args.repeats):
                copy = work / f"restart-{cache}-{i}"           # each restart finds the history alone
                shutil.copytree(folder, copy)
                started = time.perf_counter()
                restarted = Engine(loaded, cache=cache, kv_budget="256MiB", kv_store=str(copy))
                start_s = time.perf_counter() - started
                seconds, cached = first_token_s(restarted, turn)
                restarted.close()
                shutil.rmtree(copy)
                runs["restart"].append(start_s + seconds)
                runs["restart_start"].append(start_s)
                runs["cached"].add(cached)
                started = time.perf_counter()
                fresh = Engine(loaded, cache=cache, kv_budget="256MiB")
                seconds, _ = first_token_s(fresh, turn)
                runs["fresh"].append(time.perf_counter() - started)
            row = {"cache": cache, "history_tokens": len(history), "turn_tokens": len(turn),
                   "cached_tokens": sorted(runs["cached"]),
                   "restart_to_first_token_s": round(statistics.median(runs["restart"]), 3),
                   "restart_engine_start_s": round(statistics.median(runs["restart_start"]), 3),
                   "fresh_prefill_first_token_s": round(statistics.median(runs["fresh"]), 3),
                   "runs_s": {k: [round(x, 3) for x in runs[k]] for k in ("restart", "fresh")}}
            row["speedup"] = round(row["fresh_prefill_first_token_s"] / row["restart_to_first_token_s"], 2)
            restarts.append(row)
            print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    record = {"what": "kvlab serve --kv-store: bytes on disk per 1,000 tokens; restart to first token vs fresh prefill",
              "model": "SmolLM2-135M-Instruct Q8_0 (embedded), fp32 compute", "threads": args.threads,
              "repeats": args.repeats, "cpus": os.cpu_count(), "load_average_1min": round(os.getloadavg()[0], 2),
              "command": "python bench/kv_store.py", "sizes": sizes, "restart": restarts}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
