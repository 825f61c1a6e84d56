"""The serving engine's decode step alone: a few sequences with long prompts, in one pool, per block format.

    .venv/bin/python bench/served_step.py [--formats dense-f16,int4,tq4] [--sequences 8] [--prompt-tokens 1500]
                                          [--new-tokens 40] [--threads 1] [--rounds 1] [--kv-budget 1GiB]
                                          [--out FILE]

Every sequence's prompt is prefilled (chunked, as the engine schedules it), then each step decodes one token for
every sequence; only the steps that decode all of them are kept, and the first five of those are dropped (more
sequences need more new tokens: the first ones decode while the last ones' prompts are still read). Median
ms per step and the output tokens/s it makes (sequences / step). With --rounds N every format runs N times, the
order reversed each round so that a drift of the box does not favour one; a format's figure is the median of its
rounds' medians, and its ratio to the first format is taken within each round. What `kvlab bench throughput`
mixes with prompt chunks, queueing and preemption, this shows alone: how fast the pool reads its blocks.
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

from kvlab.fileio import write_json  # noqa: E402
from kvlab.measure import machine_info  # noqa: E402
from kvlab.serve import Engine, SamplingParams  # noqa: E402
from kvlab.session import cached_model  # noqa: E402

SKIPPED = 5   # decode steps dropped at the start (allocation, first touches)


def decode_steps(loaded, block_format: str, prompts: list[list[int]], new_tokens: int, kv_budget: str) -> list[float]:
    """Seconds of each engine step that decodes one token for every sequence."""
    engine = Engine(loaded, cache=block_format, kv_budget=kv_budget, max_batch=len(prompts), max_step_tokens=512,
                    prefix_caching=False)
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    seconds = []
    while engine.has_unfinished():
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        if len(outputs) == len(prompts) and all(out.new_token_ids for out in outputs):
            seconds.append(elapsed)
    if len(seconds) <= SKIPPED:
        raise SystemExit(f"{block_format}: {len(seconds)} steps decoded every sequence at once; raise --new-tokens "
                         "(or --kv-budget: every sequence must fit)")
    return seconds[SKIPPED:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="dense-f16,int4,tq4")
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1, help="runs of every format, alternating their order")
    parser.add_argument("--kv-budget", default="1GiB", help="the pool's KV budget (every sequence must fit in it)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "served_step.json"))
    args = parser.parse_args()
    n_rounds = max(1, args.rounds)
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    loaded = cached_model(None, "fp32", "cpu", "auto")
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, loaded.config.vocab_size, (args.prompt_tokens,), generator=generator).tolist()
               for _ in range(args.sequences)]
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    rounds: dict[str, list[list[float]]] = {f: [] for f in formats}   # format -> each round's step seconds
    for r in range(n_rounds):
        for block_format in formats if r % 2 == 0 else formats[::-1]:
            steps = decode_steps(loaded, block_format, prompts, args.new_tokens, args.kv_budget)
            rounds[block_format].append(steps)
            ms = 1000 * statistics.median(steps)
            print(f"round {r + 1} {block_format:>12}: {ms:6.1f} ms a step, {1000 * args.sequences / ms:6.1f} output tok/s",
                  flush=True)
    results = []
    first = [statistics.median(steps) for steps in rounds[formats[0]]]
    for block_format in formats:
        medians = [statistics.median(steps) for steps in rounds[block_format]]
        ms = 1000 * statistics.median(medians)
        results.append({"blocks": block_format, "steps": sum(len(steps) for steps in rounds[block_format]),
                        "step_ms": round(ms, 2), "output_tokens_per_s": round(1000 * args.sequences / ms, 2),
                        "round_step_ms": [round(1000 * m, 2) for m in medians],
                        "tokens_per_s_vs_first": [round(f / m, 3) for f, m in zip(first, medians)],
                        "step_ms_samples": [round(1000 * s, 2) for steps in rounds[block_format] for s in steps]})
        print(f"{block_format:>12}: {ms:6.1f} ms a step, {1000 * args.sequences / ms:6.1f} output tok/s", flush=True)
    write_json(args.out, {"benchmark": "served_step", "machine": machine_info(), "threads": args.threads,
                          "sequences": args.sequences, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                          "kv_budget": args.kv_budget, "rounds": n_rounds, "results": results}, indent=2)


if __name__ == "__main__":
    main()
