"""kvlab's caches inside transformers: a `transformers.Cache` whose layers store K/V in kvlab's formats.

    from kvlab.hf import KVLabCache
    cache = KVLabCache.from_name("tq4", model.config)
    out = model.generate(**inputs, cache=cache, max_new_tokens=64)   # past_key_values=cache before transformers 5
    print(cache.nbytes)                                              # every buffer the cache holds

transformers' attention reads full-precision K/V, so a layer's `update(key_states, value_states)` stores the
new tokens in the kvlab format and returns every stored token the way kvlab reads it back: the buffers
themselves for `dense`/`concat`, the dequantized K/V (`CompressedCache.dequantized`) for int8/int4 and
TurboQuant, as transformers' own QuantizedCache does. The new tokens are returned as stored too, so a
chunk attends to its own compressed K/V exactly as in kvlab's engine (whose models read the codes directly).

Storage, per kind of layer (transformers' `layer_types`):
  full attention    one kvlab cache for all of them (so layer seeds, `+fp-first-last` and the bytes are those
                    of kvlab's own cache), preallocated like DenseCache and grown geometrically: when a chunk
                    does not fit, `KVCache.grown` builds one of twice the capacity holding the same codes and
                    state, so no token is ever re-quantized and no capacity guess is needed.
  sliding window    what transformers' DynamicSlidingWindowLayer keeps (the last window-1 tokens, plus the new
                    chunk while it is read), in segments of `window` tokens, each a one-layer kvlab cache; a
                    segment is dropped once all its tokens have left the window, so at most two segments
                    (2·window slots) are held between forward passes. `+sinkN` lives in the first segment only
                    (it leaves with the window, as in transformers); `+recentN` is per segment (the newest N
                    tokens are always in full precision; a full segment keeps its last N so too). A new
                    segment takes TurboQuant's offsets and key weights from the one before it.
  linear attention  (Qwen3.5 / Qwen3-Next Gated DeltaNet, conv layers) transformers' own LinearAttentionLayer: the
                    conv and recurrent state as transformers keeps it (transformers >= 5; older ones refuse the
                    model in one line); `state_nbytes` counts it, and `nbytes` includes it.
Bytes: `nbytes` is the sum of `nbytes` of every kvlab cache held, so it equals kvlab's formula
(`kvlab.cache.expected_nbytes`) for each one's geometry at its current capacity.

TurboQuant's query-aware key channel weights need the queries that first read a layer, which transformers
does not hand to a cache. `read_queries(model)` switches the model to an attention implementation (sdpa, with
a hand-off) that gives each full-attention layer's first chunk its queries before it is coded, exactly as
kvlab's engine calibrates; caches built from `model.config` after it use it (`kvlab eval/generate --backend
transformers` do). Without it, and in sliding-window segments, the weights are calibrated from the keys alone
(measured on SmolLM2, one 512-token window: tq-k4v4 (then `tq4`) ΔPPL +5.5% from the keys alone, +3.4% with the queries;
kvlab's engine +2.6%, the rest being coding noise: tests/test_hf_backend.py).

The presets `tq4` and `tq3` (cache/format.py) code keys around RoPE in kvlab's engine (`+ropemean`);
transformers hands a cache keys after RoPE, so here a preset is a recipe without either (TRANSFORMERS_PRESETS: tq4 is
tq4.125+norms8+sink1+kscale=lsq+vscale=lsq; tq3 is tq-k4v3+vq+norms8+sink1, since keys after RoPE need 4 bits), and a
name that asks for `+prerope` or `+ropemean` itself is refused (CacheSpec.supports("transformers") names every refusal).

Known differences from kvlab's engine: a compressed layer dequantizes all its tokens at every step (as
QuantizedCache does) instead of attending on the codes. Beam search, `crop` and row
selection are refused (kvlab's formats have no row reorder).
Tested with transformers 5.24; the 4.56-4.x spellings of the layer contract (`get_max_cache_shape`,
`get_mask_sizes(cache_position)`) are answered too, untested.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

import torch

from .cache import CacheGeometry, CacheSpec, ConcatCache, DenseCache, KVCache
from .cache.compressed import CompressedCache
from .cache.turboquant import TurboQuantCache
from .cache.names import compressed
from .errors import ConfigError, UnsupportedArchitectureError

try:
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError as error:  # transformers is an optional extra
    raise ImportError("kvlab.hf needs transformers (>= 4.56): pip install 'kvlab[hf]'") from error
try:  # transformers 5: the recurrent layers' own cache (Qwen3.5 / Qwen3-Next Gated DeltaNet, conv layers)
    from transformers.cache_utils import LinearAttentionLayer
except ImportError:
    LinearAttentionLayer = None

#: Tokens a full-attention store holds before its first growth (it doubles from there).
INITIAL_CAPACITY = 256
_SLIDING_TYPES = ("sliding_attention", "chunked_attention")
#: Layers without per-token K/V: transformers keeps their conv / recurrent state in its own LinearAttentionLayer.
_STATE_TYPES = ("linear_attention", "conv")
#: The attention implementation `read_queries` registers: sdpa, after handing the queries to a waiting layer.
ATTENTION = "kvlab_sdpa"
#: The read a layer left for the attention that follows its `update` (same thread, same layer, next call).
_HANDOFF = threading.local()


@dataclass(frozen=True)
class CacheFormat:
    """A kvlab cache name, parsed: the class that stores K/V and its config (None for dense / concat)."""

    name: str
    cls: type
    config: object | None = None

    @classmethod
    def parse(cls, name: str) -> "CacheFormat":
        """A name transformers can hold (CacheSpec.supports("transformers"); a preset without +prerope, see above)."""
        spec = CacheSpec.parse(name, "transformers").check("transformers")
        if spec.base == "dense":
            return cls(spec.label, DenseCache)
        if spec.base == "concat":
            return cls(spec.label, ConcatCache)
        return cls(spec.label, *compressed(spec))

    @property
    def fixed_tokens(self) -> int:
        """Tokens a compressed cache keeps in full precision per layer (+sinkN, +recentN): the least capacity."""
        return self.config.full.sink + self.config.full.recent if self.config is not None else 0

    def full_layers(self, n_layers: int) -> frozenset[int]:
        """Model layers kept whole in full precision (+fp-first-last, +fp-layers=)."""
        return self.config.full.layers(n_layers) if self.config is not None else frozenset()

    def build(self, geometry: CacheGeometry, dtype: torch.dtype, device, fp_layers=frozenset(), sink: bool = True) -> KVCache:
        """The kvlab cache for `geometry`, with `fp_layers` (indices in this cache) whole in full precision."""
        if self.config is None:
            return self.cls(geometry, dtype=dtype, device=device)
        full = replace(self.config.full, first_last=False, layer_list=tuple(sorted(fp_layers)),
                       sink=self.config.full.sink if sink else 0)
        return self.cls(geometry, dtype=dtype, device=device, config=replace(self.config, full=full))


def stored_kv(cache: KVCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token `layer` holds, as the cache reads it back: (B, Hkv, S, Dk), (B, Hkv, S, Dv)."""
    if isinstance(cache, DenseCache):
        return cache.blocks.rows(layer, cache.layer_length(layer))     # views, no copy
    if isinstance(cache, ConcatCache):
        return cache.k[layer], cache.v[layer]
    if isinstance(cache, CompressedCache):
        k, v = cache.dequantized(layer)                               # float32
        return k.to(cache.dtype), v.to(cache.dtype)
    raise ConfigError(f"{type(cache).__name__} cannot hand its K/V to transformers")


class GrowingStore:
    """One kvlab cache for the model's full-attention layers, grown geometrically as tokens arrive."""

    def __init__(self, fmt: CacheFormat, model_layers: list[int], fp_model_layers: frozenset[int], initial_capacity: int,
                 queries_follow: bool = False):
        self.fmt = fmt
        self.queries_follow = queries_follow                   # the model's attention is ATTENTION (read_queries)
        self.index = {layer: i for i, layer in enumerate(model_layers)}            # model layer -> cache layer
        self.fp_layers = frozenset(self.index[l] for l in fp_model_layers if l in self.index)
        self.initial_capacity = max(initial_capacity, fmt.fixed_tokens + 1)
        self.cache: KVCache | None = None

    @property
    def capacity(self) -> int:
        return self.cache.geometry.capacity if self.cache is not None else 0

    def append(self, model_layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k: (B, Hkv, T, Dk), v: (B, Hkv, T, Dv); returns all of the layer's tokens as stored."""
        layer = self.index[model_layer]
        needed = (self.cache.layer_length(layer) if self.cache is not None else 0) + k.shape[2]
        if self.cache is None:
            geometry = _geometry(len(self.index), k, v, max(self.initial_capacity, needed))
            self.cache = self.fmt.build(geometry, k.dtype, k.device, self.fp_layers)
        elif needed > self.capacity:
            self.cache = self.cache.grown(max(2 * self.capacity, needed))   # the same codes in bigger buffers
        self.cache.append(layer, k, v)
        cache = self.cache
        if self.queries_follow and isinstance(cache, TurboQuantCache) and cache.awaits_queries(layer):
            def read(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:   # q: (B, H, T, Dk) after RoPE
                cache.calibrate(layer, q)
                return stored_kv(cache, layer)

            _HANDOFF.read = (k, read)   # for the attention handed this very `k` (a walk with no attention after
            return k, v                 # it leaves a read no other call takes); placeholders: it reads through `read`
        return stored_kv(cache, layer)

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes if self.cache is not None else 0

    def reset(self) -> None:
        self.cache = None


class WindowStore:
    """One sliding-window layer: the tokens transformers keeps, in one-layer kvlab caches of `segment` tokens."""

    def __init__(self, fmt: CacheFormat, window: int, whole_fp: bool, segment: int | None = None):
        if window is None or window <= 1:
            raise ConfigError(f"a sliding-window layer needs a window of at least 2 tokens, got {window}")
        self.fmt, self.window, self.whole_fp = fmt, window, whole_fp
        self.segment = max(segment or window, fmt.fixed_tokens + 1)
        self.segments: list[tuple[int, KVCache]] = []          # (position of its first token, cache)
        self.seen = 0                                          # tokens ever appended (cumulative length)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the chunk; return the last window-1 tokens before it plus the chunk, as stored."""
        before, n_new = self.seen, k.shape[2]
        done = 0
        while done < n_new:
            if not self.segments or self._room() == 0:
                first = not self.segments and before + done == 0
                geometry = _geometry(1, k, v, self.segment)
                cache = self.fmt.build(geometry, k.dtype, k.device, frozenset({0}) if self.whole_fp else frozenset(), sink=first)
                if self.segments:
                    inherit_calibration(self.segments[-1][1], cache)
                self.segments.append((before + done, cache))
            take = min(n_new - done, self._room())
            self.segments[-1][1].append(0, k[:, :, done:done + take], v[:, :, done:done + take])
            done += take
        self.seen += n_new
        start = before - min(before, self.window - 1)          # = kv_offset of get_mask_sizes
        keys, values = self._read(start)
        self._evict()
        return keys, values

    def _room(self) -> int:
        cache = self.segments[-1][1]
        return cache.geometry.capacity - cache.layer_length(0)

    def _read(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [start, seen) as stored: (B, Hkv, seen-start, D)."""
        ks, vs = [], []
        for first, cache in self.segments:
            end = first + cache.layer_length(0)
            if end <= start:
                continue
            k, v = stored_kv(cache, 0)
            skip = max(0, start - first)
            ks.append(k[:, :, skip:])
            vs.append(v[:, :, skip:])
        if len(ks) == 1:
            return ks[0], vs[0]
        return torch.cat(ks, dim=2), torch.cat(vs, dim=2)      # (B, Hkv, S, D)

    def _evict(self) -> None:
        """Drop the segments whose every token is older than the last window-1 (none is read again)."""
        keep_from = self.seen - (self.window - 1)
        while self.segments:
            first, cache = self.segments[0]
            if first + cache.layer_length(0) > keep_from:
                break
            self.segments.pop(0)

    @property
    def nbytes(self) -> int:
        return sum(cache.nbytes for _, cache in self.segments)

    def reset(self) -> None:
        self.segments, self.seen = [], 0


def inherit_calibration(old: KVCache, new: KVCache) -> None:
    """Give a fresh segment the per-layer state its predecessor measured on the first tokens (TurboQuant's
    key/value offsets and key channel weights): a segment started by one decode token could not measure
    them, and any stored offset or weight is exact (the same value codes and reads)."""
    if isinstance(old, TurboQuantCache):
        new.continue_calibration(old)


def _geometry(n_layers: int, k: torch.Tensor, v: torch.Tensor, capacity: int) -> CacheGeometry:
    """The geometry of a store, read off the first chunk's K/V: (B, Hkv, T, Dk), (B, Hkv, T, Dv)."""
    return CacheGeometry(n_layers=n_layers, n_kv_heads=k.shape[1], head_dim=k.shape[3], batch=k.shape[0],
                         capacity=capacity, head_dim_v=v.shape[3])


class _KVLabLayer(CacheLayerMixin):
    """transformers' per-layer contract; subclasses say where the tokens go."""

    is_compileable = False
    is_croppable = False

    def __init__(self):
        super().__init__()
        self.length = 0                                        # tokens seen by this layer

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states: (B, Hkv, T, Dk), value_states: (B, Hkv, T, Dv) -> the K/V attention reads, (B, Hkv, S, D)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = self._store(key_states, value_states)
        self.length += key_states.shape[2]
        return keys.to(key_states.dtype), values.to(value_states.dtype)

    def _store(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # the transformers 4.x name
        return self.get_max_length()

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        """(kv_length, kv_offset) of the K/V the next `update` returns."""
        if isinstance(query_length, torch.Tensor):  # transformers 4.x passes the cache positions
            query_length = query_length.shape[0]
        return self.length + query_length, 0

    def reset(self) -> None:
        self.length = 0
        self.is_initialized = False

    def _refuse(self, what: str) -> None:
        if self.length:
            raise ConfigError(f"kvlab caches cannot {what} (kvlab's formats keep no per-row index); use greedy or sampled generation")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._refuse("reorder rows for beam search")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._refuse("repeat rows")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._refuse("select rows")

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            self._refuse("drop tokens (crop)")


class FullLayer(_KVLabLayer):
    """A full-attention layer: its tokens live in the cache's GrowingStore."""

    is_sliding = False

    def __init__(self, store: GrowingStore, model_layer: int):
        super().__init__()
        self.store, self.model_layer = store, model_layer

    def _store(self, k, v):
        return self.store.append(self.model_layer, k, v)


class SlidingLayer(_KVLabLayer):
    """A sliding-window layer: the last window-1 tokens, as transformers' DynamicSlidingWindowLayer keeps."""

    is_sliding = True

    def __init__(self, store: WindowStore):
        super().__init__()
        self.store = store
        self.sliding_window = store.window

    def _store(self, k, v):
        return self.store.append(k, v)

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[0]
        kept = min(self.length, self.sliding_window - 1)
        return kept + query_length, self.length - kept

    def get_max_length(self) -> int:
        return self.sliding_window

    def reset(self) -> None:
        super().reset()
        self.store.reset()


class KVLabCache(Cache):
    """A transformers Cache storing K/V in the kvlab cache called `name` (dense, int8, int4, tq4, tq-k4v4+sink1, ...).

    `config` is the model's config (`model.config`): it tells the layers and which of them use a sliding
    window. Batch, KV heads, head dims, dtype and device are read off the first `update`.
    """

    def __init__(self, name: str, config, initial_capacity: int = INITIAL_CAPACITY):
        self.format = CacheFormat.parse(name)
        layer_types, windows = _layer_types(config)
        fp_model_layers = self.format.full_layers(len(layer_types))
        full = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
        queries_follow = getattr(config, "_attn_implementation", None) == ATTENTION
        self.store = GrowingStore(self.format, full, fp_model_layers, initial_capacity, queries_follow)
        layers: list = []
        for i, kind in enumerate(layer_types):
            if kind == "full_attention":
                layers.append(FullLayer(self.store, i))
            elif kind in _SLIDING_TYPES:
                layers.append(SlidingLayer(WindowStore(self.format, windows[i], i in fp_model_layers)))
            elif kind in _STATE_TYPES and LinearAttentionLayer is not None:
                layers.append(LinearAttentionLayer())          # transformers' own conv + recurrent state, as it keeps it
            else:
                raise UnsupportedArchitectureError(
                    f"kvlab caches hold full and sliding-window attention layers (and leave linear-attention state to "
                    f"transformers >= 5); layer {i} is {kind!r}")
        super().__init__(layers=layers)

    @classmethod
    def from_name(cls, name: str, config, initial_capacity: int = INITIAL_CAPACITY) -> "KVLabCache":
        return cls(name, config, initial_capacity)

    @property
    def name(self) -> str:
        return self.format.name

    @property
    def capacity(self) -> int:
        """Tokens per sequence the full-attention layers hold before they grow again (0 before any token)."""
        return self.store.capacity

    @property
    def nbytes(self) -> int:
        """Bytes of every buffer held: codes, scales, norms, full-precision tokens, fixed state, and the recurrent
        layers' conv and recurrent state (transformers' tensors)."""
        sliding = sum(layer.store.nbytes for layer in self.layers if isinstance(layer, SlidingLayer))
        return self.store.nbytes + sliding + self.state_nbytes

    @property
    def state_nbytes(self) -> int:
        """Bytes of the recurrent layers' state (0 for a model with attention layers only, or before the first pass)."""
        return sum(t.numel() * t.element_size() for layer in self.layers if not isinstance(layer, _KVLabLayer)
                   for states in (layer.conv_states, layer.recurrent_states) for t in states.values() if t is not None)

    def reset(self) -> None:
        super().reset()
        self.store.reset()

    def __repr__(self) -> str:
        return f"KVLabCache({self.name!r}, layers={len(self.layers)}, capacity={self.capacity}, nbytes={self.nbytes})"


def read_queries(model) -> None:
    """Switch `model` (a transformers PreTrainedModel) to sdpa attention that first hands each layer's queries
    to a kvlab cache layer waiting for them, so TurboQuant calibrates its key weights on them as kvlab's engine
    does. Call it before building caches from `model.config`."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    def attention(module, query, key, value, attention_mask, **kwargs):
        waiting = getattr(_HANDOFF, "read", None)
        _HANDOFF.read = None
        if waiting is not None and waiting[0] is key:
            key, value = (x.to(query.dtype) for x in waiting[1](query))   # (B, Hkv, S, D) as stored
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(ATTENTION, attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    model.set_attn_implementation(ATTENTION)


def _layer_types(config) -> tuple[list[str], list[int | None]]:
    """The decoder's layer types (transformers' names) and each layer's sliding window (None: full)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
    except ImportError:  # transformers 4.x: the config lists the layer types, or every layer is full
        n = text.num_hidden_layers
        kinds = list(getattr(text, "layer_types", None) or ["full_attention"] * n)[:n]
        window = getattr(text, "sliding_window", None)
        return kinds, [window if kind in _SLIDING_TYPES else None for kind in kinds]
    kinds, kwargs = get_layer_types_and_kwargs(text)
    return list(kinds), [kw.get("sliding_window") for kw in kwargs]


__all__ = ["KVLabCache", "CacheFormat", "GrowingStore", "WindowStore", "read_queries", "stored_kv"]
