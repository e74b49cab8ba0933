"""Host side of the SM90 expert GEMMs (no GPU): heuristics, grouping, and nvcc builds of every kernel variant."""

from __future__ import annotations

import math

import pytest
import torch

from gc_moe_compat.reference import ExpertWeights, dispatch_plan, quantize_activations
from gc_moe_compat.runtime import jit
from gc_moe_compat.sm90 import group_tokens, scatter_partials, select_config
from gc_moe_compat.sm90.gemm import KERNEL, SOURCE, all_variants, prepare_fp4_weights, prepare_fp8_weights
from gc_moe_compat.sm90.heuristics import (
    BLOCK_M_CANDIDATES,
    MAX_STAGES,
    SMEM_LIMIT,
    W1_SLABS,
    W2_SLABS,
    max_stages,
    select_block_m,
    smem_bytes,
)


@pytest.mark.parametrize(
    ("rows", "bm"), [(0, 8), (1, 8), (4, 8), (5.5, 8), (6, 16), (12, 16), (13, 32), (25, 32), (27, 64), (500, 64)]
)
def test_block_m_covers_mean_plus_sd(rows: float, bm: int) -> None:
    assert select_block_m(rows) == bm
    assert bm in BLOCK_M_CANDIDATES
    assert bm >= rows + math.sqrt(rows) or bm == BLOCK_M_CANDIDATES[-1]


def test_block_m_rejects_bad_input() -> None:
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="expected_rows"):
            select_block_m(bad)


def test_variant_pipelined_only_with_more_tasks_than_sms() -> None:
    # dsv41-flash at T=1: ~6 rows over 6 experts, 18 W1 tiles per block -> 108 tasks <= 132 SMs: non-pipelined.
    small = select_config(6 / 48, 6, 18, 132)
    assert (small.bm, small.pipelined, small.threads) == (8, False, 256)
    big = select_config(32.0, 48, 18, 132)
    assert (big.bm, big.pipelined, big.threads) == (64, True, 384)
    with pytest.raises(ValueError):
        select_config(1.0, 1, 0, 132)


@pytest.mark.parametrize("bm", BLOCK_M_CANDIDATES)
def test_stages_fill_but_fit_shared_memory(bm: int) -> None:
    for slabs in (W1_SLABS, W2_SLABS):
        stages = max_stages(bm, slabs)
        assert 2 <= stages <= MAX_STAGES and smem_bytes(bm, slabs, stages) <= SMEM_LIMIT
        assert stages == MAX_STAGES or smem_bytes(bm, slabs, stages + 1) > SMEM_LIMIT


def test_group_tokens_layout_and_scatter() -> None:
    gen = torch.Generator().manual_seed(3)
    t, h, e, k, bm = 11, 256, 5, 3, 8
    x_fp8, x_sf = quantize_activations(torch.randn(t, h, generator=gen), "fp32_128")
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    idx[2, 1] = -1
    weights = torch.rand(t, k, generator=gen)
    g = group_tokens(x_fp8, x_sf, idx, weights, e, bm)
    plan = dispatch_plan([idx], e)[0]
    assert g.counts.tolist() == [p.shape[0] for p in plan]
    assert g.rows == g.blocks.shape[0] * bm and int(g.num_blocks) == g.blocks.shape[0]
    for b, (ex, valid, first) in enumerate(g.blocks.tolist()):
        assert first == b * bm and 1 <= valid <= bm
        rows = slice(first, first + valid)
        start = sum(math.ceil(c / bm) for c in g.counts.tolist()[:ex]) * bm
        expected = plan[ex][first - start : first - start + valid]
        assert g.row_token[rows].tolist() == expected[:, 1].tolist()
        assert g.row_slot[rows].tolist() == expected[:, 2].tolist()
        assert (g.row_token[first + valid : first + bm] == -1).all()
    live = g.row_token >= 0
    assert torch.equal(g.x.view(torch.uint8)[live], x_fp8.view(torch.uint8)[g.row_token[live]])
    assert torch.equal(g.x_sf_t.t()[live], x_sf[g.row_token[live]])
    assert torch.equal(g.routing_w[live], weights[g.row_token[live], g.row_slot[live]])
    assert float(g.routing_w[~live].abs().sum()) == 0.0
    rows_out = torch.randn(g.rows, 4).to(torch.bfloat16)
    back = scatter_partials(rows_out, g, t, k)
    assert torch.equal(back[g.row_token[live], g.row_slot[live]], rows_out[live])
    assert float(back[2, 1].abs().sum()) == 0.0


def test_group_tokens_no_rows() -> None:
    x_fp8, x_sf = quantize_activations(torch.randn(2, 128), "fp32_128")
    g = group_tokens(x_fp8, x_sf, torch.full((2, 1), -1), torch.ones(2, 1), 4, 16)
    assert g.rows == 0 and int(g.num_blocks) == 0 and g.active_experts == 0


def test_prepare_fp8_weights_interleaves_and_checks() -> None:
    gen = torch.Generator().manual_seed(0)
    l1 = ExpertWeights.quantize(torch.randn(2, 256, 256, generator=gen), "fp8_block128")
    l2 = ExpertWeights.quantize(torch.randn(2, 256, 128, generator=gen), "fp8_block128")
    w = prepare_fp8_weights(l1, l2)
    rows = w.w1.view(torch.uint8).reshape(2, 256, 256)
    assert torch.equal(rows[:, 8:16], l1.payload.view(torch.uint8)[:, 128:136])  # up rows 0..7 follow gate rows 0..7
    assert (w.inter, w.hidden, w.num_experts) == (128, 256, 2) and torch.equal(w.w1_sf, l1.scales)
    with pytest.raises(ValueError, match="fp8_block128"):
        prepare_fp8_weights(ExpertWeights.quantize(torch.randn(2, 256, 256), "bf16"), l2)
    with pytest.raises(NotImplementedError, match="FP8xFP4"):
        prepare_fp4_weights(l1, l2)


def _has_nvcc() -> bool:
    try:
        jit.find_nvcc()
    except jit.JitError:
        return False
    return True


@pytest.mark.skipif(not _has_nvcc(), reason="needs nvcc (CI has nvcc 13.0)")
@pytest.mark.parametrize(
    "defines", all_variants(), ids=lambda d: "bm{GC_BM}-epi{GC_EPI}-prod{GC_PRODUCER_WG}".format(**d)
)
def test_every_variant_compiles_without_spills(defines: dict[str, int], tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """CI builds every variant for sm_90a: no stack frame, no spills, the register cap of the thread layout held."""
    monkeypatch.setenv("GC_MOE_CACHE_DIR", str(tmp_path))
    res = jit.compile_cubin(SOURCE, defines).resources[KERNEL]
    assert res.spill_stores == 0 and res.spill_loads == 0 and res.stack_bytes == 0
    assert res.registers <= (168 if defines["GC_PRODUCER_WG"] else 255)
