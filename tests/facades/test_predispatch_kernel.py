"""The fused pre-dispatch kernel (kernels/sm90/predispatch.cu) against the torch model of the originals' arithmetic.

Each case stages fresh random tokens (several magnitudes, all-zero rows that hit the amax floor, rows tiny enough for
UE8M0's 1e-4 floor, rows near the BF16 maximum) on the GPU into poisoned views and the same inputs on the host through
:func:`gc_moe_compat.quant.quantize_fp8_pre_dispatch`; every byte of every view must agree, including the padding rows
``[num_tokens, capacity)`` and the payload rows past ``num_tokens`` (left as poisoned). Shapes hit the boundaries: T =
0, 1, capacity; H = 256 (one warp) and 8192 (1024 threads); top-k 1 and 32 (more slots than a one-warp CTA's threads
would cover with one slot each); int32 ids in, int64 out (the originals' dtypes). Invalid routing (ids below -1 or
outside the buffer's experts, NaN / overflowing weights) is staged as (-1, 0.0), eagerly and in a captured graph, and
reported by the next eager call; so is a token whose activations hold a NaN or Inf (dropped whole: zero payload and
scales, every slot unused), reported naming x, its row and the column.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import gc_moe_compat.deep_gemm as dg
from gc_moe_compat.deep_gemm import _predispatch
from gc_moe_compat.runtime.dropped import dropped_record
from gc_moe_compat.runtime.status import DeviceCheckError

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
@pytest.mark.parametrize("fn", ["sm90", "ue8m0"])
def test_kernel_equals_the_torch_model(case: tuple[int, int, int, int], fn: str) -> None:
    n, capacity, hidden, topk = case
    x = _tokens(n, hidden, seed=n * 7 + hidden)
    idx, w = _routing(n, topk, torch.int32, seed=hidden)
    sf_dtype = torch.float32 if fn == "sm90" else torch.int32
    outs = {}
    for device in ("cpu", "cuda"):
        views = _views(capacity, hidden, topk, sf_dtype, torch.int64, device)
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
    assert torch.equal(cpu_idx[:n], idx[:n].long())


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


# ------------------------------------------------------------------------------------------------------------------
# Invalid routing only the device sees (issue 19, items 1-3): dropped as (-1, 0.0), reported by the next eager call

BAD = {  # case -> (topk_idx entry, weight, routed_scaling_factor, what the report names)
    "id_below_minus_one": (-5, 0.5, 1.0, "topk_idx entry .*observed -5, expected 9223372036854775807"),
    "nan_weight": (3, float("nan"), 1.0, "not finite in FP32 .*expected 6"),
    "product_overflow": (3, 3.0e38, 2.5, "not finite in FP32 .*expected 6"),
}


def _clear_dropped() -> None:
    record = dropped_record(torch.device("cuda"))
    record.mirror.zero_()
    record.record.zero_()


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("fn", ["sm90", "ue8m0"])
def test_invalid_routing_is_dropped_then_reported(case: str, fn: str) -> None:
    """One invalid entry (token 1, slot 2) among valid ones, views of no facade buffer: the kernel stages it as
    (-1, 0.0), every byte equals the torch model's drop rule, the valid entries are untouched; the next eager call
    raises DeviceCheckError naming the site and value before launching, and the one after runs again."""
    value, weight, factor, report = BAD[case]
    if fn == "ue8m0":
        factor = 1.0  # mega_moe_pre_dispatch has no factor: its overflow case is a weight of inf
        weight = float("inf") if case == "product_overflow" else weight
    _clear_dropped()
    n, capacity, hidden, topk = 4, 8, 256, 4
    x = _tokens(n, hidden, seed=5).cuda()
    idx = torch.randint(0, 64, (n, topk), generator=torch.Generator().manual_seed(6))
    w = torch.rand(n, topk, generator=torch.Generator().manual_seed(7))
    idx[1, 2], w[1, 2] = value, weight
    idx, w = idx.int().cuda(), w.cuda()
    sf_dtype, recipe = (torch.float32, "fp32x128") if fn == "sm90" else (torch.int32, "ue8m0x32")

    def call(views: list[torch.Tensor], topk_idx: torch.Tensor = idx, topk_weights: torch.Tensor = w) -> None:
        if fn == "sm90":
            dg.mega_moe_pre_dispatch_sm90(x, topk_idx, topk_weights, *views, num_tokens=n,
                                          routed_scaling_factor=factor)
        else:
            dg.mega_moe_pre_dispatch(x, topk_idx, topk_weights, *views, num_tokens=n, group_size=32,
                                     mma_type="fp8xfp4")

    got = _views(capacity, hidden, topk, sf_dtype, torch.int64, "cuda")
    want = _views(capacity, hidden, topk, sf_dtype, torch.int64, "cuda")
    call(got)
    _predispatch.stage_with_torch(recipe, x, idx, w, *want, n, factor)
    torch.cuda.synchronize()
    for name, a, b in zip(("buf_x", "buf_x_sf", "buf_topk_idx", "buf_topk_weights"), got, want, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    assert got[2][1, 2].item() == -1 and got[3][1, 2].item() == 0.0
    keep = torch.ones(n, topk, dtype=torch.bool, device="cuda")
    keep[1, 2] = False
    assert torch.equal(got[2][:n][keep], idx[keep].long())
    assert torch.equal(got[3][:n][keep], w[keep] * factor)
    name = "mega_moe_pre_dispatch_sm90" if fn == "sm90" else "mega_moe_pre_dispatch"
    valid_idx, valid_w = torch.zeros_like(idx), torch.full_like(w, 0.25)
    with pytest.raises(DeviceCheckError, match=f"{name}: a launch on cuda:0 before this check dropped an invalid "
                                               f"input .*pre-dispatch: .*{report}"):
        call(got, valid_idx, valid_w)
    call(got, valid_idx, valid_w)  # the record was cleared: the next call runs
    torch.cuda.synchronize()
    assert (got[2][:n] == 0).all()
    dropped_record(torch.device("cuda")).raise_if_dropped("a valid call")


def test_captured_call_drops_ids_outside_the_buffers_experts(group: dist.ProcessGroup) -> None:
    """Views of a facade buffer (E = 16): an id 16 fits the int32 input but is no expert. Captured with valid ids,
    replayed after the input changed: the replay stages (-1, 0.0) for it; the next eager call raises naming E - 1."""
    _clear_dropped()
    n = 6
    buf = dg.get_symm_buffer_for_mega_moe(group, 16, 40, 4, 512, 256)
    x = _tokens(n, 512, seed=9).cuda()
    idx = torch.randint(0, 16, (n, 4), generator=torch.Generator().manual_seed(9), dtype=torch.int32).cuda()
    w = torch.rand(n, 4, generator=torch.Generator().manual_seed(10)).cuda()

    def call() -> None:
        dg.mega_moe_pre_dispatch_sm90(x, idx, w, buf.x, buf.x_sf, buf.topk_idx, buf.topk_weights, n,
                                      routed_scaling_factor=2.5)

    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    idx[2, 3] = 16
    graph.replay()
    torch.cuda.synchronize()
    assert buf.topk_idx[2, 3].item() == -1 and buf.topk_weights[2, 3].item() == 0.0
    assert buf.topk_idx[2, 0].item() == idx[2, 0].item()
    with pytest.raises(DeviceCheckError, match="mega_moe_pre_dispatch_sm90: .*topk_idx entry .*observed 16, "
                                               "expected 15"):
        call()
    idx[2, 3] = 15
    call()
    torch.cuda.synchronize()
    assert buf.topk_idx[2, 3].item() == 15
    buf.destroy()


# ------------------------------------------------------------------------------------------------------------------
# Non-finite activations (issue 32 item 1): the token is dropped whole, reported by the next eager call


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("fn", ["sm90", "ue8m0"])
def test_non_finite_activations_drop_the_token_then_report(value: float, graph: bool, fn: str) -> None:
    """One non-finite value (token 2, column 300) among finite rows, staged eagerly or by a graph replay (captured
    on finite rows): token 2's payload and scales are zero and all its slots (-1, 0.0), every byte the torch model's,
    the other tokens staged as usual; the next eager call raises DeviceCheckError naming x, the row and the column
    before launching, and the one after runs again."""
    _clear_dropped()
    n, capacity, hidden, topk = 5, 8, 512, 4
    x = _tokens(n, hidden, seed=11).cuda()
    idx = torch.randint(0, 64, (n, topk), generator=torch.Generator().manual_seed(12), dtype=torch.int32).cuda()
    w = torch.rand(n, topk, generator=torch.Generator().manual_seed(13)).cuda()
    sf_dtype, recipe, factor = (torch.float32, "fp32x128", 2.5) if fn == "sm90" else (torch.int32, "ue8m0x32", 1.0)
    got = _views(capacity, hidden, topk, sf_dtype, torch.int64, "cuda")

    def call(views: list[torch.Tensor]) -> None:
        if fn == "sm90":
            dg.mega_moe_pre_dispatch_sm90(x, idx, w, *views, num_tokens=n, routed_scaling_factor=factor)
        else:
            dg.mega_moe_pre_dispatch(x, idx, w, *views, num_tokens=n, group_size=32, mma_type="fp8xfp4")

    if graph:
        call(got)
        torch.cuda.synchronize()
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            call(got)
        x[2, 300] = value
        for v in got:
            v.view(torch.uint8).fill_(POISON)
        captured.replay()
    else:
        x[2, 300] = value
        call(got)
    want = _views(capacity, hidden, topk, sf_dtype, torch.int64, "cuda")
    _predispatch.stage_with_torch(recipe, x, idx, w, *want, n, factor)
    torch.cuda.synchronize()
    for name, a, b in zip(("buf_x", "buf_x_sf", "buf_topk_idx", "buf_topk_weights"), got, want, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    assert (got[0][2].view(torch.uint8) == 0).all() and (got[1][2].view(torch.uint8) == 0).all()
    assert (got[2][2] == -1).all() and (got[3][2] == 0).all()
    assert torch.equal(got[2][:2], idx[:2].long()) and torch.equal(got[2][3:n], idx[3:].long())
    name = "mega_moe_pre_dispatch_sm90" if fn == "sm90" else "mega_moe_pre_dispatch"
    x[2, 300] = 1.0
    with pytest.raises(DeviceCheckError, match=f"{name}: a launch on cuda:0 before this check dropped an invalid "
                                               "input .*pre-dispatch: a row of x .*NaN or Inf.*observed 2, "
                                               "expected 300"):
        call(got)
    call(got)  # the record was cleared: the next call runs, and stages token 2 again
    torch.cuda.synchronize()
    assert torch.equal(got[2][2], idx[2].long())
    dropped_record(torch.device("cuda")).raise_if_dropped("a valid call")
