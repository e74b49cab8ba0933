"""The ``deep_ep`` facade's normal mode (DeepEP's intranode ``dispatch`` / ``combine``, SGLang's prefill path) on one
H200, against the device copy bandwidth measured in the same run.

Per preset (``dsv41-flash``: H 5120, k 6, 48 experts; ``glm52``: H 6144, k 8, 32 experts; one rank, so every expert
is local) and prefill tokens per rank ``T``, uniform top-k routing, DeepEP's test config (``Config(24, 8, 256)``:
24 SMs, the communication green partition requested with 24):

* ``dispatch_bf16`` / ``dispatch_fp8``: an uncached ``Buffer.dispatch`` with top-k (BF16 rows, or FP8 rows with FP32
  1x128 scales), including DeepEP's CPU wait for the received count;
* ``combine``: ``Buffer.combine`` of the BF16 received rows with their top-k weights.

Timing: the calls run eagerly (the uncached dispatch synchronizes the CPU, as DeepEP's does, so it cannot be graph-
captured): BENCH_PROTOCOL.md windows of ``--calls`` calls, L2 flushed between windows, the median window per call.
``floor_us``: one copy of the received payload (rows in and out: 2 x rows x row bytes, scales included) over the copy
bandwidth (bytes read + written) of the same run; ``efficiency = floor_us / latency``. The facade moves each row
twice (into the receiver's workspace, then into the output), so 0.5 is its ceiling; ``algo_GBps`` is DeepEP's figure
(received bytes / time). Accuracy per point: with one rank the received rows are the tokens with a valid slot, in
order, and the combine of them returns the tokens; both are checked bit for bit.

``python bench/deep_ep_sm90.py --out bench/results/deep_ep_sm90.json``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from _common import REPO, copy_bandwidth, pyplot, result_meta, timed_windows

import gc_moe_compat.deep_ep as deep_ep
from gc_moe_compat.runtime.green import get_partition
from gc_moe_compat.runtime.single_rank import single_rank_group

PRESETS = {"dsv41-flash": (5120, 6, 48), "glm52": (6144, 8, 32)}
"""Preset: (hidden H, top-k, experts at one rank)."""
TOKENS = (512, 1024, 2048, 4096, 8192)
NUM_SMS = 24
OPS = ("dispatch_bf16", "dispatch_fp8", "combine")


def payload_bytes(rows: int, hidden: int, fp8: bool) -> int:
    """Bytes of ``rows`` received rows: BF16, or FP8 plus FP32 1x128 scales."""
    return rows * (hidden + 4 * (hidden // 128) if fp8 else 2 * hidden)


def fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepEP's test quantization (per-token 1x128 FP8, amax / 448 scales), scales column-major as it passes them."""
    t, h = x.shape
    amax = x.float().view(t, h // 128, 128).abs().amax(dim=2).clamp(min=1e-4)
    q = (x.float().view(t, h // 128, 128) / (amax / 448).unsqueeze(2)).view(t, h).to(torch.float8_e4m3fn)
    return q, (amax / 448).T.contiguous().T


def point(buf: deep_ep.Buffer, preset: str, tokens: int, bandwidth: float, warmup: int, windows: int,
          calls: int) -> dict[str, object]:
    hidden, topk, experts = PRESETS[preset]
    g = torch.Generator().manual_seed(tokens * 7 + hidden)
    x = torch.randn(tokens, hidden, generator=g, device="cpu").to("cuda", torch.bfloat16)
    idx = torch.stack([torch.randperm(experts, generator=g, device="cpu")[:topk] for _ in range(tokens)]).cuda()
    w = torch.rand(tokens, topk, generator=g, device="cpu").cuda()
    config = deep_ep.Config(NUM_SMS, 8, 256)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=idx, topk_weights=w, config=config)
    x_fp8 = fp8_rows(x)
    recv, _, recv_w, _, handle, _ = buf.dispatch(x, **layout)
    combined, _, _ = buf.combine(recv, handle, topk_weights=recv_w, config=config)
    recv8, *_ = buf.dispatch(x_fp8, **layout)
    torch.cuda.synchronize()
    exact = {"dispatch_bf16": torch.equal(recv, x), "combine": torch.equal(combined, x),
             "dispatch_fp8": torch.equal(recv8[0].view(torch.uint8), x_fp8[0].view(torch.uint8)) and
             torch.equal(recv8[1], x_fp8[1].contiguous())}
    ops = {"dispatch_bf16": lambda: buf.dispatch(x, **layout), "dispatch_fp8": lambda: buf.dispatch(x_fp8, **layout),
           "combine": lambda: buf.combine(recv, handle, topk_weights=recv_w, config=config)}
    latency, floor, efficiency, algo = {}, {}, {}, {}
    for name, fn in ops.items():

        def window(fn=fn) -> None:
            for _ in range(calls):
                fn()

        latency[name] = statistics.median(timed_windows(window, warmup, windows, launches=calls)[0])
        moved = payload_bytes(tokens, hidden, name == "dispatch_fp8")
        floor[name] = 2 * moved / bandwidth * 1e6
        efficiency[name] = floor[name] / latency[name]
        algo[name] = moved / latency[name] / 1e3
    return {"preset": preset, "mma_type": None, "shared": 0, "tokens_per_rank": tokens, "hidden": hidden,
            "topk": topk, "num_experts": experts, "latency_us": latency, "per_rank_us": {k: [v] for k, v in
                                                                                      latency.items()},
            "floor_us": floor, "efficiency": efficiency, "algo_GBps": algo, "accuracy": {"bit_exact": exact}}


def plot(points: list[dict[str, object]], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for preset in PRESETS:
        rows = [p for p in points if p["preset"] == preset]
        t = [p["tokens_per_rank"] for p in rows]
        for op, mark in zip(OPS, ("o", "s", "x"), strict=True):
            ax.plot(t, [p["efficiency"][op] for p in rows], marker=mark, label=f"{preset} {op}")
    ax.axhline(0.5, color="grey", linestyle=":", label="two copies per row (ceiling)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per rank T")
    ax.set_ylabel("floor / latency (one copy at device copy bandwidth)")
    ax.set_title(f"deep_ep normal mode, one H200, {NUM_SMS}-SM communication partition")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/deep_ep_sm90.json")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--windows", type=int, default=10)
    parser.add_argument("--calls", type=int, default=20, help="calls per timed window")
    parser.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    args = parser.parse_args()
    with single_rank_group() as group:
        _run(args, group)


def _run(args: argparse.Namespace, group: dist.ProcessGroup) -> None:
    """Both presets' T sweep through one Buffer on this one-rank group, then the result file, the PNG and the table."""
    bandwidth = copy_bandwidth()
    hidden_bytes = 2 * max(h for h, _, _ in PRESETS.values())
    rows = max(args.tokens)
    nvl_bytes = max(deep_ep.Config(NUM_SMS, 8, 256).get_nvl_buffer_size_hint(hidden_bytes, 1),
                    (rows * (hidden_bytes + 16 + 4 * 64 + 12 * 8) + (1 << 20)))
    buf = deep_ep.Buffer(group, nvl_bytes, 0)
    points = [point(buf, p, t, bandwidth, args.warmup, args.windows, args.calls) for p in PRESETS for t in args.tokens]
    meta = result_meta("bench/deep_ep_sm90.py", sys.argv[1:], get_partition(NUM_SMS).describe(),
                       env_keys=("GC_MOE_PARTITION",))
    meta.update({"copy_bandwidth_Bps": bandwidth, "num_nvl_bytes": nvl_bytes, "config": repr(deep_ep.Config(NUM_SMS,
                                                                                                         8, 256)),
                 "timing": f"eager calls (the uncached dispatch waits on the CPU): {args.warmup} warm-up + "
                           f"{args.windows} windows of {args.calls} calls, L2 flushed between windows"})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "points": points}, indent=1) + "\n")
    plot(points, args.out.with_suffix(".png"))
    print("| preset | T | op | us | floor us | efficiency | GB/s (DeepEP's) | bit-exact |")
    print("|---|---|---|---|---|---|---|---|")
    for p in points:
        for op in OPS:
            print(f"| {p['preset']} | {p['tokens_per_rank']} | {op} | {p['latency_us'][op]:.1f} | "
                  f"{p['floor_us'][op]:.1f} | {p['efficiency'][op]:.2f} | {p['algo_GBps'][op]:.0f} | "
                  f"{'yes' if p['accuracy']['bit_exact'][op] else 'NO'} |")


if __name__ == "__main__":
    main()
