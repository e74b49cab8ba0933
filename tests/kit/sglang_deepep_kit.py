"""SGLang 0.5.23's own DeepEP token dispatcher (``sglang/srt/layers/moe/token_dispatcher/deepep.py`` and its
``base.py``), loaded from the source files with only unrelated imports stubbed, so that ``from deep_ep import Buffer,
Config`` inside it is whatever the process's ``GC_MOE_SWAP`` makes it.

The files come from the registry wheel (on the device from the carried ``.carry/sglang-0.5.23``, see
``scripts/fetch_device_deps.sh --sglang``). :func:`stubs` lists every stand-in with the reason it does not change the
low-latency decode path (``DeepEPDispatcher`` -> ``_DeepEPDispatcherImplLowLatency`` -> ``DeepEPBuffer``).
"""

from __future__ import annotations

import enum
import types
from typing import NamedTuple

import sglang_kit
import torch
import torch.distributed as dist

REAL_MODULES = ("sglang.srt.layers.moe.token_dispatcher.base", "sglang.srt.layers.moe.token_dispatcher.deepep")
"""Executed from the SGLang sources, in this order (``deepep`` imports ``base``)."""


class DeepEPMode(enum.Enum):
    """SGLang's ``--deepep-mode`` (``sglang.srt.layers.moe.utils.DeepEPMode``): the methods deepep.py calls."""

    NORMAL = "normal"
    LOW_LATENCY = "low_latency"
    AUTO = "auto"

    def enable_normal(self) -> bool:
        return self in (DeepEPMode.NORMAL, DeepEPMode.AUTO)

    def enable_low_latency(self) -> bool:
        return self in (DeepEPMode.LOW_LATENCY, DeepEPMode.AUTO)

    def resolve(self, is_extend_in_batch: bool) -> DeepEPMode:
        if self != DeepEPMode.AUTO:
            return self
        return DeepEPMode.NORMAL if is_extend_in_batch else DeepEPMode.LOW_LATENCY

    def is_normal(self) -> bool:
        return self == DeepEPMode.NORMAL

    def is_low_latency(self) -> bool:
        return self == DeepEPMode.LOW_LATENCY


class DispatcherOutputDtype(enum.Enum):
    """SGLang's dispatcher output dtypes (the keys deepep.py's config map uses)."""

    BF16 = "bf16"
    FP8 = "fp8"
    INT8 = "int8"
    NVFP4 = "nvfp4"
    MXFP4 = "mxfp4"
    MXFP8 = "mxfp8"


class TopKOutput(NamedTuple):
    """SGLang's standard top-k output: the two fields the dispatcher reads, and the router logits."""

    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    router_logits: torch.Tensor | None


DEPLOYMENT = types.SimpleNamespace(output_dtype=DispatcherOutputDtype.FP8)
"""The deployment's dispatcher output dtype (SGLang derives it from the model's quantization); a test sets it before
building a dispatcher."""


def stubs(group: dist.ProcessGroup, num_max_dispatch_tokens_per_rank: int) -> dict[str, dict[str, object]]:
    """The stand-ins, by module: ``{module: {attribute: value}}``; every one is listed with its reason."""
    envs = types.SimpleNamespace(
        SGLANG_ZBAL_LOCAL_MEM_SIZE=sglang_kit.Env(0),  # Ascend only
        SGLANG_IN_DEEPGEMM_PRECOMPILE_STAGE=sglang_kit.Env(False),  # serving, not DeepGEMM precompilation
        SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK=sglang_kit.Env(num_max_dispatch_tokens_per_rank))
    recorder = types.SimpleNamespace(on_deepep_dispatch_low_latency=lambda masked_m: None)  # EPLB statistics off
    parallel = types.SimpleNamespace(tp_group=group)
    resources = types.SimpleNamespace(buffers={})  # the process-wide resource registry DeepEPBuffer keeps state in
    return {
        "sglang.srt.environ": {"envs": envs},
        "sglang.srt.eplb.expert_distribution": {"get_global_expert_distribution_recorder": lambda: recorder},
        # A Hopper deployment with DeepGEMM's JIT (FP8 activations, FP32 scales, not UE8M0).
        "sglang.srt.layers.deep_gemm_wrapper": {"ENABLE_JIT_DEEPGEMM": True, "DEEPGEMM_BLACKWELL": False,
                                                "DEEPGEMM_SCALE_UE8M0": False},
        # Decode batches: no extend (prefill) tokens in the batch.
        "sglang.srt.layers.dp_attention": {"get_is_extend_in_batch": lambda: False},
        "sglang.srt.layers.moe.topk": {"TopKOutput": TopKOutput},
        # --deepep-mode, the dispatcher output dtype (--deepep-config unset), no two-batch overlap.
        "sglang.srt.layers.moe.utils": {"DeepEPMode": DeepEPMode, "DispatcherOutputDtype": DispatcherOutputDtype,
                                        "get_deepep_config": lambda: "", "is_tbo_enabled": lambda: False,
                                        "get_deepep_output_dtype": lambda dispatcher: DEPLOYMENT.output_dtype},
        "sglang.srt.runtime_context": {"get_parallel": lambda: parallel, "get_resources": lambda: resources},
        # Platform probes: CUDA 13 on Hopper, no FlashInfer MNNVL fabric, not ROCm / Ascend.
        "sglang.srt.utils": {"get_bool_env_var": lambda name, default="false": False,
                             "get_cuda_version": lambda: (13, 0), "is_blackwell": lambda: False,
                             "is_flashinfer_available": lambda: False, "is_hip": lambda: False,
                             "is_npu": lambda: False, "load_json_config": sglang_kit.never("load_json_config")},
        # The normal mode's FP8 quantizer (the low-latency path quantizes inside DeepEP).
        "sglang.kernels.ops.quantization.fp8_kernel": {
            "sglang_per_token_group_quant_fp8": sglang_kit.never("sglang_per_token_group_quant_fp8")},
    }


def load(root: object, group: dist.ProcessGroup, num_max_dispatch_tokens_per_rank: int) -> types.ModuleType:
    """Installs :func:`stubs`, executes ``base.py`` and ``deepep.py`` under ``root``; returns the deepep module."""
    _, deepep = sglang_kit.exec_real(root, stubs(group, num_max_dispatch_tokens_per_rank),
                                     REAL_MODULES)
    return deepep
