"""The multi-rank protocol of the ``multigpu`` tests: the pytest side starts a worker script under torchrun and
checks it; the worker side joins the group and reports ``PASS rank <r>``.

Ranks run one per GPU, or P on one GPU when :data:`SHARED_GPU_ENV` is P (``scripts/device_check.sh --shared-gpu P``
starts CUDA MPS for it): then the tests of :data:`MULTI_RANKS` ranks run P processes on the GPU, the two-rank
workers two, and the group is gloo (:func:`gc_moe_compat.runtime.colocation.init_rank_group`).

The tests call :func:`run_ranks` / :func:`run_two_ranks`. Workers are scripts (torchrun runs them with this folder on
``sys.path``) that take their scaffolding from here, so that each holds only its own test logic:

* :func:`join` before the test, :func:`report_pass` after it (:func:`finish`: behind a last barrier);
* :func:`run_suite`: the whole run of a worker of several suites chosen by ``--suite`` (:func:`suite_parser` for a
  worker with more options);
* :func:`raises`: a call that must fail, such as the missing-peer ``DeviceTimeoutError`` after
  :data:`MISSING_PEER_TIMEOUT_MS` (:func:`spin_timeout` where the call reads its timeout from the environment).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch.distributed as dist

from gc_moe_compat.runtime.colocation import init_rank_group

SHARED_GPU_ENV = "GC_MOE_TEST_SHARED_GPU"
"""P ranks share one GPU in the multi-rank tests (unset: one rank per GPU)."""


def shared_gpu_ranks() -> int:
    """:data:`SHARED_GPU_ENV` as a rank count (0 when unset)."""
    raw = os.environ.get(SHARED_GPU_ENV, "").strip()
    if not raw:
        return 0
    if not raw.isdigit() or int(raw) < 2:
        raise ValueError(f"{SHARED_GPU_ENV} must be a rank count >= 2, got {raw!r}")
    return int(raw)


MULTI_RANKS = shared_gpu_ranks() or 2
"""The rank count of the tests that run at any P (the operator, both DeepEP modes, SGLang's dispatcher)."""

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""NVLink multicast stays off on the machines the project is tested on (docs/platform_notes.md)."""
MISSING_PEER_TIMEOUT_MS = 300
"""The device spin timeout of a worker's missing-peer case: short, so that the case ends quickly."""
TIMEOUT_CEILING_S = 5
"""A device timeout must fire within this long of the start of the call that waits."""


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
    """Worker side: bind this process to its GPU and join the group (NCCL, or gloo when ranks share a GPU);
    returns the rank."""
    init_rank_group()
    return dist.get_rank()


def report_pass(rank: int) -> None:
    """Worker side: the line :func:`run_ranks` waits for, then leave the group."""
    print(f"PASS rank {rank}", flush=True)
    dist.destroy_process_group()


def finish(rank: int) -> None:
    """Worker side: a last barrier (no rank leaves while a peer may still touch its symmetric memory), then
    :func:`report_pass`."""
    dist.barrier()
    report_pass(rank)


def suite_parser(suites: Iterable[str], description: str | None = None) -> argparse.ArgumentParser:
    """Worker side: the command line of a worker of several suites, ``--suite`` (one of ``suites``, required)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--suite", choices=tuple(suites), required=True)
    return parser


def run_suite(suites: Mapping[str, Callable[[int, int], None]]) -> None:
    """Worker side: the whole run of a worker of several suites: parses ``--suite`` (a key of ``suites``), joins,
    runs that suite with (rank, world size) and reports the pass."""
    suite = suite_parser(suites).parse_args().suite
    rank = join()
    suites[suite](rank, dist.get_world_size())
    report_pass(rank)


@contextmanager
def raises(error: type[Exception], rank: int, case: str, *needles: str,
           timeout_ms: int | None = None) -> Iterator[None]:
    """Worker side: the block must raise ``error`` with each of ``needles`` in its message, and with ``timeout_ms``
    (a device timeout) no sooner than that and within :data:`TIMEOUT_CEILING_S` of entering the block. Prints
    ``rank <r>: <case> -> <error> after <s> s: <message>`` (what the tests look for); any other exception passes
    through, and no exception at all is an AssertionError."""
    start = time.monotonic()
    try:
        yield
    except error as err:
        elapsed = time.monotonic() - start
        for needle in needles:
            assert needle in str(err), err
        if timeout_ms is not None:
            assert timeout_ms / 1e3 <= elapsed < TIMEOUT_CEILING_S, elapsed
        print(f"rank {rank}: {case} -> {error.__name__} after {elapsed:.3f} s: {err}", flush=True)
    else:
        raise AssertionError(f"rank {rank}: {case}: no {error.__name__}")


@contextmanager
def spin_timeout(ms: int) -> Iterator[None]:
    """Worker side: the device spin timeout ``GC_MOE_SPIN_TIMEOUT_MS`` is ``ms`` for the calls built inside the
    block (the operator and the facades read it when they build a call), unset again after it."""
    os.environ["GC_MOE_SPIN_TIMEOUT_MS"] = str(ms)
    try:
        yield
    finally:
        del os.environ["GC_MOE_SPIN_TIMEOUT_MS"]
