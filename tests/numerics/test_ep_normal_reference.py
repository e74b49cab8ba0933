"""The normal-mode torch reference (:mod:`gc_moe_compat.references.ep_normal_reference`) against DeepEP's rules, on the
host: every received row sits where the sender's handle (rank prefix + channel start + send_head) says, rows come
by source rank then token order, counts and alignment agree, and the combine of identity expert outputs returns
each token times the number of ranks it went to."""

from __future__ import annotations

import torch

from gc_moe_compat.references.ep_normal_reference import combine_reference, dispatch_reference, layout_reference

RANKS, EXPERTS, TOPK, CHANNELS = 3, 12, 3, 4


def _routing(seed: int, tokens: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    idx = [torch.where(torch.rand(t, TOPK, generator=gen) < 0.25, -1,
                       torch.randint(0, EXPERTS, (t, TOPK), generator=gen)) for t in tokens]
    return idx, [torch.rand(t, TOPK, generator=gen) for t in tokens]


def test_rows_sit_where_the_senders_handle_points() -> None:
    tokens = [17, 0, 9]
    idx, w = _routing(1, tokens)
    refs = [dispatch_reference(idx, w, EXPERTS, CHANNELS, r, expert_alignment=4) for r in range(RANKS)]
    for r, ref in enumerate(refs):
        assert [s for s, _ in ref.recv_rows] == sorted(s for s, _ in ref.recv_rows)
        for s in range(RANKS):
            sent = [t for q, t in ref.recv_rows if q == s]
            in_rank = layout_reference(idx[s], EXPERTS, RANKS)[2]
            assert sent == sorted(sent) and sent == in_rank[:, r].nonzero().flatten().tolist()
            sender = refs[s]
            per = -(-tokens[s] // CHANNELS) if tokens[s] else 1
            for t in sent:
                c = t // per
                start = int(sender.channel_prefix_matrix[r, c - 1]) if c else 0
                before = int(ref.rank_prefix_matrix[s - 1, r]) if s else 0
                assert ref.recv_rows[before + start + int(sender.send_head[t, r])] == (s, t)
        assert int(ref.rank_prefix_matrix[-1, r]) == len(ref.recv_rows)
        local = ref.recv_topk_idx[ref.recv_topk_idx >= 0]
        raw = torch.bincount(local, minlength=EXPERTS // RANKS).tolist()
        assert ref.num_recv_tokens_per_expert == [-(-n // 4) * 4 for n in raw]
        assert bool((ref.recv_topk_weights[ref.recv_topk_idx < 0] == 0).all())


def test_combine_of_identity_outputs_counts_the_ranks() -> None:
    tokens = [8, 5, 6]
    idx, w = _routing(2, tokens)
    xs = [torch.randn(t, 16).to(torch.bfloat16) for t in tokens]
    refs = [dispatch_reference(idx, w, EXPERTS, CHANNELS, r) for r in range(RANKS)]
    rows = [ref.recv_rows for ref in refs]
    outs = [torch.stack([xs[s][t] for s, t in r]) if r else torch.zeros(0, 16, dtype=torch.bfloat16) for r in rows]
    for s in range(RANKS):
        weights = [ref.recv_topk_weights for ref in refs]
        got, got_w = combine_reference(rows, outs, tokens[s], s, weights_by_rank=weights)
        hits = layout_reference(idx[s], EXPERTS, RANKS)[2].sum(dim=1, keepdim=True)
        assert torch.equal(got, (xs[s].float() * hits).to(torch.bfloat16))
        valid = (idx[s] >= 0)
        assert torch.equal(got_w, torch.where(valid, w[s], 0.0))
