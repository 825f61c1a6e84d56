"""The C kernels in tests: skip only where they cannot exist (no compiler, KVLAB_NO_KERNEL); a compiler
whose build fails is a failure, never a silent skip."""

from __future__ import annotations

import functools
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from kvlab import kernels

#: the build flags that force each kernel variant in the per-ISA tests (instead of -march=native)
MARCH = {"avx512": "-march=x86-64-v4", "avx2": "-march=haswell", "plain": "-march=x86-64"}
#: the /proc/cpuinfo flag each variant needs to run here
CPU_NEEDS = {"avx512": "avx512f", "avx2": "avx2", "plain": ""}


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


def build_variant(source: str, name: str, march: list[str], needs: str, folder: Path, also: tuple[str, ...] = ()) -> Path:
    """kernels/`source` built alone (with the kernels it calls, `also`) with `march` instead of -march=native, as
    folder/<stem>-<name>.so: skipped only where that build cannot run here (no cc, not x86-64, a CPU without `needs`);
    a failed build fails."""
    compiler = shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler (cc)")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"the {name} variant is an x86-64 build")
    if needs and needs not in cpu_flags():
        pytest.skip(f"this CPU cannot run the {name} build")
    target = folder / f"{Path(source).stem}-{name}.so"
    flags = [g for f in kernels.FLAGS for g in (march if f == "-march=native" else [f])]
    sources = [str(kernels.HERE / f) for f in (source, *also)]
    run = subprocess.run([compiler, *flags, "-o", str(target), *sources, *kernels.LIBS],
                         capture_output=True, text=True)
    if run.returncode != 0:
        pytest.fail(f"{source} does not build with {' '.join(march)}: {(run.stderr or run.stdout).strip()[:400]}")
    return target


def runnable_here(name: str) -> None:
    """Skip where the `name` build cannot run here: no cc, not x86-64, or a CPU without the variant's flag."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler (cc)")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"the {name} variant is an x86-64 build")
    if CPU_NEEDS[name] and CPU_NEEDS[name] not in cpu_flags():
        pytest.skip(f"this CPU cannot run the {name} build")


#: the per-ISA libraries of this test run, built once and shared by every test module
_VARIANTS = tempfile.TemporaryDirectory(prefix="kvlab-isa-")


def library_variant(name: str) -> Path:
    """The whole kernel library (kernels.SOURCES) built with MARCH[name] instead of -march=native, once per test
    run: skipped only where that build cannot run here, a failed build fails."""
    runnable_here(name)
    return _build_library(name)


@functools.lru_cache(maxsize=None)
def _build_library(name: str) -> Path:
    target = Path(_VARIANTS.name) / f"kvlab-{name}.so"
    flags = [MARCH[name] if f == "-march=native" else f for f in kernels.FLAGS]
    status, output = kernels.build_shared(shutil.which("cc"), flags, kernels.SOURCES, target)
    if status != 0:
        pytest.fail(f"the kernels do not build with {MARCH[name]}: {output.strip()[:400]}")
    return target


@pytest.fixture(autouse=True)
def one_thread():
    """Numerics only: one thread keeps kernel checks quick on a busy machine (a thread-count test sets its own).
    Autouse in every test module that imports it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def require_kernel() -> kernels.BlockKernel:
    kernel = kernels.block_kernel()
    if kernel is not None:
        return kernel
    if os.environ.get("KVLAB_NO_KERNEL") or not kernels.compiler_available():
        pytest.skip(f"no C kernel here: {kernels.kernel_status()}")
    pytest.fail(f"a C compiler is here but the kernel library did not build or load: {kernels.kernel_status()}")
