"""Every driver launch of the ``deep_ep`` facade's normal mode, byte for byte, on the host: over a sequence of varied
``get_dispatch_layout`` / ``dispatch`` (BF16 and FP8, uncached, ``num_worst_tokens``, cached) / ``combine`` calls on
one and two ranks (different token counts, with and without top-k, biases, async flags, a grid bound by the rank's
share of the GPU, a spin timeout changed between calls), each launch's kernel, grid, block, shared memory, stream,
peer table and ``EpNormalParams`` bytes equal what the test builds itself, field by field, from DeepEP's rules and
the kernels' contract (kernels/sm90/ep_normal_params.cuh), in the calls' launch order.

Only the driver is replaced (the kernel load, ``cuLaunchKernel``, ``cuStreamQuery``, torch's current stream and
capture check, the events); the workspace is a CPU stand-in whose device reads as CUDA for the launch boundary's GPU
check alone. The fake notify kernel writes the host record of counts that the uncached dispatch reads after its CPU
wait, and the call's tag after them, so the received row counts (and the outputs' pointers the parameters carry) are
the test's choice.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from cuda.bindings import driver
from normal_host_kit import lift_gpu_refusal

from gc_moe_compat.comm import ep_normal
from gc_moe_compat.comm.ep_normal import EpNormalParams, HostRecord
from gc_moe_compat.deep_ep import Buffer, Config, EventOverlap, _normal
from gc_moe_compat.runtime import jit
from gc_moe_compat.runtime.status import STATUS_TIMEOUT, DeviceCheckError, DeviceTimeoutError, KernelStatus
from gc_moe_compat.runtime.workspace import PeerTable

NAMES = ("gc_ep_normal_layout", "gc_ep_normal_notify", "gc_ep_normal_dispatch", "gc_ep_normal_combine",
         "gc_ep_normal_combine_heads")
LAYOUT, NOTIFY, DISPATCH, COMBINE, _ = NAMES
FIXED_OFFSETS = dict(off_arrive=0, off_ready=1024, off_released=2048, off_status=3072, off_layout_arrive=3328,
                     off_notify_arrive=3336, off_send_arrive=3344, off_recv_arrive=3352, off_scratch=3584)
"""The fixed header's words (kernels/sm90/ep_normal.cu reads them at these offsets)."""
HEADER = 12288
STREAM = 0x5000
NVL_BYTES = 8 << 20
H = 256


def align(value: int, to: int) -> int:
    return -(-value // to) * to


def ptr(t: torch.Tensor | None) -> int:
    """A pointer field: 0 for no tensor or an empty one."""
    return 0 if t is None or t.numel() == 0 else t.data_ptr()


def transient(ranks: int, local: int, channels: int) -> dict[str, int]:
    """The call's counts after the header (each 16-byte aligned), then the data region (256-byte aligned)."""
    experts = HEADER + align(4 * ranks * ranks, 16)
    chan = experts + align(4 * ranks * local, 16)
    return dict(off_counts=HEADER, off_expert_counts=experts, off_recv_chan=chan,
                off_data=align(chan + 4 * ranks * channels, 256))


@dataclass(frozen=True)
class Launch:
    """One ``cuLaunchKernel`` as the driver sees it."""

    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared: int
    stream: int
    extra: int
    table: bytes
    params: bytes

    def fields(self) -> dict[str, int]:
        params = EpNormalParams.from_buffer_copy(self.params)
        return {name: getattr(params, name) for name, _ in EpNormalParams._fields_}


class FakeDriver:
    """Records every launch (its arguments read when it is made: the driver copies them then) and plays the notify
    kernel's part of writing ``record`` (the host counts) where its parameters point."""

    def __init__(self) -> None:
        self.launches: list[Launch] = []
        self.record: list[int] = []
        self.tag = True  # whether notify stores the call's tag (False: its wait for a peer failed)
        self.notify_status: KernelStatus | None = None  # what notify then mirrors into its status record
        self.waits = 0

    def kernel(self, name: str) -> jit.Kernel:
        return jit.Kernel(name, "host", driver.CUkernel(NAMES.index(name) + 1), None)

    def launch(self, function: driver.CUkernel, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shared: int,
               stream: driver.CUstream, args: int, extra: int) -> tuple:
        table = ctypes.string_at(ctypes.c_void_p.from_address(args).value, ctypes.sizeof(PeerTable))
        params = ctypes.string_at(ctypes.c_void_p.from_address(args + 8).value, ctypes.sizeof(EpNormalParams))
        launch = Launch(NAMES[int(function) - 1], (gx, gy, gz), (bx, by, bz), shared, int(stream), extra, table,
                        params)
        if launch.kernel == NOTIFY:  # the counts, then the tag (the call's op), as the kernel stores them
            fields = launch.fields()
            words = (ctypes.c_int32 * len(self.record))(*self.record)
            ctypes.memmove(fields["host_counts"] + 4 * HostRecord.RECV, words, ctypes.sizeof(words))
            if self.tag:
                ctypes.c_int64.from_address(fields["host_counts"] + 4 * HostRecord.TAG).value = fields["op"]
            elif self.notify_status is not None:
                size = ctypes.sizeof(KernelStatus)
                ctypes.memmove(fields["status_mirror"] + size * ep_normal.Kernel.NOTIFY, bytes(self.notify_status),
                               size)
        self.launches.append(launch)
        return (driver.CUresult.CUDA_SUCCESS,)


class FakeEvent:
    """What the calls use of DeepEP's ``EventHandle`` (with the partition off): the caller's stream waits on it."""

    def __init__(self, fake: FakeDriver | None = None) -> None:
        self.fake = fake

    def current_stream_wait(self) -> None:
        if self.fake is not None:
            self.fake.waits += 1


class HostWorkspace:
    """CPU stand-in for ``SymmetricWorkspace`` of ``ranks`` ranks seen from rank 0, with a peer table of its own
    bytes (each launch must pass them)."""

    def __init__(self, size: int, ranks: int) -> None:
        self.device, self.world_size, self.rank = torch.device("cpu"), ranks, 0
        self.buffer = torch.zeros(size, dtype=torch.uint8)
        self.peer_table = PeerTable(base=0x7000_0000 + ranks, rank=0, world_size=ranks)
        for r in range(ranks):
            self.peer_table.offsets[r] = r << 30
        self.placement, self.sm_share = None, 132

    def region(self, name: str) -> torch.Tensor:
        return self.buffer


def install_fakes(monkeypatch: pytest.MonkeyPatch) -> FakeDriver:
    """The driver stand-ins, the default host path; the normal mode's workspace device reads as CUDA inside its
    launch boundary only (the caller clears ``ep_normal.kernel_of``'s cache afterwards)."""
    fake = FakeDriver()
    monkeypatch.setattr(jit, "load_module", lambda source, *args, **kwargs: fake)
    monkeypatch.setattr(driver, "cuLaunchKernel", fake.launch)
    monkeypatch.setattr(driver, "cuStreamQuery", lambda stream: (driver.CUresult.CUDA_SUCCESS,))
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: STREAM, raising=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(_normal, "EventHandle", FakeEvent)
    for name in ("GC_MOE_DEEP_EP_PARTITION", "GC_MOE_SPIN_TIMEOUT_MS", "GC_MOE_DEEP_EP_HOST_PATH"):
        monkeypatch.delenv(name, raising=False)
    lift_gpu_refusal(monkeypatch.setattr)
    ep_normal.kernel_of.cache_clear()
    return fake


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeDriver]:
    yield install_fakes(monkeypatch)
    ep_normal.kernel_of.cache_clear()


class Session:
    """One Buffer of ``ranks`` ranks (its grids bounded by ``grid_cap``), its calls, and for each the launches the
    test expects: the collective-op number, the spin timeout, every pointer and size, set field by field."""

    def __init__(self, group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch, fake: FakeDriver, ranks: int,
                 grid_cap: int | None = None) -> None:
        monkeypatch.setattr(_normal, "SymmetricWorkspace",
                            lambda layout, group=None, device=None, where=None: HostWorkspace(layout.size, ranks))
        self.buf = Buffer(group, NVL_BYTES, 0)
        self.mode = self.buf.normal
        if grid_cap is not None:
            self.mode.grid_cap = grid_cap
        self.cap = self.mode.grid_cap
        self.fake, self.ranks, self.op, self.timeout_ns = fake, ranks, 0, 10_000_000_000
        self.table = bytes(self.mode.workspace.peer_table)
        self.host_counts: dict[int, int] = {}
        self.calls = 0

    def gen(self, seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    def params(self, **fields: int) -> bytes:
        return bytes(EpNormalParams(**FIXED_OFFSETS, timeout_ns=self.timeout_ns,
                                    status_mirror=self.mode.mirror.data_ptr(), **fields))

    def launch(self, kernel: str, grid: int, params: bytes) -> Launch:
        return Launch(kernel, (max(1, min(grid, self.cap)), 1, 1), (ep_normal.THREADS, 1, 1), 0, STREAM, 0, self.table,
                      params)

    def check(self, what: str, expected: list[Launch]) -> None:
        got, self.fake.launches = self.fake.launches, []
        self.calls += 1
        assert [(g.kernel, g.grid) for g in got] == [(e.kernel, e.grid) for e in expected], what
        for g, e in zip(got, expected, strict=True):
            if g != e:
                diff = {k: (v, e.fields()[k]) for k, v in g.fields().items() if v != e.fields()[k]}
                raise AssertionError(f"{what}: {g.kernel} launch differs (got, expected): {diff or 'not in params'}")

    # -- calls ------------------------------------------------------------------------------------------------------

    def layout(self, tokens: int, topk: int, experts: int, **flags: object) -> tuple:
        idx = torch.randint(-1, experts, (tokens, topk), generator=self.gen(tokens + topk), dtype=torch.int64)
        out = self.buf.get_dispatch_layout(idx, experts, **flags)
        per_rank, _, per_expert, in_rank, _ = out
        fields = dict(**transient(self.ranks, experts // self.ranks, 1), data_rows=0, topk_idx=ptr(idx),
                      is_token_in_rank=ptr(in_rank), num_tokens_per_rank=per_rank.data_ptr(),
                      num_tokens_per_expert=per_expert.data_ptr(), num_tokens=tokens, topk=topk, num_experts=experts,
                      local_experts=experts // self.ranks)
        grid = min(Buffer.num_sms, -(-tokens // ep_normal.THREADS))
        self.check(f"get_dispatch_layout T={tokens} k={topk}", [self.launch(LAYOUT, grid, self.params(**fields))])
        return idx, out

    def dispatch(self, tokens: int, topk: int, experts: int, *, sms: int = 8, fp8: str | None = None,
                 scales: int = 2, recv: int = 0, align_to: int = 1, worst: int = 0, **flags: object) -> tuple:
        """An uncached dispatch of ``tokens`` rows (FP8 with ``scales`` columns of ``fp8`` = ``"f32"``, ``"i32"`` or
        ``"f32-colmajor"``), ``recv`` rows received (the notify record's; ``worst`` instead when > 0)."""
        ranks, local, channels = self.ranks, experts // self.ranks, sms // 2
        g = self.gen(7 * tokens + topk)
        x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
        payload, sc = x, None
        if fp8 is not None:
            payload = x.to(torch.float8_e4m3fn)
            sc = torch.rand(scales, tokens, generator=g).t() if fp8 == "f32-colmajor" else \
                torch.randint(0, 1 << 20, (tokens, scales), generator=g, dtype=torch.int32) if fp8 == "i32" else \
                torch.rand(tokens, scales, generator=g)
        idx = torch.randint(-1, experts, (tokens, topk), generator=g) if topk else None
        w = torch.rand(tokens, topk, generator=g) if topk else None
        in_rank = torch.rand(tokens, ranks, generator=g) < 0.5
        per_rank = in_rank.sum(0).to(torch.int32)
        per_expert = torch.randint(0, 9, (experts,), generator=g, dtype=torch.int32)
        expert_counts = [int(c) for c in torch.randint(0, 50, (local,), generator=g)]
        most_recv, most_sent = recv + 3, 2 * tokens + 1
        self.fake.record = [recv, most_recv, most_sent, *expert_counts]
        x_arg = payload if sc is None else (payload, sc)
        out = self.buf.dispatch(x_arg, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w,
                                expert_alignment=align_to, num_worst_tokens=worst, config=Config(sms, 6, 256),
                                **flags)
        recv_x, recv_idx, recv_w, expert_list, handle, _ = out
        rows = worst or recv
        recv_payload, recv_scales = recv_x if sc is not None else (recv_x, None)
        assert recv_payload.shape == (rows, H) and handle[3].shape == (rows,)
        assert expert_list == ([] if worst else expert_counts)
        assert handle.most_sent == (None if worst else most_sent)
        row_bytes, num_scales, k = H * payload.element_size(), 0 if sc is None else scales, topk if idx is not None \
            else 0
        top = 16 + row_bytes + align(4 * num_scales, 16)
        stride = align(top + 12 * k, 16)
        t = transient(ranks, local, channels)
        common = dict(**t, data_rows=(NVL_BYTES - t["off_data"]) // stride, op=self.next_op(),
                      num_tokens=tokens, num_channels=channels, num_experts=experts, local_experts=local)
        rank_prefix, channel_prefix, recv_channel_prefix, recv_src_idx, _, send_head = handle
        assert handle[4] is in_rank
        host_counts = self.host_counts.setdefault(local, self.fake.launches[0].fields()["host_counts"])
        notify = self.params(**common, num_tokens_per_rank=per_rank.data_ptr(),
                             num_tokens_per_expert=per_expert.data_ptr(), is_token_in_rank=ptr(in_rank),
                             rank_prefix=rank_prefix.data_ptr(), channel_prefix=channel_prefix.data_ptr(),
                             send_head=ptr(send_head), host_counts=host_counts, expert_alignment=align_to)
        send = self.params(
            **common, x=ptr(payload), x_scales=ptr(sc), topk_idx=ptr(idx), topk_weights=ptr(w),
            rank_prefix=rank_prefix.data_ptr(), channel_prefix=channel_prefix.data_ptr(),
            recv_channel_prefix=ptr(recv_channel_prefix), send_head=ptr(send_head), recv_x=ptr(recv_payload),
            recv_scales=ptr(recv_scales), recv_topk_idx=ptr(recv_idx), recv_topk_weights=ptr(recv_w),
            recv_src_idx=ptr(recv_src_idx), hidden=H, row_bytes=row_bytes, row_stride=stride,
            off_row_scales=16 + row_bytes, off_row_topk=top, num_scales=num_scales,
            scale_token_stride=0 if sc is None else sc.stride(0), scale_hidden_stride=0 if sc is None else sc.stride(1),
            topk=k, recv_rows=rows)
        self.check(f"dispatch T={tokens} k={topk} fp8={fp8} recv={rows}",
                   [self.launch(NOTIFY, 1 + -(-ranks * channels // 8), notify),
                    self.launch(DISPATCH, sms, send)])
        return x_arg, out

    def cached(self, x: object, handle: tuple, sms: int = 8, **flags: object) -> tuple:
        """A cached dispatch of ``x`` on ``handle``; its ``recv_src_idx`` (a fresh tensor the call does not return)
        is the one pointer read from the launch: 0 exactly when no row is received."""
        ranks, channels = self.ranks, sms // 2
        out = self.buf.dispatch(x, handle, config=Config(sms, 6, 256), **flags)
        assert out[1:5] == (None, None, None, None)
        payload, sc = x if isinstance(x, tuple) else (x, None)
        recv_payload, recv_scales = out[0] if sc is not None else (out[0], None)
        rank_prefix, channel_prefix, _, recv_src_idx, _, send_head = handle
        rows = recv_src_idx.shape[0]
        recv_src = self.fake.launches[0].fields()["recv_src_idx"]
        assert (recv_src == 0) == (rows == 0) and (rows == 0 or recv_src != recv_src_idx.data_ptr())
        row_bytes, num_scales = H * payload.element_size(), 0 if sc is None else sc.shape[1]
        top = 16 + row_bytes + align(4 * num_scales, 16)
        t = transient(ranks, 1, channels)
        send = self.params(
            **t, data_rows=(NVL_BYTES - t["off_data"]) // top, op=self.next_op(), num_tokens=send_head.shape[0],
            num_channels=channels, num_experts=ranks, local_experts=1, x=ptr(payload), x_scales=ptr(sc),
            rank_prefix=rank_prefix.data_ptr(), channel_prefix=channel_prefix.data_ptr(), send_head=ptr(send_head),
            recv_x=ptr(recv_payload), recv_scales=ptr(recv_scales), recv_src_idx=recv_src, hidden=H,
            row_bytes=row_bytes, row_stride=top, off_row_scales=16 + row_bytes, off_row_topk=top,
            num_scales=num_scales, scale_token_stride=0 if sc is None else sc.stride(0),
            scale_hidden_stride=0 if sc is None else sc.stride(1), recv_rows=rows)
        self.check(f"cached dispatch rows={rows} fp8={sc is not None}",
                   [self.launch(DISPATCH, sms, send)])
        return out

    def combine(self, handle: tuple, sms: int = 8, topk: int = 0, bias: object = None, **flags: object) -> tuple:
        """A combine of the handle's received rows, with ``topk`` weight columns (0: none) and ``bias``: None, or
        ``"0"`` / ``"01"`` / ``"1"`` / ``"tensor"`` for which biases are given."""
        ranks, channels = self.ranks, sms // 2
        rank_prefix, channel_prefix, _, recv_src_idx, _, send_head = handle
        rows, tokens = recv_src_idx.shape[0], send_head.shape[0]
        g = self.gen(rows + 31 * topk)
        x = torch.randn(rows, H, generator=g).to(torch.bfloat16)
        w = torch.rand(rows, topk, generator=g) if topk else None
        b0, b1 = (torch.randn(tokens, H, generator=g).to(torch.bfloat16) for _ in range(2))
        biases = {None: (None, None), "tensor": (b0, None), "0": (b0, None), "1": (None, b1), "01": (b0, b1)}[bias]
        bias_arg = None if bias is None else b0 if bias == "tensor" else biases
        out, out_w, _ = self.buf.combine(x, handle, w, bias_arg, config=Config(sms, 6, 256), **flags)
        assert out.shape == (tokens, H) and (out_w is None) == (w is None)
        stride = align(2 * H + 4 * topk, 16)
        t = transient(ranks, 1, channels)
        params = self.params(
            **t, data_rows=(NVL_BYTES - t["off_data"]) // stride, op=self.next_op(), x=ptr(x), topk_weights=ptr(w),
            rank_prefix=rank_prefix.data_ptr(), channel_prefix=channel_prefix.data_ptr(), send_head=ptr(send_head),
            out=ptr(out), out_topk_weights=ptr(out_w), bias_0=ptr(biases[0]), bias_1=ptr(biases[1]),
            num_tokens=tokens, hidden=H, row_bytes=2 * H, row_stride=stride, off_row_topk=2 * H, topk=topk,
            num_channels=channels, recv_rows=rows)
        self.check(f"combine rows={rows} k={topk} bias={bias}",
                   [self.launch(COMBINE, sms, params)])
        return out, out_w

    def next_op(self) -> int:
        self.op += 1
        return self.op


def calls(s: Session, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sequence of calls, each checked as it is made."""
    experts = 8 * s.ranks
    for tokens, topk in ((0, 4), (1, 1), (257, 8), (700, 3), (6000, 2)):
        s.layout(tokens, topk, experts)
    s.layout(33, 4, experts, async_finish=True)
    s.layout(33, 4, experts, previous_event=EventOverlap(FakeEvent(s.fake)), async_finish=True,
             allocate_on_comm_stream=True)
    handles = []
    for tokens, topk, fp8, recv, sms in ((5, 4, None, 9, 8), (5, 4, None, 0, 8), (0, 4, None, 6, 8),
                                         (300, 8, "f32", 420, 24), (300, 8, "i32", 17, 24),
                                         (64, 2, "f32-colmajor", 100, 2), (64, 0, None, 40, 8),
                                         (64, 0, "f32", 40, 40), (129, 32, None, 200, 8), (5, 4, None, 9, 8)):
        x, out = s.dispatch(tokens, topk, experts, sms=sms, fp8=fp8, scales=3 if fp8 else 2, recv=recv)
        handles.append((x, out[4], sms, topk))
    s.dispatch(64, 4, experts, sms=8, recv=10, align_to=128)
    worst_x, worst = s.dispatch(64, 4, experts, sms=8, worst=77)
    s.dispatch(64, 4, experts, sms=8, fp8="f32", worst=5, async_finish=True)
    s.dispatch(64, 4, experts, sms=8, recv=3, previous_event=EventOverlap(FakeEvent(s.fake)),
               async_finish=True, allocate_on_comm_stream=True)
    monkeypatch.setenv("GC_MOE_SPIN_TIMEOUT_MS", "2500")  # read at each call: the next call's timeout
    s.timeout_ns = 2_500_000_000
    s.layout(40, 4, experts)
    s.dispatch(5, 4, experts, recv=9)
    monkeypatch.setenv("GC_MOE_SPIN_TIMEOUT_MS", "0.5")
    s.timeout_ns = 500_000
    s.dispatch(5, 4, experts, recv=9)
    monkeypatch.delenv("GC_MOE_SPIN_TIMEOUT_MS")
    s.timeout_ns = 10_000_000_000
    for (x, handle, sms, topk), bias in zip(handles, (None, "tensor", "0", "1", "01", None, None, "01", None, "01"),
                                             strict=True):
        s.cached(x, handle, sms)
        s.combine(handle, sms, topk=min(topk, 4), bias=bias)
    x, handle, sms, topk = handles[0]
    s.combine(handle, sms, topk=topk, async_finish=True)
    s.combine(handle, sms, previous_event=EventOverlap(FakeEvent(s.fake)), async_finish=True,
              allocate_on_comm_stream=True)
    s.cached(x, handle, sms, async_finish=True)
    s.combine(handle, sms, topk=topk)  # a second combine on the handle; its shape's previous call had biases
    s.cached(worst_x, worst[4])  # a num_worst_tokens handle: no received count to check the combine against
    s.combine(worst[4], topk=4)
    s.combine(handles[8][1], handles[8][2], topk=32)


@pytest.mark.parametrize(("ranks", "grid_cap"), [(1, None), (2, None), (2, 4)], ids=["1rank", "2ranks", "2ranks-cap4"])
def test_every_launch_is_the_expected_one(group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch,
                                          fake: FakeDriver, ranks: int, grid_cap: int | None) -> None:
    """~50 calls of every kind; each one's launches are the expected ones, byte for byte and in order (with a grid
    cap of 4: every grid bounded by it); the waits on previous events are the calls' (one each)."""
    s = Session(group, monkeypatch, fake, ranks, grid_cap)
    calls(s, monkeypatch)
    assert s.calls >= 50
    assert fake.waits == 3
    assert len(s.host_counts) == 1  # one host record per local-expert count, reused by every uncached dispatch


def test_a_notify_without_its_tag_raises(group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch,
                                         fake: FakeDriver) -> None:
    """A notify that ends without storing the call's tag (the stream ran dry): the dispatch raises the error notify
    recorded (here a spin timeout on rank 1, as the kernel mirrors it), or, with none recorded, a DeviceCheckError
    naming the protocol error; no transfer is launched and the next call works."""
    s = Session(group, monkeypatch, fake, 2)
    s.dispatch(5, 4, 16, recv=9)
    fake.tag = False
    fake.notify_status = KernelStatus(code=STATUS_TIMEOUT, site=ep_normal.NormalSite.ARRIVE << 16 | 1, observed=3,
                                      expected=4)
    with pytest.raises(DeviceTimeoutError, match="gc_ep_normal_notify.*rank 1's token counts"):
        s.dispatch(5, 4, 16, recv=9)
    fake.notify_status = None
    with pytest.raises(DeviceCheckError, match="finished without storing the received counts"):
        s.dispatch(5, 4, 16, recv=9)
    assert [launch.kernel for launch in fake.launches] == [NOTIFY, NOTIFY]
    fake.launches, fake.tag, s.op = [], True, s.mode.op
    s.dispatch(5, 4, 16, recv=9)


def test_each_call_launches_on_the_callers_current_stream(group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch,
                                                          fake: FakeDriver) -> None:
    """The partition-off calls keep one stream object per caller stream: a call after the current stream changed
    launches on the new one, and back."""
    s = Session(group, monkeypatch, fake, 1)
    for current in (STREAM, 0x6000, STREAM):
        monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index, current=current: current,
                            raising=False)
        fake.launches = []
        s.buf.get_dispatch_layout(torch.zeros(4, 2, dtype=torch.int64), 8)
        assert [launch.stream for launch in fake.launches] == [current]
    assert sorted(s.mode._off_streams) == [STREAM, 0x6000]


def test_graph_capture_is_refused_before_any_launch(group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch,
                                                    fake: FakeDriver) -> None:
    """Under a CUDA graph capture every normal-mode call raises NotImplementedError naming it (DeepEP captures each
    of these: they make no CPU wait), before any launch and without taking an op number; after the capture the calls
    run as before."""
    s = Session(group, monkeypatch, fake, 2)
    x, out = s.dispatch(5, 4, 16, recv=9)
    handle, op, config = out[4], s.mode.op, Config(8, 6, 256)
    in_rank = torch.ones(5, 2, dtype=torch.bool)
    idx, w = torch.zeros(5, 4, dtype=torch.int64), torch.rand(5, 4)
    worst = dict(num_tokens_per_rank=in_rank.sum(0).to(torch.int32), is_token_in_rank=in_rank,
                 num_tokens_per_expert=torch.zeros(16, dtype=torch.int32), topk_idx=idx, topk_weights=w,
                 num_worst_tokens=12, config=config)
    refused = {
        "get_dispatch_layout": lambda: s.buf.get_dispatch_layout(idx, 16),
        "dispatch": lambda: s.buf.dispatch(x, **worst),
        "cached dispatch": lambda: s.buf.dispatch(x, handle, config=config),
        "combine": lambda: s.buf.combine(torch.zeros(9, H, dtype=torch.bfloat16), handle, config=config),
    }
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    for what, call in refused.items():
        fn = what.split()[-1]
        with pytest.raises(NotImplementedError, match=f"^{fn}: CUDA graph capture of normal-mode calls is not "
                                                      "implemented \\(DeepEP's calls but an uncached dispatch "
                                                      "without num_worst_tokens make no CPU wait"):
            call()
    assert fake.launches == [] and s.mode.op == op
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    s.combine(handle)
    s.dispatch(5, 4, 16, worst=12)
