"""The C kernels in tests: skip only where they cannot exist (no compiler, KVLAB_NO_KERNEL); a compiler
whose build fails is a failure, never a silent skip."""

from __future__ import annotations

import os

import pytest

from kvlab import kernels


def require_kernel() -> kernels.BlockKernel:
    kernel = kernels.block_kernel()
    if kernel is not None:
        return kernel
    if os.environ.get("KVLAB_NO_KERNEL") or not kernels.compiler_available():
        pytest.skip(f"no C kernel here: {kernels.kernel_status()}")
    pytest.fail(f"a C compiler is here but the kernel library did not build or load: {kernels.kernel_status()}")
