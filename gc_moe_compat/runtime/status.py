"""Host side of the kernels' error records (kernels/common/status.cuh).

Kernels never hang or trap on a failed wait: they write a :class:`KernelStatus` record and exit. The host reads the
record after the launch and raises :class:`DeviceTimeoutError` or :class:`DeviceCheckError` with its fields. Each
kernel's check sites are a :class:`StatusSite` enum on the host, generated into the kernel's header.
"""

from __future__ import annotations

import ctypes
import enum
from collections.abc import Iterable

import numpy as np
import torch

from gc_moe_compat.runtime.env import env_get
from gc_moe_compat.runtime.params import c_enum_declaration, c_identifier

STATUS_OK = 0
STATUS_TIMEOUT = 1
STATUS_MISMATCH = 2

_DEFAULT_TIMEOUT_MS = 10_000
SPIN_TIMEOUT_ENV = "GC_MOE_SPIN_TIMEOUT_MS"


class KernelStatus(ctypes.Structure):
    """Mirror of ``gc_moe::KernelStatus`` (32 bytes)."""

    _fields_ = [
        ("code", ctypes.c_uint32),
        ("site", ctypes.c_uint32),
        ("observed", ctypes.c_uint64),
        ("expected", ctypes.c_uint64),
        ("reserved", ctypes.c_uint64),
    ]


class StatusSite(enum.IntEnum):
    """Base of a kernel's status sites (the ``site`` of its :class:`KernelStatus` records): each member is
    ``value, description``. The enum is the one definition: :meth:`c_declaration` generates the kernel's C enum
    (the description as each constant's comment) and :meth:`names` the host's names for :func:`raise_for_status`.
    """

    description: str

    def __new__(cls, value: int, description: str) -> StatusSite:
        member = int.__new__(cls, value)
        member._value_ = value
        member.description = description
        return member

    @classmethod
    def names(cls) -> dict[int, str]:
        """``{site: description}`` of every member: the ``sites`` argument of :func:`raise_for_status`."""
        return {int(site): site.description for site in cls}

    @classmethod
    def c_declaration(cls, c_name: str, prefix: str, sites: Iterable[StatusSite] | None = None) -> str:
        """The C enum ``c_name`` of ``sites`` (default: every member), each named ``prefix`` + its CamelCase name
        (:func:`~gc_moe_compat.runtime.params.c_identifier`) and commented with its description."""
        sites = list(cls if sites is None else sites)
        members = {c_identifier(prefix, site.name): int(site) for site in sites}
        comments = {c_identifier(prefix, site.name): site.description for site in sites}
        return c_enum_declaration(c_name, members, f"{cls.__module__}.{cls.__qualname__}", comments)


class DeviceTimeoutError(TimeoutError):
    """A device spin-wait ran past its timeout: the producer it waited for never arrived (or arrived too late)."""


class DeviceCheckError(RuntimeError):
    """A device-side protocol check failed (a counter or payload did not hold the required value)."""


def status_codes(mirror: torch.Tensor) -> np.ndarray:
    """The ``code`` word of every record of a host status mirror (a contiguous CPU ``[K, sizeof(KernelStatus)]``
    uint8 tensor, pinned or not) as a numpy view of the same memory: ``np.count_nonzero(codes)`` is one read of the
    words the kernels store into, with no torch op, no device work and no synchronization, cheap enough for every
    call (a quarter of ``codes.any()``'s host time)."""
    if (mirror.device.type != "cpu" or mirror.dtype != torch.uint8 or mirror.dim() != 2
            or mirror.shape[1] != ctypes.sizeof(KernelStatus) or not mirror.is_contiguous()):
        raise ValueError(f"status mirror: must be a contiguous CPU uint8 [K, {ctypes.sizeof(KernelStatus)}] tensor, "
                         f"got {list(mirror.shape)} {mirror.dtype} on {mirror.device}")
    return mirror.numpy().view(np.uint32)[:, 0]


def spin_timeout_setting() -> str | None:
    """``GC_MOE_SPIN_TIMEOUT_MS`` as set now (None: unset): the key of what a caller caches from
    :func:`spin_timeout_ms`, so that a change of the variable is seen by the next call."""
    return env_get(SPIN_TIMEOUT_ENV)


def spin_timeout_ms(setting: str | None) -> float:
    """The spin timeout in milliseconds that ``setting`` (:func:`spin_timeout_setting`) gives: its value, or 10 s."""
    return _DEFAULT_TIMEOUT_MS if setting is None else float(setting)


def spin_timeout_ns(timeout_ms: float | None = None) -> int:
    """Timeout for device spin-waits: explicit argument > ``GC_MOE_SPIN_TIMEOUT_MS`` > 10 s."""
    if timeout_ms is None:
        timeout_ms = spin_timeout_ms(spin_timeout_setting())
    if timeout_ms <= 0:
        raise ValueError(f"spin timeout must be positive, got {timeout_ms} ms")
    return int(timeout_ms * 1_000_000)


def new_status(device: torch.device | int | str) -> torch.Tensor:
    """A zeroed status record on ``device`` (a uint8 tensor of ``sizeof(KernelStatus)`` bytes)."""
    return torch.zeros(ctypes.sizeof(KernelStatus), dtype=torch.uint8, device=device)


def read_status(status: torch.Tensor) -> KernelStatus:
    """Copies a status record to the host (synchronizes with the producing stream through torch)."""
    raw = bytes(status.cpu().numpy().tobytes())
    return KernelStatus.from_buffer_copy(raw)


def raise_for_status(status: torch.Tensor, what: str, sites: dict[int, str] | None = None) -> None:
    """Raises if the record in ``status`` holds an error; ``what`` names the launch, ``sites`` names check sites."""
    record = read_status(status)
    if record.code == STATUS_OK:
        return
    site = (sites or {}).get(record.site, f"site {record.site}")
    detail = f"{what}: {site}: observed {record.observed}, expected {record.expected}"
    if record.code == STATUS_TIMEOUT:
        raise DeviceTimeoutError(f"device spin-wait timed out in {detail} (peer or producer missing?)")
    if record.code == STATUS_MISMATCH:
        raise DeviceCheckError(f"device check failed in {detail}")
    raise DeviceCheckError(f"unknown device status code {record.code} in {detail}")
