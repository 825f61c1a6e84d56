"""transformers' own caches by name, the baseline rows of `kvlab eval --backend transformers`.

    hf:dynamic               DynamicCache: full precision, the transformers backend's reference row
    hf:fp8                   QuantizedCache(backend="fp8"): float8 e4m3 with one scale per tensor (no extra package)
    hf:quanto-int4+r128      QuantizedCache(backend="quanto", nbits=4, residual_length=128)   needs optimum-quanto
    hf:quanto-int2+r128      ... nbits=2
    hf:hqq-4+r128            QuantizedCache(backend="hqq", nbits=4, residual_length=128)      needs hqq
    hf:hqq-3+r0              ... nbits 1, 2, 3, 4 or 8; any residual length

`+rN` is the residual length (the newest tokens kept in full precision until N are pending, then all
are re-quantized); without it transformers' default, 128, is used and spelled out in the name. The
quantized backends group 64 values (transformers' default q_group_size) with transformers' default axes (0).
For hqq that is HQQ's reshape of each K/V tensor to (64, -1): a group holds values 1/64 of the tensor apart,
across heads and tokens, which costs it quality (one window: hqq-4 +38% ΔPPL, quanto-int4 +2.9%). Axis 1
(a group per head vector) would be the better grouping, but HQQ's 4-bit packing splits the rows in halves and
fails on an odd count of vectors (one token of 3 KV heads), so the baseline stays as transformers ships it.
Bytes: `held_nbytes` walks every tensor the cache object holds (quantized data, scales, zero points,
the full-precision residual), once per storage.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .errors import ConfigError

PREFIX = "hf:"
DEFAULT_RESIDUAL = 128
_NAME = re.compile(r"hf:(?P<kind>dynamic|fp8|quanto-int(?P<qbits>[24])|hqq-(?P<hbits>[12348]))(?:\+r(?P<residual>\d+))?")
_PACKAGES = {"quanto": ("optimum-quanto", "is_optimum_quanto_available"), "hqq": ("hqq", "is_hqq_available")}
EXAMPLES = ("hf:dynamic", "hf:fp8", "hf:quanto-int4+r128", "hf:quanto-int2+r128", "hf:hqq-4+r128", "hf:hqq-3+r0")


def is_baseline_name(name: str) -> bool:
    return name.strip().lower().startswith(PREFIX)


@dataclass(frozen=True)
class Baseline:
    """A parsed `hf:` name: which transformers cache, its bits and residual length."""

    backend: str                 # dynamic | fp8 | quanto | hqq
    nbits: int | None = None
    residual: int | None = None

    @classmethod
    def parse(cls, name: str) -> "Baseline":
        match = _NAME.fullmatch(name.strip().lower())
        if match is None:
            raise ConfigError(f"unknown transformers cache {name!r}; choose one of: {', '.join(EXAMPLES)} (+rN: residual length)")
        kind = match["kind"]
        if kind in ("dynamic", "fp8"):
            if match["residual"] is not None:
                raise ConfigError(f"cache {name!r}: {kind} has no residual length (+rN is for quanto and hqq)")
            return cls(kind)
        backend = kind.split("-")[0]
        residual = int(match["residual"]) if match["residual"] is not None else DEFAULT_RESIDUAL
        return cls(backend, int(match["qbits"] or match["hbits"]), residual)

    @property
    def name(self) -> str:
        """The name with the residual length spelled out."""
        if self.backend in ("dynamic", "fp8"):
            return PREFIX + self.backend
        bits = f"int{self.nbits}" if self.backend == "quanto" else str(self.nbits)
        return f"{PREFIX}{self.backend}-{bits}+r{self.residual}"

    def check_installed(self) -> None:
        """One line naming the package a quanto / hqq cache needs, before any model is loaded."""
        if self.backend not in _PACKAGES:
            return
        package, probe = _PACKAGES[self.backend]
        from transformers import utils

        if not getattr(utils, probe)():
            raise ConfigError(f"cache {self.name!r} needs the {package} package: pip install {package}")

    def build(self, config):
        """The transformers cache for a model of `config` (its `model.config`)."""
        from transformers import DynamicCache, QuantizedCache

        if self.backend == "dynamic":
            return DynamicCache(config=config)
        self.check_installed()
        options = {} if self.backend == "fp8" else {"nbits": self.nbits, "residual_length": self.residual}
        try:
            return QuantizedCache(self.backend, config, **options)
        except (ValueError, ImportError) as error:  # e.g. a model with sliding-window layers
            message = " ".join(str(error).split())
            raise ConfigError(f"cache {self.name!r}: {message[:300]}") from None


def held_nbytes(obj) -> int:
    """Bytes of every tensor `obj` holds: a transformers Cache, its layers, their dicts, lists and tuples, and
    the inner tensors of tensor subclasses (quanto's packed tensors); each storage counted once."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    try:  # transformers 5: the recurrent layers' conv / recurrent state
        from transformers.cache_utils import LinearAttentionCacheLayerMixin as StateLayer
    except ImportError:
        StateLayer = CacheLayerMixin
    seen: set[tuple[int, int]] = set()

    def walk(item) -> int:
        if isinstance(item, torch.Tensor):
            if hasattr(item, "__tensor_flatten__") and type(item) is not torch.Tensor and not isinstance(item, torch.nn.Parameter):
                inner, _ = item.__tensor_flatten__()
                return sum(walk(getattr(item, attr)) for attr in inner)
            key = (item.untyped_storage().data_ptr(), item.untyped_storage().nbytes()) if item.numel() else (id(item), 0)
            if key in seen:
                return 0
            seen.add(key)
            return item.untyped_storage().nbytes() if item.numel() else 0
        if isinstance(item, dict):
            return sum(walk(value) for value in item.values())
        if isinstance(item, (list, tuple)):
            return sum(walk(value) for value in item)
        if isinstance(item, (Cache, CacheLayerMixin, StateLayer)):
            return sum(walk(value) for value in vars(item).values())
        return 0

    return walk(obj)
