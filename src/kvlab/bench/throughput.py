"""`kvlab bench throughput`: many requests at once, sequential `generate` against the batched engine.

Two fixed, seeded workloads of real text (Shakespeare token windows), every request arriving at t = 0:
  mixed    requests with prompts of 32-1,024 tokens and 16-256 new tokens (--quick: 8 requests, 16-128 / 8-32)
  shared   every prompt = one 1,000-token system prompt + a 32-128-token question, 16-64 new tokens
           (--quick: 4 requests, a 200-token system prompt)
  chat     decode-bound: 32 requests with prompts of 16-128 tokens and 128-256 new tokens (--quick: 8 requests,
           16-64 / 32-64), where batching decode steps is what counts
Greedy, EOS ignored, so every contender produces exactly the same number of tokens.
Contenders: `sequential` (kvlab's generate, one request after another, dense cache) and the engine at
each --batches max batch (dense blocks, prefix caching on), plus the largest batch without prefix
caching and in each other --formats block format.
Per run: output tokens/s, total (prompt + output) tokens/s, requests/s, time to first token and time per
output token (p50 / p99, measured from t = 0 by the caller of step()), peak KV bytes, prompt tokens
actually computed, prefix-cache hits and preemptions.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

from rich.console import Console
from rich.table import Table

from ..errors import ConfigError
from ..model.weight_modes import WEIGHTS_HELP

# torch, the engine and the model load inside the functions: `kvlab --help` and `kvlab plan` stay light


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int


@dataclass
class RunResult:
    workload: str
    contender: str                    # "sequential" or "engine"
    max_batch: int
    block_format: str
    prefix_caching: bool
    requests: int
    prompt_tokens: int
    output_tokens: int
    seconds: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    requests_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    peak_kv_bytes: int
    prompt_tokens_computed: int
    prefix_hit_tokens: int = 0
    preemptions: int = 0
    speedup_vs_sequential: float | None = None
    extra: dict = field(default_factory=dict)


def corpus_tokens(tokenizer, n: int) -> list[int]:
    """At least n token ids of Shakespeare (the eval corpus), repeated if it is short."""
    from ..quality.corpus import corpus_text

    ids = tokenizer.encode(corpus_text()[: n * 8], add_special=False)
    while len(ids) < n:
        ids = ids + ids
    return ids


#: the independent-request workloads: (requests, prompt tokens range, new tokens range), [full, --quick]; `long`: 16
#: requests whose contexts reach 2k-4k tokens, where the pool's budget decides how many run at once (their prompts are
#: most of the tokens); `long-decode`: the same reach with 512 new tokens each, where decoding is most of the work
SIZES = {"mixed": ((64, (32, 1024), (16, 256)), (8, (16, 128), (8, 32))),
         "chat": ((32, (16, 128), (128, 256)), (8, (16, 64), (32, 64))),
         "long": ((16, (2048, 3968), (64, 128)), (16, (2048, 3072), (16, 32))),
         "long-decode": ((16, (1536, 3072), (512, 512)), (16, (1536, 2048), (64, 64)))}


def workload(name: str, tokenizer, quick: bool, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    text = corpus_tokens(tokenizer, 200_000 if not quick else 20_000)

    def window(n: int) -> list[int]:
        start = rng.randrange(0, len(text) - n)
        return text[start:start + n]

    if name in SIZES:
        count, prompt_range, out_range = SIZES[name][quick]
        return [Request(window(rng.randint(*prompt_range)), rng.randint(*out_range)) for _ in range(count)]
    if name == "shared":
        count, system_len, out_range = (4, 200, (8, 16)) if quick else (64, 1000, (16, 64))
        system = window(system_len)
        return [Request(system + window(rng.randint(32, 128)), rng.randint(*out_range)) for _ in range(count)]
    raise ConfigError(f"unknown workload {name!r}; choose mixed, shared, chat, long or long-decode")


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _summary(name, contender, max_batch, block_format, prefix, reqs, seconds, first, done, peak, computed, hits=0,
             preemptions=0) -> RunResult:
    prompt_tokens = sum(len(r.prompt) for r in reqs)
    output_tokens = sum(r.max_tokens for r in reqs)
    tpot = [(done[i] - first[i]) / (r.max_tokens - 1) for i, r in enumerate(reqs) if r.max_tokens > 1]
    ttft = list(first.values())
    return RunResult(name, contender, max_batch, block_format, prefix, len(reqs), prompt_tokens, output_tokens, seconds,
                     output_tokens / seconds, (prompt_tokens + output_tokens) / seconds, len(reqs) / seconds,
                     statistics.median(ttft), _percentile(ttft, 0.99), statistics.median(tpot) if tpot else 0.0,
                     _percentile(tpot, 0.99), peak, computed, hits, preemptions)


def run_sequential(loaded, name: str, reqs: list[Request]) -> RunResult:
    """kvlab's generate, one request after another (each with its own dense cache)."""
    import torch

    from ..cache import CacheGeometry, make_cache
    from ..generate import generate

    first, done, peak = {}, {}, 0
    start = time.perf_counter()
    for i, r in enumerate(reqs):
        cache = make_cache("dense", CacheGeometry.for_model(loaded.config, capacity=len(r.prompt) + r.max_tokens))

        def on_token(_ids, i=i):
            first.setdefault(i, time.perf_counter() - start)

        generate(loaded.model, torch.tensor([r.prompt]), cache, r.max_tokens, on_token=on_token)
        done[i] = time.perf_counter() - start
        peak = max(peak, cache.nbytes)
    seconds = time.perf_counter() - start
    return _summary(name, "sequential", 1, "dense", False, reqs, seconds, first, done, peak, sum(len(r.prompt) for r in reqs))


def run_engine(loaded, name: str, reqs: list[Request], max_batch: int, block_format: str, prefix: bool,
               kv_budget: str, max_step_tokens: int) -> RunResult:
    from ..serve import Engine, SamplingParams

    engine = Engine(loaded, cache=block_format, kv_budget=kv_budget, max_batch=max_batch,
                    max_step_tokens=max(max_step_tokens, max_batch), prefix_caching=prefix)
    index = {engine.add_request(r.prompt, SamplingParams(max_tokens=r.max_tokens, ignore_eos=True)): i
             for i, r in enumerate(reqs)}
    first, done = {}, {}
    start = time.perf_counter()
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter() - start
        for out in outputs:
            i = index[out.request_id]
            if out.new_token_ids:
                first.setdefault(i, now)
            if out.finished:
                done[i] = now
    seconds = time.perf_counter() - start
    s = engine.stats()
    decode_tokens = s.generated_tokens - len(reqs)     # every token but each request's last is fed back once
    return _summary(name, "engine", max_batch, block_format, prefix, reqs, seconds, first, done, s.kv_bytes_peak,
                    s.computed_tokens - decode_tokens, s.prefix_hit_tokens, s.preemptions)


def run_throughput_bench(model: str | None, quick: bool, workloads: list[str], batches: list[int], formats: list[str],
                         kv_budget: str, max_step_tokens: int, threads: int, out: str | None, json_out: bool,
                         console: Console, sequential: bool = True, weights: str = "auto") -> dict:
    from ..cache import CacheGeometry
    from ..measure import machine_info, torch_threads, write_json
    from ..serve.formats import block_format as parse_block_format
    from ..session import cached_model

    with torch_threads(threads):
        loaded = cached_model(model, "fp32", "cpu", weights)
        geometry = CacheGeometry.for_model(loaded.config)
        for block_format in formats:                      # a bad name fails now, not after the first runs
            parse_block_format(block_format, geometry, 16)
        results: list[RunResult] = []
        for name in workloads:
            reqs = workload(name, loaded.tokenizer, quick)
            runs = [("engine", b, formats[0], True) for b in batches]
            runs += [("engine", max(batches), formats[0], False)]
            runs += [("engine", max(batches), f, True) for f in formats[1:]]
            base = run_sequential(loaded, name, reqs) if sequential else None
            if base:
                results.append(base)
            for _, batch, block_format, prefix in runs:
                console.print(f"[dim]{name}: engine max batch {batch}, {block_format} blocks, prefix caching "
                              f"{'on' if prefix else 'off'}[/]", highlight=False)
                result = run_engine(loaded, name, reqs, batch, block_format, prefix, kv_budget, max_step_tokens)
                if base:
                    result.speedup_vs_sequential = result.output_tokens_per_s / base.output_tokens_per_s
                results.append(result)
    record = {
        "benchmark": "throughput",
        "model": loaded.path.name,
        "weights": loaded.weights,
        "quick": quick,
        "kv_budget": kv_budget,
        "max_step_tokens": max_step_tokens,
        "machine": machine_info(),
        "results": [asdict(r) for r in results],
    }
    if out:
        write_json(out, record)
    if json_out:
        print(json.dumps(record))
        return record
    table = Table(title=f"throughput ({'quick' if quick else 'full'} workloads, greedy, {loaded.weights} weights)")
    for col in ("workload", "contender", "batch", "blocks", "prefix", "out tok/s", "total tok/s", "req/s", "× seq",
                "TTFT p50/p99 s", "TPOT p50/p99 ms", "peak KV MB", "prompt computed", "hits", "preempt"):
        table.add_column(col, justify="left" if col in ("workload", "contender", "blocks", "prefix") else "right")
    for r in results:
        table.add_row(r.workload, r.contender, str(r.max_batch), r.block_format, "on" if r.prefix_caching else "off",
                      f"{r.output_tokens_per_s:.1f}", f"{r.total_tokens_per_s:.1f}", f"{r.requests_per_s:.2f}",
                      f"{r.speedup_vs_sequential:.2f}×" if r.speedup_vs_sequential else "-",
                      f"{r.ttft_p50_s:.2f}/{r.ttft_p99_s:.2f}", f"{r.tpot_p50_s * 1e3:.0f}/{r.tpot_p99_s * 1e3:.0f}",
                      f"{r.peak_kv_bytes / 1e6:.1f}", f"{r.prompt_tokens_computed:,}", f"{r.prefix_hit_tokens:,}",
                      str(r.preemptions))
    console.print(table)
    if out:
        console.print(f"results in {out}")
    return record


def register(bench_app) -> None:
    """Add `kvlab bench throughput` to the bench typer app."""
    import typer

    from ..terminal import console, one_line_errors

    @bench_app.command("throughput")
    @one_line_errors
    def throughput(
        model: Optional[str] = typer.Option(None, "--model"),
        quick: bool = typer.Option(False, "--quick", help="Small workloads (a smoke run, minutes)."),
        workloads: str = typer.Option("mixed,shared", "--workloads", help="mixed | shared | chat | long (16 requests of 2k-4k-token contexts) | long-decode (the same reach, 512 new tokens each), comma-separated."),
        batches: str = typer.Option("1,4,16,32", "--batches", help="Engine max batch sizes."),
        formats: str = typer.Option("dense,dense-f16", "--formats", help="Block formats (dense, dense-f16, dense-bf16, int8, int4, tq4, tq3, ...); the first one runs every batch."),
        kv_budget: str = typer.Option("1GiB", "--kv-budget", help="The engine's KV pool."),
        max_step_tokens: int = typer.Option(512, "--max-step-tokens", min=1),
        threads: int = typer.Option(0, "--threads", min=0, help="torch intra-op threads (0: torch's default)."),
        no_sequential: bool = typer.Option(False, "--no-sequential", help="Skip the sequential generate baseline."),
        weights: str = typer.Option("auto", "--weights", help=WEIGHTS_HELP),
        out: str = typer.Option("bench/results/throughput.json", "--out"),
        json_out: bool = typer.Option(False, "--json"),
    ):
        """Requests/s, tokens/s, TTFT and TPOT of the batched engine against sequential generate."""
        try:
            batch_sizes = [int(b) for b in batches.split(",") if b.strip()]
        except ValueError:
            raise ConfigError(f"--batches must be integers like 1,4,16, got {batches!r}") from None
        if not batch_sizes or min(batch_sizes) < 1:
            raise ConfigError(f"--batches must be positive integers, got {batches!r}")
        names = [w.strip() for w in workloads.split(",") if w.strip()]
        block_formats = [f.strip() for f in formats.split(",") if f.strip()] or ["dense"]
        run_throughput_bench(model, quick, names, batch_sizes, block_formats, kv_budget, max_step_tokens, threads, out,
                             json_out, console, sequential=not no_sequential, weights=weights)
