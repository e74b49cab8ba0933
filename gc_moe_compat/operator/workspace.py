"""Byte layout of the GC-MoE operator's symmetric workspace: every region, its dtype, shape, offset and writer.

One allocation per operator instance holds everything the roles exchange (paper §4.1, Figure 2). Every rank has
the same layout, so a kernel reaches rank ``r``'s copy of region ``n`` at ``peer.base + peer.offsets[r] +
offsets.n`` (:class:`gc_moe_compat.runtime.workspace.PeerTable` plus :class:`WorkspaceOffsets`, both by value).
Sizes derive from the :class:`~gc_moe_compat.config.MoEShape` (``Tmax = capacity``, ``P``, ``E``, ``e = E/P``,
``k``, ``S`` shared experts, ``H``, ``I``) and the ring capacity of :mod:`gc_moe_compat.operator.ring` (``rows`` ring
rows,
``blocks`` signal slots, ``pool`` = the largest pool over the ``BM`` candidates). Counters are stored as int64/int32
views; kernels treat them as unsigned. Regions are placed in table order, each aligned to 256 bytes.

======================  =========  ======================  =====================================================
region                  dtype      shape                   written by (read by)
======================  =========  ======================  =====================================================
``x``                   e4m3fn     ``[Tmax, H]``           caller staging (peers' role1 pull)
``x_sf``                float32    ``[Tmax, H/128]``       caller staging, FP32 1x128 scales (peers' role1)
``topk_idx``            int64|32   ``[Tmax, k]``           caller staging (own role1)
``topk_weights``        float32    ``[Tmax, k]``           caller staging (peers' role1)
``tag1_barrier``        int64      ``[1]``                 every rank's role1: +1 per replay, never reset; a
                                                           rank passes replay ``n`` (0-based) at ``>= P·(n+1)``
``replay_seq``          int64      ``[1]``                 own role3: replays completed (role1 reads ``n``)
``recv_parity``         int64      ``[1]``                 own role3: flips 0/1 after consuming ``recv_counts``
``send_counts``         int64      ``[E]``                 own role1: per global expert, atomic add of
                                                           ``(1 << 32) | tokens`` per dispatch CTA
``recv_counts``         int64      ``[2, P, e]``           peer ``src``'s role1 at ``[parity, src, le]``: the
                                                           packed send counter (high word = its dispatch CTAs,
                                                           arrival check: high words sum to ``dispatch_sms·P``)
``combine_ready``       int64      ``[P]``                 peer ``r``'s role3 at ``[r]``: ``replay_seq + 1``
                                                           with release (phase-encoded, never reset)
``finalize_arrive``     int64      ``[1]``                 own role3: +1 per finalize CTA once it has read
                                                           ``replay_seq``; the arrival completing the grid
                                                           advances ``replay_seq`` and stores 0 back
``src_index``           int32      ``[e, P, Tmax]``        peer ``src``'s role1: ``src_token·k + slot`` of its
                                                           rows for local expert ``le``, ascending
``pool_header``         int64      ``[1]``                 own role1: ``(1 << 32) | pool blocks``; role3 -> 0
``pool_table``          int32      ``[pool, 3]``           own role1: (local expert, valid rows, ring row
                                                           offset) per pool block (the GEMM's block table)
``role2_schedule``      int64      ``[2]``                 own role2: [0] the next task of the sequence a CTA
                                                           takes, [1] CTAs done; the last CTA stores 0 to both
``l1_acts``             e4m3fn     ``[rows, H]``           own role1: token ring payload (role2 W1 TMA)
``l1_acts_sf``          float32    ``[H/128, rows]``       own role1: scales, transposed (K128 step ``kb`` of a
                                                           block is ``BM`` contiguous floats)
``l1_routing_weights``  float32    ``[rows]``              own role1 (W1 epilogue multiplies by it)
``l1_source``           int32      ``[rows, 4]``           own role1: (src_rank, src_token, slot, pool block)
                                                           (W2 epilogue scatter target; generation check)
``l1_full_count``       int32      ``[blocks]``            role1 release / role2 acquire (``ring`` docstring)
``l1_empty_count``      int32      ``[blocks]``            role2 W1 release / role1 acquire
``l2_full_mask``        int64      ``[blocks]``            role2 W1 XOR-toggles one bit per N128 tile
``l2_empty_count``      int32      ``[blocks]``            role2 W2 release / role1 acquire
``l2_acts``             e4m3fn     ``[rows, I]``           role2 W1 epilogue (SwiGLU·weight, FP8 requant)
``l2_acts_sf``          float32    ``[I/128, rows]``       role2 W1 epilogue, transposed like ``l1_acts_sf``
``shared_l2_acts``      e4m3fn     ``[Tmax, I]``           role4 shared W1 (only with ``S = 1``)
``shared_l2_acts_sf``   float32    ``[I/128, Tmax]``       role4 shared W1 (only with ``S = 1``)
``combine``             bfloat16   ``[k+S, Tmax, H]``      W2 epilogues of every rank, slot-major at
                                                           ``(slot, src_token)`` on the source rank; slot ``k``
                                                           is the shared expert (own role3 sums in slot order)
``status``              uint8      ``[4, 32]``             role ``i+1``'s ``KernelStatus`` record
======================  =========  ======================  =====================================================

Role3 resets, for the next replay: ``send_counts``, ``recv_counts[parity]``, ``pool_header`` and the four ring
signals (to 0). ``tag1_barrier``, ``replay_seq``, ``combine_ready`` are phase-encoded and never reset.
``finalize_arrive`` exists because every finalize CTA reads ``replay_seq`` (its readiness wait target) while the
same kernel advances it: the advance must follow the last read, and the grid is not a cooperative launch.
"""

from __future__ import annotations

import ctypes
import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from gc_moe_compat.config import MoEShape
from gc_moe_compat.operator.heuristics import workspace_block_ms
from gc_moe_compat.operator.ring import DEFAULT_GEOMETRY, RingCapacity, RingModel, TaskGeometry
from gc_moe_compat.runtime.params import c_enum_declaration, c_identifier, c_struct_declaration
from gc_moe_compat.runtime.status import KernelStatus
from gc_moe_compat.runtime.workspace import DEFAULT_ALIGNMENT, LayoutPlanner, Region

__all__ = [
    "INPUT_VIEWS",
    "NO_REGION",
    "NUM_ROLES",
    "REGION_NAMES",
    "SHARED_REGIONS",
    "OperatorLayout",
    "RegionSpec",
    "StatusRecord",
    "WorkspaceOffsets",
]


class StatusRecord(enum.IntEnum):
    """Index of each role's :class:`~gc_moe_compat.runtime.status.KernelStatus` record in the ``status`` region:
    role1 (dispatch), role2 (grouped GEMM), role3 (finalize), role4 (fused shared expert). The kernels index with
    the generated ``gc_moe::StatusRecord`` (:meth:`c_declaration`, in kernels/common/workspace_offsets.cuh)."""

    ROLE1 = 0
    ROLE2 = 1
    ROLE3 = 2
    ROLE4 = 3

    @classmethod
    def c_declaration(cls) -> str:
        """The matching C enum (``kRole1Record`` ... ``kRole4Record``) for the kernel sources."""
        members = {c_identifier("k", f"{record.name}_RECORD"): int(record) for record in cls}
        return c_enum_declaration("StatusRecord", members, f"{cls.__module__}.{cls.__qualname__}")


NUM_ROLES = len(StatusRecord)
"""Status records in the ``status`` region (one per :class:`StatusRecord`)."""

INPUT_VIEWS = ("x", "x_sf", "topk_idx", "topk_weights")
"""The views the caller stages before each call (paper Listing 1)."""

SHARED_REGIONS = ("shared_l2_acts", "shared_l2_acts_sf")
"""Regions that exist only with a fused shared expert."""

REGION_NAMES = (
    *INPUT_VIEWS, "tag1_barrier", "replay_seq", "recv_parity", "send_counts", "recv_counts", "combine_ready",
    "finalize_arrive", "src_index", "pool_header", "pool_table", "role2_schedule", "l1_acts", "l1_acts_sf",
    "l1_routing_weights", "l1_source", "l1_full_count", "l1_empty_count", "l2_full_mask", "l2_empty_count",
    "l2_acts", "l2_acts_sf",
    *SHARED_REGIONS, "combine", "status",
)
"""Every region in placement order (the field order of :class:`WorkspaceOffsets`)."""

NO_REGION = (1 << 64) - 1
"""Offset :class:`WorkspaceOffsets` carries for a region the layout does not have (shared regions with ``S = 0``)."""

_FP8 = torch.float8_e4m3fn


class WorkspaceOffsets(ctypes.Structure):
    """By-value kernel argument: the byte offset of every region (``NO_REGION`` if absent) and the ring sizes.

    ``ring_rows`` is also the row stride of the transposed ``l1_acts_sf`` / ``l2_acts_sf``; ``ring_blocks`` the
    number of signal slots; ``pool_blocks`` the rows of ``pool_table``; ``capacity`` is ``Tmax``.
    """

    _fields_ = [(name, ctypes.c_uint64) for name in REGION_NAMES] + [
        ("capacity", ctypes.c_uint32),
        ("ring_rows", ctypes.c_uint32),
        ("ring_blocks", ctypes.c_uint32),
        ("pool_blocks", ctypes.c_uint32),
    ]

    @classmethod
    def c_declaration(cls) -> str:
        """The matching C++ struct (``gc_moe::WorkspaceOffsets``) with a size check, for the kernel sources."""
        return c_struct_declaration(cls, "WorkspaceOffsets", "gc_moe_compat/operator/workspace.py")


@dataclass(frozen=True)
class RegionSpec:
    """One region: name, element dtype and shape (row-major); ``nbytes`` follows."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class OperatorLayout:
    """The workspace layout of one operator instance: specs and placed regions of the module table.

    Build with :meth:`build`. ``ring`` is the allocated ring capacity (sized for ``compute_sms``); ``regions`` maps
    each present region to its :class:`~gc_moe_compat.runtime.workspace.Region`; ``total_bytes`` is the allocation.
    """

    shape: MoEShape
    compute_sms: int
    geometry: TaskGeometry
    ring: RingCapacity
    pool_blocks: int
    specs: Mapping[str, RegionSpec]
    regions: Mapping[str, Region]
    total_bytes: int

    @classmethod
    def build(cls, shape: MoEShape, compute_sms: int, *, geometry: TaskGeometry = DEFAULT_GEOMETRY,
              topk_idx_dtype: torch.dtype = torch.int64, whole_pool: bool = False,
              sequential_tokens: int = 0) -> OperatorLayout:
        """Plan every region for ``shape`` with a ring sized for a ``compute_sms``-SM compute partition, or, with
        ``whole_pool``, holding the whole pool (roles in sequence, ``GC_MOE_PARTITION=off``); ``sequential_tokens``:
        the ring also holds every block of a call of at most that many tokens (the calls ``GC_MOE_PARTITION=auto``
        runs in sequence)."""
        if not isinstance(shape, MoEShape):
            raise TypeError(f"shape: must be an MoEShape, got {type(shape).__name__}")
        if topk_idx_dtype not in (torch.int64, torch.int32):
            raise TypeError(f"topk_idx_dtype: must be torch.int64 or torch.int32 (expert ids), got {topk_idx_dtype}")
        if whole_pool:
            ring = RingCapacity.whole_pool(shape, geometry)
        else:
            ring = RingCapacity.for_partition(shape, compute_sms, geometry)
            if sequential_tokens:
                ring = ring.union(RingCapacity.for_sequential_calls(shape, sequential_tokens, geometry))
        pool = max(RingModel(shape, bm, compute_sms, geometry).pool_blocks for bm in workspace_block_ms())
        specs = {s.name: s for s in _specs(shape, ring, pool, topk_idx_dtype)}
        planner = _plan(specs.values())
        return cls(shape=shape, compute_sms=compute_sms, geometry=geometry, ring=ring, pool_blocks=pool,
                   specs=MappingProxyType(specs), regions=MappingProxyType(planner.regions), total_bytes=planner.size)

    def planner(self) -> LayoutPlanner:
        """A fresh :class:`LayoutPlanner` holding this layout (what :class:`SymmetricWorkspace` allocates from)."""
        return _plan(self.specs.values())

    def view(self, storage: torch.Tensor, name: str) -> torch.Tensor:
        """Region ``name`` of ``storage`` (this layout's byte allocation) as a tensor of its dtype and shape."""
        if name not in self.specs:
            raise KeyError(f"name: no workspace region {name!r}; this layout has {sorted(self.specs)}")
        if storage.dim() != 1 or storage.element_size() != 1 or storage.numel() < self.total_bytes:
            raise ValueError(f"storage: must be a 1-D byte tensor of >= {self.total_bytes} bytes, got "
                             f"{storage.dtype} {tuple(storage.shape)}")
        spec, region = self.specs[name], self.regions[name]
        raw = storage.view(torch.uint8)[region.offset:region.offset + region.nbytes]
        return raw.view(spec.dtype).view(spec.shape)

    def offsets(self) -> WorkspaceOffsets:
        """The kernels' by-value :class:`WorkspaceOffsets` for this layout."""
        out = WorkspaceOffsets()
        for name in REGION_NAMES:
            setattr(out, name, self.regions[name].offset if name in self.regions else NO_REGION)
        out.capacity = self.shape.capacity
        out.ring_rows = self.ring.rows
        out.ring_blocks = self.ring.blocks
        out.pool_blocks = self.pool_blocks
        return out


def _specs(shape: MoEShape, ring: RingCapacity, pool: int, topk_idx_dtype: torch.dtype) -> list[RegionSpec]:
    """The regions of the module table, in placement order."""
    t, h, i, k = shape.capacity, shape.hidden, shape.intermediate, shape.topk
    p, e, rows, blocks = shape.num_ranks, shape.num_local_experts, ring.rows, ring.blocks
    specs = [
        RegionSpec("x", _FP8, (t, h)),
        RegionSpec("x_sf", torch.float32, (t, h // 128)),
        RegionSpec("topk_idx", topk_idx_dtype, (t, k)),
        RegionSpec("topk_weights", torch.float32, (t, k)),
        RegionSpec("tag1_barrier", torch.int64, (1,)),
        RegionSpec("replay_seq", torch.int64, (1,)),
        RegionSpec("recv_parity", torch.int64, (1,)),
        RegionSpec("send_counts", torch.int64, (shape.num_experts,)),
        RegionSpec("recv_counts", torch.int64, (2, p, e)),
        RegionSpec("combine_ready", torch.int64, (p,)),
        RegionSpec("finalize_arrive", torch.int64, (1,)),
        RegionSpec("src_index", torch.int32, (e, p, t)),
        RegionSpec("pool_header", torch.int64, (1,)),
        RegionSpec("pool_table", torch.int32, (pool, 3)),
        RegionSpec("role2_schedule", torch.int64, (2,)),
        RegionSpec("l1_acts", _FP8, (rows, h)),
        RegionSpec("l1_acts_sf", torch.float32, (h // 128, rows)),
        RegionSpec("l1_routing_weights", torch.float32, (rows,)),
        RegionSpec("l1_source", torch.int32, (rows, 4)),
        RegionSpec("l1_full_count", torch.int32, (blocks,)),
        RegionSpec("l1_empty_count", torch.int32, (blocks,)),
        RegionSpec("l2_full_mask", torch.int64, (blocks,)),
        RegionSpec("l2_empty_count", torch.int32, (blocks,)),
        RegionSpec("l2_acts", _FP8, (rows, i)),
        RegionSpec("l2_acts_sf", torch.float32, (i // 128, rows)),
    ]
    if shape.num_shared_experts:
        specs += [RegionSpec("shared_l2_acts", _FP8, (t, i)), RegionSpec("shared_l2_acts_sf", torch.float32,
                                                                            (i // 128, t))]
    specs += [
        RegionSpec("combine", torch.bfloat16, (shape.num_combine_slots, t, h)),
        RegionSpec("status", torch.uint8, (NUM_ROLES, ctypes.sizeof(KernelStatus))),
    ]
    return specs


def _plan(specs: Iterable[RegionSpec]) -> LayoutPlanner:
    planner = LayoutPlanner()
    for spec in specs:
        planner.add(spec.name, spec.nbytes, DEFAULT_ALIGNMENT)
    return planner
