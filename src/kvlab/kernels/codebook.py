"""ctypes front end of codebook.c: TurboQuant scores, mixes and chunk decodes straight from b-bit codes.

A `CodeLayout` says how one stored row is packed (parts of channels at their widths, each with its
centroid table; see kvlab/cache/turboquant.py `RotatedCodes` and kvlab/cache/packing.py). Every wrapper
checks dtype, shape and contiguity of each buffer against the sizes it passes to C, and the C code
re-checks the layout against the row length, so no caller can make it read or write outside a buffer.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ConfigError, KvlabError
from . import _describe, _evenly_strided_rows, _positive_int, check_buffer, kernel_for

#: codebook.c's build variants by `kvlab_codebook_variant()`
VARIANTS = {512: "avx512", 256: "avx2", 0: "plain"}


@dataclass(frozen=True)
class CodeLayout:
    """One row's packing: parts (lo, hi, bits) in channel order and their tables: scalar centroids, each padded to
    max(16, 2^bits) entries (what a one- or two-register permute reads), or a +vq block part's (K, 4) magnitude
    points (codebook.h: the part's 4th spec column is 1)."""

    dim: int
    row_bytes: int
    spec: torch.Tensor       # (parts, 4) int32: lo, hi, bits, block
    tables: torch.Tensor     # (Σ table_floats,) float32

    @classmethod
    def of(cls, parts: list[tuple[int, int, int]], centroids: list[torch.Tensor | None], row_bytes: int,
           points: list[torch.Tensor | None] | None = None) -> "CodeLayout":
        """`points[p]`: part p's (K, 4) block points (+vq), None for a scalar part (then `centroids[p]` its centroids)."""
        points = points or [None] * len(parts)
        tables = []
        for (_, _, bits), cent, block in zip(parts, centroids, points):
            padded = torch.zeros(table_floats(bits, block is not None), dtype=torch.float32)
            held = cent if block is None else block
            padded[: held.numel()] = held.detach().float().cpu().reshape(-1)
            tables.append(padded)
        spec = torch.tensor([[*p, int(block is not None)] for p, block in zip(parts, points)], dtype=torch.int32)
        return cls(parts[-1][1], row_bytes, spec, torch.cat(tables))


def table_floats(bits: int, block: bool) -> int:
    """Floats of a part's table as C steps through them (codebook.c table_size): a block part's 2^(4b-4) points of 4
    coordinates, or the scalar centroids padded to max(16, 2^bits)."""
    return (1 << (4 * bits - 4)) * 4 if block else max(16, 1 << bits)


class CodebookKernel:
    """The codebook entry points of a loaded kernel library (the main one, or a test's variant build)."""

    def __init__(self, lib: ctypes.CDLL, path: Path | None = None):
        self.path = path
        self._lib = lib
        i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
        common = [ptr, i32, i64, i64, i64, i64, i32, i32, ptr, ptr]
        lib.kvlab_codebook_dots.argtypes = [*common, ptr, i32, ptr, i32]
        lib.kvlab_codebook_mix.argtypes = [*common, ptr, i64, i32, ptr, i32]
        lib.kvlab_codebook_decode.argtypes = [*common, ptr, i32]
        lib.kvlab_codebook_variant.argtypes = []
        for fn in (lib.kvlab_codebook_dots, lib.kvlab_codebook_mix, lib.kvlab_codebook_decode, lib.kvlab_codebook_variant):
            fn.restype = i32

    @property
    def variant(self) -> str:
        """"avx512", "avx2" or "plain": which code paths this build compiled."""
        return VARIANTS[self._lib.kvlab_codebook_variant()]

    def _args(self, what: str, codes: torch.Tensor, start: int, n: int, layout: CodeLayout) -> list:
        if not isinstance(codes, torch.Tensor) or codes.dim() != 4:
            raise ConfigError(f"{what}: codes must be (B, H, slots, row bytes), got {_describe(codes)}")
        B, H, slots, _ = codes.shape
        check_buffer(what, "codes", codes, torch.uint8, (B, H, slots, layout.row_bytes))
        _positive_int(what, "start", start)
        if not 0 <= _positive_int(what, "n", n) <= slots - start:
            raise ConfigError(f"{what}: tokens [{start}, {start + n}) asked of a cache of {slots} slots")
        return [codes.data_ptr(), B * H, slots, layout.row_bytes, start, n, layout.dim, layout.spec.shape[0],
                layout.spec.data_ptr(), layout.tables.data_ptr()]

    @staticmethod
    def _status(what: str, status: int, codes: torch.Tensor) -> None:
        if status == -2:
            raise KvlabError(f"{what}: no memory for the kernel's scratch buffers")
        if status:
            raise ConfigError(f"{what} refused codes of shape {tuple(codes.shape)}")

    def dots(self, codes: torch.Tensor, start: int, n: int, layout: CodeLayout, q: torch.Tensor) -> torch.Tensor:
        """q · value(t) for rows [start, start+n). codes (B, H, slots, row bytes) uint8, q (B, H, nq, d) fp32
        -> (B, H, nq, n) fp32."""
        what = "codebook scores"
        args = self._args(what, codes, start, n, layout)
        B, H = codes.shape[:2]
        nq = q.shape[2] if isinstance(q, torch.Tensor) and q.dim() == 4 else 0
        check_buffer(what, "query", q, torch.float32, (B, H, nq, layout.dim), contiguous=False)
        q = q.contiguous()
        out = torch.empty(B, H, nq, n, dtype=torch.float32)
        self._status(what, self._lib.kvlab_codebook_dots(*args, q.data_ptr(), nq, out.data_ptr(), torch.get_num_threads()), codes)
        return out

    def mix(self, codes: torch.Tensor, start: int, n: int, layout: CodeLayout, w: torch.Tensor) -> torch.Tensor:
        """Σ_t w[..., t] · value(start + t). codes (B, H, slots, row bytes) uint8, w (B, H, nq, n) fp32 (rows may be
        evenly strided) -> (B, H, nq, d) fp32; the same for any thread count."""
        what = "codebook mix"
        args = self._args(what, codes, start, n, layout)
        B, H = codes.shape[:2]
        nq = w.shape[2] if isinstance(w, torch.Tensor) and w.dim() == 4 else 0
        check_buffer(what, "weights", w, torch.float32, (B, H, nq, n), contiguous=False)
        w = _evenly_strided_rows(w)
        out = torch.empty(B, H, nq, layout.dim, dtype=torch.float32)
        status = self._lib.kvlab_codebook_mix(*args, w.data_ptr(), w.stride(2), nq, out.data_ptr(), torch.get_num_threads())
        self._status(what, status, codes)
        return out

    def decode(self, codes: torch.Tensor, start: int, n: int, layout: CodeLayout) -> torch.Tensor:
        """value(t) for rows [start, start+n): (B, H, n, d) fp32 (a chunk's transient)."""
        what = "codebook decode"
        args = self._args(what, codes, start, n, layout)
        B, H = codes.shape[:2]
        out = torch.empty(B, H, n, layout.dim, dtype=torch.float32)
        self._status(what, self._lib.kvlab_codebook_decode(*args, out.data_ptr(), torch.get_num_threads()), codes)
        return out


def codebook_kernel_for(device: torch.device) -> CodebookKernel | None:
    """The codebook kernels for tensors on `device` (CPU only, when the kernel library loaded), else None."""
    library = kernel_for(device)
    return None if library is None else _wrap(library.lib, library.path)


@functools.lru_cache(maxsize=4)
def _wrap(lib: ctypes.CDLL, path: Path) -> CodebookKernel:
    return CodebookKernel(lib, path)
