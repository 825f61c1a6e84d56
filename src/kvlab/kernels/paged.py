"""ctypes front end of paged.c: attention of a ragged batch over K/V blocks (kvlab/serve/attention.py).

paged.c is built into the one kernel library (SOURCES); this wrapper opens that library by its path and
checks the dtype, shape, contiguity and length of every buffer before C reads or writes it.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from ..errors import ConfigError

POOL_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@functools.lru_cache(maxsize=4)
def _function(library_path: str):
    fn = ctypes.CDLL(library_path).kvlab_paged_attention   # already loaded by kernels.block_kernel(): same handle
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i32, i32, i32, i32, ptr, ptr, i32, i64, ptr, i32, i32, i32, ptr, ptr, ctypes.c_float, i32, ptr, i32]
    fn.restype = i32
    return fn


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ConfigError(f"paged attention kernel: {what}")


def paged_attention(kernel, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                    query_start: torch.Tensor, context_len: torch.Tensor, block_size: int, scale: float,
                    window: int = 0) -> torch.Tensor:
    """q (N, H, D) fp32; k_pool (slots, Hkv, D), v_pool (slots, Hkv, Dv) fp32/fp16/bf16; block_tables (S, max_blocks),
    query_start (S + 1,), context_len (S,) int32 -> (N, H, Dv) fp32. `kernel`: kvlab.kernels.block_kernel()."""
    _check(q.dim() == 3 and q.dtype == torch.float32 and q.is_contiguous(),
           f"q must be contiguous fp32 (N, H, D), got {tuple(q.shape)} {q.dtype}")
    N, H, D = q.shape
    _check(k_pool.dim() == 3 and v_pool.dim() == 3 and k_pool.shape[:2] == v_pool.shape[:2] and k_pool.shape[2] == D,
           f"pools must be (slots, Hkv, {D}) and (slots, Hkv, Dv), got {tuple(k_pool.shape)} and {tuple(v_pool.shape)}")
    slots, Hkv, Dv = v_pool.shape
    _check(k_pool.dtype == v_pool.dtype and k_pool.dtype in POOL_DTYPES, f"pool dtype {k_pool.dtype} is not fp32, fp16 or bf16")
    _check(k_pool.is_contiguous() and v_pool.is_contiguous(), "pools must be contiguous")
    _check(k_pool.device.type == "cpu" and q.device.type == "cpu", "tensors must be on the CPU")
    _check(Hkv > 0 and H % Hkv == 0, f"{H} query heads are not a multiple of {Hkv} KV heads")
    _check(block_size > 0 and slots % block_size == 0, f"{slots} pool slots are not whole blocks of {block_size}")
    for name, t in (("block_tables", block_tables), ("query_start", query_start), ("context_len", context_len)):
        _check(t.dtype == torch.int32 and t.is_contiguous() and t.device.type == "cpu",
               f"{name} must be contiguous int32 on the CPU")
    S = context_len.numel()
    _check(context_len.dim() == 1 and query_start.dim() == 1 and query_start.numel() == S + 1,
           f"query_start must hold {S + 1} offsets for {S} sequences, got {query_start.numel()}")
    _check(block_tables.dim() == 2 and block_tables.shape[0] == S and block_tables.shape[1] > 0,
           f"block_tables must be ({S}, max_blocks), got {tuple(block_tables.shape)}")
    out = torch.empty(N, H, Dv, dtype=torch.float32)
    status = _function(str(kernel.path))(
        q.data_ptr(), N, H, Hkv, D, Dv, k_pool.data_ptr(), v_pool.data_ptr(), POOL_DTYPES[k_pool.dtype], slots,
        block_tables.data_ptr(), S, block_tables.shape[1], block_size, query_start.data_ptr(), context_len.data_ptr(),
        scale, int(window), out.data_ptr(), torch.get_num_threads())
    _check(status == 0, f"refused the layout of {S} sequences over {slots} slots (a block id, length or offset out of range)")
    return out
