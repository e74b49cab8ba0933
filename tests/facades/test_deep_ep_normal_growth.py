"""The ``deep_ep`` facade's normal mode where a call's rows do not fit its workspace, on the host (the launch recorder
of tests/facades/test_deep_ep_normal_launches.py): a count alike on every rank (the group's busiest receiver after
notify, a handle's busiest sender / receiver) grows the workspace in that call and runs the call again on it, from op
1, with a ``RuntimeWarning``; a growth no rank can make keeps the workspace and releases the refused op's words; a
``num_worst_tokens`` dispatch that does not fit raises before any launch. The GPU case (a Buffer grown through
real calls at two ranks, bit-exact; at one rank the rows never enter the workspace) is the normal worker's
(tests/kit/deep_ep_normal_worker.py)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from cuda.bindings import driver
from test_deep_ep_normal_launches import (
    COMBINE,
    DISPATCH,
    NOTIFY,
    NVL_BYTES,
    STREAM,
    FakeDriver,
    HostWorkspace,
    install_fakes,
    transient,
)

from gc_moe_compat.comm import ep_normal
from gc_moe_compat.comm.ep_normal import released_word
from gc_moe_compat.deep_ep import Buffer, Config, _normal
from gc_moe_compat.runtime.cuda import CudaError
from gc_moe_compat.runtime.status import DeviceCheckError
from gc_moe_compat.runtime.workspace import WorkspaceAllocationError

H, K, EXPERTS, SMS = 256, 4, 16, 8
STRIDE = 16 + 2 * H + 16 * ((12 * K + 15) // 16)
"""A BF16 dispatch row of H with K top-k slots (source token, payload, int64 ids and FP32 weights)."""


class Group:
    """Where the mode's workspaces come from: ``HostWorkspace`` of two ranks, each creation's bytes recorded; with
    ``fail`` set, the next creation raises what the agreement raises on every rank."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sizes: list[int] = []
        self.fail = False
        self.synchronized = 0
        monkeypatch.setattr(_normal, "SymmetricWorkspace", self.create)
        monkeypatch.setattr(torch.cuda, "synchronize", self.synchronize)
        # the growth's GPU refusal, lifted as the launch boundary's is (its workspace is the host stand-in)
        monkeypatch.setattr(_normal.NormalMode, "_require_gpu", lambda mode, fn: None)

    def create(self, layout: object, group: dist.ProcessGroup | None = None, device: torch.device | None = None,
               where: object = None) -> HostWorkspace:
        if self.fail:
            raise WorkspaceAllocationError(f"symmetric workspace: 1 of 2 rank(s) could not allocate and share "
                                           f"{layout.size} bytes (rank 1: OutOfMemoryError: CUDA out of memory)")
        self.sizes.append(layout.size)
        return HostWorkspace(layout.size, 2)

    def synchronize(self, device: object = None) -> None:
        self.synchronized += 1


def _inputs(tokens: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(tokens)
    in_rank = torch.rand(tokens, 2, generator=g) < 0.5
    return dict(num_tokens_per_rank=in_rank.sum(0).to(torch.int32), is_token_in_rank=in_rank,
                num_tokens_per_expert=torch.zeros(EXPERTS, dtype=torch.int32),
                topk_idx=torch.randint(-1, EXPERTS, (tokens, K), generator=g), topk_weights=torch.rand(tokens, K))


def _dispatch(buf: Buffer, fake: FakeDriver, recv: int, most_recv: int, worst: int = 0) -> tuple:
    """An uncached BF16 dispatch of 5 tokens whose notify reports ``recv`` rows here, ``most_recv`` at the group's
    busiest receiver."""
    fake.record = [recv, most_recv, 7, *([0] * (EXPERTS // 2))]
    x = torch.randn(5, H).to(torch.bfloat16)
    return buf.dispatch(x, **_inputs(5), num_worst_tokens=worst, config=Config(SMS, 6, 256))


def _capacity(nbytes: int, stride: int, local: int = EXPERTS // 2) -> int:
    """The rows of ``stride`` bytes a workspace of ``nbytes`` holds for calls of two ranks, ``local`` experts per
    rank (an uncached dispatch's; 1 for a cached dispatch and a combine) and ``SMS / 2`` channels."""
    return (nbytes - transient(2, local, SMS // 2)["off_data"]) // stride


def _fields(fake: FakeDriver) -> list[tuple[str, int, int]]:
    """Each recorded launch as (kernel, op, data_rows)."""
    return [(launch.kernel, launch.fields()["op"], launch.fields()["data_rows"]) for launch in fake.launches]


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeDriver]:
    yield install_fakes(monkeypatch)
    ep_normal.kernel_of.cache_clear()


@pytest.fixture
def buf(group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch, fake: FakeDriver) -> tuple[Buffer, Group]:
    growth = Group(monkeypatch)
    return Buffer(group, NVL_BYTES, 0), growth


def test_a_dispatch_past_the_workspace_grows_it_and_runs_again(buf: tuple[Buffer, Group], fake: FakeDriver) -> None:
    """The group's busiest receiver needs more rows than the data region holds: after notify (op 2) every rank
    grows its workspace to twice the bytes (or what the call needs, 2 MiB-aligned), warns, and runs the call again
    on it from op 1 (the new words start at 0), its host record new; later calls go on from there."""
    buffer, growth = buf
    mode = buffer.normal
    _dispatch(buffer, fake, 9, 12)
    old_rows = _capacity(NVL_BYTES, STRIDE)
    assert _fields(fake) == [(NOTIFY, 1, old_rows), (DISPATCH, 1, old_rows)]
    fake.launches = []
    old_record = mode._host_counts[EXPERTS // 2][0]  # kept, so that the new one cannot reuse its memory
    need = old_rows + 1
    with pytest.warns(RuntimeWarning, match=rf"dispatch: the rows the busiest rank of the group receives \({need} rows "
                                            rf"of {STRIDE} bytes\) did not fit the normal mode's workspace, which grew "
                                            rf"from {NVL_BYTES} to {2 * NVL_BYTES} bytes on every rank"):
        recv_x, *_, handle, _ = _dispatch(buffer, fake, 30, need)
    new_rows = _capacity(2 * NVL_BYTES, STRIDE)
    assert growth.sizes == [NVL_BYTES, 2 * NVL_BYTES] and growth.synchronized == 1
    assert mode.buffer.numel() == 2 * NVL_BYTES and buffer.get_local_buffer_tensor(torch.uint8).numel() == \
        2 * NVL_BYTES
    assert _fields(fake) == [(NOTIFY, 2, old_rows), (NOTIFY, 1, new_rows), (DISPATCH, 1, new_rows)]
    assert fake.launches[1].fields()["host_counts"] != old_record.data_ptr()
    assert recv_x.shape == (30, H) and (handle.most_sent, handle.most_recv) == (7, need)
    mode.workspace.rendezvous = "local"  # what the Buffer's repr reads of a GPU workspace
    mode.workspace.placement = SimpleNamespace(ranks_on_device=1, shares_device=False)
    assert f"num_nvl_bytes={NVL_BYTES} (grown to {2 * NVL_BYTES})," in repr(buffer)
    fake.launches = []
    huge = 3 * new_rows  # past twice the bytes: the call's own need, rounded up to 2 MiB
    with pytest.warns(RuntimeWarning, match="grew from"):
        _dispatch(buffer, fake, 3, huge)
    need_bytes = transient(2, EXPERTS // 2, SMS // 2)["off_data"] + huge * STRIDE
    assert growth.sizes[-1] == -(-need_bytes // (1 << 21)) * (1 << 21) > 2 * 2 * NVL_BYTES
    assert [(k, op) for k, op, _ in _fields(fake)] == [(NOTIFY, 2), (NOTIFY, 1), (DISPATCH, 1)]


def test_a_combine_or_cached_dispatch_past_the_workspace_grows_it_before_any_launch(
        buf: tuple[Buffer, Group], fake: FakeDriver) -> None:
    """A handle's busiest sender (the combine's rows back) and busiest receiver (a cached dispatch's rows) are the
    group's: past the data region, the call grows the workspace before launching anything and then runs on it."""
    buffer, growth = buf
    x = torch.randn(5, H).to(torch.bfloat16)
    *_, handle, _ = _dispatch(buffer, fake, 9, 12)
    fake.launches = []
    combine_stride = 2 * H + 16 * ((4 * K + 15) // 16)
    handle.most_sent = _capacity(NVL_BYTES, combine_stride, 1) + 1
    rows = torch.randn(9, H).to(torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="combine: the rows the busiest rank of the group gets back"):
        out, _, _ = buffer.combine(rows, handle, torch.rand(9, K), config=Config(SMS, 6, 256))
    assert out.shape == (5, H) and growth.sizes == [NVL_BYTES, 2 * NVL_BYTES]
    assert [(k, op) for k, op, _ in _fields(fake)] == [(COMBINE, 1)]
    fake.launches = []
    handle.most_recv = _capacity(2 * NVL_BYTES, 16 + 2 * H, 1) + 1
    with pytest.warns(RuntimeWarning, match="dispatch: the rows the busiest rank of the group receives"):
        recv_x, *_ = buffer.dispatch(x, handle, config=Config(SMS, 6, 256))
    assert recv_x.shape == (9, H) and growth.sizes[-1] == 4 * NVL_BYTES
    assert [(k, op) for k, op, _ in _fields(fake)] == [(DISPATCH, 1)]


@pytest.fixture
def stores(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The host's stores into device words (``cuMemsetD32Async``: address, value), recorded in order."""
    stored: list[tuple[int, int]] = []

    def memset(address: int, value: int, count: int, stream: driver.CUstream) -> tuple:
        assert count == 1
        stored.append((address, value))
        return (driver.CUresult.CUDA_SUCCESS,)

    monkeypatch.setattr(driver, "cuMemsetD32Async", memset)
    monkeypatch.setattr(_normal, "current_stream_handle", lambda device: STREAM)
    monkeypatch.setattr(driver, "cuStreamSynchronize", lambda stream: (driver.CUresult.CUDA_SUCCESS,))
    return stored


def _released(table: object, op: int) -> list[tuple[int, int]]:
    """The stores that release ``op`` for rank 0 in both ranks' copies: its u64 ``released`` word, low half first."""
    return [(table.base + table.offsets[r] + released_word(0) + 4 * half, (op & 0xFFFFFFFF, op >> 32)[half])
            for r in (0, 1) for half in (0, 1)]


NEED = _capacity(NVL_BYTES, STRIDE) + 1
"""The busiest receiver's rows that the first workspace does not hold."""


def test_a_growth_no_rank_can_make_keeps_the_workspace_and_releases_the_refused_op(
        buf: tuple[Buffer, Group], fake: FakeDriver, stores: list[tuple[int, int]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the agreement says a rank could not allocate the grown workspace, every rank raises ValueError (the
    call's need, then the allocation's error) and keeps its workspace; the refused dispatch's op (its counts were
    exchanged) is stored as released into this rank's word of every rank's copy, so the next transfer proceeds
    (here: op 2 refused, the next dispatch is op 3). A store that fails leaves the Buffer's transfers refused by
    name."""
    buffer, growth = buf
    mode = buffer.normal
    _dispatch(buffer, fake, 9, 12)
    workspace, fake.launches, growth.fail = mode.workspace, [], True
    with pytest.raises(ValueError, match=rf"dispatch: num_nvl_bytes must hold the rows the busiest rank of the group "
                                         rf"receives at once: {NEED} rows .*; growing the workspace to {2 * NVL_BYTES} "
                                         r"bytes failed: symmetric workspace: 1 of 2 rank\(s\) could not allocate"):
        _dispatch(buffer, fake, 30, NEED)
    assert mode.workspace is workspace and mode.op == 2
    assert stores == _released(workspace.peer_table, 2)
    assert [(k, op) for k, op, _ in _fields(fake)] == [(NOTIFY, 2)]
    fake.launches, growth.fail = [], False
    _dispatch(buffer, fake, 9, 12)
    assert [(k, op) for k, op, _ in _fields(fake)] == [(NOTIFY, 3), (DISPATCH, 3)]

    def failing(address: int, value: int, count: int, stream: driver.CUstream) -> tuple:
        return (driver.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS,)

    monkeypatch.setattr(driver, "cuMemsetD32Async", failing)
    monkeypatch.setattr(driver, "cuGetErrorName", lambda result: (driver.CUresult.CUDA_SUCCESS,
                                                                  b"CUDA_ERROR_ILLEGAL_ADDRESS"))
    monkeypatch.setattr(driver, "cuGetErrorString", lambda result: (driver.CUresult.CUDA_SUCCESS, b"illegal"))
    fake.launches, growth.fail = [], True
    with pytest.raises(CudaError, match="CUDA_ERROR_ILLEGAL_ADDRESS"):
        _dispatch(buffer, fake, 30, NEED)
    with pytest.raises(RuntimeError, match=r"dispatch: this Buffer's normal mode cannot transfer again: .*"
                                           r"\(dispatch op 4: storing its 'released' words failed\)"):
        _dispatch(buffer, fake, 9, 12)


def test_a_ranks_own_error_before_the_growth_is_agreed_on(buf: tuple[Buffer, Group], fake: FakeDriver,
                                                          stores: list[tuple[int, int]],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """What a rank's kernels recorded (raised after its device synchronization) goes into the agreement before the
    new workspace is created: that rank raises its own error, a peer whose error it was raises ValueError naming
    it; both release the refused op and keep their workspace, so the next call runs (no rank waits in the
    creation for a rank that raised)."""
    buffer, growth = buf
    mode = buffer.normal
    workspace = mode.workspace
    recorded = DeviceCheckError("gc_ep_normal_layout: a topk_idx entry >= num_experts")
    calls = []

    def raise_recorded(when: str = "") -> None:  # the launch boundary's read finds nothing yet, the growth's this
        calls.append(when)
        if len(calls) == 2:
            raise recorded

    with monkeypatch.context() as this_rank:
        this_rank.setattr(mode, "raise_recorded", raise_recorded)
        with pytest.raises(DeviceCheckError, match="a topk_idx entry") as raised:
            _dispatch(buffer, fake, 30, NEED)
    assert isinstance(raised.value.__cause__, WorkspaceAllocationError)
    assert "could not prepare a growth of the normal mode's workspace" in str(raised.value.__cause__)
    assert stores == _released(workspace.peer_table, 1) and growth.sizes == [NVL_BYTES]

    def peer_failed(group: object, what: str, shared: object, failure: str | None) -> list[object]:
        raise WorkspaceAllocationError(f"symmetric workspace: 1 of 2 rank(s) could not {what} (rank 1: "
                                       "DeviceCheckError: a topk_idx entry >= num_experts)")

    monkeypatch.setattr(_normal, "agree", peer_failed)  # the peer's side: its agreement names this rank's error
    stores.clear()
    with pytest.raises(ValueError, match=r"; growing the workspace to \d+ bytes failed: .* could not prepare a growth "
                                         r".*rank 1: DeviceCheckError"):
        _dispatch(buffer, fake, 30, NEED)
    assert stores == _released(workspace.peer_table, 2) and mode.workspace is workspace
    fake.launches = []
    _dispatch(buffer, fake, 9, 12)
    assert [(k, op) for k, op, _ in _fields(fake)] == [(NOTIFY, 3), (DISPATCH, 3)]
    # this rank's own error where the release fails too (a broken context): its error is raised, the op stopping
    # the transfers by name
    monkeypatch.undo()
    fake = install_fakes(monkeypatch)
    Group(monkeypatch)
    monkeypatch.setattr(_normal, "current_stream_handle", lambda device: STREAM)
    monkeypatch.setattr(driver, "cuMemsetD32Async", lambda *args: (driver.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS,))
    monkeypatch.setattr(driver, "cuGetErrorName", lambda result: (driver.CUresult.CUDA_SUCCESS, b"ILLEGAL"))
    monkeypatch.setattr(driver, "cuGetErrorString", lambda result: (driver.CUresult.CUDA_SUCCESS, b"illegal"))
    calls.clear()
    monkeypatch.setattr(mode, "raise_recorded", raise_recorded)
    with pytest.raises(DeviceCheckError, match="a topk_idx entry"):
        _dispatch(buffer, fake, 30, NEED)
    monkeypatch.undo()
    fake = install_fakes(monkeypatch)
    monkeypatch.setattr(_normal.NormalMode, "_require_gpu", lambda mode, fn: None)
    with pytest.raises(RuntimeError, match=r"cannot transfer again: .*\(dispatch op 4: storing its 'released' words "
                                           r"failed\)"):
        _dispatch(buffer, fake, 9, 12)


def test_a_growth_that_fails_otherwise_or_overflows_again_stops_the_transfers_by_name(
        buf: tuple[Buffer, Group], fake: FakeDriver, stores: list[tuple[int, int]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A creation that fails other than by an allocation (a rendezvous error) is raised as it is, and a retry that
    overflows again (the grown workspace should hold it: a protocol error) raises its ValueError; neither leaves the
    refused op's words stored, so the Buffer's next transfer raises RuntimeError naming the op at once instead of
    waiting for them."""
    buffer, growth = buf

    def broken(layout: object, *args: object) -> None:
        raise RuntimeError("cuIpcOpenMemHandle failed: CUDA_ERROR_INVALID_VALUE")

    monkeypatch.setattr(_normal, "SymmetricWorkspace", broken)
    with pytest.raises(RuntimeError, match="cuIpcOpenMemHandle failed"):
        _dispatch(buffer, fake, 30, NEED)
    with pytest.raises(RuntimeError, match=r"cannot transfer again: .*\(dispatch op 1: .*its workspace's growth "
                                           r"failed\)"):
        _dispatch(buffer, fake, 9, 12)
    assert stores == []
    monkeypatch.setattr(_normal, "SymmetricWorkspace", growth.create)
    other = Buffer(buffer.group, NVL_BYTES, 0)
    monkeypatch.setattr(_normal.NormalMode, "_grow", lambda mode, fn, overflow: "not grown")
    with pytest.raises(ValueError, match=rf"dispatch: num_nvl_bytes must hold .* at once: {NEED} rows"):
        _dispatch(other, fake, 30, NEED)
    with pytest.raises(RuntimeError, match=r"cannot transfer again: .*\(dispatch op 2: .* \(after a growth\)\)"):
        _dispatch(other, fake, 9, 12)


def test_a_worst_case_dispatch_past_the_workspace_raises_before_any_launch(buf: tuple[Buffer, Group],
                                                                           fake: FakeDriver) -> None:
    """``num_worst_tokens`` is the caller's count, not the group's: past the data region it raises ValueError
    naming the bytes, before notify, and nothing grows."""
    buffer, growth = buf
    worst = _capacity(NVL_BYTES, STRIDE) + 1
    with pytest.raises(ValueError, match=rf"dispatch: num_nvl_bytes must hold num_worst_tokens received rows at "
                                         rf"once: {worst} rows of {STRIDE} bytes"):
        _dispatch(buffer, fake, 0, 0, worst=worst)
    assert fake.launches == [] and growth.sizes == [NVL_BYTES]


def test_a_handles_counts_are_checked_as_ints(buf: tuple[Buffer, Group], fake: FakeDriver) -> None:
    """A handle's ``most_recv`` (like its ``most_sent``) must be None or an int in [0, INT_MAX]."""
    buffer, _ = buf
    *_, handle, _ = _dispatch(buffer, fake, 9, 12)
    handle.most_recv = 1.5
    with pytest.raises(TypeError, match=r"dispatch: handle.most_recv \(the rows the dispatch's busiest rank "
                                        r"received\) must be an int, got float"):
        buffer.dispatch(torch.randn(5, H).to(torch.bfloat16), handle, config=Config(SMS, 6, 256))
