"""Lane permutation of window-repacked MXFP4 weights for the SM90 register-A decoder (paper §4.4, "lane-permuted").

The kernel (kernels/sm90/role2_gemm_fp8xfp4.cu) decodes FP4 straight into the m64nNk32 E4M3 A fragment: thread
``(warp w, lane l)``, ``g = l // 4``, ``t = l % 4``, holds for each K32 group four registers, register ``j`` = the
four columns ``4t + 16 (j // 2) + [0, 4)`` of weight row ``16 w + g + 8 (j % 2)`` (lowest byte = lowest column).
This module lays the FP4 codes out so that each thread reads its 64 values of a K128 step with two conflict-free
LDS.128 and turns every 32-bit word into two A registers with one byte permute each.

Unit: one 64-row slab of one expert for one K128 step, ``UNIT_BYTES = 4352`` bytes:

* bytes ``[0, 4096)``: ``[warp 4][half 2][lane 32][word 4][byte 4]``; word ``2 kk + r`` of ``(w, half, l)`` holds
  row ``16 w + g + 8 r``, K32 group ``k = 2 half + kk``, the columns of registers ``r`` (``R0``) and ``r + 2``
  (``R1``). Inside the word, nibble ``n``'s bits 0-2 are the magnitude of value ``n % 4`` of ``R0`` (``n < 4``) or
  ``R1`` (``n >= 4``); nibble ``n``'s bit 3 is the sign of value ``(n - 1) / 2`` of ``R0`` (``n`` odd) or ``n / 2``
  of ``R1`` (``n`` even). Then ``R0 = PRMT(table, mag) | (w & 0x80808080)`` and
  ``R1 = PRMT(table, mag >> 16) | ((w << 4) & 0x80808080)`` with ``mag = w & 0x77777777``.
* bytes ``[4096, 4352)``: the relative exponents ``d``: ``[warp 4][g 8][r 2][K32 group 4]`` (one LDS.64 per thread,
  shared by the 4 lanes of a row pair).

Units are stored ``[E, K/128, N/64]``, so the slabs of one task and K step are consecutive: one TMA box per stage.
The table is ``E4M3(e2m1(c) * 2^d / 64)``: the row's K32 scale is folded into the E4M3 exponent, exact for
``d <= 10`` (:func:`gc_moe_compat.layouts.window_repack_mxfp4`); :func:`decode_units` replays the decoder.
"""

from __future__ import annotations

import torch

from gc_moe_compat.quant import pack_fp4, unpack_fp4

SLAB_ROWS = 64
BK = 128
CODE_BYTES = SLAB_ROWS * BK // 2
UNIT_BYTES = CODE_BYTES + SLAB_ROWS * BK // 32
UNIT_ROWS = UNIT_BYTES // 128  # rows of the kernel's 128-byte tensor-map view per unit


def _check(packed: torch.Tensor, rel_exp: torch.Tensor) -> tuple[int, int, int]:
    if packed.dim() != 3 or packed.dtype not in (torch.uint8, torch.int8) or rel_exp.dtype != torch.uint8:
        raise ValueError(f"packed: need uint8/int8 [E, N, K/2] and rel_exp uint8 [E, N, K/32], got {packed.dtype}")
    e, n, half_k = packed.shape
    k = 2 * half_k
    if n % SLAB_ROWS or k % BK or tuple(rel_exp.shape) != (e, n, k // 32):
        raise ValueError(
            f"packed/rel_exp: need N % 64 == 0, K % 128 == 0 and rel_exp [E, N, K/32], got {tuple(packed.shape)} "
            f"and {tuple(rel_exp.shape)}"
        )
    if rel_exp.numel() and int(rel_exp.max()) > 10:
        raise ValueError("rel_exp: the decoder folds 2^d into E4M3 exactly only for d in [0, 10]")
    return e, n, k


def permute_units(packed: torch.Tensor, rel_exp: torch.Tensor) -> torch.Tensor:
    """Units ``uint8 [E, K/128, N/64, UNIT_BYTES]`` of window-repacked codes ``packed [E, N, K/2]`` with their
    relative exponents ``rel_exp [E, N, K/32]`` (see the module docstring for the byte and bit order)."""
    e, n, k = _check(packed, rel_exp)
    ns, kb = n // SLAB_ROWS, k // BK
    # codes [E, slab, w, r, g, kb, k32, R, t, nb]: row 16w + 8r + g, column 32 k32 + 16 R + 4 t + nb
    c = unpack_fp4(packed).reshape(e, ns, 4, 2, 8, kb, 4, 2, 4, 4).to(torch.int32)
    c = c.permute(0, 1, 2, 3, 4, 5, 6, 8, 7, 9)  # [..., t, R, nb]: one word per (t), values n = 4 R + nb
    mag = (c & 7).reshape(*c.shape[:-2], 8)
    sign = c >> 3
    sign = torch.stack((sign[..., 1, :], sign[..., 0, :]), dim=-1).reshape(*c.shape[:-2], 8)  # n even: R1, odd: R0
    nib = mag | (sign << 3)
    words = (nib[..., 0::2] | (nib[..., 1::2] << 4)).to(torch.uint8)  # [E, slab, w, r, g, kb, k32, t, 4 bytes]
    words = words.reshape(e, ns, 4, 2, 8, kb, 2, 2, 4, 4)  # k32 -> (half, kk)
    # -> [E, kb, slab, w, half, g, t, kk, r, byte]
    codes = words.permute(0, 5, 1, 2, 6, 4, 8, 7, 3, 9).reshape(e, kb, ns, CODE_BYTES)
    d = rel_exp.reshape(e, ns, 4, 2, 8, kb, 4).permute(0, 5, 1, 2, 4, 3, 6).reshape(e, kb, ns, 256)
    return torch.cat((codes, d), dim=-1).contiguous()


def unpermute_units(units: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`permute_units`: ``(packed uint8 [E, N, K/2], rel_exp uint8 [E, N, K/32])``."""
    if units.dim() != 4 or units.dtype != torch.uint8 or units.shape[-1] != UNIT_BYTES:
        raise ValueError(f"units: need uint8 [E, K/128, N/64, {UNIT_BYTES}], got {units.dtype} {tuple(units.shape)}")
    e, kb, ns, _ = units.shape
    words = units[..., :CODE_BYTES].reshape(e, kb, ns, 4, 2, 8, 4, 2, 2, 4).permute(0, 2, 3, 8, 5, 1, 4, 7, 6, 9)
    b = words.reshape(e, ns, 4, 2, 8, kb, 4, 4, 4).to(torch.int32)  # [..., k32, t, byte]
    nib = torch.stack((b & 0xF, b >> 4), dim=-1).reshape(*b.shape[:-1], 8)
    mag = (nib & 7).reshape(*nib.shape[:-1], 2, 4)  # [..., R, nb]
    sign = (nib >> 3).reshape(*nib.shape[:-1], 4, 2)  # [..., nb, (R1, R0)]
    sign = torch.stack((sign[..., 1], sign[..., 0]), dim=-2)  # [..., R, nb]
    c = (mag | (sign << 3)).permute(0, 1, 2, 3, 4, 5, 6, 8, 7, 9)  # [..., k32, R, t, nb]
    packed = pack_fp4(c.reshape(e, ns * SLAB_ROWS, kb * BK).to(torch.uint8))
    d = units[..., CODE_BYTES:].reshape(e, kb, ns, 4, 8, 2, 4).permute(0, 2, 3, 5, 4, 1, 6)
    return packed, d.reshape(e, ns * SLAB_ROWS, kb * 4).contiguous()


def _prmt(lo: torch.Tensor, hi: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """``prmt.b32`` in its default mode for selectors whose nibbles have bit 3 clear (int64 arithmetic)."""
    src = lo | (hi << 32)
    out = torch.zeros_like(lo)
    for j in range(4):
        idx = (sel >> (4 * j)) & 7
        out |= ((src >> (8 * idx)) & 0xFF) << (8 * j)
    return out


def decode_units(units: torch.Tensor) -> torch.Tensor:
    """Replays the kernel's decoder on every unit: the E4M3 bytes ``uint8 [E, N, K]`` that the A fragments hold,
    placed at their (row, column). ``.view(torch.float8_e4m3fn) * 64 * factor`` must equal the window dequantization.
    """
    e, kb, ns, _ = units.shape
    q = units[..., :CODE_BYTES].reshape(e, kb, ns, 4, 2, 32, 4, 4).to(torch.int64)
    w = q[..., 0] | (q[..., 1] << 8) | (q[..., 2] << 16) | (q[..., 3] << 24)  # [E, kb, slab, w, half, lane, word]
    d = units[..., CODE_BYTES:].reshape(e, kb, ns, 4, 8, 2, 4).to(torch.int64)  # [E, kb, slab, w, g, r, k32]
    lane = torch.arange(32, dtype=torch.int64, device=units.device)
    d = d[:, :, :, :, lane // 4]  # [E, kb, slab, w, lane, r, k32]
    hi = d * 0x08080808 + 0x1C181410
    lo = torch.clamp(d * 0x08080800 + 0x0C080000, min=0x0C080400)
    # [.., w, r, g, k32, R, t, byte]
    out = torch.zeros(e, kb, ns, 4, 2, 8, 4, 2, 4, 4, dtype=torch.int64, device=units.device)
    for k32 in range(4):
        for r in range(2):
            word = w[:, :, :, :, k32 // 2, :, 2 * (k32 % 2) + r]  # [E, kb, slab, w, lane]
            mag = word & 0x77777777
            t_lo, t_hi = lo[..., r, k32], hi[..., r, k32]
            r0 = _prmt(t_lo, t_hi, mag & 0xFFFF) | (word & 0x80808080)
            r1 = _prmt(t_lo, t_hi, mag >> 16) | ((word << 4) & 0x80808080)
            for reg_r, val in ((0, r0), (1, r1)):
                by = torch.stack([(val >> (8 * j)) & 0xFF for j in range(4)], dim=-1)  # [E, kb, slab, w, lane, 4]
                by = by.reshape(e, kb, ns, 4, 8, 4, 4)  # lane -> (g, t)
                out[:, :, :, :, r, :, k32, reg_r] = by
    # [E, kb, slab, w, r, g, k32, R, t, byte] -> [E, slab, w, r, g, kb, k32, R, t, byte]
    out = out.permute(0, 2, 3, 4, 5, 1, 6, 7, 8, 9).reshape(e, ns * SLAB_ROWS, kb * BK)
    return out.to(torch.uint8)
