"""The operator with a fused shared expert (role4) on one H200, both compute paths (``fp8_fp8_gc_moe``,
``fp8_fp4_gc_moe``) against the quantization-faithful reference with the shared expert in combine slot k.

Every checked call starts from poisoned ring payloads, combine slots, role4's intermediate and ``y``. Checked per call:
role4's own output (combine slot k, rows < T) against the reference's slot-k partials (cosine >= 0.9999); ``y``
against the reference (BENCH_PROTOCOL.md reference-1 targets); and ``y`` bit for bit equal to the slot-order FP32 sum
of this rank's combine slots (the valid routed slots, then slot k) rounded to BF16: role3 adds the shared partial
last. T = 0, 1, odd, capacity; partition on and off; eager vs graph replay bit-identical; the refusal of a first
call inside capture before anything runs; the deep_gemm facade's ``fp8_fp4_mega_moe`` with shared
weights bit-identical to the native call. Tests are parametrized by ``mma_type``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from operator_kit import (
    CALLS,
    CAPACITY,
    RankWeights,
    check_accuracy,
    make_inputs,
    make_weights,
    poisoned_y,
    preset_dims,
    stage,
)
from role4_kit import (
    Pairs,
    Shared,
    SharedBuffers,
    assert_facade_matches_native,
    assert_graph_matches_eager,
    checked_call,
    compile_variants,
)

from gc_moe_compat import layouts
from gc_moe_compat.references.operator_workload import make_shared_weights, reference_results

pytestmark = pytest.mark.gpu

PRESETS = ("tiny", "glm52")
MMA_TYPES = ("fp8xfp8", "fp8xfp4")
TOKENS = (0, 1, 37, CAPACITY)
GRAPH_TOKENS = 64
OFF_PRESET = "glm52"

_buffer = SharedBuffers()


@pytest.fixture(scope="module", params=MMA_TYPES)
def mma_type(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def weights(mma_type: str) -> dict[str, RankWeights]:
    return {p: make_weights(p, 0, mma_type=mma_type) for p in PRESETS}


@pytest.fixture(scope="module")
def shared() -> dict[str, Shared]:
    return {p: make_shared_weights(p) for p in PRESETS}


@pytest.fixture(scope="module", autouse=True)
def compiled(group: dist.ProcessGroup, mma_type: str) -> None:
    """Builds the role2 and role4 variants the module's calls use, in parallel."""
    buffers = [_buffer(group, preset, mma_type, partition)
               for preset, partition in [(p, "on") for p in PRESETS] + [(OFF_PRESET, "off")]]
    compile_variants(buffers, (*TOKENS, GRAPH_TOKENS), k32=False)


def _pairs(sw: Shared) -> Pairs:
    return {"shared_l1_weights": (sw[0].payload, sw[0].scales), "shared_l2_weights": (sw[1].payload, sw[1].scales)}


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("preset", PRESETS)
def test_accuracy_with_shared_expert(group: dist.ProcessGroup, weights: dict[str, RankWeights],
                                     shared: dict[str, Shared], mma_type: str, preset: str, tokens: int) -> None:
    sw = shared[preset]
    checked_call(_buffer(group, preset, mma_type, "on"), weights[preset], sw, _pairs(sw), preset, tokens,
                 seed=300 + tokens, form="block")


@pytest.mark.parametrize("tokens", (1, 37))
def test_partition_off(group: dist.ProcessGroup, weights: dict[str, RankWeights], shared: dict[str, Shared],
                       mma_type: str, tokens: int) -> None:
    """The roles in sequence on the whole device (role1 -> role4 -> role4_w2 -> role2 -> role3)."""
    preset = OFF_PRESET
    sw = shared[preset]
    checked_call(_buffer(group, preset, mma_type, "off"), weights[preset], sw, _pairs(sw), preset, tokens,
                 seed=400 + tokens, form="block")


def test_eager_and_graph_bit_identical(group: dist.ProcessGroup, weights: dict[str, RankWeights],
                                       shared: dict[str, Shared], mma_type: str) -> None:
    preset = "glm52"
    buf, w, sw = _buffer(group, preset, mma_type, "on"), weights[preset], shared[preset]
    e, k, h, _ = preset_dims(preset)
    inputs = make_inputs("uniform", GRAPH_TOKENS, e, k, h, seed=7)
    pairs = _pairs(sw)
    eager = assert_graph_matches_eager(buf, inputs, lambda y: CALLS[mma_type](y, w.w1, w.w2, buf, **pairs), "block")
    check_accuracy(eager, reference_results([inputs], [w], shared=sw)[0].y, f"{mma_type} eager", preset)


def test_refusals_before_anything_runs(group: dist.ProcessGroup, weights: dict[str, RankWeights],
                                       shared: dict[str, Shared], mma_type: str) -> None:
    """New shared weights first seen inside a capture: RuntimeError asking for one eager call; y stays poisoned
    (the K32 recipe runs: tests/operator/test_role4_shared_k32_gpu.py)."""
    preset = "tiny"
    buf, w, sw = _buffer(group, preset, mma_type, "on"), weights[preset], shared[preset]
    e, k, h, _ = preset_dims(preset)
    stage(buf, make_inputs("uniform", 5, e, k, h, seed=9))
    y = poisoned_y(5, h)
    fresh = {name: (p.clone(), s.clone()) for name, (p, s) in _pairs(sw).items()}
    outer = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="make one eager call"), torch.cuda.graph(outer):
        CALLS[mma_type](y, w.w1, w.w2, buf, **fresh)
    torch.cuda.synchronize()
    assert bool(y.isnan().all())


def test_facade_fp8_fp4_mega_moe_matches_the_native_call(group: dist.ProcessGroup, weights: dict[str, RankWeights],
                                                        shared: dict[str, Shared], mma_type: str) -> None:
    """``deep_gemm.fp8_fp4_mega_moe`` on a ``num_shared_experts=1`` facade buffer, with the originals' routed layout
    (transform_weights_for_mega_moe of the same canonical MXFP4 weights) and the SM90 shared form (L1 interleaved by
    8, FP32 block scales): the same bits as ``fp8_fp4_gc_moe`` on the same staged tokens."""
    if mma_type != "fp8xfp4":
        pytest.skip("fp8_mega_moe keeps the original's signature: no shared-expert arguments (refusal: CPU test)")
    preset = "tiny"
    sw = shared[preset]
    facade_pairs = {"shared_l1_weights": (layouts.interleave_gate_up(sw[0].payload), sw[0].scales),
                    "shared_l2_weights": (sw[1].payload, sw[1].scales)}
    assert_facade_matches_native(group, _buffer(group, preset, mma_type, "on"), weights[preset], sw, _pairs(sw),
                                 facade_pairs, preset, tokens=37, seed=11, what="block-scaled shared expert")
