#!/usr/bin/env python3
"""Regenerate ``tests/data/deep_gemm_mega_moe.json`` from the public DeepGEMM packages.

What: downloads ``deepinfer-gemm==2.8.2`` (upstream DeepGEMM 2.8.2, an sdist) and ``sgl-deep-gemm==0.2.3.post2``
(SGLang's pin, a wheel) into a temporary directory, reads their Python sources with :mod:`ast` (never importing
them: both need CUDA and a compiled ``_C``), resolves which definition each top-level ``deep_gemm.<name>`` is bound
to, and writes the parameters (name, kind, default as source text) of every Mega MoE name to one JSON file.

Why: the facade ``gc_moe_compat.deep_gemm`` must keep these signatures exactly; the tests compare
``inspect.signature`` with this file, so the third-party code itself is never committed.

How it downloads: the wheel with ``pip download --no-deps``. For the sdist, ``pip download`` would run the package's
``setup.py`` to prepare metadata, which imports torch and needs ``CUDA_HOME``; so the sdist is fetched through the
index's PEP 691 JSON API (the same listing pip reads) and checked against the sha256 the index publishes.

Usage: ``python scripts/gen_signatures.py [--out PATH]`` (needs the PyPI registry).
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
from pathlib import Path

INDEX = "https://pypi.org/simple"
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "deep_gemm_mega_moe.json"

# (distribution, version, kind): kind "sdist" or "wheel".
PACKAGES: tuple[tuple[str, str, str], ...] = (
    ("deepinfer-gemm", "2.8.2", "sdist"),
    ("sgl-deep-gemm", "0.2.3.post2", "wheel"),
)

# Top-level ``deep_gemm`` names of the Mega MoE surface (API_SURFACE.md), plus the class methods callers use.
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
METHODS: tuple[str, ...] = ("SymmBuffer.__init__", "SymmBuffer.destroy")


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


def _extract_package_sources(archive: Path, dest: Path) -> Path:
    """Extract only ``deep_gemm/**/*.py`` and return the directory that holds ``deep_gemm/``."""
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as zf:
            for member in zf.namelist():
                if member.startswith("deep_gemm/") and member.endswith(".py"):
                    zf.extract(member, dest)
        return dest
    with tarfile.open(archive) as tf:
        members = [m for m in tf.getmembers() if "/deep_gemm/" in m.name and m.name.endswith(".py") and m.isfile()]
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


def _top_level_bindings(root: Path) -> dict[str, dict[str, object]]:
    """Resolve what ``deep_gemm.<name>`` is bound to, statement by statement (the last binding wins).

    ``def name`` binds the package's own definition; ``from .mega import name`` binds ``mega/__init__.py``'s;
    ``from ._C import name`` or ``name = _C.name`` binds compiled code, which has no Python signature.
    """
    init = root / "deep_gemm" / "__init__.py"
    mega = root / "deep_gemm" / "mega" / "__init__.py"
    own, mega_defs = _module_defs(init), _module_defs(mega)
    bound: dict[str, dict[str, object]] = {}

    def python(name: str, file: Path, fn: ast.FunctionDef) -> dict[str, object]:
        return {"file": str(file.relative_to(root)), "qualname": name, "params": _params(fn)}

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Try):
                visit(node.body)
            elif isinstance(node, ast.FunctionDef | ast.ClassDef):
                for key, fn in own.items():
                    if key == node.name or key.startswith(f"{node.name}."):
                        bound[key] = python(key, init, fn)
            elif isinstance(node, ast.ImportFrom) and node.level == 1 and node.module in ("mega", "_C"):
                for alias in node.names:
                    name = alias.asname or alias.name
                    if node.module == "_C":
                        bound[name] = {"file": None, "qualname": f"_C.{alias.name}", "params": None}
                        continue
                    for key, fn in mega_defs.items():
                        if key == alias.name or key.startswith(f"{alias.name}."):
                            bound[name + key[len(alias.name):]] = python(key, mega, fn)
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute):
                value = node.value
                if isinstance(value.value, ast.Name) and value.value.id == "_C":
                    for target in node.targets:
                        if isinstance(target, ast.Name):
                            bound[target.id] = {"file": None, "qualname": f"_C.{value.attr}", "params": None}

    visit(ast.parse(init.read_text()).body)
    return bound


def generate(workdir: Path) -> dict[str, object]:
    """Download both packages into ``workdir`` and return the signature document."""
    sources: dict[str, object] = {}
    names: dict[str, dict[str, object]] = {name: {} for name in (*FUNCTIONS, *METHODS)}
    for dist, version, kind in PACKAGES:
        dl = workdir / f"{dist}-dl"
        dl.mkdir()
        fetch = _pip_download_wheel if kind == "wheel" else _index_download_sdist
        archive = fetch(dist, version, dl)
        root = _extract_package_sources(archive, workdir / f"{dist}-src")
        pin = f"{dist}=={version}"
        sources[pin] = {"archive": archive.name, "sha256": hashlib.sha256(archive.read_bytes()).hexdigest()}
        bound = _top_level_bindings(root)
        for name in names:
            names[name][pin] = bound.get(name)
    return {
        "generated_by": "scripts/gen_signatures.py",
        "note": "Parameters of each top-level deep_gemm name per package; null: the package has no such name. "
        "params null: bound to compiled _C code (no Python signature).",
        "sources": sources,
        "names": names,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        doc = generate(Path(tmp))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
