"""The host tests' recorder of the deep_ep facade's low-latency launches (nothing runs): each launch a call makes
(``_low_latency._Call.launch`` / ``launch_fused``) is recorded as ``(what, params)``. ``what`` is the :class:`Kernel`
of a half launched alone (a call with a receive hook, and that hook) or the pair of halves one fused launch runs
(:data:`DISPATCH`, :data:`COMBINE`: a call without a hook); ``params`` a copy of the call's :class:`EpLlParams` at the
launch (a later call sets the same struct)."""

from __future__ import annotations

import pytest

from gc_moe_compat.comm.ep_ll import EpLlParams, Kernel
from gc_moe_compat.deep_ep import _low_latency

DISPATCH = (Kernel.DISPATCH_SEND, Kernel.DISPATCH_RECV)
"""What a fused dispatch launch runs."""
COMBINE = (Kernel.COMBINE_SEND, Kernel.COMBINE_RECV)
"""What a fused combine launch runs."""

Launch = tuple[Kernel | tuple[Kernel, Kernel], EpLlParams]


def record_ll_launches(monkeypatch: pytest.MonkeyPatch) -> list[Launch]:
    """Replaces the facade's launches by appends to the list returned."""
    recorded: list[Launch] = []
    monkeypatch.setattr(_low_latency._Call, "launch", lambda call, kernel: recorded.append(
        (kernel, EpLlParams.from_buffer_copy(call.launches.params))))
    monkeypatch.setattr(_low_latency._Call, "launch_fused", lambda call, kernel: recorded.append(
        ((kernel.send, kernel.receive), EpLlParams.from_buffer_copy(call.launches.params))))
    return recorded
