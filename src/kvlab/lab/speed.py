"""Experiment 4: tokens/s with and without the cache, against what the operation counts predict.

For n generated tokens after a 16-token prompt, generation is n forward passes: the prompt pass,
then n-1 steps whose pass reads a sequence of L = 16 + k tokens (k = 1..n-1). With the dense cache
a step runs one new token against L stored keys; without a cache (`none`) it runs all L tokens again.

tokens/s is the tutorial's: n / the wall time of a real generate() of n tokens, after one short warm-up run,
the median of up to `repeats` runs. A run the budget cannot afford (without a cache, 2048 tokens are 2047
passes over up to 2063 tokens: over an hour for SmolLM2 on a laptop CPU) is estimated instead, and every table
labels it so. The estimate is built from measured passes:

    seconds(n) = prompt pass + Σ_{k=1}^{n-1} step(16 + k)

where step(L) is the wall time of exactly the pass generate() runs at that length (no cache: median
of single passes; cache: median of the means of blocks of consecutive steps), measured at a grid of
lengths and interpolated linearly in between (step time is smooth in L: a + bL + cL²). Every real run is
also set beside its estimate (`checks`), and an estimate more than CHECK_TOLERANCE off a real run is
printed with the table, so the estimated cells say how far to trust them.

The prediction: `counts.forward_macs` gives the multiply-adds of every pass. One rate per model,
the MAC/s the no-cache pass reaches at the longest length (large matrix products, close to the
CPU's best), turns MACs into seconds for both modes; the cache's measured speed-up divided by the
MAC ratio says how close the engine's decode step comes to that ideal.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from ..cache import make_cache
from ..cache.base import CacheGeometry
from ..errors import ConfigError
from ..limits import check_float, check_int
from ..generate import generate
from .common import Ticker
from ..fileio import save_figure
from ..measure import median_time, read_bandwidth_gb_s
from .counts import forward_macs, generation_macs

LENGTHS = (64, 256, 512, 1024, 2048)
QUICK_LENGTHS = (8, 16)
PROMPT_TOKENS = 16
MODELS = ("lab", "smollm2")
#: an estimate this far (relative) from the real run of the same cell is printed beside the table
CHECK_TOLERANCE = 0.10
#: seconds of real generate() runs one (model, n, cache) cell may take by default; above it the cell is estimated
RUN_BUDGET_S = 150.0
SMOLLM2_PROMPT = "Now is the winter of our discontent made glorious summer by this sun of York; and all the clouds"


def step_grid(max_new: int, points: int = 9) -> list[int]:
    """The k (new tokens so far) at which a step is timed: 1, doubling-ish, and n-1."""
    last = max_new - 1
    if last < 1:
        return []
    ks = {1, last}
    for frac in (0.03125, 0.0625, 0.125, 0.25, 0.375, 0.5, 0.75)[: max(0, points - 2)]:
        ks.add(max(1, round(last * frac)))
    return sorted(ks)


@dataclass
class ModelUnderTest:
    key: str                     # "lab" | "smollm2"
    name: str
    model: torch.nn.Module
    prompt: torch.Tensor         # (1, 16)
    weights: str                 # where the weights came from

    @property
    def config(self):
        return self.model.config

    @property
    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def load_models(keys: tuple[str, ...], quick: bool, weights_dir=None) -> list[ModelUnderTest]:
    out = []
    for key in keys:
        if key == "lab":
            out.append(_lab_model(quick, weights_dir))
        elif key == "smollm2":
            from ..session import cached_model

            loaded = cached_model(None, "fp32", "cpu", "dense")  # fp32 parameters: the MAC and byte model counts them
            ids = loaded.tokenizer.encode(SMOLLM2_PROMPT)[:PROMPT_TOKENS]
            if len(ids) < PROMPT_TOKENS:
                raise ConfigError(f"the SmolLM2 prompt gives {len(ids)} tokens, fewer than {PROMPT_TOKENS}")
            out.append(ModelUnderTest("smollm2", "SmolLM2-135M (fp32)", loaded.model, torch.tensor([ids]), str(loaded.path.name)))
        else:
            raise ConfigError(f"unknown model {key!r} for the speed experiment; choose from {', '.join(MODELS)}")
    return out


def _lab_model(quick: bool, weights_dir) -> ModelUnderTest:
    """The lab GPT (MHA variant): its trained weights when `kvlab lab gqa` saved them, else a random init.
    Speed does not depend on the weights' values."""
    from .corpus import encode
    from .gqa import PROMPT, TrainSettings, default_weights_dir, init_weights, lab_gpt_config, load_weights, weights_path
    from ..model.llama import Decoder

    settings = TrainSettings().quick() if quick else TrainSettings()
    cfg = lab_gpt_config(8, settings.n_layers, settings.d_ff)
    path = weights_path(weights_dir or default_weights_dir(), cfg, settings)
    if path.is_file():
        model, _ = load_weights(path, cfg)
        source = f"trained ({path.name})"
    else:
        model = Decoder(cfg).eval()
        init_weights(model, 0)
        source = "random init (run `kvlab lab gqa` to train it)"
    name = f"lab GPT ({cfg.n_layers}×256, 8 heads, MHA)"
    return ModelUnderTest("lab", name, model, torch.tensor([encode(PROMPT)]), source)


@dataclass
class StepProfile:
    mode: str                               # "dense" | "none"
    prompt_seconds: float                   # the prompt pass (median)
    contexts: list[int] = field(default_factory=list)   # L = 16 + k for the timed steps
    seconds: list[float] = field(default_factory=list)  # median seconds of one step at L

    def step(self, L: np.ndarray | float) -> np.ndarray:
        return np.interp(L, self.contexts, self.seconds)

    def total(self, n: int, prompt: int = PROMPT_TOKENS) -> float:
        """Seconds to generate n tokens: the prompt pass plus the n-1 steps."""
        if n <= 1:
            return self.prompt_seconds
        return self.prompt_seconds + float(self.step(np.arange(prompt + 1, prompt + n)).sum())


@torch.inference_mode()
def profile_no_cache(m: ModelUnderTest, ks: list[int], repeats: int, ticker: Ticker) -> StepProfile:
    """Time generate()'s no-cache pass: model(all L tokens, fresh `none` cache, last_only=True)."""
    cfg, P = m.config, m.prompt.shape[1]
    top = P + max(ks, default=0)
    g = torch.Generator().manual_seed(0)
    seq = torch.cat([m.prompt, torch.randint(0, cfg.vocab_size, (1, max(0, top - P)), generator=g)], dim=1)  # (1, top)

    def run(L: int):
        cache = make_cache("none", CacheGeometry.for_model(cfg, batch=1, capacity=L))
        return m.model(seq[:, :L], cache, last_only=True)

    prof = StepProfile("none", median_time(lambda: run(P), repeats, warmup=1))
    ticker.advance()
    # repeats in the outer loop: a burst of load from elsewhere lands on one repeat of many lengths,
    # not on every repeat of one length, and the median removes it
    times: dict[int, list[float]] = {k: [] for k in ks}
    for _ in range(repeats):
        for k in ks:
            t0 = time.perf_counter()
            run(P + k)
            times[k].append(time.perf_counter() - t0)
            ticker.advance()
    for k in ks:
        prof.contexts.append(P + k)
        prof.seconds.append(statistics.median(times[k]))
    return prof


@torch.inference_mode()
def profile_cache(m: ModelUnderTest, ks: list[int], repeats: int, ticker: Ticker, block: int = 8) -> StepProfile:
    """Time the dense cache's decode step at each length: one cache, grown to each k by chunked prefill.

    A decode step is short (a millisecond on the lab GPT), so each repeat times a block of `block`
    consecutive steps and takes their mean; the median is over repeats. (The median of single short
    steps would drop every step the OS preempted, and a real run pays for those.)"""
    cfg, P = m.config, m.prompt.shape[1]
    top = P + max(ks, default=0) + repeats * block + 2
    g = torch.Generator().manual_seed(0)
    seq = torch.cat([m.prompt, torch.randint(0, cfg.vocab_size, (1, top - P), generator=g)], dim=1)
    geometry = CacheGeometry.for_model(cfg, batch=1, capacity=top)

    def prompt_pass():
        return m.model(m.prompt, make_cache("dense", geometry), last_only=True)

    prof = StepProfile("dense", median_time(prompt_pass, repeats, warmup=1))
    ticker.advance()
    cache = make_cache("dense", geometry)

    def step():
        pos = cache.length
        m.model(seq[:, pos:pos + 1], cache, last_only=True)

    for k in ks:
        L = P + k
        # a step at length L feeds token L-1 with L-1 tokens stored; fill the cache up to there
        if cache.length < L - 2:
            m.model(seq[:, cache.length:L - 2], cache, last_only=True)
        step()                                       # warm-up: the first step after a chunked prefill
        blocks = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(block):
                step()
            blocks.append((time.perf_counter() - t0) / block)
        prof.contexts.append(L)
        prof.seconds.append(statistics.median(blocks))
        ticker.advance()
    return prof


@torch.inference_mode()
def ops_per_cached_step(m: ModelUnderTest) -> int | None:
    """How many torch operations one cached decode step dispatches (each pays a fixed cost on CPU)."""
    try:
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError:  # pragma: no cover - a torch without it
        return None

    class Counter(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counter.ops += 1
            return func(*args, **(kwargs or {}))

    cache = make_cache("dense", CacheGeometry.for_model(m.config, batch=1, capacity=m.prompt.shape[1] + 1))
    m.model(m.prompt, cache, last_only=True)
    with Counter():
        m.model(m.prompt[:, :1], cache, last_only=True)
    return Counter.ops


@dataclass
class SpeedRecord:
    model: str
    new_tokens: int
    cache: str                    # "dense" | "none"
    tokens_per_s: float           # n / seconds(n), prompt pass included
    seconds: float
    step_ms_last: float           # time of the last step (context 16 + n - 1)
    macs: int                     # multiply-adds of all n passes
    predicted_tokens_per_s: float
    method: str = "measured"      # "measured": real generate() runs (median of `runs`); "estimated": sampled steps
    runs: int = 0                 # real generate() runs behind `seconds` (0: estimated)
    estimated_seconds: float = 0.0  # the sampled-step estimate of the same run

    @property
    def estimated(self) -> bool:
        return self.method == "estimated"

    def record(self) -> dict:
        return {"experiment": "speed", **asdict(self)}


@dataclass
class SpeedCheck:
    model: str
    new_tokens: int
    cache: str
    measured_seconds: float       # real generate() runs (median)
    estimated_seconds: float      # from the step profile

    @property
    def relative_error(self) -> float:
        return self.estimated_seconds / self.measured_seconds - 1 if self.measured_seconds else 0.0

    def record(self) -> dict:
        return {"experiment": "speed_check", **asdict(self), "relative_error": round(self.relative_error, 4)}


@dataclass
class SpeedSummary:
    model: str
    key: str
    weights: str
    params: int
    new_tokens: int               # the longest n
    measured_speedup: float       # seconds without cache / seconds with it, at n (see speedup_method)
    predicted_speedup: float      # MACs without cache / MACs with it, at n
    efficiency: float             # measured / predicted
    gmacs_per_s_no_cache: float   # achieved over the n passes
    gmacs_per_s_cache: float
    calibration_gmacs_per_s: float  # the no-cache pass at the longest length: the prediction's rate
    cache_step_ms_first: float
    cache_step_ms_last: float
    cache_step_floor_ms: float    # the shortest cached step: fixed per-step cost (dispatch, weights read)
    weight_bytes: int
    cache_gb_per_s: float         # (weights + KV read) / step time, last step
    fixed_step_ms: float          # shortest cached step minus its MAC time: the per-pass cost MACs do not see
    ops_per_cached_step: int | None   # torch ops one cached step dispatches
    read_gb_per_s: float          # this machine's memory read bandwidth (same threads)
    weights_read_ms: float        # weight bytes / read bandwidth: the floor of a step that reads every weight
    predicted_speedup_with_fixed_cost: float  # every pass = MACs / rate + fixed_step_ms
    profiles: dict = field(default_factory=dict)          # the measured step times, per mode
    predicted_step_ms: dict = field(default_factory=dict) # MACs / calibration rate at a range of lengths
    speedup_method: str = "measured"  # "estimated" where either side of measured_speedup is an estimate

    def record(self) -> dict:
        return {"experiment": "speed_summary", **asdict(self)}


@dataclass
class SpeedResult:
    records: list[SpeedRecord]
    checks: list[SpeedCheck]
    summaries: list[SpeedSummary]
    lengths: tuple[int, ...]
    repeats: int

    def json_records(self) -> list[dict]:
        return [r.record() for r in self.records] + [c.record() for c in self.checks] + [s.record() for s in self.summaries]

    def disagreements(self) -> list[SpeedCheck]:
        """The real runs whose estimate is more than CHECK_TOLERANCE off."""
        return [c for c in self.checks if abs(c.relative_error) > CHECK_TOLERANCE]


def runs_affordable(estimate_s: float, repeats: int, budget_s: float) -> int:
    """How many real runs of about `estimate_s` seconds fit `budget_s` (at most `repeats`; 0: estimate the cell)."""
    if estimate_s <= 0:
        return repeats
    return min(repeats, int(budget_s // estimate_s))


@torch.inference_mode()
def timed_generate(m: ModelUnderTest, n: int, mode: str, runs: int) -> float:
    """Median wall seconds of `runs` real generate() calls of n tokens with cache `mode` (each on a fresh cache)."""
    geometry = CacheGeometry.for_model(m.config, batch=1, capacity=m.prompt.shape[1] + n)
    times = []
    for _ in range(runs):
        cache = make_cache(mode, geometry)
        t0 = time.perf_counter()
        generate(m.model, m.prompt, cache, n)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_speed(models: tuple[str, ...] = MODELS, lengths: tuple[int, ...] = LENGTHS, repeats: int = 3,
              quick: bool = False, weights_dir=None, ticker: Ticker | None = None,
              run_budget_s: float = RUN_BUDGET_S) -> SpeedResult:
    """Profile each model's steps in both modes, then run generate() for real in every (n, cache) cell whose runs
    fit `run_budget_s` seconds (median of up to `repeats`); the other cells are estimated from the profile."""
    if not lengths or min(lengths) < 2:
        raise ConfigError(f"--lengths must be token counts of at least 2, got {list(lengths)}")
    check_float(run_budget_s, "--run-budget", 0.0)
    ticker = ticker or Ticker()
    mut = load_models(tuple(models), quick, weights_dir)
    top = max(lengths)
    for m in mut:  # the longest run must fit every model's context: refuse now, not after the profiles
        context = m.config.max_seq_len
        check_int(top, "--lengths", 2, context - m.prompt.shape[1] + 1,
                  f"{m.key} holds {context:,} tokens, {m.prompt.shape[1]} of them the prompt")
    ks = step_grid(top)
    ticker.reset(len(mut) * ((1 + len(ks) * repeats) + (1 + len(ks)) + 2 * len(lengths)), "speed")
    records, checks, summaries = [], [], []
    bandwidth = read_bandwidth_gb_s() * 1e9
    for m in mut:
        ticker.describe(f"speed: {m.key}, no cache")
        none = profile_no_cache(m, ks, repeats, ticker)
        ticker.describe(f"speed: {m.key}, dense cache")
        dense = profile_cache(m, ks, repeats, ticker)
        profiles = {"none": none, "dense": dense}
        measured: dict[tuple[str, int], tuple[float, int]] = {}
        for mode, prof in (("dense", dense), ("none", none)):
            timed_generate(m, 4, mode, 1)   # warm-up: the first run pays one-time costs (the tutorial drops it)
            for n in lengths:
                runs = runs_affordable(prof.total(n), repeats, run_budget_s)
                if runs:
                    ticker.describe(f"speed: {m.key}, generate() {n} tokens, {'no cache' if mode == 'none' else 'dense cache'}")
                    seconds = timed_generate(m, n, mode, runs)
                    measured[mode, n] = seconds, runs
                    checks.append(SpeedCheck(m.name, n, mode, seconds, prof.total(n)))
                ticker.advance()
        recs, summary = _tabulate(m, profiles, measured, lengths, bandwidth)
        records.extend(recs)
        summaries.append(summary)
    return SpeedResult(records, checks, summaries, tuple(lengths), repeats)


def _tabulate(m: ModelUnderTest, profiles: dict[str, StepProfile], measured: dict[tuple[str, int], tuple[float, int]],
              lengths, bandwidth: float) -> tuple[list[SpeedRecord], SpeedSummary]:
    """One record per (n, cache): real runs where there were any, else the estimate; and the model's summary."""
    cfg, P = m.config, m.prompt.shape[1]
    none, dense = profiles["none"], profiles["dense"]
    L_top = none.contexts[-1]
    rate = forward_macs(cfg, L_top, L_top) / none.seconds[-1]           # MAC/s of the biggest no-cache pass
    records = []
    macs_at: dict[tuple[str, int], int] = {}
    for mode, prof in (("dense", dense), ("none", none)):
        for n in lengths:
            macs = _generation_macs(cfg, P, n, cached=mode == "dense")
            macs_at[mode, n] = macs
            estimate = prof.total(n, P)
            secs, runs = measured.get((mode, n), (estimate, 0))
            records.append(SpeedRecord(
                model=m.name, new_tokens=n, cache=mode, tokens_per_s=round(n / secs, 2), seconds=round(secs, 4),
                step_ms_last=round(float(prof.step(P + n - 1)) * 1000, 3), macs=macs,
                predicted_tokens_per_s=round(n / (macs / rate), 2),
                method="measured" if runs else "estimated", runs=runs, estimated_seconds=round(estimate, 4),
            ))
    n = max(lengths)
    t_none, t_dense = (measured.get((mode, n), (profiles[mode].total(n, P), 0))[0] for mode in ("none", "dense"))
    both_measured = ("none", n) in measured and ("dense", n) in measured
    measured, predicted = t_none / t_dense, macs_at["none", n] / macs_at["dense", n]
    elem = next(m.model.parameters()).element_size()
    weight_bytes = m.params * elem
    kv_read = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * elem * dense.contexts[-1]
    fixed = max(0.0, min(dense.seconds) - forward_macs(cfg, 1, dense.contexts[int(np.argmin(dense.seconds))]) / rate)
    with_fixed = {mode: macs_at[mode, n] / rate + n * fixed for mode in ("none", "dense")}
    summary = SpeedSummary(
        model=m.name, key=m.key, weights=m.weights, params=m.params, new_tokens=n,
        measured_speedup=round(measured, 2), predicted_speedup=round(predicted, 2),
        efficiency=round(measured / predicted, 4),
        gmacs_per_s_no_cache=round(macs_at["none", n] / t_none / 1e9, 3),
        gmacs_per_s_cache=round(macs_at["dense", n] / t_dense / 1e9, 3),
        calibration_gmacs_per_s=round(rate / 1e9, 3),
        cache_step_ms_first=round(dense.seconds[0] * 1000, 3), cache_step_ms_last=round(dense.seconds[-1] * 1000, 3),
        cache_step_floor_ms=round(min(dense.seconds) * 1000, 3), weight_bytes=weight_bytes,
        cache_gb_per_s=round((weight_bytes + kv_read) / dense.seconds[-1] / 1e9, 3),
        fixed_step_ms=round(fixed * 1000, 3),
        ops_per_cached_step=ops_per_cached_step(m), read_gb_per_s=round(bandwidth / 1e9, 2),
        weights_read_ms=round(weight_bytes / bandwidth * 1000, 3),
        predicted_speedup_with_fixed_cost=round(with_fixed["none"] / with_fixed["dense"], 2),
        profiles={mode: asdict(p) for mode, p in profiles.items()},
        predicted_step_ms=_predicted_steps(cfg, rate, fixed, P + 1, L_top),
        speedup_method="measured" if both_measured else "estimated",
    )
    return records, summary


def _predicted_steps(cfg, rate: float, fixed: float, first: int, last: int, points: int = 40) -> dict:
    Ls = sorted({int(x) for x in np.linspace(first, last, points)})
    return {"contexts": Ls,
            "dense": [round(forward_macs(cfg, 1, L) / rate * 1000, 4) for L in Ls],
            "dense_fixed": [round((forward_macs(cfg, 1, L) / rate + fixed) * 1000, 4) for L in Ls],
            "none": [round(forward_macs(cfg, L, L) / rate * 1000, 4) for L in Ls]}


def _generation_macs(cfg, prompt: int, n: int, cached: bool) -> int:
    return sum(generation_macs(cfg, prompt, n, cached))


# -- presentation -----------------------------------------------------------------------------------------

ESTIMATE_MARK = "≈"
ESTIMATE_NOTE = (f"{ESTIMATE_MARK}: estimated from sampled steps (its real run would exceed the run budget); "
                 "every other number is real generate() runs")


def _tokens_per_s(record: SpeedRecord, digits: int) -> str:
    return f"{ESTIMATE_MARK if record.estimated else ''}{record.tokens_per_s:,.{digits}f}"


def _speedup(dense: SpeedRecord, none: SpeedRecord) -> str:
    mark = ESTIMATE_MARK if dense.estimated or none.estimated else ""
    return f"{mark}{dense.tokens_per_s / none.tokens_per_s:,.1f}×"


def disagreement_lines(result: SpeedResult) -> list[str]:
    """One line per real run whose sampled-step estimate is more than CHECK_TOLERANCE off."""
    return [f"estimate off by {c.relative_error * 100:+.0f}% for {c.model}, {c.new_tokens} tokens, "
            f"{'no cache' if c.cache == 'none' else 'dense cache'} (real {c.measured_seconds:.3f} s, "
            f"estimated {c.estimated_seconds:.3f} s)" for c in result.disagreements()]


def speed_table(result: SpeedResult):
    from rich.table import Table

    caption = [ESTIMATE_NOTE] if any(r.estimated for r in result.records) else []
    caption += disagreement_lines(result)
    table = Table(title=f"tokens/s of real generate() runs after a {PROMPT_TOKENS}-token prompt "
                        f"(prompt pass included; median of up to {result.repeats})",
                  caption="\n".join(caption) or None, caption_justify="left")
    table.add_column("model")
    for col in ("new tokens", "cache tokens/s", "no cache tokens/s", "speed-up", "predicted by MACs"):
        table.add_column(col, justify="right")
    for model, n, dense, none in _pairs(result):
        table.add_row(model, str(n), _tokens_per_s(dense, 1), _tokens_per_s(none, 2), _speedup(dense, none),
                      f"{none.macs / dense.macs:,.1f}×")
    return table


def _pairs(result: SpeedResult):
    by = {(r.model, r.new_tokens, r.cache): r for r in result.records}
    for s in result.summaries:
        for n in result.lengths:
            yield s.model, n, by[s.model, n, "dense"], by[s.model, n, "none"]


def speed_markdown(result: SpeedResult) -> str:
    lines = ["| model | new tokens | cache: tokens/s | no cache: tokens/s | speed-up | predicted by MACs | cache: last step ms | no cache: last step ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for model, n, dense, none in _pairs(result):
        lines.append(f"| {model} | {n:,} | {_tokens_per_s(dense, 1)} | {_tokens_per_s(none, 2)} "
                     f"| {_speedup(dense, none)} | {none.macs / dense.macs:,.1f}× "
                     f"| {dense.step_ms_last:,.2f} | {none.step_ms_last:,.1f} |")
    notes = ([ESTIMATE_NOTE] if any(r.estimated for r in result.records) else []) + disagreement_lines(result)
    return "\n".join(lines + ([""] + [f"- {note}" for note in notes] if notes else []))


def checks_markdown(result: SpeedResult) -> str:
    lines = ["| model | new tokens | cache | real runs | generate() seconds | from sampled steps | difference |",
             "|---|---:|---|---:|---:|---:|---:|"]
    runs = {(r.model, r.new_tokens, r.cache): r.runs for r in result.records}
    for c in result.checks:
        lines.append(f"| {c.model} | {c.new_tokens} | {c.cache} | {runs.get((c.model, c.new_tokens, c.cache), 0)} "
                     f"| {c.measured_seconds:.3f} | {c.estimated_seconds:.3f} | {c.relative_error * 100:+.0f}% |")
    return "\n".join(lines)


def summary_markdown(result: SpeedResult) -> str:
    """Two tables: the speed-up against the predictions, and where a cached step's time goes."""
    lines = ["| model | n | measured speed-up | predicted by MACs | measured / predicted | predicted by MACs + fixed cost per pass |",
             "|---|---:|---:|---:|---:|---:|"]
    for s in result.summaries:
        lines.append(f"| {s.model} | {s.new_tokens:,} | {s.measured_speedup:,.1f}× | {s.predicted_speedup:,.1f}× "
                     f"| {s.efficiency * 100:.1f}% | {s.predicted_speedup_with_fixed_cost:,.1f}× |")
    lines += ["", "| model | GMAC/s no cache | GMAC/s cache | cached step ms (first → last) | its MACs at the no-cache rate, ms "
              "| weights ÷ read bandwidth, ms | torch ops per cached step | fixed ms per pass |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in result.summaries:
        mac_ms = s.predicted_step_ms["dense"][-1] if s.predicted_step_ms else float("nan")
        ops = f"{s.ops_per_cached_step:,}" if s.ops_per_cached_step else "n/a"
        lines.append(f"| {s.model} | {s.gmacs_per_s_no_cache:.2f} | {s.gmacs_per_s_cache:.3f} "
                     f"| {s.cache_step_ms_first:.2f} → {s.cache_step_ms_last:.2f} | {mac_ms:.3f} "
                     f"| {s.weights_read_ms:.2f} ({s.weight_bytes / 1e6:.1f} MB at {s.read_gb_per_s:.1f} GB/s) "
                     f"| {ops} | {s.fixed_step_ms:.2f} |")
    return "\n".join(lines)


def plot_speed(result: SpeedResult, path) -> None:
    from ..measure import pyplot

    plt = pyplot()
    rows = len(result.summaries)
    fig, axes = plt.subplots(rows, 2, figsize=(11, 4 * rows), dpi=110, squeeze=False)
    by = {(r.model, r.cache): [] for r in result.records}
    for r in result.records:
        by[r.model, r.cache].append(r)
    for row, s in enumerate(result.summaries):
        ax1, ax2 = axes[row]
        for mode, color, label in (("dense", "C0", "dense cache"), ("none", "C3", "no cache")):
            recs = sorted(by[s.model, mode], key=lambda r: r.new_tokens)
            ns = [r.new_tokens for r in recs]
            real = [r for r in recs if not r.estimated]
            ax1.loglog(ns, [r.estimated_seconds and r.new_tokens / r.estimated_seconds for r in recs], ":", color=color,
                       alpha=0.6, label=f"{label}, estimated from sampled steps")
            ax1.loglog([r.new_tokens for r in real], [r.tokens_per_s for r in real], "o-", color=color,
                       label=f"{label}, real generate() runs")
            ax1.loglog(ns, [r.predicted_tokens_per_s for r in recs], "--", color=color, alpha=0.7, label=f"{label}, MAC prediction")
            prof = s.profiles[mode]
            ax2.semilogy(prof["contexts"], [x * 1000 for x in prof["seconds"]], "o-", color=color, label=f"{label}, measured")
        pred = s.predicted_step_ms
        ax2.semilogy(pred["contexts"], pred["dense"], "--", color="C0", alpha=0.7, label="dense cache, MAC prediction")
        ax2.semilogy(pred["contexts"], pred["dense_fixed"], ":", color="C0", label="dense cache, MACs + fixed cost per pass")
        ax2.semilogy(pred["contexts"], pred["none"], "--", color="C3", alpha=0.7, label="no cache, MAC prediction")
        ax1.set_xlabel("generated tokens n")
        ax1.set_ylabel("tokens/s")
        ax1.set_title(f"{s.model}: tokens/s")
        ax2.set_xlabel("sequence length read by the step (16 + k)")
        ax2.set_ylabel("ms per token")
        ax2.set_title(f"{s.model}: time per token")
        for ax in (ax1, ax2):
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)

