"""CacheSpec (cache/format.py): every name the grammar accepts parses, prints and parses back to the same format, and
every path refuses exactly what `supports()` refuses, with its message. Names are generated from the grammar's own
tables (format.OPTIONS, PLAIN, PRESETS), not listed by hand."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlab.backends import cache_name
from kvlab.cache import CacheGeometry, CacheSpec, expected_nbytes, make_cache
from kvlab.cache import format as fmt
from kvlab.cache.capacity import CapacityPlan
from kvlab.errors import ConfigError
from kvlab.model.config import DecoderConfig
from kvlab.plan import PlanSettings, rules_for, make_plan
from kvlab.plan.report import plan_json
from kvlab.plan.rules.kvlab import engine_admission
from kvlab.serve.engine import capacity_for
from kvlab.serve.formats import block_format
from kvlab.sources import load_spec
from kvlab.spec import LayerSpec, ModelSpec

SMOLLM2 = CacheGeometry(n_layers=30, n_kv_heads=3, head_dim=64, n_heads=9)
#: a small geometry every generated width splits (head dim 64) with RoPE frequencies for +prerope
SMALL = CacheGeometry(n_layers=2, n_kv_heads=2, head_dim=64, n_heads=4, capacity=48,
                      rope_inv_freq=tuple(10000.0 ** (-i / 32) for i in range(32)))
EXAMPLES = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- names, generated from the grammar ---------------------------------------------------------------------------
WIDTHS = st.one_of(st.integers(1, 8).map(str), st.sampled_from(["2.5", "3.5", "4.125", "3.625", "2.95", "9", "0"]))


def option_names(base: str) -> st.SearchStrategy[str]:
    """One option of `base` as the table spells it: a flag, or its pattern filled with one of its values."""
    spelled = []
    for option in fmt.OPTIONS:
        if base in option.bases:
            values = option.values or (None,)
            spelled.append(st.sampled_from([option.spell.format(v) if v is not None else option.spell for v in values]))
    return st.one_of(spelled)


def recipes(n_units: int) -> st.SearchStrategy[str]:
    """+alloc=k…v… / +halloc=k…v… recipes for SMALL's units: the uniform one at 4 bits, a bit moved, a bad sum."""
    return st.sampled_from([f"k{'4' * n_units}v{'4' * n_units}", f"k5{'4' * (n_units - 1)}v3{'4' * (n_units - 1)}",
                            f"k{'5' * n_units}v{'4' * n_units}"])


@st.composite
def names(draw) -> str:
    kind = draw(st.sampled_from(["plain", "preset", "int", "tq", "tq-kv"]))
    if kind == "plain":
        return draw(st.sampled_from(list(fmt.PLAIN)))
    if kind == "preset":
        head, base = draw(st.sampled_from(list(fmt.PRESETS))), "tq"
    elif kind == "int":
        head, base = f"int{draw(st.integers(0, 9))}", "int"
    else:
        width = draw(WIDTHS)
        head, base = (f"tq{width}" if kind == "tq" else f"tq-k{width}v{draw(WIDTHS)}"), "tq"
    options = draw(st.lists(option_names(base), max_size=4))
    if base == "tq" and draw(st.booleans()) and not any("alloc" in o for o in options):
        heads = draw(st.booleans())
        units = SMALL.n_layers * (SMALL.n_kv_heads if heads else 1)
        options.append(("halloc" if heads else "alloc") + "=" + draw(recipes(units)))
    return "+".join([head, *options]).upper() if draw(st.booleans()) else "+".join([head, *options])


def parsed(name: str, path: str = "torch") -> CacheSpec | None:
    """The spec, or None for a name the grammar refuses (one line)."""
    try:
        return CacheSpec.parse(name, path)
    except ConfigError as err:
        assert "\n" not in str(err)
        return None


# -- parse -> print -> parse -------------------------------------------------------------------------------------
@EXAMPLES
@given(names())
def test_every_generated_name_prints_a_name_that_parses_back_to_it(name):
    for path in fmt.PATHS:
        spec = parsed(name, path)
        if spec is None:
            continue
        again = CacheSpec.parse(spec.name, path)
        assert again == spec and again.name == spec.name == str(spec)
        assert CacheSpec.parse(spec.name, "torch") == spec          # a canonical name names no preset
        for where in fmt.PATHS:                                     # supports(): one line, ok exactly without a reason
            ok, reason = spec.supports(where, 16)
            assert ok == (reason == "") and "\n" not in reason


@EXAMPLES
@given(names(), st.sampled_from(sorted(fmt.DTYPES)))
def test_planner_kv_types_round_trip(name, dtype):
    spec = parsed(name)
    if spec is None:
        return
    assert CacheSpec.parse_with_dtype(f"{spec.name}@{dtype}") == (spec, fmt.DTYPES[dtype])
    assert CacheSpec.parse_with_dtype(spec.name) == (spec, "float32")
    assert CacheSpec.parse_with_dtype(dtype) == (CacheSpec.parse("dense"), fmt.DTYPES[dtype])   # bare f16: dense


@EXAMPLES
@given(names())
def test_pool_formats_round_trip(name):
    spec = parsed(name, "pool")
    if spec is None or not spec.supports("pool", 16)[0]:
        return
    held = spec.pool_spec(16)
    assert CacheSpec.parse(held.name, "pool") == held
    assert CacheSpec.parse(held.name, "pool").pool_spec(16) == held   # the resolved key group stays spelled


def test_presets_stand_for_their_recipe_and_print_it():
    for head, recipe in fmt.PRESETS.items():
        assert CacheSpec.parse(head) == CacheSpec.parse(recipe) and CacheSpec.parse(head).name == recipe
        assert CacheSpec.parse(head).preset == head and CacheSpec.parse(recipe).preset == ""
        assert not CacheSpec.parse(head, "transformers").pre_rope
        assert CacheSpec.parse(head + "+prerope", "transformers").pre_rope
        assert CacheSpec.parse(head, "transformers").name == fmt.TRANSFORMERS_PRESETS[head]
    # keys after RoPE without +ropemean: tq4 there has an eighth of its channels at 5 bits, tq3 4-bit keys, 3-bit values
    recipe = CacheSpec.parse("tq4.125+norms8+sink1+kscale=lsq+vscale=lsq")
    assert CacheSpec.parse("tq4", "transformers") == replace(recipe, spelled="tq4")
    assert not CacheSpec.parse("tq4", "transformers").rope_mean
    tq3 = CacheSpec.parse("tq3", "transformers")
    assert (tq3.key_bits, tq3.value_bits, tq3.vector, tq3.log_norms, tq3.full.sink) == (4, 3, True, True, 1)


def test_defaults_print_as_nothing_and_options_in_one_order():
    assert CacheSpec.parse("tq-k3v3+seed0+kscale=renorm+center=k+rot=hadamard").name == "tq-k3v3"
    assert CacheSpec.parse("tq-k3v3+seed2+recent64+qjl").name == "tq-k3v3+qjl+recent64+seed2"
    assert CacheSpec.parse("tq-k3.015625v3").name == "tq-k3.015625v3"     # every digit a width needs
    assert CacheSpec.parse("int4+g32") != CacheSpec.parse("int4")          # the pool's G is the block size unless given
    assert CacheSpec.parse("int4+g32").cache_name == "int4"


def test_a_spec_is_immutable():
    spec = CacheSpec.parse("tq-k3v3")
    with pytest.raises(AttributeError):
        spec.key_bits = 4


# -- every path refuses what supports() refuses, with its message -------------------------------------------------
# supports(path) ok => every entry point of that path accepts the name; an entry point refuses => supports(path) refuses
# with the same one line. Each path is reached through the functions its users call.
FLAT = DecoderConfig(vocab_size=8, d_model=256, n_layers=SMALL.n_layers, n_heads=SMALL.n_heads, n_kv_heads=SMALL.n_kv_heads,
                     d_ff=8, head_dim=SMALL.head_dim)
#: a model whose layers differ in kind (Gemma 3): two layer groups of SMALL's 2 layers, so SMALL's recipes fit a group
LAYERED = DecoderConfig(vocab_size=8, d_model=256, n_layers=4, n_heads=SMALL.n_heads, n_kv_heads=SMALL.n_kv_heads, d_ff=8,
                        head_dim=SMALL.head_dim, arch="gemma3", layer_kinds=("sliding", "full") * 2, sliding_window=32)


def model_spec(config: DecoderConfig) -> ModelSpec:
    """The planner's view of `config`'s attention layers."""
    layers = tuple(LayerSpec(kind, config.n_heads, config.n_kv_heads, config.head_dim, config.head_dim,
                             config.sliding_window if kind == "sliding" else None) for kind in config.layer_kinds)
    return ModelSpec(config.arch, config.arch, layers)


def outcome(call) -> str:
    """"" when `call` accepts the name, else the one line of its ConfigError."""
    try:
        call()
    except ConfigError as err:
        assert "\n" not in str(err)
        return str(err)
    return ""


def assert_agrees(spec: CacheSpec, path: str, block_size: int | None, on_small: dict, anywhere: dict = {}) -> None:
    """Every entry point refuses what supports(path) refuses, with its reason, and accepts the rest. `on_small`: entry
    points that size the format for SMALL, where a format that does not fit it (a width that splits no whole channels)
    gets the bytes formula's one line; `anywhere`: entry points that read the name alone."""
    ok, reason = spec.supports(path, block_size)
    fit = reason if not ok else outcome(lambda: spec.bytes(SMALL, SMALL.capacity))
    got = {where: outcome(call) for where, call in {**on_small, **anywhere}.items()}
    assert got == {**dict.fromkeys(on_small, fit), **dict.fromkeys(anywhere, reason)}, \
        f"{spec.label!r} on {path}: supports() says {ok, reason}"


def refuses_all(name: str, *entry_points: dict) -> None:
    """A name the grammar refuses: every entry point gives a one-line ConfigError."""
    for calls in entry_points:
        for where, call in calls.items():
            assert outcome(call), f"{where} accepts {name!r}, which the grammar refuses"


def unresolved(spec: CacheSpec) -> bool:
    """+alloc / +halloc without its recipe: the torch path calibrates the recipe for its model first
    (quality/calibrate.py resolve); a cache is built from the name that spells it out."""
    return bool(spec.alloc) and not spec.key_alloc


@EXAMPLES
@given(names())
def test_the_pool_refuses_what_supports_refuses(name):
    """block_format (the pool), CapacityPlan (its admission), serve.Engine's capacity_for and the planner's --kv-budget."""
    entry_points = {
        "block_format": lambda: block_format(name, SMALL, 16),
        "CapacityPlan": lambda: CapacityPlan.build(SMALL, name, "4MiB", 16),
        "Engine": lambda: capacity_for(FLAT, name, "4MiB", 16),
        "planner --kv-budget": lambda: engine_admission(model_spec(FLAT), PlanSettings(context=64, kv_type_k=name), "4MiB"),
    }
    spec = parsed(name, "pool")
    if spec is None:
        return refuses_all(name, entry_points)
    assert_agrees(spec, "pool", 16, entry_points)
    if not outcome(lambda: block_format(name, SMALL, 16)):
        assert block_format(name, SMALL, 16).block_bytes == spec.pool_bytes(SMALL, 16).block


@EXAMPLES
@given(names())
def test_the_layered_pool_refuses_what_supports_refuses(name):
    """A model whose layers differ in kind: serve.Engine's capacity_for and the planner's --kv-budget."""
    entry_points = {
        "Engine": lambda: capacity_for(LAYERED, name, "4MiB", 16),
        "planner --kv-budget": lambda: engine_admission(model_spec(LAYERED), PlanSettings(context=64, kv_type_k=name), "4MiB"),
    }
    spec = parsed(name, "pool")
    if spec is None:
        return refuses_all(name, entry_points)
    assert_agrees(spec, "layered-pool", 16, entry_points)


@EXAMPLES
@given(names())
def test_the_torch_path_refuses_what_supports_refuses(name):
    """The single-sequence caches (make_cache), the CLI's --cache check and the planner's --kv-type (--engine kvlab)."""
    planner = lambda: rules_for("kvlab").layout(model_spec(FLAT), PlanSettings(context=48, kv_type_k=name))  # noqa: E731
    cli = {"CLI": lambda: cache_name("kvlab", name)}
    spec = parsed(name)
    if spec is None:
        return refuses_all(name, {"make_cache": lambda: make_cache(name, SMALL), "planner --kv-type": planner}, cli)
    if unresolved(spec):
        assert "has no recipe yet" in outcome(lambda: make_cache(name, SMALL))
        assert_agrees(spec, "torch", None, {"planner --kv-type": planner}, cli)
    else:
        assert_agrees(spec, "torch", None, {"make_cache": lambda: make_cache(name, SMALL), "planner --kv-type": planner}, cli)


@EXAMPLES
@given(names())
def test_transformers_refuses_what_supports_refuses(name):
    """kvlab.hf's CacheFormat and the CLI's --backend transformers check (both read the name alone)."""
    pytest.importorskip("transformers")
    from kvlab.hf import CacheFormat

    entry_points = {"CacheFormat": lambda: CacheFormat.parse(name), "CLI": lambda: cache_name("transformers", name)}
    spec = parsed(name, "transformers")
    if spec is None:
        return refuses_all(name, entry_points)
    assert_agrees(spec, "transformers", None, {}, entry_points)
    if spec.supports("transformers")[0]:
        assert CacheFormat.parse(name).name == cache_name("transformers", name) == spec.label


@EXAMPLES
@given(names())
def test_the_fused_step_refuses_what_supports_refuses(name):
    """The fused decode step (model/fused.py FusedDecodeStep.serves) takes a cache shaped for its model exactly for
    the formats supports("fused") accepts; the modules run the rest."""
    from kvlab.model.fused import FusedDecodeStep

    spec = parsed(name)
    if spec is None or unresolved(spec) or outcome(lambda: spec.bytes(SMALL, SMALL.capacity)):
        return                                    # no cache to build: a recipe to calibrate, or a width SMALL cannot hold
    step = SimpleNamespace(config=FLAT)           # serves() reads the step's model config only
    assert FusedDecodeStep.serves(step, make_cache(name, SMALL)) == spec.supports("fused")[0]


def test_named_refusals_give_the_table_message():
    """One name per row of the table (the rows that need no block size hold without one)."""
    for name, path in (("none", "transformers"), ("tq4+prerope", "transformers"), ("tq-k4v4+alloc", "transformers"),
                       ("concat", "pool"), ("int4+recent8", "pool"), ("tq-k3v3+fp-first-last", "pool"),
                       ("concat", "fused")):
        ok, reason = CacheSpec.parse(name, path).supports(path)
        assert not ok and reason and repr(name) in reason or name == "none"
    assert CacheSpec.parse("tq-k3v3+sink20").supports("pool", 16) == (
        False, "block format 'tq-k3v3+sink20': a sink of 20 tokens is more than a block of 16")
    assert "must divide the block size of 16" in CacheSpec.parse("int4+g32").supports("pool", 16)[1]
    assert CacheSpec.parse("int4").supports("pool", 16) == (True, "")
    assert all(CacheSpec.parse(name).supports("torch") == (True, "") for name in fmt.NAMES)


# -- one bytes formula ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["dense", "dense-f16", "int4", "int8+g16", "tq4", "tq-k4v4", "tq3.5+qjl", "tq-k4v3+sink2",
                                  "tq-k4v4+halloc=k" + "4" * 4 + "v" + "4" * 4])
def test_cache_pool_and_plan_share_the_formula(name):
    spec = CacheSpec.parse(name)
    assert make_cache(name, SMALL).nbytes == spec.bytes(SMALL, 5, torch.float32) == expected_nbytes(name, SMALL,
                                                                                                      torch.float32, 5)
    if spec.supports("pool", 16)[0]:
        pool = spec.pool_bytes(SMALL, 16)
        plan = CapacityPlan.build(SMALL, name, "4MiB", 16)
        assert (plan.block_bytes, plan.shared_bytes, plan.sequence_bytes) == (pool.block, pool.shared, pool.sequence)
        if spec.base != "int":   # a TurboQuant / dense block holds exactly what a token of the single cache adds
            assert pool.block == 16 * spec.token_bytes(SMALL)


@pytest.mark.parametrize("kv_type, per_token", [("tq4", 5940), ("tq-k4v4", 6120), ("dense", 46080), ("f16", 23040),
                                                ("int4", 7200), ("tq-k4v4+halloc", 6120)])
def test_planner_kv_per_token_is_what_the_cache_holds_per_token(kv_type, per_token):
    """tq4 on SmolLM2: 90 key and value vectors × 2 × (32 B of 4-bit codes + an 8-bit scale) = 5,940 B a token (the
    pool's 95,040 B blocks of 16), not a one-token cache's bytes with its fixed state and fp32 sink."""
    plan = plan_json(make_plan(load_spec("smollm2-135m"), rules_for("kvlab"), PlanSettings(context=512, kv_type_k=kv_type)))
    assert plan["kv_bytes_per_token"] == per_token
    if kv_type in ("tq4", "tq-k4v4"):
        assert block_format(kv_type, SMOLLM2, 16).block_bytes == 16 * per_token


def test_the_format_and_the_planners_kvlab_rules_load_no_torch():
    root = Path(__file__).resolve().parents[1]
    code = ("import sys, kvlab.cache, kvlab.cache.format, kvlab.cache.capacity, kvlab.plan.rules.kvlab\n"
            "from kvlab.cache import CacheSpec, CacheGeometry\n"
            "CacheSpec.parse('tq4').bytes(CacheGeometry(30, 3, 64), 512)\n"
            "assert 'torch' not in sys.modules, 'torch loaded'\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(root / "src")})
    assert run.returncode == 0, run.stderr[-2000:]
