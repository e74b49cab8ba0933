"""The ``deep_ep`` facade's low-latency dispatch and combine on H200s, bit for bit against the torch references
(:mod:`gc_moe_compat.testing.ep_reference`), on one rank and on two (issue 6's ``deep_ep`` swap target).

Each test runs ``deep_ep_ll_worker.py`` under torchrun: every payload mode (FP8, power-of-two scales, UE8M0, BF16),
int64 routing with holes (int32 refused by both calls), a rank without tokens, hook and async variants (a call with a
receive hook is two launches per direction, one without: both halves in one kernel), the zero-copy combine (its ``x``
poisoned), DeepEP's handle contents (``src_info`` the source token, ``layout_range``), two dispatches in flight, a
one-launch dispatch inside a hooked one, 200 consecutive calls, cumulative statistics, captured CUDA graphs (each
direction once with a hook, once without) replayed with fresh inputs and then 1000 times bit-identically, (two ranks) a
missing peer ending in ``DeviceTimeoutError`` (raised by the next call: no call waits on the CPU, as with DeepEP)
followed by a working new Buffer, the invalid values only the device sees (ids >= E, < -1, 2**40, a repeated expert,
another combine topk_idx than the dispatch's, a NaN weight: dropped with the rest exact, reported by the next call),
rank masking, the communication partition (``GC_MOE_DEEP_EP_PARTITION=on``; off, the default, everywhere else), and a
round under ``torch.set_default_device('cuda')`` (DeepEP's own test harness sets it; the facade's allocations must name
their device).
"""

from __future__ import annotations

import pytest
from two_rank import MULTI_RANKS, run_ranks

pytestmark = pytest.mark.gpu

WORKER = "deep_ep_ll_worker.py"
TIMEOUT_S = 400


def run_suite(suite: str, nproc: int, *expected: str) -> str:
    return run_ranks(WORKER, nproc, TIMEOUT_S, *expected, args=("--suite", suite))


@pytest.mark.parametrize("nproc", [1, pytest.param(MULTI_RANKS, marks=pytest.mark.multigpu)])
def test_deep_ep_low_latency_modes(nproc: int) -> None:
    out = run_suite("modes", nproc, "mode cases bit-exact", "int32 topk_idx -> low_latency_dispatch -> ValueError",
                    "int32 topk_idx -> low_latency_combine -> ValueError", "routing row slices bit-exact",
                    "two dispatches in flight bit-exact",
                    "a one-launch dispatch inside a hooked one bit-exact", "200 consecutive calls bit-exact",
                    "cumulative_local_expert_recv_stats = reference")
    assert out.count("200 consecutive calls bit-exact") == nproc


@pytest.mark.parametrize("nproc", [1, pytest.param(MULTI_RANKS, marks=pytest.mark.multigpu)])
def test_deep_ep_low_latency_shapes(nproc: int) -> None:
    """Hidden 7168 / top-8 (DeepSeek-V3), 7296 (a partial 256-column chunk) / top-9, 128 / top-12 (the combine's
    path for more than 8 slots) and 8320 / top-6 at 200 tokens (a row in two passes, the routing in two batches), bit
    for bit."""
    out = run_suite("shapes", nproc, "hidden=7168 top-8 bit-exact", "hidden=7296 top-9 bit-exact",
                    "hidden=128 top-12 bit-exact", "hidden=8320 top-6 bit-exact")
    assert out.count("shape cases bit-exact") == nproc


@pytest.mark.parametrize("nproc", [1, pytest.param(MULTI_RANKS, marks=pytest.mark.multigpu)])
@pytest.mark.parametrize(("suite", "hooked"), [("graph", "dispatch"), ("graph_fused", "combine")])
def test_deep_ep_low_latency_cuda_graph(nproc: int, suite: str, hooked: str) -> None:
    """Captured layers: each direction once with a receive hook (two launches) and once without (one launch)."""
    done = f"1000 captured replays bit-identical ({hooked} hooked)"
    out = run_suite(suite, nproc, f"100 graph replays with fresh inputs bit-exact ({hooked} hooked)", done)
    assert out.count(done) == nproc


def test_deep_ep_low_latency_invalid_device_values_dropped_and_reported() -> None:
    run_suite("bad_values", 1, "id >= E dropped", "id < -1 dropped", "id 2**40 dropped",
              "repeated expert dropped and reported", "combine topk_idx other than the dispatch's dropped and reported",
              "NaN weight dropped and reported", "below -1", "repeats an expert", "differs from the dispatch's",
              "not finite")


@pytest.mark.parametrize("nproc", [1, pytest.param(MULTI_RANKS, marks=pytest.mark.multigpu)])
def test_deep_ep_low_latency_rank_masking(nproc: int) -> None:
    """One rank: masking itself; P ranks: the last one masked on the others (then silent: the timeout masks it)."""
    expected = ("masked rank skipped by dispatch and combine, no hang",) if nproc == 1 else (
        f"rank {nproc - 1} masked: dispatch and combine skip it, bit-exact, no hang",
        f"silent unmasked rank {nproc - 1} masked by the timeout")
    out = run_suite("mask", nproc, "shrink mode, nothing masked: bit-exact", *expected)
    if nproc > 1:
        assert out.count(expected[0]) == out.count(expected[1]) == nproc - 1  # every served rank



def test_deep_ep_low_latency_on_the_communication_partition() -> None:
    out = run_suite("partition", 1, "on the communication partition",
                    "GC_MOE_DEEP_EP_PARTITION=off (caller's stream): bit-exact")
    assert out.count("on the communication partition") == 2


@pytest.mark.multigpu
def test_deep_ep_low_latency_missing_peer_times_out() -> None:
    run_suite("timeout", 2, "missing peer -> DeviceTimeoutError", "a new Buffer after the timeout works")


def test_deep_ep_low_latency_out_of_range_expert_is_reported() -> None:
    run_suite("bad_ids", 1, "expert id >= E (synchronous) -> DeviceCheckError", "expert id >= E (async) -> next call",
              "clean calls after the reported errors bit-exact")


def test_deep_ep_low_latency_under_default_device_cuda() -> None:
    run_suite("default_device", 1, "dispatch + combine under torch.set_default_device('cuda') bit-exact")
