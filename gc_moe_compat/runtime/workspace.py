"""The operator's symmetric workspace: one allocation per operator instance, named regions, and a peer table.

With more than one rank every rank maps every peer's copy: through torch symmetric memory (``empty`` +
``rendezvous``) when each rank has a GPU of its own, through CUDA IPC handles (``cuIpcGetMemHandle`` /
``cuIpcOpenMemHandle``, exchanged over the group) when ranks share a GPU, which torch symmetric memory refuses
(:mod:`gc_moe_compat.runtime.colocation`). Kernels get a by-value :class:`PeerTable` (base address, per-rank offsets
for up to 72 ranks, own rank) and reach rank ``r``'s region at ``base + offsets[r] + region_offset``. A group of one
rank uses a plain allocation. Regions are carved with alignment by :class:`LayoutPlanner`. A workspace is
single-instance: :meth:`SymmetricWorkspace.exclusive` rejects overlapping use.

Creating one is collective, and so is its failure: every rank allocates, then the ranks agree
(:func:`agree`) before any of them maps a peer, so a rank whose allocation fails (out of memory) makes
every rank raise :class:`WorkspaceAllocationError` naming it, instead of leaving its peers in the exchange until the
process group's timeout.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from cuda.bindings import driver

from gc_moe_compat.config import MAX_RANKS

from .colocation import Placement, placement
from .cuda import CudaError, call
from .split import MIN_DISPATCH_SMS, shared_device_sms

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


_ipc_opened: dict[bytes, list[int]] = {}
"""Peer allocations mapped into this process: handle bytes -> [address, users]. The driver maps one allocation once
per process, and torch's caching allocator may place two workspaces of a peer in one allocation."""
_ipc_lock = threading.Lock()


def _open_ipc(raw: bytes) -> int:
    """The address of the peer allocation whose IPC handle is ``raw``, mapped on first use."""
    with _ipc_lock:
        entry = _ipc_opened.get(raw)
        if entry is None:
            handle = driver.CUipcMemHandle()
            ctypes.memmove(handle.getPtr(), raw, driver.CU_IPC_HANDLE_SIZE)
            flags = driver.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
            entry = _ipc_opened[raw] = [int(call(driver.cuIpcOpenMemHandle, handle, flags)), 0]
        entry[1] += 1
        return entry[0]


def _close_ipc(raw: bytes) -> None:
    """Drops one use of a mapped peer allocation, unmapping it after the last (results ignored: at interpreter
    exit the driver may already be gone)."""
    with _ipc_lock:
        entry = _ipc_opened.get(raw)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _ipc_opened[raw]
            driver.cuIpcCloseMemHandle(entry[0])


class WorkspaceAllocationError(RuntimeError):
    """A rank of the group could not allocate its copy of a workspace; raised on every rank of the group alike."""


def agree(group: dist.ProcessGroup | None, what: str, shared: object, failure: str | None) -> list[object]:
    """Every rank's ``shared`` (what its peers need of it), gathered over ``group`` once every rank has tried to
    ``what``: ``failure`` is this rank's error (None: done). A failure anywhere raises
    :class:`WorkspaceAllocationError` on every rank, naming the ranks and their errors. A group of one rank (or
    None) exchanges nothing."""
    mine = (failure, None if failure else shared)
    if group is None or dist.get_world_size(group) == 1:
        gathered: list[object] = [mine]
    else:
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine, group=group)
    failed = {r: error for r, (error, _) in enumerate(gathered) if error is not None}
    if failed:
        named = "; ".join(f"rank {r}: {error}" for r, error in failed.items())
        raise WorkspaceAllocationError(f"symmetric workspace: {len(failed)} of {len(gathered)} rank(s) could not "
                                       f"{what} ({named})")
    return [value for _, value in gathered]


def _try(allocate: Callable[[], torch.Tensor]) -> tuple[torch.Tensor | None, str | None]:
    """``allocate()``, or None and its error's first line (torch's ``OutOfMemoryError``, a driver error: every
    allocation failure is a ``RuntimeError``), which the group agrees on before any rank maps a peer."""
    try:
        return allocate(), None
    except RuntimeError as exc:
        return None, f"{type(exc).__name__}: {next(iter(str(exc).splitlines()), '')}"


def _zeros(nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` zeroed bytes from torch's caching allocator on ``device`` (one rank, or ranks sharing a GPU)."""
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


def _symmetric_empty(nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` of torch symmetric memory on ``device``. Its allocator maps memory of its own, so the blocks torch's
    caching allocator keeps are not free to it: where the first try finds no room, they go back to the driver
    (``torch.cuda.empty_cache()``) and it tries once more."""
    from torch.distributed import _symmetric_memory as symm_mem

    try:
        return symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    except RuntimeError:
        torch.cuda.empty_cache()
        return symm_mem.empty(nbytes, dtype=torch.uint8, device=device)


class WorkspaceBusyError(RuntimeError):
    """A call tried to use a workspace that another call is using (the workspace is single-instance)."""


class SymmetricWorkspace:
    """One symmetric allocation laid out by a :class:`LayoutPlanner`, zeroed and rendezvoused across ``group``."""

    def __init__(
        self,
        layout: LayoutPlanner,
        group: dist.ProcessGroup | None = None,
        device: torch.device | int | None = None,
        where: Placement | None = None,
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
        self.placement = where if where is not None else placement(group, self.device.index)
        self._ipc_peers: list[bytes] = []
        what = f"allocate and share {layout.size} bytes"
        ipc = self.world_size > 1 and self.placement.shares_device
        symmetric = self.world_size > 1 and not ipc
        buffer, failure = _try(lambda: (_symmetric_empty if symmetric else _zeros)(layout.size, self.device))
        if ipc:
            addresses = self._ipc_rendezvous(group, buffer, failure, what)
        else:
            agree(group, what, None, failure)
            self.buffer = buffer
            addresses = [buffer.data_ptr()]
        if symmetric:
            from torch.distributed import _symmetric_memory as symm_mem

            handle = symm_mem.rendezvous(self.buffer, group)
            self.buffer.zero_()
            addresses = [int(p) for p in handle.buffer_ptrs]
        if self.world_size > 1:
            torch.cuda.synchronize(self.device)
            dist.barrier(group)  # every copy is zeroed before any peer writes into it
        self.peer_table = make_peer_table(addresses, self.rank)

    @functools.cached_property
    def sm_share(self) -> int:
        """The most SMs one launch of this rank may fill: every SM, or this rank's share when ranks share the GPU
        (:func:`gc_moe_compat.runtime.split.shared_device_sms`), so that the ranks' spinning kernels are all
        resident at once."""
        total = torch.cuda.get_device_properties(self.device).multi_processor_count
        if not self.placement.shares_device:
            return total
        return shared_device_sms(total, self.placement.ranks_on_device, MIN_DISPATCH_SMS)

    @property
    def rendezvous(self) -> str:
        """``local``, ``cuda-ipc`` or ``torch-symm-mem``: how this workspace maps its peers."""
        return self.placement.rendezvous

    def _ipc_rendezvous(self, group: dist.ProcessGroup, buffer: torch.Tensor | None, failure: str | None,
                        what: str) -> list[int]:
        """Every rank's copy mapped into this process through CUDA IPC: this rank's allocation handle and the
        buffer's offset in it (or its allocation's ``failure``) are gathered over ``group``
        (:func:`agree` on ``what``), each peer's opened here. Returns the addresses by rank."""
        mine = None
        if buffer is not None:
            self.buffer = buffer
            base, _ = call(driver.cuMemGetAddressRange, buffer.data_ptr())
            try:
                handle = call(driver.cuIpcGetMemHandle, base)
                mine = (ctypes.string_at(handle.getPtr(), driver.CU_IPC_HANDLE_SIZE), buffer.data_ptr() - int(base))
            except CudaError as err:  # agreed on like an allocation's failure, so that no peer waits for this rank
                failure = (f"the buffer cannot be shared through CUDA IPC ({err.name}); ranks that share a GPU need "
                           "torch's default caching allocator (PYTORCH_CUDA_ALLOC_CONF without expandable_segments)")
        shared = agree(group, what, mine, failure)
        addresses = []
        for r, (raw, offset) in enumerate(shared):
            if r == self.rank:
                addresses.append(self.buffer.data_ptr())
                continue
            self._ipc_peers.append(raw)
            addresses.append(_open_ipc(raw) + offset)
        return addresses

    def __del__(self) -> None:
        for raw in getattr(self, "_ipc_peers", ()):
            _close_ipc(raw)

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
