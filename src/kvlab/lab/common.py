"""What every lab experiment shares: progress reporting, the machine it ran on, plots, JSON files."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


class Ticker:
    """Progress of one experiment. The experiment calls `reset(total)` once, then `advance()`.

    Alone it drives its own bar; under `kvlab lab all` it also moves the bar across the whole run
    by `weight × done / total`, so every experiment fills its share of that bar exactly once.
    """

    def __init__(self, progress=None, task=None, overall=None, weight: float = 0.0):
        self.progress, self.task, self.overall, self.weight = progress, task, overall, weight
        self.total, self.done = 1, 0

    def reset(self, total: int, description: str | None = None) -> None:
        self.total, self.done = max(1, int(total)), 0
        if self.progress is not None:
            fields = {"description": description} if description else {}
            self.progress.update(self.task, total=self.total, completed=0, **fields)

    def describe(self, description: str) -> None:
        if self.progress is not None:
            self.progress.update(self.task, description=description)

    def advance(self, n: int = 1) -> None:
        n = max(0, min(n, self.total - self.done))
        self.done += n
        if self.progress is not None and n:
            self.progress.advance(self.task, n)
            if self.overall is not None:
                self.progress.advance(self.overall, self.weight * n / self.total)

    def finish(self) -> None:
        self.advance(self.total - self.done)


def progress_bar(console=None, transient: bool = True):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=transient)


@contextmanager
def ticker_for(console=None, enabled: bool = True, description: str = "") -> Iterator[Ticker]:
    """A Ticker with its own rich bar (or a silent one when `enabled` is False, e.g. for --json)."""
    if not enabled:
        yield Ticker()
        return
    with progress_bar(console) as progress:
        yield Ticker(progress, progress.add_task(description, total=1))
