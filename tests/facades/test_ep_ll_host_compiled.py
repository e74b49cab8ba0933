"""The compiled host path of the low-latency calls (gc_moe_compat/deep_ep/_compiled_host.cpp) against the Python
path, on the host tests' CPU workspace stand-in (test_ep_ll_host.py's): the same outputs (dtype, shape, strides,
device, views) and the same launch parameters for every call shape; every argument the record does not match runs the
Python path, which raises its own exception; a new shape gets its own record; ``GC_MOE_DEEP_EP_HOST_PATH=python``
forces the Python path; a failed build leaves the Python path and says why."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import compiled_host_kit
import pytest
import torch
from compiled_host_kit import TensorSubclass, compiled_or_skip, misaligned, same_on_both_paths, unaligned
from ll_launches import Launch, record_ll_launches
from test_ep_ll_host import _Workspace

from gc_moe_compat import swap
from gc_moe_compat.comm import ep_ll, ep_normal
from gc_moe_compat.comm.ep_ll import EpLlParams, LlShape
from gc_moe_compat.deep_ep import _compiled_host, _low_latency
from gc_moe_compat.deep_ep._low_latency import LowLatencyHandle
from gc_moe_compat.runtime.status import DeviceCheckError, KernelStatus
from gc_moe_compat.runtime.workspace import PeerTable

ENV = _compiled_host.HOST_PATH_ENV
POINTERS = [name for name, _ in EpLlParams._fields_ if name in ep_ll._POINTER_FIELDS]


@pytest.fixture(scope="module")
def fast() -> ModuleType:
    return compiled_or_skip()


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[Launch]:
    monkeypatch.delenv(ENV, raising=False)
    return record_ll_launches(monkeypatch)


@pytest.fixture
def python_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The calls that took the Python path (its two functions, counted)."""
    calls: list[str] = []
    for name in ("_checked_dispatch", "_checked_combine"):
        checked = getattr(_low_latency, name)

        def counted(*args: object, _checked: Callable = checked, _name: str = name, **kwargs: object) -> object:
            calls.append(_name)
            return _checked(*args, **kwargs)

        monkeypatch.setattr(_low_latency, name, counted)
    return calls


def _workspace(ranks: int, experts: int, max_tokens: int, hidden: int) -> _Workspace:
    """A CPU workspace sized as the hint sizes it (top-k 16, the zero-copy rows)."""
    shape = LlShape(ranks, experts, max_tokens, hidden, ep_ll.HINT_TOPK)
    buffer = torch.zeros(ep_ll.required_bytes(shape, True), dtype=torch.uint8)
    return _Workspace(torch.device("cpu"), ranks, buffer, PeerTable())


def _layout(t: torch.Tensor | None) -> tuple | None:
    """What an output must match between the paths: dtype, shape, strides, device, storage offset, whether a view
    (neither path's are: each allocates, or makes parts of one allocation that are not autograd views)."""
    if t is None:
        return None
    return t.dtype, tuple(t.shape), t.stride(), t.device, t.storage_offset(), t._is_view()


def _symbolic(params: EpLlParams, tensors: dict[str, torch.Tensor | None], fresh: str | None = None) -> tuple:
    """``params`` with each address replaced by the (tensor, byte offset) it points into (the first of ``tensors``
    in their order that holds it; 0 stays 0; field ``fresh`` points at a word of the call's own, into none of them):
    equal between two calls when every field points at the same role."""
    values = []
    for name in POINTERS:
        address = getattr(params, name)
        if address == 0:
            values.append((name, None))
            continue
        for role, t in tensors.items():
            if t is not None and t.data_ptr() <= address <= t.data_ptr() + t.numel() * t.element_size():
                values.append((name, role, address - t.data_ptr()))
                break
        else:
            assert name == fresh, (name, address)
            values.append((name, "fresh"))
    rest = EpLlParams.from_buffer_copy(params)
    for name in POINTERS:
        if name != "status_mirror":
            setattr(rest, name, 0)
    return tuple(values), bytes(rest)


def _dispatch(ws: _Workspace, x: object, topk_idx: object, max_tokens: int, experts: int, **kwargs: object
              ) -> tuple:
    options = dict(recv_stats=None, use_fp8=False, round_scale=False, use_ue8m0=False, async_finish=False,
                   return_recv_hook=False, shrink=False, num_sms=20)
    return _low_latency.dispatch(ws, x, topk_idx, max_tokens, experts, **{**options, **kwargs})


def _combine(ws: _Workspace, x: object, topk_idx: object, weights: object, handle: object, **kwargs: object
             ) -> tuple:
    options = dict(out=None, zero_copy=False, async_finish=False, return_recv_hook=False, shrink=False, num_sms=20)
    return _low_latency.combine(ws, x, topk_idx, weights, handle, **{**options, **kwargs})


def _dispatch_view(result: tuple, x: torch.Tensor, topk_idx: torch.Tensor, stats: torch.Tensor | None,
                   ws: _Workspace) -> tuple[dict[str, torch.Tensor | None], tuple]:
    """The tensors a dispatch's parameters point at, by role, and what else it returned (the handle's sizes)."""
    recv, recv_count, handle, _ = result
    recv_x, scales = recv if isinstance(recv, tuple) else (recv, None)
    storage = handle.src_route.untyped_storage()  # the private allocation the small parts share
    assert all(t.untyped_storage().data_ptr() == storage.data_ptr() for t in (
        handle.routing, handle[0], handle[1], recv_count))
    private = torch.empty(0, dtype=torch.int32).set_(storage)
    tensors = {"x": x, "topk_idx": topk_idx, "recv_x": recv_x, "scales": scales, "recv_count": recv_count,
               "src_info": handle[0], "layout_range": handle[1], "private": private, "src_route": handle.src_route,
               "routing": handle.routing, "stats": stats, "mirror": _low_latency._states[ws].mirror}
    return tensors, (tuple(handle[2:]), handle.topk, handle.num_tokens)


SHAPES = [  # ranks, experts, Tmax, hidden, T, k, fp8, round_scale, ue8m0, recv_stats, shrink
    (1, 8, 8, 256, 5, 4, False, False, False, False, False),
    (2, 16, 8, 512, 7, 6, True, False, False, True, False),
    (1, 8, 16, 1024, 16, 8, True, True, True, False, True),
    (4, 16, 4, 128, 3, 2, True, True, False, True, True),
    (1, 8, 8, 256, 0, 4, True, False, False, False, False),  # T = 0
    (2, 8, 8, 512, 0, 3, True, True, True, True, False),  # T = 0, UE8M0
]


@pytest.mark.parametrize("shape", SHAPES)
def test_both_paths_give_the_same_outputs_and_parameters(fast: ModuleType, launches: list, python_calls: list,
                                                         monkeypatch: pytest.MonkeyPatch, shape: tuple) -> None:
    """Per shape: a dispatch and a combine (allocated and given ``out``, zero-copy) under
    ``GC_MOE_DEEP_EP_HOST_PATH=python``, then twice on the default path (the first builds the records, the second
    takes the compiled path): the same output layouts, handle sizes, launch kinds and parameters (every non-pointer
    byte equal, every pointer into the same tensor at the same offset)."""
    ranks, experts, tmax, hidden, tokens, k, fp8, round_scale, ue8m0, with_stats, shrink = shape
    ws = _workspace(ranks, experts, tmax, hidden)
    g = torch.Generator().manual_seed(len(python_calls) + tokens)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    topk_idx = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]) \
        if tokens else torch.zeros(0, k, dtype=torch.int64)
    stats = torch.zeros(experts // ranks, dtype=torch.int32) if with_stats else None
    local, slots = experts // ranks, ranks * tmax
    y = torch.randn(local, slots, hidden, generator=g).to(torch.bfloat16)
    weights = torch.rand(tokens, k, generator=g)
    given = torch.empty(tokens, hidden, dtype=torch.bfloat16)

    def run() -> list[tuple]:
        seen = []
        for hook in (False, True):
            first = len(launches)
            result = _dispatch(ws, x, topk_idx, tmax, experts, recv_stats=stats, use_fp8=fp8,
                               round_scale=round_scale, use_ue8m0=ue8m0, shrink=shrink, return_recv_hook=hook)
            if hook:
                result[3]()
            tensors, sizes = _dispatch_view(result, x, topk_idx, stats, ws)
            seen.append(({role: _layout(t) for role, t in tensors.items() if role not in ("x", "topk_idx", "stats")},
                         sizes, [(what, _symbolic(p, tensors)) for what, p in launches[first:]]))
            handle = result[2]
            for out, zero_copy, idx in ((None, False, topk_idx), (given, False, topk_idx), (None, True, topk_idx)):
                first = len(launches)
                combined, back = _combine(ws, y, idx, weights, handle, out=out, zero_copy=zero_copy,
                                          return_recv_hook=hook, shrink=shrink)
                if hook:
                    back()
                assert (combined is given) == (out is given)
                roles = {"x": y, "rows": _low_latency.next_combine_buffer(ws, handle), "topk_idx": idx,
                         "weights": weights, "out": combined, "src_info": handle[0], "layout_range": handle[1],
                         "src_route": handle.src_route, "routing": handle.routing,
                         "mirror": _low_latency._states[ws].mirror}
                # a hooked call's own word (a fresh int64 [1]: its receive launch reads it), else the workspace's
                # unread one (no allocation)
                call_gens = {p.call_gen for _, p in launches[first:]}
                assert len(call_gens) == 1 and 0 not in call_gens
                assert (call_gens == {_low_latency._states[ws].unread_gen.data_ptr()}) == (not hook)
                seen.append((_layout(combined), [(what, _symbolic(p, roles, "call_gen")) for what, p in
                                                      launches[first:]]))
        return seen

    monkeypatch.setenv(ENV, "python")
    reference = run()
    monkeypatch.delenv(ENV)
    python_calls.clear()
    assert run() == reference  # records built: the dispatch's, the combine's, the zero-copy one's
    assert python_calls == ["_checked_dispatch"] + ["_checked_combine"] * 2
    python_calls.clear()
    assert run() == reference  # the compiled path throughout
    assert python_calls == []


@pytest.mark.parametrize("shape", SHAPES)
def test_the_small_outputs_are_disjoint_parts_of_one_allocation(fast: ModuleType, launches: list, python_calls: list,
                                                                shape: tuple, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    """recv_count, the handle's src_info / layout_range / src_route / routing (and the generation word before them)
    are parts of one allocation on both paths: DeepEP's dtypes, shapes and strides, each contiguous and 16-byte
    aligned, none an autograd view, no two sharing a byte (each filled with its own value, read back intact)."""
    ranks, experts, tmax, hidden, tokens, k, fp8, round_scale, ue8m0, _, shrink = shape
    local, slots = experts // ranks, ranks * tmax
    g = torch.Generator().manual_seed(tokens + k)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    topk_idx = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]) \
        if tokens else torch.zeros(0, k, dtype=torch.int64)
    ws = _workspace(ranks, experts, tmax, hidden)
    for path in ("python", "compiled", "compiled"):  # the first compiled call records the shape, the second is C++
        monkeypatch.setenv(ENV, path)
        python_calls.clear()
        _, recv_count, handle, _ = _dispatch(ws, x, topk_idx, tmax, experts, use_fp8=fp8, round_scale=round_scale,
                                             use_ue8m0=ue8m0, shrink=shrink)
        parts = [(recv_count, torch.int32, (local,)), (handle[0], torch.int32, (local, slots)),
                 (handle[1], torch.int64, (local, ranks)), (handle.src_route, torch.int32, (local, slots)),
                 (handle.routing, torch.int32, (2, tokens, k))]
        start = recv_count.untyped_storage().data_ptr()
        compiled_host_kit.assert_disjoint_parts(parts, reserved=((start, start + 8),))  # the generation word
    assert python_calls == []  # the last call took the compiled path


def test_a_compiled_dispatch_is_one_c_call(fast: ModuleType, launches: list, python_calls: list) -> None:
    """After the first call of a shape, dispatches and combines of it take the compiled path (no Python check runs),
    their outputs fresh tensors of each call."""
    ws = _workspace(1, 8, 8, 256)
    x = torch.randn(5, 256).to(torch.bfloat16)
    idx = torch.randint(0, 8, (5, 4))
    y = torch.zeros(8, 8, 256, dtype=torch.bfloat16)
    first = _dispatch(ws, x, idx, 8, 8)
    out = _combine(ws, y, idx, torch.ones(5, 4), first[2])[0]
    assert python_calls == ["_checked_dispatch", "_checked_combine"]
    second = _dispatch(ws, x, idx, 8, 8)
    out2 = _combine(ws, y, idx, torch.ones(5, 4), second[2])[0]
    assert python_calls == ["_checked_dispatch", "_checked_combine"] and len(launches) == 4
    assert second[0].data_ptr() != first[0].data_ptr() and out2.data_ptr() != out.data_ptr()
    assert launches[2][1].recv_x == second[0].data_ptr() and launches[3][1].out == out2.data_ptr()


def test_routing_row_slices_take_the_compiled_path(fast: ModuleType, launches: list, python_calls: list,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """topk_idx and topk_weights (read element by element) one element past a 16-byte boundary, as a row slice of a
    top-6 batch is, pass the records' checks as the Python path's: dispatch and combine run on the compiled path,
    their launches pointing at the slices; one byte past an element boundary runs the Python path, which refuses
    it."""
    ws = _workspace(2, 16, 8, 512)
    x = torch.randn(7, 512).to(torch.bfloat16)
    idx = torch.randint(0, 16, (7, 6))
    w = torch.rand(7, 6)
    y = torch.zeros(8, 16, 512, dtype=torch.bfloat16)
    handle = _dispatch(ws, x, idx, 8, 16)[2]
    _combine(ws, y, idx, w, handle)
    python_calls.clear()
    launches.clear()
    odd_idx, odd_w = misaligned((7, 6), torch.int64).copy_(idx), misaligned((7, 6), torch.float32).copy_(w)
    handle = _dispatch(ws, x, odd_idx, 8, 16)[2]
    _combine(ws, y, odd_idx, odd_w, handle)
    odd_stats = misaligned((8,), torch.int32)  # the local experts' counters: an atomic add each
    _dispatch(ws, x, odd_idx, 8, 16, recv_stats=odd_stats)
    assert python_calls == [] and (odd_idx.data_ptr() % 16, odd_w.data_ptr() % 16) == (8, 4)
    assert launches[-1][1].recv_stats == odd_stats.data_ptr()
    assert launches[0][1].topk_idx == odd_idx.data_ptr()
    assert (launches[1][1].topk_idx, launches[1][1].topk_weights) == (odd_idx.data_ptr(), odd_w.data_ptr())
    bad_idx, bad_w = unaligned((7, 6), torch.int64).copy_(idx), unaligned((7, 6), torch.float32).copy_(w)
    for call, needle in ((lambda: _dispatch(ws, x, bad_idx, 8, 16), "topk_idx: must be aligned to its 8-byte"),
                         (lambda: _combine(ws, y, idx, bad_w, handle), "topk_weights: must be aligned to its 4-byte")):
        error = same_on_both_paths(call, monkeypatch, python_calls)
        assert error is not None and needle in error[1], error


def test_every_mismatch_raises_the_python_paths_exception(fast: ModuleType, launches: list, python_calls: list,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """With the shape's records in place, each bad argument (type, dtype, rank, shape, device, layout, alignment,
    a foreign or forged handle) raises what ``GC_MOE_DEEP_EP_HOST_PATH=python`` raises, message included, and
    launches nothing; arguments the Python path accepts but the record does not (a tensor subclass, a view of the
    handle's members) run the Python path."""
    ws, other = _workspace(2, 16, 8, 512), _workspace(2, 16, 8, 512)
    T, H, K, L, S = 6, 512, 4, 8, 16  # noqa: N806 - the sizes' usual names
    x = torch.randn(T, H).to(torch.bfloat16)
    idx = torch.randint(0, 16, (T, K))
    stats = torch.zeros(L, dtype=torch.int32)
    y = torch.zeros(L, S, H, dtype=torch.bfloat16)
    w = torch.ones(T, K)
    kwargs = dict(recv_stats=stats, use_fp8=True)
    handle = _dispatch(ws, x, idx, 8, 16, **kwargs)[2]
    _dispatch(ws, x, idx, 8, 16, **kwargs)
    _combine(ws, y, idx, w, handle)
    _combine(ws, y, idx, w, handle)
    assert python_calls == ["_checked_dispatch", "_checked_combine"]
    foreign = _dispatch(other, x, idx, 8, 16, **kwargs)[2]
    launched = len(launches)
    forged = [LowLatencyHandle((m0, m1, *handle[2:]), topk=K, num_tokens=T, src_route=handle.src_route,
                               routing=handle.routing, workspace=ws)
              for m0, m1 in ((handle[0].float(), handle[1]), (handle[0], handle[1].int()),
                             (handle[0][0], handle[1]), (handle[0].tolist(), handle[1]),
                             (handle[0][:, :8], handle[1]), (handle[0].to("meta"), handle[1]))]
    bad_dispatch = {
        "x list": dict(x=x.tolist()), "x float32": dict(x=x.float()), "x 3-D": dict(x=x.view(1, T, H)),
        "x transposed": dict(x=torch.zeros(H, T, dtype=torch.bfloat16).t()),
        "x misaligned": dict(x=misaligned((T, H), torch.bfloat16)), "x meta": dict(x=x.to("meta")),
        "x too many tokens": dict(x=torch.zeros(9, H, dtype=torch.bfloat16), idx=torch.zeros(9, K, dtype=torch.int64)),
        "x hidden": dict(x=torch.zeros(T, 200, dtype=torch.bfloat16)),
        "idx int16": dict(idx=idx.short()), "idx int32": dict(idx=idx.int()), "idx rows": dict(idx=idx[:-1]),
        "idx k 0": dict(idx=idx[:, :0]),
        "idx non-contiguous": dict(idx=idx.t().contiguous().t()),
        "stats int64": dict(stats=stats.long()), "stats length": dict(stats=stats[:-1]),
        "stats list": dict(stats=[0] * L), "stats strided": dict(stats=torch.zeros(2 * L, dtype=torch.int32)[::2]),
        "ue8m0 without round_scale": dict(use_ue8m0=True), "experts float": dict(experts=16.0),
        "Tmax bool": dict(max_tokens=True),
    }
    bad_combine = {
        "y float32": dict(y=y.float()), "y shape": dict(y=y[:, :8]), "y list": dict(y=[1]),
        "y misaligned": dict(y=misaligned((L, S, H), torch.bfloat16)),
        "y non-contiguous": dict(y=y.transpose(0, 1).contiguous().transpose(0, 1)),
        "idx shape": dict(idx=idx[:, :2]), "idx float": dict(idx=idx.float()),
        "idx int32": dict(idx=idx.int()), "idx meta": dict(idx=idx.to("meta")),
        "weights float64": dict(w=w.double()), "weights shape": dict(w=w[:2]),
        "weights non-contiguous": dict(w=torch.ones(K, T).t()),
        "out float32": dict(out=torch.zeros(T, H)), "out shape": dict(out=torch.zeros(T, 256, dtype=torch.bfloat16)),
        "out misaligned": dict(out=misaligned((T, H), torch.bfloat16)), "out tuple": dict(out=(1,)),
        "handle tuple": dict(handle=tuple(handle)), "handle foreign": dict(handle=foreign),
        **{f"handle forged {i}": dict(handle=h) for i, h in enumerate(forged)},
    }

    def both(call: Callable[[], object]) -> tuple[type, str] | None:
        return same_on_both_paths(call, monkeypatch, python_calls)

    for name, bad in bad_dispatch.items():
        args = dict(x=x, idx=idx, stats=stats, max_tokens=8, experts=16, use_ue8m0=False) | bad
        error = both(lambda a=args: _dispatch(ws, a["x"], a["idx"], a["max_tokens"], a["experts"],
                                              recv_stats=a["stats"], use_fp8=True, use_ue8m0=a["use_ue8m0"]))
        assert error is not None and error[0] in (TypeError, ValueError), (name, error)
    for name, bad in bad_combine.items():
        args = dict(y=y, idx=idx, w=w, handle=handle, out=None) | bad
        error = both(lambda a=args: _combine(ws, a["y"], a["idx"], a["w"], a["handle"], out=a["out"]))
        assert error is not None and error[0] in (TypeError, ValueError), (name, error)
    assert len(launches) == launched
    # Accepted by the Python path, not by the records: the Python path runs and succeeds.
    for accepted in (lambda: _dispatch(ws, x.as_subclass(TensorSubclass), idx, 8, 16, **kwargs),
                     lambda: _combine(ws, y, idx, w.as_subclass(TensorSubclass), handle),
                     lambda: _combine(ws, y, idx, w, LowLatencyHandle(
                         (handle[0].t().contiguous().t(), *handle[1:]), topk=K, num_tokens=T,
                         src_route=handle.src_route, routing=handle.routing, workspace=ws))):
        python_calls.clear()
        accepted()
        assert len(python_calls) == 1


def test_a_new_shape_gets_its_own_record(fast: ModuleType, launches: list, python_calls: list) -> None:
    """Another token count or flag is a new record (its first call the Python path); each shape's later calls take
    the compiled path, whichever ran in between (two micro-batches alternate)."""
    ws = _workspace(1, 8, 16, 256)
    xs = {t: torch.zeros(t, 256, dtype=torch.bfloat16) for t in (3, 9)}
    idx = {t: torch.zeros(t, 2, dtype=torch.int64) for t in (3, 9)}
    for t in (3, 9, 3, 9):
        _dispatch(ws, xs[t], idx[t], 16, 8)
    _dispatch(ws, xs[3], idx[3], 16, 8, use_fp8=True)
    _dispatch(ws, xs[3], idx[3], 16, 8, use_fp8=True)
    assert python_calls == ["_checked_dispatch"] * 3
    state = _low_latency._states[ws]
    by_flags = {key[4]: set(records) for key, records in state.records.items()}
    assert by_flags == {0: {(3, 256, 2), (9, 256, 2)}, ep_ll.FLAG_FP8: {(3, 256, 2)}}
    for records in state.records.values():
        for record in records.values():
            assert record.launches in state.launches.values()


TOPK_IDX_REFUSED = (r"^topk_idx: must be a 2-D tensor of torch.int64 \(deep_ep.topk_idx_t, which DeepEP asserts\), "
                    r"got \(6, 4\) torch.int32$")


def test_an_int32_topk_idx_is_refused_after_its_shape_was_recorded(fast: ModuleType, launches: list,
                                                                   python_calls: list,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepEP's ``topk_idx_t`` is int64: once int64 calls of a shape have built its records (their second calls
    take the compiled path), an int32 ``topk_idx`` of the same shape is never served by them: each such dispatch and
    combine, first and second, runs the Python path and raises its ``ValueError`` (the message of
    ``GC_MOE_DEEP_EP_HOST_PATH=python``), launching nothing."""
    ws = _workspace(2, 16, 8, 512)
    T, K = 6, 4  # noqa: N806 - the sizes' usual names
    x = torch.randn(T, 512).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(16)[:K] for _ in range(T)])
    y, w = torch.zeros(8, 16, 512, dtype=torch.bfloat16), torch.ones(T, K)
    handle = _dispatch(ws, x, idx, 8, 16)[2]
    _dispatch(ws, x, idx, 8, 16)
    _combine(ws, y, idx, w, handle)
    _combine(ws, y, idx, w, handle)
    assert python_calls == ["_checked_dispatch", "_checked_combine"]  # each second call: the compiled path
    launched = len(launches)
    narrow = idx.int()
    for checked, call in (("_checked_dispatch", lambda: _dispatch(ws, x, narrow, 8, 16)),
                          ("_checked_combine", lambda: _combine(ws, y, narrow, w, handle))):
        python_calls.clear()
        for _ in range(2):
            with pytest.raises(ValueError, match=TOPK_IDX_REFUSED):
                call()
        assert python_calls == [checked] * 2
        error = same_on_both_paths(call, monkeypatch, python_calls)
        assert error is not None and error[0] is ValueError
    assert len(launches) == launched
    python_calls.clear()
    _dispatch(ws, x, idx, 8, 16)
    _combine(ws, y, idx, w, handle)
    assert python_calls == []  # the int64 calls still take the compiled path


def test_the_variable_forces_the_python_path(fast: ModuleType, launches: list, python_calls: list,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``GC_MOE_DEEP_EP_HOST_PATH=python``: every call checks in Python, records or not, and builds none; a bad
    value raises naming the variable (every call, as ``swap --check`` reports)."""
    ws = _workspace(1, 8, 8, 256)
    x, idx = torch.zeros(5, 256, dtype=torch.bfloat16), torch.zeros(5, 4, dtype=torch.int64)
    monkeypatch.setenv(ENV, "python")
    handle = _dispatch(ws, x, idx, 8, 8)[2]
    assert _low_latency._states[ws].records == {}
    monkeypatch.setenv(ENV, "compiled")
    handle = _dispatch(ws, x, idx, 8, 8)[2]
    assert _low_latency._states[ws].records != {}
    monkeypatch.setenv(ENV, " python ")
    python_calls.clear()
    for _ in range(3):
        handle = _dispatch(ws, x, idx, 8, 8)[2]
        _combine(ws, torch.zeros(8, 8, 256, dtype=torch.bfloat16), idx, torch.ones(5, 4), handle)
    assert python_calls == ["_checked_dispatch", "_checked_combine"] * 3
    assert _compiled_host.host_path() == {"host_path": "python", "reason": f"{ENV}=python"}
    monkeypatch.setenv(ENV, "cpp")
    with pytest.raises(ValueError, match=rf"{ENV}: must be one of \('compiled', 'python'\) .* got 'cpp'"):
        _dispatch(ws, x, idx, 8, 8)
    assert len(launches) == 2 + 6


def test_recorded_errors_are_raised_before_a_compiled_launch(fast: ModuleType, launches: list,
                                                             python_calls: list) -> None:
    """What the kernels recorded is raised by the next call on the compiled path too, before its launch."""
    ws = _workspace(1, 8, 8, 256)
    x, idx, y = torch.zeros(5, 256, dtype=torch.bfloat16), torch.zeros(5, 4, dtype=torch.int64), \
        torch.zeros(8, 8, 256, dtype=torch.bfloat16)
    handle = _dispatch(ws, x, idx, 8, 8)[2]
    _combine(ws, y, idx, torch.ones(5, 4), handle)
    mirror = _low_latency._states[ws].mirror
    record = KernelStatus(code=2, site=ep_ll.LlSite.EXPERT_RANGE << 16, observed=300, expected=8)
    for call in (lambda: _dispatch(ws, x, idx, 8, 8), lambda: _combine(ws, y, idx, torch.ones(5, 4), handle)):
        mirror[ep_ll.Kernel.DISPATCH_SEND] = torch.frombuffer(bytearray(bytes(record)), dtype=torch.uint8)
        python_calls.clear()
        launched = len(launches)
        with pytest.raises(DeviceCheckError, match="recorded by an earlier call"):
            call()
        assert len(launches) == launched and python_calls == [] and not mirror.any()


@pytest.fixture
def fresh_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """A build of its own in ``tmp_path`` (the test's), then the regular one again."""
    monkeypatch.setenv("GC_MOE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(ENV, raising=False)
    _compiled_host._build.cache_clear()
    yield
    _compiled_host._build.cache_clear()


def test_a_failed_build_leaves_the_python_path_and_says_why(fresh_build: None, tmp_path: Path, launches: list,
                                                           python_calls: list, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture,
                                                           capsys: pytest.CaptureFixture) -> None:
    """A compile error, or no ninja: ``host_path`` and ``swap --check`` report the Python path and the error, the
    calls run the Python path (and build no record), one warning is logged."""
    broken = tmp_path / "_compiled_host.cpp"
    broken.write_text('#error "a broken source"\n')
    monkeypatch.setattr(_compiled_host, "SOURCE", broken)
    with caplog.at_level(logging.WARNING, logger=_compiled_host.__name__):
        report = _compiled_host.host_path()
        ws = _workspace(1, 8, 8, 256)
        x, idx = torch.zeros(5, 256, dtype=torch.bfloat16), torch.zeros(5, 4, dtype=torch.int64)
        for _ in range(2):
            _dispatch(ws, x, idx, 8, 8)
    assert report["host_path"] == "python" and "a broken source" in report["reason"]
    assert report["reason"].startswith(f"_compiled_host.cpp could not be built in {tmp_path / 'deep_ep_compiled_host'}")
    assert python_calls == ["_checked_dispatch"] * 2 and _low_latency._states[ws].records == {}
    assert len([r for r in caplog.records if "Python host path" in r.getMessage()]) == 1
    assert swap.check() == 0
    assert capsys.readouterr().out.endswith(f"deep_ep facade host path: python ({report['reason']})\n")
    _compiled_host._build.cache_clear()
    unbuilt = tmp_path / "unbuilt" / "_compiled_host.cpp"  # a source torch's loader has not seen in this process
    unbuilt.parent.mkdir()
    unbuilt.write_text("// never compiled\n")
    monkeypatch.setattr(_compiled_host, "SOURCE", unbuilt)
    monkeypatch.setenv("PATH", str(tmp_path))  # no ninja, no compiler
    report = _compiled_host.host_path()
    assert report["host_path"] == "python" and "Ninja is required" in report["reason"], report


def test_the_check_command_reports_the_host_path(fast: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert swap.check() == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("deep_ep facade host path: compiled (_compiled_host.cpp built in ")
    assert _compiled_host.host_path()["host_path"] == "compiled"
    monkeypatch.setenv(ENV, "python")
    assert swap.check() == 0
    assert capsys.readouterr().out.splitlines()[-1] == \
        f"deep_ep facade host path: python ({ENV}=python)"
    monkeypatch.setenv(ENV, "fast")
    assert swap.check() == 2
    assert capsys.readouterr().out.splitlines()[-1].startswith(
        f"deep_ep facade host path: configuration error: {ENV}: must be one of")


def test_the_extension_stores_at_the_ctypes_fields_offsets(fast: ModuleType) -> None:
    """The fields the extension stores are the per-call fields of EpLlParams (its pointers) and EpNormalParams
    (its pointers and received rows; the spin timeout and the op number stay Python's), at the ctypes offsets and
    widths."""
    assert set(fast.PARAM_FIELDS) == set(_compiled_host.PARAM_STRUCTS) == {"EpLlParams", "EpNormalParams"}
    assert set(fast.PARAM_FIELDS["EpLlParams"]) <= ep_ll._POINTER_FIELDS
    assert set(fast.PARAM_FIELDS["EpNormalParams"]) == ep_normal.PER_CALL_FIELDS - {"timeout_ns", "op"}
    for struct, fields in fast.PARAM_FIELDS.items():
        params = _compiled_host.PARAM_STRUCTS[struct]
        for name, width in fields.items():
            field = getattr(params, name)
            assert (_compiled_host.field_offset(params, name, width), width) == (field.offset, field.size)
    with pytest.raises(TypeError, match="EpLlParams.num_tokens: the extension stores 8 bytes there, the field has 4"):
        _compiled_host.field_offset(EpLlParams, "num_tokens", 8)
    with pytest.raises(ValueError, match="set_param_offsets: no parameter struct EpOtherParams"):
        fast.set_param_offsets("EpOtherParams", {}, 8)
    assert ctypes.sizeof(EpLlParams) == 232



@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor:UserWarning")
def test_allocations_of_a_dispatch_mode_go_to_the_python_path(fast: ModuleType, launches: list,
                                                              python_calls: list) -> None:
    """Under a Python dispatch mode whose allocations are tensor subclasses (a fake tensor mode), the compiled
    dispatch makes no part of its allocation (a part would lack the subclass's Python object): the call goes to the
    Python path, whose outputs are the mode's tensors."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    ws = _workspace(1, 8, 8, 256)
    x = torch.randn(5, 256).to(torch.bfloat16)
    idx = torch.randint(0, 8, (5, 4))
    for _ in range(2):
        _dispatch(ws, x, idx, 8, 8)
    python_calls.clear()
    with FakeTensorMode(allow_non_fake_inputs=True):
        recv_x, recv_count, handle, _ = _dispatch(ws, x, idx, 8, 8)
    assert python_calls == ["_checked_dispatch"]
    assert all(isinstance(t, FakeTensor) for t in (recv_x, recv_count, handle.src_route, handle.routing))
