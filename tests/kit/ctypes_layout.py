"""Layout check shared by the host tests of the by-value kernel parameter structs."""

from __future__ import annotations

import ctypes


def natural_layout_size(struct: type[ctypes.Structure]) -> int:
    """Asserts every field of ``struct`` sits at its natural C offset (aligned to its own size, no hidden padding);
    returns the end of the last field rounded up to the 8-byte tail alignment, for the caller to compare with
    ``ctypes.sizeof(struct)``."""
    offset = 0
    for name, kind in struct._fields_:
        size = ctypes.sizeof(kind)
        offset = -(-offset // size) * size
        assert getattr(struct, name).offset == offset, name
        offset += size
    return -(-offset // 8) * 8
