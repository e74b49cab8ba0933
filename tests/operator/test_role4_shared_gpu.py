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

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist
from operator_kit import (
    CAPACITY,
    RankWeights,
    assert_bits_equal,
    check_accuracy,
    make_inputs,
    make_weights,
    poison,
    poisoned_y,
    preset_dims,
    stage,
)

import gc_moe_compat.deep_gemm as dg
from gc_moe_compat import layouts, quant
from gc_moe_compat.deep_gemm import _seam
from gc_moe_compat.operator import api
from gc_moe_compat.operator.sm90 import layer, role2_gemm, role4_shared
from gc_moe_compat.runtime import jit
from gc_moe_compat.testing.operator_workload import CLAMP, make_expert_weights, make_shared_weights, reference_results
from gc_moe_compat.testing.reference import ExpertWeights, accuracy_metrics

pytestmark = pytest.mark.gpu

PRESETS = ("tiny", "glm52")
MMA_TYPES = ("fp8xfp8", "fp8xfp4")
TOKENS = (0, 1, 37, CAPACITY)
GRAPH_TOKENS = 64
OFF_PRESET = "glm52"
CALLS: dict[str, Callable[..., None]] = {"fp8xfp8": api.fp8_fp8_gc_moe, "fp8xfp4": api.fp8_fp4_gc_moe}
SHARED_REGIONS = ("shared_l2_acts", "shared_l2_acts_sf")
PARTIAL_COSINE_MIN = 0.9999

_Shared = tuple[ExpertWeights, ExpertWeights]


@pytest.fixture(scope="module", params=MMA_TYPES)
def mma_type(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def weights(mma_type: str) -> dict[str, RankWeights]:
    return {p: make_weights(p, 0, mma_type=mma_type) for p in PRESETS}


@pytest.fixture(scope="module")
def shared() -> dict[str, _Shared]:
    return {p: make_shared_weights(p) for p in PRESETS}


_buffers: dict[tuple[str, str, str], api.GcMoeBuffer] = {}


def _buffer(group: dist.ProcessGroup, preset: str, mma_type: str, partition: str = "on") -> api.GcMoeBuffer:
    key = (preset, mma_type, partition)
    if key not in _buffers:
        e, k, h, inter = preset_dims(preset)
        _buffers[key] = api.get_symm_buffer_for_gc_moe(group, e, CAPACITY, k, h, inter, mma_type,
                                                       num_shared_experts=1, partition=partition)
    return _buffers[key]


@pytest.fixture(scope="module", autouse=True)
def compiled(group: dist.ProcessGroup, mma_type: str) -> None:
    """Builds the role2 and role4 variants the module's calls use, in parallel (nvcc runs are independent
    processes; the JIT cache then serves every launch)."""
    builds = set()
    for preset, partition in [(p, "on") for p in PRESETS] + [(OFF_PRESET, "off")]:
        buf = _buffer(group, preset, mma_type, partition)
        for t in (*TOKENS, GRAPH_TOKENS):
            v2 = role2_gemm.role2_variant(api.ring_model(buf, t), t)
            builds.add((v2.source, tuple(sorted(v2.defines.items()))))
            for v4 in role4_shared.role4_variants(buf.shape, t, buf.current_compute_sms()):
                builds.add((role4_shared.SOURCE, tuple(sorted(v4.defines.items()))))
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda b: jit.compile_cubin(b[0], dict(b[1])), sorted(builds)))


def _pairs(sw: _Shared) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {"shared_l1_weights": (sw[0].payload, sw[0].scales), "shared_l2_weights": (sw[1].payload, sw[1].scales)}


def _run(buf: api.GcMoeBuffer, w: RankWeights, sw: _Shared, y: torch.Tensor, **kw: object) -> None:
    CALLS[buf.shape.mma_type](y, w.w1, w.w2, buf, **_pairs(sw), **kw)


def _poison(buf: api.GcMoeBuffer) -> None:
    poison(buf)
    for name in SHARED_REGIONS:
        buf.view(name).view(torch.uint8).fill_(0xFF)


def _slot_order_sum(buf: api.GcMoeBuffer, tokens: int) -> torch.Tensor:
    """BF16 of the FP32 sum of this rank's combine slots in slot order: the valid routed slots, then slot k."""
    k = buf.shape.topk
    valid = buf.topk_idx[:tokens] >= 0
    acc = torch.zeros(tokens, buf.shape.hidden, dtype=torch.float32, device="cuda")
    for s in range(k):
        acc = torch.where(valid[:, s, None], acc + buf.combine[s, :tokens].float(), acc)
    return (acc + buf.combine[k, :tokens].float()).to(torch.bfloat16)


def _checked_call(buf: api.GcMoeBuffer, w: RankWeights, sw: _Shared, preset: str, tokens: int,
                  seed: int) -> torch.Tensor:
    """Stage seeded inputs, poison, run eagerly, check role4's slot, role3's slot-order sum and y."""
    e, k, h, _ = preset_dims(preset)
    inputs = make_inputs("uniform", tokens, e, k, h, seed)
    stage(buf, inputs)
    _poison(buf)
    y = poisoned_y(tokens, h)
    _run(buf, w, sw, y)
    torch.cuda.synchronize()
    what = f"{buf.shape.mma_type} {preset} T={tokens} partition={buf.partition}"
    if tokens:
        ref = reference_results([inputs], [w], shared=sw)[0]
        m = accuracy_metrics(buf.combine[k, :tokens].float(), ref.partials[:, k].float())
        print(f"{what}: role4 slot k vs reference {m}")
        assert m["nonfinite"] == 0 and m["cosine"] >= PARTIAL_COSINE_MIN, f"{what}: role4 slot k {m}"
        assert_bits_equal(y, _slot_order_sum(buf, tokens), f"{what}: y vs the slot-order sum of combine")
        check_accuracy(y, ref.y, what, preset)
    return y


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("preset", PRESETS)
def test_accuracy_with_shared_expert(group: dist.ProcessGroup, weights: dict[str, RankWeights],
                                     shared: dict[str, _Shared], mma_type: str, preset: str, tokens: int) -> None:
    _checked_call(_buffer(group, preset, mma_type), weights[preset], shared[preset], preset, tokens,
                  seed=300 + tokens)


@pytest.mark.parametrize("tokens", (1, 37))
def test_partition_off(group: dist.ProcessGroup, weights: dict[str, RankWeights], shared: dict[str, _Shared],
                       mma_type: str, tokens: int) -> None:
    """The roles in sequence on the whole device (role1 -> role4 -> role4_w2 -> role2 -> role3)."""
    preset = OFF_PRESET
    _checked_call(_buffer(group, preset, mma_type, "off"), weights[preset], shared[preset], preset, tokens,
                  seed=400 + tokens)


def test_eager_and_graph_bit_identical(group: dist.ProcessGroup, weights: dict[str, RankWeights],
                                       shared: dict[str, _Shared], mma_type: str) -> None:
    preset = "glm52"
    buf, w, sw = _buffer(group, preset, mma_type), weights[preset], shared[preset]
    e, k, h, _ = preset_dims(preset)
    inputs = make_inputs("uniform", GRAPH_TOKENS, e, k, h, seed=7)
    stage(buf, inputs)
    y = poisoned_y(GRAPH_TOKENS, h)
    _run(buf, w, sw, y)
    eager = y.clone()
    outer = torch.cuda.CUDAGraph()
    with torch.cuda.graph(outer):
        _run(buf, w, sw, y)
    for i in range(2):
        _poison(buf)
        y.fill_(float("nan"))
        outer.replay()
        torch.cuda.synchronize()
        layer.raise_for_layer_status(buf, f"graph replay {i}")
        assert_bits_equal(y, eager, f"graph replay {i}")
    check_accuracy(eager, reference_results([inputs], [w], shared=sw)[0].y, f"{mma_type} eager", preset)


def test_refusals_before_anything_runs(group: dist.ProcessGroup, weights: dict[str, RankWeights],
                                       shared: dict[str, _Shared], mma_type: str) -> None:
    """New shared weights first seen inside a capture: RuntimeError asking for one eager call; y stays poisoned
    (the K32 recipe runs: tests/operator/test_role4_shared_k32_gpu.py)."""
    preset = "tiny"
    buf, w, sw = _buffer(group, preset, mma_type), weights[preset], shared[preset]
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
                                                        shared: dict[str, _Shared], mma_type: str) -> None:
    """``deep_gemm.fp8_fp4_mega_moe`` on a ``num_shared_experts=1`` facade buffer, with the originals' routed layout
    (transform_weights_for_mega_moe of the same canonical MXFP4 weights) and the SM90 shared form (L1 interleaved by
    8, FP32 block scales): the same bits as ``fp8_fp4_gc_moe`` on the same staged tokens."""
    if mma_type != "fp8xfp4":
        pytest.skip("fp8_mega_moe keeps the original's signature: no shared-expert arguments (refusal: CPU test)")
    preset, tokens = "tiny", 37
    e, k, h, inter = preset_dims(preset)
    sym = dg.get_symm_buffer_for_mega_moe(group, e, CAPACITY, k, h, inter, num_shared_experts=1, mma_type=mma_type)
    native, w, sw = _buffer(group, preset, mma_type), weights[preset], shared[preset]
    inputs = make_inputs("uniform", tokens, e, k, h, seed=11)
    stage(native, inputs)
    stage(_seam.workspace_of(sym), inputs)
    y_native, y_facade = poisoned_y(tokens, h), poisoned_y(tokens, h)
    _run(native, w, sw, y_native)
    l1, l2 = make_expert_weights(preset, 0, fmt="mxfp4")
    r1, r2 = dg.transform_weights_for_mega_moe((l1.payload, quant.pack_ue8m0_k32(l1.scales)),
                                               (l2.payload, quant.pack_ue8m0_k32(l2.scales)))
    s1 = (layouts.interleave_gate_up(sw[0].payload), sw[0].scales)
    dg.fp8_fp4_mega_moe(y_facade, r1, r2, sym, shared_l1_weights=s1, shared_l2_weights=(sw[1].payload, sw[1].scales),
                        activation_clamp=CLAMP)
    torch.cuda.synchronize()
    assert_bits_equal(y_facade, y_native, "facade vs native with a shared expert")
    check_accuracy(y_facade, reference_results([inputs], [w], shared=sw)[0].y, "facade fp8_fp4_mega_moe", preset)
