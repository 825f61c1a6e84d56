"""The caches by name: a CacheSpec (format.py, the grammar) built into the cache that stores it.

The compressed formats (quantized.py, turboquant.py) are imported on first use: a run with a dense cache never
loads them (their code and the torch code they touch at import cost ~4 MiB of resident memory).
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .base import CacheGeometry, KVCache
from .concat import ConcatCache, NoCache
from .dense import DenseCache
from .format import EXAMPLES, NAMES, PRESETS, CacheSpec  # noqa: F401  (EXAMPLES, PRESETS: importable from here)


def cache_names() -> list[str]:
    """Examples of every accepted name (compressed caches take parameters in the name)."""
    return list(NAMES)


def compressed(spec: CacheSpec) -> tuple[type, object]:
    """The cache class and config of a compressed spec: (QuantizedCache, QuantizedConfig) or (TurboQuantCache, ...)."""
    if spec.base == "int":
        from .quantized import QuantizedCache, QuantizedConfig

        return QuantizedCache, QuantizedConfig(bits=spec.key_bits, group_size=spec.group_size or 32, full=spec.full)
    from .turboquant import TurboQuantCache, TurboQuantConfig, config_fields

    return TurboQuantCache, TurboQuantConfig(**config_fields(spec))


def parse(name: str) -> tuple[type, object]:
    """'tq-k3v3+recent64' -> (TurboQuantCache, TurboQuantConfig(...)); ConfigError for anything else."""
    spec = CacheSpec.parse(name)
    if not spec.compressed:
        raise ConfigError(f"cache {name!r} is not a compressed cache; compressed caches are named like {', '.join(EXAMPLES)}")
    return compressed(spec)


def make_cache(name: str, geometry: CacheGeometry, dtype: torch.dtype = torch.float32, device="cpu") -> KVCache:
    """Build the cache called `name` (e.g. "dense", "concat", "none", "int4", "tq4")."""
    spec = CacheSpec.parse(name).check("torch")
    if spec.base == "dense":
        storage = getattr(torch, spec.storage) if spec.storage else dtype
        return DenseCache(geometry, dtype=dtype, device=device, storage=storage)
    if spec.base == "concat":
        return ConcatCache(geometry, dtype=dtype, device=device)
    if spec.base == "none":
        return NoCache(geometry, dtype=dtype, device=device)
    cls, config = compressed(spec)
    return cls(geometry, dtype=dtype, device=device, config=config)


def expected_nbytes(name: str, geometry: CacheGeometry, dtype: torch.dtype, tokens: int) -> int:
    """The bytes cache `name` holds after `tokens` tokens per sequence, by formula (no tensors made)."""
    return CacheSpec.parse(name).bytes(geometry, tokens, dtype)


def describe_formula(name: str, geometry: CacheGeometry, dtype: torch.dtype) -> str:
    """The bytes of cache `name` in words, e.g. "per key vector: 64×4-bit codes + 16-bit norm = 34 B; ..."."""
    spec = CacheSpec.parse(name)
    if spec.base in ("dense", "concat"):
        stored = getattr(torch, spec.storage) if spec.storage else dtype
        elem = stored.itemsize
        text = f"per key and value vector: {geometry.head_dim}×{elem * 8}-bit values = {geometry.head_dim * elem} B"
        if stored != dtype:
            text += f" ({str(stored).removeprefix('torch.')} storage, {str(dtype).removeprefix('torch.')} attention)"
        return text
    if spec.base == "none":
        return "nothing is kept between forward passes"
    cls, config = compressed(spec)
    text = cls.describe(config, geometry, dtype)
    dtype_name = str(dtype).removeprefix("torch.")
    if config.full.sink:
        text += f"; the first {config.full.sink} tokens of every layer in {dtype_name}"
        if spec.base == "tq":   # format.py CacheSpec.coded_rows
            text += " (their rows of codes kept too, unused, as the serving pool's blocks keep them)"
    if config.full.recent:
        text += f"; the newest {config.full.recent} tokens of every layer in {dtype_name}"
    if config.full.first_last:
        text += f"; layers 0 and {geometry.n_layers - 1} whole in {dtype_name}"
    if spec.preset:   # a preset (tq4): the recipe it stands for first
        text = f"{config.name}: {text}"
    return text

