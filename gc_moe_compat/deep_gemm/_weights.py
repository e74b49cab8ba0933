"""Weight and scale-factor transforms of the Mega MoE surface (host side, once per weight set).

* :func:`transform_weights_for_mega_moe` returns the originals' layout exactly (DeepGEMM 2.8.2 and SGLang's pin
  ``sgl-deep-gemm`` alike, on every architecture): L1 payload and scale rows interleaved gate/up by 8
  (:func:`gc_moe_compat.layouts.interleave_gate_up`), then the L1 and L2 int32 scale tensors transposed for UTCCP
  (:func:`gc_moe_compat.layouts.utccp_permute_scales`, the originals' ``sf.reshape(G, mn/128, 4, 32, k')
  .transpose(2, 3)``), each result allocated like its input (``torch.empty_like``: same strides), the L2 payload
  returned as it is. SGLang's SM100 loader builds the same layout without calling it, so this layout, and only it,
  is what ``fp8_fp4_mega_moe`` reads (:func:`gc_moe_compat.deep_gemm._seam.operator_weights` undoes it once per
  weight tensor for the SM90 kernels). The earlier interleave-only form has the same shapes and dtypes: passed to
  ``fp8_fp4_mega_moe`` it would be read as UTCCP-ordered, so re-run the transform on canonical weights.
* :func:`transform_weights_for_mega_moe_sm90` is the pin's SM90 transform (FP8 L1 rows interleaved, block scales and
  L2 unchanged), the form ``fp8_mega_moe`` reads.
* :func:`transform_sf_into_required_layout` turns FP32 scale factors into the scale forms these read.

Every input is checked first (dtype, shape, agreement of the pairs, values: see
:func:`gc_moe_compat.quant.check_weight_values`; value checks are skipped on meta tensors).
"""

from __future__ import annotations

import torch

from gc_moe_compat import config, layouts, quant
from gc_moe_compat.compute_paths import FP8XFP8, compute_path
from gc_moe_compat.deep_gemm import _checks
from gc_moe_compat.operator import weights

__all__ = ["transform_scales_for_mega_moe", "transform_sf_into_required_layout", "transform_weights_for_mega_moe",
           "transform_weights_for_mega_moe_sm90"]

_Pair = tuple[torch.Tensor, torch.Tensor]
_FP4 = (torch.int8, torch.uint8)
_FP8 = torch.float8_e4m3fn
_PACKED_SF = ("int32 words of 4 packed UE8M0 K32 scales, what transform_sf_into_required_layout(recipe=(1, 32)) "
              "returns (the originals transpose only int32 scales)")


def _pair(fn: str, arg: str, value: object) -> _Pair:
    if not (isinstance(value, tuple | list) and len(value) == 2
            and all(isinstance(t, torch.Tensor) for t in value)):
        raise TypeError(f"{fn}: {arg} must be a (weights, scale factors) pair of tensors, got {type(value).__name__}")
    return value[0], value[1]


def _like(t: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` in a tensor allocated like ``t`` (the originals' ``torch.empty_like(t).copy_(...)``: same strides)."""
    return torch.empty_like(t).copy_(value)


def _grouped(fn: object, t: torch.Tensor) -> torch.Tensor:
    """``fn`` of ``[E, N, K']``, applied to one expert's ``[N, K']`` as ``[1, N, K']`` (the originals accept both)."""
    return fn(t) if t.dim() == 3 else fn(t.unsqueeze(0)).squeeze(0)


def _check_mega_moe_pairs(fn: str, mma_type: str, l1: _Pair, l2: _Pair) -> None:
    """The layout rules of :func:`transform_weights_for_mega_moe`'s inputs: dtypes, ranks, the agreement of payload
    and scales (expert count, rows, K'), of L1 and L2 (``[E, 2I, H]`` and ``[E, H, I]``), UTCCP's 128-row groups,
    one device; then the values."""
    pairs = {"l1_weights": l1, "l2_weights": l2}
    payload_dtypes = (*_FP4, _FP8) if compute_path(mma_type).fp4 else (_FP8,)
    kinds = set()
    for arg, (payload, sf) in pairs.items():
        if payload.dtype not in payload_dtypes:
            raise TypeError(f"{fn}: {arg}[0] must have dtype in {[str(d) for d in payload_dtypes]} for "
                            f"mma_type={mma_type!r} (packed E2M1, or E4M3 as for shared experts), got {payload.dtype}")
        if sf.dtype != torch.int32:
            raise TypeError(f"{fn}: {arg}[1] must be {_PACKED_SF}, got {sf.dtype}")
        if payload.dim() not in (2, 3) or sf.dim() != payload.dim() or payload.dim() != l1[0].dim():
            raise ValueError(f"{fn}: {arg} must be ([E,] N, K') tensors, all four of one rank, got "
                             f"{tuple(payload.shape)} and {tuple(sf.shape)} (l1_weights[0] {tuple(l1[0].shape)})")
        if payload.shape[:-1] != sf.shape[:-1]:
            raise ValueError(f"{fn}: {arg}[1] must have the payload's experts and rows {tuple(payload.shape[:-1])} "
                             f"(per-row scales), got {tuple(sf.shape)}")
        k = payload.shape[-1] * (2 if payload.dtype in _FP4 else 1)
        if k % 128 or sf.shape[-1] != k // 128:
            raise ValueError(f"{fn}: {arg}[1] must have K/128 = {k // 128} words for K = {k} (K % 128 == 0: 4 K32 "
                             f"scales per int32), got shape {tuple(sf.shape)} for payload {tuple(payload.shape)}")
        if payload.shape[-2] % layouts.UTCCP_ROWS:
            raise ValueError(f"{fn}: {arg} must have N % {layouts.UTCCP_ROWS} == 0 rows (the UTCCP scale transpose "
                             f"works on 128-row groups), got N = {payload.shape[-2]}")
        if payload.device != l1[0].device or sf.device != l1[0].device:
            raise ValueError(f"{fn}: {arg} must be on l1_weights[0]'s device {l1[0].device}, got {payload.device} "
                             f"and {sf.device}")
        kinds.add(payload.dtype == _FP8)
    if len(kinds) > 1:
        raise TypeError(f"{fn}: l2_weights[0] must be of l1_weights[0]'s kind ({l1[0].dtype}), got {l2[0].dtype}")
    (w1, _), (w2, _) = l1, l2
    per_byte = 2 if w1.dtype in _FP4 else 1
    h, two_i = w1.shape[-1] * per_byte, w1.shape[-2]
    want = (*w1.shape[:-2], h, two_i // 2 // per_byte)
    if tuple(w2.shape) != want:
        raise ValueError(f"{fn}: l2_weights[0] must be {list(want)} ([E,] H, I{'/2' if per_byte == 2 else ''}) for "
                         f"l1_weights[0] {list(w1.shape)} ([E,] 2I, H{'/2' if per_byte == 2 else ''}), "
                         f"got {list(w2.shape)}")
    for arg, pair in pairs.items():
        quant.check_weight_values(fn, arg, pair)


def transform_weights_for_mega_moe(
    l1_weights: torch.Tensor | _Pair,
    l2_weights: torch.Tensor | _Pair,
    activation: str = 'swiglu',
    mma_type: str = 'fp8xfp4'
) -> tuple[torch.Tensor | _Pair, torch.Tensor | _Pair]:
    """The originals' Mega MoE weight layout (module docstring): ``((interleaved L1 payload, UTCCP(interleaved L1
    scales)), (L2 payload, UTCCP(L2 scales)))``.

    ``l1_weights`` / ``l2_weights``: ``(payload, scales)`` pairs ``([E,] 2I, K')`` and ``([E,] H, K')``: packed FP4
    (int8/uint8, the routed MXFP4 weights) or E4M3 (shared-expert weights, which SGLang and DeepGEMM's test pass with
    the default ``mma_type``; with ``mma_type='fp8xfp8'`` E4M3 only), scales int32 ``[..., K/128]`` (packed UE8M0
    K32, as the originals require). BF16 weights (a bare tensor), other activations and the FP4-activation MMA kinds
    raise NotImplementedError.
    """
    fn = "transform_weights_for_mega_moe"
    _checks.choice(fn, "activation", activation, _checks.SUPPORTED_ACTIVATIONS, _checks.DEEPGEMM_ONLY_ACTIVATIONS)
    _checks.choice(fn, "mma_type", mma_type, _checks.SUPPORTED_MMA_TYPES, _checks.DEEPGEMM_ONLY_MMA_TYPES)
    if isinstance(l1_weights, torch.Tensor):
        raise NotImplementedError(f"{fn}: l1_weights is a bare (BF16) tensor: GC-MoE has no BF16 Mega MoE path")
    l1, l2 = _pair(fn, "l1_weights", l1_weights), _pair(fn, "l2_weights", l2_weights)
    _check_mega_moe_pairs(fn, mma_type, l1, l2)

    def utccp(sf: torch.Tensor) -> torch.Tensor:
        return _grouped(layouts.utccp_permute_scales, sf)

    def interleave(t: torch.Tensor) -> torch.Tensor:
        return _grouped(layouts.interleave_gate_up, t)

    return ((_like(l1[0], interleave(l1[0])), _like(l1[1], utccp(interleave(l1[1])))),
            (l2[0], _like(l2[1], utccp(l2[1]))))


def transform_weights_for_mega_moe_sm90(
    l1_weights: _Pair,
    l2_weights: _Pair
) -> tuple[_Pair, _Pair]:
    """SGLang pin's SM90 transform: the FP8 L1 payload interleaved gate/up by 8, block scales and L2 unchanged.

    The inputs are the operator's FP8xFP8 form (:func:`gc_moe_compat.config.validate`: E4M3 ``[E, 2I, H]`` /
    ``[E, H, I]`` with FP32 ``[E, N/128, K/128]`` block scales, contiguous) with valid values. The 128x128 block
    scales stay in the natural ``[E, 2I/128, H/128]`` (gate then up) layout; the operator looks a row's scale up by
    its source row (:func:`gc_moe_compat.layouts.gate_up_source_rows`), as the pin does.
    """
    fn = "transform_weights_for_mega_moe_sm90"
    l1, l2 = _pair(fn, "l1_weights", l1_weights), _pair(fn, "l2_weights", l2_weights)
    try:  # the shape l1_weights[0] gives, named as the caller passed it (2I rows, not the intermediate I)
        shape = weights.weights_shape(l1, FP8XFP8.name)
        config.validate(shape, l1_weights=l1, l2_weights=l2)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{fn}: {exc}") from exc
    for arg, pair in (("l1_weights", l1), ("l2_weights", l2)):
        quant.check_weight_values(fn, arg, pair)
    return (layouts.interleave_gate_up(l1[0]), l1[1]), l2


def transform_scales_for_mega_moe(l1_scales: torch.Tensor, l2_scales: torch.Tensor):
    """NVFP4 scale conversion of SGLang's pin: GC-MoE has no NVFP4 path."""
    raise NotImplementedError("transform_scales_for_mega_moe: converts NVFP4 scales; GC-MoE has no NVFP4 path "
                              "(mma_type='nvfp4xnvfp4' is not supported)")


def _recipe(fn: str, recipe: object, is_sfa: bool | None) -> tuple[int, int]:
    """(gran_mn, gran_k) from a 2-tuple recipe, or a 3-tuple plus ``is_sfa`` (DeepGEMM's rule)."""
    _checks.boolean(fn, "is_sfa", is_sfa, none_ok=True)
    if not isinstance(recipe, tuple | list):
        raise TypeError(f"{fn}: recipe must be a 2- or 3-tuple, got {type(recipe).__name__} ({recipe!r})")
    if len(recipe) not in (2, 3):
        raise ValueError(f"{fn}: recipe must be a 2- or 3-tuple, got {recipe!r}")
    if len(recipe) == 3:
        if is_sfa is None:
            raise ValueError(f"{fn}: is_sfa must be given with a 3-tuple recipe {tuple(recipe)}")
        grans = (recipe[0] if is_sfa else recipe[1]), recipe[2]
    else:
        if is_sfa is not None:
            raise ValueError(f"{fn}: is_sfa must be None with a 2-tuple recipe {tuple(recipe)}")
        grans = recipe[0], recipe[1]
    for name, gran in zip(("gran_mn", "gran_k"), grans, strict=True):  # (0, 128) would divide by zero
        _checks.integer(fn, f"recipe's {name}", gran, 1)
    return grans


def transform_sf_into_required_layout(sf, mn, k, recipe, num_groups=None, is_sfa=None, disable_ue8m0_cast=False,
                                      psum_layout=None):
    """FP32 scale factors of the Mega MoE recipes into the form GC-MoE's operator reads.

    * ``gran_k == 32`` (recipes ``(1, 32)``, ``(128, 32)``, SGLang's MXFP4 / K32 path): rows broadcast to
      per-row (``gran_mn`` rows share a scale), each scale encoded UE8M0 (it must be an exact power of two) and
      four K32 codes packed per int32 -> int32 ``[G, mn, ceil(k/32)/4]``, K-major contiguous. The shape and bytes
      per row are DeepGEMM's SM100 result; the strides are row-major (the operator reads packed row-major scales).
    * ``gran_k == 128`` with ``gran_mn`` in (1, 128) (the SM90 FP8 recipes): returned as a contiguous copy.

    ``num_groups`` given: ``sf`` is ``[G, ceil(mn/gran_mn), ceil(k/gran_k)]``; else 2-D. Its values must be finite
    and positive (:func:`gc_moe_compat.quant.check_block_scale_values`; skipped on meta tensors). ``psum_layout`` and
    ``disable_ue8m0_cast=True`` with K32 raise NotImplementedError.
    """
    fn = "transform_sf_into_required_layout"
    gran_mn, gran_k = _recipe(fn, recipe, is_sfa)
    _checks.boolean(fn, "disable_ue8m0_cast", disable_ue8m0_cast)  # every recipe's flag, read below for K32 only
    _checks.unsupported_feature(fn, "psum_layout", psum_layout, None, "PSUM (contiguous grouped) layout")
    _checks.integer(fn, "mn", mn, 1)
    _checks.integer(fn, "k", k, 1)
    ndim = 2 if num_groups is None else 3
    sf = _checks.tensor(fn, "sf", sf, (torch.float32,), ndim)
    expected = (-(-mn // gran_mn), -(-k // gran_k))
    if num_groups is not None:
        expected = (_checks.integer(fn, "num_groups", num_groups, 1), *expected)
    if tuple(sf.shape) != expected:
        raise ValueError(f"{fn}: sf must have shape {expected} for mn={mn}, k={k}, recipe={tuple(recipe)}, "
                         f"got {tuple(sf.shape)}")
    quant.check_block_scale_values(fn, "sf", sf)
    if gran_k == 128 and gran_mn in (1, 128):
        return sf.contiguous()
    if gran_k != 32:
        raise NotImplementedError(f"{fn}: recipe={tuple(recipe)} (gran_mn={gran_mn}, gran_k={gran_k}) is not a "
                                  "Mega MoE recipe GC-MoE supports (gran_k 32, or gran_k 128 with gran_mn 1/128)")
    _checks.unsupported_feature(fn, "disable_ue8m0_cast", disable_ue8m0_cast, False,
                                "FP32 K32 scale path (K32 scales are UE8M0)")
    rows = sf if gran_mn == 1 else sf.repeat_interleave(gran_mn, dim=-2)[..., :mn, :]
    try:
        codes = quant.ue8m0_encode(rows)
    except ValueError as exc:
        raise ValueError(f"{fn}: sf must hold exact powers of two for a K32 recipe (UE8M0 scales): {exc}") from exc
    pad = -codes.shape[-1] % 4
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad), value=127)  # 1.0 for the K32 groups beyond k
    return quant.pack_ue8m0_k32(codes).contiguous()
