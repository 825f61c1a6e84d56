"""Experiment 1: with the causal mask, appending a token leaves the earlier outputs unchanged.

A small pre-norm decoder (4 blocks, width 32, random weights) reads 8 tokens, then the same 8 plus
one more; the first 8 outputs are compared. With the mask they differ by rounding only, so every
layer's K/V of the earlier tokens is final and may be cached. Without the mask (every token reads
every token, like an encoder) they differ visibly, and a cache built from the first 8 tokens is
stale: decoding from it gives outputs that differ from recomputing the whole sequence.

"Outputs" are the final RMSNorm's output: the 32-wide hidden state each position hands to the LM head.
The unmasked model is the same model read through `UnmaskedCache`, a dense cache whose attention
passes causal=False; the model code is untouched.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from ..cache.attention import grouped_attention
from ..cache.base import CacheGeometry
from ..cache.dense import DenseCache
from ..model.config import DecoderConfig
from ..model.llama import Decoder
from .common import Ticker
from ..limits import MAX_SEED, check_int
from ..fileio import save_figure

INVARIANCE_CONFIG = DecoderConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=4, d_ff=128,
                                  max_seq_len=64, name="invariance-4x32")


class UnmaskedCache(DenseCache):
    """A dense cache whose attention has no causal mask: every stored token is visible to every query."""

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        n = self._lengths[layer]
        return grouped_attention(q, self.k[layer, :, :, :n], self.v[layer, :, :, :n], self.scale, causal=False)


def make_lab_cache(config: DecoderConfig, capacity: int, masked: bool) -> DenseCache:
    geometry = CacheGeometry.for_model(config, batch=1, capacity=capacity)
    return DenseCache(geometry) if masked else UnmaskedCache(geometry)


def invariance_model(seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(INVARIANCE_CONFIG).eval()


class HiddenStates:
    """Captures the final RMSNorm's output (B, T, C) of every forward pass."""

    def __init__(self, model: Decoder):
        self.last: torch.Tensor | None = None
        self.handle = model.norm.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output) -> None:
        self.last = output.detach().clone()

    def close(self) -> None:
        self.handle.remove()


@torch.inference_mode()
def outputs(model: Decoder, capture: HiddenStates, tokens: torch.Tensor, masked: bool) -> tuple[torch.Tensor, DenseCache]:
    """The full forward pass: empty cache, append all, attend. Returns (hidden (T, C), the cache it filled)."""
    cache = make_lab_cache(model.config, tokens.shape[1], masked)
    model(tokens, cache)
    return capture.last[0], cache


@dataclass
class InvarianceResult:
    n_tokens: int
    decode_steps: int
    seed: int
    masked_max_diff: float                       # first n outputs: n tokens vs n + 1 tokens, with the mask
    unmasked_max_diff: float                     # the same without the mask
    cached_masked_max_diff: float                # decoding from a cache vs recomputing, with the mask
    cached_unmasked_max_diff: float              # the same without the mask: the stale cache
    masked_by_position: list[float] = field(default_factory=list)
    unmasked_by_position: list[float] = field(default_factory=list)
    cached_masked_by_step: list[float] = field(default_factory=list)
    cached_unmasked_by_step: list[float] = field(default_factory=list)
    stale_keys_masked_by_layer: list[float] = field(default_factory=list)
    stale_keys_unmasked_by_layer: list[float] = field(default_factory=list)
    cached_unmasked_same_argmax: float = 1.0     # share of decode steps whose top logit still agrees

    def record(self) -> dict:
        return {"experiment": "invariance", "model": INVARIANCE_CONFIG.name, **asdict(self)}


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@torch.inference_mode()
def run_invariance(n_tokens: int = 8, decode_steps: int = 8, seed: int = 0, ticker: Ticker | None = None) -> InvarianceResult:
    context = INVARIANCE_CONFIG.max_seq_len
    check_int(n_tokens, "--tokens", 1, context - 1, f"the invariance model holds {context} tokens")
    check_int(decode_steps, "--steps", 1, context - n_tokens, f"--tokens + --steps must fit its {context} tokens")
    check_int(seed, "--seed", 0, MAX_SEED - 1)
    ticker = ticker or Ticker()
    ticker.reset(3, "invariance")
    model = invariance_model(seed)
    capture = HiddenStates(model)
    cfg = model.config
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, cfg.vocab_size, (1, n_tokens + decode_steps), generator=g)
    short, longer = tokens[:, :n_tokens], tokens[:, :n_tokens + 1]
    diffs: dict[bool, list[float]] = {}
    stale: dict[bool, list[float]] = {}
    try:
        # 1. n tokens vs the same n plus one more: are the first n outputs (and every layer's K) unchanged?
        for masked in (True, False):
            out_short, cache_short = outputs(model, capture, short, masked)
            out_long, cache_long = outputs(model, capture, longer, masked)
            diffs[masked] = (out_long[:n_tokens] - out_short).abs().amax(dim=-1).tolist()   # (n,) per position
            stale[masked] = [_max_abs(cache_long.k[layer, :, :, :n_tokens], cache_short.k[layer, :, :, :n_tokens])
                             for layer in range(cfg.n_layers)]
        ticker.advance()
        # 2. prefill n tokens into a cache, then decode the next tokens one at a time from it, and
        #    compare each step with recomputing the whole prefix from scratch.
        by_step: dict[bool, list[float]] = {}
        same_top = 0
        for masked in (True, False):
            cache = make_lab_cache(cfg, n_tokens + decode_steps, masked)
            model(short, cache)
            steps = []
            for t in range(n_tokens, n_tokens + decode_steps):
                logits = model(tokens[:, t:t + 1], cache)
                cached = capture.last[0, -1]
                full_logits = model(tokens[:, :t + 1], make_lab_cache(cfg, t + 1, masked))
                steps.append(_max_abs(cached, capture.last[0, -1]))
                if not masked:
                    same_top += int(logits[0, -1].argmax() == full_logits[0, -1].argmax())
            by_step[masked] = steps
        ticker.advance()
    finally:
        capture.close()
    ticker.finish()
    return InvarianceResult(
        n_tokens=n_tokens, decode_steps=decode_steps, seed=seed,
        masked_max_diff=max(diffs[True]), unmasked_max_diff=max(diffs[False]),
        cached_masked_max_diff=max(by_step[True]), cached_unmasked_max_diff=max(by_step[False]),
        masked_by_position=diffs[True], unmasked_by_position=diffs[False],
        cached_masked_by_step=by_step[True], cached_unmasked_by_step=by_step[False],
        stale_keys_masked_by_layer=stale[True], stale_keys_unmasked_by_layer=stale[False],
        cached_unmasked_same_argmax=same_top / max(1, decode_steps),
    )


def invariance_table(result: InvarianceResult):
    from rich.table import Table

    r = result
    table = Table(title=f"invariance: {INVARIANCE_CONFIG.n_layers} blocks, width {INVARIANCE_CONFIG.d_model}, "
                        f"{r.n_tokens} tokens (+1); largest |difference| of the outputs")
    table.add_column("comparison")
    table.add_column("causal mask", justify="right")
    table.add_column("no mask", justify="right")
    table.add_row(f"first {r.n_tokens} outputs: {r.n_tokens} tokens vs {r.n_tokens + 1}",
                  f"{r.masked_max_diff:.2e}", f"{r.unmasked_max_diff:.3g}")
    for layer, (a, b) in enumerate(zip(r.stale_keys_masked_by_layer, r.stale_keys_unmasked_by_layer)):
        table.add_row(f"  keys of block {layer} for the first {r.n_tokens} tokens", f"{a:.2e}", f"{b:.3g}")
    table.add_row(f"decode {r.decode_steps} tokens from the cache vs recompute",
                  f"{r.cached_masked_max_diff:.2e}", f"{r.cached_unmasked_max_diff:.3g}")
    return table


def invariance_markdown(result: InvarianceResult) -> str:
    r = result
    lines = [
        "| comparison (largest \\|difference\\|) | causal mask | no mask |",
        "|---|---:|---:|",
        f"| first {r.n_tokens} outputs: {r.n_tokens} tokens vs {r.n_tokens + 1} tokens | {r.masked_max_diff:.2e} | {r.unmasked_max_diff:.3g} |",
    ]
    for layer, (a, b) in enumerate(zip(r.stale_keys_masked_by_layer, r.stale_keys_unmasked_by_layer)):
        lines.append(f"| keys of block {layer} for the first {r.n_tokens} tokens | {a:.2e} | {b:.3g} |")
    lines.append(f"| decode {r.decode_steps} tokens from a cache vs recompute the prefix | "
                 f"{r.cached_masked_max_diff:.2e} | {r.cached_unmasked_max_diff:.3g} |")
    return "\n".join(lines)


def plot_invariance(result: InvarianceResult, path) -> None:
    from ..measure import pyplot

    plt = pyplot()
    floor = 1e-10  # exact zeros on a log axis
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4), dpi=110)
    pos = range(1, result.n_tokens + 1)
    ax1.semilogy(pos, [max(d, floor) for d in result.masked_by_position], "o-", label="causal mask")
    ax1.semilogy(pos, [max(d, floor) for d in result.unmasked_by_position], "s-", label="no mask")
    ax1.set_xlabel("position")
    ax1.set_ylabel("max |difference| of the output (exact 0 drawn at 1e-10)")
    ax1.set_title(f"{result.n_tokens} tokens vs {result.n_tokens + 1}: earlier outputs")
    steps = range(result.n_tokens + 1, result.n_tokens + result.decode_steps + 1)
    ax2.semilogy(steps, [max(d, floor) for d in result.cached_masked_by_step], "o-", label="causal mask")
    ax2.semilogy(steps, [max(d, floor) for d in result.cached_unmasked_by_step], "s-", label="no mask (stale cache)")
    ax2.set_xlabel("position decoded")
    ax2.set_title("decode from the cache vs recompute")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
