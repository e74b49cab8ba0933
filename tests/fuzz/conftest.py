"""The fuzz suite runs every test under the caller's default dtype float32 and bfloat16 (``dtype`` parameter): the
library names the dtype of everything it allocates, so the verdicts must not change. The deep_ep tests share
``deep_ep_host``: Buffers on a host stand-in of the symmetric workspace whose low-latency launches are recorded."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from ll_launches import record_ll_launches

from gc_moe_compat.comm.ep_ll import MAX_SMS
from gc_moe_compat.deep_ep import Buffer, _buffer, _normal
from gc_moe_compat.runtime.workspace import LayoutPlanner, PeerTable, SymmetricWorkspace


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def default_dtype(request: pytest.FixtureRequest) -> Iterator[torch.dtype]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(request.param)
    try:
        yield request.param
    finally:
        torch.set_default_dtype(before)


class HostWorkspace(SymmetricWorkspace):
    """Host stand-in for ``SymmetricWorkspace`` (what both deep_ep modes read): the real region layout (``region`` /
    ``offset``, so a view's bounds are its region's, as on the GPU) over a zeroed CPU byte buffer of a ``ranks``-rank
    workspace seen from rank 0 (the calls read only the rank count, the regions and the bytes)."""

    def __init__(self, layout: LayoutPlanner, ranks: int = 1) -> None:  # no rendezvous: nothing of the GPU's
        self.regions, self.device, self.world_size, self.rank = layout.regions, torch.device("cpu"), ranks, 0
        self.buffer = torch.zeros(layout.size, dtype=torch.uint8, device="cpu")
        self.peer_table, self.sm_share = PeerTable(), MAX_SMS


class DeepEpHost:
    """Makes deep_ep Buffers on :class:`HostWorkspace`; ``launched`` records every low-latency launch as
    ``(what, params)`` (tests/kit/ll_launches.py; nothing runs). A normal-mode call that passes its checks reaches
    the GPU refusal of its launch (``fuzz_model.NEEDS_GPU``)."""

    def __init__(self, group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch) -> None:
        self.group, self.monkeypatch = group, monkeypatch
        self.launched = record_ll_launches(monkeypatch)

    def buffer(self, *args: object, ranks: int = 1, **kwargs: object) -> Buffer:
        """``Buffer(group, *args, **kwargs)`` whose workspaces are ``ranks``-rank host stand-ins."""

        def workspace(layout: LayoutPlanner, group: dist.ProcessGroup | None = None,
                      device: torch.device | None = None, where: object = None) -> HostWorkspace:
            return HostWorkspace(layout, ranks)

        self.monkeypatch.setattr(_buffer, "SymmetricWorkspace", workspace)
        self.monkeypatch.setattr(_normal, "SymmetricWorkspace", workspace)
        return Buffer(self.group, *args, **kwargs)


@pytest.fixture
def deep_ep_host(group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch) -> DeepEpHost:
    return DeepEpHost(group, monkeypatch)
