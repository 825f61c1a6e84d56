"""What the CLI commands do, as plain functions: load a model, run a cache, report the numbers."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
from rich.table import Table

from .cache import CacheGeometry, describe_formula, expected_nbytes, make_cache
from .generate import GenerationResult, SamplingConfig, generate
from .model.loader import LoadedModel, load_model, parse_dtype
from .model.tokenizer import StreamDecoder


@functools.lru_cache(maxsize=2)
def cached_model(path: str | None, dtype: str = "fp32", device: str = "cpu") -> LoadedModel:
    """One load per (model, dtype, device) in a process: the demo and benchmarks reuse it."""
    return load_model(path, parse_dtype(dtype), device)


def encode_prompt(loaded: LoadedModel, prompt: str, chat: bool) -> list[int]:
    tokenizer = loaded.tokenizer
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        return tokenizer.encode(text, add_special=False)
    return tokenizer.encode(prompt)


@dataclass
class GenerationRun:
    text: str
    cache_name: str
    result: GenerationResult

    def to_json(self) -> dict:
        r = self.result
        return {
            "text": self.text,
            "token_ids": r.token_ids[0],
            "prompt_tokens": r.prompt_tokens,
            "new_tokens": r.new_tokens,
            "prefill_seconds": round(r.prefill_seconds, 6),
            "decode_tokens_per_s": round(r.decode_tokens_per_s, 3),
            "cache": self.cache_name,
            "cache_bytes": r.cache_bytes,
            "stop_reason": r.stop_reason,
        }

    def summary_line(self) -> str:
        r = self.result
        return (
            f"[dim]prompt {r.prompt_tokens} tokens · new {r.new_tokens} tokens · prefill {r.prefill_seconds * 1000:.0f} ms · "
            f"decode {r.decode_tokens_per_s:.1f} tokens/s · cache {self.cache_name} {r.cache_bytes:,} bytes · stop: {r.stop_reason}[/]"
        )


def run_generation(
    prompt: str,
    model: str | None = None,
    cache: str = "dense",
    dtype: str = "fp32",
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    chat: bool = False,
    capacity: int | None = None,
    chunk_size: int | None = None,
    device: str = "cpu",
    stream: Callable[[str], None] | None = None,
) -> GenerationRun:
    loaded = cached_model(model, dtype, device)
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    ids = encode_prompt(loaded, prompt, chat)
    capacity = capacity or len(ids) + max_new_tokens
    geometry = CacheGeometry.for_model(loaded.config, batch=1, capacity=capacity)
    kv = make_cache(cache, geometry, dtype=loaded.dtype, device=loaded.device)
    decoder = StreamDecoder(loaded.tokenizer)
    on_token = None
    if stream is not None:
        on_token = lambda next_ids: stream(decoder.push(int(next_ids[0])))  # noqa: E731
    prompt_ids = torch.tensor([ids], device=loaded.device)
    result = generate(loaded.model, prompt_ids, kv, max_new_tokens, sampling, loaded.tokenizer.eos_ids, chunk_size, on_token)
    text = loaded.tokenizer.decode(result.token_ids[0], skip_special=True)
    return GenerationRun(text=text, cache_name=cache, result=result)


INFO_CACHES = ("dense", "int8", "int4", "tq4", "tq3.5", "tq3", "tq2.5", "tq-k4v3")


def cache_cost(name: str, config, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes per token, fixed bytes) of cache `name` for one sequence, from the caches' own formula."""
    small, large = 1024, 2048
    at = {n: expected_nbytes(name, CacheGeometry.for_model(config, capacity=n), dtype, n) for n in (small, large)}
    per_token = (at[large] - at[small]) // (large - small)
    return per_token, at[small] - per_token * small


def model_info(model: str | None, caches: tuple[str, ...] = INFO_CACHES) -> tuple[dict, Table]:
    """Shape facts, the KV-bytes-per-token formula with the model's own numbers, and each cache's cost."""
    c = cached_model(model).config
    rows = []
    for dtype_name, nbytes in (("fp32", 4), ("bf16", 2)):
        per_token = 2 * c.n_layers * c.n_kv_heads * c.head_dim * nbytes
        formula = f"2 × {c.n_layers} layers × {c.n_kv_heads} kv_heads × {c.head_dim} head_dim × {nbytes} bytes"
        rows.append({"kv_type": dtype_name, "bytes_per_token": per_token, "formula": formula})
    bf16_per_token = rows[1]["bytes_per_token"]
    cache_rows = []
    for name in caches:
        per_token, fixed = cache_cost(name, c, torch.bfloat16)
        cache_rows.append({
            "cache": name, "bytes_per_token": per_token, "fixed_bytes": fixed,
            "vs_bf16": bf16_per_token / per_token, "formula": describe_formula(name, CacheGeometry.for_model(c), torch.bfloat16),
        })
    record = {
        "model": c.name,
        "arch": c.arch,
        "layers": c.n_layers,
        "heads": c.n_heads,
        "kv_heads": c.n_kv_heads,
        "head_dim_k": c.head_dim,
        "head_dim_v": c.head_dim,
        "attention": "MHA" if c.group_size == 1 else ("MQA" if c.n_kv_heads == 1 else f"GQA ({c.group_size} query heads per KV head)"),
        "d_model": c.d_model,
        "vocab_size": c.vocab_size,
        "context_length": c.max_seq_len,
        "kv_bytes_per_token": rows,
        "caches": cache_rows,
    }
    table = Table(title=f"{c.name} ({c.arch})")
    table.add_column("fact")
    table.add_column("value", justify="right")
    for key in ("layers", "heads", "kv_heads", "head_dim_k", "head_dim_v", "attention", "d_model", "vocab_size", "context_length"):
        table.add_row(key, str(record[key]))
    for row in rows:
        table.add_row(f"KV bytes/token ({row['kv_type']})", f"{row['formula']} = {row['bytes_per_token']:,}")
    for row in cache_rows:
        table.add_row(
            f"cache {row['cache']} (bf16 compute)",
            f"{row['bytes_per_token']:,} B/token ({row['vs_bf16']:.2f}× smaller than bf16) + {row['fixed_bytes']:,} B fixed; {row['formula']}",
        )
    return record, table
