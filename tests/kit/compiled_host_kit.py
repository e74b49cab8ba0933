"""What the compiled host path's tests (tests/facades/test_ep_ll_host_compiled.py,
test_deep_ep_normal_host_compiled.py) share: the module (or a skip), arguments the compiled path must hand to the
Python path (a tensor subclass, a view off a 16-byte or an element boundary) and the exception a call raised."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import numpy as np
import pytest
import torch

from gc_moe_compat.deep_ep import _compiled_host


def compiled_or_skip() -> ModuleType:
    """The compiled host path's module, or the test skips saying why it did not build here."""
    module = _compiled_host.compiled()
    if module is None:
        pytest.skip(f"the extension did not build here: {_compiled_host.host_path()['reason']}")
    return module


def raised(call: Callable[[], object]) -> tuple[type, str] | None:
    """The type and message of what ``call`` raised, or None."""
    try:
        call()
    except Exception as exc:  # the exception of either path, compared by the caller
        return type(exc), str(exc)
    return None


class TensorSubclass(torch.Tensor):
    """A tensor subclass: the Python path accepts it, the compiled one leaves it to the Python path."""


def misaligned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous zero tensor of ``shape`` whose address is one element past a 16-byte boundary."""
    numel = 1
    for size in shape:
        numel *= size
    return torch.zeros(numel + 16, dtype=dtype)[1:1 + numel].view(shape)


def same_on_both_paths(call: Callable[[], object], monkeypatch: pytest.MonkeyPatch, python_calls: list[str],
                       must_fall_back: bool = True) -> tuple[type, str] | None:
    """What ``call`` raises on the Python host path (``GC_MOE_DEEP_EP_HOST_PATH=python``), checked equal to what it
    raises on the default path, whose call must have handed over to the Python path (``python_calls``: the Python
    path's calls, counted by the caller's fixture) unless ``must_fall_back`` is False (an error raised before it)."""
    monkeypatch.setenv(_compiled_host.HOST_PATH_ENV, "python")
    want = raised(call)
    monkeypatch.delenv(_compiled_host.HOST_PATH_ENV)
    python_calls.clear()
    got = raised(call)
    assert got == want
    assert not must_fall_back or python_calls, "a refused argument must run the Python path"
    return got


def unaligned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous zero tensor of ``shape`` whose address is one byte past an element boundary (what torch's own
    views never make; an array from outside torch can: here NumPy's, through ``torch.from_numpy``)."""
    numel = 1
    for size in shape:
        numel *= size
    size = torch.empty(0, dtype=dtype).element_size()
    raw = np.zeros(numel * size + size, dtype=np.uint8)
    as_numpy = torch.empty(0, dtype=dtype).numpy().dtype
    return torch.from_numpy(np.frombuffer(raw.data, dtype=as_numpy, count=numel, offset=1).reshape(shape))


def assert_disjoint_parts(parts: list[tuple[torch.Tensor, torch.dtype, tuple[int, ...]]],
                          reserved: tuple[tuple[int, int], ...] = ()) -> torch.UntypedStorage:
    """Each of ``parts`` (tensor, dtype, shape) has that dtype and shape, is contiguous, 16-byte aligned, on the
    first one's storage and inside it, and not an autograd view (as DeepEP's separate tensors); no two of them, nor
    ``reserved`` byte spans of it (start, end addresses), share a byte (each filled with its own value, read back
    intact). Returns the storage."""
    storage = parts[0][0].untyped_storage()
    spans = list(reserved)
    for t, dtype, size in parts:
        assert (t.dtype, tuple(t.shape), t.is_contiguous(), t._is_view()) == (dtype, size, True, False)
        assert t.untyped_storage().data_ptr() == storage.data_ptr() and t.data_ptr() % 16 == 0
        spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False)), spans
    assert spans[-1][1] <= storage.data_ptr() + storage.nbytes()
    for value, (t, _, _) in enumerate(parts, start=1):
        t.fill_(value)
    for value, (t, _, _) in enumerate(parts, start=1):
        assert bool((t == value).all())
    return storage
