"""Experiment 2: count the work of generating n tokens, with and without a cache, while the engine runs.

`CountingCache` wraps a real cache and counts, per layer,
    (query, key) scores    B × H × T × S at every `attend` (T new queries against S stored keys;
                           the rectangle attention computes, masked entries included)
    K/V projections        B × T tokens at every `append` (each KV head projects each token once)
The seed's problem counts one block and one head. The default model has exactly that; with any other
model the table divides by blocks × query heads (scores) and blocks × KV heads (projections), and
every layer is checked to count the same.

"n generated tokens" is read as n forward passes over 1, 2, ..., n tokens: a 1-token prompt and
`generate(max_new_tokens=n)` (the prompt pass produces token 1; pass k reads a sequence of k tokens).
Without a cache pass k recomputes all k tokens: k² scores, k projections, in total Σk² and n(n+1)/2.
With a cache pass k projects the newest token only and scores it against k keys: n(n+1)/2 and n.

`forward_macs` is the same bookkeeping for a whole forward pass of any DecoderConfig (every matmul's
multiply-adds); the speed experiment uses it to predict the speed-up a cache should give.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from ..cache import make_cache
from ..cache.base import CacheGeometry, KVCache
from ..errors import ConfigError
from ..limits import check_int
from ..generate import generate
from ..model.config import DecoderConfig
from ..model.llama import Decoder
from .common import Ticker
from ..fileio import save_figure

#: The seed's problem 15 counts one block and one head: so does the default model (random weights).
COUNTS_CONFIG = DecoderConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=1, n_kv_heads=1, d_ff=64,
                              max_seq_len=4096, name="counts-1block-1head")


def counts_model(seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(COUNTS_CONFIG).eval()


class CountingCache(KVCache):
    """Counts scores and K/V projections per layer while delegating storage and attention to `inner`."""

    def __init__(self, inner: KVCache):
        super().__init__(inner.geometry, inner.dtype, inner.device)
        self.inner = inner
        self.persistent = inner.persistent
        n = inner.geometry.n_layers
        self.scores = [0] * n          # B × H × T × S summed over attend calls
        self.kv_tokens = [0] * n       # B × T summed over append calls
        self.passes = 0                # forward passes (counted at layer 0)
        self.seconds = 0.0             # wall time of the generation that filled the counts
        self._new = [0] * n

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.inner.append(layer, k, v)
        self._new[layer] = k.shape[2]
        self.kv_tokens[layer] += k.shape[0] * k.shape[2]
        self.passes += layer == 0

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        B, H, T, _ = q.shape
        S = self.inner.layer_length(layer) if self.inner.persistent else self._new[layer]  # keys this attend reads
        self.scores[layer] += B * H * T * S
        return self.inner.attend(layer, q)

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    @property
    def length(self) -> int:
        return self.inner.length

    def layer_length(self, layer: int) -> int:
        return self.inner.layer_length(layer)

    def reset(self) -> None:
        self.inner.reset()

    def per_block_per_head(self) -> tuple[int, int]:
        """(scores per block per query head, K/V projections per block per KV head); equal in every layer."""
        g = self.geometry
        if len(set(self.scores)) != 1 or len(set(self.kv_tokens)) != 1:
            raise ConfigError(f"layers counted different work: scores {self.scores}, projections {self.kv_tokens}")
        return self.scores[0] // (g.batch * g.n_heads), self.kv_tokens[0] // g.batch


def sum_squares(n: int) -> int:
    return n * (n + 1) * (2 * n + 1) // 6


def triangle(n: int) -> int:
    return n * (n + 1) // 2


@dataclass
class CountRecord:
    n: int
    forward_passes: int
    scores_no_cache: int           # per block per head, counted
    scores_cache: int
    kv_proj_no_cache: int
    kv_proj_cache: int
    expected_scores_no_cache: int  # Σk²
    expected_scores_cache: int     # n(n+1)/2
    expected_kv_proj_no_cache: int # n(n+1)/2
    expected_kv_proj_cache: int    # n
    scores_total_no_cache: int     # all blocks and heads of the model that ran
    scores_total_cache: int
    seconds_no_cache: float = 0.0  # wall time of each generation (a side note: speed is experiment 4)
    seconds_cache: float = 0.0

    @property
    def matches(self) -> bool:
        return (self.scores_no_cache, self.scores_cache, self.kv_proj_no_cache, self.kv_proj_cache) == (
            self.expected_scores_no_cache, self.expected_scores_cache, self.expected_kv_proj_no_cache, self.expected_kv_proj_cache)

    def record(self) -> dict:
        return {"experiment": "counts", **asdict(self), "score_ratio": round(self.scores_no_cache / self.scores_cache, 2),
                "kv_proj_ratio": round(self.kv_proj_no_cache / self.kv_proj_cache, 2), "matches_formula": self.matches}


def count_generation(model, n: int, cache_name: str) -> CountingCache:
    """Generate n tokens from a 1-token prompt through a counting `cache_name` cache ("dense" or "none")."""
    geometry = CacheGeometry.for_model(model.config, batch=1, capacity=max(n, 1))
    cache = CountingCache(make_cache(cache_name, geometry))
    prompt = torch.zeros(1, 1, dtype=torch.long)
    t0 = time.perf_counter()
    generate(model, prompt, cache, max_new_tokens=n)
    cache.seconds = time.perf_counter() - t0
    if cache.passes != n:
        raise ConfigError(f"expected {n} forward passes for {n} tokens, counted {cache.passes}")
    return cache


def run_counts(ns: list[int], ticker: Ticker | None = None, model=None) -> list[CountRecord]:
    """Count both ways for every n. The weights do not change the counts; any DecoderConfig may run,
    the default is one block with one head (so per block per head is the whole model)."""
    if not ns or any(n < 1 for n in ns):
        raise ConfigError(f"--n needs positive token counts, got {ns}")
    model = model or counts_model()
    for n in ns:  # a 1-token prompt and n new tokens: n positions
        check_int(n, "--n", 1, model.config.max_seq_len, f"the counting model's context")
    ticker = ticker or Ticker()
    ticker.reset(sum(sum_squares(n) + triangle(n) for n in ns), "counts")  # proportional to the work
    records = []
    for n in ns:
        ticker.describe(f"counts n={n}")
        without = count_generation(model, n, "none")
        ticker.advance(sum_squares(n))
        with_cache = count_generation(model, n, "dense")
        ticker.advance(triangle(n))
        s0, p0 = without.per_block_per_head()
        s1, p1 = with_cache.per_block_per_head()
        records.append(CountRecord(
            n=n, forward_passes=without.passes, scores_no_cache=s0, scores_cache=s1, kv_proj_no_cache=p0, kv_proj_cache=p1,
            expected_scores_no_cache=sum_squares(n), expected_scores_cache=triangle(n),
            expected_kv_proj_no_cache=triangle(n), expected_kv_proj_cache=n,
            scores_total_no_cache=sum(without.scores), scores_total_cache=sum(with_cache.scores),
            seconds_no_cache=round(without.seconds, 4), seconds_cache=round(with_cache.seconds, 4),
        ))
    return records


# -- operation counts of whole forward passes (for the speed experiment) -----------------------------

def forward_macs(cfg: DecoderConfig, new_tokens: int, context: int, last_only: bool = True) -> int:
    """Multiply-adds of one forward pass: `new_tokens` tokens whose queries read `context` keys.

    Per block: q/k/v and output projections, scores and the weighted sum of values (the full
    T × S rectangle, as attention computes it), SwiGLU. Then the LM head on one row (last_only)
    or on all of them. Norms, RoPE, softmax and the embedding lookup are O(T·d) and left out.
    """
    d, H, Hkv, D = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    T, S = new_tokens, context
    projections = T * d * (H + 2 * Hkv) * D + T * H * D * d
    attention = H * T * S * (D + D)
    ffn = T * 3 * d * cfg.d_ff
    head = (1 if last_only else T) * d * cfg.vocab_size
    return cfg.n_layers * (projections + attention + ffn) + head


def generation_macs(cfg: DecoderConfig, prompt: int, n: int, cached: bool) -> list[int]:
    """Multiply-adds of each of the n forward passes that generate n tokens after a `prompt`-token prompt."""
    passes = [forward_macs(cfg, prompt, prompt)]
    for k in range(1, n):
        L = prompt + k                                   # the sequence length this pass reads
        passes.append(forward_macs(cfg, 1, L) if cached else forward_macs(cfg, L, L))
    return passes


# -- presentation -------------------------------------------------------------------------------------

def counts_table(records: list[CountRecord]):
    from rich.table import Table

    table = Table(title="counted per block per head while generating n tokens (1-token prompt)")
    for col in ("n", "scores\nno cache", "scores\ncache", "ratio", "K/V proj\nno cache", "K/V proj\ncache",
                "= Σk², n(n+1)/2,\nn(n+1)/2, n"):
        table.add_column(col, justify="right")
    for r in records:
        table.add_row(str(r.n), f"{r.scores_no_cache:,}", f"{r.scores_cache:,}", f"{r.scores_no_cache / r.scores_cache:.0f}×",
                      f"{r.kv_proj_no_cache:,}", f"{r.kv_proj_cache:,}", "yes" if r.matches else "[red]NO[/]")
    return table


def counts_markdown(records: list[CountRecord]) -> str:
    lines = ["| n | scores, no cache (Σk²) | scores, cache (n(n+1)/2) | ratio | K/V projections, no cache (n(n+1)/2) "
             "| K/V projections, cache (n) | equal to the formulas |",
             "|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in records:
        lines.append(f"| {r.n:,} | {r.scores_no_cache:,} | {r.scores_cache:,} | {r.scores_no_cache / r.scores_cache:.0f}× "
                     f"| {r.kv_proj_no_cache:,} | {r.kv_proj_cache:,} | {'yes' if r.matches else 'NO'} |")
    return "\n".join(lines)


def plot_counts(records: list[CountRecord], path) -> None:
    from ..measure import pyplot

    plt = pyplot()
    top = max(r.n for r in records)
    xs = sorted({max(1, round(top ** (i / 40))) for i in range(41)})
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    ax.loglog(xs, [sum_squares(x) for x in xs], "-", color="C0", label="scores, no cache: Σk²")
    ax.loglog(xs, [triangle(x) for x in xs], "-", color="C1", label="scores, cache = K/V proj, no cache: n(n+1)/2")
    ax.loglog(xs, xs, "-", color="C2", label="K/V proj, cache: n")
    ns = [r.n for r in records]
    ax.loglog(ns, [r.scores_no_cache for r in records], "o", color="C0", label="counted")
    ax.loglog(ns, [r.scores_cache for r in records], "o", color="C1")
    ax.loglog(ns, [r.kv_proj_no_cache for r in records], "x", color="C1", markersize=10)
    ax.loglog(ns, [r.kv_proj_cache for r in records], "o", color="C2")
    ax.set_xlabel("generated tokens n")
    ax.set_ylabel("count per block per head")
    ax.set_title("work of generating n tokens (counted vs formula)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
