"""The deep_gemm facade's pre-dispatch runs inside ``torch.cuda.graph`` capture (SGLang captures it in decode).

Replaying the graph on new inputs gives exactly what an eager call gives: the quantization has no host sync.
"""

from __future__ import annotations

import pytest
import torch

import gc_moe_compat.deep_gemm as dg

pytestmark = pytest.mark.gpu

T, H, K = 24, 512, 4


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = (torch.randn(T, H, device="cuda") * torch.logspace(-3, 2, H, device="cuda")).bfloat16()
    idx = torch.randint(-1, 16, (T, K), device="cuda", dtype=torch.int32)
    weights = torch.rand(T, K, device="cuda")
    return x, idx, weights


def _views(sf_dtype: torch.dtype, sf_cols: int) -> list[torch.Tensor]:
    return [
        torch.empty(T, H, device="cuda", dtype=torch.float8_e4m3fn),
        torch.empty(T, sf_cols, device="cuda", dtype=sf_dtype),
        torch.empty(T, K, device="cuda", dtype=torch.int64),
        torch.empty(T, K, device="cuda", dtype=torch.float32),
    ]


@pytest.mark.parametrize(
    ("fn", "sf_dtype", "sf_cols", "kwargs"),
    [
        (dg.mega_moe_pre_dispatch_sm90, torch.float32, H // 128, {"routed_scaling_factor": 2.5}),
        (dg.mega_moe_pre_dispatch, torch.int32, H // 128, {"group_size": 32, "mma_type": "fp8xfp4"}),
    ],
)
def test_pre_dispatch_captured_replay_equals_eager(fn, sf_dtype: torch.dtype, sf_cols: int, kwargs: dict) -> None:
    torch.manual_seed(31)
    static_in, captured = _inputs(), _views(sf_dtype, sf_cols)
    fn(*static_in, *captured, num_tokens=T, **kwargs)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*static_in, *captured, num_tokens=T, **kwargs)
    for _ in range(3):
        fresh = _inputs()
        for dst, src in zip(static_in, fresh, strict=True):
            dst.copy_(src)
        for view in captured:
            view.view(torch.uint8).fill_(0xFF)  # poison: every element must be rewritten by the replay
        graph.replay()
        eager = _views(sf_dtype, sf_cols)
        fn(*fresh, *eager, num_tokens=T, **kwargs)
        torch.cuda.synchronize()
        for got, want in zip(captured, eager, strict=True):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
