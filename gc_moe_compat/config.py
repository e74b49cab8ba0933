"""Workload presets, the operator's shape description and the host-side constraint check.

Three things live here, all pure Python/torch with no device code:

* ``MoEPreset`` / ``PRESETS`` / ``preset_shape``: the workloads of ``docs/bench_protocol.md``. A preset fixes the
  *per-rank* load (``e`` local experts, top-k, H, I); ``preset_shape(name, P)`` scales the global expert count as
  ``E = e·P`` so tokens per expert (``T·k·P/E = T·k/e``) and per-rank weight bytes are the same at every P
  ("per-rank-equivalent rule"); only the remote fraction of dispatch traffic, ``(P−1)/P``, changes.
* ``MoEShape``: the scalar description of one operator instance (what the symmetric buffer is sized for).
* ``validate``: the single place that checks every shape/dtype/device/contiguity rule the operator relies on, on the
  host, before any launch. Kernels never re-check; a violated rule would otherwise surface as a hang, a trap or
  silently wrong output, so each message names the argument, the rule, its reason and the value seen.

Rules (paper Appendix A, Table 12, adapted to the SM90 path; ``e = E/P``, ``S = num_shared_experts``):

=====================================  =========================================================================
rule                                   reason
=====================================  =========================================================================
``0 < I <= 4096``, ``I % 128 == 0``    the 2I/128 W1 output tiles of one ring block must fit the 64-bit
                                       ``l2_full_mask``; W2 consumes complete K128 tiles
``0 < H <= 8192``, ``H % 256 == 0``    paper: 2-CTA clusters pair N128 tiles (H/128 even). Kept for parity with
                                       the SM103 path; the SM90 kernels may relax it to ``H % 128 == 0`` once
                                       they exist (they have no 2-CTA pairing). The bound: the facade's
                                       pre-dispatch stages a token with one CTA of H/8 threads (<= 1024), and it
                                       keeps the symmetric buffer bounded (no absurd H reaches the allocator)
``1 <= k``, ``k + S <= 32``            one warp lane carries one combine slot (k routed + S shared partials)
``S in {0, 1}``                        one fused shared expert at most (one extra combine slot, one role4 node)
``1 <= P <= 72``                       the 592-byte by-value peer descriptor holds 72 offsets
``E <= 2048``                          static per-expert signal region sizing
``E % P == 0``, ``E/P <= 512``         experts are distributed evenly; lane-held per-expert counters
``k <= E``                             top-k without repetition needs k distinct experts
``1 <= capacity <= 8192``              ring, combine buffer and receive counters are sized statically from the
                                       per-rank capacity; 8192 is this library's choice, not the paper's (256):
                                       SGLang's default ``SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK``,
                                       so an unchanged deployment is accepted, while the symmetric buffer stays
                                       bounded. Larger batches must be chunked by the caller.
``0 <= num_tokens <= capacity``        tokens beyond the capacity have no ring/combine slot
``mma_type in MMA_TYPES``              the compute paths of :mod:`gc_moe_compat.compute_paths`
tensors: dtype/shape per the table     the kernels read raw bytes through fixed TMA descriptors and strides
tensors contiguous                     TMA descriptors and ring copies assume packed row-major strides
tensors on one device                  one process per GPU; every operand is read by kernels on that GPU
T equal across x/x_sf/topk/y           one token count per call; pass ``buffer.x[:T]``-style slices
``topk_idx`` in ``[-1, E)``            ids index global experts; -1 (only) marks an unused slot
``topk_weights`` finite                a NaN/Inf weight poisons the fused requantization amax of its block
=====================================  =========================================================================

Tensor layouts (``T`` tokens of this call):

=========================  =====================================================================================
argument                   accepted dtype -> shape
=========================  =====================================================================================
``x``                      float8_e4m3fn ``[T, H]``
``x_sf`` (fp8xfp8)         float32 ``[T, H/128]`` (SM90 recipe: FP32 1x128 scales)
``x_sf`` (fp8xfp4)         float32 ``[T, H/128]`` (Hopper path: "E4M3FN with contiguous FP32 K128 scales"), or
                           int32 ``[T, H/128]`` (DeepGEMM SM100 packed form: 4 UE8M0 K32 scales per int32)
``topk_idx``               int64 or int32 ``[T, k]``
``topk_weights``           float32 ``[T, k]``
``y``                      bfloat16 ``[T, H]``
``l1_weights`` (fp8xfp4)   (uint8|int8 ``[e, 2I, H/2]`` packed E2M1, uint8 ``[e, 2I, H/32]`` UE8M0 | int32
                           ``[e, 2I, H/128]`` packed UE8M0)
``l2_weights`` (fp8xfp4)   (uint8|int8 ``[e, H, I/2]``, uint8 ``[e, H, I/32]`` | int32 ``[e, H, I/128]``)
``l1_weights`` (fp8xfp8)   (float8_e4m3fn ``[e, 2I, H]``, float32 ``[e, 2I/128, H/128]``)
``l2_weights`` (fp8xfp8)   (float8_e4m3fn ``[e, H, I]``, float32 ``[e, H/128, I/128]``)
``shared_l1_weights``      (float8_e4m3fn ``[S, 2I, H]``, uint8 ``[S, 2I, H/32]`` | int32 ``[S, 2I, H/128]``
                           (per-row K32 UE8M0) | float32 ``[S, 2I/128, H/128]`` (128x128 block scales))
``shared_l2_weights``      the same with ``N = H``, ``K = I``
=========================  =====================================================================================

The two halves of a routed (or shared) pair set must use the same scale form. Wrong Python types and wrong dtypes
raise ``TypeError``; wrong values, shapes, strides, devices raise ``ValueError``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from gc_moe_compat.compute_paths import MMA_TYPES, compute_path

__all__ = [
    "MAX_CAPACITY",
    "MAX_COMBINE_SLOTS",
    "MAX_EXPERTS",
    "MAX_HIDDEN",
    "MAX_INTERMEDIATE",
    "MAX_LOCAL_EXPERTS",
    "MAX_RANKS",
    "MAX_SMS",
    "MMA_TYPES",
    "PRESETS",
    "SWEEP_TOKENS",
    "MoEPreset",
    "MoEShape",
    "boolean",
    "check_finite",
    "check_routing",
    "check_topk_values",
    "finite_float",
    "inspect_values",
    "int_in_range",
    "integer",
    "preset_shape",
    "recipe",
    "shown",
    "tokens_per_expert",
    "validate",
]

# ----------------------------------------------------------------------------------------------------------------
# Limits and their reasons (the reasons are quoted verbatim in error messages).
# ----------------------------------------------------------------------------------------------------------------
MAX_INTERMEDIATE = 4096
INTERMEDIATE_ALIGN = 128
MAX_HIDDEN = 8192
HIDDEN_ALIGN = 256
MAX_COMBINE_SLOTS = 32
MAX_EXPERTS = 2048
MAX_LOCAL_EXPERTS = 512
MAX_RANKS = 72
MAX_CAPACITY = 8192
MAX_SMS = 1024
"""Upper bound of every SM count the callers pass (no GPU has more; an H200 has 132): the ring grows with the
compute SMs, so an absurd count would size an absurd workspace."""
SWEEP_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

_WHY_I = "K128 tiles, 64-bit W1 completion mask"
_WHY_H = "N-tile pairing: H/128 even"
_WHY_H_MAX = "one pre-dispatch CTA of H/8 threads per token; bounds the symmetric buffer"
_WHY_SLOTS = "one warp lane per combine slot"
_WHY_RANKS = "592-byte by-value peer table with 72 offsets"
_WHY_EXPERTS = "static signal sizing"
_WHY_CAPACITY = "ring and combine buffers are sized statically per rank; chunk larger batches"
_WHY_LAYOUT = "kernels read packed row-major operands through fixed TMA descriptors"

_FP8 = torch.float8_e4m3fn
_T = "T"  # marks the token dimension in an expected shape


# ----------------------------------------------------------------------------------------------------------------
# Shapes and presets
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MoEShape:
    """Scalar description of one operator instance (global view, per-rank capacity).

    Construction runs the scalar rules of the module table, so an ``MoEShape`` in hand is always inside the
    supported envelope and its derived properties are well defined.
    """

    num_experts: int
    num_ranks: int
    hidden: int
    intermediate: int
    topk: int
    num_shared_experts: int = 0
    capacity: int = 256
    mma_type: str = "fp8xfp4"

    def __post_init__(self) -> None:
        _check_shape(self)

    @property
    def num_local_experts(self) -> int:
        """Experts owned by each rank, ``e = E/P``."""
        return self.num_experts // self.num_ranks

    @property
    def num_combine_slots(self) -> int:
        """Partials summed per token by the combine: k routed plus the shared expert(s)."""
        return self.topk + self.num_shared_experts

    @property
    def num_w1_tiles(self) -> int:
        """W1 output N128 tiles per ring block (``2I/128``); one bit each in ``l2_full_mask``."""
        return 2 * self.intermediate // 128

    @property
    def routed_weight_bytes_per_rank(self) -> int:
        """Bytes of the routed weights and scale factors one rank holds (canonical scale form)."""
        total = 0
        for n, k in self._gemm_nk():
            for forms in _routed_pair_forms(self, n, k):
                dtype, (dims, _) = next(iter(forms.items()))
                total += math.prod(value for _, value in dims) * dtype.itemsize
        return total

    def _gemm_nk(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(N, K) of the two GEMMs: W1 is ``[2I, H]`` (gate/up stacked), W2 is ``[H, I]``."""
        return (2 * self.intermediate, self.hidden), (self.hidden, self.intermediate)


@dataclass(frozen=True)
class MoEPreset:
    """One workload of docs/bench_protocol.md, defined per rank so it scales to any rank count.

    ``shared_weight_k_group`` is the K granularity of the shared-expert weight scales: 32 (per-row UE8M0 K32,
    recipe (1, 1, 32)) or 128 (128x128 FP32 blocks, recipe (1, 128, 128)). ``routed_scaling_factor`` is the model's
    (SGLang's pre-dispatch multiplies the routing weights by it); ``activation_clamp`` its SwiGLU limit (None: none).
    """

    name: str
    hidden: int
    intermediate: int
    local_experts: int
    topk: int
    shared_experts: int
    shared_weight_k_group: int
    capacity: int = 256
    activation_alpha: float = 1.0
    activation_clamp: float | None = 10.0
    fast_math: bool = True
    routed_scaling_factor: float = 1.0

    def shape(self, num_ranks: int, *, mma_type: str = "fp8xfp4", with_shared: bool = True) -> MoEShape:
        """The operator shape at ``num_ranks`` ranks: ``E = e·P`` (per-rank-equivalent rule).

        Raises ``ValueError`` where ``e·P`` leaves the envelope (for example ``E > 2048``).
        """
        _check_int("num_ranks", num_ranks)
        return MoEShape(
            num_experts=self.local_experts * num_ranks,
            num_ranks=num_ranks,
            hidden=self.hidden,
            intermediate=self.intermediate,
            topk=self.topk,
            num_shared_experts=self.shared_experts if with_shared else 0,
            capacity=self.capacity,
            mma_type=mma_type,
        )


PRESETS: Mapping[str, MoEPreset] = MappingProxyType({
    p.name: p
    for p in (
        MoEPreset("dsv41-flash", hidden=5120, intermediate=2304, local_experts=48, topk=6, shared_experts=1,
                  shared_weight_k_group=32),
        MoEPreset("glm52", hidden=6144, intermediate=2048, local_experts=32, topk=8, shared_experts=1,
                  shared_weight_k_group=128),
        MoEPreset("tiny", hidden=512, intermediate=256, local_experts=4, topk=2, shared_experts=1,
                  shared_weight_k_group=128),
        # DeepSeek-V3's per-rank load at EP8: 256 routed experts / 8 ranks, top-8, one shared expert, routed scaling
        # 2.5, no SwiGLU limit (issue 22's sequence benchmark, gc-moe-ab's --preset dsv3).
        MoEPreset("dsv3", hidden=7168, intermediate=2048, local_experts=32, topk=8, shared_experts=1,
                  shared_weight_k_group=128, activation_clamp=None, routed_scaling_factor=2.5),
    )
})


def preset_shape(name: str, num_ranks: int, *, mma_type: str = "fp8xfp4", with_shared: bool = True) -> MoEShape:
    """Shape of preset ``name`` at ``num_ranks`` ranks (``E = e·P``); see ``MoEPreset.shape``."""
    if name not in PRESETS:
        raise ValueError(f"name: must be one of {sorted(PRESETS)} (docs/bench_protocol.md presets), got {name!r}")
    return PRESETS[name].shape(num_ranks, mma_type=mma_type, with_shared=with_shared)


def tokens_per_expert(num_tokens: int, shape: MoEShape) -> float:
    """Mean routed tokens per expert under balanced routing: ``T·k·P/E`` (``= T·k/e``)."""
    int_in_range("num_tokens", num_tokens, 0, None, "tokens per rank")
    return num_tokens * shape.topk * shape.num_ranks / shape.num_experts


# ----------------------------------------------------------------------------------------------------------------
# Scalar checks
# ----------------------------------------------------------------------------------------------------------------
def _fail(arg: str, rule: str, why: str, got: object, exc: type[Exception] = ValueError) -> Exception:
    """Build the uniform error: argument, rule, reason, value seen."""
    return exc(f"{arg}: must be {rule} ({why}), got {got}")


def _check_int(arg: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(arg, "an int", "shape parameters are integers", f"{value!r} of type {type(value).__name__}",
                    TypeError)


def shown(value: object) -> object:
    """``value`` for an error message: an int too long to read (``10**400``) as its digit count."""
    if isinstance(value, int) and abs(value) >= 10**20:
        return f"an int of {len(str(abs(value)))} digits"
    return value


def int_in_range(arg: str, value: object, lo: int, hi: int | None, why: str) -> int:
    """A Python int (not bool) in ``[lo, hi]`` (``hi`` None: unbounded): ``TypeError`` for another type, ``ValueError``
    out of range, each naming ``arg``, the rule, ``why`` and the value. The size check of the shape rules and of the
    calls that word their errors without a function name (the ``deep_ep`` low-latency sizes)."""
    _check_int(arg, value)
    if value < lo or (hi is not None and value > hi):
        rule = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise _fail(arg, rule, why, shown(value))
    return value


def _check_multiple(arg: str, value: int, of: int, why: str) -> None:
    if value % of:
        raise _fail(arg, f"a multiple of {of}", why, value)


def _check_shape(shape: MoEShape) -> None:
    """Scalar rules of the module table (run by ``MoEShape.__post_init__`` and by ``validate``)."""
    compute_path(shape.mma_type)
    int_in_range("hidden", shape.hidden, 1, MAX_HIDDEN, _WHY_H_MAX)
    _check_multiple("hidden", shape.hidden, HIDDEN_ALIGN, _WHY_H)
    int_in_range("intermediate", shape.intermediate, 1, MAX_INTERMEDIATE, _WHY_I)
    _check_multiple("intermediate", shape.intermediate, INTERMEDIATE_ALIGN, _WHY_I)
    check_routing(shape.num_experts, shape.num_ranks, shape.topk, shape.capacity, shape.num_shared_experts)


def check_routing(num_experts: object, num_ranks: object, topk: object, capacity: object,
                  num_shared_experts: object = 0) -> None:
    """The routing rules of the module table (experts, ranks, top-k, shared experts, capacity), each error naming
    the ``MoEShape`` field: part of :class:`MoEShape`'s check, and the whole check of calls that take only these
    sizes (the facade's ``get_block_m_for_mega_moe``), so they answer only for shapes a buffer accepts."""
    int_in_range("num_shared_experts", num_shared_experts, 0, 1, "at most one fused shared expert")
    int_in_range("topk", topk, 1, MAX_COMBINE_SLOTS - num_shared_experts,
                 f"k + num_shared_experts <= {MAX_COMBINE_SLOTS}: {_WHY_SLOTS}")
    int_in_range("num_ranks", num_ranks, 1, MAX_RANKS, _WHY_RANKS)
    int_in_range("num_experts", num_experts, 1, MAX_EXPERTS, _WHY_EXPERTS)
    if topk > num_experts:  # a rule of both: named both
        raise _fail("topk", f"<= num_experts ({num_experts})", "k <= E: top-k without repetition", topk)
    _check_multiple("num_experts", num_experts, num_ranks,
                    f"num_ranks={num_ranks}: experts are distributed evenly, e = E/P")
    int_in_range("num_experts / num_ranks", num_experts // num_ranks, 1, MAX_LOCAL_EXPERTS,
                 "lane-held per-expert counters")
    int_in_range("capacity", capacity, 1, MAX_CAPACITY, _WHY_CAPACITY)


# ----------------------------------------------------------------------------------------------------------------
# Tensor checks
# ----------------------------------------------------------------------------------------------------------------
# An expected shape is a tuple of (label, value) with value None for the token dimension.
_Dims = tuple[tuple[str, int | None], ...]
# dtype -> (expected dims, description of that form)
_Forms = Mapping[torch.dtype, tuple[_Dims, str]]
# (shape, N, K) -> accepted (payload, scales) forms of one weight pair
_FormsOf = Callable[[MoEShape, int, int], tuple[_Forms, _Forms]]


def _fmt_dims(dims: _Dims) -> str:
    return "[" + ", ".join(label if value is None else f"{label}={value}" for label, value in dims) + "]"


def _routed_pair_forms(shape: MoEShape, n: int, k: int) -> tuple[_Forms, _Forms]:
    """Accepted (payload, scales) forms of one routed weight pair ``[e, N, K]``; the first form is canonical."""
    e = ("E/P", shape.num_local_experts)
    if compute_path(shape.mma_type).fp4:
        payload: _Dims = (e, ("N", n), ("K/2", k // 2))
        fp4 = "packed E2M1, two values per byte"
        return (
            {torch.uint8: (payload, fp4), torch.int8: (payload, fp4)},
            {
                torch.uint8: ((e, ("N", n), ("K/32", k // 32)), "UE8M0 K32 scales"),
                torch.int32: ((e, ("N", n), ("K/128", k // 128)), "4 packed UE8M0 K32 scales per int32"),
            },
        )
    return (
        {_FP8: ((e, ("N", n), ("K", k)), "E4M3 weights")},
        {torch.float32: ((e, ("N/128", n // 128), ("K/128", k // 128)), "FP32 128x128 block scales")},
    )


def _shared_pair_forms(shape: MoEShape, n: int, k: int) -> tuple[_Forms, _Forms]:
    """Accepted (payload, scales) forms of one shared-expert weight pair ``[S, N, K]`` (FP8 on both paths)."""
    s = ("S", shape.num_shared_experts)
    return (
        {_FP8: ((s, ("N", n), ("K", k)), "E4M3 weights")},
        {
            torch.uint8: ((s, ("N", n), ("K/32", k // 32)), "per-row UE8M0 K32 scales, recipe (1, 1, 32)"),
            torch.int32: ((s, ("N", n), ("K/128", k // 128)), "4 packed UE8M0 K32 scales per int32"),
            torch.float32: ((s, ("N/128", n // 128), ("K/128", k // 128)), "FP32 128x128 blocks, recipe (1, 128, 128)"),
        },
    )


class _TensorChecker:
    """Checks tensors one by one while tracking the common device and token count."""

    def __init__(self, shape: MoEShape, num_tokens: int | None) -> None:
        self.shape = shape
        self.device: torch.device | None = None
        self.device_from = ""
        self.tokens = num_tokens
        self.tokens_from = "num_tokens"

    def tensor(self, arg: str, t: object, forms: _Forms) -> torch.Tensor:
        """Type, dtype, rank/shape, contiguity, device and token count of one tensor."""
        if not isinstance(t, torch.Tensor):
            raise _fail(arg, "a torch.Tensor", "operator operand", type(t).__name__, TypeError)
        accepted = ", ".join(f"{dtype} ({why})" for dtype, (_, why) in forms.items())
        if t.dtype not in forms:
            raise _fail(arg, f"of dtype {accepted}", _WHY_LAYOUT, t.dtype, TypeError)
        dims, why = forms[t.dtype]
        if t.dim() != len(dims) or any(v is not None and v != got for (_, v), got in zip(dims, t.shape, strict=True)):
            raise _fail(arg, f"of shape {_fmt_dims(dims)} for {t.dtype}", why, tuple(t.shape))
        if not t.is_contiguous():
            raise _fail(arg, "contiguous", _WHY_LAYOUT, f"strides {t.stride()}")
        if self.device is None:
            self.device, self.device_from = t.device, arg
        elif t.device != self.device:
            raise _fail(arg, f"on {self.device_from}'s device {self.device}", "one process per GPU", t.device)
        if dims[0][1] is None:
            self._tokens(arg, t.shape[0])
        return t

    def _tokens(self, arg: str, count: int) -> None:
        if self.tokens is None:
            int_in_range(f"{arg}.shape[0] (tokens)", count, 0, self.shape.capacity, _WHY_CAPACITY)
            self.tokens, self.tokens_from = count, f"{arg}.shape[0]"
        elif count != self.tokens:
            raise _fail(f"{arg}.shape[0]", f"equal to {self.tokens_from}={self.tokens}",
                        "one token count T per call", count)

    def pair(self, arg: str, pair: object, forms: tuple[_Forms, _Forms]) -> torch.dtype:
        """A ``(weights, scales)`` pair; returns the scale dtype (identifies the scale form)."""
        if not isinstance(pair, tuple | list):
            raise _fail(arg, "a 2-tuple (weights, scales) of tensors", "operator operand", type(pair).__name__,
                        TypeError)
        if len(pair) != 2:
            raise _fail(arg, "a 2-tuple (weights, scales) of tensors", "operator operand", f"length {len(pair)}")
        self.tensor(f"{arg}[0]", pair[0], forms[0])
        return self.tensor(f"{arg}[1]", pair[1], forms[1]).dtype

    def weight_pairs(self, prefix: str, l1: object, l2: object, forms_of: _FormsOf) -> None:
        """Both GEMMs' pairs of one weight set; the two halves must share one scale form."""
        seen: dict[str, torch.dtype] = {}
        for (n, k), arg, pair in zip(self.shape._gemm_nk(), (f"{prefix}l1_weights", f"{prefix}l2_weights"),
                                     (l1, l2), strict=True):
            if pair is not None:
                seen[arg] = self.pair(arg, pair, forms_of(self.shape, n, k))
        if len(set(seen.values())) > 1:
            (a1, d1), (a2, d2) = seen.items()
            raise _fail(f"{a2}[1]", f"of the same scale form as {a1}[1] ({d1})", "one recipe per weight set", d2)


def check_topk_values(t: torch.Tensor, bound: int, arg: str = "topk_idx") -> None:
    """Expert ids in ``[-1, bound)``: one vectorized min/max (a device sync on GPU). Shared by :func:`validate` and
    the pre-dispatch's host path."""
    lo, hi = (int(v) for v in torch.stack(torch.aminmax(t)).tolist())
    if lo < -1 or hi >= bound:
        raise _fail(arg, f"in [-1, {bound}) with -1 the only negative value",
                    "global expert ids; -1 marks an unused slot", f"min {lo}, max {hi}")


def check_finite(t: torch.Tensor, arg: str = "topk_weights") -> None:
    """Every value finite (a device sync on GPU): a NaN/Inf routing weight poisons the fused requantization."""
    bad = int((~torch.isfinite(t)).sum())
    if bad:
        raise _fail(arg, "finite", "a NaN/Inf weight poisons the fused requantization", f"{bad} non-finite")


def inspect_values(t: torch.Tensor) -> bool:
    """Values can be read: not a meta tensor, not empty, not under CUDA graph capture (a sync would break it)."""
    if t.is_meta or t.numel() == 0:
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def integer(fn: str, arg: str, value: object, lo: int, hi: int | None = None) -> int:
    """A Python int (not bool) in ``[lo, hi]``: ``TypeError`` for another type, ``ValueError`` out of range.

    The one integer check of the native API and both facades (``deep_gemm._checks`` re-exports it), kept with the
    shape rules, the lowest layer they all import, so they word it alike."""
    if type(value) is not int and (isinstance(value, bool) or not isinstance(value, int)):
        raise TypeError(f"{fn}: {arg} must be an int, got {type(value).__name__} ({value!r})")
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{fn}: {arg} must be {bound}, got {shown(value)}")
    return value


def finite_float(fn: str, arg: str, value: object, *, positive: bool = False) -> float:
    """A finite real number (int or float, not bool; ``positive``: also ``> 0``) as a float: ``TypeError`` for
    another type, ``ValueError`` otherwise, an int too large for a float (``10**400``) included. The one float check
    of the native API and both facades."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{fn}: {arg} must be a float, got {type(value).__name__} ({value!r})")
    try:
        result = float(value)
    except OverflowError:
        result = math.inf
    if not math.isfinite(result) or (positive and result <= 0):
        raise ValueError(f"{fn}: {arg} must be a finite{' positive' if positive else ''} number, got {shown(value)}")
    return result


def recipe(fn: str, value: object, supported: tuple[int, ...]) -> tuple[int, ...]:
    """A recipe: a tuple or list of ints equal to ``supported``, as a tuple (``TypeError`` for another type or a
    non-int member, ``ValueError`` for another recipe). The one recipe check of the native API and both facades."""
    if not isinstance(value, tuple | list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise TypeError(f"{fn}: recipe must be a tuple of ints {supported}, got {type(value).__name__} "
                        f"({value!r:.80})")
    if tuple(value) != supported:
        raise ValueError(f"{fn}: recipe must be {supported}, got {tuple(value)}")
    return tuple(value)


def boolean(fn: str, arg: str, value: object, *, none_ok: bool = False) -> bool | None:
    """A Python bool (``None`` too when ``none_ok``: DeepEP's / DeepGEMM's "auto" defaults), else ``TypeError``.

    Why: flags are read by truth value, so ``'no'`` would silently mean True and ``None`` False. Shared by the
    native API and both facades (``deep_gemm._checks`` re-exports it)."""
    if isinstance(value, bool) or (none_ok and value is None):
        return value
    allowed = "a bool or None" if none_ok else "a bool"
    raise TypeError(f"{fn}: {arg} must be {allowed}, got {type(value).__name__} ({value!r})")


def validate(
    shape: MoEShape,
    *,
    x: torch.Tensor | None = None,
    x_sf: torch.Tensor | None = None,
    topk_idx: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    l1_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    l2_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    shared_l1_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    shared_l2_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    y: torch.Tensor | None = None,
    num_tokens: int | None = None,
    check_values: bool = True,
) -> None:
    """Check ``shape`` and every given operand against the rules of the module docstring, before any launch.

    Arguments left as ``None`` are not checked, so callers can validate at buffer creation (shape only), at weight
    transformation (weights) and per call (activations, routing, output). The token count ``T`` is taken from
    ``num_tokens`` if given, else from the first token-major tensor; all of ``x, x_sf, topk_idx, topk_weights, y``
    must agree on it and it must lie in ``[0, capacity]``. Pass the ``[:T]`` slices of staging buffers.

    ``check_values`` inspects ``topk_idx`` (one vectorized min/max) and ``topk_weights`` (finiteness). On a GPU each
    is one device synchronization; both are skipped on meta tensors and while the current CUDA stream is capturing
    a graph (a sync is illegal there). Pass ``check_values=False`` on a latency-critical eager path; it must be a
    bool (``None`` would silently skip them).

    Raises:
        TypeError: a wrong Python type or tensor dtype.
        ValueError: a value, shape, stride, device or token-count violation.
    """
    boolean("validate", "check_values", check_values)
    if not isinstance(shape, MoEShape):
        raise _fail("shape", "an MoEShape", "describes the operator instance", type(shape).__name__, TypeError)
    _check_shape(shape)
    if num_tokens is not None:
        int_in_range("num_tokens", num_tokens, 0, shape.capacity, _WHY_CAPACITY)
    chk = _TensorChecker(shape, num_tokens)
    tokens_h: _Dims = (("T", None), ("H", shape.hidden))
    tokens_k: _Dims = (("T", None), ("k", shape.topk))
    sf: _Dims = (("T", None), ("H/128", shape.hidden // 128))
    x_sf_forms: dict[torch.dtype, tuple[_Dims, str]] = {torch.float32: (sf, "FP32 1x128 (K128) scales")}
    if compute_path(shape.mma_type).fp4:
        x_sf_forms[torch.int32] = (sf, "DeepGEMM SM100 packed: 4 UE8M0 K32 scales per int32")
    token_args = (
        ("x", x, {_FP8: (tokens_h, "E4M3 activations")}),
        ("x_sf", x_sf, x_sf_forms),
        ("topk_idx", topk_idx, {torch.int64: (tokens_k, "expert ids"), torch.int32: (tokens_k, "expert ids")}),
        ("topk_weights", topk_weights, {torch.float32: (tokens_k, "routing weights")}),
        ("y", y, {torch.bfloat16: (tokens_h, "BF16 output")}),
    )
    for arg, t, forms in token_args:
        if t is not None:
            chk.tensor(arg, t, forms)
    chk.weight_pairs("", l1_weights, l2_weights, _routed_pair_forms)
    if (shared_l1_weights is not None or shared_l2_weights is not None) and shape.num_shared_experts == 0:
        raise _fail("shared_l1_weights/shared_l2_weights", "None", "shape.num_shared_experts is 0", "a weight pair")
    chk.weight_pairs("shared_", shared_l1_weights, shared_l2_weights, _shared_pair_forms)
    if check_values and topk_idx is not None and inspect_values(topk_idx):
        check_topk_values(topk_idx, shape.num_experts)
    if check_values and topk_weights is not None and inspect_values(topk_weights):
        check_finite(topk_weights)
