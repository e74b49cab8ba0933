"""Shared helpers of role3's GPU tests: routing and partials, a workspace staged as role1/role2 leave it, the expected
output (reference combine semantics), the state role3 must leave, and the stand-in kernels
(kernels/testing/finalize_test.cu)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from cuda.bindings import driver

from gc_moe_compat.config import MoEShape
from gc_moe_compat.operator.buffer import GcMoeBuffer
from gc_moe_compat.operator.sm90 import role3_finalize
from gc_moe_compat.references.reference import _combine
from gc_moe_compat.runtime import jit
from gc_moe_compat.runtime.cuda import as_stream, call
from gc_moe_compat.runtime.launch import launch
from gc_moe_compat.runtime.params import ptr

SOURCE = "testing/finalize_test.cu"
STAND_IN_SITES = {1: "replay_seq", 2: "recv_parity", 3: "combine_ready", 4: "finalize_arrive", 5: "recv_counts",
                  6: "send_counts", 7: "pool_header", 8: "l1_full_count", 9: "l1_empty_count", 10: "l2_full_mask",
                  11: "l2_empty_count"}
"""Status sites of ft_stand_in (enum StandInSite): which region role3 left in the wrong state."""
COMBINE_POISON = 0x7FC1
"""BF16 NaN bit pattern filling every combine row role3 must not add (-1 slots, tokens >= T) or must wait for."""
Y_POISON = 0x7FC3
"""BF16 NaN bit pattern filling ``y`` (and its guard row) before a launch."""
OTHER_PARITY = (0x5EED << 32) | 1234
"""Value of ``recv_counts[1 - parity]``: the next replay's half, which role3 must leave untouched."""
RESET_REGIONS = ("send_counts", "pool_header", "l1_full_count", "l1_empty_count", "l2_full_mask", "l2_empty_count")


def module() -> jit.Module:
    """The stand-in kernels, compiled (or taken from the cache) and loaded."""
    return jit.load_module(SOURCE)


@dataclass
class RankData:
    """One rank's tokens: global expert ids (-1 = unused slot) and the partial every slot's expert produces."""

    topk_idx: torch.Tensor  # int64 [T, k]
    partials: torch.Tensor  # bfloat16 [T, k+S, H] (values in -1 slots are never combined)

    @property
    def tokens(self) -> int:
        return self.topk_idx.shape[0]


def make_rank_data(gen: torch.Generator, shape: MoEShape, tokens: int) -> RankData:
    """Random routing (distinct experts per token, ~30% -1 slots, token 1 with none) and partials spanning 2^±24,
    with edge rows: BF16 subnormals (no flush to zero), -0.0, exact cancellation, and an FP32 overflow to inf."""
    e_all, k, h = shape.num_experts, shape.topk, shape.hidden
    idx = torch.rand(tokens, e_all, generator=gen).argsort(dim=1)[:, :k]
    idx[torch.rand(tokens, k, generator=gen) < 0.3] = -1
    if tokens > 1:
        idx[1] = -1
    slots = shape.num_combine_slots
    scale = torch.exp2(torch.randint(-24, 25, (tokens, slots, 1), generator=gen).float())
    partials = torch.randn(tokens, slots, h, generator=gen) * scale
    if tokens > 3:
        partials[2, :, :8] = 2.0**-130 * torch.arange(1, 9)
        partials[2, :, 8:16] = -0.0
        partials[2, 0, 16:24], partials[2, 1:, 16:24] = 3.0, -3.0
        partials[3, :, :8] = 2.0**127
    return RankData(idx, partials.to(torch.bfloat16))


def valid_slots(data: RankData, shape: MoEShape) -> torch.Tensor:
    """bool [T, k+S]: routed slots with an expert id, plus the shared slot k when S = 1."""
    shared = torch.ones(data.tokens, shape.num_shared_experts, dtype=torch.bool)
    return torch.cat([data.topk_idx >= 0, shared], dim=1)


def expected_y(data: RankData, shape: MoEShape) -> torch.Tensor:
    """The reference combine (FP32 sum of the valid BF16 partials in slot order) rounded to BF16."""
    return _combine(data.partials, valid_slots(data, shape)).to(torch.bfloat16)


def recv_counts(datas: list[RankData], dst: int, shape: MoEShape) -> torch.Tensor:
    """int64 [P, e]: rows source rank ``src`` sends to local expert ``le`` of rank ``dst`` (role1's low words)."""
    e = shape.num_local_experts
    experts = torch.arange(dst * e, (dst + 1) * e)
    return torch.stack([(d.topk_idx[..., None] == experts).sum((0, 1)) for d in datas])


def stage_inputs(buffer: GcMoeBuffer, data: RankData) -> None:
    """Caller staging: ``topk_idx[:T]`` (the buffer's index dtype), the rest of ``topk_idx`` set to -1."""
    buffer.topk_idx.fill_(-1)
    buffer.topk_idx[: data.tokens] = data.topk_idx.to(buffer.topk_idx.dtype)


def stage_combine(buffer: GcMoeBuffer, rank: int, data: RankData, shape: MoEShape) -> None:
    """Poisons the whole combine buffer, then writes what this rank's own role2/role4 produce for its own tokens:
    the routed slots whose expert is local and the shared slot (remote slots come from the peers)."""
    combine = buffer.combine
    combine.view(torch.int16).fill_(COMBINE_POISON)
    e = shape.num_local_experts
    own = torch.cat([(data.topk_idx >= 0) & (data.topk_idx // e == rank),
                     torch.ones(data.tokens, shape.num_shared_experts, dtype=torch.bool)], dim=1)
    t, s = own.nonzero(as_tuple=True)
    combine[s.to(combine.device), t.to(combine.device)] = data.partials[t, s].to(combine.device)


def remote_rows(datas: list[RankData], writer: int, shape: MoEShape) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows rank ``writer``'s role2 scatters into OTHER ranks' combine buffers: int32 [n, 4] of (dst rank,
    slot, token, 0) and their BF16 data [n, H]."""
    e = shape.num_local_experts
    rows, data = [], []
    for src, d in enumerate(datas):
        if src == writer:
            continue
        t, s = ((d.topk_idx >= 0) & (d.topk_idx // e == writer)).nonzero(as_tuple=True)
        rows.append(torch.stack([torch.full_like(t, src), s, t, torch.zeros_like(t)], dim=1))
        data.append(d.partials[t, s])
    if not rows:
        return torch.zeros(0, 4, dtype=torch.int32), torch.zeros(0, shape.hidden, dtype=torch.bfloat16)
    return torch.cat(rows).to(torch.int32), torch.cat(data)


def scatter(rows: torch.Tensor, data: torch.Tensor, buffer: GcMoeBuffer, stream: object) -> None:
    """Role2's W2 scatter stand-in on ``stream``: the BF16 ``data`` rows into the peers' combine buffers at ``rows``
    (both from :func:`remote_rows`, already on the device and complete there)."""
    n = rows.shape[0]
    if n == 0:
        return
    args = [buffer.peer_table, ctypes.c_uint64(buffer.offsets.combine), ctypes.c_uint32(buffer.shape.capacity),
            ctypes.c_uint32(buffer.shape.hidden), ptr(rows), ptr(data), ctypes.c_uint32(n)]
    grid = min(132, -(-n * buffer.shape.hidden // 8 // 256))
    launch(module().kernel("ft_scatter_rows"), grid, 256, args, stream)


def warm_up(buffer: GcMoeBuffer, *streams: object) -> None:
    """Launches role3 (warm-up flag: no effect) and the stand-ins once on every stream and waits: lazy module loading
    serializes a kernel's first launch in a context (FACTS.md), which would stall a kernel another one spins for."""
    y = torch.empty(0, buffer.shape.hidden, dtype=torch.bfloat16, device=buffer.storage.device)
    none = ctypes.c_uint64(0)
    for stream in streams:
        launch(role3_finalize.kernel(), 1, role3_finalize.THREADS, role3_finalize.finalize_args(buffer, y, warmup=True),
               stream)
        launch(module().kernel("ft_scatter_rows"), 1, 32, [buffer.peer_table, none, ctypes.c_uint32(0),
                                                          ctypes.c_uint32(8), none, none, ctypes.c_uint32(0)], stream)
        delay(0, stream)
    for stream in streams:
        call(driver.cuStreamSynchronize, as_stream(stream))


def delay(ns: int, stream: object) -> None:
    """Delays the work queued after it on ``stream`` by ``ns`` nanoseconds."""
    launch(module().kernel("ft_delay"), 1, 32, [ctypes.c_uint64(ns)], stream)


def stage_counters(buffer: GcMoeBuffer, counts: torch.Tensor, dispatch_sms: int) -> int:
    """What role1/role2 leave for role3: ``recv_counts[parity]`` packed ``dispatch_sms << 32 | rows``, the other
    half holding :data:`OTHER_PARITY`, and non-zero send counters, pool header and ring signals. Returns the parity."""
    parity = int(buffer.recv_parity.item())
    buffer.recv_counts[parity] = (dispatch_sms << 32) | counts.to(buffer.recv_counts.device)
    buffer.recv_counts[1 - parity] = OTHER_PARITY
    for i, name in enumerate(RESET_REGIONS):
        view = buffer.views[name]
        view.copy_(torch.arange(i + 1, i + 1 + view.numel(), dtype=view.dtype).view(view.shape))
    return parity


def poisoned_y(tokens: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(``y`` [T, H], the full allocation with one guard row after it), every element :data:`Y_POISON`."""
    full = torch.empty(tokens + 1, hidden, dtype=torch.bfloat16, device="cuda")
    full.view(torch.int16).fill_(Y_POISON)
    return full[:tokens], full


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bit-exact equality of two BF16 tensors, naming the first differing element."""
    g, w = got.cpu().view(torch.int16), want.cpu().view(torch.int16)
    bad = (g != w).nonzero()
    assert bad.numel() == 0, (f"{what}: {bad.shape[0]} of {g.numel()} elements differ, first at {bad[0].tolist()}: "
                              f"got {got.cpu()[tuple(bad[0])].item()} want {want.cpu()[tuple(bad[0])].item()}")


def assert_state_after(buffer: GcMoeBuffer, replay: int, parity: int) -> None:
    """What role3 of ``replay`` (recv_parity ``parity`` at its start) must leave: replay_seq and parity advanced,
    the grid arrival counter back at 0, the consumed half and every per-replay region zero, the other half kept."""
    assert int(buffer.replay_seq.item()) == replay + 1
    assert int(buffer.recv_parity.item()) == parity ^ 1
    assert int(buffer.finalize_arrive.item()) == 0
    assert int(buffer.recv_counts[parity].abs().sum()) == 0
    assert bool((buffer.recv_counts[1 - parity] == OTHER_PARITY).all())
    for name in RESET_REGIONS:
        assert int(buffer.views[name].abs().sum()) == 0, name
