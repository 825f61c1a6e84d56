"""The C kernels (blockgemv.c: GEMV from GGUF blocks; decode.c: a whole decode step; intcache.c: attention
on the int8/int4 cache's codes; codebook4.c: on TurboQuant's 4-bit codes): compiled on first use with the
system `cc`, cached, loaded with ctypes.

The shared library is built with `-fopenmp` and loaded after torch, so its `libgomp.so.1` resolves to
the runtime torch already loaded (same soname): one thread pool, sized by torch.set_num_threads.
Without a compiler, or if the build fails, `block_kernel()` returns None and `kernel_status()` says why;
callers then use dequantized fp32 weights.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from ..errors import ConfigError

HERE = Path(__file__).parent
SOURCES = tuple(HERE / f for f in ("blockgemv.c", "decode.c", "intcache.c", "codebook4.c"))  # one library
HEADERS = (HERE / "blockgemv.h",)
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fopenmp")
SANITIZE = os.environ.get("KVLAB_KERNEL_SANITIZE")  # e.g. "address": an instrumented build for kvlab.fuzz
if SANITIZE:
    FLAGS += (f"-fsanitize={SANITIZE}", "-fno-omit-frame-pointer", "-g")
LIBS = ("-lm",)

# GGML type ids the kernel reads, and each block's (weights, bytes)
BLOCK_TYPES = {"Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q8_0": (8, 32, 34)}

_status = "not loaded yet"


def _cpu_fingerprint() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [line for line in text.splitlines() if line.startswith(("model name", "flags"))][:2]
    return "\n".join(wanted) or platform.machine()


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC") or "cc")


def library_path(compiler: str) -> Path:
    """Where the build for this source, compiler, flags and CPU lives (kvlab's cache folder)."""
    from ..model.weights import cache_dir

    texts = [p.read_text() for p in (*SOURCES, *HEADERS)]
    key = "\n".join([*texts, compiler, " ".join(FLAGS), _cpu_fingerprint(), platform.machine()])
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return cache_dir() / "kernels" / f"blockgemv-{digest}.so"


def compile_library(compiler: str, target: Path) -> None:
    """cc -O3 -march=native -fPIC -shared -fopenmp <SOURCES> -lm -> target, via a temporary name (atomic)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    try:
        run = subprocess.run([compiler, *FLAGS, "-o", tmp, *map(str, SOURCES), *LIBS], capture_output=True, text=True, timeout=120)
        if run.returncode != 0:
            lines = (run.stderr or run.stdout).strip().splitlines()
            raise OSError(f"{compiler} failed: {lines[0] if lines else 'exit ' + str(run.returncode)}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class BlockKernel:
    """ctypes front end of blockgemv.c: GEMV of one fp32 row against blocks, and dequantization."""

    def __init__(self, lib: ctypes.CDLL, path: Path):
        self.path = path
        self._lib = lib
        i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
        lib.kvlab_block_gemv.argtypes = [i32, ptr, i64, i64, ptr, ptr, i32]
        lib.kvlab_block_dequantize.argtypes = [i32, ptr, i64, i64, ptr, i32]
        lib.kvlab_block_omp_threads.argtypes = [i32]
        lib.kvlab_int_scores.argtypes = [i32, ptr, ptr, ptr, i32, i64, i64, i32, i32, ptr, i32, ctypes.c_float, ptr, i32]
        lib.kvlab_int_mix.argtypes = [i32, ptr, ptr, ptr, i32, i64, i64, i32, i32, ptr, i64, i32, ptr, i32]
        lib.kvlab_codebook4_dots.argtypes = [ptr, i32, i64, i64, i32, ptr, ptr, i32, ptr, i32]
        lib.kvlab_codebook4_mix.argtypes = [ptr, i32, i64, i64, i32, ptr, ptr, i64, i32, ptr, i32]
        for fn in (lib.kvlab_block_gemv, lib.kvlab_block_dequantize, lib.kvlab_block_omp_threads, lib.kvlab_int_scores,
                   lib.kvlab_int_mix, lib.kvlab_codebook4_dots, lib.kvlab_codebook4_mix):
            fn.restype = i32

    def gemv(self, type_name: str, blocks: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """blocks (rows, row_bytes) uint8, x (cols,) fp32 contiguous -> y (rows,) fp32."""
        type_id, per_block, block_bytes = BLOCK_TYPES[type_name]
        rows, cols = blocks.shape[0], blocks.shape[1] // block_bytes * per_block
        if x.dtype != torch.float32 or not x.is_contiguous() or x.numel() != cols or not blocks.is_contiguous():
            raise ConfigError(f"block GEMV needs a contiguous fp32 row of {cols} values, got {tuple(x.shape)} {x.dtype}")
        y = torch.empty(rows, dtype=torch.float32) if out is None else out
        if y.numel() != rows or y.dtype != torch.float32 or not y.is_contiguous():
            raise ConfigError(f"block GEMV output must be a contiguous fp32 vector of {rows} values")
        status = self._lib.kvlab_block_gemv(type_id, blocks.data_ptr(), rows, cols, x.data_ptr(), y.data_ptr(),
                                            torch.get_num_threads())
        if status != 0:
            raise ConfigError(f"block GEMV refused {type_name} blocks of shape {tuple(blocks.shape)}")
        return y

    def dequantize(self, type_name: str, blocks: torch.Tensor) -> torch.Tensor:
        """blocks (rows, row_bytes) uint8 contiguous -> (rows, cols) fp32, bit-exact d * q + m."""
        type_id, per_block, block_bytes = BLOCK_TYPES[type_name]
        rows, cols = blocks.shape[0], blocks.shape[1] // block_bytes * per_block
        out = torch.empty(rows, cols, dtype=torch.float32)
        if self._lib.kvlab_block_dequantize(type_id, blocks.data_ptr(), rows, cols, out.data_ptr(), torch.get_num_threads()):
            raise ConfigError(f"block dequantize refused {type_name} blocks of shape {tuple(blocks.shape)}")
        return out

    def int_scores(self, bits: int, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, n: int, group: int,
                   q: torch.Tensor, attn_scale: float) -> torch.Tensor:
        """Scores straight from an integer cache's key codes (intcache.c).
        codes (B, H, slots, row bytes) uint8; scale/zero (B, H, ⌈slots/G⌉, D) fp16; q (B, H, nq, D) fp32
        -> (B, H, nq, n) fp32 = q · keys[:n]ᵀ · attn_scale."""
        B, H, slots, _ = codes.shape
        nq, d = q.shape[2], q.shape[3]
        q = q.contiguous()
        out = torch.empty(B, H, nq, n, dtype=torch.float32)
        for t in (codes, scale, zero):
            if not t.is_contiguous():
                raise ConfigError("integer-cache kernel needs contiguous code and metadata buffers")
        if self._lib.kvlab_int_scores(bits, codes.data_ptr(), scale.data_ptr(), zero.data_ptr(), B * H, slots, n, d, group,
                                      q.data_ptr(), nq, attn_scale, out.data_ptr(), torch.get_num_threads()):
            raise ConfigError(f"integer-cache scores refused int{bits} codes of shape {tuple(codes.shape)}")
        return out

    def int_mix(self, bits: int, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, n: int, d: int,
                p: torch.Tensor) -> torch.Tensor:
        """Σ_t p[..., t] · values[t] straight from an integer cache's value codes (intcache.c).
        codes (B, H, slots, row bytes) uint8; scale/zero (B, H, slots, D/Gv) fp16; p (B, H, nq, n) fp32
        (rows may be strided, the last dim must be contiguous) -> (B, H, nq, d) fp32."""
        B, H, slots, _ = codes.shape
        nq, gv = p.shape[2], d // scale.shape[-1]
        p = _evenly_strided_rows(p)
        out = torch.empty(B, H, nq, d, dtype=torch.float32)
        if self._lib.kvlab_int_mix(bits, codes.data_ptr(), scale.data_ptr(), zero.data_ptr(), B * H, slots, n, d, gv,
                                   p.data_ptr(), p.stride(2), nq, out.data_ptr(), torch.get_num_threads()):
            raise ConfigError(f"integer-cache mix refused int{bits} codes of shape {tuple(codes.shape)}")
        return out

    def codebook4_dots(self, codes: torch.Tensor, n: int, centroids: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """q_rot · c[code[t]] for 4-bit codebook codes (codebook4.c). codes (B, H, slots, d/2) uint8,
        centroids (16,) fp32, q (B, H, nq, d) fp32 -> (B, H, nq, n) fp32."""
        B, H, slots, _ = codes.shape
        nq, d = q.shape[2], q.shape[3]
        q, centroids = q.contiguous(), centroids.contiguous()
        out = torch.empty(B, H, nq, n, dtype=torch.float32)
        if not codes.is_contiguous() or centroids.numel() != 16 or self._lib.kvlab_codebook4_dots(
                codes.data_ptr(), B * H, slots, n, d, centroids.data_ptr(), q.data_ptr(), nq, out.data_ptr(), torch.get_num_threads()):
            raise ConfigError(f"4-bit codebook scores refused codes of shape {tuple(codes.shape)}")
        return out

    def codebook4_mix(self, codes: torch.Tensor, n: int, centroids: torch.Tensor, w: torch.Tensor, d: int) -> torch.Tensor:
        """Σ_t w[..., t] · c[code[t]] for 4-bit codebook codes (codebook4.c). codes (B, H, slots, d/2) uint8,
        w (B, H, nq, n) fp32 -> (B, H, nq, d) fp32."""
        B, H, slots, _ = codes.shape
        nq = w.shape[2]
        w = _evenly_strided_rows(w)
        centroids = centroids.contiguous()
        out = torch.empty(B, H, nq, d, dtype=torch.float32)
        if not codes.is_contiguous() or centroids.numel() != 16 or self._lib.kvlab_codebook4_mix(
                codes.data_ptr(), B * H, slots, n, d, centroids.data_ptr(), w.data_ptr(), w.stride(2), nq, out.data_ptr(),
                torch.get_num_threads()):
            raise ConfigError(f"4-bit codebook mix refused codes of shape {tuple(codes.shape)}")
        return out

    def openmp_threads(self, n: int) -> int:
        """Threads a parallel region of the kernel library actually gets when asked for n."""
        return self._lib.kvlab_block_omp_threads(n)


def block_kernel() -> BlockKernel | None:
    """The compiled library, built on first use; None (see kernel_status) when it cannot be had here or
    KVLAB_NO_KERNEL is set (checked on every call, so the planner and the loader always agree)."""
    if os.environ.get("KVLAB_NO_KERNEL"):
        return None
    return _loaded_kernel()


def _evenly_strided_rows(p: torch.Tensor) -> torch.Tensor:
    """p (B, H, nq, n) as the C code reads it: contiguous rows of n, row r at r × p.stride(2) (a slice of
    the last dim of a contiguous tensor qualifies as is); anything else is copied."""
    B, H, nq, _ = p.shape
    if p.stride(-1) != 1 or p.stride(2) * nq != p.stride(1) or p.stride(1) * H != p.stride(0):
        return p.contiguous()
    return p


@functools.lru_cache(maxsize=1)
def _loaded_kernel() -> BlockKernel | None:
    global _status
    compiler = _compiler()
    if compiler is None:
        _status = f"no C compiler ({os.environ.get('CC') or 'cc'}) on PATH"
        return None
    try:
        target = library_path(compiler)
        if not target.is_file():
            compile_library(compiler, target)
        lib = ctypes.CDLL(str(target))  # torch is imported above: libgomp.so.1 resolves to torch's copy
    except (OSError, subprocess.SubprocessError) as exc:
        _status = f"kernel unavailable: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        return None
    _status = f"loaded {target}"
    return BlockKernel(lib, target)


def kernel_for(device: torch.device) -> BlockKernel | None:
    """The library for tensors on `device`: CPU only (the caches' code kernels), else None."""
    return block_kernel() if device.type == "cpu" else None


def kernel_status() -> str:
    """Why block_kernel() returns what it does (for debugging the fallback)."""
    return "disabled by KVLAB_NO_KERNEL" if os.environ.get("KVLAB_NO_KERNEL") else _status


def openmp_runtimes() -> list[str]:
    """Paths of the OpenMP runtimes mapped into this process (Linux; [] elsewhere): should be exactly one."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    return sorted({line.split()[-1] for line in maps.splitlines() if "libgomp" in line or "libiomp" in line})
