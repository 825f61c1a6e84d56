"""KV caches behind one protocol, and the formats (CacheSpec) the CLI, the server and the planner name them by.

Importing the package loads no torch: the format (format.py) and the geometry are plain Python, so the planner reads
them without it. Everything else loads on first use (module __getattr__), and the compressed formats (quantized.py,
turboquant.py) only when a compressed cache is built: a run with a dense cache never loads them (their code and the
torch code they touch at import cost ~4 MiB of resident memory).
"""

from __future__ import annotations

import importlib

from .format import CacheSpec, FullPrecision
from .geometry import CacheGeometry

#: name -> the module that holds it, imported when first asked for
_LAZY = {"KVCache": "base", "DenseCache": "dense", "ConcatCache": "concat", "NoCache": "concat",
         "make_cache": "names", "expected_nbytes": "names", "cache_names": "names", "describe_formula": "names",
         "QuantizedCache": "quantized", "QuantizedConfig": "quantized",
         "TurboQuantCache": "turboquant", "TurboQuantConfig": "turboquant"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CacheGeometry", "CacheSpec", "FullPrecision", *_LAZY]
