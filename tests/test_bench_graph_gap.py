"""Host side of bench/graph_gap_sm90.py (where a graph of the standalone GEMMs loses time against its kernels alone)
and of the config helper it shares with bench/gemm_sm90.py."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import gemm_sm90  # noqa: E402 - bench/ is a script folder, put on the path above
import graph_gap_sm90 as gap  # noqa: E402

from gc_moe_compat.sm90 import select_config  # noqa: E402


def test_excess_is_each_pair_minus_its_kernels_alone() -> None:
    latency = {"w1": 200.0, "w2": 100.0, "w1+w2": 314.0, "w1+w1": 401.0, "w2+w2": 199.5, "w2+w1": 300.0}
    assert gap.excess(latency) == {"w1+w2": 14.0, "w1+w1": 1.0, "w2+w2": -0.5, "w2+w1": 0.0}
    assert set(gap.excess(latency)) == {s for s in gap.SEQUENCES if "+" in s}
    assert gap.excess({"dg_w1": 150.0, "dg_w2": 80.0, "dg_w1+dg_w2": 236.5}) == {"dg_w1+dg_w2": 6.5}


def test_parse_samples_medians_and_skips_unreadable_lines() -> None:
    text = "1980, 650.5\n1755, 700.5\n[N/A], [N/A]\nFailed to query\n1830, 680.0\n"
    assert gap.parse_samples(text) == {"samples": 3, "sm_clock_mhz_median": 1830.0, "sm_clock_mhz_min": 1755.0,
                                       "power_w_median": 680.0}
    assert gap.parse_samples("") == {"unavailable": "no samples"}


def test_sampler_without_nvidia_smi_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with gap.GpuSampler("0") as sampler:
        pass
    assert "nvidia-smi" in sampler.summary()["unavailable"]


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
