"""One evaluation run: settings, progress bars, the perplexity suite, the text continuations, the passkey trials,
the table."""

from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..errors import ConfigError
from ..limits import check_int, check_threads
from .continuations import TextProtocol, compare, continuations
from .needle import PasskeyProtocol, check_passkey_fits, passkey_trials
from ..quality.perplexity import WindowProtocol
from .stats import COVERAGE
from .suite import CacheQuality, corpus_windows, perplexity_suite, seed_variants

#: Rotation seeds of the TurboQuant caches: three by default, one with --quick.
DEFAULT_SEEDS = (0, 1, 2)
QUICK_SEEDS = (0,)


@dataclass(frozen=True)
class EvalSettings:
    caches: tuple[str, ...]
    protocol: WindowProtocol
    passkey: PasskeyProtocol | None
    model: str | None = None
    threads: int | None = None
    seeds: tuple[int, ...] = DEFAULT_SEEDS      # rotation seeds of every TurboQuant cache
    backend: str = "kvlab"                      # kvlab.backends: kvlab | transformers
    text: TextProtocol | None = None            # greedy continuations against dense's (eval/continuations.py)

    @classmethod
    def build(cls, caches: str, quick: bool, windows: int | None, passkey: bool, passkey_lengths: str,
              model: str | None = None, threads: int | None = None, seeds: str | None = None,
              backend: str = "kvlab", passkey_repeats: int = 1, passkey_prime: bool = True,
              text: bool = True) -> "EvalSettings":
        from ..backends import cache_name, check_backend

        backend = check_backend(backend)
        names = tuple(dict.fromkeys(cache_name(backend, n) for n in caches.split(",") if n.strip()))
        if not names:
            raise ConfigError("--caches needs at least one cache name")
        n_windows = check_int(windows, "--windows", 1) if windows is not None else (4 if quick else 16)
        if threads is not None:
            check_threads(threads, allow_default=False)
        try:
            lengths = tuple(int(x) for x in passkey_lengths.split(",") if x.strip())
        except ValueError:
            raise ConfigError(f"--passkey-lengths must be comma-separated integers, got {passkey_lengths!r}") from None
        for length in lengths:
            check_int(length, "--passkey-lengths", 1)
        check_int(passkey_repeats, "--passkey-repeats", 1)
        keys = None
        if passkey:
            keys = PasskeyProtocol.covering(lengths[:1] if quick else lengths, repeats=passkey_repeats,
                                            prime=passkey_prime)
        run_seeds = parse_seeds(seeds) if seeds is not None else (QUICK_SEEDS if quick else DEFAULT_SEEDS)
        text_protocol = (TextProtocol.quick() if quick else TextProtocol()) if text else None
        return cls(names, WindowProtocol(n_windows=n_windows), keys, model, threads, run_seeds, backend, text_protocol)


def parse_seeds(text: str) -> tuple[int, ...]:
    """'0,1,2' -> (0, 1, 2); a count 'N' alone is not accepted (it reads like one seed)."""
    try:
        seeds = tuple(dict.fromkeys(int(x) for x in text.split(",") if x.strip()))
    except ValueError:
        raise ConfigError(f"--seeds must be comma-separated integers, got {text!r}") from None
    if not seeds:
        raise ConfigError("--seeds needs at least one seed")
    for seed in seeds:
        check_int(seed, "--seeds", 0)
    return seeds


class PlainProgress:
    """Progress as plain lines on stderr when it is not a terminal (a log file, CI, `nohup`): rich draws nothing there.

    One line per task at most every `every_s` seconds, and one when the task completes.
    """

    def __init__(self, stream=None, every_s: float = 60.0):
        self.stream = stream if stream is not None else sys.stderr
        self.every_s = every_s
        self.started = time.perf_counter()
        self.last_line = -math.inf

    def advance(self, description: str, done: int, total: int) -> None:
        now = time.perf_counter()
        if done < total and now - self.last_line < self.every_s:
            return
        self.last_line = now
        elapsed = int(now - self.started)
        print(f"{description}: {done}/{total} ({elapsed // 60}m{elapsed % 60:02d}s)", file=self.stream, flush=True)


def run_eval(settings: EvalSettings, console: Console | None = None,
             checkpoint: Callable[[list[CacheQuality]], None] | None = None) -> list[CacheQuality]:
    """The evaluation; `checkpoint(records)` is called whenever the records gained results (after the
    perplexity pass, after each cache's passkey trials), so a long run can be saved as it goes."""
    from ..backends import load_runtime

    if settings.threads:
        torch.set_num_threads(settings.threads)
    engine = load_runtime(settings.backend, settings.model, "fp32", "cpu")
    loaded = engine.loaded
    for name in settings.caches:  # fail on a cache this model cannot hold before any long work
        engine.make_cache(name, 16)
    token_windows = corpus_windows(loaded.tokenizer, settings.protocol)  # and on more windows than the corpus holds
    if settings.passkey:  # and on a passkey prompt the model cannot hold
        check_passkey_fits(loaded, settings.passkey)
    n_runs = 1 + sum(len(seed_variants(n, settings.seeds)) for n in settings.caches if n != engine.reference)
    bar_console = console or Console(stderr=True)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=bar_console, transient=console is None)
    plain = None if bar_console.is_terminal else PlainProgress()
    started = time.perf_counter()

    def advancer(description: str, total: int):
        task = progress.add_task(description, total=total)
        done = 0

        def advance():
            nonlocal done
            done += 1
            progress.advance(task)
            if plain:
                plain.advance(description, done, total)
        return advance

    with progress:
        records = perplexity_suite(loaded, list(settings.caches), settings.protocol,
                                   advancer("perplexity (windows × cache runs)", settings.protocol.n_windows * n_runs),
                                   token_windows, settings.seeds, engine)
        finish_records(records, settings, started, checkpoint)
        if settings.text:
            advance = advancer("text (prompts × caches)", settings.text.n_prompts * len(records))
            reference = None
            for record in records:   # records[0] is the reference (dense): every cache is compared with its text
                built = seed_variants(record.cache, settings.seeds)[0][1]
                runs = continuations(loaded, engine, built, settings.text, advance)
                reference = reference or runs
                record.extra["text"] = compare(runs, reference)
            finish_records(records, settings, started, checkpoint)
        if settings.passkey:
            p = settings.passkey
            advance = advancer("passkey (trials × caches)", p.trials * len(records))
            for record in records:
                trials = passkey_trials(loaded, record.cache, p, advance,
                                        seed_variants(record.cache, settings.seeds), engine)
                record.passkey_found = sum(t["found"] for t in trials)
                record.passkey_total = len(trials)
                record.passkey_accuracy = record.passkey_found / len(trials)
                margins = [t["key_margin"] for t in trials if t["key_margin"] is not None]
                if margins:
                    record.passkey_margin = (round(statistics.mean(margins), 4), round(min(margins), 4))
                record.extra["passkey_trials"] = trials
                record.extra["decode_tokens_per_s"] = statistics.median(t["decode_tokens_per_s"] for t in trials)
                finish_records(records, settings, started, checkpoint)
    if console is not None:
        console.print(quality_table(records))
    return records


def finish_records(records: list[CacheQuality], settings: EvalSettings, started: float, checkpoint=None) -> None:
    """Stamp the run's protocol and time on every record, then hand them to `checkpoint` (if any)."""
    for record in records:
        record.extra["seconds_total"] = round(time.perf_counter() - started, 1)
        record.extra["protocol"] = (f"{settings.protocol.n_windows} windows × {settings.protocol.length} tokens, "
                                    f"prefill {settings.protocol.prefill}, chunks {settings.protocol.chunk}, fp32, "
                                    f"TurboQuant seeds {','.join(map(str, settings.seeds))}, "
                                    f"{100 * COVERAGE:.0f}% bootstrap interval over windows")
        record.extra["backend"] = settings.backend
        if settings.passkey:
            record.extra["passkey_protocol"] = settings.passkey.describe()
        if settings.text:
            record.extra["text_protocol"] = settings.text.describe()
    if checkpoint:
        checkpoint(records)


def quality_table(records: list[CacheQuality]) -> Table:
    dense = records[0] if records else None   # the reference: dense (hf:dynamic with --backend transformers)
    title = "KV cache quality"
    if dense:
        title += f" ({dense.cache} perplexity {dense.ppl:.2f}, {dense.scored_tokens:,} scored tokens"
        title += f"; ± sd over seeds, [{100 * COVERAGE:.0f}% bootstrap interval over windows]"
        title += "; key margin: the passkey's logit lead, mean / smallest trial"
        if "text" in dense.extra:
            title += ("; text: the median first token that differs from dense's greedy text (prompts whose text is dense's), "
                      "chat answers right (as dense's), the longest repeated n-gram run / distinct 4-grams")
        title += ")"
    table = Table(title=title)
    for column in ("cache", "bytes/token", "× smaller", "bits/value", "seeds", "PPL", "ΔPPL", "ΔPPL interval",
                   "mean KL", "top-1", "passkey", "key margin", "text: 1st diff", "answers", "loop / distinct-4"):
        table.add_column(column, justify="left" if column == "cache" else "right")
    for r in records:
        ratio = records[0].bytes_per_token / r.bytes_per_token if r.bytes_per_token else float("inf")
        delta = f"{r.ppl_delta_pct:+.2f}%" + (f" ± {r.ppl_delta_sd:.2f}" if len(r.seeds) > 1 else "")
        interval = "—" if r.ppl_delta_ci is None else f"[{r.ppl_delta_ci[0]:+.2f}, {r.ppl_delta_ci[1]:+.2f}]"
        table.add_row(
            r.cache, f"{r.bytes_per_token:,.0f}", f"{ratio:.2f}×", f"{r.bits_per_value:.2f}", str(max(1, len(r.seeds))),
            f"{r.ppl:.2f}", delta, interval, f"{r.kl:.4f}", f"{100 * r.top1_agreement:.1f}%", passkey_cell(r),
            "—" if r.passkey_margin is None else f"{r.passkey_margin[0]:.2f} / {r.passkey_margin[1]:+.2f}",
            *text_cells(r.extra.get("text")),
        )
    return table


def text_cells(text: dict | None) -> tuple[str, str, str]:
    """The text part's three cells: first difference (same texts), answers (as dense's), loop run / distinct 4-grams."""
    if not text:
        return "—", "—", "—"
    first = f"{text['first_difference_median']:g} ({text['same_text']}/{text['prompts']})"
    answers = f"{text['answers_right']}/{text['questions']} ({text['answers_as_dense']} as dense)" if text["questions"] else "—"
    return first, answers, f"{text['repeat_run_mean']:.1f} / {text['distinct4_mean']:.2f}"


def passkey_cell(r: CacheQuality) -> str:
    if r.passkey_total:
        return f"{r.passkey_found}/{r.passkey_total}"
    return "—" if r.passkey_accuracy is None else f"{100 * r.passkey_accuracy:.0f}%"
