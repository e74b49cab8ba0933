"""Pre-dispatch: quantize this rank's BF16 tokens into the Mega MoE buffer's views and stage the routing.

What the originals' fused pre-dispatch kernels compute (sgl-deep-gemm's ``sm90_mega_moe_pre_dispatch.cuh`` and
``sm100_mega_moe_pre_dispatch.cuh``), arithmetic in :func:`gc_moe_compat.quant.quantize_fp8_pre_dispatch`:

* ``mega_moe_pre_dispatch_sm90`` (SGLang's Hopper call): E4M3 payload with FP32 1x128 scales
  (``scale = max(amax, 1e-10) / 448``, payload ``x * (1 / scale)``) into ``buf_x`` / ``buf_x_sf``; routing weights
  multiplied by ``routed_scaling_factor``.
* ``mega_moe_pre_dispatch`` (DeepGEMM's SM100-style call, ``fp8xfp4`` / ``fp8xfp8``): E4M3 payload with UE8M0 K32
  scales (the ceil power of two of ``max(amax, 1e-4) / 448``), four codes packed per int32 into
  ``buf_x_sf [capacity, H/128]``.

Both copy ``topk_idx`` rows ``[0, num_tokens)`` (int32, widened into the int64 view, the originals' two dtypes) and
``topk_weights``, and set the routing rows ``[num_tokens, capacity)`` to ``(-1, 0.0)`` as the originals do, so no
stale row routes anywhere. ``num_tokens`` is the row count of ``x``, ``topk_idx`` and ``topk_weights``, as the
originals assert.
On CUDA tensors the call is one launch of ``kernels/sm90/predispatch.cu`` on torch's current stream (no host sync:
capturable in a CUDA graph); host tensors get the same bytes from the torch model of that arithmetic.

Bad input. Everything the host can see is checked before any launch or write (``TypeError`` / ``ValueError`` naming the
argument): dtypes, shapes (``H`` a multiple of 256 up to 8192, ``1 <= k <= 32``, ``num_tokens`` rows), layout, one
device, and, when the views are a facade ``SymmBuffer``'s (:func:`gc_moe_compat.deep_gemm._buffer.buffer_of`), that each
is that buffer's own view of its name (not swapped, not from two buffers). ``routed_scaling_factor`` must be finite in
FP32 (the kernel multiplies in FP32: ``1e39`` is ``inf`` there); whether each product ``weight * factor`` is finite
depends on the weights. The routing values themselves are checked on the host for host tensors; on the GPU the call must
not synchronize (and may be captured), so the kernel drops what is invalid instead: an id outside ``[-1, E)`` (the
buffer's ``num_experts``; below -1 only, for views of no facade buffer) or a non-finite scaled weight is staged as the
unused slot ``(-1, 0.0)`` and recorded (:mod:`gc_moe_compat.runtime.dropped`); the next eager call on the device, this
one or ``fp8_mega_moe``, raises ``DeviceCheckError`` naming it. The activations likewise: a row of ``x`` holding a NaN
or Inf (no FP8 scale represents it) is refused on the host (``ValueError`` naming ``x`` and the row) and, on the GPU,
dropped whole (zero payload and scales, every slot ``(-1, 0.0)``) and reported as ``DeviceCheckError`` naming ``x``, the
row and a column.
"""

from __future__ import annotations

import ctypes

import torch

from gc_moe_compat import config, quant
from gc_moe_compat.deep_gemm import _buffer, _checks
from gc_moe_compat.runtime import jit
from gc_moe_compat.runtime.dropped import dropped_record
from gc_moe_compat.runtime.launch import launch
from gc_moe_compat.runtime.params import KernelArgs, c_struct_declaration

__all__ = ["PreDispatchParams", "mega_moe_pre_dispatch", "mega_moe_pre_dispatch_sm90", "params_header",
           "stage_with_torch"]

SOURCE = "sm90/predispatch.cu"
KERNELS = {"fp32x128": "gc_pre_dispatch_fp32x128", "ue8m0x32": "gc_pre_dispatch_ue8m0x32"}
_IDX_IN = (torch.int32,)
"""``topk_idx``'s dtype: the originals assert int32 (``topk_idx.scalar_type() == torch::kInt32``)."""
_IDX_OUT = (torch.int64,)
"""``buf_topk_idx``'s dtype: the originals assert int64, the buffer's (:mod:`gc_moe_compat.deep_gemm._buffer`)."""
_VIEWS = {"buf_x": "x", "buf_x_sf": "x_sf", "buf_topk_idx": "topk_idx", "buf_topk_weights": "topk_weights"}
"""Pre-dispatch view argument -> the facade SymmBuffer attribute it must be."""
FP32_MAX = float(torch.finfo(torch.float32).max)


class PreDispatchParams(ctypes.Structure):
    """By-value argument of the pre-dispatch kernels (``gc_moe::PreDispatchParams``,
    kernels/sm90/predispatch_params.cuh): device addresses (``dropped`` / ``dropped_mirror``: the device's record of
    dropped inputs), the largest valid id, sizes and the weight factor (ids: int32 in, int64 out)."""

    _fields_ = [
        ("x", ctypes.c_uint64),
        ("topk_idx", ctypes.c_uint64),
        ("topk_weights", ctypes.c_uint64),
        ("buf_x", ctypes.c_uint64),
        ("buf_x_sf", ctypes.c_uint64),
        ("buf_topk_idx", ctypes.c_uint64),
        ("buf_topk_weights", ctypes.c_uint64),
        ("dropped", ctypes.c_uint64),
        ("dropped_mirror", ctypes.c_uint64),
        ("id_max", ctypes.c_int64),
        ("num_tokens", ctypes.c_uint32),
        ("capacity", ctypes.c_uint32),
        ("hidden", ctypes.c_uint32),
        ("topk", ctypes.c_uint32),
        ("routed_scaling_factor", ctypes.c_float),
        ("reserved", ctypes.c_uint32),
    ]


def params_header() -> str:
    """The generated part of kernels/sm90/predispatch_params.cuh: the C declaration of :class:`PreDispatchParams`."""
    return c_struct_declaration(PreDispatchParams, "PreDispatchParams", "gc_moe_compat/deep_gemm/_predispatch.py")


def _check_views(fn: str, x: object, topk_idx: object, topk_weights: object, buf_x: object, buf_x_sf: object,
                 buf_topk_idx: object, buf_topk_weights: object, num_tokens: object,
                 sf_dtype: torch.dtype) -> tuple[int, int]:
    """Dtypes, shapes, layout and device of the inputs and views, and that views of a facade buffer are its own;
    returns ``(num_tokens, id_max)``: the largest valid expert id."""
    tensors = {
        "x": _checks.tensor(fn, "x", x, (torch.bfloat16,), 2),
        "topk_idx": _checks.tensor(fn, "topk_idx", topk_idx, _IDX_IN, 2),
        "topk_weights": _checks.tensor(fn, "topk_weights", topk_weights, (torch.float32,), 2),
        "buf_x": _checks.tensor(fn, "buf_x", buf_x, (torch.float8_e4m3fn,), 2),
        "buf_x_sf": _checks.tensor(fn, "buf_x_sf", buf_x_sf, (sf_dtype,), 2),
        "buf_topk_idx": _checks.tensor(fn, "buf_topk_idx", buf_topk_idx, _IDX_OUT, 2),
        "buf_topk_weights": _checks.tensor(fn, "buf_topk_weights", buf_topk_weights, (torch.float32,), 2),
    }
    hidden, topk = tensors["x"].shape[1], tensors["topk_idx"].shape[1]
    if hidden % config.HIDDEN_ALIGN or not 0 < hidden <= config.MAX_HIDDEN:  # the operator's H rule (config)
        raise ValueError(f"{fn}: x must have a hidden size that is a multiple of {config.HIDDEN_ALIGN} in "
                         f"(0, {config.MAX_HIDDEN}] (one CTA of H/8 <= 1024 threads, whole warps, per token), got "
                         f"{hidden}")
    if not 1 <= topk <= config.MAX_COMBINE_SLOTS:
        raise ValueError(f"{fn}: topk_idx must have 1 to {config.MAX_COMBINE_SLOTS} columns (the top-k; "
                         f"{config.MAX_COMBINE_SLOTS} combine slots per token), got shape {tuple(topk_idx.shape)}")
    capacity, rows = tensors["buf_x"].shape[0], tensors["x"].shape[0]
    expected = {
        "buf_x": (capacity, hidden),
        "buf_x_sf": (capacity, hidden // 128),
        "buf_topk_idx": (capacity, topk),
        "buf_topk_weights": (capacity, topk),
        "topk_idx": (rows, topk),
        "topk_weights": (rows, topk),
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
    n = _checks.integer(fn, "num_tokens", num_tokens, 0, capacity)
    if n != rows:
        raise ValueError(f"{fn}: num_tokens must equal x's rows (the originals' num_tokens == x.size(0)), got "
                         f"num_tokens={n}, x of shape {tuple(tensors['x'].shape)}")
    owner = _owner(fn, tensors)
    return n, owner.num_experts - 1 if owner is not None else int(torch.iinfo(tensors["buf_topk_idx"].dtype).max)


def _owner(fn: str, tensors: dict[str, torch.Tensor]) -> _buffer.SymmBuffer | None:
    """The facade buffer the views belong to (None for views of no facade buffer); each view must then be that
    buffer's own view of its name: swapped views or views of two buffers would stage into the wrong bytes."""
    owners = {arg: _buffer.buffer_of(tensors[arg]) for arg in _VIEWS}
    first = next((arg for arg, buf in owners.items() if buf is not None), None)
    if first is None:
        return None
    buf = owners[first]
    for arg, name in _VIEWS.items():
        t, want = tensors[arg], getattr(buf, name)
        if owners[arg] is None or owners[arg].workspace is not buf.workspace:
            got = "a tensor of no facade buffer" if owners[arg] is None else "a view of another buffer"
        elif (t.data_ptr(), t.shape, t.stride(), t.dtype) != (want.data_ptr(), want.shape, want.stride(), want.dtype):
            got = "another region of that buffer"
        else:
            continue
        raise ValueError(f"{fn}: {arg} must be sym_buffer.{name} of the buffer {first} belongs to (the views of one "
                         f"get_symm_buffer_for_mega_moe buffer, each in its place), got {got}")
    return buf


def _scaling_factor(fn: str, value: object) -> float:
    """``routed_scaling_factor``: finite in FP32, the precision the kernel multiplies in (``1e39`` is ``inf``
    there). Whether each product with a weight is finite is a property of the weights: see the module docstring."""
    factor = _checks.finite_float(fn, "routed_scaling_factor", value)
    if abs(factor) > FP32_MAX:
        raise ValueError(f"{fn}: routed_scaling_factor must be finite in FP32 (|f| <= {FP32_MAX:.8g}: the kernel "
                         f"multiplies the weights in FP32), got {value!r}")
    return factor


def _non_finite_rows(x: torch.Tensor) -> torch.Tensor:
    """Which rows of ``x`` hold a NaN or Inf (bool ``[T]``): the tokens the kernel drops."""
    return ~torch.isfinite(x).all(dim=1)


def _check_host_values(fn: str, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, n: int,
                       id_max: int, factor: float) -> None:
    """Host tensors: the activations and the routing values, before anything is written (the kernel's drop rule,
    as refusals)."""
    if config.inspect_values(x[:n]):
        rows = _non_finite_rows(x[:n]).nonzero().flatten().tolist()
        if rows:
            raise ValueError(f"{fn}: x must be finite (no FP8 scale represents a NaN or Inf activation), got "
                             f"{len(rows)} row(s) holding one, the first row {rows[0]}")
    idx, scaled = topk_idx[:n], topk_weights[:n] * torch.full_like(topk_weights[:n], factor)
    try:
        if config.inspect_values(idx):
            config.check_topk_values(idx, id_max + 1)
        if config.inspect_values(scaled):
            config.check_finite(scaled, "topk_weights * routed_scaling_factor")
    except ValueError as exc:
        raise ValueError(f"{fn}: {exc}") from exc


def _run(fn: str, recipe: str, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
         buf_x: torch.Tensor, buf_x_sf: torch.Tensor, buf_topk_idx: torch.Tensor, buf_topk_weights: torch.Tensor,
         num_tokens: int, id_max: int, factor: float) -> None:
    """Stages one call: the fused kernel on CUDA tensors (after raising for a drop an earlier launch recorded, when
    not capturing), the torch model of its arithmetic on host tensors (after checking their values)."""
    args = (recipe, x, topk_idx, topk_weights, buf_x, buf_x_sf, buf_topk_idx, buf_topk_weights, num_tokens)
    if x.is_cuda:
        if not torch.cuda.is_current_stream_capturing():
            dropped_record(x.device).raise_if_dropped(fn)
        _launch(*args, id_max, factor)
        return
    _check_host_values(fn, x, topk_idx, topk_weights, num_tokens, id_max, factor)
    stage_with_torch(*args, factor, id_max=id_max)


def stage_with_torch(recipe: str, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                     buf_x: torch.Tensor, buf_x_sf: torch.Tensor, buf_topk_idx: torch.Tensor,
                     buf_topk_weights: torch.Tensor, num_tokens: int, factor: float, *,
                     id_max: int | None = None) -> None:
    """The staging as torch ops on any device, byte for byte what the kernel writes, its drop rule included (ids
    outside ``[-1, id_max]``, default ``buf_topk_idx``'s integer range, and non-finite scaled weights become
    ``(-1, 0.0)``; a token whose row of ``x`` is not finite gets zero payload and scales and every slot
    ``(-1, 0.0)``; nothing is recorded): the host path, and the torch-op baseline of ``bench/predispatch_sm90.py``."""
    n = num_tokens
    if id_max is None:
        id_max = int(torch.iinfo(buf_topk_idx.dtype).max)
    if n:
        dropped = _non_finite_rows(x[:n]).unsqueeze(1)
        q, scales = quant.quantize_fp8_pre_dispatch(x[:n], recipe)
        buf_x[:n].copy_(q.view(torch.uint8).masked_fill(dropped, 0).view(q.dtype))
        scales = scales.masked_fill(dropped, 0)
        buf_x_sf[:n].copy_(scales if recipe == "fp32x128" else quant.pack_ue8m0_k32(scales))
        ids = topk_idx[:n].to(torch.int64)
        weights = topk_weights[:n] * torch.full_like(topk_weights[:n], factor)
        bad = (ids < -1) | (ids > id_max) | ~torch.isfinite(weights) | dropped
        buf_topk_idx[:n].copy_(torch.where(bad, torch.full_like(ids, -1), ids))
        buf_topk_weights[:n].copy_(torch.where(bad, torch.zeros_like(weights), weights))
    buf_topk_idx[n:].fill_(-1)
    buf_topk_weights[n:].fill_(0.0)


def _launch(recipe: str, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, buf_x: torch.Tensor,
            buf_x_sf: torch.Tensor, buf_topk_idx: torch.Tensor, buf_topk_weights: torch.Tensor, num_tokens: int,
            id_max: int, factor: float) -> None:
    capacity, hidden = buf_x.shape
    topk = buf_topk_idx.shape[1]
    threads = hidden // 8
    pad_blocks = -(-(capacity - num_tokens) * topk // threads)
    if num_tokens + pad_blocks == 0:
        return
    dropped, mirror = dropped_record(x.device).addresses
    params = PreDispatchParams(
        x.data_ptr(), topk_idx.data_ptr(), topk_weights.data_ptr(), buf_x.data_ptr(), buf_x_sf.data_ptr(),
        buf_topk_idx.data_ptr(), buf_topk_weights.data_ptr(), dropped, mirror, id_max, num_tokens, capacity,
        hidden, topk, factor, 0)
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
                          expert_scales: torch.Tensor | None = None,
                          *,
                          use_fp4_acts: bool | None = None) -> None:
    """FP8 activations with packed UE8M0 K32 scales (``group_size`` 32); FP4-activation kinds raise. The facade's
    SM90 buffer (FP32 1x128 ``x_sf``, what SGLang's Hopper path creates for either ``mma_type``) is refused: it is
    staged by ``mega_moe_pre_dispatch_sm90``.

    ``use_fp4_acts`` is sgl-project/DeepGEMM's dev-branch spelling of the activation kind (it stands where the pin
    has ``mma_type``): accepted as a keyword, ``False`` meaning FP8 activations, ``True`` (FP4 activations) raising
    NotImplementedError like an FP4-activation ``mma_type``. A bool passed positionally lands in ``mma_type`` and is
    refused as a TypeError that names both spellings."""
    fn = "mega_moe_pre_dispatch"
    if isinstance(mma_type, bool):
        raise TypeError(f"{fn}: mma_type must be a str (the pin's spelling, e.g. 'fp8xfp4'), got the bool "
                        f"{mma_type!r}: pass sgl-project/DeepGEMM dev's flag by keyword, use_fp4_acts={mma_type!r}")
    if use_fp4_acts is not None:
        _checks.boolean(fn, "use_fp4_acts", use_fp4_acts)
        if use_fp4_acts:
            raise NotImplementedError(f"{fn}: use_fp4_acts=True stages FP4 (E2M1) activations: GC-MoE has no "
                                      "FP4-activation path (only FP8 activations)")
    _checks.choice(fn, "mma_type", mma_type, _checks.SUPPORTED_MMA_TYPES, _checks.DEEPGEMM_ONLY_MMA_TYPES)
    _checks.choice(fn, "group_size", group_size, (32,), (16, 64, 128))
    _checks.unsupported_feature(fn, "buf_x_scales", buf_x_scales, None, "per-token outer scales (NVFP4 only)")
    _checks.unsupported_feature(fn, "expert_scales", expert_scales, None,
                                "per-expert scaling of the staged top-k weights in its pre-dispatch kernel")
    if isinstance(buf_x_sf, torch.Tensor) and buf_x_sf.dtype == torch.float32:
        raise ValueError(f"{fn}: buf_x_sf is float32, the SM90 layout (FP32 1x128 scales, the facade's Hopper "
                         f"buffer for every mma_type): stage it with mega_moe_pre_dispatch_sm90; "
                         f"mega_moe_pre_dispatch (mma_type={mma_type!r}) writes packed int32 UE8M0 K32 scales, an "
                         "SM100-layout buffer")
    n, id_max = _check_views(fn, x, topk_idx, topk_weights, buf_x, buf_x_sf, buf_topk_idx, buf_topk_weights,
                            num_tokens, torch.int32)
    _run(fn, "ue8m0x32", x, topk_idx, topk_weights, buf_x, buf_x_sf, buf_topk_idx, buf_topk_weights, n, id_max, 1.0)


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
    factor = _scaling_factor(fn, routed_scaling_factor)
    n, id_max = _check_views(fn, x, topk_idx, topk_weights, buf_x, buf_x_sf, buf_topk_idx, buf_topk_weights,
                            num_tokens, torch.float32)
    _run(fn, "fp32x128", x, topk_idx, topk_weights, buf_x, buf_x_sf, buf_topk_idx, buf_topk_weights, n, id_max,
         factor)
