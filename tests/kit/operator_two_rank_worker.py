"""One rank of the operator's multi-rank test (started by test_operator_two_rank.py through torchrun on P ranks).

The compute path comes from ``GC_MOE_TEST_MMA_TYPE`` (``fp8xfp8``, the default, or ``fp8xfp4``). Both ranks build
every rank's weights and inputs from the same seeds, stage their own and call ``fp8_fp8_gc_moe`` /
``fp8_fp4_gc_moe`` on a P-rank symmetric buffer (partition on, then off): each rank's ``y`` must meet the
quantization-faithful targets against the P-rank reference (expert_parallel_reference), for the T sweep, T = 0 on some
or all ranks, Zipf, one-expert and -1-slot routing, and different T per rank (each case's per-rank token counts
repeat over the ranks); ring payloads, combine and ``y`` are poisoned before every call. Then rank 1 stays away from
one call: rank 0 must get DeviceTimeoutError naming role1's tag-1 barrier, and a buffer created afterwards must work
on every rank. Prints ``PASS rank <r>``.

Every preset runs at P = 2; with more ranks (several sharing one GPU, where every process holds every rank's weights
for the reference) the ``tiny`` preset alone.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from operator_kit import (
    CALLS,
    CAPACITY,
    SWEEP,
    check_accuracy,
    make_inputs,
    make_weights,
    poisoned_y,
    preset_dims,
    reference_ys,
    stage,
    start_call,
)
from two_rank import MISSING_PEER_TIMEOUT_MS, join, raises, report_pass, spin_timeout

from gc_moe_compat.operator import api
from gc_moe_compat.runtime.status import DeviceTimeoutError

MMA_TYPE = os.environ.get("GC_MOE_TEST_MMA_TYPE", "fp8xfp8")
CALL = CALLS[MMA_TYPE]
CASES = [("uniform", (t, t)) for t in SWEEP] + [
    ("uniform", (0, 5)), ("uniform", (37, 0)), ("uniform", (0, 0)), ("zipf", (CAPACITY, 64)),
    ("one_expert", (CAPACITY, CAPACITY)), ("holes", (1, 200)), ("zipf", (3, CAPACITY)),
]


def _buffer(preset: str, partition: str) -> api.GcMoeBuffer:
    e, k, h, inter = preset_dims(preset)
    return api.get_symm_buffer_for_gc_moe(dist.group.WORLD, e * dist.get_world_size(), CAPACITY, k, h, inter,
                                          MMA_TYPE, partition=partition)


def _round(buf: api.GcMoeBuffer, weights: list, preset: str, kind: str, pattern: tuple[int, ...], seed: int,
           rank: int) -> None:
    world = dist.get_world_size()
    tokens = tuple(pattern[r % len(pattern)] for r in range(world))
    e, k, h, _ = preset_dims_of(buf)
    inputs = [make_inputs(kind, t, e * world, k, h, seed=seed * world + r) for r, t in enumerate(tokens)]
    y = start_call(buf, inputs[rank])
    torch.cuda.synchronize()
    dist.barrier()  # no peer scatters into this rank's combine buffer before it is poisoned
    CALL(y, weights[rank].w1, weights[rank].w2, buf)
    torch.cuda.synchronize()
    if tokens[rank]:
        m = check_accuracy(y, reference_ys(inputs, weights)[rank], f"rank {rank} {MMA_TYPE} {kind} T={tokens}",
                           preset)
        print(f"rank {rank}: {MMA_TYPE} {preset} {buf.partition} {kind} T={tokens}: cosine {m['cosine']:.7f} processed "
              f"{m['processed_diff']:.2e}", flush=True)
    dist.barrier()  # every rank finished reading its combine buffer before peers write the next round


def preset_dims_of(buf: api.GcMoeBuffer) -> tuple[int, int, int, int]:
    s = buf.shape
    return s.num_local_experts, s.topk, s.hidden, s.intermediate


def main() -> None:
    rank = join()
    world = dist.get_world_size()
    for preset in ("tiny", "dsv41-flash", "glm52") if world == 2 else ("tiny",):
        weights = [make_weights(preset, r, mma_type=MMA_TYPE) for r in range(world)]  # every rank's, for the reference
        for partition in ("on", "off"):
            buf = _buffer(preset, partition)
            for i, (kind, tokens) in enumerate(CASES):
                _round(buf, weights, preset, kind, tokens, seed=i, rank=rank)
            buf.destroy()
        del weights
        torch.cuda.empty_cache()

    preset = "tiny"
    weights = [make_weights(preset, r, mma_type=MMA_TYPE) for r in range(world)]
    with spin_timeout(MISSING_PEER_TIMEOUT_MS):  # read when the call's graph is built
        buf = _buffer(preset, "on")
        if rank == 0:
            e, k, h, _ = preset_dims(preset)
            stage(buf, make_inputs("uniform", 16, e * world, k, h, seed=99))
            y = poisoned_y(16, h)
            with raises(DeviceTimeoutError, rank, "rank 1 absent", "role1", "tag-1 barrier"):
                CALL(y, weights[0].w1, weights[0].w2, buf)
        dist.barrier()
    fresh = _buffer(preset, "on")  # the next operator created after the failure works on both ranks
    _round(fresh, weights, preset, "uniform", (16, 16), seed=123, rank=rank)
    report_pass(rank)


if __name__ == "__main__":
    main()
