"""Role3 (SM90 finalize) on one H200: exact combine, per-replay state, 1000 graph replays, readiness across two
workspaces on one GPU, timeouts. Every launch gets fresh random partials, poisoned outputs and poisoned unused
combine rows; outputs are compared bit for bit with the reference combine."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from role3_kit import (
    STAND_IN_SITES,
    Y_POISON,
    RankData,
    assert_bits_equal,
    assert_state_after,
    delay,
    expected_y,
    make_rank_data,
    module,
    poisoned_y,
    recv_counts,
    remote_rows,
    scatter,
    stage_combine,
    stage_counters,
    stage_inputs,
    warm_up,
)
from runtime_kit import sync, u32

from gc_moe_compat.config import MoEShape
from gc_moe_compat.operator.buffer import GcMoeBuffer, get_symm_buffer_for_gc_moe
from gc_moe_compat.operator.sm90 import role3_finalize
from gc_moe_compat.operator.workspace import OperatorLayout
from gc_moe_compat.runtime.graph import KernelNode, get_graph
from gc_moe_compat.runtime.green import Role, get_partition
from gc_moe_compat.runtime.params import KernelArgs, ptr
from gc_moe_compat.runtime.split import PartitionPlan
from gc_moe_compat.runtime.status import DeviceCheckError, DeviceTimeoutError, new_status, raise_for_status
from gc_moe_compat.runtime.workspace import make_peer_table
from gc_moe_compat.testing import reference

DISPATCH = 7  # role1 grid the packed counters claim (any value: role3 checks against its parameter)
REPLAYS, CHECK_EVERY = 1000, 250

# (E, k, S, H, capacity, idx dtype): 2 slots + shared; top-8 at H = 7168 with int32 ids; 31 + shared = the 32-slot
# maximum; a DeepSeek-like 6 + shared at H = 5120.
SHAPES = {
    "k2s1": (8, 2, 1, 512, 64, torch.int64),
    "k8h7168": (16, 8, 0, 7168, 16, torch.int32),
    "k31s1": (32, 31, 1, 256, 8, torch.int64),
    "k6s1h5120": (64, 6, 1, 5120, 128, torch.int64),
}
CASES = [("k2s1", 0, None), ("k2s1", 1, None), ("k2s1", 37, None), ("k2s1", 64, None), ("k2s1", 64, 1),
         ("k8h7168", 16, None), ("k8h7168", 16, 2), ("k31s1", 8, None), ("k6s1h5120", 128, None),
         ("k6s1h5120", 97, 3)]
"""(shape, T, max_ctas): T = 0 and T = capacity; small grids make every warp walk several units."""


def _buffer(group: dist.ProcessGroup, name: str) -> GcMoeBuffer:
    e, k, s, h, cap, idx = SHAPES[name]
    return get_symm_buffer_for_gc_moe(group, e, cap, k, h, 256, "fp8xfp8", num_shared_experts=s,
                                      topk_idx_dtype=idx)


def _set_phase(buffer: GcMoeBuffer, replay: int) -> None:
    """The phase words as role3 of ``replay - 1`` left them on a single-rank workspace."""
    buffer.replay_seq.fill_(replay)
    buffer.recv_parity.fill_(replay & 1)
    buffer.combine_ready.fill_(replay)


def _stage_one_rank(buffer: GcMoeBuffer, gen: torch.Generator, tokens: int, replay: int) -> tuple[RankData, int]:
    shape = buffer.shape
    data = make_rank_data(gen, shape, tokens)
    stage_inputs(buffer, data)
    stage_combine(buffer, 0, data, shape)
    _set_phase(buffer, replay)
    parity = stage_counters(buffer, recv_counts([data], 0, shape), DISPATCH)
    return data, parity


@pytest.mark.gpu
@pytest.mark.parametrize(("name", "tokens", "max_ctas"), CASES)
def test_role3_combine_exact_and_state_reset(group: dist.ProcessGroup, name: str, tokens: int,
                                             max_ctas: int | None) -> None:
    buf = _buffer(group, name)
    part = get_partition()
    seed = int.from_bytes(os.urandom(4), "little") >> 1  # fresh inputs every run; printed for a replay
    print(f"{name} T={tokens} max_ctas={max_ctas}: seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    replay = 5 + tokens % 2  # both parities
    data, parity = _stage_one_rank(buf, gen, tokens, replay)
    combine_before = buf.combine.clone()
    stats = torch.randint(0, 1000, (buf.shape.num_local_experts,), dtype=torch.int32, device="cuda")
    stats_before = stats.clone()
    y, full = poisoned_y(tokens, buf.shape.hidden)
    torch.cuda.synchronize()
    role3_finalize.launch_finalize(buf, y, part.compute.stream, recv_stats=stats, dispatch_sms=DISPATCH,
                             max_ctas=max_ctas)
    sync(part.compute)
    role3_finalize.raise_for_finalize_status(buf)
    assert_bits_equal(y, expected_y(data, buf.shape), f"{name} T={tokens}")
    assert bool((full[tokens].view(torch.int16) == Y_POISON).all()), "wrote past y"
    assert torch.equal(buf.combine.view(torch.int16), combine_before.view(torch.int16)), "combine buffer modified"
    assert_state_after(buf, replay, parity)
    assert buf.combine_ready.tolist() == [replay + 1]
    received = reference.recv_counts(reference.dispatch_plan([data.topk_idx], buf.shape.num_experts))[0]
    assert torch.equal(stats.cpu(), stats_before.cpu() + received)


@pytest.mark.gpu
def test_role3_arrival_check_reports_the_expert_and_still_completes(group: dist.ProcessGroup) -> None:
    buf = _buffer(group, "k2s1")
    part = get_partition()
    data, parity = _stage_one_rank(buf, torch.Generator().manual_seed(3), 20, 4)
    buf.recv_counts[parity, 0, 5] += 1 << 32  # one dispatch CTA too many for local expert 5
    y, _ = poisoned_y(20, buf.shape.hidden)
    torch.cuda.synchronize()
    role3_finalize.launch_finalize(buf, y, part.compute.stream, dispatch_sms=DISPATCH)
    sync(part.compute)
    with pytest.raises(DeviceCheckError, match=f"arrival check of local expert 5.*observed {DISPATCH + 1}, "
                                               f"expected {DISPATCH}"):
        role3_finalize.raise_for_finalize_status(buf)
    role3_finalize.raise_for_finalize_status(buf)  # the record was cleared
    assert_bits_equal(y, expected_y(data, buf.shape), "combine after a failed arrival check")
    assert_state_after(buf, 4, parity)  # the protocol state still advances: peers must not hang on this rank


def _stand_in_node(buf: GcMoeBuffer, seq: torch.Tensor, status: torch.Tensor) -> KernelNode:
    def args(flags: int) -> KernelArgs:
        return KernelArgs(type(buf.peer_table).from_buffer_copy(buf.peer_table), type(buf.offsets).from_buffer_copy(
            buf.offsets), ptr(seq), ptr(status), u32(DISPATCH), u32(buf.shape.num_experts),
            u32(buf.shape.num_local_experts), u32(flags))

    return KernelNode.make("standin", module().kernel("ft_stand_in"), Role.COMPUTE, 1, 256, args(0),
                           warmup_args=args(1))


@pytest.mark.gpu
def test_role3_1000_graph_replays_phase_encoding(group: dist.ProcessGroup) -> None:
    """[stand-in for role1/role2 -> role3] replayed 1000 times without host reset (half of them from inside a torch
    capture): each stand-in checks the state role3 left (replay_seq, parity, readiness, zeros) and leaves new
    counts in recv_counts[n & 1]; the statistics must add every replay's counts, y must be exact at the end."""
    buf = _buffer(group, "k6s1h5120")
    part = get_partition()
    data = make_rank_data(torch.Generator().manual_seed(11), buf.shape, 77)
    stage_inputs(buf, data)
    stage_combine(buf, 0, data, buf.shape)
    seq = torch.zeros(1, dtype=torch.int64, device="cuda")
    stand_in_status = new_status("cuda")
    stats = torch.zeros(buf.shape.num_local_experts, dtype=torch.int32, device="cuda")
    y, full = poisoned_y(77, buf.shape.hidden)
    torch.cuda.synchronize()
    nodes = [_stand_in_node(buf, seq, stand_in_status),
             role3_finalize.finalize_node(buf, y, deps=("standin",), recv_stats=stats, dispatch_sms=DISPATCH)]
    graph = get_graph(nodes, part)
    outer = torch.cuda.CUDAGraph()
    with torch.cuda.graph(outer):
        graph.launch()
    torch.cuda.synchronize()
    assert int(seq.item()) == 0  # capture ran nothing
    for n in range(CHECK_EVERY, REPLAYS + 1, CHECK_EVERY):
        for _ in range(CHECK_EVERY):
            if n <= REPLAYS // 2:
                graph.launch()
            else:
                outer.replay()
        torch.cuda.synchronize()
        raise_for_status(stand_in_status, f"stand-in after {n} replays", STAND_IN_SITES)
        role3_finalize.raise_for_finalize_status(buf, f"role3 after {n} replays")
        assert (int(seq.item()), int(buf.replay_seq.item()), int(buf.recv_parity.item())) == (n, n, n & 1)
        assert buf.combine_ready.tolist() == [n] and int(buf.finalize_arrive.item()) == 0
    assert_bits_equal(y, expected_y(data, buf.shape), "y after 1000 replays")
    assert bool((full[77].view(torch.int16) == Y_POISON).all())
    le = torch.arange(buf.shape.num_local_experts)
    want = sum((n * 7 + le) % 97 for n in range(REPLAYS))  # ft_stand_in's counts, source rank 0
    assert torch.equal(stats.cpu(), want.to(torch.int32))


def _simulated_pair(group: dist.ProcessGroup, shape: MoEShape) -> list[GcMoeBuffer]:
    """Two workspaces of a P = 2 layout on this GPU, each with a peer table reaching both: two ranks' protocol on
    one device (same kernel code; the system-scope signals stay on one GPU)."""
    part = get_partition()
    layout = OperatorLayout.build(shape, part.compute_sms)
    plan = PartitionPlan("on", part.request, part.dispatch_sms, part.compute_sms)
    bufs = [GcMoeBuffer(group, shape, layout, plan, part.compute_sms) for _ in range(2)]
    addresses = [b.storage.data_ptr() for b in bufs]
    for rank, buf in enumerate(bufs):
        buf.peer_table = make_peer_table(addresses, rank)
    return bufs


PAIR_SHAPE = MoEShape(num_experts=8, num_ranks=2, hidden=1024, intermediate=256, topk=3, num_shared_experts=1,
                      capacity=64, mma_type="fp8xfp8")


@pytest.mark.gpu
def test_role3_two_ranks_on_one_gpu_wait_for_each_other(group: dist.ProcessGroup) -> None:
    """Rank 0 on the compute partition, rank 1 on the communication partition, concurrently. Each scatters its
    partials for the other's tokens into the other's combine buffer right before its role3; rank 1 starts 50 ms
    late, so rank 0's combine must wait for rank 1's readiness or read poison. Three rounds (parities 0, 1, 0), rank
    0 with T = 0 in the second one."""
    part = get_partition()
    bufs = _simulated_pair(group, PAIR_SHAPE)
    sides = [part.compute, part.comm]
    warm_up(bufs[0], part.compute.stream, part.comm.stream)
    for rnd, tokens in enumerate([(40, 64), (0, 64), (64, 13)]):
        gen = torch.Generator().manual_seed(100 + rnd)
        datas = [make_rank_data(gen, PAIR_SHAPE, t) for t in tokens]
        parities = []
        for rank, buf in enumerate(bufs):
            assert int(buf.replay_seq.item()) == rnd and buf.combine_ready.tolist() == [rnd, rnd]
            stage_inputs(buf, datas[rank])
            stage_combine(buf, rank, datas[rank], PAIR_SHAPE)
            parities.append(stage_counters(buf, recv_counts(datas, rank, PAIR_SHAPE), DISPATCH))
        ys = [poisoned_y(t, PAIR_SHAPE.hidden)[0] for t in tokens]
        rows = [[x.cuda() for x in remote_rows(datas, rank, PAIR_SHAPE)] for rank in range(2)]
        torch.cuda.synchronize()  # staging runs on torch's stream, the launches on the partitions' streams
        for rank in (1, 0):
            if rank == 1:
                delay(50_000_000, sides[1].stream)
            scatter(*rows[rank], bufs[rank], sides[rank].stream)
            role3_finalize.launch_finalize(bufs[rank], ys[rank], sides[rank].stream, dispatch_sms=DISPATCH,
                                     max_ctas=sides[rank].sm_count)
        sync(*sides)
        for rank, buf in enumerate(bufs):
            role3_finalize.raise_for_finalize_status(buf, f"rank {rank} round {rnd}")
            assert_bits_equal(ys[rank], expected_y(datas[rank], PAIR_SHAPE), f"rank {rank} round {rnd}")
            assert_state_after(buf, rnd, parities[rank])
            assert buf.combine_ready.tolist() == [rnd + 1, rnd + 1]


@pytest.mark.gpu
def test_role3_missing_peer_times_out_and_ahead_peer_is_reported(group: dist.ProcessGroup) -> None:
    part = get_partition()
    bufs = _simulated_pair(group, PAIR_SHAPE)
    data = make_rank_data(torch.Generator().manual_seed(7), PAIR_SHAPE, 30)
    stage_inputs(bufs[0], data)
    stage_combine(bufs[0], 0, data, PAIR_SHAPE)
    parity = stage_counters(bufs[0], recv_counts([data, make_rank_data(torch.Generator(), PAIR_SHAPE, 0)], 0,
                                                 PAIR_SHAPE), DISPATCH)
    y, _ = poisoned_y(30, PAIR_SHAPE.hidden)
    torch.cuda.synchronize()
    start = time.monotonic()
    role3_finalize.launch_finalize(bufs[0], y, part.compute.stream, dispatch_sms=DISPATCH, timeout_ms=300)
    sync(part.compute)
    elapsed = time.monotonic() - start
    with pytest.raises(DeviceTimeoutError, match="waiting for rank 1's combine readiness: observed 0, expected 1"):
        role3_finalize.raise_for_finalize_status(bufs[0])
    assert 0.3 <= elapsed < 5, elapsed
    assert bool((y.view(torch.int16) == Y_POISON).all()), "a timed-out combine must not write y"
    assert bufs[1].combine_ready.tolist() == [1, 0]  # readiness published to the peer all the same
    assert_state_after(bufs[0], 0, parity)

    bufs[0].combine_ready[1] = 3  # replay 1 waits for 2: a peer two replays ahead breaks the protocol
    stage_counters(bufs[0], torch.zeros(2, PAIR_SHAPE.num_local_experts, dtype=torch.int64), DISPATCH)
    torch.cuda.synchronize()
    role3_finalize.launch_finalize(bufs[0], y, part.compute.stream, dispatch_sms=DISPATCH, timeout_ms=300)
    sync(part.compute)
    with pytest.raises(DeviceCheckError, match="readiness of rank 1 past this replay: observed 3, expected 2"):
        role3_finalize.raise_for_finalize_status(bufs[0])


@pytest.mark.gpu
def test_role3_kit_emulated_combine_matches_reference(group: dist.ProcessGroup) -> None:
    """The GPU tests' own staging: the combine buffers two ranks hold after local staging plus the peers' rows (here
    written by torch), summed in slot order over valid slots on the host, give the expected y and hold no poison in
    a valid slot, so a mismatch in the tests above is the kernel's."""
    bufs = _simulated_pair(group, PAIR_SHAPE)
    datas = [make_rank_data(torch.Generator().manual_seed(5), PAIR_SHAPE, t) for t in (64, 21)]
    for rank, buf in enumerate(bufs):
        stage_combine(buf, rank, datas[rank], PAIR_SHAPE)
    for writer in range(2):
        rows, data = remote_rows(datas, writer, PAIR_SHAPE)
        for (dst, slot, token, _), row in zip(rows.tolist(), data, strict=True):
            bufs[dst].combine[slot, token] = row.cuda()
    for rank, buf in enumerate(bufs):
        t = datas[rank].tokens
        valid = torch.cat([datas[rank].topk_idx >= 0, torch.ones(t, 1, dtype=torch.bool)], dim=1)
        staged = buf.combine[:, :t].transpose(0, 1).cpu()
        assert not bool(staged[valid].isnan().any()), "a valid slot still holds poison"
        assert torch.equal(staged[valid], datas[rank].partials[valid])
        emulated = torch.zeros(t, PAIR_SHAPE.hidden)
        for s in range(PAIR_SHAPE.num_combine_slots):
            emulated = torch.where(valid[:, s, None], emulated + staged[:, s].float(), emulated)
        assert_bits_equal(emulated.to(torch.bfloat16), expected_y(datas[rank], PAIR_SHAPE), f"rank {rank}")
