"""ctypes front end of q8gemm.c: several rows of int8-quantized activations times GGUF blocks (VNNI where the CPU has it).

The activations are quantized per 32-element block to int8 with one fp32 scale (llama.cpp's Q8_1 recipe), so the
result is close to, not equal to, the fp32 product; kvlab.model.int8act holds the torch reference it is tested
against. Every wrapper checks the dtype, shape and contiguity of each buffer against the sizes it passes to C.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from ..errors import ConfigError, KvlabError
from . import BLOCK_TYPES, _block_shape, _describe, check_buffer, kernel_for

#: q8gemm.c's build variants by `kvlab_q8_variant()`
VARIANTS = {3: "avx512-vnni", 2: "avx512", 1: "avx2", 0: "plain"}
QK = 32  # activation codes per scale


class Q8Kernel:
    """The int8-activation entry points of a loaded kernel library (the main one, or a test's variant build)."""

    def __init__(self, lib: ctypes.CDLL, path: Path | None = None):
        self.path = path
        self._lib = lib
        i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
        lib.kvlab_q8_quantize.argtypes = [ptr, i64, i64, ptr, ptr, ptr]
        lib.kvlab_q8_gemm.argtypes = [i32, ptr, i64, i64, ptr, i64, ptr, i32]
        lib.kvlab_q8_variant.argtypes = []
        for fn in (lib.kvlab_q8_quantize, lib.kvlab_q8_gemm, lib.kvlab_q8_variant):
            fn.restype = i32

    @property
    def variant(self) -> str:
        """Which instruction set this build computes with: avx512-vnni, avx512, avx2 or plain."""
        return VARIANTS[self._lib.kvlab_q8_variant()]

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (M, K) fp32 contiguous, K a multiple of 32 -> codes (M, K) int8, scales (M, K/32) fp32, sums (M, K/32) int32."""
        what = "int8 activation quantize"
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] % QK or x.shape[1] == 0:
            raise ConfigError(f"{what}: x must be a (rows, a positive multiple of {QK}) fp32 tensor, got {_describe(x)}")
        check_buffer(what, "x", x, torch.float32, tuple(x.shape))
        m, k = x.shape
        codes = torch.empty(m, k, dtype=torch.int8)
        scales = torch.empty(m, k // QK, dtype=torch.float32)
        sums = torch.empty(m, k // QK, dtype=torch.int32)
        if self._lib.kvlab_q8_quantize(x.data_ptr(), m, k, codes.data_ptr(), scales.data_ptr(), sums.data_ptr()):
            raise ConfigError(f"{what} refused input of shape {tuple(x.shape)}")
        return codes, scales, sums

    def gemm(self, type_name: str, blocks: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Y ≈ X Wᵀ with X quantized to int8 per 32-block: blocks (N, row_bytes) uint8, x (M, K) fp32, both
        contiguous CPU tensors -> (M, N) fp32; the same bits for any thread count and any build variant."""
        what = "int8-activation GEMM"
        _, n, k = _block_shape(what, type_name, blocks)
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ConfigError(f"{what}: x must be a (rows, {k}) fp32 tensor, got {_describe(x)}")
        check_buffer(what, "x", x, torch.float32, (x.shape[0], k))
        m = x.shape[0]
        y = torch.empty(m, n, dtype=torch.float32) if out is None else out
        check_buffer(what, "output", y, torch.float32, (m, n))
        status = self._lib.kvlab_q8_gemm(BLOCK_TYPES[type_name][0], blocks.data_ptr(), n, k, x.data_ptr(), m, y.data_ptr(),
                                         torch.get_num_threads())
        if status == -2:
            raise KvlabError(f"{what}: no memory for the packed int8 input ({m}×{k})")
        if status != 0:
            raise ConfigError(f"{what} refused {type_name} blocks of shape {tuple(blocks.shape)} with input {tuple(x.shape)}")
        return y


def q8_kernel_for(device: torch.device) -> Q8Kernel | None:
    """The int8-activation kernels for tensors on `device` (CPU only, when the kernel library loaded), else None."""
    library = kernel_for(device)
    return None if library is None else _wrap(library.lib, library.path)


@functools.lru_cache(maxsize=4)
def _wrap(lib: ctypes.CDLL, path: Path) -> Q8Kernel:
    return Q8Kernel(lib, path)
