"""Role1 with expert ids outside ``[-1, E)`` or non-finite routing weights staged directly into the buffer (the
native API with ``check_values=False``, or the deep_gemm facade's ``fp8_mega_moe``, which never reads the values on
the host): the kernel skips them like unused slots, role3 sums no partial for them, the layer completes (no wait
gives up, so the buffer keeps working), and the eager call raises ``DeviceCheckError`` naming the dropped value
(:mod:`gc_moe_compat.runtime.dropped`). Every call starts from poisoned payload regions and ``y``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from operator_kit import (
    CAPACITY,
    assert_bits_equal,
    check_accuracy,
    make_inputs,
    make_weights,
    preset_dims,
    reference_ys,
    start_call,
)

from gc_moe_compat.operator import api
from gc_moe_compat.runtime.status import DeviceCheckError

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
def test_role1_drops_staged_ids_outside_the_experts(group: dist.ProcessGroup, idx_dtype: torch.dtype) -> None:
    e, k, h, inter = preset_dims("tiny")
    buf = api.get_symm_buffer_for_gc_moe(group, e, CAPACITY, k, h, inter, "fp8xfp8", topk_idx_dtype=idx_dtype)
    w = make_weights("tiny", 0, mma_type="fp8xfp8")
    tokens = 37
    inputs = make_inputs("uniform", tokens, e, k, h, seed=11)
    bad_idx = inputs.topk_idx.clone()
    bad_idx[3, 0], bad_idx[5, 1], bad_idx[36, 0] = e + 3, -7, e
    sanitized = bad_idx.clone()
    sanitized[3, 0] = sanitized[5, 1] = sanitized[36, 0] = -1
    clean = dataclasses.replace(inputs, topk_idx=sanitized)
    y = start_call(buf, dataclasses.replace(inputs, topk_idx=bad_idx))
    with pytest.raises(DeviceCheckError, match="fp8_fp8_gc_moe: running the layer: .*dropped an invalid input .*"
                                               "role1 dispatch: a staged topk_idx entry .*observed (-7|4|7), "
                                               "expected 4"):
        api.fp8_fp8_gc_moe(y, w.w1, w.w2, buf, check_values=False)
    check_accuracy(y, reference_ys([clean], [w])[0], "ids dropped by role1", "tiny")
    first = y.clone()
    y = start_call(buf, clean)  # the buffer keeps working: the same layer on the sanitized routing, no error
    api.fp8_fp8_gc_moe(y, w.w1, w.w2, buf, check_values=False)
    torch.cuda.synchronize()
    assert_bits_equal(y, first, "sanitized routing after the drop")
    buf.destroy()


def test_role1_drops_staged_non_finite_weights(group: dist.ProcessGroup) -> None:
    """NaN / +Inf / -Inf routing weights of valid ids: the entries are skipped (no ring row, no partial), the rest of
    the layer is the reference's on the routing with those slots unused, and the eager call names the weight's bits
    and the entry."""
    e, k, h, inter = preset_dims("tiny")
    buf = api.get_symm_buffer_for_gc_moe(group, e, CAPACITY, k, h, inter, "fp8xfp8")
    w = make_weights("tiny", 0, mma_type="fp8xfp8")
    tokens = 37
    inputs = make_inputs("uniform", tokens, e, k, h, seed=12)
    bad_w = inputs.topk_weights.clone()
    bad_w[2, 1], bad_w[9, 0], bad_w[36, 1] = float("nan"), float("inf"), float("-inf")
    sanitized_idx, sanitized_w = inputs.topk_idx.clone(), bad_w.clone()
    for t, slot in ((2, 1), (9, 0), (36, 1)):
        sanitized_idx[t, slot], sanitized_w[t, slot] = -1, 0.0
    clean = dataclasses.replace(inputs, topk_idx=sanitized_idx, topk_weights=sanitized_w)
    y = start_call(buf, dataclasses.replace(inputs, topk_weights=bad_w))
    with pytest.raises(DeviceCheckError, match="fp8_fp8_gc_moe: running the layer: .*dropped an invalid input .*"
                                               "role1 dispatch: a staged topk_weights entry is not finite .*"
                                               "expected (5|18|73)"):
        api.fp8_fp8_gc_moe(y, w.w1, w.w2, buf, check_values=False)
    assert torch.isfinite(y.float()).all()
    check_accuracy(y, reference_ys([clean], [w])[0], "non-finite weights dropped by role1", "tiny")
    buf.destroy()
