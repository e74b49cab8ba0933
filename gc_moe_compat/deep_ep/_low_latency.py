"""DeepEP's low-latency dispatch and combine on the facade's symmetric workspace: argument checks, DeepEP-layout
outputs, the launches of :mod:`gc_moe_compat.comm.ep_ll` on the communication green partition, the receive hooks,
the zero-copy combine buffer, the rank mask and the error surfacing.

By default (``GC_MOE_DEEP_EP_PARTITION`` unset or ``off``) the kernels run on the caller's stream over the whole
device, as DeepEP's use every SM; ``GC_MOE_DEEP_EP_PARTITION=on`` runs them on the communication side of the green
partition (:func:`comm_partition`: the request is ``Buffer.num_sms``), ordered within the caller's stream, so they
never take the compute partition's SMs (slower on one H200 even beside a concurrent GEMM:
:func:`gc_moe_compat.runtime.split.deep_ep_partition_mode`).

A call's launch arguments are packed once per call shape (:class:`~gc_moe_compat.comm.ep_ll.LlLaunches`, per
workspace and thread, keyed by the sizes, the flags and ``GC_MOE_SPIN_TIMEOUT_MS`` as set at the call), so a call
checks its tensors, allocates its outputs, sets its pointers and launches. Once a call shape has passed the Python
checks, its later calls do those three steps in one call of the compiled host path (:mod:`._compiled_host`: the checks
against the shape's record, at least as strict; at any difference the Python path runs and raises its own errors),
unless ``GC_MOE_DEEP_EP_HOST_PATH=python`` or the extension could not be built. ``GC_MOE_DEEP_EP_PARTITION`` and
``GC_MOE_SPIN_TIMEOUT_MS`` are read at every call (a read of each, under a microsecond), as the operator's calls read
them when they are built: a change between two calls of one Buffer takes effect at the next call, which the tests and
tools that switch them around calls rely on; DeepEP users, who set them before the first call, see no difference.

Values only the device sees are checked there: a ``topk_idx`` entry outside ``[-1, num_experts)`` (``2**40`` or
``-5`` included) or repeating its token's earlier expert is dropped by dispatch send; a combine ``topk_idx`` entry
that differs from the dispatch's, or a non-finite weight, is dropped by combine receive; each drop is recorded
(reading the values on the host would need a synchronization and is impossible under graph capture). Errors on the
device (those drops, a peer that never arrives, a protocol mismatch) land in the workspace's status records, which
the receive kernels also copy into a pinned host mirror. As with DeepEP, no call synchronizes the CPU: a call
without ``async_finish`` or a hook returns once its kernels are queued, the caller's stream ordered after them. Every
call outside capture first reads the mirror (one read of host memory: no synchronization, no device work) and raises
what earlier calls recorded (``DeviceTimeoutError`` / ``DeviceCheckError`` naming kernel and site, "recorded by an
earlier call"), and so does ``Buffer.destroy`` (after synchronizing, as DeepEP's does): an error surfaces at the first
call after the caller's stream has passed the kernels that recorded it (after a ``torch.cuda.synchronize()``, the next
call).
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import NamedTuple

import torch
from cuda.bindings import driver

from gc_moe_compat.comm.ep_ll import (
    FLAG_FP8,
    FLAG_ROUND_SCALE,
    FLAG_SHRINK,
    FLAG_UE8M0,
    MAX_EXPERTS,
    MAX_TOPK,
    Kernel,
    LlLaunches,
    LlShape,
    load_in,
    mask_words,
    new_launches,
    new_status_mirror,
    raise_for_mirrored_status,
    required_bytes,
)
from gc_moe_compat.config import boolean, int_in_range, integer, shown
from gc_moe_compat.deep_ep import _compiled_host
from gc_moe_compat.deep_ep._config import C_INT_MAX, MAX_LAUNCH_SHAPES, TOPK_IDX_DTYPES, TOPK_IDX_RULE, address_rule
from gc_moe_compat.deep_ep._parts import part
from gc_moe_compat.runtime import colocation
from gc_moe_compat.runtime.cuda import as_stream
from gc_moe_compat.runtime.green import Partition, get_partition
from gc_moe_compat.runtime.launch import current_stream_handle
from gc_moe_compat.runtime.status import spin_timeout_ms, spin_timeout_setting, status_codes
from gc_moe_compat.runtime.workspace import SymmetricWorkspace

__all__ = ["LowLatencyHandle", "check_sizes", "clean_mask", "combine", "comm_partition", "dispatch", "ll_shape",
           "next_combine_buffer", "partition_report", "query_mask", "update_mask"]

Hook = Callable[[], None]
_STATS_DTYPE = torch.int32
"""The dtype of ``cumulative_local_expert_recv_stats`` (DeepEP's), the one the checks of both host paths accept."""
_PRIVATE_DTYPE = torch.int32
"""The dtype of a dispatch's private allocation (:class:`_PrivateLayout`), so of its int32 parts (``recv_count``,
``src_info``, the handle's ``src_route`` and ``routing``)."""
_CALL_GEN_DTYPE = torch.int64
"""The dtype of a combine's generation word (``EpLlParams.call_gen``: the kernels store a u64 there)."""


class _State:
    """What the calls on one workspace keep (created with its first call): the pinned status mirror and the numpy
    view of its code words, the packed launches of each call shape (:class:`LlLaunches`, keyed by the thread, the
    kind of call, its sizes and flags and the spin timeout setting: see :func:`_launches`) and beside them the
    compiled host path's records of the same shapes (``records``: see :func:`_records`); ``unread_gen``, the word
    where a combine without a receive hook stores its generation (:func:`_call_gen`)."""

    __slots__ = ("codes", "launches", "mirror", "records", "unread_gen")

    def __init__(self, device: torch.device) -> None:
        self.mirror = new_status_mirror(device)
        self.codes = status_codes(self.mirror)
        self.launches: dict[tuple, LlLaunches] = {}
        self.records: dict[tuple, object] = {}
        self.unread_gen = torch.empty(1, dtype=_CALL_GEN_DTYPE, device=device)


_states: weakref.WeakKeyDictionary[SymmetricWorkspace, _State] = weakref.WeakKeyDictionary()


def _state(workspace: SymmetricWorkspace, capturing: bool) -> _State:
    """The workspace's :class:`_State`; outside capture, first raises what earlier calls recorded."""
    state = _states.get(workspace)
    if state is None:
        state = _states[workspace] = _State(workspace.device)
    if not capturing:
        raise_for_mirrored_status(workspace.buffer, state.mirror, workspace.world_size, state.codes)
    return state


def _records(state: _State, kind: str, *sizes: object) -> object | None:
    """The compiled host path's records of the calls of ``kind`` with these ``sizes`` and flags (the arguments that
    are no tensor) on this thread under the spin timeout setting as set now (a change is seen by the next call, as
    with :func:`_launches`): for a dispatch a dict keyed by what the extension reads off the tensors (``(T, H, k)``),
    for a combine (every size of which is its handle's) the one record; None where no call of them passed the
    Python path yet. Sizes of another type than int (the first two) are never looked up: the Python path checks
    them. A record holds the dtypes its call checked, so a tensor of another dtype (a ``topk_idx`` other than
    int64 among them) is never served by it: the extension hands the call to the Python path, which refuses it."""
    if type(sizes[0]) is not int or type(sizes[1]) is not int:
        return None
    return state.records.get(_record_key(kind, sizes))


def _record_key(kind: str, sizes: tuple) -> tuple:
    """The key of the records of the calls of ``kind`` with ``sizes`` on this thread under the spin timeout setting
    as set now."""
    return kind, threading.get_ident(), *sizes, spin_timeout_setting()


def _remember(records: dict, key: object, make: Callable[[], object]) -> None:
    """Keeps the record ``make`` builds for the call shape the Python path just checked at ``key`` of ``records``
    (once per shape), where :func:`_records` finds it: a dispatch's in the dict of its sizes and flags, by
    ``(T, H, k)``; a combine's in ``state.records``, by :func:`_record_key` of its sizes and flags."""
    if key not in records:
        records[key] = make()


def raise_recorded(workspace: SymmetricWorkspace) -> None:
    """Raises what the kernels of calls on ``workspace`` recorded and no call has raised yet (``Buffer.destroy``'s
    check, once the device has finished them)."""
    state = _states.get(workspace)
    if state is not None:
        raise_for_mirrored_status(workspace.buffer, state.mirror, workspace.world_size, state.codes)


def _capturing(workspace: SymmetricWorkspace) -> bool:
    return workspace.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class LowLatencyHandle(tuple):
    """DeepEP's handle ``(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)``:
    ``src_info[e, j]`` is the source token of received row ``j`` of local expert ``e`` and ``layout_range[e, q]`` is
    ``(first row << 32) | rows`` of source rank ``q``, as with DeepEP. It also keeps what the combine needs besides:
    the dispatch's top-k and token count, each row's slot (``src_route``: ``token * k + slot``), the dispatch's
    routing (``routing`` int32 ``[2, T, k]``: the checked expert of each slot, -1 where it was dropped, then the
    slot's row in that expert's list of this rank's rows, -1 where no row was sent) and the workspace it came from."""

    topk: int
    num_tokens: int
    src_route: torch.Tensor
    routing: torch.Tensor

    def __new__(cls, items: tuple, *, topk: int, num_tokens: int, src_route: torch.Tensor, routing: torch.Tensor,
                workspace: SymmetricWorkspace) -> LowLatencyHandle:
        handle = super().__new__(cls, items)
        handle.topk, handle.num_tokens, handle.src_route, handle.routing = topk, num_tokens, src_route, routing
        handle._workspace = weakref.ref(workspace)
        return handle

    def comes_from(self, workspace: SymmetricWorkspace) -> bool:
        """Whether the dispatch that made this handle ran on ``workspace``."""
        return self._workspace() is workspace


class _Call:
    """One call's launches: its packed arguments (``launches``, this call's pointers set), the partition, the tensors
    they point at (held until the receive half has been launched) and the caller's stream (torch's current stream,
    looked up at the first launch: once per call, and a receive hook's when it is called). Without a receive hook a
    call makes one fused launch of its direction (:meth:`launch_fused`), with one the send half's launch, then the
    hook's (:meth:`launch`)."""

    __slots__ = ("device", "launches", "partition", "stream", "tensors")

    def __init__(self, launches: LlLaunches, device: torch.device, partition: Partition | None,
                 tensors: tuple[torch.Tensor | None, ...]) -> None:
        self.launches, self.device, self.partition, self.tensors = launches, device, partition, tensors
        self.stream: driver.CUstream | None = None

    def launch(self, kernel: Kernel) -> None:
        self.launches.launch(kernel, self._stream(), self.partition)

    def launch_fused(self, kernel: Kernel) -> None:
        self.launches.launch_fused(kernel, self._stream(), self.partition)

    def _stream(self) -> driver.CUstream:
        if self.stream is None:
            self.stream = as_stream(current_stream_handle(self.device))
        return self.stream


def comm_partition(workspace: SymmetricWorkspace, request: int) -> Partition | None:
    """The green partition whose communication side runs the kernels (``request``: its SM request, DeepEP's
    ``Buffer.num_sms``), or None where they run on the caller's stream: ``GC_MOE_DEEP_EP_PARTITION`` off (the
    default), or a workspace not on a CUDA device (the host tests' stand-in)."""
    if workspace.device.type != "cuda" or colocation.deep_ep_mode_of(workspace.placement) == "off":
        return None
    partition = get_partition(request, workspace.device.index)
    load_in(partition)
    return partition


def partition_report(workspace: SymmetricWorkspace, request: int) -> dict[str, object]:
    """Where the kernels run: ``partition`` (``on`` / ``off``), ``dispatch_sms`` (the SMs they may use) and
    ``compute_sms`` (the SMs left to the compute partition, which they never take), ``requested_dispatch_sms``."""
    part = comm_partition(workspace, request)
    where = {} if workspace.device.type != "cuda" else colocation.describe(workspace.placement,
                                                                           workspace.device.index)
    if part is None:
        sms = workspace.sm_share if workspace.device.type == "cuda" else 0
        return {"partition": "off", "dispatch_sms": sms, "compute_sms": sms, "requested_dispatch_sms": request,
                **where}
    return {"partition": "on", **part.describe(), **where}


def _tensor(name: str, t: object, dtypes: tuple[torch.dtype, ...], ndim: int, device: torch.device,
            dense: bool = True, rule: str | None = None, vectors: bool = True) -> torch.Tensor:
    """``t`` as an ``ndim``-D tensor of one of ``dtypes`` on ``device``; ``dense`` (what the kernels read or write):
    also contiguous and, where they access it by 16-byte vectors (``vectors``), 16-byte aligned (the routing, read
    element by element, takes any row slice, as with DeepEP, aligned to its elements); else any layout (a tensor
    only torch ops touch). ``rule``: how the message names ``dtypes`` (default: their names)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes or t.dim() != ndim:
        raise ValueError(f"{name}: must be a {ndim}-D tensor of {rule or ' or '.join(map(str, dtypes))}, got "
                         f"{tuple(t.shape)} {t.dtype}")
    if not dense and t.device != device:
        raise ValueError(f"{name}: must be on {device} (the buffer's device), got {t.device}")
    if not dense:
        return t
    if t.device != device or not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous on {device} (the buffer's device), got {t.device}, "
                         f"contiguous={t.is_contiguous()}")
    if t.numel() and t.data_ptr() % (16 if vectors else t.element_size()):
        raise ValueError(f"{name}: must be {address_rule(vectors, t.element_size())}, got {t.data_ptr():#x}")
    return t


def ll_shape(num_ranks: int, max_tokens: object, hidden: object, num_experts: object, topk: int,
             ranks_arg: str = "the group size") -> LlShape:
    """The checked sizes of low-latency calls: ``Tmax`` and experts positive ints, hidden a positive multiple of
    128 (the FP8 scale group), ``Tmax`` and hidden C ints (DeepEP's, and the kernels' 32-bit sizes), experts a
    multiple of the ranks and <= ``MAX_EXPERTS``. The one check of the calls and of
    :meth:`Buffer.get_low_latency_rdma_size_hint`, so a hint is never computed for sizes a call refuses;
    ``ranks_arg`` is what the caller calls the rank count (the hint's ``num_ranks``)."""
    max_tokens = int_in_range("num_max_dispatch_tokens_per_rank", max_tokens, 1, C_INT_MAX,
                              "tokens a rank sends at most; DeepEP's C int")
    if int_in_range("hidden", hidden, 1, C_INT_MAX, "the token width; DeepEP's C int") % 128:
        raise ValueError(f"hidden: must be a positive multiple of 128, got {hidden}")
    experts = int_in_range("num_experts", num_experts, 1, None, "the routed experts")
    if experts % num_ranks or experts > MAX_EXPERTS:
        raise ValueError(f"num_experts: must be a multiple of {ranks_arg} {num_ranks} and <= {MAX_EXPERTS}, got "
                         f"{experts}")
    return LlShape(num_ranks, experts, max_tokens, hidden, topk)


def _shape(workspace: SymmetricWorkspace, max_tokens: object, hidden: int, num_experts: object,
           topk: int, zero_copy: bool = False) -> LlShape:
    shape = ll_shape(workspace.world_size, max_tokens, hidden, num_experts, topk)
    ranks, max_tokens, experts = shape.num_ranks, shape.max_tokens, shape.num_experts
    need, have = required_bytes(shape, zero_copy), workspace.buffer.numel()
    if need > have:
        what = ", zero-copy" if zero_copy else ""
        raise ValueError(f"num_rdma_bytes: this call (Tmax={shown(max_tokens)}, hidden={hidden}, "
                         f"num_experts={experts}, topk={topk}, {ranks} ranks{what}) needs {shown(need)} bytes, the "
                         f"Buffer has {have}; size it with Buffer.get_low_latency_rdma_size_hint (which provisions "
                         "top-k <= 16 and zero-copy)")
    return shape


def _launches(workspace: SymmetricWorkspace, state: _State, kind: str, max_tokens: object, hidden: int,
               num_experts: object, topk: int, num_tokens: int, flags: int,
               zero_copy: bool = False) -> LlLaunches | None:
    """The packed launches of a call whose sizes were checked before (None: check them, then :func:`_pack`). The key
    holds the sizes as given (only exact ints are looked up, so another type is always checked) and
    ``GC_MOE_SPIN_TIMEOUT_MS`` as set now, so a change of the variable between calls is seen by the next one."""
    if type(max_tokens) is not int or type(num_experts) is not int:
        return None
    key = (kind, threading.get_ident(), max_tokens, hidden, num_experts, topk, num_tokens, flags, zero_copy,
           spin_timeout_setting())
    return state.launches.get(key)


def _pack(workspace: SymmetricWorkspace, state: _State, kind: str, shape: LlShape, num_tokens: int, flags: int,
          zero_copy: bool = False) -> LlLaunches:
    """New packed launches of a checked call (the status mirror and, zero-copy, the send rows set once), kept for
    the calls of its key (:func:`_launches`)."""
    setting = spin_timeout_setting()
    fixed = {"x": workspace.buffer.data_ptr() + shape.zero_copy_offset} if zero_copy else {}
    launches = new_launches(workspace.peer_table, shape, num_tokens=num_tokens, flags=flags,
                            timeout_ms=spin_timeout_ms(setting), max_ctas=workspace.sm_share,
                            status_mirror=state.mirror.data_ptr(), **fixed)
    if len(state.launches) >= MAX_LAUNCH_SHAPES:  # a decode step's token count: up to Tmax entries per kind
        state.launches.clear()
        state.records.clear()
    key = (kind, threading.get_ident(), shape.max_tokens, shape.hidden, shape.num_experts, shape.topk, num_tokens,
           flags, zero_copy, setting)
    state.launches[key] = launches
    return launches


def _receive_hook(call: _Call, kernel: Kernel) -> Hook:
    """DeepEP's receive hook: the receive kernel's launch (from a copy of this call's arguments), on the stream
    current when it is called."""
    launches, device, partition, tensors = call.launches.detached(), call.device, call.partition, call.tensors

    def receive() -> None:
        _Call(launches, device, partition, tensors).launch(kernel)

    return receive


_DispatchMade = tuple[LlLaunches, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor,
                     torch.Tensor, torch.Tensor, torch.Tensor]
"""A dispatch's packed launches (this call's pointers set) and its tensors: ``recv_x``, the scales (None for BF16),
``recv_count``, ``src_info``, ``layout_range``, the private allocation they are parts of (:class:`_PrivateLayout`)
and its two parts ``src_route`` and ``routing`` (what either host path makes)."""


def dispatch(workspace: SymmetricWorkspace, x: torch.Tensor, topk_idx: torch.Tensor, max_tokens: int,
             num_experts: int, *, recv_stats: torch.Tensor | None, use_fp8: bool, round_scale: bool,
             use_ue8m0: bool, async_finish: bool, return_recv_hook: bool, shrink: bool, num_sms: int
             ) -> tuple[torch.Tensor | tuple[torch.Tensor, torch.Tensor], torch.Tensor, LowLatencyHandle, Hook | None]:
    """DeepEP ``low_latency_dispatch`` on ``workspace``: returns ``(recv_x, recv_count, handle, hook)``. ``shrink``:
    skip the masked ranks (DeepEP's ``enable_shrink``); ``num_sms``: the communication partition's request."""
    device = workspace.device
    state = _state(workspace, _capturing(workspace))
    if not use_fp8:  # DeepEP reads both for the FP8 scales only
        round_scale = use_ue8m0 = False
    flags = (FLAG_FP8 if use_fp8 else 0) | (FLAG_ROUND_SCALE if round_scale else 0) | \
        (FLAG_UE8M0 if use_ue8m0 else 0) | (FLAG_SHRINK if shrink else 0)
    fast = _compiled_host.compiled()
    records = None if fast is None else _records(state, "dispatch", max_tokens, num_experts, flags)
    made = None if records is None else fast.dispatch(records, x, topk_idx, recv_stats)
    if made is None:
        made = _checked_dispatch(workspace, state, fast, x, topk_idx, max_tokens, num_experts, recv_stats,
                                 use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0, flags=flags)
    launches, recv_x, scales, recv_count, src_info, layout_range, private, src_route, routing = made
    shape = launches.shape
    call = _Call(launches, device, comm_partition(workspace, num_sms),
                 (x, topk_idx, recv_x, scales, recv_count, src_info, layout_range, private, recv_stats))
    handle = LowLatencyHandle((src_info, layout_range, shape.max_tokens, shape.hidden, shape.num_experts),
                              topk=shape.topk, num_tokens=launches.num_tokens, src_route=src_route, routing=routing,
                              workspace=workspace)
    out = recv_x if scales is None else (recv_x, scales)
    if return_recv_hook:
        call.launch(Kernel.DISPATCH_SEND)
        return out, recv_count, handle, _receive_hook(call, Kernel.DISPATCH_RECV)
    call.launch_fused(Kernel.DISPATCH_SEND)
    return out, recv_count, handle, None


def _checked_dispatch(workspace: SymmetricWorkspace, state: _State, fast: ModuleType | None, x: object,
                      topk_idx: object, max_tokens: object, num_experts: object, recv_stats: object, *,
                      use_fp8: bool, round_scale: bool, use_ue8m0: bool, flags: int) -> _DispatchMade:
    """The Python host path of a dispatch: checks its arguments (raising what a bad one breaks), allocates its
    outputs and sets their pointers in the shape's packed launches; with the compiled module (``fast``), records
    the call shape for its later calls (:func:`_remember`)."""
    device = workspace.device
    x = _tensor("x", x, (torch.bfloat16,), 2, device)
    topk_idx = _tensor("topk_idx", topk_idx, TOPK_IDX_DTYPES, 2, device, rule=TOPK_IDX_RULE, vectors=False)
    num_tokens, hidden = x.shape
    topk = topk_idx.shape[1]
    if topk_idx.shape[0] != num_tokens or not 1 <= topk <= MAX_TOPK:
        raise ValueError(f"topk_idx: must be [num_tokens={num_tokens}, k] with 1 <= k <= {MAX_TOPK}, got "
                         f"{tuple(topk_idx.shape)}")
    group = 512 if use_ue8m0 else 128
    if hidden % group or hidden == 0:
        raise ValueError(f"x.shape[1] (hidden): must be a positive multiple of {group}, got {hidden}")
    if use_ue8m0 and not round_scale:
        raise ValueError("use_ue8m0: FP8 UE8M0 scales need round_scale=True (UE8M0 holds power-of-two scales; "
                         "DeepEP's rule), got round_scale=False")
    launches = _launches(workspace, state, "dispatch", max_tokens, hidden, num_experts, topk, num_tokens, flags)
    if launches is None:
        shape = _shape(workspace, max_tokens, hidden, num_experts, topk)
        if shape.topk > shape.num_experts:
            raise ValueError(f"topk_idx: its k (one distinct expert per slot) must be <= num_experts="
                             f"{shape.num_experts}, got k={shape.topk}")
        if num_tokens > shape.max_tokens:
            raise ValueError(f"x.shape[0] (tokens): must be <= num_max_dispatch_tokens_per_rank={shape.max_tokens}"
                             f", got {num_tokens}")
        if shape.num_ranks * shape.max_tokens % 4:
            raise ValueError(f"num_max_dispatch_tokens_per_rank: times the group size ({shape.num_ranks}) must be a "
                             f"multiple of 4 (DeepEP's rule: its receive layout's rows, read by TMA), got "
                             f"{shape.max_tokens}")
        launches = _pack(workspace, state, "dispatch", shape, num_tokens, flags)
    shape = launches.shape
    ranks, local = shape.num_ranks, shape.local_experts
    slots = ranks * shape.max_tokens
    if recv_stats is not None:
        recv_stats = _tensor("cumulative_local_expert_recv_stats", recv_stats, (_STATS_DTYPE,), 1, device,
                             vectors=False)  # an atomicAdd per local expert
        if recv_stats.shape[0] != local:
            raise ValueError(f"cumulative_local_expert_recv_stats: must have num_experts / group size = {local} "
                             f"entries, got {recv_stats.shape[0]}")
    recv_x = torch.empty(local, slots, hidden, dtype=torch.float8_e4m3fn if use_fp8 else torch.bfloat16,
                         device=device)
    scales = None
    groups = hidden // 512 if use_ue8m0 else hidden // 128
    if use_fp8:
        # Column-major in the last two dimensions (what TMA and DeepGEMM's masked GEMM read), as DeepEP returns them
        # (its transposed [E/P, H/g, P*Tmax]): one strided allocation, not an allocation and a transposed view.
        scales = torch.empty_strided((local, slots, groups), (groups * slots, 1, slots),
                                     dtype=torch.int32 if use_ue8m0 else torch.float32, device=device)
    at = _private_layout(local, slots, ranks, num_tokens, topk)
    private = torch.empty(at.size, dtype=_PRIVATE_DTYPE, device=device)
    word = _PRIVATE_DTYPE.itemsize  # the layout's starts are in its elements
    layout_range = part(private, torch.int64, word * at.layout_range, (local, ranks))
    recv_count = part(private, _PRIVATE_DTYPE, word * at.recv_count, (local,))
    src_info = part(private, _PRIVATE_DTYPE, word * at.src_info, (local, slots))
    src_route = part(private, _PRIVATE_DTYPE, word * at.src_route, (local, slots))
    routing = part(private, _PRIVATE_DTYPE, word * at.routing, (2, num_tokens, topk))
    base = private.data_ptr()
    params = launches.params
    params.x, params.topk_idx, params.recv_x = x.data_ptr(), topk_idx.data_ptr(), recv_x.data_ptr()
    params.recv_scales = 0 if scales is None else scales.data_ptr()
    params.recv_count, params.src_info, params.layout_range = (recv_count.data_ptr(), src_info.data_ptr(),
                                                               layout_range.data_ptr())
    params.call_gen, params.src_route, params.routing = base, base + 4 * at.src_route, base + 4 * at.routing
    params.recv_stats = 0 if recv_stats is None else recv_stats.data_ptr()
    if fast is not None:  # the record holds the dtypes this call checked and allocated
        _remember(state.records.setdefault(_record_key("dispatch", (shape.max_tokens, shape.num_experts, flags)), {}),
                  (num_tokens, hidden, topk), lambda: fast.DispatchRecord(
                      launches=launches, params=ctypes.addressof(params), device=device, num_tokens=num_tokens,
                      hidden=hidden, topk=topk, local=local, slots=slots, ranks=ranks, groups=groups,
                      layout_at=at.layout_range, count_at=at.recv_count, info_at=at.src_info, route_at=at.src_route,
                      routing_at=at.routing, private_size=at.size, x_dtype=x.dtype, idx_dtype=topk_idx.dtype,
                      stats_dtype=_STATS_DTYPE, recv_dtype=recv_x.dtype,
                      scale_dtype=None if scales is None else scales.dtype, private_dtype=private.dtype))
    return launches, recv_x, scales, recv_count, src_info, layout_range, private, src_route, routing


class _PrivateLayout(NamedTuple):
    """Where each part of a dispatch's one small allocation starts, in its int32 elements, each 16-byte aligned: the
    call's generation word (a u64 at 0), ``layout_range`` (int64 ``[L, P]``), ``recv_count`` (``[L]``), ``src_info``
    and ``src_route`` (``[L, P*Tmax]``), ``routing`` (``[2, T, k]``); ``size``, the elements in all. One allocation
    instead of four: each costs about 2 us of host time per call (a CUDA allocation through torch's caching
    allocator), the sizes are small, and the parts have DeepEP's shapes, dtypes and strides
    (:func:`~gc_moe_compat.deep_ep._parts.part`: not autograd views, as DeepEP's separate tensors)."""

    layout_range: int
    recv_count: int
    src_info: int
    src_route: int
    routing: int
    size: int


def _private_layout(local: int, slots: int, ranks: int, num_tokens: int, topk: int) -> _PrivateLayout:
    """The :class:`_PrivateLayout` of a dispatch of these sizes (``slots`` = P * Tmax)."""
    parts = (2 * local * ranks, local, local * slots, local * slots, 2 * num_tokens * topk)
    starts = [4]  # after the generation word
    for elements in parts:
        starts.append(starts[-1] + -(-elements // 4) * 4)
    return _PrivateLayout(*starts[:-1], size=starts[-2] + parts[-1])


def _handle(workspace: SymmetricWorkspace, handle: object, fn: str) -> LowLatencyHandle:
    """``handle`` checked as one that ``low_latency_dispatch`` on this workspace returned (with DeepEP's contents).
    As for every tensor the facade checks (normal mode's handle members included, ``NormalMode._handle``), another
    type is a ``TypeError`` (not a handle, a member not a tensor) and a tensor of another dtype, rank, shape or
    device a ``ValueError``: a bad handle raises the same exception type in both modes."""
    if not isinstance(handle, LowLatencyHandle):
        raise TypeError(f"handle: must be the handle low_latency_dispatch returned ({fn}), got "
                        f"{type(handle).__name__}")
    if not handle.comes_from(workspace):
        raise ValueError(f"{fn}: handle comes from another Buffer's low_latency_dispatch (a handle indexes the "
                         "workspace of the Buffer that dispatched it)")
    src_info, layout_range = handle[0], handle[1]
    for name, t, dtype in (("handle[0] (src_info)", src_info, torch.int32),
                           ("handle[1] (layout_range)", layout_range, torch.int64)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor (the dispatch's), got {type(t).__name__}")
        if t.dtype != dtype or t.dim() != 2:
            raise ValueError(f"{fn}: {name} must be a 2-D {dtype} tensor (the dispatch's), got "
                             f"{list(t.shape)} {t.dtype}")
    return handle


def combine(workspace: SymmetricWorkspace, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
            handle: object, *, out: torch.Tensor | None, zero_copy: bool, async_finish: bool,
            return_recv_hook: bool, shrink: bool, num_sms: int) -> tuple[torch.Tensor, Hook | None]:
    """DeepEP ``low_latency_combine`` on ``workspace``: returns ``(combined_x, hook)``. With ``zero_copy`` the rows
    are read from the workspace's send rows (:func:`next_combine_buffer`, which the caller filled) instead of ``x``
    (still checked, as DeepEP does). The compiled host path checks the handle's members with the other tensors, so
    it raises what earlier calls recorded once its checks passed (before the launch); where they do not, the Python
    path runs from the start: a call raises the Python path's errors in its order."""
    capturing = _capturing(workspace)
    fast = _compiled_host.compiled()
    made = None
    if fast is not None and isinstance(handle, LowLatencyHandle) and handle.comes_from(workspace) and \
            (state := _states.get(workspace)) is not None:
        _, _, max_tokens, hidden, num_experts = handle
        record = _records(state, "combine", max_tokens, num_experts, hidden, handle.topk, handle.num_tokens,
                          FLAG_SHRINK if shrink else 0, zero_copy)
        made = None if record is None else fast.combine(record, handle[0], handle[1], handle.src_route,
                                                        handle.routing, x, topk_idx, topk_weights, out,
                                                        _call_gen(state, return_recv_hook))
        if made is not None and not capturing:
            raise_for_mirrored_status(workspace.buffer, state.mirror, workspace.world_size, state.codes)
    if made is None:
        made = _checked_combine(workspace, capturing, fast, x, topk_idx, topk_weights, handle, out=out,
                                zero_copy=zero_copy, shrink=shrink, hooked=return_recv_hook)
    launches, out, call_gen = made
    call = _Call(launches, workspace.device, comm_partition(workspace, num_sms),
                 (x, topk_idx, topk_weights, handle[0], handle.src_route, handle.routing, handle[1], out, call_gen))
    if return_recv_hook:
        call.launch(Kernel.COMBINE_SEND)
        return out, _receive_hook(call, Kernel.COMBINE_RECV)
    call.launch_fused(Kernel.COMBINE_SEND)
    return out, None


def _checked_combine(workspace: SymmetricWorkspace, capturing: bool, fast: ModuleType | None, x: object,
                     topk_idx: object, topk_weights: object, handle: object, *, out: object, zero_copy: bool,
                     shrink: bool, hooked: bool) -> tuple[LlLaunches, torch.Tensor, torch.Tensor]:
    """The Python host path of a combine: checks the handle, raises what earlier calls recorded (outside capture),
    checks the other arguments (raising what a bad one breaks), allocates and sets the pointers in the shape's
    packed launches; with the compiled module (``fast``), records the call shape for its later calls. Returns the
    launches, ``out`` and the call's generation word."""
    handle = _handle(workspace, handle, "low_latency_combine")
    src_info, layout_range, max_tokens, hidden, num_experts = handle
    device = workspace.device
    state = _state(workspace, capturing)
    num_tokens, topk = handle.num_tokens, handle.topk
    flags = FLAG_SHRINK if shrink else 0
    launches = _launches(workspace, state, "combine", max_tokens, hidden, num_experts, topk, num_tokens, flags,
                         zero_copy)
    if launches is None:
        shape = _shape(workspace, max_tokens, hidden, num_experts, topk, zero_copy=zero_copy)
    else:
        shape = launches.shape
    local, slots = shape.local_experts, shape.num_ranks * shape.max_tokens
    for name, t, want in (("handle[0] (src_info)", src_info, (local, slots)),
                          ("handle[1] (layout_range)", layout_range, (local, shape.num_ranks))):
        if tuple(t.shape) != want or t.device != device:
            raise ValueError(f"low_latency_combine: {name} must be the dispatch's {list(want)} on {device}, got "
                             f"{list(t.shape)} on {t.device}")
    x = _tensor("x", x, (torch.bfloat16,), 3, device)
    if tuple(x.shape) != (local, slots, hidden):
        raise ValueError(f"x: must be [num_local_experts={local}, num_ranks*Tmax={slots}, hidden={hidden}] (the "
                         f"dispatch's layout), got {tuple(x.shape)}")
    topk_idx = _tensor("topk_idx", topk_idx, TOPK_IDX_DTYPES, 2, device, rule=TOPK_IDX_RULE, vectors=False)
    expected = (num_tokens, topk)
    if tuple(topk_idx.shape) != expected:
        raise ValueError(f"topk_idx: must be the dispatch's [num_tokens, k] = {list(expected)}, got "
                         f"{list(topk_idx.shape)}")
    topk_weights = _tensor("topk_weights", topk_weights, (torch.float32,), 2, device, vectors=False)
    if tuple(topk_weights.shape) != expected:
        raise ValueError(f"topk_weights: must be float32 {list(expected)} like topk_idx, got "
                         f"{list(topk_weights.shape)}")
    if out is None:
        out = torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=device)
    else:
        out = _tensor("out", out, (torch.bfloat16,), 2, device)
        if tuple(out.shape) != (num_tokens, hidden):
            raise ValueError(f"out: must be [{num_tokens}, {hidden}], got {list(out.shape)}")
    if launches is None:
        launches = _pack(workspace, state, "combine", shape, num_tokens, flags, zero_copy)
    call_gen = _call_gen(state, hooked)
    if call_gen is None:
        call_gen = torch.empty(1, dtype=_CALL_GEN_DTYPE, device=device)
    params = launches.params
    if not zero_copy:  # the zero-copy send rows are the workspace's, set once
        params.x = x.data_ptr()
    params.topk_idx, params.topk_weights, params.out = topk_idx.data_ptr(), topk_weights.data_ptr(), out.data_ptr()
    params.src_info, params.layout_range = src_info.data_ptr(), layout_range.data_ptr()
    params.src_route, params.routing = handle.src_route.data_ptr(), handle.routing.data_ptr()
    params.call_gen = call_gen.data_ptr()
    if fast is not None:  # the record holds the dtypes this call checked and allocated, the routes' the dispatch's
        _remember(state.records,
                  _record_key("combine", (shape.max_tokens, shape.num_experts, hidden, topk, num_tokens, flags,
                                          zero_copy)), lambda: fast.CombineRecord(
                      launches=launches, params=ctypes.addressof(params), device=device, num_tokens=num_tokens,
                      hidden=hidden, topk=topk, local=local, slots=slots, ranks=shape.num_ranks,
                      zero_copy=zero_copy, x_dtype=x.dtype, idx_dtype=topk_idx.dtype,
                      weights_dtype=topk_weights.dtype, out_dtype=out.dtype, src_info_dtype=src_info.dtype,
                      layout_dtype=layout_range.dtype, route_dtype=_PRIVATE_DTYPE, call_gen_dtype=_CALL_GEN_DTYPE))
    return launches, out, call_gen


def _call_gen(state: _State, hooked: bool) -> torch.Tensor | None:
    """Where a combine's kernels store its generation (``EpLlParams.call_gen``): the receive launch of a call with a
    receive hook reads it, so such a call gets a word of its own (None here: the host path allocates it, as two
    hooked calls may be in flight); a call without one receives in its send launch, which takes the generation its
    own CTAs computed and never reads the word, so its calls share ``state.unread_gen`` (no allocation per call)."""
    return None if hooked else state.unread_gen


def next_combine_buffer(workspace: SymmetricWorkspace, handle: object) -> torch.Tensor:
    """DeepEP's ``get_next_low_latency_combine_buffer``: the BF16 ``[E/P, P*Tmax, H]`` rows in the workspace that a
    ``low_latency_combine(..., zero_copy=True)`` with this handle sends (the caller writes its expert outputs here,
    so the combine does not read ``x``). One set of rows serves every combine: a write queued on the stream after a
    combine cannot overtake that combine's first launch, which reads them (its send half; at one rank the receive
    half that launch runs)."""
    handle = _handle(workspace, handle, "get_next_low_latency_combine_buffer")
    _, _, max_tokens, hidden, num_experts = handle
    shape = _shape(workspace, max_tokens, hidden, num_experts, handle.topk, zero_copy=True)
    rows = workspace.buffer[shape.zero_copy_offset:shape.zero_copy_offset + shape.zero_copy_bytes]
    return rows.view(torch.bfloat16).view(shape.local_experts, shape.num_ranks * shape.max_tokens, hidden)


def update_mask(workspace: SymmetricWorkspace, rank_to_mask: object, mask: object) -> None:
    """DeepEP's ``low_latency_update_mask_buffer``: masks (``mask=True``) or unmasks ``rank_to_mask`` in this rank's
    mask (a stream operation, ordered with the kernels)."""
    fn = "low_latency_update_mask_buffer"
    rank = integer(fn, "rank_to_mask", rank_to_mask, 0, workspace.world_size - 1)
    boolean(fn, "mask", mask)
    mask_words(workspace.buffer, workspace.world_size)[rank].fill_(int(mask))


def _distinct_elements(t: torch.Tensor) -> bool:
    """Whether no two elements of ``t`` share a memory location (its shape and strides only; ``t``'s elements are
    few: a rank count). A broadcast (stride 0) or ``as_strided`` view can alias; a transposed or sliced one cannot."""
    if t.is_contiguous():
        return True
    offsets = torch.zeros((), dtype=torch.int64, device="cpu")  # host arithmetic on the strides: no device work
    for size, stride in zip(t.shape, t.stride(), strict=True):
        offsets = offsets.unsqueeze(-1) + torch.arange(size, dtype=torch.int64, device="cpu") * stride
    return offsets.unique().numel() == t.numel()


def query_mask(workspace: SymmetricWorkspace, mask_status: object) -> None:
    """DeepEP's ``low_latency_query_mask_buffer``: copies this rank's mask (1 = masked) into ``mask_status``.

    DeepEP checks ``mask_status.numel() == num_ranks`` and ``scalar_type() == kInt32``, nothing else (not the
    shape, strides or device: csrc/legacy/buffer.hpp ``low_latency_query_mask_buffer``), so any int32 tensor of
    ``num_ranks`` elements is accepted whatever its shape: rank ``r`` goes to its ``r``-th element in row-major
    order (DeepEP's ``data_ptr()[r]`` for a contiguous tensor). A torch copy writes it, so a non-contiguous view gets
    each rank in its own element too (DeepEP's kernel would write ``num_ranks`` consecutive words from
    ``data_ptr()``, outside such a view). Refused before anything is written (``ValueError``, as every tensor rule
    of the facade): another dtype or element count (DeepEP's two checks), a tensor off the buffer's device (DeepEP's
    kernel writes through the pointer on that device; elsewhere it is an illegal address), and elements that share
    memory (a broadcast view: no word per rank; DeepEP's kernel would write past it)."""
    fn = "low_latency_query_mask_buffer"
    if not isinstance(mask_status, torch.Tensor):
        raise TypeError(f"{fn}: mask_status must be a torch.Tensor, got {type(mask_status).__name__}")
    ranks = workspace.world_size
    if mask_status.dtype != torch.int32:
        raise ValueError(f"{fn}: mask_status must be a torch.int32 tensor (DeepEP's check), got {mask_status.dtype}")
    if mask_status.numel() != ranks:
        raise ValueError(f"{fn}: mask_status must have numel() == num_ranks={ranks} (any shape, DeepEP's check), "
                         f"got {mask_status.numel()} elements of shape {list(mask_status.shape)}")
    if mask_status.device != workspace.device:
        raise ValueError(f"{fn}: mask_status must be on {workspace.device} (the buffer's device), got "
                         f"{mask_status.device}")
    if not _distinct_elements(mask_status):
        raise ValueError(f"{fn}: mask_status's {ranks} elements must be distinct memory (one word per rank), got "
                         f"shape {list(mask_status.shape)} with strides {list(mask_status.stride())}")
    mask_status.copy_(mask_words(workspace.buffer, ranks).ne(0).to(torch.int32).view(mask_status.shape))


def clean_mask(workspace: SymmetricWorkspace) -> None:
    """DeepEP's ``low_latency_clean_mask_buffer``: unmasks every rank."""
    mask_words(workspace.buffer, workspace.world_size).zero_()


def check_sizes(workspace: SymmetricWorkspace, max_tokens: int, hidden: int, num_experts: int) -> None:
    """Raises ``ValueError`` when low-latency calls of these sizes (top-k 1) cannot run on ``workspace``."""
    _shape(workspace, max_tokens, hidden, num_experts, 1)
