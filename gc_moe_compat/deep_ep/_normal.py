"""DeepEP's normal (high-throughput) mode, intranode, on the facade's symmetric workspace of ``num_nvl_bytes``:
``get_dispatch_layout``, ``dispatch`` (uncached and cached), ``combine``, the recommended configs and the size hints.

Outputs, handle and ordering are DeepEP's: received rows ordered by source rank, then by the source's token order;
the handle is ``(rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
is_token_in_rank, send_head)`` with DeepEP's meanings (``rank_prefix_matrix`` holds every entry, DeepEP only the
receiver's column), and a combine rewrites the -1 entries of its ``send_head`` in place as DeepEP's does (each
becomes ``-h - 1``, ``h`` the head of the channel's next token to that rank, ``-(1 << 25) - 1`` where none follows;
idempotent, and a reused handle reads alike); ``recv_topk_idx`` holds local expert ids (-1 for another rank's), their
weights 0. Like DeepEP, an uncached dispatch waits on the CPU for the received count unless ``num_worst_tokens > 0``.

The kernels (:mod:`gc_moe_compat.comm.ep_normal`) run on the caller's stream with a grid of ``config.num_sms`` CTAs
(``GC_MOE_DEEP_EP_PARTITION=on``: on the communication green context of the partition ``config.num_sms`` requests),
ordered after ``previous_event`` (or the caller's stream) through a CUDA event, and the caller's stream waits for them
unless ``async_finish`` (then the returned event is the one to wait on). A call's tensors are allocated on the caller's
stream; the caller's stream of a synchronous call waits for the kernels, so no later use of their memory can overtake
them; those of an ``async_finish`` call stay referenced by the Buffer until its event completes (the role of DeepEP's
``record_stream`` and ``allocate_on_comm_stream``). As with DeepEP, the only CPU wait is the uncached dispatch's for
the received counts, and like DeepEP's it polls pinned memory: notify stores the call's collective-op number into the
host record after the counts (:func:`~gc_moe_compat.comm.ep_normal.host_tag`), and the host reads the counts once it
sees it, not at the kernel's end. The kernels' errors (``DeviceTimeoutError`` naming the rank, or
``DeviceCheckError``) are read from the pinned status mirror they copy their records into: at that wait when notify
ended without the counts (this call's), at the start of every call and in ``Buffer.destroy`` (what earlier calls
recorded, "recorded by an earlier call": after a ``torch.cuda.synchronize()``, the next call raises a synchronous
call's error).

A call's launch arguments are packed once per call shape (:class:`~gc_moe_compat.comm.ep_normal.NormalLaunch`, per
Buffer and thread, keyed by the sizes its fixed fields depend on), as the low-latency mode's are: a call checks its
tensors, allocates its outputs, sets its per-call fields (its tensors' addresses, its collective-op number, its
received rows and the spin timeout) and launches. Once a call shape of ``dispatch`` or ``combine`` has passed the
Python checks, its later calls check their tensors, allocate and set their addresses in one call of the compiled
host path (:mod:`._compiled_host`; an uncached dispatch in two: before notify's launch, and for the received tensors
after the CPU wait): its checks are the shape's record's, at least as strict, and at any difference the Python path
runs and raises its own errors; ``GC_MOE_DEEP_EP_HOST_PATH=python`` forces the Python path. The flags, the config,
the launch boundary, the op number, the CPU wait, the capacity checks and the launches stay Python's, in the same
order on both paths. ``GC_MOE_SPIN_TIMEOUT_MS`` and ``GC_MOE_DEEP_EP_PARTITION`` are read at every call, so a change
between two calls takes effect at the next.

Not implemented, each raising ``NotImplementedError`` naming it: groups above 8 ranks (DeepEP runs them internode over
NVSHMEM/RDMA), ``num_tokens_per_rdma_rank``, CUDA graph capture (DeepEP's calls but an uncached dispatch without
``num_worst_tokens`` make no CPU wait and can be captured; here a dispatch's or combine's op number, which its
kernels' waits compare the ranks' words with, is set on the host, so a replayed graph would repeat it). The data
region holds one call's rows at once (no chunked ring). Where a call needs more rows than it holds by a count alike on
every rank (the counts exchange tells each rank the largest need of the group; a handle keeps its dispatch's), every
rank grows its workspace in that call (at least doubling it, a ``RuntimeWarning`` naming the sizes:
:meth:`NormalMode._grow`) and runs the call again; where a rank cannot allocate that, every rank raises ``ValueError``
naming the bytes and keeps its workspace. A ``num_worst_tokens`` dispatch (no exchange before its transfer) whose rows
do not fit raises ``ValueError``. The first ``HEADER_BYTES`` hold the kernels' synchronization words and status
records, a call's exchanged counts follow (a count per rank and channel: they grow with ``config.num_sms``, which is
at most the device's SMs): a Buffer too small for them constructs, as DeepEP's does, and each of its kernel calls
raises ``ValueError`` naming ``num_nvl_bytes``, the bytes it needs and the size hint. ``topk_idx`` values are read
only by the layout kernel: an id outside ``[-1, num_experts)`` is treated as an unused slot and reported
(``DeviceCheckError``).
"""

from __future__ import annotations

import ctypes
import functools
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from cuda.bindings import driver

from gc_moe_compat.comm.ep_normal import (
    HEADER_BYTES,
    MAX_TOPK,
    THREADS,
    Entry,
    EpNormalParams,
    HostRecord,
    NormalLaunch,
    PackedKernel,
    combine_row_layout,
    data_offset,
    dispatch_row_layout,
    host_tag,
    kernel_of,
    new_host_counts,
    new_launch,
    new_status_mirror,
    raise_for_mirrored_status,
    released_word,
)
from gc_moe_compat.config import MAX_EXPERTS, MAX_SMS, boolean, integer
from gc_moe_compat.deep_ep import _compiled_host
from gc_moe_compat.deep_ep._config import (
    C_INT_MAX,
    INTERNODE_MISSING,
    MAX_LAUNCH_SHAPES,
    MAX_NVL_RANKS,
    TOPK_IDX_DTYPES,
    TOPK_IDX_RULE,
    Config,
    address_rule,
    config_field,
    recommended_config,
)
from gc_moe_compat.deep_ep._event import EventHandle, EventOverlap
from gc_moe_compat.deep_ep._parts import part, vector_aligned_starts
from gc_moe_compat.runtime.colocation import Placement, deep_ep_mode_of
from gc_moe_compat.runtime.cuda import CudaError, call
from gc_moe_compat.runtime.green import Partition, Role, get_partition
from gc_moe_compat.runtime.launch import current_stream_handle, launch_packed
from gc_moe_compat.runtime.side_launch import fork, join
from gc_moe_compat.runtime.status import (
    DeviceCheckError,
    DeviceTimeoutError,
    spin_timeout_ms,
    spin_timeout_ns,
    spin_timeout_setting,
    status_codes,
)
from gc_moe_compat.runtime.workspace import LayoutPlanner, SymmetricWorkspace, WorkspaceAllocationError, agree

__all__ = ["MAX_NVL_RANKS", "NormalHandle", "NormalMode", "combine_config", "dispatch_config"]

_COUNT_DTYPE = torch.int32
"""The dtype of ``num_tokens_per_rank`` / ``num_tokens_per_expert`` (DeepEP's): what the layout returns and the
dispatch's checks of both host paths accept."""
_MASK_DTYPE = torch.bool
"""The dtype of ``is_token_in_rank`` (the layout's output, the dispatch's input, the handle's fifth member)."""
_INDEX_DTYPE = torch.int32
"""The dtype of the handle's other members (the prefix matrices, ``recv_src_idx``, ``send_head``), as either host
path allocates and checks them."""
_WEIGHT_DTYPE = torch.float32
"""The dtype of the top-k weights: the dispatch's and the combine's input, the received and the combined ones."""
_ROW_DTYPE = torch.bfloat16
"""The dtype of the combine's rows: ``x``, the biases and ``out``."""


# DeepEP's recommended configs (deep_ep/buffers/legacy.py), as (nvl send, nvl recv, rdma send, rdma recv) chunks;
# one rank (absent from DeepEP's table) takes the two-rank entry.
_DISPATCH = {1: (24, 256, 6, 128), 2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128),
             16: (36, 288, 20, 128), 24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128),
             64: (32, 288, 8, 128), 96: (20, 480, 12, 128), 128: (20, 560, 12, 128), 144: (32, 720, 12, 128),
             160: (28, 720, 12, 128)}
_COMBINE = {1: (10, 256, 6, 128), 2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128),
            16: (4, 288, 12, 128), 24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128),
            64: (1, 288, 8, 128), 96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128),
            160: (2, 720, 8, 128)}


def _table_config(fn: str, table: dict, num_ranks: object, num_sms: int) -> Config:
    chunks = table.get(num_ranks) if type(num_ranks) is int else None
    if chunks is None:
        integer(fn, "num_ranks", num_ranks, 1)
        raise ValueError(f"{fn}: num_ranks must be one of {sorted(table)} (DeepEP's recommended configs), got "
                         f"{num_ranks}")
    return recommended_config(num_sms, chunks)


def dispatch_config(num_ranks: int, num_sms: int) -> Config:
    """DeepEP's recommended dispatch config for ``num_ranks`` with ``num_sms`` (``Buffer.num_sms``)."""
    return _table_config("get_dispatch_config", _DISPATCH, num_ranks, num_sms)


def combine_config(num_ranks: int, num_sms: int) -> Config:
    """DeepEP's recommended combine config for ``num_ranks`` with ``num_sms`` (``Buffer.num_sms``)."""
    return _table_config("get_combine_config", _COMBINE, num_ranks, num_sms)


class _HandleLayout(NamedTuple):
    """Where an uncached dispatch's four int32 matrices of the handle start in their one allocation, in bytes
    (:func:`~gc_moe_compat.deep_ep._parts.vector_aligned_starts`), and its bytes: one allocation before notify's
    launch instead of four (each about 2 us of host time on the path to notify, which every rank's notify waits
    for). ``_compiled_host.cpp`` reads the starts from the record (``handle_at``, in this order)."""

    rank_prefix: int
    channel_prefix: int
    send_head: int
    recv_channel_prefix: int
    nbytes: int

    @classmethod
    def of(cls, ranks: int, channels: int, tokens: int) -> _HandleLayout:
        """The layout of a dispatch of ``tokens`` tokens over ``ranks`` ranks and ``channels`` channels."""
        i = _INDEX_DTYPE.itemsize
        starts, nbytes = vector_aligned_starts((ranks * ranks * i, ranks * channels * i, tokens * ranks * i,
                                                ranks * channels * i))
        return cls(*starts, nbytes=nbytes)


def _received_layout(rows: int, topk: int, idx_dtype: torch.dtype | None, num_scales: int,
                     scale_dtype: torch.dtype | None) -> tuple[list[int], int]:
    """The byte starts of a dispatch's small received tensors in their one allocation, in this order:
    ``recv_src_idx``, the received top-k ids and weights (none without top-k), the FP8 scales (none for BF16); and
    its bytes. One allocation after the CPU wait instead of up to four (every host microsecond there delays the
    transfer); ``recv_x`` keeps its own, and so does ``recv_src_idx`` where it is alone (no top-k, no scales).
    ``_compiled_host.cpp``'s ``receive`` lays them out alike."""
    return vector_aligned_starts((rows * _INDEX_DTYPE.itemsize,
                                  rows * topk * idx_dtype.itemsize if topk else 0,
                                  rows * topk * _WEIGHT_DTYPE.itemsize if topk else 0,
                                  rows * num_scales * scale_dtype.itemsize if num_scales else 0))


class NormalHandle(tuple):
    """DeepEP's handle ``(rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
    is_token_in_rank, send_head)``; ``most_sent`` / ``most_recv``: the most rows any rank of the group sent /
    received in that dispatch (None after a ``num_worst_tokens`` dispatch, which does not synchronize), for the
    capacity checks of the combine / a cached dispatch, alike on every rank."""

    most_sent: int | None
    most_recv: int | None

    def __new__(cls, items: tuple, most_sent: int | None, most_recv: int | None = None) -> NormalHandle:
        handle = super().__new__(cls, items)
        handle.most_sent, handle.most_recv = most_sent, most_recv
        return handle


class _OverflowError(ValueError):
    """A call's rows do not fit the data region by a count alike on every rank (the group's busiest receiver or
    sender), so every rank meets it in the same call: the Buffer grows its workspace (:meth:`NormalMode._grow`) and
    runs the call again. ``nbytes``: the workspace the call needs; ``rows``: what did not fit, for the growth's
    warning; ``refused_op``: the op whose counts were exchanged without a transfer (0: none was started)."""

    def __init__(self, message: str, nbytes: int, rows: str, refused_op: int) -> None:
        super().__init__(message)
        self.nbytes, self.rows, self.refused_op = nbytes, rows, refused_op


class _CommEvent:
    """A CUDA event recorded on the communication green context's stream (an event of that context, as the driver
    requires), with DeepEP's ``EventHandle`` interface: the caller's current stream waits for it."""

    def __init__(self, ctx: driver.CUcontext, stream: int) -> None:
        call(driver.cuCtxPushCurrent, ctx)
        try:
            self.handle = call(driver.cuEventCreate, driver.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        finally:
            call(driver.cuCtxPopCurrent)
        call(driver.cuEventRecord, self.handle, driver.CUstream(stream))

    def current_stream_wait(self) -> None:
        """Torch's current stream waits for the event."""
        call(driver.cuStreamWaitEvent, driver.CUstream(torch.cuda.current_stream().cuda_stream), self.handle, 0)

    def done(self) -> bool:
        """Whether the recorded work has finished (no synchronization)."""
        result = driver.cuEventQuery(self.handle)[0]
        if result == driver.CUresult.CUDA_ERROR_NOT_READY:
            return False
        if result != driver.CUresult.CUDA_SUCCESS:
            call(lambda: (result,))
        return True

    def __del__(self) -> None:
        if getattr(self, "handle", None) is not None:
            driver.cuEventDestroy(self.handle)


_Event = EventHandle | _CommEvent


def _event_handle(event: object) -> driver.CUevent:
    """The driver event behind a facade event (a torch event's handle, or a communication event's)."""
    if isinstance(event, _CommEvent):
        return event.handle
    return driver.CUevent(int(event.event.cuda_event))


class _Stream:
    """Where a call's kernels run: the communication side of ``partition`` (``handle`` its stream, ``ctx`` its green
    context) or, without a partition, the caller's stream (``handle`` = ``caller``); ``stream``: ``handle`` as the
    driver's stream, for the call's launches. ``caller``: torch's current stream, looked up once per call."""

    __slots__ = ("caller", "ctx", "handle", "partition", "stream")

    def __init__(self, handle: int, ctx: driver.CUcontext | None, caller: int,
                 partition: Partition | None = None) -> None:
        self.handle, self.ctx, self.caller, self.partition = handle, ctx, caller, partition
        self.stream = driver.CUstream(handle)

    def wait(self, previous: EventOverlap | None) -> None:
        """Orders the kernels after ``previous`` (its event) or after the caller's stream so far (the partition's
        reused fork event: no event is created per call)."""
        if self.partition is None:
            if previous is not None and previous.event is not None:
                previous.event.current_stream_wait()
            return
        if previous is not None and previous.event is not None:
            call(driver.cuStreamWaitEvent, self.stream, _event_handle(previous.event), 0)
        else:
            fork(self.partition, Role.COMM, self.caller)

    def join(self) -> None:
        """Orders the caller's stream after the kernels queued so far (the partition's reused join event)."""
        if self.partition is not None:
            join(self.partition, Role.COMM, self.caller)

    def record(self) -> _Event:
        """A new event at the kernels' end, for an ``async_finish`` call's ``EventOverlap`` (DeepEP's
        ``EventHandle``)."""
        return EventHandle() if self.ctx is None else _CommEvent(self.ctx, self.handle)

    def finished(self) -> bool:
        """Whether everything queued on the stream has run (no synchronization; a CUDA error raises)."""
        result = driver.cuStreamQuery(self.stream)[0]
        if result == driver.CUresult.CUDA_ERROR_NOT_READY:
            return False
        if result != driver.CUresult.CUDA_SUCCESS:
            call(lambda: (result,))
        return True


_MAX_KEPT_STREAMS = 64
"""Caller streams whose partition-off :class:`_Stream` a Buffer keeps (past it the cache starts again)."""
CPU_WAIT_TIMEOUT_S = 100.0
"""Least seconds the uncached dispatch's CPU wait for the received counts runs before it raises (DeepEP's
``NUM_CPU_TIMEOUT_SECS``); twice the spin timeout where that is longer, so that the kernels' own bounded waits
report first."""
_POLLS_PER_QUERY = 256
"""Reads of the host record's tag between two queries of the stream (and of the clock) in that wait."""


def _wait_for_counts(fn: str, tag: np.ndarray, op: int, stream: _Stream, timeout_ns: int) -> bool:
    """DeepEP's CPU wait for the received counts: polls the host record's ``tag`` (:func:`host_tag`) until notify
    has stored ``op`` there, after the counts (True), as DeepEP polls the pinned counters its notify kernel writes;
    so the host goes on before the kernel's end and without the driver's wake-up of a stream synchronization.
    False when the stream has run dry without it (notify's wait for a peer failed: its status record says why).
    ``DeviceTimeoutError`` when neither happens within :data:`CPU_WAIT_TIMEOUT_S` (or twice ``timeout_ns``)."""
    polls, limit, deadline = 0, max(CPU_WAIT_TIMEOUT_S, 2e-9 * timeout_ns), None
    while tag[0] != op:
        polls += 1
        if polls % _POLLS_PER_QUERY:
            continue
        if stream.finished():
            return bool(tag[0] == op)
        now = time.monotonic()
        if deadline is None:
            deadline = now + limit
        elif now > deadline:
            raise DeviceTimeoutError(
                f"{fn}: the CPU wait for the received counts ran past {limit:g} s: notify has not stored this "
                "call's counts and the stream is still running (a rank of the group that does not call dispatch, "
                "or earlier work on the stream that does not finish)")
    return True


def _launch_transfer(kernels: Sequence[PackedKernel], stream: _Stream) -> None:
    """Launches ``kernels`` (a :class:`~gc_moe_compat.comm.ep_normal.NormalLaunch`'s, this call's fields set) in
    order on the call's stream: the one launch path of every normal-mode kernel."""
    for kernel, grid, block, args in kernels:
        launch_packed(kernel_of(kernel).handle, grid, block, args, stream.stream)


@functools.lru_cache(maxsize=16)
def _timeout_ns(setting: str | None) -> int:
    """The kernels' spin timeout for ``GC_MOE_SPIN_TIMEOUT_MS`` = ``setting`` (a setting that fails to convert
    raises at every call, as it is not kept)."""
    return spin_timeout_ns(spin_timeout_ms(setting))


def _tensor(fn: str, name: str, t: object, dtypes: Sequence[torch.dtype], shape: Sequence[int | None],
            device: torch.device, contiguous: bool = True, rule: str | None = None,
            vectors: bool = True) -> torch.Tensor:
    """``t`` as a tensor of one of ``dtypes`` with ``shape`` (None: any extent) on ``device``; TypeError /
    ValueError naming the argument, the rule and the value otherwise (``rule``: how the message names ``dtypes``,
    default their names). ``contiguous``: the kernels index it densely; ``vectors``: they also read it by 16-byte
    vectors, so its address must be 16-byte aligned (a tensor they read element by element, such as the routing,
    takes any row slice, as with DeepEP, its address aligned to its elements). Every call checks its tensors here:
    attribute reads and the two method calls contiguity and alignment need, the message built only for a failure."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    fits = t.dtype in dtypes and t.ndim == len(shape)
    if fits:
        for want, got in zip(shape, t.shape, strict=True):
            if want is not None and want != got:
                fits = False
    if not fits:
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{fn}: {name} must be {want} of {rule or ' or '.join(map(str, dtypes))}, got "
                         f"{list(t.shape)} {t.dtype}")
    if t.device != device:
        raise ValueError(f"{fn}: {name} must be on {device} (the Buffer's device), got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{fn}: {name} must be contiguous, got strides {t.stride()}")
    if contiguous and t.numel() and t.data_ptr() % (16 if vectors else t.element_size()):
        raise ValueError(f"{fn}: {name} must be {address_rule(vectors, t.element_size())}, got {t.data_ptr():#x}")
    return t


def _check_config(fn: str, config: object, max_sms: int) -> Config:
    """``config`` as a call reads it: a ``deep_ep.Config`` whose ``num_sms`` (read now: it may have been set after
    construction) is an even int in ``[2, max_sms]``, the SMs of the Buffer's device (a grid of ``num_sms`` CTAs, a
    communication partition of that many SMs)."""
    if not isinstance(config, Config):
        raise TypeError(f"{fn}: config must be a deep_ep.Config, got {type(config).__name__}")
    num_sms = config.num_sms
    if type(num_sms) is int and 2 <= num_sms <= max_sms and not num_sms % 2:
        return config
    num_sms = config_field(fn, config, "num_sms")
    if not 2 <= num_sms <= max_sms or num_sms % 2:
        raise ValueError(f"{fn}: config.num_sms must be an even int in [2, {max_sms}] (two SMs per channel, DeepEP's "
                         f"rule; at most the device's SMs), got {num_sms}")
    return config


def _flags(fn: str, previous_event: object, async_finish: object, allocate_on_comm_stream: object) -> None:
    if previous_event is None and async_finish is False and allocate_on_comm_stream is False:
        return
    for name, value in (("async_finish", async_finish), ("allocate_on_comm_stream", allocate_on_comm_stream)):
        if value is not True and value is not False:
            boolean(fn, name, value)
    if previous_event is not None and not isinstance(previous_event, EventOverlap):
        raise TypeError(f"{fn}: previous_event must be a deep_ep.EventOverlap or None, got "
                        f"{type(previous_event).__name__}")
    if allocate_on_comm_stream and not (previous_event is not None and async_finish):
        raise ValueError(f"{fn}: allocate_on_comm_stream=True needs a previous_event and async_finish=True (DeepEP's "
                         f"rule), got previous_event={previous_event!r}, async_finish={async_finish}")


def _x_parts(fn: str, x: object, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` as (payload, scales): BF16 ``[T, H]``, or (FP8 ``[T, H]``, FP32/int32 ``[T, S]`` of any strides that
    fit the kernels' 32-bit fields)."""
    if isinstance(x, tuple):
        if len(x) != 2:
            raise ValueError(f"{fn}: x must be a BF16 tensor or a (FP8 tensor, scales) pair, got a tuple of {len(x)}")
        payload = _tensor(fn, "x[0]", x[0], (torch.float8_e4m3fn,), (None, None), device)
        scales = _tensor(fn, "x[1]", x[1], (torch.float32, torch.int32), (payload.shape[0], None), device,
                         contiguous=False)
        if scales.shape[1] < 1:
            raise ValueError(f"{fn}: x[1] (scales) needs at least one column per token, got {list(scales.shape)}")
        token_stride, hidden_stride = scales.stride()
        if scales.shape[1] * hidden_stride >= C_INT_MAX or token_stride > C_INT_MAX:
            raise ValueError(f"{fn}: x[1] (scales) must have num_scales * hidden stride < {C_INT_MAX} (DeepEP's "
                             f"rule) and a token stride <= {C_INT_MAX} (the kernels' 32-bit strides), got "
                             f"{list(scales.shape)} with strides {scales.stride()}")
    else:
        payload, scales = _tensor(fn, "x", x, (torch.bfloat16,), (None, None), device), None
    row_bytes = payload.shape[1] * payload.dtype.itemsize
    if row_bytes % 16 or row_bytes == 0:
        raise ValueError(f"{fn}: x's hidden size in bytes must be a positive multiple of 16, got {row_bytes}")
    return payload, scales


def _set_sent(p: EpNormalParams, tokens: int, payload: torch.Tensor, scales: torch.Tensor | None,
              topk_idx: torch.Tensor | None, topk_weights: torch.Tensor | None, send_head: torch.Tensor) -> None:
    """A dispatch transfer's fields of the tokens it sends (``tokens`` of them; 0 for none, the kernels' contract
    for an empty tensor; the top-k ones 0 without ``topk_idx``)."""
    if tokens:
        p.x, p.send_head = payload.data_ptr(), send_head.data_ptr()
        p.x_scales = 0 if scales is None else scales.data_ptr()
        p.topk_idx, p.topk_weights = (0, 0) if topk_idx is None else (topk_idx.data_ptr(), topk_weights.data_ptr())
    else:
        p.x = p.send_head = p.x_scales = p.topk_idx = p.topk_weights = 0


_GROWTH_ALIGNMENT = 1 << 21
"""A grown workspace's bytes are a multiple of this (2 MiB, the driver's large-page granule)."""


def _new_workspace(group: dist.ProcessGroup, nbytes: int, device: torch.device | None = None,
                   where: Placement | None = None) -> SymmetricWorkspace:
    """The symmetric workspace of the normal mode: one region of ``nbytes`` (created collectively over ``group``,
    a failure to allocate raised on every rank alike: :class:`WorkspaceAllocationError`); ``device`` and ``where``:
    a grown one's, the first one's (None: the current device, its placement exchanged)."""
    layout = LayoutPlanner()
    layout.add("normal", nbytes)
    return SymmetricWorkspace(layout, group, device, where)


class NormalMode:
    """The normal-mode state of one Buffer: its workspace, status mirror, collective-op counter and the tensors of
    calls still running on the communication stream."""

    def __init__(self, group: dist.ProcessGroup, num_nvl_bytes: int) -> None:
        self.group = group
        self.workspace = _new_workspace(group, num_nvl_bytes)
        self.buffer = self.workspace.region("normal")
        self.ranks, self.rank = self.workspace.world_size, self.workspace.rank
        self.device = self.workspace.device
        # the largest config.num_sms: the device's SMs (MAX_SMS, no GPU has more, for a workspace off the GPU)
        self.max_sms = torch.cuda.get_device_properties(self.device).multi_processor_count \
            if self.device.type == "cuda" else MAX_SMS
        # The most CTAs one kernel of this rank fills: every SM, or its share where ranks share the GPU. DeepEP's
        # config.num_sms still sets the channels (the handle's layout); only the grid is bounded, so that the ranks'
        # spinning CTAs together fit the SMs and none waits for a peer that cannot be scheduled (at 8 ranks on one
        # H200, 8 x 24 CTAs did not, and waits timed out).
        self.grid_cap = self.workspace.sm_share if self.device.type == "cuda" else MAX_SMS
        self.mirror = new_status_mirror(self.device)
        self.codes = status_codes(self.mirror)
        self.op = 0
        self._stranded: str | None = None  # an op whose transfer never ran (see _transfers_possible)
        self._pending: list[tuple[_Event, tuple]] = []
        self._off_streams: dict[int, _Stream] = {}  # _begin's partition-off stream per caller stream handle
        self._host_counts: dict[int, tuple[torch.Tensor, np.ndarray]] = {}
        # The packed launches of each call shape (see _pack): a call checks its tensors, allocates its outputs,
        # sets its fields and launches. Beside them the compiled host path's records of the same shapes (see
        # _remember), cleared with them.
        self._launches: dict[tuple, NormalLaunch] = {}
        self._records: dict[tuple, dict[tuple, object]] = {}

    def destroy(self) -> None:
        """Waits for the calls still running on the communication stream, raises what their kernels recorded and
        no call has raised yet, and drops the workspace (also when raising)."""
        try:
            for event, _ in self._pending:
                if isinstance(event, _CommEvent):
                    call(driver.cuEventSynchronize, event.handle)
            self._pending.clear()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the synchronous calls: the caller's streams joined them
            self.raise_recorded()
        finally:
            del self.workspace, self.buffer

    def raise_recorded(self, when: str = " (recorded by an earlier call)") -> None:
        """Raises what the kernels copied into the status mirror and no call has raised yet (no synchronization)."""
        raise_for_mirrored_status(self.buffer, self.mirror, self.ranks, self.codes, when)

    # -- plumbing ---------------------------------------------------------------------------------------------------

    def _require_gpu(self, fn: str) -> None:
        """Refuses what no launch can serve: a workspace off the GPU, graph capture, an internode group."""
        if self.device.type != "cuda":
            raise RuntimeError(f"{fn}: the Buffer's workspace lives on {self.device}, not a CUDA device; running the "
                               "normal-mode kernels needs the GPU")
        if torch.cuda.is_current_stream_capturing():
            raise NotImplementedError(f"{fn}: CUDA graph capture of normal-mode calls is not implemented "
                                      "(DeepEP's calls but an uncached dispatch without num_worst_tokens make no CPU "
                                      "wait and can be captured; the facade's dispatch and combine number their "
                                      "cross-rank waits on the host, which a replay would repeat); run normal mode "
                                      "eagerly")
        if self.ranks > MAX_NVL_RANKS:
            raise NotImplementedError(f"{fn}: {INTERNODE_MISSING}")

    def _transfers_possible(self, fn: str) -> None:
        """A dispatch refused after its counts exchange (every rank refuses it alike) ran notify for its op but no
        transfer, and a transfer publishes the op's ``released`` words that every later transfer waits for; the host
        stores them instead (:meth:`_release`). Where they were not stored (that store, or the growth before it,
        failed), the transfers of this Buffer raise ``RuntimeError`` naming the op instead of waiting until they
        time out."""
        if self._stranded is not None:
            raise RuntimeError(f"{fn}: this Buffer's normal mode cannot transfer again: an earlier call was refused "
                               f"after its counts were exchanged ({self._stranded}), and that op's 'released' words, "
                               "which the next transfer waits for, were not stored; create a new Buffer")

    def _growing(self, fn: str, run: Callable[..., tuple], args: tuple) -> tuple:
        """``run(*args)``; where its rows do not fit the workspace by a count alike on every rank, the workspace
        grows on every rank (:meth:`_grow`) and the call runs again, a ``RuntimeWarning`` naming the sizes once it
        has. The grown workspace holds the call's rows, so a second overflow is a protocol error: its op, if its
        counts were exchanged, then stops the Buffer's transfers by name (:meth:`_transfers_possible`)."""
        try:
            return run(*args)
        except _OverflowError as overflow:
            grown = self._grow(fn, overflow)
        try:
            result = run(*args)
        except _OverflowError as overflow:
            if overflow.refused_op:
                self._stranded = f"{fn} op {overflow.refused_op}: {overflow} (after a growth)"
            raise
        warnings.warn(grown, RuntimeWarning, stacklevel=4)
        return result

    def _grow(self, fn: str, overflow: _OverflowError) -> str:
        """Replaces the workspace by one of at least twice the bytes that holds ``overflow``'s call, on every rank in
        the same call (the count that overflowed is alike on every rank); returns the warning naming both sizes:
        where DeepEP streams any count through its chunked queues, the facade's data region holds a call's rows at
        once. First each rank synchronizes its device (no kernel of this Buffer runs, on any stream) and raises what
        its kernels recorded; the ranks agree on that before any creates the new workspace (each waits there for
        the others, so every rank's notify has ended), so an error of one rank makes every rank raise instead of
        waiting for it: that rank its own error, the others ``ValueError`` naming it. The new workspace's words start
        again from op 0, and every packed launch (its peer table, its capacity) and host record (its tag) is dropped.
        Where a rank cannot allocate it, every rank raises ``ValueError`` (the call's message, then the
        allocation's) and keeps its workspace. Either way a refused op (one whose counts were exchanged) is released
        first (:meth:`_release`); where the growth fails otherwise, the op stops the Buffer's transfers by name.
        A workspace off the GPU (or a capture) is refused first, as at a launch."""
        self._require_gpu(fn)
        local: Exception | None = None
        try:
            for event, _ in self._pending:
                if isinstance(event, _CommEvent):
                    call(driver.cuEventSynchronize, event.handle)
            self._pending.clear()
            torch.cuda.synchronize(self.device)
            self.raise_recorded()
        except Exception as exc:  # raised after the agreement, so that no peer waits for this rank
            local = exc
        old = self.buffer.numel()
        nbytes = -(-max(2 * old, overflow.nbytes) // _GROWTH_ALIGNMENT) * _GROWTH_ALIGNMENT
        try:
            agree(self.group, f"prepare a growth of the normal mode's workspace to {nbytes} bytes", None,
                  None if local is None else f"{type(local).__name__}: {local}")
            workspace = _new_workspace(self.group, nbytes, self.device, self.workspace.placement)
        except WorkspaceAllocationError as exc:
            if overflow.refused_op:
                try:
                    self._release(overflow.refused_op)
                except CudaError:  # the op now stops the transfers by name; this rank's own error says more
                    if local is None:
                        raise
            if local is not None:
                raise local from exc
            raise ValueError(f"{overflow}; growing the workspace to {nbytes} bytes failed: {exc}") from exc
        except BaseException:
            if overflow.refused_op:
                self._stranded = f"{fn} op {overflow.refused_op}: {overflow} (its workspace's growth failed)"
            raise
        self.workspace, self.buffer, self.op, self._stranded = workspace, workspace.region("normal"), 0, None
        self._launches.clear()
        self._records.clear()
        self._host_counts.clear()
        return (f"{overflow.rows} did not fit the normal mode's workspace, which grew from {old} to {nbytes} bytes "
                "on every rank (the facade has no chunked queue: a call's rows are in the workspace at once); a "
                "num_nvl_bytes that holds the largest call avoids the growth and its device synchronization")

    def _release(self, op: int) -> None:
        """Stores ``op`` into this rank's ``released`` word of every rank's copy
        (:func:`~gc_moe_compat.comm.ep_normal.released_word`), as the op's receive half would have, for a dispatch
        refused on every rank after its counts exchange: no rank wrote or reads a row of it, and the Buffer's next
        transfer waits for every rank's word of ``op``. Called once the group has agreed on the refusal (every
        rank's notify of ``op`` has ended). Where a store fails, the Buffer's transfers raise naming the op
        (:meth:`_transfers_possible`) and so does this."""
        try:
            stream = driver.CUstream(current_stream_handle(self.device))
            table, word = self.workspace.peer_table, released_word(self.rank)
            for r in range(self.ranks):
                address = table.base + table.offsets[r] + word
                call(driver.cuMemsetD32Async, address, op & 0xFFFFFFFF, 1, stream)
                call(driver.cuMemsetD32Async, address + 4, op >> 32, 1, stream)
            call(driver.cuStreamSynchronize, stream)
        except CudaError:
            self._stranded = f"dispatch op {op}: storing its 'released' words failed"
            raise

    def _begin(self, fn: str, num_sms: int) -> _Stream:
        """Where a checked call's kernels run (the launch boundary: :meth:`_require_gpu`, then what earlier calls
        recorded is raised). Partition off, the caller's stream, its :class:`_Stream` (stateless) kept per handle."""
        self._require_gpu(fn)
        self.raise_recorded()
        if self._pending:
            self._pending = [(e, t) for e, t in self._pending if not (isinstance(e, _CommEvent) and e.done())]
        caller = current_stream_handle(self.device)
        if deep_ep_mode_of(self.workspace.placement) == "off":
            stream = self._off_streams.get(caller)
            if stream is None:
                if len(self._off_streams) >= _MAX_KEPT_STREAMS:
                    self._off_streams.clear()
                stream = self._off_streams[caller] = _Stream(caller, None, caller)
            return stream
        partition = get_partition(num_sms, self.device.index)
        side = partition.comm
        return _Stream(int(side.stream), side.ctx, caller, partition)

    def _finish(self, stream: _Stream, async_finish: bool, tensors: tuple) -> EventOverlap:
        """A synchronous call: the caller's stream waits for the kernels (no CPU wait; errors surface through the
        mirror). An ``async_finish`` call: its event, and ``tensors`` kept until the event completes (the kernels run
        on the communication stream, the caller's stream does not wait for them)."""
        if not async_finish:
            stream.join()
            return EventOverlap(None)
        event = stream.record()
        if stream.ctx is not None:
            self._pending.append((event, tensors))
        return EventOverlap(event)

    def _pack(self, key: tuple, kernels: Sequence[tuple[Entry, int, int]], *fields: dict) -> NormalLaunch:
        """New packed launches for the calls of ``key`` (:func:`~gc_moe_compat.comm.ep_normal.new_launch`: the peer
        table, the status mirror, grids bounded by :attr:`grid_cap`), kept for them. The key holds the calling
        thread and every size the fixed fields depend on; past ``MAX_LAUNCH_SHAPES`` the cache starts again."""
        mirror = self.mirror.data_ptr()
        launch = new_launch(self.workspace.peer_table, kernels, [{**f, "status_mirror": mirror} for f in fields],
                            self.grid_cap)
        if len(self._launches) >= MAX_LAUNCH_SHAPES:
            self._launches.clear()
            self._records.clear()
        self._launches[key] = launch
        return launch

    def _remember(self, kinds: tuple, record: object) -> None:
        """Keeps the compiled host path's ``record`` of a call shape the Python path just checked (unless one of its
        key is kept): among the records of the calls of ``kinds`` = ``(kind, config.num_sms, ints...)`` on this
        thread (the kind: ``"dispatch"``, ``"cached"`` or ``"combine"``; the ints: a dispatch's
        ``expert_alignment`` and ``num_worst_tokens``, looked up only as exact ints), by ``record.key``: what the
        extension reads off a call's tensors to find it."""
        kind, *sizes = kinds
        records = self._records.setdefault((kind, threading.get_ident(), *sizes), {})
        records.setdefault(record.key, record)

    def _new_host_record(self, local: int) -> tuple[torch.Tensor, np.ndarray]:
        """The host record of uncached dispatches with ``local`` experts per rank and its tag, kept for them."""
        record = new_host_counts(local, self.device)
        self._host_counts[local] = record, host_tag(record)
        return self._host_counts[local]

    def _next_op(self) -> int:
        self.op += 1
        return self.op

    def _room(self, fn: str, need: int, what: str) -> None:
        """``num_nvl_bytes`` holds ``need`` bytes (``what``: the fixed header the kernels keep their words and status
        records in, then a call's exchanged counts), else ``ValueError`` naming it, the minimum and the size hint. A
        smaller Buffer constructs, as DeepEP's does (the raw-buffer view needs no header); its kernel calls refuse."""
        if self.buffer.numel() < need:
            raise ValueError(f"{fn}: num_nvl_bytes must be >= {need} ({what}), got {self.buffer.numel()}; size it with "
                             "Config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks) of the dispatch and combine "
                             "configs (Buffer.get_dispatch_config / get_combine_config)")

    def _counts_room(self, fn: str, data: int, local: int, num_sms: int) -> None:
        """The header and a call's exchanged counts fit before the data region (at byte ``data``): the counts grow
        with the ranks, the ``local`` experts per rank and ``config.num_sms`` (a count per rank and channel)."""
        self._room(fn, data, f"the {HEADER_BYTES}-byte header and this call's counts for {self.ranks} rank(s), "
                   f"{local} local expert(s) and config.num_sms={num_sms} ({num_sms // 2} channels)")

    def _capacity(self, transient_data: int, row_stride: int) -> int:
        return max(0, (self.buffer.numel() - transient_data) // row_stride)

    def _need(self, fn: str, rows: int, launch: NormalLaunch, what: str, refused_op: int | None = None) -> None:
        """The data region of ``launch``'s calls holds ``rows`` rows, else ``ValueError`` naming the bytes. With
        ``refused_op`` (``rows`` is alike on every rank; the op whose counts were exchanged, 0 for none) the error
        is an :class:`_OverflowError`, on which the Buffer grows its workspace and runs the call again. At one rank
        nothing is needed: the kernels copy between the caller's tensors there, without the data region
        (kernels/sm90/ep_normal.cu: dispatch_direct, combine_direct)."""
        if self.ranks == 1:
            return
        params = launch.params[-1]
        if rows > params.data_rows:
            stride, data = params.row_stride, params.off_data
            message = (f"{fn}: num_nvl_bytes must hold {what} at once: {rows} rows of {stride} bytes after {data} "
                       f"header bytes = {data + rows * stride} bytes, the Buffer has {self.buffer.numel()} (the "
                       "facade has no chunked queue: a Buffer sized by Config.get_nvl_buffer_size_hint holds at "
                       "least num_sms / 2 * ranks * num_max_nvl_chunked_recv_tokens rows; SGLang's --deepep-config "
                       "sets those)")
            if refused_op is None:
                raise ValueError(message)
            raise _OverflowError(message, data + rows * stride, f"{fn}: {what} ({rows} rows of {stride} bytes)",
                                 refused_op)

    # -- get_dispatch_layout ----------------------------------------------------------------------------------------

    def _topk_idx(self, fn: str, topk_idx: object, tokens: int | None = None) -> torch.Tensor:
        topk_idx = _tensor(fn, "topk_idx", topk_idx, TOPK_IDX_DTYPES, (tokens, None), self.device,
                           rule=TOPK_IDX_RULE, vectors=False)
        if not 1 <= topk_idx.shape[1] <= MAX_TOPK:
            raise ValueError(f"{fn}: topk_idx must have 1 to {MAX_TOPK} columns (top-k), got {topk_idx.shape[1]}")
        return topk_idx

    def _handle(self, fn: str, handle: object, source: str, config: Config) -> NormalHandle:
        """``handle`` checked as what an uncached dispatch of this group over ``config``'s channels returns: DeepEP's
        six tensors (the kernels index them densely by this group's ranks), on the Buffer's device. ``source``: what
        the message calls that dispatch. A handle of another Buffer of the same group serves, as with DeepEP (it
        holds the routing only; the rows it needs are checked against this Buffer's bytes)."""
        if not isinstance(handle, NormalHandle):
            raise TypeError(f"{fn}: handle must be the handle {source} returned, got {type(handle).__name__}")
        if len(handle) != 6:
            raise ValueError(f"{fn}: handle must hold the dispatch's 6 tensors (DeepEP's handle), got {len(handle)}")
        ranks, i32 = self.ranks, (_INDEX_DTYPE,)
        _tensor(fn, "handle[0] (rank_prefix_matrix)", handle[0], i32, (ranks, ranks), self.device)
        channel_prefix = _tensor(fn, "handle[1] (channel_prefix_matrix)", handle[1], i32, (ranks, None), self.device)
        if channel_prefix.shape[1] != config.num_sms // 2:
            raise ValueError(f"{fn}: config.num_sms must be the dispatch's (2 x {channel_prefix.shape[1]} channels), "
                             f"got {config.num_sms}")
        _tensor(fn, "handle[2] (recv_channel_prefix_matrix)", handle[2], i32, (ranks, channel_prefix.shape[1]),
                self.device)
        _tensor(fn, "handle[3] (recv_src_idx)", handle[3], i32, (None,), self.device)
        in_rank = _tensor(fn, "handle[4] (is_token_in_rank)", handle[4], (_MASK_DTYPE,), (None, ranks), self.device,
                          vectors=False)  # the dispatch's is_token_in_rank itself, any row slice
        _tensor(fn, "handle[5] (send_head)", handle[5], i32, (in_rank.shape[0], ranks), self.device)
        for name, most in (("most_sent", "sent"), ("most_recv", "received")):
            value = getattr(handle, name)
            if value is not None:  # None: a num_worst_tokens dispatch's (no CPU wait, so no count)
                integer(fn, f"handle.{name} (the rows the dispatch's busiest rank {most})", value, 0, C_INT_MAX)
        return handle

    def _experts(self, fn: str, arg: str, num_experts: object) -> int:
        integer(fn, arg, num_experts, 1, MAX_EXPERTS)
        if num_experts % self.ranks:
            raise ValueError(f"{fn}: {arg} must be a multiple of the group size {self.ranks}, got {num_experts}")
        return num_experts

    def _layout_launch(self, fn: str, key: tuple) -> NormalLaunch:
        """The layout's launch for ``key`` = ``("layout", thread, tokens, topk, experts, num_sms)``
        (checked: the fixed header fits), packed now unless kept."""
        launch = self._launches.get(key)
        if launch is not None:
            return launch
        _, _, tokens, topk, experts, num_sms = key
        self._room(fn, HEADER_BYTES, "the fixed header: the kernels' synchronization words, status records and the "
                   "layout's histogram")
        local = experts // self.ranks
        fields = dict(transient=data_offset(self.ranks, local, 1), data_rows=0, num_tokens=tokens, topk=topk,
                      num_experts=experts, local_experts=local)
        return self._pack(key, ((Entry.LAYOUT, min(num_sms, -(-tokens // THREADS)), 0),), fields)  # a token a thread

    def get_dispatch_layout(self, topk_idx: object, num_experts: object, previous_event: EventOverlap | None,
                            async_finish: bool, allocate_on_comm_stream: bool, num_sms: int) -> tuple:
        fn = "get_dispatch_layout"
        _flags(fn, previous_event, async_finish, allocate_on_comm_stream)
        topk_idx = self._topk_idx(fn, topk_idx)
        experts = self._experts(fn, "num_experts", num_experts)
        tokens, topk = topk_idx.shape
        launch = self._layout_launch(fn, ("layout", threading.get_ident(), tokens, topk, experts, num_sms))
        stream = self._begin(fn, num_sms)
        per_rank = torch.empty(self.ranks, dtype=_COUNT_DTYPE, device=self.device)
        per_expert = torch.empty(experts, dtype=_COUNT_DTYPE, device=self.device)
        in_rank = torch.empty(tokens, self.ranks, dtype=_MASK_DTYPE, device=self.device)
        # A pointer field is 0 for an empty tensor (the kernels' contract): here, exactly when there are no tokens.
        p = launch.params[0]
        p.timeout_ns = _timeout_ns(spin_timeout_setting())
        p.topk_idx, p.is_token_in_rank = (topk_idx.data_ptr(), in_rank.data_ptr()) if tokens else (0, 0)
        p.num_tokens_per_rank, p.num_tokens_per_expert = per_rank.data_ptr(), per_expert.data_ptr()
        stream.wait(previous_event)
        _launch_transfer(launch.kernels, stream)
        event = self._finish(stream, async_finish, (topk_idx, per_rank, per_expert, in_rank))
        return per_rank, None, per_expert, in_rank, event

    # -- dispatch ---------------------------------------------------------------------------------------------------

    def _dispatch_launch(self, fn: str, key: tuple) -> NormalLaunch:
        """A dispatch's launches for ``key`` = ``("dispatch", thread, cached, tokens, hidden, payload element size,
        scales, topk, experts, channels, expert_alignment)`` (``scales``: their columns, token stride and
        column stride, zeros without; a cached dispatch's experts: the ranks), checked (the header and the counts
        fit) and packed now unless kept: notify (uncached: its own parameters), then the dispatch kernel."""
        launch = self._launches.get(key)
        if launch is not None:
            return launch
        _, _, cached, tokens, hidden, elsize, scales, topk, experts, channels, expert_alignment = key
        local = experts // self.ranks
        transient = data_offset(self.ranks, local, channels)
        self._counts_room(fn, transient.data, local, 2 * channels)
        row = dispatch_row_layout(hidden * elsize, scales[0], topk)
        common = dict(transient=transient, data_rows=self._capacity(transient.data, row.stride), num_tokens=tokens,
                      num_channels=channels, num_experts=experts, local_experts=local)
        transfer = dict(**common, hidden=hidden, row_bytes=hidden * elsize, row_stride=row.stride,
                        off_row_scales=row.scales, off_row_topk=row.topk, num_scales=scales[0],
                        scale_token_stride=scales[1], scale_hidden_stride=scales[2], topk=topk)
        sms = 2 * channels
        if cached:
            return self._pack(key, ((Entry.DISPATCH, sms, 0),), transfer)
        kernels = ((Entry.NOTIFY, 1 + -(-self.ranks * channels // 8), 0), (Entry.DISPATCH, sms, 1))
        return self._pack(key, kernels, dict(**common, expert_alignment=expert_alignment), transfer)

    def dispatch(self, x: object, handle: object, num_tokens_per_rank: object, num_tokens_per_rdma_rank: object,
                 is_token_in_rank: object, num_tokens_per_expert: object, topk_idx: object, topk_weights: object,
                 expert_alignment: object, num_worst_tokens: object, config: Config, previous_event: object,
                 async_finish: bool, allocate_on_comm_stream: bool) -> tuple:
        """DeepEP's intranode dispatch (:meth:`_dispatch`), run again on a grown workspace where the group's
        busiest receiver's rows do not fit it (:meth:`_grow`)."""
        return self._growing("dispatch", self._dispatch, (
            x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert,
            topk_idx, topk_weights, expert_alignment, num_worst_tokens, config, previous_event, async_finish,
            allocate_on_comm_stream))

    def _dispatch(self, x: object, handle: object, num_tokens_per_rank: object, num_tokens_per_rdma_rank: object,
                  is_token_in_rank: object, num_tokens_per_expert: object, topk_idx: object, topk_weights: object,
                  expert_alignment: object, num_worst_tokens: object, config: Config, previous_event: object,
                  async_finish: bool, allocate_on_comm_stream: bool) -> tuple:
        """DeepEP's intranode dispatch (uncached without ``handle``, cached with it). After the flags and the config,
        a call shape that passed the Python checks before takes the compiled host path (its checks against the
        shape's record, its allocations and the stores into the packed launches in one C++ call; an uncached
        dispatch's received tensors in a second one after the CPU wait); at any difference the Python path runs
        from there, so a call raises its errors in their order."""
        fn = "dispatch"
        _flags(fn, previous_event, async_finish, allocate_on_comm_stream)
        config = _check_config(fn, config, self.max_sms)
        fast = _compiled_host.compiled()
        made = None
        if fast is not None and num_tokens_per_rdma_rank is None and type(expert_alignment) is int and \
                type(num_worst_tokens) is int:
            if handle is None:
                records = self._records.get(("dispatch", threading.get_ident(), config.num_sms, expert_alignment,
                                             num_worst_tokens))
                if records is not None:
                    made = fast.normal_dispatch(records, x, num_tokens_per_rank, is_token_in_rank,
                                                num_tokens_per_expert, topk_idx, topk_weights)
            elif type(handle) is NormalHandle and topk_idx is None and topk_weights is None and \
                    (handle.most_recv is None or (type(handle.most_recv) is int and
                                                  0 <= handle.most_recv <= C_INT_MAX)):
                records = self._records.get(("cached", threading.get_ident(), config.num_sms, expert_alignment,
                                             num_worst_tokens))
                if records is not None:
                    made = fast.normal_cached_dispatch(records, x, handle, handle.most_sent)
        if made is None:
            made = self._checked_dispatch(fn, fast, x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank,
                                          is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                                          expert_alignment, num_worst_tokens, config)
        if handle is None:
            return self._uncached_dispatch(fn, fast, made, num_worst_tokens, config, previous_event, async_finish)
        launch, payload, scales, recv_x, recv_scales, recv_src_idx = made
        if handle.most_recv is not None:
            self._need(fn, handle.most_recv, launch, "the rows the busiest rank of the group receives", refused_op=0)
        self._transfers_possible(fn)
        stream = self._begin(fn, config.num_sms)
        op = self._next_op()
        stream.wait(previous_event)
        p = launch.params[-1]
        p.timeout_ns, p.op = _timeout_ns(spin_timeout_setting()), op
        _launch_transfer(launch.kernels, stream)
        event = self._finish(stream, async_finish, (payload, scales, handle, recv_x, recv_scales, recv_src_idx))
        return (recv_x if scales is None else (recv_x, recv_scales)), None, None, None, None, event

    def _checked_dispatch(self, fn: str, fast: ModuleType | None, x: object, handle: object,
                          num_tokens_per_rank: object, num_tokens_per_rdma_rank: object, is_token_in_rank: object,
                          num_tokens_per_expert: object, topk_idx: object, topk_weights: object,
                          expert_alignment: object, num_worst_tokens: object, config: Config) -> tuple:
        """The Python host path of a dispatch after its flags and config: checks its arguments (raising what a bad
        one breaks), finds or packs the shape's launches, allocates and sets in them what does not depend on the
        received count (all of a cached dispatch's, whose received rows are the handle's) and, with the compiled
        module (``fast``), records the call shape for its later calls. Returns what the compiled path returns (an
        uncached dispatch's record: None, so its received tensors are the Python path's too)."""
        channels = config.num_sms // 2
        payload, scales = _x_parts(fn, x, self.device)
        tokens, hidden = payload.shape
        integer(fn, "expert_alignment", expert_alignment, 1, 1 << 20)
        integer(fn, "num_worst_tokens", num_worst_tokens, 0, C_INT_MAX)
        if num_tokens_per_rdma_rank is not None:
            raise NotImplementedError(f"{fn}: num_tokens_per_rdma_rank (internode dispatch over NVSHMEM/RDMA) is not "
                                      "implemented; pass the None get_dispatch_layout returns")
        cached = handle is not None
        if cached:
            rank_prefix, channel_prefix, _, handle_src_idx, in_rank, send_head = self._handle(
                fn, handle, "an uncached dispatch", config)
            if topk_idx is not None or topk_weights is not None:
                raise ValueError(f"{fn}: a cached dispatch (handle=...) takes no topk_idx / topk_weights (DeepEP's "
                                 "rule); they were given")
            if send_head.shape != (tokens, self.ranks):
                raise ValueError(f"{fn}: x must have the handle's {send_head.shape[0]} tokens, got {tokens}")
            experts, topk = self.ranks, 0
        else:
            for name, value in (("num_tokens_per_rank", num_tokens_per_rank), ("is_token_in_rank", is_token_in_rank),
                                ("num_tokens_per_expert", num_tokens_per_expert)):
                if value is None:
                    raise ValueError(f"{fn}: an uncached dispatch needs {name} (from get_dispatch_layout), got None")
            _tensor(fn, "num_tokens_per_rank", num_tokens_per_rank, (_COUNT_DTYPE,), (self.ranks,), self.device,
                    vectors=False)
            in_rank = _tensor(fn, "is_token_in_rank", is_token_in_rank, (_MASK_DTYPE,), (tokens, self.ranks),
                              self.device, vectors=False)
            _tensor(fn, "num_tokens_per_expert", num_tokens_per_expert, (_COUNT_DTYPE,), (None,), self.device,
                    vectors=False)
            experts = self._experts(fn, "num_tokens_per_expert.shape[0]", num_tokens_per_expert.shape[0])
            if (topk_idx is None) != (topk_weights is None):
                raise ValueError(f"{fn}: topk_idx and topk_weights go together (DeepEP's rule), got "
                                 f"topk_idx={'None' if topk_idx is None else 'a tensor'}, "
                                 f"topk_weights={'None' if topk_weights is None else 'a tensor'}")
            topk = 0
            if topk_idx is not None:
                topk_idx = self._topk_idx(fn, topk_idx, tokens)
                topk = topk_idx.shape[1]
                topk_weights = _tensor(fn, "topk_weights", topk_weights, (_WEIGHT_DTYPE,), (tokens, topk),
                                       self.device, vectors=False)
            if num_worst_tokens and topk_idx is None:
                raise ValueError(f"{fn}: num_worst_tokens > 0 needs topk_idx and topk_weights (DeepEP's rule), got "
                                 f"num_worst_tokens={num_worst_tokens} without them")
        local = experts // self.ranks
        scale_layout = (0, 0, 0) if scales is None else (scales.shape[1], *scales.stride())
        launch = self._dispatch_launch(fn, (
            "dispatch", threading.get_ident(), cached, tokens, hidden, payload.dtype.itemsize, scale_layout, topk,
            experts, channels, expert_alignment))
        # A pointer field is 0 for an empty tensor (the kernels' contract): each tensor here is empty exactly when
        # its tokens (or received rows) are none (its other extents are positive).
        p = launch.params[-1]
        if cached:
            recv_x, recv_scales, recv_src_idx, _, _ = self._received(launch, payload, scales, None,
                                                                     handle_src_idx.shape[0])
            p.rank_prefix, p.channel_prefix = rank_prefix.data_ptr(), channel_prefix.data_ptr()
            p.recv_channel_prefix = 0
            _set_sent(p, tokens, payload, scales, None, None, send_head)
            host = tag = None
        else:
            handle_at = _HandleLayout.of(self.ranks, channels, tokens)
            block = torch.empty(handle_at.nbytes, dtype=torch.uint8, device=self.device)
            rank_prefix = part(block, _INDEX_DTYPE, handle_at.rank_prefix, (self.ranks, self.ranks))
            channel_prefix = part(block, _INDEX_DTYPE, handle_at.channel_prefix, (self.ranks, channels))
            send_head = part(block, _INDEX_DTYPE, handle_at.send_head, (tokens, self.ranks))
            recv_channel_prefix = part(block, _INDEX_DTYPE, handle_at.recv_channel_prefix, (self.ranks, channels))
            # The transfer's fields that do not depend on the received count are set before notify's launch, so
            # that after the CPU wait only the received tensors are allocated and pointed to: every host
            # microsecond there delays the transfer (DeepEP's C++ does only that much after its wait).
            p.rank_prefix, p.channel_prefix = rank_prefix.data_ptr(), channel_prefix.data_ptr()
            p.recv_channel_prefix = recv_channel_prefix.data_ptr()
            _set_sent(p, tokens, payload, scales, topk_idx, topk_weights, send_head)
            host, tag = self._host_counts.get(local) or self._new_host_record(local)
            n = launch.params[0]
            n.host_counts = host.data_ptr()
            n.num_tokens_per_rank, n.num_tokens_per_expert = (num_tokens_per_rank.data_ptr(),
                                                              num_tokens_per_expert.data_ptr())
            n.is_token_in_rank, n.send_head = (in_rank.data_ptr(), send_head.data_ptr()) if tokens else (0, 0)
            n.rank_prefix, n.channel_prefix = rank_prefix.data_ptr(), channel_prefix.data_ptr()
        if fast is not None:  # the record holds the dtypes this call checked and allocated
            self._remember(("cached" if cached else "dispatch", config.num_sms, expert_alignment, num_worst_tokens),
                           fast.NormalDispatchRecord(
                               launch=launch, host=host, tag=tag,
                               notify_params=0 if cached else ctypes.addressof(launch.params[0]),
                               params=ctypes.addressof(p), host_counts=0 if cached else host.data_ptr(),
                               device=self.device, cached=cached, ranks=self.ranks, channels=channels, tokens=tokens,
                               hidden=hidden, experts=experts, topk=topk, num_scales=scale_layout[0],
                               scale_token_stride=scale_layout[1], scale_hidden_stride=scale_layout[2],
                               x_dtype=payload.dtype, scale_dtype=None if scales is None else scales.dtype,
                               idx_dtype=None if topk_idx is None else topk_idx.dtype, count_dtype=_COUNT_DTYPE,
                               mask_dtype=_MASK_DTYPE, index_dtype=_INDEX_DTYPE, weight_dtype=_WEIGHT_DTYPE,
                               handle_at=() if cached else handle_at))
        if cached:
            return launch, payload, scales, recv_x, recv_scales, recv_src_idx
        return (launch, None, host, tag, local, payload, scales, topk_idx, topk_weights, in_rank, rank_prefix,
                channel_prefix, send_head, recv_channel_prefix)

    def _received(self, launch: NormalLaunch, payload: torch.Tensor, scales: torch.Tensor | None,
                  topk_idx: torch.Tensor | None, rows: int) -> tuple:
        """The Python host path's received tensors of a dispatch receiving ``rows`` rows (``recv_x``, its scales,
        ``recv_src_idx``, the top-k ids and weights; None where the call has none), their addresses and the row
        count set in the transfer's parameters. ``recv_x`` is an allocation of its own, the others parts of one
        (:func:`_received_layout`) unless ``recv_src_idx`` is alone."""
        topk = 0 if topk_idx is None else topk_idx.shape[1]
        num_scales = 0 if scales is None else scales.shape[1]
        recv_x = torch.empty(rows, payload.shape[1], dtype=payload.dtype, device=self.device)
        if topk or num_scales:
            at, nbytes = _received_layout(rows, topk, None if topk_idx is None else topk_idx.dtype,
                                          num_scales, None if scales is None else scales.dtype)
            block = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            recv_src_idx = part(block, _INDEX_DTYPE, at[0], (rows,))
        else:  # alone: an allocation of its own (a part of one would add work, save none)
            recv_src_idx = torch.empty(rows, dtype=_INDEX_DTYPE, device=self.device)
        recv_scales = None if scales is None else part(block, scales.dtype, at[3], (rows, num_scales))
        recv_topk_idx = recv_topk_weights = None
        if topk_idx is not None:
            recv_topk_idx = part(block, topk_idx.dtype, at[1], (rows, topk))
            recv_topk_weights = part(block, _WEIGHT_DTYPE, at[2], (rows, topk))
        p = launch.params[-1]
        p.recv_rows = rows
        if rows:
            p.recv_x, p.recv_src_idx = recv_x.data_ptr(), recv_src_idx.data_ptr()
            p.recv_scales = 0 if scales is None else recv_scales.data_ptr()
            p.recv_topk_idx, p.recv_topk_weights = (recv_topk_idx.data_ptr(), recv_topk_weights.data_ptr()) \
                if topk_idx is not None else (0, 0)
        else:
            p.recv_x = p.recv_src_idx = p.recv_scales = p.recv_topk_idx = p.recv_topk_weights = 0
        return recv_x, recv_scales, recv_src_idx, recv_topk_idx, recv_topk_weights

    def _uncached_dispatch(self, fn: str, fast: ModuleType | None, made: tuple, num_worst_tokens: int,
                           config: Config, previous_event: EventOverlap | None, async_finish: bool) -> tuple:
        """An uncached dispatch once either host path has checked it and set its count-independent fields
        (``made``): notify's launch, the CPU wait for the received count (none with ``num_worst_tokens``), the
        received tensors (the compiled path's where ``made`` holds a record), the transfer's launch."""
        (launch, record, host, tag, local, payload, scales, topk_idx, topk_weights, in_rank, rank_prefix,
         channel_prefix, send_head, recv_channel_prefix) = made
        if num_worst_tokens:
            self._need(fn, num_worst_tokens, launch, "num_worst_tokens received rows")
        self._transfers_possible(fn)
        stream = self._begin(fn, config.num_sms)
        op = self._next_op()
        stream.wait(previous_event)
        timeout = _timeout_ns(spin_timeout_setting())
        n, p = launch.params
        n.timeout_ns = p.timeout_ns = timeout
        n.op = p.op = op
        _launch_transfer(launch.kernels[:1], stream)
        expert_list: list[int] = []
        if num_worst_tokens:
            num_recv, most_recv, most_sent = num_worst_tokens, None, None
        else:
            if not _wait_for_counts(fn, tag, op, stream, timeout):
                self.raise_recorded(when="")  # the stream ran dry: notify copied this call's records
                raise DeviceCheckError(f"{fn}: the notify kernel finished without storing the received counts "
                                       "and recorded no error (a protocol error of the facade)")
            counts = host.tolist()
            num_recv, most_recv, most_sent = (counts[HostRecord.RECV], counts[HostRecord.MOST_RECV],
                                              counts[HostRecord.MOST_SENT])
            expert_list = counts[HostRecord.EXPERTS:HostRecord.EXPERTS + local]
            try:  # before this rank's own errors: every rank must meet the group's overflow (see _grow)
                self._need(fn, most_recv, launch, "the rows the busiest rank of the group receives", refused_op=op)
            except _OverflowError:
                stream.join()  # notify's stream joins the caller's
                raise
            self.raise_recorded()  # what earlier calls recorded (notify's own wait succeeded)
        received = None if record is None else fast.normal_received(record, num_recv)
        if received is None:  # the Python path's call, or an allocation the compiled one could not make
            received = self._received(launch, payload, scales, topk_idx, num_recv)
        recv_x, recv_scales, recv_src_idx, recv_topk_idx, recv_topk_weights = received
        _launch_transfer(launch.kernels[1:], stream)
        event = self._finish(stream, async_finish,
                             (payload, scales, topk_idx, topk_weights, in_rank, rank_prefix, channel_prefix, send_head,
                              recv_x, recv_scales, recv_src_idx, recv_topk_idx, recv_topk_weights,
                              recv_channel_prefix))
        new_handle = NormalHandle((rank_prefix, channel_prefix, recv_channel_prefix, recv_src_idx, in_rank, send_head),
                                  most_sent, most_recv)
        return (recv_x if scales is None else (recv_x, recv_scales)), recv_topk_idx, recv_topk_weights, expert_list, \
            new_handle, event

    # -- combine ----------------------------------------------------------------------------------------------------

    def _combine_launch(self, fn: str, key: tuple) -> NormalLaunch:
        """A combine's launches for ``key`` = ``("combine", thread, tokens, hidden, topk, channels)`` (checked: the
        header and the counts fit), packed now unless kept."""
        launch = self._launches.get(key)
        if launch is not None:
            return launch
        _, _, tokens, hidden, topk, channels = key
        transient = data_offset(self.ranks, 1, channels)
        self._counts_room(fn, transient.data, 1, 2 * channels)
        row = combine_row_layout(2 * hidden, topk)
        fields = dict(transient=transient, data_rows=self._capacity(transient.data, row.stride), num_tokens=tokens,
                      hidden=hidden, row_bytes=2 * hidden, row_stride=row.stride, off_row_topk=row.topk, topk=topk,
                      num_channels=channels)
        # one launch: its CTAs first make DeepEP's in-place rewrite of the caller's send_head (a warp per channel
        # and rank), which the receive half reads, then the send half and the receive half
        kernels = ((Entry.COMBINE, 2 * channels, 0),)
        return self._pack(key, kernels, fields)

    def combine(self, x: object, handle: object, topk_weights: object, bias: object, config: Config,
                previous_event: object, async_finish: bool, allocate_on_comm_stream: bool) -> tuple:
        """DeepEP's intranode combine (:meth:`_combine`), run again on a grown workspace where the rows the group's
        busiest sender gets back do not fit it (:meth:`_grow`)."""
        return self._growing("combine", self._combine, (x, handle, topk_weights, bias, config, previous_event,
                                                        async_finish, allocate_on_comm_stream))

    def _combine(self, x: object, handle: object, topk_weights: object, bias: object, config: Config,
                 previous_event: object, async_finish: bool, allocate_on_comm_stream: bool) -> tuple:
        """DeepEP's intranode combine. After the flags and the config, a call shape that passed the Python checks
        before takes the compiled host path (the checks against the shape's record, the allocations and the stores
        into the packed launch in one C++ call); at any difference the Python path runs from there, so a call
        raises its errors in their order."""
        fn = "combine"
        _flags(fn, previous_event, async_finish, allocate_on_comm_stream)
        config = _check_config(fn, config, self.max_sms)
        fast = _compiled_host.compiled()
        made = None
        if fast is not None and type(handle) is NormalHandle:
            records = self._records.get(("combine", threading.get_ident(), config.num_sms))
            if records is not None:
                made = fast.normal_combine(records, x, handle, handle.most_sent, topk_weights, bias)
        if made is None:
            made = self._checked_combine(fn, fast, x, handle, topk_weights, bias, config)
        launch, out, out_weights = made
        if handle.most_sent is not None:
            self._need(fn, handle.most_sent, launch, "the rows the busiest rank of the group gets back", refused_op=0)
        self._transfers_possible(fn)
        stream = self._begin(fn, config.num_sms)
        op = self._next_op()
        p = launch.params[0]
        p.timeout_ns, p.op = _timeout_ns(spin_timeout_setting()), op
        stream.wait(previous_event)
        _launch_transfer(launch.kernels, stream)
        event = self._finish(stream, async_finish, (x, topk_weights, bias, handle, out, out_weights))
        return out, out_weights, event

    def _checked_combine(self, fn: str, fast: ModuleType | None, x: object, handle: object, topk_weights: object,
                         bias: object, config: Config) -> tuple[NormalLaunch, torch.Tensor, torch.Tensor | None]:
        """The Python host path of a combine after its flags and config: checks its arguments (raising what a bad
        one breaks), finds or packs the shape's launches, allocates the outputs and sets the launch's per-call
        fields but the op and the spin timeout; with the compiled module (``fast``), records the call shape for its
        later calls. Returns the launches, ``out`` and the combined weights (None without ``topk_weights``)."""
        rank_prefix, channel_prefix, _, recv_src_idx, _, send_head = self._handle(fn, handle, "dispatch", config)
        channels = config.num_sms // 2
        rows = recv_src_idx.shape[0]
        x = _tensor(fn, "x", x, (_ROW_DTYPE,), (rows, None), self.device)
        tokens, hidden = send_head.shape[0], x.shape[1]
        if hidden % 8 or hidden == 0:
            raise ValueError(f"{fn}: x's hidden size must be a positive multiple of 8 (16-byte rows), got {hidden}")
        topk = 0
        if topk_weights is not None:
            topk_weights = _tensor(fn, "topk_weights", topk_weights, (_WEIGHT_DTYPE,), (rows, None), self.device,
                                   vectors=False)
            topk = topk_weights.shape[1]
            if not 1 <= topk <= MAX_TOPK:
                raise ValueError(f"{fn}: topk_weights must have 1 to {MAX_TOPK} columns, got {topk}")
        if bias is None:
            bias_0 = bias_1 = None
        elif isinstance(bias, torch.Tensor):
            bias_0 = _tensor(fn, "bias[0]", bias, (_ROW_DTYPE,), (tokens, hidden), self.device)
            bias_1 = None
        elif not isinstance(bias, tuple):
            raise TypeError(f"{fn}: bias must be None, a tensor or a pair of tensors, got {type(bias).__name__}")
        elif len(bias) != 2:
            raise ValueError(f"{fn}: bias must be a pair (bias_0, bias_1) when a tuple (DeepEP's rule), got a tuple of "
                             f"{len(bias)}")
        else:
            bias_0, bias_1 = (None if b is None else _tensor(fn, f"bias[{i}]", b, (_ROW_DTYPE,), (tokens, hidden),
                                                             self.device) for i, b in enumerate(bias))
        launch = self._combine_launch(fn, ("combine", threading.get_ident(), tokens, hidden, topk, channels))
        out = torch.empty(tokens, hidden, dtype=_ROW_DTYPE, device=self.device)
        out_weights = None if not topk else torch.empty(tokens, topk, dtype=_WEIGHT_DTYPE, device=self.device)
        # A pointer field is 0 for an empty tensor (the kernels' contract): each tensor here is empty exactly when
        # its rows (received, or the handle's tokens) are none (its other extents are positive).
        p = launch.params[0]
        p.recv_rows = rows
        p.rank_prefix, p.channel_prefix = rank_prefix.data_ptr(), channel_prefix.data_ptr()
        p.x = x.data_ptr() if rows else 0
        p.topk_weights = topk_weights.data_ptr() if topk and rows else 0
        if tokens:
            p.send_head, p.out = send_head.data_ptr(), out.data_ptr()
            p.out_topk_weights = out_weights.data_ptr() if topk else 0
            p.bias_0 = 0 if bias_0 is None else bias_0.data_ptr()
            p.bias_1 = 0 if bias_1 is None else bias_1.data_ptr()
        else:
            p.send_head = p.out = p.out_topk_weights = p.bias_0 = p.bias_1 = 0
        if fast is not None:
            self._remember(("combine", config.num_sms), fast.NormalCombineRecord(
                launch=launch, params=ctypes.addressof(p), device=self.device, ranks=self.ranks, channels=channels,
                tokens=tokens, hidden=hidden, topk=topk, row_dtype=_ROW_DTYPE, weight_dtype=_WEIGHT_DTYPE,
                index_dtype=_INDEX_DTYPE, mask_dtype=_MASK_DTYPE))
        return launch, out, out_weights
