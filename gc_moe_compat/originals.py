"""The real ``deep_gemm`` / ``deep_ep``, loadable in the same process as the swapped facades (for A/B runs).

``load(name)`` finds the installed package with the path-based finder only (so the swap's meta-path hook, which
maps ``deep_gemm`` to the facade, is bypassed) and executes it under the alias ``gc_moe_compat.originals.<name>``.
Both DeepGEMM builds import their own submodules and ``_C`` relatively, so they load unchanged under the alias.
When the swap is off and the real package is already imported as ``<name>``, that module is returned as is.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["ALIAS_PREFIX", "NAMES", "MissingOriginalError", "alias", "forwarder", "load", "location"]

NAMES = ("deep_gemm", "deep_ep")
ALIAS_PREFIX = "gc_moe_compat.originals."

# A failed load is remembered: feature probes (``hasattr``) must not re-execute a broken package on every call.
_failures: dict[str, ImportError] = {}


def alias(name: str) -> str:
    """The ``sys.modules`` key the original ``name`` is loaded under."""
    return ALIAS_PREFIX + name


def _check(name: str) -> None:
    if name not in NAMES:
        raise ValueError(f"originals: name must be one of {NAMES}, got {name!r}")


def location(name: str) -> str | None:
    """``__init__.py`` of the installed original ``name`` on ``sys.path``, or None when there is none."""
    _check(name)
    spec = importlib.machinery.PathFinder.find_spec(name)
    if spec is None or spec.origin is None or not spec.submodule_search_locations:
        return None
    return spec.origin


def _already_imported(name: str) -> ModuleType | None:
    """``sys.modules[name]`` when it is the real package (not the facade the swap put there)."""
    module = sys.modules.get(name)
    if module is None or module.__name__.startswith("gc_moe_compat."):
        return None
    return module


def load(name: str) -> ModuleType:
    """Import the original ``name`` (once; later calls return the same module).

    Raises ImportError naming the package when none is installed or when it fails to load (for example a compiled
    extension built against another torch or driver); the cause is chained. A failure is cached for the process.
    """
    _check(name)
    key = alias(name)
    if key in sys.modules:
        return sys.modules[key]
    if name in _failures:
        raise _failures[name]
    module = _already_imported(name)
    if module is not None:
        return module
    origin = location(name)
    if origin is None:
        _failures[name] = ImportError(f"no original {name} package is installed on sys.path", name=name)
        raise _failures[name]
    spec = importlib.util.spec_from_file_location(key, origin, submodule_search_locations=[os.path.dirname(origin)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:
        for loaded in [k for k in sys.modules if k == key or k.startswith(key + ".")]:
            del sys.modules[loaded]
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        error = ImportError(f"the original {name} at {origin} failed to load: {type(exc).__name__}: {exc}",
                            name=name, path=origin)
        _failures[name] = error
        raise error from exc
    return module


class MissingOriginalError(AttributeError):
    """A facade name outside the facade's surface was touched and no original package could be loaded.

    An ``AttributeError`` on purpose: callers probe these modules with ``hasattr`` / ``getattr(..., None)`` and must
    see "absent", not crash.
    """


def forwarder(name: str, surface: str, providers: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for facade ``name``: names outside the facade come from the original, loaded on first
    use; without one, :class:`MissingOriginalError` names the symbol, the ``surface`` it is not part of and the
    ``providers`` (packages) that have it."""
    _check(name)

    def forward(attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(f"module 'gc_moe_compat.{name}' has no attribute {attr!r}")
        try:
            original = load(name)
        except ImportError as exc:
            raise MissingOriginalError(
                f"{name}.{attr} is not part of gc-moe-compat's {surface} facade and no original {name} could be "
                f"loaded to forward it to ({exc}); it is provided by {providers}", name=attr, obj=None) from exc
        return getattr(original, attr)

    return forward
