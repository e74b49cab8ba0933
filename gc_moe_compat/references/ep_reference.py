"""Torch references of DeepEP's low-latency dispatch and combine for a simulated group of ``P`` ranks (CPU or GPU).

These define what the ``deep_ep`` facade must return, bit for bit: DeepEP's FP8 rule (1x128 groups, amax floored at
1e-4, ``scale = 448 / amax``, stored inverse ``amax * (1/448)``, optionally both rounded to the power of two at or
above the inverse; E4M3 round-to-nearest with saturation), the packed receive order (per local expert: source rank,
then token, then slot), and the combine's FP32 sum over valid slots in slot order with separately rounded multiply
and add, rounded to BF16 once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["ReceivePlan", "combine_reference", "ll_quantize", "receive_plan"]

_E4M3_MAX = 448.0


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    return torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent.to(torch.int32))


def ll_quantize(x: torch.Tensor, round_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, H]`` BF16 -> (E4M3 ``[T, H]``, FP32 inverse scales ``[T, H/128]``) by DeepEP's low-latency rule."""
    if x.dim() != 2 or x.shape[1] % 128:
        raise ValueError(f"x: must be [T, H] with H a multiple of 128, got {tuple(x.shape)}")
    t, h = x.shape
    groups = x.float().view(t, h // 128, 128)
    amax = groups.abs().amax(dim=-1).clamp_min(1e-4)
    scale_inv = amax * (1.0 / _E4M3_MAX)
    # A true FP32 division (``scalar / tensor`` would be torch's reciprocal-then-multiply, rounded twice).
    scale = torch.full_like(amax, _E4M3_MAX) / amax
    if round_scale:
        bits = scale_inv.view(torch.int32)
        exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
        scale_inv, scale = _pow2(exponent), _pow2(-exponent)
    payload = (groups * scale.unsqueeze(-1)).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
    return payload.view(t, h), scale_inv


@dataclass(frozen=True)
class ReceivePlan:
    """Which rows each rank receives: ``rows[r][le]`` lists ``(source rank, token, slot)`` in DeepEP's packed order."""

    rows: list[list[list[tuple[int, int, int]]]]

    def position(self, rank: int, local_expert: int, source: int, token: int, slot: int) -> int:
        """Packed row of (source, token, slot) in ``rank``'s ``recv_x[local_expert]``."""
        return self.rows[rank][local_expert].index((source, token, slot))


def receive_plan(topk_idx: Sequence[torch.Tensor], num_experts: int) -> ReceivePlan:
    """The rows every rank receives for the ranks' routings ``topk_idx[r] [T_r, k]`` (``-1`` = unused slot)."""
    ranks = len(topk_idx)
    local = num_experts // ranks
    rows: list[list[list[tuple[int, int, int]]]] = [[[] for _ in range(local)] for _ in range(ranks)]
    for src, idx in enumerate(topk_idx):
        for token, experts in enumerate(idx.tolist()):
            for slot, expert in enumerate(experts):
                if expert >= 0:
                    rows[expert // local][expert % local].append((src, token, slot))
    return ReceivePlan(rows)


def combine_reference(rank: int, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                      expert_outputs: Sequence[torch.Tensor], plan: ReceivePlan) -> torch.Tensor:
    """``rank``'s combine output ``[T, H]`` BF16 from every rank's expert output ``[e, P*Tmax, H]`` BF16."""
    local = expert_outputs[0].shape[0]
    num_tokens, topk = topk_idx.shape
    out = torch.zeros((num_tokens, expert_outputs[0].shape[-1]), dtype=torch.float32)
    for token in range(num_tokens):
        for slot in range(topk):
            expert = int(topk_idx[token, slot])
            if expert < 0:
                continue
            owner, le = divmod(expert, local)
            row = expert_outputs[owner][le, plan.position(owner, le, rank, token, slot)].float().cpu()
            out[token] = out[token] + float(topk_weights[token, slot]) * row
    return out.to(torch.bfloat16)
