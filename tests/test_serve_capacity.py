"""`kvlab plan --engine kvlab --kv-budget B --ctx N` and the serving engine agree: the planner's number of
concurrent sequences is the number the engine admits."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from kvlab.model.loader import default_model_path
from kvlab.plan.command import build_plan, plan_command
from kvlab.plan.rules.kvlab import engine_admission
from kvlab.serve import Engine, SamplingParams


@pytest.mark.parametrize("kv_type,block_format", [("f32", "dense"), ("dense-f16", "dense-f16"), ("dense-bf16", "dense-bf16")])
def test_the_planner_counts_the_engines_blocks(smollm2, kv_type, block_format):
    plan = build_plan(str(default_model_path()), ctx=1000, kv_type=kv_type, engine="kvlab")
    admission = engine_admission(plan.spec, plan.settings, "20MiB")
    engine = Engine(smollm2, cache=block_format, kv_budget="20MiB")
    assert admission["blocks"] == engine.capacity.n_blocks and admission["block_bytes"] == engine.capacity.block_bytes
    assert admission["max_concurrent"] == engine.capacity.max_concurrent(1000)
    assert engine.pool.nbytes == engine.capacity.n_blocks * admission["block_bytes"]
    # a block of 16 tokens holds what the planner's per-token bytes say, in the format's dtype
    assert admission["block_bytes"] == plan.layout.bytes_per_token * 16


def test_the_engine_admits_exactly_the_planned_number_of_sequences(smollm2):
    ctx = 32                                                       # 2 blocks of 16 per sequence
    block_bytes = Engine(smollm2, kv_budget="8MiB").capacity.block_bytes
    budget = 7 * block_bytes + block_bytes // 2                    # 7 blocks: room for 3 sequences and a bit
    plan = build_plan(str(default_model_path()), ctx=ctx, engine="kvlab")
    planned = engine_admission(plan.spec, plan.settings, str(budget))["max_concurrent"]
    assert planned == 3
    engine = Engine(smollm2, kv_budget=budget, max_batch=8, max_step_tokens=256, prefix_caching=False)
    prompts = [[(7 * i + j) % 500 + 10 for j in range(ctx - 2)] for i in range(planned + 1)]
    for prompt in prompts:                                         # prompt + 2 new tokens = ctx
        engine.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    stats = engine.stats()
    assert (stats.running, stats.waiting) == (planned, 1)
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().preemptions == 0 and engine.stats().generated_tokens == 2 * len(prompts)


def test_plan_prints_the_admission(capsys):
    console = Console(record=True, width=200)
    code = plan_command(str(default_model_path()), ctx="4096", kv_type="dense-f16", engine="kvlab", json_out=True,
                        console=console, kv_budget="512MiB")
    record = json.loads(console.export_text())
    assert code == 0 and record["engine_admission"]["max_concurrent"] == 536870912 // (23040 * 4096)
    err = Console(record=True, width=200)
    assert plan_command(str(default_model_path()), engine="vllm", kv_budget="1GiB", console=err) == 2
    assert "--engine kvlab" in err.export_text()
