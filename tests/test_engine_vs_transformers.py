"""The engine equals transformers on the same weights: SmolLM2's GGUF, and tiny HF folders per architecture.

Tolerance: on SmolLM2 the logits (magnitude ~35) agree to 2e-4 absolute. Both sides dequantize the same
Q4_1/Q8_0 blocks to fp32, so what is left is fp32 summation order (fused QKV / gate-up matmuls, SDPA vs
eager attention) accumulated over 30 layers: ~1e-6 relative.
"""

from __future__ import annotations

import json

import pytest
import torch

from kvlab.cache import CacheGeometry, make_cache
from kvlab.generate import generate
from kvlab.model.loader import load_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "To be, or not to be, that is the question:",
    "1, 2, 3, 5, 8, 13,",
]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_smollm2_logits_match_transformers(smollm2, hf_smollm2, prompt):
    ids = torch.tensor([smollm2.tokenizer.encode(prompt)])
    cache = make_cache("dense", CacheGeometry.for_model(smollm2.config, capacity=ids.shape[1]))
    with torch.no_grad():
        ours = smollm2.model(ids, cache)
        ref = hf_smollm2(ids).logits
    assert (ours - ref).abs().max().item() < 2e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_smollm2_greedy_64_tokens_identical_to_transformers(smollm2, hf_smollm2):
    ids = torch.tensor([smollm2.tokenizer.encode("Once upon a time, in a small village,")])
    cache = make_cache("dense", CacheGeometry.for_model(smollm2.config, capacity=ids.shape[1] + 64))
    ours = generate(smollm2.model, ids, cache, 64).token_ids[0]
    with torch.no_grad():
        ref = hf_smollm2.generate(ids, max_new_tokens=64, do_sample=False, min_new_tokens=64)[0, ids.shape[1]:].tolist()
    assert ours == ref


def test_smollm2_tokenizer_matches_transformers(smollm2):
    from transformers import AutoTokenizer

    path = smollm2.path
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in PROMPTS + ["  leading spaces, digits 12345, ünïcödé, 日本語, emoji 🙂\n\ttabs"]:
        assert smollm2.tokenizer.encode(text) == reference(text)["input_ids"]
        assert smollm2.tokenizer.decode(smollm2.tokenizer.encode(text)) == text


def _stepwise_vs_recompute(model, config, ids, dtype):
    """Max |logit difference| per cache between 4-token prefill + one-token steps and one full recompute."""
    n = ids.shape[1]
    geometry = CacheGeometry.for_model(config, capacity=n)
    diffs = {}
    with torch.no_grad():
        ref = model(ids, make_cache("none", geometry, dtype=dtype))
        for name in ("dense", "concat"):
            cache = make_cache(name, geometry, dtype=dtype)
            steps = [model(ids[:, :4], cache)] + [model(ids[:, t:t + 1], cache) for t in range(4, n)]
            diffs[name] = (torch.cat(steps, dim=1) - ref).abs().max().item()
    return diffs, ref.abs().max().item()


def test_smollm2_stepwise_cache_equals_recompute(smollm2):
    """fp32: within 1e-5 relative to the logit scale (gemv-vs-gemm rounding over 30 layers: ~4e-5 absolute on
    logits of ~31). fp64: within 1e-9 absolute, so the cache itself changes nothing."""
    import copy

    ids = torch.tensor([smollm2.tokenizer.encode("The quick brown fox jumps over the lazy dog because")])
    diffs, scale = _stepwise_vs_recompute(smollm2.model, smollm2.config, ids, torch.float32)
    assert max(diffs.values()) <= 1e-5 * scale, (diffs, scale)
    from kvlab.session import cached_model

    dense = cached_model(None, "fp32", "cpu", "dense")  # native weights are GGUF blocks computed in fp32: no fp64 copy
    model64 = copy.deepcopy(dense.model).double()
    model64.inv_freq.data = model64.inv_freq.float()
    diffs64, _ = _stepwise_vs_recompute(model64, smollm2.config, ids, torch.float64)
    assert max(diffs64.values()) < 1e-9, diffs64


def _tokenizer_json(tmp_path, smollm2):
    smollm2.tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": "<|im_start|>"}))


ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
}


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_folder_matches_transformers(tmp_path, smollm2, arch):
    """A random tiny model per architecture saved as config.json + safetensors + tokenizer.json."""
    import transformers

    config_cls, model_cls, extra = ARCHS[arch]
    config = getattr(transformers, config_cls)(
        vocab_size=smollm2.tokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, **extra,
    )
    torch.manual_seed(0)
    reference = getattr(transformers, model_cls)(config).eval()
    reference.save_pretrained(tmp_path, safe_serialization=True)
    _tokenizer_json(tmp_path, smollm2)
    loaded = load_model(tmp_path)
    assert loaded.config.arch == arch
    ids = torch.tensor([loaded.tokenizer.encode("Hello there, general Kenobi.")])
    with torch.no_grad():
        ours = loaded.model(ids, make_cache("dense", CacheGeometry.for_model(loaded.config, capacity=ids.shape[1])))
        ref = reference(ids).logits
    assert (ours - ref).abs().max().item() < 1e-5
