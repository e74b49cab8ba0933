"""A one-rank torch process group for code that takes a ``group`` (buffers, facades) outside ``torchrun``: the
compatibility matrix's CPU cells, the tests' ``group`` fixture, the single-GPU benchmarks."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import torch.distributed as dist

__all__ = ["single_rank_group"]


@contextlib.contextmanager
def single_rank_group() -> Iterator[dist.ProcessGroup]:
    """A gloo group of one rank on a free 127.0.0.1 port, destroyed when the block ends. A default group this process
    already has is yielded instead and left alone (its owner destroys it)."""
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
