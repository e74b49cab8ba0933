"""Fuzz of the weight and scale transforms, the entry points a deployment calls once per weight set:
``transform_sf_into_required_layout`` (every scalar option), ``transform_weights_for_mega_moe`` (its options) and the
native ``transform_weights_for_gc_moe`` (its format), each against the model of valid inputs
(tests/kit/fuzz_model.py): one argument of a valid baseline replaced by a drawn value, the model's verdict asserted,
and the caller's tensors unchanged by a refused call. Every test runs under default dtype float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch
from fuzz_model import Choice, Flag, Int, Recipe, Spec, check, expect, values
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gc_moe_compat.deep_gemm as dg
from gc_moe_compat import quant, transform_weights_for_gc_moe

FUZZ = settings(max_examples=120, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
G, MN, K = 2, 256, 256
MMA = Choice(("fp8xfp4", "fp8xfp8"), ("bf16xbf16", "mxf4xmxf4", "nvfp4xnvfp4"))
ACTIVATION = Choice(("swiglu",), ("swigluoai", "situ"))


def _draw(specs: dict[str, Spec]) -> st.SearchStrategy[tuple[str, object]]:
    return st.sampled_from(sorted(specs)).flatmap(lambda name: values(specs[name]).map(lambda v: (name, v)))


def _k32_scales() -> torch.Tensor:
    """FP32 per-row K32 scales that are exact powers of two (what UE8M0 can hold): ``[G, MN, K/32]``."""
    return torch.exp2(torch.randint(-8, 8, (G, MN, K // 32), dtype=torch.float32))


SF_SPECS: dict[str, Spec] = {
    "mn": Int(1, None, extra=lambda v: v == MN, draw_max=2 * MN),  # the scales' rows are per row: mn fixes their count
    "k": Int(1, None, extra=lambda v: -(-v // 32) == K // 32, draw_max=2 * K),  # ceil(k / 32) scale columns
    "recipe": Recipe((1, 32)),  # another recipe expects another scale shape than this sf's
    "is_sfa": Flag(none_ok=True, refused=(True, False)),  # a 2-tuple recipe takes is_sfa=None
    "disable_ue8m0_cast": Flag(refused=(True,), refused_with=NotImplementedError),  # K32 scales are UE8M0
}


@FUZZ
@given(case=_draw(SF_SPECS))
def test_transform_sf_into_required_layout(default_dtype: torch.dtype, case: tuple[str, object]) -> None:
    name, value = case
    sf = _k32_scales()
    before = sf.clone()
    kwargs = {"mn": MN, "k": K, "recipe": (1, 32), "num_groups": G, name: value}
    want = expect(SF_SPECS[name], value)
    got: list[torch.Tensor] = []
    check(lambda: got.append(dg.transform_sf_into_required_layout(sf, **kwargs)), want, (name, "sf"),
          what=f"transform_sf_into_required_layout({name}={value!r})")
    assert torch.equal(sf, before)
    if want is None:  # four UE8M0 codes per int32, one row per row
        assert got[0].dtype == torch.int32 and tuple(got[0].shape) == (G, MN, K // 32 // 4)


def _fp4_pair(rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An MXFP4 weight pair as the originals' transform takes it: packed E2M1 ``[G, rows, k/2]`` int8 and packed
    UE8M0 K32 scales ``[G, rows, k/128]`` int32 (codes 120..134: finite, not NaN)."""
    w = torch.randint(-128, 128, (G, rows, k // 2), dtype=torch.int8)
    codes = torch.randint(120, 135, (G, rows, k // 32), dtype=torch.uint8)
    return w, quant.pack_ue8m0_k32(codes)


TRANSFORM_SPECS: dict[str, Spec] = {"activation": ACTIVATION, "mma_type": MMA}


@FUZZ
@given(case=_draw(TRANSFORM_SPECS))
def test_transform_weights_for_mega_moe_options(default_dtype: torch.dtype, case: tuple[str, object]) -> None:
    """Options of the originals' transform on an MXFP4 pair: fp8xfp8 (FP8 weights only) refuses its int8 payload as
    a TypeError (a dtype rule)."""
    name, value = case
    l1, l2 = _fp4_pair(2 * MN, K), _fp4_pair(K, MN)
    before = [t.clone() for t in (*l1, *l2)]
    want = expect(TRANSFORM_SPECS[name], value)
    if name == "mma_type" and isinstance(value, str) and value == "fp8xfp8":
        want = TypeError  # FP4 payloads with the FP8xFP8 kind
    check(lambda: dg.transform_weights_for_mega_moe(l1, l2, **{name: value}), want, (name, "l1_weights"),
          what=f"transform_weights_for_mega_moe({name}={value!r})")
    assert all(torch.equal(a, b) for a, b in zip((*l1, *l2), before, strict=True))


@FUZZ
@given(mma=st.one_of(st.sampled_from(["fp8xfp4", "fp8xfp8", "fp8xfp16", "FP8XFP4", ""]), st.none(), st.integers(),
                     st.just(b"fp8xfp8")))
def test_transform_weights_for_gc_moe_format(default_dtype: torch.dtype, mma: object) -> None:
    """The native transform's ``mma_type`` on FP8 block-scaled weights: fp8xfp8 accepted, fp8xfp4 refused as a
    TypeError (its weights must be packed E2M1: a dtype rule), another string ValueError, another type TypeError."""
    l1 = (torch.zeros(G, 2 * MN, K, dtype=torch.float8_e4m3fn),
          torch.ones(G, 2 * MN // 128, K // 128, dtype=torch.float32))
    l2 = (torch.zeros(G, K, MN, dtype=torch.float8_e4m3fn), torch.ones(G, K // 128, MN // 128, dtype=torch.float32))
    want = None if mma == "fp8xfp8" else (ValueError if isinstance(mma, str) and mma != "fp8xfp4" else TypeError)
    check(lambda: transform_weights_for_gc_moe(l1, l2, mma), want, ("mma_type", "l1_weights"),
          what=f"transform_weights_for_gc_moe(mma_type={mma!r})")


@FUZZ
@given(value=values(Flag()), recipe=st.sampled_from([(1, 128), (128, 128), (1, 32)]))
def test_transform_sf_disable_ue8m0_cast_is_a_bool(default_dtype: torch.dtype, value: object,
                                                    recipe: tuple[int, int]) -> None:
    """Issue 32 item 6: ``disable_ue8m0_cast`` must be a bool for every recipe (``'yes'`` is a TypeError, not a
    true value); True is refused only where it asks for the missing FP32 K32 path."""
    gran_mn = recipe[0]
    sf = _k32_scales() if recipe[1] == 32 else torch.ones(G, -(-MN // gran_mn), K // 128, dtype=torch.float32)
    want = expect(Flag(refused=(True,) if recipe[1] == 32 else (), refused_with=NotImplementedError), value)
    check(lambda: dg.transform_sf_into_required_layout(sf, MN, K, recipe, G, disable_ue8m0_cast=value), want,
          ("disable_ue8m0_cast",), what=f"transform_sf_into_required_layout({recipe}, disable_ue8m0_cast={value!r})")


@FUZZ
@given(two_i=st.one_of(st.integers(0, 600), st.sampled_from([24, 256, 8192, 8448, 8192 + 256])))
def test_transform_weights_for_mega_moe_sm90_names_the_rows_passed(default_dtype: torch.dtype, two_i: int) -> None:
    """Issue 32 item 6: the SM90 transform reads l1_weights[0] as [E, 2I, H]; 2I rows that give no supported
    intermediate I = 2I / 2 (a multiple of 128 up to 4096) are refused naming l1_weights[0] and the 2I passed, not
    only the I derived from it. Meta tensors: the shape rules only (no values to read)."""
    l1 = (torch.zeros(G, two_i, K, dtype=torch.float8_e4m3fn, device="meta"),
          torch.ones(G, -(-two_i // 128), K // 128, dtype=torch.float32, device="meta"))
    l2 = (torch.zeros(G, K, two_i // 2, dtype=torch.float8_e4m3fn, device="meta"),
          torch.ones(G, K // 128, -(-two_i // 256), dtype=torch.float32, device="meta"))
    valid = two_i % 256 == 0 and 0 < two_i <= 8192
    names = ("l1_weights[0]",) if two_i % 2 else (f"l1_weights[0]: shape {(G, two_i, K)}", f"2I={two_i}")
    check(lambda: dg.transform_weights_for_mega_moe_sm90(l1, l2), None if valid else ValueError, names,
          what=f"transform_weights_for_mega_moe_sm90(2I={two_i})")


@pytest.mark.parametrize("mma", ["fp8xfp4", "fp8xfp8"])
def test_transform_weights_for_gc_moe_on_meta_tensors(default_dtype: torch.dtype, mma: str) -> None:
    """Issue 32 item 6: the FP4 transform reads the scale codes (the window repack): meta weights are refused naming
    l1_weights and l2_weights (ValueError), not a RuntimeError of .item(); the FP8 transform only rearranges, so meta
    weights pass."""
    if mma == "fp8xfp4":
        l1 = (torch.zeros(G, 2 * MN, K // 2, dtype=torch.uint8), torch.zeros(G, 2 * MN, K // 32, dtype=torch.uint8))
        l2 = (torch.zeros(G, K, MN // 2, dtype=torch.uint8), torch.zeros(G, K, MN // 32, dtype=torch.uint8))
    else:
        l1 = (torch.zeros(G, 2 * MN, K, dtype=torch.float8_e4m3fn),
              torch.ones(G, 2 * MN // 128, K // 128, dtype=torch.float32))
        l2 = (torch.zeros(G, K, MN, dtype=torch.float8_e4m3fn), torch.ones(G, K // 128, MN // 128, dtype=torch.float32))
    meta = [tuple(t.to("meta") for t in pair) for pair in (l1, l2)]
    want = ValueError if mma == "fp8xfp4" else None
    check(lambda: transform_weights_for_gc_moe(*meta, mma), want, ("l1_weights and l2_weights must hold readable "
                                                                   "values",), what=f"{mma} meta weights")
