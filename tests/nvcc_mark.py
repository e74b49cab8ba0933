"""``needs_nvcc``: the skip mark of the CPU tests that compile kernels (CI has nvcc 13.0; a machine without it skips
them with the reason)."""

from __future__ import annotations

import pytest

from gc_moe_compat.runtime import jit


def _has_nvcc() -> bool:
    try:
        jit.find_nvcc()
    except jit.JitError:
        return False
    return True


needs_nvcc = pytest.mark.skipif(not _has_nvcc(), reason="needs nvcc (CI has nvcc 13.0)")
