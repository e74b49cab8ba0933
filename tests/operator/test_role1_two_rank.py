"""Role1 on two ranks (nvidia-h200-x2): exact rings pulled from both ranks, and the missing-peer tag-1 timeout."""

from __future__ import annotations

import pytest
from two_rank import run_two_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]


def test_role1_two_ranks_exact_rings_and_missing_peer_timeout() -> None:
    run_two_ranks("role1_two_rank_worker.py", 280, "rank 1 absent -> DeviceTimeoutError")
