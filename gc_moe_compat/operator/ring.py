"""The token ring's capacity model and its generation arithmetic (paper §4.3), pure host code.

Role1 (dispatch) pulls every token routed to this rank into one globally reused *token ring* of ``R`` ring blocks
of ``BM`` rows; role2 (the grouped GEMMs) consumes ring blocks as they fill. This module fixes how big ``R`` must be,
which ring block and generation each logical block uses, and which value each ring signal holds when a generation
is complete. Kernels implement exactly these rules; the host checks the capacity before any launch.

Pool (static, per rank). With per-rank capacity ``Tmax``, ``P`` ranks, top-k ``k`` and ``e`` local experts, one
source token sends at most ``min(k, e)`` assignments to one rank (top-k has no repeated expert), so a rank receives
at most ``A = Tmax·P·min(k, e)`` rows. Every local expert's rows are cut into blocks of ``BM`` (the last one
partial), which needs ``sum_e ceil(n_e/BM) <= ceil(A/BM) + e`` *logical pool blocks*. Pool blocks are numbered in
local-expert order (expert 0's blocks first), rows inside an expert in the documented
:func:`gc_moe_compat.testing.reference.dispatch_plan` order ``(src_rank, src_token, slot)``.

Ring mapping. Pool block ``p`` lives in ring block ``p mod R`` as generation ``p div R`` (generations restart at 0
every replay: role3 resets the ring signals). Generation ``g`` of ring block ``b`` is complete when:

=====================  ====================================  ==================================================
signal (per block)     value when generation ``g`` is done   who releases it
=====================  ====================================  ==================================================
``l1_full_count``      ``BM·(g+1)``                          role1: +1 per landed row; the row with index
                                                             ``valid-1`` also adds the padding ``BM - valid``
``l1_empty_count``     ``t1·(g+1)``                          role2: +1 per W1 task once its token loads are done
``l2_full_mask``       all ``2I/128`` bits equal ``(g+1)&1``  role2: each W1 task *toggles* (XOR) its N128 bits
``l2_empty_count``     ``t2·(g+1)``                          role2: +1 per W2 task once it stored its partials
=====================  ====================================  ==================================================

``t1 = 2I / w1_rows`` and ``t2 = H / w2_rows`` are the W1/W2 tasks per block (a task is one tile of ``w*_rows``
weight rows over the block's ``BM`` tokens). The mask toggles instead of being set so that it needs no clearing
between generations: W2 K128 tile ``j`` waits until bits ``2j`` and ``2j+1`` equal ``(g+1)&1``; role3 resets the
mask to 0 between replays. Before role1 writes generation ``g >= 1`` of ring block ``b`` it waits for
``l1_empty_count >= t1·g`` (payload, scales and routing weights free) and ``l2_empty_count >= t2·g`` (source
metadata, which the W2 epilogue reads for the scatter, and the L2 activations free) and only then releases
``l1_full_count``; so a W1 task that sees generation ``g`` full may also overwrite the block's L2 activations.

Live-block model (the compute partition's schedule). Role2 is a persistent grid of ``C`` CTAs (``C`` = the real
compute-partition SM count, one CTA per SM) walking one task sequence: first the W1 tasks of pool blocks
``0..w-1``, then for ``j = 0, 1, ...`` the W2 tasks of block ``j`` followed by the W1 tasks of block ``j + w``.
``w = ceil(l1_waves·C / t1)`` is the look-ahead: the blocks covered by the ``l1_waves`` full waves of W1 tasks that
are pre-published before the first W2 wave. Every task waits only on tasks earlier in the sequence (W2 of ``j`` on
W1 of ``j``; W1 of ``p`` on dispatch of ``p``, which waits on W2 of ``p - R``), so the schedule is deadlock-free iff
``R >= min(pool, w)``. For full overlap the ring must also hold the blocks of one W2 wave still in flight while W1
of ``j + w`` is claimed: one wave of ``C`` W2 tasks spans at most ``s = ceil(C/t2) + 1`` blocks (``+1``: a wave
straddles a block boundary). The live-block need is therefore ``w + s``, and the ring needs
``min(pool, w + s)`` blocks (a pool smaller than that never reuses a block). :func:`check_ring` raises
:class:`RingCapacityError` when an allocated ring is below this need for the actual partition; need grows with
``C``, so a ring sized for ``C`` serves every smaller partition.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gc_moe_compat.compute_paths import MMA_TYPES
from gc_moe_compat.config import MoEShape, int_in_range
from gc_moe_compat.operator.heuristics import block_m_for_call, workspace_block_ms

__all__ = [
    "DEFAULT_GEOMETRY",
    "RingCapacity",
    "RingCapacityError",
    "RingModel",
    "RingPlan",
    "TaskGeometry",
    "check_ring",
    "pool_rows",
    "pool_table",
]


class RingCapacityError(ValueError):
    """An allocated token ring is smaller than the live-block need of the partition it would run on."""


@dataclass(frozen=True)
class TaskGeometry:
    """How role2 cuts one ring block into GEMM tasks, and how far its scheduler looks ahead.

    ``w1_rows`` / ``w2_rows``: weight rows one W1 / W2 task covers (the SM90 kernel: 2 consumer warpgroups x
    ``GC_M_SUB`` slabs of 64 rows; the W1 epilogue needs 256 rows, one 128-column requant group). ``l1_waves``: full
    waves of W1 tasks published before the first W2 wave.
    """

    w1_rows: int = 256
    w2_rows: int = 256
    l1_waves: int = 2

    def __post_init__(self) -> None:
        for arg in ("w1_rows", "w2_rows", "l1_waves"):
            int_in_range(f"TaskGeometry.{arg}", getattr(self, arg), 1, None, "a task size or wave count")
        for arg in ("w1_rows", "w2_rows"):
            if getattr(self, arg) % 64:
                raise ValueError(f"TaskGeometry.{arg}: must be a multiple of 64 (WGMMA M slabs), got "
                                 f"{getattr(self, arg)}")


DEFAULT_GEOMETRY = TaskGeometry()
"""The SM90 kernels' geometry: 256-row W1 and W2 tasks, two W1 waves of look-ahead."""


@dataclass(frozen=True)
class RingModel:
    """The capacity model of one (shape, ``BM``, compute-partition size): see the module docstring."""

    shape: MoEShape
    block_m: int
    compute_sms: int
    geometry: TaskGeometry = DEFAULT_GEOMETRY

    def __post_init__(self) -> None:
        if not isinstance(self.shape, MoEShape):
            raise TypeError(f"shape: must be an MoEShape, got {type(self.shape).__name__}")
        if self.block_m not in workspace_block_ms():
            raise ValueError(f"block_m: must be one of {workspace_block_ms()} (SM90 WGMMA N of a role2 kernel), got "
                             f"{self.block_m!r}")
        int_in_range("compute_sms", self.compute_sms, 1, None, "SMs of the compute partition")
        if not isinstance(self.geometry, TaskGeometry):
            raise TypeError(f"geometry: must be a TaskGeometry, got {type(self.geometry).__name__}")
        for n, rows, arg in ((2 * self.shape.intermediate, self.geometry.w1_rows, "w1_rows"),
                             (self.shape.hidden, self.geometry.w2_rows, "w2_rows")):
            if n % rows:
                raise ValueError(f"geometry.{arg}: must divide the GEMM's N = {n} (whole tasks per block), got {rows}")

    @property
    def max_assignments(self) -> int:
        """Rows one rank can receive per replay: ``Tmax·P·min(k, e)``."""
        s = self.shape
        return s.capacity * s.num_ranks * min(s.topk, s.num_local_experts)

    @property
    def pool_blocks(self) -> int:
        """Logical pool blocks: ``ceil(A/BM) + e`` (each expert's last block may be partial)."""
        return -(-self.max_assignments // self.block_m) + self.shape.num_local_experts

    def call_pool_blocks(self, num_tokens: int) -> int:
        """Pool blocks one call can fill when this rank passes ``num_tokens`` tokens: ``ceil(T·min(k, e)/BM) + e``
        on one rank (its ``T`` is every rank's), the whole pool with more ranks (the others' ``T`` is unknown
        here)."""
        s = self.shape
        if s.num_ranks != 1:
            return self.pool_blocks
        rows = num_tokens * min(s.topk, s.num_local_experts)
        return min(self.pool_blocks, -(-rows // self.block_m) + s.num_local_experts)

    @property
    def w1_tasks_per_block(self) -> int:
        """``t1 = 2I / w1_rows``: W1 tasks (and ``l1_empty_count`` releases) per block generation."""
        return 2 * self.shape.intermediate // self.geometry.w1_rows

    @property
    def w2_tasks_per_block(self) -> int:
        """``t2 = H / w2_rows``: W2 tasks (and ``l2_empty_count`` releases) per block generation."""
        return self.shape.hidden // self.geometry.w2_rows

    @property
    def lookahead_blocks(self) -> int:
        """``w = ceil(l1_waves·C / t1)``: blocks whose W1 tasks are published before the first W2 wave."""
        return -(-self.geometry.l1_waves * self.compute_sms // self.w1_tasks_per_block)

    @property
    def l2_wave_blocks(self) -> int:
        """``s = ceil(C / t2) + 1``: blocks one wave of W2 tasks can span."""
        return -(-self.compute_sms // self.w2_tasks_per_block) + 1

    @property
    def live_blocks(self) -> int:
        """``w + s``: ring blocks simultaneously live at full overlap."""
        return self.lookahead_blocks + self.l2_wave_blocks

    @property
    def deadlock_free_blocks(self) -> int:
        """``min(pool, w)``: the smallest ring with which the task sequence cannot deadlock."""
        return min(self.pool_blocks, self.lookahead_blocks)

    @property
    def required_ring_blocks(self) -> int:
        """``min(pool, w + s)``: the ring blocks a launch on this partition needs."""
        return min(self.pool_blocks, self.live_blocks)


@dataclass(frozen=True)
class RingPlan:
    """A ring of ``ring_blocks`` blocks of ``block_m`` rows: pool-block mapping and expected signal values."""

    block_m: int
    ring_blocks: int
    w1_tasks_per_block: int
    w2_tasks_per_block: int
    w1_tiles: int

    def __post_init__(self) -> None:
        for arg in ("block_m", "ring_blocks", "w1_tasks_per_block", "w2_tasks_per_block", "w1_tiles"):
            int_in_range(f"RingPlan.{arg}", getattr(self, arg), 1, None, "a count of ring blocks or tasks")
        if self.w1_tiles > 64:
            raise ValueError(f"RingPlan.w1_tiles: must be <= 64 (bits of l2_full_mask), got {self.w1_tiles}")

    @classmethod
    def for_model(cls, model: RingModel, ring_blocks: int) -> RingPlan:
        """The plan of a ring of ``ring_blocks`` blocks for ``model``'s shape and ``BM`` (no capacity check)."""
        return cls(model.block_m, ring_blocks, model.w1_tasks_per_block, model.w2_tasks_per_block,
                   model.shape.num_w1_tiles)

    def slot(self, pool_block: int) -> tuple[int, int]:
        """``(ring block, generation)`` of logical pool block ``pool_block``: ``(p mod R, p div R)``."""
        if isinstance(pool_block, bool) or not isinstance(pool_block, int) or pool_block < 0:
            raise ValueError(f"pool_block: must be an int >= 0, got {pool_block!r}")
        return pool_block % self.ring_blocks, pool_block // self.ring_blocks

    def ring_row(self, pool_block: int, row: int) -> int:
        """Row of the ring arrays (``l1_acts``, ``l1_acts_sf`` columns, ...) holding row ``row`` of ``pool_block``."""
        if not 0 <= row < self.block_m:
            raise ValueError(f"row: must be in [0, {self.block_m}), got {row}")
        return self.slot(pool_block)[0] * self.block_m + row

    def l1_full_expected(self, generation: int) -> int:
        """``l1_full_count`` once generation ``g`` has landed: ``BM·(g+1)``."""
        return self.block_m * (_generation(generation) + 1)

    def l1_empty_expected(self, generation: int) -> int:
        """``l1_empty_count`` once every W1 task of generation ``g`` read the block: ``t1·(g+1)``."""
        return self.w1_tasks_per_block * (_generation(generation) + 1)

    def l2_empty_expected(self, generation: int) -> int:
        """``l2_empty_count`` once every W2 task of generation ``g`` finished: ``t2·(g+1)``."""
        return self.w2_tasks_per_block * (_generation(generation) + 1)

    def l2_full_mask_expected(self, generation: int) -> int:
        """``l2_full_mask`` once every W1 tile of generation ``g`` toggled its bit: all ones for even ``g``, else 0."""
        return ((1 << self.w1_tiles) - 1) if _generation(generation) % 2 == 0 else 0

    def refill_waits(self, generation: int) -> tuple[int, int]:
        """``(l1_empty_count, l2_empty_count)`` role1 waits for before writing generation ``g`` (``(0, 0)`` at 0)."""
        g = _generation(generation)
        return self.w1_tasks_per_block * g, self.w2_tasks_per_block * g


def _generation(generation: object) -> int:
    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
        raise ValueError(f"generation: must be an int >= 0, got {generation!r}")
    return generation


def check_ring(model: RingModel, ring_blocks: int) -> RingPlan:
    """The plan of an allocated ring of ``ring_blocks`` blocks; raises :class:`RingCapacityError` if undersized.

    Call before any launch with the *actual* compute-partition SM count in ``model``.
    """
    int_in_range("ring_blocks", ring_blocks, 1, None, "blocks of the token ring")
    need = model.required_ring_blocks
    if ring_blocks < need:
        raise RingCapacityError(
            f"ring_blocks: must be >= {need} = min(pool {model.pool_blocks}, live {model.lookahead_blocks} look-ahead "
            f"+ {model.l2_wave_blocks} W2-wave) for BM={model.block_m} on a {model.compute_sms}-SM compute "
            f"partition, got {ring_blocks}; recreate the buffer for this partition (compute_sms=...)")
    return RingPlan.for_model(model, ring_blocks)


@dataclass(frozen=True)
class RingCapacity:
    """What a workspace allocates for the ring: ``rows`` ring rows and ``blocks`` per-block signal slots.

    Sized for every candidate ``BM`` at once (the block size is chosen per call from the token count):
    ``rows = max_BM required(BM)·BM`` and ``blocks = max_BM required(BM)``.
    """

    rows: int
    blocks: int

    @classmethod
    def for_partition(cls, shape: MoEShape, compute_sms: int,
                      geometry: TaskGeometry = DEFAULT_GEOMETRY) -> RingCapacity:
        """The capacity every ``BM`` candidate needs on a ``compute_sms``-SM compute partition."""
        models = [RingModel(shape, bm, compute_sms, geometry) for bm in workspace_block_ms()]
        return cls(rows=max(m.required_ring_blocks * m.block_m for m in models),
                   blocks=max(m.required_ring_blocks for m in models))

    @classmethod
    def whole_pool(cls, shape: MoEShape, geometry: TaskGeometry = DEFAULT_GEOMETRY) -> RingCapacity:
        """A ring holding every pool block of every ``BM`` candidate: what roles run in sequence need
        (``GC_MOE_PARTITION=off``: role2 starts after role1, or beside it behind a programmatic edge without every CTA
        resident until role1's leave, so role1 must never wait for a refill only role2 could grant)."""
        models = [RingModel(shape, bm, 1, geometry) for bm in workspace_block_ms()]
        return cls(rows=max(m.pool_blocks * m.block_m for m in models), blocks=max(m.pool_blocks for m in models))

    @classmethod
    def for_sequential_calls(cls, shape: MoEShape, max_tokens: int,
                             geometry: TaskGeometry = DEFAULT_GEOMETRY) -> RingCapacity:
        """A ring holding every block a call of at most ``max_tokens`` tokens can fill, at the block size each such
        call runs (either compute path's): what calls run with the roles in sequence need without the whole pool
        (``GC_MOE_PARTITION=auto``'s small calls, :func:`~gc_moe_compat.operator.heuristics.sequential_max_tokens`)."""
        rows = blocks = 0
        for t in range(1, max_tokens + 1):
            for mma_type in MMA_TYPES:
                bm = block_m_for_call(t, shape.num_ranks, shape.topk, shape.num_experts, mma_type=mma_type)
                need = RingModel(shape, bm, 1, geometry).call_pool_blocks(t)
                rows, blocks = max(rows, need * bm), max(blocks, need)
        return cls(rows=rows, blocks=blocks)

    def union(self, other: RingCapacity) -> RingCapacity:
        """The capacity holding both this one's rings and ``other``'s."""
        return RingCapacity(rows=max(self.rows, other.rows), blocks=max(self.blocks, other.blocks))

    def holds_call(self, model: RingModel, num_tokens: int) -> bool:
        """Whether this capacity holds every block a call of ``num_tokens`` tokens can fill
        (:meth:`RingModel.call_pool_blocks`): then no ring block is ever refilled, which roles run in sequence
        need."""
        return self.ring_blocks(model) >= model.call_pool_blocks(num_tokens)

    def ring_blocks(self, model: RingModel) -> int:
        """Ring blocks of ``model.block_m`` rows this capacity holds (never more than the pool uses)."""
        return min(self.rows // model.block_m, self.blocks, model.pool_blocks)

    def plan(self, model: RingModel) -> RingPlan:
        """:func:`check_ring` on this capacity: the call's ring plan, or :class:`RingCapacityError`."""
        return check_ring(model, self.ring_blocks(model))


def pool_table(counts: torch.Tensor, plan: RingPlan) -> torch.Tensor:
    """The block table role1 publishes: int32 ``[n, 3]`` of (local expert, valid rows, ring row offset).

    ``counts`` is int ``[e]``: rows this rank received per local expert (``reference.recv_counts``). Row ``p`` is
    pool block ``p``; the ring row offset is ``(p mod R)·BM``. This is the ``blocks`` table format the SM90 GEMM
    kernel reads (``kernels/sm90/role2_gemm_fp8xfp8.cu``).
    """
    if not isinstance(counts, torch.Tensor) or counts.dim() != 1 or counts.is_floating_point():
        raise ValueError(f"counts: must be a 1-D integer tensor [e], got {counts!r}")
    if counts.numel() and int(counts.min()) < 0:
        raise ValueError(f"counts: must be >= 0, got min {int(counts.min())}")
    bm = plan.block_m
    blocks = [(expert, min(bm, n - start)) for expert, n in enumerate(counts.tolist()) for start in range(0, n, bm)]
    table = [(expert, valid, plan.slot(p)[0] * bm) for p, (expert, valid) in enumerate(blocks)]
    return torch.tensor(table, dtype=torch.int32, device="cpu").reshape(-1, 3)


def pool_rows(received: list[torch.Tensor], plan: RingPlan) -> torch.Tensor:
    """Where every received row lands: int64 ``[N, 7]`` of (pool block, generation, ring row, local expert,
    src_rank, src_token, slot), in pool order.

    ``received[le]`` is ``[n, 3]`` (src_rank, src_token, slot) for local expert ``le``, in the documented order: one
    rank's entry of :func:`gc_moe_compat.testing.reference.dispatch_plan`. This is the ring content kernels are
    compared to.
    """
    out = []
    first = 0
    for expert, rows in enumerate(received):
        if rows.dim() != 2 or rows.shape[1] != 3:
            raise ValueError(f"received[{expert}]: must be [n, 3] (src_rank, src_token, slot), got {tuple(rows.shape)}")
        n = rows.shape[0]
        i = torch.arange(n, dtype=torch.int64, device=rows.device)
        block = first + i // plan.block_m
        gen = block // plan.ring_blocks
        ring_row = (block % plan.ring_blocks) * plan.block_m + i % plan.block_m
        out.append(torch.stack([block, gen, ring_row, torch.full_like(i, expert), *rows.to(torch.int64).unbind(1)], 1))
        first += math.ceil(n / plan.block_m)
    return torch.cat(out) if out else torch.zeros(0, 7, dtype=torch.int64, device="cpu")
