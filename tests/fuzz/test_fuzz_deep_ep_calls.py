"""Fuzz of the deep_ep facade's size and option arguments beyond ``Buffer`` construction (see
test_fuzz_native_and_deep_ep.py for that): ``get_low_latency_rdma_size_hint``, the sizes of ``low_latency_dispatch``,
the flags of ``low_latency_combine``, and normal mode's ``get_dispatch_layout`` / ``dispatch`` options, each against
the model of valid inputs (tests/kit/fuzz_model.py): one argument of a valid baseline replaced by a drawn value, the
model's verdict asserted. CPU only: the workspaces are host stand-ins (tests/fuzz/conftest.py); a low-latency launch
is recorded, a normal-mode call that passes every check stops at its launch's GPU refusal, which counts as
accepted."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from fuzz_model import NEEDS_GPU, Flag, Int, Spec, check, draw, expect, values
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gc_moe_compat.comm.ep_ll import MAX_EXPERTS as LL_MAX_EXPERTS
from gc_moe_compat.comm.ep_ll import MAX_RANKS as LL_MAX_RANKS
from gc_moe_compat.comm.ep_ll import required_bytes
from gc_moe_compat.comm.ep_normal import HEADER_BYTES as NVL_HEADER_BYTES
from gc_moe_compat.comm.ep_normal import Kernel as NormalKernel
from gc_moe_compat.comm.ep_normal import NormalSite, data_offset, new_status_mirror, raise_for_mirrored_status
from gc_moe_compat.config import MAX_SMS
from gc_moe_compat.deep_ep import Buffer, Config, _low_latency, _normal
from gc_moe_compat.deep_ep._config import BUFFER_ALIGNMENT_BYTES
from gc_moe_compat.deep_ep._normal import NormalHandle
from gc_moe_compat.runtime.status import STATUS_MISMATCH, DeviceCheckError, KernelStatus

if TYPE_CHECKING:
    from conftest import DeepEpHost

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
C_INT_MAX = (1 << 31) - 1
"""DeepEP's sizes and counts are C ints (pybind refuses a larger Python int): the model's bound for them."""
FUZZ = settings(max_examples=120, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
T, H, K, E, TMAX = 6, 256, 4, 8, 8


@pytest.fixture
def host_buffers(deep_ep_host: DeepEpHost) -> tuple[Buffer, Buffer, list]:
    """A low-latency Buffer whose launches are recorded and a normal-mode Buffer whose calls stop at the GPU refusal
    of their launch."""
    return deep_ep_host.buffer(0, LL_BYTES, low_latency_mode=True), deep_ep_host.buffer(1 << 20, 0), \
        deep_ep_host.launched


HINT_BASE = dict(num_max_dispatch_tokens_per_rank=TMAX, hidden=H, num_ranks=1, num_experts=E)
HINT_SPECS: dict[str, Spec] = {  # Tmax and hidden are DeepEP's C ints (issue 32: no 400-digit hint)
    "num_max_dispatch_tokens_per_rank": Int(1, C_INT_MAX, draw_max=4096),
    "hidden": Int(1, C_INT_MAX, multiple=128, draw_max=16384),
    "num_ranks": Int(1, LL_MAX_RANKS, extra=lambda p: E % p == 0),
    "num_experts": Int(1, LL_MAX_EXPERTS),
}


@FUZZ
@given(case=draw(HINT_SPECS))
def test_low_latency_size_hint(default_dtype: torch.dtype, case: tuple[str, object]) -> None:
    """Every accepted size gives a positive int of bytes; every refused one names its argument."""
    name, value = case
    kwargs = {**HINT_BASE, name: value}
    want = expect(HINT_SPECS[name], value)
    got: list[object] = []
    check(lambda: got.append(Buffer.get_low_latency_rdma_size_hint(**kwargs)), want, (name,),
          what=f"get_low_latency_rdma_size_hint({name}={value!r})")
    if want is None:
        assert type(got[0]) is int and got[0] > 0, got


def test_low_latency_size_hint_is_a_byte_count_buffer_takes(default_dtype: torch.dtype) -> None:
    """Sizes each within its bound whose hint would pass the largest num_rdma_bytes (an int64) are refused naming
    them; the largest sizes whose hint fits give it."""
    big = (C_INT_MAX, C_INT_MAX - C_INT_MAX % 128, 1, LL_MAX_EXPERTS)
    check(lambda: Buffer.get_low_latency_rdma_size_hint(*big), ValueError, ("num_max_dispatch_tokens_per_rank",),
          what=f"get_low_latency_rdma_size_hint{big}")
    hint = Buffer.get_low_latency_rdma_size_hint(C_INT_MAX, 128, 1, 1)
    assert type(hint) is int and 0 < hint < 2**63


LL_BYTES = Buffer.get_low_latency_rdma_size_hint(TMAX, H, 1, E)


def _fits(max_tokens: int = TMAX, hidden: int = H, experts: int = E, topk: int = K) -> bool:
    """The documented size rule of a call: its workspace bytes (the hint's formula) within the Buffer's."""
    return required_bytes(_low_latency.ll_shape(1, max_tokens, hidden, experts, topk)) <= LL_BYTES


LL_DISPATCH_SPECS: dict[str, Spec] = {
    # >= the tokens, fits, and (one rank) a multiple of 4: DeepEP's TMA rule on the group size x Tmax
    "num_max_dispatch_tokens_per_rank": Int(T, C_INT_MAX, extra=lambda t: _fits(t) and t % 4 == 0, draw_max=4 * TMAX),
    "num_experts": Int(K, LL_MAX_EXPERTS, extra=lambda e: e <= E),  # >= top-k (every id < E); sized for E
}


@FUZZ
@given(case=draw(LL_DISPATCH_SPECS))
def test_low_latency_dispatch_sizes(host_buffers: tuple[Buffer, Buffer, list], default_dtype: torch.dtype,
                                    case: tuple[str, object]) -> None:
    name, value = case
    ll, _, launched = host_buffers
    x = torch.randn(T, H, dtype=torch.float32).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(K, dtype=torch.int64) for _ in range(T)])  # ids < K: valid for every E >= K
    kwargs = {"num_max_dispatch_tokens_per_rank": TMAX, "num_experts": E, name: value}
    before = len(launched)
    want = expect(LL_DISPATCH_SPECS[name], value)
    check(lambda: ll.low_latency_dispatch(x, idx, **kwargs), want, (name, "num_rdma_bytes", "topk_idx"),
          what=f"low_latency_dispatch({name}={value!r})")
    assert (len(launched) > before) == (want is None)  # refused: nothing launched


LL_COMBINE_SPECS: dict[str, Spec] = {
    "use_logfmt": Flag(refused=(True,), refused_with=NotImplementedError),
    "zero_copy": Flag(),
    "return_recv_hook": Flag(),
}
"""async_finish=True makes a CUDA event: its type check is in tests/facades/test_bad_input.py."""


@FUZZ
@given(case=draw(LL_COMBINE_SPECS))
def test_low_latency_combine_flags(host_buffers: tuple[Buffer, Buffer, list], default_dtype: torch.dtype,
                                   case: tuple[str, object]) -> None:
    name, value = case
    ll, _, launched = host_buffers
    x = torch.randn(T, H, dtype=torch.float32).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, dtype=torch.int64)[:K] for _ in range(T)])
    w = torch.rand(T, K, dtype=torch.float32)
    _, _, handle, _, _ = ll.low_latency_dispatch(x, idx, TMAX, E, use_fp8=False)
    expert_out = torch.zeros(E, TMAX, H, dtype=torch.bfloat16)
    before = len(launched)
    want = expect(LL_COMBINE_SPECS[name], value)
    check(lambda: ll.low_latency_combine(expert_out, idx, w, handle, **{name: value}), want, (name,),
          what=f"low_latency_combine({name}={value!r})")
    assert (len(launched) > before) == (want is None)


NORMAL_LAYOUT_SPECS: dict[str, Spec] = {
    # the host rule; ids outside [-1, num_experts) are values only the device sees (the layout kernel reports them)
    "num_experts": Int(1, _normal.MAX_EXPERTS),
    "async_finish": Flag(),
}


@FUZZ
@given(case=draw(NORMAL_LAYOUT_SPECS))
def test_normal_get_dispatch_layout(host_buffers: tuple[Buffer, Buffer, list], default_dtype: torch.dtype,
                                    case: tuple[str, object]) -> None:
    name, value = case
    _, normal, _ = host_buffers
    idx = torch.randint(-1, E, (T, K), dtype=torch.int64)
    kwargs = {"num_experts": E, name: value}
    want = expect(NORMAL_LAYOUT_SPECS[name], value)
    check(lambda: normal.get_dispatch_layout(idx, **kwargs), want, (name,), boundary=NEEDS_GPU,
          what=f"get_dispatch_layout({name}={value!r})")


@pytest.mark.parametrize(("name", "observed", "expected", "names"), [
    ("EXPERT_NEGATIVE", 5, 1, r"a topk_idx entry below -1 \(observed: its negation\).*observed 5, expected 1"),
    ("EXPERT_RANGE", 9, 8, r"a topk_idx entry \(observed\) >= num_experts \(expected\).*observed 9, expected 8"),
])
def test_normal_layout_reports_name_ids_outside_the_experts(default_dtype: torch.dtype, name: str, observed: int,
                                                            expected: int, names: str) -> None:
    """Issue 32 item 5: ids below -1 are only seen on the device, like ids >= num_experts: the layout kernel
    (kernels/sm90/ep_normal.cu) records each at a site of its own, which the host names with the value (the GPU
    test: tests/facades/test_deep_ep_normal.py)."""
    site = NormalSite[name]
    assert "kNormalSite" + name.title().replace("_", "") in (KERNELS / "sm90" / "ep_normal.cu").read_text()
    workspace, mirror = torch.zeros(NVL_HEADER_BYTES, dtype=torch.uint8), new_status_mirror(torch.device("cpu"))
    record = bytes(KernelStatus(STATUS_MISMATCH, site << 16, observed, expected, 0))
    mirror[NormalKernel.LAYOUT] = torch.frombuffer(bytearray(record), dtype=torch.uint8)
    with pytest.raises(DeviceCheckError, match=r"gc_ep_normal_layout \(recorded by an earlier call\): " + names):
        raise_for_mirrored_status(workspace, mirror, 1)
    assert not mirror.any()  # cleared: reported once


NORMAL_DISPATCH_SPECS: dict[str, Spec] = {
    "expert_alignment": Int(1, 1 << 20),
    "num_worst_tokens": Int(0, (1 << 31) - 1, draw_max=64),
    "async_finish": Flag(),
    "allocate_on_comm_stream": Flag(refused=(True,)),  # DeepEP's rule: needs a previous_event and async_finish
    # set on a Config after construction (issue 32): two SMs per channel, at most the device's (a host: MAX_SMS)
    "config.num_sms": Int(2, MAX_SMS, multiple=2),
}


@FUZZ
@given(case=draw(NORMAL_DISPATCH_SPECS))
def test_normal_dispatch_options(host_buffers: tuple[Buffer, Buffer, list], default_dtype: torch.dtype,
                                 case: tuple[str, object]) -> None:
    name, value = case
    _, normal, _ = host_buffers
    x = torch.randn(T, H, dtype=torch.float32).to(torch.bfloat16)
    idx = torch.randint(-1, E, (T, K), dtype=torch.int64)
    layout = dict(num_tokens_per_rank=torch.zeros(1, dtype=torch.int32),
                  is_token_in_rank=torch.zeros(T, 1, dtype=torch.bool),
                  num_tokens_per_expert=torch.zeros(E, dtype=torch.int32))
    config = Config(8, 6, 256)
    kwargs = {**layout, "topk_idx": idx, "topk_weights": torch.rand(T, K, dtype=torch.float32), "config": config}
    if name == "config.num_sms":
        config.num_sms = value
    else:
        kwargs[name] = value
    want = expect(NORMAL_DISPATCH_SPECS[name], value)
    check(lambda: normal.dispatch(x, **kwargs), want, (name,), boundary=NEEDS_GPU,
          what=f"dispatch({name}={value!r})")


ROWS = 5
NORMAL_CALLS = ("get_dispatch_layout", "uncached dispatch", "cached dispatch", "combine")


def _normal_call(buf: Buffer, call: str, sms: int) -> tuple[object, int]:
    """``(call, the num_nvl_bytes it needs before its launch)``: the header for get_dispatch_layout, the header
    and the call's exchanged counts (``data_offset``: they grow with ``config.num_sms``) for a dispatch or a combine;
    the cached dispatch and the combine take the handle of a ``num_worst_tokens`` dispatch (no row count on it), over
    ``sms / 2`` channels (one for an ``sms`` past ``MAX_SMS``: the config is refused before the handle is read)."""
    channels, config = sms // 2 if sms <= MAX_SMS else 1, Config(sms, 6, 256)
    x = torch.randn(T, H, dtype=torch.float32).to(torch.bfloat16)
    idx = torch.randint(-1, E, (T, K), dtype=torch.int64)
    handle = NormalHandle((torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, channels, dtype=torch.int32),
                           torch.zeros(1, channels, dtype=torch.int32), torch.zeros(ROWS, dtype=torch.int32),
                           torch.zeros(T, 1, dtype=torch.bool), torch.zeros(T, 1, dtype=torch.int32)), most_sent=None)
    layout = dict(num_tokens_per_rank=torch.zeros(1, dtype=torch.int32),
                  is_token_in_rank=torch.zeros(T, 1, dtype=torch.bool),
                  num_tokens_per_expert=torch.zeros(E, dtype=torch.int32))
    if call == "get_dispatch_layout":
        return lambda: buf.get_dispatch_layout(idx, E), NVL_HEADER_BYTES
    if call == "uncached dispatch":
        return (lambda: buf.dispatch(x, **layout, topk_idx=idx, topk_weights=torch.rand(T, K, dtype=torch.float32),
                                    config=config),
                data_offset(1, E, channels).data)
    if call == "cached dispatch":  # the handle's routing: one "expert" per rank
        return lambda: buf.dispatch(x, handle=handle, config=config), data_offset(1, 1, channels).data
    rows = torch.zeros(ROWS, H, dtype=torch.bfloat16)
    return lambda: buf.combine(rows, handle, config=config), data_offset(1, 1, channels).data


@FUZZ
@given(nvl_bytes=st.one_of(st.integers(0, 15_000 // BUFFER_ALIGNMENT_BYTES).map(lambda n: n * BUFFER_ALIGNMENT_BYTES),
                           st.sampled_from([BUFFER_ALIGNMENT_BYTES, NVL_HEADER_BYTES - BUFFER_ALIGNMENT_BYTES,
                                            NVL_HEADER_BYTES])),
       sms=st.sampled_from([2, 8, 256, MAX_SMS]), call=st.sampled_from(NORMAL_CALLS))
def test_normal_calls_need_the_header_and_their_counts(deep_ep_host: DeepEpHost, default_dtype: torch.dtype,
                                                       nvl_bytes: int, sms: int, call: str) -> None:
    """Issue 32 items 2 and 3: a Buffer of any num_nvl_bytes that DeepEP takes (a multiple of 128) constructs (as
    DeepEP's: its raw view needs no header),
    and each normal-mode kernel call is refused before its launch, naming num_nvl_bytes, when the Buffer cannot hold
    the kernels' fixed header (get_dispatch_layout) or the header and the call's counts (dispatch, combine: named with
    config.num_sms, which they grow with); else it reaches the launch's GPU refusal."""
    buf = deep_ep_host.buffer(nvl_bytes, 0)
    run, need = _normal_call(buf, call, sms)
    want = ValueError if nvl_bytes < need else None
    names = ("num_nvl_bytes",) if nvl_bytes < NVL_HEADER_BYTES or call == "get_dispatch_layout" else \
        (f"config.num_sms={sms}",)
    check(run, want, names, boundary=NEEDS_GPU, what=f"{call} with num_nvl_bytes={nvl_bytes}, num_sms={sms}")


@pytest.mark.parametrize("sms", [10**6, 2**31 - 2, MAX_SMS + 2])
@pytest.mark.parametrize("call", ["uncached dispatch", "cached dispatch", "combine"])
def test_normal_config_num_sms_is_bounded(deep_ep_host: DeepEpHost, default_dtype: torch.dtype, sms: int,
                                          call: str) -> None:
    """Issue 32 item 3: a Config's num_sms past the device's SMs (a host: MAX_SMS) is refused naming it and the
    value, before its counts region (a count per rank and channel) is sized against the Buffer."""
    run, _ = _normal_call(deep_ep_host.buffer(1 << 20, 0), call, sms)
    check(run, ValueError, (f"config.num_sms must be an even int in [2, {MAX_SMS}]",), what=f"{call}, num_sms={sms}")
    with pytest.raises(ValueError, match=f"got {sms}"):
        run()


# One field changed from the defaults Config(20, 6, 256, 6, 256), under DeepEP's constructor rules: C ints, chunks > 0,
# each send chunk below its receive chunk, the RDMA send chunk at most half the receive chunk rounded up to a multiple
# of it (a send chunk of 129-255 rounds 256 up to twice itself; the receive chunk's rounding must stay a C int).
CONFIG_SPECS: dict[str, Spec] = {
    "num_sms": Int(0, C_INT_MAX, draw_max=1024),
    "num_max_nvl_chunked_send_tokens": Int(1, 255, draw_max=1024),
    "num_max_nvl_chunked_recv_tokens": Int(7, C_INT_MAX, draw_max=1024),
    "num_max_rdma_chunked_send_tokens": Int(1, 255, draw_max=1024),
    "num_max_rdma_chunked_recv_tokens": Int(7, C_INT_MAX // 6 * 6, draw_max=1024),
}
HINT_NVL_SPECS: dict[str, Spec] = {"hidden_bytes": Int(1, C_INT_MAX, draw_max=1 << 16),  # DeepEP's C ints
                                   "num_ranks": Int(1, C_INT_MAX, extra=lambda p: p <= 8 or p % 8 == 0, draw_max=64)}
CONFIG_TABLE = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160)


@FUZZ
@given(case=draw(CONFIG_SPECS))
def test_config(default_dtype: torch.dtype, case: tuple[str, object]) -> None:
    name, value = case
    check(lambda: Config(**{name: value}), expect(CONFIG_SPECS[name], value), (name,), what=f"Config({name}={value!r})")


@FUZZ
@given(case=draw(HINT_NVL_SPECS))
def test_nvl_buffer_size_hint(default_dtype: torch.dtype, case: tuple[str, object]) -> None:
    """Every accepted size gives a positive int of bytes; every refused one names its argument."""
    name, value = case
    kwargs = {"hidden_bytes": 2 * H, "num_ranks": 8, name: value}
    got: list[object] = []
    want = expect(HINT_NVL_SPECS[name], value)
    check(lambda: got.append(Config(24, 8, 256).get_nvl_buffer_size_hint(**kwargs)), want, (name,),
          what=f"get_nvl_buffer_size_hint({name}={value!r})")
    if got:
        assert type(got[0]) is int and got[0] > 0, got


@FUZZ
@given(name=st.sampled_from(["num_sms", "num_max_nvl_chunked_recv_tokens"]),
       value=values(Int(0, C_INT_MAX, draw_max=1024)))
def test_nvl_buffer_size_hint_reads_the_fields_as_they_are(default_dtype: torch.dtype, name: str,
                                                           value: object) -> None:
    """A field the hint reads, set on the Config after construction, meets the constructor's rule or is refused
    naming it (issue 32: not an unnamed TypeError from its arithmetic)."""
    config = Config(24, 8, 256)
    setattr(config, name, value)
    check(lambda: config.get_nvl_buffer_size_hint(2 * H, 8), expect(Int(0, C_INT_MAX), value), (f"config.{name}",),
          what=f"get_nvl_buffer_size_hint with config.{name}={value!r}")


@FUZZ
@given(ranks=values(Int(1, None, extra=lambda p: p in CONFIG_TABLE, draw_max=200)))
def test_recommended_configs(default_dtype: torch.dtype, ranks: object) -> None:
    """DeepEP's recommended configs exist for its table of rank counts; another count names num_ranks."""
    want = expect(Int(1, None, extra=lambda p: p in CONFIG_TABLE), ranks)
    for get in (Buffer.get_dispatch_config, Buffer.get_combine_config):
        check(lambda get=get: get(ranks), want, ("num_ranks",), what=f"{get.__name__}({ranks!r})")


@FUZZ
@given(sms=values(Int(2, MAX_SMS, multiple=2)))
def test_set_num_sms(default_dtype: torch.dtype, sms: object) -> None:
    """The communication SM request: an even int in [2, MAX_SMS]; a refused one leaves the request as it was."""
    before = Buffer.num_sms
    try:
        check(lambda: Buffer.set_num_sms(sms), expect(Int(2, MAX_SMS, multiple=2), sms), ("new_num_sms",),
              what=f"set_num_sms({sms!r})")
        if expect(Int(2, MAX_SMS, multiple=2), sms) is not None:
            assert Buffer.num_sms == before
    finally:
        Buffer.num_sms = before


CLEAN_SPECS: dict[str, Spec] = {
    "num_max_dispatch_tokens_per_rank": Int(1, C_INT_MAX, extra=lambda t: _fits(t, topk=1), draw_max=4 * TMAX),
    "hidden": Int(1, C_INT_MAX, multiple=128, extra=lambda h: _fits(hidden=h, topk=1), draw_max=4 * H),
    "num_experts": Int(1, LL_MAX_EXPERTS, extra=lambda e: _fits(experts=e, topk=1)),
}
"""clean_low_latency_buffer checks calls of top-k 1 against the workspace."""


@FUZZ
@given(case=draw(CLEAN_SPECS))
def test_clean_low_latency_buffer(host_buffers: tuple[Buffer, Buffer, list], default_dtype: torch.dtype,
                                  case: tuple[str, object]) -> None:
    name, value = case
    ll, _, _ = host_buffers
    kwargs = {"num_max_dispatch_tokens_per_rank": TMAX, "hidden": H, "num_experts": E, name: value}
    check(lambda: ll.clean_low_latency_buffer(**kwargs), expect(CLEAN_SPECS[name], value), (name, "num_rdma_bytes"),
          what=f"clean_low_latency_buffer({name}={value!r})")
