"""An integer layer as the C code codes and reads it (kernels/decode.c `Quantized`), for a single cache and for the
serving pool alike.

`Quantized` describes one layer's codes (cache/quantized.py: keys coded per channel over groups of G tokens, values
per group of Gv channels per token, the open key group's keys staged in fp32) and where its rows lie:
    single cache   codes, value scales (Hkv, slots, ...), key scales (Hkv, ⌈slots/G⌉, hd), stage (Hkv, G, hd)
    serving pool   codes, value scales (slots, Hkv, ...), key scales (slots/G, Hkv, hd), a stage per running
                   sequence (rows, G, Hkv, hd)
`code_tokens` codes a step's K/V into the pool with kvlab_int_code_tokens, which stores each token as the fused
decode step stores its one (int_store); QuantizedCache's torch code is its reference (tests/test_int_kernel.py).
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
                ("meta_group_stride", c_int64), ("stage_head_stride", c_int64), ("stage_row_stride", c_int64)]


def single_layout(q: Quantized) -> Quantized:
    """A single cache's rows (head-major): see the module docstring."""
    G, S = q.group, q.slots
    q.head_stride, q.slot_stride, q.meta_head_stride, q.meta_group_stride = S, 1, -(-S // G), 1
    q.stage_head_stride, q.stage_row_stride = G, 1
    return q


def pool_layer(buffers: dict[str, torch.Tensor], stage: torch.Tensor, bits: int, group: int, value_group: int,
               what: str) -> Quantized:
    """One pool layer's codes: buffers {k_codes, v_codes (slots, Hkv, row), k_scale, k_zero (slots/G, Hkv, hd),
    v_scale, v_zero (slots, Hkv, hd/Gv)} and the layer's stages (rows, G, Hkv, hd) fp32, checked here."""
    slots, H, _ = buffers["k_codes"].shape
    hd = stage.shape[-1]
    row = packed_nbytes(hd, bits)
    shapes = {"k_codes": ((slots, H, row), torch.uint8), "v_codes": ((slots, H, row), torch.uint8),
              "k_scale": ((slots // group, H, hd), torch.float16), "k_zero": ((slots // group, H, hd), torch.float16),
              "v_scale": ((slots, H, hd // value_group), torch.float16), "v_zero": ((slots, H, hd // value_group), torch.float16)}
    q = Quantized(bits=bits, group=group, value_group=value_group, slots=slots, k_row_bytes=row, v_row_bytes=row)
    for name, (shape, dtype) in shapes.items():
        check_buffer(what, name, buffers[name], dtype, shape)
        setattr(q, name, buffers[name].data_ptr())
    check_buffer(what, "key stage", stage, torch.float32, (stage.shape[0], group, H, hd))
    q.k_stage = stage.data_ptr()
    q.head_stride, q.slot_stride, q.meta_head_stride, q.meta_group_stride = 1, H, 1, H
    q.stage_head_stride, q.stage_row_stride = 1, H
    q.checked = (H, hd, stage.shape[0])   # what the buffers were checked for: KV heads, head dim, stage rows
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
