"""The ``deep_ep`` facade on one H200 (one rank: every expert is local, every row goes to itself), three parts in one
run and one result file:

1. ``normal``: DeepEP's intranode ``dispatch`` / ``combine`` (SGLang's prefill path) against the device copy bandwidth.
   Per preset (``dsv41-flash``, ``glm52`` from :data:`gc_moe_compat.config.PRESETS`: H, top-k, local experts) and
   prefill tokens ``T``, uniform top-k routing, DeepEP's test config ``Config(24, 8, 256)`` (the communication
   partition requested with 24 SMs): ``dispatch_bf16`` / ``dispatch_fp8`` (an uncached ``Buffer.dispatch`` with
   top-k, BF16 rows or FP8 rows with FP32 1x128 scales, including DeepEP's CPU wait for the received count) and
   ``combine`` (``Buffer.combine`` of the received rows with their weights). The uncached dispatch synchronizes the
   CPU, as DeepEP's does, so these calls are timed eagerly: windows of ``--calls`` calls. ``floor_us``: one copy of
   the received payload (2 x rows x row bytes) over the copy bandwidth (bytes read + written) of the same run; the
   facade moves each row twice, so 0.5 is its ceiling; ``algo_GBps`` is DeepEP's figure (received bytes / time).
   Accuracy: the received rows are the tokens (bit for bit), and so is their combine.
2. ``low_latency``: ``low_latency_dispatch`` (BF16 in, FP8 1x128 out, DeepEP's default) and ``low_latency_combine``
   latency per T (docs/bench_protocol.md's sweep 1..256, ``Tmax`` = 256, the per-rank capacity), for DeepEP's test shape
   (``deepep-test``: H 7168, top-8, 288 experts, as ``tests/legacy/test_low_latency.py``) and the presets', each op
   captured in its own CUDA graph (the kernels where ``GC_MOE_DEEP_EP_PARTITION`` puts them: the caller's stream over
   the whole device by default, the ``Buffer.num_sms`` = 20 communication partition with ``on``) and timed by
   replay; ``pair_graph_us``: both in one graph, the dispatch's handle taken by the combine, as a decode step's graph
   holds them (one graph replay's own cost instead of two: ``graph_replay_floor_us``, a one-kernel graph). Floor: the
   bytes each op must read and write once (dispatch: the BF16 tokens in, every slot's FP8 row and scales out;
   combine: every slot's BF16 row in, the BF16 tokens out) over the copy bandwidth. Accuracy: the eager dispatch bit
   for bit against :func:`gc_moe_compat.testing.ep_reference.ll_quantize` in DeepEP's receive order
   (counts, source tokens, payload, scales), the combine of seeded expert rows bit for bit against
   :func:`~gc_moe_compat.testing.ep_reference.combine_reference`, the replays (both graphs' combine outputs)
   identical to the eager calls.
   ``--phases N``: after each point's timing, N eager calls per op on the phase-timed kernels (bench/_ep_ll_phases.py),
   each read back: when the median and the latest CTA passed each step, and the one-rank checker CTA's steps (the
   point's ``phases``, also printed). Their timing is not the point's.
3. ``overlap``: what the green partition buys SGLang's two-batch overlap: a grouped-GEMM-sized load on the compute
   side while the other micro-batch's dispatch + combine runs. Per preset and T (``Tmax`` = 128, SGLang's default):
   ``green`` (dispatch + combine in one CUDA graph with the kernels on the communication partition, the GEMM on the
   compute partition's stream) against ``ordinary`` (the same graph captured with ``GC_MOE_DEEP_EP_PARTITION=off``,
   both on ordinary streams). The GEMM is a stand-in, labelled so: ``torch.bmm`` of BF16 ``[e, 128, H] x [e, H, 2I]``
   (DeepGEMM's masked grouped L1 GEMM shape, one 128-row block per expert, in BF16, so this part needs no DeepGEMM
   build). A step forks both streams from the main one and joins them; windows of ``--steps`` steps.
   Reported per mode: ``step`` (both done), ``ll`` (step start to the combine's end: the communication's latency
   under the GEMM), ``ll_alone`` per T, ``gemm_alone`` per preset. Accuracy: both modes' combine bit for bit against
   the reference.

Timing: :mod:`gc_moe_compat.ab.protocol` (docs/bench_protocol.md): 10 warm-up + 30 measured windows, L2 flushed and the
device synchronized before each, the median window; graphs by :func:`~gc_moe_compat.ab.protocol.capture_graph` /
:func:`~gc_moe_compat.ab.protocol.median_graph_window` (100 replays a window). The result file is rewritten after each
part, so an interrupted run keeps the parts it finished. The PNG beside it answers the question a decode deployment
asks (the time of one low-latency dispatch and combine call per batch size, :func:`plot`); the normal and overlap
parts are tables (:func:`print_tables`, bench/README.md). ``--dry-run`` prints the plan without a GPU.

``python bench/deep_ep_sm90.py --out bench/results/deep_ep_sm90.json``
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import _ep_ll_phases
import torch
import torch.distributed as dist
from _common import (
    PER_WINDOW,
    REPO,
    copy_bandwidth,
    pyplot,
    require_gpus,
    result_meta,
    timed_windows,
    write_partial_result,
)

import gc_moe_compat.deep_ep as deep_ep
from gc_moe_compat.ab.protocol import capture_graph, graph_replay_floor, median_graph_window
from gc_moe_compat.config import PRESETS as CONFIGS
from gc_moe_compat.deep_ep._config import aligned_bytes
from gc_moe_compat.runtime.green import Role, get_partition
from gc_moe_compat.runtime.single_rank import single_rank_group
from gc_moe_compat.runtime.split import DEEP_EP_PARTITION_ENV, deep_ep_partition_mode
from gc_moe_compat.testing.ep_reference import combine_reference, ll_quantize, receive_plan

PARTS = ("normal", "low_latency", "overlap")
PRESETS = {name: (CONFIGS[name].hidden, CONFIGS[name].topk, CONFIGS[name].local_experts)
           for name in ("dsv41-flash", "glm52")}
"""Preset: (hidden H, top-k, experts at one rank = the per-rank load of the paper's EP8 runs)."""
TOKENS = (512, 1024, 2048, 4096, 8192)
NUM_SMS = 24
OPS = ("dispatch_bf16", "dispatch_fp8", "combine")
LL_SHAPES = {"deepep-test": (7168, 8, 288), **PRESETS}
"""Low-latency shapes: DeepEP's test_low_latency.py (hidden 7168, top-8, 288 experts) and the presets'."""
LL_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
LL_TMAX = 256
LL_OPS = ("dispatch", "combine")
OVERLAP_TOKENS = (16, 128)
OVERLAP_TMAX = 128
MODES = ("green", "ordinary")


# -- shared inputs -----------------------------------------------------------------------------------------------------


def routing(tokens: int, hidden: int, topk: int, experts: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Seeded BF16 tokens ``[T, H]``, uniform top-k ids without repetition ``[T, k]`` (int64) and FP32 weights, on
    the host (the references read them there)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, device="cpu").to(torch.bfloat16)
    idx = torch.stack([torch.randperm(experts, generator=g, device="cpu")[:topk] for _ in range(tokens)])
    w = torch.rand(tokens, topk, generator=g, device="cpu")
    return x, idx, w


class ExpertRows:
    """Seeded BF16 expert outputs of the rows one rank receives, on the host by (local expert, row) for the combine
    reference, and as the padded ``[e, Tmax, H]`` tensor the combine reads (zeros past each expert's rows)."""

    def __init__(self, counts: Sequence[int], max_tokens: int, hidden: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows = [torch.randn(n, hidden, generator=g, device="cpu").to(torch.bfloat16) for n in counts]
        self.shape = (len(counts), max_tokens, hidden)

    def __getitem__(self, index: tuple[int, int]) -> torch.Tensor:
        le, pos = index
        return self.rows[le][pos]

    def padded(self, device: torch.device) -> torch.Tensor:
        out = torch.zeros(self.shape, dtype=torch.bfloat16, device=device)
        for le, rows in enumerate(self.rows):
            out[le, :rows.shape[0]] = rows.to(device)
        return out


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical (NaNs included), on ``a``'s device, of any layout: made contiguous, then flattened (an empty view
    keeps its strides under ``contiguous()``; flattening gives it unit stride)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.to(a.device).contiguous().reshape(-1).view(torch.uint8))


# -- part 1: normal mode -----------------------------------------------------------------------------------------------


def payload_bytes(rows: int, hidden: int, fp8: bool) -> int:
    """Bytes of ``rows`` received rows: BF16, or FP8 plus FP32 1x128 scales."""
    return rows * (hidden + 4 * (hidden // 128) if fp8 else 2 * hidden)


def fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepEP's test quantization (per-token 1x128 FP8, amax / 448 scales), scales column-major as it passes them."""
    t, h = x.shape
    amax = x.float().view(t, h // 128, 128).abs().amax(dim=2).clamp(min=1e-4)
    q = (x.float().view(t, h // 128, 128) / (amax / 448).unsqueeze(2)).view(t, h).to(torch.float8_e4m3fn)
    return q, (amax / 448).T.contiguous().T


def dispatch_kwargs(buf: object, idx: torch.Tensor, w: torch.Tensor, experts: int, config: object
                    ) -> dict[str, object]:
    """The keyword arguments of an uncached top-k ``Buffer.dispatch``: ``get_dispatch_layout``'s counts and mask,
    the routing and ``config`` (any DeepEP-compatible Buffer: the facade's or the original's)."""
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
    return dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=idx, topk_weights=w, config=config)


def normal_point(buf: deep_ep.Buffer, preset: str, tokens: int, bandwidth: float, args: argparse.Namespace
                 ) -> dict[str, object]:
    hidden, topk, experts = PRESETS[preset]
    x, idx, w = (t.cuda() for t in routing(tokens, hidden, topk, experts, tokens * 7 + hidden))
    config = deep_ep.Config(NUM_SMS, 8, 256)
    layout = dispatch_kwargs(buf, idx, w, experts, config)
    x_fp8 = fp8_rows(x)
    recv, _, recv_w, _, handle, _ = buf.dispatch(x, **layout)
    combined, _, _ = buf.combine(recv, handle, topk_weights=recv_w, config=config)
    recv8, *_ = buf.dispatch(x_fp8, **layout)
    torch.cuda.synchronize()
    exact = {"dispatch_bf16": bits_equal(recv, x), "combine": bits_equal(combined, x),
             "dispatch_fp8": bits_equal(recv8[0], x_fp8[0]) and bits_equal(recv8[1], x_fp8[1])}
    ops = {"dispatch_bf16": lambda: buf.dispatch(x, **layout), "dispatch_fp8": lambda: buf.dispatch(x_fp8, **layout),
           "combine": lambda: buf.combine(recv, handle, topk_weights=recv_w, config=config)}
    latency, floor, efficiency, algo = {}, {}, {}, {}
    for name, fn in ops.items():

        def window(fn: Callable[[], object] = fn) -> None:
            for _ in range(args.calls):
                fn()

        latency[name] = statistics.median(timed_windows(window, args.warmup, args.windows, launches=args.calls)[0])
        moved = payload_bytes(tokens, hidden, name == "dispatch_fp8")
        floor[name] = 2 * moved / bandwidth * 1e6
        efficiency[name] = floor[name] / latency[name]
        algo[name] = moved / latency[name] / 1e3
    return {"part": "normal", "preset": preset, "mma_type": None, "shared": 0, "tokens_per_rank": tokens,
            "hidden": hidden, "topk": topk, "num_experts": experts, "latency_us": latency,
            "per_rank_us": {k: [v] for k, v in latency.items()}, "floor_us": floor, "efficiency": efficiency,
            "algo_GBps": algo, "accuracy": {"bit_exact": exact}}


NVL_ROW_EXTRA = 16 + 4 * 64 + 12 * 8
"""Bytes the facade's normal-mode data region keeps per received row beyond the row (source index, top-k, scales)."""


def normal_nvl_bytes(hidden: int, tokens: int, ranks: int = 1, num_sms: int = NUM_SMS) -> int:
    """``num_nvl_bytes`` of a normal-mode Buffer for BF16 rows of ``hidden``: DeepEP's hint, or the facade's whole-call
    data region (``ranks * tokens`` received rows at most, plus 1 MiB), whichever is larger, in the multiples of 128
    bytes a Buffer takes."""
    hidden_bytes = 2 * hidden
    hint = deep_ep.Config(num_sms, 8, 256).get_nvl_buffer_size_hint(hidden_bytes, ranks)
    return aligned_bytes(max(hint, ranks * tokens * (hidden_bytes + NVL_ROW_EXTRA) + (1 << 20)))


def run_normal(group: dist.ProcessGroup, bandwidth: float, args: argparse.Namespace) -> list[dict[str, object]]:
    hidden = max(h for h, _, _ in PRESETS.values())
    buf = deep_ep.Buffer(group, normal_nvl_bytes(hidden, max(args.tokens)), 0, explicitly_destroy=True)
    points = []
    try:
        for preset in PRESETS:
            for t in args.tokens:
                points.append(normal_point(buf, preset, t, bandwidth, args))
                print(f"normal {preset} T={t}: " + ", ".join(f"{op} {us:.1f} us" for op, us in
                                                             points[-1]["latency_us"].items()), flush=True)
    finally:
        buf.destroy()
    return points


# -- part 2: low-latency latency per T ---------------------------------------------------------------------------------


def ll_floor_bytes(tokens: int, hidden: int, topk: int) -> dict[str, int]:
    """Bytes each op reads plus writes at least once: dispatch reads the BF16 tokens and writes every slot's FP8 row
    with its FP32 1x128 scales; combine reads every slot's BF16 row and writes the BF16 tokens."""
    slots = tokens * topk
    return {"dispatch": 2 * tokens * hidden + slots * (hidden + 4 * (hidden // 128)),
            "combine": slots * 2 * hidden + 2 * tokens * hidden}


def check_ll_dispatch(out: tuple, x: torch.Tensor, idx: torch.Tensor) -> bool:
    """One rank's dispatch output bit for bit: expert ``e``'s rows are the tokens routed to it, in token order, as
    :func:`ll_quantize` quantizes them, with their source token indices and counts."""
    (recv_x, recv_scales), count, handle = out[0], out[1], out[2]
    q, scales = ll_quantize(x)
    ok = True
    for e in range(recv_x.shape[0]):
        tokens = (idx == e).any(dim=1).nonzero().flatten()
        n = tokens.numel()
        ok = ok and int(count[e]) == n and bits_equal(recv_x[e, :n], q[tokens]) and \
            bits_equal(recv_scales[e, :n], scales[tokens]) and bits_equal(handle[0][e, :n], tokens.to(torch.int32))
    return ok


def ll_point(buf: deep_ep.Buffer, shape: str, tokens: int, bandwidth: float, args: argparse.Namespace
             ) -> dict[str, object]:
    hidden, topk, experts = LL_SHAPES[shape]
    x_cpu, idx_cpu, w_cpu = routing(tokens, hidden, topk, experts, 31 * tokens + hidden + experts)
    x, idx, w = x_cpu.cuda(), idx_cpu.cuda(), w_cpu.cuda()
    dispatch = functools.partial(buf.low_latency_dispatch, x, idx, LL_TMAX, experts)
    eager = dispatch()
    torch.cuda.synchronize()
    dispatch_exact = check_ll_dispatch(eager, x, idx)
    plan = receive_plan([idx_cpu], experts)
    rows = ExpertRows([len(r) for r in plan.rows[0]], LL_TMAX, hidden, seed=tokens + 17 * experts)
    expert_out = rows.padded(x.device)
    want = combine_reference(0, idx_cpu, w_cpu, [rows], plan)
    handle = eager[2]
    combine_eager = buf.low_latency_combine(expert_out, idx, w, handle)[0]
    torch.cuda.synchronize()
    combine_exact = bits_equal(combine_eager, want)
    captured: dict[str, object] = {}
    out, pair_out = torch.empty_like(combine_eager), torch.empty_like(combine_eager)

    def pair() -> None:  # both ops in one graph, as a decode step's graph holds them: the combine takes this handle
        buf.low_latency_combine(expert_out, idx, w, dispatch()[2], out=pair_out)

    graphs = {"dispatch": capture_graph(lambda: captured.update(dispatch=dispatch())),
              "combine": capture_graph(lambda: buf.low_latency_combine(expert_out, idx, w, handle, out=out))}
    latency = {op: median_graph_window(graph, args.warmup, args.windows) for op, graph in graphs.items()}
    pair_us = median_graph_window(capture_graph(pair), args.warmup, args.windows)
    replay_floor = graph_replay_floor(x.device, args.warmup, args.windows)
    torch.cuda.synchronize()
    replayed = captured["dispatch"]
    # The rows past an expert's count are never written (torch.empty, as DeepEP leaves them): compare the written
    # rows, through the same check as the eager call's, and the whole combine output (of both graphs).
    replay_identical = check_ll_dispatch(replayed, x, idx) and bits_equal(out, combine_eager) and \
        bits_equal(pair_out, combine_eager)
    floor_bytes = ll_floor_bytes(tokens, hidden, topk)
    floor = {op: floor_bytes[op] / bandwidth * 1e6 for op in LL_OPS}
    phases = {}
    if args.phases:
        phases = {"phases": ll_phases(x.device, dispatch, lambda: buf.low_latency_combine(expert_out, idx, w, handle),
                                      args.phases, (x, idx, combine_eager))}
    return {"part": "low_latency", "preset": shape, "mma_type": None, "shared": 0, "tokens_per_rank": tokens,
            "hidden": hidden, "topk": topk, "num_experts": experts, "max_dispatch_tokens_per_rank": LL_TMAX,
            "latency_us": latency, "per_rank_us": {op: [us] for op, us in latency.items()}, "floor_us": floor,
            "pair_graph_us": pair_us, "graph_replay_floor_us": replay_floor,
            "efficiency": {op: floor[op] / latency[op] for op in LL_OPS},
            "accuracy": {"dispatch_bit_exact_vs_reference": dispatch_exact,
                         "combine_bit_exact_vs_reference": combine_exact,
                         "replay_bit_identical": replay_identical}, **phases}


def ll_phases(device: torch.device, dispatch: Callable[[], tuple], combine: Callable[[], tuple], count: int,
              want: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> dict[str, object]:
    """``count`` eager calls of each op on the phase-timed kernels, each read back (bench/_ep_ll_phases.py): per op
    the summary of its marks (one rank: the checker CTA apart), and whether every call's output equals the
    production kernels' (``want``: the tokens, the routing and the eager combine's output)."""
    x, idx, combined = want
    identical = True
    marks: dict[str, list] = {op: [] for op in LL_OPS}
    out: dict[str, tuple] = {}  # each call's outputs, overwritten by the next
    with _ep_ll_phases.variant(device) as times:
        for _ in range(count):
            marks["dispatch"].append(times.timed(lambda: out.update(dispatch=dispatch()), "dispatch"))
            marks["combine"].append(times.timed(lambda: out.update(combine=combine()), "combine"))
            identical = identical and check_ll_dispatch(out["dispatch"], x, idx) and \
                bits_equal(out["combine"][0], combined)
    return {**{op: _ep_ll_phases.summary(calls, op, checker=True) for op, calls in marks.items()},
            "outputs_identical": identical}


def run_low_latency(group: dist.ProcessGroup, bandwidth: float, args: argparse.Namespace
                    ) -> tuple[list[dict[str, object]], dict[str, object]]:
    points, partition = [], {}
    for shape in args.ll_shapes:
        hidden, _, experts = LL_SHAPES[shape]
        hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(LL_TMAX, hidden, 1, experts)
        buf = deep_ep.Buffer(group, 0, hint, low_latency_mode=True, explicitly_destroy=True)
        partition = buf.low_latency_partition
        try:
            for t in args.ll_tokens:
                points.append(ll_point(buf, shape, t, bandwidth, args))
                p = points[-1]
                print(f"low_latency {shape} T={t}: " + ", ".join(f"{op} {p['latency_us'][op]:.1f} us "
                                                                 f"(floor {p['floor_us'][op]:.2f})" for op in LL_OPS) +
                      f" | both in one graph {p['pair_graph_us']:.1f} us"
                      f" | one-kernel graph {p['graph_replay_floor_us']:.1f} us"
                      f" | exact {list(p['accuracy'].values())}", flush=True)
                for line in phase_lines(p):
                    print(line, flush=True)
        finally:
            buf.destroy()
            torch.cuda.empty_cache()
    return points, partition


def phase_lines(point: dict[str, object]) -> list[str]:
    """The printed lines of a low-latency point's ``phases``: per op, the median and latest moving CTA and the
    checker at each mark, µs after the call's first entry."""
    phases = point.get("phases")
    if not phases:
        return []
    lines = []
    for op in LL_OPS:
        got = phases[op]
        line = f"  phases T={point['tokens_per_rank']} {op} ({got['ctas']} CTAs, last exit CTA {got['last_exit_cta']}):"
        for key in ("median_us", "latest_us", "checker_us"):
            if key in got:
                line += f" | {key[:-3]} " + " ".join(f"{m} {us:.2f}" for m, us in got[key].items())
        lines.append(line)
    lines.append(f"  phases outputs identical to the production kernels': {phases['outputs_identical']}")
    return lines


# -- part 3: overlap under a GEMM --------------------------------------------------------------------------------------


def capture_pair(buf: deep_ep.Buffer, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, expert_out: torch.Tensor,
                 out: torch.Tensor, experts: int, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    """Dispatch (FP8) + combine of a fixed expert output into ``out``, run eagerly once then captured on
    ``stream``; the partition mode is the environment's at the call."""

    def layer() -> None:
        _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, OVERLAP_TMAX, experts)
        buf.low_latency_combine(expert_out, idx, w, handle, out=out)

    with torch.cuda.stream(stream):
        layer()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        layer()
    torch.cuda.synchronize()
    return graph


def step_window(ll: torch.cuda.CUDAGraph | None, gemm: Callable[[], None] | None, ll_stream: torch.cuda.Stream,
                gemm_stream: torch.cuda.Stream, steps: int, ll_events: list[tuple[torch.cuda.Event, ...]],
                side: tuple[object, Role] | None) -> Callable[[], None]:
    """A window of ``steps`` steps: fork both streams from the current one, the LL graph on one and the GEMM on the
    other, join; the LL's start/end events of each step go to ``ll_events``. ``side`` = (partition, role) when the
    GEMM stream is a green side's (forked and joined with that partition's events, runtime/side_launch.py)."""
    from gc_moe_compat.runtime.side_launch import fork, join

    main = torch.cuda.current_stream()

    def window() -> None:
        for _ in range(steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(main)
            if ll is not None:
                ll_stream.wait_stream(main)
                with torch.cuda.stream(ll_stream):
                    ll.replay()
                end.record(ll_stream)
                ll_events.append((start, end))
            if gemm is not None:
                if side is None:
                    gemm_stream.wait_stream(main)
                else:
                    fork(*side, main.cuda_stream)
                with torch.cuda.stream(gemm_stream):
                    gemm()
                if side is None:
                    main.wait_stream(gemm_stream)
                else:
                    join(*side, main.cuda_stream)
            if ll is not None:
                main.wait_stream(ll_stream)

    return window


def measure(ll: torch.cuda.CUDAGraph | None, gemm: Callable[[], None] | None, ll_stream: torch.cuda.Stream,
            gemm_stream: torch.cuda.Stream, side: tuple[object, Role] | None,
            args: argparse.Namespace) -> tuple[float, float | None]:
    """(median µs per step, median µs from step start to the LL's end or None)."""
    events: list[tuple[torch.cuda.Event, ...]] = []
    per_step, _ = timed_windows(step_window(ll, gemm, ll_stream, gemm_stream, args.steps, events, side),
                                args.warmup, args.windows, launches=args.steps)
    torch.cuda.synchronize()
    measured = events[args.warmup * args.steps:]
    ll_us = statistics.median(s.elapsed_time(e) * 1e3 for s, e in measured) if measured else None
    return statistics.median(per_step), ll_us


def run_overlap(group: dist.ProcessGroup, args: argparse.Namespace) -> list[dict[str, object]]:
    dev = torch.device("cuda", torch.cuda.current_device())
    points = []
    for preset in args.overlap_presets:
        cfg = CONFIGS[preset]
        e, h, inter, k = cfg.local_experts, cfg.hidden, cfg.intermediate, cfg.topk
        hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(OVERLAP_TMAX, h, 1, e)
        buf = deep_ep.Buffer(group, 0, hint, low_latency_mode=True, explicitly_destroy=True)
        partition = get_partition(deep_ep.Buffer.num_sms, dev.index)
        side = (partition, Role.COMPUTE)
        streams = {"green": partition.side(Role.COMPUTE).torch_stream(dev.index), "ordinary": torch.cuda.Stream(dev)}
        g = torch.Generator(device=dev).manual_seed(e * h)
        a = torch.randn(e, OVERLAP_TMAX, h, generator=g, device=dev).to(torch.bfloat16)
        wgt = (torch.randn(e, h, 2 * inter, generator=g, device=dev) * 0.02).to(torch.bfloat16)
        c = torch.empty(e, OVERLAP_TMAX, 2 * inter, dtype=torch.bfloat16, device=dev)
        gemm = functools.partial(torch.bmm, a, wgt, out=c)
        ll_stream = torch.cuda.Stream(dev)
        gemm_alone = {mode: measure(None, gemm, ll_stream, streams[mode], side if mode == "green" else None,
                                    args)[0] for mode in MODES}
        for t in args.overlap_tokens:
            x_cpu, idx_cpu, w_cpu = routing(t, h, k, e, 1000 * t + e)
            plan = receive_plan([idx_cpu], e)
            rows = ExpertRows([len(r) for r in plan.rows[0]], OVERLAP_TMAX, h, seed=2000 * t + e)
            want = combine_reference(0, idx_cpu, w_cpu, [rows], plan)
            x, idx, w, expert_out = x_cpu.to(dev), idx_cpu.to(dev), w_cpu.to(dev), rows.padded(dev)
            lat: dict[str, float] = {}
            accuracy = {}
            for mode in MODES:
                out = torch.full((t, h), float("nan"), dtype=torch.bfloat16, device=dev)
                before = os.environ.get(DEEP_EP_PARTITION_ENV)
                os.environ[DEEP_EP_PARTITION_ENV] = "on" if mode == "green" else "off"
                try:
                    graph = capture_pair(buf, x, idx, w, expert_out, out, e, ll_stream)
                finally:
                    if before is None:
                        os.environ.pop(DEEP_EP_PARTITION_ENV)
                    else:
                        os.environ[DEEP_EP_PARTITION_ENV] = before
                mode_side = side if mode == "green" else None
                lat[f"{mode}_step"], lat[f"{mode}_ll"] = measure(graph, gemm, ll_stream, streams[mode], mode_side,
                                                                 args)
                lat[f"{mode}_gemm_alone"] = gemm_alone[mode]
                _, lat[f"{mode}_ll_alone"] = measure(graph, None, ll_stream, streams[mode], mode_side, args)
                torch.cuda.synchronize()
                accuracy[mode] = {"bit_exact_vs_reference": bits_equal(out, want),
                                  "nan_count": int(out.isnan().sum())}
                del graph
            points.append({"part": "overlap", "preset": preset, "tokens_per_rank": t, "mma_type": None, "shared": 0,
                           "max_dispatch_tokens_per_rank": OVERLAP_TMAX, "latency_us": lat,
                           "speedup": lat["ordinary_step"] / lat["green_step"],
                           "ll_speedup_under_gemm": lat["ordinary_ll"] / lat["green_ll"], "accuracy": accuracy})
            print(f"overlap {preset} T={t}: " + ", ".join(f"{op} {v:.1f}" for op, v in lat.items()) +
                  f" | exact {[accuracy[m]['bit_exact_vs_reference'] for m in MODES]}", flush=True)
        buf.destroy()
        torch.cuda.empty_cache()
    return points


# -- the result file ---------------------------------------------------------------------------------------------------


SHAPE_LABELS = {
    "deepep-test": "DeepEP's test shape (hidden 7168, top-8, 288 experts)",
    "dsv41-flash": "DeepSeek-V4.1-Flash, one GPU of 8 (hidden 5120, top-6, 48 experts)",
    "glm52": "GLM-5.2, one GPU of 8 (hidden 6144, top-8, 32 experts)",
}
"""How the PNG names each low-latency shape (:data:`LL_SHAPES`)."""


def plot(points: list[dict[str, object]], path: Path) -> None:
    """The PNG answers one question: how long does one low-latency dispatch and one combine take on one H200 as the
    decode batch grows? One panel per call, latency per call against tokens per GPU, one line per model shape. The
    normal mode and the overlap part are tables (print_tables, bench/README.md)."""
    plt = pyplot()
    if plt is None:
        return
    rows = [p for p in points if p["part"] == "low_latency"]
    fig, axes = plt.subplots(1, len(LL_OPS), figsize=(11, 4.4), sharey=True)
    for ax, op in zip(axes, LL_OPS, strict=True):
        for shape, marker in zip(LL_SHAPES, ("o", "s", "^"), strict=True):
            mine = [p for p in rows if p["preset"] == shape]
            if mine:
                ax.plot([p["tokens_per_rank"] for p in mine], [p["latency_us"][op] for p in mine], marker=marker,
                        label=SHAPE_LABELS[shape])
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(LL_TOKENS), [str(t) for t in LL_TOKENS])
        ax.set_xlabel("tokens per GPU (decode batch)")
        ax.set_title(f"low_latency_{op}: BF16 in, FP8 out" if op == "dispatch" else f"low_latency_{op}: BF16",
                     fontsize=10)
        ax.grid(True, alpha=0.3)
        if not rows:
            ax.text(0.5, 0.5, "not measured in this run", ha="center", va="center", transform=ax.transAxes)
    axes[0].set_ylabel("time per call (µs)")
    axes[0].set_ylim(bottom=0)
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(loc="upper left", fontsize=8)
    fig.suptitle("deep_ep facade on one H200: time of one low-latency dispatch / combine call\n(one GPU, so no NVLink "
                 "traffic; CUDA-graph replay)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_result(args: argparse.Namespace, points: list[dict[str, object]], partitions: dict[str, object],
                 bandwidth: float) -> None:
    meta = result_meta("bench/deep_ep_sm90.py", sys.argv[1:], partitions, env_keys=(DEEP_EP_PARTITION_ENV,))
    meta |= {"copy_bandwidth_Bps": bandwidth,
             "timing": {"warmup_windows": args.warmup, "windows": args.windows,
                        "normal": f"eager calls (the uncached dispatch waits on the CPU), {args.calls} per window",
                        "low_latency": f"CUDA-graph replays, {PER_WINDOW} per window",
                        "overlap": f"{args.steps} steps per window (two streams forked and joined per step)"},
             "normal_config": repr(deep_ep.Config(NUM_SMS, 8, 256)),
             "overlap_ops": {"ll": "low_latency_dispatch (BF16 in, FP8 out) + low_latency_combine, one CUDA graph",
                             "gemm": "STAND-IN for DeepGEMM's masked grouped L1 GEMM: torch.bmm BF16 [e, 128, H] x "
                                     "[e, H, 2I]",
                             "green": "LL kernels on the communication green partition, GEMM on the compute "
                                      "partition's stream",
                             "ordinary": "GC_MOE_DEEP_EP_PARTITION=off: LL kernels on the whole device, both on "
                                         "ordinary streams"}}
    write_partial_result(args.out, meta, points, unit="parts", key="part",
                         requested=[p for p in PARTS if p in args.parts])
    plot(points, args.out.with_suffix(".png"))


def print_tables(points: list[dict[str, object]]) -> None:
    print("| preset | T | op | us | floor us | efficiency | GB/s (DeepEP's) | bit-exact |\n"
          "|---|---|---|---|---|---|---|---|")
    for p in (p for p in points if p["part"] == "normal"):
        for op in OPS:
            print(f"| {p['preset']} | {p['tokens_per_rank']} | {op} | {p['latency_us'][op]:.1f} | "
                  f"{p['floor_us'][op]:.1f} | {p['efficiency'][op]:.3f} | {p['algo_GBps'][op]:.0f} | "
                  f"{'yes' if p['accuracy']['bit_exact'][op] else 'NO'} |")
    print("\n| shape | T | dispatch us | combine us | both in one graph us | floor us (d / c) | one-kernel graph us "
          "| bit-exact |\n|---|---|---|---|---|---|---|---|")
    for p in (p for p in points if p["part"] == "low_latency"):
        lat, floor = p["latency_us"], p["floor_us"]
        print(f"| {p['preset']} | {p['tokens_per_rank']} | {lat['dispatch']:.1f} | {lat['combine']:.1f} | "
              f"{p['pair_graph_us']:.1f} | "
              f"{floor['dispatch']:.2f} / {floor['combine']:.2f} | {p['graph_replay_floor_us']:.1f} | "
              f"{'yes' if all(p['accuracy'].values()) else 'NO'} |")
    print("\n| preset | T | mode | step us | dispatch+combine done us | GEMM alone us | dispatch+combine alone us |"
          "\n|---|---|---|---|---|---|---|")
    for p in (p for p in points if p["part"] == "overlap"):
        lat = p["latency_us"]
        for mode in MODES:
            print(f"| {p['preset']} | {p['tokens_per_rank']} | {mode} | {lat[f'{mode}_step']:.1f} | "
                  f"{lat[f'{mode}_ll']:.1f} | {lat[f'{mode}_gemm_alone']:.1f} | {lat[f'{mode}_ll_alone']:.1f} |")


def plan_lines(args: argparse.Namespace) -> list[str]:
    """What a run measures (``--dry-run`` prints it; no GPU needed)."""
    lines = [f"windows: {args.warmup} warm-up + {args.windows} measured, L2 flushed before each"]
    if "normal" in args.parts:
        lines.append(f"normal: {len(PRESETS)} presets x T {args.tokens} x {len(OPS)} ops, {args.calls} eager calls "
                     "per window")
    if "low_latency" in args.parts:
        lines.append(f"low_latency: {args.ll_shapes} x T {args.ll_tokens} (Tmax {LL_TMAX}) x {len(LL_OPS)} graphs, "
                     f"{PER_WINDOW} replays per window" +
                     (f"; then {args.phases} phase-timed eager calls per op" if args.phases else ""))
    if "overlap" in args.parts:
        lines.append(f"overlap: {args.overlap_presets} x T {args.overlap_tokens} (Tmax {OVERLAP_TMAX}) x "
                     f"{len(MODES)} modes, {args.steps} steps per window")
    return lines


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/deep_ep_sm90.json")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--windows", type=int, default=30)
    parser.add_argument("--calls", type=int, default=10, help="normal mode: eager calls per timed window")
    parser.add_argument("--steps", type=int, default=PER_WINDOW, help="overlap: steps per timed window")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="normal mode's T")
    parser.add_argument("--ll-tokens", type=int, nargs="+", default=list(LL_TOKENS))
    parser.add_argument("--ll-shapes", nargs="+", default=list(LL_SHAPES), choices=list(LL_SHAPES))
    parser.add_argument("--overlap-tokens", type=int, nargs="+", default=list(OVERLAP_TOKENS))
    parser.add_argument("--overlap-presets", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    parser.add_argument("--phases", type=int, default=0,
                        help="low_latency: eager calls per op on the phase-timed kernels after each point "
                             "(bench/_ep_ll_phases.py): where the time inside each goes")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU)")
    args = parser.parse_args(argv)
    for name, value in (("--warmup", args.warmup), ("--windows", args.windows), ("--calls", args.calls),
                        ("--steps", args.steps), ("--phases", args.phases)):
        least = 0 if name in ("--warmup", "--phases") else 1
        if value < least:
            parser.error(f"{name}: must be >= {least}, got {value}")
    for name, tokens, lo, hi in (("--tokens", args.tokens, 1, None), ("--ll-tokens", args.ll_tokens, 1, LL_TMAX),
                                 ("--overlap-tokens", args.overlap_tokens, 1, OVERLAP_TMAX)):
        bad = [t for t in tokens if t < lo or (hi is not None and t > hi)]
        if bad:
            parser.error(f"{name}: every T must lie in [{lo}, {hi or 'inf'}], got {bad}")
    return args


def main() -> int:
    args = parse_args(sys.argv[1:])
    print("\n".join(plan_lines(args)), flush=True)
    if args.dry_run:
        return 0
    require_gpus("deep_ep_sm90", hint="--dry-run prints the plan without one")
    with single_rank_group() as group:
        bandwidth = copy_bandwidth()
        points: list[dict[str, object]] = []
        partitions: dict[str, object] = {}
        if "normal" in args.parts:
            points += run_normal(group, bandwidth, args)
            partitions["normal"] = ({"partition": "on", **get_partition(NUM_SMS).describe()}
                                    if deep_ep_partition_mode() == "on" else {"partition": "off"})
            write_result(args, points, partitions, bandwidth)
        if "low_latency" in args.parts:
            ll_points, partitions["low_latency"] = run_low_latency(group, bandwidth, args)
            points += ll_points
            write_result(args, points, partitions, bandwidth)
        if "overlap" in args.parts:
            points += run_overlap(group, args)
            partitions.setdefault("low_latency", get_partition(deep_ep.Buffer.num_sms).describe())
            write_result(args, points, partitions, bandwidth)
    print_tables(points)
    return 0


if __name__ == "__main__":
    sys.exit(main())
