"""One batched forward over a ragged batch: all scheduled tokens of all sequences as one row stack.

The N tokens of a step (decode tokens and prefill chunks of any number of sequences) go through the
model as one (1, N, C) batch, so every weight matrix is read once per step. The model's own Block
modules run it: BatchView speaks the cache protocol (append / attend, and mix for recurrent layers) for the
step, writing each token's K/V into its pool slot and answering attention per sequence through its block table.
Where it applies (dense, TurboQuant or integer blocks, at most GEMM_MAX_ROWS rows: fused_batch.fused_batch_for), the same
layers run in one C call instead, and the sampled rows' final norm, output head and argmax in one more.

Models whose layers differ in kind (Gemma 3, Qwen3.5) run the modules: each attention layer reads the blocks of its
layer group (cache/capacity.LayerGroups) with its own window, and each recurrent layer runs over the sequences' state
slots (state_slots.py): the decoding sequences as one batch, each prefill chunk on its own.
"""

from __future__ import annotations

import torch

from ..cache.capacity import LayerGroups
from .attention import RaggedLayout
from .blocks import NO_BLOCK
from .fused_batch import fused_batch_for
from .sampling import Draw, sample_rows
from .scheduler import Chunk


class BatchView:
    """What a pool reads for the layers of one group and window in one step: the new tokens' slots, the block
    tables, the scale and window (and, for a model of one group, the cache protocol: append, then attend)."""

    def __init__(self, pool, slots: torch.Tensor, layout: RaggedLayout, scale: float, window: int | None,
                 use_kernel: bool, rows: list[int] | None = None, group: int = 0):
        self.pool, self.slots, self.layout = pool, slots, layout
        self.scale, self.window, self.use_kernel = scale, window, use_kernel
        self.rows = rows                    # each sequence's row of per-sequence pool state (coded pools)
        self.group = group                  # its layer group: pool layer j of group g keeps its state apart (coded pools)
        self.rope = None                    # +prerope pools: the step's RoPE table, made by its first layer

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k (1, Hkv, N, D), v (1, Hkv, N, Dv): the N new tokens, written to their slots."""
        self.pool.append(layer, self, k[0].transpose(0, 1), v[0].transpose(0, 1))   # (N, Hkv, D)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q (1, H, N, D) -> (1, H, N, Dv): each sequence's rows against its own blocks."""
        out = self.pool.attend(layer, self, q[0].transpose(0, 1).float())             # (N, H, Dv)
        return out.transpose(0, 1)[None].to(q.dtype)


class StepView:
    """The cache protocol over one step for the model's layers: each attention layer's append and attend go to the
    view of its group and window, at its layer in the pool; recurrent layers call mix (state_slots.py)."""

    def __init__(self, where: dict[int, tuple[int, BatchView]], state=None, state_rows=None):
        self.where = where                                   # model layer -> (its pool layer, its BatchView)
        self.state, self.state_rows = state, state_rows      # StateSlots, and (slots, starts, sizes) of the step

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        index, view = self.where[layer]
        view.append(index, k, v)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        index, view = self.where[layer]
        return view.attend(index, q)

    def mix(self, layer: int, mixer, h: torch.Tensor) -> torch.Tensor:
        """A recurrent layer over the step's rows h (1, N, C), each sequence on its state slot."""
        return self.state.mix(layer, mixer, h, *self.state_rows)


def token_slots(table: list[int], start: int, n: int, block_size: int) -> list[int]:
    """The slots of tokens [start, start + n) in a block table."""
    return [table[t // block_size] * block_size + t % block_size for t in range(start, start + n)]


class Runner:
    def __init__(self, model, pool, use_kernel: bool = True, fused_batch: bool = True, groups: LayerGroups | None = None,
                 state=None):
        self.model, self.pool, self.use_kernel = model, pool, use_kernel
        self.fused_batch = fused_batch      # False: every step through the modules (fused_batch.py decides when on)
        cfg = model.config
        self.scale = cfg.head_dim ** -0.5
        self.window = cfg.sliding_window
        self.groups = groups or LayerGroups.build(cfg.layer_kinds, cfg.sliding_window, free_window=False)
        self.state = state                  # StateSlots of the recurrent layers (None: the model has none)
        self.device = pool.device

    @torch.inference_mode()
    def run(self, chunks: list[Chunk]) -> list[list[Draw] | None]:
        """Forward every chunk; the draws of each chunk that reaches its sequence's end (one, or one per choice
        of a prompt that forks into n), else None."""
        if not chunks:
            return []
        return self.sample(chunks, self.hidden(chunks))

    @torch.inference_mode()
    def hidden(self, chunks: list[Chunk]) -> torch.Tensor:
        """Every chunk's tokens through every layer -> (1, N, C) rows before the final norm; their K/V into the pool."""
        ids = [t for c in chunks for t in c.seq.token_ids[c.start:c.start + c.n_tokens]]
        positions = torch.tensor([p for c in chunks for p in range(c.start, c.start + c.n_tokens)], device=self.device)
        bs = self.pool.block_size
        sizes, ends = [c.n_tokens for c in chunks], [c.start + c.n_tokens for c in chunks]
        layout = RaggedLayout.build([c.seq.block_table for c in chunks], sizes, ends, bs)
        fused = fused_batch_for(self, len(ids))
        tokens = torch.tensor([ids], device=self.device)
        rows = self.pool.rows_for([c.seq for c in chunks])
        if fused is not None:
            x = self.model.embed(tokens)                                           # (1, N, C)
            cos, sin = self.model.rope_at(positions, x.dtype)                     # (N, D)
            return fused(x, cos, sin, self.pool, layout, self.scale, self.window, rows)   # (1, N, C): one C call
        where: dict[int, tuple[int, BatchView]] = {}
        views: dict[tuple[int, int | None], BatchView] = {}
        for group, members in enumerate(self.groups.members):
            if group == 0:
                slots, group_layout = [s for c in chunks for s in c.slots], layout
            else:
                tables = [c.seq.group_tables[group - 1] for c in chunks]
                slots = [s for c, t in zip(chunks, tables) for s in token_slots(t, c.start, c.n_tokens, bs)]
                group_layout = RaggedLayout.build([[0 if b == NO_BLOCK else b for b in t] for t in tables], sizes, ends, bs)
            slot_tensor = torch.tensor(slots, dtype=torch.long, device=self.device)   # (N,)
            for index, layer in enumerate(members):
                window = self.groups.window_of(layer)
                if (group, window) not in views:
                    views[group, window] = BatchView(self.pool, slot_tensor, group_layout, self.scale, window, self.use_kernel, rows,
                                                 group)
                where[layer] = (index, views[group, window])
        state_rows = None
        if self.state is not None:
            state_rows = (self.state.slots_for([c.seq for c in chunks]), [0, *torch.tensor(sizes).cumsum(0).tolist()][:-1], sizes)
        view = StepView(where, self.state, state_rows)
        return self.model.hidden_at(tokens, positions, view)                        # (1, N, C)

    def sample(self, chunks: list[Chunk], x: torch.Tensor) -> list[list[Draw] | None]:
        """The draws of each chunk that reaches its sequence's end (its last row of x (1, N, C)), else None."""
        ends = torch.tensor([c.n_tokens for c in chunks]).cumsum(0) - 1             # last row of each chunk
        sampling = [i for i, c in enumerate(chunks) if c.samples]
        tokens: list[list[Draw] | None] = [None] * len(chunks)
        if sampling:
            rows = x[0, ends[sampling]]                                            # (R, C)
            fused = fused_batch_for(self, len(sampling))
            if fused is not None:
                logits, greedy = fused.head(rows)                                  # (R, vocab), (R,): one C call
            else:
                logits, greedy = self.model.logits(rows[None])[0], None     # (R, vocab)
            seqs = [chunks[i].seq for i in sampling]
            drawn = sample_rows(logits, [s.sampling for s in seqs], [s.generator for s in seqs], greedy,
                                [s.counts for s in seqs], [1 + s.pending_forks for s in seqs], [s.grammar for s in seqs])
            for i, token in zip(sampling, drawn):
                tokens[i] = token
        return tokens
