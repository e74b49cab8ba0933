"""gc-moe-ab's result file on the CPU: points from rank records (slowest rank, per-op floors and efficiency,
speedups over the reference operator, accuracy targets, pairs, timing rounds and their spread), the mean of
per-point ratios, the schema check, the table and the PNG; and the protocol helpers the benchmarks share."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gc_moe_compat.ab import protocol, report, results

OPS = {"facade": "fp8xfp8", "facade_partition_off": "fp8xfp8", "native_fp8xfp4": "fp8xfp4",
       "original_deep_gemm": "fp8xfp8"}


def _metrics(cos: float) -> dict[str, float]:
    return {"cosine": cos, "processed_diff": 1 - cos, "max_abs_err": 0.01, "rel_l2": 0.01, "nonfinite": 0,
            "nonfinite_ref": 0}


COOL = {"sm_mhz": 1980.0, "mem_mhz": 3201.0, "temp_c": 38.0, "power_w": 120.5}
WARM = {"sm_mhz": 1755.0, "mem_mhz": 3201.0, "temp_c": 61.0, "power_w": None}


def _record(lat: dict[str, float | list[list[float]]], floor_fp8: int, cos: float = 0.99995,
            rank: int = 0) -> dict[str, object]:
    """A rank record as run.py gathers it; an op's latency is either its timing rounds' windows or one figure (one
    round of one window). Rank 0's record carries the GPU conditions after each round (warmer each round)."""
    refs = {"faithful": _metrics(cos), "bf16_model": _metrics(0.995)}
    timing = {op: results.rank_timing(us if isinstance(us, list) else [[us]]) for op, us in lat.items()}
    fields = {key: {op: t[key] for op, t in timing.items()} for key in ("latency_us", "repeat_us", "repeat_window_us")}
    conditions = {op: [COOL, WARM][: len(t["repeat_us"])] for op, t in timing.items()} if rank == 0 else {}
    return {**fields, "repeat_conditions": conditions, "accuracy": {op: refs for op in lat},
            "bit_identical": dict.fromkeys(lat, True),
            "unavailable": {"original_deep_gemm": "no original deep_gemm package is installed on sys.path"},
            "pairs": {"facade|native_fp8xfp4": _metrics(0.99)},
            "floor_bytes": {"fp8xfp8": floor_fp8, "fp8xfp4": floor_fp8 // 2}}


def _point(t: int, facade: float = 50.0) -> dict[str, object]:
    records = [_record({"facade": facade, "facade_partition_off": 60.0, "native_fp8xfp4": 30.0}, 4_000_000),
               _record({"facade": facade + 5, "facade_partition_off": 58.0, "native_fp8xfp4": 31.0}, 8_000_000,
                       cos=0.9998, rank=1)]
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
    assert p["repeat_us"]["facade"] == [55.0] and p["repeat_window_us"]["facade"] == [[55.0, 55.0, 55.0]]
    assert p["repeat_conditions"]["facade"] == [COOL]  # rank 0's
    assert "spread_pct" not in p  # one round: nothing to compare


FACADE_ROUNDS = ([[50.0, 52.0, 51.0], [53.0, 54.0, 60.0]],  # rank 0: round medians 51, 54; pooled median 52.5
                 [[55.0, 56.0, 54.0], [52.0, 53.0, 51.0]])  # rank 1: round medians 55, 52; pooled median 53.5
ORIGINAL_ROUNDS = ([[40.0, 40.0, 40.0], [40.0, 40.0, 40.0]], [[41.0, 42.0, 40.0], [40.0, 40.0, 40.0]])


def _two_round_point(t: int = 8) -> dict[str, object]:
    records = [_record({"facade": FACADE_ROUNDS[r], "original_deep_gemm": ORIGINAL_ROUNDS[r]}, 4_000_000, rank=r)
               for r in (0, 1)]
    for r in records:
        r["unavailable"] = {"facade_partition_off": "not run", "native_fp8xfp4": "not run"}
    return results.assemble_point("glm52", t, records, OPS, [4e12, 4e12], "facade")


def test_two_rounds_on_two_ranks_give_the_pooled_median_each_rounds_slowest_rank_and_the_spread() -> None:
    timing = results.rank_timing(FACADE_ROUNDS[0])
    assert timing == {"latency_us": 52.5, "repeat_us": [51.0, 54.0],
                      "repeat_window_us": [[50.0, 51.0, 52.0], [53.0, 54.0, 60.0]]}
    p = _two_round_point()
    assert p["per_rank_us"]["facade"] == [52.5, 53.5] and p["latency_us"]["facade"] == 53.5
    assert p["repeat_us"]["facade"] == [55.0, 54.0]  # round 1: rank 1's median, round 2: rank 0's
    assert p["repeat_window_us"]["facade"] == [[54.0, 55.0, 56.0], [53.0, 54.0, 60.0]]
    assert p["spread_pct"]["facade"] == pytest.approx(100 * (55 - 54) / 54) == pytest.approx(1.851852)
    assert p["repeat_us"]["original_deep_gemm"] == [41.0, 40.0]
    assert p["spread_pct"]["original_deep_gemm"] == pytest.approx(2.5)
    assert p["repeat_conditions"]["facade"] == [COOL, WARM]
    assert protocol.spread_pct([54.0]) is None and protocol.spread_pct([54.0, 54.0]) == 0.0
    records = [_record({"facade": FACADE_ROUNDS[0]}, 1), _record({"facade": FACADE_ROUNDS[1][:1]}, 1, rank=1)]
    with pytest.raises(ValueError, match=r"repeat_us.facade: every rank must time the same rounds, got \[2, 1\]"):
        results.assemble_point("glm52", 8, records, {"facade": "fp8xfp8"}, [4e12, 4e12], "facade")
    with pytest.raises(ValueError, match="rounds: need at least one round"):
        results.rank_timing([[50.0], []])


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


def test_the_schema_check_takes_the_rounds_and_rejects_a_malformed_spread() -> None:
    data = _data([_two_round_point(1), _two_round_point(8)])
    results.validate_result(data)
    for field, value, message in [
        ("spread_pct", {"facade": -0.5, "original_deep_gemm": 2.5}, r"spread_pct.facade: must be a finite percentage"),
        ("spread_pct", {"facade": float("nan"), "original_deep_gemm": 2.5}, r"spread_pct.facade: must be a finite"),
        ("spread_pct", {"facade": "1.8", "original_deep_gemm": 2.5}, r"spread_pct.facade: must be a finite"),
        ("spread_pct", {"facade": 1.85}, r"spread_pct: must give every measured op \['facade', 'original_deep_gemm'\]"),
        ("repeat_us", {"facade": [55.0, 54.0], "original_deep_gemm": [41.0, 40.0, 40.0]},
         r"points\[1\].repeat_us: every op with a spread needs the same number \(>= 2\) of rounds"),
        ("repeat_us", {"facade": [55.0], "original_deep_gemm": [41.0]}, r"same number \(>= 2\) of rounds"),
    ]:
        broken = json.loads(json.dumps(data))
        broken["points"][1][field] = value
        with pytest.raises(ValueError, match=message):
            results.validate_result(broken)


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


def test_the_table_shows_each_ops_spread_where_the_points_have_rounds(capsys: pytest.CaptureFixture[str]) -> None:
    points = [_two_round_point(1), _two_round_point(8)]
    rows = report.table_rows(points, list(OPS), "facade")
    assert rows[:2] == [["1", "facade", "53.5", "1", "0.02", "0.999950", "1.85"],
                        ["1", "original_deep_gemm", "40.0", "0.75", "0.03", "0.999950", "2.50"]]
    report.table("glm52", points, list(OPS), "facade", {})
    out = capsys.readouterr().out
    assert "spread %" in out and "spread %: 100 (max - min) / min of the timing rounds' latencies" in out
    assert all(len(row) == 6 for row in report.table_rows([_point(1)], list(OPS), "facade"))  # one round: no column


def test_progress_without_a_terminal_bar(capsys: pytest.CaptureFixture[str]) -> None:
    with report.progress(2, enabled=False) as bar:
        bar.advance("T=1 facade")
        bar.note("done")
        bar.advance("T=1 original_deep_gemm: failed", steps=3)
    out = capsys.readouterr().out
    assert "[1/2] T=1 facade" in out and "[4/2] T=1 original_deep_gemm: failed" in out and bar.done == 4


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


def test_gpu_conditions_take_one_nvidia_smi_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, ...]] = []
    answer: list[str | None] = ["1980, 3201, 45, 312.75"]

    def fake(*cmd: str) -> str | None:
        calls.append(cmd)
        return answer[0]

    monkeypatch.setattr(protocol, "_run", fake)
    assert protocol.gpu_conditions(3) == {"sm_mhz": 1980.0, "mem_mhz": 3201.0, "temp_c": 45.0, "power_w": 312.75}
    assert calls == [("nvidia-smi", "--id=3", "--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw",
                      "--format=csv,noheader,nounits")]
    answer[0] = "1755, 3201, 61, [N/A]"
    assert protocol.gpu_conditions(0) == {"sm_mhz": 1755.0, "mem_mhz": 3201.0, "temp_c": 61.0, "power_w": None}
    answer[0] = None  # no nvidia-smi
    assert protocol.gpu_conditions(0) == dict.fromkeys(("sm_mhz", "mem_mhz", "temp_c", "power_w"))


def test_nvidia_smi_is_asked_by_uuid_where_torch_knows_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """nvidia-smi numbers GPUs without CUDA_VISIBLE_DEVICES: torch's device 0 may be its GPU 3, so the UUID names it."""
    calls: list[tuple[str, ...]] = []
    monkeypatch.setattr(protocol, "_run", lambda *cmd: calls.append(cmd) or "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: SimpleNamespace(uuid=f"6c1a2b3c-0000-0000-0000-00000000000{d}"))
    assert protocol.smi_device(1) == "GPU-6c1a2b3c-0000-0000-0000-000000000001"
    protocol.gpu_conditions(0)
    protocol.idle_gpu_check(2)
    assert calls[0][1] == "--id=GPU-6c1a2b3c-0000-0000-0000-000000000000"
    assert all(c[1] == "--id=GPU-6c1a2b3c-0000-0000-0000-000000000002" for c in calls[1:]) and len(calls) == 3
    calls.clear()  # a driver that does not take the UUID form: asked again by the index
    monkeypatch.setattr(protocol, "_run", lambda *cmd: calls.append(cmd) or (None if "GPU-" in cmd[1] else "1, 2"))
    assert protocol.gpu_conditions(1)["sm_mhz"] == 1.0
    assert [c[1] for c in calls] == ["--id=GPU-6c1a2b3c-0000-0000-0000-000000000001", "--id=1"]
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(uuid="GPU-1234"))
    assert protocol.smi_device(0) == "GPU-1234"  # already in nvidia-smi's form: not prefixed twice
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace())  # an older torch
    assert protocol.smi_device(1) == "1"


def test_result_meta_writes_a_runnable_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(protocol.torch.cuda, "get_device_name", lambda *_: "NVIDIA H200 (faked)")
    monkeypatch.setenv("GC_MOE_PARTITION", "off")
    meta = protocol.result_meta("gc-moe-ab", [], {}, env_keys=("GC_MOE_PARTITION",),
                                command=["gc-moe-ab", "--model-config", "/a b/config.json"])
    assert meta["command"] == "GC_MOE_PARTITION=off gc-moe-ab --model-config '/a b/config.json'"
    assert protocol.result_meta("bench/x.py", ["--out", "r.json"], {})["command"] == "python bench/x.py --out r.json"


@pytest.mark.parametrize(("run", "num_ops"), [("ab_glm52.json", 3), ("archive/ab5/ab_glm52.json", 5)])
@pytest.mark.parametrize("with_spread", [False, True])
@pytest.mark.parametrize("rich_installed", [True, False])
def test_the_table_of_a_real_run_fits_120_columns(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str], rich_installed: bool,
                                                  with_spread: bool, run: str, num_ops: int) -> None:
    """The committed glm52 runs (the headline one, and the archived five-operator one with the longest operator
    names; 9 T each), also with a spread per op (a run of several timing rounds): every line <= 120 characters and
    every row on one line."""
    data = json.loads((Path(__file__).resolve().parents[2] / "bench/results" / run).read_text())
    ops = list(data["meta"]["ops"])
    assert len(ops) == num_ops
    if with_spread:
        for p in data["points"]:
            p["spread_pct"] = dict.fromkeys(p["latency_us"], 12.345)
    if not rich_installed:
        monkeypatch.setattr(report, "_rich", lambda: None)
    report.table("gc-moe-ab glm52", data["points"], ops, "facade", {})
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= report.TABLE_WIDTH
    rows = report.table_rows(data["points"], ops, "facade")
    assert len(rows) == num_ops * len(data["points"]) == num_ops * 9
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
