"""Per-token cost of a JSON-schema token mask on this CPU: xgrammar against llguidance, on SmolLM2's vocabulary.

For each library: compile a schema (the compile time is recorded apart), then walk a valid document token by
token as a model would produce it -- compute the allowed-token bitmask for the next position, check that the
document's token is allowed, consume it -- timing the mask computation of every token. Reports the median and
p90 in microseconds, and writes bench/results/grammar_mask.json.

    PYTHONPATH=src python bench/grammar_mask.py [--repeats 5]

It also runs the engine at 16 concurrent requests with none or one of them held to a JSON schema (interleaved
repeats), the batch's output tokens/s in each case: what one constrained request costs the others.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "arguments": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                          "units": {"enum": ["metric", "imperial"]}},
                      "required": ["city", "days", "units"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "arguments", "tags"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "get_weather", "arguments": {"city": "Paris, France", "days": 14, "units": "metric"},
            "tags": ["travel", "weather forecast", "europe"]}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def bench_xgrammar(tokenizer, ids: list[int], repeats: int) -> dict:
    import xgrammar

    vocab = [tokenizer.backend.id_to_token(i) for i in range(tokenizer.vocab_size)]
    info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.BYTE_LEVEL, stop_token_ids=list(tokenizer.eos_ids))
    started = time.perf_counter()
    compiled = xgrammar.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - started
    bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    times = []
    for _ in range(repeats):
        matcher = xgrammar.GrammarMatcher(compiled)
        for token in ids:
            started = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            times.append(time.perf_counter() - started)
            assert _allowed(bitmask[0], token), f"xgrammar refused token {token}"
            assert matcher.accept_token(token)
    return {"compile_s": compile_s, "times": times}


def bench_llguidance(tokenizer, ids: list[int], repeats: int) -> dict:
    import llguidance
    import llguidance.torch

    lltok = llguidance.LLTokenizer(tokenizer.backend.to_str(), eos_token=tokenizer.eos_ids[0])
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    started = time.perf_counter()
    first = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - started
    assert not first.is_error(), first.get_error()
    bitmask = llguidance.torch.allocate_token_bitmask(1, lltok.vocab_size)
    times = []
    for _ in range(repeats):
        matcher = llguidance.LLMatcher(lltok, grammar)
        for token in ids:
            started = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            times.append(time.perf_counter() - started)
            assert _allowed(bitmask[0], token), f"llguidance refused token {token}"
            assert matcher.consume_token(token), matcher.get_error()
    return {"compile_s": compile_s, "times": times}


def _allowed(bitmask_row: torch.Tensor, token: int) -> bool:
    """Bit `token` of a packed int32 bitmask row (both libraries use this layout)."""
    return bool((int(bitmask_row[token // 32]) >> (token % 32)) & 1)


def batched_throughput(repeats: int, concurrent: int = 16, tokens: int = 32) -> dict:
    """Output tokens/s of `concurrent` requests of `tokens` tokens each, none or one constrained (llguidance)."""
    from kvlab.serve import Engine, SamplingParams
    from kvlab.serve.grammar import Grammar

    engine = Engine.from_model_path(None, kv_budget="64MiB", max_batch=concurrent)
    tokenizer = engine.tokenizer
    prompts = [tokenizer.encode(f"Write about the number {i}:") for i in range(concurrent)]
    free = SamplingParams(max_tokens=tokens, ignore_eos=True)
    constrained = SamplingParams(max_tokens=tokens, ignore_eos=True, grammar=Grammar.json_schema(
        {"type": "array", "items": {"type": "integer"}, "minItems": 64}))   # longer than `tokens`: never done early
    engine.generate(prompts[:2], [free, constrained], progress=False)           # warm up (and build the vocabulary)
    rates: dict[str, list[float]] = {"none_constrained": [], "one_constrained": []}
    for _ in range(repeats):
        for name, params in (("none_constrained", [free] * concurrent),
                             ("one_constrained", [constrained] + [free] * (concurrent - 1))):
            started = time.perf_counter()
            outputs = engine.generate(prompts, params, progress=False)
            rates[name].append(sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - started))
    medians = {name: round(statistics.median(r), 1) for name, r in rates.items()}
    return {"concurrent": concurrent, "tokens_each": tokens, "output_tokens_per_s_median": medians,
            "ratio_one_constrained": round(medians["one_constrained"] / medians["none_constrained"], 3)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench/results/grammar_mask.json")
    args = parser.parse_args()
    from kvlab.session import cached_model

    tokenizer = cached_model(None, "fp32", "cpu").tokenizer
    ids = tokenizer.encode(json.dumps(DOCUMENT), add_special=False)
    record = {"what": "per-token JSON-schema mask computation, SmolLM2-135M vocabulary (49,152 tokens)",
              "document_tokens": len(ids), "repeats": args.repeats, "machine": platform.processor() or platform.machine(),
              "torch_threads": torch.get_num_threads(), "load_average_1min": round(os.getloadavg()[0], 2),
              "libraries": {}}
    for name, run in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
        result = run(tokenizer, ids, args.repeats)
        times_us = [t * 1e6 for t in result["times"]]
        record["libraries"][name] = {"compile_ms": round(result["compile_s"] * 1e3, 2),
                                     "median_us": round(statistics.median(times_us), 1),
                                     "p90_us": round(percentile(times_us, 90), 1),
                                     "max_us": round(max(times_us), 1)}
        print(name, record["libraries"][name])
    record["batched_16"] = batched_throughput(args.repeats)
    print("batched_16", record["batched_16"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
