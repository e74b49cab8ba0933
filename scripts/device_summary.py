"""Prints the short table that ends scripts/device_check.sh: test outcomes, then each benchmark's points.

Usage: python scripts/device_summary.py OUT_DIR [BENCH_NAME...]
"""

from __future__ import annotations

import csv
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def tests(out: Path) -> None:
    junit = out / "pytest.xml"
    if not junit.is_file():
        print("tests: not run")
        return
    cases = ET.parse(junit).getroot().iter("testcase")
    outcome: dict[str, list[str]] = {"passed": [], "failed": [], "skipped": []}
    for case in cases:
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            outcome["failed"].append(name)
        elif case.find("skipped") is not None:
            outcome["skipped"].append(name)
        else:
            outcome["passed"].append(name)
    print("tests: " + ", ".join(f"{len(v)} {k}" for k, v in outcome.items()))
    for name in outcome["failed"]:
        print(f"  FAILED {name}")


def bench(out: Path, name: str) -> None:
    path = out / f"{name}.json"
    if not path.is_file():
        print(f"bench {name}: no result file (see bench.log)")
        return
    data = json.loads(path.read_text())
    print(f"bench {name}: partition {data['meta']['partition']}")
    for point in data["points"]:
        label = " ".join(str(point.get(k)) for k in ("case", "launch", "preset", "tokens_per_rank") if k in point)
        print(f"  {label:<40} {latencies(point)}")


def latencies(point: dict) -> str:
    """A point's latencies: one per operation, or (bench/graph_gap_sm90.py) each kernel's duration in each traced
    sequence, or (its sweep) each sequence's latency at the most replays per window."""
    traced = point.get("trace", {}) | point.get("probes", {})
    if traced:
        return ", ".join(f"{seq} " + "/".join(f"{k['dur_us']:.1f}" for k in t["positions"]) + " us"
                         if "positions" in t else f"{seq} {t}" for seq, t in traced.items())
    return ", ".join(f"{op} {list(us.values())[-1] if isinstance(us, dict) else us:.2f} us"
                     for op, us in point["latency_us"].items())


# The --counters metrics printed, in MB (L2 sectors are 32 bytes).
COUNTER_MB = {"dram__bytes_read.sum": "DRAM read", "dram__bytes_write.sum": "DRAM write",
              "lts__t_sectors_op_read.sum": "L2 reads", "lts__t_sectors_op_read_lookup_miss.sum": "L2 read misses"}


def counters(out: Path) -> None:
    """Each --counters CSV (Nsight Compute, one row per graph replay): DRAM and L2 read traffic in MB."""
    for path in sorted(out.glob("counters_*.csv")):
        rows = [r for r in csv.reader(path.read_text().splitlines()) if r]
        header = next((r for r in rows if r[0] == "ID"), None)
        if header is None:
            print(f"counters {path.stem}: no profile (see the file)")
            continue
        print(f"counters {path.stem}")
        for row in (r for r in rows if r[0].isdigit()):
            mb = {name: int(row[i].replace(",", "")) * (32 if "sectors" in name else 1) / 1e6
                  for i, name in enumerate(header) if name in COUNTER_MB}
            text = ", ".join(f"{label} {mb[name]:.1f} MB" for name, label in COUNTER_MB.items())
            print(f"  replay {row[0]}: {text}")


def main() -> None:
    out = Path(sys.argv[1])
    tests(out)
    for name in sys.argv[2:]:
        bench(out, name)
    counters(out)


if __name__ == "__main__":
    main()
