"""SM90 FP8xFP8 expert GEMMs on the H200: accuracy against both references, boundary expert sizes, SASS.

Every run: fresh seeded inputs, the intermediate and the partial rows poisoned (0xFF bytes: NaN in FP8 and BF16)
before the launch, so an unwritten element shows up as NaN; only rows of real (token, slot) pairs are outputs.
"""

from __future__ import annotations

import pytest
import torch
from _gemm_workload import CLAMP, make_layer, make_tokens, reference_partials
from _grouping import group_tokens, scatter_partials
from _standalone_gemm import ExpertGemmSM90, all_variants
from _standalone_heuristics import KernelConfig, select_config
from gemm_kit import boundary_tokens, config, run_poisoned, sass_report

from gc_moe_compat.compute_paths import FP8XFP8
from gc_moe_compat.config import SWEEP_TOKENS
from gc_moe_compat.operator.heuristics import W1_SLABS, tile_rows
from gc_moe_compat.testing.reference import accuracy_metrics, expert_rows, l1_intermediate

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


@pytest.fixture(scope="module", params=["dsv41-flash", "glm52"])
def layer(request: pytest.FixtureRequest):  # noqa: ANN201
    return make_layer(request.param, DEV, seed=1)


@pytest.mark.parametrize("tokens_per_rank", SWEEP_TOKENS)
def test_presets_sweep(layer, tokens_per_rank: int) -> None:  # noqa: ANN001
    tok = make_tokens(layer, tokens_per_rank, seed=tokens_per_rank)
    e = layer.l1.num_experts
    cfg = select_config(tokens_per_rank * layer.topk / e, e, 2 * layer.prepared.inter // tile_rows(W1_SLABS), 132,
                        hidden=layer.prepared.hidden)
    grouped = group_tokens(tok.x_fp8, tok.x_sf, tok.topk_idx, tok.topk_weights, e, cfg.bm)
    gemm = ExpertGemmSM90(layer.prepared, cfg, activation_clamp=CLAMP)
    ws = run_poisoned(gemm, grouped)
    live = grouped.row_token >= 0
    assert not ws.out[live].isnan().any() and not ws.inter[live].float().isnan().any()
    ours = scatter_partials(ws.out, grouped, tok.x.shape[0], layer.topk)
    ref, valid = reference_partials(layer, tok, faithful=True)
    model, _ = reference_partials(layer, tok, faithful=False)
    m = accuracy_metrics(ours[valid], ref[valid])
    mm = accuracy_metrics(ours[valid], model[valid])
    print(f"{layer.name} T={tokens_per_rank} bm={cfg.bm} pipelined={cfg.pipelined} faithful {m} model {mm}")
    assert m["nonfinite"] == 0 and m["cosine"] >= 0.9999 and m["processed_diff"] <= 1e-4
    assert mm["cosine"] >= 0.99


@pytest.mark.parametrize("pipelined", [True, False])
@pytest.mark.parametrize("bm", [8, 16, 32, 64])
def test_boundary_expert_sizes(bm: int, pipelined: bool) -> None:
    """Experts with 0, 1, BM and BM+1 rows (one slot per token), checked row by row, intermediate included."""
    check_expert_rows(config(bm, pipelined), None, seed=bm + pipelined)


@pytest.mark.parametrize("w2_slabs", [1, 2])
def test_cluster_pairs_multicast_split_and_mirror(w2_slabs: int) -> None:
    """The cluster-pair variants (BM = 64, W2 tasks of 128 and 256 rows): experts of 1, 65, 129 and 1 rows give seven
    blocks, so the pair table holds two multicast pairs (one expert's blocks), a pair of two experts (each CTA its own
    weights) and a last block whose partner runs as a mirror that stores nothing; checked row by row, intermediate
    included."""
    check_expert_rows(config(64, True, cluster=True, slabs=w2_slabs), [1, 65, 129, 1], seed=11)


def check_expert_rows(cfg: KernelConfig, counts: list[int] | None, seed: int) -> None:
    """One slot per token for experts with ``counts`` rows (default: 0, 1, BM, BM+1) through the ``cfg`` variant:
    every expert's partial rows and intermediate against the faithful reference."""
    bm = cfg.bm
    tok = boundary_tokens(bm, 512, torch.Generator(device=DEV).manual_seed(7 * bm + seed), counts)
    experts = int(tok.grouped.counts.shape[0])
    layer = make_layer("tiny", DEV, seed=seed, experts=experts, shape=(512, 256))
    ws = run_poisoned(ExpertGemmSM90(layer.prepared, cfg, activation_clamp=CLAMP), tok.grouped)
    xq, weights = tok.x_dequant, tok.topk_weights
    for e in range(experts):
        rows, tokens = tok.rows_of(e)
        if not bool(rows.any()):
            continue
        w1, w2 = layer.l1.dequantize(e), layer.l2.dequantize(e)
        kw = dict(activation_clamp=CLAMP, intermediate_quant="fp32_128")
        ref = expert_rows(xq[tokens], w1, w2, weights[tokens, 0], **kw)
        got = ws.out[rows]
        inter = ws.inter[rows].float() * ws.inter_sf_t[:, rows].t().repeat_interleave(128, dim=1)

        ref_inter = l1_intermediate(xq[tokens], w1, weights[tokens, 0], **kw)
        mi, mo = accuracy_metrics(inter, ref_inter), accuracy_metrics(got, ref)
        print(f"{cfg} expert {e} rows {int(rows.sum())}: inter {mi} out {mo}")
        assert mo["nonfinite"] == 0 and mi["nonfinite"] == 0
        assert mo["cosine"] >= 0.9999 and mo["processed_diff"] <= 1e-4 and mi["cosine"] >= 0.9999


def test_sass_and_resources() -> None:
    """Every variant: QGMMA (WGMMA on FP8) and UTMALDG (TMA) in the SASS, no local memory, no spills."""
    for defines in all_variants():
        res, counts = sass_report(FP8XFP8.kernel, defines, FP8XFP8.standalone_entry,
                                  ("QGMMA", "UTMALDG", "UBLKCP", "LDL", "STL"))
        print(f"{defines}: {res} {counts}")
        assert counts["QGMMA"] > 0 and counts["UTMALDG"] > 0
        assert counts["LDL"] == 0 and counts["STL"] == 0
        assert res.spill_stores == 0 and res.spill_loads == 0 and res.stack_bytes == 0
