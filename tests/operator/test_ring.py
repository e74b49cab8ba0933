"""Ring capacity model (paper §4.3): pool bound, live-block need, generation mapping, expected signal values."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gc_moe_compat import config
from gc_moe_compat.operator import ring
from gc_moe_compat.operator.heuristics import WIDE_BLOCK_M, workspace_block_ms
from gc_moe_compat.testing import reference


def _shape(**kw: object) -> config.MoEShape:
    args = dict(num_experts=16, num_ranks=2, hidden=512, intermediate=256, topk=4, capacity=64)
    args.update(kw)
    return config.MoEShape(**args)


shapes = st.builds(
    lambda e, p, h, i, k, cap: config.MoEShape(num_experts=e * p, num_ranks=p, hidden=256 * h, intermediate=128 * i,
                                               topk=min(k, e * p), capacity=cap),
    st.integers(1, 64), st.integers(1, 8), st.integers(1, 24), st.integers(1, 32), st.integers(1, 16),
    st.integers(1, 512))
bms = st.sampled_from(workspace_block_ms())
sms = st.integers(1, 160)


def test_dsv41_flash_two_ranks() -> None:
    shape = config.preset_shape("dsv41-flash", 2)
    m = ring.RingModel(shape, 64, 128)
    assert m.max_assignments == 256 * 2 * 6
    assert m.pool_blocks == 3072 // 64 + 48
    assert (m.w1_tasks_per_block, m.w2_tasks_per_block) == (18, 20)
    assert (m.lookahead_blocks, m.l2_wave_blocks, m.live_blocks) == (15, 8, 23)
    assert m.required_ring_blocks == 23 and m.deadlock_free_blocks == 15
    cap = ring.RingCapacity.for_partition(shape, 128)
    assert (cap.rows, cap.blocks) == (23 * WIDE_BLOCK_M, 23)  # the widest block any role2 kernel runs sets the rows


def test_small_pool_caps_ring() -> None:
    m = ring.RingModel(_shape(capacity=1, num_ranks=1, num_experts=8, topk=2), 64, 132)
    assert m.pool_blocks == 1 + 8 and m.required_ring_blocks == 9 < m.live_blocks


def test_min_k_e_bounds_assignments() -> None:
    # k = 8 > e = 2: one token reaches at most 2 experts of one rank
    assert ring.RingModel(_shape(num_experts=16, num_ranks=8, topk=8), 8, 64).max_assignments == 64 * 8 * 2


def test_expected_signal_values() -> None:
    plan = ring.RingPlan(block_m=16, ring_blocks=5, w1_tasks_per_block=18, w2_tasks_per_block=20, w1_tiles=36)
    assert [plan.slot(p) for p in (0, 4, 5, 11)] == [(0, 0), (4, 0), (0, 1), (1, 2)]
    assert plan.ring_row(7, 3) == 2 * 16 + 3
    assert [plan.l1_full_expected(g) for g in range(3)] == [16, 32, 48]
    assert plan.l1_empty_expected(1) == 36 and plan.l2_empty_expected(2) == 60
    assert plan.l2_full_mask_expected(0) == (1 << 36) - 1 and plan.l2_full_mask_expected(1) == 0
    assert plan.refill_waits(0) == (0, 0) and plan.refill_waits(2) == (36, 40)
    with pytest.raises(ValueError, match="generation: must be an int >= 0"):
        plan.l1_full_expected(-1)
    with pytest.raises(ValueError, match="row: must be in"):
        plan.ring_row(0, 16)
    with pytest.raises(ValueError, match="w1_tiles: must be <= 64"):
        ring.RingPlan(16, 5, 1, 1, 65)


def test_check_ring_raises_when_undersized() -> None:
    shape = config.preset_shape("dsv41-flash", 2)
    cap = ring.RingCapacity.for_partition(shape, 64)
    bigger = ring.RingModel(shape, 32, 132)
    assert cap.ring_blocks(bigger) < bigger.required_ring_blocks
    with pytest.raises(ring.RingCapacityError, match=r"ring_blocks: must be >= \d+ .* 132-SM compute partition"):
        cap.plan(bigger)
    assert cap.plan(ring.RingModel(shape, 32, 64)).ring_blocks >= ring.RingModel(shape, 32, 64).required_ring_blocks


@pytest.mark.parametrize(("kw", "exc", "match"), [
    ({"block_m": 24}, ValueError, "block_m: must be one of"),
    ({"compute_sms": 0}, ValueError, "compute_sms: must be >= 1"),
    ({"compute_sms": 1.0}, TypeError, "compute_sms: must be an int"),
    ({"geometry": ring.TaskGeometry(w2_rows=1024 * 3)}, ValueError, "geometry.w2_rows: must divide"),
    ({"shape": "dsv41"}, TypeError, "shape: must be an MoEShape"),
])
def test_model_argument_errors(kw: dict, exc: type, match: str) -> None:
    args = dict(shape=_shape(), block_m=16, compute_sms=64)
    args.update(kw)
    with pytest.raises(exc, match=match):
        ring.RingModel(**args)


def test_geometry_errors() -> None:
    with pytest.raises(ValueError, match="TaskGeometry.w1_rows: must be a multiple of 64"):
        ring.TaskGeometry(w1_rows=96)
    with pytest.raises(ValueError, match="TaskGeometry.l1_waves: must be >= 1"):
        ring.TaskGeometry(l1_waves=0)


@settings(max_examples=200, deadline=None)
@given(shapes, bms, sms, st.data())
def test_every_pool_block_maps_to_a_valid_ring_block(shape: config.MoEShape, bm: int, c: int, data: st.DataObject):
    model = ring.RingModel(shape, bm, c)
    plan = ring.RingCapacity.for_partition(shape, c).plan(model)
    last = {}
    for p in range(model.pool_blocks):
        b, g = plan.slot(p)
        assert 0 <= b < plan.ring_blocks and g >= 0
        assert g > last.get(b, -1)  # generations of one ring block strictly increase with the pool index
        last[b] = g
        assert plan.l1_full_expected(g) == bm * (g + 1)
    gens = [plan.slot(p)[1] for p in range(model.pool_blocks)]
    assert gens == sorted(gens)  # monotone over the pool


@settings(max_examples=200, deadline=None)
@given(shapes, bms, sms, sms)
def test_capacity_never_below_need(shape: config.MoEShape, bm: int, c: int, c2: int) -> None:
    model = ring.RingModel(shape, bm, c)
    cap = ring.RingCapacity.for_partition(shape, c)
    assert cap.ring_blocks(model) >= model.required_ring_blocks >= model.deadlock_free_blocks
    assert cap.ring_blocks(model) * bm <= cap.rows and cap.ring_blocks(model) <= cap.blocks
    # need grows with the partition, so a ring sized for the larger partition serves the smaller one
    small, large = sorted((c, c2))
    need_small = ring.RingModel(shape, bm, small).required_ring_blocks
    assert need_small <= ring.RingModel(shape, bm, large).required_ring_blocks
    ring.RingCapacity.for_partition(shape, large).plan(ring.RingModel(shape, bm, small))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(1, 4), st.integers(0, 12), bms, st.integers(1, 9),
       st.randoms(use_true_random=False))
def test_pool_bound_holds_for_any_routing(p: int, e: int, k: int, tmax: int, bm: int, r: int, rnd) -> None:
    """Every routing of Tmax tokens per rank fits the pool, and pool_rows/pool_table agree with dispatch_plan."""
    num_experts = e * p
    k = min(k, num_experts)
    idx = []
    for _ in range(p):
        rows = [rnd.sample(range(num_experts), k) for _ in range(tmax)]
        t = torch.tensor(rows, dtype=torch.int64).reshape(tmax, k)
        idx.append(torch.where(torch.rand(t.shape, generator=torch.Generator().manual_seed(rnd.randint(0, 99))) < 0.1,
                               -1, t))
    shape = config.MoEShape(num_experts=num_experts, num_ranks=p, hidden=256, intermediate=128, topk=k,
                            capacity=max(tmax, 1))
    model = ring.RingModel(shape, bm, 32)
    plan = ring.RingPlan.for_model(model, r)
    dispatch = reference.dispatch_plan(idx, num_experts)
    for rank, received in enumerate(dispatch):
        counts = reference.recv_counts(dispatch)[rank]
        table = ring.pool_table(counts, plan)
        assert table.shape[0] <= model.pool_blocks
        assert int(table[:, 1].sum()) == int(counts.sum()) <= model.max_assignments
        last_of_expert = torch.ones(table.shape[0], dtype=torch.bool)
        last_of_expert[:-1] = table[1:, 0] != table[:-1, 0]
        assert bool((table[~last_of_expert, 1] == bm).all()) and bool((table[:, 1] >= 1).all())
        rows = ring.pool_rows(received, plan)
        assert rows.shape[0] == int(counts.sum())
        for p_blk in range(table.shape[0]):
            mine = rows[rows[:, 0] == p_blk]
            assert mine.shape[0] == int(table[p_blk, 1]) and bool((mine[:, 3] == table[p_blk, 0]).all())
            assert bool((mine[:, 2] // bm == int(table[p_blk, 2]) // bm).all())
            assert bool((mine[:, 1] == p_blk // r).all())
        assert torch.equal(rows[:, 4:], torch.cat(received))


def test_pool_table_errors() -> None:
    plan = ring.RingPlan(16, 4, 1, 1, 2)
    with pytest.raises(ValueError, match="counts: must be a 1-D integer tensor"):
        ring.pool_table(torch.zeros(2, 2, dtype=torch.int32), plan)
    with pytest.raises(ValueError, match="counts: must be >= 0"):
        ring.pool_table(torch.tensor([1, -1]), plan)
    assert ring.pool_table(torch.tensor([0, 0]), plan).shape == (0, 3)
    assert ring.pool_table(torch.tensor([17, 0, 16]), plan).tolist() == [[0, 16, 0], [0, 1, 16], [2, 16, 32]]


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 12), st.integers(1, 6), st.integers(1, 64), bms, st.randoms(use_true_random=False))
def test_call_pool_bound_holds_for_any_routing_of_one_rank(e: int, k: int, t: int, bm: int, rnd) -> None:
    """One rank: every routing of a call's T tokens fills at most ``call_pool_blocks(T)`` pool blocks (the bound
    the sequential calls' ring is sized by); with more ranks the bound is the whole pool."""
    k = min(k, e)
    shape = config.MoEShape(num_experts=e, num_ranks=1, hidden=256, intermediate=128, topk=k, capacity=64)
    model = ring.RingModel(shape, bm, 32)
    idx = torch.tensor([rnd.sample(range(e), k) for _ in range(t)], dtype=torch.int64).reshape(t, k)
    counts = reference.recv_counts(reference.dispatch_plan([idx], e))[0]
    table = ring.pool_table(counts, ring.RingPlan.for_model(model, 1))
    assert table.shape[0] <= model.call_pool_blocks(t) == min(model.pool_blocks, -(-t * k // bm) + e)
    assert model.call_pool_blocks(64) == model.pool_blocks
    two = ring.RingModel(config.MoEShape(num_experts=2 * e, num_ranks=2, hidden=256, intermediate=128, topk=k,
                                         capacity=64), bm, 32)
    assert two.call_pool_blocks(1) == two.pool_blocks


def test_sequential_calls_capacity_holds_every_call_up_to_its_tokens() -> None:
    shape = _shape(num_ranks=1, num_experts=32, topk=8, capacity=256)
    cap = ring.RingCapacity.for_sequential_calls(shape, 15)
    assert (cap.rows, cap.blocks) == (8 * (15 + 32), 15 + 32)  # T = 15 at BM = 8: ceil(120 / 8) + 32 blocks
    for t in range(1, 16):
        assert cap.holds_call(ring.RingModel(shape, 8, 132), t)
    assert not cap.holds_call(ring.RingModel(shape, 8, 132), 16)
    big = ring.RingCapacity(rows=10, blocks=100).union(ring.RingCapacity(rows=20, blocks=5))
    assert (big.rows, big.blocks) == (20, 100)
