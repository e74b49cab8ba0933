"""Cost of the facade's two pre-dispatch functions under CUDA-graph replay: SGLang's Hopper call
``deep_gemm.mega_moe_pre_dispatch_sm90`` (FP32 1x128 scales) and DeepGEMM's ``mega_moe_pre_dispatch`` (UE8M0 K32
scales packed four per int32, the SM100-layout views; ``mma_type='fp8xfp4'``, routed scaling 1 as its signature has
none). Each ``function`` is one ``recipe`` of ``kernels/sm90/predispatch.cu``.

Two implementations of the same staging on identical inputs, timed as a serving engine's captured decode step pays
them: 100 calls captured in one CUDA graph, the graph replayed once per window, latency = window / 100
(docs/bench_protocol.md windows: 10 warm-up + 30 measured, L2 flushed between windows). ``fused_alone``: the fused call
as the only node of its graph, replayed 100 times per window (each replay a host launch, ~2.3 us on an H200:
bench/results/runtime_sm90.json), the upper bound of a call outside a larger graph.

* ``fused``: the facade's call, one launch of ``kernels/sm90/predispatch.cu``;
* ``torch_ops``: the same arithmetic as a chain of torch ops on the GPU (``_predispatch.stage_with_torch``, the
  facade's host path: ``quant.quantize_fp8_pre_dispatch``, the routing copies and the padding fills), the form the
  facade had before the kernel.

Per point: BF16 tokens ``[T, H]`` (int32 ids, FP32 weights; :data:`FUNCTIONS` names each call's scaling) into
views of ``capacity`` rows (SGLang's default 8192, so the padding fill of ``(capacity - T) * k`` slots is included).
``floor_us``: the bytes the call must move (tokens in, payload and scales out, routing in and out, padding) over the
copy bandwidth measured in the same run. ``bit_exact``: the two outputs agree in every byte. Target: fused <= 4 us at
every T <= 256.

``python bench/predispatch_sm90.py --out bench/results/predispatch_sm90.json``
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from _common import PER_WINDOW, REPO, copy_bandwidth, pyplot, require_gpus, result_meta, timed_windows, write_result

import gc_moe_compat.deep_gemm as dg
from gc_moe_compat.config import SWEEP_TOKENS
from gc_moe_compat.deep_gemm import _predispatch

SHAPES = {"dsv41-flash": (5120, 6), "glm52": (6144, 8), "deepseek-v3": (7168, 8)}
"""Preset: (hidden H, top-k)."""
CAPACITY = 8192
FUNCTIONS = {"mega_moe_pre_dispatch_sm90": ("fp32x128", torch.float32, 2.5),
             "mega_moe_pre_dispatch": ("ue8m0x32", torch.int32, 1.0)}
"""Function: (kernel recipe, ``buf_x_sf`` dtype, routed scaling factor: SGLang's DeepSeek-V3 2.5 for the Hopper call;
DeepGEMM's call has no factor)."""
TARGET_US = 4.0


def make_call(function: str, name: str, hidden: int, topk: int,
              tokens: int) -> tuple[Callable[[], None], list[torch.Tensor]]:
    """The staging call ``name`` (``fused`` / ``torch_ops``) of ``function`` for one point, with its inputs and
    output views (allocated once)."""
    recipe, sf_dtype, factor = FUNCTIONS[function]
    g = torch.Generator().manual_seed(tokens * 131 + hidden)
    x = (torch.randn(tokens, hidden, generator=g) * 3.0).to("cuda", torch.bfloat16)
    idx = torch.randint(0, 256, (tokens, topk), generator=g, dtype=torch.int32).cuda()
    w = torch.rand(tokens, topk, generator=g).cuda()
    views = [torch.empty(CAPACITY, hidden, dtype=torch.float8_e4m3fn, device="cuda"),
             torch.empty(CAPACITY, hidden // 128, dtype=sf_dtype, device="cuda"),
             torch.empty(CAPACITY, topk, dtype=torch.int64, device="cuda"),
             torch.empty(CAPACITY, topk, dtype=torch.float32, device="cuda")]

    def fused() -> None:
        if recipe == "fp32x128":
            dg.mega_moe_pre_dispatch_sm90(x, idx, w, *views, num_tokens=tokens, routed_scaling_factor=factor)
        else:
            dg.mega_moe_pre_dispatch(x, idx, w, *views, num_tokens=tokens, mma_type="fp8xfp4")

    def torch_ops() -> None:
        _predispatch.stage_with_torch(recipe, x, idx, w, *views, tokens, factor)

    return {"fused": fused, "torch_ops": torch_ops}[name], views


def replay_us(call: Callable[[], None], warmup: int, windows: int, *, calls_per_graph: int) -> float:
    """Median microseconds per ``call``: a graph of ``calls_per_graph`` calls, replayed until a window holds
    :data:`PER_WINDOW` calls."""
    call()  # compile / load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            call()

    def window() -> None:
        for _ in range(PER_WINDOW // calls_per_graph):
            graph.replay()

    device_us, _ = timed_windows(window, warmup, windows)
    return statistics.median(device_us)


def floor_bytes(hidden: int, topk: int, tokens: int) -> int:
    """Bytes one call must read and write: BF16 tokens in, E4M3 payload and FP32 scales out, int32 ids and FP32
    weights in, int64 ids and FP32 weights out for every capacity row (written or padded)."""
    return tokens * (2 * hidden + hidden + 4 * hidden // 128 + 8 * topk) + CAPACITY * topk * 12


def point(function: str, preset: str, tokens: int, bandwidth: float, warmup: int,
          windows: int) -> dict[str, object]:
    hidden, topk = SHAPES[preset]
    latency: dict[str, float] = {}
    outputs = {}
    for name in ("fused", "torch_ops"):
        call, views = make_call(function, name, hidden, topk, tokens)
        latency[name] = replay_us(call, warmup, windows, calls_per_graph=PER_WINDOW)
        if name == "fused":
            latency["fused_alone"] = replay_us(call, warmup, windows, calls_per_graph=1)
        bx, bsf, bidx, bw = views
        outputs[name] = [t.view(torch.uint8).clone() for t in (bx[:tokens], bsf[:tokens], bidx, bw)]
    return {"function": function, "recipe": FUNCTIONS[function][0], "preset": preset, "tokens_per_rank": tokens,
            "hidden": hidden, "topk": topk, "latency_us": latency,
            "floor_us": floor_bytes(hidden, topk, tokens) / bandwidth * 1e6,
            "speedup": latency["torch_ops"] / latency["fused"], "meets_target": latency["fused"] <= TARGET_US,
            "bit_exact": all(torch.equal(a, b) for a, b in zip(outputs["fused"], outputs["torch_ops"], strict=True))}


def plot(points: list[dict[str, object]], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(FUNCTIONS), figsize=(6 * len(FUNCTIONS), 4), squeeze=False)
    for ax, function in zip(axes[0], FUNCTIONS, strict=True):
        for preset in SHAPES:
            rows = [p for p in points if p["preset"] == preset and p["function"] == function]
            t = [p["tokens_per_rank"] for p in rows]
            ax.plot(t, [p["latency_us"]["fused"] for p in rows], marker="o", label=f"{preset} fused")
            ax.plot(t, [p["latency_us"]["torch_ops"] for p in rows], marker="x", linestyle="--",
                    label=f"{preset} torch ops")
        ax.axhline(TARGET_US, color="grey", linestyle=":", label="target 4 us")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per rank T")
        ax.set_ylabel("us per call (100 calls in one graph)")
        ax.set_title(f"{function}, capacity {CAPACITY}")
        ax.legend(fontsize=7)
    fig.suptitle("The facade's pre-dispatch kernels, one H200")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/predispatch_sm90.json")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--windows", type=int, default=30)
    args = parser.parse_args()
    require_gpus("predispatch_sm90")
    bandwidth = copy_bandwidth()
    points = [point(f, p, t, bandwidth, args.warmup, args.windows)
              for f in FUNCTIONS for p in SHAPES for t in SWEEP_TOKENS]
    meta = result_meta("bench/predispatch_sm90.py", sys.argv[1:], {"mode": "whole device (no partition)"})
    meta.update({"capacity": CAPACITY, "routed_scaling_factor": {f: v[2] for f, v in FUNCTIONS.items()},
                 "copy_bandwidth_Bps": bandwidth, "target_us": TARGET_US})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, {"meta": meta, "points": points})
    plot(points, args.out.with_suffix(".png"))
    print("| function | preset | T | fused us | fused alone us | torch ops us | floor us | x torch ops | bit-exact |")
    print("|---|---|---|---|---|---|---|---|---|")
    for p in points:
        us = p["latency_us"]
        print(f"| {p['function']} | {p['preset']} | {p['tokens_per_rank']} | {us['fused']:.2f} | "
              f"{us['fused_alone']:.2f} | {us['torch_ops']:.2f} | {p['floor_us']:.2f} | {p['speedup']:.1f} | "
              f"{'yes' if p['bit_exact'] else 'NO'} |")


if __name__ == "__main__":
    main()
