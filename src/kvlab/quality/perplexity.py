"""Perplexity with every scored token attending to the cache under test.

Protocol (the ANCHORS.md one): each window of `length` tokens gets a fresh cache; the first
`prefill` tokens go in one forward pass (their logits are not scored), then the rest in chunks of
`chunk` tokens. Each chunk's queries attend to everything the cache stores (the compressed past and,
because a cache appends before it attends, the chunk's own K/V as the cache stores them). The
logits at positions prefill .. length-2 are scored against the next token: length-prefill-1
tokens per window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..cache import KVCache


@dataclass(frozen=True)
class WindowProtocol:
    length: int = 512       # tokens per window
    prefill: int = 64       # tokens fed in the first pass (not scored)
    chunk: int = 32         # tokens per later pass
    n_windows: int = 16

    @property
    def scored_per_window(self) -> int:
        return self.length - self.prefill - 1


def chunk_spans(length: int, prefill: int, chunk: int) -> list[tuple[int, int]]:
    """The protocol's passes over `length` tokens: [0, prefill), then `chunk` tokens at a time -> [(start, stop)]."""
    starts = [0, prefill, *range(prefill + chunk, length, chunk)]
    return [(a, min(b, length)) for a, b in zip(starts, [*starts[1:], length]) if a < min(b, length)]


@torch.inference_mode()
def chunked_logits(model, tokens: torch.Tensor, cache: KVCache, prefill: int, chunk: int) -> torch.Tensor:
    """tokens: (1, W) -> float32 logits (W - prefill, V) for positions prefill .. W-1."""
    out = [model(tokens[:, a:b], cache)[0].float() for a, b in chunk_spans(tokens.shape[1], prefill, chunk)]
    return torch.cat(out[1:] if prefill else out, dim=0)               # (W - prefill, V)


def window_nll(logits: torch.Tensor, tokens: torch.Tensor, prefill: int) -> torch.Tensor:
    """Negative log-likelihood of tokens[prefill+1:] under logits[:-1]; (W - prefill - 1,) float64."""
    targets = tokens[0, prefill + 1:]                                  # (N,)
    return F.cross_entropy(logits[:-1], targets, reduction="none").double()


def run_window(model, tokens: torch.Tensor, make: Callable[[], KVCache], protocol: WindowProtocol) -> tuple[torch.Tensor, int]:
    """(scored logits (N, V), cache bytes) for one window with a fresh cache from `make`."""
    cache = make()
    logits = chunked_logits(model, tokens, cache, protocol.prefill, protocol.chunk)
    return logits[:-1], cache.nbytes
