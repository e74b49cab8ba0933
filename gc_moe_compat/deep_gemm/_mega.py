"""The Mega MoE calls: validate every argument exactly, then run the GC-MoE operator.

``fp8_fp4_mega_moe`` (FP8 activations x MXFP4 routed weights, recipe ``(1, 1, 32)``) and ``fp8_mega_moe`` (SGLang's
Hopper call: FP8 x FP8 with 128x128 block scales, recipe ``(128, 128, 128)``) check the buffer, the output, the
weights and every option against :func:`gc_moe_compat.config.validate` and the supported values, then run the
operator through :func:`gc_moe_compat.deep_gemm._seam.mega_moe` on the tokens staged in the buffer (``y.shape[0]`` of
them). That check is the call's only one: the seam runs the operator without the native calls' own (errors of the
launch name the facade call too).

Weights are DeepGEMM's layout: for ``fp8_mega_moe`` L1 rows interleaved gate/up by 8
(``transform_weights_for_mega_moe_sm90`` output, or SGLang's ``build_sm90_mega_moe_experts_weights``), L2 as is, FP8
block scales in the natural ``[E/P, N/128, K/128]`` layout; for ``fp8_fp4_mega_moe`` the originals'
``transform_weights_for_mega_moe`` layout only (L1 interleaved, int32 K32 scales transposed for UTCCP; SGLang's SM100
loader builds the same), which has the shapes of the interleave-only form and cannot be told from it. They are
converted for the operator once per weight tensor (see :func:`gc_moe_compat.deep_gemm._seam.operator_weights`).

Fused shared expert (``fp8_fp4_mega_moe`` on a buffer made with ``num_shared_experts=1``; ``fp8_mega_moe`` keeps the
original's signature, which has no shared-expert arguments, and refuses such a buffer): the operator's role4, on the
local tokens the buffer's ``shared_l1_acts`` / ``shared_l1_acts_sf`` are (``x`` / ``x_sf`` themselves: on SM90 no
Eq. (3) restaging), its partial in combine slot ``k``. Two shared weight forms are read, told apart by the scales'
dtype:

* DeepGEMM's shared recipe, as its tests/test_mega_moe.py builds it: ``per_token_cast_to_fp8(w, use_ue8m0=True,
  gran_k=32, use_packed_ue8m0=True)`` (E4M3 ``[N, K]``, per-row UE8M0 K32 scales packed four per int32
  ``[N, K/128]``) through ``transform_weights_for_mega_moe(shared_l1, shared_l2)``: L1 rows interleaved gate/up by
  8, both int32 scale tensors in UTCCP row order, any strides (DeepGEMM's are MN-major), ``[N, K']`` or
  ``[1, N, K']``. That layout only (uint8 codes cannot be it: the originals transpose int32 only); converted once
  per weight tensor into the native API's canonical pairs (:func:`_seam.canonical_pair`, the routed weights' rule),
  which role4 reads with its K32-promoting mainloop.
* The SM90 form, as ``transform_weights_for_mega_moe_sm90`` leaves an FP8 pair: E4M3 ``[1, 2I, H]`` with L1 rows
  interleaved gate/up by 8 and FP32 128x128 block scales ``[1, N/128, K/128]`` (natural order), L2 as is; the L1
  payload is de-interleaved once per weight tensor.

:func:`_native_shared` does both. SGLang's pin drops ``num_shared_experts`` on SM90 (its Hopper buffer has no shared
expert); this facade keeps 1 (the native operator fuses it on Hopper).
DeepGEMM options GC-MoE lacks (NVFP4, BF16, TRT-LLM layout, post-expert norm, ...) raise NotImplementedError naming
the argument; ``nvfp4_mega_moe`` and ``bf16_mega_moe`` always do.
"""

from __future__ import annotations

import math
import weakref

import torch

from gc_moe_compat import config, layouts, quant
from gc_moe_compat.compute_paths import FP8XFP4, FP8XFP8, ComputePath
from gc_moe_compat.deep_gemm import _checks, _seam
from gc_moe_compat.deep_gemm._buffer import SymmBuffer
from gc_moe_compat.operator import api

__all__ = ["bf16_mega_moe", "fp8_fp4_mega_moe", "fp8_mega_moe", "nvfp4_mega_moe"]

_Pair = tuple[torch.Tensor, torch.Tensor]


def _live_buffer(fn: str, sym_buffer: object) -> SymmBuffer:
    if not isinstance(sym_buffer, SymmBuffer):
        raise TypeError(f"{fn}: sym_buffer must come from gc_moe_compat's get_symm_buffer_for_mega_moe, "
                        f"got {type(sym_buffer).__module__}.{type(sym_buffer).__name__}")
    if sym_buffer.workspace is None:
        raise ValueError(f"{fn}: sym_buffer was destroyed")
    return sym_buffer


_shared_caches: weakref.WeakKeyDictionary[object, dict[tuple, tuple]] = weakref.WeakKeyDictionary()
"""Per primary workspace: a converted shared pair by its argument and the identity of its source tensors (sources,
their version counters and the canonical pair kept)."""

_SHARED_GEMMS = {"shared_l1_weights": "l1", "shared_l2_weights": "l2"}


def _k32_pair(fn: str, arg: str, pair: object, rows: int, k: int) -> _Pair:
    """One of DeepGEMM's K32 shared pairs (module docstring), checked: a pair of tensors, E4M3 ``[N, K]`` and int32
    ``[N, K/128]`` (both without or both with a leading 1), on one device; the rest of the rules are checked on the
    canonical pair by the native API's call check."""
    if not (isinstance(pair, tuple | list) and len(pair) == 2 and all(isinstance(t, torch.Tensor) for t in pair)):
        raise TypeError(f"{fn}: {arg} must be a (weights, scale factors) pair of tensors, got {type(pair).__name__}")
    payload, sf = pair
    if payload.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{fn}: {arg}[0] must be float8_e4m3fn (DeepGEMM's shared recipe), got {payload.dtype}")
    if sf.dtype != torch.int32:
        raise TypeError(f"{fn}: {arg}[1] must be int32 (4 packed UE8M0 K32 scales per word, in "
                        f"transform_weights_for_mega_moe's UTCCP row order: the originals' layout), or float32 128x128 "
                        f"block scales (the SM90 form), got {sf.dtype}")
    for i, (t, want) in enumerate(((payload, (rows, k)), (sf, (rows, k // 128)))):
        if tuple(t.shape) not in (want, (1, *want)):
            raise ValueError(f"{fn}: {arg}[{i}] must have shape {list(want)} or {[1, *want]} (one shared expert, "
                             f"N = {rows} rows, K = {k}), got {list(t.shape)}")
    if payload.dim() != sf.dim() or payload.device != sf.device:
        raise ValueError(f"{fn}: {arg} must be two tensors of one rank on one device, got {tuple(payload.shape)} on "
                         f"{payload.device} and {tuple(sf.shape)} on {sf.device}")
    return payload, sf


def _is_k32_form(*pairs: object) -> bool:
    """Whether the shared pairs are meant as DeepGEMM's K32 form: some pair's scales are a tensor of another dtype
    than the SM90 form's float32 (:func:`_k32_pair` then names what is wrong with either pair)."""
    return any(isinstance(p, tuple | list) and len(p) == 2 and isinstance(p[1], torch.Tensor)
               and p[1].dtype != torch.float32 for p in pairs)


def _native_shared(fn: str, buf: SymmBuffer, shared_l1: object, shared_l2: object, *,
                   k32: bool) -> tuple[_Pair, _Pair]:
    """The native API's canonical shared pairs for the facade's (module docstring), converted once per source tensor
    and buffer (rebuilt when a version counter moves; the same tensors are returned otherwise, so role4's own
    per-weight conversion is cached too). ``k32``: DeepGEMM's K32 form, checked (:func:`_k32_pair`, then no UE8M0
    code 255 and no E4M3 NaN) and converted through :func:`_seam.canonical_pair`, both pairs, before the native
    call check; else the SM90 form, after that check: the L1 payload de-interleaved, L2 as it is. A conversion
    that copies an inference tensor (no version counter, so its copy could go stale unseen) and a first conversion
    inside CUDA graph capture raise."""
    h, inter = buf.hidden, buf.intermediate_hidden
    if k32:
        dtypes = [p[1].dtype for p in (shared_l1, shared_l2)
                  if isinstance(p, tuple | list) and len(p) == 2 and isinstance(p[1], torch.Tensor)]
        if torch.float32 in dtypes:
            raise TypeError(f"{fn}: shared_l1_weights/shared_l2_weights must both be DeepGEMM's K32 form (int32 "
                            f"scales) or both the SM90 form (float32 block scales), got scales of {dtypes}")
    out = []
    for arg, pair, (rows, k) in (("shared_l1_weights", shared_l1, (2 * inter, h)),
                                 ("shared_l2_weights", shared_l2, (h, inter))):
        if k32:
            pair = _k32_pair(fn, arg, pair, rows, k)
        elif arg == "shared_l2_weights":
            out.append(pair)
            continue
        for i, t in enumerate(pair if k32 else pair[:1]):
            if t.is_inference():
                raise ValueError(f"{fn}: {arg}[{i}]: is an inference tensor (made under torch.inference_mode()), "
                                 "which has no version counter, so an in-place update of it could not be seen and "
                                 "its converted copy would silently go stale; make the weights outside inference "
                                 "mode, or clone them there once")
        workspace = _seam.workspace_of(buf)
        cache = _shared_caches.setdefault(workspace.alias_of or workspace, {})
        key = (arg, _seam._identity(pair[0]), _seam._identity(pair[1]))
        entry = cache.get(key)
        if entry is None or entry[1] != _seam._versions(pair):
            if pair[0].is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"{fn}: {arg}: converting them for the operator needs a device copy, which a CUDA "
                                   "graph capture would record; make one eager call with these weights before "
                                   "capturing")
            if k32:
                quant.check_weight_values(fn, arg, pair)
                grouped = tuple(t if t.dim() == 3 else t.unsqueeze(0) for t in pair)
                canonical = tuple(t.contiguous() for t in _seam.canonical_pair(_SHARED_GEMMS[arg], grouped))
            else:
                canonical = (layouts.deinterleave_gate_up(pair[0]), pair[1])
            entry = (pair, _seam._versions(pair), canonical)
            cache[key] = entry
        out.append(entry[2])
    return out[0], out[1]


def _clamp(fn: str, value: object) -> float | None:
    """``activation_clamp`` as the pin checks it (``activation_clamp >= 0``, so ``+inf`` too): a real number, not NaN,
    at least 0; ``+inf`` clamps nothing, so it runs as None (no clamp)."""
    if value is None or (isinstance(value, float) and value == math.inf):
        return None
    clamp = _checks.finite_float(fn, "activation_clamp", value)
    if clamp < 0:
        raise ValueError(f"{fn}: activation_clamp must be >= 0 (the pin's rule; None or +inf: no clamp), got {value!r}")
    return clamp


def _run(path: ComputePath, y: object, l1_weights: object, l2_weights: object, sym_buffer: object,
         shared_l1_weights: object, shared_l2_weights: object, stats: object, activation: object,
         activation_clamp: object, fast_math: object) -> None:
    """The checks common to both calls (the one validation of a facade call: the operator does not repeat it), then
    the operator through the seam."""
    fn = path.facade_fn
    buf = _live_buffer(fn, sym_buffer)
    _checks.choice(fn, "activation", activation, _checks.SUPPORTED_ACTIVATIONS, _checks.DEEPGEMM_ONLY_ACTIVATIONS)
    activation_clamp = _clamp(fn, activation_clamp)
    _checks.boolean(fn, "fast_math", fast_math)
    shape = config.MoEShape(
        num_experts=buf.num_experts, num_ranks=buf.shape.num_ranks, hidden=buf.hidden,
        intermediate=buf.intermediate_hidden, topk=buf.num_topk, num_shared_experts=buf.num_shared_experts,
        capacity=buf.num_max_tokens_per_rank, mma_type=path.name)
    k32 = bool(shape.num_shared_experts) and _is_k32_form(shared_l1_weights, shared_l2_weights)
    if k32:
        shared_l1_weights, shared_l2_weights = _native_shared(fn, buf, shared_l1_weights, shared_l2_weights, k32=True)
    try:  # the native API's call check (one validation layer), on DeepGEMM's views of the workspace
        inputs = {name: getattr(buf, name) for name in ("x", "x_sf", "topk_idx", "topk_weights")}
        api.validate_call(shape, y, inputs, l1_weights, l2_weights, shared_l1_weights, shared_l2_weights,
                          check_values=False)
        if isinstance(stats, torch.Tensor) and stats.dim() != 1 and stats.is_contiguous():
            stats = stats.view(-1)  # the pin checks only numel() == E/P: [1, E/P] serves, counted in place
        stats = api.check_recv_stats(stats, buf.workspace)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{fn}: {exc}") from exc
    if shape.num_shared_experts and not k32:
        shared_l1_weights, shared_l2_weights = _native_shared(fn, buf, shared_l1_weights, shared_l2_weights, k32=False)
    _seam.mega_moe(path.name, y, l1_weights, l2_weights, buf, shared_l1_weights=shared_l1_weights,
                   shared_l2_weights=shared_l2_weights, cumulative_local_expert_recv_stats=stats,
                   activation_clamp=activation_clamp, fast_math=fast_math)


def fp8_fp4_mega_moe(y: torch.Tensor,
                     l1_weights: _Pair,
                     l2_weights: _Pair,
                     sym_buffer: SymmBuffer,
                     shared_l1_weights: _Pair | None = None,
                     shared_l2_weights: _Pair | None = None,
                     cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                     recipe: tuple[int, int, int] = (1, 1, 32),
                     activation: str = 'swiglu',
                     activation_clamp: float | None = None,
                     fast_math: bool = True,
                     use_x_scales: bool = False,
                     l1_alphas: torch.Tensor | None = None,
                     l2_alphas: torch.Tensor | None = None,
                     l2_act_scales: torch.Tensor | None = None,
                     weight_layout: str = 'megamoe',
                     global_num_tokens: int | None = None,
                     post_expert_norm: bool = False,
                     post_expert_norm_weight: torch.Tensor | None = None,
                     post_expert_norm_eps: float = 1e-6,
                     post_expert_norm_weight_first: bool = False):
    """One MoE layer, FP8 activations x MXFP4 routed weights (FP8 shared weights): ``y [T, H]`` bf16 in place."""
    fn = FP8XFP4.facade_fn
    if isinstance(recipe, tuple | list) and tuple(recipe) == (1, 1, 16):
        raise NotImplementedError(f"{fn}: recipe=(1, 1, 16) is NVFP4: GC-MoE has no NVFP4 path")
    _checks.recipe(fn, recipe, FP8XFP4.recipe)
    _checks.choice(fn, "weight_layout", weight_layout, ("megamoe",), ("trtllm",))
    _checks.unsupported_feature(fn, "use_x_scales", use_x_scales, False, "per-token outer scales (NVFP4 only)")
    for arg, value in (("l1_alphas", l1_alphas), ("l2_alphas", l2_alphas), ("l2_act_scales", l2_act_scales)):
        _checks.unsupported_feature(fn, arg, value, None, "NVFP4 per-expert alphas / activation scales")
    # the norm's options are read only with the norm on, as by the pin (which checks eps >= 0 only then)
    _checks.unsupported_feature(fn, "post_expert_norm", post_expert_norm, False, "fused post-expert norm")
    _checks.boolean(fn, "post_expert_norm_weight_first", post_expert_norm_weight_first)
    if isinstance(post_expert_norm_eps, bool) or not isinstance(post_expert_norm_eps, int | float):
        raise TypeError(f"{fn}: post_expert_norm_eps must be a float, got {type(post_expert_norm_eps).__name__}")
    if post_expert_norm_weight is not None and not isinstance(post_expert_norm_weight, torch.Tensor):
        raise TypeError(f"{fn}: post_expert_norm_weight must be a torch.Tensor or None, got "
                        f"{type(post_expert_norm_weight).__name__}")
    if global_num_tokens is not None and isinstance(sym_buffer, SymmBuffer) and sym_buffer.workspace is not None:
        own = y.shape[0] if isinstance(y, torch.Tensor) and y.dim() == 2 else 0  # at least this rank's tokens
        _checks.integer(fn, "global_num_tokens", global_num_tokens, own,
                        sym_buffer.shape.num_ranks * sym_buffer.num_max_tokens_per_rank)
    _run(FP8XFP4, y, l1_weights, l2_weights, sym_buffer, shared_l1_weights, shared_l2_weights,
         cumulative_local_expert_recv_stats, activation, activation_clamp, fast_math)


def fp8_mega_moe(y: torch.Tensor,
                 l1_weights: _Pair,
                 l2_weights: _Pair,
                 sym_buffer: SymmBuffer,
                 cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                 recipe: tuple[int, int, int] = (128, 128, 128),
                 activation: str = 'swiglu',
                 activation_clamp: float | None = None,
                 fast_math: bool = True):
    """One MoE layer, FP8 x FP8 with 128x128 block-scaled weights (SGLang's Hopper path): ``y`` in place."""
    fn = FP8XFP8.facade_fn
    _checks.recipe(fn, recipe, FP8XFP8.recipe)
    if isinstance(sym_buffer, SymmBuffer) and sym_buffer.num_shared_experts:
        raise ValueError(f"{fn}: sym_buffer was created with num_shared_experts={sym_buffer.num_shared_experts}, "
                         "but fp8_mega_moe takes no shared-expert weights (create it with num_shared_experts=0)")
    _run(FP8XFP8, y, l1_weights, l2_weights, sym_buffer, None, None, cumulative_local_expert_recv_stats,
         activation, activation_clamp, fast_math)


def nvfp4_mega_moe(y: torch.Tensor,
                   l1_weights: _Pair,
                   l2_weights: _Pair,
                   sym_buffer: SymmBuffer,
                   shared_l1_weights: _Pair | None = None,
                   shared_l2_weights: _Pair | None = None,
                   cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                   activation: str = 'swiglu',
                   activation_clamp: float | None = None,
                   fast_math: bool = True,
                   use_x_scales: bool = False,
                   l1_alphas: torch.Tensor | None = None,
                   l2_alphas: torch.Tensor | None = None,
                   l2_act_scales: torch.Tensor | None = None,
                   weight_layout: str = 'megamoe',
                   global_num_tokens: int | None = None,
                   post_expert_norm: bool = False,
                   post_expert_norm_weight: torch.Tensor | None = None,
                   post_expert_norm_eps: float = 1e-6,
                   post_expert_norm_weight_first: bool = False):
    """SGLang pin's NVFP4 x NVFP4 layer: GC-MoE has no NVFP4 path."""
    raise NotImplementedError("nvfp4_mega_moe: GC-MoE has no NVFP4 path (mma_type='nvfp4xnvfp4')")


def bf16_mega_moe(y: torch.Tensor,
                  l1_weights: torch.Tensor,
                  l2_weights: torch.Tensor,
                  sym_buffer: SymmBuffer,
                  shared_l1_weights: torch.Tensor | None = None,
                  shared_l2_weights: torch.Tensor | None = None,
                  cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                  activation: str = 'swiglu',
                  activation_clamp: float | None = None,
                  fast_math: bool = True,
                  weight_layout: str = 'megamoe',
                  global_num_tokens: int | None = None,
                  post_expert_norm: bool = False,
                  post_expert_norm_weight: torch.Tensor | None = None,
                  post_expert_norm_eps: float = 1e-6,
                  post_expert_norm_weight_first: bool = False):
    """DeepGEMM's BF16 layer: GC-MoE has no BF16 path."""
    raise NotImplementedError("bf16_mega_moe: GC-MoE has no BF16 Mega MoE path (mma_type='bf16xbf16')")
