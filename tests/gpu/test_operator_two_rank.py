"""The FP8xFP8 operator on two ranks (nvidia-h200-x2): every rank's y against the 2-rank reference, partition on
and off, and the missing-peer error followed by a working fresh buffer (operator_two_rank_worker.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

WORKER = Path(__file__).with_name("operator_two_rank_worker.py")
HARD_TIMEOUT_S = 590


def test_operator_two_ranks_every_rank_matches_reference_and_missing_peer_fails_cleanly():
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HARD_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"two-rank operator worker hung past {HARD_TIMEOUT_S} s:\n{err.stdout}\n{err.stderr}")
    output = proc.stdout + proc.stderr
    print(output)
    assert proc.returncode == 0, output
    assert "PASS rank 0" in output and "PASS rank 1" in output
    assert "rank 1 absent -> DeviceTimeoutError" in output
