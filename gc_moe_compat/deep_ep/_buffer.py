"""``deep_ep.Buffer`` (DeepEP's legacy buffer, as SGLang's pin ``sgl-deep-ep==0.1.2.post1`` declares it), with its
low-latency mode and its intranode normal mode on gc-moe-compat's kernels.

A Buffer created with ``num_nvl_bytes > 0`` owns a symmetric workspace of that size for the normal mode
(``get_dispatch_layout`` / ``dispatch`` / ``combine``, :mod:`gc_moe_compat.deep_ep._normal`: DeepEP's outputs, handle
and ordering, kernels on the communication green partition that ``config.num_sms`` requests); ``internode_*`` and
groups above 8 ranks raise ``NotImplementedError`` (NVSHMEM/RDMA).

A Buffer created with ``low_latency_mode=True`` owns one symmetric workspace of ``num_rdma_bytes`` (torch symmetric
memory across ``group``; size it with :meth:`Buffer.get_low_latency_rdma_size_hint`). ``low_latency_dispatch`` /
``low_latency_combine`` keep DeepEP's arguments, outputs (shapes, dtypes, column-major scales), handle and hook
semantics, the zero-copy combine and rank masking (``enable_shrink``); they run on the communication green partition
requested by ``Buffer.num_sms`` (:attr:`Buffer.low_latency_partition` reports it). What is not implemented raises
``NotImplementedError`` saying so: NVFP4 dispatch, LogFMT combine, the receive-cost statistics, and SGLang's
single-batch-overlap signals. ``use_fabric`` is accepted and unused, as by the pin (the workspace is torch symmetric
memory either way).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from gc_moe_compat.comm.ep_ll import HEADER_BYTES, HINT_TOPK, MAX_RANKS, check_rank_count, required_bytes
from gc_moe_compat.config import MAX_SMS, boolean, integer, shown
from gc_moe_compat.deep_ep import _low_latency, _normal
from gc_moe_compat.deep_ep._config import BUFFER_ALIGNMENT_BYTES, C_INT_MAX, MAX_NVL_RANKS, Config, aligned_bytes
from gc_moe_compat.deep_ep._event import EventHandle, EventOverlap
from gc_moe_compat.runtime.colocation import deep_ep_mode_of
from gc_moe_compat.runtime.green import get_partition
from gc_moe_compat.runtime.workspace import LayoutPlanner, SymmetricWorkspace

__all__ = ["Buffer"]

_Hook = Callable[[], None] | None
_MAX_BYTES = (1 << 63) - 1
"""DeepEP's byte counts are C++ ``int64_t``: a larger count is refused here, not overflowed in an allocator."""


def _flags(fn: str, **flags: object) -> None:
    """Every bool flag of a call must be a bool (``TypeError`` naming it): DeepEP reads them by truth value, so
    ``'no'`` would silently mean True. ``use_fabric`` alone may be None (DeepEP's "auto" default)."""
    for arg, value in flags.items():
        if value is not True and value is not False:  # the check's call only where it may fail: a per-call path
            boolean(fn, arg, value, none_ok=arg == "use_fabric")


def _no_async_hook(fn: str, async_finish: bool, return_recv_hook: bool) -> None:
    """DeepEP's ``not (async and return_recv_hook)``: a hooked call returns before its receive half, so there is no
    finished event to wait for."""
    if async_finish and return_recv_hook:
        raise ValueError(f"{fn}: async_finish and return_recv_hook cannot both be True (DeepEP's rule), got both")


def _missing(what: str) -> NotImplementedError:
    return NotImplementedError(f"{what} is not implemented by gc-moe-compat's deep_ep facade")


def _event(async_finish: bool) -> EventOverlap:
    return EventOverlap(EventHandle() if async_finish else None)


def _local_view(fn: str, region: torch.Tensor, dtype: torch.dtype, size: object, offset: object) -> torch.Tensor:
    """``region`` (bytes) from byte ``offset`` as ``dtype``, shaped ``size`` or 1-D to the end; ``TypeError`` /
    ``ValueError`` naming ``offset`` or ``size`` for an offset outside the region or not a multiple of the element
    size, a shape that is not a sequence of ints >= 0, or one that does not fit."""
    nbytes, itemsize = region.numel(), dtype.itemsize
    integer(fn, "offset", offset, 0, nbytes)
    if offset % itemsize:
        raise ValueError(f"{fn}: offset must be a multiple of {dtype}'s {itemsize} bytes (element alignment), got "
                         f"{offset}")
    room = (nbytes - offset) // itemsize
    if size is None:
        return region[offset:offset + room * itemsize].view(dtype)
    if not isinstance(size, tuple | list):
        raise TypeError(f"{fn}: size must be a torch.Size (a shape) or None, got {type(size).__name__} ({size!r})")
    dims = [integer(fn, f"size[{i}]", d, 0, nbytes) for i, d in enumerate(size)]
    numel = math.prod(dims)
    if numel > room:
        raise ValueError(f"{fn}: size must fit the NVL buffer: {list(dims)} is {numel} elements of {dtype}, "
                         f"{room} fit after offset {offset} of {nbytes} bytes")
    return region[offset:offset + numel * itemsize].view(dtype).view(dims)


def _check_byte_counts(fn: str, num_nvl_bytes: int, num_rdma_bytes: int, low_latency_mode: bool,
                       num_ranks: int) -> None:
    """DeepEP's rules for the two byte counts (its ``Buffer`` constructor's asserts), as ``ValueError`` naming the
    argument: multiples of :data:`BUFFER_ALIGNMENT_BYTES` and fewer than ``INT_MAX`` 16-byte vectors; RDMA bytes only
    in low-latency mode or above :data:`MAX_NVL_RANKS` ranks (internode); ``num_nvl_bytes`` above a C ``int`` only
    without RDMA bytes; ``num_rdma_bytes`` above a C ``int`` only in low-latency mode."""
    for arg, value in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
        if value % BUFFER_ALIGNMENT_BYTES:
            raise ValueError(f"{fn}: {arg} must be a multiple of {BUFFER_ALIGNMENT_BYTES} bytes (DeepEP's buffer "
                             f"alignment; the size hints return such counts), got {value}")
        if value // 16 >= C_INT_MAX:
            raise ValueError(f"{fn}: {arg} must be below {16 * C_INT_MAX} bytes (DeepEP counts 16-byte vectors in a "
                             f"C int), got {value}")
    if num_nvl_bytes > C_INT_MAX and num_rdma_bytes:
        raise ValueError(f"{fn}: num_nvl_bytes above {C_INT_MAX} (a C int) needs num_rdma_bytes=0, as DeepEP's "
                         f"Buffer; got num_nvl_bytes={num_nvl_bytes}, num_rdma_bytes={num_rdma_bytes}")
    if num_rdma_bytes > C_INT_MAX and not low_latency_mode:
        raise ValueError(f"{fn}: num_rdma_bytes above {C_INT_MAX} (a C int) needs low_latency_mode=True, as "
                         f"DeepEP's Buffer; got num_rdma_bytes={num_rdma_bytes}")
    if num_rdma_bytes and not low_latency_mode and num_ranks <= MAX_NVL_RANKS:
        raise ValueError(f"{fn}: num_rdma_bytes must be 0 for an intranode normal-mode Buffer (DeepEP uses RDMA "
                         f"bytes in low-latency mode or above {MAX_NVL_RANKS} ranks), got num_rdma_bytes="
                         f"{num_rdma_bytes} with {num_ranks} ranks and low_latency_mode=False")


class Buffer:
    """DeepEP's expert-parallel communication buffer; the low-latency mode runs gc-moe-compat's kernels."""

    num_sms: int = 20

    def __init__(self, group: dist.ProcessGroup | None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool | None = None, explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm: Any = None) -> None:
        if group is None:
            if comm is not None:
                raise _missing("an mpi4py communicator (comm=...); pass a torch.distributed group")
            raise ValueError("group: either 'group' or 'comm' must be provided")
        fn = "Buffer"
        _flags(fn, low_latency_mode=low_latency_mode,
               allow_nvlink_for_low_latency_mode=allow_nvlink_for_low_latency_mode, allow_mnnvl=allow_mnnvl,
               use_fabric=use_fabric, explicitly_destroy=explicitly_destroy, enable_shrink=enable_shrink)
        integer(fn, "num_nvl_bytes", num_nvl_bytes, 0, _MAX_BYTES)
        integer(fn, "num_rdma_bytes", num_rdma_bytes, 0, _MAX_BYTES)
        integer(fn, "num_qps_per_rank", num_qps_per_rank, 1 if low_latency_mode else -C_INT_MAX - 1)  # DeepEP: > 0
        if allow_mnnvl:
            raise _missing("allow_mnnvl=True (multi-node NVLink: the workspace is torch symmetric memory within one "
                           "node, with no MNNVL / fabric memory handles)")
        if not allow_nvlink_for_low_latency_mode and low_latency_mode:
            raise _missing("allow_nvlink_for_low_latency_mode=False (the low-latency kernels use NVLink peer stores)")
        self.rank, self.group, self.group_size = dist.get_rank(group), group, dist.get_world_size(group)
        check_rank_count(self.group_size)
        _check_byte_counts(fn, num_nvl_bytes, num_rdma_bytes, low_latency_mode, self.group_size)
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.explicitly_destroy = low_latency_mode, explicitly_destroy
        self.enable_shrink = enable_shrink
        self.workspace: SymmetricWorkspace | None = None
        self._destroyed = False
        if num_rdma_bytes and not low_latency_mode and self.group_size > _normal.MAX_NVL_RANKS:
            raise _missing(f"num_rdma_bytes with {self.group_size} ranks (internode normal mode over NVSHMEM/RDMA)")
        self.normal: _normal.NormalMode | None = None
        if num_nvl_bytes:
            try:
                self.normal = _normal.NormalMode(group, num_nvl_bytes)
            except RuntimeError as exc:  # no CUDA device, a failed rendezvous: named as this call's
                raise RuntimeError(f"{fn}: num_nvl_bytes={num_nvl_bytes} (normal mode): {exc}") from exc
        if low_latency_mode:
            if num_rdma_bytes < HEADER_BYTES:
                raise ValueError(f"num_rdma_bytes: the low-latency mode needs an int >= {HEADER_BYTES} (see "
                                 f"Buffer.get_low_latency_rdma_size_hint), got {num_rdma_bytes!r}")
            layout = LayoutPlanner()
            layout.add("low_latency", num_rdma_bytes)
            try:
                self.workspace = SymmetricWorkspace(layout, group)
            except RuntimeError as exc:  # no CUDA device, a failed rendezvous: named as this call's
                raise RuntimeError(f"{fn}: low_latency_mode=True: {exc}") from exc
            _low_latency.comm_partition(self.workspace, Buffer.num_sms)  # made now, not first inside a capture

    def __repr__(self) -> str:
        """The modes this Buffer serves and where its kernels run: the partition mode, how its workspace maps the
        peers and how many ranks share this GPU; the normal mode's workspace bytes where calls grew it."""
        spaces = [w for w in (self.workspace, None if self.normal is None else self.normal.workspace) if w is not None]
        where = f", rendezvous={spaces[0].rendezvous!r}, ranks_on_device={spaces[0].placement.ranks_on_device}, " \
                f"partition={deep_ep_mode_of(spaces[0].placement)!r}" if spaces else ""
        grown = self.normal is not None and self.normal.buffer.numel() != self.num_nvl_bytes
        nvl = f"{self.num_nvl_bytes} (grown to {self.normal.buffer.numel()})" if grown else f"{self.num_nvl_bytes}"
        return (f"Buffer(rank={self.rank}, num_ranks={self.group_size}, num_nvl_bytes={nvl}, "
                f"num_rdma_bytes={self.num_rdma_bytes}, low_latency_mode={self.low_latency_mode}{where})")

    def destroy(self) -> None:
        """Releases the workspace (only for a Buffer created with ``explicitly_destroy=True``, as with DeepEP), after
        synchronizing the device (as DeepEP does): then raises what the kernels of earlier calls recorded and no call
        has raised yet (``DeviceTimeoutError`` / ``DeviceCheckError`` naming kernel and site), the workspace released
        all the same."""
        if not self.explicitly_destroy:
            raise ValueError("destroy: the Buffer was created with explicitly_destroy=False")
        if self._destroyed:
            raise ValueError("destroy: the Buffer was already destroyed (DeepEP's runtime refuses a second destroy)")
        self._destroyed = True
        workspace, normal = self.workspace, self.normal
        self.workspace = self.normal = None
        try:
            if workspace is not None:
                if workspace.device.type == "cuda":
                    torch.cuda.synchronize(workspace.device)
                _low_latency.raise_recorded(workspace)
        finally:
            if normal is not None:
                normal.destroy()

    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: the low-latency kernels are built for SM90 (at first use)."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Sets the SM count of the communication kernels: the low-latency kernels' green-partition request (the
        communication side gets at least this many SMs, driver-aligned; the compute side the rest). Set it before
        a CUDA graph capture: a new request makes a new partition on the next call."""
        if integer("set_num_sms", "new_num_sms", new_num_sms, 2, MAX_SMS) % 2:
            raise ValueError(f"set_num_sms: new_num_sms must be even (two SMs per channel, DeepEP's rule), got "
                             f"{new_num_sms}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded on the current stream."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Workspace bytes for low-latency calls of these sizes with top-k up to 16 (BF16 receive stage) and the
        zero-copy combine's send rows. The sizes are checked as the calls check them (``ValueError`` / ``TypeError``
        naming the argument), so the hint is never negative, fractional, NaN or smaller than a call of these sizes
        needs; a multiple of :data:`BUFFER_ALIGNMENT_BYTES`, as DeepEP's; sizes whose hint is past the largest
        ``num_rdma_bytes`` (an ``int64_t``) raise ``ValueError`` naming them, so the hint is always a byte count
        ``Buffer`` accepts."""
        fn = "get_low_latency_rdma_size_hint"
        integer(fn, "num_ranks", num_ranks, 1, MAX_RANKS)  # the low-latency kernels' readiness table
        try:
            shape = _low_latency.ll_shape(num_ranks, num_max_dispatch_tokens_per_rank, hidden, num_experts, HINT_TOPK,
                                          ranks_arg="num_ranks")
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{fn}: {exc}") from exc
        size = aligned_bytes(required_bytes(shape, zero_copy=True))
        if size > _MAX_BYTES:
            raise ValueError(f"{fn}: num_max_dispatch_tokens_per_rank={shape.max_tokens}, hidden={shape.hidden} and "
                             f"num_experts={shape.num_experts} need more bytes than a Buffer takes (num_rdma_bytes "
                             f"<= {_MAX_BYTES}, DeepEP's int64_t): {shown(size)}")
        return size

    def _device(self, fn: str) -> torch.device:
        """The CUDA device the Buffer's kernels run on: its workspace's, else torch's current CUDA device."""
        for workspace in (self.workspace, None if self.normal is None else self.normal.workspace):
            if workspace is not None:
                device = workspace.device
                break
        else:
            if not torch.cuda.is_available():
                raise RuntimeError(f"{fn}: needs a CUDA device (the communication kernels run on one); none is "
                                   "visible to this process")
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type != "cuda":
            raise RuntimeError(f"{fn}: needs a CUDA device (the communication kernels run on one), the Buffer's "
                               f"workspace is on {device}")
        return device

    def get_comm_stream(self) -> torch.cuda.Stream:
        """The stream the communication kernels of both modes run on (DeepEP's communication stream).

        ``GC_MOE_DEEP_EP_PARTITION=on``: the stream of the communication green context of the partition that
        ``Buffer.num_sms`` requests on this thread (:func:`gc_moe_compat.runtime.green.get_partition`), as a
        ``torch.cuda.ExternalStream``; torch work queued on it runs on that partition's SMs. As with DeepEP, a call's
        kernels are queued on it after the caller's stream (or ``previous_event``) and after what was queued on it
        before; work queued on it after the call runs after them. The caller's stream waits for them (normal mode
        without ``async_finish``, and the low-latency mode always) or the call's event marks their end (normal mode
        with ``async_finish``). A normal-mode ``config`` whose ``num_sms`` differs from ``Buffer.num_sms`` requests
        another partition, whose stream this is not.

        ``GC_MOE_DEEP_EP_PARTITION=off`` (the default): the kernels run on the caller's current stream (DeepEP has
        a stream of its own; here the ordering it promises holds trivially), so this is torch's current stream on the
        Buffer's device: the one a call made now from this stream context runs on.
        """
        device = self._device("get_comm_stream")
        spaces = (self.workspace, None if self.normal is None else self.normal.workspace)
        if deep_ep_mode_of(next((w.placement for w in spaces if w is not None), None)) == "off":
            return torch.cuda.current_stream(device)
        return get_partition(Buffer.num_sms, device.index).comm.torch_stream(device.index)

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: torch.Size | None = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """A view of this rank's NVL buffer (the ``num_nvl_bytes`` of the normal mode's symmetric workspace region)
        as ``dtype``, starting at byte ``offset``: shaped ``size`` (a ``torch.Size`` or a sequence of ints), or 1-D
        over the whole elements from ``offset`` to the end when ``size`` is None. Writes through it are writes into
        the workspace (DeepEP's raw-buffer access); its first ``HEADER_BYTES`` hold the normal-mode kernels'
        persistent synchronization words and status records (:mod:`gc_moe_compat.comm.ep_normal`), the rest one
        call's exchanged counts and rows, so write only between calls, as with DeepEP. A call that grows the
        workspace (its rows did not fit: ``gc_moe_compat.deep_ep._normal``) replaces it, and a view taken before no
        longer aliases it.

        Divergence: DeepEP's default view has ``num_nvl_bytes // itemsize`` elements whatever ``offset`` (it runs
        ``offset`` bytes past the buffer); this one ends at the buffer's end. ``use_rdma_buffer=True`` raises
        ``NotImplementedError``: DeepEP's RDMA buffer is NVSHMEM memory."""
        fn = "get_local_buffer_tensor"
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"{fn}: dtype must be a torch.dtype, got {type(dtype).__name__} ({dtype!r})")
        boolean(fn, "use_rdma_buffer", use_rdma_buffer)
        if use_rdma_buffer:
            raise _missing(f"{fn}(use_rdma_buffer=True) (DeepEP's RDMA buffer is NVSHMEM/RDMA memory; the facade has "
                           "none)")
        return _local_view(fn, self._normal_mode(fn).buffer, dtype, size, offset)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP's recommended normal-mode dispatch config for ``num_ranks`` with ``Buffer.num_sms`` SMs."""
        return _normal.dispatch_config(num_ranks, Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """DeepEP's recommended normal-mode combine config for ``num_ranks`` with ``Buffer.num_sms`` SMs."""
        return _normal.combine_config(num_ranks, Buffer.num_sms)

    def _normal_mode(self, fn: str) -> _normal.NormalMode:
        if self.normal is None and self.num_nvl_bytes:
            raise ValueError(f"{fn}: the Buffer was destroyed")
        if self.normal is None:
            raise ValueError(f"{fn}: the normal mode needs a Buffer with num_nvl_bytes > 0 (size it with "
                             f"Config.get_nvl_buffer_size_hint), got num_nvl_bytes={self.num_nvl_bytes}")
        return self.normal

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event: EventOverlap | None = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False) -> tuple:
        """``(num_tokens_per_rank, None, num_tokens_per_expert, is_token_in_rank, event)`` of ``topk_idx``, by the
        layout kernel on the communication partition (:mod:`gc_moe_compat.deep_ep._normal`)."""
        return self._normal_mode("get_dispatch_layout").get_dispatch_layout(
            topk_idx, num_experts, previous_event, async_finish, allocate_on_comm_stream, Buffer.num_sms)

    def dispatch(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor], handle: tuple | None = None,
                 num_tokens_per_rank: torch.Tensor | None = None, num_tokens_per_rdma_rank: torch.Tensor | None = None,
                 is_token_in_rank: torch.Tensor | None = None, num_tokens_per_expert: torch.Tensor | None = None,
                 topk_idx: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Config | None = None,
                 previous_event: EventOverlap | None = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False) -> tuple:
        """DeepEP's intranode dispatch: ``(recv_x, recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, handle, event)`` (:mod:`gc_moe_compat.deep_ep._normal`)."""
        mode = self._normal_mode("dispatch")
        config = self.get_dispatch_config(self.group_size) if config is None else config
        return mode.dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                             num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                             config, previous_event, async_finish, allocate_on_comm_stream)

    def combine(self, x: torch.Tensor, handle: tuple, topk_weights: torch.Tensor | None = None,
                bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None, config: Config | None = None,
                previous_event: EventOverlap | None = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False) -> tuple:
        """DeepEP's intranode combine (an unweighted sum per token, plus ``bias``): ``(combined_x,
        combined_topk_weights, event)`` (:mod:`gc_moe_compat.deep_ep._normal`)."""
        mode = self._normal_mode("combine")
        config = self.get_combine_config(self.group_size) if config is None else config
        return mode.combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                            allocate_on_comm_stream)

    def internode_dispatch(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor], handle: tuple | None = None,
                           num_tokens_per_rank: torch.Tensor | None = None,
                           num_tokens_per_rdma_rank: torch.Tensor | None = None,
                           is_token_in_rank: torch.Tensor | None = None,
                           num_tokens_per_expert: torch.Tensor | None = None, topk_idx: torch.Tensor | None = None,
                           topk_weights: torch.Tensor | None = None, expert_alignment: int = 1,
                           config: Config | None = None, previous_event: EventOverlap | None = None,
                           async_finish: bool = False, allocate_on_comm_stream: bool = False) -> tuple:
        """Not implemented: internode dispatch runs over NVSHMEM/RDMA in DeepEP."""
        raise _missing("internode_dispatch (internode normal mode over NVSHMEM/RDMA)")

    def internode_combine(self, x: torch.Tensor, handle: tuple, topk_weights: torch.Tensor | None = None,
                          bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
                          config: Config | None = None, previous_event: EventOverlap | None = None,
                          async_finish: bool = False, allocate_on_comm_stream: bool = False) -> tuple:
        """Not implemented: internode combine runs over NVSHMEM/RDMA in DeepEP."""
        raise _missing("internode_combine (internode normal mode over NVSHMEM/RDMA)")

    def _low_latency_workspace(self, fn: str) -> SymmetricWorkspace:
        if not self.low_latency_mode:
            raise ValueError(f"{fn}: the Buffer was created with low_latency_mode=False")
        if self.workspace is None:
            raise ValueError(f"{fn}: the Buffer was destroyed")
        return self.workspace

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Checks the sizes against the workspace. Nothing needs zeroing: every synchronization word of the
        low-latency kernels is generation-tagged, so switching modes or sizes leaves no stale state to clean."""
        workspace = self._low_latency_workspace("clean_low_latency_buffer")
        _low_latency.check_sizes(workspace, num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
                             x_global_scale: torch.Tensor | None = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, use_nvfp4: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False
                             ) -> tuple[Any, torch.Tensor, tuple, EventOverlap, _Hook]:
        """Sends this rank's tokens to their experts' ranks: ``(recv_x, recv_count, handle, event, hook)`` with
        DeepEP's layout (``recv_x [E/P, P*Tmax, H]`` FP8 with column-major FP32 1x128 scales, or BF16 when
        ``use_fp8=False``; rows ``[0, recv_count[e])`` of expert ``e`` are valid, ordered by source rank, then
        token, then slot). ``round_scale`` and ``use_ue8m0`` shape the FP8 scales only: with ``use_fp8=False`` they
        are unused, as by DeepEP."""
        _flags("low_latency_dispatch", use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
               use_nvfp4=use_nvfp4, async_finish=async_finish, return_recv_hook=return_recv_hook)
        _no_async_hook("low_latency_dispatch", async_finish, return_recv_hook)
        workspace = self._low_latency_workspace("low_latency_dispatch")
        if dispatch_wait_recv_cost_stats is not None:
            raise _missing("dispatch_wait_recv_cost_stats")
        if x_global_scale is not None and not isinstance(x_global_scale, torch.Tensor):
            raise TypeError(f"low_latency_dispatch: x_global_scale must be a torch.Tensor or None, got "
                            f"{type(x_global_scale).__name__}")
        if use_nvfp4:  # x_global_scale is NVFP4's alone: without it, unused, as by DeepEP
            raise _missing("NVFP4 dispatch (use_nvfp4, x_global_scale)")
        recv_x, recv_count, handle, hook = _low_latency.dispatch(
            workspace, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
            recv_stats=cumulative_local_expert_recv_stats, use_fp8=use_fp8, round_scale=round_scale,
            use_ue8m0=use_ue8m0, async_finish=async_finish, return_recv_hook=return_recv_hook,
            shrink=self.enable_shrink, num_sms=Buffer.num_sms)
        return recv_x, recv_count, handle, _event(async_finish), hook

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: tuple, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: torch.Tensor | None = None, combine_wait_recv_cost_stats: torch.Tensor | None = None,
                            overlap: bool = False, src_signals: torch.Tensor | None = None,
                            src_signal_expect_value: int = 0, *, packed_recv_count: torch.Tensor | None = None,
                            comp_signal: torch.Tensor | None = None, block_m: int | None = None,
                            threshold: int | None = None, num_sms: int | None = None
                            ) -> tuple[torch.Tensor, EventOverlap, _Hook]:
        """Sums every token's expert outputs back on its rank: ``combined_x [T, H] = BF16(sum over valid slots, in
        slot order, of topk_weights * row)`` in FP32, as ``(combined_x, event, hook)``.

        ``packed_recv_count``, ``comp_signal``, ``block_m``, ``threshold`` and ``num_sms`` are the keyword names of
        SGLang's Hopper single-batch overlap; they are accepted so the call binds, and ``overlap=True`` raises
        ``NotImplementedError`` (the operator's green-context overlap replaces that scheme)."""
        _flags("low_latency_combine", use_logfmt=use_logfmt, zero_copy=zero_copy, async_finish=async_finish,
               return_recv_hook=return_recv_hook, overlap=overlap)
        _no_async_hook("low_latency_combine", async_finish, return_recv_hook)
        integer("low_latency_combine", "src_signal_expect_value", src_signal_expect_value, 0, (1 << 32) - 1)
        workspace = self._low_latency_workspace("low_latency_combine")
        if use_logfmt:
            raise _missing("use_logfmt (LogFMT combine)")
        if combine_wait_recv_cost_stats is not None:
            raise _missing("combine_wait_recv_cost_stats")
        if overlap or src_signals is not None or comp_signal is not None:
            raise _missing("single-batch overlap (overlap, src_signals, comp_signal); run SGLang without "
                           "--enable-single-batch-overlap")
        combined, hook = _low_latency.combine(workspace, x, topk_idx, topk_weights, handle, out=out,
                                              zero_copy=zero_copy, async_finish=async_finish,
                                              return_recv_hook=return_recv_hook, shrink=self.enable_shrink,
                                              num_sms=Buffer.num_sms)
        return combined, _event(async_finish), hook

    def _shrink_workspace(self, fn: str) -> SymmetricWorkspace:
        workspace = self._low_latency_workspace(fn)
        if not self.enable_shrink:
            raise ValueError(f"{fn}: the Buffer was created with enable_shrink=False (rank masking needs True)")
        return workspace

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Masks (``mask=True``) or unmasks ``rank_to_mask``: the low-latency kernels neither wait for nor send to a
        masked rank (its rows count as zero, its experts' combine slots are skipped). A rank that times out is
        masked by the kernels themselves."""
        _low_latency.update_mask(self._shrink_workspace("low_latency_update_mask_buffer"), rank_to_mask, mask)

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Writes every rank's mask status (1 = masked) into ``mask_status``: an int32 tensor of ``num_ranks``
        elements (DeepEP checks the element count, not the shape: rank ``r`` lands in element ``r`` in row-major
        order) on the Buffer's device, of any strides whose elements do not alias."""
        _low_latency.query_mask(self._shrink_workspace("low_latency_query_mask_buffer"), mask_status)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmasks every rank."""
        _low_latency.clean_mask(self._shrink_workspace("low_latency_clean_mask_buffer"))

    def get_next_low_latency_combine_buffer(self, handle: object) -> torch.Tensor:
        """The BF16 ``[num_local_experts, num_ranks * Tmax, hidden]`` send rows of the next zero-copy combine with
        ``handle``, in the workspace: write the expert outputs there and call ``low_latency_combine(...,
        zero_copy=True)``."""
        workspace = self._low_latency_workspace("get_next_low_latency_combine_buffer")
        return _low_latency.next_combine_buffer(workspace, handle)

    @property
    def low_latency_partition(self) -> dict[str, object]:
        """Where the low-latency kernels run: ``partition`` (``on``: the communication green context; ``off``:
        the caller's stream, ``GC_MOE_DEEP_EP_PARTITION=off``, the default), ``dispatch_sms`` (the SMs they use)
        and ``compute_sms`` (those left to the compute partition), the request ``Buffer.num_sms`` and the driver's
        split details. An attribute, not a method: the facade adds no method to DeepEP's API."""
        workspace = self._low_latency_workspace("low_latency_partition")
        return _low_latency.partition_report(workspace, Buffer.num_sms)
