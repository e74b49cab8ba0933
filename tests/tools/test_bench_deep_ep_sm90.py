"""Host-side parts of bench/deep_ep_sm90.py (the normal mode's benchmark): the payload bytes of its floor and the FP8
input it passes (DeepEP's test quantization, column-major scales)."""

from __future__ import annotations

import sys
from pathlib import Path

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
