"""gc-moe-ab's timing rounds on the CPU (graphs, timing and nvidia-smi faked): every operator is prepared once, then
timed in interleaved rounds (A, B, C, A, B, C, ...) on its one captured graph; an operator failing in a round
leaves the later rounds and is marked unavailable, one failing its status check after the last round too; the
others' record fields hold the pooled median and each round's figures."""

from __future__ import annotations

import types

import pytest
import torch

from gc_moe_compat.ab import protocol, report, run
from gc_moe_compat.ab.operators import OperatorSpec

CONDITIONS = {"sm_mhz": 1980.0, "mem_mhz": 3201.0, "temp_c": 40.0, "power_w": 300.0}


class _Runner:
    """An operator whose output is fixed; ``check`` raises for the one named ``bad_check``."""

    def __init__(self, name: str) -> None:
        self.name, self.staged = name, False
        self.y = torch.full((2, 4), float(len(name)), dtype=torch.bfloat16)

    def stage(self, tokens: object) -> None:
        self.staged = True

    def run(self) -> torch.Tensor:
        return self.y

    def check(self, what: str) -> None:
        if self.name == "bad_check":
            raise RuntimeError(f"status word set after {what}")


class _Ranks:
    """One rank: every error is the first one."""

    rank, device = 0, torch.device("cpu")

    def first_error(self, error: str | None) -> str | None:
        return error

    def align(self) -> None:
        """The device barrier the real windows start with (not reached: the windows are faked)."""


@pytest.mark.parametrize("timeline_replays", [0, 4])
def test_operators_are_timed_in_interleaved_rounds_on_their_one_graph(monkeypatch: pytest.MonkeyPatch,
                                                                      timeline_replays: int) -> None:
    """Each operator's graph is captured once and timed in interleaved rounds (a failing one leaves the later
    rounds); with --timeline N each operator that ran every round is traced on its own graph, N replays, before the
    graph is released."""
    names = ["a", "fails_in_round_2", "bad_check"]
    runners = {n: _Runner(n) for n in names}
    specs = [OperatorSpec(n, n, "fp8_block128", lambda ctx: None, lambda: None) for n in names]
    graphs: dict[str, object] = {}
    order: list[str] = []
    windows = {"a": iter([[10.0, 30.0, 11.0], [13.0, 12.0, 30.0], [30.0, 15.0, 14.0]])}

    def capture(fn: object) -> types.SimpleNamespace:
        name = next(n for n, r in runners.items() if fn == r.run)
        graphs[name] = types.SimpleNamespace(name=name)
        return graphs[name]

    def timed(graph: types.SimpleNamespace, warmup: int, count: int, before_window: object) -> list[float]:
        assert (warmup, count, before_window) == (1, 3, ranks.align) and graph is graphs[graph.name]
        order.append(graph.name)
        if graph.name == "fails_in_round_2" and order.count(graph.name) == 2:
            raise RuntimeError("replay failed")
        return next(windows["a"]) if graph.name == "a" else [5.0, 5.0, 5.0]

    monkeypatch.setattr(protocol, "capture_graph", capture)
    monkeypatch.setattr(protocol, "graph_windows", timed)
    monkeypatch.setattr(protocol, "gpu_conditions", lambda device: dict(CONDITIONS))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    traced: list[tuple[str, int]] = []

    def graph_timeline(graph: types.SimpleNamespace, replays: int) -> dict[str, object]:
        assert graph is graphs[graph.name]  # before the graph is released
        traced.append((graph.name, replays))
        return {"span_us": 1.0}

    monkeypatch.setattr(run.timeline, "graph_timeline", graph_timeline)
    ranks = _Ranks()
    refs = {"fp8_block128": {"faithful": torch.ones(2, 4)}}
    record: dict[str, dict] = {k: {} for k in ("latency_us", "repeat_us", "repeat_window_us", "repeat_conditions",
                                               "accuracy", "bit_identical", "unavailable", "timeline")}
    bar = report.Progress(None, None, 9)
    cfg = types.SimpleNamespace(warmup=1, windows=3, repeats=3, timeline=timeline_replays)
    ys = run._measure_point(specs, runners, object(), refs, ranks, cfg, record, bar, "T=8")
    assert all(r.staged for r in runners.values()) and sorted(graphs) == sorted(names)  # each captured once
    assert order == ["a", "fails_in_round_2", "bad_check", "a", "fails_in_round_2", "bad_check", "a", "bad_check"]
    assert record["unavailable"] == {
        "fails_in_round_2": "failed in timing round 2: RuntimeError: replay failed",
        "bad_check": "device error after the timed replays: RuntimeError: status word set after bad_check replays"}
    assert list(ys) == ["a"] and torch.equal(ys["a"], runners["a"].y) and record["bit_identical"] == {"a": True}
    assert record["latency_us"] == {"a": 14.0}  # the median of all nine windows; of the round medians: 13
    assert record["repeat_us"] == {"a": [11.0, 13.0, 15.0]}
    assert record["repeat_window_us"] == {"a": [[10.0, 11.0, 30.0], [12.0, 13.0, 30.0], [14.0, 15.0, 30.0]]}
    assert record["repeat_conditions"] == {"a": [CONDITIONS] * 3}
    assert bar.done == bar.total == 9  # the failed operators' remaining rounds are counted as done
    finished = ["a", "bad_check"] if timeline_replays else []  # the operators that ran every round
    assert traced == [(name, timeline_replays) for name in finished]
    assert record["timeline"] == dict.fromkeys(finished, {"span_us": 1.0})
