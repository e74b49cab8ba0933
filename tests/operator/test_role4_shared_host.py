"""Role4 (the fused shared expert, operator/sm90/role4_shared.py <-> kernels/sm90/role4_shared.cu) on the host: its
status sites are the standalone body's, the block-size and variant rules, the shared-memory formula against the
kernel's own (a compile-time assert), every variant builds without spills or serialized WGMMAs, the weight-form
and inference-tensor refusals, the K32 weights' conversion to the kernel's words."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from nvcc_mark import needs_nvcc, serialized_wgmma

from gc_moe_compat import config, layouts, quant
from gc_moe_compat.operator.heuristics import BLOCK_M_CANDIDATES, SMEM_LIMIT
from gc_moe_compat.operator.sm90 import layer, role2_gemm, role4_shared
from gc_moe_compat.operator.sm90.role4_shared import Role4Site, Role4Variant
from gc_moe_compat.runtime import jit

H, N_I = 512, 256


def test_sites_are_the_standalone_bodys() -> None:
    """The kernel reports the grouped sites 1-3 of kernels/sm90/grouped.cuh into role4's record."""
    grouped = {s.name: int(s) for s in (role2_gemm.Role2Site.SMEM, role2_gemm.Role2Site.EMPTY,
                                        role2_gemm.Role2Site.FULL)}
    assert {s.name: int(s) for s in Role4Site} == grouped
    assert all(d.startswith("role4 ") for d in Role4Site.names().values())


@pytest.mark.parametrize(("tokens", "bm"), [(0, 8), (1, 8), (8, 8), (9, 16), (17, 32), (33, 64), (64, 64),
                                            (65, 64), (8192, 64)])
def test_block_m_holds_every_token(tokens: int, bm: int) -> None:
    assert role4_shared.block_m_for_shared(tokens) == bm


@pytest.mark.parametrize("bad", [-1, 1.5, True, None])
def test_block_m_rejects_bad_token_counts(bad: object) -> None:
    with pytest.raises(ValueError, match="num_tokens: must be an int >= 0"):
        role4_shared.block_m_for_shared(bad)


def test_variant_rule() -> None:
    """BM from the token count, the producer warpgroup once a CTA has two tasks, the scale rule of the path."""
    # 2I = 4096 rows: 16 W1 tasks per block; H = 7168: 56 W2 tasks (128-row tasks) per block
    v = role4_shared.role4_variant(1, 4096, 1, 128, mma_type="fp8xfp8")
    assert (v.bm, v.pipelined, v.ue8m0, v.slabs) == (8, False, False, 2)
    v = role4_shared.role4_variant(256, 7168, 2, 128, mma_type="fp8xfp4")
    assert (v.bm, v.pipelined, v.ue8m0, v.slabs) == (64, True, True, 1)  # 4 blocks x 56 tasks > 128 SMs
    assert not role4_shared.role4_variant(64, 4096, 1, 16, mma_type="fp8xfp8").pipelined  # 16 tasks, 16 SMs
    assert role4_shared.role4_variant(65, 4096, 1, 16, mma_type="fp8xfp8").pipelined  # two blocks: 32 tasks
    with pytest.raises(ValueError, match="variant: bm in"):
        Role4Variant(12, 1, False)


@pytest.mark.parametrize("epi", [1, 2])
@pytest.mark.parametrize("bm", BLOCK_M_CANDIDATES)
def test_shared_memory_fits_with_at_least_two_stages(bm: int, epi: int) -> None:
    v = Role4Variant(bm, epi, True)
    assert v.stages >= 2 and v.smem <= SMEM_LIMIT
    assert v.defines["GC_ROLE4_SMEM_BYTES"] == v.smem and v.threads == 384


@pytest.mark.parametrize("bm", BLOCK_M_CANDIDATES)
def test_task_scale_region_takes_stages_only_when_it_must(bm: int) -> None:
    """The W1 task-scale region (4 * BM * H/128 bytes) sits beside the stages; a stage goes only when it does not
    fit (H = 7168: never; a region of 512 groups at BM 64: down to 2 stages), beyond that the variant is refused."""
    plain = Role4Variant(bm, 1, True)
    for groups in (56, 64):
        v = Role4Variant(bm, 1, True, task_scales=groups)
        assert v.stages == plain.stages and v.smem == plain.smem + 4 * bm * groups <= SMEM_LIMIT
        assert v.defines["GC_TASK_SCALES"] == groups
    big = Role4Variant(64, 1, True, task_scales=512)
    assert big.stages == 2 and big.smem <= SMEM_LIMIT
    with pytest.raises(ValueError, match="task_scales=1024 at bm=64 needs"):
        Role4Variant(64, 1, True, task_scales=1024)
    for bad, epi in ((4, 2), (-1, 1), (True, 1), (1.5, 1)):
        with pytest.raises(ValueError, match="variant: task_scales must be an int >= 0"):
            Role4Variant(bm, epi, True, task_scales=bad)


def test_variants_of_a_call() -> None:
    """role4_variants: W1 with H/128 task-scale groups (none with task_scales=False), W2 without; both with the
    weights' scale form."""
    shape = config.preset_shape("dsv3", 8, mma_type="fp8xfp8")
    w1, w2 = role4_shared.role4_variants(shape, 64, 112, k32=True)
    assert (w1.epi, w1.task_scales, w1.k32, w2.epi, w2.task_scales, w2.k32) == (1, 56, True, 2, 0, True)
    assert role4_shared.role4_variants(shape, 64, 112, task_scales=False)[0].task_scales == 0


_VARIANTS = [Role4Variant(bm, epi, p, ue8m0=u, k32=k, task_scales=56 if epi == 1 else 0) for bm in (8, 64)
             for epi in (1, 2) for p in (True, False) for u in ((False, True) if epi == 1 and bm == 64 else (False,))
             for k in (False, True)] + [Role4Variant(64, 1, p, k32=k) for p in (True, False) for k in (False, True)]


@needs_nvcc
@pytest.mark.parametrize("variant", _VARIANTS,
                         ids=lambda v: f"bm{v.bm}-epi{v.epi}-prod{int(v.pipelined)}-ue{int(v.ue8m0)}-k32{int(v.k32)}"
                                       f"-ts{v.task_scales}")
def test_variants_compile_without_spills(variant: Role4Variant, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    """Builds for sm_90a (which asserts kSmemBytes == Role4Variant.smem): no stack, no spills, no serialized WGMMA,
    the producer layout's 168-register cap."""
    monkeypatch.setenv("GC_MOE_CACHE_DIR", str(tmp_path))
    cubin = jit.compile_cubin(role4_shared.SOURCE, variant.defines)
    res = cubin.resources[role4_shared.KERNEL]
    assert res.spill_stores == 0 and res.spill_loads == 0 and res.stack_bytes == 0
    assert not serialized_wgmma(cubin.warnings)
    assert res.registers <= (168 if variant.pipelined else 255)


@needs_nvcc
def test_a_drifted_smem_formula_fails_to_compile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GC_MOE_CACHE_DIR", str(tmp_path))
    v = Role4Variant(16, 1, False)
    with pytest.raises(jit.JitError, match="GC_ROLE4_SMEM_BYTES"):
        jit.compile_cubin(role4_shared.SOURCE, {**v.defines, "GC_ROLE4_SMEM_BYTES": v.smem + 16})


def _shared_pairs(scale_form: str = "block") -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    g = torch.Generator().manual_seed(3)
    w1, w2 = torch.randn(1, 2 * N_I, H, generator=g), torch.randn(1, H, N_I, generator=g)
    if scale_form == "block":
        return quant.quantize_fp8_blocks(w1), quant.quantize_fp8_blocks(w2)
    out = []
    for w in (w1, w2):
        payload, sf = quant.quantize_fp8_groups(w, 32, "ue8m0")
        codes = quant.ue8m0_encode(sf)
        out.append((payload, codes if scale_form == "k32" else quant.pack_ue8m0_k32(codes)))
    return tuple(out)


def _words_model(codes: torch.Tensor, interleave: bool) -> torch.Tensor:
    """The kernel's int32 words [1, K/128, N] by loops over rows: word (kb, r) packs the codes of K32 groups
    4kb..4kb+3 of source row src(r) (gate row 8j + i / up row I + 8j + i at interleaved row 16j + i / 16j + 8 + i),
    group 4kb + b in byte b."""
    _, n, groups = codes.shape
    out = torch.zeros(1, groups // 4, n, dtype=torch.int64)
    for r in range(n):
        j, i = divmod(r, 16)
        src = (j * 8 + i if i < 8 else n // 2 + j * 8 + i - 8) if interleave else r
        for kb in range(groups // 4):
            out[0, kb, r] = sum(int(codes[0, src, 4 * kb + b]) << (8 * b) for b in range(4))
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


@pytest.mark.parametrize("form", ["k32", "k32_packed"])
def test_k32_shared_weights_become_transposed_words(form: str) -> None:
    """DeepGEMM's shared recipe (per-row UE8M0 K32, uint8 codes or packed int32): the payload interleaved for L1
    only, the scales as int32 words [1, K/128, N] in the payload's row order (checked against a loop model)."""
    l1, l2 = _shared_pairs(form)
    for gemm, (payload, sf), interleave in (("l1", l1, True), ("l2", l2, False)):
        codes = quant.unpack_ue8m0_k32(sf) if sf.dtype == torch.int32 else sf
        got_payload, words = role4_shared._k32_words(gemm, (payload, sf))
        want_payload = layouts.interleave_gate_up(payload) if interleave else payload
        assert torch.equal(got_payload.view(torch.uint8), want_payload.view(torch.uint8))
        assert words.dtype == torch.int32 and words.is_contiguous()
        assert torch.equal(words, _words_model(codes, interleave)), gemm


def test_mixed_shared_scale_forms_are_refused() -> None:
    """One pair with block scales and the other with K32 scales: ValueError naming both, before any conversion."""
    (b1, _), (_, k2) = _shared_pairs(), _shared_pairs("k32")
    with pytest.raises(ValueError, match="both pairs must use one scale form"):
        role4_shared.Role4Weights(b1, k2)


def test_shared_key_follows_versions_and_refuses_inference_tensors() -> None:
    l1, l2 = _shared_pairs()
    key = layer._shared_key(l1, l2)
    assert layer._shared_key(l1, l2) == key
    l1[0].view(torch.uint8)[0, 0, 0] ^= 1  # an in-place update moves the version counter
    assert layer._shared_key(l1, l2) != key
    with torch.inference_mode():
        frozen = (l2[0].clone(), l2[1].clone())
    with pytest.raises(ValueError, match=r"shared_l2_weights\[0\]: is an inference tensor"):
        layer._shared_key(l1, frozen)


def test_reserve_rule() -> None:
    """Beside role2 up to one role4 token block (T <= 64): role4's larger GEMM's tasks, at most a quarter of the
    compute SMs; above one block, or without tokens, 0 (before role2)."""
    dsv3 = config.MoEShape(num_experts=256, num_ranks=8, capacity=256, topk=8, hidden=7168, intermediate=2048)
    # W1: 2I / 256 = 16 tasks per block, W2: H / 128 = 56: capped at 128 // 4 = 32
    assert [role4_shared.reserve_sms(dsv3, t, 128) for t in (0, 1, 8, 9, 16, 33, 64, 65, 128, 256)] == \
        [0, 32, 32, 32, 32, 32, 32, 0, 0, 0]
    assert role4_shared.reserve_sms(dsv3, 1, 112) == 28
    small = config.MoEShape(num_experts=8, num_ranks=1, capacity=64, topk=2, hidden=H, intermediate=N_I)
    assert role4_shared.reserve_sms(small, 5, 128) == H // 128  # W2 4 tasks, W1 2: the whole role4 grid
