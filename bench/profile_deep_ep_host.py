"""Where the time of one eager ``deep_ep`` facade call goes, on one GPU at one rank: the kernels' GPU time against
the wall time of the Python call, and the host functions that take it.

For each op (normal ``get_dispatch_layout``, ``dispatch`` BF16 and FP8 uncached, ``combine``; low-latency
``low_latency_dispatch`` FP8 and ``low_latency_combine``) on one shape: ``--calls`` eager calls back to back,
synchronized once at the end, give the host time per call (issuing them) and the wall time (until the GPU has finished
them); torch's profiler (CUPTI) over the same loop gives every kernel's GPU time per call; cProfile over the loop
gives the host functions by cumulative time. A call whose wall time far exceeds its kernels' is host-bound, and the
cProfile table names where; a table of the primitives' host costs (current-stream lookups, the low-latency dispatch's
allocations, beside an empty call's) follows the summary (the uncached dispatch's host time includes its CPU wait for
the counts). ``--ncu``: instead, one call of each op (after three warm-up calls) between ``cudaProfilerStart`` and
``cudaProfilerStop``, for ``ncu --profile-from-start off`` (bench/README.md says which sections). This is a diagnosis,
not a benchmark: the report is text, written to ``--out`` (default ``profile_deep_ep_host.txt`` in the working
directory), and the timings in it are not the protocol's.

``python bench/profile_deep_ep_host.py --out profile_deep_ep_host.txt``
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _common import require_gpus
from deep_ep_sm90 import NUM_SMS, dispatch_kwargs, fp8_rows, normal_nvl_bytes, routing

import gc_moe_compat.deep_ep as deep_ep
from gc_moe_compat.runtime.launch import current_stream_handle
from gc_moe_compat.runtime.single_rank import single_rank_group
from gc_moe_compat.runtime.split import deep_ep_partition_mode


def host_and_wall_per_call(fn: Callable[[], object], calls: int) -> tuple[float, float]:
    """Microseconds per call of ``calls`` eager calls, synchronized before and once after: ``(host, wall)``, host
    the time to issue them (the loop's end, before the synchronization), wall until the GPU has finished them."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    return (issued - start) / calls * 1e6, (time.perf_counter() - start) / calls * 1e6


def primitive_costs(ll_shape: tuple[int, int, int], repeats: int = 20_000) -> list[str]:
    """Host microseconds per call of the primitives an eager call is made of, on this host: torch's current-stream
    lookup two ways (the facade's :func:`~gc_moe_compat.runtime.launch.current_stream_handle`), and allocations of
    the low-latency dispatch's shapes (``ll_shape`` = local experts, slots, hidden; at one rank every expert is
    local and the slots are Tmax): its received rows, its scales (one strided allocation) and a small int32 tensor;
    first an empty call, the loop's own cost that every other row includes."""
    device = torch.device("cuda", torch.cuda.current_device())
    local, slots, hidden = ll_shape
    groups = hidden // 128
    cases = {
        "an empty call (the loop's own cost)": lambda: None,
        "torch.cuda.current_stream(device).cuda_stream": lambda: torch.cuda.current_stream(device).cuda_stream,
        "current_stream_handle(device)": lambda: current_stream_handle(device),
        f"torch.empty([{local}, {slots}, {hidden}] fp8)":
            lambda: torch.empty((local, slots, hidden), dtype=torch.float8_e4m3fn, device=device),
        f"torch.empty_strided([{local}, {slots}, {groups}] fp32, column-major)":
            lambda: torch.empty_strided((local, slots, groups), (groups * slots, 1, slots), dtype=torch.float32,
                                        device=device),
        f"torch.empty([{local}] int32)": lambda: torch.empty(local, dtype=torch.int32, device=device),
    }
    lines = []
    for name, fn in cases.items():
        for _ in range(200):
            fn()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        lines.append(f"{name:62s} {(time.perf_counter() - start) / repeats * 1e6:7.2f} us/call")
    return lines


def kernel_table(fn: Callable[[], object], calls: int) -> list[tuple[str, float, int]]:
    """(kernel name, GPU microseconds per call, launches per call) of ``calls`` calls, from torch's profiler."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.count:
            rows.append((e.key, e.device_time_total / calls, e.count // calls))
    return sorted(rows, key=lambda r: -r[1])


def host_profile(fn: Callable[[], object], calls: int, top: int) -> str:
    """cProfile's tables of ``calls`` calls, ``top`` rows each: by cumulative time (which call path) and by own time
    (which function, the driver and torch calls included)."""
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    return machine_neutral(out.getvalue())


def machine_neutral(text: str) -> str:
    """``text`` without this machine's directories: the repository root and the interpreter's library folders
    become relative names, so a committed report names files as the tree does."""
    roots = {str(Path(__file__).resolve().parent.parent)}
    roots |= {p for p in sys.path if p and Path(p).is_absolute() and ("site-packages" in p or "python3" in p)}
    for root in sorted(roots, key=len, reverse=True):  # the innermost first: a venv may sit inside the tree
        text = text.replace(root.rstrip("/") + "/", "")
    return text


def ll_max_tokens(tokens: int) -> int:
    """The low-latency calls' Tmax for ``tokens``: the multiple of 4 at or above (DeepEP's rule: its receive rows are
    read by TMA)."""
    return -(-tokens // 4) * 4


def ops(group: object, tokens: int, hidden: int, topk: int, experts: int, ll_tokens: int, num_sms: int = NUM_SMS
        ) -> tuple[dict[str, Callable[[], object]], list[deep_ep.Buffer]]:
    """The eager calls, their inputs prepared once (the normal mode's ``Config(num_sms, 8, 256)``); the Buffers to
    destroy afterwards."""
    x, idx, w = (t.cuda() for t in routing(tokens, hidden, topk, experts, 7))
    config = deep_ep.Config(num_sms, 8, 256)
    normal = deep_ep.Buffer(group, normal_nvl_bytes(hidden, tokens, num_sms=num_sms), 0, explicitly_destroy=True)
    layout = dispatch_kwargs(normal, idx, w, experts, config)
    recv, _, recv_w, _, handle, _ = normal.dispatch(x, **layout)
    x_fp8 = fp8_rows(x)
    ll_max = ll_max_tokens(ll_tokens)
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(ll_max, hidden, 1, experts)
    ll = deep_ep.Buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=experts, explicitly_destroy=True)
    lx, lidx = x[:ll_tokens].contiguous(), idx[:ll_tokens].contiguous()
    lw = w[:ll_tokens].contiguous()
    recv_x, _, ll_handle, _, _ = ll.low_latency_dispatch(lx, lidx, ll_max, experts, use_fp8=False)
    expert_out = recv_x.clone()
    table = {
        "normal layout": lambda: normal.get_dispatch_layout(idx, experts),
        "normal dispatch bf16": lambda: normal.dispatch(x, **layout),
        "normal dispatch fp8": lambda: normal.dispatch(x_fp8, **layout),
        "normal combine": lambda: normal.combine(recv, handle, topk_weights=recv_w, config=config),
        "ll dispatch fp8": lambda: ll.low_latency_dispatch(lx, lidx, ll_max, experts),
        "ll combine": lambda: ll.low_latency_combine(expert_out, lidx, lw, ll_handle),
    }
    return table, [normal, ll]


def ncu_window(args: argparse.Namespace) -> int:
    """Three warm-up calls of each op, then one call of each inside the profiler window (nothing is timed here)."""
    with single_rank_group() as group:
        table, buffers = ops(group, args.tokens, args.hidden, args.topk, args.experts, args.ll_tokens, args.num_sms)
        for fn in table.values():
            for _ in range(3):
                fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        for fn in table.values():
            fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        for b in buffers:
            b.destroy()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=512, help="normal-mode tokens (default 512)")
    parser.add_argument("--ll-tokens", type=int, default=128,
                        help="low-latency tokens; Tmax is the multiple of 4 at or above (default 128)")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--num-sms", type=int, default=NUM_SMS,
                        help=f"the normal mode's Config(num_sms, 8, 256), its grids (default {NUM_SMS}: DeepEP's test)")
    parser.add_argument("--top", type=int, default=30, help="cProfile rows per op")
    parser.add_argument("--out", type=Path, default=Path("profile_deep_ep_host.txt"))
    parser.add_argument("--ncu", action="store_true", help="one call of each op inside cudaProfilerStart/Stop")
    args = parser.parse_args()
    require_gpus("profile_deep_ep_host")
    if args.ncu:
        return ncu_window(args)
    partition = deep_ep_partition_mode()
    sha = os.environ.get("GC_MOE_GIT_SHA") or "unknown"
    report = [f"tree {sha}; deep_ep facade, one rank, GC_MOE_DEEP_EP_PARTITION={partition}, "
              f"{torch.cuda.get_device_name()}: normal T={args.tokens} on Config({args.num_sms}, 8, 256), "
              f"low-latency T={args.ll_tokens} (Tmax {ll_max_tokens(args.ll_tokens)}), "
              f"hidden {args.hidden}, top-{args.topk}, {args.experts} experts, {args.calls} eager calls per "
              "measurement", ""]
    with single_rank_group() as group:
        table, buffers = ops(group, args.tokens, args.hidden, args.topk, args.experts, args.ll_tokens, args.num_sms)
        summary = []
        for name, fn in table.items():
            for _ in range(5):
                fn()
            host, wall = host_and_wall_per_call(fn, args.calls)
            kernels = kernel_table(fn, args.calls)
            gpu = sum(us for _, us, _ in kernels)
            summary.append(f"{name:22s} host {host:8.1f}   wall {wall:8.1f} us/call   kernels {gpu:8.1f} us/call")
            report += [f"== {name}: host {host:.1f}, wall {wall:.1f} us per call, kernels {gpu:.1f} us per call"]
            report += [f"   {us:9.1f} us  x{n}  {k}" for k, us, n in kernels]
            report += [host_profile(fn, args.calls, args.top)]
        for b in buffers:
            b.destroy()
        primitives = primitive_costs((args.experts, args.ll_tokens, args.hidden))
    report = summary + ["", "primitives (host time per call):"] + primitives + [""] + report
    args.out.write_text("\n".join(report) + "\n")
    print("\n".join(summary + [""] + primitives))
    return 0


if __name__ == "__main__":
    sys.exit(main())
