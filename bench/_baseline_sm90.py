"""The DeepGEMM baselines of the SM90 benchmarks: one masked-GEMM pipeline with a fused activation, and the composed
expert-parallel layer (torch.distributed all-to-all + that pipeline) of bench/operator_sm90.py.

* :class:`DeepGemmMasked` (home: :mod:`gc_moe_compat.ab.masked_gemm`, shared with gc-moe-ab's composed DeepEP +
  DeepGEMM operator): DeepGEMM's masked W1 -> one fused Triton SwiGLU + routing weight + 1x128 FP8 requant kernel
  (:func:`swiglu_quant_masked`) -> masked W2 on FP8 weights with FP32 128x128 block scales, the path SGLang's
  DeepEP low-latency MoE runs on Hopper.
* :class:`ComposedBaseline`: one rank of the expert-parallel layer: pack the rank's (token, slot) rows (FP8 payload,
  FP32 scales, routing weight: one int32-word row each), ``all_to_all_single`` (NCCL, graph-capturable), unpack into
  DeepGEMM's masked layout, :class:`DeepGemmMasked`, gather the BF16 partials back in arrival order,
  ``all_to_all_single`` back, combine each token's valid slots in slot order in FP32 (BF16 out). Four small Triton
  kernels besides the GEMMs and the activation. The split sizes and row permutations of the fixed routing are
  planned on the host before capture (:func:`plan_all_to_all`): this favours the baseline (a real layer exchanges
  counts on the device first, or sizes every expert for the worst case as DeepEP does).

Host planning (:func:`masked_geometry`, :func:`plan_all_to_all`, :func:`row_words`) is pure torch on the CPU and
tested in tests/tools/test_bench_operator.py; Triton is imported only when a kernel is first used.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace

import torch

from gc_moe_compat.ab.masked_gemm import AMAX_FLOOR, E4M3_MAX, DeepGemmMasked, next_pow2, swiglu_quant_masked
from gc_moe_compat.testing.reference import ExpertWeights

__all__ = ["AMAX_FLOOR", "E4M3_MAX", "A2APlan", "AllToAllExchange", "ComposedBaseline", "DeepGemmMasked",
           "combine_slots", "gather_rows", "import_deep_gemm", "masked_geometry", "pack_rows", "plan_all_to_all",
           "row_words", "swiglu_quant_masked", "unpack_rows"]

MASKED_ROW_ALIGN = 128
"""DeepGEMM masked layout: rows per expert (``max_m``) rounded up to this (and at least this)."""
ROW_ALIGN_WORDS = 4
"""Packed dispatch rows are padded to 16 bytes."""

def import_deep_gemm() -> ModuleType:
    """The real DeepGEMM, never this library's facade (which ``GC_MOE_SWAP=deep_gemm`` would put under the name
    ``deep_gemm``); raises ImportError saying why it cannot be had."""
    import deep_gemm

    if not deep_gemm.__name__.startswith("gc_moe_compat"):
        return deep_gemm
    from gc_moe_compat import originals

    return originals.load("deep_gemm")


# --------------------------------------------------------------------------------------------------- host planning
def masked_geometry(counts: torch.Tensor) -> tuple[int, int]:
    """``(max_m, expected_m)`` of DeepGEMM's masked layout for per-expert row ``counts``: ``max_m`` the largest count
    rounded up to :data:`MASKED_ROW_ALIGN` (at least that), ``expected_m`` the mean rows of an active expert (>= 1),
    the hint DeepGEMM's heuristics take."""
    counts = counts.to(torch.int64)
    if counts.dim() != 1 or (counts.numel() and int(counts.min()) < 0):
        raise ValueError(f"counts: must be a 1-D tensor of non-negative row counts, got {counts!r:.80}")
    top = int(counts.max()) if counts.numel() else 0
    max_m = max(MASKED_ROW_ALIGN, math.ceil(top / MASKED_ROW_ALIGN) * MASKED_ROW_ALIGN)
    active = max(1, int((counts > 0).sum()))
    return max_m, max(1, math.ceil(int(counts.sum()) / active))


def row_words(hidden: int) -> int:
    """int32 words of one packed dispatch row: ``H`` FP8 bytes, ``H/128`` FP32 scales, one FP32 routing weight,
    padded to 16 bytes."""
    if hidden <= 0 or hidden % 128:
        raise ValueError(f"hidden: must be a positive multiple of 128, got {hidden}")
    words = hidden // 4 + hidden // 128 + 1
    return -(-words // ROW_ALIGN_WORDS) * ROW_ALIGN_WORDS


@dataclass(frozen=True)
class A2APlan:
    """One rank's all-to-all plan for a fixed routing (every tensor on the CPU).

    Send rows are this rank's valid (token, slot) pairs ordered by destination rank, then local expert, then token,
    then slot; ``input_splits[d]`` of them go to rank ``d``. Received rows arrive source rank by source rank
    (``output_splits[s]`` from rank ``s``), each block in its sender's order; ``recv_dest[i]`` is the flat row
    ``local_expert * max_m + position`` of received row ``i`` in the masked layout, positions following (source
    rank, token, slot) order (:func:`gc_moe_compat.testing.reference.dispatch_plan`'s). The combine exchange sends
    the partials back with the splits swapped, so they return in send order: ``combine_index[t, s]`` is the send row
    of (token t, slot s), -1 for an unused slot.
    """

    rank: int
    num_ranks: int
    num_local_experts: int
    send_token: torch.Tensor
    send_slot: torch.Tensor
    input_splits: list[int]
    output_splits: list[int]
    recv_dest: torch.Tensor
    masked_m: torch.Tensor
    max_m: int
    expected_m: int
    combine_index: torch.Tensor

    @property
    def rows_sent(self) -> int:
        return int(self.send_token.numel())

    @property
    def rows_received(self) -> int:
        return int(self.recv_dest.numel())

    @property
    def active_experts(self) -> int:
        return int((self.masked_m > 0).sum())


def _send_order(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(token, slot, global expert)`` of the valid slots of ``idx [T, k]``, sorted by expert (stable: token, slot
    order within an expert), i.e. by destination rank then local expert."""
    ts = (idx >= 0).nonzero()
    experts = idx[ts[:, 0], ts[:, 1]]
    order = torch.sort(experts, stable=True).indices
    return ts[order, 0], ts[order, 1], experts[order]


def plan_all_to_all(topk_idx_per_rank: Sequence[torch.Tensor], num_experts: int, rank: int) -> A2APlan:
    """Rank ``rank``'s :class:`A2APlan` given every rank's routing ``[T_r, k]`` (global ids in ``[-1, E)``)."""
    num_ranks = len(topk_idx_per_rank)
    if num_ranks < 1 or not 0 <= rank < num_ranks:
        raise ValueError(f"rank: must lie in [0, {num_ranks}) for {num_ranks} routings, got {rank}")
    if num_experts < 1 or num_experts % num_ranks:
        raise ValueError(f"num_experts: must be a positive multiple of the rank count {num_ranks}, got {num_experts}")
    local = num_experts // num_ranks
    idxs = [i.detach().to("cpu", torch.int64) for i in topk_idx_per_rank]
    topk = idxs[0].shape[1] if idxs[0].dim() == 2 else -1
    for r, idx in enumerate(idxs):
        if idx.dim() != 2 or idx.shape[1] != topk:
            raise ValueError(f"topk_idx_per_rank[{r}]: must be [T, {topk}], got {tuple(idx.shape)}")
        if idx.numel() and (int(idx.min()) < -1 or int(idx.max()) >= num_experts):
            raise ValueError(f"topk_idx_per_rank[{r}]: ids must lie in [-1, {num_experts}), got "
                             f"[{int(idx.min())}, {int(idx.max())}]")
    orders = [_send_order(idx) for idx in idxs]

    token, slot, experts = orders[rank]
    input_splits = torch.bincount(experts // local, minlength=num_ranks).tolist()
    combine_index = torch.full(tuple(idxs[rank].shape), -1, dtype=torch.int64)
    combine_index[token, slot] = torch.arange(token.numel())

    recv_local = []
    for _, _, ex in orders:  # source ranks in order; each block in its sender's order
        recv_local.append(ex[ex // local == rank] - rank * local)
    recv_local = torch.cat(recv_local)
    output_splits = [int(((ex // local) == rank).sum()) for _, _, ex in orders]
    masked_m = torch.bincount(recv_local, minlength=local)
    max_m, expected_m = masked_geometry(masked_m)
    # position of each received row among its expert's rows, in arrival order
    order = torch.sort(recv_local, stable=True).indices
    starts = torch.cumsum(masked_m, 0) - masked_m
    pos = torch.empty_like(recv_local)
    pos[order] = torch.arange(recv_local.numel()) - starts[recv_local[order]]
    return A2APlan(rank=rank, num_ranks=num_ranks, num_local_experts=local, send_token=token.to(torch.int32),
                   send_slot=slot.to(torch.int32), input_splits=input_splits, output_splits=output_splits,
                   recv_dest=recv_local * max_m + pos, masked_m=masked_m.to(torch.int32), max_m=max_m,
                   expected_m=expected_m, combine_index=combine_index)


# --------------------------------------------------------------------------------------------------- Triton kernels
_KERNELS: SimpleNamespace | None = None


def kernels() -> SimpleNamespace:
    """The exchange's Triton kernels, defined on first use (Triton is imported here, not at module import)."""
    global _KERNELS
    if _KERNELS is not None:
        return _KERNELS
    import triton
    import triton.language as tl

    @triton.jit
    def pack_rows(x, sf, w, token, slot, out, xw: tl.constexpr, groups: tl.constexpr, topk: tl.constexpr,
                  row_w: tl.constexpr, bx: tl.constexpr, bg: tl.constexpr):
        # send row i <- x[token] words, sf[token] words, w[token, slot] word (all 32-bit copies)
        i = tl.program_id(0).to(tl.int64)
        t = tl.load(token + i).to(tl.int64)
        s = tl.load(slot + i).to(tl.int64)
        o = tl.arange(0, bx)
        dst = out + i * row_w
        tl.store(dst + o, tl.load(x + t * xw + o, mask=o < xw), mask=o < xw)
        og = tl.arange(0, bg)
        tl.store(dst + xw + og, tl.load(sf + t * groups + og, mask=og < groups), mask=og < groups)
        tl.store(dst + xw + groups, tl.load(w + t * topk + s))

    @triton.jit
    def unpack_rows(recv, dest, x, sf_t, rw, max_m, xw: tl.constexpr, groups: tl.constexpr, row_w: tl.constexpr,
                    bx: tl.constexpr, bg: tl.constexpr):
        # received row i -> masked row d = dest[i]: payload words, MN-major scales sf_t[e, g, pos], routing weight
        i = tl.program_id(0).to(tl.int64)
        d = tl.load(dest + i)
        ex = d // max_m
        pos = d - ex * max_m
        src = recv + i * row_w
        o = tl.arange(0, bx)
        tl.store(x + d * xw + o, tl.load(src + o, mask=o < xw), mask=o < xw)
        og = tl.arange(0, bg)
        tl.store(sf_t + ex * groups * max_m + og * max_m + pos, tl.load(src + xw + og, mask=og < groups),
                 mask=og < groups)
        tl.store(rw + d, tl.load(src + xw + groups))

    @triton.jit
    def gather_rows(src, index, out, words: tl.constexpr, bw: tl.constexpr):
        # out row i <- src row index[i] (32-bit words)
        i = tl.program_id(0).to(tl.int64)
        j = tl.load(index + i)
        o = tl.arange(0, bw)
        tl.store(out + i * words + o, tl.load(src + j * words + o, mask=o < words), mask=o < words)

    @triton.jit
    def combine(rows, index, y, hidden: tl.constexpr, topk: tl.constexpr, block: tl.constexpr):
        # y[t] = sum over slots s (in order) of rows[index[t, s]] (skipped where -1), FP32, BF16 out
        t = tl.program_id(0).to(tl.int64)
        o = tl.program_id(1) * block + tl.arange(0, block)
        m = o < hidden
        acc = tl.zeros([block], dtype=tl.float32)
        for s in tl.static_range(topk):
            j = tl.load(index + t * topk + s)
            # a [block] bool mask: Triton 3.9's interpreter refuses a block mask & a scalar condition as a load mask
            valid = m & (tl.zeros([block], dtype=tl.int64) + j >= 0)
            acc += tl.load(rows + j * hidden + o, mask=valid, other=0.0).to(tl.float32)
        tl.store(y + t * hidden + o, acc.to(tl.bfloat16), mask=m)

    _KERNELS = SimpleNamespace(pack_rows=pack_rows, unpack_rows=unpack_rows,
                               gather_rows=gather_rows, combine=combine)
    return _KERNELS


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t`` reinterpreted as int32 words along its last dimension (contiguous rows of 4-byte multiples)."""
    return t.view(torch.int32)


def pack_rows(x: torch.Tensor, x_sf: torch.Tensor, weights: torch.Tensor, token: torch.Tensor, slot: torch.Tensor,
              out: torch.Tensor) -> None:
    """``out [S, row_words(H)]`` int32 <- per send row: ``x[token]`` (E4M3), ``x_sf[token]`` (FP32),
    ``weights[token, slot]`` (FP32)."""
    if token.numel() == 0:
        return
    h, g, k = x.shape[1], x_sf.shape[1], weights.shape[1]
    xw = h // 4
    kernels().pack_rows[(token.numel(),)](_words(x), _words(x_sf), _words(weights), token, slot, out, xw=xw,
                                          groups=g, topk=k, row_w=out.shape[1], bx=next_pow2(xw), bg=next_pow2(g),
                                          num_warps=4)


def unpack_rows(recv: torch.Tensor, dest: torch.Tensor, x: torch.Tensor, x_sf_t: torch.Tensor,
                rw: torch.Tensor) -> None:
    """Received rows ``recv [R, row_words(H)]`` into the masked layout: ``x [e, max_m, H]`` E4M3, MN-major scales
    ``x_sf_t [e, H/128, max_m]`` FP32, routing weights ``rw [e, max_m]``, at flat rows ``dest`` (int64)."""
    if dest.numel() == 0:
        return
    e, max_m, h = x.shape
    xw, g = h // 4, h // 128
    kernels().unpack_rows[(dest.numel(),)](recv, dest, _words(x), _words(x_sf_t), _words(rw), max_m, xw=xw,
                                           groups=g, row_w=recv.shape[1], bx=next_pow2(xw), bg=next_pow2(g),
                                           num_warps=4)


def gather_rows(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    """``out[i] = src[index[i]]`` for 2-D tensors of whole 32-bit words per row (``index`` int64)."""
    if index.numel() == 0:
        return
    words = _words(out).shape[1]
    kernels().gather_rows[(index.numel(),)](_words(src), index, _words(out), words=words, bw=next_pow2(words),
                                            num_warps=4)


def combine_slots(rows: torch.Tensor, index: torch.Tensor, y: torch.Tensor, block: int = 1024) -> None:
    """``y[t] = sum_s rows[index[t, s]]`` (slot order, FP32, skipping -1) as BF16; ``rows [S, H]`` BF16."""
    t, k = index.shape
    if t == 0:
        return
    h = y.shape[1]
    kernels().combine[(t, -(-h // block))](rows, index, y, hidden=h, topk=k, block=block, num_warps=4)


# ------------------------------------------------------------------------------------------- composed EP baseline
class AllToAllExchange:
    """The composed layer's exchange for one rank's fixed routing (``plan``): :meth:`dispatch` packs the (token, slot)
    rows, sends them with ``all_to_all_single`` and unpacks them into a masked layout; :meth:`combine` gathers the
    experts' BF16 rows back in arrival order, returns them with ``all_to_all_single`` and sums each token's slots.
    Static buffers, so a CUDA graph may capture both."""

    def __init__(self, group: object, plan: A2APlan, hidden: int, device: torch.device) -> None:
        import torch.distributed as dist

        self.dist, self.group, self.plan, self.hidden = dist, group, plan, hidden
        words = row_words(hidden)
        self.send = torch.zeros(plan.rows_sent, words, dtype=torch.int32, device=device)
        self.recv = torch.zeros(plan.rows_received, words, dtype=torch.int32, device=device)
        self.back_send = torch.zeros(plan.rows_received, hidden, dtype=torch.bfloat16, device=device)
        self.back_recv = torch.zeros(plan.rows_sent, hidden, dtype=torch.bfloat16, device=device)
        self.y = torch.zeros(plan.combine_index.shape[0], hidden, dtype=torch.bfloat16, device=device)
        self.send_token = plan.send_token.to(device)
        self.send_slot = plan.send_slot.to(device)
        self.recv_dest = plan.recv_dest.to(device)
        self.combine_index = plan.combine_index.to(device)

    def dispatch(self, x: torch.Tensor, x_sf: torch.Tensor, topk_weights: torch.Tensor, masked_x: torch.Tensor,
                 masked_sf_t: torch.Tensor, masked_rw: torch.Tensor) -> None:
        """This rank's rows into every destination's masked layout (``[e, max_m, H]`` E4M3, MN-major scales
        ``[e, H/128, max_m]``, routing weights ``[e, max_m]``)."""
        p = self.plan
        pack_rows(x, x_sf, topk_weights, self.send_token, self.send_slot, self.send)
        self.dist.all_to_all_single(self.recv, self.send, p.output_splits, p.input_splits, group=self.group)
        unpack_rows(self.recv, self.recv_dest, masked_x, masked_sf_t, masked_rw)

    def combine(self, expert_rows: torch.Tensor) -> torch.Tensor:
        """``y [T, H]`` BF16 from the experts' rows ``[e * max_m, H]`` BF16 of the masked layout."""
        p = self.plan
        gather_rows(expert_rows, self.recv_dest, self.back_send)
        self.dist.all_to_all_single(self.back_recv, self.back_send, p.input_splits, p.output_splits,
                                    group=self.group)
        combine_slots(self.back_recv, self.combine_index, self.y)
        return self.y


class ComposedBaseline:
    """One rank of the composed expert-parallel layer (module docstring): stage inputs with :meth:`stage`, then
    :meth:`run` (capturable after one eager run) writes ``y [T, H]`` BF16."""

    def __init__(self, dg: object, group: object, plan: A2APlan, l1: ExpertWeights, l2: ExpertWeights,
                 clamp: float, alpha: float = 1.0) -> None:
        dev = l1.payload.device
        h = l1.payload.shape[2]
        t, k = plan.combine_index.shape
        self.hidden, self.tokens, self.topk = h, t, k
        self.pipe = DeepGemmMasked(dg, l1, l2, plan.masked_m, plan.max_m, plan.expected_m, clamp, alpha)
        self.exchange = AllToAllExchange(group, plan, h, dev)
        self.x = torch.zeros(t, h, dtype=torch.float8_e4m3fn, device=dev)
        self.x_sf = torch.zeros(t, h // 128, dtype=torch.float32, device=dev)
        self.topk_weights = torch.zeros(t, k, dtype=torch.float32, device=dev)

    def stage(self, x: torch.Tensor, x_sf: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """Copy this rank's inputs (the routing is the plan's) into the static staging tensors."""
        self.x.copy_(x)
        self.x_sf.copy_(x_sf)
        self.topk_weights.copy_(topk_weights)

    def run(self) -> torch.Tensor:
        """Dispatch, the masked pipeline, combine; returns the static ``y``."""
        self.exchange.dispatch(self.x, self.x_sf, self.topk_weights, self.pipe.x, self.pipe.x_sf_t, self.pipe.rw)
        self.pipe.pipeline()
        return self.exchange.combine(self.pipe.d2.view(-1, self.hidden))
