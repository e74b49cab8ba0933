"""The FP8xFP8 GC-MoE operator on two H200s (issue 5) against its partition-off ablation and the composed baseline.

Per preset (``dsv41-flash``, ``glm52``) and tokens per rank ``T`` (docs/bench_protocol.md sweep), world size 2,
``E = 2e`` experts, per-rank capacity 256, FP8 weights with FP32 128x128 block scales (recipe (128, 128, 128)),
uniform top-k routing without repetition (seeded per rank and T), every rank's inputs identical for all three
operators, each captured in a CUDA graph and timed by replay:

* ``gc_moe``: ``api.fp8_fp8_gc_moe`` on a ``partition="on"`` buffer (role1 on the communication green context,
  role2/role3 on the compute one, concurrently).
* ``gc_moe_no_partition``: the same kernels on a ``partition="off"`` buffer (in sequence on the whole device:
  the ``GC_MOE_PARTITION=off`` partition ablation; role2 may start beside role1 behind its programmatic edge).
* ``composed_baseline``: torch.distributed ``all_to_all_single`` (NCCL) dispatch and combine around DeepGEMM
  2.8.2's masked W1 / W2 with a fused Triton activation (bench/_baseline_sm90.py). Its split sizes and row
  permutations are planned on the host before capture, which favours it. Recorded as unavailable, with the
  reason, where ``import deep_gemm`` fails.

Timing (docs/bench_protocol.md): windows of 100 replays, ``--warmup`` / ``--windows`` (10 / 30) windows, L2 flushed
and the device synchronized between windows, a device-side all-reduce aligning both ranks' window starts; each
rank's median window, a point's latency the slowest rank's. Floor per point: per rank, its unique active experts'
FP8 weights + block scales plus its received rows in (FP8 + FP32 scales) and out (BF16 partials), over the copy
bandwidth that rank measured in this run; the point's floor is the largest. Accuracy per point and rank: ``y``
of each operator against the 2-rank quantization-faithful reference (``gc_moe_compat.testing.reference``), and every
graph's replayed ``y`` bit-identical to its eager run.

The script starts its own two ranks: run as ``python bench/operator_sm90.py`` it compiles the operator's kernel
variants and warms DeepGEMM's JIT up in parallel processes, then re-executes itself under
``python -m torch.distributed.run --standalone --nproc-per-node=2``; rank 0 writes the result and the PNG.
scripts/device_check.sh runs it as ``--bench operator_sm90`` (result name ``operator_sm90_x2``).
``GC_MOE_BENCH_TOKENS`` ("1,8,64") and ``GC_MOE_BENCH_WINDOWS`` ("WARMUP,WINDOWS") shorten a run.

``python bench/operator_sm90.py --out bench/results/operator_sm90_x2.json``
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import _baseline_sm90 as base
import torch
from _baseline_sm90 import A2APlan, plan_all_to_all
from _common import (
    PER_WINDOW,
    REPO,
    copy_bandwidth,
    expert_floor_bytes,
    pyplot,
    require_gpus,
    result_meta,
)
from _common import write_result as write_file

from gc_moe_compat.ab import results
from gc_moe_compat.ab.protocol import capture_graph, median_graph_window, portable_path, torchrun_command
from gc_moe_compat.config import SWEEP_TOKENS
from gc_moe_compat.operator.heuristics import block_m_for_call
from gc_moe_compat.testing.operator_workload import CAPACITY, CLAMP, make_inputs, preset_dims

WORLD = 2
OPS = ("gc_moe", "gc_moe_no_partition", "composed_baseline")
PRESETS = ("dsv41-flash", "glm52")
SEED_BASE = 50_000
BUDGET_S = 380
"""Default wall-clock budget of the whole run (prebuild + ranks): the ranks start no point that would end past it
(estimated from the previous point) and the launcher stops them GRACE_S after it."""
GRACE_S = 45
DEADLINE_ENV = "GC_MOE_BENCH_DEADLINE"
"""Set by the launcher for the ranks: the budget's end (``time.time()`` seconds)."""
COSINE_FAITHFUL, PROCESSED_FAITHFUL = 0.9999, 1e-4
"""docs/bench_protocol.md reference-1 targets (the operator)."""
COSINE_BASELINE = 0.99
"""The composed baseline's numerics check against the same faithful reference."""
TARGETS = {
    "gc_moe_faster_than_composed_baseline": "speedup composed_baseline/gc_moe > 1 at every point",
    "speedup_vs_no_partition_t4_to_32": "no_partition/gc_moe >= 1.10 at T = 4..32",
    "t1_within_3x_floor": "gc_moe latency <= 3 x floor at T = 1",
}
NO_PARTITION_MIN, NO_PARTITION_TOKENS, T1_FLOOR_FACTOR = 1.10, (4, 8, 16, 32), 3.0
ENV_KEYS = ("GC_MOE_BENCH_WINDOWS", "GC_MOE_BENCH_TOKENS", "GC_MOE_DISPATCH_SMS")


# ------------------------------------------------------------------------------------------------ host-side parts
def input_seed(tokens: int, rank: int) -> int:
    """Seed of rank ``rank``'s inputs at ``tokens`` tokens per rank (same on every rank: the reference needs all)."""
    return SEED_BASE + tokens * WORLD + rank


def point_routing(preset: str, tokens: int) -> list[torch.Tensor]:
    """Every rank's ``topk_idx [T, k]`` (CPU) of a point: the routing :func:`make_inputs` draws for it."""
    e, k, h, _ = preset_dims(preset)
    return [make_inputs("uniform", tokens, e * WORLD, k, h, seed=input_seed(tokens, r), device="cpu").topk_idx
            for r in range(WORLD)]


def rank_floor_bytes(plan: A2APlan, hidden: int, inter: int) -> int:
    """docs/bench_protocol.md floor bytes of one rank: its unique active experts' FP8 weights + block scales, plus the
    rows it computes in (FP8 + FP32 1x128 scales) and out (BF16 partials)."""
    return expert_floor_bytes(hidden, inter, plan.active_experts, plan.rows_received, "fp8xfp8")


def _accuracy_summary(per_rank: Sequence[dict[str, float | int]], bit_identical: Sequence[bool]) -> dict[str, object]:
    return {
        "cosine_min": min(m["cosine"] for m in per_rank),
        "processed_diff_max": max(m["processed_diff"] for m in per_rank),
        "max_abs_err_max": max(m["max_abs_err"] for m in per_rank),
        "nonfinite": sum(int(m["nonfinite"]) for m in per_rank),
        "graph_bit_identical_to_eager": all(bit_identical),
        "per_rank": list(per_rank),
    }


def assemble_point(preset: str, tokens: int, records: Sequence[dict[str, object]], floor_us: float,
                   routing: dict[str, list[int]]) -> dict[str, object]:
    """One point of the result file from every rank's record.

    A rank record holds ``latency_us`` (op -> that rank's median window), ``accuracy`` (op -> metrics against the
    faithful reference), ``bit_identical`` (op -> replayed y equal to the eager y) and ``unavailable`` (op ->
    reason). An op is reported where every rank has its latency; otherwise its reasons are kept under
    ``unavailable``.
    """
    if len(records) != WORLD:
        raise ValueError(f"records: need one per rank ({WORLD}), got {len(records)}")
    latency, per_rank, accuracy, unavailable = {}, {}, {}, {}
    for op in OPS:
        reasons = sorted({str(r["unavailable"][op]) for r in records if op in r.get("unavailable", {})})
        if reasons or not all(op in r["latency_us"] for r in records):
            unavailable[op] = "; ".join(reasons) or "not measured on every rank"
            continue
        per_rank[op] = [float(r["latency_us"][op]) for r in records]
        latency[op] = max(per_rank[op])
        accuracy[op] = _accuracy_summary([r["accuracy"][op] for r in records],
                                         [bool(r["bit_identical"][op]) for r in records])
    speedup = {}
    if "gc_moe" in latency:
        for op, key in (("composed_baseline", "composed_baseline_over_gc_moe"),
                        ("gc_moe_no_partition", "no_partition_over_gc_moe")):
            if op in latency:
                speedup[key] = latency[op] / latency["gc_moe"]
    if "gc_moe" in accuracy:
        a = accuracy["gc_moe"]
        a["meets_faithful_targets"] = (a["cosine_min"] >= COSINE_FAITHFUL
                                       and a["processed_diff_max"] <= PROCESSED_FAITHFUL and a["nonfinite"] == 0)
    if "composed_baseline" in accuracy:
        a = accuracy["composed_baseline"]
        a["cosine_ge_0.99"] = a["cosine_min"] >= COSINE_BASELINE and a["nonfinite"] == 0
    point: dict[str, object] = {
        "preset": preset,
        "mma_type": "fp8xfp8",
        "shared": False,
        "tokens_per_rank": tokens,
        "routing": routing,
        "latency_us": latency,
        "per_rank_us": per_rank,
        "speedup": speedup,
        "floor_us": floor_us,
        "efficiency": {op: floor_us / us for op, us in latency.items()},
        "accuracy": accuracy,
    }
    if unavailable:
        point["unavailable"] = unavailable
    return point


def summarize_targets(points: Sequence[dict[str, object]]) -> dict[str, object]:
    """The issue's targets as booleans with the values behind them (``None`` where nothing could be measured)."""
    base = [(p["preset"], p["tokens_per_rank"], p["speedup"].get("composed_baseline_over_gc_moe")) for p in points]
    measured = [b for b in base if b[2] is not None]
    nopart = [(p["preset"], p["tokens_per_rank"], p["speedup"].get("no_partition_over_gc_moe")) for p in points
              if p["tokens_per_rank"] in NO_PARTITION_TOKENS]
    nopart_measured = [n for n in nopart if n[2] is not None]
    t1 = [(p["preset"], p["latency_us"]["gc_moe"] / p["floor_us"]) for p in points
          if p["tokens_per_rank"] == 1 and "gc_moe" in p["latency_us"]]

    def verdict(values: list[bool], complete: bool) -> bool | None:
        return None if not values else (all(values) and complete)

    return {
        "gc_moe_faster_than_composed_baseline": {
            "met": verdict([s > 1.0 for *_, s in measured], len(measured) == len(base)),
            "min_speedup": min((s for *_, s in measured), default=None),
            "points_missed": [[p, t, s] for p, t, s in measured if s <= 1.0],
            "points_unmeasured": [[p, t] for p, t, s in base if s is None],
        },
        "speedup_vs_no_partition_t4_to_32": {
            "met": verdict([s >= NO_PARTITION_MIN for *_, s in nopart_measured], len(nopart_measured) == len(nopart)),
            "threshold": NO_PARTITION_MIN,
            "values": [[p, t, s] for p, t, s in nopart_measured],
        },
        "t1_within_3x_floor": {
            "met": verdict([r <= T1_FLOOR_FACTOR for _, r in t1], True),
            "factor": T1_FLOOR_FACTOR,
            "latency_over_floor": [[p, r] for p, r in t1],
        },
        "descriptions": TARGETS,
    }


def validate_result(data: dict[str, object]) -> None:
    """Raises ``ValueError`` naming the first field where ``data`` departs from docs/bench_protocol.md's result schema
    (:func:`gc_moe_compat.ab.results.validate_result`, with this benchmark's ops) plus this benchmark's fields."""
    meta = data.get("meta")
    if isinstance(meta, dict):
        if meta.get("world_size") != WORLD:
            raise ValueError(f"meta.world_size: must be {WORLD}, got {meta.get('world_size')}")
        if not isinstance(meta.get("command"), str) or "bench/operator_sm90.py" not in meta["command"]:
            raise ValueError(f"meta.command: must run bench/operator_sm90.py, got {meta.get('command')!r}")
        if "targets" not in meta:
            raise ValueError("meta.targets: missing")
    results.validate_result(data, known_ops=OPS)


# ------------------------------------------------------------------------------------------------- prebuild (host)
def _prebuild_operator_kernels(presets: Sequence[str], tokens: Sequence[int]) -> list[str]:
    """nvcc builds (into the shared cubin cache) of role1, role3 and the role2 variants the sweep can pick, in
    threads; returns one line per build."""
    from gc_moe_compat.operator.sm90 import role1_dispatch, role2_gemm, role3_finalize
    from gc_moe_compat.runtime import jit

    bms = set()
    for preset in presets:
        e, k, _, _ = preset_dims(preset)
        bms |= {block_m_for_call(t, WORLD, k, e * WORLD, mma_type="fp8xfp8") for t in tokens}
    jobs = [(role1_dispatch.SOURCE, {}), (role3_finalize.SOURCE, {})]
    variants = [v for bm in sorted(bms) for v in role2_gemm.variants_of(bm, "fp8xfp8")]
    jobs += [(v.source, v.defines) for v in variants]
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        cubins = list(pool.map(lambda job: jit.compile_cubin(*job), jobs))
    return [f"{src} {defs}: {'cached' if c.from_cache else 'built'}"
            for (src, defs), c in zip(jobs, cubins, strict=True)]


def _warm_deepgemm(device: int, calls: Sequence[tuple[str, int, int]]) -> str:
    """Runs each ``(preset, max_m, expected_m)`` masked pipeline once on zero data (DeepGEMM JIT and Triton into
    their disk caches), plus the composed baseline's data-movement kernels for each preset."""
    torch.cuda.set_device(device)
    dg = base.import_deep_gemm()

    from gc_moe_compat.testing.reference import ExpertWeights

    t0 = time.monotonic()
    weights: dict[str, tuple[ExpertWeights, ExpertWeights]] = {}
    for preset, max_m, expected_m in calls:
        e, k, h, inter = preset_dims(preset)
        if preset not in weights:
            fp8, dev = torch.float8_e4m3fn, "cuda"
            weights = {preset: (  # one preset's zero weights at a time
                ExpertWeights("fp8_block128", torch.zeros(e, 2 * inter, h, dtype=fp8, device=dev),
                              torch.ones(e, 2 * inter // 128, h // 128, device=dev)),
                ExpertWeights("fp8_block128", torch.zeros(e, h, inter, dtype=fp8, device=dev),
                              torch.ones(e, h // 128, inter // 128, device=dev)))}
            x = torch.zeros(1, h, dtype=fp8, device=dev)
            sf, w = torch.zeros(1, h // 128, device=dev), torch.zeros(1, k, device=dev)
            one = torch.zeros(1, dtype=torch.int32, device=dev)
            send = torch.zeros(1, base.row_words(h), dtype=torch.int32, device=dev)
            rows = torch.zeros(1, h, dtype=torch.bfloat16, device=dev)
            pipe0 = base.DeepGemmMasked(dg, *weights[preset], torch.zeros(e), 128, 1, CLAMP)
            base.pack_rows(x, sf, w, one, one, send)
            base.unpack_rows(send, one.long(), pipe0.x, pipe0.x_sf_t, pipe0.rw)
            base.gather_rows(pipe0.d2.view(-1, h), one.long(), rows)
            base.combine_slots(rows, torch.zeros(1, k, dtype=torch.int64, device=dev), rows[:, :h].clone())
        pipe = base.DeepGemmMasked(dg, *weights[preset], torch.zeros(e), max_m, expected_m, CLAMP)
        pipe.pipeline()
        torch.cuda.synchronize()
    return f"cuda:{device} warmed {len(calls)} DeepGEMM shapes in {time.monotonic() - t0:.1f} s"


def _deepgemm_calls(presets: Sequence[str], tokens: Sequence[int]) -> list[tuple[str, int, int]]:
    calls = set()
    for preset in presets:
        e, *_ = preset_dims(preset)
        for t in tokens:
            routing = point_routing(preset, t)
            for r in range(WORLD):
                plan = plan_all_to_all(routing, e * WORLD, r)
                calls.add((preset, plan.max_m, plan.expected_m))
    return sorted(calls)


def prebuild(presets: Sequence[str], tokens: Sequence[int], workers: int) -> None:
    """Compile every kernel the ranks will need before they start, in parallel: the operator's cubins (nvcc
    threads) and DeepGEMM's / Triton's JIT (``workers`` processes over both GPUs). Failures are printed and left
    to the ranks (which record DeepGEMM as unavailable if it cannot be imported)."""
    t0 = time.monotonic()
    calls = _deepgemm_calls(presets, tokens)
    chunks = [calls[i::workers] for i in range(workers) if calls[i::workers]]
    if not chunks:
        return
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(len(chunks), mp_context=ctx) as procs:
        futures = [procs.submit(_warm_deepgemm, i % WORLD, chunk) for i, chunk in enumerate(chunks)]
        try:
            for line in _prebuild_operator_kernels(presets, tokens):
                print(f"prebuild: {line}", flush=True)
        except Exception as err:  # noqa: BLE001 - the ranks build (and report) what is missing themselves
            print(f"prebuild: operator kernels failed: {type(err).__name__}: {err}", flush=True)
        for fut in futures:
            try:
                print(f"prebuild: {fut.result()}", flush=True)
            except Exception as err:  # noqa: BLE001 - e.g. no deep_gemm: the ranks record it as unavailable
                print(f"prebuild: DeepGEMM warm-up failed: {type(err).__name__}: {err}", flush=True)
    print(f"prebuild: {time.monotonic() - t0:.1f} s", flush=True)


# ------------------------------------------------------------------------------------------------ the ranks (GPU)
class Ranks:
    """The process group of this run and the collective helpers every rank calls in the same order."""

    def __init__(self) -> None:
        import torch.distributed as dist

        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        self.dist, self.group = dist, dist.group.WORLD
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.world != WORLD:
            raise ValueError(f"world size: this benchmark runs on {WORLD} ranks, got {self.world}")
        self._one = torch.zeros(1, device="cuda")

    def align(self) -> None:
        """A device-side barrier: an all-reduce on the current stream (window starts line up on both GPUs)."""
        self.dist.all_reduce(self._one, group=self.group)

    def gather(self, obj: object) -> list[object]:
        out: list[object] = [None] * self.world
        self.dist.all_gather_object(out, obj, group=self.group)
        return out


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def measure_op(name: str, run: Callable[[], torch.Tensor], y_ref: torch.Tensor, ranks: Ranks, record: dict,
               args: argparse.Namespace, check: Callable[[], None] | None = None) -> None:
    """Eager run (builds and JITs) -> accuracy; capture; timed replays; replayed y bit-identical to the eager one.
    Every rank calls it for the same op; a failure on any rank marks the op unavailable on all of them."""
    from gc_moe_compat.testing.reference import accuracy_metrics

    error, graph, eager = None, None, None
    try:
        y = run()
        torch.cuda.synchronize()
        record["accuracy"][name] = accuracy_metrics(y.float(), y_ref.float())
        eager = y.clone()
        graph = capture_graph(run)
    except Exception as err:  # noqa: BLE001 - recorded (both ranks skip the timing together)
        error = f"{type(err).__name__}: {err}"
        traceback.print_exc()
    errors = [e for e in ranks.gather(error) if e]
    if errors:
        record["unavailable"][name] = f"failed: {errors[0]}"
        return
    latency = median_graph_window(graph, args.warmup, args.windows, ranks.align)
    torch.cuda.synchronize()
    del graph
    try:
        if check is not None:
            check()
    except Exception as err:  # noqa: BLE001 - a device-side error makes the timing meaningless: recorded
        error = f"{type(err).__name__}: {err}"
    errors = [e for e in ranks.gather(error) if e]
    if errors:
        record["unavailable"][name] = f"device error after the timed replays: {errors[0]}"
        return
    record["latency_us"][name] = latency
    record["bit_identical"][name] = _bits_equal(y, eager)


def measure_gc_moe(ranks: Ranks, bufs: dict[str, object], w1: object, w2: object, inputs: object,
                   y_ref: torch.Tensor, record: dict, args: argparse.Namespace) -> None:
    """``gc_moe`` (partition on) and ``gc_moe_no_partition`` (off) on this rank's staged inputs."""
    from gc_moe_compat.operator import api
    from gc_moe_compat.operator.sm90 import layer
    from gc_moe_compat.testing.operator_workload import stage

    for op, mode in (("gc_moe", "on"), ("gc_moe_no_partition", "off")):
        buf = bufs[mode]
        stage(buf, inputs)
        y = torch.empty(inputs.tokens, buf.shape.hidden, dtype=torch.bfloat16, device="cuda")
        torch.cuda.synchronize()
        ranks.dist.barrier()  # both ranks staged before either dispatches

        def run(y: torch.Tensor = y, buf: api.GcMoeBuffer = buf) -> torch.Tensor:
            api.fp8_fp8_gc_moe(y, w1, w2, buf, check_values=not torch.cuda.is_current_stream_capturing())
            return y

        measure_op(op, run, y_ref, ranks, record, args,
                   check=lambda buf=buf, op=op: layer.raise_for_layer_status(buf, f"{op} replays"))


def measure_baseline(ranks: Ranks, dg: object, plan: A2APlan, weights: tuple, inputs: object, y_ref: torch.Tensor,
                     record: dict, args: argparse.Namespace) -> None:
    """``composed_baseline`` on this rank (set up on every rank before any collective)."""
    error, composed = None, None
    try:
        composed = base.ComposedBaseline(dg, ranks.group, plan, *weights, clamp=CLAMP)
        composed.stage(inputs.x, inputs.x_sf, inputs.topk_weights)
    except Exception as err:  # noqa: BLE001 - recorded; both ranks then skip it together
        error = f"{type(err).__name__}: {err}"
        traceback.print_exc()
    errors = [e for e in ranks.gather(error) if e]
    if errors:
        record["unavailable"]["composed_baseline"] = f"setup failed: {errors[0]}"
        return
    torch.cuda.synchronize()
    ranks.dist.barrier()
    measure_op("composed_baseline", composed.run, y_ref, ranks, record, args)


def run_ranks(args: argparse.Namespace) -> None:
    """Every rank: weights, buffers, the three operators per point; rank 0 assembles and writes the result."""
    from gc_moe_compat.operator import api
    from gc_moe_compat.runtime.green import get_partition
    from gc_moe_compat.testing.operator_workload import make_expert_weights, reference_ys

    ranks = Ranks()
    rank = ranks.rank
    try:
        dg = base.import_deep_gemm()
        baseline_off = None
    except Exception as err:  # noqa: BLE001 - any import failure is recorded, the rest still runs
        dg, baseline_off = None, f"import deep_gemm failed: {type(err).__name__}: {err}"
    bandwidths = ranks.gather(copy_bandwidth())
    points: list[dict[str, object]] = []
    partitions: dict[str, object] = {}
    t_start = time.monotonic()
    deadline = float(os.environ[DEADLINE_ENV]) if os.environ.get(DEADLINE_ENV) else math.inf
    skipped: list[list[object]] = []
    last_point_s = 0.0
    for preset in args.presets:
        if skipped:
            skipped += [[preset, t] for t in args.tokens]
            continue
        e, k, h, inter = preset_dims(preset)
        num_experts = e * WORLD
        canon = [make_expert_weights(preset, r) for r in range(WORLD)]  # every rank's: the reference needs them
        l1, l2 = canon[rank]
        w1, w2 = api.transform_weights_for_gc_moe((l1.payload, l1.scales), (l2.payload, l2.scales), "fp8xfp8")
        bufs = {mode: api.get_symm_buffer_for_gc_moe(ranks.group, num_experts, CAPACITY, k, h, inter, "fp8xfp8",
                                                        partition=mode) for mode in ("on", "off")}
        if not partitions:
            partitions = {**get_partition(bufs["on"].dispatch_sms).describe(), "buffer": bufs["on"].describe(),
                          "no_partition_buffer": bufs["off"].describe()}
        for t in args.tokens:
            # rank 0 decides for both: start no point that would end past the budget
            if skipped or ranks.gather(time.time() + 1.5 * last_point_s > deadline)[0]:
                skipped.append([preset, t])
                continue
            t0 = time.monotonic()
            inputs = [make_inputs("uniform", t, num_experts, k, h, seed=input_seed(t, r)) for r in range(WORLD)]
            y_ref = reference_ys(inputs, canon)[rank]
            plans = [plan_all_to_all([i.topk_idx for i in inputs], num_experts, r) for r in range(WORLD)]
            record: dict[str, dict] = {"latency_us": {}, "accuracy": {}, "bit_identical": {}, "unavailable": {}}
            measure_gc_moe(ranks, bufs, w1, w2, inputs[rank], y_ref, record, args)
            if baseline_off is None:
                measure_baseline(ranks, dg, plans[rank], (l1, l2), inputs[rank], y_ref, record, args)
                if "composed_baseline" in record["unavailable"]:  # same on both ranks (decided collectively)
                    baseline_off = f"{record['unavailable']['composed_baseline']} (first at {preset} T={t})"
            else:
                record["unavailable"]["composed_baseline"] = baseline_off
            records = ranks.gather(record)
            floor_us = max(rank_floor_bytes(p, h, inter) / bw * 1e6 for p, bw in zip(plans, bandwidths, strict=True))
            routing = {"rows_sent": [p.rows_sent for p in plans], "rows_received": [p.rows_received for p in plans],
                       "active_experts": [p.active_experts for p in plans], "max_m": [p.max_m for p in plans],
                       "expected_m": [p.expected_m for p in plans]}
            points.append(assemble_point(preset, t, records, floor_us, routing))
            last_point_s = time.monotonic() - t0
            if rank == 0:
                write_result(args, points, partitions, bandwidths, baseline_off, skipped, final=False)
                lat = ", ".join(f"{op} {us:.1f}" for op, us in points[-1]["latency_us"].items())
                print(f"{preset} T={t}: {lat} µs, floor {floor_us:.1f} µs ({time.monotonic() - t0:.1f} s)", flush=True)
        for buf in bufs.values():
            buf.destroy()
        del bufs, canon, l1, l2, w1, w2
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    if rank == 0:
        write_result(args, points, partitions, bandwidths, baseline_off, skipped, final=True)
        print_table(points)
        print(f"ranks ran {time.monotonic() - t_start:.1f} s; wrote {args.out}", flush=True)
    ranks.dist.barrier()


def write_result(args: argparse.Namespace, points: list[dict[str, object]], partition: dict[str, object],
                 bandwidths: list[float], baseline_off: str | None, skipped: list[list[object]], *,
                 final: bool) -> None:
    """The result file (after every point, so partial results survive) and, at the end, the PNG."""
    meta = result_meta("bench/operator_sm90.py", sys.argv[1:], partition, world_size=WORLD, env_keys=ENV_KEYS)
    meta |= {
        "timing": {"warmup_windows": args.warmup, "windows": args.windows, "replays_per_window": PER_WINDOW,
                   "window_start": "device all-reduce across ranks after the L2 flush and synchronization",
                   "point_latency": "max over ranks of each rank's median window"},
        "copy_bandwidth_bytes_per_s": bandwidths,
        "floor": "per rank: unique active experts' FP8 weights + FP32 block scales + received rows in (FP8 + "
                 "scales) and out (BF16), over that rank's copy bandwidth; point floor = max over ranks",
        "workload": {"world_size": WORLD, "capacity": CAPACITY, "routing": "uniform top-k without repetition",
                     "seed": f"{SEED_BASE} + 2 T + rank", "recipe": [128, 128, 128], "activation_clamp": CLAMP,
                     "activation_alpha": 1.0},
        "composed_baseline": {
            "status": "measured" if baseline_off is None else f"unavailable: {baseline_off}",
            "what": "pack rows (Triton) -> all_to_all_single (NCCL) -> unpack into DeepGEMM's masked layout "
                    "(Triton) -> deepinfer-gemm 2.8.2 m_grouped_fp8_gemm_nt_masked W1 -> fused Triton clamped "
                    "SwiGLU x routing weight + 1x128 FP8 requant -> masked W2 -> gather (Triton) -> "
                    "all_to_all_single back -> slot-order combine (Triton)",
            "favoured": "per-rank split sizes and row permutations of the fixed routing are computed on the host "
                        "before capture (no on-device count exchange, no worst-case expert sizing): this favours "
                        "the baseline",
            "env": "scripts/device_check.sh builds DeepGEMM into /tmp/deepgemm and runs with LD_PRELOAD of the "
                   "system libstdc++ (docs/platform_notes.md)",
            "module": portable_path(getattr(sys.modules.get("gc_moe_compat.originals.deep_gemm",
                                                            sys.modules.get("deep_gemm")), "__file__", None)),
        },
        "targets": summarize_targets(points),
        "complete": final and not skipped,
        "skipped_points": {"points": skipped, "why": f"past the run's budget ({args.budget_s} s, --budget-s)"},
    }
    data = {"meta": meta, "points": points}
    try:
        validate_result(data)
    except ValueError as err:  # a bug of this script: written down, the measurements are still kept
        meta["schema_error"] = str(err)
        print(f"operator_sm90: result schema check failed: {err}", file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_file(args.out, data)
    if final:
        plot(points, args.out.with_suffix(".png"))


def plot(points: list[dict[str, object]], path: Path) -> None:
    """Latency (with the floor) and speedups versus tokens per rank, one column per preset."""
    presets = [p for p in PRESETS if any(q["preset"] == p for q in points)]
    plt = pyplot() if presets else None
    if plt is None:
        return
    fig, axes = plt.subplots(2, len(presets), figsize=(6 * len(presets), 7), squeeze=False)
    for col, preset in enumerate(presets):
        pts = [p for p in points if p["preset"] == preset]
        ts = [p["tokens_per_rank"] for p in pts]
        ax = axes[0][col]
        for op in OPS:
            ys = [p["latency_us"].get(op) for p in pts]
            if any(y is not None for y in ys):
                ax.plot(ts, [math.nan if y is None else y for y in ys], marker="o", label=op)
        ax.plot(ts, [p["floor_us"] for p in pts], "k--", label="floor (bytes / copy BW)")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{preset}, 2 x H200: latency (µs, slowest rank)")
        ax.legend(fontsize=7)
        ax = axes[1][col]
        for key in ("composed_baseline_over_gc_moe", "no_partition_over_gc_moe"):
            ys = [p["speedup"].get(key) for p in pts]
            if any(y is not None for y in ys):
                ax.plot(ts, [math.nan if y is None else y for y in ys], marker="s", label=key)
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.axhline(NO_PARTITION_MIN, color="grey", lw=0.5, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per rank")
        ax.set_title("speedup of gc_moe")
        ax.legend(fontsize=7)
    fig.suptitle("GC-MoE FP8xFP8 operator vs partition off vs all-to-all + DeepGEMM, CUDA-graph replay")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_table(points: list[dict[str, object]]) -> None:
    """The short table that ends the run."""
    print(f"{'preset':<12} {'T':>4} {'gc_moe':>8} {'no_part':>8} {'composed':>9} {'floor':>7} {'eff':>5} "
          f"{'x comp':>6} {'x nopart':>8} {'cos min':>9}")

    def fmt(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    for p in points:
        lat, sp = p["latency_us"], p["speedup"]
        cos = p["accuracy"].get("gc_moe", {}).get("cosine_min")
        print(f"{p['preset']:<12} {p['tokens_per_rank']:>4} {fmt(lat.get('gc_moe'), '8.1f')} "
              f"{fmt(lat.get('gc_moe_no_partition'), '8.1f')} {fmt(lat.get('composed_baseline'), '9.1f')} "
              f"{p['floor_us']:7.1f} {fmt(p['efficiency'].get('gc_moe'), '5.2f')} "
              f"{fmt(sp.get('composed_baseline_over_gc_moe'), '6.2f')} "
              f"{fmt(sp.get('no_partition_over_gc_moe'), '8.2f')} {fmt(cos, '9.6f')}")


# ---------------------------------------------------------------------------------------------------- entry point
def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/operator_sm90_x2.json")
    parser.add_argument("--presets", nargs="+", default=list(PRESETS), choices=PRESETS)
    parser.add_argument("--tokens", nargs="+", type=int, default=list(SWEEP_TOKENS))
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--windows", type=int, default=30)
    parser.add_argument("--prebuild-workers", type=int, default=8, help="DeepGEMM JIT warm-up processes (0: none)")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="wall-clock budget of the whole run")
    args = parser.parse_args(argv)
    if os.environ.get("GC_MOE_BENCH_WINDOWS"):  # "WARMUP,WINDOWS": a shorter run inside a device lease
        args.warmup, args.windows = (int(v) for v in os.environ["GC_MOE_BENCH_WINDOWS"].split(","))
    if os.environ.get("GC_MOE_BENCH_TOKENS"):  # "T,T,...": a subset of the sweep inside a device lease
        args.tokens = [int(v) for v in os.environ["GC_MOE_BENCH_TOKENS"].split(",")]
    bad = [t for t in args.tokens if not 1 <= t <= CAPACITY]
    if bad:
        parser.error(f"--tokens: every T must lie in [1, {CAPACITY}] (the per-rank capacity), got {bad}")
    return args


def main() -> int:
    args = parse_args(sys.argv[1:])
    if "LOCAL_RANK" in os.environ:  # one of the two ranks
        run_ranks(args)
        sys.stdout.flush()
        os._exit(0)  # docs/platform_notes.md: destroy_process_group() after graph-captured NCCL calls can hang at exit
    deadline = time.time() + args.budget_s
    require_gpus("operator_sm90", WORLD)
    if args.prebuild_workers > 0:
        prebuild(args.presets, args.tokens, args.prebuild_workers)
    cmd, env = torchrun_command([str(Path(__file__).resolve()), *sys.argv[1:]], WORLD, {DEADLINE_ENV: repr(deadline)})
    limit = max(60.0, deadline + GRACE_S - time.time())
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)  # its own group: a stop reaches the ranks too
    try:
        return proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        print(f"operator_sm90: the ranks ran past the budget ({args.budget_s} s + {GRACE_S} s) and were stopped; "
              f"{args.out} holds the points finished before (meta.complete false)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
