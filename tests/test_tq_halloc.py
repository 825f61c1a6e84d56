"""TurboQuant `+halloc`: a key and a value width per (layer, KV head) at the uniform total, from a calibration pass.

Each head's codes are exactly what a uniform cache at that head's widths stores for it (bytes, norms, rebuilt
K/V); attention reads what is stored, chunk or token by token; the bytes are the formula's, the uniform
cache's per token plus the L·Hkv·2-byte recipe; the calibration shares each layer's KL out over its heads
deterministically and the allocator meets the budget exactly; a bad recipe is a one-line error; the serving pool
refuses it (the fused decode step reads it: tests/test_fused_codes.py).
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import replace

import pytest
import torch

from kvlab.backends import KvlabRuntime
from kvlab.cache import CacheGeometry, CacheSpec, TurboQuantCache, describe_formula, expected_nbytes, make_cache
from kvlab.cache.allocation import allocate, held_widths
from kvlab.cache.names import parse
from kvlab.cache.tq_codec import HeadCodes
from kvlab.errors import ConfigError
from kvlab.quality import calibrate
from kvlab.serve.formats import block_format

from .compressed_checks import (GEOMETRY, check_attend_is_exact_to_storage, check_attend_is_token_by_token, check_nbytes,
                                feed)
from .test_causal_caches import CHUNKS, SAME, chunked_logits, two_sequences
from .test_tq_alloc import SMALL, check_recipe_bytes, loaded, small_model, windows_of  # noqa: F401  (loaded: a fixture)

# GEOMETRY: 3 layers × 2 KV heads = 6 units; each recipe sums to 6·(key bits + value bits)
BASES = {  # recipe name: (the uniform cache, the name without a recipe)
    "tq-k4v4+halloc=k354453v444444": ("tq-k4v4", "tq-k4v4+halloc"),
    "tq-k3v3+halloc=k243342v333333+sink2": ("tq-k3v3+sink2", "tq-k3v3+halloc+sink2"),
    "tq-k4v3+halloc=k555333v234432+recent8": ("tq-k4v3+recent8", "tq-k4v3+halloc+recent8"),
    "tq-k4v4+halloc2=k264444v444444": ("tq-k4v4", "tq-k4v4+halloc2"),
}
NAMES = list(BASES)
# a fractional base spends the budget rounded down, floor(6·(key bits + value bits)) bits per token, around the
# nearest whole widths: recipe name -> (those bits, the name without a recipe)
FRACTIONAL = {"tq-k3v2.95+halloc=k333333v333332+sink1": (35, "tq-k3v2.95+halloc+sink1"),
              "tq-k4v3.5+halloc=k454443v343434": (45, "tq-k4v3.5+halloc")}


def unit_widths(config, layer: int, head: int) -> tuple[int, int]:
    unit = layer * GEOMETRY.n_kv_heads + head
    return config.key_alloc[unit], config.value_alloc[unit]


# -- storing and reading -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_each_head_stores_what_a_uniform_cache_at_its_widths_stores(name):
    """The reference: for every (layer, head), a plain cache at that head's key and value widths fed the same
    K/V and queries holds the same code bytes and norms for that head, and rebuilds the same K/V."""
    config = parse(name)[1]
    uniform = replace(CacheSpec.parse(name), alloc=0, key_alloc=(), value_alloc=(), alloc_heads=False)   # no recipe
    references = {}
    for layer, head in itertools.product(range(GEOMETRY.n_layers), range(GEOMETRY.n_kv_heads)):
        kb, vb = unit_widths(config, layer, head)
        references.setdefault((kb, vb), replace(uniform, key_bits=kb, value_bits=vb).name)
    fed = {ref: feed(ref) for ref in set(references.values())}
    for cache, q, _, _ in feed(name):
        plain = {ref: next(steps)[0] for ref, steps in fed.items()}
        for layer in range(GEOMETRY.n_layers):
            cache.attend(layer, q)
            for ref in plain.values():
                ref.attend(layer, q)                                   # the same queries set the same key weights
            codes = cache.codec.layer_key_codes[layer], cache.codec.layer_value_codes[layer]
            assert all(isinstance(c, HeadCodes) for c in codes)
            k, v = cache.dequantized(layer)
            for head in range(GEOMETRY.n_kv_heads):
                ref = plain[references[unit_widths(config, layer, head)]]
                for name_, heads in (("k", codes[0]), ("v", codes[1])):
                    a, b = heads.spans[head]
                    ours = getattr(cache, f"{name_}_codes")[layer][:, 0, :, a:b]        # (B, S, bytes)
                    theirs = getattr(ref, f"{name_}_codes")[layer][:, head]
                    assert torch.equal(ours, theirs), (name, layer, head, name_)
                    assert torch.equal(getattr(cache, f"{name_}_norm")[layer][:, head], getattr(ref, f"{name_}_norm")[layer][:, head])
                rk, rv = ref.dequantized(layer)
                assert torch.equal(k[:, head], rk[:, head]) and torch.equal(v[:, head], rv[:, head]), (name, layer, head)


@pytest.mark.parametrize("name", NAMES)
def test_attention_reads_exactly_what_each_head_stores(name):
    check_attend_is_exact_to_storage(name)
    check_attend_is_exact_to_storage(name, attend_first=True)
    cache = make_cache(name, GEOMETRY)
    assert not cache.codec.rows_in_c                                        # one width's C row readers do not apply
    for layer in range(GEOMETRY.n_layers):
        keys = tuple(unit_widths(cache.config, layer, h)[0] for h in range(GEOMETRY.n_kv_heads))
        assert cache.codec.layer_key_codes[layer].bits == keys
        assert cache.k_codes[layer].shape[1:] == (1, cache.config.spec.coded_rows(GEOMETRY.capacity), sum(GEOMETRY.head_dim * b // 8 for b in keys))


def test_every_chunk_reads_what_token_by_token_decoding_reads():
    check_attend_is_token_by_token("tq-k4v4+halloc=k534453v453354+kweights=none")


def test_model_logits_are_causal_and_the_head_widths_matter():
    from .conftest import tiny_model

    model = tiny_model(seed=3, n_heads=4, n_kv_heads=2, d_model=128, max_seq_len=sum(CHUNKS))
    tokens = two_sequences()
    a = chunked_logits(model, tokens[:1], "tq-k4v4+prerope+halloc=k3553v4444", CHUNKS)
    b = chunked_logits(model, tokens[1:], "tq-k4v4+prerope+halloc=k3553v4444", CHUNKS)
    assert torch.equal(a[:, :SAME], b[:, :SAME]) and not torch.equal(a[:, SAME:], b[:, SAME:])
    per_layer = chunked_logits(model, tokens[:1], "tq-k4v4+prerope+alloc=k44v44", CHUNKS)   # the same total, by layer
    swapped = chunked_logits(model, tokens[:1], "tq-k4v4+prerope+halloc=k5335v4444", CHUNKS)
    assert not torch.equal(a, per_layer) and not torch.equal(a, swapped)   # each head's own widths were read


# -- bytes ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_nbytes_are_the_formula_and_the_codes_cost_the_uniform_bytes_per_token(name):
    check_recipe_bytes(name, *BASES[name])


@pytest.mark.parametrize("name", FRACTIONAL)
def test_a_fractional_base_spends_the_rounded_down_budget_and_reads_what_it_stores(name):
    """Its codes cost the budget's bits·d/8 bytes per token (+ the two 16-bit norms of every head), its bytes are
    the formula's with or without the recipe spelled, and attention reads exactly what each head stores."""
    check_nbytes(name)
    bits, bare = FRACTIONAL[name]

    def per_token(n: str) -> int:
        return expected_nbytes(n, replace(GEOMETRY, capacity=200), torch.bfloat16, 0) - expected_nbytes(n, GEOMETRY, torch.bfloat16, 0)

    units = GEOMETRY.n_layers * GEOMETRY.n_kv_heads
    assert per_token(name) == 104 * (bits * GEOMETRY.head_dim // 8 + units * 2 * 2)
    assert expected_nbytes(bare, GEOMETRY, torch.bfloat16, 0) == expected_nbytes(name, GEOMETRY, torch.bfloat16, 0)
    assert f"{bits * GEOMETRY.head_dim // 8} B of codes" in describe_formula(bare, GEOMETRY, torch.bfloat16)   # kvlab info
    check_attend_is_exact_to_storage(name)


def test_the_recipe_is_held_one_byte_per_width_per_layer_and_head():
    cache = make_cache("tq-k4v4+halloc=k354453v444444", GEOMETRY)
    per_layer = make_cache("tq-k4v4+alloc=k444v444", GEOMETRY)
    assert tuple(cache.codec.recipe.shape) == (3, 2, 2) and cache.codec.recipe.dtype == torch.uint8
    assert cache.codec.recipe[:, :, 0].flatten().tolist() == [3, 5, 4, 4, 5, 3]
    assert cache.codec.state_nbytes() - per_layer.codec.state_nbytes() == 3 * 2 * 2 - 3 * 2   # the same codebooks held


def test_smollm2_halloc_caches_stay_within_the_issue_budgets():
    """SmolLM2's geometry (30 layers × 3 KV heads) at 511 tokens, bf16: tq4+halloc costs tq4+alloc's bytes plus
    its bigger recipe (180 more bytes per cache), within 6,227 B/token; tq-k3v3+halloc within 4,702."""
    from kvlab.eval.suite import bytes_per_token
    from kvlab.model.config import DecoderConfig

    smollm2 = DecoderConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_ff=1536, max_seq_len=8192)
    per_token = {name: bytes_per_token(name, smollm2)[0] for name in ("tq-k4v4", "tq-k4v4+halloc", "tq-k4v4+prerope+sink1+halloc", "tq-k3v3+halloc")}
    assert max(per_token["tq-k4v4+halloc"], per_token["tq-k4v4+prerope+sink1+halloc"]) <= 6227, per_token
    assert per_token["tq-k3v3+halloc"] <= 4702, per_token
    g = CacheGeometry.for_model(smollm2, capacity=511)
    recipe = "k" + "35" * 45 + "v" + "4" * 90
    assert expected_nbytes(f"tq-k4v4+halloc={recipe}", g, torch.bfloat16, 511) == expected_nbytes("tq-k4v4+halloc", g, torch.bfloat16, 511)
    assert (expected_nbytes("tq-k4v4+halloc", g, torch.bfloat16, 511) - expected_nbytes("tq-k4v4+alloc", g, torch.bfloat16, 511)
            == 30 * 3 * 2 - 30 * 2)


# -- names and bad recipes -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES + ["tq-k4v4+halloc", "tq-k4v4+halloc2", "tq-k4v4+prerope+halloc+sink1+seed2",
                                          "tq-k3v2.95+prerope+sink1+halloc", *FRACTIONAL])
def test_names_round_trip(name):
    _, config = parse(name)
    assert parse(config.name)[1] == config
    assert config.alloc and config.alloc_heads and "+halloc" in config.name


@pytest.mark.parametrize("name, words", [
    ("tq-k4v4+halloc=k345v444", "3 units (layer and KV head), the cache has 6"),     # a per-layer recipe
    ("tq-k4v4+halloc=k354453v44444", "bad +halloc recipe"),
    ("tq-k4v4+halloc=k35x453v444444", "bad +halloc recipe"),
    ("tq-k4v4+halloc=k354454v444444", "not the uniform"),
    ("tq-k4v4+halloc=k264444v444444", "outside 3..5"),
    ("tq-k4v4+halloc", "no recipe yet"),
    ("tq-k4v4+halloc3", "+halloc spreads the widths by 1 or 2"),
    ("tq-k4v4+qjl+halloc", "without +qjl"),
    ("tq-k3v2.95+halloc=k333333v333333", "not the rounded-down 35"),
    ("tq-k3v2.95+halloc=k333333v333311", "outside 2..4"),
    ("tq-k4v4+fp-first-last+halloc", "every layer"),
    ("tq-k4v4+alloc+halloc", "two bit allocations"),
])
def test_bad_recipes_are_one_line_errors(name, words):
    with pytest.raises(ConfigError) as err:
        make_cache(name, GEOMETRY)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_the_serving_pool_holds_per_head_widths_at_the_uniform_bytes():
    """Blocks of any recipe cost what the uniform cache's do (the budget's codes); the recipe is shared state (its
    attention in the pool: tests/test_serve_compressed.py, tests/test_serve_codes_kernel.py)."""
    held = block_format("tq-k4v4+halloc=k354453v444444", GEOMETRY, 16)
    uniform = block_format("tq-k4v4", GEOMETRY, 16)
    assert held.block_bytes == uniform.block_bytes == 16 * 3 * 2 * 2 * (32 + 2)   # 16 tokens, 3 layers, 2 heads, K and V


# -- the allocator over (layer, head) units ------------------------------------------------------------------

def test_the_allocator_meets_the_budget_exactly_over_layer_head_units():
    rng = random.Random(1)
    for trial in range(10):
        units = 4                                                       # e.g. 2 layers × 2 KV heads
        key_harm = [{w: rng.random() * 4.0 ** (4 - w) for w in held_widths(4)} for _ in range(units)]
        value_harm = [{w: rng.random() * 4.0 ** (3 - w) for w in held_widths(3)} for _ in range(units)]
        keys, values = allocate(key_harm, value_harm, 4, 3)
        assert len(keys) == len(values) == units and sum(keys) + sum(values) == units * 7
        got = sum(h[w] for h, w in zip(key_harm + value_harm, keys + values))
        best = min(sum(h[w] for h, w in zip(key_harm + value_harm, choice))
                   for choice in itertools.product(*[held_widths(4)] * units, *[held_widths(3)] * units)
                   if sum(choice) == units * 7)
        assert got == pytest.approx(best, rel=1e-12), trial


def test_the_allocator_meets_a_fractional_budget_exactly():
    """tq-k4v2.6 over 5 units: widths around 4 and 3, summing to floor(5·6.6) = 33 bits, the least harm of all."""
    rng = random.Random(2)
    for trial in range(10):
        units = 5
        key_harm = [{w: rng.random() * 4.0 ** (4 - w) for w in held_widths(4)} for _ in range(units)]
        value_harm = [{w: rng.random() * 4.0 ** (3 - w) for w in held_widths(3)} for _ in range(units)]
        keys, values = allocate(key_harm, value_harm, 4, 2.6)
        assert sum(keys) + sum(values) == 33
        got = sum(h[w] for h, w in zip(key_harm + value_harm, keys + values))
        best = min(sum(h[w] for h, w in zip(key_harm + value_harm, choice))
                   for choice in itertools.product(*[held_widths(4)] * units, *[held_widths(3)] * units)
                   if sum(choice) == 33)
        assert got == pytest.approx(best, rel=1e-12), trial


# -- the calibration pass ------------------------------------------------------------------------------------

def test_the_calibration_shares_each_layers_kl_over_its_heads():
    from .conftest import tiny_model

    model = tiny_model(seed=3, n_heads=2, n_kv_heads=2, d_model=64, max_seq_len=SMALL.length)    # head dim 32, 2 layers
    heads, layers = calibrate.measure_harms(model, windows_of(1), parse("tq-k4v4+halloc")[1], SMALL), \
        calibrate.measure_harms(model, windows_of(1), parse("tq-k4v4+alloc")[1], SMALL)
    assert heads == calibrate.measure_harms(model, windows_of(1), parse("tq-k4v4+halloc")[1], SMALL)   # deterministic
    H = model.config.n_kv_heads
    assert len(heads.keys) == len(heads.values) == model.config.n_layers * H
    for per_head, per_layer in ((heads.keys, layers.keys), (heads.values, layers.values)):
        for layer, whole in enumerate(per_layer):
            shares = per_head[layer * H:(layer + 1) * H]
            assert sum(h[4] for h in shares) == pytest.approx(whole[4], rel=1e-9)   # the layer's KL, shared out
            for h in shares:
                assert h[3] > h[4] > h[5] > 0
    keys, values = calibrate.recipe_from(heads, parse("tq-k4v4+halloc")[1])
    assert len(keys) == 4 and sum(keys) + sum(values) == 4 * 8


def test_a_fractional_base_allocates_from_its_whole_bases_stored_pass(loaded, monkeypatch):
    """tq-k4v3.5+halloc measures what tq4+halloc measured (the centre widths 4 and 4): no second pass, its own budget."""
    whole = calibrate.resolve("tq-k4v4+halloc", loaded)
    monkeypatch.setattr(calibrate, "measure_harms", lambda *a, **k: pytest.fail("calibrated twice"))
    config = parse(calibrate.resolve("tq-k4v3.5+halloc", loaded))[1]
    units = loaded.config.n_layers * loaded.config.n_kv_heads
    assert sum(config.key_alloc) + sum(config.value_alloc) == int(units * 7.5) < units * 8
    assert sum(parse(whole)[1].key_alloc) + sum(parse(whole)[1].value_alloc) == units * 8
    assert len(list(calibrate.recipe_dir().glob("*halloc*.json"))) == 2          # its own recipe stored too


def test_the_engine_calibrates_a_per_head_recipe_and_reads_it_back(loaded, monkeypatch):
    cache = KvlabRuntime(loaded).make_cache("tq-k4v4+halloc+seed1", 64)
    units = loaded.config.n_layers * loaded.config.n_kv_heads
    assert isinstance(cache, TurboQuantCache) and cache.config.alloc_heads and len(cache.config.key_alloc) == units
    stored = list(calibrate.recipe_dir().glob("*halloc*.json"))
    assert len(stored) == 1
    record = json.loads(stored[0].read_text())
    assert record["cache"] == "tq-k4v4+halloc" and len(record["keys"]) == units
    calibrate._MEMO.clear()
    monkeypatch.setattr(calibrate, "measure_harms", lambda *a, **k: pytest.fail("calibrated twice"))
    assert calibrate.resolve("tq-k4v4+halloc", loaded) == replace(cache.config, seed=0).name
    record["keys"] = record["keys"][:-1]                                # a stored recipe that does not fit
    stored[0].write_text(json.dumps(record))
    calibrate._MEMO.clear()
    with pytest.raises(ConfigError) as err:
        calibrate.resolve("tq-k4v4+halloc", loaded)
    assert "stored +halloc recipe" in str(err.value) and "\n" not in str(err.value)


SMOLLM2_HEADS = "k" + "35" * 45 + "v" + "4" * 90                        # 30 layers × 3 KV heads


@pytest.mark.parametrize("name, spelled", [
    ("tq-k4v4+halloc", f"tq-k4v4+halloc={SMOLLM2_HEADS}"),                      # the bare name plans a recipe's bytes
    *[(n, n) for n in ("tq-k3v3+prerope+sink1+halloc=k" + "24" * 45 + "v" + "3" * 90, "tq-k4v4+alloc=k" + "35" * 15 + "v" + "4" * 30)],
])
def test_the_planner_predicts_the_bytes_of_spelled_and_bare_recipes(name, spelled):
    from kvlab.plan import PlanSettings, rules_for, make_plan
    from kvlab.plan.report import plan_json
    from kvlab.sources import load_spec

    from .test_plan_kvlab import SMOLLM2

    plan = plan_json(make_plan(load_spec("smollm2-135m"), rules_for("kvlab"), PlanSettings(context=33, kv_type_k=f"{name}@f32")))
    geometry = CacheGeometry(batch=1, capacity=33, rope_inv_freq=tuple(10000.0 ** (-i / 32) for i in range(32)), **SMOLLM2)
    cache = make_cache(spelled, geometry)
    assert plan["kv_bytes"] == cache.nbytes == expected_nbytes(name, geometry, torch.float32, 33)
