"""`kvlab plan config.json`: a bare Hugging Face config plans the KV cache and counts its parameters from the
architecture, exactly: against transformers' own models built from the same configs, against safetensors
files written by transformers, against the embedded GGUF's tensor table, and against the catalog's stated totals."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from typer.testing import CliRunner

from kvlab.cli import app
from kvlab.model.loader import default_model_path
from kvlab.sources import catalog, load_spec, spec_from_config

transformers = pytest.importorskip("transformers")

#: their stated totals include the 0.42 B SigLIP vision tower (gemma-3-4b: 3.88 B text + 0.42 B = 4.3 B)
STATED_WITH_VISION = {"gemma-3-4b", "gemma-3-12b", "gemma-3-27b"}


def saved_numel(model) -> int:
    """What save_pretrained writes: every parameter once (tied ones once) plus the persistent buffers."""
    saved = model.state_dict().keys()
    return (sum(p.numel() for p in model.parameters())
            + sum(b.numel() for name, b in model.named_buffers() if name in saved))


def transformers_count(config: dict) -> int:
    """Tensors transformers' model for `config` (the language model) saves, built on the meta device: no memory."""
    from transformers import CONFIG_MAPPING, AutoModel, AutoModelForCausalLM

    config = config.get("text_config", config)
    cfg = CONFIG_MAPPING[config["model_type"]](**{k: v for k, v in config.items() if k != "model_type"})
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        try:
            return saved_numel(AutoModelForCausalLM.from_config(cfg))
        except ValueError:  # a text tower without a CausalLM class of its own (qwen3_vl_text): add its head
            body = saved_numel(AutoModel.from_config(cfg))
            return body + (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)


@pytest.mark.parametrize("name", sorted(catalog()))
def test_count_equals_transformers_for_every_catalog_model(name):
    entry = catalog()[name]
    counted = spec_from_config(entry.config, name=name)  # no n_params given: counted from the architecture
    assert counted.extra["n_params_source"] == "architecture"
    assert counted.n_params == transformers_count(entry.config)


@pytest.mark.parametrize("name", sorted(set(catalog()) - STATED_WITH_VISION))
def test_count_agrees_with_the_catalogs_stated_total(name):
    entry = catalog()[name]
    counted = spec_from_config(entry.config, name=name).n_params
    assert abs(counted / entry.n_params - 1) < 0.015, (counted, entry.n_params)  # stated totals are rounded


def test_count_equals_the_embedded_gguf_tensor_table():
    from_file = load_spec(str(default_model_path()))
    from_config = spec_from_config(catalog()["smollm2-135m"].config)
    assert from_config.n_params == from_file.n_params == 134_515_008


TINY = {
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, tie_word_embeddings=True),
    "qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128),
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                      num_experts=4, num_experts_per_tok=2, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=128, mlp_only_layers=[1]),
    "deepseek_v3": dict(model_type="deepseek_v3", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                        n_group=1, topk_group=1, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                        q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                        vocab_size=128),
    "qwen3_next": dict(model_type="qwen3_next", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, full_attention_interval=2,
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                       linear_value_head_dim=8, vocab_size=128),
    "mamba": dict(model_type="mamba", hidden_size=32, intermediate_size=64, state_size=4, num_hidden_layers=2,
                  vocab_size=128, use_bias=True),
}


@pytest.mark.parametrize("family", sorted(TINY))
def test_bare_config_counts_what_safetensors_holds(family, tmp_path):
    """A tiny model of each family saved by transformers: its safetensors total (read from the headers) equals the
    count from its config.json alone, and `kvlab plan config.json` plans it (exit 0, the count announced)."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    raw = dict(TINY[family])
    cfg = CONFIG_MAPPING[raw.pop("model_type")](**raw)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "full")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((tmp_path / "full" / "config.json").read_text())

    with_weights = load_spec(str(tmp_path / "full"))
    counted = load_spec(str(bare / "config.json"))
    assert with_weights.n_params > 0 and "n_params_source" not in with_weights.extra
    assert counted.n_params == with_weights.n_params
    assert counted.extra["n_params_source"] == "architecture"

    if family == "mamba":
        return  # the llama.cpp plan of a pure recurrent model is covered by the catalog tests
    result = CliRunner().invoke(app, ["plan", str(bare / "config.json"), "--json", "--vram", "4"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["n_params"] == counted.n_params and doc["n_params_source"] == "architecture"
    assert doc["weights_bytes"] == counted.n_params * 4  # transformers saved it in float32
    assert doc["kv_bytes"] > 0 and doc["fits"] is True


def test_an_unknown_architecture_still_plans_its_cache(tmp_path):
    """Never a refusal of the whole plan: the KV plans from the layers, the weights wait for --params / --weights-bytes."""
    config = dict(model_type="brand_new", num_hidden_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_spec(str(tmp_path / "config.json")).n_params == 0  # never a guess
    result = CliRunner().invoke(app, ["plan", str(tmp_path / "config.json"), "--gpu", "RTX 3060"])
    assert result.exit_code == 0 and "Traceback" not in result.output
    assert "weights are unknown for 'brand_new'" in " ".join(result.output.split())
    doc = json.loads(CliRunner().invoke(app, ["plan", str(tmp_path / "config.json"), "--json", "--gpu", "RTX 3060"]).output)
    assert doc["kv_bytes"] == 2 * 2 * 64 * 2 * 4096 and doc["weights_known"] is False and doc["fits"] is None
    given = json.loads(CliRunner().invoke(app, ["plan", str(tmp_path / "config.json"), "--json", "--gpu", "RTX 3060",
                                                "--params", "1.5M", "--weights-quant", "bf16"]).output)
    assert given["weights_bytes"] == 3_000_000 and given["fits"] is True


#: current families beyond the catalog: counted exactly like transformers' models (kimi_k2 is DeepSeek-V3's code)
NEW_FAMILIES = {
    "glm4_moe": dict(model_type="glm4_moe", hidden_size=64, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4,
                     num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                     num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                     attention_bias=True, partial_rotary_factor=0.5),
    "glm4_moe_qk_norm": dict(model_type="glm4_moe", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                             n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=2, n_group=1,
                             topk_group=1, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             vocab_size=128, use_qk_norm=True),
    "qwen3_5_moe": {"model_type": "qwen3_5_moe", "text_config": dict(
        model_type="qwen3_5_moe_text", hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        full_attention_interval=2, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, vocab_size=128)},
}


@pytest.mark.parametrize("family", sorted(NEW_FAMILIES))
def test_new_families_count_like_transformers(family):
    config = NEW_FAMILIES[family]
    assert spec_from_config(config).n_params == transformers_count(config)


def test_kimi_k2_counts_as_deepseek_v3():
    config = dict(TINY["deepseek_v3"])
    assert spec_from_config(dict(config, model_type="kimi_k2")).n_params == transformers_count(config)


@pytest.mark.parametrize("key, value", [("moe_intermediate_size", "big"), ("n_shared_experts", -1),
                                        ("first_k_dense_replace", float("nan")), ("q_lora_rank", [1])])
def test_a_malformed_count_key_is_one_line_naming_it(key, value, tmp_path):
    config = dict(catalog()["deepseek-v3"].config, **{key: value})
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(app, ["plan", str(tmp_path / "config.json")])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert key in result.output and len(result.output.strip().splitlines()) == 1
