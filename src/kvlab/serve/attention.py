"""Attention over a ragged batch: every sequence's new queries against its own K/V blocks.

The batch is flat: sequence s owns query rows [query_start[s], query_start[s+1]) of q (N, H, D) and attends
to its first context_len[s] tokens, found through its block table (token t: block_tables[s, t // bs],
offset t % bs). Its T new queries are the last T of those tokens: the lower-right causal mask.

`ragged_attention_reference` is plain torch: gather, then kvlab.cache.attention.grouped_attention (the
one place causality lives). `ragged_attention` runs the C kernel (kernels/paged.c) on CPU and falls back
to the reference elsewhere; the tests hold the two equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.attention import grouped_attention
from ..kernels import kernel_for
from ..kernels.paged import paged_attention


@dataclass(frozen=True)
class RaggedLayout:
    """Where each sequence of a step lives: shared by every layer of the step."""

    query_start: torch.Tensor   # (S + 1,) int32: row offsets of each sequence's queries in the flat batch
    context_len: torch.Tensor   # (S,) int32: tokens each sequence attends to (cached + new)
    block_tables: torch.Tensor  # (S, max_blocks) int32, unused entries 0
    block_size: int

    @classmethod
    def build(cls, tables: list[list[int]], n_queries: list[int], n_context: list[int], block_size: int) -> "RaggedLayout":
        width = max(1, max(len(t) for t in tables))
        padded = [t + [0] * (width - len(t)) for t in tables]
        starts = [0]
        for n in n_queries:
            starts.append(starts[-1] + n)
        return cls(torch.tensor(starts, dtype=torch.int32), torch.tensor(n_context, dtype=torch.int32),
                   torch.tensor(padded, dtype=torch.int32).reshape(len(tables), width), block_size)

    def slots(self, s: int) -> torch.Tensor:
        """(context_len[s],) int64 pool slots of sequence s's tokens, in order."""
        t = torch.arange(int(self.context_len[s]))
        return self.block_tables[s].long()[t // self.block_size] * self.block_size + t % self.block_size


def sequence_rows(pool: torch.Tensor, layout: RaggedLayout, s: int) -> torch.Tensor:
    """(Hkv, context_len[s], D): sequence s's rows of a layer's blocks pool (n_blocks, Hkv, block_size, D), in order."""
    n, bs = int(layout.context_len[s]), layout.block_size
    blocks = layout.block_tables[s, :-(-n // bs)].long().to(pool.device)                    # (nb,)
    rows = pool[blocks].transpose(0, 1)                                                    # (Hkv, nb, bs, D)
    return rows.reshape(rows.shape[0], -1, rows.shape[-1])[:, :n]


def ragged_attention_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, layout: RaggedLayout,
                               scale: float, window: int | None = None) -> torch.Tensor:
    """q (N, H, D) fp32; k_pool (n_blocks, Hkv, block_size, D), v_pool (n_blocks, Hkv, block_size, Dv) in any float
    dtype -> (N, H, Dv) fp32."""
    out = q.new_empty(q.shape[0], q.shape[1], v_pool.shape[-1], dtype=torch.float32)       # (N, H, Dv)
    for s in range(layout.context_len.numel()):
        lo, hi = int(layout.query_start[s]), int(layout.query_start[s + 1])
        k = sequence_rows(k_pool, layout, s).float()[None]                                 # (1, Hkv, S, D)
        v = sequence_rows(v_pool, layout, s).float()[None]                                 # (1, Hkv, S, Dv)
        qs = q[lo:hi].float().transpose(0, 1)[None]                                         # (1, H, T, D)
        out[lo:hi] = grouped_attention(qs, k, v, scale, window=window)[0].transpose(0, 1)   # (T, H, Dv)
    return out


def ragged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, layout: RaggedLayout,
                     scale: float, window: int | None = None, use_kernel: bool = True) -> torch.Tensor:
    """The C kernel where it runs (CPU, library built), else the torch reference. Same arguments and result."""
    kernel = kernel_for(q.device) if use_kernel else None
    if kernel is None:
        return ragged_attention_reference(q, k_pool, v_pool, layout, scale, window)
    return paged_attention(kernel, q.float().contiguous(), k_pool, v_pool, layout.block_tables, layout.query_start,
                           layout.context_len, scale, window or 0)
