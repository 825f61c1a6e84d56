"""Passkey retrieval: a number hidden at a depth of a long filler text, asked back through the chat template.

Filler: King Lear (not among the perplexity plays), from its first full line on. The needle
"The pass key is NNNNN. Remember it. NNNNN is the pass key." is inserted at a line boundary at the
given depth (fraction of the filler tokens); the user message is filler + question, rendered with
the model's chat template, and the assistant's turn opens with "The pass key is" (PRIME, as the original
passkey test's prompt ends: Mohtashami & Jaggi 2023), so a trial asks for the number, not for a phrasing
(`prime=False`: the turn opens empty and the model phrases its answer). The prompt is prefilled in chunks
into the cache under test, then up to 12 tokens are decoded greedily; a trial passes when the answer
contains the number.

Beside pass/fail, a primed trial measures how sure the retrieval was: its key margin, the smallest
logit lead of the key's next token over the best other token, over the key's tokens while the answer
follows the key (negative at the token where it leaves it). A cache that finds every key with margins
shrunk from dense's is closer to losing one than the count says; a miss by a near-tie is not a lost key.

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
from ..quality.corpus import FILLER_PLAY, play_text

QUESTION = "What is the pass key? Answer with the number only."
PRIME = "The pass key is"
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
    prime: bool = True                               # the answer opens with PRIME

    @property
    def trials(self) -> int:
        return len(self.lengths) * len(self.depths) * self.repeats

    def keys(self) -> list[int]:
        """The trials' keys in trial order (lengths, then depths, then repeats)."""
        rng = random.Random(self.seed)
        return [rng.randrange(10000, 100000) for _ in range(self.trials)]

    def describe(self) -> str:
        return (f"filler {','.join(map(str, self.lengths))} × depths {','.join(map(str, self.depths))} × "
                f"{self.repeats} keys, {'answer primed' if self.prime else 'unprimed'}, {self.max_new_tokens} new tokens")

    @classmethod
    def covering(cls, lengths: tuple[int, ...], depths: tuple[float, ...] = (0.25, 0.5, 0.75), repeats: int = 1,
                 prime: bool = True) -> "PasskeyProtocol":
        """These lengths and depths, each `repeats` times or more, until there are at least MIN_TRIALS trials."""
        positions = len(lengths) * len(depths)
        return cls(lengths=lengths, depths=depths, repeats=max(repeats, -(-MIN_TRIALS // positions)), prime=prime)


@dataclass(frozen=True)
class PasskeyPrompt:
    ids: list[int]                   # the prompt's tokens
    key_ids: list[int] | None        # the tokens that continue it with the key (None: unprimed, or the tokenizer
                                     # would merge the key into the prompt's last token)


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


def passkey_prompt(tokenizer, n_tokens: int, depth: float, key: int, prime: bool = True) -> PasskeyPrompt:
    lines = _filler_lines(tokenizer, n_tokens)
    at = round(depth * len(lines))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    text = "\n".join(lines[:at] + [needle] + lines[at:])
    message = f"{text}\n\n{QUESTION}"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": message}])
    if not prime:
        return PasskeyPrompt(tokenizer.encode(rendered, add_special=False), None)
    ids = tokenizer.encode(rendered + PRIME, add_special=False)
    answered = tokenizer.encode(f"{rendered}{PRIME} {key}", add_special=False)
    return PasskeyPrompt(ids, answered[len(ids):] if answered[:len(ids)] == ids else None)


def lead(logits: torch.Tensor, token: int) -> float:
    """How far `token`'s logit is above the best other token's (negative: another token is preferred); logits (V,)."""
    rival = logits.clone()
    rival[token] = -torch.inf
    return float(logits[token] - rival.max())


def key_margin(step_logits: list[torch.Tensor], answer: list[int], key_ids: list[int] | None) -> float | None:
    """The smallest lead of the key's token over the best other token, step by step while the answer follows the
    key; the step where it leaves the key counts (a negative lead) and ends it. step_logits: (V,) per step."""
    if not key_ids:
        return None
    leads = []
    for logits, got, want in zip(step_logits, answer, key_ids):
        leads.append(lead(logits, want))
        if got != want:
            break
    return min(leads) if leads else None


def check_passkey_fits(loaded, protocol: PasskeyProtocol) -> None:
    """Refuse, before the evaluation starts, a filler length whose prompt + answer the model cannot hold."""
    context = loaded.config.max_seq_len
    if context is None:  # the model states no context
        return
    longest = max(protocol.lengths)
    needed = len(passkey_prompt(loaded.tokenizer, longest, 0.5, 10000, protocol.prime).ids) + protocol.max_new_tokens - 1
    if needed > context:
        raise InputLimitError(f"--passkey-lengths {longest:,}: the passkey prompt and answer need {needed:,} tokens, "
                              f"more than the model's context of {context:,}")


def passkey_trials(loaded, name: str, protocol: PasskeyProtocol, advance=None,
                   variants: list[tuple[int | None, str]] | None = None, engine=None) -> list[dict]:
    """One record per (length, depth, repeat): the key, the answer, whether it was found, its key margin.

    `variants`: [(seed, cache name)] to cycle through over the trials (suite.seed_variants); default
    [(None, name)]. `engine`: the backend running `loaded` (kvlab.backends; default kvlab's own).
    """
    from ..backends import KvlabRuntime

    engine = engine or KvlabRuntime(loaded)
    variants = variants or [(None, name)]
    keys = iter(protocol.keys())
    records = []
    for length in protocol.lengths:
        for depth in protocol.depths:
            for _ in range(protocol.repeats):
                key = next(keys)
                seed, built = variants[len(records) % len(variants)]
                asked = passkey_prompt(loaded.tokenizer, length, depth, key, protocol.prime)
                cache = engine.make_cache(built, len(asked.ids) + protocol.max_new_tokens)
                prompt = torch.tensor([asked.ids], device=loaded.device)
                step_logits: list[torch.Tensor] = []   # the steps the key margin reads
                keep = len(asked.key_ids or ())

                def observe(logits):                    # (1, V)
                    if len(step_logits) < keep:
                        step_logits.append(logits[0].float().clone())

                result = generate(loaded.model, prompt, cache, protocol.max_new_tokens,
                                  eos_ids=loaded.tokenizer.eos_ids, chunk_size=protocol.chunk, on_logits=observe)
                answer = loaded.tokenizer.decode(result.token_ids[0], skip_special=True)
                margin = key_margin(step_logits, result.token_ids[0], asked.key_ids)
                records.append({"length": length, "prompt_tokens": len(asked.ids), "depth": depth, "key": key,
                                "seed": seed, "answer": PRIME + answer.rstrip() if protocol.prime else answer.strip(),
                                "found": str(key) in answer,
                                "key_margin": None if margin is None else round(margin, 4),
                                "decode_tokens_per_s": round(result.decode_tokens_per_s, 2)})
                if advance:
                    advance()
    return records
