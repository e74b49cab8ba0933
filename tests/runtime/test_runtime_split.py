"""Partition arithmetic and validation (no GPU needed): gc_moe_compat.runtime.split."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gc_moe_compat.runtime.split import (
    PartitionError,
    dispatch_request,
    plan_split,
    validate_split,
)


@pytest.mark.parametrize(
    ("total", "alignment", "minimum", "wanted", "dispatch", "compute"),
    [
        (132, 8, 8, 16, 20, 112),  # docs/platform_notes.md: request 16 on an H200 gives 20 / 112
        (132, 8, 8, 4, 4, 128),  # the paper's SM90 default request
        (132, 8, 8, 20, 20, 112),
        (148, 8, 8, 20, 20, 128),  # B300 in the paper
        (78, 2, 2, 8, 8, 70),
    ],
)
def test_plan_split_matches_driver_recipe(total, alignment, minimum, wanted, dispatch, compute):
    plan = plan_split(total, alignment, minimum, wanted)
    assert (plan.total_sms, plan.dispatch_sms, plan.compute_sms) == (total, dispatch, compute)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((132, 8, 8, 1), "request must be >= 2"),
        ((132, 8, 8, 132), "leaves no compute SMs"),
        ((132, 8, 8, 101), ">= 32 SMs"),
        ((67, 1, 1, 2), "even SM count"),
        ((132, 8, 64, 76), "minimum partition"),
        ((132, 0, 8, 4), "must be positive"),
    ],
)
def test_plan_split_rejects(args, message):
    with pytest.raises(PartitionError, match=message):
        plan_split(*args)


@pytest.mark.parametrize(
    ("split", "message"),
    [
        ((132, 1, 131), "even"),
        ((132, 102, 30), ">= 32"),
        ((132, 1, 130), "dispatch partition needs >= 2"),
        ((132, 20, 110), "cover the device"),
    ],
)
def test_validate_split_rejects(split, message):
    with pytest.raises(PartitionError, match=message):
        validate_split(*split)


@given(
    total=st.integers(34, 400),
    alignment=st.sampled_from([1, 2, 4, 8, 16]),
    request=st.integers(2, 200),
)
def test_plan_split_invariants(total, alignment, request):
    try:
        plan = plan_split(total, alignment, alignment, request)
    except PartitionError:
        return
    assert plan.dispatch_sms + plan.compute_sms == total
    assert plan.compute_sms % alignment == 0
    assert request <= plan.dispatch_sms < request + alignment
    assert plan.compute_sms >= 32 and plan.compute_sms % 2 == 0


def test_dispatch_request_precedence(monkeypatch):
    monkeypatch.delenv("GC_MOE_DISPATCH_SMS", raising=False)
    monkeypatch.delenv("GC_MOE_SM90_DISPATCH_SMS", raising=False)
    assert dispatch_request() == 4
    monkeypatch.setenv("GC_MOE_SM90_DISPATCH_SMS", "12")
    assert dispatch_request() == 12
    monkeypatch.setenv("GC_MOE_DISPATCH_SMS", "16")
    assert dispatch_request() == 16
    assert dispatch_request(8) == 8


def test_dispatch_request_rejects_garbage(monkeypatch):
    monkeypatch.setenv("GC_MOE_DISPATCH_SMS", "lots")
    with pytest.raises(PartitionError, match="GC_MOE_DISPATCH_SMS must be an integer"):
        dispatch_request()


@pytest.mark.parametrize(("env", "want"), [(None, "off"), ("", "off"), (" on ", "on"), ("off", "off")])
def test_deep_ep_partition_mode_is_off_unless_asked(monkeypatch: pytest.MonkeyPatch, env: str | None,
                                                    want: str) -> None:
    """The deep_ep facade's kernels default to the caller's stream (measured faster on an H200), whatever the
    operator's GC_MOE_PARTITION says; GC_MOE_DEEP_EP_PARTITION=on puts them on the communication partition."""
    from gc_moe_compat.runtime.split import deep_ep_partition_mode

    monkeypatch.setenv("GC_MOE_PARTITION", "on")
    if env is None:
        monkeypatch.delenv("GC_MOE_DEEP_EP_PARTITION", raising=False)
    else:
        monkeypatch.setenv("GC_MOE_DEEP_EP_PARTITION", env)
    assert deep_ep_partition_mode() == want
    monkeypatch.setenv("GC_MOE_DEEP_EP_PARTITION", "yes")
    with pytest.raises(ValueError, match="GC_MOE_DEEP_EP_PARTITION: must be one of \\('on', 'off'\\).*'yes'"):
        deep_ep_partition_mode()


def test_deep_ep_mode_is_off_where_ranks_share_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from gc_moe_compat.runtime.colocation import Placement, deep_ep_mode_of

    monkeypatch.setenv("GC_MOE_DEEP_EP_PARTITION", "on")
    assert deep_ep_mode_of(Placement(rank=0, device_uuids=("GPU-0", "GPU-1"))) == "on"
    assert deep_ep_mode_of(None) == "on"
    assert deep_ep_mode_of(Placement(rank=1, device_uuids=("GPU-0", "GPU-0"))) == "off"
