"""What a byte budget buys in one block format: the serving engine's admission and the planner share it (no torch).

    budget >= pool_bytes = n_blocks·block_bytes + shared_bytes + max_batch·sequence_bytes

with the block, shared and per-sequence bytes of the format's own formula (CacheSpec.pool_bytes), so the number of
blocks a budget buys is the planner's number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError
from ..limits import parse_size
from .format import CacheSpec
from .geometry import CacheGeometry

def parse_bytes(value: int | str) -> int:
    """512MiB, 2GiB, 1e9, 4096 -> bytes (> 0)."""
    return parse_size(value, "kv_budget", "512MiB or 2GiB")


@dataclass(frozen=True)
class CapacityPlan:
    """What a byte budget buys in one block format."""

    format: str
    budget: int          # bytes asked for
    block_size: int      # tokens per block
    block_bytes: int     # one block in every layer, K and V
    n_blocks: int
    shared_bytes: int = 0     # once per pool (TurboQuant's rotations, codebooks, calibration)
    sequence_bytes: int = 0   # per batch slot (the int formats' open key group)
    max_batch: int = 16

    @classmethod
    def build(cls, geometry: CacheGeometry, block_format: str, kv_budget: int | str, block_size: int = 16,
              max_batch: int = 16) -> "CapacityPlan":
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ConfigError(f"block_size must be a positive integer, got {block_size!r}")
        fmt = CacheSpec.parse(block_format, "pool").pool_bytes(geometry, block_size)   # the caches' (and planner's) formula
        budget = parse_bytes(kv_budget)
        fixed = fmt.shared + max_batch * fmt.sequence
        n_blocks = max(0, budget - fixed) // fmt.block
        if n_blocks < 1:
            raise ConfigError(f"kv_budget of {budget:,} bytes holds no block: one {fmt.name} block of "
                              f"{block_size} tokens needs {fmt.block:,} bytes"
                              + (f" after {fixed:,} bytes of shared and per-sequence state" if fixed else ""))
        return cls(fmt.name, budget, block_size, fmt.block, n_blocks, fmt.shared, fmt.sequence, max_batch)

    @property
    def fixed_bytes(self) -> int:
        """What the pool holds besides its blocks: shared state and one row of per-sequence state per batch slot."""
        return self.shared_bytes + self.max_batch * self.sequence_bytes

    @property
    def pool_bytes(self) -> int:
        return self.n_blocks * self.block_bytes + self.fixed_bytes

    @property
    def tokens(self) -> int:
        return self.n_blocks * self.block_size

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def max_concurrent(self, ctx_tokens: int) -> int:
        """Sequences of `ctx_tokens` tokens each that fit in the pool at once."""
        return self.n_blocks // self.blocks_for(max(1, ctx_tokens))
