"""What a byte budget buys in one block format: the serving engine's admission and the planner share it (no torch).

    budget >= pool_bytes = n_blocks·block_bytes + shared_bytes + max_batch·(sequence_bytes + state_bytes)

with the block, shared and per-sequence bytes of the format's own formula (CacheSpec.pool_bytes), so the number of
blocks a budget buys is the planner's number. A block holds block_size tokens of one *layer group* (LayerGroups):
a model whose attention layers are all alike has one group of every attention layer; a model with sliding and full
layers (Gemma 3) has groups of one kind each, a block table per group, so a sliding group's blocks go back to the
pool once they leave the window while the full groups keep theirs (vLLM's hybrid allocator). Recurrent layers hold
no blocks: their state is one slot per batch row (state_bytes each).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from ..errors import ConfigError
from ..limits import parse_size
from .format import CacheSpec
from .geometry import CacheGeometry

def parse_bytes(value: int | str) -> int:
    """512MiB, 2GiB, 1e9, 4096 -> bytes (> 0)."""
    return parse_size(value, "kv_budget", "512MiB or 2GiB")


@dataclass(frozen=True)
class LayerGroups:
    """How a pool lays out a model's attention layers: groups of `size` layers, each group of one kind and with a
    block table of its own per sequence. A block holds block_size tokens of the `size` layers of one group.

    members  the model layers of each group (pool layer j of group g is model layer members[g][j])
    windows  per group: None, or the sliding window W whose blocks are given back once all their tokens are more
             than W - 1 behind the sequence's next token (no later query sees them)
    attention_windows  per model attention layer: the window its attention masks with (None: full)

    One table for all layers would free nothing for Gemma 3 (its full layers need every block); groups of one kind
    free the sliding layers' blocks, and equal-sized groups keep every block the same size, so one free list serves
    them all. Groups are as large as the layer counts allow: size = gcd(full layers, sliding layers).
    """

    members: tuple[tuple[int, ...], ...]
    windows: tuple[int | None, ...]
    attention_windows: tuple[tuple[int, int | None], ...]   # (model layer, window) per attention layer

    @property
    def size(self) -> int:
        return len(self.members[0])

    @property
    def freeing(self) -> bool:
        """Whether some group gives blocks back as they leave its window."""
        return any(w is not None for w in self.windows)

    def window_of(self, layer: int) -> int | None:
        return dict(self.attention_windows)[layer]

    @classmethod
    def build(cls, kinds: Sequence[str], window: int | None, free_window: bool = True) -> "LayerGroups":
        """From each model layer's kind (full, sliding, recurrent, none, ...). Sliding layers free their blocks
        (`free_window`) where the model also has full layers: a prefix-cache hit is verified on the full layers'
        blocks (blocks.py), so a model of sliding layers only keeps one table and frees nothing."""
        full = tuple(i for i, k in enumerate(kinds) if k == "full")
        sliding = tuple(i for i, k in enumerate(kinds) if k == "sliding")
        if not full and not sliding:
            raise ConfigError("the serving pool holds attention layers; this model has none")
        attention = tuple(sorted(full + sliding))
        windows = tuple((i, window if i in sliding else None) for i in attention)
        if not (free_window and full and sliding):
            return cls((attention,), (None,), windows)
        size = math.gcd(len(full), len(sliding))
        groups = [full[i:i + size] for i in range(0, len(full), size)] + [sliding[i:i + size] for i in range(0, len(sliding), size)]
        return cls(tuple(groups), tuple(None if g[0] in full else window for g in groups), windows)


@dataclass(frozen=True)
class CapacityPlan:
    """What a byte budget buys in one block format."""

    format: str
    budget: int          # bytes asked for
    block_size: int      # tokens per block
    block_bytes: int     # one block: block_size tokens of one layer group's layers, K and V
    n_blocks: int
    shared_bytes: int = 0     # once per pool (TurboQuant's rotations, codebooks, calibration)
    sequence_bytes: int = 0   # per batch slot (the int formats' open key group)
    max_batch: int = 16
    groups: LayerGroups | None = None   # None: one group of every layer
    state_bytes: int = 0      # per batch slot: the recurrent layers' state
    step_tokens: int = 512    # the most tokens a sequence writes in one step (the engine's max_step_tokens)

    @classmethod
    def build(cls, geometry: CacheGeometry, block_format: str, kv_budget: int | str, block_size: int = 16,
              max_batch: int = 16, groups: LayerGroups | None = None, state_bytes: int = 0,
              step_tokens: int = 512) -> "CapacityPlan":
        """`geometry`: the attention layers' shapes (its n_layers is taken from `groups` when given). A block holds
        one group's layers; the shared and per-sequence state (TurboQuant's per-layer calibration, the int formats'
        open key group) is every attention layer's: each group's own."""
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ConfigError(f"block_size must be a positive integer, got {block_size!r}")
        spec = CacheSpec.parse(block_format, "pool")
        if groups is not None:
            geometry = replace(geometry, n_layers=groups.size)
        fmt = spec.pool_bytes(geometry, block_size)   # the caches' (and planner's) formula
        if groups is not None and len(groups.members) > 1:
            every = spec.pool_bytes(replace(geometry, n_layers=groups.size * len(groups.members)), block_size)
            fmt = replace(fmt, shared=every.shared, sequence=every.sequence)
        budget = parse_bytes(kv_budget)
        fixed = fmt.shared + max_batch * (fmt.sequence + state_bytes)
        n_blocks = max(0, budget - fixed) // fmt.block
        if n_blocks < 1:
            raise ConfigError(f"kv_budget of {budget:,} bytes holds no block: one {fmt.name} block of "
                              f"{block_size} tokens needs {fmt.block:,} bytes"
                              + (f" after {fixed:,} bytes of shared and per-sequence state" if fixed else ""))
        return cls(fmt.name, budget, block_size, fmt.block, n_blocks, fmt.shared, fmt.sequence, max_batch, groups,
                   state_bytes, step_tokens)

    @property
    def fixed_bytes(self) -> int:
        """What the pool holds besides its blocks: shared state, and per batch slot its per-sequence rows and
        recurrent state."""
        return self.shared_bytes + self.max_batch * (self.sequence_bytes + self.state_bytes)

    @property
    def pool_bytes(self) -> int:
        return self.n_blocks * self.block_bytes + self.fixed_bytes

    @property
    def n_groups(self) -> int:
        """Layer groups: a pool keeps per-layer state (shared or per sequence) for each group's layers."""
        return 1 if self.groups is None else len(self.groups.members)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return (None,) if self.groups is None else self.groups.windows

    def window_blocks(self, window: int) -> int:
        """The most blocks a sliding group holds for one sequence: its window, one step's tokens, one block of slack."""
        return math.ceil((window - 1 + self.step_tokens) / self.block_size) + 1

    @property
    def tokens(self) -> int:
        """The longest sequence the pool holds alone."""
        n_full = sum(w is None for w in self.windows)
        caps = [self.window_blocks(w) for w in self.windows if w is not None]
        if not caps:
            return self.n_blocks // n_full * self.block_size
        lo, hi = 0, self.n_blocks                       # blocks per full group: the most that fit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if n_full * mid + sum(min(mid, c) for c in caps) <= self.n_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo * self.block_size

    def blocks_for(self, tokens: int) -> int:
        """Blocks one sequence of `tokens` tokens holds at its most, over every group (a sliding group's capped by
        window_blocks)."""
        n = math.ceil(tokens / self.block_size)
        return sum(n if w is None else min(n, self.window_blocks(w)) for w in self.windows)

    def max_concurrent(self, ctx_tokens: int) -> int:
        """Sequences of `ctx_tokens` tokens each that fit in the pool at once."""
        return self.n_blocks // self.blocks_for(max(1, ctx_tokens))
