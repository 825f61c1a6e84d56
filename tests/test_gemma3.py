"""Gemma 3 (interleaved sliding-window and global attention) runs as transformers runs it: a tiny seeded model from
transformers' own class, sliding / global alternating, a window of 8 tokens and prompts far longer, as an HF folder
and as GGUF."""

from __future__ import annotations

import json

import pytest
import torch

from kvlab.errors import ConfigError
from kvlab.model.layer_caches import SlidingWindowCache, model_cache
from kvlab.model.loader import load_model
from kvlab.sources.gguf import gguf_metadata, open_gguf

from .hybrid_checks import check_greedy, check_prefill_forms, reference_logits
from .hybrid_models import WINDOW, build, save_folder, write_gguf


@pytest.fixture(scope="module")
def pair(smollm2, tmp_path_factory):
    reference = build("gemma3", smollm2.tokenizer.vocab_size)
    folder = save_folder(reference, tmp_path_factory.mktemp("gemma3"), smollm2.tokenizer)
    return load_model(folder), reference


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 49152, (1, n), generator=torch.Generator().manual_seed(seed))


def test_facts(pair):
    loaded, _ = pair
    cfg = loaded.config
    assert cfg.arch == "gemma3" and cfg.layer_kinds == ("sliding", "full", "sliding", "full")
    assert cfg.sliding_window == WINDOW and cfg.rope_theta_local == 10000.0 and cfg.rope_theta == 1_000_000.0
    assert cfg.rope_linear_factor == 8.0 and cfg.query_scale == 24 ** -0.5 and cfg.embed_scale == 64 ** 0.5
    assert cfg.sandwich_norms and cfg.hidden_act == "gelu_tanh" and cfg.tie_embeddings and cfg.qk_norm


def test_logits_equal_transformers_in_one_pass_chunks_and_steps(pair):
    loaded, reference = pair
    check_prefill_forms(loaded, reference, prompt(60))


def test_window_cache_moving_its_rows_and_taking_wide_chunks(pair):
    """A block of 4 rows beyond the window: chunks of 7 (wider than the block) and single tokens move the rows."""
    loaded, reference = pair
    check_prefill_forms(loaded, reference, prompt(40, seed=5), chunk=7, window_block=4)
    check_prefill_forms(loaded, reference, prompt(30, seed=6), chunk=3, window_block=4)


def test_greedy_64_tokens_equal_transformers(pair):
    loaded, reference = pair
    check_greedy(loaded, reference, prompt(20, seed=1))
    check_greedy(loaded, reference, prompt(20, seed=1), new_tokens=16, chunk_size=6)


def test_sliding_layers_hold_at_most_their_window_and_a_block(pair):
    loaded, _ = pair
    cfg = loaded.config
    cache = model_cache(cfg, "dense", capacity=400, window_block=16)
    by_kind = {type(inner).__name__: (inner, layers) for inner, layers in cache.parts}
    sliding, layers = by_kind["SlidingWindowCache"]
    assert layers == (0, 2)
    row = 2 * cfg.n_kv_heads * cfg.head_dim * 4
    assert sliding.nbytes == 2 * (WINDOW - 1 + 16) * row == SlidingWindowCache.expected_nbytes(sliding.geometry, torch.float32, 16)
    full, _ = by_kind["DenseCache"]
    assert full.nbytes == 2 * 400 * row
    with torch.no_grad():
        for start in range(0, 300, 10):
            loaded.model(prompt(10, seed=start), cache)
    assert cache.length == 300 and sliding.nbytes == 2 * (WINDOW - 1 + 16) * row


def test_gguf_gives_the_same_logits(smollm2, tmp_path):
    """llama.cpp scales Gemma 3's queries by 1/sqrt(head_dim) (27B: n_embd/n_head), so the model written here has
    query_pre_attn_scalar = head_dim."""
    reference = build("gemma3", smollm2.tokenizer.vocab_size, seed=3, query_pre_attn_scalar=16)
    path = write_gguf(reference, "gemma3", tmp_path / "gemma3.gguf", gguf_metadata(open_gguf(smollm2.path)))
    loaded = load_model(path)
    assert loaded.config.layer_kinds == ("sliding", "full", "sliding", "full") and loaded.config.rope_linear_factor == 8.0
    ids = prompt(50, seed=7)
    with torch.no_grad():
        ours = loaded.model(ids, model_cache(loaded.config, "dense", capacity=50))
    assert (ours - reference_logits(reference, ids)).abs().max().item() < 1e-4


def test_compressed_cache_on_both_kinds(pair):
    loaded, reference = pair
    ids = prompt(30, seed=8)
    cache = model_cache(loaded.config, "int8", capacity=30)
    assert [layers for _, layers in cache.parts] == [(1, 3), (0, 2)]
    assert cache.parts[1][0].geometry.window == WINDOW and cache.parts[0][0].geometry.window is None
    with torch.no_grad():
        ours = loaded.model(ids, cache)
    assert (ours - reference_logits(reference, ids)).abs().max().item() < 0.1


def test_unsupported_activation_is_one_line(smollm2, tmp_path):
    reference = build("gemma3", smollm2.tokenizer.vocab_size)
    folder = save_folder(reference, tmp_path / "act", smollm2.tokenizer)
    config = json.loads((folder / "config.json").read_text())
    config["hidden_activation"] = "relu2"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="activation 'relu2' cannot be run") as err:
        load_model(folder)
    assert "\n" not in str(err.value)


def test_prerope_cache_gets_each_kinds_frequencies(pair):
    """tq4 (+prerope) codes keys before RoPE: sliding and global layers' caches carry their own bases and scaling."""
    from kvlab.rope import kind_frequencies

    loaded, reference = pair
    cache = model_cache(loaded.config, "tq4", capacity=40)
    frequencies = kind_frequencies(loaded.config)
    (full, full_layers), (sliding, sliding_layers) = cache.parts
    assert (full_layers, sliding_layers) == ((1, 3), (0, 2))
    assert torch.equal(full.codec.rope_inv_freq, frequencies["full"]) and torch.equal(sliding.codec.rope_inv_freq, frequencies["sliding"])
    assert not torch.equal(frequencies["full"], frequencies["sliding"])
    ids = prompt(40, seed=9)
    with torch.no_grad():
        ours = loaded.model(ids, cache)
    assert (ours - reference_logits(reference, ids)).abs().max().item() < 0.1


def test_f16_storage_keeps_the_window_too(pair):
    loaded, reference = pair
    ids = prompt(40, seed=10)
    cache = model_cache(loaded.config, "dense-f16", capacity=40, window_block=4)
    sliding = next(inner for inner, layers in cache.parts if layers == (0, 2))
    assert isinstance(sliding, SlidingWindowCache) and sliding.k.dtype == torch.float16
    with torch.no_grad():
        steps = torch.cat([loaded.model(ids[:, a:a + 5], cache) for a in range(0, 40, 5)], dim=1)
    assert (steps - reference_logits(reference, ids)).abs().max().item() < 2e-2     # K/V rounded to f16
    assert sliding.nbytes == 2 * 2 * (WINDOW - 1 + 4) * 2 * loaded.config.head_dim * 2


@pytest.mark.parametrize("name", ["dense", "dense-f16", "int8", "tq4"])
def test_cache_bytes_equal_the_formula(pair, name):
    from kvlab.model.layer_caches import LayeredCache

    loaded, _ = pair
    cache = model_cache(loaded.config, name, capacity=96, window_block=16)
    expected = LayeredCache.expected_nbytes(loaded.config, name, 1, 96, torch.float32, window_block=16)
    assert cache.nbytes == expected
    with torch.no_grad():
        for start in range(0, 60, 10):                         # chunks within the block: no wide copy held
            loaded.model(prompt(10, seed=start), cache)
    assert cache.nbytes == expected


def test_hub_style_config_reads_the_same_facts():
    """Gemma 3 configs on the Hub predate layer_types and per-kind rope_parameters: rope_theta, rope_local_base_freq,
    rope_scaling and sliding_window_pattern say the same things."""
    from kvlab.sources.hf_folder import spec_from_config

    spec = spec_from_config({
        "model_type": "gemma3_text", "num_hidden_layers": 12, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300, "sliding_window": 512,
        "sliding_window_pattern": 6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "query_pre_attn_scalar": 168,
    })
    assert [layer.kind for layer in spec.layers] == (["sliding"] * 5 + ["full"]) * 2
    facts = spec.runtime
    assert (facts.rope_theta, facts.rope_theta_local, facts.rope_scaling_factor, facts.rope_scaling_type) == (1e6, 1e4, 8.0, None)
    assert facts.query_pre_attn_scalar == 168 and facts.hidden_act == "gelu_tanh" and facts.tie_embeddings and facts.qk_norm
