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

import pytest
import torch
import torch.distributed as dist
from operator_kit import CALLS, CAPACITY, RankWeights, assert_bits_equal, make_inputs, make_weights, preset_dims
from role4_kit import (
    Pairs,
    Shared,
    SharedBuffers,
    assert_facade_matches_native,
    assert_graph_matches_eager,
    checked_call,
    compile_variants,
)

import gc_moe_compat.deep_gemm as dg
from gc_moe_compat import quant
from gc_moe_compat.operator import api
from gc_moe_compat.references.operator_workload import make_shared_weights
from gc_moe_compat.references.reference import ExpertWeights

pytestmark = pytest.mark.gpu

PRESET = "tiny"
BIG = "dsv41-flash"  # the preset whose shared expert uses the K32 recipe (config.PRESETS' shared_weight_k_group)
MMA_TYPES = ("fp8xfp8", "fp8xfp4")
TOKENS = (0, 1, 17, 37, CAPACITY)

_buffer = SharedBuffers()


def k32_shared(preset: str) -> Shared:
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


def native_pairs(sw: Shared, packed: bool = False) -> Pairs:
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
def shared() -> dict[str, Shared]:
    return {p: k32_shared(p) for p in (PRESET, BIG)}


@pytest.fixture(scope="module", autouse=True)
def compiled(group: dist.ProcessGroup, mma_type: str) -> None:
    """Builds the role2 and K32 role4 variants the module's calls use, in parallel."""
    compile_variants([_buffer(group, preset, mma_type) for preset in (PRESET, BIG)], TOKENS, k32=True)


def _checked_call(buf: api.GcMoeBuffer, w: RankWeights, sw: Shared, preset: str, tokens: int, seed: int,
                  packed: bool = False) -> torch.Tensor:
    return checked_call(buf, w, sw, native_pairs(sw, packed), preset, tokens, seed, "K32", check_status=True)


@pytest.mark.parametrize("tokens", TOKENS)
def test_k32_shared_accuracy(group: dist.ProcessGroup, weights: dict[str, RankWeights], shared: dict[str, Shared],
                             mma_type: str, tokens: int) -> None:
    _checked_call(_buffer(group, PRESET, mma_type), weights[PRESET], shared[PRESET], PRESET, tokens, 500 + tokens)


@pytest.mark.parametrize("tokens", (1, 37))
def test_k32_shared_accuracy_dsv41_flash(group: dist.ProcessGroup, weights: dict[str, RankWeights],
                                         shared: dict[str, Shared], mma_type: str, tokens: int) -> None:
    _checked_call(_buffer(group, BIG, mma_type), weights[BIG], shared[BIG], BIG, tokens, 600 + tokens)


def test_packed_words_and_codes_give_the_same_bits(group: dist.ProcessGroup, weights: dict[str, RankWeights],
                                                   shared: dict[str, Shared], mma_type: str) -> None:
    buf, w, sw = _buffer(group, PRESET, mma_type), weights[PRESET], shared[PRESET]
    codes = _checked_call(buf, w, sw, PRESET, 37, seed=71).clone()
    assert_bits_equal(_checked_call(buf, w, sw, PRESET, 37, seed=71, packed=True), codes, "int32 words vs codes")


def test_k32_eager_and_graph_bit_identical(group: dist.ProcessGroup, weights: dict[str, RankWeights],
                                           shared: dict[str, Shared], mma_type: str) -> None:
    buf, w, sw = _buffer(group, PRESET, mma_type), weights[PRESET], shared[PRESET]
    e, k, h, _ = preset_dims(PRESET)
    pairs = native_pairs(sw)
    assert_graph_matches_eager(buf, make_inputs("uniform", 37, e, k, h, seed=8),
                               lambda y: CALLS[mma_type](y, w.w1, w.w2, buf, **pairs), "K32")


def _deepgemm_form(w: ExpertWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """What DeepGEMM's test_mega_moe.py hands transform_weights_for_mega_moe: 2-D E4M3 [N, K] and the MN-major copy
    of the packed int32 words [N, K/128] (its x_sf_tma)."""
    words = quant.pack_ue8m0_k32(quant.ue8m0_encode(w.scales))[0]
    n = words.shape[0]
    return w.payload[0], torch.empty_strided(words.shape, (1, n), dtype=torch.int32, device="cuda").copy_(words)


def test_facade_with_deepgemms_shared_recipe_matches_the_native_call(
        group: dist.ProcessGroup, weights: dict[str, RankWeights], shared: dict[str, Shared], mma_type: str) -> None:
    """dg.fp8_fp4_mega_moe on a num_shared_experts=1 facade buffer, routed weights and shared weights both through
    dg.transform_weights_for_mega_moe as DeepGEMM's test prepares them: the native call's bits."""
    if mma_type != "fp8xfp4":
        pytest.skip("fp8_mega_moe keeps the original's signature: no shared-expert arguments")
    sw = shared[PRESET]
    s1, s2 = dg.transform_weights_for_mega_moe(_deepgemm_form(sw[0]), _deepgemm_form(sw[1]))
    assert_facade_matches_native(group, _buffer(group, PRESET, mma_type), weights[PRESET], sw, native_pairs(sw),
                                 {"shared_l1_weights": s1, "shared_l2_weights": s2}, PRESET, tokens=37, seed=12,
                                 what="DeepGEMM's K32 shared recipe")
