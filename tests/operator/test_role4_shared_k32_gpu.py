"""The fused shared expert (role4) with DeepGEMM's shared recipe on one H200: FP8 E4M3 shared weights with per-row
UE8M0 K32 scales (``per_token_cast_to_fp8(w, use_ue8m0=True, gran_k=32)``), promoted per K32 MMA, on both compute
paths, against the quantization-faithful reference (whose ``"fp8_k32"`` weights dequantize each row's K32 groups
with their own scale).

The shared weights' K32 scales are made to differ between groups and rows (the draws times ``2^u``, ``u`` uniform in
``[-3, 3]`` per row and K32 group), so a kernel that applied a neighbouring group's or row's scale would miss the
partial's cosine. Every checked call starts from poisoned ring payloads, combine slots, role4's intermediate and
``y``; T = 0, 1, 17, 37 and the capacity (BM 8, 32, 64 and several blocks). Checked per call: role4's slot k
against the reference's slot-k partials (cosine >= 0.9999), ``y`` bit for bit the slot-order sum of the combine slots,
``y`` against the reference. Also: packed int32 words and uint8 codes give the same bits; eager vs graph replay
bit-identical; ``deep_gemm.fp8_fp4_mega_moe`` with DeepGEMM's transformed shared pairs (2-D, MN-major int32 scales in
UTCCP order, L1 interleaved) the same bits as the native call."""

from __future__ import annotations

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
from gc_moe_compat import quant
from gc_moe_compat.deep_gemm import _seam
from gc_moe_compat.operator import api
from gc_moe_compat.operator.sm90 import layer, role2_gemm, role4_shared
from gc_moe_compat.runtime import jit
from gc_moe_compat.testing.operator_workload import (
    CLAMP,
    make_expert_weights,
    make_shared_weights,
    reference_results,
)
from gc_moe_compat.testing.reference import ExpertWeights, accuracy_metrics

pytestmark = pytest.mark.gpu

PRESET = "tiny"
BIG = "dsv41-flash"  # the preset whose shared expert uses the K32 recipe (config.PRESETS' shared_weight_k_group)
MMA_TYPES = ("fp8xfp8", "fp8xfp4")
TOKENS = (0, 1, 17, 37, CAPACITY)
CALLS = {"fp8xfp8": api.fp8_fp8_gc_moe, "fp8xfp4": api.fp8_fp4_gc_moe}
PARTIAL_COSINE_MIN = 0.9999

_Shared = tuple[ExpertWeights, ExpertWeights]


def k32_shared(preset: str) -> _Shared:
    """The preset's shared expert draws, each row's K32 groups scaled by 2^u (u in [-3, 3], seeded), stored in
    ``"fp8_k32"`` (E4M3, FP32 power-of-two per-row K32 scales)."""
    g = torch.Generator(device="cuda").manual_seed(901)
    out = []
    for w in make_shared_weights(preset, fmt="bf16"):
        e, n, k = w.payload.shape
        u = torch.randint(-3, 4, (e, n, k // 32), generator=g, device="cuda").float()
        scaled = (w.payload.float().view(e, n, k // 32, 32) * torch.pow(2.0, u).unsqueeze(-1)).view(e, n, k)
        out.append(ExpertWeights.quantize(scaled, "fp8_k32"))
    return out[0], out[1]


def native_pairs(sw: _Shared, packed: bool = False) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The native API's K32 pairs: uint8 UE8M0 codes [1, N, K/32], or int32 words [1, N, K/128] (``packed``)."""
    def pair(w: ExpertWeights) -> tuple[torch.Tensor, torch.Tensor]:
        codes = quant.ue8m0_encode(w.scales)
        return w.payload, quant.pack_ue8m0_k32(codes) if packed else codes
    return {"shared_l1_weights": pair(sw[0]), "shared_l2_weights": pair(sw[1])}


@pytest.fixture(scope="module", params=MMA_TYPES)
def mma_type(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def weights(mma_type: str) -> dict[str, RankWeights]:
    return {p: make_weights(p, 0, mma_type=mma_type) for p in (PRESET, BIG)}


@pytest.fixture(scope="module")
def shared() -> dict[str, _Shared]:
    return {p: k32_shared(p) for p in (PRESET, BIG)}


_buffers: dict[tuple[str, str], api.GcMoeBuffer] = {}


def _buffer(group: dist.ProcessGroup, preset: str, mma_type: str) -> api.GcMoeBuffer:
    if (preset, mma_type) not in _buffers:
        e, k, h, inter = preset_dims(preset)
        _buffers[preset, mma_type] = api.get_symm_buffer_for_gc_moe(group, e, CAPACITY, k, h, inter, mma_type,
                                                                    num_shared_experts=1)
    return _buffers[preset, mma_type]


@pytest.fixture(scope="module", autouse=True)
def compiled(group: dist.ProcessGroup, mma_type: str) -> None:
    """Builds the role2 and K32 role4 variants the module's calls use, in parallel."""
    builds = set()
    for preset in (PRESET, BIG):
        buf = _buffer(group, preset, mma_type)
        for t in TOKENS:
            v2 = role2_gemm.role2_variant(api.ring_model(buf, t), t)
            builds.add((v2.source, tuple(sorted(v2.defines.items()))))
            for v4 in role4_shared.role4_variants(buf.shape, t, buf.current_compute_sms(), k32=True):
                builds.add((role4_shared.SOURCE, tuple(sorted(v4.defines.items()))))
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda b: jit.compile_cubin(b[0], dict(b[1])), sorted(builds)))


def _poison(buf: api.GcMoeBuffer) -> None:
    poison(buf)
    for name in ("shared_l2_acts", "shared_l2_acts_sf"):
        buf.view(name).view(torch.uint8).fill_(0xFF)


def _slot_order_sum(buf: api.GcMoeBuffer, tokens: int) -> torch.Tensor:
    k = buf.shape.topk
    valid = buf.topk_idx[:tokens] >= 0
    acc = torch.zeros(tokens, buf.shape.hidden, dtype=torch.float32, device="cuda")
    for s in range(k):
        acc = torch.where(valid[:, s, None], acc + buf.combine[s, :tokens].float(), acc)
    return (acc + buf.combine[k, :tokens].float()).to(torch.bfloat16)


def _checked_call(buf: api.GcMoeBuffer, w: RankWeights, sw: _Shared, preset: str, tokens: int, seed: int,
                  packed: bool = False) -> torch.Tensor:
    e, k, h, _ = preset_dims(preset)
    inputs = make_inputs("uniform", tokens, e, k, h, seed)
    stage(buf, inputs)
    _poison(buf)
    y = poisoned_y(tokens, h)
    CALLS[buf.shape.mma_type](y, w.w1, w.w2, buf, **native_pairs(sw, packed))
    torch.cuda.synchronize()
    layer.raise_for_layer_status(buf, "k32 shared call")
    what = f"{buf.shape.mma_type} {preset} K32 shared T={tokens}"
    if tokens:
        ref = reference_results([inputs], [w], shared=sw)[0]
        m = accuracy_metrics(buf.combine[k, :tokens].float(), ref.partials[:, k].float())
        print(f"{what}: role4 slot k vs reference {m}")
        assert m["nonfinite"] == 0 and m["cosine"] >= PARTIAL_COSINE_MIN, f"{what}: role4 slot k {m}"
        assert_bits_equal(y, _slot_order_sum(buf, tokens), f"{what}: y vs the slot-order sum of combine")
        check_accuracy(y, ref.y, what, preset)
    return y


@pytest.mark.parametrize("tokens", TOKENS)
def test_k32_shared_accuracy(group: dist.ProcessGroup, weights: dict[str, RankWeights], shared: dict[str, _Shared],
                             mma_type: str, tokens: int) -> None:
    _checked_call(_buffer(group, PRESET, mma_type), weights[PRESET], shared[PRESET], PRESET, tokens, 500 + tokens)


@pytest.mark.parametrize("tokens", (1, 37))
def test_k32_shared_accuracy_dsv41_flash(group: dist.ProcessGroup, weights: dict[str, RankWeights],
                                         shared: dict[str, _Shared], mma_type: str, tokens: int) -> None:
    _checked_call(_buffer(group, BIG, mma_type), weights[BIG], shared[BIG], BIG, tokens, 600 + tokens)


def test_packed_words_and_codes_give_the_same_bits(group: dist.ProcessGroup, weights: dict[str, RankWeights],
                                                   shared: dict[str, _Shared], mma_type: str) -> None:
    buf, w, sw = _buffer(group, PRESET, mma_type), weights[PRESET], shared[PRESET]
    codes = _checked_call(buf, w, sw, PRESET, 37, seed=71).clone()
    assert_bits_equal(_checked_call(buf, w, sw, PRESET, 37, seed=71, packed=True), codes, "int32 words vs codes")


def test_k32_eager_and_graph_bit_identical(group: dist.ProcessGroup, weights: dict[str, RankWeights],
                                           shared: dict[str, _Shared], mma_type: str) -> None:
    buf, w, sw = _buffer(group, PRESET, mma_type), weights[PRESET], shared[PRESET]
    e, k, h, _ = preset_dims(PRESET)
    stage(buf, make_inputs("uniform", 37, e, k, h, seed=8))
    y = poisoned_y(37, h)
    pairs = native_pairs(sw)
    CALLS[mma_type](y, w.w1, w.w2, buf, **pairs)
    eager = y.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        CALLS[mma_type](y, w.w1, w.w2, buf, **pairs)
    for i in range(2):
        _poison(buf)
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        layer.raise_for_layer_status(buf, f"graph replay {i}")
        assert_bits_equal(y, eager, f"K32 graph replay {i}")


def _deepgemm_form(w: ExpertWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """What DeepGEMM's test_mega_moe.py hands transform_weights_for_mega_moe: 2-D E4M3 [N, K] and the MN-major copy
    of the packed int32 words [N, K/128] (its x_sf_tma)."""
    words = quant.pack_ue8m0_k32(quant.ue8m0_encode(w.scales))[0]
    n = words.shape[0]
    return w.payload[0], torch.empty_strided(words.shape, (1, n), dtype=torch.int32, device="cuda").copy_(words)


def test_facade_with_deepgemms_shared_recipe_matches_the_native_call(
        group: dist.ProcessGroup, weights: dict[str, RankWeights], shared: dict[str, _Shared], mma_type: str) -> None:
    """dg.fp8_fp4_mega_moe on a num_shared_experts=1 facade buffer, routed weights and shared weights both through
    dg.transform_weights_for_mega_moe as DeepGEMM's test prepares them: the native call's bits."""
    if mma_type != "fp8xfp4":
        pytest.skip("fp8_mega_moe keeps the original's signature: no shared-expert arguments")
    tokens = 37
    e, k, h, inter = preset_dims(PRESET)
    sym = dg.get_symm_buffer_for_mega_moe(group, e, CAPACITY, k, h, inter, num_shared_experts=1, mma_type=mma_type)
    native, w, sw = _buffer(group, PRESET, mma_type), weights[PRESET], shared[PRESET]
    inputs = make_inputs("uniform", tokens, e, k, h, seed=12)
    stage(native, inputs)
    stage(_seam.workspace_of(sym), inputs)
    y_native, y_facade = poisoned_y(tokens, h), poisoned_y(tokens, h)
    CALLS[mma_type](y_native, w.w1, w.w2, native, **native_pairs(sw))
    l1, l2 = make_expert_weights(PRESET, 0, fmt="mxfp4")
    r1, r2 = dg.transform_weights_for_mega_moe((l1.payload, quant.pack_ue8m0_k32(l1.scales)),
                                               (l2.payload, quant.pack_ue8m0_k32(l2.scales)))
    s1, s2 = dg.transform_weights_for_mega_moe(_deepgemm_form(sw[0]), _deepgemm_form(sw[1]))
    dg.fp8_fp4_mega_moe(y_facade, r1, r2, sym, shared_l1_weights=s1, shared_l2_weights=s2, activation_clamp=CLAMP)
    torch.cuda.synchronize()
    assert_bits_equal(y_facade, y_native, "facade (DeepGEMM's K32 shared recipe) vs native")
    check_accuracy(y_facade, reference_results([inputs], [w], shared=sw)[0].y, "facade K32 shared", PRESET)
