"""Compressed block formats (int8, int4, tq4, tq-k3v3, ...) in the serving pool.

The single-sequence reference of a block format is the cache `fmt.cache_name` (int4 blocks of 16 tokens:
int4+g16), and for TurboQuant that cache given the pool's shared calibration (`use_calibration(codec)`;
a plain tq4 cache calibrates on each prompt, which a pool shared by many sequences cannot). With it,
batched greedy tokens equal each sequence's tokens alone, and the pool's attention equals the single
cache's attention on the same K/V stream in any chunking.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from kvlab.cache import CacheGeometry, CacheSpec, compressed, make_cache
from kvlab.cache.tq_codec import TqCodec
from kvlab.cache.turboquant import TurboQuantCache
from kvlab.errors import ConfigError
from kvlab.generate import generate
from kvlab.model.loader import default_model_path
from kvlab.plan.command import build_plan
from kvlab.plan.rules.kvlab import engine_admission
from kvlab.kernels import block_kernel
from kvlab.kernels.paged import tq_attention, tq_pool_layer
from kvlab.serve import Engine, SamplingParams, coded
from kvlab.serve.attention import RaggedLayout
from kvlab.serve.blocks import CapacityPlan
from kvlab.serve.coded import IntPool, TurboPool
from kvlab.serve.formats import block_format
from kvlab.serve.fused_batch import FusedBatchStep
from kvlab.serve.runner import BatchView
from kvlab.serve.sequence import Sequence

from .test_serve_engine import ids_of

#: greedy tokens batched vs alone: the plain formats. +vq and +norms8 blocks are held to the single cache by their attention
#: (random chunks below), not by greedy text: C's and torch's reads differ by ~1e-5 (fp32 order), which flips a block
#: index or an 8-bit scale (4.4% a step) now and then, and a flipped scale of the first token's key moves the logits by
#: more than any near-tie allowance (seen on SmolLM2: the first token of a 41-token prompt parts, gap 1.4 of 29). So are
#: +ropemean blocks (CASES below): the C coder turns each key back by RoPE and forward around the offset in another fp32
#: order than torch's, and a flipped code parts the texts past the allowance on some CPUs (seen on an Intel Xeon: the
#: second token of the 4-token case, gap 0.12 of 19.3)
#: a +halloc recipe for SmolLM2's 30 layers x 3 KV heads (90 units): keys alternate 3 and 5 bits, values 4
HALLOC = "tq-k4v4+prerope+halloc=k" + "35" * 45 + "v" + "4" * 90 + "+sink1"
FORMATS = ["int8", "int4", "tq-k4v4", "tq-k3v3", "tq-k4v4+prerope", "tq-k4v4+prerope+sink1", HALLOC]


def single_cache(engine: Engine, geometry: CacheGeometry):
    """The single-sequence cache that stores and reads tokens as the engine's blocks do."""
    fmt = block_format(engine.capacity.format, geometry, engine.capacity.block_size)
    if fmt.kind == "tq":
        cache = TurboQuantCache(geometry, config=fmt.config)
        cache.use_calibration(engine.pool.codec)
        return cache
    return make_cache(fmt.cache_name, geometry)


def alone(smollm2, engine: Engine, prompt: list[int], max_tokens: int) -> list[int]:
    geometry = CacheGeometry.for_model(smollm2.config, capacity=len(prompt) + max_tokens)
    cache = single_cache(engine, geometry)
    return generate(smollm2.model, torch.tensor([prompt]), cache, max_tokens, eos_ids=smollm2.tokenizer.eos_ids).token_ids[0]


# int4 codes each key channel over 16 tokens from its min and max: on SmolLM2, whose keys have outlier channels, one
# ulp more on every K/V (x (1 + 2^-23) in the modules' own path) moves the next logits by up to 3.4% of their scale
NEAR_TIE = {"int4": 3.5e-2}


def assert_same_greedy_tokens(smollm2, engine: Engine, prompt: list[int], got: list[int], want: list[int],
                              near_tie: float = 5e-3) -> None:
    """`got` (batched) equals `want` (alone), or they part where the alone run's top two logits are a near-tie: within
    `near_tie` of the logits' scale, what one flipped code moves them by (C and torch code a coordinate that close to a
    bucket boundary apart, see test_fused_codes; NEAR_TIE for int4, where the batch's C products and the single
    cache's torch prefill part by fp32 rounding), and every token before it is equal."""
    if got == want:
        return
    at = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    geometry = CacheGeometry.for_model(smollm2.config, capacity=len(prompt) + at + 1)
    with torch.no_grad():
        logits = smollm2.model(torch.tensor([prompt + want[:at]]), single_cache(engine, geometry))[0, -1]   # (V,)
    gap = (logits[want[at]] - logits[got[at]]).item()
    assert abs(gap) <= near_tie * logits.abs().max().item(), (got, want, at, gap)


@pytest.mark.parametrize("name", FORMATS)
def test_batched_tokens_equal_each_sequence_alone_with_that_format(smollm2, name, monkeypatch):
    """Through the pool's C kernels where they build (TurboQuant: one call per layer and step, kernels/paged.c; both
    formats: every layer of a step in one, kernels/batchstep.c)."""
    calls = []
    monkeypatch.setattr(coded, "tq_attention", lambda *a, **kw: calls.append(1) or tq_attention(*a, **kw))
    monkeypatch.setattr(coded, "tq_pool_layer", lambda *a, **kw: calls.append(1) or tq_pool_layer(*a, **kw))   # one call a layer
    step_call = FusedBatchStep.__call__                                                    # or every layer in one call
    monkeypatch.setattr(FusedBatchStep, "__call__", lambda self, *a: calls.append(1) or step_call(self, *a))
    system = ids_of(smollm2, 37)
    cases = [(system + ids_of(smollm2, 4, 60), 4), (ids_of(smollm2, 5, 3), 5), (system + ids_of(smollm2, 11, 80), 3)]
    engine = Engine(smollm2, cache=name, kv_budget="8MiB", max_batch=4, max_step_tokens=24)   # chunked prefill
    first = engine.add_request(cases[0][0], SamplingParams(max_tokens=cases[0][1]))
    tokens: dict[str, list[int]] = {}
    for _ in range(3):                                   # the system prompt's two full blocks get cached
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    rids = [first] + [engine.add_request(p, SamplingParams(max_tokens=n)) for p, n in cases[1:]]
    doomed = engine.add_request(ids_of(smollm2, 20, 7), SamplingParams(max_tokens=20))
    steps, reasons, cached = 0, {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            cached[out.request_id] = out.cached_prompt_tokens
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        steps += 1
        if steps == 2:
            engine.abort(doomed)                          # in its first decodes: its row and blocks go back
    assert reasons[doomed] == "abort" and cached[rids[2]] == 32
    for rid, (prompt, n) in zip(rids, cases):
        assert_same_greedy_tokens(smollm2, engine, prompt, tokens[rid], alone(smollm2, engine, prompt, n),
                                  NEAR_TIE.get(name, 5e-3))
    stats = engine.stats()
    assert stats.blocks_used == 0 and stats.running == 0 and not getattr(engine.pool, "rows", {})
    assert bool(calls) == (block_kernel() is not None)


# -- the pool's attention against the single caches', on random shapes -------------------------------------
def calibrated(geometry: CacheGeometry, config, rng: torch.Generator) -> TqCodec:
    """A codec calibrated (offsets and key weights) on random keys and queries with a common key component."""
    probe = TurboQuantCache(replace(geometry, capacity=32), config=config)
    k = torch.randn(1, geometry.n_kv_heads, 32, geometry.head_dim, generator=rng) + 2.0
    probe.append(0, k, torch.randn(k.shape, generator=rng))
    probe.attend(0, torch.randn(1, geometry.n_heads, 32, geometry.head_dim, generator=rng))
    codec = TqCodec(config, replace(geometry, batch=1), range(geometry.n_layers), 1, "cpu", config.full.sink)  # as calibrated_codec
    codec.take_calibration(probe.codec)
    return codec


CASES = [  # format, block size, query heads, KV heads, sliding window, C path (reads the codes)
    ("int4", 16, 9, 3, None, False), ("int4", 16, 9, 3, None, True), ("int8+g4", 8, 4, 1, None, False),
    ("int8+g4", 8, 4, 1, None, True), ("int3+g8", 16, 2, 2, None, False), ("int4", 8, 4, 1, 7, False),
    ("int4", 8, 4, 1, 7, True), ("tq-k4v4", 16, 9, 3, None, False), ("tq-k4v4", 16, 9, 3, None, True),
    ("tq-k4v4", 8, 4, 1, 9, True), ("tq3.5", 8, 2, 2, None, False), ("tq3.5", 8, 2, 2, None, True),
    ("tq-k4v3+qjl", 16, 9, 3, None, False), ("tq-k4v3+qjl", 16, 4, 1, None, True),
    ("tq-k3v3+vq", 16, 4, 2, None, False), ("tq2.5+vq", 8, 4, 1, 9, True),      # block codes (C decodes block parts)
    ("tq-k4v4+norms8", 16, 4, 2, None, False), ("tq-k3v3+vq+norms8", 8, 9, 3, None, True),   # 8-bit log scales
    # keys coded before RoPE, rebuilt at their positions (Hadamard, Haar: the d x d inverse; key weights off)
    ("tq-k4v4+prerope", 16, 9, 3, None, False), ("tq-k4v4+prerope", 16, 9, 3, None, True), ("tq-k3v3+prerope", 8, 4, 1, 7, True),
    ("tq-k4v4+prerope+rot=haar+kweights=none+norms8", 8, 4, 2, None, True), ("tq-k4v3+qjl+prerope", 16, 4, 2, None, True),
    # the first tokens exact beside the blocks (sinks.py), merged with the coded keys' softmax
    ("tq-k4v4+sink1", 16, 9, 3, None, False), ("tq-k4v4+sink1", 16, 9, 3, None, True), ("tq-k4v4+prerope+sink2", 8, 4, 1, 7, True),
    ("tq-k4v4+prerope+sink2", 8, 4, 1, 7, False),
    # keys after RoPE around their offset turned to each position, read on the codes plus the offset's term
    ("tq-k4v4+ropemean", 16, 9, 3, None, False), ("tq-k4v4+ropemean", 16, 9, 3, None, True),
    ("tq-k3v3+ropemean+sink2+norms8", 8, 4, 1, 7, True), ("tq-k4v4+ropemean+sink1", 16, 4, 2, None, False),
    ("tq-k3v3+prerope+sink1+norms8", 16, 4, 2, None, True), ("tq-k4v3+qjl+sink3", 8, 4, 2, None, True),
    # a width per KV head (+halloc): the heads' codes side by side in a token's row, each read with its own layout
    ("tq-k4v4+halloc=k354v444", 16, 9, 3, None, False), ("tq-k4v4+halloc=k354v444", 16, 9, 3, None, True),
    ("tq-k3v3+prerope+sink1+halloc=k24v33+vq+norms8", 8, 4, 2, 7, True), ("tq-k3v2.95+halloc=k3v2", 8, 2, 1, None, True),
    ("tq-k4v4+alloc=k5v3", 16, 4, 2, None, True),                             # a width per layer
    # each key's largest entries kept exactly beside its codes (before RoPE with +prerope)
    ("tq-k4v4+outliers2", 16, 9, 3, None, False), ("tq-k4v4+outliers2", 16, 9, 3, None, True),
    ("tq-k4v3+prerope+outliers1+sink1", 8, 4, 1, 7, True), ("tq-k4v4+qjl+outliers1", 8, 4, 2, None, True),
    ("tq-k4v4+ropemean+qjl+sink1", 8, 4, 2, 7, True),
    # 16-row blocks read from their codes in registers, the keys' 3-bit half in blocks of 4 coordinates (+vq)
    ("tq-k3.5v3+ropemean+vq+norms8", 16, 9, 3, None, True),
]
#: RoPE frequencies of a head dim of 16 (+prerope needs the model's)
INV_FREQ = tuple(10000.0 ** (-i / 8) for i in range(8))


@pytest.mark.parametrize("seed,case", list(enumerate(CASES)))
def test_pool_attention_equals_the_single_cache_on_random_chunks(seed, case):
    name, block_size, heads, kv_heads, window, use_kernel = case
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    geometry = CacheGeometry(n_layers=1, n_kv_heads=kv_heads, head_dim=16, n_heads=heads, capacity=64, window=window,
                             rope_inv_freq=INV_FREQ)
    plan = CapacityPlan.build(geometry, name, 10**9, block_size, max_batch=4)
    plan = replace(plan, n_blocks=24)
    fmt = block_format(name, geometry, block_size)
    if fmt.kind == "tq":
        codec = calibrated(geometry, fmt.config, gen)
        pool = TurboPool(geometry, plan, fmt, codec)
    else:
        pool = IntPool(geometry, plan, fmt)
    lengths = [rng.randint(1, 40) for _ in range(3)]
    free = list(range(plan.n_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lengths]
    singles = []
    for _ in lengths:
        if fmt.kind == "tq":
            cache = TurboQuantCache(geometry, config=fmt.config)
            cache.use_calibration(codec)
            if not use_kernel:   # the pool's torch path against the single cache's: both code and read in torch
                cache.code_kernel = None
        else:
            cache = make_cache(fmt.cache_name, geometry)
        singles.append(cache)
    same_read = use_kernel and fmt.kind == "int" and singles[0].code_kernel is not None   # int8 / int4 on CPU
    done = [0] * len(lengths)
    seqs = [Sequence(str(i), [100 + i]) for i in range(len(lengths))]   # first tokens apart: a sink entry each
    while any(d < n for d, n in zip(done, lengths)):
        active = [s for s in range(len(lengths)) if done[s] < lengths[s]]
        chunk = {s: min(lengths[s] - done[s], rng.choice([1, 1, rng.randint(1, 2 * block_size)])) for s in active}
        layout = RaggedLayout.build([tables[s] for s in active], [chunk[s] for s in active],
                                    [done[s] + chunk[s] for s in active], block_size)
        slots = torch.cat([layout.slots(i)[done[s]:] for i, s in enumerate(active)])
        k = torch.randn(len(slots), kv_heads, 16, generator=gen) + 2.0       # (N, Hkv, D) with a common component
        v = torch.randn(len(slots), kv_heads, 16, generator=gen)
        q = torch.randn(len(slots), heads, 16, generator=gen)               # (N, H, D)
        view = BatchView(pool, slots, layout, 16 ** -0.5, window, use_kernel, pool.rows_for([seqs[s] for s in active]))
        pool.append(0, view, k, v)
        out = pool.attend(0, view, q)                                        # (N, H, D)
        at = 0
        for s in active:
            rows = slice(at, at + chunk[s])
            singles[s].append(0, k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None])
            expected = singles[s].attend(0, q[rows].transpose(0, 1)[None])[0].transpose(0, 1)
            if same_read:   # both read through kernels/intcache.h's one function: the same bits
                assert torch.equal(out[rows], expected), (out[rows] - expected).abs().max()
            else:
                torch.testing.assert_close(out[rows], expected, atol=2e-5, rtol=1e-4)
            at += chunk[s]
            done[s] += chunk[s]


# -- bytes ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,per_head_token", [
    ("int8", 64 + 64 * 4 / 16 + 64 + 4 * 4),            # codes, fp16 scale+zero per channel per 16 tokens; values per 16 channels
    ("int4", 32 + 64 * 4 / 16 + 32 + 4 * 4),
    ("int4+g8", 32 + 64 * 4 / 8 + 32 + 8 * 4),
    ("tq-k4v4", 32 + 2 + 32 + 2),                           # codes + a 16-bit norm per vector
    ("tq-k3v3", 24 + 2 + 24 + 2),
    ("tq-k4v3", 32 + 2 + 24 + 2),
    ("tq-k4v4+halloc=k" + "35" * 45 + "v" + "4" * 90, 32 + 2 + 32 + 2),   # SmolLM2's 90 units: any recipe, the same bytes
])
def test_pool_bytes_are_blocks_times_the_formula(smollm2, name, per_head_token):
    engine = Engine(smollm2, cache=name, kv_budget="6MiB", max_batch=3)
    cap, cfg = engine.capacity, smollm2.config
    assert cap.block_bytes == cfg.n_layers * cfg.n_kv_heads * 16 * per_head_token
    assert engine.pool.nbytes == cap.pool_bytes <= cap.budget < cap.pool_bytes + cap.block_bytes
    assert engine.pool.nbytes == cap.n_blocks * cap.block_bytes + cap.shared_bytes + 3 * cap.sequence_bytes
    # one sequence of 4 blocks in the single cache holds 4 blocks + the per-sequence and shared state
    geometry = CacheGeometry.for_model(cfg, capacity=64)
    assert single_cache(engine, geometry).nbytes == 4 * cap.block_bytes + cap.shared_bytes + cap.sequence_bytes
    base = CacheSpec.parse(name).base
    assert (cap.shared_bytes == 0) == (base == "int") and (cap.sequence_bytes == 0) == (base == "tq")



@pytest.mark.parametrize("seed,case", [(s, c) for s, c in enumerate(CASES) if CacheSpec.parse(c[0]).base == "int" and c[5]])
def test_long_chunks_of_an_int_cache_read_as_the_pool_reads(seed, case, monkeypatch):
    """The same run with the blocks of a long chunk (ATTEND_ROWS x ATTEND_KEYS) shrunk so that these chunks count as
    long: a single int8 / int4 cache reads them through the C read too, not in spans, so its output stays the pool's
    to the bit."""
    monkeypatch.setattr(compressed, "ATTEND_ROWS", 4)
    monkeypatch.setattr(compressed, "ATTEND_KEYS", 8)
    test_pool_attention_equals_the_single_cache_on_random_chunks(seed, case)

def test_an_engine_given_the_loaded_model_spells_out_its_recipe(smollm2, monkeypatch):
    """`tq4+halloc` names the recipe calibrated for the model: the engine asks eval/calibrate.resolve for it (stubbed
    here: the pass takes a minute) before it sizes the pool, whose codec then codes each head at its width."""
    from kvlab.quality import calibrate

    asked = []
    monkeypatch.setattr(calibrate, "resolve", lambda name, loaded: asked.append((name, loaded)) or HALLOC)
    engine = Engine(smollm2, cache="tq-k4v4+prerope+sink1+halloc", kv_budget="6MiB", max_batch=2)
    assert asked == [("tq-k4v4+prerope+sink1+halloc", smollm2)] and engine.capacity.format == HALLOC
    assert engine.pool.codec.recipe[0].tolist() == [[3, 4], [5, 4], [3, 4]]                    # layer 0: (key, value) per head
    blocks = engine.pool.blocks
    assert [tuple(blocks.buffers["k_codes"][layer].shape) for layer in (0, 1)] == [
        (blocks.n_blocks, 1, blocks.block_size, 24 + 40 + 24), (blocks.n_blocks, 1, blocks.block_size, 40 + 24 + 40)]
    with pytest.raises(ConfigError, match="no recipe yet") as err:                             # a bare model: nothing to calibrate
        Engine(smollm2.model, smollm2.tokenizer, cache="tq-k4v4+halloc", kv_budget="6MiB", max_batch=2)
    assert "\n" not in str(err.value)


def test_planner_admission_is_the_engines_and_tq4_holds_3_5x_the_f16_sequences(smollm2):
    admitted = {}
    for name in ("dense-f16", "tq-k4v4"):
        plan = build_plan(str(default_model_path()), ctx=4096, kv_type=name, engine="kvlab")
        planned = engine_admission(plan.spec, plan.settings, "256MiB")
        engine = Engine(smollm2, cache=name, kv_budget="256MiB", max_batch=16, max_step_tokens=16 * 4096)
        assert planned["blocks"] == engine.capacity.n_blocks and planned["max_concurrent"] == engine.capacity.max_concurrent(4096)
        for i in range(planned["max_concurrent"] + 1):
            engine.add_request([(7 * i + j) % 500 + 10 for j in range(4095)], SamplingParams(max_tokens=1, ignore_eos=True))
        engine.scheduler.schedule()                      # admission only: the blocks are reserved, nothing runs
        assert len(engine.scheduler.running) == planned["max_concurrent"] and len(engine.scheduler.waiting) == 1
        admitted[name] = len(engine.scheduler.running)
    assert admitted["tq-k4v4"] >= 3.5 * admitted["dense-f16"] > 0


@pytest.mark.parametrize("name,match", [("tq-k4v4+recent8", "tq-k4v4\\+recent8.*full-precision.*hold \\+sinkN"),
                                        ("int4+sink1", "int4\\+sink1.*full-precision"), ("tq-k4v4+sink17", "sink of 17 tokens"),
                                        ("int4+recent64", "int4\\+recent64"),
                                        ("int4+g32", "must divide the block size"), ("zip9", "unknown block format 'zip9'")])
def test_formats_the_pool_cannot_hold_are_one_line_errors(smollm2, name, match):
    with pytest.raises(ConfigError, match=match) as info:
        Engine(smollm2, cache=name, kv_budget="4MiB")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["tq-k4v4", "tq-k4v4+prerope", "tq4"])
def test_pools_calibrate_on_text_in_the_chat_template_and_answer_like_dense(smollm2, name):
    """The shared calibration runs on prose as a chat message (coded.CALIBRATION_TEXT), so it opens as served chats
    open; on fixed ids spread over the vocabulary a tq4+prerope pool answered this question with noise."""
    tok = smollm2.tokenizer
    ids = coded.calibration_ids(smollm2.config.vocab_size, tok)
    opening = tok.encode(tok.apply_chat_template([{"role": "user", "content": "x"}]), add_special=False)[:5]
    assert len(ids) == coded.CALIBRATION_TOKENS and ids[:5] == opening
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]), add_special=False)
    engine = Engine(smollm2, cache=name, kv_budget="16MiB", max_batch=2)
    outputs = engine.generate([prompt], SamplingParams(max_tokens=8), progress=False)
    assert "Paris" in outputs[0].text
