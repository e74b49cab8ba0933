"""Where a group's ranks run: how many of them share this rank's GPU, whether CUDA MPS serves the GPU, and the host
backend that follows from it.

Several ranks on one GPU (P processes on one H200 under CUDA MPS) is a supported mode for tests and shared-GPU
measurements. torch symmetric memory and NCCL both refuse two ranks on one device, so:

* the symmetric workspace rendezvouses through CUDA IPC handles instead (:mod:`gc_moe_compat.runtime.workspace`);
* host collectives use gloo (:func:`host_backend`, :func:`init_rank_group`);
* the operator runs with the partition off and its grids sized to the rank's share of the SMs
  (:func:`gc_moe_compat.runtime.split.shared_device_sms`), because green contexts do not confine under MPS and
  ranks that spin on each other must all be resident at once.

The placement is found once per buffer with one ``all_gather_object`` of the device UUIDs over the group.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from cuda.bindings import driver

from .cuda import call, device
from .split import deep_ep_partition_mode

log = logging.getLogger(__name__)

SHARED_GPU_LABEL = "ranks on one GPU under CUDA MPS: no NVLink"
"""How results measured with several ranks on one GPU are labelled (meta, tables, plot titles): never an NVLink
figure."""


@dataclass(frozen=True)
class Placement:
    """The GPU of every rank of a group (by UUID) and this rank's index in it."""

    rank: int
    device_uuids: tuple[str, ...]

    @property
    def world_size(self) -> int:
        return len(self.device_uuids)

    @property
    def ranks_on_device(self) -> int:
        """How many ranks of the group (this one included) run on this rank's GPU."""
        return self.device_uuids.count(self.device_uuids[self.rank])

    @functools.cached_property
    def shares_device(self) -> bool:
        """True when any two ranks of the group share a GPU (then no rank may use torch symmetric memory); computed
        once (every eager deep_ep call asks)."""
        return len(set(self.device_uuids)) < self.world_size

    @property
    def rendezvous(self) -> str:
        """How the workspace maps its peers: ``local`` (one rank), ``cuda-ipc`` (ranks share a GPU) or
        ``torch-symm-mem``."""
        if self.world_size == 1:
            return "local"
        return "cuda-ipc" if self.shares_device else "torch-symm-mem"


def device_uuid(index: int) -> str:
    """The UUID of CUDA device ``index`` as torch reports it."""
    return str(torch.cuda.get_device_properties(index).uuid)


def placement(group: dist.ProcessGroup | None, index: int) -> Placement:
    """This rank's :class:`Placement` in ``group`` (collective: every rank calls it), its GPU being ``index``.

    Over an NCCL group whose ranks share a GPU the exchange fails in NCCL ("Duplicate GPU detected"): that error is
    re-raised naming the fix (a gloo group, :func:`init_rank_group`)."""
    own = device_uuid(index)
    world = dist.get_world_size(group) if group is not None else 1
    if world == 1:
        return Placement(rank=0, device_uuids=(own,))
    uuids: list[object] = [None] * world
    try:
        dist.all_gather_object(uuids, own, group=group)
    except (RuntimeError, dist.DistBackendError) as err:
        raise RuntimeError(
            f"group: exchanging the ranks' GPU ids over the {dist.get_backend(group)} group failed ({err}); ranks "
            "that share a GPU need a gloo group (NCCL refuses two ranks on one device): "
            "gc_moe_compat.runtime.colocation.init_rank_group picks the backend") from err
    return Placement(rank=dist.get_rank(group), device_uuids=tuple(str(u) for u in uuids))


def deep_ep_mode_of(where: Placement | None) -> str:
    """The partition mode of the ``deep_ep`` facade's kernels whose workspace is at ``where``:
    :func:`~gc_moe_compat.runtime.split.deep_ep_partition_mode`, and ``off`` wherever ranks share the GPU: green
    contexts do not confine under MPS, and the ranks' grids are sized to their share of the SMs instead."""
    return "off" if where is not None and where.shares_device else deep_ep_partition_mode()


def mps_enabled(index: int) -> bool:
    """Whether contexts on CUDA device ``index`` are served by CUDA MPS (``CU_DEVICE_ATTRIBUTE_MPS_ENABLED``)."""
    attr = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MPS_ENABLED
    return bool(call(driver.cuDeviceGetAttribute, attr, device(index)))


def describe(where: Placement, index: int) -> dict[str, object]:
    """What result files' meta and the facades' reports record about the placement."""
    info: dict[str, object] = {"rendezvous": where.rendezvous, "ranks_on_device": where.ranks_on_device}
    if where.shares_device:
        info["mps"] = mps_enabled(index)
        info["label"] = f"{where.ranks_on_device} {SHARED_GPU_LABEL}"
    return info


def ranks_per_device(local_world_size: int, device_count: int) -> int:
    """Ranks of one host on each GPU when ``local_world_size`` processes share ``device_count`` GPUs (ceil)."""
    if local_world_size < 1 or device_count < 1:
        raise ValueError(f"local_world_size and device_count must be >= 1, got {local_world_size}, {device_count}")
    return -(-local_world_size // device_count)


def host_backend(local_world_size: int, device_count: int) -> tuple[str, str | None]:
    """The process-group backend for ``local_world_size`` ranks on ``device_count`` GPUs, and why gloo when it is:
    NCCL when every rank has a GPU of its own, gloo when ranks share one (NCCL refuses that)."""
    per = ranks_per_device(local_world_size, device_count)
    if per == 1:
        return "nccl", None
    return "gloo", (f"{local_world_size} ranks share {device_count} GPU(s) ({per} per GPU): NCCL refuses two ranks "
                    "on one device, so host collectives use gloo")


def local_device(local_rank: int, local_world_size: int, device_count: int) -> int:
    """The GPU of local rank ``local_rank``: consecutive ranks fill one GPU before the next."""
    return local_rank // ranks_per_device(local_world_size, device_count)


def init_rank_group() -> torch.device:
    """Joins torchrun's group (``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` and the rendezvous variables) on this rank's
    GPU with the backend :func:`host_backend` picks, logging once why when it is gloo; returns the device (also made
    current)."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    count = torch.cuda.device_count()
    dev = torch.device("cuda", local_device(local, local_world, count))
    torch.cuda.set_device(dev)
    backend, reason = host_backend(local_world, count)
    if reason is not None and local == 0:
        log.warning("gc_moe_compat: %s", reason)
    dist.init_process_group(backend, **({"device_id": dev} if backend == "nccl" else {}))
    return dev
