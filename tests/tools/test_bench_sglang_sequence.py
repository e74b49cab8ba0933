"""Host-side parts of bench/sglang_sequence_sm90.py: the result file is rewritten after each preset, so a run cut by
its limit keeps the presets it finished and its meta says the run is incomplete."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import sglang_sequence_sm90 as seq  # noqa: E402 - bench/ is a script folder, put on the path above


class _CutShortError(Exception):
    """The stand-in for a device run killed by its limit."""


class _FakeRun:
    """A preset's run without a GPU: one point per T with the fields the script prints; ``cut`` names the preset
    whose first point stops the run."""

    cut: str | None = None

    def __init__(self, group: object, preset: str) -> None:
        self.preset = preset
        self.native = SimpleNamespace(dispatch_sms=4, compute_sms=128, partition="on")

    def point(self, tokens: int, bandwidth: float, warmup: int, windows: int,
              timed: tuple[str, ...]) -> dict[str, object]:
        if self.preset == self.cut:
            raise _CutShortError(self.preset)
        return {"preset": self.preset, "tokens_per_rank": tokens, "role4_block_m": 8, "floor_us": 1.0,
                "latency_us": dict.fromkeys(timed, 2.0), "accuracy": {}}


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> SimpleNamespace:
    """The script's ``_run`` with the GPU parts replaced, writing to ``tmp_path``."""
    monkeypatch.setattr(seq, "PresetRun", _FakeRun)
    monkeypatch.setattr(seq, "_jobs", lambda preset, tokens: [])
    monkeypatch.setattr(seq, "prebuild", lambda jobs, workers: [])
    monkeypatch.setattr(seq, "copy_bandwidth", lambda: 1e12)
    monkeypatch.setattr(seq, "pyplot", lambda: None)
    monkeypatch.setattr(_FakeRun, "cut", None)
    args = SimpleNamespace(out=tmp_path / "seq.json", presets=["dsv41-flash", "glm52", "dsv3"], tokens=[1, 2],
                           warmup=0, windows=1, ops=["layer", "role4"])
    return SimpleNamespace(args=args, run=lambda: seq._run(args, group=None))


def test_a_run_cut_in_a_later_preset_keeps_the_finished_presets(bench: SimpleNamespace) -> None:
    _FakeRun.cut = "glm52"
    with pytest.raises(_CutShortError):
        bench.run()
    data = json.loads(bench.args.out.read_text())
    assert [(p["preset"], p["tokens_per_rank"]) for p in data["points"]] == [("dsv41-flash", 1), ("dsv41-flash", 2)]
    assert data["meta"]["presets_requested"] == ["dsv41-flash", "glm52", "dsv3"]
    assert data["meta"]["presets_measured"] == ["dsv41-flash"]
    assert data["meta"]["complete"] is False


def test_a_full_run_is_marked_complete(bench: SimpleNamespace) -> None:
    bench.run()
    data = json.loads(bench.args.out.read_text())
    assert len(data["points"]) == 6
    assert data["meta"]["presets_measured"] == ["dsv41-flash", "glm52", "dsv3"]
    assert data["meta"]["complete"] is True
    assert data["meta"]["command"].startswith("python bench/sglang_sequence_sm90.py")

