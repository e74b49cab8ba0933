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

``python -m gc_moe_compat.swap --check`` prints the variable, what is active and where each module comes from, and
the host path of the ``deep_ep`` facade's calls (compiled, or Python and why: building it if no call has, so a check
before serving also takes the build off the first call).
"""

from __future__ import annotations

import argparse
import importlib
import os
import site
import sys
from pathlib import Path

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

__all__ = ["ENV", "MODULES", "PTH_NAME", "SwapConfigError", "SwapFinder", "check", "install", "installed", "parse",
           "pth_location", "uninstall"]


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


PTH_NAME = "gc_moe_compat_swap.pth"
"""The start-up hook ``pip install`` puts at the top of site-packages (``shims/``)."""


def pth_location() -> str | None:
    """Where this interpreter's site directories hold :data:`PTH_NAME`, or None (the package's install lacks it)."""
    dirs = [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
    return next((str(Path(d) / PTH_NAME) for d in dict.fromkeys(dirs) if d and (Path(d) / PTH_NAME).is_file()), None)


def _hook_line(value: str | None) -> tuple[str, int]:
    """The hook's state as ``--check`` says it, and the exit status (2: a bad value, or a swap asked for that the
    missing ``.pth`` cannot have installed)."""
    finder = installed()
    if finder is not None and finder.error is not None:
        return f"hook: installed, configuration error: {finder.error}", 2
    if finder is not None:
        return f"hook: installed, swapping {', '.join(finder.swapped) or 'nothing'}", 0
    pth = pth_location()
    try:
        asked = parse(value)
    except SwapConfigError as exc:
        asked, bad = (), exc
    else:
        bad = None
    if pth is None and (asked or bad):
        return (f"hook: not installed: {ENV} is set but {PTH_NAME} is missing from site-packages; reinstall the "
                "package into this Python (python -m pip install -e .)"), 2
    if pth is None:
        return (f"off: the real packages load; {PTH_NAME} is missing from site-packages, so {ENV}=1 would not swap "
                "either: reinstall the package into this Python (python -m pip install -e .)"), 0
    return f"off: the real packages load; set {ENV}=1 to swap", 0


def check() -> int:
    """Print the variable, the active swap, each module's source and the ``deep_ep`` facade's host path; 0 when
    consistent, 2 on a bad value (of ``GC_MOE_SWAP`` or ``GC_MOE_DEEP_EP_HOST_PATH``)."""
    value = os.environ.get(ENV)
    print(f"{ENV}={value!r}")
    line, status = _hook_line(value)
    print(line)
    if status:
        return status
    for name in MODULES:
        print(f"{name}: {_describe(name)}")
    line, status = _deep_ep_host_path()
    print(f"deep_ep facade host path: {line}")
    return status


def _deep_ep_host_path() -> tuple[str, int]:
    """``compiled`` or ``python`` and why (:func:`gc_moe_compat.deep_ep._compiled_host.host_path`), and the exit
    status (2: ``GC_MOE_DEEP_EP_HOST_PATH`` has a bad value, which every deep_ep dispatch and combine would raise)."""
    try:
        from gc_moe_compat.deep_ep._compiled_host import host_path
    except ImportError as exc:
        return f"not importable: {exc}", 0
    try:
        report = host_path()
    except ValueError as exc:
        return f"configuration error: {exc}", 2
    return f"{report['host_path']} ({report['reason']})", 0


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
