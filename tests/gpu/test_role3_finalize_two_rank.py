"""Role3 on two ranks (nvidia-h200-x2): partials scattered into the peer's combine buffer through the peer table,
readiness across GPUs, exact outputs on both ranks, and a clean timeout when the peer never arrives."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

WORKER = Path(__file__).with_name("role3_two_rank_worker.py")
HARD_TIMEOUT_S = 300


def test_role3_two_ranks_exact_combine_and_missing_peer_timeout():
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HARD_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"role3 two-rank worker hung past {HARD_TIMEOUT_S} s:\n{err.stdout}\n{err.stderr}")
    output = proc.stdout + proc.stderr
    print(output)
    assert proc.returncode == 0, output
    assert "PASS rank 0" in output and "PASS rank 1" in output
