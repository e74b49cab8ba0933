"""Green-context partitions: the device split into a communication and a compute partition.

A :class:`Partition` owns two green contexts made from one driver-aligned SM split (see :mod:`.split`), the
``CUcontext`` of each (for graph kernel nodes) and one non-blocking stream per context. Balanced workqueues are
requested when the driver supports them; otherwise the fallback is logged and visible as ``workqueue_mode``.
Partitions are cached per (thread, device, current CUDA context, request) by :func:`get_partition`.
"""

from __future__ import annotations

import atexit
import enum
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from cuda.bindings import driver

from .cuda import CudaError, call, current_context, device
from .split import (
    PartitionError,
    PartitionPlan,
    SplitPlan,
    dispatch_request,
    plan_split,
    shared_device_sms,
    validate_split,
)

log = logging.getLogger(__name__)

WORKQUEUE_BALANCED = "balanced"
WORKQUEUE_DEFAULT = "default"


class Role(enum.Enum):
    """Which partition a kernel runs on."""

    COMM = "comm"
    COMPUTE = "compute"


@dataclass
class GreenSide:
    """One green context of a partition: its handles and SM count."""

    role: Role
    sm_count: int
    green_ctx: driver.CUgreenCtx
    ctx: driver.CUcontext
    stream: driver.CUstream

    def torch_stream(self, device_index: int) -> torch.cuda.ExternalStream:
        """This context's stream as a torch stream (torch work queued on it runs on this partition's SMs)."""
        return torch.cuda.ExternalStream(int(self.stream), device=torch.device("cuda", device_index))


def _workqueue_resource(dev: driver.CUdevice) -> driver.CUdevResource:
    res = driver.CUdevResource()
    res.type = driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_WORKQUEUE_CONFIG
    res.wqConfig.device = dev
    res.wqConfig.sharingScope = driver.CUdevWorkqueueConfigScope.CU_WORKQUEUE_SCOPE_GREEN_CTX_BALANCED
    res.wqConfig.wqConcurrencyLimit = 1
    return res


def _descriptors(
    dev: driver.CUdevice, sm_resources: list[driver.CUdevResource]
) -> tuple[str, str | None, list[driver.CUdevResourceDesc]]:
    """Resource descriptors for each SM resource: with a balanced workqueue config if the driver takes it.

    Returns (workqueue mode, fallback reason or None, descriptors).
    """
    try:
        descs = [call(driver.cuDevResourceGenerateDesc, [sm, _workqueue_resource(dev)], 2) for sm in sm_resources]
        return WORKQUEUE_BALANCED, None, descs
    except CudaError as err:
        if err.result != driver.CUresult.CUDA_ERROR_INVALID_RESOURCE_TYPE:
            raise
        reason = f"balanced workqueues unavailable ({err.name}); plain SM partitioning"
        log.warning("gc_moe_compat green contexts: %s", reason)
    return WORKQUEUE_DEFAULT, reason, [call(driver.cuDevResourceGenerateDesc, [sm], 1) for sm in sm_resources]


class Partition:
    """The device split into a communication and a compute green context.

    Built from a dispatch SM request (see :func:`.split.dispatch_request`). ``comm`` and ``compute`` hold the
    contexts; ``plan`` the obtained SM counts; ``workqueue_mode`` is ``"balanced"`` or ``"default"``.
    """

    def __init__(self, device_index: int, request: int) -> None:
        self.device_index = device_index
        self.request = request
        self._closed = False
        self._on_close: list[Callable[[Partition], None]] = []
        dev = device(device_index)
        self._dev = dev
        sm = call(driver.cuDeviceGetDevResource, dev, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM)
        self.alignment = int(sm.sm.smCoscheduledAlignment)
        self.min_partition = int(sm.sm.minSmPartitionSize)
        target = plan_split(int(sm.sm.smCount), self.alignment, self.min_partition, request)
        groups, n_groups, remainder = call(driver.cuDevSmResourceSplitByCount, 1, sm, 0, target.compute_sms)
        if n_groups != 1:
            raise PartitionError(f"cuDevSmResourceSplitByCount made {n_groups} groups, not 1")
        compute_res = groups[0]
        self.plan: SplitPlan = validate_split(
            int(sm.sm.smCount), int(remainder.sm.smCount), int(compute_res.sm.smCount)
        )
        self.workqueue_mode, self.workqueue_fallback_reason, descs = _descriptors(dev, [remainder, compute_res])
        self.comm = self._make_side(Role.COMM, int(remainder.sm.smCount), descs[0])
        try:
            self.compute = self._make_side(Role.COMPUTE, int(compute_res.sm.smCount), descs[1])
        except CudaError:
            _destroy(self.comm)  # nothing ran on it yet
            raise
        log.info("gc_moe_compat partition on cuda:%d: %s", device_index, self.describe())

    def _make_side(self, role: Role, sm_count: int, desc: driver.CUdevResourceDesc) -> GreenSide:
        flags = driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM
        green_ctx = call(driver.cuGreenCtxCreate, desc, self._dev, flags)
        try:
            ctx = call(driver.cuCtxFromGreenCtx, green_ctx)
            stream = call(driver.cuGreenCtxStreamCreate, green_ctx, driver.CUstream_flags.CU_STREAM_NON_BLOCKING, 0)
        except CudaError:
            call(driver.cuGreenCtxDestroy, green_ctx)
            raise
        return GreenSide(role=role, sm_count=sm_count, green_ctx=green_ctx, ctx=ctx, stream=stream)

    @property
    def dispatch_sms(self) -> int:
        return self.plan.dispatch_sms

    @property
    def compute_sms(self) -> int:
        return self.plan.compute_sms

    @property
    def key(self) -> tuple[int, int, int, str]:
        """Identity of this resource state for cache keys: (device, dispatch SMs, compute SMs, workqueue mode)."""
        return (self.device_index, self.dispatch_sms, self.compute_sms, self.workqueue_mode)

    @property
    def closed(self) -> bool:
        return self._closed

    def side(self, role: Role) -> GreenSide:
        """The green context of ``role``."""
        self._require_open()
        return self.comm if role is Role.COMM else self.compute

    def describe(self) -> dict[str, object]:
        """The partition actually obtained, as recorded in benchmark metadata."""
        return {
            "dispatch_sms": self.dispatch_sms,
            "compute_sms": self.compute_sms,
            "total_sms": self.plan.total_sms,
            "requested_dispatch_sms": self.request,
            "alignment": self.alignment,
            "workqueue": self.workqueue_mode,
            "workqueue_fallback_reason": self.workqueue_fallback_reason,
        }

    def on_close(self, callback: Callable[[Partition], None]) -> None:
        """Registers ``callback`` to run before the contexts are destroyed (caches drop their graphs there)."""
        self._on_close.append(callback)

    def _require_open(self) -> None:
        if self._closed:
            raise RuntimeError("gc_moe_compat partition used after close()")

    def close(self) -> None:
        """Retires and destroys both contexts: runs the close callbacks, records a retirement event per green
        context (all work submitted to it), waits for it, then destroys the streams and the contexts."""
        if self._closed:
            return
        self._closed = True
        for callback in self._on_close:
            callback(self)
        self._on_close.clear()
        primary = call(driver.cuDevicePrimaryCtxRetain, self._dev)
        call(driver.cuCtxPushCurrent, primary)
        try:
            for side in (self.comm, self.compute):
                event = call(driver.cuEventCreate, driver.CUevent_flags.CU_EVENT_DISABLE_TIMING)
                try:
                    call(driver.cuGreenCtxRecordEvent, side.green_ctx, event)
                    call(driver.cuEventSynchronize, event)
                finally:
                    call(driver.cuEventDestroy, event)
                _destroy(side)
        finally:
            call(driver.cuCtxPopCurrent)
            call(driver.cuDevicePrimaryCtxRelease, self._dev)


def _destroy(side: GreenSide) -> None:
    """Waits for the side's stream, then destroys it and the green context."""
    call(driver.cuStreamSynchronize, side.stream)
    call(driver.cuStreamDestroy, side.stream)
    call(driver.cuGreenCtxDestroy, side.green_ctx)


_cache: dict[tuple[int, int, int, int], Partition] = {}
_cache_lock = threading.Lock()


def get_partition(dispatch_sms: int | None = None, device_index: int | None = None) -> Partition:
    """The cached partition for (this thread, device, current CUDA context, dispatch request).

    ``dispatch_sms`` overrides the environment (see :func:`.split.dispatch_request`); ``device_index`` defaults to
    torch's current device.
    """
    index = torch.cuda.current_device() if device_index is None else device_index
    torch.cuda.init()
    request = dispatch_request(dispatch_sms)
    key = (threading.get_ident(), index, current_context(), request)
    with _cache_lock:
        part = _cache.get(key)
        if part is None or part.closed:
            part = Partition(index, request)
            _cache[key] = part
        return part


def plan_partition(mode: str, request: int, ranks_on_device: int = 1, reason: str | None = None,
                   device_index: int | None = None) -> PartitionPlan:
    """The :class:`~.split.PartitionPlan` of a buffer on CUDA device ``device_index`` (default: torch's current).

    ``on``: the cached green partition for ``request`` (driver-aligned; made now, so the launches reuse it).
    ``off``: role1 keeps a grid of ``request`` CTAs and role2/role3 get every SM, or this rank's share of them when
    ``ranks_on_device`` ranks share the GPU (:func:`.split.shared_device_sms`; only the partition off runs there).
    """
    index = torch.cuda.current_device() if device_index is None else device_index
    if mode == "off":
        total = torch.cuda.get_device_properties(index).multi_processor_count
        compute = total if ranks_on_device == 1 else shared_device_sms(total, ranks_on_device, request)
        return PartitionPlan("off", request, request, compute, ranks_on_device, reason)
    if ranks_on_device > 1:
        raise PartitionError(f"partition 'on' with {ranks_on_device} ranks on one GPU: green contexts do not confine "
                             "under CUDA MPS; ranks sharing a GPU run with the partition off")
    part = get_partition(request, index)
    return PartitionPlan("on", request, part.dispatch_sms, part.compute_sms, ranks_on_device, reason)


def launch_partition(plan: PartitionPlan, device_index: int) -> Partition | None:
    """The green partition the launches of ``plan`` run on (the cached one its request made), None when it is
    ``off``."""
    return get_partition(plan.request, device_index) if plan.mode == "on" else None


def close_all_partitions() -> None:
    """Tears down every cached partition (registered to run at interpreter exit)."""
    with _cache_lock:
        parts = list(_cache.values())
        _cache.clear()
    for part in parts:
        part.close()


atexit.register(close_all_partitions)
