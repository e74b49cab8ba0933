"""The import graph of ``gc_moe_compat``: no cycles, every arrow down the layers of DESIGN.md, the core apart from
the references and the tools.

Every ``import`` / ``from ... import`` of the package's own modules counts, at module level or inside a function (a
lazy import is still a dependency). ``from pkg import name`` is an edge to ``pkg.name`` where that is a module, else
to ``pkg``. Layers, bottom to top; a module may import its own layer and the ones below:

numerics (compute_paths, config, quant, layouts) < runtime < comm < operator (heuristics, ring, workspace, weights,
buffer) < operator roles (``operator/sm90``: the layer and one module per role kernel) < operator api < originals <
facades (deep_gemm, deep_ep) < swap < the package's ``__init__`` (its lazy re-export of the native API): the core.
Above it the tools' layer: ``references`` (the FP32 references and workloads, shipped for ``gc-moe-ab``) < ``ab``
(the A/B tool and the compatibility matrix). The core never imports either, the references never import the tools.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from functools import cache
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "gc_moe_compat"
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("numerics", ("gc_moe_compat.compute_paths", "gc_moe_compat.config", "gc_moe_compat.quant",
                  "gc_moe_compat.layouts")),
    ("runtime", ("gc_moe_compat.runtime",)),
    ("comm", ("gc_moe_compat.comm",)),
    ("operator", ("gc_moe_compat.operator",)),
    ("operator roles", ("gc_moe_compat.operator.sm90",)),
    ("operator api", ("gc_moe_compat.operator.api",)),
    ("originals", ("gc_moe_compat.originals",)),
    ("facades", ("gc_moe_compat.deep_gemm", "gc_moe_compat.deep_ep")),
    ("swap", ("gc_moe_compat.swap", "gc_moe_compat._swap_hook")),
    ("package", ("gc_moe_compat",)),
    ("references", ("gc_moe_compat.testing",)),
    ("tools", ("gc_moe_compat.ab",)),
)
CORE = "package"
"""The top layer of the core (numerics .. facades, swap): nothing at or below it imports a layer above it."""


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    """Every module of the package by dotted name."""
    return {module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def _imports(name: str, path: Path, known: Mapping[str, Path]) -> set[str]:
    """The package's own modules that ``name`` (at ``path``) imports anywhere in its body."""
    is_package = path.name == "__init__.py"
    edges = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            edges.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + int(is_package)]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            for alias in node.names:
                edges.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source)
    return {e for e in edges if e in known and e != name}


def import_graph(known: Mapping[str, Path]) -> dict[str, set[str]]:
    return {name: _imports(name, path, known) for name, path in known.items()}


def find_cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a path that starts and ends at the same module, or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for succ in sorted(graph.get(node, ())):
            if state.get(succ) == 1:
                return [*path[path.index(succ):], succ]
            if succ not in state and (found := visit(succ)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def layer_of(name: str) -> int | None:
    """Index of ``name``'s layer in :data:`LAYERS` (the longest matching prefix)."""
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (index, len(prefix))
    if best is None:
        raise AssertionError(f"{name}: in no layer of LAYERS; place it")
    return best[0]


def test_the_package_has_no_import_cycle() -> None:
    cycle = find_cycle(import_graph(modules()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or ())


def test_the_cycle_finder_finds_a_planted_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_graph_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "gc_moe_compat" / "sub"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import x\n")
    (pkg / "a.py").write_text("def f():\n    from gc_moe_compat.sub import b\n")
    (pkg / "b.py").write_text("")
    known = {"gc_moe_compat.sub": pkg / "__init__.py", "gc_moe_compat.sub.a": pkg / "a.py",
             "gc_moe_compat.sub.b": pkg / "b.py"}
    assert import_graph(known) == {"gc_moe_compat.sub": {"gc_moe_compat.sub.a"},
                                   "gc_moe_compat.sub.a": {"gc_moe_compat.sub.b"}, "gc_moe_compat.sub.b": set()}


@pytest.mark.parametrize("name", sorted(modules()))
def test_every_arrow_points_down_the_layers(name: str) -> None:
    own = layer_of(name)
    for target in sorted(import_graph(modules())[name]):
        theirs = layer_of(target)
        assert theirs <= own, (f"{name} ({LAYERS[own][0]}) imports {target} ({LAYERS[theirs][0]}): an arrow up "
                               "the layers")


def test_the_core_never_imports_the_references_or_the_tools() -> None:
    """The rule of DESIGN.md's layers, stated apart: no module of the core (numerics .. facades, swap, the package's
    ``__init__``) imports ``gc_moe_compat.testing`` or ``gc_moe_compat.ab``, at module level or lazily."""
    top = [name for name, _ in LAYERS].index(CORE)
    graph = import_graph(modules())
    core = [name for name in graph if layer_of(name) <= top]
    assert len(core) > 40 and "gc_moe_compat.operator.api" in core and "gc_moe_compat.testing.reference" not in core
    bad = [f"{name} imports {target}" for name in sorted(core) for target in sorted(graph[name])
           if layer_of(target) > top]
    assert not bad, "the core imports the tools' layer:\n" + "\n".join(bad)
    assert any(layer_of(t) == top + 1 for t in graph["gc_moe_compat.ab.run"])  # the tools do use the references
