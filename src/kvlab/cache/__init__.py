"""KV caches behind one protocol, and the names the CLI and planner know them by.

The compressed formats (quantized.py, turboquant.py) are imported on first use: a run with a dense cache never
loads them (their code and the torch code they touch at import cost ~4 MiB of resident memory).
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .base import CacheGeometry, KVCache
from .concat import ConcatCache, NoCache
from .dense import STORAGE as _DENSE_STORAGE
from .dense import DenseCache
from .names import EXAMPLES as _COMPRESSED_EXAMPLES
from .names import expand, is_compressed_name, parse as _parse_compressed

#: the compressed caches' classes, importable from here as before (loaded when first asked for)
_LAZY = {"QuantizedCache": "quantized", "QuantizedConfig": "quantized",
         "TurboQuantCache": "turboquant", "TurboQuantConfig": "turboquant"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

#: name -> cache class for the uncompressed caches; compressed caches add their parser below.
#: dense-f16 / dense-bf16: the dense cache storing K/V in f16 / bf16 whatever the run's dtype (cache/dense.py).
_PLAIN = {"dense": DenseCache, "dense-f16": DenseCache, "dense-bf16": DenseCache, "concat": ConcatCache, "none": NoCache}


def _storage(key: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype the dense cache `key` stores K/V in, in a run of `dtype`."""
    return _DENSE_STORAGE[key] or dtype


def cache_names() -> list[str]:
    """Examples of every accepted name (compressed caches take parameters in the name)."""
    return list(_PLAIN) + _COMPRESSED_EXAMPLES


def make_cache(name: str, geometry: CacheGeometry, dtype: torch.dtype = torch.float32, device="cpu") -> KVCache:
    """Build the cache called `name` (e.g. "dense", "concat", "none")."""
    key = name.strip().lower()
    if key in _DENSE_STORAGE:
        return DenseCache(geometry, dtype=dtype, device=device, storage=_storage(key, dtype))
    if key in _PLAIN:
        return _PLAIN[key](geometry, dtype=dtype, device=device)
    if is_compressed_name(key):
        cls, config = _parse_compressed(key)
        return cls(geometry, dtype=dtype, device=device, config=config)
    raise ConfigError(f"unknown cache {name!r}; choose one of: {', '.join(cache_names())}")


def expected_nbytes(name: str, geometry: CacheGeometry, dtype: torch.dtype, tokens: int) -> int:
    """The bytes cache `name` holds after `tokens` tokens per sequence, by formula (no tensors made)."""
    key = name.strip().lower()
    if key in _DENSE_STORAGE:
        return DenseCache.bytes_per_token(geometry, _storage(key, dtype)) * geometry.batch * geometry.capacity
    if key == "concat":
        return DenseCache.bytes_per_token(geometry, dtype) * geometry.batch * tokens
    if key == "none":
        return 0
    if is_compressed_name(key):  # preallocated to the capacity: independent of `tokens`
        cls, config = _parse_compressed(key)
        return cls.expected_nbytes(config, geometry, dtype)
    raise ConfigError(f"unknown cache {name!r}; choose one of: {', '.join(cache_names())}")


def describe_formula(name: str, geometry: CacheGeometry, dtype: torch.dtype) -> str:
    """The bytes of cache `name` in words, e.g. "per key vector: 64×4-bit codes + 16-bit norm = 34 B; ..."."""
    key = name.strip().lower()
    if key in ("dense", "concat") or key in _DENSE_STORAGE:
        stored = _storage(key, dtype) if key in _DENSE_STORAGE else dtype
        elem = torch.empty(0, dtype=stored).element_size()
        text = f"per key and value vector: {geometry.head_dim}×{elem * 8}-bit values = {geometry.head_dim * elem} B"
        if stored != dtype:
            text += f" ({str(stored).removeprefix('torch.')} storage, {str(dtype).removeprefix('torch.')} attention)"
        return text
    if key == "none":
        return "nothing is kept between forward passes"
    cls, config = _parse_compressed(key)
    text = cls.describe(config, geometry, dtype)
    dtype_name = str(dtype).removeprefix("torch.")
    if config.full.sink:
        text += f"; the first {config.full.sink} tokens of every layer in {dtype_name}"
    if config.full.recent:
        text += f"; the newest {config.full.recent} tokens of every layer in {dtype_name}"
    if config.full.first_last:
        text += f"; layers 0 and {geometry.n_layers - 1} whole in {dtype_name}"
    if expand(key) != key:   # a preset (tq4): the recipe it stands for first
        text = f"{config.name}: {text}"
    return text


__all__ = ["CacheGeometry", "KVCache", "DenseCache", "ConcatCache", "NoCache", "make_cache", "expected_nbytes", "cache_names",
           "describe_formula", "QuantizedCache", "QuantizedConfig", "TurboQuantCache", "TurboQuantConfig"]
