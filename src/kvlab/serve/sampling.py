"""Per-request sampling: SamplingParams, the batched draw, and what ends a request.

sample_rows draws one token per row of a step's logits (R, V). What changes the logits is applied to the
whole batch at once, as tensor operations over (R, V) (no Python loop over the vocabulary): logit_bias,
repetition_penalty (prompt and output tokens, divided/multiplied as HF and vLLM do), presence and
frequency penalties (output tokens, OpenAI's formula), min_p (relative to the row's most likely token at
its temperature), and a grammar's mask of allowed tokens (grammar.py). Greedy rows take the argmax of the adjusted logits; the others draw through generate.py's
sample_next with their own generator (seeded requests repeat). Logprobs are log_softmax of the model's
raw logits (before any adjustment, as OpenAI and vLLM report them).

A request ends on an EOS id (unless ignore_eos), one of its stop ids, a stop string in its text (the text
returned stops before it), or max_tokens. TextStream turns token ids into text pieces with
generate's StreamDecoder and holds back a tail that could still grow into a stop string. Stop strings are
found by StopMatcher, which reads each new character once (Knuth-Morris-Pratt): the cost per token does not
grow with the text or with the stop strings' length, which MAX_STOP_CHARS bounds anyway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..generate import GREEDY_BELOW, SamplingConfig, sample_next
from ..model.tokenizer import StreamDecoder
from .grammar import Grammar, GrammarState, allowed_mask

MAX_STOP_CHARS = 1_000   # a stop string is a marker ("\nUser:", "</answer>"), not a document
MAX_TOP_LOGPROBS = 20    # OpenAI's bound on top_logprobs
MAX_LOGIT_BIAS = 100.0   # OpenAI's bound on a logit_bias value


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
    presence_penalty: float = 0.0         # [-2, 2]: minus this from every token already generated
    frequency_penalty: float = 0.0        # [-2, 2]: minus this times how often a token was generated
    repetition_penalty: float = 1.0       # > 0: tokens of the prompt or the output are divided (positive logits) or
    #                                       multiplied (negative ones) by it; 1 -> off
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias in [-100, 100]) added to the logits
    min_p: float = 0.0                    # [0, 1]: drop tokens less likely than min_p times the most likely one
    logprobs: int | None = None           # None: off; k >= 0: each chosen token's logprob and the k most likely
    n: int = 1                            # choices of one prompt (the prompt's KV is shared, prefilled once)
    grammar: Grammar | None = None        # the output must follow it (a JSON schema, a Lark grammar)

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
        for name, low, high in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0), ("min_p", 0.0, 1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise ConfigError(f"{name} must be a number in [{low:g}, {high:g}], got {value!r}")
        rp = self.repetition_penalty
        if isinstance(rp, bool) or not isinstance(rp, (int, float)) or not 0 < rp <= 100:
            raise ConfigError(f"repetition_penalty must be a number in (0, 100], got {rp!r}")
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in dict(self.logit_bias).items()))
        for token, bias in self.logit_bias:
            if token < 0 or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ConfigError(f"logit_bias takes token ids >= 0 and biases in [-100, 100], got {token}: {bias:g}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise ConfigError(f"top logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ConfigError(f"n must be an integer >= 1, got {self.n!r}")
        self.config  # temperature / top_k / top_p ranges: SamplingConfig's checks, one place

    @property
    def config(self) -> SamplingConfig:
        """The same settings as generate.py takes them."""
        return SamplingConfig(temperature=float(self.temperature), top_k=self.top_k, top_p=float(self.top_p), seed=self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def counts_tokens(self) -> bool:
        """The penalties need the request's token counts (TokenCounts)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def adjusts_logits(self) -> bool:
        return (self.counts_tokens or bool(self.logit_bias) or (self.min_p > 0 and not self.greedy)
                or self.grammar is not None)

    def generator(self, device: torch.device) -> torch.Generator | None:
        """A fresh generator for one request: seeded like generate() seeds its own, else None (torch's global RNG)."""
        return None if self.seed is None else torch.Generator(device=device).manual_seed(self.seed)


class TokenCounts:
    """What the penalties of one request need: which tokens its prompt holds, how often each was generated."""

    def __init__(self, vocab: int, prompt_ids: list[int], device="cpu"):
        self.in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)      # (V,)
        self.in_prompt[torch.tensor(prompt_ids, dtype=torch.long, device=device)] = True
        self.generated = torch.zeros(vocab, dtype=torch.float32, device=device)   # (V,)

    def add(self, token: int) -> None:
        self.generated[token] += 1

    def copy(self) -> "TokenCounts":
        twin = object.__new__(TokenCounts)
        twin.in_prompt, twin.generated = self.in_prompt, self.generated.clone()   # the prompt is shared
        return twin


@dataclass(frozen=True)
class Draw:
    """One sampled token; with logprobs asked, its logprob and the k most likely (token id, logprob) of its row."""

    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


def adjust_logits(logits: torch.Tensor, params: list[SamplingParams], counts: list[TokenCounts | None],
                  grammars: list[GrammarState | None] | None = None) -> torch.Tensor:
    """logits (R, V) fp32 -> (R, V) with each row's logit_bias, penalties, min_p and grammar mask applied, all rows
    at once."""
    R, V = logits.shape
    device = logits.device
    constrained = [r for r in range(R) if grammars is not None and grammars[r] is not None]
    if constrained:
        allowed = allowed_mask([grammars[r] for r in constrained], V, device)     # (Rg, V)
        sub = logits[constrained].masked_fill(~allowed, float("-inf"))
        logits = logits.index_copy(0, torch.tensor(constrained, device=device), sub)
    biased = [(r, t, b) for r, p in enumerate(params) for t, b in p.logit_bias if t < V]
    if biased:
        rows, tokens, values = zip(*biased)
        logits = logits.index_put((torch.tensor(rows, device=device), torch.tensor(tokens, device=device)),
                                  torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)
    counted = [r for r, p in enumerate(params) if p.counts_tokens]
    if counted:
        sub = logits[counted]                                                        # (Rc, V)
        generated = torch.stack([counts[r].generated for r in counted])             # (Rc, V)
        seen = torch.stack([counts[r].in_prompt for r in counted]) | (generated > 0)
        column = lambda name: torch.tensor([getattr(params[r], name) for r in counted], device=device)[:, None]  # noqa: E731
        repetition = column("repetition_penalty")                                   # (Rc, 1)
        sub = torch.where(seen, torch.where(sub > 0, sub / repetition, sub * repetition), sub)
        sub = sub - column("frequency_penalty") * generated - column("presence_penalty") * (generated > 0)
        logits = logits.index_copy(0, torch.tensor(counted, device=device), sub)
    floored = [r for r, p in enumerate(params) if p.min_p > 0 and not p.greedy]
    if floored:
        # p_i < min_p * p_max  <=>  logit_i < logit_max + T * log(min_p)  (at the row's temperature T)
        sub = logits[floored]
        lift = torch.tensor([params[r].temperature * math.log(params[r].min_p) for r in floored], device=device)
        sub = sub.masked_fill(sub < sub.max(dim=-1, keepdim=True).values + lift[:, None], float("-inf"))
        logits = logits.index_copy(0, torch.tensor(floored, device=device), sub)
    return logits


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                greedy: torch.Tensor | None = None, counts: list[TokenCounts | None] | None = None,
                draws_per_row: list[int] | None = None, grammars: list[GrammarState | None] | None = None,
                ) -> list[list[Draw]]:
    """logits (R, V), one row per request -> each row's draws (one, or draws_per_row[r] for a prompt's n choices).
    Greedy rows share one argmax: `greedy` (R,) when the caller has it already (the fused head's), else torch's."""
    R = logits.shape[0]
    counts = counts if counts is not None else [None] * R
    draws_per_row = draws_per_row or [1] * R
    adjusted = [r for r, p in enumerate(params) if p.adjusts_logits]
    work = adjust_logits(logits.float(), params, counts, grammars) if adjusted else logits
    if adjusted or greedy is None:
        greedy = work.argmax(dim=-1)                                                  # (R,)
    argmax = greedy.tolist()
    tokens: list[list[int]] = []
    for r, (p, generator) in enumerate(zip(params, generators)):
        if p.greedy:
            tokens.append([argmax[r]] * draws_per_row[r])
        else:
            row = work[r:r + 1]
            tokens.append([int(sample_next(row, p.config, generator)[0]) for _ in range(draws_per_row[r])])
    wanted = [r for r, p in enumerate(params) if p.logprobs is not None]
    if not wanted:
        return [[Draw(t) for t in row] for row in tokens]
    logprobs = torch.log_softmax(logits[wanted].float(), dim=-1)                      # (Rw, V): the model's own
    k = max(params[r].logprobs for r in wanted)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    out = [[Draw(t) for t in row] for row in tokens]
    for i, r in enumerate(wanted):
        chosen = logprobs[i, torch.tensor(tokens[r])].tolist()
        top = tuple(zip(top_ids[i, :params[r].logprobs].tolist(), top_values[i, :params[r].logprobs].tolist()))
        out[r] = [Draw(t, lp, top) for t, lp in zip(tokens[r], chosen)]
    return out


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
