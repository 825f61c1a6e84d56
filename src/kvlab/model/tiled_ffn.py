"""SwiGLU of a prompt chunk over native (GGUF block) weights, a tile of the hidden width at a time.

FeedForward's plain path for a chunk of T rows holds the whole (T, 2F) gate|up projection, the (T, F) product
and the fp32 copy the multi-row path dequantizes (SmolLM2 at T = 512: 6 + 3 + 2.3 MB per tile), so the largest
transients of a prefill, and the heap's holes they leave, come from the feed-forward. Here the hidden width F is
cut into tiles of FFN_TILE: for each tile only its gate rows, up rows and down columns are dequantized (a 512-wide
tile of SmolLM2: 1.2 MB each), its (T, tile) activations computed, and its share of the down product added to
the output in place. Every GEMM keeps all T rows. The result is the plain path's sum split over the tiles (the
down product's fp32 rounding differs in the last bits).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..kernels import BLOCK_TYPES
from .blockquant import GEMM_MAX_ROWS, BlockQuantLinear, dequantize_blocks, gemm_enabled

FFN_TILE = 512  # hidden units per tile: a whole number of 32-weight blocks


def tiled_applies(gate_up, down, x: torch.Tensor) -> bool:
    """Whether tiled_swiglu runs this call: native fp32 weights without bias, a multi-row fp32 CPU input (the calls
    that would dequantize whole matrices); decode steps and every other case keep FeedForward's plain path."""
    return (isinstance(gate_up, BlockQuantLinear) and isinstance(down, BlockQuantLinear)
            and gate_up.bias is None and down.bias is None and gate_up.activations == down.activations == "fp32"
            and x.device.type == "cpu" and x.dtype == torch.float32 and math.prod(x.shape[:-1]) > GEMM_MAX_ROWS
            and gemm_enabled())


def block_rows(linear: BlockQuantLinear, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of the layer's weight, dequantized: (stop - start, in) fp32."""
    return dequantize_blocks(linear.block_type, linear.blocks[start:stop], linear.in_features)


def block_cols(linear: BlockQuantLinear, start: int, stop: int) -> torch.Tensor:
    """Columns [start, stop) of the layer's weight (multiples of 32: whole blocks), dequantized: (out, stop - start) fp32."""
    _, per_block, block_bytes = BLOCK_TYPES[linear.block_type]
    blocks = linear.blocks[:, start // per_block * block_bytes:stop // per_block * block_bytes].contiguous()  # (out, bytes)
    return dequantize_blocks(linear.block_type, blocks, stop - start)


def tiled_swiglu(x: torch.Tensor, gate_up: BlockQuantLinear, down: BlockQuantLinear) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) for x (..., C), gate|up fused as (2F, C) blocks and down as (C, F) blocks."""
    hidden = down.in_features
    rows = x.reshape(-1, x.shape[-1])                                               # (N, C)
    out = None
    for start in range(0, hidden, FFN_TILE):
        stop = min(hidden, start + FFN_TILE)
        gate = rows @ block_rows(gate_up, start, stop).t()                           # (N, tile)
        up = rows @ block_rows(gate_up, hidden + start, hidden + stop).t()           # (N, tile)
        h = F.silu(gate).mul_(up)                                                    # (N, tile)
        del gate, up
        w_down = block_cols(down, start, stop)                                       # (C, tile)
        out = h @ w_down.t() if out is None else out.addmm_(h, w_down.t())          # (N, C): this tile's share added
        del h, w_down
    return out.view(*x.shape[:-1], down.out_features)                               # (..., C)
