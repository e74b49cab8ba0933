"""The facade's signatures equal DeepGEMM's (committed JSON), and SGLang 0.5.23's deep_gemm call sites bind to them.

The JSON comes from ``scripts/gen_signatures.py`` (``deepinfer-gemm==2.8.2`` and ``sgl-deep-gemm==0.2.3.post2``).
The SGLang wheel is fetched from the registry at test time into ``~/.cache/gc_moe_compat/registry`` by
``tests/kit/sglang_wheel.py`` (skipped, with the reason, only when the registry cannot be reached).
"""

from __future__ import annotations

import ast
import inspect
import json
from pathlib import Path

import pytest
import sglang_wheel
from signature_kit import KwargsResolver, as_records, bind_error, expected_records, positional_count

import gc_moe_compat.deep_gemm as facade

SIGNATURES = json.loads((Path(__file__).parents[1] / "data" / "deep_gemm_mega_moe.json").read_text())
SGL_PIN = "sgl-deep-gemm==0.2.3.post2"
UPSTREAM = "deepinfer-gemm==2.8.2"


def _ours(name: str) -> inspect.Signature:
    obj = facade
    for part in name.split("."):
        obj = getattr(obj, part)
    return inspect.signature(obj)


OTHER_VERSIONS_SPELLINGS = {"mega_moe_pre_dispatch": ("use_fp4_acts",)}
"""Keyword-only parameters the facade adds after the pin's: another original version's spelling of an argument
(sgl-project/DeepGEMM dev names the activation kind ``use_fp4_acts``), accepted where it does not conflict."""


def _python_entries(name: str) -> dict[str, list[dict]]:
    return {pin: e["params"] for pin, e in SIGNATURES["names"][name].items() if e and e["params"] is not None}


@pytest.mark.parametrize("name", sorted(SIGNATURES["names"]))
def test_name_exists_in_facade(name: str) -> None:
    obj = facade
    for part in name.split("."):
        obj = getattr(obj, part)
    assert callable(obj)


@pytest.mark.parametrize("name", sorted(n for n in SIGNATURES["names"] if _python_entries(n)))
def test_signature_equals_sglang_pin_and_extends_upstream(name: str) -> None:
    entries = _python_entries(name)
    signature = _ours(name)
    extra = OTHER_VERSIONS_SPELLINGS.get(name, ())
    assert [p.name for p in signature.parameters.values() if p.kind is p.KEYWORD_ONLY] == list(extra)
    ours = as_records(signature.replace(parameters=[p for p in signature.parameters.values() if p.name not in extra]))
    if "." in name:  # a method: drop ``self``
        entries = {pin: params[1:] for pin, params in entries.items()}
        ours = ours[1:] if ours and ours[0][0] == "self" else ours
    # The union of both packages is SGLang's pin where it has the name (a superset of upstream), else upstream.
    reference = entries.get(SGL_PIN, entries.get(UPSTREAM))
    assert ours == expected_records(reference)
    for params in entries.values():  # every package's parameters are a prefix of ours (same names, order, defaults)
        assert ours[: len(params)] == expected_records(params)
    for (_, _, default), (_, _, want) in zip(ours, expected_records(reference), strict=True):
        assert type(default) is type(want)


def test_compiled_names_take_deepgemm_arguments() -> None:
    """``get_num_sms``/``set_num_sms`` are compiled in both packages: no arguments / one positional."""
    assert SIGNATURES["names"]["set_num_sms"][SGL_PIN]["params"] is None
    assert len(_ours("get_num_sms").parameters) == 0
    _ours("set_num_sms").bind(132)


def test_sglang_hopper_gate_attributes() -> None:
    assert hasattr(facade, "fp8_mega_moe") and hasattr(facade, "mega_moe_pre_dispatch_sm90")


# ------------------------------------------------------------------------------------------------------------------
# SGLang 0.5.23 call sites


@pytest.fixture(scope="module")
def sglang_sources() -> dict[str, str]:
    try:
        return sglang_wheel.read_sources()
    except sglang_wheel.RegistryUnreachableError as exc:
        pytest.skip(str(exc))


def _deep_gemm_calls(source: str) -> list[tuple[str, int, int, frozenset[str]]]:
    """Every call of a ``deep_gemm`` function: (name, line, positional count, keyword names), one entry per set of
    keyword names the call can pass.

    Names come from ``import deep_gemm [as m]`` (``m.name(...)``), ``from deep_gemm import name [as n]`` and a
    parameter named ``deep_gemm``, scoped to the function they appear in; ``**d`` is resolved to the keys ``d`` can
    hold (:class:`signature_kit.KwargsResolver`).
    """
    tree = ast.parse(source)
    calls = []
    scopes = [tree] + [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    for scope in scopes:
        module_aliases, direct = set(), {}
        body_nodes = scope.body if scope is tree else list(ast.walk(scope))
        for node in body_nodes:
            if isinstance(node, ast.Import):
                module_aliases |= {a.asname or a.name for a in node.names if a.name == "deep_gemm"}
            elif isinstance(node, ast.ImportFrom) and node.module == "deep_gemm":
                direct.update({a.asname or a.name: a.name for a in node.names})
        if scope is not tree:  # SGLang also passes the module around as a parameter named ``deep_gemm``
            module_aliases |= {a.arg for a in scope.args.args if a.arg == "deep_gemm"}
        if scope is tree or not (module_aliases or direct):
            continue
        resolver = KwargsResolver(scope)
        for node in ast.walk(scope):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in module_aliases:
                name = f.attr
            elif isinstance(f, ast.Name) and f.id in direct:
                name = direct[f.id]
            else:
                continue
            npos = positional_count(node)
            calls += [(name, node.lineno, npos, keywords) for keywords in resolver.call_keywords(node)]
    return sorted(set(calls), key=lambda c: (c[0], c[1], c[2], sorted(c[3])))


def test_sglang_call_sites_bind(sglang_sources: dict[str, str]) -> None:
    seen = set()
    for path, source in sglang_sources.items():
        for name, line, npos, keywords in _deep_gemm_calls(source):
            seen.add(name)
            error = bind_error(inspect.signature(getattr(facade, name)), npos, keywords)
            if error is not None:
                pytest.fail(f"{path}:{line}: deep_gemm.{name}({npos} positional, {sorted(keywords)}) does not bind: "
                            f"{error}")
    assert {"fp8_mega_moe", "mega_moe_pre_dispatch_sm90", "fp8_fp4_mega_moe", "get_symm_buffer_for_mega_moe",
            "get_block_m_for_mega_moe", "transform_sf_into_required_layout", "transform_weights_for_mega_moe",
            "get_num_sms", "set_num_sms", "mega_moe_pre_dispatch"} <= seen
