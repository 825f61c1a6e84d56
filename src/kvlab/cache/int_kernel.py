"""An integer layer as the C code codes and reads it (kernels/decode.c `Quantized`), for a single cache and for the
serving pool alike.

`Quantized` describes one layer's codes (cache/quantized.py: keys coded per channel over groups of G tokens, values
per group of Gv channels per token, the open key group's keys staged in fp32) and where its rows lie, in the blocks
of cache/blocks.py IntBlocks:
    single cache   one block: codes, value scales (Hkv, slots, ...), key scales (Hkv, ⌈slots/G⌉, hd), stage (G, Hkv, hd)
    serving pool   codes, value scales (n_blocks, Hkv, block_size, ...), key scales (n_blocks, Hkv, block_size/G, hd),
                   a stage per running sequence (rows, G, Hkv, hd)
`code_tokens` codes a step's K/V with kvlab_int_code_tokens, which stores each token as the fused decode step stores
its one (int_store): the pool's tokens, and a single cache's prompt chunks (`blocks_layer` over its blocks, one per
sequence); QuantizedCache's torch code is its reference (tests/test_int_kernel.py).
"""

from __future__ import annotations

import ctypes
from ctypes import c_float, c_int32, c_int64, c_void_p

import torch

from ..errors import ConfigError
from ..kernels import check_buffer
from .packing import packed_nbytes


class Quantized(ctypes.Structure):
    _fields_ = [("bits", c_int32), ("group", c_int32), ("value_group", c_int32), ("slots", c_int32),
                ("k_row_bytes", c_int64), ("v_row_bytes", c_int64), ("k_codes", c_void_p), ("v_codes", c_void_p),
                ("k_scale", c_void_p), ("k_zero", c_void_p), ("v_scale", c_void_p), ("v_zero", c_void_p),
                ("k_stage", c_void_p), ("overflow_what", c_int32), ("overflow", c_float),
                ("head_stride", c_int64), ("slot_stride", c_int64), ("meta_head_stride", c_int64),
                ("meta_group_stride", c_int64), ("stage_head_stride", c_int64), ("stage_row_stride", c_int64),
                ("block_rows", c_int64), ("block_stride", c_int64), ("meta_block_stride", c_int64), ("stages", c_int64)]


def single_layout(q: Quantized, n_kv_heads: int) -> Quantized:
    """A single cache's rows (head-major, one block) and its stage (G, Hkv, hd): see the module docstring."""
    G, S = q.group, q.slots
    q.head_stride, q.slot_stride, q.meta_head_stride, q.meta_group_stride = S, 1, -(-S // G), 1
    q.stage_head_stride, q.stage_row_stride = 1, n_kv_heads
    q.block_rows, q.block_stride, q.meta_block_stride, q.stages = max(S, 1), 0, 0, 1
    return q


def pool_layer(buffers: dict[str, torch.Tensor], stage: torch.Tensor, bits: int, group: int, value_group: int,
               what: str) -> Quantized:
    """One pool layer's codes (`blocks_layer`), its stages (rows, G, Hkv, hd): a sequence spans blocks, so a key group
    must not straddle two."""
    bs = buffers["k_codes"].shape[2]
    if bs % group:
        raise ConfigError(f"{what}: key groups of {group} tokens do not tile blocks of {bs}")
    return blocks_layer(buffers, stage, bits, group, value_group, what)


def blocks_layer(buffers: dict[str, torch.Tensor], stage: torch.Tensor, bits: int, group: int, value_group: int,
                 what: str) -> Quantized:
    """One layer of cache/blocks.py IntBlocks as the C coder takes it, checked here: buffers {k_codes, v_codes
    (n_blocks, Hkv, block_size, row), k_scale, k_zero (n_blocks, Hkv, ⌈block_size/G⌉, hd), v_scale, v_zero (n_blocks,
    Hkv, block_size, hd/Gv)} and the layer's stages fp32, (rows, G, Hkv, hd): one per running sequence (the pool's), or
    per sequence of a single cache, each its one block."""
    n_blocks, H, bs, _ = buffers["k_codes"].shape
    hd = stage.shape[-1]
    row, n_groups = packed_nbytes(hd, bits), -(-bs // group)
    blocks, groups, n_vg = (n_blocks, H, bs), (n_blocks, H, n_groups, hd), hd // value_group
    shapes = {"k_codes": ((*blocks, row), torch.uint8), "v_codes": ((*blocks, row), torch.uint8),
              "k_scale": (groups, torch.float16), "k_zero": (groups, torch.float16),
              "v_scale": ((*blocks, n_vg), torch.float16), "v_zero": ((*blocks, n_vg), torch.float16)}
    q = Quantized(bits=bits, group=group, value_group=value_group, slots=n_blocks * bs, k_row_bytes=row, v_row_bytes=row)
    for name, (shape, dtype) in shapes.items():
        check_buffer(what, name, buffers[name], dtype, shape)
        setattr(q, name, buffers[name].data_ptr())
    check_buffer(what, "key stage", stage, torch.float32, (stage.shape[0], group, H, hd))
    q.k_stage = stage.data_ptr()
    q.block_rows, q.block_stride, q.meta_block_stride = bs, H * bs, H * n_groups
    q.head_stride, q.slot_stride, q.meta_head_stride, q.meta_group_stride = bs, 1, n_groups, 1
    q.stage_head_stride, q.stage_row_stride, q.stages = 1, H, stage.shape[0]
    q.checked = (H, hd)   # what the buffers were checked for: KV heads, head dim
    return q


def code_tokens(kernel, q: Quantized, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                stage_rows: torch.Tensor) -> bool:
    """Code k, v (n, Hkv, d) into the pool layer `q` describes: token r at position positions[r] into slot slots[r],
    its key staged in stage row stage_rows[r] (its sequence's; a sequence's tokens in position order). True when
    stored; False when the K/V are not finite or beyond float16's range (nothing written: the caller's torch
    reference names it)."""
    status = kernel.int_code_tokens(q, k.float().contiguous(), v.float().contiguous(), slots.to(torch.int64).contiguous(),
                                    positions.to(torch.int64).contiguous(), stage_rows.to(torch.int64).contiguous())
    if status < 0:
        raise ConfigError("integer coding: kvlab_int_code_tokens refused the layer's description")
    return status == 0
