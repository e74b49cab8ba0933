"""One point of bench/gemm_sm90.py (preset, tokens per rank, weight format), launched for a profiler.

Builds the same layer, tokens and heuristic config as the benchmark, then runs W1 -> W2 ``--repeats`` times eagerly
(the first run loads the modules). Meant to run under Nsight Compute, which the device script starts with the
clocks left alone, e.g.

``ncu --clock-control none --kernel-name regex:gc_sm90 --launch-skip 2 --launch-count 2 --section SpeedOfLight
python bench/profile_gemm_sm90.py --preset dsv41-flash --tokens 256 --format fp8xfp4``

It times nothing itself: the profiler's counters are the output (issue-slot, tensor-pipe and DRAM utilization per
kernel), read next to the benchmark's W1/W2 split latencies. ``--sequence`` then launches W1 and W2 in a given order,
for counters that depend on what ran before (with ``--cache-control none``: e.g. ``w1 w1 w2 w1`` gives W1 after
itself and W1 after W2; ``dg_w1`` / ``dg_w2`` are DeepGEMM's kernels). With ``--graph N`` the sequence is one CUDA
graph instead, replayed N times between cudaProfilerStart and cudaProfilerStop (for ``ncu --profile-from-start off
--graph-profiling graph``): the kernels run back to back as in the benchmark, and the counters cover the whole
sequence.
"""

from __future__ import annotations

import argparse

import torch
from _baseline_sm90 import import_deep_gemm
from _common import require_gpus
from _gemm_workload import CLAMP, make_fp4_layer, make_layer, make_tokens
from _grouping import group_tokens
from _standalone_gemm import ExpertGemmSM90
from gemm_sm90 import capture, gemm_steps, point_config

from gc_moe_compat.config import MMA_TYPES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="dsv41-flash")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--format", choices=MMA_TYPES, default="fp8xfp4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sequence", nargs="*", choices=("w1", "w2", "dg_w1", "dg_w2"), default=[],
                        help="kernels launched one by one after the repeats, in this order (dg_*: DeepGEMM's "
                             "masked W1 / W2 on the point's FP8 weights, as in bench/gemm_sm90.py)")
    parser.add_argument("--graph", type=int, default=0, metavar="N",
                        help="capture the sequence as one graph and replay it N times, profiled alone")
    args = parser.parse_args()
    require_gpus("profile_gemm_sm90")
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    layer = make_layer(args.preset, torch.device("cuda"), seed=1)
    weights = make_fp4_layer(layer.l1_bf16, layer.l2_bf16).prepared if args.format == "fp8xfp4" else layer.prepared
    tok = make_tokens(layer, args.tokens, seed=args.tokens)
    e = layer.l1.num_experts
    counts = torch.bincount(tok.topk_idx[tok.topk_idx >= 0], minlength=e)
    cfg = point_config(layer, args.tokens, counts, num_sms, args.format)
    grouped = group_tokens(tok.x_fp8, tok.x_sf, tok.topk_idx, tok.topk_weights, e, cfg.bm)
    gemm = ExpertGemmSM90(weights, cfg, activation_clamp=CLAMP)
    ws = gemm.workspace(grouped)
    for _ in range(args.repeats):
        gemm.run(grouped, ws)
    dg = import_deep_gemm() if any(kernel.startswith("dg_") for kernel in args.sequence) else None
    kernels = gemm_steps(gemm, grouped, ws, layer, tok, dg)
    steps = [kernels[kernel] for kernel in args.sequence]

    def sequence() -> None:
        for step in steps:
            step()

    if args.graph:
        graph = capture(sequence)
        torch.cuda.profiler.start()
        for _ in range(args.graph):
            graph.replay()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    else:
        sequence()
    torch.cuda.synchronize()
    gemm.check()
    print(f"{args.preset} T={args.tokens} {args.format}: {cfg}, {int(counts.sum())} rows, "
          f"{int((counts > 0).sum())} active experts")


if __name__ == "__main__":
    main()
