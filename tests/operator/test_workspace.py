"""Operator workspace layout: regions disjoint and aligned, exact sizes for the presets, views, by-value offsets."""

from __future__ import annotations

import ctypes

import pytest
import torch

from gc_moe_compat import config
from gc_moe_compat.operator import ring, workspace
from gc_moe_compat.operator.workspace import NO_REGION, REGION_NAMES, OperatorLayout, WorkspaceOffsets

CASES = [(name, p, shared, mma) for name in config.PRESETS for p in (1, 2, 8) for shared in (True, False)
         for mma in config.MMA_TYPES]


def _expected_bytes(shape: config.MoEShape, cap: ring.RingCapacity, pool: int, idx_bytes: int = 8) -> dict[str, int]:
    t, h, i, k, p, e = (shape.capacity, shape.hidden, shape.intermediate, shape.topk, shape.num_ranks,
                        shape.num_local_experts)
    want = {
        "x": t * h, "x_sf": t * h // 128 * 4, "topk_idx": t * k * idx_bytes, "topk_weights": t * k * 4,
        "tag1_barrier": 8, "replay_seq": 8, "recv_parity": 8, "send_counts": 8 * shape.num_experts,
        "recv_counts": 8 * 2 * p * e, "combine_ready": 8 * p, "finalize_arrive": 8, "src_index": 4 * e * p * t,
        "pool_header": 8, "role2_schedule": 16,
        "pool_table": 12 * pool, "l1_acts": cap.rows * h, "l1_acts_sf": 4 * cap.rows * h // 128,
        "l1_routing_weights": 4 * cap.rows, "l1_source": 16 * cap.rows, "l1_full_count": 4 * cap.blocks,
        "l1_empty_count": 4 * cap.blocks, "l2_full_mask": 8 * cap.blocks, "l2_empty_count": 4 * cap.blocks,
        "l2_acts": cap.rows * i, "l2_acts_sf": 4 * cap.rows * i // 128,
        "combine": 2 * (k + shape.num_shared_experts) * t * h, "status": 4 * 32,
    }
    if shape.num_shared_experts:
        want.update(shared_l2_acts=t * i, shared_l2_acts_sf=4 * t * i // 128)
    return want


@pytest.mark.parametrize(("name", "p", "shared", "mma"), CASES)
def test_regions_disjoint_aligned_exact(name: str, p: int, shared: bool, mma: str) -> None:
    shape = config.preset_shape(name, p, mma_type=mma, with_shared=shared)
    layout = OperatorLayout.build(shape, 128)
    cap = ring.RingCapacity.for_partition(shape, 128)
    pool = ring.RingModel(shape, 8, 128).pool_blocks
    assert (layout.ring, layout.pool_blocks) == (cap, pool)
    want = _expected_bytes(shape, cap, pool)
    assert {n: r.nbytes for n, r in layout.regions.items()} == want
    assert list(layout.regions) == [n for n in REGION_NAMES if n in want]
    spans = sorted((r.offset, r.offset + r.nbytes) for r in layout.regions.values())
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False))
    assert all(r.offset % 256 == 0 for r in layout.regions.values())
    assert layout.total_bytes >= spans[-1][1] and layout.total_bytes % 256 == 0
    assert layout.total_bytes - spans[-1][1] < 256
    assert sum(want.values()) <= layout.total_bytes < sum(want.values()) + 256 * len(want)
    assert layout.planner().regions == dict(layout.regions) and layout.planner().size == layout.total_bytes


def test_dsv41_flash_two_ranks_total() -> None:
    layout = OperatorLayout.build(config.preset_shape("dsv41-flash", 2), 128)
    # ring rows of the widest role2 block (FP8xFP8's 96), for either path: one layout serves both
    assert (layout.ring.rows, layout.ring.blocks, layout.pool_blocks) == (23 * 96, 23, 432)
    assert layout.total_bytes == 37_386_240


def test_views_dtype_shape_and_aliasing() -> None:
    shape = config.MoEShape(num_experts=8, num_ranks=1, hidden=256, intermediate=128, topk=2, num_shared_experts=1,
                            capacity=16)
    layout = OperatorLayout.build(shape, 40, topk_idx_dtype=torch.int32)
    storage = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    for name, spec in layout.specs.items():
        v = layout.view(storage, name)
        assert (v.dtype, tuple(v.shape), v.is_contiguous()) == (spec.dtype, spec.shape, True)
        assert v.data_ptr() - storage.data_ptr() == layout.regions[name].offset
    assert layout.view(storage, "topk_idx").dtype == torch.int32
    layout.view(storage, "l1_full_count")[3] = 7
    assert int(storage[layout.regions["l1_full_count"].offset + 12]) == 7
    with pytest.raises(KeyError, match="no workspace region 'ring'"):
        layout.view(storage, "ring")
    with pytest.raises(ValueError, match="storage: must be a 1-D byte tensor"):
        layout.view(storage[:-1], "x")


def test_offsets_struct_mirrors_regions() -> None:
    shape = config.preset_shape("tiny", 2, with_shared=False)
    layout = OperatorLayout.build(shape, 64)
    off = layout.offsets()
    for name in REGION_NAMES:
        want = layout.regions[name].offset if name in layout.regions else NO_REGION
        assert getattr(off, name) == want, name
    assert off.shared_l2_acts == NO_REGION
    assert (off.capacity, off.ring_rows, off.ring_blocks, off.pool_blocks) == (
        256, layout.ring.rows, layout.ring.blocks, layout.pool_blocks)
    assert ctypes.sizeof(WorkspaceOffsets) == 8 * len(REGION_NAMES) + 16
    decl = WorkspaceOffsets.c_declaration()
    assert all(f" {name};" in decl for name in REGION_NAMES)
    assert f"sizeof(WorkspaceOffsets) == {ctypes.sizeof(WorkspaceOffsets)}" in decl


def test_build_argument_errors() -> None:
    shape = config.preset_shape("tiny", 1)
    with pytest.raises(TypeError, match="topk_idx_dtype: must be torch.int64 or torch.int32"):
        OperatorLayout.build(shape, 64, topk_idx_dtype=torch.int16)
    with pytest.raises(TypeError, match="shape: must be an MoEShape"):
        OperatorLayout.build("tiny", 64)
    with pytest.raises(ValueError, match="compute_sms: must be >= 1"):
        OperatorLayout.build(shape, 0)
    assert REGION_NAMES[:4] == workspace.INPUT_VIEWS
