"""The operator on two ranks (nvidia-h200-x2), for both compute paths (FP8xFP8, FP8xFP4): every rank's y against the
2-rank reference, partition on and off, and the missing-peer error followed by a working fresh buffer
(operator_two_rank_worker.py, one torchrun per path; ``-k fp8xfp4`` runs the FP4 path alone)."""

from __future__ import annotations

import pytest
from two_rank import run_two_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]


@pytest.mark.parametrize("mma_type", ["fp8xfp8", "fp8xfp4"])
def test_operator_two_ranks_every_rank_matches_reference_and_missing_peer_fails_cleanly(
        mma_type: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GC_MOE_TEST_MMA_TYPE", mma_type)  # the workers inherit this process's environment
    run_two_ranks("operator_two_rank_worker.py", 590, "rank 1 absent -> DeviceTimeoutError")
