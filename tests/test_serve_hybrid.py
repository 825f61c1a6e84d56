"""The serving engine runs Gemma 3 (sliding + full attention) and Qwen3.5 (Gated DeltaNet + gated attention).

Tiny seeded models from transformers' classes (hybrid_models.py), fp32, greedy: each request's tokens served in a
batch equal the tokens of the torch path run on it alone (LayeredCache), across prefill chunks, preemption, abort and
prefix hits. A hypothesis state machine drives the block manager with a sliding group that frees blocks behind its
window and the recurrent state slots: nothing leaks, and every sequence reads only its own tokens and state. The
planner's --engine kvlab bytes equal the running caches' nbytes and the engine's pool bytes.
"""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvlab.cache import CacheGeometry
from kvlab.cache.capacity import CapacityPlan, LayerGroups
from kvlab.errors import ConfigError
from kvlab.model.config import DecoderConfig
from kvlab.model.layer_caches import LayeredCache, model_cache
from kvlab.model.loader import load_model
from kvlab.plan import PlanSettings, make_plan, rules_for
from kvlab.plan.report import plan_json
from kvlab.plan.rules.kvlab import engine_admission
from kvlab.serve.blocks import NO_BLOCK, BlockManager, BlockPool
from kvlab.serve.engine import Engine
from kvlab.serve.sampling import SamplingParams
from kvlab.serve.sequence import Sequence
from kvlab.serve.state_slots import StateSlots
from kvlab.sources import load_spec
from kvlab.spec import LinearAttentionFacts

from .hybrid_models import WINDOW, build, save_folder

ARCHS = ("qwen3_5", "gemma3")
NEW = 10


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are a few kilobytes a layer: one thread runs them faster than two on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=ARCHS)
def loaded(request, smollm2, tmp_path_factory):
    reference = build(request.param, smollm2.tokenizer.vocab_size)
    return load_model(save_folder(reference, tmp_path_factory.mktemp(request.param), smollm2.tokenizer))


def alone(loaded, prompt: list[int], n: int = NEW, cache_name: str = "dense") -> list[int]:
    """Greedy tokens of the torch path (one LayeredCache of `cache_name`), the reference every batched run must equal."""
    cache = model_cache(loaded.config, cache_name, capacity=len(prompt) + n)
    out = []
    with torch.no_grad():
        logits = loaded.model(torch.tensor([prompt]), cache)
        for _ in range(n):
            out.append(int(logits[0, -1].argmax()))
            logits = loaded.model(torch.tensor([[out[-1]]]), cache)
    return out


def prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 5000, (n,), generator=g).tolist() for n in lengths]


GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


def step(engine: Engine, tokens: dict[str, list[int]]) -> None:
    for out in engine.step():
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)


def assert_all_given_back(engine: Engine) -> None:
    assert engine.blocks.n_free == engine.blocks.n_blocks
    assert engine.state is None or (engine.state.n_used == 0 and len(engine.state.slots.free) == engine.scheduler.max_batch)


def run_with_preemption_and_abort(loaded, cache: str, batch: list[list[int]]) -> tuple[Engine, dict, list[str], str]:
    """The batch served in a pool where the longest prompt fits but several do not (a preemption), one sequence
    aborted while decoding: (engine, tokens by request, request ids, the aborted one)."""
    sizes = Engine(loaded, cache=cache, kv_budget="64MiB", max_batch=4, block_size=8, max_step_tokens=24).capacity
    longest = sizes.blocks_for(max(map(len, batch)) + NEW)
    budget = sizes.fixed_bytes + (longest + 1) * sizes.block_bytes     # the longest fits; several do not
    engine = Engine(loaded, cache=cache, kv_budget=budget, max_batch=4, block_size=8, max_step_tokens=24)
    assert engine.pool_nbytes == engine.capacity.pool_bytes
    ids = [engine.add_request(p, GREEDY) for p in batch]
    tokens: dict[str, list[int]] = {}
    while not engine.scheduler.preemptions:
        assert engine.has_unfinished()
        step(engine, tokens)
    running = engine.scheduler.running[-1].request_id
    engine.abort(running)                                           # while decoding: its blocks and state slot go
    while engine.has_unfinished():
        step(engine, tokens)
    assert_all_given_back(engine)
    return engine, tokens, ids, running


def test_batched_equals_alone_across_chunks_preemption_and_abort(loaded):
    batch = prompts(1, (5, 40, 23, 70, 33, 9))
    _, tokens, ids, running = run_with_preemption_and_abort(loaded, "dense", batch)
    for rid, p in zip(ids, batch):
        if rid != running:
            assert tokens[rid] == alone(loaded, p), rid


@pytest.mark.parametrize("cache", ["int8", "int4"])
def test_int_blocks_batched_equal_the_torch_path_alone(loaded, cache):
    """int8 / int4 blocks (each layer group's layers keep their own open key group per sequence): the tokens equal the
    torch path's alone with the blocks' cache (int8+g8: the key group is the block), across preemption and abort."""
    batch = prompts(1, (5, 40, 23, 70, 33, 9))
    engine, tokens, ids, running = run_with_preemption_and_abort(loaded, cache, batch)
    assert engine.capacity.format == f"{cache}+g8" and engine.scheduler.preemptions
    for rid, p in zip(ids, batch):
        if rid != running:
            assert tokens[rid] == alone(loaded, p, cache_name=engine.capacity.format), rid


def test_prefix_hits_are_served_or_switched_off_with_the_reason(loaded):
    shared = prompts(2, (48,))[0]
    first = [shared + p for p in prompts(3, (5, 12))]
    second = [shared + p for p in prompts(4, (7, 20))] + [shared[:30]]
    engine = Engine(loaded, kv_budget="4MiB", max_batch=4, block_size=8, max_step_tokens=16)
    for group in (first, second):
        outs = engine.generate(group, GREEDY, progress=False)
        assert [o.token_ids for o in outs] == [alone(loaded, p) for p in group]
    stats = engine.stats()
    if loaded.config.layers_of("recurrent"):
        assert stats.prefix_hit_tokens == 0 and "recurrent" in engine.prefix_caching_off
    else:                                  # the sliding blocks near each hit were freed behind the window, then found
        assert engine.prefix_caching_off is None and stats.prefix_hit_tokens >= 3 * 40
        assert engine.groups.freeing
    assert_all_given_back(engine)


def test_choices_forked_after_the_prompt_go_on_from_its_state(loaded):
    """n = 2: the second choice shares the prompt's blocks and a copy of its recurrent state."""
    prompt = prompts(6, (30,))[0]
    engine = Engine(loaded, kv_budget="4MiB", max_batch=4, block_size=8)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, n=2))
    tokens: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == rid
            tokens.setdefault(out.index, []).extend(out.new_token_ids)
    assert tokens[0] == tokens[1] == alone(loaded, prompt)
    assert_all_given_back(engine)


def test_sliding_groups_hold_their_window_only(loaded):
    """A long Gemma 3 sequence: its sliding group keeps at most window_blocks blocks, its full group all of them;
    with window freeing off one table holds every layer, and the same budget admits fewer sequences."""
    if not loaded.config.layers_of("sliding"):
        pytest.skip("no sliding layers")
    engine = Engine(loaded, kv_budget="4MiB", max_batch=2, block_size=4, max_step_tokens=8)
    seq_id = engine.add_request(prompts(5, (60,))[0], GREEDY)
    cap = engine.capacity.window_blocks(WINDOW)
    while engine.has_unfinished():
        engine.step()
        for seq in engine.requests.get(seq_id, []):
            (sliding,) = seq.group_tables
            assert sum(b != NO_BLOCK for b in sliding) <= cap
            assert all(b == NO_BLOCK for b in sliding[:engine.blocks.first_needed(seq.num_computed, WINDOW)])
            assert NO_BLOCK not in seq.block_table
    off = Engine(loaded, kv_budget="4MiB", max_batch=2, block_size=4, max_step_tokens=8, free_window=False)
    assert len(off.groups.members) == 1 and off.capacity.max_concurrent(400) < engine.capacity.max_concurrent(400)


@pytest.mark.parametrize("cache", ["tq-k4v4", "tq-k4v3+qjl+outliers1"])
def test_turboquant_blocks_batched_equal_each_sequence_alone(loaded, cache):
    """TurboQuant blocks (+qjl's sketches and +outliersN's entries too): one codec over every layer group, calibrated
    through the model's own cache; each request's tokens equal its tokens served alone (the same calibration), across
    preemption and abort."""
    batch = prompts(1, (5, 40, 23, 70, 33, 9))
    _, tokens, ids, running = run_with_preemption_and_abort(loaded, cache, batch)
    one = Engine(loaded, cache=cache, kv_budget="4MiB", max_batch=1, block_size=8, max_step_tokens=24)
    for rid, p in zip(ids, batch):
        if rid != running:
            assert tokens[rid] == one.generate([p], GREEDY, progress=False)[0].token_ids, rid


@pytest.mark.parametrize("cache", ["tq4", "tq-k4v4+sink1", "tq-k4v4+prerope"])
def test_turboquant_blocks_per_pool_layer_are_refused_in_one_line(loaded, cache):
    with pytest.raises(ConfigError, match="without \\+prerope, \\+sinkN or \\+alloc") as err:
        Engine(loaded, cache=cache, kv_budget="4MiB")
    assert "\n" not in str(err.value)


def test_the_kv_store_refuses_what_it_cannot_restore_in_one_line(loaded, tmp_path):
    """The store keeps one block table per sequence: recurrent state and a second layer group are refused."""
    why = "recurrent" if loaded.config.layers_of("recurrent") else "layer groups"
    with pytest.raises(ConfigError, match=why) as err:
        Engine(loaded, kv_budget="4MiB", kv_store=str(tmp_path / "store"))
    assert "\n" not in str(err.value)


def test_plan_bytes_equal_running_nbytes_and_pool_bytes(loaded):
    """--engine kvlab: layer by layer the bytes a LayeredCache holds (each cache format); --kv-budget: the pool."""
    spec = load_spec(str(loaded.path))
    cfg = loaded.config
    for name, dtype in (("dense", "f32"), ("dense", "f16"), ("int8", "f32"), ("tq-k4v4", "f32")):
        for context, batch in ((40, 1), (300, 2)):
            plan = make_plan(spec, rules_for("kvlab"), PlanSettings(context=context, parallel=batch, kv_type_k=f"{name}@{dtype}"))
            torch_dtype = {"f32": torch.float32, "f16": torch.float16}[dtype]
            cache = LayeredCache(cfg, name, batch, context, torch_dtype)
            assert plan_json(plan)["kv_bytes"] + plan_json(plan)["recurrent_bytes"] == cache.nbytes
            per_layer = {i: 0 for i in range(cfg.n_layers)}
            for part, layers in cache.parts:
                for i in layers:
                    per_layer[i] = part.nbytes // len(layers)
            for i in cfg.layers_of("recurrent"):
                per_layer[i] = cache.state_nbytes // len(cfg.layers_of("recurrent"))
            planned = {row.index: row.k_bytes + row.v_bytes + row.state_bytes for row in plan.layout.layers}
            assert planned == per_layer or sum(planned.values()) == sum(per_layer.values()) and name != "dense"
    for budget, cache in (("1MiB", "dense"), ("3MiB", "dense"), ("1MiB", "int8"), ("3MiB", "int4"),
                          ("1MiB", "tq-k4v4")):
        admission = engine_admission(spec, PlanSettings(context=1000, kv_type_k=cache), budget)
        engine = Engine(loaded, cache=cache, kv_budget=budget)
        assert admission["format"] == engine.capacity.format
        assert admission["pool_bytes"] == engine.capacity.pool_bytes == engine.pool_nbytes
        assert admission["blocks"] == engine.capacity.n_blocks
        assert admission["max_concurrent"] == engine.capacity.max_concurrent(1000)


# -- the block manager with a sliding group and state slots, under random operations ----------------------------------
BLOCK, SLIDE, N_BLOCKS, MAX_SEQS, STEP = 4, 6, 24, 5, 8
GROUPS = LayerGroups.build(("sliding", "full", "recurrent"), SLIDE)            # group 0 full, group 1 sliding
GEOMETRY = CacheGeometry(n_layers=GROUPS.size, n_kv_heads=1, head_dim=2)
TINY = DecoderConfig(vocab_size=8, d_model=8, n_layers=3, n_heads=1, n_kv_heads=1, d_ff=8, head_dim=2, arch="qwen3_5",
                     layer_kinds=("sliding", "full", "recurrent"), sliding_window=SLIDE, rope_dim=2,
                     linear=LinearAttentionFacts(k_heads=1, v_heads=1, k_dim=2, v_dim=2, conv_kernel=2))
tokens = st.lists(st.integers(0, 2), min_size=1, max_size=20)


class HybridBlockMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        one = CapacityPlan.build(GEOMETRY, "dense", 1 << 20, BLOCK, MAX_SEQS, GROUPS, step_tokens=STEP)
        self.plan = CapacityPlan.build(GEOMETRY, "dense", one.block_bytes * N_BLOCKS, BLOCK, MAX_SEQS, GROUPS,
                                       step_tokens=STEP)
        self.caps = tuple(w and self.plan.window_blocks(w) for w in GROUPS.windows)
        self.pool = BlockPool(GEOMETRY, self.plan)
        self.state = StateSlots(TINY, MAX_SEQS)
        self.blocks = BlockManager(self.plan.n_blocks, BLOCK, True, on_copy=self.pool.copy_block, on_free=self.state.release,
                                   on_fork=self.state.fork, windows=GROUPS.windows, window_caps=self.caps)
        self.active: list[Sequence] = []
        self.preempted: list[Sequence] = []
        self.marks: dict[Sequence, float] = {}
        self.names = 0

    def _compute(self, seq: Sequence, n: int) -> bool:
        """Write tokens [num_computed, num_computed + n) in steps of at most STEP, as the scheduler would; False
        (the sequence preempted by the caller) when blocks run out."""
        while n:
            m = min(n, STEP)
            if not self.blocks.can_reserve(seq, m):
                return False
            self.blocks.reserve(seq, m)
            for group, table in enumerate(self.blocks.tables(seq)):
                for t in range(seq.num_computed, seq.num_computed + m):
                    slot = table[t // BLOCK] * BLOCK + t % BLOCK
                    self.pool.k[0, slot // BLOCK, 0, slot % BLOCK] = torch.tensor([seq.token_ids[t], group], dtype=torch.float32)
            seq.num_computed += m
            n -= m
            self.blocks.register_full_blocks(seq)
            self.blocks.free_behind_window(seq)
        return True

    def _admit(self, seq: Sequence) -> None:
        self.blocks.take_cached_prefix(seq)
        if self.blocks.can_reserve(seq, seq.remaining) and self._compute(seq, seq.remaining):
            self.active.append(seq)
            self._mark(seq)
        else:
            self.blocks.free(seq)
            self.preempted.append(seq)

    def _mark(self, seq: Sequence) -> None:
        """Write the sequence's own number into its state slot (what its recurrent layers would have computed)."""
        slot = self.state.slots_for([seq])[0]
        self.names += 1
        self.marks[seq] = float(self.names)
        self.state.state.delta[:, slot] = self.marks[seq]

    @precondition(lambda self: len(self.active) < MAX_SEQS)
    @rule(ids=tokens)
    def add(self, ids):
        self._admit(Sequence(f"s{self.names}", ids))

    @precondition(lambda self: self.active)
    @rule(pick=st.integers(0, 99), more=st.lists(st.integers(0, 2), min_size=1, max_size=3))
    def append(self, pick, more):
        seq = self.active[pick % len(self.active)]
        seq.token_ids += more
        if not self._compute(seq, len(more)):
            self.preempt(self.active.index(seq))

    @precondition(lambda self: self.active and len(self.active) < MAX_SEQS)
    @rule(pick=st.integers(0, 99))
    def fork(self, pick):
        parent = self.active[pick % len(self.active)]
        child = Sequence(f"c{self.names}", [])
        self.blocks.fork(parent, child)
        assert self.state.state.delta[0, self.state.slots[child], 0, 0, 0] == self.marks[parent]   # the parent's state
        self.active.append(child)
        self._mark(child)

    @precondition(lambda self: self.active)
    @rule(pick=st.integers(0, 99))
    def finish(self, pick):
        self.blocks.free(self.active.pop(pick % len(self.active)))

    @precondition(lambda self: self.active)
    @rule(pick=st.integers(0, 99))
    def preempt(self, pick):
        seq = self.active.pop(pick % len(self.active))
        self.blocks.free(seq)
        self.preempted.append(seq)

    @precondition(lambda self: self.preempted and len(self.active) < MAX_SEQS)
    @rule()
    def resume(self):
        self._admit(self.preempted.pop(0))

    @invariant()
    def reference_counts_match_the_tables(self):
        held = [0] * self.plan.n_blocks
        for seq in self.active:
            for table in self.blocks.tables(seq):
                assert len(table) == math.ceil(seq.num_computed / BLOCK)
                for block_id in table:
                    held[block_id] += block_id != NO_BLOCK
        for seq in self.preempted:
            assert seq.block_table == seq.group_tables == [] and seq.num_computed == 0
        assert [b.ref_count for b in self.blocks.blocks] == held          # no leak, nothing freed in use
        assert set(self.blocks.free_lru) == {i for i, n in enumerate(held) if n == 0}

    @invariant()
    def sliding_blocks_behind_the_window_are_given_back(self):
        for seq in self.active:
            full, sliding = self.blocks.tables(seq)
            first = self.blocks.first_needed(seq.num_computed, SLIDE)
            assert NO_BLOCK not in full and all(b == NO_BLOCK for b in sliding[:first])
            assert NO_BLOCK not in sliding[first:] and len(sliding) - first <= self.caps[1]

    @invariant()
    def every_sequence_reads_its_own_tokens_and_state(self):
        for seq in self.active:
            for group, table in enumerate(self.blocks.tables(seq)):
                start = self.blocks.first_needed(seq.num_computed, GROUPS.windows[group]) * BLOCK
                slots = [table[t // BLOCK] * BLOCK + t % BLOCK for t in range(start, seq.num_computed)]
                at = torch.tensor(slots, dtype=torch.long)
                assert self.pool.k[0, at // BLOCK, 0, at % BLOCK].tolist() == [[float(t), float(group)] for t in seq.token_ids[start:seq.num_computed]]
            assert self.state.state.delta[0, self.state.slots[seq], 0, 0, 0] == self.marks[seq]

    @invariant()
    def state_slots_are_held_by_running_sequences_only(self):
        assert set(self.state.slots.of) == set(self.active)
        assert len(self.state.slots.free) + len(self.state.slots) == MAX_SEQS


TestHybridBlockManager = HybridBlockMachine.TestCase
TestHybridBlockManager.settings = settings(max_examples=50, stateful_step_count=40, deadline=None)
