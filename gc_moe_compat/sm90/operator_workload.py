"""Seeded operator workloads shared by the operator's GPU tests and its benchmark (bench/operator_sm90.py).

One rank's routed experts of a BENCH_PROTOCOL.md preset (random ``randn / sqrt(K)`` weights, seeded by rank,
quantized to ``fp8_block128`` expert by expert and transformed for the operator), seeded per-rank inputs (E4M3 tokens
with FP32 1x128 scales, global top-k ids, softmax routing weights), staging into a :class:`~gc_moe_compat.native.
GcMoeBuffer`, and every rank's ``y`` from the P-rank quantization-faithful reference
(:func:`gc_moe_compat.reference.expert_parallel_reference` with the intermediate requantized as the SM90 FP8xFP8
path does, ``"fp32_128"``). Every rank rebuilds every other rank's weights and inputs from the same seeds, so the
reference needs no communication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gc_moe_compat import native
from gc_moe_compat.config import PRESETS
from gc_moe_compat.native_weights import GcMoeWeights
from gc_moe_compat.reference import ExpertWeights, expert_parallel_reference, quantize_activations

from .workload import CLAMP

__all__ = [
    "CAPACITY",
    "CLAMP",
    "ROUTINGS",
    "RankInputs",
    "RankWeights",
    "make_expert_weights",
    "make_inputs",
    "make_weights",
    "preset_dims",
    "reference_ys",
    "stage",
]

CAPACITY = 256  # BENCH_PROTOCOL.md: per-rank capacity
ROUTINGS = ("uniform", "zipf", "one_expert", "holes")


@dataclass(frozen=True)
class RankWeights:
    """One rank's routed experts: the canonical FP8 weights (the reference's) and the operator's transformed pair."""

    l1: ExpertWeights
    l2: ExpertWeights
    w1: GcMoeWeights
    w2: GcMoeWeights


def preset_dims(preset: str) -> tuple[int, int, int, int]:
    """``(e, k, H, I)`` of a BENCH_PROTOCOL.md preset (routed experts only; the shared expert needs role4)."""
    p = PRESETS[preset]
    return p.local_experts, p.topk, p.hidden, p.intermediate


def make_expert_weights(preset: str, rank: int, device: torch.device | str = "cuda") -> tuple[ExpertWeights,
                                                                                               ExpertWeights]:
    """Rank ``rank``'s canonical ``fp8_block128`` weights ``(l1 [e, 2I, H], l2 [e, H, I])``: ``randn / sqrt(K)``
    from a generator seeded ``100 + rank`` on ``device``, quantized expert by expert (bounded temporaries)."""
    e, _, h, inter = preset_dims(preset)
    gen = torch.Generator(device=device).manual_seed(100 + rank)
    parts1, parts2 = [], []
    for _ in range(e):
        w1 = (torch.randn(1, 2 * inter, h, generator=gen, device=device) / h**0.5).to(torch.bfloat16)
        w2 = (torch.randn(1, h, inter, generator=gen, device=device) / inter**0.5).to(torch.bfloat16)
        parts1.append(ExpertWeights.quantize(w1, "fp8_block128"))
        parts2.append(ExpertWeights.quantize(w2, "fp8_block128"))
    l1 = ExpertWeights("fp8_block128", torch.cat([p.payload for p in parts1]), torch.cat([p.scales for p in parts1]))
    l2 = ExpertWeights("fp8_block128", torch.cat([p.payload for p in parts2]), torch.cat([p.scales for p in parts2]))
    return l1, l2


def make_weights(preset: str, rank: int, device: torch.device | str = "cuda") -> RankWeights:
    """:func:`make_expert_weights` plus the operator's transformed pair (``transform_weights_for_gc_moe``)."""
    l1, l2 = make_expert_weights(preset, rank, device)
    w1, w2 = native.transform_weights_for_gc_moe((l1.payload, l1.scales), (l2.payload, l2.scales), "fp8xfp8")
    return RankWeights(l1, l2, w1, w2)


@dataclass(frozen=True)
class RankInputs:
    """One rank's staged inputs: E4M3 tokens with FP32 1x128 scales, global expert ids (-1 unused), weights."""

    x: torch.Tensor
    x_sf: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor

    @property
    def tokens(self) -> int:
        return self.topk_idx.shape[0]


def make_inputs(kind: str, tokens: int, num_experts: int, topk: int, hidden: int, seed: int,
                device: torch.device | str = "cuda") -> RankInputs:
    """Seeded inputs (identical on every rank that asks for the same seed): ``uniform`` top-k without repetition,
    ``zipf`` (expert popularity ~ 1/(i+1)^1.2, without repetition), ``one_expert`` (slot 0 of every token is expert
    0), ``holes`` (uniform with ~30% of the slots -1 and token 1 with none); routing weights a softmax."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "zipf":
        probs = 1.0 / (torch.arange(num_experts, dtype=torch.float64) + 1) ** 1.2
        idx = torch.multinomial(probs.expand(max(tokens, 1), -1), topk, replacement=False, generator=gen)[:tokens]
    else:
        idx = torch.rand(tokens, num_experts, generator=gen).argsort(dim=1)[:, :topk]
    if kind == "one_expert":
        idx[:, 1:] = torch.rand(tokens, num_experts - 1, generator=gen).argsort(dim=1)[:, : topk - 1] + 1
        idx[:, 0] = 0
    elif kind == "holes":
        idx[torch.rand(tokens, topk, generator=gen) < 0.3] = -1
        if tokens > 1:
            idx[1] = -1
    elif kind not in ("uniform", "zipf"):
        raise ValueError(f"kind: one of {ROUTINGS}, got {kind!r}")
    weights = torch.softmax(torch.randn(tokens, topk, generator=gen), dim=1)
    x = torch.randn(tokens, hidden, generator=gen).to(device)
    x_fp8, x_sf = quantize_activations(x, "fp32_128")
    return RankInputs(x_fp8, x_sf.float(), idx.to(device), weights.to(device))


def stage(buffer: native.GcMoeBuffer, inputs: RankInputs) -> None:
    """Caller staging into the buffer's views; the rest of ``topk_idx`` is -1."""
    t = inputs.tokens
    buffer.x[:t] = inputs.x
    buffer.x_sf[:t] = inputs.x_sf
    buffer.topk_idx.fill_(-1)
    buffer.topk_idx[:t] = inputs.topk_idx.to(buffer.topk_idx.dtype)
    buffer.topk_weights[:t] = inputs.topk_weights


def reference_ys(inputs: list[RankInputs], weights: list[RankWeights] | list[tuple[ExpertWeights, ExpertWeights]]
                 ) -> list[torch.Tensor]:
    """Every rank's ``y`` from the P-rank quantization-faithful reference (slot-order FP32 combine, BF16).

    ``weights[r]`` is rank r's :class:`RankWeights` or its canonical ``(l1, l2)`` pair (:func:`make_expert_weights`).
    """
    pairs = [(w.l1, w.l2) if isinstance(w, RankWeights) else w for w in weights]
    results = expert_parallel_reference(
        [(i.x, i.x_sf) for i in inputs], [i.topk_idx for i in inputs], [i.topk_weights for i in inputs],
        [p[0] for p in pairs], [p[1] for p in pairs], activation_clamp=CLAMP, intermediate_quant="fp32_128")
    return [r.y for r in results]
