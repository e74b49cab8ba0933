"""Role1 on two ranks (two GPUs): exact rings pulled from both ranks, and the missing-peer tag-1 timeout."""

from __future__ import annotations

import pytest
from two_rank import run_two_ranks, shared_gpu_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]


@pytest.mark.skipif(bool(shared_gpu_ranks()), reason=(
    "role1 beside its stand-in consumer on the two green partitions at once, with a ring smaller than the pool: the "
    "partitioned mode, which ranks sharing a GPU do not run (green contexts do not confine under MPS; the operator "
    "runs there with the partition off, covered by test_operator_two_rank); on one H200 under MPS rank 0's tag-1 "
    "barrier timed out waiting for rank 1's role1"))
def test_role1_two_ranks_exact_rings_and_missing_peer_timeout() -> None:
    run_two_ranks("role1_two_rank_worker.py", 280, "rank 1 absent -> DeviceTimeoutError")
