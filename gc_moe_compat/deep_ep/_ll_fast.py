"""The compiled host path of the low-latency dispatch and combine (``_ll_fast.cpp``, built at first use).

On an H200 host every call from Python into torch's C++ costs microseconds (``torch.empty`` of a CUDA tensor 7-9 us
from Python, ~2 us as DeepEP's C++ ``at::empty``), and an eager low-latency call makes up to six allocations, a dozen
tensor checks and a dozen ctypes stores of pointers into its packed launch parameters. ``_ll_fast.cpp`` does that
work of a call in one C++ call: given the call's tensors and the record of a call shape that the Python path of
:mod:`gc_moe_compat.deep_ep._low_latency` checked before, it checks every tensor against the record (what the Python
checks accept for that shape, or less), allocates the outputs as the Python path does and stores their addresses into
the shape's ``EpLlParams`` (at the byte offsets of the ctypes fields, passed once here), or returns None at the first
difference, and the Python path then runs its checks, raising its errors: every error message stays in Python.

The extension uses ATen and torch's Python binding only (no CUDA header or library), so it builds on a CPU-only
machine as on a GPU host: torch's ``cpp_extension.load`` (which needs ninja and a C++ compiler) builds it into
``<cache_dir()>/deep_ep_ll_fast/<hash>``, the hash binding its source, torch's version and the interpreter's ABI, so
an edit or an upgrade rebuilds (concurrent ranks: torch's lock file in that folder lets one build). Where it cannot be
built or loaded, the calls take the Python path, and :func:`host_path` keeps the reason (``python -m
gc_moe_compat.swap --check`` prints it). ``GC_MOE_DEEP_EP_HOST_PATH=python`` forces the Python path (an A/B of the
two; read at every call, as the facade's other variables); unset or ``compiled``: the compiled one where it builds.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from gc_moe_compat.comm.ep_ll import EpLlParams
from gc_moe_compat.runtime.jit import cache_dir

__all__ = ["HOST_PATH_ENV", "HOST_PATHS", "SOURCE", "compiled", "host_path"]

HOST_PATH_ENV = "GC_MOE_DEEP_EP_HOST_PATH"
HOST_PATHS = ("compiled", "python")
"""``GC_MOE_DEEP_EP_HOST_PATH``'s values: ``compiled`` (the default) where the extension builds, ``python`` always
the Python path."""
SOURCE = Path(__file__).with_suffix(".cpp")
"""The extension's source (shipped as package data next to this module)."""

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Build:
    """The outcome of the build: the loaded module, or None and why (the exception's type and text)."""

    module: ModuleType | None
    where: Path
    reason: str


def _requested() -> str:
    """``GC_MOE_DEEP_EP_HOST_PATH`` as set now: ``compiled`` (also when unset or empty) or ``python``; another value
    raises ``ValueError`` naming the variable."""
    raw = os.environ.get(HOST_PATH_ENV, "").strip()
    if raw == "":
        return "compiled"
    if raw not in HOST_PATHS:
        raise ValueError(f"{HOST_PATH_ENV}: must be one of {HOST_PATHS} (the deep_ep low-latency host path), got "
                         f"{raw!r}")
    return raw


def _digest() -> str:
    """What names the build: the source, torch's version and location, and the interpreter's ABI tag."""
    identity = f"{torch.__version__}\0{Path(torch.__file__).parent}\0{sys.implementation.cache_tag}\0"
    return hashlib.sha256(identity.encode() + SOURCE.read_bytes()).hexdigest()[:16]


@functools.cache
def _build() -> _Build:
    """Builds (or finds built) and loads the extension, then gives it the ``EpLlParams`` field offsets it stores at;
    once per process. A failure of the build or the import (no compiler or ninja, a compile error, a module built
    for another torch) is kept as the reason for the Python path, and logged once."""
    digest = _digest()
    where = cache_dir() / "deep_ep_ll_fast" / digest
    try:
        from torch.utils import cpp_extension

        where.mkdir(parents=True, exist_ok=True)
        module = cpp_extension.load(name=f"gc_moe_ll_fast_{digest}", sources=[str(SOURCE)],
                                    build_directory=str(where), extra_cflags=["-O2"], with_cuda=False, verbose=False)
    except Exception as exc:  # any failure to build or import means the Python path, with its reason
        reason = f"{type(exc).__name__}: {exc}".strip()
        _log.warning("deep_ep low-latency calls take the Python host path: %s could not be built in %s (%s)",
                     SOURCE.name, where, reason)
        return _Build(None, where, reason)
    module.set_param_offsets({name: _u64_offset(name) for name in module.PARAM_FIELDS}, ctypes.sizeof(EpLlParams))
    return _Build(module, where, "")


def _u64_offset(name: str) -> int:
    """The byte offset of ``EpLlParams.<name>``, a 64-bit field (what the extension stores an address into)."""
    field = getattr(EpLlParams, name)
    if field.size != 8:
        raise TypeError(f"EpLlParams.{name}: the extension stores a 64-bit address there, the field has {field.size} "
                        "bytes")
    return field.offset


def compiled() -> ModuleType | None:
    """The compiled module the calls use now, or None for the Python path (``GC_MOE_DEEP_EP_HOST_PATH=python``, or
    the extension could not be built: :func:`host_path` says why). The first call builds it."""
    if _requested() == "python":
        return None
    return _build().module


def host_path() -> dict[str, str]:
    """Which host path the low-latency calls take now: ``{"host_path": "compiled" | "python", "reason": ...}`` (the
    build folder where compiled; else the variable that forces the Python path, or why the build failed). Builds the
    extension if no call has yet."""
    if _requested() == "python":
        return {"host_path": "python", "reason": f"{HOST_PATH_ENV}=python"}
    build = _build()
    if build.module is None:
        return {"host_path": "python", "reason": f"{SOURCE.name} could not be built in {build.where}: {build.reason}"}
    return {"host_path": "compiled", "reason": f"{SOURCE.name} built in {build.where}"}
