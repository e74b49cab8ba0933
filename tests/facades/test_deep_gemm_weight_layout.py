"""``transform_weights_for_mega_moe`` returns the originals' layout, and ``fp8_fp4_mega_moe`` reads it (issue 22,
item 3).

The expected results come from a torch model written here from the originals' documented formula (DeepGEMM 2.8.2
and ``sgl-deep-gemm`` ``deep_gemm/mega/__init__.py``, which agree): ``_interleave_weights`` (``[gate 0..7, up 0..7,
gate 8..15, ...]``) of the L1 payload and scales, then ``_transpose_sf_for_utccp``
(``sf.reshape(G, mn/128, 4, 32, k').transpose(2, 3).reshape(G, mn, k')``) of the L1 and L2 int32 scales, every result
in ``torch.empty_like(input)`` (the input's strides), the L2 payload returned as it is, 2-D (one expert) inputs
handled as ``[1, ...]``. It shares no code with :mod:`gc_moe_compat.layouts`. CPU tests compare bit for bit (values,
shapes, dtypes, strides); the GPU test runs the facade on weights made by that formula against the native API on the
canonical weights (bit-identical ``y``) and the FP32 quantization-faithful reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import gc_moe_compat.deep_gemm as dg
from gc_moe_compat import quant
from gc_moe_compat.deep_gemm import _seam as seam
from gc_moe_compat.operator import api

H, N_I, E = 512, 256, 3

_Pair = tuple[torch.Tensor, torch.Tensor]


# ------------------------------------------------------------------------------------------------------------------
# The originals' formula (the test's own model)


def _model_interleave(t: torch.Tensor, gran: int = 8) -> torch.Tensor:
    squeeze = t.dim() == 2
    t3 = t.unsqueeze(0) if squeeze else t
    g, n, *rest = t3.shape
    gate = t3[:, :n // 2].reshape(g, n // 2 // gran, gran, *rest)
    up = t3[:, n // 2:].reshape(g, n // 2 // gran, gran, *rest)
    out = torch.empty_like(t3).copy_(torch.stack([gate, up], dim=2).reshape(g, n, *rest))
    return out.squeeze(0) if squeeze else out


def _model_utccp(sf: torch.Tensor) -> torch.Tensor:
    squeeze = sf.dim() == 2
    s3 = sf.unsqueeze(0) if squeeze else sf
    g, mn, k = s3.shape
    out = torch.empty_like(s3).copy_(s3.reshape(g, mn // 128, 4, 32, k).transpose(2, 3).reshape(g, mn, k))
    return out.squeeze(0) if squeeze else out


def originals_layout(l1: _Pair, l2: _Pair) -> tuple[_Pair, _Pair]:
    """What the originals' ``transform_weights_for_mega_moe`` returns for weight pairs ``(l1, l2)``."""
    return ((_model_interleave(l1[0]), _model_utccp(_model_interleave(l1[1]))), (l2[0], _model_utccp(l2[1])))


# ------------------------------------------------------------------------------------------------------------------
# Inputs


def _payload(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Random payload bytes of ``dtype``: any FP4 byte; E4M3 bytes without the NaN codes 0x7f / 0xff."""
    raw = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    if dtype == torch.float8_e4m3fn:
        raw[(raw & 0x7F) == 0x7F] = 0x38  # 1.0
    return raw.view(dtype)


def _scales(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Random packed UE8M0 K32 scales ``[..., K/128]`` int32 (codes 100..150: no NaN code 255)."""
    codes = torch.randint(100, 151, (*shape[:-1], shape[-1] * 4), dtype=torch.uint8, generator=g)
    return quant.pack_ue8m0_k32(codes)


def _pairs(lead: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> tuple[_Pair, _Pair]:
    """Canonical ``(l1 [lead, 2I, H'], l2 [lead, H, I'])`` pairs of payload ``dtype`` with int32 K32 scales."""
    g = torch.Generator().manual_seed(seed)
    per_byte = 1 if dtype == torch.float8_e4m3fn else 2
    l1 = (_payload((*lead, 2 * N_I, H // per_byte), dtype, g), _scales((*lead, 2 * N_I, H // 128), g))
    l2 = (_payload((*lead, H, N_I // per_byte), dtype, g), _scales((*lead, H, N_I // 128), g))
    return l1, l2


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype} {got.shape} != {want.dtype} " \
                                                                 f"{want.shape}"
    assert got.stride() == want.stride(), f"{what}: strides {got.stride()} != {want.stride()}"
    assert torch.equal(_bits(got), _bits(want)), f"{what}: values differ"


# ------------------------------------------------------------------------------------------------------------------
# The layout, bit for bit


@pytest.mark.parametrize(("lead", "dtype", "mma_type"), [
    ((E,), torch.int8, "fp8xfp4"),            # routed MXFP4, DeepGEMM's int8 storage
    ((E,), torch.uint8, "fp8xfp4"),           # routed MXFP4 as uint8
    ((), torch.int8, "fp8xfp4"),              # one expert, 2-D
    ((), torch.float8_e4m3fn, "fp8xfp4"),     # a shared expert: FP8 2-D, default mma_type (SGLang, DeepGEMM's test)
    ((1,), torch.float8_e4m3fn, "fp8xfp4"),   # a shared expert as [1, N, K]
    ((E,), torch.float8_e4m3fn, "fp8xfp8"),   # SM100 FP8xFP8 weights (per-row K32 scales)
], ids=["fp4-int8", "fp4-uint8", "fp4-2d", "fp8-shared-2d", "fp8-shared-3d", "fp8xfp8"])
def test_transform_returns_the_originals_layout(lead: tuple[int, ...], dtype: torch.dtype, mma_type: str) -> None:
    l1, l2 = _pairs(lead, dtype)
    originals = [tuple(t.clone() for t in pair) for pair in (l1, l2)]
    (w1, s1), (w2, s2) = dg.transform_weights_for_mega_moe(l1, l2, mma_type=mma_type)
    (m1, n1), (m2, n2) = originals_layout(l1, l2)
    for got, want, what in ((w1, m1, "l1 payload"), (s1, n1, "l1 scales"), (w2, m2, "l2 payload"),
                            (s2, n2, "l2 scales")):
        _assert_same(got, want, what)
    assert w2 is l2[0]  # the originals return the L2 payload itself
    assert all(torch.equal(_bits(t), _bits(o)) for pair, opair in zip((l1, l2), originals, strict=True)
               for t, o in zip(pair, opair, strict=True))  # inputs untouched


def test_transform_refuses_what_gc_moe_has_no_path_for() -> None:
    l1, l2 = _pairs((E,), torch.int8)
    with pytest.raises(NotImplementedError, match="BF16"):
        dg.transform_weights_for_mega_moe(torch.zeros(E, 2 * N_I, H, dtype=torch.bfloat16), l2[0])
    with pytest.raises(NotImplementedError, match="mma_type='mxf4xmxf4'"):
        dg.transform_weights_for_mega_moe(l1, l2, mma_type="mxf4xmxf4")
    with pytest.raises(NotImplementedError, match="activation='swigluoai'"):
        dg.transform_weights_for_mega_moe(l1, l2, activation="swigluoai")


def test_transform_keeps_the_strides_of_mn_major_scales() -> None:
    """DeepGEMM's SM100 ``transform_sf_into_required_layout`` returns MN-major int32 scales; the originals' results
    (``empty_like``) keep those strides, and so does the facade."""
    l1, l2 = _pairs((E,), torch.int8)
    mn_major = [s.transpose(1, 2).contiguous().transpose(1, 2) for s in (l1[1], l2[1])]
    assert not mn_major[0].is_contiguous() and torch.equal(mn_major[0], l1[1])
    (_, s1), (_, s2) = dg.transform_weights_for_mega_moe((l1[0], mn_major[0]), (l2[0], mn_major[1]))
    (_, n1), (_, n2) = originals_layout((l1[0], mn_major[0]), (l2[0], mn_major[1]))
    _assert_same(s1, n1, "l1 scales")
    _assert_same(s2, n2, "l2 scales")
    assert s1.stride() == mn_major[0].stride()


def test_utccp_order_is_the_documented_transpose() -> None:
    """Row ``128c + 4b + a`` of a transformed L2 scale tensor holds canonical row ``128c + 32a + b``."""
    l1, l2 = _pairs((E,), torch.int8)
    (_, _), (_, s2) = dg.transform_weights_for_mega_moe(l1, l2)
    for row in (0, 1, 4, 5, 127, 128, 133, H - 1):
        c, r = divmod(row, 128)
        b, a = divmod(r, 4)
        assert torch.equal(s2[:, row], l2[1][:, 128 * c + 32 * a + b])


def test_meta_tensors_get_the_shape_rules_only() -> None:
    l1, l2 = _pairs((E,), torch.int8)
    meta = [tuple(t.to("meta") for t in pair) for pair in (l1, l2)]
    (w1, s1), (w2, s2) = dg.transform_weights_for_mega_moe(*meta)
    assert s1.is_meta and s1.shape == l1[1].shape and s1.dtype == torch.int32 and w2 is meta[1][0]
    with pytest.raises(ValueError, match="K/128 = 4 words"):
        dg.transform_weights_for_mega_moe((meta[0][0], meta[0][1][..., :3]), meta[1])


# ------------------------------------------------------------------------------------------------------------------
# fp8_fp4_mega_moe reads that layout (the conversion, on CPU)


def _canonical_fp4(seed: int = 1) -> tuple[_Pair, _Pair]:
    g = torch.Generator().manual_seed(seed)
    return (quant.quantize_mxfp4(torch.randn(E, 2 * N_I, H, generator=g)),
            quant.quantize_mxfp4(torch.randn(E, H, N_I, generator=g)))


def _same(a: api.GcMoeWeights, b: api.GcMoeWeights) -> bool:
    return all(torch.equal(x, y) for x, y in ((a.payload, b.payload), (a.scales, b.scales), (a.factor, b.factor)))


def test_conversion_reads_the_originals_layout_only(group: dist.ProcessGroup) -> None:
    """The originals' layout converts to the native transform of the canonical weights; the interleave-only form
    (the facade's earlier output, same shapes and dtypes) converts to other weights: it is read as UTCCP-ordered."""
    canonical = _canonical_fp4()
    packed = [(w, quant.pack_ue8m0_k32(sf)) for w, sf in canonical]
    sym = dg.get_symm_buffer_for_mega_moe(group, E, 16, 2, H, N_I)
    ref1, ref2 = api.transform_weights_for_gc_moe(*canonical, mma_type="fp8xfp4")
    w1, w2 = seam.operator_weights(sym, "fp8xfp4", *originals_layout(*packed))
    assert _same(w1, ref1) and _same(w2, ref2)
    old_l1 = (_model_interleave(packed[0][0]), _model_interleave(packed[0][1]))
    v1, v2 = seam.operator_weights(sym, "fp8xfp4", old_l1, packed[1])
    assert not _same(v1, ref1) and not _same(v2, ref2)


# ------------------------------------------------------------------------------------------------------------------
# GPU: the facade on the originals' layout == the native API on the canonical weights


@pytest.mark.gpu
def test_fp8_fp4_mega_moe_on_the_originals_layout_matches_the_native_api(group: dist.ProcessGroup) -> None:
    """dsv41-flash's rank: weights in the originals' layout (the formula above) through the facade give the native
    API's ``y`` on the canonical weights bit for bit, and meet the accuracy targets against the FP32 reference, at
    T = 1, an odd T and the capacity, from poisoned workspaces and ``y``."""
    from operator_kit import (
        CAPACITY,
        CLAMP,
        assert_bits_equal,
        check_accuracy,
        make_inputs,
        make_weights,
        preset_dims,
        reference_ys,
        start_call,
    )

    preset = "dsv41-flash"
    e, k, h, inter = preset_dims(preset)
    weights = make_weights(preset, 0, mma_type="fp8xfp4")
    packed = [(w.payload, quant.pack_ue8m0_k32(w.scales)) for w in (weights.l1, weights.l2)]
    l1, l2 = originals_layout(*packed)
    sym = dg.get_symm_buffer_for_mega_moe(group, e, CAPACITY, k, h, inter, mma_type="fp8xfp4")
    native = api.get_symm_buffer_for_gc_moe(group, e, CAPACITY, k, h, inter, "fp8xfp4")
    for tokens in (1, 37, CAPACITY):
        inputs = make_inputs("uniform", tokens, e, k, h, seed=tokens)
        y_facade, y_native = start_call(sym.workspace, inputs), start_call(native, inputs)
        dg.fp8_fp4_mega_moe(y_facade, l1, l2, sym, activation_clamp=CLAMP)
        api.fp8_fp4_gc_moe(y_native, weights.w1, weights.w2, native, activation_clamp=CLAMP)
        torch.cuda.synchronize()
        assert_bits_equal(y_facade, y_native, f"facade on the originals' layout vs native, T={tokens}")
        check_accuracy(y_facade, reference_ys([inputs], [weights])[0], f"facade T={tokens}", preset)
