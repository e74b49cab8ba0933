"""gc-moe-ab's result file on the CPU: points from rank records (slowest rank, per-op floors and efficiency,
speedups over the reference operator, accuracy targets, pairs), the mean of per-point ratios, the schema check,
the table and the PNG; and the protocol helpers the benchmarks share."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gc_moe_compat.ab import protocol, report, results

OPS = {"facade": "fp8xfp8", "facade_partition_off": "fp8xfp8", "native_fp8xfp4": "fp8xfp4",
       "original_deep_gemm": "fp8xfp8"}


def _metrics(cos: float) -> dict[str, float]:
    return {"cosine": cos, "processed_diff": 1 - cos, "max_abs_err": 0.01, "rel_l2": 0.01, "nonfinite": 0,
            "nonfinite_ref": 0}


def _record(lat: dict[str, float], floor_fp8: int, cos: float = 0.99995) -> dict[str, object]:
    refs = {"faithful": _metrics(cos), "bf16_model": _metrics(0.995)}
    return {"latency_us": lat, "accuracy": {op: refs for op in lat}, "bit_identical": dict.fromkeys(lat, True),
            "unavailable": {"original_deep_gemm": "no original deep_gemm package is installed on sys.path"},
            "pairs": {"facade|native_fp8xfp4": _metrics(0.99)},
            "floor_bytes": {"fp8xfp8": floor_fp8, "fp8xfp4": floor_fp8 // 2}}


def _point(t: int, facade: float = 50.0) -> dict[str, object]:
    records = [_record({"facade": facade, "facade_partition_off": 60.0, "native_fp8xfp4": 30.0}, 4_000_000),
               _record({"facade": facade + 5, "facade_partition_off": 58.0, "native_fp8xfp4": 31.0}, 8_000_000,
                       cos=0.9998)]
    return results.assemble_point("glm52", t, records, OPS, [4e12, 4e12], "facade")


def test_a_point_takes_the_slowest_rank_and_each_ops_own_floor() -> None:
    p = _point(8)
    assert p["latency_us"] == {"facade": 55.0, "facade_partition_off": 60.0, "native_fp8xfp4": 31.0}
    assert p["per_rank_us"]["facade"] == [50.0, 55.0]
    assert p["floor_us_by_mma"] == {"fp8xfp8": pytest.approx(2.0), "fp8xfp4": pytest.approx(1.0)}
    assert p["floor_us"] == pytest.approx(2.0)  # the reference op's (FP8) floor, largest over ranks
    assert p["efficiency"]["native_fp8xfp4"] == pytest.approx(1.0 / 31.0)
    assert p["speedup"] == {"facade_partition_off_over_facade": pytest.approx(60 / 55),
                            "native_fp8xfp4_over_facade": pytest.approx(31 / 55)}
    assert p["unavailable"] == {"original_deep_gemm": "no original deep_gemm package is installed on sys.path"}
    facade = p["accuracy"]["facade"]
    assert facade["faithful"]["cosine_min"] == 0.9998 and facade["meets_faithful_targets"] is False
    assert facade["meets_model_target"] is True and facade["graph_bit_identical_to_eager"] is True
    assert p["accuracy"]["pairs"]["facade|native_fp8xfp4"]["cosine_min"] == 0.99


def test_the_summary_is_the_mean_of_per_point_ratios_not_a_ratio_of_means() -> None:
    points = [_point(1, facade=10.0), _point(8, facade=100.0)]
    ratios = [60 / 15, 60 / 105]
    s = results.summarize(points, "facade")["facade_partition_off_over_facade"]
    assert s["mean_of_ratios"] == pytest.approx(sum(ratios) / 2) and s["points"] == 2
    assert s["mean_of_ratios"] != pytest.approx(120 / 120)
    assert protocol.mean_of_ratios([]) is None and protocol.slowest_rank([3.0, 7.0, 5.0]) == 7.0
    with pytest.raises(ValueError, match="per_rank_us"):
        protocol.slowest_rank([])


def _data(points: list[dict[str, object]]) -> dict[str, object]:
    meta = {k: "x" for k in results.META_KEYS} | {"world_size": 2, "ops": OPS,
                                                 "partition": {"dispatch_sms": 20, "compute_sms": 112,
                                                               "workqueue": "plain"}}
    return {"meta": meta, "points": points}


def test_the_schema_check_names_the_field() -> None:
    data = _data([_point(1)])
    results.validate_result(data)
    broken = json.loads(json.dumps(data))
    broken["points"][0]["per_rank_us"]["facade"] = [1.0]
    with pytest.raises(ValueError, match=r"points\[0\].per_rank_us.facade: must list 2 ranks"):
        results.validate_result(broken)
    broken = json.loads(json.dumps(data))
    del broken["points"][0]["unavailable"]
    with pytest.raises(ValueError, match=r"ops \['original_deep_gemm'\] neither measured nor marked unavailable"):
        results.validate_result(broken)
    del broken["meta"]["command"]
    with pytest.raises(ValueError, match="meta.command: missing"):
        results.validate_result(broken)


def test_table_json_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    points = [_point(t, facade=40.0 + t) for t in (1, 2, 4)]
    report.table("glm52", points, list(OPS), "facade", {"original_deep_gemm": "not installed"})
    out = capsys.readouterr().out
    assert "over facade" in out and "not run: original_deep_gemm: not installed" in out
    rows = report.table_rows(points, list(OPS), "facade")
    assert [r[:4] for r in rows[:3]] == [["1", "facade", "46.0", "1"], ["1", "facade_partition_off", "60.0", "1.30"],
                                         ["1", "native_fp8xfp4", "31.0", "0.67"]]
    assert len(rows) == 9 and all(r[1] != "original_deep_gemm" for r in rows)  # the original: not measured
    report.write_json(tmp_path / "ab.json", _data(points))
    results.validate_result(json.loads((tmp_path / "ab.json").read_text()))
    pytest.importorskip("matplotlib")
    assert report.plot(points, list(OPS), "facade", "title", tmp_path / "ab.png")
    assert (tmp_path / "ab.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_progress_without_a_terminal_bar(capsys: pytest.CaptureFixture[str]) -> None:
    with report.progress(2, enabled=False) as bar:
        bar.advance("T=1 facade")
        bar.note("done")
    assert "[1/2] T=1 facade" in capsys.readouterr().out


def test_idle_check_reports_other_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    answers = {"--query-compute-apps=pid,process_name,used_memory": "4242, python, 1000 MiB",
               "--query-gpu=utilization.gpu": "87"}

    def fake(*cmd: str) -> str:
        return next(v for k, v in answers.items() if k in cmd)

    monkeypatch.setattr(protocol, "_run", fake)
    check = protocol.idle_gpu_check(0)
    assert check["idle"] is False and "1 other compute process(es): 4242, python" in check["detail"]
    assert "utilization 87% > 5%" in check["detail"]
    answers.update({"--query-compute-apps=pid,process_name,used_memory": "", "--query-gpu=utilization.gpu": "0"})
    assert protocol.idle_gpu_check(0) == {"idle": True, "detail": "no other compute process, utilization 0%"}
    monkeypatch.setattr(protocol, "_run", lambda *cmd: None)
    assert protocol.idle_gpu_check(0)["idle"] is None


def test_result_meta_writes_a_runnable_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(protocol.torch.cuda, "get_device_name", lambda *_: "NVIDIA H200 (faked)")
    monkeypatch.setenv("GC_MOE_PARTITION", "off")
    meta = protocol.result_meta("gc-moe-ab", [], {}, env_keys=("GC_MOE_PARTITION",),
                                command=["gc-moe-ab", "--model-config", "/a b/config.json"])
    assert meta["command"] == "GC_MOE_PARTITION=off gc-moe-ab --model-config '/a b/config.json'"
    assert protocol.result_meta("bench/x.py", ["--out", "r.json"], {})["command"] == "python bench/x.py --out r.json"


@pytest.mark.parametrize("rich_installed", [True, False])
def test_the_table_of_a_real_run_fits_120_columns(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str], rich_installed: bool) -> None:
    """The committed glm52 run (5 operators x 9 T, the longest operator names): every line <= 120 characters and
    every row on one line."""
    data = json.loads((Path(__file__).resolve().parents[2] / "bench/results/ab_glm52.json").read_text())
    ops = list(data["meta"]["ops"])
    if not rich_installed:
        monkeypatch.setattr(report, "_rich", lambda: None)
    report.table("gc-moe-ab glm52", data["points"], ops, "facade", {})
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= report.TABLE_WIDTH
    rows = report.table_rows(data["points"], ops, "facade")
    assert len(rows) == len(ops) * len(data["points"]) == 45
    for row in rows:  # each row's cells on one line
        assert sum(all(cell in line for cell in row[1:4]) for line in lines) >= 1, row


def test_result_files_name_files_inside_the_checkout_by_relative_paths(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    repo = protocol.REPO
    monkeypatch.chdir(tmp_path)
    assert protocol.portable_path(repo / ".carry/sgl_deep_gemm/deep_gemm/__init__.py") == \
        ".carry/sgl_deep_gemm/deep_gemm/__init__.py"
    assert protocol.portable_path(tmp_path / "cfg" / "config.json") == "cfg/config.json"  # the working directory
    assert protocol.portable_path("/opt/elsewhere/deep_gemm/__init__.py") == \
        "<outside the checkout>/deep_gemm/__init__.py"
    assert protocol.portable_path("tests/data/x.json") == "tests/data/x.json" and protocol.portable_path(None) is None
    data = {"meta": {"deep_gemm": str(repo / ".carry/dg/__init__.py"),
                     "status": f"the original deep_gemm at {repo}/x/deep_gemm/__init__.py failed"}}
    protocol.write_result(tmp_path / "out" / "r.json", data)
    text = (tmp_path / "out" / "r.json").read_text()
    assert str(repo) not in text and str(tmp_path) not in text
    assert json.loads(text)["meta"] == {"deep_gemm": ".carry/dg/__init__.py",
                                        "status": "the original deep_gemm at x/deep_gemm/__init__.py failed"}


def test_the_committed_results_carry_no_absolute_paths() -> None:
    results_dir = Path(__file__).resolve().parents[2] / "bench" / "results"
    for f in sorted(results_dir.glob("*.json")) + sorted(results_dir.glob("*.md")):
        text = f.read_text()
        for prefix in ('"/work/', '"/tmp/', '"/home/', '"/root/', " /work/", " /tmp/"):
            assert prefix not in text, f"{f.name} holds an absolute path ({prefix.strip()}...)"


def test_dirty_is_the_trees_state_when_the_process_first_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that rewrites a tracked result file part by part does not call its own later parts dirty."""
    answers = iter(["", " M bench/results/x.json"])
    monkeypatch.delenv("GC_MOE_GIT_DIRTY", raising=False)
    monkeypatch.setattr(protocol, "_git", lambda *args: next(answers))
    protocol._tree_dirty_at_start.cache_clear()
    try:
        assert protocol._dirty() is False and protocol._dirty() is False
    finally:
        protocol._tree_dirty_at_start.cache_clear()
    monkeypatch.setenv("GC_MOE_GIT_DIRTY", "1")
    assert protocol._dirty() is True
