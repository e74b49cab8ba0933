"""Child graphs of kernel nodes bound to green contexts, launched directly or attached to a torch capture.

A :class:`GreenGraph` holds kernel nodes whose ``CUDA_KERNEL_NODE_PARAMS.ctx`` is the ``CUcontext`` of a partition's
green context, so each node runs on that partition's SMs. Nodes without dependencies are concurrent roots. Outside
capture the graph is instantiated and launched on the caller's stream; inside a ``torch.cuda.graph`` capture it is
added to the capturing graph as a child node (``cuStreamGetCaptureInfo`` -> ``cuGraphAddChildGraphNode`` ->
``cuStreamUpdateCaptureDependencies``), so a serving engine's CUDA-graph runner can capture a layer call.
A dependency may be programmatic (``KernelNode.programmatic``: a ``CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC`` edge
from the kernel's programmatic port): the dependent grid then launches once every CTA of the earlier one has
executed ``griddepcontrol.launch_dependents`` (or exited), so its launch and prologue overlap the earlier grid, and
it synchronizes through memory flags or ``griddepcontrol.wait`` (kernels/common/sync.cuh).
Before a kernel is placed in a graph it is launched once in its context (first launches can serialize).
Without a partition (``partition=None``, e.g. ``GC_MOE_PARTITION=off``) every node runs in the caller's context.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from cuda.bindings import driver

from .cuda import as_stream, call, current_context
from .green import Partition, Role
from .jit import Kernel
from .launch import Dim3, dim3, launch
from .params import KernelArgs

_CAPTURE_ACTIVE = driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE


@dataclass(frozen=True)
class KernelNode:
    """One kernel node: ``role`` picks the green context (None: the caller's undivided context).

    ``deps`` names earlier nodes this one waits for; those also in ``programmatic`` through a programmatic edge
    (module docstring), the others until they complete. ``warmup_args`` are the arguments of the one-time warm-up
    launch in the node's context; None means ``args`` are safe to launch once more.
    """

    name: str
    kernel: Kernel
    role: Role | None
    grid: Dim3
    block: Dim3
    args: KernelArgs
    shared_bytes: int = 0
    deps: tuple[str, ...] = ()
    warmup_args: KernelArgs | None = None
    programmatic: tuple[str, ...] = ()

    @staticmethod
    def make(
        name: str,
        kernel: Kernel,
        role: Role | None,
        grid: int | Sequence[int],
        block: int | Sequence[int],
        args: KernelArgs,
        *,
        shared_bytes: int = 0,
        deps: Sequence[str] = (),
        warmup_args: KernelArgs | None = None,
        programmatic: Sequence[str] = (),
    ) -> KernelNode:
        """A node with normalized launch shapes; ``programmatic`` must name dependencies in ``deps``."""
        stray = [d for d in programmatic if d not in deps]
        if stray:
            raise ValueError(f"node {name!r}: programmatic dependencies {stray} are not among its deps {list(deps)}")
        return KernelNode(name, kernel, role, dim3(grid), dim3(block), args, shared_bytes, tuple(deps), warmup_args,
                          tuple(programmatic))

    def signature(self) -> tuple[object, ...]:
        """Cache identity: kernel, context role, launch shapes, by-value parameter bytes, dependencies and their
        kinds."""
        role = self.role.value if self.role else None
        return (
            self.name,
            self.kernel.module_key,
            self.kernel.name,
            role,
            self.grid,
            self.block,
            self.shared_bytes,
            self.args.signature,
            self.deps,
            self.programmatic,
        )


def capture_graph(stream: driver.CUstream) -> tuple[driver.CUgraph, list[driver.CUgraphNode]] | None:
    """(graph being captured, current dependencies) if ``stream`` is capturing, else None."""
    # Outputs: status, id, graph, dependencies, (edge data,) dependency count.
    info = call(driver.cuStreamGetCaptureInfo, stream)
    if info[0] != _CAPTURE_ACTIVE:
        return None
    return info[2], list(info[3] or [])[: int(info[-1])]


def edge_adder(bindings: object = driver) -> object:
    """The driver call that adds edges with edge data: ``cuGraphAddDependencies`` in the CUDA 13 bindings,
    ``cuGraphAddDependencies_v2`` in the 12.x ones (there the plain name takes no edge data); both take ``(graph,
    from, to, edge data, count)``."""
    return getattr(bindings, "cuGraphAddDependencies_v2", None) or bindings.cuGraphAddDependencies


def _programmatic_edge() -> driver.CUgraphEdgeData:
    """Edge data of a programmatic dependency: out of the earlier kernel's programmatic port (it opens when every
    CTA has launched its dependents or exited) into the later kernel's launch."""
    edge = driver.CUgraphEdgeData()
    edge.type = driver.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
    edge.from_port = driver.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
    return edge


_warmed: set[tuple[str, str, int]] = set()
_graphs: dict[tuple[object, ...], GreenGraph] = {}
_lock = threading.Lock()
_watched: set[int] = set()


def _forget(partition: Partition) -> None:
    """Close callback: drops the partition's graphs and warm-up records (its context handles may be reused)."""
    contexts = {int(partition.comm.ctx), int(partition.compute.ctx)}
    with _lock:
        graphs = [_graphs.pop(k) for k, g in list(_graphs.items()) if g.partition is partition]
        _warmed.difference_update({k for k in _warmed if k[2] in contexts})
        _watched.discard(id(partition))
    for graph in graphs:
        graph.destroy()


def _watch(partition: Partition) -> None:
    with _lock:
        if id(partition) in _watched:
            return
        _watched.add(id(partition))
    partition.on_close(_forget)


def _warm_up(node: KernelNode, partition: Partition | None) -> None:
    """Launches ``node.kernel`` once in its context (and waits) unless that was done before in this process."""
    if node.role is None:
        ctx, stream = current_context(), as_stream(torch.cuda.current_stream().cuda_stream)
    else:
        side = partition.side(node.role)
        ctx, stream = int(side.ctx), side.stream
    key = (node.kernel.module_key, node.kernel.name, ctx)
    if partition is not None:
        _watch(partition)
    with _lock:
        if key in _warmed:
            return
        if torch.cuda.is_current_stream_capturing() or capture_graph(stream) is not None:
            raise RuntimeError(
                f"kernel {node.kernel.name} has not run in its context yet and a stream is capturing: "
                "build the GreenGraph before capture (warm-up launches cannot be captured)"
            )
        args = node.args if node.warmup_args is None else node.warmup_args
        launch(node.kernel, node.grid, node.block, args, stream, node.shared_bytes)
        call(driver.cuStreamSynchronize, stream)
        _warmed.add(key)


class GreenGraph:
    """A CUDA graph of :class:`KernelNode` s on one partition (or, with ``partition=None``, on the caller's context:
    every node's ``role`` must then be None). Build with :func:`get_graph` to share the cache."""

    def __init__(self, nodes: Sequence[KernelNode], partition: Partition | None) -> None:
        names = [n.name for n in nodes]
        if len(set(names)) != len(names):
            raise ValueError(f"graph node names must be unique, got {names}")
        if partition is None and any(n.role is not None for n in nodes):
            raise ValueError(f"nodes {[n.name for n in nodes if n.role is not None]} name a green context role but "
                             "the graph has no partition")
        for i, node in enumerate(nodes):
            missing = [d for d in node.deps if d not in names[:i]]
            if missing:
                raise ValueError(f"node {node.name!r} depends on {missing}, which are not earlier nodes")
        self.partition = partition
        self.nodes = tuple(nodes)
        for node in nodes:
            _warm_up(node, partition)
        self.graph = call(driver.cuGraphCreate, 0)
        self._exec: driver.CUgraphExec | None = None
        handles: dict[str, driver.CUgraphNode] = {}
        for node in nodes:
            params = driver.CUDA_KERNEL_NODE_PARAMS()
            params.kern = node.kernel.handle
            if node.role is not None:
                params.ctx = partition.side(node.role).ctx
            params.gridDimX, params.gridDimY, params.gridDimZ = node.grid
            params.blockDimX, params.blockDimY, params.blockDimZ = node.block
            params.sharedMemBytes = node.shared_bytes
            params.kernelParams = node.args.address
            deps = [handles[d] for d in node.deps if d not in node.programmatic]
            handles[node.name] = call(driver.cuGraphAddKernelNode, self.graph, deps, len(deps), params)
            for dep in node.programmatic:  # one edge a call: each gets its own edge data
                call(edge_adder(), self.graph, [handles[dep]], [handles[node.name]], [_programmatic_edge()], 1)

    def launch(self, stream: int | driver.CUstream | None = None) -> None:
        """Runs the graph on ``stream`` (default: torch's current stream), or attaches it if that stream captures."""
        handle = as_stream(torch.cuda.current_stream().cuda_stream if stream is None else stream)
        capture = capture_graph(handle)
        if capture is None:
            self.replay(handle)
            return
        outer, deps = capture
        child = call(driver.cuGraphAddChildGraphNode, outer, deps, len(deps), self.graph)
        flags = driver.CUstreamUpdateCaptureDependencies_flags.CU_STREAM_SET_CAPTURE_DEPENDENCIES
        call(driver.cuStreamUpdateCaptureDependencies, handle, [child], None, 1, flags)

    def replay(self, stream: int | driver.CUstream) -> None:
        """Launches the instantiated graph on ``stream``; outside capture only (use :meth:`launch` in general)."""
        if self._exec is None:
            self._exec = call(driver.cuGraphInstantiate, self.graph, 0)
        call(driver.cuGraphLaunch, self._exec, as_stream(stream))

    def destroy(self) -> None:
        """Frees the executable and the graph (their kernels must have finished)."""
        if self._exec is not None:
            call(driver.cuGraphExecDestroy, self._exec)
            self._exec = None
        if self.graph is not None:
            call(driver.cuGraphDestroy, self.graph)
            self.graph = None


def get_graph(nodes: Sequence[KernelNode], partition: Partition | None) -> GreenGraph:
    """The cached graph for (kernels, launch shapes, by-value parameters, partition); built on first use.

    Graphs are destroyed when their partition is closed (graphs without a partition live as long as the process).
    """
    part_key = None if partition is None else (id(partition), partition.key)
    key = (part_key, current_context(), tuple(n.signature() for n in nodes))
    with _lock:
        graph = _graphs.get(key)
    if graph is not None:
        return graph
    graph = GreenGraph(nodes, partition)
    with _lock:
        existing = _graphs.setdefault(key, graph)
    if existing is not graph:
        graph.destroy()
    return existing
