"""Role2 in operator mode and the operator assembly, host side (no GPU).

* the operator-mode kernels (``GC_OPERATOR=1``, FP8xFP8 and FP8xFP4) build for sm_90a without spills in every
  variant, and their shared-memory size equals the host formula (the build asserts it);
* every standalone FP8xFP8 / FP8xFP4 variant's cubin is byte-identical to its record (a refactor or an operator-mode
  change must not move the standalone kernels; a deliberate kernel change rewrites the records with
  scripts/record_sm90_cubins.py);
* :class:`Role2Params` is the generated C declaration;
* the FP8xFP4 kernel's weight units are exactly the standalone FP4 kernel's (the GPU-verified layout);
* the task sequence is ring.py's live-block order, and a simulation of the persistent grid with role1's refill
  waits finishes for the capacity the host checks (and can deadlock below it), for both kernels' task counts;
* the three-node graph's node list, contexts, dependencies and warm-up arguments (kernels faked);
* ``GC_MOE_PARTITION=off`` sizes the ring for the whole pool and rejects a ring that does not hold it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import heapq
import json
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from _standalone_gemm import prepare_fp4_weights, recorded_variants
from nvcc_mark import needs_nvcc, serialized_wgmma

from gc_moe_compat.compute_paths import FP8XFP4, FP8XFP8, compute_path
from gc_moe_compat.config import MMA_TYPES, MoEShape
from gc_moe_compat.operator import api, ring
from gc_moe_compat.operator.heuristics import SMEM_LIMIT, block_m_candidates
from gc_moe_compat.operator.sm90 import layer, role1_dispatch, role2_gemm, role3_finalize
from gc_moe_compat.operator.workspace import StatusRecord
from gc_moe_compat.runtime import jit
from gc_moe_compat.runtime.green import Role
from gc_moe_compat.runtime.status import DeviceCheckError, DeviceTimeoutError
from gc_moe_compat.runtime.tensormap import TensorMapArg
from gc_moe_compat.testing.reference import ExpertWeights

KERNELS_DIR = Path(__file__).resolve().parents[2] / "kernels"
DATA_DIR = Path(__file__).resolve().parents[1] / "data"
H, N_I, E, K, TMAX = 512, 256, 8, 2, 32


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("GC_MOE_PARTITION", "GC_MOE_DISPATCH_SMS", "GC_MOE_SM90_DISPATCH_SMS"):
        monkeypatch.delenv(name, raising=False)


# ------------------------------------------------------------------------------------------------------------------
# Kernel builds


def test_role2_params_header_is_generated_from_the_ctypes_struct() -> None:
    header = (KERNELS_DIR / "sm90" / "role2_gemm_params.cuh").read_text()
    assert "// BEGIN GENERATED\n" + role2_gemm.params_header() + "// END GENERATED" in header
    assert ctypes.sizeof(role2_gemm.Role2Params) == 64


def test_role2_sites_are_generated_into_both_headers() -> None:
    """Sites 1-3 (shared with the standalone kernel) are grouped.cuh's generated block, 4-8 role2_gemm_params.cuh's:
    every site of :class:`Role2Site` is declared once."""
    grouped = (KERNELS_DIR / "sm90" / "grouped.cuh").read_text()
    assert "// BEGIN GENERATED\n" + role2_gemm.grouped_header() + "// END GENERATED" in grouped
    declared = role2_gemm.grouped_header() + role2_gemm.params_header()
    assert sorted(int(v) for v in re.findall(r"^    kSite\w+ = (\d+),", declared, re.MULTILINE)) == sorted(
        role2_gemm.Role2Site)


@pytest.mark.parametrize(("bm", "mma_type"), [(bm, m) for m in MMA_TYPES for bm in block_m_candidates(m)])
def test_operator_smem_fits_and_stages_are_maximal(bm: int, mma_type: str) -> None:
    stages = role2_gemm.operator_stages(bm, mma_type)
    assert stages >= 2 and role2_gemm.operator_smem_bytes(bm, stages, mma_type) <= SMEM_LIMIT
    assert stages == 8 or role2_gemm.operator_smem_bytes(bm, stages + 1, mma_type) > SMEM_LIMIT
    variant = role2_gemm.Role2Variant(bm, True, mma_type=mma_type)
    assert variant.smem == role2_gemm.operator_smem_bytes(bm, stages, mma_type)


def test_variant_picks_the_kernel_of_its_weight_format() -> None:
    fp8, fp4 = role2_gemm.Role2Variant(16, True), role2_gemm.Role2Variant(16, True, mma_type="fp8xfp4")
    assert (fp8.source, fp8.kernel_name) == (FP8XFP8.kernel, FP8XFP8.operator_entry)
    assert (fp4.source, fp4.kernel_name) == ("sm90/role2_gemm_fp8xfp4.cu", "gc_sm90_fp8_fp4_role2")
    assert fp4.defines["GC_OP_SMEM_BYTES"] == fp4.smem != fp8.smem
    assert role2_gemm.role2_defines(16, True) == fp8.defines  # the FP8xFP8 default (bench/operator_sm90.py's call)
    with pytest.raises(ValueError, match="mma_type: must be one of"):
        role2_gemm.Role2Variant(16, True, mma_type="fp8xbf16")
    for mma_type in MMA_TYPES:
        shape = MoEShape(num_experts=16, num_ranks=2, hidden=1024, intermediate=512, topk=4, capacity=64,
                         mma_type=mma_type)
        assert role2_gemm.role2_variant(ring.RingModel(shape, 8, 16), 4).mma_type == mma_type


def test_wide_block_variants() -> None:
    """The 96-row block exists only in the FP8xFP8 kernel and only pipelined; a call that picks it runs the
    producer warpgroup even with few tasks, and a prebuild compiles just that variant."""
    wide = role2_gemm.Role2Variant(96, True)
    assert (wide.defines["GC_BM"], wide.defines["GC_STAGES"]) == (96, 3) and wide.smem <= SMEM_LIMIT
    with pytest.raises(ValueError, match="BM=96 runs only with the producer warpgroup"):
        role2_gemm.Role2Variant(96, False)
    with pytest.raises(ValueError, match=r"bm: must be one of \(8, 16, 32, 64\) \(the fp8xfp4"):
        role2_gemm.Role2Variant(96, True, mma_type="fp8xfp4")
    assert [v.pipelined for v in role2_gemm.variants_of(96, "fp8xfp8")] == [True]
    assert [v.pipelined for v in role2_gemm.variants_of(64, "fp8xfp4")] == [False, True]
    shape = MoEShape(num_experts=16, num_ranks=1, hidden=1024, intermediate=512, topk=4, capacity=512,
                     mma_type="fp8xfp8")
    assert role2_gemm.role2_variant(ring.RingModel(shape, 96, 132), 1).pipelined


@needs_nvcc
@pytest.mark.parametrize("variant", [v for m in MMA_TYPES for bm in block_m_candidates(m)
                                     for v in role2_gemm.variants_of(bm, m)],
                         ids=lambda v: f"{v.mma_type}-bm{v.bm}-prod{int(v.pipelined)}")
def test_operator_variants_compile_without_spills(variant: role2_gemm.Role2Variant, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Every operator-mode variant of both kernels builds for sm_90a (which also asserts kSmemBytes ==
    operator_smem_bytes): no stack frame, no spills, no serialized WGMMAs, the 168-register cap of the producer
    layout."""
    monkeypatch.setenv("GC_MOE_CACHE_DIR", str(tmp_path))
    cubin = jit.compile_cubin(variant.source, variant.defines)
    res = cubin.resources[variant.kernel_name]
    assert res.spill_stores == 0 and res.spill_loads == 0 and res.stack_bytes == 0
    assert not serialized_wgmma(cubin.warnings)
    assert res.registers <= (168 if variant.pipelined else 255)


# (source, record) per mma type: both rewritten by scripts/record_sm90_cubins.py after the WGMMA serialization fix
# and the FP8xFP4 software pipeline (each record's note says which change; before it, FP8xFP8 was recorded before
# operator mode existed, commit fb7c8b1, and FP8xFP4 at commit 1447f6d).
STANDALONE_RECORDS = {
    "fp8xfp8": (FP8XFP8.kernel, DATA_DIR / "sm90_fp8_standalone_cubins.json"),
    "fp8xfp4": (FP8XFP4.kernel, DATA_DIR / "sm90_fp4_standalone_cubins.json"),
}


@needs_nvcc
@pytest.mark.parametrize("mma_type", sorted(STANDALONE_RECORDS))
def test_standalone_cubins_are_byte_identical(mma_type: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Operator mode is a compile-time switch and shared device code is a refactor: every standalone cubin is the
    same bytes as in its record (tests/data/sm90_*_standalone_cubins.json, same nvcc; the record's note says which
    kernel change wrote it and whether that build was GPU-verified)."""
    source, data = STANDALONE_RECORDS[mma_type]
    record = json.loads(data.read_text())
    version = subprocess.run([str(jit.find_nvcc()), "--version"], capture_output=True, text=True).stdout
    if record["nvcc"] not in version:
        pytest.skip(f"hashes recorded with {record['nvcc']}, this nvcc differs")
    monkeypatch.setenv("GC_MOE_CACHE_DIR", str(tmp_path))
    variants = recorded_variants(mma_type)
    assert len(variants) == len(record["cubins"])
    for defines in variants:
        cubin = jit.compile_cubin(source, defines)
        digest = hashlib.sha256(cubin.path.read_bytes()).hexdigest()
        assert digest == record["cubins"][str(sorted(defines.items()))], defines


def test_fp4_units_are_the_standalone_kernels_units() -> None:
    """The operator's FP8xFP4 weight view (native transform, then role2_gemm.fp4_units, chunked) is byte for byte what
    the
    GPU-verified standalone FP4 kernel reads (gemm.prepare_fp4_weights), factors included; K32 scales spread over 16
    exponents so the window clips groups and the units carry d up to 10; 11 experts cross a permutation chunk."""
    g = torch.Generator().manual_seed(5)
    e, h, inter = 11, 256, 128
    spread = [torch.randn(e, n, k, generator=g) * torch.exp2(-torch.randint(0, 16, (e, n, k // 32), generator=g)
                                                             .float()).repeat_interleave(32, dim=-1)
              for n, k in ((2 * inter, h), (h, inter))]
    l1, l2 = (ExpertWeights.quantize(w, "mxfp4") for w in spread)
    w1, w2 = api.transform_weights_for_gc_moe((l1.payload, l1.scales), (l2.payload, l2.scales), "fp8xfp4")
    assert int(w1.scales.max()) == 10
    ref = prepare_fp4_weights(l1, l2)
    assert torch.equal(role2_gemm.fp4_units(w1), ref.w1) and torch.equal(role2_gemm.fp4_units(w2), ref.w2)
    assert torch.equal(w1.factor, ref.w1_factor) and torch.equal(w2.factor, ref.w2_factor)
    with pytest.raises(ValueError, match="w: must be fp8xfp4 weights"):
        role2_gemm.fp4_units(api.transform_weights_for_gc_moe(*_fp8_pairs(), "fp8xfp8")[0])


@pytest.mark.parametrize("mma_type", MMA_TYPES)
def test_role2_weights_maps(mma_type: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Role2Weights (tensor maps faked: no driver): FP8xFP8 maps the interleaved payloads with 256-row swizzled boxes
    and passes the block scales; FP8xFP4 maps the decoder's units with one task's four units per box (136 rows of
    128 bytes, no swizzle: kWBytes of the kernel) and passes the per-expert factors."""
    maps = []
    monkeypatch.setattr(role2_gemm, "encode_2d",
                        lambda t, rows, swizzle=True: maps.append((tuple(t.shape), rows, swizzle)))
    if mma_type == "fp8xfp8":
        w1, w2 = api.transform_weights_for_gc_moe(*_fp8_pairs(), "fp8xfp8")
        assert maps == [] and role2_gemm.Role2Weights(w1, w2).w1_sf.shape == (E, 2 * N_I // 128, H // 128)
        assert maps == [((E * 2 * N_I, H), 256, True), ((E * H, N_I), 256, True)]
        return
    g = torch.Generator().manual_seed(6)
    l1 = ExpertWeights.quantize(torch.randn(E, 2 * N_I, H, generator=g), "mxfp4")
    l2 = ExpertWeights.quantize(torch.randn(E, H, N_I, generator=g), "mxfp4")
    w1, w2 = api.transform_weights_for_gc_moe((l1.payload, l1.scales), (l2.payload, l2.scales), "fp8xfp4")
    view = role2_gemm.Role2Weights(w1, w2)
    assert (view.mma_type, view.num_experts, view.hidden, view.inter) == ("fp8xfp4", E, H, N_I)
    assert maps == [((E * (H // 128) * (2 * N_I // 64) * 34, 128), 136, False),
                    ((E * (N_I // 128) * (H // 64) * 34, 128), 136, False)]
    assert 136 * 128 == 4 * 4352 and torch.equal(view.w1_sf, w1.factor)
    assert torch.equal(view.w2_sf, w2.factor) and view.w2_sf.dtype == torch.float32
    with pytest.raises(ValueError, match="weights: role2 takes an \\(l1, l2\\) pair of one mma_type"):
        role2_gemm.Role2Weights(w2, w1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a first FP4 call on a buffer inside a capture
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="make one eager call with these weights on this buffer before capturing"):
        role2_gemm.Role2Weights(w1, w2)


def _fp8_pairs() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    return ((torch.zeros(E, 2 * N_I, H, dtype=torch.float8_e4m3fn), torch.ones(E, 2 * N_I // 128, H // 128)),
            (torch.zeros(E, H, N_I, dtype=torch.float8_e4m3fn), torch.ones(E, H // 128, N_I // 128)))


# ------------------------------------------------------------------------------------------------------------------
# Task sequence and deadlock freedom


def _declared_order(n: int, w: int, t1: int, t2: int) -> list[tuple[str, int, int]]:
    """ring.py's live-block order written out: W1 of the look-ahead blocks (tile-major), then per block j its W2
    tiles followed by the W1 tiles of block j + w."""
    a = min(w, n)
    out = [("w1", b, tile) for tile in range(t1) for b in range(a)]
    for j in range(n):
        out += [("w2", j, tile) for tile in range(t2)]
        out += [("w1", j + w, tile) for tile in range(t1) if j + w < n]
    return out


@pytest.mark.parametrize(("n", "w", "t1", "t2"), [(0, 3, 2, 2), (1, 3, 2, 2), (5, 3, 2, 4), (7, 7, 3, 1),
                                                  (9, 1, 1, 1), (40, 6, 18, 20), (3, 10, 4, 2)])
def test_task_sequence_is_the_live_block_order(n: int, w: int, t1: int, t2: int) -> None:
    seq = role2_gemm.task_sequence(n, w, t1, t2)
    assert seq == _declared_order(n, w, t1, t2)
    assert sorted(seq) == sorted([("w1", b, i) for b in range(n) for i in range(t1)]
                                 + [("w2", b, i) for b in range(n) for i in range(t2)])
    pos = {task: i for i, task in enumerate(seq)}
    for b in range(n):  # W2 of a block after every W1 tile of it
        assert min(pos[("w2", b, i)] for i in range(t2)) > max(pos[("w1", b, i)] for i in range(t1))


def _simulate(n: int, ring_blocks: int, ctas: int, w: int, t1: int, t2: int, row_steps: int = 1,
              held: int = 2) -> bool:
    """Discrete simulation of role1 (pulls pool blocks in order, refill waits on W1 and W2 of p - R) and role2's
    grid (a CTA takes the next task of the sequence whenever it holds fewer than ``held``: the consumers' current
    task and those its producer has taken ahead; only the first it holds runs; a W1 task needs its block landed, a
    W2 task every W1 tile of its block). Returns whether everything finished (False: no actor could move, a
    deadlock)."""
    seq = role2_gemm.task_sequence(n, w, t1, t2)
    done_w1 = [0] * n
    done_w2 = [0] * n
    landed = [False] * n
    queue: list[list[int]] = [[] for _ in range(ctas)]
    taken = 0
    pulled = 0
    while pulled < n or taken < len(seq) or any(queue):
        moved = False
        for _ in range(row_steps):  # role1
            if pulled < n:
                p = pulled
                if p < ring_blocks or (done_w1[p - ring_blocks] == t1 and done_w2[p - ring_blocks] == t2):
                    landed[p] = True
                    pulled += 1
                    moved = True
        for c in range(ctas):
            while len(queue[c]) < held and taken < len(seq):  # the producer takes ahead
                queue[c].append(taken)
                taken += 1
                moved = True
            if not queue[c]:
                continue
            kind, b, _ = seq[queue[c][0]]
            if kind == "w1" and landed[b]:
                done_w1[b] += 1
            elif kind == "w2" and done_w1[b] == t1:
                done_w2[b] += 1
            else:
                continue
            queue[c].pop(0)
            moved = True
        if not moved:
            return False
    return True


def _most_work(hidden: int, inter: int, n: int, ctas: int, dynamic: bool) -> float:
    """The busiest CTA's K steps over the mean (dependencies aside): W1 tasks take ``H/128`` steps, W2 ``I/128``;
    static: CTA c runs tasks c, c + C, ...; dynamic: each next task to the CTA that frees first (a CTA takes the next
    task when it is ready for one)."""
    t1, t2 = 2 * inter // role2_gemm.TASK_ROWS, hidden // role2_gemm.TASK_ROWS
    w = -(-ctas // t1)
    cost = [hidden // 128 if kind == "w1" else inter // 128 for kind, _, _ in role2_gemm.task_sequence(n, w, t1, t2)]
    if dynamic:
        free = [(0, c) for c in range(ctas)]
        work = [0] * ctas
        for steps in cost:
            at, c = heapq.heappop(free)
            work[c] = at + steps
            heapq.heappush(free, (at + steps, c))
    else:
        work = [sum(cost[c::ctas]) for c in range(ctas)]
    return max(work) / (sum(cost) / ctas)


@pytest.mark.parametrize(("hidden", "inter", "n"), [(7168, 2048, 32), (6144, 2048, 32), (5120, 2304, 48)])
@pytest.mark.parametrize("ctas", [120, 128, 132])
def test_taking_the_next_task_evens_out_the_work(hidden: int, inter: int, n: int, ctas: int) -> None:
    """Why role2 takes tasks dynamically: on the presets' shapes (DeepSeek-V3, glm52, dsv41-flash per-rank loads,
    one block per local expert) the static split gives the busiest CTA 3-65 % more K steps than the mean, the
    dynamic one at most 5 %."""
    assert _most_work(hidden, inter, n, ctas, dynamic=False) > 1.03
    assert _most_work(hidden, inter, n, ctas, dynamic=True) <= 1.05


@pytest.mark.parametrize("mma_type", MMA_TYPES)
@pytest.mark.parametrize("compute_sms", [4, 16, 128])
@pytest.mark.parametrize("bm", [8, 64])
def test_grid_never_deadlocks_with_the_checked_ring(compute_sms: int, bm: int, mma_type: str) -> None:
    """Both kernels walk the same sequence: 256-row W1 and W2 tasks (their kRows; the FP8xFP4 operator build keeps
    two slabs per warpgroup in W2 for it), so t1 = 2I/256 and t2 = H/256 for either weight format."""
    shape = MoEShape(num_experts=16, num_ranks=2, hidden=1024, intermediate=512, topk=4, capacity=64,
                     mma_type=mma_type)
    model = ring.RingModel(shape, bm, compute_sms)
    rows = role2_gemm.TASK_ROWS
    assert (model.w1_tasks_per_block, model.w2_tasks_per_block) == (2 * 512 // rows, 1024 // rows)
    t1, t2, w = model.w1_tasks_per_block, model.w2_tasks_per_block, model.lookahead_blocks
    for n in (1, model.pool_blocks // 3, model.pool_blocks):
        for r in (model.required_ring_blocks, model.deadlock_free_blocks):
            for held in (1, 2, 9):  # a producer holds up to kStages + 1 tasks when they are shorter than its stages
                assert _simulate(n, r, compute_sms, w, t1, t2, held=held), (n, r, held)


def test_ring_below_the_look_ahead_can_deadlock() -> None:
    """Why R >= min(pool, w): with fewer ring blocks, W1 of block R (look-ahead, early in the sequence) waits for
    role1, which waits for W2 of block 0, which comes after it."""
    assert not _simulate(n=8, ring_blocks=2, ctas=1, w=4, t1=1, t2=1)
    assert _simulate(n=8, ring_blocks=4, ctas=1, w=4, t1=1, t2=1)


# ------------------------------------------------------------------------------------------------------------------
# Graph assembly (kernels faked: no driver, no GPU)


class _FakeKernel:
    def __init__(self, name: str) -> None:
        self.name, self.module_key, self.handle, self.resources = name, f"key-{name}", None, None


class _FakeWeights:
    """What role2_args reads of a Role2Weights (FP8xFP8: block scales; FP8xFP4: per-expert factors)."""

    def __init__(self, mma_type: str = "fp8xfp8") -> None:
        self.mma_type = mma_type
        self.tm_w1 = TensorMapArg()
        self.tm_w2 = TensorMapArg()
        if mma_type == "fp8xfp8":
            self.w1_sf, self.w2_sf = torch.ones(E, 2 * N_I // 128, H // 128), torch.ones(E, H // 128, N_I // 128)
        else:
            self.w1_sf, self.w2_sf = torch.ones(E), torch.full((E,), 2.0)
        self.num_experts, self.hidden, self.inter = E, H, N_I


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> _FakeWeights:
    monkeypatch.setattr(role1_dispatch, "kernel", lambda: _FakeKernel(role1_dispatch.KERNEL))
    monkeypatch.setattr(role3_finalize, "kernel", lambda: _FakeKernel(role3_finalize.KERNEL))
    monkeypatch.setattr(role2_gemm, "kernel", lambda v: _FakeKernel(f"{v.kernel_name}-{v.bm}-{int(v.pipelined)}"))
    monkeypatch.setattr(role2_gemm, "_ring_maps", lambda buf, bm: (TensorMapArg(), TensorMapArg()))
    return _FakeWeights()


def _buffer(group: dist.ProcessGroup, partition: str, mma_type: str = "fp8xfp8") -> api.GcMoeBuffer:
    return api.get_symm_buffer_for_gc_moe(group, num_experts=E, capacity=TMAX, topk=K, hidden=H,
                                             intermediate=N_I, mma_type=mma_type, compute_sms=64,
                                             partition=partition)


def _call(buf: api.GcMoeBuffer, t: int) -> layer.LayerCall:
    model = api.ring_model(buf, t)
    return layer.LayerCall(num_tokens=t, model=model, plan=api.ring_plan(buf, t, model),
                           variant=role2_gemm.role2_variant(model, t), activation_clamp=10.0, activation_alpha=1.0)


@pytest.mark.parametrize("mma_type", MMA_TYPES)
@pytest.mark.parametrize("partition", ["on", "off"])
def test_layer_nodes_contexts_and_dependencies(group: dist.ProcessGroup, fakes: _FakeWeights, partition: str,
                                               mma_type: str, monkeypatch: pytest.MonkeyPatch) -> None:
    buf = _buffer(group, partition, mma_type)
    fakes = _FakeWeights(mma_type)
    y = torch.empty(5, H, dtype=torch.bfloat16)
    call = _call(buf, 5)
    assert call.variant.mma_type == mma_type
    nodes = layer.layer_nodes(buf, y, fakes, call)
    assert [n.name for n in nodes] == list(layer.NODE_NAMES)
    r1, r2, r3 = nodes
    if partition == "on":  # concurrent roots on the two green contexts, role3 on compute after both
        assert (r1.role, r2.role, r3.role) == (Role.COMM, Role.COMPUTE, Role.COMPUTE)
        assert (r1.deps, r2.deps, r3.deps) == ((), (), ("role1", "role2"))
        assert (r2.programmatic, r3.programmatic) == ((), ("role2",))
    else:  # the whole device, in sequence: role2 launched as role1 starts, role3 as role2 ends (programmatic edges)
        assert (r1.role, r2.role, r3.role) == (None, None, None)
        assert (r1.deps, r2.deps, r3.deps) == ((), ("role1",), ("role1", "role2"))
        assert (r2.programmatic, r3.programmatic) == (("role1",), ("role2",))
    assert r1.grid == (buf.dispatch_sms, 1, 1) and r2.grid == (call.model.compute_sms, 1, 1)
    assert r2.block == (call.variant.threads, 1, 1) and r2.shared_bytes == call.variant.smem
    assert r2.kernel.name.startswith(compute_path(mma_type).operator_entry + "-")
    params = role2_gemm.Role2Params.from_buffer_copy(r2.args.signature[-1][1])
    warm = role2_gemm.Role2Params.from_buffer_copy(r2.warmup_args.signature[-1][1])
    assert (params.flags, warm.flags) == (0, role2_gemm.WARMUP)
    assert (params.block_m, params.ring_blocks) == (call.plan.block_m, call.plan.ring_blocks)
    assert (params.w1_tasks, params.w2_tasks, params.lookahead) == (2 * N_I // 256, H // 256,
                                                                    call.model.lookahead_blocks)
    assert (params.hidden, params.inter, params.clamp, params.alpha) == (H, N_I, 10.0, 1.0)
    assert params.w1_sf == fakes.w1_sf.data_ptr() and params.w2_sf == fakes.w2_sf.data_ptr()
    assert len(r2.args) == 7 and r2.args.signature[4][0] == type(buf.peer_table).__name__
    for node in (r1, r3):
        assert node.warmup_args is not None and node.args.signature != node.warmup_args.signature
    if partition == "off":  # ranks sharing the GPU keep full edges (one kernel of a rank resident at a time)
        monkeypatch.setattr(buf, "plan", dataclasses.replace(buf.plan, ranks_on_device=2))
        r1, r2, r3 = layer.layer_nodes(buf, y, fakes, call)
        assert (r2.deps, r3.deps, r2.programmatic, r3.programmatic) == (("role1",), ("role1", "role2"), (), ())
    other = _FakeWeights("fp8xfp4" if mma_type == "fp8xfp8" else "fp8xfp8")
    with pytest.raises(ValueError, match=f"weights: {other.mma_type} weights on a buffer of mma_type='{mma_type}'"):
        layer.layer_nodes(buf, y, other, call)
    wrong = dataclasses.replace(call, variant=dataclasses.replace(call.variant, mma_type=other.mma_type))
    with pytest.raises(ValueError, match=f"variant: the {other.mma_type} kernel on a buffer of mma_type"):
        layer.layer_nodes(buf, y, fakes, wrong)


@pytest.mark.parametrize(("partition", "reserve"), [("on", 8), ("on", 0), ("off", 8)])
def test_layer_nodes_place_role4_beside_or_before_role2(group: dist.ProcessGroup, fakes: _FakeWeights,
                                                        monkeypatch: pytest.MonkeyPatch, partition: str,
                                                        reserve: int) -> None:
    """With a shared expert: beside role2 (no edge, role2 on the compute SMs minus role4's reserve, role4's grid
    capped at it, role3 after both) when reserve_sms says so on a partitioned buffer; before role2 otherwise (on
    every compute SM; in sequence with the partition off)."""
    seen = {}

    def role4_nodes(buffer, weights, tables, num_tokens, *, deps=(), max_grid=None, **kw):  # noqa: ANN001, ANN202
        seen.update(deps=tuple(deps), max_grid=max_grid)
        return [SimpleNamespace(name="role4", deps=tuple(deps)), SimpleNamespace(name="role4_w2", deps=("role4",))]

    monkeypatch.setattr(layer.role4_shared, "role4_nodes", role4_nodes)
    monkeypatch.setattr(layer.role4_shared, "reserve_sms", lambda shape, t, sms: reserve)
    buf = _buffer(group, partition)
    call = _call(buf, 5)
    nodes = layer.layer_nodes(buf, torch.empty(5, H, dtype=torch.bfloat16), fakes, call, shared=(None, None))
    assert [n.name for n in nodes] == ["role1", "role4", "role4_w2", "role2", "role3"]
    r2, r3 = nodes[3], nodes[4]
    sms = call.model.compute_sms
    assert r3.programmatic == ("role2",)  # role4's edges, and role2's after role4, are full ones
    if partition == "off":
        assert (seen["deps"], r2.deps, r3.deps, r2.grid[0], seen["max_grid"]) == (("role1",), ("role4_w2",),
                                                                                   ("role1", "role2", "role4_w2"), sms,
                                                                                   None)
        assert r2.programmatic == ()
    elif reserve:
        assert (seen["deps"], r2.deps, r3.deps) == ((), (), ("role1", "role2", "role4_w2"))
        assert (r2.grid[0], seen["max_grid"]) == (sms - reserve, reserve)
    else:
        assert (seen["deps"], r2.deps, r3.deps, r2.grid[0], seen["max_grid"]) == ((), ("role4_w2",),
                                                                                   ("role1", "role2", "role4_w2"), sms,
                                                                                   None)


def test_call_key_separates_what_changes_the_graph(group: dist.ProcessGroup, fakes: _FakeWeights) -> None:
    buf = _buffer(group, "on")
    y, y2 = torch.empty(5, H, dtype=torch.bfloat16), torch.empty(5, H, dtype=torch.bfloat16)
    w = api.transform_weights_for_gc_moe((torch.zeros(E, 2 * N_I, H, dtype=torch.float8_e4m3fn),
                                             torch.ones(E, 2 * N_I // 128, H // 128)),
                                            (torch.zeros(E, H, N_I, dtype=torch.float8_e4m3fn),
                                             torch.ones(E, H // 128, N_I // 128)), "fp8xfp8")
    call = _call(buf, 5)
    key = layer.call_key(buf, y, *w, call)
    assert key == layer.call_key(buf, y, *w, _call(buf, 5))
    assert key != layer.call_key(buf, y2, *w, call)  # another output tensor
    assert key != layer.call_key(buf, y, *w, _call(buf, 6))  # another token count
    assert key != layer.call_key(buf, y, *w, dataclasses.replace(call, activation_clamp=None))


def test_layer_cache_builds_weight_views_once(monkeypatch: pytest.MonkeyPatch) -> None:
    built = []
    monkeypatch.setattr(role2_gemm, "Role2Weights", lambda w1, w2: built.append((w1, w2)) or object())
    cache = layer.LayerCache()
    a, b = object(), object()
    first = cache.role2_weights(a, b)
    assert cache.role2_weights(a, b) is first and len(built) == 1
    assert cache.role2_weights(b, a) is not first and len(built) == 2


# ------------------------------------------------------------------------------------------------------------------
# Partition off: the ring holds the whole pool


def test_partition_off_ring_holds_the_pool(group: dist.ProcessGroup) -> None:
    buf = _buffer(group, "off")
    assert buf.layout.ring == ring.RingCapacity.whole_pool(buf.shape)
    for t in (1, TMAX):
        model = api.ring_model(buf, t)
        assert buf.layout.ring.holds_call(model, t) and buf.layout.ring.holds_call(model, TMAX)
        assert api.ring_plan(buf, t, model).ring_blocks == model.pool_blocks


def test_partition_off_rejects_a_ring_without_the_pool(group: dist.ProcessGroup) -> None:
    shape = MoEShape(num_experts=64, num_ranks=1, hidden=H, intermediate=N_I, topk=8, capacity=512,
                     mma_type="fp8xfp8")
    small = ring.RingCapacity.for_partition(shape, 4)
    model = ring.RingModel(shape, 8, 4)
    assert not small.holds_call(model, 1)  # a 4-SM ring does not hold the blocks of even a one-token call
    buf = api.get_symm_buffer_for_gc_moe(group, num_experts=64, capacity=512, topk=8, hidden=H,
                                            intermediate=N_I, mma_type="fp8xfp8", compute_sms=4, partition="on")
    buf.plan = dataclasses.replace(buf.plan, mode="off")  # the mode changed after a partitioned buffer was sized
    with pytest.raises(ring.RingCapacityError, match="with the partition off role1 runs before role2"):
        api.ring_plan(buf, 1)


def test_role2_status_names_the_site_of_its_record(group: dist.ProcessGroup) -> None:
    """An error in role2's record (:class:`StatusRecord` ``ROLE2``) is raised with its :class:`Role2Site`'s name,
    a shared site (1-3) as well as an operator-mode one (4-8), and cleared."""
    buf = _buffer(group, "off")
    record = buf.status[StatusRecord.ROLE2]
    for code, site, error in ((2, role2_gemm.Role2Site.SOURCE, DeviceCheckError),
                              (1, role2_gemm.Role2Site.EMPTY, DeviceTimeoutError)):
        record.view(torch.int32)[:2] = torch.tensor([code, site], dtype=torch.int32)
        with pytest.raises(error, match=f"role2 grouped GEMM: {re.escape(site.description)}"):
            role2_gemm.raise_for_role2_status(buf)
        assert int(record.sum()) == 0
