"""The deep_ep facade's signatures equal SGLang's pin (committed JSON), and SGLang 0.5.23's DeepEP call sites bind.

The JSON comes from ``scripts/gen_signatures.py`` (``sgl-deep-ep==0.1.2.post1``: ``deep_ep/buffers/legacy.py``'s
``Buffer``, ``deep_ep/utils/event.py``'s ``EventOverlap``). The call sites are read from
``sglang/srt/layers/moe/token_dispatcher/deepep.py`` in the ``sglang==0.5.23`` wheel, fetched from the registry at
test time into ``~/.cache/gc_moe_compat/registry`` by ``tests/kit/sglang_wheel.py`` (skipped, with the reason, only when
the registry cannot be reached and the wheel is not cached). The platform under test is CUDA: branches SGLang takes
only on Ascend NPUs (``_is_npu``) are pruned, each one listed here.
"""

from __future__ import annotations

import ast
import inspect
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import sglang_wheel
import torch.distributed as dist
from signature_kit import (
    Keywords,
    KwargsResolver,
    UnresolvedKwargsError,
    as_records,
    bind_error,
    expected_records,
    positional_count,
)

from gc_moe_compat.deep_ep import Buffer, Config, EventOverlap

SIGNATURES = json.loads((Path(__file__).parents[1] / "data" / "deep_ep_buffer.json").read_text())
PIN = "sgl-deep-ep==0.1.2.post1"
CLASSES = {"Buffer": Buffer, "EventOverlap": EventOverlap}

COMBINE_EXTRAS = ("packed_recv_count", "comp_signal", "block_m", "threshold", "num_sms")
"""Keyword-only parameters the facade's ``low_latency_combine`` has beyond the pin: the names SGLang 0.5.23's Hopper
single-batch-overlap path passes (a DeepEP build other than the pin takes them); all default to None."""

ABSENT: dict[str, str] = {}
"""Methods of the pin's ``Buffer`` the facade intentionally lacks, with the reason."""


def _entry(name: str) -> dict:
    entry = SIGNATURES["names"][name][PIN]
    assert entry is not None and entry["params"] is not None, name
    return entry


def _resolve(name: str) -> tuple[type, str]:
    cls, method = name.split(".")
    return CLASSES[cls], method


PRESENT = sorted(n for n in SIGNATURES["names"] if n not in ABSENT)


def test_json_covers_both_classes_and_absent_names_are_real() -> None:
    names = set(SIGNATURES["names"])
    assert set(ABSENT) <= names  # no stale exemption
    assert {n.split(".")[0] for n in names} == set(CLASSES)
    assert {"Buffer.__init__", "Buffer.low_latency_dispatch", "Buffer.low_latency_combine",
            "Buffer.get_low_latency_rdma_size_hint", "EventOverlap.current_stream_wait"} <= names


@pytest.mark.parametrize("name", sorted(ABSENT))
def test_intentionally_absent(name: str) -> None:
    cls, method = _resolve(name)
    assert not hasattr(cls, method), f"{name} exists now: drop it from ABSENT and let the signature test cover it"


@pytest.mark.parametrize("name", PRESENT)
def test_signature_equals_sglang_pin(name: str) -> None:
    """Same parameter names, kinds, order and defaults (by value and type); the JSON lists ``self`` for instance
    methods, and so does ``inspect.signature`` of the function on the class. Static stays static."""
    cls, method = _resolve(name)
    entry = _entry(name)
    assert isinstance(inspect.getattr_static(cls, method), staticmethod) is entry["static"], name
    ours = as_records(inspect.signature(getattr(cls, method)))
    want = expected_records(entry["params"])
    if name == "Buffer.low_latency_combine":
        assert ours[len(want):] == [(extra, "KEYWORD_ONLY", None) for extra in COMBINE_EXTRAS]
        ours = ours[:len(want)]
    assert ours == want
    for (_, _, default), (_, _, expected) in zip(ours, want, strict=True):
        assert type(default) is type(expected), name


def test_no_public_method_beyond_the_pin() -> None:
    """The facade invents no public API: every public method (and context-manager dunder) is one of the pin's."""
    for cls_name, cls in CLASSES.items():
        for attr, value in vars(cls).items():
            method = callable(inspect.getattr_static(cls, attr)) or isinstance(value, staticmethod)
            if method and (not attr.startswith("_") or attr in ("__init__", "__call__", "__enter__", "__exit__")):
                assert f"{cls_name}.{attr}" in SIGNATURES["names"], f"{cls_name}.{attr}"


def test_class_attributes_equal_the_pin() -> None:
    for name, by_pin in SIGNATURES["attributes"].items():
        cls, attr = _resolve(name)
        want = ast.literal_eval(by_pin[PIN])
        assert getattr(cls, attr) == want and type(getattr(cls, attr)) is type(want), name


# ------------------------------------------------------------------------------------------------------------------
# SGLang 0.5.23 call sites (sglang/srt/layers/moe/token_dispatcher/deepep.py)

DEEPEP = "sglang/srt/layers/moe/token_dispatcher/deepep.py"

NPU_ONLY_BRANCHES = {"dict(topk_weights=topk_weights)": "low_latency_dispatch's topk_weights: Ascend's DeepEP only "
                     "(guarded by `_is_npu and not _use_zbal`); the pin has no such parameter either"}
"""``**(A if test else B)`` branches that run only on Ascend NPUs, pruned on CUDA (the test asserts exactly these)."""

NPU_HELPERS = {"_get_quantization_kwargs": "starts with `if not _is_npu: return {}`",
               "_get_npu_mxfp_quantization_kwargs": "starts with `if not _is_npu: return {}`"}
"""SGLang methods whose returned dict is ``**``-passed; the test checks each returns ``{}`` on CUDA (its first
statement) and binds it as no keywords."""

UNBINDABLE = {("Config.__init__", "config_parsed['normal_dispatch']"): "Config(**config_dispatch): keys of the "
              "user's --deepep-config JSON",
              ("Config.__init__", "config_parsed['normal_combine']"): "Config(**config_combine): keys of the user's "
              "--deepep-config JSON"}
"""Calls whose ``**`` keys come from run-time data, by the expression they come from (the facade's ``Config`` takes
DeepEP's field names as keywords: tests/facades/test_deep_ep_facade.py)."""


@dataclass(frozen=True)
class Site:
    """One way a call site can call: ``target`` (``Class.method``), line, how (``constructor``: ``Cls(...)``,
    ``class``: ``Cls.m(...)``, ``instance``: ``obj.m(...)``), positional count and keyword names."""

    target: str
    line: int
    how: str
    npos: int
    keywords: Keywords


@pytest.fixture(scope="module")
def deepep_tree() -> ast.Module:
    try:
        (source,) = sglang_wheel.read_sources([DEEPEP]).values()
    except sglang_wheel.RegistryUnreachableError as exc:
        pytest.skip(str(exc))
    return ast.parse(source)


def _innermost_functions(tree: ast.Module) -> dict[int, ast.AST]:
    """``id(call) -> `` the innermost function containing it (the module for top-level calls)."""
    scope: dict[int, ast.AST] = {id(n): tree for n in ast.walk(tree) if isinstance(n, ast.Call)}
    for fn in ast.walk(tree):  # breadth first: inner functions come later and overwrite
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            scope.update({id(n): fn for n in ast.walk(fn) if isinstance(n, ast.Call)})
    return scope


def _config_loop_names(scope: ast.AST) -> set[str]:
    """Names bound by ``for name in (X or Buffer.get_dispatch_config(...), ...)``: DeepEP ``Config`` objects."""
    names = set()
    for node in ast.walk(scope):
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name) and isinstance(node.iter, ast.Tuple):
            last = [e.values[-1] if isinstance(e, ast.BoolOp) else e for e in node.iter.elts]
            if last and all(isinstance(e, ast.Call) and ast.unparse(e.func) in
                            ("Buffer.get_dispatch_config", "Buffer.get_combine_config") for e in last):
                names.add(node.target.id)
    return names


def _is_buffer_instance(expr: ast.expr) -> bool:
    return (isinstance(expr, ast.Name) and expr.id == "buffer") or (isinstance(expr, ast.Attribute)
                                                                    and expr.attr == "buffer")


def _classify(call: ast.Call, config_names: set[str]) -> tuple[str, str] | None:
    """``(target, how)`` when ``call`` calls the deep_ep Buffer/Config class or an instance of it."""
    f = call.func
    if isinstance(f, ast.Name) and f.id in ("Buffer", "Config"):
        return f"{f.id}.__init__", "constructor"
    if not isinstance(f, ast.Attribute):
        return None
    if isinstance(f.value, ast.Name) and f.value.id in ("Buffer", "Config"):
        return f"{f.value.id}.{f.attr}", "class"
    if _is_buffer_instance(f.value):
        return f"Buffer.{f.attr}", "instance"
    if isinstance(f.value, ast.Name) and f.value.id in config_names:
        return f"Config.{f.attr}", "instance"
    return None


def _npu_only(test: ast.expr, taken: bool) -> bool:
    """Whether the branch ``taken`` of a conditional on ``test`` runs only when ``_is_npu``."""
    def is_npu(e: ast.expr) -> bool:
        return isinstance(e, ast.Name) and e.id == "_is_npu"

    if taken:
        return is_npu(test) or (isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And)
                                and any(is_npu(v) for v in test.values))
    return isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and is_npu(test.operand)


@dataclass
class _Scan:
    sites: list[Site]
    unbindable: dict[tuple[str, str], str]
    pruned: set[str]
    npu_helpers: set[str]


def _scan(tree: ast.Module) -> _Scan:
    """Every call on a deep_ep ``Buffer`` / ``Config`` (class or instance) with each keyword set it can pass."""
    methods = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    scan = _Scan([], {}, set(), set())

    def branch_possible(ifexp: ast.IfExp, taken: bool) -> bool:
        if _npu_only(ifexp.test, taken):
            scan.pruned.add(ast.unparse(ifexp.body if taken else ifexp.orelse))
            return False
        return True

    def resolve_call(call: ast.Call) -> list[Keywords] | None:
        f = call.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self":
            fn = methods.get(f.attr)
            first = ast.unparse(fn.body[0]) if fn is not None else ""
            if first == "if not _is_npu:\n    return {}":
                scan.npu_helpers.add(f.attr)
                return [frozenset()]
        return None

    scopes = _innermost_functions(tree)
    config_names: dict[int, set[str]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        scope = scopes[id(node)]
        names = config_names.setdefault(id(scope), _config_loop_names(scope))
        found = _classify(node, names)
        if found is None:
            continue
        target, how = found
        resolver = KwargsResolver(scope, branch_possible=branch_possible, resolve_call=resolve_call)
        try:
            alternatives = resolver.call_keywords(node)
        except UnresolvedKwargsError as exc:
            scan.unbindable[(target, exc.text)] = f"line {node.lineno}"
            continue
        npos = positional_count(node)
        scan.sites += [Site(target, node.lineno, how, npos, kw) for kw in alternatives]
    return scan


@pytest.fixture(scope="module")
def scan(deepep_tree: ast.Module) -> _Scan:
    return _scan(deepep_tree)


def _signature(site: Site) -> inspect.Signature:
    cls_name, method = site.target.split(".")
    cls = {"Buffer": Buffer, "Config": Config}[cls_name]
    if site.how == "constructor":
        return inspect.signature(cls)
    static = inspect.getattr_static(cls, method)
    if site.how == "class":
        assert isinstance(static, staticmethod | classmethod), f"line {site.line}: {site.target} called on the class"
    sig = inspect.signature(getattr(cls, method))
    if site.how == "instance" and not isinstance(static, staticmethod | classmethod):
        sig = sig.replace(parameters=list(sig.parameters.values())[1:])  # drop self
    return sig


def test_receivers_are_deep_ep_buffers(deepep_tree: ast.Module) -> None:
    """What the scan treats as a Buffer is one: ``Buffer``/``Config`` come from ``deep_ep`` on CUDA, every local
    ``buffer`` is ``self._get_buffer()`` (which returns ``DeepEPBuffer.get_deepep_buffer(...)``) or a parameter
    annotated ``Buffer``, every ``.buffer`` attribute stored is a ``Buffer(...)``."""
    imports = [n for n in ast.walk(deepep_tree) if isinstance(n, ast.ImportFrom) and n.module == "deep_ep"]
    assert [sorted(a.name for a in n.names) for n in imports] == [["Buffer", "Config"]]
    for node in ast.walk(deepep_tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id == "buffer":
                    assert ast.unparse(node.value) == "self._get_buffer()", node.lineno
                if isinstance(target, ast.Attribute) and target.attr == "buffer":
                    assert isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "Buffer", node.lineno
        if isinstance(node, ast.arg) and node.arg == "buffer":
            assert node.annotation is not None and ast.unparse(node.annotation) == "Buffer", node.lineno
    getters = [ast.unparse(n.body[-1]) for n in ast.walk(deepep_tree)
               if isinstance(n, ast.FunctionDef) and n.name == "_get_buffer"]
    # The base class's raises; the normal and low-latency implementations return the process-wide buffer.
    assert sorted(g.split("(")[0] for g in getters) == [
        "raise NotImplementedError", "return DeepEPBuffer.get_deepep_buffer", "return DeepEPBuffer.get_deepep_buffer"]


def test_sglang_deepep_call_sites_bind(scan: _Scan) -> None:
    failures = []
    for site in scan.sites:
        cls_name, method = site.target.split(".")
        if not hasattr({"Buffer": Buffer, "Config": Config}[cls_name], method):
            failures.append(f"{DEEPEP}:{site.line}: {site.target} does not exist in the facade")
            continue
        error = bind_error(_signature(site), site.npos, site.keywords)
        if error is not None:
            failures.append(f"{DEEPEP}:{site.line}: {site.target}({site.npos} positional, {sorted(site.keywords)}) "
                            f"does not bind: {error}")
    assert not failures, "\n".join(failures)
    assert {s.target for s in scan.sites} == {
        "Buffer.__init__", "Buffer.get_dispatch_config", "Buffer.get_combine_config",
        "Buffer.get_low_latency_rdma_size_hint", "Buffer.capture", "Buffer.clean_low_latency_buffer",
        "Buffer.get_dispatch_layout", "Buffer.dispatch", "Buffer.combine", "Buffer.low_latency_dispatch",
        "Buffer.low_latency_combine", "Config.get_nvl_buffer_size_hint", "Config.get_rdma_buffer_size_hint"}


def test_sglang_deepep_keyword_sets(scan: _Scan) -> None:
    """The enumeration saw SGLang's variants: the Buffer keywords (use_fabric with and without), every optional
    dispatch keyword, the three combine variants (plain, Blackwell and Hopper overlap), and nothing else unresolved."""
    def keyword_sets(target: str) -> set[Keywords]:
        return {s.keywords for s in scan.sites if s.target == target}

    base = frozenset({"low_latency_mode", "num_qps_per_rank", "allow_mnnvl"})
    assert keyword_sets("Buffer.__init__") == {base, base | {"use_fabric"}}
    dispatch = keyword_sets("Buffer.low_latency_dispatch")
    assert len(dispatch) == 8 and frozenset().union(*dispatch) == {
        "use_fp8", "use_nvfp4", "x_global_scale", "async_finish", "return_recv_hook", "round_scale", "use_ue8m0"}
    plain = frozenset({"x", "topk_idx", "topk_weights", "handle", "async_finish", "return_recv_hook"})
    assert keyword_sets("Buffer.low_latency_combine") == {
        plain, plain | {"overlap", "src_signals", "src_signal_expect_value"}, plain | {"overlap", *COMBINE_EXTRAS}}
    assert scan.pruned == set(NPU_ONLY_BRANCHES)
    assert scan.npu_helpers == set(NPU_HELPERS)
    assert set(scan.unbindable) == set(UNBINDABLE)


def test_combine_extras_are_exactly_what_sglang_passes_beyond_the_pin(scan: _Scan) -> None:
    pin = {p["name"] for p in _entry("Buffer.low_latency_combine")["params"]}
    passed = frozenset().union(*(s.keywords for s in scan.sites if s.target == "Buffer.low_latency_combine"))
    assert passed - pin == set(COMBINE_EXTRAS)


def test_sglang_deepep_attribute_reads_exist(deepep_tree: ast.Module, group: dist.ProcessGroup) -> None:
    """Attributes SGLang reads off the class (``Buffer.num_sms``) or an instance (``buffer.group_size``,
    ``state.buffer.low_latency_mode``, methods it inspects) exist on the facade (an instance in normal mode,
    which needs no GPU)."""
    calls = {id(n.func) for n in ast.walk(deepep_tree) if isinstance(n, ast.Call)}
    reads = set()
    for node in ast.walk(deepep_tree):
        if isinstance(node, ast.Attribute) and id(node) not in calls and isinstance(node.ctx, ast.Load):
            if isinstance(node.value, ast.Name) and node.value.id == "Buffer":
                reads.add(("class", node.attr))
            elif _is_buffer_instance(node.value):
                reads.add(("instance", node.attr))
    assert reads == {("class", "num_sms"), ("instance", "group_size"), ("instance", "low_latency_mode"),
                     ("instance", "dispatch"), ("instance", "low_latency_dispatch")}
    instance = Buffer(group, 0, 0, low_latency_mode=False)
    for how, attr in sorted(reads):
        assert hasattr(Buffer if how == "class" else instance, attr), (how, attr)
