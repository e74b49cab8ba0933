"""SGLang's whole Hopper Mega MoE sequence on one H200, against the layer alone, the floor, and (with a shared
expert) the fused operator against routed-only plus a separate shared-expert GEMM on the same inputs.

Operations per point, each captured in one CUDA graph and timed as docs/bench_protocol.md says (100 replays per window,
10 warm-up + 30 measured windows, L2 flushed between windows; median window):

* ``sequence``: what SGLang's Hopper path runs per MoE layer through the ``deep_gemm`` facade,
  ``mega_moe_pre_dispatch_sm90`` (BF16 tokens -> FP8 + FP32 1x128 scales, routing copied and scaled, the fused
  kernel) then ``fp8_mega_moe`` (FP8xFP8, routed experts only: SGLang's pin refuses shared experts on SM90);
* ``layer``: ``fp8_mega_moe`` alone on the staged tokens;
* ``layer_after_spin``: a ~3 µs spin kernel (``torch.cuda._sleep``, no memory traffic: as long as the pre-dispatch)
  then ``layer``: it separates what the pre-dispatch costs from what a gap between two replays of the layer changes
  (the sequence measured below the layer alone at T >= 128); ``spin``: the spin kernel alone;
* probes, only with ``--ops`` (:data:`PROBE_OPS`): ``layer_after_restage`` (the staged tokens, scales and routing
  copied back over themselves from clones, the pre-dispatch's writes without its arithmetic) and ``layer_after_read``
  (the staged FP8 tokens read into a scratch tensor) before ``layer``: whether the layer's dispatch gains from finding
  its tokens in L2;
* ``fused_shared``: the pre-dispatch into a ``num_shared_experts=1`` buffer, then the native ``fp8_fp8_gc_moe`` with
  the shared expert's weights (role4 in the operator's graph, its partial in combine slot k);
* ``separate_shared``: the pre-dispatch, the routed-only ``fp8_mega_moe``, then the shared expert as its own GEMMs
  on the same staged tokens (this project's standalone SM90 FP8 grouped GEMM, W1 with the fused SwiGLU + requant
  epilogue and W2, one expert, the whole device; the FP32 scales transposed into the MN-major layout it reads) and
  the shared output added to ``y``;
* ``fused_shared_k32``: ``fused_shared`` with the shared expert in DeepGEMM's shared recipe (E4M3 with per-row UE8M0
  K32 scales: role4's K32-promoting mainloop), the same draws;
* role4 alone, its nodes as the fused call's graph holds them (on the compute partition, the staged tokens of
  ``fused_shared``), to name what role4 costs inside the layer: ``role4`` (W1 + W2 nodes), ``role4_w1`` (the W1
  node), ``role4_k32`` (both nodes, K32 weights) and ``role4_stage_scales`` / ``role4_w1_stage_scales`` (W1 copying
  each K step's token scales with one thread instead of the block's scales once per task: the code before the
  task-scale region, ``role4_shared.role4_nodes(task_scales=False)``).

``floor_us``: docs/bench_protocol.md's floor of the routed layer (unique active experts' FP8 weights + block scales, the
tokens in and out) over the copy bandwidth measured in the same run; ``floor_shared_us`` adds the shared expert's
weights. ``efficiency`` = floor / latency of ``sequence`` (and ``fused_shared``). Accuracy per point: ``fused_shared``'s
``y`` against the quantization-faithful reference with the shared expert (the staged FP8 tokens the operator read,
slot k summed last), and ``separate_shared`` against ``fused_shared``.

Presets: ``dsv41-flash``, ``glm52`` and ``dsv3`` (DeepSeek-V3 at EP8's per-rank load: H 7168, I 2048, 32 local of
256 experts, top-8, one shared expert, routed scaling 2.5; the other two scale by 1.0), P = 1, capacity 256,
clamp 10, T = 1..256 (``config.SWEEP_TOKENS``).

``python bench/sglang_sequence_sm90.py --out bench/results/sglang_sequence_sm90.json``; ``--ops`` times a subset
(the accuracy and the derived fields need ``fused_shared``, and ``sequence`` / ``layer`` / ``separate_shared`` for
the speedups and the pre-dispatch share; a subset's file is not a protocol result of this file). The file is rewritten
after each preset's sweep: ``meta.presets_measured`` names the presets it holds and ``meta.complete`` is false until
every requested preset ran (a run cut by its limit keeps the presets it finished).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from _common import REPO, copy_bandwidth, expert_floor_bytes, pyplot, require_gpus, result_meta, write_partial_result
from _grouping import GroupedTokens
from _standalone_gemm import (
    EPI_W1,
    EPI_W2,
    ExpertGemmSM90,
    prepare_fp8_weights,
    variant_defines,
)
from _standalone_heuristics import select_config

import gc_moe_compat.deep_gemm as dg
from gc_moe_compat import quant
from gc_moe_compat.ab.prebuild import kernel_jobs, prebuild
from gc_moe_compat.ab.protocol import capture_graph, median_graph_window
from gc_moe_compat.compute_paths import FP8XFP8
from gc_moe_compat.config import PRESETS as CONFIG_PRESETS
from gc_moe_compat.config import SWEEP_TOKENS, preset_shape
from gc_moe_compat.deep_gemm import _seam
from gc_moe_compat.operator import api
from gc_moe_compat.operator.heuristics import tile_rows
from gc_moe_compat.operator.sm90 import role4_shared
from gc_moe_compat.runtime.graph import get_graph
from gc_moe_compat.runtime.green import launch_partition
from gc_moe_compat.runtime.single_rank import single_rank_group
from gc_moe_compat.testing.operator_workload import (
    CAPACITY,
    CLAMP,
    RankInputs,
    make_inputs,
    make_shared_weights,
    make_weights,
    preset_dims,
    reference_results,
)
from gc_moe_compat.testing.reference import ExpertWeights, accuracy_metrics

PRESETS = ("dsv41-flash", "glm52", "dsv3")
OPS = ("sequence", "layer", "fused_shared", "separate_shared")
ROLE4_OPS = {"role4": ("block", True, 2), "role4_w1": ("block", True, 1), "role4_k32": ("k32", True, 2),
             "role4_stage_scales": ("block", False, 2), "role4_w1_stage_scales": ("block", False, 1)}
"""role4 alone: (shared weights' form, task-scale region, nodes: W1 only or W1 + W2)."""
ALL_OPS = (*OPS, "layer_after_spin", "spin", "fused_shared_k32", *ROLE4_OPS)
PROBE_OPS = ("layer_after_restage", "layer_after_read")
"""Chosen with ``--ops`` only (not in the default run): what the pre-dispatch's memory traffic does to the layer."""
SPIN_CYCLES = 6000
"""``layer_after_spin``'s spin: ~3 µs at the H200's 1.98 GHz SM clock, the fused pre-dispatch's length at T = 256."""


def _separate_config(tokens: int, hidden: int, inter: int) -> object:
    """The standalone GEMM's variant for one expert's ``tokens`` rows (the heuristic's, whole device)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return select_config(tokens, 1, 2 * inter // tile_rows(2), sms, "fp8xfp8", hidden=hidden)


def _jobs(preset: str, tokens: list[int]) -> list[tuple[str, dict[str, int]]]:
    """Every kernel variant the preset's points pick: the operator's roles and pre-dispatch (gc-moe-ab's list),
    role4's W1 / W2 variants of both weight forms and both token-scale paths (for the default partition's compute
    SMs; another partition compiles its own at first use) and the standalone GEMM of the separate shared expert."""
    e, k, h, inter = preset_dims(preset)
    jobs = kernel_jobs(["fp8xfp8"], tokens, 1, k, e)
    compute_sms = torch.cuda.get_device_properties(0).multi_processor_count - 4  # the default dispatch request
    shape = preset_shape(preset, 1, mma_type="fp8xfp8")
    for t in tokens:
        for k32, task_scales in ((False, True), (True, True), (False, False)):
            for v in role4_shared.role4_variants(shape, t, compute_sms, k32=k32, task_scales=task_scales):
                jobs.append((role4_shared.SOURCE, v.defines))
    for t in tokens:
        c = _separate_config(t, h, inter)
        for epi, stages in ((EPI_W1, c.stages_w1), (EPI_W2, c.stages_w2)):
            jobs.append((FP8XFP8.kernel, variant_defines(c.bm, epi, c.pipelined, stages, slabs=c.w2_slabs,
                                                 cluster=c.cluster)))
    return jobs


def _one_expert_rows(x: torch.Tensor, tokens: int, bm: int, hidden: int) -> GroupedTokens:
    """The standalone GEMM's input for one expert over the first ``tokens`` staged rows of ``x`` (a view: the
    separate GEMM reads the staged payload in place; only its scales get their own MN-major array)."""
    nb = -(-tokens // bm)
    rows = nb * bm
    start = torch.arange(0, rows, bm, dtype=torch.int32)
    blocks = torch.stack([torch.zeros_like(start), (tokens - start).clamp(max=bm), start], 1).cuda()
    token = torch.arange(rows, dtype=torch.int64)
    token[tokens:] = -1
    return GroupedTokens(x=x[:rows], x_sf_t=torch.zeros(hidden // 128, rows, dtype=torch.float32, device="cuda"),
                         routing_w=torch.ones(rows, dtype=torch.float32, device="cuda"), blocks=blocks,
                         pair_blocks=blocks, num_blocks=torch.tensor([nb], dtype=torch.int32, device="cuda"),
                         row_token=token.cuda(), row_slot=torch.zeros(rows, dtype=torch.int64, device="cuda"),
                         counts=torch.tensor([tokens], dtype=torch.int64), bm=bm)


class PresetRun:
    """One preset's weights and buffers (S = 0 and S = 1 facade buffers), built once for its T sweep."""

    def __init__(self, group: dist.ProcessGroup, preset: str) -> None:
        self.preset = preset
        self.e, self.k, self.h, self.inter = preset_dims(preset)
        self.factor = CONFIG_PRESETS[preset].routed_scaling_factor
        self.weights = make_weights(preset, 0, mma_type="fp8xfp8")
        w1, w2 = self.weights.w1, self.weights.w2
        self.l1, self.l2 = (w1.payload, w1.scales), (w2.payload, w2.scales)  # DeepGEMM's SM90 layout: interleaved L1
        self.shared = make_shared_weights(preset)
        s1, s2 = self.shared
        self.shared_pairs = {"shared_l1_weights": (s1.payload, s1.scales),
                             "shared_l2_weights": (s2.payload, s2.scales)}
        self.shared_k32 = tuple(ExpertWeights.quantize(w.payload, "fp8_k32")
                                for w in make_shared_weights(preset, fmt="bf16"))
        self.shared_pairs_k32 = {name: (w.payload, quant.ue8m0_encode(w.scales))
                                 for name, w in zip(self.shared_pairs, self.shared_k32, strict=True)}
        self.separate_weights = prepare_fp8_weights(s1, s2)
        self.sym = {s: dg.get_symm_buffer_for_mega_moe(group, self.e, CAPACITY, self.k, self.h, self.inter,
                                                       num_shared_experts=s, mma_type="fp8xfp4") for s in (0, 1)}
        self.native = _seam.workspace_of(self.sym[1]).retyped("fp8xfp8")
        self.role4_weights = {"block": role4_shared.Role4Weights(*self.shared_pairs.values()),
                              "k32": role4_shared.Role4Weights(*self.shared_pairs_k32.values())}
        self.role4_tables = role4_shared.Role4Tables(self.native)
        self.partition = launch_partition(self.native.plan, self.native.storage.device.index)

    def role4_op(self, tokens: int, name: str) -> Callable[[], None]:
        """Role4 alone (:data:`ROLE4_OPS`): its nodes for ``tokens`` tokens as one graph on the compute partition."""
        form, task_scales, count = ROLE4_OPS[name]
        nodes = role4_shared.role4_nodes(self.native, self.role4_weights[form], self.role4_tables, tokens,
                                         activation_clamp=CLAMP, task_scales=task_scales)[:count]
        graph = get_graph(nodes, self.partition)
        return lambda: graph.launch()  # on torch's current stream; attached as a child graph while it captures

    def ops(self, tokens: int, seed: int) -> tuple[dict[str, Callable[[], None]], dict[str, torch.Tensor]]:
        """The operations of one point on fresh seeded inputs (:data:`ALL_OPS`), and the output each writes."""
        inputs = make_inputs("uniform", tokens, self.e, self.k, self.h, seed)
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(tokens, self.h, generator=g).to("cuda", torch.bfloat16)
        idx = inputs.topk_idx.to(torch.int32)  # SGLang hands int32 ids to the pre-dispatch
        weights = inputs.topk_weights
        ys = {name: torch.empty(tokens, self.h, dtype=torch.bfloat16, device="cuda")
              for name in (*OPS, "fused_shared_k32")}

        def pre(s: int) -> None:
            b = self.sym[s]
            dg.mega_moe_pre_dispatch_sm90(x, idx, weights, b.x, b.x_sf, b.topk_idx, b.topk_weights,
                                          num_tokens=tokens, routed_scaling_factor=self.factor)

        def layer(y: torch.Tensor) -> None:
            dg.fp8_mega_moe(y, self.l1, self.l2, self.sym[0], activation_clamp=CLAMP)

        config = _separate_config(tokens, self.h, self.inter)
        gemm = ExpertGemmSM90(self.separate_weights, config, activation_clamp=CLAMP)
        grouped = _one_expert_rows(self.sym[0].x, tokens, config.bm, self.h)
        ws = gemm.workspace(grouped)

        def separate() -> None:
            pre(0)
            layer(ys["separate_shared"])
            grouped.x_sf_t[:, :tokens].copy_(self.sym[0].x_sf[:tokens].t())
            gemm.run(grouped, ws)
            ys["separate_shared"].add_(ws.out[:tokens])

        def fused(name: str, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], None]:
            def run() -> None:
                pre(1)
                api.fp8_fp8_gc_moe(ys[name], self.weights.w1, self.weights.w2, self.native, activation_clamp=CLAMP,
                                   check_values=False, **pairs)
            return run

        pre(0)  # ``layer`` and role4 alone time what is staged: this point's tokens, whichever ops run before them
        pre(1)
        b = self.sym[0]
        staged = [(t[:tokens], t[:tokens].clone()) for t in (b.x, b.x_sf, b.topk_idx, b.topk_weights)]
        scratch = torch.empty_like(b.x[:tokens])

        def restage() -> None:
            for dst, src in staged:
                dst.copy_(src)

        ops = {"sequence": lambda: (pre(0), layer(ys["sequence"])), "layer": lambda: layer(ys["layer"]),
               "layer_after_spin": lambda: (torch.cuda._sleep(SPIN_CYCLES), layer(ys["layer"])),
               "spin": lambda: torch.cuda._sleep(SPIN_CYCLES),
               "layer_after_restage": lambda: (restage(), layer(ys["layer"])),
               "layer_after_read": lambda: (scratch.copy_(b.x[:tokens]), layer(ys["layer"])),
               "fused_shared": fused("fused_shared", self.shared_pairs), "separate_shared": separate,
               "fused_shared_k32": fused("fused_shared_k32", self.shared_pairs_k32)}
        ops.update({name: self.role4_op(tokens, name) for name in ROLE4_OPS})
        return ops, ys

    def accuracy(self, tokens: int, ys: dict[str, torch.Tensor], timed: set[str]) -> dict[str, dict[str, float | int]]:
        """Of the timed ops: ``fused_shared`` (and ``fused_shared_k32``) against the faithful reference on what the
        operator read; ``separate_shared`` against ``fused_shared``."""
        b = self.sym[1]
        staged = RankInputs(b.x[:tokens].clone(), b.x_sf[:tokens].clone(), b.topk_idx[:tokens].clone(),
                            b.topk_weights[:tokens].clone())
        out = {}
        for name, shared in (("fused_shared", self.shared), ("fused_shared_k32", self.shared_k32)):
            if name in timed:
                ref = reference_results([staged], [self.weights], shared=shared)[0].y
                out[f"{name}_vs_reference"] = accuracy_metrics(ys[name].float(), ref.float())
        if {"separate_shared", "fused_shared"} <= timed:
            out["separate_vs_fused"] = accuracy_metrics(ys["separate_shared"].float(), ys["fused_shared"].float())
        return out

    def point(self, tokens: int, bandwidth: float, warmup: int, windows: int,
              timed: tuple[str, ...] = ALL_OPS) -> dict[str, object]:
        ops, ys = self.ops(tokens, seed=7000 + tokens)
        latency = {}
        for name in timed:
            op = ops[name]
            op()  # JIT, graphs and conversions outside the capture
            graph = capture_graph(op)
            latency[name] = median_graph_window(graph, warmup, windows)
        active = int(torch.unique(self.sym[1].topk_idx[:tokens]).ge(0).sum())
        floor = expert_floor_bytes(self.h, self.inter, active, tokens) / bandwidth * 1e6
        floor_shared = expert_floor_bytes(self.h, self.inter, active + 1, tokens) / bandwidth * 1e6
        point = {"preset": self.preset, "mma_type": "fp8xfp8", "shared": True, "tokens_per_rank": tokens,
                 "role4_block_m": role4_shared.block_m_for_shared(tokens),
                 "routed_scaling_factor": self.factor, "active_experts": active, "latency_us": latency,
                 "per_rank_us": {name: [us] for name, us in latency.items()},
                 "floor_us": floor, "floor_shared_us": floor_shared,
                 "accuracy": self.accuracy(tokens, ys, set(timed))}
        if set(OPS) <= set(timed):
            point.update({
                "speedup": {"layer_over_sequence": latency["layer"] / latency["sequence"],
                            "separate_over_fused": latency["separate_shared"] / latency["fused_shared"]},
                "pre_dispatch_share_us": latency["sequence"] - latency["layer"],
                "efficiency": {"sequence": floor / latency["sequence"], "layer": floor / latency["layer"],
                               "fused_shared": floor_shared / latency["fused_shared"],
                               "separate_shared": floor_shared / latency["separate_shared"]}})
        return point


def plot(points: list[dict[str, object]], presets: list[str], path: Path) -> None:
    plt = pyplot()
    if plt is None or not set(OPS) <= set(points[0]["latency_us"]):
        return
    fig, axes = plt.subplots(1, len(presets), figsize=(5 * len(presets), 4), squeeze=False)
    for ax, preset in zip(axes[0], presets, strict=True):
        rows = [p for p in points if p["preset"] == preset]
        t = [p["tokens_per_rank"] for p in rows]
        for name, style in (("sequence", "o-"), ("layer", "s--"), ("fused_shared", "^-"), ("separate_shared", "v:")):
            ax.plot(t, [p["latency_us"][name] for p in rows], style, label=name)
        ax.plot(t, [p["floor_us"] for p in rows], "k-", linewidth=0.8, label="floor (routed)")
        ax.plot(t, [p["floor_shared_us"] for p in rows], "k:", linewidth=0.8, label="floor (+ shared)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per rank T")
        ax.set_ylabel("us per layer (graph replay)")
        ax.set_title(preset)
        ax.legend(fontsize=7)
    fig.suptitle("SGLang's Hopper Mega MoE sequence, one H200, P = 1")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_result(args: argparse.Namespace, points: list[dict[str, object]], native: object, bandwidth: float) -> None:
    """The result file of the presets finished so far (``meta.presets_measured``, ``meta.complete``) and its PNG."""
    meta = result_meta("bench/sglang_sequence_sm90.py", sys.argv[1:],
                       {"dispatch_sms": native.dispatch_sms, "compute_sms": native.compute_sms,
                        "workqueue": "plain SM partitioning (see the run's log)", "mode": native.partition})
    meta.update({"capacity": CAPACITY, "activation_clamp": CLAMP, "copy_bandwidth_Bps": bandwidth,
                 "routed_scaling_factor": {p: CONFIG_PRESETS[p].routed_scaling_factor for p in args.presets},
                 "presets": list(args.presets), "warmup": args.warmup, "windows": args.windows,
                 "ops": list(args.ops)})
    write_partial_result(args.out, meta, points, unit="presets", key="preset", requested=args.presets)
    plot(points, [p for p in args.presets if any(q["preset"] == p for q in points)], args.out.with_suffix(".png"))


def print_tables(args: argparse.Namespace, points: list[dict[str, object]]) -> None:
    """The latency table per point, the accuracy lines and, when every op of :data:`OPS` ran, the speedup table."""
    print("| preset | T | BM | " + " | ".join(args.ops) + " |")
    print("|---|---|---|" + "---|" * len(args.ops))
    for p in points:
        print(f"| {p['preset']} | {p['tokens_per_rank']} | {p['role4_block_m']} | "
              + " | ".join(f"{p['latency_us'][name]:.1f}" for name in args.ops) + " |")
    for p in points:
        print(f"{p['preset']} T={p['tokens_per_rank']} accuracy: " + ", ".join(
            f"{k} cos {m['cosine']:.6f}" for k, m in p["accuracy"].items()))
    if not set(OPS) <= set(args.ops):
        return
    print("| preset | T | sequence | layer | pre-dispatch | floor | fused shared | separate shared | separate/fused "
          "| fused cos |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for p in points:
        us = p["latency_us"]
        print(f"| {p['preset']} | {p['tokens_per_rank']} | {us['sequence']:.1f} | {us['layer']:.1f} | "
              f"{p['pre_dispatch_share_us']:.1f} | {p['floor_us']:.1f} | {us['fused_shared']:.1f} | "
              f"{us['separate_shared']:.1f} | {p['speedup']['separate_over_fused']:.3f} | "
              f"{p['accuracy']['fused_shared_vs_reference']['cosine']:.6f} |")


def _run(args: argparse.Namespace, group: dist.ProcessGroup) -> None:
    """Every preset's T sweep on this one-rank group, the result file rewritten after each preset (a run cut by its
    limit keeps the presets it finished), then the tables."""
    jobs = {(src, tuple(sorted(d.items()))): (src, d) for preset in args.presets
            for src, d in _jobs(preset, args.tokens)}
    built = prebuild(list(jobs.values()), workers=16)
    print(f"prebuild: {sum('built' in b for b in built)} built, {sum('cached' in b for b in built)} cached, "
          f"{sum('FAILED' in b for b in built)} failed", flush=True)
    bandwidth = copy_bandwidth()
    points = []
    for preset in args.presets:
        run = PresetRun(group, preset)
        for t in args.tokens:
            points.append(run.point(t, bandwidth, args.warmup, args.windows, tuple(args.ops)))
            p = points[-1]
            print(f"{preset} T={t}: " + ", ".join(f"{k} {v:.1f}" for k, v in p["latency_us"].items())
                  + f" us, floor {p['floor_us']:.1f}", flush=True)
        write_result(args, points, run.native, bandwidth)
    print_tables(args, points)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/sglang_sequence_sm90.json")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--windows", type=int, default=30)
    parser.add_argument("--presets", nargs="+", default=list(PRESETS), choices=PRESETS)
    parser.add_argument("--tokens", nargs="+", type=int, default=list(SWEEP_TOKENS))
    parser.add_argument("--ops", nargs="+", default=list(ALL_OPS), choices=(*ALL_OPS, *PROBE_OPS),
                        help="operations to time (module docstring; default all)")
    args = parser.parse_args()
    require_gpus("sglang_sequence_sm90")
    with single_rank_group() as group:
        _run(args, group)


if __name__ == "__main__":
    main()
