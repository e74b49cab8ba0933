"""The deep_ep facade's host side on CPU: construction, what is not implemented, argument checks, output layouts.

A Buffer in normal mode (``low_latency_mode=False``) needs no GPU. For the low-latency paths the symmetric workspace is
replaced by a CPU stand-in (:class:`FakeWorkspace`) and the kernel launches by a recorder, so every check that must
run before a launch is exercised, and a valid call's outputs (shapes, dtypes, the column-major scales, the handle)
and launch parameters can be inspected. The kernels themselves are the GPU tests' (tests/facades/test_deep_ep_ll.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from compiled_host_kit import misaligned, unaligned
from ll_launches import Launch, record_ll_launches

from gc_moe_compat import deep_ep
from gc_moe_compat.comm import TOPK_IDX_DTYPE, ep_ll
from gc_moe_compat.comm.ep_ll import HEADER_BYTES, HINT_TOPK, MAX_SMS, Kernel, LlShape, required_bytes
from gc_moe_compat.deep_ep import Buffer, Config, EventOverlap, LowLatencyHandle, _buffer
from gc_moe_compat.deep_ep._config import BUFFER_ALIGNMENT_BYTES, C_INT_MAX, TOPK_IDX_DTYPES
from gc_moe_compat.runtime.workspace import PeerTable

T_MAX, HIDDEN, EXPERTS, TOPK, TOKENS = 8, 256, 8, 4, 5


class FakeWorkspace:
    """CPU stand-in for ``SymmetricWorkspace``: the attributes the facade reads (device, world size, the buffer it
    sizes calls against, the peer table it passes to launches)."""

    def __init__(self, layout: object, group: dist.ProcessGroup | None = None) -> None:
        self.device = torch.device("cpu")
        self.world_size = dist.get_world_size(group) if group is not None else 1
        self.buffer = torch.zeros(layout.size, dtype=torch.uint8)
        self.peer_table, self.sm_share = PeerTable(), MAX_SMS


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[Launch]:
    """Every kernel launch a low-latency call makes, as ``(what, params)`` (tests/kit/ll_launches.py), instead of
    launching."""
    return record_ll_launches(monkeypatch)


@pytest.fixture
def make_ll(group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch,
            launches: list) -> Callable[..., Buffer]:
    """Low-latency Buffers on :class:`FakeWorkspace` (sized by the hint for ``T_MAX, HIDDEN, EXPERTS`` by default)."""
    monkeypatch.setattr(_buffer, "SymmetricWorkspace", FakeWorkspace)

    def make(num_rdma_bytes: int | None = None, **kw: object) -> Buffer:
        if num_rdma_bytes is None:
            num_rdma_bytes = Buffer.get_low_latency_rdma_size_hint(T_MAX, HIDDEN, 1, EXPERTS)
        return Buffer(group, 0, num_rdma_bytes, low_latency_mode=True, **kw)

    return make


@pytest.fixture
def ll(make_ll: Callable[..., Buffer]) -> Buffer:
    return make_ll()


def _inputs(tokens: int = TOKENS, hidden: int = HIDDEN, topk: int = TOPK) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(tokens, hidden).to(torch.bfloat16)
    topk_idx = torch.randint(-1, EXPERTS, (tokens, topk), dtype=torch.int64)
    return x, topk_idx


# ------------------------------------------------------------------------------------------------------------------
# Construction and the normal mode


@pytest.fixture
def normal(group: dist.ProcessGroup) -> Buffer:
    return Buffer(group, 0, 0, low_latency_mode=False)


def test_normal_mode_buffer_constructs_without_a_gpu(normal: Buffer) -> None:
    assert (normal.rank, normal.group_size, normal.low_latency_mode, normal.workspace) == (0, 1, False, None)
    assert Buffer.is_sm90_compiled() is True


def test_normal_mode_calls_without_num_nvl_bytes_name_it(normal: Buffer) -> None:
    """The normal mode is implemented (tests/facades/test_deep_ep_normal*.py); without ``num_nvl_bytes`` its calls
    name the argument, while the configs and hints (no workspace) answer."""
    calls = {
        "get_dispatch_layout": lambda: normal.get_dispatch_layout(torch.zeros(2, 2, dtype=torch.int64), 8),
        "dispatch": lambda: normal.dispatch(torch.zeros(2, 128), topk_idx=None),
        "combine": lambda: normal.combine(torch.zeros(2, 128), ()),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match="num_nvl_bytes > 0") as info:
            call()
        assert name in str(info.value)
    assert Buffer.get_dispatch_config(1).num_sms == Buffer.num_sms
    assert Config().get_nvl_buffer_size_hint(7168 * 2, 8) > 0 and Config().get_rdma_buffer_size_hint(7168 * 2, 8) == 0


def test_low_latency_methods_on_a_normal_buffer_name_low_latency_mode(normal: Buffer) -> None:
    x, topk_idx = _inputs()
    for call in (lambda: normal.clean_low_latency_buffer(T_MAX, HIDDEN, EXPERTS),
                 lambda: normal.low_latency_dispatch(x, topk_idx, T_MAX, EXPERTS),
                 lambda: normal.low_latency_combine(x, topk_idx, torch.ones(TOKENS, TOPK), ())):
        with pytest.raises(ValueError, match="low_latency_mode=False"):
            call()


def test_constructor_checks(group: dist.ProcessGroup) -> None:
    with pytest.raises(ValueError, match="group: either 'group' or 'comm' must be provided"):
        Buffer(None)
    with pytest.raises(NotImplementedError, match="mpi4py communicator"):
        Buffer(None, comm=object())
    with pytest.raises(NotImplementedError, match="allow_nvlink_for_low_latency_mode=False"):
        Buffer(group, 0, 1 << 20, low_latency_mode=True, allow_nvlink_for_low_latency_mode=False)
    for bad in (0, HEADER_BYTES - BUFFER_ALIGNMENT_BYTES):
        with pytest.raises(ValueError, match=f"num_rdma_bytes: the low-latency mode needs an int >= {HEADER_BYTES}"):
            Buffer(group, 0, bad, low_latency_mode=True)
    for bad in (True, float(1 << 20)):
        with pytest.raises(TypeError, match="Buffer: num_rdma_bytes must be an int"):
            Buffer(group, 0, bad, low_latency_mode=True)


def test_destroy(make_ll: Callable[..., Buffer]) -> None:
    with pytest.raises(ValueError, match="explicitly_destroy=False"):
        make_ll().destroy()
    buf = make_ll(explicitly_destroy=True)
    buf.destroy()
    with pytest.raises(ValueError, match="clean_low_latency_buffer: the Buffer was destroyed"):
        buf.clean_low_latency_buffer(T_MAX, HIDDEN, EXPERTS)
    with pytest.raises(ValueError, match="destroy: the Buffer was already destroyed"):  # DeepEP: `not destroyed`
        buf.destroy()


@pytest.fixture
def restore_num_sms(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(Buffer, "num_sms", Buffer.num_sms)
    yield


@pytest.mark.usefixtures("restore_num_sms")
def test_set_num_sms() -> None:
    Buffer.set_num_sms(24)
    assert Buffer.num_sms == 24
    for bad, error in ((0, ValueError), (-2, ValueError), (3, ValueError), (10**400, ValueError), (True, TypeError),
                       (24.0, TypeError), ("24", TypeError)):
        with pytest.raises(error, match="set_num_sms: new_num_sms must be"):
            Buffer.set_num_sms(bad)
    assert Buffer.num_sms == 24


@pytest.mark.parametrize(("tokens", "hidden", "ranks", "experts"),
                         [(128, 7168, 8, 256), (T_MAX, HIDDEN, 1, EXPERTS), (256, 4096, 2, 64), (1, 128, 72, 72)])
def test_rdma_size_hint_provisions_top16(tokens: int, hidden: int, ranks: int, experts: int) -> None:
    hint = Buffer.get_low_latency_rdma_size_hint(tokens, hidden, ranks, experts)
    assert hint == required_bytes(LlShape(ranks, experts, tokens, hidden, HINT_TOPK), True) and HINT_TOPK == 16


def test_rdma_size_hint_rank_bounds() -> None:
    for ranks in (0, 73):
        with pytest.raises(ValueError, match=r"get_low_latency_rdma_size_hint: num_ranks must be in \[1, 72\]"):
            Buffer.get_low_latency_rdma_size_hint(8, 128, ranks, 72)


def test_config() -> None:
    default = Config()
    assert (default.num_sms, default.num_max_nvl_chunked_send_tokens, default.num_max_nvl_chunked_recv_tokens,
            default.num_max_rdma_chunked_send_tokens, default.num_max_rdma_chunked_recv_tokens) == (20, 6, 256, 6, 256)
    # SGLang builds it from --deepep-config JSON with DeepEP's field names as keywords.
    fields = {"num_sms": 24, "num_max_nvl_chunked_send_tokens": 16, "num_max_nvl_chunked_recv_tokens": 512,
              "num_max_rdma_chunked_send_tokens": 8, "num_max_rdma_chunked_recv_tokens": 128}
    cfg = Config(**fields)
    assert {k: getattr(cfg, k) for k in fields} == fields
    assert vars(Config(24, 16, 512, 8, 128)) == vars(cfg)
    assert repr(cfg) == "Config(num_sms=24, 16, 512, 8, 128)"
    for bad, error in ((-1, ValueError), (1 << 31, ValueError), (True, TypeError), (1.5, TypeError),
                       (None, TypeError)):
        with pytest.raises(error, match="Config: num_max_nvl_chunked_recv_tokens must be (an int|in \\[0, )"):
            Config(num_max_nvl_chunked_recv_tokens=bad)
    # DeepEP's constructor asserts on the chunk sizes
    for args, match in (((20, 0, 256), "chunked_send_tokens and num_max_nvl_chunked_recv_tokens must be > 0"),
                        ((20, 256, 256), "nvl_chunked_send_tokens must be below num_max_nvl_chunked_recv_tokens"),
                        ((20, 6, 256, 6, 0), "rdma_chunked_send_tokens and num_max_rdma_chunked_recv_tokens must be"),
                        ((20, 6, 256, 8, 8), "at most half of num_max_rdma_chunked_recv_tokens rounded up .*rounded 8"),
                        ((20, 6, 256, 256, 256), "rounded 256")):
        with pytest.raises(ValueError, match=f"Config: num_max_.*{match}"):
            Config(*args)
    assert Config(20, 6, 256, 129, 256).num_max_rdma_chunked_recv_tokens == 256  # 256 rounds up to 258 = 2 x 129


class FakeEvent:
    def __init__(self) -> None:
        self.waits = 0

    def current_stream_wait(self) -> None:
        self.waits += 1


def test_event_overlap() -> None:
    empty = EventOverlap()
    with pytest.raises(ValueError, match="EventOverlap.current_stream_wait: there is no event"):
        empty.current_stream_wait()
    with empty:  # no event: nothing to wait for, as with DeepEP
        pass
    event = FakeEvent()
    ran = []
    overlap = EventOverlap(event)
    overlap.register_hook_after_wait(lambda: ran.append(1))
    with pytest.raises(ValueError, match="a hook is already registered"):
        overlap.register_hook_after_wait(lambda: None)
    overlap.current_stream_wait()
    overlap.current_stream_wait()
    assert (event.waits, ran) == (2, [1])  # the hook runs once, after the first wait
    with overlap(release_handle=True) as same:
        assert same is overlap
    assert (event.waits, overlap.event) == (3, None)


# ------------------------------------------------------------------------------------------------------------------
# Low-latency options the facade does not implement: refused before any launch


@pytest.mark.parametrize(("option", "value", "match"), [
    ("dispatch_wait_recv_cost_stats", torch.zeros(EXPERTS, dtype=torch.int64), "dispatch_wait_recv_cost_stats"),
    ("use_nvfp4", True, "use_nvfp4"),
])
def test_dispatch_unimplemented_options(ll: Buffer, launches: list, option: str, value: object, match: str) -> None:
    x, topk_idx = _inputs()
    with pytest.raises(NotImplementedError, match=match):
        ll.low_latency_dispatch(x, topk_idx, T_MAX, EXPERTS, **{option: value})
    assert launches == []


def test_x_global_scale_is_unused_without_nvfp4(ll: Buffer, launches: list) -> None:
    """``x_global_scale`` is NVFP4's alone: DeepEP reads it only with ``use_nvfp4=True`` (which raises here), so a
    tensor beside ``use_nvfp4=False`` (SGLang passes it whenever its quant config has an input global scale) runs the
    dispatch as without it; another type than a tensor is refused."""
    x, topk_idx = _inputs()
    ll.low_latency_dispatch(x, topk_idx, T_MAX, EXPERTS, x_global_scale=torch.ones(1), return_recv_hook=True)
    assert len(launches) == 1
    with pytest.raises(NotImplementedError, match="use_nvfp4, x_global_scale"):
        ll.low_latency_dispatch(x, topk_idx, T_MAX, EXPERTS, x_global_scale=torch.ones(1), use_nvfp4=True)
    with pytest.raises(TypeError, match="x_global_scale must be a torch.Tensor or None, got float"):
        ll.low_latency_dispatch(x, topk_idx, T_MAX, EXPERTS, x_global_scale=1.0)


def test_src_signal_expect_value_is_a_uint32(ll: Buffer, launches: list) -> None:
    """DeepEP's ``src_signal_expect_value`` is a C ``uint32_t`` (pybind refuses -1 or a str); unused without SGLang's
    single-batch overlap, it is still checked as one."""
    x, topk_idx = _inputs()
    handle = ll.low_latency_dispatch(x, topk_idx, T_MAX, EXPERTS, return_recv_hook=True)[2]
    y, w = torch.randn(EXPERTS, T_MAX, HIDDEN).to(torch.bfloat16), torch.rand(TOKENS, TOPK)
    ll.low_latency_combine(y, topk_idx, w, handle, src_signal_expect_value=(1 << 32) - 1, return_recv_hook=True)
    for value, error in ((-1, ValueError), (1 << 32, ValueError), ("x", TypeError), (1.0, TypeError)):
        with pytest.raises(error, match="low_latency_combine: src_signal_expect_value must be"):
            ll.low_latency_combine(y, topk_idx, w, handle, src_signal_expect_value=value, return_recv_hook=True)


@pytest.mark.parametrize(("option", "value", "match"), [
    ("use_logfmt", True, "use_logfmt"),
    ("combine_wait_recv_cost_stats", torch.zeros(EXPERTS, dtype=torch.int64), "combine_wait_recv_cost_stats"),
    ("overlap", True, "overlap"),
    ("comp_signal", torch.zeros(4, dtype=torch.int32), "comp_signal"),
    ("src_signals", torch.zeros(4, dtype=torch.int32), "src_signals"),
])
def test_combine_unimplemented_options(ll: Buffer, launches: list, option: str, value: object, match: str) -> None:
    x, topk_idx = _inputs()
    with pytest.raises(NotImplementedError, match=match):
        ll.low_latency_combine(x, topk_idx, torch.ones(TOKENS, TOPK), (), **{option: value})
    assert launches == []


def test_sglang_hopper_overlap_keywords_bind_but_refuse(ll: Buffer, launches: list) -> None:
    """The keyword set of SGLang's Hopper single-batch overlap is accepted by the signature; overlap=True refuses,
    naming the SGLang flag to drop."""
    x, topk_idx = _inputs()
    with pytest.raises(NotImplementedError, match="--enable-single-batch-overlap"):
        ll.low_latency_combine(x=x, topk_idx=topk_idx, topk_weights=torch.ones(TOKENS, TOPK), handle=(),
                               async_finish=False, return_recv_hook=True, overlap=True,
                               packed_recv_count=torch.zeros(EXPERTS, dtype=torch.int32),
                               comp_signal=torch.zeros(4, dtype=torch.int32), block_m=64, threshold=1, num_sms=3)
    assert launches == []


# ------------------------------------------------------------------------------------------------------------------
# Valid calls up to the launch (launches recorded)


def _dispatch(ll: Buffer, **kw: object) -> tuple:
    x, topk_idx = kw.pop("inputs", None) or _inputs()
    return ll.low_latency_dispatch(x, topk_idx, kw.pop("tmax", T_MAX), kw.pop("experts", EXPERTS),
                                   return_recv_hook=kw.pop("return_recv_hook", True), **kw)


def test_dispatch_fp8_layout_and_launches(ll: Buffer, launches: list) -> None:
    x, topk_idx = _inputs()
    recv, recv_count, handle, event, hook = _dispatch(ll, inputs=(x, topk_idx))
    assert [k for k, _ in launches] == [Kernel.DISPATCH_SEND] and event.event is None and hook is not None
    hook()
    assert [k for k, _ in launches] == [Kernel.DISPATCH_SEND, Kernel.DISPATCH_RECV]
    recv_x, scales = recv
    slots = 1 * T_MAX
    assert (recv_x.shape, recv_x.dtype) == ((EXPERTS, slots, HIDDEN), torch.float8_e4m3fn)
    # Column-major FP32 1x128 scales per local expert (DeepEP's layout, what the masked GEMM's TMA reads).
    assert (scales.shape, scales.dtype, scales.stride()) == ((EXPERTS, slots, HIDDEN // 128), torch.float32,
                                                             (slots * HIDDEN // 128, 1, slots))
    assert (recv_count.shape, recv_count.dtype) == ((EXPERTS,), torch.int32)
    assert isinstance(handle, LowLatencyHandle) and (handle.topk, handle.num_tokens) == (TOPK, TOKENS)
    src_info, layout_range, tmax, hidden, experts = handle
    assert (tuple(src_info.shape), src_info.dtype, tuple(layout_range.shape), layout_range.dtype) == (
        (EXPERTS, slots), torch.int32, (EXPERTS, 1), torch.int64)
    assert (tmax, hidden, experts) == (T_MAX, HIDDEN, EXPERTS)
    p = launches[0][1]
    assert (p.num_tokens, p.topk, p.hidden, p.num_experts, p.local_experts, p.max_tokens) == (
        TOKENS, TOPK, HIDDEN, EXPERTS, EXPERTS, T_MAX)
    assert (p.flags, p.x, p.topk_idx, p.recv_x, p.recv_scales, p.recv_count, p.recv_stats) == (
        ep_ll.FLAG_FP8, x.data_ptr(), topk_idx.data_ptr(), recv_x.data_ptr(), scales.data_ptr(),
        recv_count.data_ptr(), 0)
    assert bytes(launches[1][1]) == bytes(p)  # the receive half runs with the same parameters


def test_dispatch_ue8m0_bf16_and_stats(ll: Buffer, launches: list) -> None:
    # UE8M0: four power-of-two exponents per int32, column-major [e][H/512][P*Tmax] words (DeepEP's packed layout).
    (recv_x, scales), *_ = _dispatch(ll, inputs=_inputs(hidden=512), round_scale=True, use_ue8m0=True)
    assert (scales.shape, scales.dtype, scales.stride()) == ((EXPERTS, T_MAX, 1), torch.int32, (T_MAX, 1, T_MAX))
    assert launches[-1][1].flags == ep_ll.FLAG_FP8 | ep_ll.FLAG_ROUND_SCALE | ep_ll.FLAG_UE8M0
    stats = torch.zeros(EXPERTS, dtype=torch.int32)
    recv_x, *_ = _dispatch(ll, use_fp8=False, cumulative_local_expert_recv_stats=stats)
    assert recv_x.dtype == torch.bfloat16 and recv_x.shape == (EXPERTS, T_MAX, HIDDEN)
    p = launches[-1][1]
    assert (p.flags, p.recv_scales, p.recv_stats) == (0, 0, stats.data_ptr())
    # DeepEP reads round_scale and use_ue8m0 for the FP8 scales only: a BF16 dispatch ignores them (code that passes
    # its FP8 flags unchanged beside use_fp8=False runs with DeepEP)
    for kw in (dict(use_ue8m0=True), dict(use_ue8m0=True, round_scale=True), dict(round_scale=True)):
        recv_x, *_ = _dispatch(ll, use_fp8=False, **kw)
        assert recv_x.dtype == torch.bfloat16 and launches[-1][1].flags == 0


def test_combine_layout_and_launches(ll: Buffer, launches: list) -> None:
    x, topk_idx = _inputs()
    _, _, handle, _, _ = _dispatch(ll, inputs=(x, topk_idx))
    launches.clear()
    expert_out = torch.randn(EXPERTS, T_MAX, HIDDEN).to(torch.bfloat16)
    weights = torch.rand(TOKENS, TOPK)
    combined, event, hook = ll.low_latency_combine(expert_out, topk_idx, weights, handle, return_recv_hook=True)
    assert (combined.shape, combined.dtype, event.event) == ((TOKENS, HIDDEN), torch.bfloat16, None)
    hook()
    assert [k for k, _ in launches] == [Kernel.COMBINE_SEND, Kernel.COMBINE_RECV]
    p = launches[0][1]
    assert (p.x, p.topk_weights, p.out, p.src_info, p.num_tokens, p.topk) == (
        expert_out.data_ptr(), weights.data_ptr(), combined.data_ptr(), handle[0].data_ptr(), TOKENS, TOPK)
    out = torch.empty(TOKENS, HIDDEN, dtype=torch.bfloat16)
    combined, _, _ = ll.low_latency_combine(expert_out, topk_idx, weights, handle, return_recv_hook=True, out=out)
    assert combined is out


def test_the_groups_receive_rows_are_a_multiple_of_4(ll: Buffer, launches: list) -> None:
    """DeepEP asserts ``num_ranks * num_max_dispatch_tokens_per_rank % 4 == 0`` (its receive layout's rows, read by
    TMA): at one rank a Tmax of 5 is refused naming it, before any launch, as the pin refuses it."""
    x, topk_idx = _inputs(tokens=5)
    with pytest.raises(ValueError, match=r"num_max_dispatch_tokens_per_rank: times the group size \(1\) must be a "
                                         r"multiple of 4 \(DeepEP's rule.*got 5$"):
        ll.low_latency_dispatch(x, topk_idx, 5, EXPERTS)
    assert launches == []
    ll.low_latency_dispatch(x, topk_idx, 8, EXPERTS, return_recv_hook=True)
    assert len(launches) == 1


def test_the_recv_stats_take_a_row_slice(ll: Buffer, launches: list) -> None:
    """``cumulative_local_expert_recv_stats`` gets an atomic add per local expert: a slice 4 bytes past a 16-byte
    boundary is taken in place."""
    x, topk_idx = _inputs()
    stats = misaligned((EXPERTS,), torch.int32)
    assert stats.data_ptr() % 16 == 4
    ll.low_latency_dispatch(x, topk_idx, T_MAX, EXPERTS, cumulative_local_expert_recv_stats=stats,
                            return_recv_hook=True)
    assert launches[-1][1].recv_stats == stats.data_ptr()


def test_routing_row_slices_are_read_in_place(ll: Buffer, launches: list) -> None:
    """The kernels read topk_idx and topk_weights element by element: a row slice 8 or 4 bytes past a 16-byte
    boundary (SGLang's two-batch overlap splitting a top-k batch) is taken in place, as by DeepEP; x and out, read
    and written by 16-byte vectors, still need the alignment."""
    x, ids = _inputs(tokens=TOKENS + 1)
    topk_idx = misaligned((TOKENS, TOPK), torch.int64).copy_(ids[1:])
    assert topk_idx.data_ptr() % 16 == 8
    _, _, handle, _, _ = _dispatch(ll, inputs=(x[1:], topk_idx))
    assert launches[0][1].topk_idx == topk_idx.data_ptr()
    launches.clear()
    weights = misaligned((TOKENS, TOPK), torch.float32).copy_(torch.rand(TOKENS, TOPK))
    assert weights.data_ptr() % 16 == 4
    ll.low_latency_combine(torch.randn(EXPERTS, T_MAX, HIDDEN).to(torch.bfloat16), topk_idx, weights, handle,
                           return_recv_hook=True)
    assert (launches[0][1].topk_idx, launches[0][1].topk_weights) == (topk_idx.data_ptr(), weights.data_ptr())
    with pytest.raises(ValueError, match="x: must be 16-byte aligned"):
        _dispatch(ll, inputs=(misaligned((TOKENS, HIDDEN), torch.bfloat16), topk_idx))
    # one byte past an element boundary (an array from outside torch): the kernels' element reads would fault
    odd_idx = unaligned((TOKENS, TOPK), torch.int64).copy_(topk_idx)
    with pytest.raises(ValueError, match=r"topk_idx: must be aligned to its 8-byte elements \(element reads\)"):
        _dispatch(ll, inputs=(x[1:], odd_idx))
    odd_weights = unaligned((TOKENS, TOPK), torch.float32).copy_(weights)
    with pytest.raises(ValueError, match=r"topk_weights: must be aligned to its 4-byte elements"):
        ll.low_latency_combine(torch.randn(EXPERTS, T_MAX, HIDDEN).to(torch.bfloat16), topk_idx, odd_weights, handle,
                               return_recv_hook=True)


def test_clean_low_latency_buffer_checks_sizes(ll: Buffer, launches: list) -> None:
    ll.clean_low_latency_buffer(T_MAX, HIDDEN, EXPERTS)
    with pytest.raises(ValueError, match="hidden: must be a positive multiple of 128, got 200"):
        ll.clean_low_latency_buffer(T_MAX, 200, EXPERTS)
    with pytest.raises(ValueError, match="num_rdma_bytes: this call"):
        ll.clean_low_latency_buffer(T_MAX * 4, HIDDEN, EXPERTS)
    assert launches == []


# ------------------------------------------------------------------------------------------------------------------
# Argument checks: every one raises before any launch


def _bf16(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape, dtype=torch.bfloat16)


TOPK_IDX_REFUSED = (r"^topk_idx: must be a 2-D tensor of torch.int64 \(deep_ep.topk_idx_t, which DeepEP asserts\), "
                    r"got {shape} {dtype}$")
"""The refusal of a ``topk_idx`` of another dtype than DeepEP's ``topk_idx_t`` (int64), by dispatch and combine."""

DISPATCH_ERRORS = [
    ("x list", dict(inputs=([[0.0]], torch.zeros(1, 1, dtype=torch.int64))), TypeError, "x: must be a torch.Tensor"),
    ("x float32", dict(inputs=(torch.zeros(TOKENS, HIDDEN), torch.zeros(TOKENS, TOPK, dtype=torch.int64))),
     ValueError, "x: must be a 2-D tensor of torch.bfloat16"),
    ("x 3-D", dict(inputs=(_bf16(1, TOKENS, HIDDEN), torch.zeros(TOKENS, TOPK, dtype=torch.int64))), ValueError,
     "x: must be a 2-D tensor"),
    ("x on meta", dict(inputs=(torch.zeros(TOKENS, HIDDEN, dtype=torch.bfloat16, device="meta"),
                               torch.zeros(TOKENS, TOPK, dtype=torch.int64))), ValueError,
     "x: must be contiguous on cpu"),
    ("x strided", dict(inputs=(_bf16(HIDDEN, TOKENS).t(), torch.zeros(TOKENS, TOPK, dtype=torch.int64))), ValueError,
     "contiguous=False"),
    ("topk_idx float", dict(inputs=(_bf16(TOKENS, HIDDEN), torch.zeros(TOKENS, TOPK))), ValueError,
     TOPK_IDX_REFUSED.format(shape=r"\(5, 4\)", dtype="torch.float32")),
    ("topk_idx int32", dict(inputs=(_bf16(TOKENS, HIDDEN), torch.zeros(TOKENS, TOPK, dtype=torch.int32))), ValueError,
     TOPK_IDX_REFUSED.format(shape=r"\(5, 4\)", dtype="torch.int32")),
    ("topk_idx rows", dict(inputs=(_bf16(TOKENS, HIDDEN), torch.zeros(TOKENS + 1, TOPK, dtype=torch.int64))),
     ValueError, r"topk_idx: must be \[num_tokens=5, k\]"),
    ("topk 33", dict(inputs=(_bf16(TOKENS, HIDDEN), torch.zeros(TOKENS, 33, dtype=torch.int64))), ValueError,
     "1 <= k <= 32"),
    ("hidden 200", dict(inputs=(_bf16(TOKENS, 200), torch.zeros(TOKENS, TOPK, dtype=torch.int64))), ValueError,
     r"x.shape\[1\] \(hidden\): must be a positive multiple of 128, got 200"),
    ("ue8m0 hidden 256", dict(round_scale=True, use_ue8m0=True), ValueError,
     r"x.shape\[1\] \(hidden\): must be a positive multiple of 512, got 256"),
    ("ue8m0 without round_scale", dict(inputs=_inputs(hidden=512), use_ue8m0=True), ValueError,
     "use_ue8m0: FP8 UE8M0 scales need round_scale=True"),
    ("T > Tmax", dict(inputs=_inputs(tokens=T_MAX + 1)), ValueError,
     r"x.shape\[0\] \(tokens\): must be <= num_max_dispatch_tokens_per_rank=8, got 9"),
    ("Tmax 0", dict(tmax=0), ValueError, "num_max_dispatch_tokens_per_rank: must be in \\[1, 2147483647\\] .*, got 0"),
    ("Tmax bool", dict(tmax=True), TypeError,
     "num_max_dispatch_tokens_per_rank: must be an int .*, got True of type bool"),
    ("experts > 1024", dict(experts=2048), ValueError, "num_experts: must be a multiple of the group size 1 and "
     "<= 1024, got 2048"),
    ("stats int64", dict(cumulative_local_expert_recv_stats=torch.zeros(EXPERTS, dtype=torch.int64)), ValueError,
     "cumulative_local_expert_recv_stats: must be a 1-D tensor of torch.int32"),
    ("stats length", dict(cumulative_local_expert_recv_stats=torch.zeros(3, dtype=torch.int32)), ValueError,
     "cumulative_local_expert_recv_stats: must have num_experts / group size = 8 entries, got 3"),
    ("async and hook", dict(async_finish=True), ValueError,
     "low_latency_dispatch: async_finish and return_recv_hook cannot both be True"),
]


def test_topk_idx_t_is_the_one_dtype_the_calls_take() -> None:
    """``deep_ep.topk_idx_t`` is DeepEP's (torch.int64) and the object the calls check ``topk_idx`` against."""
    assert deep_ep.topk_idx_t is TOPK_IDX_DTYPE is torch.int64
    assert (deep_ep.topk_idx_t,) == TOPK_IDX_DTYPES


@pytest.mark.parametrize(("case", "kw", "error", "match"), DISPATCH_ERRORS, ids=[c[0] for c in DISPATCH_ERRORS])
def test_dispatch_argument_checks(ll: Buffer, launches: list, case: str, kw: dict, error: type,
                                  match: str) -> None:
    with pytest.raises(error, match=match):
        _dispatch(ll, **dict(kw))
    assert launches == []


def test_dispatch_experts_must_divide_over_ranks(ll: Buffer, launches: list) -> None:
    ll.workspace.world_size = 2  # the group size the workspace was rendezvoused over
    with pytest.raises(ValueError, match="num_experts: must be a multiple of the group size 2 and <= 1024, got 3"):
        _dispatch(ll, experts=3)
    assert launches == []


def test_dispatch_needs_enough_rdma_bytes(ll: Buffer, launches: list) -> None:
    need = required_bytes(LlShape(1, EXPERTS, 64, HIDDEN, TOPK))
    have = ll.workspace.buffer.numel()
    with pytest.raises(ValueError, match=f"num_rdma_bytes: this call .* needs {need} bytes, the Buffer has {have}; "
                                         "size it with Buffer.get_low_latency_rdma_size_hint"):
        _dispatch(ll, tmax=64)
    assert launches == []


def test_dispatch_topk_above_the_hint_needs_a_larger_buffer(make_ll: Callable[..., Buffer], launches: list) -> None:
    """A buffer sized for top-16 calls (the hint's top-k); a call with k = 32 (of 32 experts) names the bytes it
    needs."""
    ll = make_ll(required_bytes(LlShape(1, 32, T_MAX, HIDDEN, HINT_TOPK)))
    need = required_bytes(LlShape(1, 32, T_MAX, HIDDEN, 32))
    with pytest.raises(ValueError, match=f"topk=32, 1 ranks\\) needs {need} bytes"):
        _dispatch(ll, inputs=_inputs(topk=32), experts=32)
    _dispatch(make_ll(need), inputs=_inputs(topk=32), experts=32)
    assert [k for k, _ in launches] == [Kernel.DISPATCH_SEND]


@pytest.fixture
def dispatched(ll: Buffer, launches: list) -> tuple[LowLatencyHandle, torch.Tensor]:
    x, topk_idx = _inputs()
    _, _, handle, _, _ = _dispatch(ll, inputs=(x, topk_idx))
    launches.clear()
    return handle, topk_idx


COMBINE_ERRORS = [
    ("handle tuple", dict(handle=()), TypeError, "handle: must be the handle low_latency_dispatch returned"),
    ("x shape", dict(x=_bf16(EXPERTS, T_MAX, 128)), ValueError,
     r"x: must be \[num_local_experts=8, num_ranks\*Tmax=8, hidden=256\]"),
    ("x float32", dict(x=torch.zeros(EXPERTS, T_MAX, HIDDEN)), ValueError, "x: must be a 3-D tensor of torch.bfloat16"),
    ("topk_idx shape", dict(topk_idx=torch.zeros(TOKENS, TOPK - 1, dtype=torch.int64)), ValueError,
     r"topk_idx: must be the dispatch's \[num_tokens, k\] = \[5, 4\]"),
    ("topk_idx int32", dict(topk_idx=torch.zeros(TOKENS, TOPK, dtype=torch.int32)), ValueError,
     TOPK_IDX_REFUSED.format(shape=r"\(5, 4\)", dtype="torch.int32")),
    ("weights float16", dict(topk_weights=torch.zeros(TOKENS, TOPK, dtype=torch.float16)), ValueError,
     "topk_weights: must be a 2-D tensor of torch.float32"),
    ("weights shape", dict(topk_weights=torch.zeros(TOKENS, TOPK + 1)), ValueError,
     r"topk_weights: must be float32 \[5, 4\] like topk_idx"),
    ("out shape", dict(out=_bf16(TOKENS + 1, HIDDEN)), ValueError, r"out: must be \[5, 256\], got \[6, 256\]"),
    ("out float32", dict(out=torch.zeros(TOKENS, HIDDEN)), ValueError, "out: must be a 2-D tensor of torch.bfloat16"),
    ("async and hook", dict(async_finish=True), ValueError,
     "low_latency_combine: async_finish and return_recv_hook cannot both be True"),
]


@pytest.mark.parametrize(("case", "kw", "error", "match"), COMBINE_ERRORS, ids=[c[0] for c in COMBINE_ERRORS])
def test_combine_argument_checks(ll: Buffer, launches: list, dispatched: tuple, case: str, kw: dict, error: type,
                                 match: str) -> None:
    handle, topk_idx = dispatched
    args = dict(x=_bf16(EXPERTS, T_MAX, HIDDEN), topk_idx=topk_idx, topk_weights=torch.ones(TOKENS, TOPK),
                handle=handle, return_recv_hook=True)
    args.update(kw)
    with pytest.raises(error, match=match):
        ll.low_latency_combine(**args)
    assert launches == []


@pytest.mark.parametrize(("args", "kwargs", "message"), [
    ((1,), {}, "num_nvl_bytes must be a multiple of 128 bytes .*got 1$"),
    (((1 << 20) + 64,), {}, "num_nvl_bytes must be a multiple of 128 bytes .*got 1048640"),
    ((0, HEADER_BYTES + 1), {"low_latency_mode": True}, "num_rdma_bytes must be a multiple of 128 bytes .*got 18433"),
    ((0, 100), {}, "num_rdma_bytes must be a multiple of 128 bytes .*got 100"),
    ((C_INT_MAX + 1, 128), {}, f"num_nvl_bytes above {C_INT_MAX} \\(a C int\\) needs num_rdma_bytes=0"),
    ((0, C_INT_MAX + 1), {}, f"num_rdma_bytes above {C_INT_MAX} \\(a C int\\) needs low_latency_mode=True"),
])
def test_byte_counts_follow_deepeps_rules_before_any_allocation(group: dist.ProcessGroup, args: tuple,
                                                               kwargs: dict, message: str) -> None:
    """DeepEP's Buffer asserts both byte counts are multiples of NUM_BUFFER_ALIGNMENT_BYTES (128), num_nvl_bytes above
    a C int only without RDMA bytes, num_rdma_bytes above one only in low-latency mode: the facade refuses the same
    values, naming the argument, before it allocates a workspace (the refused sizes reach no CUDA call here)."""
    with pytest.raises(ValueError, match=f"^Buffer: {message}"):
        Buffer(group, *args, **kwargs)


@pytest.mark.parametrize("sizes", [(1, 128, 1, 2), (3, 7168, 3, 9), (128, 7168, 8, 256), (7, 2048, 5, 40)])
def test_the_size_hints_are_byte_counts_a_buffer_takes(sizes: tuple[int, int, int, int]) -> None:
    """Both hints return multiples of 128, as DeepEP's do, so a Buffer sized by them passes its alignment rule."""
    tokens, hidden, ranks, experts = sizes
    assert Buffer.get_low_latency_rdma_size_hint(tokens, hidden, ranks, experts) % BUFFER_ALIGNMENT_BYTES == 0
    for num_sms in (2, 20, 24):
        hint = Config(num_sms, 6, 256).get_nvl_buffer_size_hint(hidden * 2 + 1, min(ranks, 8))
        assert hint % BUFFER_ALIGNMENT_BYTES == 0
