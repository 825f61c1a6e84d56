"""CacheGeometry: the shapes a cache holds (no torch: the planner builds them too)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

#: rows a dense sliding-window cache keeps beyond window - 1: room for one prompt chunk before rows move
#: (model/layer_caches.SlidingWindowCache; the planner's --engine kvlab counts them)
WINDOW_BLOCK = 256


@dataclass(frozen=True)
class CacheGeometry:
    """The shapes a cache must hold: the attention part of a model, one batch of sequences."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    batch: int = 1
    capacity: int = 2048               # tokens per sequence the cache can hold
    n_heads: int = 0                   # query heads (0: unknown / same as n_kv_heads)
    head_dim_v: int = 0                # 0: same as head_dim
    window: int | None = None          # sliding-window attention, applied when reading
    rope_inv_freq: tuple[float, ...] | None = None  # the model's RoPE frequencies (head_dim/2), for caches that
                                                    # code keys before RoPE (tq+prerope); None: unknown

    def __post_init__(self) -> None:
        for name in ("n_layers", "n_kv_heads", "head_dim", "batch"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"cache {name} must be positive, got {getattr(self, name)}")
        if self.capacity <= 0:
            raise ConfigError(f"cache capacity must be positive, got {self.capacity}")
        if self.head_dim_v == 0:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        if self.n_heads == 0:
            object.__setattr__(self, "n_heads", self.n_kv_heads)

    @classmethod
    def for_model(cls, config, batch: int = 1, capacity: int | None = None) -> "CacheGeometry":
        """From a DecoderConfig."""
        return cls(
            n_layers=config.n_layers,
            n_kv_heads=config.n_kv_heads,
            head_dim=config.head_dim,
            batch=batch,
            capacity=capacity or config.max_seq_len,
            n_heads=config.n_heads,
            window=config.sliding_window,
            rope_inv_freq=_rope_frequencies(config),
        )


def _rope_frequencies(config) -> tuple[float, ...] | None:
    """The decoder's RoPE inverse frequencies as a tuple (None for a config without RoPE settings)."""
    if not hasattr(config, "rope_theta"):
        return None
    from ..rope import rope_inv_freq   # torch: only for a config that has RoPE

    return tuple(rope_inv_freq(config).tolist())
