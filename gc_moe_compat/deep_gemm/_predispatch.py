"""Pre-dispatch: quantize this rank's BF16 tokens per group into the buffer views and stage the routing.

Pure torch on the caller's device, built on :mod:`gc_moe_compat.quant` (the numerics the reference models):

* ``mega_moe_pre_dispatch_sm90`` (SGLang's Hopper call): E4M3 payload with FP32 1x128 scales
  (``scale = amax / 448``) into ``buf_x`` / ``buf_x_sf``; routing weights multiplied by ``routed_scaling_factor``.
* ``mega_moe_pre_dispatch`` (DeepGEMM's SM100-style call, ``fp8xfp4`` / ``fp8xfp8``): E4M3 payload with UE8M0 K32
  scales (power of two, ``2**ceil(log2(amax / 448))``), four codes packed per int32 into ``buf_x_sf [T, H/128]``.

Both copy ``topk_idx`` (int32 or int64, converted to the view's dtype) and ``topk_weights`` into rows
``[0, num_tokens)``. With ``num_tokens == 0`` they also mark row 0's slots unused (-1): SGLang still hands the
kernel a 1-row ``y`` then, and a stale row must not route anywhere.
"""

from __future__ import annotations

import torch

from gc_moe_compat import quant
from gc_moe_compat.deep_gemm import _checks

__all__ = ["mega_moe_pre_dispatch", "mega_moe_pre_dispatch_sm90"]

_IDX = (torch.int32, torch.int64)


def _check_views(fn: str, x: object, topk_idx: object, topk_weights: object, buf_x: object, buf_x_sf: object,
                 buf_topk_idx: object, buf_topk_weights: object, num_tokens: object, sf_dtype: torch.dtype,
                 sf_cols: int) -> int:
    """Dtypes, shapes and token counts of the inputs and views; returns ``num_tokens``."""
    x = _checks.tensor(fn, "x", x, (torch.bfloat16,), 2)
    topk_idx = _checks.tensor(fn, "topk_idx", topk_idx, _IDX, 2)
    topk_weights = _checks.tensor(fn, "topk_weights", topk_weights, (torch.float32,), 2)
    buf_x = _checks.tensor(fn, "buf_x", buf_x, (torch.float8_e4m3fn,), 2)
    buf_x_sf = _checks.tensor(fn, "buf_x_sf", buf_x_sf, (sf_dtype,), 2)
    buf_topk_idx = _checks.tensor(fn, "buf_topk_idx", buf_topk_idx, _IDX, 2)
    buf_topk_weights = _checks.tensor(fn, "buf_topk_weights", buf_topk_weights, (torch.float32,), 2)
    hidden, topk = x.shape[1], topk_idx.shape[1]
    capacity = buf_x.shape[0]
    expected = {
        "buf_x": (buf_x, (capacity, hidden)),
        "buf_x_sf": (buf_x_sf, (capacity, sf_cols)),
        "buf_topk_idx": (buf_topk_idx, (capacity, topk)),
        "buf_topk_weights": (buf_topk_weights, (capacity, topk)),
        "topk_weights": (topk_weights, (topk_idx.shape[0], topk)),
    }
    for arg, (t, shape) in expected.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{fn}: {arg} must have shape {shape}, got {tuple(t.shape)}")
    return _checks.integer(fn, "num_tokens", num_tokens, 0, min(capacity, x.shape[0], topk_idx.shape[0]))


def _stage_routing(topk_idx: torch.Tensor, topk_weights: torch.Tensor, buf_topk_idx: torch.Tensor,
                   buf_topk_weights: torch.Tensor, num_tokens: int) -> None:
    if num_tokens == 0:
        buf_topk_idx[:1].fill_(-1)
        return
    buf_topk_idx[:num_tokens].copy_(topk_idx[:num_tokens])
    buf_topk_weights[:num_tokens].copy_(topk_weights[:num_tokens])


def mega_moe_pre_dispatch(x: torch.Tensor,
                          topk_idx: torch.Tensor,
                          topk_weights: torch.Tensor,
                          buf_x: torch.Tensor,
                          buf_x_sf: torch.Tensor,
                          buf_topk_idx: torch.Tensor,
                          buf_topk_weights: torch.Tensor,
                          num_tokens: int,
                          group_size: int = 32,
                          mma_type: str = 'fp8xfp4',
                          buf_x_scales: torch.Tensor | None = None,
                          expert_scales: torch.Tensor | None = None) -> None:
    """FP8 activations with packed UE8M0 K32 scales (``group_size`` 32); FP4-activation kinds raise."""
    fn = "mega_moe_pre_dispatch"
    _checks.choice(fn, "mma_type", mma_type, _checks.SUPPORTED_MMA_TYPES, _checks.DEEPGEMM_ONLY_MMA_TYPES)
    _checks.choice(fn, "group_size", group_size, (32,), (16,))
    _checks.unsupported_feature(fn, "buf_x_scales", buf_x_scales, None, "per-token outer scales (NVFP4 only)")
    _checks.unsupported_feature(fn, "expert_scales", expert_scales, None, "per-expert input scales (NVFP4 only)")
    hidden = x.shape[-1] if isinstance(x, torch.Tensor) else 0
    if hidden % 128:
        raise ValueError(f"{fn}: x must have a hidden size that is a multiple of 128 (4 K32 scales per int32), "
                         f"got {hidden}")
    n = _check_views(fn, x, topk_idx, topk_weights, buf_x, buf_x_sf, buf_topk_idx, buf_topk_weights, num_tokens,
                     torch.int32, hidden // 128)
    if n:
        q, scales = quant.quantize_fp8_groups(x[:n], 32, scale_format="ue8m0")
        buf_x[:n].copy_(q)
        buf_x_sf[:n].copy_(quant.pack_ue8m0_k32(quant.ue8m0_encode(scales)))
    _stage_routing(topk_idx, topk_weights, buf_topk_idx, buf_topk_weights, n)


def mega_moe_pre_dispatch_sm90(x: torch.Tensor,
                               topk_idx: torch.Tensor,
                               topk_weights: torch.Tensor,
                               buf_x: torch.Tensor,
                               buf_x_sf: torch.Tensor,
                               buf_topk_idx: torch.Tensor,
                               buf_topk_weights: torch.Tensor,
                               num_tokens: int,
                               group_size: int = 128,
                               routed_scaling_factor: float = 1.0) -> None:
    """FP8 activations with FP32 1x128 scales; routing weights scaled by ``routed_scaling_factor``."""
    fn = "mega_moe_pre_dispatch_sm90"
    _checks.choice(fn, "group_size", group_size, (128,), ())
    factor = _checks.finite_float(fn, "routed_scaling_factor", routed_scaling_factor)
    hidden = x.shape[-1] if isinstance(x, torch.Tensor) else 0
    if hidden % 128:
        raise ValueError(f"{fn}: x must have a hidden size that is a multiple of 128, got {hidden}")
    n = _check_views(fn, x, topk_idx, topk_weights, buf_x, buf_x_sf, buf_topk_idx, buf_topk_weights, num_tokens,
                     torch.float32, hidden // 128)
    if n:
        q, scales = quant.quantize_fp8_groups(x[:n], 128, scale_format="fp32")
        buf_x[:n].copy_(q)
        buf_x_sf[:n].copy_(scales)
    _stage_routing(topk_idx, topk_weights * factor if factor != 1.0 else topk_weights,
                   buf_topk_idx, buf_topk_weights, n)
