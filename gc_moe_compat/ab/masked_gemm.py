"""DeepGEMM's SM90 masked-GEMM expert pipeline: W1 -> fused SwiGLU + FP8 requant -> W2, the expert computation of
SGLang's DeepEP low-latency MoE on Hopper (``DeepEPMoE.forward_deepgemm_masked``) and of the benchmarks' composed
baselines (bench/_baseline_sm90.py).

* :func:`masked_gemm_of`: the original ``deep_gemm``'s masked FP8 grouped GEMM under whichever name the build
  exports (DeepGEMM 2.8.2 ``m_grouped_fp8_gemm_nt_masked``; sgl-project/DeepGEMM ``m_grouped_fp8_fp4_gemm_nt_masked``
  / ``fp8_m_grouped_gemm_nt_masked``).
* :func:`swiglu_quant_masked`: ONE Triton kernel between the GEMMs: clamped SwiGLU (``min(gate, c)``,
  ``clamp(up, -c, c)``, ``alpha``), optionally times the row's routing weight, per-token 1x128 FP8 requant with FP32
  scales ``max(amax, 1e-10) / 448`` (correctly rounded division, as :mod:`gc_moe_compat.quant`), reading
  ``masked_m`` on the device and touching only valid rows (an unfused torch chain over the padded buffer costs
  ~400 µs and would flatter the operator). Unweighted it is the arithmetic of SGLang's
  ``silu_and_mul_masked_post_quant_fwd`` (FP32 per-128 scales on Hopper) plus the model's SwiGLU clamp.
* :class:`MaskedExperts`: the three steps on the caller's masked inputs (DeepEP's ``recv_x``), static intermediates;
  :class:`DeepGemmMasked`: the same with its own static inputs (the benchmarks fill them).

Activation scales are MN-major and TMA-aligned (``[e, G, max_m]`` storage, passed transposed), the layout DeepGEMM's
SM90 kernel reads (DeepEP's low-latency dispatch writes its scales so too), so no transpose kernel runs. Triton is
imported only when the kernel is first used.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import torch

from gc_moe_compat.references.reference import ExpertWeights

__all__ = ["ACT_PROGRAMS_PER_SM", "AMAX_FLOOR", "E4M3_MAX", "MASKED_GEMM_NAMES", "DeepGemmMasked", "MaskedExperts",
           "masked_gemm_of", "next_pow2", "swiglu_quant_masked"]

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-10  # gc_moe_compat.quant.AMAX_FLOOR: the FP32 1x128 recipe's scale floor
ACT_PROGRAMS_PER_SM = 4
"""The activation kernel's grid: ``e`` experts x ``ceil(ACT_PROGRAMS_PER_SM * SMs / e)`` row programs."""
MASKED_GEMM_NAMES = ("m_grouped_fp8_gemm_nt_masked", "m_grouped_fp8_fp4_gemm_nt_masked",
                     "fp8_m_grouped_gemm_nt_masked")
"""The masked FP8 grouped GEMM's names in the originals, the first one a build exports is used."""
GEMM_OPTIONS = {"recipe": (1, 128, 128), "disable_ue8m0_cast": True}
"""FP32 1x128 activation scales against FP32 128x128 weight scales (SM90's FP8 recipe)."""


def masked_gemm_of(dg: ModuleType) -> Any:
    """``dg``'s masked FP8 grouped GEMM (:data:`MASKED_GEMM_NAMES`); ``AttributeError`` names the module and the
    spellings looked for when it exports none."""
    for name in MASKED_GEMM_NAMES:
        fn = getattr(dg, name, None)
        if fn is not None:
            return fn
    raise AttributeError(f"deep_gemm at {getattr(dg, '__file__', '?')} exports no masked FP8 grouped GEMM "
                         f"(looked for {', '.join(MASKED_GEMM_NAMES)})")


_KERNEL: Any = None


def next_pow2(n: int) -> int:
    """The least power of two >= ``n`` (1 for n <= 1): Triton block sizes."""
    return 1 << max(0, (n - 1).bit_length())


def _kernel() -> Any:
    """The Triton activation kernel, defined on first use (Triton is imported here, not at module import)."""
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def swiglu_quant(d1, rw, masked_m, a2, a2_sf, max_m, row_programs, clamp, alpha, inter: tl.constexpr,
                     groups: tl.constexpr, groups_p2: tl.constexpr, weighted: tl.constexpr,
                     store_fp32: tl.constexpr):
        # one program per (expert, row program); rows r = p, p + row_programs, ... < masked_m[e]
        e = tl.program_id(0)
        p = tl.program_id(1)
        m = tl.load(masked_m + e)
        grp = tl.arange(0, groups_p2)
        c = tl.arange(0, 128)
        col = grp[:, None] * 128 + c[None, :]
        gmask = grp < groups
        mask = gmask[:, None] & (c[None, :] < 128)
        e64 = e.to(tl.int64)
        for r in range(p, m, row_programs):
            row = e64 * max_m + r
            gate = tl.load(d1 + row * (2 * inter) + col, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(d1 + row * (2 * inter) + inter + col, mask=mask, other=0.0).to(tl.float32)
            gate = tl.minimum(gate, clamp)
            up = tl.minimum(tl.maximum(up, -clamp), clamp)
            act = gate * tl.sigmoid(alpha * gate) * up
            if weighted:
                act = act * tl.load(rw + row)
            amax = tl.max(tl.abs(act), axis=1)
            scale = tl.math.div_rn(tl.maximum(amax, 1e-10), tl.full([groups_p2], 448.0, tl.float32))
            q = tl.math.div_rn(act, tl.broadcast_to(scale[:, None], (groups_p2, 128)))
            q = tl.minimum(tl.maximum(q, -448.0), 448.0)
            if store_fp32:  # the host interpreter test: its fp8 cast mis-rounds where a carry crosses a power of 2
                tl.store(a2 + row * inter + col, q, mask=mask)
            else:
                tl.store(a2 + row * inter + col, q.to(tl.float8e4nv), mask=mask)
            tl.store(a2_sf + e64 * groups * max_m + grp * max_m + r, scale, mask=gmask)

    _KERNEL = swiglu_quant
    return _KERNEL


def swiglu_quant_masked(d1: torch.Tensor, rw: torch.Tensor | None, masked_m: torch.Tensor, a2: torch.Tensor,
                        a2_sf_t: torch.Tensor, clamp: float | None, alpha: float = 1.0,
                        row_programs: int | None = None) -> None:
    """The fused activation: ``d1 [e, max_m, 2I]`` BF16 (gate columns then up) and, unless None, routing weights
    ``rw [e, max_m]`` -> ``a2 [e, max_m, I]`` E4M3 (or FP32: the interpreter test) and MN-major scales
    ``a2_sf_t [e, I/128, max_m]``, for rows ``< masked_m[e]`` only. ``clamp`` None: no SwiGLU limit."""
    e, max_m, two_i = d1.shape
    inter = two_i // 2
    if row_programs is None:
        sms = torch.cuda.get_device_properties(d1.device).multi_processor_count if d1.is_cuda else 8
        row_programs = max(1, min(max_m, -(-ACT_PROGRAMS_PER_SM * sms // e)))
    groups = inter // 128
    limit = math.inf if clamp is None else float(clamp)
    _kernel()[(e, row_programs)](
        d1, d1 if rw is None else rw, masked_m, a2, a2_sf_t, max_m, row_programs, limit, float(alpha), inter=inter,
        groups=groups, groups_p2=next_pow2(groups), weighted=rw is not None, store_fp32=a2.dtype == torch.float32,
        num_warps=8)


class MaskedExperts:
    """One rank's experts through the original DeepGEMM's masked pipeline, on canonical FP8 weights with FP32
    128x128 block scales (L1 gate rows then up rows).

    The inputs are the caller's (``x [e, max_m, H]`` E4M3 with its ``[e, max_m, H/128]`` FP32 scales as an MN-major
    view, ``masked_m [e]`` int32 on the device); the intermediates ``d1 [e, max_m, 2I]`` BF16, ``a2 [e, max_m, I]``
    E4M3 with ``a2_sf_t [e, I/128, max_m]`` and the output ``d2 [e, max_m, H]`` BF16 are static (zero-initialized),
    so a CUDA graph may capture every step. ``expected_m`` (DeepGEMM's heuristic hint) may be set per call site."""

    def __init__(self, dg: ModuleType, l1: ExpertWeights, l2: ExpertWeights, max_m: int, expected_m: int,
                 clamp: float | None, alpha: float = 1.0) -> None:
        self.gemm = masked_gemm_of(dg)
        self.l1, self.l2 = l1, l2
        e, two_i, h = l1.payload.shape
        inter = two_i // 2
        dev = l1.payload.device
        self.num_experts, self.hidden, self.inter = e, h, inter
        self.max_m, self.expected_m, self.clamp, self.alpha = max_m, expected_m, clamp, alpha
        fp8 = torch.float8_e4m3fn
        self.d1 = torch.zeros(e, max_m, two_i, dtype=torch.bfloat16, device=dev)
        self.a2 = torch.zeros(e, max_m, inter, dtype=fp8, device=dev)
        self.a2_sf_t = torch.zeros(e, inter // 128, max_m, dtype=torch.float32, device=dev)
        self.d2 = torch.zeros(e, max_m, h, dtype=torch.bfloat16, device=dev)

    def w1(self, x: torch.Tensor, x_sf: torch.Tensor, masked_m: torch.Tensor) -> None:
        self.gemm((x, x_sf), (self.l1.payload, self.l1.scales), self.d1, masked_m, self.expected_m, **GEMM_OPTIONS)

    def activation(self, masked_m: torch.Tensor, rw: torch.Tensor | None) -> None:
        swiglu_quant_masked(self.d1, rw, masked_m, self.a2, self.a2_sf_t, self.clamp, self.alpha)

    def w2(self, masked_m: torch.Tensor) -> None:
        self.gemm((self.a2, self.a2_sf_t.transpose(1, 2)), (self.l2.payload, self.l2.scales), self.d2, masked_m,
                  self.expected_m, **GEMM_OPTIONS)

    def __call__(self, x: torch.Tensor, x_sf: torch.Tensor, masked_m: torch.Tensor,
                 rw: torch.Tensor | None = None) -> torch.Tensor:
        """W1, the activation (times ``rw`` unless None), W2; returns the static ``d2``."""
        self.w1(x, x_sf, masked_m)
        self.activation(masked_m, rw)
        self.w2(masked_m)
        return self.d2


class DeepGemmMasked(MaskedExperts):
    """:class:`MaskedExperts` with its own static inputs: ``x [e, max_m, H]`` E4M3, MN-major scales
    ``x_sf_t [e, H/128, max_m]``, routing weights ``rw [e, max_m]`` (applied in the activation) and ``masked_m``.
    The caller fills the first ``masked_m[e]`` rows of ``x``, ``x_sf_t``, ``rw`` per expert."""

    def __init__(self, dg: ModuleType, l1: ExpertWeights, l2: ExpertWeights, masked_m: torch.Tensor, max_m: int,
                 expected_m: int, clamp: float | None, alpha: float = 1.0) -> None:
        super().__init__(dg, l1, l2, max_m, expected_m, clamp, alpha)
        e, h, dev = self.num_experts, self.hidden, l1.payload.device
        self.masked_m = masked_m.to(device=dev, dtype=torch.int32).contiguous()
        self.x = torch.zeros(e, max_m, h, dtype=torch.float8_e4m3fn, device=dev)
        self.x_sf_t = torch.zeros(e, h // 128, max_m, dtype=torch.float32, device=dev)
        self.rw = torch.zeros(e, max_m, dtype=torch.float32, device=dev)

    @property
    def x_sf(self) -> torch.Tensor:
        """``[e, max_m, H/128]`` view of the MN-major scales (what DeepGEMM is given)."""
        return self.x_sf_t.transpose(1, 2)

    def gemm1(self) -> None:
        self.w1(self.x, self.x_sf, self.masked_m)

    def act(self) -> None:
        self.activation(self.masked_m, self.rw)

    def gemm2(self) -> None:
        self.w2(self.masked_m)

    def pipeline(self) -> None:
        """W1, fused activation, W2."""
        self(self.x, self.x_sf, self.masked_m, self.rw)

    def gemms(self) -> None:
        """The two masked GEMMs alone (a lower bound of any DeepGEMM pipeline)."""
        self.gemm1()
        self.gemm2()
