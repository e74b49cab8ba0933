"""The operator's shared heuristics (:mod:`gc_moe_compat.operator.heuristics`): the stage rule and the pipelining
rule that the standalone GEMM, role2 and role4 all read, each with its own shared-memory layout."""

from __future__ import annotations

from gc_moe_compat.operator.heuristics import (
    MAX_STAGES,
    SEQUENTIAL_BELOW_ROWS,
    SMEM_LIMIT,
    WIDE_BLOCK_M,
    most_stages,
    pipelined,
    producer_only,
    sequential_max_tokens,
)
from gc_moe_compat.operator.sm90 import role2_gemm, role4_shared


def test_most_stages_is_the_largest_count_that_fits() -> None:
    assert most_stages(lambda s: 0) == MAX_STAGES
    assert most_stages(lambda s: s * SMEM_LIMIT // 5) == 5
    assert most_stages(lambda s: SMEM_LIMIT + s) == 2  # nothing fits: the kernel reports its shortfall


def test_pipelined_iff_some_cta_gets_a_second_task_or_the_block_needs_it() -> None:
    assert not pipelined(132, 132, block_m=64) and pipelined(133, 132, block_m=64) and not pipelined(0, 1, block_m=8)
    assert pipelined(1, 132, block_m=WIDE_BLOCK_M) and producer_only(WIDE_BLOCK_M) and not producer_only(64)


def test_role2_and_role4_stages_follow_the_rule() -> None:
    for bm in (8, 64):
        v2 = role2_gemm.Role2Variant(bm, True, mma_type="fp8xfp4")
        assert v2.defines["GC_STAGES"] == most_stages(lambda s, b=bm: role2_gemm.operator_smem_bytes(b, s, "fp8xfp4"))
        v4 = role4_shared.Role4Variant(bm, 1, True, task_scales=56)
        assert v4.stages == most_stages(v4._smem) and v4.smem <= SMEM_LIMIT


def test_sequential_max_tokens_is_below_32_expected_rows_on_one_rank() -> None:
    assert SEQUENTIAL_BELOW_ROWS == 32
    assert sequential_max_tokens(1, 8, 32, 256) == 127  # glm52 / DeepSeek-V3 share: T * 8 / 32 < 32
    assert sequential_max_tokens(1, 6, 48, 256) == 255  # dsv41-flash share: T * 6 / 48 < 32
    assert sequential_max_tokens(1, 8, 32, 10) == 10  # capped by the buffer's capacity
    assert sequential_max_tokens(1, 8, 1, 256) == 3  # 8 T < 32: T <= 3
    assert sequential_max_tokens(2, 8, 64, 256) == 0  # more ranks: unmeasured, the partition stays on
