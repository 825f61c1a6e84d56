"""Sink rows: the first N tokens' K/V of the running sequences, kept exact beside a TurboQuant pool (+sinkN).

A single cache with +sinkN keeps its sequence's first N tokens in full precision and codes the rest. In the pool
those K/V live here, not in the blocks (a block's first N slots of a sequence stay unwritten). In a causal decoder
the K/V of positions 0..N-1 depend on the first N token ids alone, so sequences that start with the same N tokens
(a chat template's opening, a shared system prompt) share one entry; an entry is found by those ids.

Entries: `max_batch` of them, each (L, N, Hkv, D) for K and for V in the pool's dtype, so every running sequence has
one. A sequence takes its entry when it first runs (`entry_for`) and lets go of it when the pool releases it; an
entry nobody holds keeps its rows (the least recently used is reused first), which is what lets a sequence take
cached prefix blocks: the prefix cache may give a sequence blocks whose first N tokens it never computes, and
`holds` answers whether their rows are still here (else the sequence computes its prompt from the start).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from ..cache import CacheGeometry
from ..cache.base import tensors_nbytes


class SinkRows:
    def __init__(self, geometry: CacheGeometry, entries: int, sink: int, dtype: torch.dtype, device):
        g = geometry
        self.sink = sink
        self.k = torch.zeros(g.n_layers, entries, sink, g.n_kv_heads, g.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(g.n_layers, entries, sink, g.n_kv_heads, g.head_dim_v, dtype=dtype, device=device)
        self.ids: list[tuple[int, ...] | None] = [None] * entries   # each entry's first N token ids
        self.written = [0] * entries                                  # its rows written so far (positions 0..)
        self.holders: dict[object, int] = {}                          # running sequence -> its entry
        self.idle: OrderedDict[int, None] = OrderedDict((e, None) for e in range(entries))  # held by none, LRU first

    @property
    def nbytes(self) -> int:
        return tensors_nbytes(self.k, self.v)

    def _key(self, seq) -> tuple:
        """Its first N token ids; a sequence with fewer tokens (a short prompt) gets a key of its own: the rows it
        writes past its prompt come from its own sampled tokens, which another sequence need not share."""
        ids = tuple(seq.token_ids[:self.sink])
        return ids if len(ids) == self.sink else (*ids, object())

    def _find(self, key: tuple[int, ...]) -> int | None:
        return next((e for e, ids in enumerate(self.ids) if ids == key), None)

    def entry_for(self, seq) -> int:
        """The sequence's entry: the one it holds, one with its first token ids, or the least recently used idle one
        (its rows then written from position 0 as the sequence computes them)."""
        if seq in self.holders:
            return self.holders[seq]
        key = self._key(seq)
        entry = self._find(key)
        if entry is None:
            if not self.idle:
                raise RuntimeError("more running sequences than the pool has sink rows (max_batch)")
            entry = next(iter(self.idle))
            self.ids[entry], self.written[entry] = key, 0
        self.idle.pop(entry, None)
        self.holders[seq] = entry
        return entry

    def holds(self, seq) -> bool:
        """Whether an entry holds all N rows of the sequence's first tokens (then the sequence holds it from now on,
        and cached prefix blocks may stand in for its first tokens)."""
        entry = self.holders.get(seq)
        if entry is None:
            entry = self._find(self._key(seq))
            if entry is None or self.written[entry] < self.sink or len(seq.token_ids) < self.sink:
                return False
            self.idle.pop(entry, None)
            self.holders[seq] = entry
        return self.written[entry] >= self.sink

    def rows(self, ids, adopt: bool = False) -> list[tuple[str, torch.Tensor]] | None:
        """Views of the entry's rows for sequences starting with `ids` ((L, N, Hkv, D) K and V: what the KV store
        keeps with a sequence's first block). The entry that holds all N rows, or None; `adopt`: else take the least
        recently used idle entry for them, counted as written (the caller fills the rows now, or calls `forget`)."""
        key = tuple(ids[:self.sink])
        if len(key) < self.sink:
            return None
        entry = self._find(key)
        if entry is None or self.written[entry] < self.sink:
            if not adopt or (entry is None and not self.idle) or entry in self.holders.values():
                return None               # (an entry a running sequence is writing is not taken)
            if entry is None:
                entry = next(iter(self.idle))
                self.ids[entry] = key
            self.written[entry] = self.sink
            if entry in self.idle:
                self.idle.move_to_end(entry)
        return [("sink.k", self.k[:, entry]), ("sink.v", self.v[:, entry])]

    def release(self, seq) -> None:
        entry = self.holders.pop(seq, None)
        if entry is not None and entry not in self.holders.values():
            self.idle[entry] = None                                   # most recently used: reused last

    def fork(self, parent, child) -> None:
        """The child starts with the parent's tokens: the same entry, once they hold all N (else its own later)."""
        if parent in self.holders and len(parent.token_ids) >= self.sink:
            self.holders[child] = self.holders[parent]

    def held(self, layer: int, entry: int | torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The entry's first n rows of `layer` as attention reads them: k (n, Hkv, D), v (n, Hkv, Dv) float32; for a
        tensor of entries (N,), each one's: (N, n, Hkv, D), (N, n, Hkv, Dv)."""
        return self.k[layer, entry, :n].float(), self.v[layer, entry, :n].float()

    def write(self, layer: int, entry: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k (T, Hkv, D), v (T, Hkv, Dv) of positions start .. start+T (< N) into the entry's rows."""
        end = start + k.shape[0]
        self.k[layer, entry, start:end] = k.to(self.k.dtype)
        self.v[layer, entry, start:end] = v.to(self.v.dtype)
        self.wrote(layer, entry, end)

    def wrote(self, layer: int, entry: int, end: int) -> None:
        """The entry's rows of `layer` hold positions .. end (written here or by C): complete once the last layer's do."""
        if layer == self.k.shape[0] - 1:
            self.written[entry] = max(self.written[entry], end)
