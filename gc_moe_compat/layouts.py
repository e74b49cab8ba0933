"""Weight and scale layouts that the GC-MoE kernels consume (pure torch, CPU and CUDA alike).

Every transform here is a host-side, once-per-weight-set (or once-per-token-count) rearrangement. The kernels read
the results directly, so each transform must be exact: row moves are permutations (bijections, with an inverse
here), and the only value-changing transform, the Hopper window repack, states and tests its error bound.

Contents
--------
1. Gate/up row interleave by 8 (paper §4.4, DeepGEMM ``_interleave_weights``) for weights and per-row scales, and
   the correct handling of 128-row block scales (which an interleave cannot simply permute).
2. K128 tile prepack of FP4 weights ``[E, rows, K/2] -> [E, K/128, rows, 64]`` (paper §4.4 "Weight prepacking").
3. The UTCCP scale-row permutation of DeepGEMM's SM100 path (within 128 rows, ``32a + b -> 4b + a``).
4. The shared-expert scale row order of the paper's Eq. (3), built from item 3's permutation plus block placement.
5. The Hopper window-based MXFP4 scale repack (paper §4.4, "Hopper path (SM90)"), host side.

Conventions: a *destination map* ``dest`` says where source row ``r`` goes (``out[dest[r]] = x[r]``); a *source map*
``src`` says which source row lands at position ``p`` (``out[p] = x[src[p]]``). Each is the inverse permutation of the
other. Row moves use ``index_select`` only, which works for every dtype on CPU and CUDA (``index_copy_`` does not
support the float8 dtypes on CPU).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from gc_moe_compat.quant import e2m1_decode, e2m1_encode, pack_fp4, unpack_fp4

__all__ = [
    "GATE_UP_GROUP",
    "K128_FP4_SEGMENT_BYTES",
    "SCALE_BLOCK_ROWS",
    "SHARED_BLOCK_M_CANDIDATES",
    "SM90_FP4_DECODE_HEADROOM",
    "UTCCP_ROWS",
    "WINDOW_STEPS",
    "FP4_SHIFT_LUT_MAX",
    "WindowRepackedMXFP4",
    "collapse_row_scales",
    "deinterleave_gate_up",
    "expand_block_scales",
    "fp4_shift_lut",
    "fp4_to_e4m3_bits",
    "gate_up_source_rows",
    "interleave_gate_up",
    "interleave_gate_up_block_scales",
    "prepack_k128",
    "shared_scale_buffer_rows",
    "shared_scale_rows",
    "stage_shared_scales",
    "unprepack_k128",
    "utccp_permute_scales",
    "utccp_row_position",
    "utccp_unpermute_scales",
    "window_dequantize",
    "window_repack_mxfp4",
    "window_unrepack_mxfp4",
]

GATE_UP_GROUP = 8
"""Rows per gate (or up) run in the interleaved L1 weight: ``[g0..g7, u0..u7, g8..g15, u8..u15, ...]``."""

SCALE_BLOCK_ROWS = 128
"""MN rows covered by one block scale in the (128, 128) FP8 recipe."""

K128_FP4_SEGMENT_BYTES = 64
"""Bytes one row contributes to a K128 tile of packed FP4 (128 values x 4 bit)."""

UTCCP_ROWS = 128
"""MN rows in one UTCCP (``tcgen05.cp ... 32x128b.warpx4``) scale-factor group."""

SHARED_BLOCK_M_CANDIDATES = (8, 16, 32, 64, 96, 128, 192, 240)
"""Token block sizes BM the shared-expert staging buffer bound ``ceil(Tmax/8) * 128`` is proven for (any BM >= 8)."""

WINDOW_STEPS = 11
"""Exponent steps one expert's window covers on the Hopper path: relative exponents ``d`` lie in ``[0, 10]``."""

SM90_FP4_DECODE_HEADROOM = 64
"""The SM90 register decoder yields ``value / 64`` (see :func:`fp4_to_e4m3_bits`); stored scales carry the x64."""

FP4_SHIFT_LUT_MAX = 5
"""Smallest right shift that flushes every FP4 magnitude to zero (6 * 2^-5 = 0.1875 < 0.25); larger shifts clamp."""


# ----------------------------------------------------------------------------------------------------------------
# Validation and the one row-move primitive
# ----------------------------------------------------------------------------------------------------------------


def _check_tensor(name: str, x: object, min_dim: int = 1) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dims, got shape {tuple(x.shape)}")
    return x


def _check_int(name: str, v: object, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__} ({v!r})")
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


def _check_dtype(name: str, x: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if x.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {x.dtype}")


def _invert(perm: torch.Tensor) -> torch.Tensor:
    """Inverse of a permutation of ``arange(n)``: turns a destination map into a source map and vice versa."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype)
    return inv


def _gather_rows(x: torch.Tensor, dim: int, src: torch.Tensor) -> torch.Tensor:
    """``out[..., p, ...] = x[..., src[p], ...]`` along ``dim``; contiguous result, any dtype."""
    return x.index_select(dim, src.to(x.device)).contiguous()


# ----------------------------------------------------------------------------------------------------------------
# 1. Gate/up row interleave
# ----------------------------------------------------------------------------------------------------------------


def gate_up_source_rows(
    num_rows: int, group: int = GATE_UP_GROUP, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Source map of the gate/up interleave: the original row placed at interleaved row ``p`` (int64, on ``device``).

    With ``I = num_rows / 2`` (gate rows ``[0, I)``, up rows ``[I, 2I)``) and ``p = 2*group*j + group*h + i``
    (``h = 0`` gate, ``h = 1`` up, ``i < group``), the source row is ``h*I + group*j + i``. The kernel uses this map
    to find a row's scale in a layout that was *not* interleaved (DeepGEMM's SM90 block scales, see
    :func:`interleave_gate_up_block_scales`).

    Raises ValueError unless ``num_rows`` is even and ``num_rows / 2`` is a multiple of ``group``.
    """
    _check_int("num_rows", num_rows, 0)
    _check_int("group", group, 1)
    if num_rows % (2 * group) != 0:
        raise ValueError(
            f"num_rows must be 2*I with I % {group} == 0 (gate rows [0, I), up rows [I, 2I)), got num_rows={num_rows}"
        )
    half = num_rows // 2
    p = torch.arange(num_rows, device=device, dtype=torch.int64)
    j, h, i = p // (2 * group), (p // group) % 2, p % group
    return h * half + j * group + i


def _check_gate_up(name: str, x: object, group: int) -> torch.Tensor:
    x = _check_tensor(name, x, min_dim=2)
    if x.shape[1] % (2 * group) != 0:
        raise ValueError(
            f"{name} must be [E, 2I, ...] with I % {group} == 0 (gate rows [0, I), up rows [I, 2I)), "
            f"got dim 1 = {x.shape[1]} (shape {tuple(x.shape)})"
        )
    return x


def interleave_gate_up(x: torch.Tensor, group: int = GATE_UP_GROUP) -> torch.Tensor:
    """Interleave gate/up rows in runs of ``group``: ``[E, 2I, *rest]`` -> rows ``[g0..g7, u0..u7, g8..g15, ...]``.

    Why: the SwiGLU epilogue of the L1 GEMM needs each gate row and its up row inside the same output tile, so the
    L1 weight's rows are reordered once on the host (DeepGEMM ``transform_weights_for_mega_moe`` does the same with
    ``gran = 8``). Only dim 1 moves, so one function serves every per-row tensor: the FP8 payload ``[E, 2I, K]``,
    packed FP4 ``[E, 2I, K/2]``, UE8M0 codes ``[E, 2I, K/32]``, packed UE8M0 ``int32 [E, 2I, K/128]``, FP32 per-row
    scales. It is *not* valid for 128-row block scales ``[E, 2I/128, K/128]``: use
    :func:`interleave_gate_up_block_scales` for those.
    """
    x = _check_gate_up("x", x, group)
    return _gather_rows(x, 1, gate_up_source_rows(x.shape[1], group, x.device))


def deinterleave_gate_up(x: torch.Tensor, group: int = GATE_UP_GROUP) -> torch.Tensor:
    """Inverse of :func:`interleave_gate_up`: interleaved ``[E, 2I, *rest]`` back to ``[gate | up]`` row order."""
    x = _check_gate_up("x", x, group)
    return _gather_rows(x, 1, _invert(gate_up_source_rows(x.shape[1], group, x.device)))


def expand_block_scales(sf: torch.Tensor, block_rows: int = SCALE_BLOCK_ROWS) -> torch.Tensor:
    """Expand MN block scales ``[E, N/block_rows, *rest]`` to per-row form ``[E, N, *rest]`` (each row repeated).

    Per-row form is the representation in which row permutations are always exact.
    """
    sf = _check_tensor("sf", sf, min_dim=2)
    _check_int("block_rows", block_rows, 1)
    return sf.repeat_interleave(block_rows, dim=1)


def collapse_row_scales(sf_rows: torch.Tensor, block_rows: int = SCALE_BLOCK_ROWS) -> torch.Tensor:
    """Inverse of :func:`expand_block_scales`: ``[E, N, *rest]`` -> ``[E, N/block_rows, *rest]``.

    Raises ValueError when ``N`` is not a multiple of ``block_rows`` or when some block holds rows with different
    scales (then no block-scale tensor represents the rows exactly); the message names the first offending
    ``(expert, block)``.
    """
    sf_rows = _check_tensor("sf_rows", sf_rows, min_dim=2)
    _check_int("block_rows", block_rows, 1)
    e, n, *rest = sf_rows.shape
    if n % block_rows != 0:
        raise ValueError(f"sf_rows dim 1 must be a multiple of block_rows={block_rows}, got {n}")
    blocks = sf_rows.reshape(e, n // block_rows, block_rows, *rest)
    first = blocks[:, :, :1]
    # float8 has no ``==``: compare one-byte dtypes bitwise
    bits = blocks.view(torch.uint8) if blocks.dtype.itemsize == 1 else blocks
    same = bits == bits[:, :, :1]
    mixed = ~same.reshape(e, n // block_rows, -1).all(dim=-1)
    if bool(mixed.any()):
        ex, blk = (int(v) for v in mixed.nonzero()[0])
        raise ValueError(
            f"sf_rows: block {blk} of expert {ex} (rows [{blk * block_rows}, {(blk + 1) * block_rows})) mixes "
            f"different scales, so it has no exact {block_rows}-row block scale"
        )
    return first.squeeze(2).contiguous()


def interleave_gate_up_block_scales(
    sf: torch.Tensor, block_rows: int = SCALE_BLOCK_ROWS, group: int = GATE_UP_GROUP
) -> torch.Tensor:
    """Block scales ``[E, 2I/block_rows, *rest]`` of the *interleaved* L1 weight, or ValueError when none exist.

    What the interleave does to 128-row blocks: interleaved block ``b'`` holds rows ``[128b', 128b' + 128)``, i.e.
    run pairs ``j in [8b', 8b' + 8)``, i.e. gate rows ``[64b', 64b' + 64)`` (source block ``b' // 2``) and up rows
    ``I + [64b', 64b' + 64)`` (source block ``(I + 64b') // 128``, which is ``I/128 + b' // 2`` when
    ``I % 128 == 0``). Every interleaved block therefore mixes 64 gate and 64 up rows from two *different* source
    blocks, and a block scale tensor cannot simply be permuted. This function expands to per-row scales,
    interleaves them, and collapses back; it succeeds only when each interleaved block's two sources share a scale
    and raises ValueError (naming the block) otherwise. The always-exact alternatives are per-row scales
    (``interleave_gate_up(expand_block_scales(sf))``) or looking the scale up by source row.

    DeepGEMM's ``transform_weights_for_mega_moe_sm90`` interleaves the FP8 rows and returns the block scales
    *unchanged* (its docstring: natural ``(E, 2*IH/128, H/128)`` layout, gate then up along N). That is exact only
    when the consumer indexes the scales by the row's *source* row, ``sf[src[p] // 128]`` with
    ``src = gate_up_source_rows(2I)``. Read as "block ``b'`` of the interleaved matrix", it is wrong whenever the
    gate and up halves have different block scales: e.g. interleaved block 0 would apply gate block 0's scale to
    its 64 up rows, whose true scale is up block 0's (``sf[I/128]``), and interleaved block 1 would apply gate
    block 1's scale to gate rows that belong to gate block 0. Tests check both statements.
    """
    sf = _check_tensor("sf", sf, min_dim=2)
    _check_int("block_rows", block_rows, 1)
    rows = expand_block_scales(sf, block_rows)
    _check_gate_up("sf (expanded to rows)", rows, group)
    return collapse_row_scales(interleave_gate_up(rows, group), block_rows)


# ----------------------------------------------------------------------------------------------------------------
# 2. K128 tile prepack
# ----------------------------------------------------------------------------------------------------------------


def prepack_k128(w: torch.Tensor, segment: int = K128_FP4_SEGMENT_BYTES) -> torch.Tensor:
    """K128 tile prepack: row-major ``[E, rows, K/2]`` packed FP4 -> ``[E, K/128, rows, 64]``.

    Why: within one K128 tile all rows' 64-byte segments become one contiguous range, so one TMA box
    ``(128, 128, 1, 1)`` over ``(K, rows, kb, experts)`` loads a weight tile as a single 8 KB burst instead of 128
    segments spaced a full weight row apart (paper §4.4, "Weight prepacking"). ``segment`` is the last-dim extent
    of one K128 tile: 64 for packed FP4 (default), 128 for FP8 shared weights (16 KB tiles). Any dtype.
    """
    w = _check_tensor("w", w, min_dim=3)
    _check_int("segment", segment, 1)
    if w.dim() != 3:
        raise ValueError(f"w must be [E, rows, K/2] (3 dims), got shape {tuple(w.shape)}")
    e, rows, kk = w.shape
    if kk % segment != 0:
        raise ValueError(f"w last dim must be a multiple of segment={segment} (K % 128 == 0), got {kk}")
    return w.reshape(e, rows, kk // segment, segment).permute(0, 2, 1, 3).contiguous()


def unprepack_k128(tiles: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`prepack_k128`: ``[E, K/128, rows, segment]`` -> row-major ``[E, rows, K/128 * segment]``."""
    tiles = _check_tensor("tiles", tiles, min_dim=4)
    if tiles.dim() != 4:
        raise ValueError(f"tiles must be [E, K/128, rows, segment] (4 dims), got shape {tuple(tiles.shape)}")
    e, kb, rows, seg = tiles.shape
    return tiles.permute(0, 2, 1, 3).reshape(e, rows, kb * seg).contiguous()


# ----------------------------------------------------------------------------------------------------------------
# 3. UTCCP scale-row permutation (and 4. Eq. 3, which is built on it)
# ----------------------------------------------------------------------------------------------------------------


def utccp_row_position(rows: torch.Tensor) -> torch.Tensor:
    """Destination of MN row ``r`` in UTCCP order: ``128*floor(r/128) + 4*(r mod 32) + floor((r mod 128)/32)``.

    Within each group of 128 rows, row ``r = 32a + b`` (``a < 4``, ``b < 32``) goes to ``4b + a``: a 4 x 32 -> 32 x 4
    transpose, the order in which ``tcgen05.cp.32x128b.warpx4`` lands scale rows in TMEM lanes. Confirmed against
    DeepGEMM 2.8.2 ``deep_gemm/mega/__init__.py::_transpose_sf_for_utccp``: it reshapes ``[G, mn, k]`` (int32,
    asserts ``mn % 128 == 0``) to ``[G, mn/128, 4, 32, k]``, transposes dims 2 and 3, and reshapes back, so output
    row ``128c + 4b + a`` holds input row ``128c + 32a + b`` — this map. The paper's Eq. (3) is the same map applied
    to the within-block token index (:func:`shared_scale_rows`). Accepts any integer tensor of rows >= 0.
    """
    rows = _check_tensor("rows", rows)
    if rows.dtype.is_floating_point or rows.dtype.is_complex or rows.dtype == torch.bool:
        raise TypeError(f"rows must be an integer tensor, got {rows.dtype}")
    if rows.numel() and int(rows.min()) < 0:
        raise ValueError(f"rows must be >= 0, got min {int(rows.min())}")
    rows = rows.to(torch.int64)
    return (rows // UTCCP_ROWS) * UTCCP_ROWS + (rows % 32) * 4 + (rows % UTCCP_ROWS) // 32


def _utccp_positions(mn: int) -> torch.Tensor:
    """UTCCP destinations of rows ``0..mn-1``, built on the host (``_gather_rows`` moves them to the tensor's device,
    meta included: the range check of :func:`utccp_row_position` reads values)."""
    return utccp_row_position(torch.arange(mn, device="cpu", dtype=torch.int64))


def _check_utccp(sf: object) -> torch.Tensor:
    sf = _check_tensor("sf", sf, min_dim=2)
    mn = sf.shape[-2]
    if mn % UTCCP_ROWS != 0:
        raise ValueError(
            f"sf must be [..., MN, G] with MN % {UTCCP_ROWS} == 0 (pad MN up to a multiple of {UTCCP_ROWS} first; a "
            f"partial group has no UTCCP destination inside itself), got MN={mn} (shape {tuple(sf.shape)})"
        )
    return sf


def utccp_permute_scales(sf: torch.Tensor) -> torch.Tensor:
    """Permute scale rows ``[..., MN, G]`` into UTCCP consumption order (``out[pos(r)] = sf[r]``, dim -2).

    MN must be a multiple of 128 (as DeepGEMM asserts): a partial trailing group would send rows ``4b + a`` past its
    own end, so padding is the caller's explicit choice (pad to ``align(MN, 128)``, as Eq. (3) does with
    ``align(BM, 128)``), never silent. Any dtype (packed int32 UE8M0, uint8 codes, float32).
    """
    sf = _check_utccp(sf)
    return _gather_rows(sf, sf.dim() - 2, _invert(_utccp_positions(sf.shape[-2])))


def utccp_unpermute_scales(sf: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`utccp_permute_scales`: UTCCP-ordered ``[..., MN, G]`` back to natural MN row order."""
    sf = _check_utccp(sf)
    return _gather_rows(sf, sf.dim() - 2, _utccp_positions(sf.shape[-2]))


def shared_scale_rows(num_tokens: int, block_m: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Destination rows of the shared-expert activation scales, paper Eq. (3), as an int64 tensor ``[num_tokens]`` on
    ``device``.

    ``row(t) = floor(t/BM) * align(BM, 128) + utccp_row_position(t mod BM)``: token block ``floor(t/BM)`` owns
    ``align(BM, 128)`` rows, and inside it the token index ``u`` is placed by the UTCCP permutation (expanding
    ``utccp_row_position(u)`` gives Eq. 3's ``floor(u/128)*128 + (u mod 32)*4 + floor((u mod 128)/32)``), the same
    order the kernel writes routed scales in, so routed and shared experts share one scale map. Injective, since
    blocks occupy disjoint row ranges and the permutation is a bijection of each range.
    """
    _check_int("num_tokens", num_tokens, 0)
    _check_int("block_m", block_m, 1)
    t = torch.arange(num_tokens, device=device, dtype=torch.int64)
    span = -(-block_m // UTCCP_ROWS) * UTCCP_ROWS
    return (t // block_m) * span + utccp_row_position(t % block_m)


def shared_scale_buffer_rows(num_max_tokens: int) -> int:
    """Rows of ``shared_l1_acts_sf``: ``ceil(Tmax/8) * 128`` (paper §4.5), enough for every ``BM >= 8``.

    Proof: ``floor(row(t)/128) = q*ceil(BM/128) + floor(u/128)`` with ``t = q*BM + u``. For ``BM >= 8``,
    ``ceil(BM/128) <= BM/8`` and ``floor(u/128) <= floor(u/8)``, hence ``floor(row(t)/128) <= floor(q*BM/8) +
    floor(u/8) <= floor(t/8)``, so ``row(t) < (floor(t/8) + 1) * 128 <= ceil(Tmax/8) * 128`` for every ``t < Tmax``.
    The bound covers whole 128-row UTCCP chunks touched by valid tokens, not a full ``align(BM,128)`` block span
    (``T = 1, BM = 240`` touches one chunk, while its block spans 256 rows).
    """
    _check_int("num_max_tokens", num_max_tokens, 0)
    return -(-num_max_tokens // 8) * UTCCP_ROWS


def stage_shared_scales(
    sf: torch.Tensor, block_m: int, num_max_tokens: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Scatter per-token scales ``[T, G]`` into the Eq. (3) row order of a ``[ceil(Tmax/8)*128, G]`` buffer.

    Row ``shared_scale_rows(T, block_m)[t]`` receives ``sf[t]``. A fresh buffer is zero-filled; when ``out`` is given
    it must have shape ``[shared_scale_buffer_rows(num_max_tokens), G]`` and ``sf``'s dtype and device, and only the
    ``T`` destination rows are written (the kernel reads nothing else). Requires ``block_m >= 8`` (the buffer bound's
    premise) and ``T <= num_max_tokens``. Returns the buffer.
    """
    sf = _check_tensor("sf", sf, min_dim=2)
    if sf.dim() != 2:
        raise ValueError(f"sf must be [T, G] (2 dims), got shape {tuple(sf.shape)}")
    _check_int("block_m", block_m, 8)
    _check_int("num_max_tokens", num_max_tokens, 0)
    t, g = sf.shape
    if t > num_max_tokens:
        raise ValueError(f"sf has T={t} tokens, more than num_max_tokens={num_max_tokens}")
    shape = (shared_scale_buffer_rows(num_max_tokens), g)
    if out is None:
        out = torch.zeros(shape, dtype=sf.dtype, device=sf.device)
    else:
        out = _check_tensor("out", out)
        if tuple(out.shape) != shape or out.dtype != sf.dtype or out.device != sf.device:
            raise ValueError(
                f"out must be {list(shape)} {sf.dtype} on {sf.device}, got {list(out.shape)} {out.dtype} on "
                f"{out.device}"
            )
    out[shared_scale_rows(t, block_m, sf.device)] = sf
    return out


# ----------------------------------------------------------------------------------------------------------------
# 5. Hopper window-based MXFP4 scale repack
# ----------------------------------------------------------------------------------------------------------------


@functools.cache
def _lut_cpu() -> torch.Tensor:
    codes = torch.arange(16, dtype=torch.uint8, device="cpu")
    mag = e2m1_decode(codes & 7).to(torch.float32)
    shifts = torch.arange(FP4_SHIFT_LUT_MAX + 1, dtype=torch.float32, device="cpu")
    scaled = mag[None, :] * torch.exp2(-shifts)[:, None]
    return (e2m1_encode(scaled).to(torch.uint8) & 7) | (codes & 8)[None, :]


def fp4_shift_lut(device: torch.device | str | None = None) -> torch.Tensor:
    """LUT ``uint8 [FP4_SHIFT_LUT_MAX + 1, 16]``: ``lut[s, c]`` = code of ``e2m1(c) * 2^-s``, RNE, sign kept.

    Built once (cached) from :mod:`gc_moe_compat.quant`'s E2M1 encode/decode over the 4-bit code space; the sign
    bit (bit 3) is copied from ``c``, so a magnitude flushed to zero keeps its sign (``-0``). Row 0 is the
    identity; rows ``s >= FP4_SHIFT_LUT_MAX`` are all zero magnitudes, so larger shifts clamp to the last row.
    """
    return _lut_cpu().to(device) if device is not None else _lut_cpu().clone()


def fp4_to_e4m3_bits(codes: torch.Tensor) -> torch.Tensor:
    """Reference of the SM90 register decoder: FP4 bits ``s e1 e0 m`` -> E4M3 bits ``s 0 0 e1 e0 m 0 0`` (uint8).

    The result, read as ``float8_e4m3fn``, equals ``e2m1(code) / 64`` exactly: for ``e >= 1`` the FP4 value
    ``2^(e-1) (1 + m/2)`` becomes ``2^(e-7) (1 + m/2)`` (E4M3 bias 7), and for ``e = 0`` the FP4 subnormal ``m/2``
    becomes the E4M3 subnormal ``2^-6 * m/2``. Hence the kernel multiplies by ``SM90_FP4_DECODE_HEADROOM = 64``
    (the "x64 headroom" folded into the stored scales).
    """
    codes = _check_tensor("codes", codes)
    _check_dtype("codes", codes, (torch.uint8,))
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"codes must be 4-bit FP4 codes in [0, 15], got max {int(codes.max())}")
    return ((codes & 8) << 4) | ((codes & 7) << 2)


@dataclass(frozen=True)
class WindowRepackedMXFP4:
    """Hopper-path MXFP4 weights after the window repack (host side of paper §4.4).

    Dequantized value of element ``k`` of row ``n`` of expert ``e`` (group ``g = k // 32``):
    ``e2m1(code'[e, n, k]) * 2^rel_exp[e, n, g] * factor[e]``.

    Attributes:
        packed: packed FP4 ``[E, N, K/2]`` (input dtype, uint8 or int8), magnitudes shifted where needed.
        rel_exp: uint8 ``[E, N, K/32]``, ``d = s' - base`` in ``[0, WINDOW_STEPS - 1]``.
        factor: float32 ``[E]``, ``2^base`` (the per-expert compensating factor; exact in float32 for
            ``base >= -127``).
        base: int32 ``[E]``, the unbiased window base exponent.
        clipped: bool ``[E, N, K/32]``, groups whose exponent was below the window (their magnitudes were shifted).
    """

    packed: torch.Tensor
    rel_exp: torch.Tensor
    factor: torch.Tensor
    base: torch.Tensor
    clipped: torch.Tensor


def window_repack_mxfp4(packed: torch.Tensor, sf_codes: torch.Tensor) -> WindowRepackedMXFP4:
    """Window-based scale repack of MXFP4 weights for the SM90 kernel (host side; lane permutation not included).

    For each expert, with ``s`` the unbiased UE8M0 exponents of its K32 groups: ``base = max(s_min, s_max - 10)``
    (at most ``WINDOW_STEPS = 11`` exponent steps). Groups with ``s >= base`` keep their FP4 codes and store
    ``d = s - base``. Groups with ``s < base`` get ``s' = base`` and their FP4 magnitudes shifted down by the exact
    power of two ``2^-(base - s)`` through :func:`fp4_shift_lut` (RNE on the FP4 grid, sign kept).

    Error bound (proved here, tested): within the window the dequantized values are bit-identical. Outside, each
    element ``v = e2m1(c) * 2^s`` becomes ``RNE(x) * 2^base`` with ``x = e2m1(c) * 2^-(base-s)``; a shift >= 1 gives
    ``|x| <= 3`` and the only grid points of ``e2m1 / 2^k`` above 2 are 2 and 3 (exact), so rounding happens on the
    part of the FP4 grid with step 0.5 and ``|err| <= 0.25 * 2^base`` per element (and ``<= |v|``, since 0 is on
    the grid). The bound is attained, e.g. ``0.5 * 2^(base-1)`` rounds (tie to even) to 0.

    Kernel-side convention: the register decoder turns FP4 bits into E4M3 bits (``s|00e1e0|m00``, see
    :func:`fp4_to_e4m3_bits`), which yields ``value / 64``; the kernel multiplies by
    ``SM90_FP4_DECODE_HEADROOM = 64``. For every code and every ``d`` in ``[0, 10]``, ``e2m1(code) * 2^d / 64`` is
    exactly representable in E4M3 (``2^-7 .. 96``), which is why 11 steps fit (with margin: E4M3's range alone would
    admit ``d <= 12``, since ``6 * 2^12 / 64 = 384 <= 448`` while ``d = 13`` gives 768). The tile-byte permutation
    to the decoder's lane order belongs to the kernel issue and is not done here.

    Args:
        packed: packed FP4 ``[E, N, K/2]`` uint8 or int8 (element ``2i`` in the low nibble).
        sf_codes: UE8M0 codes uint8 ``[E, N, K/32]`` (127 = 1.0); 255 (NaN) is rejected.
    """
    packed = _check_tensor("packed", packed, min_dim=3)
    sf_codes = _check_tensor("sf_codes", sf_codes, min_dim=3)
    _check_dtype("packed", packed, (torch.uint8, torch.int8))
    _check_dtype("sf_codes", sf_codes, (torch.uint8,))
    if packed.dim() != 3 or sf_codes.dim() != 3:
        raise ValueError(
            f"packed must be [E, N, K/2] and sf_codes [E, N, K/32] (3 dims each), got {tuple(packed.shape)} and "
            f"{tuple(sf_codes.shape)}"
        )
    e, n, half_k = packed.shape
    if half_k % 16 != 0 or tuple(sf_codes.shape) != (e, n, half_k // 16):
        raise ValueError(
            f"sf_codes must be [E, N, K/32] = {[e, n, half_k // 16]} for packed {list(packed.shape)} (K % 32 == 0), "
            f"got {list(sf_codes.shape)}"
        )
    if e == 0 or n == 0 or half_k == 0:
        raise ValueError(f"packed must be non-empty, got shape {tuple(packed.shape)}")
    if bool((sf_codes == 255).any()):
        raise ValueError("sf_codes must not contain 255 (UE8M0 NaN)")
    s = sf_codes.to(torch.int32) - 127
    flat = s.reshape(e, -1)
    s_max = flat.amax(dim=1)
    base = torch.maximum(flat.amin(dim=1), s_max - (WINDOW_STEPS - 1))
    shift = (base[:, None, None] - s).clamp(min=0)
    clipped = shift > 0
    codes = unpack_fp4(packed).reshape(e, n, -1, 32).to(torch.int64)
    lut = fp4_shift_lut(packed.device).to(torch.int64)
    row = shift.clamp(max=FP4_SHIFT_LUT_MAX).to(torch.int64)[..., None]
    new_codes = lut.flatten()[row * 16 + codes].to(torch.uint8).reshape(e, n, -1)
    rel = (s + shift - base[:, None, None]).to(torch.uint8)
    factor = torch.exp2(base.to(torch.float64)).to(torch.float32)
    new_packed = pack_fp4(new_codes).view(packed.dtype)
    return WindowRepackedMXFP4(packed=new_packed, rel_exp=rel, factor=factor, base=base, clipped=clipped)


def window_dequantize(rep: WindowRepackedMXFP4) -> torch.Tensor:
    """Float32 ``[E, N, K]`` values a window-repacked weight stands for: ``e2m1(code') * 2^d * factor``."""
    if not isinstance(rep, WindowRepackedMXFP4):
        raise TypeError(f"rep must be a WindowRepackedMXFP4, got {type(rep).__name__}")
    e, n, _ = rep.packed.shape
    vals = e2m1_decode(unpack_fp4(rep.packed)).to(torch.float32).reshape(e, n, -1, 32)
    scale = torch.exp2(rep.rel_exp.to(torch.float32))[..., None] * rep.factor[:, None, None, None]
    return (vals * scale).reshape(e, n, -1)


def window_unrepack_mxfp4(rep: WindowRepackedMXFP4) -> tuple[torch.Tensor, torch.Tensor]:
    """Expand a window repack back to plain MXFP4 ``(packed [E, N, K/2], UE8M0 codes uint8 [E, N, K/32])``.

    Codes are ``d + base + 127``. This is the exact inverse of :func:`window_repack_mxfp4` for every group that was
    inside the window (``rep.clipped`` false); a clipped group comes back as its shifted codes at exponent ``base``,
    which dequantize to the same values as the repack (not to the original ones).
    """
    if not isinstance(rep, WindowRepackedMXFP4):
        raise TypeError(f"rep must be a WindowRepackedMXFP4, got {type(rep).__name__}")
    codes = (rep.rel_exp.to(torch.int32) + rep.base[:, None, None] + 127).to(torch.uint8)
    return rep.packed.clone(), codes
