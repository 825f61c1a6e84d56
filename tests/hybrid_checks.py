"""The checks every hybrid decoder passes against transformers (used by test_qwen35.py and test_gemma3.py)."""

from __future__ import annotations

import torch

from kvlab.generate import generate
from kvlab.model.layer_caches import model_cache

TOLERANCE = 1e-4


def reference_logits(reference, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return reference(ids).logits                                    # (1, T, vocab): one pass, no cache


def check_prefill_forms(loaded, reference, ids: torch.Tensor, chunk: int = 7, **cache_options) -> float:
    """kvlab's logits at every position equal transformers' in one pass, in chunks of `chunk` and token by token;
    returns the largest difference."""
    ref = reference_logits(reference, ids)
    T = ids.shape[1]
    worst = 0.0
    with torch.no_grad():
        one = loaded.model(ids, model_cache(loaded.config, "dense", capacity=T, **cache_options))
        cache = model_cache(loaded.config, "dense", capacity=T, **cache_options)
        chunks = torch.cat([loaded.model(ids[:, a:a + chunk], cache) for a in range(0, T, chunk)], dim=1)
        cache = model_cache(loaded.config, "dense", capacity=T, **cache_options)
        steps = torch.cat([loaded.model(ids[:, t:t + 1], cache) for t in range(T)], dim=1)
    for ours in (one, chunks, steps):
        assert ours.shape == ref.shape
        worst = max(worst, (ours - ref).abs().max().item())
    assert worst < TOLERANCE, worst
    assert ref.abs().max().item() > 1.0                                  # the logits really spread (not a zero model)
    return worst


def check_greedy(loaded, reference, ids: torch.Tensor, new_tokens: int = 64, chunk_size: int | None = None) -> list[int]:
    """kvlab's greedy continuation equals transformers' for `new_tokens` tokens."""
    cache = model_cache(loaded.config, "dense", capacity=ids.shape[1] + new_tokens)
    ours = generate(loaded.model, ids, cache, new_tokens, chunk_size=chunk_size).token_ids[0]
    with torch.no_grad():
        ref = reference.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    assert ours == ref[0, ids.shape[1]:].tolist()
    return ours
