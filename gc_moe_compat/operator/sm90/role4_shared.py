"""Host side of role4 on SM90: the fused shared expert on this rank's ``T`` local tokens (paper §4.5).

What it computes: ``combine[k][t] = BF16(W2_s · requant(SwiGLU(BF16(W1_s · x[t]))))`` for ``t < T``, the shared
expert's partial in this rank's combine slot ``k``, which role3 adds after the ``k`` routed slots (slot order, as the
reference's semantics 7). Inputs are read in place (zero copy): the staged ``x`` E4M3 ``[Tmax, H]`` by TMA and its
FP32 1x128 scales ``x_sf [Tmax, H/128]`` token-major. Eq. (3)'s ``shared_l1_acts_sf`` staging is the SM100 (UTCCP)
layout; on SM90 the kernel reads ``x_sf`` as the caller staged it, so nothing is restaged.

Weight recipes (both routed formats; ``Role4Weights`` converts once per weight tensor):

* FP8 E4M3 with FP32 128x128 block scales (recipe ``(1, 128, 128)``, ``config._shared_pair_forms``' float32 form):
  the SM90 FP8 recipe the WGMMA mainloop already streams, converted by
  :func:`~gc_moe_compat.operator.weights.transform_weights_for_gc_moe` ``(…, "fp8xfp8")`` (gate/up interleave by 8).
  One promotion per K128 step.
* DeepGEMM's shared recipe: FP8 E4M3 with per-row UE8M0 K32 scales (``per_token_cast_to_fp8(w, use_ue8m0=True,
  gran_k=32)``; uint8 codes ``[1, N, K/32]`` or packed int32 ``[1, N, K/128]``, canonical row order). L1 payload and
  scale rows interleaved gate/up by 8, the scales packed and transposed to int32 words ``[1, K/128, N]`` (a K step's
  words of a warp's rows are then contiguous: one 32-byte sector per load). The kernel variant ``k32``
  (``GC_W_K32=1``) promotes per K32 MMA: each WGMMA k32 lands in a temporary accumulator and is added with
  ``2^code[row, k32] * x_scale[token, k128]`` (``fp8_grouped.cuh``'s ``consume_n_k32``). Why this and not the FP4
  mainloop's trick (folding the K32 exponent into the E4M3 operand in registers, exact only because E2M1 values
  have 3 bits of range; an E4M3 weight times ``2^(e_k32 - e_max)`` can leave E4M3's range and round): WGMMA has no
  per-K32 scale operand, so an exact K32 scale must be applied between K32 MMAs, and a promotion of a K32 result is
  the cheapest exact place. Two temporaries alternate (the next K32 MMA runs while the last one is promoted), which
  takes exactly the registers of the K128 loop's two slabs, so every variant compiles without spills; the cost is
  four promotions (a multiply and an FMA per accumulator register) per K128 step instead of one.

The W1 epilogue is the routed path's of the buffer's format: clamp, alpha, BF16 rounding, routing weight 1.0, then
the intermediate requant (FP32 ``amax/448`` for ``fp8xfp8``, UE8M0 for ``fp8xfp4``: ``GC_SHARED_UE8M0``).

Kernel: ``kernels/sm90/role4_shared.cu``, the FP8 mainloop of ``sm90/fp8_grouped.cuh`` and the standalone grid body
(``sm90/standalone_gemm.cuh``) with role4's own W1 stage issue (token-major scales). Token scales of W1: ``x_sf``
is token-major, and the mainloop's issue bulk-copies a K step's scales from a transposed ``[K/128, rows]`` array.
The W1 variant therefore has a task-scale region (``task_scales = H/128``, ``4 * BM * H/128`` bytes of shared
memory beside the stages, so no stage is lost at H <= 8192): at a task's start its consumer warpgroups copy the
block's ``[BM, H/128]`` scales once, coalesced, and every K step reads them there. The per-K-step copy
(``task_scales = 0``) stays as a variant only to measure the difference (``role4_nodes(task_scales=False)``,
bench/sglang_sequence_sm90.py's ``*_stage_scales`` ops). Two graph nodes of that source, :data:`NODE_NAMES`:
``role4`` (W1 variant, into ``shared_l2_acts`` / ``shared_l2_acts_sf``) and ``role4_w2`` (W2 variant, into
``combine[k]``), because a W2 task needs every W1 tile of its token block and the standalone body has no grid-wide
handshake (the edge between the nodes is that handshake).

Placement (:func:`reserve_sms`): both nodes run on the compute partition, concurrently with role1 on the
communication partition, and role4 depends on nothing but the caller's staging. Up to one role4 token block
(T <= 64) they run *beside* role2: role4's grid is capped at a reserve of a quarter of the compute SMs, role2's
persistent grid takes the rest (it walks every task with any grid size, and both grids stay resident together), no
edge between them, role3 after both. Why: at small T role4 has few tasks and role2 is bound by streaming weights,
so side by side role4's time is mostly hidden. Above one block they run *before* role2 on every compute SM
(``role2`` depends on ``role4_w2``): role4's work grows with T and a reserve would cut it short. With the partition
off the roles run in sequence: role1 -> role4 -> role4_w2 -> role2 -> role3. The measurements behind the rule
(beside against before per preset and T, and the shipped rule's speedups) are in bench/README.md, "SGLang's Hopper
sequence".
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gc_moe_compat import layouts, quant
from gc_moe_compat.compute_paths import FP8XFP8, compute_path
from gc_moe_compat.config import MoEShape
from gc_moe_compat.operator.buffer import GcMoeBuffer
from gc_moe_compat.operator.heuristics import (
    BLOCK_M_CANDIDATES,
    CONSUMER_WARPGROUPS,
    SMEM_LIMIT,
    W1_SLABS,
    W2_SLABS,
    most_stages,
    pipelined,
    smem_bytes,
    tile_rows,
)
from gc_moe_compat.operator.weights import transform_weights_for_gc_moe
from gc_moe_compat.operator.workspace import StatusRecord
from gc_moe_compat.runtime import jit
from gc_moe_compat.runtime.graph import KernelNode
from gc_moe_compat.runtime.green import Role
from gc_moe_compat.runtime.params import KernelArgs, ptr
from gc_moe_compat.runtime.status import StatusSite, raise_for_status, spin_timeout_ns
from gc_moe_compat.runtime.tensormap import encode_2d

__all__ = [
    "KERNEL",
    "NODE_NAMES",
    "SOURCE",
    "Role4Site",
    "Role4Tables",
    "Role4Variant",
    "Role4Weights",
    "block_m_for_shared",
    "raise_for_role4_status",
    "reserve_sms",
    "role4_nodes",
    "role4_variant",
    "role4_variants",
]

SOURCE = "sm90/role4_shared.cu"
KERNEL = "gc_sm90_role4_shared"
NODE_NAMES = ("role4", "role4_w2")
"""The W1 node and the W2 node (after it)."""
EPI_W1, EPI_W2 = 1, 2

_Pair = tuple[torch.Tensor, torch.Tensor]


class Role4Site(StatusSite):
    """Status sites of role4: the standalone grid body's sites (``gc_moe::sm90::GroupedSite`` 1-3 of
    kernels/sm90/grouped.cuh), reported in role4's own record."""

    SMEM = 1, "role4 dynamic shared memory below the variant's need"
    EMPTY = 2, "role4 producer wait for a free pipeline stage"
    FULL = 3, "role4 consumer wait for a filled pipeline stage"


def block_m_for_shared(num_tokens: int) -> int:
    """``BM`` of the shared expert: every token goes to it, so the smallest candidate holding all ``T`` rows (the
    largest, 64, beyond: several blocks then share each weight tile through L2)."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens: must be an int >= 0, got {num_tokens!r}")
    return next((bm for bm in BLOCK_M_CANDIDATES if bm >= num_tokens), BLOCK_M_CANDIDATES[-1])


@dataclass(frozen=True)
class Role4Variant:
    """One compiled variant: ``bm``, epilogue (1: W1, 2: W2), producer warpgroup or not, fast-math sigmoid, the
    intermediate's scale rule (``ue8m0``: the FP8xFP4 path's), the weights' scale form (``k32``: per-row UE8M0
    K32 words, promoted per K32 MMA; else FP32 128x128 blocks) and where W1 finds the token scales
    (``task_scales``: ``H/128``, the block's scales copied once per task into a shared region of ``4 * BM * H/128``
    bytes; 0, copied per stage by the issuing thread, kept to measure the difference: module docstring)."""

    bm: int
    epi: int
    pipelined: bool
    fast_math: bool = True
    ue8m0: bool = False
    k32: bool = False
    task_scales: int = 0

    def __post_init__(self) -> None:
        if self.bm not in BLOCK_M_CANDIDATES or self.epi not in (EPI_W1, EPI_W2):
            raise ValueError(f"variant: bm in {BLOCK_M_CANDIDATES} and epi in (1, 2), got {self.bm}, {self.epi}")
        if isinstance(self.task_scales, bool) or not isinstance(self.task_scales, int) or self.task_scales < 0 or (
                self.task_scales and self.epi != EPI_W1):
            raise ValueError(f"variant: task_scales must be an int >= 0 (H/128, or 0), and 0 for W2, got "
                             f"{self.task_scales!r} with epi {self.epi}")
        if self.smem > SMEM_LIMIT:
            raise ValueError(f"variant: task_scales={self.task_scales} at bm={self.bm} needs {self.smem} bytes of "
                             f"shared memory with 2 stages, more than the {SMEM_LIMIT} a CTA may use")

    @property
    def slabs(self) -> int:
        """64-row slabs per consumer warpgroup: W1 2 (one 128-column requant group per task), W2 1 (128-row tasks:
        twice the tasks of 256 rows for the few token blocks of a decode batch)."""
        return W1_SLABS if self.epi == EPI_W1 else W2_SLABS

    @property
    def stages(self) -> int:
        """The most stages of the standalone FP8 layout with the task-scale region beside them that fit one CTA."""
        return most_stages(self._smem)

    @property
    def smem(self) -> int:
        """``kSmemBytes``: the standalone FP8 layout plus the task-scale region (``fp8_grouped.cuh``)."""
        return self._smem(self.stages)

    def _smem(self, stages: int) -> int:
        return smem_bytes(self.bm, self.slabs, stages, FP8XFP8.name) + 4 * self.bm * self.task_scales

    @property
    def threads(self) -> int:
        return 128 * (CONSUMER_WARPGROUPS + int(self.pipelined))

    @property
    def defines(self) -> dict[str, int]:
        return {"GC_BM": self.bm, "GC_EPI": self.epi, "GC_M_SUB": self.slabs, "GC_PRODUCER_WG": int(self.pipelined),
                "GC_STAGES": self.stages, "GC_FAST_MATH": int(self.fast_math), "GC_SHARED_UE8M0": int(self.ue8m0),
                "GC_W_K32": int(self.k32), "GC_TASK_SCALES": self.task_scales, "GC_ROLE4_SMEM_BYTES": self.smem}


def _tasks(num_tokens: int, bm: int, rows: int, epi: int) -> int:
    return -(-num_tokens // bm) * (rows // tile_rows(W1_SLABS if epi == EPI_W1 else W2_SLABS))


def reserve_sms(shape: MoEShape, num_tokens: int, compute_sms: int) -> int:
    """The compute SMs kept off role2's grid so that role4 runs beside it, or 0 (role4 before role2).

    Role4 goes beside role2 while the tokens fill one role4 token block (``num_tokens <= BM`` of
    :func:`block_m_for_shared`: T <= 64): it then gets its larger GEMM's tasks (``max(2I, H)`` rows in 256-row W1 /
    128-row W2 tiles), at most a quarter of the compute SMs, and role2 the rest; the routed GEMM, bound by weight
    streaming at these token counts, loses little to the smaller grid, while role4 no longer delays its start. With
    more token blocks role4's work grows with T and the routed GEMM becomes bound by its K steps, so role4 runs before
    role2 on every compute SM. bench/README.md ("SGLang's Hopper sequence") gives the measurement."""
    if num_tokens <= 0:
        return 0
    bm = block_m_for_shared(num_tokens)
    if num_tokens > bm:
        return 0
    need = max(_tasks(num_tokens, bm, 2 * shape.intermediate, EPI_W1), _tasks(num_tokens, bm, shape.hidden, EPI_W2))
    return min(need, compute_sms // 4)


def role4_variant(num_tokens: int, n_w: int, epi: int, compute_sms: int, *, mma_type: str,
                  fast_math: bool = True, k32: bool = False, task_scales: int = 0) -> Role4Variant:
    """The variant of one role4 GEMM (``n_w`` weight rows: 2I for W1, H for W2): :func:`block_m_for_shared`, the
    producer warpgroup when a CTA of the persistent grid gets more than one task, the scale rule of ``mma_type``,
    the weights' scale form (``k32``: :attr:`Role4Weights.k32`), ``task_scales`` as :class:`Role4Variant`'s."""
    bm = block_m_for_shared(num_tokens)
    pipe = pipelined(_tasks(num_tokens, bm, n_w, epi), compute_sms, block_m=bm)
    ue8m0 = compute_path(mma_type).intermediate_quant == "ue8m0_128"
    return Role4Variant(bm, epi, pipe, fast_math, ue8m0, k32, task_scales)


def role4_variants(shape: MoEShape, num_tokens: int, compute_sms: int, *, fast_math: bool = True, k32: bool = False,
                   task_scales: bool = True) -> tuple[Role4Variant, Role4Variant]:
    """The W1 and W2 variants of a call with ``num_tokens`` tokens on ``compute_sms`` SMs (what :func:`role4_nodes`
    launches; the tests and benchmarks prebuild them): W1 with the task-scale region of ``H/128`` groups unless
    ``task_scales`` is False (the per-stage copy)."""
    groups = shape.hidden // 128 if task_scales else 0
    return (role4_variant(num_tokens, 2 * shape.intermediate, EPI_W1, compute_sms, mma_type=shape.mma_type,
                          fast_math=fast_math, k32=k32, task_scales=groups),
            role4_variant(num_tokens, shape.hidden, EPI_W2, compute_sms, mma_type=shape.mma_type,
                          fast_math=fast_math, k32=k32))


def _kernel(variant: Role4Variant) -> jit.Kernel:
    return jit.load_kernel(SOURCE, variant.defines, KERNEL, shared_bytes=variant.smem,
                           ordinal=torch.cuda.current_device())


def _k32_words(gemm: str, pair: _Pair) -> _Pair:
    """DeepGEMM's shared recipe (per-row UE8M0 K32 scales, canonical rows) in the kernel's form: the payload
    (L1 rows interleaved gate/up by 8) and int32 words ``[1, K/128, N]`` (four codes each, byte ``j`` = K32 group
    ``4i + j`` of word ``i``; L1 rows interleaved like the payload), transposed so that a K step's words are
    contiguous over the rows."""
    payload, scales = pair
    words = scales if scales.dtype == torch.int32 else quant.pack_ue8m0_k32(scales)
    if gemm == "l1":
        payload, words = layouts.interleave_gate_up(payload), layouts.interleave_gate_up(words)
    return payload.contiguous(), words.transpose(1, 2).contiguous()


class Role4Weights:
    """One shared weight pair's kernel view, built once: the FP8 payloads (W1 rows interleaved gate/up by 8), the W1
    map (256-row boxes) and W2 map (128-row boxes), and their scales in the kernel's form, by the pair's scale form
    (module docstring): FP32 block scales as they are (:func:`transform_weights_for_gc_moe` ``fp8xfp8``), or
    per-row UE8M0 K32 scales as int32 words ``[1, K/128, N]`` (``k32``).

    ``shared_l1`` / ``shared_l2``: ``(E4M3 [1, 2I, H], scales)`` and ``([1, H, I], scales)`` with scales float32
    ``[1, N/128, K/128]``, uint8 ``[1, N, K/32]`` or int32 ``[1, N, K/128]``, both of one form, already checked by
    :func:`gc_moe_compat.config.validate` (and their values where the weights entered). Must be built outside graph
    capture (the conversion is a device copy).
    """

    def __init__(self, shared_l1: _Pair, shared_l2: _Pair) -> None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("shared_l1_weights/shared_l2_weights: the shared expert's weights are converted for "
                               "role4 on their first call on a buffer, which cannot happen while a stream is "
                               "capturing: make one eager call with these weights on this buffer before capturing")
        forms = {shared_l1[1].dtype == torch.float32, shared_l2[1].dtype == torch.float32}
        if len(forms) > 1:
            raise ValueError(f"shared_l1_weights/shared_l2_weights: both pairs must use one scale form (FP32 128x128 "
                             f"blocks, or per-row UE8M0 K32), got {shared_l1[1].dtype} and {shared_l2[1].dtype}")
        self.k32 = not forms.pop()
        if self.k32:
            (w1, self.w1_sf), (w2, self.w2_sf) = _k32_words("l1", shared_l1), _k32_words("l2", shared_l2)
        else:
            t1, t2 = transform_weights_for_gc_moe(shared_l1, shared_l2, FP8XFP8.name)
            (w1, self.w1_sf), (w2, self.w2_sf) = t1.pair, t2.pair
        _, two_i, hidden = w1.shape
        self.hidden, self.inter = hidden, two_i // 2
        self.w1, self.w2 = w1, w2
        self.tm_w1 = encode_2d(w1.reshape(two_i, hidden).view(torch.uint8), tile_rows(W1_SLABS))
        self.tm_w2 = encode_2d(w2.reshape(hidden, self.inter).view(torch.uint8), tile_rows(W2_SLABS))


class Role4Tables:
    """A buffer's token-block tables, built once outside capture: per ``BM`` candidate the rows ``(0, min(BM,
    Tmax - i·BM), i·BM)`` over the capacity, the block counts ``arange(ceil(Tmax/8) + 1)`` (the kernel's
    ``num_blocks`` points at entry ``ceil(T/BM)``; entry 0 is the warm-up's) and FP32 routing weights of 1.0."""

    def __init__(self, buffer: GcMoeBuffer) -> None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("buffer: role4's token-block tables are built on the first call with a shared expert, "
                               "which cannot happen while a stream is capturing: make one eager call first")
        cap, dev = buffer.shape.capacity, buffer.storage.device
        self.blocks = {}
        for bm in BLOCK_M_CANDIDATES:
            start = torch.arange(0, cap, bm, dtype=torch.int32, device=dev)
            self.blocks[bm] = torch.stack([torch.zeros_like(start), (cap - start).clamp(max=bm), start], 1).contiguous()
        self.counts = torch.arange(-(-cap // BLOCK_M_CANDIDATES[0]) + 1, dtype=torch.int32, device=dev)
        self.ones = torch.ones(cap, dtype=torch.float32, device=dev)

    def count(self, num_tokens: int, bm: int) -> torch.Tensor:
        """The one-element view holding ``ceil(num_tokens / bm)``."""
        n = -(-num_tokens // bm)
        return self.counts[n:n + 1]


def _args(buffer: GcMoeBuffer, weights: Role4Weights, tables: Role4Tables, variant: Role4Variant, count: torch.Tensor,
          clamp: float, alpha: float, timeout_ns: int) -> KernelArgs:
    s = buffer.shape
    if variant.epi == EPI_W1:
        tm_w, w_sf, n_w, k = weights.tm_w1, weights.w1_sf, 2 * s.intermediate, s.hidden
        tm_x, x_sf, out = encode_2d(buffer.x.view(torch.uint8), variant.bm), buffer.x_sf, buffer.shared_l2_acts
    else:
        tm_w, w_sf, n_w, k = weights.tm_w2, weights.w2_sf, s.hidden, s.intermediate
        tm_x = encode_2d(buffer.shared_l2_acts.view(torch.uint8), variant.bm)
        x_sf, out = buffer.shared_l2_acts_sf, buffer.combine[s.topk]
    return KernelArgs(tm_w, tm_x, ptr(w_sf), ptr(x_sf), ptr(tables.blocks[variant.bm]), ptr(count), ptr(tables.ones),
                      ptr(out), ptr(buffer.shared_l2_acts_sf), ctypes.c_int32(n_w), ctypes.c_int32(k),
                      ctypes.c_int32(s.capacity), ctypes.c_float(clamp), ctypes.c_float(alpha),
                      ptr(buffer.status[StatusRecord.ROLE4]), ctypes.c_uint64(timeout_ns))


def _check_buffer(buffer: GcMoeBuffer, weights: Role4Weights) -> None:
    s = buffer.shape
    if not s.num_shared_experts:
        raise ValueError("buffer: created with num_shared_experts=0; role4 needs its shared_l2_acts regions")
    if (weights.hidden, weights.inter) != (s.hidden, s.intermediate):
        raise ValueError(f"shared_l1_weights/shared_l2_weights: H={weights.hidden}, I={weights.inter} do not match "
                         f"the buffer's H={s.hidden}, I={s.intermediate}")
    if s.capacity % 4:
        raise NotImplementedError(f"buffer: capacity={s.capacity}: role4 needs a capacity that is a multiple of 4 (its "
                                  "W2 copies a K step's scales from shared_l2_acts_sf [I/128, capacity] with 16-byte "
                                  "aligned bulk copies)")


def role4_nodes(buffer: GcMoeBuffer, weights: Role4Weights, tables: Role4Tables, num_tokens: int, *,
                deps: Sequence[str] = (), activation_clamp: float | None = 10.0, activation_alpha: float = 1.0,
                fast_math: bool = True, timeout_ms: float | None = None,
                task_scales: bool = True, max_grid: int | None = None) -> list[KernelNode]:
    """Role4's two nodes for ``num_tokens`` local tokens: ``role4`` (W1, after ``deps``) and ``role4_w2`` (after it),
    on the compute green context when the buffer is partitioned; each a persistent grid of at most one CTA per
    compute SM (a standalone grid walks its tasks with the grid's stride, so any grid size is correct).
    ``task_scales=False`` builds W1 with the per-stage token-scale copy instead (:func:`role4_variants`; the
    operator never does, the sequence benchmark times both). ``max_grid``: at most that many CTAs (the
    :func:`reserve_sms` of a role4 beside role2)."""
    _check_buffer(buffer, weights)
    s = buffer.shape
    role = Role.COMPUTE if buffer.partition == "on" else None
    sms = buffer.current_compute_sms()
    clamp = math.inf if activation_clamp is None else float(activation_clamp)
    timeout_ns = spin_timeout_ns(timeout_ms)
    nodes = []
    variants = role4_variants(s, num_tokens, sms, fast_math=fast_math, k32=weights.k32, task_scales=task_scales)
    for name, variant, n_w, after in ((NODE_NAMES[0], variants[0], 2 * s.intermediate, tuple(deps)),
                                      (NODE_NAMES[1], variants[1], s.hidden, (NODE_NAMES[0],))):
        grid = max(1, min(_tasks(num_tokens, variant.bm, n_w, variant.epi), sms, max_grid or sms))
        count = tables.count(num_tokens, variant.bm)
        args = _args(buffer, weights, tables, variant, count, clamp, activation_alpha, timeout_ns)
        warm = _args(buffer, weights, tables, variant, tables.count(0, variant.bm), clamp, activation_alpha,
                     timeout_ns)
        nodes.append(KernelNode.make(name, _kernel(variant), role, grid, variant.threads, args,
                                     shared_bytes=variant.smem, deps=after, warmup_args=warm))
    return nodes


def raise_for_role4_status(buffer: GcMoeBuffer, what: str = "role4 fused shared expert") -> None:
    """Raises :class:`~gc_moe_compat.runtime.status.DeviceTimeoutError` / ``DeviceCheckError`` if role4 recorded an
    error (nothing is recorded without a shared expert); call once the graph has finished. The record is cleared
    first (the next launch runs)."""
    record = buffer.status[StatusRecord.ROLE4]
    saved = record.clone()
    if int(saved[:4].view(torch.int32)[0]):
        record.zero_()
    raise_for_status(saved, what, Role4Site.names())
