"""FusedBatchStep: every layer of an engine step in one C call (kernels/batchstep.c), over the dense block pool, a
TurboQuant pool or an integer pool (each layer's K/V coded and read by paged.c kvlab_tq_pool_layer or
kvlab_int_pool_layer, through the pool's descriptors).

The runner's module path (runner.py) runs a step's rows through the Decoder's Blocks: per layer a few dozen small
torch operations whose Python overhead was ~20% of a 16-row decode step. The fused step does the same arithmetic
in C: norms, the products (GGUF blocks through blockgemm.c, int8 activations through q8gemm.c where the model asks
for them, fp32 rows), RoPE at each row's position, K/V into each row's pool slot, paged attention (paged.c) over
each sequence's block table, SwiGLU, residuals. `head` then takes the rows the step samples in one more C call: the
final norm, the output head (through the same kernels the head's module picks) and each row's argmax, the greedy
token (torch.argmax over a 49,152-entry vocabulary took ~1.4 ms for 16 rows, the C pass ~0.1 ms). Drawing the
tokens of rows that sample stays in Python (sampling.py).

It reads the weights through the C structs of the model's fused decode step (model/fused.py), so it runs exactly
while that step is the model's: moving or casting the model drops `model.fused`, and with it this step.
`fused_batch_for` is the one place that decides whether a step takes it; the modules stay the reference.
"""

from __future__ import annotations

import ctypes
import os
import weakref
from contextlib import contextmanager
from ctypes import c_float, c_int32, c_int64, c_void_p

import torch

from ..errors import ConfigError, KvlabError, NonFiniteError
from ..kernels import block_kernel, check_buffer
from ..kernels.paged import POOL_DTYPES, Ragged
from ..model.blockquant import GEMM_MAX_ROWS, gemm_enabled
from ..model.fused import FusedDecodeStep
from ..model.fused_int import raise_range_error
from .attention import RaggedLayout
from .blocks import BlockPool
from .coded import IntPool, TurboPool

WHAT = "fused batch step"
OFF_ENV = "KVLAB_NO_FUSED_BATCH"   # set: every engine step through the modules


class _Pool(ctypes.Structure):   # batchstep.c Pool
    _fields_ = [("type", c_int32), ("n_layers", c_int32), ("n_kv_heads", c_int32), ("head_dim", c_int32),
                ("slots", c_int64), ("k", c_void_p), ("v", c_void_p), ("tq", c_void_p), ("tq_step", c_void_p),
                ("ints", c_void_p), ("stage_rows", c_void_p), ("failed_layer", c_int32)]


POOL_TQ, POOL_INT = 4, 5   # batchstep.c: a TurboQuant or integer pool, each layer through its descriptor


class FusedBatchStep:
    """Built once per fused decode step (it reads that step's weight structs); called for each engine step."""

    def __init__(self, model, decode_step: FusedDecodeStep, lib: ctypes.CDLL):
        self.config = model.config
        self._decode_step = weakref.ref(decode_step)   # weak: the model's step, not this one, keeps the weights alive
        self._lib = lib
        lib.kvlab_batch_step.argtypes = [c_void_p, c_void_p, c_int64, c_void_p, c_void_p, ctypes.POINTER(_Pool),
                                         ctypes.POINTER(Ragged), c_float, c_int32, c_void_p, c_int32]
        lib.kvlab_batch_step.restype = c_int32
        lib.kvlab_batch_head.argtypes = [c_void_p, c_void_p, c_int64, c_int32, c_void_p, c_void_p, c_int32]
        lib.kvlab_batch_head.restype = c_int32
        lib.kvlab_rows_argmax.argtypes = [c_void_p, c_int64, c_int64, c_void_p, c_int32]
        lib.kvlab_rows_argmax.restype = c_int32

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool: BlockPool | TurboPool | IntPool,
                 layout: RaggedLayout, scale: float, window: int | None, rows: list[int] | None = None) -> torch.Tensor:
        """x (1, N, C) embedded rows, cos/sin (N, D) at their positions -> (1, N, C) after every layer; each row's
        K/V written to its pool slot (found through the layout's block tables). A TurboPool codes them there (sink
        positions into the sink rows of each sequence's entry, `rows`: pool.rows_for of the step's sequences), an
        IntPool too (each sequence's open key group in its stage row, `rows`)."""
        cfg = self.config
        C, D, L = cfg.d_model, cfg.head_dim, cfg.n_layers
        if not isinstance(layout, RaggedLayout) or not isinstance(pool, (BlockPool, TurboPool, IntPool)):
            raise ConfigError(f"{WHAT}: needs a RaggedLayout over a dense BlockPool, a TurboPool or an IntPool, got "
                              f"{type(layout).__name__} over {type(pool).__name__}")
        S = layout.context_len.numel()
        check_buffer(WHAT, "query_start", layout.query_start, torch.int32, (S + 1,))
        check_buffer(WHAT, "context_len", layout.context_len, torch.int32, (S,))
        if layout.block_tables.dim() != 2:
            raise ConfigError(f"{WHAT}: block_tables must be (sequences, max blocks), got {tuple(layout.block_tables.shape)}")
        check_buffer(WHAT, "block_tables", layout.block_tables, torch.int32, (S, layout.block_tables.shape[1]))
        N = int(layout.query_start[-1])
        check_buffer(WHAT, "rows", x, torch.float32, (1, N, C), contiguous=False)
        check_buffer(WHAT, "rope cos", cos, torch.float32, (N, D))
        check_buffer(WHAT, "rope sin", sin, torch.float32, (N, D))
        if isinstance(window, bool) or not isinstance(window, (int, type(None))) or (window or 0) < 0:
            raise ConfigError(f"{WHAT}: window must be a non-negative number of tokens or None, got {window!r}")
        decode_step = self._decode_step()
        if decode_step is None:
            raise ConfigError(f"{WHAT}: the fused decode step whose weight structs it reads is gone")
        flags = decode_step.int8_flags()                                         # (4L + 1,): the layers', the head's
        check_buffer(WHAT, "int8 flags", flags, torch.uint8, (4 * L + 1,))
        pool_struct, held = self._pool_struct(pool, layout, rows)
        rows_out = torch.empty(N, C, dtype=torch.float32)
        rows_out.copy_(x[0])                                                      # (N, C): updated in place by C
        ragged = Ragged(S, layout.block_tables.shape[1], layout.block_size, layout.block_tables.data_ptr(),
                        layout.query_start.data_ptr(), layout.context_len.data_ptr())
        status = self._lib.kvlab_batch_step(
            ctypes.addressof(decode_step.weights), rows_out.data_ptr(), N, cos.data_ptr(), sin.data_ptr(),
            ctypes.byref(pool_struct), ctypes.byref(ragged), float(scale), int(window or 0), flags.data_ptr(),
            torch.get_num_threads())
        del held
        if status == -2:
            raise KvlabError(f"{WHAT}: no memory for the scratch rows of {N} tokens")
        if status == 1:
            what = "an integer key or value" if isinstance(pool, IntPool) else "a TurboQuant key or value scale"
            raise NonFiniteError(f"{WHAT}: {what} of the step is not finite")
        if status == 2:
            raise_range_error(pool.layer_structs().structs[pool_struct.failed_layer])   # the modules' message
        if status != 0:
            raise ConfigError(f"{WHAT} refused {S} sequences over {pool_struct.slots} pool slots (a block id, length or "
                              f"offset out of range, or a pool not shaped for this model)")
        if isinstance(pool, TurboPool):
            pool.sinks_written(L - 1, layout, rows)
        return rows_out.view(1, N, C)

    def _pool_struct(self, pool: BlockPool | TurboPool | IntPool, layout: RaggedLayout,
                     rows: list[int] | None) -> tuple[_Pool, object]:
        """batchstep.c's Pool over `pool`, checked, and what it points at that nothing else holds during the call."""
        cfg = self.config
        D, L = cfg.head_dim, cfg.n_layers
        if isinstance(pool, (TurboPool, IntPool)):   # each layer's descriptor was checked where it was made
            layers = pool.layer_structs()
            if layers is None or len(layers) != L or pool.geometry.n_kv_heads != cfg.n_kv_heads or pool.geometry.head_dim != D:
                raise ConfigError(f"{WHAT}: the {type(pool).__name__}'s layers are not {L} coded in C for this model")
        if isinstance(pool, IntPool):
            if rows is None or len(rows) != layout.context_len.numel():
                raise ConfigError(f"{WHAT}: an integer pool needs each sequence's stage row")
            stage_rows = torch.tensor(rows, dtype=torch.int32)                       # (S,)
            return _Pool(POOL_INT, L, cfg.n_kv_heads, D, pool.slots, None, None, None, None, ctypes.addressof(layers),
                         stage_rows.data_ptr()), stage_rows
        if isinstance(pool, TurboPool):
            if pool.sinks is not None and (rows is None or len(rows) != layout.context_len.numel()):
                raise ConfigError(f"{WHAT}: a pool with sink rows needs each sequence's entry")
            step = pool.step_struct(layout, rows)
            return _Pool(POOL_TQ, L, cfg.n_kv_heads, D, pool.slots, None, None, ctypes.addressof(layers),
                         ctypes.addressof(step)), step
        if pool.dtype not in POOL_DTYPES or pool.k.dim() != 5:
            raise ConfigError(f"{WHAT}: pool blocks of {pool.k.dtype} are not fp32, fp16 or bf16")
        if pool.block_size != layout.block_size:
            raise ConfigError(f"{WHAT}: the layout's blocks of {layout.block_size} tokens are not the pool's {pool.block_size}")
        shape = (L, pool.n_blocks, cfg.n_kv_heads, pool.block_size, D)           # cache/blocks.py's layout
        for name, t in (("pool keys", pool.k), ("pool values", pool.v)):
            check_buffer(WHAT, name, t, pool.dtype, shape)
        return _Pool(POOL_DTYPES[pool.dtype], L, cfg.n_kv_heads, D, pool.n_blocks * pool.block_size, pool.k.data_ptr(),
                     pool.v.data_ptr(), None, None), None

    def head(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (R, C) rows after every layer -> their logits (R, vocab), as the model's logits() computes them (the
        final norm, then the head's product: int8 activations where its module takes them),
        and each row's argmax (R,) int64."""
        decode_step = self._decode_step()
        if decode_step is None:
            raise ConfigError(f"{WHAT}: the fused decode step whose weight structs it reads is gone")
        int8 = bool(decode_step.int8_flags()[-1])
        R, C, vocab = x.shape[0], self.config.d_model, decode_step.weights.head.rows
        check_buffer(WHAT, "head rows", x, torch.float32, (R, C))
        logits = torch.empty(R, vocab, dtype=torch.float32)                      # (R, vocab)
        tokens = torch.empty(R, dtype=torch.int64)                               # (R,)
        status = self._lib.kvlab_batch_head(ctypes.addressof(decode_step.weights), x.data_ptr(), R, int(int8),
                                            logits.data_ptr(), tokens.data_ptr(), torch.get_num_threads())
        if status == -2:
            raise KvlabError(f"{WHAT}: no memory for the final norm of {R} rows")
        if status != 0:
            raise ConfigError(f"{WHAT}: the output head is not shaped ({vocab}, {C}) for this model")
        return logits, tokens

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (R, V) fp32 -> (R,) int64: torch.argmax(logits, dim=-1) (the first of equal values, the first nan)."""
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[1] == 0:
            raise ConfigError(f"{WHAT}: argmax needs (rows, values > 0) logits, got {getattr(logits, 'shape', logits)!r}")
        check_buffer(WHAT, "logits", logits, torch.float32, tuple(logits.shape))
        tokens = torch.empty(logits.shape[0], dtype=torch.int64)
        self._lib.kvlab_rows_argmax(logits.data_ptr(), logits.shape[0], logits.shape[1], tokens.data_ptr(),
                                    torch.get_num_threads())
        return tokens


_steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # fused decode step -> its batch step, while it lives


def _step_of(model) -> FusedBatchStep | None:
    """The batch step over the model's current fused decode step (built on first use), or None without one."""
    decode_step = getattr(model, "fused", None)
    if not isinstance(decode_step, FusedDecodeStep):
        return None
    step = _steps.get(decode_step)
    if step is None:
        kernel = block_kernel()
        if kernel is None or not hasattr(kernel.lib, "kvlab_batch_step"):
            return None
        step = _steps[decode_step] = FusedBatchStep(model, decode_step, kernel.lib)
    return step


def fused_batch_for(runner, n_rows: int) -> FusedBatchStep | None:
    """The fused step when it runs this step of `runner` as the modules would, else None (the module path): dense
    blocks in fp32/f16/bf16, or TurboQuant or integer blocks whose layers run in C (a model of one layer group; an
    integer pool's C coder takes an fp32 stage and value heads as wide as key heads) on the CPU, the C attention kernel
    chosen, the model's fused decode step in place, and at most GEMM_MAX_ROWS rows (more go through torch's GEMM in the
    modules, faster than the block GEMM)."""
    pool = runner.pool
    if not runner.fused_batch or os.environ.get(OFF_ENV) or not runner.use_kernel or pool.device.type != "cpu":
        return None
    if not 0 < n_rows <= GEMM_MAX_ROWS or not gemm_enabled() or torch.is_grad_enabled():
        return None
    if type(pool) is BlockPool:
        if pool.dtype not in POOL_DTYPES:
            return None
    elif type(pool) not in (TurboPool, IntPool) or len(runner.groups.members) != 1 or runner.state is not None:
        return None
    elif type(pool) is TurboPool and not pool.layers_in_c:
        return None
    step = _step_of(runner.model)
    if step is not None and type(pool) is not BlockPool and pool.layer_structs() is None:
        return None
    return step


@contextmanager
def fused_batch_off(runner, off: bool = True):
    """Run the engine's steps through the modules (when `off`), then put the fused step back."""
    before = runner.fused_batch
    runner.fused_batch = not off and before
    try:
        yield
    finally:
        runner.fused_batch = before
