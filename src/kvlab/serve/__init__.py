"""Serving many sequences from one pool of KV blocks (the nano-vllm shape).

    blocks.py     the pool, block tables, ref counts, prefix cache (hashes chained over token ids, verified), LRU
    sequence.py   one request's tokens and blocks
    rows.py       per-sequence rows of a pool's buffers; state_slots.py the recurrent layers' state in such rows
    scheduler.py  waiting / running queues, per-step token budget, chunked prefill, preemption
    attention.py  attention over a ragged batch through block tables (torch reference + kernels/paged.c)
    runner.py     one batched forward per step: weights read once, attention per block table
    fused_batch.py  the same step in one C call (kernels/batchstep.c) where it applies: any blocks, <= 48 rows
    sampling.py   SamplingParams, the batched draw (penalties, logit_bias, min_p, grammar masks, logprobs), stop strings
    grammar.py    constrained decoding (llguidance): JSON schemas and Lark grammars, one mask row per sequence
    engine.py     add_request · step · abort · generate; n choices forked from one prefill
    kv_store.py   the prefix cache on disk (--kv-store): blocks in the pool's own format, read on a prefix miss
  and the HTTP server on top (kvlab serve, docs/serve.md):
    engine_loop.py  the thread that owns the engine; openai_api.py the wire format; tools.py tool calls;
    http.py       FastAPI + uvicorn, with the bounds a misbehaving client meets; command.py the CLI
"""

from .blocks import CapacityPlan
from .engine import Engine, EngineStats, GenerationOutput, RequestOutput
from .sampling import SamplingParams

__all__ = ["CapacityPlan", "Engine", "EngineStats", "GenerationOutput", "RequestOutput", "SamplingParams"]
