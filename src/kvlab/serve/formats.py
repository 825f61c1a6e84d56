"""Block formats: what one block of the pool holds, and its bytes by the caches' own formula.

    dense, dense-f16, dense-bf16   K/V in that storage dtype (attention computes in fp32)
    int<B>[+g<G>]                  the integer cache's codes (cache/quantized.py): per token B-bit value codes
                                   with fp16 scale+zero per value group, B-bit key codes with fp16 scale+zero
                                   per channel per key group of G tokens. G must divide the block size so a
                                   group never straddles two blocks; without +gN, G = the block size
                                   (so the format's name is int4+g16 at the default block size of 16)
    tq<W>, tq-k<W>v<W>, +qjl, ...  TurboQuant codes (cache/turboquant.py): per token codes + 16-bit norms

Compressed blocks hold codes, norms and scales only. Two more kinds of bytes come with them:
  shared        once per pool: TurboQuant's per-layer rotations, codebooks, key offsets and key channel
                weights (one calibration for every sequence, see serve/coded.py)
  per sequence  int formats: the open key group of each running sequence (< G tokens of fp32 keys,
                the single cache's "stage"); TurboQuant +sinkN: the first N tokens' K/V in fp32 (serve/sinks.py);
                one row per batch slot (max_batch rows)
Blocks and shared bytes come from the format's formula (CacheSpec.pool_bytes: the single-sequence cache's codes only)
at batch 1: its bytes at a capacity of c tokens are c·per_token + rest, so a block is f(2·bs) - f(bs) and the rest is
f(bs) - block.
With +sinkN a sequence's first N slots stay unwritten (their tokens are in its sink rows), so its blocks hold N
slots more than the single cache's codes. Names whose single cache keeps other full-precision tokens or layers
(+recentN, +fp-first-last, +fp-layers=, and +sinkN of the int formats) are not block formats: every refusal is a
row of cache/format.py REFUSALS (CacheSpec.supports("pool")).
+prerope is held: a slot's position is its token's place in its sequence (the same for every sequence that shares the
block through the prefix cache), so keys are turned back from it when coded and rebuilt at it when read. +alloc /
+halloc are held: a layer's codes are one row per token of its heads' codes side by side (each head at its width; a
buffer per layer where the layers' rows differ in length), their bytes the budget's, the same for any recipe; the
recipe is the model's, spelled out by the engine before the pool is built (quality/calibrate.py resolve).
+vq and +norms8 blocks are held (C decodes block parts and 8-bit log scales; the scales' centres are shared state), and
+qjl's and +outliersN's (each key's residual sketch or kept entries beside its codes, coded and read in C).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import CacheGeometry, CacheSpec
from ..cache.format import POOL_DTYPE, POOL_EXAMPLES
from ..cache.names import compressed

#: dense block format -> storage dtype
DENSE_FORMATS = {"dense": torch.float32, "dense-f16": torch.float16, "dense-bf16": torch.bfloat16}
#: the dtype of whatever a compressed format keeps in full precision (the int formats' open key group)
CODED_DTYPE = getattr(torch, POOL_DTYPE)
EXAMPLES = POOL_EXAMPLES


@dataclass(frozen=True)
class BlockFormat:
    name: str                   # canonical: dense-f16, int4+g16, tq4
    kind: str                   # "dense" | "int" | "tq"
    dtype: torch.dtype          # dense: the storage dtype; coded: CODED_DTYPE
    config: object | None       # QuantizedConfig / TurboQuantConfig of the single-sequence cache
    block_bytes: int            # one block of block_size tokens, every layer, K and V
    shared_bytes: int = 0       # once per pool
    sequence_bytes: int = 0     # per running sequence (batch slot)

    @property
    def cache_name(self) -> str:
        """The single-sequence cache that stores and reads tokens exactly as these blocks do."""
        return "dense" if self.kind == "dense" else self.name


def block_format(name: str, geometry: CacheGeometry, block_size: int) -> BlockFormat:
    """Parse a block format name; ConfigError (one line) for anything the pool cannot hold (CacheSpec.supports)."""
    spec = CacheSpec.parse(name, "pool")
    held = spec.pool_bytes(geometry, block_size)                  # the refusals, and the bytes by the caches' formula
    if spec.base == "dense":
        return BlockFormat(held.name, "dense", DENSE_FORMATS[held.name], None, held.block)
    config = compressed(spec.pool_spec(block_size))[1]
    return BlockFormat(held.name, spec.base, CODED_DTYPE, config, held.block, held.shared, held.sequence)
