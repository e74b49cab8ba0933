"""Where the time of an eager call goes, host and GPU on one time line: a Kineto trace (torch.profiler: CPU ops, the
CUDA runtime and driver calls, the GPU kernels) of a few calls of each timed op, each call inside a
``record_function`` span named after its op, and a summary of that trace per call.

The summary answers what the result files' ``latency_us`` / ``host_us`` cannot split: for each call, the host span
(entry to return), each kernel it launched (the launch's host offset from the call's entry, the kernel's GPU start
and end offsets and its duration), and the host gaps between two launches, where an uncached dispatch's CPU wait
for the received counts and the allocations after it show up. ``bench/deep_ep_ab.py --trace DIR`` writes the traces
(one Chrome trace per implementation, rank and point) and their summaries; ``python bench/_call_trace.py DIR``
summarizes saved traces again. Tracing adds host time to every call (the profiler's callbacks): read offsets and
gaps against each other, not against the untraced ``host_us``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

TRACE_CALLS = 8
"""Traced calls per op; the summary reads the calls after the first (a call's first trace pays the profiler's
warm-up)."""
ALLOC_OPS = ("aten::empty", "aten::empty_strided")
"""The CPU ops of the calls' output allocations, totalled per call in the summary."""
LAUNCH_NAMES = ("cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernel", "cudaLaunchKernelExC",
                "cudaLaunchCooperativeKernel", "cuGraphLaunch", "cudaGraphLaunch")
"""Runtime and driver calls whose correlation id names a kernel they launched."""


def trace_calls(calls: Mapping[str, Callable[[], object]], path: Path, sync: Callable[[], None]) -> None:
    """Trace ``TRACE_CALLS`` eager calls of each op of ``calls`` into the Chrome trace ``path``; ``sync`` runs before
    each op's calls on every rank (the device synchronized, then a barrier of the group), so that the ranks' calls
    meet as in the timed windows."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for op, fn in calls.items():
            sync()
            for _ in range(TRACE_CALLS):
                with record_function(op):
                    fn()
            torch.cuda.synchronize()
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))


def _events(trace: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e and "dur" in e]


def summarize(trace: Mapping[str, Any], ops: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """One record per traced call (its op, host span, launches, host gaps and time in allocations), from a Kineto
    Chrome trace whose calls sit inside ``record_function`` spans (category ``user_annotation``) named after ``ops``
    (every such span when None). Times are µs, offsets from the call's entry."""
    events = _events(trace)
    spans = sorted((e for e in events if e.get("cat") == "user_annotation" and (ops is None or e["name"] in ops)),
                   key=lambda e: e["ts"])
    kernels = {e["args"]["correlation"]: e for e in events
               if e.get("cat") == "kernel" and "correlation" in e.get("args", {})}
    launches = sorted((e for e in events if e["name"] in LAUNCH_NAMES and "correlation" in e.get("args", {})),
                      key=lambda e: e["ts"])
    allocs = [e for e in events if e.get("cat") == "cpu_op" and e["name"] in ALLOC_OPS]
    calls = []
    for span in spans:
        start, end = span["ts"], span["ts"] + span["dur"]
        mine = [e for e in launches if start <= e["ts"] <= end]
        record: dict[str, Any] = {"op": span["name"], "host_us": span["dur"], "launches": [], "gaps_us": [],
                                  "alloc_us": sum(e["dur"] for e in allocs if start <= e["ts"] <= end)}
        previous = start
        for launch in mine:
            kernel = kernels.get(launch["args"]["correlation"])
            record["gaps_us"].append(launch["ts"] - previous)
            previous = launch["ts"] + launch["dur"]
            record["launches"].append({
                "kernel": None if kernel is None else kernel["name"], "launch_at": launch["ts"] - start,
                "launch_us": launch["dur"],
                "gpu_start": None if kernel is None else kernel["ts"] - start,
                "gpu_end": None if kernel is None else kernel["ts"] + kernel["dur"] - start,
                "gpu_us": None if kernel is None else kernel["dur"]})
        record["gaps_us"].append(end - previous)
        calls.append(record)
    return calls


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def summary_lines(calls: Sequence[Mapping[str, Any]]) -> list[str]:
    """Per op, the medians over its calls after the first: host span, each launch's host offset, its kernel's GPU
    start / end offsets and duration, and the host gap before each launch (the last gap: the last launch to the
    return). Calls that launched a different number of kernels than the op's first are left out."""
    lines = []
    for op in dict.fromkeys(c["op"] for c in calls):
        mine = [c for c in calls if c["op"] == op][1:]
        if not mine:
            continue
        shape = len(mine[0]["launches"])
        mine = [c for c in mine if len(c["launches"]) == shape]
        lines.append(f"{op}: {len(mine)} calls, host {_us(_median([c['host_us'] for c in mine]))} us, allocations "
                     f"{_us(_median([c['alloc_us'] for c in mine]))} us (medians)")
        for i in range(shape):
            parts = [c["launches"][i] for c in mine]
            name = (parts[0]["kernel"] or "?").split("(")[0]
            lines.append(
                f"  gap {_us(_median([c['gaps_us'][i] for c in mine])):>7}  launch at "
                f"{_us(_median([p['launch_at'] for p in parts])):>7} ({_us(_median([p['launch_us'] for p in parts]))})"
                f"  gpu {_us(_median([p['gpu_start'] for p in parts])):>7} .. "
                f"{_us(_median([p['gpu_end'] for p in parts])):>7} ({_us(_median([p['gpu_us'] for p in parts]))})"
                f"  {name}")
        lines.append(f"  gap {_us(_median([c['gaps_us'][shape] for c in mine])):>7}  return")
    return lines


def summarize_file(path: Path) -> list[str]:
    """The summary lines of one saved trace, headed by its name."""
    return [f"== {path.name}", *summary_lines(summarize(json.loads(path.read_text())))]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, help="trace files, or folders of them (*.json)")
    args = parser.parse_args(argv)
    files = [f for p in args.paths for f in (sorted(p.glob("*.json")) if p.is_dir() else [p])]
    if not files:
        parser.error(f"no trace files in {[str(p) for p in args.paths]}")
    for f in files:
        print("\n".join(summarize_file(f)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
