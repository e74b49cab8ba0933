"""Where role2's time goes inside one replay of the one-rank Mega MoE layer, per CTA, from inside the kernel (issue
30's large-T loss: role2 takes 20-25 us longer in the layer's replay than alone under Nsight Compute).

The marked variant of the role2 kernel (``GC_ROLE2_MARKS`` defined, kernels/sm90/role2_ring.cuh) records per CTA
the kernel's entry, the moment role1's pool header arrived, the producer's first K step issued, its last task
taken, the consumers' exit, the tasks the CTA took, and, summed over the replay, the time its producer spun on
role1's ring fills (``l1_wait``, l1_full_count) and on W1 tiles of its own grid (``l2_wait``, l2_full_mask) with
how many waits spun. Only the spin path of a wait is counted (a signal already there costs nothing).

Per point (``--preset`` or ``--model-config``, T): the facade's SGLang Hopper call (``fp8_mega_moe`` after the
pre-dispatch, gc-moe-ab's ``facade`` operator) is built twice on identical inputs, once with the production role2
and once with the marked variant. Both are captured in a CUDA graph; ``latency_us`` times the two graphs at the
protocol (interleaved, L2 flushed, median window: what the marks cost), and ``--replays`` further replays of the
marked graph are read back one by one (no L2 flush between them). Per replay the CTA times are taken after the
earliest role2 entry; ``marks`` holds, per field, the median over the replays of the CTAs' median and latest
(times) or median and largest (waits, µs; counts). The two graphs' outputs must be bit-identical.

The marked variant is a measuring tool, not a product kernel: its pipelined variants at BM <= 32 and FP8xFP4 BM =
64 spill a few words (the marks' call in the waits' spin path); the FP8xFP8 BM = 64 / 96 ones that T = 128 / 256
pick on the big shapes do not (tests/tools/test_bench_role2_marks.py).

Run on an H200: ``bash scripts/device_check.sh --bench-only --bench 'role2_marks_sm90 --preset glm52 --tokens 128
256'`` (``python bench/role2_marks_sm90.py --out bench/results/role2_marks_sm90.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from _common import REPO, require_gpus, result_meta, write_result
from cuda.bindings import driver

from gc_moe_compat.ab import model_config, protocol
from gc_moe_compat.ab.inputs import make_tokens, make_weights
from gc_moe_compat.ab.operators import Context, MegaMoeSequence
from gc_moe_compat.operator.sm90 import role2_gemm
from gc_moe_compat.runtime import jit
from gc_moe_compat.runtime.cuda import call
from gc_moe_compat.runtime.green import Role, launch_partition
from gc_moe_compat.runtime.single_rank import single_rank_group

DEFINES = {"GC_ROLE2_MARKS": 1}
"""The marked variant's extra JIT define."""
FIELDS = ("entry", "pool_ready", "l1_wait_ns", "l1_waits", "l2_wait_ns", "l2_waits", "first_load", "last_take",
          "tasks", "exit")
"""The words of one CTA's record, in order (``Role2Mark`` of the kernel)."""
TIMES = ("pool_ready", "first_load", "last_take", "exit")
"""Fields that are %globaltimer times (reported after the replay's earliest entry)."""
WAITS = ("l1_wait_ns", "l2_wait_ns")
"""Fields that are summed wait nanoseconds."""
COUNTS = ("l1_waits", "l2_waits", "tasks")
"""Fields that are counts."""
CTAS = 256
"""CTAs the buffer holds (``kRole2MarkCtas``)."""
GLOBAL = b"gc_role2_marks"


class Marks:
    """The device buffer the marked variant writes (``[CTA][field]`` u64) and its readout."""

    def __init__(self, device: torch.device) -> None:
        self.words = torch.zeros(CTAS * len(FIELDS), dtype=torch.int64, device=device)
        self.pointed: set[tuple[str, int]] = set()

    def point(self, module: jit.Module, contexts: Sequence[driver.CUcontext]) -> None:
        """Points ``module``'s global at this buffer in each of ``contexts`` (a library's global has one copy per
        context: role2 runs on the compute green context when the partition is on)."""
        pointer = np.array([self.words.data_ptr()], dtype=np.uint64)
        for ctx in contexts:
            key = (module.key, int(ctx))
            if key in self.pointed:
                continue
            call(driver.cuCtxPushCurrent, ctx)
            try:
                address, size = call(driver.cuLibraryGetGlobal, module.library, GLOBAL)
                if size != 8:
                    raise RuntimeError(f"{GLOBAL.decode()}: a pointer of 8 bytes expected, the module's global has "
                                       f"{size}")
                call(driver.cuMemcpyHtoD, address, pointer.ctypes.data, 8)
            finally:
                call(driver.cuCtxPopCurrent)
            self.pointed.add(key)

    def replay(self, graph: torch.cuda.CUDAGraph) -> np.ndarray:
        """One replay of ``graph`` on a cleared buffer: the records of the CTAs that ran, ``[CTAs, fields]``."""
        self.words.zero_()
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
        rows = self.words.view(CTAS, len(FIELDS)).cpu().numpy()
        ran = rows[rows[:, FIELDS.index("entry")] != 0]
        if not len(ran):
            raise RuntimeError("role2 stored no marks: the replay did not run the marked variant with its global set "
                               "in the context it ran in")
        return ran


def contexts_of(runner: MegaMoeSequence) -> list[driver.CUcontext]:
    """The CUDA contexts ``runner``'s kernels launch in: this thread's, and its buffer's green contexts."""
    out = [call(driver.cuCtxGetCurrent)]
    workspace = runner.buf.workspace
    partition = launch_partition(workspace.plan, workspace.storage.device.index)
    if partition is not None:
        out += [partition.side(role).ctx for role in Role]
    return out


@contextlib.contextmanager
def marked_role2(built: list[jit.Module]) -> Iterator[None]:
    """Within the block the layer graphs built (a buffer's first call at a T) take the marked role2 variant (role2's
    ``kernel``, which :func:`~gc_moe_compat.operator.sm90.role2_gemm.role2_node` reads when it builds a node,
    swapped); each module it loads is appended to ``built``. Graphs built earlier keep their kernels."""
    production = role2_gemm.kernel

    def kernel(variant: role2_gemm.Role2Variant) -> jit.Kernel:
        defines = {**variant.defines, **DEFINES}
        built.append(jit.load_module(variant.source, defines))
        return jit.load_kernel(variant.source, defines, variant.kernel_name, shared_bytes=variant.smem,
                               ordinal=torch.cuda.current_device())

    role2_gemm.kernel = kernel
    try:
        yield
    finally:
        role2_gemm.kernel = production


def summary(replays: Sequence[np.ndarray]) -> dict[str, dict[str, float]]:
    """Per field, the median over ``replays`` of the CTAs' median and latest / largest: times in µs after the
    replay's earliest entry, waits in µs, counts as counted; ``span`` the latest exit after the earliest entry."""
    col = {f: i for i, f in enumerate(FIELDS)}
    per: dict[str, dict[str, list[float]]] = {}

    def add(name: str, values: np.ndarray) -> None:
        entry = per.setdefault(name, {"median": [], "max": []})
        entry["median"].append(float(np.median(values)))
        entry["max"].append(float(values.max()))

    for rows in replays:
        start = rows[:, col["entry"]].min()
        add("entry", (rows[:, col["entry"]] - start) / 1e3)
        for f in TIMES:
            have = rows[:, col[f]] != 0  # a producer-less variant leaves first_load / last_take at 0
            if have.any():
                add(f, (rows[have, col[f]] - start) / 1e3)
        for f in WAITS:
            add(f.removesuffix("_ns") + "_us", rows[:, col[f]] / 1e3)
        for f in COUNTS:
            add(f, rows[:, col[f]].astype(np.float64))
        add("span", np.array([(rows[:, col["exit"]].max() - start) / 1e3]))
    return {name: {k: statistics.median(v) for k, v in stats.items()} for name, stats in per.items()}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=model_config.PRESET_NAMES, help="default: glm52")
    source.add_argument("--model-config", type=Path, help="a HuggingFace config.json (gc-moe-ab's option)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--replays", type=int, default=20, help="marked replays read back per point")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--windows", type=int, default=10)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/role2_marks_sm90.json")
    args = parser.parse_args(argv)
    for name in ("replays", "warmup", "windows"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: must be at least 1, got {getattr(args, name)}")
    bad = [t for t in args.tokens if t < 1]
    if bad:
        parser.error(f"--tokens: every T must be at least 1, got {bad}")
    return args


def measure(w: model_config.Workload, tokens_per_rank: Sequence[int], group: object, *, replays: int, warmup: int,
            windows: int) -> tuple[list[dict[str, object]], dict[str, object]]:
    """The points of ``w`` at each T of ``tokens_per_rank`` (one rank); the marked runner's partition for the meta
    block."""
    from gc_moe_compat import deep_gemm

    device = torch.device("cuda", torch.cuda.current_device())
    weights = make_weights(w.local_experts, w.hidden, w.intermediate, 0, ("fp8_block128",), device)
    ctx = Context(group, w, 1, 0, weights, device)
    production, marked = MegaMoeSequence(deep_gemm, ctx), MegaMoeSequence(deep_gemm, ctx)
    marks, built = Marks(device), []
    points = []
    try:
        for t in tokens_per_rank:
            tokens = make_tokens(t, ctx.shape("fp8xfp8").num_experts, w.topk, w.hidden, 0, 1,
                                 w.routed_scaling_factor, device)
            production.stage(tokens)
            marked.stage(tokens)
            y_production = production.run().clone()
            with marked_role2(built):
                y_marked = marked.run().clone()
            for runner in (production, marked):
                runner.check(f"role2_marks_sm90 T={t}")
            for module in built:
                marks.point(module, contexts_of(marked))
            graphs = {"production": protocol.capture_graph(production.run),
                      "marked": protocol.capture_graph(marked.run)}
            latency: dict[str, list[float]] = {name: [] for name in graphs}
            for _ in range(2):  # interleaved rounds: a drift of the machine hits both alike
                for name, graph in graphs.items():
                    latency[name] += protocol.graph_windows(graph, warmup, windows)
            records = [marks.replay(graphs["marked"]) for _ in range(replays)]
            marked.check(f"role2_marks_sm90 T={t} (marked replays)")
            bit_identical = bool(torch.equal(y_production, y_marked))
            if not bit_identical:
                raise RuntimeError(f"T={t}: the marked role2 changed the layer's output")
            point = {"workload": w.name, "tokens_per_rank": t, "ctas": int(records[0].shape[0]),
                     "latency_us": {name: statistics.median(v) for name, v in latency.items()},
                     "bit_identical": bit_identical, "marks": summary(records),
                     "tasks_per_replay": [int(r[:, FIELDS.index("tasks")].sum()) for r in records]}
            points.append(point)
            s = point["marks"]
            print(f"{w.name} T={t}: layer {point['latency_us']['production']:.1f} us (marked "
                  f"{point['latency_us']['marked']:.1f}); role2 span {s['span']['median']:.1f}, pool ready "
                  f"{s['pool_ready']['median']:.1f}, exit median/latest {s['exit']['median']:.1f}/"
                  f"{s['exit']['max']:.1f}, L1 wait median/max {s['l1_wait_us']['median']:.1f}/"
                  f"{s['l1_wait_us']['max']:.1f}, L2 wait {s['l2_wait_us']['median']:.1f}/"
                  f"{s['l2_wait_us']['max']:.1f} us", flush=True)
        return points, marked.partition()
    finally:
        production.close()
        marked.close()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    require_gpus("bench/role2_marks_sm90.py")
    w = (model_config.preset(args.preset or "glm52") if args.model_config is None
         else model_config.from_hf_config(args.model_config))
    with single_rank_group() as group:
        points, partition = measure(w, args.tokens, group, replays=args.replays, warmup=args.warmup,
                                    windows=args.windows)
    meta = result_meta("bench/role2_marks_sm90.py", sys.argv[1:] if argv is None else list(argv), partition,
                       env_keys=("GC_MOE_DISPATCH_SMS", "GC_MOE_PARTITION"))
    meta["fields"] = list(FIELDS)
    write_result(args.out, {"meta": meta, "points": points})
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
