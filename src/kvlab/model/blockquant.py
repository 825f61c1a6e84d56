"""Linear layers that hold GGUF quantized blocks (Q4_0, Q4_1, Q8_0) instead of fp32 weights.

A BlockMatrix is a (rows, cols) weight kept as its GGUF bytes: `data` (rows, row_bytes) uint8, each row the bytes
of its cols / 32 blocks with the blocks' fp16 scales gathered at the front (`split_rows`): [d of every block | m of
every block (Q4_1) | each block's quants (16 bytes of nibbles, 32 int8 for Q8_0)]. The same bytes as the file's row
(a row of one block is the file's block), laid out so that a kernel loads sixteen blocks' scales with one vector
load instead of gathering them from sixteen blocks (llama.cpp repacks its CPU weights for the same reason).

BlockQuantLinear multiplies one fp32 row straight from the blocks with the C kernel (kvlab.kernels), reading
~5-8.5 bits per weight instead of 32, and a few rows (a batched decode step: up to GEMM_MAX_ROWS) with the block
GEMM kernel, which dequantizes each block in registers and uses it for 8 rows at once, so no fp32 copy of the
matrix is made. More rows (prompt chunks, eval windows), no kernel, or KVLAB_NO_GEMM=1 (the reference path the
GEMM is tested against): the matrix is dequantized to fp32 and F.linear is used. The weight values are the file's,
exactly: only the fp32 summation order of the kernels differs from the dense path.

Opt-in (`activations="int8"`, the loader's weights="native-q8"): every call (a decode token, batched decode, prompt
chunks) quantizes the activations to int8 per 32-block and takes integer dot products with the weight codes
(kernels/q8gemm.c: row dots for a few rows, a packed kernel for more, VNNI where the CPU has it; reference:
kvlab.model.int8act), as llama.cpp's CPU path does: faster than the fp32 paths (a decode token's products 1.2-1.4x
on an AVX2 CPU, 16 rows ~1.9x), at the price of the activation rounding (not equal to the dense path; never the
default).

Rows of a BlockMatrix are whole blocks, so fusing q|k|v or gate|up is a concatenation of byte rows and
llama.cpp's Q/K RoPE row permutation is undone by permuting byte rows, as for fp32 rows.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import ConfigError, ModelFileError
from ..kernels import BLOCK_TYPES, block_kernel
from ..kernels.q8gemm import q8_kernel_for
from ..sources.native import native_parts, native_weight_bytes, supported  # noqa: F401  (the rule, importable from here)
from .weights import unpermute_rope_rows


@dataclass
class BlockMatrix:
    """A (rows, cols) weight as GGUF blocks: data (rows, row_bytes) uint8 of type `block_type`, rows in split_rows'
    layout (BlockMatrix.from_gguf makes it from a file's tensor, BlockMatrix.of_gguf_rows from a file's row bytes)."""

    block_type: str
    data: torch.Tensor
    cols: int

    def __post_init__(self):
        if self.block_type not in BLOCK_TYPES:
            raise ConfigError(f"block type {self.block_type!r} is not one of {', '.join(BLOCK_TYPES)}")
        _, per_block, block_bytes = BLOCK_TYPES[self.block_type]
        if self.cols % per_block:
            raise ModelFileError(f"{self.block_type} matrix with {self.cols} columns: not a whole number of {per_block}-weight blocks")
        row_bytes = self.cols // per_block * block_bytes
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or self.data.shape[1] != row_bytes:
            raise ModelFileError(
                f"{self.block_type} block buffer of shape {tuple(self.data.shape)} ({self.data.dtype}) does not hold rows × {row_bytes} bytes"
            )

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @staticmethod
    def from_gguf(tensor) -> "BlockMatrix":
        """A 2-D GGUF tensor of a supported block type -> its bytes, read from the file (kvlab.sources.gguf.GGUFTensor.read:
        not through the mmap, whose touched pages would stay resident next to the copy)."""
        cols = int(tensor.shape[0])  # GGUF lists the fastest-moving dim (columns) first
        raw = tensor.read()                                                       # (rows, row_bytes) uint8
        return BlockMatrix.of_gguf_rows(tensor.tensor_type.name, torch.from_numpy(raw).reshape(-1, raw.shape[-1]), cols)

    @staticmethod
    def of_gguf_rows(block_type: str, data: torch.Tensor, cols: int) -> "BlockMatrix":
        """(rows, row_bytes) uint8 rows as a GGUF file holds them -> a BlockMatrix; `data` is rearranged in place."""
        matrix = BlockMatrix(block_type, data, cols)                              # checks the type and shape first
        for start in range(0, data.shape[0], SPLIT_ROWS_AT_ONCE):                 # a transient of at most this many rows
            rows = data[start:start + SPLIT_ROWS_AT_ONCE]
            rows.copy_(split_rows(block_type, rows))
        return matrix


#: rows split_rows rearranges at a time while a matrix loads (~1.5 MiB of SmolLM2's embedding rows)
SPLIT_ROWS_AT_ONCE = 4096
#: bytes of fp16 scales a GGUF block starts with, d (and m for Q4_1), before its quants
SCALE_BYTES = {"Q4_0": 2, "Q4_1": 4, "Q8_0": 2}


def split_rows(block_type: str, data: torch.Tensor) -> torch.Tensor:
    """(rows, row_bytes) uint8 rows of GGUF blocks -> the same bytes with each row's scales in front:
    [d_0 .. d_{n-1} | m_0 .. m_{n-1} (Q4_1) | quants_0 .. quants_{n-1}], n blocks a row (a new tensor)."""
    _, _, block_bytes = BLOCK_TYPES[block_type]
    rows = data.shape[0]
    blocks = data.reshape(rows, data.shape[1] // block_bytes, block_bytes)       # (R, n, bytes)
    head = SCALE_BYTES[block_type]
    fields = [blocks[..., at:at + 2] for at in range(0, head, 2)] + [blocks[..., head:]]   # d, (m,) quants
    return torch.cat([f.reshape(rows, -1) for f in fields], dim=1)               # (R, row_bytes)


def dequantize_blocks(block_type: str, data: torch.Tensor, cols: int) -> torch.Tensor:
    """(rows, row_bytes) uint8 blocks -> (rows, cols) fp32, with the C kernel when there is one, else torch."""
    kernel = block_kernel()
    if kernel is not None and data.is_contiguous():
        return kernel.dequantize(block_type, data)
    return _dequantize_torch(block_type, data, cols)


def _dequantize_torch(block_type: str, data: torch.Tensor, cols: int) -> torch.Tensor:
    """The same arithmetic in torch (no compiler needed): d * q + m per block, exact in fp32."""
    codes, d, m = block_fields(block_type, data, cols)
    weights = d[..., None] * codes.float()                                        # (R, B, 32)
    return (weights if m is None else weights + m[..., None]).reshape(data.shape[0], cols)


def block_fields(block_type: str, data: torch.Tensor, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(R, row_bytes) rows in split_rows' layout -> signed integer codes (R, B, 32) int32 (Q4_0's -8 applied), d (R, B)
    fp32 and, for Q4_1, m (R, B) fp32 (else None): weight = d · code (+ m)."""
    _, per_block, _ = BLOCK_TYPES[block_type]
    rows, n = data.shape[0], cols // per_block
    head = SCALE_BYTES[block_type]
    d = data[:, :2 * n].contiguous().view(torch.float16).float()                  # (R, B)
    quants = data[:, head * n:].reshape(rows, n, -1)                              # (R, B, 16 or 32)
    if block_type == "Q8_0":
        return quants.contiguous().view(torch.int8).int(), d, None                # (R, B, 32)
    q = torch.cat([quants & 0x0F, quants >> 4], dim=-1).int()                    # (R, B, 32): low then high
    if block_type == "Q4_1":
        return q, d, data[:, 2 * n:4 * n].contiguous().view(torch.float16).float()
    return q - 8, d, None


# Up to this many rows (a decode step for a batch of sequences) the block GEMM wins: it reads each weight once
# and never writes an fp32 copy. Beyond it (prompt chunks) dequantizing one matrix at a time and multiplying
# with torch's GEMM wins: 0.93x at 64 rows, 0.59x at 512 (bench/block_gemm.py, 1 thread; docs/benchmarks.md).
GEMM_MAX_ROWS = 48


# Beyond GEMM_MAX_ROWS the matrix is dequantized and multiplied a tile of weight rows at a time, each product written
# into its columns of the output: the fp32 copy alive at once is one tile of at most DEQUANT_TILE_BYTES (512 rows at
# SmolLM2's 576 columns, 192 rows of its 1,536-wide down projection), not the whole matrix (2.2 MB for the q|k|v,
# 7 MB for the gate|up), the size of a prompt chunk's other transients, so the heap reuses their holes; within
# ~1-5 % of whole matrices' speed (GEMMs of 512 rows). Tiles are whole multiples of DEQUANT_ROW_STEP rows.
DEQUANT_TILE_BYTES = 512 * 576 * 4
DEQUANT_ROW_STEP = 64


def dequant_tile_rows(in_features: int) -> int:
    """Weight rows per dequantized tile for a matrix of `in_features` columns (at least DEQUANT_ROW_STEP)."""
    fitting = DEQUANT_TILE_BYTES // (4 * max(1, in_features))
    return max(DEQUANT_ROW_STEP, fitting // DEQUANT_ROW_STEP * DEQUANT_ROW_STEP)


ACTIVATIONS = ("fp32", "int8")


def gemm_enabled() -> bool:
    """Whether several rows go through the block GEMM kernel; KVLAB_NO_GEMM=1 selects the reference path
    (dequantize the whole matrix, F.linear). Read on every call, like KVLAB_NO_KERNEL."""
    return not os.environ.get("KVLAB_NO_GEMM")


class BlockQuantLinear(nn.Module):
    """y = x Wᵀ + b with W held as GGUF blocks; fp32 CPU rows go through the block GEMV (one row) or GEMM kernel."""

    def __init__(self, matrix: BlockMatrix, bias: torch.Tensor | None = None, activations: str = "fp32"):
        super().__init__()
        if activations not in ACTIVATIONS:
            raise ConfigError(f"activations {activations!r}: choose {' or '.join(ACTIVATIONS)}")
        self.activations = activations
        self.block_type = matrix.block_type
        self.in_features, self.out_features = matrix.cols, matrix.rows
        self.register_buffer("blocks", matrix.data.contiguous())                 # (out, row_bytes) uint8
        self.bias = None if bias is None else nn.Parameter(bias)

    def dequantized(self) -> torch.Tensor:
        """(out, in) fp32 weight: the exact values the blocks encode."""
        return dequantize_blocks(self.block_type, self.blocks, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = block_kernel()
        one_row = x.numel() == x.shape[-1]
        rows = math.prod(x.shape[:-1])                                            # no division: a 0-wide x is legal
        if self.activations == "int8" and x.dtype == torch.float32 and self.in_features:
            q8 = q8_kernel_for(x.device)
            if q8 is not None:
                return self._finish(q8.gemm(self.block_type, self.blocks, x.reshape(-1, self.in_features).contiguous()), x)
        if x.device.type == "cpu" and x.dtype == torch.float32 and rows > GEMM_MAX_ROWS and gemm_enabled():
            return self._finish(self._tiled_product(x.reshape(-1, self.in_features)), x)
        if (kernel is None or x.device.type != "cpu" or x.dtype != torch.float32 or rows > GEMM_MAX_ROWS
                or not (one_row or gemm_enabled())):
            return F.linear(x, self.dequantized().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        if one_row:
            y = kernel.gemv(self.block_type, self.blocks, x.reshape(-1).contiguous())           # (out,)
        else:
            y = kernel.gemm(self.block_type, self.blocks, x.reshape(-1, self.in_features).contiguous())  # (rows, out)
        return self._finish(y, x)

    def _tiled_product(self, x: torch.Tensor) -> torch.Tensor:
        """x (rows, in) fp32 -> x Wᵀ (rows, out): W dequantized a tile of rows at a time (dequant_tile_rows), each
        tile's product written in place into its columns of the output (the same dot products as F.linear on the whole
        matrix)."""
        y = x.new_empty(x.shape[0], self.out_features)                                # (rows, out)
        step = dequant_tile_rows(self.in_features)
        for start in range(0, self.out_features, step):
            tile = dequantize_blocks(self.block_type, self.blocks[start:start + step], self.in_features)  # (n, in)
            torch.mm(x, tile.t(), out=y[:, start:start + tile.shape[0]])              # (rows, n) columns of y
            del tile                                                                  # before the next one exists
        return y

    def _finish(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y (rows, out) or (out,) from a kernel -> + bias, shaped (..., out) like x."""
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], -1)                                          # (..., out)

    def extra_repr(self) -> str:
        extra = ", activations=int8" if self.activations == "int8" else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, blocks={self.block_type}{extra}"


def set_activations(model: nn.Module, activations: str) -> int:
    """Set every BlockQuantLinear of `model` to fp32 or int8 activations; returns how many there are."""
    if activations not in ACTIVATIONS:
        raise ConfigError(f"activations {activations!r}: choose {' or '.join(ACTIVATIONS)}")
    layers = [m for m in model.modules() if isinstance(m, BlockQuantLinear)]
    for layer in layers:
        layer.activations = activations
    return len(layers)


class BlockQuantEmbedding(nn.Module):
    """Token embedding held as GGUF blocks: a lookup dequantizes only the gathered rows."""

    def __init__(self, matrix: BlockMatrix):
        super().__init__()
        self.block_type = matrix.block_type
        self.num_embeddings, self.embedding_dim = matrix.rows, matrix.cols
        self.register_buffer("blocks", matrix.data.contiguous())                 # (vocab, row_bytes) uint8

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = self.blocks.index_select(0, tokens.reshape(-1))                    # (N, row_bytes)
        values = dequantize_blocks(self.block_type, rows, self.embedding_dim)      # (N, C)
        return values.view(*tokens.shape, self.embedding_dim)                      # (..., C)

    def as_linear(self) -> BlockQuantLinear:
        """The tied output head over these same blocks (one buffer, no fp32 copy)."""
        return BlockQuantLinear(BlockMatrix(self.block_type, self.blocks, self.embedding_dim))

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, blocks={self.block_type}"


# -- which of a GGUF's matrices the Decoder keeps as blocks -----------------------------------------
def gguf_block_matrices(tensors: dict, cfg, permute_qk: bool) -> dict[str, BlockMatrix]:
    """The native modules' BlockMatrix, fused and with Q/K rows un-permuted like the fp32 path."""
    matrices = {}
    for module, found in native_parts(tensors, cfg.n_layers).items():
        pieces = [BlockMatrix.from_gguf(t) for t in found]
        if module.endswith("attn.qkv") and permute_qk:
            pieces[0].data = unpermute_rope_rows(pieces[0].data, cfg.n_heads)
            pieces[1].data = unpermute_rope_rows(pieces[1].data, cfg.n_kv_heads)
        data = torch.cat([p.data for p in pieces], dim=0) if len(pieces) > 1 else pieces[0].data
        matrices[module] = BlockMatrix(pieces[0].block_type, data.contiguous(), pieces[0].cols)
    return matrices
