"""Every tensor the shipped code allocates names its device and dtype (the project's mission, issue 18).

The library must work under the caller's torch defaults: DeepEP's own test harness calls
``torch.set_default_device('cuda')``, engines set a default dtype. A torch factory without ``device=`` follows the
default device (a host table or a pinned mirror lands on the GPU, ``pin_memory`` then fails); one without ``dtype=``
follows the default dtype. So an AST walk over ``gc_moe_compat/`` (not ``testing/``, the tools' FP32 references)
finds every call of a factory, multi-line calls included, and requires both keywords, neither the literal ``None`` nor a
parameter of the enclosing function that defaults to ``None`` and is never reassigned (that ``None`` reaches the
factory, which then takes the default after all).

Factories: the constructors torch's default device applies to (``torch.utils._device``), called as an attribute of
``torch`` or of a module imported from it (``symm_mem.empty``), or by a name imported from torch. Exempt, because they
inherit device and dtype from a tensor, which no torch default replaces: ``torch.*_like(t, ...)`` (from ``t``) and the
``t.new_*(...)`` methods (from ``t``). ``torch.from_numpy`` / ``torch.frombuffer`` always give a host tensor of the
source's dtype and take no ``device=``: not factories here. A ``*_like`` whose fill value should set another dtype
than its argument's is a review matter, not this test's.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "gc_moe_compat"
FACTORIES = frozenset({
    "arange", "as_tensor", "asarray", "bartlett_window", "blackman_window", "empty", "empty_permuted",
    "empty_quantized", "empty_strided", "eye", "full", "hamming_window", "hann_window", "kaiser_window", "linspace",
    "logspace", "nested_tensor", "ones", "rand", "randint", "randn", "randperm", "range", "scalar_tensor",
    "sparse_bsc_tensor", "sparse_bsr_tensor", "sparse_compressed_tensor", "sparse_coo_tensor", "sparse_csc_tensor",
    "sparse_csr_tensor", "tensor", "tril_indices", "triu_indices", "zeros",
})
"""torch's default-device constructors (``torch.utils._device._device_constructors``, torch 2.13), by name."""
KEYWORDS = ("device", "dtype")


def _torch_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """``(modules, factories)``: names bound to torch or a module/object imported from it, and names bound to a
    factory imported from torch (``from torch import zeros``)."""
    modules, factories = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch" or alias.name.startswith("torch."):
                    modules.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            for alias in node.names:
                (factories if alias.name in FACTORIES else modules).add(alias.asname or alias.name)
    return modules, factories


def _factory(call: ast.Call, modules: set[str], factories: set[str]) -> str | None:
    """The factory ``call`` invokes, spelled as in the source, or None."""
    func = call.func
    if isinstance(func, ast.Attribute) and func.attr in FACTORIES and isinstance(func.value, ast.Name) \
            and func.value.id in modules:
        return f"{func.value.id}.{func.attr}"
    if isinstance(func, ast.Name) and func.id in factories:
        return func.id
    return None


def _none_parameters(func: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """Parameters of ``func`` that default to ``None`` and are never reassigned in its body."""
    args = func.args
    positional = [*args.posonlyargs, *args.args]
    pairs = [*zip(positional[len(positional) - len(args.defaults):], args.defaults, strict=True),
             *((a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None)]
    names = {a.arg for a, d in pairs if isinstance(d, ast.Constant) and d.value is None}
    stored = {n.id for n in ast.walk(func) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return names - stored


def _problem(call: ast.Call, none_params: set[str]) -> str | None:
    """What ``call`` (a factory call) fails to name, or None."""
    given = {k.arg: k.value for k in call.keywords if k.arg is not None}
    missing = [k for k in KEYWORDS if k not in given]
    if missing:
        return "names no " + " and no ".join(f"{k}=" for k in missing)
    for k in KEYWORDS:
        v = given[k]
        if isinstance(v, ast.Constant) and v.value is None:
            return f"passes {k}=None (torch's default)"
        if isinstance(v, ast.Name) and v.id in none_params:
            return f"passes {k}={v.id}, a parameter that defaults to None (torch's default)"
    return None


def violations(source: str, filename: str) -> list[str]:
    """``filename:line: call problem`` for every factory call in ``source`` without an explicit device and dtype."""
    tree = ast.parse(source, filename)
    modules, factories = _torch_names(tree)
    none_params: dict[int, set[str]] = {}  # id(call) -> the None-default parameters of the functions around it
    for func in ast.walk(tree):
        if isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            params = _none_parameters(func)
            for node in ast.walk(func):
                if isinstance(node, ast.Call):
                    none_params.setdefault(id(node), set()).update(params)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (name := _factory(node, modules, factories)):
            problem = _problem(node, none_params.get(id(node), set()))
            if problem:
                found.append((node.lineno, f"{filename}:{node.lineno}: {name}(...) {problem}"))
    return [msg for _, msg in sorted(found)]


def shipped_sources() -> list[Path]:
    """The core's and the tools' modules: every ``.py`` of the package except ``testing/``."""
    return [p for p in sorted(PACKAGE_DIR.rglob("*.py")) if "testing" not in p.relative_to(PACKAGE_DIR).parts[:-1]]


def test_every_shipped_allocation_names_device_and_dtype() -> None:
    sources = shipped_sources()
    assert len(sources) > 30 and PACKAGE_DIR / "comm" / "ep_ll.py" in sources
    assert not any("testing" in p.relative_to(PACKAGE_DIR).parts for p in sources)
    found = [v for p in sources for v in violations(p.read_text(), str(p.relative_to(PACKAGE_DIR.parent)))]
    assert not found, "allocations that follow torch's default device or dtype:\n" + "\n".join(found)


PLANTED = '''
import torch
import torch as T
from torch import zeros
from torch.distributed import _symmetric_memory as symm_mem


def host_table(n, device=None, dtype=None, other=None):
    a = torch.zeros(4, dtype=torch.uint8, pin_memory=True)
    b = T.arange(
        n,
        device="cpu",
    )
    c = zeros(n, device="cpu", dtype=torch.int32)
    d = symm_mem.empty(n, dtype=torch.uint8)
    e = torch.tensor([1.0], device=None, dtype=torch.float32)
    f = torch.empty(n, device=device, dtype=torch.int64)
    g = torch.full((n,), 1, device="cpu", dtype=dtype)
    if other is None:
        other = "cpu"
    ok = [torch.zeros_like(a), torch.full_like(a, 7), a.new_zeros(3), torch.ones(n, device=other, dtype=T.int8),
          torch.empty(n, device=a.device, dtype=a.dtype), torch.from_numpy(n), torch.cat([a, a])]
    return a, b, c, d, e, f, g, ok
'''


def test_the_check_finds_each_planted_allocation() -> None:
    """Missing keywords (one or both, a multi-line call, an aliased module, a name imported from torch, a module
    imported from torch), a literal None and a None-default parameter are found; inheriting calls, explicit
    calls and a None default that is reassigned first are not."""
    assert violations(PLANTED, "planted.py") == [
        "planted.py:9: torch.zeros(...) names no device=",
        "planted.py:10: T.arange(...) names no dtype=",
        "planted.py:15: symm_mem.empty(...) names no device=",
        "planted.py:16: torch.tensor(...) passes device=None (torch's default)",
        "planted.py:17: torch.empty(...) passes device=device, a parameter that defaults to None (torch's default)",
        "planted.py:18: torch.full(...) passes dtype=dtype, a parameter that defaults to None (torch's default)",
    ]
