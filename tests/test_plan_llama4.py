"""Llama 4's chunked attention: read from a llama4 config's no_rope_layers / attention_chunk_size (as transformers'
Llama4TextConfig derives its layer_types) and planned as llama.cpp allocates it (models/llama4.cpp: 3 chunked layers
of 4, n_swa fixed at 8,192, a second cache of pad(n_swa + n_ubatch, 256) cells). llama.cpp's own bytes for a tiny
llama4 are in tests/fixtures/llama_cpp_kv.json (test_plan_llama_cpp.py)."""

from __future__ import annotations

import pytest

from kvlab.errors import ConfigError
from kvlab.plan.rules import LlamaCppRules
from kvlab.plan.settings import PlanSettings
from kvlab.sources import load_spec, spec_from_config
from kvlab.sources.gguf import write_gguf

TEXT = {"model_type": "llama4_text", "num_hidden_layers": 8, "hidden_size": 512, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 1024, "intermediate_size_mlp": 2048,
        "vocab_size": 1000, "max_position_embeddings": 262144, "num_local_experts": 4, "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 1, "rope_theta": 500000.0, "rms_norm_eps": 1e-5}


def kinds(spec) -> list[str]:
    return [layer.kind for layer in spec.layers]


def test_default_chunks_every_layer_but_each_fourth():
    spec = spec_from_config(TEXT)
    assert kinds(spec) == ["sliding"] * 3 + ["full"] + ["sliding"] * 3 + ["full"]
    assert {layer.window for layer in spec.layers if layer.kind == "sliding"} == {8192}


def test_the_kinds_equal_transformers_layer_types():
    transformers = pytest.importorskip("transformers")
    for extra in ({}, {"no_rope_layers": [1, 0, 1, 1, 0, 1, 1, 1]}, {"no_rope_layer_interval": 2},
                  {"attention_chunk_size": None}):
        keys = {k: v for k, v in TEXT.items() if k != "model_type"}
        derived = transformers.Llama4TextConfig(**keys, **extra).layer_types
        expected = ["sliding" if t == "chunked_attention" else "full" for t in derived]
        assert kinds(spec_from_config({**TEXT, **extra})) == expected, extra


def test_nested_text_config_and_explicit_layer_types():
    scout_like = {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"],
                  "text_config": {**TEXT, "attention_chunk_size": 4096}, "vision_config": {"model_type": "llama4_vision_model"}}
    spec = spec_from_config(scout_like)
    assert kinds(spec) == kinds(spec_from_config(TEXT))
    assert {layer.window for layer in spec.layers if layer.kind == "sliding"} == {4096}
    every_layer_full = spec_from_config({**TEXT, "layer_types": ["full_attention"] * 8})   # MobileLLM-R1
    assert kinds(every_layer_full) == ["full"] * 8
    with pytest.raises(ConfigError, match="no_rope_layers"):
        spec_from_config({**TEXT, "no_rope_layers": [1, 0]})


@pytest.mark.parametrize("ctx,parallel,unified", [(32768, 1, False), (4096, 1, False), (65536, 4, False), (65536, 4, True)])
def test_llama_cpp_plans_the_config_as_its_converted_gguf(tmp_path, ctx, parallel, unified):
    """convert_hf_to_gguf.py writes no window for Llama 4 (Llama4Model.set_gguf_parameters); llama.cpp's loader then
    chunks 3 of 4 layers at 8,192. The config's plan and the GGUF's plan agree, cell for cell."""
    arch = "llama4"
    metadata = {"general.architecture": arch, f"{arch}.block_count": 8, f"{arch}.context_length": 262144,
                f"{arch}.embedding_length": 512, f"{arch}.feed_forward_length": 2048, f"{arch}.attention.head_count": 8,
                f"{arch}.attention.head_count_kv": 2, f"{arch}.attention.key_length": 64, f"{arch}.attention.value_length": 64,
                f"{arch}.attention.layer_norm_rms_epsilon": 1e-5, f"{arch}.expert_count": 4, f"{arch}.expert_used_count": 1,
                f"{arch}.expert_feed_forward_length": 1024, f"{arch}.interleave_moe_layer_step": 1, f"{arch}.vocab_size": 1000}
    settings = PlanSettings(context=ctx // parallel, parallel=parallel, kv_unified=unified)
    engine = LlamaCppRules()
    planned = {}
    for source, spec in (("config", spec_from_config({**TEXT, "attention_chunk_size": 4096})),
                         ("gguf", load_spec(str(write_gguf(tmp_path / "llama4.gguf", metadata))))):
        layout = engine.layout(spec, settings)
        planned[source] = [(row.kind, row.cells, row.k_bytes, row.v_bytes) for row in layout.layers]
    assert planned["config"] == planned["gguf"]
    _, cells, streams, n_ubatch = engine.contexts(settings)
    window_cells = min(cells, -(-(8192 * (parallel if unified else 1) + n_ubatch) // 256) * 256)
    assert [row[1] for row in planned["gguf"]] == [window_cells * streams] * 3 + [cells * streams] + \
        [window_cells * streams] * 3 + [cells * streams]
    note = engine.layout(spec_from_config({**TEXT, "attention_chunk_size": 4096}), settings).notes
    assert any("8,192 tokens" in n for n in note)


def test_a_zero_window_in_the_gguf_means_no_chunks(tmp_path):
    """llama4.cpp: a sliding_window key of 0 turns the chunks off (MobileLLM); any other value is replaced by 8,192."""
    base = {"general.architecture": "llama4", "llama4.block_count": 4, "llama4.embedding_length": 256,
            "llama4.attention.head_count": 4, "llama4.attention.head_count_kv": 2, "llama4.feed_forward_length": 512,
            "llama4.context_length": 8192}
    off = load_spec(str(write_gguf(tmp_path / "off.gguf", {**base, "llama4.attention.sliding_window": 0})))
    assert kinds(off) == ["full"] * 4
    other = load_spec(str(write_gguf(tmp_path / "other.gguf", {**base, "llama4.attention.sliding_window": 100})))
    assert kinds(other) == ["sliding"] * 3 + ["full"] and other.layers[0].window == 8192
