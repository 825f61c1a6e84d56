"""kvlab's caches inside transformers (kvlab/hf.py), against transformers' own DynamicCache.

Tiny random models (hidden 64, 2 layers, vocab 128, seeded) built from transformers' configs for every
family the adapter must serve: llama, qwen2, qwen3, mistral, gemma-3 (one sliding-window layer of 6
tokens, shorter than the prompt), phi-3 and two MoE (qwen2_moe, mixtral). For each:
  * dense: greedy generation is token-for-token DynamicCache's;
  * int8: the logits, teacher-forced on DynamicCache's tokens, stay within 1% of their range (measured:
    0.1-0.4%; int4 is 1.5-7.5%, so the bound tells the two apart);
  * tq4: generation runs, and kvlab's attention on its own codes (the C lookup of 4-bit codes) equals
    attention over the K/V the cache handed to transformers: those are its dequantized storage.
Then, without a model: growing the buffers never changes a stored value, `nbytes` is kvlab's formula
at the current capacity, sliding layers keep and return what DynamicSlidingWindowLayer does, and bad
names fail with one line.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache  # noqa: E402
from transformers.cache_utils import DynamicSlidingWindowLayer  # noqa: E402

from kvlab.cache import CacheGeometry, CacheSpec, expected_nbytes, make_cache  # noqa: E402
from kvlab.cache.attention import grouped_attention  # noqa: E402
from kvlab.errors import ConfigError  # noqa: E402
from kvlab.hf import KVLabCache, SlidingLayer, stored_kv  # noqa: E402

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)
WINDOW = 6
ARCHS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=16),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=None),
    "gemma3": lambda: transformers.Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=WINDOW,
                                                    layer_types=["sliding_attention", "full_attention"]),
    "phi3": lambda: transformers.Phi3Config(**COMMON),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**COMMON, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                                     num_experts=4, num_experts_per_tok=2),
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
}
NEW_TOKENS = 6


def tiny(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    config = ARCHS[arch]()
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    prompt = torch.randint(1, COMMON["vocab_size"], (1, 9))
    return model, prompt


def greedy(model, prompt, cache, **kwargs) -> torch.Tensor:
    return model.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, cache=cache, **kwargs)


@torch.no_grad()
def forced_logits(model, tokens: torch.Tensor, n_prompt: int, cache) -> torch.Tensor:
    """Logits for positions n_prompt-1 .. end-1: the prompt in one pass, then one given token at a time."""
    out = [model(tokens[:, :n_prompt], cache=cache).logits[:, -1]]
    for t in range(n_prompt, tokens.shape[1] - 1):
        out.append(model(tokens[:, t:t + 1], cache=cache).logits[:, -1])
    return torch.stack(out, dim=1)                                          # (B, N, V)


def record_returns(cache: KVLabCache) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Keep the last (keys, values) each layer's `update` handed to transformers' attention."""
    returned = {}
    for i, layer in enumerate(cache.layers):
        def update(k, v, *args, _update=layer.update, _i=i, **kwargs):
            returned[_i] = _update(k, v, *args, **kwargs)
            return returned[_i]
        layer.update = update
    return returned


@pytest.mark.parametrize("arch", list(ARCHS))
def test_kvlab_caches_in_transformers_generate(arch):
    model, prompt = tiny(arch)
    config = model.config
    reference = greedy(model, prompt, DynamicCache(config=config))

    # dense: the same tokens, through a geometric growth (capacity 9 -> 18)
    dense = KVLabCache.from_name("dense", config, initial_capacity=4)
    assert torch.equal(greedy(model, prompt, dense), reference)
    assert dense.get_seq_length() == reference.shape[1] - 1

    # int8: logits along DynamicCache's tokens stay close
    want = forced_logits(model, reference, prompt.shape[1], DynamicCache(config=config))
    got = forced_logits(model, reference, prompt.shape[1], KVLabCache.from_name("int8", config, initial_capacity=4))
    assert (got - want).abs().max().item() < 0.01 * (want.max() - want.min()).item()   # int8 ~1e-3, int4 ~2e-2

    # tq4: generation runs; attention over the returned K/V is kvlab's attention on its codes
    tq4 = KVLabCache.from_name("tq-k4v4", config, initial_capacity=4)
    returned = record_returns(tq4)
    tokens = greedy(model, prompt, tq4)
    assert tokens.shape == reference.shape
    torch.manual_seed(1)
    for i, layer in enumerate(tq4.layers):
        keys, values = returned[i]
        if isinstance(layer, SlidingLayer):
            assert keys.shape[2] == WINDOW - 1 + 1                          # what DynamicSlidingWindowLayer returns
            kept = torch.cat([stored_kv(c, 0)[0] for _, c in layer.store.segments], dim=2)
            assert torch.equal(keys, kept[:, :, -keys.shape[2]:])
            continue
        store = layer.store
        assert keys.shape[2] == tokens.shape[1] - 1
        q = torch.randn(1, config.num_attention_heads, 1, keys.shape[-1])   # (B, H, 1, D)
        on_codes = store.cache.attend(store.index[i], q)
        over_returned = grouped_attention(q, keys, values, keys.shape[-1] ** -0.5)
        assert torch.allclose(on_codes, over_returned, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_left_padded_batch_equals_each_row_alone(arch):
    model, _ = tiny(arch)
    torch.manual_seed(2)
    long, short = torch.randint(1, 128, (1, 9)), torch.randint(1, 128, (1, 5))
    batch = torch.cat([long, torch.cat([torch.zeros(1, 4, dtype=torch.long), short], dim=1)])  # left padded
    mask = torch.cat([torch.ones(1, 9), torch.cat([torch.zeros(1, 4), torch.ones(1, 5)], dim=1)]).long()
    together = greedy(model, batch, KVLabCache.from_name("dense", model.config), attention_mask=mask)
    alone_long = greedy(model, long, KVLabCache.from_name("dense", model.config))
    alone_short = greedy(model, short, KVLabCache.from_name("dense", model.config))
    assert torch.equal(together[0, 9:], alone_long[0, 9:])
    assert torch.equal(together[1, 9:], alone_short[0, 5:])


# -- without a model: feed `update` directly ------------------------------------------------------------

LAYERS, KV_HEADS, HEAD_DIM, BATCH = 3, 2, 32, 2
CHUNKS = [9, 1, 1, 12, 3, 1, 30, 1]                                          # prefill, decode, chunked prefill


def llama_config(**overrides):
    return transformers.LlamaConfig(**{**COMMON, "num_hidden_layers": LAYERS, "num_key_value_heads": KV_HEADS,
                                       "num_attention_heads": 2 * KV_HEADS, "head_dim": HEAD_DIM, **overrides})


def chunks(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    for n in CHUNKS:
        k = torch.randn(BATCH, KV_HEADS, n, HEAD_DIM, generator=gen) + 0.5
        yield k, torch.randn(BATCH, KV_HEADS, n, HEAD_DIM, generator=gen)


NAMES = ["dense", "concat", "int8", "int4+g8", "int4+recent8", "tq4", "tq-k4v4", "tq-k4v4+sink1", "tq-k3v3+fp-first-last", "tq3.5",
         "tq-k4v3+qjl", "tq-k3v3+recent16+sink2"]


@pytest.mark.parametrize("name", NAMES)
def test_growing_never_changes_a_stored_value_and_bytes_are_the_formula(name):
    cache = KVLabCache.from_name(name, llama_config(), initial_capacity=4)
    total = sum(CHUNKS)
    stored = cache.format.config.name if cache.format.config else name     # tq4: the preset without +prerope
    fixed = make_cache(stored, CacheGeometry(LAYERS, KV_HEADS, HEAD_DIM, BATCH, capacity=total))  # never grows
    capacities = set()
    for k, v in chunks():
        for layer in range(LAYERS):
            keys, values = cache.update(k, v, layer)
            fixed.append(layer, k, v)
            capacities.add(cache.capacity)
            if name in ("dense", "concat"):
                want_k = fixed.k[layer][:, :, :fixed.layer_length(layer)] if name == "dense" else fixed.k[layer]
                assert torch.equal(keys, want_k)
            else:
                want_k, want_v = fixed.dequantized(layer)
                assert torch.equal(keys, want_k) and torch.equal(values, want_v)
        geometry = CacheGeometry(LAYERS, KV_HEADS, HEAD_DIM, BATCH, capacity=cache.capacity)
        assert cache.nbytes == expected_nbytes(stored, geometry, torch.float32, cache.get_seq_length())
    assert len(capacities) >= 3                                              # it grew, more than once
    assert total <= cache.capacity < 2 * total                              # geometrically, no capacity guess
    assert cache.get_seq_length() == total and cache.get_mask_sizes(1, 0) == (total + 1, 0)


@pytest.mark.parametrize("name", ["dense", "int4", "tq-k4v4+sink1"])
def test_sliding_layers_keep_and_return_what_transformers_does(name):
    window = 10
    config = transformers.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 2, "num_key_value_heads": KV_HEADS,
                                              "head_dim": HEAD_DIM}, sliding_window=window,
                                           layer_types=["sliding_attention", "full_attention"])
    cache = KVLabCache.from_name(name, config)
    reference = DynamicSlidingWindowLayer(sliding_window=window)
    layer = cache.layers[0]
    assert isinstance(layer, SlidingLayer)
    worst = 0.0
    for k, v in chunks():
        assert layer.get_mask_sizes(k.shape[2]) == reference.get_mask_sizes(k.shape[2])
        keys, values = cache.update(k, v, 0)
        want_k, want_v = reference.update(k, v)
        assert keys.shape == want_k.shape and values.shape == want_v.shape
        if name == "dense":
            assert torch.equal(keys, want_k) and torch.equal(values, want_v)
        else:   # the same tokens, compressed: each vector near its original (measured max 0.10 int4, 0.27 tq4)
            # (int keys wait in full precision until their 32-token group is complete: values are coded at once)
            error = max(((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
                        for got, want in ((keys, want_k), (values, want_v)))
            assert error < 0.35
            worst = max(worst, error)
        segments = layer.store.segments
        held = sum(c.layer_length(0) for _, c in segments)
        seen = layer.get_seq_length()
        assert min(seen, window - 1) <= held < window - 1 + window           # the window, in whole segments
        assert len(segments) <= 2
        geometry = CacheGeometry(1, KV_HEADS, HEAD_DIM, BATCH, capacity=window)
        spec = CacheSpec.parse(name)
        plain = replace(spec, full=replace(spec.full, sink=0)).name          # the sink lives in the first segment only
        want = sum(expected_nbytes(name if start == 0 else plain, geometry, torch.float32, window) for start, _ in segments)
        assert layer.store.nbytes == want
    assert layer.get_seq_length() == reference.get_seq_length() == sum(CHUNKS)
    assert (worst > 0) == (name != "dense")                                  # compressed formats really code
    if CacheSpec.parse(name).base == "tq":   # later segments code with the key offset measured on the first chunk
        first = make_cache(name, CacheGeometry(1, KV_HEADS, HEAD_DIM, BATCH, capacity=window))
        first.append(0, *next(chunks()))
        assert first.codec.k_offset[0].float().abs().sum() > 0
        assert all(torch.equal(cache.codec.k_offset[0], first.codec.k_offset[0]) for _, cache in segments)


def test_bad_names_and_refused_operations_fail_with_one_line():
    config = llama_config()
    for name, words in (("tq9", "width"), ("int4+bogus", "unknown option"), ("fp16", "unknown cache"), ("none", "keeps nothing"),
                        ("tq-k4v4+prerope", "keys after RoPE"), ("tq4+prerope", "keys after RoPE"), ("tq-k4v4+ropemean", "keys after RoPE"), ("tq-k4v4+alloc", "no recipe"), ("tq-k4v4+halloc", "spell the recipe")):
        with pytest.raises(ConfigError, match=words) as error:
            KVLabCache.from_name(name, config)
        assert "\n" not in str(error.value)
    preset = KVLabCache.from_name("tq4", config).format.config          # the preset as transformers can hold it
    assert preset.name == "tq4.125+norms8+sink1+kscale=lsq+vscale=lsq"
    cache = KVLabCache.from_name("int8", config)
    cache.update(torch.randn(1, KV_HEADS, 3, HEAD_DIM), torch.randn(1, KV_HEADS, 3, HEAD_DIM), 0)
    with pytest.raises(ConfigError, match="beam search"):
        cache.reorder_cache(torch.tensor([0]))
    cache.reset()                                                            # forgets everything, holds nothing
    assert cache.get_seq_length() == 0 and cache.nbytes == 0
    keys, _ = cache.update(torch.randn(2, KV_HEADS, 5, HEAD_DIM), torch.randn(2, KV_HEADS, 5, HEAD_DIM), 0)
    assert keys.shape == (2, KV_HEADS, 5, HEAD_DIM)                          # a new batch size after the reset


def test_transformers_stays_optional():
    """kvlab never imports transformers; kvlab.hf without it says how to install it, in one line."""
    code = ("import sys, kvlab, kvlab.cache, kvlab.errors; assert 'transformers' not in sys.modules; "
            "sys.modules['transformers'] = None\n"
            "try:\n    import kvlab.hf\nexcept ImportError as error:\n    print(error)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "kvlab.hf needs transformers (>= 4.56): pip install 'kvlab[hf]'"
