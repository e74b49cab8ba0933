"""Host side of the low-latency expert-parallel kernels behind the ``deep_ep`` facade (kernels/sm90/ep_ll.cu).

DeepEP's low-latency mode moves decode tokens in two halves per direction: one launch of the direction's kernel
(``gc_moe::ep_ll::dispatch``, ``gc_moe::ep_ll::combine``) runs both (:data:`PHASE_BOTH`,
:meth:`LlLaunches.launch_fused`: the receive half waits in the same grid for the words the send half publishes, as
DeepEP's kernels do), or, when the caller asks for ``return_recv_hook``, one launch each (the hook launches the
receive half, exactly as with DeepEP). A profiler sees one kernel name per direction, which is what DeepEP's
``bench_kineto(kernel_names=('dispatch', 'combine'))`` matches (one table line per name, and ``::dispatch`` /
``::combine`` in the trace events, one per call, two with a hook).

* dispatch send: a CTA per token (or per column part of it, where there are fewer tokens than CTAs) reads its part of
  the token once, quantizes it to FP8 E4M3 with FP32 1x128 scales (DeepEP's rule, optional power-of-two scales) or
  keeps it BF16, and copies it into the receive stage of each of its slots' owner ranks, ``[parity][local
  expert][source rank][row]`` (bulk copies over NVLink), the row being the count of
  earlier (token, slot) entries with that expert; it also writes the routing the handle keeps for the combine (int32
  ``[2, T, k]``: the checked expert, -1 where an entry was dropped, then the entry's row); the grid's last CTA then
  publishes ``(generation << 32) | rows`` for every (expert, source) pair;
* dispatch receive: waits for the counts of every source, packs the stage rows into DeepEP's layout
  (``recv_x [e, P*Tmax, H]``, column-major scales, ``recv_count``, and the handle's ``src_info`` (the source token,
  DeepEP's meaning) / ``layout_range``; the row's slot goes to a private ``src_route`` of ``token * k + slot``);
* combine send: stores every received row of the expert output ``x`` (or of the zero-copy send rows in the workspace)
  into its source rank's combine stage ``[parity][token][slot]``, then the grid's last CTA publishes readiness on
  every rank;
* combine receive: waits for every rank's readiness and writes ``out[t] = BF16(sum over valid slots, slot order, of
  weight * row)`` in FP32 (separately rounded multiply and add: bit-reproducible by the torch reference).

At one rank (the direct path) there is no stage: dispatch send stores the rows straight into ``recv_x``, combine
receive reads the rows of ``x`` in place at the rows the routing names, and one more CTA, the checker, re-derives
from the caller's inputs what the others decide (dispatch: ``recv_count``, ``layout_range`` and the statistics),
reports dropped entries and publishes the generation while they move rows, so no CTA waits for the grid; each
direction's first launch does it all (the fused one, or a hooked call's send launch: :func:`ll_grid` sizes both for
that half, and a hook's launch returns at once), with the staged path's outputs.

Every synchronization word is generation-tagged and double-buffered by the generation's parity, so no call needs a
host-side reset or a trailing barrier, and two calls of a kind may be in flight (as DeepEP allows). The parity's
``consumed`` word (written by the consumer, read by producers on other ranks) keeps a producer from overwriting a
stage before its consumer two generations back has read it. Spin-waits are bounded; a timeout, a protocol mismatch or
a dropped input lands in a status record (:func:`raise_for_mirrored_status`) and the kernel completes. With
:data:`FLAG_SHRINK` (DeepEP's ``enable_shrink``) the kernels skip the ranks set in the workspace's rank mask
(:func:`mask_words`) and mask a rank whose wait times out, instead of recording the timeout.
"""

from __future__ import annotations

import ctypes
import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from cuda.bindings import driver

from gc_moe_compat.runtime import jit
from gc_moe_compat.runtime.cuda import call
from gc_moe_compat.runtime.green import Partition, Role
from gc_moe_compat.runtime.launch import launch_packed
from gc_moe_compat.runtime.params import (
    KernelArgs,
    c_enum_declaration,
    c_identifier,
    c_struct_declaration,
    fields_before,
)
from gc_moe_compat.runtime.side_launch import launch_on
from gc_moe_compat.runtime.status import KernelStatus, StatusSite, raise_for_status, spin_timeout_ns, status_codes
from gc_moe_compat.runtime.workspace import MAX_RANKS, PeerTable

__all__ = [
    "CTAS_PER_SM",
    "FLAG_SHRINK",
    "HEADER_BYTES",
    "HINT_TOPK",
    "MAX_EXPERTS",
    "MAX_TOPK",
    "MIN_PART_GROUPS",
    "PHASE_BOTH",
    "PHASE_RECV",
    "PHASE_SEND",
    "SOURCE",
    "THREADS",
    "EpLlParams",
    "Kernel",
    "LlLaunches",
    "LlShape",
    "LlSite",
    "fused_grid",
    "ll_grid",
    "load_in",
    "ll_sites",
    "mask_words",
    "new_launches",
    "params_header",
    "new_status_mirror",
    "raise_for_mirrored_status",
    "required_bytes",
]

SOURCE = "sm90/ep_ll.cu"
THREADS = 256
"""Threads per CTA (8 warps) of every low-latency kernel."""
MAX_EXPERTS = 1024
"""Global experts the fixed count table holds (per parity)."""
MAX_TOPK = 32
"""Routing slots per token the dispatch send kernel holds."""
HINT_TOPK = 16
"""Top-k the size hint provisions the combine stage for (calls with a larger k need a larger buffer)."""
MAX_SMS = 132
"""Upper bound of the SMs a grid fills (an H200's: one CTA an SM; the one-rank grids :data:`CTAS_PER_SM`)."""
CTAS_PER_SM = 2
"""CTAs of either kernel that fit an SM (their ``__launch_bounds__``): at one rank, where no CTA waits for another,
the working grid (dispatch send, the reducing combine) may hold this many per SM."""
MIN_PART_GROUPS = 8
"""Scale groups (128 columns) a dispatch send CTA's share of a token's row has at least, the last share excepted (the
kernel's ``kMinPartGroups``): with fewer tokens than CTAs, up to ``hidden / 128 / MIN_PART_GROUPS`` CTAs share a
row."""
PHASE_SEND, PHASE_RECV, PHASE_BOTH = 0, 1, 2
"""``EpLlParams.phase``: the send half, the receive half (the two launches of a call with a receive hook), or both in
one launch (``gc_moe::kLlPhase*``)."""


class Kernel(enum.IntEnum):
    """The four halves of a dispatch and a combine (two phases of each direction's kernel, launched one each with a
    receive hook, together by :meth:`LlLaunches.launch_fused` without); the value is also the index of the half's
    status record and arrival counters (``gc_moe::LlKernel``, generated into kernels/sm90/ep_ll_params.cuh by
    :func:`params_header`)."""

    DISPATCH_SEND = 0
    DISPATCH_RECV = 1
    COMBINE_SEND = 2
    COMBINE_RECV = 3

    @property
    def entry(self) -> str:
        """The kernel entry point (demangled) that runs this launch."""
        return "gc_moe::ep_ll::dispatch" if self in (Kernel.DISPATCH_SEND, Kernel.DISPATCH_RECV) else \
            "gc_moe::ep_ll::combine"

    @property
    def phase(self) -> int:
        """``EpLlParams.phase`` of this half's own launch: :data:`PHASE_SEND` or :data:`PHASE_RECV`."""
        return PHASE_RECV if int(self) % 2 else PHASE_SEND

    @property
    def send(self) -> Kernel:
        """The send half of this half's direction."""
        return Kernel(int(self) & ~1)

    @property
    def receive(self) -> Kernel:
        """The receive half of this half's direction."""
        return Kernel(int(self) | 1)

    @property
    def label(self) -> str:
        """What error messages call this launch (``dispatch send`` ...)."""
        return self.name.lower().replace("_recv", " receive").replace("_", " ")


_MANGLED = {"gc_moe::ep_ll::dispatch": "_ZN6gc_moe5ep_ll8dispatchENS_9PeerTableENS_10EpLlParamsE",
            "gc_moe::ep_ll::combine": "_ZN6gc_moe5ep_ll7combineENS_9PeerTableENS_10EpLlParamsE"}
"""The entry points' symbols in the cubin (C++ names, so that a profiler shows ``gc_moe::ep_ll::dispatch``)."""


class LlSite(StatusSite):
    """Kinds of the kernels' status sites (``gc_moe::LlSite``, generated into kernels/sm90/ep_ll_params.cuh by
    :func:`params_header`); a record's site is ``kind << 16 | rank`` (:func:`ll_sites` names them)."""

    CONSUMED = 1, "a producer waiting until the stage's consumer read it two generations back"
    COUNT = 2, "dispatch receive waiting for a source's count"
    COUNT_AHEAD = 3, "a count carries a later generation than this call's"
    READY = 4, "combine receive waiting for a rank's readiness"
    READY_AHEAD = 5, "a readiness word carries a later generation than this call's"
    EXPERT_RANGE = 6, "a topk_idx entry >= num_experts (dropped)"
    EXPERT_NEGATIVE = 7, "a topk_idx entry < -1 (dropped)"
    EXPERT_REPEAT = 8, "a topk_idx entry repeating an earlier slot's expert of its token (dropped)"
    COUNT_RANGE = 9, "a source's row count above Tmax"
    TOPK_MISMATCH = 10, "a combine topk_idx entry differing from the dispatch's (dropped)"
    WEIGHT = 11, "a non-finite combine topk_weights entry (dropped)"


# Fixed header of the workspace (independent of the call's shapes, so persistent words never move).
_SEQ = 0                                   # u64 [2]: last generation taken by dispatch send, by combine send
                                           # (by combine receive at one rank)
_ARRIVE = 64                               # u64 [4 kinds][2 parities]: grid arrival counters
_CONSUMED = 128                            # u64 [2 directions][2 parities]: last generation read from the stage
_READY = 256                               # u64 [2 parities][MAX_RANKS]: combine readiness per source rank
_STATUS = _READY + 2 * MAX_RANKS * 8       # KernelStatus [4]
_MASK = _STATUS + 4 * ctypes.sizeof(KernelStatus)  # u32 [MAX_RANKS]: this rank's rank mask (shrink mode)
_COUNTS = 2048                             # u64 [2 parities][MAX_EXPERTS]: (generation << 32) | rows
HEADER_BYTES = _COUNTS + 2 * MAX_EXPERTS * 8
"""Bytes of the fixed header; the two stages follow it."""
assert _MASK + 4 * MAX_RANKS <= _COUNTS

FLAG_FP8, FLAG_ROUND_SCALE, FLAG_UE8M0, FLAG_SHRINK = 1, 2, 4, 8


@dataclass(frozen=True)
class LlShape:
    """The sizes of one low-latency call: ranks ``P``, global experts ``E``, ``Tmax`` tokens per rank, hidden ``H``
    and top-k ``k``."""

    num_ranks: int
    num_experts: int
    max_tokens: int
    hidden: int
    topk: int

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def row_stride(self) -> int:
        """Bytes of one receive-stage row: 16 bytes of source (token, slot), then a BF16 row, or an FP8 row and its
        FP32 1x128 scales (which fit in the BF16 row's bytes)."""
        return 16 + 2 * self.hidden

    @property
    def recv_stage_bytes(self) -> int:
        return 2 * self.num_experts * self.max_tokens * self.row_stride

    @property
    def combine_stage_bytes(self) -> int:
        return 2 * self.max_tokens * self.topk * 2 * self.hidden

    @property
    def recv_stage_offset(self) -> int:
        return HEADER_BYTES

    @property
    def combine_stage_offset(self) -> int:
        return HEADER_BYTES + self.recv_stage_bytes

    @property
    def zero_copy_offset(self) -> int:
        """Where the zero-copy combine's send rows ``[E/P, P*Tmax, H]`` BF16 start (after the combine stage)."""
        return self.combine_stage_offset + self.combine_stage_bytes

    @property
    def zero_copy_bytes(self) -> int:
        return self.num_experts * self.max_tokens * 2 * self.hidden


def required_bytes(shape: LlShape, zero_copy: bool = False) -> int:
    """Workspace bytes a call of ``shape`` needs (header, receive stage, combine stage, and with ``zero_copy`` the
    zero-copy combine's send rows)."""
    return shape.zero_copy_offset + (shape.zero_copy_bytes if zero_copy else 0)


class EpLlParams(ctypes.Structure):
    """By-value kernel argument after the peer table (``gc_moe::EpLlParams``, kernels/sm90/ep_ll_params.cuh).

    Pointers are device addresses (0 where a kernel does not use one); ``status_mirror`` is pinned host memory the
    receive kernels copy the four status records into; ``off_*`` are byte offsets into every rank's workspace.
    ``topk_idx`` (the dispatch's and the combine's) is int64 ``[T, k]`` (:data:`~gc_moe_compat.comm.TOPK_IDX_DTYPE`).
    ``src_info`` int32 ``[E/P, P*Tmax]`` is DeepEP's (source token), ``src_route`` the same rows' ``token * k + slot``
    and ``routing`` int32 ``[2, T, k]`` the dispatch's checked routing, then each valid slot's row in its expert's list
    of this rank's rows (both kept by the handle for the combine).
    ``flags``: bit 0 FP8 payload, bit 1 power-of-two scales, bit 2 UE8M0-packed scales, bit 3 rank masking.
    ``status_mirror`` is written by the last CTA of each receive half (at one rank by each direction's checker).
    ``phase``: :data:`PHASE_SEND`, :data:`PHASE_RECV` or :data:`PHASE_BOTH`.
    """

    _fields_ = [
        ("x", ctypes.c_uint64),
        ("topk_idx", ctypes.c_uint64),
        ("topk_weights", ctypes.c_uint64),
        ("recv_x", ctypes.c_uint64),
        ("recv_scales", ctypes.c_uint64),
        ("recv_count", ctypes.c_uint64),
        ("src_info", ctypes.c_uint64),
        ("src_route", ctypes.c_uint64),
        ("routing", ctypes.c_uint64),
        ("layout_range", ctypes.c_uint64),
        ("recv_stats", ctypes.c_uint64),
        ("out", ctypes.c_uint64),
        ("call_gen", ctypes.c_uint64),
        ("status_mirror", ctypes.c_uint64),
        ("timeout_ns", ctypes.c_uint64),
        ("off_seq", ctypes.c_uint64),
        ("off_arrive", ctypes.c_uint64),
        ("off_consumed", ctypes.c_uint64),
        ("off_ready", ctypes.c_uint64),
        ("off_status", ctypes.c_uint64),
        ("off_mask", ctypes.c_uint64),
        ("off_counts", ctypes.c_uint64),
        ("off_recv_stage", ctypes.c_uint64),
        ("off_combine_stage", ctypes.c_uint64),
        ("num_tokens", ctypes.c_uint32),
        ("topk", ctypes.c_uint32),
        ("hidden", ctypes.c_uint32),
        ("num_experts", ctypes.c_uint32),
        ("local_experts", ctypes.c_uint32),
        ("max_tokens", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("row_stride", ctypes.c_uint32),
        ("phase", ctypes.c_uint32),
    ]


def params_header() -> str:
    """The generated part of kernels/sm90/ep_ll_params.cuh: the C declarations of :class:`EpLlParams`,
    :class:`LlSite` and :class:`Kernel` (``LlKernel``, each constant commented with its entry point)."""
    struct = c_struct_declaration(EpLlParams, "EpLlParams", "gc_moe_compat/comm/ep_ll.py")
    kernels = {c_identifier("k", kernel.name): int(kernel) for kernel in Kernel}
    entries = {c_identifier("k", kernel.name): f"{kernel.entry}, phase {kernel.phase}" for kernel in Kernel}
    indices = c_enum_declaration("LlKernel", kernels, f"{__name__}.{Kernel.__qualname__}", entries)
    return struct + "\n" + LlSite.c_declaration("LlSite", "kLlSite") + "\n" + indices


_POINTER_FIELDS = fields_before(EpLlParams, "timeout_ns")
"""The device and pinned-host address fields of :class:`EpLlParams` (those before ``timeout_ns``)."""


def make_params(shape: LlShape, *, num_tokens: int, flags: int = 0,
                timeout_ms: float | None = None, **pointers: int) -> EpLlParams:
    """The :class:`EpLlParams` of one call; ``pointers`` names device addresses (``x=...``, ``call_gen=...``). A
    fresh struct per call, copied from a cached template of everything but the pointers (the sizes, offsets, flags
    and timeout: what the shape and the flags fix), so a call sets only its pointers."""
    if not pointers.keys() <= _POINTER_FIELDS:
        raise TypeError(f"make_params: not pointer fields of EpLlParams: {sorted(pointers.keys() - _POINTER_FIELDS)}")
    params = EpLlParams.from_buffer_copy(_template(shape, num_tokens, flags, spin_timeout_ns(timeout_ms)))
    for name, value in pointers.items():
        setattr(params, name, value)
    return params


@functools.lru_cache(maxsize=64)
def _template(shape: LlShape, num_tokens: int, flags: int, timeout_ns: int) -> EpLlParams:
    """The pointer-free :class:`EpLlParams` of calls of ``shape`` (read only: :func:`make_params` copies it)."""
    return EpLlParams(
        timeout_ns=timeout_ns, off_seq=_SEQ, off_arrive=_ARRIVE, off_consumed=_CONSUMED, off_ready=_READY,
        off_status=_STATUS, off_mask=_MASK, off_counts=_COUNTS, off_recv_stage=shape.recv_stage_offset,
        off_combine_stage=shape.combine_stage_offset, num_tokens=num_tokens, topk=shape.topk, hidden=shape.hidden,
        num_experts=shape.num_experts, local_experts=shape.local_experts, max_tokens=shape.max_tokens,
        flags=flags, row_stride=shape.row_stride)


def ll_grid(kernel: Kernel, shape: LlShape, num_tokens: int, max_ctas: int = MAX_SMS) -> int:
    """CTAs of one half's own launch (a call with a receive hook; :func:`fused_grid` for both in one): dispatch
    send, a CTA per token and column part (up to ``hidden / 128 / MIN_PART_GROUPS`` parts a token, so that a small
    batch's rows leave through several SMs; the kernel splits whatever grid it gets the same way); for dispatch
    receive and combine send, CTAs owning whole local experts (every CTA up to the cap: with fewer local experts
    than the cap, each expert gets the same number of CTAs, ``L * (cap // L)``); for combine receive a warp per
    (token, 256 columns). At one rank (the direct path) the combine's send launch does the receive half's work and
    gets its grid, a receive launch, which returns at once, one CTA, and a working launch one CTA more: its checker
    (kernels/sm90/ep_ll.cu: it counts, reports and publishes while the others move rows). At least one, at most
    ``max_ctas`` (the SMs of the partition the launch runs on; at most :data:`MAX_SMS`), except at one rank: nothing
    waits there, so a working grid may fill every SM :data:`CTAS_PER_SM` times: the combine's, whose warps then sum
    fewer column chunks of their token with more loads in flight per SM, and dispatch send's where a token a CTA
    does not fit one CTA an SM (a CTA then sends one token, not two, and an SM overlaps two tokens' chains; with
    fewer tokens, twice the column parts a token measured slower)."""
    cap = max(1, min(MAX_SMS, max_ctas))
    direct = shape.num_ranks == 1
    if direct and kernel in (Kernel.DISPATCH_RECV, Kernel.COMBINE_RECV):
        return 1  # the direct path: a hook's launch, which returns at once
    limit = CTAS_PER_SM * cap if direct else cap  # one rank: nothing waits, every working grid may fill SMs twice
    if kernel is Kernel.DISPATCH_SEND:
        parts = max(1, shape.hidden // 128 // MIN_PART_GROUPS)
        if num_tokens + direct <= cap:  # a token a CTA fits one an SM: more column parts instead measured slower
            limit = cap
        return max(1, min(limit, num_tokens * parts + direct))
    if kernel is Kernel.COMBINE_RECV or direct:  # one rank: the combine's send launch reduces
        warps = num_tokens * -(-shape.hidden // 256)
        return max(1, min(limit, -(-warps // (THREADS // 32)) + direct))
    local = shape.local_experts
    return cap if local >= cap else local * (cap // local)


def fused_grid(kernel: Kernel, shape: LlShape, num_tokens: int, max_ctas: int = MAX_SMS) -> int:
    """CTAs of the fused launch (:data:`PHASE_BOTH`) of ``kernel``'s direction: the larger of its two halves'
    :func:`ll_grid`, so at most ``max_ctas`` like each (each half loops over its work with a grid stride; a CTA
    without work in a half only arrives). Its receiving CTAs wait for words its own last CTA publishes, so the whole
    grid must be resident at once: ``max_ctas`` is at most the SMs the launch may use, and one CTA fits an SM
    (kernels/sm90/ep_ll.cu, "Co-residency"; at one rank nothing waits, and the grid is the working half's, up to
    :data:`CTAS_PER_SM` an SM)."""
    return max(ll_grid(kernel.send, shape, num_tokens, max_ctas), ll_grid(kernel.receive, shape, num_tokens, max_ctas))


@functools.cache
def kernel_of(kernel: Kernel) -> jit.Kernel:
    """The loaded entry point that runs ``kernel`` (compiled or taken from the cache on first use, then kept: the
    cache lookup hashes the sources, far too slow for every launch of a decode step)."""
    return jit.load_module(SOURCE).kernel(_MANGLED[kernel.entry])


_loaded: set[tuple[int, int]] = set()
"""(partition id, green context) pairs whose communication side has both entry points loaded."""


def load_in(partition: Partition) -> None:
    """Loads both entry points into ``partition``'s communication green context now (``cuKernelGetFunction`` with
    that context current), so that no first launch there waits for a lazy module load while a peer spins for it
    (docs/platform_notes.md: load every kernel in every context that runs it before two of them depend on each
    other)."""
    ctx = partition.side(Role.COMM).ctx
    key = (id(partition), int(ctx))
    if key in _loaded:
        return
    call(driver.cuCtxPushCurrent, ctx)
    try:
        for kernel in (Kernel.DISPATCH_SEND, Kernel.COMBINE_SEND):  # one launch of each entry point
            call(driver.cuKernelGetFunction, kernel_of(kernel).handle)
    finally:
        call(driver.cuCtxPopCurrent)
    _loaded.add(key)


_PHASES = tuple(kernel.phase for kernel in Kernel)
_BLOCK = (THREADS, 1, 1)


class LlLaunches:
    """The launches of low-latency calls of one shape on one workspace, packed once: ``params`` (the calls'
    :class:`EpLlParams`, everything but the per-call pointers fixed: a call sets its pointers, then launches), ``args``
    (the by-value arguments the driver reads: a copy of the peer table, then ``params``) and the grids without a
    partition of each half's launch (``grids``) and of each direction's fused launch (``fused_grids``, by either half),
    at most ``max_ctas`` CTAs (at one rank :data:`CTAS_PER_SM` times as many, where nothing waits): at most the SMs one
    launch of the rank may fill (the facade passes
    :attr:`~gc_moe_compat.runtime.workspace.SymmetricWorkspace.sm_share`), which the fused launches' co-residency rests
    on. The driver copies the arguments when a launch (or a captured node) is made, so every call reuses the same ones
    instead of packing its own; an instance serves one thread, and a receive hook launches from a :meth:`detached` copy,
    which later calls do not reach."""

    __slots__ = ("args", "fused_grids", "grids", "max_ctas", "num_tokens", "params", "shape", "table")

    def __init__(self, table: PeerTable, params: EpLlParams, shape: LlShape, num_tokens: int,
                 max_ctas: int = MAX_SMS) -> None:
        self.table, self.params, self.shape, self.num_tokens, self.max_ctas = table, params, shape, num_tokens, max_ctas
        self.args = KernelArgs(table, params)
        cap = min(max_ctas, MAX_SMS)
        self.grids = tuple((ll_grid(kernel, shape, num_tokens, cap), 1, 1) for kernel in Kernel)
        self.fused_grids = tuple((fused_grid(kernel, shape, num_tokens, cap), 1, 1) for kernel in Kernel)

    def detached(self) -> LlLaunches:
        """A copy with parameters of its own (as set now): what a receive hook launches later."""
        return LlLaunches(self.table, EpLlParams.from_buffer_copy(self.params), self.shape, self.num_tokens,
                          self.max_ctas)

    def launch(self, kernel: Kernel, stream: driver.CUstream, partition: Partition | None = None) -> None:
        """Launches the half ``kernel`` alone (a call with a receive hook) in the order of ``stream`` (torch's
        current stream, or a capture's): without a partition on ``stream`` itself with the full-device grid (at most
        ``max_ctas`` CTAs: a rank's share of a GPU that several ranks share,
        :attr:`gc_moe_compat.runtime.workspace.SymmetricWorkspace.sm_share`); else on the communication side of
        ``partition`` with a grid of at most its SMs."""
        self._launch(kernel, _PHASES[kernel], self.grids[kernel], ll_grid, stream, partition)

    def launch_fused(self, kernel: Kernel, stream: driver.CUstream, partition: Partition | None = None) -> None:
        """Launches both halves of ``kernel``'s direction as one kernel (:data:`PHASE_BOTH`; a call without a
        receive hook), where :meth:`launch` would, with :func:`fused_grid`'s grid: at most as many CTAs as the SMs
        the launch may use, so that the whole grid is resident at once, which the receive half's waits on words of
        its own grid need at more than one rank (the device's SMs, a rank's share of a shared GPU, a partition's SMs:
        every path meets it, so a call without a hook never needs two launches)."""
        self._launch(kernel, PHASE_BOTH, self.fused_grids[kernel], fused_grid, stream, partition)

    def _launch(self, kernel: Kernel, phase: int, grid: tuple[int, int, int],
                grid_of: Callable[[Kernel, LlShape, int, int], int], stream: driver.CUstream,
                partition: Partition | None) -> None:
        """Launches ``kernel``'s entry point with ``phase`` set in ``params``: on ``stream`` with ``grid`` (the
        full-device one), or on the communication side of ``partition`` with ``grid_of``'s grid for its SMs."""
        self.params.phase = phase
        if partition is None:
            launch_packed(kernel_of(kernel).handle, grid, _BLOCK, self.args.address, stream)
            return
        cap = min(self.max_ctas, partition.dispatch_sms)
        launch_on(partition, Role.COMM, kernel_of(kernel), grid_of(kernel, self.shape, self.num_tokens, cap), THREADS,
                  self.args, stream)


def new_launches(table: PeerTable, shape: LlShape, *, num_tokens: int, flags: int,
                 timeout_ms: float | None, max_ctas: int = MAX_SMS, **pointers: int) -> LlLaunches:
    """The :class:`LlLaunches` of calls of ``shape`` (``pointers``: those fixed for every call, e.g. the status
    mirror; :func:`make_params` names the other arguments)."""
    params = make_params(shape, num_tokens=num_tokens, flags=flags, timeout_ms=timeout_ms, **pointers)
    return LlLaunches(type(table).from_buffer_copy(table), params, shape, num_tokens, max_ctas)


def ll_sites(num_ranks: int) -> dict[int, str]:
    """Names of the kernels' status sites (``kind << 16 | rank``)."""
    sites = {
        LlSite.EXPERT_RANGE << 16: "a topk_idx entry (observed) >= num_experts (expected); the slot was dropped",
        LlSite.EXPERT_NEGATIVE << 16: "a topk_idx entry below -1 (observed: its negation); the slot was dropped",
        LlSite.EXPERT_REPEAT << 16: ("a topk_idx entry (observed) repeats an expert an earlier slot of its token "
                                     "names (expected: the slot); the slot was dropped (one row per token and "
                                     "expert)"),
        LlSite.TOPK_MISMATCH << 16: ("combine: a topk_idx entry (observed) differs from the dispatch's (expected: "
                                     "the entry's index token * k + slot); the slot was dropped (pass the dispatch's "
                                     "topk_idx)"),
        LlSite.WEIGHT << 16: ("combine: a topk_weights entry is not finite (observed: its FP32 bits; expected: the "
                              "entry's index token * k + slot); the slot was dropped"),
    }
    for r in range(num_ranks):
        sites[LlSite.CONSUMED << 16 | r] = f"waiting until rank {r} has read the stage two generations back"
        sites[LlSite.COUNT << 16 | r] = f"dispatch receive waiting for rank {r}'s token counts"
        sites[LlSite.COUNT_AHEAD << 16 | r] = f"rank {r}'s token count is past this generation"
        sites[LlSite.COUNT_RANGE << 16 | r] = f"rank {r}'s row count (observed) is above Tmax (expected)"
        sites[LlSite.READY << 16 | r] = f"combine receive waiting for rank {r}'s rows"
        sites[LlSite.READY_AHEAD << 16 | r] = f"rank {r}'s combine readiness is past this generation"
    return sites


def status_records(workspace: torch.Tensor) -> torch.Tensor:
    """The four status records of a workspace (uint8 ``[4, 32]`` view)."""
    size = ctypes.sizeof(KernelStatus)
    return workspace[_STATUS:_STATUS + 4 * size].view(4, size)


def _raise_first(records: torch.Tensor, num_ranks: int, when: str) -> None:
    codes = records[:, :4].contiguous().view(torch.int32).flatten().tolist()
    for kernel in Kernel:
        if codes[kernel]:
            raise_for_status(records[kernel].clone(), f"deep_ep low-latency {kernel.label} ({kernel.entry}){when}",
                             ll_sites(num_ranks))


def raise_for_mirrored_status(workspace: torch.Tensor, mirror: torch.Tensor, num_ranks: int,
                              codes: np.ndarray | None = None) -> None:
    """Raises for an error an earlier call recorded, as the receive kernels last copied the records into the pinned
    host ``mirror`` (``[4, 32]`` uint8): one read of its code words (``codes``: :func:`status_codes` of ``mirror``,
    kept by the caller so the check costs no view either), no synchronization, so it may lag the device by the calls
    still in flight. Clears the records and the mirror before raising."""
    if not np.count_nonzero(status_codes(mirror) if codes is None else codes):
        return
    saved = mirror.clone()
    status_records(workspace).zero_()
    mirror.zero_()
    _raise_first(saved, num_ranks, " (recorded by an earlier call)")


def mask_words(workspace: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """This rank's rank mask in its workspace (int32 ``[num_ranks]`` view: nonzero = masked), what DeepEP's
    ``low_latency_update_mask_buffer`` / ``query`` / ``clean`` act on (stream-ordered with the kernels)."""
    return workspace[_MASK:_MASK + 4 * num_ranks].view(torch.int32)


def new_status_mirror(device: torch.device) -> torch.Tensor:
    """The zeroed ``[4, 32]`` uint8 mirror of the status records: pinned host memory for a CUDA workspace (the
    kernels store into it through its unified address), plain memory otherwise. Host memory under any torch default
    device (``pin_memory`` needs a CPU tensor)."""
    return torch.zeros(4, ctypes.sizeof(KernelStatus), dtype=torch.uint8, device="cpu",
                       pin_memory=device.type == "cuda")


def check_rank_count(num_ranks: int) -> None:
    """Raises ``ValueError`` when the group is larger than the readiness table."""
    if not 1 <= num_ranks <= MAX_RANKS:
        raise ValueError(f"group: the low-latency kernels support 1 to {MAX_RANKS} ranks, got {num_ranks}")
