"""SGLang 0.5.23's own Mega MoE code, loaded from its source files with only unrelated imports stubbed.

The real files are ``sglang/srt/layers/moe/mega_moe_sm90.py`` (``build_sm90_mega_moe_experts_weights``,
``run_sm90_mega_routed``, ``is_sm90_fp8_mega_moe_available``) and ``sglang/srt/layers/moe/mega_moe.py``
(``run_mega_routed_experts``, ``_get_mega_moe_symm_buffer`` and its cache, ``is_mega_moe_experts_ready``), taken from
the registry wheel (``tests/kit/sglang_wheel.py``; on the device from the carried ``.carry/sglang-0.5.23``, see
``scripts/fetch_device_deps.sh --sglang``). They run unchanged; ``import deep_gemm`` inside them is whatever the
process's ``GC_MOE_SWAP`` makes it. Everything else SGLang would import is replaced by :data:`STUBS`: each entry
names the module, what the two files take from it, and why the stand-in does not change the Hopper routed path.
Parent packages (``sglang``, ``sglang.srt``, ...) are empty module objects, so no other SGLang file is executed.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from gc_moe_compat.references.reference import ExpertWeights

VERSION = "0.5.23"
SOURCE_ENV = "GC_MOE_SGLANG_SRC"
DEFAULT_SOURCE = Path(__file__).resolve().parents[2] / ".carry" / f"sglang-{VERSION}"
REAL_MODULES = ("sglang.srt.layers.moe.mega_moe_sm90", "sglang.srt.layers.moe.mega_moe")
"""Loaded from the SGLang sources, in this order (``mega_moe`` imports ``mega_moe_sm90``)."""

DEFAULT_ENVS = {
    "SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK": 8192,
    "SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS": 2,
    "SGLANG_OPT_DEEPGEMM_MEGA_MOE_FUSE_SHARED_EXPERTS": True,
    "SGLANG_AMD_USE_FLYDSL_MEGA_MOE": False,
}
"""The ``sglang.srt.environ.envs`` fields the two files read, with SGLang 0.5.23's defaults (``environ.py``)."""


def source_dir() -> Path:
    """Where the SGLang files are looked for: ``$GC_MOE_SGLANG_SRC``, else ``<repo>/.carry/sglang-0.5.23``."""
    return Path(os.environ.get(SOURCE_ENV) or DEFAULT_SOURCE)


def missing_sources(root: Path, modules: tuple[str, ...] = REAL_MODULES) -> list[str]:
    """The files of ``modules`` (default :data:`REAL_MODULES`) absent under ``root``."""
    return [str(root / (m.replace(".", "/") + ".py")) for m in modules
            if not (root / (m.replace(".", "/") + ".py")).is_file()]


class Env:
    """One ``envs.NAME`` of SGLang: ``.get()`` returns its value."""

    def __init__(self, value: object) -> None:
        self.value = value

    def get(self) -> object:
        return self.value


def never(what: str) -> Callable[..., object]:
    def call(*args: object, **kwargs: object) -> object:
        raise AssertionError(f"stub {what} was called: it is not on SGLang's SM90 routed Mega MoE path")
    return call


def stubs(group: dist.ProcessGroup, num_max_tokens_per_rank: int, device_sm: int) -> dict[str, dict[str, object]]:
    """The stand-ins, by module: ``{module: {attribute: value}}``; every one is listed with its reason."""
    envs = types.SimpleNamespace(**{name: Env(v) for name, v in DEFAULT_ENVS.items()})
    envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK = Env(num_max_tokens_per_rank)
    megamoe_backend = types.SimpleNamespace(is_megamoe=lambda: True)  # the deployment's --moe-a2a-backend megamoe
    parallel = types.SimpleNamespace(moe_ep_group=types.SimpleNamespace(device_group=group))
    return {
        # _device_sm: SGLang computes major*10+minor of the current GPU; the Hopper branch needs 90.
        "sglang.srt.models.deepseek_common.utils": {"_device_sm": device_sm},
        # The SM100 JIT pre-dispatch kernel; the SM90 branch calls deep_gemm.mega_moe_pre_dispatch_sm90 instead.
        "sglang.kernels.ops.moe.dsv4": {"mega_moe_pre_dispatch": never("sglang.kernels.ops.moe.dsv4 pre-dispatch")},
        # Environment knobs: SGLang's defaults, the per-rank capacity as the test deploys it.
        "sglang.srt.environ": {"envs": envs},
        # Context-parallel prefill and DP-attention token counts: only should_use_mega_moe reads them (not called).
        "sglang.srt.layers.attention.dsa.utils": {"is_dsa_enable_prefill_cp": lambda: False},
        "sglang.srt.layers.dp_attention": {"get_dp_global_num_tokens": lambda: None},
        # The fused gate (top-k inside the Mega MoE buffer) is an SM100 fp8xfp4 feature; the test routes itself.
        "sglang.srt.layers.moe.mega_gate": {"run_mega_gate": never("run_mega_gate"),
                                            "should_use_mega_gate": lambda *args, **kwargs: False},
        # --moe-a2a-backend megamoe.
        "sglang.srt.layers.moe.utils": {"get_moe_a2a_backend": lambda: megamoe_backend},
        # CUDA graph capture mode flag: only should_use_mega_moe / forward_mega_moe read it (not called).
        "sglang.srt.model_executor.runner": {"get_is_capture_mode": lambda: False},
        # Vision-token routing of DeepSeek V4.1 VL: part of the gate, not of the routed experts.
        "sglang.srt.multimodal.dsv41.vl_routing": {"vision_topk": never("vision_topk")},
        # Platform probes: CUDA, Hopper.
        "sglang.srt.utils": {"is_hip": lambda: False, "is_sm100_supported": lambda: False},
        # The process groups: the expert-parallel group is the test's group.
        "sglang.srt.runtime_context": {"get_parallel": lambda: parallel},
    }


def _package(name: str) -> types.ModuleType:
    module = sys.modules.get(name)
    if module is None:
        module = types.ModuleType(name)
        module.__path__ = []  # a package that contains nothing but what is registered below it
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(_package(parent), child, module)
    return module


def _register(name: str, module: types.ModuleType) -> None:
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    setattr(_package(parent), child, module)


def exec_real(root: Path, stub_map: dict[str, dict[str, object]], real_modules: tuple[str, ...]
              ) -> list[types.ModuleType]:
    """Registers ``stub_map`` (``{module: {attribute: value}}``) as modules, then executes the real files of
    ``real_modules`` under ``root`` in order; returns the executed modules."""
    missing = missing_sources(root, real_modules)
    if missing:
        raise FileNotFoundError(f"SGLang {VERSION} sources missing: {missing}")
    for name, attrs in stub_map.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        _register(name, module)
    loaded = []
    for name in real_modules:
        spec = importlib.util.spec_from_file_location(name, root / (name.replace(".", "/") + ".py"))
        module = importlib.util.module_from_spec(spec)
        _register(name, module)
        spec.loader.exec_module(module)
        loaded.append(module)
    return loaded


def load(root: Path, group: dist.ProcessGroup, num_max_tokens_per_rank: int,
         device_sm: int) -> types.SimpleNamespace:
    """Installs :func:`stubs` and executes the real files under ``root``; returns ``(sm90=..., mega_moe=...)``."""
    sm90, mega_moe = exec_real(root, stubs(group, num_max_tokens_per_rank, device_sm), REAL_MODULES)
    return types.SimpleNamespace(sm90=sm90, mega_moe=mega_moe)


def device_sm() -> int:
    """``major*10+minor`` of the current GPU (SGLang's ``_device_sm``); 90 on a host without one (dry run)."""
    if not torch.cuda.is_available():
        return 90
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def experts(l1: ExpertWeights, l2: ExpertWeights, num_experts: int) -> types.SimpleNamespace:
    """The attributes of SGLang's FusedMoE layer that the two files read, as block-FP8 loading leaves them: canonical
    ``w13_weight`` (gate rows then up rows) with FP32 128x128 ``w13_weight_scale_inv``, ``w2_weight`` and its scales
    (parameters sharing the reference's tensors), the global expert count, and the Mega MoE flags before building."""
    def param(t: torch.Tensor) -> torch.nn.Parameter:
        return torch.nn.Parameter(t, requires_grad=False)

    return types.SimpleNamespace(
        w13_weight=param(l1.payload), w13_weight_scale_inv=param(l1.scales),
        w2_weight=param(l2.payload), w2_weight_scale_inv=param(l2.scales),
        num_experts=num_experts, _mega_moe_weights_built=False, _mega_moe_nvfp4=False, _mega_moe_w4a4=False)
