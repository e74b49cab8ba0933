"""Tokens grouped per local expert into ring blocks of BM rows (the SM90 GEMMs' input layout), and back.

Row order: experts in order; inside an expert its (token, slot) rows sorted by token, then slot (the order of
``reference.dispatch_plan``); each expert's rows start a fresh block, so block ``b`` holds rows
``[b*BM, b*BM + valid_b)`` of one expert and the rest of its BM rows are padding (zero payload, unit scale, zero
routing weight; the kernels compute those columns and never store them). An expert with no rows has no block.
The block table row ``(expert, valid, first_row)`` is what the kernels read; ``num_blocks`` lives on the device so
that a captured graph can replay with another routing of the same capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_GROUP = 128  # FP32 1x128 activation scales of the SM90 recipe


@dataclass(frozen=True)
class GroupedTokens:
    """Grouped rows: ``x`` FP8 ``[R, H]``, ``x_sf_t`` FP32 ``[H/128, R]`` (transposed), ``routing_w`` FP32 ``[R]``,
    ``blocks`` int32 ``[B, 3]``, ``num_blocks`` int32 ``[1]``, ``row_token``/``row_slot`` int64 ``[R]`` (-1: padding),
    ``counts`` int64 ``[E]`` rows per expert; ``R = B * bm``. ``pair_blocks``: the same table rows, each expert's
    blocks in pairs first (an odd one left for the rest, which follow), so that table rows ``2p`` and ``2p + 1`` of
    an expert with several blocks share its weights: the order the cluster-pair GEMM variants read."""

    x: torch.Tensor
    x_sf_t: torch.Tensor
    routing_w: torch.Tensor
    blocks: torch.Tensor
    pair_blocks: torch.Tensor
    num_blocks: torch.Tensor
    row_token: torch.Tensor
    row_slot: torch.Tensor
    counts: torch.Tensor
    bm: int

    @property
    def rows(self) -> int:
        """Rows of every row-indexed array (``num_blocks * bm``)."""
        return self.x.shape[0]

    @property
    def active_experts(self) -> int:
        """Experts with at least one row."""
        return int((self.counts > 0).sum())


def group_tokens(
    x: torch.Tensor,
    x_sf: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    bm: int,
) -> GroupedTokens:
    """Groups FP8 tokens ``x [T, H]`` (FP32 scales ``x_sf [T, H/128]``) by expert (``topk_idx [T, k]``, -1 unused)."""
    t, h = x.shape
    if x.dtype != torch.float8_e4m3fn or x_sf.dtype != torch.float32 or tuple(x_sf.shape) != (t, h // SCALE_GROUP):
        raise ValueError(f"x/x_sf: need float8_e4m3fn [T, H] and float32 [T, H/128], got {x.dtype} {x_sf.dtype}")
    if topk_idx.shape != topk_weights.shape or topk_idx.shape[0] != t or bm % 8 or bm < 8:
        raise ValueError(f"topk_idx/topk_weights [T, k] with T={t}, bm a multiple of 8; got {tuple(topk_idx.shape)}")
    device = x.device
    flat = topk_idx.reshape(-1).to(torch.int64)
    if flat.numel() and (int(flat.min()) < -1 or int(flat.max()) >= num_experts):
        raise ValueError(f"topk_idx: expert ids must lie in [-1, {num_experts})")
    used = (flat >= 0).nonzero().squeeze(1)
    experts = flat[used]
    order = torch.sort(experts, stable=True).indices  # stable: (token, slot) order inside an expert
    used, experts = used[order], experts[order]
    counts = torch.bincount(experts, minlength=num_experts)
    counts_host = counts.tolist()
    table, first_block, paired, unpaired = [], [], [], []
    for e, n in enumerate(counts_host):
        first_block.append(len(table))
        own = [(e, min(bm, n - j * bm), (len(table) + j) * bm) for j in range((n + bm - 1) // bm)]
        table += own
        cut = len(own) - len(own) % 2
        paired += own[:cut]
        unpaired += own[cut:]
    num_blocks, rows = len(table), len(table) * bm
    expert_start = torch.tensor(first_block, dtype=torch.int64, device=device) * bm
    rank_in_expert = torch.arange(used.numel(), device=device) - (torch.cumsum(counts, 0) - counts)[experts]
    dest = expert_start[experts] + rank_in_expert
    row_token = torch.full((rows,), -1, dtype=torch.int64, device=device)
    row_slot = torch.full((rows,), -1, dtype=torch.int64, device=device)
    k = topk_idx.shape[1] if topk_idx.dim() == 2 else 1
    row_token[dest], row_slot[dest] = used // k, used % k
    gx = torch.zeros(rows, h, dtype=torch.uint8, device=device)
    gx[dest] = x.view(torch.uint8)[used // k]
    gsf = torch.ones(rows, h // SCALE_GROUP, dtype=torch.float32, device=device)
    gsf[dest] = x_sf[used // k]
    rw = torch.zeros(rows, dtype=torch.float32, device=device)
    rw[dest] = topk_weights.reshape(-1).float()[used]
    # With no rows the table keeps one placeholder row (never read: the kernels see num_blocks = 0).
    blocks = torch.tensor(table or [(0, 0, 0)], dtype=torch.int32, device=device)
    pair_blocks = torch.tensor(paired + unpaired or [(0, 0, 0)], dtype=torch.int32, device=device)
    return GroupedTokens(
        x=gx.view(torch.float8_e4m3fn),
        x_sf_t=gsf.t().contiguous(),
        routing_w=rw,
        blocks=blocks,
        pair_blocks=pair_blocks,
        num_blocks=torch.tensor([num_blocks], dtype=torch.int32, device=device),
        row_token=row_token,
        row_slot=row_slot,
        counts=counts,
        bm=bm,
    )


def scatter_partials(rows_out: torch.Tensor, grouped: GroupedTokens, num_tokens: int, topk: int) -> torch.Tensor:
    """BF16 partial rows ``[R, H]`` back to ``[T, k, H]`` per (token, slot); slots without a row are zero."""
    out = torch.zeros(num_tokens, topk, rows_out.shape[1], dtype=rows_out.dtype, device=rows_out.device)
    live = grouped.row_token >= 0
    out[grouped.row_token[live], grouped.row_slot[live]] = rows_out[live]
    return out
