"""One bytes formula: for every format the planner and the serving pool both take, the planner's bytes, the pool's
bytes and a running cache's nbytes are one number, on SmolLM2, a tiny GGUF and an HF folder with a sliding window.

A pool of BLOCK-token blocks holds the format `CacheSpec.pool_spec` names (int4 there is int4+g16: a key group is a
block); the planner and the single-sequence cache are asked for that same format. The cache takes CONTEXT tokens of
K/V in every layer (random: its bytes do not depend on them, and SmolLM2's forward would cost more than the rest). The
pool (serve.Engine, max_batch 1) gets the planner's bytes for one sequence of CONTEXT tokens as its budget, so it must
hold exactly that sequence's blocks, with nothing left over.
"""

from __future__ import annotations

import pytest
import torch

from kvlab.cache import CacheGeometry, CacheSpec, make_cache
from kvlab.cache import format as fmt
from kvlab.model.loader import load_model
from kvlab.plan import PlanSettings, make_plan, rules_for
from kvlab.plan.report import plan_json
from kvlab.plan.rules.kvlab import engine_admission
from kvlab.serve.engine import Engine
from kvlab.sources import load_spec

from .test_hostile_files import HF, hf_tensors, tiny_path, tokenizer_meta, write_hf  # noqa: F401 (fixtures)

BLOCK, CONTEXT = 16, 32                      # two blocks; the window model's window is 16 tokens
#: every name of the format code's lists (NAMES, POOL_EXAMPLES) that the pool holds at BLOCK-token blocks
FORMATS = [name for name in dict.fromkeys([*fmt.NAMES, *fmt.POOL_EXAMPLES])
           if CacheSpec.parse(name, "pool").supports("pool", BLOCK)[0]]


@pytest.fixture(scope="module", params=["smollm2", "tiny-gguf", "hf-mistral-window16"])
def model(request, smollm2, tmp_path_factory):
    """(path, loaded model, the planner's spec of it)."""
    if request.param == "smollm2":
        path, loaded = smollm2.path, smollm2
    elif request.param == "tiny-gguf":
        path = request.getfixturevalue("tiny_path")
        loaded = load_model(path)
    else:
        config = {**HF, "model_type": "mistral", "sliding_window": 16, "vocab_size": smollm2.tokenizer.vocab_size}
        folder = tmp_path_factory.mktemp("mistral")
        path = write_hf(folder, config, hf_tensors(config))
        smollm2.tokenizer.backend.save(str(folder / "tokenizer.json"))
        loaded = load_model(path)
        assert loaded.config.sliding_window == 16
    return path, loaded, load_spec(str(path))


def filled(name: str, config) -> object:
    """The single-sequence cache `name` for `config`, after CONTEXT tokens of K/V in every layer."""
    geometry = CacheGeometry.for_model(config, capacity=CONTEXT)
    cache = make_cache(name, geometry)
    gen = torch.Generator().manual_seed(0)
    for layer in range(geometry.n_layers):
        k, v = (torch.randn(1, geometry.n_kv_heads, CONTEXT, geometry.head_dim, generator=gen) for _ in "kv")
        cache.append(layer, k, v)
    assert cache.length == CONTEXT
    return cache


def test_the_formats_are_the_format_codes_own():
    assert {"dense", "dense-f16", "int4", "tq4", "tq3", "tq-k4v4+qjl"} <= set(FORMATS)
    assert not {"concat", "none", "int4+recent128"} & set(FORMATS)


@pytest.mark.parametrize("name", FORMATS)
def test_planner_bytes_equal_pool_bytes_equal_nbytes(model, name):
    path, loaded, spec = model
    held = CacheSpec.parse(name, "pool").pool_spec(BLOCK).cache_name     # the format the pool's blocks hold
    planned = plan_json(make_plan(spec, rules_for("kvlab"), PlanSettings(context=CONTEXT, kv_type_k=held)))["kv_bytes"]
    cache = filled(held, loaded.config)
    engine = Engine(loaded, cache=name, kv_budget=planned, max_batch=1, block_size=BLOCK)
    admitted = engine_admission(spec, PlanSettings(context=CONTEXT, kv_type_k=name, block_size=BLOCK), planned, max_batch=1)
    assert engine.capacity.format == admitted["format"] == held
    cap = engine.capacity
    needs = cap.blocks_for(CONTEXT) * cap.block_bytes + cap.fixed_bytes       # what the pool holds for the sequence
    assert {"planner": planned, "nbytes": cache.nbytes, "pool": engine.pool_nbytes,
            "planner --kv-budget": admitted["pool_bytes"]} == dict.fromkeys(
        ["planner", "nbytes", "pool", "planner --kv-budget"], planned), \
        f"{name} on {path}: one sequence of {CONTEXT} tokens takes {needs:,} B of the pool, {planned:,} B planned"
    assert cap.n_blocks == cap.blocks_for(CONTEXT) == admitted["blocks_per_sequence"]
