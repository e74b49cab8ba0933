"""What every benchmark script shares: the BENCH_PROTOCOL.md window timing and the result file's ``meta`` block.

Benchmarks run as scripts (``python bench/NAME.py``), so this module is imported from the script's own folder.
"""

from __future__ import annotations

import datetime
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

REPO = Path(__file__).resolve().parents[1]
PER_WINDOW = 100  # launches (or graph replays) per timed window
L2_FLUSH_BYTES = 256 << 20  # >= 2x the H200's 50 MiB L2


def timed_windows(window: Callable[[], None], warmup: int, windows: int,
                  before_window: Callable[[], None] | None = None,
                  launches: int = PER_WINDOW) -> tuple[list[float], float]:
    """Run ``window`` (which issues ``launches`` launches) ``warmup + windows`` times, L2 flushed and the device
    synchronized before each; return the per-launch device microseconds of each measured window (CUDA events) and
    the median host microseconds per launch spent issuing them (above the device time, launches are host-bound).

    ``before_window`` runs after the synchronization and before the start event is recorded (e.g. a device-side
    barrier of several ranks, so that their windows start together)."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    device_us, host_us = [], []
    for i in range(warmup + windows):
        flush.zero_()
        torch.cuda.synchronize()
        if before_window is not None:
            before_window()
        start.record()
        t0 = time.perf_counter()
        window()
        t1 = time.perf_counter()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            device_us.append(start.elapsed_time(end) * 1e3 / launches)
            host_us.append((t1 - t0) * 1e6 / launches)
    return device_us, statistics.median(host_us)


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written) of a 2 GiB copy, median of 10."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(12):
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / statistics.median(times[2:])


def expert_floor_bytes(hidden: int, inter: int, active_experts: int, rows: int, mma_type: str = "fp8xfp8") -> int:
    """BENCH_PROTOCOL.md floor bytes: ``active_experts`` experts' weights + scales (FP8 ``3 H I`` with FP32 128x128
    block scales, or FP4 ``1.5 H I`` with one UE8M0 byte per 32 values), plus ``rows`` token rows in (FP8 + FP32
    1x128 scales) and out (BF16)."""
    h = hidden
    if mma_type == "fp8xfp8":
        per_expert = 3 * h * inter + 4 * (2 * inter // 128 * h // 128 + h // 128 * inter // 128)
    elif mma_type == "fp8xfp4":
        per_expert = 3 * h * inter // 2 + 3 * h * inter // 32
    else:
        raise ValueError(f"mma_type: must be 'fp8xfp8' or 'fp8xfp4', got {mma_type!r}")
    return active_experts * per_expert + rows * (h + 4 * h // 128) + rows * 2 * h


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _dirty() -> bool | None:
    """Whether tracked files differ from HEAD (``GC_MOE_GIT_DIRTY`` where the copy has no git metadata)."""
    if os.environ.get("GC_MOE_GIT_DIRTY"):
        return os.environ["GC_MOE_GIT_DIRTY"].lower() in ("1", "true", "yes")
    status = _git("status", "--porcelain", "--untracked-files=no")
    return None if status is None else bool(status)


def _driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
        return out.splitlines()[0].strip()
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown"


def result_meta(script: str, argv: list[str], partition: dict[str, object], *, world_size: int = 1,
                env_keys: tuple[str, ...] = ()) -> dict[str, object]:
    """The ``meta`` block of BENCH_PROTOCOL.md "Result files": provenance, machine, partition and the command that
    re-runs the benchmark (``env_keys`` that are set are written in front of it)."""
    env = [f"{k}={os.environ[k]}" for k in env_keys if os.environ.get(k)]
    return {
        "git_sha": os.environ.get("GC_MOE_GIT_SHA") or _git("rev-parse", "HEAD") or "unknown",
        "dirty": _dirty(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "driver": _driver_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "world_size": world_size,
        "partition": partition,
        "command": " ".join([*env, "python", script, *argv]),
    }


def pyplot() -> ModuleType | None:
    """``matplotlib.pyplot`` on the headless Agg backend, or None (with a note) where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG written", file=sys.stderr)
        return None
    return plt
