"""Seeded weights and tokens of an A/B run: every compared operator reads the same values.

* Weights: per rank, ``randn / sqrt(K)`` BF16 experts from a generator seeded by the rank, kept as BF16 (the model
  the quantized layers approximate) and quantized once per format the operators compute with: ``fp8_block128``
  (FP8 with FP32 128x128 block scales, SGLang's Hopper checkpoint format) and ``mxfp4`` (window-equivalent, as the
  SM90 FP8xFP4 kernel computes with it).
* Tokens: per rank and point, BF16 hidden states (what SGLang hands ``mega_moe_pre_dispatch_sm90``), int32 top-k
  ids (uniform top-k without repetition, :func:`gc_moe_compat.references.operator_workload.make_inputs`) and FP32
  softmax routing weights. :meth:`Tokens.staged` is what the pre-dispatch writes into the buffer, computed by its
  byte-exact torch model (:func:`gc_moe_compat.quant.quantize_fp8_pre_dispatch`), so operators staged by the caller
  (the native API) see the same bytes as operators that run the pre-dispatch themselves.

Every rank rebuilds every rank's weights and tokens from the seeds: the P-rank references need no communication.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from gc_moe_compat import layouts, quant
from gc_moe_compat.references.operator_workload import RankInputs, make_inputs
from gc_moe_compat.references.reference import ExpertWeights

__all__ = ["WEIGHT_FORMATS", "LayerWeights", "Tokens", "make_tokens", "make_weights", "token_seed"]

WEIGHT_FORMATS = ("fp8_block128", "mxfp4")
_SEED_WEIGHTS = 7_000
_SEED_TOKENS = 90_000


@dataclass(frozen=True)
class LayerWeights:
    """One rank's routed experts ``(l1 [e, 2I, H], l2 [e, H, I])`` per storage format (``"bf16"`` always)."""

    formats: dict[str, tuple[ExpertWeights, ExpertWeights]]

    def __getitem__(self, fmt: str) -> tuple[ExpertWeights, ExpertWeights]:
        if fmt not in self.formats:
            raise KeyError(f"weights: format {fmt!r} was not built (have {sorted(self.formats)})")
        return self.formats[fmt]


def _window_equivalent(w: ExpertWeights) -> ExpertWeights:
    """MXFP4 weights as the SM90 FP8xFP4 kernel computes with them (after its window repack)."""
    return ExpertWeights("mxfp4", *layouts.window_unrepack_mxfp4(layouts.window_repack_mxfp4(w.payload, w.scales)))


def make_weights(local_experts: int, hidden: int, intermediate: int, rank: int, formats: tuple[str, ...],
                 device: torch.device | str) -> LayerWeights:
    """Rank ``rank``'s experts in BF16 and in each of ``formats`` (:data:`WEIGHT_FORMATS`), built expert by expert
    on ``device`` (bounded temporaries)."""
    bad = [f for f in formats if f not in WEIGHT_FORMATS]
    if bad:
        raise ValueError(f"formats: must be drawn from {WEIGHT_FORMATS}, got {bad}")
    gen = torch.Generator(device=device).manual_seed(_SEED_WEIGHTS + rank)
    parts: dict[str, tuple[list[ExpertWeights], list[ExpertWeights]]] = {f: ([], []) for f in ("bf16", *formats)}
    for _ in range(local_experts):
        w1 = torch.randn(1, 2 * intermediate, hidden, generator=gen, dtype=torch.float32, device=device) / hidden**0.5
        w2 = torch.randn(1, hidden, intermediate, generator=gen, dtype=torch.float32, device=device) / intermediate**0.5
        for half, w in enumerate((w1.to(torch.bfloat16), w2.to(torch.bfloat16))):
            for fmt, lists in parts.items():
                q = ExpertWeights.quantize(w, fmt)
                lists[half].append(_window_equivalent(q) if fmt == "mxfp4" else q)

    def stacked(fmt: str, ws: list[ExpertWeights]) -> ExpertWeights:
        scales = None if fmt == "bf16" else torch.cat([w.scales for w in ws])
        return ExpertWeights(fmt, torch.cat([w.payload for w in ws]), scales)

    return LayerWeights({fmt: (stacked(fmt, l1s), stacked(fmt, l2s)) for fmt, (l1s, l2s) in parts.items()})


def token_seed(tokens: int, rank: int, world_size: int) -> int:
    """Seed of rank ``rank``'s tokens at ``tokens`` per rank (the same on every rank)."""
    return _SEED_TOKENS + tokens * world_size + rank


@dataclass(frozen=True)
class Tokens:
    """One rank's tokens of one point, as the model hands them to the MoE layer."""

    x: torch.Tensor  # bf16 [T, H]
    topk_idx: torch.Tensor  # int32 [T, k], global expert ids
    topk_weights: torch.Tensor  # float32 [T, k], the router's (before routed scaling)
    routed_scaling_factor: float

    @property
    def count(self) -> int:
        return self.x.shape[0]

    @cached_property
    def staged(self) -> RankInputs:
        """What ``mega_moe_pre_dispatch_sm90`` writes: E4M3 rows with FP32 1x128 scales, int64 ids, weights times
        the routed scaling factor (one FP32 multiply)."""
        x, x_sf = quant.quantize_fp8_pre_dispatch(self.x, "fp32x128")
        w = self.topk_weights * torch.full_like(self.topk_weights, self.routed_scaling_factor)
        return RankInputs(x, x_sf, self.topk_idx.to(torch.int64), w)


def make_tokens(tokens: int, num_experts: int, topk: int, hidden: int, rank: int, world_size: int,
                routed_scaling_factor: float, device: torch.device | str) -> Tokens:
    """Rank ``rank``'s seeded tokens at ``tokens`` per rank: uniform top-k routing without repetition, softmax
    weights, ``randn`` BF16 hidden states."""
    seed = token_seed(tokens, rank, world_size)
    routing = make_inputs("uniform", tokens, num_experts, topk, 128, seed=seed, device="cpu")
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, hidden, generator=gen, dtype=torch.float32, device="cpu").to(torch.bfloat16)
    return Tokens(x.to(device), routing.topk_idx.to(device=device, dtype=torch.int32),
                  routing.topk_weights.to(device=device, dtype=torch.float32), float(routed_scaling_factor))
