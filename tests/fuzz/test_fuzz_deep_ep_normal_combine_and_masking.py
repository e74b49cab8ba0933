"""Fuzz of the deep_ep calls the other fuzz files leave out (issue 19: every public entry point): normal mode's
``Buffer.combine`` (every argument), the low-latency rank masking (``low_latency_update_mask_buffer`` / ``query`` /
``clean``) and the zero-copy combine's ``get_next_low_latency_combine_buffer``, each against the model of valid
inputs (tests/kit/fuzz_model.py) under both default dtypes. CPU only: the workspaces are host stand-ins
(tests/fuzz/conftest.py). A combine that passes every check stops at its launch's GPU refusal (what a CPU host must
say); the masking calls and the zero-copy rows act on the stand-in's bytes, so their results are checked too. Every
refused call leaves the caller's tensors as they were."""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING

import pytest
import torch
from fuzz_model import (
    DTYPES,
    JUNK,
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
    values,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gc_moe_compat.comm.ep_ll import required_bytes
from gc_moe_compat.deep_ep import Buffer, Config, EventOverlap, LowLatencyHandle, _low_latency
from gc_moe_compat.deep_ep._config import C_INT_MAX
from gc_moe_compat.deep_ep._normal import MAX_TOPK, NormalHandle

if TYPE_CHECKING:
    from conftest import DeepEpHost

FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
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
    "topk_weights": Tensor((torch.float32,), (ROWS, None), vectors=False,  # read element by element
                           extra=lambda t: 1 <= t.shape[1] <= MAX_TOPK, none_ok=True),
    "bias": TensorOrPair(Tensor((torch.bfloat16,), (T, H))),
    "config": Instance(Config, (Config(2 * CHANNELS, 6, 256), Config(2 * CHANNELS, 1, 64), None), none_ok=True),
    "config.num_sms": Int(2, None, multiple=2, extra=lambda n: n == 2 * CHANNELS, draw_max=64),
    "handle.most_sent": Int(0, C_INT_MAX),
    "previous_event": Instance(EventOverlap, (EventOverlap(None), None), none_ok=True),
    "async_finish": Flag(),
    "allocate_on_comm_stream": Flag(refused=(True,)),  # DeepEP's rule: needs a previous_event and async_finish
}
"""``config.num_sms`` is a Config's (its own type rule is test_fuzz_deep_ep_calls.py's): the handle's channels times
two. ``handle.most_sent`` is the rows the dispatch's busiest rank sent (what a handle from another Buffer carries),
an int in ``[0, INT_MAX]``: past what the Buffer holds, the combine grows the workspace first, on the GPU (past the
host stand-in's refusal; tests/facades/test_deep_ep_normal_growth.py)."""
NAMES = {"handle": ("handle", "config.num_sms", "x must be ["), "config.num_sms": ("config.num_sms",),
         "handle.most_sent": ("num_nvl_bytes", "handle.most_sent"), "bias": ("bias",)}


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
    if name == "handle.most_sent" and value is None:
        want = None  # a num_worst_tokens dispatch's handle (no CPU wait, so no count): the device checks the rows
    return kwargs, want


@pytest.fixture
def normal_buffer(deep_ep_host: DeepEpHost) -> Buffer:
    """One normal-mode Buffer for every example of a test (a refused or GPU-refused call changes nothing in it)."""
    return deep_ep_host.buffer(NVL_BYTES, 0)


@settings(FUZZ, max_examples=200)
@given(case=draw(COMBINE_SPECS, {"config.num_sms": st.one_of(st.just(2 * CHANNELS), st.integers(0, 64)),
                                  "handle.most_sent": st.one_of(st.sampled_from([None, 0, ROWS, -1,
                                                                                 NVL_BYTES // (2 * H) + 1, 10**9]),
                                                                JUNK)}))
def test_normal_combine(normal_buffer: Buffer, default_dtype: torch.dtype, case: tuple[str, object]) -> None:
    """Each argument of a valid combine replaced by a drawn value: refused with the model's exception naming it (and
    the caller's tensors unchanged), or accepted up to the launch's GPU refusal."""
    name, value = case
    buf = normal_buffer
    kwargs, want = _combine_case(name, value)
    snapshot = _snapshot(*kwargs.values())
    what = f"combine({name}={value!r:.120})"
    check(lambda: buf.combine(**kwargs), want, NAMES.get(name, (name.split(".")[0],)), boundary=NEEDS_GPU, what=what)
    _unchanged(snapshot, what)


@pytest.mark.parametrize(("call", "field", "value", "error", "message"), [
    ("combine", "config.num_sms", "x", TypeError, r"combine: config.num_sms must be an int, got str \('x'\)"),
    ("dispatch", "config.num_sms", "x", TypeError, r"dispatch: config.num_sms must be an int, got str \('x'\)"),
    ("combine", "handle.most_sent", "x", TypeError, r"combine: handle.most_sent .* must be an int, got str \('x'\)"),
    ("combine", "handle.most_sent", -1, ValueError, r"combine: handle.most_sent .* must be in \[0, \d+\], got -1"),
    ("dispatch", "handle.most_sent", "x", TypeError, r"dispatch: handle.most_sent .* must be an int, got str"),
])
def test_fields_set_after_construction_are_named(normal_buffer: Buffer, default_dtype: torch.dtype, call: str,
                                                 field: str, value: object, error: type[Exception],
                                                 message: str) -> None:
    """Issue 32 item 4: a Config's num_sms set after construction and a handle's most_sent (what a handle from
    another Buffer carries) are read by the call: a value of another type or out of range is refused naming the
    field, the rule and the value (not an unnamed comparison error, not a launch), a cached dispatch included."""
    kwargs, _ = _combine_case("async_finish", False)
    if field == "config.num_sms":
        kwargs["config"].num_sms = value
    else:
        kwargs["handle"] = NormalHandle(tuple(kwargs["handle"]), most_sent=value)
    x = torch.zeros(T, H, dtype=torch.bfloat16)
    calls = {"combine": lambda: normal_buffer.combine(**kwargs),
             "dispatch": lambda: normal_buffer.dispatch(x, handle=kwargs["handle"], config=kwargs["config"])}
    with pytest.raises(error, match=message):
        calls[call]()


def test_combine_needs_a_normal_mode_buffer(deep_ep_host: DeepEpHost, default_dtype: torch.dtype) -> None:
    """A Buffer without num_nvl_bytes (low-latency only) refuses combine naming num_nvl_bytes, a destroyed one says
    so; a low-latency handle is not a normal-mode one."""
    ll = deep_ep_host.buffer(0, Buffer.get_low_latency_rdma_size_hint(8, H, 1, 8), low_latency_mode=True)
    kwargs, _ = _combine_case("async_finish", False)
    check(lambda: ll.combine(**kwargs), ValueError, ("num_nvl_bytes",), what="combine on a low-latency Buffer")
    destroyed = deep_ep_host.buffer(NVL_BYTES, 0, explicitly_destroy=True)
    destroyed.destroy()
    check(lambda: destroyed.combine(**kwargs), ValueError, ("destroyed",), what="combine on a destroyed Buffer")
    x = torch.randn(T, H, dtype=torch.float32).to(torch.bfloat16)
    _, _, ll_handle, _, _ = ll.low_latency_dispatch(x, torch.zeros(T, 1, dtype=torch.int64), 8, 8, use_fp8=False)
    normal = deep_ep_host.buffer(NVL_BYTES, 0)
    check(lambda: normal.combine(**{**kwargs, "handle": ll_handle}), TypeError, ("handle",),
          what="combine(handle=a low-latency handle)")


# ------------------------------------------------------------------------------------------------------------------
# Rank masking: low_latency_update_mask_buffer / low_latency_query_mask_buffer / low_latency_clean_mask_buffer

RANKS = 4
MASK_SPECS: dict[str, Spec] = {
    "rank_to_mask": Int(0, RANKS - 1),
    "mask": Flag(),
    "mask_status": Tensor((torch.int32,), (RANKS,), dense=False),  # the [num_ranks] DeepEP documents (drawn)
}


def _distinct(t: torch.Tensor) -> bool:
    """Whether no two elements of ``t`` share a memory location (every index's offset, from its strides)."""
    offsets = {sum(i * s for i, s in zip(index, t.stride(), strict=True))
               for index in itertools.product(*map(range, t.shape))}
    return len(offsets) == t.numel()


def _mask_status_rule(v: object) -> Tensor:
    """DeepEP's rule for ``mask_status`` (csrc/legacy/buffer.hpp: ``numel() == num_ranks`` and int32, no shape,
    stride or device check): an int32 tensor of RANKS elements of any shape, on the Buffer's device, of any strides
    (torch writes it) whose elements do not alias (one word per rank)."""
    dims = v.dim() if isinstance(v, torch.Tensor) else 1
    return Tensor((torch.int32,), (None,) * dims, dense=False, extra=lambda t: t.numel() == RANKS and _distinct(t))


@st.composite
def _shaped_statuses(draw: st.DrawFn) -> torch.Tensor:
    """Tensors of other shapes than ``[RANKS]`` (RANKS elements or not, 0-d included), mostly int32, in a base
    filled with 7: dense, transposed, every other element, one element in, or broadcast (aliasing elements)."""
    shape = draw(st.sampled_from(((2, 2), (4, 1), (1, 4), (1, 2, 1, 2), (), (1,), (2, 3), (8,))))
    dtype = draw(st.sampled_from((torch.int32,) * 3 + (torch.int64, torch.float32)))
    layout = draw(st.sampled_from(("dense", "transposed", "strided", "offset", "broadcast")))
    n = math.prod(shape)
    base = torch.full((2 * n + 1,), 7, dtype=dtype)
    if layout == "transposed":
        return base[:n].view(shape[::-1]).permute(tuple(reversed(range(len(shape)))))
    if layout == "strided":
        return base[:2 * n:2].view(shape)
    if layout == "offset":
        return base[1:n + 1].view(shape)
    if layout == "broadcast":
        return base[:1].view((1,) * len(shape)).expand(shape)
    return base[:n].view(shape)


def _outside(t: object) -> list[int] | None:
    """The values of the base of view ``t`` outside ``t`` (None for a tensor that is not a view)."""
    base = t._base if isinstance(t, torch.Tensor) else None
    if base is None:
        return None
    assert base.is_contiguous() and base.storage_offset() == 0
    inside = {t.storage_offset() + sum(i * s for i, s in zip(index, t.stride(), strict=True))
              for index in itertools.product(*map(range, t.shape))}
    return [v for i, v in enumerate(base.flatten().tolist()) if i not in inside]


_OPS = st.one_of(
    st.tuples(st.just("update"), values(MASK_SPECS["rank_to_mask"]), values(MASK_SPECS["mask"])),
    st.tuples(st.just("query"), st.one_of(values(MASK_SPECS["mask_status"]), _shaped_statuses())),
    st.tuples(st.just("clean")),
)


@pytest.fixture
def shrink_buffer(deep_ep_host: DeepEpHost) -> Buffer:
    """One 4-rank low-latency Buffer with enable_shrink for every example of a test (each starts by cleaning it)."""
    return deep_ep_host.buffer(0, LL_BYTES, low_latency_mode=True, enable_shrink=True, ranks=RANKS)


@settings(FUZZ, max_examples=100)
@given(ops=st.lists(_OPS, min_size=1, max_size=8))
def test_rank_masking(shrink_buffer: Buffer, default_dtype: torch.dtype, ops: list[tuple]) -> None:
    """A sequence of masking calls on a 4-rank Buffer with enable_shrink, from a clean mask, against the model's
    mask: each refused call (the model's exception naming its argument) changes neither the mask nor the caller's
    tensor; each query writes the model's mask (1 = masked: rank r in row-major element r, whatever the shape and
    strides) and nothing else (a view's base keeps its other elements)."""
    buf = shrink_buffer
    buf.low_latency_clean_mask_buffer()
    model = [0] * RANKS
    for op, *args in ops:
        if op == "update":
            rank, mask = args
            want = expect(MASK_SPECS["rank_to_mask"], rank) or expect(MASK_SPECS["mask"], mask)
            names = ("rank_to_mask",) if expect(MASK_SPECS["rank_to_mask"], rank) else ("mask",)
            check(lambda rank=rank, mask=mask: buf.low_latency_update_mask_buffer(rank, mask), want, names,
                  what=f"update({rank!r}, {mask!r})")
            if want is None:
                model[rank] = int(mask)
        elif op == "query":
            (status,) = args
            want = expect(_mask_status_rule(status), status)
            snapshot, outside = _snapshot(status), _outside(status)
            check(lambda status=status: buf.low_latency_query_mask_buffer(status), want, ("mask_status",),
                  what=f"query({status!r:.80})")
            if want is None:
                assert status.flatten().tolist() == model, (status.flatten().tolist(), model)
                assert _outside(status) == outside
            else:
                _unchanged(snapshot, "a refused query")
        else:
            buf.low_latency_clean_mask_buffer()
            model = [0] * RANKS
    final = torch.full((RANKS,), 7, dtype=torch.int32)
    buf.low_latency_query_mask_buffer(final)
    assert final.tolist() == model


def test_rank_masking_needs_a_shrink_buffer(deep_ep_host: DeepEpHost, default_dtype: torch.dtype) -> None:
    """Each masking call on a Buffer that cannot mask names why: enable_shrink=False, low_latency_mode=False, or
    destroyed; the caller's mask_status stays as it was."""
    no_shrink = deep_ep_host.buffer(0, LL_BYTES, low_latency_mode=True)
    normal = deep_ep_host.buffer(NVL_BYTES, 0)
    destroyed = deep_ep_host.buffer(0, LL_BYTES, low_latency_mode=True, enable_shrink=True, explicitly_destroy=True)
    destroyed.destroy()
    status = torch.full((1,), 5, dtype=torch.int32)
    for buf, why in ((no_shrink, "enable_shrink"), (normal, "low_latency_mode"), (destroyed, "destroyed")):
        for what, call in (("update", lambda b=buf: b.low_latency_update_mask_buffer(0, True)),
                           ("query", lambda b=buf: b.low_latency_query_mask_buffer(status)),
                           ("clean", lambda b=buf: b.low_latency_clean_mask_buffer())):
            check(call, ValueError, (why,), what=f"{what} on a Buffer without {why}")
    assert status.tolist() == [5]


# ------------------------------------------------------------------------------------------------------------------
# get_next_low_latency_combine_buffer (the zero-copy combine)

TMAX, E = 8, 8
LL_BYTES = Buffer.get_low_latency_rdma_size_hint(TMAX, H, 1, E)
_HANDLES = ("valid", "valid", "plain tuple", "another Buffer's", "normal-mode handle", "no zero-copy room",
            "destroyed", "junk", "member dtype", "member junk")


@pytest.fixture
def ll_buffers(deep_ep_host: DeepEpHost) -> dict[str, Buffer]:
    """Low-latency Buffers for every example of a test: sized by the hint (``hint``, and ``other`` for another
    Buffer's handles) and ``no_room`` (every call of these sizes, without the zero-copy rows)."""
    no_room = required_bytes(_low_latency.ll_shape(1, TMAX, H, E, E))
    return {"hint": deep_ep_host.buffer(0, LL_BYTES, low_latency_mode=True),
            "other": deep_ep_host.buffer(0, LL_BYTES, low_latency_mode=True),
            "no_room": deep_ep_host.buffer(0, no_room, low_latency_mode=True)}


@FUZZ
@given(form=st.sampled_from(_HANDLES), junk=JUNK, tokens=st.integers(0, TMAX), topk=st.integers(1, E),
       max_tokens=st.integers(1, TMAX // 4).map(lambda n: 4 * n),  # one rank: DeepEP's TMA rule, Tmax % 4 == 0
       experts=st.sampled_from([1, 2, 4, 8]), member=st.integers(0, 1),
       member_dtype=st.sampled_from(DTYPES))
def test_next_low_latency_combine_buffer(deep_ep_host: DeepEpHost, ll_buffers: dict[str, Buffer],
                                         default_dtype: torch.dtype, form: str, junk: object, tokens: int, topk: int,
                                         max_tokens: int, experts: int, member: int, member_dtype: torch.dtype) -> None:
    """The handle of a dispatch of drawn sizes, or another kind of handle. Valid: a BF16 ``[E/P, P*Tmax, H]`` view of
    the Buffer's workspace, the rows the next zero-copy combine sends (its launch reads them, not ``x``). Refused:
    another type (TypeError naming handle), a handle of another Buffer (ValueError naming handle), a Buffer without
    the zero-copy rows (ValueError naming num_rdma_bytes), a destroyed Buffer; a handle whose src_info (int32) or
    layout_range (int64) is a tensor of another dtype (ValueError naming handle, as normal mode's handle members)
    or no tensor (TypeError naming handle); the same verdicts from low_latency_combine."""
    tokens, topk = min(tokens, max_tokens), min(topk, experts)
    buf = ll_buffers["no_room" if form == "no zero-copy room" else "hint"]
    if form == "destroyed":
        buf = deep_ep_host.buffer(0, LL_BYTES, low_latency_mode=True, explicitly_destroy=True)
    x = torch.randn(tokens, H, dtype=torch.float32).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(experts, dtype=torch.int64)[:topk] for _ in range(tokens)]) if tokens else \
        torch.zeros(0, topk, dtype=torch.int64)
    _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, max_tokens, experts, use_fp8=False)
    names: tuple[str, ...] = ("handle",)
    want: type[Exception] | None = TypeError
    if form == "plain tuple":
        handle = tuple(handle)
    elif form == "another Buffer's":
        _, _, handle, _, _ = ll_buffers["other"].low_latency_dispatch(x, idx, max_tokens, experts, use_fp8=False)
        want = ValueError
    elif form == "normal-mode handle":
        handle = HANDLE.make(tuple(torch.zeros(r.shape, dtype=r.dtypes[0]) for r in HANDLE.items))
    elif form == "no zero-copy room":  # refused where the zero-copy rows of these sizes (the size rule) do not fit
        zero_copy = required_bytes(_low_latency.ll_shape(1, max_tokens, H, experts, topk), zero_copy=True)
        want, names = (ValueError if zero_copy > buf.num_rdma_bytes else None), ("num_rdma_bytes",)
    elif form == "destroyed":
        buf.destroy()
        want, names = ValueError, ("destroyed",)
    elif form == "junk":
        handle = junk
    elif form.startswith("member"):
        own = (torch.int32, torch.int64)[member]
        forged = handle[member].to(member_dtype) if form == "member dtype" else junk
        members = (*handle[:member], forged, *handle[member + 1:])
        handle = LowLatencyHandle(members, topk=handle.topk, num_tokens=handle.num_tokens,
                                  src_route=handle.src_route, routing=handle.routing, workspace=buf.workspace)
        want = expect(Tensor((own,), (None, None), dense=False), forged)  # a 2-D tensor of the dispatch's dtype
        names = ("handle[0] (src_info)", "handle[1] (layout_range)")[member:member + 1]
        if want is not None:
            combine_x = torch.zeros(experts, max_tokens, H, dtype=torch.bfloat16)
            weights = torch.rand(tokens, topk, dtype=torch.float32)
            check(lambda: buf.low_latency_combine(combine_x, idx, weights, handle), want, names,
                  what=f"low_latency_combine({form} {member})")
    else:
        want = None
    got: list[torch.Tensor] = []
    check(lambda: got.append(buf.get_next_low_latency_combine_buffer(handle)), want, names,
          what=f"get_next_low_latency_combine_buffer({form})")
    if want is not None:
        return
    rows = got[0]
    assert isinstance(handle, LowLatencyHandle)
    assert (rows.dtype, tuple(rows.shape)) == (torch.bfloat16, (experts, max_tokens, H))
    ws = buf.workspace.buffer
    assert ws.data_ptr() <= rows.data_ptr() and rows.data_ptr() + rows.numel() * 2 <= ws.data_ptr() + ws.numel()
    expert_out = torch.zeros(experts, max_tokens, H, dtype=torch.bfloat16)
    buf.low_latency_combine(expert_out, idx, torch.rand(tokens, topk, dtype=torch.float32), handle, zero_copy=True)
    assert deep_ep_host.launched[-1][1].x == rows.data_ptr()  # the zero-copy combine sends these rows
