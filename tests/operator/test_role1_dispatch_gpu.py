"""Role1 (SM90 dispatch, kernels/sm90/role1_dispatch.cu) on one H200, alone: stand-ins play role2's side of the ring
(capture every block generation, release l1_empty/l2_empty) and role3's bookkeeping (arrival check, resets, parity
flip, replay_seq). Every run starts from a poisoned ring and fresh random routing; the ring, its scales, weights,
l1_source, pool_table, src_index, the packed counters and l1_full_count must equal the oracle exactly."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from role1_kit import (
    ROUTINGS,
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

from gc_moe_compat.operator import api
from gc_moe_compat.operator.buffer import GcMoeBuffer
from gc_moe_compat.operator.ring import RingModel, RingPlan
from gc_moe_compat.operator.sm90 import role1_dispatch
from gc_moe_compat.runtime.graph import KernelNode, get_graph
from gc_moe_compat.runtime.green import Partition, Role, get_partition
from gc_moe_compat.runtime.launch import launch
from gc_moe_compat.runtime.params import KernelArgs
from gc_moe_compat.runtime.status import DeviceCheckError, DeviceTimeoutError, new_status
from gc_moe_compat.testing.operator_workload import RankInputs

pytestmark = pytest.mark.gpu

SHAPES = {
    "small": dict(num_experts=16, capacity=256, topk=4, hidden=512, intermediate=256),
    "wide": dict(num_experts=64, capacity=64, topk=8, hidden=7168, intermediate=256),
}
TIMEOUT_MS = 5_000
REPLAYS, RESTAGE_EVERY = 1_000, 100


class Rig:
    """One buffer on the default partition with warmed-up kernels: runs role1 + stand-ins eagerly and checks."""

    def __init__(self, group: dist.ProcessGroup, shape: str, idx_dtype: torch.dtype = torch.int64) -> None:
        self.part: Partition = get_partition()
        self.buf: GcMoeBuffer = api.get_symm_buffer_for_gc_moe(group, **SHAPES[shape], topk_idx_dtype=idx_dtype)
        assert self.buf.dispatch_sms == self.part.dispatch_sms >= 2
        self.mod = standins()
        self.replays = 0
        self.gen = torch.Generator().manual_seed(17 * len(shape) + idx_dtype.itemsize)
        scratch_plan = self.plan(8, 1)
        scratch = CaptureBuffers.allocate(self.buf, 8)
        status = new_status("cuda")
        torch.cuda.synchronize()
        launch(self.mod.kernel("dt_consume"), 1, 256, consume_args(self.buf, scratch, scratch_plan, status,
                                                                    warmup=True), self.part.compute.stream)
        launch(self.mod.kernel("dt_finalize"), 1, 256, finalize_args(self.buf, status, warmup=True),
               self.part.compute.stream)
        launch(role1_dispatch.kernel(), self.buf.dispatch_sms, role1_dispatch.THREADS,
               role1_dispatch.dispatch_args(self.buf, scratch_plan, 0, warmup=True), self.part.comm.stream)
        sync(self.part.comm, self.part.compute)
        raise_for_standin(status, "warm-up")

    def plan(self, bm: int, ring_blocks: int) -> RingPlan:
        return RingPlan.for_model(RingModel(self.buf.shape, bm, self.buf.compute_sms), ring_blocks)

    def run(self, inputs: RankInputs, plan: RingPlan, *, consume: bool = True, delay_ns: int = 0,
            timeout_ms: float = TIMEOUT_MS,
            consume_timeout_ms: float = TIMEOUT_MS) -> tuple[CaptureBuffers, torch.Tensor]:
        """Stages ``inputs``, poisons every output, runs role1 (+ the consumer); returns (capture, consumer status).
        Raises role1's error, if any, after both streams finished."""
        cap = CaptureBuffers.allocate(self.buf, plan.block_m)
        cap.poison()
        stage(self.buf, inputs)
        poison_outputs(self.buf)
        status = new_status("cuda")
        torch.cuda.synchronize()  # green streams do not order after torch's stream
        if consume:
            launch(self.mod.kernel("dt_consume"), 1, 256,
                   consume_args(self.buf, cap, plan, status, delay_ns=delay_ns, timeout_ms=consume_timeout_ms),
                   self.part.compute.stream)
        role1_dispatch.launch_dispatch(self.buf, plan, inputs.tokens, self.part.comm.stream, timeout_ms=timeout_ms)
        sync(self.part.comm, self.part.compute)
        role1_dispatch.raise_for_dispatch_status(self.buf)
        return cap, status

    def finalize(self) -> None:
        status = new_status("cuda")
        launch(self.mod.kernel("dt_finalize"), 1, 256, finalize_args(self.buf, status), self.part.compute.stream)
        sync(self.part.compute)
        raise_for_standin(status, "stand-in role3")
        self.replays += 1
        b = self.buf
        assert int(b.replay_seq) == self.replays and int(b.recv_parity) == self.replays % 2
        assert not b.send_counts.any() and not b.recv_counts.any() and int(b.pool_header) == 0
        assert not b.l1_full_count.any() and not b.l1_empty_count.any() and not b.l2_empty_count.any()

    def run_and_check(self, kind: str, tokens: int, plan: RingPlan) -> None:
        inputs = make_inputs(kind, tokens, self.buf, self.gen)
        parity = self.replays % 2
        cap, status = self.run(inputs, plan)
        raise_for_standin(status, "stand-in role2")
        exp = expected([inputs], 0, self.buf, plan)
        check_capture(cap, exp, plan)
        check_ring(self.buf, exp)
        check_src_index(self.buf, exp, self.buf.shape.topk)
        check_counters(self.buf, exp, plan, parity, self.replays)
        assert not self.buf.recv_counts[1 - parity].any()
        self.finalize()


CASES = [  # shape, routing, T, BM, R (small R: many generations per ring block, so refills are waited for)
    ("small", "uniform", 1, 8, 2),
    ("small", "uniform", 37, 8, 1),
    ("small", "zipf", 200, 16, 2),
    ("small", "one_expert", 256, 64, 2),
    ("small", "holes", 64, 16, 3),
    ("small", "uniform", 0, 16, 2),
    ("small", "uniform", 256, 32, 3),
    ("wide", "zipf", 64, 16, 2),
    ("wide", "uniform", 64, 64, 1),
    ("wide", "holes", 3, 8, 4),
]


@pytest.mark.parametrize(("shape", "kind", "tokens", "bm", "ring_blocks"), CASES)
def test_role1_eager_ring_is_exact(group: dist.ProcessGroup, shape: str, kind: str, tokens: int, bm: int,
                                   ring_blocks: int) -> None:
    """Three consecutive calls on one buffer (replay phases 0, 1, 2; parity 0, 1, 0), each with fresh inputs."""
    rig = Rig(group, shape)
    plan = rig.plan(bm, ring_blocks)
    for _ in range(3):
        rig.run_and_check(kind, tokens, plan)


@pytest.mark.parametrize("kind", ROUTINGS)
def test_role1_int32_ids_and_the_operator_ring_plan(group: dist.ProcessGroup, kind: str) -> None:
    """int32 topk_idx, and the ring plan the operator itself picks (api.ring_plan: heuristic BM, full ring)."""
    rig = Rig(group, "small", torch.int32)
    for tokens in (5, 100, 256):
        rig.run_and_check(kind, tokens, api.ring_plan(rig.buf, tokens))


def test_role1_graph_1000_replays_with_parity_flips(group: dist.ProcessGroup) -> None:
    """Role1 and the stand-in consumer as concurrent graph roots, the stand-in role3 after both: 1000 replays (half
    through an outer torch.cuda.graph capture), fresh routing every 100 (restaged in place, same T), every replay
    checked exactly with no host reset; the first replay of each routing also starts from a poisoned ring."""
    rig = Rig(group, "small")
    buf, tokens = rig.buf, 96
    plan = rig.plan(16, 2)
    cap = CaptureBuffers.allocate(buf, plan.block_m)
    s2, s3 = new_status("cuda"), new_status("cuda")
    nodes = [
        role1_dispatch.dispatch_node(buf, plan, tokens, timeout_ms=TIMEOUT_MS),
        KernelNode.make("consume", rig.mod.kernel("dt_consume"), Role.COMPUTE, 1, 256,
                        KernelArgs(*consume_args(buf, cap, plan, s2)),
                        warmup_args=KernelArgs(*consume_args(buf, cap, plan, s2, warmup=True))),
        KernelNode.make("finalize", rig.mod.kernel("dt_finalize"), Role.COMPUTE, 1, 256,
                        KernelArgs(*finalize_args(buf, s3)), deps=("role1", "consume"),
                        warmup_args=KernelArgs(*finalize_args(buf, s3, warmup=True))),
    ]
    graph = get_graph(nodes, rig.part)
    outer = torch.cuda.CUDAGraph()
    with torch.cuda.graph(outer):
        graph.launch()
    exp = None
    for n in range(REPLAYS):
        fresh = n % RESTAGE_EVERY == 0
        if fresh:
            inputs = make_inputs(ROUTINGS[(n // RESTAGE_EVERY) % len(ROUTINGS)], tokens, buf, rig.gen)
            stage(buf, inputs)
            poison_outputs(buf)
            exp = expected([inputs], 0, buf, plan)
        cap.poison()
        torch.cuda.synchronize()
        if n < REPLAYS // 2:
            graph.launch()
        else:
            outer.replay()
        torch.cuda.synchronize()
        role1_dispatch.raise_for_dispatch_status(buf, f"role1, replay {n}")
        raise_for_standin(s2, f"stand-in role2, replay {n}")
        raise_for_standin(s3, f"stand-in role3, replay {n}")
        check_capture(cap, exp, plan)
        if fresh:
            check_ring(buf, exp)
            check_src_index(buf, exp, buf.shape.topk)
        counters = torch.cat([buf.tag1_barrier, buf.replay_seq, buf.recv_parity]).tolist()
        assert counters == [n + 1, n + 1, (n + 1) % 2], (n, counters)


def test_role1_refill_waits_time_out_into_status_and_the_next_call_works(group: dist.ProcessGroup) -> None:
    """No consumer releases l1_empty -> DeviceTimeoutError at the l1_empty refill wait; a consumer that releases
    l2_empty only after role1's timeout -> DeviceTimeoutError at the l2_empty wait. Neither hangs, and a normal call
    afterwards (state reset by the stand-in role3) is exact."""
    rig = Rig(group, "small")
    plan = rig.plan(8, 1)
    inputs = make_inputs("uniform", 37, rig.buf, rig.gen)
    start = time.monotonic()
    with pytest.raises(DeviceTimeoutError, match="l1_empty_count"):
        rig.run(inputs, plan, consume=False, timeout_ms=300)
    assert time.monotonic() - start < 5
    rig.finalize()
    # 37 tokens x top-4 = 148 rows in BM=8 blocks over 16 experts: 19..34 pool blocks. A ring of 18 blocks makes every
    # refill a generation-1 wait, whose l1_empty the stand-in releases at once: only the l2_empty wait can time out.
    two_generations = rig.plan(8, 18)
    start = time.monotonic()
    with pytest.raises(DeviceTimeoutError, match="l2_empty_count"):
        rig.run(inputs, two_generations, delay_ns=1_500_000_000, timeout_ms=300, consume_timeout_ms=3_000)
    assert time.monotonic() - start < 10
    rig.finalize()
    rig.run_and_check("zipf", 120, plan)


@pytest.mark.parametrize("tokens", [200, 50])
def test_role1_tag1_barrier_times_out_when_a_phase_never_completes(group: dist.ProcessGroup, tokens: int) -> None:
    """replay_seq one ahead of tag1_barrier (as when a peer never arrives). The staged path (T·k = 800 > 512) waits
    for P·(n+1) arrivals, gets one fewer (its own arrival is counted) and ends in DeviceTimeoutError at the tag-1
    barrier within the timeout, without hanging; the one-rank path (T·k = 200) waits for no arrival: its add finds the
    phase behind and it raises DeviceCheckError at the tag-1 site at once. Neither publishes a block table; the next
    operator (a new buffer) works."""
    rig = Rig(group, "small")
    rig.run_and_check("uniform", 50, rig.plan(16, 2))
    rig.buf.replay_seq += 1
    inputs = make_inputs("uniform", tokens, rig.buf, rig.gen)
    staged = tokens * rig.buf.shape.topk > role1_dispatch.THREADS
    start = time.monotonic()
    with pytest.raises(DeviceTimeoutError if staged else DeviceCheckError, match="tag-1 barrier"):
        rig.run(inputs, rig.plan(16, 2), consume=False, timeout_ms=400 if staged else 3_000)
    elapsed = time.monotonic() - start
    assert (0.4 <= elapsed < 5) if staged else elapsed < 1.5  # the one-rank path does not wait out its 3 s
    assert int(rig.buf.tag1_barrier) == 2 and int(rig.buf.pool_header) == 0
    rig.buf.destroy()
    fresh = Rig(group, "small")
    fresh.run_and_check("holes", 50, fresh.plan(16, 2))
