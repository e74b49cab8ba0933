"""The native GC-MoE API of the paper's Listing 1, SM90 path.

``get_symm_buffer_for_gc_moe`` (:mod:`.buffer`), ``transform_weights_for_gc_moe`` (:mod:`.weights`),
``fp8_fp4_gc_moe`` (FP8 activations x window-repacked MXFP4 weights, recipe ``(1, 1, 32)``) and ``fp8_fp8_gc_moe``
(FP8 x FP8 with 128x128 block scales, recipe ``(128, 128, 128)``). A call writes ``y [T, H]`` BF16 in place from the
``T`` tokens staged in ``buffer.x[:T]`` etc., ``T = y.shape[0]``.

What a call does, in order: every argument through :func:`gc_moe_compat.config.validate` and the option checks
(``TypeError``/``ValueError`` naming the argument); take the single-instance workspace guard
(:func:`.buffer.exclusive`); pick ``BM`` for ``T`` and check the ring against the compute SMs the launch
would get (:class:`gc_moe_compat.operator.ring.RingCapacityError`; with ``GC_MOE_PARTITION=off`` the ring must hold the
whole pool); then run the three-node graph of :mod:`gc_moe_compat.operator.sm90.layer` (role1 dispatch, role2 grouped
GEMMs, role3 finalize; with a fused shared expert role4 too, :mod:`gc_moe_compat.operator.sm90.role4_shared`) on
torch's current stream, or attach it to the capture in progress. Outside capture the call
then waits for the graph and raises :class:`~gc_moe_compat.runtime.status.DeviceTimeoutError` /
``DeviceCheckError`` naming the role and site of any device-side error (inside a capture the records are read by
the next eager call). Both compute paths have all three roles (role2: :mod:`gc_moe_compat.operator.sm90.role2_gemm`
picks the
FP8xFP8 or the FP8xFP4 grouped-GEMM kernel by ``mma_type``), and a buffer with ``num_shared_experts=1`` runs the
shared expert as role4 on the call's ``shared_l1_weights`` / ``shared_l2_weights`` (FP8 E4M3 with FP32 128x128 block
scales, or DeepGEMM's per-row UE8M0 K32 scales as uint8 codes or packed int32; canonical layout: gate rows then up
rows; converted once per weight tensor and buffer, so the first call with them must be eager, not captured) into
combine slot ``k``, which role3 sums after the routed slots.
"""

from __future__ import annotations

import weakref

import torch

from gc_moe_compat import config
from gc_moe_compat.compute_paths import FP8XFP4, FP8XFP8, ComputePath
from gc_moe_compat.config import boolean, finite_float
from gc_moe_compat.config import recipe as recipe_of
from gc_moe_compat.operator.buffer import GcMoeBuffer, exclusive, get_symm_buffer_for_gc_moe
from gc_moe_compat.operator.heuristics import block_m_for_call
from gc_moe_compat.operator.ring import RingCapacityError, RingModel, RingPlan
from gc_moe_compat.operator.sm90 import layer, role2_gemm
from gc_moe_compat.operator.weights import GcMoeWeights, transform_weights_for_gc_moe
from gc_moe_compat.runtime.split import partition_mode

__all__ = [
    "check_recv_stats",
    "GcMoeBuffer",
    "GcMoeWeights",
    "fp8_fp4_gc_moe",
    "fp8_fp8_gc_moe",
    "get_symm_buffer_for_gc_moe",
    "partition_mode",
    "ring_model",
    "ring_plan",
    "run_checked_call",
    "transform_weights_for_gc_moe",
    "validate_call",
]


_Pair = tuple[torch.Tensor, torch.Tensor]


def validate_call(shape: config.MoEShape, y: object, inputs: dict[str, torch.Tensor], l1_weights: object,
                  l2_weights: object, shared_l1_weights: object = None, shared_l2_weights: object = None, *,
                  check_values: bool = True) -> int:
    """``config.validate`` of one call against ``shape``; returns ``T = y.shape[0]``.

    ``inputs`` holds the full-capacity staging views ``x``, ``x_sf``, ``topk_idx``, ``topk_weights``; their ``[:T]``
    slices are checked. Both routed weight pairs are required, and with a fused shared expert the shared ones. The
    one call check of the native API and the deep_gemm facade's layer calls (which prefix its errors with their
    name).
    """
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"y: must be a 2-D bfloat16 tensor [T, H], got {type(y).__name__}")
    if y.dim() != 2:
        raise ValueError(f"y: must be a 2-D bfloat16 tensor [T, H], got shape {tuple(y.shape)}")
    for arg, pair in (("l1_weights", l1_weights), ("l2_weights", l2_weights)):
        if pair is None:
            raise TypeError(f"{arg}: must be a (weights, scales) pair of tensors, got None")
    if shape.num_shared_experts and (shared_l1_weights is None or shared_l2_weights is None):
        raise ValueError("shared_l1_weights/shared_l2_weights: must be given (the buffer has a fused shared "
                         "expert, combine slot k), got None")
    t = y.shape[0]
    if t > shape.capacity:
        raise ValueError(f"y.shape[0] (tokens T): must be <= capacity={shape.capacity} (the buffer's Tmax, a facade "
                         f"buffer's num_max_tokens_per_rank rounded up; ring and combine buffers are sized for it), "
                         f"got {t}")
    config.validate(shape, **{name: view[:t] for name, view in inputs.items()}, y=y, l1_weights=l1_weights,
                    l2_weights=l2_weights, shared_l1_weights=shared_l1_weights, shared_l2_weights=shared_l2_weights,
                    num_tokens=t, check_values=check_values)
    return t


def ring_model(buffer: GcMoeBuffer, num_tokens: int) -> RingModel:
    """The ring model of a call with ``num_tokens`` tokens: ``BM`` from the block-size heuristic, the compute SMs
    the launch would get now."""
    s = buffer.shape
    bm = block_m_for_call(num_tokens, s.num_ranks, s.topk, s.num_experts, mma_type=s.mma_type)
    return RingModel(s, bm, buffer.current_compute_sms(), buffer.layout.geometry)


def ring_plan(buffer: GcMoeBuffer, num_tokens: int, model: RingModel | None = None) -> RingPlan:
    """The ring plan of a call with ``num_tokens`` tokens (``model`` default :func:`ring_model`), checked against
    the compute SMs the launch would get (:class:`gc_moe_compat.operator.ring.RingCapacityError` if undersized). With
    the partition off the roles run in sequence: role1 must never wait for a refill, so the ring must hold every
    block the call can fill (:meth:`~gc_moe_compat.operator.ring.RingCapacity.holds_call`) and the live-block need
    of a concurrent schedule does not apply."""
    model = model or ring_model(buffer, num_tokens)
    ring = buffer.layout.ring
    if buffer.partition == "on":
        return ring.plan(model)
    if not ring.holds_call(model, num_tokens):
        raise RingCapacityError(
            f"buffer: with the partition off role1 runs before role2, so the ring must hold every block the call "
            f"can fill, {model.call_pool_blocks(num_tokens)} blocks of BM={model.block_m} rows at T={num_tokens} "
            f"(role1 would otherwise wait forever for role2 to free a block); this buffer's ring holds "
            f"{ring.ring_blocks(model)}: create the buffer with partition='off' (it then sizes the ring for the "
            "whole pool)")
    return RingPlan.for_model(model, ring.ring_blocks(model))


def _weights(arg: str, w: object, path: ComputePath, gemm: str, num_local_experts: int) -> _Pair:
    if not isinstance(w, GcMoeWeights):
        raise TypeError(f"{arg}: must come from transform_weights_for_gc_moe, got {type(w).__name__}")
    if (w.mma_type, w.gemm) != (path.name, gemm):
        raise ValueError(f"{arg}: must be the {gemm!r} weights of mma_type={path.name!r}, got the {w.gemm!r} "
                         f"weights of mma_type={w.mma_type!r}")
    if path.fp4:
        f = w.factor
        if not isinstance(f, torch.Tensor) or f.dtype != torch.float32 or tuple(f.shape) != (num_local_experts,):
            raise ValueError(f"{arg}.factor: must be float32 [{num_local_experts}] (per-expert 2^base), got {f!r:.80}")
    return w.pair


def check_recv_stats(stats: object, buffer: GcMoeBuffer) -> torch.Tensor | None:
    """``cumulative_local_expert_recv_stats``: None or a contiguous int32 ``[e]`` on the buffer's device (the native
    calls' and the deep_gemm facade's one check)."""
    if stats is None:
        return None
    e = buffer.shape.num_local_experts
    if not isinstance(stats, torch.Tensor) or stats.dtype != torch.int32:
        raise TypeError(f"cumulative_local_expert_recv_stats: must be an int32 tensor [{e}] or None, got "
                        f"{stats!r:.80}")
    if tuple(stats.shape) != (e,) or not stats.is_contiguous() or stats.device != buffer.storage.device:
        raise ValueError(f"cumulative_local_expert_recv_stats: must be a contiguous int32 tensor [{e}] (e = E/P) on "
                         f"{buffer.storage.device}, got shape {tuple(stats.shape)} on {stats.device}")
    return stats


def _check_call(path: ComputePath, y: object, w1: object, w2: object, buffer: object, recipe: object,
                activation: object, activation_alpha: object, activation_clamp: object, shared_l1_weights: object,
                shared_l2_weights: object, check_values: object, fast_math: object,
                recv_stats: object) -> torch.Tensor | None:
    """Every check of a native call of ``path`` (``TypeError`` / ``ValueError`` naming ``path.native_fn`` and the
    argument); returns the checked ``cumulative_local_expert_recv_stats``."""
    fn = path.native_fn
    if not isinstance(buffer, GcMoeBuffer):
        raise TypeError(f"{fn}: buffer: must come from get_symm_buffer_for_gc_moe, got {type(buffer).__name__}")
    if buffer.storage is None:
        raise ValueError(f"{fn}: buffer: was destroyed")
    shape = buffer.shape
    boolean(fn, "check_values", check_values)  # before validate_call reads it: None would skip the value checks
    try:
        if shape.mma_type != path.name:
            raise ValueError(f"buffer: must be created with mma_type={path.name!r}, got {shape.mma_type!r}")
        e = shape.num_local_experts
        l1, l2 = _weights("w1", w1, path, "l1", e), _weights("w2", w2, path, "l2", e)
        inputs = {name: buffer.view(name) for name in ("x", "x_sf", "topk_idx", "topk_weights")}
        validate_call(shape, y, inputs, l1, l2, shared_l1_weights, shared_l2_weights, check_values=check_values)
        if not isinstance(activation, str):
            raise TypeError(f"activation: must be 'swiglu' (a str), got {type(activation).__name__} "
                            f"({activation!r:.80})")
        if activation != "swiglu":
            raise ValueError(f"activation: must be 'swiglu' (fused in the W1 epilogue), got {activation!r}")
        recv_stats = check_recv_stats(recv_stats, buffer)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{fn}: {exc}") from exc
    recipe_of(fn, recipe, path.recipe)
    finite_float(fn, "activation_alpha", activation_alpha)
    if activation_clamp is not None:
        finite_float(fn, "activation_clamp", activation_clamp, positive=True)
    boolean(fn, "fast_math", fast_math)
    return recv_stats


def run_checked_call(fn: str, buffer: GcMoeBuffer, y: torch.Tensor, w1: GcMoeWeights, w2: GcMoeWeights, *,
                     activation_alpha: float, activation_clamp: float | None, fast_math: bool,
                     recv_stats: torch.Tensor | None, shared: tuple[_Pair, _Pair] | None) -> None:
    """One layer call on ``y.shape[0]`` staged tokens whose arguments were checked where they entered: by the
    native calls, or by the ``deep_gemm`` facade (its ``validate_call`` on DeepGEMM's views, before the seam
    converts the weights), so that a facade call is validated once. Takes the workspace guard, plans the ring
    (:class:`~gc_moe_compat.operator.ring.RingCapacityError`) and runs the graph, with the partition the buffer's
    plan gives a call of this size (:meth:`GcMoeBuffer.for_call`); ``fn``, the caller's function, prefixes the
    errors of the launch. ``shared``: the fused shared expert's pairs (None without one)."""
    t = y.shape[0]
    with exclusive(buffer):
        buffer = buffer.for_call(t)
        model = ring_model(buffer, t)
        plan = ring_plan(buffer, t, model)
        _launch(fn, buffer, y, w1, w2, t, model, plan, activation_alpha, activation_clamp, fast_math=fast_math,
                recv_stats=recv_stats, shared=shared)


def _run(path: ComputePath, y: object, w1: object, w2: object, buffer: object, recipe: object,
         activation: object, activation_alpha: object, activation_clamp: object, shared_l1_weights: object,
         shared_l2_weights: object, check_values: object, *, fast_math: object = True,
         recv_stats: object = None) -> None:
    """A native call of ``path``: :func:`_check_call`, then :func:`run_checked_call`."""
    recv_stats = _check_call(path, y, w1, w2, buffer, recipe, activation, activation_alpha, activation_clamp,
                             shared_l1_weights, shared_l2_weights, check_values, fast_math, recv_stats)
    shared = (shared_l1_weights, shared_l2_weights) if buffer.shape.num_shared_experts else None
    run_checked_call(path.native_fn, buffer, y, w1, w2, activation_alpha=activation_alpha,
                     activation_clamp=activation_clamp, fast_math=fast_math, recv_stats=recv_stats, shared=shared)


_caches: weakref.WeakKeyDictionary[GcMoeBuffer, layer.LayerCache] = weakref.WeakKeyDictionary()
"""Built graphs and weight views per buffer (dropped with the buffer)."""


def _launch(fn: str, buffer: GcMoeBuffer, y: torch.Tensor, w1: GcMoeWeights, w2: GcMoeWeights, t: int,
            model: RingModel, plan: RingPlan, activation_alpha: float, activation_clamp: float | None, *,
            fast_math: bool = True, recv_stats: torch.Tensor | None = None,
            shared: tuple[_Pair, _Pair] | None = None) -> None:
    """Runs (or, inside a capture, attaches) the call's graph; outside capture waits for it and raises the first
    device-side error (role order). ``fast_math`` picks the role2 (and role4) variant's sigmoid; ``recv_stats`` is
    role3's optional per-local-expert receive counter; ``shared`` the shared expert's weight pairs (role4)."""
    if not buffer.storage.is_cuda:
        raise RuntimeError(f"{fn}: buffer: lives in host memory (created without a CUDA device); running the layer "
                           "needs the GPU")
    cache = _caches.setdefault(buffer, layer.LayerCache())
    call = layer.LayerCall(num_tokens=t, model=model, plan=plan,
                           variant=role2_gemm.role2_variant(model, t, fast_math=fast_math),
                           activation_clamp=None if activation_clamp is None else float(activation_clamp),
                           activation_alpha=float(activation_alpha), recv_stats=recv_stats)
    if layer.run_layer(buffer, y, w1, w2, call, cache, shared):
        return
    layer.raise_for_layer_status(buffer, f"{fn}: running the layer")


def fp8_fp4_gc_moe(y: torch.Tensor, w1: GcMoeWeights, w2: GcMoeWeights, buffer: GcMoeBuffer,
                   recipe: tuple[int, int, int] = (1, 1, 32), activation: str = "swiglu",
                   activation_alpha: float = 1.0, activation_clamp: float | None = 10.0, *,
                   shared_l1_weights: _Pair | None = None, shared_l2_weights: _Pair | None = None,
                   check_values: bool = True, fast_math: bool = True,
                   cumulative_local_expert_recv_stats: torch.Tensor | None = None) -> None:
    """One MoE layer, FP8 activations x MXFP4 routed weights: ``y [T, H]`` BF16 written in place.

    ``check_values`` (default on) also checks the staged ``topk_idx`` range and ``topk_weights`` finiteness: one
    device sync each outside graph capture, skipped automatically while capturing. ``fast_math`` and
    ``cumulative_local_expert_recv_stats`` as in :func:`fp8_fp8_gc_moe`.
    """
    _run(FP8XFP4, y, w1, w2, buffer, recipe, activation, activation_alpha, activation_clamp,
         shared_l1_weights, shared_l2_weights, check_values, fast_math=fast_math,
         recv_stats=cumulative_local_expert_recv_stats)


def fp8_fp8_gc_moe(y: torch.Tensor, w1: GcMoeWeights, w2: GcMoeWeights, buffer: GcMoeBuffer,
                   recipe: tuple[int, int, int] = (128, 128, 128), activation: str = "swiglu",
                   activation_alpha: float = 1.0, activation_clamp: float | None = 10.0, *,
                   shared_l1_weights: _Pair | None = None, shared_l2_weights: _Pair | None = None,
                   check_values: bool = True, fast_math: bool = True,
                   cumulative_local_expert_recv_stats: torch.Tensor | None = None) -> None:
    """One MoE layer, FP8 x FP8 with 128x128 block-scaled weights: ``y [T, H]`` BF16 written in place.

    ``fast_math`` (default on): ``__expf`` and a fast reciprocal in the SwiGLU sigmoid (DeepGEMM's option).
    ``cumulative_local_expert_recv_stats``: optional contiguous int32 ``[E/P]`` on the buffer's device; role3 adds
    the rows this rank received per local expert in this call (DeepGEMM's / DeepEP's statistics counter).
    """
    _run(FP8XFP8, y, w1, w2, buffer, recipe, activation, activation_alpha, activation_clamp,
         shared_l1_weights, shared_l2_weights, check_values, fast_math=fast_math,
         recv_stats=cumulative_local_expert_recv_stats)
