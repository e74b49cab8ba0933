"""scripts/ncu_sass_stalls.py, the per-SASS-line summary of an Nsight Compute source page exported as CSV: kernels
split at their name rows, samples and reasons summed, lines ranked, the issued-only twins of the reasons left out."""

from __future__ import annotations

import csv
import io
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import ncu_sass_stalls as stalls  # noqa: E402 - scripts/ is a script folder, put on the path above

HEADER = ["Address", "Source", stalls.SAMPLES, "Warp Stall Sampling (Not-issued Samples)", "stall_long_sb",
          "stall_barrier", "stall_long_sb (Not Issued)"]


def _csv(*kernels: tuple[str, list[list[str]]]) -> list[list[str]]:
    text = io.StringIO()
    writer = csv.writer(text, quoting=csv.QUOTE_ALL)
    for name, lines in kernels:
        writer.writerow(["Kernel Name", name, ""])
        writer.writerow(HEADER)
        writer.writerows(lines)
    return list(csv.reader(io.StringIO(text.getvalue())))


def test_each_kernel_is_summed_by_line_and_reason() -> None:
    rows = _csv(("a", [["0x10", "LDG.E.128 R4, [R2]", "1,200", "1100", "1,000", "200", "900"],
                       ["0x20", "IMAD R5, R4, 0x10000, RZ", "300", "250", "0", "300", "0"],
                       ["0x30", "EXIT", "", "", "", "", ""]]),
                ("b", [["0x10", "NOP", "0", "0", "0", "0", "0"]]))
    a, b = stalls.read_kernels(rows)
    assert (a.name, a.samples, b.samples) == ("a", 1500, 0)
    assert a.reasons() == {"long_sb": 1000, "barrier": 500}  # the "(Not Issued)" column is not a reason of its own
    text = stalls.report(a, top=1)
    assert text.splitlines()[0] == "a: 1500 samples; by reason: long_sb 66.7 %, barrier 33.3 %"
    assert len(text.splitlines()) == 2 and "80.0 %" in text and "LDG.E.128" in text and "long_sb 1000" in text
    assert stalls.report(b, top=5) == "b: no stall samples"
    page = ("a", [["0x10", "NOP", "5", "5", "5", "0", "0"]])
    repeated = _csv(page, page,
                    ("a", [["0x10", "NOP", "6", "6", "6", "0", "0"]]))
    assert [k.samples for k in stalls.distinct(stalls.read_kernels(repeated))] == [5, 6]  # a repeated page once


def test_an_export_without_samples_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="Warp Stall Sampling"):
        list(stalls.read_kernels([["Kernel Name", "k"], ["Address", "Source"], ["0x10", "NOP"]]))
    empty = tmp_path / "empty.csv"
    empty.write_text("==PROF== nothing\n")
    with pytest.raises(SystemExit, match="no 'Kernel Name' section"):
        stalls.main([str(empty)])
