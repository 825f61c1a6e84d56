"""The block pool: every sequence's K/V in fixed-size blocks of one preallocated buffer per layer.

    pool.k[layer]   (n_blocks, Hkv, block_size, D)    token slot = block · block_size + offset
    pool.v[layer]   (n_blocks, Hkv, block_size, Dv)

A dense pool is the dense formats' one storage (cache/blocks.py DenseBlocks, the single cache's too) with many
sequences in it. A block's format is a cache format (`dense` fp32, `dense-f16`, `dense-bf16`: storage dtype; compute
stays fp32; the compressed formats int4, tq4, ... live in coded.py, see formats.py). Its bytes come from the
caches' own formula (kvlab.cache.expected_nbytes), the one the planner's `--engine kvlab` uses, so the
number of blocks a budget buys is the planner's number.

BlockManager keeps the metadata: a block table per sequence, a reference count per block, and the
prefix index. A full block is keyed by a SHA-256 chained over the token ids (key_i = sha256(key_{i-1}, ids_i),
key_{-1} = `root`: the store's identity with --kv-store, so a key names the same K/V in any process) and verified
on lookup against its stored ids and the exact block (id, generation) before it, so a key collision can only
miss, never mix two prompts. Freed blocks keep their key and sit in an LRU until their memory is needed; a block
shared by several sequences is copied before one of them writes into it. With a `store` (serve/kv_store.py) a
block the index misses is looked for on disk before the prefix is given up.

Layer groups (cache/capacity.LayerGroups: Gemma 3's full and sliding layers). The pool's buffers hold one group's
layers (pool layer j of every group); a block belongs to one group, and a sequence has a table per group:
`seq.block_table` for group 0 (full layers) and `seq.group_tables` for the others, all the same length (token t in
entry t // block_size). A sliding group gives back its blocks once they leave the window (free_behind_window: the
entry becomes NO_BLOCK), so the same blocks hold more sequences. Prefix hits are found and verified on group 0's
chain as above; another group's block at position i is keyed by sha256(group, key_i) and verified by the group-0 block it
was written beside (its `parent` is that block's (id, generation)), so it holds the same tokens' K/V; a sliding
group needs only the blocks its window still reaches at the hit, and the hit is as long as every group can serve.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..cache import CacheGeometry
from ..cache.capacity import CapacityPlan, parse_bytes  # noqa: F401  (the engine's admission, importable from here)
from ..cache.blocks import DenseBlocks
from ..errors import ConfigError
from .attention import ragged_attention
from .formats import DENSE_FORMATS


def storage_dtype(block_format: str) -> torch.dtype:
    key = block_format.strip().lower()
    if key not in DENSE_FORMATS:
        raise ConfigError(f"unknown dense block format {block_format!r}; choose one of: {', '.join(DENSE_FORMATS)}")
    return DENSE_FORMATS[key]


class BlockPool(DenseBlocks):
    """The K/V storage of dense blocks: DenseBlocks of the plan's blocks, in the format's dtype."""

    def __init__(self, geometry: CacheGeometry, plan: CapacityPlan, device="cpu"):
        super().__init__(geometry, plan.n_blocks, plan.block_size, storage_dtype(plan.format), device)
        self.plan = plan

    @property
    def dtype(self) -> torch.dtype:
        """The blocks' storage dtype (the name the engine and the pools share)."""
        return self.storage

    def rows_for(self, seqs) -> None:
        """Dense blocks keep no per-sequence state (coded pools give each running sequence a row)."""
        return None

    def release(self, seq) -> None:
        """Nothing to forget when a sequence's blocks are freed."""

    def fork(self, parent, child) -> None:
        """Nothing but blocks to share when a sequence is forked."""

    def append(self, layer: int, view, k: torch.Tensor, v: torch.Tensor) -> None:
        """k (N, Hkv, D), v (N, Hkv, Dv): the step's N new tokens into their slots (view.slots)."""
        self.write_slots(layer, view.slots, k, v)

    def attend(self, layer: int, view, q: torch.Tensor) -> torch.Tensor:
        """q (N, H, D) fp32 -> (N, H, Dv) fp32: each sequence's rows against its own blocks."""
        return ragged_attention(q, self.k[layer], self.v[layer], view.layout, view.scale, view.window, view.use_kernel)


@dataclass
class Block:
    id: int
    ref_count: int = 0
    generation: int = 0                       # bumped each time the block is handed out again
    key: bytes | None = None                  # prefix-index key, once full and registered
    token_ids: tuple[int, ...] = ()           # the ids a registered block holds (verification)
    parent: tuple[int, int] | None = None     # (id, generation) of the block before it in its sequence


#: a table entry whose block a sliding group has given back (its tokens left the window)
NO_BLOCK = -1


class BlockManager:
    """Block tables, reference counts, the prefix index and the LRU of free blocks."""

    def __init__(self, n_blocks: int, block_size: int, prefix_caching: bool = True, on_copy=None, on_free=None,
                 on_fork=None, prefix_state=None, windows: tuple = (None,), window_caps: tuple = (None,),
                 root: bytes = b"", store=None):
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.windows = tuple(windows)           # per layer group: None, or the window it frees blocks behind
        self.window_caps = tuple(window_caps)   # per group: None, or the most blocks it holds for one sequence
        self.blocks = [Block(i) for i in range(n_blocks)]
        self.free_lru: OrderedDict[int, None] = OrderedDict((i, None) for i in range(n_blocks))  # first = evicted first
        self.index: dict[bytes, int] = {}       # key -> block id
        self.on_copy = on_copy                  # on_copy(src, dst): copy the data of a block (the pool's copy_block)
        self.on_free = on_free                  # on_free(seq): the sequence holds no blocks any more (the pool's release)
        self.on_fork = on_fork                  # on_fork(parent, child): per-sequence pool state too (the pool's fork)
        self.prefix_state = prefix_state        # prefix_state(seq): whether the pool holds what cached blocks do not
                                                # (its holds_prefix_state: +sinkN rows); None: blocks are all
        self.root = root                        # the key before a sequence's first block
        self.store = store                      # blocks from disk (hold_prefix's `source`), and
                                                # store.load_state(ids, first block's key) -> bool: prefix_state from disk

    # -- counts -----------------------------------------------------------------------------------------
    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    @property
    def n_free(self) -> int:
        """Blocks no sequence references (cached ones included: they are evicted when needed)."""
        return len(self.free_lru)

    @property
    def n_used(self) -> int:
        return self.n_blocks - self.n_free

    # -- prefix cache -------------------------------------------------------------------------------------
    @staticmethod
    def chain_key(parent_key: bytes, ids: tuple[int, ...]) -> bytes:
        return hashlib.sha256(parent_key + array("q", ids).tobytes()).digest()

    def tables(self, seq) -> list[list[int]]:
        """The sequence's block table of each layer group (group 0's is seq.block_table)."""
        if len(self.windows) == 1:
            return [seq.block_table]
        if len(seq.group_tables) != len(self.windows) - 1:
            seq.group_tables = [[] for _ in self.windows[1:]]
        return [seq.block_table, *seq.group_tables]

    def group_key(self, group: int, key: bytes) -> bytes:
        return key if group == 0 else hashlib.sha256(b"group %d " % group + key).digest()

    def first_needed(self, position: int, window: int | None) -> int:
        """The first block a query at `position` reads in a group of `window` (0 for full layers)."""
        return 0 if window is None else max(0, position - window + 1) // self.block_size

    def take_cached_prefix(self, seq) -> int:
        """Give a sequence with no blocks the longest cached run of full blocks of its tokens (never the
        last token: its logits are needed). Returns the number of tokens it now has computed."""
        assert not seq.block_table and seq.num_computed == 0
        if not self.prefix_caching or (self.prefix_state is not None and not self.prefix_state(seq)
                                       and not self._state_from_store(seq)):
            return 0
        bs, n = self.block_size, (len(seq.token_ids) - 1) // self.block_size
        if len(self.windows) == 1:
            seq.block_table = [b.id for b in self.hold_prefix(seq.token_ids, n, self.store)]
            seq.num_hashed = len(seq.block_table)
            seq.num_computed = seq.num_hashed * bs
            return seq.num_computed
        found = self.cached_prefix(seq.token_ids[:n * bs])            # group 0's blocks, verified along the chain
        hit, others = len(found), None
        while hit and others is None:                               # as long as every other group can serve it
            others = self._group_hit(found, hit)
            hit -= others is None
        tables = self.tables(seq)
        for group, row in enumerate([[b.id for b in found[:hit]], *(others or [[] for _ in tables[1:]])]):
            for block_id in row:
                if block_id != NO_BLOCK:
                    self._hold(block_id)
            tables[group].extend(row)
        seq.num_hashed = hit
        seq.num_computed = hit * bs
        return seq.num_computed

    def _state_from_store(self, seq) -> bool:
        """The pool's prefix state for the sequence (+sinkN rows) from the store's copy of its first block, if any."""
        if self.store is None or len(seq.token_ids) <= self.block_size:
            return False
        first = self.chain_key(self.root, tuple(seq.token_ids[:self.block_size]))
        return self.store.load_state(seq.token_ids, first) and self.prefix_state(seq)

    def hold_prefix(self, token_ids, n_blocks: int, source=None) -> list[Block]:
        """A reference to each block of the longest cached run of the first `n_blocks` full blocks of `token_ids`.
        A block the index misses is taken from `source` while free blocks last: `source.has(key)`, and
        `source.load(key, parent_key, ids, block_id) -> bool` fills a fresh block with its K/V (or says it cannot)."""
        bs, key, held = self.block_size, self.root, []
        for i in range(n_blocks):
            ids = tuple(token_ids[i * bs:(i + 1) * bs])
            parent_key, key = key, self.chain_key(key, ids)
            parent = (held[-1].id, held[-1].generation) if held else None
            block_id = self.index.get(key)
            block = None if block_id is None else self.blocks[block_id]
            if block is not None and block.token_ids == ids and block.parent == parent:
                self._hold(block_id)
            else:                               # a miss (or a collision, or a stale chain): the store may have it
                block = self._load(key, parent_key, ids, parent, source)
                if block is None:
                    break
            held.append(block)
        return held

    def _load(self, key: bytes, parent_key: bytes, ids: tuple[int, ...], parent, source) -> Block | None:
        """A fresh block filled by `source` and registered under `key` (held once), or None."""
        if source is None or not self.free_lru or not source.has(key):
            return None
        block = self._allocate()
        if not source.load(key, parent_key, ids, block.id):
            block.ref_count = 0
            self.free_lru[block.id] = None
            self.free_lru.move_to_end(block.id, last=False)     # empty: the first to be handed out again
            return None
        block.key, block.token_ids, block.parent = key, ids, parent
        self.index[key] = block.id
        return block

    def release(self, held: list[Block]) -> None:
        """Drop references taken by hold_prefix, last block first (a prefix outlives its tail in the LRU)."""
        for block in reversed(held):
            self._drop(block.id)

    def cached_prefix(self, token_ids) -> list[Block]:
        """The longest run of full blocks of `token_ids` the prefix index holds now (no references taken)."""
        bs, key, found = self.block_size, self.root, []
        for i in range(len(token_ids) // bs):
            ids = tuple(token_ids[i * bs:(i + 1) * bs])
            key = self.chain_key(key, ids)
            block_id = self.index.get(key)
            if block_id is None or self.blocks[block_id].token_ids != ids or \
                    self.blocks[block_id].parent != ((found[-1].id, found[-1].generation) if found else None):
                break
            found.append(self.blocks[block_id])
        return found

    def _group_hit(self, found: list[Block], hit: int) -> list[list[int]] | None:
        """The other groups' blocks for the first `hit` blocks of group 0 (`found`), NO_BLOCK where a sliding group's
        window no longer reaches at the hit; None if one is missing."""
        rows = []
        for group in range(1, len(self.windows)):
            first = self.first_needed(hit * self.block_size, self.windows[group])
            row = [NO_BLOCK] * first
            for twin in found[first:hit]:
                block_id = self.index.get(self.group_key(group, twin.key))
                if block_id is None or self.blocks[block_id].parent != (twin.id, twin.generation):
                    return None
                row.append(block_id)
            rows.append(row)
        return rows

    def register_full_blocks(self, seq) -> None:
        """Enter the sequence's newly completed blocks into the prefix index (the first holder keeps a key)."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        tables = self.tables(seq)
        key = self.blocks[seq.block_table[seq.num_hashed - 1]].key if seq.num_hashed else self.root
        for i in range(seq.num_hashed, seq.num_computed // bs):
            block = self.blocks[seq.block_table[i]]
            ids = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            key = self.chain_key(key, ids)
            if block.key is None:
                before = self.blocks[seq.block_table[i - 1]] if i else None
                block.key, block.token_ids = key, ids
                block.parent = None if before is None else (before.id, before.generation)
                self.index.setdefault(key, block.id)
            for group in range(1, len(tables)):               # beside it: verified by the group-0 block it sits with
                other = self.blocks[tables[group][i]]
                if other.key is None:
                    other.key, other.token_ids, other.parent = self.group_key(group, key), ids, (block.id, block.generation)
                    self.index.setdefault(other.key, other.id)
            seq.num_hashed = i + 1

    def free_behind_window(self, seq) -> None:
        """Give back each sliding group's blocks that no later query of the sequence reads (all their tokens more than
        window - 1 behind its next token); they stay in the prefix cache until their memory is needed."""
        for group, table in enumerate(self.tables(seq)):
            window = self.windows[group]
            if window is None:
                continue
            i = min(self.first_needed(seq.num_computed, window), len(table)) - 1
            while i >= 0 and table[i] != NO_BLOCK:
                self._drop(table[i])
                table[i] = NO_BLOCK
                i -= 1

    # -- allocation -------------------------------------------------------------------------------------
    def blocks_needed(self, seq, n_new: int) -> int:
        """Fresh blocks writing tokens [num_computed, num_computed + n_new) takes (a copy of a shared block included),
        over every group; a sliding group's count stops at the most it ever holds (window_caps), since it frees blocks
        behind its window between steps (one step writes at most as many blocks as the cap allows)."""
        tables = self.tables(seq)
        new = max(0, math.ceil((seq.num_computed + n_new) / self.block_size) - len(seq.block_table))
        needed = 0
        for cap, table in zip(self.window_caps, tables):
            if cap is not None and new > 1:
                needed += max(0, min(new, cap - sum(b != NO_BLOCK for b in table)))
            else:
                needed += new
        return needed + sum(self._shared_tail(seq, table) for table in tables)

    def can_reserve(self, seq, n_new: int) -> bool:
        return self.blocks_needed(seq, n_new) <= self.n_free

    def tokens_that_fit(self, seq) -> int:
        """How many more tokens the sequence could write with the free blocks there are now."""
        tables = self.tables(seq)
        room = len(seq.block_table) * self.block_size - seq.num_computed
        free = self.n_free - sum(self._shared_tail(seq, table) for table in tables)
        return max(0, room + free // len(tables) * self.block_size) if free >= 0 else 0

    def reserve(self, seq, n_new: int) -> list[int]:
        """Blocks for n_new more tokens in every group (copying a shared tail block first); returns group 0's slots."""
        if not self.can_reserve(seq, n_new):
            raise RuntimeError("reserve() without can_reserve(): the scheduler must check first")
        bs = self.block_size
        for table in self.tables(seq):
            if self._shared_tail(seq, table):              # copy-on-write
                tail = seq.num_computed // bs
                old, new = self.blocks[table[tail]], self._allocate()
                if self.on_copy is not None:
                    self.on_copy(old.id, new.id)
                old.ref_count -= 1
                table[tail] = new.id
            while len(table) * bs < seq.num_computed + n_new:
                table.append(self._allocate().id)
        return [seq.block_table[t // bs] * bs + t % bs for t in range(seq.num_computed, seq.num_computed + n_new)]

    def free(self, seq) -> None:
        """Drop the sequence's references, last block first (so a prefix outlives its tail in the LRU)."""
        for table in self.tables(seq):
            self.release([self.blocks[b] for b in table if b != NO_BLOCK])
        seq.block_table = []
        if len(self.windows) > 1:
            seq.group_tables = []
        seq.num_computed = seq.num_hashed = 0
        if self.on_free is not None:
            self.on_free(seq)

    def fork(self, parent, child) -> None:
        """The child shares all of the parent's blocks (and tokens); writes then copy a shared tail."""
        child.token_ids = list(parent.token_ids)
        child.block_table = list(parent.block_table)
        if len(self.windows) > 1:
            child.group_tables = [list(t) for t in parent.group_tables]
        child.num_computed, child.num_hashed = parent.num_computed, parent.num_hashed
        for table in self.tables(child):
            for block_id in table:
                if block_id != NO_BLOCK:
                    self._hold(block_id)
        if self.on_fork is not None:
            self.on_fork(parent, child)

    def _hold(self, block_id: int) -> None:
        """One more reference; a block no one held leaves the LRU of free blocks."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_lru[block_id]
        block.ref_count += 1

    def _drop(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_lru[block_id] = None

    def _shared_tail(self, seq, table: list[int] | None = None) -> bool:
        """The next token would be written into a partly filled block another sequence also holds."""
        table = seq.block_table if table is None else table
        if seq.num_computed % self.block_size == 0 or len(table) * self.block_size <= seq.num_computed:
            return False
        return self.blocks[table[seq.num_computed // self.block_size]].ref_count > 1

    def _allocate(self) -> Block:
        """The least recently freed block, forgotten by the prefix index."""
        block_id, _ = self.free_lru.popitem(last=False)
        block = self.blocks[block_id]
        if block.key is not None and self.index.get(block.key) == block_id:
            del self.index[block.key]
        block.key, block.token_ids, block.parent = None, (), None
        block.generation += 1
        block.ref_count = 1
        return block
