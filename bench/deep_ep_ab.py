"""The ``deep_ep`` facade and the original DeepEP (v1.2.1, built by scripts/build_deep_ep.sh) side by side, on
identical inputs, at P ranks sharing one GPU under CUDA MPS (shared-GPU figures: never NVLink ones).

Launch: ``python bench/deep_ep_ab.py --ranks 2 4 --out deep_ep_ab.json``. Per rank count P the script spawns P
processes (``torch.multiprocessing``, no torchrun) that join one group through
:func:`gc_moe_compat.runtime.colocation.init_rank_group` (gloo where the ranks share a GPU, as NCCL refuses that) and
build both Buffers, the facade's ``gc_moe_compat.deep_ep.Buffer`` and the original's
``gc_moe_compat.originals.load("deep_ep").Buffer``, on the same group with the same sizes. Per point every rank draws
its own seeded inputs and hands the same tensors to both implementations.

* ``normal``: ``get_dispatch_layout`` then an uncached ``dispatch`` of BF16 rows (``dispatch_bf16``) or FP8 rows with
  FP32 1x128 scales, column-major, as DeepEP's tests make them (``dispatch_fp8``), and ``combine`` of the received
  BF16 rows (scaled per rank) with their weights; ``Config(num_sms, 8, 256)`` with ``num_sms`` at most the rank's
  share of the SMs (:func:`normal_num_sms`); T in 512 .. 8192 tokens per rank. The
  uncached dispatch waits on the CPU for the received count (both implementations), so normal mode cannot be
  captured in a CUDA graph: it is timed eagerly only.
* ``low_latency``: ``low_latency_dispatch`` (BF16 in, FP8 1x128 out) and ``low_latency_combine`` at T = 1 .. 256
  (``Tmax`` 256, or 128 with ``--ll-tmax``), eager and captured in a CUDA graph and replayed. The original's
  low-latency mode needs NVSHMEM, whose initialisation hung on the lent machines under MPS with its CUDA VMM heap
  and passes without it (then its static heap must hold the Buffer: :func:`size_static_heap`): before each P it is
  tried in child processes with a timeout (``--ll-original-env`` variants, ``--probe-timeout``); where it does not
  start the result says ``did not start: <reason>`` and the facade runs alone.

Shapes (:data:`SHAPES`): SGLang's deployments' hidden sizes, top-k and expert counts (all experts split over the P
ranks). Per call and implementation: ``latency_us`` is the GPU time (CUDA events around a window of ``--calls``
calls, per call; for the uncached dispatch that includes DeepEP's CPU wait between its two kernels), ``host_us`` the
host time of the Python calls (``perf_counter`` around the same window, per call, no synchronization added), and for
low-latency ``graph_us`` (a graph of two calls, so that DeepEP's two alternating buffers stay consistent across
replays, per call). A point's figure is the slowest rank's median window (docs/bench_protocol.md), windows started
together on every rank: after the L2 flush and the device synchronization, a gloo barrier, and before an eager
window one untimed call (its exchange releases the ranks' GPUs together; the window queues behind it). Per P the
job's ``host_reference`` (:func:`host_reference`): each rank's host time per bare launch and its CPUs, so that host
time that grows with P can be told apart from the calls' own work.

``--rounds N``: each point timed in N rounds, the two implementations alternating within a round (their order reversed
every other round), so that the shared GPU's drift between one measurement and the next (the other ranks' processes
under MPS) reaches both alike; a figure is the median round's, every round's GPU time is kept (``rounds_us``) with
its spread (``round_spread_pct``).

``--phases N``: after each point's timing, N more facade calls per op on the phase-timed kernels
(bench/_ep_normal_phases.py, bench/_ep_ll_phases.py), each read back: per rank and op, when the median and the latest
CTA passed each phase (normal mode: of the send and receive halves; low-latency: of the send half, then the exit,
which follows the receive half and its wait for the peers), the point's ``phases``, also printed in the log. Their
timing is not the point's.

Floor: the bytes every rank of the GPU moves once (all P ranks share one GPU's memory bandwidth) over the copy
bandwidth of the same run. No torch.distributed all-to-all is compared: on a gloo group it runs on the host (device
to host copies over TCP), which measures nothing about a GPU exchange; the result's meta says so.

Correctness, facade against original on the same inputs (reported, never fatal): the layout, received rows (BF16 bits;
FP8 bytes and scales), top-k ids and weights, per-expert counts, the handle's tensors (``rank_prefix_matrix``: the
receiver's column, the only one DeepEP fills), the combined rows and weights; low-latency: ``recv_count``, every
valid received row (FP8 bytes and scales) matched by its (source rank, token) since DeepEP's order within a source
rank is its atomics', and the combine of the same expert outputs (built per row from the dispatched token). BF16
dispatch and combine are expected bit-exact.

Result file (``--out``, default ``deep_ep_ab.json`` in the working directory): protocol meta (git sha, GPU, world
sizes, ``gpu_setup`` per P, the shared-GPU label, the original's location, version and the commit its ``SOURCE`` file
names), a point per (mode, P, shape, T), rewritten after each P; a PNG beside it, and a compact table printed last.
``--dry-run`` prints the plan without a GPU.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import _ep_ll_phases
import _ep_normal_phases
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _call_trace import summarize_file, trace_calls
from _common import PER_WINDOW, copy_bandwidth, pyplot, require_gpus, result_meta, write_partial_result
from deep_ep_sm90 import dispatch_kwargs, fp8_rows, ll_floor_bytes, normal_nvl_bytes, payload_bytes, routing

from gc_moe_compat import originals
from gc_moe_compat.ab.protocol import (
    MULTICAST_OFF,
    capture_graph,
    gpu_setup,
    median_graph_window,
    portable_path,
    slowest_rank,
    timed_windows,
)
from gc_moe_compat.deep_ep._config import MAX_NVL_RANKS
from gc_moe_compat.runtime import colocation
from gc_moe_compat.runtime.split import MIN_DISPATCH_SMS, shared_device_sms


@dataclass(frozen=True)
class Shape:
    """One deployment's MoE layer as DeepEP sees it: token width, experts per token, routed experts in all."""

    hidden: int
    topk: int
    experts: int
    label: str


SHAPES = {
    "deepseek-v3": Shape(7168, 8, 256, "DeepSeek-V3 (H 7168, top-8, 256 experts)"),
    "kimi-k2": Shape(7168, 8, 384, "Kimi-K2 (H 7168, top-8, 384 experts)"),
    "glm": Shape(5120, 8, 160, "GLM-class (H 5120, top-8, 160 experts)"),
    "qwen": Shape(6144, 8, 128, "Qwen-class (H 6144, top-8, 128 experts)"),
}
"""SGLang's DeepEP shapes: hidden 7168 (DeepSeek-V3, Kimi), 5120 (GLM-class), 6144 (Qwen-class)."""
MODES = ("normal", "low_latency")
IMPLS = ("facade", "original")
NORMAL_OPS = ("dispatch_bf16", "dispatch_fp8", "combine")
LL_OPS = ("dispatch", "combine")
NORMAL_TOKENS = (512, 1024, 2048, 4096, 8192)
LL_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
LL_TMAX = (256, 128)
"""SGLang's ``num_max_dispatch_tokens_per_rank`` choices; the first is the default."""
RANKS = (2, 4)
NUM_SMS = 24
LL_ORIGINAL_ENV = ("NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_DISABLE_NCCL=1 "
                   "NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=1 NVSHMEM_DISABLE_CUDA_VMM=1",
                   "NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_DISABLE_NCCL=1 "
                   "NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=1")
"""The NVSHMEM settings the original's low-latency probe tries, in order (one string per attempt): no remote
transport (no network card to find), NCCL off (NVSHMEM disables it under MPS anyway) and the full multiple-PEs-per-GPU
mode under MPS; first with NVSHMEM's cudaIpc heap instead of its CUDA VMM one (under MPS on the lent machines every
try with VMM hung at initialisation; without it NVSHMEM initialised, its heap then sized by :func:`size_static_heap`).
DeepEP's Buffer itself sets ``NVSHMEM_IB_ENABLE_IBGDA=1`` before it initializes NVSHMEM."""
NVSHMEM_DEFAULT_HEAP = 1 << 30
"""NVSHMEM's ``NVSHMEM_SYMMETRIC_SIZE`` default: the whole symmetric heap where it is static (VMM off)."""
ALL_TO_ALL_NOTE = ("omitted: on a gloo group (ranks sharing a GPU) torch.distributed.all_to_all runs on the host "
                   "(device-to-host copies over TCP), so it would not measure a GPU exchange")


# -- the command line and the plan -------------------------------------------------------------------------------------


def env_variant(text: str) -> dict[str, str]:
    """``"K=V K2=V2"`` (or ``"K=V+K2=V2"``: one word, which survives ``device_check.sh --bench``'s split on spaces) as
    a dict (one ``--ll-original-env`` attempt); ``ValueError`` naming a word without ``=``."""
    pairs = {}
    for word in text.replace("+", " ").split():
        key, sep, value = word.partition("=")
        if not sep or not key:
            raise ValueError(f"--ll-original-env: {word!r} is not KEY=VALUE")
        pairs[key] = value
    return pairs


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("deep_ep_ab.json"),
                        help="result file (default: the working directory; bench/results/ only when named)")
    parser.add_argument("--ranks", type=int, nargs="+", default=list(RANKS), help="rank counts P sharing the GPU")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", type=int, nargs="+", default=list(NORMAL_TOKENS), help="normal mode's T")
    parser.add_argument("--ll-tokens", type=int, nargs="+", default=list(LL_TOKENS), help="low-latency T")
    parser.add_argument("--ll-tmax", type=int, default=LL_TMAX[0], choices=LL_TMAX)
    parser.add_argument("--warmup", type=int, default=3, help="warm-up windows (the protocol's: 10)")
    parser.add_argument("--windows", type=int, default=10, help="measured windows (the protocol's: 30)")
    parser.add_argument("--calls", type=int, default=5, help="eager calls per timed window")
    parser.add_argument("--rounds", type=int, default=1,
                        help="timing rounds per point, the implementations alternating (their order reversed every "
                             "other round): a figure is the median round's, each round's kept (rounds_us)")
    parser.add_argument("--num-sms", type=int, default=NUM_SMS,
                        help="normal mode's Config.num_sms (both; at most the rank's even SM share)")
    parser.add_argument("--no-original", action="store_true", help="the facade alone")
    parser.add_argument("--ll-original-env", nargs="+", default=list(LL_ORIGINAL_ENV),
                        help="NVSHMEM settings for the original's low-latency probe, one 'K=V K=V' (or 'K=V+K=V') "
                             "string per try")
    parser.add_argument("--probe-timeout", type=float, default=45.0, help="seconds per low-latency probe")
    parser.add_argument("--job-timeout", type=float, default=300.0, help="seconds per rank count's measurement")
    parser.add_argument("--trace", type=Path, default=None,
                        help="also write a Kineto trace of a few eager calls per op, implementation, rank and point "
                             "of --trace-tokens (bench/_call_trace.py) and its summary into this folder")
    parser.add_argument("--trace-tokens", type=int, nargs="+", default=[512, 1],
                        help="the T (normal or low-latency) traced with --trace")
    parser.add_argument("--phases", type=int, default=0,
                        help="after each point's timing, this many more facade calls per op on the phase-timed "
                             "kernels (bench/_ep_normal_phases.py, bench/_ep_ll_phases.py): where the time inside "
                             "each goes")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU)")
    args = parser.parse_args(argv)
    check_args(parser, args)
    return args


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse what no run can do: counts below their minimum, rank counts past the facade's NVLink group (8) or
    that do not divide a chosen shape's experts, T outside its mode's range."""
    for name, value, low in (("--warmup", args.warmup, 0), ("--windows", args.windows, 1), ("--calls", args.calls, 1),
                             ("--rounds", args.rounds, 1), ("--num-sms", args.num_sms, 2),
                             ("--phases", args.phases, 0)):
        if value < low:
            parser.error(f"{name}: must be >= {low}, got {value}")
    if args.num_sms % 2:
        parser.error(f"--num-sms: must be even (two SMs per channel, DeepEP's rule), got {args.num_sms}")
    bad = [p for p in args.ranks if not 2 <= p <= MAX_NVL_RANKS]
    if bad:
        parser.error(f"--ranks: every P must lie in [2, {MAX_NVL_RANKS}], got {bad}")
    for p in args.ranks:
        odd = [s for s in args.shapes if SHAPES[s].experts % p]
        if odd:
            parser.error(f"--ranks {p}: does not divide the experts of {odd}")
    for name, tokens, high in (("--tokens", args.tokens, None), ("--ll-tokens", args.ll_tokens, args.ll_tmax)):
        out = [t for t in tokens if t < 1 or (high is not None and t > high)]
        if out:
            parser.error(f"{name}: every T must lie in [1, {high or 'inf'}], got {out}")
    for text in args.ll_original_env:
        try:
            env_variant(text)
        except ValueError as exc:
            parser.error(str(exc))


def job_name(mode: str, ranks: int) -> str:
    """The key of one (mode, P) part in the result file (``meta.jobs_requested`` / ``jobs_measured``)."""
    return f"{mode} P={ranks}"


def requested_jobs(args: argparse.Namespace) -> list[str]:
    return [job_name(mode, p) for p in args.ranks for mode in MODES if mode in args.modes]


def plan_lines(args: argparse.Namespace) -> list[str]:
    """What a run measures (``--dry-run`` prints it; no GPU needed)."""
    impls = "facade" if args.no_original else "facade and original"
    lines = [f"ranks P {args.ranks}, each P as P processes on one GPU ({colocation.SHARED_GPU_LABEL}); {impls}",
             f"windows: {args.warmup} warm-up + {args.windows} measured (slowest rank's median), L2 flushed and ranks "
             f"aligned before each; {args.rounds} round(s) per point, the implementations alternating",
             "shapes: " + "; ".join(f"{name} = {SHAPES[name].label}" for name in args.shapes)]
    if "normal" in args.modes:
        lines.append(f"normal: T {args.tokens} x {list(NORMAL_OPS)}, Config(min({args.num_sms}, the rank's even SM "
                     "share), 8, 256), "
                     f"{args.calls} eager calls per window (not capturable: the uncached dispatch waits on the CPU)")
    if "low_latency" in args.modes:
        probe = "not run (--no-original)" if args.no_original else \
            f"probed first per P ({len(args.ll_original_env)} setting(s), {args.probe_timeout:.0f} s each)"
        lines.append(f"low_latency: T {args.ll_tokens} (Tmax {args.ll_tmax}) x {list(LL_OPS)}, eager ({args.calls} "
                     f"calls per window) and CUDA graph ({PER_WINDOW} replays of 2 calls per window); the original's "
                     f"low-latency mode {probe}")
    lines.append(f"all-to-all baseline: {ALL_TO_ALL_NOTE}")
    lines.append(f"points: {point_count(args)}; result {args.out} (+ .png)")
    return lines


def point_count(args: argparse.Namespace) -> int:
    per_p = len(args.shapes) * (len(args.tokens) * ("normal" in args.modes) +
                                len(args.ll_tokens) * ("low_latency" in args.modes))
    return per_p * len(args.ranks)


# -- the original DeepEP: where it is, what it is ----------------------------------------------------------------------


def source_info(origin: str | None) -> dict[str, object]:
    """What the result records about the original DeepEP at ``origin`` (its ``__init__.py``) without importing it: the
    location (checkout-relative or anonymised), the version its ``setup.py`` declares (or the installed metadata's),
    and the ref and commit of the ``SOURCE`` file scripts/build_deep_ep.sh writes beside the package."""
    if origin is None:
        return {"location": None}
    staging = Path(origin).resolve().parent.parent
    info: dict[str, object] = {"location": portable_path(origin), "version": _version(staging)}
    source = staging / "SOURCE"
    if source.is_file():
        words = source.read_text().split()
        info["commit"] = words[-1] if words and re.fullmatch(r"[0-9a-f]{40}", words[-1]) else None
        info["ref"] = words[1] if len(words) == 3 else None
    else:
        info["source"] = "no SOURCE file beside the package (not staged by scripts/build_deep_ep.sh)"
    return info


def original_root(origin: str | None) -> str | None:
    """The folder the original DeepEP was staged and built in (its ``__init__.py``'s grandparent): the prefix of the
    source paths its compiled assertions print."""
    return None if origin is None else str(Path(origin).resolve().parent.parent)


def without_root(point: dict[str, object], root: str | None) -> dict[str, object]:
    """``point`` with ``root`` in its error texts written as ``<original DeepEP>/``: a result file names no absolute
    path of the machine, and the original's assertions name its build folder."""
    errors = point.get("errors")
    if root is None or not isinstance(errors, dict):
        return point
    return {**point, "errors": {k: str(v).replace(root + os.sep, "<original DeepEP>/") for k, v in errors.items()}}


def _version(staging: Path) -> str | None:
    try:
        return importlib.metadata.version("deep_ep")
    except importlib.metadata.PackageNotFoundError:
        pass
    setup = staging / "setup.py"
    found = re.search(r"version\s*=\s*'([^']+)'", setup.read_text()) if setup.is_file() else None
    return found.group(1) if found else None


def load_original() -> tuple[ModuleType | None, str | None]:
    """The original ``deep_ep`` module, or None and why not (``not available: ...``)."""
    try:
        return originals.load("deep_ep"), None
    except ImportError as exc:
        return None, f"not available: {exc}"


# -- the jobs: P processes on one GPU ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """What one group of P rank processes does: ``probe`` (build the original's low-latency Buffer and run one call,
    nothing else) or ``measure`` (the chosen modes, both implementations); rank 0 writes ``result``."""

    kind: str
    ranks: int
    port: int
    result: str
    args: argparse.Namespace
    use_original: bool
    ll_original_env: dict[str, str] | None = None
    """The NVSHMEM settings the original's low-latency mode started with (None: it is not run)."""
    ll_status: str = ""
    """What became of the original's low-latency mode at this P (the probe's verdict)."""

    def rank_env(self, rank: int) -> dict[str, str]:
        """The environment :func:`colocation.init_rank_group` reads (torchrun's variables), multicast off, and the
        original's NVSHMEM settings."""
        env = {"LOCAL_RANK": str(rank), "RANK": str(rank), "LOCAL_WORLD_SIZE": str(self.ranks),
               "WORLD_SIZE": str(self.ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.port),
               **MULTICAST_OFF}
        return env | (self.ll_original_env or {})


@dataclass
class Outcome:
    """What the parent learnt from one job: rank 0's file (points, info) and how the processes ended."""

    data: dict[str, Any] = field(default_factory=dict)
    exit_codes: list[int | None] = field(default_factory=list)
    timed_out: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(code == 0 for code in self.exit_codes)

    def status(self, timeout: float) -> str:
        """``finished`` or what stopped it: the timeout (the ranks killed) or the ranks' exit codes."""
        if self.timed_out:
            return f"timed out after {timeout:.0f} s (ranks killed)"
        if not self.ok:
            return f"ranks exited with {self.exit_codes}"
        return "finished"


def free_port() -> int:
    """A TCP port no process listens on now, for the group's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_job(job: Job, timeout: float, target: Callable[[int, Job], None] | None = None) -> Outcome:
    """Start ``job.ranks`` spawned processes of ``target`` (:func:`rank_main`; the tests pass a stand-in), wait up to
    ``timeout`` s, kill the ones still running (by their own handles) and read rank 0's result file (what it wrote
    so far)."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target or rank_main, args=(rank, job), name=f"deep_ep_ab rank {rank}")
             for rank in range(job.ranks)]
    start = time.monotonic()
    for proc in procs:
        proc.start()
    outcome = Outcome()
    for proc in procs:
        proc.join(max(0.0, timeout - (time.monotonic() - start)))
    for proc in procs:
        if proc.is_alive():
            outcome.timed_out = True
            proc.kill()
            proc.join()
    outcome.exit_codes = [proc.exitcode for proc in procs]
    outcome.seconds = time.monotonic() - start
    outcome.data = read_job_file(Path(job.result))
    return outcome


def read_job_file(path: Path) -> dict[str, Any]:
    """Rank 0's job file, or {} where it wrote none (a rank that died first) or a partial one."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


DEVICE_READY_COMMAND = (sys.executable, "-c", "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()")
"""A fresh process that opens a CUDA context and runs a kernel: whether the GPU (its MPS server) takes new clients."""
DEVICE_READY_SECONDS = 90.0
"""How long :func:`wait_for_device` tries after a killed probe. Killing eight NVSHMEM ranks left the MPS server
refusing new clients (``cudaErrorMpsServerNotReady``, then ``cudaErrorDevicesUnavailable``) long enough that every
rank of the next measurement failed its CUDA initialisation."""


def wait_for_device(limit: float, command: Sequence[str] = DEVICE_READY_COMMAND) -> tuple[bool, str]:
    """Run ``command`` until it succeeds or ``limit`` seconds have passed (one try a second, each bounded by the
    time left): (True, how long it took) or (False, the last try's error)."""
    start, last = time.monotonic(), "not tried"
    while (left := limit - (time.monotonic() - start)) > 0:
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=max(left, 1.0))
        except subprocess.TimeoutExpired:
            last = f"a CUDA context took over {left:.0f} s"
            break
        if proc.returncode == 0:
            return True, f"the GPU took a new client after {time.monotonic() - start:.0f} s"
        last = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        time.sleep(min(1.0, max(0.0, limit - (time.monotonic() - start))))
    return False, f"the GPU took no new client within {limit:.0f} s: {last}"


def probe_original_ll(ranks: int, args: argparse.Namespace, workdir: Path,
                      ready: Callable[[], tuple[bool, str]] = lambda: wait_for_device(DEVICE_READY_SECONDS)
                      ) -> tuple[dict[str, str] | None, str]:
    """Try the original's low-latency mode at ``ranks`` ranks with each ``--ll-original-env`` setting in turn (a
    child group each, killed at ``--probe-timeout``): the first setting it started with, or None and why not. After
    a killed try, waits until the GPU takes new clients again (``ready``) and says so in the verdict."""
    reasons = []
    for i, text in enumerate(args.ll_original_env):
        env = env_variant(text)
        job = Job("probe", ranks, free_port(), str(workdir / f"probe_P{ranks}_{i}.json"), args, True, env)
        outcome = run_job(job, args.probe_timeout)
        if outcome.ok and outcome.data.get("started"):
            return env, f"started with {text!r}"
        why = outcome.data.get("error") or outcome.status(args.probe_timeout)
        if outcome.timed_out:
            why += f" {probe_progress(outcome.data)}; then {ready()[1]}"
        reasons.append(f"{text!r}: {why}")
    return None, "did not start: " + "; ".join(reasons)


PROBE_STEPS = ("the Buffer", "a dispatch", "a combine", "the closing barrier")
"""What a probe runs, in order (:func:`run_probe`); rank 0 records each one it finished in its job file."""


def probe_progress(data: Mapping[str, Any]) -> str:
    """Where a killed probe stopped, from the steps rank 0 recorded (``data["probe_done"]``): what it was running."""
    done = int(data.get("probe_done", 0))
    if done >= len(PROBE_STEPS):
        return "(every step done on rank 0)"
    finished = f"after {', '.join(PROBE_STEPS[:done])}" if done else "before any step finished"
    return f"(rank 0 in {PROBE_STEPS[done]}, {finished})"


# -- one rank ----------------------------------------------------------------------------------------------------------


_STARTED = time.monotonic()
"""When this process started (a spawned rank imports the module anew): the log's seconds since then."""


def rank_main(rank: int, job: Job) -> None:
    """A spawned rank: join the group, run the job, leave with ``os._exit`` (no destructor of a Buffer runs: the
    original's NVSHMEM teardown is not this benchmark's to wait for)."""
    os.environ.update(job.rank_env(rank))
    # P processes share the host's cores: torch's default of one intra-op thread per core in each would oversubscribe
    # them P times over in the CPU work of a point (its seeded inputs on the host)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // job.ranks))
    code = 0
    try:
        device = colocation.init_rank_group()
        if rank == 0:
            print(f"{job.kind} P={job.ranks}: group joined after {time.monotonic() - _STARTED:.1f} s", flush=True)
        (run_probe if job.kind == "probe" else run_measure)(rank, device, job)
        dist.barrier()
    except Exception as exc:
        traceback.print_exc()
        if rank == 0:
            JobFile(job.result).update(error=f"rank 0: {type(exc).__name__}: {exc}")
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class JobFile:
    """Rank 0's record of its job, rewritten whole at each update so the parent finds what was done by a cut run."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.data: dict[str, Any] = read_job_file(self.path)
        self.data.setdefault("points", [])

    def update(self, **items: object) -> None:
        """Merge ``items`` and rewrite the file through a temporary one, so a rank killed mid-write leaves the last
        whole file."""
        self.data.update(items)
        partial = self.path.with_suffix(".tmp")
        partial.write_text(json.dumps(self.data, default=str))
        os.replace(partial, self.path)

    def add_point(self, point: dict[str, object]) -> None:
        self.update(points=[*self.data["points"], point])


def gather(value: object) -> list[Any]:
    """Every rank's ``value``, in rank order (gloo or NCCL, whichever the group is)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def run_probe(rank: int, device: torch.device, job: Job) -> None:
    """Build the original's low-latency Buffer for the first shape and run one dispatch + combine of one token."""
    module, why = load_original()
    if module is None:
        raise RuntimeError(why)
    shape = SHAPES[job.args.shapes[0]]
    out = JobFile(job.result) if rank == 0 else None

    def done(step: int) -> None:  # rank 0's progress through PROBE_STEPS, for the verdict of a killed probe
        if out is not None:
            out.update(probe_done=step)

    size_static_heap(ll_rdma_bytes(module, job.ranks, job.args.ll_tmax, [shape]))
    buf = ll_buffer(module, job.ranks, job.args.ll_tmax, [shape])
    done(1)
    x, idx, w = (t.to(device) for t in routing(1, shape.hidden, shape.topk, shape.experts, seed=rank))
    _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, job.args.ll_tmax, shape.experts)
    torch.cuda.synchronize()
    done(2)
    local = shape.experts // job.ranks
    rows = torch.zeros(local, job.ranks * job.args.ll_tmax, shape.hidden, dtype=torch.bfloat16, device=device)
    buf.low_latency_combine(rows, idx, w, handle)
    torch.cuda.synchronize()
    done(3)
    dist.barrier()
    if out is not None:
        out.update(probe_done=4, started=True)


def run_measure(rank: int, device: torch.device, job: Job) -> None:
    """Both modes at this rank: agree on whether the original loaded everywhere, measure the copy bandwidth (rank 0),
    then every point of each mode; rank 0 records each point as it is made."""
    module, why = load_original() if job.use_original else (None, "not available: --no-original")
    loaded = gather(why)
    if any(loaded):
        module, why = None, next(w for w in loaded if w)
    impls: dict[str, ModuleType] = {"facade": _facade()} | ({"original": module} if module is not None else {})
    where = colocation.placement(dist.group.WORLD, device.index)
    bandwidth = gather(copy_bandwidth() if rank == 0 else None)[0]
    host_paths = gather(facade_host_path())
    host = gather(host_reference(device, job.args))
    torch.cuda.empty_cache()
    out = JobFile(job.result) if rank == 0 else None
    if out is not None:
        print(f"facade host path per rank: {host_paths}", flush=True)
        print(f"P={job.ranks}: host reference per rank: {host}", flush=True)
        out.update(info={"placement": colocation.describe(where, device.index),
                         "partition": colocation.deep_ep_mode_of(where), "copy_bandwidth_Bps": bandwidth,
                         "facade_host_path": host_paths, "host_reference": host,
                         "original": "loaded" if module is not None else why})
    runs = {"normal": run_normal, "low_latency": run_low_latency}
    for mode in (m for m in MODES if m in job.args.modes):
        runs[mode](rank, device, job, impls, bandwidth, out, why)


def host_reference(device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    """What a host microsecond costs on this rank, beside the points' ``host_us``: ``launch_us``, the host time per
    call of a one-kernel torch op (zeroing 16 bytes), timed in windows of ``--calls`` as the points' calls are (with
    every rank's process running, each waiting in its own windows); ``cpus``, the CPUs this process may run on;
    ``cpu_quota``, the cgroup's CPU limit in CPUs (None: none set). Where the bare launch's host time grows with P as
    both implementations' calls do, the host (P processes and the MPS server on its CPUs), not a call's own work, is
    what the extra time is."""
    small = torch.zeros(4, dtype=torch.float32, device=device)

    def window() -> None:
        for _ in range(args.calls):
            small.zero_()

    _, launch = timed_windows(window, args.warmup, args.windows, before_window=barrier, launches=args.calls)
    return {"launch_us": round(launch, 2), "cpus": len(os.sched_getaffinity(0)), "cpu_quota": cpu_quota()}


def cpu_quota(path: Path = Path("/sys/fs/cgroup/cpu.max")) -> float | None:
    """The cgroup (v2) CPU limit of this process in CPUs, from ``cpu.max`` (``"QUOTA PERIOD"``, or ``"max PERIOD"``
    for none); None where there is none or no such file."""
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else round(int(quota) / int(period), 2)


def facade_host_path() -> str:
    """This rank's facade host path, ``compiled`` or ``python`` and why (building the extension now, before any
    timing, where no call has): a result measured on the Python path says so. The cache folder the extension is
    built in is written ``<cache dir>`` (a result file names no absolute path of the machine)."""
    from gc_moe_compat.deep_ep._compiled_host import host_path
    from gc_moe_compat.runtime.jit import cache_dir

    report = host_path()
    return f"{report['host_path']} ({report['reason']})".replace(str(cache_dir()), "<cache dir>")


def _facade() -> ModuleType:
    import gc_moe_compat.deep_ep as facade

    return facade


def spread(point: Mapping[str, Any], key: str) -> str:
    """``key``'s spread between the point's rounds for its log line ("" with one round)."""
    rounds = point.get("rounds_us", {}).get(key, [])
    return f", rounds {point['round_spread_pct'][key]:.1f} % apart" if len(rounds) > 1 else ""


def record_point(out: JobFile | None, point: dict[str, object] | None) -> None:
    """Rank 0 keeps the point and prints its line (the full log)."""
    if out is None or point is None:
        return
    out.add_point(point)
    lat, host = point["latency_us"], point["host_us"]
    print(f"[{time.monotonic() - _STARTED:.1f} s] {point['job']} {point['preset']} T={point['tokens_per_rank']}: " +
          ", ".join(f"{key} {us:.1f} us (host {host[key]:.1f}{spread(point, key)})" for key, us in lat.items()) +
          f" | mismatches {point['accuracy'].get('mismatch', {})}", flush=True)
    for rank, ops in enumerate(point.get("phases") or []):
        for op, marks in (ops or {}).items():
            print(f"  phases rank {rank} {op}: median CTA " +
                  " / ".join(f"{m} {us:.1f}" for m, us in marks["median_us"].items()) +
                  f" us; latest CTA's exit {marks['latest_us']['exit']:.1f} us", flush=True)


# -- timing ------------------------------------------------------------------------------------------------------------


def barrier() -> None:
    dist.barrier()


def aligned_start(fn: Callable[[], object]) -> Callable[[], None]:
    """What runs before each eager window, after the L2 flush and the device synchronization: the gloo barrier, then
    one untimed call of ``fn``, not waited for. The window's start event and calls queue behind that call, whose own
    exchange waits for every rank on the GPU, so every rank's window starts when the ranks' GPUs leave it together;
    the gloo barrier alone releases the processes at the host's pace, and the first exchange of a short window would
    wait out their skew inside the timed window. The window's first call then finds that call's data in the L2, as
    its later calls find their predecessors'."""

    def start() -> None:
        barrier()
        fn()

    return start


def eager_us(fn: Callable[[], object], args: argparse.Namespace) -> tuple[float, float]:
    """(GPU µs, host µs) per call of ``fn``: windows of ``--calls`` eager calls, the median window's CUDA-event time
    and the median host time of issuing them (no synchronization inside the window), each window started together
    on every rank (:func:`aligned_start`)."""

    def window() -> None:
        for _ in range(args.calls):
            fn()

    device, host = timed_windows(window, args.warmup, args.windows, before_window=aligned_start(fn),
                                 launches=args.calls)
    return statistics.median(device), host


def maybe_trace(job: Job, mode: str, shape: str, tokens: int, impl: str, rank: int,
                calls: Mapping[str, Callable[[], object]]) -> None:
    """With ``--trace``, at ``--trace-tokens``: this rank's Kineto trace of ``calls`` (bench/_call_trace.py) and its
    summary beside it (``.txt``), named after the point, the implementation and the rank."""
    args = job.args
    if args.trace is None or tokens not in args.trace_tokens:
        return
    path = args.trace / f"{mode}_P{job.ranks}_{shape}_T{tokens}_{impl}_rank{rank}.json"

    def sync() -> None:
        torch.cuda.synchronize()
        barrier()

    trace_calls(calls, path, sync)
    path.with_suffix(".txt").write_text("\n".join(summarize_file(path)) + "\n")


def graph_us(fn: Callable[[], object], args: argparse.Namespace) -> float:
    """µs per call of ``fn`` replayed from a CUDA graph of two calls: DeepEP's low-latency calls alternate between
    two buffers and each cleans the other one, so a graph of one call would reuse an uncleaned buffer at every
    replay."""
    graph = capture_graph(lambda: (fn(), fn()))
    try:
        return median_graph_window(graph, args.warmup, args.windows, before_window=barrier) / 2
    finally:
        del graph
        torch.cuda.synchronize()


def rank_record(record: dict[str, Any], impls: Sequence[str],
                outputs_of: Callable[[str], tuple[dict[str, Any], dict[str, Callable[[], object]]]],
                ops: Sequence[str], args: argparse.Namespace,
                after: Callable[[str, Mapping[str, Callable[[], object]]], None], graph: bool) -> dict[str, Any]:
    """This rank's part of one point in either mode, filled into ``record``: each implementation's outputs and calls
    (``outputs_of(impl)``), their timed rounds (:func:`timed_rounds`), then ``after(impl, calls)`` (traces, phases)
    and the comparison. An implementation that raises is recorded under ``errors`` and the run goes on."""
    errors: dict[str, str] = record.setdefault("errors", {})
    outputs, calls = {}, {}
    for impl in impls:
        try:
            outputs[impl], calls[impl] = outputs_of(impl)
        except Exception as exc:  # recorded, the run goes on
            errors[impl] = f"{type(exc).__name__}: {exc}"
    record |= timed_rounds(calls, ops, args, errors, graph=graph)
    for impl, fns in calls.items():
        if impl in errors:
            continue
        try:
            after(impl, fns)
        except Exception as exc:  # recorded, the run goes on
            errors[impl] = f"{type(exc).__name__}: {exc}"
    if len(outputs) == 2:
        record["accuracy"] = compare(outputs["facade"], outputs["original"])
    return record


def timed_rounds(calls: Mapping[str, Mapping[str, Callable[[], object]]], ops: Sequence[str],
                 args: argparse.Namespace, errors: dict[str, str], graph: bool) -> dict[str, dict[str, Any]]:
    """This rank's timings of every implementation's ``ops`` (``calls[impl][op]``; with ``graph`` also
    ``calls[impl]["graph:" + op]`` replayed): ``--rounds`` rounds, each timing every implementation in turn, their
    order reversed every other round, so that drift of the shared GPU (the other ranks' processes, clocks) reaches
    both alike and neither always follows the other. Returns ``latency_us`` / ``host_us`` (/ ``graph_us``): the
    median round's figure per ``impl/op``, and ``rounds_us``: each round's GPU time (eager). An implementation that
    raises is recorded in ``errors`` and left out of the later rounds."""
    measures = ("latency_us", "host_us", "graph_us") if graph else ("latency_us", "host_us")
    rounds: dict[str, dict[str, list[float]]] = {m: {} for m in measures}
    live = [impl for impl in calls if impl not in errors]
    for r in range(args.rounds):
        for impl in live if r % 2 == 0 else live[::-1]:
            if impl in errors:
                continue
            try:
                for op in ops:  # the eager calls first, then the graphs (DeepEP's buffers alternate between calls)
                    gpu, host = eager_us(calls[impl][op], args)
                    rounds["latency_us"].setdefault(f"{impl}/{op}", []).append(gpu)
                    rounds["host_us"].setdefault(f"{impl}/{op}", []).append(host)
                for op in ops if graph else ():
                    rounds["graph_us"].setdefault(f"{impl}/{op}", []).append(graph_us(calls[impl][f"graph:{op}"], args))
            except Exception as exc:  # recorded, the run goes on
                errors[impl] = f"{type(exc).__name__}: {exc}"
    done = {m: {k: v for k, v in figures.items() if k.split("/")[0] not in errors} for m, figures in rounds.items()}
    return {m: {k: statistics.median(v) for k, v in figures.items()} for m, figures in done.items()} | {
        "rounds_us": done["latency_us"]}


# -- comparisons -------------------------------------------------------------------------------------------------------


def mismatch(a: object, b: object, chunk: int = 1 << 24) -> str | None:
    """None when ``a`` and ``b`` are bit-identical (tensors: shape, dtype and every byte, NaNs included; else
    ``==``), else what differs (for tensors: how many elements' bits, compared ``chunk`` elements at a time)."""
    tensors = isinstance(a, torch.Tensor) + isinstance(b, torch.Tensor)
    if tensors == 1:
        return f"{type(a).__name__} != {type(b).__name__}"
    if tensors == 0:
        return None if a == b else f"{a!r} != {b!r}"
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{a.dtype} {list(a.shape)} != {b.dtype} {list(b.shape)}"
    width = a.element_size()
    ab = a.contiguous().reshape(-1).view(torch.uint8).view(-1, width)
    bb = b.to(a.device).contiguous().reshape(-1).view(torch.uint8).view(-1, width)
    # in slices: a whole P = 8, T = 8192 receive compared at once took 2.3 GiB more than an 80 GB card had left
    differ = sum(int((ab[i:i + chunk] != bb[i:i + chunk]).any(dim=1).sum()) for i in range(0, ab.shape[0], chunk))
    return None if differ == 0 else f"{differ} of {a.numel()} elements differ"


def compare(facade: Mapping[str, object], original: Mapping[str, object]) -> dict[str, object]:
    """``{"exact": [fields bit-identical], "mismatch": {field: what differs}}`` over the fields both record."""
    exact, differ = [], {}
    for name in facade:
        if name not in original:
            continue
        why = mismatch(facade[name], original[name])
        if why is None:
            exact.append(name)
        else:
            differ[name] = why
    return {"exact": exact, "mismatch": differ}


def slowest(records: Sequence[Mapping[str, Any]], key: str) -> dict[str, float]:
    """Per timed call, the slowest rank's figure of ``key`` (records without it, e.g. a failed implementation, are
    skipped)."""
    names = dict.fromkeys(name for r in records for name in r.get(key, {}))
    return {name: slowest_rank([r[key][name] for r in records if name in r.get(key, {})]) for name in names}


def slowest_rounds(records: Sequence[Mapping[str, Any]]) -> dict[str, list[float]]:
    """Per timed call, the slowest rank's GPU time in each round (every rank that timed the call ran every round)."""
    names = dict.fromkeys(name for r in records for name in r.get("rounds_us", {}))
    return {name: [slowest_rank(list(figures)) for figures in
                   zip(*(r["rounds_us"][name] for r in records if name in r.get("rounds_us", {})), strict=True)]
            for name in names}


def round_spread_pct(figures: Sequence[float]) -> float:
    """How far apart a point's rounds are: (slowest - fastest) / fastest, in percent (0 for one round)."""
    return (max(figures) - min(figures)) / min(figures) * 100 if figures else 0.0


def assemble_point(base: dict[str, object], records: Sequence[Mapping[str, Any]], floor_us: Mapping[str, float],
                   ops: Sequence[str], original: str) -> dict[str, object]:
    """One result point from every rank's record: slowest-rank latencies (``impl/op`` keys), per-rank figures, the
    floor per op, the speedup (original over facade, > 1: the facade is faster), the comparison (rank 0's exact
    fields; every rank's mismatches, the other ranks' under their rank) and what became of the original."""
    latency, host, graph = slowest(records, "latency_us"), slowest(records, "host_us"), slowest(records, "graph_us")
    rounds = slowest_rounds(records)
    speedup = {op: latency[f"original/{op}"] / latency[f"facade/{op}"] for op in ops
               if f"original/{op}" in latency and f"facade/{op}" in latency}
    graph_speedup = {op: graph[f"original/{op}"] / graph[f"facade/{op}"] for op in ops
                     if f"original/{op}" in graph and f"facade/{op}" in graph}
    first = records[0].get("accuracy")
    accuracy = {} if first is None else {"exact": list(first["exact"]), "mismatch": dict(first["mismatch"])}
    for r, rec in enumerate(records[1:], start=1):
        for name, why in rec.get("accuracy", {}).get("mismatch", {}).items():
            accuracy.setdefault("mismatch", {})[f"rank {r}: {name}"] = why
    errors = {f"rank {r}: {k}": v for r, rec in enumerate(records) for k, v in rec.get("errors", {}).items()}
    if any("phases" in rec for rec in records):
        base = base | {"phases": [rec.get("phases") for rec in records]}
    return base | {"latency_us": latency, "host_us": host, "graph_us": graph,
                   "per_rank_us": {k: [r.get("latency_us", {}).get(k) for r in records] for k in latency},
                   "rounds_us": rounds, "round_spread_pct": {k: round_spread_pct(v) for k, v in rounds.items()},
                   "floor_us": dict(floor_us), "speedup": speedup, "graph_speedup": graph_speedup,
                   "accuracy": accuracy, "errors": errors, "original": original}


# -- normal mode -------------------------------------------------------------------------------------------------------


def normal_seed(shape: str, tokens: int, rank: int) -> int:
    return 1_000 * tokens + 17 * SHAPES[shape].hidden + SHAPES[shape].experts + 7_919 * rank


HANDLE_FIELDS = ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix", "recv_src_idx",
                 "is_token_in_rank", "send_head")


def normal_num_sms(requested: int, ranks: int, total_sms: int) -> int:
    """``Config.num_sms`` of both implementations at ``ranks`` ranks on one ``total_sms``-SM GPU: ``requested``, at
    most the rank's even share of the SMs (:func:`~gc_moe_compat.runtime.split.shared_device_sms`, the facade's own
    grid bound there). As on P GPUs of their own, every rank's kernels then fit the GPU together: DeepEP's intranode
    kernels (one 768-thread CTA per SM) spin on their peers' CTAs, and 8 ranks x 24 of them would not all be resident
    on an H200's 132 SMs."""
    return min(requested, shared_device_sms(total_sms, ranks, MIN_DISPATCH_SMS))


def normal_outputs(buf: Any, module: ModuleType, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                   experts: int, rank: int, num_sms: int) -> tuple[dict[str, object], dict[str, Callable[[], object]]]:
    """One implementation's outputs on these inputs (what the comparison reads) and its three timed calls."""
    config = module.Config(num_sms, 8, 256)
    layout = dispatch_kwargs(buf, idx, w, experts, config)
    x8 = fp8_rows(x)
    recv, recv_idx, recv_w, counts, handle, _ = buf.dispatch(x, **layout)
    (recv8, recv8_scales), *_ = buf.dispatch(x8, **layout)
    rows = (recv.float() * (rank + 1.5)).to(torch.bfloat16)
    combined, combined_w, _ = buf.combine(rows, handle, topk_weights=recv_w, config=config)
    torch.cuda.synchronize()
    got: dict[str, object] = {"num_tokens_per_rank": layout["num_tokens_per_rank"],
                              "num_tokens_per_expert": layout["num_tokens_per_expert"],
                              "is_token_in_rank (layout)": layout["is_token_in_rank"], "recv_x": recv,
                              "recv_x_fp8": recv8,
                              "recv_x_fp8_scales": recv8_scales, "recv_topk_idx": recv_idx,
                              "recv_topk_weights": recv_w, "num_recv_tokens_per_expert": list(counts),
                              "combined_x": combined, "combined_topk_weights": combined_w}
    got |= dict(zip(HANDLE_FIELDS, handle, strict=True))
    got["rank_prefix_matrix"] = handle[0][:, rank]  # DeepEP fills the receiver's column only
    calls = {"dispatch_bf16": functools.partial(buf.dispatch, x, **layout),
             "dispatch_fp8": functools.partial(buf.dispatch, x8, **layout),
             "combine": functools.partial(buf.combine, rows, handle, topk_weights=recv_w, config=config)}
    return got, calls


def normal_rank_record(rank: int, device: torch.device, job: Job, impls: Mapping[str, Any], shape: str,
                       tokens: int, num_sms: int) -> dict[str, Any]:
    """This rank's part of one normal-mode point: each implementation's outputs and timings (``Config(num_sms, 8,
    256)``), their comparison."""
    s = SHAPES[shape]
    x, idx, w = (t.to(device) for t in routing(tokens, s.hidden, s.topk, s.experts, normal_seed(shape, tokens, rank)))
    record: dict[str, Any] = {}

    def outputs_of(impl: str) -> tuple[dict[str, Any], dict[str, Callable[[], object]]]:
        module, buf = impls[impl]
        got, calls = normal_outputs(buf, module, x, idx, w, s.experts, rank, num_sms)
        record["recv_rows"] = got["recv_x"].shape[0]
        return got, calls

    def after(impl: str, calls: Mapping[str, Callable[[], object]]) -> None:
        maybe_trace(job, "normal", shape, tokens, impl, rank, calls)
        if impl == "facade" and job.args.phases:
            record["phases"] = normal_phases(device, calls, job.args.phases)

    return rank_record(record, list(impls), outputs_of, NORMAL_OPS, job.args, after, graph=False)


def normal_phases(device: torch.device, calls: Mapping[str, Callable[[], object]], count: int) -> dict[str, object]:
    """``count`` calls of each op on the phase-timed kernels, each read back (bench/_ep_normal_phases.py): per op the
    marks' summary. Every rank makes the same calls in the same order (each is collective)."""
    with _ep_normal_phases.variant(device) as times:
        return {op: _ep_normal_phases.summary(
            [times.timed(fn, "combine" if op == "combine" else "dispatch") for _ in range(count)])
            for op, fn in calls.items()}


def normal_floor_us(recv_rows: Sequence[int], hidden: int, bandwidth: float) -> dict[str, float]:
    """Every rank's received rows copied once (read + written) over the one GPU's copy bandwidth: the ranks share it."""
    bf16 = sum(payload_bytes(n, hidden, fp8=False) for n in recv_rows)
    fp8 = sum(payload_bytes(n, hidden, fp8=True) for n in recv_rows)
    return {"dispatch_bf16": 2 * bf16 / bandwidth * 1e6, "dispatch_fp8": 2 * fp8 / bandwidth * 1e6,
            "combine": 2 * bf16 / bandwidth * 1e6}


def build_buffers(modules: Mapping[str, ModuleType], make: Callable[[ModuleType], Any],
                  status: str | None) -> tuple[dict[str, tuple[ModuleType, Any]], str | None]:
    """``make(module)``'s Buffer per implementation, and what became of the original: ``measured``, ``status`` where
    it is not among ``modules``, or ``did not start: <error>`` where its Buffer raised (the facade's error
    propagates: without it there is nothing to measure)."""
    impls = {}
    for impl, module in modules.items():
        try:
            impls[impl] = (module, make(module))
        except Exception as exc:
            if impl == "facade":
                raise
            status = f"did not start: {type(exc).__name__}: {exc}"
    return impls, "measured" if "original" in impls else status


def run_normal(rank: int, device: torch.device, job: Job, modules: Mapping[str, ModuleType], bandwidth: float,
               out: JobFile | None, original: str | None) -> None:
    args = job.args
    num_sms = normal_num_sms(args.num_sms, job.ranks, torch.cuda.get_device_properties(device).multi_processor_count)
    nvl = max(normal_nvl_bytes(SHAPES[s].hidden, max(args.tokens), job.ranks, num_sms) for s in args.shapes)
    impls, status = build_buffers(
        modules, lambda module: module.Buffer(dist.group.WORLD, nvl, 0, explicitly_destroy=True), original)
    for shape in args.shapes:
        s = SHAPES[shape]
        for tokens in args.tokens:
            records = gather(normal_rank_record(rank, device, job, impls, shape, tokens, num_sms))
            base = {"mode": "normal", "job": job_name("normal", job.ranks), "case": job_name("normal", job.ranks),
                    "world_size": job.ranks, "preset": shape, "tokens_per_rank": tokens, "hidden": s.hidden,
                    "topk": s.topk, "num_experts": s.experts, "config": f"Config({num_sms}, 8, 256)",
                    "recv_rows": [r.get("recv_rows") for r in records]}
            rows = [r.get("recv_rows") or 0 for r in records]
            floor = normal_floor_us(rows, s.hidden, bandwidth)
            record_point(out, assemble_point(base, records, floor, NORMAL_OPS, status) if rank == 0 else None)
    for _, buf in impls.values():
        buf.destroy()
    torch.cuda.empty_cache()


# -- low-latency mode --------------------------------------------------------------------------------------------------


def size_static_heap(nbytes: int, environ: MutableMapping[str, str] | None = None) -> None:
    """Where NVSHMEM's symmetric heap is static (``NVSHMEM_DISABLE_CUDA_VMM=1``) it holds ``NVSHMEM_SYMMETRIC_SIZE``
    bytes, 1 GiB by default, less than a low-latency Buffer of Tmax 256 at hidden 7168 (~3.8 GB): the allocation
    then comes back null and DeepEP's ``cudaMemset`` of it fails ('invalid argument'). Set it to ``nbytes`` (the
    Buffer's RDMA bytes) plus the default again for NVSHMEM's own allocations, unless the try sets it; before the
    Buffer initializes NVSHMEM, in the rank's process (``environ``: ``os.environ`` by default)."""
    env = os.environ if environ is None else environ
    if env.get("NVSHMEM_DISABLE_CUDA_VMM") == "1" and "NVSHMEM_SYMMETRIC_SIZE" not in env:
        env["NVSHMEM_SYMMETRIC_SIZE"] = str(nbytes + NVSHMEM_DEFAULT_HEAP)


def ll_rdma_bytes(module: ModuleType, ranks: int, tmax: int, shapes: Sequence[Shape]) -> int:
    """``module``'s low-latency size hint, the largest over ``shapes``."""
    return max(module.Buffer.get_low_latency_rdma_size_hint(tmax, s.hidden, ranks, s.experts) for s in shapes)


def ll_buffer(module: ModuleType, ranks: int, tmax: int, shapes: Sequence[Shape]) -> Any:
    """One low-latency Buffer of ``module`` for every shape: its own size hint's largest, as many QPs per rank as
    the most local experts (DeepEP's test)."""
    hint = ll_rdma_bytes(module, ranks, tmax, shapes)
    qps = max(s.experts // ranks for s in shapes)
    return module.Buffer(dist.group.WORLD, 0, hint, low_latency_mode=True, num_qps_per_rank=qps,
                         explicitly_destroy=True)


def clean_ll_buffers(impls: Mapping[str, tuple[ModuleType, Any]], tmax: int, shape: Shape) -> None:
    """``clean_low_latency_buffer`` for the next shape, on every rank: DeepEP's signalling words sit after data
    regions whose sizes depend on hidden and experts, so a new shape's words start where the last one's data was
    (the facade's call only checks the sizes: its words are generation-tagged)."""
    for _, buf in impls.values():
        buf.clean_low_latency_buffer(tmax, shape.hidden, shape.experts)
    torch.cuda.synchronize()
    dist.barrier()


def ll_row_sources(count: torch.Tensor, src_info: torch.Tensor, layout_range: torch.Tensor,
                   tokens: int) -> list[torch.Tensor]:
    """Per local expert, the flat (source rank * ``tokens`` + token) of each valid received row, in receive order.

    DeepEP's handle: ``src_info [e, P*Tmax]`` the source token of each row, ``layout_range [e, P]`` per source rank
    ``(first row << 32) | rows``; rows ``[0, count[e])`` are valid."""
    count, src_info, layout_range = count.cpu(), src_info.cpu(), layout_range.cpu()
    out = []
    for e in range(count.shape[0]):
        n = int(count[e])
        source = torch.full((n,), -1, dtype=torch.int64, device="cpu")
        for r, packed in enumerate(layout_range[e].tolist()):
            begin, rows = packed >> 32, packed & 0xFFFFFFFF
            source[begin:begin + rows] = r
        out.append(source * tokens + src_info[e, :n].to(torch.int64))
    return out


def ll_received(recv: tuple[torch.Tensor, torch.Tensor], count: torch.Tensor,
                sources: Sequence[torch.Tensor]) -> dict[str, object]:
    """One implementation's received rows (FP8 payload and scales) in a canonical order, by (source rank, token)
    within each expert (:func:`ll_row_sources`), for the comparison: DeepEP orders the rows of one source rank by its
    atomics, the facade by token."""
    payload, scales = recv
    order = [torch.sort(s).indices.to(payload.device) for s in sources]
    return {"recv_count": count.cpu(), "row_sources": torch.cat([torch.sort(s).values for s in sources]),
            "recv_x": torch.cat([payload[e, :len(o)][o] for e, o in enumerate(order)]),
            "recv_x_scales": torch.cat([scales[e, :len(o)][o] for e, o in enumerate(order)])}


def ll_expert_rows(sources: Sequence[torch.Tensor], x_all: torch.Tensor, rows_per_expert: int,
                   first_expert: int) -> torch.Tensor:
    """The stand-in expert output ``[e, P*Tmax, H]`` BF16 an implementation combines: each valid row is its source
    token (``x_all [P*T, H]``, indexed by flat source) times a factor of its global expert, so both implementations
    combine the same values whatever order they received the rows in; rows past the count are zero."""
    out = torch.zeros((len(sources), rows_per_expert, x_all.shape[1]), dtype=torch.bfloat16, device=x_all.device)
    for e, source in enumerate(sources):
        factor = 1 + ((first_expert + e) % 7) / 8
        out[e, :source.numel()] = (x_all[source.to(x_all.device)].float() * factor).to(torch.bfloat16)
    return out


def ll_seed(shape: str, tokens: int, rank: int) -> int:
    return 31 * tokens + SHAPES[shape].hidden + SHAPES[shape].experts + 7_919 * rank + 1


def ll_outputs(buf: Any, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, x_all: torch.Tensor, shape: Shape,
               job: Job, rank: int) -> tuple[dict[str, object], dict[str, Callable[[], object]]]:
    """One implementation's eager dispatch (received rows in canonical order) and combine of the stand-in expert
    rows, and its timed calls: eager, and (``graph:`` keys) what is captured, the combine writing into one ``out``."""
    tmax, tokens = job.args.ll_tmax, x.shape[0]
    dispatch = functools.partial(buf.low_latency_dispatch, x, idx, tmax, shape.experts)
    recv, count, handle, _, _ = dispatch()
    torch.cuda.synchronize()
    sources = ll_row_sources(count, handle[0], handle[1], tokens)
    got = ll_received(recv, count, sources)
    local = shape.experts // job.ranks
    rows = ll_expert_rows(sources, x_all, job.ranks * tmax, rank * local)
    got["combined_x"] = buf.low_latency_combine(rows, idx, w, handle)[0].clone()
    torch.cuda.synchronize()
    out = torch.empty((tokens, shape.hidden), dtype=torch.bfloat16, device=x.device)
    calls = {"dispatch": dispatch, "combine": functools.partial(buf.low_latency_combine, rows, idx, w, handle)}
    captured = {"dispatch": dispatch, "combine": functools.partial(buf.low_latency_combine, rows, idx, w, handle,
                                                                   out=out)}
    return got, calls | {f"graph:{op}": fn for op, fn in captured.items()}


def ll_rank_record(rank: int, device: torch.device, job: Job, impls: Mapping[str, Any], shape: str,
                   tokens: int) -> dict[str, Any]:
    """This rank's part of one low-latency point: every rank's seeded tokens (the stand-in expert rows are built from
    them), each implementation's outputs, eager and graph timings, their comparison."""
    s = SHAPES[shape]
    inputs = [routing(tokens, s.hidden, s.topk, s.experts, ll_seed(shape, tokens, r)) for r in range(job.ranks)]
    x_all = torch.cat([x for x, _, _ in inputs]).to(device)
    x, idx, w = (t.to(device) for t in inputs[rank])
    record: dict[str, Any] = {}

    def outputs_of(impl: str) -> tuple[dict[str, Any], dict[str, Callable[[], object]]]:
        got, calls = ll_outputs(impls[impl][1], x, idx, w, x_all, s, job, rank)
        record["recv_rows"] = int(got["recv_count"].sum())
        return got, calls

    def after(impl: str, calls: Mapping[str, Callable[[], object]]) -> None:
        maybe_trace(job, "low_latency", shape, tokens, impl, rank, {op: calls[op] for op in LL_OPS})
        if impl == "facade" and job.args.phases:
            record["phases"] = ll_phases(device, calls, job.args.phases)

    return rank_record(record, list(impls), outputs_of, LL_OPS, job.args, after, graph=True)


def ll_phases(device: torch.device, calls: Mapping[str, Callable[[], object]], count: int) -> dict[str, object]:
    """``count`` eager calls of each low-latency op on the phase-timed kernels, each read back
    (bench/_ep_ll_phases.py): per op the marks' summary, every CTA a mover (the one-rank checker CTA does not exist
    above one rank). Every rank makes the same calls in the same order (each is collective)."""
    with _ep_ll_phases.variant(device) as times:
        return {op: _ep_ll_phases.summary([times.timed(calls[op], op) for _ in range(count)], op, checker=False)
                for op in LL_OPS}


def ll_floor_us(ranks: int, tokens: int, shape: Shape, bandwidth: float) -> dict[str, float]:
    """Every rank's bytes of each op (:func:`deep_ep_sm90.ll_floor_bytes`) over the one GPU's copy bandwidth."""
    moved = ll_floor_bytes(tokens, shape.hidden, shape.topk)
    return {op: ranks * moved[op] / bandwidth * 1e6 for op in LL_OPS}


def run_low_latency(rank: int, device: torch.device, job: Job, modules: Mapping[str, ModuleType], bandwidth: float,
                    out: JobFile | None, original: str | None) -> None:
    args = job.args
    shapes = [SHAPES[s] for s in args.shapes]
    started = {impl: m for impl, m in modules.items() if impl == "facade" or job.ll_original_env is not None}
    if "original" in started:
        size_static_heap(ll_rdma_bytes(started["original"], job.ranks, args.ll_tmax, shapes))
    impls, status = build_buffers(started, lambda module: ll_buffer(module, job.ranks, args.ll_tmax, shapes),
                                  original if "original" not in modules else job.ll_status)
    for shape in args.shapes:
        s = SHAPES[shape]
        clean_ll_buffers(impls, args.ll_tmax, s)
        for tokens in args.ll_tokens:
            records = gather(ll_rank_record(rank, device, job, impls, shape, tokens))
            base = {"mode": "low_latency", "job": job_name("low_latency", job.ranks),
                    "case": job_name("low_latency", job.ranks), "world_size": job.ranks, "preset": shape,
                    "tokens_per_rank": tokens, "hidden": s.hidden, "topk": s.topk, "num_experts": s.experts,
                    "max_dispatch_tokens_per_rank": args.ll_tmax, "recv_rows": [r.get("recv_rows") for r in records]}
            floor = ll_floor_us(job.ranks, tokens, s, bandwidth)
            record_point(out, assemble_point(base, records, floor, LL_OPS, status) if rank == 0 else None)


# -- the result file, the PNG, the table -------------------------------------------------------------------------------


def write_results(args: argparse.Namespace, points: list[dict[str, object]], jobs: dict[str, object],
                  original: dict[str, object]) -> None:
    """The result file (protocol meta, the points so far, which (mode, P) parts finished) and its PNG."""
    partition = {"dispatch_sms": None, "compute_sms": None, "workqueue": None,
                 "note": "ranks share the GPU: the facade's green partition is off (jobs.<P>.partition)"}
    meta = result_meta("bench/deep_ep_ab.py", sys.argv[1:], partition, world_size=max(args.ranks))
    meta |= {"world_sizes": list(args.ranks), "gpu_setup_per_world_size": {p: gpu_setup(p) for p in args.ranks},
             "shared_gpu_label": colocation.SHARED_GPU_LABEL, "original_deep_ep": original, "jobs": jobs,
             "shapes": {name: vars(SHAPES[name]) for name in args.shapes},
             "normal_config": f"Config(min({args.num_sms}, the rank's even SM share), 8, 256): each point's config",
             "max_dispatch_tokens_per_rank": args.ll_tmax,
             "all_to_all": ALL_TO_ALL_NOTE,
             "timing": {"warmup_windows": args.warmup, "windows": args.windows, "calls_per_window": args.calls,
                        "rounds": args.rounds,
                        "rounds_us": "each round's GPU time (slowest rank per round); the implementations alternate "
                                     "within a round, their order reversed every other round; a point's figures "
                                     "are the median round's; round_spread_pct: (slowest - fastest) / fastest",
                        "latency_us": "GPU time per call: CUDA events around a window of eager calls (normal: "
                                      "includes DeepEP's CPU wait inside the uncached dispatch)",
                        "host_us": "perf_counter around the same window, per call, nothing synchronized inside",
                        "graph_us": f"low-latency only: CUDA graph of 2 calls, {PER_WINDOW} replays per window, "
                                    "per call; normal mode cannot be captured (the uncached dispatch waits on the "
                                    "CPU)",
                        "point": "slowest rank's median window; windows started together (L2 flush, gloo "
                                 "barrier; eager: then one untimed call the window queues behind)"},
             "floor": "every rank's bytes moved once (read + written) over the one GPU's copy bandwidth "
                      "(jobs.<P>.copy_bandwidth_Bps): the ranks share it"}
    write_partial_result(args.out, meta, points, unit="jobs", key="job", requested=requested_jobs(args))
    plot(points, args.out.with_suffix(".png"), meta["gpu"])


def pair_us(point: Mapping[str, Any], impl: str) -> float | None:
    """What the PNG draws per point: one dispatch plus one combine of ``impl`` (low-latency: graph replays; normal:
    the BF16 dispatch, eager), or None where it was not measured."""
    source, ops = (point["graph_us"], LL_OPS) if point["mode"] == "low_latency" else \
        (point["latency_us"], ("dispatch_bf16", "combine"))
    keys = [f"{impl}/{op}" for op in ops]
    return sum(source[k] for k in keys) if all(k in source for k in keys) else None


def plot(points: Sequence[Mapping[str, Any]], path: Path, gpu: str) -> None:
    """One panel per mode: dispatch + combine time per call against tokens per rank, the facade (solid) against the
    original (dashed) per rank count, for the first shape measured in that mode; titled as a shared-GPU figure."""
    plt = pyplot()
    if plt is None:
        return
    modes = [m for m in MODES if any(p["mode"] == m for p in points)] or list(MODES)
    fig, axes = plt.subplots(1, len(modes), figsize=(6.2 * len(modes), 4.6), squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=True):
        mine = [p for p in points if p["mode"] == mode]
        shape = mine[0]["preset"] if mine else None
        for ranks in sorted({p["world_size"] for p in mine}):
            for impl, style in zip(IMPLS, ("-", "--"), strict=True):
                pts = [(p["tokens_per_rank"], pair_us(p, impl)) for p in mine
                       if p["preset"] == shape and p["world_size"] == ranks]
                pts = [(t, us) for t, us in pts if us is not None]
                if pts:
                    ax.plot(*zip(*pts, strict=True), style, marker="o", label=f"{impl}, P={ranks}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel("dispatch + combine per call (µs)")
        what = "CUDA-graph replay" if mode == "low_latency" else "eager, BF16 dispatch"
        ax.set_title(f"{mode}: {SHAPES[shape].label if shape else 'not measured'}\n({what})", fontsize=9)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(f"deep_ep facade vs original DeepEP on one {gpu}: P {colocation.SHARED_GPU_LABEL}\n"
                 "(shared-GPU figures, not NVLink ones)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def table_lines(points: Sequence[Mapping[str, Any]]) -> list[str]:
    """The compact table printed last: one row per point and op, both implementations' GPU, host and graph time,
    the speedup (original / facade GPU time: > 1, the facade is faster) and the mismatching fields."""
    lines = ["| job | shape | T | op | facade us | original us | orig/facade | facade host | original host | "
             "facade graph | original graph | mismatches |", "|" + "---|" * 12]
    for p in points:
        ops = LL_OPS if p["mode"] == "low_latency" else NORMAL_OPS
        lat, host, graph = p["latency_us"], p["host_us"], p.get("graph_us", {})
        wrong = ", ".join(p["accuracy"].get("mismatch", {})) or ("none" if p["accuracy"] else "no comparison")
        for op in ops:
            f, o = f"facade/{op}", f"original/{op}"
            ratio = p["speedup"].get(op)
            lines.append(f"| {p['job']} | {p['preset']} | {p['tokens_per_rank']} | {op} | {_us(lat.get(f))} | "
                         f"{_us(lat.get(o))} | {'-' if ratio is None else f'{ratio:.2f}'} | {_us(host.get(f))} | "
                         f"{_us(host.get(o))} | {_us(graph.get(f))} | {_us(graph.get(o))} | {wrong} |")
    return lines


# -- the launcher ------------------------------------------------------------------------------------------------------


def run_rank_count(ranks: int, args: argparse.Namespace, origin: str | None, workdir: Path,
                   ll_failed: str | None) -> tuple[Outcome, str]:
    """Probe the original's low-latency mode (unless an earlier P found it does not start), then measure at
    ``ranks`` ranks; returns the outcome and the low-latency verdict."""
    ll_env, ll_status = None, "not measured (--modes)"
    if "low_latency" in args.modes:
        if args.no_original:
            ll_status = "not available: --no-original"
        elif origin is None:
            ll_status = "not available: no original deep_ep package on sys.path"
        elif ll_failed is not None:
            ll_status = f"{ll_failed} (at a smaller P; not retried)"
        else:
            ll_env, ll_status = probe_original_ll(ranks, args, workdir)
        print(f"P={ranks}: original low-latency mode {ll_status}", flush=True)
    job = Job("measure", ranks, free_port(), str(workdir / f"measure_P{ranks}.json"), args, not args.no_original,
              ll_env, ll_status)
    return run_job(job, args.job_timeout), ll_status


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    print("\n".join(plan_lines(args)), flush=True)
    if args.dry_run:
        return 0
    require_gpus("deep_ep_ab", hint="--dry-run prints the plan without one")
    origin = None if args.no_original else originals.location("deep_ep")
    original = source_info(origin)
    points: list[dict[str, object]] = []
    jobs: dict[str, object] = {}
    ll_failed = None
    root = original_root(origin)
    with tempfile.TemporaryDirectory(prefix="deep_ep_ab_") as tmp:
        for ranks in args.ranks:
            outcome, ll_status = run_rank_count(ranks, args, origin, Path(tmp), ll_failed)
            if ll_status.startswith("did not start"):
                ll_failed = ll_failed or ll_status
            points += [without_root(p, root) for p in outcome.data.get("points", [])]
            jobs[str(ranks)] = {"status": outcome.status(args.job_timeout), "seconds": round(outcome.seconds, 1),
                                "gpu_setup": gpu_setup(ranks), "low_latency_original": ll_status,
                                **outcome.data.get("info", {}),
                                **({"error": outcome.data["error"]} if "error" in outcome.data else {})}
            print(f"P={ranks}: {jobs[str(ranks)]['status']} in {outcome.seconds:.0f} s", flush=True)
            write_results(args, points, jobs, original)
    print("\n".join(table_lines(points)))
    for ranks, job in jobs.items():
        if "host_reference" in job:
            print(f"P={ranks}: host reference per rank (bare launch us, CPUs, quota): "
                  + "; ".join(f"{h['launch_us']} / {h['cpus']} / {h['cpu_quota']}" for h in job["host_reference"]))
    return 0 if all(j["status"] == "finished" for j in jobs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
