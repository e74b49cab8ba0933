"""Host side of the operator benchmark (bench/operator_sm90.py) and its composed baseline (bench/_baseline_sm90.py):
the all-to-all split/permutation plan against a brute-force simulation of the exchange, DeepGEMM's masked geometry,
packed row sizes, floor bytes, the result schema and targets, argument handling, the shared operator workload; and,
where Triton is installed, the baseline's Triton kernels in Triton's CPU interpreter (a two-rank round trip)."""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import _baseline_sm90 as base  # noqa: E402 - bench/ is a script folder, put on the path above
import _common  # noqa: E402
import gemm_sm90  # noqa: E402
import operator_sm90 as bench  # noqa: E402

from gc_moe_compat.config import SWEEP_TOKENS  # noqa: E402
from gc_moe_compat.operator import api  # noqa: E402
from gc_moe_compat.testing import operator_workload as ow  # noqa: E402
from gc_moe_compat.testing.reference import dispatch_plan  # noqa: E402


# ------------------------------------------------------------------------------------------------ plan vs oracle
def _routing(tokens: list[int], num_experts: int, topk: int, seed: int, holes: float = 0.0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for t in tokens:
        idx = torch.rand(t, num_experts, generator=gen).argsort(dim=1)[:, :topk]
        idx[torch.rand(t, topk, generator=gen) < holes] = -1
        out.append(idx)
    return out


def _oracle_send(idx: torch.Tensor, num_ranks: int, local: int) -> list[list[tuple[int, int]]]:
    """Per destination rank, the (token, slot) rows in (local expert, token, slot) order, by explicit loops."""
    rows = [[] for _ in range(num_ranks)]
    for d in range(num_ranks):
        for le in range(local):
            for t in range(idx.shape[0]):
                for s in range(idx.shape[1]):
                    if int(idx[t, s]) == d * local + le:
                        rows[d].append((t, s))
    return rows


def _check_plan_against_oracle(routing: list[torch.Tensor], num_experts: int) -> None:
    num_ranks = len(routing)
    local = num_experts // num_ranks
    plans = [base.plan_all_to_all(routing, num_experts, r) for r in range(num_ranks)]
    sends = [_oracle_send(idx, num_ranks, local) for idx in routing]
    reference = dispatch_plan(routing, num_experts)
    for r, plan in enumerate(plans):
        flat = [row for d in range(num_ranks) for row in sends[r][d]]
        assert list(zip(plan.send_token.tolist(), plan.send_slot.tolist(), strict=True)) == flat
        assert plan.input_splits == [len(sends[r][d]) for d in range(num_ranks)]
        assert plan.send_token.dtype == torch.int32 and plan.send_slot.dtype == torch.int32
    # the exchange: rank r receives, source by source, the block each source addressed to it (in its send order)
    for r, plan in enumerate(plans):
        received = [(src, t, s) for src in range(num_ranks) for (t, s) in sends[src][r]]
        assert plan.output_splits == [len(sends[src][r]) for src in range(num_ranks)]
        assert plan.output_splits == [plans[src].input_splits[r] for src in range(num_ranks)]
        assert plan.rows_received == len(received) == plan.recv_dest.numel()
        # masked layout: expert le's rows at positions 0..masked_m[le]-1, in dispatch_plan's (src, token, slot) order
        layout: dict[int, tuple[int, int, int]] = {}
        for i, (src, t, s) in enumerate(received):
            le = int(routing[src][t, s]) - r * local
            d = int(plan.recv_dest[i])
            assert d // plan.max_m == le and d not in layout
            layout[d] = (src, t, s)
        for le in range(local):
            n = int(plan.masked_m[le])
            assert n == reference[r][le].shape[0]
            got = [layout[le * plan.max_m + p] for p in range(n)]
            assert got == [tuple(row) for row in reference[r][le].tolist()]
        assert sum(plan.masked_m.tolist()) == plan.rows_received
        assert plan.max_m % base.MASKED_ROW_ALIGN == 0 and plan.max_m >= max(plan.masked_m.tolist(), default=0)
        assert (plan.max_m, plan.expected_m) == base.masked_geometry(plan.masked_m)
        assert plan.active_experts == sum(1 for n in plan.masked_m.tolist() if n)
    # the combine: partials go back in arrival order with the splits swapped; rank r gets them in its send order
    for r, plan in enumerate(plans):
        back = []
        for dst in range(num_ranks):
            arrivals = [(src, t, s) for src in range(num_ranks) for (t, s) in sends[src][dst]]
            offset = sum(plans[dst].output_splits[:r])
            back += arrivals[offset: offset + plans[dst].output_splits[r]]
        assert len(back) == plan.rows_sent
        idx = routing[r]
        for t in range(idx.shape[0]):
            for s in range(idx.shape[1]):
                j = int(plan.combine_index[t, s])
                if int(idx[t, s]) < 0:
                    assert j == -1
                else:
                    assert back[j] == (r, t, s)


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", range(4))
def test_plan_matches_brute_force_exchange(num_ranks: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tokens = [int(v) for v in torch.randint(0, 13, (num_ranks,), generator=gen)]
    _check_plan_against_oracle(_routing(tokens, 4 * num_ranks, 3, seed, holes=0.25), 4 * num_ranks)


@pytest.mark.parametrize("preset", ["dsv41-flash", "glm52"])
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_plan_matches_oracle_on_the_benchmark_routing(preset: str, tokens: int) -> None:
    e, *_ = ow.preset_dims(preset)
    _check_plan_against_oracle(bench.point_routing(preset, tokens), e * bench.WORLD)


def test_plan_edge_cases() -> None:
    # every slot on one expert (a token routed twice to it counts twice), a rank with no tokens, all slots -1
    one = [torch.tensor([[5, 5], [5, -1]]), torch.zeros(0, 2, dtype=torch.int64), torch.full((3, 2), -1)]
    _check_plan_against_oracle(one, 6)
    plan = base.plan_all_to_all(one, 6, 2)
    assert plan.masked_m.tolist() == [0, 3] and plan.rows_sent == 0 and plan.output_splits == [3, 0, 0]
    assert base.plan_all_to_all(one, 6, 1).combine_index.shape == (0, 2)
    # more rows for one expert than one masked block of 128
    many = [torch.zeros(200, 1, dtype=torch.int64), torch.zeros(100, 1, dtype=torch.int64)]
    _check_plan_against_oracle(many, 2)
    assert base.plan_all_to_all(many, 2, 0).max_m == 384


def test_plan_rejects_bad_arguments() -> None:
    idx = [torch.tensor([[0, 1]]), torch.tensor([[2, 3]])]
    with pytest.raises(ValueError, match="rank"):
        base.plan_all_to_all(idx, 4, 2)
    with pytest.raises(ValueError, match="num_experts"):
        base.plan_all_to_all(idx, 5, 0)
    with pytest.raises(ValueError, match=r"ids must lie in \[-1, 4\)"):
        base.plan_all_to_all([torch.tensor([[0, 4]]), idx[1]], 4, 0)
    with pytest.raises(ValueError, match="must be"):
        base.plan_all_to_all([torch.tensor([[0, 1, 2]]), idx[1]], 4, 0)


def test_masked_geometry_and_row_words() -> None:
    assert base.masked_geometry(torch.tensor([0, 0])) == (128, 1)
    assert base.masked_geometry(torch.tensor([3, 0, 1])) == (128, 2)
    assert base.masked_geometry(torch.tensor([129, 1])) == (256, 65)
    assert base.masked_geometry(torch.tensor([128])) == (128, 128)
    with pytest.raises(ValueError, match="counts"):
        base.masked_geometry(torch.tensor([-1]))
    # H FP8 bytes + H/128 FP32 scales + one FP32 weight, padded to 16 bytes
    assert base.row_words(5120) == 1324 and base.row_words(6144) == 1588 and base.row_words(128) == 36
    for h in (128, 512, 5120, 6144):
        w = base.row_words(h)
        assert w % base.ROW_ALIGN_WORDS == 0 and 0 <= w - (h // 4 + h // 128 + 1) < base.ROW_ALIGN_WORDS
    with pytest.raises(ValueError, match="hidden"):
        base.row_words(100)


# ------------------------------------------------------------------------------------------------- floor bytes
def test_floor_bytes() -> None:
    h, inter = 5120, 2304  # dsv41-flash: 35.4 MB of FP8 weights + 8640 bytes of block scales per expert
    per_expert = 3 * h * inter + 4 * ((2 * inter // 128) * (h // 128) + (h // 128) * (inter // 128))
    assert per_expert == 35_398_080
    row = h + 4 * h // 128 + 2 * h  # FP8 + scales in, BF16 out
    assert _common.expert_floor_bytes(h, inter, 7, 8) == 7 * per_expert + 8 * row
    assert _common.expert_floor_bytes(h, inter, 0, 0) == 0
    assert _common.expert_floor_bytes(h, inter, 1, 0, "fp8xfp4") == 3 * h * inter // 2 + 3 * h * inter // 32
    with pytest.raises(ValueError, match="mma_type"):
        _common.expert_floor_bytes(h, inter, 1, 0, "fp4")
    routing = bench.point_routing("dsv41-flash", 4)
    plan = base.plan_all_to_all(routing, 96, 1)
    assert bench.rank_floor_bytes(plan, h, inter) == plan.active_experts * per_expert + plan.rows_received * row


def test_gemm_sm90_floor_unchanged_by_the_move() -> None:
    """gemm_sm90.floor_bytes now delegates to _common.expert_floor_bytes: the former inline formula still holds."""

    class _W:
        in_features, out_features = 6144, 4096

    layer = type("L", (), {"l1": _W()})()
    counts = torch.tensor([0, 3, 5, 0, 1])
    h, inter = 6144, 2048
    for mma in ("fp8xfp8", "fp8xfp4"):
        if mma == "fp8xfp8":
            per = 3 * h * inter + 4 * (2 * inter // 128 * h // 128 + h // 128 * inter // 128)
        else:
            per = 3 * h * inter // 2 + 3 * h * inter // 32
        assert gemm_sm90.floor_bytes(layer, counts, mma) == 3 * per + 9 * (h + 4 * h // 128) + 9 * 2 * h


# ---------------------------------------------------------------------------------------------- schema / targets
def _metrics(cos: float = 0.99999) -> dict[str, float | int]:
    return {"cosine": cos, "processed_diff": 1 - cos, "max_abs_err": 0.01, "rel_l2": 0.004, "nonfinite": 0,
            "nonfinite_ref": 0}


def _record(lat: dict[str, float], unavailable: dict[str, str] | None = None) -> dict[str, object]:
    return {"latency_us": dict(lat), "accuracy": {op: _metrics() for op in lat},
            "bit_identical": dict.fromkeys(lat, True), "unavailable": dict(unavailable or {})}


def _meta() -> dict[str, object]:
    return {"git_sha": "abc", "dirty": False, "date": "2026-11-30T00:00:00+00:00", "gpu": "NVIDIA H200",
            "driver": "580", "torch": "2.11", "cuda": "13.0", "world_size": 2,
            "partition": {"dispatch_sms": 4, "compute_sms": 128, "workqueue": "default"},
            "command": "python bench/operator_sm90.py --out bench/results/operator_sm90_x2.json", "targets": {}}


def test_assemble_point_takes_the_slowest_rank_and_ratios() -> None:
    routing = {"rows_received": [8, 4]}
    recs = [_record({"gc_moe": 50.0, "gc_moe_no_partition": 60.0, "composed_baseline": 150.0}),
            _record({"gc_moe": 55.0, "gc_moe_no_partition": 58.0, "composed_baseline": 140.0})]
    p = bench.assemble_point("glm52", 4, recs, 40.0, routing)
    assert p["latency_us"] == {"gc_moe": 55.0, "gc_moe_no_partition": 60.0, "composed_baseline": 150.0}
    assert p["per_rank_us"]["gc_moe"] == [50.0, 55.0]
    want = {"composed_baseline_over_gc_moe": 150 / 55, "no_partition_over_gc_moe": 60 / 55}
    assert p["speedup"] == pytest.approx(want)
    assert p["efficiency"]["gc_moe"] == pytest.approx(40 / 55)
    assert p["accuracy"]["gc_moe"]["meets_faithful_targets"] is True
    assert p["accuracy"]["composed_baseline"]["cosine_ge_0.99"] is True
    assert p["accuracy"]["gc_moe"]["graph_bit_identical_to_eager"] is True
    assert "unavailable" not in p and p["routing"] is routing
    bench.validate_result({"meta": _meta(), "points": [p]})
    recs[1]["accuracy"]["gc_moe"] = _metrics(0.9990)
    recs[0]["bit_identical"]["gc_moe"] = False
    p = bench.assemble_point("glm52", 4, recs, 40.0, routing)
    assert p["accuracy"]["gc_moe"]["meets_faithful_targets"] is False
    assert p["accuracy"]["gc_moe"]["cosine_min"] == 0.9990
    assert p["accuracy"]["gc_moe"]["graph_bit_identical_to_eager"] is False


def test_assemble_point_records_an_unavailable_baseline() -> None:
    why = "import deep_gemm failed: ModuleNotFoundError: No module named 'deep_gemm'"
    recs = [_record({"gc_moe": 50.0, "gc_moe_no_partition": 60.0}, {"composed_baseline": why}) for _ in range(2)]
    p = bench.assemble_point("dsv41-flash", 1, recs, 40.0, {})
    assert p["unavailable"] == {"composed_baseline": why}
    assert "composed_baseline" not in p["latency_us"] and set(p["speedup"]) == {"no_partition_over_gc_moe"}
    bench.validate_result({"meta": _meta(), "points": [p]})
    # measured on one rank only: not reported as measured
    recs = [_record({"gc_moe": 50.0, "gc_moe_no_partition": 60.0, "composed_baseline": 1.0}),
            _record({"gc_moe": 50.0, "gc_moe_no_partition": 60.0})]
    p = bench.assemble_point("dsv41-flash", 1, recs, 40.0, {})
    assert p["unavailable"] == {"composed_baseline": "not measured on every rank"}
    with pytest.raises(ValueError, match="records"):
        bench.assemble_point("dsv41-flash", 1, recs[:1], 40.0, {})


def test_validate_result_names_the_broken_field() -> None:
    recs = [_record({"gc_moe": 50.0, "gc_moe_no_partition": 60.0, "composed_baseline": 150.0})] * 2
    good = {"meta": _meta(), "points": [bench.assemble_point("glm52", 8, recs, 40.0, {})]}
    bench.validate_result(good)
    cases = [
        (lambda d: d["meta"].pop("driver"), r"meta\.driver"),
        (lambda d: d["meta"]["partition"].pop("workqueue"), r"meta\.partition\.workqueue"),
        (lambda d: d["meta"].update(world_size=1), r"meta\.world_size"),
        (lambda d: d["meta"].update(command="python bench/gemm_sm90.py"), r"meta\.command"),
        (lambda d: d["meta"].pop("targets"), r"meta\.targets"),
        (lambda d: d["points"][0].pop("floor_us"), r"points\[0\]\.floor_us"),
        (lambda d: d["points"][0]["per_rank_us"].update(gc_moe=[1.0, 2.0]), r"per_rank_us\.gc_moe"),
        (lambda d: d["points"][0]["latency_us"].update(other=3.0), r"latency_us\.other"),
        (lambda d: d["points"][0]["latency_us"].update(gc_moe=float("nan")), r"latency_us\.gc_moe"),
        (lambda d: d["points"][0]["accuracy"].pop("gc_moe"), r"accuracy\.gc_moe"),
        (lambda d: [d["points"][0][k].pop("composed_baseline") for k in ("latency_us", "per_rank_us")],
         "neither measured nor marked unavailable"),
    ]
    for breaks, message in cases:
        data = copy.deepcopy(good)
        breaks(data)
        with pytest.raises(ValueError, match=message):
            bench.validate_result(data)


def _point(preset: str, t: int, ours: float, nopart: float | None, comp: float | None, floor: float) -> dict:
    lat = {"gc_moe": ours}
    if nopart is not None:
        lat["gc_moe_no_partition"] = nopart
    if comp is not None:
        lat["composed_baseline"] = comp
    unavailable = {} if comp is not None else {"composed_baseline": "x"}
    return bench.assemble_point(preset, t, [_record(lat, unavailable)] * 2, floor, {})


def test_targets_are_booleans_with_values() -> None:
    pts = [_point("glm52", t, 100.0, 115.0, 200.0, 50.0) for t in SWEEP_TOKENS]
    got = bench.summarize_targets(pts)
    assert got["gc_moe_faster_than_composed_baseline"]["met"] is True
    assert got["gc_moe_faster_than_composed_baseline"]["min_speedup"] == pytest.approx(2.0)
    assert got["speedup_vs_no_partition_t4_to_32"]["met"] is True
    assert [v[1] for v in got["speedup_vs_no_partition_t4_to_32"]["values"]] == [4, 8, 16, 32]
    assert got["t1_within_3x_floor"] == {"met": True, "factor": 3.0, "latency_over_floor": [["glm52", 2.0]]}
    pts[0] = _point("glm52", 1, 160.0, 170.0, 150.0, 50.0)  # slower than the baseline and > 3x the floor at T=1
    pts[3] = _point("glm52", 8, 100.0, 105.0, 200.0, 50.0)  # partition gains only 5 % at T=8
    got = bench.summarize_targets(pts)
    assert got["gc_moe_faster_than_composed_baseline"]["met"] is False
    assert got["gc_moe_faster_than_composed_baseline"]["points_missed"] == [["glm52", 1, 150 / 160]]
    assert got["speedup_vs_no_partition_t4_to_32"]["met"] is False
    assert got["t1_within_3x_floor"]["met"] is False
    # no baseline anywhere: nothing to judge
    got = bench.summarize_targets([_point("glm52", t, 100.0, 115.0, None, 50.0) for t in (1, 4)])
    assert got["gc_moe_faster_than_composed_baseline"]["met"] is None
    assert got["gc_moe_faster_than_composed_baseline"]["points_unmeasured"] == [["glm52", 1], ["glm52", 4]]
    # a baseline measured at some points only cannot meet "every point"
    got = bench.summarize_targets([_point("glm52", 1, 100.0, 115.0, 200.0, 50.0),
                                   _point("glm52", 4, 100.0, 115.0, None, 50.0)])
    assert got["gc_moe_faster_than_composed_baseline"]["met"] is False


# ------------------------------------------------------------------------------------------------------- arguments
def test_parse_args_defaults_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GC_MOE_BENCH_WINDOWS", raising=False)
    monkeypatch.delenv("GC_MOE_BENCH_TOKENS", raising=False)
    args = bench.parse_args([])
    assert (args.warmup, args.windows, args.tokens) == (10, 30, list(SWEEP_TOKENS))
    assert args.presets == ["dsv41-flash", "glm52"]
    assert args.out == REPO / "bench/results/operator_sm90_x2.json"
    monkeypatch.setenv("GC_MOE_BENCH_WINDOWS", "2,5")
    monkeypatch.setenv("GC_MOE_BENCH_TOKENS", "1,64")
    args = bench.parse_args(["--presets", "glm52"])
    assert (args.warmup, args.windows, args.tokens, args.presets) == (2, 5, [1, 64], ["glm52"])
    monkeypatch.setenv("GC_MOE_BENCH_TOKENS", "0,300")
    with pytest.raises(SystemExit):
        bench.parse_args([])


def test_gemm_sm90_defaults_to_the_protocol_windows() -> None:
    text = (REPO / "bench/gemm_sm90.py").read_text()
    assert 'add_argument("--warmup", type=int, default=10)' in text
    assert 'add_argument("--windows", type=int, default=30)' in text


def test_device_check_maps_the_two_rank_result_name() -> None:
    text = (REPO / "scripts/device_check.sh").read_text()
    assert "[operator_sm90]=operator_sm90_x2" in text
    assert 'bench/$name.py" --out "bench/results/$result.json"' in text


def test_prebuild_covers_every_deepgemm_shape_of_the_sweep() -> None:
    calls = bench._deepgemm_calls(["glm52"], [1, 256])
    e, *_ = ow.preset_dims("glm52")
    want = {("glm52", p.max_m, p.expected_m) for t in (1, 256)
            for p in (base.plan_all_to_all(bench.point_routing("glm52", t), 2 * e, r) for r in range(2))}
    assert set(calls) == want and calls == sorted(calls)


# ---------------------------------------------------------------------------------------------- operator workload
def test_operator_workload_on_the_host(group: object) -> None:
    """The helpers the GPU tests and the benchmark share, on the CPU with the tiny preset."""
    e, k, h, inter = ow.preset_dims("tiny")
    assert (e, k, h, inter) == (4, 2, 512, 256)
    w = ow.make_weights("tiny", 1, "cpu")
    l1, l2 = ow.make_expert_weights("tiny", 1, "cpu")
    assert torch.equal(w.l1.payload.view(torch.uint8), l1.payload.view(torch.uint8))
    assert torch.equal(w.l2.scales, l2.scales)
    w1, _ = api.transform_weights_for_gc_moe((l1.payload, l1.scales), (l2.payload, l2.scales), "fp8xfp8")
    assert torch.equal(w.w1.payload.view(torch.uint8), w1.payload.view(torch.uint8))
    a = ow.make_inputs("uniform", 6, 2 * e, k, h, seed=3, device="cpu")
    b = ow.make_inputs("uniform", 6, 2 * e, k, h, seed=3, device="cpu")
    assert torch.equal(a.topk_idx, b.topk_idx) and torch.equal(a.x_sf, b.x_sf) and a.tokens == 6
    assert all(len(set(row)) == k for row in a.topk_idx.tolist())
    with pytest.raises(ValueError, match="kind"):
        ow.make_inputs("bad", 1, 8, 2, h, seed=0, device="cpu")
    other = ow.make_inputs("holes", 3, 2 * e, k, h, seed=4, device="cpu")
    weights = [ow.make_weights("tiny", 0, "cpu"), w]
    ys = ow.reference_ys([a, other], weights)
    ys_pairs = ow.reference_ys([a, other], [(x.l1, x.l2) for x in weights])
    assert [y.shape for y in ys] == [(6, h), (3, h)]
    assert all(torch.equal(p, q) for p, q in zip(ys, ys_pairs, strict=True))
    buf = api.get_symm_buffer_for_gc_moe(group, e, ow.CAPACITY, k, h, inter, "fp8xfp8", compute_sms=112)
    ow.stage(buf, ow.make_inputs("uniform", 5, e, k, h, seed=1, device="cpu"))
    assert (buf.topk_idx[5:] == -1).all() and (buf.topk_idx[:5] >= 0).all()


# ------------------------------------------------------------------------------------- Triton kernels (interpreter)
HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (its CPU interpreter runs these kernels)")
def test_baseline_kernels_in_the_triton_interpreter() -> None:
    """The baseline's five Triton kernels in TRITON_INTERPRET=1 (a subprocess: the flag is read at import)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), env.get("PYTHONPATH")]))
    code = "import test_bench_operator as t; t.interpreter_checks(); print('interpreter ok')"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "interpreter ok" in proc.stdout, proc.stdout + proc.stderr


def _act_oracle(d1: torch.Tensor, rw: torch.Tensor, clamp: float, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Clamped SwiGLU x routing weight, 1x128 requant (FP32 quotient before the E4M3 cast, FP32 scales)."""
    inter = d1.shape[-1] // 2
    gate = d1[..., :inter].float().clamp(max=clamp)
    up = d1[..., inter:].float().clamp(-clamp, clamp)
    act = gate * (1 / (1 + torch.exp(-(alpha * gate)))) * up * rw.unsqueeze(-1)
    g = act.reshape(*act.shape[:-1], inter // 128, 128)
    scale = g.abs().amax(-1).clamp(min=base.AMAX_FLOOR) / base.E4M3_MAX
    return (g / scale.unsqueeze(-1)).clamp(-base.E4M3_MAX, base.E4M3_MAX).reshape(act.shape), scale


def _numpy2_scalar_index() -> None:
    """Triton 3.6's interpreter holds scalars as 1-element arrays and turns them into loop bounds with ``int()``,
    which numpy >= 2 rejects for arrays with a dimension; take the element instead (interpreter only)."""
    import triton.runtime.interpreter as interp

    original = interp._patch_lang_tensor

    def patched(tensor: object, scope: object) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched


def interpreter_checks() -> None:
    """Run by :func:`test_baseline_kernels_in_the_triton_interpreter` with TRITON_INTERPRET=1."""
    _numpy2_scalar_index()
    gen = torch.Generator().manual_seed(0)
    # the activation: valid rows only, MN-major scales, padding rows untouched
    e, max_m, inter = 3, 8, 384
    d1 = (torch.randn(e, max_m, 2 * inter, generator=gen) * 4).to(torch.bfloat16)
    rw = torch.rand(e, max_m, generator=gen)
    masked_m = torch.tensor([5, 0, 8], dtype=torch.int32)
    a2 = torch.full((e, max_m, inter), -7.0)
    sf_t = torch.full((e, inter // 128, max_m), -7.0)
    base.swiglu_quant_masked(d1, rw, masked_m, a2, sf_t, clamp=3.0, alpha=1.5, row_programs=3)
    q, scale = _act_oracle(d1, rw, 3.0, 1.5)
    for ex, n in enumerate(masked_m.tolist()):
        torch.testing.assert_close(sf_t[ex, :, :n].T, scale[ex, :n], rtol=1e-6, atol=0)
        torch.testing.assert_close(a2[ex, :n], q[ex, :n], rtol=1e-5, atol=1e-4)
        assert (a2[ex, n:] == -7.0).all() and (sf_t[ex, :, n:] == -7.0).all()
        if n:
            amax = a2[ex, :n].reshape(n, -1, 128).abs().amax(-1)
            torch.testing.assert_close(amax, torch.full_like(amax, base.E4M3_MAX))

    # a two-rank round trip through the data-movement kernels, the all-to-all simulated by slicing
    num_ranks, local, topk, h = 2, 3, 2, 256
    tokens = [5, 3]
    routing = _routing(tokens, num_ranks * local, topk, seed=7, holes=0.2)
    plans = [base.plan_all_to_all(routing, num_ranks * local, r) for r in range(num_ranks)]
    xs = [torch.randn(t, h, generator=gen).clamp(-400, 400).to(torch.float8_e4m3fn) for t in tokens]
    sfs = [torch.rand(t, h // 128, generator=gen) + 0.5 for t in tokens]
    ws = [torch.rand(t, topk, generator=gen) for t in tokens]
    words = base.row_words(h)
    sends = []
    for r, p in enumerate(plans):
        send = torch.zeros(p.rows_sent, words, dtype=torch.int32)
        base.pack_rows(xs[r], sfs[r], ws[r], p.send_token, p.send_slot, send)
        sends.append(send)

    def exchange(blocks: list[torch.Tensor], splits: list[list[int]], dst: int) -> torch.Tensor:
        parts = []
        for src in range(num_ranks):
            off = sum(splits[src][:dst])
            parts.append(blocks[src][off: off + splits[src][dst]])
        return torch.cat(parts)

    partials = []
    for r, p in enumerate(plans):
        recv = exchange(sends, [q.input_splits for q in plans], r)
        assert recv.shape[0] == p.rows_received
        x_m = torch.zeros(local, p.max_m, h, dtype=torch.float8_e4m3fn)
        sf_m = torch.zeros(local, h // 128, p.max_m)
        rw_m = torch.zeros(local, p.max_m)
        base.unpack_rows(recv, p.recv_dest, x_m, sf_m, rw_m)
        # every received row landed where the plan says, with its payload, scales and routing weight
        i = 0
        for src in range(num_ranks):
            for t, s in zip(plans[src].send_token.tolist(), plans[src].send_slot.tolist(), strict=True):
                if int(routing[src][t, s]) // local != r:
                    continue
                d = int(p.recv_dest[i])
                ex, pos = divmod(d, p.max_m)
                assert torch.equal(x_m[ex, pos].view(torch.uint8), xs[src][t].view(torch.uint8))
                assert torch.equal(sf_m[ex, :, pos], sfs[src][t]) and float(rw_m[ex, pos]) == float(ws[src][t, s])
                i += 1
        assert i == p.rows_received
        # a stand-in for the GEMMs: each expert's partial row = (dequantized row x weight + expert id), BF16
        d2 = torch.zeros(local, p.max_m, h, dtype=torch.bfloat16)
        deq = x_m.float() * sf_m.transpose(1, 2).repeat_interleave(128, dim=2)
        d2[:] = (deq * rw_m.unsqueeze(-1) + torch.arange(local).view(-1, 1, 1)).to(torch.bfloat16)
        back = torch.zeros(p.rows_received, h, dtype=torch.bfloat16)
        base.gather_rows(d2.view(-1, h), p.recv_dest, back)
        assert torch.equal(back, d2.view(-1, h)[p.recv_dest])
        partials.append(back)
    for r, p in enumerate(plans):
        back_recv = exchange(partials, [q.output_splits for q in plans], r)
        y = torch.full((tokens[r], h), float("nan"), dtype=torch.bfloat16)
        base.combine_slots(back_recv, p.combine_index, y, block=128)
        want = torch.zeros(tokens[r], h)
        deq = xs[r].float() * sfs[r].repeat_interleave(128, dim=1)
        for s in range(topk):  # slot order, FP32
            ex = routing[r][:, s]
            part = (deq * ws[r][:, s:s + 1] + (ex % local).unsqueeze(1)).to(torch.bfloat16).float()
            want = torch.where((ex >= 0).unsqueeze(1), want + part, want)
        # the GPU rounds the FP32 sum to nearest even; Triton 3.6's interpreter truncates FP32 -> BF16
        truncated = (want.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
        assert torch.equal(y, want.to(torch.bfloat16)) or torch.equal(y, truncated), (y - want).abs().max()
    _composed_two_ranks()
    _gemm_sm90_pipeline()


def _gemm_sm90_pipeline() -> None:
    """bench/gemm_sm90.py's DeepGEMM pipeline (tokens staged into the masked layout, the shared fused activation)
    with :class:`FakeDeepGemm`: every valid (token, slot) partial equals the faithful reference's (tiny preset)."""
    from _gemm_workload import make_layer, make_tokens, reference_partials

    from gc_moe_compat.testing.reference import accuracy_metrics

    layer = make_layer("tiny", torch.device("cpu"), seed=1)
    tok = make_tokens(layer, 4, seed=4)
    pipe = gemm_sm90.DeepGemmPipeline(FakeDeepGemm(), layer, tok)
    pipe.masked.a2 = torch.zeros(pipe.masked.a2.shape)  # FP32 quotients: see FakeDeepGemm
    pipe.pipeline()
    ref, valid = reference_partials(layer, tok, faithful=True)
    ours = torch.zeros_like(ref)
    for ex in range(layer.l1.num_experts):
        tokens, slots = (tok.topk_idx == ex).nonzero(as_tuple=True)
        ours[tokens, slots] = pipe.masked.d2[ex, : tokens.numel()]
    assert int(valid.sum()) > 0
    m = accuracy_metrics(ours[valid].float(), ref[valid].float())  # bit-exact here; an exp ulp may flip one E4M3
    assert m["nonfinite"] == 0 and m["cosine"] >= 0.9999 and m["processed_diff"] <= 1e-4, m


class FakeDeepGemm:
    """``m_grouped_fp8_gemm_nt_masked`` on the CPU with DeepGEMM's semantics for the SM90 recipe (1, 128, 128):
    per group g, ``d[g, :masked_m[g]] = A @ B^T`` of the dequantized operands (exact product, FP32, BF16 out).
    ``sfa`` must arrive MN-major (as the baseline passes it, so DeepGEMM runs no transpose). An FP32 ``A`` is the
    activation kernel's interpreter output (the quotient before its E4M3 cast): cast here, round to nearest even."""

    @staticmethod
    def m_grouped_fp8_gemm_nt_masked(a: tuple, b: tuple, d: torch.Tensor, masked_m: torch.Tensor, expected_m: int,
                                     recipe: tuple, disable_ue8m0_cast: bool) -> None:
        (x, sfa), (w, sfb) = a, b
        assert recipe == (1, 128, 128) and disable_ue8m0_cast and expected_m >= 1
        assert sfa.stride(1) == 1 and sfa.stride(2) == sfa.shape[1], "activation scales must be MN-major"
        assert masked_m.dtype == torch.int32 and d.dtype == torch.bfloat16
        x = x.to(torch.float8_e4m3fn) if x.dtype == torch.float32 else x
        for g, m in enumerate(masked_m.tolist()):
            xa = x[g, :m].float() * sfa[g, :m].repeat_interleave(128, dim=-1)
            wb = w[g].float() * sfb[g].repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)
            d[g, :m] = (xa.double() @ wb.double().T).float().to(torch.bfloat16)


def _composed_rank(rank: int, port: int, tokens: list[int]) -> None:
    """One gloo rank of :func:`_composed_two_ranks`: the composed baseline's run() against the faithful reference."""
    import torch.distributed as dist

    from gc_moe_compat.testing.reference import accuracy_metrics

    _numpy2_scalar_index()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        e, k, h, _ = ow.preset_dims("tiny")
        inputs = [ow.make_inputs("holes", t, 2 * e, k, h, seed=40 + r, device="cpu") for r, t in enumerate(tokens)]
        weights = [ow.make_expert_weights("tiny", r, "cpu") for r in range(2)]
        y_ref = ow.reference_ys(inputs, weights)[rank]
        plan = base.plan_all_to_all([i.topk_idx for i in inputs], 2 * e, rank)
        composed = base.ComposedBaseline(FakeDeepGemm(), dist.group.WORLD, plan, *weights[rank], clamp=ow.CLAMP)
        composed.pipe.a2 = torch.zeros(composed.pipe.a2.shape)  # FP32 quotients: see FakeDeepGemm
        composed.stage(inputs[rank].x, inputs[rank].x_sf, inputs[rank].topk_weights)
        y = composed.run()
        m = accuracy_metrics(y.float(), y_ref.float())
        # the sigmoid differs from torch's by an ulp at most (one E4M3 flip moves tiny's processed diff by ~1e-4)
        assert m["nonfinite"] == 0 and m["cosine"] >= 0.9995 and m["processed_diff"] <= 5e-4, (rank, m)
        assert torch.equal(composed.run(), y)  # a second run: same bits
    finally:
        dist.destroy_process_group()


def _composed_two_ranks() -> None:
    """The composed baseline end to end on two gloo ranks: Triton kernels in the interpreter, NCCL replaced by gloo,
    DeepGEMM by :class:`FakeDeepGemm`; every rank's y against the 2-rank faithful reference (tiny preset)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_composed_rank, args=(port, [7, 3]), nprocs=2)



def test_write_result_table_and_png(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The rank-0 writer on the host (the GPU name faked): a file that passes the schema check, the table, and the
    PNG where matplotlib is installed."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H200 (faked)")
    monkeypatch.delenv("GC_MOE_BENCH_TOKENS", raising=False)
    args = bench.parse_args(["--out", str(tmp_path / "operator_sm90_x2.json")])
    pts = [_point(p, t, 100.0 + t, 120.0 + t, 300.0 if t > 1 else None, 60.0) for p in ("glm52", "dsv41-flash")
           for t in (1, 4, 64)]
    part = {"dispatch_sms": 4, "compute_sms": 128, "workqueue": "default"}
    bench.write_result(args, pts, part, [4.2e12, 4.3e12], None, [["glm52", 256]], final=True)
    data = __import__("json").loads(args.out.read_text())
    bench.validate_result(data)
    meta = data["meta"]
    assert "schema_error" not in meta and meta["complete"] is False
    assert meta["skipped_points"]["points"] == [["glm52", 256]]
    assert meta["world_size"] == 2 and meta["partition"] == part and meta["gpu"] == "NVIDIA H200 (faked)"
    assert meta["targets"]["gc_moe_faster_than_composed_baseline"]["met"] is False  # unmeasured at T = 1
    assert len(data["points"]) == 6
    png = args.out.with_suffix(".png")
    assert png.is_file() == (importlib.util.find_spec("matplotlib") is not None)
    bench.print_table(pts)
    out = capsys.readouterr().out
    assert out.count("glm52") == 3 and out.count("dsv41-flash") == 3 and "composed" in out


class _FakeRanks:
    """Rank 0 of two, with the peer's contribution to every gather fixed."""

    rank, world, group = 0, 2, None

    def __init__(self, peer: object = None) -> None:
        self.peer = peer

    def gather(self, obj: object) -> list[object]:
        return [obj, self.peer]

    def align(self) -> None:
        """The barrier before each timed window: nothing to wait for here."""


class _FakeGraph:
    def __init__(self, fn: object) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


@pytest.mark.parametrize("case", ["ok", "run_fails", "peer_fails", "check_fails", "replay_differs"])
def test_measure_op_records_latency_or_why_not(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """measure_op's decisions with the device parts faked: eager accuracy, capture, timing, the post-replay check
    and the bit-identity of replayed and eager y; any rank's failure makes the op unavailable on both."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *_: None)
    monkeypatch.setattr(bench, "capture_graph", _FakeGraph)
    monkeypatch.setattr(bench, "median_graph_window", lambda graph, *_: (graph.replay(), 42.5)[1])
    y_ref = torch.randn(3, 8).to(torch.bfloat16)
    y = y_ref.clone()
    calls = []

    def run() -> torch.Tensor:
        calls.append(1)
        if case == "run_fails":
            raise RuntimeError("eager call failed")
        if case == "replay_differs" and len(calls) > 1:
            y.add_(1)
        return y

    def check() -> None:
        if case == "check_fails":
            raise TimeoutError("role2 timed out")

    record = {"latency_us": {}, "accuracy": {}, "bit_identical": {}, "unavailable": {}}
    ranks = _FakeRanks("ValueError: peer broke" if case == "peer_fails" else None)
    bench.measure_op("gc_moe", run, y_ref, ranks, record, bench.parse_args([]), check=check)
    if case in ("ok", "replay_differs"):
        assert record["latency_us"] == {"gc_moe": 42.5} and not record["unavailable"]
        assert record["accuracy"]["gc_moe"]["cosine"] == pytest.approx(1.0)
        assert record["bit_identical"] == {"gc_moe": case == "ok"}
    else:
        assert "gc_moe" not in record["latency_us"]
        why = record["unavailable"]["gc_moe"]
        want = {"run_fails": "failed: RuntimeError: eager call failed", "peer_fails": "failed: ValueError: peer broke",
                "check_fails": "device error after the timed replays: TimeoutError: role2 timed out"}[case]
        assert why == want


def test_measure_baseline_setup_failure_is_shared(monkeypatch: pytest.MonkeyPatch) -> None:
    """A baseline that cannot be set up on one rank is unavailable on both, before any collective of its own."""

    def broken(*_: object, **__: object) -> None:
        raise MemoryError("no room")

    monkeypatch.setattr(base, "ComposedBaseline", broken)
    record = {"latency_us": {}, "accuracy": {}, "bit_identical": {}, "unavailable": {}}
    bench.measure_baseline(_FakeRanks(), None, None, (None, None), None, None, record, bench.parse_args([]))
    assert not record["latency_us"]
    assert record["unavailable"] == {"composed_baseline": "setup failed: MemoryError: no room"}
    record["unavailable"].clear()
    staged = type("Staged", (), {"stage": lambda self, *_: None})()
    monkeypatch.setattr(base, "ComposedBaseline", lambda *_, **__: staged)  # fine here, broken on the peer
    inputs = type("Inputs", (), {"x": None, "x_sf": None, "topk_weights": None})()
    bench.measure_baseline(_FakeRanks("MemoryError: no room"), None, None, (None, None), inputs, None, record,
                           bench.parse_args([]))
    assert record["unavailable"] == {"composed_baseline": "setup failed: MemoryError: no room"}


def test_import_deep_gemm_never_returns_the_facade(monkeypatch: pytest.MonkeyPatch) -> None:
    from gc_moe_compat import originals

    monkeypatch.setattr(originals, "_failures", {})  # the load failure below is not cached for other tests
    real = type(sys)("deep_gemm")
    monkeypatch.setitem(sys.modules, "deep_gemm", real)
    assert base.import_deep_gemm() is real
    facade = type(sys)("gc_moe_compat.deep_gemm")  # what GC_MOE_SWAP=deep_gemm puts under the name deep_gemm
    monkeypatch.setitem(sys.modules, "deep_gemm", facade)
    with pytest.raises(ImportError, match="no original deep_gemm"):  # none installed here: never the facade
        base.import_deep_gemm()
