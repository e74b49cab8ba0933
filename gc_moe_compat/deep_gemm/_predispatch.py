"""Pre-dispatch: quantize this rank's BF16 tokens into the Mega MoE buffer's views and stage the routing.

What the originals' fused pre-dispatch kernels compute (sgl-deep-gemm's ``sm90_mega_moe_pre_dispatch.cuh`` and
``sm100_mega_moe_pre_dispatch.cuh``), arithmetic in :func:`gc_moe_compat.quant.quantize_fp8_pre_dispatch`:

* ``mega_moe_pre_dispatch_sm90`` (SGLang's Hopper call): E4M3 payload with FP32 1x128 scales
  (``scale = max(amax, 1e-10) / 448``, payload ``x * (1 / scale)``) into ``buf_x`` / ``buf_x_sf``; routing weights
  multiplied by ``routed_scaling_factor``.
* ``mega_moe_pre_dispatch`` (DeepGEMM's SM100-style call, ``fp8xfp4`` / ``fp8xfp8``): E4M3 payload with UE8M0 K32
  scales (the ceil power of two of ``max(amax, 1e-4) / 448``), four codes packed per int32 into
  ``buf_x_sf [capacity, H/128]``.

Both copy ``topk_idx`` rows ``[0, num_tokens)`` (int32 or int64, into the view's width) and ``topk_weights``, and set
the routing rows ``[num_tokens, capacity)`` to ``(-1, 0.0)`` as the originals do, so no stale row routes anywhere.
On CUDA tensors the call is one launch of ``kernels/sm90/predispatch.cu`` on torch's current stream (no host sync:
capturable in a CUDA graph); host tensors get the same bytes from the torch model of that arithmetic.
"""

from __future__ import annotations

import ctypes

import torch

from gc_moe_compat import quant
from gc_moe_compat.deep_gemm import _checks
from gc_moe_compat.runtime import jit
from gc_moe_compat.runtime.launch import launch
from gc_moe_compat.runtime.params import KernelArgs, c_struct_declaration

__all__ = ["PreDispatchParams", "mega_moe_pre_dispatch", "mega_moe_pre_dispatch_sm90", "params_header",
           "stage_with_torch"]

SOURCE = "sm90/predispatch.cu"
KERNELS = {"fp32x128": "gc_pre_dispatch_fp32x128", "ue8m0x32": "gc_pre_dispatch_ue8m0x32"}
MAX_HIDDEN = 8192
"""One CTA of ``H/8`` threads per token (a 16-byte BF16 vector each), at most 1024 threads."""
HIDDEN_ALIGN = 256
"""Whole warps per CTA (``H/8`` a multiple of 32): the group maxima are warp shuffles."""

_IDX = (torch.int32, torch.int64)


class PreDispatchParams(ctypes.Structure):
    """By-value argument of the pre-dispatch kernels (``gc_moe::PreDispatchParams``,
    kernels/sm90/predispatch_params.cuh): device addresses, sizes, index widths (1 = int64) and the weight factor."""

    _fields_ = [
        ("x", ctypes.c_uint64),
        ("topk_idx", ctypes.c_uint64),
        ("topk_weights", ctypes.c_uint64),
        ("buf_x", ctypes.c_uint64),
        ("buf_x_sf", ctypes.c_uint64),
        ("buf_topk_idx", ctypes.c_uint64),
        ("buf_topk_weights", ctypes.c_uint64),
        ("num_tokens", ctypes.c_uint32),
        ("capacity", ctypes.c_uint32),
        ("hidden", ctypes.c_uint32),
        ("topk", ctypes.c_uint32),
        ("idx_in_64", ctypes.c_uint32),
        ("idx_out_64", ctypes.c_uint32),
        ("routed_scaling_factor", ctypes.c_float),
        ("reserved", ctypes.c_uint32),
    ]


def params_header() -> str:
    """The generated part of kernels/sm90/predispatch_params.cuh: the C declaration of :class:`PreDispatchParams`."""
    return c_struct_declaration(PreDispatchParams, "PreDispatchParams", "gc_moe_compat/deep_gemm/_predispatch.py")


def _check_views(fn: str, x: object, topk_idx: object, topk_weights: object, buf_x: object, buf_x_sf: object,
                 buf_topk_idx: object, buf_topk_weights: object, num_tokens: object, sf_dtype: torch.dtype,
                 sf_cols: int) -> int:
    """Dtypes, shapes, layout and device of the inputs and views; returns ``num_tokens``."""
    tensors = {
        "x": _checks.tensor(fn, "x", x, (torch.bfloat16,), 2),
        "topk_idx": _checks.tensor(fn, "topk_idx", topk_idx, _IDX, 2),
        "topk_weights": _checks.tensor(fn, "topk_weights", topk_weights, (torch.float32,), 2),
        "buf_x": _checks.tensor(fn, "buf_x", buf_x, (torch.float8_e4m3fn,), 2),
        "buf_x_sf": _checks.tensor(fn, "buf_x_sf", buf_x_sf, (sf_dtype,), 2),
        "buf_topk_idx": _checks.tensor(fn, "buf_topk_idx", buf_topk_idx, _IDX, 2),
        "buf_topk_weights": _checks.tensor(fn, "buf_topk_weights", buf_topk_weights, (torch.float32,), 2),
    }
    hidden, topk = tensors["x"].shape[1], tensors["topk_idx"].shape[1]
    capacity = tensors["buf_x"].shape[0]
    expected = {
        "buf_x": (capacity, hidden),
        "buf_x_sf": (capacity, sf_cols),
        "buf_topk_idx": (capacity, topk),
        "buf_topk_weights": (capacity, topk),
        "topk_weights": (tensors["topk_idx"].shape[0], topk),
    }
    for arg, shape in expected.items():
        if tuple(tensors[arg].shape) != shape:
            raise ValueError(f"{fn}: {arg} must have shape {shape}, got {tuple(tensors[arg].shape)}")
    device = tensors["x"].device
    for arg, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{fn}: {arg} must be on x's device {device}, got {t.device}")
        if not t.is_contiguous():
            raise ValueError(f"{fn}: {arg} must be contiguous (the kernel reads and writes whole rows), got strides "
                             f"{t.stride()}")
    return _checks.integer(fn, "num_tokens", num_tokens, 0, min(capacity, tensors["x"].shape[0],
                                                                tensors["topk_idx"].shape[0]))


def _check_hidden(fn: str, x: object) -> None:
    hidden = x.shape[-1] if isinstance(x, torch.Tensor) else 0
    if hidden % HIDDEN_ALIGN or not 0 < hidden <= MAX_HIDDEN:
        raise ValueError(f"{fn}: x must have a hidden size that is a multiple of {HIDDEN_ALIGN} in (0, {MAX_HIDDEN}] "
                         f"(one CTA of H/8 threads, whole warps, per token), got {hidden}")


def _run(recipe: str, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
         buf_x: torch.Tensor, buf_x_sf: torch.Tensor, buf_topk_idx: torch.Tensor, buf_topk_weights: torch.Tensor,
         num_tokens: int, factor: float) -> None:
    """Stages one call: the fused kernel on CUDA tensors, the torch model of its arithmetic on host tensors."""
    stage = _launch if x.is_cuda else stage_with_torch
    stage(recipe, x, topk_idx, topk_weights, buf_x, buf_x_sf, buf_topk_idx, buf_topk_weights, num_tokens, factor)


def stage_with_torch(recipe: str, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                     buf_x: torch.Tensor, buf_x_sf: torch.Tensor, buf_topk_idx: torch.Tensor,
                     buf_topk_weights: torch.Tensor, num_tokens: int, factor: float) -> None:
    """The staging as torch ops on any device, byte for byte what the kernel writes: the host path, and the
    torch-op baseline of ``bench/predispatch_sm90.py``."""
    n = num_tokens
    if n:
        q, scales = quant.quantize_fp8_pre_dispatch(x[:n], recipe)
        buf_x[:n].copy_(q)
        buf_x_sf[:n].copy_(scales if recipe == "fp32x128" else quant.pack_ue8m0_k32(scales))
        buf_topk_idx[:n].copy_(topk_idx[:n])
        buf_topk_weights[:n].copy_(topk_weights[:n] * torch.full_like(topk_weights[:n], factor))
    buf_topk_idx[n:].fill_(-1)
    buf_topk_weights[n:].fill_(0.0)


def _launch(recipe: str, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, buf_x: torch.Tensor,
            buf_x_sf: torch.Tensor, buf_topk_idx: torch.Tensor, buf_topk_weights: torch.Tensor, num_tokens: int,
            factor: float) -> None:
    capacity, hidden = buf_x.shape
    topk = buf_topk_idx.shape[1]
    threads = hidden // 8
    pad_blocks = -(-(capacity - num_tokens) * topk // threads)
    if num_tokens + pad_blocks == 0:
        return
    params = PreDispatchParams(
        x.data_ptr(), topk_idx.data_ptr(), topk_weights.data_ptr(), buf_x.data_ptr(), buf_x_sf.data_ptr(),
        buf_topk_idx.data_ptr(), buf_topk_weights.data_ptr(), num_tokens, capacity, hidden, topk,
        int(topk_idx.dtype == torch.int64), int(buf_topk_idx.dtype == torch.int64), factor, 0)
    kernel = jit.load_module(SOURCE).kernel(KERNELS[recipe])
    with torch.cuda.device(x.device):
        launch(kernel, num_tokens + pad_blocks, threads, KernelArgs(params),
               torch.cuda.current_stream(x.device).cuda_stream)


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
    _check_hidden(fn, x)
    n = _check_views(fn, x, topk_idx, topk_weights, buf_x, buf_x_sf, buf_topk_idx, buf_topk_weights, num_tokens,
                     torch.int32, x.shape[-1] // 128)
    _run("ue8m0x32", x, topk_idx, topk_weights, buf_x, buf_x_sf, buf_topk_idx, buf_topk_weights, n, 1.0)


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
    _check_hidden(fn, x)
    n = _check_views(fn, x, topk_idx, topk_weights, buf_x, buf_x_sf, buf_topk_idx, buf_topk_weights, num_tokens,
                     torch.float32, x.shape[-1] // 128)
    _run("fp32x128", x, topk_idx, topk_weights, buf_x, buf_x_sf, buf_topk_idx, buf_topk_weights, n, factor)
