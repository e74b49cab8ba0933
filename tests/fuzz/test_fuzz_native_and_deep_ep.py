"""Fuzz of the native API (``get_symm_buffer_for_gc_moe``, ``fp8_fp8_gc_moe`` / ``fp8_fp4_gc_moe``) and of the
deep_ep facade (``Buffer`` construction and the host checks of ``low_latency_dispatch``) against the model of valid
inputs (tests/kit/fuzz_model.py): one argument of a valid baseline replaced by a drawn value, the model's verdict
asserted. CPU only: the native buffer is laid out on a meta allocation (sizes recorded and bounded) or is a host
buffer whose calls are accepted at the launch boundary; deep_ep's workspace is a host stand-in whose launches are
recorded, not run. Every test runs under default dtype float32 and bfloat16."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import pytest
import torch
import torch.distributed as dist
from fuzz_model import Choice, Flag, Int, Real, Recipe, Spec, check, draw, expect, values
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gc_moe_compat import config, quant
from gc_moe_compat.comm.ep_ll import HEADER_BYTES
from gc_moe_compat.deep_ep import Buffer
from gc_moe_compat.deep_ep._config import BUFFER_ALIGNMENT_BYTES, C_INT_MAX
from gc_moe_compat.operator import api
from gc_moe_compat.operator import buffer as op_buffer
from gc_moe_compat.runtime.workspace import make_peer_table

if TYPE_CHECKING:
    from conftest import DeepEpHost

FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
HOST_LAUNCH = "lives in host memory .*needs the GPU"
H, N_I, E, K, T, TMAX = 512, 256, 16, 4, 3, 32
MAX_BUFFER_BYTES = 8 << 30


@pytest.fixture
def meta_allocation(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    requested: list[int] = []

    def allocate(layout: object, group: dist.ProcessGroup, where: object) -> tuple[torch.Tensor, object, None]:
        requested.append(layout.total_bytes)
        return torch.empty(layout.total_bytes, dtype=torch.uint8, device="meta"), make_peer_table([0], 0), None

    monkeypatch.setattr(op_buffer, "_allocate", allocate)
    return requested


# ------------------------------------------------------------------------------------------------------------------
# get_symm_buffer_for_gc_moe

NATIVE_BASE = dict(num_experts=E, capacity=TMAX, topk=K, hidden=H, intermediate=N_I, mma_type="fp8xfp4",
                   num_shared_experts=0, dispatch_sms=None, partition=None, compute_sms=64)
NATIVE_SPECS: dict[str, Spec] = {
    "num_experts": Int(K, 512, draw_max=64), "capacity": Int(1, 8192, draw_max=512), "topk": Int(1, E),
    "hidden": Int(256, 8192, multiple=256, draw_max=2048), "intermediate": Int(128, 4096, multiple=128,
                                                                               draw_max=1024),
    "mma_type": Choice(("fp8xfp4", "fp8xfp8")), "num_shared_experts": Int(0, 1), "dispatch_sms": Int(2, 1024),
    "partition": Choice(("on", "off")), "compute_sms": Int(2, 1024, multiple=2, draw_max=256),
}
OPTIONAL = {"dispatch_sms": (None,), "partition": (None, True, False)}
"""Values accepted besides the spec's (None: the environment / default; a bool partition: on / off)."""


@FUZZ
@given(case=draw(NATIVE_SPECS))
def test_native_buffer_creation(group: dist.ProcessGroup, meta_allocation: list[int], default_dtype: torch.dtype,
                                case: tuple[str, object]) -> None:
    name, value = case
    kwargs = {**NATIVE_BASE, name: value}
    want = None if any(value is v for v in OPTIONAL.get(name, ())) else expect(NATIVE_SPECS[name], value)
    if name == "compute_sms" and value is None:
        want = ValueError  # required on a host without CUDA (a GPU sizes the ring from its own partition)
    names = (name, "num_experts") if name in ("num_experts", "topk") else (name,)  # k <= E names both
    check(lambda: api.get_symm_buffer_for_gc_moe(group, **kwargs), want, names,
          what=f"get_symm_buffer_for_gc_moe({name}={value!r})")
    assert all(b <= MAX_BUFFER_BYTES for b in meta_allocation)


@FUZZ
@given(e=st.sampled_from([4, 16, 512]), t=st.integers(1, 8192), k=st.integers(1, 4),
       h=st.sampled_from([256, 7168, 8192]), i=st.sampled_from([128, 4096]), mma=st.sampled_from(["fp8xfp4",
                                                                                                    "fp8xfp8"]),
       idx=st.sampled_from([torch.int64, torch.int32]))
def test_every_valid_native_buffer_is_accepted(group: dist.ProcessGroup, meta_allocation: list[int],
                                               default_dtype: torch.dtype, e: int, t: int, k: int, h: int, i: int,
                                               mma: str, idx: torch.dtype) -> None:
    buf = api.get_symm_buffer_for_gc_moe(group, e, t, k, h, i, mma, compute_sms=128, topk_idx_dtype=idx)
    assert buf.x.shape == (t, h) and buf.topk_idx.dtype == idx and buf.topk_weights.dtype == torch.float32
    assert meta_allocation[-1] <= MAX_BUFFER_BYTES


# ------------------------------------------------------------------------------------------------------------------
# fp8_fp8_gc_moe / fp8_fp4_gc_moe options on a host buffer (accepted at the launch boundary)


@pytest.fixture(scope="module")
def native_call(group: dist.ProcessGroup) -> dict[str, object]:
    buf = api.get_symm_buffer_for_gc_moe(group, E, TMAX, K, H, N_I, "fp8xfp8", compute_sms=64)
    g = torch.Generator().manual_seed(0)
    pairs = [quant.quantize_fp8_blocks(torch.randn(E, n, k, generator=g, dtype=torch.float32))
             for n, k in ((2 * N_I, H), (H, N_I))]
    w1, w2 = api.transform_weights_for_gc_moe(*pairs, mma_type="fp8xfp8")
    return {"buffer": buf, "w1": w1, "w2": w2}


CALL_SPECS: dict[str, Spec] = {
    "recipe": Recipe((128, 128, 128)), "activation": Choice(("swiglu",)), "activation_alpha": Real(),
    "activation_clamp": Real(positive=True, none_ok=True), "check_values": Flag(), "fast_math": Flag(),
}


@FUZZ
@given(case=draw(CALL_SPECS))
def test_native_call_options(native_call: dict[str, object], default_dtype: torch.dtype,
                             case: tuple[str, object]) -> None:
    name, value = case
    y = torch.empty(T, H, dtype=torch.bfloat16)
    check(lambda: api.fp8_fp8_gc_moe(y, native_call["w1"], native_call["w2"], native_call["buffer"],
                                     **{name: value}),
          expect(CALL_SPECS[name], value), (name,), boundary=HOST_LAUNCH, what=f"fp8_fp8_gc_moe({name}={value!r})")


@FUZZ
@given(value=values(Flag()))
def test_validate_check_values_is_a_bool(default_dtype: torch.dtype, value: object) -> None:
    """Issue 32 item 6: config.validate's check_values must be a bool (None would skip the value checks): staged ids
    past E are refused with True, accepted with False, and anything else is a TypeError naming check_values."""
    shape = config.MoEShape(E, 1, H, N_I, K)
    idx = torch.full((T, K), E, dtype=torch.int64)
    want = expect(Flag(refused=(True,)), value)
    check(lambda: config.validate(shape, topk_idx=idx, check_values=value), want,
          ("check_values",) if want is TypeError else ("topk_idx",), what=f"validate(check_values={value!r})")


@pytest.mark.parametrize(("idx", "weight", "want", "arg"), [
    (0, 0.5, None, ""), (-1, 0.5, None, ""), (E - 1, 0.5, None, ""), (E, 0.5, ValueError, "topk_idx"),
    (-2, 0.5, ValueError, "topk_idx"), (0, float("nan"), ValueError, "topk_weights"),
    (0, float("inf"), ValueError, "topk_weights"),
])
def test_native_call_routing_values(native_call: dict[str, object], default_dtype: torch.dtype, idx: int,
                                    weight: float, want: type[Exception] | None, arg: str) -> None:
    """check_values=True (the default) refuses staged ids outside [-1, E) and non-finite weights on the host;
    with check_values=False the same call reaches the launch (the device drops them: the GPU tests)."""
    buf = native_call["buffer"]
    buf.topk_idx[:T], buf.topk_weights[:T] = idx, weight
    try:
        args = (torch.empty(T, H, dtype=torch.bfloat16), native_call["w1"], native_call["w2"], buf)
        check(lambda: api.fp8_fp8_gc_moe(*args), want, (arg,), boundary=HOST_LAUNCH, what=f"staged {idx}, {weight}")
        check(lambda: api.fp8_fp8_gc_moe(*args, check_values=False), None, (), boundary=HOST_LAUNCH)
    finally:
        buf.topk_idx.zero_()
        buf.topk_weights.zero_()


# ------------------------------------------------------------------------------------------------------------------
# deep_ep Buffer and low_latency_dispatch's host checks


EP_BASE = dict(num_nvl_bytes=0, num_rdma_bytes=1 << 20, low_latency_mode=True, num_qps_per_rank=24,
               allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, use_fabric=None, explicitly_destroy=False,
               enable_shrink=False)
EP_SPECS: dict[str, Spec] = {
    # DeepEP's rules: multiples of 128, num_nvl_bytes a C int beside the base's RDMA bytes (low-latency mode: fewer
    # than INT_MAX 16-byte vectors of num_rdma_bytes); the normal-mode calls need their header too
    # (test_fuzz_deep_ep_calls.py); RDMA bytes at one rank only in low-latency mode
    "num_nvl_bytes": Int(0, C_INT_MAX, multiple=BUFFER_ALIGNMENT_BYTES, draw_max=1 << 16),
    "num_rdma_bytes": Int(HEADER_BYTES, (16 * C_INT_MAX - 1) // BUFFER_ALIGNMENT_BYTES * BUFFER_ALIGNMENT_BYTES,
                          multiple=BUFFER_ALIGNMENT_BYTES, draw_max=1 << 22),
    "num_qps_per_rank": Int(1, None, draw_max=64),
    "low_latency_mode": Flag(refused=(False,)),
    "allow_nvlink_for_low_latency_mode": Flag(refused=(False,), refused_with=NotImplementedError),
    "allow_mnnvl": Flag(refused=(True,), refused_with=NotImplementedError),
    "use_fabric": Flag(none_ok=True),  # unused by the pin
    "explicitly_destroy": Flag(), "enable_shrink": Flag(),
}


@FUZZ
@given(case=draw(EP_SPECS))
def test_deep_ep_buffer(deep_ep_host: DeepEpHost, default_dtype: torch.dtype, case: tuple[str, object]) -> None:
    name, value = case
    kwargs = {**EP_BASE, name: value}
    want = expect(EP_SPECS[name], value)
    if name == "num_rdma_bytes" and type(value) is int and 0 <= value < HEADER_BYTES:
        want = ValueError  # a valid byte count, too small for the low-latency header
    check(lambda: deep_ep_host.buffer(**kwargs), want, (name,), what=f"Buffer({name}={value!r})")


@pytest.mark.parametrize(("args", "mode"), [((1 << 20, 0), "num_nvl_bytes=1048576 (normal mode)"),
                                            ((0, 1 << 20, True), "low_latency_mode=True")])
def test_deep_ep_buffer_without_cuda_names_itself(group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch,
                                                  default_dtype: torch.dtype, args: tuple, mode: str) -> None:
    """Issue 32 item 7: on a host without CUDA both modes' workspaces are refused as this call's, "Buffer:" and
    the mode first."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=rf"^Buffer: {re.escape(mode)}: symmetric workspace: needs a CUDA device"):
        Buffer(group, *args)


DISPATCH_SPECS: dict[str, Spec] = {"use_fp8": Flag(), "return_recv_hook": Flag()}
"""async_finish=True makes a CUDA event: accepted only where there is a device (its type check is in
tests/facades/test_bad_input.py)."""


@FUZZ
@given(case=draw(DISPATCH_SPECS))
def test_low_latency_dispatch_flags(deep_ep_host: DeepEpHost, default_dtype: torch.dtype,
                                    case: tuple[str, object]) -> None:
    name, value = case
    ll = deep_ep_host.buffer(0, Buffer.get_low_latency_rdma_size_hint(8, 256, 1, 8), low_latency_mode=True)
    x = torch.randn(5, 256, dtype=torch.float32).to(torch.bfloat16)
    idx = torch.randint(-1, 8, (5, 4), dtype=torch.int64)
    before = len(deep_ep_host.launched)
    want = expect(DISPATCH_SPECS[name], value)
    check(lambda: ll.low_latency_dispatch(x, idx, 8, 8, **{name: value}), want, (name,),
          what=f"low_latency_dispatch({name}={value!r})")
    assert (len(deep_ep_host.launched) > before) == (want is None)  # refused: nothing launched
