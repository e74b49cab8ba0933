"""One rank of the two-rank workspace test (started by test_runtime_two_rank.py through torchrun).

Each rank signals the peer through the peer table while waiting for the peer's signal (both directions at once,
producer on the communication partition, consumer on the compute partition), then waits for a signal nobody sends
and must get DeviceTimeoutError within the configured timeout. Prints ``PASS rank <r>`` on success.
"""

from __future__ import annotations

import time

import torch.distributed as dist
from runtime_kit import SITES, i32, module, sync, u32, u64
from two_rank import MISSING_PEER_TIMEOUT_MS, finish, join, raises

from gc_moe_compat.runtime.green import get_partition
from gc_moe_compat.runtime.launch import launch
from gc_moe_compat.runtime.params import ptr
from gc_moe_compat.runtime.status import DeviceTimeoutError, new_status, raise_for_status, spin_timeout_ns
from gc_moe_compat.runtime.workspace import LayoutPlanner, SymmetricWorkspace

PAYLOAD_WORDS = 1 << 18  # 1 MiB written into the peer before its flag is released
ROUNDS = 5


def main() -> None:
    rank = join()
    peer = 1 - rank
    part = get_partition()
    plan = LayoutPlanner()
    plan.add("signal", 128 + 4 * PAYLOAD_WORDS, alignment=4096)
    plan.add("unused", 128 + 4 * 64, alignment=4096)
    ws = SymmetricWorkspace(plan, dist.group.WORLD)
    mod = module()
    signal, wait = mod.kernel("rt_peer_signal"), mod.kernel("rt_peer_wait")
    table, timeout = ws.peer_table, u64(spin_timeout_ns(10_000))

    # First launches can serialize (docs/platform_notes.md): run each kernel once in the context that will run it.
    scratch = new_status("cuda")
    launch(wait, 1, 256, [table, u64(ws.offset("unused")), u64(0), u32(0), timeout, ptr(scratch)], part.compute.stream)
    launch(signal, 1, 256, [table, i32(rank), u64(ws.offset("unused")), u64(0), u32(0)], part.comm.stream)
    sync(part.compute, part.comm)
    dist.barrier()

    off = u64(ws.offset("signal"))
    for value in range(1, ROUNDS + 1):
        status = new_status("cuda")
        start = time.monotonic()
        launch(wait, 1, 1024, [table, off, u64(value), u32(PAYLOAD_WORDS), timeout, ptr(status)], part.compute.stream)
        launch(signal, 1, 1024, [table, i32(peer), off, u64(value), u32(PAYLOAD_WORDS)], part.comm.stream)
        sync(part.compute, part.comm)
        raise_for_status(status, f"rank {rank} waiting for rank {peer}, round {value}", SITES)
        print(f"rank {rank}: round {value} signal from rank {peer} + 1 MiB payload in {time.monotonic() - start:.4f} s")
        dist.barrier()

    status = new_status("cuda")
    with raises(DeviceTimeoutError, rank, "missing peer", timeout_ms=MISSING_PEER_TIMEOUT_MS):
        missing = [table, u64(ws.offset("unused")), u64(1), u32(0), u64(spin_timeout_ns(MISSING_PEER_TIMEOUT_MS))]
        launch(wait, 1, 256, [*missing, ptr(status)], part.compute.stream)
        sync(part.compute)
        raise_for_status(status, f"rank {rank} waiting for a signal rank {peer} never sends", SITES)
    finish(rank)


if __name__ == "__main__":
    main()
