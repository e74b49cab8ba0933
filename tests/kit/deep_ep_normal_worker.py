"""Worker of tests/facades/test_deep_ep_normal.py: the ``deep_ep`` facade's normal-mode layout, dispatch and combine on
1 or 2 ranks against :mod:`gc_moe_compat.testing.ep_normal_reference`.

Every rank draws every rank's inputs from one seed and checks its own outputs: the layout, every handle tensor, the
received rows (BF16 or FP8 bytes and scales, bit for bit), source indices, local top-k ids and weights, the aligned
per-expert counts, the worst-case padding, a cached re-dispatch, and the combine (bit for bit against the FP32
reference, with and without bias and top-k weights); after it the handle's send_head holds DeepEP's in-place rewrite
(the reference's ``combined_send_head``), and a second combine on the same handle and a cached dispatch after it give
the same results and leave that rewrite. The caching allocator is poisoned (freed 0xFF blocks) before each call, so an
output row the kernels fail to write shows. Suites: ``cases`` (random routing with -1 slots, a rank without tokens on
two ranks, T = 0, every token to one expert, expert_alignment, num_worst_tokens, async + previous_event, channels of
several 32-token chunks, a default device of cuda, the routing and counts one element past a 16-byte boundary, a
workspace grown by its calls and a growth refused at two ranks, a 64 KB workspace that holds no row at one), ``timeout``
(rank 1 stays away: rank 0's dispatch ends in DeviceTimeoutError naming rank 1) and ``legacy_shape`` (DeepEP's
tests/legacy/test_intranode.py sizes and data: 4096 tokens of hidden 7168 per rank, top-8 of 256 experts, 24 SMs, 2e9
NVL bytes, every row of rank r equal to r, in BF16 and FP8 with column-major scales; each received row is checked
against its source rank and a bad one is reported by source, column range and the facade's recorded status).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from two_rank import MISSING_PEER_TIMEOUT_MS, raises, run_suite, spin_timeout

import gc_moe_compat.deep_ep as deep_ep
from gc_moe_compat.runtime import workspace
from gc_moe_compat.runtime.status import DeviceTimeoutError
from gc_moe_compat.testing.ep_normal_reference import (
    combine_reference,
    combined_send_head,
    dispatch_reference,
    layout_reference,
)

HIDDEN, TOPK, SMS = 512, 4, 8
NVL_BYTES = 64 << 20


def experts_for(ranks: int) -> int:
    return 8 * ranks


def poison() -> None:
    """Freed 0xFF blocks in torch's caching allocator: the facade's next outputs likely reuse them."""
    block = torch.full((16 << 20,), -1, dtype=torch.int32, device="cuda")
    del block


def routing(gen: torch.Generator, tokens: int, experts: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "one_expert":
        idx = torch.full((tokens, TOPK), -1, dtype=torch.int64, device="cpu")
        idx[:, 0] = experts - 1
    else:
        idx = torch.stack([torch.randperm(experts, generator=gen, device="cpu")[:TOPK] for _ in range(tokens)]) \
            if tokens else torch.zeros(0, TOPK, dtype=torch.int64, device="cpu")
        idx = torch.where(torch.rand(tokens, TOPK, generator=gen, device="cpu") < 0.2, -1, idx)
    return idx, torch.rand(tokens, TOPK, generator=gen, device="cpu")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().contiguous().view(torch.uint8)


def check_equal(what: str, got: torch.Tensor, want: torch.Tensor, any_nan: bool = False) -> None:
    """``got`` bit for bit ``want``; with ``any_nan`` a NaN matches any NaN (a sum's NaN is the GPU's canonical one,
    torch's CPU rounding keeps another payload), every other element still bit for bit."""
    got = got.cpu()
    want = want.to(got.dtype)
    assert got.shape == want.shape, f"{what}: shape {list(got.shape)} != {list(want.shape)}"
    if any_nan:
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan), f"{what}: NaN at other elements"
        got, want = got.masked_fill(nan, 0), want.masked_fill(nan, 0)
    assert torch.equal(bits(got), bits(want)), f"{what}: {(bits(got) != bits(want)).sum().item()} bytes differ"


SPECIAL_VALUES = (-0.0, float("inf"), float("-inf"), 1e-39, -3e-40, float("nan"))
"""Written into every 37th column of the payloads (``run_case(special=True)``): -0 (a sum from +0 makes it +0),
infinities, BF16 subnormals (no flush to zero) and NaN."""


def with_special_values(x: torch.Tensor) -> torch.Tensor:
    for k, value in enumerate(SPECIAL_VALUES):
        x[:, k::37] = value
    return x


def off_16(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a tensor one element past a 16-byte boundary (a row slice's address)."""
    return torch.zeros(t.numel() + 16, dtype=t.dtype, device=t.device)[1:1 + t.numel()].view(t.shape).copy_(t)


def run_case(buf: deep_ep.Buffer, rank: int, ranks: int, seed: int, tokens: list[int], kind: str, fp8: bool,
             align: int = 1, worst: int = 0, use_async: bool = False, bias: bool = False, hidden: int = HIDDEN,
             sliced: bool = False, special: bool = False) -> None:
    """One layout, uncached dispatch, cached dispatch and two combines, every output against the references;
    ``sliced``: the routing, the counts and the combine's weights passed one element past a 16-byte boundary (as
    row slices of a larger batch are), which the kernels read element by element; ``special``: BF16 payloads with
    :data:`SPECIAL_VALUES` (the combine's NaNs compared as NaN)."""
    gen = torch.Generator().manual_seed(seed)
    experts = experts_for(ranks)
    xs = [(torch.randn(t, hidden, generator=gen, device="cpu") * 2).to(torch.bfloat16) for t in tokens]
    if special:
        assert not fp8, "special values: BF16 payloads only (an FP8 block's scale of an infinity is not finite)"
        xs = [with_special_values(x) for x in xs]
    routes = [routing(gen, t, experts, kind) for t in tokens]
    idx, w = [r[0] for r in routes], [r[1] for r in routes]
    config = deep_ep.Config(SMS, 8, 256)
    ref = dispatch_reference(idx, w, experts, SMS // 2, rank, align)
    per_rank, per_expert, in_rank = layout_reference(idx[rank], experts, ranks)
    poison()
    prev = deep_ep.Buffer.capture() if use_async else None
    got_rank, rdma, got_expert, got_in, ev = buf.get_dispatch_layout(idx[rank].cuda(), experts, previous_event=prev,
                                                                      async_finish=use_async,
                                                                      allocate_on_comm_stream=use_async)
    if use_async:
        ev.current_stream_wait()
    assert rdma is None
    check_equal("num_tokens_per_rank", got_rank, per_rank)
    check_equal("num_tokens_per_expert", got_expert, per_expert)
    check_equal("is_token_in_rank", got_in, in_rank)
    own_routing = (idx[rank].cuda(), w[rank].cuda())
    if sliced:
        got_rank, got_expert, got_in = off_16(got_rank), off_16(got_expert), off_16(got_in)
        own_routing = tuple(off_16(t) for t in own_routing)
        assert all(t.data_ptr() % 16 for t in (got_rank, got_expert, *own_routing) if t.numel())
    x = xs[rank].cuda()
    if fp8:
        payload, scales = _fp8_of(xs[rank])
        x_in = (payload.cuda(), scales.cuda().T.contiguous().T)  # column-major scales, as DeepEP's test passes them
    else:
        x_in = x
    poison()
    prev = deep_ep.Buffer.capture() if use_async else None
    recv, recv_idx, recv_w, counts, handle, ev = buf.dispatch(
        x_in, num_tokens_per_rank=got_rank, is_token_in_rank=got_in, num_tokens_per_expert=got_expert,
        topk_idx=own_routing[0], topk_weights=own_routing[1], expert_alignment=align, num_worst_tokens=worst,
        config=config, previous_event=prev, async_finish=use_async)
    if use_async:
        ev.current_stream_wait()
    torch.cuda.synchronize()
    n = len(ref.recv_rows)
    rows_x = torch.stack([xs[s][t] for s, t in ref.recv_rows]) if n else \
        torch.zeros(0, hidden, dtype=torch.bfloat16, device="cpu")
    recv_x = recv[0] if fp8 else recv
    if worst:
        assert counts == [] and recv_x.shape[0] == worst and recv_idx.shape[0] == worst
        assert bool((recv_idx[n:] == -1).all()), "num_worst_tokens: rows past the received count need top-k id -1"
    else:
        assert counts == ref.num_recv_tokens_per_expert, (counts, ref.num_recv_tokens_per_expert)
        assert recv_x.shape[0] == n
    if fp8:
        quantized = [_fp8_of(q) for q in xs]
        want_payload = torch.stack([quantized[s][0][t] for s, t in ref.recv_rows]) if n else \
            torch.zeros(0, hidden, dtype=torch.float8_e4m3fn, device="cpu")
        want_scales = torch.stack([quantized[s][1][t] for s, t in ref.recv_rows]) if n else \
            torch.zeros(0, hidden // 128, dtype=torch.float32, device="cpu")
        check_equal("recv_x (FP8)", recv_x[:n], want_payload)
        check_equal("recv_x scales", recv[1][:n], want_scales)
    else:
        check_equal("recv_x", recv_x[:n], rows_x)
    check_equal("recv_topk_idx", recv_idx[:n], ref.recv_topk_idx)
    check_equal("recv_topk_weights", recv_w[:n], ref.recv_topk_weights)
    rank_prefix, channel_prefix, recv_chan, src_idx, h_in_rank, send_head = handle
    if sliced:
        recv_w = off_16(recv_w)
    check_equal("rank_prefix_matrix", rank_prefix, ref.rank_prefix_matrix)
    check_equal("channel_prefix_matrix", channel_prefix, ref.channel_prefix_matrix)
    check_equal("recv_channel_prefix_matrix", recv_chan, ref.recv_channel_prefix_matrix)
    check_equal("recv_src_idx", src_idx[:n], ref.recv_src_idx)
    check_equal("send_head", send_head, ref.send_head)
    if not fp8:
        poison()
        again, *_ = buf.dispatch(x, handle=handle, config=config)
        torch.cuda.synchronize()
        check_equal("cached dispatch recv_x", again[:n], rows_x)
    # Combine: every rank's "expert output" is its received rows scaled by a rank-dependent factor.
    outs: list[torch.Tensor] = [torch.empty(0, device="cpu")] * ranks
    rows_by_rank, w_by_rank = [], []
    for q in range(ranks):
        rq = dispatch_reference(idx, w, experts, SMS // 2, q, align)
        rows_by_rank.append(rq.recv_rows)
        xq = torch.stack([xs[s][t] for s, t in rq.recv_rows]) if rq.recv_rows else \
            torch.zeros(0, hidden, dtype=torch.float32, device="cpu")
        outs[q] = (xq.float() * (q + 1.5)).to(torch.bfloat16)
        w_by_rank.append(rq.recv_topk_weights)
    mine = outs[rank]
    pad = torch.full((recv_x.shape[0] - n, hidden), float("nan"), dtype=torch.bfloat16, device="cpu")
    x_comb = torch.cat([mine, pad])
    b = tuple(torch.randn(tokens[rank], hidden, generator=gen, device="cpu").to(torch.bfloat16) for _ in range(2)) \
        if bias else (None, None)
    want_x, want_w = combine_reference(rows_by_rank, outs, tokens[rank], rank, b, w_by_rank)
    poison()
    prev = deep_ep.Buffer.capture() if use_async else None
    combined, combined_w, ev = buf.combine(
        x_comb.cuda(), handle, topk_weights=recv_w, config=config, previous_event=prev, async_finish=use_async,
        bias=tuple(t.cuda() for t in b) if bias else None)
    if use_async:
        ev.current_stream_wait()
    torch.cuda.synchronize()
    check_equal("combined_x", combined, want_x, any_nan=special)
    check_equal("combined_topk_weights", combined_w, want_w)
    # DeepEP's combine rewrites the handle's send_head in place; a second combine on the same handle reads that
    # rewrite (and leaves it), as does a cached dispatch after it.
    heads = combined_send_head(ref.send_head, SMS // 2)
    check_equal("send_head after combine", send_head, heads)
    poison()
    combined, combined_w, _ = buf.combine(x_comb.cuda(), handle, topk_weights=recv_w, config=config,
                                          bias=tuple(t.cuda() for t in b) if bias else None)
    torch.cuda.synchronize()
    check_equal("second combine combined_x", combined, want_x, any_nan=special)
    check_equal("second combine combined_topk_weights", combined_w, want_w)
    check_equal("send_head after a second combine", send_head, heads)
    if not fp8:
        poison()
        again, *_ = buf.dispatch(x, handle=handle, config=config)
        torch.cuda.synchronize()
        check_equal("cached dispatch after combine recv_x", again[:n], rows_x)
        check_equal("send_head after a cached dispatch", send_head, heads)


def _fp8_of(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The worker's own FP8 quantization (what it passes as x), on the host, for another rank's rows."""
    t = x.shape[0]
    amax = x.float().view(t, -1, 128).abs().amax(dim=2).clamp(min=1e-4)
    scales = amax / 448
    payload = (x.float().view(t, -1, 128) / scales.unsqueeze(2)).view(t, x.shape[1]).to(torch.float8_e4m3fn)
    return payload, scales


def suite_cases(rank: int, ranks: int) -> None:
    buf = deep_ep.Buffer(dist.group.WORLD, NVL_BYTES, 0)
    full = [96] * ranks
    cases = [
        ("random BF16", dict(seed=1, tokens=full, kind="random", fp8=False)),
        ("random FP8 (column-major scales)", dict(seed=2, tokens=full, kind="random", fp8=True)),
        ("bias + expert_alignment=4", dict(seed=3, tokens=[37] * ranks, kind="random", fp8=False, align=4,
                                           bias=True)),
        ("all tokens to one expert", dict(seed=4, tokens=full, kind="one_expert", fp8=False)),
        ("num_worst_tokens", dict(seed=5, tokens=full, kind="random", fp8=False, worst=96 * ranks)),
        ("async + previous_event + allocate_on_comm_stream", dict(seed=6, tokens=full, kind="random", fp8=True,
                                                                  use_async=True)),
        ("T = 0 on every rank", dict(seed=7, tokens=[0] * ranks, kind="random", fp8=False)),
        ("a rank without tokens", dict(seed=8, tokens=[0] + [50] * (ranks - 1) if ranks > 1 else [1],
                                       kind="random", fp8=False)),
        ("long channels (send_head's rewrite over several 32-token chunks)",
         dict(seed=10, tokens=[600, 333] * (ranks // 2) + [413] * (ranks % 2), kind="random", fp8=False, bias=True)),
        # Row sizes around the kernels' batches: 65 scale words (past the 64 loaded ahead), 520 FP8 / 1040 BF16
        # vectors (512 per warp round: one or two full rounds and a partial one; the combine's last 2048-column chunk
        # 128 columns wide), and a row of fewer vectors than a warp's lanes.
        ("hidden 8320 FP8", dict(seed=11, tokens=[40] * ranks, kind="random", fp8=True, hidden=8320)),
        ("hidden 8320 BF16 + bias", dict(seed=12, tokens=[40] * ranks, kind="random", fp8=False, bias=True,
                                        hidden=8320)),
        ("hidden 384 FP8", dict(seed=13, tokens=[40] * ranks, kind="random", fp8=True, hidden=384)),
        ("routing row slices", dict(seed=14, tokens=[37] * ranks, kind="random", fp8=False, bias=True, sliced=True)),
        ("routing row slices FP8", dict(seed=15, tokens=[37] * ranks, kind="random", fp8=True, sliced=True)),
        # -0, infinities, subnormals and NaN through the dispatch's copies and the combine's FP32 sums; hidden 7168:
        # 896 vectors, two full rounds of the row copies' 14 vectors per lane.
        ("special values BF16", dict(seed=16, tokens=[40] * ranks, kind="random", fp8=False, hidden=7168,
                                     special=True)),
        ("special values BF16 + bias", dict(seed=17, tokens=[40] * ranks, kind="random", fp8=False, bias=True,
                                            special=True)),
    ]
    for name, case in cases:
        run_case(buf, rank, ranks, **case)
        print(f"rank {rank}: normal {name} bit-exact", flush=True)
    torch.set_default_device("cuda")
    try:
        run_case(buf, rank, ranks, seed=9, tokens=full, kind="random", fp8=False)
    finally:
        torch.set_default_device(None)
    print(f"rank {rank}: normal under torch.set_default_device('cuda') bit-exact", flush=True)
    for i in range(20):
        run_case(buf, rank, ranks, seed=100 + i, tokens=[64 + 7 * i] * ranks, kind="random", fp8=i % 2 == 1)
    print(f"rank {rank}: 20 consecutive normal rounds bit-exact", flush=True)
    # A Buffer too small for the calls' rows (64 KB): every rank grows it in the call that does not fit, with a
    # RuntimeWarning, and the results stay bit-exact: the FP8 dispatch first, then its BF16 combine (wider rows than
    # the FP8 ones: 1040 bytes against 592), then a call that fits. At one rank the rows never enter the workspace
    # (the kernels copy between the caller's tensors), so nothing grows and the results are bit-exact all the same.
    small = deep_ep.Buffer(dist.group.WORLD, 64 << 10, 0, explicitly_destroy=True)
    with warnings.catch_warnings(record=True) as grown:
        warnings.simplefilter("always", RuntimeWarning)
        run_case(small, rank, ranks, seed=30, tokens=[2500] * ranks, kind="random", fp8=True)
        run_case(small, rank, ranks, seed=31, tokens=[8] * ranks, kind="random", fp8=False)
    messages = [str(w.message) for w in grown if issubclass(w.category, RuntimeWarning)]
    growths = [m.split(":")[0] for m in messages if "workspace, which grew" in m]
    assert growths == (["dispatch", "combine"] if ranks > 1 else []), messages
    assert ranks > 1 or small.normal.buffer.numel() == 64 << 10
    print(f"rank {rank}: normal on a 64 KB workspace ({small.normal.buffer.numel()} bytes after the calls: "
          f"{len(growths)} growths), bit-exact", flush=True)
    small.destroy()
    if ranks == 1:  # no growth at one rank, so none to refuse
        return
    # A growth that a rank cannot make (the last rank's allocation made to fail): every rank raises ValueError and
    # keeps its workspace; the refused dispatch's op (its counts were exchanged) is released by the host, so the next
    # calls run at once, bit-exact, instead of waiting for that op's words.
    small = deep_ep.Buffer(dist.group.WORLD, 64 << 10, 0, explicitly_destroy=True)
    allocate = workspace._try
    if rank == ranks - 1:
        workspace._try = lambda make: (None, "RuntimeError: the test's refusal")
    try:
        with raises(ValueError, rank, "a growth the last rank cannot make", "growing the workspace to",
                    f"rank {ranks - 1}: RuntimeError: the test's refusal"):
            run_case(small, rank, ranks, seed=32, tokens=full, kind="random", fp8=False)
    finally:
        workspace._try = allocate
    assert small.normal.buffer.numel() == 64 << 10
    run_case(small, rank, ranks, seed=33, tokens=[8] * ranks, kind="random", fp8=False)
    print(f"rank {rank}: normal after a refused growth (the op released by the host) bit-exact", flush=True)
    small.destroy()


def suite_timeout(rank: int, ranks: int) -> None:
    with spin_timeout(MISSING_PEER_TIMEOUT_MS):
        buf = deep_ep.Buffer(dist.group.WORLD, NVL_BYTES, 0)
        if rank == 0:
            idx = torch.zeros(8, TOPK, dtype=torch.int64, device="cuda")
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts_for(ranks))
            with raises(DeviceTimeoutError, rank, "missing peer", "rank 1"):
                buf.dispatch(torch.zeros(8, HIDDEN, dtype=torch.bfloat16, device="cuda"), num_tokens_per_rank=per_rank,
                             is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                             config=deep_ep.Config(SMS, 8, 256))
    dist.barrier()


LEGACY_TOKENS, LEGACY_HIDDEN, LEGACY_TOPK, LEGACY_EXPERTS, LEGACY_SMS, LEGACY_NVL = 4096, 7168, 8, 256, 24, int(2e9)


def _legacy_rows_ok(recv: object, sources: torch.Tensor, fp8: bool) -> torch.Tensor:
    """Per received row, whether it is its source rank's row: BF16 all equal to the rank; FP8 DeepEP's
    per_token_cast_to_fp8 of it (payload 448, or 0 for rank 0, and the scale amax / 448 of every 128-column group)."""
    if not fp8:
        return (recv.float() == sources.float().unsqueeze(1)).all(dim=1)
    payload, scales = recv
    amax = sources.float().clamp(min=1e-4).unsqueeze(1)
    want_payload = torch.where(sources > 0, 448.0, 0.0).unsqueeze(1)
    return (payload.float() == want_payload).all(dim=1) & (scales == amax / 448).all(dim=1)


def _legacy_report(what: str, ok: torch.Tensor, sources: torch.Tensor, recv: object, fp8: bool,
                   buf: deep_ep.Buffer) -> str:
    """Which rows are wrong (per source rank, the first row, its first and last wrong column) and what the facade
    recorded: a device error would surface at the next call."""
    bad = (~ok).nonzero().flatten()
    per_source = torch.bincount(sources[bad].long(), minlength=dist.get_world_size()).tolist()
    row = int(bad[0])
    values = (recv[0] if fp8 else recv)[row].float()
    wrong = (values != values[0]).nonzero().flatten() if fp8 else (values != float(sources[row])).nonzero().flatten()
    cols = f"columns {int(wrong[0])}..{int(wrong[-1])}" if wrong.numel() else "payload uniform (scales differ)"
    try:
        buf.get_dispatch_layout(torch.zeros(1, LEGACY_TOPK, dtype=torch.int64, device="cuda"), LEGACY_EXPERTS)
        torch.cuda.synchronize()
        recorded = "nothing recorded"
    except Exception as err:  # noqa: BLE001 - the report names whatever the facade raised
        recorded = f"{type(err).__name__}: {err}"
    return (f"{what}: {bad.numel()} of {ok.numel()} received rows wrong, per source rank {per_source}; first row "
            f"{row} (source {int(sources[row])}): {cols}; the facade: {recorded}")


def suite_legacy_shape(rank: int, ranks: int) -> None:
    buf = deep_ep.Buffer(dist.group.WORLD, LEGACY_NVL, 0, explicitly_destroy=True)
    config = deep_ep.Config(LEGACY_SMS, 8, 256)
    x = torch.ones((LEGACY_TOKENS, LEGACY_HIDDEN), dtype=torch.bfloat16, device="cuda") * rank
    amax = x.float().view(LEGACY_TOKENS, -1, 128).abs().amax(dim=2).clamp(min=1e-4)
    payload = (x.float().view(LEGACY_TOKENS, -1, 128) / (amax / 448).unsqueeze(2)).view_as(x).to(torch.float8_e4m3fn)
    x_fp8 = (payload, (amax / 448).T.contiguous().T)  # column-major scales, as DeepEP's test passes them
    torch.manual_seed(rank)
    scores = torch.randn((LEGACY_TOKENS, LEGACY_EXPERTS), dtype=torch.float32, device="cuda").abs() + 1
    topk_idx = torch.topk(scores, LEGACY_TOPK, dim=-1, largest=True, sorted=False)[1]
    topk_w = torch.ones((LEGACY_TOKENS, LEGACY_TOPK), dtype=torch.float32, device="cuda") * rank
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, LEGACY_EXPERTS)
    for round_ in range(2):
        for fp8 in (False, True):
            for with_topk in (False, True):
                what = f"round {round_} {'FP8' if fp8 else 'BF16'} {'with' if with_topk else 'without'} top-k"
                extra = dict(topk_idx=topk_idx, topk_weights=topk_w) if with_topk else {}
                recv, _, _, _, handle, _ = buf.dispatch(x_fp8 if fp8 else x, num_tokens_per_rank=per_rank,
                                                        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                                                        config=config, **extra)
                torch.cuda.synchronize()
                prefix = handle[0][:, rank].tolist()
                sources = torch.repeat_interleave(torch.arange(ranks, device="cuda"), torch.tensor(
                    [prefix[0]] + [prefix[i] - prefix[i - 1] for i in range(1, ranks)], device="cuda"))
                ok = _legacy_rows_ok(recv, sources, fp8)
                assert bool(ok.all()), _legacy_report(what, ok, sources, recv, fp8, buf)
                if not with_topk:
                    again, *_ = buf.dispatch(x_fp8 if fp8 else x, handle=handle, config=config)
                    torch.cuda.synchronize()
                    ok = _legacy_rows_ok(again, sources, fp8)
                    assert bool(ok.all()), _legacy_report(f"{what}, cached", ok, sources, again, fp8, buf)
                print(f"rank {rank}: legacy shape {what} rows from their sources", flush=True)
    buf.destroy()


if __name__ == "__main__":
    run_suite({"cases": suite_cases, "timeout": suite_timeout, "legacy_shape": suite_legacy_shape})
