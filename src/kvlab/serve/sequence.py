"""Sequence: one request's tokens, its block table, how much of it the pool holds, and how it ended."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from .grammar import GrammarState
from .sampling import SamplingParams, TextStream, TokenCounts


class Status(enum.Enum):
    WAITING = "waiting"     # not admitted, or preempted (holds no blocks)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """token_ids = prompt + generated; token_ids[:num_computed] have their K/V in the pool."""

    request_id: str
    token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    n_prompt: int = 0
    block_table: list[int] = field(default_factory=list)   # block ids; token t lives in block_table[t // block_size]
    group_tables: list[list[int]] = field(default_factory=list)   # the other layer groups' tables (blocks.py)
    num_computed: int = 0          # tokens whose K/V are written
    num_hashed: int = 0            # leading full blocks registered in the prefix index
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache at the first admission
    admissions: int = 0            # 1 + times it came back after a preemption
    status: Status = Status.WAITING
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    text: TextStream | None = None
    counts: TokenCounts | None = None   # for the penalties (sampling.counts_tokens)
    grammar: GrammarState | None = None   # where its output is in sampling.grammar
    index: int = 0                 # which of the request's n choices this is
    pending_forks: int = 0         # choices still to fork from this sequence when its prompt is done

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)
        self.n_prompt = self.n_prompt or len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.n_prompt:]

    @property
    def remaining(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return len(self.token_ids) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
