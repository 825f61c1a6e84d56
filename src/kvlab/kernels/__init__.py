"""The C kernels (blockgemv.c: GEMV from GGUF blocks; q8gemm.c: int8 activations x blocks, wrapped by q8gemm.py; decode.c: a whole decode step; intcache.c: attention
on the int8/int4 cache's codes; codebook.c: on TurboQuant's codes of any width, wrapped by codebook.py;
paged.c: over paged blocks; batchstep.c: a whole engine step, wrapped by serve/fused_batch.py): compiled on first use with the
system `cc`, cached, loaded with ctypes.

The shared library is built with `-fopenmp` and loaded after torch, so its `libgomp.so.1` resolves to
the runtime torch already loaded (same soname): one thread pool, sized by torch.set_num_threads.
Without a compiler, or if the build fails, `block_kernel()` returns None and `kernel_status()` says why;
callers then use dequantized fp32 weights.

The cached library is built under a temporary name and renamed into place (atomic), with its size and
sha256 recorded beside it (`<name>.so.sha256`); a library that does not match its record (a torn or
damaged file) is rebuilt before it is ever mapped. A cache folder that cannot be written or read
falls back, with one warning line, to a private temporary folder.

Every wrapper below checks the dtype, shape, contiguity and length of each buffer against the sizes it
passes to C, so no caller (and no model file) can make the C code read or write outside a buffer.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..bitplanes import packed_nbytes
from ..errors import ConfigError, KvlabError
from ..paths import cache_dir

HERE = Path(__file__).parent
SOURCES = tuple(HERE / f for f in ("blockgemv.c", "blockgemm.c", "q8gemm.c", "decode.c", "intcache.c", "paged.c", "codebook.c",
                                   "batchstep.c"))  # one library
HEADERS = (HERE / "blockgemv.h", HERE / "codebook.h", HERE / "intcache.h", HERE / "intcodes.h", HERE / "rowmath.h",
           HERE / "decode.h", HERE / "paged.h", HERE / "tqcodes.h")
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fopenmp")
SANITIZE = os.environ.get("KVLAB_KERNEL_SANITIZE")  # e.g. "address": an instrumented build for kvlab.fuzz
if SANITIZE:   # -O1, as the sanitizers' docs advise: reports keep their lines, and the build takes half the time
    FLAGS = ("-O1", *FLAGS[1:], f"-fsanitize={SANITIZE}", "-fno-omit-frame-pointer", "-g")
LIBS = ("-lm",)

# GGML type ids the kernel reads, and each block's (weights, bytes)
BLOCK_TYPES = {"Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q8_0": (8, 32, 34)}

_status = "not loaded yet"


def build_flags() -> tuple[str, ...]:
    """The compiler flags of this build (FLAGS plus any extras); they are part of the library's cache key."""
    return FLAGS


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


def compiler_available() -> bool:
    """Whether a C compiler is on PATH (a kernel test then fails, not skips, when the build does not work)."""
    return _compiler() is not None


def library_name(compiler: str) -> str:
    """The library's file name: a digest of the sources, compiler, flags and CPU."""
    texts = [p.read_text() for p in (*SOURCES, *HEADERS)]
    key = "\n".join([*texts, compiler, " ".join(build_flags()), " ".join(LIBS), _cpu_fingerprint(), platform.machine()])
    return f"blockgemv-{hashlib.sha256(key.encode()).hexdigest()[:20]}.so"


def library_path(compiler: str) -> Path:
    """Where the build for this source, compiler, flags and CPU lives (kvlab's cache folder)."""
    return cache_dir() / "kernels" / library_name(compiler)


def _record_path(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _file_digest(path: Path) -> tuple[int, str]:
    data = path.read_bytes()
    return len(data), hashlib.sha256(data).hexdigest()


def verified(library: Path) -> bool:
    """Whether `library` exists and matches the size and sha256 recorded beside it when it was built."""
    try:
        size, digest = _record_path(library).read_text().split()
        return library.stat().st_size == int(size) and _file_digest(library) == (int(size), digest)
    except (OSError, ValueError):
        return False


def _write_atomic(target: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=target.name, suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, 0o644)  # readable by the other users of a shared cache folder
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_shared(compiler: str, flags, sources, output: Path, timeout: float = 300) -> tuple[int, str]:
    """cc <flags> -c each source, one per core at a time (codebook.c alone takes most of a build, so the others
    compile beside it), then link them into `output` with LIBS: (exit status, the compiler's output)."""
    flags = [f for f in flags if f != "-shared"]
    with tempfile.TemporaryDirectory(prefix="kvlab-build-") as folder:
        objects = [Path(folder) / f"{i}-{Path(src).stem}.o" for i, src in enumerate(sources)]

        def compile_one(pair) -> subprocess.CompletedProcess:
            src, obj = pair
            return subprocess.run([compiler, *flags, "-c", str(src), "-o", str(obj)], check=False, capture_output=True, text=True,
                                  timeout=timeout)

        workers = max(1, min(len(objects), os.cpu_count() or 1))
        try:
            with ThreadPoolExecutor(workers) as pool:
                runs = list(pool.map(compile_one, zip(sources, objects)))
            failed = [run for run in runs if run.returncode != 0]
            if failed:
                return failed[0].returncode, failed[0].stderr or failed[0].stdout
            link = subprocess.run([compiler, *flags, "-shared", "-o", str(output), *map(str, objects), *LIBS],
                                  check=False, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return -1, f"{compiler} took over {timeout:.0f} s"
        return link.returncode, link.stderr or link.stdout


def compile_library(compiler: str, target: Path) -> None:
    """build_shared(<flags>, SOURCES) -> target via a temporary name (atomic), with its size + sha256 recorded."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    try:
        status, output = build_shared(compiler, build_flags(), SOURCES, Path(tmp))
        if status != 0:
            lines = output.strip().splitlines()
            raise OSError(f"{compiler} failed: {lines[0] if lines else 'exit ' + str(status)}")
        size, digest = _file_digest(Path(tmp))
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
        _write_atomic(_record_path(target), f"{size} {digest}\n".encode())
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _warn(message: str) -> None:
    print(f"warning: {' '.join(message.split())}", file=sys.stderr)


# -- buffer checks: every pointer handed to C is a CPU tensor of exactly the size C will touch --------
def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    layout = "contiguous" if t.is_contiguous() else "strided"
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} {layout} on {t.device.type}"


def check_buffer(what: str, name: str, t, dtype: torch.dtype, shape: tuple[int, ...], contiguous: bool = True) -> None:
    """Raise a one-line ConfigError unless `t` is a CPU tensor of `dtype` and exactly `shape` (and contiguous)."""
    if (not isinstance(t, torch.Tensor) or t.dtype != dtype or t.device.type != "cpu" or tuple(t.shape) != tuple(shape)
            or (contiguous and not t.is_contiguous())):
        want = f"{'contiguous ' if contiguous else ''}{str(dtype).removeprefix('torch.')} CPU tensor of shape {tuple(shape)}"
        raise ConfigError(f"{what}: {name} must be a {want}, got {_describe(t)}")


def _positive_int(what: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{what}: {name} must be a non-negative integer, got {value!r}")
    return value


def packed_row_bytes(bits: int, d: int) -> int:
    """Bytes of one row of d integer codes (intcache.c's layout: int8 one per byte, int4 two)."""
    return d if bits == 8 else (d + 1) // 2


def _block_shape(what: str, type_name: str, blocks) -> tuple[int, int, int]:
    """(type id, rows, cols) of a (rows, row_bytes) uint8 block buffer; row_bytes must be whole blocks."""
    if type_name not in BLOCK_TYPES:
        raise ConfigError(f"{what}: block type {type_name!r} is not one of {', '.join(BLOCK_TYPES)}")
    type_id, per_block, block_bytes = BLOCK_TYPES[type_name]
    if not isinstance(blocks, torch.Tensor) or blocks.dim() != 2 or blocks.shape[1] % block_bytes:
        raise ConfigError(f"{what}: {type_name} blocks must be (rows, whole {block_bytes}-byte blocks) uint8, got {_describe(blocks)}")
    check_buffer(what, "blocks", blocks, torch.uint8, tuple(blocks.shape))
    return type_id, blocks.shape[0], blocks.shape[1] // block_bytes * per_block


class BlockKernel:
    """ctypes front end of the kernel library: block GEMV / dequantization and the caches' code kernels."""

    def __init__(self, lib: ctypes.CDLL, path: Path):
        self.path = path
        self.lib = lib   # the loaded library: the fused steps call its entry points directly
        i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
        lib.kvlab_block_gemv.argtypes = [i32, ptr, i64, i64, ptr, ptr, i32]
        lib.kvlab_block_dequantize.argtypes = [i32, ptr, i64, i64, ptr, i32]
        lib.kvlab_block_omp_threads.argtypes = [i32]
        lib.kvlab_int_decode.argtypes = [i32, ptr, ptr, ptr, i32, i64, i64, i32, i64, i64, i32, i32, i32, ptr, i32]
        lib.kvlab_int_attention.argtypes = [i32, ptr, ptr, ptr, ptr, ptr, ptr, i32, i64, i64, i32, i32, i32, i32, ptr, i64,
                                            ptr, i64, i32, ptr, i32, i32, i64, i64, ctypes.c_float, ptr, ptr, i32]
        lib.kvlab_block_gemm.argtypes = [i32, ptr, i64, i64, ptr, i64, ptr, i32]
        lib.kvlab_tq_code_tokens.argtypes = [ptr, i32, i32, i64, ptr, ptr, ptr, ptr, ptr, i32]
        lib.kvlab_int_code_tokens.argtypes = [ptr, i32, i32, i64, ptr, ptr, i64, ptr, ptr, ptr, i64, i32]
        for fn in (lib.kvlab_block_gemv, lib.kvlab_block_gemm, lib.kvlab_block_dequantize, lib.kvlab_block_omp_threads,
                   lib.kvlab_int_decode, lib.kvlab_int_attention, lib.kvlab_tq_code_tokens, lib.kvlab_int_code_tokens):
            fn.restype = i32

    def __deepcopy__(self, memo) -> "BlockKernel":
        return self   # one loaded library, shared (a copied cache reads through the same functions)

    def gemv(self, type_name: str, blocks: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """blocks (rows, row_bytes) uint8, x (cols,) fp32 contiguous -> y (rows,) fp32."""
        what = "block GEMV"
        type_id, rows, cols = _block_shape(what, type_name, blocks)
        check_buffer(what, "x", x, torch.float32, (cols,))
        y = torch.empty(rows, dtype=torch.float32) if out is None else out
        check_buffer(what, "output", y, torch.float32, (rows,))
        status = self.lib.kvlab_block_gemv(type_id, blocks.data_ptr(), rows, cols, x.data_ptr(), y.data_ptr(),
                                            torch.get_num_threads())
        if status != 0:
            raise ConfigError(f"block GEMV refused {type_name} blocks of shape {tuple(blocks.shape)}")
        return y

    def gemm(self, type_name: str, blocks: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Y = X Wᵀ straight from blocks (blockgemm.c): blocks (N, row_bytes) uint8, x (M, K) fp32, both contiguous
        CPU tensors -> (M, N) fp32; the same for any thread count."""
        if type_name not in BLOCK_TYPES:
            raise ConfigError(f"block GEMM: unknown block type {type_name!r}; choose {', '.join(BLOCK_TYPES)}")
        type_id, per_block, block_bytes = BLOCK_TYPES[type_name]
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_contiguous() or blocks.device.type != "cpu" \
                or blocks.shape[1] == 0 or blocks.shape[1] % block_bytes:
            raise ConfigError(f"block GEMM needs contiguous CPU uint8 {type_name} blocks (rows, k × {block_bytes} bytes), "
                              f"got {tuple(blocks.shape)} {blocks.dtype} on {blocks.device}")
        n, k = blocks.shape[0], blocks.shape[1] // block_bytes * per_block
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k or not x.is_contiguous() or x.device.type != "cpu":
            raise ConfigError(f"block GEMM needs a contiguous CPU fp32 (rows, {k}) input, got {tuple(x.shape)} {x.dtype} on {x.device}")
        m = x.shape[0]
        y = torch.empty(m, n, dtype=torch.float32) if out is None else out
        if y.dtype != torch.float32 or tuple(y.shape) != (m, n) or not y.is_contiguous() or y.device.type != "cpu":
            raise ConfigError(f"block GEMM output must be a contiguous CPU fp32 ({m}, {n}) tensor, got {tuple(y.shape)} {y.dtype}")
        status = self.lib.kvlab_block_gemm(type_id, blocks.data_ptr(), n, k, x.data_ptr(), m, y.data_ptr(), torch.get_num_threads())
        if status == -2:
            raise KvlabError(f"block GEMM: no memory for its scratch buffers ({m}×{k} packed input)")
        if status != 0:
            raise ConfigError(f"block GEMM refused {type_name} blocks of shape {tuple(blocks.shape)} with input {tuple(x.shape)}")
        return y

    def dequantize(self, type_name: str, blocks: torch.Tensor) -> torch.Tensor:
        """blocks (rows, row_bytes) uint8 contiguous -> (rows, cols) fp32, bit-exact d * q + m."""
        type_id, rows, cols = _block_shape("block dequantize", type_name, blocks)
        out = torch.empty(rows, cols, dtype=torch.float32)
        if self.lib.kvlab_block_dequantize(type_id, blocks.data_ptr(), rows, cols, out.data_ptr(), torch.get_num_threads()):
            raise ConfigError(f"block dequantize refused {type_name} blocks of shape {tuple(blocks.shape)}")
        return out

    def int_decode(self, bits: int, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, start: int, n: int,
                   token_group: int, channel_group: int) -> torch.Tensor:
        """Rows [start, start+n) of an integer cache's codes as zero + code·scale (intcache.c), a span's transient.
        codes (B, H, slots, row bytes) uint8; scale/zero (B, H, meta rows, D / channel_group) fp16, one row per
        `token_group` tokens (keys: token_group = G, channel_group = 1; values: 1 and Gv) -> (B, H, n, D) fp32."""
        what = f"int{bits} cache decode"
        if bits not in (4, 8) or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (token_group, channel_group)):
            raise ConfigError(f"{what}: bits must be 4 or 8 and the groups positive, got bits={bits!r} groups={token_group!r}, {channel_group!r}")
        if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (codes, scale, zero)):
            raise ConfigError(f"{what}: codes, scales and zeros must be 4-D, got {_describe(codes)}, {_describe(scale)}, {_describe(zero)}")
        B, H, slots, _ = codes.shape
        meta_rows, meta_cols = scale.shape[2], scale.shape[3]
        d = meta_cols * channel_group
        if d <= 0 or (bits == 4 and d % 2):
            raise ConfigError(f"{what}: head dim {d} does not fit int{bits} codes")
        check_buffer(what, "codes", codes, torch.uint8, (B, H, slots, packed_row_bytes(bits, d)))
        check_buffer(what, "scales", scale, torch.float16, (B, H, meta_rows, meta_cols))
        check_buffer(what, "zeros", zero, torch.float16, (B, H, meta_rows, meta_cols))
        start, n = _positive_int(what, "start", start), _positive_int(what, "n", n)
        if start + n > slots or (n and (start + n - 1) // token_group >= meta_rows):
            raise ConfigError(f"{what}: rows [{start}, {start + n}) asked of a cache of {slots} slots ({meta_rows} metadata rows)")
        out = torch.empty(B, H, n, d, dtype=torch.float32)
        if self.lib.kvlab_int_decode(bits, codes.data_ptr(), scale.data_ptr(), zero.data_ptr(), B * H, slots, meta_rows, meta_cols,
                                      start, n, d, token_group, channel_group, out.data_ptr(), torch.get_num_threads()):
            raise ConfigError(f"integer-cache decode refused int{bits} codes of shape {tuple(codes.shape)}")
        return out

    def int_attention(self, bits: int, k_codes: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
                      v_codes: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor, n: int, dv: int, group: int,
                      exact: torch.Tensor, q: torch.Tensor, T: int, first_count: int, first_lo: int,
                      attn_scale: float, recent: int = 0,
                      exact_values: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """An integer cache's attention over its n compressed tokens (intcache.c kvlab_int_attention: every row through
        kvlab_int_attend, as the fused step and the serving pool read).
        k_codes (B, H, slots, key row bytes), v_codes (B, H, slots, value row bytes) uint8; k_scale/k_zero
        (B, H, ⌈slots/G⌉, Dk), v_scale/v_zero (B, H, slots, Dv/Gv) fp16; exact (B, H, n - first, Dk) fp32 the keys of
        tokens [first, n) (the open groups', first <= the first query's group start); q (B, H, nq, Dk) fp32, row
        g·T + i the head g of the chunk's token i, which reads tokens [max(0, first_lo + i), min(n, first_count + i +
        recent)); with a recent window (recent > 0), those from first_count + i on exact, their values from exact_values
        (B, H, n - v_first, Dv) fp32, tokens [v_first, n) -> the normalized output (B, H, nq, Dv) and the log-sum-exp
        (B, H, nq) fp32 (-inf: a row that reads none)."""
        what = f"int{bits} cache attention"
        if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (k_codes, v_codes, v_scale, exact, q)):
            raise ConfigError(f"{what}: codes, scales, exact keys and queries must be 4-D")
        B, H, slots, _ = k_codes.shape
        nq, dk = q.shape[2], q.shape[3]
        n_vg = v_scale.shape[3]
        if not (1 <= bits <= 8) or n_vg <= 0 or dk <= 0 or dv <= 0 or dv % n_vg:
            raise ConfigError(f"{what}: bits must be 1..8 and {n_vg} value groups divide the heads, got int{bits}, head dims {dk}, {dv}")
        check_buffer(what, "key codes", k_codes, torch.uint8, (B, H, slots, packed_nbytes(dk, bits)))
        for name, t in (("key scales", k_scale), ("key zeros", k_zero)):
            check_buffer(what, name, t, torch.float16, (B, H, -(-slots // group), dk))
        check_buffer(what, "value codes", v_codes, torch.uint8, (B, H, slots, packed_nbytes(dv, bits)))
        for name, t in (("value scales", v_scale), ("value zeros", v_zero)):
            check_buffer(what, name, t, torch.float16, (B, H, slots, n_vg))
        check_buffer(what, "exact keys", exact, torch.float32, (B, H, exact.shape[2], dk))
        check_buffer(what, "query", q, torch.float32, (B, H, nq, dk))
        if recent and not (isinstance(exact_values, torch.Tensor) and exact_values.dim() == 4):
            raise ConfigError(f"{what}: a recent window needs the exact values of its tokens (4-D)")
        if recent:
            check_buffer(what, "exact values", exact_values, torch.float32, (B, H, exact_values.shape[2], dv))
        out = torch.empty(B, H, nq, dv, dtype=torch.float32)
        lse = torch.empty(B, H, nq, dtype=torch.float32)
        if self.lib.kvlab_int_attention(bits, k_codes.data_ptr(), k_scale.data_ptr(), k_zero.data_ptr(), v_codes.data_ptr(),
                                         v_scale.data_ptr(), v_zero.data_ptr(), B * H, slots, n, dk, dv, group, dv // n_vg,
                                         exact.data_ptr(), n - exact.shape[2],
                                         exact_values.data_ptr() if recent else None,
                                         n - exact_values.shape[2] if recent else 0, recent,
                                         q.data_ptr(), nq, T, first_count, first_lo,
                                         attn_scale, out.data_ptr(), lse.data_ptr(), torch.get_num_threads()):
            raise ConfigError(f"integer-cache attention refused {n} tokens, {nq} query rows of {T} tokens from "
                              f"{first_count}, {exact.shape[2]} exact keys over int{bits} codes of shape {tuple(k_codes.shape)}")
        return out, lse

    def tq_code_tokens(self, coded, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor | None,
                       sin: torch.Tensor | None) -> int:
        """kvlab_tq_code_tokens (decode.c): k, v (n, Hkv, d) fp32 coded into slots (n,) int64 of the TurboQuant layer
        `coded` (a cache/tq_kernel.py Coded, its buffers checked for `coded.checked` = (Hkv, d) where it was made; C
        checks each slot against its slots); +prerope: cos / sin (n, d) each token's. 0 stored, 1 a scale not
        finite, -1 refused."""
        what = "TurboQuant coding"
        heads, d = coded.checked
        n = slots.shape[0] if slots.dim() == 1 else -1
        check_buffer(what, "slots", slots, torch.int64, (n,))
        check_buffer(what, "keys", k, torch.float32, (n, heads, d))
        check_buffer(what, "values", v, torch.float32, (n, heads, d))
        for name, t in (("RoPE cos", cos), ("RoPE sin", sin)):
            if t is not None:
                check_buffer(what, name, t, torch.float32, (n, d))
        return self.lib.kvlab_tq_code_tokens(ctypes.byref(coded), heads, d, n, k.data_ptr(), v.data_ptr(), slots.data_ptr(),
                                              None if cos is None else cos.data_ptr(), None if sin is None else sin.data_ptr(),
                                              torch.get_num_threads())

    def int_code_tokens(self, quantized, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                        stage_rows: torch.Tensor) -> int:
        """kvlab_int_code_tokens (decode.c): k, v (n, Hkv, d) fp32 coded into slots (n,) of the integer pool layer
        `quantized` (a cache/int_kernel.py Quantized, its buffers checked for `quantized.checked` = (Hkv, d) where it
        was made; C checks each slot and stage row), token r at positions[r] with its key staged in stage row
        stage_rows[r]. 0 stored, 1 not finite, 2 beyond float16's range, -1 refused."""
        what = "integer coding"
        heads, d = quantized.checked
        n = slots.shape[0] if slots.dim() == 1 else -1
        for name, t in (("slots", slots), ("positions", positions), ("stage rows", stage_rows)):
            check_buffer(what, name, t, torch.int64, (n,))
        check_buffer(what, "keys", k, torch.float32, (n, heads, d))
        check_buffer(what, "values", v, torch.float32, (n, heads, d))
        stage_stride = quantized.group * heads * d                                 # floats of one stage row (G, Hkv, d)
        return self.lib.kvlab_int_code_tokens(ctypes.byref(quantized), heads, d, n, k.data_ptr(), v.data_ptr(),
                                               heads * d, slots.data_ptr(), positions.data_ptr(), stage_rows.data_ptr(),
                                               stage_stride, torch.get_num_threads())

    def openmp_threads(self, n: int) -> int:
        """Threads a parallel region of the kernel library actually gets when asked for n."""
        return self.lib.kvlab_block_omp_threads(n)


def block_kernel() -> BlockKernel | None:
    """The compiled library, built on first use; None (see kernel_status) when it cannot be had here or
    KVLAB_NO_KERNEL is set (checked on every call, so the planner and the loader always agree)."""
    if os.environ.get("KVLAB_NO_KERNEL"):
        return None
    return _loaded_kernel()


def kernel_expected() -> bool:
    """Whether block_kernel() would give a library, answered without building anything (the planner's
    question): what this process already got when it has tried, else whether a compiler is here to build
    one. Only a build that fails later makes the loader fall back where this said yes."""
    if os.environ.get("KVLAB_NO_KERNEL"):
        return False
    if _loaded_kernel.cache_info().currsize:
        return _loaded_kernel() is not None
    return compiler_available()


def _evenly_strided_rows(p: torch.Tensor) -> torch.Tensor:
    """p (B, H, nq, n) as the C code reads it: contiguous rows of n, row r at r × p.stride(2) (a slice of
    the last dim of a contiguous tensor qualifies as is); anything else is copied."""
    B, H, nq, _ = p.shape
    if p.stride(-1) != 1 or p.stride(2) * nq != p.stride(1) or p.stride(1) * H != p.stride(0):
        return p.contiguous()
    return p


class _BuildFailed(Exception):
    """Internal: the compiler ran and failed (building elsewhere would fail the same way)."""


def _build_into(compiler: str, target: Path) -> Path:
    try:
        compile_library(compiler, target)
    except OSError as exc:
        if str(exc).startswith(f"{compiler} failed"):
            raise _BuildFailed(str(exc)) from None
        raise
    if not verified(target):
        raise OSError(f"{target} does not match its recorded size and sha256 right after the build")
    return target


@functools.lru_cache(maxsize=1)
def _private_folder() -> Path:
    """A folder of this process only (removed at exit): the fallback when the cache folder is unusable."""
    import atexit

    folder = Path(tempfile.mkdtemp(prefix="kvlab-kernels-"))
    atexit.register(shutil.rmtree, folder, True)
    return folder


def obtain_library(compiler: str) -> Path:
    """A verified library for this build: the cached one, else built into the cache folder (replacing a
    damaged file), else, with one warning line, built into a private temporary folder."""
    target = library_path(compiler)
    if verified(target):
        return target
    try:
        return _build_into(compiler, target)
    except (OSError, subprocess.SubprocessError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        fallback = _private_folder() / target.name
        _warn(f"kernel cache folder {target.parent} is unusable ({reason}); building the kernels into {fallback.parent} "
              "for this run")
        return _build_into(compiler, fallback)


@functools.lru_cache(maxsize=1)
def _loaded_kernel() -> BlockKernel | None:
    global _status
    compiler = _compiler()
    if compiler is None:
        _status = f"no C compiler ({os.environ.get('CC') or 'cc'}) on PATH"
        return None
    try:
        target = obtain_library(compiler)
        lib = ctypes.CDLL(str(target))  # torch is imported above: libgomp.so.1 resolves to torch's copy
    except (OSError, subprocess.SubprocessError, _BuildFailed) as exc:
        _status = f"kernel unavailable: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        _warn(f"C kernels unavailable ({_status.removeprefix('kernel unavailable: ')}); using dense fp32 weights and torch paths")
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
