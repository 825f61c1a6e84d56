"""The C kernels in tests: skip only where they cannot exist (no compiler, KVLAB_NO_KERNEL); a compiler
whose build fails is a failure, never a silent skip."""

from __future__ import annotations

import os

import pytest
import torch

from kvlab import kernels

#: the build flags that force each kernel variant in the per-ISA tests (instead of -march=native)
MARCH = {"avx512": "-march=x86-64-v4", "avx2": "-march=haswell", "plain": "-march=x86-64"}


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
