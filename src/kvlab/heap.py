"""Hand the C heap's free pages back to the system at the points where a run has just freed a lot of memory.

glibc's malloc keeps freed memory in its heap for reuse: a page freed in the middle of the heap stays in the
process's resident set (RSS) until something asks for it back. `release_free_memory()` calls glibc's
`malloc_trim(0)`, which returns every whole free page (the pages are not in use: touching one again costs a fresh
zero-filled page, never wrong data). The loader calls it once the header's Python objects and the tokenizer's
build temporaries are gone, and generation after the prompt's prefill (its chunks' activations). With another C
library (musl, macOS, Windows) it does nothing.
"""

from __future__ import annotations

import ctypes
import functools


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none."""
    try:
        trim = ctypes.CDLL(None).malloc_trim   # the symbols already loaded: glibc's libc on Linux
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_memory() -> bool:
    """Return the heap's free pages to the system (glibc); whether anything could be asked."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
