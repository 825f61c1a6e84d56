"""One batched forward over a ragged batch: all scheduled tokens of all sequences as one row stack.

The N tokens of a step (decode tokens and prefill chunks of any number of sequences) go through the
model as one (1, N, C) batch, so every weight matrix is read once per step. The model's own Block
modules run it: BatchView speaks the cache protocol (append / attend) for the step, writing each token's
K/V into its pool slot and answering attention per sequence through its block table. Where it applies (dense
blocks, at most GEMM_MAX_ROWS rows: fused_batch.fused_batch_for), the same layers run in one C call instead, and
the sampled rows' final norm, output head and argmax in one more.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import RaggedLayout
from .fused_batch import fused_batch_for
from .sampling import Draw, sample_rows
from .scheduler import Chunk


class BatchView:
    """The cache protocol over one step's batch: the model's Attention modules call append, then attend.

    The pool stores and reads (dense blocks, or codes: coded.py); the view carries the step's layout."""

    def __init__(self, pool, slots: torch.Tensor, layout: RaggedLayout, scale: float, window: int | None,
                 use_kernel: bool, rows: list[int] | None = None):
        self.pool, self.slots, self.layout = pool, slots, layout
        self.scale, self.window, self.use_kernel = scale, window, use_kernel
        self.rows = rows                    # each sequence's row of per-sequence pool state (coded pools)
        self.rope = None                    # +prerope pools: the step's RoPE table, made by its first layer

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k (1, Hkv, N, D), v (1, Hkv, N, Dv): the N new tokens, written to their slots."""
        self.pool.append(layer, self, k[0].transpose(0, 1), v[0].transpose(0, 1))   # (N, Hkv, D)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q (1, H, N, D) -> (1, H, N, Dv): each sequence's rows against its own blocks."""
        out = self.pool.attend(layer, self, q[0].transpose(0, 1).float())             # (N, H, Dv)
        return out.transpose(0, 1)[None].to(q.dtype)


def output_logits(model, x: torch.Tensor) -> torch.Tensor:
    """Final norm and output projection of rows x (1, R, C) -> (1, R, vocab), as Decoder.forward ends."""
    x = model.norm(x)
    return model.lm_head(x) if model.lm_head is not None else F.linear(x, model.output_weight())


class Runner:
    def __init__(self, model, pool, use_kernel: bool = True, fused_batch: bool = True):
        self.model, self.pool, self.use_kernel = model, pool, use_kernel
        self.fused_batch = fused_batch      # False: every step through the modules (fused_batch.py decides when on)
        cfg = model.config
        self.scale = cfg.head_dim ** -0.5
        self.window = cfg.sliding_window
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
        layout = RaggedLayout.build([c.seq.block_table for c in chunks], [c.n_tokens for c in chunks],
                                    [c.start + c.n_tokens for c in chunks], self.pool.block_size)
        x = self.model.embed(torch.tensor([ids], device=self.device))              # (1, N, C)
        cos, sin = self.model.rope_at(positions, x.dtype)                         # (N, D)
        fused = fused_batch_for(self, len(ids))
        if fused is not None:
            return fused(x, cos, sin, self.pool, layout, self.scale, self.window)  # (1, N, C): one C call
        slots = torch.tensor([s for c in chunks for s in c.slots], dtype=torch.long, device=self.device)   # (N,)
        rows = self.pool.rows_for([c.seq for c in chunks])
        view = BatchView(self.pool, slots, layout, self.scale, self.window, self.use_kernel, rows)
        for block in self.model.blocks:
            x = block(x, cos, sin, view)                                            # (1, N, C)
        return x

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
                logits, greedy = output_logits(self.model, rows[None])[0], None     # (R, vocab)
            seqs = [chunks[i].seq for i in sampling]
            drawn = sample_rows(logits, [s.sampling for s in seqs], [s.generator for s in seqs], greedy,
                                [s.counts for s in seqs], [1 + s.pending_forks for s in seqs], [s.grammar for s in seqs])
            for i, token in zip(sampling, drawn):
                tokens[i] = token
        return tokens
