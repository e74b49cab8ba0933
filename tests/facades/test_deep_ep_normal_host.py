"""The ``deep_ep`` facade's normal mode on the host: the kernels build for sm_90a, the generated parameter header, the
configs and size hints (DeepEP's numbers), and every argument check of get_dispatch_layout / dispatch / combine
(TypeError / ValueError naming the argument, the rule and the value) before any launch. The workspace is a CPU
stand-in; the kernels are the GPU tests' (tests/facades/test_deep_ep_normal.py)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from compiled_host_kit import misaligned, unaligned
from ctypes_layout import natural_layout_size
from nvcc_mark import needs_nvcc

from gc_moe_compat.comm import ep_normal
from gc_moe_compat.deep_ep import Buffer, Config, EventOverlap, _normal
from gc_moe_compat.runtime import jit
from gc_moe_compat.runtime.status import DeviceTimeoutError
from gc_moe_compat.runtime.workspace import PeerTable

HEADER = Path(__file__).resolve().parents[2] / "kernels" / "sm90" / "ep_normal_params.cuh"
T, H, K, E = 6, 256, 4, 8


class FakeWorkspace:
    """CPU stand-in for ``SymmetricWorkspace`` (what NormalMode reads)."""

    def __init__(self, layout: object, group: dist.ProcessGroup | None = None, device: object = None,
                 where: object = None) -> None:
        self.device = torch.device("cpu")
        self.world_size, self.rank = 1, 0
        self.buffer = torch.zeros(layout.size, dtype=torch.uint8)
        self.peer_table = PeerTable(base=0x1000, rank=0, world_size=1)

    def region(self, name: str) -> torch.Tensor:
        return self.buffer


@pytest.fixture
def buf(group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch) -> Buffer:
    monkeypatch.setattr(_normal, "SymmetricWorkspace", FakeWorkspace)

    def no_launch(*args: object) -> None:
        raise AssertionError("a bad call reached a launch")

    monkeypatch.setattr(_normal.NormalMode, "_begin", no_launch)
    return Buffer(group, 1 << 20, 0)


@needs_nvcc
def test_ep_normal_compiles_for_sm90a_without_spills(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GC_MOE_CACHE_DIR", str(tmp_path))
    resources = jit.compile_cubin(ep_normal.SOURCE).resources
    assert set(resources) == set(ep_normal.ENTRY_NAMES.values())
    assert f"constexpr u32 kThreads = {ep_normal.THREADS};" in (HEADER.parent / "ep_normal.cu").read_text()
    for name, res in resources.items():
        assert (res.stack_bytes, res.spill_stores, res.spill_loads) == (0, 0, 0), name
        assert res.registers * ep_normal.THREADS <= 65536 and res.shared_bytes < 48 * 1024, name


def test_params_header_is_generated_from_the_ctypes_struct() -> None:
    text = HEADER.read_text()
    block = text.split("// BEGIN GENERATED\n")[1].split("// END GENERATED")[0]
    assert block.rstrip("\n") == ep_normal.params_header().rstrip("\n")
    assert ctypes.sizeof(ep_normal.EpNormalParams) == natural_layout_size(ep_normal.EpNormalParams)


def test_configs_and_hints_are_deepeps() -> None:
    cfg = Buffer.get_dispatch_config(8)
    assert (cfg.num_sms, cfg.num_max_nvl_chunked_send_tokens, cfg.num_max_nvl_chunked_recv_tokens) == (20, 6, 256)
    assert Buffer.get_combine_config(8).num_max_nvl_chunked_send_tokens == 4
    assert vars(Buffer.get_dispatch_config(1)) == vars(Buffer.get_dispatch_config(2))  # one rank: the 2-rank entry
    with pytest.raises(ValueError, match=r"get_dispatch_config: num_ranks must be one of \[1, 2, 4, 8, .*got 3"):
        Buffer.get_dispatch_config(3)
    # every recommended config is what the checked constructor makes of its row, a new object at every call
    for table, get in ((_normal._DISPATCH, Buffer.get_dispatch_config), (_normal._COMBINE, Buffer.get_combine_config)):
        for ranks, chunks in table.items():
            made = get(ranks)
            assert type(made) is Config and vars(made) == vars(Config(Buffer.num_sms, *chunks)), ranks
            made.num_sms = 2
            assert get(ranks).num_sms == Buffer.num_sms
    with pytest.raises(TypeError, match="Config: num_sms must be an int"):
        _normal.combine_config(2, 24.0)
    with pytest.raises(ValueError, match="Config: num_sms must be in"):
        _normal.dispatch_config(2, -2)
    with pytest.raises(TypeError, match="get_combine_config: num_ranks must be an int"):
        Buffer.get_combine_config(True)
    # DeepEP's arithmetic: 12 channels x 8 ranks x 256 tokens x (hidden + 8 + 128 x (8 + 4 + 4)) + the queue words.
    assert Config(24, 8, 256).get_nvl_buffer_size_hint(7168 * 2, 8) == -(-(96 * 5 * 4 + 96 * 256 * 16392) // 128) * 128
    assert Config().get_rdma_buffer_size_hint(7168 * 2, 8) == 0
    with pytest.raises(NotImplementedError, match="NVSHMEM/RDMA"):
        Config().get_rdma_buffer_size_hint(7168 * 2, 16)
    with pytest.raises(TypeError, match="hidden_bytes must be an int"):
        Config().get_nvl_buffer_size_hint(1.5, 8)


TOPK_IDX_REFUSED = (r"^{fn}: topk_idx must be \[{rows}, \*\] of torch.int64 "
                    r"\(deep_ep.topk_idx_t, which DeepEP asserts\), got \[6, 4\] {dtype}$")
"""The refusal of a ``[6, 4]`` ``topk_idx`` of another dtype than DeepEP's ``topk_idx_t`` (int64)."""


def _layout_inputs() -> tuple[torch.Tensor, ...]:
    idx = torch.randint(-1, E, (T, K))
    x = torch.randn(T, H).to(torch.bfloat16)
    return x, idx, torch.zeros(1, dtype=torch.int32), torch.zeros(E, dtype=torch.int32), torch.zeros(T, 1,
                                                                                                       dtype=torch.bool)


def test_layout_checks(buf: Buffer) -> None:
    _, idx, *_ = _layout_inputs()
    cases = [
        (TypeError, "get_dispatch_layout: topk_idx must be a torch.Tensor, got list",
         lambda: buf.get_dispatch_layout([[0]], E)),
        (ValueError, TOPK_IDX_REFUSED.format(fn="get_dispatch_layout", rows=r"\*", dtype="torch.float32"),
         lambda: buf.get_dispatch_layout(idx.float(), E)),
        (ValueError, TOPK_IDX_REFUSED.format(fn="get_dispatch_layout", rows=r"\*", dtype="torch.int32"),
         lambda: buf.get_dispatch_layout(idx.int(), E)),
        (ValueError, "topk_idx must have 1 to 32 columns", lambda: buf.get_dispatch_layout(torch.zeros(2, 33,
                                                                                                         dtype=torch.int64),
                                                                                               E)),
        (TypeError, "num_experts must be an int, got float", lambda: buf.get_dispatch_layout(idx, 8.0)),
        (ValueError, r"num_experts must be in \[1, 2048\], got 0", lambda: buf.get_dispatch_layout(idx, 0)),
        (TypeError, "async_finish must be a bool, got str", lambda: buf.get_dispatch_layout(idx, E, async_finish="no")),
        (ValueError, "allocate_on_comm_stream=True needs a previous_event and async_finish=True",
         lambda: buf.get_dispatch_layout(idx, E, allocate_on_comm_stream=True)),
        (TypeError, "previous_event must be a deep_ep.EventOverlap", lambda: buf.get_dispatch_layout(idx, E,
                                                                                                  previous_event=1)),
        (ValueError, "topk_idx must be contiguous", lambda: buf.get_dispatch_layout(idx.T, E)),
    ]
    for error, needle, fn in cases:
        with pytest.raises(error, match=needle):
            fn()


def test_dispatch_checks(buf: Buffer) -> None:
    x, idx, per_rank, per_expert, in_rank = _layout_inputs()
    w = torch.rand(T, K)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    cfg = Config(8, 6, 256)
    cases = [
        (ValueError, r"dispatch: x must be \[\*, \*\] of torch.bfloat16, got \[6, 256\] torch.float32",
         dict(x=x.float(), **layout)),
        (ValueError, "x must be a BF16 tensor or a \\(FP8 tensor, scales\\) pair, got a tuple of 3",
         dict(x=(x, x, x), **layout)),
        (ValueError, r"x\[1\] must be \[6, \*\] of torch.float32 or torch.int32",
         dict(x=(x.to(torch.float8_e4m3fn), torch.zeros(T, 2, dtype=torch.float16)), **layout)),
        (ValueError, "hidden size in bytes must be a positive multiple of 16, got 12",
         dict(x=torch.zeros(T, 6, dtype=torch.bfloat16), **layout)),
        (ValueError, "an uncached dispatch needs is_token_in_rank", dict(x=x, num_tokens_per_rank=per_rank,
                                                                         num_tokens_per_expert=per_expert)),
        (ValueError, r"is_token_in_rank must be \[6, 1\] of torch.bool", dict(x=x, **{**layout,
                                                                                   "is_token_in_rank": in_rank[:2]})),
        (ValueError, "topk_idx and topk_weights go together", dict(x=x, topk_idx=idx, **layout)),
        (ValueError, TOPK_IDX_REFUSED.format(fn="dispatch", rows=T, dtype="torch.int32"),
         dict(x=x, topk_idx=idx.int(), topk_weights=w, **layout)),
        (ValueError, r"topk_weights must be \[6, 4\] of torch.float32", dict(x=x, topk_idx=idx, topk_weights=w[:, :2],
                                                                           **layout)),
        (ValueError, "num_worst_tokens > 0 needs topk_idx and topk_weights", dict(x=x, num_worst_tokens=4, **layout)),
        (ValueError, r"num_worst_tokens must be in \[0, ", dict(x=x, num_worst_tokens=-1, **layout)),
        (TypeError, "expert_alignment must be an int, got float", dict(x=x, expert_alignment=1.0, **layout)),
        (ValueError, r"expert_alignment must be in \[1, ", dict(x=x, expert_alignment=0, **layout)),
        (NotImplementedError, "num_tokens_per_rdma_rank .*NVSHMEM/RDMA",
         dict(x=x, num_tokens_per_rdma_rank=per_rank, **layout)),
        (TypeError, "config must be a deep_ep.Config, got dict", dict(x=x, config={}, **layout)),
        (TypeError, "handle must be the handle an uncached dispatch returned, got tuple", dict(x=x, handle=(1,))),
    ]
    for error, needle, kwargs in cases:
        with pytest.raises(error, match=needle):
            buf.dispatch(**{"config": cfg, **kwargs})
    # at one rank the rows go from x straight into the outputs (no data region), so num_worst_tokens past
    # num_nvl_bytes is no refusal there, as with DeepEP (two ranks: test_deep_ep_normal_growth.py)
    with pytest.raises(AssertionError, match="a bad call reached a launch"):
        buf.dispatch(x, topk_idx=idx, topk_weights=w, num_worst_tokens=1 << 14, config=cfg, **layout)
    with pytest.raises(ValueError, match=r"config.num_sms must be an even int in \[2, 1024\] .* got 7"):
        buf.dispatch(x, config=Config(7, 6, 256), **layout)


def test_combine_checks(buf: Buffer) -> None:
    rows, tokens = 5, T
    handle = _normal.NormalHandle((torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, 4, dtype=torch.int32),
                                   torch.zeros(1, 4, dtype=torch.int32), torch.zeros(rows, dtype=torch.int32),
                                   torch.zeros(tokens, 1, dtype=torch.bool), torch.zeros(tokens, 1, dtype=torch.int32)),
                                  most_sent=rows)
    x = torch.zeros(rows, H, dtype=torch.bfloat16)
    cfg = Config(8, 6, 256)
    cases = [
        (TypeError, "combine: handle must be the handle dispatch returned, got tuple", dict(x=x, handle=tuple(handle))),
        (ValueError, r"x must be \[5, \*\] of torch.bfloat16, got \[4, 256\]", dict(x=x[:4], handle=handle)),
        (ValueError, r"config.num_sms must be the dispatch's \(2 x 4 channels\), got 4",
         dict(x=x, handle=handle, config=Config(4, 2, 256))),
        (ValueError, r"topk_weights must be \[5, \*\] of torch.float32", dict(x=x, handle=handle,
                                                                            topk_weights=torch.zeros(4, K))),
        (TypeError, "bias must be None, a tensor or a pair of tensors, got list", dict(x=x, handle=handle, bias=[x])),
        (ValueError, r"bias\[1\] must be \[6, 256\] of torch.bfloat16", dict(x=x, handle=handle,
                                                                           bias=(None, torch.zeros(2, H)))),
        (ValueError, r"hidden size must be a positive multiple of 8 \(16-byte rows\), got 4",
         dict(x=torch.zeros(rows, 4, dtype=torch.bfloat16), handle=handle)),
        (ValueError, "allocate_on_comm_stream=True needs a previous_event", dict(x=x, handle=handle,
                                                                              allocate_on_comm_stream=True)),
    ]
    for error, needle, kwargs in cases:
        with pytest.raises(error, match=needle):
            buf.combine(**{"config": cfg, **kwargs})
    assert isinstance(EventOverlap(None), EventOverlap)


def _off_16(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values one element past a 16-byte boundary (a row slice's address)."""
    return misaligned(tuple(t.shape), t.dtype).copy_(t)


def test_routing_row_slices_reach_the_launch(buf: Buffer) -> None:
    """The kernels read the routing and the counts element by element, so a tensor 4 or 8 bytes past a 16-byte
    boundary (a row slice of a top-6 batch, as SGLang's two-batch overlap makes) is accepted, as by DeepEP: the
    calls get past every check to the launch."""
    x, idx, per_rank, per_expert, in_rank = _layout_inputs()
    w = torch.rand(T, K)
    for call in (lambda: buf.get_dispatch_layout(_off_16(idx), E),
                 lambda: buf.dispatch(x, num_tokens_per_rank=_off_16(per_rank), is_token_in_rank=_off_16(in_rank),
                                      num_tokens_per_expert=_off_16(per_expert), topk_idx=_off_16(idx),
                                      topk_weights=_off_16(w), config=Config(8, 6, 256))):
        with pytest.raises(AssertionError, match="a bad call reached a launch"):
            call()
    rows = 5
    handle = _normal.NormalHandle((torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, 4, dtype=torch.int32),
                                   torch.zeros(1, 4, dtype=torch.int32), torch.zeros(rows, dtype=torch.int32),
                                   torch.zeros(T, 1, dtype=torch.bool), torch.zeros(T, 1, dtype=torch.int32)),
                                  most_sent=rows)
    with pytest.raises(AssertionError, match="a bad call reached a launch"):
        buf.combine(torch.zeros(rows, H, dtype=torch.bfloat16), handle, topk_weights=_off_16(torch.rand(rows, K)),
                    config=Config(8, 6, 256))
    with pytest.raises(ValueError, match="x must be 16-byte aligned"):  # rows read by 16-byte vectors
        buf.dispatch(_off_16(x), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                     num_tokens_per_expert=per_expert, config=Config(8, 6, 256))
    # the handle holds the dispatch's is_token_in_rank itself: a row slice there serves a cached dispatch too
    sliced = _normal.NormalHandle((*handle[:4], _off_16(torch.ones(T, 1, dtype=torch.bool))[1:],
                                   torch.zeros(T - 1, 1, dtype=torch.int32)), most_sent=rows)
    assert sliced[4].data_ptr() % 16
    with pytest.raises(AssertionError, match="a bad call reached a launch"):
        buf.dispatch(x[1:], sliced, config=Config(8, 6, 256))


def test_routing_off_its_element_boundary_is_refused(buf: Buffer) -> None:
    """A routing tensor or count one byte past an element boundary (an array from outside torch: the kernels' 4- or
    8-byte element reads would fault) is refused naming it and its element size, before any launch."""
    x, idx, per_rank, per_expert, in_rank = _layout_inputs()
    w = torch.rand(T, K)
    with pytest.raises(ValueError, match=r"get_dispatch_layout: topk_idx must be aligned to its 8-byte elements "
                                         r"\(element reads\), got 0x[0-9a-f]*1$"):
        buf.get_dispatch_layout(unaligned((T, K), torch.int64).copy_(idx), E)
    inputs = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=idx, topk_weights=w)
    for name, t in inputs.items():
        if t.dtype == torch.bool:
            continue  # one-byte elements: any address is aligned
        bad = inputs | {name: unaligned(tuple(t.shape), t.dtype).copy_(t)}
        with pytest.raises(ValueError, match=rf"dispatch: {name} must be aligned to its {t.element_size()}-byte "
                                             r"elements \(element reads\)"):
            buf.dispatch(x, **bad, config=Config(8, 6, 256))


def test_a_stranded_op_stops_the_transfers_by_name(buf: Buffer) -> None:
    """After a dispatch refused past its counts exchange (its op has no transfer: on the GPU, the worker's case), the
    Buffer's dispatches and combines raise naming it, before a launch; the layout (no transfer) still runs."""
    x, idx, per_rank, per_expert, in_rank = _layout_inputs()
    buf.normal._stranded = "dispatch op 7: dispatch: num_nvl_bytes must hold ..."
    message = "cannot transfer again: an earlier call was refused after its counts were exchanged \\(dispatch op 7"
    with pytest.raises(RuntimeError, match=f"dispatch: this Buffer's normal mode {message}"):
        buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                     config=Config(8, 6, 256))
    rows = 5
    handle = _normal.NormalHandle((torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, 4, dtype=torch.int32),
                                   torch.zeros(1, 4, dtype=torch.int32), torch.zeros(rows, dtype=torch.int32),
                                   torch.zeros(T, 1, dtype=torch.bool), torch.zeros(T, 1, dtype=torch.int32)),
                                  most_sent=rows)
    with pytest.raises(RuntimeError, match=f"combine: this Buffer's normal mode {message}"):
        buf.combine(torch.zeros(rows, H, dtype=torch.bfloat16), handle, config=Config(8, 6, 256))
    with pytest.raises(AssertionError, match="a bad call reached a launch"):
        buf.get_dispatch_layout(idx, E)


def test_combine_rewrites_the_handles_send_head_before_its_readers(buf: Buffer,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A checked combine is one launch on its stream, the combine kernel with a CTA per channel half (its CTAs make
    the send_head rewrite, DeepEP's in-place one on the caller's handle[5] itself, then the send and the receive
    halves), its parameters pointing at that send_head."""
    launches: list[tuple[ep_normal.Kernel, int, bytes]] = []
    monkeypatch.setattr(_normal.NormalMode, "_begin", lambda self, fn, num_sms: _normal._Stream(0, None, 0))

    def launch_transfer(kernels: list[ep_normal.PackedKernel], stream: _normal._Stream) -> None:
        for kernel, grid, _, args in kernels:
            params = ctypes.c_void_p.from_address(args + 8).value
            launches.append((kernel, grid[0], ctypes.string_at(params, ctypes.sizeof(ep_normal.EpNormalParams))))

    monkeypatch.setattr(_normal, "_launch_transfer", launch_transfer)
    rows, channels = 5, 20
    send_head = torch.full((T, 1), -1, dtype=torch.int32)
    handle = _normal.NormalHandle((torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, channels, dtype=torch.int32),
                                   torch.zeros(1, channels, dtype=torch.int32), torch.zeros(rows, dtype=torch.int32),
                                   torch.zeros(T, 1, dtype=torch.bool), send_head), most_sent=rows)
    buf.combine(torch.zeros(rows, H, dtype=torch.bfloat16), handle, config=Config(2 * channels, 6, 256))
    entries = ep_normal.Entry
    assert [(k, g) for k, g, _ in launches] == [(entries.COMBINE, 2 * channels)]
    params = ep_normal.EpNormalParams.from_buffer_copy(launches[0][2])
    assert (params.send_head, params.num_tokens, params.num_channels) == (send_head.data_ptr(), T, channels)


def test_internode_is_not_implemented(buf: Buffer) -> None:
    for call in (buf.internode_dispatch, buf.internode_combine):
        with pytest.raises(NotImplementedError, match="NVSHMEM/RDMA"):
            call(torch.zeros(1, H, dtype=torch.bfloat16), None)


def test_local_buffer_tensor_views_the_nvl_buffer(buf: Buffer) -> None:
    """DeepEP's semantics: from byte ``offset``, shaped ``size`` or 1-D to the end (not past it), a view (writes land
    in the normal mode's workspace region)."""
    region = buf.normal.buffer
    nbytes = region.numel()
    whole = buf.get_local_buffer_tensor(torch.uint8)
    assert whole.data_ptr() == region.data_ptr() and whole.shape == (nbytes,) == (1 << 20,)
    rest = buf.get_local_buffer_tensor(torch.float32, offset=1024)
    assert rest.shape == ((nbytes - 1024) // 4,) and rest.data_ptr() == region.data_ptr() + 1024
    shaped = buf.get_local_buffer_tensor(torch.bfloat16, torch.Size([3, 4]), offset=64)
    assert shaped.shape == (3, 4) and shaped.dtype == torch.bfloat16 and shaped.is_contiguous()
    shaped.fill_(1.5)
    assert torch.equal(region[64:88].view(torch.bfloat16), torch.full((12,), 1.5, dtype=torch.bfloat16))
    assert buf.get_local_buffer_tensor(torch.int64, [2, 0]).shape == (2, 0)
    assert buf.get_local_buffer_tensor(torch.uint8, offset=nbytes).shape == (0,)
    assert buf.get_local_buffer_tensor(torch.float64, torch.Size([nbytes // 8])).shape == (nbytes // 8,)
    assert buf.get_local_buffer_tensor(torch.int32, offset=nbytes - 8).shape == (2,)


def test_local_buffer_tensor_checks(buf: Buffer, group: dist.ProcessGroup) -> None:
    nbytes = buf.normal.buffer.numel()
    fn = "get_local_buffer_tensor"
    cases = [
        (TypeError, f"{fn}: dtype must be a torch.dtype, got str", dict(dtype="float32")),
        (TypeError, f"{fn}: offset must be an int, got float", dict(dtype=torch.uint8, offset=8.0)),
        (ValueError, rf"{fn}: offset must be in \[0, {nbytes}\], got -1", dict(dtype=torch.uint8, offset=-1)),
        (ValueError, rf"{fn}: offset must be in \[0, {nbytes}\], got {nbytes + 1}",
         dict(dtype=torch.uint8, offset=nbytes + 1)),
        (ValueError, f"{fn}: offset must be a multiple of torch.float32's 4 bytes .* got 6",
         dict(dtype=torch.float32, offset=6)),
        (TypeError, f"{fn}: size must be a torch.Size \\(a shape\\) or None, got int", dict(dtype=torch.uint8, size=4)),
        (TypeError, rf"{fn}: size\[1\] must be an int, got float", dict(dtype=torch.uint8, size=(2, 2.0))),
        (ValueError, rf"{fn}: size\[0\] must be in \[0, {nbytes}\], got -2", dict(dtype=torch.uint8, size=[-2])),
        (ValueError, f"{fn}: size must fit the NVL buffer: \\[2, {nbytes // 8}\\] is {nbytes // 4} elements",
         dict(dtype=torch.float64, size=torch.Size([2, nbytes // 8]))),
        (ValueError, f"{fn}: size must fit .* 0 fit after offset {nbytes}",
         dict(dtype=torch.uint8, size=(1,), offset=nbytes)),
        (TypeError, f"{fn}: use_rdma_buffer must be a bool, got int", dict(dtype=torch.uint8, use_rdma_buffer=1)),
        (NotImplementedError, r"use_rdma_buffer=True.*NVSHMEM/RDMA", dict(dtype=torch.uint8, use_rdma_buffer=True)),
    ]
    for error, needle, kwargs in cases:
        with pytest.raises(error, match=needle):
            buf.get_local_buffer_tensor(**kwargs)
    with pytest.raises(ValueError, match=f"{fn}: the normal mode needs a Buffer with num_nvl_bytes > 0"):
        Buffer(group, 0, 0).get_local_buffer_tensor(torch.uint8)
    destroyed = Buffer(group, 1 << 20, 0, explicitly_destroy=True)
    destroyed.destroy()
    with pytest.raises(ValueError, match=f"{fn}: the Buffer was destroyed"):
        destroyed.get_local_buffer_tensor(torch.uint8)


def test_grids_stay_within_the_ranks_share() -> None:
    """A kernel's grid is DeepEP's (config.num_sms, or the layout's and notify's own) bounded by the rank's share of
    the GPU: at 8 ranks on one H200 (a share of 16 SMs) 24-CTA grids of spinning kernels did not all fit; an empty
    layout's grid is still one CTA (the packed launches' grids)."""
    kernels = [(ep_normal.Entry.DISPATCH, grid, 0) for grid in (0, 1, 2, 13, 24, 132)]
    launch = ep_normal.new_launch(PeerTable(), kernels, [dict(transient=ep_normal.data_offset(1, 1, 1), data_rows=0)],
                                  max_ctas=16)
    assert [grid for _, grid, _, _ in launch.kernels] == [(g, 1, 1) for g in (1, 1, 2, 13, 16, 16)]


def test_packed_launches_fix_no_per_call_field() -> None:
    """What a call sets (its pointers, op, received rows, timeout) is never part of a shape's fixed fields."""
    assert {"x", "send_head", "host_counts", "op", "recv_rows", "timeout_ns"} <= ep_normal.PER_CALL_FIELDS
    assert not {"status_mirror", "num_tokens", "data_rows", "off_data"} & ep_normal.PER_CALL_FIELDS
    fields = dict(transient=ep_normal.data_offset(1, 1, 1), data_rows=0, x=1, op=2)
    with pytest.raises(TypeError, match=r"per-call fields of EpNormalParams: \['op', 'x'\]"):
        ep_normal.new_launch(PeerTable(), [(ep_normal.Entry.LAYOUT, 1, 0)], [fields], max_ctas=16)


class PollStream:
    """The stream as the CPU wait queries it: it stores ``tag`` into the record at its ``store_at``-th query and
    runs dry at its ``dry_at``-th (never when None)."""

    def __init__(self, record: torch.Tensor, tag: int, store_at: int | None, dry_at: int | None) -> None:
        self.record, self.value, self.store_at, self.dry_at, self.queries = record, tag, store_at, dry_at, 0

    def finished(self) -> bool:
        self.queries += 1
        if self.queries == self.store_at:
            ep_normal.host_tag(self.record)[0] = self.value
        return self.dry_at is not None and self.queries >= self.dry_at


def poll(store_at: int | None, dry_at: int | None, op: int = 7) -> tuple[bool, int]:
    record = ep_normal.new_host_counts(4, torch.device("cpu"))
    stream = PollStream(record, op, store_at, dry_at)
    found = _normal._wait_for_counts("dispatch", ep_normal.host_tag(record), op, stream, 1_000_000)
    return found, stream.queries


def test_the_cpu_wait_polls_the_tag_until_notify_stores_the_calls_op() -> None:
    """The record starts untagged (-1); the wait returns once this call's op is there (an earlier op does not end
    it), False when the stream runs dry without it, and reads the tag, not the stream, while polling."""
    record = ep_normal.new_host_counts(4, torch.device("cpu"))
    assert record.tolist()[ep_normal.HostRecord.RECV:] == [-1] * 7 and ep_normal.host_tag(record)[0] == -1
    assert poll(store_at=3, dry_at=None) == (True, 3)
    assert poll(store_at=None, dry_at=2) == (False, 2)
    assert poll(store_at=2, dry_at=2) == (True, 2)  # stored just before it ran dry
    record = ep_normal.new_host_counts(4, torch.device("cpu"))
    ep_normal.host_tag(record)[0] = 6  # the previous call's tag
    stream = PollStream(record, 7, None, 1)
    assert not _normal._wait_for_counts("dispatch", ep_normal.host_tag(record), 7, stream, 1_000_000)


def test_the_cpu_wait_times_out_while_the_stream_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither the tag nor the stream's end: DeviceTimeoutError after CPU_WAIT_TIMEOUT_S (or twice the spin
    timeout, when longer), naming the wait; the clock is read only at the stream queries."""
    clock = iter(range(0, 10_000, 50))
    monkeypatch.setattr(_normal.time, "monotonic", lambda: next(clock))
    with pytest.raises(DeviceTimeoutError, match=r"dispatch: the CPU wait for the received counts ran past 100 s"):
        poll(store_at=None, dry_at=None)
    clock = iter(range(0, 10_000, 50))
    with pytest.raises(DeviceTimeoutError, match=r"ran past 300 s"):
        record = ep_normal.new_host_counts(4, torch.device("cpu"))
        _normal._wait_for_counts("dispatch", ep_normal.host_tag(record), 7, PollStream(record, 7, None, None),
                                 150_000_000_000)


def test_make_params_refuses_names_that_are_not_fields() -> None:
    """A misspelled or removed field (the kernels' int32/int64 ``idx_bytes`` is gone) raises instead of becoming a
    plain attribute of the ctypes struct that no kernel reads."""
    transient = ep_normal.data_offset(2, 4, 4)
    assert ep_normal.make_params(transient=transient, data_rows=3, num_tokens=5).num_tokens == 5
    with pytest.raises(TypeError, match=r"^make_params: not fields of EpNormalParams: \['idx_bytes'\]$"):
        ep_normal.make_params(transient=transient, data_rows=3, num_tokens=5, idx_bytes=8)


def test_fp8_scales_whose_strides_overflow_the_kernels_fields_are_refused(buf: Buffer) -> None:
    """DeepEP asserts ``num_scales * scale_hidden_stride < INT_MAX``; the kernels keep both strides in 32-bit fields:
    scales whose strides exceed them are refused naming x[1], not truncated; column-major scales fit."""
    x, idx, per_rank, per_expert, in_rank = _layout_inputs()
    payload = x.to(torch.float8_e4m3fn)
    base = np.zeros(2, dtype=np.float32)
    args = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                config=Config(8, 6, 256))
    for strides in ((1, 1 << 31), (1 << 32, 1)):  # views no real storage could back: never read, refused first
        scales = torch.from_numpy(np.lib.stride_tricks.as_strided(base, (T, 2), tuple(4 * s for s in strides)))
        assert scales.stride() == strides
        with pytest.raises(ValueError, match=r"dispatch: x\[1\] \(scales\) must have num_scales \* hidden stride < "
                                             r"2147483647 \(DeepEP's rule\) and a token stride <= 2147483647"):
            buf.dispatch((payload, scales), **args)
    with pytest.raises(AssertionError, match="a bad call reached a launch"):
        buf.dispatch((payload, torch.rand(2, T).t()), **args)
