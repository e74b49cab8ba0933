"""Native GC-MoE API on CPU: buffer (gloo, one rank), partition mode, weight transform, call validation, seam."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

import gc_moe_compat.deep_gemm as dg
from gc_moe_compat import layouts, quant
from gc_moe_compat.deep_gemm import _seam as seam
from gc_moe_compat.operator import api, ring
from gc_moe_compat.operator.buffer import exclusive
from gc_moe_compat.operator.workspace import REGION_NAMES
from gc_moe_compat.runtime.split import PartitionError, partition_mode
from gc_moe_compat.runtime.workspace import WorkspaceBusyError

H, N_I, E, K, TMAX = 512, 256, 8, 2, 32


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("GC_MOE_PARTITION", "GC_MOE_DISPATCH_SMS", "GC_MOE_SM90_DISPATCH_SMS"):
        monkeypatch.delenv(name, raising=False)


def _buffer(group: dist.ProcessGroup, **kw: object) -> api.GcMoeBuffer:
    args = dict(num_experts=E, capacity=TMAX, topk=K, hidden=H, intermediate=N_I, compute_sms=64)
    args.update(kw)
    return api.get_symm_buffer_for_gc_moe(group, **args)


_Pair = tuple[torch.Tensor, torch.Tensor]


def _fp4_pairs(e: int = E, seed: int = 0) -> tuple[_Pair, _Pair]:
    g = torch.Generator().manual_seed(seed)
    l1 = quant.quantize_mxfp4(torch.randn(e, 2 * N_I, H, generator=g))
    l2 = quant.quantize_mxfp4(torch.randn(e, H, N_I, generator=g))
    return l1, l2


def _fp8_pairs(e: int = E) -> tuple[_Pair, _Pair]:
    g = torch.Generator().manual_seed(1)
    return (quant.quantize_fp8_blocks(torch.randn(e, 2 * N_I, H, generator=g)),
            quant.quantize_fp8_blocks(torch.randn(e, H, N_I, generator=g)))


def _stage(buf: api.GcMoeBuffer, t: int) -> None:
    buf.x[:t] = torch.randn(t, H).to(torch.float8_e4m3fn)
    buf.x_sf[:t] = 1.0
    buf.topk_idx[:t] = torch.stack([torch.randperm(E)[:K] for _ in range(t)])
    buf.topk_weights[:t] = 0.5


# ------------------------------------------------------------------------------------------------------------------
# Partition mode


@pytest.mark.parametrize(("arg", "env", "want"), [
    (None, None, "auto"), (None, "off", "off"), (None, " on ", "on"), ("off", "on", "off"), (True, "off", "on"),
    (False, None, "off"), (None, "", "auto"), ("auto", "off", "auto"), (None, "auto", "auto"),
])
def test_partition_mode(monkeypatch: pytest.MonkeyPatch, arg: object, env: str | None, want: str) -> None:
    if env is not None:
        monkeypatch.setenv("GC_MOE_PARTITION", env)
    assert partition_mode(arg) == want


def test_partition_mode_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GC_MOE_PARTITION", "maybe")
    with pytest.raises(ValueError, match="GC_MOE_PARTITION: must be one of \\('auto', 'on', 'off'\\).*'maybe'"):
        partition_mode()
    assert partition_mode("on") == "on"  # the argument wins over a bad environment
    with pytest.raises(ValueError, match="partition: must be one of .*'ON'"):
        partition_mode("ON")
    with pytest.raises(TypeError, match="partition: must be one of .* got int"):
        partition_mode(1)


def test_partition_auto_runs_small_calls_in_sequence(group: dist.ProcessGroup) -> None:
    """``auto`` (the default): a partitioned buffer whose calls below 32 expected rows per expert (T*K/E < 32: T <=
    127 here) run on an alias with the partition off, on the same storage and guard, with a ring holding their
    blocks."""
    buf = _buffer(group, capacity=256)
    assert (buf.partition, buf.plan.sequential_max_tokens) == ("on", 127)
    assert buf.describe()["sequential_max_tokens"] == 127
    assert buf.for_call(128) is buf and buf.for_call(256) is buf
    seq = buf.for_call(1)
    assert buf.for_call(0) is seq  # an empty call fills the fewest blocks
    assert seq is buf.for_call(127) and seq is not buf and seq.alias_of is buf
    assert (seq.partition, seq.plan.sequential_max_tokens) == ("off", 0)
    assert seq.storage is buf.storage and seq.layout is buf.layout and seq.shape == buf.shape
    with exclusive(buf), pytest.raises(WorkspaceBusyError), exclusive(seq):
        pass
    for t in range(1, 128):  # every sequential call's blocks fit the ring: no refill, no live-block check
        model = api.ring_model(seq, t)
        assert buf.layout.ring.holds_call(model, t)
        assert api.ring_plan(seq, t, model).ring_blocks >= model.call_pool_blocks(t)
    assert buf.layout.ring == ring.RingCapacity.for_partition(buf.shape, 64).union(
        ring.RingCapacity.for_sequential_calls(buf.shape, 127))
    # a retyped alias keeps its own sequential alias
    fp8 = buf.retyped("fp8xfp8")
    assert fp8.for_call(1).shape.mma_type == "fp8xfp8" and fp8.for_call(1).partition == "off"
    assert fp8.for_call(1) is not seq and fp8.for_call(1).alias_of is buf


def test_partition_on_and_off_have_no_sequential_calls(group: dist.ProcessGroup) -> None:
    on, off = _buffer(group, partition="on"), _buffer(group, partition="off")
    assert on.plan.sequential_max_tokens == off.plan.sequential_max_tokens == 0
    assert on.for_call(1) is on and off.for_call(1) is off
    assert on.for_call(0) is on and off.for_call(0) is off  # T = 0 too: no rule, no alias
    assert on.layout.ring == ring.RingCapacity.for_partition(on.shape, 64)
    assert off.layout.ring == ring.RingCapacity.whole_pool(off.shape)


# ------------------------------------------------------------------------------------------------------------------
# Buffer


def test_buffer_views_and_plan(group: dist.ProcessGroup) -> None:
    buf = _buffer(group, num_shared_experts=1, dispatch_sms=6, partition="off")
    assert (buf.partition, buf.dispatch_sms, buf.compute_sms, buf.shape.capacity) == ("off", 6, 64, TMAX)
    assert set(buf.views) == set(REGION_NAMES)
    want = {"x": ((TMAX, H), torch.float8_e4m3fn), "x_sf": ((TMAX, H // 128), torch.float32),
            "topk_idx": ((TMAX, K), torch.int64), "topk_weights": ((TMAX, K), torch.float32),
            "recv_counts": ((2, 1, E), torch.int64), "combine": ((K + 1, TMAX, H), torch.bfloat16),
            "l1_acts": ((buf.layout.ring.rows, H), torch.float8_e4m3fn)}
    for name, (shape, dtype) in want.items():
        view = getattr(buf, name)
        assert (tuple(view.shape), view.dtype) == (shape, dtype), name
        assert view.data_ptr() - buf.storage.data_ptr() == buf.layout.regions[name].offset
    assert buf.view("l2_full_mask") is buf.l2_full_mask
    assert seam.workspace_view(buf, "l1_acts") is buf.l1_acts
    assert buf.storage.numel() == buf.layout.total_bytes and int(buf.storage.sum()) == 0
    assert buf.peer_table.base == buf.storage.data_ptr() and buf.peer_table.world_size == 1
    assert buf.offsets.combine == buf.layout.regions["combine"].offset
    assert buf.describe()["total_bytes"] == buf.layout.total_bytes
    assert buf.layout.ring == ring.RingCapacity.for_partition(buf.shape, 64)
    with pytest.raises(KeyError, match="no workspace region 'ring'"):
        buf.view("ring")
    buf.destroy()
    assert buf.storage is None and buf.x is None and buf.group is None
    with pytest.raises(ValueError, match="buffer: was destroyed"):
        buf.view("x")


def test_buffer_dispatch_sms_from_environment(group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GC_MOE_DISPATCH_SMS", "8")
    assert _buffer(group).dispatch_sms == 8
    assert _buffer(group, dispatch_sms=3).dispatch_sms == 3  # the argument wins
    monkeypatch.setenv("GC_MOE_DISPATCH_SMS", "100000")  # an absurd request from the environment is refused too
    with pytest.raises(ValueError, match="get_symm_buffer_for_gc_moe: GC_MOE_DISPATCH_SMS \\(the dispatch SM request, "
                                         "dispatch_sms=None\\) must be in \\[2, 1024\\] .*, got 100000"):
        _buffer(group)
    monkeypatch.setenv("GC_MOE_DISPATCH_SMS", "many")
    with pytest.raises(PartitionError, match="GC_MOE_DISPATCH_SMS must be an integer"):
        _buffer(group)


@pytest.mark.parametrize(("kw", "exc", "match"), [
    ({"dispatch_sms": 1}, ValueError, "get_symm_buffer_for_gc_moe: dispatch_sms must be in \\[2, 1024\\], got 1"),
    ({"dispatch_sms": 10**9}, ValueError, "dispatch_sms must be in \\[2, 1024\\], got 1000000000"),
    ({"dispatch_sms": 4.0}, TypeError, "dispatch_sms must be an int, got float \\(4.0\\)"),
    ({"partition": "maybe"}, ValueError, "partition: must be one of"),
    ({"compute_sms": None}, ValueError, "compute_sms: required on a host without CUDA"),
    ({"compute_sms": 0}, ValueError, "get_symm_buffer_for_gc_moe: compute_sms must be in \\[2, 1024\\], got 0"),
    ({"compute_sms": 1}, ValueError, "compute_sms must be in \\[2, 1024\\], got 1"),
    ({"compute_sms": 10**7}, ValueError, "compute_sms must be in \\[2, 1024\\], got 10000000"),
    ({"compute_sms": 65}, ValueError, "compute_sms must be even .*, got 65"),
    ({"compute_sms": "64"}, TypeError, "compute_sms must be an int, got str \\('64'\\)"),
    ({"hidden": 384}, ValueError, "hidden: must be a multiple of 256"),
    ({"capacity": 0}, ValueError, "capacity: must be in"),
    ({"mma_type": "fp4xfp4"}, ValueError, "mma_type: must be one of"),
    ({"num_shared_experts": 2}, ValueError, "num_shared_experts: must be in \\[0, 1\\]"),
    ({"topk_idx_dtype": torch.float32}, TypeError, "topk_idx_dtype"),
])
def test_buffer_argument_errors(group: dist.ProcessGroup, kw: dict, exc: type, match: str) -> None:
    if "compute_sms" in kw and kw["compute_sms"] is None and torch.cuda.is_available():
        pytest.skip("a CUDA host reads the SM count from the device")
    with pytest.raises(exc, match=match):
        _buffer(group, **kw)


def test_buffer_group_type() -> None:
    with pytest.raises(TypeError, match="group: must be a torch.distributed ProcessGroup"):
        api.get_symm_buffer_for_gc_moe(None, E, TMAX, K, H, N_I, compute_sms=64)


def test_exclusive_rejects_overlap(group: dist.ProcessGroup) -> None:
    buf = _buffer(group)
    with exclusive(buf):
        with pytest.raises(WorkspaceBusyError, match="buffer: is in use by another call"), exclusive(buf):
            pass
        other = _buffer(group)
        with exclusive(other):  # another buffer is another workspace
            pass
    with exclusive(buf):  # released
        pass


# ------------------------------------------------------------------------------------------------------------------
# Weights


def test_transform_fp8xfp4_interleaves_and_window_repacks() -> None:
    (w1, s1), (w2, s2) = _fp4_pairs()
    t1, t2 = api.transform_weights_for_gc_moe((w1, s1), (w2, s2), mma_type="fp8xfp4")
    assert (t1.gemm, t2.gemm, t1.mma_type) == ("l1", "l2", "fp8xfp4")
    assert t1.payload.shape == w1.shape and t1.scales.shape == s1.shape and t1.factor.shape == (E,)
    # exact: the transformed weights stand for the interleaved originals wherever the window did not clip
    want = layouts.interleave_gate_up(quant.dequantize_mxfp4(w1, s1))
    got = layouts.window_dequantize(layouts.WindowRepackedMXFP4(t1.payload, t1.scales, t1.factor,
                                                                torch.zeros(E, dtype=torch.int32),
                                                                torch.zeros_like(t1.scales, dtype=torch.bool)))
    rep = layouts.window_repack_mxfp4(layouts.interleave_gate_up(w1), layouts.interleave_gate_up(s1))
    inside = ~rep.clipped.repeat_interleave(32, dim=-1)
    assert torch.equal(got[inside], want[inside])
    assert torch.equal(t2.payload, layouts.window_repack_mxfp4(w2, s2).packed)
    # the packed-int32 scale form gives the same result
    p1 = api.transform_weights_for_gc_moe((w1, quant.pack_ue8m0_k32(s1)), (w2, quant.pack_ue8m0_k32(s2)))
    assert torch.equal(p1[0].payload, t1.payload) and torch.equal(p1[1].scales, t2.scales)


def test_transform_fp8xfp4_in_expert_chunks_equals_one_repack() -> None:
    """The repack runs a few experts at a time (bounded temporaries); the window is per expert, so 19 experts with
    K32 exponents spread over 16 steps (clipped groups included) give exactly the whole-tensor repack."""
    g = torch.Generator().manual_seed(4)
    spread = torch.exp2(-torch.randint(0, 16, (19, 2 * N_I, H // 32), generator=g).float())
    w = torch.randn(19, 2 * N_I, H, generator=g) * spread.repeat_interleave(32, -1)
    (p1, s1), (p2, s2) = quant.quantize_mxfp4(w, 32), quant.quantize_mxfp4(w[:, :H, :N_I], 32)
    t1, t2 = api.transform_weights_for_gc_moe((p1, s1), (p2, s2), mma_type="fp8xfp4")
    whole = layouts.window_repack_mxfp4(layouts.interleave_gate_up(p1), layouts.interleave_gate_up(s1))
    assert bool(whole.clipped.any())
    assert torch.equal(t1.payload, whole.packed) and torch.equal(t1.scales, whole.rel_exp)
    assert torch.equal(t1.factor, whole.factor) and torch.equal(t2.factor, layouts.window_repack_mxfp4(p2, s2).factor)


def test_transform_fp8xfp8_interleaves_l1_payload_only() -> None:
    (w1, s1), (w2, s2) = _fp8_pairs()
    t1, t2 = api.transform_weights_for_gc_moe((w1, s1), (w2, s2), mma_type="fp8xfp8")
    assert torch.equal(t1.payload.view(torch.uint8), layouts.interleave_gate_up(w1).view(torch.uint8))
    assert torch.equal(t1.scales, s1) and t1.factor is None
    assert torch.equal(t2.payload.view(torch.uint8), w2.view(torch.uint8)) and torch.equal(t2.scales, s2)


def test_transform_errors() -> None:
    l1, l2 = _fp4_pairs()
    with pytest.raises(ValueError, match="mma_type: must be one of"):
        api.transform_weights_for_gc_moe(l1, l2, mma_type="bf16")
    with pytest.raises(TypeError, match="l2_weights: must be a \\(weights, scales\\) pair"):
        api.transform_weights_for_gc_moe(l1, l2[0])
    with pytest.raises(ValueError, match="l1_weights\\[0\\]: must be \\[e, 2I, K'\\]"):
        api.transform_weights_for_gc_moe((l1[0][0], l1[1]), l2)
    with pytest.raises(ValueError, match="l2_weights\\[0\\]: must be of shape"):
        api.transform_weights_for_gc_moe(l1, (l2[0][:, :, :-1], l2[1]))
    with pytest.raises(TypeError, match="l1_weights\\[1\\]: must be of dtype"):
        api.transform_weights_for_gc_moe((l1[0], l1[1].float()), l2)
    with pytest.raises(ValueError, match="intermediate: must be a multiple of 128"):
        api.transform_weights_for_gc_moe((l1[0][:, :64], l1[1][:, :64]), l2)


# ------------------------------------------------------------------------------------------------------------------
# Calls


@pytest.mark.parametrize("mma_type", ["fp8xfp4", "fp8xfp8"])
@pytest.mark.parametrize("shared", [0, 1])
def test_call_validates_then_reaches_the_launch(group: dist.ProcessGroup, mma_type: str, shared: int) -> None:
    buf = _buffer(group, mma_type=mma_type, num_shared_experts=shared)
    _stage(buf, 5)
    pairs = _fp4_pairs() if mma_type == "fp8xfp4" else _fp8_pairs()
    w1, w2 = api.transform_weights_for_gc_moe(*pairs, mma_type=mma_type)
    call = api.fp8_fp4_gc_moe if mma_type == "fp8xfp4" else api.fp8_fp8_gc_moe
    kw = {}
    if shared:
        g = torch.Generator().manual_seed(2)
        kw = dict(shared_l1_weights=quant.quantize_fp8_blocks(torch.randn(1, 2 * N_I, H, generator=g)),
                  shared_l2_weights=quant.quantize_fp8_blocks(torch.randn(1, H, N_I, generator=g)))
    y = torch.empty(5, H, dtype=torch.bfloat16)
    # every role exists for both weight formats, with and without a shared expert (role4): validation passes and
    # the call reaches the launch, which needs the GPU
    with pytest.raises(RuntimeError, match=f"{call.__name__}: buffer: lives in host memory.*needs the GPU"):
        call(y, w1, w2, buf, **kw)
    with exclusive(buf), pytest.raises(WorkspaceBusyError):
        call(y, w1, w2, buf, **kw)


def _call_args(group: dist.ProcessGroup, compute_sms: int = 64, partition: str = "auto") -> dict:
    buf = _buffer(group, compute_sms=compute_sms, partition=partition)
    _stage(buf, 4)
    w1, w2 = api.transform_weights_for_gc_moe(*_fp4_pairs())
    return dict(y=torch.empty(4, H, dtype=torch.bfloat16), w1=w1, w2=w2, buffer=buf)


@pytest.mark.parametrize(("kw", "exc", "match"), [
    ({"recipe": (128, 128, 128)}, ValueError, "recipe must be \\(1, 1, 32\\), got \\(128, 128, 128\\)"),
    ({"recipe": None}, TypeError, "recipe must be a tuple of ints \\(1, 1, 32\\), got NoneType"),
    ({"activation": 1}, TypeError, "activation: must be 'swiglu' \\(a str\\), got int"),
    ({"activation": "gelu"}, ValueError, "activation: must be 'swiglu'"),
    ({"activation_alpha": float("nan")}, ValueError, "activation_alpha must be a finite number"),
    ({"activation_clamp": 0.0}, ValueError, "activation_clamp must be a finite positive"),
    ({"activation_clamp": "10"}, TypeError, "activation_clamp must be a float"),
    ({"check_values": 1}, TypeError, "check_values must be a bool, got int \\(1\\)"),
    ({"check_values": None}, TypeError, "check_values must be a bool, got NoneType \\(None\\)"),
    ({"fast_math": "x"}, TypeError, "fast_math must be a bool, got str \\('x'\\)"),
    ({"y": torch.empty(4, H)}, TypeError, "y: must be of dtype"),
    ({"y": torch.empty(TMAX + 1, H, dtype=torch.bfloat16)}, ValueError,
     "y.shape\\[0\\] \\(tokens T\\): must be <= capacity=32"),
    ({"y": torch.empty(4)}, ValueError, "y: must be a 2-D .* got shape \\(4,\\)"),
    ({"y": None}, TypeError, "y: must be a 2-D bfloat16 tensor \\[T, H\\], got NoneType"),
    ({"buffer": object()}, TypeError, "buffer: must come from get_symm_buffer_for_gc_moe"),
    ({"w1": (torch.zeros(1), torch.zeros(1))}, TypeError, "w1: must come from transform_weights_for_gc_moe"),
    ({"shared_l1_weights": (torch.zeros(1), torch.zeros(1))}, ValueError, "shared_l1_weights/shared_l2_weights"),
])
def test_call_argument_errors(group: dist.ProcessGroup, kw: dict, exc: type, match: str) -> None:
    args = _call_args(group)
    args.update(kw)
    with pytest.raises(exc, match=f"fp8_fp4_gc_moe: {match}"):
        api.fp8_fp4_gc_moe(**args)


def test_call_weight_and_buffer_mismatches(group: dist.ProcessGroup) -> None:
    args = _call_args(group)
    w8 = api.transform_weights_for_gc_moe(*_fp8_pairs(), mma_type="fp8xfp8")
    with pytest.raises(ValueError, match="w1: must be the 'l1' weights of mma_type='fp8xfp4'"):
        api.fp8_fp4_gc_moe(**{**args, "w1": w8[0]})
    with pytest.raises(ValueError, match="w2: must be the 'l2' weights .* got the 'l1'"):
        api.fp8_fp4_gc_moe(**{**args, "w2": args["w1"]})
    with pytest.raises(ValueError, match="fp8_fp8_gc_moe: buffer: must be created with mma_type='fp8xfp8'"):
        api.fp8_fp8_gc_moe(args["y"], *w8, args["buffer"])
    other = api.transform_weights_for_gc_moe(*_fp4_pairs(e=E // 2))
    with pytest.raises(ValueError, match="w1.factor: must be float32 \\[8\\]"):
        api.fp8_fp4_gc_moe(**{**args, "w1": other[0]})
    args["buffer"].topk_idx[0, 0] = E
    with pytest.raises(ValueError, match="fp8_fp4_gc_moe: topk_idx: must be in \\[-1, 8\\)"):
        api.fp8_fp4_gc_moe(**args)
    with pytest.raises(RuntimeError, match="fp8_fp4_gc_moe: buffer: lives in host memory"):  # past the checks
        api.fp8_fp4_gc_moe(**args, check_values=False)
    with pytest.raises(TypeError, match="fp8_fp4_gc_moe: check_values must be a bool, got NoneType"):
        api.fp8_fp4_gc_moe(**args, check_values=None)  # None used to skip the range check and reach the launch
    args["buffer"].destroy()
    with pytest.raises(ValueError, match="fp8_fp4_gc_moe: buffer: was destroyed"):
        api.fp8_fp4_gc_moe(**args)


def test_call_raises_on_undersized_ring(group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    args = _call_args(group, compute_sms=4, partition="on")  # ring sized for a 4-SM compute partition
    buf = args["buffer"]
    monkeypatch.setattr(type(buf), "current_compute_sms", lambda self: 1024)  # the launch would get more SMs
    with pytest.raises(ring.RingCapacityError, match="1024-SM compute partition"):
        api.fp8_fp4_gc_moe(**args)
    with exclusive(buf):  # the guard was released by the failed call
        pass


def test_ring_plan_uses_block_m_heuristic(group: dist.ProcessGroup) -> None:
    buf = _buffer(group)
    for t, want_bm in ((1, 8), (TMAX, 16)):
        plan = api.ring_plan(buf, t)
        assert plan.block_m == want_bm == dg.get_block_m_for_mega_moe(1, E, TMAX, t, K)
        assert plan.ring_blocks >= ring.RingModel(buf.shape, want_bm, 64).required_ring_blocks


def test_concurrent_calls_serialize(group: dist.ProcessGroup) -> None:
    """Two threads on one buffer: the one that finds it held gets WorkspaceBusyError, never a shared workspace."""
    args = _call_args(group)
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with exclusive(args["buffer"]):
            holding.set()
            release.wait(10)

    th = threading.Thread(target=hold)
    th.start()
    try:
        assert holding.wait(10)
        with pytest.raises(WorkspaceBusyError):
            api.fp8_fp4_gc_moe(**args)
    finally:
        release.set()
        th.join()
    with pytest.raises(RuntimeError, match="lives in host memory"):  # released: the call reaches the launch
        api.fp8_fp4_gc_moe(**args)
