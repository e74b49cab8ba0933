#!/usr/bin/env python3
"""Regenerate the committed signature files of the real ``deep_gemm`` / ``deep_ep`` packages the facades mirror.

What: downloads each pinned package into a temporary directory, reads its Python sources with :mod:`ast` (never
importing them: they need CUDA and a compiled ``_C``) and writes the parameters (name, kind, default as source text)
of the names the facades keep to one JSON file per facade:

* ``tests/data/deep_gemm_mega_moe.json``: every top-level ``deep_gemm.<name>`` of the Mega MoE surface (and the
  ``SymmBuffer`` methods) in ``deepinfer-gemm==2.8.2`` (upstream DeepGEMM 2.8.2, an sdist) and
  ``sgl-deep-gemm==0.2.3.post2`` (SGLang's pin, a wheel), resolving which definition each name is bound to;
* ``tests/data/deep_ep_buffer.json``: every public method (``__init__``, static methods and the context-manager
  dunders included) of ``deep_ep.Buffer`` (the legacy buffer) and ``deep_ep.EventOverlap``, plus their class-level
  attributes, in ``sgl-deep-ep==0.1.2.post1`` (SGLang's pin, a wheel), following ``deep_ep/__init__.py``'s imports to
  the defining modules.

Why: the facades ``gc_moe_compat.deep_gemm`` / ``gc_moe_compat.deep_ep`` must keep these signatures exactly; the
tests compare ``inspect.signature`` with these files, so the third-party code itself is never committed.

How it downloads: wheels with ``pip download --no-deps``. For the sdist, ``pip download`` would run the package's
``setup.py`` to prepare metadata, which imports torch and needs ``CUDA_HOME``; so the sdist is fetched through the
index's PEP 691 JSON API (the same listing pip reads) and checked against the sha256 the index publishes.

Usage: ``python scripts/gen_signatures.py [--only deep_gemm|deep_ep] [--out-dir DIR]`` (needs the PyPI registry).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

INDEX = "https://pypi.org/simple"
DATA_DIR = Path(__file__).resolve().parents[1] / "tests" / "data"

# Top-level ``deep_gemm`` names of the Mega MoE surface (docs/data_contracts.md), plus the class methods callers use.
FUNCTIONS: tuple[str, ...] = (
    "get_symm_buffer_for_mega_moe",
    "get_symm_buffer_for_sm90_mega_moe",
    "transform_weights_for_mega_moe",
    "transform_weights_for_mega_moe_sm90",
    "transform_scales_for_mega_moe",
    "fp8_fp4_mega_moe",
    "fp8_mega_moe",
    "nvfp4_mega_moe",
    "bf16_mega_moe",
    "mega_moe_pre_dispatch",
    "mega_moe_pre_dispatch_sm90",
    "get_block_m_for_mega_moe",
    "transform_sf_into_required_layout",
    "get_num_sms",
    "set_num_sms",
)
METHODS: tuple[str, ...] = ("SymmBuffer.__init__", "SymmBuffer.destroy", "SM90SymmBuffer.__init__")

# ``deep_ep`` classes whose public methods the facade keeps (DeepEP's legacy buffer API, as SGLang's pin ships it).
DEEP_EP_CLASSES: tuple[str, ...] = ("Buffer", "EventOverlap")
# Dunder methods that are part of a class's public use (construction, ``obj(...)``, ``with obj:``).
PUBLIC_DUNDERS = frozenset({"__init__", "__call__", "__enter__", "__exit__"})

Entry = dict[str, object]


@dataclass(frozen=True)
class Package:
    """One pinned distribution: ``kind`` is ``"wheel"`` or ``"sdist"``."""

    dist: str
    version: str
    kind: str

    @property
    def pin(self) -> str:
        return f"{self.dist}=={self.version}"


@dataclass(frozen=True)
class Target:
    """One signature file: the packages it reads, the import package inside them, and how it reads a package.

    ``read(root)`` returns ``(entries, attributes)`` for the sources extracted under ``root``: the signature entry of
    every name it finds and, optionally, class-level attributes (``Class.attr`` -> default source text).
    ``names`` fixes the names written (``null`` where a package lacks one); empty: every name any package has.
    """

    key: str
    out_name: str
    import_package: str
    packages: tuple[Package, ...]
    read: Callable[[Path], tuple[dict[str, Entry], dict[str, str]]]
    names: tuple[str, ...]
    note: str


def _pip_download_wheel(dist: str, version: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(dest),
           f"{dist}=={version}"]
    subprocess.run(cmd, check=True)
    stem = dist.replace("-", "_")
    (wheel,) = [p for p in dest.iterdir() if p.name.startswith(f"{stem}-{version}") and p.suffix == ".whl"]
    return wheel


def _index_download_sdist(dist: str, version: str, dest: Path) -> Path:
    req = urllib.request.Request(f"{INDEX}/{dist}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        files = json.load(resp)["files"]
    name = f"{dist.replace('-', '_')}-{version}.tar.gz"
    (entry,) = [f for f in files if f["filename"] == name]
    path = dest / name
    with urllib.request.urlopen(entry["url"], timeout=300) as resp:
        data = resp.read()
    if hashlib.sha256(data).hexdigest() != entry["hashes"]["sha256"]:
        raise RuntimeError(f"sha256 mismatch for {name}")
    path.write_bytes(data)
    return path


def _extract_package_sources(archive: Path, dest: Path, package: str) -> Path:
    """Extract only ``<package>/**/*.py`` and return the directory that holds ``<package>/``."""
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as zf:
            for member in zf.namelist():
                if member.startswith(f"{package}/") and member.endswith(".py"):
                    zf.extract(member, dest)
        return dest
    with tarfile.open(archive) as tf:
        members = [m for m in tf.getmembers() if f"/{package}/" in m.name and m.name.endswith(".py") and m.isfile()]
        tf.extractall(dest, members=members, filter="data")
    (root,) = {Path(m.name).parts[0] for m in members}
    return dest / root


def _default_text(node: ast.expr | None) -> str | None:
    return None if node is None else ast.unparse(node)


def _params(fn: ast.FunctionDef) -> list[dict[str, str | None]]:
    """Parameters in ``inspect`` order with their ``inspect.Parameter`` kind names and default source text."""
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out: list[dict[str, str | None]] = []
    for i, arg in enumerate(positional):
        kind = "POSITIONAL_ONLY" if i < len(a.posonlyargs) else "POSITIONAL_OR_KEYWORD"
        out.append({"name": arg.arg, "kind": kind, "default": _default_text(defaults[i])})
    if a.vararg:
        out.append({"name": a.vararg.arg, "kind": "VAR_POSITIONAL", "default": None})
    for arg, default in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        out.append({"name": arg.arg, "kind": "KEYWORD_ONLY", "default": _default_text(default)})
    if a.kwarg:
        out.append({"name": a.kwarg.arg, "kind": "VAR_KEYWORD", "default": None})
    return out


def _module_defs(path: Path) -> dict[str, ast.FunctionDef]:
    """Every function reachable from the module's top level (in try blocks too), plus ``Class.method``."""
    defs: dict[str, ast.FunctionDef] = {}

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef):
                defs[node.name] = node
            elif isinstance(node, ast.ClassDef):
                defs.update({f"{node.name}.{m.name}": m for m in node.body if isinstance(m, ast.FunctionDef)})
            elif isinstance(node, ast.Try):
                visit(node.body)

    visit(ast.parse(path.read_text()).body)
    return defs


def _python_entry(root: Path, file: Path, qualname: str, fn: ast.FunctionDef) -> Entry:
    return {"file": str(file.relative_to(root)), "qualname": qualname, "params": _params(fn)}


def _deep_gemm_bindings(root: Path) -> tuple[dict[str, Entry], dict[str, str]]:
    """Resolve what ``deep_gemm.<name>`` is bound to, statement by statement (the last binding wins).

    ``def name`` binds the package's own definition; ``from .mega import name`` binds ``mega/__init__.py``'s;
    ``from ._C import name`` or ``name = _C.name`` binds compiled code, which has no Python signature.
    """
    init = root / "deep_gemm" / "__init__.py"
    mega = root / "deep_gemm" / "mega" / "__init__.py"
    own, mega_defs = _module_defs(init), _module_defs(mega)
    bound: dict[str, Entry] = {}

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Try):
                visit(node.body)
            elif isinstance(node, ast.FunctionDef | ast.ClassDef):
                for key, fn in own.items():
                    if key == node.name or key.startswith(f"{node.name}."):
                        bound[key] = _python_entry(root, init, key, fn)
            elif isinstance(node, ast.ImportFrom) and node.level == 1 and node.module in ("mega", "_C"):
                for alias in node.names:
                    name = alias.asname or alias.name
                    if node.module == "_C":
                        bound[name] = {"file": None, "qualname": f"_C.{alias.name}", "params": None}
                        continue
                    for key, fn in mega_defs.items():
                        if key == alias.name or key.startswith(f"{alias.name}."):
                            bound[name + key[len(alias.name):]] = _python_entry(root, mega, key, fn)
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute):
                value = node.value
                if isinstance(value.value, ast.Name) and value.value.id == "_C":
                    for target in node.targets:
                        if isinstance(target, ast.Name):
                            bound[target.id] = {"file": None, "qualname": f"_C.{value.attr}", "params": None}

    visit(ast.parse(init.read_text()).body)
    return bound, {}


def _exported_from(root: Path, package: str, name: str) -> Path:
    """The module file ``<package>/__init__.py`` imports ``name`` from (``from .a.b import name``; the last wins)."""
    init = root / package / "__init__.py"
    found = None
    for node in ast.walk(ast.parse(init.read_text())):
        if (isinstance(node, ast.ImportFrom) and node.level == 1 and node.module
                and any(alias.name == name and alias.asname in (None, name) for alias in node.names)):
            found = root / package / (node.module.replace(".", "/") + ".py")
    if found is None:
        raise LookupError(f"{init} does not import {name} from a submodule")
    return found


def _class_members(root: Path, package: str, cls: str) -> tuple[dict[str, Entry], dict[str, str]]:
    """The public methods of ``<package>.<cls>`` (``Class.method`` -> entry with ``static``) and its class-level
    attributes with a value (``Class.attr`` -> source text), from the module ``<package>/__init__.py`` takes it from."""
    file = _exported_from(root, package, cls)
    (node,) = [n for n in ast.parse(file.read_text()).body if isinstance(n, ast.ClassDef) and n.name == cls]
    methods: dict[str, Entry] = {}
    attributes: dict[str, str] = {}
    for member in node.body:
        if isinstance(member, ast.FunctionDef) and (not member.name.startswith("_") or member.name in PUBLIC_DUNDERS):
            qualname = f"{cls}.{member.name}"
            static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in member.decorator_list)
            methods[qualname] = {**_python_entry(root, file, qualname, member), "static": static}
        elif isinstance(member, ast.AnnAssign) and isinstance(member.target, ast.Name) and member.value is not None:
            attributes[f"{cls}.{member.target.id}"] = ast.unparse(member.value)
        elif isinstance(member, ast.Assign):
            for target in member.targets:
                if isinstance(target, ast.Name):
                    attributes[f"{cls}.{target.id}"] = ast.unparse(member.value)
    return methods, attributes


def _deep_ep_classes(root: Path) -> tuple[dict[str, Entry], dict[str, str]]:
    methods: dict[str, Entry] = {}
    attributes: dict[str, str] = {}
    for cls in DEEP_EP_CLASSES:
        m, a = _class_members(root, "deep_ep", cls)
        methods.update(m)
        attributes.update(a)
    return methods, attributes


TARGETS: tuple[Target, ...] = (
    Target(
        key="deep_gemm", out_name="deep_gemm_mega_moe.json", import_package="deep_gemm",
        packages=(Package("deepinfer-gemm", "2.8.2", "sdist"), Package("sgl-deep-gemm", "0.2.3.post2", "wheel")),
        read=_deep_gemm_bindings, names=(*FUNCTIONS, *METHODS),
        note="Parameters of each top-level deep_gemm name per package; null: the package has no such name. "
        "params null: bound to compiled _C code (no Python signature).",
    ),
    Target(
        key="deep_ep", out_name="deep_ep_buffer.json", import_package="deep_ep",
        packages=(Package("sgl-deep-ep", "0.1.2.post1", "wheel"),),
        read=_deep_ep_classes, names=(),
        note="Parameters of every public method of deep_ep.Buffer (the legacy buffer) and deep_ep.EventOverlap per "
        "package (static: a staticmethod, no self); attributes: class-level attributes with their value's source "
        "text. Config, EventHandle and topk_idx_t are compiled (_C) and have no Python source.",
    ),
)


def generate(workdir: Path, target: Target) -> dict[str, object]:
    """Download ``target``'s packages into ``workdir`` and return its signature document."""
    sources: dict[str, object] = {}
    found: dict[str, dict[str, Entry]] = {}
    attributes: dict[str, dict[str, str]] = {}
    for pkg in target.packages:
        dl = workdir / f"{pkg.dist}-dl"
        dl.mkdir()
        fetch = _pip_download_wheel if pkg.kind == "wheel" else _index_download_sdist
        archive = fetch(pkg.dist, pkg.version, dl)
        root = _extract_package_sources(archive, workdir / f"{pkg.dist}-src", target.import_package)
        sources[pkg.pin] = {"archive": archive.name, "sha256": hashlib.sha256(archive.read_bytes()).hexdigest()}
        entries, attrs = target.read(root)
        found[pkg.pin] = entries
        for name, text in attrs.items():
            attributes.setdefault(name, {})[pkg.pin] = text
    names = target.names or tuple(dict.fromkeys(n for entries in found.values() for n in entries))
    doc: dict[str, object] = {
        "generated_by": "scripts/gen_signatures.py",
        "note": target.note,
        "sources": sources,
        "names": {name: {pin: entries.get(name) for pin, entries in found.items()} for name in names},
    }
    if attributes:
        doc["attributes"] = attributes
    return doc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=[t.key for t in TARGETS], help="regenerate one file (default: all)")
    parser.add_argument("--out-dir", type=Path, default=DATA_DIR)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for target in TARGETS:
        if args.only not in (None, target.key):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            doc = generate(Path(tmp), target)
        out = args.out_dir / target.out_name
        out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
