"""The FP32 reference with a shared expert in DeepGEMM's shared recipe (``"fp8_k32"``: E4M3 with per-row UE8M0 K32
scales): each row's K32 group is dequantized with its own scale, and the shared partial (slot k) is the expert
computed from those values, checked against a model written out here (the product of FP64 dequantized values, the
BF16 rounding after W1, SwiGLU, the requant of the path, W2 rounded to BF16)."""

from __future__ import annotations

import torch

from gc_moe_compat import quant
from gc_moe_compat.references.reference import ExpertWeights, moe_reference, quantize_activations

H, N_I, E, K, T = 256, 128, 2, 1, 5


def _k32_weights(n: int, k: int, gen: torch.Generator) -> ExpertWeights:
    """Draws whose K32 groups and rows get scales 2^u, u in [-3, 3], so every group has its own UE8M0 code."""
    w = torch.randn(1, n, k, generator=gen) * torch.pow(2.0, torch.randint(-3, 4, (1, n, k // 32), generator=gen)
                                                        ).float().repeat_interleave(32, -1)
    return ExpertWeights.quantize(w, "fp8_k32")


def test_fp8_k32_dequantizes_each_row_group_with_its_scale() -> None:
    gen = torch.Generator().manual_seed(1)
    w = _k32_weights(64, 128, gen)
    assert len(torch.unique(w.scales)) > 4  # the groups do differ
    want = w.payload.float() * w.scales.repeat_interleave(32, -1)
    assert torch.equal(w.dequantize(), want)
    codes = quant.ue8m0_encode(w.scales)
    assert torch.equal(torch.pow(2.0, codes.float() - 127), w.scales)  # the scales are UE8M0 values


def test_shared_slot_is_the_k32_expert() -> None:
    gen = torch.Generator().manual_seed(2)
    s1, s2 = _k32_weights(2 * N_I, H, gen), _k32_weights(H, N_I, gen)
    l1 = ExpertWeights.quantize(torch.randn(E, 2 * N_I, H, generator=gen) / 16, "fp8_block128")
    l2 = ExpertWeights.quantize(torch.randn(E, H, N_I, generator=gen) / 16, "fp8_block128")
    x = quantize_activations(torch.randn(T, H, generator=gen), "fp32_128")
    idx = torch.zeros(T, K, dtype=torch.int64)
    res = moe_reference(x, idx, torch.ones(T, K), l1, l2, shared=(s1, s2), activation_clamp=10.0,
                        intermediate_quant="fp32_128")
    xs = quant.dequantize_fp8_groups(*x).double()
    w1 = (s1.payload.float() * s1.scales.repeat_interleave(32, -1))[0].double()
    w2 = (s2.payload.float() * s2.scales.repeat_interleave(32, -1))[0].double()
    acc = (xs @ w1.T).float().to(torch.bfloat16).float()
    gate, up = acc[:, :N_I].clamp(max=10.0), acc[:, N_I:].clamp(-10.0, 10.0)
    act = gate * torch.sigmoid(gate) * up
    act = quant.dequantize_fp8_groups(*quant.quantize_fp8_groups(act, 128, "fp32"))
    want = (act.double() @ w2.T).float().to(torch.bfloat16)
    assert torch.equal(res.partials[:, K], want)
    assert bool(res.valid[:, K].all())
