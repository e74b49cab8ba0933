"""The compiled host path of the deep_ep facade's calls (``_compiled_host.cpp``, built at first use): the
low-latency dispatch and combine, and the normal mode's dispatch (uncached and cached) and combine.

On an H200 host every call from Python into torch's C++ costs microseconds (``torch.empty`` of a CUDA tensor 7-9 us
from Python, ~2 us as DeepEP's C++ ``at::empty``), and an eager call makes up to six allocations, a dozen tensor
checks and a dozen ctypes stores of pointers into its packed launch parameters. ``_compiled_host.cpp`` does that
work of a call in one C++ call (the uncached normal dispatch: one before notify's launch, one after the CPU wait for
the received count): given the call's tensors and the record of a call shape that the Python path of
:mod:`gc_moe_compat.deep_ep._low_latency` or :mod:`gc_moe_compat.deep_ep._normal` checked before, it checks every
tensor against the record (what the Python checks accept for that shape, or less), allocates the outputs as the Python
path does and stores their addresses into the shape's packed parameters (``EpLlParams`` / ``EpNormalParams``, at the
byte offsets of the ctypes fields, passed once here), or returns None at the first difference, and the Python path
then runs its checks, raising its errors: every error message stays in Python.

The extension uses ATen and torch's Python binding only (no CUDA header or library), so it builds on a CPU-only
machine as on a GPU host: torch's ``cpp_extension.load`` (which needs ninja and a C++ compiler) builds it into
``<cache_dir()>/deep_ep_compiled_host/<hash>``, the hash binding its source, torch's version and the interpreter's
ABI, so an edit or an upgrade rebuilds (concurrent ranks: torch's lock file in that folder lets one build). Where it
cannot be built or loaded, the calls take the Python path, and :func:`host_path` keeps the reason (``python -m
gc_moe_compat.swap --check`` prints it). ``GC_MOE_DEEP_EP_HOST_PATH=python`` forces the Python path of both modes (an
A/B of the two; read at every call, as the facade's other variables); unset or ``compiled``: the compiled one where
it builds.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from gc_moe_compat.comm.ep_ll import EpLlParams
from gc_moe_compat.comm.ep_normal import EpNormalParams
from gc_moe_compat.runtime.jit import cache_dir
from gc_moe_compat.runtime.split import env_choice

__all__ = ["HOST_PATH_ENV", "HOST_PATHS", "PARAM_STRUCTS", "SOURCE", "compiled", "host_path"]

HOST_PATH_ENV = "GC_MOE_DEEP_EP_HOST_PATH"
HOST_PATHS = ("compiled", "python")
"""``GC_MOE_DEEP_EP_HOST_PATH``'s values: ``compiled`` (the default) where the extension builds, ``python`` always
the Python path."""
SOURCE = Path(__file__).with_suffix(".cpp")
"""The extension's source (shipped as package data next to this module)."""
PARAM_STRUCTS: dict[str, type[ctypes.Structure]] = {"EpLlParams": EpLlParams, "EpNormalParams": EpNormalParams}
"""The packed parameter structs the extension stores into, by the name its ``PARAM_FIELDS`` uses."""

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
    return env_choice(HOST_PATH_ENV, "compiled", HOST_PATHS, "the deep_ep facade's host path")


def _digest() -> str:
    """What names the build: the source, torch's version and location, and the interpreter's ABI tag."""
    identity = f"{torch.__version__}\0{Path(torch.__file__).parent}\0{sys.implementation.cache_tag}\0"
    return hashlib.sha256(identity.encode() + SOURCE.read_bytes()).hexdigest()[:16]


@functools.cache
def _build() -> _Build:
    """Builds (or finds built) and loads the extension, then gives it the offsets of the parameter fields it stores
    at; once per process. A failure of the build or the import (no compiler or ninja, a compile error, a module built
    for another torch) is kept as the reason for the Python path, and logged once."""
    digest = _digest()
    where = cache_dir() / "deep_ep_compiled_host" / digest
    try:
        from torch.utils import cpp_extension

        where.mkdir(parents=True, exist_ok=True)
        module = cpp_extension.load(name=f"gc_moe_compiled_host_{digest}", sources=[str(SOURCE)],
                                    build_directory=str(where), extra_cflags=["-O2"], with_cuda=False, verbose=False)
    except Exception as exc:  # any failure to build or import means the Python path, with its reason
        reason = f"{type(exc).__name__}: {exc}".strip()
        _log.warning("deep_ep calls take the Python host path: %s could not be built in %s (%s)", SOURCE.name, where,
                     reason)
        return _Build(None, where, reason)
    for struct, fields in module.PARAM_FIELDS.items():
        params = PARAM_STRUCTS[struct]
        module.set_param_offsets(struct, {name: field_offset(params, name, width) for name, width in fields.items()},
                                 ctypes.sizeof(params))
    return _Build(module, where, "")


def field_offset(params: type[ctypes.Structure], name: str, width: int) -> int:
    """The byte offset of ``params.<name>``, a field of ``width`` bytes (what the extension stores there)."""
    field = getattr(params, name)
    if field.size != width:
        raise TypeError(f"{params.__name__}.{name}: the extension stores {width} bytes there, the field has "
                        f"{field.size}")
    return field.offset


def compiled() -> ModuleType | None:
    """The compiled module the calls use now, or None for the Python path (``GC_MOE_DEEP_EP_HOST_PATH=python``, or
    the extension could not be built: :func:`host_path` says why). The first call builds it."""
    if _requested() == "python":
        return None
    return _build().module


def host_path() -> dict[str, str]:
    """Which host path the deep_ep calls take now: ``{"host_path": "compiled" | "python", "reason": ...}`` (the
    build folder where compiled; else the variable that forces the Python path, or why the build failed). Builds the
    extension if no call has yet."""
    if _requested() == "python":
        return {"host_path": "python", "reason": f"{HOST_PATH_ENV}=python"}
    build = _build()
    if build.module is None:
        return {"host_path": "python", "reason": f"{SOURCE.name} could not be built in {build.where}: {build.reason}"}
    return {"host_path": "compiled", "reason": f"{SOURCE.name} built in {build.where}"}
