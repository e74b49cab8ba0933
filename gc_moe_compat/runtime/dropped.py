"""Records of invalid inputs a kernel dropped: values only the device sees, reported by the next eager call.

Some inputs cannot be checked on the host before a launch: routing staged inside a CUDA-graph capture (a host read
would break it), or on a latency-critical path that must not synchronize (the ``deep_gemm`` facade's pre-dispatch and
``fp8_mega_moe``, the native API with ``check_values=False``). The kernels that read such values never act on an
invalid one: they drop it (an expert id outside ``[-1, E)`` or a non-finite routing weight becomes the unused slot
``(-1, 0.0)``; a token whose BF16 activations hold a NaN or Inf, which no FP8 scale represents, has every slot
unused), so nothing is read or written out of bounds, and they record the first drop here. Unlike a role's
status record, a drop does not make the operator's other waits give up: the layer completes without the slot.

One record per device, for the process's lifetime (the kernels' by-value arguments, and so captured graphs, hold its
addresses): a :class:`~gc_moe_compat.runtime.status.KernelStatus` in device memory that the first dropping thread
claims (atomic CAS), and a copy of it in pinned host memory (:attr:`DroppedRecord.mirror`) that the claiming thread
writes through its unified address, so the host reads it without a synchronization. The next eager call on the
device (:meth:`DroppedRecord.raise_if_dropped`) raises ``DeviceCheckError`` naming the site and the value, then
clears both; the mirror may lag the device by the launches still in flight (an eager operator call waits for its
graph first, so it sees everything launched before it). :class:`DroppedSite` is generated into
kernels/common/dropped.cuh (``report_dropped``).
"""

from __future__ import annotations

import ctypes
import struct

import torch

from gc_moe_compat.runtime.status import STATUS_OK, DeviceCheckError, KernelStatus, StatusSite

__all__ = ["DroppedRecord", "DroppedSite", "dropped_record", "header_block"]


class DroppedSite(StatusSite):
    """Where a kernel dropped an invalid input (``gc_moe::DroppedSite``, kernels/common/dropped.cuh)."""

    PREDISPATCH_ID = 1, ("pre-dispatch: a topk_idx entry (observed) outside [-1, id_max] (expected: the largest "
                         "valid id, the buffer's num_experts - 1 or, for views of no facade buffer, buf_topk_idx's "
                         "integer maximum)")
    PREDISPATCH_WEIGHT = 2, ("pre-dispatch: topk_weights * routed_scaling_factor is not finite in FP32 (observed: its "
                             "bits; expected: the entry's index token * k + slot)")
    ROLE1_EXPERT = 3, "role1 dispatch: a staged topk_idx entry (observed) outside [-1, num_experts) (expected)"
    ROLE1_WEIGHT = 4, ("role1 dispatch: a staged topk_weights entry is not finite (observed: its FP32 bits; "
                       "expected: the entry's index token * k + slot)")
    PREDISPATCH_X = 5, ("pre-dispatch: a row of x (observed: the row, its token) holds a NaN or Inf (expected: the "
                        "column of one such value); the whole token was dropped (every slot unused, zero payload)")


_SIGNED = {DroppedSite.PREDISPATCH_ID, DroppedSite.ROLE1_EXPERT}
"""Sites whose observed value is a signed expert id."""


def header_block() -> str:
    """The generated part of kernels/common/dropped.cuh: the C enum of :class:`DroppedSite`."""
    return DroppedSite.c_declaration("DroppedSite", "kDropped")


class DroppedRecord:
    """A device's record of dropped inputs: ``record`` (uint8 ``[32]`` on the device, claimed by CAS) and ``mirror``
    (its pinned host copy; plain host memory for a CPU device, where no kernel writes it)."""

    def __init__(self, device: torch.device) -> None:
        size = ctypes.sizeof(KernelStatus)
        self.device = device
        self.record = torch.zeros(size, dtype=torch.uint8, device=device)
        self.mirror = torch.zeros(size, dtype=torch.uint8, device="cpu", pin_memory=device.type == "cuda")

    @property
    def addresses(self) -> tuple[int, int]:
        """``(record, mirror)`` as the kernels take them (device address, unified address of the pinned copy)."""
        return self.record.data_ptr(), self.mirror.data_ptr()

    def raise_if_dropped(self, what: str) -> None:
        """Raises ``DeviceCheckError`` for a recorded drop (naming ``what``, the site and the value) after clearing
        the record; no synchronization (reads the host mirror). Call outside graph capture only: the clearing of the
        device record is a stream operation."""
        saved = KernelStatus.from_buffer_copy(bytes(self.mirror.numpy().tobytes()))
        if saved.code == STATUS_OK:
            return
        self.mirror.zero_()
        self.record.zero_()
        observed: int = saved.observed
        if saved.site in _SIGNED:
            observed = struct.unpack("<q", struct.pack("<Q", observed))[0]
        site = DroppedSite.names().get(saved.site, f"site {saved.site}")
        raise DeviceCheckError(f"{what}: a launch on {self.device} before this check dropped an invalid input "
                               f"(treated as the unused slot (-1, 0.0)): {site}: observed {observed}, expected "
                               f"{saved.expected}")


_records: dict[torch.device, DroppedRecord] = {}


def dropped_record(device: torch.device) -> DroppedRecord:
    """The record of ``device`` (created on first use, outside capture; kept for the process: graphs hold its
    addresses). ``RuntimeError`` if the first use is inside a CUDA-graph capture."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    record = _records.get(device)
    if record is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"the record of dropped inputs on {device} is allocated on first use, which cannot be "
                               "inside a CUDA-graph capture: make one eager call first (creating a Mega MoE buffer "
                               "on the device also allocates it)")
        record = _records[device] = DroppedRecord(device)
    return record
