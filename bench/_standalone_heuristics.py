"""The standalone SM90 expert GEMM's variant choice (the harness :mod:`_standalone_gemm`, its tests and benchmarks):
which compiled variant runs a point, from the expected tokens per expert.

The block size, pipelining and stage rules are the operator's (:mod:`gc_moe_compat.operator.heuristics`); what only
the standalone kernels have is chosen here:

* W2 task sizes: 128-row tasks, or 256-row ones for FP8xFP4 from BM = 16 (:func:`w2_slabs`) and for cluster pairs
  where 256 divides H.
* Past 64 expected rows (BM capped at 64, so most experts are two or more ring blocks), the kernels run in
  clusters of two CTAs that take the same weight tile against two blocks of one expert and stream it once, each
  loading half by TMA multicast (:func:`cluster_pairs`; glm52 at T=256 otherwise moved 1.4x the W1 weight bytes
  from DRAM, bench/README.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gc_moe_compat.compute_paths import compute_path
from gc_moe_compat.operator.heuristics import (
    BLOCK_M_CANDIDATES,
    CONSUMER_WARPGROUPS,
    W1_SLABS,
    W2_SLABS,
    most_stages,
    pipelined,
    select_block_m,
    smem_bytes,
    tile_rows,
)


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


def max_stages(bm: int, slabs: int, mma_type: str = "fp8xfp8") -> int:
    """The most stages of the standalone layout (:func:`~gc_moe_compat.operator.heuristics.smem_bytes`) that fit
    one CTA."""
    return most_stages(lambda stages: smem_bytes(bm, slabs, stages, mma_type))


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
    ``block_m`` replaces the operator's block-size rule (benchmark probes of the rule itself); ``hidden``: the
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
    pipe = pipelined(blocks * tiles_per_block, num_sms, block_m=bm)
    cluster = cluster_pairs(expected_rows, bm, pipe, mma_type)
    # Cluster pairs stream each W2 tile once for two blocks; with 128-row tasks that W2 was no faster on an H200 (its
    # steps, not its bytes, bound it), so it takes 256-row tasks like W1 (bench/README.md, session 6).
    slabs = 2 if cluster and hidden is not None and hidden % tile_rows(2) == 0 else w2_slabs(bm, mma_type)
    return KernelConfig(bm, pipe, max_stages(bm, W1_SLABS, mma_type), max_stages(bm, slabs, mma_type), slabs, cluster)
