"""Where a kernel's warps wait, per SASS line: the summary of an Nsight Compute source page exported as CSV (``ncu
--import R.ncu-rep --page source --csv --print-source sass``, what ``scripts/device_check.sh``'s ``--ncu-ll``,
``--ncu-normal`` and ``--ncu-layer`` write as ``*_sass.csv``).

Per kernel in the file (one section per ``"Kernel Name"`` line, in profile order): its stall samples in all, the
share of each stall reason over the whole kernel, and the ``--top`` SASS lines by samples with their share, the
instruction and their two largest reasons. A reading aid for the profiles the benchmarks' analysis cites; it measures
nothing itself.

``python scripts/ncu_sass_stalls.py FILE.csv [--top 12]``
"""

from __future__ import annotations

import argparse
import csv
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
"""The column of each line's stall samples (issued and not issued)."""
REASON_PREFIX = "stall_"
"""The per-reason sample columns (``stall_long_sb``, ...); their ``(Not Issued)`` twins are left out."""


@dataclass
class Line:
    """One SASS line of a kernel's page: its address, instruction, stall samples and their split by reason."""

    address: str
    source: str
    samples: int
    reasons: dict[str, int]


@dataclass
class Kernel:
    """One profiled launch's page: the kernel's name and its SASS lines in address order."""

    name: str
    lines: list[Line] = field(default_factory=list)

    @property
    def samples(self) -> int:
        """The kernel's stall samples in all."""
        return sum(line.samples for line in self.lines)

    def reasons(self) -> dict[str, int]:
        """The kernel's stall samples per reason, summed over its lines."""
        total: dict[str, int] = {}
        for line in self.lines:
            for reason, count in line.reasons.items():
                total[reason] = total.get(reason, 0) + count
        return total


def _count(text: str) -> int:
    """A count as the export writes it ("1,234", or empty for none)."""
    text = text.replace(",", "").strip()
    return int(float(text)) if text else 0


def read_kernels(rows: Sequence[Sequence[str]]) -> Iterator[Kernel]:
    """The kernels of an exported source page: each ``"Kernel Name", NAME`` row starts one, its next row is the
    header, the rows after it its SASS lines."""
    kernel: Kernel | None = None
    header: list[str] | None = None
    for row in rows:
        if not row:
            continue
        if row[0] == "Kernel Name":
            if kernel is not None:
                yield kernel
            kernel, header = Kernel(row[1] if len(row) > 1 else "?"), None
        elif kernel is not None and header is None:
            if SAMPLES not in row:
                raise ValueError(f"kernel {kernel.name}: its header has no {SAMPLES!r} column (ncu --page source "
                                 "--csv --print-source sass with the WarpStateStats / SourceCounters sections)")
            header = list(row)
        elif kernel is not None and header is not None:
            values = dict(zip(header, row, strict=False))
            reasons = {name[len(REASON_PREFIX):]: _count(value) for name, value in values.items()
                       if name.startswith(REASON_PREFIX) and "(Not Issued)" not in name}
            kernel.lines.append(Line(values.get("Address", ""), values.get("Source", "").strip(),
                                     _count(values.get(SAMPLES, "")), reasons))
    if kernel is not None:
        yield kernel


def distinct(kernels: Iterator[Kernel]) -> list[Kernel]:
    """``kernels`` without a section that repeats the one before it line for line (the export prints each profiled
    launch's page twice)."""
    out: list[Kernel] = []
    for kernel in kernels:
        if not out or out[-1] != kernel:
            out.append(kernel)
    return out


def report(kernel: Kernel, top: int) -> str:
    """The kernel's summary: its samples and leading reasons, then its ``top`` lines by samples."""
    total = kernel.samples
    if not total:
        return f"{kernel.name}: no stall samples"
    reasons = sorted(kernel.reasons().items(), key=lambda item: -item[1])
    out = [f"{kernel.name}: {total} samples; by reason: "
           + ", ".join(f"{name} {100 * count / total:.1f} %" for name, count in reasons[:6] if count)]
    for line in sorted(kernel.lines, key=lambda line: -line.samples)[:top]:
        if not line.samples:
            break
        first = sorted(line.reasons.items(), key=lambda item: -item[1])[:2]
        why = ", ".join(f"{name} {count}" for name, count in first if count)
        out.append(f"  {100 * line.samples / total:5.1f} %  {line.address:>6}  {line.source[:60]:60}  {why}")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", type=Path)
    parser.add_argument("--top", type=int, default=12, help="SASS lines per kernel (default 12)")
    args = parser.parse_args(argv)
    with args.csv.open(newline="") as handle:
        kernels = distinct(read_kernels(list(csv.reader(handle))))
    if not kernels:
        raise SystemExit(f"{args.csv}: no 'Kernel Name' section (not an ncu --page source --csv export?)")
    print("\n\n".join(report(kernel, args.top) for kernel in kernels))


if __name__ == "__main__":
    main()
