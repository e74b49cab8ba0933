"""The A/B measurement on the GPUs: one process per rank, every operator on identical seeded inputs.

Per rank: the idle-GPU check (a warning), the copy bandwidth, every rank's weights (the P-rank references need
them), each available operator built once (buffers, weight transforms: what a deployment does at load time). Per
point ``T``: every rank's tokens; this rank's references (quantization-faithful for each weight format, BF16
model); per operator: stage, one eager run (JIT, accuracy), capture of one step in a CUDA graph. Then the timing, in
``--repeats`` interleaved rounds: round 1 times every operator in turn (warm-up + measured windows of graph replays,
:func:`protocol.graph_windows`, windows aligned across ranks by a device-side all-reduce; then rank 0's GPU clocks,
temperature and power, :func:`protocol.gpu_conditions`), round 2 again every operator, ..., so that a drift of the
machine hits every operator alike; each graph lives until its last round. Per operator then: the device status
check and the replayed ``y`` compared bit for bit with the eager one; then each pair of operators' eager outputs
against each other. An operator's latency on a rank is the median of its measured windows of all rounds pooled;
the point keeps each round's figures and their spread (:mod:`results`). A failure of one operator (on any rank, in
any step or round) marks it unavailable at that point with the error; the run goes on. Every rank runs the same
rounds in the same order. Rank 0 assembles the points (:mod:`results`) and writes the file after every point.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from gc_moe_compat.ab import prebuild, protocol, report, results, timeline
from gc_moe_compat.ab.inputs import Tokens, make_tokens, make_weights
from gc_moe_compat.ab.model_config import Workload
from gc_moe_compat.ab.operators import REFERENCE_OP, Context, OperatorSpec, Runner
from gc_moe_compat.compute_paths import MMA_TYPES
from gc_moe_compat.runtime.colocation import init_rank_group

__all__ = ["RunConfig", "Ranks", "main_ranks", "run"]

ENV_KEYS = ("GC_MOE_DISPATCH_SMS", "GC_MOE_PARTITION", "GC_MOE_DEEP_EP_PARTITION", "GC_MOE_SWAP",
            "GC_MOE_AB_DEEP_EP_PROBE_S")
"""Settings that change what runs: written in front of ``meta.command`` when set."""


@dataclass(frozen=True)
class RunConfig:
    workload: Workload
    tokens: tuple[int, ...]
    ops: tuple[OperatorSpec, ...]
    warmup: int
    windows: int
    repeats: int
    out: Path
    command: tuple[str, ...]
    quick: bool = False
    prebuild_only: bool = False
    timeline: int = 0  # graph replays under the profiler per operator and point after its rounds (0: none)


class Ranks:
    """This run's process group: torchrun's environment (NCCL, or gloo where ranks share a GPU:
    :func:`gc_moe_compat.runtime.colocation.init_rank_group`), or one rank of its own (an NCCL group of one: the
    originals allocate symmetric memory through it)."""

    def __init__(self) -> None:
        if "RANK" not in os.environ:
            self.device = torch.device("cuda", 0)
            torch.cuda.set_device(self.device)
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                    device_id=self.device)
        else:
            self.device = init_rank_group()
        self.group = dist.group.WORLD
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._one = torch.zeros(1, dtype=torch.float32, device=self.device)

    def align(self) -> None:
        """A device-side barrier (an all-reduce on the current stream): window starts line up on every GPU."""
        dist.all_reduce(self._one, group=self.group)

    def gather(self, obj: object) -> list[object]:
        out: list[object] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def first_error(self, error: str | None) -> str | None:
        """The first rank's error of a step every rank ran (so that all ranks skip it together)."""
        return next((e for e in self.gather(error) if e), None)


def _error(exc: BaseException) -> str:
    traceback.print_exc()
    return f"{type(exc).__name__}: {exc}"


def _every_ranks_weights(w: Workload, formats: tuple[str, ...], ranks: Ranks) -> list[object]:
    """Every rank's experts on this rank (the P-rank references need all of them): ``world`` shares per rank, so
    P ranks on one GPU hold ``P * P`` shares there. Running out of memory ends the run with that arithmetic, not
    with an allocator traceback."""
    shares: list[object] = []
    try:
        for r in range(ranks.world):
            shares.append(make_weights(w.local_experts, w.hidden, w.intermediate, r, formats, ranks.device))
    except torch.OutOfMemoryError:
        share = _share_bytes(shares[0]) if shares else None
        per_gpu = torch.cuda.get_device_properties(ranks.device).total_memory
        colocated = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) // max(torch.cuda.device_count(), 1)
        need = "" if share is None else (
            f" ({ranks.world} shares of {share / 2**30:.2f} GiB = {ranks.world * share / 2**30:.1f} GiB per rank")
        if need and colocated > 1:
            need += f", x {colocated} ranks on this GPU = {colocated * ranks.world * share / 2**30:.1f} GiB"
        raise RuntimeError(
            f"gc-moe-ab rank {ranks.rank}: out of GPU memory while building every rank's experts for the references"
            f"{need + ')' if need else ''} on a GPU of {per_gpu / 2**30:.1f} GiB: run fewer ranks "
            "(--world-size) or a smaller share (--hidden / --intermediate / --experts / --ep-size)") from None
    return shares


def _share_bytes(weights: object) -> int:
    """Device bytes of one rank's experts in every format built."""
    return sum(t.nbytes for l1, l2 in weights.formats.values() for e in (l1, l2)
               for t in (e.payload, e.scales) if t is not None)


def _references(tokens: Sequence[Tokens], weights: Sequence[object], formats: set[str], clamp: float | None,
                rank: int) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's reference outputs: ``{weight format: {"faithful": y, "bf16_model": y}}``."""
    from gc_moe_compat.testing.operator_workload import INTERMEDIATE_QUANT
    from gc_moe_compat.testing.reference import expert_parallel_reference

    staged = [t.staged for t in tokens]
    idx, w = [s.topk_idx for s in staged], [s.topk_weights for s in staged]

    def layer(fmt: str, acts: list[object]) -> torch.Tensor:
        out = expert_parallel_reference(acts, idx, w, [lw[fmt][0] for lw in weights], [lw[fmt][1] for lw in weights],
                                        activation_clamp=clamp, intermediate_quant=INTERMEDIATE_QUANT[fmt])
        return out[rank].y

    model = layer("bf16", [t.x.float() for t in tokens])
    return {fmt: {"faithful": layer(fmt, [(s.x, s.x_sf) for s in staged]), "bf16_model": model} for fmt in formats}


def _floor_bytes(tokens: Sequence[Tokens], workload: Workload, num_experts: int, rank: int) -> dict[str, int]:
    """This rank's docs/bench_protocol.md floor bytes per mma type: its unique active experts and received rows."""
    from gc_moe_compat.testing.reference import dispatch_plan

    plan = dispatch_plan([t.topk_idx.to(torch.int64) for t in tokens], num_experts)[rank]
    active, rows = sum(1 for r in plan if r.shape[0]), sum(int(r.shape[0]) for r in plan)
    return {mma: protocol.expert_floor_bytes(workload.hidden, workload.intermediate, active, rows, mma)
            for mma in MMA_TYPES}


@dataclass
class _Timed:
    """One operator ready to be timed at a point: its captured graph (alive until its last round), the output the
    replays write, the eager output, and what this rank measured in each round so far."""

    graph: torch.cuda.CUDAGraph | None
    y: torch.Tensor
    eager: torch.Tensor
    rounds: list[list[float]] = field(default_factory=list)
    conditions: list[dict[str, float | None]] = field(default_factory=list)


def _prepare(spec: OperatorSpec, runner: Runner, refs: dict[str, torch.Tensor], ranks: Ranks,
             record: dict[str, dict]) -> _Timed | None:
    """One operator at one point before its timing: one eager run (accuracy) and the capture of its graph. None where
    a rank failed (recorded as unavailable); every rank calls it for the same operator."""
    from gc_moe_compat.testing.reference import accuracy_metrics

    error, timed = None, None
    try:
        y = runner.run()
        torch.cuda.synchronize()
        eager = y.clone()
        record["accuracy"][spec.name] = {name: accuracy_metrics(eager.float(), ref.float())
                                         for name, ref in refs.items()}
        timed = _Timed(protocol.capture_graph(runner.run), y, eager)
    except Exception as exc:  # noqa: BLE001 - recorded; every rank skips the timing together
        error = _error(exc)
    error = ranks.first_error(error)
    if error:
        record["unavailable"][spec.name] = f"failed: {error}"
        return None
    return timed


def _time_round(name: str, timed: _Timed, ranks: Ranks, cfg: RunConfig, record: dict[str, dict], round_: int) -> bool:
    """One timing round of one operator (warm-up + measured windows), then rank 0's GPU conditions; False where a
    rank failed (recorded as unavailable: the operator leaves the later rounds)."""
    error = None
    try:
        timed.rounds.append(protocol.graph_windows(timed.graph, cfg.warmup, cfg.windows, before_window=ranks.align))
    except Exception as exc:  # noqa: BLE001 - recorded; every rank drops the operator together
        error = _error(exc)
    error = ranks.first_error(error)
    if error:
        record["unavailable"][name] = f"failed in timing round {round_}: {error}"
        return False
    if ranks.rank == 0:
        timed.conditions.append(protocol.gpu_conditions(ranks.device.index))
    return True


def _finish(name: str, runner: Runner, timed: _Timed, ranks: Ranks, record: dict[str, dict],
            ys: dict[str, torch.Tensor], timeline_replays: int) -> None:
    """After an operator's last round: ``timeline_replays`` traced replays (:func:`timeline.graph_timeline`, every
    rank together), its graph released, the device status check, the bit-identity of the replayed ``y`` with the
    eager one, and this rank's timing fields (:func:`results.rank_timing`)."""
    if timeline_replays:
        ranks.align()
        record["timeline"][name] = timeline.graph_timeline(timed.graph, timeline_replays)
    timed.graph = None
    error = None
    try:
        runner.check(f"{name} replays")
    except Exception as exc:  # noqa: BLE001 - a device error makes the timing meaningless: recorded
        error = _error(exc)
    error = ranks.first_error(error)
    if error:
        record["unavailable"][name] = f"device error after the timed replays: {error}"
        return
    for key, value in results.rank_timing(timed.rounds).items():
        record[key][name] = value
    if ranks.rank == 0:
        record["repeat_conditions"][name] = timed.conditions
    record["bit_identical"][name] = torch.equal(timed.y.view(torch.int16), timed.eager.view(torch.int16))
    ys[name] = timed.eager


def _measure_point(specs: Sequence[OperatorSpec], runners: dict[str, Runner], tokens: Tokens,
                   refs: dict[str, dict[str, torch.Tensor]], ranks: Ranks, cfg: RunConfig, record: dict[str, dict],
                   bar: report.Progress, what: str) -> dict[str, torch.Tensor]:
    """Every operator at one point on this rank (module docstring): staged, run eagerly and captured one after the
    other, timed in ``cfg.repeats`` interleaved rounds, then checked. Returns the measured operators' eager
    outputs; ``bar`` advances once per operator and round."""
    ready: dict[str, _Timed] = {}
    for spec in specs:
        error, timed = None, None
        try:
            runners[spec.name].stage(tokens)
        except Exception as exc:  # noqa: BLE001 - recorded
            error = _error(exc)
        error = ranks.first_error(error)
        if error:
            record["unavailable"][spec.name] = f"staging failed: {error}"
        else:
            timed = _prepare(spec, runners[spec.name], refs[spec.weight_format], ranks, record)
        if timed is None:
            bar.advance(f"{what} {spec.name}: not timed", steps=cfg.repeats)
        else:
            ready[spec.name] = timed
    for round_ in range(1, cfg.repeats + 1):
        for name in list(ready):
            if _time_round(name, ready[name], ranks, cfg, record, round_):
                bar.advance(f"{what} {name} round {round_}/{cfg.repeats}")
            else:
                del ready[name]
                bar.advance(f"{what} {name}: failed", steps=cfg.repeats - round_ + 1)
    ys: dict[str, torch.Tensor] = {}
    for name, timed in ready.items():
        _finish(name, runners[name], timed, ranks, record, ys, cfg.timeline)
    return ys


def _build(specs: Sequence[OperatorSpec], ctx: Context, ranks: Ranks, unavailable: dict[str, str]
           ) -> dict[str, Runner]:
    """Build every operator that passed its probe on every rank; a setup failure is recorded and left out."""
    runners: dict[str, Runner] = {}
    for spec in specs:
        if spec.name in unavailable:
            continue
        runner, error = None, None
        try:
            runner = spec.build(ctx)
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on without it
            error = _error(exc)
        error = ranks.first_error(error)
        if error:
            unavailable[spec.name] = f"setup failed: {error}"
            if runner is not None:
                runner.close()
            continue
        runners[spec.name] = runner
    return runners


def _partition_meta(runners: dict[str, Runner]) -> dict[str, object]:
    """``meta.partition``: the reference operator's partition (docs/bench_protocol.md's keys) plus every operator's."""
    per_op = {}
    for name, runner in runners.items():
        try:
            per_op[name] = runner.partition()
        except Exception as exc:  # noqa: BLE001 - metadata only
            per_op[name] = {"error": f"{type(exc).__name__}: {exc}"}
    ref = per_op.get(REFERENCE_OP, {})
    green = ref.get("green", {}) if isinstance(ref, dict) else {}
    return {"dispatch_sms": green.get("dispatch_sms", ref.get("dispatch_sms")),
            "compute_sms": green.get("compute_sms", ref.get("compute_sms")),
            "workqueue": green.get("workqueue"), "per_operator": per_op}


def run(cfg: RunConfig) -> int:
    """The measurement on this rank (every rank runs it); rank 0 writes ``cfg.out`` (+ PNG) and the table."""
    ranks = Ranks()
    rank, world, w = ranks.rank, ranks.world, cfg.workload
    lead = rank == 0
    shape = w.shape(world, "fp8xfp8")
    idle = ranks.gather(protocol.idle_gpu_check(ranks.device.index))
    if lead:
        for r, check in enumerate(idle):
            if check["idle"] is False:
                print(f"WARNING: GPU of rank {r} is not idle ({check['detail']}): latencies may be inflated",
                      file=sys.stderr, flush=True)
    bandwidths = ranks.gather(protocol.copy_bandwidth())
    unavailable: dict[str, str] = {}
    for spec in cfg.ops:  # a probe that fails on any rank leaves the operator out on all of them
        reason = ranks.first_error(spec.probe())
        if reason:
            unavailable[spec.name] = reason
    probed = [s for s in cfg.ops if s.name not in unavailable]
    formats = {s.weight_format for s in probed}
    t0 = time.monotonic()
    if lead:  # one rank compiles every variant the points can pick, in parallel; the others wait
        names = {s.name for s in probed}
        jobs = prebuild.kernel_jobs({s.mma_type for s in probed}, cfg.tokens, world, w.topk, shape.num_experts,
                                    low_latency="composed_deepep_deepgemm" in names)
        for line in prebuild.prebuild(jobs):
            print(f"prebuild: {line}", flush=True)
        if world == 1 and names & set(prebuild.ORIGINAL_OPS):
            for line in prebuild.prebuild_originals(cfg.command[1:], cfg.tokens):
                print(f"prebuild: {line}", flush=True)
        print(f"prebuild: {time.monotonic() - t0:.1f} s", flush=True)
    dist.barrier()
    if cfg.prebuild_only:
        if lead:
            print("prebuild only: every kernel of the run is compiled; nothing timed", flush=True)
        return 0
    weights = _every_ranks_weights(w, tuple(sorted(formats)), ranks)
    ctx = Context(ranks.group, w, world, rank, weights[rank], ranks.device)
    runners = _build(cfg.ops, ctx, ranks, unavailable)
    if lead:
        print(f"set up {len(runners)} operator(s) in {time.monotonic() - t0:.1f} s; not run: "
              f"{', '.join(unavailable) or 'none'}", flush=True)
    ops = {s.name: s.mma_type for s in cfg.ops}
    specs = [s for s in cfg.ops if s.name in runners]
    points: list[dict[str, object]] = []
    partition = _partition_meta(runners)
    with report.progress(len(cfg.tokens) * len(specs) * cfg.repeats, enabled=lead) as bar:
        for t in cfg.tokens:
            tokens = [make_tokens(t, shape.num_experts, w.topk, w.hidden, r, world, w.routed_scaling_factor,
                                  ranks.device) for r in range(world)]
            refs = _references(tokens, weights, {s.weight_format for s in specs}, w.activation_clamp, rank)
            record: dict[str, dict] = {"latency_us": {}, "repeat_us": {}, "repeat_window_us": {},
                                       "repeat_conditions": {}, "accuracy": {}, "bit_identical": {},
                                       "unavailable": dict(unavailable), "pairs": {}, "timeline": {},
                                       "floor_bytes": _floor_bytes(tokens, w, shape.num_experts, rank)}
            ys = _measure_point(specs, runners, tokens[rank], refs, ranks, cfg, record, bar, f"{w.name} T={t}")
            _pairs(ys, record)
            records = ranks.gather(record)
            if lead:
                points.append(results.assemble_point(w.name, t, records, ops, bandwidths, REFERENCE_OP))
                spread = points[-1].get("spread_pct", {})
                lat = ", ".join(f"{op} {us:.1f}" + (f" (spread {spread[op]:.2f} %)" if op in spread else "")
                                for op, us in points[-1]["latency_us"].items())
                bar.note(f"T={t}: {lat} µs; floor {points[-1]['floor_us']:.1f} µs")
                _write(cfg, points, partition, bandwidths, idle, unavailable, world, final=False)
    for runner in runners.values():
        runner.close()
    if lead:
        _write(cfg, points, partition, bandwidths, idle, unavailable, world, final=True)
        title = f"gc-moe-ab {w.name}, {protocol.gpu_setup(world)}, E={shape.num_experts}"
        report.table(title, points, [s.name for s in specs], REFERENCE_OP, unavailable)
        print(f"wrote {cfg.out} and {cfg.out.with_suffix('.png')}", flush=True)
    dist.barrier()
    return 0


def _pairs(ys: dict[str, torch.Tensor], record: dict[str, dict]) -> None:
    """Every pair of measured operators' eager outputs on this rank, against each other."""
    from gc_moe_compat.testing.reference import accuracy_metrics

    names = list(ys)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            record["pairs"][f"{a}|{b}"] = accuracy_metrics(ys[a].float(), ys[b].float())


def ops_meta(specs: Sequence[OperatorSpec], unavailable: dict[str, str]) -> dict[str, dict[str, str]]:
    """A result file's ``meta.ops``: per operator its label, formats and status, and for one that ran an original
    the build it ran (``source``: two builds of one original share a label)."""
    ops = {}
    for s in specs:
        ops[s.name] = {"label": s.label, "mma_type": s.mma_type, "weight_format": s.weight_format,
                       "status": f"not run: {unavailable[s.name]}" if s.name in unavailable else "measured"}
        source = None if s.name in unavailable else s.source_fn()
        if source:
            ops[s.name]["source"] = source
    return ops


def _write(cfg: RunConfig, points: list[dict[str, object]], partition: dict[str, object], bandwidths: list[float],
           idle: list[dict[str, object]], unavailable: dict[str, str], world: int, *, final: bool) -> None:
    meta = protocol.result_meta("gc-moe-ab", [], partition, world_size=world, env_keys=ENV_KEYS,
                                command=cfg.command)
    meta |= {
        "tool": "gc-moe-ab",
        "workload": cfg.workload.describe(),
        "operator_shape": {"num_experts": cfg.workload.local_experts * world, "num_ranks": world,
                           "rule": "E = (model E / ep_size) * world size: the deployment's per-rank share"},
        "ops": ops_meta(cfg.ops, unavailable),
        "reference_op": REFERENCE_OP,
        "timing": {"warmup_windows": cfg.warmup, "windows": cfg.windows, "replays_per_window": protocol.PER_WINDOW,
                   "repeats": cfg.repeats, "l2_flush_bytes": protocol.L2_FLUSH_BYTES, "quick": cfg.quick,
                   "window_start": "device all-reduce across ranks after the L2 flush and synchronization",
                   "rounds": "each point is timed in `repeats` interleaved rounds: round 1 times every op (warm-up + "
                             "measured windows), then round 2 every op, ...; each op's graph is captured once",
                   "point_latency": "max over ranks of each rank's median of its measured windows of all rounds "
                                    "pooled",
                   "spread": "repeat_us: per round, the slowest rank's median window; spread_pct = 100 (max - min) "
                             "/ min over those (two rounds or more); repeat_conditions: rank 0's GPU SM/memory "
                             "clocks, temperature and power (nvidia-smi) right after each round"},
        "idle_gpu_check": idle,
        "copy_bandwidth_bytes_per_s": bandwidths,
        "floor": "per rank: unique active experts' weights + scales (per mma type) + received rows in (FP8 + FP32 "
                 "scales) and out (BF16), over that rank's copy bandwidth; point floor = max over ranks",
        "workload_inputs": "per rank: randn BF16 experts (seed 7000 + rank) quantized per format; uniform top-k "
                           "routing without repetition, softmax weights, randn BF16 hidden states (seed 90000 + "
                           "T * world + rank)",
        "references": {"faithful": "quantization-faithful FP32 reference of each op's weight format "
                                   "(gc_moe_compat.testing.reference)",
                       "bf16_model": "the same layer with the unquantized BF16 experts and BF16 activations"},
        "summary": results.summarize(points, REFERENCE_OP),
        "complete": final and len(points) == len(cfg.tokens),
    }
    data = {"meta": meta, "points": points}
    try:
        results.validate_result(data)
    except ValueError as exc:  # a bug of this tool: written down, the measurements are kept
        meta["schema_error"] = str(exc)
        print(f"gc-moe-ab: result schema check failed: {exc}", file=sys.stderr)
    report.write_json(cfg.out, data)
    if final:
        report.plot(points, [s.name for s in cfg.ops], REFERENCE_OP,
                    f"gc-moe-ab {cfg.workload.name}: latency and ratio over {REFERENCE_OP}, CUDA-graph replay",
                    cfg.out.with_suffix(".png"))


def main_ranks(cfg: RunConfig) -> int:
    """Entry of one rank process (every rank parsed the same arguments): run, then leave without teardown."""
    code = run(cfg)
    sys.stdout.flush()
    os._exit(code)  # docs/platform_notes.md: destroy_process_group() after graph-captured NCCL calls can hang at exit
