"""The two-rank protocol of the ``multigpu`` tests: the pytest side starts a worker script under torchrun on both
GPUs and checks it; the worker side joins the NCCL group and reports ``PASS rank <r>``.

Workers are scripts (torchrun runs them with this folder on ``sys.path``), so they import :func:`join` and
:func:`report_pass` from here; the tests call :func:`run_two_ranks`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""NVLink multicast stays off on the lent machines (KINDS.md)."""


def run_ranks(worker: str, nproc: int, timeout_s: float, *expected: str, env: Mapping[str, str] | None = None,
              args: Sequence[str] = ()) -> str:
    """Runs ``worker`` (a file next to this one, with ``args``) on ``nproc`` ranks under torchrun, ``env`` added to
    this process's environment; fails the test if it hangs past ``timeout_s``, exits non-zero, misses a
    ``PASS rank`` line or any of the ``expected`` substrings. Returns the combined output."""
    script = Path(__file__).with_name(worker)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script),
           *args]
    try:
        proc = subprocess.run(cmd, env={**os.environ, **NO_MULTICAST, **(env or {})}, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{worker} hung past {timeout_s} s:\n{err.stdout}\n{err.stderr}")
    output = proc.stdout + proc.stderr
    print(output)
    assert proc.returncode == 0, output
    for line in (*(f"PASS rank {r}" for r in range(nproc)), *expected):
        assert line in output, f"{worker}: no {line!r} in its output:\n{output}"
    return output


def run_two_ranks(worker: str, timeout_s: float, *expected: str) -> str:
    """:func:`run_ranks` on two ranks."""
    return run_ranks(worker, 2, timeout_s, *expected)


def join() -> int:
    """Worker side: bind this process to its local GPU and join the NCCL group; returns the rank."""
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    return dist.get_rank()


def report_pass(rank: int) -> None:
    """Worker side: the line :func:`run_two_ranks` waits for, then leave the group."""
    print(f"PASS rank {rank}", flush=True)
    dist.destroy_process_group()
