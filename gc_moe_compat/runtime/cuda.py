"""Checked access to the CUDA driver API (cuda-bindings).

Every driver call in the runtime goes through :func:`call`, which turns a non-success ``CUresult`` into a
:class:`CudaError` carrying the CUDA error name, so no call site checks results by hand and none is forgotten.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from cuda.bindings import driver


class CudaError(RuntimeError):
    """A CUDA driver call returned an error; ``name`` is the CUDA error name (e.g. ``CUDA_ERROR_INVALID_VALUE``)."""

    def __init__(self, func: str, result: driver.CUresult) -> None:
        self.func = func
        self.result = result
        self.name = error_name(result)
        super().__init__(f"{func} failed: {self.name} ({int(result)}): {_error_string(result)}")


def error_name(result: driver.CUresult) -> str:
    """The CUDA error name of ``result``, or the enum's own name if the driver cannot name it."""
    err, name = driver.cuGetErrorName(result)
    if err != driver.CUresult.CUDA_SUCCESS or not name:
        return getattr(result, "name", f"CUresult({int(result)})")
    return name.decode()


def _error_string(result: driver.CUresult) -> str:
    err, text = driver.cuGetErrorString(result)
    return text.decode() if err == driver.CUresult.CUDA_SUCCESS and text else "no description"


def call(func: Callable[..., tuple[Any, ...]], *args: Any) -> Any:
    """Calls a cuda-bindings driver function and returns its outputs, raising :class:`CudaError` on failure.

    cuda-bindings returns ``(CUresult, *outputs)``; this returns ``None`` for no output, the output itself for one,
    and the tuple of outputs otherwise.
    """
    result, *outputs = func(*args)
    if result != driver.CUresult.CUDA_SUCCESS:
        raise CudaError(getattr(func, "__name__", repr(func)), result)
    if not outputs:
        return None
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


@functools.cache
def init_driver() -> None:
    """Initializes the driver once per process (``cuInit``); safe to call from every entry point."""
    call(driver.cuInit, 0)


def device(ordinal: int) -> driver.CUdevice:
    """The ``CUdevice`` of a device ordinal (the same numbering torch uses)."""
    init_driver()
    return call(driver.cuDeviceGet, ordinal)


def current_context() -> int:
    """The calling thread's current ``CUcontext`` as an integer handle (0 when none is current)."""
    init_driver()
    return int(call(driver.cuCtxGetCurrent))


def as_stream(handle: int | driver.CUstream) -> driver.CUstream:
    """A ``CUstream`` from a raw handle such as ``torch.cuda.current_stream().cuda_stream``."""
    return handle if isinstance(handle, driver.CUstream) else driver.CUstream(int(handle))
