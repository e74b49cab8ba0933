"""``Buffer.get_comm_stream`` and ``Buffer.get_local_buffer_tensor`` (DeepEP's raw access to a Buffer's stream and NVL
buffer).

CPU: the contract of get_comm_stream (which partition's stream it is, the caller's stream with the partition off, a
CPU host's error). GPU (one H200, in-process on the one-rank group), with the partition on and off: the stream is the
one the kernels run on (the communication green context's), and work queued on it is ordered as DeepEP promises:
what was queued before a call precedes the call's kernels, what is queued after follows them, for normal-mode and
low-latency calls; the NVL view aliases the workspace the normal-mode kernels write (a dispatched row is read back
through it). The argument checks of get_local_buffer_tensor are test_deep_ep_normal_host.py's and the fuzz suite's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from gc_moe_compat.deep_ep import Buffer, _buffer
from gc_moe_compat.runtime.colocation import Placement
from gc_moe_compat.runtime.green import get_partition

T, H, K, E = 64, 512, 2, 8
SLEEP_CYCLES = 20_000_000
"""About 10 ms of ``torch.cuda._sleep`` on an H200: long enough that unordered work would visibly run first."""


# ------------------------------------------------------------------------------------------------------------------
# CPU: the contract


@pytest.fixture
def on_cuda_3(group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Buffer, list]]:
    """A Buffer whose workspace claims cuda:3, and a record of every partition looked up for it (request, device)
    and of every stream taken from it (the communication side's, on which device)."""
    buf = Buffer(group, 0, 0)
    alone = Placement(rank=0, device_uuids=("GPU-3",))
    monkeypatch.setattr(buf, "workspace", SimpleNamespace(device=torch.device("cuda", 3), placement=alone))
    record: list = []

    def torch_stream(device_index: int) -> str:
        record.append(("comm stream", device_index))
        return f"comm stream of cuda:{device_index}"

    def partition(request: int, device_index: int) -> SimpleNamespace:
        record.append(("partition", request, device_index))
        return SimpleNamespace(comm=SimpleNamespace(torch_stream=torch_stream))

    monkeypatch.setattr(_buffer, "get_partition", partition)
    before = Buffer.num_sms
    yield buf, record
    Buffer.num_sms = before


def test_comm_stream_is_the_comm_side_of_the_num_sms_partition(on_cuda_3: tuple[Buffer, list],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """GC_MOE_DEEP_EP_PARTITION=on: the communication side's stream of the partition ``Buffer.num_sms`` requests (the
    request of the low-latency kernels and of the normal mode's default configs) on the Buffer's device."""
    buf, record = on_cuda_3
    monkeypatch.setenv("GC_MOE_DEEP_EP_PARTITION", "on")
    assert buf.get_comm_stream() == "comm stream of cuda:3"
    Buffer.set_num_sms(32)
    buf.get_comm_stream()
    assert record == [("partition", 20, 3), ("comm stream", 3), ("partition", 32, 3), ("comm stream", 3)]
    assert Buffer.get_dispatch_config(1).num_sms == Buffer.get_combine_config(1).num_sms == Buffer.num_sms


def test_comm_stream_with_the_partition_off_is_the_callers(on_cuda_3: tuple[Buffer, list],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    buf, record = on_cuda_3
    monkeypatch.delenv("GC_MOE_DEEP_EP_PARTITION", raising=False)  # off, the default
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"current stream of {device}")
    assert buf.get_comm_stream() == "current stream of cuda:3"
    assert record == []


def test_comm_stream_where_ranks_share_the_gpu_is_the_callers(on_cuda_3: tuple[Buffer, list],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks sharing a GPU run with the partition off whatever GC_MOE_DEEP_EP_PARTITION says (green contexts do not
    confine under MPS), so the kernels run on the caller's stream."""
    buf, record = on_cuda_3
    monkeypatch.setenv("GC_MOE_DEEP_EP_PARTITION", "on")
    buf.workspace.placement = Placement(rank=1, device_uuids=("GPU-3", "GPU-3"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"current stream of {device}")
    assert buf.get_comm_stream() == "current stream of cuda:3"
    assert record == []


def test_comm_stream_needs_a_cuda_workspace(on_cuda_3: tuple[Buffer, list], monkeypatch: pytest.MonkeyPatch) -> None:
    buf, _ = on_cuda_3
    monkeypatch.setattr(buf, "workspace", SimpleNamespace(device=torch.device("cpu")))
    with pytest.raises(RuntimeError, match="get_comm_stream: needs a CUDA device .* the Buffer's workspace is on cpu"):
        buf.get_comm_stream()


def test_comm_stream_needs_a_cuda_device(group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="get_comm_stream: needs a CUDA device"):
        Buffer(group, 0, 0).get_comm_stream()


# ------------------------------------------------------------------------------------------------------------------
# GPU: ordering and aliasing


@pytest.fixture(params=["on", "off"])
def partition(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("GC_MOE_DEEP_EP_PARTITION", request.param)
    return request.param


def _routing() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded BF16 tokens, top-k ids without repetition (every token has a valid slot) and weights, on the GPU."""
    g = torch.Generator().manual_seed(18)
    x = torch.randn(T, H, generator=g, device="cpu").to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g, device="cpu")[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g, device="cpu")
    return x.cuda(), idx.cuda(), w.cuda()


def _check_stream(buf: Buffer, partition: str) -> torch.cuda.Stream:
    comm = buf.get_comm_stream()
    assert isinstance(comm, torch.cuda.Stream) and comm.device == torch.device("cuda", torch.cuda.current_device())
    if partition == "on":
        assert comm.cuda_stream == int(get_partition(Buffer.num_sms).comm.stream)
        assert comm != torch.cuda.current_stream()
    else:
        assert comm == torch.cuda.current_stream()
    return comm


def _tokens_queued_before(comm: torch.cuda.Stream, x_real: torch.Tensor) -> torch.Tensor:
    """Zeros that ``comm`` (after the caller's queued work) fills with ``x_real`` behind a sleep, the caller's stream
    not waiting for it: a call whose kernels run on ``comm`` in order reads ``x_real`` from them."""
    x = torch.zeros_like(x_real)
    comm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(comm):
        torch.cuda._sleep(SLEEP_CYCLES)
        x.copy_(x_real)
    return x


def _read_queued_after(comm: torch.cuda.Stream, call: Callable[[], tuple]) -> tuple[torch.Tensor, tuple]:
    """The caller's stream put to sleep, then ``call()`` (an async call; its output first), then a copy of that
    output queued on ``comm``: the copy once ``comm`` finished, and what the call returned."""
    torch.cuda._sleep(SLEEP_CYCLES)
    result = call()
    with torch.cuda.stream(comm):
        seen = result[0].clone()
    comm.synchronize()
    return seen, result


@pytest.mark.gpu
def test_normal_mode_comm_stream_ordering(group: dist.ProcessGroup, partition: str) -> None:
    x_real, idx, w = _routing()
    buf = Buffer(group, 1 << 24, 0)
    comm = _check_stream(buf, partition)
    # Queued on the stream before the calls: the dispatch's kernels, queued on the same stream, read the tokens it
    # writes.
    x = _tokens_queued_before(comm, x_real)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    recv, _, recv_w, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    torch.cuda.synchronize()
    assert torch.equal(recv, x_real)  # one rank: every token once, in order
    # Queued after an async call: runs after its kernels, which run after the caller's (sleeping) stream.
    seen, (combined, _, event) = _read_queued_after(comm, lambda: buf.combine(recv * 2, handle, async_finish=True))
    assert torch.equal(seen, x_real * 2)
    event.current_stream_wait()
    assert torch.equal(combined, x_real * 2)


@pytest.mark.gpu
def test_low_latency_comm_stream_ordering(group: dist.ProcessGroup, partition: str) -> None:
    x_real, idx, w = _routing()
    buf = Buffer(group, 0, Buffer.get_low_latency_rdma_size_hint(T, H, 1, E), low_latency_mode=True)
    comm = _check_stream(buf, partition)
    x = _tokens_queued_before(comm, x_real)
    recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    torch.cuda.synchronize()
    for e in range(E):
        rows = (idx == e).any(dim=1).nonzero().flatten()  # one rank: expert e's rows in token order
        assert int(count[e]) == rows.numel() and torch.equal(recv[e, :rows.numel()], x_real[rows]), e
    expert_out = torch.zeros_like(recv)
    for e in range(E):
        expert_out[e, :int(count[e])] = recv[e, :int(count[e])] * 2
    # Queued after an async call: runs after its kernels, which run after the caller's (sleeping) stream.
    seen, (combined, _, _) = _read_queued_after(
        comm, lambda: buf.low_latency_combine(expert_out, idx, w, handle, async_finish=True))
    want = (x_real.float() * 2 * w.sum(dim=1, keepdim=True)).to(torch.bfloat16)
    torch.testing.assert_close(seen.float(), want.float(), rtol=2e-2, atol=2e-2)
    torch.cuda.synchronize()
    assert torch.equal(seen, combined)


@pytest.mark.gpu
def test_local_buffer_tensor_aliases_the_normal_workspace(group: dist.ProcessGroup) -> None:
    """The raw view is the normal mode's workspace itself. (At one rank the normal kernels copy between the caller's
    tensors and leave the data region alone, so what a call stores there is not looked at here.)"""
    nvl_bytes = 1 << 24
    buf = Buffer(group, nvl_bytes, 0)
    whole = buf.get_local_buffer_tensor(torch.uint8)
    assert whole.is_cuda and whole.numel() == nvl_bytes and whole.data_ptr() == buf.normal.buffer.data_ptr()
    # Writes through a view at an offset land in the workspace at that offset.
    view = buf.get_local_buffer_tensor(torch.int32, torch.Size([4, 8]), offset=nvl_bytes - 128)
    view.fill_(7)
    assert torch.equal(buf.normal.buffer[-128:].view(torch.int32),
                       torch.full((32,), 7, dtype=torch.int32, device="cuda"))
