"""The FP8xFP8 operator on two ranks (nvidia-h200-x2): every rank's y against the 2-rank reference, partition on
and off, and the missing-peer error followed by a working fresh buffer (operator_two_rank_worker.py)."""

from __future__ import annotations

import pytest
from two_rank import run_two_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]


def test_operator_two_ranks_every_rank_matches_reference_and_missing_peer_fails_cleanly() -> None:
    run_two_ranks("operator_two_rank_worker.py", 590, "rank 1 absent -> DeviceTimeoutError")
