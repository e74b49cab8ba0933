"""The ``deep_ep`` facade's normal mode (DeepEP's intranode ``get_dispatch_layout`` / ``dispatch`` / ``combine``) on
H200s, bit for bit against the torch references (:mod:`gc_moe_compat.testing.ep_normal_reference`), on one rank and on
two: every handle tensor (``send_head`` also after a combine, which rewrites it in place as DeepEP's does, after a
second combine on the same handle and after a cached dispatch), BF16 and FP8 payloads (column-major scales), -1 slots,
T = 0, a rank without tokens, every token to one expert, ``expert_alignment``, ``num_worst_tokens``, a cached
re-dispatch, bias, -0 / infinities / subnormals / NaN in the payloads, async with ``previous_event``, channels of
several 32-token chunks, 20 consecutive rounds, a default device of cuda, on the communication green partition and
with the partition off; two ranks: a missing peer ends in ``DeviceTimeoutError`` naming it. The rewrite's kernel on
its own (issue 29): DeepEP's bytes (the reference's ``combined_send_head``) for up to 8 rank columns, long and empty
channels, inside guard words, twice (a reused handle), with the facade's grid and with one CTA. In process on one
rank: ``get_dispatch_layout`` reports an id outside ``[-1, num_experts)`` (issue 32 item 5: below -1 too) as
``DeviceCheckError`` at the next call (no call waits on the CPU, as with DeepEP), a synchronous one's and an
``async_finish`` one's, and ``Buffer.destroy`` raises one that no call raised. Inside a ``torch.cuda.graph`` capture
every call raises ``NotImplementedError`` and the Buffer's later eager calls are unchanged.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from two_rank import MULTI_RANKS, run_ranks

from gc_moe_compat.comm import ep_normal
from gc_moe_compat.deep_ep import Buffer
from gc_moe_compat.runtime.cuda import as_stream
from gc_moe_compat.runtime.launch import launch
from gc_moe_compat.runtime.params import KernelArgs
from gc_moe_compat.runtime.status import DeviceCheckError, spin_timeout_ns
from gc_moe_compat.runtime.workspace import PeerTable
from gc_moe_compat.testing.ep_normal_reference import combined_send_head, layout_reference

pytestmark = pytest.mark.gpu

WORKER = "deep_ep_normal_worker.py"
TIMEOUT_S = 400
CASES = ("normal random BF16 bit-exact", "normal random FP8 (column-major scales) bit-exact",
         "normal num_worst_tokens bit-exact", "normal T = 0 on every rank bit-exact",
         "normal long channels (send_head's rewrite over several 32-token chunks) bit-exact",
         "normal hidden 8320 FP8 bit-exact", "normal hidden 8320 BF16 + bias bit-exact",
         "normal hidden 384 FP8 bit-exact", "normal routing row slices bit-exact",
         "normal routing row slices FP8 bit-exact", "normal special values BF16 bit-exact",
         "normal special values BF16 + bias bit-exact",
         "normal under torch.set_default_device('cuda') bit-exact", "20 consecutive normal rounds bit-exact",
         "normal on a 64 KB workspace")
GROWTH_CASES = ("2 growths), bit-exact", "a growth the last rank cannot make -> ValueError",
                "normal after a refused growth (the op released by the host) bit-exact")
"""Printed with more than one rank only: at one rank no row enters the workspace, so it never grows ("0 growths")."""


@pytest.mark.parametrize("nproc", [1, pytest.param(MULTI_RANKS, marks=pytest.mark.multigpu)])
@pytest.mark.parametrize("partition", ["on", "off"])
def test_deep_ep_normal_cases(nproc: int, partition: str) -> None:
    cases = CASES + (GROWTH_CASES if nproc > 1 else ("0 growths), bit-exact",))
    out = run_ranks(WORKER, nproc, TIMEOUT_S, *cases, env={"GC_MOE_DEEP_EP_PARTITION": partition},
                    args=("--suite", "cases"))
    assert out.count("20 consecutive normal rounds bit-exact") == nproc


@pytest.mark.multigpu
def test_deep_ep_normal_at_the_legacy_shape_rows_come_from_their_sources() -> None:
    """DeepEP's legacy intranode test's sizes and data (4096 tokens of hidden 7168 per rank, 256 experts, 2e9 NVL
    bytes), every received row checked against its source rank, BF16 and FP8, uncached and cached, twice: at 8
    processes on one H200 the legacy test's first FP8 dispatch received rows that were not their source's."""
    out = run_ranks(WORKER, MULTI_RANKS, TIMEOUT_S, args=("--suite", "legacy_shape"))
    assert out.count("legacy shape round 1 FP8 with top-k rows from their sources") == MULTI_RANKS


@pytest.mark.multigpu
def test_deep_ep_normal_missing_peer_times_out() -> None:
    run_ranks(WORKER, 2, TIMEOUT_S, "missing peer", args=("--suite", "timeout"))


def _send_head(in_rank: torch.Tensor, channels: int) -> torch.Tensor:
    """A dispatch's send_head for ``is_token_in_rank`` over ``channels``: the token's index among its channel's tokens
    to the rank, -1 where it does not go there (the reference's rule)."""
    tokens = in_rank.shape[0]
    per = -(-tokens // channels) if tokens else 0
    head = torch.full(in_rank.shape, -1, dtype=torch.int32, device="cpu")
    for c in range(channels):
        block = in_rank[min(per * c, tokens):min(per * c + per, tokens)]
        head[min(per * c, tokens):min(per * c + per, tokens)] = torch.where(block, block.int().cumsum(0) - 1, -1)
    return head


GUARD = 64
"""int32 words before and after the kernel's send_head, which it must leave as they are."""


@pytest.mark.parametrize(("tokens", "ranks", "channels", "density"), [
    (0, 2, 4, 0.3), (1, 1, 1, 0.0), (1, 8, 12, 0.5), (33, 3, 1, 0.3), (257, 2, 1, 0.1), (300, 8, 40, 0.3),
    (1000, 8, 12, 0.05), (4096, 8, 12, 0.3), (4096, 2, 66, 0.9), (600, 4, 10, 0.0), (600, 4, 10, 1.0)])
def test_combine_heads_kernel_rewrites_send_head_as_deepep(tokens: int, ranks: int, channels: int,
                                                           density: float) -> None:
    """gc_ep_normal_combine_heads launched on its own (a peer table of ``ranks`` ranks: it reads only their count)
    on a dispatch's send_head between guard words: the result is the reference's rewrite (DeepEP v1.2.1's bytes), no
    word outside the tensor changes, and a second launch (a second combine on the handle) leaves it as it is; with the
    grid of a warp per channel and rank and with one CTA (each warp striding over several); the facade's combine runs
    the same rewrite inside its kernel."""
    gen = torch.Generator().manual_seed(7 * tokens + 131 * ranks + channels)
    in_rank = torch.rand((tokens, ranks), generator=gen, dtype=torch.float32, device="cpu") < density
    send_head = _send_head(in_rank, channels)
    want = combined_send_head(send_head, channels)
    if 0 < density < 1 and tokens > 32:
        assert not torch.equal(want, send_head), "a case the rewrite leaves alone shows nothing"
    table = PeerTable()
    table.rank, table.world_size = 0, ranks
    stream = as_stream(torch.cuda.current_stream().cuda_stream)
    for grid in (-(-ranks * channels // 8), 1):
        words = torch.full((tokens * ranks + 2 * GUARD,), 0x5EEDBEEF, dtype=torch.int32, device="cuda")
        heads = words[GUARD:GUARD + tokens * ranks].view(tokens, ranks)
        heads.copy_(send_head)
        params = ep_normal.make_params(transient=ep_normal.data_offset(ranks, 1, channels), data_rows=0,
                                       send_head=heads.data_ptr(), num_tokens=tokens, num_channels=channels,
                                       timeout_ns=spin_timeout_ns())
        for which in ("first", "second"):
            launch(ep_normal.kernel_of(ep_normal.Entry.COMBINE_HEADS), grid, ep_normal.THREADS,
                   KernelArgs(table, params), stream)
            torch.cuda.synchronize()
            got = words.cpu()
            assert bool((got[:GUARD] == 0x5EEDBEEF).all()) and bool((got[-GUARD:] == 0x5EEDBEEF).all()), \
                f"grid {grid}, {which} launch: a word outside send_head changed"
            diff = int((heads.cpu() != want).sum())
            assert diff == 0, f"grid {grid}, {which} launch: {diff} send_head entries are not DeepEP's"


BAD_IDS = {  # id -> what the report names (observed / expected of the layout kernel's record)
    -5: r"a topk_idx entry below -1 \(observed: its negation\).*observed 5, expected 1",
    -(2**31): r"a topk_idx entry below -1 .*observed 2147483648, expected 1",
    8: r"a topk_idx entry \(observed\) >= num_experts \(expected\).*observed 8, expected 8",
}


@pytest.mark.parametrize("bad", sorted(BAD_IDS))
@pytest.mark.parametrize("partition", ["on", "off"])
def test_layout_reports_ids_outside_the_experts(group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch,
                                                bad: int, partition: str) -> None:
    """One id outside [-1, E) (token 3, slot 1) among valid ones: the synchronous get_dispatch_layout returns
    without waiting, the layout with that slot unused (the torch reference's), and the next call raises
    DeviceCheckError naming the kernel, the site and the value as recorded by an earlier call; so does the call after
    an async_finish one; the call after that runs and equals the reference; an error no call raised is raised by
    Buffer.destroy. The ids are int64 (DeepEP's topk_idx_t): int32 ones are refused on the host, before a launch."""
    monkeypatch.setenv("GC_MOE_DEEP_EP_PARTITION", partition)
    tokens, topk, experts = 16, 4, 8
    buf = Buffer(group, 1 << 22, 0, explicitly_destroy=True)
    g = torch.Generator().manual_seed(32)
    idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])
    bad_idx = idx.clone()
    bad_idx[3, 1] = bad
    idx, bad_idx = idx.cuda(), bad_idx.cuda()
    with pytest.raises(ValueError, match=r"^get_dispatch_layout: topk_idx must be \[\*, \*\] of torch.int64 "
                                         r"\(deep_ep.topk_idx_t, which DeepEP asserts\), got \[16, 4\] torch.int32$"):
        buf.get_dispatch_layout(bad_idx.int(), experts)
    recorded = f"gc_ep_normal_layout \\(recorded by an earlier call\\): {BAD_IDS[bad]}"
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(bad_idx, experts)  # synchronous: no CPU wait
    torch.cuda.synchronize()
    for got, want in zip((per_rank, per_expert, in_rank), layout_reference(bad_idx, experts, 1), strict=True):
        assert torch.equal(got.cpu(), want)
    with pytest.raises(DeviceCheckError, match=recorded):
        buf.get_dispatch_layout(idx, experts)
    per_rank, _, per_expert, in_rank, event = buf.get_dispatch_layout(bad_idx, experts, async_finish=True)
    event.current_stream_wait()
    torch.cuda.synchronize()
    for got, want in zip((per_rank, per_expert, in_rank), layout_reference(bad_idx, experts, 1), strict=True):
        assert torch.equal(got.cpu(), want)
    with pytest.raises(DeviceCheckError, match=recorded):
        buf.get_dispatch_layout(idx, experts)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
    for got, want in zip((per_rank, per_expert, in_rank), layout_reference(idx, experts, 1), strict=True):
        assert torch.equal(got.cpu(), want)
    buf.get_dispatch_layout(bad_idx, experts)  # an error no call raises: destroy does (it synchronizes)
    with pytest.raises(DeviceCheckError, match=recorded):
        buf.destroy()


def test_calls_inside_a_graph_capture_raise_and_the_buffer_goes_on(group: dist.ProcessGroup) -> None:
    """Inside a real ``torch.cuda.graph`` capture each normal-mode call (the layout, a ``num_worst_tokens`` dispatch,
    a cached dispatch, a combine: DeepEP captures all four) raises NotImplementedError naming it, the capture ends
    with the exception, and the Buffer's eager calls afterwards give the rows and sums they gave before it."""
    tokens, topk, experts, hidden = 16, 4, 8, 256
    buf = Buffer(group, 1 << 22, 0, explicitly_destroy=True)
    g = torch.Generator().manual_seed(47)
    idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)]).cuda()
    w = torch.rand(tokens, topk, generator=g).cuda()
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).cuda()
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=idx, topk_weights=w)
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, **layout)
    combined, combined_w, _ = buf.combine(recv_x, handle, recv_w)
    torch.cuda.synchronize()
    before = [t.clone() for t in (recv_x, combined, combined_w)]
    calls = {
        "get_dispatch_layout": lambda: buf.get_dispatch_layout(idx, experts),
        "dispatch": lambda: buf.dispatch(x, **layout, num_worst_tokens=tokens),
        "cached dispatch": lambda: buf.dispatch(x, handle),
        "combine": lambda: buf.combine(recv_x, handle, recv_w),
    }
    refused = "CUDA graph capture of normal-mode calls is not implemented"
    for what, call in calls.items():
        expected = pytest.raises(NotImplementedError, match=f"^{what.split()[-1]}: {refused}")
        with expected, torch.cuda.graph(torch.cuda.CUDAGraph()):
            call()
    recv_again, _, recv_w_again, _, handle, _ = buf.dispatch(x, **layout)
    combined_again, combined_w_again, _ = buf.combine(recv_again, handle, recv_w_again)
    torch.cuda.synchronize()
    for got, want in zip((recv_again, combined_again, combined_w_again), before, strict=True):
        assert torch.equal(got, want)
    buf.destroy()
