"""SM90 FP8xFP4 expert GEMMs on the H200: accuracy against both references, boundary expert sizes, SASS.

The faithful reference computes with the window-repacked MXFP4 weights (``Fp4Layer.l1_window``: what the kernel's
units encode), E4M3 activations with FP32 1x128 scales and the UE8M0 1x128 intermediate requant. Every run: fresh
seeded inputs, the intermediate, its scales and the partial rows poisoned (0xFF bytes: NaN in FP8 and BF16) before
the launch, so an unwritten element shows up as NaN; only rows of real (token, slot) pairs are outputs.
"""

from __future__ import annotations

import pytest
import torch
from _gemm_workload import CLAMP, make_fp4_layer, make_layer, make_tokens, reference_partials_fp4
from _grouping import group_tokens, scatter_partials
from _standalone_gemm import ExpertGemmSM90, Workspace, all_variants
from _standalone_heuristics import KernelConfig, select_config
from gemm_kit import boundary_tokens, config, run_poisoned, sass_report

from gc_moe_compat.compute_paths import FP8XFP4
from gc_moe_compat.config import SWEEP_TOKENS
from gc_moe_compat.operator.heuristics import W1_SLABS, tile_rows
from gc_moe_compat.testing.reference import accuracy_metrics, expert_rows, l1_intermediate

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


def _intermediate(ws: Workspace, rows: torch.Tensor) -> torch.Tensor:
    """The W2 input of ``rows`` in FP32: E4M3 payload times the FP32 value of its UE8M0 1x128 group scale (checked
    to be a power of two: the W2 kernel relies on an exact scale)."""
    scales = ws.inter_sf_t[:, rows].t()  # [n, I/128]
    mantissa, _ = torch.frexp(scales)
    assert torch.all(mantissa == 0.5), "intermediate scales must be powers of two (UE8M0)"
    return ws.inter[rows].float() * scales.repeat_interleave(128, dim=1)


@pytest.fixture(scope="module", params=["dsv41-flash", "glm52"])
def layers(request: pytest.FixtureRequest):  # noqa: ANN201
    layer = make_layer(request.param, DEV, seed=1)
    return layer, make_fp4_layer(layer.l1_bf16, layer.l2_bf16)


@pytest.mark.parametrize("tokens_per_rank", SWEEP_TOKENS)
def test_fp4_presets_sweep(layers, tokens_per_rank: int) -> None:  # noqa: ANN001
    layer, fp4 = layers
    tok = make_tokens(layer, tokens_per_rank, seed=tokens_per_rank)
    e = layer.l1.num_experts
    tiles = 2 * fp4.prepared.inter // tile_rows(W1_SLABS)
    cfg = select_config(tokens_per_rank * layer.topk / e, e, tiles, 132, "fp8xfp4")
    grouped = group_tokens(tok.x_fp8, tok.x_sf, tok.topk_idx, tok.topk_weights, e, cfg.bm)
    ws = run_poisoned(ExpertGemmSM90(fp4.prepared, cfg, activation_clamp=CLAMP), grouped)
    live = grouped.row_token >= 0
    assert not ws.out[live].isnan().any() and not ws.inter[live].float().isnan().any()
    ours = scatter_partials(ws.out, grouped, tok.x.shape[0], layer.topk)
    ref, valid = reference_partials_fp4(layer, fp4, tok, faithful=True)
    model, _ = reference_partials_fp4(layer, fp4, tok, faithful=False)
    m = accuracy_metrics(ours[valid], ref[valid])
    mm = accuracy_metrics(ours[valid], model[valid])
    print(f"fp4 {layer.name} T={tokens_per_rank} bm={cfg.bm} pipelined={cfg.pipelined} faithful {m} model {mm}")
    assert m["nonfinite"] == 0 and m["cosine"] >= 0.9999 and m["processed_diff"] <= 1e-4
    assert mm["cosine"] >= 0.97


@pytest.mark.parametrize("pipelined", [True, False])
@pytest.mark.parametrize("bm", [8, 16, 32, 64])
def test_fp4_boundary_expert_sizes(bm: int, pipelined: bool) -> None:
    """Experts with 0, 1, BM and BM+1 rows (one slot per token), checked row by row, intermediate included. The
    weights' K32 scales span 16 exponents, so the window clips groups and the decoder folds d up to 10. W2 runs as
    256-row tasks from BM = 16 (_standalone_heuristics.w2_slabs), 128-row ones at BM = 8."""
    check_fp4_expert_rows(config(bm, pipelined, "fp8xfp4"), None, seed=100 + bm + pipelined)


def test_fp4_cluster_pairs_multicast_split_and_mirror() -> None:
    """The FP8xFP4 cluster-pair variants (BM = 64): experts of 1, 65, 129 and 1 rows give multicast pairs, a pair of
    two experts and a mirror, as in the FP8xFP8 test."""
    check_fp4_expert_rows(config(64, True, "fp8xfp4", cluster=True), [1, 65, 129, 1], seed=211)


def check_fp4_expert_rows(cfg: KernelConfig, counts: list[int] | None, seed: int) -> None:
    """One slot per token for four experts with ``counts`` rows (default: 0, 1, BM, BM+1) through the ``cfg``
    variant, on FP4 weights whose K32 scales span 16 exponents: every expert's partial rows and intermediate against
    the faithful reference."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    h, inter = 512, 256
    spread = [
        (torch.randn(4, n, k, generator=gen, device=DEV) / k**0.5)
        * torch.exp2(-torch.randint(0, 16, (4, n, k // 32), generator=gen, device=DEV).float()).repeat_interleave(
            32, dim=-1
        )
        for n, k in ((2 * inter, h), (h, inter))
    ]
    fp4 = make_fp4_layer(*(w.to(torch.bfloat16) for w in spread))
    tok = boundary_tokens(cfg.bm, h, gen, counts)
    ws = run_poisoned(ExpertGemmSM90(fp4.prepared, cfg, activation_clamp=CLAMP), tok.grouped)
    xq, weights = tok.x_dequant, tok.topk_weights
    for e in range(4):
        rows, tokens = tok.rows_of(e)
        if not bool(rows.any()):
            continue
        w1, w2 = fp4.l1_window.dequantize(e), fp4.l2_window.dequantize(e)
        kw = dict(activation_clamp=CLAMP, intermediate_quant="ue8m0_128")
        ref = expert_rows(xq[tokens], w1, w2, weights[tokens, 0], **kw)
        ref_inter = l1_intermediate(xq[tokens], w1, weights[tokens, 0], **kw)
        mi, mo = accuracy_metrics(_intermediate(ws, rows), ref_inter), accuracy_metrics(ws.out[rows], ref)
        print(f"fp4 {cfg} expert {e} rows {int(rows.sum())}: inter {mi} out {mo}")
        assert mo["nonfinite"] == 0 and mi["nonfinite"] == 0
        assert mo["cosine"] >= 0.9999 and mo["processed_diff"] <= 1e-4 and mi["cosine"] >= 0.9999


def test_fp4_sass_and_resources() -> None:
    """Every FP8xFP4 variant: QGMMA (register-A WGMMA on E4M3), UTMALDG (TMA), PRMT (the register decoder) in the
    SASS, no local memory, no spills."""
    for defines in all_variants("fp8xfp4"):
        res, counts = sass_report(FP8XFP4.kernel, defines, FP8XFP4.standalone_entry,
                                  ("QGMMA", "UTMALDG", "UBLKCP", "PRMT", "LDL", "STL"))
        print(f"fp4 {defines}: {res} {counts}")
        assert counts["QGMMA"] > 0 and counts["UTMALDG"] > 0 and counts["PRMT"] > 0
        assert counts["LDL"] == 0 and counts["STL"] == 0
        assert res.spill_stores == 0 and res.spill_loads == 0 and res.stack_bytes == 0
