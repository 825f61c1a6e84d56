"""Text that holds up: greedy continuations of fixed prompts through each cache, against dense's.

Perplexity scores the next token of a text the model is given; a user reads the text the model writes, where
one early slip changes everything after it and a cache that makes the model loop ("lost, lost, lost, …") is
worse than its perplexity says. So on PROMPTS (the README's examples, chat questions with a known answer, prose
openings), each cache continues every prompt greedily for `max_new_tokens` tokens (chat questions through the
model's chat template, stopping at its end-of-turn), and against dense's continuation of the same prompt:

  first difference   the first generated position where the cache's token differs from dense's
                     (the continuation's length where they never do); median over prompts, and the share of
                     prompts whose continuation equals dense's
  answers            chat questions whose answer contains the expected word, for the cache and for dense, and
                     how many the cache answers as dense does (both right or both wrong)
  degeneration       the longest repeated n-gram run (the most tokens covered by one n-gram, n ≤ 16, repeated
                     back to back at least twice) and the distinct-4-gram ratio (distinct 4-grams / 4-grams),
                     each averaged over prompts; a cache should stay within 10% of dense's

A TurboQuant cache runs with the first rotation seed of the evaluation.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from ..generate import generate

#: (question, a word every right answer contains), asked through the chat template
QUESTIONS: tuple[tuple[str, str], ...] = (
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What is the capital of Italy?", "Rome"),
    ("What is the capital of Germany?", "Berlin"),
    ("What is the capital of Spain?", "Madrid"),
    ("What is the capital of England?", "London"),
    ("What is the capital of Russia?", "Moscow"),
    ("What is the capital of Egypt?", "Cairo"),
    ("What is the largest planet in our solar system?", "Jupiter"),
    ("Which planet is known as the Red Planet?", "Mars"),
    ("What color is the sky on a clear day?", "blue"),
    ("What color are the leaves of most trees in summer?", "green"),
    ("What is the chemical symbol for water?", "H2O"),
    ("How many days are there in a week?", "seven"),
    ("What is 2 + 2?", "4"),
    ("Who wrote Romeo and Juliet?", "Shakespeare"),
    ("What animal is known as the king of the jungle?", "lion"),
    ("What is the freezing point of water in degrees Celsius?", "0"),
    ("What language is spoken in Brazil?", "Portuguese"),
    ("What is the opposite of hot?", "cold"),
)

#: plain-text openings the model continues (no chat template); the README's first
OPENINGS: tuple[str, ...] = (
    "Once upon a time",
    "The quick brown fox",
    "Now is the winter of our discontent",
    "To be, or not to be, that is the question:",
    "It was the best of times, it was the worst of times,",
    "In the beginning",
    "The history of the Roman Empire",
    "A recipe for bread: first,",
    "The weather today is",
    "My favourite book is",
    "The city was quiet at night, and",
    "Scientists have discovered that",
    "The best way to learn a new language is",
    "Dear diary, today I",
    "The old man walked slowly down the road",
    "Photosynthesis is the process by which",
    "The first rule of programming is",
    "On a cold winter morning,",
    "The ship sailed out of the harbour",
    "Friends, Romans, countrymen, lend me your ears;",
    "Water boils at 100 degrees Celsius because",
    "The little girl opened the box and found",
    "In a small village by the sea,",
    "The most important thing about a good story is",
    "When the sun goes down,",
    "He opened the door and saw",
    "The train was late again, so",
    "Mathematics is the language of",
    "Long ago, in a kingdom far away,",
    "The cat sat on the mat and",
    "Here is a short poem about the moon:",
    "The three most important inventions in history are",
)

#: the README's chat example, answered like the questions
CHAT: tuple[str, ...] = ("Tell me a short story about a dragon.", "Explain what a KV cache is in one sentence.")

MAX_NEW_TOKENS = 64
QUICK_PROMPTS = 8
QUICK_NEW_TOKENS = 16
MAX_NGRAM = 16


@dataclass(frozen=True)
class TextPrompt:
    text: str
    chat: bool                  # through the chat template (a question or a request)
    answer: str | None = None   # a word a right answer contains


@dataclass(frozen=True)
class TextProtocol:
    n_prompts: int = len(QUESTIONS) + len(OPENINGS) + len(CHAT)
    max_new_tokens: int = MAX_NEW_TOKENS

    @classmethod
    def quick(cls) -> "TextProtocol":
        return cls(QUICK_PROMPTS, QUICK_NEW_TOKENS)

    def prompts(self) -> list[TextPrompt]:
        """Questions, openings and chat requests interleaved, so a short run still sees every kind."""
        kinds = [[TextPrompt(q, True, a) for q, a in QUESTIONS], [TextPrompt(o, False) for o in OPENINGS],
                 [TextPrompt(c, True) for c in CHAT]]
        mixed = [p for group in zip(*kinds) for p in group]
        shortest = min(len(k) for k in kinds)
        mixed += [p for k in kinds for p in k[shortest:]]
        return mixed[: self.n_prompts]

    def describe(self) -> str:
        return f"{self.n_prompts} prompts, {self.max_new_tokens} greedy tokens each"


def longest_repeat_run(ids: list[int], max_n: int = MAX_NGRAM) -> int:
    """The most tokens one n-gram (n ≤ max_n) covers repeated back to back at least twice; 0 when none repeats.
    [5, 1, 2, 1, 2, 1, 2, 9] -> 6 ((1, 2) three times)."""
    best = 0
    for n in range(1, min(max_n, len(ids) // 2) + 1):
        for start in range(len(ids) - 2 * n + 1):
            gram, end = ids[start:start + n], start + n
            while ids[end:end + n] == gram:
                end += n
            if end - start >= 2 * n:
                best = max(best, end - start)
    return best


def distinct_ngrams(ids: list[int], n: int = 4) -> float:
    """Distinct n-grams / n-grams (1.0 for a text shorter than n + 1 tokens: nothing can repeat)."""
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return len(set(grams)) / len(grams) if len(grams) > 1 else 1.0


def first_difference(ids: list[int], reference: list[int]) -> int:
    """The first position where `ids` and `reference` differ (their common length when one extends the other)."""
    for i, (a, b) in enumerate(zip(ids, reference)):
        if a != b:
            return i
    return min(len(ids), len(reference))


def prompt_ids(tokenizer, prompt: TextPrompt) -> list[int]:
    if prompt.chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}])
        return tokenizer.encode(text, add_special=False)
    return tokenizer.encode(prompt.text)


@torch.inference_mode()
def continuations(loaded, runtime, cache_name: str, protocol: TextProtocol, advance=None) -> list[dict]:
    """One record per prompt: the greedy continuation's ids and text through cache `cache_name`."""
    out = []
    for prompt in protocol.prompts():
        ids = prompt_ids(loaded.tokenizer, prompt)
        cache = runtime.make_cache(cache_name, len(ids) + protocol.max_new_tokens)
        result = generate(loaded.model, torch.tensor([ids], device=loaded.device), cache, protocol.max_new_tokens,
                          eos_ids=loaded.tokenizer.eos_ids if prompt.chat else ())
        new = result.token_ids[0]
        text = loaded.tokenizer.decode(new, skip_special=True)
        out.append({"prompt": prompt.text, "chat": prompt.chat, "ids": new, "text": text,
                    "right": None if prompt.answer is None else prompt.answer.lower() in text.lower()})
        if advance:
            advance()
    return out


def compare(runs: list[dict], reference: list[dict]) -> dict:
    """The text part of a cache's record: its continuations against the reference's (dense), prompt by prompt."""
    firsts = [first_difference(r["ids"], d["ids"]) for r, d in zip(runs, reference)]
    asked = [(r["right"], d["right"]) for r, d in zip(runs, reference) if d["right"] is not None]
    return {
        "prompts": len(runs),
        "first_difference_median": statistics.median(firsts) if firsts else None,
        "same_text": sum(r["ids"] == d["ids"] for r, d in zip(runs, reference)),
        "answers_right": sum(mine for mine, _ in asked),
        "answers_right_dense": sum(theirs for _, theirs in asked),
        "answers_as_dense": sum(mine == theirs for mine, theirs in asked),
        "questions": len(asked),
        "repeat_run_mean": round(statistics.mean(longest_repeat_run(r["ids"]) for r in runs), 3) if runs else None,
        "distinct4_mean": round(statistics.mean(distinct_ngrams(r["ids"]) for r in runs), 4) if runs else None,
        "continuations": [{"prompt": r["prompt"], "text": r["text"], "first_difference": f}
                          for r, f in zip(runs, firsts)],
    }
