"""Host side of the SM90 expert GEMMs (no GPU): heuristics, grouping, and nvcc builds of every kernel variant."""

from __future__ import annotations

import math

import pytest
import torch
from _grouping import group_tokens, scatter_partials
from _standalone_gemm import (
    ExpertGemmSM90,
    all_variants,
    prepare_fp4_weights,
    prepare_fp8_weights,
)
from _standalone_heuristics import KernelConfig, max_stages, select_config, w2_slabs
from nvcc_mark import needs_nvcc, serialized_wgmma

from gc_moe_compat import layouts, quant
from gc_moe_compat.compute_paths import MMA_TYPES, compute_path
from gc_moe_compat.operator.heuristics import (
    BLOCK_M_CANDIDATES,
    MAX_STAGES,
    SMEM_LIMIT,
    W1_SLABS,
    W2_SLABS,
    WIDE_BLOCK_M,
    block_m_candidates,
    block_m_for_call,
    select_block_m,
    smem_bytes,
    workspace_block_ms,
)
from gc_moe_compat.operator.sm90.fp4_layout import UNIT_BYTES, UNIT_ROWS, decode_units, permute_units, unpermute_units
from gc_moe_compat.runtime import jit
from gc_moe_compat.runtime.launch import cluster_config
from gc_moe_compat.testing.reference import ExpertWeights, dispatch_plan, quantize_activations


@pytest.mark.parametrize(
    ("rows", "bm"), [(0, 8), (1, 8), (4, 8), (5.5, 8), (6, 16), (12, 16), (13, 32), (25, 32), (27, 64), (500, 64)]
)
def test_block_m_covers_mean_plus_sd(rows: float, bm: int) -> None:
    assert select_block_m(rows) == bm
    assert bm in BLOCK_M_CANDIDATES
    assert bm >= rows + math.sqrt(rows) or bm == BLOCK_M_CANDIDATES[-1]


@pytest.mark.parametrize(("rows", "fp8", "fp4"), [(27, 64, 64), (56, 64, 64), (57, 96, 64), (64, 96, 64),
                                                  (86, 96, 64), (500, 96, 64)])
def test_wide_block_for_fp8_role2_only(rows: float, fp8: int, fp4: int) -> None:
    """Past 64 covered rows FP8xFP8's role2 runs one 96-row block (DeepSeek-V3 / GLM-5.2 EP8 shares at T = 256:
    64 expected rows); FP8xFP4's kernel stops at 64. A workspace is sized for both."""
    assert select_block_m(rows, block_m_candidates("fp8xfp8")) == fp8
    assert select_block_m(rows, block_m_candidates("fp8xfp4")) == fp4
    assert select_block_m(rows) == min(fp8, BLOCK_M_CANDIDATES[-1])  # the standalone kernels' blocks


def test_wide_block_per_call_and_workspace() -> None:
    assert workspace_block_ms() == BLOCK_M_CANDIDATES + (WIDE_BLOCK_M,)
    # T = 256 per rank, EP8, top-8, 256 experts: 64 rows per expert
    assert block_m_for_call(256, 8, 8, 256, mma_type="fp8xfp8") == WIDE_BLOCK_M
    assert block_m_for_call(256, 8, 8, 256, mma_type="fp8xfp4") == 64


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


@pytest.mark.parametrize("mma_type", MMA_TYPES)
@pytest.mark.parametrize("bm", BLOCK_M_CANDIDATES)
def test_stages_fill_but_fit_shared_memory(bm: int, mma_type: str) -> None:
    for slabs in (W1_SLABS, W2_SLABS):
        stages = max_stages(bm, slabs, mma_type)
        assert 2 <= stages <= MAX_STAGES and smem_bytes(bm, slabs, stages, mma_type) <= SMEM_LIMIT
        assert stages == MAX_STAGES or smem_bytes(bm, slabs, stages + 1, mma_type) > SMEM_LIMIT
    # an FP4 stage streams half the weight bytes of an FP8 one (+ 1/32 for the relative exponents)
    assert smem_bytes(bm, W1_SLABS, 1, "fp8xfp4") < smem_bytes(bm, W1_SLABS, 1, "fp8xfp8")
    with pytest.raises(ValueError, match="mma_type"):
        smem_bytes(bm, W1_SLABS, 2, "fp4")


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


def test_group_tokens_pair_table_puts_each_experts_blocks_in_aligned_pairs() -> None:
    """pair_blocks: the same table rows; rows 2p and 2p + 1 share an expert for every full pair of its blocks."""
    gen = torch.Generator().manual_seed(5)
    counts, bm = [1, 9, 0, 17, 3, 8], 8  # blocks: 1, 2, 0, 3, 1, 1
    idx = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts)).unsqueeze(1)
    x_fp8, x_sf = quantize_activations(torch.randn(idx.shape[0], 128, generator=gen), "fp32_128")
    g = group_tokens(x_fp8, x_sf, idx, torch.ones(idx.shape), len(counts), bm)
    table, pairs = g.blocks.tolist(), g.pair_blocks.tolist()
    assert sorted(pairs) == sorted(table)
    assert [row[0] for row in pairs] == [1, 1, 3, 3, 0, 3, 4, 5]  # full pairs first, then the rest in table order


def test_cluster_pairs_only_pipelined_past_the_block() -> None:
    """Cluster pairs where m + sqrt(m) rows exceed BM = 64 (glm52 T=256: 65 rows per expert), pipelined only, for
    both weight formats; the runner refuses a non-pipelined cluster config before any CUDA call."""
    assert select_config(65.0, 32, 16, 132).cluster
    assert select_config(65.0, 32, 16, 132, "fp8xfp4").cluster
    assert not select_config(32.3, 32, 16, 132).cluster
    assert not select_config(65.0, 2, 1, 132).cluster  # two tasks: not pipelined
    assert not select_config(65.0, 32, 16, 132, block_m=32).cluster  # a probe's smaller BM: no cluster variant
    # W2 as 256-row tasks in cluster pairs, where H is known and 256 divides it
    assert select_config(65.0, 32, 16, 132, hidden=5120).w2_slabs == 2
    assert select_config(65.0, 32, 16, 132).w2_slabs == select_config(65.0, 32, 16, 132, hidden=384).w2_slabs == 1
    assert select_config(32.3, 32, 16, 132, hidden=5120).w2_slabs == 1
    gen = torch.Generator().manual_seed(0)
    l1 = ExpertWeights.quantize(torch.randn(1, 512, 256, generator=gen).to(torch.bfloat16), "mxfp4")
    l2 = ExpertWeights.quantize(torch.randn(1, 256, 256, generator=gen).to(torch.bfloat16), "mxfp4")
    cfg = KernelConfig(64, False, max_stages(64, 2), max_stages(64, 1), cluster=True)
    with pytest.raises(NotImplementedError, match="cluster pairs"):
        ExpertGemmSM90(prepare_fp4_weights(l1, l2), cfg)


def test_cluster_launch_config_needs_whole_clusters() -> None:
    config = cluster_config(132, 384, 2, 0, 1024)
    assert (config.gridDimX, config.blockDimX, config.numAttrs, config.sharedMemBytes) == (132, 384, 1, 1024)
    with pytest.raises(ValueError, match="cluster"):
        cluster_config(131, 384, 2, 0)


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
    with pytest.raises(ValueError, match="mxfp4"):
        prepare_fp4_weights(l1, l2)


def test_runner_rejects_w2_tasks_that_do_not_tile_hidden() -> None:
    """256-row W2 tasks on H = 384 would leave rows unwritten: refused before any CUDA call."""
    gen = torch.Generator().manual_seed(0)
    l1 = ExpertWeights.quantize(torch.randn(1, 256, 384, generator=gen), "fp8_block128")
    l2 = ExpertWeights.quantize(torch.randn(1, 384, 128, generator=gen), "fp8_block128")
    cfg = KernelConfig(16, True, max_stages(16, 2), max_stages(16, 2), w2_slabs=2)
    with pytest.raises(ValueError, match="w2_slabs=2 needs a hidden size that is a multiple of 256, got 384"):
        ExpertGemmSM90(prepare_fp8_weights(l1, l2), cfg)


def _spread_mxfp4(e: int, n: int, k: int, seed: int, steps: int = 16) -> ExpertWeights:
    """MXFP4 weights whose K32 scales span ``steps`` exponents: beyond the 11-step window, so some groups clip."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(e, n, k, generator=gen)
    w = w * torch.exp2(-torch.randint(0, steps, (e, n, k // 32), generator=gen).float()).repeat_interleave(32, -1)
    return ExpertWeights.quantize(w, "mxfp4")


def test_fp4_units_round_trip_and_register_decode_is_exact() -> None:
    """The lane permutation is a bijection, and the kernel's decoder (replayed bit for bit: PRMT table of
    E4M3(e2m1 * 2^d / 64) per row and K32 group, sign bits) gives exactly the window dequantization, d up to 10."""
    w = _spread_mxfp4(2, 128, 512, seed=1)
    rep = layouts.window_repack_mxfp4(w.payload, w.scales)
    assert int(rep.rel_exp.max()) == 10 and bool(rep.clipped.any())
    units = permute_units(rep.packed, rep.rel_exp)
    assert tuple(units.shape) == (2, 512 // 128, 128 // 64, UNIT_BYTES) and UNIT_BYTES == UNIT_ROWS * 128
    packed, rel = unpermute_units(units)
    assert torch.equal(packed, rep.packed) and torch.equal(rel, rep.rel_exp)
    decoded = decode_units(units).view(torch.float8_e4m3fn).float() * 64 * rep.factor[:, None, None]
    assert torch.equal(decoded, layouts.window_dequantize(rep))
    with pytest.raises(ValueError, match="rel_exp"):
        permute_units(rep.packed, rep.rel_exp + 1)


def test_prepare_fp4_weights_round_trips_to_mxfp4_inside_the_window() -> None:
    """window_dequantize of the prepared units equals the MXFP4 dequantization of the interleaved weights wherever
    the K32 group lies inside its expert's window, and the clipped groups are off by at most 0.25 * 2^base."""
    e, inter, h = 2, 128, 256
    l1, l2 = _spread_mxfp4(e, 2 * inter, h, seed=2), _spread_mxfp4(e, h, inter, seed=3)
    w = prepare_fp4_weights(l1, l2)
    assert (w.num_experts, w.hidden, w.inter) == (e, h, inter)
    for units, factor, src, interleave in ((w.w1, w.w1_factor, l1, True), (w.w2, w.w2_factor, l2, False)):
        n, k = src.payload.shape[1], src.in_features
        packed, rel = unpermute_units(units.reshape(e, k // 128, n // 64, UNIT_BYTES))
        base = torch.log2(factor).to(torch.int32)
        got = layouts.window_dequantize(layouts.WindowRepackedMXFP4(packed, rel, factor, base, rel > 255))
        payload, codes = src.payload, src.scales
        if interleave:
            payload, codes = layouts.interleave_gate_up(payload), layouts.interleave_gate_up(codes)
        want = quant.dequantize_mxfp4(payload, codes)
        inside = (codes.to(torch.int32) - 127 >= base[:, None, None]).repeat_interleave(32, -1)
        assert bool(inside.any()) and bool((~inside).any())
        assert torch.equal(got[inside], want[inside])
        bound = 0.25 * factor[:, None, None].expand_as(got)
        assert bool(((got - want).abs()[~inside] <= bound[~inside]).all())


@needs_nvcc
@pytest.mark.parametrize(
    ("mma_type", "defines"),
    [(m, d) for m in MMA_TYPES for d in all_variants(m)],
    ids=lambda v: v if isinstance(v, str) else "bm{GC_BM}-epi{GC_EPI}-prod{GC_PRODUCER_WG}".format(**v),
)
def test_every_variant_compiles_without_spills(mma_type: str, defines: dict[str, int], tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """CI builds every variant of both kernels for sm_90a: no stack frame, no spills, no serialized WGMMAs, the
    register cap of the thread layout held."""
    monkeypatch.setenv("GC_MOE_CACHE_DIR", str(tmp_path))
    path = compute_path(mma_type)
    source, kernel = path.kernel, path.standalone_entry
    cubin = jit.compile_cubin(source, defines)
    res = cubin.resources[kernel]
    assert res.spill_stores == 0 and res.spill_loads == 0 and res.stack_bytes == 0
    assert not serialized_wgmma(cubin.warnings)
    assert res.registers <= (168 if defines["GC_PRODUCER_WG"] else 255)


@pytest.mark.parametrize("block_m", BLOCK_M_CANDIDATES)
def test_select_config_block_m_override_keeps_the_other_rules(block_m: int) -> None:
    """A forced BM replaces only the heuristic's BM: stages follow that BM, pipelining still counts its blocks."""
    for mma_type in ("fp8xfp8", "fp8xfp4"):
        cfg = select_config(65.0, 32, 16, 132, mma_type, block_m=block_m)
        assert cfg.bm == block_m
        w2_stages = max_stages(block_m, w2_slabs(block_m, mma_type), mma_type)
        assert (cfg.stages_w1, cfg.stages_w2) == (max_stages(block_m, 2, mma_type), w2_stages)
        assert cfg.pipelined == (32 * math.ceil(65.0 / block_m) * 16 > 132)


@pytest.mark.parametrize("mma_type", MMA_TYPES)
@pytest.mark.parametrize("block_m", BLOCK_M_CANDIDATES)
def test_w2_task_rows_follow_format_and_block(mma_type: str, block_m: int) -> None:
    """256-row W2 tasks only for FP8xFP4 from BM = 16; the config's W2 stages follow them, and the variant is one of
    the compiled (recorded) ones."""
    two = mma_type == "fp8xfp4" and block_m >= 16
    assert w2_slabs(block_m, mma_type) == (2 if two else 1)
    cfg = select_config(65.0, 32, 16, 132, mma_type, block_m=block_m)
    assert cfg.w2_slabs == (2 if two else 1)
    assert cfg.stages_w2 == max_stages(block_m, cfg.w2_slabs, mma_type)
    variants = all_variants(mma_type)
    assert {"GC_BM": block_m, "GC_EPI": 2, "GC_M_SUB": cfg.w2_slabs, "GC_PRODUCER_WG": int(cfg.pipelined),
            "GC_STAGES": cfg.stages_w2, "GC_FAST_MATH": 1} in variants  # fmt: skip


@pytest.mark.parametrize("bad", (0, 12, 128, -8))
def test_select_config_rejects_a_block_m_outside_the_candidates(bad: int) -> None:
    with pytest.raises(ValueError, match="block_m"):
        select_config(10.0, 4, 16, 132, block_m=bad)
