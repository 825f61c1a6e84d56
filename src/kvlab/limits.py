"""Bounds on the numbers a user gives kvlab. Each check returns the value or raises InputLimitError whose
one-line message names the option (`--threads`, `--seed`, ...) and the range it accepts.

The limits are what the machine or the library can actually do, not taste: torch crashes with tens of
thousands of threads, torch's generators take 64-bit seeds, and a device string must name a device
this machine has.
"""

from __future__ import annotations

import math
import os
import re

from .errors import ConfigError, InputLimitError

#: threads beyond this many per core only add scheduling overhead (and torch segfaults at ~100,000)
THREADS_PER_CORE = 4
#: torch.Generator.manual_seed takes any integer in [-2**63, 2**64); kvlab asks for a non-negative one
MAX_SEED = 2**64 - 1
#: timing repeats: a median of more than this many runs is never needed
MAX_REPEATS = 100


def max_threads() -> int:
    return THREADS_PER_CORE * (os.cpu_count() or 1)


def check_int(value, option: str, low: int, high: int | None = None, why: str = "") -> int:
    """An integer in [low, high] (high None: no upper bound)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputLimitError(f"{option} must be a whole number, got {value!r}")
    if value < low or (high is not None and value > high):
        span = f"at least {low:,}" if high is None else f"between {low:,} and {high:,}"
        raise InputLimitError(f"{option} must be {span}{f' ({why})' if why else ''}, got {value:,}")
    return value


def check_threads(n: int, option: str = "--threads", allow_default: bool = True) -> int:
    """0 (torch's default, when allowed) or 1 .. THREADS_PER_CORE × cores."""
    return check_int(n, option, 0 if allow_default else 1, max_threads(),
                     f"{THREADS_PER_CORE} per core on this {os.cpu_count() or 1}-core machine")


def check_seed(seed: int | None, option: str = "--seed") -> int | None:
    if seed is None:
        return None
    return check_int(seed, option, 0, MAX_SEED, "a 64-bit seed")


def check_float(value: float, option: str, low: float | None = None, high: float | None = None,
                low_open: bool = False) -> float:
    """A finite number in [low, high] ((low, high] with low_open)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise InputLimitError(f"{option} must be a number, got {value!r}") from None
    if not math.isfinite(number):
        raise InputLimitError(f"{option} must be a finite number, got {value!r}")
    below = low is not None and (number <= low if low_open else number < low)
    if below or (high is not None and number > high):
        left = "" if low is None else (f"> {low:g}" if low_open else f">= {low:g}")
        right = "" if high is None else f"<= {high:g}"
        raise InputLimitError(f"{option} must be {' and '.join(p for p in (left, right) if p)}, got {value!r}")
    return number


def check_device(name: str, option: str = "--device"):
    """A torch.device this machine has: cpu, cuda[:i] when CUDA is available, mps when available."""
    import torch

    text = str(name).strip()
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        raise InputLimitError(f"{option} {name!r} is not a device; use cpu, cuda, cuda:N or mps") from None
    if device.type == "cpu":
        return device
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InputLimitError(f"{option} {name!r}: this torch has no usable CUDA device; use --device cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise InputLimitError(f"{option} {name!r}: this machine has {count} CUDA device(s) (cuda:0 .. cuda:{count - 1})")
        return device
    if device.type == "mps":
        if not torch.backends.mps.is_available():
            raise InputLimitError(f"{option} {name!r}: MPS is not available on this machine; use --device cpu")
        return device
    raise InputLimitError(f"{option} {name!r}: kvlab runs on cpu, cuda or mps")


#: size units a user may write: decimal (kb, MB, GB, TB) and binary (KiB, MiB, GiB, TiB), any case
SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
              "gib": 2**30, "tib": 2**40}


def parse_size(value: int | str, option: str, examples: str = "5.97GB, 920MiB or a number of bytes") -> int:
    """5.97GB, 920MiB, 1e9, 4096 -> bytes (> 0); anything else is one line naming `option`."""
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?(?:e[0-9]+)?)\s*([a-z]*)\s*", str(value).lower())
        if not match or match.group(2) not in SIZE_UNITS:
            raise ConfigError(f"{option} must be a size like {examples}, got {value!r}")
        number = int(float(match.group(1)) * SIZE_UNITS[match.group(2)])
    if number <= 0:
        raise ConfigError(f"{option} must be positive, got {value!r}")
    return number
