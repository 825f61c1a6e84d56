"""The cache of a decoder whose layers differ in kind: each kind keeps what it needs, behind the one KVCache protocol.

    full       K/V of every token, in the chosen kvlab cache (dense, int8, tq4, ...)
    sliding    K/V of the last `window` tokens; the dense caches (dense, dense-f16, dense-bf16) keep at most
               window - 1 + one block of rows (SlidingWindowCache); a compressed one keeps every token and masks
               the rest when reading
    recurrent  a fixed state per sequence (RecurrentState): the conv's last kernel-1 inputs and the delta-rule state

A compressed cache therefore codes exactly the attention layers: for Qwen3.5 the 1 layer in 4 that holds KV.
`model_cache(config, name, ...)` builds the right cache for any DecoderConfig (the llama family: one kvlab cache).
"""

from __future__ import annotations

import torch

from ..cache import CacheGeometry, CacheSpec, KVCache, expected_nbytes, make_cache
from ..cache.attention import chunked_attention, grouped_attention
from ..cache.base import tensors_nbytes
from ..cache.blocks import DenseBlocks
from ..cache.geometry import WINDOW_BLOCK  # noqa: F401  (rows beyond the window; importable from here)
from ..errors import CacheCapacityError, ConfigError
from ..kernels import kernel_for
from ..kernels.paged import sequences_attention
from ..rope import kind_frequencies
from .config import LLAMA_FAMILY, DecoderConfig



class RecurrentState:
    """The Gated DeltaNet layers' state for a batch of sequences, preallocated, updated in place.

    conv  (L_rec, B, channels, kernel - 1)  the conv's last inputs
    delta (L_rec, B, v_heads, k_dim, v_dim) the delta-rule state
    Both fp32 whatever the run's dtype (as llama.cpp keeps them; a bf16 run's conv inputs are bf16 values, held
    exactly): state_elements × 4 bytes per sequence, the planner's formula.
    """

    def __init__(self, config: DecoderConfig, batch: int, dtype: torch.dtype, device):
        la = config.linear
        self.layers = config.layers_of("recurrent")
        self.slot = {layer: i for i, layer in enumerate(self.layers)}
        n = len(self.layers)
        self.conv = torch.zeros(n, batch, la.conv_channels, la.conv_kernel - 1, dtype=torch.float32, device=device)
        self.delta = torch.zeros(n, batch, la.v_heads, la.k_dim, la.v_dim, dtype=torch.float32, device=device)

    @staticmethod
    def expected_nbytes(config: DecoderConfig, batch: int, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of the state by formula: per recurrent layer and sequence, (kernel-1)·channels + v_heads·k_dim·v_dim
        fp32 values (the planner's state_elements × 4 B), whatever the run's dtype."""
        la = config.linear
        if la is None:
            return 0
        per_layer = ((la.conv_kernel - 1) * la.conv_channels + la.v_heads * la.k_dim * la.v_dim) * 4
        return len(config.layers_of("recurrent")) * batch * per_layer

    def of(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv state (B, channels, kernel-1), delta state (B, v_heads, k_dim, v_dim)) of model layer `layer`: views."""
        i = self.slot[layer]
        return self.conv[i], self.delta[i]

    def reset(self) -> None:
        self.conv.zero_()
        self.delta.zero_()

    @property
    def nbytes(self) -> int:
        return tensors_nbytes(self.conv, self.delta)


class SlidingWindowCache(KVCache):
    """Dense K/V of sliding-window layers that keeps at most window - 1 + `block` rows per layer, however long the
    sequence (`geometry.capacity`, the positions it may reach, can be far larger).

    The rows hold the newest tokens in order; when a chunk does not fit, the last window - 1 rows (all a new token can
    still see) move to the front first. A chunk longer than `block` is attended from a temporary copy of those rows and
    the chunk, and only its last window - 1 tokens are kept.
    """

    def __init__(self, geometry: CacheGeometry, dtype: torch.dtype = torch.float32, device="cpu", block: int = WINDOW_BLOCK,
                 storage: torch.dtype | None = None):
        super().__init__(geometry, dtype, device)
        g = geometry
        if not g.window:
            raise ConfigError("a sliding-window cache needs a window")
        self.storage = storage or dtype                                  # dense-f16 / dense-bf16: narrower rows
        self.keep = g.window - 1                                         # rows a future token can still see
        self.rows = min(g.capacity, self.keep + block)
        self.blocks = DenseBlocks(g, g.batch, self.rows, self.storage, self.device)   # one block of `rows` per sequence
        self.k, self.v = self.blocks.k, self.blocks.v                    # (L, B, Hkv, rows, D)
        self._held = [0] * g.n_layers                                    # rows in use per layer
        self._wide: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}    # layer -> K/V of a chunk longer than the rows
        self.read_kernel = kernel_for(self.device)                       # None: torch reads the rows (the reference)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n_new = self._check_append(layer, k, v)
        k, v = self.blocks.stored(layer, k, v)                           # rounded as stored (see cache/dense.py)
        self._wide.pop(layer, None)
        held = self._held[layer]
        keep = min(held, self.keep)
        if held + n_new > self.rows and keep < held:                     # the rows the window still needs, to the front
            self.k[layer, :, :, :keep] = self.k[layer, :, :, held - keep:held].clone()
            self.v[layer, :, :, :keep] = self.v[layer, :, :, held - keep:held].clone()
            held = keep
        if held + n_new <= self.rows:
            self.k[layer, :, :, held:held + n_new] = k
            self.v[layer, :, :, held:held + n_new] = v
            self._held[layer] = held + n_new
        else:                                                            # a chunk longer than the block
            wide_k = torch.cat((self.k[layer, :, :, :held], k), dim=2)   # (B, Hkv, held + T, D): a copy
            wide_v = torch.cat((self.v[layer, :, :, :held], v), dim=2)
            self._wide[layer] = (wide_k, wide_v)
            tail = min(self.keep, held + n_new)
            self.k[layer, :, :, :tail] = wide_k[:, :, held + n_new - tail:]
            self.v[layer, :, :, :tail] = wide_v[:, :, held + n_new - tail:]
            self._held[layer] = tail
        self._lengths[layer] += n_new

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        self._check_attend(layer, q)
        if layer in self._wide:
            rows_k, rows_v = self._wide.pop(layer)                       # (B, Hkv, held + T, D), contiguous copies
            held = rows_k.shape[2]
        else:
            rows_k, rows_v, held = self.k[layer], self.v[layer], self._held[layer]   # the newest `held` tokens in order
        out = sequences_attention(self.read_kernel, q, rows_k, rows_v, held, self.scale, self.geometry.window)
        if out is not None:
            return out
        k, v = rows_k[:, :, :held], rows_v[:, :, :held]                   # (B, Hkv, S, D)
        if self.storage != q.dtype:
            return chunked_attention(q, k, v, self.scale, window=self.geometry.window)
        return grouped_attention(q, k, v, self.scale, window=self.geometry.window)

    def reset(self) -> None:
        super().reset()
        self._held = [0] * self.geometry.n_layers
        self._wide.clear()

    @staticmethod
    def expected_nbytes(geometry: CacheGeometry, dtype: torch.dtype, block: int = WINDOW_BLOCK) -> int:
        """Bytes of the rows (`dtype`: the storage dtype), outside a chunk wider than the block."""
        g = geometry
        return DenseBlocks.bytes_for(g, g.batch, min(g.capacity, g.window - 1 + block), dtype)

    @property
    def nbytes(self) -> int:
        return tensors_nbytes(self.k, self.v, *(t for pair in self._wide.values() for t in pair))


class LayeredCache(KVCache):
    """One cache per layer kind of a DecoderConfig, addressed by model layer (the KVCache protocol for attention
    layers; `recurrent(layer)` and `advance(layer, n)` for the recurrent ones)."""

    def __init__(self, config: DecoderConfig, name: str, batch: int = 1, capacity: int | None = None,
                 dtype: torch.dtype = torch.float32, device="cpu", window_block: int = WINDOW_BLOCK):
        capacity = capacity or config.max_seq_len
        super().__init__(CacheGeometry(n_layers=config.n_layers, n_kv_heads=config.n_kv_heads, head_dim=config.head_dim,
                                       batch=batch, capacity=capacity, n_heads=config.n_heads), dtype, device)
        self.config = config
        self.name = name
        self.parts: list[tuple[KVCache, tuple[int, ...]]] = []          # (cache, the model layers it holds)
        self.where: dict[int, tuple[KVCache, int]] = {}                  # model layer -> (its cache, index in it)
        dense, storage = _dense_storage(name)
        for kind, layers, geometry in attention_geometries(config, batch, capacity):
            if kind == "sliding" and dense:                             # dense, dense-f16, dense-bf16
                cache = SlidingWindowCache(geometry, dtype, device, block=window_block, storage=storage)
            else:
                try:
                    cache = make_cache(name, geometry, dtype, device)
                except ConfigError as exc:
                    if "RoPE frequencies" not in str(exc) or geometry.rope_inv_freq is not None:
                        raise
                    raise ConfigError(f"cache {name!r} turns keys by their positions (+prerope, +ropemean), which needs "
                                      f"RoPE over the whole head; {config.arch} rotates {config.rope_dim} of "
                                      f"{config.head_dim} dims: choose a cache without them (tq-k4v4, int8, ...)") from None
            if not cache.persistent:
                raise ConfigError(f"cache {name!r} keeps nothing between forward passes; {config.arch} needs one that does")
            self.parts.append((cache, layers))
            self.where.update({layer: (cache, i) for i, layer in enumerate(layers)})
        self.state = RecurrentState(config, batch, dtype, device) if config.layers_of("recurrent") else None

    @staticmethod
    def expected_nbytes(config: DecoderConfig, name: str, batch: int = 1, capacity: int | None = None,
                        dtype: torch.dtype = torch.float32, window_block: int = WINDOW_BLOCK) -> int:
        """The bytes a LayeredCache of `name` holds, by formula (no tensors made): each attention kind's cache
        (kvlab.cache.expected_nbytes; the dense sliding rows) + the recurrent state."""
        capacity = capacity or config.max_seq_len
        dense, storage = _dense_storage(name)
        total = RecurrentState.expected_nbytes(config, batch, dtype)
        for kind, _, geometry in attention_geometries(config, batch, capacity):
            if kind == "sliding" and dense:
                total += SlidingWindowCache.expected_nbytes(geometry, storage or dtype, window_block)
            else:
                total += expected_nbytes(name, geometry, dtype, capacity)
        return total

    # -- attention layers: the protocol, passed to the cache of the layer's kind -----------------------------
    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        cache, index = self.where[layer]
        cache.append(index, k, v)
        self._lengths[layer] = cache.layer_length(index)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        cache, index = self.where[layer]
        return cache.attend(index, q)

    # -- recurrent layers -------------------------------------------------------------------------------------
    def recurrent(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (conv, delta) state views of recurrent layer `layer` (updated in place by the layer)."""
        return self.state.of(layer)

    def mix(self, layer: int, mixer, h: torch.Tensor) -> torch.Tensor:
        """Run recurrent layer `layer`'s mixer over rows h (B, T, C) and its state (updated in place)."""
        self.check_room(layer, h.shape[1])
        out = mixer(h, *self.recurrent(layer))
        self.advance(layer, h.shape[1])
        return out

    def check_room(self, layer: int, n_new: int) -> None:
        """CacheCapacityError when n_new more tokens would pass the capacity (recurrent layers hold no rows, but the
        positions of the attention layers beside them must fit)."""
        if self._lengths[layer] + n_new > self.geometry.capacity:
            raise CacheCapacityError(f"context of {self._lengths[layer] + n_new} tokens exceeds the cache capacity of "
                                     f"{self.geometry.capacity} tokens")

    def advance(self, layer: int, n_new: int) -> None:
        self._lengths[layer] += n_new

    # -- the rest of KVCache ----------------------------------------------------------------------------------
    def reset(self) -> None:
        super().reset()
        for cache, _ in self.parts:
            cache.reset()
        if self.state is not None:
            self.state.reset()

    def grown(self, capacity: int) -> "KVCache":
        raise ConfigError(f"the {self.config.arch} cache does not grow; make it with the capacity it needs")

    @property
    def kv_nbytes(self) -> int:
        """Bytes of the attention layers' K/V."""
        return sum(cache.nbytes for cache, _ in self.parts)

    @property
    def state_nbytes(self) -> int:
        """Bytes of the recurrent layers' state."""
        return self.state.nbytes if self.state is not None else 0

    @property
    def nbytes(self) -> int:
        return self.kv_nbytes + self.state_nbytes


def attention_geometries(config: DecoderConfig, batch: int, capacity: int) -> list[tuple[str, tuple[int, ...], CacheGeometry]]:
    """(kind, its model layers, the geometry of their cache) for each attention kind the model has: full and sliding
    (with the window). RoPE frequencies go with each (for +prerope caches) when RoPE covers whole heads."""
    whole_head = config.rope_dim == config.head_dim     # +prerope caches undo RoPE over whole heads only
    frequencies = kind_frequencies(config)
    out = []
    for kind in ("full", "sliding"):
        layers = config.layers_of(kind)
        if layers:
            out.append((kind, layers, CacheGeometry(
                n_layers=len(layers), n_kv_heads=config.n_kv_heads, head_dim=config.head_dim, batch=batch,
                capacity=capacity, n_heads=config.n_heads, window=config.sliding_window if kind == "sliding" else None,
                rope_inv_freq=tuple(frequencies[kind].tolist()) if whole_head else None)))
    return out


def model_cache(config: DecoderConfig, name: str, batch: int = 1, capacity: int | None = None,
                dtype: torch.dtype = torch.float32, device="cpu", window_block: int = WINDOW_BLOCK) -> KVCache:
    """The cache `name` for a model of `config`: one kvlab cache over every layer for the llama family, a LayeredCache
    (a cache per layer kind, the recurrent state beside them) for Gemma 3, Qwen3.5 and Qwen3-Next."""
    if config.arch in LLAMA_FAMILY:
        return make_cache(name, CacheGeometry.for_model(config, batch=batch, capacity=capacity), dtype, device)
    return LayeredCache(config, name, batch, capacity, dtype, device, window_block)


def _dense_storage(name: str) -> tuple[bool, torch.dtype | None]:
    """(whether `name` is a dense format, its storage dtype: None for the run's own)."""
    spec = CacheSpec.parse(name)
    return spec.base == "dense", (getattr(torch, spec.storage) if spec.base == "dense" and spec.storage else None)
