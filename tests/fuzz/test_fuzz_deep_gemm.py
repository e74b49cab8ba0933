"""Fuzz of the deep_gemm facade's public entry points against the model of valid inputs (tests/kit/fuzz_model.py).

Each test starts from a valid baseline call, replaces one argument by a drawn value and asserts the model's verdict:
refused with the right exception type naming the argument, before anything is written, or accepted (the baseline and
every valid variation keep working, meta tensors included). On this CPU host the Mega MoE layer calls are accepted
when they reach the launch ("lives in host memory ... needs the GPU"); buffer creation runs on a meta allocation
(the sizes of every accepted request are recorded and bounded). Every test runs under default dtype float32 and
bfloat16.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from fuzz_model import Choice, Flag, Int, Real, Recipe, Spec, check, expect, values
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gc_moe_compat.deep_gemm as dg
from gc_moe_compat import quant
from gc_moe_compat.deep_gemm import _runtime
from gc_moe_compat.operator import buffer as op_buffer
from gc_moe_compat.operator.heuristics import block_m_candidates
from gc_moe_compat.runtime.workspace import make_peer_table

FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
HOST_LAUNCH = "lives in host memory .*needs the GPU"
H, N_I, E, K, T = 512, 256, 16, 4, 3
MMA = Choice(("fp8xfp4", "fp8xfp8"), ("bf16xbf16", "mxf4xmxf4", "nvfp4xnvfp4"))
ACTIVATION = Choice(("swiglu",), ("swigluoai", "situ"))
MAX_BUFFER_BYTES = 8 << 30
"""No accepted buffer request may exceed this (the largest valid shape needs far less): absurd sizes never reach
the allocator."""


def _draw(specs: dict[str, Spec]) -> st.SearchStrategy[tuple[str, object]]:
    return st.sampled_from(sorted(specs)).flatmap(lambda name: values(specs[name]).map(lambda v: (name, v)))


@pytest.fixture
def meta_allocation() -> object:
    """Buffer storage on the meta device (the layout and views are real, no bytes): records each request's size."""
    requested: list[int] = []

    def allocate(layout: object, group: dist.ProcessGroup, where: object) -> tuple[torch.Tensor, object, None]:
        requested.append(layout.total_bytes)
        return torch.empty(layout.total_bytes, dtype=torch.uint8, device="meta"), make_peer_table([0], 0), None

    mp = pytest.MonkeyPatch()
    mp.setattr(op_buffer, "_allocate", allocate)
    yield requested
    mp.undo()


# ------------------------------------------------------------------------------------------------------------------
# get_symm_buffer_for_mega_moe / get_symm_buffer_for_sm90_mega_moe

BUFFER_BASE = dict(num_experts=E, num_max_tokens_per_rank=40, num_topk=K, hidden=H, intermediate_hidden=N_I,
                   num_shared_experts=0, use_fp8_dispatch=None, mma_type="fp8xfp4", activation="swiglu")
BUFFER_SPECS: dict[str, Spec] = {
    "num_experts": Int(K, 512, draw_max=64),  # one rank: e = E <= 512, k <= E
    "num_max_tokens_per_rank": Int(1, 8192, draw_max=512),
    "num_topk": Int(1, E, draw_max=E),  # k <= E (and <= 32)
    "hidden": Int(256, 8192, multiple=256, draw_max=2048),
    "intermediate_hidden": Int(128, 4096, multiple=128, draw_max=1024),
    "num_shared_experts": Int(0, 1),
    "use_fp8_dispatch": Flag(none_ok=True, refused=(False,)),  # False contradicts mma_type 'fp8xfp4'
    "mma_type": MMA,
    "activation": ACTIVATION,
}
BUFFER_NAMES = {"num_max_tokens_per_rank": ("num_max_tokens_per_rank",), "num_topk": ("num_topk",),
                "intermediate_hidden": ("intermediate_hidden",), "use_fp8_dispatch": ("use_fp8_dispatch",)}


@pytest.mark.filterwarnings("ignore:`use_fp8_dispatch`:DeprecationWarning")
@FUZZ
@given(case=_draw(BUFFER_SPECS))
def test_buffer_creation(group: dist.ProcessGroup, meta_allocation: list, default_dtype: torch.dtype,
                         case: tuple[str, object]) -> None:
    name, value = case
    kwargs = {**BUFFER_BASE, name: value}
    check(lambda: dg.get_symm_buffer_for_mega_moe(group, **kwargs), expect(BUFFER_SPECS[name], value),
          BUFFER_NAMES.get(name, (name,)), what=f"get_symm_buffer_for_mega_moe({name}={value!r})")
    assert all(b <= MAX_BUFFER_BYTES for b in meta_allocation)


@FUZZ
@given(e=st.sampled_from([4, 8, 64, 512]), t=st.integers(1, 8192), k=st.integers(1, 4),
       h=st.sampled_from([256, 512, 7168, 8192]), i=st.sampled_from([128, 2048, 4096]), s=st.integers(0, 1),
       mma=st.sampled_from(["fp8xfp4", "fp8xfp8"]))
def test_every_valid_buffer_is_accepted_and_bounded(group: dist.ProcessGroup, meta_allocation: list,
                                                    default_dtype: torch.dtype, e: int, t: int, k: int, h: int,
                                                    i: int, s: int, mma: str) -> None:
    buf = dg.get_symm_buffer_for_mega_moe(group, e, t, k, h, i, num_shared_experts=s, mma_type=mma)
    assert buf.x.shape == (buf.num_max_tokens_per_rank, h) and buf.num_max_tokens_per_rank >= t
    assert buf.x.dtype == torch.float8_e4m3fn and buf.topk_weights.dtype == torch.float32
    assert meta_allocation[-1] <= MAX_BUFFER_BYTES
    sm90 = dg.get_symm_buffer_for_sm90_mega_moe(group, e, t, k, h, i)
    assert sm90.mma_type == "fp8xfp8"


# ------------------------------------------------------------------------------------------------------------------
# get_block_m_for_mega_moe, set_num_sms

BLOCK_BASE = dict(num_ranks=8, num_experts=256, num_max_tokens_per_rank=256, num_tokens=16, num_topk=8,
                  mma_type="fp8xfp4", global_num_tokens=None)
BLOCK_SPECS: dict[str, Spec] = {
    "num_ranks": Int(1, 72, extra=lambda p: 256 % p == 0),  # E % P == 0 (E/P <= 512 holds for every divisor)
    "num_experts": Int(8, 2048, multiple=8),  # k <= E, E % P == 0
    "num_max_tokens_per_rank": Int(16, 8192),  # >= num_tokens
    "num_tokens": Int(0, 256),
    "num_topk": Int(1, 32),
    "mma_type": MMA,
    "global_num_tokens": Int(0, 8 * 256),
}


@FUZZ
@given(case=_draw(BLOCK_SPECS))
def test_get_block_m_for_mega_moe(default_dtype: torch.dtype, case: tuple[str, object]) -> None:
    name, value = case
    kwargs = {**BLOCK_BASE, name: value}
    want = expect(BLOCK_SPECS[name], value)
    if name == "global_num_tokens" and value is None:
        want = None
    names = (name, "num_tokens") if name == "num_max_tokens_per_rank" else (name,)  # num_tokens <= it
    check(lambda: dg.get_block_m_for_mega_moe(**kwargs), want, names, what=f"get_block_m({name}={value!r})")
    if want is None:
        assert dg.get_block_m_for_mega_moe(**kwargs) in block_m_candidates(kwargs.get("mma_type", "fp8xfp4"))


@FUZZ
@given(value=values(Int(1, 1024)))
def test_set_num_sms_on_a_host_without_cuda(monkeypatch_module: pytest.MonkeyPatch, default_dtype: torch.dtype,
                                            value: object) -> None:
    check(lambda: dg.set_num_sms(value), expect(Int(1, 1024), value), ("new_num_sms",),
          what=f"set_num_sms({value!r})")


@pytest.fixture
def monkeypatch_module() -> object:
    mp = pytest.MonkeyPatch()
    mp.setattr(_runtime, "_device_num_sms", lambda: None)
    mp.setattr(_runtime, "_num_sms", None)
    yield mp
    mp.undo()


# ------------------------------------------------------------------------------------------------------------------
# mega_moe_pre_dispatch_sm90 / mega_moe_pre_dispatch: scalars, then a table of tensors


def _pre_inputs(device: str = "cpu", sf_dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, H, generator=g, dtype=torch.float32).to(torch.bfloat16)
    idx = torch.randint(-1, E, (5, K), generator=g, dtype=torch.int32)
    w = torch.rand(5, K, generator=g, dtype=torch.float32)
    views = [torch.zeros(8, H, dtype=torch.float8_e4m3fn), torch.zeros(8, H // 128, dtype=sf_dtype),
             torch.zeros(8, K, dtype=torch.int64), torch.zeros(8, K, dtype=torch.float32)]
    return [t.to(device) for t in (x, idx, w, *views)]


# num_tokens: x's 5 rows exactly (the originals assert num_tokens == x.size(0))
PRE_SPECS: dict[str, Spec] = {"num_tokens": Int(5, 5), "group_size": Choice((128,)),
                              "routed_scaling_factor": Real(fp32=True)}
UE8M0_SPECS: dict[str, Spec] = {"num_tokens": Int(5, 5), "group_size": Choice((32,), (16,)), "mma_type": MMA}


@FUZZ
@given(case=_draw(PRE_SPECS), meta=st.booleans())
def test_pre_dispatch_sm90_scalars(default_dtype: torch.dtype, case: tuple[str, object], meta: bool) -> None:
    name, value = case
    tensors = _pre_inputs("meta" if meta else "cpu")
    before = [t.clone() for t in tensors[3:]] if not meta else None
    kwargs = {"num_tokens": 5, "group_size": 128, "routed_scaling_factor": 2.5, name: value}
    want = expect(PRE_SPECS[name], value)
    check(lambda: dg.mega_moe_pre_dispatch_sm90(*tensors, **kwargs), want, (name,),
          what=f"mega_moe_pre_dispatch_sm90({name}={value!r}, meta={meta})")
    if want is not None and before is not None:  # a refusal writes nothing
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(tensors[3:], before,
                                                                                           strict=True))
    if want is None and not meta:
        n = kwargs["num_tokens"]
        assert torch.equal(tensors[5][:n], tensors[1][:n].long()) and (tensors[5][n:] == -1).all()


@FUZZ
@given(case=_draw(UE8M0_SPECS))
def test_pre_dispatch_ue8m0_scalars(default_dtype: torch.dtype, case: tuple[str, object]) -> None:
    name, value = case
    tensors = _pre_inputs(sf_dtype=torch.int32)
    kwargs = {"num_tokens": 5, "group_size": 32, "mma_type": "fp8xfp4", name: value}
    check(lambda: dg.mega_moe_pre_dispatch(*tensors, **kwargs), expect(UE8M0_SPECS[name], value), (name,),
          what=f"mega_moe_pre_dispatch({name}={value!r})")


def _replace(i: int, make: object) -> object:
    def change(ts: list[torch.Tensor]) -> list[torch.Tensor]:
        ts = list(ts)
        ts[i] = make(ts[i])
        return ts
    return change


PRE_TENSOR_CASES = {  # name -> (change of the tensors, expected error, argument named)
    "x-0d": (_replace(0, lambda t: t[0, 0]), ValueError, "x"),
    "x-fp32": (_replace(0, lambda t: t.float()), TypeError, "x"),
    "x-hidden-0": (_replace(0, lambda t: t[:, :0]), ValueError, "x"),
    "x-hidden-384": (_replace(0, lambda t: torch.zeros(5, 384, dtype=torch.bfloat16)), ValueError, "x"),
    "x-not-contiguous": (_replace(0, lambda t: t.t().contiguous().t()), ValueError, "x"),
    "x-none": (_replace(0, lambda t: None), TypeError, "x"),
    "idx-float": (_replace(1, lambda t: t.float()), TypeError, "topk_idx"),
    "idx-k0": (_replace(1, lambda t: t[:, :0]), ValueError, "topk_idx"),
    "idx-999": (_replace(1, lambda t: torch.full_like(t, 999)), None, ""),  # plain int64 views: in range
    "idx-int64": (_replace(1, lambda t: t.long()), TypeError, "topk_idx"),  # the originals' int32 ids
    "idx-rows": (_replace(1, lambda t: t[:4]), ValueError, "topk_idx"),
    "idx-minus-5": (_replace(1, lambda t: torch.full_like(t, -5)), ValueError, "topk_idx"),
    "weights-nan": (_replace(2, lambda t: torch.full_like(t, float("nan"))), ValueError, "topk_weights"),
    "weights-shape": (_replace(2, lambda t: t[:, :2]), ValueError, "topk_weights"),
    "buf-x-rows": (_replace(3, lambda t: t[:4]), ValueError, "buf_x"),
    # H/128 == k: a [8, k] float32 tensor has buf_x_sf's shape (plain views: nothing to tell them apart)
    "buf-sf-swapped-width": (_replace(4, lambda t: torch.zeros(8, K, dtype=torch.float32)), None, ""),
    "buf-idx-uint8": (_replace(5, lambda t: t.to(torch.uint8)), TypeError, "buf_topk_idx"),
    "buf-idx-int32": (_replace(5, lambda t: t.int()), TypeError, "buf_topk_idx"),  # the originals' int64 view
    "buf-weights-strided": (_replace(6, lambda t: torch.zeros(8, 2 * K, dtype=torch.float32)[:, ::2]), ValueError,
                            "buf_topk_weights"),
    "buf-weights-meta": (_replace(6, lambda t: t.to("meta")), ValueError, "buf_topk_weights"),
}


@pytest.mark.parametrize("case", sorted(PRE_TENSOR_CASES))
def test_pre_dispatch_tensor_table(default_dtype: torch.dtype, case: str) -> None:
    change, want, arg = PRE_TENSOR_CASES[case]
    tensors = change(_pre_inputs())
    check(lambda: dg.mega_moe_pre_dispatch_sm90(*tensors, 5, routed_scaling_factor=2.5), want,
          (arg, f"{arg} must"), what=f"pre-dispatch {case}")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("fn", ["mega_moe_pre_dispatch_sm90", "mega_moe_pre_dispatch"])
def test_pre_dispatch_refuses_non_finite_activations(default_dtype: torch.dtype, value: float, fn: str) -> None:
    """Issue 32 item 1: host tensors whose rows of x hold a NaN or Inf are refused (ValueError naming x and the first
    such row) before anything is written; the finite rows alone are staged.
    (On the GPU the kernel drops the token and the next eager call reports it: test_predispatch_kernel.py.)"""
    tensors = _pre_inputs(sf_dtype=torch.float32 if fn == "mega_moe_pre_dispatch_sm90" else torch.int32)
    tensors[0][3, 100] = value
    tensors[0][4, 7] = value
    before = [t.clone() for t in tensors[3:]]
    call = getattr(dg, fn)
    with pytest.raises(ValueError, match=r"x must be finite .*2 row\(s\).* the first row 3"):
        call(*tensors, 5)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(tensors[3:], before,
                                                                                       strict=True))
    call(*(t[:3] for t in tensors[:3]), *tensors[3:], 3)  # the finite rows 0-2
    assert torch.equal(tensors[5][:3], tensors[1][:3].long())


def test_pre_dispatch_views_of_a_facade_buffer(group: dist.ProcessGroup, default_dtype: torch.dtype) -> None:
    """The facade buffer's own views are accepted; ids past its E, swapped views, views of two buffers are not."""
    a = dg.get_symm_buffer_for_mega_moe(group, E, 8, K, H, N_I)
    b = dg.get_symm_buffer_for_mega_moe(group, E, 8, K, H, N_I)
    x, idx, w = _pre_inputs()[:3]
    dg.mega_moe_pre_dispatch_sm90(x, idx, w, a.x, a.x_sf, a.topk_idx, a.topk_weights, 5)
    assert torch.equal(a.topk_idx[:5], idx.long())
    for views, arg in (((a.x, a.x_sf, a.topk_idx, b.topk_weights), "buf_topk_weights"),
                       ((a.x, a.topk_weights, a.topk_idx, a.x_sf), "buf_x_sf")):
        check(lambda views=views: dg.mega_moe_pre_dispatch_sm90(x, idx, w, *views, 5), ValueError, (arg,))
    check(lambda: dg.mega_moe_pre_dispatch_sm90(x, torch.full_like(idx, E), w, a.x, a.x_sf, a.topk_idx,
                                                a.topk_weights, 5), ValueError, ("topk_idx",))
    check(lambda: dg.mega_moe_pre_dispatch(x, idx, w, a.x, a.x_sf, a.topk_idx, a.topk_weights, 5), ValueError,
          ("mega_moe_pre_dispatch_sm90",))
    a.destroy()
    check(lambda: dg.mega_moe_pre_dispatch_sm90(x, idx, w, a.x, a.x_sf, a.topk_idx, a.topk_weights, 5), TypeError,
          ("destroyed",))


# ------------------------------------------------------------------------------------------------------------------
# fp8_mega_moe / fp8_fp4_mega_moe: options against a real host buffer, accepted at the launch boundary


@pytest.fixture(scope="module")
def host_buffer(group: dist.ProcessGroup) -> dg.SymmBuffer:
    return dg.get_symm_buffer_for_mega_moe(group, E, 40, K, H, N_I)


def _fp8_weights() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    return ((torch.zeros(E, 2 * N_I, H, dtype=torch.float8_e4m3fn), torch.ones(E, 2 * N_I // 128, H // 128,
                                                                              dtype=torch.float32)),
            (torch.zeros(E, H, N_I, dtype=torch.float8_e4m3fn), torch.ones(E, H // 128, N_I // 128,
                                                                          dtype=torch.float32)))


FP8_SPECS: dict[str, Spec] = {"recipe": Recipe((128, 128, 128)), "activation": ACTIVATION,
                              "activation_clamp": Real(at_least_zero=True, none_ok=True),  # the pin: >= 0
                              "fast_math": Flag()}


@FUZZ
@given(case=_draw(FP8_SPECS))
def test_fp8_mega_moe_options(host_buffer: dg.SymmBuffer, default_dtype: torch.dtype,
                              case: tuple[str, object]) -> None:
    name, value = case
    l1, l2 = _fp8_weights()
    y = torch.empty(T, H, dtype=torch.bfloat16)
    check(lambda: dg.fp8_mega_moe(y, l1, l2, host_buffer, **{name: value}), expect(FP8_SPECS[name], value),
          (name,), boundary=HOST_LAUNCH, what=f"fp8_mega_moe({name}={value!r})")


FP8_CALL_CASES = {  # name -> (y, l1, l2 changes, expected error, argument named)
    "baseline": (lambda y: y, lambda p: p, None, ""),
    "y-rows-0": (lambda y: y[:0], lambda p: p, None, ""),
    "y-rows-past-capacity": (lambda y: torch.empty(65, H, dtype=torch.bfloat16), lambda p: p, ValueError, "y"),
    "y-0d": (lambda y: y[0, 0], lambda p: p, ValueError, "y"),
    "y-fp32": (lambda y: y.float(), lambda p: p, TypeError, "y"),
    "y-meta": (lambda y: y.to("meta"), lambda p: p, ValueError, "y"),
    "l1-none": (lambda y: y, lambda p: None, TypeError, "l1_weights"),
    "l1-list": (lambda y: y, lambda p: list(p), None, ""),
    "l1-one-tensor": (lambda y: y, lambda p: p[0], TypeError, "l1_weights"),
    "l1-int8-scales": (lambda y: y, lambda p: (p[0], p[1].to(torch.int8)), TypeError, "l1_weights[1]"),
    "l1-experts": (lambda y: y, lambda p: (p[0][:2], p[1][:2]), ValueError, "l1_weights[0]"),
}


@pytest.mark.parametrize("case", sorted(FP8_CALL_CASES))
def test_fp8_mega_moe_tensor_table(host_buffer: dg.SymmBuffer, default_dtype: torch.dtype, case: str) -> None:
    change_y, change_l1, want, arg = FP8_CALL_CASES[case]
    l1, l2 = _fp8_weights()
    y = change_y(torch.empty(T, H, dtype=torch.bfloat16))
    check(lambda: dg.fp8_mega_moe(y, change_l1(l1), l2, host_buffer), want, (arg,), boundary=HOST_LAUNCH,
          what=f"fp8_mega_moe {case}")


def test_layer_calls_name_the_function_called(host_buffer: dg.SymmBuffer, default_dtype: torch.dtype) -> None:
    """Issue 32 item 7: a valid fp8_mega_moe / fp8_fp4_mega_moe stops at the launch (a host buffer) with a message
    naming the facade function the caller called, not the native call it runs on."""
    g = torch.Generator().manual_seed(1)
    fp4 = [(torch.randint(-128, 128, (E, n, k // 2), generator=g, dtype=torch.int8),
            quant.pack_ue8m0_k32(torch.randint(120, 135, (E, n, k // 32), generator=g, dtype=torch.uint8)))
           for n, k in ((2 * N_I, H), (H, N_I))]
    y = torch.empty(T, H, dtype=torch.bfloat16)
    for fn, call in (("fp8_mega_moe", lambda: dg.fp8_mega_moe(y, *_fp8_weights(), host_buffer)),
                     ("fp8_fp4_mega_moe",
                      lambda: dg.fp8_fp4_mega_moe(y, *dg.transform_weights_for_mega_moe(*fp4), host_buffer))):
        with pytest.raises(RuntimeError, match=HOST_LAUNCH) as info:
            call()
        assert str(info.value).startswith(f"{fn}: ") and "gc_moe" not in str(info.value), str(info.value)


def test_fp8_mega_moe_on_meta_buffer(group: dist.ProcessGroup, meta_allocation: list,
                                     default_dtype: torch.dtype) -> None:
    """A meta buffer with meta y and weights passes every check (values are not read) up to the launch."""
    buf = dg.get_symm_buffer_for_mega_moe(group, E, 40, K, H, N_I)
    l1, l2 = ((t.to("meta") for t in pair) for pair in _fp8_weights())
    check(lambda: dg.fp8_mega_moe(torch.empty(T, H, dtype=torch.bfloat16, device="meta"), tuple(l1), tuple(l2),
                                  buf), None, (), boundary=HOST_LAUNCH)


FP4_SPECS: dict[str, Spec] = {"recipe": Recipe((1, 1, 32), not_implemented=((1, 1, 16),)), "activation": ACTIVATION,
                              "fast_math": Flag(), "use_x_scales": Flag(refused=(True,),
                                                                        refused_with=NotImplementedError),
                              "post_expert_norm": Flag(refused=(True,), refused_with=NotImplementedError),
                              "global_num_tokens": Int(T, 64)}


@FUZZ
@given(case=_draw(FP4_SPECS))
def test_fp8_fp4_mega_moe_options(host_buffer: dg.SymmBuffer, default_dtype: torch.dtype,
                                  case: tuple[str, object]) -> None:
    """Refusals of the options come before the weights are read, so fp8 weights stand in: an accepted option then
    meets the weights' dtype check (TypeError naming l1_weights[0]), the first check after the options."""
    name, value = case
    l1, l2 = _fp8_weights()
    y = torch.empty(T, H, dtype=torch.bfloat16)
    want = expect(FP4_SPECS[name], value)
    if name == "global_num_tokens" and value is None:
        want = None
    names = (name,) if want is not None else ("l1_weights[0]",)
    check(lambda: dg.fp8_fp4_mega_moe(y, l1, l2, host_buffer, **{name: value}), want or TypeError, names,
          what=f"fp8_fp4_mega_moe({name}={value!r})")
