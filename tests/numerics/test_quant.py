"""Tests for gc_moe_compat.quant: exhaustive code tables, packing orders, error bounds and input validation."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gc_moe_compat import quant as qt

F32_TINY_SLACK = 1e-45  # one float32 subnormal step: absorbs rounding below the normal range


# ----------------------------------------------------------------------------------------------------------------------
# strategies


def _f32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


def _finite_f32(max_abs: float = 1e30) -> st.SearchStrategy[float]:
    """Finite float32 values mixing zeros, subnormal/tiny, ordinary and large magnitudes."""
    tiny, big = _f32(1e-30), _f32(max_abs)
    return st.one_of(
        st.sampled_from([0.0, -0.0]),
        st.floats(-tiny, tiny, width=32),  # includes float32 subnormals
        st.floats(-10.0, 10.0, width=32),
        st.floats(-big, big, width=32),
    )


@st.composite
def _rows(draw: st.DrawFn, block_choices: tuple[int, ...], max_abs: float = 1e30) -> tuple[torch.Tensor, int]:
    """A float32 tensor [rows, K] with K a multiple of the drawn block, each row scaled by its own power of two."""
    block = draw(st.sampled_from(block_choices))
    rows = draw(st.integers(1, 3))
    groups = draw(st.integers(1, 3))
    k = block * groups
    vals = draw(st.lists(_finite_f32(max_abs), min_size=rows * k, max_size=rows * k))
    x = torch.tensor(vals, dtype=torch.float32).reshape(rows, k)
    if draw(st.booleans()):  # zero out one whole group
        x[0, :block] = 0.0
    return x, block


def _e4m3_half_ulp(v: torch.Tensor) -> torch.Tensor:
    """Half an E4M3 ulp at |v| (v already divided by its scale).

    3 mantissa bits: a normal |v| in [2**e, 2**(e+1)) has ulp 2**(e-3), so round-to-nearest errs by at most
    2**(e-4) <= |v| * 2**-4; below the smallest normal 2**-6 the ulp is the subnormal step 2**-9 (half: 2**-10).
    Saturation at 448 stays inside the relative bound for |v| <= 448 * (1 + 2**-23) (the FP32 recipe's overshoot).
    """
    return torch.maximum(v.abs() * 2.0**-4, torch.full_like(v, 2.0**-10))


def _e2m1_half_step(v: torch.Tensor) -> torch.Tensor:
    """Half the E2M1 grid spacing at |v| <= 6: spacing 0.5 on [0, 2), 1 on [2, 4), 2 on [4, 6]."""
    a = v.abs()
    return torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, 1.0))


def _check_fp8_error(x: torch.Tensor, deq: torch.Tensor, scale_per_elem: torch.Tensor) -> None:
    v = x / scale_per_elem
    bound = scale_per_elem * _e4m3_half_ulp(v)
    # float32 rounding of x / scale and of q * scale: 2**-24 relative each
    slack = 2.0**-22 * (x.abs() + deq.abs()) + F32_TINY_SLACK
    err = (deq - x).abs()
    assert torch.isfinite(deq).all()
    assert (err <= bound + slack).all(), f"max excess {(err - bound - slack).max().item()}"


# ----------------------------------------------------------------------------------------------------------------------
# E4M3


ALL_BYTES = torch.arange(256, dtype=torch.uint8)


def test_e4m3_decode_exhaustive_matches_torch_view() -> None:
    got = qt.e4m3_decode(ALL_BYTES)
    ref = ALL_BYTES.view(torch.float8_e4m3fn).float()
    assert got.dtype == torch.float32
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    assert torch.isnan(got).nonzero().flatten().tolist() == [0x7F, 0xFF]
    finite = ~torch.isnan(ref)
    assert torch.equal(got[finite], ref[finite])
    assert torch.equal(torch.signbit(got[finite]), torch.signbit(ref[finite]))  # -0 is 0x80
    assert got[0x7E].item() == 448.0 and got[0x01].item() == 2.0**-9 and got[0x08].item() == 2.0**-6


def test_e4m3_encode_decode_round_trip_every_non_nan_pattern() -> None:
    values = qt.e4m3_decode(ALL_BYTES)
    keep = ~torch.isnan(values)
    assert keep.sum() == 254  # includes +0 (0x00) and -0 (0x80)
    assert torch.equal(qt.e4m3_encode(values[keep]), ALL_BYTES[keep])


def test_e4m3_saturates_and_keeps_nan() -> None:
    x = torch.tensor([1e6, -1e6, 449.0, 500.0, -470.0, float("inf"), float("-inf")])
    assert qt.e4m3_encode(x).tolist() == [0x7E, 0xFE, 0x7E, 0x7E, 0xFE, 0x7E, 0xFE]
    assert qt.to_e4m3(x).float().abs().max().item() == qt.E4M3_MAX
    nan = qt.to_e4m3(torch.tensor([float("nan")]))
    assert nan.dtype == torch.float8_e4m3fn and torch.isnan(nan.float()).all()


def test_e4m3_round_half_even() -> None:
    # 1.0625 lies halfway between 1.0 (even mantissa) and 1.125; 1.1875 halfway between 1.125 and 1.25 (even)
    x = torch.tensor([1.0625, 1.1875, 3 * 2.0**-11, 2.0**-10, 2.0**-10 * 1.0001])
    assert qt.to_e4m3(x).float().tolist() == [1.0, 1.25, 2.0**-9, 0.0, 2.0**-9]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_to_e4m3_matches_torch_cast_in_range(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    mant = torch.randn(20000, generator=g)
    expo = torch.randint(-14, 9, (20000,), generator=g).float()
    x = (mant * torch.exp2(expo)).clamp(-qt.E4M3_MAX, qt.E4M3_MAX).to(dtype)
    assert (x.float().abs() < 2.0**-6).sum() > 100  # the subnormal range is exercised
    got = qt.to_e4m3(x)
    assert got.dtype == torch.float8_e4m3fn
    assert torch.equal(got.view(torch.uint8), x.to(torch.float8_e4m3fn).view(torch.uint8))


# ----------------------------------------------------------------------------------------------------------------------
# E2M1 / FP4


ALL_CODES = torch.arange(16, dtype=torch.uint8)
E2M1_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_e2m1_values_table() -> None:
    assert qt.E2M1_VALUES.dtype == torch.float32 and qt.E2M1_VALUES.shape == (16,)
    assert qt.E2M1_VALUES[:8].tolist() == E2M1_TABLE
    assert qt.E2M1_VALUES[8:].tolist() == [-v for v in E2M1_TABLE]
    assert torch.signbit(qt.E2M1_VALUES[8]).item()  # code 8 is -0
    # bit 3 sign, bits 2..1 exponent (bias 1), bit 0 mantissa
    for c in range(16):
        s, e, m = c >> 3, (c >> 1) & 3, c & 1
        mag = (m * 0.5) if e == 0 else 2.0 ** (e - 1) * (1 + m * 0.5)
        assert qt.E2M1_VALUES[c].item() == (-mag if s else mag)


def test_e2m1_decode_exhaustive_and_round_trip() -> None:
    dec = qt.e2m1_decode(ALL_CODES)
    assert dec.dtype == torch.float32
    assert torch.equal(dec, qt.E2M1_VALUES)
    assert torch.equal(torch.signbit(dec), torch.signbit(qt.E2M1_VALUES))
    assert torch.equal(qt.e2m1_encode(dec), ALL_CODES)


@pytest.mark.parametrize(
    ("x", "expected"),
    [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)]
    + [(0.26, 0.5), (0.74, 0.5), (2.51, 3.0), (4.99, 4.0), (5.01, 6.0), (6.5, 6.0), (1e30, 6.0)],
)
def test_e2m1_ties_and_rounding(x: float, expected: float) -> None:
    for sign in (1.0, -1.0):
        code = qt.e2m1_encode(torch.tensor([sign * x]))
        assert qt.e2m1_decode(code).item() == sign * expected
        assert (code.item() >= 8) == (sign < 0)


def test_e2m1_sign_of_zero_and_infinity() -> None:
    codes = qt.e2m1_encode(torch.tensor([0.0, -0.0, -0.1, float("inf"), float("-inf")]))
    assert codes.tolist() == [0, 8, 8, 7, 15]


def test_e2m1_encode_accepts_low_precision_input() -> None:
    x = torch.tensor([0.75, -2.5, 5.5], dtype=torch.bfloat16)
    assert qt.e2m1_decode(qt.e2m1_encode(x)).tolist() == [1.0, -2.0, 6.0]


def test_pack_fp4_nibble_order_hand_made() -> None:
    codes = torch.tensor([[0x1, 0x2, 0xF, 0x0, 0x7, 0x9]], dtype=torch.uint8)
    packed = qt.pack_fp4(codes)
    assert packed.dtype == torch.uint8
    assert packed.tolist() == [[0x21, 0x0F, 0x97]]  # element 2i low nibble, 2i+1 high nibble
    assert torch.equal(qt.unpack_fp4(packed), codes)
    assert qt.unpack_fp4(torch.tensor([0xAB], dtype=torch.uint8)).tolist() == [0xB, 0xA]


def test_unpack_fp4_accepts_int8() -> None:
    packed = torch.tensor([[-1, 0x21, -128]], dtype=torch.int8)
    assert qt.unpack_fp4(packed).tolist() == [[15, 15, 1, 2, 0, 8]]


def test_pack_fp4_round_trip_random() -> None:
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (3, 5, 64), generator=g, dtype=torch.uint8)
    packed = qt.pack_fp4(codes)
    assert packed.shape == (3, 5, 32)
    assert torch.equal(qt.unpack_fp4(packed), codes)
    assert torch.equal(qt.unpack_fp4(packed.view(torch.int8)), codes)
    assert torch.equal(qt.pack_fp4(codes[..., ::2].contiguous().repeat_interleave(2, -1))[..., 0] & 0xF, codes[..., 0])


def _torch_fp4_reference() -> dict[str, object]:
    """torch's own FP4 test helpers (``_f32_to_floatx_unpacked`` / ``pack_uint4``), read from its source.

    ``torch.testing._internal.common_quantized`` needs test-only packages to import, so the few definitions are
    compiled from the file instead. The helpers are what torch's test suite uses to build ``float4_e2m1fn_x2`` data.
    """
    path = Path(torch.__file__).parent / "testing" / "_internal" / "common_quantized.py"
    if not path.exists():
        pytest.skip("torch's common_quantized.py is not shipped with this torch")
    tree = ast.parse(path.read_text())
    funcs = {"_n_ones", "_f32_to_floatx_unpacked", "down_size", "pack_uint4"}
    consts = {"EBITS_F32", "MBITS_F32", "F32_EXP_BIAS"}

    def wanted(node: ast.stmt) -> bool:
        if isinstance(node, ast.FunctionDef):
            return node.name in funcs
        if isinstance(node, ast.Assign):
            names = {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            return bool(names) and names <= consts
        return False

    module = ast.Module(body=[n for n in tree.body if wanted(n)], type_ignores=[])
    ns: dict[str, object] = {"torch": torch, "Tensor": torch.Tensor}
    exec(compile(module, str(path), "exec"), ns)  # noqa: S102 - torch's own source, test-only
    if not funcs <= ns.keys():
        pytest.skip("torch's FP4 test helpers changed shape")
    return ns


def test_e2m1_and_packing_agree_with_torch_float4_helpers() -> None:
    ref = _torch_fp4_reference()
    g = torch.Generator().manual_seed(2)
    x = torch.cat(
        [
            torch.randn(4096, generator=g) * 3,
            torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.25, -5.0, 0.0]),
            torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]).repeat_interleave(2),
        ]
    )
    x = x[: x.numel() // 2 * 2]
    codes = qt.e2m1_encode(x)
    torch_codes = ref["_f32_to_floatx_unpacked"](x.float(), 2, 1)
    # torch's helper gives +0 for negatives that round to zero; everything else must match bit for bit
    signed_zero = (codes == 8) & (torch_codes == 0)
    assert torch.equal(torch.where(signed_zero, 0, codes), torch_codes)
    packed = ref["pack_uint4"](torch_codes)
    assert torch.equal(qt.pack_fp4(torch_codes), packed)
    assert torch.equal(qt.unpack_fp4(packed.view(torch.float4_e2m1fn_x2).view(torch.uint8)), torch_codes)


# ----------------------------------------------------------------------------------------------------------------------
# UE8M0


ALL_FINITE_UE8M0 = torch.arange(255, dtype=torch.uint8)


def test_ue8m0_decode_encode_all_finite_codes() -> None:
    vals = qt.ue8m0_decode(ALL_FINITE_UE8M0)
    assert vals.dtype == torch.float32
    expected = torch.tensor([2.0 ** (c - 127) for c in range(255)], dtype=torch.float32)
    assert torch.equal(vals, expected)
    assert vals[127].item() == 1.0 and vals[0].item() == 2.0**-127 and vals[254].item() == 2.0**127
    assert torch.equal(qt.ue8m0_encode(vals), ALL_FINITE_UE8M0)
    assert torch.isnan(qt.ue8m0_decode(torch.tensor([255], dtype=torch.uint8))).all()


def test_ue8m0_encode_accepts_other_float_dtypes() -> None:
    scales = torch.tensor([0.5, 1.0, 2.0**-40, 2.0**100], dtype=torch.bfloat16)
    assert qt.ue8m0_encode(scales).tolist() == [126, 127, 87, 227]


@pytest.mark.parametrize("bad", [3.0, 0.0, -0.0, -2.0, 2.0**-128, 2.0**-149, float("inf"), float("nan"), 1.5])
def test_ue8m0_encode_rejects_non_powers_of_two(bad: float) -> None:
    with pytest.raises(ValueError, match=r"ue8m0_encode: scale must hold positive powers of two"):
        qt.ue8m0_encode(torch.tensor([1.0, bad]))


def test_ue8m0_scale_known_values() -> None:
    amax = torch.tensor([448.0, 448.00003, 224.0, 224.00002, 1.0, 0.0, 3.0e38])
    got = qt.ue8m0_scale(amax, qt.E4M3_MAX)
    floor_scale = 2.0 ** math.ceil(math.log2(qt.AMAX_FLOOR / 448))
    assert got.tolist() == [1.0, 2.0, 0.5, 1.0, 2.0**-8, floor_scale, 2.0**120]
    assert qt.ue8m0_scale(torch.tensor([6.0, 6.1, 3.0, 0.75]), qt.E2M1_MAX).tolist() == [1.0, 2.0, 0.5, 0.125]
    assert qt.ue8m0_scale(torch.tensor([5.0], dtype=torch.float64), 6).dtype == torch.float32


@settings(max_examples=200, deadline=None)
@given(
    # amax <= 2**127 keeps the scale within UE8M0 for every fmt_max >= 1 (beyond, it raises: error-path cases)
    amax=st.lists(st.floats(0.0, 2.0**127, width=32), min_size=1, max_size=32),
    fmt_max=st.sampled_from([qt.E4M3_MAX, qt.E2M1_MAX, 1.0, 57344.0]),
)
def test_ue8m0_scale_is_smallest_fitting_power_of_two(amax: list[float], fmt_max: float) -> None:
    a = torch.tensor(amax, dtype=torch.float32)
    s = qt.ue8m0_scale(a, fmt_max)
    assert s.dtype == torch.float32
    qt.ue8m0_encode(s)  # a power of two within UE8M0's range, or this raises
    for ai, si in zip(a.tolist(), s.tolist(), strict=True):  # exact float64 arithmetic on float32 values
        eff = max(ai, float(torch.tensor(qt.AMAX_FLOOR, dtype=torch.float32)))
        assert eff / si <= fmt_max
        assert eff / (si / 2) > fmt_max
    assert ((a / s) <= fmt_max).all()  # also in float32


def test_pack_ue8m0_k32_byte_order_hand_made() -> None:
    codes = torch.tensor([[0x01, 0x02, 0x03, 0xC8, 0x7F, 0x80, 0x00, 0xFE]], dtype=torch.uint8)
    packed = qt.pack_ue8m0_k32(codes)
    assert packed.dtype == torch.int32 and packed.shape == (1, 2)
    words = [w & 0xFFFFFFFF for w in packed.flatten().tolist()]
    assert words == [0xC8030201, 0xFE00807F]  # group 4i+j in byte j, j=0 least significant
    assert torch.equal(packed, codes.view(torch.int32))  # = DeepGEMM's little-endian uint8 -> int32 view
    assert torch.equal(qt.unpack_ue8m0_k32(packed), codes)


def test_pack_ue8m0_k32_round_trip_random() -> None:
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 256, (2, 3, 16), generator=g, dtype=torch.uint8)
    packed = qt.pack_ue8m0_k32(codes)
    assert packed.shape == (2, 3, 4)
    assert torch.equal(qt.unpack_ue8m0_k32(packed), codes)
    strided = codes.transpose(0, 1)  # non-contiguous input packs the same values
    assert torch.equal(qt.pack_ue8m0_k32(strided), packed.transpose(0, 1))


# ----------------------------------------------------------------------------------------------------------------------
# FP8 groups


@settings(max_examples=150, deadline=None)
@given(data=_rows((1, 4, 32, 128)), scale_format=st.sampled_from(["fp32", "ue8m0"]))
def test_fp8_groups_error_within_half_ulp(data: tuple[torch.Tensor, int], scale_format: str) -> None:
    x, gs = data
    q, s = qt.quantize_fp8_groups(x, gs, scale_format)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == (x.shape[0], x.shape[1] // gs)
    assert torch.isfinite(s).all() and (s > 0).all()
    amax = x.reshape(x.shape[0], -1, gs).abs().amax(-1)
    if scale_format == "ue8m0":
        qt.ue8m0_encode(s)  # powers of two
        assert ((amax / s) <= qt.E4M3_MAX).all()
    else:
        assert torch.equal(s, amax.clamp(min=qt.AMAX_FLOOR) / qt.E4M3_MAX)
        assert ((amax / s) <= qt.E4M3_MAX * (1 + 2.0**-22)).all()  # one float32 rounding; the cast saturates it
    deq = qt.dequantize_fp8_groups(q, s)
    assert deq.dtype == torch.float32
    _check_fp8_error(x, deq, s.repeat_interleave(gs, dim=-1))


def test_fp8_groups_leading_dims_and_dtypes() -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 256, generator=g).to(torch.bfloat16)
    q, s = qt.quantize_fp8_groups(x, 128)
    assert q.shape == (2, 3, 256) and s.shape == (2, 3, 2)
    q2, s2 = qt.quantize_fp8_groups(x.float(), 128)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    q3, s3 = qt.quantize_fp8_groups(x, 32, scale_format="ue8m0")
    assert s3.shape == (2, 3, 8)
    assert torch.equal(qt.dequantize_fp8_groups(q3, s3.bfloat16()), qt.dequantize_fp8_groups(q3, s3))


@pytest.mark.parametrize("scale_format", ["fp32", "ue8m0"])
def test_fp8_groups_all_zero_group(scale_format: str) -> None:
    x = torch.zeros(2, 64)
    x[1, 32:] = torch.linspace(-1, 1, 32)
    q, s = qt.quantize_fp8_groups(x, 32, scale_format)
    assert torch.isfinite(s).all() and (s > 0).all()
    deq = qt.dequantize_fp8_groups(q, s)
    assert torch.equal(deq[0], torch.zeros(64)) and torch.equal(deq[1, :32], torch.zeros(32))
    expected = qt.AMAX_FLOOR / 448 if scale_format == "fp32" else 2.0 ** math.ceil(math.log2(qt.AMAX_FLOOR / 448))
    assert s[0, 0].item() == pytest.approx(expected, rel=1e-6)


# ----------------------------------------------------------------------------------------------------------------------
# FP8 blocks


@st.composite
def _matrices(draw: st.DrawFn) -> tuple[torch.Tensor, int]:
    block = draw(st.sampled_from([1, 2, 4, 8, 128]))
    lead = draw(st.sampled_from([(), (2,)]))
    n, k = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    numel = math.prod(lead) * n * k
    vals = draw(st.lists(_finite_f32(), min_size=numel, max_size=numel))
    return torch.tensor(vals, dtype=torch.float32).reshape(*lead, n, k), block


@settings(max_examples=150, deadline=None)
@given(data=_matrices())
def test_fp8_blocks_error_within_half_ulp(data: tuple[torch.Tensor, int]) -> None:
    w, block = data
    q, s = qt.quantize_fp8_blocks(w, block)
    n, k = w.shape[-2:]
    nb, kb = -(-n // block), -(-k // block)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (*w.shape[:-2], nb, kb)
    s_full = s.repeat_interleave(block, -2)[..., :n, :].repeat_interleave(block, -1)[..., :k]
    # amax over each (possibly partial) block, computed independently of the implementation's padding
    amax = torch.zeros_like(s)
    for i in range(nb):
        for j in range(kb):
            tile = w[..., i * block : (i + 1) * block, j * block : (j + 1) * block]
            amax[..., i, j] = tile.abs().amax(dim=(-2, -1))
    assert torch.equal(s, amax.clamp(min=qt.AMAX_FLOOR) / qt.E4M3_MAX)
    assert ((amax / s) <= qt.E4M3_MAX * (1 + 2.0**-22)).all()
    deq = qt.dequantize_fp8_blocks(q, s, block)
    _check_fp8_error(w, deq, s_full)


def test_fp8_blocks_default_block_partial_edges_and_zero_block() -> None:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(3, 200, 300, generator=g)
    w[:, :128, :128] = 0.0
    q, s = qt.quantize_fp8_blocks(w)
    assert s.shape == (3, 2, 3)
    assert torch.isfinite(s).all() and (s[:, 0, 0] == qt.AMAX_FLOOR / qt.E4M3_MAX).all()
    deq = qt.dequantize_fp8_blocks(q, s)
    assert torch.equal(deq[:, :128, :128], torch.zeros(3, 128, 128))
    assert torch.equal(s[:, 1, 2], w[:, 128:, 256:].abs().amax(dim=(-2, -1)) / qt.E4M3_MAX)
    assert ((deq - w).abs() <= s.max() * 16 + 1e-6).all()


# ----------------------------------------------------------------------------------------------------------------------
# MXFP4


@settings(max_examples=150, deadline=None)
@given(data=_rows((2, 4, 32), max_abs=1e36))
def test_mxfp4_error_within_half_step(data: tuple[torch.Tensor, int]) -> None:
    w, block = data
    packed, codes = qt.quantize_mxfp4(w, block)
    assert packed.dtype == torch.uint8 and packed.shape == (w.shape[0], w.shape[1] // 2)
    assert codes.dtype == torch.uint8 and codes.shape == (w.shape[0], w.shape[1] // block)
    scale = qt.ue8m0_decode(codes)
    amax = w.reshape(w.shape[0], -1, block).abs().amax(-1)
    assert torch.equal(scale, qt.ue8m0_scale(amax, qt.E2M1_MAX))
    assert ((amax / scale) <= qt.E2M1_MAX).all()
    deq = qt.dequantize_mxfp4(packed, codes)
    assert deq.dtype == torch.float32 and deq.shape == w.shape
    s_full = scale.repeat_interleave(block, dim=-1)
    bound = s_full * _e2m1_half_step(w / s_full)  # the division by a power of two is exact
    assert torch.isfinite(deq).all()
    assert ((deq - w).abs() <= bound + F32_TINY_SLACK).all()
    assert torch.equal(qt.dequantize_mxfp4(packed.view(torch.int8), codes), deq)


def test_mxfp4_all_zero_block_and_exact_grid() -> None:
    w = torch.zeros(2, 64)
    w[1, 32:] = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0] * 4) * -(2.0**-5)
    packed, codes = qt.quantize_mxfp4(w)
    scale = qt.ue8m0_decode(codes)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert codes[0, 0].item() == 127 + math.ceil(math.log2(qt.AMAX_FLOOR / 6))
    assert codes[1, 1].item() == 127 - 5
    deq = qt.dequantize_mxfp4(packed, codes)
    assert torch.equal(deq, w)  # grid values times a power of two are exact


# ----------------------------------------------------------------------------------------------------------------------
# validation: every error path names its argument


F8 = torch.zeros(2, 4, dtype=torch.float8_e4m3fn)
U8 = torch.zeros(2, 4, dtype=torch.uint8)
F32 = torch.zeros(2, 4)
I32 = torch.zeros(2, 1, dtype=torch.int32)
NAN = torch.tensor([[1.0, float("nan"), 0.0, 0.0]])
INF = torch.tensor([[1.0, float("inf"), 0.0, 0.0]])


@pytest.mark.parametrize(
    ("call", "exc", "pattern"),
    [
        # not a tensor / wrong dtype
        (lambda: qt.to_e4m3([1.0]), TypeError, r"to_e4m3: x must be a torch.Tensor, got list"),
        (lambda: qt.to_e4m3(U8), TypeError, r"to_e4m3: x must have a floating-point dtype, got torch.uint8"),
        (lambda: qt.e4m3_encode(U8), TypeError, r"e4m3_encode: x must have a floating-point dtype"),
        (lambda: qt.e4m3_decode(F32), TypeError, r"e4m3_decode: bits must have dtype torch.uint8, got torch.float32"),
        (lambda: qt.ue8m0_scale(U8, 448.0), TypeError, r"ue8m0_scale: amax must have a floating-point dtype"),
        (lambda: qt.ue8m0_scale(F32, "448"), TypeError, r"ue8m0_scale: fmt_max must be a float, got str"),
        (lambda: qt.ue8m0_scale(F32, True), TypeError, r"ue8m0_scale: fmt_max must be a float, got bool"),
        (lambda: qt.ue8m0_encode(U8), TypeError, r"ue8m0_encode: scale must have a floating-point dtype"),
        (lambda: qt.ue8m0_decode(I32), TypeError, r"ue8m0_decode: code must have dtype torch.uint8"),
        (lambda: qt.pack_ue8m0_k32(I32), TypeError, r"pack_ue8m0_k32: codes must have dtype torch.uint8"),
        (lambda: qt.unpack_ue8m0_k32(U8), TypeError, r"unpack_ue8m0_k32: packed must have dtype torch.int32"),
        (lambda: qt.quantize_fp8_groups(U8, 2), TypeError, r"quantize_fp8_groups: x must have a floating-point"),
        (lambda: qt.quantize_fp8_groups(F32, 2.0), TypeError, r"quantize_fp8_groups: group_size must be an int"),
        (lambda: qt.quantize_fp8_groups(F32, True), TypeError, r"quantize_fp8_groups: group_size must be an int"),
        (
            lambda: qt.dequantize_fp8_groups(U8, F32),
            TypeError,
            r"dequantize_fp8_groups: q must have dtype torch.float8",
        ),
        (lambda: qt.dequantize_fp8_groups(F8, U8), TypeError, r"dequantize_fp8_groups: scales must have a floating"),
        (lambda: qt.quantize_fp8_blocks(U8), TypeError, r"quantize_fp8_blocks: w must have a floating-point"),
        (lambda: qt.quantize_fp8_blocks(F32, "128"), TypeError, r"quantize_fp8_blocks: block must be an int"),
        (lambda: qt.dequantize_fp8_blocks(F32, F32), TypeError, r"dequantize_fp8_blocks: q must have dtype"),
        (lambda: qt.dequantize_fp8_blocks(F8, U8), TypeError, r"dequantize_fp8_blocks: scales must have a floating"),
        (lambda: qt.dequantize_fp8_blocks(F8, F32, 1.5), TypeError, r"dequantize_fp8_blocks: block must be an int"),
        (lambda: qt.e2m1_encode(U8), TypeError, r"e2m1_encode: x must have a floating-point dtype"),
        (lambda: qt.e2m1_decode(F32), TypeError, r"e2m1_decode: codes must have dtype torch.uint8"),
        (lambda: qt.pack_fp4(F32), TypeError, r"pack_fp4: codes must have dtype torch.uint8"),
        (lambda: qt.unpack_fp4(F32), TypeError, r"unpack_fp4: packed must have dtype torch.uint8 or torch.int8"),
        (lambda: qt.quantize_mxfp4(U8), TypeError, r"quantize_mxfp4: w must have a floating-point dtype"),
        (lambda: qt.quantize_mxfp4(F32, None), TypeError, r"quantize_mxfp4: block must be an int, got NoneType"),
        (lambda: qt.dequantize_mxfp4(F32, U8), TypeError, r"dequantize_mxfp4: packed must have dtype"),
        (lambda: qt.dequantize_mxfp4(U8, I32), TypeError, r"dequantize_mxfp4: scale_codes must have dtype torch.uint8"),
        # values: finiteness, ranges, signs
        (lambda: qt.ue8m0_scale(F32, 0.0), ValueError, r"ue8m0_scale: fmt_max must be a positive.*got 0.0"),
        (lambda: qt.ue8m0_scale(F32, 1e-40), ValueError, r"ue8m0_scale: fmt_max must be .*normal float32.*1e-40"),
        (lambda: qt.ue8m0_scale(F32, float("inf")), ValueError, r"ue8m0_scale: fmt_max must be .*got inf"),
        (lambda: qt.ue8m0_scale(INF, 448.0), ValueError, r"ue8m0_scale: amax must be finite.*inf"),
        (lambda: qt.ue8m0_scale(NAN, 448.0), ValueError, r"ue8m0_scale: amax must be finite.*nan"),
        (lambda: qt.ue8m0_scale(-F32 - 1, 448.0), ValueError, r"ue8m0_scale: amax must be non-negative, got -1.0"),
        (lambda: qt.ue8m0_scale(F32, 1e38), ValueError, r"ue8m0_scale: .*fmt_max=1e\+38 needs 2\*\*k.*outside UE8M0"),
        (
            lambda: qt.ue8m0_scale(torch.tensor([3e38]), 1e-30),
            ValueError,
            r"ue8m0_scale: the scale for amax .*fmt_max=1e-30.*outside UE8M0",
        ),
        (lambda: qt.quantize_fp8_groups(NAN, 2), ValueError, r"quantize_fp8_groups: x must be finite.*nan"),
        (lambda: qt.quantize_fp8_groups(INF, 2), ValueError, r"quantize_fp8_groups: x must be finite.*inf"),
        (lambda: qt.quantize_fp8_blocks(INF), ValueError, r"quantize_fp8_blocks: w must be finite"),
        (lambda: qt.quantize_mxfp4(NAN, 2), ValueError, r"quantize_mxfp4: w must be finite"),
        (lambda: qt.e2m1_encode(NAN), ValueError, r"e2m1_encode: x must not contain NaN"),
        (lambda: qt.e2m1_decode(U8 + 16), ValueError, r"e2m1_decode: codes must hold values in 0..15, got 16"),
        (lambda: qt.pack_fp4(U8 + 200), ValueError, r"pack_fp4: codes must hold values in 0..15, got 200"),
        # shapes and divisibility
        (lambda: qt.pack_ue8m0_k32(U8[:, :3]), ValueError, r"pack_ue8m0_k32: codes.shape\[-1\].*multiple of 4, got 3"),
        (lambda: qt.pack_ue8m0_k32(U8[0, 0]), ValueError, r"pack_ue8m0_k32: codes must have at least 1 dim"),
        (lambda: qt.unpack_ue8m0_k32(I32[0, 0]), ValueError, r"unpack_ue8m0_k32: packed must have at least 1 dim"),
        (
            lambda: qt.quantize_fp8_groups(F32, 3),
            ValueError,
            r"quantize_fp8_groups: x.shape\[-1\] \(K=4\).*group_size=3",
        ),
        (
            lambda: qt.quantize_fp8_groups(F32, 0),
            ValueError,
            r"quantize_fp8_groups: group_size must be >= 1, got 0",
        ),
        (lambda: qt.quantize_fp8_groups(F32[0, 0], 1), ValueError, r"quantize_fp8_groups: x must have at least 1"),
        (
            lambda: qt.quantize_fp8_groups(F32, 2, "bf16"),
            ValueError,
            r"quantize_fp8_groups: scale_format must be one of \('fp32', 'ue8m0'\), got 'bf16'",
        ),
        (lambda: qt.dequantize_fp8_groups(F8, F32[:1]), ValueError, r"dequantize_fp8_groups: scales must share q's"),
        (lambda: qt.dequantize_fp8_groups(F8, F32[:, :3]), ValueError, r"dequantize_fp8_groups: q.shape\[-1\] \(K=4\)"),
        (lambda: qt.dequantize_fp8_groups(F8, F32[:, :0]), ValueError, r"dequantize_fp8_groups: .*\(G=0\)"),
        (lambda: qt.dequantize_fp8_groups(F8[0, 0], F32), ValueError, r"dequantize_fp8_groups: q must have at least 1"),
        (lambda: qt.dequantize_fp8_groups(F8, F32[0, 0]), ValueError, r"dequantize_fp8_groups: scales must have at"),
        (lambda: qt.quantize_fp8_blocks(F32[0]), ValueError, r"quantize_fp8_blocks: w must have at least 2 dim"),
        (lambda: qt.quantize_fp8_blocks(F32, -1), ValueError, r"quantize_fp8_blocks: block must be >= 1, got -1"),
        (lambda: qt.dequantize_fp8_blocks(F8[0], F32), ValueError, r"dequantize_fp8_blocks: q must have at least 2"),
        (
            lambda: qt.dequantize_fp8_blocks(F8, F32, 2),
            ValueError,
            r"dequantize_fp8_blocks: scales must have shape \(1, 2\) for q \(2, 4\) and block=2, got \(2, 4\)",
        ),
        (lambda: qt.pack_fp4(U8[:, :3]), ValueError, r"pack_fp4: codes.shape\[-1\] \(K=3\) must be even"),
        (lambda: qt.pack_fp4(U8[0, 0]), ValueError, r"pack_fp4: codes must have at least 1 dim"),
        (lambda: qt.unpack_fp4(U8[0, 0]), ValueError, r"unpack_fp4: packed must have at least 1 dim"),
        (lambda: qt.quantize_mxfp4(F32, 3), ValueError, r"quantize_mxfp4: w.shape\[-1\] \(K=4\).*block=3"),
        (lambda: qt.quantize_mxfp4(F32[:, :1], 1), ValueError, r"quantize_mxfp4: w.shape\[-1\] \(K=1\) must be even"),
        (lambda: qt.quantize_mxfp4(F32, 0), ValueError, r"quantize_mxfp4: block must be >= 1"),
        (lambda: qt.quantize_mxfp4(F32[0, 0]), ValueError, r"quantize_mxfp4: w must have at least 1 dim"),
        (lambda: qt.dequantize_mxfp4(U8[0, 0], U8), ValueError, r"dequantize_mxfp4: packed must have at least 1"),
        (lambda: qt.dequantize_mxfp4(U8, U8[0, 0]), ValueError, r"dequantize_mxfp4: scale_codes must have at least"),
        (lambda: qt.dequantize_mxfp4(U8, U8[:1]), ValueError, r"dequantize_mxfp4: scale_codes must share packed's"),
        (lambda: qt.dequantize_mxfp4(U8, U8[:, :3]), ValueError, r"dequantize_mxfp4: K = 2 \* packed.shape\[-1\] = 8"),
    ],
)
def test_validation_messages_name_the_argument(call: object, exc: type[Exception], pattern: str) -> None:
    with pytest.raises(exc, match=pattern):
        call()
