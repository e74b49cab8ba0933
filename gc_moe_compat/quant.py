"""Bit-exact quantization helpers for the FP8 (E4M3) and MXFP4 (E2M1 + UE8M0) formats the MoE kernels read.

Everything here is pure torch and device-agnostic: tensors stay on the device they arrive on, nothing loops over
elements in Python, and no numpy is involved. The functions exist so that the weight transforms, the layout code and
the quantization-faithful reference all produce *the same bits* the kernels consume; reading a result through these
functions and through the hardware must agree exactly.

Formats
-------
* **E4M3** (``torch.float8_e4m3fn``): 1 sign, 4 exponent (bias 7), 3 mantissa bits; max normal 448, min normal 2**-6,
  min subnormal 2**-9; no infinities, ``0x7F``/``0xFF`` are NaN. :func:`to_e4m3` rounds to nearest even and
  *saturates* to ±448 (±inf saturates too, NaN stays NaN), the behaviour of the kernels' ``cvt.rn.satfinite``.
  Conversion goes through float32, so a float64 input is rounded twice (float64 -> float32 -> E4M3).
* **E2M1** (FP4): code bit 3 = sign, bits 2..1 = exponent (bias 1), bit 0 = mantissa. Codes 0..7 are
  +{0, 0.5, 1, 1.5, 2, 3, 4, 6}, codes 8..15 their negatives (8 is -0). :func:`e2m1_encode` rounds to the nearest grid
  value with ties to the code whose mantissa bit is 0 (round-half-even on the code), saturating |x| > 6 to 6; the sign
  bit is always copied, so -0.0 and small negatives that round to zero give code 8 (-0), which decodes to -0.0 and
  compares equal to 0.
* **UE8M0** scale factors: an unsigned 8-bit biased exponent, value ``2**(code - 127)``; code 127 is 1.0, codes
  0..254 are finite (2**-127 .. 2**127) and 255 is NaN per the OCP Microscaling spec v1.0. The code equals the float32
  biased-exponent field of the scale (2**-127 being the one float32 subnormal in range).

UE8M0 rounding rule
-------------------
A block's scale is the *smallest* power of two that brings its absolute maximum inside the element format:
``scale = 2**ceil(log2(max(amax, AMAX_FLOOR) / fmt_max))``, so that ``amax / scale <= fmt_max`` always holds and no
element saturates (``fmt_max`` = 448 for E4M3, 6 for E2M1). :func:`ue8m0_scale` evaluates this exactly (the exponent
is read from ``frexp`` and settled by one exact power-of-two comparison), not through a rounded ``log2``. This is the
rounding DeepGEMM's SM100 epilogue uses for the per-32 intermediate requantization and SGLang's ``scale_ue8m0`` path;
it differs from the OCP spec's example ``floor(log2(amax)) - emax`` (which may saturate the block's largest element).
The FP32 recipe (SGLang / DeepGEMM SM90 1x128 activations and 128x128 weight blocks) is instead
``scale = max(amax, AMAX_FLOOR) / 448`` in float32; there ``amax / scale`` may exceed 448 by one float32 rounding and
the saturating cast absorbs it. ``AMAX_FLOOR`` (1e-10, SGLang's ``eps``) keeps an all-zero group's scale finite and
nonzero.

Weight value checks
-------------------
:func:`check_weight_values` is the one home of the value rules of weights in every accepted form (no E4M3 NaN code,
finite positive FP32 block scales, no UE8M0 code 255), run once where weights enter (the native and facade transforms,
the facade's conversion); it reads in bounded slices and skips meta tensors and CUDA graph capture
(:func:`values_readable`).

Packing
-------
* FP4: two codes per byte, element ``2i`` in the **low** nibble (bits 3..0) and element ``2i + 1`` in the high nibble
  (bits 7..4). This is the order documented for ``torch.float4_e2m1fn_x2`` in
  ``torch/headeronly/util/Float4_e2m1fn_x2.h`` ("val1 : val0" = bits "7654 : 3210") and produced by torch's own
  ``torch.testing._internal.common_quantized.pack_uint4`` (the tests check agreement with it); DeepGEMM's packed FP4
  weights (stored as int8) use the same order. torch 2.13 has no float <-> ``float4_e2m1fn_x2`` cast, so the
  ``.view(torch.float4_e2m1fn_x2)`` of a packed uint8 tensor is the only interop point.
* UE8M0 K-major scale words: four consecutive K32 groups per int32, group ``4i + j`` in byte ``j`` of word ``i``
  (``j = 0`` least significant), i.e. the little-endian ``uint8 -> int32`` view DeepGEMM uses for ``x_sf``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from gc_moe_compat.config import integer

__all__ = [
    "AMAX_FLOOR",
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "dequantize_fp8_blocks",
    "dequantize_fp8_groups",
    "dequantize_mxfp4",
    "e2m1_decode",
    "e2m1_encode",
    "e4m3_decode",
    "e4m3_encode",
    "check_block_scale_values",
    "check_e4m3_values",
    "check_ue8m0_values",
    "check_weight_values",
    "pack_fp4",
    "pack_ue8m0_k32",
    "quantize_fp8_blocks",
    "quantize_fp8_groups",
    "quantize_fp8_pre_dispatch",
    "quantize_mxfp4",
    "to_e4m3",
    "ue8m0_decode",
    "ue8m0_encode",
    "ue8m0_scale",
    "unpack_fp4",
    "unpack_ue8m0_k32",
    "values_readable",
]

E4M3_MAX = 448.0
E2M1_MAX = 6.0
AMAX_FLOOR = 1e-10

E2M1_VALUES: Tensor = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
    device="cpu",
)

# Midpoints between neighbouring E2M1 magnitudes, split by where a tie goes: to the upper code when that code's
# mantissa bit is 0 (0.75 -> 1.0, 1.75 -> 2.0, 3.5 -> 4.0), to the lower code otherwise (0.25, 1.25, 2.5, 5.0).
_E2M1_TIES_UP = (0.75, 1.75, 3.5)
_E2M1_TIES_DOWN = (0.25, 1.25, 2.5, 5.0)

_UE8M0_MIN_EXP = -127
_UE8M0_MAX_EXP = 127
_FP32_NAN_BITS = 0x7FC00000
_SCALE_FORMATS = ("fp32", "ue8m0")


# ----------------------------------------------------------------------------------------------------------------------
# validation helpers


def _require_tensor(fn: str, name: str, x: object) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _require_float(fn: str, name: str, x: object) -> Tensor:
    x = _require_tensor(fn, name, x)
    if not x.is_floating_point():
        raise TypeError(f"{fn}: {name} must have a floating-point dtype, got {x.dtype}")
    return x


def _require_dtype(fn: str, name: str, x: object, *dtypes: torch.dtype) -> Tensor:
    x = _require_tensor(fn, name, x)
    if x.dtype not in dtypes:
        allowed = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{fn}: {name} must have dtype {allowed}, got {x.dtype}")
    return x


def _require_ndim(fn: str, name: str, x: Tensor, ndim: int) -> None:
    if x.dim() < ndim:
        raise ValueError(f"{fn}: {name} must have at least {ndim} dimension(s), got shape {tuple(x.shape)}")


def _can_inspect(x: Tensor) -> bool:
    """Whether checks that read values may run: not on a meta tensor (it has none), not under CUDA graph capture,
    where the device sync they need would break the capture (a serving engine captures the pre-dispatch
    quantization). Shape and dtype checks always run."""
    return not x.is_meta and not (x.is_cuda and torch.cuda.is_current_stream_capturing())


def values_readable(x: Tensor) -> bool:
    """Whether the weight value checks below read ``x``: not a meta tensor (no values), not empty, and not under CUDA
    graph capture (their device sync would break it). Where this is False only the shape and dtype rules apply."""
    return x.numel() > 0 and _can_inspect(x)


_CHECK_CHUNK_ELEMENTS = 1 << 26
"""Elements per slice of a weight value check: bounds its temporaries (a few bytes per element) for weights of many
GB, whose whole-tensor predicate would need as much again."""


def _count_bad(x: Tensor, bad: Callable[[Tensor], Tensor]) -> int:
    """Elements of ``x`` where ``bad`` holds, evaluated over slices of dim 0 of at most ``_CHECK_CHUNK_ELEMENTS``
    and summed on the device (one host sync in all)."""
    if x.dim() == 0:
        x = x.reshape(1)
    step = max(1, _CHECK_CHUNK_ELEMENTS // max(1, x[0].numel()))
    total = torch.zeros((), dtype=torch.int64, device=x.device)
    for i in range(0, x.shape[0], step):
        total += bad(x[i:i + step]).sum()
    return int(total)


def check_e4m3_values(fn: str, arg: str, payload: Tensor) -> None:
    """ValueError naming ``fn: arg`` when a ``float8_e4m3fn`` payload holds a NaN code (``0x7F`` / ``0xFF``).

    Why: E4M3 has no infinity, so a NaN code is never a weight; one poisons every output it reaches through the GEMM
    and the intermediate requantization's amax. Skipped where :func:`values_readable` is False."""
    payload = _require_dtype(fn, arg, payload, torch.float8_e4m3fn)
    if not values_readable(payload):
        return
    bad = _count_bad(payload, lambda c: (c.view(torch.uint8) & 0x7F) == 0x7F)
    if bad:
        raise ValueError(f"{fn}: {arg} must hold no E4M3 NaN codes (0x7f/0xff; a NaN weight poisons every output it "
                         f"reaches), found {bad}")


def check_ue8m0_values(fn: str, arg: str, sf: Tensor) -> None:
    """ValueError naming ``fn: arg`` when UE8M0 scales hold code 255 (NaN per the OCP MX spec): uint8 codes, or int32
    words of four packed codes (:func:`pack_ue8m0_k32`; any stride). Skipped where :func:`values_readable` is False."""
    sf = _require_dtype(fn, arg, sf, torch.uint8, torch.int32)
    if not values_readable(sf):
        return
    if sf.dtype == torch.uint8:
        bad = _count_bad(sf, lambda c: c == 255)
    else:
        bad = _count_bad(sf, lambda w: sum(((w >> s) & 0xFF) == 0xFF for s in (0, 8, 16, 24)))
    if bad:
        raise ValueError(f"{fn}: {arg} must hold no UE8M0 code 255 (NaN), found {bad}")


def check_block_scale_values(fn: str, arg: str, sf: Tensor) -> None:
    """ValueError naming ``fn: arg`` unless every FP32 block scale is finite and positive (what the FP8 recipes'
    ``max(amax, 1e-10) / 448`` produces). A zero, negative, NaN or infinite scale dequantizes its whole block to a
    wrong or non-finite value. Skipped where :func:`values_readable` is False."""
    sf = _require_dtype(fn, arg, sf, torch.float32)
    if not values_readable(sf):
        return
    bad = _count_bad(sf, lambda s: ~(torch.isfinite(s) & (s > 0)))
    if bad:
        first = sf[~(torch.isfinite(sf) & (sf > 0))].flatten()[0].item()
        raise ValueError(f"{fn}: {arg} must hold finite positive FP32 scales, found {bad} other value(s), "
                         f"e.g. {first}")


def check_weight_values(fn: str, arg: str, pair: tuple[Tensor, Tensor]) -> None:
    """The value rules of one ``(payload, scales)`` weight pair, by dtype: E4M3 payloads without NaN codes
    (:func:`check_e4m3_values`), FP32 block scales finite and positive (:func:`check_block_scale_values`), UE8M0
    scales (uint8 codes or packed int32) without code 255 (:func:`check_ue8m0_values`); packed FP4 payloads have no
    invalid code. Errors name ``arg[0]`` / ``arg[1]``. Run once where weights enter (the transforms, the facade's
    conversion), never per call: it reads every byte."""
    payload, sf = pair
    if payload.dtype == torch.float8_e4m3fn:
        check_e4m3_values(fn, f"{arg}[0]", payload)
    if sf.dtype == torch.float32:
        check_block_scale_values(fn, f"{arg}[1]", sf)
    elif sf.dtype in (torch.uint8, torch.int32):
        check_ue8m0_values(fn, f"{arg}[1]", sf)


def _require_finite(fn: str, name: str, x: Tensor) -> None:
    if not _can_inspect(x):
        return
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        first = x[bad].flatten()[0].item()
        raise ValueError(f"{fn}: {name} must be finite, found {int(bad.sum())} non-finite value(s), e.g. {first}")


def _require_code_range(fn: str, name: str, codes: Tensor, limit: int) -> None:
    if not _can_inspect(codes):
        return
    bad = codes > limit
    if bool(bad.any()):
        raise ValueError(f"{fn}: {name} must hold values in 0..{limit}, got {int(codes[bad].max())}")


def _pow2(k: Tensor) -> Tensor:
    """Exact float32 ``2**k`` for integer ``k`` in [-149, 127], built from the bit pattern (no transcendental)."""
    k = k.to(torch.int32)
    normal = (k + 127).clamp(min=1) << 23
    subnormal = torch.ones_like(k) << (k + 149).clamp(0, 22)
    return torch.where(k >= -126, normal, subnormal).view(torch.float32)


def _fp8_amax_scale(amax: Tensor) -> Tensor:
    """The FP32 recipe: ``max(amax, AMAX_FLOOR) / 448`` in float32, correctly rounded on every device.

    The divisor is a tensor on purpose: torch's CUDA division by a Python scalar multiplies by its rounded reciprocal,
    which differs from the true quotient in the last bit for some inputs (seen on H200) and would make CPU and GPU
    scales disagree. ``full_like`` (a device fill, no host copy) keeps it capturable in a CUDA graph.
    """
    return amax.clamp(min=AMAX_FLOOR) / torch.full_like(amax, E4M3_MAX)


# ----------------------------------------------------------------------------------------------------------------------
# E4M3


def to_e4m3(x: Tensor) -> Tensor:
    """Round ``x`` to ``float8_e4m3fn`` (nearest even), saturating to ±448; ±inf saturates, NaN stays NaN.

    torch's own cast is not saturating on every version (older releases give NaN above 464), so the value is
    clamped to ±448 in float32 first; clamping never changes a value that rounds inside the range.
    """
    x = _require_float("to_e4m3", "x", x)
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e4m3_encode(x: Tensor) -> Tensor:
    """The uint8 bit patterns of :func:`to_e4m3` ``(x)`` (what a kernel reading raw bytes sees)."""
    x = _require_float("e4m3_encode", "x", x)
    return to_e4m3(x).view(torch.uint8)


def e4m3_decode(bits: Tensor) -> Tensor:
    """Decode uint8 E4M3 bit patterns to float32 (exact; ``0x7F`` and ``0xFF`` decode to NaN)."""
    bits = _require_dtype("e4m3_decode", "bits", bits, torch.uint8)
    return bits.view(torch.float8_e4m3fn).float()


# ----------------------------------------------------------------------------------------------------------------------
# UE8M0


def ue8m0_scale(amax: Tensor, fmt_max: float) -> Tensor:
    """Smallest power-of-two scale with ``max(amax, AMAX_FLOOR) / scale <= fmt_max``, as float32.

    Equals ``2**ceil(log2(max(amax, AMAX_FLOOR) / fmt_max))`` evaluated exactly rather than through a rounded
    quotient and ``log2``: with ``a = ma * 2**ea`` and ``fmt_max = mf * 2**ef`` (``frexp``, mantissas in [0.5, 1)) the
    answer is ``2**(ea - ef)`` or ``2**(ea - ef + 1)``, and an exact comparison ``a <= fmt_max * 2**(ea - ef)`` picks
    one, so the block's maximum never saturates. ``amax`` must be finite and non-negative, ``fmt_max`` a positive
    normal float32 value, and the result must fit UE8M0 (2**-127 .. 2**127).
    """
    fn = "ue8m0_scale"
    amax = _require_float(fn, "amax", amax)
    if isinstance(fmt_max, bool) or not isinstance(fmt_max, int | float):
        raise TypeError(f"{fn}: fmt_max must be a float, got {type(fmt_max).__name__} ({fmt_max!r})")
    fmt32 = float(torch.tensor(float(fmt_max), dtype=torch.float32, device="cpu"))
    if not (torch.finfo(torch.float32).tiny <= fmt32 < float("inf")):
        raise ValueError(f"{fn}: fmt_max must be a positive, finite, normal float32 value, got {fmt_max}")
    _require_finite(fn, "amax", amax)
    if _can_inspect(amax) and bool((amax < 0).any()):
        raise ValueError(f"{fn}: amax must be non-negative, got {amax.min().item()}")

    a = amax.float().clamp(min=AMAX_FLOOR)
    ef = math.frexp(fmt32)[1]
    k = torch.frexp(a)[1].to(torch.int32) - ef  # ma / mf lies in (0.5, 2): ceil(log2) is k or k + 1
    fits = a <= fmt32 * _pow2(k.clamp(-149, 127))  # exact: a power-of-two product (an overflow to inf compares right)
    k = torch.where(fits, k, k + 1)
    if _can_inspect(k) and bool(((k < _UE8M0_MIN_EXP) | (k > _UE8M0_MAX_EXP)).any()):
        raise ValueError(
            f"{fn}: the scale for amax in [{a.min().item()}, {a.max().item()}] with fmt_max={fmt_max} needs 2**k "
            f"with k in [{int(k.min())}, {int(k.max())}], outside UE8M0's [{_UE8M0_MIN_EXP}, {_UE8M0_MAX_EXP}]"
        )
    return _pow2(k)


def ue8m0_encode(scale: Tensor) -> Tensor:
    """Encode power-of-two scales (2**-127 .. 2**127) as UE8M0 codes (uint8 biased exponent, 127 == 1.0).

    Raises ValueError if any element is not exactly a positive power of two in that range (a scale that is not a
    power of two cannot be represented, and silently truncating it would change the dequantized values).
    """
    fn = "ue8m0_encode"
    scale = _require_float(fn, "scale", scale)
    s = scale.float()
    bits = s.view(torch.int32)
    biased = (bits >> 23) & 0xFF
    normal = (bits >= 0) & (biased >= 1) & (biased <= 254) & ((bits & 0x7FFFFF) == 0)
    tiny = bits == 0x00400000  # 2**-127, the one in-range float32 subnormal
    ok = normal | tiny
    if _can_inspect(ok) and not bool(ok.all()):
        first = s[~ok].flatten()[0].item()
        raise ValueError(
            f"{fn}: scale must hold positive powers of two in [2**-127, 2**127], found {int((~ok).sum())} other "
            f"value(s), e.g. {first}"
        )
    return torch.where(tiny, torch.zeros_like(biased), biased).to(torch.uint8)


def ue8m0_decode(code: Tensor) -> Tensor:
    """Decode UE8M0 codes (uint8) to float32 ``2**(code - 127)``; code 255 is NaN per the OCP MX spec."""
    code = _require_dtype("ue8m0_decode", "code", code, torch.uint8)
    c = code.to(torch.int32)
    value = _pow2(c - 127).view(torch.int32)
    nan = torch.full_like(value, _FP32_NAN_BITS)
    return torch.where(c == 255, nan, value).view(torch.float32)


def pack_ue8m0_k32(codes: Tensor) -> Tensor:
    """Pack UE8M0 codes ``[..., G]`` (uint8, one per K32 group) into int32 words ``[..., G/4]``, K-major.

    Byte ``j`` (``j = 0`` least significant) of word ``i`` holds group ``4i + j``: DeepGEMM's ``x_sf`` layout, the
    same bytes as a little-endian ``codes.view(torch.int32)``, built arithmetically so any stride or host works.
    """
    fn = "pack_ue8m0_k32"
    codes = _require_dtype(fn, "codes", codes, torch.uint8)
    _require_ndim(fn, "codes", codes, 1)
    g = codes.shape[-1]
    if g % 4 != 0:
        raise ValueError(f"{fn}: codes.shape[-1] (number of K32 groups) must be a multiple of 4, got {g}")
    c = codes.reshape(*codes.shape[:-1], g // 4, 4).to(torch.int64)
    shifts = torch.arange(0, 32, 8, dtype=torch.int64, device=codes.device)
    word = (c << shifts).sum(dim=-1)
    word = torch.where(word >= 2**31, word - 2**32, word)
    return word.to(torch.int32)


def unpack_ue8m0_k32(packed: Tensor) -> Tensor:
    """Inverse of :func:`pack_ue8m0_k32`: int32 words ``[..., W]`` to uint8 codes ``[..., 4W]``."""
    fn = "unpack_ue8m0_k32"
    packed = _require_dtype(fn, "packed", packed, torch.int32)
    _require_ndim(fn, "packed", packed, 1)
    p = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 8, dtype=torch.int64, device=packed.device)
    b = (p.unsqueeze(-1) >> shifts) & 0xFF
    return b.reshape(*packed.shape[:-1], packed.shape[-1] * 4).to(torch.uint8)


# ----------------------------------------------------------------------------------------------------------------------
# FP8 groups and blocks


def quantize_fp8_groups(x: Tensor, group_size: int, scale_format: str = "fp32") -> tuple[Tensor, Tensor]:
    """Quantize ``x [..., K]`` to E4M3 with one scale per ``group_size`` consecutive values along the last dim.

    Used per token group for activations (1x128 on SM90, per-32 UE8M0 for the SM100 intermediate) and per weight
    row with K32 groups. ``scale_format="fp32"``: ``scale = max(amax, AMAX_FLOOR) / 448`` (SGLang / DeepGEMM SM90);
    ``"ue8m0"``: ``scale = ue8m0_scale(amax, 448)`` (a power of two, DeepGEMM SM100). Payload =
    ``to_e4m3(x / scale)`` (division, saturating). ``x`` must be finite.

    Returns ``(q float8_e4m3fn [..., K], scales float32 [..., K / group_size])``.
    """
    fn = "quantize_fp8_groups"
    x = _require_float(fn, "x", x)
    group_size = integer(fn, "group_size", group_size, 1)
    if scale_format not in _SCALE_FORMATS:
        raise ValueError(f"{fn}: scale_format must be one of {_SCALE_FORMATS}, got {scale_format!r}")
    _require_ndim(fn, "x", x, 1)
    k = x.shape[-1]
    if k % group_size != 0:
        raise ValueError(f"{fn}: x.shape[-1] (K={k}) must be a multiple of group_size={group_size}")
    _require_finite(fn, "x", x)

    xg = x.float().reshape(*x.shape[:-1], k // group_size, group_size)
    amax = xg.abs().amax(dim=-1)
    scale = _fp8_amax_scale(amax) if scale_format == "fp32" else ue8m0_scale(amax, E4M3_MAX)
    q = to_e4m3(xg / scale.unsqueeze(-1)).reshape(x.shape)
    return q, scale


PRE_DISPATCH_RECIPES = {"fp32x128": (128, 1e-10), "ue8m0x32": (32, 1e-4)}
"""The originals' pre-dispatch recipes: (group size, amax floor)."""


def quantize_fp8_pre_dispatch(x: Tensor, recipe: str) -> tuple[Tensor, Tensor]:
    """The originals' fused pre-dispatch quantization of BF16 rows ``x [T, K]``, operation for operation
    (sgl-deep-gemm's ``sm90_mega_moe_pre_dispatch.cuh`` / ``sm100_mega_moe_pre_dispatch.cuh``;
    ``kernels/sm90/predispatch.cu`` runs it):

    * ``"fp32x128"``: per 128 values ``s = max(amax, 1e-10) / 448`` and ``q = e4m3_sat(x * (1 / s))``: a reciprocal
      multiply, which differs from :func:`quantize_fp8_groups`'s ``x / s`` in the last bit of some products.
      Returns ``(q, s float32 [T, K/128])``.
    * ``"ue8m0x32"``: per 32 values ``e`` = the UE8M0 byte of the smallest power of two at least the rounded FP32
      quotient ``max(amax, 1e-4) / 448`` (clamped to [1, 254]) and ``q = e4m3_sat(x * 2**(127 - e))``. Returns
      ``(q, e uint8 [T, K/32])``.

    Every operation is an IEEE FP32 operation between tensors, so CPU and GPU results are bit-identical.
    """
    fn = "quantize_fp8_pre_dispatch"
    x = _require_dtype(fn, "x", x, torch.bfloat16)
    _require_ndim(fn, "x", x, 2)
    if recipe not in PRE_DISPATCH_RECIPES:
        raise ValueError(f"{fn}: recipe must be one of {tuple(PRE_DISPATCH_RECIPES)}, got {recipe!r}")
    group, floor = PRE_DISPATCH_RECIPES[recipe]
    t, k = x.shape
    if k % group:
        raise ValueError(f"{fn}: x.shape[-1] (K={k}) must be a multiple of {group}")
    xg = x.float().reshape(t, k // group, group)
    amax = xg.abs().amax(dim=-1).clamp(min=floor)
    quotient = amax / torch.full_like(amax, E4M3_MAX)
    if recipe == "fp32x128":
        inv = torch.full_like(quotient, 1.0) / quotient
        return to_e4m3(xg * inv.unsqueeze(-1)).reshape(t, k), quotient
    bits = quotient.view(torch.int32)
    code = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    code = code.clamp(1, 254)
    inv = ((254 - code) << 23).view(torch.float32)
    return to_e4m3(xg * inv.unsqueeze(-1)).reshape(t, k), code.to(torch.uint8)


def dequantize_fp8_groups(q: Tensor, scales: Tensor) -> Tensor:
    """Dequantize E4M3 ``q [..., K]`` with per-group ``scales [..., G]`` to float32 (group size ``K / G``)."""
    fn = "dequantize_fp8_groups"
    q = _require_dtype(fn, "q", q, torch.float8_e4m3fn)
    scales = _require_float(fn, "scales", scales)
    _require_ndim(fn, "q", q, 1)
    _require_ndim(fn, "scales", scales, 1)
    if q.shape[:-1] != scales.shape[:-1]:
        raise ValueError(
            f"{fn}: scales must share q's leading dims, got q {tuple(q.shape)} and scales {tuple(scales.shape)}"
        )
    k, g = q.shape[-1], scales.shape[-1]
    if g == 0 or k % g != 0:
        raise ValueError(f"{fn}: q.shape[-1] (K={k}) must be a positive multiple of scales.shape[-1] (G={g})")
    qg = q.float().reshape(*q.shape[:-1], g, k // g)
    return (qg * scales.float().unsqueeze(-1)).reshape(q.shape)


def _block_grid(shape: torch.Size, block: int) -> tuple[int, int, int, int]:
    n, k = shape[-2], shape[-1]
    return n, k, -(-n // block), -(-k // block)


def quantize_fp8_blocks(w: Tensor, block: int = 128) -> tuple[Tensor, Tensor]:
    """Quantize weights ``w [..., N, K]`` to E4M3 with one FP32 scale per ``block x block`` tile.

    ``scale = max(amax, AMAX_FLOOR) / 448`` over each tile (the 128x128 block recipe of DeepSeek-V3 style FP8
    checkpoints and DeepGEMM SM90); edge tiles may be partial. ``w`` must be finite.

    Returns ``(q float8_e4m3fn [..., N, K], scales float32 [..., ceil(N/block), ceil(K/block)])``.
    """
    fn = "quantize_fp8_blocks"
    w = _require_float(fn, "w", w)
    block = integer(fn, "block", block, 1)
    _require_ndim(fn, "w", w, 2)
    _require_finite(fn, "w", w)
    n, k, nb, kb = _block_grid(w.shape, block)
    lead = w.shape[:-2]
    wp = torch.nn.functional.pad(w.float(), (0, kb * block - k, 0, nb * block - n))  # zeros never raise an amax
    tiles = wp.reshape(*lead, nb, block, kb, block)
    amax = tiles.abs().amax(dim=(-3, -1))
    scale = _fp8_amax_scale(amax)
    q = to_e4m3(tiles / scale[..., :, None, :, None]).reshape(*lead, nb * block, kb * block)
    return q[..., :n, :k].contiguous(), scale


def dequantize_fp8_blocks(q: Tensor, scales: Tensor, block: int = 128) -> Tensor:
    """Dequantize block-scaled E4M3 weights ``q [..., N, K]`` with ``scales [..., ceil(N/block), ceil(K/block)]``."""
    fn = "dequantize_fp8_blocks"
    q = _require_dtype(fn, "q", q, torch.float8_e4m3fn)
    scales = _require_float(fn, "scales", scales)
    block = integer(fn, "block", block, 1)
    _require_ndim(fn, "q", q, 2)
    n, k, nb, kb = _block_grid(q.shape, block)
    expected = (*q.shape[:-2], nb, kb)
    if tuple(scales.shape) != expected:
        raise ValueError(
            f"{fn}: scales must have shape {expected} for q {tuple(q.shape)} and block={block}, "
            f"got {tuple(scales.shape)}"
        )
    s = scales.float().repeat_interleave(block, dim=-2)[..., :n, :]
    s = s.repeat_interleave(block, dim=-1)[..., :k]
    return q.float() * s


# ----------------------------------------------------------------------------------------------------------------------
# E2M1 / MXFP4


def e2m1_encode(x: Tensor) -> Tensor:
    """Round ``x`` to the nearest E2M1 value and return its code (uint8, 0..15).

    Ties go to the code with mantissa bit 0 (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4,
    5 -> 4); |x| > 6 (including inf) saturates to 6. The sign bit is copied from ``x``, so -0.0 and negatives that
    round to zero give code 8 (-0). NaN has no E2M1 encoding: ValueError.
    """
    fn = "e2m1_encode"
    x = _require_float(fn, "x", x)
    if bool(torch.isnan(x).any()):
        raise ValueError(f"{fn}: x must not contain NaN (E2M1 has no NaN), found {int(torch.isnan(x).sum())}")
    xf = x.float()
    a = xf.abs().clamp(max=E2M1_MAX)
    up = torch.tensor(_E2M1_TIES_UP, dtype=torch.float32, device=x.device)
    down = torch.tensor(_E2M1_TIES_DOWN, dtype=torch.float32, device=x.device)
    # magnitude code = number of midpoints passed; a tie passes an "up" midpoint but not a "down" one
    mag = torch.bucketize(a, up, right=True) + torch.bucketize(a, down, right=False)
    sign = torch.signbit(xf).to(mag.dtype) << 3
    return (mag | sign).to(torch.uint8)


def e2m1_decode(codes: Tensor) -> Tensor:
    """Decode E2M1 codes (uint8, 0..15) to float32 via :data:`E2M1_VALUES`."""
    fn = "e2m1_decode"
    codes = _require_dtype(fn, "codes", codes, torch.uint8)
    _require_code_range(fn, "codes", codes, 15)
    return E2M1_VALUES.to(codes.device)[codes.long()]


def pack_fp4(codes: Tensor) -> Tensor:
    """Pack E2M1 codes ``[..., K]`` (uint8 0..15, K even) two per byte: element ``2i`` low nibble, ``2i+1`` high.

    The order of ``torch.float4_e2m1fn_x2`` (bits 7654 : 3210 = val1 : val0) and of DeepGEMM's packed FP4 weights;
    the result may be ``.view(torch.float4_e2m1fn_x2)`` or ``.view(torch.int8)`` as a consumer needs.
    """
    fn = "pack_fp4"
    codes = _require_dtype(fn, "codes", codes, torch.uint8)
    _require_ndim(fn, "codes", codes, 1)
    k = codes.shape[-1]
    if k % 2 != 0:
        raise ValueError(f"{fn}: codes.shape[-1] (K={k}) must be even")
    _require_code_range(fn, "codes", codes, 15)
    pairs = codes.reshape(*codes.shape[:-1], k // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_fp4(packed: Tensor) -> Tensor:
    """Inverse of :func:`pack_fp4`: uint8 or int8 (DeepGEMM's storage dtype) ``[..., W]`` to codes ``[..., 2W]``."""
    fn = "unpack_fp4"
    packed = _require_dtype(fn, "packed", packed, torch.uint8, torch.int8)
    _require_ndim(fn, "packed", packed, 1)
    p = packed.view(torch.uint8)
    return torch.stack((p & 0xF, p >> 4), dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


def quantize_mxfp4(w: Tensor, block: int = 32) -> tuple[Tensor, Tensor]:
    """Quantize ``w [..., K]`` to MXFP4: E2M1 values with one UE8M0 scale per ``block`` values along K.

    ``scale = ue8m0_scale(amax, 6.0)`` (see the module docstring for the ceil rounding), codes =
    ``e2m1_encode(w / scale)`` (exact division by a power of two). ``w`` must be finite and K even.

    Returns ``(packed uint8 [..., K/2], scale codes uint8 [..., K/block])``.
    """
    fn = "quantize_mxfp4"
    w = _require_float(fn, "w", w)
    block = integer(fn, "block", block, 1)
    _require_ndim(fn, "w", w, 1)
    k = w.shape[-1]
    if k % block != 0 or k % 2 != 0:
        raise ValueError(f"{fn}: w.shape[-1] (K={k}) must be even and a multiple of block={block}")
    _require_finite(fn, "w", w)
    wg = w.float().reshape(*w.shape[:-1], k // block, block)
    scale = ue8m0_scale(wg.abs().amax(dim=-1), E2M1_MAX)
    codes = e2m1_encode(wg / scale.unsqueeze(-1)).reshape(w.shape)
    return pack_fp4(codes), ue8m0_encode(scale)


def dequantize_mxfp4(packed: Tensor, scale_codes: Tensor) -> Tensor:
    """Dequantize MXFP4 ``packed [..., K/2]`` (uint8/int8) with UE8M0 ``scale_codes [..., G]`` to float32 ``[..., K]``.

    The block size is ``K / G``.
    """
    fn = "dequantize_mxfp4"
    packed = _require_dtype(fn, "packed", packed, torch.uint8, torch.int8)
    scale_codes = _require_dtype(fn, "scale_codes", scale_codes, torch.uint8)
    _require_ndim(fn, "packed", packed, 1)
    _require_ndim(fn, "scale_codes", scale_codes, 1)
    if packed.shape[:-1] != scale_codes.shape[:-1]:
        raise ValueError(
            f"{fn}: scale_codes must share packed's leading dims, got packed {tuple(packed.shape)} and "
            f"scale_codes {tuple(scale_codes.shape)}"
        )
    k, g = packed.shape[-1] * 2, scale_codes.shape[-1]
    if g == 0 or k % g != 0:
        raise ValueError(
            f"{fn}: K = 2 * packed.shape[-1] = {k} must be a positive multiple of scale_codes.shape[-1] (G={g})"
        )
    vals = e2m1_decode(unpack_fp4(packed)).reshape(*packed.shape[:-1], g, k // g)
    return (vals * ue8m0_decode(scale_codes).unsqueeze(-1)).reshape(*packed.shape[:-1], k)
