"""The operator's compute paths: one record per path (what ``mma_type`` names), read by every layer.

A compute path is a weight format with its GEMM kernel: the numerics check its tensors' forms, the operator picks its
role2 kernel and weight transform, the native API and the ``deep_gemm`` facade name their call after it, and the
tools quantize their experts to its format. Every one of those reads the fields below, so a third path is a new
:class:`ComputePath` here plus its kernel (and the branches on :attr:`ComputePath.fp4` where its format differs).

* ``fp8xfp4``: FP8 E4M3 activations x MXFP4 routed weights (packed E2M1 codes, UE8M0 K32 scales, window-repacked
  with a per-expert ``2^base`` factor), decoded to E4M3 in registers; UE8M0 1x128 intermediate requant.
* ``fp8xfp8``: FP8 x FP8 with FP32 128x128 block-scaled weights (SGLang's Hopper recipe); FP32 1x128 intermediate
  requant.

Pure data: this module imports nothing of the package, so every layer (numerics upwards) may read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["FP8XFP4", "FP8XFP8", "MMA_TYPES", "PATHS", "ComputePath", "compute_path"]


@dataclass(frozen=True)
class ComputePath:
    """One compute path.

    ``name``: the ``mma_type`` spelling (DeepGEMM's). ``recipe``: the scale-granularity triple the layer calls take
    (``(1, 1, 32)`` K32 groups, ``(128, 128, 128)`` blocks). ``weight_format``: the routed weights' quantization
    in the references' vocabulary (``ExpertWeights.fmt``). ``intermediate_quant``: the W1 epilogue's requant of the
    intermediate, in the same vocabulary (``reference.quantize_activations`` modes). ``kernel``: the role2 grouped
    GEMM source under ``kernels/``; ``operator_entry`` / ``standalone_entry``: its entry points compiled with
    ``GC_OPERATOR=1`` (role2 over the token ring) and without (the standalone grouped GEMM). ``native_fn`` /
    ``facade_fn``: the layer call of the native API and of the ``deep_gemm`` facade that run this path.
    ``max_block_m``: the widest token block its role2 kernel compiles (WGMMA N): 96 for FP8xFP8 (its K loop's wide
    step); 64 for FP8xFP4, whose register-A decode runs at its register limit there.
    """

    name: str
    recipe: tuple[int, int, int]
    weight_format: str
    intermediate_quant: str
    kernel: str
    operator_entry: str
    standalone_entry: str
    native_fn: str
    facade_fn: str
    max_block_m: int

    @property
    def fp4(self) -> bool:
        """Whether the routed weights are MXFP4: two E2M1 codes per byte (``K/2`` payload columns), UE8M0 K32
        scales, window-repacked with a per-expert factor (a transform that always copies)."""
        return self.weight_format == "mxfp4"


FP8XFP4 = ComputePath(
    name="fp8xfp4", recipe=(1, 1, 32), weight_format="mxfp4", intermediate_quant="ue8m0_128",
    kernel="sm90/role2_gemm_fp8xfp4.cu", operator_entry="gc_sm90_fp8_fp4_role2",
    standalone_entry="gc_sm90_fp8_fp4_grouped_gemm", native_fn="fp8_fp4_gc_moe", facade_fn="fp8_fp4_mega_moe",
    max_block_m=64)
FP8XFP8 = ComputePath(
    name="fp8xfp8", recipe=(128, 128, 128), weight_format="fp8_block128", intermediate_quant="fp32_128",
    kernel="sm90/role2_gemm_fp8xfp8.cu", operator_entry="gc_sm90_fp8_role2",
    standalone_entry="gc_sm90_fp8_grouped_gemm", native_fn="fp8_fp8_gc_moe", facade_fn="fp8_mega_moe",
    max_block_m=96)

PATHS: Mapping[str, ComputePath] = MappingProxyType({p.name: p for p in (FP8XFP4, FP8XFP8)})
"""Every compute path by ``mma_type``."""
MMA_TYPES: tuple[str, ...] = tuple(PATHS)
"""The ``mma_type`` names, in :data:`PATHS` order."""


def compute_path(mma_type: object) -> ComputePath:
    """The record of ``mma_type``: ``TypeError`` for a non-str, ``ValueError`` for a string naming no path. The one
    ``mma_type`` check of the shape rules, the weight transform and the kernels' variants."""
    why = f"one of {MMA_TYPES} (supported compute paths), got {mma_type!r}"
    if not isinstance(mma_type, str):
        raise TypeError(f"mma_type: must be {why}")
    if mma_type not in PATHS:
        raise ValueError(f"mma_type: must be {why}")
    return PATHS[mma_type]

