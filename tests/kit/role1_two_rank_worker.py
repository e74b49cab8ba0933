"""One rank of role1's two-rank test (started by test_role1_two_rank.py through torchrun).

Both ranks generate every rank's inputs from the same seeds, stage their own, and run role1 (communication
partition) with the stand-in consumer (compute partition) and the stand-in role3 between rounds: each rank's ring,
scales, weights, l1_source, pool_table, src_index (written by both ranks) and packed counters must equal the oracle
for the rows pulled from both ranks. Rounds cover uniform, Zipf, one-expert and holed routing, T = 0 and T =
capacity on either rank, and several BM / ring sizes, with the receive parity flipping every round. Finally rank 1
stays away: rank 0 must get DeviceTimeoutError at the tag-1 barrier within its timeout. Prints ``PASS rank <r>``.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from role1_kit import (
    CaptureBuffers,
    check_capture,
    check_counters,
    check_ring,
    check_src_index,
    consume_args,
    expected,
    finalize_args,
    make_inputs,
    poison_outputs,
    raise_for_standin,
    stage,
    standins,
    sync,
)
from two_rank import MISSING_PEER_TIMEOUT_MS, finish, join, raises

from gc_moe_compat.operator import api
from gc_moe_compat.operator.ring import RingModel, RingPlan
from gc_moe_compat.operator.sm90 import role1_dispatch
from gc_moe_compat.runtime.green import get_partition
from gc_moe_compat.runtime.launch import launch
from gc_moe_compat.runtime.status import DeviceTimeoutError, new_status

CAPACITY = 128
ROUNDS = [  # routing, tokens per rank, BM, ring blocks
    ("uniform", (37, 90), 8, 2),
    ("zipf", (CAPACITY, CAPACITY), 16, 2),
    ("one_expert", (CAPACITY, 100), 64, 1),
    ("holes", (0, 64), 16, 3),
    ("uniform", (CAPACITY, 0), 32, 2),
    ("uniform", (0, 0), 16, 2),
] * 2


def main() -> None:
    rank = join()
    part = get_partition()
    buf = api.get_symm_buffer_for_gc_moe(dist.group.WORLD, num_experts=16, capacity=CAPACITY, topk=4, hidden=1024,
                                            intermediate=256)
    mod = standins()
    consume, finalize = mod.kernel("dt_consume"), mod.kernel("dt_finalize")

    def plan_of(bm: int, ring_blocks: int) -> RingPlan:
        return RingPlan.for_model(RingModel(buf.shape, bm, buf.compute_sms), ring_blocks)

    # First launches can serialize (docs/platform_notes.md): every kernel once in the context that will run it.
    scratch, status = CaptureBuffers.allocate(buf, 8), new_status("cuda")
    launch(consume, 1, 256, consume_args(buf, scratch, plan_of(8, 1), status, warmup=True), part.compute.stream)
    launch(finalize, 1, 256, finalize_args(buf, status, warmup=True), part.compute.stream)
    launch(role1_dispatch.kernel(), buf.dispatch_sms, role1_dispatch.THREADS,
           role1_dispatch.dispatch_args(buf, plan_of(8, 1), 0, warmup=True), part.comm.stream)
    sync(part.comm, part.compute)
    dist.barrier()

    for i, (kind, tokens, bm, ring_blocks) in enumerate(ROUNDS):
        gen = torch.Generator().manual_seed(1000 + i)
        inputs = [make_inputs(kind, t, buf, gen) for t in tokens]  # identical on both ranks
        plan = plan_of(bm, ring_blocks)
        cap = CaptureBuffers.allocate(buf, bm)
        cap.poison()
        stage(buf, inputs[rank])
        poison_outputs(buf)
        torch.cuda.synchronize()
        dist.barrier()  # no peer writes into this rank's src_index before it is poisoned
        status = new_status("cuda")
        start = time.monotonic()
        launch(consume, 1, 256, consume_args(buf, cap, plan, status), part.compute.stream)
        role1_dispatch.launch_dispatch(buf, plan, inputs[rank].tokens, part.comm.stream)
        sync(part.comm, part.compute)
        elapsed = time.monotonic() - start
        role1_dispatch.raise_for_dispatch_status(buf, f"rank {rank} role1, round {i}")
        raise_for_standin(status, f"rank {rank} stand-in role2, round {i}")
        exp = expected(inputs, rank, buf, plan)
        check_capture(cap, exp, plan)
        check_ring(buf, exp)
        check_src_index(buf, exp, buf.shape.topk)
        check_counters(buf, exp, plan, parity=i % 2, replay=i)
        dist.barrier()  # every rank has pulled before anyone resets or restages
        status = new_status("cuda")
        launch(finalize, 1, 256, finalize_args(buf, status), part.compute.stream)
        sync(part.compute)
        raise_for_standin(status, f"rank {rank} stand-in role3, round {i}")
        print(f"rank {rank}: round {i} {kind} T={tokens} BM={bm} R={ring_blocks}: {exp.rows.shape[0]} rows in "
              f"{exp.blocks} blocks exact ({elapsed * 1e3:.2f} ms)", flush=True)
        dist.barrier()

    if rank == 0:
        stage(buf, make_inputs("uniform", 16, buf, torch.Generator().manual_seed(7)))
        torch.cuda.synchronize()
        with raises(DeviceTimeoutError, rank, "rank 1 absent", "tag-1 barrier", timeout_ms=MISSING_PEER_TIMEOUT_MS):
            role1_dispatch.launch_dispatch(buf, plan_of(16, 2), 16, part.comm.stream,
                                           timeout_ms=MISSING_PEER_TIMEOUT_MS)
            sync(part.comm)
            role1_dispatch.raise_for_dispatch_status(buf, "rank 0 role1 with rank 1 absent")
    finish(rank)


if __name__ == "__main__":
    main()
