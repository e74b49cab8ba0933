"""Block size, pipelining and stages of the SM90 expert GEMMs, chosen on the host from the expected tokens per expert.

Paper §4.4: ``BM in {8, 16, 32, 64}`` (the ring block's token rows, the WGMMA N extent; FP8xFP8's role2 adds 96)
and a 384-thread pipelined variant (a producer warpgroup that runs ahead across tasks) or a 256-thread non-pipelined
one (loads issued by a consumer thread, only within its own task). Why these rules:

* BM covers the expected rows of one expert plus one standard deviation of a balanced multinomial routing
  (``m + sqrt(m)``), so most experts fill one block; a larger BM would only stream padded token rows, a smaller one
  would re-stream the expert's weights once per extra block (each block reads every weight tile, and a task's K loop
  costs about as much whatever its rows). Past 64 the FP8xFP8 role2 kernel has one wider block,
  :data:`WIDE_BLOCK_M` (:func:`block_m_candidates`: a compute path's ``max_block_m``), pipelined only
  (:func:`producer_only`): on an H200 one block per expert at 64 expected rows took the layer from 620 to under
  560 us on a DeepSeek-V3 EP8 share and from 517 to under 483 us on GLM-5.2, against BM = 64 (bench/README.md).
* Pipelining across tasks pays only when a CTA gets more than one task: with at most one task per SM (small T, few
  active experts) the producer warpgroup has nothing to run ahead into and the 256-thread variant is used.
* Stages: as many as the shared memory holds (at most :data:`MAX_STAGES`); a decode GEMM streams weights, so
  bytes in flight per SM are what hide the DRAM latency.
* The partition per call (``GC_MOE_PARTITION=auto``, :func:`sequential_max_tokens`): on one rank, a call with fewer
  than :data:`SEQUENTIAL_BELOW_ROWS` expected rows per expert runs the roles in sequence on the whole device, where
  role2 follows role1 through a programmatic edge (it starts beside role1 and takes each ring block as role1 fills
  it, as when partitioned) and streams the weights on all SMs instead of the compute partition's (132 against 128).
  On the headline A/B runs of three workloads with those edges (one H100, bench/README.md, twenty-eighth session)
  the sequential mode was as fast or faster up to 32 rows per expert on glm52 and DeepSeek-V3 (0.989-0.995 of the
  partition's latency at 4-32 rows) and up to 16 on dsv41-flash, the partition faster at 32 rows on dsv41-flash and
  at 64 on all three (1.1-1.9 %); below 32 rows the threshold picks the faster mode at 25 of 27 points (the two
  misses, 32 rows on glm52 and DeepSeek-V3, by 0.6-0.8 %). With more ranks the dispatch crosses GPUs and the rule is
  unmeasured: the partition stays on.

The shared-memory formulas mirror ``kSmemBytes`` in ``kernels/sm90/role2_gemm_fp8xfp8.cu`` (``"fp8xfp8"``) and
``kernels/sm90/role2_gemm_fp8xfp4.cu`` (``"fp8xfp4"``: a 64-row slab of one K128 step is a 4352-byte unit of FP4
codes and relative exponents, half the FP8 tile); each kernel checks its dynamic shared memory against it and
reports a mismatch instead of running.

These are the rules the operator's GEMMs (role2, role4) read; the standalone GEMM's own variant choice (W2 task
sizes, cluster pairs: ``select_config``) lives beside its harness, bench/_standalone_heuristics.py.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

from gc_moe_compat.compute_paths import MMA_TYPES, compute_path

BLOCK_M_CANDIDATES = (8, 16, 32, 64)
"""Token block sizes every grouped-GEMM variant compiles (standalone, role2 of both paths, role4)."""
WIDE_BLOCK_M = 96
"""The wider block role2 runs where its compute path allows (``ComputePath.max_block_m``): up to ~86 expected rows
per expert in one block (T = 256 on a DeepSeek-V3 or GLM-5.2 EP8 rank share: 64). 128 spills in the W1 epilogue."""
MAX_STAGES = 8
SMEM_LIMIT = 232448  # bytes of dynamic shared memory one H200 CTA may opt into
BK = 128
CONSUMER_WARPGROUPS = 2
W1_SLABS = 2  # 64-row slabs per consumer warpgroup in W1: 256 rows = one 128-column requant group per task
W2_SLABS = 1  # W2 tiles of 128 rows: twice the tasks, for balance at small T (role4's W2)
FP4_UNIT_BYTES = 64 * BK // 2 + 64 * BK // 32  # one slab and K128 step: FP4 codes + one d byte per K32 group


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


def producer_only(block_m: int) -> bool:
    """Whether blocks of ``block_m`` rows run only in the producer-warpgroup variant: the wide block
    (:data:`WIDE_BLOCK_M`), whose pipelined variant is the one measured and tested on an H200 (the 256-thread one
    compiles, but has never run)."""
    return block_m > BLOCK_M_CANDIDATES[-1]


def pipelined(tasks: int, num_sms: int, *, block_m: int) -> bool:
    """Whether a persistent grid of at most ``num_sms`` CTAs runs the producer-warpgroup variant for ``tasks``
    expected tasks of ``block_m``-row blocks: only when some CTA gets more than one (module docstring), in every GEMM
    of the operator and in the standalone one, or where the block exists only so (:func:`producer_only`)."""
    return tasks > num_sms or producer_only(block_m)


def block_m_candidates(mma_type: str) -> tuple[int, ...]:
    """The token block sizes role2 of ``mma_type``'s kernel compiles: :data:`BLOCK_M_CANDIDATES`, and
    :data:`WIDE_BLOCK_M` where the path's ``max_block_m`` reaches it."""
    wide = (WIDE_BLOCK_M,) if compute_path(mma_type).max_block_m >= WIDE_BLOCK_M else ()
    return BLOCK_M_CANDIDATES + wide


@functools.cache
def workspace_block_ms() -> tuple[int, ...]:
    """Every block role2 of any compute path runs: a workspace's ring and pool are sized for all of them, so that one
    layout serves both paths (SGLang makes its Hopper buffer with ``mma_type='fp8xfp4'`` and calls
    ``fp8_mega_moe`` on it)."""
    return tuple(sorted({bm for mma_type in MMA_TYPES for bm in block_m_candidates(mma_type)}))


def select_block_m(expected_rows: float, candidates: tuple[int, ...] = BLOCK_M_CANDIDATES) -> int:
    """Smallest of ``candidates`` (ascending) covering ``m + sqrt(m)`` expected rows of an expert (the largest
    beyond)."""
    if expected_rows < 0 or math.isnan(expected_rows):
        raise ValueError(f"expected_rows: must be a non-negative number of rows per expert, got {expected_rows}")
    need = expected_rows + math.sqrt(expected_rows)
    return next((bm for bm in candidates if bm >= need), candidates[-1])


def expected_rows_per_expert(num_tokens: int, num_ranks: int, topk: int, num_experts: int,
                             global_num_tokens: int | None = None) -> float:
    """Rows one expert receives in expectation under balanced routing: ``T_total * k / E``.

    ``T_total`` is ``global_num_tokens`` when given (the tokens every EP rank sends this call, DeepGEMM's meaning),
    else ``num_tokens * num_ranks`` (every rank sends ``num_tokens``).
    """
    total = num_tokens * num_ranks if global_num_tokens is None else global_num_tokens
    return total * topk / num_experts


SEQUENTIAL_BELOW_ROWS = 32.0
"""Expected rows per expert below which a one-rank call runs with the partition off (module docstring)."""


def sequential_max_tokens(num_ranks: int, topk: int, num_experts: int, capacity: int) -> int:
    """The most tokens a call may have and still run with the partition off under ``GC_MOE_PARTITION=auto``: the
    largest ``T <= capacity`` with fewer than :data:`SEQUENTIAL_BELOW_ROWS` expected rows per expert on one rank,
    0 with more ranks (module docstring)."""
    if num_ranks != 1:
        return 0
    fits = [t for t in range(1, capacity + 1)
            if expected_rows_per_expert(t, 1, topk, num_experts) < SEQUENTIAL_BELOW_ROWS]
    return max(fits, default=0)


def block_m_for_call(num_tokens: int, num_ranks: int, topk: int, num_experts: int,
                     global_num_tokens: int | None = None, *, mma_type: str) -> int:
    """The block-size rule of one call: :func:`select_block_m` of :func:`expected_rows_per_expert` over
    ``mma_type``'s role2 blocks (:func:`block_m_candidates`). The operator, the ``deep_gemm`` facade's
    ``get_block_m_for_mega_moe`` and the benchmarks all ask this one function."""
    return select_block_m(expected_rows_per_expert(num_tokens, num_ranks, topk, num_experts, global_num_tokens),
                          block_m_candidates(mma_type))
