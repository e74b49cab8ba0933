"""Seeded operator workloads shared by the operator's GPU tests and its benchmark (bench/operator_sm90.py).

One rank's routed experts of a docs/bench_protocol.md preset (random ``randn / sqrt(K)`` weights, seeded by rank,
quantized expert by expert to ``fp8_block128`` for FP8xFP8 or ``mxfp4`` for FP8xFP4, and transformed for the
operator), seeded per-rank inputs (E4M3 tokens with FP32 1x128 scales, global top-k ids, softmax routing weights),
staging into a :class:`~gc_moe_compat.operator.api.GcMoeBuffer`, and every rank's ``y`` from the P-rank
quantization-faithful reference (:func:`gc_moe_compat.testing.reference.expert_parallel_reference` with the
intermediate requantized as the weights' SM90 path does: ``"fp32_128"`` for FP8xFP8, ``"ue8m0_128"`` for FP8xFP4).
Every rank rebuilds every other rank's weights and inputs from the same seeds, so the reference needs no communication.
A fused shared expert (role4): :func:`make_shared_weights` (one ``fp8_block128`` expert, the SM90 shared recipe on
both paths, replicated on every rank) and ``reference_ys(..., shared=)`` (slot ``k``, summed after the routed slots).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from gc_moe_compat.compute_paths import PATHS, compute_path
from gc_moe_compat.config import MAX_INTERMEDIATE, PRESETS, MoEPreset
from gc_moe_compat.layouts import window_repack_mxfp4, window_unrepack_mxfp4
from gc_moe_compat.operator import api
from gc_moe_compat.operator.weights import GcMoeWeights
from gc_moe_compat.testing.reference import (
    ExpertWeights,
    MoEResult,
    expert_parallel_reference,
    quantize_activations,
)

__all__ = [
    "CAPACITY",
    "CLAMP",
    "INTERMEDIATE_QUANT",
    "ROUTINGS",
    "SHARED_SEED",
    "WORKLOADS",
    "RankInputs",
    "RankWeights",
    "make_expert_weights",
    "make_inputs",
    "make_shared_weights",
    "make_weights",
    "preset_dims",
    "reference_results",
    "reference_ys",
    "stage",
]

CAPACITY = 256  # docs/bench_protocol.md: per-rank capacity
CLAMP = 10.0  # docs/bench_protocol.md: SwiGLU alpha 1.0, clamp 10.0 for both production presets
ROUTINGS = ("uniform", "zipf", "one_expert", "holes")
INTERMEDIATE_QUANT = {**{p.weight_format: p.intermediate_quant for p in PATHS.values()}, "bf16": None}
"""The W1 epilogue's requantization of each weight format's SM90 path (its compute path's ``intermediate_quant``,
reference.py semantics 5); none for the BF16 model (docs/bench_protocol.md reference 2)."""


@dataclass(frozen=True)
class RankWeights:
    """One rank's routed experts: the canonical weights (the reference's) and the operator's transformed pair."""

    l1: ExpertWeights
    l2: ExpertWeights
    w1: GcMoeWeights
    w2: GcMoeWeights


WORKLOADS: Mapping[str, MoEPreset] = MappingProxyType({
    **PRESETS,
    "tiny-max-i": dataclasses.replace(PRESETS["tiny"], name="tiny-max-i", intermediate=MAX_INTERMEDIATE),
})
"""The presets of :data:`config.PRESETS` plus the accuracy suite's "I at its maximum" boundary case (``tiny`` with
``I = config.MAX_INTERMEDIATE``)."""


def preset_dims(preset: str) -> tuple[int, int, int, int]:
    """``(e, k, H, I)`` of a :data:`WORKLOADS` entry (routed experts; :func:`make_shared_weights` for its shared
    expert)."""
    p = WORKLOADS[preset]
    return p.local_experts, p.topk, p.hidden, p.intermediate


def _window(w: ExpertWeights) -> ExpertWeights:
    """MXFP4 expert ``w`` as the SM90 FP8xFP4 kernel computes with it: after the window repack, as plain mxfp4
    (identical wherever a K32 group lies inside its expert's 11-exponent window)."""
    return ExpertWeights("mxfp4", *window_unrepack_mxfp4(window_repack_mxfp4(w.payload, w.scales)))


def make_expert_weights(preset: str, rank: int, device: torch.device | str = "cuda",
                        fmt: str = "fp8_block128") -> tuple[ExpertWeights, ExpertWeights]:
    """Rank ``rank``'s canonical weights ``(l1 [e, 2I, H], l2 [e, H, I])``: ``randn / sqrt(K)`` in BF16 from a
    generator seeded ``100 + rank`` on ``device``, stored expert by expert (bounded temporaries) in ``fmt``:
    ``"fp8_block128"``, ``"mxfp4"`` (window-repacked, :func:`_window`) or ``"bf16"`` (the draws themselves: the BF16
    model both quantized forms approximate)."""
    if fmt not in INTERMEDIATE_QUANT:
        raise ValueError(f"fmt: must be one of {tuple(INTERMEDIATE_QUANT)}, got {fmt!r}")
    e, _, h, inter = preset_dims(preset)
    gen = torch.Generator(device=device).manual_seed(100 + rank)
    parts1, parts2 = [], []
    for _ in range(e):
        w1 = (torch.randn(1, 2 * inter, h, generator=gen, device=device) / h**0.5).to(torch.bfloat16)
        w2 = (torch.randn(1, h, inter, generator=gen, device=device) / inter**0.5).to(torch.bfloat16)
        for parts, w in ((parts1, w1), (parts2, w2)):
            q = ExpertWeights.quantize(w, fmt)
            parts.append(_window(q) if fmt == "mxfp4" else q)

    def stacked(parts: list[ExpertWeights]) -> ExpertWeights:
        scales = None if fmt == "bf16" else torch.cat([p.scales for p in parts])
        return ExpertWeights(fmt, torch.cat([p.payload for p in parts]), scales)

    return stacked(parts1), stacked(parts2)


def make_weights(preset: str, rank: int, device: torch.device | str = "cuda", mma_type: str = "fp8xfp8"
                 ) -> RankWeights:
    """:func:`make_expert_weights` in ``mma_type``'s format plus the operator's transformed pair
    (``transform_weights_for_gc_moe``)."""
    l1, l2 = make_expert_weights(preset, rank, device, compute_path(mma_type).weight_format)
    w1, w2 = api.transform_weights_for_gc_moe((l1.payload, l1.scales), (l2.payload, l2.scales), mma_type)
    return RankWeights(l1, l2, w1, w2)


SHARED_SEED = 900
"""Seed of the shared expert's draws (the same on every rank: the shared expert is replicated)."""


def make_shared_weights(preset: str, device: torch.device | str = "cuda",
                        fmt: str = "fp8_block128") -> tuple[ExpertWeights, ExpertWeights]:
    """The preset's shared expert ``(l1 [1, 2I, H], l2 [1, H, I])`` in canonical layout (gate rows first):
    ``randn / sqrt(K)`` in BF16 from a generator seeded :data:`SHARED_SEED`, stored in ``fmt`` (``"fp8_block128"``,
    the SM90 shared recipe (1, 128, 128) of both paths, or ``"bf16"``: the draws). The native calls take
    ``(l1.payload, l1.scales)`` / ``(l2.payload, l2.scales)``."""
    if fmt not in ("fp8_block128", "bf16"):
        raise ValueError(f"fmt: must be 'fp8_block128' or 'bf16', got {fmt!r}")
    _, _, h, inter = preset_dims(preset)
    gen = torch.Generator(device=device).manual_seed(SHARED_SEED)
    w1 = (torch.randn(1, 2 * inter, h, generator=gen, device=device) / h**0.5).to(torch.bfloat16)
    w2 = (torch.randn(1, h, inter, generator=gen, device=device) / inter**0.5).to(torch.bfloat16)
    return ExpertWeights.quantize(w1, fmt), ExpertWeights.quantize(w2, fmt)


@dataclass(frozen=True)
class RankInputs:
    """One rank's staged inputs: E4M3 tokens (or their bytes) with FP32 1x128 scales, global expert ids (-1 unused),
    routing weights."""

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


def stage(buffer: api.GcMoeBuffer, inputs: RankInputs) -> None:
    """Caller staging into the buffer's views; the rest of ``topk_idx`` is -1."""
    t = inputs.tokens
    buffer.x[:t] = inputs.x
    buffer.x_sf[:t] = inputs.x_sf
    buffer.topk_idx.fill_(-1)
    buffer.topk_idx[:t] = inputs.topk_idx.to(buffer.topk_idx.dtype)
    buffer.topk_weights[:t] = inputs.topk_weights


def reference_results(inputs: list[RankInputs],
                      weights: list[RankWeights] | list[tuple[ExpertWeights, ExpertWeights]],
                      shared: tuple[ExpertWeights, ExpertWeights] | None = None) -> list[MoEResult]:
    """Every rank's :class:`~gc_moe_compat.testing.reference.MoEResult` (``y`` and the per-slot partials) from the
    P-rank quantization-faithful reference (slot-order FP32 combine, BF16), the intermediate requantized as the
    routed weights' path does (:data:`INTERMEDIATE_QUANT`, the shared expert's too: role4 runs that path's W1
    epilogue); with ``"bf16"`` pairs the BF16 model reference on the staged activations.

    ``weights[r]`` is rank r's :class:`RankWeights` or its canonical ``(l1, l2)`` pair (:func:`make_expert_weights`);
    ``shared``: the shared expert (:func:`make_shared_weights`), slot ``k``.
    """
    pairs = [(w.l1, w.l2) if isinstance(w, RankWeights) else w for w in weights]
    return expert_parallel_reference(
        [(i.x, i.x_sf) for i in inputs], [i.topk_idx for i in inputs], [i.topk_weights for i in inputs],
        [p[0] for p in pairs], [p[1] for p in pairs], shared=shared, activation_clamp=CLAMP,
        intermediate_quant=INTERMEDIATE_QUANT[pairs[0][0].fmt])


def reference_ys(inputs: list[RankInputs], weights: list[RankWeights] | list[tuple[ExpertWeights, ExpertWeights]],
                 shared: tuple[ExpertWeights, ExpertWeights] | None = None) -> list[torch.Tensor]:
    """Every rank's ``y`` of :func:`reference_results`."""
    return [r.y for r in reference_results(inputs, weights, shared)]
