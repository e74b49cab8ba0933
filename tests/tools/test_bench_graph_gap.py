"""Host side of bench/graph_gap_sm90.py (where a graph of the standalone GEMMs loses time against its kernels alone)
and of the config helper it shares with bench/gemm_sm90.py."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import gemm_sm90  # noqa: E402 - bench/ is a script folder, put on the path above
import graph_gap_sm90 as gap  # noqa: E402
from _standalone_heuristics import select_config  # noqa: E402


def test_excess_is_each_pair_minus_its_kernels_alone() -> None:
    latency = {"w1": 200.0, "w2": 100.0, "w1+w2": 314.0, "w1+w1": 401.0, "w2+w2": 199.5, "w2+w1": 300.0}
    assert gap.excess(latency) == {"w1+w2": 14.0, "w1+w1": 1.0, "w2+w2": -0.5, "w2+w1": 0.0}
    assert set(gap.excess(latency)) == {s for s in gap.SEQUENCES if "+" in s}
    assert gap.excess({"dg_w1": 150.0, "dg_w2": 80.0, "dg_w1+dg_w2": 236.5}) == {"dg_w1+dg_w2": 6.5}
    assert gap.excess({"w1+w2": 314.0}, alone={"w1": 210.0, "w2": 100.0}) == {"w1+w2": 4.0}


def test_window_excess_compares_at_the_same_and_at_twice_the_replays() -> None:
    latency = {"w1": {50: 200.0, 100: 204.0, 200: 210.0}, "w2": {50: 100.0, 100: 102.0, 200: 104.0},
               "w1+w2": {50: 310.0, 100: 314.0, 200: 316.0}}
    same, matched = gap.window_excess(latency)
    assert same == {50: {"w1+w2": 10.0}, 100: {"w1+w2": 8.0}, 200: {"w1+w2": 2.0}}
    assert matched == {50: {"w1+w2": 4.0}, 100: {"w1+w2": 0.0}}  # 400 was not measured: no matched row for 200


def test_parse_samples_reads_time_clock_power_and_the_power_cap_bit() -> None:
    text = ("2026/11/30 14:40:01.120, 1980, 650.5, 0x0000000000000000\n"
            "2026/11/30 14:40:01.130, 1755, 700.5, 0x0000000000000004\n"
            "2026/11/30 14:40:01.140, [N/A], [N/A], [N/A]\nFailed to query\n"
            "2026/11/30 14:40:01.150, 1830, 680.0\n")
    samples = gap.parse_samples(text)
    assert [(s.clock_mhz, s.power_w, s.power_capped) for s in samples] == [
        (1980.0, 650.5, False), (1755.0, 700.5, True), (1830.0, 680.0, None)]
    assert samples[1].t - samples[0].t == pytest.approx(0.010, abs=1e-4)
    assert gap.summarize(samples) == {"samples": 3, "sm_clock_mhz_median": 1830.0, "sm_clock_mhz_min": 1755.0,
                                      "power_w_median": 680.0, "power_capped_share": 0.5}
    assert gap.summarize([]) == {"unavailable": "no samples"}


def test_series_summary_compares_the_first_chunk_with_the_last_quarter() -> None:
    chunks = [(10.0 * i, 200.0 + i) for i in range(1, 41)]  # 400 ms, slowing down
    samples = [(-100.0, 345.0, 90.0, False)] + [(float(t), 1980.0 - t, 690.0, t >= 200) for t in range(0, 401, 10)]
    summary = gap.series_summary(chunks, samples)
    assert summary["first_chunk_us"] == 201.0
    assert summary["last_quarter_us"] == pytest.approx(statistics.mean(200.0 + i for i in range(30, 41)))
    assert summary["sm_clock_mhz_first_50ms"] == 1955.0  # the idle sample before the start is left out
    assert summary["sm_clock_mhz_last_quarter"] == 1980.0 - 350.0
    assert summary["power_capped_share_last_quarter"] == 1.0


def test_sampler_without_nvidia_smi_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with gap.GpuSampler("0") as sampler:
        pass
    assert "nvidia-smi" in sampler.error
    assert sampler.samples() == []


def test_visible_gpu_follows_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert gap.visible_gpu() == "3"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert gap.visible_gpu() == "0"


@pytest.mark.parametrize(("tokens", "mma_type"), [(1, "fp8xfp8"), (128, "fp8xfp8"), (256, "fp8xfp8"), (256, "fp8xfp4")])
def test_point_config_is_the_heuristics_choice(tokens: int, mma_type: str) -> None:
    layer = SimpleNamespace(prepared=SimpleNamespace(inter=2048, hidden=6144), topk=8,
                            l1=SimpleNamespace(num_experts=32))
    counts = torch.zeros(32, dtype=torch.int64)
    counts[: min(32, tokens * 8)] = max(1, tokens * 8 // 32)
    cfg = gemm_sm90.point_config(layer, tokens, counts, 132, mma_type)
    active = int((counts > 0).sum())
    assert cfg == select_config(tokens * 8 / 32, active, 2 * 2048 // 256, 132, mma_type, hidden=6144)
    assert cfg.cluster == (tokens == 256)  # past 64 expected rows per expert, both formats


def test_trace_summary_gives_each_kernel_of_a_replay_its_duration_and_gap() -> None:
    kernels = []
    for r in range(4):  # replays of [W1 (200 µs), W2 (100 µs)], 3 µs between them, 5 µs between replays
        start = 308.0 * r
        kernels += [(start, 200.0, "w1_kernel"), (start + 203.0, 100.0, "w2_kernel")]
    summary = gap.trace_summary(kernels, 4)
    assert summary["kernels_per_replay"] == 2
    assert summary["positions"] == [{"name": "w1_kernel", "dur_us": 200.0, "gap_before_us": 5.0},
                                    {"name": "w2_kernel", "dur_us": 100.0, "gap_before_us": 3.0}]
    assert summary["replay_us"] == 308.0
    assert "7 kernel records" in gap.trace_summary(kernels[:7], 4)["unavailable"]
