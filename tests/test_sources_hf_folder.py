"""config.json (+ safetensors headers), the Hub (offline), and the bundled catalog."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from kvlab.errors import ConfigError, KvlabError, ModelFileError, OfflineError
from kvlab.plan import PlanSettings, rules_for, make_plan
from kvlab.sources import catalog, load_spec, spec_from_config
from kvlab.sources.hf_folder import read_safetensors_header

LLAMA = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 8,
         "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 2048, "intermediate_size": 512}


def test_folder_with_safetensors_weights(tmp_path):
    from safetensors.numpy import save_file

    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    save_file({"a": np.zeros((10, 20), np.float32), "b": np.zeros(7, np.float16)}, tmp_path / "model-00001.safetensors")
    save_file({"c": np.zeros((3, 3), np.float32)}, tmp_path / "model-00002.safetensors")
    spec = load_spec(str(tmp_path))
    assert spec.weights_bytes == 200 * 4 + 7 * 2 + 9 * 4 and spec.n_params == 200 + 7 + 9
    assert load_spec(str(tmp_path / "config.json")).n_layers == 4
    assert {(l.kind, l.n_kv_heads, l.head_dim_k) for l in spec.layers} == {("full", 2, 32)}


def test_safetensors_header_errors(tmp_path):
    (tmp_path / "short.safetensors").write_bytes(b"\x05\x00")
    (tmp_path / "junk.safetensors").write_bytes((10).to_bytes(8, "little") + b"not json!!")
    with pytest.raises(ModelFileError, match="truncated"):
        read_safetensors_header(tmp_path / "short.safetensors")
    with pytest.raises(ModelFileError, match="not a safetensors"):
        read_safetensors_header(tmp_path / "junk.safetensors")


@pytest.mark.parametrize("change, message", [
    ({"num_attention_heads": None}, "no attention head count"),
    ({"num_key_value_heads": 0}, "positive head counts"),
    ({"num_hidden_layers": -1}, "must be positive"),
    ({"num_attention_heads": 8, "num_key_value_heads": 3}, "not a multiple"),
])
def test_bad_configs_are_one_line_errors(change, message):
    config = {k: v for k, v in {**LLAMA, **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=message) as err:
        spec_from_config(config, source="cfg.json")
    assert "\n" not in str(err.value) and "cfg.json" in str(err.value)


def test_layer_kinds_from_standard_keys():
    hybrid = {**LLAMA, "num_hidden_layers": 6, "hybrid_override_pattern": "M-M*-*", "ssm_state_size": 16,
              "mamba_num_heads": 8, "mamba_head_dim": 32, "n_groups": 1, "conv_kernel": 4}
    assert [l.kind for l in spec_from_config(hybrid).layers] == ["recurrent", "none", "recurrent", "full", "none", "full"]
    types = {**LLAMA, "layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window": 128}
    assert [l.kind for l in spec_from_config(types).layers] == ["sliding", "full"] * 2
    pattern = {**LLAMA, "num_hidden_layers": 12, "sliding_window": 512, "sliding_window_pattern": 6}
    assert [l.kind for l in spec_from_config(pattern).layers].count("full") == 2
    shared = {**LLAMA, "num_kv_shared_layers": 1}
    assert spec_from_config(shared).layers[-1].kind == "none"
    qwen2 = {**LLAMA, "sliding_window": 4096, "use_sliding_window": False}
    assert {l.kind for l in spec_from_config(qwen2).layers} == {"full"}
    nested = {"model_type": "vlm", "text_config": LLAMA}
    assert spec_from_config(nested).n_layers == 4


def test_mla_from_config():
    spec = load_spec("deepseek-v3")
    assert {(l.kind, l.kv_lora_rank, l.rope_dim) for l in spec.layers} == {("mla", 512, 64)}
    assert spec.kv_elements_per_token() == 61 * 576


def test_hub_repo_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OfflineError, match="HF_HUB_OFFLINE") as err:
        load_spec("someone/some-model")
    assert "\n" not in str(err.value)


def test_unknown_model_string():
    with pytest.raises(KvlabError, match="not a file"):
        load_spec("definitely not a model")
    with pytest.raises(ModelFileError, match="no such file"):
        load_spec("/nonexistent/model.gguf")


def test_catalog_has_the_models_and_cites_sources():
    entries = catalog()
    assert len(entries) >= 30
    for needed in ("llama-3.2-1b", "llama-3.3-70b", "qwen3-0.6b", "qwen3-32b", "qwen3-30b-a3b", "qwen3-next-80b-a3b",
                   "qwen3.5-9b", "qwen3-vl-4b", "gemma-3-1b", "gemma-3-27b", "gpt-oss-20b", "gpt-oss-120b",
                   "deepseek-v3", "mistral-7b", "mixtral-8x7b", "phi-4", "smollm2-135m"):
        assert needed in entries
    for entry in entries.values():
        assert entry.source.startswith("https://huggingface.co/") and entry.source.endswith("config.json")
        assert entry.n_params > 0
        entry.spec()  # every entry derives


def test_catalog_lookup_by_repo_id_and_alias():
    assert load_spec("Qwen/Qwen3.5-9B").name == "qwen3.5-9b"
    assert load_spec("deepseek-r1").name == "deepseek-v3"


def test_planning_a_catalog_model_is_fast():
    from kvlab.plan import find_gpu

    spec = load_spec("deepseek-v3")
    make_plan(spec, rules_for("llama.cpp"), PlanSettings(context=4096), "q4_k_m", find_gpu("H200"))  # warm
    t = time.perf_counter()
    for name in ("deepseek-v3", "gemma-3-27b", "qwen3-next-80b-a3b"):
        make_plan(load_spec(name), rules_for("llama.cpp"), PlanSettings(context=32768), "q4_k_m", find_gpu("H200"))
    assert (time.perf_counter() - t) / 3 < 0.2


def test_hub_repo_unreachable_says_offline_quickly(monkeypatch):
    """Without HF_HUB_OFFLINE, an unreachable Hub is reported as such (checked before the client's retries; never "no such repo")."""
    from huggingface_hub import constants

    from kvlab.sources.hf_folder import spec_from_hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens on loopback
    with pytest.raises(OfflineError, match="cannot reach the Hugging Face Hub"):
        spec_from_hub("some-org/some-model")
