"""The torch reference of the rewrite DeepEP v1.2.1's intranode combine makes to the caller's ``send_head``
(handle[5]) before its combine kernel reads it (``cached_notify_combine``, csrc/kernels/intranode.cu):
:func:`~gc_moe_compat.testing.ep_normal_reference.combined_send_head`, on the host.

DeepEP's rule, per channel (``ceil(T / C)`` contiguous tokens) and rank column: a -1 entry (the token does not go to
the rank) becomes ``-h - 1``, ``h`` the head of the nearest later token of the same channel that goes there, or
``-(1 << 25) - 1`` where none does; heads stay. Checked against hand-worked cases (a channel without tokens for a
rank, channel boundaries, T not divisible by C, more channels than tokens, T = 0 and 1, all -1 columns), against a
scan from each channel's end on fresh random routings (dispatch_reference's send_head), for what each rewritten entry
means (the count of the channel's earlier tokens to that rank), and for idempotence: a second combine on the same
handle rewrites the same bytes, and the sign of every entry (all the combines and the facade's cached dispatch read)
is unchanged."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gc_moe_compat.testing.ep_normal_reference import NO_LATER_HEAD, combined_send_head, dispatch_reference

NONE = -NO_LATER_HEAD - 1
"""A -1 entry with no later token of its channel to its rank, rewritten."""


def heads_of(in_rank: torch.Tensor, channels: int) -> torch.Tensor:
    """``send_head`` of a dispatch with this ``is_token_in_rank`` (bool ``[T, P]``) over ``channels``: each token's
    index among its channel's tokens to the rank, -1 where it does not go there (written out, token by token)."""
    tokens, ranks = in_rank.shape
    per = -(-tokens // channels) if tokens else 0
    head = torch.full((tokens, ranks), -1, dtype=torch.int32, device="cpu")
    for r in range(ranks):
        for c in range(channels):
            queued = 0
            for t in range(min(per * c, tokens), min(per * (c + 1), tokens)):
                if in_rank[t, r]:
                    head[t, r] = queued
                    queued += 1
    return head


def scan_from_channel_end(send_head: torch.Tensor, channels: int) -> torch.Tensor:
    """DeepEP's rule as a scalar walk: each channel's tokens from its last to its first, per rank, carrying the last
    head met (none yet: 1 << 25); a negative entry takes ``-carried - 1``."""
    tokens, ranks = send_head.shape
    per = -(-tokens // channels) if tokens else 0
    out = send_head.clone()
    for r in range(ranks):
        for c in range(channels):
            carried = NO_LATER_HEAD
            for t in reversed(range(min(per * c, tokens), min(per * (c + 1), tokens))):
                h = int(send_head[t, r])
                if h >= 0:
                    carried = h
                else:
                    out[t, r] = -carried - 1
    return out


def column(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device="cpu").unsqueeze(1)


def test_hand_worked_two_ranks_three_channels_of_ten_tokens() -> None:
    """T = 10 over C = 3: channels [0, 4), [4, 8), [8, 10). Rank 0 gets tokens 0, 3, 9 (none of channel 1); rank 1
    gets 1, 2, 4, 6, 8 (channel 0's last token 3 has none after it in its channel: token 4's head 0 is channel 1's)."""
    in_rank = torch.tensor([[1, 0], [0, 1], [0, 1], [1, 0], [0, 1], [0, 0], [0, 1], [0, 0], [0, 1], [1, 0]],
                           dtype=torch.bool, device="cpu")
    send_head = heads_of(in_rank, 3)
    assert send_head.T.tolist() == [[0, -1, -1, 1, -1, -1, -1, -1, -1, 0],
                                    [-1, 0, 1, -1, 0, -1, 1, -1, 0, -1]]
    assert combined_send_head(send_head, 3).T.tolist() == [
        [0, -2, -2, 1, NONE, NONE, NONE, NONE, -1, 0],
        [-1, 0, 1, NONE, 0, -2, 1, NONE, 0, NONE]]


def test_no_tokens() -> None:
    for ranks, channels in ((1, 1), (2, 10), (8, 12)):
        got = combined_send_head(torch.zeros((0, ranks), dtype=torch.int32, device="cpu"), channels)
        assert got.shape == (0, ranks) and got.dtype == torch.int32


def test_one_token() -> None:
    """One token, in channel 0 of any C: it stays where it goes, and has nothing after it where it does not."""
    for channels in (1, 4):
        got = combined_send_head(torch.tensor([[0, -1, 0]], dtype=torch.int32, device="cpu"), channels)
        assert got.tolist() == [[0, NONE, 0]]


def test_a_column_of_minus_ones_has_no_later_head_anywhere() -> None:
    for tokens, channels in ((7, 1), (7, 3), (64, 5)):
        got = combined_send_head(torch.full((tokens, 2), -1, dtype=torch.int32, device="cpu"), channels)
        assert bool((got == NONE).all())


def test_a_column_of_heads_stays() -> None:
    in_rank = torch.ones((11, 1), dtype=torch.bool, device="cpu")
    send_head = heads_of(in_rank, 4)  # channels of 3, 3, 3, 2 tokens
    assert send_head.flatten().tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1]
    assert torch.equal(combined_send_head(send_head, 4), send_head)


def test_more_channels_than_tokens() -> None:
    """T = 3 over C = 4: one token per channel, the last channel empty; no -1 entry has a later head."""
    send_head = column([0, -1, -1])
    assert combined_send_head(send_head, 4).flatten().tolist() == [0, NONE, NONE]


def test_tokens_not_divisible_by_channels_end_in_a_short_channel() -> None:
    """T = 7 over C = 3: channels [0, 3), [3, 6), [6, 7); the short last channel's -1 has nothing after it."""
    in_rank = torch.tensor([0, 1, 0, 0, 0, 1, 0], dtype=torch.bool, device="cpu").unsqueeze(1)
    send_head = heads_of(in_rank, 3)
    assert send_head.flatten().tolist() == [-1, 0, -1, -1, -1, 0, -1]
    assert combined_send_head(send_head, 3).flatten().tolist() == [-1, 0, NONE, -1, -1, 0, NONE]


def test_a_long_channel_carries_the_head_across_many_tokens() -> None:
    """One channel of 200 tokens, the rank's tokens at 5, 150 and 199: every -1 before 5 reads head 0's, those
    between 5 and 150 head 1's, those between 150 and 199 head 2's."""
    in_rank = torch.zeros((200, 1), dtype=torch.bool, device="cpu")
    in_rank[[5, 150, 199]] = True
    got = combined_send_head(heads_of(in_rank, 1), 1).flatten()
    want = [-1] * 5 + [0] + [-2] * 144 + [1] + [-3] * 48 + [2]
    assert got.tolist() == want


def random_heads(seed: int, tokens: int, ranks: int, channels: int, density: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return heads_of(torch.rand((tokens, ranks), generator=gen, dtype=torch.float32, device="cpu") < density, channels)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31 - 1), tokens=st.integers(0, 300), ranks=st.integers(1, 9),
       channels=st.integers(1, 40), density=st.sampled_from([0.0, 0.05, 0.3, 0.7, 1.0]))
def test_matches_a_scan_from_each_channels_end(seed: int, tokens: int, ranks: int, channels: int,
                                               density: float) -> None:
    send_head = random_heads(seed, tokens, ranks, channels, density)
    before = send_head.clone()
    got = combined_send_head(send_head, channels)
    assert torch.equal(send_head, before), "the reference must not change its input"
    assert torch.equal(got, scan_from_channel_end(send_head, channels))


@pytest.mark.parametrize("seed", range(4))
def test_on_dispatch_reference_heads(seed: int) -> None:
    """Fresh random routings of 3 ranks (-1 slots, a rank without tokens): each rank's send_head from the dispatch
    reference, rewritten as the scan says."""
    gen = torch.Generator().manual_seed(100 + seed)
    tokens, experts, topk, channels = [130, 0, 77], 12, 2, 4
    idx = [torch.where(torch.rand(t, topk, generator=gen, dtype=torch.float32, device="cpu") < 0.3, -1,
                       torch.randint(0, experts, (t, topk), generator=gen, dtype=torch.int64, device="cpu"))
           for t in tokens]
    for r in range(3):
        send_head = dispatch_reference(idx, None, experts, channels, r).send_head
        assert torch.equal(combined_send_head(send_head, channels), scan_from_channel_end(send_head, channels))


@pytest.mark.parametrize(("tokens", "ranks", "channels"), [(1, 1, 1), (97, 4, 10), (400, 8, 12), (33, 2, 40)])
def test_a_rewritten_entry_is_the_channels_earlier_tokens_to_the_rank(tokens: int, ranks: int, channels: int) -> None:
    """What a combine receiver reads from a rewritten entry ``v``: ``-v - 1`` tokens of the channel to that rank lie
    before the token (the queue slots it has passed), unless no token of the channel to the rank follows."""
    send_head = random_heads(tokens, tokens, ranks, channels, 0.4)
    got = combined_send_head(send_head, channels)
    per = -(-tokens // channels)
    for t in range(tokens):
        start, end = per * (t // per), min(per * (t // per + 1), tokens)
        for r in range(ranks):
            if send_head[t, r] >= 0:
                assert got[t, r] == send_head[t, r]
            elif bool((send_head[t + 1:end, r] >= 0).any()):
                assert -int(got[t, r]) - 1 == int((send_head[start:t, r] >= 0).sum())
            else:
                assert got[t, r] == NONE


@pytest.mark.parametrize(("tokens", "ranks", "channels"), [(0, 2, 3), (1, 1, 1), (50, 3, 7), (500, 8, 10)])
def test_a_second_combine_rewrites_the_same_bytes(tokens: int, ranks: int, channels: int) -> None:
    """DeepEP allows a handle to be reused: the second combine reads the first one's rewrite and leaves it as it is,
    and the entries' signs (what a combine and a cached dispatch read) are the dispatch's."""
    send_head = random_heads(7 + tokens, tokens, ranks, channels, 0.35)
    once = combined_send_head(send_head, channels)
    assert torch.equal(combined_send_head(once, channels), once)
    assert torch.equal(once >= 0, send_head >= 0)
    assert torch.equal(once[send_head >= 0], send_head[send_head >= 0])


def test_argument_checks() -> None:
    good = torch.zeros((3, 2), dtype=torch.int32, device="cpu")
    with pytest.raises(TypeError, match="send_head must be a torch.Tensor"):
        combined_send_head([[0]], 1)
    with pytest.raises(ValueError, match=r"send_head must be int32 \[T, P\], got \[3, 2\] torch.int64"):
        combined_send_head(good.long(), 1)
    with pytest.raises(ValueError, match=r"send_head must be int32 \[T, P\], got \[6\]"):
        combined_send_head(good.flatten(), 1)
    with pytest.raises(ValueError, match="channels must be >= 1"):
        combined_send_head(good, 0)
    with pytest.raises(TypeError, match="channels must be an int"):
        combined_send_head(good, 2.0)
