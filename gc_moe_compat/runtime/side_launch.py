"""A single kernel launched on one green context's SMs, in the order of the caller's stream.

The operator's kernels run as nodes of a cached :class:`~gc_moe_compat.runtime.graph.GreenGraph`. A kernel launched
once per call with fresh by-value arguments (the ``deep_ep`` facade's communication kernels) cannot be cached that
way, so :func:`launch_on` places it on a partition's side directly:

* outside capture, on the side's own stream between a fork and a join event: the side's stream waits for the work
  queued on the caller's stream, and the caller's stream waits for the kernel (so the launch is stream-ordered with
  the caller's work, as a launch on the caller's stream is, but runs on the side's SMs);
* inside a capture of the caller's stream, as a kernel node whose ``ctx`` is the side's green context, added after
  the capture's current dependencies, which it then replaces (the way a GreenGraph attaches its child graph).

The fork event is created in the caller's context and the join event in the green context (each recorded on a stream
of its own context; ``cuStreamWaitEvent`` accepts an event of another context). Partitions are cached per thread
(:func:`~gc_moe_compat.runtime.green.get_partition`), and so are these events; they are destroyed with the partition.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from cuda.bindings import driver

from .cuda import as_stream, call
from .graph import capture_graph
from .green import Partition, Role
from .jit import Kernel
from .launch import dim3, launch
from .params import KernelArgs

__all__ = ["launch_on"]

_events: dict[int, tuple[driver.CUevent, driver.CUevent]] = {}
_lock = threading.Lock()


def _destroy_events(partition: Partition) -> None:
    with _lock:
        pair = _events.pop(id(partition), None)
    for event in pair or ():
        call(driver.cuEventDestroy, event)


def _fork_join(partition: Partition, role: Role) -> tuple[driver.CUevent, driver.CUevent]:
    """The partition's (fork, join) events: fork in the current context, join in ``role``'s green context."""
    with _lock:
        pair = _events.get(id(partition))
    if pair is not None:
        return pair
    flags = driver.CUevent_flags.CU_EVENT_DISABLE_TIMING
    fork = call(driver.cuEventCreate, flags)
    call(driver.cuCtxPushCurrent, partition.side(role).ctx)
    try:
        join = call(driver.cuEventCreate, flags)
    finally:
        call(driver.cuCtxPopCurrent)
    with _lock:
        _events[id(partition)] = (fork, join)
    partition.on_close(_destroy_events)
    return fork, join


def launch_on(partition: Partition | None, role: Role, kernel: Kernel, grid: int | Sequence[int],
              block: int | Sequence[int], args: KernelArgs, stream: int | driver.CUstream) -> None:
    """Launches ``kernel`` on the SMs of ``partition``'s ``role`` side, ordered after the work queued on ``stream``
    (the caller's, e.g. torch's current stream) and before what is queued on it next; captured as a green-context
    kernel node when ``stream`` is capturing. ``partition=None`` launches on ``stream`` itself (the whole device)."""
    caller = as_stream(stream)
    if partition is None:
        launch(kernel, grid, block, args, caller)
        return
    side = partition.side(role)
    capture = capture_graph(caller)
    if capture is not None:
        graph, deps = capture
        params = driver.CUDA_KERNEL_NODE_PARAMS()
        params.kern = kernel.handle
        params.ctx = side.ctx
        params.gridDimX, params.gridDimY, params.gridDimZ = dim3(grid)
        params.blockDimX, params.blockDimY, params.blockDimZ = dim3(block)
        params.sharedMemBytes = 0
        params.kernelParams = args.address
        node = call(driver.cuGraphAddKernelNode, graph, deps, len(deps), params)
        flags = driver.CUstreamUpdateCaptureDependencies_flags.CU_STREAM_SET_CAPTURE_DEPENDENCIES
        call(driver.cuStreamUpdateCaptureDependencies, caller, [node], None, 1, flags)
        return
    fork, join = _fork_join(partition, role)
    call(driver.cuEventRecord, fork, caller)
    call(driver.cuStreamWaitEvent, side.stream, fork, 0)
    launch(kernel, grid, block, args, side.stream)
    call(driver.cuEventRecord, join, side.stream)
    call(driver.cuStreamWaitEvent, caller, join, 0)
