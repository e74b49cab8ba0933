"""Where a graph of the standalone SM90 GEMMs loses time against its kernels timed apart (issue 4's FP8 misses).

At glm52 T=128 and dsv41-flash T=256 the graph of W1 -> W2 (bench/gemm_sm90.py's ``gc_fp8``) takes 10-25 µs more
than W1 and W2 each replayed alone (``latency_split_us``); with the sum of the two, both points would beat DeepGEMM's
pipeline. This script separates the candidate causes (what each run found: bench/README.md, session 8).
Per point (preset, T; default: the two misses and glm52 T=64, where the excess is small), FP8xFP8 with the
benchmark's config (:func:`gemm_sm90.point_config`), the parts (``--parts``, default all):

* ``sweep`` -> ``latency_us``: graphs of the kernel sequences [W1], [W2], [W1, W2], [W1, W1], [W2, W2], [W2, W1]
  (and DeepGEMM 2.8.2's two masked GEMMs on the same FP8 weights, ``dg_w1``, ``dg_w2``, where DeepGEMM loads), each
  timed like the benchmark (:func:`gemm_sm90.time_graph`, L2 flushed between windows, median window) at several
  replays per window;
  ``excess_us``: each two-kernel sequence minus the sum of its kernels alone at the same replays per window (the
  benchmark's split comparison), and ``matched_excess_us``: the same against its kernels alone at twice the replays,
  so that both sides launch as many kernels per window. An excess that vanishes when matched is the window length;
* ``trace``: TRACE_REPLAYS back-to-back replays of each sequence under the PyTorch profiler (CUPTI kernel records,
  no L2 flush): per kernel of the sequence its median duration and the median gap from the kernel before it, so
  that an excess shows as a longer kernel (which one) or a longer gap;
* ``probes``: traces of W1 after other kernels than W2 (the traces show W1 ~16 µs longer after W2 than after W1
  at glm52 T=128): after zeroing W2's output buffer (dirty lines of the same size in L2), after filling the L2
  with dirty lines, after reading 1 GiB (L2 and TLB turned over with clean lines), after a spin kernel that
  touches no memory (only the multiprocessors' own state changes), after W1 itself on one token per rank (same
  code and shared-memory size, little traffic), after DeepGEMM's W2; and DeepGEMM's W1 after our W2; then whether
  re-reading W1's token rows (``read_x``) or its weight and token scales (``read_sf``) into L2 after the dirty
  lines or the 1 GiB read gives W1 back the time it has after itself;
* ``series``: after half a second idle, one window of ~600 ms of one sequence with an event every SERIES_CHUNK
  replays, and ``nvidia-smi`` samples (SM clock, power draw, the SW power cap clock-event reason) every SAMPLE_MS
  over the same time (clocks are only read, never set): how the time per replay follows the clock under the cap.

Run on an H200: ``bash scripts/device_check.sh --bench-only --bench graph_gap_sm90``
(``python bench/graph_gap_sm90.py --out bench/results/graph_gap_sm90.json``); one part, e.g. the probes:
``--bench 'graph_gap_sm90 --parts probes'``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import NamedTuple

import torch
from _baseline_sm90 import import_deep_gemm
from _common import REPO, require_gpus, result_meta, write_result
from _gemm_workload import CLAMP, Layer, make_layer, make_tokens
from _grouping import GroupedTokens, group_tokens
from _standalone_gemm import ExpertGemmSM90, Workspace
from gemm_sm90 import capture, gemm_steps, point_config, time_graph

from gc_moe_compat.ab.timeline import traced_kernels
from gc_moe_compat.operator.heuristics import W1_SLABS, smem_bytes

SEQUENCES = ("w1", "w2", "w1+w2", "w1+w1", "w2+w2", "w2+w1")
DG_SEQUENCES = ("dg_w1", "dg_w2", "dg_w1+dg_w2")
PROBE_SEQUENCES = ("w1+w1", "w2+w1", "zero_out+w1", "fill_l2+w1", "read_big+w1", "spin+w1", "w1_tiny+w1",
                   "dg_w2+w1", "w2+dg_w1", "zero_out+read_x+w1", "zero_out+read_sf+w1", "read_big+read_x+w1",
                   "read_big+read_sf+w1")
SPIN_CYCLES = 20_000  # ~10 µs of torch.cuda._sleep
PARTS = ("sweep", "trace", "probes", "series")
SERIES_SEQUENCES = ("w1", "w1+w2", "dg_w1", "dg_w1+dg_w2")
DEFAULT_POINTS = ("glm52:128", "dsv41-flash:256", "glm52:64")
REPLAYS = (50, 100, 200, 400)  # per window; the benchmark's is 100
SAMPLE_MS = 10
SERIES_MS = 600
SERIES_CHUNK = 25  # replays per event of a series
IDLE_S = 0.5  # before a series, so that it starts from the clock an idle card ramps to
TRACE_REPLAYS = 50
REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")  # new and old nvidia-smi names
SW_POWER_CAP = 0x4  # NVML's clocks event reason bit: the SM clock is lowered to hold the power limit


class Sample(NamedTuple):
    """One ``nvidia-smi`` reading: host time (s since the epoch), SM clock (MHz), power draw (W), whether the SW
    power cap was holding the clock down (None where the driver does not report the reasons)."""

    t: float
    clock_mhz: float
    power_w: float
    power_capped: bool | None


@functools.cache
def reason_field(gpu: str) -> str | None:
    """The clock-event-reason field this driver's ``nvidia-smi`` accepts, or None."""
    for field in REASON_FIELDS:
        try:
            probe = subprocess.run(["nvidia-smi", f"--id={gpu}", f"--query-gpu={field}", "--format=csv,noheader"],
                                   capture_output=True, text=True, timeout=30)
        except OSError:
            return None
        if probe.returncode == 0 and probe.stdout.strip().startswith("0x"):
            return field
    return None


class GpuSampler:
    """``nvidia-smi`` reading one GPU's SM clock, power draw and power-cap reason every SAMPLE_MS while the block
    runs; ``samples()`` parses what it read, ``error`` says why there is nothing."""

    def __init__(self, gpu: str) -> None:
        self.gpu = gpu
        self.proc: subprocess.Popen[str] | None = None
        self.out = ""
        self.error: str | None = None

    def __enter__(self) -> GpuSampler:
        fields = ",".join(["timestamp", "clocks.sm", "power.draw"] + [f for f in [reason_field(self.gpu)] if f])
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", f"--id={self.gpu}", f"--query-gpu={fields}", "--format=csv,noheader,nounits",
                 f"--loop-ms={SAMPLE_MS}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError as err:
            self.error = f"nvidia-smi: {err}"
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.out = self.proc.communicate(timeout=10)[0]

    def samples(self) -> list[Sample]:
        return parse_samples(self.out)


def parse_samples(text: str) -> list[Sample]:
    """``nvidia-smi``'s "timestamp, clock, power[, reasons]" CSV lines (lines that do not parse are skipped)."""
    samples = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        try:
            t = datetime.datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            clock, power = float(fields[1]), float(fields[2])
            capped = bool(int(fields[3], 16) & SW_POWER_CAP) if len(fields) > 3 else None
        except (IndexError, ValueError):
            continue
        samples.append(Sample(t, clock, power, capped))
    return samples


def summarize(samples: list[Sample]) -> dict[str, object]:
    """Medians of the clock and power, the lowest clock, and the share of samples under the SW power cap."""
    if not samples:
        return {"unavailable": "no samples"}
    capped = [s.power_capped for s in samples if s.power_capped is not None]
    return {"samples": len(samples), "sm_clock_mhz_median": statistics.median(s.clock_mhz for s in samples),
            "sm_clock_mhz_min": min(s.clock_mhz for s in samples),
            "power_w_median": statistics.median(s.power_w for s in samples),
            "power_capped_share": sum(capped) / len(capped) if capped else None}


def excess(latency: dict[str, float], alone: dict[str, float] | None = None) -> dict[str, float]:
    """Each two-kernel sequence's time minus the sum of its kernels alone (from ``alone``, default ``latency``)."""
    alone = latency if alone is None else alone
    return {seq: latency[seq] - sum(alone[k] for k in seq.split("+")) for seq in latency if "+" in seq}


def window_excess(latency: dict[str, dict[int, float]]) -> tuple[dict[int, dict], dict[int, dict]]:
    """Per replays-per-window ``n``: :func:`excess` against the kernels alone at ``n`` (the benchmark's split
    comparison) and, where measured, at ``2 n`` (as many kernel launches per window on both sides)."""
    counts = sorted({n for per_n in latency.values() for n in per_n})
    at = {n: {seq: latency[seq][n] for seq in latency} for n in counts}
    same = {n: excess(at[n]) for n in counts}
    matched = {n: excess(at[n], at[2 * n]) for n in counts if 2 * n in at}
    return same, matched


def series_summary(chunks: list[tuple[float, float]], samples: list[tuple[float, float, float, bool | None]]
                   ) -> dict[str, object]:
    """A series' first chunk against its last quarter: µs per replay, SM clock and power-cap share (samples before
    the series, the idle second, are left out)."""
    end = chunks[-1][0]
    tail = [us for t, us in chunks if t >= 0.75 * end]
    running = [Sample(*s) for s in samples if 0.0 <= s[0] <= end]
    first = summarize([s for s in running if s.t <= 50.0])
    last = summarize([s for s in running if s.t >= 0.75 * end])
    return {"first_chunk_us": chunks[0][1], "last_quarter_us": statistics.mean(tail),
            "sm_clock_mhz_first_50ms": first.get("sm_clock_mhz_median"),
            "sm_clock_mhz_last_quarter": last.get("sm_clock_mhz_median"),
            "power_w_last_quarter": last.get("power_w_median"),
            "power_capped_share_last_quarter": last.get("power_capped_share")}


def replay_series(fn: Callable[[], None], latency_us: float, gpu: str) -> dict[str, object]:
    """One ~SERIES_MS window of graph replays of ``fn`` after IDLE_S idle: ``chunks`` as (ms since the window's
    start at the chunk's end, µs per replay), ``samples`` as (ms since the start, MHz, W, power-capped)."""
    graph = capture(fn)
    num_chunks = math.ceil(SERIES_MS * 1e3 / latency_us / SERIES_CHUNK)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(num_chunks + 1)]
    with GpuSampler(gpu) as sampler:
        torch.cuda.synchronize()
        time.sleep(IDLE_S)
        t0 = time.time()
        events[0].record()
        for event in events[1:]:
            for _ in range(SERIES_CHUNK):
                graph.replay()
            event.record()
        torch.cuda.synchronize()
        time.sleep(2 * SAMPLE_MS / 1e3)
    ends = [events[0].elapsed_time(e) for e in events[1:]]
    chunks = [(b, (b - a) * 1e3 / SERIES_CHUNK) for a, b in zip([0.0, *ends[:-1]], ends, strict=True)]
    samples = [((s.t - t0) * 1e3, s.clock_mhz, s.power_w, s.power_capped) for s in sampler.samples()]
    result: dict[str, object] = {"chunks": chunks, "samples": samples, "replays": num_chunks * SERIES_CHUNK}
    if sampler.error:
        result["sampler"] = sampler.error
    return result | {"summary": series_summary(chunks, samples)}


def kernel_trace(fn: Callable[[], None], trace_file: Path) -> list[tuple[float, float, str]]:
    """(start µs, duration µs, name) of every kernel of TRACE_REPLAYS replays of a graph of ``fn``, in start order,
    from the PyTorch profiler's trace (written to ``trace_file``)."""
    graph = capture(fn)
    for _ in range(5):
        graph.replay()
    return traced_kernels(graph, TRACE_REPLAYS, trace_file)


def trace_summary(kernels: list[tuple[float, float, str]], replays: int) -> dict[str, object]:
    """Per kernel position of one replay: its median duration and the median gap from the end of the kernel before
    it (the previous replay's last for the first); and the median replay period."""
    per_replay, left = divmod(len(kernels), replays)
    if left or not per_replay:
        return {"unavailable": f"{len(kernels)} kernel records for {replays} replays"}
    positions = []
    for i in range(per_replay):
        at = range(i, len(kernels), per_replay)
        gaps = [kernels[j][0] - kernels[j - 1][0] - kernels[j - 1][1] for j in at if j > 0]
        positions.append({"name": kernels[i][2][:80], "dur_us": statistics.median(kernels[j][1] for j in at),
                          "gap_before_us": statistics.median(gaps)})
    starts = [kernels[j][0] for j in range(0, len(kernels), per_replay)]
    period = [b - a for a, b in zip(starts[:-1], starts[1:], strict=True)]
    return {"kernels_per_replay": per_replay, "positions": positions, "replay_us": statistics.median(period)}


def visible_gpu() -> str:
    """The ``nvidia-smi`` id of torch's device 0: the first entry of CUDA_VISIBLE_DEVICES, else 0."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return visible or "0"


def probe_kernels(layer: Layer, grouped: GroupedTokens, gemm: ExpertGemmSM90, ws: Workspace
                  ) -> dict[str, Callable[[], object]]:
    """The kernels that the probes put before W1 (module docstring), by name."""
    fill = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    big = torch.zeros(1 << 29, dtype=torch.float16, device="cuda")
    tiny = make_tokens(layer, 1, seed=1)
    grouped_tiny = group_tokens(tiny.x_fp8, tiny.x_sf, tiny.topk_idx, tiny.topk_weights, layer.l1.num_experts,
                                grouped.bm)
    ws_tiny = gemm.run(grouped_tiny)
    return {"zero_out": ws.out.zero_, "fill_l2": fill.zero_, "read_big": big.max,
            "spin": lambda: torch.cuda._sleep(SPIN_CYCLES), "w1_tiny": lambda: gemm.run_w1(grouped_tiny, ws_tiny),
            "read_x": grouped.x.view(torch.uint8).max,
            "read_sf": lambda: (layer.prepared.w1_sf.max(), grouped.x_sf_t.max())}


def measure_point(preset: str, t: int, num_sms: int, gpu: str, warmup: int, windows: int,
                  dg: object | None, trace_dir: Path, parts: list[str]) -> dict[str, object]:
    """The ``parts`` (of PARTS) of one point, DeepGEMM's sequences too where ``dg`` is the loaded module: each
    sequence at each of REPLAYS per window with its GPU samples and the two-kernel excesses, the kernel traces
    (files under ``trace_dir``), the probes and the series."""
    layer = make_layer(preset, torch.device("cuda"), seed=1)
    tok = make_tokens(layer, t, seed=t)
    counts = torch.bincount(tok.topk_idx[tok.topk_idx >= 0], minlength=layer.l1.num_experts)
    cfg = point_config(layer, t, counts, num_sms)
    grouped = group_tokens(tok.x_fp8, tok.x_sf, tok.topk_idx, tok.topk_weights, layer.l1.num_experts, cfg.bm)
    gemm = ExpertGemmSM90(layer.prepared, cfg, activation_clamp=CLAMP)
    ws = gemm.run(grouped)  # W2 of every sequence reads a written intermediate
    kernels = gemm_steps(gemm, grouped, ws, layer, tok, dg)
    sequences = SEQUENCES + (DG_SEQUENCES if dg is not None else ())

    def run_sequence(seq: str) -> Callable[[], None]:
        steps = [kernels[k] for k in seq.split("+")]
        return lambda: [step() for step in steps]

    def traces(seqs: tuple[str, ...]) -> dict[str, object]:
        return {seq: trace_summary(kernel_trace(run_sequence(seq), trace_dir / f"{preset}_{t}_{seq}.json"),
                                   TRACE_REPLAYS) for seq in seqs if all(k in kernels for k in seq.split("+"))}

    point: dict[str, object] = {
        "preset": preset, "tokens_per_rank": t, "mma_type": "fp8xfp8",
        "config": {"bm": cfg.bm, "pipelined": cfg.pipelined, "cluster": cfg.cluster,
                   "stages": [cfg.stages_w1, cfg.stages_w2], "w2_slabs": cfg.w2_slabs,
                   "smem_bytes": [smem_bytes(cfg.bm, W1_SLABS, cfg.stages_w1),
                                  smem_bytes(cfg.bm, cfg.w2_slabs, cfg.stages_w2)]}}
    if "sweep" in parts:
        latency: dict[str, dict[int, float]] = {}
        samples = {}
        for seq in sequences:
            with GpuSampler(gpu) as sampler:
                latency[seq] = {n: time_graph(run_sequence(seq), warmup, windows, replays=n) for n in REPLAYS}
            samples[seq] = summarize(sampler.samples()) if sampler.error is None else {"unavailable": sampler.error}
        same, matched = window_excess(latency)
        point |= {"latency_us": latency, "excess_us": same, "matched_excess_us": matched, "gpu_samples": samples}
    if "trace" in parts:
        point["trace"] = traces(sequences)
    if "probes" in parts:
        kernels |= probe_kernels(layer, grouped, gemm, ws)
        point["probes"] = traces(PROBE_SEQUENCES)
    if "series" in parts:
        point["series"] = {seq: replay_series(run_sequence(seq), time_graph(run_sequence(seq), 1, 3), gpu)
                           for seq in SERIES_SEQUENCES if seq in sequences}
    gemm.check()
    return point


def report(spec: str, point: dict) -> str:
    """The point's lines of the printed table: excess per replays per window, split and matched, and each series'
    first chunk against its last quarter."""
    lines = [f"{spec} bm={point['config']['bm']}"]
    for n, row in point.get("excess_us", {}).items():
        matched = point["matched_excess_us"].get(n, {})
        lines.append(f"  {n:>3} replays: " + ", ".join(
            f"{seq} {v:+.1f}" + (f" (matched {matched[seq]:+.1f})" if seq in matched else "")
            for seq, v in row.items()))
    for part in ("trace", "probes"):
        for seq, tr in point.get(part, {}).items():
            lines.append(f"  {part} {seq}: " + (", ".join(f"{p['dur_us']:.1f} (gap {p['gap_before_us']:.1f})"
                                                          for p in tr["positions"]) if "positions" in tr else str(tr)))
    for seq, s in point.get("series", {}).items():
        m = s["summary"]
        lines.append(f"  series {seq}: {m['first_chunk_us']:.1f} -> {m['last_quarter_us']:.1f} us, "
                     f"SM {m['sm_clock_mhz_first_50ms']} -> {m['sm_clock_mhz_last_quarter']} MHz, "
                     f"{m['power_w_last_quarter']} W, capped {m['power_capped_share_last_quarter']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/graph_gap_sm90.json")
    parser.add_argument("--points", nargs="+", default=list(DEFAULT_POINTS), help="PRESET:T, FP8xFP8")
    parser.add_argument("--trace-dir", type=Path, default=Path(os.environ.get("OUT", "/tmp")) / "graph_gap_traces",
                        help="where the profiler's kernel traces go (not the repository: they are large)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--windows", type=int, default=10)
    args = parser.parse_args()
    require_gpus("graph_gap_sm90")
    torch.cuda.init()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    gpu = visible_gpu()
    try:
        dg = import_deep_gemm()
        dg_status = "deepinfer-gemm 2.8.2 (built on the device)"
    except Exception as err:  # noqa: BLE001 - any import failure is recorded, our sequences still run
        dg, dg_status = None, f"unavailable: {type(err).__name__}: {err}"
    partition = {"dispatch_sms": 0, "compute_sms": num_sms, "workqueue": "none (whole device, no green context)"}
    meta = result_meta("bench/graph_gap_sm90.py", sys.argv[1:], partition)
    meta["timing"] = {"warmup_windows": args.warmup, "windows": args.windows, "replays_per_window": list(REPLAYS),
                      "sampler_ms": SAMPLE_MS, "series_ms": SERIES_MS, "series_chunk": SERIES_CHUNK,
                      "idle_before_series_s": IDLE_S, "clock_reason_field": reason_field(gpu)}
    meta["timing"]["trace_replays"] = TRACE_REPLAYS
    meta["deepgemm"] = dg_status
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.trace_dir.mkdir(parents=True, exist_ok=True)
    points = []
    for spec in args.points:
        preset, tokens = spec.split(":")
        point = measure_point(preset, int(tokens), num_sms, gpu, args.warmup, args.windows, dg, args.trace_dir,
                              args.parts)
        points.append(point)
        write_result(args.out, {"meta": meta, "points": points})  # partial results survive
        print(report(spec, point))
        torch.cuda.empty_cache()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
