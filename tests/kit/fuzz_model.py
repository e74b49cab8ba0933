"""The model of valid inputs the fuzz suite (tests/fuzz/) checks every public entry point against.

Each scalar argument of an entry point has a :data:`Spec`: the rule its value must meet, written here independently
of the library's checks. :func:`expect` says what a call with that value must do (``None``: accept; else the
exception type it must raise, naming the argument), and :func:`values` draws values for it: valid ones, the boundaries
of the rule on both sides, and junk of every other kind (None, bools, huge and negative ints, NaN / inf, strings,
numpy scalars and arrays, 0-d tensors). Tensor arguments have a :class:`Tensor` rule (dtype, shape, device,
layout), handles an :class:`Items` rule (their kind, then a :class:`Tensor` rule per member), and :func:`values`
draws tensors by mutating a valid one (another dtype, a dimension more or less, an extent off by one, the meta
device, a strided or misaligned view). :func:`check` runs one call and asserts the model's verdict: a refusal of
the right type whose message names the argument, or an acceptance (the call returns, or reaches the launch
boundary the caller names: a CPU host stops there with its "needs the GPU" error).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from hypothesis import strategies as st

FP32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class Int:
    """A Python int (not bool) in ``[lo, hi]`` (``hi`` None: unbounded) that is a multiple of ``multiple`` and meets
    ``extra`` (a rule on the value given the baseline, e.g. divides E); ``draw_max`` caps the valid values drawn
    (large accepted sizes would allocate for real)."""

    lo: int
    hi: int | None
    multiple: int = 1
    extra: Callable[[int], bool] | None = None
    draw_max: int | None = None


@dataclass(frozen=True)
class Flag:
    """A bool (or None where the original's default is None)."""

    none_ok: bool = False
    refused: tuple[object, ...] = ()  # bools that are well-typed but refused (ValueError / NotImplementedError)
    refused_with: type[Exception] = ValueError


@dataclass(frozen=True)
class Choice:
    """One of ``options`` (same type); ``not_implemented``: values of an original that GC-MoE refuses as
    NotImplementedError; another type is a TypeError, another value of the type a ValueError. ``exact_type``:
    the library compares loosely within the type family (a numpy str equals a str)."""

    options: tuple[object, ...]
    not_implemented: tuple[object, ...] = ()


@dataclass(frozen=True)
class Real:
    """A finite int or float (not bool; numpy float64 is a float); ``positive``: > 0; ``at_least_zero``: >= 0, the
    float +inf included; ``fp32``: finite in FP32; ``none_ok``: None accepted."""

    positive: bool = False
    fp32: bool = False
    none_ok: bool = False
    at_least_zero: bool = False


@dataclass(frozen=True)
class Recipe:
    """A tuple or list of ints equal to ``value`` (another type or non-int members: TypeError)."""

    value: tuple[int, ...]
    not_implemented: tuple[tuple[int, ...], ...] = ()
    non_tuple_error: type[Exception] = TypeError


@dataclass(frozen=True)
class Instance:
    """An instance of ``kinds`` (``none_ok``: or None), e.g. an event; another type: TypeError. ``examples``: valid
    instances to draw."""

    kinds: type | tuple[type, ...]
    examples: tuple[object, ...]
    none_ok: bool = False


@dataclass(frozen=True)
class Tensor:
    """A ``torch.Tensor`` of one of ``dtypes`` with ``shape`` (None: any extent) on ``device``; ``dense``: also
    contiguous and, with ``vectors`` (read by the kernels' vector accesses), 16-byte aligned; ``extra``: a rule on
    the tensor (e.g. a row width in bytes); ``none_ok``: None accepted. Another type: TypeError; another dtype, shape,
    device, layout, or ``extra`` not met: ValueError."""

    dtypes: tuple[torch.dtype, ...]
    shape: tuple[int | None, ...]
    device: str = "cpu"
    dense: bool = True
    vectors: bool = True
    extra: Callable[[torch.Tensor], bool] | None = None
    none_ok: bool = False


@dataclass(frozen=True)
class TensorOrPair:
    """DeepEP's ``bias``: None, a tensor meeting ``member``, or a tuple of two, each None or such a tensor. Another
    type (a list included): TypeError; a tuple of another length: ValueError."""

    member: Tensor


@dataclass(frozen=True)
class Items:
    """A handle: an instance of ``kind`` (a tuple subclass) with one member per rule of ``items`` (another type, a
    plain tuple included: TypeError; another length: ValueError; a member judged by its :class:`Tensor` rule)."""

    kind: type
    items: tuple[Tensor, ...]
    make: Callable[[tuple[object, ...]], object] = tuple  # builds a ``kind`` from members (what _handles draws)


Spec = Int | Flag | Choice | Real | Recipe | Instance | Tensor | TensorOrPair | Items
NEEDS_GPU = "needs the GPU"
"""What the launch boundary of a call on a host stand-in says (a CPU host has no kernels to run)."""


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def expect(spec: Spec, v: object) -> type[Exception] | None:
    """What a call with value ``v`` must do under ``spec``: None (accept) or the exception type."""
    if isinstance(spec, Int):
        if not _is_int(v):
            return TypeError
        if v < spec.lo or (spec.hi is not None and v > spec.hi) or v % spec.multiple:
            return ValueError
        return ValueError if spec.extra is not None and not spec.extra(v) else None
    if isinstance(spec, Flag):
        if v is None and spec.none_ok:
            return None
        if not isinstance(v, bool):
            return TypeError
        return spec.refused_with if v in spec.refused else None
    if isinstance(spec, Choice):
        kinds = {type(o) for o in spec.options}
        same_kind = isinstance(v, tuple(kinds)) and not isinstance(v, bool)
        if same_kind and any(v == o for o in spec.options):
            return None
        if same_kind and any(v == o for o in spec.not_implemented):
            return NotImplementedError
        return TypeError if not same_kind else ValueError
    if isinstance(spec, Real):
        if v is None and spec.none_ok:
            return None
        if isinstance(v, bool) or not isinstance(v, int | float):
            return TypeError
        if spec.at_least_zero and isinstance(v, float) and v == math.inf:
            return None
        f = math.inf if _is_int(v) and abs(v) > 10**308 else float(v)
        if not math.isfinite(f) or (spec.positive and f <= 0) or (spec.at_least_zero and f < 0) or (
                spec.fp32 and abs(f) > FP32_MAX):
            return ValueError
        return None
    if isinstance(spec, Recipe):
        if isinstance(v, tuple | list) and tuple(v) in spec.not_implemented:
            return NotImplementedError
        if not isinstance(v, tuple | list):
            return spec.non_tuple_error
        if not all(_is_int(x) for x in v):
            return TypeError
        return None if tuple(v) == spec.value else ValueError
    if isinstance(spec, Instance):
        return None if (v is None and spec.none_ok) or isinstance(v, spec.kinds) else TypeError
    if isinstance(spec, Tensor):
        return _expect_tensor(spec, v)
    if isinstance(spec, TensorOrPair):
        if v is None:
            return None
        if isinstance(v, torch.Tensor):
            return _expect_tensor(spec.member, v)
        if not isinstance(v, tuple):
            return TypeError
        if len(v) != 2:
            return ValueError
        member = Tensor(**{**vars(spec.member), "none_ok": True})
        return next((e for e in (_expect_tensor(member, b) for b in v) if e is not None), None)
    if isinstance(spec, Items):
        if not isinstance(v, spec.kind):
            return TypeError
        if len(v) != len(spec.items):
            return ValueError
        return next((e for e in (_expect_tensor(r, t) for r, t in zip(spec.items, v, strict=True)) if e is not None),
                    None)
    raise AssertionError(spec)


def _expect_tensor(spec: Tensor, v: object) -> type[Exception] | None:
    if v is None and spec.none_ok:
        return None
    if not isinstance(v, torch.Tensor):
        return TypeError
    if v.dtype not in spec.dtypes or v.dim() != len(spec.shape) or any(
            s is not None and s != d for s, d in zip(spec.shape, v.shape, strict=True)):
        return ValueError
    if v.device != torch.device(spec.device):
        return ValueError
    if spec.dense and (not v.is_contiguous() or (spec.vectors and v.numel() and v.data_ptr() % 16)):
        return ValueError
    return ValueError if spec.extra is not None and not spec.extra(v) else None


JUNK = st.sampled_from([
    None, True, False, 0, -1, 1.5, math.nan, math.inf, -math.inf, 10**400, -(10**400), "", "1", "fp8xfp4",
    np.int64(3), np.float32(1.0), np.float64(2.0), np.str_("swiglu"), np.array("fp8xfp4"), np.array([1, 2]),
    torch.tensor(3), torch.tensor(1.0), (128, 128), [1, 1, 32], (1, 1, 16), 2**63, 2**64 + 5,
])


def values(spec: Spec) -> st.SearchStrategy[object]:
    """Values for ``spec``: valid, boundary and junk, so both verdicts are drawn often."""
    if isinstance(spec, Int):
        top = spec.hi if spec.draw_max is None else min(spec.hi or spec.draw_max, spec.draw_max)
        valid = st.integers(spec.lo, max(spec.lo, top)).map(lambda v: v - v % spec.multiple or spec.multiple)
        edges = [spec.lo - 1, spec.lo, spec.lo + spec.multiple - 1, top, top + 1, -spec.multiple]
        if spec.hi is not None:
            edges += [spec.hi + 1, spec.hi + spec.multiple]
        return st.one_of(valid, st.sampled_from(edges), JUNK)
    if isinstance(spec, Flag):
        return st.one_of(st.booleans(), JUNK)
    if isinstance(spec, Choice):
        return st.one_of(st.sampled_from(spec.options + spec.not_implemented), st.text(max_size=12), JUNK)
    if isinstance(spec, Real):
        return st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10**6, 10**6),
                         st.sampled_from([FP32_MAX, 1e39, -1e39, 5e-324, 0.0, -0.0]), JUNK)
    if isinstance(spec, Recipe):
        near = st.lists(st.sampled_from([0, 1, 16, 32, 128, -1]), min_size=2, max_size=3).map(tuple)
        return st.one_of(st.just(spec.value), st.just(list(spec.value)), near, JUNK)
    if isinstance(spec, Instance):
        return st.one_of(st.sampled_from(spec.examples), JUNK)
    if isinstance(spec, Tensor):  # tensors twice as often as junk (None among it)
        return st.one_of(_tensors(spec), _tensors(spec), JUNK)
    if isinstance(spec, TensorOrPair):
        member = st.one_of(st.none(), _tensors(spec.member))
        return st.one_of(st.none(), _tensors(spec.member), st.tuples(member, member),
                         st.lists(member, min_size=1, max_size=3).flatmap(lambda m: st.sampled_from([m, tuple(m)])),
                         JUNK)
    if isinstance(spec, Items):
        return _handles(spec)
    raise AssertionError(spec)


def draw(specs: dict[str, Spec], drawn: dict[str, st.SearchStrategy[object]] | None = None
         ) -> st.SearchStrategy[tuple[str, object]]:
    """``(argument, value)``: an argument of ``specs`` (each as often) and a value drawn for it by :func:`values`, or
    by ``drawn[argument]`` where the test draws its own (one argument of a valid baseline replaced per example)."""
    drawn = drawn or {}
    return st.sampled_from(sorted(specs)).flatmap(
        lambda name: (drawn[name] if name in drawn else values(specs[name])).map(lambda v: (name, v)))


DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.int32,
          torch.int64, torch.uint8, torch.bool)
FREE_EXTENTS = (8, 0, 1, 3, 4, 32, 256)
"""Extents drawn where a rule leaves one free (None): zero, odd, and the widths the kernels' row rules test."""


def _make(shape: tuple[int, ...], dtype: torch.dtype, how: str) -> torch.Tensor:
    """A zero-filled tensor of ``shape`` and ``dtype``: ``dense``, ``meta`` (another device), ``strided`` (a view of
    every other column of a wider tensor) or ``misaligned`` (a view one element into a larger allocation)."""
    if how == "meta":
        return torch.zeros(shape, dtype=dtype, device="meta")
    if how == "strided" and shape:
        return torch.zeros((*shape[:-1], 2 * shape[-1]), dtype=dtype, device="cpu")[..., ::2]
    if how == "misaligned":
        n = math.prod(shape)
        return torch.zeros(n + 1, dtype=dtype, device="cpu")[1:].view(shape)
    return torch.zeros(shape, dtype=dtype, device="cpu")


@st.composite
def _tensors(draw: st.DrawFn, spec: Tensor) -> torch.Tensor:
    """A tensor of the rule's form (free extents drawn), then at most one mutation of dtype, rank, extent or
    layout (none 4 times in 10), so valid tensors and each kind of invalid one are all drawn often."""
    shape = [draw(st.sampled_from(FREE_EXTENTS)) if s is None else s for s in spec.shape]
    dtype = draw(st.sampled_from(spec.dtypes))
    mutation = draw(st.sampled_from(("none",) * 4 + ("dtype", "rank", "extent", "meta", "strided", "misaligned")))
    if mutation == "dtype":
        dtype = draw(st.sampled_from(DTYPES))
    elif mutation == "rank":
        shape = shape[:-1] if shape and draw(st.booleans()) else [*shape, draw(st.sampled_from((1, 2)))]
    elif mutation == "extent" and shape:
        i = draw(st.integers(0, len(shape) - 1))
        shape[i] = max(0, shape[i] + draw(st.sampled_from((-1, 1))))
    how = mutation if mutation in ("meta", "strided", "misaligned") else "dense"
    return _make(tuple(shape), dtype, how)


@st.composite
def _handles(draw: st.DrawFn, spec: Items) -> object:
    """A handle built by ``spec.make`` from valid members (free extents 1) but for at most one drawn member (any
    tensor or junk), or with a member dropped or added; a plain tuple of the members; or junk."""
    members: list[object] = [_make(tuple(1 if s is None else s for s in r.shape), r.dtypes[0], "dense")
                             for r in spec.items]
    form = draw(st.sampled_from(("valid", "member", "member", "length", "plain", "junk")))
    if form == "member":
        i = draw(st.integers(0, len(members) - 1))
        members[i] = draw(st.one_of(_tensors(spec.items[i]), JUNK))
    elif form == "length":
        members = members[:-1] if draw(st.booleans()) else [*members, members[-1]]
    elif form == "plain":
        return tuple(members)
    elif form == "junk":
        return draw(JUNK)
    return spec.make(tuple(members))


@dataclass
class Outcome:
    """What one fuzzed call did."""

    error: BaseException | None = None
    accepted: bool = False
    notes: list[str] = field(default_factory=list)


def run(call: Callable[[], object], boundary: str | None = None) -> Outcome:
    """Runs ``call``; a RuntimeError matching ``boundary`` (the launch boundary of a CPU host) counts as accepted."""
    try:
        call()
    except RuntimeError as exc:
        if boundary is not None and re.search(boundary, str(exc)):
            return Outcome(accepted=True)
        return Outcome(error=exc)
    except Exception as exc:  # noqa: BLE001 - every other exception is judged by the model
        return Outcome(error=exc)
    return Outcome(accepted=True)


def check(call: Callable[[], object], want: type[Exception] | None, names: tuple[str, ...],
          boundary: str | None = None, what: str = "") -> None:
    """Asserts the model's verdict ``want`` for ``call``: accepted, or ``want`` raised (exactly that kind, never an
    AttributeError / IndexError / OverflowError / ZeroDivisionError) with a message naming one of ``names``."""
    out = run(call, boundary)
    if want is None:
        assert out.accepted, f"{what}: a valid input was refused: {type(out.error).__name__}: {out.error}"
        return
    assert not out.accepted, f"{what}: accepted, but the model says {want.__name__}"
    assert type(out.error) is want or (want is ValueError and type(out.error).__name__ == "RingCapacityError"), (
        f"{what}: want {want.__name__}, got {type(out.error).__name__}: {out.error}")
    message = str(out.error)
    assert any(n in message for n in names), f"{what}: the message does not name {names}: {message}"
