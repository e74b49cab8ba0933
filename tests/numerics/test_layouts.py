"""Tests for gc_moe_compat.layouts: bijections, inverses, value preservation, Eq. (3), the window repack bound."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gc_moe_compat import layouts as lay
from gc_moe_compat.quant import (
    dequantize_fp8_blocks,
    dequantize_mxfp4,
    e2m1_decode,
    pack_fp4,
    quantize_fp8_blocks,
    quantize_mxfp4,
    unpack_fp4,
)


def _is_perm(idx: torch.Tensor) -> bool:
    return torch.equal(idx.sort().values, torch.arange(idx.numel(), dtype=idx.dtype))


def _rand_u8(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)


# ----------------------------------------------------------------------------------------------------------------
# 1. gate/up interleave
# ----------------------------------------------------------------------------------------------------------------


def test_gate_up_source_rows_small_hand_computed() -> None:
    src = lay.gate_up_source_rows(32)  # I = 16
    expected = list(range(0, 8)) + list(range(16, 24)) + list(range(8, 16)) + list(range(24, 32))
    assert src.tolist() == expected
    assert _is_perm(src)


@pytest.mark.parametrize("two_i", [16, 256, 384, 1024])
def test_gate_up_source_rows_is_permutation(two_i: int) -> None:
    assert _is_perm(lay.gate_up_source_rows(two_i))


def test_interleave_layout_and_inverse_on_index_tensor() -> None:
    e, two_i = 2, 64
    x = torch.arange(e * two_i).reshape(e, two_i, 1) % two_i
    y = lay.interleave_gate_up(x)[0, :, 0]
    half = two_i // 2
    assert y[:8].tolist() == list(range(8))
    assert y[8:16].tolist() == list(range(half, half + 8))
    assert y[16:24].tolist() == list(range(8, 16))
    assert _is_perm(y)
    assert torch.equal(lay.deinterleave_gate_up(lay.interleave_gate_up(x)), x)


@pytest.mark.parametrize(
    ("dtype", "last"),
    [(torch.float8_e4m3fn, 64), (torch.uint8, 32), (torch.int8, 32), (torch.int32, 4), (torch.float32, 2)],
)
def test_interleave_roundtrip_all_payloads(dtype: torch.dtype, last: int) -> None:
    x = _rand_u8(3, 48, last, seed=1)
    x = x.view(dtype) if dtype.itemsize == 1 else torch.randn(3, 48, last).to(dtype) * 100
    y = lay.interleave_gate_up(x)
    assert y.dtype == dtype and y.shape == x.shape
    back = lay.deinterleave_gate_up(y)
    assert torch.equal(
        back.view(torch.uint8) if dtype.itemsize == 1 else back, x.view(torch.uint8) if dtype.itemsize == 1 else x
    )


def test_interleave_preserves_dequantized_fp8_and_fp4() -> None:
    torch.manual_seed(0)
    w = torch.randn(2, 256, 256)
    # FP8 payload with per-row (1x128) style scales: interleave payload and per-row scales alike
    q = w.to(torch.float8_e4m3fn)
    row_sf = torch.rand(2, 256, 2) + 0.5
    deq = q.float() * row_sf.repeat_interleave(128, dim=2)
    deq_i = lay.interleave_gate_up(q).float() * lay.interleave_gate_up(row_sf).repeat_interleave(128, dim=2)
    assert torch.equal(deq_i, lay.interleave_gate_up(deq))
    # MXFP4 payload + UE8M0 codes
    packed, codes = quantize_mxfp4(w)
    a = dequantize_mxfp4(lay.interleave_gate_up(packed), lay.interleave_gate_up(codes))
    assert torch.equal(a, lay.interleave_gate_up(dequantize_mxfp4(packed, codes)))


def test_interleave_validation() -> None:
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        lay.interleave_gate_up([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least 2 dims"):
        lay.interleave_gate_up(torch.zeros(16))
    with pytest.raises(ValueError, match="I % 8 == 0.*dim 1 = 24"):
        lay.interleave_gate_up(torch.zeros(1, 24, 4))
    with pytest.raises(ValueError, match="I % 8 == 0"):
        lay.deinterleave_gate_up(torch.zeros(1, 8, 4))
    with pytest.raises(ValueError, match="num_rows"):
        lay.gate_up_source_rows(20)
    with pytest.raises(TypeError, match="num_rows must be an int"):
        lay.gate_up_source_rows(16.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="group must be >= 1"):
        lay.gate_up_source_rows(16, group=0)


def test_block_scales_expand_collapse_roundtrip() -> None:
    sf = torch.rand(3, 4, 5)
    rows = lay.expand_block_scales(sf)
    assert rows.shape == (3, 512, 5)
    assert torch.equal(lay.collapse_row_scales(rows), sf)
    bad = rows.clone()
    bad[1, 300, 2] += 1.0
    with pytest.raises(ValueError, match="block 2 of expert 1"):
        lay.collapse_row_scales(bad)
    with pytest.raises(ValueError, match="multiple of block_rows=128"):
        lay.collapse_row_scales(torch.zeros(1, 100, 1))
    # float8 / uint8 block scales compare bitwise
    f8 = _rand_u8(2, 3, 4, seed=3).view(torch.float8_e4m3fn)
    assert torch.equal(lay.collapse_row_scales(lay.expand_block_scales(f8)).view(torch.uint8), f8.view(torch.uint8))


def _interleaved_block_sources(two_i: int, b: int) -> set[int]:
    src = lay.gate_up_source_rows(two_i)
    return {int(r) // 128 for r in src[128 * b : 128 * (b + 1)]}


@pytest.mark.parametrize("two_i", [512, 1024, 2048])
def test_interleaved_block_mixes_two_source_blocks(two_i: int) -> None:
    """Worked-out claim: interleaved block b' = gate block b'//2 (64 rows) + up block I/128 + b'//2 (64 rows)."""
    half = two_i // 2
    src = lay.gate_up_source_rows(two_i)
    for b in range(two_i // 128):
        rows = src[128 * b : 128 * (b + 1)]
        gate, up = rows[rows < half], rows[rows >= half]
        assert gate.numel() == 64 and up.numel() == 64
        assert gate.tolist() == sorted(set(range(64 * b, 64 * b + 64)))
        assert _interleaved_block_sources(two_i, b) == {b // 2, half // 128 + b // 2}


def test_interleave_block_scales_raises_when_mixed_and_works_when_compatible() -> None:
    e = 2  # 2I = 512 rows, I = 256: two gate blocks, two up blocks
    mixed = torch.tensor([1.0, 2.0, 3.0, 4.0]).repeat(e, 1)[..., None].expand(e, 4, 3).contiguous()
    with pytest.raises(ValueError, match="mixes"):
        lay.interleave_gate_up_block_scales(mixed)
    # compatible: gate block j and up block j share a scale -> interleaved block b' has scale of gate block b'//2
    ok = torch.tensor([1.0, 2.0, 1.0, 2.0]).repeat(e, 1)[..., None].expand(e, 4, 3).contiguous()
    out = lay.interleave_gate_up_block_scales(ok)
    assert out[:, :, 0].tolist() == [[1.0, 1.0, 2.0, 2.0]] * e
    with pytest.raises(ValueError, match="I % 8 == 0"):
        lay.interleave_gate_up_block_scales(torch.zeros(1, 1, 1), block_rows=4)


def test_deepgemm_sm90_unchanged_block_scales_exact_only_by_source_row_lookup() -> None:
    """DeepGEMM's SM90 transform interleaves FP8 rows and keeps block scales: exact iff indexed by source row."""
    torch.manual_seed(1)
    e, two_i, k = 2, 512, 256
    w = torch.randn(e, two_i, k) * torch.arange(1, two_i + 1, dtype=torch.float32)[None, :, None]
    q, sf = quantize_fp8_blocks(w)  # [E, 2I, K] fp8, [E, 4, 2] fp32
    assert sf.shape == (e, 4, 2)
    truth = lay.interleave_gate_up(dequantize_fp8_blocks(q, sf))
    q_i = lay.interleave_gate_up(q)  # what DeepGEMM does to the payload; sf stays as is
    src = lay.gate_up_source_rows(two_i)
    # (a) scale looked up by the interleaved row's source row: exact
    sf_rows = sf[:, src // 128].repeat_interleave(128, dim=2)
    assert torch.equal(q_i.float() * sf_rows, truth)
    # same thing as interleaving the per-row expansion
    assert torch.equal(sf[:, src // 128], lay.interleave_gate_up(lay.expand_block_scales(sf)))
    # (b) the unchanged sf read as blocks of the interleaved matrix: wrong (gate and up scales differ here)
    naive = dequantize_fp8_blocks(q_i, sf)
    assert not torch.equal(naive, truth)
    # ... and interleaved block 0's up rows (8..15) got gate block 0's scale instead of up block 0's
    assert sf[0, 0, 0] != sf[0, two_i // 2 // 128, 0]


# ----------------------------------------------------------------------------------------------------------------
# 2. K128 prepack
# ----------------------------------------------------------------------------------------------------------------


def test_prepack_k128_layout_roundtrip_and_values() -> None:
    e, rows, k = 2, 16, 384
    w = torch.randn(e, rows, k)
    packed, codes = quantize_mxfp4(w)
    tiles = lay.prepack_k128(packed)
    assert tiles.shape == (e, k // 128, rows, 64) and tiles.is_contiguous()
    # a tile is one contiguous 64*rows range holding every row's 64-byte segment
    for kb in range(k // 128):
        assert torch.equal(tiles[1, kb], packed[1, :, 64 * kb : 64 * (kb + 1)])
        flat = tiles.reshape(e, -1)[1, kb * rows * 64 : (kb + 1) * rows * 64]
        assert torch.equal(flat, packed[1, :, 64 * kb : 64 * (kb + 1)].reshape(-1))
    assert torch.equal(lay.unprepack_k128(tiles), packed)
    assert torch.equal(dequantize_mxfp4(lay.unprepack_k128(tiles), codes), dequantize_mxfp4(packed, codes))
    # index tensor: forward of a permutation is a permutation
    idx = torch.arange(e * rows * k // 2).reshape(e, rows, k // 2)
    assert _is_perm(lay.prepack_k128(idx).reshape(-1))
    # int8 storage and FP8 (segment 128) work too
    assert torch.equal(lay.unprepack_k128(lay.prepack_k128(packed.view(torch.int8))), packed.view(torch.int8))
    f8 = w.to(torch.float8_e4m3fn)
    t8 = lay.prepack_k128(f8, segment=128)
    assert t8.shape == (e, 3, rows, 128)
    assert torch.equal(lay.unprepack_k128(t8).view(torch.uint8), f8.view(torch.uint8))


def test_prepack_validation() -> None:
    with pytest.raises(ValueError, match="3 dims"):
        lay.prepack_k128(torch.zeros(1, 2, 3, 64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="at least 3 dims"):
        lay.prepack_k128(torch.zeros(2, 64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of segment=64.*got 96"):
        lay.prepack_k128(torch.zeros(1, 2, 96, dtype=torch.uint8))
    with pytest.raises(ValueError, match="4 dims"):
        lay.unprepack_k128(torch.zeros(1, 2, 3, 4, 5))
    with pytest.raises(TypeError, match="tiles must be a torch.Tensor"):
        lay.unprepack_k128(None)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------------------------
# 3. UTCCP permutation
# ----------------------------------------------------------------------------------------------------------------


def test_utccp_row_position_hand_computed() -> None:
    pos = lay.utccp_row_position(torch.tensor([0, 1, 31, 32, 33, 64, 127, 128, 160, 255]))
    # r = 32a + b -> 4b + a (+ 128 per group)
    assert pos.tolist() == [0, 4, 124, 1, 5, 2, 127, 128, 129, 255]
    assert _is_perm(lay.utccp_row_position(torch.arange(512)))


def test_utccp_matches_deepgemm_reshape_transpose_semantics() -> None:
    """DeepGEMM 2.8.2 _transpose_sf_for_utccp: reshape [G, mn/128, 4, 32, k], transpose(2, 3), reshape back."""
    sf = torch.randint(-(2**31), 2**31 - 1, (3, 256, 4), dtype=torch.int32)
    expected = sf.reshape(3, -1, 4, 32, 4).transpose(2, 3).reshape(3, 256, 4)
    assert torch.equal(lay.utccp_permute_scales(sf), expected)
    assert torch.equal(lay.utccp_unpermute_scales(expected), sf)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.float32])
def test_utccp_roundtrip_any_leading_dims(dtype: torch.dtype) -> None:
    x = torch.arange(2 * 3 * 384 * 2).reshape(2, 3, 384, 2).to(dtype)
    assert torch.equal(lay.utccp_unpermute_scales(lay.utccp_permute_scales(x)), x)
    assert torch.equal(lay.utccp_permute_scales(lay.utccp_unpermute_scales(x)), x)
    rows = torch.arange(384).reshape(384, 1)
    assert _is_perm(lay.utccp_permute_scales(rows)[:, 0])


def test_utccp_preserves_values_per_row() -> None:
    torch.manual_seed(2)
    w = torch.randn(2, 256, 128)
    packed, codes = quantize_mxfp4(w)
    deq = dequantize_mxfp4(lay.utccp_permute_scales(packed), lay.utccp_permute_scales(codes))
    assert torch.equal(deq, lay.utccp_permute_scales(dequantize_mxfp4(packed, codes)))


def test_utccp_validation() -> None:
    with pytest.raises(ValueError, match="MN % 128 == 0.*MN=100"):
        lay.utccp_permute_scales(torch.zeros(100, 4))
    with pytest.raises(ValueError, match="MN % 128 == 0"):
        lay.utccp_unpermute_scales(torch.zeros(1, 64, 4))
    with pytest.raises(ValueError, match="at least 2 dims"):
        lay.utccp_permute_scales(torch.zeros(128))
    with pytest.raises(TypeError, match="integer tensor"):
        lay.utccp_row_position(torch.zeros(3))
    with pytest.raises(ValueError, match="rows must be >= 0"):
        lay.utccp_row_position(torch.tensor([-1]))


# ----------------------------------------------------------------------------------------------------------------
# 4. Eq. (3)
# ----------------------------------------------------------------------------------------------------------------


def _eq3(t: int, bm: int) -> int:
    u = t % bm
    return (t // bm) * (-(-bm // 128) * 128) + (u // 128) * 128 + (u % 32) * 4 + (u % 128) // 32


def test_shared_scale_rows_hand_computed() -> None:
    # BM = 16: block 0 -> rows 0,4,...,60; token 16 starts block 1 at row 128
    assert lay.shared_scale_rows(18, 16).tolist()[:3] == [0, 4, 8]
    assert lay.shared_scale_rows(18, 16).tolist()[15:] == [60, 128, 132]
    # BM = 96: u = 32 -> row 1, u = 95 -> 31*4 + 2 = 126
    r96 = lay.shared_scale_rows(97, 96).tolist()
    assert (r96[32], r96[33], r96[95], r96[96]) == (1, 5, 126, 128)
    # BM = 240: u = 128 -> 128, u = 239 -> 128 + 15*4 + 3 = 191; t = 240 -> 256
    r240 = lay.shared_scale_rows(241, 240).tolist()
    assert (r240[127], r240[128], r240[239], r240[240]) == (127, 128, 191, 256)


@pytest.mark.parametrize("bm", lay.SHARED_BLOCK_M_CANDIDATES)
def test_shared_scale_rows_matches_formula_and_is_injective(bm: int) -> None:
    t = 1000
    rows = lay.shared_scale_rows(t, bm)
    assert rows.tolist() == [_eq3(i, bm) for i in range(t)]
    assert rows.unique().numel() == t


def test_shared_scale_buffer_bound_every_bm_every_tmax() -> None:
    tmax = torch.arange(1, 4097)
    for bm in lay.SHARED_BLOCK_M_CANDIDATES:
        rows = lay.shared_scale_rows(4096, bm)
        # max row over tokens [0, T) for every T = running max
        running_max = torch.cummax(rows, dim=0).values
        bound = (tmax + 7) // 8 * 128
        assert bool((running_max < bound).all()), bm
        assert lay.shared_scale_buffer_rows(4096) == 512 * 128
    # BM = 8 makes the bound tight at 128-row chunk granularity: T tokens touch exactly ceil(T/8) chunks
    chunks = torch.cummax(lay.shared_scale_rows(4096, 8) // 128, dim=0).values + 1
    assert torch.equal(chunks, (tmax + 7) // 8)
    assert lay.shared_scale_buffer_rows(0) == 0


def test_shared_scale_rows_below_bm8_can_break_bound() -> None:
    # the premise BM >= 8 matters: BM = 1 places token 1 at row 128 >= ceil(2/8)*128
    assert int(lay.shared_scale_rows(2, 1)[1]) >= lay.shared_scale_buffer_rows(2)


def test_stage_shared_scales() -> None:
    t, g, tmax, bm = 37, 4, 64, 16
    sf = torch.randint(0, 2**31 - 1, (t, g), dtype=torch.int32)
    buf = lay.stage_shared_scales(sf, bm, tmax)
    assert buf.shape == (lay.shared_scale_buffer_rows(tmax), g) and buf.dtype == torch.int32
    rows = lay.shared_scale_rows(t, bm)
    assert torch.equal(buf[rows], sf)
    mask = torch.ones(buf.shape[0], dtype=torch.bool)
    mask[rows] = False
    assert bool((buf[mask] == 0).all())
    # inverse: gather back by rows
    out = torch.full_like(buf, -1)
    assert lay.stage_shared_scales(sf, bm, tmax, out=out) is out
    assert torch.equal(out[rows], sf) and bool((out[mask] == -1).all())
    # per 128-row block, Eq. 3 is the UTCCP permutation of the natural (padded) block order
    nat = torch.zeros(128, g, dtype=torch.int32)
    nat[:bm] = sf[:bm]
    assert torch.equal(buf[:128], lay.utccp_permute_scales(nat))


def test_stage_shared_scales_validation() -> None:
    sf = torch.zeros(10, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="block_m must be >= 8, got 4"):
        lay.stage_shared_scales(sf, 4, 16)
    with pytest.raises(ValueError, match="T=10 tokens, more than num_max_tokens=8"):
        lay.stage_shared_scales(sf, 8, 8)
    with pytest.raises(ValueError, match=r"out must be \[256, 2\]"):
        lay.stage_shared_scales(sf, 8, 16, out=torch.zeros(256, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="2 dims"):
        lay.stage_shared_scales(torch.zeros(2, 3, 4), 8, 16)
    with pytest.raises(TypeError, match="block_m must be an int"):
        lay.shared_scale_rows(4, True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        lay.shared_scale_rows(-1, 8)


# ----------------------------------------------------------------------------------------------------------------
# 5. window repack
# ----------------------------------------------------------------------------------------------------------------


def test_fp4_shift_lut() -> None:
    lut = lay.fp4_shift_lut()
    assert lut.shape == (lay.FP4_SHIFT_LUT_MAX + 1, 16) and lut.dtype == torch.uint8
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(lut[0], codes)
    assert torch.equal(lut & 8, (codes & 8).expand_as(lut))  # sign kept
    assert bool((lut[lay.FP4_SHIFT_LUT_MAX] & 7 == 0).all())
    assert bool((lut[lay.FP4_SHIFT_LUT_MAX - 1] & 7 != 0).any())
    # spot values: 6 >> 1 = 3 (code 5), 0.5 >> 1 = 0.25 -> tie to 0, 1.5 >> 1 = 0.75 -> tie to 1.0 (code 2)
    assert (int(lut[1, 7]), int(lut[1, 1]), int(lut[1, 3])) == (5, 0, 2)
    for s in range(lay.FP4_SHIFT_LUT_MAX + 1):
        err = (e2m1_decode(lut[s]) - e2m1_decode(codes) * 2.0**-s).abs()
        assert float(err.max()) <= 0.25


def test_fp4_to_e4m3_bits_is_value_over_64() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    e4 = lay.fp4_to_e4m3_bits(codes).view(torch.float8_e4m3fn).float()
    assert torch.equal(e4 * lay.SM90_FP4_DECODE_HEADROOM, e2m1_decode(codes))
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        lay.fp4_to_e4m3_bits(torch.tensor([16], dtype=torch.uint8))
    with pytest.raises(TypeError, match="codes must have dtype"):
        lay.fp4_to_e4m3_bits(torch.tensor([1]))


def test_window_fits_e4m3_exactly() -> None:
    """Every FP4 value times 2^d / 64, d in [0, 10], is an exact E4M3 value: why 11 window steps fit."""
    vals = e2m1_decode(torch.arange(16, dtype=torch.uint8))
    for d in range(lay.WINDOW_STEPS):
        x = vals * 2.0**d / lay.SM90_FP4_DECODE_HEADROOM
        assert torch.equal(x.to(torch.float8_e4m3fn).float(), x), d
    assert float(vals.abs()[vals != 0].min()) / 64 == 2.0**-7  # E4M3 subnormal 4 * 2^-9
    # margin: E4M3's range alone would admit d up to 12 (6 * 2^12 / 64 = 384 <= 448) but not 13 (768 > 448)
    x12 = vals * 2.0**12 / 64
    assert torch.equal(x12.to(torch.float8_e4m3fn).float(), x12)
    assert float((vals * 2.0**13 / 64).abs().max()) > 448


def _make_mxfp4(exps: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random FP4 codes with given unbiased exponents ``exps [E, N, G]``."""
    g = torch.Generator().manual_seed(seed)
    e, n, groups = exps.shape
    codes = torch.randint(0, 16, (e, n, groups * 32), dtype=torch.uint8, generator=g)
    return pack_fp4(codes), (exps + 127).to(torch.uint8)


def _check_repack(packed: torch.Tensor, sf: torch.Tensor) -> lay.WindowRepackedMXFP4:
    rep = lay.window_repack_mxfp4(packed, sf)
    e, n, _ = packed.shape
    s = sf.to(torch.int32) - 127
    base = torch.maximum(s.reshape(e, -1).amin(1), s.reshape(e, -1).amax(1) - 10)
    assert torch.equal(rep.base, base)
    assert torch.equal(rep.factor, torch.tensor([math.ldexp(1.0, int(b)) for b in base], dtype=torch.float32))
    assert rep.rel_exp.dtype == torch.uint8 and int(rep.rel_exp.max()) <= lay.WINDOW_STEPS - 1
    assert torch.equal(rep.clipped, s < base[:, None, None])
    orig = dequantize_mxfp4(packed, sf).reshape(e, n, -1, 32)
    new = lay.window_dequantize(rep).reshape(e, n, -1, 32)
    inside = ~rep.clipped
    assert torch.equal(new[inside], orig[inside])  # bit-exact inside the window
    err = (new - orig).abs()
    bound = 0.25 * rep.factor[:, None, None, None]
    assert bool((err <= bound).all())
    assert bool((err <= orig.abs()).all())
    back_packed, back_sf = lay.window_unrepack_mxfp4(rep)
    assert torch.equal(dequantize_mxfp4(back_packed, back_sf), lay.window_dequantize(rep).reshape(e, n, -1))
    if not bool(rep.clipped.any()):
        assert torch.equal(back_packed, packed) and torch.equal(back_sf, sf)
    else:
        assert torch.equal(back_sf[inside], sf[inside])
    return rep


@settings(max_examples=60, deadline=None)
@given(
    spread=st.integers(0, 20),
    low=st.integers(-40, 20),
    seed=st.integers(0, 2**16),
    shape=st.tuples(st.integers(1, 3), st.integers(1, 6), st.integers(1, 4)),
)
def test_window_repack_property(spread: int, low: int, seed: int, shape: tuple[int, int, int]) -> None:
    g = torch.Generator().manual_seed(seed)
    exps = low + torch.randint(0, spread + 1, shape, generator=g)
    exps.view(-1)[0] = low
    exps.view(-1)[-1] = low + spread
    packed, sf = _make_mxfp4(exps, seed)
    rep = _check_repack(packed, sf)
    if spread <= 10:
        assert not bool(rep.clipped.any())


@pytest.mark.parametrize("spread", [10, 11])
def test_window_repack_spread_10_and_11(spread: int) -> None:
    exps = torch.tensor([[[-3, -3 + spread, 0, -1]]]).repeat(2, 4, 1)
    exps[1] = 5  # the second expert has spread 0
    packed, sf = _make_mxfp4(exps, 7)
    rep = _check_repack(packed, sf)
    assert rep.base.tolist() == [-3 if spread == 10 else -2, 5]
    assert bool(rep.clipped.any()) == (spread == 11)
    if spread == 11:
        assert bool(rep.clipped[0, :, 0].all()) and int(rep.clipped.sum()) == 4
        assert bool((rep.rel_exp[0, :, 0] == 0).all()) and bool((rep.rel_exp[0, :, 1] == 10).all())


def test_window_repack_error_bound_is_attained() -> None:
    # expert exponents {0, 11}: base = 1; a group at s = 0 holding 0.5 (code 1) -> 0.25 * 2^1 rounds to 0
    exps = torch.tensor([[[0, 11]]])
    codes = torch.ones(1, 1, 64, dtype=torch.uint8)
    rep = lay.window_repack_mxfp4(pack_fp4(codes), (exps + 127).to(torch.uint8))
    err = (lay.window_dequantize(rep) - dequantize_mxfp4(pack_fp4(codes), (exps + 127).to(torch.uint8))).abs()
    assert float(err.max()) == 0.25 * 2.0 ** int(rep.base[0])
    assert bool((unpack_fp4(rep.packed)[0, 0, :32] == 0).all())


def test_window_repack_quantized_weights_and_int8_storage() -> None:
    torch.manual_seed(3)
    w = torch.randn(2, 8, 256) * torch.logspace(-6, 6, 8, base=2.0)[None, :, None]
    packed, sf = quantize_mxfp4(w)
    rep = _check_repack(packed.view(torch.int8), sf)
    assert rep.packed.dtype == torch.int8
    # huge shifts clamp to the all-zero LUT row: exponents spread 40
    exps = torch.tensor([[[-20, 20]]])
    packed2, sf2 = _make_mxfp4(exps, 9)
    rep2 = _check_repack(packed2, sf2)
    assert bool((unpack_fp4(rep2.packed)[0, 0, :32] & 7 == 0).all())


def test_window_repack_validation() -> None:
    p = torch.zeros(1, 2, 16, dtype=torch.uint8)
    sf = torch.full((1, 2, 1), 127, dtype=torch.uint8)
    with pytest.raises(TypeError, match="packed must have dtype"):
        lay.window_repack_mxfp4(p.float(), sf)
    with pytest.raises(TypeError, match="sf_codes must have dtype"):
        lay.window_repack_mxfp4(p, sf.int())
    with pytest.raises(ValueError, match=r"sf_codes must be \[E, N, K/32\]"):
        lay.window_repack_mxfp4(p, torch.full((1, 2, 2), 127, dtype=torch.uint8))
    with pytest.raises(ValueError, match="3 dims each"):
        lay.window_repack_mxfp4(p[None], sf[None])
    with pytest.raises(ValueError, match="255"):
        lay.window_repack_mxfp4(p, torch.full((1, 2, 1), 255, dtype=torch.uint8))
    with pytest.raises(ValueError, match="non-empty"):
        lay.window_repack_mxfp4(torch.zeros(1, 0, 16, dtype=torch.uint8), torch.zeros(1, 0, 1, dtype=torch.uint8))
    with pytest.raises(TypeError, match="rep must be a WindowRepackedMXFP4"):
        lay.window_dequantize(p)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="rep must be a WindowRepackedMXFP4"):
        lay.window_unrepack_mxfp4(p)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------------------------
# device: the same transforms on CUDA give the CPU results
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_matches_cpu() -> None:
    torch.manual_seed(4)
    w = torch.randn(2, 256, 256)
    packed, sf = quantize_mxfp4(w)
    exps = torch.randint(-15, 5, (2, 256, 8))
    p2, sf2 = _make_mxfp4(exps, 11)
    for fn, args in [
        (lay.interleave_gate_up, (packed,)),
        (lay.deinterleave_gate_up, (sf,)),
        (lay.prepack_k128, (packed,)),
        (lay.utccp_permute_scales, (sf,)),
        (lay.utccp_unpermute_scales, (sf,)),
    ]:
        assert torch.equal(fn(*(a.cuda() for a in args)).cpu(), fn(*args))
    rep_c, rep = lay.window_repack_mxfp4(p2.cuda(), sf2.cuda()), lay.window_repack_mxfp4(p2, sf2)
    assert torch.equal(rep_c.packed.cpu(), rep.packed) and torch.equal(rep_c.rel_exp.cpu(), rep.rel_exp)
    assert torch.equal(lay.window_dequantize(rep_c).cpu(), lay.window_dequantize(rep))
    s = torch.randint(0, 255, (37, 4), dtype=torch.uint8)
    assert torch.equal(lay.stage_shared_scales(s.cuda(), 16, 64).cpu(), lay.stage_shared_scales(s, 16, 64))
