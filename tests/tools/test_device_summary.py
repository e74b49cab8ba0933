"""The summary table that ends scripts/device_check.sh: benchmark points of every shape and the --counters CSVs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "device_summary.py"
_spec = importlib.util.spec_from_file_location("device_summary", SCRIPT)
summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(summary)

NCU_HEADER = ('"ID","Kernel Name","dram__bytes_read.sum","dram__bytes_write.sum","gpu__time_duration.sum",'
              '"lts__t_sectors_op_read.sum","lts__t_sectors_op_read_lookup_miss.sum"')
NCU_UNITS = '"","","byte","byte","ns","sector","sector"'


def test_latencies_of_a_plain_point_a_sweep_and_traced_sequences() -> None:
    plain = {"latency_us": {"gc_fp8": 61.604, "deepgemm": 73}}
    assert summary.latencies(plain) == "gc_fp8 61.60 us, deepgemm 73.00 us"
    sweep = {"latency_us": {"w1": {"50": 209.8, "400": 215.4}, "w1+w2": {"50": 330.0, "400": 331.5}}}
    assert summary.latencies(sweep) == "w1 215.40 us, w1+w2 331.50 us"
    traced = {"trace": {"w1+w2": {"positions": [{"dur_us": 227.55}, {"dur_us": 105.04}]}},
              "probes": {"spin+w1": {"positions": [{"dur_us": 10.7}, {"dur_us": 207.5}]}}}
    assert summary.latencies(traced) == "w1+w2 227.6/105.0 us, spin+w1 10.7/207.5 us"


def test_counters_print_each_replay_in_mb(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = ['"1","graph","1,287,681,536","33,098,496","608,768","2,495,000","1,561,000"',
            '"2","graph","1,287,320,832","32,804,096","592,128","2,494,000","1,560,000"']
    (tmp_path / "counters_glm52_128_w2+w1.csv").write_text("==PROF== noise\n" + "\n".join([NCU_HEADER, NCU_UNITS,
                                                                                           *rows]))
    (tmp_path / "counters_glm52_128_w1.csv").write_text("==ERROR== ncu failed\n")
    summary.counters(tmp_path)
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "counters counters_glm52_128_w1: no profile (see the file)",
        "counters counters_glm52_128_w2+w1",
        "  replay 1: DRAM read 1287.7 MB, DRAM write 33.1 MB, L2 reads 79.8 MB, L2 read misses 50.0 MB",
        "  replay 2: DRAM read 1287.3 MB, DRAM write 32.8 MB, L2 reads 79.8 MB, L2 read misses 49.9 MB",
    ]


def test_main_prints_tests_benchmarks_then_counters(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    point = {"preset": "glm52", "tokens_per_rank": 128, "latency_us": {"gc_fp8": 335.3}}
    (tmp_path / "gemm_sm90.json").write_text(json.dumps({"meta": {"partition": "whole"}, "points": [point]}))
    monkeypatch.setattr("sys.argv", ["device_summary.py", str(tmp_path), "gemm_sm90", "missing"])
    summary.main()
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "tests: not run"
    assert out[1] == "bench gemm_sm90: partition whole"
    assert out[2].split() == ["glm52", "128", "gc_fp8", "335.30", "us"]
    assert out[3] == "bench missing: no result file (see bench.log)"
    assert len(out) == 4  # no counters files
