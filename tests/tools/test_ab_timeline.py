"""gc-moe-ab's graph timeline on the CPU: the summary of kernel records (replays split by start time, concurrent
kernels keyed by name and occurrence, medians of offsets and durations, the refusals), the replays a failing
profiler still runs, the point's ``timeline`` field and the CLI option."""

from __future__ import annotations

import pytest

from gc_moe_compat.ab import cli, results, timeline

ROLE1, ROLE2, ROLE3 = "gc_moe::role1_dispatch", "gc_moe::role2_gemm<8>", "gc_moe::role3_finalize"


def _replay(at: float, role1_first: bool, role2_us: float) -> list[timeline.KernelRecord]:
    """One operator replay starting at ``at``: role1 and role2 as concurrent roots (either may start first), then
    role3, then a second role3 (two launches of one name)."""
    first, second = ((at, 4.0, ROLE1), (at + 0.5, role2_us, ROLE2))
    if not role1_first:
        first, second = (at + 0.5, 4.0, ROLE1), (at, role2_us, ROLE2)
    end = at + role2_us + 1.0
    return [first, second, (end, 2.0, ROLE3), (end + 3.0, 1.0, ROLE3)]


def test_concurrent_kernels_are_keyed_by_name_and_occurrence() -> None:
    kernels = sorted(_replay(0.0, True, 60.0) + _replay(100.0, False, 62.0) + _replay(200.0, True, 61.0))
    got = timeline.summarize(kernels, 3)
    assert (got["replays"], got["kernels_per_replay"]) == (3, 4)
    assert got["span_us"] == pytest.approx(66.0)  # the median of the replays' 65, 67 and 66
    rows = {(row["name"], i): row for i, row in enumerate(got["kernels"])}
    assert [row["name"] for row in got["kernels"]] == [ROLE1, ROLE2, ROLE3, ROLE3]
    role1, role2 = rows[(ROLE1, 0)], rows[(ROLE2, 1)]
    assert (role1["start_us"], role1["duration_us"]) == (0.0, 4.0)  # offsets 0, 0.5, 0 -> median 0
    assert (role2["start_us"], role2["duration_us"], role2["end_us"]) == (0.5, 61.0, 61.5)
    assert got["kernels"][3]["start_us"] - got["kernels"][2]["start_us"] == pytest.approx(3.0)


def test_records_that_do_not_split_into_equal_replays_are_refused() -> None:
    kernels = sorted(_replay(0.0, True, 60.0) + _replay(100.0, True, 60.0))
    assert "do not split" in timeline.summarize(kernels[:-1], 2)["unavailable"]
    assert "do not split" in timeline.summarize([], 1)["unavailable"]
    other = [(k[0], k[1], "other" if k[2] == ROLE3 and k[0] > 100 else k[2]) for k in kernels]
    assert "different kernels" in timeline.summarize(other, 2)["unavailable"]
    with pytest.raises(ValueError, match="replays: must be >= 1"):
        timeline.summarize(kernels, 0)


def test_names_are_cut_to_their_first_characters() -> None:
    long = "void gc_moe::role2<" + "x" * 300 + ">()"
    got = timeline.summarize([(0.0, 1.0, long)], 1)
    assert got["kernels"][0]["name"] == long[:timeline.NAME_CHARS]


class _Graph:
    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


class _FailingProfiler:
    def __init__(self, **kwargs: object) -> None:
        pass

    def start(self) -> None:
        raise RuntimeError("CUPTI is busy")


def test_a_failing_profiler_still_replays_each_replay_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A multi-rank graph's peers replay theirs as many times: the replays run whatever the profiler does."""
    import torch.profiler

    monkeypatch.setattr(torch.profiler, "profile", _FailingProfiler)
    monkeypatch.setattr(timeline.torch.cuda, "synchronize", lambda: None)
    graph = _Graph()
    got = timeline.graph_timeline(graph, 5)  # type: ignore[arg-type]
    assert graph.replays == 5
    assert got == {"unavailable": "the profiler failed: RuntimeError: CUPTI is busy"}


def _rank_record(timelines: dict[str, object]) -> dict[str, object]:
    metrics = {"cosine": 1.0, "processed_diff": 0.0, "max_abs_err": 0.0, "rel_l2": 0.0, "nonfinite": 0,
               "nonfinite_ref": 0}
    timing = results.rank_timing([[10.0, 11.0]])
    return {"latency_us": {"facade": timing["latency_us"]}, "repeat_us": {"facade": timing["repeat_us"]},
            "repeat_window_us": {"facade": timing["repeat_window_us"]}, "repeat_conditions": {"facade": []},
            "accuracy": {"facade": {"faithful": metrics}}, "bit_identical": {"facade": True}, "unavailable": {},
            "pairs": {}, "floor_bytes": {"fp8xfp8": 1000}, "timeline": timelines}


def test_the_point_keeps_each_ranks_timeline() -> None:
    one = timeline.summarize(sorted(_replay(0.0, True, 60.0)), 1)
    point = results.assemble_point("glm52", 1, [_rank_record({"facade": one}), _rank_record({"facade": one})],
                                   {"facade": "fp8xfp8"}, [4e12, 4e12], "facade")
    assert point["timeline"] == {"facade": [one, one]}
    without = results.assemble_point("glm52", 1, [_rank_record({}), _rank_record({})], {"facade": "fp8xfp8"},
                                     [4e12, 4e12], "facade")
    assert "timeline" not in without


def test_the_cli_option() -> None:
    parser = cli.build_parser()
    assert parser.parse_args(["--preset", "glm52", "--timeline", "20"]).timeline == 20
    assert parser.parse_args(["--preset", "glm52"]).timeline == 0
