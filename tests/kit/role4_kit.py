"""What the fused shared expert's (role4's) GPU tests share, for both weight forms (block-scaled FP8 in
tests/operator/test_role4_shared_gpu.py, DeepGEMM's K32 recipe in test_role4_shared_k32_gpu.py): their
``num_shared_experts=1`` buffers, the parallel build of the variants they launch, and the three checks both make.

* :func:`checked_call`: a poisoned eager call against the quantization-faithful reference: role4's combine slot k
  against the reference's slot-k partials (cosine >= :data:`PARTIAL_COSINE_MIN`), ``y`` bit for bit the slot-order
  FP32 sum of the combine slots (role3 adds the shared partial last), ``y`` against the reference's;
* :func:`assert_graph_matches_eager`: graph replays from poisoned workspaces bit-identical to the eager call;
* :func:`assert_facade_matches_native`: ``deep_gemm.fp8_fp4_mega_moe`` on a facade buffer, with the routed weights
  through ``transform_weights_for_mega_moe``, the native call's bits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from operator_kit import (
    CALLS,
    CAPACITY,
    CLAMP,
    RankWeights,
    assert_bits_equal,
    check_accuracy,
    make_expert_weights,
    make_inputs,
    poison,
    poisoned_y,
    preset_dims,
    stage,
    start_call,
)

import gc_moe_compat.deep_gemm as dg
from gc_moe_compat import quant
from gc_moe_compat.deep_gemm import _seam
from gc_moe_compat.operator import api
from gc_moe_compat.operator.sm90 import layer, role2_gemm, role4_shared
from gc_moe_compat.references.operator_workload import RankInputs, reference_results
from gc_moe_compat.references.reference import ExpertWeights, accuracy_metrics
from gc_moe_compat.runtime import jit

Shared = tuple[ExpertWeights, ExpertWeights]
"""A shared expert's L1 and L2 weights as the reference reads them."""
Pairs = dict[str, tuple[torch.Tensor, torch.Tensor]]
"""The native call's shared-weight keywords: ``shared_l1_weights`` / ``shared_l2_weights`` (payload, scales)."""
PARTIAL_COSINE_MIN = 0.9999
"""Role4's slot k against the reference's slot-k partials."""


class SharedBuffers:
    """One test module's ``num_shared_experts=1`` operator buffers, one per (preset, compute path, partition),
    allocated at first use and kept for the module (``partition`` None: the buffer's default)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, str, str | None], api.GcMoeBuffer] = {}

    def __call__(self, group: dist.ProcessGroup, preset: str, mma_type: str,
                 partition: str | None = None) -> api.GcMoeBuffer:
        key = (preset, mma_type, partition)
        if key not in self._buffers:
            e, k, h, inter = preset_dims(preset)
            self._buffers[key] = api.get_symm_buffer_for_gc_moe(group, e, CAPACITY, k, h, inter, mma_type,
                                                                num_shared_experts=1, partition=partition)
        return self._buffers[key]


def compile_variants(buffers: Iterable[api.GcMoeBuffer], tokens: Iterable[int], *, k32: bool) -> None:
    """Builds the role2 and role4 variants (``k32``: role4's K32-promoting ones) that calls with ``tokens`` tokens
    on ``buffers`` launch, in parallel (nvcc runs are independent processes; the JIT cache then serves every
    launch)."""
    tokens = tuple(tokens)
    builds = set()
    for buf in buffers:
        for t in tokens:
            v2 = role2_gemm.role2_variant(api.ring_model(buf, t), t)
            builds.add((v2.source, tuple(sorted(v2.defines.items()))))
            for v4 in role4_shared.role4_variants(buf.shape, t, buf.current_compute_sms(), k32=k32):
                builds.add((role4_shared.SOURCE, tuple(sorted(v4.defines.items()))))
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda b: jit.compile_cubin(b[0], dict(b[1])), sorted(builds)))


def slot_order_sum(buf: api.GcMoeBuffer, tokens: int) -> torch.Tensor:
    """BF16 of the FP32 sum of this rank's combine slots in slot order: the valid routed slots, then slot k."""
    k = buf.shape.topk
    valid = buf.topk_idx[:tokens] >= 0
    acc = torch.zeros(tokens, buf.shape.hidden, dtype=torch.float32, device="cuda")
    for s in range(k):
        acc = torch.where(valid[:, s, None], acc + buf.combine[s, :tokens].float(), acc)
    return (acc + buf.combine[k, :tokens].float()).to(torch.bfloat16)


def checked_call(buf: api.GcMoeBuffer, w: RankWeights, sw: Shared, pairs: Pairs, preset: str, tokens: int,
                 seed: int, form: str, *, check_status: bool = False) -> torch.Tensor:
    """Stage seeded inputs, poison (role4's intermediate too), run the native call eagerly with the shared weights
    ``pairs`` (``sw`` as the reference reads them), then check role4's slot k, role3's slot-order sum and ``y``
    (``form`` names the weights' form in the messages; ``check_status``: the layer's status records first)."""
    e, k, h, _ = preset_dims(preset)
    inputs = make_inputs("uniform", tokens, e, k, h, seed)
    y = start_call(buf, inputs, shared=True)
    CALLS[buf.shape.mma_type](y, w.w1, w.w2, buf, **pairs)
    torch.cuda.synchronize()
    if check_status:
        layer.raise_for_layer_status(buf, f"{form} shared call")
    what = f"{buf.shape.mma_type} {preset} {form} shared T={tokens} partition={buf.partition}"
    if tokens:
        ref = reference_results([inputs], [w], shared=sw)[0]
        m = accuracy_metrics(buf.combine[k, :tokens].float(), ref.partials[:, k].float())
        print(f"{what}: role4 slot k vs reference {m}")
        assert m["nonfinite"] == 0 and m["cosine"] >= PARTIAL_COSINE_MIN, f"{what}: role4 slot k {m}"
        assert_bits_equal(y, slot_order_sum(buf, tokens), f"{what}: y vs the slot-order sum of combine")
        check_accuracy(y, ref.y, what, preset)
    return y


def assert_graph_matches_eager(buf: api.GcMoeBuffer, inputs: RankInputs, call: Callable[[torch.Tensor], None],
                               what: str) -> torch.Tensor:
    """``inputs`` staged, ``call(y)`` once eagerly, then captured in a CUDA graph replayed twice from poisoned
    workspaces (role4's intermediate too) and a NaN ``y``: each replay's ``y`` bit for bit the eager one, which is
    returned."""
    stage(buf, inputs)
    y = poisoned_y(inputs.tokens, buf.shape.hidden)
    call(y)
    eager = y.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(y)
    for i in range(2):
        poison(buf, shared=True)
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        layer.raise_for_layer_status(buf, f"graph replay {i}")
        assert_bits_equal(y, eager, f"{what} graph replay {i}")
    return eager


def assert_facade_matches_native(group: dist.ProcessGroup, native: api.GcMoeBuffer, w: RankWeights, sw: Shared,
                                 pairs: Pairs, facade_pairs: Pairs, preset: str, tokens: int, seed: int,
                                 what: str) -> None:
    """``dg.fp8_fp4_mega_moe`` on a ``num_shared_experts=1`` facade buffer, the routed weights the same canonical
    MXFP4 weights through ``dg.transform_weights_for_mega_moe`` and the shared ones ``facade_pairs``: the bits of
    the native FP8xFP4 call on ``native`` with ``pairs`` on the same staged tokens, and the reference's accuracy."""
    e, k, h, inter = preset_dims(preset)
    sym = dg.get_symm_buffer_for_mega_moe(group, e, CAPACITY, k, h, inter, num_shared_experts=1, mma_type="fp8xfp4")
    inputs = make_inputs("uniform", tokens, e, k, h, seed=seed)
    stage(native, inputs)
    stage(_seam.workspace_of(sym), inputs)
    y_native, y_facade = poisoned_y(tokens, h), poisoned_y(tokens, h)
    api.fp8_fp4_gc_moe(y_native, w.w1, w.w2, native, **pairs)
    l1, l2 = make_expert_weights(preset, 0, fmt="mxfp4")
    r1, r2 = dg.transform_weights_for_mega_moe((l1.payload, quant.pack_ue8m0_k32(l1.scales)),
                                               (l2.payload, quant.pack_ue8m0_k32(l2.scales)))
    dg.fp8_fp4_mega_moe(y_facade, r1, r2, sym, **facade_pairs, activation_clamp=CLAMP)
    torch.cuda.synchronize()
    assert_bits_equal(y_facade, y_native, f"facade ({what}) vs native")
    check_accuracy(y_facade, reference_results([inputs], [w], shared=sw)[0].y, f"facade {what}", preset)
