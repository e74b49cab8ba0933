"""bench/_call_trace.py: the per-call summary of a Kineto trace (launches matched to their kernels by correlation id,
host gaps, allocation time), on a hand-made trace with known times; the CLI on a saved file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import _call_trace as call_trace  # noqa: E402 - bench/ is a script folder, put on the path above


def _x(cat: str, name: str, ts: float, dur: float, **args: object) -> dict[str, object]:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


def _call(t0: float, corr: int, wait: float) -> list[dict[str, object]]:
    """A dispatch-like call at ``t0``: an allocation, a notify launch, a CPU wait of ``wait`` µs, an allocation, two
    launches; kernels on the GPU after each launch."""
    end = t0 + 30 + wait
    return [
        _x("user_annotation", "dispatch_bf16", t0, end - t0),
        _x("cpu_op", "aten::empty", t0 + 1, 4),
        _x("cuda_driver", "cuLaunchKernel", t0 + 6, 3, correlation=corr),
        _x("kernel", "notify(int)", t0 + 10, 8, correlation=corr),
        _x("cpu_op", "aten::empty_strided", t0 + 10 + wait, 5),
        _x("cuda_driver", "cuLaunchKernel", t0 + 16 + wait, 3, correlation=corr + 1),
        _x("cuda_runtime", "cudaLaunchKernel", t0 + 20 + wait, 4, correlation=corr + 2),
        _x("kernel", "send", t0 + 20 + wait, 10, correlation=corr + 1),
        _x("kernel", "recv", t0 + 30 + wait, 10, correlation=corr + 2),
        _x("cpu_op", "aten::empty", end + 50, 4),  # outside every call: not counted
    ]


def _trace(waits: list[float]) -> dict[str, object]:
    events = [{"ph": "M", "name": "process_name", "args": {"name": "x"}}]
    for i, wait in enumerate(waits):
        events += _call(3000.0 * (i + 1), 10 * (i + 1), wait)
    return {"traceEvents": events}


def test_summary_matches_launches_to_kernels_and_splits_the_host_span() -> None:
    calls = call_trace.summarize(_trace([40.0, 60.0]))
    assert [c["op"] for c in calls] == ["dispatch_bf16", "dispatch_bf16"]
    first = calls[0]
    assert first["host_us"] == 70.0 and first["alloc_us"] == 9.0
    assert [launch["kernel"] for launch in first["launches"]] == ["notify(int)", "send", "recv"]
    assert [launch["launch_at"] for launch in first["launches"]] == [6.0, 56.0, 60.0]
    assert [(launch["gpu_start"], launch["gpu_end"]) for launch in first["launches"]] == [(10, 18), (60, 70), (70, 80)]
    # the gap before each launch, then the last launch's end to the return: the CPU wait shows in the second
    assert first["gaps_us"] == [6.0, 47.0, 1.0, 6.0]
    assert calls[1]["gaps_us"][1] == 67.0


def test_summary_lines_skip_the_first_call_and_take_medians() -> None:
    lines = call_trace.summary_lines(call_trace.summarize(_trace([999.0, 40.0, 60.0, 80.0])))
    assert lines[0] == "dispatch_bf16: 3 calls, host 90.0 us, allocations 9.0 us (medians)"
    assert "gap    67.0" in lines[2] and lines[2].endswith("send")
    assert lines[1].endswith("notify") and lines[-1].endswith("return")


def test_cli_summarizes_a_folder(tmp_path: Path, capsys) -> None:
    (tmp_path / "a.json").write_text(json.dumps(_trace([10.0, 20.0])))
    assert call_trace.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("== a.json\ndispatch_bf16: 1 calls")


def test_digest_takes_each_ops_medians_after_the_first_call() -> None:
    digest = call_trace.call_digest(call_trace.summarize(_trace([999.0, 40.0, 60.0, 80.0])))
    assert list(digest) == ["dispatch_bf16"]
    assert digest["dispatch_bf16"] == {"host_us": 90.0, "first_launch_us": 6.0, "launch_calls_us": 10.0,
                                       "between_us": 68.0, "after_last_us": 6.0, "alloc_us": 9.0}


def test_across_ranks_groups_a_points_rank_files(tmp_path: Path, capsys) -> None:
    """The files of one point (``_rank<R>``) make one line per op, each field the median over the ranks."""
    for rank, waits in enumerate(([999.0, 40.0], [999.0, 60.0], [999.0, 100.0])):
        (tmp_path / f"normal_P3_glm_T512_facade_rank{rank}.json").write_text(json.dumps(_trace(waits)))
    (tmp_path / "normal_P3_glm_T512_original_rank0.json").write_text(json.dumps(_trace([999.0, 20.0])))
    assert call_trace.main(["--across-ranks", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "normal_P3_glm_T512_facade dispatch_bf16: host 90.0, first launch 6.0, launch calls 10.0, between 68.0, "
        "after last 6.0, alloc 9.0 us (3 ranks)",
        "normal_P3_glm_T512_original dispatch_bf16: host 50.0, first launch 6.0, launch calls 10.0, between 28.0, "
        "after last 6.0, alloc 9.0 us (1 ranks)"]


def test_timeline_puts_a_points_ranks_on_one_clock(tmp_path: Path, capsys) -> None:
    """The k-th steady calls of the ranks are one collective call: times from the earliest rank's entry into it."""
    for rank, shift in enumerate((0.0, 5.0)):
        trace = _trace([999.0, 40.0, 60.0])
        for event in trace["traceEvents"]:
            if "ts" in event:
                event["ts"] += shift
        (tmp_path / f"normal_P2_glm_T512_facade_rank{rank}.json").write_text(json.dumps(trace))
    (tmp_path / "other.json").write_text(json.dumps(_trace([999.0, 40.0])))  # no rank in its name: its own point
    assert call_trace.main(["--timeline", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[3].startswith("other dispatch_bf16: 1 calls") and lines[4].startswith("  rank other: entry 0.0 |")
    # calls 2 and 3 (waits 40, 60): rank 1 five us later; the last kernel (recv) ends 5 + 30 + wait + 10 after
    assert lines[0].startswith("normal_P2_glm_T512_facade dispatch_bf16: 2 calls, last kernel end 95.0 us after")
    assert lines[1] == ("  rank 0: entry 0.0 | notify 6.0 gpu 10.0..18.0 | send 66.0 gpu 70.0..80.0 | "
                        "recv 70.0 gpu 80.0..90.0")
    assert lines[2].startswith("  rank 1: entry 5.0 | notify 11.0 gpu 15.0..23.0 |")
