"""Constrained decoding: a request's output held to a grammar (a JSON schema, any JSON object, or a Lark grammar)
token by token, with llguidance.

A Grammar is the request's immutable description (it lives in SamplingParams); a GrammarState is one sequence's
matcher over it. Each step, `allowed_mask` fills one packed bitmask row per constrained sequence and the sampler
applies them to the batch's logits in one tensor operation (sampling.py), so a constrained request does not slow
the others by more than its own mask (~28 us median on SmolLM2's 49,152 tokens: bench/results/grammar_mask.json).

llguidance over xgrammar (both measured on this CPU by bench/grammar_mask.py): xgrammar's median mask is faster
(~5 us against ~28 us, both under 0.1% of a decode step), but llguidance compiles a schema faster (1.6-50 ms
against 35-150 ms: an agent sends new tool schemas with every request) and installs with no dependencies, where
xgrammar's wheel requires torch, transformers and triton.
"""

from __future__ import annotations

import json
import threading
import warnings
from dataclasses import dataclass

import torch

from ..errors import ConfigError, KvlabError


@dataclass(frozen=True)
class Grammar:
    kind: str        # "json_schema" | "lark"
    source: str      # the schema as JSON text, or the Lark grammar

    @classmethod
    def json_schema(cls, schema: dict) -> "Grammar":
        # key order kept: properties are generated in it; whitespace as json.dumps writes it (a model left free to
        # add blank lines may add them until max_tokens)
        options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        return cls("json_schema", json.dumps({**schema, "x-guidance": options}))

    @classmethod
    def json_object(cls) -> "Grammar":
        return cls.json_schema({"type": "object"})

    def llguidance_grammar(self) -> str:
        llguidance = _llguidance()
        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(self.source)
        return llguidance.grammar_from("lark", self.source)


def _llguidance():
    try:
        import llguidance
        with warnings.catch_warnings():     # its torch helpers use torch.jit.script, which torch now deprecates
            warnings.simplefilter("ignore", DeprecationWarning)
            import llguidance.torch  # noqa: F401  (the bitmask helpers)
    except ImportError:
        raise KvlabError("constrained output (response_format, tool_choice) needs llguidance: "
                         "pip install 'kvlab[serve]'") from None
    return llguidance


class GrammarTokenizer:
    """llguidance's view of a kvlab Tokenizer (built once, ~2 s for a 49k vocabulary: on first use)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._built = None
        self._lock = threading.Lock()

    def get(self):
        with self._lock:
            if self._built is None:
                llguidance = _llguidance()
                eos = self.tokenizer.eos_ids[0] if self.tokenizer.eos_ids else None
                self._built = llguidance.LLTokenizer(self.tokenizer.backend.to_str(), eos_token=eos)
            return self._built


class GrammarState:
    """One sequence's position in its grammar."""

    def __init__(self, grammar: Grammar, tokenizer: GrammarTokenizer, matcher=None):
        self.grammar, self.tokenizer = grammar, tokenizer
        if matcher is None:
            llguidance = _llguidance()
            matcher = llguidance.LLMatcher(tokenizer.get(), grammar.llguidance_grammar())
            if matcher.is_error():
                raise ConfigError(f"the output grammar is not valid: {matcher.get_error()}")
        self.matcher = matcher

    def consume(self, token: int) -> None:
        if not self.matcher.is_stopped():
            self.matcher.consume_token(token)

    def copy(self) -> "GrammarState":
        return GrammarState(self.grammar, self.tokenizer, self.matcher.deep_copy())

    @property
    def done(self) -> bool:
        """The output is complete: nothing but an end of sequence may follow."""
        return self.matcher.is_stopped()


def allowed_mask(states: list[GrammarState], vocab: int, device) -> torch.Tensor:
    """(R, vocab) bool: the tokens each state allows next (tokens past the tokenizer's vocabulary never)."""
    lt = _llguidance().torch
    n_tokens = states[0].tokenizer.get().vocab_size
    bitmask = lt.allocate_token_bitmask(len(states), n_tokens)                  # (R, ceil(n / 32)) int32
    for row, state in enumerate(states):
        lt.fill_next_token_bitmask(state.matcher, bitmask, row)
    bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1      # (R, W, 32)
    mask = bits.reshape(len(states), -1)[:, :n_tokens].bool()                   # (R, n)
    if n_tokens < vocab:
        mask = torch.cat([mask, torch.zeros(len(states), vocab - n_tokens, dtype=torch.bool)], dim=1)
    return mask[:, :vocab].to(device)
