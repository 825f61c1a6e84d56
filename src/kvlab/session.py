"""What the CLI commands do, as plain functions: load a model, run a cache, report the numbers."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

import torch

from .cache import CacheGeometry, describe_formula, expected_nbytes
from .errors import ConfigError
from .generate import GenerationResult, SamplingConfig, check_fits, generate, model_context
from .limits import check_int
from .model.loader import LoadedModel, cached_model  # noqa: F401  (cached_model: importable from here)
from .model.fused import decode_step_kind
from .model.tokenizer import StreamDecoder

if TYPE_CHECKING:
    from rich.table import Table


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
    weights: str = "dense"         # what the model holds: native (GGUF blocks) or dense
    decode_step: str = "modules"   # "fused": one C call per decode token (kvlab.model.fused)

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
            "weights": self.weights,
            "decode_step": self.decode_step,
        }

    def summary_line(self) -> str:
        r = self.result
        return (
            f"[dim]prompt {r.prompt_tokens} tokens · new {r.new_tokens} tokens · prefill {r.prefill_seconds * 1000:.0f} ms · "
            f"decode {r.decode_tokens_per_s:.1f} tokens/s ({self.weights} weights, {self.decode_step} step) · "
            f"cache {self.cache_name} {r.cache_bytes:,} bytes · stop: {r.stop_reason}[/]"
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
    weights: str = "auto",
    backend: str = "kvlab",
) -> GenerationRun:
    from .backends import check_backend, load_runtime

    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    backend = check_backend(backend, [cache])   # before any loading
    runtime = load_runtime(backend, model, dtype, device, weights)
    loaded = runtime.loaded
    context = model_context(loaded.model)
    if capacity is not None:
        check_int(capacity, "--capacity", 1, context, "the model's context" if context else "")
    ids = encode_prompt(loaded, prompt, chat)
    check_fits(len(ids), max_new_tokens, context, capacity)  # before the cache is allocated, not after
    capacity = capacity or len(ids) + max_new_tokens
    kv = runtime.make_cache(cache, capacity)
    decoder = StreamDecoder(loaded.tokenizer)
    on_token = None
    if stream is not None:
        on_token = lambda next_ids: stream(decoder.push(int(next_ids[0])))  # noqa: E731
    prompt_ids = torch.tensor([ids], device=loaded.device)
    result = generate(loaded.model, prompt_ids, kv, max_new_tokens, sampling, loaded.tokenizer.eos_ids, chunk_size, on_token)
    text = loaded.tokenizer.decode(result.token_ids[0], skip_special=True)
    step = decode_step_kind(loaded.model, kv) if backend == "kvlab" else "transformers"
    return GenerationRun(text=text, cache_name=getattr(kv, "name", cache), result=result, weights=loaded.weights,
                         decode_step=step)


INFO_CACHES = ("dense", "int8", "int4", "tq4", "tq-k4v4", "tq3.5", "tq3", "tq-k3v3", "tq2.5", "tq-k4v3")


def cache_cost(name: str, geometry: CacheGeometry, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes per token, fixed bytes) of cache `name` for one sequence, from the caches' own formula."""
    small, large = 1024, 2048
    at = {n: expected_nbytes(name, replace(geometry, capacity=n), dtype, n) for n in (small, large)}
    per_token = (at[large] - at[small]) // (large - small)
    return per_token, at[small] - per_token * small


def model_info(model: str | None, caches: tuple[str, ...] = INFO_CACHES) -> tuple[dict, Table]:
    """Shape facts, the KV-bytes-per-token formula with the model's own numbers, and each cache's cost.

    Reads only the model's header or config (any model `kvlab plan` reads: file, folder, catalog name).
    """
    from .model.loader import default_model_path
    from .sources import load_spec
    from .sources.layers import layer_pattern

    spec = load_spec(str(model) if model else str(default_model_path()))
    attention = [layer for layer in spec.layers if layer.kind in ("full", "sliding")]
    if not attention:
        raise ConfigError(f"{spec.name} has no standard attention layers; `kvlab plan {model or ''}` breaks its state down")
    shapes = Counter((layer.n_heads, layer.n_kv_heads, layer.head_dim_k, layer.head_dim_v) for layer in attention)
    (n_heads, n_kv, dim_k, dim_v), _ = shapes.most_common(1)[0]
    uniform = len(shapes) == 1
    group = n_heads // n_kv
    rows = []
    for dtype_name, nbytes in (("fp32", 4), ("bf16", 2)):
        per_token = sum(layer.n_kv_heads * (layer.head_dim_k + layer.head_dim_v) for layer in attention) * nbytes
        if uniform and dim_k == dim_v:
            formula = f"2 × {len(attention)} layers × {n_kv} kv_heads × {dim_k} head_dim × {nbytes} bytes"
        else:
            formula = f"Σ over {len(attention)} attention layers of kv_heads × (head_dim_k + head_dim_v) × {nbytes} bytes"
        rows.append({"kv_type": dtype_name, "bytes_per_token": per_token, "formula": formula})
    others = Counter(layer.kind for layer in spec.layers if layer.kind not in ("full", "sliding"))
    record = {
        "model": spec.name,
        "arch": spec.arch,
        "layers": spec.n_layers,
        "attention_layers": len(attention),
        "other_layers": dict(others),
        "heads": n_heads,
        "kv_heads": n_kv,
        "head_dim_k": dim_k,
        "head_dim_v": dim_v,
        "attention": "MHA" if group == 1 else ("MQA" if n_kv == 1 else f"GQA ({group} query heads per KV head)"),
        "d_model": spec.d_model,
        "vocab_size": spec.vocab_size,
        "context_length": spec.context_length,
        "layer_kinds": [layer.kind for layer in spec.layers],
        "layer_pattern": layer_pattern(spec.layers),
        "recurrent_state_bytes": sum(layer.state_elements for layer in spec.layers) * 4,  # per sequence, fp32
        "kv_bytes_per_token": rows,
        "caches": [],
    }
    if uniform:
        geometry = CacheGeometry(n_layers=len(attention), n_kv_heads=n_kv, head_dim=dim_k, head_dim_v=dim_v, n_heads=n_heads)
        bf16_per_token = rows[1]["bytes_per_token"]
        for name in caches:
            per_token, fixed = cache_cost(name, geometry, torch.bfloat16)
            record["caches"].append({
                "cache": name, "bytes_per_token": per_token, "fixed_bytes": fixed, "vs_bf16": bf16_per_token / per_token,
                "formula": describe_formula(name, geometry, torch.bfloat16),
            })
    from rich.table import Table  # here, not at import: generation alone never builds a table (~2 MiB of modules)

    table = Table(title=f"{spec.name} ({spec.arch})")
    table.add_column("fact")
    table.add_column("value", justify="right")
    for key in ("layers", "layer_pattern", "attention_layers", "heads", "kv_heads", "head_dim_k", "head_dim_v", "attention",
                "d_model", "vocab_size", "context_length"):
        table.add_row(key, str(record[key]))
    if record["recurrent_state_bytes"]:
        table.add_row("recurrent state per sequence (fp32)", f"{record['recurrent_state_bytes']:,} B, whatever the context")
    if others:
        table.add_row("other layers (see kvlab plan)", ", ".join(f"{n} {kind}" for kind, n in others.items()))
    for row in rows:
        table.add_row(f"KV bytes/token ({row['kv_type']})", f"{row['formula']} = {row['bytes_per_token']:,}")
    for row in record["caches"]:
        table.add_row(
            f"cache {row['cache']} (bf16 compute)",
            f"{row['bytes_per_token']:,} B/token ({row['vs_bf16']:.2f}× smaller than bf16) + {row['fixed_bytes']:,} B fixed; {row['formula']}",
        )
    return record, table
