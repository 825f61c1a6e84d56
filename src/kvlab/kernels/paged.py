"""ctypes front end of paged.c: attention of a ragged batch over K/V blocks (kvlab/serve/attention.py), dense
(`paged_attention`), TurboQuant codes (`tq_attention`, `tq_pool_layer`: serve/coded.py TurboPool) or integer codes
(`paged_int_attention`, IntPool).

paged.c is built into the one kernel library (SOURCES); these wrappers open that library by its path and
check the dtype, shape, contiguity and length of every buffer before C reads or writes it.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from ..bitplanes import packed_nbytes
from ..errors import ConfigError, KvlabError
from . import check_buffer

WHAT = "paged attention kernel"   # every message starts with it (_check's prefix too)
POOL_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
MAX_CODE_DIM = 512                    # paged.c MAX_DIM


@functools.lru_cache(maxsize=4)
def _function(library_path: str):
    fn = ctypes.CDLL(library_path).kvlab_paged_attention   # already loaded by kernels.block_kernel(): same handle
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i32, i32, i32, i32, ptr, ptr, i32, i64, ptr, i32, i32, i32, ptr, ptr, ctypes.c_float, i32, ptr, i32]
    fn.restype = i32
    return fn


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ConfigError(f"{WHAT}: {what}")


def paged_attention(kernel, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                    query_start: torch.Tensor, context_len: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """q (N, H, D) fp32; k_pool (n_blocks, Hkv, block_size, D), v_pool (n_blocks, Hkv, block_size, Dv) fp32/fp16/bf16
    (cache/blocks.py's layout); block_tables (S, max_blocks), query_start (S + 1,), context_len (S,) int32 -> (N, H, Dv)
    fp32. `kernel`: kvlab.kernels.block_kernel()."""
    _check(q.dim() == 3 and q.dtype == torch.float32 and q.is_contiguous(),
           f"q must be contiguous fp32 (N, H, D), got {tuple(q.shape)} {q.dtype}")
    N, H, D = q.shape
    _check(k_pool.dim() == 4 and v_pool.dim() == 4 and k_pool.shape[:3] == v_pool.shape[:3] and k_pool.shape[3] == D,
           f"pools must be (n_blocks, Hkv, block_size, {D}) and (n_blocks, Hkv, block_size, Dv), got "
           f"{tuple(k_pool.shape)} and {tuple(v_pool.shape)}")
    n_blocks, Hkv, block_size, Dv = v_pool.shape
    _check(k_pool.dtype == v_pool.dtype and k_pool.dtype in POOL_DTYPES, f"pool dtype {k_pool.dtype} is not fp32, fp16 or bf16")
    _check(k_pool.is_contiguous() and v_pool.is_contiguous(), "pools must be contiguous")
    _check(k_pool.device.type == "cpu" and q.device.type == "cpu", "tensors must be on the CPU")
    _check(Hkv > 0 and H % Hkv == 0, f"{H} query heads are not a multiple of {Hkv} KV heads")
    slots = n_blocks * block_size
    _check_layout(block_tables, query_start, context_len, slots, block_size)
    S = context_len.numel()
    out = torch.empty(N, H, Dv, dtype=torch.float32)
    status = _function(str(kernel.path))(
        q.data_ptr(), N, H, Hkv, D, Dv, k_pool.data_ptr(), v_pool.data_ptr(), POOL_DTYPES[k_pool.dtype], slots,
        block_tables.data_ptr(), S, block_tables.shape[1], block_size, query_start.data_ptr(), context_len.data_ptr(),
        scale, int(window), out.data_ptr(), torch.get_num_threads())
    _check(status != -2, "out of memory for the work list")
    _check(status == 0, f"refused the layout of {S} sequences over {slots} slots (a block id, length or offset out of range)")
    return out


def sequences_attention(kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int, scale: float,
                        window: int | None = None) -> torch.Tensor | None:
    """A single cache's read through paged_attention: q (B, H, T, D) fp32; k (B, Hkv, rows, D), v (B, Hkv, rows, Dv)
    contiguous, sequence b's rows (one block of `rows` each), the first n of them its keys in order, the queries the
    last T of those positions (causal, and the window) -> (B, H, T, Dv) fp32. None where C does not read it (no
    kernel: the cache's torch reference; another query dtype; no queries, or more than keys): torch reads it."""
    if kernel is None or q.dtype != torch.float32 or not 0 < q.shape[2] <= n:
        return None
    B, H, T, D = q.shape
    rows = q.transpose(1, 2).reshape(B * T, H, D).contiguous()                 # (B·T, H, D): each query row's heads
    tables = torch.arange(B, dtype=torch.int32).unsqueeze(1)                   # sequence b: block b
    starts = torch.arange(0, B * T + 1, T, dtype=torch.int32)
    lengths = torch.full((B,), n, dtype=torch.int32)
    out = paged_attention(kernel, rows, k, v, tables, starts, lengths, scale, window or 0)   # (B·T, H, Dv)
    return out.view(B, T, H, -1).transpose(1, 2)


@functools.lru_cache(maxsize=4)
def _int_function(library_path: str):
    fn = ctypes.CDLL(library_path).kvlab_paged_int_attention
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i32, i32, i32, i32, i32, ptr, ptr, ptr, i32, ptr, ptr, ptr, i32, i64, ptr, ptr, i64,
                   ptr, i32, i32, i32, ptr, ptr, ctypes.c_float, i32, ptr, i32]
    fn.restype = i32
    return fn


def _check_layout(block_tables: torch.Tensor, query_start: torch.Tensor, context_len: torch.Tensor, slots: int,
                  block_size: int) -> None:
    """The ragged layout's buffers (their values are checked in C before any is used as an index)."""
    _check(isinstance(block_size, int) and block_size > 0 and slots % block_size == 0,
           f"{slots} pool slots are not whole blocks of {block_size}")
    for name, t in (("block_tables", block_tables), ("query_start", query_start), ("context_len", context_len)):
        _check(isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.is_contiguous() and t.device.type == "cpu",
               f"{name} must be contiguous int32 on the CPU")
    S = context_len.numel()
    _check(context_len.dim() == 1 and query_start.dim() == 1 and query_start.numel() == S + 1,
           f"query_start must hold {S + 1} offsets for {S} sequences, got {query_start.numel()}")
    _check(block_tables.dim() == 2 and block_tables.shape[0] == S and block_tables.shape[1] > 0,
           f"block_tables must be ({S}, max_blocks), got {tuple(block_tables.shape)}")


def paged_int_attention(kernel, q: torch.Tensor, bits: int, k_codes: torch.Tensor, k_scale: torch.Tensor,
                        k_zero: torch.Tensor, v_codes: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor,
                        exact: torch.Tensor, exact_start: torch.Tensor, block_tables: torch.Tensor,
                        query_start: torch.Tensor, context_len: torch.Tensor, key_group: int,
                        scale: float, window: int = 0, value_dim: int | None = None) -> torch.Tensor:
    """Ragged attention straight from integer codes in blocks (paged.c kvlab_paged_int_attention, serve/coded.py IntPool),
    each query read as the single integer cache reads it (kernels/intcache.h): the same bits.

    q (N, H, D) fp32; blocks head-major as cache/blocks.py lays them out: k_codes (n_blocks, Hkv, block_size, packed
    bytes of D codes), v_codes (n_blocks, Hkv, block_size, packed bytes of Dv codes) uint8 with Dv = value_dim (None:
    D); k_scale, k_zero (n_blocks, Hkv, block_size / key_group, D) and v_scale, v_zero (n_blocks, Hkv, block_size,
    Dv / value group) fp16; exact (E, Hkv, D) fp32: each sequence's keys from its open key group on, sequence s's rows
    exact_start[s]:exact_start[s + 1] (int64, S + 1) the last of its context; the ragged layout as `paged_attention`
    -> (N, H, Dv) fp32. The query at position p reads the keys of the groups complete at p from their codes, the
    others exact (cache/quantized.py)."""
    _check(isinstance(q, torch.Tensor) and q.dim() == 3 and q.dtype == torch.float32 and q.is_contiguous()
           and q.device.type == "cpu", "q must be a contiguous fp32 (N, H, D) CPU tensor")
    N, H, D = q.shape
    _check(isinstance(bits, int) and 1 <= bits <= 8, f"integer codes are 1..8 bits, got {bits!r}")
    Dv = D if value_dim is None else value_dim
    _check(isinstance(Dv, int) and 0 < D <= MAX_CODE_DIM and 0 < Dv <= MAX_CODE_DIM,
           f"head dims {D}, {Dv!r} are not 1..{MAX_CODE_DIM}")
    _check(isinstance(k_codes, torch.Tensor) and k_codes.dim() == 4, "k_codes must be (n_blocks, Hkv, block_size, row bytes)")
    n_blocks, Hkv, block_size = k_codes.shape[:3]
    slots = n_blocks * block_size
    _check(Hkv > 0 and H % Hkv == 0, f"{H} query heads are not a multiple of {Hkv} KV heads")
    _check(isinstance(key_group, int) and key_group > 0 and block_size > 0 and block_size % key_group == 0,
           f"key group {key_group} does not divide the block size {block_size}")
    _check(isinstance(v_scale, torch.Tensor) and v_scale.dim() == 4 and v_scale.shape[3] > 0 and Dv % v_scale.shape[3] == 0,
           f"value scales must be (n_blocks, Hkv, block_size, value groups dividing {Dv})")
    n_vg = v_scale.shape[3]
    groups = (n_blocks, Hkv, block_size // key_group, D)
    for name, t, dtype, shape in (("k_codes", k_codes, torch.uint8, (n_blocks, Hkv, block_size, packed_nbytes(D, bits))),
                                  ("v_codes", v_codes, torch.uint8, (n_blocks, Hkv, block_size, packed_nbytes(Dv, bits))),
                                  ("k_scale", k_scale, torch.float16, groups), ("k_zero", k_zero, torch.float16, groups),
                                  ("v_scale", v_scale, torch.float16, (n_blocks, Hkv, block_size, n_vg)),
                                  ("v_zero", v_zero, torch.float16, (n_blocks, Hkv, block_size, n_vg))):
        check_buffer(WHAT, name, t, dtype, shape)
    _check_layout(block_tables, query_start, context_len, slots, block_size)
    S = context_len.numel()
    _check(isinstance(exact, torch.Tensor) and exact.dim() == 3, "exact keys must be (rows, Hkv, D)")
    check_buffer(WHAT, "exact keys", exact, torch.float32, (exact.shape[0], Hkv, D))
    check_buffer(WHAT, "exact_start", exact_start, torch.int64, (S + 1,))
    out = torch.empty(N, H, Dv, dtype=torch.float32)
    status = _int_function(str(kernel.path))(
        q.data_ptr(), N, H, Hkv, D, Dv, bits, k_codes.data_ptr(), k_scale.data_ptr(), k_zero.data_ptr(), key_group,
        v_codes.data_ptr(), v_scale.data_ptr(), v_zero.data_ptr(), Dv // n_vg, slots, exact.data_ptr(),
        exact_start.data_ptr(), exact.shape[0], block_tables.data_ptr(), S, block_tables.shape[1], block_size,
        query_start.data_ptr(), context_len.data_ptr(), scale, int(window or 0), out.data_ptr(), torch.get_num_threads())
    if status == -2:
        raise KvlabError("paged int attention: no memory for the kernel's work items")
    _check(status == 0, f"refused the layout of {S} sequences over {slots} slots (a block id, length, offset or exact-key "
                        f"range out of range)")
    return out


# -- a layer of a TurboQuant pool in one call (tqcodes.h kvlab_tq_pool_layer) -----------------------------------------
class Ragged(ctypes.Structure):   # paged.h Ragged: a ragged layout's buffers
    _fields_ = [("n_seqs", ctypes.c_int32), ("max_blocks", ctypes.c_int32), ("block_size", ctypes.c_int32),
                ("block_tables", ctypes.c_void_p), ("query_start", ctypes.c_void_p), ("context_len", ctypes.c_void_p)]

    @classmethod
    def of(cls, block_tables: torch.Tensor, query_start: torch.Tensor, context_len: torch.Tensor, slots: int,
           block_size: int) -> "Ragged":
        """The struct after checking the buffers (C checks their values before any is used as an index)."""
        _check_layout(block_tables, query_start, context_len, slots, block_size)
        return cls(context_len.numel(), block_tables.shape[1], block_size, block_tables.data_ptr(), query_start.data_ptr(),
                   context_len.data_ptr())


class TqPoolLayer(ctypes.Structure):   # tqcodes.h: a pool layer's Coded, its sink rows; made by cache/tq_kernel.py
    _fields_ = [("coded", ctypes.c_void_p), ("sink", ctypes.c_int32), ("sink_type", ctypes.c_int32),
                ("sink_entries", ctypes.c_int32), ("sink_k", ctypes.c_void_p), ("sink_v", ctypes.c_void_p)]


class TqStep(ctypes.Structure):   # tqcodes.h: what every layer of a step reads
    _fields_ = [("entries", ctypes.c_void_p), ("rope_cos", ctypes.c_void_p), ("rope_sin", ctypes.c_void_p),
                ("rope_rows", ctypes.c_int64)]

    @classmethod
    def of(cls, entries: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor] | None, n_seqs: int,
           d: int) -> "TqStep":
        """entries (n_seqs,) int32: each sequence's sink entry (+sinkN), or None; rope: +prerope's cos, sin (rows, d)
        of positions 0 .., or None. Checked here; the struct points at them without holding them."""
        if entries is not None:
            check_buffer(WHAT, "sink entries", entries, torch.int32, (n_seqs,))
        rows = 0
        if rope is not None:
            rows = rope[0].shape[0] if isinstance(rope[0], torch.Tensor) and rope[0].dim() == 2 else -1
            for name, t in zip(("RoPE cos", "RoPE sin"), rope):
                check_buffer(WHAT, name, t, torch.float32, (rows, d))
        step = cls(None if entries is None else entries.data_ptr(), None if rope is None else rope[0].data_ptr(),
                   None if rope is None else rope[1].data_ptr(), rows)
        step.checked = (n_seqs, d)
        return step


@functools.lru_cache(maxsize=4)
def _tq_attention_function(library_path: str):
    fn = ctypes.CDLL(library_path).kvlab_tq_attention
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i32, i32, i32, ctypes.POINTER(Ragged), i64, ctypes.POINTER(TqStep), ptr, i64, i64, ctypes.c_float,
                   i32, ptr, ptr, i32]
    fn.restype = i32
    return fn


def tq_attention(kernel, coded, q: torch.Tensor, block_tables: torch.Tensor, query_start: torch.Tensor,
                 context_len: torch.Tensor, step: TqStep, scale: float, window: int = 0, first_key: int = 0,
                 key_end: int | None = None, with_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Ragged attention straight from a TurboQuant layer's codes in blocks (paged.c kvlab_tq_attention): `coded` the
    layer as cache/tq_kernel.py describes it (its buffers checked for coded.checked = (Hkv, D)), read through the block
    tables in blocks of its block rows. q (N, H, D) fp32 as the codes are read (rotated, key weights applied); with
    +prerope q itself, each key rebuilt and turned to its position with `step`'s RoPE rows. Keys at positions
    [first_key, key_end) are read (+sinkN: the pool holds the first ones exact apart; a single cache's recent window
    follows its codes). -> (N, H, D) fp32 in the rotated domain
    = Σ_t p_t·v_norm_t·v̂_t, p = softmax_t(scale·k_norm_t·(q·k̂_t)) over each row's causal (and window) keys; with_lse
    also (N, H) the log of each row's softmax sum (-inf where the row read no key: its output is 0)."""
    Hkv, D = coded.checked
    _check(isinstance(q, torch.Tensor) and q.dim() == 3, "q must be (N, H, D)")
    N, H = q.shape[:2]
    _check(H % Hkv == 0, f"{H} query heads are not a multiple of {Hkv} KV heads")
    check_buffer(WHAT, "q", q, torch.float32, (N, H, D))
    _check(isinstance(first_key, int) and first_key >= 0, f"first_key must be >= 0, got {first_key}")
    _check(key_end is None or (isinstance(key_end, int) and key_end >= 0), f"key_end must be None or >= 0, got {key_end}")
    ragged = Ragged.of(block_tables, query_start, context_len, coded.slots, coded.block_rows)
    _check(step.checked == (ragged.n_seqs, D), f"the step's buffers were checked for {step.checked} (sequences, head dim), "
                                               f"not ({ragged.n_seqs}, {D})")
    out = torch.empty(N, H, D, dtype=torch.float32)
    lse = torch.empty(N, H, dtype=torch.float32) if with_lse else None
    status = _tq_attention_function(str(kernel.path))(
        ctypes.addressof(coded), H, Hkv, D, ctypes.byref(ragged), N, ctypes.byref(step), q.data_ptr(), first_key,
        -1 if key_end is None else key_end, scale,
        int(window or 0), out.data_ptr(), None if lse is None else lse.data_ptr(), torch.get_num_threads())
    if status == -2:
        raise KvlabError("TurboQuant attention: no memory for the kernel's work items")
    _check(status == 0, f"refused a TurboQuant layer over {ragged.n_seqs} sequences of {coded.slots} slots (a block id, "
                        f"length or RoPE row out of range, or a layout it cannot read)")
    return (out, lse) if with_lse else out


@functools.lru_cache(maxsize=4)
def _tq_layer_function(library_path: str):
    fn = ctypes.CDLL(library_path).kvlab_tq_pool_layer
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ctypes.POINTER(TqPoolLayer), i32, i32, i32, ctypes.POINTER(Ragged), i64, ctypes.POINTER(TqStep), ptr,
                   ptr, ptr, i64, ctypes.c_float, i32, ptr, i32]
    fn.restype = i32
    return fn


def tq_pool_layer(kernel, layer: TqPoolLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_tables: torch.Tensor,
                  query_start: torch.Tensor, context_len: torch.Tensor, block_size: int, step: TqStep, scale: float,
                  window: int = 0) -> torch.Tensor | None:
    """One layer of a TurboQuant pool step in one call (paged.c kvlab_tq_pool_layer): k, v (N, Hkv, D) fp32 (keys after
    RoPE) coded into each row's slot, a position below the layer's sink into its sequence's sink rows (step.entries);
    then q (N, H, D) fp32 after RoPE -> (N, H, D), each row's attention over its sequence's coded keys (and sink rows),
    in the model's domain. `layer`: cache/tq_kernel.py CodedLayers.pool_layer, its buffers checked for
    layer.checked = (Hkv, D, slots). None when a scale is not finite (the caller's torch reference names it)."""
    Hkv, D, slots = layer.checked
    _check(isinstance(q, torch.Tensor) and q.dim() == 3, "q must be (N, H, D)")
    N, H = q.shape[:2]
    _check(H % Hkv == 0, f"{H} query heads are not a multiple of {Hkv} KV heads")
    check_buffer(WHAT, "q", q, torch.float32, (N, H, D))
    check_buffer(WHAT, "keys", k, torch.float32, (N, Hkv, D))
    check_buffer(WHAT, "values", v, torch.float32, (N, Hkv, D))
    ragged = Ragged.of(block_tables, query_start, context_len, slots, block_size)
    _check(step.checked == (ragged.n_seqs, D), f"the step's buffers were checked for {step.checked} (sequences, head dim), "
                                               f"not ({ragged.n_seqs}, {D})")
    out = torch.empty(N, H, D, dtype=torch.float32)
    status = _tq_layer_function(str(kernel.path))(
        ctypes.byref(layer), H, Hkv, D, ctypes.byref(ragged), N, ctypes.byref(step), q.data_ptr(), k.data_ptr(), v.data_ptr(),
        Hkv * D, scale, int(window or 0), out.data_ptr(), torch.get_num_threads())
    if status == -2:
        raise KvlabError("TurboQuant pool layer: no memory for the kernel's work items")
    _check(status >= 0, f"refused a TurboQuant layer over {ragged.n_seqs} sequences of {slots} slots (a block id, length, "
                        f"offset, sink entry or RoPE row out of range, or a layout it cannot read)")
    return out if status == 0 else None
