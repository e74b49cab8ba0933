"""``transform_weights_for_gc_moe``: quantized expert weights into the form the SM90 operator reads (paper §4.4).

Run once per weight set, outside graph capture; the result is reused across token counts, buffers and graphs. It
never quantizes, it only rearranges (and, for FP4, re-expresses scales exactly as the window repack states):

* ``fp8xfp4`` (routed MXFP4 weights, recipe ``(1, 1, 32)``): L1 rows (payload and per-row UE8M0 K32 scales)
  interleaved gate/up in runs of 8 (:func:`gc_moe_compat.layouts.interleave_gate_up`), then both GEMMs'
  weights window-repacked per expert (:func:`gc_moe_compat.layouts.window_repack_mxfp4`): FP4 codes, relative
  exponents ``d`` in ``[0, 10]`` and the per-expert factor ``2^base``, a few experts at a time (the window is per
  expert; the repack's integer temporaries are ~30 bytes per weight). Packed-int32 UE8M0 scales are unpacked first.
  The register decoder's lane permutation of the tile bytes is a kernel-side concern
  (:func:`gc_moe_compat.operator.sm90.role2_gemm.fp4_units`) and is not applied here.
* ``fp8xfp8`` (FP8 weights with FP32 128x128 block scales, recipe ``(128, 128, 128)``): the L1 payload interleaved
  gate/up by 8; block scales stay ``[e, 2I/128, H/128]`` (gate blocks then up blocks: the kernel maps a W1 tile to
  gate block ``tile`` and up block ``I/128 + tile``); L2 unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gc_moe_compat import config, layouts, quant
from gc_moe_compat.compute_paths import compute_path

__all__ = ["GcMoeWeights", "transform_weights_for_gc_moe"]

_Pair = tuple[torch.Tensor, torch.Tensor]
_REPACK_CHUNK = 8
"""Experts per window-repack call (bounds the temporaries; the result does not depend on it)."""


@dataclass(frozen=True)
class GcMoeWeights:
    """One GEMM's transformed weights.

    ``payload``: packed FP4 ``[e, N, K/2]`` (``fp8xfp4``, window-repacked) or E4M3 ``[e, N, K]``; ``scales``: uint8
    relative exponents ``[e, N, K/32]`` or FP32 block scales ``[e, N/128, K/128]``; ``factor``: FP32 ``[e]``
    (``2^base`` per expert, ``fp8xfp4`` only, else None). ``gemm`` is ``"l1"`` (``N = 2I``, rows interleaved) or
    ``"l2"`` (``N = H``).
    """

    payload: torch.Tensor
    scales: torch.Tensor
    factor: torch.Tensor | None
    mma_type: str
    gemm: str

    def __post_init__(self) -> None:
        """Refuse what the kernels could only compute garbage from, also for weights built by hand (issue 19 item
        13): the kind, the tensor types, and the values of the small tensors (FP32 block scales finite and positive;
        relative exponents in ``[0, WINDOW_STEPS - 1]``, the range the register decoder's E4M3 trick is exact for;
        a finite positive per-expert factor). The payload's codes are checked where weights enter (the transforms),
        not here: that reads every byte. Value checks are skipped on meta tensors and under CUDA graph capture
        (:func:`gc_moe_compat.quant.values_readable`)."""
        if self.mma_type not in config.MMA_TYPES or self.gemm not in ("l1", "l2"):
            raise ValueError(f"GcMoeWeights: mma_type must be one of {config.MMA_TYPES} and gemm 'l1' or 'l2', got "
                             f"{self.mma_type!r} and {self.gemm!r}")
        fp4 = compute_path(self.mma_type).fp4
        forms = ((("payload", self.payload), (torch.uint8, torch.int8) if fp4 else (torch.float8_e4m3fn,)),
                 (("scales", self.scales), (torch.uint8,) if fp4 else (torch.float32,)))
        for (name, t), dtypes in forms:
            if not isinstance(t, torch.Tensor) or t.dtype not in dtypes:
                raise TypeError(f"GcMoeWeights.{name}: must be a tensor of dtype {[str(d) for d in dtypes]} for "
                                f"{self.mma_type}, got {t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
        if not fp4:
            if self.factor is not None:
                raise TypeError(f"GcMoeWeights.factor: must be None for {self.mma_type}, got "
                                f"{type(self.factor).__name__}")
            quant.check_block_scale_values("GcMoeWeights", "scales", self.scales)
            return
        f = self.factor
        if not isinstance(f, torch.Tensor) or f.dtype != torch.float32 or f.dim() != 1:
            raise TypeError(f"GcMoeWeights.factor: must be a float32 [e] tensor (2^base per expert) for "
                            f"{self.mma_type}, got {f!r:.80}")
        if quant.values_readable(f) and not bool((torch.isfinite(f) & (f > 0)).all()):
            raise ValueError(f"GcMoeWeights.factor: must be finite and positive (2^base per expert), got "
                             f"{f[~(torch.isfinite(f) & (f > 0))].flatten()[0].item()}")
        if quant.values_readable(self.scales):
            top = int(self.scales.amax())
            if top >= layouts.WINDOW_STEPS:
                raise ValueError(f"GcMoeWeights.scales: relative exponents must lie in [0, {layouts.WINDOW_STEPS - 1}]"
                                 f" (the window repack's {layouts.WINDOW_STEPS} steps, exact in the E4M3 decoder), "
                                 f"got {top}")

    @property
    def pair(self) -> _Pair:
        """``(payload, scales)``: the form :func:`gc_moe_compat.config.validate` checks."""
        return self.payload, self.scales


def _pair(arg: str, value: object) -> _Pair:
    if not (isinstance(value, tuple | list) and len(value) == 2 and all(isinstance(t, torch.Tensor) for t in value)):
        raise TypeError(f"{arg}: must be a (weights, scales) pair of tensors, got {type(value).__name__}")
    return value[0], value[1]


def weights_shape(l1: _Pair, mma_type: str) -> config.MoEShape:
    """The per-rank shape the L1 pair describes (``e`` experts, ``H``, ``I``), validated by ``config``'s rules;
    an error names ``l1_weights[0]``, its shape and the ``[e, 2I, K']`` it is read as (a caller passes 2I rows, not
    the ``intermediate`` the rule is about). The transforms' one reading of a weight set's shape."""
    payload = l1[0]
    if payload.dim() != 3:
        raise ValueError(f"l1_weights[0]: must be [e, 2I, K'] (3 dims), got shape {tuple(payload.shape)}")
    e, two_i, k_cols = payload.shape
    hidden = k_cols * 2 if compute_path(mma_type).fp4 else k_cols
    try:
        return config.MoEShape(num_experts=e, num_ranks=1, hidden=hidden, intermediate=two_i // 2, topk=1,
                               mma_type=mma_type)
    except ValueError as exc:
        layout = "[e, 2I, H/2]" if mma_type == "fp8xfp4" else "[e, 2I, H]"
        raise ValueError(f"l1_weights[0]: shape {tuple(payload.shape)} (read as {layout}: e={e}, 2I={two_i}, "
                         f"H={hidden}) gives an unsupported operator shape: {exc}") from exc


def _ue8m0_codes(sf: torch.Tensor) -> torch.Tensor:
    """UE8M0 K32 codes uint8 ``[e, N, K/32]`` from either accepted form (packed int32 is unpacked)."""
    return quant.unpack_ue8m0_k32(sf) if sf.dtype == torch.int32 else sf


def transform_weights_for_gc_moe(l1_weights: _Pair, l2_weights: _Pair,
                                 mma_type: str = "fp8xfp4") -> tuple[GcMoeWeights, GcMoeWeights]:
    """Transform one rank's routed weights ``(l1, l2)`` for the operator; see the module docstring.

    ``l1_weights`` / ``l2_weights``: ``(payload, scales)`` in a form :func:`gc_moe_compat.config.validate` accepts
    for ``mma_type`` (``[e, 2I, H]`` and ``[e, H, I]`` GEMMs, gate rows then up rows in L1), with valid values
    (:func:`gc_moe_compat.quant.check_weight_values`: no E4M3 NaN codes, finite positive FP32 block scales, no UE8M0
    code 255; skipped on meta tensors). Raises ``TypeError`` / ``ValueError`` naming the argument on any violation,
    before transforming anything; ``fp8xfp4`` weights must hold values (not meta tensors: the repack reads them).
    """
    path = compute_path(mma_type)
    l1, l2 = _pair("l1_weights", l1_weights), _pair("l2_weights", l2_weights)
    shape = weights_shape(l1, mma_type)
    config.validate(shape, l1_weights=l1, l2_weights=l2)
    for arg, pair in (("l1_weights", l1), ("l2_weights", l2)):
        quant.check_weight_values("transform_weights_for_gc_moe", arg, pair)
    if not path.fp4:
        return (GcMoeWeights(layouts.interleave_gate_up(l1[0]), l1[1].contiguous(), None, mma_type, "l1"),
                GcMoeWeights(l2[0].contiguous(), l2[1].contiguous(), None, mma_type, "l2"))
    if not quant.values_readable(l1[1]):  # validate put all four tensors on one device
        raise ValueError(f"transform_weights_for_gc_moe: l1_weights and l2_weights must hold readable values for "
                         f"mma_type='fp8xfp4' (the window repack derives each expert's exponents from the scale "
                         f"codes: not meta tensors, not inside a CUDA-graph capture), got tensors on {l1[1].device}")
    out = []
    for gemm, (payload, sf) in (("l1", l1), ("l2", l2)):
        codes = _ue8m0_codes(sf)
        if gemm == "l1":
            payload, codes = layouts.interleave_gate_up(payload), layouts.interleave_gate_up(codes)
        reps = [layouts.window_repack_mxfp4(payload[i:i + _REPACK_CHUNK], codes[i:i + _REPACK_CHUNK])
                for i in range(0, payload.shape[0], _REPACK_CHUNK)]
        out.append(GcMoeWeights(*(torch.cat([getattr(r, f) for r in reps]) for f in ("packed", "rel_exp", "factor")),
                                mma_type, gemm))
    return out[0], out[1]
