"""The engine's fused batch step (one C call per step, kernels/batchstep.c) equals the module path.

Every step of a whole engine run is computed both ways from the same pool state: the rows' logits and the K/V
written to the pool agree to fp32 rounding (GQA, MQA, MHA, head norms, q/k/v bias, a sliding window, f16/bf16
blocks, GGUF-block weights, int8 activations); greedy tokens equal each sequence's tokens generated alone; the
fused rows are bit-identical for any thread count; bad buffers and layouts are one-line errors that write nothing.
"""

from __future__ import annotations

import gc
import random
import weakref

import pytest
import torch

from kvlab.cache import CacheGeometry, make_cache
from kvlab.errors import ConfigError
from kvlab.generate import generate
from kvlab.model.blockquant import GEMM_MAX_ROWS, set_activations
from kvlab.model.fused import fused_decode_step, fused_step_off
from kvlab.serve import Engine, SamplingParams
from kvlab.serve.attention import RaggedLayout
from kvlab.serve.coded import IntPool
from kvlab.serve.fused_batch import FusedBatchStep, fused_batch_for, fused_batch_off

from .conftest import tiny_model
from .kernel_checks import one_thread, require_kernel  # noqa: F401  (one_thread: autouse)
from .test_fused_decode import CONFIGS, quantize_matrices   # the fused decode step's model set-ups, shared
from .test_serve_engine import alone, ids_of, run_all

PROMPT_LENGTHS = (1, 5, 9, 14, 23)          # odd lengths across blocks of 4 tokens


@pytest.fixture(scope="module", autouse=True)
def kernel():
    return require_kernel()


def fused_model(seed: int = 0, **config):
    """A tiny random decoder with its fused decode step installed (the batch step reads its weight structs)."""
    model = tiny_model(seed, **config)
    model.fused = fused_decode_step(model)
    assert model.fused is not None
    return model


def prompts_of(seed: int, lengths=PROMPT_LENGTHS, vocab: int = 97) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def compare_every_step(engine: Engine, rel: float, pool_rel: float) -> list[int]:
    """Make engine.step() run each step both ways from the same pool state and compare logits and pool contents;
    the run continues with the module path's rows. Returns the row count of every step (all fused)."""
    runner, pool, model = engine.runner, engine.pool, engine.model
    rows_per_step: list[int] = []

    @torch.inference_mode()
    def run(chunks):
        n = sum(c.n_tokens for c in chunks)
        assert fused_batch_for(runner, n) is not None, f"a step of {n} rows did not take the fused path"
        k0, v0 = pool.k.clone(), pool.v.clone()
        with fused_batch_off(runner):
            want = runner.hidden(chunks)                                       # (1, N, C)
        want_k, want_v = pool.k.clone(), pool.v.clone()
        pool.k.copy_(k0)
        pool.v.copy_(v0)
        got = runner.hidden(chunks)                                            # (1, N, C)
        want_logits, got_logits = model.logits(want), model.logits(got)
        scale = want_logits.abs().max().item()
        assert (got_logits - want_logits).abs().max().item() <= rel * scale + 1e-6, f"step of {n} rows"
        for got_kv, want_kv in ((pool.k, want_k), (pool.v, want_v)):
            atol = pool_rel * want_kv.float().abs().max().item()
            assert (got_kv.float() - want_kv.float()).abs().max().item() <= atol
        rows_per_step.append(n)
        return runner.sample(chunks, want)

    runner.run = run
    engine.generate(prompts_of(0), [SamplingParams(max_tokens=n) for n in (7, 3, 9, 5, 4)], progress=False)
    return rows_per_step


@pytest.mark.parametrize("kind", CONFIGS)
def test_every_step_equals_the_modules(kind):
    """Prefill chunks and decodes of five sequences of different lengths, blocks of 4 tokens."""
    engine = Engine(fused_model(**CONFIGS[kind]), kv_budget="1MiB", block_size=4, max_batch=4, max_step_tokens=11)
    rows = compare_every_step(engine, rel=1e-5, pool_rel=1e-5)
    assert 1 in rows and max(rows) == 11                                       # lone decodes and mixed stacks


@pytest.mark.parametrize("cache", ["dense-f16", "dense-bf16"])
def test_16_bit_blocks_equal_the_modules(cache):
    """K/V rounded to the pool's dtype as torch rounds them (an fp32 ulp apart before rounding can land one 16-bit
    step apart, hence the tolerances)."""
    engine = Engine(fused_model(n_heads=4, n_kv_heads=2), cache=cache, kv_budget="1MiB", block_size=4, max_batch=5,
                    max_step_tokens=16)
    compare_every_step(engine, rel=2e-4, pool_rel=4e-3)


@pytest.mark.parametrize("block_type", ["Q4_0", "Q4_1", "Q8_0"])
def test_block_weights_equal_the_modules(block_type):
    """Matrices as GGUF blocks (rows of 2 to 17 blocks) through the block GEMM, and int8 activations (q8gemm.c,
    from 8 rows on) where the model asks for them: the same choice of kernel as BlockQuantLinear."""
    model = tiny_model(n_heads=4, n_kv_heads=2, d_model=64, d_ff=544, qkv_bias=True, tie_embeddings=False)
    quantize_matrices(model, block_type)
    model.fused = fused_decode_step(model)
    engine = Engine(model, kv_budget="1MiB", block_size=4, max_batch=4, max_step_tokens=11)
    compare_every_step(engine, rel=1e-5, pool_rel=1e-5)
    set_activations(model, "int8")
    engine = Engine(model, kv_budget="1MiB", block_size=4, max_batch=4, max_step_tokens=11)
    rows = compare_every_step(engine, rel=5e-3, pool_rel=5e-3)   # int8 activations: an ulp apart, a code may flip
    assert max(rows) >= 8


def test_greedy_tokens_equal_each_sequence_alone_on_a_tiny_model():
    model = fused_model(1, n_heads=4, n_kv_heads=1, max_seq_len=64)
    prompts = prompts_of(1, (3, 17, 8, 30, 1, 12))
    counts = (9, 4, 12, 6, 10, 7)
    calls = []
    step_call = FusedBatchStep.__call__
    engine = Engine(model, kv_budget="1MiB", block_size=4, max_batch=4, max_step_tokens=12)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(FusedBatchStep, "__call__", lambda self, *a: calls.append(1) or step_call(self, *a))
        outputs = engine.generate(prompts, [SamplingParams(max_tokens=n) for n in counts], progress=False)
    assert len(calls) == engine.stats().steps                                 # every step fused
    for prompt, n, out in zip(prompts, counts, outputs):
        geometry = CacheGeometry.for_model(model.config, capacity=len(prompt) + n)
        assert out.token_ids == generate(model, torch.tensor([prompt]), make_cache("dense", geometry), n).token_ids[0]


def test_smollm2_greedy_tokens_equal_each_sequence_alone(smollm2):
    """The real model (GGUF Q4_1 blocks, 30 layers, 9 / 3 heads): four sequences decoding together."""
    cases = [(ids_of(smollm2, 5), 6), (ids_of(smollm2, 19, 4), 8), (ids_of(smollm2, 33, 9), 5), (ids_of(smollm2, 12, 2), 7)]
    engine = Engine(smollm2, kv_budget="16MiB", max_batch=4, max_step_tokens=GEMM_MAX_ROWS)
    calls = []
    step_call = FusedBatchStep.__call__
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(FusedBatchStep, "__call__", lambda self, *a: calls.append(1) or step_call(self, *a))
        tokens = run_all_added(engine, cases)
    assert len(calls) == engine.stats().steps
    for (prompt, n), got in zip(cases, tokens):
        assert got == alone(smollm2, prompt, n)


def run_all_added(engine: Engine, cases) -> list[list[int]]:
    ids = [engine.add_request(prompt, SamplingParams(max_tokens=n)) for prompt, n in cases]
    tokens = run_all(engine)
    return [tokens[i] for i in ids]


def test_fused_rows_are_the_same_for_any_thread_count():
    """Products split weight rows, attention splits (row, KV head) items, the row work splits rows: bit-identical."""
    model = fused_model(2, n_heads=4, n_kv_heads=2)
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            engine = Engine(model, kv_budget="1MiB", block_size=4, max_batch=4, max_step_tokens=11)
            rows = []
            step_call = engine.runner.hidden
            engine.runner.hidden = lambda chunks: rows.append(step_call(chunks)) or rows[-1]
            engine.generate(prompts_of(2), SamplingParams(max_tokens=6), progress=False)
            runs.append(rows)
    finally:
        torch.set_num_threads(threads)
    assert len(runs[0]) == len(runs[1]) and all(torch.equal(a, b) for a, b in zip(*runs))


@torch.inference_mode()
def one_step(model, n_tokens: int = 3):
    """An engine that has prefilled one sequence, and the next decode step's inputs (the batch step's arguments)."""
    engine = Engine(model, kv_budget="1MiB", block_size=4, max_batch=2, max_step_tokens=8)
    engine.add_request(list(range(1, n_tokens + 1)), SamplingParams(max_tokens=4))
    engine.step()
    (chunk,) = engine.scheduler.schedule()
    layout = RaggedLayout.build([chunk.seq.block_table], [1], [chunk.start + 1], engine.pool.block_size)
    x = model.embed(torch.tensor([[chunk.seq.token_ids[-1]]]))
    cos, sin = model.rope_at(torch.tensor([chunk.start]), torch.float32)
    return engine, fused_batch_for(engine.runner, 1), (x, cos, sin, engine.pool, layout, engine.runner.scale, None)


@torch.inference_mode()
def test_bad_buffers_and_layouts_are_one_line_errors_that_write_nothing():
    model = fused_model(3)
    engine, step, args = one_step(model)
    x, cos, sin, pool, layout, scale, window = args
    before_k, before_v = pool.k.clone(), pool.v.clone()
    table = layout.block_tables
    bad_layouts = {
        "block id": RaggedLayout(layout.query_start, layout.context_len, torch.full_like(table, pool.plan.n_blocks), 4),
        "negative block id": RaggedLayout(layout.query_start, layout.context_len, torch.full_like(table, -1), 4),
        "context past the table": RaggedLayout(layout.query_start, layout.context_len + 4 * table.shape[1], table, 4),
        "rows past the context": RaggedLayout(torch.tensor([0, 1], dtype=torch.int32), torch.zeros(1, dtype=torch.int32), table, 4),
    }
    for name, bad in bad_layouts.items():
        with pytest.raises(ConfigError, match="refused") as err:
            step(x, cos, sin, pool, bad, scale, window)
        assert "\n" not in str(err.value), name
    bad_args = {
        "rows": (x[:, :, :-1], cos, sin, pool, layout),
        "rope cos": (x, cos.double(), sin, pool, layout),
        "rope sin": (x, cos, sin.t(), pool, layout),
        "query_start": (x, cos, sin, pool, RaggedLayout(layout.query_start.long(), layout.context_len, table, 4)),
        "block_tables": (x, cos, sin, pool, RaggedLayout(layout.query_start, layout.context_len, table.long(), 4)),
        "context_len": (x, cos, sin, pool, RaggedLayout(layout.query_start, layout.context_len.long(), table, 4)),
    }
    for name, call in bad_args.items():
        with pytest.raises(ConfigError, match=name) as err:
            step(*call, scale, window)
        assert "\n" not in str(err.value)
    for name, swap in (("pool keys", "k"), ("pool values", "v")):
        saved = getattr(pool, swap)
        setattr(pool, swap, saved[:, :-4])                                    # not the pool's slot count
        with pytest.raises(ConfigError, match=name):
            step(x, cos, sin, pool, layout, scale, window)
        setattr(pool, swap, saved)
    with pytest.raises(ConfigError, match="window"):
        step(x, cos, sin, pool, layout, scale, -1)
    assert torch.equal(pool.k, before_k) and torch.equal(pool.v, before_v)
    out = step(*args)                                                         # the good call still runs
    assert out.shape == x.shape and not torch.equal(pool.k, before_k)


def test_when_the_fused_step_applies(monkeypatch):
    model = fused_model(4)
    engine, step, _ = one_step(model)
    runner = engine.runner
    assert fused_batch_for(runner, 1) is None                                 # autograd on: the modules
    with torch.inference_mode():
        assert isinstance(step, FusedBatchStep) and step is fused_batch_for(runner, GEMM_MAX_ROWS)
        assert fused_batch_for(runner, GEMM_MAX_ROWS + 1) is None              # prompt chunks: torch's GEMM is faster
        with fused_batch_off(runner):
            assert fused_batch_for(runner, 1) is None
        assert fused_batch_for(runner, 1) is step
        with fused_step_off(model):                                           # no decode step: no weight structs
            assert fused_batch_for(runner, 1) is None
        monkeypatch.setenv("KVLAB_NO_FUSED_BATCH", "1")
        assert fused_batch_for(runner, 1) is None
        monkeypatch.delenv("KVLAB_NO_FUSED_BATCH")
        assert fused_batch_for(Engine(model, kv_budget="1MiB", use_kernel=False).runner, 1) is None
        coded = Engine(model, cache="int8", kv_budget="1MiB").runner                # integer blocks: in C ...
        assert fused_batch_for(coded, 1) is step
        monkeypatch.setattr(IntPool, "_codes_in_c", lambda self: False)        # ... where the pool's C coder takes them
        assert fused_batch_for(Engine(model, cache="int8", kv_budget="1MiB").runner, 1) is None
    model.double()                                                            # cast buffers drop model.fused
    with torch.inference_mode():
        assert fused_batch_for(runner, 1) is None


def test_a_dropped_model_takes_its_batch_step_with_it():
    model = fused_model(5)
    engine, step, args = one_step(model)
    gone = weakref.ref(step)
    del engine, step, args, model
    gc.collect()
    assert gone() is None
