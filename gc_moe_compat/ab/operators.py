"""The operators ``gc-moe-ab`` compares, one adapter each, driven through the public API a user calls.

Every adapter is an :class:`OperatorSpec`: a name, a label saying what it really is and what its timed CUDA graph
holds, the weight format it computes with, a :meth:`~OperatorSpec.probe` that says why it cannot run here (and what
would install it) or None, and a ``build`` that sets it up for one run. A built :class:`Runner` stages one point's
tokens outside the graph (:meth:`Runner.stage`) and runs the layer (:meth:`Runner.run`, graph-capturable, returns
``y [T, H]`` BF16).

* ``facade`` - ``gc_moe_compat.deep_gemm`` (what ``GC_MOE_SWAP=deep_gemm`` makes ``import deep_gemm``) called as
  SGLang 0.5.23's Hopper Mega MoE path calls it: ``get_symm_buffer_for_mega_moe(..., mma_type='fp8xfp4')`` once,
  ``transform_weights_for_mega_moe_sm90`` once, then per step ``mega_moe_pre_dispatch_sm90`` + ``fp8_mega_moe``,
  under the default ``GC_MOE_PARTITION=auto`` (the partition per call: ``meta.partition`` records the buffer's
  ``sequential_max_tokens``, the most tokens a call may have to run with the partition off).
* ``facade_partition_off`` - the same sequence on a buffer created under ``GC_MOE_PARTITION=off``: the same kernels
  in sequence on the whole device (the partition ablation; role2 follows role1 through a programmatic edge, so it
  may start beside role1 where the rank has the GPU alone).
* ``facade_partition_on`` and ``facade_dispatch_sms_<N>`` (``--partition-sweep``) - the same sequence under
  ``GC_MOE_PARTITION=on`` (partitioned at every T) and under ``GC_MOE_DISPATCH_SMS=N``.
* ``native_fp8xfp4`` - the native API's FP8xFP4 path (``fp8_fp4_gc_moe``) on the same BF16 experts quantized to
  MXFP4, the tokens staged by the caller (the pre-dispatch's bytes, not timed).
* ``original_deep_gemm`` - the installed original ``deep_gemm``'s ``fp8_mega_moe`` (SGLang's ``sgl-deep-gemm``,
  or a build of sgl-project/DeepGEMM's SM90 Mega MoE: ``scripts/build_sgl_deep_gemm.sh``), loaded beside the facade
  by :mod:`gc_moe_compat.originals`; its own pre-dispatch where it has one.
* ``composed_deepep_deepgemm`` - SGLang's ``--moe-a2a-backend deepep`` low-latency path
  (``DeepEPMoE.forward_deepgemm_masked``): DeepEP ``low_latency_dispatch`` (BF16 in, FP8 1x128 out; the original
  ``deep_ep`` where it imports and its low-latency mode starts in a bounded probe child
  (:mod:`gc_moe_compat.ab.deep_ep_probe`), else this library's ``gc_moe_compat.deep_ep`` facade: the runner's
  ``partition()`` says which and why) -> the original DeepGEMM's masked FP8 grouped GEMM W1 -> SwiGLU + FP8
  per-token-group(128) requant (:func:`gc_moe_compat.ab.masked_gemm.swiglu_quant_masked`, our Triton kernel of the
  arithmetic of SGLang's ``silu_and_mul_masked_post_quant_fwd``, with the model's SwiGLU clamp; SGLang itself is not
  imported) -> masked W2 -> ``low_latency_combine`` (routing weights applied there, as DeepEP does). FP8
  128x128-block experts.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Protocol

import torch
import torch.distributed as dist

from gc_moe_compat import config, quant
from gc_moe_compat.ab.inputs import LayerWeights, Tokens
from gc_moe_compat.ab.masked_gemm import masked_gemm_of
from gc_moe_compat.ab.model_config import Workload
from gc_moe_compat.ab.protocol import portable_path
from gc_moe_compat.compute_paths import PATHS, compute_path

__all__ = ["DISPATCH_SWEEP", "REFERENCE_OP", "ComposedDeepEpDeepGemm", "Context", "MegaMoeSequence",
           "NativeFp8Fp4", "OperatorSpec", "Runner", "composed_expected_m", "default_ops", "operator_specs", "select"]

DISPATCH_SWEEP = (4, 8, 16, 24)
"""The dispatch SM requests of ``--partition-sweep``."""
REFERENCE_OP = "facade"
"""The operator every speedup divides by (docs/bench_protocol.md: speedup = baseline / ours)."""
SGLANG_BUFFER_MMA_TYPE = "fp8xfp4"
"""The ``mma_type`` SGLang 0.5.23 creates its Hopper Mega MoE buffer with (and then calls ``fp8_mega_moe``)."""
DEEPGEMM_INSTALL = ("build sgl-project/DeepGEMM's SM90 Mega MoE with scripts/build_sgl_deep_gemm.sh SRC DEST and put "
                    "DEST on PYTHONPATH (SGLang's prebuilt sgl-deep-gemm wheels need torch 2.14)")
COMPOSED_ACTIVATION = ("gc_moe_compat.ab.masked_gemm.swiglu_quant_masked: our fused Triton SwiGLU (model clamp) + "
                       "FP8 1x128 requant, the arithmetic of SGLang's silu_and_mul_masked_post_quant_fwd (SGLang is "
                       "not imported)")


@dataclass(frozen=True)
class Context:
    """What one rank's adapters are built from."""

    group: dist.ProcessGroup
    workload: Workload
    world_size: int
    rank: int
    weights: LayerWeights
    device: torch.device

    def shape(self, mma_type: str) -> config.MoEShape:
        return self.workload.shape(self.world_size, mma_type)


class Runner(Protocol):
    """One operator set up for a run."""

    def stage(self, tokens: Tokens) -> None:
        """Copy one point's tokens into the runner's static inputs (outside the timed graph)."""

    def run(self) -> torch.Tensor:
        """The layer on the staged tokens: ``y [T, H]`` BF16 (graph-capturable after one eager run)."""

    def partition(self) -> dict[str, object]:
        """The partition this runner's buffer runs on (``describe()`` of the green partition or the mode)."""

    def check(self, what: str) -> None:
        """Raise the device-side error the timed replays left (GC-MoE's status records), if any."""

    def close(self) -> None:
        """Release the buffers."""


@dataclass(frozen=True)
class OperatorSpec:
    """One compared operator: what it is, whether it can run here, how to build it."""

    name: str
    label: str
    weight_format: str
    build: Callable[[Context], Runner]
    probe_fn: Callable[[], str | None]
    source_fn: Callable[[], str | None] = lambda: None
    """Which build of an original it runs (result files record it: two builds of one original share a label)."""

    @property
    def mma_type(self) -> str:
        """The compute path whose routed weight format this operator computes with."""
        return next(p.name for p in PATHS.values() if p.weight_format == self.weight_format)

    def probe(self) -> str | None:
        """None where this operator can run in this process; else every reason why not and what would make it
        run (the device's and the software's, so that a CPU machine's ``--check`` lists both)."""
        reasons = []
        if not torch.cuda.is_available():
            reasons.append("needs a CUDA GPU (none visible)")
        elif torch.cuda.get_device_capability() != (9, 0):
            major, minor = torch.cuda.get_device_capability()
            reasons.append(f"needs an SM90 (Hopper) GPU, this is sm_{major}{minor}")
        software = self.probe_fn()
        if software:
            reasons.append(software)
        return "; ".join(reasons) or None


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` set for the block (the facade reads its partition settings at buffer
    creation, as a deployment's environment would set them)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _accepted(fn: Callable[..., object], kwargs: dict[str, object]) -> dict[str, object]:
    """The keywords of ``kwargs`` that ``fn``'s signature takes (builds of the originals differ in their options)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


class _StaticTokens:
    """The static input tensors a captured graph reads: one point's BF16 rows and routing, plus the output."""

    def __init__(self, tokens: Tokens, hidden: int, device: torch.device) -> None:
        self.count = tokens.count
        self.x = tokens.x.to(device).clone()
        self.topk_idx = tokens.topk_idx.to(device).clone()
        self.topk_weights = tokens.topk_weights.to(device).clone()
        self.y = torch.zeros(max(self.count, 1), hidden, dtype=torch.bfloat16, device=device)


class MegaMoeSequence:
    """SGLang's Hopper Mega MoE sequence on a ``deep_gemm`` module (the facade or an original build).

    Created once per run (buffer + weight transform, as SGLang does at load time); per step: the pre-dispatch
    (``mega_moe_pre_dispatch_sm90`` where the module has it, else the byte-identical torch staging before the
    graph) and the Mega MoE call: ``fp8_mega_moe`` on FP8 128x128-block experts (``mma_type='fp8xfp8'``, what SGLang
    calls on Hopper) or ``fp8_fp4_mega_moe`` on MXFP4 experts (``'fp8xfp4'``, transformed by
    ``transform_weights_for_mega_moe``). ``buffer_mma_type`` / ``num_shared_experts`` are the buffer's (SGLang's:
    ``'fp8xfp4'``, 0)."""

    def __init__(self, dg: ModuleType, ctx: Context, env: dict[str, str] | None = None, *,
                 mma_type: str = "fp8xfp8", buffer_mma_type: str = SGLANG_BUFFER_MMA_TYPE,
                 num_shared_experts: int = 0) -> None:
        self.dg, self.ctx = dg, ctx
        w = ctx.workload
        shape = ctx.shape(mma_type)
        buffer_kwargs = _accepted(dg.get_symm_buffer_for_mega_moe,
                                  {"num_shared_experts": num_shared_experts, "mma_type": buffer_mma_type})
        with _environment(env or {}):
            self.buf = dg.get_symm_buffer_for_mega_moe(ctx.group, shape.num_experts, w.capacity, w.topk, w.hidden,
                                                       w.intermediate, **buffer_kwargs)
        options = {"activation": "swiglu", "activation_clamp": w.activation_clamp, "fast_math": True}
        if not compute_path(mma_type).fp4:
            l1, l2 = ctx.weights["fp8_block128"]
            self.l1, self.l2 = dg.transform_weights_for_mega_moe_sm90((l1.payload, l1.scales),
                                                                      (l2.payload, l2.scales))
            self.call = dg.fp8_mega_moe
            options["recipe"] = (128, 128, 128)
        else:  # DeepGEMM's form: UE8M0 K32 scales packed four per int32 (transform_sf_into_required_layout's)
            l1, l2 = ctx.weights["mxfp4"]
            self.l1, self.l2 = dg.transform_weights_for_mega_moe(
                (l1.payload, quant.pack_ue8m0_k32(l1.scales)), (l2.payload, quant.pack_ue8m0_k32(l2.scales)),
                mma_type="fp8xfp4")
            self.call = dg.fp8_fp4_mega_moe
            options["recipe"] = (1, 1, 32)
        self.pre_dispatch = getattr(dg, "mega_moe_pre_dispatch_sm90", None)
        self.moe_kwargs = _accepted(self.call, options)
        self.tokens: _StaticTokens | None = None

    def stage(self, tokens: Tokens) -> None:
        self.tokens = _StaticTokens(tokens, self.ctx.workload.hidden, self.ctx.device)
        if self.pre_dispatch is None:  # this build has no pre-dispatch: stage its bytes outside the graph
            staged, n, b = tokens.staged, tokens.count, self.buf
            b.x[:n], b.x_sf[:n] = staged.x, staged.x_sf
            b.topk_idx.fill_(-1)
            b.topk_weights.zero_()
            b.topk_idx[:n], b.topk_weights[:n] = staged.topk_idx.to(b.topk_idx.dtype), staged.topk_weights

    def run(self) -> torch.Tensor:
        t, b = self.tokens, self.buf
        if self.pre_dispatch is not None:
            self.pre_dispatch(t.x, t.topk_idx, t.topk_weights, b.x, b.x_sf, b.topk_idx, b.topk_weights,
                              num_tokens=t.count, group_size=128,
                              routed_scaling_factor=self.ctx.workload.routed_scaling_factor)
        self.call(t.y, self.l1, self.l2, b, **self.moe_kwargs)
        return t.y[: t.count]

    def partition(self) -> dict[str, object]:
        workspace = getattr(self.buf, "workspace", None)
        if workspace is None:  # an original build: DeepGEMM's own SM split
            return {"partition": "original deep_gemm", "num_sms": getattr(self.dg, "get_num_sms", lambda: None)()}
        return _gc_moe_partition(workspace)

    def check(self, what: str) -> None:
        workspace = getattr(self.buf, "workspace", None)
        if workspace is None:
            torch.cuda.synchronize()  # an original build: a sticky CUDA error surfaces here
        else:
            _raise_for_status(workspace, what)

    def close(self) -> None:
        self.buf.destroy()


def _raise_for_status(buffer: object, what: str) -> None:
    from gc_moe_compat.operator.sm90 import layer

    layer.raise_for_layer_status(buffer, what)


def _gc_moe_partition(buffer: object) -> dict[str, object]:
    """The operator buffer's plan plus, with the partition on, the green partition obtained."""
    info = dict(buffer.describe())
    if info.get("partition") == "on":
        from gc_moe_compat.runtime.green import launch_partition

        info["green"] = launch_partition(buffer.plan, buffer.storage.device.index).describe()
    return info


class NativeFp8Fp4:
    """The native API's FP8xFP4 path: ``get_symm_buffer_for_gc_moe(..., 'fp8xfp4')``, ``transform_weights_for_gc_moe``
    of the MXFP4 experts, the caller's staging of the pre-dispatch bytes, ``fp8_fp4_gc_moe``."""

    def __init__(self, ctx: Context) -> None:
        from gc_moe_compat.operator import api

        self.api, self.ctx = api, ctx
        w = ctx.workload
        shape = ctx.shape("fp8xfp4")
        self.buf = api.get_symm_buffer_for_gc_moe(ctx.group, shape.num_experts, w.capacity, w.topk, w.hidden,
                                                  w.intermediate, "fp8xfp4")
        l1, l2 = ctx.weights["mxfp4"]
        self.w1, self.w2 = api.transform_weights_for_gc_moe((l1.payload, l1.scales), (l2.payload, l2.scales),
                                                            "fp8xfp4")
        self.y: torch.Tensor | None = None

    def stage(self, tokens: Tokens) -> None:
        from gc_moe_compat.testing.operator_workload import stage

        stage(self.buf, tokens.staged)
        self.buf.topk_weights[tokens.count:].zero_()
        self.y = torch.zeros(tokens.count, self.ctx.workload.hidden, dtype=torch.bfloat16, device=self.ctx.device)

    def run(self) -> torch.Tensor:
        self.api.fp8_fp4_gc_moe(self.y, self.w1, self.w2, self.buf,
                                activation_clamp=self.ctx.workload.activation_clamp,
                                check_values=not torch.cuda.is_current_stream_capturing())
        return self.y

    def partition(self) -> dict[str, object]:
        return _gc_moe_partition(self.buf)

    def check(self, what: str) -> None:
        _raise_for_status(self.buf, what)

    def close(self) -> None:
        self.buf.destroy()


def _facade() -> ModuleType:
    from gc_moe_compat import deep_gemm

    return deep_gemm


def _original_deep_gemm() -> ModuleType:
    from gc_moe_compat import originals

    return originals.load("deep_gemm")


def _source(module: ModuleType) -> str:
    """Where ``module`` was loaded from, as a result file records it (inside the checkout: relative)."""
    return portable_path(getattr(module, "__file__", None)) or "?"


def _original_deep_gemm_source() -> str | None:
    """The original deep_gemm that runs: where it was loaded from and, for a staging of
    ``scripts/build_sgl_deep_gemm.sh`` (its ``SOURCE`` file beside the package), the ref and commit it was staged
    from (a path in that line written as every result file writes one); None where none loads."""
    try:
        dg = _original_deep_gemm()
    except ImportError:
        return None
    where = _source(dg)
    staged = Path(getattr(dg, "__file__", "") or ".").resolve().parent.parent / "SOURCE"
    if not staged.is_file():
        return where
    words = staged.read_text().split(";")[0].split()
    return f"{where} ({' '.join(portable_path(w) if w.startswith('/') else w for w in words)})"


def _probe_original_mega_moe() -> str | None:
    try:
        dg = _original_deep_gemm()
    except ImportError as exc:
        return f"{exc}; to run it: {DEEPGEMM_INSTALL}"
    missing = [n for n in ("get_symm_buffer_for_mega_moe", "transform_weights_for_mega_moe_sm90", "fp8_mega_moe")
               if not hasattr(dg, n)]
    if missing:
        return (f"the original deep_gemm at {_source(dg)} has no SM90 Mega MoE ({', '.join(missing)} "
                f"missing: DeepGEMM 2.8.2's Mega MoE is SM100-only); to run it: {DEEPGEMM_INSTALL}")
    return None


def _probe_composed() -> str | None:
    try:
        masked_gemm_of(_original_deep_gemm())
    except ImportError as exc:
        return (f"needs the original DeepGEMM's masked FP8 grouped GEMM ({exc}); to run it: {DEEPGEMM_INSTALL} "
                "(or install deepinfer-gemm==2.8.2 built from its sdist)")
    except AttributeError as exc:
        return f"{exc}; to run it: {DEEPGEMM_INSTALL}"
    return None


def _deep_ep(group: dist.ProcessGroup | None = None, world_size: int = 1,
             device: int | None = None) -> tuple[ModuleType, str]:
    """The original ``deep_ep`` where it imports and its low-latency mode starts, else this library's facade; and a
    line saying which (and why).

    The start is asked of a child process bounded by ``GC_MOE_AB_DEEP_EP_PROBE_S`` (:mod:`gc_moe_compat.ab.
    deep_ep_probe`): where NVSHMEM cannot start (IBGDA finding no network card) the original's low-latency
    ``Buffer`` never returns, and a run must not hang on it. With ``world_size > 1`` every rank of ``group`` probes
    and they agree (a collective: every rank calls this), so that no rank runs the original while another runs the
    facade."""
    from gc_moe_compat import originals
    from gc_moe_compat.ab import deep_ep_probe

    ep: ModuleType | None
    try:
        ep = originals.load("deep_ep")
    except ImportError as exc:
        ep, verdict = None, deep_ep_probe.Verdict(False, f"the original deep_ep is not importable: {exc}")
    else:
        origin = getattr(ep, "__file__", None)
        try:
            verdict = deep_ep_probe.probe(_source(ep), device,
                                          original_dir=os.path.dirname(os.path.dirname(origin)) if origin else None)
        except Exception as exc:  # noqa: BLE001 - a bad setting or no child: the facade, and the ranks still agree
            verdict = deep_ep_probe.Verdict(False, f"the probe of the original deep_ep at {_source(ep)} did not run: "
                                                   f"{type(exc).__name__}: {exc}")
    if world_size > 1:
        verdicts: list[object] = [None] * world_size
        dist.all_gather_object(verdicts, verdict, group=group)
        verdict = deep_ep_probe.agree(verdicts)
    if ep is not None and verdict.ok:
        return ep, (f"original deep_ep at {_source(ep)} (its low-latency mode started in a probe child, "
                    f"{verdict.seconds:.1f} s)")
    from gc_moe_compat import deep_ep

    return deep_ep, f"gc_moe_compat.deep_ep facade ({verdict.reason})"


def composed_expected_m(tokens: int, world_size: int, topk: int, num_experts: int) -> int:
    """DeepGEMM's ``expected_m`` hint as a DeepEP low-latency caller knows it before the dispatch (no counts on the
    host): the mean rows per expert, ``ceil(T * P * k / E)``, at least 1."""
    return max(1, -(-tokens * world_size * topk // num_experts))


class ComposedDeepEpDeepGemm:
    """SGLang's DeepEP low-latency MoE (module docstring): one low-latency ``Buffer`` sized for the capacity, the
    original DeepGEMM's masked pipeline (:class:`~gc_moe_compat.ab.masked_gemm.MaskedExperts`) on DeepEP's
    ``[E/P, P * Tmax, H]`` receive layout (Tmax: the capacity, rounded up to a multiple of 4); per step: dispatch,
    W1, activation, W2, combine (all captured)."""

    def __init__(self, ctx: Context) -> None:
        from gc_moe_compat.ab.masked_gemm import MaskedExperts

        self.ctx = ctx
        w = ctx.workload
        self.num_experts = ctx.shape("fp8xfp8").num_experts
        self.ep, self.ep_source = _deep_ep(ctx.group, ctx.world_size, ctx.device.index)  # first: a collective
        # DeepEP's Tmax: the capacity, rounded up to a multiple of 4 (DeepEP asserts ranks x Tmax % 4 == 0)
        self.max_tokens = -(-w.capacity // 4) * 4
        hint = self.ep.Buffer.get_low_latency_rdma_size_hint(self.max_tokens, w.hidden, ctx.world_size,
                                                             self.num_experts)
        self.buf = self.ep.Buffer(ctx.group, 0, hint, low_latency_mode=True, num_qps_per_rank=w.local_experts)
        dg = _original_deep_gemm()
        l1, l2 = ctx.weights["fp8_block128"]
        self.experts = MaskedExperts(dg, l1, l2, ctx.world_size * self.max_tokens, 1, w.activation_clamp)
        self.dg_source = _source(dg)
        self.x: torch.Tensor | None = None

    def stage(self, tokens: Tokens) -> None:
        staged, dev = tokens.staged, self.ctx.device
        self.x = tokens.x.to(device=dev, dtype=torch.bfloat16).clone()
        self.topk_idx = staged.topk_idx.to(device=dev, dtype=torch.int64).clone()
        self.topk_weights = staged.topk_weights.to(device=dev, dtype=torch.float32).clone()
        self.y = torch.zeros(tokens.count, self.ctx.workload.hidden, dtype=torch.bfloat16, device=dev)
        self.experts.expected_m = composed_expected_m(tokens.count, self.ctx.world_size, self.ctx.workload.topk,
                                                      self.num_experts)

    def run(self) -> torch.Tensor:
        (x, x_sf), count, handle, _, _ = self.buf.low_latency_dispatch(
            self.x, self.topk_idx, self.max_tokens, self.num_experts, use_fp8=True)
        out = self.experts(x, x_sf, count)
        self.buf.low_latency_combine(out, self.topk_idx, self.topk_weights, handle, out=self.y)
        return self.y

    def partition(self) -> dict[str, object]:
        return {"partition": "composed (DeepEP low-latency kernels + DeepGEMM on the whole device)",
                "deep_ep": self.ep_source, "deep_gemm": self.dg_source, "activation": COMPOSED_ACTIVATION,
                "expected_m": "ceil(T * P * k / E) per point"}

    def check(self, what: str) -> None:
        torch.cuda.synchronize()  # a sticky CUDA error of the dispatch / GEMM kernels surfaces here

    def close(self) -> None:
        """Drop the buffer and the pipeline (DeepEP frees a Buffer not created with explicitly_destroy on GC)."""
        self.buf = self.experts = None


def _always() -> None:
    return None


def operator_specs(partition_sweep: bool = False) -> list[OperatorSpec]:
    """Every adapter, in report order (the dispatch-SM sweep entries with ``partition_sweep``)."""
    specs = [
        OperatorSpec("facade", "gc_moe_compat.deep_gemm facade, SGLang 0.5.23's Hopper sequence: "
                     "mega_moe_pre_dispatch_sm90 + fp8_mega_moe (GC-MoE, partition per call: "
                     "GC_MOE_PARTITION=auto); timed: both calls",
                     "fp8_block128", lambda ctx: MegaMoeSequence(_facade(), ctx), _always),
        OperatorSpec("facade_partition_off", "the same facade sequence on a buffer created with GC_MOE_PARTITION=off "
                     "(GC-MoE's kernels in sequence on the whole device: the partition ablation); timed: both calls",
                     "fp8_block128",
                     lambda ctx: MegaMoeSequence(_facade(), ctx, {"GC_MOE_PARTITION": "off"}), _always),
        OperatorSpec("native_fp8xfp4", "GC-MoE native API fp8_fp4_gc_moe: the same BF16 experts quantized to MXFP4, "
                     "tokens staged by the caller with the pre-dispatch's bytes; timed: the operator call only",
                     "mxfp4", NativeFp8Fp4, _always),
        OperatorSpec("original_deep_gemm", "the installed original deep_gemm (sgl-deep-gemm / sgl-project DeepGEMM "
                     "SM90 Mega MoE), SGLang's Hopper sequence on it; timed: its pre-dispatch (where the build has "
                     "one) + fp8_mega_moe", "fp8_block128",
                     lambda ctx: MegaMoeSequence(_original_deep_gemm(), ctx), _probe_original_mega_moe,
                     _original_deep_gemm_source),
        OperatorSpec("composed_deepep_deepgemm", "SGLang's deepep low-latency path: DeepEP low_latency_dispatch "
                     "(original deep_ep if importable and its low-latency mode starts in a probe child, else the "
                     "gc_moe_compat.deep_ep facade: meta.partition says which) -> original DeepGEMM masked FP8 "
                     "W1 -> SwiGLU + FP8 1x128 requant (our Triton kernel of SGLang's arithmetic) -> masked W2 -> "
                     "low_latency_combine; timed: all five steps",
                     "fp8_block128", ComposedDeepEpDeepGemm, _probe_composed, _original_deep_gemm_source),
    ]
    if partition_sweep:
        specs.append(OperatorSpec(
            "facade_partition_on", "the same facade sequence on a buffer created with GC_MOE_PARTITION=on (the green "
            "partition at every T, also where the per-call rule runs the roles in sequence); timed: both calls",
            "fp8_block128", lambda ctx: MegaMoeSequence(_facade(), ctx, {"GC_MOE_PARTITION": "on"}), _always))
        specs += [
            OperatorSpec(f"facade_dispatch_sms_{n}", f"the facade sequence on a buffer created with "
                         f"GC_MOE_DISPATCH_SMS={n} (communication partition request {n} SMs); timed: both calls",
                         "fp8_block128",
                         lambda ctx, n=n: MegaMoeSequence(_facade(), ctx, {"GC_MOE_DISPATCH_SMS": str(n)}), _always)
            for n in DISPATCH_SWEEP
        ]
    return specs


def default_ops() -> list[str]:
    """The operators a run compares when ``--ops`` is not given."""
    return [s.name for s in operator_specs()]


def select(names: Sequence[str] | None, partition_sweep: bool) -> list[OperatorSpec]:
    """The specs of ``names`` (all by default), in report order; unknown names raise ``ValueError``."""
    swept = ("facade_dispatch_sms_", "facade_partition_on")
    specs = operator_specs(partition_sweep or any(n.startswith(swept) for n in names or ()))
    by_name = {s.name: s for s in specs}
    if names is None:
        return specs
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"--ops: unknown operator(s) {unknown}; known: {list(by_name)}")
    return [s for s in specs if s.name in names]
