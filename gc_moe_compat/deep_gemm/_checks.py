"""Argument checks shared by the facade functions: every unsupported value raises, naming the argument.

Two kinds of refusal: ``ValueError`` for a value that DeepGEMM itself rejects (or that makes no sense), and
``NotImplementedError`` for a value DeepGEMM accepts but GC-MoE has no path for (another MMA kind, activation or
feature). Messages start with the facade function and the argument, so a serving log points at the call.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from gc_moe_compat import config
from gc_moe_compat.config import MAX_SMS, MMA_TYPES, MoEShape, boolean, finite_float, integer, recipe

__all__ = ["MAX_SMS", "boolean", "choice", "finite_float", "integer", "moe_shape", "recipe", "routing", "tensor",
           "unsupported_feature"]

# DeepGEMM's names for values GC-MoE does not implement (accepted by some DeepGEMM build, so not a caller bug).
DEEPGEMM_ONLY_MMA_TYPES = ("bf16xbf16", "mxf4xmxf4", "nvfp4xnvfp4")
SUPPORTED_MMA_TYPES = MMA_TYPES
DEEPGEMM_ONLY_ACTIVATIONS = ("swigluoai", "situ")
SUPPORTED_ACTIVATIONS = ("swiglu",)

# config.MoEShape field -> the facade's argument name, so errors name what the caller passed.
_FACADE_NAMES = {
    "capacity": "num_max_tokens_per_rank",
    "intermediate": "intermediate_hidden",
    "topk": "num_topk",
    "num_ranks": "group.size()",
    "num_experts / num_ranks": "num_experts / group.size()",
}
BLOCK_M_NAMES = {**_FACADE_NAMES, "num_ranks": "num_ranks", "num_experts / num_ranks": "num_experts / num_ranks"}
"""The same for ``get_block_m_for_mega_moe``, which takes ``num_ranks`` itself."""


def _among(value: object, options: tuple[object, ...]) -> bool:
    """``value`` equals one of ``options`` of its own kind (so a numpy array or a bool never compares loosely)."""
    return any(isinstance(value, type(o)) and type(value) is not bool and value == o for o in options)


def choice(fn: str, arg: str, value: object, supported: Iterable[object], not_implemented: Iterable[object]) -> None:
    """``value`` must be in ``supported``; a known DeepGEMM-only value raises NotImplementedError; a value of another
    type than the supported ones (a numpy array for a str, say) TypeError; anything else ValueError."""
    supported = tuple(supported)
    if _among(value, supported):
        return
    kinds = tuple({type(o) for o in supported})
    if not isinstance(value, kinds) or isinstance(value, bool):
        names = " or ".join(sorted(k.__name__ for k in kinds))
        raise TypeError(f"{fn}: {arg} must be one of {supported} (a {names}), got {type(value).__name__} "
                        f"({value!r:.80})")
    if _among(value, tuple(not_implemented)):
        raise NotImplementedError(f"{fn}: {arg}={value!r} is a DeepGEMM option GC-MoE does not implement "
                                  f"(supported: {supported})")
    raise ValueError(f"{fn}: {arg} must be one of {supported}, got {value!r}")


def unsupported_feature(fn: str, arg: str, value: object, default: object, what: str) -> None:
    """A DeepGEMM feature GC-MoE lacks: only its default (off) value is accepted. A flag (bool default) must be a
    bool first, so ``'yes'`` is a ``TypeError`` naming the value rather than a request for the missing feature."""
    if isinstance(default, bool):
        boolean(fn, arg, value)
    if value is not default and value != default:
        raise NotImplementedError(f"{fn}: {arg}={value!r} is not supported: GC-MoE has no {what}; "
                                  f"pass {default!r}")


def routing(fn: str, **fields: object) -> None:
    """``config.check_routing(**fields)`` (the routing sizes a buffer accepts) with its errors re-worded in
    ``get_block_m_for_mega_moe``'s argument names (:data:`BLOCK_M_NAMES`)."""
    try:
        config.check_routing(**fields)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        arg, _, rest = str(exc).partition(": ")
        raise type(exc)(f"{fn}: {BLOCK_M_NAMES.get(arg, arg)}: {rest}") from exc


def tensor(fn: str, arg: str, t: object, dtypes: tuple[torch.dtype, ...], ndim: int) -> torch.Tensor:
    """A tensor of one of ``dtypes`` with ``ndim`` dimensions (TypeError for type/dtype, ValueError for rank)."""
    if not isinstance(t, torch.Tensor):
        if t is None:
            raise TypeError(f"{fn}: {arg} must be a torch.Tensor, got None (the views of a destroyed SymmBuffer are "
                            "None)")
        raise TypeError(f"{fn}: {arg} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{fn}: {arg} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{fn}: {arg} must be {ndim}-D, got shape {tuple(t.shape)}")
    return t


def moe_shape(fn: str, **fields: object) -> MoEShape:
    """``config.MoEShape(**fields)`` with its errors re-worded in the facade's argument names."""
    try:
        return MoEShape(**fields)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        arg, _, rest = str(exc).partition(": ")
        raise type(exc)(f"{fn}: {_FACADE_NAMES.get(arg, arg)}: {rest}") from exc
