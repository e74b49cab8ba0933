"""Block size and kernel variant of the SM90 expert GEMMs, chosen on the host from the expected tokens per expert.

Paper §4.4: ``BM in {8, 16, 32, 64}`` (the ring block's token rows, the WGMMA N extent) and a 384-thread pipelined
variant (a producer warpgroup that runs ahead across tasks) or a 256-thread non-pipelined one (loads issued by a
consumer thread, only within its own task). Why these rules:

* BM covers the expected rows of one expert plus one standard deviation of a balanced multinomial routing
  (``m + sqrt(m)``), so most experts fill one block; a larger BM would only stream padded token rows, a smaller one
  would re-stream the expert's weights once per extra block (each block reads every weight tile).
* Pipelining across tasks pays only when a CTA gets more than one task: with at most one task per SM (small T, few
  active experts) the producer warpgroup has nothing to run ahead into and the 256-thread variant is used.
* Past 64 expected rows (BM capped at 64, so most experts are two or more ring blocks), the kernels run in
  clusters of two CTAs that take the same weight tile against two blocks of one expert and stream it once, each
  loading half by TMA multicast (:func:`cluster_pairs`; glm52 at T=256 otherwise moved 1.4x the W1 weight bytes
  from DRAM, bench/README.md).
* Stages: as many as the shared memory holds (at most :data:`MAX_STAGES`); a decode GEMM streams weights, so
  bytes in flight per SM are what hide the DRAM latency.

The shared-memory formulas mirror ``kSmemBytes`` in ``kernels/sm90/role2_gemm_fp8xfp8.cu`` (``"fp8xfp8"``) and
``kernels/sm90/role2_gemm_fp8xfp4.cu`` (``"fp8xfp4"``: a 64-row slab of one K128 step is a 4352-byte unit of FP4
codes and relative exponents, half the FP8 tile); each kernel checks its dynamic shared memory against it and
reports a mismatch instead of running.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from gc_moe_compat.compute_paths import compute_path

BLOCK_M_CANDIDATES = (8, 16, 32, 64)
MAX_STAGES = 8
SMEM_LIMIT = 232448  # bytes of dynamic shared memory one H200 CTA may opt into
BK = 128
CONSUMER_WARPGROUPS = 2
W1_SLABS = 2  # 64-row slabs per consumer warpgroup in W1: 256 rows = one 128-column requant group per task
W2_SLABS = 1  # W2 tiles of 128 rows: twice the tasks, for balance at small T (FP8xFP4 from BM = 16: w2_slabs)
FP4_UNIT_BYTES = 64 * BK // 2 + 64 * BK // 32  # one slab and K128 step: FP4 codes + one d byte per K32 group


@dataclass(frozen=True)
class KernelConfig:
    """One compiled variant: block rows ``bm``, stages per GEMM, whether the producer warpgroup exists, the 64-row
    slabs per consumer warpgroup of a W2 task (:func:`w2_slabs`) and whether CTAs run in cluster pairs
    (:func:`cluster_pairs`)."""

    bm: int
    pipelined: bool
    stages_w1: int
    stages_w2: int
    w2_slabs: int = W2_SLABS
    cluster: bool = False

    @property
    def threads(self) -> int:
        """Threads per CTA: 384 pipelined (producer + 2 consumer warpgroups), 256 otherwise."""
        return 128 * (CONSUMER_WARPGROUPS + int(self.pipelined))


def tile_rows(slabs: int) -> int:
    """Weight rows of one task: 64 per slab per consumer warpgroup."""
    return CONSUMER_WARPGROUPS * slabs * 64


def smem_bytes(bm: int, slabs: int, stages: int, mma_type: str = "fp8xfp8") -> int:
    """Dynamic shared memory of a variant (``kSmemBytes`` of the ``mma_type`` kernel)."""
    fp4 = compute_path(mma_type).fp4
    weights = CONSUMER_WARPGROUPS * slabs * FP4_UNIT_BYTES if fp4 else tile_rows(slabs) * BK
    reduction = CONSUMER_WARPGROUPS * 4 * bm * 4  # the W1 epilogue's amax per (consumer warp, column)
    stage = weights + bm * BK + bm * 4
    return stages * stage + reduction + 2 * stages * 8 + 1024


def most_stages(smem_of: Callable[[int], int]) -> int:
    """The most pipeline stages (2 to :data:`MAX_STAGES`) whose dynamic shared memory ``smem_of(stages)`` fits one
    CTA (:data:`SMEM_LIMIT`; 2 if none does, which the kernel then reports): the stage rule of every variant, the
    standalone GEMM's, role2's and role4's, each with its own shared-memory layout."""
    stages = MAX_STAGES
    while stages > 2 and smem_of(stages) > SMEM_LIMIT:
        stages -= 1
    return stages


def pipelined(tasks: int, num_sms: int) -> bool:
    """Whether a persistent grid of at most ``num_sms`` CTAs runs the producer-warpgroup variant for ``tasks``
    expected tasks: only when some CTA gets more than one (module docstring), in every GEMM of the operator and in
    the standalone one."""
    return tasks > num_sms


def max_stages(bm: int, slabs: int, mma_type: str = "fp8xfp8") -> int:
    """The most stages of the standalone layout (:func:`smem_bytes`) that fit one CTA."""
    return most_stages(lambda stages: smem_bytes(bm, slabs, stages, mma_type))


def select_block_m(expected_rows: float) -> int:
    """Smallest candidate BM covering ``m + sqrt(m)`` expected rows of an expert (the largest candidate beyond)."""
    if expected_rows < 0 or math.isnan(expected_rows):
        raise ValueError(f"expected_rows: must be a non-negative number of rows per expert, got {expected_rows}")
    need = expected_rows + math.sqrt(expected_rows)
    return next((bm for bm in BLOCK_M_CANDIDATES if bm >= need), BLOCK_M_CANDIDATES[-1])


def expected_rows_per_expert(num_tokens: int, num_ranks: int, topk: int, num_experts: int,
                             global_num_tokens: int | None = None) -> float:
    """Rows one expert receives in expectation under balanced routing: ``T_total * k / E``.

    ``T_total`` is ``global_num_tokens`` when given (the tokens every EP rank sends this call, DeepGEMM's meaning),
    else ``num_tokens * num_ranks`` (every rank sends ``num_tokens``).
    """
    total = num_tokens * num_ranks if global_num_tokens is None else global_num_tokens
    return total * topk / num_experts


def block_m_for_call(num_tokens: int, num_ranks: int, topk: int, num_experts: int,
                     global_num_tokens: int | None = None) -> int:
    """The block-size rule of one call: :func:`select_block_m` of :func:`expected_rows_per_expert`. The operator,
    the ``deep_gemm`` facade's ``get_block_m_for_mega_moe`` and the benchmarks all ask this one function."""
    return select_block_m(expected_rows_per_expert(num_tokens, num_ranks, topk, num_experts, global_num_tokens))


def w2_slabs(bm: int, mma_type: str) -> int:
    """Slabs per consumer warpgroup of a W2 task: 2 (256-row tasks) for FP8xFP4 from BM = 16, else :data:`W2_SLABS`
    (128-row tasks). FP8xFP4 weights always have H a multiple of 256 (the operator shape rule of
    :mod:`gc_moe_compat.config` that their transform enforces), so 256-row tasks tile H.

    FP8xFP4 decodes its weights in the MMA warps: with one slab per warpgroup the only work to overlap a slab's MMAs
    with is the next stage's decode, and on an H200 its W2 cost 13-18 % more per weight byte than its two-slab W1
    (bench/README.md, session 4). At BM = 8 the decode and MMAs run in sequence anyway and the smaller tasks
    keep the SMs busy at small T.
    """
    return 2 if compute_path(mma_type).fp4 and bm >= 16 else W2_SLABS


def cluster_pairs(expected_rows: float, bm: int, pipelined: bool, mma_type: str) -> bool:
    """Whether the GEMMs run in cluster pairs sharing each weight tile between two ring blocks of one expert:
    pipelined, at the largest BM where ``m + sqrt(m)`` expected rows exceed it (most experts then have two or more
    blocks; the variants that exist and are tested), for both weight formats."""
    compute_path(mma_type)
    return pipelined and bm == BLOCK_M_CANDIDATES[-1] and expected_rows + math.sqrt(expected_rows) > bm


def select_config(
    expected_rows: float, active_experts: int, tiles_per_block: int, num_sms: int, mma_type: str = "fp8xfp8",
    *, block_m: int | None = None, hidden: int | None = None,
) -> KernelConfig:
    """The variant for ``expected_rows`` tokens per expert over ``active_experts`` experts.

    ``tiles_per_block``: W1 tasks per ring block (``2I / 256``); ``num_sms``: SMs the GEMM runs on; ``mma_type``
    picks the kernel whose shared memory bounds the stages (the BM / variant rules are the same for both);
    ``block_m`` replaces :func:`select_block_m`'s choice (benchmark probes of the rule itself); ``hidden``: the
    layer's H, which lets cluster pairs run W2 as 256-row tasks where 256 divides it (unknown: 128-row tasks).
    """
    compute_path(mma_type)
    if block_m is not None and block_m not in BLOCK_M_CANDIDATES:
        raise ValueError(f"block_m: one of {BLOCK_M_CANDIDATES} or None, got {block_m!r}")
    if active_experts < 0 or tiles_per_block < 1 or num_sms < 1:
        raise ValueError(
            f"active_experts >= 0, tiles_per_block >= 1, num_sms >= 1 required, got "
            f"{active_experts}, {tiles_per_block}, {num_sms}"
        )
    bm = block_m or select_block_m(expected_rows)
    blocks = active_experts * max(1, math.ceil(expected_rows / bm))
    pipe = pipelined(blocks * tiles_per_block, num_sms)
    cluster = cluster_pairs(expected_rows, bm, pipe, mma_type)
    # Cluster pairs stream each W2 tile once for two blocks; with 128-row tasks that W2 was no faster on an H200 (its
    # steps, not its bytes, bound it), so it takes 256-row tasks like W1 (bench/README.md, session 6).
    slabs = 2 if cluster and hidden is not None and hidden % tile_rows(2) == 0 else w2_slabs(bm, mma_type)
    return KernelConfig(bm, pipe, max_stages(bm, W1_SLABS, mma_type), max_stages(bm, slabs, mma_type), slabs, cluster)
