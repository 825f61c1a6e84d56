"""The scheduler: which tokens of which sequences run in the next step.

Each step gets at most `max_step_tokens` tokens. Running sequences come first, oldest first: every
decoding one gets its one token, then prefilling ones get chunks of their prompt from what is left.
Waiting sequences are admitted (first come, first served) while there is room in the batch, in the token
budget, and in the pool for their whole remaining prompt. When a running sequence needs a block and none
is free, the newest sequence not yet scheduled in this step is preempted: its blocks are freed (they stay
in the prefix cache) and it goes back to the front of the queue, to be recomputed later. Nothing is lost:
its tokens so far are kept and become its prompt.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .blocks import BlockManager
from .sequence import Sequence, Status


@dataclass
class Chunk:
    """Tokens [start, start + n_tokens) of `seq` run in this step; their K/V go to `slots`."""

    seq: Sequence
    start: int
    n_tokens: int
    slots: list[int]

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the sequence: its last row's logits give the next token."""
        return self.start + self.n_tokens == len(self.seq.token_ids)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch: int, max_step_tokens: int):
        self.blocks = blocks
        self.max_batch = max_batch
        self.max_step_tokens = max_step_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []       # in admission order: the last one is the newest
        self.preemptions = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and free its blocks (abort, finish)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -----------------------------------------------------------------------------------------
    def schedule(self) -> list[Chunk]:
        budget = self.max_step_tokens
        chunks: list[Chunk] = []
        scheduled: set[int] = set()
        for seq in sorted(self.running, key=lambda s: s.remaining != 1):   # decodes first, order kept otherwise
            if seq.status is not Status.RUNNING or budget == 0:
                continue
            n = self._fit_running(seq, min(seq.remaining, budget), scheduled)
            if n:
                chunks.append(Chunk(seq, seq.num_computed, n, self.blocks.reserve(seq, n)))
                scheduled.add(id(seq))
                budget -= n
        while self.waiting and len(self.running) + self.waiting[0].pending_forks < self.max_batch and budget > 0:
            seq = self.waiting[0]                   # (room for the choices it will fork into, too)
            n = self._admit(seq, budget)
            if not n:
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            chunks.append(Chunk(seq, seq.num_computed, n, self.blocks.reserve(seq, n)))
            budget -= n
        return chunks

    def _fit_running(self, seq: Sequence, n: int, scheduled: set[int]) -> int:
        """Tokens of `seq` that get blocks this step, preempting the newest unscheduled sequences if needed."""
        while not self.blocks.can_reserve(seq, n):
            if seq.remaining > 1 and self.blocks.tokens_that_fit(seq) > 0:   # a prefill chunk can shrink instead
                return min(n, self.blocks.tokens_that_fit(seq))
            victim = next(s for s in reversed(self.running) if id(s) not in scheduled)
            self._preempt(victim)
            if victim is seq:
                return 0
        return n

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Tokens of a waiting sequence to run now (0: it must wait). Takes its cached prefix first."""
        hit = self.blocks.take_cached_prefix(seq)
        if not self.blocks.can_reserve(seq, seq.remaining):   # its whole remaining prompt must fit now
            self.blocks.free(seq)
            return 0
        if seq.admissions == 0:                             # prefix hits count at the first admission only
            self.prefix_query_tokens += seq.n_prompt
            self.prefix_hit_tokens += hit
            seq.cached_prompt_tokens = hit
        seq.admissions += 1
        return min(seq.remaining, budget)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def update(self, chunks: list[Chunk], sampled: list[int | None]) -> None:
        """Count the computed tokens, index their full blocks, free what left a window, append each sampled token."""
        for chunk, token in zip(chunks, sampled):
            seq = chunk.seq
            seq.num_computed += chunk.n_tokens
            self.blocks.register_full_blocks(seq)
            self.blocks.free_behind_window(seq)
            if token is not None:
                seq.token_ids.append(token)
