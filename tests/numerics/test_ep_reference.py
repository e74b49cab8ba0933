"""The torch references of the deep_ep facade (gc_moe_compat.references.ep_reference) against independent float32
arithmetic."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gc_moe_compat.references.ep_reference import combine_reference, ll_quantize, receive_plan


def _numpy_rule(x: torch.Tensor, round_scale: bool) -> tuple[np.ndarray, np.ndarray]:
    """DeepEP's FP8 rule in numpy float32, one group at a time (payload as dequantization-ready float32)."""
    xf = x.float().numpy().reshape(x.shape[0], -1, 128)
    amax = np.maximum(np.abs(xf).max(axis=-1), np.float32(1e-4)).astype(np.float32)
    scale_inv = (amax * np.float32(1.0 / 448.0)).astype(np.float32)
    scale = (np.float32(448.0) / amax).astype(np.float32)
    if round_scale:
        exponent = np.ceil(np.log2(scale_inv.astype(np.float64)))
        scale_inv = np.exp2(exponent).astype(np.float32)
        scale = np.exp2(-exponent).astype(np.float32)
    scaled = np.clip((xf * scale[..., None]).astype(np.float32), -448, 448)
    return scaled, scale_inv


@pytest.mark.parametrize("round_scale", [False, True])
def test_ll_quantize_matches_float32_rule(round_scale: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(64, 512, generator=gen) * torch.logspace(-6, 3, 64).unsqueeze(1)).to(torch.bfloat16)
    x[0, :128] = 0  # an all-zero group: amax floors at 1e-4
    payload, scale_inv = ll_quantize(x, round_scale)
    scaled, want_inv = _numpy_rule(x, round_scale)
    assert torch.equal(scale_inv, torch.from_numpy(want_inv))
    want_payload = torch.from_numpy(scaled).view(64, 512).to(torch.float8_e4m3fn)
    assert torch.equal(payload.view(torch.uint8), want_payload.view(torch.uint8))
    if round_scale:
        mantissa = scale_inv.view(torch.int32) & 0x7FFFFF
        assert not mantissa.any(), "rounded scales must be powers of two"


def test_receive_plan_orders_by_source_token_slot_and_skips_holes() -> None:
    idx = [torch.tensor([[3, 0], [0, -1]]), torch.tensor([[0, 2]])]
    plan = receive_plan(idx, num_experts=4)
    assert plan.rows[0][0] == [(0, 0, 1), (0, 1, 0), (1, 0, 0)]
    assert plan.rows[1][1] == [(0, 0, 0)] and plan.rows[1][0] == [(1, 0, 1)]
    assert plan.position(0, 0, 1, 0, 0) == 2


def test_combine_reference_weights_valid_slots_in_order() -> None:
    idx = [torch.tensor([[1, -1, 0]])]
    plan = receive_plan(idx, num_experts=2)
    outs = [torch.tensor([[[1.0, 2.0]], [[4.0, 8.0]]], dtype=torch.bfloat16)]
    w = torch.tensor([[0.5, 100.0, 0.25]])
    got = combine_reference(0, idx[0], w, outs, plan)
    assert got.tolist() == [[0.5 * 4 + 0.25 * 1, 0.5 * 8 + 0.25 * 2]]
