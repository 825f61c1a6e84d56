"""FusedDecodeStep: the Decoder's one-token step through every layer in one C call (kernels/decode.c).

Batch-1 decode on a CPU is a few hundred small operations per token (norms, RoPE, one-query attention,
SwiGLU, a GEMV per matrix); run one by one from Python their overhead is about as long as reading the
weights. The fused step does the same arithmetic in one call over the model's own buffers (GGUF blocks
or fp32 rows) and writes K/V into a DenseCache in place (stored fp32, or f16 / bf16 for dense-f16 / dense-bf16,
read back in fp32 one key chunk at a time), or into a TurboQuantCache or QuantizedCache, whose tokens it codes and
whose attention it reads straight from the codes (model/fused_codes.py and model/fused_int.py say which it serves).
The Python modules stay the reference: tests hold the fused step to the module path, and everything it
does not accept (prefill, batches, other caches, bf16, CUDA, autograd) goes through the modules.
"""

from __future__ import annotations

import ctypes
import os
import weakref
from contextlib import contextmanager
from ctypes import POINTER, c_float, c_int32, c_int64, c_void_p

import torch
import torch.nn as nn

from ..errors import ConfigError, NonFiniteError
from .blockquant import BlockQuantLinear
from .config import LLAMA_FAMILY
from ..kernels import BLOCK_TYPES, block_kernel, check_buffer
from . import fused_codes, fused_int
from .fused_codes import KV_TYPES, CacheView, Fill, LayerKV

F32 = 0  # GGML type id of plain fp32 rows


class _Matrix(ctypes.Structure):
    _fields_ = [("type", c_int32), ("rows", c_int64), ("cols", c_int64), ("data", c_void_p), ("bias", c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [("attn_norm", c_void_p), ("ffn_norm", c_void_p), ("q_norm", c_void_p), ("k_norm", c_void_p),
                ("qkv", _Matrix), ("out", _Matrix), ("gate_up", _Matrix), ("down", _Matrix)]


class _Model(ctypes.Structure):
    _fields_ = [("n_layers", c_int32), ("d_model", c_int32), ("n_heads", c_int32), ("n_kv_heads", c_int32),
                ("head_dim", c_int32), ("d_ff", c_int32), ("window", c_int32), ("rms_eps", c_float),
                ("attn_scale", c_float), ("layers", POINTER(_Layer)), ("final_norm", c_void_p), ("head", _Matrix)]


class FusedDecodeStep:
    """Built once per model (it holds pointers to the model's buffers); called for each decode token."""

    def __init__(self, model: nn.Module, lib: ctypes.CDLL):
        cfg = model.config
        self.config = cfg
        self._lib = lib
        self._keep: list[torch.Tensor] = []   # every buffer the C structs point into stays alive with them
        d, hd, ff = cfg.d_model, cfg.head_dim, cfg.d_ff
        q_dim, kv_dim = cfg.n_heads * hd, cfg.n_kv_heads * hd
        if len(model.blocks) != cfg.n_layers:
            raise ConfigError(f"fused decode: the model has {len(model.blocks)} blocks, the config {cfg.n_layers} layers")
        # decode.c sizes every scratch buffer from these numbers: each buffer it is given must match them exactly
        layers = (_Layer * cfg.n_layers)()
        for i, block in enumerate(model.blocks):
            attn = block.attn
            at = f"layer {i}"
            layers[i] = _Layer(
                self._ptr(block.attn_norm.weight, (d,), f"{at} attn_norm"), self._ptr(block.ffn_norm.weight, (d,), f"{at} ffn_norm"),
                self._ptr(attn.q_norm.weight if attn.q_norm is not None else None, (hd,), f"{at} q_norm"),
                self._ptr(attn.k_norm.weight if attn.k_norm is not None else None, (hd,), f"{at} k_norm"),
                self._matrix(attn.qkv, q_dim + 2 * kv_dim, d, f"{at} qkv"), self._matrix(attn.out, d, q_dim, f"{at} attn out"),
                self._matrix(block.ffn.gate_up, 2 * ff, d, f"{at} gate_up"), self._matrix(block.ffn.down, d, ff, f"{at} ffn down"),
            )
        self._layers = layers
        head = model.lm_head if model.lm_head is not None else model.embed  # tied: the fp32 embedding table
        # every matrix in decode.c's order (each layer's QKV, OUT, GATE_UP, DOWN, then the head): their activations
        self._matrices = [m for b in model.blocks for m in (b.attn.qkv, b.attn.out, b.ffn.gate_up, b.ffn.down)] + [head]
        self._flags_of: tuple[bool, ...] | None = None   # the activations `_flags` was made for
        self._flags = torch.zeros(len(self._matrices), dtype=torch.uint8)
        self._model = _Model(cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff,
                             cfg.sliding_window or 0, cfg.rms_eps, cfg.head_dim ** -0.5, layers,
                             self._ptr(model.norm.weight, (d,), "final norm"), self._matrix(head, cfg.vocab_size, d, "output head"))
        self._embed = model.embed
        self._rope = model.rope
        lib.kvlab_decode_step.argtypes = [POINTER(_Model), c_void_p, c_int32, c_void_p, c_void_p, POINTER(LayerKV),
                                          POINTER(Fill), c_void_p, c_void_p, ctypes.c_int]
        lib.kvlab_decode_step.restype = c_int32
        self._views: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # cache -> its CacheView, while it lives

    @property
    def weights(self) -> _Model:
        """The model's weights as decode.h's Model struct; the engine's batch step reads them too (serve/fused_batch.py)."""
        return self._model

    def int8_flags(self) -> torch.Tensor:
        """(n_layers * 4 + 1,) uint8: 1 for each matrix (QKV, OUT, GATE_UP, DOWN of each layer, then the head) whose
        activations are int8 (BlockQuantLinear.activations), read on every call as the modules read theirs."""
        now = tuple(getattr(m, "activations", "fp32") == "int8" for m in self._matrices)
        if now != self._flags_of:
            self._flags_of, self._flags = now, torch.tensor(now, dtype=torch.uint8)
        return self._flags

    def __deepcopy__(self, memo) -> None:
        """A copied model has copied buffers: it does not inherit a step that points into the originals."""
        return None

    def _ptr(self, t: torch.Tensor | None, shape: tuple[int, ...], what: str, dtype: torch.dtype = torch.float32) -> int | None:
        """The address of `t` after checking it is a contiguous CPU tensor of `dtype` and exactly `shape`."""
        if t is None:
            return None
        check_buffer("fused decode", what, t, dtype, shape)
        self._keep.append(t)
        return t.data_ptr()

    def _matrix(self, module: nn.Module, rows: int, cols: int, what: str) -> _Matrix:
        """A Linear / Embedding (fp32 rows) or a BlockQuantLinear (GGUF blocks) of (rows, cols) as the C struct."""
        bias = getattr(module, "bias", None)
        bias_ptr = self._ptr(bias, (rows,), f"{what} bias")
        if isinstance(module, BlockQuantLinear):
            type_id, per_block, block_bytes = BLOCK_TYPES[module.block_type]
            if cols % per_block:
                raise ConfigError(f"fused decode: {what} has {cols} columns, not whole {per_block}-weight blocks")
            data = self._ptr(module.blocks, (rows, cols // per_block * block_bytes), f"{what} {module.block_type} blocks", torch.uint8)
            return _Matrix(type_id, rows, cols, data, bias_ptr)
        return _Matrix(F32, rows, cols, self._ptr(module.weight, (rows, cols), f"{what} weight"), bias_ptr)  # (rows, cols) fp32

    def serves(self, cache) -> bool:
        """Whether this kind of cache takes the fused step at all: a fp32 CPU DenseCache (K/V stored in fp32,
        f16 or bf16) of one sequence shaped for this model, or a TurboQuantCache / QuantizedCache fused_codes serves."""
        g, cfg = cache.geometry, self.config
        if cache.kernel_format != "dense":
            return fused_codes.serves_codes(cache, cfg)
        return (
            cache.dtype == torch.float32 and cache.storage in KV_TYPES and cache.device.type == "cpu"
            and (g.batch, g.n_layers, g.n_kv_heads, g.head_dim, g.head_dim_v, g.window)
            == (1, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.head_dim, cfg.sliding_window)
        )

    def accepts(self, tokens: torch.Tensor, cache) -> bool:
        """One new token into a cache it serves, whose layers are level and not full, without autograd.
        Anything else (and every error case) takes the module path."""
        return self._fill_for(tokens, cache) is not None

    def _fill_for(self, tokens: torch.Tensor, cache) -> Fill | None:
        """Where the token goes in `cache` when the step accepts it (`accepts`), else None."""
        if not (tokens.shape == (1, 1) and not torch.is_grad_enabled() and self.serves(cache)
                and cache.length < cache.geometry.capacity and cache.is_level):
            return None
        return fused_codes.fill(cache)

    def _view_for(self, cache) -> CacheView:
        """The C structs of `cache`: built on its first fused step, reused while its buffers stay in place."""
        view = self._views.get(cache)
        if view is None or not view.fits(cache):
            view = self._views[cache] = CacheView(cache, self.config)
        return view

    def __call__(self, tokens: torch.Tensor, cache) -> torch.Tensor:
        """tokens (1, 1) -> logits (1, 1, vocab); K/V of the token written (or coded) into `cache`."""
        logits = self.try_step(tokens, cache)
        if logits is None:
            raise ConfigError(f"fused decode step does not take tokens {tuple(tokens.shape)} into this {type(cache).__name__}")
        return logits

    def try_step(self, tokens: torch.Tensor, cache) -> torch.Tensor | None:
        """As calling the step, or None (nothing done) where it does not accept the token: the Decoder's forward asks
        once, not once to check and again to run."""
        where = self._fill_for(tokens, cache)   # the C code checks every row it writes
        if where is None:
            return None
        cfg = self.config
        pos = cache.length
        view = self._view_for(cache)
        x = self._embed(tokens).reshape(-1).float().contiguous()               # (C,)
        cos, sin = self._rope(pos, 1, torch.float32)                           # (1, D) each
        check_buffer("fused decode", "embedding", x, torch.float32, (cfg.d_model,))
        check_buffer("fused decode", "rope cos", cos, torch.float32, (1, cfg.head_dim))
        check_buffer("fused decode", "rope sin", sin, torch.float32, (1, cfg.head_dim))
        logits = torch.empty(self._model.head.rows, dtype=torch.float32)        # (vocab,)
        self._model.attn_scale = cache.scale
        status = self._lib.kvlab_decode_step(
            ctypes.byref(self._model), x.data_ptr(), pos, cos.data_ptr(), sin.data_ptr(), view.layers,
            ctypes.byref(where), self.int8_flags().data_ptr(), logits.data_ptr(), torch.get_num_threads(),
        )
        if status < 0:
            raise ConfigError(f"fused decode step refused position {pos} of a cache of {cache.geometry.capacity} tokens")
        n_layers = cfg.n_layers
        if status > 0:  # layers before the bad one were written, as in the module path
            bad = (status - 1) % n_layers
            cache.record_written(range(bad), 1)
            if status > n_layers and cache.kernel_format == "int":
                fused_int.raise_range_error(view.quant[bad])
            if status > n_layers:
                raise NonFiniteError(f"a key or value norm of layer {bad} overflows the {cache.config.norm_dtype} norms "
                                     "of the TurboQuant cache")
            raise NonFiniteError(f"NaN or Inf in the keys/values appended to layer {bad}")
        cache.record_written(range(n_layers), 1)  # as `append` would have counted it
        return logits.view(1, 1, -1)


def fused_decode_step(model: nn.Module) -> FusedDecodeStep | None:
    """The fused step for a fp32 CPU Decoder whose matrices are fp32 or GGUF blocks; None when it cannot run
    here (no kernel, another dtype or device, KVLAB_NO_FUSED set)."""
    if os.environ.get("KVLAB_NO_FUSED"):
        return None
    if getattr(getattr(model, "config", None), "arch", "llama") not in LLAMA_FAMILY:
        return None  # Gemma 3 / Qwen3.5 / Qwen3-Next: layer kinds the C step has no code for (model/hybrid.py FUSED_OFF)
    kernel = block_kernel()
    if kernel is None or not hasattr(kernel.lib, "kvlab_decode_step"):
        return None
    try:
        return FusedDecodeStep(model, kernel.lib)
    except ConfigError:
        return None


@contextmanager
def fused_step_off(model: nn.Module, off: bool = True):
    """Run the block with the model's fused step switched off (when `off`), then put it back."""
    step = model.fused
    model.fused = None if off else step
    try:
        yield
    finally:
        model.fused = step


def decode_step_kind(model: nn.Module, cache) -> str:
    """"fused" when this model decodes into this cache with the fused step, else "modules"."""
    return "fused" if model.fused is not None and model.fused.serves(cache) else "modules"
