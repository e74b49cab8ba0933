"""Host side of role2 in operator mode, the SM90 grouped GEMMs over the token ring (paper §4.3-4.5).

The kernel is a grouped-GEMM source compiled with ``GC_OPERATOR=1``, one per compute path
(:class:`~gc_moe_compat.compute_paths.ComputePath` ``kernel`` / ``operator_entry``):
``kernels/sm90/role2_gemm_fp8xfp8.cu`` (entry ``gc_sm90_fp8_role2``, ``fp8xfp8``: FP8 weights with FP32 128x128 block
scales, FP32 1x128 intermediate requant) and ``kernels/sm90/role2_gemm_fp8xfp4.cu`` (``gc_sm90_fp8_fp4_role2``,
``fp8xfp4``: window-repacked MXFP4 weights decoded to E4M3 in registers, UE8M0 1x128 intermediate requant, its
power-of-two scales stored as FP32 in ``l2_acts_sf`` like the FP8 path's). Their standalone variants
(``GC_OPERATOR`` unset) are unchanged byte for byte. Both share the grid body, ring handshake and W2 scatter
(``kernels/sm90/role2_gemm.cuh``, ``role2_ring.cuh``). One persistent grid of one CTA per compute SM (less the
SMs a fused shared expert beside it reserves, :func:`~.role4_shared.reserve_sms`) acquires ``pool_header``
(role1), reads the block table from ``pool_table`` and walks the task sequence of
:func:`task_sequence`, each CTA taking the next task whenever it is ready for one (the workspace's
``role2_schedule`` count: W1 tasks take ``H/128`` K steps, W2 tasks ``I/128``, and a static split left some CTAs
1.1-1.7x the mean work): W1 tiles of ring blocks as role1 fills them (``l1_full_count``), W1 epilogue into ``l2_acts`` /
``l2_acts_sf`` toggling ``l2_full_mask`` and releasing ``l1_empty_count``, W2 tiles once their intermediate tiles are
there, W2 epilogue storing BF16 partial rows straight into the source rank's ``combine`` slot ``(slot, src_token)``
and releasing ``l2_empty_count``. The ordering argument (deadlock freedom, proxy fences, why role3's fence/release
chain covers the remote stores) is written at the top of ``role2_gemm.cuh``.

Arguments: four tensor maps (W1 / W2 weights, ``l1_acts`` / ``l2_acts`` of the workspace), the workspace
:class:`~gc_moe_compat.runtime.workspace.PeerTable` and :class:`~gc_moe_compat.operator.workspace.WorkspaceOffsets`,
and :class:`Role2Params` (C declaration generated into ``kernels/sm90/role2_gemm_params.cuh``). Errors land in role2's
record of the workspace ``status`` region at one of the :class:`Role2Site` sites (generated into the kernels'
headers too); :func:`raise_for_role2_status` reads it.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gc_moe_compat.compute_paths import MMA_TYPES, compute_path
from gc_moe_compat.operator.buffer import GcMoeBuffer
from gc_moe_compat.operator.heuristics import (
    CONSUMER_WARPGROUPS,
    W1_SLABS,
    block_m_candidates,
    most_stages,
    pipelined,
    producer_only,
    smem_bytes,
    tile_rows,
)
from gc_moe_compat.operator.ring import RingModel, RingPlan
from gc_moe_compat.operator.sm90.fp4_layout import UNIT_ROWS, permute_units
from gc_moe_compat.operator.weights import GcMoeWeights
from gc_moe_compat.operator.workspace import StatusRecord, WorkspaceOffsets
from gc_moe_compat.runtime import jit
from gc_moe_compat.runtime.graph import KernelNode
from gc_moe_compat.runtime.green import Role
from gc_moe_compat.runtime.params import KernelArgs, c_struct_declaration
from gc_moe_compat.runtime.status import StatusSite, raise_for_status, spin_timeout_ns
from gc_moe_compat.runtime.tensormap import TensorMapArg, encode_2d

__all__ = [
    "TASK_ROWS",
    "WARMUP",
    "Role2Params",
    "Role2Site",
    "Role2Variant",
    "Role2Weights",
    "check_variant",
    "fp4_units",
    "grouped_header",
    "operator_smem_bytes",
    "operator_stages",
    "params_header",
    "raise_for_role2_status",
    "role2_args",
    "role2_defines",
    "role2_node",
    "role2_variant",
    "variants_of",
    "task_sequence",
]

TASK_ROWS = tile_rows(W1_SLABS)
"""Weight rows of every role2 task, W1 and W2 alike (256: ``ring.DEFAULT_GEOMETRY``)."""
WARMUP = 1
"""``Role2Params.flags`` bit: return at once (the one-time warm-up launch of a graph node)."""


class Role2Site(StatusSite):
    """Status sites of the operator-mode kernel: 1-3 shared with the standalone kernel (``gc_moe::sm90::GroupedSite``,
    generated into kernels/sm90/grouped.cuh by :func:`grouped_header`), 4-8 of operator mode only
    (``gc_moe::Role2Site``, generated into kernels/sm90/role2_gemm_params.cuh by :func:`params_header`)."""

    SMEM = 1, "role2 dynamic shared memory below the variant's need"
    EMPTY = 2, "role2 producer wait for a free pipeline stage"
    FULL = 3, "role2 consumer wait for a filled pipeline stage"
    POOL_HEADER = 4, "role2 wait for pool_header (role1 never published the block table)"
    L1_FULL = 5, "role2 W1 wait on l1_full_count (role1 never filled the ring block)"
    L2_MASK = 6, "role2 W2 wait on l2_full_mask (a W1 tile of the block never finished)"
    POOL_SIZE = 7, "role2 pool_header holds more pool blocks than pool_table rows"
    SOURCE = 8, "role2 l1_source names another pool block than the task's (ring generation mix-up)"


_GROUPED_SITES = (Role2Site.SMEM, Role2Site.EMPTY, Role2Site.FULL)
"""The sites both grouped GEMMs report, standalone and in operator mode."""


class Role2Params(ctypes.Structure):
    """By-value kernel argument: weight scales, sizes, ring plan numbers, epilogue constants, timeout, flags.

    ``w1_sf`` / ``w2_sf``: device addresses of the W1 / W2 weight scales the kernel applies outside the payload:
    ``fp8xfp8`` the FP32 block scales ``[e, 2I/128, H/128]`` / ``[e, H/128, I/128]``, ``fp8xfp4`` the per-expert window
    factors ``2^base`` (FP32 ``[e]``; the K32 scales travel inside the weight units);
    ``w1_tasks`` / ``w2_tasks`` / ``lookahead``: ``t1``, ``t2``, ``w`` of the call's
    :class:`~gc_moe_compat.operator.ring.
    RingModel`; ``clamp`` +inf for no clamp.
    """

    _fields_ = [
        ("w1_sf", ctypes.c_uint64),
        ("w2_sf", ctypes.c_uint64),
        ("timeout_ns", ctypes.c_uint64),
        ("hidden", ctypes.c_uint32),
        ("inter", ctypes.c_uint32),
        ("block_m", ctypes.c_uint32),
        ("ring_blocks", ctypes.c_uint32),
        ("w1_tasks", ctypes.c_uint32),
        ("w2_tasks", ctypes.c_uint32),
        ("lookahead", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("clamp", ctypes.c_float),
        ("alpha", ctypes.c_float),
    ]


def params_header() -> str:
    """The generated part of kernels/sm90/role2_gemm_params.cuh: the C declarations of :class:`Role2Params` and of
    the operator-mode sites of :class:`Role2Site`."""
    struct = c_struct_declaration(Role2Params, "Role2Params", "gc_moe_compat/operator/sm90/role2_gemm.py")
    sites = [site for site in Role2Site if site not in _GROUPED_SITES]
    return struct + "\n" + Role2Site.c_declaration("Role2Site", "kSite", sites)


def grouped_header() -> str:
    """The generated part of kernels/sm90/grouped.cuh: the C declaration of the sites of :class:`Role2Site` the
    standalone kernel shares."""
    return Role2Site.c_declaration("GroupedSite", "kSite", _GROUPED_SITES)


def operator_smem_bytes(bm: int, stages: int, mma_type: str = "fp8xfp8") -> int:
    """Dynamic shared memory of an operator-mode variant (``kSmemBytes`` with ``GC_OPERATOR=1``): the standalone
    W1 layout of the ``mma_type`` kernel (:func:`~gc_moe_compat.operator.heuristics.smem_bytes`, 256-row tasks) plus the
    W2 epilogue's staged BF16 tile ``[bm][256 rows + 8 pad]`` and ``2 + stages`` 32-bit shared words (the pool block
    count, the producer's stop slot, the task of each stage) in whole 16-byte units."""
    words = 4 * (2 + stages)
    return smem_bytes(bm, W1_SLABS, stages, mma_type) + bm * (TASK_ROWS * 2 + 16) + -(-words // 16) * 16


def operator_stages(bm: int, mma_type: str = "fp8xfp8") -> int:
    """The most stages whose operator-mode shared memory fits one CTA
    (:func:`~gc_moe_compat.operator.heuristics.most_stages`)."""
    return most_stages(lambda stages: operator_smem_bytes(bm, stages, mma_type))


def check_variant(bm: int, pipelined: bool, mma_type: str) -> None:
    """Refuses a variant the ``mma_type`` kernel does not compile: ``bm`` outside its role2 blocks
    (:func:`~gc_moe_compat.operator.heuristics.block_m_candidates`), or the wide block without the producer
    warpgroup."""
    candidates = block_m_candidates(mma_type)
    if bm not in candidates:
        raise ValueError(f"bm: must be one of {candidates} (the {mma_type} role2 kernel's blocks), got {bm!r}")
    if producer_only(bm) and not pipelined:
        raise ValueError(f"pipelined: BM={bm} runs only with the producer warpgroup (heuristics.producer_only)")


def role2_defines(bm: int, pipelined: bool, fast_math: bool = True, mma_type: str = "fp8xfp8") -> dict[str, int]:
    """Compile-time parameters of one operator-mode variant of the ``mma_type`` kernel (256-row
    tasks for both GEMMs); ``GC_OP_SMEM_BYTES`` is :func:`operator_smem_bytes`, which the kernel asserts equal to
    its own ``kSmemBytes``."""
    check_variant(bm, pipelined, mma_type)
    stages = operator_stages(bm, mma_type)
    return {"GC_OPERATOR": 1, "GC_BM": bm, "GC_EPI": 1, "GC_M_SUB": W1_SLABS, "GC_PRODUCER_WG": int(pipelined),
            "GC_STAGES": stages, "GC_FAST_MATH": int(fast_math),
            "GC_OP_SMEM_BYTES": operator_smem_bytes(bm, stages, mma_type)}


@dataclass(frozen=True)
class Role2Variant:
    """One operator-mode variant: ``bm``, producer warpgroup or not, fast-math sigmoid, and the compute path whose
    kernel it is (``mma_type``)."""

    bm: int
    pipelined: bool
    fast_math: bool = True
    mma_type: str = "fp8xfp8"

    def __post_init__(self) -> None:
        check_variant(self.bm, self.pipelined, self.mma_type)

    @property
    def source(self) -> str:
        """The kernel source under ``kernels/``."""
        return compute_path(self.mma_type).kernel

    @property
    def kernel_name(self) -> str:
        """The kernel's operator-mode entry point."""
        return compute_path(self.mma_type).operator_entry

    @property
    def threads(self) -> int:
        """384 with the producer warpgroup, 256 without."""
        return 128 * (CONSUMER_WARPGROUPS + int(self.pipelined))

    @property
    def smem(self) -> int:
        return operator_smem_bytes(self.bm, operator_stages(self.bm, self.mma_type), self.mma_type)

    @property
    def defines(self) -> dict[str, int]:
        return role2_defines(self.bm, self.pipelined, self.fast_math, self.mma_type)


def role2_variant(model: RingModel, num_tokens: int, *, fast_math: bool = True) -> Role2Variant:
    """The variant for a call: ``model.block_m``, the kernel of ``model.shape.mma_type``; the producer warpgroup
    when the expected tasks (over the blocks ``num_tokens`` tokens per rank fill on average) exceed the grid, as
    every GEMM decides (:func:`~gc_moe_compat.operator.heuristics.pipelined`)."""
    s = model.shape
    rows = num_tokens * s.num_ranks * min(s.topk, s.num_local_experts)
    blocks = min(model.pool_blocks, -(-rows // model.block_m) + min(s.num_local_experts, rows))
    tasks = blocks * (model.w1_tasks_per_block + model.w2_tasks_per_block)
    pipe = pipelined(tasks, model.compute_sms, block_m=model.block_m)
    return Role2Variant(model.block_m, pipe, fast_math, s.mma_type)


def variants_of(bm: int, mma_type: str, fast_math: bool = True) -> list[Role2Variant]:
    """Every variant a call with block ``bm`` can run (with and without the producer warpgroup where both exist):
    what a prebuild compiles."""
    return [Role2Variant(bm, p, fast_math, mma_type) for p in (False, True)
            if p or not producer_only(bm)]


def task_sequence(n: int, lookahead: int, t1: int, t2: int) -> list[tuple[str, int, int]]:
    """The kernel's task order (``role2_task``) for ``n`` pool blocks: ``(kind, pool block, tile)`` per index.

    W1 tiles of blocks ``0..min(w, n)-1`` (tile-major), then per ``j``: the W2 tiles of block ``j``, then the W1 tiles
    of block ``j + w`` while it exists: the order of :mod:`gc_moe_compat.operator.ring`'s live-block model.
    """
    a = min(lookahead, n)
    out = [("w1", s % a, s // a) for s in range(a * t1)]
    for j in range(n):
        out += [("w2", j, tile) for tile in range(t2)]
        if j + lookahead < n:
            out += [("w1", j + lookahead, tile) for tile in range(t1)]
    return out


_UNIT_CHUNK = 8
"""Experts per lane-permutation chunk in :func:`fp4_units` (its integer temporaries are ~40 bytes per weight)."""


def fp4_units(w: GcMoeWeights) -> torch.Tensor:
    """The ``fp8xfp4`` weights ``w`` (window-repacked ``[e, N, K/2]`` codes, relative exponents ``[e, N, K/32]``) as
    the register decoder's lane-permuted units (:func:`~gc_moe_compat.operator.sm90.fp4_layout.permute_units`) viewed as
    128-byte rows ``uint8 [e * K/128 * N/64 * UNIT_ROWS, 128]``, permuted a few experts at a time."""
    if not compute_path(w.mma_type).fp4:
        raise ValueError(f"w: must be fp8xfp4 weights, got mma_type={w.mma_type!r}")
    codes = w.payload.view(torch.uint8)
    parts = [permute_units(codes[i:i + _UNIT_CHUNK], w.scales[i:i + _UNIT_CHUNK])
             for i in range(0, codes.shape[0], _UNIT_CHUNK)]
    return torch.cat(parts).reshape(-1, 128)


class Role2Weights:
    """One weight pair's kernel view, built once per :class:`GcMoeWeights` pair and reused: tensor maps of both
    GEMMs' weights (one box per task and K128 step) and the per-weight scales :class:`Role2Params` points at.

    ``fp8xfp8``: the interleaved W1 ``[e·2I, H]`` and W2 ``[e·H, I]`` E4M3 payloads (256-row boxes, 128-byte swizzle)
    and their FP32 block scales. ``fp8xfp4``: the window-repacked payloads lane-permuted into the decoder's units
    (:func:`fp4_units`; boxes of a task's four 64-row units, no swizzle) and the per-expert factors ``2^base``.
    """

    def __init__(self, w1: GcMoeWeights, w2: GcMoeWeights) -> None:
        if (w1.gemm, w2.gemm) != ("l1", "l2") or w1.mma_type != w2.mma_type or w1.mma_type not in MMA_TYPES:
            raise ValueError(f"weights: role2 takes an (l1, l2) pair of one mma_type in {MMA_TYPES}, got "
                             f"({w1.gemm}, {w2.gemm}) of {w1.mma_type}/{w2.mma_type}")
        self.mma_type = w1.mma_type
        self.w1, self.w2 = w1, w2  # keep the payloads alive while the maps point at them
        e, two_i, k_cols = w1.payload.shape
        self.num_experts, self.inter = e, two_i // 2
        if not compute_path(self.mma_type).fp4:
            self.hidden = k_cols
            self.tm_w1 = encode_2d(w1.payload.reshape(e * two_i, k_cols).view(torch.uint8), TASK_ROWS)
            self.tm_w2 = encode_2d(w2.payload.reshape(e * k_cols, self.inter).view(torch.uint8), TASK_ROWS)
            self.w1_sf = w1.scales.float().contiguous()
            self.w2_sf = w2.scales.float().contiguous()
        else:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                # the permutation's kernels would land in the caller's graph and fill the units only when it replays
                raise RuntimeError("weights: fp8xfp4 weights are lane-permuted for role2 on their first call on a "
                                   "buffer, which cannot happen while a stream is capturing: make one eager call with "
                                   "these weights on this buffer before capturing")
            self.hidden = 2 * k_cols
            box = TASK_ROWS // 64 * UNIT_ROWS  # one task's 64-row units of one K128 step
            self.units1, self.units2 = fp4_units(w1), fp4_units(w2)
            self.tm_w1 = encode_2d(self.units1, box, swizzle=False)
            self.tm_w2 = encode_2d(self.units2, box, swizzle=False)
            self.w1_sf = w1.factor.float().contiguous()
            self.w2_sf = w2.factor.float().contiguous()


def _ring_maps(buffer: GcMoeBuffer, bm: int) -> tuple[TensorMapArg, TensorMapArg]:
    return (encode_2d(buffer.l1_acts.view(torch.uint8), bm), encode_2d(buffer.l2_acts.view(torch.uint8), bm))


def role2_params(buffer: GcMoeBuffer, weights: Role2Weights, model: RingModel, plan: RingPlan, *,
                 activation_clamp: float | None = 10.0, activation_alpha: float = 1.0,
                 timeout_ms: float | None = None, warmup: bool = False) -> Role2Params:
    """The :class:`Role2Params` of one call (``plan`` from the buffer's ring for ``model``)."""
    shape = buffer.shape
    if weights.mma_type != shape.mma_type:
        raise ValueError(f"weights: {weights.mma_type} weights on a buffer of mma_type={shape.mma_type!r}")
    if (weights.num_experts, weights.hidden, weights.inter) != (shape.num_local_experts, shape.hidden,
                                                                shape.intermediate):
        raise ValueError(f"weights: [{weights.num_experts} experts, H={weights.hidden}, I={weights.inter}] do not "
                         f"match the buffer's e={shape.num_local_experts}, H={shape.hidden}, I={shape.intermediate}")
    if (plan.block_m != model.block_m or plan.w1_tasks_per_block != model.w1_tasks_per_block
            or plan.w2_tasks_per_block != model.w2_tasks_per_block):
        raise ValueError(f"plan: {plan} is not a plan of the model's BM={model.block_m} geometry")
    return Role2Params(
        w1_sf=weights.w1_sf.data_ptr(), w2_sf=weights.w2_sf.data_ptr(), timeout_ns=spin_timeout_ns(timeout_ms),
        hidden=shape.hidden, inter=shape.intermediate, block_m=plan.block_m, ring_blocks=plan.ring_blocks,
        w1_tasks=plan.w1_tasks_per_block, w2_tasks=plan.w2_tasks_per_block, lookahead=model.lookahead_blocks,
        flags=WARMUP if warmup else 0, clamp=math.inf if activation_clamp is None else float(activation_clamp),
        alpha=float(activation_alpha))


def role2_args(buffer: GcMoeBuffer, weights: Role2Weights, model: RingModel, plan: RingPlan,
               **kw: object) -> KernelArgs:
    """The kernel's seven by-value arguments: four tensor maps, peer table, workspace offsets, :func:`role2_params`
    (keywords as there)."""
    params = role2_params(buffer, weights, model, plan, **kw)
    tm_l1, tm_l2 = _ring_maps(buffer, plan.block_m)
    table = type(buffer.peer_table).from_buffer_copy(buffer.peer_table)
    return KernelArgs(weights.tm_w1, weights.tm_w2, tm_l1, tm_l2, table,
                      WorkspaceOffsets.from_buffer_copy(buffer.offsets), params)


def kernel(variant: Role2Variant) -> jit.Kernel:
    """The operator-mode kernel of ``variant``, compiled (or cached), loaded, its shared-memory opt-in set."""
    return jit.load_kernel(variant.source, variant.defines, variant.kernel_name, shared_bytes=variant.smem,
                           ordinal=torch.cuda.current_device())


def role2_node(buffer: GcMoeBuffer, weights: Role2Weights, model: RingModel, plan: RingPlan, variant: Role2Variant,
               *, name: str = "role2", deps: Sequence[str] = (), programmatic: Sequence[str] = (),
               grid: int | None = None, **kw: object) -> KernelNode:
    """Role2 as a graph node after ``deps`` (those in ``programmatic`` through a programmatic edge; none when
    partitioned: a root concurrent with role1): on the compute
    green context when the buffer is partitioned (the whole device otherwise), one CTA per compute SM
    (``model.compute_sms``, or ``grid`` CTAs: fewer when role4 runs beside it on the others; every CTA must be
    resident, the task sequence relies on it, and any grid size walks every task); its warm-up launch has the
    :data:`WARMUP` flag. ``kw``: the keywords of :func:`role2_params`."""
    if variant.bm != plan.block_m:
        raise ValueError(f"variant: BM={variant.bm} differs from the plan's {plan.block_m}")
    if variant.mma_type != buffer.shape.mma_type:
        raise ValueError(f"variant: the {variant.mma_type} kernel on a buffer of mma_type={buffer.shape.mma_type!r}")
    role = Role.COMPUTE if buffer.partition == "on" else None
    args = role2_args(buffer, weights, model, plan, **kw)
    warm = role2_args(buffer, weights, model, plan, **kw, warmup=True)
    return KernelNode.make(name, kernel(variant), role, model.compute_sms if grid is None else grid,
                           variant.threads, args, shared_bytes=variant.smem, deps=deps, warmup_args=warm,
                           programmatic=programmatic)


def raise_for_role2_status(buffer: GcMoeBuffer, what: str = "role2 grouped GEMM") -> None:
    """Raises :class:`~gc_moe_compat.runtime.status.DeviceTimeoutError` / ``DeviceCheckError`` if role2 recorded an
    error; call once the graph has finished. The record is cleared first (the next launch runs)."""
    record = buffer.status[StatusRecord.ROLE2]
    saved = record.clone()
    if int(saved[:4].view(torch.int32)[0]):
        record.zero_()
    raise_for_status(saved, what, Role2Site.names())
