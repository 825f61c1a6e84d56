"""Run the quality evaluation for a list of caches: one record per cache, dense as the reference."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from ..backends import KvlabEngine, formula_bytes_per_token
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
    return formula_bytes_per_token(name, config, BYTES_TOKENS, BYTES_DTYPE)


def corpus_windows(tokenizer, protocol: WindowProtocol) -> list[torch.Tensor]:
    ids = tokenizer.encode(corpus_text(), add_special=False)
    return [torch.tensor([w]) for w in windows(ids, protocol.n_windows, protocol.length)]


def perplexity_suite(loaded, names: list[str], protocol: WindowProtocol, advance=None,
                     token_windows: list[torch.Tensor] | None = None, engine=None) -> list[CacheQuality]:
    """The engine's reference first (dense; hf:dynamic for transformers), then every cache in `names`, window by window.

    `advance()` is called after each (window, cache) pass, for a progress bar. `token_windows`: the
    corpus windows when the caller cut them already (default: cut them here). `engine`: the backend
    running `loaded` (kvlab.backends; default kvlab's own).
    """
    engine = engine or KvlabEngine(loaded)
    model, reference_name = loaded.model, engine.reference
    names = [reference_name] + [n for n in names if n != reference_name]
    sums = {n: {"nll": 0.0, "kl": 0.0, "top1": 0, "count": 0} for n in names}
    for tokens in token_windows if token_windows is not None else corpus_windows(loaded.tokenizer, protocol):
        reference = None
        for name in names:
            logits, _ = run_window(model, tokens, lambda: engine.make_cache(name, protocol.length), protocol)
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
    dense_ppl = math.exp(sums[reference_name]["nll"] / sums[reference_name]["count"])
    for name in names:
        s = sums[name]
        ppl = math.exp(s["nll"] / s["count"])
        per_token, bits = engine.bytes_per_token(name, BYTES_TOKENS, BYTES_DTYPE, protocol.prefill, protocol.chunk)
        records.append(CacheQuality(
            cache=name, bytes_per_token=round(per_token, 1), bits_per_value=round(bits, 3), ppl=ppl,
            ppl_delta_pct=100 * (ppl / dense_ppl - 1), kl=s["kl"] / s["count"], top1_agreement=s["top1"] / s["count"],
            scored_tokens=s["count"],
        ))
    return records
