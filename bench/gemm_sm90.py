"""SM90 expert GEMMs (W1 -> W2 on grouped tokens) versus DeepGEMM 2.8.2's masked-GEMM pipeline on one H200.

Per preset (``dsv41-flash``, ``glm52``) and tokens per rank ``T`` (docs/bench_protocol.md sweep): the rank-0 share of
``8T`` tokens routed top-k uniformly over ``8e`` experts (bench/_gemm_workload.py). Operators, each
captured in
a CUDA graph and timed by replay (``--warmup`` / ``--windows`` windows of 100 replays, L2 flushed between windows,
median window):

* ``gc_fp8``: this library's FP8xFP8 kernels (W1 with the fused SwiGLU / routing weight / FP8 requant, W2 BF16).
* ``deepgemm_pipeline``: ``m_grouped_fp8_gemm_nt_masked`` W1 on the same FP8 weights, the fused Triton activation
  of bench/_baseline_sm90.py (clamped SwiGLU, routing weight, per-token 1x128 FP8 requant, valid rows only), masked
  W2 (what SGLang's DeepEP low-latency path runs on Hopper); activation scales MN-major (no transpose kernel).
* ``deepgemm_gemms``: the two masked GEMMs alone.
* ``gc_fp4``: this library's FP8xFP4 kernels on MXFP4 weights of the same BF16 layer (window-repacked,
  lane-permuted; FP4 decoded to E4M3 in registers; UE8M0 1x128 intermediate).

Floors per point, over the device-to-device copy bandwidth measured in the same run: FP8 = the active experts' FP8
weight and scale bytes plus the rows' token payload in (FP8 + scales) and out (BF16); FP4 = the active experts'
``1.5 H I`` FP4 bytes + one scale byte per 32 values, plus the same payload. Efficiency = floor / latency (gc_fp4
against the FP4 floor, everything else against the FP8 floor); speedups are DeepGEMM's latency over ours.
Accuracy per point: our partials against the quantization-faithful and BF16 model references.
W1 and W2 are also timed apart (``latency_split_us``: where each family's time goes). Apart, each kernel follows
itself, which flatters W1 where its token tiles are large (up to 17 µs at glm52 T=128: bench/graph_gap_sm90.py,
NOTES session 8); the graph's time is what a model sees.
``GC_MOE_BENCH_TOKENS`` ("64,128,256") restricts the sweep, ``GC_MOE_BENCH_WINDOWS`` the windows (short leases).

Run on an H200 (scripts/device_check.sh does, with DeepGEMM built there):
``python bench/gemm_sm90.py --out bench/results/gemm_sm90.json``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from _baseline_sm90 import DeepGemmMasked, import_deep_gemm, masked_geometry
from _common import (
    PER_WINDOW,
    REPO,
    copy_bandwidth,
    expert_floor_bytes,
    pyplot,
    require_gpus,
    result_meta,
    timed_windows,
    write_result,
)
from _gemm_workload import (
    CLAMP,
    WORLD,
    Layer,
    Tokens,
    make_fp4_layer,
    make_layer,
    make_tokens,
    reference_partials,
    reference_partials_fp4,
)
from _grouping import GroupedTokens, group_tokens, scatter_partials
from _standalone_gemm import ExpertGemmSM90, Workspace, variant_defines
from _standalone_heuristics import KernelConfig, select_config

from gc_moe_compat.compute_paths import compute_path
from gc_moe_compat.config import SWEEP_TOKENS
from gc_moe_compat.operator.heuristics import W1_SLABS, expected_rows_per_expert, tile_rows
from gc_moe_compat.runtime import jit
from gc_moe_compat.testing.reference import accuracy_metrics

TARGETS = {"fp8_efficiency_t_ge_64": 0.7, "fp4_efficiency_t_ge_64": 0.6, "fp4_speedup_vs_deepgemm_t_ge_64": 1.6}


def capture(fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``fn``'s launches (``fn`` runs once first, so that JIT and module load stay out of it)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def time_graph(fn: Callable[[], None], warmup: int, windows: int, replays: int = PER_WINDOW) -> float:
    """Median over windows of (CUDA-event time of ``replays`` replays of a graph of ``fn``) / ``replays``, in µs."""
    graph = capture(fn)

    def window() -> None:
        for _ in range(replays):
            graph.replay()

    return statistics.median(timed_windows(window, warmup, windows, launches=replays)[0])


def split_latency(gemm: ExpertGemmSM90, grouped: GroupedTokens, ws: Workspace, warmup: int, windows: int) -> dict:
    """W1 and W2 timed apart (each its own graph, the same protocol): where a kernel family's time goes. Each
    follows itself here, so W1 finds its own lines in L2 rather than W2's (see the module docstring)."""
    return {
        "w1": time_graph(lambda: gemm.run_w1(grouped, ws), warmup, windows),
        "w2": time_graph(lambda: gemm.run_w2(grouped, ws), warmup, windows),
    }


def point_config(layer: Layer, tokens_per_rank: int, counts: torch.Tensor, num_sms: int, mma_type: str = "fp8xfp8",
                 block_m: int | None = None) -> KernelConfig:
    """The config :func:`select_config` picks for a point with ``counts`` rows per expert: what this benchmark runs
    (bench/profile_gemm_sm90.py and bench/graph_gap_sm90.py run the same)."""
    tiles = 2 * layer.prepared.inter // tile_rows(W1_SLABS)
    rows = expected_rows_per_expert(tokens_per_rank, WORLD, layer.topk, WORLD * layer.l1.num_experts)
    return select_config(rows, int((counts > 0).sum()), tiles, num_sms, mma_type, block_m=block_m,
                         hidden=layer.prepared.hidden)


def floor_bytes(layer: Layer, counts: torch.Tensor, mma_type: str = "fp8xfp8") -> int:
    """:func:`_common.expert_floor_bytes` of this point: the active experts and the rows of ``counts``."""
    h, inter = layer.l1.in_features, layer.l1.out_features // 2
    return expert_floor_bytes(h, inter, int((counts > 0).sum()), int(counts.sum()), mma_type)


class DeepGemmPipeline:
    """DeepGEMM 2.8.2 SM90 masked pipeline (bench/_baseline_sm90.py, fused Triton activation) on the same FP8
    weights, with this point's tokens staged into the masked layout (row ``j`` of expert ``e``: the ``j``-th token
    routed to ``e``, its scales MN-major, its routing weight)."""

    def __init__(self, dg, layer: Layer, tok: Tokens) -> None:  # noqa: ANN001 - the deep_gemm module
        e = layer.l1.num_experts
        idx = tok.topk_idx
        counts = torch.bincount(idx[idx >= 0], minlength=e)
        max_m, expected_m = masked_geometry(counts)
        self.masked = DeepGemmMasked(dg, layer.l1, layer.l2, counts, max_m, expected_m, clamp=CLAMP)
        for ex in range(e):
            tokens, slots = (idx == ex).nonzero(as_tuple=True)
            n = tokens.numel()
            self.masked.x[ex, :n] = tok.x_fp8[tokens]
            self.masked.x_sf_t[ex, :, :n] = tok.x_sf[tokens].T
            self.masked.rw[ex, :n] = tok.topk_weights[tokens, slots]

    def pipeline(self) -> None:
        self.masked.pipeline()

    def gemms(self) -> None:
        self.masked.gemms()


def gemm_steps(gemm: ExpertGemmSM90, grouped: GroupedTokens, ws: Workspace, layer: Layer, tok: Tokens,
               dg=None) -> dict[str, Callable[[], object]]:  # noqa: ANN001 - the deep_gemm module
    """Our W1 and W2 of a point as launchable steps (``w1``, ``w2``, on ``ws``) and, with DeepGEMM's module ``dg``,
    its masked W1 and W2 on the same FP8 weights (``dg_w1``, ``dg_w2``; its W2 reads a written activation, as ours
    does): the kernel sequences of bench/graph_gap_sm90.py and bench/profile_gemm_sm90.py."""
    steps = {"w1": lambda: gemm.run_w1(grouped, ws), "w2": lambda: gemm.run_w2(grouped, ws)}
    if dg is not None:
        base = DeepGemmPipeline(dg, layer, tok).masked
        base.pipeline()
        steps |= {"dg_w1": base.gemm1, "dg_w2": base.gemm2}
    return steps


def sass_record(used: set[tuple[str, KernelConfig]]) -> dict[str, object]:
    """QGMMA / UTMALDG / local-memory counts and ptxas resources of the variants the benchmark ran."""
    cuobjdump = shutil.which("cuobjdump") or "/usr/local/cuda/bin/cuobjdump"
    record = {}
    for mma_type, cfg in sorted(used, key=lambda u: (u[0], u[1].bm, u[1].pipelined, u[1].w2_slabs, u[1].cluster)):
        path = compute_path(mma_type)
        source, kernel = path.kernel, path.standalone_entry
        for epi, stages in ((1, cfg.stages_w1), (2, cfg.stages_w2)):
            defines = variant_defines(cfg.bm, epi, cfg.pipelined, stages, slabs=cfg.w2_slabs, cluster=cfg.cluster)
            cubin = jit.compile_cubin(source, defines)
            try:
                text = subprocess.run([cuobjdump, "--dump-sass", str(cubin.path)], capture_output=True, text=True,
                                      check=True).stdout  # fmt: skip
                ops = {op: text.count(op) for op in ("QGMMA", "UTMALDG", "UBLKCP", "PRMT", "LDL", "STL")}
            except (OSError, subprocess.CalledProcessError) as err:
                ops = {"error": str(err)}
            res = cubin.resources.get(kernel)
            slabs = W1_SLABS if epi == 1 else cfg.w2_slabs
            name = f"{mma_type}_bm{cfg.bm}_{'pipelined' if cfg.pipelined else 'plain'}_w{epi}_slabs{slabs}"
            name += "_cluster" if cfg.cluster else ""
            record[name] = {"sass": ops, "resources": None if res is None else res.__dict__}
    return record


def plot(points: list[dict[str, object]], path: Path) -> None:
    """Latency and efficiency versus tokens per rank, one panel pair per preset (skipped without matplotlib)."""
    plt = pyplot()
    if plt is None:
        return
    presets = sorted({p["preset"] for p in points})
    fig, axes = plt.subplots(2, len(presets), figsize=(6 * len(presets), 7), squeeze=False)
    for col, preset in enumerate(presets):
        pts = [p for p in points if p["preset"] == preset]
        ts = [p["tokens_per_rank"] for p in pts]
        ax = axes[0][col]
        for op in ("gc_fp8", "gc_fp4", "deepgemm_pipeline", "deepgemm_gemms"):
            ys = [p["latency_us"].get(op) for p in pts]
            if any(y is not None for y in ys):
                ax.plot(ts, ys, marker="o", label=op)
        ax.plot(ts, [p["floor_us"] for p in pts], "k--", label="floor (FP8 bytes / copy BW)")
        ax.plot(ts, [p["floor_fp4_us"] for p in pts], "k:", label="floor (FP4 bytes / copy BW)")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{preset}: latency (µs)")
        ax.legend(fontsize=7)
        ax = axes[1][col]
        ax.plot(ts, [p["efficiency"].get("gc_fp8") for p in pts], marker="o", label="gc_fp8 efficiency")
        ax.plot(ts, [p["efficiency"].get("gc_fp4") for p in pts], marker="o", label="gc_fp4 efficiency (FP4 floor)")
        ax.plot(ts, [p["speedup"].get("vs_deepgemm_pipeline") for p in pts], marker="s", label="fp8 x DG pipeline")
        ax.plot(ts, [p["speedup"].get("fp4_vs_deepgemm_pipeline") for p in pts], marker="s", label="fp4 x DG pipeline")
        ax.axhline(0.6, color="grey", lw=0.5)
        ax.axhline(0.7, color="grey", lw=0.5)
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per rank")
        ax.legend(fontsize=7)
    fig.suptitle("SM90 expert GEMMs (W1 -> W2) on one H200, CUDA-graph replay")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/gemm_sm90.json")
    parser.add_argument("--presets", nargs="+", default=["dsv41-flash", "glm52"])
    parser.add_argument("--tokens", nargs="+", type=int, default=list(SWEEP_TOKENS))
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--windows", type=int, default=30)
    parser.add_argument("--block-m", type=int, default=None,
                        help="force this BM for both formats instead of the heuristic's choice (probes of the rule)")
    args = parser.parse_args()
    if os.environ.get("GC_MOE_BENCH_WINDOWS"):  # "WARMUP,WINDOWS": a shorter run inside a device lease
        args.warmup, args.windows = (int(v) for v in os.environ["GC_MOE_BENCH_WINDOWS"].split(","))
    if os.environ.get("GC_MOE_BENCH_TOKENS"):  # "T,T,...": a subset of the sweep inside a device lease
        args.tokens = [int(v) for v in os.environ["GC_MOE_BENCH_TOKENS"].split(",")]
    require_gpus("gemm_sm90")
    torch.cuda.init()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    try:
        dg = import_deep_gemm()
        dg_error = None
    except Exception as err:  # noqa: BLE001 - any import failure is recorded, the rest still runs
        dg, dg_error = None, f"{type(err).__name__}: {err}"
    bandwidth = copy_bandwidth()
    points, used = [], set()
    meta = result_meta(
        "bench/gemm_sm90.py",
        sys.argv[1:],
        {"dispatch_sms": 0, "compute_sms": num_sms, "workqueue": "none (whole device, no green context)"},
        env_keys=("GC_MOE_BENCH_WINDOWS", "GC_MOE_BENCH_TOKENS"),
    )
    meta |= {
        "timing": {"warmup_windows": args.warmup, "windows": args.windows, "replays_per_window": PER_WINDOW},
        "copy_bandwidth_bytes_per_s": bandwidth,
        "deepgemm": "deepinfer-gemm 2.8.2 (built on the device)" if dg is not None else f"unavailable: {dg_error}",
        "targets": TARGETS,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for preset in args.presets:
        layer = make_layer(preset, torch.device("cuda"), seed=1)
        fp4 = make_fp4_layer(layer.l1_bf16, layer.l2_bf16)
        e = layer.l1.num_experts
        for t in args.tokens:
            tok = make_tokens(layer, t, seed=t)
            counts = torch.bincount(tok.topk_idx[tok.topk_idx >= 0], minlength=e)
            cfg = point_config(layer, t, counts, num_sms, block_m=args.block_m)
            used.add(("fp8xfp8", cfg))
            grouped = group_tokens(tok.x_fp8, tok.x_sf, tok.topk_idx, tok.topk_weights, e, cfg.bm)
            gemm = ExpertGemmSM90(layer.prepared, cfg, activation_clamp=CLAMP)
            ws = gemm.workspace(grouped)
            latency = {"gc_fp8": time_graph(lambda g=gemm, gr=grouped, w=ws: g.run(gr, w), args.warmup, args.windows)}
            split = {"gc_fp8": split_latency(gemm, grouped, ws, args.warmup, args.windows)}
            gemm.check()
            ours = scatter_partials(gemm.run(grouped, ws).out, grouped, tok.x.shape[0], layer.topk)
            ref, valid = reference_partials(layer, tok, faithful=True)
            model, _ = reference_partials(layer, tok, faithful=False)
            accuracy = {
                "faithful": accuracy_metrics(ours[valid], ref[valid]),
                "model": accuracy_metrics(ours[valid], model[valid]),
            }
            cfg4 = point_config(layer, t, counts, num_sms, "fp8xfp4", block_m=args.block_m)
            used.add(("fp8xfp4", cfg4))
            gemm4 = ExpertGemmSM90(fp4.prepared, cfg4, activation_clamp=CLAMP)  # same BM rules: same grouping
            ws4 = gemm4.workspace(grouped)
            latency["gc_fp4"] = time_graph(lambda g=gemm4, gr=grouped, w=ws4: g.run(gr, w), args.warmup, args.windows)
            split["gc_fp4"] = split_latency(gemm4, grouped, ws4, args.warmup, args.windows)
            gemm4.check()
            ours4 = scatter_partials(gemm4.run(grouped, ws4).out, grouped, tok.x.shape[0], layer.topk)
            ref4, _ = reference_partials_fp4(layer, fp4, tok, faithful=True)
            accuracy["fp4_faithful"] = accuracy_metrics(ours4[valid], ref4[valid])
            accuracy["fp4_model"] = accuracy_metrics(ours4[valid], model[valid])
            if dg is not None:
                base = DeepGemmPipeline(dg, layer, tok)
                latency["deepgemm_pipeline"] = time_graph(base.pipeline, args.warmup, args.windows)
                latency["deepgemm_gemms"] = time_graph(base.gemms, args.warmup, args.windows)
            floor_us = floor_bytes(layer, counts) / bandwidth * 1e6
            floor_fp4_us = floor_bytes(layer, counts, "fp8xfp4") / bandwidth * 1e6
            point = {
                "preset": preset,
                "mma_type": "fp8xfp8 and fp8xfp4",
                "shared": False,
                "tokens_per_rank": t,
                "rows": int(counts.sum()),
                "active_experts": int((counts > 0).sum()),
                "config": {
                    "bm": cfg.bm,
                    "pipelined": cfg.pipelined,
                    "stages": [cfg.stages_w1, cfg.stages_w2],
                    "stages_fp4": [cfg4.stages_w1, cfg4.stages_w2],
                    "w2_slabs": [cfg.w2_slabs, cfg4.w2_slabs],
                    "cluster": [cfg.cluster, cfg4.cluster],
                },
                "latency_us": latency,
                "latency_split_us": split,
                "per_rank_us": {op: [v] for op, v in latency.items()},
                "floor_us": floor_us,
                "floor_fp4_us": floor_fp4_us,
                "efficiency": {op: (floor_fp4_us if op == "gc_fp4" else floor_us) / v for op, v in latency.items()},
                "speedup": {
                    **{f"vs_{op}": v / latency["gc_fp8"] for op, v in latency.items() if op.startswith("deepgemm")},
                    **{f"fp4_vs_{op}": v / latency["gc_fp4"] for op, v in latency.items() if op.startswith("deepgemm")},
                },
                "accuracy": accuracy,
            }
            points.append(point)
            write_result(args.out, {"meta": meta, "points": points})  # partial results survive
            keys = ("preset", "tokens_per_rank", "config", "latency_us", "latency_split_us", "floor_us", "floor_fp4_us")
            print(json.dumps({k: point[k] for k in keys}))
            del gemm, ws, gemm4, ws4, grouped
        del layer, fp4
        torch.cuda.empty_cache()
    meta["sass"] = sass_record(used)
    write_result(args.out, {"meta": meta, "points": points})
    plot(points, args.out.with_suffix(".png"))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
