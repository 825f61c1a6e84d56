"""Per-request sampling: SamplingParams, the draw itself (generate.py's sample_next), and what ends a request.

A request ends on an EOS id (unless ignore_eos), one of its stop ids, a stop string in its text (the text
returned stops before it), or max_tokens. TextStream turns token ids into text pieces with
generate's StreamDecoder and holds back a tail that could still grow into a stop string. Stop strings are
found by StopMatcher, which reads each new character once (Knuth-Morris-Pratt): the cost per token does not
grow with the text or with the stop strings' length, which MAX_STOP_CHARS bounds anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..generate import GREEDY_BELOW, SamplingConfig, sample_next
from ..model.tokenizer import StreamDecoder

MAX_STOP_CHARS = 1_000   # a stop string is a marker ("\nUser:", "</answer>"), not a document


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16                  # new tokens at most (>= 1)
    temperature: float = 0.0              # 0 -> greedy (argmax)
    top_k: int = 0                        # 0 -> off
    top_p: float = 1.0                    # 1 -> off
    seed: int | None = None               # per-request torch.Generator seed (reproducible sampling)
    stop: tuple[str, ...] = ()            # stop strings; the returned text excludes them
    stop_token_ids: tuple[int, ...] = ()  # extra stop ids; the model's EOS ids always stop unless ignore_eos
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        for name, kind in (("temperature", (int, float)), ("top_p", (int, float)), ("top_k", int)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, kind):
                raise ConfigError(f"{name} must be a number, got {value!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ConfigError(f"seed must be an integer or None, got {self.seed!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ConfigError(f"stop strings must be non-empty strings, got {self.stop!r}")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            longest = max(len(s) for s in self.stop)
            raise ConfigError(f"stop strings may be at most {MAX_STOP_CHARS:,} characters long, got one of {longest:,}")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ConfigError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        self.config  # temperature / top_k / top_p ranges: SamplingConfig's checks, one place

    @property
    def config(self) -> SamplingConfig:
        """The same settings as generate.py takes them."""
        return SamplingConfig(temperature=float(self.temperature), top_k=self.top_k, top_p=float(self.top_p), seed=self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def generator(self, device: torch.device) -> torch.Generator | None:
        """A fresh generator for one request: seeded like generate() seeds its own, else None (torch's global RNG)."""
        return None if self.seed is None else torch.Generator(device=device).manual_seed(self.seed)


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                greedy: torch.Tensor | None = None) -> list[int]:
    """logits (R, V), one row per request -> one token id per row. Greedy rows share one argmax: `greedy` (R,) when
    the caller has it already (the fused head's), else torch's."""
    tokens = (logits.argmax(dim=-1) if greedy is None else greedy).tolist()  # (R,)
    for row, (p, generator) in enumerate(zip(params, generators)):
        if not p.greedy:
            tokens[row] = int(sample_next(logits[row:row + 1], p.config, generator)[0])
    return tokens


class StopMatcher:
    """Where stop strings end in a text fed piece by piece: one Knuth-Morris-Pratt automaton per string, so each
    character is read once whatever the strings' lengths (a naive suffix scan is quadratic in them)."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.fallback = [_prefix_function(s) for s in stops]
        self.matched = [0] * len(stops)   # per string: its longest prefix that ends the text so far

    def feed(self, piece: str) -> int | None:
        """Read `piece`; the index in it one past the first place where a stop string ends, or None."""
        for i, ch in enumerate(piece):
            for k, stop in enumerate(self.stops):
                q, back = self.matched[k], self.fallback[k]
                while q and stop[q] != ch:
                    q = back[q - 1]
                if stop[q] == ch:
                    q += 1
                if q == len(stop):
                    return i + 1
                self.matched[k] = q
        return None

    @property
    def partial(self) -> int:
        """Characters at the end of the text that could still grow into a stop string."""
        return max(self.matched, default=0)


def _prefix_function(s: str) -> list[int]:
    """pi[i]: the length of the longest proper prefix of s[:i + 1] that is also its suffix."""
    pi = [0] * len(s)
    for i in range(1, len(s)):
        q = pi[i - 1]
        while q and s[i] != s[q]:
            q = pi[q - 1]
        pi[i] = q + (s[i] == s[q])
    return pi


class TextStream:
    """Incremental text of one request: StreamDecoder pieces, stop strings cut, a possible stop prefix held back."""

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.decoder = StreamDecoder(tokenizer)
        self.stop = stop
        self.matcher = StopMatcher(stop)
        self.pending = ""   # decoded but not handed out: it might be the start of a stop string
        self.text = ""      # handed out so far

    def push(self, token_id: int) -> tuple[str, bool]:
        """(new text to hand out, True if a stop string was reached)."""
        piece = self.decoder.push(token_id)
        if not self.stop:
            return self._emit(piece, ""), False
        end = self.matcher.feed(piece)
        if end is not None:          # the stop string that ended first; the text returned stops before it
            self.pending += piece[:end]
            length = max(len(s) for s in self.stop if self.pending.endswith(s))
            return self._emit(self.pending[:len(self.pending) - length], ""), True
        self.pending += piece
        hold = min(self.matcher.partial, len(self.pending))
        return self._emit(self.pending[:len(self.pending) - hold], self.pending[len(self.pending) - hold:]), False

    def flush(self) -> str:
        """The held-back tail, when the request ends for another reason."""
        return self._emit(self.pending, "")

    def _emit(self, out: str, keep: str) -> str:
        self.pending = keep
        self.text += out
        return out
