"""Issue 19, items 8-12 and the wrong kinds of error: bad flags, sizes, SM counts and views at the facades' entry
points raise ``TypeError`` / ``ValueError`` / ``NotImplementedError`` naming the function, the argument and the value,
before any allocation or launch; the originals' defaults keep working. CPU only (the deep_ep low-latency Buffer runs
on a fake workspace and records its launches instead of running them)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from ll_launches import COMBINE, DISPATCH, record_ll_launches

import gc_moe_compat.deep_gemm as dg
from gc_moe_compat import quant
from gc_moe_compat.comm.ep_ll import HINT_TOPK, MAX_SMS, LlShape, required_bytes
from gc_moe_compat.deep_ep import Buffer, _buffer
from gc_moe_compat.deep_gemm import _runtime
from gc_moe_compat.operator import api
from gc_moe_compat.runtime.workspace import PeerTable

T_MAX, HIDDEN, EXPERTS, TOPK, TOKENS = 8, 256, 8, 4, 5
H, N_I, E, K = 512, 256, 16, 4


class FakeWorkspace:
    """CPU stand-in for ``SymmetricWorkspace`` (what the facade reads); counts its allocations."""

    created = 0

    def __init__(self, layout: object, group: dist.ProcessGroup | None = None) -> None:
        FakeWorkspace.created += 1
        self.device = torch.device("cpu")
        self.world_size = dist.get_world_size(group) if group is not None else 1
        self.buffer = torch.zeros(layout.size, dtype=torch.uint8)
        self.peer_table, self.sm_share = PeerTable(), MAX_SMS


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list:
    monkeypatch.setattr(_buffer, "SymmetricWorkspace", FakeWorkspace)
    return record_ll_launches(monkeypatch)


@pytest.fixture
def ll(group: dist.ProcessGroup, launches: list) -> Buffer:
    return Buffer(group, 0, Buffer.get_low_latency_rdma_size_hint(T_MAX, HIDDEN, 1, EXPERTS), low_latency_mode=True)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(TOKENS, HIDDEN).to(torch.bfloat16)
    return x, torch.randint(-1, EXPERTS, (TOKENS, TOPK))


# ------------------------------------------------------------------------------------------------------------------
# Item 9: non-bools where bools are meant


@pytest.mark.parametrize(("flag", "value"), [
    ("use_fp8", "no"), ("use_fp8", None), ("round_scale", 2), ("use_ue8m0", 1), ("use_nvfp4", "False"),
    ("async_finish", "x"), ("return_recv_hook", 0),
])
def test_dispatch_flags_must_be_bools(ll: Buffer, launches: list, flag: str, value: object) -> None:
    x, topk_idx = _inputs()
    before = (x.clone(), topk_idx.clone())
    with pytest.raises(TypeError, match=f"low_latency_dispatch: {flag} must be a bool, got {type(value).__name__} "
                                        f"\\({value!r}\\)"):
        ll.low_latency_dispatch(x, topk_idx, T_MAX, EXPERTS, **{flag: value})
    assert launches == []
    assert torch.equal(x, before[0]) and torch.equal(topk_idx, before[1])


@pytest.mark.parametrize(("flag", "value"), [
    ("use_logfmt", "no"), ("zero_copy", 1), ("async_finish", "x"), ("return_recv_hook", None), ("overlap", 0),
])
def test_combine_flags_must_be_bools(ll: Buffer, launches: list, flag: str, value: object) -> None:
    x, topk_idx = _inputs()
    recv, _, handle, _, hook = ll.low_latency_dispatch(x, topk_idx, T_MAX, EXPERTS, use_fp8=False,
                                                       return_recv_hook=True)
    hook()
    launches.clear()
    with pytest.raises(TypeError, match=f"low_latency_combine: {flag} must be a bool, got {type(value).__name__}"):
        ll.low_latency_combine(recv, topk_idx, torch.ones(TOKENS, TOPK), handle, **{flag: value})
    assert launches == []


def test_dispatch_and_combine_defaults_still_run(ll: Buffer, launches: list) -> None:
    """DeepEP's defaults (use_fp8=True, round_scale/use_ue8m0/async_finish/return_recv_hook False) pass the checks."""
    x, topk_idx = _inputs()
    (recv, _), _, handle, _, hook = ll.low_latency_dispatch(x, topk_idx, T_MAX, EXPERTS)
    assert hook is None and [what for what, _ in launches] == [DISPATCH]
    out, _, hook = ll.low_latency_combine(torch.zeros(recv.shape, dtype=torch.bfloat16), topk_idx,
                                          torch.ones(TOKENS, TOPK), handle)
    assert hook is None and [what for what, _ in launches] == [DISPATCH, COMBINE] and out.shape == (TOKENS, HIDDEN)


@pytest.mark.parametrize(("flag", "value"), [
    ("low_latency_mode", "yes"), ("low_latency_mode", None), ("allow_nvlink_for_low_latency_mode", 1),
    ("allow_mnnvl", "no"), ("allow_mnnvl", None), ("use_fabric", "no"), ("explicitly_destroy", 1),
    ("enable_shrink", "False"),
])
def test_buffer_flags_must_be_bools(group: dist.ProcessGroup, launches: list, flag: str, value: object) -> None:
    created = FakeWorkspace.created
    allowed = "a bool or None" if flag == "use_fabric" else "a bool"
    with pytest.raises(TypeError, match=f"Buffer: {flag} must be {allowed}, got {type(value).__name__} "
                                        f"\\({value!r}\\)"):
        Buffer(group, 0, 1 << 20, **{flag: value})
    assert FakeWorkspace.created == created  # nothing allocated


def test_buffer_defaults_still_construct(group: dist.ProcessGroup, launches: list) -> None:
    """DeepEP's defaults (use_fabric=None is "auto"; allow_mnnvl=False) and explicit False stay accepted."""
    Buffer(group)
    Buffer(group, 0, 0, low_latency_mode=False, num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True,
           allow_mnnvl=False, use_fabric=None, explicitly_destroy=False, enable_shrink=False)
    Buffer(group, 0, 1 << 20, low_latency_mode=True, use_fabric=False, explicitly_destroy=True)


def test_deep_gemm_flags_must_be_bools(group: dist.ProcessGroup) -> None:
    args = dict(num_experts=E, num_max_tokens_per_rank=40, num_topk=K, hidden=H, intermediate_hidden=N_I)
    for value in (1, "yes", 0.0):
        with pytest.raises(TypeError, match=f"get_symm_buffer_for_mega_moe: use_fp8_dispatch must be a bool or "
                                            f"None, got {type(value).__name__}"):
            dg.get_symm_buffer_for_mega_moe(group, **args, use_fp8_dispatch=value)
        with pytest.raises(TypeError, match="get_symm_buffer_for_sm90_mega_moe: use_fp8_dispatch must be a bool"):
            dg.get_symm_buffer_for_sm90_mega_moe(group, **args, use_fp8_dispatch=value)
    with pytest.raises(TypeError, match="get_symm_buffer_for_mega_moe: mma_type must be one of .* \\(a str\\), got "
                                        "NoneType"):
        dg.get_symm_buffer_for_mega_moe(group, **args, use_fp8_dispatch=True, mma_type=None)  # was AttributeError
    assert dg.get_symm_buffer_for_mega_moe(group, **args).mma_type == "fp8xfp4"  # None: derived from mma_type
    with pytest.raises(TypeError, match="transform_sf_into_required_layout: disable_ue8m0_cast must be a bool, "
                                        "got str \\('yes'\\)"):
        dg.transform_sf_into_required_layout(torch.ones(4, 16), 4, 512, (1, 32), disable_ue8m0_cast="yes")
    with pytest.raises(TypeError, match="transform_sf_into_required_layout: is_sfa must be a bool or None, got str"):
        dg.transform_sf_into_required_layout(torch.ones(4, 16), 4, 512, (1, 1, 32), is_sfa="no")  # was: True
    buf = dg.get_symm_buffer_for_mega_moe(group, **args)
    l1 = (torch.zeros(E, 2 * N_I, H, dtype=torch.float8_e4m3fn), torch.ones(E, 2 * N_I // 128, H // 128))
    l2 = (torch.zeros(E, H, N_I, dtype=torch.float8_e4m3fn), torch.ones(E, H // 128, N_I // 128))
    with pytest.raises(TypeError, match="fp8_mega_moe: fast_math must be a bool, got str \\('x'\\)"):
        dg.fp8_mega_moe(torch.empty(3, H, dtype=torch.bfloat16), l1, l2, buf, fast_math="x")
    with pytest.raises(TypeError, match="fp8_fp4_mega_moe: post_expert_norm must be a bool, got int \\(1\\)"):
        dg.fp8_fp4_mega_moe(torch.empty(3, H, dtype=torch.bfloat16), l1, l2, buf, post_expert_norm=1)


# ------------------------------------------------------------------------------------------------------------------
# Item 8: get_low_latency_rdma_size_hint checks the sizes the calls check


@pytest.mark.parametrize(("kw", "exc", "match"), [
    ({"tokens": -1}, ValueError, "num_max_dispatch_tokens_per_rank: must be in \\[1, 2147483647\\] .*, got -1"),
    ({"tokens": 0}, ValueError, "num_max_dispatch_tokens_per_rank: must be in \\[1, 2147483647\\] .*, got 0"),
    ({"tokens": 1.5}, TypeError, "num_max_dispatch_tokens_per_rank: must be an int .*, got 1.5 of type float"),
    ({"tokens": math.nan}, TypeError, "num_max_dispatch_tokens_per_rank: must be an int .*, got nan of type float"),
    ({"hidden": 200}, ValueError, "hidden: must be a positive multiple of 128, got 200"),
    ({"hidden": 0}, ValueError, "hidden: must be in \\[1, 2147483647\\] .*, got 0"),
    ({"experts": 9}, ValueError, "num_experts: must be a multiple of num_ranks 8 and <= 1024, got 9"),
    ({"experts": 2048}, ValueError, "num_experts: must be a multiple of num_ranks 8 and <= 1024, got 2048"),
    ({"ranks": True}, TypeError, "get_low_latency_rdma_size_hint: num_ranks must be an int, got bool \\(True\\)"),
    ({"ranks": 8.0}, TypeError, "num_ranks must be an int, got float"),
])
def test_rdma_size_hint_refuses_bad_sizes(kw: dict, exc: type, match: str) -> None:
    args = {"tokens": 128, "hidden": 7168, "ranks": 8, "experts": 256, **kw}
    with pytest.raises(exc, match=match):
        Buffer.get_low_latency_rdma_size_hint(args["tokens"], args["hidden"], args["ranks"], args["experts"])


def test_rdma_size_hint_valid_sizes_unchanged() -> None:
    assert Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256) == required_bytes(LlShape(8, 256, 128, 7168,
                                                                                              HINT_TOPK), True)


# ------------------------------------------------------------------------------------------------------------------
# Item 12: byte counts, QPs, SM counts, MNNVL / fabric


@pytest.mark.parametrize(("kw", "exc", "match"), [
    ({"num_nvl_bytes": -1}, ValueError, "Buffer: num_nvl_bytes must be in \\[0, 9223372036854775807\\], got -1"),
    ({"num_nvl_bytes": "1024"}, TypeError, "Buffer: num_nvl_bytes must be an int, got str \\('1024'\\)"),
    ({"num_rdma_bytes": -5}, ValueError, "Buffer: num_rdma_bytes must be in \\[0, 9223372036854775807\\], got -5"),
    ({"num_rdma_bytes": "1 << 20"}, TypeError, "Buffer: num_rdma_bytes must be an int, got str"),
    ({"num_rdma_bytes": 10**400}, ValueError, "Buffer: num_rdma_bytes must be in \\[0, 9223372036854775807\\]"),
    ({"num_qps_per_rank": -1}, ValueError, "Buffer: num_qps_per_rank must be >= 1, got -1"),
    ({"num_qps_per_rank": 2.0}, TypeError, "Buffer: num_qps_per_rank must be an int, got float"),
    ({"allow_mnnvl": True}, NotImplementedError, "allow_mnnvl=True \\(multi-node NVLink.*MNNVL"),
    ({"num_nvl_bytes": 1 << 35}, ValueError, "Buffer: num_nvl_bytes must be below 34359738352 bytes .*16-byte "
                                            "vectors in a C int"),  # DeepEP: num_nvl_bytes / sizeof(int4) < INT_MAX
    ({"low_latency_mode": False}, ValueError, "Buffer: num_rdma_bytes must be 0 for an intranode normal-mode Buffer"),
])
def test_buffer_sizes_and_unimplemented_memory(group: dist.ProcessGroup, launches: list, kw: dict, exc: type,
                                               match: str) -> None:
    created = FakeWorkspace.created
    args: dict = {"num_nvl_bytes": 0, "num_rdma_bytes": 1 << 20, "low_latency_mode": True, **kw}
    with pytest.raises(exc, match=match):
        Buffer(group, **args)
    assert FakeWorkspace.created == created  # refused before the workspace is allocated


def test_buffer_accepts_what_the_pin_leaves_unused(group: dist.ProcessGroup, launches: list) -> None:
    """sgl-deep-ep 0.1.2.post1 ignores ``use_fabric`` and reads ``num_qps_per_rank`` in low-latency mode only."""
    Buffer(group, 0, 1 << 20, low_latency_mode=True, use_fabric=True)
    Buffer(group, 0, 0, num_qps_per_rank=0)  # a normal-mode Buffer (the NVL bytes need no GPU for this check)
    with pytest.raises(ValueError, match="Buffer: num_qps_per_rank must be >= 1, got 0"):
        Buffer(group, 0, 1 << 20, low_latency_mode=True, num_qps_per_rank=0)


@pytest.mark.parametrize("bad", [0, -1, 10**7, 10**400, 2.0, True])
def test_deep_gemm_set_num_sms_bounds(monkeypatch: pytest.MonkeyPatch, bad: object) -> None:
    monkeypatch.setattr(_runtime, "_num_sms", None)
    monkeypatch.setattr(_runtime, "_device_num_sms", lambda: None)  # a host without CUDA: bounded by MAX_SMS
    exc = TypeError if isinstance(bad, bool | float) else ValueError
    with pytest.raises(exc, match="set_num_sms: new_num_sms must be"):
        dg.set_num_sms(bad)
    assert _runtime._num_sms is None
    dg.set_num_sms(1024)
    assert dg.get_num_sms() == 1024


def test_native_sm_counts_named_through_the_facade_buffer(group: dist.ProcessGroup) -> None:
    """The facade sizes the native buffer's ring itself (``HOST_COMPUTE_SMS`` on a CPU host), which passes the
    native bounds; the native refusals of compute_sms / dispatch_sms are tested in tests/operator/test_api.py."""
    buf = dg.get_symm_buffer_for_mega_moe(group, E, 40, K, H, N_I)
    assert 2 <= buf.workspace.compute_sms <= dg._checks.MAX_SMS


# ------------------------------------------------------------------------------------------------------------------
# Items 10, 11 and the wrong kind of error: each named as the caller's argument, TypeError / ValueError, before any
# allocation (values only the device sees: tests/facades/test_predispatch_kernel.py, tests/operator/
# test_role1_dropped_gpu.py; the fuzz of every entry point: tests/fuzz/)


def _pre(buf: dg.SymmBuffer, **kw: object) -> None:
    x = torch.zeros(5, H, dtype=torch.bfloat16)
    idx, w = torch.zeros(5, K, dtype=torch.int32), torch.full((5, K), 0.5, dtype=torch.float32)
    views = dict(buf_x=buf.x, buf_x_sf=buf.x_sf, buf_topk_idx=buf.topk_idx, buf_topk_weights=buf.topk_weights)
    args = {"x": x, "topk_idx": idx, "topk_weights": w, **views, "num_tokens": 5, **kw}
    dg.mega_moe_pre_dispatch_sm90(**args)


@pytest.mark.parametrize(("kw", "exc", "match"), [
    ({"x": torch.zeros(5, 0, dtype=torch.bfloat16)}, ValueError, "x must have a hidden size .* got 0"),  # hidden 0
    ({"topk_idx": torch.zeros(5, 0, dtype=torch.int32), "topk_weights": torch.zeros(5, 0, dtype=torch.float32)},
     ValueError, "topk_idx must have 1 to 32 columns"),  # top-k 0
    ({"x": torch.tensor(1.0, dtype=torch.bfloat16)}, ValueError, "x must be 2-D, got shape \\(\\)"),  # was IndexError
    ({"topk_idx": torch.full((5, K), 2**31 - 1, dtype=torch.int32)}, ValueError,
     "topk_idx: must be in \\[-1, 16\\)"),  # item 2: host tensors are checked
    ({"topk_idx": torch.full((5, K), -5, dtype=torch.int32)}, ValueError, "topk_idx: must be in \\[-1, 16\\)"),
    ({"topk_idx": torch.zeros(5, K, dtype=torch.int64)}, TypeError,
     "topk_idx must have dtype in \\['torch.int32'\\], got torch.int64"),  # the pin's int32 ids
    ({"topk_weights": torch.full((5, K), math.nan, dtype=torch.float32)}, ValueError,
     "topk_weights \\* routed_scaling_factor: must be finite"),
    ({"routed_scaling_factor": 1e39}, ValueError, "routed_scaling_factor must be finite in FP32"),  # item 3
    ({"routed_scaling_factor": 10**400}, ValueError, "routed_scaling_factor must be a finite number, got an int of "
                                                     "401 digits"),  # was OverflowError
    ({"topk_weights": torch.full((5, K), 2.0e38, dtype=torch.float32), "routed_scaling_factor": 2.0}, ValueError,
     "topk_weights \\* routed_scaling_factor: must be finite"),
])
def test_pre_dispatch_refusals_name_the_argument(group: dist.ProcessGroup, kw: dict, exc: type, match: str) -> None:
    buf = dg.get_symm_buffer_for_mega_moe(group, E, 8, K, H, N_I)
    before = [t.clone() for t in (buf.x.view(torch.uint8), buf.topk_idx, buf.topk_weights)]
    with pytest.raises(exc, match=f"mega_moe_pre_dispatch_sm90: {match}"):
        _pre(buf, **kw)
    after = (buf.x.view(torch.uint8), buf.topk_idx, buf.topk_weights)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # nothing written
    _pre(buf)  # the baseline stages


def test_pre_dispatch_views_must_be_one_buffers_own(group: dist.ProcessGroup) -> None:
    """Item 10: views swapped (x_sf <-> topk_weights have the same shape here: H/128 == k) or of two buffers."""
    a, b = (dg.get_symm_buffer_for_mega_moe(group, E, 8, K, H, N_I) for _ in range(2))
    with pytest.raises(ValueError, match="buf_x_sf must be sym_buffer.x_sf .* got another region of that buffer"):
        _pre(a, buf_x_sf=a.topk_weights, buf_topk_weights=a.x_sf)
    with pytest.raises(ValueError, match="buf_topk_idx must be sym_buffer.topk_idx .* got a view of another buffer"):
        _pre(a, buf_topk_idx=b.topk_idx)
    with pytest.raises(ValueError, match="mega_moe_pre_dispatch: buf_x_sf is float32, the SM90 layout .*"
                                         "mega_moe_pre_dispatch_sm90"):  # issue 22 point 3
        dg.mega_moe_pre_dispatch(torch.zeros(5, H, dtype=torch.bfloat16), torch.zeros(5, K, dtype=torch.int32),
                                 torch.zeros(5, K, dtype=torch.float32), a.x, a.x_sf, a.topk_idx, a.topk_weights, 5,
                                 mma_type="fp8xfp4")
    a.destroy()
    with pytest.raises(TypeError, match="buf_x must be a torch.Tensor, got None \\(the views of a destroyed"):
        _pre(a)


@pytest.mark.parametrize(("kw", "exc", "match"), [
    ({"num_experts": 4096}, ValueError, "num_experts: must be in \\[1, 2048\\]"),
    ({"num_topk": 64}, ValueError, "num_topk: must be in \\[1, 32\\]"),
    ({"num_ranks": 1024, "num_experts": 1024}, ValueError, "num_ranks: must be in \\[1, 72\\]"),
    ({"num_max_tokens_per_rank": 9000, "num_tokens": 1}, ValueError, "num_max_tokens_per_rank: must be in "
                                                                     "\\[1, 8192\\]"),
    ({"mma_type": None}, TypeError, "mma_type must be one of .* got NoneType"),
])
def test_block_m_answers_only_for_shapes_a_buffer_accepts(kw: dict, exc: type, match: str) -> None:
    """Item 11: get_block_m_for_mega_moe checks the routing sizes the buffer checks (config.check_routing)."""
    args = {**dict(num_ranks=8, num_experts=256, num_max_tokens_per_rank=256, num_tokens=16, num_topk=8), **kw}
    with pytest.raises(exc, match=f"get_block_m_for_mega_moe: {match}"):
        dg.get_block_m_for_mega_moe(**args)


def test_layer_call_refusals_name_the_argument(group: dist.ProcessGroup) -> None:
    buf = dg.get_symm_buffer_for_mega_moe(group, E, 40, K, H, N_I)
    l1 = (torch.zeros(E, 2 * N_I, H, dtype=torch.float8_e4m3fn), torch.ones(E, 2 * N_I // 128, H // 128))
    l2 = (torch.zeros(E, H, N_I, dtype=torch.float8_e4m3fn), torch.ones(E, H // 128, N_I // 128))
    y = torch.empty(3, H, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fp8_mega_moe: y.shape\\[0\\] \\(tokens T\\): must be <= capacity=64 .*"
                                         "num_max_tokens_per_rank rounded up.* got 65"):  # not num_tokens
        dg.fp8_mega_moe(torch.empty(65, H, dtype=torch.bfloat16), l1, l2, buf)
    with pytest.raises(TypeError, match="fp8_mega_moe: l1_weights: must be a \\(weights, scales\\) pair of "
                                        "tensors, got None"):  # was 'NoneType' object is not subscriptable
        dg.fp8_mega_moe(y, None, l2, buf)
    with pytest.raises(TypeError, match="fp8_mega_moe: recipe must be a tuple of ints"):
        dg.fp8_mega_moe(y, l1, l2, buf, recipe=None)
    with pytest.raises(ValueError, match="fp8_fp4_mega_moe: global_num_tokens must be in \\[3, 64\\], got 2"):
        dg.fp8_fp4_mega_moe(y, l1, l2, buf, global_num_tokens=2)  # below y's rows (item 11)
    with pytest.raises(RuntimeError, match="fp8_mega_moe: buffer: lives in host memory"):  # valid: to the launch
        dg.fp8_mega_moe(y, l1, l2, buf)
    buf.destroy()
    with pytest.raises(ValueError, match="fp8_mega_moe: sym_buffer was destroyed"):
        dg.fp8_mega_moe(y, l1, l2, buf)
    stats = torch.zeros(3, dtype=torch.int32)  # [e] = [16] expected
    with pytest.raises(ValueError, match="fp8_mega_moe: cumulative_local_expert_recv_stats: must be a contiguous "
                                         "int32 tensor \\[16\\]"):  # the native call's one check
        dg.fp8_mega_moe(y, l1, l2, dg.get_symm_buffer_for_mega_moe(group, E, 40, K, H, N_I),
                        cumulative_local_expert_recv_stats=stats)


@pytest.mark.parametrize(("kw", "exc", "match"), [
    ({"num_max_tokens_per_rank": 8193}, ValueError, "num_max_tokens_per_rank must be in \\[1, 8192\\], got 8193"),
    ({"hidden": 256 * 2**32}, ValueError, "hidden: must be in \\[1, 8192\\]"),  # was a ~2 PB allocation
    ({"num_experts": 10**400}, ValueError, "num_experts: must be in \\[1, 2048\\] .* got an int of 401 digits"),
    ({"mma_type": __import__("numpy").array("fp8xfp4")}, TypeError, "mma_type must be one of .* got ndarray"),
])
def test_buffer_refusals_name_the_callers_value(group: dist.ProcessGroup, kw: dict, exc: type, match: str) -> None:
    args = {**dict(num_experts=E, num_max_tokens_per_rank=40, num_topk=K, hidden=H, intermediate_hidden=N_I), **kw}
    with pytest.raises(exc, match=match):
        dg.get_symm_buffer_for_mega_moe(group, **args)


def test_wrong_kinds_of_error_are_gone(group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TypeError, match="SymmBuffer: group must be a torch.distributed ProcessGroup, got NoneType"):
        dg.get_symm_buffer_for_mega_moe(None, E, 40, K, H, N_I)  # was AttributeError
    with pytest.raises(ValueError, match="transform_sf_into_required_layout: recipe's gran_mn must be >= 1, got 0"):
        dg.transform_sf_into_required_layout(torch.ones(4, 16), 4, 512, (0, 128))  # was ZeroDivisionError
    with pytest.raises(TypeError, match="transform_sf_into_required_layout: recipe's gran_mn must be an int"):
        dg.transform_sf_into_required_layout(torch.ones(4, 16), 4, 512, ("a", 128))
    if not torch.cuda.is_available():  # was "Torch not compiled with CUDA enabled" (AssertionError)
        with pytest.raises(RuntimeError, match="Buffer: low_latency_mode=True: symmetric workspace: needs a CUDA "
                                               "device"):
            Buffer(group, 0, 1 << 20, low_latency_mode=True)
    monkeypatch.setenv("GC_MOE_DISPATCH_SMS", "100000")  # the variable is named, not the argument
    with pytest.raises(ValueError, match="GC_MOE_DISPATCH_SMS \\(the dispatch SM request, dispatch_sms=None\\)"):
        api.get_symm_buffer_for_gc_moe(group, E, 32, K, H, N_I, compute_sms=64)


# ------------------------------------------------------------------------------------------------------------------
# Items 4, 5 and 13: weight transforms and weights (dtype, shape, agreement of the pairs, values)

W_E = 2
"""Experts of the weight-transform cases."""


def _fp8_pairs(e: int = W_E) -> list[list[torch.Tensor]]:
    """Valid FP8xFP8 canonical weights (E4M3 payloads, FP32 128x128 block scales), as mutable lists."""
    return [[torch.full((e, 2 * N_I, H), 0.5).to(torch.float8_e4m3fn), torch.full((e, 2 * N_I // 128, H // 128), 0.01)],
            [torch.full((e, H, N_I), 0.5).to(torch.float8_e4m3fn), torch.full((e, H // 128, N_I // 128), 0.01)]]


def _fp4_pairs(e: int = W_E, packed: bool = True) -> list[list[torch.Tensor]]:
    """Valid MXFP4 weights (packed E2M1 uint8, UE8M0 K32 scales 1.0: int32 words, or uint8 codes)."""
    def sf(n: int, k: int) -> torch.Tensor:
        codes = torch.full((e, n, k // 32), 127, dtype=torch.uint8)
        return quant.pack_ue8m0_k32(codes) if packed else codes
    return [[torch.full((e, 2 * N_I, H // 2), 0x22, dtype=torch.uint8), sf(2 * N_I, H)],
            [torch.full((e, H, N_I // 2), 0x22, dtype=torch.uint8), sf(H, N_I)]]


def _poke(t: torch.Tensor, value: float | int) -> torch.Tensor:
    """``t`` with its first element (its first byte, for an E4M3 payload) set to ``value``."""
    t = t.clone()
    if t.dtype == torch.float8_e4m3fn:
        t.view(torch.uint8).view(-1)[0] = value
    else:
        t.view(-1)[0] = value
    return t


def _with(pairs: list[list[torch.Tensor]], gemm: int, part: int, t: torch.Tensor) -> tuple[tuple, tuple]:
    pairs = [list(p) for p in pairs]
    pairs[gemm][part] = t
    return tuple(pairs[0]), tuple(pairs[1])


_BAD_FP8_VALUES = [(0, 0, 0x7F, "l1_weights\\[0\\] must hold no E4M3 NaN codes"),
                   (1, 0, 0xFF, "l2_weights\\[0\\] must hold no E4M3 NaN codes"),
                   (0, 1, float("nan"), "l1_weights\\[1\\] must hold finite positive FP32 scales"),
                   (1, 1, float("inf"), "l2_weights\\[1\\] must hold finite positive"),
                   (0, 1, -0.5, "l1_weights\\[1\\] must hold finite positive"),
                   (0, 1, 0.0, "l1_weights\\[1\\] must hold finite positive")]


@pytest.mark.parametrize(("gemm", "part", "value", "match"), _BAD_FP8_VALUES)
def test_fp8_weight_values_are_refused_by_every_entry(group: dist.ProcessGroup, gemm: int, part: int,
                                                      value: float, match: str) -> None:
    """NaN E4M3 codes and NaN/Inf/negative/zero block scales: the native transform, the SM90 facade transform and
    fp8_mega_moe (at its one conversion, before the launch) refuse them with one rule (quant.check_weight_values)."""
    pairs = _fp8_pairs()
    bad = _with(pairs, gemm, part, _poke(pairs[gemm][part], value))
    with pytest.raises(ValueError, match=f"transform_weights_for_gc_moe: {match}"):
        api.transform_weights_for_gc_moe(*bad, mma_type="fp8xfp8")
    with pytest.raises(ValueError, match=f"transform_weights_for_mega_moe_sm90: {match}"):
        dg.transform_weights_for_mega_moe_sm90(*bad)
    deepgemm = dg.transform_weights_for_mega_moe_sm90(*_with(pairs, 0, 0, pairs[0][0]))
    bad_deepgemm = _with([list(p) for p in deepgemm], gemm, part, _poke(deepgemm[gemm][part], value))
    buf = dg.get_symm_buffer_for_mega_moe(group, W_E, 16, 2, H, N_I)
    with pytest.raises(ValueError, match=f"fp8_mega_moe: {match}"):
        dg.fp8_mega_moe(torch.empty(2, H, dtype=torch.bfloat16), *bad_deepgemm, buf)


@pytest.mark.parametrize("gemm", [0, 1])
def test_ue8m0_code_255_is_refused_by_every_entry(group: dist.ProcessGroup, gemm: int) -> None:
    arg = ("l1_weights", "l2_weights")[gemm]
    for packed in (False, True):
        pairs = _fp4_pairs(packed=packed)
        bad = _with(pairs, gemm, 1, _poke(pairs[gemm][1], -1 if packed else 255))
        with pytest.raises(ValueError, match=f"transform_weights_for_gc_moe: {arg}\\[1\\] must hold no UE8M0 code 255"):
            api.transform_weights_for_gc_moe(*bad)
    with pytest.raises(ValueError, match=f"transform_weights_for_mega_moe: {arg}\\[1\\] must hold no UE8M0 code 255"):
        dg.transform_weights_for_mega_moe(*bad)
    layout = dg.transform_weights_for_mega_moe(*_fp4_pairs())
    bad_layout = _with([list(p) for p in layout], gemm, 1, _poke(layout[gemm][1], 0x7F_FF_FF_FF))
    buf = dg.get_symm_buffer_for_mega_moe(group, W_E, 16, 2, H, N_I)
    with pytest.raises(ValueError, match=f"fp8_fp4_mega_moe: {arg}\\[1\\] must hold no UE8M0 code 255"):
        dg.fp8_fp4_mega_moe(torch.empty(2, H, dtype=torch.bfloat16), *bad_layout, buf)


def _fp4_case(gemm: int, part: int, t: torch.Tensor) -> tuple[tuple, tuple]:
    return _with(_fp4_pairs(), gemm, part, t)


_P1, _S1 = (2 * N_I, H // 2), (2 * N_I, H // 128)


@pytest.mark.parametrize(("args", "kw", "exc", "match"), [
    (_fp4_case(0, 1, torch.ones(W_E, *_S1)), {}, TypeError, "l1_weights\\[1\\] must be int32 words of 4 packed"),
    (_fp4_case(1, 1, torch.full((W_E, H, N_I // 32), 127, dtype=torch.uint8)), {}, TypeError,
     "l2_weights\\[1\\] must be int32 words .* got torch.uint8"),
    (_fp4_case(0, 0, torch.zeros(W_E, *_P1)), {}, TypeError, "l1_weights\\[0\\] must have dtype in"),
    (_fp4_case(0, 0, torch.zeros(W_E, *_P1, dtype=torch.uint8)), {"mma_type": "fp8xfp8"}, TypeError,
     "l1_weights\\[0\\] must have dtype in \\['torch.float8_e4m3fn'\\] for mma_type='fp8xfp8'"),
    (_fp4_case(0, 1, torch.zeros(W_E, 2 * N_I, 7, dtype=torch.int32)), {}, ValueError,
     "l1_weights\\[1\\] must have K/128 = 4 words for K = 512"),
    (_fp4_case(0, 1, torch.zeros(W_E + 1, *_S1, dtype=torch.int32)), {}, ValueError,
     "l1_weights\\[1\\] must have the payload's experts and rows \\(2, 512\\)"),
    (_fp4_case(1, 0, torch.zeros(W_E + 1, H, N_I // 2, dtype=torch.uint8)), {}, ValueError,
     "l2_weights\\[1\\] must have the payload's experts and rows \\(3, 512\\)"),
    (_with(_fp4_pairs(W_E + 1), 0, 0, _fp4_pairs(W_E + 1)[0][0])[:1] + (tuple(_fp4_pairs()[1]),), {}, ValueError,
     "l2_weights\\[0\\] must be \\[3, 512, 128\\]"),
    (_fp4_case(0, 0, torch.zeros(W_E, 2 * N_I, H // 2, dtype=torch.int16)), {}, TypeError, "l1_weights\\[0\\]"),
    ((tuple(_fp4_pairs()[0]), (torch.zeros(W_E, H, N_I, dtype=torch.float8_e4m3fn), _fp4_pairs()[1][1])), {},
     TypeError, "l2_weights\\[0\\] must be of l1_weights\\[0\\]'s kind"),
    (((torch.zeros(W_E, 192, H // 2, dtype=torch.uint8), torch.zeros(W_E, 192, H // 128, dtype=torch.int32)),
      tuple(_fp4_pairs()[1])), {}, ValueError, "l1_weights must have N % 128 == 0 rows"),
    ((tuple(t[0] for t in _fp4_pairs()[0]), tuple(_fp4_pairs()[1])), {}, ValueError,
     "l2_weights .*all four of one rank"),
], ids=["fp32-scales", "uint8-codes", "fp32-payload", "fp4-with-fp8xfp8", "k-words-7", "experts-l1", "experts-l2",
        "experts-l1-vs-l2", "int16-payload", "mixed-kinds", "rows-192", "mixed-ranks"])
def test_transform_weights_for_mega_moe_refusals(args: tuple, kw: dict, exc: type, match: str) -> None:
    with pytest.raises(exc, match=f"transform_weights_for_mega_moe: {match}"):
        dg.transform_weights_for_mega_moe(*args, **kw)


@pytest.mark.parametrize(("gemm", "part", "t", "exc", "match"), [
    (0, 0, torch.zeros(W_E, 2 * N_I, H), TypeError, "l1_weights\\[0\\]: must be of dtype"),
    (0, 1, torch.ones(W_E, 2 * N_I // 128, H // 128, dtype=torch.int32), TypeError, "l1_weights\\[1\\]: must be of "
                                                                                     "dtype"),
    (0, 1, torch.ones(W_E, 7, 3), ValueError, "l1_weights\\[1\\]: must be of shape"),
    (1, 0, torch.zeros(W_E + 1, H, N_I, dtype=torch.float8_e4m3fn), ValueError, "l2_weights\\[0\\]: must be of "
                                                                                 "shape \\[E/P=2"),
    (1, 1, torch.ones(W_E + 1, H // 128, N_I // 128), ValueError, "l2_weights\\[1\\]: must be of shape \\[E/P=2"),
], ids=["fp32-payload", "int32-scales", "scales-7x3", "experts-l2-payload", "experts-l2-scales"])
def test_transform_weights_for_mega_moe_sm90_refusals(gemm: int, part: int, t: torch.Tensor, exc: type,
                                                      match: str) -> None:
    with pytest.raises(exc, match=f"transform_weights_for_mega_moe_sm90: {match}"):
        dg.transform_weights_for_mega_moe_sm90(*_with(_fp8_pairs(), gemm, part, t))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, 0.0])
@pytest.mark.parametrize(("recipe", "shape"), [((128, 128), (4, 4)), ((1, 32), (512, 16))], ids=["k128", "k32"])
def test_transform_sf_values(value: float, recipe: tuple[int, int], shape: tuple[int, int]) -> None:
    sf = torch.ones(shape)
    sf[1, 2] = value
    with pytest.raises(ValueError, match="transform_sf_into_required_layout: sf must hold finite positive FP32 "
                                         "scales"):
        dg.transform_sf_into_required_layout(sf, 512, 512, recipe)


def test_meta_weights_get_the_shape_and_dtype_rules_only() -> None:
    """Meta tensors have no values: the value rules are skipped, the shape and dtype rules still run."""
    meta8 = [tuple(t.to("meta") for t in p) for p in _fp8_pairs()]
    (w, s), _ = dg.transform_weights_for_mega_moe_sm90(*meta8)
    assert w.is_meta and s is meta8[0][1]
    w1, _ = api.transform_weights_for_gc_moe(*meta8, mma_type="fp8xfp8")
    assert w1.payload.is_meta
    assert dg.transform_sf_into_required_layout(torch.ones(4, 4, device="meta"), 512, 512, (128, 128)).is_meta
    with pytest.raises(ValueError, match="transform_weights_for_mega_moe_sm90: l1_weights\\[1\\]: must be of shape"):
        dg.transform_weights_for_mega_moe_sm90(*_with(meta8, 0, 1, torch.ones(W_E, 7, 3, device="meta")))


def _window_weights() -> api.GcMoeWeights:
    return api.transform_weights_for_gc_moe(*_fp4_pairs())[0]


@pytest.mark.parametrize(("field", "value", "exc", "match"), [
    ("factor", torch.tensor([float("nan"), 1.0]), ValueError, "GcMoeWeights.factor: must be finite and positive"),
    ("factor", torch.tensor([0.0, 1.0]), ValueError, "GcMoeWeights.factor: must be finite and positive"),
    ("factor", None, TypeError, "GcMoeWeights.factor: must be a float32 \\[e\\] tensor"),
    ("scales", torch.full((W_E, 2 * N_I, H // 32), 200, dtype=torch.uint8), ValueError,
     "GcMoeWeights.scales: relative exponents must lie in \\[0, 10\\].* got 200"),
    ("scales", torch.zeros(W_E, 2 * N_I, H // 32), TypeError, "GcMoeWeights.scales: must be a tensor of dtype"),
    ("mma_type", "fp4", ValueError, "GcMoeWeights: mma_type must be one of"),
], ids=["nan-factor", "zero-factor", "no-factor", "exponent-200", "fp32-exponents", "mma-type"])
def test_hand_built_weights_refuse_at_construction(field: str, value: object, exc: type, match: str) -> None:
    """Issue 19 item 13: GcMoeWeights built by hand with a NaN factor or an exponent out of the window."""
    w = _window_weights()
    fields = {"payload": w.payload, "scales": w.scales, "factor": w.factor, "mma_type": w.mma_type, "gemm": w.gemm}
    with pytest.raises(exc, match=match):
        api.GcMoeWeights(**{**fields, field: value})
    api.GcMoeWeights(**fields)  # the valid baseline


def test_hand_built_fp8_weights_refuse_bad_block_scales() -> None:
    w = api.transform_weights_for_gc_moe(*_fp8_pairs(), mma_type="fp8xfp8")[1]
    with pytest.raises(ValueError, match="GcMoeWeights: scales must hold finite positive FP32 scales"):
        api.GcMoeWeights(w.payload, _poke(w.scales, float("nan")), None, "fp8xfp8", "l2")
    with pytest.raises(TypeError, match="GcMoeWeights.factor: must be None for fp8xfp8"):
        api.GcMoeWeights(w.payload, w.scales, torch.ones(W_E), "fp8xfp8", "l2")


