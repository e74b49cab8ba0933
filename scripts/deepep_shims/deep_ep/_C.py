# ruff: noqa: N999  (the module is named after DeepEP's compiled extension, deep_ep._C)
"""Shim of DeepEP's compiled ``deep_ep._C`` for its test helpers (scripts/run_deepep_legacy_tests.sh).

DeepEP's ``deep_ep/utils/event.py`` imports ``EventHandle`` from ``_C`` at import time; ``envs.py`` and ``comm.py``
import ``_C`` and call its NCCL / topology functions only from helpers the legacy tests do not call. So this shim
supplies ``EventHandle`` (the facade's) and nothing else: any other name raises ``AttributeError`` naming it.
"""

from gc_moe_compat.deep_ep import EventHandle

__all__ = ["EventHandle"]


def __getattr__(name: str) -> object:
    raise AttributeError(f"deep_ep._C.{name}: the legacy-test shim provides only EventHandle (DeepEP's compiled "
                         "extension is not loaded under GC_MOE_SWAP=deep_ep)")
