"""The operator's symmetric workspace: one allocation per operator instance, named regions, and a peer table.

With more than one rank the buffer comes from torch symmetric memory (``empty`` + ``rendezvous``), so every rank
can address every peer's copy; kernels get a by-value :class:`PeerTable` (base address, per-rank offsets for up to
72 ranks, own rank) and reach rank ``r``'s region at ``base + offsets[r] + region_offset``. A group of one rank uses
a plain allocation. Regions are carved with alignment by :class:`LayoutPlanner`. A workspace is single-instance:
:meth:`SymmetricWorkspace.exclusive` rejects overlapping use.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gc_moe_compat.config import MAX_RANKS

DEFAULT_ALIGNMENT = 256


class PeerTable(ctypes.Structure):
    """Mirror of ``gc_moe::PeerTable`` (kernels/common/peer_table.cuh), passed to kernels by value (592 bytes)."""

    _fields_ = [
        ("base", ctypes.c_uint64),
        ("offsets", ctypes.c_int64 * MAX_RANKS),
        ("rank", ctypes.c_int32),
        ("world_size", ctypes.c_int32),
    ]


def make_peer_table(addresses: list[int], rank: int) -> PeerTable:
    """The peer table of a workspace whose rank ``r`` copy is mapped at ``addresses[r]`` in this process."""
    if not 1 <= len(addresses) <= MAX_RANKS:
        raise ValueError(f"peer table holds 1 to {MAX_RANKS} ranks, got {len(addresses)}")
    if not 0 <= rank < len(addresses):
        raise ValueError(f"rank {rank} outside a group of {len(addresses)}")
    table = PeerTable()
    table.base = addresses[rank]
    for r, address in enumerate(addresses):
        table.offsets[r] = address - addresses[rank]
    table.rank = rank
    table.world_size = len(addresses)
    return table


@dataclass(frozen=True)
class Region:
    """A named byte range of the workspace."""

    name: str
    offset: int
    nbytes: int


class LayoutPlanner:
    """Places named regions one after another, each at a multiple of its alignment (a power of two)."""

    def __init__(self) -> None:
        self._regions: dict[str, Region] = {}
        self._end = 0
        self._max_alignment = DEFAULT_ALIGNMENT

    def add(self, name: str, nbytes: int, alignment: int = DEFAULT_ALIGNMENT) -> Region:
        """Reserves ``nbytes`` for ``name``; raises ``ValueError`` on a duplicate name or a bad size/alignment."""
        if name in self._regions:
            raise ValueError(f"workspace region {name!r} already planned")
        if nbytes <= 0:
            raise ValueError(f"workspace region {name!r} needs a positive size, got {nbytes}")
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"workspace region {name!r} alignment must be a power of two, got {alignment}")
        offset = -(-self._end // alignment) * alignment
        region = self._regions[name] = Region(name, offset, nbytes)
        self._end = offset + nbytes
        self._max_alignment = max(self._max_alignment, alignment)
        return region

    @property
    def regions(self) -> dict[str, Region]:
        return dict(self._regions)

    @property
    def size(self) -> int:
        """Total bytes, rounded up to the largest alignment used."""
        return max(1, -(-self._end // self._max_alignment)) * self._max_alignment


class WorkspaceBusyError(RuntimeError):
    """A call tried to use a workspace that another call is using (the workspace is single-instance)."""


class SymmetricWorkspace:
    """One symmetric allocation laid out by a :class:`LayoutPlanner`, zeroed and rendezvoused across ``group``."""

    def __init__(
        self,
        layout: LayoutPlanner,
        group: dist.ProcessGroup | None = None,
        device: torch.device | int | None = None,
    ) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("symmetric workspace: needs a CUDA device (torch symmetric memory, peer stores over "
                               "NVLink); none is visible to this process")
        self.regions = layout.regions
        self.device = torch.device(
            "cuda", torch.cuda.current_device() if device is None else torch.device(device).index
        )
        self.world_size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        if self.world_size > MAX_RANKS:
            raise ValueError(f"workspace supports up to {MAX_RANKS} ranks, group has {self.world_size}")
        self._busy = threading.Lock()
        if self.world_size == 1:
            self.buffer = torch.zeros(layout.size, dtype=torch.uint8, device=self.device)
            addresses = [self.buffer.data_ptr()]
        else:
            from torch.distributed import _symmetric_memory as symm_mem

            self.buffer = symm_mem.empty(layout.size, dtype=torch.uint8, device=self.device)
            handle = symm_mem.rendezvous(self.buffer, group)
            self.buffer.zero_()
            torch.cuda.synchronize(self.device)
            dist.barrier(group)
            addresses = [int(p) for p in handle.buffer_ptrs]
        self.peer_table = make_peer_table(addresses, self.rank)

    def offset(self, name: str) -> int:
        """Byte offset of region ``name`` (what kernels add to a peer's base address)."""
        return self._region(name).offset

    def region(self, name: str, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """This rank's region ``name`` as a 1-D tensor of ``dtype``."""
        r = self._region(name)
        itemsize = dtype.itemsize
        if r.offset % itemsize or r.nbytes % itemsize:
            raise ValueError(f"region {name!r} ({r.offset}+{r.nbytes}) is not a whole number of {dtype}")
        return self.buffer[r.offset : r.offset + r.nbytes].view(dtype)

    def _region(self, name: str) -> Region:
        if name not in self.regions:
            raise KeyError(f"no workspace region {name!r}; planned: {sorted(self.regions)}")
        return self.regions[name]

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[SymmetricWorkspace]:
        """Holds the workspace for one call; a second concurrent holder gets :class:`WorkspaceBusyError`."""
        if not self._busy.acquire(blocking=False):
            raise WorkspaceBusyError("workspace is in use by another call; calls sharing a workspace must serialize")
        try:
            yield self
        finally:
            self._busy.release()
