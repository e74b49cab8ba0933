"""gc_moe_compat.deep_ep._parts: the starts of parts of one allocation and the parts themselves."""

from __future__ import annotations

import pytest
import torch

from gc_moe_compat.deep_ep._parts import PART_ALIGNMENT, part, vector_aligned_starts


@pytest.mark.parametrize(("nbytes", "first", "starts", "end"), [
    ((), 0, [], 0),
    ((4,), 0, [0], 4),
    ((4, 8, 0, 3), 0, [0, 16, 32, 32], 35),
    ((16, 16), 0, [0, 16], 32),
    ((1, 0, 0), 4, [16, 32, 32], 32),
    ((0, 0), 0, [0, 0], 0),
])
def test_vector_aligned_starts(nbytes: tuple, first: int, starts: list, end: int) -> None:
    assert vector_aligned_starts(nbytes, first) == (starts, end)
    assert all(s % PART_ALIGNMENT == 0 for s in starts)


def test_a_part_is_a_contiguous_tensor_on_the_storage_not_a_view() -> None:
    block = torch.full((64,), 0xAB, dtype=torch.uint8)
    t = part(block, torch.int64, 16, (2, 3))
    assert (t.dtype, t.shape, t.stride(), t.storage_offset()) == (torch.int64, (2, 3), (3, 1), 2)
    assert t._base is None and not t._is_view() and t.is_contiguous()
    assert t.untyped_storage().data_ptr() == block.untyped_storage().data_ptr()
    t.copy_(torch.arange(6).view(2, 3))
    assert block[:16].eq(0xAB).all() and block[16:64].view(torch.int64).tolist() == list(range(6))
    del block
    assert t.sum().item() == 15  # the part alone keeps the storage alive


def test_an_empty_part() -> None:
    block = torch.empty(0, dtype=torch.uint8)
    t = part(block, torch.float32, 0, (0, 4))
    assert t.shape == (0, 4) and t.numel() == 0 and not t._is_view()
