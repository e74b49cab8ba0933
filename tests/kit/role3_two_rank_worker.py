"""One rank of role3's two-rank test (started by test_role3_finalize_two_rank.py through torchrun).

Both ranks build the same global routing and partials per round (same seed). Each rank poisons its combine buffer,
writes the partials its own role2/role4 would produce for its own tokens, then (after a barrier standing in for the
tag-1 barrier) scatters the partials of the PEER's tokens whose expert it owns into the peer's combine buffer through
the peer table and runs role3, on the compute partition; one rank starts 30 ms late, so the other's combine must
wait for its readiness. Rounds cover both parities and T = 0 on either rank; the outputs must equal the reference
combine bit for bit, the per-replay state must be reset and the statistics accumulated. Last, rank 0 runs role3
while rank 1 stays away: DeviceTimeoutError naming rank 1 after the configured timeout. Prints ``PASS rank <r>``.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from role3_kit import (
    Y_POISON,
    assert_bits_equal,
    assert_state_after,
    delay,
    expected_y,
    make_rank_data,
    poisoned_y,
    recv_counts,
    remote_rows,
    scatter,
    stage_combine,
    stage_counters,
    stage_inputs,
    warm_up,
)
from runtime_kit import sync
from two_rank import MISSING_PEER_TIMEOUT_MS, finish, join, raises

from gc_moe_compat.operator.buffer import get_symm_buffer_for_gc_moe
from gc_moe_compat.operator.sm90 import role3_finalize
from gc_moe_compat.references import reference
from gc_moe_compat.runtime.green import get_partition
from gc_moe_compat.runtime.status import DeviceTimeoutError

ROUNDS = [(48, 64), (0, 37), (64, 0), (64, 64), (5, 1)]
"""Tokens of (rank 0, rank 1) per round."""
LATE_NS = 30_000_000


def main() -> None:
    rank = join()
    buf = get_symm_buffer_for_gc_moe(dist.group.WORLD, 8, 64, 3, 1024, 256, "fp8xfp8", num_shared_experts=1)
    shape, part = buf.shape, get_partition()
    stream = part.compute.stream

    warm_up(buf, stream)  # first launches can serialize (FACTS.md)
    dist.barrier()

    stats = torch.zeros(shape.num_local_experts, dtype=torch.int32, device="cuda")
    stats_want = torch.zeros(shape.num_local_experts, dtype=torch.int32)
    for rnd, tokens in enumerate(ROUNDS):
        gen = torch.Generator().manual_seed(1000 + rnd)  # the same global data on both ranks
        datas = [make_rank_data(gen, shape, t) for t in tokens]
        assert int(buf.replay_seq.item()) == rnd and buf.combine_ready.tolist() == [rnd, rnd], rnd
        stage_inputs(buf, datas[rank])
        stage_combine(buf, rank, datas[rank], shape)
        parity = stage_counters(buf, recv_counts(datas, rank, shape), buf.dispatch_sms)
        assert parity == rnd & 1
        rows = [x.cuda() for x in remote_rows(datas, rank, shape)]
        y, full = poisoned_y(tokens[rank], shape.hidden)
        torch.cuda.synchronize()
        dist.barrier()  # every rank's poison and own partials land before a peer scatters (role1's tag-1 barrier)

        start = time.monotonic()
        if rank == rnd % 2:
            delay(LATE_NS, stream)
        scatter(*rows, buf, stream)
        role3_finalize.launch_finalize(buf, y, stream, recv_stats=stats)
        sync(part.compute)
        elapsed = time.monotonic() - start
        role3_finalize.raise_for_finalize_status(buf, f"rank {rank} round {rnd}")
        assert_bits_equal(y, expected_y(datas[rank], shape), f"rank {rank} round {rnd}")
        assert bool((full[tokens[rank]].view(torch.int16) == Y_POISON).all()), "wrote past y"
        assert_state_after(buf, rnd, parity)
        plan = reference.dispatch_plan([d.topk_idx for d in datas], shape.num_experts)
        stats_want += reference.recv_counts(plan)[rank]
        print(f"rank {rank}: round {rnd} (T = {tokens}) exact in {elapsed:.4f} s")
        dist.barrier()
        assert buf.combine_ready.tolist() == [rnd + 1, rnd + 1]
    assert torch.equal(stats.cpu(), stats_want), (stats.cpu(), stats_want)

    if rank == 0:
        data = make_rank_data(torch.Generator().manual_seed(7), shape, 16)
        stage_inputs(buf, data)
        stage_combine(buf, rank, data, shape)
        stage_counters(buf, recv_counts([data, data], rank, shape), buf.dispatch_sms)
        y, _ = poisoned_y(16, shape.hidden)
        torch.cuda.synchronize()
        with raises(DeviceTimeoutError, rank, "missing peer", "waiting for rank 1's combine readiness",
                    timeout_ms=MISSING_PEER_TIMEOUT_MS):
            role3_finalize.launch_finalize(buf, y, stream, timeout_ms=MISSING_PEER_TIMEOUT_MS)
            sync(part.compute)
            role3_finalize.raise_for_finalize_status(buf, "rank 0 with rank 1 absent")
        assert bool((y.view(torch.int16) == Y_POISON).all()), "a timed-out combine must not write y"
    finish(rank)


if __name__ == "__main__":
    main()
