"""The ``deep_ep`` facade's normal mode (DeepEP's intranode ``get_dispatch_layout`` / ``dispatch`` / ``combine``) on
H200s, bit for bit against the torch references (:mod:`gc_moe_compat.testing.ep_normal_reference`), on one rank and
on two: every handle tensor, BF16 and FP8 payloads (column-major scales), -1 slots, T = 0, a rank without tokens,
every token to one expert, ``expert_alignment``, ``num_worst_tokens``, a cached re-dispatch, bias, async with
``previous_event``, 20 consecutive rounds, a default device of cuda, on the communication green partition and with
the partition off; two ranks: a missing peer ends in ``DeviceTimeoutError`` naming it. In process on one rank:
``get_dispatch_layout`` reports an id outside ``[-1, num_experts)`` (issue 32 item 5: below -1 too) as
``DeviceCheckError`` at the next call (no call waits on the CPU, as with DeepEP), a synchronous one's and an
``async_finish`` one's, and ``Buffer.destroy`` raises one that no call raised.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from two_rank import MULTI_RANKS, run_ranks

from gc_moe_compat.deep_ep import Buffer
from gc_moe_compat.runtime.status import DeviceCheckError
from gc_moe_compat.testing.ep_normal_reference import layout_reference

pytestmark = pytest.mark.gpu

WORKER = "deep_ep_normal_worker.py"
TIMEOUT_S = 400
CASES = ("normal random BF16 bit-exact", "normal random FP8 (column-major scales) bit-exact",
         "normal num_worst_tokens bit-exact", "normal T = 0 on every rank bit-exact",
         "normal under torch.set_default_device('cuda') bit-exact", "20 consecutive normal rounds bit-exact")


@pytest.mark.parametrize("nproc", [1, pytest.param(MULTI_RANKS, marks=pytest.mark.multigpu)])
@pytest.mark.parametrize("partition", ["on", "off"])
def test_deep_ep_normal_cases(nproc: int, partition: str) -> None:
    out = run_ranks(WORKER, nproc, TIMEOUT_S, *CASES, env={"GC_MOE_DEEP_EP_PARTITION": partition},
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


BAD_IDS = {  # id -> what the report names (observed / expected of the layout kernel's record)
    -5: r"a topk_idx entry below -1 \(observed: its negation\).*observed 5, expected 1",
    -(2**31): r"a topk_idx entry below -1 .*observed 2147483648, expected 1",
    8: r"a topk_idx entry \(observed\) >= num_experts \(expected\).*observed 8, expected 8",
}


@pytest.mark.parametrize("bad", sorted(BAD_IDS))
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
@pytest.mark.parametrize("partition", ["on", "off"])
def test_layout_reports_ids_outside_the_experts(group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch,
                                                bad: int, dtype: torch.dtype, partition: str) -> None:
    """One id outside [-1, E) (token 3, slot 1) among valid ones: the synchronous get_dispatch_layout returns
    without waiting, the layout with that slot unused (the torch reference's), and the next call raises
    DeviceCheckError naming the kernel, the site and the value as recorded by an earlier call; so does the call after
    an async_finish one; the call after that runs and equals the reference; an error no call raised is raised by
    Buffer.destroy."""
    monkeypatch.setenv("GC_MOE_DEEP_EP_PARTITION", partition)
    tokens, topk, experts = 16, 4, 8
    buf = Buffer(group, 1 << 22, 0, explicitly_destroy=True)
    g = torch.Generator().manual_seed(32)
    idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)]).to(dtype)
    bad_idx = idx.clone()
    bad_idx[3, 1] = bad
    idx, bad_idx = idx.cuda(), bad_idx.cuda()
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
