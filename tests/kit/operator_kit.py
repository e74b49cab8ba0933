"""Shared helpers of the operator's GPU tests (one and two ranks): preset weights of either compute path, routings,
staging, poisoning (:func:`start_call`: both, and the NaN ``y``), the P-rank quantization-faithful reference and the
docs/bench_protocol.md accuracy check.

The oracle is :func:`gc_moe_compat.testing.reference.expert_parallel_reference` on the exact weights and activations
the kernels read (``make_weights(..., mma_type=)``: ``fp8_block128`` for FP8xFP8, window-repacked ``mxfp4`` for
FP8xFP4), with the intermediate requantized as that SM90 path does (``"fp32_128"`` / ``"ue8m0_128"``, chosen by
``reference_ys`` from the weights' format); ``make_expert_weights(..., fmt="bf16")`` gives the BF16 model both
approximate.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gc_moe_compat.config import SWEEP_TOKENS
from gc_moe_compat.operator import api
from gc_moe_compat.testing.operator_workload import (  # noqa: F401 - re-exported for the operator tests
    CAPACITY,
    CLAMP,
    ROUTINGS,
    RankInputs,
    RankWeights,
    make_expert_weights,
    make_inputs,
    make_weights,
    preset_dims,
    reference_ys,
    stage,
)
from gc_moe_compat.testing.reference import accuracy_metrics

SWEEP = tuple(SWEEP_TOKENS)
POISONED = ("l1_acts", "l1_acts_sf", "l1_routing_weights", "l1_source", "l2_acts", "l2_acts_sf", "combine")
"""Payload regions filled with 0xFF (FP8/FP32/BF16 NaN, source -1) before a checked call: a padding row or an
unwritten combine slot that leaked into y would show up as NaN."""
SHARED_POISONED = ("shared_l2_acts", "shared_l2_acts_sf")
"""Role4's intermediate in a shared-expert buffer, poisoned too where a test checks role4 (``poison(shared=True)``)."""
CALLS: dict[str, Callable[..., None]] = {"fp8xfp8": api.fp8_fp8_gc_moe, "fp8xfp4": api.fp8_fp4_gc_moe}
"""The native API's call of each compute path."""
COSINE_MIN, PROCESSED_MAX = 0.9999, 1e-4
"""docs/bench_protocol.md reference-1 targets, checked as they are for the protocol's workload presets."""
TINY_COSINE_MIN, TINY_PROCESSED_MAX = 0.9995, 5e-4
"""The test-only ``tiny`` preset (I = 256, top-2): a rank with one token and one or two valid slots has a single
256-wide FP8 intermediate, so one E4M3 rounding flip moves the processed diff by ~1e-4. Hopper's FP8 WGMMA keeps
about 14 mantissa bits inside each K128 step, which the FP32 reference cannot reproduce; a CPU model of that
truncation on tiny's shapes (1 token, 300 seeds) gave processed diffs up to 3.4e-4 and above 1e-4 in 1-2 % of seeds,
while an exact FP32 re-ordering stays <= 1.7e-5. Wider presets average such flips out and keep the protocol targets."""


def poison(buffer: api.GcMoeBuffer, *, shared: bool = False) -> None:
    """0xFF into every payload region of :data:`POISONED`, and of :data:`SHARED_POISONED` with ``shared`` (never the
    protocol counters)."""
    for name in POISONED + (SHARED_POISONED if shared else ()):
        buffer.view(name).view(torch.uint8).fill_(0xFF)


def poisoned_y(tokens: int, hidden: int) -> torch.Tensor:
    """``y [T, H]`` BF16 filled with NaN."""
    return torch.full((tokens, hidden), float("nan"), dtype=torch.bfloat16, device="cuda")


def start_call(buffer: api.GcMoeBuffer, inputs: RankInputs, *, shared: bool = False) -> torch.Tensor:
    """How a checked call starts: ``inputs`` staged into ``buffer``, its payload regions poisoned (:func:`poison`)
    and a NaN ``y [T, H]`` (:func:`poisoned_y`) returned for the call to write."""
    stage(buffer, inputs)
    poison(buffer, shared=shared)
    return poisoned_y(inputs.tokens, inputs.x.shape[1])


def check_accuracy(y: torch.Tensor, y_ref: torch.Tensor, what: str, preset: str) -> dict[str, float | int]:
    """No NaN/Inf; docs/bench_protocol.md reference 1 targets (cosine >= 0.9999, processed diff <= 1e-4) for the
    workload presets, :data:`TINY_COSINE_MIN` / :data:`TINY_PROCESSED_MAX` for ``tiny``."""
    m = accuracy_metrics(y.float(), y_ref.float())
    assert m["nonfinite"] == 0 and m["nonfinite_ref"] == 0, f"{what}: non-finite values {m}"
    cos_min, diff_max = (TINY_COSINE_MIN, TINY_PROCESSED_MAX) if preset == "tiny" else (COSINE_MIN, PROCESSED_MAX)
    assert m["cosine"] >= cos_min and m["processed_diff"] <= diff_max, f"{preset} {what}: {m}"
    return m


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bit-exact equality of two BF16 tensors."""
    g, w = got.view(torch.int16), want.view(torch.int16)
    bad = int((g != w).sum())
    assert bad == 0, f"{what}: {bad} of {g.numel()} elements differ"
