"""Worker of tests/facades/test_deep_ep_ll.py: the ``deep_ep`` facade's low-latency dispatch and combine on 1 or 2 ranks
against the torch references of :mod:`gc_moe_compat.testing.ep_reference`, bit for bit. Every rank draws every rank's
inputs from one seed (so each can build the reference of the whole group) and checks its own outputs: ``recv_count``,
every valid ``recv_x`` row (FP8 bytes and scales, UE8M0 bytes, or BF16), the cumulative statistics, and the combine
(outputs poisoned with NaN first, expert-output rows past ``recv_count`` poisoned with NaN so a read of them shows).
Suites: ``modes`` (FP8 / power-of-two / UE8M0 / BF16 payloads, int64 routing with int32 refused by both calls, holes, a
rank with no tokens, hook and async variants, two dispatches in flight, a one-launch dispatch inside a hooked one, 200
calls with fresh inputs), ``shapes`` (other hidden sizes and top-k, SHAPES), ``graph`` / ``graph_fused`` (dispatch + an
expert stand-in + combine captured once, replayed with fresh inputs; the dispatch or the combine with a receive hook,
the other in one launch) and ``timeout`` (rank 1 stays away; rank 0's next call gets DeviceTimeoutError; a new Buffer
then works on both ranks), ``bad_ids`` (an expert id >= num_experts: DeviceCheckError from the call after a synchronous
one and from the call after an asynchronous one), ``default_device`` (a Buffer, a dispatch and a combine under
``torch.set_default_device('cuda')``, as DeepEP's own test harness runs them).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from two_rank import MISSING_PEER_TIMEOUT_MS, raises, run_suite, spin_timeout

import gc_moe_compat.deep_ep as deep_ep
from gc_moe_compat.runtime.status import DeviceCheckError, DeviceTimeoutError
from gc_moe_compat.testing.ep_reference import combine_reference, ll_quantize, receive_plan


@dataclass(frozen=True)
class Shape:
    """A low-latency call shape: ``num_max_dispatch_tokens_per_rank``, hidden, top-k and experts per rank."""

    tmax: int = 24
    hidden: int = 1024
    topk: int = 4
    experts_per_rank: int = 8

    def experts(self, ranks: int) -> int:
        return self.experts_per_rank * ranks


SHAPE = Shape()
"""The shape of every suite but ``shapes``."""
TMAX, HIDDEN, TOPK = SHAPE.tmax, SHAPE.hidden, SHAPE.topk
SHAPES = (Shape(24, 7168, 8, 32), Shape(16, 7296, 9, 16), Shape(8, 128, 12, 16), Shape(200, 8320, 6, 8))
"""The ``shapes`` suite's: DeepSeek-V3's hidden and top-k; 57 x 128 columns (a partial 256-column chunk in the
combine) with top-9; one partial chunk with top-12 (the combine's path for more than 8 slots); 65 x 128 columns with
top-6 and 200 tokens (dispatch send's second pass of a row, 16 of its 1040 vectors, and its routing ids in two
batches of 1024 entries, a token straddling the two)."""


def ll_buffer(ranks: int, shape: Shape = SHAPE, **options: int) -> deep_ep.Buffer:
    """A low-latency ``deep_ep.Buffer`` on every rank, sized by the facade's hint for ``shape``."""
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(shape.tmax, shape.hidden, ranks, shape.experts(ranks))
    return deep_ep.Buffer(dist.group.WORLD, 0, hint, low_latency_mode=True, **options)


class Inputs:
    """Every rank's tokens, routing (with -1 holes and repeated experts across tokens) and weights from one seed."""

    def __init__(self, seed: int, ranks: int, tokens: list[int], shape: Shape = SHAPE) -> None:
        gen = torch.Generator().manual_seed(seed)
        experts, k = shape.experts(ranks), shape.topk
        self.shape = shape
        self.x, self.idx, self.w = [], [], []
        for t in tokens:
            self.x.append((torch.randn(t, shape.hidden, generator=gen) * 3).to(torch.bfloat16))
            idx = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(t)]) if t else \
                torch.zeros(0, k, dtype=torch.int64)
            holes = torch.rand(t, k, generator=gen) < 0.15
            self.idx.append(torch.where(holes, -1, idx))
            self.w.append(torch.rand(t, k, generator=gen))
        self.plan = receive_plan(self.idx, experts)


def check_dispatch(rank: int, inp: Inputs, recv, count: torch.Tensor, mode: str, handle: tuple | None = None) -> None:
    """recv_count, every valid row (payload and scales) and, given the handle, DeepEP's src_info (the source token
    of each row) and layout_range (``(first row << 32) | rows`` per source rank)."""
    local = count.shape[0]
    rows = inp.plan.rows[rank]
    assert count.tolist() == [len(r) for r in rows], (count.tolist(), [len(r) for r in rows])
    if handle is not None:
        src_info, layout_range = handle[0].cpu(), handle[1].cpu()
        for le in range(local):
            assert src_info[le, :len(rows[le])].tolist() == [t for _, t, _ in rows[le]], f"src_info of expert {le}"
            sources = [s for s, _, _ in rows[le]]
            want = [sum(s < q for s in sources) << 32 | sources.count(q) for q in range(layout_range.shape[1])]
            assert layout_range[le].tolist() == want, f"layout_range of expert {le}"
    round_scale = mode in ("round", "ue8m0")
    quant = [ll_quantize(x, round_scale) for x in inp.x]
    for le in range(local):
        if not rows[le]:
            continue
        src = [s for s, _, _ in rows[le]]
        tok = [t for _, t, _ in rows[le]]
        n = len(rows[le])
        if mode == "bf16":
            want = torch.stack([inp.x[s][t] for s, t in zip(src, tok, strict=True)])
            got = recv[le, :n].cpu()
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"bf16 rows of expert {le}"
            continue
        payload, scales = recv
        want_q = torch.stack([quant[s][0][t] for s, t in zip(src, tok, strict=True)])
        want_s = torch.stack([quant[s][1][t] for s, t in zip(src, tok, strict=True)])
        got_q = payload[le, :n].cpu()
        bad = got_q.view(torch.uint8) != want_q.view(torch.uint8)
        assert not bad.any(), (f"fp8 rows of expert {le}: {int(bad.sum())} of {bad.numel()} bytes differ, max |diff| "
                               f"{(got_q.float() - want_q.float()).abs().max().item()}")
        if mode == "ue8m0":
            hidden = inp.shape.hidden
            assert scales.dtype == torch.int32 and scales.shape[-1] == hidden // 512
            got_bytes = scales[le, :n].cpu().contiguous().view(torch.uint8).view(n, hidden // 128)
            want_bytes = ((want_s.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
            assert torch.equal(got_bytes, want_bytes), f"ue8m0 scales of expert {le}"
        else:
            assert scales.stride()[-2:] == (1, scales.shape[1]), f"scales must be column-major, got {scales.stride()}"
            assert torch.equal(scales[le, :n].cpu(), want_s), f"scales of expert {le}"


def expert_outputs(ranks: int, count_lists: list[list[int]], seed: int, shape: Shape = SHAPE) -> list[torch.Tensor]:
    """Every rank's stand-in expert output: random BF16 valid rows, NaN past recv_count."""
    gen = torch.Generator().manual_seed(seed)
    outs = []
    for counts in count_lists:
        y = torch.full((len(counts), ranks * shape.tmax, shape.hidden), float("nan"), dtype=torch.bfloat16)
        for le, n in enumerate(counts):
            y[le, :n] = torch.randn(n, shape.hidden, generator=gen).to(torch.bfloat16)
        outs.append(y)
    return outs


def run_once(buf: deep_ep.Buffer, rank: int, ranks: int, seed: int, tokens: list[int], mode: str,
             variant: str, stats: torch.Tensor | None = None, zero_copy: bool = False,
             shape: Shape = SHAPE) -> None:
    inp = Inputs(seed, ranks, tokens, shape)
    x, idx, w = inp.x[rank].cuda(), inp.idx[rank].cuda(), inp.w[rank].cuda()
    hooked, async_ = variant == "hook", variant == "async"
    recv, count, handle, event, hook = buf.low_latency_dispatch(
        x, idx, shape.tmax, shape.experts(ranks), cumulative_local_expert_recv_stats=stats, use_fp8=mode != "bf16",
        round_scale=mode in ("round", "ue8m0"), use_ue8m0=mode == "ue8m0", async_finish=async_,
        return_recv_hook=hooked)
    if hooked:
        assert event.event is None and hook is not None
        hook()
    elif async_:
        event.current_stream_wait()
    torch.cuda.synchronize()
    check_dispatch(rank, inp, recv, count, mode, handle)
    counts = [[len(r) for r in inp.plan.rows[q]] for q in range(ranks)]
    outs = expert_outputs(ranks, counts, seed + 1, shape)
    out = torch.full((tokens[rank], shape.hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    x = outs[rank].cuda()
    if zero_copy:  # the rows go into the workspace; x (still checked, as by DeepEP) is poisoned: it must not be read
        buf.get_next_low_latency_combine_buffer(handle).copy_(x)
        x = torch.full_like(x, float("nan"))
    combined, event, hook = buf.low_latency_combine(x, idx, w, handle, out=out, zero_copy=zero_copy,
                                                    async_finish=async_, return_recv_hook=hooked)
    assert combined.data_ptr() == out.data_ptr()
    if hooked:
        hook()
    elif async_:
        event.current_stream_wait()
    torch.cuda.synchronize()
    want = combine_reference(rank, inp.idx[rank], inp.w[rank], outs, inp.plan)
    assert not combined.isnan().any(), "combine left an element unwritten or read a poisoned row"
    assert torch.equal(combined.cpu().view(torch.int16), want.view(torch.int16)), (
        f"combine differs in {(combined.cpu() != want).sum().item()} elements")


def suite_modes(rank: int, ranks: int) -> None:
    buf = ll_buffer(ranks, num_qps_per_rank=SHAPE.experts(ranks) // ranks)
    full = [TMAX] * ranks
    uneven = [(TMAX, 7)[r % 2] for r in range(ranks)]  # every other rank sends 7 tokens
    idle = [(0, 11)[r % 2] for r in range(ranks)] if ranks > 1 else [0]  # every other rank sends none
    stats = torch.zeros(SHAPE.experts(ranks) // ranks, dtype=torch.int32, device="cuda")
    case = 0
    for mode in ("plain", "round", "ue8m0", "bf16"):
        for variant in ("sync", "hook", "async"):
            for tokens in (full, uneven, idle):
                case += 1
                run_once(buf, rank, ranks, 1000 + case, tokens, mode, variant, zero_copy=case % 2 == 0)
    print(f"rank {rank}: {case} mode cases bit-exact", flush=True)

    # DeepEP's topk_idx_t is int64: int32 routing is refused by both calls on the host (no launch), on the compiled
    # host path's recorded shape too; the int64 calls around them run.
    experts, inp = SHAPE.experts(ranks), Inputs(1100, ranks, full)
    x, idx, w = inp.x[rank].cuda(), inp.idx[rank].cuda(), inp.w[rank].cuda()
    _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, TMAX, experts)
    for _ in range(2):
        with raises(ValueError, rank, "int32 topk_idx -> low_latency_dispatch", "deep_ep.topk_idx_t", "torch.int32"):
            buf.low_latency_dispatch(x, idx.int(), TMAX, experts)
    y = torch.zeros(experts // ranks, ranks * TMAX, SHAPE.hidden, dtype=torch.bfloat16, device="cuda")
    for _ in range(2):
        with raises(ValueError, rank, "int32 topk_idx -> low_latency_combine", "deep_ep.topk_idx_t", "torch.int32"):
            buf.low_latency_combine(y, idx.int(), w, handle)
    buf.low_latency_combine(y, idx, w, handle)
    torch.cuda.synchronize()

    # Routing row slices (the kernels read topk_idx and topk_weights element by element): tensors 8 / 4 bytes past a
    # 16-byte boundary, as a two-batch split of a top-k batch makes, give the aligned tensors' bytes.
    def off_16(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros(t.numel() + 16, dtype=t.dtype, device=t.device)[1:1 + t.numel()].view(t.shape).copy_(t)

    sliced_idx, sliced_w = off_16(idx), off_16(w)
    assert sliced_idx.data_ptr() % 16 and sliced_w.data_ptr() % 16
    y = torch.randn(experts // ranks, ranks * TMAX, SHAPE.hidden, generator=torch.Generator().manual_seed(rank))
    y = y.to(device="cuda", dtype=torch.bfloat16)
    outs = []
    for ids, weights in ((idx, w), (sliced_idx, sliced_w)):
        (recv_x, scales), count, handle, _, _ = buf.low_latency_dispatch(x, ids, TMAX, experts)
        combined, _, _ = buf.low_latency_combine(y, ids, weights, handle)
        torch.cuda.synchronize()
        rows = [(recv_x[e, :n].view(torch.uint8).cpu(), scales[e, :n].cpu()) for e, n in enumerate(count.tolist())]
        outs.append((count.cpu(), rows, combined.view(torch.int16).cpu()))
    (count_a, rows_a, comb_a), (count_b, rows_b, comb_b) = outs
    assert torch.equal(count_a, count_b) and torch.equal(comb_a, comb_b)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(rows_a, rows_b, strict=True))
    print(f"rank {rank}: routing row slices bit-exact", flush=True)

    # Cumulative statistics over calls.
    expected = torch.zeros_like(stats)
    for i in range(3):
        run_once(buf, rank, ranks, 50 + i, full, "plain", "sync", stats=stats)
        inp = Inputs(50 + i, ranks, full)
        expected += torch.tensor([len(r) for r in inp.plan.rows[rank]], dtype=torch.int32, device="cuda")
    assert torch.equal(stats, expected), (stats.tolist(), expected.tolist())
    print(f"rank {rank}: cumulative_local_expert_recv_stats = reference", flush=True)

    # Two dispatches in flight (hooks received in call order, after both sends), then both combines.
    a, b = Inputs(71, ranks, full), Inputs(72, ranks, uneven)
    ra = buf.low_latency_dispatch(a.x[rank].cuda(), a.idx[rank].cuda(), TMAX, SHAPE.experts(ranks),
                                  return_recv_hook=True)
    rb = buf.low_latency_dispatch(b.x[rank].cuda(), b.idx[rank].cuda(), TMAX, SHAPE.experts(ranks),
                                  return_recv_hook=True)
    ra[4]()
    rb[4]()
    torch.cuda.synchronize()
    check_dispatch(rank, a, ra[0], ra[1], "plain")
    check_dispatch(rank, b, rb[0], rb[1], "plain")
    print(f"rank {rank}: two dispatches in flight bit-exact", flush=True)

    # A dispatch in one launch (no hook) between a hooked dispatch's send and its hook: the next generation, served
    # by its own words while the earlier one's receive waits.
    ra = buf.low_latency_dispatch(a.x[rank].cuda(), a.idx[rank].cuda(), TMAX, SHAPE.experts(ranks),
                                  return_recv_hook=True)
    rb = buf.low_latency_dispatch(b.x[rank].cuda(), b.idx[rank].cuda(), TMAX, SHAPE.experts(ranks))
    ra[4]()
    torch.cuda.synchronize()
    check_dispatch(rank, a, ra[0], ra[1], "plain")
    check_dispatch(rank, b, rb[0], rb[1], "plain")
    print(f"rank {rank}: a one-launch dispatch inside a hooked one bit-exact", flush=True)

    # Many calls with fresh inputs: the generation-tagged, parity-buffered words need no reset.
    for i in range(200):
        run_once(buf, rank, ranks, 5000 + i, [TMAX - (i + q) % 5 for q in range(ranks)], "plain",
                 ("sync", "hook", "async")[i % 3])
    print(f"rank {rank}: 200 consecutive calls bit-exact", flush=True)


def suite_shapes(rank: int, ranks: int) -> None:
    """:data:`SHAPES`, each on its own Buffer: FP8 and BF16 payloads (UE8M0 where hidden is a multiple of 512), a
    call in one launch per direction and one with receive hooks (its combine zero-copy), every rank full, then
    uneven."""
    case = 0
    for shape in SHAPES:
        buf = ll_buffer(ranks, shape)
        modes = ("plain", "bf16", *(("ue8m0",) if shape.hidden % 512 == 0 else ()))
        uneven = [(shape.tmax, 5)[r % 2] for r in range(ranks)]
        for mode in modes:
            for variant in ("sync", "hook"):
                for tokens in ([shape.tmax] * ranks, uneven):
                    case += 1
                    run_once(buf, rank, ranks, 3000 + case, tokens, mode, variant,
                             zero_copy=variant == "hook", shape=shape)
        print(f"rank {rank}: shape Tmax={shape.tmax} hidden={shape.hidden} top-{shape.topk} bit-exact", flush=True)
    print(f"rank {rank}: {case} shape cases bit-exact", flush=True)


def suite_graph(rank: int, ranks: int) -> None:
    """The dispatch's two launches (send, then its hook) and the combine's fused launch, captured."""
    graph_replays(rank, ranks, hooked="dispatch")


def suite_graph_fused(rank: int, ranks: int) -> None:
    """The dispatch's fused launch and the combine's two launches (send, then its hook), captured."""
    graph_replays(rank, ranks, hooked="combine")


def graph_replays(rank: int, ranks: int, hooked: str) -> None:
    """A layer (dispatch, an expert stand-in, combine; the ``hooked`` direction with a receive hook, the other in
    one launch) captured once, replayed with fresh inputs against the references, then 1000 times bit-identically."""
    buf = ll_buffer(ranks)
    tokens = [TMAX - 3 * q for q in range(ranks)]
    static = Inputs(1, ranks, tokens)
    x, idx, w = static.x[rank].cuda(), static.idx[rank].cuda(), static.w[rank].cuda()

    def layer() -> torch.Tensor:
        recv, _, handle, _, hook = buf.low_latency_dispatch(x, idx, TMAX, SHAPE.experts(ranks), use_fp8=False,
                                                            return_recv_hook=hooked == "dispatch")
        if hook is not None:
            hook()
        combined, _, hook = buf.low_latency_combine(recv * 2, idx, w, handle, return_recv_hook=hooked == "combine")
        if hook is not None:
            hook()
        return combined

    layer()  # eager warm-up (kernel loads)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer()
    for replay in range(100):
        fresh = Inputs(100 + replay, ranks, tokens)
        x.copy_(fresh.x[rank])
        idx.copy_(fresh.idx[rank])
        w.copy_(fresh.w[rank])
        graph.replay()
        if replay % 10 == 9:  # the last replay included: its reference is the one the 1000 replays below use
            torch.cuda.synchronize()
            outs = []
            for q in range(ranks):
                y = torch.zeros(SHAPE.experts(ranks) // ranks, ranks * TMAX, HIDDEN, dtype=torch.bfloat16)
                for le, rows in enumerate(fresh.plan.rows[q]):
                    for i, (s, t, _) in enumerate(rows):
                        y[le, i] = fresh.x[s][t].float() * 2
                outs.append(y)
            want = combine_reference(rank, fresh.idx[rank], fresh.w[rank], outs, fresh.plan)
            assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16)), f"graph replay {replay}"
    print(f"rank {rank}: 100 graph replays with fresh inputs bit-exact ({hooked} hooked)", flush=True)
    # 1000 more replays of the last inputs: every output bit-identical to the reference (compared on the device).
    want = want.cuda().view(torch.int16)
    differing = torch.zeros((), dtype=torch.int64, device="cuda")
    for _ in range(1000):
        out.fill_(float("nan"))  # a replay that wrote nothing would show
        graph.replay()
        differing += (out.view(torch.int16) != want).sum()
    assert differing.item() == 0, f"{differing.item()} elements differ over 1000 replays"
    print(f"rank {rank}: 1000 captured replays bit-identical ({hooked} hooked)", flush=True)


def suite_timeout(rank: int, ranks: int) -> None:
    buf = ll_buffer(ranks)
    inp = Inputs(9, ranks, [TMAX] * ranks)
    if rank == 0:  # the call returns at once (no CPU wait, as with DeepEP); the next one raises the timeout
        with spin_timeout(MISSING_PEER_TIMEOUT_MS):
            buf.low_latency_dispatch(inp.x[0].cuda(), inp.idx[0].cuda(), TMAX, SHAPE.experts(ranks))
        torch.cuda.synchronize()  # until the receive half has timed out
        with raises(DeviceTimeoutError, rank, "missing peer", "rank 1's token counts", "recorded by an earlier call"):
            buf.low_latency_dispatch(inp.x[0].cuda(), inp.idx[0].cuda(), TMAX, SHAPE.experts(ranks))
    dist.barrier()
    fresh = ll_buffer(ranks)
    run_once(fresh, rank, ranks, 10, [TMAX] * ranks, "plain", "sync")
    print(f"rank {rank}: a new Buffer after the timeout works", flush=True)


def suite_bad_ids(rank: int, ranks: int) -> None:
    """An expert id >= num_experts: the error of a synchronous call (which returns without waiting, as DeepEP's) and
    of an asynchronous one is raised by the next call as DeviceCheckError naming it (from the pinned mirror, no
    synchronization); then calls are clean again."""
    experts = SHAPE.experts(ranks)
    buf = ll_buffer(ranks)
    inp = Inputs(21, ranks, [TMAX] * ranks)
    bad = inp.idx[rank].clone()
    bad[3, 1] = experts + 5
    buf.low_latency_dispatch(inp.x[rank].cuda(), bad.cuda(), TMAX, experts)
    torch.cuda.synchronize()
    with raises(DeviceCheckError, rank, "expert id >= E (synchronous)", "num_experts", f"observed {experts + 5}",
                "recorded by an earlier call"):
        buf.low_latency_dispatch(inp.x[rank].cuda(), inp.idx[rank].cuda(), TMAX, experts)
    buf.low_latency_dispatch(inp.x[rank].cuda(), bad.cuda(), TMAX, experts, async_finish=True)
    torch.cuda.synchronize()
    with raises(DeviceCheckError, rank, "expert id >= E (async) -> next call", "recorded by an earlier"):
        buf.low_latency_dispatch(inp.x[rank].cuda(), inp.idx[rank].cuda(), TMAX, experts)
    run_once(buf, rank, ranks, 22, [TMAX] * ranks, "plain", "sync")
    print(f"rank {rank}: clean calls after the reported errors bit-exact", flush=True)


def _kept(idx: list[torch.Tensor], experts: int) -> list[torch.Tensor]:
    """Every rank's routing as the kernels keep it: an entry outside [-1, experts) or repeating an earlier slot's
    expert of its token becomes -1."""
    out = []
    for i in idx:
        kept = i.clone()
        for t, row in enumerate(i.tolist()):
            for k, e in enumerate(row):
                if not -1 <= e < experts or e in row[:k]:
                    kept[t, k] = -1
        out.append(kept)
    return out


def _check_round(buf: deep_ep.Buffer, rank: int, ranks: int, inp: Inputs, want_idx: list[torch.Tensor], idx,
                 combine_idx, weights, expect: str, seed: int, combine_want: torch.Tensor | None = None) -> None:
    """An asynchronous dispatch of ``idx`` and combine of ``combine_idx`` / ``weights``: outputs exact against the
    references of ``want_idx`` (the routing with the dropped slots removed; ``combine_want``: this rank's routing
    the combine sums, if it drops more); the next call raises DeviceCheckError naming ``expect`` (no
    synchronization in between: read from the host mirror), and the call after it is clean."""
    experts = SHAPE.experts(ranks)
    want = Inputs(seed, ranks, [TMAX] * ranks)
    want.idx, want.plan = want_idx, receive_plan([i.long() for i in want_idx], experts)
    recv, count, handle, _, _ = buf.low_latency_dispatch(inp.x[rank].cuda(), idx.cuda(), TMAX, experts,
                                                         async_finish=True)
    torch.cuda.synchronize()
    check_dispatch(rank, want, recv, count, "plain", handle)
    outs = expert_outputs(ranks, [[len(r) for r in want.plan.rows[q]] for q in range(ranks)], seed + 1)
    args = (outs[rank].cuda(), combine_idx.cuda(), weights.cuda(), handle)
    if combine_idx is idx and weights is inp.w[rank]:  # the dispatch's error is raised by this call: repeat it
        with raises(DeviceCheckError, rank, f"{expect} -> next call", expect, "recorded by an earlier"):
            buf.low_latency_combine(*args)
        combined, _, _ = buf.low_latency_combine(*args, async_finish=True)
    else:
        combined, _, _ = buf.low_latency_combine(*args, async_finish=True)
        torch.cuda.synchronize()
        with raises(DeviceCheckError, rank, f"{expect} -> next call", expect, "recorded by an earlier"):
            buf.low_latency_dispatch(inp.x[rank].cuda(), inp.idx[rank].cuda(), TMAX, experts)
    torch.cuda.synchronize()
    summed = want_idx[rank] if combine_want is None else combine_want
    ref = combine_reference(rank, summed.long(), weights, outs, want.plan)
    assert torch.equal(combined.cpu().view(torch.int16), ref.view(torch.int16)), f"{expect}: combine differs"


def suite_bad_values(rank: int, ranks: int) -> None:
    """Every invalid routing value only the device sees (issue 19 item 7) is dropped and reported: ids >= E, < -1
    and 2**40, an expert repeated in a token's slots (dispatch), a combine topk_idx other than the dispatch's and a
    NaN weight (combine); the other slots' rows and sums stay exact."""
    experts = SHAPE.experts(ranks)
    buf = ll_buffer(ranks)
    inp = Inputs(23, ranks, [TMAX] * ranks)
    for name, value, needle in (("id >= E", experts + 3, f"observed {experts + 3}"), ("id < -1", -5, "below -1"),
                                ("id 2**40", 2**40, f"observed {2**40}")):
        bad = [i.clone() for i in inp.idx]
        for i in bad:
            i[5, 2] = value
        _check_round(buf, rank, ranks, inp, _kept(bad, experts), bad[rank], bad[rank], inp.w[rank], needle, 23)
        print(f"rank {rank}: {name} dropped (rows and sums of the rest exact) and reported", flush=True)
    bad = [i.clone() for i in inp.idx]
    for i in bad:
        i[4, 0] = i[4, 1] = 3  # slot 1 repeats slot 0's expert
    _check_round(buf, rank, ranks, inp, _kept(bad, experts), bad[rank], bad[rank], inp.w[rank], "repeats an expert",
                 23)
    print(f"rank {rank}: repeated expert dropped and reported", flush=True)
    other, summed = inp.idx[rank].clone(), inp.idx[rank].clone()
    other[6, 0] = next(e for e in range(experts) if e not in other[6].tolist())  # valid, not repeating its token
    summed[6, 0] = -1  # this rank's combine drops the differing slot
    _check_round(buf, rank, ranks, inp, inp.idx, inp.idx[rank], other, inp.w[rank], "differs from the dispatch's",
                 23, combine_want=summed)
    print(f"rank {rank}: combine topk_idx other than the dispatch's dropped and reported", flush=True)
    weights, summed = inp.w[rank].clone(), inp.idx[rank].clone()
    t, k = (inp.idx[rank] >= 0).nonzero()[0].tolist()
    weights[t, k], summed[t, k] = float("nan"), -1
    _check_round(buf, rank, ranks, inp, inp.idx, inp.idx[rank], inp.idx[rank].clone(), weights, "not finite", 23,
                 combine_want=summed)
    print(f"rank {rank}: NaN weight dropped and reported", flush=True)


def suite_mask(rank: int, ranks: int) -> None:
    """Rank masking (enable_shrink): query/update/clean; with nothing masked the calls are exact; a masked rank is
    neither waited for nor sent to (one rank: masking itself leaves nothing to receive or sum, no hang); P ranks:
    the others with the last rank masked, then with it silent and unmasked (the timeout masks it, no error)."""
    experts = SHAPE.experts(ranks)
    buf = ll_buffer(ranks, enable_shrink=True)
    status = torch.full((ranks,), 7, dtype=torch.int32, device="cuda")
    buf.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0] * ranks, status.tolist()
    run_once(buf, rank, ranks, 61, [TMAX] * ranks, "plain", "sync")
    print(f"rank {rank}: shrink mode, nothing masked: bit-exact", flush=True)
    if ranks == 1:
        inp = Inputs(62, 1, [TMAX])
        buf.low_latency_update_mask_buffer(0, True)
        buf.low_latency_query_mask_buffer(status)
        assert status.tolist() == [1]
        start = time.monotonic()
        recv, count, handle, _, _ = buf.low_latency_dispatch(inp.x[0].cuda(), inp.idx[0].cuda(), TMAX, experts)
        combined, _, _ = buf.low_latency_combine(recv[0].float().to(torch.bfloat16), inp.idx[0].cuda(),
                                                 inp.w[0].cuda(), handle)
        torch.cuda.synchronize()
        assert time.monotonic() - start < 2 and count.tolist() == [0] * experts and not combined.float().any()
        buf.low_latency_clean_mask_buffer()
        run_once(buf, 0, 1, 63, [TMAX], "plain", "sync")
        print(f"rank {rank}: masked rank skipped by dispatch and combine, no hang; clean: bit-exact again", flush=True)
        return
    dist.barrier()
    masked = ranks - 1  # masked on every other rank, and it stays out of the calls
    local = experts // ranks
    tokens = [TMAX] * (ranks - 1) + [0]
    alone = ll_buffer(ranks, enable_shrink=True)
    if rank != masked:
        inp = Inputs(64, ranks, tokens)
        mine = [i.clone() for i in inp.idx]
        for m in mine:  # every served rank's slots of the masked rank's experts are skipped
            m[(m >= masked * local) & (m < (masked + 1) * local)] = -1
        alone.low_latency_update_mask_buffer(masked, True)
        start = time.monotonic()
        want = Inputs(64, ranks, tokens)
        want.idx, want.plan = mine, receive_plan(mine, experts)
        x, idx, w = inp.x[rank].cuda(), inp.idx[rank].cuda(), inp.w[rank].cuda()
        recv, count, handle, _, _ = alone.low_latency_dispatch(x, idx, TMAX, experts)
        torch.cuda.synchronize()
        check_dispatch(rank, want, recv, count, "plain", handle)
        outs = expert_outputs(ranks, [[len(r) for r in want.plan.rows[q]] for q in range(ranks)], 65)
        combined, _, _ = alone.low_latency_combine(outs[rank].cuda(), idx, w, handle)
        torch.cuda.synchronize()
        assert time.monotonic() - start < 2
        ref = combine_reference(rank, mine[rank], inp.w[rank], outs, want.plan)
        assert torch.equal(combined.cpu().view(torch.int16), ref.view(torch.int16))
        print(f"rank {rank}: rank {masked} masked: dispatch and combine skip it, bit-exact, no hang", flush=True)
        silent = ll_buffer(ranks, enable_shrink=True)
        with spin_timeout(MISSING_PEER_TIMEOUT_MS):
            silent.low_latency_dispatch(x, idx, TMAX, experts)
        silent.low_latency_query_mask_buffer(status)
        assert status.tolist() == [0] * (ranks - 1) + [1], status.tolist()
        print(f"rank {rank}: silent unmasked rank {masked} masked by the timeout (shrink mode), no error", flush=True)
    else:
        ll_buffer(ranks, enable_shrink=True)  # the collective creation the served ranks' third Buffer needs
    dist.barrier()


def suite_partition(rank: int, ranks: int) -> None:
    """With GC_MOE_DEEP_EP_PARTITION=on the kernels run on the communication green partition requested by
    Buffer.num_sms (reported by Buffer.low_latency_partition) and a new request makes a new partition; off (the
    default) runs them on the caller's stream; bit-exact in each."""
    total = torch.cuda.get_device_properties(0).multi_processor_count
    os.environ["GC_MOE_DEEP_EP_PARTITION"] = "on"
    buf = ll_buffer(ranks)
    for request in (deep_ep.Buffer.num_sms, 8):
        deep_ep.Buffer.set_num_sms(request)
        report = buf.low_latency_partition
        assert report["partition"] == "on" and report["requested_dispatch_sms"] == request, report
        assert request <= report["dispatch_sms"] < request + 16 and report["dispatch_sms"] + report["compute_sms"] == \
            total, report
        run_once(buf, rank, ranks, 70 + request, [TMAX] * ranks, "plain", "sync")
        print(f"rank {rank}: on the communication partition {report}: bit-exact", flush=True)
    deep_ep.Buffer.set_num_sms(20)
    del os.environ["GC_MOE_DEEP_EP_PARTITION"]
    assert buf.low_latency_partition["partition"] == "off"
    run_once(buf, rank, ranks, 90, [TMAX] * ranks, "plain", "hook")
    print(f"rank {rank}: GC_MOE_DEEP_EP_PARTITION=off (caller's stream): bit-exact", flush=True)


def suite_default_device(rank: int, ranks: int) -> None:
    """DeepEP's test harness calls ``torch.set_default_device('cuda')`` first: a new Buffer, its first dispatch (which
    creates the pinned status mirror) and a combine into a facade-allocated output under it, bit for bit against the
    references. Inputs and references are built (and checked) under torch's own defaults: they are this worker's
    host code, not the facade's."""
    inp = Inputs(31, ranks, [TMAX] * ranks)
    outs = expert_outputs(ranks, [[len(r) for r in inp.plan.rows[q]] for q in range(ranks)], 32)
    want = combine_reference(rank, inp.idx[rank], inp.w[rank], outs, inp.plan)
    torch.set_default_device("cuda")
    try:
        buf = ll_buffer(ranks)
        idx = inp.idx[rank].cuda()
        recv, count, handle, _, _ = buf.low_latency_dispatch(inp.x[rank].cuda(), idx, TMAX, SHAPE.experts(ranks))
        combined, _, _ = buf.low_latency_combine(outs[rank].cuda(), idx, inp.w[rank].cuda(), handle)
        torch.cuda.synchronize()
    finally:
        torch.set_default_device(None)
    check_dispatch(rank, inp, recv, count, "plain")
    assert torch.equal(combined.cpu().view(torch.int16), want.view(torch.int16)), (
        f"combine differs in {(combined.cpu() != want).sum().item()} elements")
    print(f"rank {rank}: dispatch + combine under torch.set_default_device('cuda') bit-exact", flush=True)


if __name__ == "__main__":
    run_suite({"modes": suite_modes, "shapes": suite_shapes, "graph": suite_graph, "graph_fused": suite_graph_fused,
               "timeout": suite_timeout, "bad_ids": suite_bad_ids,
               "bad_values": suite_bad_values, "mask": suite_mask, "partition": suite_partition,
               "default_device": suite_default_device})
