"""Two ranks (nvidia-h200-x2): peer-table signals in both directions and the missing-peer timeout."""

from __future__ import annotations

import pytest
from two_rank import run_two_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]


def test_peer_signal_both_directions_and_missing_peer_timeout() -> None:
    run_two_ranks("runtime_two_rank_worker.py", 240)
