"""Tests for gc_moe_compat.references.reference: the FP32 references every kernel is checked against."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gc_moe_compat import quant
from gc_moe_compat.references import reference as ref
from gc_moe_compat.references.reference import ExpertWeights


def _bf16(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.bfloat16).float()


def _random_layer(e: int, h: int, i: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Float L1 [E, 2I, H] and L2 [E, H, I] with the realistic N(0, 1/sqrt(K)) scale."""
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(e, 2 * i, h, generator=g) / math.sqrt(h)
    w2 = torch.randn(e, h, i, generator=g) / math.sqrt(i)
    return w1, w2


def _random_routing(t: int, e: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform top-k without repetition, softmax routing weights (BENCH_PROTOCOL.md)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k)
    weights = torch.softmax(torch.randn(t, k, generator=g), dim=-1)
    return idx.long(), weights


def _one_expert(gate: float, up: float, down: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """H = I = 1, one expert: x @ W1^T = (gate, up) for x = [1]; W2 = [[down]]."""
    return torch.tensor([[[gate], [up]]]), torch.tensor([[[down]]])


ONE = torch.tensor([[1.0]])
IDX0 = torch.tensor([[0]])


# ----------------------------------------------------------------------------------------------------------- weights
@pytest.mark.parametrize(
    ("fmt", "atol"), [("mxfp4", 0.6), ("fp8_block128", 0.05), ("fp8_k32", 0.05), ("bf16", 0.01), ("fp32", 0.0)]
)
def test_weights_quantize_dequantize(fmt: str, atol: float) -> None:
    w1, _ = _random_layer(3, 64, 32)
    w = ExpertWeights.quantize(w1, fmt)
    assert (w.num_experts, w.out_features, w.in_features) == (3, 64, 64)
    deq = w.dequantize()
    assert deq.dtype == torch.float32 and deq.shape == w1.shape
    torch.testing.assert_close(deq, w1, atol=atol * w1.abs().max().item(), rtol=0)
    torch.testing.assert_close(w.dequantize(1), deq[1], atol=0, rtol=0)


def test_weights_formats_match_quant() -> None:
    w1, _ = _random_layer(2, 64, 32)
    mx = quant.dequantize_mxfp4(*quant.quantize_mxfp4(w1))
    assert torch.equal(ExpertWeights.quantize(w1, "mxfp4").dequantize(), mx)
    q, s = quant.quantize_fp8_blocks(w1, 128)
    assert torch.equal(ExpertWeights.quantize(w1, "fp8_block128").dequantize(), quant.dequantize_fp8_blocks(q, s))
    q, s = quant.quantize_fp8_groups(w1, 32, "ue8m0")
    assert torch.equal(ExpertWeights.quantize(w1, "fp8_k32").dequantize(), quant.dequantize_fp8_groups(q, s))


def test_weights_single_expert_int8_payload_and_shard() -> None:
    w1, _ = _random_layer(4, 64, 32)
    one = ExpertWeights.quantize(w1[2], "mxfp4")
    assert one.num_experts == 1
    as_int8 = ExpertWeights("mxfp4", one.payload.view(torch.int8), one.scales)
    assert torch.equal(as_int8.dequantize(0), one.dequantize(0))
    full = ExpertWeights.quantize(w1, "fp8_k32")
    shards = full.shard(2)
    assert [s.num_experts for s in shards] == [2, 2]
    assert torch.equal(shards[1].dequantize(0), full.dequantize(2))
    with pytest.raises(ValueError, match="num_ranks"):
        full.shard(3)


def test_weights_validation() -> None:
    w = torch.randn(2, 64, 64)
    fp8, s = quant.quantize_fp8_groups(w, 32, "ue8m0")
    with pytest.raises(ValueError, match="fmt"):
        ExpertWeights("int4", w)
    with pytest.raises(ValueError, match="fmt"):
        ExpertWeights.quantize(w, "int4")
    with pytest.raises(ValueError, match="payload"):
        ExpertWeights("fp32", w[0])
    with pytest.raises(ValueError, match="scales"):
        ExpertWeights("fp32", w, s)
    with pytest.raises(ValueError, match="scales"):
        ExpertWeights("fp8_k32", fp8)
    with pytest.raises(ValueError, match="dtype"):
        ExpertWeights("bf16", w)
    with pytest.raises(ValueError, match="scales"):
        ExpertWeights("fp8_block128", fp8, s)
    with pytest.raises(ValueError, match="K % 32"):
        ExpertWeights("fp8_k32", fp8[..., :48], s[..., :1])
    with pytest.raises(TypeError, match="l1_per_rank"):
        ref.moe_reference(ONE, IDX0, ONE, torch.zeros(1, 2, 1, dtype=torch.int32), torch.ones(1, 1, 1))


# ------------------------------------------------------------------------------------------------------- activations
@pytest.mark.parametrize(("mode", "group"), [("ue8m0_32", 32), ("ue8m0_128", 128), ("fp32_128", 128)])
def test_activations_roundtrip_matches_quant(mode: str, group: int) -> None:
    x = torch.randn(5, 256)
    q, s = ref.quantize_activations(x, mode)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 256 // group)
    fmt = "fp32" if mode == "fp32_128" else "ue8m0"
    q2, s2 = quant.quantize_fp8_groups(x, group, fmt)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    assert torch.equal(ref.dequantize_activations((q, s)), quant.dequantize_fp8_groups(q2, s2))
    if fmt == "ue8m0":
        assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # powers of two


def test_activations_validation() -> None:
    x = torch.randn(2, 64)
    q, s = ref.quantize_activations(x, "ue8m0_32")
    with pytest.raises(ValueError, match="mode"):
        ref.quantize_activations(x, "e5m2")
    with pytest.raises(ValueError, match="group size"):
        ref.quantize_activations(x, "fp32_128")
    with pytest.raises(TypeError, match="float tensor"):
        ref.dequantize_activations(q)
    with pytest.raises(TypeError, match="float tensor"):
        ref.dequantize_activations(torch.ones(2, 64, dtype=torch.int32))
    with pytest.raises(TypeError, match="pair"):
        ref.dequantize_activations((q, s.double()))
    with pytest.raises(ValueError, match="tile"):
        ref.dequantize_activations((q, s[:, :0]))
    assert torch.equal(ref.dequantize_activations(x.bfloat16()), x.bfloat16().float())


# ----------------------------------------------------------------------------------- hand-computed epilogue semantics
def test_swiglu_clamp_alpha_hand() -> None:
    # gate 12 -> min(12, 10) = 10; up -15 -> clamp to -10; alpha 0.5; routing weight 0.5 (all BF16-exact).
    w1, w2 = _one_expert(12.0, -15.0)
    out = ref.moe_reference(ONE, IDX0, torch.tensor([[0.5]]), w1, w2, activation_clamp=10.0, activation_alpha=0.5)
    gate, up = torch.tensor(10.0), torch.tensor(-10.0)
    expected = _bf16(gate * torch.sigmoid(0.5 * gate) * up * 0.5)
    assert out.y.item() == expected.item() and out.y.dtype == torch.bfloat16
    # the lower bound of gate is not clamped: silu(-12) * clamp(3, -10, 10)
    w1, w2 = _one_expert(-12.0, 3.0)
    out = ref.moe_reference(ONE, IDX0, ONE, w1, w2, activation_clamp=10.0)
    assert out.y.item() == _bf16(torch.tensor(-12.0) * torch.sigmoid(torch.tensor(-12.0)) * 3.0).item()
    # no clamp when it is None
    w1, w2 = _one_expert(12.0, -15.0)
    out = ref.moe_reference(ONE, IDX0, ONE, w1, w2, activation_clamp=None)
    assert out.y.item() == _bf16(torch.tensor(12.0) * torch.sigmoid(torch.tensor(12.0)) * -15.0).item()


def test_swiglu_function() -> None:
    gate = torch.tensor([-20.0, -1.0, 0.0, 3.0, 50.0])
    up = torch.tensor([50.0, -50.0, 1.0, 2.0, -3.0])
    out = ref.swiglu(gate, up, activation_clamp=7.0, activation_alpha=1.702)
    g = gate.clamp(max=7.0)
    torch.testing.assert_close(out, g * torch.sigmoid(1.702 * g) * up.clamp(-7.0, 7.0), rtol=0, atol=0)


def test_bf16_rounding_before_activation_changes_result() -> None:
    # acc gate = 2.01171875 is not BF16: it rounds to 2.015625 before SwiGLU, and the output differs in BF16.
    w1, w2 = _one_expert(2.0 + 3 / 256, 1.0)
    rounded = ref.moe_reference(ONE, IDX0, ONE, w1, w2)
    unrounded = ref.moe_reference(ONE, IDX0, ONE, w1, w2, round_l1_bf16=False)
    g = torch.tensor(2.015625)
    assert rounded.y.item() == _bf16(g * torch.sigmoid(g)).item()
    g = torch.tensor(2.0 + 3 / 256)
    assert unrounded.y.item() == _bf16(g * torch.sigmoid(g)).item()
    assert rounded.y.item() != unrounded.y.item()


def test_w2_output_rounded_to_bf16_per_slot() -> None:
    # two slots, each W2 output 1 + 2^-9 before rounding: BF16 partials are 1.0 each, so the FP32 sum is exactly 2.0
    # (without per-slot rounding it would be 2.00390625).
    w1, w2 = _one_expert(20.0, 1.0, down=1.0)  # silu(20) = 20 * sigmoid(20) ~= 20 (FP32: 20 - 4e-8 -> 20.0)
    idx = torch.tensor([[0, 0]])
    act = _bf16(torch.tensor(20.0)) * torch.sigmoid(torch.tensor(20.0))
    tw = torch.tensor([[1.0, 1.0]]) * (1 + 2**-9) / act
    out = ref.moe_reference(ONE, idx, tw, w1, w2)
    assert out.partials.dtype == torch.bfloat16
    assert out.partials.float().flatten().tolist() == [1.0, 1.0]
    assert out.y_fp32.item() == 2.0


def _requant_layer(mode: str, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    w1, w2 = _random_layer(1, 64, i, seed=3)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    rw = torch.tensor([0.3, 0.71, 1.9])
    return x, w1[0], w2[0], rw


@pytest.mark.parametrize(("mode", "i"), [("ue8m0_32", 32), ("ue8m0_128", 128), ("fp32_128", 128)])
def test_requantized_intermediate_is_quant_roundtrip(mode: str, i: int) -> None:
    x, w1, w2, rw = _requant_layer(mode, i)
    plain = ref.l1_intermediate(x, w1, rw, activation_clamp=10.0)
    requant = ref.l1_intermediate(x, w1, rw, activation_clamp=10.0, intermediate_quant=mode)
    group, fmt = {"ue8m0_32": (32, "ue8m0"), "ue8m0_128": (128, "ue8m0"), "fp32_128": (128, "fp32")}[mode]
    assert torch.equal(requant, quant.dequantize_fp8_groups(*quant.quantize_fp8_groups(plain, group, fmt)))
    assert not torch.equal(requant, plain)
    # hand-built W1 stage: BF16 accumulator, SwiGLU, routing weight
    acc = _bf16(x @ w1.T)
    hand = ref.swiglu(acc[:, :i], acc[:, i:], activation_clamp=10.0) * rw[:, None]
    torch.testing.assert_close(plain, hand, rtol=1e-6, atol=1e-6)
    # the expert's partial is the BF16 W2 GEMM of exactly that intermediate
    rows = ref.expert_rows(x, w1, w2, rw, activation_clamp=10.0, intermediate_quant=mode)
    assert torch.equal(rows, (requant.double() @ w2.double().T).float().to(torch.bfloat16))


def test_routing_weight_applied_before_requantization() -> None:
    x, w1, w2, rw = _requant_layer("ue8m0_32", 32)
    plain = ref.l1_intermediate(x, w1, torch.ones(3))
    requant = ref.l1_intermediate(x, w1, rw, intermediate_quant="ue8m0_32")

    def qdq(a: torch.Tensor) -> torch.Tensor:
        return quant.dequantize_fp8_groups(*quant.quantize_fp8_groups(a, 32, "ue8m0"))

    assert torch.equal(requant, qdq(plain * rw[:, None]))
    assert not torch.equal(requant, qdq(plain) * rw[:, None])  # weight after requant would be a different kernel
    # through the layer: token t, one slot with weight rw[t]
    layer = ref.moe_reference(
        x, torch.zeros(3, 1, dtype=torch.long), rw[:, None], w1[None], w2[None], intermediate_quant="ue8m0_32"
    )
    assert torch.equal(layer.partials[:, 0], ref.expert_rows(x, w1, w2, rw, intermediate_quant="ue8m0_32"))


# ------------------------------------------------------------------------------------------------- routing, combine
def test_minus_one_slots_and_empty_tokens() -> None:
    e, h, i = 3, 64, 32
    w1, w2 = _random_layer(e, h, i)
    l1, l2 = ExpertWeights.quantize(w1, "mxfp4"), ExpertWeights.quantize(w2, "mxfp4")
    x = ref.quantize_activations(torch.randn(3, h), "ue8m0_32")
    idx = torch.tensor([[-1, 2], [-1, -1], [1, -1]])
    tw = torch.tensor([[5.0, 0.5], [1.0, 1.0], [0.25, 7.0]])
    out = ref.quantization_faithful_reference(x, idx, tw, l1, l2, activation_clamp=10.0)
    assert out.valid.tolist() == [[False, True], [False, False], [True, False]]
    assert not out.partials[~out.valid].any()
    assert not out.y[1].any() and not out.y_fp32[1].any()
    xf = ref.dequantize_activations(x)
    for t, (s, ex) in enumerate([(1, 2), (None, None), (0, 1)]):
        if s is None:
            continue
        row = ref.expert_rows(
            xf[t : t + 1],
            l1.dequantize(ex),
            l2.dequantize(ex),
            tw[t, s : s + 1],
            activation_clamp=10.0,
            intermediate_quant="ue8m0_32",
        )
        assert torch.equal(out.partials[t, s], row[0])
        assert torch.equal(out.y_fp32[t], row[0].float())
    # with a shared expert, the all -1 token gets exactly the shared partial
    shared = (ExpertWeights.quantize(w1[0], "fp8_k32"), ExpertWeights.quantize(w2[0], "fp8_k32"))
    out_s = ref.quantization_faithful_reference(x, idx, tw, l1, l2, shared=shared, activation_clamp=10.0)
    assert out_s.partials.shape == (3, 3, h) and out_s.valid[:, 2].all()
    assert torch.equal(out_s.y_fp32[1], out_s.partials[1, 2].float())


def test_shared_expert_is_last_slot_with_weight_one() -> None:
    e, h, i = 2, 64, 32
    w1, w2 = _random_layer(e + 1, h, i, seed=7)
    x = torch.randn(4, h).bfloat16()
    idx, tw = _random_routing(4, e, 2, seed=1)
    for fmt in ("fp8_k32", "fp8_block128", "bf16"):
        shared = (ExpertWeights.quantize(w1[e], fmt), ExpertWeights.quantize(w2[e], fmt))
        out = ref.model_reference(x, idx, tw, w1[:e], w2[:e], shared=shared, activation_clamp=10.0)
        routed = ref.model_reference(x, idx, tw, w1[:e], w2[:e], activation_clamp=10.0)
        expected = ref.expert_rows(
            x.float(), shared[0].dequantize(0), shared[1].dequantize(0), torch.ones(4), activation_clamp=10.0
        )
        assert torch.equal(out.partials[:, 2], expected)
        assert torch.equal(out.partials[:, :2], routed.partials)
        assert torch.equal(out.y_fp32, routed.y_fp32 + expected.float())  # slot k added last
    with pytest.raises(ValueError, match="shared"):
        ref.model_reference(x, idx, tw, w1[:e], w2[:e], shared=(w1[:e], w2[:e]))


def test_combine_sums_in_slot_order() -> None:
    # 2^24 + 1 + 1 in FP32: slot order gives 2^24 (each +1 is lost); any other order could give 2^24 + 2
    partials = torch.tensor([[[2.0**24], [1.0], [1.0]], [[1.0], [1.0], [2.0**24]]]).to(torch.bfloat16)
    valid = torch.ones(2, 3, dtype=torch.bool)
    assert ref._combine(partials, valid).flatten().tolist() == [2.0**24, 2.0**24 + 2]
    valid[1, 0] = False
    assert ref._combine(partials, valid).flatten().tolist() == [2.0**24, 2.0**24]  # 0 + 1 + 2^24 rounds to even


def test_layer_y_is_bf16_of_slot_order_sum() -> None:
    e, h, i, t, k = 4, 64, 32, 6, 3
    w1, w2 = _random_layer(e, h, i)
    idx, tw = _random_routing(t, e, k, seed=5)
    out = ref.model_reference(torch.randn(t, h), idx, tw, w1, w2, activation_clamp=10.0)
    acc = torch.zeros(t, h)
    for s in range(k):
        acc = acc + out.partials[:, s].float()
    assert torch.equal(out.y_fp32, acc) and torch.equal(out.y, acc.to(torch.bfloat16))


def test_dispatch_plan_hand_example() -> None:
    # P = 2, E = 4: rank 0 owns global 0, 1; rank 1 owns global 2, 3 (local 0, 1).
    idx0 = torch.tensor([[3, 0], [1, -1]])
    idx1 = torch.tensor([[0, 2], [-1, -1], [3, 1]])
    plan = ref.dispatch_plan([idx0, idx1], 4)
    as_lists = [[t.tolist() for t in rank] for rank in plan]
    assert as_lists == [
        [[[0, 0, 1], [1, 0, 0]], [[0, 1, 0], [1, 2, 1]]],
        [[[1, 0, 1]], [[0, 0, 0], [1, 2, 0]]],
    ]
    assert all(t.dtype == torch.int64 and t.shape[1] == 3 for rank in plan for t in rank)
    assert [c.tolist() for c in ref.recv_counts(plan)] == [[2, 2], [1, 2]]
    assert ref.recv_counts(plan)[0].dtype == torch.int32


def test_dispatch_plan_boundaries() -> None:
    empty = torch.zeros(0, 2, dtype=torch.long)
    everyone_to_3 = torch.full((5, 2), -1).index_fill_(1, torch.tensor([1]), 3)
    plan = ref.dispatch_plan([empty, everyone_to_3, empty, torch.full((2, 2), -1)], 8)
    counts = [c.tolist() for c in ref.recv_counts(plan)]
    assert counts == [[0, 0], [0, 5], [0, 0], [0, 0]]
    assert plan[1][1].tolist() == [[1, t, 1] for t in range(5)]
    assert ref.dispatch_plan([empty], 4)[0][3].shape == (0, 3)
    # duplicate expert in one token: two rows, counted twice
    assert ref.dispatch_plan([torch.tensor([[1, 1]])], 2)[0][1].tolist() == [[0, 0, 0], [0, 0, 1]]


def test_dispatch_plan_validation() -> None:
    idx = torch.tensor([[0, 1]])
    with pytest.raises(ValueError, match="at least one rank"):
        ref.dispatch_plan([], 4)
    with pytest.raises(ValueError, match="num_experts"):
        ref.dispatch_plan([idx, idx, idx], 4)
    with pytest.raises(ValueError, match=r"\[-1, 4\)"):
        ref.dispatch_plan([torch.tensor([[4, 0]])], 4)
    with pytest.raises(ValueError, match=r"\[-1, 4\)"):
        ref.dispatch_plan([torch.tensor([[-2, 0]])], 4)
    with pytest.raises(ValueError, match="integer"):
        ref.dispatch_plan([idx.float()], 4)
    with pytest.raises(ValueError, match="topk_idx\\[1\\]"):
        ref.dispatch_plan([idx, torch.tensor([[0, 1, 2]])], 4)


def test_expert_parallel_validation() -> None:
    w1, w2 = _random_layer(2, 64, 32)
    x, idx, tw = torch.randn(2, 64), torch.tensor([[0], [1]]), torch.ones(2, 1)
    with pytest.raises(ValueError, match="same non-zero number"):
        ref.expert_parallel_reference([x], [idx, idx], [tw], [w1], [w2])
    with pytest.raises(ValueError, match="l1_per_rank\\[1\\]"):
        ref.expert_parallel_reference([x, x], [idx, idx], [tw, tw], [w1[:1], w1[:1, :32]], [w2[:1], w2[:1]])
    with pytest.raises(ValueError, match="l2_per_rank\\[0\\]"):
        ref.expert_parallel_reference([x], [idx], [tw], [w1], [w2[:, :, :16]])
    with pytest.raises(ValueError, match="x/topk_weights\\[0\\]"):
        ref.moe_reference(x[:1], idx, tw, w1, w2)
    with pytest.raises(ValueError, match="x/topk_weights\\[0\\]"):
        ref.moe_reference(x, idx, tw[:, :0], w1, w2)


# --------------------------------------------------------------------------------------- P-rank simulation vs 1 rank
H, INTER, E_LOCAL = 64, 32, 2
_W1, _W2 = _random_layer(4 * E_LOCAL, H, INTER, seed=11)
_L1, _L2 = ExpertWeights.quantize(_W1, "mxfp4"), ExpertWeights.quantize(_W2, "mxfp4")
_SHARED = (ExpertWeights.quantize(_W1[0], "fp8_k32"), ExpertWeights.quantize(_W2[0], "fp8_k32"))


@st.composite
def _ep_case(draw: st.DrawFn) -> tuple[int, int, list[torch.Tensor], list[torch.Tensor]]:
    p = draw(st.sampled_from([1, 2, 4]))
    k = draw(st.integers(1, 3))
    e = p * E_LOCAL
    idx = []
    for _ in range(p):
        t = draw(st.integers(0, 4))
        ids = draw(st.lists(st.integers(-1, e - 1), min_size=t * k, max_size=t * k))
        idx.append(torch.tensor(ids, dtype=torch.long).reshape(t, k))
    seed = draw(st.integers(0, 2**16))
    return (
        p,
        seed,
        idx,
        [torch.rand(i.shape, generator=torch.Generator().manual_seed(seed + r)) for r, i in enumerate(idx)],
    )


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_ep_case(), with_shared=st.booleans())
def test_expert_parallel_equals_single_rank(case: tuple, with_shared: bool) -> None:
    p, seed, idx, tw = case
    e = p * E_LOCAL
    g = torch.Generator().manual_seed(seed)
    xs = [ref.quantize_activations(torch.randn(i.shape[0], H, generator=g), "ue8m0_32") for i in idx]
    l1, l2 = _L1.experts(0, e), _L2.experts(0, e)
    shared = _SHARED if with_shared else None
    kw = dict(shared=shared, activation_clamp=10.0, intermediate_quant="ue8m0_32")
    per_rank = ref.expert_parallel_reference(xs, idx, tw, l1.shard(p), l2.shard(p), **kw)
    cat_x = (torch.cat([x[0] for x in xs]), torch.cat([x[1] for x in xs]))
    single = ref.moe_reference(cat_x, torch.cat(idx), torch.cat(tw), l1, l2, **kw)
    assert len(per_rank) == p
    assert torch.equal(torch.cat([o.y for o in per_rank]), single.y)
    assert torch.equal(torch.cat([o.y_fp32 for o in per_rank]), single.y_fp32)
    assert torch.equal(torch.cat([o.partials for o in per_rank]), single.partials)
    assert torch.equal(torch.cat([o.valid for o in per_rank]), single.valid)
    for r, o in enumerate(per_rank):
        assert o.y.shape == (idx[r].shape[0], H)
    counts = torch.cat(ref.recv_counts(ref.dispatch_plan(idx, e)))
    assert counts.tolist() == [int((torch.cat(idx) == ex).sum()) for ex in range(e)]


def test_expert_parallel_boundaries() -> None:
    # T = 0 on two ranks, every token to one expert on the last rank, an expert with no tokens
    p, e = 4, 4 * E_LOCAL
    t = [0, 3, 0, 5]
    idx = [torch.full((n, 2), e - 1) for n in t]
    idx[1][:, 1] = -1
    xs = [torch.randn(n, H) for n in t]
    tw = [torch.ones(n, 2) for n in t]
    out = ref.expert_parallel_reference(xs, idx, tw, _L1.shard(p), _L2.shard(p), activation_clamp=10.0)
    assert [o.y.shape[0] for o in out] == t
    assert ref.recv_counts(ref.dispatch_plan(idx, e))[3].tolist() == [0, 13]
    single = ref.moe_reference(torch.cat(xs), torch.cat(idx), torch.cat(tw), _L1, _L2, activation_clamp=10.0)
    assert torch.equal(torch.cat([o.y for o in out]), single.y)
    # every rank empty
    empty = ref.expert_parallel_reference(
        [torch.zeros(0, H)] * 2,
        [torch.zeros(0, 1, dtype=torch.long)] * 2,
        [torch.zeros(0, 1)] * 2,
        _L1.experts(0, 4).shard(2),
        _L2.experts(0, 4).shard(2),
        shared=_SHARED,
    )
    assert [o.y.shape for o in empty] == [(0, H), (0, H)]


# ------------------------------------------------------------------------------------ model vs quantization-faithful
def _independent_faithful(x, idx, tw, l1: ExpertWeights, l2: ExpertWeights, mode: str, clamp: float) -> torch.Tensor:
    """A naive per-token, per-slot FP32 re-derivation straight from quant.py (no reference code)."""
    group, fmt = (32, "ue8m0") if mode == "ue8m0_32" else (128, "fp32")
    xf = quant.dequantize_fp8_groups(*x)
    w1, w2 = l1.dequantize(), l2.dequantize()
    i = w2.shape[-1]
    y = torch.zeros(xf.shape)
    for t in range(xf.shape[0]):
        for s in range(idx.shape[1]):
            e = int(idx[t, s])
            acc = (xf[t] @ w1[e].T).to(torch.bfloat16).float()
            gate, up = acc[:i].clamp(max=clamp), acc[i:].clamp(-clamp, clamp)
            act = gate * torch.sigmoid(gate) * up * tw[t, s]
            act = quant.dequantize_fp8_groups(*quant.quantize_fp8_groups(act[None], group, fmt))[0]
            y[t] += (act @ w2[e].T).to(torch.bfloat16).float()
    return y.to(torch.bfloat16)


@pytest.mark.parametrize(
    ("fmt", "mode", "threshold"),
    [("mxfp4", "ue8m0_32", 0.97), ("fp8_block128", "fp32_128", 0.99), ("fp8_k32", "ue8m0_32", 0.99)],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_model_vs_faithful(fmt: str, mode: str, threshold: float, seed: int) -> None:
    e, h, i, t, k = 8, 256, 128, 32, 4
    w1, w2 = _random_layer(e, h, i, seed=seed)
    idx, tw = _random_routing(t, e, k, seed=seed)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(seed + 100)).bfloat16()
    l1, l2 = ExpertWeights.quantize(w1, fmt), ExpertWeights.quantize(w2, fmt)
    xq = ref.quantize_activations(x, mode)
    faithful = ref.quantization_faithful_reference(xq, idx, tw, l1, l2, activation_clamp=10.0, intermediate_quant=mode)
    model = ref.model_reference(x, idx, tw, w1.bfloat16(), w2.bfloat16(), activation_clamp=10.0)
    m = ref.accuracy_metrics(faithful.y, model.y)
    assert m["cosine"] >= threshold, m
    assert m["nonfinite"] == 0 and m["nonfinite_ref"] == 0
    # an independent naive derivation agrees with the faithful reference to kernel-grade accuracy
    naive = _independent_faithful(xq, idx, tw, l1, l2, mode, 10.0)
    mk = ref.accuracy_metrics(naive, faithful.y)
    assert mk["cosine"] >= 0.9999 and mk["processed_diff"] <= 1e-4, mk


# ---------------------------------------------------------------------------------------------------------- metrics
def test_metrics_known_values() -> None:
    r = torch.tensor([3.0, -4.0])
    m = ref.accuracy_metrics(r.clone(), r)
    assert m == {
        "cosine": 1.0,
        "processed_diff": 0.0,
        "max_abs_err": 0.0,
        "rel_l2": 0.0,
        "nonfinite": 0,
        "nonfinite_ref": 0,
    }
    m = ref.accuracy_metrics(2 * r, r)
    assert m["cosine"] == pytest.approx(1.0) and m["processed_diff"] == pytest.approx(1 - 2 * 50 / 125)
    assert m["max_abs_err"] == 4.0 and m["rel_l2"] == pytest.approx(1.0)
    m = ref.accuracy_metrics(torch.tensor([4.0, 3.0]), r)
    assert m["cosine"] == pytest.approx(0.0) and m["processed_diff"] == pytest.approx(1.0)
    m = ref.accuracy_metrics(-r, r)
    assert m["cosine"] == pytest.approx(-1.0) and m["processed_diff"] == pytest.approx(2.0)
    m = ref.accuracy_metrics(r.bfloat16(), r.double())  # mixed dtypes are fine
    assert m["cosine"] == 1.0


def test_metrics_zero_empty_nonfinite() -> None:
    z = torch.zeros(3, 4)
    assert ref.accuracy_metrics(z, z.clone()) == {
        "cosine": 1.0,
        "processed_diff": 0.0,
        "max_abs_err": 0.0,
        "rel_l2": 0.0,
        "nonfinite": 0,
        "nonfinite_ref": 0,
    }
    e = torch.zeros(0, 8, dtype=torch.bfloat16)
    assert ref.accuracy_metrics(e, e)["cosine"] == 1.0 and ref.accuracy_metrics(e, e)["max_abs_err"] == 0.0
    one = torch.ones(3, 4)
    m = ref.accuracy_metrics(z, one)
    assert (m["cosine"], m["processed_diff"], m["rel_l2"]) == (0.0, 1.0, 1.0)
    m = ref.accuracy_metrics(one, z)
    assert (m["cosine"], m["processed_diff"], m["rel_l2"]) == (0.0, 1.0, math.inf)
    bad = one.clone()
    bad[0, 0], bad[1, 1] = float("nan"), float("inf")
    m = ref.accuracy_metrics(bad, one)
    assert m["nonfinite"] == 2 and m["nonfinite_ref"] == 0 and math.isnan(m["cosine"])
    assert ref.accuracy_metrics(one, bad)["nonfinite_ref"] == 2
    with pytest.raises(ValueError, match="shape"):
        ref.accuracy_metrics(one, one[:2])
