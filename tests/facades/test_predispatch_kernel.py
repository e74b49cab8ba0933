"""The fused pre-dispatch kernel (kernels/sm90/predispatch.cu) against the torch model of the originals' arithmetic.

Each case stages fresh random tokens (several magnitudes, all-zero rows that hit the amax floor, rows tiny enough for
UE8M0's 1e-4 floor, rows near the BF16 maximum) on the GPU into poisoned views and the same inputs on the host through
:func:`gc_moe_compat.quant.quantize_fp8_pre_dispatch`; every byte of every view must agree, including the padding
rows ``[num_tokens, capacity)`` and the payload rows past ``num_tokens`` (left as poisoned). Shapes hit the
boundaries: T = 0, 1, capacity; H = 256 (one warp) and 8192 (1024 threads); top-k 1 and 32 (more slots than a
one-warp CTA's threads would cover with one slot each); int32 and int64 ids in and out.
"""

from __future__ import annotations

import pytest
import torch

import gc_moe_compat.deep_gemm as dg

pytestmark = pytest.mark.gpu

POISON = 0xA5

CASES = [  # (num_tokens, capacity, hidden, topk)
    (0, 16, 256, 8), (1, 16, 256, 1), (16, 16, 256, 32), (5, 40, 7168, 8), (37, 64, 8192, 6), (128, 256, 5120, 6),
]


def _tokens(n: int, hidden: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=g) * torch.logspace(-3, 3, hidden)
    if n >= 4:
        x[1] = 0.0  # amax floor of both recipes
        x[2] *= 1e-9  # below UE8M0's 1e-4 floor
        x[3] = x[3].sign() * 3.0e38  # near the BF16 maximum
    return x.bfloat16()


def _routing(n: int, topk: int, in_dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(-1, 64, (n, topk), generator=g, dtype=in_dtype), torch.rand(n, topk, generator=g)


def _views(capacity: int, hidden: int, topk: int, sf_dtype: torch.dtype, out_dtype: torch.dtype,
           device: str) -> list[torch.Tensor]:
    views = [torch.empty(capacity, hidden, dtype=torch.float8_e4m3fn, device=device),
             torch.empty(capacity, hidden // 128, dtype=sf_dtype, device=device),
             torch.empty(capacity, topk, dtype=out_dtype, device=device),
             torch.empty(capacity, topk, dtype=torch.float32, device=device)]
    for v in views:
        v.view(torch.uint8).fill_(POISON)
    return views


@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}-cap{}-H{}-k{}".format(*c))
@pytest.mark.parametrize(("in_dtype", "out_dtype"), [(torch.int32, torch.int64), (torch.int64, torch.int32)])
@pytest.mark.parametrize("fn", ["sm90", "ue8m0"])
def test_kernel_equals_the_torch_model(case: tuple[int, int, int, int], in_dtype: torch.dtype,
                                       out_dtype: torch.dtype, fn: str) -> None:
    n, capacity, hidden, topk = case
    x = _tokens(max(n, 1), hidden, seed=n * 7 + hidden)
    idx, w = _routing(max(n, 1), topk, in_dtype, seed=hidden)
    sf_dtype = torch.float32 if fn == "sm90" else torch.int32
    outs = {}
    for device in ("cpu", "cuda"):
        views = _views(capacity, hidden, topk, sf_dtype, out_dtype, device)
        args = (x.to(device), idx.to(device), w.to(device), *views)
        if fn == "sm90":
            dg.mega_moe_pre_dispatch_sm90(*args, num_tokens=n, routed_scaling_factor=2.5)
        else:
            dg.mega_moe_pre_dispatch(*args, num_tokens=n, group_size=32, mma_type="fp8xfp4")
        outs[device] = [v.cpu() for v in views]
    torch.cuda.synchronize()
    names = ("buf_x", "buf_x_sf", "buf_topk_idx", "buf_topk_weights")
    for name, host, dev in zip(names, outs["cpu"], outs["cuda"], strict=True):
        differ = (host.view(torch.uint8) != dev.view(torch.uint8)).nonzero()
        assert differ.numel() == 0, f"{name}: {differ.shape[0]} bytes differ, first at {differ[0].tolist()}"
    cpu_x, _, cpu_idx, cpu_w = outs["cpu"]
    assert (cpu_idx[n:] == -1).all() and (cpu_w[n:] == 0).all()  # the originals' padding
    assert (cpu_x[n:].view(torch.uint8) == POISON).all()  # payload rows past num_tokens are not written
    assert torch.equal(cpu_idx[:n], idx[:n].to(out_dtype))


def test_kernel_launch_is_one_kernel_and_capturable() -> None:
    """One launch per call (the kernel trace of one eager call), and a graph replay on new inputs equals an eager
    call on them."""
    n, capacity, hidden, topk = 24, 32, 512, 4
    x, (idx, w) = _tokens(n, hidden, 3).cuda(), (t.cuda() for t in _routing(n, topk, torch.int32, 3))
    views = _views(capacity, hidden, topk, torch.float32, torch.int64, "cuda")
    dg.mega_moe_pre_dispatch_sm90(x, idx, w, *views, num_tokens=n, routed_scaling_factor=2.5)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        dg.mega_moe_pre_dispatch_sm90(x, idx, w, *views, num_tokens=n, routed_scaling_factor=2.5)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert kernels == ["gc_pre_dispatch_fp32x128"], kernels
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dg.mega_moe_pre_dispatch_sm90(x, idx, w, *views, num_tokens=n, routed_scaling_factor=2.5)
    x.copy_(_tokens(n, hidden, 4))
    for v in views:
        v.view(torch.uint8).fill_(POISON)
    graph.replay()
    eager = _views(capacity, hidden, topk, torch.float32, torch.int64, "cuda")
    dg.mega_moe_pre_dispatch_sm90(x, idx, w, *eager, num_tokens=n, routed_scaling_factor=2.5)
    torch.cuda.synchronize()
    for got, want in zip(views, eager, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
