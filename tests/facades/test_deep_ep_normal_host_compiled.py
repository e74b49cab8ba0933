"""The compiled host path of the normal mode's dispatch (uncached and cached) and combine
(gc_moe_compat/deep_ep/_compiled_host.cpp) against the Python path, through ``Buffer`` on the launch-recording CPU
stand-ins of test_deep_ep_normal_launches.py: the same outputs (dtype, shape, strides, device), expert counts and
handles, and the same launches (kernel, grid, stream, peer table, every ``EpNormalParams`` byte, each pointer into
the same role) on several call shapes; every argument the record does not match runs the Python path, which raises
its own exception; ``GC_MOE_DEEP_EP_HOST_PATH=python`` forces the Python path; records are cleared with the
launches they hold."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import ModuleType

import pytest
import torch
import torch.distributed as dist
from compiled_host_kit import (
    TensorSubclass,
    assert_disjoint_parts,
    compiled_or_skip,
    misaligned,
    same_on_both_paths,
    unaligned,
)
from test_deep_ep_normal_launches import FakeDriver, HostWorkspace, install_fakes

from gc_moe_compat.comm import ep_normal
from gc_moe_compat.comm.ep_normal import EpNormalParams
from gc_moe_compat.deep_ep import Buffer, Config, _compiled_host, _normal
from gc_moe_compat.deep_ep._parts import part
from gc_moe_compat.runtime.status import DeviceCheckError, KernelStatus

ENV = _compiled_host.HOST_PATH_ENV
POINTERS = sorted(ep_normal.PER_CALL_FIELDS - {"timeout_ns", "op", "recv_rows"})
H = 256


@pytest.fixture(scope="module")
def fast() -> ModuleType:
    return compiled_or_skip()


@pytest.fixture
def driver_fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeDriver]:
    """The driver stand-ins of test_deep_ep_normal_launches.py, the default host path."""
    yield install_fakes(monkeypatch)
    ep_normal.kernel_of.cache_clear()


@pytest.fixture
def python_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The calls that took the Python path (its functions, counted; ``_received``: its received tensors)."""
    calls: list[str] = []
    for name in ("_checked_dispatch", "_checked_combine", "_received"):
        checked = getattr(_normal.NormalMode, name)

        def counted(*args: object, _checked: Callable = checked, _name: str = name, **kwargs: object) -> object:
            calls.append(_name)
            return _checked(*args, **kwargs)

        monkeypatch.setattr(_normal.NormalMode, name, counted)
    return calls


def _buffer(group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch, ranks: int) -> Buffer:
    monkeypatch.setattr(_normal, "SymmetricWorkspace",
                        lambda layout, group=None, device=None, where=None: HostWorkspace(layout.size, ranks))
    return Buffer(group, 8 << 20, 0)


def _layout(t: object) -> object:
    """What an output must match between the paths: dtype, shape, strides, device, storage offset (so the place of a
    part in its allocation), whether an autograd view (a tuple's items each)."""
    if isinstance(t, tuple):
        return tuple(_layout(item) for item in t)
    if isinstance(t, torch.Tensor):
        return t.dtype, tuple(t.shape), t.stride(), t.device, t.storage_offset(), t._is_view()
    return t


def _symbolic(launches: list, roles: dict[str, object], op_base: int, fresh: str | None = None) -> list:
    """Each launch with every pointer replaced by the role of the tensor it points at (0 stays 0; field ``fresh``
    may point at a tensor of the call's own, none of ``roles``) and the op relative to ``op_base``: equal between
    two calls when they launch the same and every field points at the same role."""
    where = {t.data_ptr(): role for role, t in roles.items() if isinstance(t, torch.Tensor) and t.numel()}
    seen = []
    for launch in launches:
        params = EpNormalParams.from_buffer_copy(launch.params)
        pointers = {}
        for name in POINTERS:
            address = getattr(params, name)
            if address == 0:
                pointers[name] = None
            elif address in where:
                pointers[name] = where[address]
            else:
                assert name == fresh, (name, address, where)
                pointers[name] = "fresh"
            setattr(params, name, 0)
        params.op -= op_base
        seen.append((launch.kernel, launch.grid, launch.block, launch.stream, launch.table, pointers, bytes(params)))
    return seen


class Calls:
    """A scenario's calls on one Buffer: an uncached dispatch, a cached one on its handle, a combine of its rows."""

    def __init__(self, buf: Buffer, fake: FakeDriver, ranks: int, tokens: int, topk: int, fp8: str | None,
                 recv: int, sms: int, align_to: int, worst: int, bias: str | None,
                 weights: bool) -> None:
        self.buf, self.fake, self.ranks, self.sms = buf, fake, ranks, sms
        experts = 8 * ranks
        g = torch.Generator().manual_seed(tokens + 7 * topk)
        x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
        if fp8 is None:
            self.x: object = x
        else:
            scales = torch.rand(3, tokens, generator=g).t() if fp8 == "f32-colmajor" else \
                torch.randint(0, 1 << 20, (tokens, 3), generator=g, dtype=torch.int32) if fp8 == "i32" else \
                torch.rand(tokens, 3, generator=g)
            self.x = (x.to(torch.float8_e4m3fn), scales)
        self.idx = torch.randint(-1, experts, (tokens, topk), generator=g) if topk else None
        self.w = torch.rand(tokens, topk, generator=g) if topk else None
        self.in_rank = torch.rand(tokens, ranks, generator=g) < 0.5
        self.per_rank = self.in_rank.sum(0).to(torch.int32)
        self.per_expert = torch.randint(0, 9, (experts,), generator=g, dtype=torch.int32)
        self.record = [recv, recv + 3, 2 * tokens + 1, *range(5, 5 + 8)]
        self.align_to, self.worst, self.bias, self.weights = align_to, worst, bias, weights
        self.rows = worst or recv
        self.y = torch.randn(self.rows, H, generator=g).to(torch.bfloat16)
        self.cw = torch.rand(self.rows, 2, generator=g) if weights else None
        self.b = [torch.randn(tokens, H, generator=g).to(torch.bfloat16) for _ in range(2)]

    def bias_arg(self) -> object:
        b0, b1 = self.b
        return {None: None, "tensor": b0, "0": (b0, None), "1": (None, b1), "01": (b0, b1)}[self.bias]

    def dispatch(self) -> dict:
        self.fake.record = self.record
        return dict(x=self.x, num_tokens_per_rank=self.per_rank, is_token_in_rank=self.in_rank,
                    num_tokens_per_expert=self.per_expert, topk_idx=self.idx, topk_weights=self.w,
                    expert_alignment=self.align_to, num_worst_tokens=self.worst, config=Config(self.sms, 6, 256))

    def run(self) -> list:
        """The three calls; what each returned (layouts) and launched (symbolically)."""
        mode, seen = self.buf.normal, []
        host = mode._host_counts.get(8)
        base = mode.op
        self.fake.launches = []
        recv_x, recv_idx, recv_w, experts, handle, _ = self.buf.dispatch(**self.dispatch())
        host = mode._host_counts[8][0]
        payload, scales = self.x if isinstance(self.x, tuple) else (self.x, None)
        recv_payload, recv_scales = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
        assert handle[4] is self.in_rank
        roles = dict(x=payload, scales=scales, idx=self.idx, w=self.w, in_rank=self.in_rank, per_rank=self.per_rank,
                     per_expert=self.per_expert, recv_x=recv_payload, recv_scales=recv_scales, recv_idx=recv_idx,
                     recv_w=recv_w, **{f"handle{i}": t for i, t in enumerate(handle)}, host=host,
                     mirror=mode.mirror)
        seen.append((_layout((recv_x, recv_idx, recv_w, tuple(handle))), experts, handle.most_sent,
                     _symbolic(self.fake.launches, roles, base)))
        self.fake.launches = []
        cached = self.buf.dispatch(self.x, handle, config=Config(self.sms, 6, 256))
        c_payload, c_scales = cached[0] if isinstance(cached[0], tuple) else (cached[0], None)
        roles = dict(x=payload, scales=scales, recv_x=c_payload, recv_scales=c_scales, mirror=mode.mirror,
                     **{f"handle{i}": t for i, t in enumerate(handle)})
        seen.append((_layout(cached[:5]), _symbolic(self.fake.launches, roles, base, fresh="recv_src_idx")))
        self.fake.launches = []
        out, out_w, _ = self.buf.combine(self.y, handle, self.cw, self.bias_arg(), config=Config(self.sms, 6, 256))
        b0, b1 = self.b
        roles = dict(y=self.y, w=self.cw, b0=b0, b1=b1, out=out, out_w=out_w, mirror=mode.mirror,
                     **{f"handle{i}": t for i, t in enumerate(handle)})
        seen.append((_layout((out, out_w)), _symbolic(self.fake.launches, roles, base)))
        return seen


SHAPES = {  # ranks, tokens, topk, fp8, recv, sms, expert_alignment, num_worst_tokens, bias, weights
    "bf16": (1, 5, 4, None, 9, 8, 1, 0, None, True),
    "fp8-f32": (2, 300, 8, "f32", 420, 24, 1, 0, "tensor", True),
    "fp8-i32-scales": (2, 64, 2, "i32", 100, 2, 1, 0, "0", False),
    "fp8-colmajor-scales": (2, 64, 4, "f32-colmajor", 33, 8, 1, 0, "1", True),
    "no-topk": (1, 64, 0, None, 40, 8, 1, 0, "01", False),
    "no-topk-fp8": (2, 64, 0, "f32", 40, 40, 1, 0, None, True),
    "expert-alignment": (2, 64, 4, None, 10, 8, 128, 0, None, True),
    "num-worst-tokens": (2, 64, 4, "f32", 0, 8, 1, 77, "01", True),
    "nothing-received": (1, 5, 4, None, 0, 8, 1, 0, None, True),
    "no-tokens": (2, 0, 4, None, 6, 8, 1, 0, "01", True),
    "no-tokens-fp8": (1, 0, 3, "f32", 0, 8, 1, 0, "tensor", False),
}


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_both_paths_give_the_same_outputs_and_parameters(fast: ModuleType, group: dist.ProcessGroup,
                                                         monkeypatch: pytest.MonkeyPatch, driver_fake: FakeDriver,
                                                         python_calls: list, shape: tuple) -> None:
    """Per shape: an uncached dispatch, a cached one on its handle and a combine of its rows under
    ``GC_MOE_DEEP_EP_HOST_PATH=python``, then twice on the default path (the first builds the records, the second
    takes the compiled path throughout): the same output layouts, expert counts, handles and launches."""
    ranks, *rest = shape
    calls = Calls(_buffer(group, monkeypatch, ranks), driver_fake, ranks, *rest)
    monkeypatch.setenv(ENV, "python")
    reference = calls.run()
    assert calls.buf.normal._records == {}
    monkeypatch.delenv(ENV)
    python_calls.clear()
    assert calls.run() == reference
    assert python_calls == ["_checked_dispatch", "_received", "_checked_dispatch", "_received", "_checked_combine"]
    python_calls.clear()
    assert calls.run() == reference
    assert python_calls == []


@pytest.mark.parametrize("host_path", ["python", "compiled"])
def test_small_outputs_are_disjoint_parts_of_one_allocation(fast: ModuleType, group: dist.ProcessGroup,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            driver_fake: FakeDriver, host_path: str) -> None:
    """On either path: the handle's four int32 matrices are parts of one allocation (made before notify's launch),
    ``recv_src_idx``, the received top-k ids and weights and the FP8 scales parts of another (after the CPU wait),
    ``recv_x`` an allocation of its own; no part is an autograd view (DeepEP returns separate tensors)."""
    monkeypatch.setenv(ENV, host_path)
    calls = Calls(_buffer(group, monkeypatch, 2), driver_fake, 2, 300, 8, "f32", 420, 24, 1, 0, None, True)
    for _ in range(2):  # the second call takes the compiled path where it is asked for
        (recv_x, recv_scales), recv_idx, recv_w, _, handle, _ = calls.buf.dispatch(**calls.dispatch())
    rank_prefix, channel_prefix, recv_channel_prefix, recv_src_idx, _, send_head = handle
    assert_disjoint_parts([(rank_prefix, torch.int32, (2, 2)), (channel_prefix, torch.int32, (2, 12)),
                           (send_head, torch.int32, (300, 2)),
                           (recv_channel_prefix, torch.int32, (2, 12))])
    assert_disjoint_parts([(recv_src_idx, torch.int32, (420,)), (recv_idx, torch.int64, (420, 8)),
                           (recv_w, torch.float32, (420, 8)), (recv_scales, torch.float32, (420, 3))])
    assert recv_x.untyped_storage().data_ptr() not in {
        t.untyped_storage().data_ptr() for t in (recv_src_idx, rank_prefix)}
    assert recv_x.storage_offset() == 0 and not recv_x._is_view()


def test_a_lone_recv_src_idx_is_its_own_allocation(group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch,
                                                   driver_fake: FakeDriver) -> None:
    """Without top-k and scales ``recv_src_idx`` is the only small received tensor: an allocation of its own, not
    the one part of a one-part allocation, which would only add host work (the Python path's parts counted; the
    compiled path's outputs equal its, test_both_paths_give_the_same_outputs_and_parameters)."""
    made = []

    def counted(block: torch.Tensor, dtype: torch.dtype, start: int, shape: tuple) -> torch.Tensor:
        made.append(tuple(shape))
        return part(block, dtype, start, shape)

    monkeypatch.setenv(ENV, "python")
    monkeypatch.setattr(_normal, "part", counted)
    calls = Calls(_buffer(group, monkeypatch, 1), driver_fake, 1, 64, 0, None, 40, 8, 1, 0, None, False)
    _, recv_idx, recv_w, _, handle, _ = calls.buf.dispatch(**calls.dispatch())
    assert recv_idx is None and recv_w is None and handle[3].shape == (40,)
    assert made == [(1, 1), (1, 4), (64, 1), (1, 4)]  # the handle's four matrices only
    assert (handle[3].storage_offset(), handle[3]._is_view(), handle[3].untyped_storage().nbytes()) == (0, False, 160)


def test_compiled_calls_allocate_fresh_outputs(fast: ModuleType, group: dist.ProcessGroup,
                                               monkeypatch: pytest.MonkeyPatch, driver_fake: FakeDriver,
                                               python_calls: list) -> None:
    """The compiled path's outputs are each call's own tensors, and its launches point at them."""
    calls = Calls(_buffer(group, monkeypatch, 2), driver_fake, 2, 64, 4, "f32", 20, 8, 1, 0, None, True)
    firsts = [calls.buf.dispatch(**calls.dispatch()) for _ in range(2)]
    python_calls.clear()
    driver_fake.launches = []
    out = calls.buf.dispatch(**calls.dispatch())
    assert python_calls == []
    for first in firsts:
        assert out[0][0].data_ptr() != first[0][0].data_ptr() and out[4][0].data_ptr() != first[4][0].data_ptr()
    fields = driver_fake.launches[1].fields()
    assert (fields["recv_x"], fields["recv_scales"], fields["recv_src_idx"], fields["send_head"]) == (
        out[0][0].data_ptr(), out[0][1].data_ptr(), out[4][3].data_ptr(), out[4][5].data_ptr())


def test_every_mismatch_raises_the_python_paths_exception(fast: ModuleType, group: dist.ProcessGroup,
                                                          monkeypatch: pytest.MonkeyPatch, driver_fake: FakeDriver,
                                                          python_calls: list) -> None:
    """With the shapes' records in place, each bad argument (type, dtype, rank, shape, device, layout, alignment,
    a flag's type or range, a forged handle, a bias form) raises what ``GC_MOE_DEEP_EP_HOST_PATH=python`` raises,
    message included, through the Python path, and launches nothing; arguments the Python path accepts but the
    records do not (tensor subclasses, a tuple subclass) run the Python path."""
    calls = Calls(_buffer(group, monkeypatch, 2), driver_fake, 2, 6, 4, "f32", 5, 8, 1, 0, "01", True)
    buf, cfg = calls.buf, Config(8, 6, 256)
    handle = None
    for _ in range(2):
        handle = buf.dispatch(**calls.dispatch())[4]
        buf.dispatch(calls.x, handle, config=cfg)
        buf.combine(calls.y, handle, calls.cw, calls.bias_arg(), config=cfg)
        buf.combine(calls.y, handle, None, None, config=cfg)  # the record without top-k weights
    assert python_calls.count("_checked_dispatch") == 2 and python_calls.count("_checked_combine") == 2
    payload, scales = calls.x
    launched = len(driver_fake.launches)
    forged = [_normal.NormalHandle(tuple(handle[:i]) + (member,) + tuple(handle[i + 1:]), handle.most_sent)
              for i, member in ((0, handle[0].float()), (1, handle[1][:, :2]), (2, handle[2].tolist()),
                                (3, handle[3].long()), (4, handle[4].int()), (5, handle[5].t()),
                                (0, handle[0].to("meta")), (5, misaligned((6, 2), torch.int32)))]
    bad_dispatch = {
        "x list": dict(x=[1]), "x bf16 float32": dict(x=payload.float()), "x triple": dict(x=(payload, scales, None)),
        "x scales float16": dict(x=(payload, scales.half())), "x scales rows": dict(x=(payload, scales[:2])),
        "x payload bf16": dict(x=(payload.to(torch.bfloat16), scales)), "x 3-D": dict(x=(payload[None], scales)),
        "x non-contiguous": dict(x=(payload.t().contiguous().t(), scales)),
        "x misaligned": dict(x=(misaligned((6, H), torch.float8_e4m3fn), scales)),
        "x meta": dict(x=(payload.to("meta"), scales)), "x hidden": dict(x=(payload[:, :8], scales)),
        "per_rank int64": dict(num_tokens_per_rank=calls.per_rank.long()),
        "per_rank none": dict(num_tokens_per_rank=None), "in_rank int": dict(is_token_in_rank=calls.in_rank.int()),
        "in_rank shape": dict(is_token_in_rank=calls.in_rank[:3]),
        "per_expert odd": dict(num_tokens_per_expert=calls.per_expert[:5]),
        "idx without weights": dict(topk_weights=None), "weights without idx": dict(topk_idx=None),
        "idx float": dict(topk_idx=calls.idx.float()), "idx int32": dict(topk_idx=calls.idx.int()),
        "idx 33": dict(topk_idx=torch.zeros(6, 33, dtype=torch.int64), topk_weights=torch.zeros(6, 33)),
        "idx 0": dict(topk_idx=calls.idx[:, :0], topk_weights=calls.w[:, :0]),
        "weights float64": dict(topk_weights=calls.w.double()), "weights shape": dict(topk_weights=calls.w[:, :2]),
        "worst without topk": dict(topk_idx=None, topk_weights=None, num_worst_tokens=4),
        "worst too many": dict(num_worst_tokens=1 << 20), "worst negative": dict(num_worst_tokens=-1),
        "worst bool": dict(num_worst_tokens=True), "alignment float": dict(expert_alignment=1.0),
        "alignment bool": dict(expert_alignment=True), "alignment 0": dict(expert_alignment=0),
        "rdma": dict(num_tokens_per_rdma_rank=calls.per_rank), "config": dict(config={}),
        "config odd": dict(config=Config(7, 6, 256)), "async str": dict(async_finish="yes"),
    }
    bad_cached = {
        "x list": dict(x=[1]), "x tokens": dict(x=(payload[:3], scales[:3])), "x bf16": dict(x=payload),
        "handle tuple": dict(handle=tuple(handle)), "handle short": dict(handle=_normal.NormalHandle(handle[:5], 1)),
        "most_sent str": dict(handle=_normal.NormalHandle(tuple(handle), "1")),
        "most_sent bool": dict(handle=_normal.NormalHandle(tuple(handle), True)),
        "most_sent negative": dict(handle=_normal.NormalHandle(tuple(handle), -1)),
        "topk given": dict(topk_idx=calls.idx), "config channels": dict(config=Config(10, 6, 256)),
        **{f"handle forged {i}": dict(handle=h) for i, h in enumerate(forged)},
    }
    bad_combine = {
        "x rows": dict(x=calls.y[:2]), "x float32": dict(x=calls.y.float()), "x list": dict(x=[1]),
        "x hidden": dict(x=calls.y[:, :4].contiguous()), "x misaligned": dict(x=misaligned((5, H), torch.bfloat16)),
        "weights 33": dict(topk_weights=torch.zeros(5, 33)), "weights 0": dict(topk_weights=torch.zeros(5, 0)),
        "weights rows": dict(topk_weights=calls.cw[:2]),
        "weights int": dict(topk_weights=calls.cw.int()), "bias list": dict(bias=[calls.b[0]]),
        "bias triple": dict(bias=(None, None, None)), "bias shape": dict(bias=(None, calls.b[1][:, :8])),
        "bias float": dict(bias=calls.b[0].float()), "bias list in pair": dict(bias=([1], None)),
        "handle tuple": dict(handle=tuple(handle)), "config channels": dict(config=Config(10, 6, 256)),
        "most_sent float": dict(handle=_normal.NormalHandle(tuple(handle), 1.0)),
        "most_sent too many": dict(handle=_normal.NormalHandle(tuple(handle), 1 << 40)),
        **{f"handle forged {i}": dict(handle=h) for i, h in enumerate(forged)},
    }

    def both(call: Callable[[], object], early: bool) -> tuple[type, str] | None:
        return same_on_both_paths(call, monkeypatch, python_calls, must_fall_back=not early)

    early = ("config", "config odd", "async str")
    for name, bad in bad_dispatch.items():
        args = calls.dispatch() | bad
        error = both(lambda a=args: buf.dispatch(**a), name in early)
        assert error is not None and error[0] in (TypeError, ValueError, NotImplementedError), (name, error)
    for name, bad in bad_cached.items():
        args = dict(x=calls.x, handle=handle, config=cfg) | bad
        error = both(lambda a=args: buf.dispatch(**a), False)
        assert error is not None and error[0] in (TypeError, ValueError), (name, error)
    for name, bad in bad_combine.items():
        args = dict(x=calls.y, handle=handle, topk_weights=calls.cw, bias=calls.bias_arg(), config=cfg) | bad
        error = both(lambda a=args: buf.combine(**a), False)
        assert error is not None and error[0] in (TypeError, ValueError), (name, error)
    assert len(driver_fake.launches) == launched
    # Accepted by the Python path, not by the records: the Python path runs and succeeds.
    b0, b1 = calls.b

    class Pair(tuple):
        """A tuple subclass (the Python path takes it as a pair)."""

    sub_handle = _normal.NormalHandle((handle[0].as_subclass(TensorSubclass), *handle[1:]), handle.most_sent)
    for accepted in (lambda: buf.dispatch(**calls.dispatch() | dict(x=(payload.as_subclass(TensorSubclass), scales))),
                     lambda: buf.dispatch(**calls.dispatch() | dict(is_token_in_rank=calls.in_rank.as_subclass(
                         TensorSubclass))),
                     lambda: buf.dispatch(**calls.dispatch() | dict(x=Pair((payload, scales)))),
                     lambda: buf.dispatch(Pair(calls.x), handle, config=cfg),
                     lambda: buf.combine(calls.y.as_subclass(TensorSubclass), handle, calls.cw, (b0, b1), config=cfg),
                     lambda: buf.combine(calls.y, handle, calls.cw, Pair((b0, b1)), config=cfg),
                     lambda: buf.combine(calls.y, sub_handle, calls.cw, (b0, b1), config=cfg)):
        python_calls.clear()
        accepted()
        assert python_calls and python_calls[0] in ("_checked_dispatch", "_checked_combine")


def test_routing_row_slices_take_the_compiled_path(fast: ModuleType, group: dist.ProcessGroup,
                                                   monkeypatch: pytest.MonkeyPatch, driver_fake: FakeDriver,
                                                   python_calls: list) -> None:
    """The routing and the counts (read element by element) one element past a 16-byte boundary, as a row slice of
    a top-6 batch is, pass the records' checks as the Python path's: the dispatch, a cached dispatch on its handle
    (which holds that is_token_in_rank) and a combine with such weights run on the compiled path, their launches
    pointing at the slices; one byte past an element boundary runs the Python path, which refuses it."""
    calls = Calls(_buffer(group, monkeypatch, 2), driver_fake, 2, 6, 4, "f32", 5, 8, 1, 0, None, True)
    buf, cfg = calls.buf, Config(8, 6, 256)
    for _ in range(2):  # the records, then the compiled path
        handle = buf.dispatch(**calls.dispatch())[4]
        buf.dispatch(calls.x, handle, config=cfg)
        buf.combine(calls.y, handle, calls.cw, None, config=cfg)
    sliced = {name: misaligned(tuple(t.shape), t.dtype).copy_(t) for name, t in (
        ("num_tokens_per_rank", calls.per_rank), ("is_token_in_rank", calls.in_rank),
        ("num_tokens_per_expert", calls.per_expert), ("topk_idx", calls.idx), ("topk_weights", calls.w))}
    python_calls.clear()
    driver_fake.launches = []
    handle = buf.dispatch(**calls.dispatch() | sliced)[4]
    weights = misaligned(tuple(calls.cw.shape), calls.cw.dtype).copy_(calls.cw)
    buf.dispatch(calls.x, handle, config=cfg)
    buf.combine(calls.y, handle, weights, None, config=cfg)
    assert python_calls == [] and handle[4] is sliced["is_token_in_rank"]
    notify, send = (launch.fields() for launch in driver_fake.launches[:2])
    assert (notify["num_tokens_per_rank"], notify["is_token_in_rank"], notify["num_tokens_per_expert"]) == (
        sliced["num_tokens_per_rank"].data_ptr(), sliced["is_token_in_rank"].data_ptr(),
        sliced["num_tokens_per_expert"].data_ptr())
    assert (send["topk_idx"], send["topk_weights"]) == (sliced["topk_idx"].data_ptr(),
                                                        sliced["topk_weights"].data_ptr())
    assert driver_fake.launches[-1].fields()["topk_weights"] == weights.data_ptr()
    for name in ("num_tokens_per_rank", "topk_idx", "topk_weights"):
        t = sliced[name]
        bad = calls.dispatch() | {name: unaligned(tuple(t.shape), t.dtype).copy_(t)}
        error = same_on_both_paths(lambda a=bad: buf.dispatch(**a), monkeypatch, python_calls)
        assert error is not None and f"{name} must be aligned to its" in error[1], (name, error)


TOPK_IDX_REFUSED = (r"^{fn}: topk_idx must be \[{rows}, \*\] of torch.int64 "
                    r"\(deep_ep.topk_idx_t, which DeepEP asserts\), got \[6, 4\] torch.int32$")


def test_an_int32_topk_idx_is_refused_after_its_shape_was_recorded(fast: ModuleType, group: dist.ProcessGroup,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   driver_fake: FakeDriver,
                                                                   python_calls: list) -> None:
    """DeepEP's ``topk_idx_t`` is int64: once int64 dispatches of a shape have built its record (the second one
    takes the compiled path), an int32 ``topk_idx`` of the same shape is never served by it: each such dispatch,
    first and second, runs the Python path and raises its ``ValueError`` (the message of
    ``GC_MOE_DEEP_EP_HOST_PATH=python``), launching nothing; ``get_dispatch_layout`` (checked in Python at every
    call) refuses it alike after int64 calls of its shape."""
    buf = _buffer(group, monkeypatch, 2)
    calls = Calls(buf, driver_fake, 2, 6, 4, None, 5, 8, 1, 0, None, True)
    for _ in range(2):
        buf.get_dispatch_layout(calls.idx, 16)
        buf.dispatch(**calls.dispatch())
    assert python_calls.count("_checked_dispatch") == 1  # the second dispatch: the compiled path
    launched = len(driver_fake.launches)
    narrow = calls.idx.int()
    for fn, rows, call in (("dispatch", 6, lambda: buf.dispatch(**calls.dispatch() | dict(topk_idx=narrow))),
                           ("get_dispatch_layout", r"\*", lambda: buf.get_dispatch_layout(narrow, 16))):
        python_calls.clear()
        for _ in range(2):
            with pytest.raises(ValueError, match=TOPK_IDX_REFUSED.format(fn=fn, rows=rows)):
                call()
        assert python_calls == (["_checked_dispatch"] * 2 if fn == "dispatch" else [])
    error = same_on_both_paths(lambda: buf.dispatch(**calls.dispatch() | dict(topk_idx=narrow)), monkeypatch,
                               python_calls)
    assert error is not None and error[0] is ValueError
    assert len(driver_fake.launches) == launched
    python_calls.clear()
    buf.dispatch(**calls.dispatch())
    assert python_calls == []  # the int64 call still takes the compiled path


def test_a_new_shape_gets_its_own_record(fast: ModuleType, group: dist.ProcessGroup,
                                         monkeypatch: pytest.MonkeyPatch, driver_fake: FakeDriver,
                                         python_calls: list) -> None:
    """Another token count, flag or config is a new record (its first call the Python path); each shape's later
    calls take the compiled path, whichever ran in between; records are cleared with the launches they hold."""
    buf = _buffer(group, monkeypatch, 1)
    shapes = {t: Calls(buf, driver_fake, 1, t, 2, None, 3, 8, 1, 0, None, False) for t in (3, 9)}
    for t in (3, 9, 3, 9):
        buf.dispatch(**shapes[t].dispatch())
    buf.dispatch(**shapes[3].dispatch() | dict(expert_alignment=4))
    buf.dispatch(**shapes[3].dispatch() | dict(config=Config(10, 6, 256)))
    assert python_calls.count("_checked_dispatch") == 4
    records = buf.normal._records
    assert {key[0]: key[2:] for key in records} == {"dispatch": (10, 1, 0)}
    assert sorted((key[2:], len(r)) for key, r in records.items()) == [((8, 1, 0), 2), ((8, 4, 0), 1),
                                                                       ((10, 1, 0), 1)]
    for kept in records.values():
        for record in kept.values():
            assert record.launch in buf.normal._launches.values()
    monkeypatch.setattr(_normal, "MAX_LAUNCH_SHAPES", len(buf.normal._launches))
    buf.dispatch(**shapes[9].dispatch() | dict(expert_alignment=2))  # a new launch: the caches start again
    assert [len(r) for r in records.values()] == [1] and len(buf.normal._launches) == 1


def test_the_variable_forces_the_python_path(fast: ModuleType, group: dist.ProcessGroup,
                                             monkeypatch: pytest.MonkeyPatch, driver_fake: FakeDriver,
                                             python_calls: list) -> None:
    """``GC_MOE_DEEP_EP_HOST_PATH=python``: every call checks in Python, records or not, and builds none."""
    buf = _buffer(group, monkeypatch, 2)
    calls = Calls(buf, driver_fake, 2, 6, 4, None, 5, 8, 1, 0, None, True)
    monkeypatch.setenv(ENV, "python")
    calls.run()
    assert buf.normal._records == {}
    monkeypatch.delenv(ENV)
    calls.run()
    assert buf.normal._records != {}
    monkeypatch.setenv(ENV, "python")
    python_calls.clear()
    calls.run()
    assert python_calls == ["_checked_dispatch", "_received", "_checked_dispatch", "_received", "_checked_combine"]
    monkeypatch.setenv(ENV, "cpp")
    for call in (lambda: buf.dispatch(**calls.dispatch()), lambda: buf.combine(calls.y, None)):
        with pytest.raises(ValueError, match=rf"{ENV}: must be one of \('compiled', 'python'\) .* got 'cpp'"):
            call()


def test_recorded_errors_are_raised_before_a_compiled_launch(fast: ModuleType, group: dist.ProcessGroup,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             driver_fake: FakeDriver, python_calls: list) -> None:
    """What the kernels recorded is raised at the next call's launch boundary on the compiled path too, before its
    launches and its op number."""
    buf = _buffer(group, monkeypatch, 2)
    calls = Calls(buf, driver_fake, 2, 6, 4, None, 5, 8, 1, 0, None, True)
    calls.run()
    handle = buf.dispatch(**calls.dispatch())[4]
    record = KernelStatus(code=2, site=ep_normal.NormalSite.EXPERT_RANGE << 16, observed=300, expected=16)
    cfg = Config(8, 6, 256)
    for call in (lambda: buf.dispatch(**calls.dispatch()), lambda: buf.dispatch(calls.x, handle, config=cfg),
                 lambda: buf.combine(calls.y, handle, calls.cw, config=cfg)):
        buf.normal.mirror[ep_normal.Kernel.LAYOUT] = torch.frombuffer(bytearray(bytes(record)), dtype=torch.uint8)
        python_calls.clear()
        driver_fake.launches, op = [], buf.normal.op
        with pytest.raises(DeviceCheckError, match="recorded by an earlier call"):
            call()
        assert driver_fake.launches == [] and python_calls == [] and buf.normal.op == op
