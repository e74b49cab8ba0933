"""gc-moe-compat: the GC-MoE operator behind DeepEP / DeepGEMM Mega MoE call signatures.

The native API (paper Listing 1, :mod:`gc_moe_compat.operator.api`) is re-exported here::

    from gc_moe_compat import fp8_fp4_gc_moe, get_symm_buffer_for_gc_moe, transform_weights_for_gc_moe

The names resolve on first use (PEP 562): the swap's ``.pth`` hook imports this package at every interpreter start
and must not pull in torch or the operator there.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "GcMoeBuffer",
    "GcMoeWeights",
    "fp8_fp4_gc_moe",
    "fp8_fp8_gc_moe",
    "get_symm_buffer_for_gc_moe",
    "transform_weights_for_gc_moe",
]

if TYPE_CHECKING:
    from gc_moe_compat.operator.api import (
        GcMoeBuffer,
        GcMoeWeights,
        fp8_fp4_gc_moe,
        fp8_fp8_gc_moe,
        get_symm_buffer_for_gc_moe,
        transform_weights_for_gc_moe,
    )


def __getattr__(name: str) -> Any:
    """The native API's names, imported from :mod:`gc_moe_compat.operator.api` when first asked for."""
    if name in __all__:
        return getattr(importlib.import_module("gc_moe_compat.operator.api"), name)
    raise AttributeError(f"module 'gc_moe_compat' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
