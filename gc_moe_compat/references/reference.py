"""FP32 references for the MoE layer: every kernel of this project is tested against these.

Two references (BENCH_PROTOCOL.md, "Accuracy suite") share ONE core, :func:`expert_parallel_reference`
(:func:`moe_reference` is its one-rank case). They differ only in what they are given and in one flag:

* **Quantization-faithful** (:func:`quantization_faithful_reference`): the exact packed weights
  (:class:`ExpertWeights` in ``"mxfp4"``, ``"fp8_block128"`` or ``"fp8_k32"``) and the FP8 activations the kernel
  reads are dequantized, and the intermediate is requantized exactly as the W1 epilogue does.
* **Model** (:func:`model_reference`): unquantized (``"bf16"``/``"fp32"``) weights and float activations, no
  intermediate requantization: the BF16 layer the quantized one approximates.

Semantics modelled (API_SURFACE.md, "Semantics the numbers depend on"; DeepGEMM 2.8.2's SM100 Mega MoE epilogue):

1. **Canonical layout** (before any kernel weight transform; the gate/up interleave by 8 is NOT applied here):
   L1 = ``[E, 2I, H]`` with gate rows ``[0, I)`` and up rows ``[I, 2I)``; L2 = ``[E, H, I]``.
2. **Activations** are a float tensor ``[T, H]`` or a pair ``(fp8 [T, H], float32 scales [T, H/g])``; ``g`` follows
   from the scale shape: 128 with FP32 scales (SM90 recipe) or 32 with UE8M0 (power-of-two) scales (SM100 recipe,
   recipe ``(1, 1, 32)``). Dequantized with :func:`gc_moe_compat.quant.dequantize_fp8_groups`.
3. **GEMMs** model an ideal FP32 accumulator: the product is formed in FP64 (exact for FP8/FP4/BF16 inputs up to
   ~2^-53 relative) and rounded once to FP32. This is at least as accurate as any FP32 accumulation order a kernel
   uses, and it does not depend on TF32 settings or on BLAS blocking (so a row's result does not depend on which
   other rows share its GEMM). Devices without FP64 (MPS) fall back to an FP32 matmul.
4. **W1 epilogue**: ``acc = x @ W1^T`` is rounded to BF16 (``round_l1_bf16=True``, the default for BOTH references:
   the kernel does it, and the model reference models a BF16 layer whose GEMM outputs are BF16). Then SwiGLU in
   FP32 with clamp ``c`` and ``alpha``: ``gate = min(gate, c)`` (upper bound only), ``up = clamp(up, -c, c)``,
   ``out = gate * sigmoid(alpha * gate) * up`` (``c=None``: no clamp; the reference uses the exact sigmoid where the
   kernel uses fast math). Then ``out *= routing_weight`` (FP32) BEFORE requantization, so W2 needs no per-token
   scaling.
5. **Intermediate requantization** (faithful reference only), per token per group along I: ``"ue8m0_32"``
   (scale ``2**ceil(log2(amax/448))``, E4M3 payload; recipe ``(1, 1, 32)``, DeepGEMM's SM100 FP8xFP4 path),
   ``"ue8m0_128"`` (the same power-of-two scale per 128 values; the SM90 FP8xFP4 path) or ``"fp32_128"`` (scale
   ``amax/448``; the SM90 FP8xFP8 path), immediately dequantized: exactly the values the W2 stage reads.
6. **W2 epilogue**: ``partial = act @ W2^T`` rounded to BF16: one BF16 partial per (token, slot).
7. **Combine**: per token, the valid partials are added in FP32 in slot order (slot 0 first, starting from +0.0),
   then the optional shared expert as slot ``k`` (routing weight 1.0, its own weights in ``"fp8_k32"``,
   ``"fp8_block128"``, ``"bf16"`` or ``"fp32"``, computed on the token's own rank: it is replicated on every rank);
   ``y`` is that FP32 sum rounded to BF16. A slot with ``topk_idx == -1`` contributes nothing and never indexes an
   expert; a token with only ``-1`` slots and no shared expert gives 0.
8. **Expert parallelism** (simulated on one device): P ranks, ``E % P == 0``; rank ``r`` owns global experts
   ``[r*E/P, (r+1)*E/P)`` (local index ``e mod E/P``) and holds only their weights. :func:`dispatch_plan` lists,
   for each destination rank and local expert, the received rows ``(src_rank, src_token, slot)`` sorted by
   src_rank, then src_token, then slot: the order a kernel's token ring is compared against. Each received row is
   computed on its destination rank with that rank's weights and combined back on its source rank as in 7.
   :func:`recv_counts` gives the rows received per local expert (what ``cumulative_local_expert_recv_stats`` adds);
   a token routed twice to one expert counts twice (two rows).
9. **Metrics** (:func:`accuracy_metrics`) are computed in FP64; see that function for the zero/empty conventions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from gc_moe_compat import quant

__all__ = [
    "ActivationQuant",
    "Activations",
    "ExpertWeights",
    "MoEResult",
    "WeightFormat",
    "accuracy_metrics",
    "dequantize_activations",
    "dispatch_plan",
    "expert_parallel_reference",
    "expert_rows",
    "l1_intermediate",
    "model_reference",
    "moe_reference",
    "quantization_faithful_reference",
    "quantize_activations",
    "recv_counts",
    "requantize_intermediate",
    "swiglu",
]

WeightFormat = Literal["mxfp4", "fp8_block128", "fp8_k32", "bf16", "fp32"]
"""Weight storage formats: routed FP8xFP4 (mxfp4), SM90 FP8 (fp8_block128), shared (1,1,32) (fp8_k32), unquantized."""

ActivationQuant = Literal["ue8m0_32", "ue8m0_128", "fp32_128"]
"""Per-token group quantization of activations/intermediates: UE8M0 scales per 32 or 128, or FP32 scales per 128."""

Activations = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""A float ``[T, H]`` tensor, or ``(float8_e4m3fn [T, H], float32 scales [T, H/g])``."""

_WEIGHT_FORMATS: tuple[str, ...] = get_args(WeightFormat)
_ACT_RECIPES: dict[str, tuple[int, str]] = {
    "ue8m0_32": (32, "ue8m0"),
    "ue8m0_128": (128, "ue8m0"),
    "fp32_128": (128, "fp32"),
}
_FP8 = torch.float8_e4m3fn


# ----------------------------------------------------------------------------------------------------------- weights
@dataclass(frozen=True)
class ExpertWeights:
    """One weight matrix per expert, ``[E, N, K]`` logically, in one storage format.

    ``payload`` / ``scales`` by ``fmt``:

    * ``"mxfp4"``: packed E2M1 ``uint8`` (or ``int8``) ``[E, N, K/2]``, UE8M0 codes ``uint8`` ``[E, N, K/32]``.
    * ``"fp8_block128"``: ``float8_e4m3fn`` ``[E, N, K]``, FP32 ``[E, ceil(N/128), ceil(K/128)]`` block scales.
    * ``"fp8_k32"``: ``float8_e4m3fn`` ``[E, N, K]``, FP32 power-of-two (UE8M0-valued) ``[E, N, K/32]`` scales.
    * ``"bf16"`` / ``"fp32"``: the plain weights, ``scales`` is None.

    Build from float weights with :meth:`quantize`; slice per rank with :meth:`shard`.
    """

    fmt: WeightFormat
    payload: torch.Tensor
    scales: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.fmt not in _WEIGHT_FORMATS:
            raise ValueError(f"fmt: unknown weight format {self.fmt!r}, expected one of {_WEIGHT_FORMATS}")
        if self.payload.dim() != 3:
            raise ValueError(f"payload: expected [E, N, K] (3 dims), got shape {tuple(self.payload.shape)}")
        unquantized = self.fmt in ("bf16", "fp32")
        if unquantized != (self.scales is None):
            raise ValueError(f"scales: format {self.fmt!r} {'takes no' if unquantized else 'needs'} scales")
        expected_dtype = {
            "mxfp4": (torch.uint8, torch.int8),
            "fp8_block128": (_FP8,),
            "fp8_k32": (_FP8,),
            "bf16": (torch.bfloat16,),
            "fp32": (torch.float32,),
        }[self.fmt]
        if self.payload.dtype not in expected_dtype:
            raise ValueError(f"payload: format {self.fmt!r} needs dtype {expected_dtype}, got {self.payload.dtype}")
        if self.scales is None:
            return
        e, n, k = self.num_experts, self.out_features, self.in_features
        scale_dtype, scale_shape = {
            "mxfp4": (torch.uint8, (e, n, k // 32)),
            "fp8_block128": (torch.float32, (e, math.ceil(n / 128), math.ceil(k / 128))),
            "fp8_k32": (torch.float32, (e, n, k // 32)),
        }[self.fmt]
        if self.fmt != "fp8_block128" and k % 32:
            raise ValueError(f"payload: format {self.fmt!r} needs K % 32 == 0, got K={k}")
        if self.scales.dtype != scale_dtype or tuple(self.scales.shape) != scale_shape:
            raise ValueError(
                f"scales: format {self.fmt!r} needs {scale_dtype} {scale_shape}, "
                f"got {self.scales.dtype} {tuple(self.scales.shape)}"
            )

    @property
    def num_experts(self) -> int:
        """Number of experts E (leading dimension)."""
        return self.payload.shape[0]

    @property
    def out_features(self) -> int:
        """Rows per expert N (2I for L1, H for L2)."""
        return self.payload.shape[1]

    @property
    def in_features(self) -> int:
        """Reduction length K (H for L1, I for L2); FP4 packs two values per byte."""
        return self.payload.shape[2] * (2 if self.fmt == "mxfp4" else 1)

    @classmethod
    def quantize(cls, w: torch.Tensor, fmt: WeightFormat) -> ExpertWeights:
        """Store float weights ``[E, N, K]`` (or one expert ``[N, K]``) in ``fmt`` with :mod:`gc_moe_compat.quant`."""
        if w.dim() == 2:
            w = w.unsqueeze(0)
        if fmt == "mxfp4":
            return cls(fmt, *quant.quantize_mxfp4(w.float(), 32))
        if fmt == "fp8_block128":
            return cls(fmt, *quant.quantize_fp8_blocks(w.float(), 128))
        if fmt == "fp8_k32":
            return cls(fmt, *quant.quantize_fp8_groups(w.float(), 32, "ue8m0"))
        if fmt == "bf16":
            return cls(fmt, w.to(torch.bfloat16))
        if fmt == "fp32":
            return cls(fmt, w.float())
        raise ValueError(f"fmt: unknown weight format {fmt!r}, expected one of {_WEIGHT_FORMATS}")

    def dequantize(self, expert: int | None = None) -> torch.Tensor:
        """FP32 values ``[E, N, K]``, or ``[N, K]`` of one ``expert`` (dequantizing only that expert)."""
        sel = slice(None) if expert is None else expert
        payload = self.payload[sel]
        scales = None if self.scales is None else self.scales[sel]
        if self.fmt == "mxfp4":
            return quant.dequantize_mxfp4(payload.view(torch.uint8), scales)
        if self.fmt == "fp8_block128":
            return quant.dequantize_fp8_blocks(payload, scales, 128)
        if self.fmt == "fp8_k32":
            return quant.dequantize_fp8_groups(payload, scales)
        return payload.float()

    def experts(self, start: int, stop: int) -> ExpertWeights:
        """The experts ``[start, stop)`` as their own :class:`ExpertWeights` (views, no copy)."""
        scales = None if self.scales is None else self.scales[start:stop]
        return ExpertWeights(self.fmt, self.payload[start:stop], scales)

    def shard(self, num_ranks: int) -> list[ExpertWeights]:
        """Split the experts evenly over ``num_ranks`` ranks: rank r gets ``[r*E/P, (r+1)*E/P)``."""
        if num_ranks < 1 or self.num_experts % num_ranks:
            raise ValueError(f"num_ranks: {self.num_experts} experts do not split over {num_ranks} ranks")
        n = self.num_experts // num_ranks
        return [self.experts(r * n, (r + 1) * n) for r in range(num_ranks)]


def _as_weights(w: ExpertWeights | torch.Tensor, name: str) -> ExpertWeights:
    """Accept a plain float tensor ``[E, N, K]`` as unquantized weights."""
    if isinstance(w, ExpertWeights):
        return w
    if isinstance(w, torch.Tensor) and w.is_floating_point() and w.element_size() >= 2:
        return ExpertWeights.quantize(w, "bf16" if w.dtype == torch.bfloat16 else "fp32")
    raise TypeError(f"{name}: expected ExpertWeights or a float tensor, got {type(w).__name__}")


# ------------------------------------------------------------------------------------------------------- activations
def _group_recipe(mode: str, name: str) -> tuple[int, str]:
    if mode not in _ACT_RECIPES:
        raise ValueError(f"{name}: unknown quantization {mode!r}, expected one of {tuple(_ACT_RECIPES)}")
    return _ACT_RECIPES[mode]


def quantize_activations(x: torch.Tensor, mode: ActivationQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize float activations ``[T, H]`` per token group as the pre-dispatch kernels do.

    ``"ue8m0_32"``: UE8M0 scale per 32 values (SM100, recipe (1, 1, 32)); ``"ue8m0_128"``: UE8M0 per 128;
    ``"fp32_128"``: FP32 scale per 128 (SM90).
    Returns ``(float8_e4m3fn [T, H], float32 scales [T, H/g])``.
    """
    group, fmt = _group_recipe(mode, "mode")
    if x.shape[-1] % group:
        raise ValueError(f"x: hidden size {x.shape[-1]} is not a multiple of the group size {group} of {mode!r}")
    return quant.quantize_fp8_groups(x.float(), group, fmt)


def dequantize_activations(x: Activations) -> torch.Tensor:
    """FP32 ``[T, H]`` activations from a float tensor or an ``(fp8, float32 group scales)`` pair."""
    if isinstance(x, torch.Tensor):
        if not x.is_floating_point() or x.dtype == _FP8:
            raise TypeError(f"x: a bare tensor must be a float tensor, got {x.dtype}; pass FP8 as (payload, scales)")
        return x.float()
    payload, scales = x
    if payload.dtype != _FP8 or scales.dtype != torch.float32:
        raise TypeError(f"x: expected (float8_e4m3fn, float32) pair, got ({payload.dtype}, {scales.dtype})")
    if scales.dim() != payload.dim() or scales.shape[-1] == 0 or payload.shape[-1] % scales.shape[-1]:
        raise ValueError(f"x: scales {tuple(scales.shape)} do not tile payload {tuple(payload.shape)} in groups")
    return quant.dequantize_fp8_groups(payload, scales)


# ----------------------------------------------------------------------------------------------------- expert rows
def _gemm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``a @ w^T`` as an ideal FP32 accumulator: FP64 product rounded once to FP32 (see module docstring, 3)."""
    if a.device.type == "mps":  # pragma: no cover - no FP64 there
        return a.float() @ w.float().T
    return (a.double() @ w.double().T).float()


def swiglu(
    gate: torch.Tensor, up: torch.Tensor, *, activation_clamp: float | None = None, activation_alpha: float = 1.0
) -> torch.Tensor:
    """Clamped SwiGLU in FP32: ``min(gate, c) * sigmoid(alpha * min(gate, c)) * clamp(up, -c, c)``."""
    gate, up = gate.float(), up.float()
    if activation_clamp is not None:
        gate = torch.clamp(gate, max=activation_clamp)
        up = torch.clamp(up, -activation_clamp, activation_clamp)
    return gate * torch.sigmoid(activation_alpha * gate) * up


def requantize_intermediate(act: torch.Tensor, mode: ActivationQuant | None) -> torch.Tensor:
    """The intermediate the W2 stage reads: FP8 group quantize-dequantize per token (``None``: unchanged)."""
    if mode is None:
        return act
    return dequantize_activations(quantize_activations(act, mode))


def l1_intermediate(
    x: torch.Tensor,
    w1: torch.Tensor,
    routing_weights: torch.Tensor,
    *,
    activation_clamp: float | None = None,
    activation_alpha: float = 1.0,
    intermediate_quant: ActivationQuant | None = None,
    round_l1_bf16: bool = True,
) -> torch.Tensor:
    """The W1 stage for rows of one expert: FP32 ``[n, I]`` exactly as the W2 stage reads it.

    ``x`` ``[n, H]`` (FP32 values), ``w1`` ``[2I, H]`` (gate rows first), ``routing_weights`` ``[n]``.
    Steps (module docstring, 4-5): GEMM, optional BF16 rounding, SwiGLU, times routing weight, optional requant.
    """
    acc = _gemm(x, w1)
    if round_l1_bf16:
        acc = acc.to(torch.bfloat16).float()
    inter = w1.shape[0] // 2
    act = swiglu(acc[:, :inter], acc[:, inter:], activation_clamp=activation_clamp, activation_alpha=activation_alpha)
    act = act * routing_weights.float().unsqueeze(-1)
    return requantize_intermediate(act, intermediate_quant)


def expert_rows(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    routing_weights: torch.Tensor,
    *,
    activation_clamp: float | None = None,
    activation_alpha: float = 1.0,
    intermediate_quant: ActivationQuant | None = None,
    round_l1_bf16: bool = True,
) -> torch.Tensor:
    """One expert on ``n`` rows: the BF16 partials ``[n, H]`` its W2 epilogue writes.

    ``w1`` ``[2I, H]`` and ``w2`` ``[H, I]`` are FP32 (dequantized) weights of that expert. This is the single
    computation both references and the P-rank simulation use for every (token, slot) row.
    """
    act = l1_intermediate(
        x,
        w1,
        routing_weights,
        activation_clamp=activation_clamp,
        activation_alpha=activation_alpha,
        intermediate_quant=intermediate_quant,
        round_l1_bf16=round_l1_bf16,
    )
    return _gemm(act, w2).to(torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------- routing
def _check_routing(topk_idx_per_rank: Sequence[torch.Tensor], num_experts: int) -> None:
    if len(topk_idx_per_rank) < 1:
        raise ValueError("topk_idx_per_rank: need at least one rank")
    num_ranks = len(topk_idx_per_rank)
    if num_experts < 1 or num_experts % num_ranks:
        raise ValueError(f"num_experts: {num_experts} is not a positive multiple of the rank count {num_ranks}")
    topk = topk_idx_per_rank[0].shape[-1] if topk_idx_per_rank[0].dim() == 2 else -1
    for r, idx in enumerate(topk_idx_per_rank):
        if idx.dim() != 2 or idx.shape[1] != topk or idx.is_floating_point() or idx.dtype == torch.bool:
            raise ValueError(
                f"topk_idx[{r}]: expected an integer [T, k] tensor with k={topk}, got {idx.dtype} {tuple(idx.shape)}"
            )
        if idx.numel() and (int(idx.min()) < -1 or int(idx.max()) >= num_experts):
            raise ValueError(
                f"topk_idx[{r}]: expert ids must lie in [-1, {num_experts}), got [{int(idx.min())}, {int(idx.max())}]"
            )


def dispatch_plan(topk_idx_per_rank: Sequence[torch.Tensor], num_experts: int) -> list[list[torch.Tensor]]:
    """Rows each rank receives: ``plan[dst_rank][local_expert]``, int64 ``[n, 3]`` of (src_rank, src_token, slot).

    ``topk_idx_per_rank[r]`` is ``[T_r, k]`` with GLOBAL expert ids in ``[-1, num_experts)``; the rank count P is
    ``len(topk_idx_per_rank)``; global expert ``e`` lives on rank ``e // (E/P)`` as local expert ``e % (E/P)``.
    Rows are sorted by src_rank, then src_token, then slot (the order a kernel's token ring is compared against);
    ``-1`` slots are not dispatched. Tensors are on the device of ``topk_idx_per_rank[0]``.
    """
    _check_routing(topk_idx_per_rank, num_experts)
    num_ranks = len(topk_idx_per_rank)
    device = topk_idx_per_rank[0].device
    rows, experts = [], []
    for r, idx in enumerate(topk_idx_per_rank):
        idx = idx.to(device=device, dtype=torch.int64)
        token_slot = (idx >= 0).nonzero()  # row-major: sorted by token, then slot
        rows.append(torch.cat([torch.full_like(token_slot[:, :1], r), token_slot], dim=1))
        experts.append(idx[token_slot[:, 0], token_slot[:, 1]])
    all_rows, all_experts = torch.cat(rows), torch.cat(experts)
    order = torch.sort(all_experts, stable=True).indices  # stable: keeps (src_rank, src_token, slot) order
    counts = torch.bincount(all_experts, minlength=num_experts).tolist()
    per_expert = torch.split(all_rows[order], counts)
    local = num_experts // num_ranks
    return [list(per_expert[d * local : (d + 1) * local]) for d in range(num_ranks)]


def recv_counts(plan: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """Rows received per local expert, int32 ``[E/P]`` per rank: what ``cumulative_local_expert_recv_stats`` adds."""
    return [torch.tensor([t.shape[0] for t in rank], dtype=torch.int32) for rank in plan]


# ---------------------------------------------------------------------------------------------------------- layers
@dataclass(frozen=True)
class MoEResult:
    """One rank's layer output.

    ``y``: BF16 ``[T, H]``; ``y_fp32``: the FP32 slot-order sum before the final rounding; ``partials``: BF16
    ``[T, S, H]`` with ``S = k`` (+1 for the shared expert, last), zero where ``valid`` (bool ``[T, S]``) is False.
    """

    y: torch.Tensor
    y_fp32: torch.Tensor
    partials: torch.Tensor
    valid: torch.Tensor


def _combine(partials: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Sum valid BF16 partials per token in FP32, in slot order (slot 0 first)."""
    acc = torch.zeros(partials.shape[0], partials.shape[2], dtype=torch.float32, device=partials.device)
    for s in range(partials.shape[1]):
        acc = torch.where(valid[:, s, None], acc + partials[:, s].float(), acc)
    return acc


def expert_parallel_reference(
    x_per_rank: Sequence[Activations],
    topk_idx_per_rank: Sequence[torch.Tensor],
    topk_weights_per_rank: Sequence[torch.Tensor],
    l1_per_rank: Sequence[ExpertWeights | torch.Tensor],
    l2_per_rank: Sequence[ExpertWeights | torch.Tensor],
    *,
    shared: tuple[ExpertWeights | torch.Tensor, ExpertWeights | torch.Tensor] | None = None,
    activation_clamp: float | None = None,
    activation_alpha: float = 1.0,
    intermediate_quant: ActivationQuant | None = None,
    round_l1_bf16: bool = True,
) -> list[MoEResult]:
    """The MoE layer on P simulated ranks; the core of every reference (module docstring, 1-8).

    Per rank r: activations ``x_per_rank[r]`` (float ``[T_r, H]`` or ``(fp8, scales)``), ``topk_idx`` ``[T_r, k]``
    with global ids in ``[-1, E)``, ``topk_weights`` ``[T_r, k]``, and the weights of its E/P local experts
    (``l1`` ``[E/P, 2I, H]``, ``l2`` ``[E/P, H, I]``). ``shared``: optional ``(l1, l2)`` of one shared expert
    (``[1, 2I, H]``, ``[1, H, I]``), replicated on every rank. Rows are computed per destination rank and local
    expert in :func:`dispatch_plan` order, then combined on their source rank. Returns one :class:`MoEResult` per rank.
    """
    num_ranks = len(x_per_rank)
    lengths = {len(topk_idx_per_rank), len(topk_weights_per_rank), len(l1_per_rank), len(l2_per_rank)}
    if num_ranks < 1 or lengths != {num_ranks}:
        raise ValueError("x/topk_idx/topk_weights/l1/l2 per rank: need the same non-zero number of ranks")
    l1s = [_as_weights(w, f"l1_per_rank[{r}]") for r, w in enumerate(l1_per_rank)]
    l2s = [_as_weights(w, f"l2_per_rank[{r}]") for r, w in enumerate(l2_per_rank)]
    local, hidden, inter2 = l1s[0].num_experts, l1s[0].in_features, l1s[0].out_features
    for r, (l1, l2) in enumerate(zip(l1s, l2s, strict=True)):
        if (l1.num_experts, l1.out_features, l1.in_features) != (local, inter2, hidden) or inter2 % 2:
            raise ValueError(
                f"l1_per_rank[{r}]: expected [{local}, 2I, {hidden}] like rank 0, got "
                f"[{l1.num_experts}, {l1.out_features}, {l1.in_features}]"
            )
        if (l2.num_experts, l2.out_features, l2.in_features) != (local, hidden, inter2 // 2):
            raise ValueError(
                f"l2_per_rank[{r}]: expected [{local}, {hidden}, {inter2 // 2}], got "
                f"[{l2.num_experts}, {l2.out_features}, {l2.in_features}]"
            )
    plan = dispatch_plan(topk_idx_per_rank, local * num_ranks)

    xs = [dequantize_activations(x) for x in x_per_rank]
    device = xs[0].device
    topk = topk_idx_per_rank[0].shape[1]
    for r, (x, w) in enumerate(zip(xs, topk_weights_per_rank, strict=True)):
        t = topk_idx_per_rank[r].shape[0]
        if tuple(x.shape) != (t, hidden) or tuple(w.shape) != (t, topk):
            raise ValueError(
                f"x/topk_weights[{r}]: expected [{t}, {hidden}] and [{t}, {topk}], got "
                f"{tuple(x.shape)} and {tuple(w.shape)}"
            )
    offsets = [0]
    for x in xs:
        offsets.append(offsets[-1] + x.shape[0])
    x_all = torch.cat([x.to(device) for x in xs])
    w_all = torch.cat([w.to(device=device, dtype=torch.float32) for w in topk_weights_per_rank])
    idx_all = torch.cat([i.to(device) for i in topk_idx_per_rank])
    offs = torch.tensor(offsets[:-1], dtype=torch.int64, device=device)

    num_slots = topk + (shared is not None)
    partials = torch.zeros(x_all.shape[0], num_slots, hidden, dtype=torch.bfloat16, device=device)
    valid = torch.zeros(x_all.shape[0], num_slots, dtype=torch.bool, device=device)
    valid[:, :topk] = idx_all >= 0
    kwargs = dict(
        activation_clamp=activation_clamp,
        activation_alpha=activation_alpha,
        intermediate_quant=intermediate_quant,
        round_l1_bf16=round_l1_bf16,
    )
    for dst in range(num_ranks):
        for e in range(local):
            rows = plan[dst][e].to(device)
            if rows.shape[0] == 0:
                continue
            token = offs[rows[:, 0]] + rows[:, 1]
            slot = rows[:, 2]
            w1, w2 = l1s[dst].dequantize(e).to(device), l2s[dst].dequantize(e).to(device)
            partials[token, slot] = expert_rows(x_all[token], w1, w2, w_all[token, slot], **kwargs)
    if shared is not None:
        sl1, sl2 = _as_weights(shared[0], "shared[0]"), _as_weights(shared[1], "shared[1]")
        if (sl1.num_experts, sl1.out_features, sl1.in_features) != (1, inter2, hidden) or (
            sl2.num_experts,
            sl2.out_features,
            sl2.in_features,
        ) != (1, hidden, inter2 // 2):
            raise ValueError(f"shared: expected one expert [1, {inter2}, {hidden}] and [1, {hidden}, {inter2 // 2}]")
        ones = torch.ones(x_all.shape[0], dtype=torch.float32, device=device)
        partials[:, topk] = expert_rows(
            x_all, sl1.dequantize(0).to(device), sl2.dequantize(0).to(device), ones, **kwargs
        )
        valid[:, topk] = True

    y_fp32 = _combine(partials, valid)
    y = y_fp32.to(torch.bfloat16)
    return [
        MoEResult(y[a:b], y_fp32[a:b], partials[a:b], valid[a:b])
        for a, b in zip(offsets[:-1], offsets[1:], strict=True)
    ]


def moe_reference(
    x: Activations,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    l1: ExpertWeights | torch.Tensor,
    l2: ExpertWeights | torch.Tensor,
    *,
    shared: tuple[ExpertWeights | torch.Tensor, ExpertWeights | torch.Tensor] | None = None,
    activation_clamp: float | None = None,
    activation_alpha: float = 1.0,
    intermediate_quant: ActivationQuant | None = None,
    round_l1_bf16: bool = True,
) -> MoEResult:
    """The MoE layer on one rank holding all E experts: :func:`expert_parallel_reference` with P = 1."""
    return expert_parallel_reference(
        [x],
        [topk_idx],
        [topk_weights],
        [l1],
        [l2],
        shared=shared,
        activation_clamp=activation_clamp,
        activation_alpha=activation_alpha,
        intermediate_quant=intermediate_quant,
        round_l1_bf16=round_l1_bf16,
    )[0]


def quantization_faithful_reference(
    x: Activations,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    l1: ExpertWeights,
    l2: ExpertWeights,
    *,
    shared: tuple[ExpertWeights, ExpertWeights] | None = None,
    activation_clamp: float | None = None,
    activation_alpha: float = 1.0,
    intermediate_quant: ActivationQuant = "ue8m0_32",
) -> MoEResult:
    """Reference 1: the kernel's exact inputs dequantized, intermediate requantized (``"ue8m0_32"``: SM100 FP8xFP4
    path; ``"ue8m0_128"``: SM90 FP8xFP4 path; ``"fp32_128"``: SM90 FP8xFP8 path). Target for kernels: cosine >=
    0.9999, processed diff <= 1e-4."""
    return moe_reference(
        x,
        topk_idx,
        topk_weights,
        l1,
        l2,
        shared=shared,
        activation_clamp=activation_clamp,
        activation_alpha=activation_alpha,
        intermediate_quant=intermediate_quant,
    )


def model_reference(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    l1: ExpertWeights | torch.Tensor,
    l2: ExpertWeights | torch.Tensor,
    *,
    shared: tuple[ExpertWeights | torch.Tensor, ExpertWeights | torch.Tensor] | None = None,
    activation_clamp: float | None = None,
    activation_alpha: float = 1.0,
) -> MoEResult:
    """Reference 2: the BF16 layer with unquantized weights and float activations, no requantization.
    Target: cosine >= 0.97 with FP4 routed weights, >= 0.99 with FP8 weights."""
    return moe_reference(
        x,
        topk_idx,
        topk_weights,
        l1,
        l2,
        shared=shared,
        activation_clamp=activation_clamp,
        activation_alpha=activation_alpha,
        intermediate_quant=None,
    )


# ---------------------------------------------------------------------------------------------------------- metrics
def accuracy_metrics(y: torch.Tensor, y_ref: torch.Tensor) -> dict[str, float | int]:
    """Accuracy of ``y`` against ``y_ref`` (same shape), in FP64 (BENCH_PROTOCOL.md, "Accuracy suite").

    Keys: ``cosine`` (<y,r>/(|y||r|)), ``processed_diff`` (1 - 2<y,r>/(|y|^2+|r|^2)), ``max_abs_err``, ``rel_l2``
    (|y-r|/|r|), ``nonfinite`` (NaN/Inf count in ``y``), ``nonfinite_ref`` (in ``y_ref``). Conventions: two all-zero
    (or empty) tensors are identical: cosine 1.0, processed diff 0.0, errors 0.0; if exactly one is zero, cosine 0.0
    and processed diff 1.0; ``rel_l2`` with a zero reference is 0.0 when ``y`` is zero too, else inf. With NaN/Inf
    present the other metrics are NaN/Inf as FP64 arithmetic gives them; check ``nonfinite`` first.
    """
    if tuple(y.shape) != tuple(y_ref.shape):
        raise ValueError(f"y: shape {tuple(y.shape)} differs from y_ref {tuple(y_ref.shape)}")
    a, b = y.detach().double().flatten(), y_ref.detach().double().flatten().to(y.device)
    nonfinite = int((~torch.isfinite(a)).sum())
    nonfinite_ref = int((~torch.isfinite(b)).sum())
    dot, aa, bb = float((a * b).sum()), float((a * a).sum()), float((b * b).sum())
    err = a - b
    max_abs = float(err.abs().max()) if err.numel() else 0.0
    err_norm = float(err.norm()) if err.numel() else 0.0
    if aa == 0.0 and bb == 0.0:
        cosine, processed = 1.0, 0.0
    elif aa == 0.0 or bb == 0.0:
        cosine, processed = 0.0, 1.0
    else:
        cosine = dot / math.sqrt(aa * bb)
        processed = 1.0 - 2.0 * dot / (aa + bb)
    rel_l2 = (0.0 if aa == 0.0 else math.inf) if bb == 0.0 else err_norm / math.sqrt(bb)
    return {
        "cosine": cosine,
        "processed_diff": processed,
        "max_abs_err": max_abs,
        "rel_l2": rel_l2,
        "nonfinite": nonfinite,
        "nonfinite_ref": nonfinite_ref,
    }
