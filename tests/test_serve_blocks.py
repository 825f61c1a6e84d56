"""The block manager under random add / append / fork / free / preempt: a hypothesis state machine.

The pool is real (tiny geometry); every computed token writes its own id into its K slot, so "a sequence
reads only its own tokens" is checked on the data itself, copy-on-write included. A second run uses a
hash that collides on purpose: verification must turn every collision into a miss.
"""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvlab.cache import CacheGeometry
from kvlab.errors import ConfigError
from kvlab.serve.blocks import BlockManager, BlockPool, CapacityPlan, parse_bytes
from kvlab.serve.sequence import Sequence

GEOMETRY = CacheGeometry(n_layers=2, n_kv_heads=1, head_dim=2)
BLOCK = 4
N_BLOCKS = 12
tokens = st.lists(st.integers(0, 2), min_size=1, max_size=14)   # a tiny alphabet: prefixes repeat often


class CollidingManager(BlockManager):
    @staticmethod
    def chain_key(parent_key, ids):
        return sum(ids) % 3          # different prompts share keys all the time


class BlockMachine(RuleBasedStateMachine):
    manager_class = BlockManager

    def __init__(self):
        super().__init__()
        block_bytes = CapacityPlan.build(GEOMETRY, "dense", 1 << 20, BLOCK).block_bytes
        self.plan = CapacityPlan.build(GEOMETRY, "dense", block_bytes * N_BLOCKS, BLOCK)
        self.pool = BlockPool(GEOMETRY, self.plan)
        self.blocks = self.manager_class(self.plan.n_blocks, BLOCK, prefix_caching=True, on_copy=self.pool.copy_block)
        self.active: list[Sequence] = []
        self.preempted: list[Sequence] = []
        self.names = 0

    def _compute(self, seq: Sequence, n: int) -> bool:
        """Write tokens [num_computed, num_computed + n) if blocks allow; False (nothing changed) if not."""
        if not self.blocks.can_reserve(seq, n):
            return False
        slots = self.blocks.reserve(seq, n)
        ids = torch.tensor(seq.token_ids[seq.num_computed:seq.num_computed + n], dtype=torch.float32)
        at = torch.as_tensor(slots)
        self.pool.k[:, at // BLOCK, 0, at % BLOCK, 0] = ids   # the data a reader would see (head 0 of each slot)
        seq.num_computed += n
        self.blocks.register_full_blocks(seq)
        return True

    def _admit(self, seq: Sequence) -> None:
        self.blocks.take_cached_prefix(seq)
        if self._compute(seq, seq.remaining):
            self.active.append(seq)
        else:
            self.blocks.free(seq)
            self.preempted.append(seq)

    @rule(ids=tokens)
    def add(self, ids):
        self.names += 1
        self._admit(Sequence(str(self.names), ids))

    @precondition(lambda self: self.active)
    @rule(pick=st.integers(0, 99), token=st.integers(0, 2))
    def append(self, pick, token):
        seq = self.active[pick % len(self.active)]
        seq.token_ids.append(token)
        if not self._compute(seq, 1):                # out of blocks: preempt it, as the scheduler would
            self.active.remove(seq)
            self.blocks.free(seq)
            self.preempted.append(seq)

    @precondition(lambda self: self.active)
    @rule(pick=st.integers(0, 99))
    def fork(self, pick):
        parent = self.active[pick % len(self.active)]
        self.names += 1
        child = Sequence(str(self.names), [])
        self.blocks.fork(parent, child)
        self.active.append(child)

    @precondition(lambda self: self.active)
    @rule(pick=st.integers(0, 99))
    def free(self, pick):
        seq = self.active.pop(pick % len(self.active))
        self.blocks.free(seq)

    @precondition(lambda self: self.active)
    @rule(pick=st.integers(0, 99))
    def preempt(self, pick):
        seq = self.active.pop(pick % len(self.active))
        self.blocks.free(seq)
        self.preempted.append(seq)

    @precondition(lambda self: self.preempted)
    @rule()
    def resume(self):
        self._admit(self.preempted.pop(0))

    @invariant()
    def reference_counts_match_the_tables(self):
        held = [0] * N_BLOCKS
        for seq in self.active:
            assert len(seq.block_table) == math.ceil(seq.num_computed / BLOCK)
            for block_id in seq.block_table:
                held[block_id] += 1
        for seq in self.preempted:
            assert seq.block_table == [] and seq.num_computed == 0
        assert [b.ref_count for b in self.blocks.blocks] == held          # no leak, nothing freed in use
        assert set(self.blocks.free_lru) == {i for i, n in enumerate(held) if n == 0}

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        for seq in self.active:
            slots = [seq.block_table[t // BLOCK] * BLOCK + t % BLOCK for t in range(seq.num_computed)]
            at = torch.tensor(slots, dtype=torch.long)
            assert self.pool.k[0, at // BLOCK, 0, at % BLOCK, 0].tolist() == [float(t) for t in seq.token_ids[:seq.num_computed]]

    @invariant()
    def the_index_points_at_registered_blocks(self):
        for key, block_id in self.blocks.index.items():
            assert self.blocks.blocks[block_id].key == key

    @invariant()
    def bytes_balance(self):
        assert self.pool.nbytes == self.pool.k.nbytes + self.pool.v.nbytes == self.plan.pool_bytes
        used, free = self.blocks.n_used * self.plan.block_bytes, self.blocks.n_free * self.plan.block_bytes
        assert used + free == self.pool.nbytes


class CollidingMachine(BlockMachine):
    manager_class = CollidingManager


TestBlockManager = BlockMachine.TestCase
TestBlockManager.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestBlockManagerWithCollisions = CollidingMachine.TestCase
TestBlockManagerWithCollisions.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)


def test_a_prefix_is_shared_and_a_shared_block_is_copied_before_it_is_written():
    m = BlockMachine()
    first = Sequence("a", list(range(10)))
    m._admit(first)                                   # blocks 0-3, 4-7 full and registered; 8-9 partial
    second = Sequence("b", list(range(10)) + [7])
    m._admit(second)
    assert second.block_table[:2] == first.block_table[:2]    # the two full blocks are shared
    assert second.block_table[2] != first.block_table[2]
    child = Sequence("c", [])
    m.blocks.fork(first, child)
    m.active.append(child)
    tail = first.block_table[2]
    child.token_ids.append(1)
    assert m._compute(child, 1)
    assert child.block_table[2] != tail and first.block_table[2] == tail   # copied, the parent's block untouched
    m.every_sequence_reads_its_own_tokens()
    m.reference_counts_match_the_tables()


def test_freed_blocks_stay_cached_until_their_memory_is_needed():
    m = BlockMachine()
    seq = Sequence("a", list(range(9)))
    m._admit(seq)
    m.blocks.free(seq)
    again = Sequence("b", list(range(9)))
    assert m.blocks.take_cached_prefix(again) == 8    # both full blocks come back
    m.blocks.free(again)
    hog = Sequence("c", [5] * (N_BLOCKS * BLOCK))
    m._admit(hog)                                     # needs every block: the cached ones are evicted
    assert m.blocks.index == {} or all(m.blocks.blocks[b].ref_count for b in m.blocks.index.values())
    assert m.blocks.take_cached_prefix(Sequence("d", list(range(9)))) == 0


def test_budget_parsing_and_block_bytes():
    assert parse_bytes("512MiB") == 512 << 20 and parse_bytes("1.5GB") == 1_500_000_000 and parse_bytes(4096) == 4096
    for bad in ("lots", "-3MiB", 0, "12 parsecs"):
        with pytest.raises(ConfigError):
            parse_bytes(bad)
    plan = CapacityPlan.build(GEOMETRY, "dense-f16", "1MiB", 16)
    assert plan.block_bytes == 2 * 2 * 1 * 2 * 2 * 16            # K+V × layers × heads × dim × 2 bytes × tokens
    assert plan.max_concurrent(33) == plan.n_blocks // 3
    with pytest.raises(ConfigError, match="block format"):
        CapacityPlan.build(GEOMETRY, "dense-f8", "1MiB")
    with pytest.raises(ConfigError, match="holds no block"):
        CapacityPlan.build(GEOMETRY, "dense", 10)
