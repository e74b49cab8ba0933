"""The CPU stand-in's one lift of the normal mode's GPU refusal, shared by the launch-recording tests
(tests/facades/test_deep_ep_normal_launches.py) and the host-path diagnosis (scripts/host_path_cpu.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from gc_moe_compat.deep_ep import _normal


def lift_gpu_refusal(set_attribute: Callable[[object, str, object], None]) -> None:
    """Lets a normal-mode call on a host workspace past its launch boundary's refusal of a workspace off the GPU:
    the device reads as CUDA inside the boundary (``NormalMode._begin``) alone, not where the call allocates.
    ``set_attribute``: ``setattr``, or pytest's ``monkeypatch.setattr`` so that a test undoes it."""
    begin = _normal.NormalMode._begin
    cuda = torch.device("cuda", 0)

    def begin_on_gpu(self: _normal.NormalMode, fn: str, num_sms: int) -> object:
        device, self.device = self.device, cuda
        try:
            return begin(self, fn, num_sms)
        finally:
            self.device = device

    set_attribute(_normal.NormalMode, "_begin", begin_on_gpu)
