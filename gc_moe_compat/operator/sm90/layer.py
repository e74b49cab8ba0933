"""The operator assembly on SM90: role1, role2, role3 (and role4) of one call as one CUDA child graph (paper §4.1,
§4.6).

Partitioned (``GC_MOE_PARTITION=on``): role1 (:mod:`.role1_dispatch`) on the communication green context and role2
(:mod:`.role2_gemm`) on the compute one are concurrent roots with no edge between them (they handshake through the
ring signals); role3 (:mod:`.role3_finalize`) on the compute context depends on both. With a fused shared expert,
role4 (:mod:`.role4_shared`, two nodes: W1 then W2 into combine slot ``k``) is a compute-context root too, placed
by :func:`~.role4_shared.reserve_sms` (its module docstring gives the measurement): up to one role4 token block
(T <= 64) *beside* role2, role4's grid on a reserve of the compute SMs and role2's on the rest, no edge between them,
role3 after both; above it *before* role2 ("role2 optionally waits on role4"), on every compute SM while role1
dispatches. Unpartitioned (``off``): the same kernels on the whole device in
sequence, role1 -> (role4 -> role4_w2 ->) role2 -> role3 (the buffer's ring then holds the whole pool, so role1 never
waits for a refill that only role2 could grant). Where the rank has the GPU alone, role2's edge from role1 and
role3's from role2 are programmatic (:mod:`gc_moe_compat.runtime.graph`): role1 and role2 let their dependents launch
at their start, so role2 starts beside role1 and waits on the ring signals as it does when partitioned (with role4
before it, its edge stays a full one), and role3's launch overlaps role2's end (role3 waits in
``griddepcontrol.wait`` before reading anything; its other edges are full ones in both modes). Ranks sharing a GPU
keep full edges: their no-starvation rule (:func:`gc_moe_compat.runtime.split.shared_device_sms`) needs one kernel
of a rank resident at a time, and role2's CTAs spinning beside role1's could hold the SMs a peer's role1 needs.

Graphs come from :func:`gc_moe_compat.runtime.graph.get_graph` (cached by kernels, launch shapes, by-value
parameters and partition; every kernel is warmed up in its context before the graph is built) and are also kept
per call configuration in :class:`LayerCache`, so a replay does no JIT lookup or tensor-map encoding. A launch runs
on the caller's torch stream, or attaches as a child node when that stream is capturing (``torch.cuda.graph``).
:func:`raise_for_layer_status` reads the three roles' status records after the graph (role1 first: its failure
makes the others give up; role4's next) and raises :class:`~gc_moe_compat.runtime.status.DeviceTimeoutError` /
``DeviceCheckError`` naming the role and the site.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from gc_moe_compat.operator.buffer import GcMoeBuffer
from gc_moe_compat.operator.ring import RingModel, RingPlan
from gc_moe_compat.operator.sm90 import role1_dispatch, role2_gemm, role3_finalize, role4_shared
from gc_moe_compat.operator.weights import GcMoeWeights
from gc_moe_compat.runtime.cuda import as_stream
from gc_moe_compat.runtime.graph import GreenGraph, KernelNode, capture_graph, get_graph
from gc_moe_compat.runtime.green import launch_partition

__all__ = ["NODE_NAMES", "LayerCache", "LayerCall", "layer_nodes", "raise_for_layer_status", "run_layer"]

NODE_NAMES = ("role1", "role2", "role3")
"""The three roles' nodes; a fused shared expert adds :data:`role4_shared.NODE_NAMES`."""

_Pair = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class LayerCall:
    """Everything one call's graph depends on besides the buffer: tokens, ring model and plan, role2 variant,
    epilogue constants, the optional statistics tensor and the spin timeout (``fast_math`` is the variant's)."""

    num_tokens: int
    model: RingModel
    plan: RingPlan
    variant: role2_gemm.Role2Variant
    activation_clamp: float | None
    activation_alpha: float
    recv_stats: torch.Tensor | None = None
    timeout_ms: float | None = None


def layer_nodes(buffer: GcMoeBuffer, y: torch.Tensor, weights: role2_gemm.Role2Weights, call: LayerCall,
                shared: tuple[role4_shared.Role4Weights, role4_shared.Role4Tables] | None = None) -> list[KernelNode]:
    """The kernel nodes of one call, in graph order, with the dependencies of the buffer's partition mode: role1,
    (role4's two nodes when ``shared`` holds the shared expert's weights and the buffer's tables,) role2, role3."""
    partitioned = buffer.partition == "on"
    r1 = role1_dispatch.dispatch_node(buffer, call.plan, call.num_tokens, timeout_ms=call.timeout_ms,
                                      name=NODE_NAMES[0])
    r4: list[KernelNode] = []
    reserve = 0  # compute SMs of a role4 beside role2 (0: role4, if any, before role2)
    if shared is not None:
        if partitioned:
            reserve = role4_shared.reserve_sms(buffer.shape, call.num_tokens, call.model.compute_sms)
        r4 = role4_shared.role4_nodes(buffer, *shared, call.num_tokens, deps=() if partitioned else (NODE_NAMES[0],),
                                      activation_clamp=call.activation_clamp, activation_alpha=call.activation_alpha,
                                      fast_math=call.variant.fast_math, timeout_ms=call.timeout_ms,
                                      max_grid=reserve or None)
    # role1 first on the whole device, through a programmatic edge where this rank has the GPU alone: role2 launches
    # as role1 starts and waits on the ring signals (as when partitioned), so its launch and prologue overlap role1
    alone = buffer.ranks_on_device == 1
    r2_deps = (NODE_NAMES[0],) if not partitioned else ()
    r2_early = r2_deps if alone else ()
    # role2's edge programmatic (alone): role3's launch overlaps role2's end. Role3's full edge from role1 must stay:
    # role3's griddepcontrol.wait covers role2 only, and role2 can end (done, or given up) while role1 still runs
    r3_deps = NODE_NAMES[:2]
    if r4:  # role3 waits for role4's partials (combine slot k) by a full edge, beside role2 or before it
        r3_deps = (*r3_deps, r4[-1].name)
    if r4 and not reserve:  # before role2
        r2_deps, r2_early = (r4[-1].name,), ()
    r2 = role2_gemm.role2_node(buffer, weights, call.model, call.plan, call.variant, name=NODE_NAMES[1],
                          deps=r2_deps, programmatic=r2_early, activation_clamp=call.activation_clamp,
                          activation_alpha=call.activation_alpha, timeout_ms=call.timeout_ms,
                          grid=call.model.compute_sms - reserve)
    r3 = role3_finalize.finalize_node(buffer, y, deps=r3_deps, programmatic=NODE_NAMES[1:2] if alone else (),
                                      recv_stats=call.recv_stats, timeout_ms=call.timeout_ms, name=NODE_NAMES[2])
    return [r1, *r4, r2, r3]


def _shared_key(shared_l1: _Pair, shared_l2: _Pair) -> tuple:
    """Identity and version counter of every tensor of the shared weight pairs (an in-place update moves the counter,
    so the converted copy is rebuilt); an inference tensor has no counter, so its copy could go stale unseen and
    it is refused (``ValueError`` naming it and the fix)."""
    key = []
    for arg, pair in (("shared_l1_weights", shared_l1), ("shared_l2_weights", shared_l2)):
        for i, t in enumerate(pair):
            if t.is_inference():
                raise ValueError(f"{arg}[{i}]: is an inference tensor (made under torch.inference_mode()), which has "
                                 "no version counter, so an in-place update of it could not be seen and role4's "
                                 "converted copy (gate/up interleave) would silently go stale; make the weights "
                                 "outside inference mode, or clone them there once")
            key.append((id(t), t.data_ptr(), tuple(t.shape), t.dtype, t._version))
    return tuple(key)


@dataclass
class LayerCache:
    """Per-buffer memo of built graphs and weight views: ``graphs`` by call key, ``weights`` by the identity of the
    :class:`GcMoeWeights` pair (the pair is kept so that its identity stays unique), ``shared`` the shared expert's
    converted weights by :func:`_shared_key` (sources kept alive likewise), ``tables`` role4's token-block tables."""

    graphs: dict[Hashable, GreenGraph] = field(default_factory=dict)
    weights: dict[tuple[int, int], tuple[GcMoeWeights, GcMoeWeights, role2_gemm.Role2Weights]] = field(
        default_factory=dict)
    shared: dict[tuple, tuple[tuple[_Pair, _Pair], role4_shared.Role4Weights]] = field(default_factory=dict)
    tables: role4_shared.Role4Tables | None = None

    def role2_weights(self, w1: GcMoeWeights, w2: GcMoeWeights) -> role2_gemm.Role2Weights:
        """The kernel view of ``(w1, w2)``, built on first use."""
        key = (id(w1), id(w2))
        if key not in self.weights:
            self.weights[key] = (w1, w2, role2_gemm.Role2Weights(w1, w2))
        return self.weights[key][2]

    def role4(self, buffer: GcMoeBuffer, shared_l1: _Pair, shared_l2: _Pair
              ) -> tuple[tuple, tuple[role4_shared.Role4Weights, role4_shared.Role4Tables]]:
        """The shared pairs' cache key and role4's inputs (converted weights, the buffer's tables), built on first
        use (outside capture: both need device work)."""
        key = _shared_key(shared_l1, shared_l2)
        if key not in self.shared:
            # drop conversions of the same tensors at older versions (their copies are stale)
            ids = tuple(k[:2] for k in key)
            for old in [k for k in self.shared if tuple(e[:2] for e in k) == ids]:
                del self.shared[old]
            self.shared[key] = ((shared_l1, shared_l2), role4_shared.Role4Weights(shared_l1, shared_l2))
        if self.tables is None:
            self.tables = role4_shared.Role4Tables(buffer)
        return key, (self.shared[key][1], self.tables)


def call_key(buffer: GcMoeBuffer, y: torch.Tensor, w1: GcMoeWeights, w2: GcMoeWeights, call: LayerCall,
             shared_key: tuple | None = None) -> Hashable:
    """What identifies a call's graph: output address and shape, weights (the shared expert's by ``shared_key``),
    ring plan, variant, epilogue constants, statistics address, timeout, partition plan (the kernels' own hashes
    enter through :func:`get_graph`)."""
    stats = None if call.recv_stats is None else call.recv_stats.data_ptr()
    return (y.data_ptr(), tuple(y.shape), id(w1), id(w2), call.num_tokens, call.model, call.plan, call.variant,
            call.activation_clamp, call.activation_alpha, stats, call.timeout_ms, buffer.partition,
            buffer.dispatch_sms, buffer.compute_sms, shared_key)


def run_layer(buffer: GcMoeBuffer, y: torch.Tensor, w1: GcMoeWeights, w2: GcMoeWeights, call: LayerCall,
              cache: LayerCache, shared: tuple[_Pair, _Pair] | None = None) -> bool:
    """Launches (or attaches, inside a capture) the call's graph on torch's current stream; returns whether it was
    captured (then no status can be read now: a later eager call's check reports an error left in the records).
    ``shared``: the shared expert's ``(shared_l1_weights, shared_l2_weights)`` pairs (role4), or None."""
    shared_key, role4_inputs = cache.role4(buffer, *shared) if shared is not None else (None, None)
    key = call_key(buffer, y, w1, w2, call, shared_key)
    graph = cache.graphs.get(key)
    if graph is None:
        partition = launch_partition(buffer.plan, buffer.storage.device.index)
        graph = get_graph(layer_nodes(buffer, y, cache.role2_weights(w1, w2), call, role4_inputs), partition)
        cache.graphs[key] = graph
    stream = as_stream(torch.cuda.current_stream().cuda_stream)
    captured = capture_graph(stream) is not None
    graph.launch(stream)
    return captured


def raise_for_layer_status(buffer: GcMoeBuffer, what: str) -> None:
    """Reads (and clears) role1's, role4's, role2's and role3's status records once the graph has finished; raises
    the first error in that order, naming the role and the site (the later roles' errors are usually its
    consequence; role4's record stays empty without a shared expert)."""
    first: Exception | None = None
    for check in (role1_dispatch.raise_for_dispatch_status, role4_shared.raise_for_role4_status,
                  role2_gemm.raise_for_role2_status, role3_finalize.raise_for_finalize_status):
        try:
            check(buffer)
        except (TimeoutError, RuntimeError) as exc:
            first = first or exc
    if first is not None:
        raise type(first)(f"{what}: {first}") from first
