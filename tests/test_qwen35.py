"""Qwen3.5 and Qwen3-Next (Gated DeltaNet + gated attention) run as transformers runs them: tiny seeded models made
from transformers' own classes, 3 DeltaNet layers then a full-attention layer, as HF folders and as GGUF."""

from __future__ import annotations

import json

import pytest
import torch

from kvlab.errors import ConfigError, KvlabError, ModelFileError
from kvlab.model.deltanet import delta_rule_chunked, delta_rule_step, l2_normalize
from kvlab.model.layer_caches import LayeredCache, RecurrentState, model_cache
from kvlab.model.loader import load_model
from kvlab.sources import load_spec
from kvlab.sources.gguf import gguf_metadata, open_gguf

from .hybrid_checks import check_greedy, check_prefill_forms, reference_logits
from .hybrid_models import build, save_folder, write_gguf

ARCHS = ("qwen3_5", "qwen3_next")


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, smollm2, tmp_path_factory):
    """(kvlab's LoadedModel from the HF folder, the transformers model, arch)."""
    reference = build(request.param, smollm2.tokenizer.vocab_size)
    folder = save_folder(reference, tmp_path_factory.mktemp(request.param), smollm2.tokenizer)
    return load_model(folder), reference, request.param


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 49152, (1, n), generator=torch.Generator().manual_seed(seed))


def test_layer_kinds_and_facts(pair):
    loaded, _, arch = pair
    cfg = loaded.config
    assert cfg.arch == arch
    assert cfg.layer_kinds == ("recurrent", "recurrent", "recurrent", "full")
    assert cfg.rope_dim == 4 and cfg.attn_output_gate and cfg.qk_norm
    assert (cfg.linear.k_heads, cfg.linear.v_heads, cfg.linear.k_dim, cfg.linear.v_dim, cfg.linear.conv_kernel) == (2, 4, 8, 8, 4)
    assert loaded.model.fused is None and "llama family only" in loaded.model.fused_off
    from kvlab.model.fused import decode_step_kind, fused_decode_step

    assert fused_decode_step(loaded.model) is None                      # never built for these layer kinds
    assert decode_step_kind(loaded.model, model_cache(cfg, "dense", capacity=4)) == "modules"


def test_logits_equal_transformers_in_one_pass_chunks_and_steps(pair):
    """Chunks of 7 cross the DeltaNet's 64-token chunks unevenly and carry the conv state between calls."""
    loaded, reference, _ = pair
    check_prefill_forms(loaded, reference, prompt(100))


def test_greedy_64_tokens_equal_transformers(pair):
    loaded, reference, _ = pair
    check_greedy(loaded, reference, prompt(20, seed=1))


def test_chunked_delta_rule_equals_the_recurrence():
    """The chunked form (prompts) and the one-token recurrence (decode) give the same outputs and final state."""
    g = torch.Generator().manual_seed(3)
    B, H, T, Dk, Dv = 2, 3, 70, 8, 5
    q = l2_normalize(torch.randn(B, H, T, Dk, generator=g)) * Dk ** -0.5
    k = l2_normalize(torch.randn(B, H, T, Dk, generator=g))
    v = torch.randn(B, H, T, Dv, generator=g)
    gate = -torch.rand(B, H, T, generator=g)
    beta = torch.rand(B, H, T, generator=g)
    state = torch.randn(B, H, Dk, Dv, generator=g)
    out, final = delta_rule_chunked(q, k, v, gate, beta, state, chunk=16)
    s = state
    steps = []
    for t in range(T):
        o, s = delta_rule_step(q[:, :, t], k[:, :, t], v[:, :, t], gate[:, :, t], beta[:, :, t], s)
        steps.append(o)
    assert torch.allclose(out, torch.stack(steps, dim=2), atol=1e-5)
    assert torch.allclose(final, s, atol=1e-5)


def test_cache_holds_kv_of_the_attention_layers_only_and_a_fixed_state(pair):
    loaded, _, _ = pair
    cfg = loaded.config
    cache = model_cache(cfg, "dense", capacity=100)
    assert isinstance(cache, LayeredCache)
    la = cfg.linear
    state_per_layer = ((la.conv_kernel - 1) * la.conv_channels + la.v_heads * la.k_dim * la.v_dim) * 4
    assert cache.state_nbytes == 3 * state_per_layer == RecurrentState.expected_nbytes(cfg, 1, torch.float32)
    assert cache.kv_nbytes == 1 * 2 * cfg.n_kv_heads * cfg.head_dim * 100 * 4       # one attention layer
    spec = load_spec(str(loaded.path))
    assert [layer.state_elements * 4 for layer in spec.layers if layer.kind == "recurrent"] == [state_per_layer] * 3
    before = cache.state_nbytes
    with torch.no_grad():
        loaded.model(prompt(60), cache)
    assert cache.state_nbytes == before and cache.length == 60


def test_compressed_cache_codes_only_the_attention_layer(pair):
    loaded, reference, _ = pair
    ids = prompt(40, seed=2)
    cache = model_cache(loaded.config, "int8", capacity=40)
    (inner, layers), = cache.parts
    assert layers == (3,) and inner.geometry.n_layers == 1
    with torch.no_grad():
        ours = loaded.model(ids, cache)
    ref = reference_logits(reference, ids)
    assert (ours - ref).abs().max().item() < 0.1                  # int8 K/V: close, not exact
    assert torch.equal(ours[0, -1].argmax(), ref[0, -1].argmax())


def test_gguf_gives_the_same_logits(pair, smollm2, tmp_path):
    loaded, reference, arch = pair
    path = write_gguf(reference, arch, tmp_path / f"{arch}.gguf", gguf_metadata(open_gguf(smollm2.path)))
    from_gguf = load_model(path)
    assert from_gguf.config.layer_kinds == loaded.config.layer_kinds
    assert from_gguf.config.linear == loaded.config.linear and from_gguf.config.rope_dim == loaded.config.rope_dim
    ids = prompt(70, seed=4)
    with torch.no_grad():
        ours = from_gguf.model(ids, model_cache(from_gguf.config, "dense", capacity=90))
    assert (ours - reference_logits(reference, ids)).abs().max().item() < 1e-4


def test_gguf_missing_a_deltanet_tensor_is_one_line(smollm2, tmp_path):
    reference = build("qwen3_5", smollm2.tokenizer.vocab_size)
    path = write_gguf(reference, "qwen3_5", tmp_path / "broken.gguf", gguf_metadata(open_gguf(smollm2.path)),
                      drop="blk.1.ssm_conv1d.weight")
    with pytest.raises(ModelFileError, match=r"tensor 'blk\.1\.ssm_conv1d\.weight' is missing") as err:
        load_model(path)
    assert "\n" not in str(err.value) and "layer 1 (recurrent) of qwen3_5 needs it" in str(err.value)


def test_unknown_layer_kind_in_config_is_one_line(smollm2, tmp_path):
    reference = build("qwen3_5", smollm2.tokenizer.vocab_size)
    folder = save_folder(reference, tmp_path / "bad", smollm2.tokenizer)
    config = json.loads((folder / "config.json").read_text())
    config["layer_types"][1] = "mamba_attention"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"unknown layer type 'mamba_attention' in layer_types") as err:
        load_model(folder)
    assert "\n" not in str(err.value)


def test_mismatched_state_shape_is_one_line(smollm2, tmp_path):
    """A config whose DeltaNet dims disagree with the weights: the tensor and both shapes are named."""
    reference = build("qwen3_5", smollm2.tokenizer.vocab_size)
    folder = save_folder(reference, tmp_path / "shape", smollm2.tokenizer)
    config = json.loads((folder / "config.json").read_text())
    config["linear_value_head_dim"] = 16
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFileError, match=r"tensor 'model\.layers\.0\.linear_attn\.in_proj_qkv\.weight' has shape") as err:
        load_model(folder)
    assert "\n" not in str(err.value) and "v=16" in str(err.value)


def test_cache_of_another_kind_is_refused(pair):
    from kvlab.cache import CacheGeometry, make_cache

    loaded, _, _ = pair
    plain = make_cache("dense", CacheGeometry.for_model(loaded.config, capacity=8))
    with pytest.raises(ConfigError, match="needs the cache of its layer kinds"):
        loaded.model(prompt(4), plain)


def test_capacity_is_checked_for_recurrent_layers_too(pair):
    loaded, _, _ = pair
    cache = model_cache(loaded.config, "dense", capacity=8)
    with pytest.raises(KvlabError, match="exceeds the cache capacity of 8"):
        loaded.model(prompt(9), cache)


def test_cache_with_a_mismatched_state_shape_is_refused(pair):
    from dataclasses import replace

    loaded, _, _ = pair
    other = replace(loaded.config, linear=replace(loaded.config.linear, v_dim=16))
    with pytest.raises(ConfigError, match="recurrent state is shaped for .*v_dim=16") as err:
        loaded.model(prompt(4), model_cache(other, "dense", capacity=8))
    assert "\n" not in str(err.value)


@pytest.fixture(scope="module", params=("qwen3_5_moe", "qwen3_next_moe"))
def moe_pair(request, smollm2, tmp_path_factory):
    """Mixture-of-experts feed-forwards: Qwen3.5-MoE in every layer, Qwen3-Next in all but layer 1 (mlp_only_layers)."""
    reference = build(request.param, smollm2.tokenizer.vocab_size, seed=5)
    folder = save_folder(reference, tmp_path_factory.mktemp(request.param), smollm2.tokenizer)
    return load_model(folder), reference, request.param


def test_moe_logits_and_greedy_equal_transformers(moe_pair):
    loaded, reference, arch = moe_pair
    assert loaded.config.moe.n_experts == 4 and loaded.config.moe.top_k == 2
    assert loaded.config.moe_layers == ((0, 1, 2, 3) if arch == "qwen3_5_moe" else (0, 2, 3))
    check_prefill_forms(loaded, reference, prompt(66, seed=9))
    check_greedy(loaded, reference, prompt(12, seed=10), new_tokens=16)


def test_moe_gguf_gives_the_same_logits(smollm2, tmp_path):
    reference = build("qwen3_5_moe", smollm2.tokenizer.vocab_size, seed=6)
    path = write_gguf(reference, "qwen3_5_moe", tmp_path / "moe.gguf", gguf_metadata(open_gguf(smollm2.path)))
    loaded = load_model(path)
    assert loaded.config.moe_layers == (0, 1, 2, 3)
    ids = prompt(70, seed=11)
    with torch.no_grad():
        ours = loaded.model(ids, model_cache(loaded.config, "dense", capacity=70))
    assert (ours - reference_logits(reference, ids)).abs().max().item() < 1e-4


def test_prerope_cache_is_refused_for_partial_rope(pair):
    loaded, _, _ = pair
    with pytest.raises(ConfigError, match=r"rotates 4 of 16 dims") as err:
        model_cache(loaded.config, "tq4", capacity=8)
    assert "\n" not in str(err.value)
    assert model_cache(loaded.config, "tq-k4v4", capacity=8).nbytes > 0


def test_info_shows_the_layer_pattern_and_the_recurrent_state():
    """Qwen3.5-9B (the catalog's config): 8 × (3 Gated DeltaNet + 1 attention); 24 layers of 548,864 state values."""
    from kvlab.session import model_info

    record, _ = model_info("qwen3.5-9b")
    assert record["layer_pattern"] == "8 × (3 recurrent + 1 full)"
    assert record["recurrent_state_bytes"] == 24 * (3 * (2 * 16 * 128 + 32 * 128) + 32 * 128 * 128) * 4
    record, _ = model_info("gemma-3-1b")
    assert record["layer_pattern"] == "4 × (5 sliding (window 512) + 1 full) + 2 sliding (window 512)"


def test_multimodal_checkpoint_layout_loads_the_text_decoder(pair, smollm2, tmp_path):
    """Qwen3.5's released checkpoints are Qwen3_5ForConditionalGeneration: the text config nested under text_config,
    the decoder's tensors under model.language_model. (the vision tower's are ignored)."""
    from safetensors.torch import load_file, save_file

    loaded, reference, arch = pair
    if arch != "qwen3_5":
        pytest.skip("Qwen3-Next ships as a text-only model")
    folder = save_folder(reference, tmp_path / "flat", smollm2.tokenizer)
    text = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": text,
                                                    "vision_config": {"depth": 1}, "tie_word_embeddings": False}))
    tensors = load_file(str(folder / "model.safetensors"))
    renamed = {name.replace("model.", "model.language_model.", 1): t for name, t in tensors.items()}
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 4)
    (folder / "model.safetensors").unlink()
    save_file(renamed, str(folder / "model.safetensors"))
    nested = load_model(folder)
    assert nested.config.layer_kinds == loaded.config.layer_kinds
    ids = prompt(30, seed=12)
    with torch.no_grad():
        ours = nested.model(ids, model_cache(nested.config, "dense", capacity=30))
    assert (ours - reference_logits(reference, ids)).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", ["dense", "dense-bf16", "int8", "tq-k4v4"])
def test_cache_bytes_equal_the_formula(pair, name):
    loaded, _, _ = pair
    from kvlab.backends import formula_bytes_per_token

    cache = model_cache(loaded.config, name, capacity=96)
    assert cache.nbytes == LayeredCache.expected_nbytes(loaded.config, name, 1, 96, torch.float32)
    assert formula_bytes_per_token(name, loaded.config, 96, torch.float32)[0] * 96 == pytest.approx(cache.nbytes)
    with torch.no_grad():
        loaded.model(prompt(50), cache)
    assert cache.nbytes == LayeredCache.expected_nbytes(loaded.config, name, 1, 96, torch.float32)
