"""The GC-MoE operator's entry points: the one seam every facade calls to run the operator.

Both entry points go through the native API (:mod:`gc_moe_compat.native`): the same validation, the same
single-instance guard and the same ``NotImplementedError`` naming the role kernels that do not exist yet. The
deep_gemm facade's ``SymmBuffer`` allocates only the caller-staged inputs; the operator workspace (token ring, L2
activations, counters, combine buffer) is laid out by :mod:`gc_moe_compat.operator_layout` and allocated by
:class:`gc_moe_compat.native.GcMoeBuffer`, which this seam also accepts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from gc_moe_compat import native
from gc_moe_compat.native import OPERATOR_MISSING

__all__ = ["OPERATOR_MISSING", "mega_moe", "workspace_view"]

_FACADE_NO_WORKSPACE = ("the deep_gemm facade's SymmBuffer holds only the caller-staged inputs, not the operator "
                        "workspace (gc_moe_compat.native.GcMoeBuffer)")
_SEAM_NO_RUN = ("this seam receives the facade's canonical weight pairs, not transform_weights_for_gc_moe output; "
                "call gc_moe_compat.native.fp8_fp8_gc_moe to run the operator")
_MMA_OF_RECIPE = {recipe: mma for mma, recipe in native.RECIPES.items()}


def mega_moe(
    y: torch.Tensor,
    l1_weights: tuple[torch.Tensor, torch.Tensor],
    l2_weights: tuple[torch.Tensor, torch.Tensor],
    buffer: Any,
    *,
    shared_l1_weights: tuple[torch.Tensor, torch.Tensor] | None,
    shared_l2_weights: tuple[torch.Tensor, torch.Tensor] | None,
    cumulative_local_expert_recv_stats: torch.Tensor | None,
    recipe: tuple[int, int, int],
    activation_clamp: float | None,
    fast_math: bool,
) -> None:
    """Run one layer: dispatch the tokens staged in ``buffer``, both grouped GEMMs, combine into ``y`` in place.

    ``buffer`` is the facade's ``SymmBuffer`` or a ``GcMoeBuffer``; the weights are the facade's validated pairs.
    """
    what = "running the Mega MoE layer"
    if tuple(recipe) not in _MMA_OF_RECIPE:
        raise ValueError(f"recipe: must be one of {tuple(_MMA_OF_RECIPE)}, got {recipe!r}")
    shape = dataclasses.replace(buffer.shape, mma_type=_MMA_OF_RECIPE[tuple(recipe)])
    inputs = {name: getattr(buffer, name) for name in ("x", "x_sf", "topk_idx", "topk_weights")}
    t = native.validate_call(shape, y, inputs, l1_weights, l2_weights, shared_l1_weights, shared_l2_weights,
                             check_values=False)
    with native.exclusive(buffer):
        if not isinstance(buffer, native.GcMoeBuffer):
            raise native.not_built_error(what, shape.num_shared_experts, _FACADE_NO_WORKSPACE, shape.mma_type)
        native.ring_plan(buffer, t)
        detail = None if native.missing_role_kernels(shape.num_shared_experts, shape.mma_type) else _SEAM_NO_RUN
        raise native.not_built_error(what, shape.num_shared_experts, detail, shape.mma_type)


def workspace_view(buffer: Any, name: str) -> torch.Tensor:
    """The operator-owned view ``name`` (token ring, L2 activations) of ``buffer``; its layout is the operator's."""
    if isinstance(buffer, native.GcMoeBuffer):
        return buffer.view(name)
    raise NotImplementedError(f"the symmetric buffer's operator workspace view {name!r}: {OPERATOR_MISSING}; "
                              f"{_FACADE_NO_WORKSPACE}")
