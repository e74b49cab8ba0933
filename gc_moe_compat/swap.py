"""The environment-variable swap: ``import deep_gemm`` / ``import deep_ep`` resolve to gc-moe-compat's facades.

``GC_MOE_SWAP``: unset, empty or ``0``: off. ``1``: both modules. ``deep_gemm`` or ``deep_ep``: that one only.
The ``.pth`` file installed with the package (``shims/gc_moe_compat_swap.pth``) installs the hook
(:mod:`gc_moe_compat._swap_hook`) at interpreter start when the variable is set to anything but ``0``; otherwise it
does one ``os.environ`` lookup and imports nothing. So every process of the environment, SGLang's workers included,
is covered.

Behaviour:

* A swapped module and its submodules come from its facade where the facade has them (:mod:`gc_moe_compat.deep_gemm`:
  ``deep_gemm``, ``deep_gemm.mega``; :mod:`gc_moe_compat.deep_ep`: ``deep_ep``); other submodules are the real
  package's, loaded by :mod:`gc_moe_compat.originals`, which also keeps the originals importable for A/B. Names
  outside a facade are forwarded to the original; without one they raise ``MissingOriginalError`` (an
  ``AttributeError``) naming the package that provides them.
* A bad value does not break interpreters that never touch the two packages (pip, tools): importing ``deep_gemm``
  or ``deep_ep`` then raises :class:`SwapConfigError` (a RuntimeError, so an ``except ImportError`` probe cannot
  silently fall back to the original), and ``--check`` reports it with exit status 2.
* The first swapped import logs one line (logger ``gc_moe_compat.swap``, INFO) naming what is replaced.

``python -m gc_moe_compat.swap --check`` prints the variable, what is active and where each module comes from.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from gc_moe_compat._swap_hook import (
    ENV,
    FACADE_PREFIX,
    MODULES,
    SwapConfigError,
    SwapFinder,
    install,
    installed,
    parse,
    uninstall,
)

__all__ = ["ENV", "MODULES", "SwapConfigError", "SwapFinder", "check", "install", "installed", "parse", "uninstall"]


def _describe(name: str) -> str:
    """Where ``import name`` would come from in this process."""
    from gc_moe_compat import originals

    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        return f"not importable: {exc}"
    source = getattr(module, "__file__", None)
    original = originals.location(name)
    if module.__name__.startswith(FACADE_PREFIX):
        return f"GC-MoE facade {module.__name__} ({source}); original: {original or 'not installed'}"
    return f"original ({source})"


def check() -> int:
    """Print the variable, the active swap and each module's source; 0 when consistent, 2 on a bad value."""
    value = os.environ.get(ENV)
    finder = installed()
    print(f"{ENV}={value!r}")
    if finder is None:
        print("hook: not installed (variable unset/0 at interpreter start, or the .pth is missing)")
    elif finder.error is not None:
        print(f"hook: installed, configuration error: {finder.error}")
        return 2
    else:
        print(f"hook: installed, swapping {', '.join(finder.swapped) or 'nothing'}")
    for name in MODULES:
        print(f"{name}: {_describe(name)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gc_moe_compat.swap", description="GC-MoE import swap.")
    parser.add_argument("--check", action="store_true", help="print what is active and where each module comes from")
    args = parser.parse_args(argv)
    if not args.check:
        parser.print_help()
        return 0
    return check()


if __name__ == "__main__":
    sys.exit(main())
