"""Passkey retrieval: a number hidden at a depth of a long filler text, asked back through the chat template.

Filler: King Lear (not among the perplexity plays), from its first full line on. The needle
"The pass key is NNNNN. Remember it. NNNNN is the pass key." is inserted at a line boundary at the
given depth (fraction of the filler tokens); the user message is filler + question, rendered with
the model's chat template. The prompt is prefilled in chunks into the cache under test, then up to
12 tokens are decoded greedily; a trial passes when the answer contains the number.

A cache is judged on a count of trials, never on one: lengths × depths × repeats (at least
MIN_TRIALS by default, `--quick` included), each repeat with a new random key; a cache with rotation
seeds cycles through them over the trials.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ..errors import InputLimitError
from ..generate import generate
from .corpus import FILLER_PLAY, play_text

QUESTION = "What is the pass key? Answer with the number only."
#: The fewest trials a default passkey protocol runs per cache.
MIN_TRIALS = 9


@dataclass(frozen=True)
class PasskeyProtocol:
    lengths: tuple[int, ...] = (1000, 3000, 6000)   # filler tokens
    depths: tuple[float, ...] = (0.25, 0.5, 0.75)
    chunk: int = 256                                 # prefill chunk (bounds attention memory)
    max_new_tokens: int = 12
    seed: int = 0                                    # of the random keys
    repeats: int = 1                                 # trials per (length, depth), each with its own key

    @property
    def trials(self) -> int:
        return len(self.lengths) * len(self.depths) * self.repeats

    @classmethod
    def covering(cls, lengths: tuple[int, ...], depths: tuple[float, ...] = (0.25, 0.5, 0.75)) -> "PasskeyProtocol":
        """These lengths and depths, repeated until there are at least MIN_TRIALS trials."""
        positions = len(lengths) * len(depths)
        return cls(lengths=lengths, depths=depths, repeats=-(-MIN_TRIALS // positions))


def _filler_lines(tokenizer, n_tokens: int) -> list[str]:
    """Whole lines of the filler play adding up to about `n_tokens` tokens (the play repeats if needed)."""
    lines = [line for line in play_text(FILLER_PLAY).splitlines() if line.strip()]
    out, total, i = [], 0, 0
    while total < n_tokens:
        line = lines[i % len(lines)]
        out.append(line)
        total += len(tokenizer.encode(line + "\n", add_special=False))
        i += 1
    return out


def passkey_prompt(tokenizer, n_tokens: int, depth: float, key: int) -> list[int]:
    lines = _filler_lines(tokenizer, n_tokens)
    at = round(depth * len(lines))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    text = "\n".join(lines[:at] + [needle] + lines[at:])
    message = f"{text}\n\n{QUESTION}"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": message}])
    return tokenizer.encode(rendered, add_special=False)


def check_passkey_fits(loaded, protocol: PasskeyProtocol) -> None:
    """Refuse, before the evaluation starts, a filler length whose prompt + answer the model cannot hold."""
    context = loaded.config.max_seq_len
    if context is None:  # the model states no context
        return
    longest = max(protocol.lengths)
    needed = len(passkey_prompt(loaded.tokenizer, longest, 0.5, 10000)) + protocol.max_new_tokens - 1
    if needed > context:
        raise InputLimitError(f"--passkey-lengths {longest:,}: the passkey prompt and answer need {needed:,} tokens, "
                              f"more than the model's context of {context:,}")


def passkey_trials(loaded, name: str, protocol: PasskeyProtocol, advance=None,
                   variants: list[tuple[int | None, str]] | None = None, engine=None) -> list[dict]:
    """One record per (length, depth, repeat): the key, the answer, whether it was found.

    `variants`: [(seed, cache name)] to cycle through over the trials (suite.seed_variants); default
    [(None, name)]. `engine`: the backend running `loaded` (kvlab.backends; default kvlab's own).
    """
    from ..backends import KvlabEngine

    engine = engine or KvlabEngine(loaded)
    variants = variants or [(None, name)]
    rng = random.Random(protocol.seed)
    records = []
    for length in protocol.lengths:
        for depth in protocol.depths:
            for _ in range(protocol.repeats):
                key = rng.randrange(10000, 100000)
                seed, built = variants[len(records) % len(variants)]
                ids = passkey_prompt(loaded.tokenizer, length, depth, key)
                cache = engine.make_cache(built, len(ids) + protocol.max_new_tokens)
                prompt = torch.tensor([ids], device=loaded.device)
                result = generate(loaded.model, prompt, cache, protocol.max_new_tokens,
                                  eos_ids=loaded.tokenizer.eos_ids, chunk_size=protocol.chunk)
                answer = loaded.tokenizer.decode(result.token_ids[0], skip_special=True)
                records.append({"length": length, "prompt_tokens": len(ids), "depth": depth, "key": key, "seed": seed,
                                "answer": answer.strip(), "found": str(key) in answer,
                                "decode_tokens_per_s": round(result.decode_tokens_per_s, 2)})
                if advance:
                    advance()
    return records
