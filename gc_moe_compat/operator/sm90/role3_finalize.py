"""Host side of role3, the SM90 finalize kernel (kernels/sm90/role3_finalize.cu): parameters, launch, graph node,
status.

Role3 runs on the compute partition after role1 and role2 (and role4 with a fused shared expert). CTA 0's first four
warps publish this rank's combine readiness (``combine_ready[rank] = replay_seq + 1`` on every rank, release at
system scope, also with ``T = 0``), consume ``recv_counts[recv_parity]`` with the arrival check (high words sum to
``dispatch_sms·P`` per local expert), add the received rows into the optional ``cumulative_local_expert_recv_stats``,
reset ``send_counts``, ``recv_counts[parity]``, ``pool_header`` and the four ring signals, and flip
``recv_parity``; the CTA whose arrival on ``finalize_arrive`` completes the grid advances ``replay_seq``. Every
other warp waits (bounded) until every peer's readiness equals ``replay_seq + 1`` and writes
``y[t] = BF16(sum over valid slots, slot order, FP32)`` of the partials in this rank's ``combine`` buffer (slot
``k`` = the shared expert when ``S = 1``; a slot with ``topk_idx == -1`` contributes nothing): the semantics of
:func:`gc_moe_compat.testing.reference._combine`. The ordering argument (why no cross-rank barrier is needed between
replays) is written at the top of the kernel source.

The kernel takes three by-value arguments: the :class:`~gc_moe_compat.runtime.workspace.PeerTable`, the
:class:`~gc_moe_compat.operator.workspace.WorkspaceOffsets` (kernels/common/workspace_offsets.cuh) and
:class:`FinalizeParams`. Errors land in role3's record of the workspace ``status`` region; read them with
:func:`raise_for_finalize_status` once the stream or graph has finished.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from gc_moe_compat.operator.buffer import GcMoeBuffer
from gc_moe_compat.operator.workspace import WorkspaceOffsets
from gc_moe_compat.runtime import jit
from gc_moe_compat.runtime.graph import KernelNode
from gc_moe_compat.runtime.green import Role
from gc_moe_compat.runtime.launch import launch
from gc_moe_compat.runtime.params import KernelArgs
from gc_moe_compat.runtime.status import raise_for_status, spin_timeout_ns

__all__ = [
    "BOOK_WARPS",
    "CHUNK",
    "KERNEL",
    "ROLE3_RECORD",
    "SOURCE",
    "THREADS",
    "WARMUP",
    "FinalizeParams",
    "finalize_args",
    "finalize_grid",
    "finalize_node",
    "finalize_params",
    "finalize_sites",
    "kernel",
    "launch_finalize",
    "raise_for_finalize_status",
]

SOURCE = "sm90/role3_finalize.cu"
KERNEL = "gc_sm90_finalize"
THREADS = 384
"""Threads per finalize CTA (12 warps)."""
BOOK_WARPS = 4
"""CTA 0's bookkeeping warps; every other warp of the grid combines."""
CHUNK = 256
"""Hidden columns per combine unit: one warp, 16 bytes (8 BF16) per lane."""
WARMUP = 1
"""``FinalizeParams.flags`` bit: return at once (the one-time warm-up launch of a graph node)."""
ROLE3_RECORD = 2
"""Index of role3's record in the workspace ``status`` region."""
_SITE_ARRIVAL, _SITE_READY_TIMEOUT, _SITE_READY_AHEAD = 1, 2, 3


class FinalizeParams(ctypes.Structure):
    """By-value kernel argument (``gc_moe::FinalizeParams``): output, statistics, sizes, timeout and flags.

    ``y`` / ``recv_stats`` are device addresses (``recv_stats`` 0 when absent); ``idx_bytes`` is the width of
    ``topk_idx`` (8 or 4); ``dispatch_sms`` the role1 grid every (source, expert) counter's high word counts.
    """

    _fields_ = [
        ("y", ctypes.c_uint64),
        ("recv_stats", ctypes.c_uint64),
        ("timeout_ns", ctypes.c_uint64),
        ("num_tokens", ctypes.c_uint32),
        ("topk", ctypes.c_uint32),
        ("num_shared", ctypes.c_uint32),
        ("hidden", ctypes.c_uint32),
        ("num_experts", ctypes.c_uint32),
        ("num_local_experts", ctypes.c_uint32),
        ("dispatch_sms", ctypes.c_uint32),
        ("idx_bytes", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
    ]


def finalize_sites(num_ranks: int, num_local_experts: int) -> dict[int, str]:
    """Names of the kernel's status sites (``kind << 16 | index``) for ``P`` ranks and ``e`` local experts."""
    sites = {_SITE_ARRIVAL << 16 | le: f"role3 receive-count arrival check of local expert {le} (high words must "
             "sum to dispatch_sms*P)" for le in range(num_local_experts)}
    for r in range(num_ranks):
        sites[_SITE_READY_TIMEOUT << 16 | r] = f"role3 combine waiting for rank {r}'s combine readiness"
        sites[_SITE_READY_AHEAD << 16 | r] = f"role3 combine readiness of rank {r} past this replay"
    return sites


def finalize_grid(num_tokens: int, hidden: int, max_ctas: int) -> int:
    """CTAs of one launch: one combine warp per unit (token x ``CHUNK`` columns) plus the bookkeeping warps, at most
    ``max_ctas`` (one CTA per compute SM), at least 1 (bookkeeping runs even with ``T = 0``)."""
    warps = num_tokens * (hidden // CHUNK) + BOOK_WARPS
    return max(1, min(max_ctas, -(-warps // (THREADS // 32))))


def _check_y(y: object, capacity: int, hidden: int, device: torch.device) -> None:
    if not isinstance(y, torch.Tensor) or y.dtype != torch.bfloat16 or y.dim() != 2 or y.shape[1] != hidden:
        raise ValueError(f"y: must be a bfloat16 tensor [T, {hidden}], got {y!r:.80}")
    if y.shape[0] > capacity:
        raise ValueError(f"y.shape[0] (tokens T): must be <= capacity={capacity}, got {y.shape[0]}")
    if y.device != device or not y.is_contiguous():
        raise ValueError(f"y: must be contiguous on {device} (the workspace's device), got {y.device}, "
                         f"contiguous={y.is_contiguous()}")
    if y.numel() and y.data_ptr() % 16:
        raise ValueError(f"y: must be 16-byte aligned (16-byte stores), got address {y.data_ptr():#x}")


def finalize_params(buffer: GcMoeBuffer, y: torch.Tensor, *, recv_stats: torch.Tensor | None = None,
                    timeout_ms: float | None = None, dispatch_sms: int | None = None,
                    warmup: bool = False) -> FinalizeParams:
    """The :class:`FinalizeParams` of one call writing ``y [T, H]`` from ``buffer``.

    ``recv_stats``: optional int32 ``[e]`` (``cumulative_local_expert_recv_stats``) the kernel adds this replay's
    received rows per local expert to. ``timeout_ms`` bounds the readiness wait (default
    :func:`~gc_moe_compat.runtime.status.spin_timeout_ns`). ``dispatch_sms``: role1's grid on every rank (default
    ``buffer.dispatch_sms``). Raises ``ValueError`` naming the argument.
    """
    if buffer.storage is None:
        raise ValueError("buffer: was destroyed")
    shape = buffer.shape
    if buffer.peer_table.world_size != shape.num_ranks:
        raise ValueError(f"buffer.peer_table: holds {buffer.peer_table.world_size} ranks, the shape has "
                         f"P={shape.num_ranks}")
    _check_y(y, shape.capacity, shape.hidden, buffer.storage.device)
    stats = 0
    if recv_stats is not None:
        e = shape.num_local_experts
        if (not isinstance(recv_stats, torch.Tensor) or recv_stats.dtype != torch.int32
                or tuple(recv_stats.shape) != (e,) or recv_stats.device != buffer.storage.device
                or not recv_stats.is_contiguous()):
            raise ValueError(f"recv_stats: must be a contiguous int32 tensor [{e}] (e = E/P) on "
                             f"{buffer.storage.device}, got {recv_stats!r:.80}")
        stats = recv_stats.data_ptr()
    dispatch = buffer.dispatch_sms if dispatch_sms is None else dispatch_sms
    if isinstance(dispatch, bool) or not isinstance(dispatch, int) or dispatch < 1:
        raise ValueError(f"dispatch_sms: must be an int >= 1 (role1's grid), got {dispatch!r}")
    return FinalizeParams(
        y=y.data_ptr(), recv_stats=stats, timeout_ns=spin_timeout_ns(timeout_ms), num_tokens=y.shape[0],
        topk=shape.topk, num_shared=shape.num_shared_experts, hidden=shape.hidden, num_experts=shape.num_experts,
        num_local_experts=shape.num_local_experts, dispatch_sms=dispatch,
        idx_bytes=buffer.topk_idx.element_size(), flags=WARMUP if warmup else 0)


def finalize_args(buffer: GcMoeBuffer, y: torch.Tensor, *, recv_stats: torch.Tensor | None = None,
                  timeout_ms: float | None = None, dispatch_sms: int | None = None,
                  warmup: bool = False) -> KernelArgs:
    """The kernel's three by-value arguments: peer table, workspace offsets, :func:`finalize_params`."""
    params = finalize_params(buffer, y, recv_stats=recv_stats, timeout_ms=timeout_ms, dispatch_sms=dispatch_sms,
                             warmup=warmup)
    table = type(buffer.peer_table).from_buffer_copy(buffer.peer_table)
    return KernelArgs(table, WorkspaceOffsets.from_buffer_copy(buffer.offsets), params)


def kernel() -> jit.Kernel:
    """The role3 kernel, compiled (or taken from the cache) and loaded."""
    return jit.load_module(SOURCE).kernel(KERNEL)


def _grid(buffer: GcMoeBuffer, y: torch.Tensor, max_ctas: int | None) -> int:
    limit = buffer.compute_sms if max_ctas is None else max_ctas
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"max_ctas: must be an int >= 1 or None (the compute SMs), got {limit!r}")
    return finalize_grid(y.shape[0], buffer.shape.hidden, limit)


def launch_finalize(buffer: GcMoeBuffer, y: torch.Tensor, stream: object, *,
                    recv_stats: torch.Tensor | None = None, timeout_ms: float | None = None,
                    dispatch_sms: int | None = None, max_ctas: int | None = None) -> None:
    """Launches role3 on ``stream`` (a raw handle or ``CUstream``, e.g. the compute green context's).

    Asynchronous: check the outcome with :func:`raise_for_finalize_status` once the stream is done. The launch must
    follow this rank's role1 and role2 (and role4) of the same replay on that stream.
    """
    args = finalize_args(buffer, y, recv_stats=recv_stats, timeout_ms=timeout_ms, dispatch_sms=dispatch_sms)
    grid = _grid(buffer, y, max_ctas)
    launch(kernel(), grid, THREADS, args, stream)


def finalize_node(buffer: GcMoeBuffer, y: torch.Tensor, *, deps: Sequence[str] = ("role1", "role2"),
                  recv_stats: torch.Tensor | None = None, timeout_ms: float | None = None,
                  dispatch_sms: int | None = None, max_ctas: int | None = None, name: str = "role3") -> KernelNode:
    """Role3 as a graph node for :mod:`gc_moe_compat.runtime.graph`, after ``deps`` (role1, role2 and, with a fused
    shared expert, role4): on the compute green context when the buffer is partitioned (no context otherwise); its
    warm-up launch has the :data:`WARMUP` flag (no side effect)."""
    role = Role.COMPUTE if buffer.partition == "on" else None
    kw = dict(recv_stats=recv_stats, timeout_ms=timeout_ms, dispatch_sms=dispatch_sms)
    args, warmup = finalize_args(buffer, y, **kw), finalize_args(buffer, y, **kw, warmup=True)
    grid = _grid(buffer, y, max_ctas)
    return KernelNode.make(name, kernel(), role, grid, THREADS, args, deps=deps, warmup_args=warmup)


def raise_for_finalize_status(buffer: GcMoeBuffer, what: str = "role3 finalize") -> None:
    """Raises :class:`~gc_moe_compat.runtime.status.DeviceTimeoutError` (a peer's readiness never came) or
    ``DeviceCheckError`` (arrival check, readiness past this replay) if role3 recorded an error; call once the
    launching stream (or graph) has finished. The record is cleared before raising, so a later check reports only
    later errors."""
    record = buffer.status[ROLE3_RECORD]
    saved = record.clone()
    if int(saved[:4].view(torch.int32)[0]):
        record.zero_()
    raise_for_status(saved, what, finalize_sites(buffer.shape.num_ranks, buffer.shape.num_local_experts))
