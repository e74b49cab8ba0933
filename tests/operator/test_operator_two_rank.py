"""The operator on P ranks (two GPUs, or P ranks sharing one: tests/kit/two_rank.py), for both compute paths
(FP8xFP8, FP8xFP4): every rank's y against the P-rank reference, partition on and off, and the missing-peer error
followed by a working fresh buffer (operator_two_rank_worker.py, one torchrun per path; ``-k fp8xfp4`` runs the FP4
path alone)."""

from __future__ import annotations

import pytest
from two_rank import MULTI_RANKS, run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]


@pytest.mark.parametrize("mma_type", ["fp8xfp8", "fp8xfp4"])
def test_operator_two_ranks_every_rank_matches_reference_and_missing_peer_fails_cleanly(
        mma_type: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GC_MOE_TEST_MMA_TYPE", mma_type)  # the workers inherit this process's environment
    run_ranks("operator_two_rank_worker.py", MULTI_RANKS, 590, "rank 1 absent -> DeviceTimeoutError")
