"""The content of a ``gc-moe-ab`` result file: points assembled from every rank's record, the run's summary, and
the schema check (docs/bench_protocol.md "Result files").

A point is timed in N interleaved *rounds* (``gc-moe-ab --repeats N``): every round times every operator once
(warm-up + measured windows). A *rank record* (one per rank and point, JSON-able, gathered to rank 0) holds
``latency_us`` (op -> that rank's latency: the median of its measured windows of every round, pooled),
``repeat_us`` (op -> that rank's median window of each round), ``repeat_window_us`` (op -> [min, median, max] of
its windows of each round; :func:`rank_timing` makes these three), ``repeat_conditions`` (op -> the GPU's clocks,
temperature and power after each round; filled on rank 0 only), ``accuracy`` (op -> {reference name -> metrics}),
``pairs`` ("a|b" -> metrics of op a's ``y`` against op b's), ``bit_identical`` (op -> the replayed ``y`` equals the
eager one), ``unavailable`` (op -> reason) and ``floor_bytes`` (mma type -> the bytes this rank must stream).

Why the pooled median: every window of every round is a sample of the same graph under the same protocol; their
median is the one figure that uses all of them and, like a single round's median, ignores the odd slow window. A
round's latency is the slowest rank's median window of that round (as a point's latency is the slowest rank's);
the spread (:func:`~gc_moe_compat.ab.protocol.spread_pct`) compares those round latencies. Pure Python: tested on
the CPU.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Mapping, Sequence

from gc_moe_compat.ab.protocol import mean_of_ratios, slowest_rank, spread_pct

__all__ = ["COSINE_FAITHFUL", "PROCESSED_FAITHFUL", "assemble_point", "rank_timing", "summarize", "validate_result"]

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


def rank_timing(rounds: Sequence[Sequence[float]]) -> dict[str, object]:
    """One rank's record fields of one operator timed in ``rounds`` (each round's measured windows, µs):
    ``latency_us`` (the median of every round's windows pooled), ``repeat_us`` (each round's median window) and
    ``repeat_window_us`` (each round's [min, median, max] window)."""
    if not rounds or not all(rounds):
        raise ValueError(f"rounds: need at least one round of measured windows each, got {list(rounds)}")
    medians = [statistics.median(r) for r in rounds]
    return {"latency_us": statistics.median([w for r in rounds for w in r]), "repeat_us": medians,
            "repeat_window_us": [[min(r), m, max(r)] for r, m in zip(rounds, medians, strict=True)]}


def _slowest_rounds(records: Sequence[Mapping[str, object]], op: str) -> tuple[list[float], list[list[float]]]:
    """Per round: the slowest rank's median window of that round and that rank's [min, median, max] window.
    ``ValueError`` where the ranks timed different numbers of rounds."""
    counts = [len(r["repeat_us"][op]) for r in records]
    if len(set(counts)) != 1:
        raise ValueError(f"repeat_us.{op}: every rank must time the same rounds, got {counts} rounds per rank")
    per_rank = [list(zip(r["repeat_us"][op], r["repeat_window_us"][op], strict=True)) for r in records]
    slowest = [max(ranks, key=lambda round_: round_[0]) for ranks in zip(*per_rank, strict=True)]
    return [float(median) for median, _ in slowest], [[float(x) for x in window] for _, window in slowest]


def assemble_point(workload: str, tokens: int, records: Sequence[Mapping[str, object]], ops: Mapping[str, str],
                   bandwidths: Sequence[float], reference_op: str) -> dict[str, object]:
    """One point from every rank's record. ``ops`` maps each compared op to its mma type (in report order);
    ``bandwidths`` is each rank's copy bandwidth (bytes/s). An op is reported where every rank measured it;
    otherwise its reasons are kept under ``unavailable``. The timing rounds (module docstring) give ``repeat_us``,
    ``repeat_window_us``, ``repeat_conditions`` (rank 0's) and, with two rounds or more, ``spread_pct``; a run with
    ``--timeline`` gives ``timeline`` (per op, each rank's :func:`~gc_moe_compat.ab.timeline.summarize`)."""
    if len(records) != len(bandwidths) or not records:
        raise ValueError(f"records: need one per rank ({len(bandwidths)}), got {len(records)}")
    latency, per_rank, accuracy, unavailable = {}, {}, {}, {}
    repeat, repeat_window, conditions, spread = {}, {}, {}, {}
    for op, mma in ops.items():
        reasons = sorted({str(r["unavailable"][op]) for r in records if op in r.get("unavailable", {})})
        if reasons or not all(op in r["latency_us"] for r in records):
            unavailable[op] = "; ".join(reasons) or "not measured on every rank"
            continue
        per_rank[op] = [float(r["latency_us"][op]) for r in records]
        latency[op] = slowest_rank(per_rank[op])
        repeat[op], repeat_window[op] = _slowest_rounds(records, op)
        conditions[op] = records[0]["repeat_conditions"][op]
        if (pct := spread_pct(repeat[op])) is not None:
            spread[op] = pct
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
        "repeat_us": repeat,
        "repeat_window_us": repeat_window,
        "repeat_conditions": conditions,
    }
    if spread:
        point["spread_pct"] = spread
    timelines = {op: [r["timeline"][op] for r in records] for op in latency
                 if all(op in r.get("timeline", {}) for r in records)}
    if timelines:
        point["timeline"] = timelines
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
        if "spread_pct" in p:
            _check_spread(p, f"points[{i}]")
        missing = set(ops) - set(p["latency_us"]) - set(p.get("unavailable", {}))
        if missing:
            raise ValueError(f"points[{i}]: ops {sorted(missing)} neither measured nor marked unavailable")


def _check_spread(point: Mapping[str, object], where: str) -> None:
    """A point's ``spread_pct``: one finite percentage >= 0 per measured op, every op timed in the same number (>= 2)
    of rounds (``repeat_us``)."""
    spread, repeat = point["spread_pct"], point.get("repeat_us", {})
    if not isinstance(spread, Mapping) or set(spread) != set(point["latency_us"]):
        raise ValueError(f"{where}.spread_pct: must give every measured op {sorted(point['latency_us'])}, got "
                         f"{spread}")
    for op, pct in spread.items():
        if not (isinstance(pct, (int, float)) and not isinstance(pct, bool) and math.isfinite(pct) and pct >= 0):
            raise ValueError(f"{where}.spread_pct.{op}: must be a finite percentage >= 0, got {pct}")
    rounds = {op: len(repeat[op]) if isinstance(repeat.get(op), list) else None for op in spread}
    if len(set(rounds.values())) > 1 or any(n is None or n < 2 for n in rounds.values()):
        raise ValueError(f"{where}.repeat_us: every op with a spread needs the same number (>= 2) of rounds, got "
                         f"{rounds}")
