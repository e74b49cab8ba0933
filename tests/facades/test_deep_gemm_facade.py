"""CPU behaviour of the deep_gemm facade: buffer views (of the operator workspace), pre-dispatch numerics, heuristics,
transforms, refusals, and the layer calls up to the operator launch (which needs a GPU)."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
import torch.distributed as dist

import gc_moe_compat.deep_gemm as dg
from gc_moe_compat import layouts, quant
from gc_moe_compat.deep_gemm import _runtime
from gc_moe_compat.operator import api
from gc_moe_compat.operator.heuristics import block_m_candidates

H, N_I, E, K = 512, 256, 16, 4


def _buffer(group: dist.ProcessGroup, **kw: object) -> dg.SymmBuffer:
    args = dict(num_experts=E, num_max_tokens_per_rank=40, num_topk=K, hidden=H, intermediate_hidden=N_I)
    args.update(kw)
    return dg.get_symm_buffer_for_mega_moe(group, **args)


# ------------------------------------------------------------------------------------------------------------------
# SymmBuffer


@pytest.mark.parametrize("mma_type", ["fp8xfp4", "fp8xfp8"])
@pytest.mark.parametrize("num_shared_experts", [0, 1])
def test_buffer_views(group: dist.ProcessGroup, mma_type: str, num_shared_experts: int) -> None:
    buf = _buffer(group, mma_type=mma_type, num_shared_experts=num_shared_experts)
    t = 64  # 40 rounded up to the token alignment
    assert dg._buffer.TOKEN_ALIGNMENT == 64 and buf.num_max_tokens_per_rank == t
    assert (buf.group, buf.num_experts, buf.num_topk, buf.hidden, buf.intermediate_hidden, buf.mma_type,
            buf.activation, buf.num_shared_experts) == (group, E, K, H, N_I, mma_type, "swiglu", num_shared_experts)
    want = {"x": ((t, H), torch.float8_e4m3fn, (H, 1)), "x_sf": ((t, H // 128), torch.float32, (H // 128, 1)),
            "topk_idx": ((t, K), torch.int64, (K, 1)), "topk_weights": ((t, K), torch.float32, (K, 1))}
    for name, (shape, dtype, stride) in want.items():
        view = getattr(buf, name)
        assert (tuple(view.shape), view.dtype, view.stride()) == (shape, dtype, stride), name
        start = view.data_ptr() - buf.buffer.data_ptr()
        assert start % 128 == 0 and start + view.nbytes <= buf.buffer.nbytes
        assert view is buf.workspace.views[name]  # the operator's staging region itself: no copy
    assert buf.shared_l1_acts is buf.x
    assert (buf.shared_l1_acts_sf is buf.x_sf) == bool(num_shared_experts)
    assert buf.x_scales.numel() == 0 and buf.x_scales.dtype == torch.int8
    assert isinstance(buf.workspace, api.GcMoeBuffer) and buf.workspace.shape == buf.shape
    assert buf.buffer.data_ptr() == buf.workspace.storage.data_ptr() and buf.buffer.dtype == torch.int8
    assert buf.buffer.nbytes == buf.workspace.layout.total_bytes
    assert buf.handle.buffer_ptrs == [buf.buffer.data_ptr()]
    assert int(buf.buffer.abs().sum()) == 0  # zeroed
    spans = sorted((getattr(buf, n).data_ptr(), getattr(buf, n).data_ptr() + getattr(buf, n).nbytes) for n in want)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))  # views do not overlap
    buf.destroy()
    assert buf.buffer is None and buf.handle is None and buf.group is None and buf.x is None
    assert buf.workspace is None


@pytest.mark.parametrize("num_shared_experts", [0, 1])
def test_operator_workspace_views(group: dist.ProcessGroup, num_shared_experts: int) -> None:
    buf = _buffer(group, num_shared_experts=num_shared_experts)
    for name in ("l1_acts", "l1_acts_sf", "l2_acts", "l2_acts_sf"):
        assert getattr(buf, name) is buf.workspace.views[name]
    for name in ("shared_l2_acts", "shared_l2_acts_sf"):
        if num_shared_experts:
            assert getattr(buf, name) is buf.workspace.views[name]
        else:
            assert not hasattr(buf, name)
            with pytest.raises(AttributeError, match="only with num_shared_experts=1"):
                getattr(buf, name)
    with pytest.raises(AttributeError, match="'SymmBuffer' object has no attribute 'nope'"):
        buf.nope  # noqa: B018


def test_buffer_reuses_base(group: dist.ProcessGroup) -> None:
    base = _buffer(group)
    small = dg.SymmBuffer(group, E, 8, K, H, N_I, base=base)  # aligns to base's 64 tokens: the same configuration
    assert small.workspace is base.workspace and small.x is base.x
    other = dg.SymmBuffer(group, E, 8, K, H, N_I, mma_type="fp8xfp8", base=base)  # either compute path, one workspace
    assert other.workspace is base.workspace and other.mma_type == "fp8xfp8"
    with pytest.raises(ValueError, match="base holds"):
        dg.SymmBuffer(group, E, 256, K, H, N_I, base=base)
    with pytest.raises(NotImplementedError, match="base: sharing a workspace between two configurations"):
        dg.SymmBuffer(group, E, 8, 2, H, N_I, base=base)  # smaller, but another layout
    with pytest.raises(ValueError, match="base must be a live SymmBuffer"):
        dg.SymmBuffer(group, E, 8, K, H, N_I, base=object())


@pytest.mark.parametrize(("kw", "exc", "match"), [
    ({"mma_type": "nvfp4xnvfp4"}, NotImplementedError, "mma_type='nvfp4xnvfp4'"),
    ({"mma_type": "bf16xbf16"}, NotImplementedError, "mma_type='bf16xbf16'"),
    ({"mma_type": "int8"}, ValueError, "mma_type must be one of"),
    ({"activation": "swigluoai"}, NotImplementedError, "activation='swigluoai'"),
    ({"intermediate_hidden": 200}, ValueError, "intermediate_hidden: must be a multiple of 128"),
    ({"num_topk": 0}, ValueError, "num_topk: must be in"),
    ({"num_max_tokens_per_rank": 9000}, ValueError, "num_max_tokens_per_rank must be in \\[1, 8192\\], got 9000"),
    ({"num_experts": 6, "num_topk": 4}, None, None),
    ({"use_fp8_dispatch": False}, ValueError, "use_fp8_dispatch=False contradicts"),
])
def test_buffer_argument_errors(group: dist.ProcessGroup, kw: dict, exc: type | None, match: str | None) -> None:
    if exc is None:
        _buffer(group, **kw)
        return
    with pytest.raises(exc, match=match):
        _buffer(group, **kw)


def test_use_fp8_dispatch_is_deprecated(group: dist.ProcessGroup) -> None:
    with pytest.warns(DeprecationWarning, match="use_fp8_dispatch"):
        _buffer(group, use_fp8_dispatch=True)


def test_sm90_constructor(group: dist.ProcessGroup) -> None:
    buf = dg.get_symm_buffer_for_sm90_mega_moe(group, E, 40, K, H, N_I)
    assert isinstance(buf, dg.SM90SymmBuffer) and buf.x_sf.dtype == torch.float32
    with pytest.raises(NotImplementedError, match="use_fp8_dispatch"):
        dg.get_symm_buffer_for_sm90_mega_moe(group, E, 40, K, H, N_I, use_fp8_dispatch=False)


# ------------------------------------------------------------------------------------------------------------------
# Pre-dispatch


def _inputs(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, H, generator=g) * torch.logspace(-3, 2, H)).bfloat16()
    idx = torch.randint(0, E, (n, K), generator=g, dtype=torch.int32)
    w = torch.rand(n, K, generator=g)
    return x, idx, w


@pytest.mark.parametrize("n", [0, 1, 17, 40])
def test_pre_dispatch_sm90_stages_the_originals_arithmetic(group: dist.ProcessGroup, n: int) -> None:
    """Scales ``max(amax, 1e-10) / 448`` (the FP32 recipe of quant), payload ``x * (1 / scale)`` (a reciprocal
    multiply, as the originals' kernel), ids widened, weights scaled, routing rows past ``n`` set to (-1, 0)."""
    buf = _buffer(group)
    buf.topk_idx.fill_(5)
    buf.topk_weights.fill_(7.0)
    x, idx, w = _inputs(n)
    dg.mega_moe_pre_dispatch_sm90(x, idx, w, buf.x, buf.x_sf, buf.topk_idx, buf.topk_weights, num_tokens=n,
                                  group_size=128, routed_scaling_factor=2.5)
    assert (buf.topk_idx[n:] == -1).all() and (buf.topk_weights[n:] == 0).all()
    assert (buf.x[n:].view(torch.uint8) == 0).all()
    if n == 0:
        return
    _, s = quant.quantize_fp8_groups(x[:n], 128, scale_format="fp32")
    inv = torch.ones_like(s) / s
    q = quant.to_e4m3(x[:n].float().reshape(n, H // 128, 128) * inv.unsqueeze(-1)).reshape(n, H)
    assert torch.equal(buf.x[:n].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(buf.x_sf[:n], s)
    assert torch.equal(buf.topk_idx[:n], idx.long())
    assert torch.equal(buf.topk_weights[:n], w * torch.full_like(w, 2.5))


@pytest.mark.parametrize("n", [1, 33])
def test_pre_dispatch_ue8m0_matches_quant(n: int) -> None:
    """Where every group's amax is above UE8M0's 1e-4 floor, the originals' K32 recipe is quant's power-of-two
    recipe exactly (scaling by a power of two is exact either way)."""
    t = 64
    bx, bsf = torch.zeros(t, H, dtype=torch.float8_e4m3fn), torch.zeros(t, H // 128, dtype=torch.int32)
    bidx, bw = torch.zeros(t, K, dtype=torch.int64), torch.zeros(t, K)
    x, idx, w = _inputs(n)
    dg.mega_moe_pre_dispatch(x, idx, w, bx, bsf, bidx, bw, num_tokens=n, group_size=32, mma_type="fp8xfp4")
    q, s = quant.quantize_fp8_groups(x[:n], 32, scale_format="ue8m0")
    assert torch.equal(bx[:n].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(bsf[:n], quant.pack_ue8m0_k32(quant.ue8m0_encode(s)))
    assert torch.equal(quant.ue8m0_decode(quant.unpack_ue8m0_k32(bsf[:n])), s)
    assert torch.equal(bidx[:n], idx[:n].long()) and torch.equal(bw[:n], w[:n])
    assert (bx[n:].view(torch.uint8) == 0).all() and (bidx[n:] == -1).all() and (bw[n:] == 0).all()


def test_pre_dispatch_refusals(group: dist.ProcessGroup) -> None:
    buf = _buffer(group)
    x, idx, w = _inputs(4)
    views = (buf.x, buf.x_sf, buf.topk_idx, buf.topk_weights)
    with pytest.raises(ValueError, match="group_size must be one of"):
        dg.mega_moe_pre_dispatch_sm90(x, idx, w, *views, num_tokens=4, group_size=32)
    with pytest.raises(ValueError, match="num_tokens must equal x's rows"):
        dg.mega_moe_pre_dispatch_sm90(x, idx, w, *views, num_tokens=5)
    with pytest.raises(TypeError, match="x must have dtype"):
        dg.mega_moe_pre_dispatch_sm90(x.float(), idx, w, *views, num_tokens=4)
    with pytest.raises(ValueError, match="routed_scaling_factor must be a finite"):
        dg.mega_moe_pre_dispatch_sm90(x, idx, w, *views, num_tokens=4, routed_scaling_factor=math.inf)
    with pytest.raises(ValueError, match="buf_x_sf is float32, the SM90 layout .*mega_moe_pre_dispatch_sm90"):
        dg.mega_moe_pre_dispatch(x, idx, w, *views, num_tokens=4)  # the SM90 buffer holds FP32 scales (issue 22)
    with pytest.raises(NotImplementedError, match="mma_type='mxf4xmxf4'"):
        dg.mega_moe_pre_dispatch(x, idx, w, *views, num_tokens=4, mma_type="mxf4xmxf4")
    with pytest.raises(NotImplementedError, match="buf_x_scales"):
        dg.mega_moe_pre_dispatch(x, idx, w, *views, num_tokens=4, buf_x_scales=buf.x_scales)
    # the pin's other scale groups and its per-expert weight scales (a multiply in its kernel, for every kind)
    for group_size in (16, 64, 128):
        with pytest.raises(NotImplementedError, match=f"group_size={group_size} is a DeepGEMM option"):
            dg.mega_moe_pre_dispatch(x, idx, w, *views, num_tokens=4, group_size=group_size)
    with pytest.raises(NotImplementedError, match="expert_scales=.*per-expert scaling of the staged top-k weights"):
        dg.mega_moe_pre_dispatch(x, idx, w, *views, num_tokens=4, expert_scales=torch.ones(E))


# ------------------------------------------------------------------------------------------------------------------
# The Mega MoE calls: validated, then the operator seam


def _fp8_weights(e: int = E) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    l1 = (torch.zeros(e, 2 * N_I, H, dtype=torch.float8_e4m3fn), torch.ones(e, 2 * N_I // 128, H // 128))
    l2 = (torch.zeros(e, H, N_I, dtype=torch.float8_e4m3fn), torch.ones(e, H // 128, N_I // 128))
    return l1, l2


def _fp4_weights() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    l1 = (torch.zeros(E, 2 * N_I, H // 2, dtype=torch.uint8), torch.full((E, 2 * N_I, H // 32), 127, dtype=torch.uint8))
    l2 = (torch.zeros(E, H, N_I // 2, dtype=torch.uint8), torch.full((E, H, N_I // 32), 127, dtype=torch.uint8))
    return l1, l2


def test_fp8_mega_moe_validates_then_runs_operator(group: dist.ProcessGroup) -> None:
    buf = _buffer(group)  # mma_type='fp8xfp4', as SGLang creates its Hopper buffer
    l1, l2 = _fp8_weights()
    y = torch.empty(3, H, dtype=torch.bfloat16)
    buf.topk_idx[:3] = 0
    with pytest.raises(RuntimeError, match="fp8_mega_moe: buffer: lives in host memory .* needs the GPU"):
        dg.fp8_mega_moe(y, l1, l2, buf, recipe=(128, 128, 128), activation="swiglu", activation_clamp=10.0,
                        fast_math=True)
    with pytest.raises(ValueError, match="fp8_mega_moe: sym_buffer was created with num_shared_experts=1"):
        dg.fp8_mega_moe(y, l1, l2, _buffer(group, num_shared_experts=1))
    with pytest.raises(ValueError, match="fp8_mega_moe: recipe must be \\(128, 128, 128\\), got \\(1, 1, 32\\)"):
        dg.fp8_mega_moe(y, l1, l2, buf, recipe=(1, 1, 32))
    with pytest.raises(ValueError, match="fp8_mega_moe: .*l1_weights"):
        dg.fp8_mega_moe(y, _fp8_weights(E + 1)[0], l2, buf)
    with pytest.raises(TypeError, match="fp8_mega_moe: y"):
        dg.fp8_mega_moe(y.float(), l1, l2, buf)
    for clamp in (-1.0, math.nan, -math.inf):
        with pytest.raises(ValueError, match="activation_clamp"):
            dg.fp8_mega_moe(y, l1, l2, buf, activation_clamp=clamp)
    for clamp in (0.0, math.inf):  # the pin checks activation_clamp >= 0; +inf clamps nothing
        with pytest.raises(RuntimeError, match="fp8_mega_moe: buffer: lives in host memory .* needs the GPU"):
            dg.fp8_mega_moe(y, l1, l2, buf, activation_clamp=clamp)
    with pytest.raises(ValueError, match="cumulative_local_expert_recv_stats"):
        dg.fp8_mega_moe(y, l1, l2, buf, cumulative_local_expert_recv_stats=torch.zeros(3, dtype=torch.int32))
    local = buf.workspace.shape.num_local_experts  # the pin checks numel() == E/P only: [1, E/P] serves, in place
    with pytest.raises(RuntimeError, match="fp8_mega_moe: buffer: lives in host memory .* needs the GPU"):
        dg.fp8_mega_moe(y, l1, l2, buf, cumulative_local_expert_recv_stats=torch.zeros(1, local, dtype=torch.int32))
    with pytest.raises(ValueError, match="cumulative_local_expert_recv_stats"):  # numel() differs
        dg.fp8_mega_moe(y, l1, l2, buf, cumulative_local_expert_recv_stats=torch.zeros(2, local, dtype=torch.int32))
    with pytest.raises(TypeError, match="sym_buffer"):
        dg.fp8_mega_moe(y, l1, l2, object())
    buf.destroy()
    with pytest.raises(ValueError, match="fp8_mega_moe: sym_buffer was destroyed"):
        dg.fp8_mega_moe(y, l1, l2, buf)


@pytest.mark.parametrize(("kw", "exc", "arg"), [
    ({"recipe": (1, 1, 16)}, NotImplementedError, "recipe"),
    ({"recipe": (1, 128, 128)}, ValueError, "recipe"),
    ({"use_x_scales": True}, NotImplementedError, "use_x_scales"),
    ({"l1_alphas": torch.ones(E)}, NotImplementedError, "l1_alphas"),
    ({"l2_act_scales": torch.ones(E)}, NotImplementedError, "l2_act_scales"),
    ({"weight_layout": "trtllm"}, NotImplementedError, "weight_layout"),
    ({"weight_layout": "other"}, ValueError, "weight_layout"),
    ({"post_expert_norm": True}, NotImplementedError, "post_expert_norm"),
    ({"post_expert_norm_eps": "1e-5"}, TypeError, "post_expert_norm_eps"),  # read only with the norm on, as by the pin
    ({"post_expert_norm_weight_first": 1}, TypeError, "post_expert_norm_weight_first"),
    ({"post_expert_norm_weight": [1.0]}, TypeError, "post_expert_norm_weight"),
    ({"global_num_tokens": 10_000}, ValueError, "global_num_tokens"),
    ({"global_num_tokens": 1}, ValueError, "global_num_tokens"),  # below this rank's rows (the pin: >= 0)
    ({"activation": "situ"}, NotImplementedError, "activation"),
    ({"fast_math": 1}, TypeError, "fast_math"),
])
def test_fp8_fp4_mega_moe_arguments(group: dist.ProcessGroup, kw: dict, exc: type, arg: str) -> None:
    """The facade's own refusals; what the operator does with valid arguments is
    tests/facades/test_deep_gemm_seam.py's."""
    buf = _buffer(group)
    l1, l2 = _fp4_weights()
    with pytest.raises(exc, match=f"fp8_fp4_mega_moe: .*{arg}"):
        dg.fp8_fp4_mega_moe(torch.empty(2, H, dtype=torch.bfloat16), l1, l2, buf, **kw)


def test_the_norms_options_pass_with_the_norm_off_as_with_the_pin(group: dist.ProcessGroup) -> None:
    """With ``post_expert_norm=False`` the pin reads neither its eps nor its weight order (it checks ``eps >= 0``
    only with the norm on): those calls get past the facade's own checks to the weights' (here uint8 scales, refused
    by their own rule)."""
    buf = _buffer(group)
    l1, l2 = _fp4_weights()
    for kw in ({"post_expert_norm_eps": 1e-5}, {"post_expert_norm_eps": -1.0, "post_expert_norm_weight_first": True},
               {"post_expert_norm_weight": torch.ones(H)}):
        with pytest.raises(TypeError, match=r"l1_weights\[1\]: must be int32"):
            dg.fp8_fp4_mega_moe(torch.empty(2, H, dtype=torch.bfloat16), l1, l2, buf, **kw)


def test_sm90_symm_buffer_takes_the_pins_arguments(group: dist.ProcessGroup) -> None:
    """The pin's ``SM90SymmBuffer(group, E, T, k, H, I, use_fp8_dispatch=True, activation='swiglu')``: positional
    ``use_fp8_dispatch`` binds there (not to a shared-expert count), the buffer is the facade's FP8xFP8 SymmBuffer,
    and ``get_symm_buffer_for_sm90_mega_moe`` makes one; FP8 dispatch only."""
    buf = dg.SM90SymmBuffer(group, E, 40, K, H, N_I, True, "swiglu")
    assert isinstance(buf, dg.SymmBuffer) and (buf.num_shared_experts, buf.workspace.shape.mma_type) == (0, "fp8xfp8")
    assert type(dg.get_symm_buffer_for_sm90_mega_moe(group, E, 40, K, H, N_I)) is dg.SM90SymmBuffer
    with pytest.raises(NotImplementedError, match="SM90SymmBuffer: use_fp8_dispatch=False"):
        dg.SM90SymmBuffer(group, E, 40, K, H, N_I, False)
    with pytest.raises(NotImplementedError, match="get_symm_buffer_for_sm90_mega_moe: use_fp8_dispatch=False"):
        dg.get_symm_buffer_for_sm90_mega_moe(group, E, 40, K, H, N_I, use_fp8_dispatch=False)
    with pytest.raises(TypeError, match="SM90SymmBuffer: use_fp8_dispatch must be a bool"):
        dg.SM90SymmBuffer(group, E, 40, K, H, N_I, 1)


def test_unsupported_families_raise(group: dist.ProcessGroup) -> None:
    y = torch.empty(1, H, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="nvfp4_mega_moe: GC-MoE has no NVFP4"):
        dg.nvfp4_mega_moe(y, None, None, None)
    with pytest.raises(NotImplementedError, match="bf16_mega_moe: GC-MoE has no BF16"):
        dg.bf16_mega_moe(y, None, None, None)
    with pytest.raises(NotImplementedError, match="NVFP4"):
        dg.transform_scales_for_mega_moe(None, None)


# ------------------------------------------------------------------------------------------------------------------
# Heuristic and settings


def test_block_m_heuristic() -> None:
    def bm(tokens: int, **kw: object) -> int:
        args = dict(num_ranks=8, num_experts=256, num_max_tokens_per_rank=256, num_tokens=tokens, num_topk=8)
        args.update(kw)
        return dg.get_block_m_for_mega_moe(**args)

    assert bm(0) == 8 and bm(1) == 8  # 0.25 tokens per expert
    assert bm(16) == 8  # m = 4, 4 + 2 = 6
    assert bm(32) == 16  # m = 8, 8 + 2.83
    assert bm(64) == 32  # m = 16, 20
    assert bm(128) == 64 and bm(256) == 64  # capped (fp8xfp4's role2)
    assert bm(256, mma_type="fp8xfp8") == 96 and bm(128, mma_type="fp8xfp8") == 64  # m = 64: FP8xFP8's wide block
    assert bm(1, global_num_tokens=8 * 64) == 32  # the global count decides when given
    values = [bm(t) for t in range(257)]
    assert values == sorted(values) and set(values) <= set(block_m_candidates("fp8xfp4"))
    for kw, arg in (({"num_tokens": 257}, "num_tokens"), ({"num_experts": 250}, "num_experts"),
                    ({"global_num_tokens": 8 * 256 + 1}, "global_num_tokens"), ({"num_topk": 0}, "num_topk")):
        with pytest.raises(ValueError, match=arg):
            bm(**{"tokens": kw.pop("num_tokens", 1)}, **kw)
    with pytest.raises(NotImplementedError, match="mma_type"):
        bm(1, mma_type="mxf4xmxf4")


def test_num_sms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_runtime, "_num_sms", None)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA device"):
            dg.get_num_sms()
    dg.set_num_sms(20)
    assert dg.get_num_sms() == 20
    with pytest.raises(ValueError, match="new_num_sms"):
        dg.set_num_sms(0)
    with pytest.raises(TypeError, match="new_num_sms"):
        dg.set_num_sms(2.0)


# ------------------------------------------------------------------------------------------------------------------
# Weight and scale transforms


def test_transform_weights_sm90_interleaves_l1_only() -> None:
    (l1w, l1s), l2 = _fp8_weights(2)
    l1w = torch.randn(2, 2 * N_I, H).to(torch.float8_e4m3fn)
    (w, s), l2_out = dg.transform_weights_for_mega_moe_sm90((l1w, l1s), l2)
    assert torch.equal(w.view(torch.uint8), layouts.interleave_gate_up(l1w).view(torch.uint8))
    assert s is l1s and l2_out[0] is l2[0] and l2_out[1] is l2[1]
    assert torch.equal(w[0, 8:16].view(torch.uint8), l1w[0, N_I:N_I + 8].view(torch.uint8))  # [g0..7, u0..7, ...]


@pytest.mark.parametrize(("recipe", "num_groups"), [((1, 32), 3), ((128, 32), None)])
def test_transform_sf_k32_packs_ue8m0(recipe: tuple[int, int], num_groups: int | None) -> None:
    mn, k = 256, 512
    gran_mn = recipe[0]
    shape = (-(-mn // gran_mn), k // 32) if num_groups is None else (num_groups, mn, k // 32)
    sf = torch.pow(2.0, torch.randint(-10, 10, shape).float())
    out = dg.transform_sf_into_required_layout(sf, mn=mn, k=k, recipe=recipe, num_groups=num_groups,
                                               disable_ue8m0_cast=False)
    rows = sf.repeat_interleave(gran_mn, dim=-2)
    assert out.dtype == torch.int32 and out.shape == (*shape[:-2], mn, k // 128) and out.is_contiguous()
    assert torch.equal(quant.ue8m0_decode(quant.unpack_ue8m0_k32(out)), rows)


def test_transform_sf_other_recipes() -> None:
    sf = torch.rand(2, 4, 4)
    assert torch.equal(dg.transform_sf_into_required_layout(sf, 512, 512, (128, 128), num_groups=2), sf)
    assert torch.equal(dg.transform_sf_into_required_layout(sf, 4, 512, (1, 1, 128), num_groups=2, is_sfa=True), sf)
    with pytest.raises(ValueError, match="sf must have shape"):
        dg.transform_sf_into_required_layout(sf, 512, 256, (128, 128), num_groups=2)
    with pytest.raises(ValueError, match="is_sfa must be given"):
        dg.transform_sf_into_required_layout(sf, 512, 512, (1, 128, 128), num_groups=2)
    with pytest.raises(NotImplementedError, match="psum_layout"):
        dg.transform_sf_into_required_layout(sf, 512, 512, (128, 128), num_groups=2, psum_layout=torch.zeros(1))
    with pytest.raises(NotImplementedError, match="disable_ue8m0_cast"):
        dg.transform_sf_into_required_layout(torch.ones(4, 16), 4, 512, (1, 32), disable_ue8m0_cast=True)
    with pytest.raises(ValueError, match="power"):  # a K32 scale that is not a power of two cannot become UE8M0
        dg.transform_sf_into_required_layout(torch.full((4, 16), 3.0), 4, 512, (1, 32))


# ------------------------------------------------------------------------------------------------------------------
# Forwarding


def test_forwarding_without_original_names_symbol_and_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not os.path.isdir(os.path.join(p, "deep_gemm"))])
    with pytest.raises(dg.MissingOriginalError, match=r"deep_gemm\.fp8_gemm_nt .*sgl-deep-gemm==0\.2\.3\.post2"):
        dg.fp8_gemm_nt  # noqa: B018
    assert not hasattr(dg, "get_compile_mode")  # SGLang's feature probes see "absent"
    assert getattr(dg, "set_pdl", None) is None
    with pytest.raises(AttributeError):
        dg.__wrapped__  # noqa: B018
