"""Seeded workloads for the SM90 GEMM tests and benchmark (docs/bench_protocol.md presets, rank-0 share of EP8).

A preset's per-rank load: ``e`` local experts; ``T`` tokens per rank on each of ``P = 8`` ranks are routed top-k
uniformly without repetition over ``8e`` experts (seeded), routing weights a softmax of random logits; this rank
(rank 0) receives the rows routed to experts ``[0, e)``, so the GEMMs see ``T * 8`` candidate tokens with non-local
slots marked ``-1`` (DeepGEMM's ``masked_m`` view of the same load). Weights are random (``randn / sqrt(K)``),
stored in BF16 (the model reference), ``fp8_block128`` (what the FP8xFP8 kernels read) and, through
:func:`make_fp4_layer`, ``mxfp4`` (what the FP8xFP4 kernels read after the window repack).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from _standalone_gemm import Fp4Weights, Fp8Weights, prepare_fp4_weights, prepare_fp8_weights

from gc_moe_compat.config import PRESETS
from gc_moe_compat.layouts import window_repack_mxfp4, window_unrepack_mxfp4
from gc_moe_compat.testing.operator_workload import CLAMP
from gc_moe_compat.testing.reference import ExpertWeights, moe_reference, quantize_activations

WORLD = 8


@dataclass(frozen=True)
class Layer:
    """One rank's routed experts: BF16 and FP8 canonical weights and the kernels' prepared form."""

    name: str
    l1_bf16: torch.Tensor
    l2_bf16: torch.Tensor
    l1: ExpertWeights
    l2: ExpertWeights
    prepared: Fp8Weights
    topk: int


@dataclass(frozen=True)
class Tokens:
    """Candidate tokens of one point: float and FP8 (1x128 FP32 scales) activations, local routing."""

    x: torch.Tensor
    x_fp8: torch.Tensor
    x_sf: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor


def make_layer(
    name: str, device: torch.device, seed: int = 0, experts: int | None = None, shape: tuple[int, int] | None = None
) -> Layer:
    """Random weights of preset ``name`` (or ``shape = (H, I)`` / ``experts`` overrides) on ``device``."""
    p = PRESETS[name]
    h, inter = shape or (p.hidden, p.intermediate)
    e = experts or p.local_experts
    gen = torch.Generator(device=device).manual_seed(seed)
    l1_bf16 = torch.empty(e, 2 * inter, h, dtype=torch.bfloat16, device=device)
    l2_bf16 = torch.empty(e, h, inter, dtype=torch.bfloat16, device=device)
    for i in range(e):  # one expert at a time keeps the FP32 temporaries small
        l1_bf16[i] = torch.randn(2 * inter, h, generator=gen, device=device) / h**0.5
        l2_bf16[i] = torch.randn(h, inter, generator=gen, device=device) / inter**0.5
    l1 = ExpertWeights.quantize(l1_bf16, "fp8_block128")
    l2 = ExpertWeights.quantize(l2_bf16, "fp8_block128")
    return Layer(name, l1_bf16, l2_bf16, l1, l2, prepare_fp8_weights(l1, l2), p.topk)


def make_tokens(layer: Layer, tokens_per_rank: int, seed: int = 0, world: int = WORLD) -> Tokens:
    """The rank-0 share of ``tokens_per_rank * world`` tokens routed uniformly over ``world * e`` experts."""
    device = layer.l1_bf16.device
    e, h = layer.l1.num_experts, layer.l1.in_features
    n = tokens_per_rank * world
    gen = torch.Generator(device=device).manual_seed(1000 + seed)
    x = torch.randn(n, h, generator=gen, device=device)
    scores = torch.rand(n, e * world, generator=gen, device=device)
    topk_idx = scores.topk(layer.topk, dim=1).indices
    topk_weights = torch.softmax(torch.randn(n, layer.topk, generator=gen, device=device), dim=1)
    topk_idx = torch.where(topk_idx < e, topk_idx, torch.full_like(topk_idx, -1))
    x_fp8, x_sf = quantize_activations(x, "fp32_128")
    return Tokens(x, x_fp8, x_sf, topk_idx, topk_weights)


def reference_partials(layer: Layer, tok: Tokens, faithful: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partials [N, k, H] BF16, valid [N, k])`` of the quantization-faithful (FP8 weights and activations, FP32
    1x128 intermediate requant) or the BF16 model reference."""
    if faithful:
        res = moe_reference(
            (tok.x_fp8, tok.x_sf), tok.topk_idx, tok.topk_weights, layer.l1, layer.l2,
            activation_clamp=CLAMP, intermediate_quant="fp32_128",
        )  # fmt: skip
    else:
        res = moe_reference(tok.x, tok.topk_idx, tok.topk_weights, layer.l1_bf16, layer.l2_bf16, activation_clamp=CLAMP)
    return res.partials, res.valid


@dataclass(frozen=True)
class Fp4Layer:
    """One rank's routed experts in MXFP4: ``l1`` / ``l2`` as quantized (canonical ``mxfp4``), ``l1_window`` /
    ``l2_window`` the same after the window repack expressed as plain ``mxfp4`` (what the kernels compute with:
    equal to ``l1`` / ``l2`` wherever a K32 group lies inside its expert's 11-step window), ``prepared`` the
    kernels' form."""

    l1: ExpertWeights
    l2: ExpertWeights
    l1_window: ExpertWeights
    l2_window: ExpertWeights
    prepared: Fp4Weights


def _window_equivalent(w: ExpertWeights) -> ExpertWeights:
    """``w`` (mxfp4) after the window repack, as plain mxfp4 (UE8M0 codes ``d + base + 127``), expert by expert."""
    packed, codes = [], []
    for i in range(w.num_experts):
        p, c = window_unrepack_mxfp4(window_repack_mxfp4(w.payload[i : i + 1], w.scales[i : i + 1]))
        packed.append(p)
        codes.append(c)
    return ExpertWeights("mxfp4", torch.cat(packed), torch.cat(codes))


def make_fp4_layer(l1_bf16: torch.Tensor, l2_bf16: torch.Tensor) -> Fp4Layer:
    """MXFP4 weights (UE8M0 K32 scales, quant.quantize_mxfp4) of BF16 ``l1 [E, 2I, H]`` / ``l2 [E, H, I]``."""
    quantized = []
    for w in (l1_bf16, l2_bf16):
        parts = [ExpertWeights.quantize(w[i : i + 1], "mxfp4") for i in range(w.shape[0])]  # bounded temporaries
        quantized.append(
            ExpertWeights("mxfp4", torch.cat([q.payload for q in parts]), torch.cat([q.scales for q in parts]))
        )
    l1, l2 = quantized
    return Fp4Layer(l1, l2, _window_equivalent(l1), _window_equivalent(l2), prepare_fp4_weights(l1, l2))


def reference_partials_fp4(
    layer: Layer, fp4: Fp4Layer, tok: Tokens, faithful: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partials [N, k, H] BF16, valid [N, k])`` of the FP8xFP4 quantization-faithful reference (window-repacked
    MXFP4 weights, E4M3 activations with FP32 1x128 scales, UE8M0 1x128 intermediate requant) or the BF16 model
    reference."""
    if not faithful:
        return reference_partials(layer, tok, faithful=False)
    res = moe_reference(
        (tok.x_fp8, tok.x_sf), tok.topk_idx, tok.topk_weights, fp4.l1_window, fp4.l2_window,
        activation_clamp=CLAMP, intermediate_quant="ue8m0_128",
    )  # fmt: skip
    return res.partials, res.valid
