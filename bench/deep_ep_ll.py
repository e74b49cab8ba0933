"""The ``deep_ep`` facade's low-latency dispatch + combine on two H200s, against an NCCL all-to-all exchange.

The original DeepEP's low-latency mode does not run on the machines this was measured on (it needs a network card for
NVSHMEM: docs/platform_notes.md), so the comparison is the exchange of the operator benchmark's composed baseline.
Per preset (``dsv41-flash``, ``glm52``: hidden ``H``, top-k ``k``, ``E = 2e`` experts at EP2) and tokens per rank
``T``, with ``Tmax = 128`` (SGLang's default ``num_max_dispatch_tokens_per_rank``) and uniform top-k routing, each
op captured in one CUDA graph and timed by replay:

* ``deep_ep_facade``: ``Buffer.low_latency_dispatch`` (BF16 tokens, FP8 1x128 quantization inside the kernel, DeepEP's
  ``[e, P*Tmax, H]`` layout) then ``Buffer.low_latency_combine`` of a fixed BF16 expert output (the expert GEMMs are
  not part of either op).
* ``nccl_all_to_all``: bench/_baseline_sm90.py's exchange: pack the FP8 rows (already quantized: favours it),
  ``all_to_all_single``, unpack into DeepGEMM's masked layout, gather the fixed expert output back,
  ``all_to_all_single``, slot-order combine; its split sizes are planned on the host before capture (favours it).

Timing (docs/bench_protocol.md): windows of 100 replays, 10 warm-up + 30 measured, L2 flushed and both ranks aligned
(device all-reduce) before each window; a point's latency is the slowest rank's median window. Floor per point: the
bytes one rank must move over NVLink (rows to the other rank: FP8 + FP32 scales out, BF16 back), the larger of the two
ranks, over the peer copy bandwidth measured in the same run. Accuracy: the facade's combined output of the eager run
is compared bit for bit with :func:`gc_moe_compat.testing.ep_reference.combine_reference`, and the replayed output
with the eager one.

``python bench/deep_ep_ll.py --out bench/results/deep_ep_ll_x2.json`` (re-executes itself on two ranks).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import _baseline_sm90 as base
import torch
from _common import PER_WINDOW, REPO, pyplot, require_gpus, result_meta
from _common import write_result as write_file
from operator_sm90 import WORLD, Ranks

from gc_moe_compat.ab.protocol import capture_graph, median_graph_window, torchrun_command

TMAX = 128
TOKENS = (1, 4, 16, 32, 64, 128)
PRESETS = ("dsv41-flash", "glm52")
OPS = ("deep_ep_facade", "nccl_all_to_all")


def peer_bandwidth() -> float:
    """Bytes/s of a 1 GiB copy from this GPU to the other one (median of 10), measured by rank 0 only."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(src, device="cuda:1")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(12):
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return src.numel() / statistics.median(times[2:])


def nvlink_bytes(plans: Sequence[base.A2APlan], hidden: int) -> int:
    """The larger rank's bytes that cross NVLink: rows sent to the other rank out (FP8 + FP32 scales) and back
    (BF16), plus the rows it receives from the other rank (same sizes)."""
    row_out, row_back = hidden + 4 * (hidden // 128), 2 * hidden
    worst = 0
    for p in plans:
        remote_sent = sum(n for d, n in enumerate(p.input_splits) if d != p.rank)
        remote_recv = sum(n for s, n in enumerate(p.output_splits) if s != p.rank)
        worst = max(worst, (remote_sent + remote_recv) * (row_out + row_back))
    return worst


class ExpertRows:
    """One rank's stand-in expert output by (local expert, packed row), for the reference: seeded BF16 rows for the
    rows that rank receives (the same on every rank that asks), without materializing the padded tensor."""

    def __init__(self, counts: Sequence[int], hidden: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.rows = [torch.randn(n, hidden, generator=gen).to(torch.bfloat16) for n in counts]
        self.shape = (len(counts), WORLD * TMAX, hidden)

    def __getitem__(self, index: tuple[int, int]) -> torch.Tensor:
        le, pos = index
        return self.rows[le][pos]

    def padded(self) -> torch.Tensor:
        """The ``[e, P*Tmax, H]`` tensor the combine reads (zeros past each expert's rows), on the GPU."""
        out = torch.zeros(self.shape, dtype=torch.bfloat16, device="cuda")
        for le, rows in enumerate(self.rows):
            out[le, :rows.shape[0]] = rows.cuda()
        return out


def facade_layer(buffer: object, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, expert_out: torch.Tensor,
                 out: torch.Tensor, experts: int) -> torch.Tensor:
    """The facade's dispatch then combine of ``expert_out`` into ``out`` (what one op replays)."""
    _, _, handle, _, _ = buffer.low_latency_dispatch(x, idx, TMAX, experts)
    buffer.low_latency_combine(expert_out, idx, weights, handle, out=out)
    return out


class NcclExchange:
    """The composed baseline's exchange (:class:`_baseline_sm90.AllToAllExchange`) around a fixed expert output: what
    the ``nccl_all_to_all`` op replays."""

    def __init__(self, group: object, plan: base.A2APlan, inputs: object, hidden: int) -> None:
        dev = inputs.x.device
        e, max_m = plan.num_local_experts, plan.max_m
        self.exchange = base.AllToAllExchange(group, plan, hidden, dev)
        self.inputs = inputs
        self.masked_x = torch.zeros(e, max_m, hidden, dtype=torch.float8_e4m3fn, device=dev)
        self.masked_sf_t = torch.zeros(e, hidden // 128, max_m, dtype=torch.float32, device=dev)
        self.masked_rw = torch.zeros(e, max_m, dtype=torch.float32, device=dev)
        self.expert_rows = torch.randn(e * max_m, hidden, device=dev).to(torch.bfloat16)

    def run(self) -> torch.Tensor:
        i = self.inputs
        self.exchange.dispatch(i.x, i.x_sf, i.topk_weights, self.masked_x, self.masked_sf_t, self.masked_rw)
        return self.exchange.combine(self.expert_rows)


def run_ranks(args: argparse.Namespace) -> None:
    import gc_moe_compat.deep_ep as deep_ep
    from gc_moe_compat.testing.ep_reference import combine_reference, receive_plan
    from gc_moe_compat.testing.operator_workload import make_inputs, preset_dims

    ranks = Ranks()
    rank, group, gather = ranks.rank, ranks.group, ranks.gather
    bandwidth = gather(peer_bandwidth() if rank == 0 else None)[0]
    points = []
    for preset in args.presets:
        e, k, h, _ = preset_dims(preset)
        experts = e * WORLD
        hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(TMAX, h, WORLD, experts)
        buffer = deep_ep.Buffer(group, 0, hint, low_latency_mode=True, num_qps_per_rank=e)
        for t in args.tokens:
            inputs = [make_inputs("uniform", t, experts, k, h, seed=70_000 + 2 * t + r) for r in range(WORLD)]
            mine = inputs[rank]
            x_bf16 = (mine.x.float() * mine.x_sf.repeat_interleave(128, dim=1)).to(torch.bfloat16)
            plan = receive_plan([i.topk_idx.cpu() for i in inputs], experts)
            counts = [len(rows) for rows in plan.rows[rank]]
            stand_ins = [ExpertRows([len(rows) for rows in plan.rows[q]], h, seed=90_000 + 2 * t + q)
                         for q in range(WORLD)]
            expert_out = stand_ins[rank].padded()
            out = torch.empty(t, h, dtype=torch.bfloat16, device="cuda")

            facade = functools.partial(facade_layer, buffer, x_bf16, mine.topk_idx, mine.topk_weights, expert_out,
                                       out, experts)
            record: dict[str, object] = {"latency_us": {}}
            eager = facade().clone()
            want = combine_reference(rank, mine.topk_idx.cpu(), mine.topk_weights.cpu(), stand_ins, plan)
            record["facade_bit_exact"] = torch.equal(eager.cpu().view(torch.int16), want.view(torch.int16))
            graph = capture_graph(facade)
            record["latency_us"]["deep_ep_facade"] = median_graph_window(graph, args.warmup, args.windows,
                                                                          ranks.align)
            record["replay_bit_exact"] = torch.equal(out.view(torch.int16), eager.view(torch.int16))
            del graph

            plans = [base.plan_all_to_all([i.topk_idx for i in inputs], experts, r) for r in range(WORLD)]
            nccl = NcclExchange(group, plans[rank], mine, h)
            nccl.run()
            graph = capture_graph(nccl.run)
            record["latency_us"]["nccl_all_to_all"] = median_graph_window(graph, args.warmup, args.windows,
                                                                           ranks.align)
            del graph, nccl
            record["received_rows"] = sum(counts)
            records = gather(record)
            floor_us = nvlink_bytes(plans, h) / bandwidth * 1e6
            latency = {op: max(r["latency_us"][op] for r in records) for op in OPS}
            points.append({
                "preset": preset, "tokens_per_rank": t, "hidden": h, "topk": k, "num_experts": experts,
                "latency_us": latency, "per_rank_us": {op: [r["latency_us"][op] for r in records] for op in OPS},
                "speedup_facade_over_nccl": latency["nccl_all_to_all"] / latency["deep_ep_facade"],
                "floor_us": floor_us, "efficiency": {op: floor_us / us for op, us in latency.items()},
                "received_rows": [r["received_rows"] for r in records],
                "accuracy": {"deep_ep_facade": {"bit_exact_vs_reference": all(r["facade_bit_exact"] for r in records),
                                                "replay_bit_identical": all(r["replay_bit_exact"] for r in records)}},
            })
            if rank == 0:
                print(f"{preset} T={t}: facade {latency['deep_ep_facade']:.1f} µs, nccl "
                      f"{latency['nccl_all_to_all']:.1f} µs, floor {floor_us:.1f} µs", flush=True)
    if rank == 0:
        write_result(args, points, bandwidth)
    ranks.dist.barrier()


def write_result(args: argparse.Namespace, points: list[dict[str, object]], bandwidth: float) -> None:
    meta = result_meta("bench/deep_ep_ll.py", sys.argv[1:], {"dispatch_sms": None, "compute_sms": None,
                                                            "workqueue": None, "note": "no green contexts"},
                       world_size=WORLD)
    meta |= {"timing": {"warmup_windows": args.warmup, "windows": args.windows, "replays_per_window": PER_WINDOW},
             "peer_copy_bandwidth_bytes_per_s": bandwidth, "max_dispatch_tokens_per_rank": TMAX,
             "floor": "larger rank's NVLink bytes (remote rows out FP8 + scales, back BF16, both directions) over "
                      "the GPU0->GPU1 copy bandwidth",
             "ops": {"deep_ep_facade": "gc_moe_compat.deep_ep low_latency_dispatch (BF16 in, FP8 out) + "
                                       "low_latency_combine",
                     "nccl_all_to_all": "pre-quantized FP8 rows: Triton pack -> all_to_all_single -> unpack -> "
                                        "gather -> all_to_all_single -> combine (host-planned splits)"}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_file(args.out, {"meta": meta, "points": points})
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, len(args.presets), figsize=(6 * len(args.presets), 4), squeeze=False)
        for ax, preset in zip(axes[0], args.presets, strict=True):
            pts = [p for p in points if p["preset"] == preset]
            ts = [p["tokens_per_rank"] for p in pts]
            for op in OPS:
                ax.plot(ts, [p["latency_us"][op] for p in pts], marker="o", label=op)
            ax.plot(ts, [p["floor_us"] for p in pts], "k--", label="floor (NVLink bytes / peer copy BW)")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tokens per rank")
            ax.set_title(f"{preset}, 2 x H200: dispatch + combine (µs)")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.out.with_suffix(".png"), dpi=110)
    print(f"{'preset':<12} {'T':>4} {'facade':>8} {'nccl':>8} {'floor':>7} {'x nccl':>7} {'exact':>6}")
    for p in points:
        lat = p["latency_us"]
        print(f"{p['preset']:<12} {p['tokens_per_rank']:>4} {lat['deep_ep_facade']:8.1f} {lat['nccl_all_to_all']:8.1f}"
              f" {p['floor_us']:7.1f} {p['speedup_facade_over_nccl']:7.2f} "
              f"{str(p['accuracy']['deep_ep_facade']['bit_exact_vs_reference']):>6}")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/deep_ep_ll_x2.json")
    parser.add_argument("--presets", nargs="+", default=list(PRESETS), choices=PRESETS)
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--windows", type=int, default=30)
    args = parser.parse_args(argv)
    bad = [t for t in args.tokens if not 1 <= t <= TMAX]
    if bad:
        parser.error(f"--tokens: every T must lie in [1, {TMAX}], got {bad}")
    return args


def main() -> int:
    args = parse_args(sys.argv[1:])
    if "LOCAL_RANK" in os.environ:
        run_ranks(args)
        sys.stdout.flush()
        os._exit(0)  # docs/platform_notes.md: destroy_process_group() after graph-captured NCCL calls can hang at exit
    require_gpus("deep_ep_ll", WORLD)
    cmd, env = torchrun_command([str(Path(__file__).resolve()), *sys.argv[1:]], WORLD)
    return subprocess.run(cmd, env=env, timeout=540).returncode


if __name__ == "__main__":
    sys.exit(main())
