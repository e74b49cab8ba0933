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
of its own context; ``cuStreamWaitEvent`` accepts an event of another context). :func:`fork` / :func:`join` are the
two halves, for other work queued on a side's stream (``GreenSide.torch_stream``). Partitions are cached per thread
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

__all__ = ["fork", "join", "launch_on"]

_events: dict[tuple[int, Role], tuple[driver.CUevent, driver.CUevent]] = {}
_lock = threading.Lock()


def _destroy_events(partition: Partition) -> None:
    with _lock:
        pairs = [_events.pop(key) for key in list(_events) if key[0] == id(partition)]
    for pair in pairs:
        for event in pair:
            call(driver.cuEventDestroy, event)


def _fork_join(partition: Partition, role: Role) -> tuple[driver.CUevent, driver.CUevent]:
    """The (fork, join) events of ``partition``'s ``role`` side: fork in the current context, join in the side's
    green context."""
    key = (id(partition), role)
    with _lock:
        pair = _events.get(key)
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
        first = not any(k[0] == id(partition) for k in _events)
        _events[key] = (fork, join)
    if first:
        partition.on_close(_destroy_events)
    return fork, join


def fork(partition: Partition, role: Role, stream: int | driver.CUstream) -> None:
    """Makes the ``role`` side's stream wait for the work queued on ``stream`` so far (outside capture)."""
    event = _fork_join(partition, role)[0]
    call(driver.cuEventRecord, event, as_stream(stream))
    call(driver.cuStreamWaitEvent, partition.side(role).stream, event, 0)


def join(partition: Partition, role: Role, stream: int | driver.CUstream) -> None:
    """Makes ``stream`` wait for the work queued on the ``role`` side's stream so far (outside capture)."""
    event = _fork_join(partition, role)[1]
    call(driver.cuEventRecord, event, partition.side(role).stream)
    call(driver.cuStreamWaitEvent, as_stream(stream), event, 0)


def launch_on(partition: Partition, role: Role, kernel: Kernel, grid: int | Sequence[int],
              block: int | Sequence[int], args: KernelArgs, stream: int | driver.CUstream) -> None:
    """Launches ``kernel`` on the SMs of ``partition``'s ``role`` side, ordered after the work queued on ``stream``
    (the caller's, e.g. torch's current stream) and before what is queued on it next; captured as a green-context
    kernel node when ``stream`` is capturing. (Without a partition a launch on ``stream`` itself is
    :func:`~gc_moe_compat.runtime.launch.launch`.)"""
    caller = as_stream(stream)
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
    fork(partition, role, caller)
    launch(kernel, grid, block, args, side.stream)
    join(partition, role, caller)
