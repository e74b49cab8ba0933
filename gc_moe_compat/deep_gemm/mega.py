"""``deep_gemm.mega`` facade: the submodule both DeepGEMM builds define the Mega MoE API in."""

from gc_moe_compat.deep_gemm._buffer import SymmBuffer, get_symm_buffer_for_mega_moe
from gc_moe_compat.deep_gemm._mega import bf16_mega_moe, fp8_fp4_mega_moe, nvfp4_mega_moe
from gc_moe_compat.deep_gemm._predispatch import mega_moe_pre_dispatch, mega_moe_pre_dispatch_sm90
from gc_moe_compat.deep_gemm._runtime import get_block_m_for_mega_moe
from gc_moe_compat.deep_gemm._weights import transform_scales_for_mega_moe, transform_weights_for_mega_moe

__all__ = [
    "SymmBuffer",
    "bf16_mega_moe",
    "fp8_fp4_mega_moe",
    "get_block_m_for_mega_moe",
    "get_symm_buffer_for_mega_moe",
    "mega_moe_pre_dispatch",
    "mega_moe_pre_dispatch_sm90",
    "nvfp4_mega_moe",
    "transform_scales_for_mega_moe",
    "transform_weights_for_mega_moe",
]
