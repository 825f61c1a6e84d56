"""`kvlab bench decode --contexts 512,2k,4k,8k`: decode tokens/s of each cache at each context length.

At every context length, each cache is filled with the same random prompt (chunked prefill, timed apart),
then decodes greedily, one token per call, with the model's fused step wherever it serves the cache (the
`step` column says which ran). Caches run in turn within each repeat (A B C A B C …) so the drift of a shared
machine hits all alike; each repeat times `steps` tokens, after `warmup` untimed ones. The cache keeps
growing: repeat r reads context + warmup + r·steps … tokens, all within the model's context (a context
too long for that is lowered to fit, and the table shows the one measured).

Achieved bandwidth = (weight bytes + K/V bytes read per step) × tokens/s. K/V bytes read per step are the
bytes the cache holds for the tokens it has at mid-run, by the caches' own formula (kvlab.cache.expected_nbytes
via session.cache_cost): a step reads every stored K/V byte once. The read limit is the best of the machine's
read bandwidth measured before and after every repeat (kvlab.measure.read_bandwidth_gb_s).

With `--llama-cpp PYTHON`, `llama.cpp:f16` / `llama.cpp:q8_0` / `llama.cpp:q4_0` in --caches run llama.cpp on the
same GGUF in the same interleaved loop (bench/llama_peer.py): same prompt, same greedy one-token steps, same
threads; its K/V bytes per step are llama.cpp's type sizes.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from ..cache import CacheGeometry
from ..errors import ConfigError
from ..fileio import check_writable, write_json
from ..generate import model_context, prefill
from ..measure import machine_info, read_bandwidth_gb_s, torch_threads
from ..model.config import LLAMA_FAMILY
from ..model.fused import decode_step_kind
from ..model.layer_caches import LayeredCache, model_cache
from ..session import cache_cost, cached_model
from .llama_peer import LlamaPeer, check_python, is_peer, kv_bytes_per_token, peer_kv

DEFAULT_CACHES = "dense,dense-f16,int8,int4,tq4,tq3"
BASELINE = "dense-f16"   # the cache llama.cpp and vLLM store by default: the ratio column's reference


@dataclass
class ContextResult:
    asked: int                   # the context length asked for
    context: int                 # tokens in the cache when the first timed step runs
    cache: str
    step: str                    # "fused" (one C call per token) or "modules"
    tokens_per_s: float          # median over repeats
    samples: list[float]         # tokens/s of each repeat
    prefill_s: float             # the chunked prefill of `context` tokens into this cache
    weight_bytes: int
    kv_bytes_read_per_step: int  # at mid-run
    bandwidth_gb_s: float
    share_of_read_limit: float
    ratio_vs_baseline: float | None = None


def parse_contexts(text: str) -> list[int]:
    """'512,2k,4k,8k' -> [512, 2048, 4096, 8192] (k = 1024, as `kvlab plan --ctx`)."""
    from ..plan.build import parse_ctx

    values = []
    for item in (part.strip() for part in text.split(",")):
        try:
            value = parse_ctx(item) if item else None
        except ConfigError:
            value = None
        if value is None:
            raise ConfigError(f"--contexts takes token counts like 512,2k,4k,8k; {item!r} is not one")
        values.append(value)
    return values


def _timed_steps(model, cache, token: torch.Tensor, n: int) -> tuple[float, torch.Tensor]:
    """(seconds, last token) of n greedy one-token steps starting from `token` (1, 1)."""
    start = time.perf_counter()
    for _ in range(n):
        token = model(token, cache)[:, -1].argmax(-1, keepdim=True)   # (1, 1)
    return time.perf_counter() - start, token


def run_context_bench(model_name, contexts: list[int], caches: list[str], repeats: int, steps: int, warmup: int,
                      threads: int, weights: str, out: str | None, json_out: bool, console: Console,
                      llama_python: str | None = None) -> dict:
    caches = [c.strip().lower() for c in caches if c.strip()]
    if not caches or len(set(caches)) != len(caches):
        raise ConfigError(f"--caches must name at least one cache, each once, got {','.join(caches) or 'nothing'}")
    if out:
        check_writable(out, "--out")   # before the long run, not after it
    peers = [name for name in caches if is_peer(name)]
    if peers and not llama_python:
        raise ConfigError(f"{peers[0]} needs --llama-cpp PYTHON: a Python that imports llama_cpp")
    with torch_threads(threads):
        loaded = cached_model(model_name, "fp32", "cpu", weights)
        if peers:
            for name in peers:
                peer_kv(name)
            if loaded.path.suffix.lower() != ".gguf":
                raise ConfigError(f"llama.cpp contenders run a GGUF file; {loaded.path.name} is not one")
            check_python(llama_python)
        limit = model_context(loaded.model) or max(contexts) + warmup + repeats * steps
        geometry = CacheGeometry.for_model(loaded.config, capacity=1)   # 1: the llama family's cache checks its name
        from ..quality.calibrate import resolve   # the compressed formats load for compressed names only

        # the cache each name builds: tq-k4v4+halloc spelled out with the recipe calibrated for this model
        built = {name: name if is_peer(name) else resolve(name, loaded) for name in caches}
        for name in caches:   # every name (and its bytes) checked before anything runs
            if not is_peer(name):
                model_cache(loaded.config, built[name], capacity=1)
                _cost(built[name], loaded.config, geometry)
        record = _run(loaded, contexts, caches, built, repeats, steps, warmup, limit, console, llama_python)
    record["model"] = loaded.path.name
    if out:
        write_json(out, record, indent=2)
    if json_out:
        print(json.dumps(record))
    else:
        _print_table(record, console, out)
    return record


def _cost(name: str, config, geometry: CacheGeometry) -> tuple[int, int]:
    """(bytes per token, fixed bytes) of cache `name` for one sequence of a model of `config`, fp32: the llama
    family's by the caches' formula; Gemma 3's / Qwen3.5's by LayeredCache's (dense sliding layers and the
    recurrent state are fixed bytes)."""
    if config.arch in LLAMA_FAMILY:
        return cache_cost(name, geometry, torch.float32)
    small, large = 1024, 2048
    at = {n: LayeredCache.expected_nbytes(config, name, 1, n, torch.float32) for n in (small, large)}
    per_token = (at[large] - at[small]) // (large - small)
    return per_token, at[small] - per_token * small


def _run(loaded, contexts, caches, built, repeats, steps, warmup, limit, console, llama_python=None) -> dict:
    model, config = loaded.model, loaded.config
    extra = warmup + repeats * steps                       # tokens each cache takes after the prompt
    if limit <= extra:
        raise ConfigError(f"the model's context of {limit} tokens leaves no room for {extra} decode steps")
    bandwidths = [read_bandwidth_gb_s() * 1e9]
    results: list[ContextResult] = []
    gen = torch.Generator().manual_seed(0)
    prompt_all = torch.randint(100, config.vocab_size - 100, (1, min(max(contexts), limit - extra)), generator=gen)
    with Progress(console=console, transient=True) as progress, torch.inference_mode():
        task = progress.add_task("decode by context", total=len(contexts) * len(caches) * (1 + repeats))
        for asked in contexts:
            context = min(asked, limit - extra)
            prompt = prompt_all[:, :context]
            geometry = CacheGeometry.for_model(config, capacity=context + extra)
            held, tokens, prefill_s = {}, {}, {}
            try:
                for name in caches:
                    progress.update(task, description=f"{context} tokens: prefill {name}")
                    if is_peer(name):
                        held[name] = LlamaPeer(llama_python, loaded.path, context + extra, torch.get_num_threads(), peer_kv(name))
                        prefill_s[name], token = held[name].prefill(prompt)
                        tokens[name] = held[name].steps(token, warmup)[1] if warmup else token
                    else:
                        held[name] = model_cache(config, built[name], capacity=context + extra)
                        start = time.perf_counter()
                        logits = prefill(model, prompt, held[name])
                        prefill_s[name] = time.perf_counter() - start
                        tokens[name] = _timed_steps(model, held[name], logits[:, -1].argmax(-1, keepdim=True), warmup)[1]
                    progress.advance(task)
                samples: dict[str, list[float]] = {name: [] for name in caches}
                for repeat in range(repeats):
                    for name in caches:   # interleaved
                        progress.update(task, description=f"{context} tokens: repeat {repeat + 1}/{repeats} {name}")
                        if is_peer(name):
                            seconds, tokens[name] = held[name].steps(tokens[name], steps)
                        else:
                            seconds, tokens[name] = _timed_steps(model, held[name], tokens[name], steps)
                        samples[name].append(steps / seconds)
                        progress.advance(task)
                    bandwidths.append(read_bandwidth_gb_s() * 1e9)
            finally:
                for contender in held.values():
                    if isinstance(contender, LlamaPeer):
                        contender.close()
            mid = context + warmup + repeats * steps // 2
            for name in caches:
                if is_peer(name):
                    per_token, fixed, step = kv_bytes_per_token(config, peer_kv(name)), 0, "llama.cpp"
                else:
                    (per_token, fixed), step = _cost(built[name], config, geometry), decode_step_kind(model, held[name])
                kv_read = int(per_token * mid + fixed)
                rate = statistics.median(samples[name])
                results.append(ContextResult(
                    asked=asked, context=context, cache=name, step=step,
                    tokens_per_s=rate, samples=[round(s, 3) for s in samples[name]], prefill_s=round(prefill_s[name], 3),
                    weight_bytes=loaded.weight_bytes, kv_bytes_read_per_step=kv_read,
                    bandwidth_gb_s=(loaded.weight_bytes + kv_read) * rate / 1e9, share_of_read_limit=0.0,
                ))
    limit_bw = max(bandwidths)
    for r in results:
        r.share_of_read_limit = r.bandwidth_gb_s * 1e9 / limit_bw
        base = next((b for b in results if b.cache == BASELINE and b.context == r.context), None)
        if base is None:
            base = next(b for b in results if b.context == r.context)   # no dense-f16: the first cache
        r.ratio_vs_baseline = r.tokens_per_s / base.tokens_per_s
    return {
        "benchmark": "decode_contexts",
        "baseline": BASELINE if BASELINE in caches else caches[0],
        "dtype": "fp32",
        "weights": loaded.weights,
        "repeats": repeats,
        "steps": steps,
        "warmup": warmup,
        "threads": torch.get_num_threads(),
        "machine": machine_info(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "read_bandwidth_gb_s": limit_bw / 1e9,
        "read_bandwidth_samples_gb_s": [round(b / 1e9, 2) for b in bandwidths],
        "results": [asdict(r) for r in results],
    }


def _print_table(record: dict, console: Console, out: str | None) -> None:
    table = Table(title=f"decode by context: fp32, {record['weights']} weights, batch 1, greedy, {record['threads']} threads, "
                        f"median of {record['repeats']} × {record['steps']} steps")
    for col in ("context", "cache", "step", "tokens/s", f"× {record['baseline']}", "KV MB/step", "GB/s", "of limit", "prefill s"):
        table.add_column(col, justify="left" if col in ("cache", "step") else "right")
    last = None
    for r in record["results"]:
        if last is not None and r["context"] != last:
            table.add_section()
        last = r["context"]
        context = f"{r['context']:,}" + ("" if r["context"] == r["asked"] else f" ({r['asked']:,} asked)")
        table.add_row(context, r["cache"], r["step"], f"{r['tokens_per_s']:.2f}", f"{r['ratio_vs_baseline']:.2f}×",
                      f"{r['kv_bytes_read_per_step'] / 1e6:.1f}", f"{r['bandwidth_gb_s']:.2f}",
                      f"{r['share_of_read_limit']:.0%}", f"{r['prefill_s']:.1f}")
    console.print(table)
    console.print(f"read limit {record['read_bandwidth_gb_s']:.1f} GB/s (best of {len(record['read_bandwidth_samples_gb_s'])} "
                  f"samples); weights {record['results'][0]['weight_bytes'] / 1e6:.0f} MB read per step"
                  + (f"; results in {out}" if out else ""))
