"""Compile, cache and load the CUDA sources under ``kernels/`` for ``sm_90a``.

A cubin's cache key binds the compiler identity (nvcc path, ``nvcc --version``, nvcc and ptxas hashes), the content
of the source and of every header it includes (``#include "..."`` resolved recursively inside ``kernels/``), the
defines (template / constexpr parameters) and the whitelisted options. Cubins live under ``GC_MOE_CACHE_DIR``
(default ``~/.cache/gc_moe_compat``), written through a temporary file and ``os.replace`` so that ranks compiling
the same kernel at once never read a partial file. ``ptxas -v``'s resource report is kept next to each cubin.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.resources
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cuda.bindings import driver

from .cuda import call, device, init_driver

ARCH_FLAG = "-gencode=arch=compute_90a,code=sm_90a"
_BASE_FLAGS = ("-cubin", ARCH_FLAG, "-std=c++17", "-O3", "-Xptxas", "-v")
_KEY_SCHEMA = 2  # 2: the report keeps the compiler's warnings and coded ptxas notes

#: User options nvcc may receive; anything else (e.g. ``-rdc``, ``-G``, another ``-arch``) is rejected.
ALLOWED_OPTIONS: tuple[re.Pattern[str], ...] = tuple(
    re.compile(p)
    for p in (
        r"-lineinfo",
        r"--use_fast_math",
        r"--extra-device-vectorization",
        r"-maxrregcount=\d{1,3}",
        r"-Xptxas=-O[0-3]",
        r"-Xptxas=--warn-on-spills",
    )
)
_DIAGNOSTIC = re.compile(r"\(C\d{4}\)")  # ptxas's coded performance notes, e.g. "(C7511) ... wgmma ... serialized"
_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)
_DEFINE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DEFINE_VALUE = re.compile(r"-?[A-Za-z0-9_.]+")

DefineValue = int | bool | str


class JitError(RuntimeError):
    """nvcc failed or a source cannot be resolved; the message carries nvcc's output."""


def kernels_root() -> Path:
    """The directory of the installed ``gc_moe_compat.kernels`` package (``kernels/`` in the repository)."""
    root = importlib.resources.files("gc_moe_compat.kernels")
    path = Path(str(root))
    if not path.is_dir():
        raise JitError(f"gc_moe_compat.kernels is not a directory on disk: {root!r}")
    return path


def cache_dir() -> Path:
    """``GC_MOE_CACHE_DIR`` or ``$XDG_CACHE_HOME/gc_moe_compat`` (default ``~/.cache/gc_moe_compat``)."""
    explicit = os.environ.get("GC_MOE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gc_moe_compat"


def find_nvcc() -> Path:
    """nvcc to use: ``GC_MOE_NVCC`` > ``$CUDA_HOME/bin/nvcc`` > ``nvcc`` on PATH > ``/usr/local/cuda/bin/nvcc``."""
    candidates = [os.environ.get("GC_MOE_NVCC")]
    if os.environ.get("CUDA_HOME"):
        candidates.append(str(Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc"))
    candidates += [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    raise JitError("nvcc not found: set GC_MOE_NVCC or CUDA_HOME, or put nvcc on PATH")


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class CompilerIdentity:
    """What makes two compilers interchangeable for the cache: path, version text and binary hashes."""

    nvcc_path: str
    nvcc_version: str
    nvcc_sha256: str
    ptxas_path: str
    ptxas_sha256: str


@functools.cache
def compiler_identity(nvcc: Path | None = None) -> CompilerIdentity:
    """The identity record of ``nvcc`` (default :func:`find_nvcc`); computed once per process."""
    nvcc = (nvcc or find_nvcc()).resolve()
    version = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=True).stdout.strip()
    ptxas = shutil.which("ptxas", path=str(nvcc.parent)) or shutil.which("ptxas") or ""
    return CompilerIdentity(
        nvcc_path=str(nvcc),
        nvcc_version=version,
        nvcc_sha256=_sha256_file(nvcc),
        ptxas_path=ptxas,
        ptxas_sha256=_sha256_file(Path(ptxas)) if ptxas else "",
    )


def validate_options(options: Sequence[str]) -> tuple[str, ...]:
    """Returns ``options`` if every one is whitelisted (:data:`ALLOWED_OPTIONS`); raises ``ValueError`` otherwise."""
    for option in options:
        if not any(p.fullmatch(option) for p in ALLOWED_OPTIONS):
            allowed = [p.pattern for p in ALLOWED_OPTIONS]
            raise ValueError(f"nvcc option {option!r} is not allowed (whitelist: {allowed})")
    return tuple(options)


def define_flags(defines: Mapping[str, DefineValue]) -> tuple[str, ...]:
    """``-DNAME=VALUE`` flags in sorted order; names must be identifiers and values plain tokens."""
    flags = []
    for name in sorted(defines):
        value = defines[name]
        text = str(int(value)) if isinstance(value, bool) else str(value)
        if not _DEFINE_NAME.fullmatch(name) or not _DEFINE_VALUE.fullmatch(text):
            raise ValueError(f"define {name}={text!r} is not an identifier = token pair")
        flags.append(f"-D{name}={text}")
    return tuple(flags)


def included_sources(source: Path, root: Path) -> list[Path]:
    """``source`` and every header it includes with ``#include "..."``, recursively, all inside ``root``.

    A quoted include resolves against the including file's directory, then ``root``; a miss raises
    :class:`JitError` (angle-bracket includes are the toolkit's and are covered by the compiler identity).
    """
    root = root.resolve()
    seen: dict[Path, None] = {}
    pending = [source.resolve()]
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        if root not in path.parents:
            raise JitError(f"{path} is outside the kernel tree {root}")
        seen[path] = None
        for name in _INCLUDE.findall(path.read_text()):
            for base in (path.parent, root):
                candidate = (base / name).resolve()
                if candidate.is_file():
                    pending.append(candidate)
                    break
            else:
                raise JitError(f'{path}: #include "{name}" not found in {path.parent} or {root}')
    return sorted(seen)


def cache_key(
    source: Path,
    defines: Mapping[str, DefineValue],
    options: Sequence[str],
    identity: CompilerIdentity,
    root: Path | None = None,
) -> str:
    """The cubin cache key (hex sha256) of compiling ``source`` with ``defines`` and ``options``."""
    root = (root or kernels_root()).resolve()
    contents = {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in included_sources(source, root)
    }
    record = {
        "schema": _KEY_SCHEMA,
        "compiler": dataclasses.asdict(identity),
        "flags": list(_BASE_FLAGS),
        "source": str(source.resolve().relative_to(root)),
        "contents": contents,
        "defines": list(define_flags(defines)),
        "options": list(validate_options(options)),
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class KernelResources:
    """ptxas's report for one kernel."""

    registers: int
    shared_bytes: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas_report(text: str) -> dict[str, KernelResources]:
    """Per-kernel resources from ``ptxas -v`` output (entry name -> :class:`KernelResources`)."""
    report: dict[str, KernelResources] = {}
    current: str | None = None
    frame = (0, 0, 0)
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            current, frame = m.group(1), (0, 0, 0)
        elif current and (m := _FRAME.search(line)):
            frame = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
        elif current and (m := _USED.search(line)):
            smem = _SMEM.search(line)
            report[current] = KernelResources(
                registers=int(m.group(1)),
                shared_bytes=int(smem.group(1)) if smem else 0,
                stack_bytes=frame[0],
                spill_stores=frame[1],
                spill_loads=frame[2],
            )
            current = None
    return report


@dataclass(frozen=True)
class Cubin:
    """A compiled (or cached) cubin: its key, file, ptxas resource report, and the compiler's warning lines and
    coded ptxas notes (for example C7511 / C7519: WGMMAs serialized or a warpgroup.arrive injected)."""

    key: str
    path: Path
    resources: dict[str, KernelResources]
    from_cache: bool
    warnings: tuple[str, ...] = ()


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _resolve_source(source: str | Path, root: Path) -> Path:
    path = Path(source)
    path = path if path.is_absolute() else root / path
    if not path.is_file():
        raise JitError(f"kernel source {source} not found under {root}")
    return path


def compile_cubin(
    source: str | Path,
    defines: Mapping[str, DefineValue] | None = None,
    options: Sequence[str] = (),
    root: Path | None = None,
) -> Cubin:
    """Compiles ``source`` (relative to ``kernels/``) for sm_90a, or returns the cached cubin of the same key."""
    root = (root or kernels_root()).resolve()
    defines = dict(defines or {})
    path = _resolve_source(source, root)
    identity = compiler_identity()
    key = cache_key(path, defines, options, identity, root)
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"{path.stem}-{key[:40]}"
    cubin_path, report_path = directory / f"{stem}.cubin", directory / f"{stem}.json"
    if cubin_path.is_file() and report_path.is_file():
        report = json.loads(report_path.read_text())
        return Cubin(key, cubin_path, _resources(report), from_cache=True, warnings=tuple(report["warnings"]))
    with tempfile.TemporaryDirectory(dir=directory, prefix=".build-") as tmp:
        out = Path(tmp) / "out.cubin"
        cmd = [
            identity.nvcc_path,
            *_BASE_FLAGS,
            f"-I{root}",
            *define_flags(defines),
            *validate_options(options),
            "-o",
            str(out),
            str(path),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise JitError(f"nvcc failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
        resources = parse_ptxas_report(proc.stdout + proc.stderr)
        warnings = tuple(line.strip() for line in (proc.stdout + proc.stderr).splitlines()
                         if "warning" in line.lower() or _DIAGNOSTIC.search(line))
        report = {"key": key, "command": cmd, "warnings": list(warnings),
                  "kernels": {name: dataclasses.asdict(r) for name, r in resources.items()}}
        _atomic_write(report_path, json.dumps(report, indent=1).encode())
        _atomic_write(cubin_path, out.read_bytes())
    return Cubin(key, cubin_path, resources, from_cache=False, warnings=warnings)


def _resources(report: dict) -> dict[str, KernelResources]:
    return {name: KernelResources(**r) for name, r in report["kernels"].items()}


@dataclass(frozen=True)
class Kernel:
    """A kernel of a loaded library: ``handle`` is a context-independent ``CUkernel``."""

    name: str
    module_key: str
    handle: driver.CUkernel
    resources: KernelResources | None


class Module:
    """A cubin loaded with ``cuLibraryLoadData`` (context-independent; kept for the life of the process)."""

    def __init__(self, cubin: Cubin) -> None:
        init_driver()
        self.cubin = cubin
        self._image = cubin.path.read_bytes()
        self.library = call(driver.cuLibraryLoadData, self._image, None, None, 0, None, None, 0)
        self._kernels: dict[str, Kernel] = {}

    @property
    def key(self) -> str:
        return self.cubin.key

    def kernel(self, name: str) -> Kernel:
        """The kernel ``name`` (an ``extern "C"`` entry point)."""
        if name not in self._kernels:
            handle = call(driver.cuLibraryGetKernel, self.library, name.encode())
            self._kernels[name] = Kernel(name, self.key, handle, self.cubin.resources.get(name))
        return self._kernels[name]


_modules: dict[str, Module] = {}
_modules_lock = threading.Lock()


def load_module(
    source: str | Path,
    defines: Mapping[str, DefineValue] | None = None,
    options: Sequence[str] = (),
) -> Module:
    """Compiles (or finds in the cache) and loads ``source``; one :class:`Module` per key per process."""
    cubin = compile_cubin(source, defines, options)
    with _modules_lock:
        module = _modules.get(cubin.key)
        if module is None:
            module = _modules[cubin.key] = Module(cubin)
        return module


def load_kernel(source: str | Path, defines: Mapping[str, DefineValue], name: str, *, shared_bytes: int,
                ordinal: int) -> Kernel:
    """The kernel ``name`` of ``source`` compiled with ``defines`` (:func:`load_module`), opted into ``shared_bytes``
    of dynamic shared memory on device ``ordinal``: a kernel that uses more than the default 48 KiB must be before
    it is launched or put in a graph. The opt-in is a per-device attribute of the (cached, shared) kernel, so it is
    set on every call: the variants of one module may need different amounts."""
    kernel = load_module(source, defines).kernel(name)
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    call(driver.cuKernelSetAttribute, attr, shared_bytes, kernel.handle, device(ordinal))
    return kernel
