"""Quality over seeds and windows: per-seed values, their mean and spread, a bootstrap interval over windows.

Every quantity is built from per-window sums, so a resample of windows is a weighted sum. For a cache
run with seeds s = 1..S on windows w = 1..W (dense once per window, the reference):
    ΔPPL_s = 100·(exp(Σ_w nll_sw / Σ_w n_w) / exp(Σ_w nll_dense,w / Σ_w n_w) - 1)
    KL_s   = Σ_w kl_sw / Σ_w n_w          top-1_s = Σ_w match_sw / Σ_w n_w
The reported value is the mean over seeds and the spread their sample standard deviation (0 for one
seed). The confidence interval resamples the W windows with replacement (the same draw for the cache
and for dense: the comparison is paired) and takes the percentile interval of the seed-mean.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

#: Bootstrap resamples of the windows, their seed, and the interval's coverage.
RESAMPLES = 2000
BOOTSTRAP_SEED = 0
COVERAGE = 0.95


@dataclass
class WindowSums:
    """Per-window sums of one cache run with one seed: each a (W,) float64 tensor."""

    nll: torch.Tensor      # Σ negative log-likelihood of the scored tokens
    kl: torch.Tensor       # Σ KL(dense ‖ cache)
    top1: torch.Tensor     # number of positions whose argmax agrees with dense
    count: torch.Tensor    # scored tokens


@dataclass
class Summary:
    """One metric over seeds: the mean, the spread, the per-seed values and the bootstrap interval."""

    mean: float
    sd: float
    per_seed: list[float]
    ci: tuple[float, float]


def _metrics(runs: list[WindowSums], dense: WindowSums, weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """weights: (R, W) window multiplicities -> each metric as (R, S), S = len(runs)."""
    n = weights @ dense.count                                                    # (R,)
    dense_nll = (weights @ dense.nll) / n                                        # (R,)
    nll = torch.stack([weights @ r.nll for r in runs], dim=1) / n[:, None]       # (R, S)
    return {
        "ppl": nll.exp(),
        "ppl_delta_pct": 100 * torch.expm1(nll - dense_nll[:, None]),
        "kl": torch.stack([weights @ r.kl for r in runs], dim=1) / n[:, None],
        "top1": torch.stack([weights @ r.top1 for r in runs], dim=1) / n[:, None],
    }


def summarize(runs: list[WindowSums], dense: WindowSums, resamples: int = RESAMPLES,
              seed: int = BOOTSTRAP_SEED) -> dict[str, Summary]:
    """{"ppl", "ppl_delta_pct", "kl", "top1"} -> Summary, for one cache run with len(runs) seeds."""
    W = dense.count.numel()
    point = _metrics(runs, dense, torch.ones(1, W, dtype=torch.float64))                 # each (1, S)
    gen = torch.Generator().manual_seed(seed)
    draws = torch.randint(0, W, (resamples, W), generator=gen)                           # (R, W) window indices
    weights = torch.zeros(resamples, W, dtype=torch.float64).scatter_add_(1, draws, torch.ones(resamples, W, dtype=torch.float64))
    boot = _metrics(runs, dense, weights)                                                # each (R, S)
    tail = (1 - COVERAGE) / 2
    out = {}
    for name, values in point.items():
        per_seed = values[0].tolist()
        means = boot[name].mean(dim=1)                                                   # (R,) seed-mean per resample
        lo, hi = torch.quantile(means, torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
        sd = statistics.stdev(per_seed) if len(per_seed) > 1 else 0.0
        out[name] = Summary(mean=sum(per_seed) / len(per_seed), sd=sd, per_seed=per_seed, ci=(lo, hi))
    return out

