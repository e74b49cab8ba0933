"""The content of a ``gc-moe-ab`` result file: points assembled from every rank's record, the run's summary, and
the schema check (docs/bench_protocol.md "Result files").

A *rank record* (one per rank and point, JSON-able, gathered to rank 0) holds ``latency_us`` (op -> that rank's
median window), ``accuracy`` (op -> {reference name -> metrics}), ``pairs`` ("a|b" -> metrics of op a's ``y``
against op b's), ``bit_identical`` (op -> the replayed ``y`` equals the eager one), ``unavailable`` (op -> reason)
and ``floor_bytes`` (mma type -> the bytes this rank must stream). Pure Python: tested on the CPU.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence

from gc_moe_compat.ab.protocol import mean_of_ratios, slowest_rank

__all__ = ["COSINE_FAITHFUL", "PROCESSED_FAITHFUL", "assemble_point", "summarize", "validate_result"]

COSINE_FAITHFUL, PROCESSED_FAITHFUL = 0.9999, 1e-4
"""docs/bench_protocol.md reference-1 targets."""
MODEL_COSINE = {"fp8xfp8": 0.99, "fp8xfp4": 0.97}
"""docs/bench_protocol.md reference-2 (BF16 model) cosine targets per routed-weight format."""
META_KEYS = ("git_sha", "dirty", "date", "gpu", "driver", "torch", "cuda", "world_size", "partition", "command")
POINT_KEYS = ("preset", "mma_type", "shared", "tokens_per_rank", "latency_us", "per_rank_us", "speedup", "floor_us",
              "efficiency", "accuracy")


def _over_ranks(per_rank: Sequence[Mapping[str, float]]) -> dict[str, object]:
    return {
        "cosine_min": min(m["cosine"] for m in per_rank),
        "processed_diff_max": max(m["processed_diff"] for m in per_rank),
        "max_abs_err_max": max(m["max_abs_err"] for m in per_rank),
        "nonfinite": sum(int(m["nonfinite"]) for m in per_rank),
        "per_rank": list(per_rank),
    }


def assemble_point(workload: str, tokens: int, records: Sequence[Mapping[str, object]], ops: Mapping[str, str],
                   bandwidths: Sequence[float], reference_op: str) -> dict[str, object]:
    """One point from every rank's record. ``ops`` maps each compared op to its mma type (in report order);
    ``bandwidths`` is each rank's copy bandwidth (bytes/s). An op is reported where every rank measured it;
    otherwise its reasons are kept under ``unavailable``."""
    if len(records) != len(bandwidths) or not records:
        raise ValueError(f"records: need one per rank ({len(bandwidths)}), got {len(records)}")
    latency, per_rank, accuracy, unavailable = {}, {}, {}, {}
    for op, mma in ops.items():
        reasons = sorted({str(r["unavailable"][op]) for r in records if op in r.get("unavailable", {})})
        if reasons or not all(op in r["latency_us"] for r in records):
            unavailable[op] = "; ".join(reasons) or "not measured on every rank"
            continue
        per_rank[op] = [float(r["latency_us"][op]) for r in records]
        latency[op] = slowest_rank(per_rank[op])
        refs = records[0]["accuracy"][op]
        summary: dict[str, object] = {ref: _over_ranks([r["accuracy"][op][ref] for r in records]) for ref in refs}
        summary["graph_bit_identical_to_eager"] = all(bool(r["bit_identical"][op]) for r in records)
        faithful = summary.get("faithful")
        if faithful is not None:
            summary["meets_faithful_targets"] = (faithful["cosine_min"] >= COSINE_FAITHFUL
                                                 and faithful["processed_diff_max"] <= PROCESSED_FAITHFUL
                                                 and faithful["nonfinite"] == 0)
        model = summary.get("bf16_model")
        if model is not None:
            summary["meets_model_target"] = model["cosine_min"] >= MODEL_COSINE[mma] and model["nonfinite"] == 0
        accuracy[op] = summary
    pairs = {}
    for key in records[0].get("pairs", {}):
        a, b = key.split("|")
        if a in latency and b in latency and all(key in r.get("pairs", {}) for r in records):
            pairs[key] = _over_ranks([r["pairs"][key] for r in records])
    floors = {mma: max(int(r["floor_bytes"][mma]) / bw * 1e6 for r, bw in zip(records, bandwidths, strict=True))
              for mma in sorted(set(ops.values()))}
    speedup = {f"{op}_over_{reference_op}": us / latency[reference_op] for op, us in latency.items()
               if reference_op in latency and op != reference_op}
    point: dict[str, object] = {
        "preset": workload,
        "mma_type": ops.get(reference_op, "fp8xfp8"),
        "shared": False,
        "tokens_per_rank": tokens,
        "latency_us": latency,
        "per_rank_us": per_rank,
        "speedup": speedup,
        "floor_us": floors.get(ops.get(reference_op, "fp8xfp8"), min(floors.values())),
        "floor_us_by_mma": floors,
        "efficiency": {op: floors[ops[op]] / us for op, us in latency.items()},
        "accuracy": {**accuracy, "pairs": pairs},
    }
    if unavailable:
        point["unavailable"] = unavailable
    return point


def summarize(points: Sequence[Mapping[str, object]], reference_op: str) -> dict[str, object]:
    """Per compared op: the mean of its per-point speedup ratios over ``reference_op`` (docs/bench_protocol.md), their
    range and the points behind them."""
    out: dict[str, object] = {}
    keys = sorted({k for p in points for k in p["speedup"]})
    for key in keys:
        values = [(p["tokens_per_rank"], p["speedup"][key]) for p in points if key in p["speedup"]]
        ratios = [v for _, v in values]
        out[key] = {"mean_of_ratios": mean_of_ratios(ratios), "min": min(ratios), "max": max(ratios),
                    "points": len(ratios), "meaning": f"latency of {key.split('_over_')[0]} / latency of "
                                                      f"{reference_op} (> 1: {reference_op} faster)"}
    return out


def validate_result(data: Mapping[str, object], known_ops: Collection[str] | None = None) -> None:
    """Raises ``ValueError`` naming the first field where ``data`` departs from docs/bench_protocol.md's schema. The ops
    every point must measure or mark unavailable are ``meta.ops``'s, or ``known_ops`` (then no other op is allowed)."""
    meta = data.get("meta")
    if not isinstance(meta, Mapping):
        raise ValueError("meta: missing")
    for key in META_KEYS:
        if key not in meta:
            raise ValueError(f"meta.{key}: missing")
    for key in ("dispatch_sms", "compute_sms", "workqueue"):
        if key not in meta["partition"]:
            raise ValueError(f"meta.partition.{key}: missing")
    points = data.get("points")
    if not isinstance(points, list):
        raise ValueError("points: must be a list")
    ops = meta.get("ops", {}) if known_ops is None else known_ops
    for i, p in enumerate(points):
        for key in POINT_KEYS:
            if key not in p:
                raise ValueError(f"points[{i}].{key}: missing")
        for op, us in p["latency_us"].items():
            if known_ops is not None and op not in known_ops:
                raise ValueError(f"points[{i}].latency_us.{op}: must be one of {sorted(known_ops)}")
            if not (isinstance(us, float) and us > 0 and math.isfinite(us)):
                raise ValueError(f"points[{i}].latency_us.{op}: must be a positive latency, got {us}")
            ranks = p["per_rank_us"].get(op)
            if not isinstance(ranks, list) or len(ranks) != meta["world_size"] or max(ranks) != us:
                raise ValueError(f"points[{i}].per_rank_us.{op}: must list {meta['world_size']} ranks whose maximum "
                                 f"is the latency {us}, got {ranks}")
            if op not in p["accuracy"]:
                raise ValueError(f"points[{i}].accuracy.{op}: missing")
        missing = set(ops) - set(p["latency_us"]) - set(p.get("unavailable", {}))
        if missing:
            raise ValueError(f"points[{i}]: ops {sorted(missing)} neither measured nor marked unavailable")
