"""Run the quality evaluation for a list of caches: one record per cache, dense as the reference."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from ..backends import KvlabRuntime, formula_bytes_per_token
from ..cache import CacheSpec
from ..hf_baselines import is_baseline_name
from ..quality.agreement import kl_divergence, top1_matches
from ..quality.corpus import calibration_text, corpus_text, windows
from ..quality.perplexity import WindowProtocol, run_window, window_nll
from .stats import WindowSums, summarize

#: bytes per token are reported the ANCHORS.md way: everything the cache holds at 511 tokens, bf16 run.
BYTES_TOKENS = 511
BYTES_DTYPE = torch.bfloat16


@dataclass
class CacheQuality:
    """One cache's quality against dense; with several rotation seeds, ppl .. top1_agreement are seed means."""

    cache: str
    bytes_per_token: float
    bits_per_value: float
    ppl: float = math.nan
    ppl_delta_pct: float = math.nan
    kl: float = math.nan
    top1_agreement: float = math.nan
    passkey_accuracy: float | None = None
    scored_tokens: int = 0
    extra: dict = field(default_factory=dict)
    seeds: list[int] = field(default_factory=list)             # rotation seeds run ([] : the cache has none)
    ppl_delta_sd: float = 0.0                                   # spread of ΔPPL over the seeds (sample sd)
    ppl_delta_ci: tuple[float, float] | None = None             # 95% bootstrap interval over windows
    kl_ci: tuple[float, float] | None = None
    top1_ci: tuple[float, float] | None = None
    per_seed: list[dict] = field(default_factory=list)          # {"seed", "ppl", "ppl_delta_pct", "kl", "top1"}
    passkey_found: int | None = None                            # passkey trials passed, of passkey_total
    passkey_total: int | None = None
    passkey_margin: tuple[float, float] | None = None           # key margins over the trials: (mean, smallest)

    def to_json(self) -> dict:
        record = asdict(self)
        extra = record.pop("extra")
        return {**record, **extra}


def bytes_per_token(name: str, config) -> tuple[float, float]:
    """(bytes per token, bits per cached value) of cache `name` holding 511 tokens in a bf16 run."""
    return formula_bytes_per_token(name, config, BYTES_TOKENS, BYTES_DTYPE)


def corpus_windows(tokenizer, protocol: WindowProtocol, text: str | None = None) -> list[torch.Tensor]:
    """The protocol's (1, length) token windows of `text` (default: the evaluation plays)."""
    ids = tokenizer.encode(corpus_text() if text is None else text, add_special=False)
    return [torch.tensor([w]) for w in windows(ids, protocol.n_windows, protocol.length)]


def calibration_windows(tokenizer, protocol: WindowProtocol) -> list[torch.Tensor]:
    """Windows of the calibration plays (corpus.CALIBRATION_PLAYS): text no evaluation window contains."""
    return corpus_windows(tokenizer, protocol, calibration_text())


def seed_variants(name: str, seeds: tuple[int, ...]) -> list[tuple[int | None, str]]:
    """[(seed, cache name to build)]: one per seed for a TurboQuant cache without its own `+seedN`, else [(None, name)]."""
    if not seeds or is_baseline_name(name):                 # transformers' own caches (hf:dynamic, ...) have no seed
        return [(None, name)]
    spec = CacheSpec.parse(name)
    if spec.base != "tq" or spec.seed:
        return [(None, name)]
    return [(seed, f"{name}+seed{seed}") for seed in seeds]


def perplexity_suite(loaded, names: list[str], protocol: WindowProtocol, advance=None,
                     token_windows: list[torch.Tensor] | None = None, seeds: tuple[int, ...] = (),
                     engine=None) -> list[CacheQuality]:
    """The engine's reference first (dense; hf:dynamic for transformers), then every cache in `names`, window by window.

    `advance()` is called after each (window, cache run) pass, for a progress bar. `token_windows`: the
    corpus windows when the caller cut them already (default: cut them here). `seeds`: rotation seeds
    each TurboQuant cache runs with (default: its own, one run); see stats.py for the statistics.
    `engine`: the backend running `loaded` (kvlab.backends; default kvlab's own).
    """
    engine = engine or KvlabRuntime(loaded)
    model, reference_name = loaded.model, engine.reference
    names = [reference_name] + [n for n in names if n != reference_name]
    runs = [(name, seed, built) for name in names for seed, built in seed_variants(name, seeds)]
    token_windows = token_windows if token_windows is not None else corpus_windows(loaded.tokenizer, protocol)
    sums = {(name, seed): [] for name, seed, _ in runs}              # per run: one (nll, kl, top1, count) per window
    for tokens in token_windows:
        reference = None
        for name, seed, built in runs:
            logits, _ = run_window(model, tokens, lambda: engine.make_cache(built, protocol.length), protocol)
            nll = window_nll(torch.cat([logits, logits[-1:]]), tokens, protocol.prefill)
            if reference is None:
                reference = logits
            sums[name, seed].append((nll.sum().item(), kl_divergence(reference, logits).sum().item(),
                                     int(top1_matches(reference, logits).sum()), nll.numel()))
            if advance:
                advance()
    window_sums = {run: WindowSums(*torch.tensor(rows, dtype=torch.float64).T) for run, rows in sums.items()}
    dense = window_sums[reference_name, None]
    records = []
    for name in names:
        run_seeds = [seed for n, seed, _ in runs if n == name]
        summary = summarize([window_sums[name, seed] for seed in run_seeds], dense)
        per_token, bits = engine.bytes_per_token(name, BYTES_TOKENS, BYTES_DTYPE, protocol.prefill, protocol.chunk)
        delta, kl, top1 = summary["ppl_delta_pct"], summary["kl"], summary["top1"]
        records.append(CacheQuality(
            cache=name, bytes_per_token=round(per_token, 1), bits_per_value=round(bits, 3), ppl=summary["ppl"].mean,
            ppl_delta_pct=delta.mean, kl=kl.mean, top1_agreement=top1.mean, scored_tokens=int(dense.count.sum()),
            seeds=[s for s in run_seeds if s is not None], ppl_delta_sd=delta.sd, ppl_delta_ci=delta.ci, kl_ci=kl.ci,
            top1_ci=top1.ci,
            per_seed=[{"seed": seed, "ppl": p, "ppl_delta_pct": d, "kl": k, "top1": t} for seed, p, d, k, t in
                      zip(run_seeds, summary["ppl"].per_seed, delta.per_seed, kl.per_seed, top1.per_seed)],
        ))
    return records
