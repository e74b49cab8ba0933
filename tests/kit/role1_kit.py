"""Shared helpers of role1's GPU tests: stand-in kernels, routings, staging, poisoning and the exact expected ring.

The oracle is independent of the kernel's arithmetic: :func:`gc_moe_compat.testing.reference.dispatch_plan` (which
rows a rank receives, in which order) and :func:`gc_moe_compat.operator.ring.pool_rows` /
:func:`~gc_moe_compat.operator.ring.pool_table`
(where each row lands), applied to the inputs every rank staged.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from cuda.bindings import driver

from gc_moe_compat.operator.buffer import GcMoeBuffer
from gc_moe_compat.operator.ring import RingPlan, pool_rows, pool_table
from gc_moe_compat.runtime import jit
from gc_moe_compat.runtime.cuda import call
from gc_moe_compat.runtime.green import GreenSide
from gc_moe_compat.runtime.params import ptr
from gc_moe_compat.runtime.status import raise_for_status, spin_timeout_ns
from gc_moe_compat.testing.operator_workload import RankInputs
from gc_moe_compat.testing.reference import dispatch_plan

STANDINS = "testing/dispatch_test.cu"
STANDIN_SITES = {
    1: "stand-in role2 waiting for pool_header",
    2: "stand-in role2 waiting for l1_full_count",
    3: "stand-in role3 receive-count arrival check",
}
ROUTINGS = ("uniform", "zipf", "one_expert", "holes")
POISON = 0xFF  # every ring byte before a run: FP8 NaN payload, NaN scales and weights, source -1


class Capture(ctypes.Structure):
    """Mirror of ``Capture`` in kernels/testing/dispatch_test.cu (six device pointers)."""

    _fields_ = [(name, ctypes.c_uint64) for name in ("acts", "scales", "weights", "source", "full_seen",
                                                      "header_seen")]


@dataclass
class CaptureBuffers:
    """Every pool block generation as the stand-in consumer saw it (``[pool, BM, ...]``)."""

    acts: torch.Tensor
    scales: torch.Tensor
    weights: torch.Tensor
    source: torch.Tensor
    full_seen: torch.Tensor
    header_seen: torch.Tensor

    @classmethod
    def allocate(cls, buffer: GcMoeBuffer, bm: int) -> CaptureBuffers:
        pool, h = buffer.layout.pool_blocks, buffer.shape.hidden
        dev = buffer.storage.device
        return cls(torch.empty(pool, bm, h, dtype=torch.uint8, device=dev),
                   torch.empty(pool, bm, h // 128, dtype=torch.float32, device=dev),
                   torch.empty(pool, bm, dtype=torch.float32, device=dev),
                   torch.empty(pool, bm, 4, dtype=torch.int32, device=dev),
                   torch.empty(pool, dtype=torch.int32, device=dev),
                   torch.empty(1, dtype=torch.int64, device=dev))

    def poison(self) -> None:
        for t in (self.acts, self.scales, self.weights, self.source, self.full_seen, self.header_seen):
            t.view(torch.uint8).fill_(POISON)

    def struct(self) -> Capture:
        return Capture(*(ptr(t).value for t in (self.acts, self.scales, self.weights, self.source, self.full_seen,
                                                self.header_seen)))


def standins() -> jit.Module:
    return jit.load_module(STANDINS)


def u32(v: int) -> ctypes.c_uint32:
    return ctypes.c_uint32(v)


def u64(v: int) -> ctypes.c_uint64:
    return ctypes.c_uint64(v)


def consume_args(buffer: GcMoeBuffer, cap: CaptureBuffers, plan: RingPlan, status: torch.Tensor, *,
                 delay_ns: int = 0, timeout_ms: float = 10_000, warmup: bool = False) -> list[object]:
    """Arguments of ``dt_consume`` (stand-in role2: capture each block generation, release the empties)."""
    return [buffer.peer_table, buffer.offsets, cap.struct(), u32(plan.block_m), u32(plan.ring_blocks),
            u32(buffer.shape.hidden), u32(plan.w1_tasks_per_block), u32(plan.w2_tasks_per_block), u64(delay_ns),
            u64(spin_timeout_ns(timeout_ms)), ptr(status), u32(int(warmup))]


def finalize_args(buffer: GcMoeBuffer, status: torch.Tensor, *, warmup: bool = False) -> list[object]:
    """Arguments of ``dt_finalize`` (stand-in role3: arrival check, resets, parity flip, replay_seq + 1)."""
    s = buffer.shape
    return [buffer.peer_table, buffer.offsets, u32(s.num_experts), u32(s.num_local_experts),
            u32(buffer.dispatch_sms), ptr(status), u32(int(warmup))]


def sync(*sides: GreenSide) -> None:
    for side in sides:
        call(driver.cuStreamSynchronize, side.stream)


def raise_for_standin(status: torch.Tensor, what: str) -> None:
    raise_for_status(status, what, STANDIN_SITES)


# ----------------------------------------------------------------------------------------------------- inputs
def routing(kind: str, tokens: int, topk: int, num_experts: int, gen: torch.Generator) -> torch.Tensor:
    """int64 ``[tokens, topk]`` global expert ids (distinct per token, -1 for unused slots).

    ``uniform``: random distinct experts; ``zipf``: drawn without replacement with weights ``1/(rank+1)^1.5`` over
    a random expert order (a few hot experts get most rows); ``one_expert``: every token's slot 0 goes to one expert
    and the other slots are unused; ``holes``: uniform with about 40 % of the slots unused.
    """
    if tokens == 0:
        return torch.zeros(0, topk, dtype=torch.int64)
    if kind == "zipf":
        order = torch.randperm(num_experts, generator=gen)
        weight = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** 1.5
        picks = torch.multinomial(weight.expand(tokens, -1), topk, replacement=False, generator=gen)
        return order[picks]
    if kind == "one_expert":
        idx = torch.full((tokens, topk), -1, dtype=torch.int64)
        idx[:, 0] = int(torch.randint(num_experts, (1,), generator=gen))
        return idx
    idx = torch.stack([torch.randperm(num_experts, generator=gen)[:topk] for _ in range(tokens)])
    if kind == "holes":
        idx[torch.rand(idx.shape, generator=gen) < 0.4] = -1
    elif kind != "uniform":
        raise ValueError(f"kind: one of {ROUTINGS}, got {kind!r}")
    return idx


def make_inputs(kind: str, tokens: int, buffer: GcMoeBuffer, gen: torch.Generator) -> RankInputs:
    """Random inputs (on the host; the payload as bytes ``[T, H]``, which role1 copies without reading): every byte
    and every float distinct enough that a misplaced row shows."""
    s = buffer.shape
    x = torch.randint(0, 256, (tokens, s.hidden), dtype=torch.uint8, generator=gen)
    x_sf = torch.rand(tokens, s.hidden // 128, generator=gen) + 0.5
    weights = torch.rand(tokens, s.topk, generator=gen)
    return RankInputs(x, x_sf, routing(kind, tokens, s.topk, s.num_experts, gen), weights)


def stage(buffer: GcMoeBuffer, inputs: RankInputs) -> None:
    """Writes ``inputs`` into the buffer's staging views (``[:T]``) and poisons the rest of them."""
    t = inputs.tokens
    for name in ("x", "x_sf", "topk_idx", "topk_weights"):
        buffer.view(name).view(torch.uint8).fill_(POISON)
    buffer.x.view(torch.uint8)[:t] = inputs.x.to(buffer.x.device)
    buffer.x_sf[:t] = inputs.x_sf.to(buffer.x_sf.device)
    buffer.topk_idx[:t] = inputs.topk_idx.to(buffer.topk_idx.device, buffer.topk_idx.dtype)
    buffer.topk_weights[:t] = inputs.topk_weights.to(buffer.topk_weights.device)


def poison_outputs(buffer: GcMoeBuffer) -> None:
    """Fills everything role1 writes for a rank (ring payload, scales, weights, source, block table, src_index)."""
    for name in ("l1_acts", "l1_acts_sf", "l1_routing_weights", "l1_source", "pool_table", "src_index"):
        buffer.view(name).view(torch.uint8).fill_(POISON)


# -------------------------------------------------------------------------------------------------- expectation
@dataclass
class Expected:
    """What rank ``rank`` must hold after role1 for the inputs of every rank."""

    rows: torch.Tensor  # pool_rows: (pool block, generation, ring row, le, src_rank, src_token, slot)
    table: torch.Tensor  # pool_table [n, 3]
    counts: torch.Tensor  # [P, e] rows from src to le
    send: torch.Tensor  # [E] this rank's entries per global expert
    received: list[torch.Tensor]
    x: torch.Tensor  # the payload bytes of every row, in pool order
    x_sf: torch.Tensor
    weights: torch.Tensor

    @property
    def blocks(self) -> int:
        return self.table.shape[0]


def expected(all_inputs: list[RankInputs], rank: int, buffer: GcMoeBuffer, plan: RingPlan) -> Expected:
    s = buffer.shape
    received = dispatch_plan([inp.topk_idx for inp in all_inputs], s.num_experts)[rank]
    rows = pool_rows(received, plan)
    per_expert = torch.tensor([r.shape[0] for r in received], dtype=torch.int32)
    counts = torch.tensor([[int((r[:, 0] == src).sum()) for r in received] for src in range(len(all_inputs))],
                          dtype=torch.int64).reshape(len(all_inputs), s.num_local_experts)
    own = all_inputs[rank].topk_idx.reshape(-1)
    send = torch.bincount(own[own >= 0], minlength=s.num_experts)
    src, tok, slot = rows[:, 4], rows[:, 5], rows[:, 6]
    x = torch.zeros(rows.shape[0], s.hidden, dtype=torch.uint8)
    x_sf = torch.zeros(rows.shape[0], s.hidden // 128)
    w = torch.zeros(rows.shape[0])
    for r, inp in enumerate(all_inputs):
        m = src == r
        x[m], x_sf[m], w[m] = inp.x[tok[m]], inp.x_sf[tok[m]], inp.topk_weights[tok[m], slot[m]]
    return Expected(rows, pool_table(per_expert, plan), counts, send, received, x, x_sf, w)


def _eq(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    got, want = got.cpu(), want.cpu()
    if got.shape != want.shape or not torch.equal(got, want):
        bad = (got != want).nonzero()[:5].tolist() if got.shape == want.shape else "shape"
        raise AssertionError(f"{name}: got {tuple(got.shape)} differs from expected {tuple(want.shape)} at {bad}")


def check_capture(cap: CaptureBuffers, exp: Expected, plan: RingPlan) -> None:
    """Every block generation the stand-in consumer saw holds exactly the expected rows, complete at BM·(g+1)."""
    bm, n = plan.block_m, exp.blocks
    _eq("pool_header seen by role2", cap.header_seen, torch.tensor([(1 << 32) | n]))
    gens = torch.arange(n) // plan.ring_blocks
    _eq("l1_full_count when each generation completed", cap.full_seen[:n], (bm * (gens + 1)).to(torch.int32))
    flat = (exp.rows[:, 0] * bm + exp.rows[:, 2] % bm).to(cap.acts.device)
    _eq("ring payload rows", cap.acts.view(-1, cap.acts.shape[-1])[flat], exp.x)
    _eq("ring scales", cap.scales.view(-1, cap.scales.shape[-1])[flat], exp.x_sf)
    _eq("ring routing weights", cap.weights.view(-1)[flat], exp.weights)
    source = torch.stack([exp.rows[:, 4], exp.rows[:, 5], exp.rows[:, 6], exp.rows[:, 0]], 1).to(torch.int32)
    _eq("ring l1_source", cap.source.view(-1, 4)[flat], source)


def check_ring(buffer: GcMoeBuffer, exp: Expected) -> None:
    """The ring after a run that started poisoned: each ring row holds its last generation's row, every other row
    (padding, unused blocks) is still poison."""
    rows_total = buffer.layout.ring.rows
    ring_row = exp.rows[:, 2]
    last = torch.full((rows_total,), -1, dtype=torch.int64).scatter_reduce(
        0, ring_row, torch.arange(exp.rows.shape[0]), "amax", include_self=True)
    hit = last >= 0
    pick = last[hit]
    h = buffer.shape.hidden
    acts = torch.full((rows_total, h), POISON, dtype=torch.uint8)
    acts[hit] = exp.x[pick]
    _eq("l1_acts", buffer.l1_acts.view(torch.uint8), acts)
    sf = torch.full((h // 128, rows_total), -1, dtype=torch.int32)
    sf[:, hit] = exp.x_sf[pick].t().contiguous().view(torch.int32)
    _eq("l1_acts_sf", buffer.l1_acts_sf.view(torch.int32), sf)
    w = torch.full((rows_total,), -1, dtype=torch.int32)
    w[hit] = exp.weights[pick].view(torch.int32)
    _eq("l1_routing_weights", buffer.l1_routing_weights.view(torch.int32), w)
    src = torch.full((rows_total, 4), -1, dtype=torch.int32)
    src[hit] = torch.stack([exp.rows[pick, 4], exp.rows[pick, 5], exp.rows[pick, 6], exp.rows[pick, 0]],
                           1).to(torch.int32)
    _eq("l1_source", buffer.l1_source, src)
    table = torch.full((buffer.layout.pool_blocks, 3), -1, dtype=torch.int32)
    table[:exp.blocks] = exp.table
    _eq("pool_table", buffer.pool_table, table)


def check_src_index(buffer: GcMoeBuffer, exp: Expected, topk: int) -> None:
    """src_index[le][src] holds src's entries ``token·k + slot`` for ``le`` in ascending order, then poison."""
    want = torch.full(tuple(buffer.src_index.shape), -1, dtype=torch.int32)
    for le, rows in enumerate(exp.received):
        for src in range(want.shape[1]):
            mine = rows[rows[:, 0] == src]
            want[le, src, :mine.shape[0]] = (mine[:, 1] * topk + mine[:, 2]).to(torch.int32)
    _eq("src_index", buffer.src_index, want)


def check_counters(buffer: GcMoeBuffer, exp: Expected, plan: RingPlan, parity: int, replay: int) -> None:
    """Before role3: packed send and receive counts (high word = dispatch CTAs), tag-1 phase, and l1_full_count at
    ``BM·(g+1)`` of each ring block's last generation (0 where no block landed)."""
    d, ranks = buffer.dispatch_sms, buffer.shape.num_ranks
    _eq("send_counts", buffer.send_counts, (d << 32) | exp.send)
    _eq(f"recv_counts[{parity}]", buffer.recv_counts[parity], (d << 32) | exp.counts)
    _eq("tag1_barrier", buffer.tag1_barrier, torch.tensor([ranks * (replay + 1)]))
    full = torch.zeros(buffer.layout.ring.blocks, dtype=torch.int32)
    for q in range(exp.blocks):
        b, g = plan.slot(q)
        full[b] = plan.l1_full_expected(g)
    _eq("l1_full_count", buffer.l1_full_count, full)
