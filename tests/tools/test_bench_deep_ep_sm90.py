"""Host-side parts of bench/deep_ep_sm90.py: the payload bytes of the normal mode's floor, the FP8 input it passes
(DeepEP's test quantization, column-major scales), and the PNG drawn from the committed result file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import deep_ep_sm90  # noqa: E402 - bench/ is a script folder, put on the path above


def test_payload_bytes_count_scales_with_fp8_rows() -> None:
    assert deep_ep_sm90.payload_bytes(10, 256, fp8=False) == 10 * 512
    assert deep_ep_sm90.payload_bytes(10, 256, fp8=True) == 10 * (256 + 8)


def test_fp8_rows_are_deepeps_quantization_with_column_major_scales() -> None:
    x = (torch.randn(5, 256) * 4).to(torch.bfloat16)
    q, scales = deep_ep_sm90.fp8_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (5, 2) and scales.stride() == (1, 5)
    back = (q.float().view(5, 2, 128) * scales.unsqueeze(2)).view(5, 256)
    assert torch.allclose(back, x.float(), rtol=0.07, atol=1e-3)
    assert deep_ep_sm90.OPS == ("dispatch_bf16", "dispatch_fp8", "combine")


def test_the_png_answers_one_question_with_labelled_axes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """How long one low-latency dispatch / combine call takes as the batch grows: two panels, axes with units, the
    shapes named for a reader (no preset keys), a landscape aspect."""
    plt = pytest.importorskip("matplotlib.pyplot")
    figures: list[object] = []
    monkeypatch.setattr(plt, "close", figures.append)
    data = json.loads((Path(__file__).resolve().parents[2] / "bench/results/deep_ep_sm90.json").read_text())
    deep_ep_sm90.plot(data["points"], tmp_path / "deep_ep_sm90.png")
    assert (tmp_path / "deep_ep_sm90.png").read_bytes()[:4] == b"\x89PNG"
    (fig,) = figures
    axes = fig.axes
    assert [a.get_xlabel() for a in axes] == ["tokens per GPU (decode batch)"] * 2
    assert axes[0].get_ylabel() == "time per call (µs)"
    assert [a.get_title() for a in axes] == ["low_latency_dispatch: BF16 in, FP8 out", "low_latency_combine: BF16"]
    legend = [t.get_text() for t in axes[0].get_legend().get_texts()]
    assert legend == list(deep_ep_sm90.SHAPE_LABELS.values())
    assert all(len(line.get_xdata()) == 9 for a in axes for line in a.get_lines())  # T = 1..256 per shape
    width, height = fig.get_size_inches()
    assert 2 <= width / height <= 3


def test_low_latency_table_shows_the_one_kernel_graph_beside_the_ops(capsys: pytest.CaptureFixture[str]) -> None:
    """A low-latency row carries both ops in one graph and the run's one-kernel graph replay beside the ops'
    latencies, so a reader can tell the kernels' own time from what any one-kernel graph costs per replay."""
    point = {"part": "low_latency", "preset": "deepep-test", "tokens_per_rank": 128,
             "latency_us": {"dispatch": 12.6, "combine": 12.4}, "floor_us": {"dispatch": 3.1, "combine": 5.2},
             "pair_graph_us": 20.44, "graph_replay_floor_us": 2.34,
             "accuracy": {"dispatch_bit_exact_vs_reference": True}}
    deep_ep_sm90.print_tables([point])
    out = capsys.readouterr().out
    assert ("| dispatch us | combine us | both in one graph us | floor us (d / c) | one-kernel graph us | bit-exact |"
            in out)
    assert "| deepep-test | 128 | 12.6 | 12.4 | 20.4 | 3.10 / 5.20 | 2.3 | yes |" in out
