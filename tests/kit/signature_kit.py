"""Helpers the signature tests share (``test_deep_gemm_signatures``, ``test_deep_ep_signatures``).

* The committed signature files (``tests/data/*.json``, written by ``scripts/gen_signatures.py``) as records
  comparable with ``inspect.signature``: ``(name, kind, default)``, defaults compared by value
  (``ast.literal_eval`` of the recorded source text).
* The keyword names a call site in SGLang's source passes, with its ``**`` expressions resolved statically
  (:class:`KwargsResolver`): a dict literal, ``dict(k=...)``, a conditional ``A if c else B`` (both branches, unless
  the caller says a branch cannot happen on our platform), or a local name (every value it is assigned in the
  function, with the keys later stored into it by ``name["k"] = ...`` optionally added). What cannot be resolved
  raises :class:`UnresolvedKwargsError`, so a test never binds a call with keywords silently dropped.
"""

from __future__ import annotations

import ast
import inspect
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

Record = tuple[str, str, object]
Keywords = frozenset[str]


def as_records(sig: inspect.Signature) -> list[Record]:
    """``(name, kind name, default)`` of every parameter, in order."""
    return [(p.name, p.kind.name, p.default) for p in sig.parameters.values()]


def expected_records(params: list[dict]) -> list[Record]:
    """The records of a signature file's parameter list (``default`` null: no default)."""
    empty = inspect.Parameter.empty
    return [(p["name"], p["kind"], empty if p["default"] is None else ast.literal_eval(p["default"])) for p in params]


class UnresolvedKwargsError(LookupError):
    """A ``**`` expression (or a starred positional) whose keys cannot be determined from the source."""

    def __init__(self, node: ast.AST, why: str) -> None:
        super().__init__(f"line {getattr(node, 'lineno', '?')}: {ast.unparse(node)}: {why}")
        self.text = ast.unparse(node)


def positional_count(call: ast.Call) -> int:
    """How many positional arguments ``call`` passes (a ``*args`` makes it unknowable)."""
    for arg in call.args:
        if isinstance(arg, ast.Starred):
            raise UnresolvedKwargsError(arg, "a starred positional argument has no static length")
    return len(call.args)


def _product(parts: Iterable[list[Keywords]]) -> list[Keywords]:
    out = {frozenset().union(*combo) for combo in itertools.product(*parts)}
    return sorted(out, key=sorted)


@dataclass
class KwargsResolver:
    """Resolves the keyword names of calls inside one function ``scope``.

    ``branch_possible(ifexp, taken)``: whether the branch ``taken`` (True: the body) of the conditional expression
    ``ifexp`` can run on the platform under test (default: both can). ``resolve_call(call)``: the key sets a call
    used as ``**call(...)`` (or assigned to a name used so) can return, or None when unknown (default: only
    ``dict(...)`` is known).
    """

    scope: ast.AST
    branch_possible: Callable[[ast.IfExp, bool], bool] = field(default=lambda ifexp, taken: True)
    resolve_call: Callable[[ast.Call], list[Keywords] | None] = field(default=lambda call: None)

    def call_keywords(self, call: ast.Call) -> list[Keywords]:
        """Every set of keyword names ``call`` can pass (explicit keywords plus one alternative per ``**``)."""
        parts = [[frozenset(k.arg for k in call.keywords if k.arg is not None)]]
        parts += [self.alternatives(k.value) for k in call.keywords if k.arg is None]
        return _product(parts)

    def alternatives(self, expr: ast.expr) -> list[Keywords]:
        """The key sets the mapping expression ``expr`` can hold."""
        if isinstance(expr, ast.Dict):
            parts: list[list[Keywords]] = []
            for key, value in zip(expr.keys, expr.values, strict=True):
                if key is None:
                    parts.append(self.alternatives(value))
                elif isinstance(key, ast.Constant) and isinstance(key.value, str):
                    parts.append([frozenset({key.value})])
                else:
                    raise UnresolvedKwargsError(expr, "a dict key that is not a string literal")
            return _product(parts)
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "dict":
            if expr.args:
                raise UnresolvedKwargsError(expr, "dict() built from a positional argument")
            return self.call_keywords(expr)
        if isinstance(expr, ast.IfExp):
            branches = [(expr.body, True), (expr.orelse, False)]
            out = [alt for branch, taken in branches if self.branch_possible(expr, taken)
                   for alt in self.alternatives(branch)]
            if not out:
                raise UnresolvedKwargsError(expr, "neither branch can run")
            return sorted(set(out), key=sorted)
        if isinstance(expr, ast.Call):
            found = self.resolve_call(expr)
            if found is None:
                raise UnresolvedKwargsError(expr, "a call whose returned keys are unknown")
            return found
        if isinstance(expr, ast.Name):
            return self._name_alternatives(expr)
        raise UnresolvedKwargsError(expr, f"a {type(expr).__name__} expression")

    def _name_alternatives(self, name: ast.Name) -> list[Keywords]:
        values: list[ast.expr] = []
        added: set[str] = set()
        for node in ast.walk(self.scope):
            if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name) and target.id == name.id:
                        values.append(node.value)
                    elif (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name)
                          and target.value.id == name.id):
                        if not (isinstance(target.slice, ast.Constant) and isinstance(target.slice.value, str)):
                            raise UnresolvedKwargsError(target, "a key that is not a string literal")
                        added.add(target.slice.value)
        if not values:
            raise UnresolvedKwargsError(name, "not assigned in the calling function")
        optional = [[frozenset(), frozenset({key})] for key in sorted(added)]
        return _product([sorted({a for v in values for a in self.alternatives(v)}, key=sorted), *optional])


def bind_error(sig: inspect.Signature, npos: int, keywords: Iterable[str]) -> str | None:
    """None when ``npos`` positional arguments and ``keywords`` bind to ``sig``, else the binding's error."""
    try:
        sig.bind(*[object()] * npos, **dict.fromkeys(keywords, object()))
    except TypeError as exc:
        return str(exc)
    return None
