"""``get_symm_buffer_for_gc_moe``: the operator's symmetric buffer (paper Listing 1), its partition mode and guard.

The buffer is one allocation laid out by :class:`gc_moe_compat.operator.workspace.OperatorLayout`: torch symmetric
memory rendezvoused across the group on CUDA (:class:`gc_moe_compat.runtime.workspace.SymmetricWorkspace`), a
plain zeroed host tensor for a single rank on a host without CUDA (so layouts can be inspected and tested
anywhere; running the operator needs the GPU). Every region is an attribute (``buffer.x``, ``buffer.l1_acts``,
``buffer.recv_counts``, ...); the caller stages ``x``, ``x_sf``, ``topk_idx``, ``topk_weights`` before each call.

Partition mode (:func:`gc_moe_compat.runtime.split.partition_mode`). ``GC_MOE_PARTITION=on`` runs role1 on the
communication green context and role2/role3 on the compute one; ``off`` runs the same kernels in sequence on the
whole device (the partition ablation; where the rank has the GPU alone role2 follows role1 through a programmatic
edge and may start beside it: :mod:`gc_moe_compat.operator.sm90.layer`); ``auto`` (default) is ``on`` except for
the calls the operator's rule runs with the partition off
(:func:`gc_moe_compat.operator.heuristics.sequential_max_tokens`, one rank only; such a call runs on
:meth:`GcMoeBuffer.for_call`'s alias). The ``partition`` argument wins over the environment. The ring is sized
from the compute SMs the roles will have (:func:`gc_moe_compat.runtime.green.plan_partition`, the buffer's one
:class:`~gc_moe_compat.runtime.split.PartitionPlan`, which every launch reads): the green partition's
compute side (``on``; its dispatch request comes from ``dispatch_sms`` > ``GC_MOE_DISPATCH_SMS`` >
``GC_MOE_SM90_DISPATCH_SMS`` > 4, see :func:`gc_moe_compat.runtime.split.dispatch_request`) or every SM (``off``).
With ``off`` role2 cannot be counted on to run before role1 ends (none of its CTAs may be resident yet), so role1
must never wait for role2 to free a ring block: the ring then holds
the whole pool (:meth:`gc_moe_compat.operator.ring.RingCapacity.whole_pool`), and with ``auto`` every block of the
calls it runs in sequence (:meth:`~gc_moe_compat.operator.ring.RingCapacity.for_sequential_calls`). A workspace is
single-instance: :func:`exclusive` rejects overlapping calls.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import threading
import weakref
from collections.abc import Iterator, Mapping
from types import MappingProxyType

import torch
import torch.distributed as dist

from gc_moe_compat import config
from gc_moe_compat.config import MAX_SMS, integer
from gc_moe_compat.operator.heuristics import sequential_max_tokens
from gc_moe_compat.operator.workspace import OperatorLayout, WorkspaceOffsets
from gc_moe_compat.runtime import colocation
from gc_moe_compat.runtime.colocation import Placement, placement
from gc_moe_compat.runtime.dropped import dropped_record
from gc_moe_compat.runtime.green import plan_partition
from gc_moe_compat.runtime.split import DISPATCH_ENV, MIN_DISPATCH_SMS, PartitionPlan, dispatch_request, partition_mode
from gc_moe_compat.runtime.workspace import PeerTable, SymmetricWorkspace, WorkspaceBusyError, make_peer_table

__all__ = ["GcMoeBuffer", "exclusive", "get_symm_buffer_for_gc_moe"]

log = logging.getLogger(__name__)


def _dispatch_request(dispatch_sms: object) -> int:
    """The dispatch SM request (argument > environment > default), checked for type and ``[2, MAX_SMS]``."""
    fn = "get_symm_buffer_for_gc_moe"
    if dispatch_sms is not None:
        integer(fn, "dispatch_sms", dispatch_sms, MIN_DISPATCH_SMS, MAX_SMS)
    request = dispatch_request(dispatch_sms)
    if not MIN_DISPATCH_SMS <= request <= MAX_SMS:  # from the environment: name the variable, not the argument
        name = next(n for n in DISPATCH_ENV if os.environ.get(n, "").strip())
        raise ValueError(f"{fn}: {name} (the dispatch SM request, dispatch_sms=None) must be in "
                         f"[{MIN_DISPATCH_SMS}, {MAX_SMS}] (role1 needs a grid of >= 2 CTAs; no GPU has more SMs), "
                         f"got {request}")
    return request


def _allocate(layout: OperatorLayout, group: dist.ProcessGroup,
              where: Placement | None) -> tuple[torch.Tensor, PeerTable, SymmetricWorkspace | None]:
    """Zeroed storage for ``layout``, its peer table and workspace (symmetric memory on CUDA, host memory for one
    rank without a workspace)."""
    if torch.cuda.is_available():
        ws = SymmetricWorkspace(layout.planner(), group, where=where)
        return ws.buffer, ws.peer_table, ws
    if group.size() != 1:
        raise RuntimeError(f"group: a group of {group.size()} ranks needs CUDA symmetric memory; no CUDA device "
                           "is visible")
    storage = torch.zeros(layout.total_bytes, dtype=torch.uint8, device="cpu")
    return storage, make_peer_table([storage.data_ptr()], 0), None


class GcMoeBuffer:
    """The operator's symmetric buffer: shape, partition plan, layout, storage, peer table and region views.

    Attributes: ``shape`` (:class:`~gc_moe_compat.config.MoEShape`), ``group``, ``plan`` (the
    :class:`~gc_moe_compat.runtime.split.PartitionPlan` every launch reads; ``partition``, ``dispatch_sms``,
    ``partition_reason`` and ``ranks_on_device`` are its fields), ``compute_sms`` (what the ring was sized for: the
    plan's, or the ``compute_sms`` the caller asked for), ``placement`` (where the group's ranks run; None without
    CUDA), ``layout``, ``storage`` (uint8), ``peer_table``, ``offsets``
    (:class:`~gc_moe_compat.operator.workspace.WorkspaceOffsets`), ``views`` (name -> tensor) and one attribute per
    region.
    """

    def __init__(self, group: dist.ProcessGroup, shape: config.MoEShape, layout: OperatorLayout, plan: PartitionPlan,
                 compute_sms: int, where: Placement | None = None) -> None:
        self.group: dist.ProcessGroup | None = group
        self.shape = shape
        self.layout = layout
        self.plan = plan
        self.compute_sms = compute_sms
        self.placement = where
        self.storage: torch.Tensor | None
        self.storage, self.peer_table, self._workspace = _allocate(layout, group, where)
        dropped_record(self.storage.device)  # allocated now, eagerly: role1 reports dropped ids there, also captured
        self.offsets: WorkspaceOffsets = layout.offsets()
        self.views: Mapping[str, torch.Tensor] = MappingProxyType(
            {name: layout.view(self.storage, name) for name in layout.specs})
        for name, view in self.views.items():
            setattr(self, name, view)
        self.alias_of: GcMoeBuffer | None = None
        self._aliases: dict[tuple[str, str], GcMoeBuffer] = {}

    def retyped(self, mma_type: str) -> GcMoeBuffer:
        """This workspace as a buffer of the other compute path ``mma_type`` (no new allocation).

        Why: DeepGEMM's callers create one symmetric buffer and may run either layer call on it (SGLang's Hopper
        path creates it with ``mma_type='fp8xfp4'`` and calls ``fp8_mega_moe``, FP8xFP8). The workspace layout does
        not depend on ``mma_type`` (checked here by rebuilding it), so the alias shares storage, peer table, views
        and the single-instance guard (:func:`exclusive` locks the primary); it is cached, so the graphs built for
        it are reused. Raises ``ValueError`` for an unknown ``mma_type`` and ``NotImplementedError`` if the layouts
        ever differ.
        """
        self._require_live()
        if mma_type not in config.MMA_TYPES:
            raise ValueError(f"mma_type: must be one of {config.MMA_TYPES}, got {mma_type!r}")
        return self._alias(mma_type, self.plan)

    def for_call(self, num_tokens: int) -> GcMoeBuffer:
        """The buffer a call of ``num_tokens`` tokens runs on: this one, or, where the plan sends calls that small
        to the partition off (``GC_MOE_PARTITION=auto``: ``plan.sequential_max_tokens``), this workspace with the
        roles in sequence on the whole device (an alias like :meth:`retyped`'s; the ring was sized for such calls
        when the buffer was made)."""
        self._require_live()
        if num_tokens > self.plan.sequential_max_tokens or not self.plan.sequential_max_tokens:
            return self
        cached = (self.alias_of or self)._aliases.get((self.shape.mma_type, "off"))
        if cached is not None:
            return cached
        if torch.cuda.is_available() and self.storage.is_cuda:
            off = plan_partition("off", self.plan.request, self.plan.ranks_on_device,
                                 device_index=self.storage.device.index)
        else:
            off = PartitionPlan("off", self.plan.request, self.plan.request, self.plan.compute_sms)
        return self._alias(self.shape.mma_type, off)

    def _alias(self, mma_type: str, plan: PartitionPlan) -> GcMoeBuffer:
        """The primary workspace as a buffer of ``mma_type`` launched by ``plan`` (cached per compute path and
        partition mode: a buffer has one plan per mode; the primary itself for its own pair)."""
        primary = self.alias_of or self
        if mma_type == primary.shape.mma_type and plan == primary.plan:
            return primary
        key = (mma_type, plan.mode)
        alias = primary._aliases.get(key)
        if alias is None:
            shape, layout = primary.shape, primary.layout
            if mma_type != shape.mma_type:
                shape = dataclasses.replace(shape, mma_type=mma_type)
                layout = OperatorLayout.build(shape, layout.compute_sms, geometry=layout.geometry,
                                              topk_idx_dtype=layout.specs["topk_idx"].dtype,
                                              whole_pool=primary.partition == "off",
                                              sequential_tokens=primary.plan.sequential_max_tokens)
                if layout.regions != primary.layout.regions or layout.ring != primary.layout.ring:
                    raise NotImplementedError(f"mma_type={mma_type!r}: its workspace layout differs from this "
                                              f"buffer's ({primary.shape.mma_type!r}); create a buffer for it")
            alias = copy.copy(primary)
            alias.shape, alias.layout, alias.plan, alias.alias_of, alias._aliases = shape, layout, plan, primary, {}
            primary._aliases[key] = alias
        return alias

    def view(self, name: str) -> torch.Tensor:
        """Region ``name`` (``KeyError`` naming the regions if there is none)."""
        self._require_live()
        if name not in self.views:
            raise KeyError(f"name: no workspace region {name!r}; this buffer has {sorted(self.views)}")
        return self.views[name]

    def current_compute_sms(self) -> int:
        """The compute SMs a launch gets: the plan's for a CUDA buffer, else the ring's value.

        Kept apart from ``compute_sms`` (what the ring was sized for) because a caller may size the ring for fewer
        SMs than the launch gets (``compute_sms=``): the ring check must use what the launch really gets.
        """
        self._require_live()
        return self.plan.compute_sms if self.storage.is_cuda else self.compute_sms

    @property
    def partition(self) -> str:
        """``"on"`` or ``"off"``: the plan's mode."""
        return self.plan.mode

    @property
    def dispatch_sms(self) -> int:
        """Role1's grid: the plan's communication SMs (the driver's aligned split when the partition is on)."""
        return self.plan.dispatch_sms

    @property
    def partition_reason(self) -> str | None:
        """Why the partition is off when it was forced (ranks sharing a GPU), else None."""
        return self.plan.reason

    @property
    def ranks_on_device(self) -> int:
        """Ranks of the group on this rank's GPU (1 without CUDA)."""
        return self.plan.ranks_on_device

    def __repr__(self) -> str:
        """The shape and where it runs: partition, how peers are mapped and how many ranks share this GPU."""
        if self.storage is None:
            return "GcMoeBuffer(destroyed)"
        s = self.shape
        where = "" if self.placement is None else (f", rendezvous={self.placement.rendezvous!r}, "
                                                   f"ranks_on_device={self.placement.ranks_on_device}")
        return (f"GcMoeBuffer(ranks={s.num_ranks}, experts={s.num_experts}, hidden={s.hidden}, "
                f"intermediate={s.intermediate}, topk={s.topk}, mma_type={s.mma_type!r}, partition={self.partition!r}"
                f"{where}, dispatch_sms={self.dispatch_sms}, compute_sms={self.compute_sms})")

    def describe(self) -> dict[str, object]:
        """The plan recorded in benchmark metadata: partition, SM counts, ring capacity, total bytes."""
        where = {} if self.placement is None else colocation.describe(self.placement, self.storage.device.index)
        return {**self.plan.describe(), **where, "ring_compute_sms": self.compute_sms,
                "ring_rows": self.layout.ring.rows, "ring_blocks": self.layout.ring.blocks,
                "pool_blocks": self.layout.pool_blocks, "total_bytes": self.layout.total_bytes}

    def _require_live(self) -> None:
        if self.storage is None:
            raise ValueError("buffer: was destroyed")

    def destroy(self) -> None:
        """Drop the allocation and every view; the buffer is unusable afterwards."""
        for name in self.views:
            setattr(self, name, None)
        self.views = MappingProxyType({})
        self.storage = None
        self._workspace = None
        self.group = None
        for alias in self._aliases.values():
            alias.destroy()
        self._aliases = {}


_locks: weakref.WeakKeyDictionary[object, threading.Lock] = weakref.WeakKeyDictionary()
_locks_guard = threading.Lock()


@contextlib.contextmanager
def exclusive(buffer: object) -> Iterator[None]:
    """Hold ``buffer``'s workspace for one call; an overlapping holder gets ``WorkspaceBusyError``.

    The workspace (ring, counters, parity, barrier phase) is single-instance (paper, Limitations): two calls on one
    buffer at once would corrupt each other's protocol state, so they must serialize.
    """
    buffer = getattr(buffer, "alias_of", None) or buffer  # an alias shares its primary's workspace and guard
    with _locks_guard:
        lock = _locks.setdefault(buffer, threading.Lock())
    if not lock.acquire(blocking=False):
        raise WorkspaceBusyError("buffer: is in use by another call; calls sharing a workspace must serialize")
    try:
        yield
    finally:
        lock.release()


def get_symm_buffer_for_gc_moe(group: dist.ProcessGroup, num_experts: int, capacity: int, topk: int, hidden: int,
                               intermediate: int, mma_type: str = "fp8xfp4", num_shared_experts: int = 0,
                               dispatch_sms: int | None = None, partition: str | bool | None = None, *,
                               compute_sms: int | None = None,
                               topk_idx_dtype: torch.dtype = torch.int64) -> GcMoeBuffer:
    """Allocate and rendezvous the operator's buffer for ``group`` (collective: every rank calls it).

    ``capacity`` is ``Tmax``, the most tokens one rank passes per call. ``dispatch_sms`` / ``partition``: see the
    module docstring. ``compute_sms`` sizes the ring for that many compute SMs instead of the device's (required
    on a host without CUDA). ``topk_idx_dtype``: int64 (DeepGEMM's) or int32 expert ids. Raises ``TypeError`` /
    ``ValueError`` naming the argument before allocating anything.
    """
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group: must be a torch.distributed ProcessGroup, got {type(group).__name__}")
    shape = config.MoEShape(num_experts=num_experts, num_ranks=group.size(), hidden=hidden,
                            intermediate=intermediate, topk=topk, num_shared_experts=num_shared_experts,
                            capacity=capacity, mma_type=mma_type)
    config.validate(shape)
    mode = partition_mode(partition)
    request = _dispatch_request(dispatch_sms)
    if compute_sms is not None:
        integer("get_symm_buffer_for_gc_moe", "compute_sms", compute_sms, 2, MAX_SMS)
        if compute_sms % 2:
            raise ValueError(f"get_symm_buffer_for_gc_moe: compute_sms must be even (the compute partition is "
                             f"allocated in SM pairs), got {compute_sms}")
    where, reason = None, None
    if torch.cuda.is_available():
        where = placement(group, torch.cuda.current_device())
        if where.shares_device and mode != "off":
            mode, reason = "off", (f"{where.ranks_on_device} ranks share this GPU: green contexts do not confine "
                                   "under CUDA MPS, so the roles run in sequence on this rank's share of the SMs")
            log.warning("get_symm_buffer_for_gc_moe: partition off: %s", reason)
        plan = plan_partition("on" if mode == "auto" else mode, request, where.ranks_on_device, reason)
    elif compute_sms is None:
        raise ValueError("compute_sms: required on a host without CUDA (the ring is sized from the compute "
                         "partition's SM count), got None")
    else:
        plan = PartitionPlan("on" if mode == "auto" else mode, request, request, compute_sms)
    if mode == "auto":
        plan = dataclasses.replace(plan, sequential_max_tokens=sequential_max_tokens(
            shape.num_ranks, shape.topk, shape.num_experts, shape.capacity))
    planned = plan.compute_sms if compute_sms is None else compute_sms
    layout = OperatorLayout.build(shape, planned, topk_idx_dtype=topk_idx_dtype, whole_pool=mode == "off",
                                  sequential_tokens=plan.sequential_max_tokens)
    return GcMoeBuffer(group, shape, layout, plan, planned, where)
