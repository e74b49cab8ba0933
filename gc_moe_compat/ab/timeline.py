"""Where a captured graph's time goes, kernel by kernel: back-to-back replays under the PyTorch profiler (CUPTI's
kernel records), and per kernel of one replay its median start and end offsets from the replay's first kernel start
and its median duration, with the replay's median span (first start to last end).

What latency windows cannot split: whether a layer's time above its weight floor is one kernel's (which) or the
gaps and overlaps between them (the operator's concurrent roots, the original's single kernel). ``gc-moe-ab
--timeline N`` records it per operator and point (:func:`graph_timeline`); ``bench/graph_gap_sm90.py`` reads the
same records of its GEMM graphs (:func:`traced_kernels`). The profiler's replays are not the protocol's windows (no
L2 flush between replays): read the offsets and durations against each other, not against ``latency_us``.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["KernelRecord", "graph_timeline", "summarize", "traced_kernels"]

KernelRecord = tuple[float, float, str]
"""One kernel execution: (start µs, duration µs, name), as the profiler's Chrome trace records it."""
NAME_CHARS = 96
"""A kernel's name as summaries keep it: its first characters (C++ names with template arguments run long)."""


def traced_kernels(graph: torch.cuda.CUDAGraph, replays: int, trace_file: Path | None = None) -> list[KernelRecord]:
    """Every kernel of ``replays`` back-to-back replays of ``graph`` under the PyTorch profiler (CUDA activity only),
    in start order; the Chrome trace goes to ``trace_file`` (a temporary file when None)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    return _recorded(prof, trace_file)


def _recorded(prof: object, trace_file: Path | None) -> list[KernelRecord]:
    """The kernel records of a stopped profiler, through its Chrome trace (``trace_file``, or a temporary file)."""
    with tempfile.TemporaryDirectory() as scratch:
        path = trace_file or Path(scratch) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    return sorted((float(e["ts"]), float(e["dur"]), str(e["name"])) for e in events if e.get("cat") == "kernel")


def summarize(kernels: Sequence[KernelRecord], replays: int) -> dict[str, object]:
    """The timeline of one replay from ``kernels`` (start order) of ``replays`` back-to-back replays: each replay's
    kernels are the next ``len(kernels) / replays`` by start time (a graph's replays run one after the other on its
    stream), a kernel is its name and its occurrence among that replay's kernels of the name (concurrent kernels may
    start in either order), and each gets its median ``start_us`` / ``end_us`` offsets from the replay's first start
    and its median ``duration_us``, listed by start; ``span_us`` is the median replay's first start to last end.
    ``{"unavailable": why}`` where the records do not split into equal replays."""
    if replays < 1:
        raise ValueError(f"replays: must be >= 1, got {replays}")
    per_replay, left = divmod(len(kernels), replays)
    if left or not per_replay:
        return {"unavailable": f"{len(kernels)} kernel records do not split into {replays} equal replays"}
    by_kernel: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    spans = []
    for r in range(replays):
        replay = kernels[r * per_replay:(r + 1) * per_replay]
        first = replay[0][0]
        spans.append(max(start + dur for start, dur, _ in replay) - first)
        seen: dict[str, int] = {}
        for start, dur, name in replay:
            key = (name[:NAME_CHARS], seen.get(name, 0))
            seen[name] = key[1] + 1
            by_kernel.setdefault(key, []).append((start - first, start - first + dur, dur))
    if any(len(times) != replays for times in by_kernel.values()):
        return {"unavailable": "the replays ran different kernels: "
                               f"{sorted((name, n, len(t)) for (name, n), t in by_kernel.items())}"}
    rows = [{"name": name, "start_us": statistics.median(t[0] for t in times),
             "end_us": statistics.median(t[1] for t in times), "duration_us": statistics.median(t[2] for t in times)}
            for (name, _), times in by_kernel.items()]
    rows.sort(key=lambda row: row["start_us"])
    return {"replays": replays, "kernels_per_replay": per_replay, "span_us": statistics.median(spans),
            "kernels": rows}


def graph_timeline(graph: torch.cuda.CUDAGraph, replays: int) -> dict[str, object]:
    """:func:`summarize` of ``replays`` traced back-to-back replays of ``graph``. The replays run exactly once each
    whatever the profiler does (a multi-rank graph's peers replay theirs as many times): where it fails to start or to
    give its records, its error is returned instead of the timeline."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    prof: object | None = profile(activities=[ProfilerActivity.CUDA])
    failed = None
    try:
        prof.start()
    except Exception as exc:  # noqa: BLE001 - recorded; the replays still run
        prof, failed = None, exc
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    try:
        if prof is not None:
            prof.stop()
            return summarize(_recorded(prof, None), replays)
    except Exception as exc:  # noqa: BLE001 - recorded
        failed = exc
    return {"unavailable": f"the profiler failed: {type(failed).__name__}: {failed}"}
