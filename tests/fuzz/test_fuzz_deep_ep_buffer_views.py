"""Fuzz of ``Buffer.get_local_buffer_tensor`` (DeepEP's view of a rank's NVL buffer) against a model of its rule,
written here apart from the library's checks: ``dtype`` a ``torch.dtype``; ``use_rdma_buffer`` a bool, True refused as
NotImplementedError; ``offset`` an int in ``[0, nbytes]`` and a multiple of the dtype's size; ``size`` None or a
tuple / list / ``torch.Size`` of ints in ``[0, nbytes]`` whose product fits the whole elements after ``offset``.

Two tests: one argument of a valid baseline replaced by any drawn value (junk included: the verdict and the argument
the message names), and every argument drawn from the well-typed ranges around the bounds, where an accepted call's
view is checked against the model (dtype, shape, start address, and that a write through it changes exactly its
bytes of the region). CPU only: the workspace is conftest's host allocation carved by the real region layout, so the
view's bounds are the region's ``num_nvl_bytes`` (a size DeepEP takes, a multiple of 128), as on the GPU."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import pytest
import torch
from fuzz_model import JUNK, Flag, Int, check, expect, values
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gc_moe_compat.deep_ep import Buffer

if TYPE_CHECKING:
    from conftest import DeepEpHost

FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
NVL_BYTES = 4224
"""Not a multiple of 8 or 16: the default view keeps the whole elements only."""
DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


@pytest.fixture
def buf(deep_ep_host: DeepEpHost) -> Buffer:
    buffer = deep_ep_host.buffer(NVL_BYTES, 0)
    assert buffer.normal.buffer.numel() == NVL_BYTES
    return buffer


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def model(dtype: object, size: object, offset: object, use_rdma_buffer: object) -> tuple[type[Exception] | None, str]:
    """The verdict of a call (None: a view) and the argument a refusal names, in the order the arguments are judged:
    dtype, use_rdma_buffer, offset, then size."""
    if not isinstance(dtype, torch.dtype):
        return TypeError, "dtype"
    flag = expect(Flag(refused=(True,), refused_with=NotImplementedError), use_rdma_buffer)
    if flag is not None:
        return flag, "use_rdma_buffer"
    offset_rule = expect(Int(0, NVL_BYTES, multiple=dtype.itemsize), offset)
    if offset_rule is not None:
        return offset_rule, "offset"
    if size is None:
        return None, ""
    if not isinstance(size, tuple | list):
        return TypeError, "size"
    for d in size:
        if not _is_int(d):
            return TypeError, "size"
        if not 0 <= d <= NVL_BYTES:
            return ValueError, "size"
    fits = math.prod(size) * dtype.itemsize <= NVL_BYTES - offset
    return (None, "") if fits else (ValueError, "size")


def _assert_view(buf: Buffer, view: torch.Tensor, dtype: torch.dtype, size: object, offset: int) -> None:
    """The accepted call's view against the model: dtype, shape, start, and exactly its bytes aliased."""
    region = buf.normal.buffer
    itemsize = dtype.itemsize
    shape = ((NVL_BYTES - offset) // itemsize,) if size is None else tuple(size)
    assert view.dtype == dtype and tuple(view.shape) == shape and view.is_contiguous()
    nbytes = math.prod(shape) * itemsize
    if nbytes:
        assert view.data_ptr() == region.data_ptr() + offset
    region.zero_()
    view.reshape(-1).view(torch.uint8).fill_(0xA5)
    marked = (region == 0xA5).nonzero().flatten()
    assert marked.numel() == nbytes and (nbytes == 0 or (int(marked[0]), int(marked[-1])) == (offset,
                                                                                             offset + nbytes - 1))


SIZES = st.one_of(st.none(), st.lists(st.integers(-2, 70), max_size=3).flatmap(
    lambda dims: st.sampled_from([tuple(dims), list(dims)] + ([torch.Size(dims)] if min(dims, default=0) >= 0
                                                              else []))))
OFFSETS = st.one_of(st.integers(-4, 64), st.integers(NVL_BYTES - 80, NVL_BYTES + 4))
BASELINE = dict(dtype=torch.bfloat16, size=torch.Size([3, 5]), offset=64, use_rdma_buffer=False)
DRAWN: dict[str, st.SearchStrategy[object]] = {
    "dtype": st.one_of(st.sampled_from(DTYPES), st.sampled_from(["float32", torch.float32.__repr__(), float,
                                                                 torch.Tensor, torch.empty(0)]), JUNK),
    "size": st.one_of(SIZES, st.sampled_from([4, 4.0, "3", (2, 2.0), (True, 2), [torch.tensor(2)],
                                              (NVL_BYTES + 1,), (1 << 70,)]), JUNK),
    "offset": values(Int(0, NVL_BYTES, multiple=2)),
    "use_rdma_buffer": values(Flag()),
}
@FUZZ
@given(case=st.sampled_from(sorted(DRAWN)).flatmap(lambda name: DRAWN[name].map(lambda v: (name, v))))
def test_one_argument_against_the_model(buf: Buffer, default_dtype: torch.dtype, case: tuple[str, object]) -> None:
    name, value = case
    kwargs = {**BASELINE, name: value}
    want, arg = model(**kwargs)
    got: list[torch.Tensor] = []
    check(lambda: got.append(buf.get_local_buffer_tensor(**kwargs)), want, (arg,),
          what=f"get_local_buffer_tensor({name}={value!r})")
    if want is None:
        _assert_view(buf, got[0], kwargs["dtype"], kwargs["size"], kwargs["offset"])


def _near_fit(dtype: torch.dtype, offset: int) -> st.SearchStrategy[object]:
    """Shapes whose element count is within 2 of what fits after ``offset`` (one or two dimensions), or any."""
    room = max(0, (NVL_BYTES - offset) // dtype.itemsize)
    near = st.integers(max(0, room - 2), room + 2)
    return st.one_of(SIZES, near.map(lambda n: (n,)), near.map(lambda n: [2, -(-n // 2)]),
                     near.map(lambda n: torch.Size([n, 1])))


@FUZZ
@given(data=st.data(), dtype=st.sampled_from(DTYPES), offset=OFFSETS)
def test_bounds_against_the_model(buf: Buffer, default_dtype: torch.dtype, data: st.DataObject, dtype: torch.dtype,
                                  offset: int) -> None:
    size = data.draw(_near_fit(dtype, offset), label="size")
    want, arg = model(dtype, size, offset, False)
    got: list[torch.Tensor] = []
    check(lambda: got.append(buf.get_local_buffer_tensor(dtype, size, offset)), want, (arg,),
          what=f"get_local_buffer_tensor({dtype}, {size!r}, {offset})")
    if want is None:
        _assert_view(buf, got[0], dtype, size, offset)
