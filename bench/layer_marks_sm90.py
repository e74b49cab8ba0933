"""Where role1's and role2's time goes inside one replay of the one-rank Mega MoE layer, from inside the kernels
(issue 30's large-T loss: role2 takes 20-25 us longer in the layer's replay than alone under Nsight Compute, while
role1 runs beside it for 123 / 186 us at glm52 T = 128 / 256).

The marked variants (``GC_ROLE2_MARKS`` in kernels/sm90/role2_ring.cuh and role2_gemm.cuh, ``GC_ROLE1_MARKS`` in
kernels/sm90/role1_dispatch.cu) record:

* role2, per CTA: the kernel's entry, the moment role1's pool header arrived, the producer's first K step issued,
  its last task taken, the consumers' exit, the tasks the CTA took, and, summed over the replay, the time its
  producer spun on role1's ring fills (``l1_wait``, l1_full_count) and on W1 tiles of its own grid (``l2_wait``,
  l2_full_mask) with how many waits spun (a signal already there costs nothing);
* role2, per token (the first ``ROLE2.tail`` combine rows): the latest time a W2 epilogue stored a tile of it, over
  its k slots and H tiles, i.e. when the token could be combined (``combinable``: how long before role2's exit the
  tokens were complete, the bound on combining them while role2 runs);
* role1, per warp: the kernel's entry, the start of its row pulls (the block table published), its first row
  released into the ring, its exit, its rows, and its waits for ring refills (role2 emptying a block of an earlier
  generation), timed whether or not they spun.

Per point (``--preset`` or ``--model-config``, T): the facade's SGLang Hopper call (``fp8_mega_moe`` after the
pre-dispatch, gc-moe-ab's ``facade`` operator) is built twice on identical inputs, once with the production kernels
and once with the marked ones. Both are captured in a CUDA graph; ``latency_us`` times the two graphs at the protocol
(interleaved, L2 flushed, median window: what the marks cost), and ``--replays`` further replays of the marked graph
are read back one by one (no L2 flush between them). Per replay every time is taken after the earliest entry of
either role (one clock per GPU), so role1's and role2's marks compare directly. ``marks[role][field]`` holds the
median over the replays of the records' median and latest / largest value: times and waits in µs, counts as counted;
``span`` is the role's latest exit; ``last_replay`` keeps the last marked replay's records themselves (``raw``). The
two graphs' outputs must be bit-identical.

The marked variants are measuring tools, not product kernels: role2's pipelined variants at BM <= 32 and FP8xFP4 BM
= 64 spill a few words (the marks' call in the waits' spin path); the FP8xFP8 BM = 64 / 96 ones that T = 128 / 256
pick on the big shapes do not, nor does role1's (tests/tools/test_bench_layer_marks.py).

Run on an H200: ``bash scripts/device_check.sh --bench-only --bench 'layer_marks_sm90 --preset glm52 --tokens 64 128
256'`` (``python bench/layer_marks_sm90.py --out bench/results/layer_marks_sm90.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from _common import REPO, point_global, require_gpus, result_meta, write_result
from cuda.bindings import driver

from gc_moe_compat.ab import model_config, protocol
from gc_moe_compat.ab.inputs import make_tokens, make_weights
from gc_moe_compat.ab.operators import Context, MegaMoeSequence
from gc_moe_compat.operator.sm90 import role1_dispatch, role2_gemm
from gc_moe_compat.runtime import jit
from gc_moe_compat.runtime.cuda import call
from gc_moe_compat.runtime.green import Role, launch_partition
from gc_moe_compat.runtime.single_rank import single_rank_group


@dataclass(frozen=True)
class Recorded:
    """One role's marked variant: its JIT define, its global, its record's words (``Role1Mark`` / ``Role2Mark`` of
    the kernel, in order) by kind, how many records the device buffer holds, and how many words follow them (role2:
    a time per token, ``kRole2MarkTokens``)."""

    role: str
    define: str
    global_name: bytes
    times: tuple[str, ...]
    waits: tuple[str, ...]
    counts: tuple[str, ...]
    fields: tuple[str, ...]
    records: int
    tail: int = 0


ROLE1 = Recorded("role1", "GC_ROLE1_MARKS", b"gc_role1_marks",
                 times=("pull_start", "first_row", "exit"), waits=("refill_wait_ns",), counts=("refills", "rows"),
                 fields=("entry", "pull_start", "first_row", "refill_wait_ns", "refills", "rows", "exit"),
                 records=4096)
"""Role1: a record per warp (``kRole1MarkWarps``)."""
ROLE2 = Recorded("role2", "GC_ROLE2_MARKS", b"gc_role2_marks",
                 times=("pool_ready", "first_load", "last_take", "exit"), waits=("l1_wait_ns", "l2_wait_ns"),
                 counts=("l1_waits", "l2_waits", "tasks"),
                 fields=("entry", "pool_ready", "l1_wait_ns", "l1_waits", "l2_wait_ns", "l2_waits", "first_load",
                         "last_take", "tasks", "exit"),
                 records=256, tail=8192)
"""Role2: a record per CTA (``kRole2MarkCtas``), then a time per token."""
ROLES = (ROLE1, ROLE2)
SPECS = {spec.role: spec for spec in ROLES}


class Marks:
    """The device buffer one role's marked variant writes (``[record][field]`` u64) and its readout."""

    def __init__(self, spec: Recorded, device: torch.device) -> None:
        self.spec = spec
        self.words = torch.zeros(spec.records * len(spec.fields) + spec.tail, dtype=torch.int64, device=device)
        self.pointed: set[tuple[str, int]] = set()

    def point(self, module: jit.Module, contexts: Sequence[driver.CUcontext]) -> None:
        """Points ``module``'s global at this buffer in each of ``contexts`` (a library's global has one copy per
        context: with the partition on, role1 and role2 run on green contexts)."""
        for ctx in contexts:
            key = (module.key, int(ctx))
            if key in self.pointed:
                continue
            call(driver.cuCtxPushCurrent, ctx)
            try:
                point_global(module.library, self.spec.global_name, self.words)
            finally:
                call(driver.cuCtxPopCurrent)
            self.pointed.add(key)

    def read(self) -> np.ndarray:
        """The records of the replay since the last clear that ran, ``[records, fields]``."""
        size = self.spec.records * len(self.spec.fields)
        rows = self.words[:size].view(self.spec.records, len(self.spec.fields)).cpu().numpy()
        ran = rows[rows[:, self.spec.fields.index("entry")] != 0]
        if not len(ran):
            raise RuntimeError(f"{self.spec.role} stored no marks: the replay did not run its marked variant with the "
                               "global set in the context it ran in")
        return ran

    def read_tail(self, count: int) -> np.ndarray:
        """The first ``count`` words after the records (role2: the tokens' times, 0 where none was stored)."""
        if not 0 <= count <= self.spec.tail:
            raise ValueError(f"{self.spec.role}: the buffer holds {self.spec.tail} words after its records, "
                             f"not {count}")
        start = self.spec.records * len(self.spec.fields)
        return self.words[start:start + count].cpu().numpy()


def replay(graph: torch.cuda.CUDAGraph, marks: Mapping[str, Marks]) -> dict[str, np.ndarray]:
    """One replay of ``graph`` on cleared buffers: each role's records."""
    for m in marks.values():
        m.words.zero_()
    torch.cuda.synchronize()
    graph.replay()
    torch.cuda.synchronize()
    return {role: m.read() for role, m in marks.items()}


BEFORE_EXIT_US = (5.0, 10.0, 20.0, 40.0)
"""Margins before role2's latest exit at which :func:`combinable` counts the complete tokens."""


def combinable(replays: Sequence[tuple[Mapping[str, np.ndarray], np.ndarray]]) -> dict[str, object]:
    """From each replay's records and tokens' times (one rank: token t's time at index t): the median over the
    replays of when the tokens were complete (µs after the earliest entry of either role: their median and latest),
    of how long before role2's latest exit (``before_exit_us``: the tokens' 10th / 50th / 90th percentile), and of
    the share complete ``m`` µs before that exit (``share_before_exit``, per margin of :data:`BEFORE_EXIT_US`): what
    a combine running while role2 runs could take off the finalize that follows it. A token without a time (no slot
    stored) is left out and counted."""
    done_median, done_max, missing = [], [], []
    before: dict[str, list[float]] = {q: [] for q in ("p10", "p50", "p90")}
    share: dict[str, list[float]] = {str(m): [] for m in BEFORE_EXIT_US}
    for records, tokens in replays:
        start = _origin(records)
        exit_ = (int(records["role2"][:, ROLE2.fields.index("exit")].max()) - start) / 1e3
        stored = tokens[tokens != 0]
        missing.append(int(len(tokens) - len(stored)))
        if not len(stored):
            continue
        done = (stored - start) / 1e3
        done_median.append(float(np.median(done)))
        done_max.append(float(done.max()))
        lead = exit_ - done
        for q, p in (("p10", 10), ("p50", 50), ("p90", 90)):
            before[q].append(float(np.percentile(lead, p)))
        for m in BEFORE_EXIT_US:
            share[str(m)].append(float(np.mean(lead >= m)))

    def med(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    return {"done_us": {"median": med(done_median), "max": med(done_max)},
            "before_exit_us": {q: med(v) for q, v in before.items()},
            "share_before_exit": {m: med(v) for m, v in share.items()},
            "tokens_without_time": max(missing) if missing else 0}


def contexts_of(runner: MegaMoeSequence) -> list[driver.CUcontext]:
    """The CUDA contexts ``runner``'s kernels launch in: this thread's, and its buffer's green contexts."""
    out = [call(driver.cuCtxGetCurrent)]
    workspace = runner.buf.workspace
    partition = launch_partition(workspace.plan, workspace.storage.device.index)
    if partition is not None:
        out += [partition.side(role).ctx for role in Role]
    return out


@contextlib.contextmanager
def marked_kernels(built: list[tuple[Recorded, jit.Module]]) -> Iterator[None]:
    """Within the block the layer graphs built (a buffer's first call at a T) take the marked role1 and role2
    variants (the ``kernel`` functions :func:`~gc_moe_compat.operator.sm90.role1_dispatch.dispatch_node` and
    :func:`~gc_moe_compat.operator.sm90.role2_gemm.role2_node` read when they build a node, swapped); each module
    they load is appended to ``built`` with its role. Graphs built earlier keep their kernels."""
    production = role1_dispatch.kernel, role2_gemm.kernel

    def role1_kernel() -> jit.Kernel:
        module = jit.load_module(role1_dispatch.SOURCE, {ROLE1.define: 1})
        built.append((ROLE1, module))
        return module.kernel(role1_dispatch.KERNEL)

    def role2_kernel(variant: role2_gemm.Role2Variant) -> jit.Kernel:
        defines = {**variant.defines, ROLE2.define: 1}
        built.append((ROLE2, jit.load_module(variant.source, defines)))
        return jit.load_kernel(variant.source, defines, variant.kernel_name, shared_bytes=variant.smem,
                               ordinal=torch.cuda.current_device())

    role1_dispatch.kernel, role2_gemm.kernel = role1_kernel, role2_kernel
    try:
        yield
    finally:
        role1_dispatch.kernel, role2_gemm.kernel = production


def _origin(records: Mapping[str, np.ndarray]) -> int:
    """A replay's clock origin: the earliest entry of either role (ns)."""
    return min(int(rows[:, SPECS[role].fields.index("entry")].min()) for role, rows in records.items())


def summary(replays: Sequence[Mapping[str, np.ndarray]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per role and field, the median over ``replays`` of the records' median and latest / largest: times in µs
    after the replay's earliest entry of either role, waits in µs, counts as counted; ``span`` the role's latest
    exit. A time left at 0 (a role2 variant without a producer, a role1 warp without rows) is not a record's time."""
    per: dict[str, dict[str, dict[str, list[float]]]] = {}

    def add(role: str, name: str, values: np.ndarray) -> None:
        entry = per.setdefault(role, {}).setdefault(name, {"median": [], "max": []})
        entry["median"].append(float(np.median(values)))
        entry["max"].append(float(values.max()))

    for records in replays:
        start = _origin(records)
        for role, rows in records.items():
            spec = SPECS[role]
            col = {f: i for i, f in enumerate(spec.fields)}
            add(role, "entry", (rows[:, col["entry"]] - start) / 1e3)
            for f in spec.times:
                have = rows[:, col[f]] != 0
                if have.any():
                    add(role, f, (rows[have, col[f]] - start) / 1e3)
            for f in spec.waits:
                add(role, f.removesuffix("_ns") + "_us", rows[:, col[f]] / 1e3)
            for f in spec.counts:
                add(role, f, rows[:, col[f]].astype(np.float64))
            add(role, "span", np.array([(rows[:, col["exit"]].max() - start) / 1e3]))
    return {role: {name: {k: statistics.median(v) for k, v in stats.items()} for name, stats in fields.items()}
            for role, fields in per.items()}


def raw(records: Mapping[str, np.ndarray]) -> dict[str, list[list[float]]]:
    """One replay's records as written to the result file (per role, a row per record in ``fields`` order): times
    in µs after the replay's earliest entry of either role (0 where the kernel left the time unset), the rest as
    :func:`summary` reads them (waits in µs, counts)."""
    start = _origin(records)
    out = {}
    for role, rows in records.items():
        spec = SPECS[role]
        table = rows.astype(np.float64)
        for i, f in enumerate(spec.fields):
            if f == "entry" or f in spec.times:
                table[:, i] = np.where(rows[:, i] != 0, (rows[:, i] - start) / 1e3, 0.0)
            elif f in spec.waits:
                table[:, i] = rows[:, i] / 1e3
        out[role] = [[round(float(v), 3) for v in row] for row in table]
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=model_config.PRESET_NAMES, help="default: glm52")
    source.add_argument("--model-config", type=Path, help="a HuggingFace config.json (gc-moe-ab's option)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--replays", type=int, default=20, help="marked replays read back per point")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--windows", type=int, default=10)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/layer_marks_sm90.json")
    args = parser.parse_args(argv)
    for name in ("replays", "warmup", "windows"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: must be at least 1, got {getattr(args, name)}")
    bad = [t for t in args.tokens if not 1 <= t <= ROLE2.tail]
    if bad:
        parser.error(f"--tokens: every T must be 1..{ROLE2.tail} (the tokens role2's marks time), got {bad}")
    return args


def _line(name: str, t: int, point: Mapping[str, object]) -> str:
    """The point's one-line report."""
    r1, r2 = point["marks"]["role1"], point["marks"]["role2"]
    lat = point["latency_us"]
    return (f"{name} T={t}: layer {lat['production']:.1f} us (marked {lat['marked']:.1f}); role1 pulls from "
            f"{r1['pull_start']['median']:.1f}, exit {r1['exit']['max']:.1f}, refill waits median/max "
            f"{r1['refill_wait_us']['median']:.1f}/{r1['refill_wait_us']['max']:.1f}; role2 pool ready "
            f"{r2['pool_ready']['median']:.1f}, exit median/latest {r2['exit']['median']:.1f}/{r2['exit']['max']:.1f}, "
            f"L1 wait median/max {r2['l1_wait_us']['median']:.1f}/{r2['l1_wait_us']['max']:.1f}, L2 wait "
            f"{r2['l2_wait_us']['median']:.1f}/{r2['l2_wait_us']['max']:.1f} us; tokens complete median/latest "
            f"{_fmt(point['combinable']['done_us']['median'])}/{_fmt(point['combinable']['done_us']['max'])}, before "
            f"role2's exit p10/p50/p90 " + "/".join(_fmt(v) for v in point["combinable"]["before_exit_us"].values())
            + " us")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def measure(w: model_config.Workload, tokens_per_rank: Sequence[int], group: object, *, replays: int, warmup: int,
            windows: int) -> tuple[list[dict[str, object]], dict[str, object]]:
    """The points of ``w`` at each T of ``tokens_per_rank`` (one rank); the marked runner's partition for the meta
    block."""
    from gc_moe_compat import deep_gemm

    device = torch.device("cuda", torch.cuda.current_device())
    weights = make_weights(w.local_experts, w.hidden, w.intermediate, 0, ("fp8_block128",), device)
    ctx = Context(group, w, 1, 0, weights, device)
    production, marked = MegaMoeSequence(deep_gemm, ctx), MegaMoeSequence(deep_gemm, ctx)
    marks = {spec.role: Marks(spec, device) for spec in ROLES}
    built: list[tuple[Recorded, jit.Module]] = []
    points = []
    try:
        for t in tokens_per_rank:
            tokens = make_tokens(t, ctx.shape("fp8xfp8").num_experts, w.topk, w.hidden, 0, 1,
                                 w.routed_scaling_factor, device)
            production.stage(tokens)
            marked.stage(tokens)
            y_production = production.run().clone()
            with marked_kernels(built):
                y_marked = marked.run().clone()
            for runner in (production, marked):
                runner.check(f"layer_marks_sm90 T={t}")
            for spec, module in built:
                marks[spec.role].point(module, contexts_of(marked))
            graphs = {"production": protocol.capture_graph(production.run),
                      "marked": protocol.capture_graph(marked.run)}
            latency: dict[str, list[float]] = {name: [] for name in graphs}
            for _ in range(2):  # interleaved rounds: a drift of the machine hits both alike
                for name, graph in graphs.items():
                    latency[name] += protocol.graph_windows(graph, warmup, windows)
            records, tokens = [], []
            for _ in range(replays):
                records.append(replay(graphs["marked"], marks))
                tokens.append(marks["role2"].read_tail(t))
            marked.check(f"layer_marks_sm90 T={t} (marked replays)")
            if not torch.equal(y_production, y_marked):
                raise RuntimeError(f"T={t}: the marked kernels changed the layer's output")
            tasks, rows = ROLE2.fields.index("tasks"), ROLE1.fields.index("rows")
            point = {"workload": w.name, "tokens_per_rank": t,
                     "records": {role: int(records[0][role].shape[0]) for role in marks},
                     "latency_us": {name: statistics.median(v) for name, v in latency.items()},
                     "bit_identical": True, "marks": summary(records),
                     "role1_rows_per_replay": [int(r["role1"][:, rows].sum()) for r in records],
                     "role2_tasks_per_replay": [int(r["role2"][:, tasks].sum()) for r in records],
                     "combinable": combinable(list(zip(records, tokens, strict=True))),
                     "last_replay": raw(records[-1])}
            points.append(point)
            print(_line(w.name, t, point), flush=True)
        return points, marked.partition()
    finally:
        production.close()
        marked.close()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    require_gpus("bench/layer_marks_sm90.py")
    w = (model_config.preset(args.preset or "glm52") if args.model_config is None
         else model_config.from_hf_config(args.model_config))
    with single_rank_group() as group:
        points, partition = measure(w, args.tokens, group, replays=args.replays, warmup=args.warmup,
                                    windows=args.windows)
    meta = result_meta("bench/layer_marks_sm90.py", sys.argv[1:] if argv is None else list(argv), partition,
                       env_keys=("GC_MOE_DISPATCH_SMS", "GC_MOE_PARTITION"))
    meta["fields"] = {spec.role: list(spec.fields) for spec in ROLES}
    write_result(args.out, {"meta": meta, "points": points})
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
