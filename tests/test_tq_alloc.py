"""TurboQuant `+alloc`: a key and a value width per layer at the uniform total, from a calibration pass.

The recipe's widths flow through every read (scores / mix on the codes, the C kernel and the torch path,
long chunks in blocks, the rebuilt keys); the bytes are the formula's and never more per token than the
uniform cache's; the calibration is deterministic, runs on text no evaluation window contains, and a bad
recipe (spelled or stored) is a one-line error.
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from kvlab.backends import KvlabRuntime
from kvlab.cache import CacheGeometry, TurboQuantCache, expected_nbytes, make_cache
from kvlab.cache import compressed
from kvlab.cache.allocation import allocate, held_widths
from kvlab.cache.attention import grouped_attention
from kvlab.cache.names import parse
from kvlab.errors import ConfigError
from kvlab.quality import calibrate
from kvlab.quality.corpus import shared_spans
from kvlab.quality.perplexity import WindowProtocol
from kvlab.eval.suite import corpus_windows

from .compressed_checks import (GEOMETRY, check_attend_is_exact_to_storage, check_attend_is_token_by_token,
                                check_code_kernel_equals_the_torch_path, check_nbytes)
from .conftest import tiny_model
from .test_causal_caches import CHUNKS, SAME, chunked_logits, two_sequences

# GEOMETRY has 3 layers: each recipe sums to 3·(key bits + value bits)
BASES = {  # recipe name: (the uniform cache, the name without a recipe)
    "tq-k4v4+alloc=k345v444": ("tq-k4v4", "tq-k4v4+alloc"),
    "tq-k3v3+alloc=k234v333+sink2": ("tq-k3v3+sink2", "tq-k3v3+alloc+sink2"),
    "tq-k4v3+alloc=k553v233+recent8": ("tq-k4v3+recent8", "tq-k4v3+alloc+recent8"),
    "tq-k4v4+rot=haar+alloc=k543v354": ("tq-k4v4+rot=haar", "tq-k4v4+rot=haar+alloc"),
    "tq-k4v4+alloc2=k264v444": ("tq-k4v4", "tq-k4v4+alloc2"),
}
NAMES = list(BASES)
SMALL = WindowProtocol(length=96, prefill=32, chunk=32, n_windows=1)


def small_model():
    return tiny_model(seed=3, n_heads=2, n_kv_heads=1, d_model=64, max_seq_len=SAME + 64)   # head dim 32, 2 layers


def windows_of(n: int, length: int = SMALL.length, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (1, length), generator=gen) for _ in range(n)]


# -- reading and bytes ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_attention_reads_exactly_what_each_layer_stores_at_its_own_width(name):
    check_attend_is_exact_to_storage(name)
    check_attend_is_exact_to_storage(name, attend_first=True)
    cache = make_cache(name, GEOMETRY)
    config = cache.config
    for layer in range(GEOMETRY.n_layers):
        assert cache.codec.layer_key_codes[layer].bits == config.key_alloc[layer]
        assert cache.codec.layer_value_codes[layer].bits == config.value_alloc[layer]
        assert cache.k_codes[layer].shape[-1] == GEOMETRY.head_dim * config.key_alloc[layer] // 8


def test_every_chunk_reads_what_token_by_token_decoding_reads():
    check_attend_is_token_by_token("tq-k4v4+alloc=k543v354+kweights=none")


@pytest.mark.parametrize("name", ["tq-k4v4+alloc=k35v44", "tq-k3v3+alloc=k24v33+sink1"])
def test_the_c_kernel_equals_the_torch_path(name):
    check_code_kernel_equals_the_torch_path(name, seed=1)


def test_long_chunks_in_blocks_read_every_layer_at_its_width(monkeypatch):
    g = replace(GEOMETRY, capacity=160)
    blocked, one_pass = make_cache("tq-k4v4+alloc=k534v453", g), make_cache("tq-k4v4+alloc=k534v453", g)
    gen = torch.Generator().manual_seed(2)
    for T in (70, 60):
        k, v, q = torch.randn(1, 2, T, 64, generator=gen), torch.randn(1, 2, T, 64, generator=gen), torch.randn(1, 6, T, 64, generator=gen)
        for layer in range(g.n_layers):
            blocked.append(layer, k, v)
            one_pass.append(layer, k, v)
            reference = one_pass.attend(layer, q)
            first_read = blocked.awaits_queries(layer)              # the first chunk is read exactly, then coded
            with monkeypatch.context() as patch:
                patch.setattr(compressed, "ATTEND_ROWS", 45)
                patch.setattr(compressed, "ATTEND_KEYS", 32)
                ours = blocked.attend(layer, q)
            torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
            keys, values = (k, v) if first_read else blocked.dequantized(layer)
            torch.testing.assert_close(ours, grouped_attention(q, keys, values, blocked.scale), atol=2e-5, rtol=1e-4)


def test_model_logits_are_causal_and_the_widths_matter():
    model = tiny_model(seed=3, n_heads=4, n_kv_heads=2, d_model=128, max_seq_len=sum(CHUNKS))
    tokens = two_sequences()
    a = chunked_logits(model, tokens[:1], "tq-k4v4+alloc=k35v44", CHUNKS)
    b = chunked_logits(model, tokens[1:], "tq-k4v4+alloc=k35v44", CHUNKS)
    assert torch.equal(a[:, :SAME], b[:, :SAME]) and not torch.equal(a[:, SAME:], b[:, SAME:])
    uniform = chunked_logits(model, tokens[:1], "tq-k4v4", CHUNKS)
    assert not torch.equal(a, uniform)                    # the recipe's widths, not the base ones, were read


@pytest.mark.parametrize("name", NAMES)
def test_nbytes_are_the_formula_and_the_codes_cost_the_uniform_bytes_per_token(name):
    check_recipe_bytes(name, *BASES[name])


def check_recipe_bytes(name: str, base: str, bare: str) -> None:
    """A recipe cache's bytes are its formula; per token it costs the uniform `base`; `bare` (no recipe) the same."""
    check_nbytes(name)

    def per_token(n: str) -> int:
        return expected_nbytes(n, replace(GEOMETRY, capacity=200), torch.bfloat16, 0) - expected_nbytes(n, GEOMETRY, torch.bfloat16, 0)

    assert per_token(name) == per_token(base)
    # `tq4+alloc` (no recipe yet) has the same bytes as any recipe: the formula does not depend on it
    assert expected_nbytes(bare, GEOMETRY, torch.bfloat16, 0) == expected_nbytes(name, GEOMETRY, torch.bfloat16, 0)


def test_fixed_state_counts_the_recipe_and_every_held_codebook():
    cache = make_cache("tq-k4v4+alloc=k345v444", GEOMETRY)
    plain = make_cache("tq-k4v4", GEOMETRY)
    assert tuple(cache.codec.recipe.shape) == (3, 2) and cache.codec.recipe.dtype == torch.uint8
    assert cache.codec.recipe.tolist() == [[3, 4], [4, 4], [5, 4]]
    assert sorted(cache.codec.key_books) == sorted(cache.codec.value_books) == [3, 4, 5]
    assert all(cache.codec.key_books[b] is cache.codec.value_books[b] for b in (3, 4, 5))   # held once
    books = sum(cache.codec.key_books[b].nbytes for b in (3, 4, 5))
    assert cache.codec.state_nbytes() - plain.codec.state_nbytes() == books + 6 - plain.codec.key_codes.nbytes - plain.codec.value_codes.nbytes


def test_smollm2_alloc_caches_stay_within_the_issue_budgets():
    """SmolLM2's geometry at 511 tokens, bf16 (the eval's bytes per token): tq4+alloc no more than tq4, and both
    tq4-class caches within 6,227 B/token, tq-k3v3+alloc within 4,702 (its held 2- and 4-bit codebooks included)."""
    from kvlab.eval.suite import bytes_per_token
    from kvlab.model.config import DecoderConfig

    smollm2 = DecoderConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_ff=1536, max_seq_len=8192)
    per_token = {name: bytes_per_token(name, smollm2)[0] for name in ("tq-k4v4", "tq-k4v4+alloc", "tq-k4v4+alloc2", "tq-k3v3+alloc", "tq-k3v3+alloc2")}
    assert max(per_token["tq-k4v4+alloc"], per_token["tq-k4v4+alloc2"]) <= per_token["tq-k4v4"] <= 6227, per_token
    assert max(per_token["tq-k3v3+alloc"], per_token["tq-k3v3+alloc2"]) <= 4702, per_token
    recipe = "k" + "35" * 15 + "v" + "4" * 30
    g = CacheGeometry.for_model(smollm2, capacity=511)
    assert expected_nbytes(f"tq-k4v4+alloc={recipe}", g, torch.bfloat16, 511) == expected_nbytes("tq-k4v4+alloc", g, torch.bfloat16, 511)


# -- names and bad recipes -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES + ["tq-k4v4+alloc", "tq-k4v4+alloc2", "tq-k4v4+prerope+alloc+sink1+seed2"])
def test_names_round_trip(name):
    _, config = parse(name)
    assert parse(config.name)[1] == config
    assert config.alloc


@pytest.mark.parametrize("name, words", [
    ("tq-k4v4+alloc=k34v44", "not the uniform"),
    ("tq-k4v4+alloc=k3x5v444", "bad +alloc recipe"),
    ("tq-k4v4+alloc=k345v44", "bad +alloc recipe"),
    ("tq-k4v4+alloc=k246v444", "outside 3..5"),
    ("tq-k4v4+alloc=k35v44", "2 units (layer), the cache has 3"),
    ("tq-k4v4+qjl+alloc", "without +qjl"),
    ("tq-k4v3.5+alloc=k444v333", "not the rounded-down 22"),
    ("tq-k4v4+fp-first-last+alloc", "every layer"),
    ("tq-k4v4+alloc", "no recipe yet"),
    ("tq-k4v4+alloc3", "spreads the widths by 1 or 2"),
    ("tq-k4v4+alloc=k264v444", "outside 3..5"),
])
def test_bad_recipes_are_one_line_errors(name, words):
    with pytest.raises(ConfigError) as err:
        make_cache(name, GEOMETRY)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_head_dim_that_is_not_whole_bytes_is_refused():
    with pytest.raises(ConfigError, match="multiple of 8"):
        make_cache("tq-k4v4+alloc=k35v44", CacheGeometry(n_layers=2, n_kv_heads=1, head_dim=36, capacity=8))


# -- the allocator -------------------------------------------------------------------------------------------

def test_the_allocator_finds_the_least_harm_at_the_budget():
    rng = random.Random(0)
    for trial in range(30):
        n, kb, vb = rng.choice([1, 2, 3]), rng.choice([2, 4]), rng.choice([3, 4])
        key_harm = [{w: rng.random() * 4.0 ** (kb - w) for w in held_widths(kb)} for _ in range(n)]
        value_harm = [{w: rng.random() * 4.0 ** (vb - w) for w in held_widths(vb)} for _ in range(n)]
        keys, values = allocate(key_harm, value_harm, kb, vb)
        assert sum(keys) + sum(values) == n * (kb + vb)
        got = sum(h[w] for h, w in zip(key_harm + value_harm, keys + values))
        best = min(sum(h[w] for h, w in zip(key_harm + value_harm, choice))
                   for choice in itertools.product(*[held_widths(kb)] * n, *[held_widths(vb)] * n)
                   if sum(choice) == n * (kb + vb))
        assert got == pytest.approx(best, rel=1e-12), trial


def test_equal_harms_keep_the_base_widths():
    harm = [{3: 1.0, 4: 1.0, 5: 1.0}] * 3
    assert allocate(harm, harm, 4, 4) == ((4, 4, 4), (4, 4, 4))


# -- the calibration pass ------------------------------------------------------------------------------------

def test_the_calibration_pass_is_deterministic_and_orders_the_widths():
    model = small_model()
    config = parse("tq-k4v4+alloc")[1]
    ticks = []
    first = calibrate.measure_harms(model, windows_of(1), config, SMALL, lambda: ticks.append(1))
    again = calibrate.measure_harms(model, windows_of(1), config, SMALL)
    assert first == again
    assert len(ticks) == 1 * 2 * model.config.n_layers    # the progress bar: one step per window × keys|values × layer
    for harm in first.keys + first.values:
        assert harm[3] > harm[4] > harm[5] > 0               # a bit fewer hurts more, a bit more hurts less
    keys, values = calibrate.recipe_from(first, config)
    assert sum(keys) + sum(values) == 2 * 8 and len(keys) == len(values) == 2


def test_the_calibration_text_is_disjoint_from_the_evaluation_windows():
    from kvlab.model.loader import _gguf_tokenizer, default_model_path, read_model

    _, gguf_file = read_model(default_model_path())
    tokenizer = _gguf_tokenizer(gguf_file)
    calibration = [w[0].tolist() for w in calibrate.calibration_windows(tokenizer)]
    evaluation = [w[0].tolist() for w in corpus_windows(tokenizer, WindowProtocol())]
    assert len(calibration) == calibrate.CALIBRATION.n_windows
    assert all(len(w) == calibrate.CALIBRATION.length for w in calibration)
    assert not shared_spans(calibration, evaluation)


@pytest.fixture
def loaded(tmp_path, monkeypatch):
    """A tiny model behind a model file, with a character tokenizer; recipes kept under tmp_path."""
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(calibrate, "CALIBRATION", SMALL)
    monkeypatch.setattr(calibrate, "_MEMO", {})
    model_file = tmp_path / "model.gguf"
    model_file.write_bytes(b"a model file")
    model = small_model()
    tokenizer = SimpleNamespace(encode=lambda text, add_special=False: [ord(c) % 97 for c in text])
    return SimpleNamespace(model=model, config=model.config, tokenizer=tokenizer, path=model_file,
                           dtype=torch.float32, device=torch.device("cpu"))


def test_the_engine_calibrates_once_stores_the_recipe_and_reads_it_back(loaded, monkeypatch):
    cache = KvlabRuntime(loaded).make_cache("tq-k4v4+alloc+seed1", 64)
    assert isinstance(cache, TurboQuantCache) and len(cache.config.key_alloc) == 2 and cache.config.seed == 1
    stored = list((calibrate.recipe_dir()).glob("*.json"))
    assert len(stored) == 1
    record = json.loads(stored[0].read_text())
    assert record["cache"] == "tq-k4v4+alloc" and record["model_sha256"] == calibrate.model_digest(loaded.path)
    assert (tuple(record["keys"]), tuple(record["values"])) == (cache.config.key_alloc, cache.config.value_alloc)
    calibrate._MEMO.clear()                                # from disk now, not calibrated again
    monkeypatch.setattr(calibrate, "measure_harms", lambda *a, **k: pytest.fail("calibrated twice"))
    assert calibrate.resolve("tq-k4v4+alloc", loaded) == replace(cache.config, seed=0).name
    assert calibrate.resolve("tq-k4v4", loaded) == "tq-k4v4"


@pytest.mark.parametrize("damage", ["not json", "other model", "bad widths"])
def test_a_stored_recipe_that_does_not_fit_is_a_one_line_error(loaded, damage):
    digest = calibrate.model_digest(loaded.path)
    path = calibrate.recipe_dir() / f"{digest[:16]}-tq-k4v4+alloc.json"
    path.parent.mkdir(parents=True)
    record = {"format": 1, "model_sha256": digest, "cache": "tq-k4v4+alloc", "keys": [5, 4], "values": [4, 3]}
    if damage == "other model":
        record["model_sha256"] = "0" * 64
    if damage == "bad widths":
        record["keys"] = [5, 5]
    path.write_text("{oops" if damage == "not json" else json.dumps(record))
    with pytest.raises(ConfigError) as err:
        calibrate.resolve("tq-k4v4+alloc", loaded)
    assert "delete it" in str(err.value) and "\n" not in str(err.value)
