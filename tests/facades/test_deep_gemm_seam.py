"""The seam from the deep_gemm facade to the native operator, on CPU: the facade buffer's workspace and its
per-compute-path alias, the weight conversion (zero-copy FP8, repacked FP4, once per weight tensor), the options
handed to the native call, and the guard shared by a workspace and its alias. The launch itself needs a GPU."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

import gc_moe_compat.deep_gemm as dg
from gc_moe_compat import config, layouts, quant
from gc_moe_compat.deep_gemm import _checks
from gc_moe_compat.deep_gemm import _seam as seam
from gc_moe_compat.operator import api
from gc_moe_compat.operator.buffer import exclusive
from gc_moe_compat.runtime.workspace import WorkspaceBusyError

H, N_I, E, K, TMAX = 512, 256, 8, 2, 32

_Pair = tuple[torch.Tensor, torch.Tensor]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("GC_MOE_PARTITION", "GC_MOE_DISPATCH_SMS", "GC_MOE_SM90_DISPATCH_SMS"):
        monkeypatch.delenv(name, raising=False)


def _sym(group: dist.ProcessGroup, **kw: object) -> dg.SymmBuffer:
    buf = dg.get_symm_buffer_for_mega_moe(group, E, TMAX, K, H, N_I, **kw)
    buf.topk_idx[:4] = torch.tensor([[0, 5], [3, -1], [7, 1], [2, 2]])
    return buf


def _fp8_canonical(seed: int = 1) -> tuple[_Pair, _Pair]:
    g = torch.Generator().manual_seed(seed)
    return (quant.quantize_fp8_blocks(torch.randn(E, 2 * N_I, H, generator=g)),
            quant.quantize_fp8_blocks(torch.randn(E, H, N_I, generator=g)))


def _fp8_deepgemm(seed: int = 1) -> tuple[_Pair, _Pair]:
    """DeepGEMM-layout FP8 pairs: what transform_weights_for_mega_moe_sm90 (and SGLang's builder) return."""
    return dg.transform_weights_for_mega_moe_sm90(*_fp8_canonical(seed))


def _fp4_canonical() -> tuple[_Pair, _Pair]:
    g = torch.Generator().manual_seed(0)
    return (quant.quantize_mxfp4(torch.randn(E, 2 * N_I, H, generator=g)),
            quant.quantize_mxfp4(torch.randn(E, H, N_I, generator=g)))


def _fp4_deepgemm() -> tuple[_Pair, _Pair]:
    """The originals' FP8xFP4 layout of the canonical pairs (packed int32 scales): what fp8_fp4_mega_moe reads."""
    return dg.transform_weights_for_mega_moe(*[(w, quant.pack_ue8m0_k32(sf)) for w, sf in _fp4_canonical()])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _same_weights(a: api.GcMoeWeights, b: api.GcMoeWeights) -> bool:
    factors = (a.factor is None and b.factor is None) or torch.equal(a.factor, b.factor)
    return ((a.mma_type, a.gemm) == (b.mma_type, b.gemm) and factors and torch.equal(_bits(a.payload), _bits(b.payload))
            and torch.equal(a.scales, b.scales))


class _Launches:
    """Records the native launches (``api._launch``) instead of running them (no GPU here)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[dict] = []
        monkeypatch.setattr(api, "_launch", self._record)

    def _record(self, fn, buffer, y, w1, w2, t, model, plan, alpha, clamp, *, fast_math=True, recv_stats=None,
                shared=None):
        self.calls.append(dict(fn=fn, buffer=buffer, y=y, w1=w1, w2=w2, t=t, alpha=alpha, clamp=clamp,
                               fast_math=fast_math, recv_stats=recv_stats, shared=shared))


# ------------------------------------------------------------------------------------------------------------------
# Workspace and its per-compute-path alias


def test_retyped_alias_shares_the_workspace(group: dist.ProcessGroup) -> None:
    sym = _sym(group)  # SGLang's Hopper buffer: mma_type='fp8xfp4', then fp8_mega_moe (FP8xFP8) on it
    primary = sym.workspace
    alias = primary.retyped("fp8xfp8")
    assert alias is not primary and alias.shape.mma_type == "fp8xfp8" and alias.alias_of is primary
    assert alias.storage is primary.storage and alias.views is primary.views and alias.x is sym.x
    assert alias.layout.regions == primary.layout.regions and alias.offsets is primary.offsets
    assert primary.retyped("fp8xfp8") is alias and alias.retyped("fp8xfp4") is primary and alias.retyped(
        "fp8xfp8") is alias
    assert seam.workspace_of(sym) is primary and seam.workspace_view(sym, "l2_acts") is primary.l2_acts
    with pytest.raises(KeyError, match="no workspace region 'nope'"):
        seam.workspace_view(sym, "nope")
    with pytest.raises(ValueError, match="mma_type: must be one of"):
        primary.retyped("nvfp4xnvfp4")
    with exclusive(primary), pytest.raises(WorkspaceBusyError), exclusive(alias):
        pass
    with exclusive(alias), pytest.raises(WorkspaceBusyError), exclusive(primary):
        pass
    primary.destroy()
    assert alias.storage is None
    with pytest.raises(ValueError, match="buffer: was destroyed"):
        primary.retyped("fp8xfp8")


def test_seam_refuses_other_buffers(group: dist.ProcessGroup) -> None:
    with pytest.raises(TypeError, match="buffer: must be a facade SymmBuffer or a GcMoeBuffer, got object"):
        seam.workspace_of(object())
    sym = _sym(group)
    sym.destroy()
    with pytest.raises(ValueError, match="buffer: was destroyed"):  # its workspace reference is gone (issue 19)
        seam.workspace_of(sym)


# ------------------------------------------------------------------------------------------------------------------
# Weight conversion


def test_fp8_weights_are_wrapped_without_copy_and_equal_the_native_transform(group: dist.ProcessGroup) -> None:
    sym = _sym(group)
    canonical = _fp8_canonical()
    l1, l2 = dg.transform_weights_for_mega_moe_sm90(*canonical)
    w1, w2 = seam.operator_weights(sym, "fp8xfp8", l1, l2)
    assert w1.payload is l1[0] and w1.scales is l1[1] and w2.payload is l2[0] and w2.scales is l2[1]
    ref1, ref2 = api.transform_weights_for_gc_moe(*canonical, mma_type="fp8xfp8")
    assert _same_weights(w1, ref1) and _same_weights(w2, ref2)
    assert seam.operator_weights(sym, "fp8xfp8", l1, l2) == (w1, w2)
    assert seam.operator_weights(sym.workspace.retyped("fp8xfp8"), "fp8xfp8", l1, l2)[0] is w1  # one cache


def test_weights_are_reconverted_after_an_in_place_update(group: dist.ProcessGroup) -> None:
    sym = _sym(group)
    l1, l2 = _fp8_deepgemm()
    w1, w2 = seam.operator_weights(sym, "fp8xfp8", l1, l2)
    l2[1].mul_(2)  # bumps that tensor's version counter
    v1, v2 = seam.operator_weights(sym, "fp8xfp8", l1, l2)
    assert v1 is w1 and v2 is not w2 and torch.equal(v2.scales, l2[1])
    copy_l1 = (l1[0].clone(), l1[1].clone())  # same values, other tensors: another entry
    assert seam.operator_weights(sym, "fp8xfp8", copy_l1, l2)[0] is not w1
    other = _sym(group)  # another workspace converts for itself
    assert seam.operator_weights(other, "fp8xfp8", l1, l2)[0] is not w1


def test_non_contiguous_fp8_weights_are_copied_once(group: dist.ProcessGroup) -> None:
    sym = _sym(group)
    l1, l2 = _fp8_deepgemm()
    strided = torch.empty(E, 2 * N_I, 2 * H, dtype=l1[0].dtype)[..., ::2]
    strided.view(torch.uint8).copy_(l1[0].view(torch.uint8))
    w1, _ = seam.operator_weights(sym, "fp8xfp8", (strided, l1[1]), l2)
    assert w1.payload.is_contiguous() and torch.equal(_bits(w1.payload), _bits(l1[0]))
    assert seam.operator_weights(sym, "fp8xfp8", (strided, l1[1]), l2)[0] is w1


def test_fp4_weights_are_read_in_the_originals_layout_and_repacked_once(group: dist.ProcessGroup) -> None:
    """The originals' layout (interleaved L1, UTCCP-ordered int32 scales) converts to exactly the native transform of
    the canonical weights; uint8 codes (no original makes them) are refused before any conversion."""
    sym = _sym(group)
    canonical = _fp4_canonical()
    l1, l2 = _fp4_deepgemm()
    w1, w2 = seam.operator_weights(sym, "fp8xfp4", l1, l2)
    ref1, ref2 = api.transform_weights_for_gc_moe(*canonical, mma_type="fp8xfp4")
    assert _same_weights(w1, ref1) and _same_weights(w2, ref2)
    assert seam.operator_weights(sym, "fp8xfp4", l1, l2) == (w1, w2)
    assert torch.equal(layouts.deinterleave_gate_up(l1[0]), canonical[0][0])
    for i, gemm in enumerate(("l1", "l2")):
        assert torch.equal(quant.unpack_ue8m0_k32(seam.canonical_pair(gemm, (l1, l2)[i])[1]), canonical[i][1])
    codes = (layouts.interleave_gate_up(canonical[0][0]), layouts.interleave_gate_up(canonical[0][1]))
    with pytest.raises(TypeError, match=r"fp8_fp4_mega_moe: l1_weights\[1\]: must be int32 .* got torch.uint8"):
        seam.operator_weights(_sym(group), "fp8xfp4", codes, canonical[1])


# ------------------------------------------------------------------------------------------------------------------
# The call


def test_fp8_mega_moe_hands_the_operator_its_options(group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    launches = _Launches(monkeypatch)
    sym = _sym(group)
    l1, l2 = _fp8_deepgemm()
    stats = torch.zeros(E, dtype=torch.int32)
    y = torch.empty(4, H, dtype=torch.bfloat16)
    dg.fp8_mega_moe(y, l1, l2, sym, cumulative_local_expert_recv_stats=stats, activation_clamp=7.0,
                    fast_math=False)
    dg.fp8_mega_moe(y, l1, l2, sym)
    first, second = launches.calls
    # T = 4 is below the per-call rule's edge: the FP8 alias's sequential twin runs it
    assert first["fn"] == "fp8_mega_moe" and first["buffer"] is sym.workspace.retyped("fp8xfp8").for_call(4)
    assert first["buffer"].partition == "off" and first["buffer"].alias_of is sym.workspace
    assert first["y"] is y and first["t"] == 4 and first["alpha"] == 1.0 and first["clamp"] == 7.0
    assert first["fast_math"] is False and first["recv_stats"] is stats
    assert first["w1"].payload is l1[0] and first["w2"].payload is l2[0]
    assert second["fast_math"] is True and second["recv_stats"] is None and second["clamp"] is None
    assert second["w1"] is first["w1"] and second["w2"] is first["w2"]  # converted once: the graph cache key holds
    with exclusive(sym.workspace), pytest.raises(WorkspaceBusyError):  # the primary's guard covers the alias
        dg.fp8_mega_moe(y, l1, l2, sym)
    assert len(launches.calls) == 2


def _counting(counts: dict[str, int], key: str, real: Callable[..., object]) -> Callable[..., object]:
    def counted(*args: object, **kwargs: object) -> object:
        counts[key] += 1
        return real(*args, **kwargs)
    return counted


def test_a_facade_call_is_validated_once(group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    """The facade's check is the call's only one: ``config.validate``, the recipe rule and the statistics check run
    once per ``fp8_mega_moe`` / ``fp8_fp4_mega_moe`` call (with weights converted before: an FP8xFP4 pair's first
    conversion validates the weights once more, in ``transform_weights_for_gc_moe``, and is cached)."""
    launches = _Launches(monkeypatch)
    checks = ((config, "validate", "validate"), (_checks, "recipe", "recipe"), (api, "recipe_of", "recipe"),
              (api, "check_recv_stats", "check_recv_stats"))
    stats = torch.zeros(E, dtype=torch.int32)
    y = torch.empty(4, H, dtype=torch.bfloat16)
    for call, mma_type, (l1, l2) in ((dg.fp8_mega_moe, "fp8xfp8", _fp8_deepgemm()),
                                     (dg.fp8_fp4_mega_moe, "fp8xfp4", _fp4_deepgemm())):
        sym = _sym(group)
        seam.operator_weights(sym, mma_type, l1, l2)
        counts = dict.fromkeys(("validate", "recipe", "check_recv_stats"), 0)
        with monkeypatch.context() as m:
            for module, name, key in checks:
                m.setattr(module, name, _counting(counts, key, getattr(module, name)))
            call(y, l1, l2, sym, cumulative_local_expert_recv_stats=stats)
        assert counts == {"validate": 1, "recipe": 1, "check_recv_stats": 1}, call.__name__
    assert [c["fn"] for c in launches.calls] == ["fp8_mega_moe", "fp8_fp4_mega_moe"]


def test_operator_seam_runs_on_a_native_buffer(group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    launches = _Launches(monkeypatch)
    buf = api.get_symm_buffer_for_gc_moe(group, E, TMAX, K, H, N_I, "fp8xfp8", compute_sms=64)
    buf.topk_idx.fill_(-1)
    l1, l2 = _fp8_deepgemm()
    kw = dict(shared_l1_weights=None, shared_l2_weights=None, cumulative_local_expert_recv_stats=None,
              activation_clamp=None, fast_math=True)
    seam.mega_moe("fp8xfp8", torch.empty(2, H, dtype=torch.bfloat16), l1, l2, buf, **kw)
    assert launches.calls[0]["buffer"] is buf.for_call(2) and launches.calls[0]["t"] == 2
    with pytest.raises(ValueError, match="mma_type: must be one of"):
        seam.mega_moe("fp8xfp16", torch.empty(2, H, dtype=torch.bfloat16), l1, l2, buf, **kw)


def test_native_fp8_call_checks_its_new_options(group: dist.ProcessGroup) -> None:
    buf = api.get_symm_buffer_for_gc_moe(group, E, TMAX, K, H, N_I, "fp8xfp8", compute_sms=64)
    buf.topk_idx.fill_(-1)
    w1, w2 = api.transform_weights_for_gc_moe(*_fp8_canonical(), mma_type="fp8xfp8")
    y = torch.empty(2, H, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="fp8_fp8_gc_moe: fast_math must be a bool"):
        api.fp8_fp8_gc_moe(y, w1, w2, buf, fast_math=1)
    with pytest.raises(TypeError, match="fp8_fp8_gc_moe: cumulative_local_expert_recv_stats: must be an int32"):
        api.fp8_fp8_gc_moe(y, w1, w2, buf, cumulative_local_expert_recv_stats=torch.zeros(E))
    with pytest.raises(ValueError, match="fp8_fp8_gc_moe: cumulative_local_expert_recv_stats: must be a contiguous "
                                         "int32 tensor \\[8\\]"):
        api.fp8_fp8_gc_moe(y, w1, w2, buf, cumulative_local_expert_recv_stats=torch.zeros(2 * E, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="lives in host memory"):  # valid options reach the launch
        api.fp8_fp8_gc_moe(y, w1, w2, buf, fast_math=False,
                              cumulative_local_expert_recv_stats=torch.zeros(E, dtype=torch.int32))


@pytest.mark.parametrize("kw", [{}, {"fast_math": False},
                                {"cumulative_local_expert_recv_stats": torch.zeros(E, dtype=torch.int32)}],
                         ids=["defaults", "fast_math", "stats"])
def test_fp8_fp4_mega_moe_reaches_the_operator(group: dist.ProcessGroup, kw: dict) -> None:
    """Every option reaches the native FP8xFP4 call, which stops on CPU at the launch."""
    sym = _sym(group)
    l1, l2 = _fp4_deepgemm()
    y = torch.empty(3, H, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="fp8_fp4_mega_moe: buffer: lives in host memory"):
        dg.fp8_fp4_mega_moe(y, l1, l2, sym, **kw)


def test_fp8_fp4_mega_moe_with_a_shared_expert(group: dist.ProcessGroup) -> None:
    """Both shared forms reach the native call with role4 (which stops on CPU at the launch): the SM90 form (E4M3, L1
    interleaved, FP32 128x128 block scales) and DeepGEMM's K32 recipe (int32 packed UE8M0 K32, UTCCP order); uint8
    K32 codes cannot be the originals' layout and raise TypeError naming it
    (tests/facades/test_deep_gemm_shared_k32.py checks the K32 conversion)."""
    l1, l2 = _fp4_deepgemm()
    y = torch.empty(3, H, dtype=torch.bfloat16)
    shared = _sym(group, num_shared_experts=1)
    codes = torch.uint8
    s1 = (torch.zeros(1, 2 * N_I, H, dtype=torch.float8_e4m3fn), torch.full((1, 2 * N_I, H // 32), 127, dtype=codes))
    s2 = (torch.zeros(1, H, N_I, dtype=torch.float8_e4m3fn), torch.full((1, H, N_I // 32), 127, dtype=codes))
    with pytest.raises(TypeError, match=r"fp8_fp4_mega_moe: shared_l1_weights\[1\] must be int32 .* UTCCP"):
        dg.fp8_fp4_mega_moe(y, l1, l2, shared, shared_l1_weights=s1, shared_l2_weights=s2)
    p1, p2 = ((s[0], quant.pack_ue8m0_k32(s[1])) for s in (s1, s2))
    for b1, b2 in ((p1, p2), ((s1[0], torch.ones(1, 2 * N_I // 128, H // 128)), (s2[0], torch.ones(1, H // 128,
                                                                                                  N_I // 128)))):
        with pytest.raises(RuntimeError, match="fp8_fp4_mega_moe: buffer: lives in host memory"):
            dg.fp8_fp4_mega_moe(y, l1, l2, shared, shared_l1_weights=b1, shared_l2_weights=b2)


# ------------------------------------------------------------------------------------------------------------------
# Staleness of the converted weights (issue 19, item 6)


_TRANSFORM = api.transform_weights_for_gc_moe  # the reference transform, not counted by _Conversions


class _Conversions:
    """Counts the FP8xFP4 repacks (``api.transform_weights_for_gc_moe``, which the seam calls per conversion)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        self._transform = api.transform_weights_for_gc_moe
        monkeypatch.setattr(api, "transform_weights_for_gc_moe", self._counted)

    def _counted(self, *args: object, **kw: object) -> tuple[api.GcMoeWeights, api.GcMoeWeights]:
        self.count += 1
        return self._transform(*args, **kw)


def _move_expert(pairs: tuple[_Pair, _Pair], src: int, dst: int) -> None:
    """EPLB's in-place update: expert ``dst``'s slices of every tensor become expert ``src``'s."""
    for pair in pairs:
        for t in pair:
            t[dst].copy_(t[src])


def _moved_reference(src: int, dst: int) -> tuple[api.GcMoeWeights, api.GcMoeWeights]:
    canonical = tuple(tuple(t.clone() for t in pair) for pair in _fp4_canonical())
    _move_expert(canonical, src, dst)  # per-expert slices: the move commutes with the interleave and the repack
    return _TRANSFORM(*canonical, mma_type="fp8xfp4")


@pytest.mark.parametrize("update_mode", ["plain", "inference_mode"])
def test_fp4_weights_updated_in_place_are_repacked_again(group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch,
                                                         update_mode: str) -> None:
    """Normal tensors moved in place (also inside inference_mode, as a serving loop runs EPLB): the next call
    repacks them and sees the new values; unchanged weights are repacked once."""
    conversions = _Conversions(monkeypatch)
    sym = _sym(group)
    l1, l2 = _fp4_deepgemm()
    w1, w2 = seam.operator_weights(sym, "fp8xfp4", l1, l2)
    for _ in range(3):
        assert seam.operator_weights(sym, "fp8xfp4", l1, l2) == (w1, w2)
    assert conversions.count == 1
    if update_mode == "inference_mode":
        with torch.inference_mode():
            _move_expert((l1, l2), 1, 0)
    else:
        _move_expert((l1, l2), 1, 0)
    v1, v2 = seam.operator_weights(sym, "fp8xfp4", l1, l2)
    assert conversions.count == 2 and v1 is not w1 and v2 is not w2
    assert not torch.equal(v1.payload, w1.payload) and not torch.equal(v2.payload, w2.payload)
    ref1, ref2 = _moved_reference(1, 0)
    assert _same_weights(v1, ref1) and _same_weights(v2, ref2)
    assert seam.operator_weights(sym, "fp8xfp4", l1, l2) == (v1, v2) and conversions.count == 2
    l2[1][3].copy_(l2[1][2])  # only L2's scales: only L2 is repacked
    u1, u2 = seam.operator_weights(sym, "fp8xfp4", l1, l2)
    assert conversions.count == 3 and u1 is v1 and u2 is not v2 and torch.equal(u2.payload, v2.payload)


def test_fp4_inference_tensors_are_refused_not_cached(group: dist.ProcessGroup,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Inference tensors have no version counter: their repacked copy could go stale unseen, so the seam refuses
    them (before converting or launching); a clone made outside inference mode is accepted and tracked."""
    conversions = _Conversions(monkeypatch)
    sym = _sym(group)
    with torch.inference_mode():
        l1, l2 = _fp4_deepgemm()
        assert l1[0].is_inference()
        for _ in range(2):  # created, then updated in place, inside inference mode: never a stale copy
            with pytest.raises(ValueError, match=r"l1_weights\[0\]: is an inference tensor .* fp8xfp4 conversion, "
                                                 r"a repacked copy, would silently go stale"):
                seam.operator_weights(sym, "fp8xfp4", l1, l2)
            _move_expert((l1, l2), 1, 0)
    assert conversions.count == 0 and not seam._weight_caches.get(sym.workspace)
    y = torch.empty(3, H, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"l1_weights\[0\]: is an inference tensor"):  # before the launch's check
        dg.fp8_fp4_mega_moe(y, l1, l2, sym)
    normal_l1 = tuple(t.clone() for t in l1)  # the fix the message names: a clone outside inference mode
    with pytest.raises(ValueError, match=r"l2_weights\[0\]: is an inference tensor"):
        seam.operator_weights(sym, "fp8xfp4", normal_l1, l2)
    normal_l2 = tuple(t.clone() for t in l2)
    w1, w2 = seam.operator_weights(sym, "fp8xfp4", normal_l1, normal_l2)
    ref1, ref2 = _moved_reference(1, 0)
    assert conversions.count == 1 and _same_weights(w1, ref1) and _same_weights(w2, ref2)
    with torch.inference_mode():
        _move_expert((normal_l1, normal_l2), 2, 0)
    assert seam.operator_weights(sym, "fp8xfp4", normal_l1, normal_l2)[0] is not w1 and conversions.count == 2


def test_fp8_inference_tensors_stay_zero_copy_and_cannot_go_stale(group: dist.ProcessGroup) -> None:
    """Contiguous FP8xFP8 weights alias the caller's tensors, inference tensors included: an in-place update is in
    the operator's weights at once. A non-contiguous inference tensor would be copied: refused."""
    sym = _sym(group)
    with torch.inference_mode():
        l1, l2 = _fp8_deepgemm()
        w1, w2 = seam.operator_weights(sym, "fp8xfp8", l1, l2)
        assert w1.payload is l1[0] and w1.scales is l1[1] and w2.payload is l2[0] and w2.scales is l2[1]
        l2[1].mul_(2)
        l1[0][0].copy_(l1[0][1])
        v1, v2 = seam.operator_weights(sym, "fp8xfp8", l1, l2)
        assert v1.payload is l1[0] and v2.scales is l2[1] and torch.equal(_bits(v1.payload[0]), _bits(l1[0][1]))
        strided = torch.empty(E, 2 * N_I, 2 * H, dtype=l1[0].dtype)[..., ::2]
        strided.view(torch.uint8).copy_(l1[0].view(torch.uint8))
        with pytest.raises(ValueError, match=r"l1_weights\[0\]: is an inference tensor .* fp8xfp8 conversion, a "
                                             r"contiguous copy"):
            seam.operator_weights(sym, "fp8xfp8", (strided, l1[1]), l2)
        assert seam.operator_weights(sym, "fp8xfp8", (strided.clone(), l1[1]), l2)[0].payload.is_inference()
