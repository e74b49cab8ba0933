"""Fuzz of the deep_ep calls the other fuzz files leave out (issue 19: every public entry point): normal mode's
``Buffer.combine`` (every argument), the low-latency rank masking (``low_latency_update_mask_buffer`` / ``query`` /
``clean``) and the zero-copy combine's ``get_next_low_latency_combine_buffer``, each against the model of valid
inputs (tests/kit/fuzz_model.py) under both default dtypes. CPU only: the workspaces are host stand-ins
(tests/fuzz/conftest.py). A combine that passes every check stops at its launch's GPU refusal (what a CPU host must
say); the masking calls and the zero-copy rows act on the stand-in's bytes, so their results are checked too. Every
refused call leaves the caller's tensors as they were."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from fuzz_model import (
    NEEDS_GPU,
    Flag,
    Instance,
    Int,
    Items,
    Spec,
    Tensor,
    TensorOrPair,
    check,
    draw,
    expect,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gc_moe_compat.deep_ep import Buffer, Config, EventOverlap
from gc_moe_compat.deep_ep._normal import MAX_TOPK, NormalHandle

if TYPE_CHECKING:
    from conftest import DeepEpHost

FUZZ = settings(max_examples=200, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
NVL_BYTES = 1 << 20
ROWS, T, H, CHANNELS = 5, 6, 256, 4
"""The combine's baseline: a dispatch that received ROWS rows for T tokens of hidden H over CHANNELS channels."""


def _snapshot(*args: object) -> list[tuple[object, torch.Tensor]]:
    """Copies of the host tensors among ``args`` (members of tuples too), to show a call left them unchanged."""
    found: list[tuple[object, torch.Tensor]] = []
    for v in args:
        for t in v if isinstance(v, tuple) else (v,):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                found.append((t, t.clone()))
    return found


def _unchanged(snapshot: list[tuple[object, torch.Tensor]], what: str) -> None:
    for t, before in snapshot:
        assert torch.equal(t, before), f"{what}: a caller's tensor changed"


# ------------------------------------------------------------------------------------------------------------------
# Buffer.combine (normal mode)

HANDLE = Items(NormalHandle, (
    Tensor((torch.int32,), (1, 1)),  # rank_prefix_matrix [P, P]
    Tensor((torch.int32,), (1, CHANNELS)),  # channel_prefix_matrix [P, C]
    Tensor((torch.int32,), (1, CHANNELS)),  # recv_channel_prefix_matrix [P, C]
    Tensor((torch.int32,), (ROWS,)),  # recv_src_idx: one entry per received row (x's rows)
    Tensor((torch.bool,), (T, 1)),  # is_token_in_rank [T, P]
    Tensor((torch.int32,), (T, 1)),  # send_head [T, P]
), make=lambda members: NormalHandle(members, most_sent=ROWS))
"""The handle an uncached dispatch of a one-rank group returns (DeepEP's six tensors), shaped for the baseline."""

COMBINE_SPECS: dict[str, Spec] = {
    "x": Tensor((torch.bfloat16,), (ROWS, None), extra=lambda t: t.shape[1] > 0 and t.shape[1] % 8 == 0),
    "handle": HANDLE,
    "topk_weights": Tensor((torch.float32,), (ROWS, None), extra=lambda t: 1 <= t.shape[1] <= MAX_TOPK,
                           none_ok=True),
    "bias": TensorOrPair(Tensor((torch.bfloat16,), (T, H))),
    "config": Instance(Config, (Config(2 * CHANNELS, 6, 256), Config(2 * CHANNELS, 1, 64), None), none_ok=True),
    "config.num_sms": Int(2, None, multiple=2, extra=lambda n: n == 2 * CHANNELS, draw_max=64),
    "handle.most_sent": Int(0, ROWS),
    "previous_event": Instance(EventOverlap, (EventOverlap(None), None), none_ok=True),
    "async_finish": Flag(),
    "allocate_on_comm_stream": Flag(refused=(True,)),  # DeepEP's rule: needs a previous_event and async_finish
}
"""``config.num_sms`` is a Config's (its own type rule is test_fuzz_deep_ep_calls.py's): the handle's channels times
two. ``handle.most_sent`` is the rows the dispatch's busiest rank sent (what a handle from another Buffer carries):
this Buffer holds ROWS; it cannot hold more than ``NVL_BYTES / (2 H)`` (each row is at least a BF16 row), and the
test draws no count in between (there the layout's header decides)."""
NAMES = {"handle": ("handle", "config.num_sms", "x must be ["), "config.num_sms": ("config.num_sms",),
         "handle.most_sent": ("num_nvl_bytes",), "bias": ("bias",)}


def _combine_case(name: str, value: object) -> tuple[dict[str, object], type[Exception] | None]:
    """The baseline combine with ``name`` replaced by ``value``, and the model's verdict."""
    handle = HANDLE.make(tuple(torch.zeros(r.shape, dtype=r.dtypes[0]) for r in HANDLE.items))
    kwargs: dict[str, object] = {"x": torch.randn(ROWS, H, dtype=torch.float32).to(torch.bfloat16), "handle": handle,
                                 "topk_weights": torch.rand(ROWS, 4, dtype=torch.float32),
                                 "config": Config(2 * CHANNELS, 6, 256)}
    if name == "config.num_sms":
        kwargs["config"] = Config(value, 6, 256)
    elif name == "handle.most_sent":
        kwargs["handle"] = NormalHandle(tuple(handle), most_sent=value)
    else:
        kwargs[name] = value
    want = expect(COMBINE_SPECS[name], value)
    if name == "config" and want is None:  # None: DeepEP's recommended config, whose num_sms is Buffer.num_sms
        want = expect(COMBINE_SPECS["config.num_sms"], (value or Buffer.get_combine_config(1)).num_sms)
    return kwargs, want


@settings(FUZZ, max_examples=300)
@given(case=draw(COMBINE_SPECS, {"config.num_sms": st.one_of(st.just(2 * CHANNELS), st.integers(0, 64)),
                                  "handle.most_sent": st.sampled_from([None, 0, ROWS, NVL_BYTES // (2 * H) + 1,
                                                                       10**9])}))
def test_normal_combine(deep_ep_host: DeepEpHost, default_dtype: torch.dtype, case: tuple[str, object]) -> None:
    """Each argument of a valid combine replaced by a drawn value: refused with the model's exception naming it (and
    the caller's tensors unchanged), or accepted up to the launch's GPU refusal."""
    name, value = case
    buf = deep_ep_host.buffer(NVL_BYTES, 0)
    kwargs, want = _combine_case(name, value)
    if name == "handle.most_sent" and value is None:
        want = None  # a num_worst_tokens dispatch's handle: the device checks the rows
    snapshot = _snapshot(*kwargs.values())
    what = f"combine({name}={value!r:.120})"
    check(lambda: buf.combine(**kwargs), want, NAMES.get(name, (name.split(".")[0],)), boundary=NEEDS_GPU, what=what)
    _unchanged(snapshot, what)


def test_combine_needs_a_normal_mode_buffer(deep_ep_host: DeepEpHost, default_dtype: torch.dtype) -> None:
    """A Buffer without num_nvl_bytes (low-latency only) refuses combine naming num_nvl_bytes; a low-latency
    handle is not a normal-mode one."""
    ll = deep_ep_host.buffer(0, Buffer.get_low_latency_rdma_size_hint(8, H, 1, 8), low_latency_mode=True)
    kwargs, _ = _combine_case("async_finish", False)
    check(lambda: ll.combine(**kwargs), ValueError, ("num_nvl_bytes",), what="combine on a low-latency Buffer")
    x = torch.randn(T, H, dtype=torch.float32).to(torch.bfloat16)
    _, _, ll_handle, _, _ = ll.low_latency_dispatch(x, torch.zeros(T, 1, dtype=torch.int64), 8, 8, use_fp8=False)
    normal = deep_ep_host.buffer(NVL_BYTES, 0)
    check(lambda: normal.combine(**{**kwargs, "handle": ll_handle}), TypeError, ("handle",),
          what="combine(handle=a low-latency handle)")
