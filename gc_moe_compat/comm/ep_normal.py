"""Host side of DeepEP's normal-mode (high-throughput) intranode kernels behind the ``deep_ep`` facade
(kernels/sm90/ep_normal.cu): the parameter struct, the workspace layout, the kernel launches and the error records.

Five kernels (seven roles, each with its status record), each its own launch on the communication stream (the caller
picks it: the communication green context's, or the caller's stream with the partition off):

* layout: ``num_tokens_per_rank``, ``num_tokens_per_expert``, ``is_token_in_rank`` from ``topk_idx``;
* notify (uncached dispatch): every rank's per-rank and per-expert counts exchanged through the workspace behind a
  generation-tagged barrier; ``rank_prefix_matrix`` (all ``P x P`` entries), the received and ``expert_alignment``-
  aligned per-expert counts into a pinned host record (DeepEP's CPU sync), ``send_head`` and ``channel_prefix_matrix``
  over DeepEP's channels (``config.num_sms / 2`` contiguous token ranges);
* dispatch (a send half, then a receive half in each CTA: one launch, as DeepEP's): each token's row (payload,
  scales, transformed top-k) is stored into the data region of every rank it goes to, at DeepEP's receive position
  (source rank, then channel, then token); the receiver copies its rows into the outputs. A CTA's receive half waits
  for its own grid's send half, so the grid is at most the CTAs the launch can hold at once (``max_ctas``, the
  rank's share of the SMs);
* combine heads: first in a combine, the rewrite DeepEP's intranode combine makes to the caller's handle in place
  (``cached_notify_combine``): each ``send_head`` entry of a token that does not go to a rank becomes
  ``-h - 1``, ``h`` the head of the channel's next token to that rank (``-(1 << 25) - 1`` where none follows), so
  that the handle holds DeepEP's bytes after a combine
  (:func:`~gc_moe_compat.testing.ep_normal_reference.combined_send_head` is its reference); idempotent, and the
  other kernels read any negative entry as "not sent";
* combine (send and receive halves, as dispatch): each received row goes back to its source rank, which sums them
  (FP32, rank order, after ``bias_0 + bias_1``) into BF16, as DeepEP's intranode combine does.

Synchronization words (``arrive``, ``ready``, ``released``) carry the Buffer's collective-op number (the same on
every rank: dispatches and combines are collective and called in the same order), so no call needs a reset. Waits
are bounded (:func:`~gc_moe_compat.runtime.status.spin_timeout_ns`); a timeout or a protocol error lands in a status
record that the kernels also copy into a pinned host mirror (:func:`raise_for_mirrored_status`).
"""

from __future__ import annotations

import ctypes
import enum
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gc_moe_compat.config import MAX_EXPERTS, MAX_RANKS
from gc_moe_compat.runtime import jit
from gc_moe_compat.runtime.launch import Dim3
from gc_moe_compat.runtime.params import (
    KernelArgs,
    c_enum_declaration,
    c_identifier,
    c_struct_declaration,
    fields_before,
)
from gc_moe_compat.runtime.status import KernelStatus, StatusSite, raise_for_status, status_codes
from gc_moe_compat.runtime.workspace import PeerTable

__all__ = [
    "ENTRY_NAMES",
    "HEADER_BYTES",
    "MAX_TOPK",
    "PER_CALL_FIELDS",
    "SOURCE",
    "THREADS",
    "EpNormalParams",
    "Entry",
    "HostRecord",
    "Kernel",
    "NormalLaunch",
    "NormalSite",
    "PackedKernel",
    "combine_row_layout",
    "data_offset",
    "dispatch_row_layout",
    "host_tag",
    "kernel_of",
    "make_params",
    "new_host_counts",
    "new_launch",
    "new_status_mirror",
    "normal_sites",
    "params_header",
    "raise_for_mirrored_status",
    "released_word",
]

SOURCE = "sm90/ep_normal.cu"
THREADS = 384
"""Threads per CTA (12 warps) of every normal-mode kernel (kernels/sm90/ep_normal.cu: kThreads)."""
MAX_TOPK = 32
"""Routing slots per token (one warp lane each in the combine's weight sum)."""


class Kernel(enum.IntEnum):
    """The seven roles of the normal-mode kernels; the value is the index of the role's status record
    (``gc_moe::NormalKernel``; COMBINE_HEADS, which neither waits nor checks, never writes its record). A
    direction's send and receive halves are one kernel (:class:`Entry`), each half reporting in its own record."""

    LAYOUT = 0
    NOTIFY = 1
    DISPATCH_SEND = 2
    DISPATCH_RECV = 3
    COMBINE_SEND = 4
    COMBINE_RECV = 5
    COMBINE_HEADS = 6


class Entry(enum.IntEnum):
    """The kernels' entry points, what a launch names: DISPATCH and COMBINE run their direction's send half, then its
    receive half, in one grid (COMBINE first rewrites the handle's send_head); COMBINE_HEADS is that rewrite alone,
    which the kernel test launches to check DeepEP's bytes on any grid."""

    LAYOUT = 0
    NOTIFY = 1
    DISPATCH = 2
    COMBINE = 3
    COMBINE_HEADS = 4


ENTRY_NAMES = {Entry.LAYOUT: "gc_ep_normal_layout", Entry.NOTIFY: "gc_ep_normal_notify",
                Entry.DISPATCH: "gc_ep_normal_dispatch", Entry.COMBINE: "gc_ep_normal_combine",
                Entry.COMBINE_HEADS: "gc_ep_normal_combine_heads"}
"""Each entry point's kernel name in kernels/sm90/ep_normal.cu."""
_ROLE_ENTRIES = {Kernel.LAYOUT: (Entry.LAYOUT, ""), Kernel.NOTIFY: (Entry.NOTIFY, ""),
                 Kernel.DISPATCH_SEND: (Entry.DISPATCH, " (send half)"),
                 Kernel.DISPATCH_RECV: (Entry.DISPATCH, " (receive half)"),
                 Kernel.COMBINE_SEND: (Entry.COMBINE, " (send half)"),
                 Kernel.COMBINE_RECV: (Entry.COMBINE, " (receive half)"),
                 Kernel.COMBINE_HEADS: (Entry.COMBINE, " (send_head rewrite)")}
"""Each role's entry point (the grid it runs in) and which part of it the role is."""
_NAMES = {kernel: ENTRY_NAMES[entry] + part for kernel, (entry, part) in _ROLE_ENTRIES.items()}
"""Each role's name in error messages and in the generated header: its entry point, and which half."""


class HostRecord(enum.IntEnum):
    """Indices of the int32 host record notify fills (``gc_moe::HostRecord``; :func:`new_host_counts`): the tag, an
    int64 over words 0 and 1 that notify stores last (the call's collective-op number), then the counts."""

    TAG = 0
    RECV = 2
    MOST_RECV = 3
    MOST_SENT = 4
    EXPERTS = 5


_HOST_COMMENTS = {"kHostTag": "int64 (words 0, 1): the call's op, stored after every count (release, system scope)",
                  "kHostRecv": "rows this rank receives", "kHostMostRecv": "most rows any rank receives",
                  "kHostMostSent": "most rows any rank sends",
                  "kHostExperts": "first of the aligned per-local-expert counts"}


class NormalSite(StatusSite):
    """Kinds of the kernels' status sites (``gc_moe::NormalSite``); a record's site is ``kind << 16 | rank``."""

    ARRIVE = 1, "notify waiting for a rank's counts"
    RELEASED = 2, "a sender waiting until a rank has read the previous operation's rows"
    READY = 3, "a receiver waiting for a rank's rows"
    CAPACITY = 4, "a row past the data region of num_nvl_bytes (observed row, expected capacity)"
    RECV_ROWS = 5, "more rows received than the outputs hold (observed, expected): num_worst_tokens too small"
    EXPERT_RANGE = 6, "a topk_idx entry >= num_experts (treated as an unused slot)"
    EXPERT_NEGATIVE = 7, "a topk_idx entry < -1 (treated as an unused slot)"


# Fixed header: persistent words never move between calls of different shapes.
_ARRIVE = 0                                 # u64 [MAX_RANKS]
_READY = 1024                               # u64 [MAX_RANKS]
_RELEASED = 2048                            # u64 [MAX_RANKS]
_STATUS = 3072                              # KernelStatus [len(Kernel)]
_LAYOUT_ARRIVE, _NOTIFY_ARRIVE, _SEND_ARRIVE, _RECV_ARRIVE = 3328, 3336, 3344, 3352
_SCRATCH = 3584                             # u32 [MAX_EXPERTS + MAX_RANKS]: the layout's histogram
HEADER_BYTES = 12288
"""Bytes of the fixed header; the op's transient counts and the data region follow it."""
assert MAX_RANKS * 8 <= 1024 and _STATUS + len(Kernel) * ctypes.sizeof(KernelStatus) <= _LAYOUT_ARRIVE
assert _SCRATCH + 4 * (MAX_EXPERTS + MAX_RANKS) <= HEADER_BYTES


def released_word(rank: int) -> int:
    """The byte offset, in every rank's copy of the workspace, of ``released[rank]``: the last op whose rows ``rank``
    has read from its data region (its receive half publishes it; the host stores it for an op whose counts were
    exchanged but whose transfer was refused on every rank)."""
    return _RELEASED + 8 * rank


def _align(value: int, to: int) -> int:
    return -(-value // to) * to


@dataclass(frozen=True)
class Transient:
    """Offsets of one call's exchanged counts (``counts [P][P]``, ``expert_counts [P][L]``, ``recv_chan [P][C]``)
    and of the data region that follows them."""

    counts: int
    expert_counts: int
    recv_chan: int
    data: int


def data_offset(num_ranks: int, local_experts: int, num_channels: int) -> Transient:
    """The transient offsets of calls with these sizes (the data region 256-byte aligned)."""
    counts = HEADER_BYTES
    experts = counts + _align(4 * num_ranks * num_ranks, 16)
    chan = experts + _align(4 * num_ranks * local_experts, 16)
    return Transient(counts, experts, chan, _align(chan + 4 * num_ranks * num_channels, 256))


@dataclass(frozen=True)
class RowLayout:
    """Bytes of one data-region row: payload at ``payload``, scales at ``scales``, top-k (int64 ids, then FP32
    weights; weights only for combine rows) at ``topk``, ``stride`` in all (a multiple of 16)."""

    payload: int
    scales: int
    topk: int
    stride: int


def dispatch_row_layout(row_bytes: int, num_scales: int, topk: int) -> RowLayout:
    """A dispatch row: 16 bytes of source token index, the payload, the scales, the transformed top-k."""
    scales = 16 + row_bytes
    top = scales + _align(4 * num_scales, 16)
    return RowLayout(16, scales, top, _align(top + 12 * topk, 16))


def combine_row_layout(row_bytes: int, topk: int) -> RowLayout:
    """A combine row: the BF16 row, then the FP32 top-k weights."""
    return RowLayout(0, row_bytes, row_bytes, _align(row_bytes + 4 * topk, 16))


class EpNormalParams(ctypes.Structure):
    """By-value kernel argument after the peer table (``gc_moe::EpNormalParams``, kernels/sm90/ep_normal_params.cuh).

    Pointers are device addresses (0 where a kernel does not use one); ``host_counts`` and ``status_mirror`` are
    pinned host memory the kernels store into; ``off_*`` are byte offsets into every rank's workspace (``off_row_*``
    into a data-region row); ``op`` is the call's collective-op number. ``topk_idx`` and ``recv_topk_idx`` are int64
    (:data:`~gc_moe_compat.comm.TOPK_IDX_DTYPE`)."""

    _fields_ = [
        ("x", ctypes.c_uint64),
        ("x_scales", ctypes.c_uint64),
        ("topk_idx", ctypes.c_uint64),
        ("topk_weights", ctypes.c_uint64),
        ("is_token_in_rank", ctypes.c_uint64),
        ("num_tokens_per_rank", ctypes.c_uint64),
        ("num_tokens_per_expert", ctypes.c_uint64),
        ("rank_prefix", ctypes.c_uint64),
        ("channel_prefix", ctypes.c_uint64),
        ("recv_channel_prefix", ctypes.c_uint64),
        ("send_head", ctypes.c_uint64),
        ("recv_x", ctypes.c_uint64),
        ("recv_scales", ctypes.c_uint64),
        ("recv_topk_idx", ctypes.c_uint64),
        ("recv_topk_weights", ctypes.c_uint64),
        ("recv_src_idx", ctypes.c_uint64),
        ("out", ctypes.c_uint64),
        ("out_topk_weights", ctypes.c_uint64),
        ("bias_0", ctypes.c_uint64),
        ("bias_1", ctypes.c_uint64),
        ("host_counts", ctypes.c_uint64),
        ("status_mirror", ctypes.c_uint64),
        ("timeout_ns", ctypes.c_uint64),
        ("op", ctypes.c_uint64),
        ("data_rows", ctypes.c_uint64),
        ("off_arrive", ctypes.c_uint64),
        ("off_ready", ctypes.c_uint64),
        ("off_released", ctypes.c_uint64),
        ("off_status", ctypes.c_uint64),
        ("off_layout_arrive", ctypes.c_uint64),
        ("off_notify_arrive", ctypes.c_uint64),
        ("off_send_arrive", ctypes.c_uint64),
        ("off_recv_arrive", ctypes.c_uint64),
        ("off_scratch", ctypes.c_uint64),
        ("off_counts", ctypes.c_uint64),
        ("off_expert_counts", ctypes.c_uint64),
        ("off_recv_chan", ctypes.c_uint64),
        ("off_data", ctypes.c_uint64),
        ("num_tokens", ctypes.c_uint32),
        ("hidden", ctypes.c_uint32),
        ("row_bytes", ctypes.c_uint32),
        ("row_stride", ctypes.c_uint32),
        ("off_row_scales", ctypes.c_uint32),
        ("off_row_topk", ctypes.c_uint32),
        ("num_scales", ctypes.c_uint32),
        ("scale_token_stride", ctypes.c_uint32),
        ("scale_hidden_stride", ctypes.c_uint32),
        ("topk", ctypes.c_uint32),
        ("num_experts", ctypes.c_uint32),
        ("local_experts", ctypes.c_uint32),
        ("num_channels", ctypes.c_uint32),
        ("recv_rows", ctypes.c_uint32),
        ("expert_alignment", ctypes.c_uint32),
    ]


def params_header() -> str:
    """The generated part of kernels/sm90/ep_normal_params.cuh: :class:`EpNormalParams`, :class:`NormalSite` and
    :class:`Kernel` (``NormalKernel``, each constant commented with its entry point, plus the count)."""
    struct = c_struct_declaration(EpNormalParams, "EpNormalParams", "gc_moe_compat/comm/ep_normal.py")
    kernels = {c_identifier("kNormal", kernel.name): int(kernel) for kernel in Kernel}
    kernels["kNormalKernelCount"] = len(Kernel)
    entries = {c_identifier("kNormal", kernel.name): name for kernel, name in _NAMES.items()}
    entries["kNormalKernelCount"] = "status records"
    indices = c_enum_declaration("NormalKernel", kernels, f"{__name__}.{Kernel.__qualname__}", entries)
    record = c_enum_declaration("HostRecord", {c_identifier("kHost", i.name): int(i) for i in HostRecord},
                                f"{__name__}.{HostRecord.__qualname__}", _HOST_COMMENTS)
    return struct + "\n" + NormalSite.c_declaration("NormalSite", "kNormalSite") + "\n" + indices + "\n" + record


def make_params(*, transient: Transient, data_rows: int, **fields: int) -> EpNormalParams:
    """The :class:`EpNormalParams` of launches with these sizes: the fixed offsets, ``transient``'s, ``data_rows``
    and ``fields`` (device addresses such as ``x=...``, sizes such as ``num_tokens=...``, ``timeout_ns``); a name
    that is not a field raises ``TypeError`` (ctypes would keep it as a plain attribute the kernels never see)."""
    unknown = fields.keys() - {name for name, _ in EpNormalParams._fields_}
    if unknown:
        raise TypeError(f"make_params: not fields of EpNormalParams: {sorted(unknown)}")
    return EpNormalParams(
        **fields, data_rows=data_rows, off_arrive=_ARRIVE, off_ready=_READY, off_released=_RELEASED,
        off_status=_STATUS, off_layout_arrive=_LAYOUT_ARRIVE, off_notify_arrive=_NOTIFY_ARRIVE,
        off_send_arrive=_SEND_ARRIVE, off_recv_arrive=_RECV_ARRIVE, off_scratch=_SCRATCH, off_counts=transient.counts,
        off_expert_counts=transient.expert_counts, off_recv_chan=transient.recv_chan, off_data=transient.data)


PER_CALL_FIELDS = fields_before(EpNormalParams, "status_mirror") | {"timeout_ns", "op", "recv_rows"}
"""The fields of :class:`EpNormalParams` a call sets: its tensors' device addresses and the host record notify fills
(the fields before ``status_mirror``), the spin timeout as ``GC_MOE_SPIN_TIMEOUT_MS`` is set at the call, its
collective-op number and its received rows. :func:`new_launch` fixes every other field for the calls of one shape."""


@functools.cache
def kernel_of(entry: Entry) -> jit.Kernel:
    """The loaded kernel, looked up once per process: ``jit.load_module`` hashes the source tree for its cache key
    (milliseconds), which would otherwise be paid by every launch of a normal-mode call."""
    return jit.load_module(SOURCE).kernel(ENTRY_NAMES[entry])


PackedKernel = tuple[Entry, Dim3, Dim3, int]
"""One launch of a :class:`NormalLaunch`: the entry point, its grid, its block and the address of its packed arguments
(with :func:`kernel_of`'s handle, what :func:`~gc_moe_compat.runtime.launch.launch_packed` takes before the
stream; the kernel is loaded at its first launch, not when the launches are packed)."""
_BLOCK = (THREADS, 1, 1)


class NormalLaunch:
    """The launches of normal-mode calls of one shape on one workspace, packed once (:func:`new_launch`):
    ``params``, one :class:`EpNormalParams` per parameter set (an uncached dispatch has two, notify's and then the
    transfer's), each with every field but :data:`PER_CALL_FIELDS` fixed, so that a call sets those and launches;
    ``kernels``, the launches in order (:data:`PackedKernel`: grids bounded by the rank's share of the GPU), each
    reading the packed by-value arguments of its set (a copy of the peer table, then the parameters), which the
    driver copies at every launch. An instance serves one thread."""

    __slots__ = ("args", "kernels", "params")

    def __init__(self, table: PeerTable, params: Sequence[EpNormalParams],
                 kernels: Sequence[tuple[Entry, int, int]], max_ctas: int) -> None:
        self.params = tuple(params)
        self.args = tuple(KernelArgs(table, p) for p in self.params)
        self.kernels: tuple[PackedKernel, ...] = tuple(
            (kernel, (max(1, min(grid, max_ctas)), 1, 1), _BLOCK, self.args[index].address)
            for kernel, grid, index in kernels)


def new_launch(table: PeerTable, kernels: Sequence[tuple[Entry, int, int]], fields: Sequence[Mapping[str, object]],
               max_ctas: int) -> NormalLaunch:
    """The :class:`NormalLaunch` of calls of one shape: ``fields``, each parameter set's :func:`make_params`
    arguments (none of :data:`PER_CALL_FIELDS`); ``kernels``, in launch order, each ``(kernel, grid, index of its
    parameter set)``, its grid at least 1 CTA and at most ``max_ctas`` (every kernel loops over its work with a grid
    stride; notify needs 2, which every rank's share holds: its CTA 0 waits while the others compute; the direction
    kernels' receive halves wait for their own grid's send half, so ``max_ctas`` must be CTAs the launch's SMs hold
    at once)."""
    for f in fields:
        if f.keys() & PER_CALL_FIELDS:
            raise TypeError(f"new_launch: per-call fields of EpNormalParams: {sorted(f.keys() & PER_CALL_FIELDS)}")
    return NormalLaunch(type(table).from_buffer_copy(table), [make_params(**f) for f in fields], kernels, max_ctas)


def normal_sites(num_ranks: int) -> dict[int, str]:
    """Names of the kernels' status sites (``kind << 16 | rank``)."""
    sites = {NormalSite.EXPERT_RANGE << 16: ("a topk_idx entry (observed) >= num_experts (expected); treated as an "
                                             "unused slot"),
             NormalSite.EXPERT_NEGATIVE << 16: ("a topk_idx entry below -1 (observed: its negation), -1 the only "
                                                "unused-slot id; treated as an unused slot"),
             NormalSite.RECV_ROWS << 16: NormalSite.RECV_ROWS.description}
    for r in range(num_ranks):
        sites[NormalSite.ARRIVE << 16 | r] = f"notify waiting for rank {r}'s token counts"
        sites[NormalSite.RELEASED << 16 | r] = f"waiting until rank {r} has read the previous operation's rows"
        sites[NormalSite.READY << 16 | r] = f"waiting for rank {r}'s rows"
        sites[NormalSite.CAPACITY << 16 | r] = (f"a row for rank {r} past the data region (observed row, expected "
                                                "capacity): num_nvl_bytes too small")
    return sites


def status_records(workspace: torch.Tensor) -> torch.Tensor:
    """The status records of a workspace, one per kernel (uint8 ``[len(Kernel), 32]`` view)."""
    size = ctypes.sizeof(KernelStatus)
    return workspace[_STATUS:_STATUS + len(Kernel) * size].view(len(Kernel), size)


def new_status_mirror(device: torch.device) -> torch.Tensor:
    """The zeroed host mirror (``[len(Kernel), 32]`` uint8) the layout, notify and receive kernels copy the records
    into: pinned for a CUDA workspace (the kernels store through its unified address); host memory under any torch
    default device."""
    return torch.zeros(len(Kernel), ctypes.sizeof(KernelStatus), dtype=torch.uint8, device="cpu",
                       pin_memory=device.type == "cuda")


def new_host_counts(local_experts: int, device: torch.device) -> torch.Tensor:
    """The host record notify fills (pinned for a CUDA workspace; :class:`HostRecord`): int32 ``[tag (int64 over two
    words), received rows, most rows any rank receives, most rows any rank sends, aligned per-local-expert
    counts...]``, -1 until written. Notify stores the tag, the call's collective-op number, after the counts, so a
    host that sees its call's op there reads them without waiting for the kernel's end (:func:`host_tag`)."""
    return torch.full((HostRecord.EXPERTS + local_experts,), -1, dtype=torch.int32, device="cpu",
                      pin_memory=device.type == "cuda")


def host_tag(record: torch.Tensor) -> np.ndarray:
    """The tag of a host record (:func:`new_host_counts`) as a one-element int64 array over its memory: every read
    of ``tag[0]`` loads what notify last stored."""
    return record.numpy()[HostRecord.TAG:HostRecord.TAG + 2].view(np.int64)


def _raise_first(records: torch.Tensor, num_ranks: int, when: str) -> None:
    codes = records[:, :4].contiguous().view(torch.int32).flatten().tolist()
    for kernel in Kernel:
        if codes[kernel]:
            raise_for_status(records[kernel].clone(), f"deep_ep normal-mode {_NAMES[kernel]}{when}",
                             normal_sites(num_ranks))


def raise_for_mirrored_status(workspace: torch.Tensor, mirror: torch.Tensor, num_ranks: int,
                              codes: np.ndarray | None = None, when: str = " (recorded by an earlier call)") -> None:
    """Raises for an error the kernels recorded, as they last copied the records into ``mirror``: one read of its
    code words (``codes``: :func:`status_codes` of ``mirror``, kept by the caller), no synchronization, so it may lag
    the device by the calls still in flight; ``when`` ends the kernel's name in the message (the default: at the
    start of a call; ``""`` where the communication stream has just been synchronized, so the records are this
    call's). Clears records and mirror before raising."""
    if not np.count_nonzero(status_codes(mirror) if codes is None else codes):
        return
    saved = mirror.clone()
    status_records(workspace).zero_()
    mirror.zero_()
    _raise_first(saved, num_ranks, when)
