"""Run the quality evaluation for a list of caches: one record per cache, dense as the reference."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from ..cache import CacheGeometry, expected_nbytes, make_cache
from .agreement import kl_divergence, top1_matches
from .corpus import corpus_text, windows
from .perplexity import WindowProtocol, run_window, window_nll

#: bytes per token are reported the ANCHORS.md way: everything the cache holds at 511 tokens, bf16 run.
BYTES_TOKENS = 511
BYTES_DTYPE = torch.bfloat16


@dataclass
class CacheQuality:
    cache: str
    bytes_per_token: float
    bits_per_value: float
    ppl: float = math.nan
    ppl_delta_pct: float = math.nan
    kl: float = math.nan
    top1_agreement: float = math.nan
    passkey_accuracy: float | None = None
    scored_tokens: int = 0
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        record = asdict(self)
        extra = record.pop("extra")
        return {**record, **extra}


def bytes_per_token(name: str, config) -> tuple[float, float]:
    """(bytes per token, bits per cached value) of cache `name` holding 511 tokens in a bf16 run."""
    geometry = CacheGeometry.for_model(config, batch=1, capacity=BYTES_TOKENS)
    per_token = expected_nbytes(name, geometry, BYTES_DTYPE, BYTES_TOKENS) / BYTES_TOKENS
    values = config.n_layers * config.n_kv_heads * 2 * config.head_dim
    return per_token, per_token * 8 / values


def corpus_windows(tokenizer, protocol: WindowProtocol) -> list[torch.Tensor]:
    ids = tokenizer.encode(corpus_text(), add_special=False)
    return [torch.tensor([w]) for w in windows(ids, protocol.n_windows, protocol.length)]


def perplexity_suite(loaded, names: list[str], protocol: WindowProtocol, advance=None,
                     token_windows: list[torch.Tensor] | None = None) -> list[CacheQuality]:
    """Dense first (the reference), then every cache in `names`, window by window.

    `advance()` is called after each (window, cache) pass, for a progress bar. `token_windows`: the
    corpus windows when the caller cut them already (default: cut them here).
    """
    model, config = loaded.model, loaded.config
    geometry = CacheGeometry.for_model(config, batch=1, capacity=protocol.length)
    names = ["dense"] + [n for n in names if n != "dense"]
    sums = {n: {"nll": 0.0, "kl": 0.0, "top1": 0, "count": 0} for n in names}
    for tokens in token_windows if token_windows is not None else corpus_windows(loaded.tokenizer, protocol):
        reference = None
        for name in names:
            logits, _ = run_window(model, tokens, lambda: make_cache(name, geometry, loaded.dtype, loaded.device), protocol)
            nll = window_nll(torch.cat([logits, logits[-1:]]), tokens, protocol.prefill)
            s = sums[name]
            s["nll"] += nll.sum().item()
            s["count"] += nll.numel()
            if reference is None:
                reference = logits
            s["kl"] += kl_divergence(reference, logits).sum().item()
            s["top1"] += int(top1_matches(reference, logits).sum())
            if advance:
                advance()
    records = []
    dense_ppl = math.exp(sums["dense"]["nll"] / sums["dense"]["count"])
    for name in names:
        s = sums[name]
        ppl = math.exp(s["nll"] / s["count"])
        per_token, bits = bytes_per_token(name, config)
        records.append(CacheQuality(
            cache=name, bytes_per_token=round(per_token, 1), bits_per_value=round(bits, 3), ppl=ppl,
            ppl_delta_pct=100 * (ppl / dense_ppl - 1), kl=s["kl"] / s["count"], top1_agreement=s["top1"] / s["count"],
            scored_tokens=s["count"],
        ))
    return records
