"""Generation: prefill the prompt in one pass (or in chunks), then decode one token at a time."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from .cache.base import KVCache
from .errors import CacheCapacityError, ConfigError, InputLimitError
from .heap import release_free_memory
from .limits import check_float, check_seed


GREEDY_BELOW = 1e-5  # temperatures this small would overflow the logits; they mean greedy
# a long prompt is prefilled in chunks of this many tokens unless told otherwise: the activations (and the
# attention's (T, S) mask) of one chunk, not of the whole prompt, are alive at once; the result is the same.
# 256, not 512: a 4,000-token prompt's peak RSS falls ~10 MiB (its chunk's feed-forward transients and the heap
# holes they leave halve) for ~4% more prefill CPU (each chunk dequantizes the weights once); 128 saves ~2 more.
PREFILL_CHUNK = 256


@dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 = greedy; top_k 0 and top_p 1.0 = off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:  # NaN too
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        check_float(self.temperature, "temperature (--temperature)")  # and finite
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        check_seed(self.seed, "seed (--seed)")


@dataclass
class GenerationResult:
    token_ids: list[list[int]]          # new tokens per sequence
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float
    cache_bytes: int
    stop_reason: str = "length"

    @property
    def new_tokens(self) -> int:
        """Decode steps taken: the longest row (rows of a batch that hit EOS early are cut there)."""
        return max((len(row) for row in self.token_ids), default=0)

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode steps per second after the first token (which comes from the prefill)."""
        steps = self.new_tokens - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds > 0 else 0.0


def model_context(model) -> int | None:
    """The longest sequence the model was built for (its config's max_seq_len), or None when it says nothing."""
    context = getattr(getattr(model, "config", None), "max_seq_len", None)
    return context if isinstance(context, int) and context > 0 else None


def check_fits(prompt_tokens: int, max_new_tokens: int, context: int | None, capacity: int | None = None,
               cached: int = 0, new_option: str = "--max-new-tokens") -> None:
    """Refuse, before any work, a generation that would pass the model's context or the cache's capacity.

    Positions used: the `cached` tokens already in the cache, the prompt, and every new token but the
    last (it is returned, never fed back). `capacity` None: no cache bound (the no-cache baseline).
    `new_option` is the option the messages name for the new tokens.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    needed = cached + prompt_tokens + max_new_tokens - 1
    if context is not None and cached + prompt_tokens > context:
        raise InputLimitError(f"prompt of {prompt_tokens:,} tokens{f' after {cached:,} cached' if cached else ''} "
                              f"exceeds the model's context of {context:,} tokens")
    if context is not None and needed > context:
        room = context - cached - prompt_tokens + 1
        raise InputLimitError(f"prompt of {prompt_tokens:,} tokens + {new_option} {max_new_tokens:,} needs {needed:,} positions, "
                              f"more than the model's context of {context:,}; use {new_option} {room:,} or less")
    if capacity is not None and cached + prompt_tokens > capacity:
        raise CacheCapacityError(f"prompt of {prompt_tokens} tokens exceeds the cache capacity of {capacity} tokens")
    if capacity is not None and needed > capacity:
        raise CacheCapacityError(f"prompt of {prompt_tokens:,} tokens + {new_option} {max_new_tokens:,} needs a cache of {needed:,} "
                                 f"tokens, more than its capacity of {capacity:,}; raise --capacity or lower {new_option}")


def sample_next(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """logits (B, V) -> next token ids (B,)."""
    if sampling.temperature < GREEDY_BELOW:
        return logits.argmax(dim=-1)  # the limit of sampling as the temperature goes to 0
    logits = logits.float() / sampling.temperature
    if sampling.top_k > 0:
        kth = torch.topk(logits, min(sampling.top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs > sampling.top_p       # keep the smallest prefix reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.inference_mode()
def prefill(model, tokens: torch.Tensor, cache: KVCache, chunk_size: int | None = None, last_only: bool = True) -> torch.Tensor:
    """Run the prompt (B, T) through the model into `cache`; chunks of `chunk_size` (default PREFILL_CHUNK) give
    the same result as one pass."""
    T = tokens.shape[1]
    if chunk_size is not None and chunk_size < 1:
        raise ConfigError(f"prefill chunk size must be at least 1 token, got {chunk_size}")
    if cache.persistent:
        step = chunk_size or min(T, PREFILL_CHUNK)
    else:
        step = T  # without a cache a chunk could not see the chunks before it: one pass
    logits = None
    for start in range(0, T, step):
        logits = model(tokens[:, start:start + step], cache, last_only=last_only)
        release_free_memory()  # the chunk's activations are freed: their heap pages too, before the next chunk's
    return logits


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def generate_stream(
    model,
    prompt: torch.Tensor,
    cache: KVCache,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    eos_ids: tuple[int, ...] = (),
    chunk_size: int | None = None,
    stats: dict | None = None,
    on_logits: Callable[[torch.Tensor], None] | None = None,
) -> Iterator[torch.Tensor]:
    """Yield the next token ids (B,) one step at a time. prompt: (B, T) equal-length prompts.

    With a persistent cache the prompt is prefilled once and each step feeds one token; with the
    no-cache baseline (cache.persistent is False) each step feeds the whole sequence again.
    `stats`, when given, receives prefill_seconds, decode_seconds and stop_reason. `on_logits`, when
    given, sees each step's logits (B, V) before the next ids are chosen from them.
    """
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise ConfigError(f"prompt must be a non-empty (batch, tokens) tensor, got shape {tuple(prompt.shape)}")
    capacity = cache.geometry.capacity
    check_fits(prompt.shape[1], max_new_tokens, model_context(model), capacity if cache.persistent else None,
               cache.length if cache.persistent else 0)
    device = prompt.device
    generator = None
    if sampling.seed is not None:
        generator = torch.Generator(device=device).manual_seed(sampling.seed)
    stats = stats if stats is not None else {}
    stats.update(prefill_seconds=0.0, decode_seconds=0.0, stop_reason="length")
    finished = torch.zeros(prompt.shape[0], dtype=torch.bool, device=device)
    eos = torch.tensor(eos_ids, device=device) if eos_ids else None
    sequence = prompt

    t0 = time.perf_counter()
    logits = prefill(model, prompt, cache, chunk_size)[:, -1]                 # (B, V)
    _sync(device)
    release_free_memory()  # the prompt chunks' activations are gone: their heap pages go back for the decode
    stats["prefill_seconds"] = time.perf_counter() - t0
    for step in range(max_new_tokens):
        if on_logits is not None:
            on_logits(logits)
        next_ids = sample_next(logits, sampling, generator)                   # (B,)
        if eos is not None:
            finished |= torch.isin(next_ids, eos)
        yield next_ids
        if bool(finished.all()):
            stats["stop_reason"] = "eos"
            break
        if step == max_new_tokens - 1:
            break
        t_step = time.perf_counter()  # decode time counts the model's work, not the caller's between steps
        if cache.persistent:
            if cache.length + 1 > capacity:
                stats["stop_reason"] = "capacity"
                break
            logits = model(next_ids[:, None], cache, last_only=True)[:, -1]
        else:
            sequence = torch.cat([sequence, next_ids[:, None]], dim=1)       # (B, T+1): recompute everything
            logits = model(sequence, cache, last_only=True)[:, -1]
        _sync(device)
        stats["decode_seconds"] += time.perf_counter() - t_step


def _cut_after_eos(row: list[int], eos_ids: tuple[int, ...]) -> list[int]:
    for i, token in enumerate(row):
        if token in eos_ids:
            return row[: i + 1]
    return row


def generate(
    model,
    prompt: torch.Tensor,
    cache: KVCache,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    eos_ids: tuple[int, ...] = (),
    chunk_size: int | None = None,
    on_token: Callable[[torch.Tensor], None] | None = None,
    on_logits: Callable[[torch.Tensor], None] | None = None,
) -> GenerationResult:
    """Generate up to `max_new_tokens` for each prompt row; stops when every row has hit EOS."""
    stats: dict = {}
    new: list[torch.Tensor] = []
    for next_ids in generate_stream(model, prompt, cache, max_new_tokens, sampling, eos_ids, chunk_size, stats,
                                    on_logits):
        new.append(next_ids)
        if on_token is not None:
            on_token(next_ids)
    ids = torch.stack(new, dim=1).tolist() if new else [[] for _ in range(prompt.shape[0])]
    ids = [_cut_after_eos(row, eos_ids) for row in ids]  # rows of a batch that ended early
    return GenerationResult(
        token_ids=ids,
        prompt_tokens=prompt.shape[1],
        prefill_seconds=stats["prefill_seconds"],
        decode_seconds=stats["decode_seconds"],
        cache_bytes=cache.nbytes,
        stop_reason=stats["stop_reason"],
    )
