"""The cache protocol: storage plus the attention that reads it.

Every layer of the decoder does
    cache.append(layer, k, v)     # k: (B, Hkv, T, Dk), v: (B, Hkv, T, Dv) for the T new tokens
    out = cache.attend(layer, q)  # q: (B, H, T, Dk) for the same T tokens -> (B, H, T, Dv)
so a cache decides how K/V are stored and how they are read, and swapping caches never touches the model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import replace

import torch

from ..errors import CacheCapacityError, ConfigError, NonFiniteError
from .geometry import CacheGeometry


class KVCache(ABC):
    """Base class for every cache. Subclasses store K/V their own way and answer `attend` from it."""

    #: False for the no-cache baseline: generation must then feed the whole sequence every step.
    persistent: bool = True

    #: the layout a C kernel reads this cache in ("dense", "int", "tq"), or None: only the modules read it. A
    #: subclass is read like its parent only where it says so (it may change what attention reads).
    kernel_format: str | None = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "kernel_format" not in cls.__dict__:
            cls.kernel_format = None

    def __init__(self, geometry: CacheGeometry, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.geometry = geometry
        self.dtype = dtype
        self.device = torch.device(device)
        self.scale = geometry.head_dim ** -0.5
        self._lengths = [0] * geometry.n_layers

    # -- the protocol ---------------------------------------------------------------------------
    @abstractmethod
    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the K/V of T new tokens for `layer`. k: (B, Hkv, T, Dk), v: (B, Hkv, T, Dv)."""

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of the T newest tokens' queries over everything stored. q: (B, H, T, Dk) -> (B, H, T, Dv)."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of every buffer the cache holds right now (data and metadata)."""

    def reset(self) -> None:
        """Forget all tokens (buffers stay allocated where the cache preallocates)."""
        self._lengths = [0] * self.geometry.n_layers

    @property
    def length(self) -> int:
        """Tokens stored in every layer: the absolute position of the next token."""
        return min(self._lengths)

    def layer_length(self, layer: int) -> int:
        return self._lengths[layer]

    @property
    def is_level(self) -> bool:
        """Every layer holds the same number of tokens (what a one-token step over all layers needs)."""
        return all(n == self._lengths[0] for n in self._lengths)

    # -- growth ---------------------------------------------------------------------------------------
    def grown(self, capacity: int) -> "KVCache":
        """A new cache with room for `capacity` tokens per sequence holding exactly what this one holds: the same
        tokens, codes and per-layer state in bigger buffers (nothing is re-coded). Used by kvlab.hf, whose caches
        grow as transformers' DynamicCache does."""
        if capacity < self.geometry.capacity:
            raise ConfigError(f"a cache grows, never shrinks: capacity {capacity} < {self.geometry.capacity}")
        bigger = self._empty(replace(self.geometry, capacity=capacity))
        self._copy_into(bigger)
        return bigger

    def _empty(self, geometry: CacheGeometry) -> "KVCache":
        """An empty cache of this kind and configuration for `geometry`."""
        return type(self)(geometry, self.dtype, self.device)

    def _copy_into(self, bigger: "KVCache") -> None:
        """Copy every token and piece of state into `bigger` (same kind, capacity at least this one's).
        Subclasses extend it with their buffers."""
        bigger._lengths = list(self._lengths)

    # -- shared checks ----------------------------------------------------------------------------
    def _check_attend(self, layer: int, q: torch.Tensor) -> None:
        """The query fits this cache: q (B, H, T, Dk) with H a multiple of the KV heads (one line otherwise; T may be 0)."""
        g = self.geometry
        if not 0 <= layer < g.n_layers:
            raise ConfigError(f"layer {layer} out of range for a cache of {g.n_layers} layers")
        if (q.dim() != 4 or q.shape[0] != g.batch or q.shape[1] == 0 or q.shape[1] % g.n_kv_heads
                or q.shape[3] != g.head_dim):
            raise ConfigError(
                f"query of shape {tuple(q.shape)} does not fit a cache of (batch={g.batch}, heads=a multiple of "
                f"{g.n_kv_heads}, T, head_dim={g.head_dim})"
            )

    def _check_append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """Validate shapes, capacity and finiteness; returns the number of new tokens T."""
        g = self.geometry
        if not 0 <= layer < g.n_layers:
            raise ConfigError(f"layer {layer} out of range for a cache of {g.n_layers} layers")
        if k.dim() != 4 or k.shape[0] != g.batch or k.shape[1] != g.n_kv_heads or k.shape[3] != g.head_dim:
            raise ConfigError(
                f"key of shape {tuple(k.shape)} does not fit a cache of (batch={g.batch}, kv_heads={g.n_kv_heads}, T, head_dim={g.head_dim})"
            )
        if v.shape[:3] != k.shape[:3] or v.shape[3] != g.head_dim_v:
            raise ConfigError(f"value of shape {tuple(v.shape)} does not match key of shape {tuple(k.shape)}")
        n_new = k.shape[2]
        if self.persistent and self._lengths[layer] + n_new > g.capacity:
            raise CacheCapacityError(
                f"context of {self._lengths[layer] + n_new} tokens exceeds the cache capacity of {g.capacity} tokens"
            )
        if not (torch.isfinite(k).all() and torch.isfinite(v).all()):
            raise NonFiniteError(f"NaN or Inf in the keys/values appended to layer {layer}")
        return n_new


def copy_prefix(old, new) -> None:
    """Copy buffer `old` into the leading corner of `new` (same rank, each size at least old's); dicts of
    buffers key by key. Tokens and groups are prefix-aligned along the slot axis, so this is how they grow."""
    if isinstance(old, dict):
        for key, tensor in old.items():
            copy_prefix(tensor, new[key])
        return
    if old.dim() != new.dim() or any(a > b for a, b in zip(old.shape, new.shape)):
        raise ConfigError(f"cannot grow a buffer of shape {tuple(old.shape)} into {tuple(new.shape)}")
    new[tuple(slice(0, n) for n in old.shape)] = old


def tensors_nbytes(*tensors: torch.Tensor | None) -> int:
    """Sum of `tensor.nbytes` over the given buffers (None counts as zero)."""
    return sum(t.nbytes for t in tensors if t is not None)
