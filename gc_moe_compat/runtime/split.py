"""The partition settings and the pure arithmetic of the SM split between the communication (dispatch) and compute
partitions.

Settings: ``GC_MOE_PARTITION`` (:func:`partition_mode`: ``on`` runs role1 on the communication green context,
``off`` every role on the whole device, in sequence, ``auto`` (the default) picks one of the two per call from the
operator's measured rule), ``GC_MOE_DEEP_EP_PARTITION`` (:func:`deep_ep_partition_mode`:
the same choice for the ``deep_ep`` facade's kernels, off by default) and the dispatch SM request
(:func:`dispatch_request`: argument > ``GC_MOE_DISPATCH_SMS`` > ``GC_MOE_SM90_DISPATCH_SMS`` > 4). Kept free of
driver calls so that CI can test it on a machine without a GPU: the driver-facing code in
:mod:`gc_moe_compat.runtime.green` applies the same rules to what ``cuDeviceGetDevResource`` reports
(and :func:`~gc_moe_compat.runtime.green.plan_partition` answers what the roles get in each mode).
"""

from __future__ import annotations

from dataclasses import dataclass

from .env import env_get

#: The paper's SM90 default dispatch SM request (overridable with ``GC_MOE_SM90_DISPATCH_SMS``).
SM90_DEFAULT_DISPATCH_SMS = 4
MIN_COMPUTE_SMS = 32
MIN_DISPATCH_SMS = 2
DISPATCH_ENV = ("GC_MOE_DISPATCH_SMS", "GC_MOE_SM90_DISPATCH_SMS")
"""The environment variables of the dispatch SM request, first wins."""


class PartitionError(ValueError):
    """A requested or obtained SM split breaks a partition rule; the message names the rule and the values."""


@dataclass(frozen=True)
class SplitPlan:
    """SM counts of one split: ``dispatch_sms + compute_sms == total_sms``."""

    total_sms: int
    dispatch_sms: int
    compute_sms: int


@dataclass(frozen=True)
class PartitionPlan:
    """Where one buffer's roles run, decided once when the buffer is made and passed down to every launch.

    ``mode``: ``on`` (role1 on the communication green context, role2/role3 on the compute one) or ``off`` (in
    sequence on the whole device, or on this rank's share of it). ``request``: the dispatch SM request the green
    partition is made (and cached) for. ``dispatch_sms`` / ``compute_sms``: the SMs the launches get (the driver's
    aligned split when ``on``). ``ranks_on_device``: ranks of the group on this GPU; ``reason``: why the mode is
    ``off`` when it was forced (ranks sharing a GPU). ``sequential_max_tokens``: with ``on``, calls of at most this
    many tokens run with the partition off instead (``GC_MOE_PARTITION=auto``'s per-call rule; 0: none)."""

    mode: str
    request: int
    dispatch_sms: int
    compute_sms: int
    ranks_on_device: int = 1
    reason: str | None = None
    sequential_max_tokens: int = 0

    def describe(self) -> dict[str, object]:
        """The plan as result files' meta and the buffers' reports record it."""
        return {"partition": self.mode, "partition_reason": self.reason, "requested_dispatch_sms": self.request,
                "dispatch_sms": self.dispatch_sms, "compute_sms": self.compute_sms,
                "sequential_max_tokens": self.sequential_max_tokens}


def _env_int(name: str) -> int | None:
    raw = env_get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise PartitionError(f"{name} must be an integer SM count, got {raw!r}") from None


def dispatch_request(explicit: int | None = None) -> int:
    """The dispatch SM request: explicit argument > ``GC_MOE_DISPATCH_SMS`` > ``GC_MOE_SM90_DISPATCH_SMS`` > 4."""
    if explicit is not None:
        return int(explicit)
    for name in DISPATCH_ENV:
        value = _env_int(name)
        if value is not None:
            return value
    return SM90_DEFAULT_DISPATCH_SMS


PARTITION_ENV = "GC_MOE_PARTITION"
PARTITION_MODES = ("auto", "on", "off")
"""The operator's modes: ``auto`` picks ``on`` or ``off`` per call (the operator's rule), the others force one."""


DEEP_EP_PARTITION_ENV = "GC_MOE_DEEP_EP_PARTITION"
DEEP_EP_PARTITION_MODES = ("on", "off")


def env_choice(name: str, default: str, choices: tuple[str, ...], what: str = "green-context split") -> str:
    """Environment variable ``name`` as set now: ``default`` when unset or blank, else one of ``choices``; another
    value raises ``ValueError`` naming the variable, the choices and ``what`` it selects."""
    raw = (env_get(name) or "").strip()
    if raw == "":
        return default
    if raw not in choices:
        raise ValueError(f"{name}: must be one of {choices} ({what}), got {raw!r}")
    return raw


def partition_mode(partition: str | bool | None = None) -> str:
    """The operator's mode, ``"auto"``, ``"on"`` or ``"off"``: the argument (a mode string, or a bool for on/off)
    wins, else ``GC_MOE_PARTITION``, else ``"auto"``."""
    if partition is None:
        return env_choice(PARTITION_ENV, "auto", PARTITION_MODES)
    if isinstance(partition, bool):
        return "on" if partition else "off"
    if not isinstance(partition, str):
        raise TypeError(f"partition: must be one of {PARTITION_MODES}, a bool or None, got "
                        f"{type(partition).__name__}")
    if partition not in PARTITION_MODES:
        raise ValueError(f"partition: must be one of {PARTITION_MODES} (green-context split per call, on, off), "
                         f"got {partition!r}")
    return partition


def deep_ep_partition_mode() -> str:
    """Where the ``deep_ep`` facade's kernels run, ``"on"`` (the communication green partition that
    ``Buffer.num_sms`` / ``config.num_sms`` request) or ``"off"`` (the caller's stream; low-latency grids over the
    whole device, normal-mode grids of ``config.num_sms`` CTAs, as DeepEP's): ``GC_MOE_DEEP_EP_PARTITION``, else
    ``"off"``. Off by default because it was faster everywhere it was measured on one H200 (bench/README.md): eager
    low-latency kernels took 4.6x as long on the 20-SM partition as with full-device grids, and beside a concurrent
    GEMM the partitioned dispatch + combine made the whole step 0.3-13 % slower."""
    return env_choice(DEEP_EP_PARTITION_ENV, "off", DEEP_EP_PARTITION_MODES)


def validate_split(total_sms: int, dispatch_sms: int, compute_sms: int) -> SplitPlan:
    """Checks the partition rules on a split (planned or obtained from the driver) and returns it as a plan."""
    if compute_sms < MIN_COMPUTE_SMS:
        raise PartitionError(f"compute partition needs >= {MIN_COMPUTE_SMS} SMs, got {compute_sms}")
    if compute_sms % 2:
        raise PartitionError(f"compute partition needs an even SM count, got {compute_sms}")
    if dispatch_sms < MIN_DISPATCH_SMS:
        raise PartitionError(f"dispatch partition needs >= {MIN_DISPATCH_SMS} SMs, got {dispatch_sms}")
    if dispatch_sms + compute_sms != total_sms:
        raise PartitionError(
            f"partitions must cover the device: {dispatch_sms} dispatch + {compute_sms} compute != {total_sms} SMs"
        )
    return SplitPlan(total_sms=total_sms, dispatch_sms=dispatch_sms, compute_sms=compute_sms)


def shared_device_sms(total_sms: int, ranks_on_device: int, dispatch_sms: int) -> int:
    """The SMs one rank's kernels may fill when ``ranks_on_device`` ranks share a ``total_sms`` GPU: an even
    ``floor(total / ranks)``.

    Why this bound is the partition rule there: green contexts do not confine under CUDA MPS, and with the partition
    off a rank has one kernel resident at a time (role1 with ``dispatch_sms`` CTAs, then role2, then role3, each at
    most this many). The ranks' kernels together then hold at most ``total_sms`` CTAs, each fitting an empty SM, so
    every CTA that spins for a peer and every CTA it waits for are resident at once: none can starve another."""
    if ranks_on_device < 1:
        raise PartitionError(f"ranks on one device must be >= 1, got {ranks_on_device}")
    share = total_sms // ranks_on_device // 2 * 2
    if share < MIN_DISPATCH_SMS or dispatch_sms > share:
        raise PartitionError(f"{ranks_on_device} ranks on one {total_sms}-SM GPU leave {share} SMs per rank, fewer "
                             f"than role1's {max(dispatch_sms, MIN_DISPATCH_SMS)} CTAs (the dispatch SM request)")
    return share


def plan_split(total_sms: int, alignment: int, min_partition: int, request: int) -> SplitPlan:
    """Plans the driver-aligned split for a dispatch request.

    compute = floor((total - request) / alignment) * alignment; the remainder (>= request) is communication.
    ``alignment`` and ``min_partition`` are the device's ``smCoscheduledAlignment`` and ``minSmPartitionSize``.
    """
    if total_sms <= 0 or alignment <= 0 or min_partition <= 0:
        raise PartitionError(
            f"device SM resource must be positive: total={total_sms}, alignment={alignment}, min={min_partition}"
        )
    if request < MIN_DISPATCH_SMS:
        raise PartitionError(f"dispatch SM request must be >= {MIN_DISPATCH_SMS}, got {request}")
    if request >= total_sms:
        raise PartitionError(f"dispatch SM request {request} leaves no compute SMs on a {total_sms}-SM device")
    compute = (total_sms - request) // alignment * alignment
    if compute < min_partition:
        raise PartitionError(
            f"compute partition of {compute} SMs is below the driver's minimum partition of {min_partition} SMs"
        )
    return validate_split(total_sms, total_sms - compute, compute)
