"""docs/bench_protocol.md's timing protocol and result provenance: the one home of what every measurement shares.

``gc-moe-ab`` and the benchmark scripts of ``bench/`` (through ``bench/_common.py``, which re-exports these names)
time the same way:

* a *window* replays a CUDA graph :data:`PER_WINDOW` times; latency = CUDA-event elapsed / :data:`PER_WINDOW`;
* 10 warm-up and 30 measured windows; before each window the L2 is flushed (a write of :data:`L2_FLUSH_BYTES`, at
  least twice the H200's 50 MiB L2) and the device synchronized;
* each rank keeps its median window, a point's latency is the slowest rank's (:func:`slowest_rank`), a mean speedup
  is the arithmetic mean of per-point ratios (:func:`mean_of_ratios`);
* ``gc-moe-ab`` times a point in several rounds (:func:`graph_windows` each) and reports their spread
  (:func:`spread_pct`) with the GPU's clocks, temperature and power after each round (:func:`gpu_conditions`);
* a benchmark of single kernels times a graph of one 1-element kernel beside them (:func:`graph_replay_floor`): the
  part of a replay that is no kernel's own time;
* the floor is the bytes the layer must stream once (:func:`expert_floor_bytes`) over the copy bandwidth measured in
  the same run (:func:`copy_bandwidth`);
* the GPU should be idle: :func:`idle_gpu_check` reports other compute processes or a busy GPU (a warning, the run
  goes on);
* every result file carries :func:`result_meta` (git SHA, dirty tree, GPU, driver, torch, CUDA, world size,
  partition, and the command that re-runs it); a script that measures in parts rewrites its file after each part
  (:func:`write_partial_result`), so a run cut by its limit keeps what it finished and says so;
* a result file names files by their path inside the checkout (:func:`write_result`, :func:`portable_path`), never
  by an absolute path of the machine that made it, and says whether the tree was dirty when the process first asked;
* a multi-rank run starts one process per GPU under ``torch.distributed.run`` with NVLink multicast off
  (:func:`torchrun_command`).
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from gc_moe_compat.compute_paths import compute_path

__all__ = [
    "L2_FLUSH_BYTES",
    "PER_WINDOW",
    "REPO",
    "capture_graph",
    "copy_bandwidth",
    "expert_floor_bytes",
    "gpu_conditions",
    "graph_replay_floor",
    "graph_windows",
    "idle_gpu_check",
    "mean_of_ratios",
    "median_graph_window",
    "portable_path",
    "portable_text",
    "result_meta",
    "slowest_rank",
    "spread_pct",
    "timed_windows",
    "torchrun_command",
    "write_partial_result",
    "write_result",
]

REPO = Path(__file__).resolve().parents[2]
"""The checkout this package runs from (an editable install); git provenance is read there when it is one."""
PER_WINDOW = 100  # launches (or graph replays) per timed window
L2_FLUSH_BYTES = 256 << 20  # >= 2x the H200's 50 MiB L2
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""NVLink multicast stays off on the machines the project is tested on (docs/platform_notes.md): every rank process
inherits these."""
IDLE_UTILIZATION_PCT = 5
"""A GPU reporting more utilization than this before the run is not idle (nvidia-smi's sampled figure)."""
GPU_CONDITIONS = {"sm_mhz": "clocks.sm", "mem_mhz": "clocks.mem", "temp_c": "temperature.gpu", "power_w": "power.draw"}
"""What :func:`gpu_conditions` records, and the nvidia-smi query field of each (in query order)."""


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


def torchrun_command(target: Sequence[str], nproc: int,
                     extra_env: Mapping[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The command and environment that run ``target`` (a script path or ``-m module``, then its arguments) once per
    GPU, ``nproc`` processes, under ``torch.distributed.run --standalone``: multicast off (:data:`MULTICAST_OFF`),
    unbuffered output, plus ``extra_env``. The caller starts it (with its own timeout or process-group handling)."""
    env = dict(os.environ, **MULTICAST_OFF, PYTHONUNBUFFERED="1", **(extra_env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *target]
    return cmd, env


def capture_graph(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``fn`` (run eagerly before, so every JIT and lazy allocation is done). ``thread_local``
    capture mode: NCCL's and torch's watchdog threads may query events meanwhile."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        fn()
    torch.cuda.synchronize()
    return graph


def graph_windows(graph: torch.cuda.CUDAGraph, warmup: int, windows: int,
                  before_window: Callable[[], None] | None = None) -> list[float]:
    """This rank's measured windows of ``graph`` replays (µs per replay, in order): :func:`timed_windows` of
    :data:`PER_WINDOW` replays a window. A caller that times in rounds pools or summarizes them itself."""

    def window() -> None:
        for _ in range(PER_WINDOW):
            graph.replay()

    return timed_windows(window, warmup, windows, before_window=before_window)[0]


def median_graph_window(graph: torch.cuda.CUDAGraph, warmup: int, windows: int,
                        before_window: Callable[[], None] | None = None) -> float:
    """This rank's median window of ``graph`` replays (µs per replay)."""
    return statistics.median(graph_windows(graph, warmup, windows, before_window=before_window))


def graph_replay_floor(device: torch.device, warmup: int, windows: int) -> float:
    """The median window (µs per replay) of a graph holding one kernel that does nothing measurable (a 1-element
    add): what replaying any one-kernel graph costs here, launch and inter-graph gap included. A one-kernel
    benchmark's latency minus this is about its kernel's own time."""
    probe = torch.zeros(1, dtype=torch.int32, device=device)
    probe.add_(1)  # eagerly first, as capture_graph's callers do: any lazy module load happens outside the capture
    return median_graph_window(capture_graph(lambda: probe.add_(1)), warmup, windows)


def slowest_rank(per_rank_us: Sequence[float]) -> float:
    """A point's latency: the maximum over the ranks' median windows."""
    if not per_rank_us:
        raise ValueError("per_rank_us: needs one median window per rank, got none")
    return max(per_rank_us)


def spread_pct(round_us: Sequence[float]) -> float | None:
    """The spread of one operator's latencies over timing rounds: ``100 (max - min) / min``, in percent; None with
    fewer than two rounds (nothing to compare)."""
    if len(round_us) < 2:
        return None
    return 100 * (max(round_us) - min(round_us)) / min(round_us)


def mean_of_ratios(ratios: Sequence[float]) -> float | None:
    """The arithmetic mean of per-point speedups (None without any point): never a ratio of mean latencies."""
    return statistics.fmean(ratios) if ratios else None


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
    """docs/bench_protocol.md floor bytes: ``active_experts`` experts' weights + scales (FP8 ``3 H I`` with FP32 128x128
    block scales, or FP4 ``1.5 H I`` with one UE8M0 byte per 32 values), plus ``rows`` token rows in (FP8 + FP32
    1x128 scales) and out (BF16)."""
    h = hidden
    if compute_path(mma_type).fp4:
        per_expert = 3 * h * inter // 2 + 3 * h * inter // 32
    else:
        per_expert = 3 * h * inter + 4 * (2 * inter // 128 * h // 128 + h // 128 * inter // 128)
    return active_experts * per_expert + rows * (h + 4 * h // 128) + rows * 2 * h


def _run(*cmd: str) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return None


def _git(*args: str) -> str | None:
    """git in this checkout; None where the package does not run from one (a wheel install)."""
    if not (REPO / "pyproject.toml").is_file():
        return None
    return _run("git", "-C", str(REPO), *args)


def _dirty() -> bool | None:
    """Whether tracked files differ from HEAD (``GC_MOE_GIT_DIRTY`` where the copy has no git metadata)."""
    if os.environ.get("GC_MOE_GIT_DIRTY"):
        return os.environ["GC_MOE_GIT_DIRTY"].lower() in ("1", "true", "yes")
    return _tree_dirty_at_start()


@functools.cache
def _tree_dirty_at_start() -> bool | None:
    """``git status`` of the checkout when this process first asks, kept for the process: a run that rewrites a
    tracked result file (``--out bench/results/...``) part by part must not call its own later parts dirty."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return None if status is None else bool(status)


def portable_path(path: str | os.PathLike[str] | None) -> str | None:
    """``path`` as a result file records it: relative to the checkout (or the working directory) where it lies
    inside one, else ``<outside the checkout>/<folder>/<file>``; never an absolute path of the machine."""
    if path is None:
        return None
    p = Path(path)
    if not p.is_absolute():
        return p.as_posix()
    for base in (REPO, Path.cwd()):
        if p.is_relative_to(base) and base != Path(base.anchor):
            return p.relative_to(base).as_posix()
    return f"<outside the checkout>/{p.parent.name}/{p.name}" if p.parent.name else p.name


def portable_text(text: str) -> str:
    """``text`` with every path inside the checkout (or the working directory) written relative to it."""
    for base in dict.fromkeys((str(REPO), str(Path.cwd()))):
        if base != os.sep:
            text = text.replace(base + os.sep, "")
    return text


def write_result(path: Path, data: Mapping[str, object]) -> None:
    """Write the result file ``data`` (JSON, parents created) with :func:`portable_text`'s paths."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(portable_text(json.dumps(data, indent=1, default=str)) + "\n")


def _driver_version() -> str:
    out = _run("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
    return out.splitlines()[0].strip() if out else "unknown"


def gpu_setup(world_size: int) -> str:
    """How a run of ``world_size`` ranks sat on this host's GPUs, for result titles: ``P x <GPU>`` with a GPU per rank,
    else ``P ranks on N <GPU>: <the shared-GPU label>`` (several ranks per GPU under CUDA MPS: never an NVLink
    figure)."""
    from gc_moe_compat.runtime.colocation import SHARED_GPU_LABEL

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if world_size <= max(gpus, 1):
        return f"{world_size} x {_gpu_name()}"
    return f"{world_size} ranks on {gpus} {_gpu_name()}: {SHARED_GPU_LABEL}"


def _gpu_name() -> str:
    """The current GPU's name, ``"none"`` where torch has no CUDA device (a CPU-only matrix run)."""
    try:
        return torch.cuda.get_device_name()
    except (AssertionError, RuntimeError):
        return "none"


def smi_device(device: int) -> str:
    """How nvidia-smi names torch's CUDA device ``device``: ``GPU-<uuid>`` (nvidia-smi's numbering ignores
    ``CUDA_VISIBLE_DEVICES``, a reordered visibility would point an index at another GPU), the index where torch cannot
    tell the UUID (no CUDA here)."""
    if torch.cuda.is_available():
        uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
        if uuid is not None:  # torch prints it in 8-4-4-4-12 form, nvidia-smi wants its "GPU-" in front
            text = str(uuid)
            return text if text.startswith("GPU-") else f"GPU-{text}"
    return str(device)


def _smi(device: int, *query: str) -> str | None:
    """nvidia-smi's answer to ``query`` for GPU ``device``, asked by :func:`smi_device`'s name, then by the index
    where that gets no answer (a driver that does not take the UUID form); None where neither does."""
    for which in dict.fromkeys((smi_device(device), str(device))):
        out = _run("nvidia-smi", f"--id={which}", *query)
        if out is not None:
            return out
    return None


def idle_gpu_check(device: int = 0) -> dict[str, object]:
    """Whether GPU ``device`` looked idle before the run: other processes' compute contexts and the sampled
    utilization (nvidia-smi). ``{"idle": bool | None, "detail": str}``; None where nvidia-smi cannot say."""
    own = str(os.getpid())
    apps = _smi(device, "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader")
    util = _smi(device, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits")
    if apps is None or util is None:
        return {"idle": None, "detail": "nvidia-smi did not answer: idleness unknown"}
    others = [line.strip() for line in apps.splitlines() if line.strip() and line.split(",")[0].strip() != own]
    try:
        busy = int(util.splitlines()[0].strip())
    except (ValueError, IndexError):
        busy = None
    problems = []
    if others:
        problems.append(f"{len(others)} other compute process(es): {'; '.join(others)}")
    if busy is not None and busy > IDLE_UTILIZATION_PCT:
        problems.append(f"utilization {busy}% > {IDLE_UTILIZATION_PCT}%")
    detail = "; ".join(problems) or f"no other compute process, utilization {busy}%"
    return {"idle": not problems, "detail": detail}


def gpu_conditions(device: int = 0) -> dict[str, float | None]:
    """GPU ``device``'s SM and memory clocks (MHz), temperature (°C) and power draw (W) now, from one nvidia-smi
    call: what may explain a spread between timing rounds, measured right after each (:data:`GPU_CONDITIONS`). A
    field nvidia-smi does not answer (no nvidia-smi, ``[N/A]``) is None."""
    out = _smi(device, f"--query-gpu={','.join(GPU_CONDITIONS.values())}", "--format=csv,noheader,nounits")
    values = out.splitlines()[0].split(",") if out else []
    return {key: _number(values[i]) if i < len(values) else None for i, key in enumerate(GPU_CONDITIONS)}


def _number(text: str) -> float | None:
    """nvidia-smi's figure as a float; None for what is not one (``[N/A]``, ``[Not Supported]``)."""
    try:
        return float(text)
    except ValueError:
        return None


def result_meta(script: str, argv: list[str], partition: dict[str, object], *, world_size: int = 1,
                env_keys: tuple[str, ...] = (), command: Sequence[str] | None = None) -> dict[str, object]:
    """The ``meta`` block of docs/bench_protocol.md "Result files": provenance, machine, partition and the command that
    re-runs the run: ``python script argv``, or ``command`` (a console script's words) when given; the ``env_keys``
    that are set are written in front of it."""
    env = [f"{k}={shlex.quote(os.environ[k])}" for k in env_keys if os.environ.get(k)]
    words = list(command) if command is not None else ["python", script, *argv]
    return {
        "git_sha": os.environ.get("GC_MOE_GIT_SHA") or _git("rev-parse", "HEAD") or "unknown",
        "dirty": _dirty(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": _gpu_name(),
        "driver": _driver_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "world_size": world_size,
        "gpu_setup": gpu_setup(world_size),
        "partition": partition,
        "command": " ".join([*env, *(shlex.quote(w) for w in words)]),
    }


def write_partial_result(path: Path, meta: dict[str, object], points: Sequence[Mapping[str, object]], *, unit: str,
                         key: str, requested: Sequence[str]) -> None:
    """Write the result file ``{"meta", "points"}`` of the points measured so far (parents created).

    A script that measures in parts (presets, modes) calls it after each part, so a run cut by its limit leaves the
    parts it finished. ``meta`` gains ``<unit>_requested`` (``requested``), ``<unit>_measured`` (those with a point
    whose ``key`` names them, in requested order) and ``complete`` (every requested one measured)."""
    measured = [r for r in requested if any(p[key] == r for p in points)]
    meta = {**meta, f"{unit}_requested": list(requested), f"{unit}_measured": measured,
            "complete": measured == list(requested)}
    write_result(path, {"meta": meta, "points": list(points)})
