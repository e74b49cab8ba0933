"""The role1 GPU tests' oracle on the host (no GPU): a step-by-step simulation of role1's writes, driven by the
kernel's own arithmetic (:func:`gc_moe_compat.operator.sm90.role1_dispatch.assign_rows` and the src_index lists),
passes every
check of role1_kit, and a single misplaced row fails them. So the GPU tests can pass, and they can fail."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from role1_kit import (  # noqa: E402
    CaptureBuffers,
    check_capture,
    check_counters,
    check_ring,
    check_src_index,
    expected,
    make_inputs,
    poison_outputs,
)

from gc_moe_compat.operator import api
from gc_moe_compat.operator.ring import RingPlan
from gc_moe_compat.operator.sm90.role1_dispatch import assign_rows


def _simulate(buffer: api.GcMoeBuffer, inputs: list, rank: int, plan: RingPlan, cap: CaptureBuffers) -> None:
    """Role1 of ``rank`` plus the stand-in consumer's capture, in program order, on host tensors."""
    s, d = buffer.shape, buffer.dispatch_sms
    k, e, ranks = s.topk, s.num_local_experts, len(inputs)
    parity = int(buffer.recv_parity) & 1
    for src, inp in enumerate(inputs):  # every rank's steps A-C, as far as they touch this rank
        flat = inp.topk_idx.reshape(-1)
        for le in range(e):
            entries = (flat == rank * e + le).nonzero().squeeze(1)
            buffer.src_index[le, src, :entries.numel()] = entries.to(torch.int32)
            buffer.recv_counts[parity, src, le] = (d << 32) | entries.numel()
    own = inputs[rank].topk_idx.reshape(-1)
    buffer.send_counts[:] = (d << 32) | torch.bincount(own[own >= 0], minlength=s.num_experts)
    buffer.tag1_barrier += ranks
    table, rows = assign_rows(buffer.recv_counts[parity] & 0xFFFFFFFF, plan)
    buffer.pool_table[:table.shape[0]] = table
    cap.header_seen[0] = (1 << 32) | table.shape[0]
    bm = plan.block_m
    for j, (le, src, pos, q, _gen, row, _valid, inc) in enumerate(rows.tolist()):
        token, slot = divmod(int(buffer.src_index[le, src, pos]), k)
        inp = inputs[src]
        buffer.l1_acts.view(torch.uint8)[row] = inp.x[token]
        buffer.l1_acts_sf[:, row] = inp.x_sf[token]
        buffer.l1_routing_weights[row] = inp.topk_weights[token, slot]
        buffer.l1_source[row] = torch.tensor([src, token, slot, q], dtype=torch.int32)
        b = q % plan.ring_blocks
        buffer.l1_full_count[b] += inc
        if j + 1 == rows.shape[0] or int(rows[j + 1, 3]) != q:  # block complete: the consumer captures it
            first = b * bm
            cap.acts[q] = buffer.l1_acts.view(torch.uint8)[first:first + bm]
            cap.scales[q] = buffer.l1_acts_sf[:, first:first + bm].t()
            cap.weights[q] = buffer.l1_routing_weights[first:first + bm]
            cap.source[q] = buffer.l1_source[first:first + bm]
            cap.full_seen[q] = buffer.l1_full_count[b]


@pytest.mark.parametrize(("kind", "tokens", "bm", "ring_blocks"),
                         [("uniform", 37, 8, 2), ("zipf", 64, 16, 1), ("one_expert", 64, 64, 3), ("holes", 5, 8, 4),
                          ("uniform", 0, 16, 2)])
def test_role1_oracle_accepts_the_simulation_and_rejects_one_swap(group: dist.ProcessGroup, kind: str, tokens: int,
                                                                   bm: int, ring_blocks: int) -> None:
    buf = api.get_symm_buffer_for_gc_moe(group, num_experts=16, capacity=64, topk=4, hidden=512,
                                            intermediate=256, compute_sms=64)
    gen = torch.Generator().manual_seed(tokens + bm)
    inputs = [make_inputs(kind, tokens, buf, gen)]
    plan = RingPlan(bm, ring_blocks, 2, 2, 4)
    cap = CaptureBuffers.allocate(buf, bm)
    cap.poison()
    poison_outputs(buf)
    _simulate(buf, inputs, 0, plan, cap)
    exp = expected(inputs, 0, buf, plan)
    check_capture(cap, exp, plan)
    check_ring(buf, exp)
    check_src_index(buf, exp, 4)
    check_counters(buf, exp, plan, parity=0, replay=0)
    if exp.rows.shape[0] < 2:
        return
    a, b = int(exp.rows[0, 2]), int(exp.rows[-1, 2])
    if a == b or torch.equal(buf.l1_source[a], buf.l1_source[b]):
        return
    buf.l1_source[[a, b]] = buf.l1_source[[b, a]]
    with pytest.raises(AssertionError, match="l1_source"):
        check_ring(buf, exp)
    cap.source.view(-1, 4)[[0, 1]] = cap.source.view(-1, 4)[[1, 0]]
    with pytest.raises(AssertionError, match="l1_source"):
        check_capture(cap, exp, plan)
