"""Role3 on two ranks (nvidia-h200-x2): partials scattered into the peer's combine buffer through the peer table,
readiness across GPUs, exact outputs on both ranks, and a clean timeout when the peer never arrives."""

from __future__ import annotations

import pytest
from two_rank import run_two_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]


def test_role3_two_ranks_exact_combine_and_missing_peer_timeout() -> None:
    run_two_ranks("role3_two_rank_worker.py", 300)
