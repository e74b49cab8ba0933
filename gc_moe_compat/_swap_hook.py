"""The import hook behind :mod:`gc_moe_compat.swap` (stdlib only: the ``.pth`` imports it at interpreter start).

Kept apart from :mod:`gc_moe_compat.swap` so that ``python -m gc_moe_compat.swap`` (which runs that module as
``__main__``) finds the same, already installed finder instead of a second copy of its class.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
from types import ModuleType

__all__ = ["ENV", "MODULES", "SwapConfigError", "SwapFinder", "install", "installed", "parse", "uninstall"]

ENV = "GC_MOE_SWAP"
MODULES = ("deep_gemm", "deep_ep")
_VALUES = {"": (), "0": (), "1": MODULES, "deep_gemm": ("deep_gemm",), "deep_ep": ("deep_ep",)}
FACADE_PREFIX = "gc_moe_compat."

log = logging.getLogger("gc_moe_compat.swap")


class SwapConfigError(RuntimeError):
    """``GC_MOE_SWAP`` holds a value the swap does not understand."""


def parse(value: str | None) -> tuple[str, ...]:
    """The modules ``value`` swaps; raises SwapConfigError for anything but the documented values."""
    if value is None:
        return ()
    try:
        return _VALUES[value.strip()]
    except KeyError:
        raise SwapConfigError(
            f"{ENV}={value!r} is not a valid value: use 1 (deep_gemm and deep_ep), deep_gemm, deep_ep, or 0 / unset "
            "(off)") from None


class _ExistingModuleLoader(importlib.abc.Loader):
    """Loader that hands the import system an already-imported module (the facade or an original submodule)."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return self.module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module is already executed."""


class SwapFinder(importlib.abc.MetaPathFinder):
    """Meta-path finder mapping ``deep_gemm[.x]`` / ``deep_ep[.x]`` to the facades (first on ``sys.meta_path``)."""

    def __init__(self, swapped: tuple[str, ...], error: SwapConfigError | None = None) -> None:
        self.swapped = swapped
        self.error = error
        self._logged = False

    def find_spec(self, fullname: str, path: object = None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        top = fullname.partition(".")[0]
        if top not in MODULES:
            return None
        if self.error is not None:
            raise self.error
        if top not in self.swapped:
            return None
        module = _resolve(fullname)
        if not self._logged:
            self._logged = True
            log.info("gc_moe_compat.swap (%s=%s): %s", ENV, os.environ.get(ENV, ""),
                     ", ".join(f"{name} -> {FACADE_PREFIX}{name}" for name in self.swapped))
        return importlib.util.spec_from_loader(fullname, _ExistingModuleLoader(module),
                                               is_package=hasattr(module, "__path__"))


def _facade_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(FACADE_PREFIX + name) is not None
    except ModuleNotFoundError:
        return False


def _resolve(fullname: str) -> ModuleType:
    """The module a swapped ``fullname`` stands for: the facade's (every name of :data:`MODULES` has one), else the
    original's submodule."""
    from gc_moe_compat import originals

    top, _, rest = fullname.partition(".")
    if not rest or _facade_exists(fullname):
        return importlib.import_module(FACADE_PREFIX + fullname)
    try:
        originals.load(top)
    except ImportError as exc:
        raise ModuleNotFoundError(f"No module named {fullname!r}: the {FACADE_PREFIX}{top} facade has no {rest!r} "
                                  f"and no original {top} could be loaded ({exc})", name=fullname) from exc
    return importlib.import_module(f"{originals.alias(top)}.{rest}")


def installed() -> SwapFinder | None:
    return next((f for f in sys.meta_path if isinstance(f, SwapFinder)), None)


def install() -> SwapFinder:
    """Put the finder first on ``sys.meta_path`` for the current ``GC_MOE_SWAP`` (idempotent: replaces it)."""
    uninstall()
    try:
        finder = SwapFinder(parse(os.environ.get(ENV)))
    except SwapConfigError as exc:
        finder = SwapFinder((), exc)
    sys.meta_path.insert(0, finder)
    return finder


def uninstall() -> None:
    """Remove the finder (modules already imported stay in ``sys.modules``)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, SwapFinder)]
