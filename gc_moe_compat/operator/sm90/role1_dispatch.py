"""Host side of role1, the SM90 dispatch kernel (kernels/sm90/role1_dispatch.cu): parameters, launch, graph node,
status.

Role1 runs on the communication partition. Per replay it counts this rank's (token, slot) entries per global
expert, writes each entry ``src_token·k + slot`` into the target rank's ``src_index`` (ascending), adds the packed
``(1 << 32) | count`` of every dispatch CTA into ``send_counts``, publishes the counts to every peer's
``recv_counts[parity]``, passes the persistent tag-1 barrier, publishes the block table (``pool_table``,
``pool_header``) and pulls every received row into the token ring, releasing ``l1_full_count`` per row
(:mod:`gc_moe_compat.operator.ring`). At one rank with at most one routing entry per thread (T·k <= 512) every CTA
ranks all entries itself and no CTA waits on another (no arrival wait, no tag-1 wait): the same stores, ring rows and
counters, a few microseconds less of the serial dispatch at small T. The kernel gets three by-value arguments: the
workspace :class:`~gc_moe_compat.runtime.workspace.PeerTable`, the
:class:`~gc_moe_compat.operator.workspace.WorkspaceOffsets` and :class:`DispatchParams`; its C declarations live in
kernels/common/workspace_offsets.cuh and kernels/sm90/role1_dispatch_params.cuh, generated from the ctypes classes
(:func:`params_header`; the tests check both), like the status sites (:class:`DispatchSite`) and record index
(:class:`~gc_moe_compat.operator.workspace.StatusRecord`).

:func:`assign_rows` is the kernel's row and block arithmetic written with torch: which pool block, ring row and
``l1_full_count`` increment each received row gets, from the ``[P, e]`` receive counts alone.
"""

from __future__ import annotations

import ctypes

import torch

from gc_moe_compat.config import MAX_EXPERTS
from gc_moe_compat.operator.buffer import GcMoeBuffer
from gc_moe_compat.operator.ring import RingPlan
from gc_moe_compat.operator.workspace import StatusRecord, WorkspaceOffsets
from gc_moe_compat.runtime import jit
from gc_moe_compat.runtime.dropped import dropped_record
from gc_moe_compat.runtime.graph import KernelNode
from gc_moe_compat.runtime.green import Role
from gc_moe_compat.runtime.launch import launch
from gc_moe_compat.runtime.params import KernelArgs, c_struct_declaration
from gc_moe_compat.runtime.status import StatusSite, raise_for_status, spin_timeout_ns

__all__ = [
    "KERNEL",
    "MAX_EXPERTS",
    "MAX_LOCAL_EXPERTS",
    "SOURCE",
    "THREADS",
    "WARMUP",
    "DispatchParams",
    "DispatchSite",
    "assign_rows",
    "dispatch_args",
    "dispatch_node",
    "dispatch_params",
    "launch_dispatch",
    "params_header",
    "raise_for_dispatch_status",
]

SOURCE = "sm90/role1_dispatch.cu"
KERNEL = "gc_sm90_dispatch"
THREADS = 512
"""Threads per dispatch CTA (16 warps); the grid is one CTA per dispatch SM."""
MAX_LOCAL_EXPERTS = THREADS
"""The receive-count scan gives one thread per local expert (config: ``E/P <= 512``)."""
WARMUP = 1
"""``DispatchParams.flags`` bit: return at once (the one-time warm-up launch of a graph node)."""


class DispatchSite(StatusSite):
    """Status sites of role1 (``gc_moe::DispatchSite``, generated into kernels/sm90/role1_dispatch_params.cuh)."""

    GRID_ARRIVAL = 1, "role1 grid arrival (send_counts high words = dispatch CTAs)"
    TAG1 = 2, "role1 tag-1 barrier (a peer's role1 never arrived; one rank: the replay out of phase)"
    REFILL_L1 = 3, "role1 ring refill wait on l1_empty_count"
    REFILL_L2 = 4, "role1 ring refill wait on l2_empty_count"
    ARRIVAL_CHECK = 5, "role1 receive-count arrival check (high words must sum to dispatch_sms*P)"
    POOL_OVERFLOW = 6, "role1 pool overflow (more pool blocks than pool_table rows)"
    SRC_INDEX_OVERFLOW = 7, "role1 src_index overflow (more rows from one rank to one expert than the capacity)"


class DispatchParams(ctypes.Structure):
    """By-value kernel argument: the call's sizes, ring plan numbers, timeout and flags.

    ``num_tokens`` is this rank's ``T``; ``idx_bytes`` the width of ``topk_idx`` (8 or 4); ``ring_blocks`` ``R``
    and ``w1_tasks`` / ``w2_tasks`` (``t1``/``t2``) come from the call's :class:`~gc_moe_compat.operator.ring.RingPlan`.
    ``dropped`` / ``dropped_mirror``: the device's record of dropped inputs (:mod:`gc_moe_compat.runtime.dropped`),
    where an expert id outside ``[-1, E)`` or a non-finite routing weight staged in the buffer is reported; the slot
    is skipped (role3 sums no partial for it), the call goes on.
    """

    _fields_ = [
        ("timeout_ns", ctypes.c_uint64),
        ("dropped", ctypes.c_uint64),
        ("dropped_mirror", ctypes.c_uint64),
        ("num_tokens", ctypes.c_uint32),
        ("topk", ctypes.c_uint32),
        ("num_experts", ctypes.c_uint32),
        ("local_experts", ctypes.c_uint32),
        ("hidden", ctypes.c_uint32),
        ("block_m", ctypes.c_uint32),
        ("ring_blocks", ctypes.c_uint32),
        ("w1_tasks", ctypes.c_uint32),
        ("w2_tasks", ctypes.c_uint32),
        ("idx_bytes", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
    ]

    @classmethod
    def c_declaration(cls) -> str:
        """The matching C++ struct (``gc_moe::DispatchParams``) with a size check."""
        return c_struct_declaration(cls, "DispatchParams", "gc_moe_compat/operator/sm90/role1_dispatch.py")


def params_header() -> str:
    """The generated part of kernels/sm90/role1_dispatch_params.cuh: the C declarations of :class:`DispatchParams`
    and :class:`DispatchSite`."""
    return DispatchParams.c_declaration() + "\n" + DispatchSite.c_declaration("DispatchSite", "kSite")


def dispatch_params(buffer: GcMoeBuffer, plan: RingPlan, num_tokens: int, timeout_ms: float | None = None, *,
                    warmup: bool = False) -> DispatchParams:
    """The :class:`DispatchParams` of one call with ``num_tokens`` tokens on ``buffer`` and ring ``plan``.

    Raises ``ValueError`` naming the argument when the plan does not fit the buffer's ring or the shape exceeds what
    the kernel's shared-memory tables hold. ``timeout_ms``: every spin-wait's bound (default
    :func:`~gc_moe_compat.runtime.status.spin_timeout_ns`).
    """
    shape, ring = buffer.shape, buffer.layout.ring
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not 0 <= num_tokens <= shape.capacity:
        raise ValueError(f"num_tokens: must be an int in [0, capacity={shape.capacity}], got {num_tokens!r}")
    if plan.block_m * plan.ring_blocks > ring.rows or plan.ring_blocks > ring.blocks:
        raise ValueError(f"plan: {plan.ring_blocks} ring blocks of {plan.block_m} rows do not fit the buffer's ring "
                         f"({ring.rows} rows, {ring.blocks} signal slots)")
    if shape.num_experts > MAX_EXPERTS or shape.num_local_experts > MAX_LOCAL_EXPERTS:
        raise ValueError(f"shape: role1 holds <= {MAX_EXPERTS} experts and <= {MAX_LOCAL_EXPERTS} local experts, got "
                         f"E={shape.num_experts}, e={shape.num_local_experts}")
    dropped, mirror = dropped_record(buffer.storage.device).addresses
    return DispatchParams(
        timeout_ns=spin_timeout_ns(timeout_ms), dropped=dropped, dropped_mirror=mirror, num_tokens=num_tokens,
        topk=shape.topk, num_experts=shape.num_experts, local_experts=shape.num_local_experts, hidden=shape.hidden,
        block_m=plan.block_m, ring_blocks=plan.ring_blocks, w1_tasks=plan.w1_tasks_per_block,
        w2_tasks=plan.w2_tasks_per_block, idx_bytes=buffer.topk_idx.element_size(), flags=WARMUP if warmup else 0)


def dispatch_args(buffer: GcMoeBuffer, plan: RingPlan, num_tokens: int, timeout_ms: float | None = None, *,
                  warmup: bool = False) -> KernelArgs:
    """The kernel's three by-value arguments: peer table, workspace offsets, :func:`dispatch_params`."""
    params = dispatch_params(buffer, plan, num_tokens, timeout_ms, warmup=warmup)
    table = type(buffer.peer_table).from_buffer_copy(buffer.peer_table)
    offsets = WorkspaceOffsets.from_buffer_copy(buffer.offsets)
    return KernelArgs(table, offsets, params)


def kernel() -> jit.Kernel:
    """The role1 kernel, compiled (or taken from the cache) and loaded."""
    return jit.load_module(SOURCE).kernel(KERNEL)


def launch_dispatch(buffer: GcMoeBuffer, plan: RingPlan, num_tokens: int, stream: int, *,
                    timeout_ms: float | None = None) -> None:
    """Launches role1 on ``stream`` (e.g. the communication green context's) with ``buffer.dispatch_sms`` CTAs.

    Asynchronous: check the outcome with :func:`raise_for_dispatch_status` once the stream is done.
    """
    launch(kernel(), buffer.dispatch_sms, THREADS, dispatch_args(buffer, plan, num_tokens, timeout_ms), stream)


def dispatch_node(buffer: GcMoeBuffer, plan: RingPlan, num_tokens: int, *, timeout_ms: float | None = None,
                  name: str = "role1") -> KernelNode:
    """Role1 as a graph root for :mod:`gc_moe_compat.runtime.graph`: on the communication green context when the
    buffer is partitioned (no context otherwise); its warm-up launch has the :data:`WARMUP` flag (no side effect)."""
    role = Role.COMM if buffer.partition == "on" else None
    return KernelNode.make(name, kernel(), role, buffer.dispatch_sms, THREADS,
                           dispatch_args(buffer, plan, num_tokens, timeout_ms),
                           warmup_args=dispatch_args(buffer, plan, num_tokens, timeout_ms, warmup=True))


def raise_for_dispatch_status(buffer: GcMoeBuffer, what: str = "role1 dispatch") -> None:
    """Raises :class:`~gc_moe_compat.runtime.status.DeviceTimeoutError` / ``DeviceCheckError`` if role1 recorded an
    error, or ``DeviceCheckError`` for an invalid input dropped on the buffer's device (by role1 or by a pre-dispatch
    before it: :mod:`gc_moe_compat.runtime.dropped`); call once the launching stream (or graph) has finished. The
    record is cleared before raising so that the next launch runs: role1's waits give up at once while the record
    holds an error."""
    record = buffer.status[StatusRecord.ROLE1]
    saved = record.clone()
    if int(saved[:4].view(torch.int32)[0]):
        record.zero_()
    raise_for_status(saved, what, DispatchSite.names())
    dropped_record(buffer.storage.device).raise_if_dropped(what)


def assign_rows(counts: torch.Tensor, plan: RingPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's row and block arithmetic on the host, from the receive counts ``counts`` int ``[P, e]``.

    Received rows are numbered ``j`` in local-expert order, inside an expert by source rank, inside a source rank
    by its ``src_index`` position. Returns ``(table, rows)``: ``table`` int32 ``[n, 3]`` (local expert, valid rows,
    ring row offset) per pool block, and ``rows`` int64 ``[N, 8]`` of (local expert, src_rank, position, pool
    block, generation, ring row, valid rows of the block, ``l1_full_count`` increment). The kernel finds the expert
    and the source rank of row ``j`` by binary search over the same exclusive prefix sums.
    """
    if counts.dim() != 2 or counts.is_floating_point():
        raise ValueError(f"counts: must be an integer tensor [P, e], got {counts!r:.80}")
    counts = counts.to(torch.int64)
    bm, r = plan.block_m, plan.ring_blocks
    per_expert = counts.sum(0)
    blocks = (per_expert + bm - 1) // bm
    row_start = torch.cumsum(per_expert, 0) - per_expert
    block_start = torch.cumsum(blocks, 0) - blocks
    src_start = torch.cumsum(counts, 0) - counts  # [P, e]: first row of (src, le) inside le
    n_rows, n_blocks = int(per_expert.sum()), int(blocks.sum())
    j = torch.arange(n_rows, dtype=torch.int64, device=counts.device)
    le = torch.searchsorted(row_start, j, right=True) - 1
    i = j - row_start[le]
    src = (src_start.t()[le] <= i[:, None]).sum(1) - 1  # largest src whose first row is <= i
    pos = i - src_start[src, le]
    block = block_start[le] + i // bm
    valid = torch.clamp(per_expert[le] - (i // bm) * bm, max=bm)
    inc = torch.where(i % bm == valid - 1, 1 + bm - valid, torch.ones_like(valid))
    rows = torch.stack([le, src, pos, block, block // r, (block % r) * bm + i % bm, valid, inc], 1)
    q = torch.arange(n_blocks, dtype=torch.int64, device=counts.device)
    q_le = torch.searchsorted(block_start, q, right=True) - 1
    q_valid = torch.clamp(per_expert[q_le] - (q - block_start[q_le]) * bm, max=bm)
    table = torch.stack([q_le, q_valid, (q % r) * bm], 1).to(torch.int32)
    return table, rows
