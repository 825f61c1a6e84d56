"""Serving many sequences from one pool of KV blocks (the nano-vllm shape).

    blocks.py     the pool, block tables, ref counts, prefix cache (hashes chained over token ids, verified), LRU
    sequence.py   one request's tokens and blocks
    scheduler.py  waiting / running queues, per-step token budget, chunked prefill, preemption
    attention.py  attention over a ragged batch through block tables (torch reference + kernels/paged.c)
    runner.py     one batched forward per step: weights read once, attention per block table
    fused_batch.py  the same step in one C call (kernels/batchstep.c) where it applies: dense blocks, <= 48 rows
    sampling.py   SamplingParams, per-request draws, stop strings
    engine.py     add_request · step · abort · generate
"""

from .blocks import CapacityPlan
from .engine import Engine, EngineStats, GenerationOutput, RequestOutput
from .sampling import SamplingParams

__all__ = ["CapacityPlan", "Engine", "EngineStats", "GenerationOutput", "RequestOutput", "SamplingParams"]
