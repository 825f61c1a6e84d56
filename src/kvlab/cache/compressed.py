"""What every compressed cache shares: full-precision exceptions, the recent window, one softmax.

A compressed cache (int8/int4 in quantized.py, TurboQuant in turboquant.py) stores most tokens in
its own format and may keep, spelled out in its name,
  * `+sinkN`: the N first tokens of every layer in the cache dtype (the "attention sink": models
    send a large share of their attention to the first tokens, so their error weighs most),
  * `+recentN`: the N newest tokens of every layer in the cache dtype (a FIFO: a token is compressed
    the moment it leaves the window), and
  * `+fp-first-last`: the first and last layers whole in the cache dtype (a one-layer DenseCache each).
Attention over a layer is one softmax over [sink tokens | compressed tokens | window tokens], with the
lower-right causal mask of cache/attention.py; the subclass answers only for its compressed part:
  _scores(layer, qg, n) -> logits of the grouped queries against its n compressed tokens
  _mix(layer, p, n)     -> Σ p·v over those tokens
so a subclass reads its own storage (codes, and any full-precision state it counts in its bytes, such
as the integer caches' incomplete key group) and the base class never sees its K/V.

Long prompts: a subclass that can attend over a span of its compressed tokens (`reads_spans`, hook
`_span_attend(layer, qg, lo, hi, mask, first_query) -> (out, lse)`; TurboQuant and the integer caches) is
read in blocks of ATTEND_ROWS query rows against chunks of ATTEND_KEYS keys of one part at a time once a
chunk's logits would exceed one such block: each chunk gives its normalized output and log-sum-exp per row
(attention.attend_with_lse,
torch's fused CPU flash kernel where it exists) and the chunks combine by their log-sum-exps, so a
prompt of T tokens over S keys holds O(ATTEND_ROWS × ATTEND_KEYS) logits per KV head, never (G·T, S);
chunks no query of a block may see are skipped.

Causality: a query never reads anything a later token set. Per-token codes (TurboQuant, integer values)
are causal by construction; the integer caches' key groups are read per query as token-by-token
decoding reads them (quantized.py).

Bytes: every buffer is preallocated to the capacity (like DenseCache), so `nbytes` does not change
as tokens arrive and equals the format's formula (format.py CacheSpec.bytes, which spells it out).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .attention import attend_with_lse, block_mask, causal_mask, merge_attention
from .base import CacheGeometry, KVCache, copy_prefix, tensors_nbytes
from .dense import DenseCache
from .format import CacheSpec, FullPrecision


@dataclass(frozen=True)
class NextSlot:
    """Where the next token of every compressed layer goes, for a kernel that writes it in place (the layers are
    level: each holds `sink` tokens in its sink rows, `coded` in its store and `recent` in its recent window)."""

    sink: int
    coded: int
    recent: int
    goes: str     # "sink" | "coded" | "recent" | "spill" (the window's oldest token is coded, the new one takes its row)


#: A long chunk is attended in blocks of this many query rows (G·T axis) ...
ATTEND_ROWS = 512
#: ... against chunks of this many keys, once its logits exceed one such block per KV head (see the docstring).
ATTEND_KEYS = 1024


class CompressedCache(KVCache):
    """Base class: routes tokens to full-precision layers, the recent window or the subclass's store."""

    #: whether the subclass attends over spans of its compressed tokens (`_span_attend`): long chunks are
    #: then attended in bounded blocks
    reads_spans = False

    def __init__(self, geometry: CacheGeometry, dtype: torch.dtype, device, full: FullPrecision):
        super().__init__(geometry, dtype, device)
        g = geometry
        self.full = full
        self.fp_layers = full.layers(g.n_layers)
        # full-precision first and newest tokens per compressed layer, and the compressed tokens' slots
        self.sink, self.window, self.slots = full.split(g.capacity)
        one_layer = replace(g, n_layers=1)
        self._dense = {layer: DenseCache(one_layer, dtype, device) for layer in sorted(self.fp_layers)}

        def buffers(tokens: int, dim: int) -> dict[int, torch.Tensor]:
            shape = (g.batch, g.n_kv_heads, tokens, dim)
            return {l: torch.zeros(shape, dtype=dtype, device=self.device) for l in self.compressed_layers}

        self._sink_k, self._sink_v = buffers(self.sink, g.head_dim), buffers(self.sink, g.head_dim_v)
        self._win_k, self._win_v = buffers(self.window, g.head_dim), buffers(self.window, g.head_dim_v)
        self._n_comp = [0] * g.n_layers                    # compressed tokens per layer

    @property
    def compressed_layers(self) -> list[int]:
        return [layer for layer in range(self.geometry.n_layers) if layer not in self.fp_layers]

    # -- what a kernel reads and writes in place (the fused decode step) -------------------------------
    def full_layer(self, layer: int) -> DenseCache:
        """The one-layer dense cache of a layer kept whole in full precision (`layer in fp_layers`)."""
        return self._dense[layer]

    def full_precision_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A compressed layer's sink keys and values (B, Hkv, sink, D) and recent-window keys and values (B, Hkv, window, D)."""
        return self._sink_k[layer], self._sink_v[layer], self._win_k[layer], self._win_v[layer]

    def kernel_buffers(self) -> list[torch.Tensor]:
        """Every buffer a kernel may point into: the full-precision layers, sinks and windows, and the store's."""
        held = [self._dense[l].k for l in sorted(self._dense)] + [self._dense[l].v for l in sorted(self._dense)]
        for buffers in (self._sink_k, self._sink_v, self._win_k, self._win_v):
            held += buffers.values()
        return held + self._store_buffers()

    def _goes(self, layer: int) -> str:
        """Where `layer`'s next token goes (NextSlot.goes)."""
        if self._n_sink(layer) < self.sink:
            return "sink"
        if self.window == 0:
            return "coded"
        return "recent" if self._held(layer) < self.window else "spill"

    def next_slot(self) -> NextSlot | None:
        """Where the next token goes in every compressed layer, or None when a kernel cannot write it: the layers'
        parts are not level, or the subclass must take that token itself (`_writes_in_place`)."""
        layers = self.compressed_layers
        first = layers[0]
        if not all(self._n_comp[l] == self._n_comp[first] and self._lengths[l] == self._lengths[first] for l in layers):
            return None
        goes = self._goes(first)
        if not self._writes_in_place(goes):
            return None
        return NextSlot(self._n_sink(first), self._n_comp[first], self._held(first), goes)

    def record_written(self, layers, n_new: int = 1) -> None:
        """Count the one token a kernel wrote in place into `layers`, where `next_slot` said it goes."""
        if n_new != 1:
            raise ValueError(f"a compressed cache counts one token written in place at a time, not {n_new}")
        for layer in layers:
            if layer in self.fp_layers:
                self._dense[layer].record_written([0], 1)
            elif self._goes(layer) in ("coded", "spill"):
                self._n_comp[layer] += 1
            self._lengths[layer] += 1

    # -- subclass hooks -----------------------------------------------------------------------------
    def _writes_in_place(self, goes: str) -> bool:
        """Whether a kernel may write the next token (going to `goes`) as the subclass's own `_store` would."""
        return True

    def _store_buffers(self) -> list[torch.Tensor]:
        """The store's buffers a kernel points into."""
        raise NotImplementedError

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Compress tokens [start, start+T) of `layer`. k: (B, Hkv, T, Dk), v: (B, Hkv, T, Dv)."""
        raise NotImplementedError

    def _scores(self, layer: int, qg: torch.Tensor, n: int) -> torch.Tensor:
        """Scaled logits of grouped queries qg: (B, Hkv, G·T, Dk) float32 against the n compressed tokens."""
        raise NotImplementedError

    def _mix(self, layer: int, p: torch.Tensor, n: int) -> torch.Tensor:
        """Σ_i p_i·v_i over the n compressed tokens; p: (B, Hkv, G·T, n) -> (B, Hkv, G·T, Dv) float32."""
        raise NotImplementedError

    def _span_attend(self, layer: int, qg: torch.Tensor, lo: int, hi: int, mask: torch.Tensor | None,
                     first_query: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of qg (B, Hkv, R, Dk) over compressed tokens [lo, hi) alone, as attend_with_lse returns it:
        (normalized output (B, Hkv, R, Dv) float32, log-sum-exp (B, Hkv, R)); mask: (R, hi-lo) additive or None.
        The R rows are the G query heads of a group, each for the R/G consecutive positions from `first_query`
        (absolute; for a cache whose reading depends on the query's position, quantized.py)."""
        raise NotImplementedError

    def _restore(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The n compressed tokens' K/V as the cache will read them, (B, Hkv, n, D) float32 (tests only)."""
        raise NotImplementedError

    def _store_nbytes(self) -> int:
        """Bytes of the subclass's buffers and fixed state."""
        raise NotImplementedError

    # -- the protocol -------------------------------------------------------------------------------
    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n_new = self._check_append(layer, k, v)
        if layer in self.fp_layers:
            self._dense[layer].append(0, k, v)
            self._lengths[layer] += n_new
            return
        in_sink = self._n_sink(layer)
        to_sink = min(n_new, self.sink - in_sink)                                         # the first tokens
        if to_sink:
            self._sink_k[layer][:, :, in_sink:in_sink + to_sink] = k[:, :, :to_sink]
            self._sink_v[layer][:, :, in_sink:in_sink + to_sink] = v[:, :, :to_sink]
            self._lengths[layer] += to_sink
            k, v, n_new = k[:, :, to_sink:], v[:, :, to_sink:], n_new - to_sink
            if not n_new:
                return
        if self.window == 0:
            self._store(layer, k, v, self._n_comp[layer])
            self._n_comp[layer] += n_new
        else:
            held = self._held(layer)                                                      # tokens in the window
            all_k = torch.cat([self._win_k[layer][:, :, :held], k.to(self.dtype)], dim=2)  # (B, Hkv, held+T, Dk)
            all_v = torch.cat([self._win_v[layer][:, :, :held], v.to(self.dtype)], dim=2)
            spill = max(0, held + n_new - self.window)                                    # oldest leave the window
            if spill:
                self._store(layer, all_k[:, :, :spill], all_v[:, :, :spill], self._n_comp[layer])
                self._n_comp[layer] += spill
            kept = held + n_new - spill
            self._win_k[layer][:, :, :kept] = all_k[:, :, spill:]
            self._win_v[layer][:, :, :kept] = all_v[:, :, spill:]
        self._lengths[layer] += n_new

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        self._check_attend(layer, q)
        if layer in self.fp_layers:
            return self._dense[layer].attend(0, q)
        B, H, T, Dk = q.shape
        Hkv = self.geometry.n_kv_heads
        group = H // Hkv
        n_sink, n, held = self._n_sink(layer), self._n_comp[layer], self._held(layer)
        qg = q.float().reshape(B, Hkv, group * T, Dk)                          # (B, Hkv, G·T, Dk)
        coded = self._coded_read(layer, qg, T) if n else None                 # the compressed tokens in C, if it reads them
        if coded is not None:
            return self._with_exact_parts(layer, qg, T, *coded).reshape(B, H, T, -1).to(q.dtype)
        if self._in_spans(layer, group * T, T):
            return self._attend_blocks(layer, qg, T).reshape(B, H, T, -1).to(q.dtype)
        logits = []
        if n_sink:
            k_sink = self._sink_k[layer][:, :, :n_sink].float()                # (B, Hkv, n_sink, Dk)
            logits.append((qg @ k_sink.transpose(-1, -2)) * self.scale)        # (B, Hkv, G·T, n_sink)
        if n:
            logits.append(self._scores(layer, qg, n))                          # (B, Hkv, G·T, n)
        if held:
            k_win = self._win_k[layer][:, :, :held].float()                    # (B, Hkv, held, Dk)
            logits.append((qg @ k_win.transpose(-1, -2)) * self.scale)         # (B, Hkv, G·T, held)
        scores = torch.cat(logits, dim=-1) if len(logits) > 1 else logits[0]  # (B, Hkv, G·T, S)
        S = n_sink + n + held
        window = self.geometry.window
        if T > 1 or (window is not None and S > window):
            mask = causal_mask(T, S, q.device, window).repeat(group, 1)        # (G·T, S)
            scores = scores.masked_fill(~mask, float("-inf"))
        p = torch.softmax(scores, dim=-1)                                      # (B, Hkv, G·T, S)
        out = self._mix(layer, p[..., n_sink:n_sink + n], n) if n else 0.0    # (B, Hkv, G·T, Dv)
        if n_sink:
            out = out + p[..., :n_sink] @ self._sink_v[layer][:, :, :n_sink].float()
        if held:
            out = out + p[..., n_sink + n:] @ self._win_v[layer][:, :, :held].float()
        return out.reshape(B, H, T, -1).to(q.dtype)

    def _coded_read(self, layer: int, qg: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The attention of qg (B, Hkv, G·T, Dk) over the compressed tokens alone, read in C where the subclass can:
        its normalized output (B, Hkv, G·T, Dv) and log-sum-exp (B, Hkv, G·T), which `_with_exact_parts` merges with the
        sink and the window. None: the torch path reads them (one softmax over every part)."""
        return None

    def _with_exact_parts(self, layer: int, qg: torch.Tensor, T: int, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """The compressed tokens' attention (out, lse from `_coded_read`) merged by the log-sum-exps with the sink's and
        the recent window's full-precision tokens (the lower-right causal mask, the model's window): (B, Hkv, G·T, Dv)."""
        n_sink, n, held = self._n_sink(layer), self._n_comp[layer], self._held(layer)
        first = n_sink + n + held - T                                             # the first query's position
        group, window = qg.shape[2] // T, self.geometry.window
        for start, count, keys, values in ((0, n_sink, self._sink_k[layer], self._sink_v[layer]),
                                           (n_sink + n, held, self._win_k[layer], self._win_v[layer])):
            if not count:
                continue
            mask = _part_mask(first, T, start, count, group, qg.device, window)             # (G·T, count) or None
            part = attend_with_lse(qg, keys[:, :, :count].float(), values[:, :, :count].float(), self.scale, mask)
            out, lse = merge_attention(out, lse, *part)
        return out

    def _in_spans(self, layer: int, rows: int, T: int) -> bool:
        """Whether attend reads a chunk of T tokens (rows = G·T query rows) in blocks over spans (`_attend_blocks`):
        where it can and the chunk's logits would exceed one block."""
        keys = self._n_sink(layer) + self._n_comp[layer] + self._held(layer)
        return self.reads_spans and T > 1 and rows * keys > ATTEND_ROWS * ATTEND_KEYS

    def _attend_blocks(self, layer: int, qg: torch.Tensor, T: int) -> torch.Tensor:
        """attend() of a long chunk in bounded memory: qg (B, Hkv, G·T, Dk) -> (B, Hkv, G, T, Dv) float32.

        Query blocks of at most ATTEND_ROWS rows (all G heads of a group for the same positions, so one mask
        serves them) against key chunks of ATTEND_KEYS keys of one part (sink, compressed or window) at a time;
        each chunk's output joins the block's by their log-sum-exps. Chunks no query of the block sees are skipped.
        """
        B, Hkv, rows, Dk = qg.shape
        group = rows // T
        n_sink, n, held = self._n_sink(layer), self._n_comp[layer], self._held(layer)
        S = n_sink + n + held
        window = self.geometry.window
        Dv = self._sink_v[layer].shape[-1]

        def full_precision(keys: torch.Tensor, values: torch.Tensor):
            return lambda qb, a, b, mask: attend_with_lse(qb, keys[:, :, a:b].float(), values[:, :, a:b].float(), self.scale, mask)

        parts = [  # (first key position, keys, attention of a query block over keys [a, b) of the part)
            (0, n_sink, full_precision(self._sink_k[layer], self._sink_v[layer])),
            (n_sink, n, lambda qb, a, b, mask: self._span_attend(layer, qb, a, b, mask, first)),
            (n_sink + n, held, full_precision(self._win_k[layer], self._win_v[layer])),
        ]
        q_by_position = qg.reshape(B, Hkv, group, T, Dk)                          # (B, Hkv, G, T, Dk)
        out = torch.empty(B, Hkv, group, T, Dv, device=qg.device)
        step = -(-T // -(-rows // ATTEND_ROWS))                                   # positions per block, blocks even
        for t0 in range(0, T, step):
            t1 = min(T, t0 + step)
            first, last = S - T + t0, S - T + t1 - 1                              # the block's query positions
            qb = q_by_position[:, :, :, t0:t1].reshape(B, Hkv, group * (t1 - t0), Dk)  # (B, Hkv, R, Dk)
            acc = torch.zeros(B, Hkv, qb.shape[2], Dv, device=qg.device)          # Σ over chunks so far, normalized
            lse = torch.full((B, Hkv, qb.shape[2]), float("-inf"), device=qg.device)
            for start, count, attend in parts:
                for a in range(0, count, ATTEND_KEYS):
                    b = min(count, a + ATTEND_KEYS)
                    lo, hi = start + a, start + b - 1                             # key positions
                    if lo > last or (window is not None and hi <= first - window):
                        continue                                                  # no query of the block sees it
                    mask = _part_mask(first, t1 - t0, lo, b - a, group, qg.device, window)  # (R, b-a) or None
                    acc, lse = merge_attention(acc, lse, *attend(qb, a, b, mask))   # (B, Hkv, R, Dv), (B, Hkv, R)
            out[:, :, :, t0:t1] = acc.reshape(B, Hkv, group, t1 - t0, Dv)
        return out

    def _n_sink(self, layer: int) -> int:
        """Tokens of `layer` held in its full-precision sink (the first ones)."""
        return min(self._lengths[layer], self.sink)

    def _held(self, layer: int) -> int:
        """Tokens of `layer` held in its full-precision recent window."""
        return self._lengths[layer] - self._n_sink(layer) - self._n_comp[layer]

    def reset(self) -> None:
        super().reset()
        self._n_comp = [0] * self.geometry.n_layers
        for dense in self._dense.values():
            dense.reset()

    def _empty(self, geometry: CacheGeometry) -> "CompressedCache":
        return type(self)(geometry, self.dtype, self.device, config=self.config)

    def _copy_into(self, bigger: "CompressedCache") -> None:
        """The full-precision layers, sink and recent window, then the subclass's store (its `_copy_into`).
        The sink and window keep their sizes once the capacity covers them (kvlab.hf starts above that)."""
        super()._copy_into(bigger)
        bigger._n_comp = list(self._n_comp)
        for layer, dense in self._dense.items():
            dense._copy_into(bigger._dense[layer])
        for old, new in ((self._sink_k, bigger._sink_k), (self._sink_v, bigger._sink_v),
                         (self._win_k, bigger._win_k), (self._win_v, bigger._win_v)):
            copy_prefix(old, new)

    @property
    def nbytes(self) -> int:
        dense = sum(d.nbytes for d in self._dense.values())
        held = tensors_nbytes(*self._sink_k.values(), *self._sink_v.values(), *self._win_k.values(), *self._win_v.values())
        return dense + held + self._store_nbytes()

    # -- formula and debugging ------------------------------------------------------------------------
    @classmethod
    def expected_nbytes(cls, config, geometry: CacheGeometry, dtype: torch.dtype) -> int:
        """What `nbytes` is for a cache built with (config, geometry, dtype): the format's formula (format.py)."""
        return CacheSpec.from_config(config).bytes(geometry, geometry.capacity, dtype)

    def dequantized(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All stored K/V of `layer` as attention reads them, (B, Hkv, S, D) float32 — for tests and debugging."""
        if layer in self.fp_layers:
            n = self._lengths[layer]
            dense = self._dense[layer]
            return dense.k[0, :, :, :n].float(), dense.v[0, :, :, :n].float()
        n_sink, n, held = self._n_sink(layer), self._n_comp[layer], self._held(layer)
        k_parts, v_parts = [], []
        if n_sink:
            k_parts.append(self._sink_k[layer][:, :, :n_sink].float())
            v_parts.append(self._sink_v[layer][:, :, :n_sink].float())
        if n:
            k_c, v_c = self._restore(layer, n)
            k_parts.append(k_c)
            v_parts.append(v_c)
        if held:
            k_parts.append(self._win_k[layer][:, :, :held].float())
            v_parts.append(self._win_v[layer][:, :, :held].float())
        if not k_parts:
            g = self.geometry
            empty = torch.zeros(g.batch, g.n_kv_heads, 0, g.head_dim, device=self.device)
            return empty, empty[..., : g.head_dim_v]
        return torch.cat(k_parts, dim=2), torch.cat(v_parts, dim=2)


def _part_mask(first_query: int, n_queries: int, first_key: int, n_keys: int, group: int, device,
               window: int | None) -> torch.Tensor | None:
    """The additive mask (group·n_queries, n_keys) of queries at positions first_query.. (each position's `group` heads,
    head-major) over keys at first_key.. (the lower-right causal mask, the model's window); None where every query sees
    every key (decided from the positions, never by reading the mask back)."""
    last_key, last_query = first_key + n_keys - 1, first_query + n_queries - 1
    if last_key <= first_query and (window is None or first_key > last_query - window):
        return None
    seen = block_mask(first_query, n_queries, first_key, n_keys, device, window).repeat(group, 1)
    return torch.zeros(seen.shape, device=device).masked_fill_(~seen, float("-inf"))
