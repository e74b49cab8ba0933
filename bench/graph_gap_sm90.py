"""Where a graph of the standalone SM90 GEMMs loses time against its kernels timed apart (issue 4's FP8 misses).

At glm52 T=128 and dsv41-flash T=256 the graph of W1 -> W2 (bench/gemm_sm90.py's ``gc_fp8``) takes 10-14 µs more
than W1 and W2 each replayed alone (``latency_split_us``); with the sum of the two, both points would beat DeepGEMM's
pipeline. Launch latency (PDL, session 7) and L2 left warm by the split timing (Nsight Compute's cold durations) were
ruled out. This script separates the candidates that remain. Per point (preset, T; default: the two misses and
glm52 T=64, where the excess is ~0), FP8xFP8 with the benchmark's config (:func:`gemm_sm90.point_config`):

* CUDA graphs of the kernel sequences [W1], [W2], [W1, W2], [W1, W1], [W2, W2] and [W2, W1], each timed like the
  benchmark (:func:`gemm_sm90.time_graph`: windows of 100 replays, L2 flushed between windows, median window);
* per two-kernel sequence, ``excess_us`` = its time minus the sum of its kernels alone: an excess only in [W1, W2]
  points at that boundary, one in every pair at any two kernels in one graph;
* the same for DeepGEMM 2.8.2's two masked GEMMs on the same FP8 weights (``dg_w1``, ``dg_w2``, where DeepGEMM
  loads): does the baseline's graph show an excess at the same points?
* during each sequence's windows, ``nvidia-smi`` samples the SM clock and the power draw every 20 ms (clocks are
  only read, never set): a lower clock in the longer graphs would point at power.

Run on the lent H200: ``bash scripts/device_check.sh --bench-only --bench graph_gap_sm90``
(``python bench/graph_gap_sm90.py --out bench/results/graph_gap_sm90.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from types import TracebackType

import torch
from _baseline_sm90 import import_deep_gemm
from _common import PER_WINDOW, REPO, result_meta
from gemm_sm90 import DeepGemmPipeline, point_config, time_graph

from gc_moe_compat.sm90 import group_tokens
from gc_moe_compat.sm90.gemm import ExpertGemmSM90
from gc_moe_compat.sm90.workload import CLAMP, make_layer, make_tokens

SEQUENCES = ("w1", "w2", "w1+w2", "w1+w1", "w2+w2", "w2+w1")
DG_SEQUENCES = ("dg_w1", "dg_w2", "dg_w1+dg_w2")
DEFAULT_POINTS = ("glm52:128", "dsv41-flash:256", "glm52:64")
SAMPLE_MS = 20


class GpuSampler:
    """``nvidia-smi`` reading one GPU's SM clock (MHz) and power draw (W) every SAMPLE_MS while the block runs;
    ``summary()`` gives their medians and the lowest clock, or why there are none."""

    def __init__(self, gpu: str) -> None:
        self.gpu = gpu
        self.proc: subprocess.Popen[str] | None = None
        self.out = ""
        self.error: str | None = None

    def __enter__(self) -> GpuSampler:
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", f"--id={self.gpu}", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                 f"--loop-ms={SAMPLE_MS}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError as err:
            self.error = f"nvidia-smi: {err}"
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.out = self.proc.communicate(timeout=10)[0]

    def summary(self) -> dict[str, object]:
        return parse_samples(self.out) if self.error is None else {"unavailable": self.error}


def parse_samples(text: str) -> dict[str, object]:
    """Medians of ``nvidia-smi``'s "clock, power" CSV lines (lines that are not two numbers are skipped)."""
    clocks, powers = [], []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        try:
            clock, power = float(fields[0]), float(fields[1])
        except (IndexError, ValueError):
            continue
        clocks.append(clock)
        powers.append(power)
    if not clocks:
        return {"unavailable": "no samples"}
    return {"samples": len(clocks), "sm_clock_mhz_median": statistics.median(clocks),
            "sm_clock_mhz_min": min(clocks), "power_w_median": statistics.median(powers)}


def excess(latency: dict[str, float]) -> dict[str, float]:
    """Each two-kernel sequence's time minus the sum of its kernels alone (µs)."""
    return {seq: latency[seq] - sum(latency[k] for k in seq.split("+")) for seq in latency if "+" in seq}


def visible_gpu() -> str:
    """The ``nvidia-smi`` id of torch's device 0: the first entry of CUDA_VISIBLE_DEVICES, else 0."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return visible or "0"


def measure_point(preset: str, t: int, num_sms: int, gpu: str, warmup: int, windows: int,
                  dg: object | None) -> dict[str, object]:
    """Every sequence of one point (DeepGEMM's too where ``dg`` is the loaded module), timed, with its GPU samples
    and the two-kernel excesses."""
    layer = make_layer(preset, torch.device("cuda"), seed=1)
    tok = make_tokens(layer, t, seed=t)
    counts = torch.bincount(tok.topk_idx[tok.topk_idx >= 0], minlength=layer.l1.num_experts)
    cfg = point_config(layer, t, counts, num_sms)
    grouped = group_tokens(tok.x_fp8, tok.x_sf, tok.topk_idx, tok.topk_weights, layer.l1.num_experts, cfg.bm)
    gemm = ExpertGemmSM90(layer.prepared, cfg, activation_clamp=CLAMP)
    ws = gemm.run(grouped)  # W2 of every sequence reads a written intermediate
    kernels = {"w1": lambda: gemm.run_w1(grouped, ws), "w2": lambda: gemm.run_w2(grouped, ws)}
    sequences = SEQUENCES
    if dg is not None:
        base = DeepGemmPipeline(dg, layer, tok).masked
        base.pipeline()  # its W2 reads a written activation, as ours does
        kernels |= {"dg_w1": base.gemm1, "dg_w2": base.gemm2}
        sequences += DG_SEQUENCES
    latency, samples = {}, {}
    for seq in sequences:
        steps = [kernels[k] for k in seq.split("+")]
        with GpuSampler(gpu) as sampler:
            latency[seq] = time_graph(lambda s=steps: [step() for step in s], warmup, windows)
        samples[seq] = sampler.summary()
    gemm.check()
    return {"preset": preset, "tokens_per_rank": t, "mma_type": "fp8xfp8",
            "config": {"bm": cfg.bm, "pipelined": cfg.pipelined, "cluster": cfg.cluster,
                       "stages": [cfg.stages_w1, cfg.stages_w2], "w2_slabs": cfg.w2_slabs},
            "latency_us": latency, "excess_us": excess(latency), "gpu_samples": samples}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/graph_gap_sm90.json")
    parser.add_argument("--points", nargs="+", default=list(DEFAULT_POINTS), help="PRESET:T, FP8xFP8")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--windows", type=int, default=30)
    args = parser.parse_args()
    torch.cuda.init()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    gpu = visible_gpu()
    try:
        dg = import_deep_gemm()
        dg_status = "deepinfer-gemm 2.8.2 (built on the device)"
    except Exception as err:  # noqa: BLE001 - any import failure is recorded, our sequences still run
        dg, dg_status = None, f"unavailable: {type(err).__name__}: {err}"
    partition = {"dispatch_sms": 0, "compute_sms": num_sms, "workqueue": "none (whole device, no green context)"}
    meta = result_meta("bench/graph_gap_sm90.py", sys.argv[1:], partition)
    meta["timing"] = {"warmup_windows": args.warmup, "windows": args.windows, "replays_per_window": PER_WINDOW,
                      "sampler_ms": SAMPLE_MS}
    meta["deepgemm"] = dg_status
    args.out.parent.mkdir(parents=True, exist_ok=True)
    points = []
    for spec in args.points:
        preset, tokens = spec.split(":")
        point = measure_point(preset, int(tokens), num_sms, gpu, args.warmup, args.windows, dg)
        points.append(point)
        args.out.write_text(json.dumps({"meta": meta, "points": points}, indent=1))  # partial results survive
        print(f"{spec} bm={point['config']['bm']}: "
              + ", ".join(f"{k} {v:.1f}" for k, v in point["latency_us"].items())
              + " | excess " + ", ".join(f"{k} {v:+.1f}" for k, v in point["excess_us"].items())
              + " | SM MHz " + ", ".join(f"{k} {c.get('sm_clock_mhz_median', '-')}"
                                         for k, c in point["gpu_samples"].items()))
        torch.cuda.empty_cache()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
