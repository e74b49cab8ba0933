"""The operator assembly on SM90: role1, role2 and role3 of one call as one CUDA child graph (paper §4.1, §4.6).

Partitioned (``GC_MOE_PARTITION=on``): role1 (:mod:`.dispatch`) on the communication green context and role2
(:mod:`.role2`) on the compute one are concurrent roots with no edge between them (they handshake through the ring
signals); role3 (:mod:`.finalize`) on the compute context depends on both. Unpartitioned (``off``): the same
kernels on the whole device in sequence, role1 -> role2 -> role3 (the buffer's ring then holds the whole pool, so
role1 never waits for a refill that only role2 could grant).

Graphs come from :func:`gc_moe_compat.runtime.graph.get_graph` (cached by kernels, launch shapes, by-value
parameters and partition; every kernel is warmed up in its context before the graph is built) and are also kept
per call configuration in :class:`LayerCache`, so a replay does no JIT lookup or tensor-map encoding. A launch runs
on the caller's torch stream, or attaches as a child node when that stream is capturing (``torch.cuda.graph``).
:func:`raise_for_layer_status` reads the three roles' status records after the graph (role1 first: its failure
makes the others give up) and raises :class:`~gc_moe_compat.runtime.status.DeviceTimeoutError` /
``DeviceCheckError`` naming the role and the site.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from gc_moe_compat.operator.buffer import GcMoeBuffer
from gc_moe_compat.operator.ring import RingModel, RingPlan
from gc_moe_compat.operator.sm90 import role1_dispatch, role2_gemm, role3_finalize
from gc_moe_compat.operator.weights import GcMoeWeights
from gc_moe_compat.runtime.cuda import as_stream
from gc_moe_compat.runtime.graph import GreenGraph, KernelNode, capture_graph, get_graph
from gc_moe_compat.runtime.green import get_partition

__all__ = ["NODE_NAMES", "LayerCache", "LayerCall", "layer_nodes", "raise_for_layer_status", "run_layer"]

NODE_NAMES = ("role1", "role2", "role3")


@dataclass(frozen=True)
class LayerCall:
    """Everything one call's graph depends on besides the buffer: tokens, ring model and plan, role2 variant,
    epilogue constants, the optional statistics tensor and the spin timeout."""

    num_tokens: int
    model: RingModel
    plan: RingPlan
    variant: role2_gemm.Role2Variant
    activation_clamp: float | None
    activation_alpha: float
    recv_stats: torch.Tensor | None = None
    timeout_ms: float | None = None


def layer_nodes(buffer: GcMoeBuffer, y: torch.Tensor, weights: role2_gemm.Role2Weights,
                call: LayerCall) -> list[KernelNode]:
    """The three kernel nodes of one call, in graph order, with the dependencies of the buffer's partition mode."""
    partitioned = buffer.partition == "on"
    r1 = role1_dispatch.dispatch_node(buffer, call.plan, call.num_tokens, timeout_ms=call.timeout_ms,
                                      name=NODE_NAMES[0])
    r2 = role2_gemm.role2_node(buffer, weights, call.model, call.plan, call.variant, name=NODE_NAMES[1],
                          deps=() if partitioned else (NODE_NAMES[0],), activation_clamp=call.activation_clamp,
                          activation_alpha=call.activation_alpha, timeout_ms=call.timeout_ms)
    r3 = role3_finalize.finalize_node(buffer, y, deps=NODE_NAMES[:2] if partitioned else NODE_NAMES[1:2],
                                recv_stats=call.recv_stats, timeout_ms=call.timeout_ms, name=NODE_NAMES[2])
    return [r1, r2, r3]


@dataclass
class LayerCache:
    """Per-buffer memo of built graphs and weight views: ``graphs`` by call key, ``weights`` by the identity of the
    :class:`GcMoeWeights` pair (the pair is kept so that its identity stays unique)."""

    graphs: dict[Hashable, GreenGraph] = field(default_factory=dict)
    weights: dict[tuple[int, int], tuple[GcMoeWeights, GcMoeWeights, role2_gemm.Role2Weights]] = field(
        default_factory=dict)

    def role2_weights(self, w1: GcMoeWeights, w2: GcMoeWeights) -> role2_gemm.Role2Weights:
        """The kernel view of ``(w1, w2)``, built on first use."""
        key = (id(w1), id(w2))
        if key not in self.weights:
            self.weights[key] = (w1, w2, role2_gemm.Role2Weights(w1, w2))
        return self.weights[key][2]


def call_key(buffer: GcMoeBuffer, y: torch.Tensor, w1: GcMoeWeights, w2: GcMoeWeights, call: LayerCall) -> Hashable:
    """What identifies a call's graph: output address and shape, weights, ring plan, variant, epilogue constants,
    statistics address, timeout, partition plan (the kernels' own hashes enter through :func:`get_graph`)."""
    stats = None if call.recv_stats is None else call.recv_stats.data_ptr()
    return (y.data_ptr(), tuple(y.shape), id(w1), id(w2), call.num_tokens, call.model, call.plan, call.variant,
            call.activation_clamp, call.activation_alpha, stats, call.timeout_ms, buffer.partition,
            buffer.dispatch_sms, buffer.compute_sms)


def run_layer(buffer: GcMoeBuffer, y: torch.Tensor, w1: GcMoeWeights, w2: GcMoeWeights, call: LayerCall,
              cache: LayerCache) -> bool:
    """Launches (or attaches, inside a capture) the call's graph on torch's current stream; returns whether it was
    captured (then no status can be read now: a later eager call's check reports an error left in the records)."""
    key = call_key(buffer, y, w1, w2, call)
    graph = cache.graphs.get(key)
    if graph is None:
        partition = get_partition(buffer.dispatch_sms) if buffer.partition == "on" else None
        graph = get_graph(layer_nodes(buffer, y, cache.role2_weights(w1, w2), call), partition)
        cache.graphs[key] = graph
    stream = as_stream(torch.cuda.current_stream().cuda_stream)
    captured = capture_graph(stream) is not None
    graph.launch(stream)
    return captured


def raise_for_layer_status(buffer: GcMoeBuffer, what: str) -> None:
    """Reads (and clears) role1's, role2's and role3's status records once the graph has finished; raises the first
    error in role order, naming the role and the site (the later roles' errors are usually its consequence)."""
    first: Exception | None = None
    for check in (role1_dispatch.raise_for_dispatch_status, role2_gemm.raise_for_role2_status,
                  role3_finalize.raise_for_finalize_status):
        try:
            check(buffer)
        except (TimeoutError, RuntimeError) as exc:
            first = first or exc
    if first is not None:
        raise type(first)(f"{what}: {first}") from first
