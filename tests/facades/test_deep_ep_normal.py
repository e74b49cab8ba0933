"""The ``deep_ep`` facade's normal mode (DeepEP's intranode ``get_dispatch_layout`` / ``dispatch`` / ``combine``) on
H200s, bit for bit against the torch references (:mod:`gc_moe_compat.references.ep_normal_reference`), on one rank and
on two: every handle tensor, BF16 and FP8 payloads (column-major scales), -1 slots, T = 0, a rank without tokens,
every token to one expert, ``expert_alignment``, ``num_worst_tokens``, a cached re-dispatch, bias, async with
``previous_event``, 20 consecutive rounds, a default device of cuda, on the communication green partition and with
the partition off; two ranks: a missing peer ends in ``DeviceTimeoutError`` naming it.
"""

from __future__ import annotations

import pytest
from two_rank import run_ranks

pytestmark = pytest.mark.gpu

WORKER = "deep_ep_normal_worker.py"
TIMEOUT_S = 400
CASES = ("normal random BF16 bit-exact", "normal random FP8 (column-major scales) bit-exact",
         "normal num_worst_tokens bit-exact", "normal T = 0 on every rank bit-exact",
         "normal under torch.set_default_device('cuda') bit-exact", "20 consecutive normal rounds bit-exact")


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.multigpu)])
@pytest.mark.parametrize("partition", ["on", "off"])
def test_deep_ep_normal_cases(nproc: int, partition: str) -> None:
    out = run_ranks(WORKER, nproc, TIMEOUT_S, *CASES, env={"GC_MOE_PARTITION": partition}, args=("--suite", "cases"))
    assert out.count("20 consecutive normal rounds bit-exact") == nproc


@pytest.mark.multigpu
def test_deep_ep_normal_missing_peer_times_out() -> None:
    run_ranks(WORKER, 2, TIMEOUT_S, "missing peer", args=("--suite", "timeout"))
