"""Role1 (SM90 dispatch) on the host: nvcc builds, by-value parameter packing, and the kernel's row arithmetic
against the ring model (:func:`gc_moe_compat.operator.ring.pool_table` /
:func:`~gc_moe_compat.operator.ring.pool_rows`)."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ctypes_layout import natural_layout_size
from hypothesis import given, settings
from hypothesis import strategies as st
from nvcc_mark import needs_nvcc

from gc_moe_compat import config
from gc_moe_compat.operator import api, ring
from gc_moe_compat.operator.heuristics import workspace_block_ms
from gc_moe_compat.operator.sm90 import role1_dispatch
from gc_moe_compat.operator.workspace import StatusRecord, WorkspaceOffsets
from gc_moe_compat.runtime import jit
from gc_moe_compat.runtime.status import DeviceTimeoutError
from gc_moe_compat.runtime.workspace import PeerTable
from gc_moe_compat.testing.reference import dispatch_plan

KERNELS_DIR = Path(__file__).resolve().parents[2] / "kernels"
STANDINS = "testing/dispatch_test.cu"


@needs_nvcc
def test_role1_compiles_for_sm90a_without_spills(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dispatch kernel and the test stand-ins build for sm_90a: no stack frame, no spills, and role1 fits 512
    threads on one SM (<= 128 registers) with its static shared memory under the 48 KiB static limit."""
    monkeypatch.setenv("GC_MOE_CACHE_DIR", str(tmp_path))
    res = jit.compile_cubin(role1_dispatch.SOURCE).resources[role1_dispatch.KERNEL]
    assert (res.stack_bytes, res.spill_stores, res.spill_loads) == (0, 0, 0)
    assert res.registers <= 65536 // role1_dispatch.THREADS
    assert res.shared_bytes < 48 * 1024
    for name, r in jit.compile_cubin(STANDINS).resources.items():
        assert (r.stack_bytes, r.spill_stores, r.spill_loads) == (0, 0, 0), name


def test_role1_params_header_is_generated_from_the_ctypes_structs() -> None:
    """The kernel's headers hold exactly the C declarations of the two structs the host packs by value."""
    header = (KERNELS_DIR / "sm90" / "role1_dispatch_params.cuh").read_text()
    assert "// BEGIN GENERATED\n" + role1_dispatch.params_header() + "// END GENERATED" in header
    assert '#include "common/workspace_offsets.cuh"' in header
    assert WorkspaceOffsets.c_declaration() in (KERNELS_DIR / "common" / "workspace_offsets.cuh").read_text()


def test_role1_histogram_holds_the_configured_expert_limit() -> None:
    """The kernel's shared-memory histogram (``kMaxExperts``) is sized for exactly ``config.MAX_EXPERTS`` experts,
    the limit ``config.validate`` and :func:`role1_dispatch.dispatch_args` enforce."""
    source = (KERNELS_DIR / "sm90" / "role1_dispatch.cu").read_text()
    (value,) = re.findall(r"constexpr u32 kMaxExperts = (\d+);", source)
    assert int(value) == config.MAX_EXPERTS == role1_dispatch.MAX_EXPERTS


def test_role1_params_struct_layout() -> None:
    """Every field at its natural C offset, no hidden padding beyond the 8-byte tail alignment."""
    assert ctypes.sizeof(role1_dispatch.DispatchParams) == natural_layout_size(role1_dispatch.DispatchParams) == 72


def _buffer(group: dist.ProcessGroup, **kw: object) -> api.GcMoeBuffer:
    args = dict(num_experts=16, capacity=64, topk=4, hidden=512, intermediate=256, compute_sms=64)
    args.update(kw)
    return api.get_symm_buffer_for_gc_moe(group, **args)


@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
def test_role1_args_pack_the_buffer(group: dist.ProcessGroup, idx_dtype: torch.dtype) -> None:
    """The three by-value arguments: the buffer's peer table and offsets byte for byte, then the call's params."""
    buf = _buffer(group, topk_idx_dtype=idx_dtype)
    plan = api.ring_plan(buf, 40)
    args = role1_dispatch.dispatch_args(buf, plan, 40, timeout_ms=250)
    (t_name, t_bytes), (o_name, o_bytes), (p_name, p_bytes) = args.signature
    assert (t_name, o_name, p_name) == ("PeerTable", "WorkspaceOffsets", "DispatchParams")
    assert t_bytes == bytes(buf.peer_table) and len(t_bytes) == ctypes.sizeof(PeerTable) == 592
    assert o_bytes == bytes(buf.offsets) and len(o_bytes) == ctypes.sizeof(WorkspaceOffsets)
    p = role1_dispatch.DispatchParams.from_buffer_copy(p_bytes)
    s = buf.shape
    assert (p.num_tokens, p.topk, p.num_experts, p.local_experts, p.hidden) == (40, 4, 16, 16, 512)
    assert (p.block_m, p.ring_blocks, p.w1_tasks, p.w2_tasks) == (
        plan.block_m, plan.ring_blocks, plan.w1_tasks_per_block, plan.w2_tasks_per_block)
    assert p.w1_tasks == 2 * s.intermediate // 256 and p.w2_tasks == s.hidden // 256
    assert p.idx_bytes == idx_dtype.itemsize and p.timeout_ns == 250_000_000 and p.flags == 0
    warm_args = role1_dispatch.dispatch_args(buf, plan, 40, warmup=True)
    warm = role1_dispatch.DispatchParams.from_buffer_copy(warm_args.signature[2][1])
    assert warm.flags == role1_dispatch.WARMUP


def test_role1_params_reject_what_the_kernel_cannot_hold(group: dist.ProcessGroup) -> None:
    buf = _buffer(group)
    plan = api.ring_plan(buf, 8)
    with pytest.raises(ValueError, match="num_tokens: must be an int in \\[0, capacity=64\\]"):
        role1_dispatch.dispatch_params(buf, plan, 65)
    with pytest.raises(ValueError, match="num_tokens"):
        role1_dispatch.dispatch_params(buf, plan, True)
    big = ring.RingPlan(64, buf.layout.ring.blocks + 1, 2, 2, 4)
    with pytest.raises(ValueError, match="plan: .* do not fit the buffer's ring"):
        role1_dispatch.dispatch_params(buf, big, 8)
    assert role1_dispatch.dispatch_params(buf, plan, 0).num_tokens == 0


def test_role1_status_names_the_site_of_its_record(group: dist.ProcessGroup) -> None:
    """An error in role1's record (:class:`StatusRecord` ``ROLE1``) is raised with its :class:`DispatchSite`'s name
    and cleared; the other roles' records are not role1's."""
    buf = _buffer(group)
    buf.status[StatusRecord.ROLE2].view(torch.int32)[0] = 1
    role1_dispatch.raise_for_dispatch_status(buf)  # role2's error: nothing for role1 to raise
    record = buf.status[StatusRecord.ROLE1]
    record.view(torch.int32)[:2] = torch.tensor([1, role1_dispatch.DispatchSite.TAG1], dtype=torch.int32)
    with pytest.raises(DeviceTimeoutError, match="role1 dispatch: role1 tag-1 barrier .*: observed 0, expected 0"):
        role1_dispatch.raise_for_dispatch_status(buf)
    assert int(record.sum()) == 0


def _received(topk: list[torch.Tensor], num_experts: int, dst: int) -> list[torch.Tensor]:
    return dispatch_plan(topk, num_experts)[dst]


@st.composite
def _routings(draw: st.DrawFn) -> tuple[list[torch.Tensor], int, int, ring.RingPlan]:
    ranks = draw(st.integers(1, 4))
    local = draw(st.integers(1, 6))
    experts = ranks * local
    k = draw(st.integers(1, min(experts, 4)))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    topk = []
    for _ in range(ranks):
        t = draw(st.integers(0, 24))
        idx = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k)
        idx = idx.to(torch.int64)
        idx[torch.rand(idx.shape, generator=g) < draw(st.sampled_from([0.0, 0.3]))] = -1
        topk.append(idx)
    plan = ring.RingPlan(draw(st.sampled_from(workspace_block_ms())), draw(st.integers(1, 5)), 2, 3, 4)
    return topk, experts, draw(st.integers(0, ranks - 1)), plan


@settings(max_examples=300, deadline=None)
@given(_routings())
def test_role1_row_assignment_equals_the_ring_model(case: tuple[list[torch.Tensor], int, int, ring.RingPlan]) -> None:
    """The kernel's arithmetic (:func:`role1_dispatch.assign_rows`, from the [P, e] counts alone) puts every received
    row
    where :func:`ring.pool_rows` says, publishes :func:`ring.pool_table`, and its ``l1_full_count`` increments bring
    every block generation to exactly ``BM·(g+1)``."""
    topk, experts, dst, plan = case
    ranks = len(topk)
    received = _received(topk, experts, dst)
    counts = torch.tensor([[int((rows[:, 0] == src).sum()) for rows in received] for src in range(ranks)])
    table, rows = role1_dispatch.assign_rows(counts, plan)
    per_expert = torch.tensor([r.shape[0] for r in received], dtype=torch.int32)
    assert torch.equal(table, ring.pool_table(per_expert, plan))
    want = ring.pool_rows(received, plan)
    le, src, pos, block, gen, ring_row, valid, inc = rows.unbind(1)
    assert torch.equal(torch.stack([block, gen, ring_row, le, src], 1), want[:, :5])
    # position = index of the row among the rows of (src, le), the src_index list role1 writes ascending
    for j in range(rows.shape[0]):
        mine = received[int(le[j])]
        mine = mine[mine[:, 0] == src[j]]
        assert torch.equal(mine[int(pos[j]), 1:], want[j, 5:])
    if rows.shape[0]:
        assert torch.equal(valid, table[block, 1].to(torch.int64))
    # every pool block gets exactly BM: generation g of a ring block completes at BM*(g+1) (role3 resets to 0)
    full = torch.zeros(table.shape[0], dtype=torch.int64).index_add_(0, block, inc)
    assert torch.all(full == plan.block_m)
