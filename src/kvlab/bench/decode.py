"""`kvlab bench decode`: batch-1 greedy decode, kvlab's caches against transformers, interleaved in one run.

Every contender generates `new_tokens` after the same `prompt_tokens`-token prompt. Two rates are kept:
  tokens_per_s         new tokens / (prefill + decode) wall time: what a user waits for
  decode_tokens_per_s  (new tokens - 1) / time after the first token: the steady-state decode step rate
Contenders run in turn within each repeat (A B C A B C …) so drift of this shared machine hits all
alike; the table shows medians and each ratio against transformers' default cache in the same dtype.
Bandwidth achieved = (weight bytes + mean KV bytes read per step) × decode steps/s, against the
machine's measured read bandwidth. Weight bytes are what each contender holds and reads every step:
kvlab with native weights reads a GGUF's quantized blocks (kvlab.model.blockquant), `kvlab-dense-weights`
the same values dequantized to the run's dtype, transformers its own dequantized parameters.
`kvlab` decodes with the fused step where it applies (fp32 CPU, dense cache: kvlab.model.fused);
`kvlab-unfused` is the same model with it switched off, so the table shows what the fusion buys.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from ..cache import CacheGeometry, DenseCache
from ..errors import ConfigError
from ..fileio import check_writable, write_json
from ..limits import check_int
from ..generate import check_fits, generate, model_context
from ..model.fused import decode_step_kind, fused_step_off
from ..model.layer_caches import RecurrentState, model_cache
from ..session import cached_model
from ..measure import machine_info, read_bandwidth_gb_s, torch_threads


@dataclass
class DecodeResult:
    engine: str
    cache: str
    dtype: str
    weights: str
    tokens_per_s: float
    decode_tokens_per_s: float
    runs: int
    kv_bytes_read_per_step: float
    weight_bytes: int
    bandwidth_gb_s: float = 0.0
    ratio_vs_transformers: float | None = None
    step: str = "-"            # kvlab's decode step: "fused" (one C call per token) or "modules"


class _FirstTokenClock:
    """A transformers streamer that notes when the first new token arrives (after the prompt)."""

    def __init__(self):
        self.calls = 0
        self.first_token_time = None

    def put(self, value):
        self.calls += 1
        if self.calls == 2:  # call 1 is the prompt itself
            self.first_token_time = time.perf_counter()

    def end(self):
        pass


def _time_kvlab(loaded, prompt, cache_name, new_tokens, fused: bool = True):
    """(tokens/s, decode tokens/s, the decode step that ran). `fused=False`: the same model with its fused
    decode step switched off (each layer's modules run)."""
    cache = model_cache(loaded.config, cache_name, capacity=prompt.shape[1] + new_tokens, dtype=loaded.dtype)
    with fused_step_off(loaded.model, off=not fused):
        start = time.perf_counter()
        result = generate(loaded.model, prompt, cache, new_tokens)
        total = time.perf_counter() - start
        step = decode_step_kind(loaded.model, cache)
    return new_tokens / total, result.decode_tokens_per_s, step


def _time_transformers(hf_model, prompt, use_cache, new_tokens):
    clock = _FirstTokenClock()
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf_model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                use_cache=use_cache, streamer=clock, pad_token_id=0)
    end = time.perf_counter()
    produced = out.shape[1] - prompt.shape[1]
    decode_rate = (produced - 1) / (end - clock.first_token_time) if clock.first_token_time else 0.0
    return produced / (end - start), decode_rate, "-"


ENGINES = ("kvlab", "kvlab-unfused", "kvlab-dense-weights", "transformers")


def _run_contender(contender, models, hf_model, prompt, new_tokens):
    engine, cache = contender.split(":")
    if engine == "transformers":
        return _time_transformers(hf_model, prompt, cache != "none", new_tokens)
    if engine == "kvlab-unfused":
        return _time_kvlab(models["kvlab"], prompt, cache, new_tokens, fused=False)
    return _time_kvlab(models[engine], prompt, cache, new_tokens)


def _load_transformers(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    if path.is_dir():
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()


def _kv_bytes_read_per_step(config, dtype: torch.dtype, prompt_tokens: int, new_tokens: int, cache: str) -> float:
    """Mean K+V bytes attention reads per decode step (the no-cache baselines recompute rather than read): the
    full layers every token, the sliding layers their window at most, and the recurrent layers' state."""
    if cache == "none":
        return 0.0
    per_layer = DenseCache.bytes_per_token(replace(CacheGeometry.for_model(config), n_layers=1), dtype)
    context = prompt_tokens + new_tokens / 2
    window = min(context, config.sliding_window or context)
    return (per_layer * (len(config.layers_of("full")) * context + len(config.layers_of("sliding")) * window)
            + RecurrentState.expected_nbytes(config, 1))


def run_decode_bench(model, prompt_tokens, new_tokens, dtypes, repeats, contenders, out, json_out, console: Console,
                     no_cache_repeats: int = 1, threads: int = 0, weights: str = "auto"):
    with torch_threads(threads):
        return _run(model, prompt_tokens, new_tokens, dtypes, repeats, contenders, out, json_out, console, no_cache_repeats,
                    weights)


def _run(model, prompt_tokens, new_tokens, dtypes, repeats, contenders, out, json_out, console, no_cache_repeats, weights):
    contenders = [c.strip() for c in contenders if c.strip()]
    for c in contenders:
        if c.split(":")[0] not in ENGINES or ":" not in c:
            raise ConfigError(
                f"contender {c!r} must be kvlab:<cache>, kvlab-unfused:<cache>, kvlab-dense-weights:<cache> or transformers:default|none"
            )
    if out:
        check_writable(out, "--out")  # before the long run, not after it
    torch.manual_seed(0)
    bandwidths = [read_bandwidth_gb_s() * 1e9]  # measured again after every repeat; the best is the limit
    results: list[DecodeResult] = []
    with Progress(console=console, transient=True) as progress:
        for dtype_name in dtypes:
            loaded = cached_model(model, dtype_name, "cpu", weights)
            context = model_context(loaded.model)
            check_int(prompt_tokens, "--prompt-tokens", 1, context, "the model's context")  # before the prompt exists
            check_fits(prompt_tokens, new_tokens, context, new_option="--new-tokens")
            models = {"kvlab": loaded}
            if any(c.startswith("kvlab-dense-weights:") for c in contenders):
                models["kvlab-dense-weights"] = cached_model(model, dtype_name, "cpu", "dense")
            hf = _load_transformers(loaded.path, loaded.dtype) if any(c.startswith("transformers") for c in contenders) else None
            prompt = torch.randint(100, loaded.config.vocab_size - 100, (1, prompt_tokens))
            models["kvlab-unfused"] = loaded  # the same model, run with its fused step off
            weight_bytes = {engine: m.weight_bytes for engine, m in models.items()}
            weights_held = {engine: m.weights for engine, m in models.items()}
            if hf is not None:
                weight_bytes["transformers"] = sum(p.nbytes for p in hf.parameters())
                weights_held["transformers"] = "dense"
            samples: dict[str, list[tuple[float, float]]] = {c: [] for c in contenders}
            n_runs = sum(no_cache_repeats if c.endswith(":none") else repeats for c in contenders)
            task = progress.add_task(f"{dtype_name}: {len(contenders)} contenders, {n_runs} runs", total=n_runs)
            for contender in contenders:  # warm-up: a short run each, not counted
                _run_contender(contender, models, hf, prompt[:, :8], 4)
            for repeat in range(repeats):
                for contender in contenders:
                    if contender.endswith(":none") and repeat >= no_cache_repeats:
                        continue  # the recomputing baselines are ~10× slower: fewer runs, same interleaving
                    samples[contender].append(_run_contender(contender, models, hf, prompt, new_tokens))
                    progress.advance(task)
                bandwidths.append(read_bandwidth_gb_s() * 1e9)
            for contender in contenders:
                engine, cache = contender.split(":")
                kv_read = _kv_bytes_read_per_step(loaded.config, loaded.dtype, prompt_tokens, new_tokens, cache)
                decode_rate = statistics.median(s[1] for s in samples[contender])
                results.append(DecodeResult(
                    engine=engine, cache=cache, dtype=dtype_name, weights=weights_held[engine],
                    tokens_per_s=statistics.median(s[0] for s in samples[contender]),
                    decode_tokens_per_s=decode_rate, runs=len(samples[contender]),
                    kv_bytes_read_per_step=kv_read, weight_bytes=weight_bytes[engine],
                    bandwidth_gb_s=(weight_bytes[engine] + kv_read) * decode_rate / 1e9 if cache != "none" else 0.0,
                    step=samples[contender][-1][2],
                ))
    bandwidth = max(bandwidths)
    for r in results:
        base = next((b for b in results if b.engine == "transformers" and b.cache == "default" and b.dtype == r.dtype), None)
        if base and base.tokens_per_s:
            r.ratio_vs_transformers = r.tokens_per_s / base.tokens_per_s
    record = {
        "benchmark": "decode",
        "model": str(cached_model(model, dtypes[0], "cpu", weights).path.name),
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "machine": machine_info(),
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "read_bandwidth_samples_gb_s": [round(b / 1e9, 2) for b in bandwidths],
        "results": [asdict(r) for r in results],
    }
    if out:
        write_json(out, record, indent=2)
    if json_out:
        print(json.dumps(record))
        return record
    table = Table(title=f"decode: {prompt_tokens}-token prompt, {new_tokens} new tokens, batch 1, greedy, median of {repeats} ({no_cache_repeats} for no-cache)")
    for col in ("engine", "cache", "dtype", "weights", "step", "weight MB", "tokens/s", "× transformers", "decode steps/s",
                "bandwidth GB/s", "of limit"):
        table.add_column(col, justify="left" if col in ("engine", "cache", "dtype", "weights", "step") else "right")
    for r in results:
        table.add_row(
            r.engine, r.cache, r.dtype, r.weights, r.step, f"{r.weight_bytes / 1e6:.0f}", f"{r.tokens_per_s:.2f}",
            f"{r.ratio_vs_transformers:.2f}×" if r.ratio_vs_transformers else "-",
            f"{r.decode_tokens_per_s:.2f}",
            f"{r.bandwidth_gb_s:.2f}" if r.bandwidth_gb_s else "-",
            f"{r.bandwidth_gb_s * 1e9 / bandwidth:.0%}" if r.bandwidth_gb_s else "-",
        )
    console.print(table)
    console.print(f"measured read bandwidth: {bandwidth / 1e9:.1f} GB/s ({torch.get_num_threads()} threads); results in {out}")
    return record
