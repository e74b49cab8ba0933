"""Several small outputs of one call as parts of one allocation, the way the facade's Python host path makes them.

Each CUDA allocation costs host time on every call (about 2 us through torch's caching allocator from C++, more from
Python), and a dispatch makes several small tensors whose lifetimes end together (a handle's prefix matrices, the
received top-k ids and weights, a low-latency dispatch's routing records). So one allocation holds them, each part
starting on a 16-byte boundary (the kernels read by 16-byte vectors). A part is a tensor of DeepEP's dtype, shape and
contiguous strides on that allocation's storage, made with ``Tensor.set_``: it is not an autograd view (``_base`` is
None, ``_is_view()`` False), like DeepEP's own separate tensors. ``_compiled_host.cpp`` makes the same parts in C++
(``part_of``) at the same starts; the host tests compare the two paths.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["PART_ALIGNMENT", "part", "vector_aligned_starts"]

PART_ALIGNMENT = 16
"""Every part starts at a multiple of this many bytes from the allocation's start."""


def vector_aligned_starts(nbytes: Sequence[int], first: int = 0) -> tuple[list[int], int]:
    """The byte starts of parts of ``nbytes`` bytes laid out in order from byte ``first``, each rounded up to
    :data:`PART_ALIGNMENT`, and the bytes the allocation needs (the last part's end)."""
    starts, end = [], first
    for size in nbytes:
        start = -(-end // PART_ALIGNMENT) * PART_ALIGNMENT
        starts.append(start)
        end = start + size
    return starts, end


def part(block: torch.Tensor, dtype: torch.dtype, start: int, shape: Sequence[int]) -> torch.Tensor:
    """A contiguous tensor of ``dtype`` and ``shape`` on the storage of ``block`` (a fresh allocation: storage offset
    0) from byte ``start`` (a multiple of the dtype's size), not a view of ``block``: it keeps the storage alive as
    ``block`` does."""
    return torch.empty(0, dtype=dtype, device=block.device).set_(block.untyped_storage(), start // dtype.itemsize,
                                                                 tuple(shape))
