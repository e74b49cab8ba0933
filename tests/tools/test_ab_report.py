"""The README rows generated from gc-moe-ab result files (gc_moe_compat.ab.report): what a row says, the inline
markers, and that only the rows between them are replaced."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gc_moe_compat.ab import report


def _result(complete: bool = True) -> dict[str, object]:
    """The fields of a result file a row reads (the shape run.py writes; values made up for the test)."""
    def point(t: int, ours: float, orig: float) -> dict[str, object]:
        return {"tokens_per_rank": t, "latency_us": {"facade": ours, "original_deep_gemm": orig},
                "speedup": {"original_deep_gemm_over_facade": orig / ours}, "efficiency": {"facade": 0.1 * t},
                "accuracy": {"facade": {"faithful": {"cosine_min": 0.99995 - 0.00001 * t}}}}

    return {"meta": {"reference_op": "facade", "world_size": 1, "gpu": "NVIDIA H200", "complete": complete,
                     "command": "gc-moe-ab --preset glm52",
                     "workload": {"name": "glm52", "hidden": 6144, "intermediate": 2048, "local_experts": 32,
                                  "topk": 8},
                     "ops": {"facade": {"status": "measured"}, "original_deep_gemm": {"status": "measured"},
                             "composed_deepep_deepgemm": {"status": "not run: needs the original DeepGEMM"}},
                     "summary": {"original_deep_gemm_over_facade": {"mean_of_ratios": 1.15, "min": 1.1, "max": 1.2,
                                                                    "points": 2}}},
            "points": [point(1, 50.0, 55.0), point(2, 50.0, 60.0)]}


def test_a_row_names_the_workload_the_command_the_ratios_and_what_did_not_run() -> None:
    row = report.readme_row(_result(), "ab_glm52.json")
    assert row.startswith("| gc-moe-ab glm52 (H 6144, I 2048, 32 experts per rank, top-8), 1× NVIDIA H200, T = 1…2 ")
    assert "(`ab_glm52.json`; `gc-moe-ab --preset glm52`)" in row
    assert "latency over `facade` (mean of the per-point ratios, range, points): `original_deep_gemm` 1.15 " \
           "(1.10–1.20, 2)" in row
    assert "`composed_deepep_deepgemm` not run" in row
    assert "`facade` efficiency 0.10–0.20" in row and "cosine ≥ 0.99993 vs the faithful reference" in row
    assert "incomplete" in report.readme_row(_result(complete=False), "ab_glm52.json")
    assert "spread" not in row  # no timing rounds in the file


def test_a_row_of_a_run_in_rounds_gives_the_largest_spread() -> None:
    data = _result()
    data["meta"]["timing"] = {"repeats": 3}
    data["points"][0]["spread_pct"] = {"facade": 0.4, "original_deep_gemm": 1.234}
    data["points"][1]["spread_pct"] = {"facade": 0.9, "original_deep_gemm": 0.2}
    assert report.readme_row(data, "ab_glm52.json").endswith(
        "cosine ≥ 0.99993 vs the faithful reference; spread between 3 timing rounds ≤ 1.23 % |")


def test_rows_replace_only_what_lies_between_the_markers(tmp_path: Path) -> None:
    files = []
    for name in ("ab_b.json", "ab_a.json"):
        files.append(tmp_path / name)
        files[-1].write_text(json.dumps(_result()))
    rows = report.readme_rows(sorted(files))
    assert report.README_BEGIN in rows[0] and report.README_END in rows[-1] and rows[0].startswith("| ")
    readme = tmp_path / "README.md"
    readme.write_text("# t\n\n| what | headline |\n|---|---|\n| kept | row |\n"
                      f"| {report.README_BEGIN}old | row |\n| old | row {report.README_END} |\n| kept too | row |\n")
    assert report.main(["--readme-table", *map(str, files), "--write", str(readme)]) == 0
    lines = readme.read_text().splitlines()
    assert lines[:5] == ["# t", "", "| what | headline |", "|---|---|", "| kept | row |"]
    assert lines[5:7] == rows and lines[7:] == ["| kept too | row |"] and "ab_a.json" in lines[5]
    with pytest.raises(ValueError, match="needs one <!-- ab-table:begin --> line"):
        report.replace_readme_rows("no markers", rows)
