"""Where the time of an eager call goes, host and GPU on one time line: a Kineto trace (torch.profiler: CPU ops, the
CUDA runtime and driver calls, the GPU kernels) of a few calls of each timed op, each call inside a
``record_function`` span named after its op, and a summary of that trace per call.

The summary answers what the result files' ``latency_us`` / ``host_us`` cannot split: for each call, the host span
(entry to return), each kernel it launched (the launch's host offset from the call's entry, the kernel's GPU start
and end offsets and its duration), and the host gaps between two launches, where an uncached dispatch's CPU wait
for the received counts and the allocations after it show up. ``bench/deep_ep_ab.py --trace DIR`` writes the traces
(one Chrome trace per implementation, rank and point) and their summaries; ``python bench/_call_trace.py DIR``
summarizes saved traces again, ``--across-ranks`` as one line per point and op (the medians over its ranks' files
of each rank's median call), ``--timeline`` each point's ranks on one clock (when each rank entered, launched and
ran its kernels in the same collective call). Tracing adds host time to every CUDA API call (the profiler's
callbacks), so a call making more of them is taxed more: read offsets and gaps against each other, not against the
untraced ``host_us``.
"""

from __future__ import annotations

import argparse
import json
import re
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
        record: dict[str, Any] = {"op": span["name"], "entry": start, "host_us": span["dur"], "launches": [],
                                  "gaps_us": [],
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


def _steady_calls(calls: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """Per op, its calls after the first (whose trace pays the profiler's warm-up) that launched as many kernels as
    the first of them; ops with no such call are left out."""
    steady = {}
    for op in dict.fromkeys(c["op"] for c in calls):
        mine = [c for c in calls if c["op"] == op][1:]
        if mine:
            steady[op] = [c for c in mine if len(c["launches"]) == len(mine[0]["launches"])]
    return steady


def summary_lines(calls: Sequence[Mapping[str, Any]]) -> list[str]:
    """Per op, the medians over its calls after the first: host span, each launch's host offset, its kernel's GPU
    start / end offsets and duration, and the host gap before each launch (the last gap: the last launch to the
    return). Calls that launched a different number of kernels than the op's first are left out."""
    lines = []
    for op, mine in _steady_calls(calls).items():
        shape = len(mine[0]["launches"])
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


DIGEST_FIELDS = ("host_us", "first_launch_us", "launch_calls_us", "between_us", "after_last_us", "alloc_us")
"""What :func:`call_digest` keeps per op: the host span; the entry's gap to the first launch; the launch calls'
time in all; the host time between launches (an uncached dispatch's CPU wait among it); the last launch's end to
the return; the allocations."""


def call_digest(calls: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Per op that launched a kernel, the medians of :data:`DIGEST_FIELDS` over its :func:`_steady_calls`."""
    digest = {}
    for op, mine in _steady_calls(calls).items():
        if not mine[0]["launches"]:
            continue
        per_call = [(c["host_us"], c["gaps_us"][0], sum(launch["launch_us"] for launch in c["launches"]),
                     sum(c["gaps_us"][1:-1]), c["gaps_us"][-1], c["alloc_us"]) for c in mine]
        columns = zip(*per_call, strict=True)
        digest[op] = {name: statistics.median(values) for name, values in zip(DIGEST_FIELDS, columns, strict=True)}
    return digest


def digest_lines(paths: Sequence[Path]) -> list[str]:
    """One line per point and op: the trace files of one point (one per rank, ``..._rank<R>.json``, as
    ``deep_ep_ab.py --trace`` names them) grouped, and each :data:`DIGEST_FIELDS` entry the median over the ranks of
    each rank's :func:`call_digest` (µs)."""
    lines = []
    for point, files in _point_groups(paths).items():
        ranks = [call_digest(summarize(json.loads(f.read_text()))) for f in files]
        for op in dict.fromkeys(op for digest in ranks for op in digest):
            mine = [digest[op] for digest in ranks if op in digest]
            fields = ", ".join(f"{name[:-3].replace('_', ' ')} {statistics.median(d[name] for d in mine):.1f}"
                               for name in DIGEST_FIELDS)
            lines.append(f"{point} {op}: {fields} us ({len(mine)} ranks)")
    return lines


_RANK = re.compile(r"_rank(\d+)$")
"""The end of a trace file's stem that names its rank (``deep_ep_ab.py --trace``'s names)."""


def _point_groups(paths: Sequence[Path]) -> dict[str, list[Path]]:
    """The trace files of each point (one per rank, ``..._rank<R>.json``, as ``deep_ep_ab.py --trace`` names them;
    a file named otherwise is a point of its own), in rank order."""
    groups: dict[str, list[Path]] = {}
    for path in paths:
        groups.setdefault(_RANK.sub("", path.stem), []).append(path)
    return {point: sorted(files, key=lambda f: int(m[1]) if (m := _RANK.search(f.stem)) else 0)
            for point, files in groups.items()}


def _absolute(call: Mapping[str, Any]) -> list[float | None]:
    """A call's entry, then per launch its host time and its kernel's GPU start and end, on the trace's clock."""
    times: list[float | None] = [call["entry"]]
    for launch in call["launches"]:
        times.append(call["entry"] + launch["launch_at"])
        times += [None if launch[key] is None else call["entry"] + launch[key] for key in ("gpu_start", "gpu_end")]
    return times


def timeline_lines(paths: Sequence[Path]) -> list[str]:
    """Each point's ranks on one clock: per op, the k-th steady call of every rank taken together (the ranks meet
    before each op's calls, so their k-th calls are one collective call), times from the earliest rank's entry into
    that call; per rank, the medians over the calls of its entry and of each launch's host time and its kernel's GPU
    start and end; and the median over the calls of the last kernel's end over the ranks (the collective call's
    latency as the shared GPU ran it). The ranks' processes stamp their traces with the host's one clock."""
    lines = []
    for point, files in _point_groups(paths).items():
        ranks = [_steady_calls(summarize(json.loads(f.read_text()))) for f in files]
        for op in dict.fromkeys(op for steady in ranks for op in steady):
            mine = [steady.get(op, []) for steady in ranks]
            count = min(len(calls) for calls in mine)
            if count == 0:
                continue
            times = [[_absolute(calls[k]) for k in range(count)] for calls in mine]  # [rank][call][event]
            starts = [min(rank[k][0] for rank in times) for k in range(count)]
            ends = [max((t for rank in times for t in rank[k][3::3] if t is not None), default=None)
                    for k in range(count)]
            last = _median([None if e is None else e - s for e, s in zip(ends, starts, strict=True)])
            lines.append(f"{point} {op}: {count} calls, last kernel end {_us(last)} us after the first entry "
                         f"(medians; per rank: entry, then each kernel's launch and its GPU start..end)")
            for file, calls, rank in zip(files, mine, times, strict=True):
                at = [_median([None if call[i] is None else call[i] - s for call, s in zip(rank, starts, strict=True)])
                      for i in range(len(rank[0]))]
                parts = [f"entry {_us(at[0])}"]
                for i, launch in enumerate(calls[0]["launches"]):
                    name = (launch["kernel"] or "?").split("(")[0]
                    parts.append(f"{name} {_us(at[1 + 3 * i])} gpu {_us(at[2 + 3 * i])}..{_us(at[3 + 3 * i])}")
                rank_name = m[1] if (m := _RANK.search(file.stem)) else file.stem
                lines.append(f"  rank {rank_name}: " + " | ".join(parts))
    return lines


def summarize_file(path: Path) -> list[str]:
    """The summary lines of one saved trace, headed by its name."""
    return [f"== {path.name}", *summary_lines(summarize(json.loads(path.read_text())))]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, help="trace files, or folders of them (*.json)")
    parser.add_argument("--across-ranks", action="store_true",
                        help="one line per point and op, medians over its ranks' files (digest_lines)")
    parser.add_argument("--timeline", action="store_true",
                        help="each point's ranks on one clock, per op and rank (timeline_lines)")
    args = parser.parse_args(argv)
    files = [f for p in args.paths for f in (sorted(p.glob("*.json")) if p.is_dir() else [p])]
    if not files:
        parser.error(f"no trace files in {[str(p) for p in args.paths]}")
    if args.across_ranks or args.timeline:
        print("\n".join((digest_lines(files) if args.across_ranks else []) +
                        (timeline_lines(files) if args.timeline else [])))
        return 0
    for f in files:
        print("\n".join(summarize_file(f)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
