"""Direct kernel launches on a stream (outside graphs), e.g. on a green context's stream."""

from __future__ import annotations

from collections.abc import Sequence

from cuda.bindings import driver

from .cuda import as_stream, call
from .jit import Kernel
from .params import Arg, KernelArgs, as_args

Dim3 = tuple[int, int, int]


def dim3(value: int | Sequence[int]) -> Dim3:
    """A grid or block shape as three positive ints."""
    dims = (value, 1, 1) if isinstance(value, int) else tuple(value) + (1,) * (3 - len(value))
    if len(dims) != 3 or any(int(d) < 1 for d in dims):
        raise ValueError(f"launch dimensions must be 1 to 3 positive ints, got {value!r}")
    return (int(dims[0]), int(dims[1]), int(dims[2]))


def launch(
    kernel: Kernel,
    grid: int | Sequence[int],
    block: int | Sequence[int],
    args: KernelArgs | Sequence[Arg],
    stream: int | driver.CUstream,
    shared_bytes: int = 0,
) -> None:
    """Launches ``kernel`` on ``stream``; a green context's stream runs it in that context (on its SMs)."""
    g, b, packed = dim3(grid), dim3(block), as_args(args)
    call(driver.cuLaunchKernel, kernel.handle, *g, *b, shared_bytes, as_stream(stream), packed.address, 0)
