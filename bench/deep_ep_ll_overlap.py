"""Why the ``deep_ep`` facade's low-latency kernels run on the communication green partition: one H200, a grouped
GEMM of one micro-batch running while the other micro-batch's dispatch + combine runs (SGLang's two-batch overlap).

Per preset (``dsv41-flash``, ``glm52``: ``e`` local experts, hidden ``H``, intermediate ``I``, top-k ``k``) and tokens
``T`` (``Tmax = 128``, uniform top-k routing over ``E = e`` experts on one rank), two modes:

* ``green``: ``Buffer.low_latency_dispatch`` + ``low_latency_combine`` captured in a CUDA graph with the kernels on the
  communication green partition (``Buffer.num_sms`` = 20, the default request), replayed on its own stream; the
  grouped GEMM on the compute partition's stream.
* ``ordinary``: the same graph captured with ``GC_MOE_PARTITION=off`` (the kernels on the whole device) and the same
  GEMM, each on an ordinary torch stream.

The GEMM is a stand-in labelled as such: ``torch.bmm`` of BF16 ``[e, 128, H] x [e, H, 2I]`` (DeepGEMM's masked
grouped L1 GEMM shape with one 128-row block per expert, in BF16; DeepGEMM does not load on these machines,
FACTS.md). A step forks both streams from the main stream and joins them. Timed per BENCH_PROTOCOL.md: windows of
20 steps (``--steps``), warm-up and measured windows, L2 flushed and synchronized before each; reported per mode:
``step_us`` (both done), ``ll_us`` (step start to the end of the combine: the communication's latency under the GEMM)
and alone: ``gemm_alone_us`` (GEMM alone on its partition or the whole device) and ``ll_alone_us``. Accuracy: the
combined output of both modes is bit-identical to the torch reference.

``python bench/deep_ep_ll_overlap.py --out bench/results/deep_ep_ll_overlap.json`` (re-executes itself under torchrun
on one rank).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from _common import REPO, pyplot, result_meta, timed_windows

from gc_moe_compat.ab.protocol import torchrun_command

TMAX = 128
TOKENS = (16, 128)
PRESETS = ("dsv41-flash", "glm52")
MODES = ("green", "ordinary")


def capture_ll(buffer: object, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, expert_out: torch.Tensor,
               out: torch.Tensor, experts: int, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    """Dispatch (FP8) + combine of a fixed expert output into ``out``, run eagerly once then captured on
    ``stream``; the partition mode is the environment's at the call."""

    def layer() -> None:
        _, _, handle, _, _ = buffer.low_latency_dispatch(x, idx, TMAX, experts)
        buffer.low_latency_combine(expert_out, idx, w, handle, out=out)

    with torch.cuda.stream(stream):
        layer()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        layer()
    torch.cuda.synchronize()
    return graph


def step_window(ll: torch.cuda.CUDAGraph | None, gemm: Callable[[], None] | None, ll_stream: torch.cuda.Stream,
                gemm_stream: torch.cuda.Stream, steps: int, ll_events: list[tuple[torch.cuda.Event, ...]],
                side: tuple[object, object] | None) -> Callable[[], None]:
    """A window of ``steps`` steps: fork both streams from the current one, the LL graph on one and the GEMM on the
    other, join; the LL's start/end events of each step go to ``ll_events``. ``side`` = (partition, role) when the
    GEMM stream is a green side's (forked and joined with that partition's events, runtime/side_launch.py)."""
    from gc_moe_compat.runtime.side_launch import fork, join

    main = torch.cuda.current_stream()

    def window() -> None:
        for _ in range(steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(main)
            if ll is not None:
                ll_stream.wait_stream(main)
                with torch.cuda.stream(ll_stream):
                    ll.replay()
                end.record(ll_stream)
                ll_events.append((start, end))
            if gemm is not None:
                if side is None:
                    gemm_stream.wait_stream(main)
                else:
                    fork(*side, main.cuda_stream)
                with torch.cuda.stream(gemm_stream):
                    gemm()
                if side is None:
                    main.wait_stream(gemm_stream)
                else:
                    join(*side, main.cuda_stream)
            if ll is not None:
                main.wait_stream(ll_stream)

    return window


def measure(ll: torch.cuda.CUDAGraph | None, gemm: Callable[[], None] | None, ll_stream: torch.cuda.Stream,
            gemm_stream: torch.cuda.Stream, side: tuple[object, object] | None,
            args: argparse.Namespace) -> tuple[float, float | None]:
    """(median µs per step, median µs from step start to the LL's end or None)."""
    events: list[tuple[torch.cuda.Event, ...]] = []
    per_step, _ = timed_windows(step_window(ll, gemm, ll_stream, gemm_stream, args.steps, events, side),
                                args.warmup, args.windows, launches=args.steps)
    torch.cuda.synchronize()
    measured = events[args.warmup * args.steps:]
    ll_us = statistics.median(s.elapsed_time(e) * 1e3 for s, e in measured) if measured else None
    return statistics.median(per_step), ll_us


def run(args: argparse.Namespace) -> None:
    import gc_moe_compat.deep_ep as deep_ep
    from gc_moe_compat.config import PRESETS as CONFIGS
    from gc_moe_compat.runtime.green import Role
    from gc_moe_compat.testing.ep_reference import combine_reference, receive_plan

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    dev = torch.device("cuda", local)
    points, partition = [], None
    for preset in args.presets:
        cfg = CONFIGS[preset]
        e, h, inter, k = cfg.local_experts, cfg.hidden, cfg.intermediate, cfg.topk
        hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(TMAX, h, 1, e)
        buffer = deep_ep.Buffer(dist.group.WORLD, 0, hint, low_latency_mode=True)
        partition = buffer.low_latency_partition
        part_obj = deep_ep._low_latency.comm_partition(buffer.workspace, deep_ep.Buffer.num_sms)
        compute_stream = part_obj.side(Role.COMPUTE).torch_stream(local)
        a = torch.randn(e, TMAX, h, device=dev).to(torch.bfloat16)
        wgt = (torch.randn(e, h, 2 * inter, device=dev) * 0.02).to(torch.bfloat16)
        c = torch.empty(e, TMAX, 2 * inter, dtype=torch.bfloat16, device=dev)

        gemm = functools.partial(torch.bmm, a, wgt, out=c)

        for t in args.tokens:
            gen = torch.Generator().manual_seed(1000 * t + e)
            x = (torch.randn(t, h, generator=gen) * 2).to(torch.bfloat16)
            idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
            w = torch.rand(t, k, generator=gen)
            plan = receive_plan([idx], e)
            expert_out = torch.full((e, TMAX, h), float("nan"), dtype=torch.bfloat16)
            for le, rows in enumerate(plan.rows[0]):
                expert_out[le, :len(rows)] = torch.randn(len(rows), h, generator=gen).to(torch.bfloat16)
            want = combine_reference(0, idx, w, [expert_out], plan)
            xd, idxd, wd, eod = x.to(dev), idx.to(dev), w.to(dev), expert_out.to(dev)
            point: dict[str, object] = {"preset": preset, "tokens_per_rank": t, "mma_type": None, "shared": 0,
                                        "latency_us": {}, "accuracy": {}}
            for mode in MODES:
                out = torch.full((t, h), float("nan"), dtype=torch.bfloat16, device=dev)
                ll_stream = torch.cuda.Stream(dev)
                gemm_stream = compute_stream if mode == "green" else torch.cuda.Stream(dev)
                if mode == "ordinary":
                    os.environ["GC_MOE_PARTITION"] = "off"
                try:
                    graph = capture_ll(buffer, xd, idxd, wd, eod, out, e, ll_stream)
                finally:
                    os.environ.pop("GC_MOE_PARTITION", None)
                side = (part_obj, Role.COMPUTE) if mode == "green" else None
                lat = point["latency_us"]
                lat[f"{mode}_step"], lat[f"{mode}_ll"] = measure(graph, gemm, ll_stream, gemm_stream, side, args)
                lat[f"{mode}_gemm_alone"], _ = measure(None, gemm, ll_stream, gemm_stream, side, args)
                _, lat[f"{mode}_ll_alone"] = measure(graph, None, ll_stream, gemm_stream, side, args)
                torch.cuda.synchronize()
                point["accuracy"][mode] = {"bit_exact_vs_reference": torch.equal(out.cpu().view(torch.int16),
                                                                                 want.view(torch.int16)),
                                           "nan_count": int(out.isnan().sum())}
            lat = point["latency_us"]
            point["speedup"] = lat["ordinary_step"] / lat["green_step"]
            point["ll_speedup_under_gemm"] = lat["ordinary_ll"] / lat["green_ll"]
            points.append(point)
            print(f"{preset} T={t}: " + ", ".join(f"{op} {v:.1f}" for op, v in lat.items()) +
                  f" | exact {[point['accuracy'][m]['bit_exact_vs_reference'] for m in MODES]}", flush=True)
    write_result(args, points, partition)


def write_result(args: argparse.Namespace, points: list[dict[str, object]], partition: dict[str, object]) -> None:
    meta = result_meta("bench/deep_ep_ll_overlap.py", sys.argv[1:], partition)
    meta |= {"timing": {"warmup_windows": args.warmup, "windows": args.windows, "steps_per_window": args.steps},
             "max_dispatch_tokens_per_rank": TMAX,
             "ops": {"ll": "gc_moe_compat.deep_ep low_latency_dispatch (BF16 in, FP8 out) + low_latency_combine, "
                           "one CUDA graph",
                     "gemm": "STAND-IN for DeepGEMM's masked grouped L1 GEMM: torch.bmm BF16 [e, 128, H] x "
                             "[e, H, 2I]",
                     "green": "LL kernels on the communication green partition, GEMM on the compute partition's "
                              "stream",
                     "ordinary": "GC_MOE_PARTITION=off: LL kernels on the whole device, both on ordinary streams"}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "points": points}, indent=1) + "\n")
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        labels = [f"{p['preset']}\nT={p['tokens_per_rank']}" for p in points]
        xs = range(len(points))
        for ax, what in zip(axes, ("step", "ll"), strict=True):
            for i, mode in enumerate(MODES):
                ax.bar([x + 0.4 * i for x in xs], [p["latency_us"][f"{mode}_{what}"] for p in points], 0.4,
                       label=mode)
            ax.set_xticks([x + 0.2 for x in xs], labels, fontsize=7)
            ax.set_ylabel("µs")
            ax.set_title("GEMM || dispatch+combine: step" if what == "step" else "dispatch+combine end under the GEMM")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.out.with_suffix(".png"), dpi=110)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/deep_ep_ll_overlap.json")
    parser.add_argument("--presets", nargs="+", default=list(PRESETS), choices=PRESETS)
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--windows", type=int, default=10)
    args = parser.parse_args(argv)
    bad = [t for t in args.tokens if not 1 <= t <= TMAX]
    if bad:
        parser.error(f"--tokens: every T must lie in [1, {TMAX}], got {bad}")
    return args


def main() -> int:
    args = parse_args(sys.argv[1:])
    if "LOCAL_RANK" in os.environ:
        run(args)
        sys.stdout.flush()
        os._exit(0)
    cmd, env = torchrun_command([str(Path(__file__).resolve()), *sys.argv[1:]], 1)
    return subprocess.run(cmd, env=env, timeout=540).returncode


if __name__ == "__main__":
    sys.exit(main())
