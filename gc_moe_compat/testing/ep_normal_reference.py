"""Torch references of DeepEP's normal-mode (intranode) layout, dispatch and combine for a group of ``P`` ranks,
computed from every rank's inputs on the host, for the facade's bit-exact GPU tests.

DeepEP's rules reproduced: a token goes to each rank owning one of its experts; rank ``r`` receives the tokens of
rank 0, then rank 1, ... each in the source's token order; ``channel_prefix_matrix`` counts over ``C`` channels of
``ceil(T / C)`` contiguous tokens (inclusive prefix); ``send_head[t][r]`` is the token's index among its channel's
tokens to ``r`` (-1 when it does not go there), and a combine rewrites those -1 entries of the caller's handle in
place (:func:`combined_send_head`); received top-k ids are local (-1 for another rank's expert, weight 0); the
per-expert counts are aligned up to ``expert_alignment``; the combine sums, in FP32, ``bias_0 + bias_1`` then each
rank's row in rank order, rounded once to BF16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gc_moe_compat.config import integer

__all__ = ["NO_LATER_HEAD", "DispatchReference", "combine_reference", "combined_send_head", "dispatch_reference",
           "layout_reference"]

NO_LATER_HEAD = 1 << 25
"""The head DeepEP's combine encodes where no later token of the channel goes to the rank: such an entry becomes
``-NO_LATER_HEAD - 1`` (v1.2.1's "heuristic large number", above any channel's queue position)."""


def layout_reference(topk_idx: torch.Tensor, num_experts: int, num_ranks: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank)`` of one rank's ``topk_idx``."""
    idx = topk_idx.long().cpu()
    valid = (idx >= 0) & (idx < num_experts)
    per_expert = torch.zeros(num_experts, dtype=torch.int32, device="cpu")
    per_expert.index_add_(0, idx[valid], torch.ones(int(valid.sum()), dtype=torch.int32, device="cpu"))
    owner = torch.where(valid, idx // (num_experts // num_ranks), -1)
    in_rank = torch.stack([(owner == r).any(dim=1) for r in range(num_ranks)], dim=1) if idx.shape[0] else \
        torch.zeros((0, num_ranks), dtype=torch.bool, device="cpu")
    return in_rank.sum(dim=0).to(torch.int32), per_expert, in_rank


@dataclass
class DispatchReference:
    """One rank's expected dispatch outputs (host tensors)."""

    rank_prefix_matrix: torch.Tensor
    channel_prefix_matrix: torch.Tensor
    recv_channel_prefix_matrix: torch.Tensor
    send_head: torch.Tensor
    recv_src_idx: torch.Tensor
    recv_rows: list[tuple[int, int]]
    recv_topk_idx: torch.Tensor | None
    recv_topk_weights: torch.Tensor | None
    num_recv_tokens_per_expert: list[int]


def _channel_bounds(tokens: int, channels: int) -> list[tuple[int, int]]:
    per = -(-tokens // channels) if tokens else 0
    return [(min(per * c, tokens), min(per * c + per, tokens)) for c in range(channels)]


def combined_send_head(send_head: torch.Tensor, channels: int) -> torch.Tensor:
    """``send_head`` (int32 ``[T, P]``, a dispatch's handle[5]) as DeepEP v1.2.1's intranode combine leaves it
    (``cached_notify_combine`` in csrc/kernels/intranode.cu rewrites the caller's tensor in place before the combine
    kernel reads it); a new host tensor, ``send_head`` unchanged.

    Within each of the ``channels`` token ranges (``ceil(T / channels)`` contiguous tokens) and each rank column, an
    entry of a token that does not go to the rank (any negative value) becomes ``-h - 1``, ``h`` the head of the
    nearest later token of the same channel that does go there (its position in that rank's channel queue, which is
    the count of the channel's earlier tokens to the rank), or ``-NO_LATER_HEAD - 1`` where none does; heads (``>= 0``)
    stay. Why DeepEP does it: a combine receiver that meets such a token still learns how far that rank's queue has
    been consumed (``-entry - 1``) and releases the slots. The rewrite reads heads only, so it is idempotent: a
    second combine on the same handle (DeepEP allows reusing one) rewrites the same values again, and every reader
    that asks only whether an entry is negative (the combines, the facade's cached dispatch) reads it unchanged."""
    if not isinstance(send_head, torch.Tensor):
        raise TypeError(f"combined_send_head: send_head must be a torch.Tensor, got {type(send_head).__name__}")
    if send_head.dtype != torch.int32 or send_head.dim() != 2:
        raise ValueError(f"combined_send_head: send_head must be int32 [T, P], got {list(send_head.shape)} "
                         f"{send_head.dtype}")
    integer("combined_send_head", "channels", channels, 1)
    heads = send_head.cpu()
    out = heads.clone()
    none = torch.full((1, heads.shape[1]), NO_LATER_HEAD, dtype=torch.int32, device="cpu")
    for start, end in _channel_bounds(heads.shape[0], channels):
        block = heads[start:end]
        n = end - start
        pos = torch.arange(n, dtype=torch.int64, device="cpu").unsqueeze(1).expand_as(block)
        # the position of the nearest token at or after each one whose entry is a head (n: none is)
        nearest = torch.where(block >= 0, pos, n).flip(0).cummin(dim=0).values.flip(0)
        later = torch.cat([block, none]).gather(0, nearest)
        out[start:end] = torch.where(block >= 0, block, -later - 1)
    return out


def dispatch_reference(topk_idx: list[torch.Tensor], topk_weights: list[torch.Tensor] | None, num_experts: int,
                       channels: int, rank: int, expert_alignment: int = 1) -> DispatchReference:
    """Rank ``rank``'s dispatch outputs given every rank's routing (``recv_rows[j] = (source rank, token)``)."""
    ranks = len(topk_idx)
    local = num_experts // ranks
    in_rank = [layout_reference(i, num_experts, ranks)[2] for i in topk_idx]
    counts = torch.stack([m.sum(dim=0) for m in in_rank]).to(torch.int32)          # [source, destination]
    prefix = counts.cumsum(dim=0).to(torch.int32)
    channel_counts, heads = [], []
    for m in in_rank:
        cc = torch.zeros((ranks, channels), dtype=torch.int32, device="cpu")
        head = torch.full((m.shape[0], ranks), -1, dtype=torch.int32, device="cpu")
        for c, (start, end) in enumerate(_channel_bounds(m.shape[0], channels)):
            for r in range(ranks):
                sel = m[start:end, r]
                head[start:end, r] = torch.where(sel, sel.to(torch.int32).cumsum(0) - 1, -1)
                cc[r, c] = int(sel.sum())
        channel_counts.append(cc.cumsum(dim=1).to(torch.int32))
        heads.append(head)
    rows = [(s, t) for s in range(ranks) for t in in_rank[s][:, rank].nonzero().flatten().tolist()]
    recv_chan = torch.stack([torch.cat([torch.zeros(1, dtype=torch.int32, device="cpu"), cp[rank, :-1]])
                             for cp in channel_counts])
    topk = recv_w = None
    if topk_weights is not None:
        k = topk_idx[0].shape[1]
        topk = torch.full((len(rows), k), -1, dtype=torch.int64, device="cpu")
        recv_w = torch.zeros((len(rows), k), dtype=torch.float32, device="cpu")
        for j, (s, t) in enumerate(rows):
            e = topk_idx[s][t].long().cpu()
            mine = (e >= rank * local) & (e < (rank + 1) * local)
            topk[j] = torch.where(mine, e - rank * local, -1)
            recv_w[j] = torch.where(mine, topk_weights[s][t].cpu(), 0.0)
    experts = torch.zeros(local, dtype=torch.int64, device="cpu")
    for i in topk_idx:
        e = i.long().cpu()
        e = e[(e >= rank * local) & (e < (rank + 1) * local)] - rank * local
        experts += torch.bincount(e, minlength=local)
    aligned = [-(-int(n) // expert_alignment) * expert_alignment for n in experts]
    return DispatchReference(prefix, channel_counts[rank], recv_chan, heads[rank],
                             torch.tensor([t for _, t in rows], dtype=torch.int32, device="cpu"), rows, topk, recv_w,
                             aligned)


def combine_reference(rows_by_rank: list[list[tuple[int, int]]], x_by_rank: list[torch.Tensor], tokens: int,
                      rank: int, bias: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
                      weights_by_rank: list[torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rank ``rank``'s combine output: for each of its tokens, FP32 ``bias_0 + bias_1``, then each rank's row (rank
    order) where the token went, one BF16 rounding; the top-k weights summed likewise (FP32)."""
    hidden = x_by_rank[0].shape[1]
    acc = torch.zeros((tokens, hidden), dtype=torch.float32, device="cpu")
    for b in bias:
        if b is not None:
            acc = acc + b.float().cpu()
    w = None
    if weights_by_rank is not None:
        w = torch.zeros((tokens, weights_by_rank[0].shape[1]), dtype=torch.float32, device="cpu")
    for r, rows in enumerate(rows_by_rank):
        for j, (s, t) in enumerate(rows):
            if s != rank:
                continue
            acc[t] += x_by_rank[r][j].float().cpu()
            if w is not None:
                w[t] += weights_by_rank[r][j].cpu()
    return acc.to(torch.bfloat16), w
