"""The fuzz suite runs every test under the caller's default dtype float32 and bfloat16 (``dtype`` parameter): the
library names the dtype of everything it allocates, so the verdicts must not change. The deep_ep tests share
``deep_ep_host``: Buffers on a host stand-in of the symmetric workspace whose low-latency launches are recorded."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from gc_moe_compat.deep_ep import Buffer, _buffer, _low_latency, _normal


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def default_dtype(request: pytest.FixtureRequest) -> Iterator[torch.dtype]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(request.param)
    try:
        yield request.param
    finally:
        torch.set_default_dtype(before)


class HostWorkspace:
    """Host stand-in for ``SymmetricWorkspace`` (what both deep_ep modes read): a zeroed CPU byte buffer of a
    ``ranks``-rank workspace seen from rank 0 (the calls read only the rank count and the bytes)."""

    def __init__(self, layout: object, ranks: int = 1) -> None:
        self.device = torch.device("cpu")
        self.world_size, self.rank = ranks, 0
        self.buffer = torch.zeros(layout.size, dtype=torch.uint8, device="cpu")
        self.peer_table = "peer table"

    def region(self, name: str) -> torch.Tensor:
        return self.buffer


class DeepEpHost:
    """Makes deep_ep Buffers on :class:`HostWorkspace`; ``launched`` records every low-latency launch as
    ``(kernel, params)`` (nothing runs). A normal-mode call that passes its checks reaches the GPU refusal of its
    launch (``fuzz_model.NEEDS_GPU``)."""

    def __init__(self, group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch) -> None:
        self.group, self.monkeypatch, self.launched = group, monkeypatch, []
        monkeypatch.setattr(_low_latency._Call, "launch", lambda call, kernel: self.launched.append((kernel,
                                                                                                      call.params)))
        monkeypatch.setattr(_low_latency, "_finish", lambda call, synchronous: None)

    def buffer(self, *args: object, ranks: int = 1, **kwargs: object) -> Buffer:
        """``Buffer(group, *args, **kwargs)`` whose workspaces are ``ranks``-rank host stand-ins."""

        def workspace(layout: object, group: dist.ProcessGroup | None = None) -> HostWorkspace:
            return HostWorkspace(layout, ranks)

        self.monkeypatch.setattr(_buffer, "SymmetricWorkspace", workspace)
        self.monkeypatch.setattr(_normal, "SymmetricWorkspace", workspace)
        return Buffer(self.group, *args, **kwargs)


@pytest.fixture
def deep_ep_host(group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch) -> DeepEpHost:
    return DeepEpHost(group, monkeypatch)
