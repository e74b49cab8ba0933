"""Weight and scale-factor transforms of the Mega MoE surface (host side, once per weight set).

GC-MoE's SM90 operator reads the L1 weight with gate/up rows interleaved in runs of 8 (``[g0..g7, u0..u7, g8..]``,
:func:`gc_moe_compat.layouts.interleave_gate_up`), so the SwiGLU epilogue finds a gate row and its up row in one
tile. Everything else is left in the canonical row-major form the operator's host check
(:func:`gc_moe_compat.config.validate`) accepts; SM100-only rearrangements (the UTCCP scale transpose, DeepGEMM's
MN-major TMA-aligned scale tensors) have no meaning for the SM90 kernels and are not applied.
"""

from __future__ import annotations

import torch

from gc_moe_compat import layouts, quant
from gc_moe_compat.deep_gemm import _checks

__all__ = ["transform_scales_for_mega_moe", "transform_sf_into_required_layout", "transform_weights_for_mega_moe",
           "transform_weights_for_mega_moe_sm90"]

_Pair = tuple[torch.Tensor, torch.Tensor]


def _pair(fn: str, arg: str, value: object) -> _Pair:
    if not (isinstance(value, tuple | list) and len(value) == 2
            and all(isinstance(t, torch.Tensor) for t in value)):
        raise TypeError(f"{fn}: {arg} must be a (weights, scale factors) pair of tensors, got {type(value).__name__}")
    return value[0], value[1]


def _interleave(fn: str, arg: str, t: torch.Tensor) -> torch.Tensor:
    """Gate/up interleave of ``[E, 2I, ...]`` or a single expert's ``[2I, ...]`` (DeepGEMM accepts both)."""
    if t.dim() not in (2, 3):
        raise ValueError(f"{fn}: {arg} must be [2I, K'] or [E, 2I, K'], got shape {tuple(t.shape)}")
    if t.dim() == 2:
        return layouts.interleave_gate_up(t.unsqueeze(0)).squeeze(0)
    return layouts.interleave_gate_up(t)


def transform_weights_for_mega_moe(
    l1_weights: torch.Tensor | _Pair,
    l2_weights: torch.Tensor | _Pair,
    activation: str = 'swiglu',
    mma_type: str = 'fp8xfp4'
) -> tuple[torch.Tensor | _Pair, torch.Tensor | _Pair]:
    """L1 weights and their per-row scale factors interleaved gate/up by 8; L2 returned unchanged.

    ``l1_weights``: ``(payload [E, 2I, K'], scales [E, 2I, K''])`` (or one expert without ``E``) with per-row
    scales (FP4 or FP8 payload, UE8M0 or packed-UE8M0 K32 scales). BF16 weights (a bare tensor) and the
    FP4-activation MMA kinds raise NotImplementedError; 128-row block scales have no exact interleave (use
    ``transform_weights_for_mega_moe_sm90``).
    """
    fn = "transform_weights_for_mega_moe"
    _checks.choice(fn, "activation", activation, _checks.SUPPORTED_ACTIVATIONS, _checks.DEEPGEMM_ONLY_ACTIVATIONS)
    _checks.choice(fn, "mma_type", mma_type, _checks.SUPPORTED_MMA_TYPES, _checks.DEEPGEMM_ONLY_MMA_TYPES)
    if isinstance(l1_weights, torch.Tensor):
        raise NotImplementedError(f"{fn}: l1_weights is a bare (BF16) tensor: GC-MoE has no BF16 Mega MoE path")
    l1_w, l1_sf = _pair(fn, "l1_weights", l1_weights)
    l2 = _pair(fn, "l2_weights", l2_weights)
    if l1_sf.dim() != l1_w.dim() or l1_sf.shape[:-1] != l1_w.shape[:-1]:
        raise ValueError(f"{fn}: l1_weights scales must be per-row ([E,] 2I, K/gran) matching the payload's "
                         f"{tuple(l1_w.shape[:-1])}, got {tuple(l1_sf.shape)}")
    return (_interleave(fn, "l1_weights[0]", l1_w), _interleave(fn, "l1_weights[1]", l1_sf)), l2


def transform_weights_for_mega_moe_sm90(
    l1_weights: _Pair,
    l2_weights: _Pair
) -> tuple[_Pair, _Pair]:
    """SGLang pin's SM90 transform: the FP8 L1 payload interleaved gate/up by 8, block scales and L2 unchanged.

    The 128x128 block scales stay in the natural ``[E, 2I/128, H/128]`` (gate then up) layout; the operator looks
    a row's scale up by its source row (:func:`gc_moe_compat.layouts.gate_up_source_rows`), as the pin does.
    """
    fn = "transform_weights_for_mega_moe_sm90"
    l1_w, l1_sf = _pair(fn, "l1_weights", l1_weights)
    l2 = _pair(fn, "l2_weights", l2_weights)
    return (_interleave(fn, "l1_weights[0]", l1_w), l1_sf), l2


def transform_scales_for_mega_moe(l1_scales: torch.Tensor, l2_scales: torch.Tensor):
    """NVFP4 scale conversion of SGLang's pin: GC-MoE has no NVFP4 path."""
    raise NotImplementedError("transform_scales_for_mega_moe: converts NVFP4 scales; GC-MoE has no NVFP4 path "
                              "(mma_type='nvfp4xnvfp4' is not supported)")


def _recipe(fn: str, recipe: object, is_sfa: bool | None) -> tuple[int, int]:
    """(gran_mn, gran_k) from a 2-tuple recipe, or a 3-tuple plus ``is_sfa`` (DeepGEMM's rule)."""
    _checks.boolean(fn, "is_sfa", is_sfa, none_ok=True)
    if not isinstance(recipe, tuple | list) or len(recipe) not in (2, 3):
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

    ``num_groups`` given: ``sf`` is ``[G, ceil(mn/gran_mn), ceil(k/gran_k)]``; else 2-D. ``psum_layout`` and
    ``disable_ue8m0_cast=True`` with K32 raise NotImplementedError.
    """
    fn = "transform_sf_into_required_layout"
    gran_mn, gran_k = _recipe(fn, recipe, is_sfa)
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
    if gran_k == 128 and gran_mn in (1, 128):
        return sf.contiguous()
    if gran_k != 32:
        raise NotImplementedError(f"{fn}: recipe={tuple(recipe)} (gran_mn={gran_mn}, gran_k={gran_k}) is not a "
                                  "Mega MoE recipe GC-MoE supports (gran_k 32, or gran_k 128 with gran_mn 1/128)")
    _checks.unsupported_feature(fn, "disable_ue8m0_cast", disable_ue8m0_cast, False,
                                "FP32 K32 scale path (K32 scales are UE8M0)")
    rows = sf if gran_mn == 1 else sf.repeat_interleave(gran_mn, dim=-2)[..., :mn, :]
    codes = quant.ue8m0_encode(rows)
    pad = -codes.shape[-1] % 4
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad), value=127)  # 1.0 for the K32 groups beyond k
    return quant.pack_ue8m0_k32(codes).contiguous()
