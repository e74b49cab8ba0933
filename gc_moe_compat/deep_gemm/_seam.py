"""The GC-MoE operator's entry points for the facades: one call of the layer on a facade buffer and facade weights.

:func:`mega_moe` is the seam every Mega MoE call of the deep_gemm facade ends in. It takes what DeepGEMM's callers
hold and runs the native operator (:mod:`gc_moe_compat.operator.api`):

* **Buffer.** The facade's ``SymmBuffer`` is backed by a :class:`gc_moe_compat.operator.api.GcMoeBuffer` (its
  ``workspace``); its caller-facing views are that workspace's staging regions. The call runs on the workspace as
  seen by the call's compute path (:meth:`GcMoeBuffer.retyped`): SGLang's Hopper path creates its buffer with
  ``mma_type='fp8xfp4'`` and calls ``fp8_mega_moe`` (FP8xFP8) on it, which DeepGEMM allows and the layout permits.
* **Weights.** DeepGEMM-layout pairs become :class:`~gc_moe_compat.operator.api.GcMoeWeights` once per weight
  tensor and buffer (:func:`operator_weights`), never per call, after their value checks
  (:func:`gc_moe_compat.quant.check_weight_values`). FP8xFP8 pairs (``transform_weights_for_mega_moe_sm90`` and
  SGLang's ``build_sm90_mega_moe_experts_weights``: L1 rows interleaved gate/up by 8, natural block scales) are
  already the operator's layout and are wrapped without a copy. FP8xFP4 pairs must be in the originals'
  ``transform_weights_for_mega_moe`` layout (int32 scales in UTCCP row order, L1 interleaved; what SGLang's SM100
  loader builds too), the only layout read: :func:`canonical_pair` undoes it and
  :func:`gc_moe_compat.operator.api.transform_weights_for_gc_moe` repacks (new tensors). An interleave-only pair has
  the same shapes and cannot be told apart, so it would be misread: nothing else may be passed. A copy is rebuilt
  when its source's version counter moves; inference tensors have none, so their copies are refused
  (:func:`operator_weights` says why).
* **Options.** ``activation_clamp`` and ``fast_math`` are the operator's; ``cumulative_local_expert_recv_stats`` is
  incremented by role3. SwiGLU alpha is 1 (DeepGEMM has no alpha). A fused shared expert's pairs arrive here in the
  native API's canonical form (the facade's ``_mega._native_shared`` converts DeepGEMM's, the K32 recipe through
  :func:`canonical_pair` like the routed weights) and run as role4.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from gc_moe_compat import layouts, quant
from gc_moe_compat.compute_paths import compute_path
from gc_moe_compat.operator import api

__all__ = ["canonical_pair", "mega_moe", "operator_weights", "workspace_of", "workspace_view"]

_Pair = tuple[torch.Tensor, torch.Tensor]


def workspace_of(buffer: Any) -> api.GcMoeBuffer:
    """The live :class:`~gc_moe_compat.operator.api.GcMoeBuffer` behind ``buffer`` (a facade ``SymmBuffer`` or
    itself)."""
    workspace = getattr(buffer, "workspace", buffer)
    if workspace is None:  # a destroyed facade SymmBuffer
        raise ValueError("buffer: was destroyed")
    if not isinstance(workspace, api.GcMoeBuffer):
        raise TypeError(f"buffer: must be a facade SymmBuffer or a GcMoeBuffer, got {type(buffer).__name__}")
    if workspace.storage is None:
        raise ValueError("buffer: was destroyed")
    return workspace


def workspace_view(buffer: Any, name: str) -> torch.Tensor:
    """The operator-owned region ``name`` (token ring, L2 activations, ...) of ``buffer``; its layout is the
    operator's (:mod:`gc_moe_compat.operator.workspace`), not DeepGEMM's. ``KeyError`` naming the regions if absent."""
    return workspace_of(buffer).view(name)


# ---------------------------------------------------------------------------------------------------------- weights
@dataclass
class _Converted:
    """One converted pair: the source tensors (kept, so their ``id`` stays unique), their version counters when
    converted (None only for an inference tensor the weights alias, never for one they copy), and the operator's
    weights."""

    sources: _Pair
    versions: tuple[int | None, int | None]
    weights: api.GcMoeWeights


_weight_caches: weakref.WeakKeyDictionary[api.GcMoeBuffer, dict[tuple, _Converted]] = weakref.WeakKeyDictionary()
"""Per primary workspace: converted pairs by (compute path, GEMM, identity of both tensors). It lives as long as the
workspace, like the graphs the native API caches per buffer (which also keep the weights they point at alive)."""


def _identity(t: torch.Tensor) -> tuple:
    return id(t), t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device


def _versions(pair: _Pair) -> tuple[int | None, int | None]:
    """Version counters of a pair (None for an inference tensor, which has none: it can still be updated in place
    inside ``torch.inference_mode()``, so None is only safe where the weights alias the tensor)."""
    return tuple(None if t.is_inference() else t._version for t in pair)


def _copied(mma_type: str, pair: _Pair) -> tuple[torch.Tensor, ...]:
    """The tensors of ``pair`` whose conversion is a copy (every one for FP8xFP4, the non-contiguous ones for
    FP8xFP8, whose contiguous tensors are wrapped as they are)."""
    return tuple(t for t in pair if compute_path(mma_type).fp4 or not t.is_contiguous())


def _refuse_uncached_copies(mma_type: str, gemm: str, pair: _Pair) -> None:
    """``ValueError`` when a tensor the conversion of ``pair`` copies is an inference tensor (see
    :func:`operator_weights`)."""
    copied = _copied(mma_type, pair)
    for i, t in enumerate(pair):
        if t.is_inference() and any(t is c for c in copied):
            what = "repacked" if compute_path(mma_type).fp4 else "contiguous"
            raise ValueError(
                f"{gemm}_weights[{i}]: is an inference tensor (made under torch.inference_mode()), which has no "
                f"version counter, so an in-place update of it (EPLB moving expert slices) could not be seen and "
                f"its {mma_type} conversion, a {what} copy, would silently go stale; make the weights outside "
                f"inference mode, or clone them there once (with torch.inference_mode(False): w = w.clone())")


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def canonical_pair(gemm: str, pair: _Pair) -> _Pair:
    """A pair in the originals' ``transform_weights_for_mega_moe`` layout (int32 K32 scales in UTCCP row order, L1
    rows interleaved gate/up by 8) back in canonical row order: the inverse permutations, applied in reverse
    (:func:`gc_moe_compat.layouts.utccp_unpermute_scales`, then :func:`gc_moe_compat.layouts.deinterleave_gate_up`
    for ``gemm == "l1"``). Exact: both are row permutations. ``[E, N, K']`` pairs (routed or shared weights)."""
    payload, sf = pair[0], layouts.utccp_unpermute_scales(pair[1])
    if gemm == "l1":
        payload, sf = layouts.deinterleave_gate_up(payload), layouts.deinterleave_gate_up(sf)
    return payload, sf


def _refuse_unpacked_scales(mma_type: str, gemm: str, pair: _Pair) -> None:
    """``TypeError`` unless an FP8xFP4 pair's scales are int32: the originals' layout has no uint8 form (their UTCCP
    transpose takes int32 only), so uint8 codes could only be some other layout."""
    path = compute_path(mma_type)
    if path.fp4 and pair[1].dtype != torch.int32:
        raise TypeError(f"{path.facade_fn}: {gemm}_weights[1]: must be int32 (4 packed UE8M0 K32 scales per "
                        f"word, in transform_weights_for_mega_moe's UTCCP row order: the originals' layout), got "
                        f"{pair[1].dtype}")


def _convert(mma_type: str, l1: _Pair, l2: _Pair, need: tuple[bool, bool]) -> tuple[api.GcMoeWeights, ...]:
    """The operator's weights of the pairs flagged in ``need`` (None for the others)."""
    if not compute_path(mma_type).fp4:
        # The DeepGEMM SM90 layout is the operator's: interleaved FP8 L1 rows, natural 128x128 block scales, plain
        # L2 (= transform_weights_for_gc_moe of the de-interleaved pair, without its two copies of every L1).
        return tuple(api.GcMoeWeights(p.contiguous(), s.contiguous(), None, mma_type, gemm) if want else None
                     for (p, s), gemm, want in zip((l1, l2), ("l1", "l2"), need, strict=True))
    w1, w2 = api.transform_weights_for_gc_moe(canonical_pair("l1", l1), canonical_pair("l2", l2), mma_type)
    return w1 if need[0] else None, w2 if need[1] else None


def operator_weights(buffer: Any, mma_type: str, l1_weights: _Pair,
                     l2_weights: _Pair) -> tuple[api.GcMoeWeights, api.GcMoeWeights]:
    """The operator's weights for DeepGEMM-layout ``(l1, l2)`` pairs, converted once per weight tensor and buffer.

    A pair is looked up by the identity of its two tensors (``id``, data pointer, shape, strides, dtype, device) and
    reconverted when one's version counter moved (an in-place update through that tensor or a view of it, inside
    ``torch.inference_mode()`` too). The FP8xFP8 conversion is zero-copy when the tensors are contiguous: the weights
    alias the caller's memory, so no update of it, through any alias, can leave them stale.

    **Inference tensors** (made under ``torch.inference_mode()``) have no version counter, yet can be updated in
    place inside inference mode, so a copy of one cannot be cached by identity. A pair whose conversion copies such a
    tensor (any FP8xFP4 pair; a non-contiguous FP8 tensor) raises ``ValueError`` naming it; a contiguous FP8xFP8 one
    is wrapped, as it cannot go stale. Refusing is the only rule that is both cheap and never stale:

    * re-converting every call would repack the layer's weights per call (more memory traffic than the GEMMs that
      read them once), hand the native API new weights every call (its per-buffer graph cache keys on them) and is
      impossible inside CUDA graph capture, where the decode steps run;
    * a content fingerprint that provably sees every change must read every byte (an EPLB move may change one
      expert's slice only) and synchronise with the host on every call, which capture forbids too.

    The fix is one line for the caller, made once: create or clone the weights outside inference mode.

    Not seen by the version counter, so the caller must pass new tensors after them: writes through a tensor that
    shares the storage but not the counter (``.data``, another tensor over the same storage, raw pointers) and any
    update between replays of a captured graph (the graph holds the converted weights; no host code runs).
    A conversion that needs device work (an FP8xFP4 repack, a non-contiguous FP8 tensor) inside CUDA graph capture
    raises ``RuntimeError``: call once eagerly before capturing.
    """
    workspace = workspace_of(buffer)
    cache = _weight_caches.setdefault(workspace.alias_of or workspace, {})
    pairs = {"l1": l1_weights, "l2": l2_weights}
    keys = {gemm: (mma_type, gemm, _identity(p[0]), _identity(p[1])) for gemm, p in pairs.items()}
    hits = {}
    for gemm, pair in pairs.items():
        entry = cache.get(keys[gemm])
        if entry is not None and entry.versions == _versions(pair):
            hits[gemm] = entry.weights
    if len(hits) < 2:
        need = ("l1" not in hits, "l2" not in hits)
        for gemm, want in zip(pairs, need, strict=True):
            if want:
                _refuse_unpacked_scales(mma_type, gemm, pairs[gemm])
                _refuse_uncached_copies(mma_type, gemm, pairs[gemm])
                quant.check_weight_values(compute_path(mma_type).facade_fn, f"{gemm}_weights", pairs[gemm])
        copies = any(_copied(mma_type, pairs[gemm]) for gemm, want in zip(pairs, need, strict=True) if want)
        if copies and _capturing(l1_weights[0]):
            raise RuntimeError(f"l1_weights/l2_weights: converting them for the {mma_type} operator needs device "
                               "copies, which a CUDA graph capture would record; make one eager call with these "
                               "weights before capturing")
        converted = _convert(mma_type, l1_weights, l2_weights, need)
        for gemm, weights in zip(pairs, converted, strict=True):
            if weights is not None:
                pair = pairs[gemm]
                cache[keys[gemm]] = _Converted(pair, _versions(pair), weights)
                hits[gemm] = weights
    return hits["l1"], hits["l2"]


# ------------------------------------------------------------------------------------------------------------ call
def mega_moe(
    mma_type: str,
    y: torch.Tensor,
    l1_weights: _Pair,
    l2_weights: _Pair,
    buffer: Any,
    *,
    shared_l1_weights: _Pair | None,
    shared_l2_weights: _Pair | None,
    cumulative_local_expert_recv_stats: torch.Tensor | None,
    activation_clamp: float | None,
    fast_math: bool,
) -> None:
    """Run one layer of compute path ``mma_type`` on ``buffer``'s staged tokens: dispatch, both grouped GEMMs,
    combine into ``y`` in place.

    The caller has checked every argument (the facade's calls: :func:`gc_moe_compat.operator.api.validate_call` on
    DeepGEMM's views, the recipe, the options), so this converts the weights and runs
    :func:`gc_moe_compat.operator.api.run_checked_call` without checking them again; errors of the conversion and the
    launch name the path's facade call. ``buffer`` is a facade ``SymmBuffer`` (or a ``GcMoeBuffer``); the weight
    pairs are in DeepGEMM's layout (module docstring); the shared pairs in the native API's canonical form.
    """
    path = compute_path(mma_type)
    workspace = workspace_of(buffer).retyped(path.name)
    w1, w2 = operator_weights(workspace, path.name, l1_weights, l2_weights)
    shared = (shared_l1_weights, shared_l2_weights) if workspace.shape.num_shared_experts else None
    api.run_checked_call(path.facade_fn, workspace, y, w1, w2, activation_alpha=1.0,
                         activation_clamp=activation_clamp, fast_math=fast_math,
                         recv_stats=cumulative_local_expert_recv_stats, shared=shared)
