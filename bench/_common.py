"""What every benchmark script shares: the protocol's window timing (docs/bench_protocol.md), the result file's
``meta`` block, and the check that the GPUs a script measures on are there.

The protocol itself lives in the package (:mod:`gc_moe_compat.ab.protocol`, shared with ``gc-moe-ab``) and the PNG
helper in :mod:`gc_moe_compat.ab.report`; this module re-exports them under the names the scripts import.
Benchmarks run as scripts (``python bench/NAME.py``), so this module is imported from the script's own folder.
"""

from __future__ import annotations

from pathlib import Path

from gc_moe_compat.ab.protocol import (
    L2_FLUSH_BYTES,
    PER_WINDOW,
    copy_bandwidth,
    expert_floor_bytes,
    result_meta,
    timed_windows,
    write_partial_result,
    write_result,
)
from gc_moe_compat.ab.report import pyplot

__all__ = ["L2_FLUSH_BYTES", "PER_WINDOW", "REPO", "copy_bandwidth", "expert_floor_bytes", "gpu_shortfall",
           "point_global", "pyplot", "require_gpus", "result_meta", "timed_windows", "write_partial_result",
           "write_result"]

REPO = Path(__file__).resolve().parents[1]


def gpu_shortfall(script: str, count: int, found: int, hint: str = "") -> str | None:
    """The one-line message of a benchmark that needs ``count`` CUDA GPUs where ``found`` are visible, or None when
    there are enough. ``hint``: what the script can still do without them (e.g. its ``--dry-run``)."""
    if found >= count:
        return None
    need = "a CUDA GPU" if count == 1 else f"{count} GPUs on one host"
    seen = "torch sees no CUDA device" if found == 0 else f"found {found}"
    return f"{script}: needs {need} ({seen}){'; ' + hint if hint else ''}"


def require_gpus(script: str, count: int = 1, hint: str = "") -> None:
    """Exit with :func:`gpu_shortfall`'s message (status 1) instead of a traceback where the GPUs are missing: the
    benchmarks time CUDA kernels and have nothing to run on a CPU machine."""
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    message = gpu_shortfall(script, count, found, hint)
    if message is not None:
        raise SystemExit(message)


def point_global(library: object, name: bytes, target: object) -> None:
    """Sets the device-pointer global ``name`` of the loaded ``library`` (a ``CUlibrary``: a marked kernel variant's
    record pointer) to the address of the tensor ``target``, in the current CUDA context: a library's globals have a
    copy per context, so a caller whose kernels run on green contexts pushes each of them first."""
    import numpy as np
    from cuda.bindings import driver

    from gc_moe_compat.runtime.cuda import call

    address, size = call(driver.cuLibraryGetGlobal, library, name)
    if size != 8:
        raise RuntimeError(f"{name.decode()}: a pointer of 8 bytes expected, the module's global has {size}")
    pointer = np.array([target.data_ptr()], dtype=np.uint64)
    call(driver.cuMemcpyHtoD, address, pointer.ctypes.data, 8)
