"""``needs_nvcc``: the skip mark of the CPU tests that compile kernels (CI has nvcc 13.0; a machine without it skips
them with the reason), and :func:`serialized_wgmma`, the compile-time check those tests share."""

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


def serialized_wgmma(warnings: tuple[str, ...]) -> list[str]:
    """The compiler warnings of a build that say ptxas serialized WGMMAs (C7511/C7519: each waits for the previous
    one, the SM90 GEMMs' lost overlap that commit d988dbb fixed)."""
    return [w for w in warnings if "C7511" in w or "C7519" in w or ("wgmma" in w.lower() and "serializ" in w.lower())]
