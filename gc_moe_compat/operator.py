"""The GC-MoE operator's entry points: the one seam every facade calls to run the operator.

The SM90 operator (issue 5: kernels, green-context roles, graph, workspace) is not built yet. Until it is, each
entry point raises ``NotImplementedError`` naming what is missing, so a facade that validated its arguments never
falls back to something that only pretends to be the kernel. Issue 5 replaces the bodies, not the signatures.
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch

__all__ = ["OPERATOR_MISSING", "mega_moe", "workspace_view"]

OPERATOR_MISSING = "the GC-MoE SM90 operator (issue 5) is not built yet"


def _missing(what: str) -> NoReturn:
    raise NotImplementedError(f"{what}: {OPERATOR_MISSING}; nothing ran")


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
    """Run one layer: dispatch the tokens staged in ``buffer``, both grouped GEMMs, combine into ``y`` in place."""
    _missing("running the Mega MoE layer")


def workspace_view(buffer: Any, name: str) -> torch.Tensor:
    """The operator-owned view ``name`` (token ring, L2 activations) of ``buffer``; its layout is the operator's."""
    _missing(f"the symmetric buffer's operator workspace view {name!r}")
