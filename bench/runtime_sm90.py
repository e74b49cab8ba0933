"""Replay cost of the empty three-node green-context graph versus one-kernel graphs (SM90 runtime benchmark).

Cases (every kernel is the empty ``rt_noop``): ``three_node_green`` (comm root + compute root + compute node
depending on both, the operator's graph shape), ``one_kernel_green`` (one node on the compute partition) and
``one_kernel_plain`` (one node in the caller's undivided context). Each is timed two ways: ``direct`` (100
``cuGraphLaunch`` calls per window on torch's stream) and ``captured`` (the graph attached 100 times inside one
outer ``torch.cuda.graph``, replayed once per window: the cost inside a serving engine's captured layer).
docs/bench_protocol.md timing: 10 warm-up and 30 measured windows, L2 flushed between windows, median window.

Run on an H200 (scripts/device_check.sh does):
``python bench/runtime_sm90.py --out bench/results/runtime_sm90.json``
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from _common import PER_WINDOW, REPO, pyplot, require_gpus, result_meta, timed_windows, write_result

from gc_moe_compat.runtime import jit
from gc_moe_compat.runtime.graph import GreenGraph, KernelNode, get_graph
from gc_moe_compat.runtime.green import Partition, Role, get_partition
from gc_moe_compat.runtime.params import KernelArgs


def graphs(part: Partition) -> dict[str, GreenGraph]:
    """The benchmarked graphs, built (and their kernels warmed up in each context) before any timing."""
    noop = jit.load_module("testing/runtime_test.cu").kernel("rt_noop")
    none = KernelArgs()
    return {
        "three_node_green": get_graph(
            [
                KernelNode.make("A", noop, Role.COMM, 1, 32, none),
                KernelNode.make("B", noop, Role.COMPUTE, 1, 32, none),
                KernelNode.make("C", noop, Role.COMPUTE, 1, 32, none, deps=("A", "B")),
            ],
            part,
        ),
        "one_kernel_green": get_graph([KernelNode.make("B", noop, Role.COMPUTE, 1, 32, none)], part),
        "one_kernel_plain": get_graph([KernelNode.make("B", noop, None, 1, 32, none)], part),
    }


def direct_window(graph: GreenGraph) -> Callable[[], None]:
    stream = torch.cuda.current_stream().cuda_stream

    def window() -> None:
        for _ in range(PER_WINDOW):
            graph.replay(stream)

    return window


def captured_window(graph: GreenGraph) -> tuple[Callable[[], None], torch.cuda.CUDAGraph]:
    outer = torch.cuda.CUDAGraph()
    with torch.cuda.graph(outer):
        for _ in range(PER_WINDOW):
            graph.launch()
    return outer.replay, outer


def summarize(case: str, nodes: int, how: str, samples: list[float], host_us: float | None) -> dict[str, object]:
    ordered = sorted(samples)
    return {
        "case": case,
        "nodes": nodes,
        "launch": how,
        "latency_us": {"replay": statistics.median(samples)},
        "p10_us": ordered[len(ordered) // 10],
        "p90_us": ordered[(len(ordered) * 9) // 10],
        "host_us_per_launch": host_us,  # captured: one outer replay issues all 100, amortized per graph
        "host_bound": host_us > statistics.median(samples),
        "windows_us": samples,
    }


def plot(points: list[dict[str, object]], path: Path) -> None:
    """Bar chart of the median replay cost per case and launch mode (skipped without matplotlib)."""
    plt = pyplot()
    if plt is None:
        return
    labels = [f"{p['case']}\n{p['launch']}" for p in points]
    values = [p["latency_us"]["replay"] for p in points]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.bar(labels, values, color=["#4477aa" if p["launch"] == "direct" else "#ee7733" for p in points])
    ax.set_ylabel("µs per replay (median window)")
    ax.set_title("Green-context graph replay cost, H200")
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "runtime_sm90.json")
    parser.add_argument("--dispatch-sms", type=int, default=None, help="dispatch SM request (default: env / 4)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--windows", type=int, default=30)
    args = parser.parse_args()
    require_gpus("runtime_sm90")

    part = get_partition(args.dispatch_sms)
    points = []
    keep = []
    for case, graph in graphs(part).items():
        samples, host = timed_windows(direct_window(graph), args.warmup, args.windows)
        points.append(summarize(case, len(graph.nodes), "direct", samples, host))
        replay, outer = captured_window(graph)
        keep.append(outer)
        samples, host = timed_windows(replay, args.warmup, args.windows)
        points.append(summarize(case, len(graph.nodes), "captured", samples, host))

    meta = result_meta("bench/runtime_sm90.py", sys.argv[1:], part.describe())
    meta["protocol"] = f"{args.warmup} warm-up + {args.windows} measured windows of {PER_WINDOW} launches, L2 flushed"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, {"meta": meta, "points": points})
    plot(points, args.out.with_suffix(".png"))
    print(f"partition: {part.describe()}")
    print(f"{'case':<18} {'launch':<9} {'median µs':>10} {'p10':>7} {'p90':>7} {'host µs':>8}")
    for p in points:
        host = f"{p['host_us_per_launch']:.2f}" if p["host_us_per_launch"] is not None else "-"
        print(
            f"{p['case']:<18} {p['launch']:<9} {p['latency_us']['replay']:>10.2f} "
            f"{p['p10_us']:>7.2f} {p['p90_us']:>7.2f} {host:>8}"
        )
    del keep


if __name__ == "__main__":
    main()
