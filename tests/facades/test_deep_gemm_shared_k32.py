"""DeepGEMM's shared-expert recipe through the deep_gemm facade on the host: what DeepGEMM 2.8.2's
tests/test_mega_moe.py builds (``per_token_cast_to_fp8(w, use_ue8m0=True, gran_k=32, use_packed_ue8m0=True)``, MN-major
int32 scales, then ``transform_weights_for_mega_moe(shared_l1, shared_l2)`` on the 2-D pairs) becomes the native
API's canonical K32 pairs exactly, once per weight tensor; the refusals name the argument and the rule.

The DeepGEMM side is modelled here independently of the facade's layouts module: the cast (amax per 32 clamped at
1e-4, the ceil power of two of amax/448, payload x * (1/sf)), the packing (byte j of a word = K32 group 4i + j), the
gate/up interleave (``stack([gate, up], 2)`` in runs of 8) and the UTCCP transpose (``reshape(mn/128, 4, 32, k')
.transpose``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import gc_moe_compat.deep_gemm as dg
from gc_moe_compat.deep_gemm import _mega

H, N_I, E, K, TMAX = 512, 256, 8, 2, 32
FN = "fp8_fp4_mega_moe"

_Pair = tuple[torch.Tensor, torch.Tensor]


def _cast_k32(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepGEMM's per_token_cast_to_fp8(w, use_ue8m0=True, gran_k=32, use_packed_ue8m0=True), modelled: E4M3 payload,
    canonical int32 words [N, K/128], and the MN-major copy of the words test_mega_moe.py hands on (x_sf_tma)."""
    n, k = w.shape
    view = w.float().view(n, k // 32, 32)
    sf = view.abs().amax(2).clamp(min=1e-4) / 448.0
    sf = torch.pow(2.0, torch.ceil(torch.log2(sf)))
    payload = (view * (1.0 / sf.unsqueeze(2))).to(torch.float8_e4m3fn).view(n, k)
    codes = (torch.log2(sf).round().to(torch.int64) + 127).view(n, k // 128, 4)
    words = sum(codes[..., b] << (8 * b) for b in range(4))
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    mn_major = torch.empty_strided((n, k // 128), (1, n), dtype=torch.int32).copy_(words)
    return payload, words, mn_major


def _interleave(t: torch.Tensor) -> torch.Tensor:
    n = t.shape[0]
    gate, up = t[:n // 2].reshape(n // 16, 8, -1), t[n // 2:].reshape(n // 16, 8, -1)
    return torch.stack([gate, up], 1).reshape(n, -1)


def _utccp(sf: torch.Tensor) -> torch.Tensor:
    n, k = sf.shape
    return sf.reshape(n // 128, 4, 32, k).transpose(1, 2).reshape(n, k)


def _deepgemm_shared() -> tuple[tuple[_Pair, _Pair], tuple[_Pair, _Pair]]:
    """(canonical pairs [1, N, K'] contiguous, DeepGEMM's transformed 2-D pairs) of one random shared expert."""
    g = torch.Generator().manual_seed(5)
    w1 = torch.randn(2 * N_I, H, generator=g).to(torch.bfloat16)
    w2 = torch.randn(H, N_I, generator=g).to(torch.bfloat16)
    (p1, c1, m1), (p2, c2, m2) = _cast_k32(w1), _cast_k32(w2)
    canonical = ((p1[None], c1[None]), (p2[None], c2[None]))
    # transform_weights_for_mega_moe (empty_like(t).copy_(...): the MN-major strides stay)
    t1 = (_interleave(p1.view(torch.uint8)).view(torch.float8_e4m3fn),
          torch.empty_like(m1).copy_(_utccp(torch.empty_like(m1).copy_(_interleave(m1)))))
    t2 = (p2, torch.empty_like(m2).copy_(_utccp(m2)))
    return canonical, (t1, t2)


def _sym(group: dist.ProcessGroup) -> dg.SymmBuffer:
    return dg.get_symm_buffer_for_mega_moe(group, E, TMAX, K, H, N_I, num_shared_experts=1)


def _equal(a: _Pair, b: _Pair) -> bool:
    return (a[0].shape == b[0].shape and torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8))
            and torch.equal(a[1], b[1]))


def test_the_facades_transform_is_deepgemms_for_shared_pairs() -> None:
    """dg.transform_weights_for_mega_moe on the 2-D K32 shared pairs gives the modelled DeepGEMM result, strides
    included (the MN-major scales stay MN-major)."""
    canonical, (t1, t2) = _deepgemm_shared()
    (p1, _), (p2, _) = canonical
    m1 = torch.empty_strided((2 * N_I, H // 128), (1, 2 * N_I), dtype=torch.int32).copy_(canonical[0][1][0])
    m2 = torch.empty_strided((H, N_I // 128), (1, H), dtype=torch.int32).copy_(canonical[1][1][0])
    r1, r2 = dg.transform_weights_for_mega_moe((p1[0], m1), (p2[0], m2))
    for got, want in ((r1, t1), (r2, t2)):
        assert _equal(got, want) and got[1].stride() == want[1].stride()


def test_deepgemm_k32_shared_pairs_become_the_canonical_pairs(group: dist.ProcessGroup) -> None:
    """DeepGEMM's transformed pairs (2-D, MN-major scales) -> the canonical [1, N, K'] pairs bit for bit, contiguous,
    converted once: the same tensors on the next call, new ones after an in-place update of a source."""
    canonical, (t1, t2) = _deepgemm_shared()
    sym = _sym(group)
    c1, c2 = _mega._native_shared(FN, sym, t1, t2, k32=True)
    assert _equal(c1, canonical[0]) and _equal(c2, canonical[1])
    assert all(t.is_contiguous() for t in (*c1, *c2))
    again = _mega._native_shared(FN, sym, t1, t2, k32=True)
    assert again[0][0] is c1[0] and again[1][1] is c2[1]
    t2[1][0, 0] = t2[1][0, 0]  # an in-place write moves the version counter
    moved = _mega._native_shared(FN, sym, t1, t2, k32=True)
    assert moved[0][0] is c1[0] and moved[1][1] is not c2[1] and _equal(moved[1], canonical[1])
    three_d = _mega._native_shared(FN, sym, tuple(t[None] for t in t1), tuple(t[None] for t in t2), k32=True)
    assert _equal(three_d[0], canonical[0]) and _equal(three_d[1], canonical[1])


def test_k32_shared_refusals(group: dist.ProcessGroup) -> None:
    """Each refusal names the argument, the rule and the value, before any conversion."""
    _, (t1, t2) = _deepgemm_shared()
    sym = _sym(group)
    y, (l1, l2) = torch.empty(3, H, dtype=torch.bfloat16), _routed()
    cases = [
        ((t1[0].float(), t1[1]), t2, TypeError, r"shared_l1_weights\[0\] must be float8_e4m3fn"),
        (t1, (t2[0], t2[1].to(torch.int64)), TypeError, r"shared_l2_weights\[1\] must be int32"),
        ((t1[0][:-128], t1[1][:-128]), t2, ValueError, r"shared_l1_weights\[0\] must have shape \[512, 512\]"),
        (t1, (t2[0], t2[1][:, :1]), ValueError, r"shared_l2_weights\[1\] must have shape \[512, 2\]"),
        (t1, (t2[0][None], t2[1]), ValueError, "shared_l2_weights must be two tensors of one rank"),
        (t1, t2[0], TypeError, "shared_l2_weights must be a .* pair of tensors"),
        (t1, (t2[0], torch.ones(H // 128, N_I // 128)), TypeError, "shared_l1_weights/shared_l2_weights must both be "
         "DeepGEMM's K32 form"),
    ]
    for s1, s2, exc, match in cases:
        with pytest.raises(exc, match=f"{FN}: {match}"):
            dg.fp8_fp4_mega_moe(y, l1, l2, sym, shared_l1_weights=s1, shared_l2_weights=s2)
    bad = t1[1].clone()
    bad[3, 1] = 0x7F7F7FFF  # UE8M0 code 255 (NaN) in K32 group 4 * 1 + 3
    with pytest.raises(ValueError, match=rf"{FN}: shared_l1_weights\[1\]"):
        dg.fp8_fp4_mega_moe(y, l1, l2, sym, shared_l1_weights=(t1[0], bad), shared_l2_weights=t2)
    with torch.inference_mode():
        frozen = (t2[0].clone(), t2[1].clone())
    with pytest.raises(ValueError, match=rf"{FN}: shared_l2_weights\[0\]: is an inference tensor"):
        dg.fp8_fp4_mega_moe(y, l1, l2, sym, shared_l1_weights=t1, shared_l2_weights=frozen)


def test_k32_shared_pairs_reach_the_native_call(group: dist.ProcessGroup) -> None:
    """DeepGEMM's shared form passes every check and reaches role4's launch (which stops on CPU)."""
    _, (t1, t2) = _deepgemm_shared()
    y, (l1, l2) = torch.empty(3, H, dtype=torch.bfloat16), _routed()
    with pytest.raises(RuntimeError, match="fp8_fp4_mega_moe: buffer: lives in host memory"):
        dg.fp8_fp4_mega_moe(y, l1, l2, _sym(group), shared_l1_weights=t1, shared_l2_weights=t2)


def _routed() -> tuple[_Pair, _Pair]:
    """Routed MXFP4 weights in the originals' layout (zeros, scale 1.0)."""
    w1 = (torch.zeros(E, 2 * N_I, H // 2, dtype=torch.uint8), torch.full((E, 2 * N_I, H // 128), 0x7F7F7F7F,
                                                                          dtype=torch.int32))
    w2 = (torch.zeros(E, H, N_I // 2, dtype=torch.uint8), torch.full((E, H, N_I // 128), 0x7F7F7F7F,
                                                                     dtype=torch.int32))
    return dg.transform_weights_for_mega_moe(w1, w2)
