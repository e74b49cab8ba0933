"""The pre-dispatch kernel on the host: its generated parameter struct, its build, the torch model of the originals'
arithmetic (:func:`gc_moe_compat.quant.quantize_fp8_pre_dispatch`) and the checks that run before any launch."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch
from ctypes_layout import natural_layout_size
from nvcc_mark import needs_nvcc

import gc_moe_compat.deep_gemm as dg
from gc_moe_compat import quant
from gc_moe_compat.deep_gemm import _predispatch
from gc_moe_compat.runtime import jit

KERNELS_DIR = Path(__file__).resolve().parents[2] / "kernels"


def test_params_header_is_generated_from_the_ctypes_struct() -> None:
    header = (KERNELS_DIR / "sm90" / "predispatch_params.cuh").read_text()
    assert "// BEGIN GENERATED\n" + _predispatch.params_header() + "// END GENERATED" in header
    assert '#include "sm90/predispatch_params.cuh"' in (KERNELS_DIR / _predispatch.SOURCE).read_text()
    assert ctypes.sizeof(_predispatch.PreDispatchParams) == natural_layout_size(_predispatch.PreDispatchParams)


@needs_nvcc
def test_kernels_build_without_spills(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both entry points build for sm_90a with no stack frame or spills and fit 1024 threads per CTA."""
    monkeypatch.setenv("GC_MOE_CACHE_DIR", str(tmp_path))
    resources = jit.compile_cubin(_predispatch.SOURCE).resources
    assert set(resources) == set(_predispatch.KERNELS.values())
    for name, r in resources.items():
        assert (r.stack_bytes, r.spill_stores, r.spill_loads) == (0, 0, 0), name
        assert r.registers <= 64, name


def test_fp32_recipe_is_a_reciprocal_multiply() -> None:
    """Scales equal the FP32 group recipe; the payload is ``x * (1 / s)``, which differs from ``x / s`` in the last
    bit of some products, so some E4M3 codes differ (the originals' kernel multiplies)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(256, 1024, generator=g) * 37.0).bfloat16()
    q, s = quant.quantize_fp8_pre_dispatch(x, "fp32x128")
    q_div, s_div = quant.quantize_fp8_groups(x, 128, scale_format="fp32")
    assert torch.equal(s, s_div)
    inv = torch.ones_like(s) / s
    want = quant.to_e4m3(x.float().reshape(256, 8, 128) * inv.unsqueeze(-1)).reshape(256, 1024)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))
    assert (q.view(torch.uint8) != q_div.view(torch.uint8)).any(), "no product rounded differently: weak inputs"


def test_ue8m0_recipe_floors_amax_at_1e_4() -> None:
    """A zero group and a group of 1e-9 both get the exponent of 1e-4 / 448 rounded up; a group of 448 gets 2^0."""
    x = torch.zeros(3, 32)
    x[1] = 1e-9
    x[2, 0] = 448.0
    q, codes = quant.quantize_fp8_pre_dispatch(x.bfloat16(), "ue8m0x32")
    floor_code = 127 + (torch.tensor(1e-4) / 448).log2().ceil().int().item()
    assert codes[:, 0].tolist() == [floor_code, floor_code, 127]
    assert q[2, 0].item() == 448.0 and (q[0].float() == 0).all()


def test_host_path_widens_the_ids_and_fills_the_padding() -> None:
    x = torch.randn(2, 256).bfloat16()
    idx = torch.tensor([[2**31 - 1, -1], [0, 5]], dtype=torch.int32)
    w = torch.rand(2, 2)
    bx, bsf = torch.zeros(6, 256, dtype=torch.float8_e4m3fn), torch.zeros(6, 2)
    bidx, bw = torch.full((6, 2), 9, dtype=torch.int64), torch.full((6, 2), 9.0)
    dg.mega_moe_pre_dispatch_sm90(x, idx, w, bx, bsf, bidx, bw, num_tokens=2, routed_scaling_factor=0.5)
    assert bidx.tolist() == [[2**31 - 1, -1], [0, 5], [-1, -1], [-1, -1], [-1, -1], [-1, -1]]
    assert torch.equal(bw[:2], w * 0.5) and (bw[2:] == 0).all()


@pytest.mark.parametrize("fn", ["mega_moe_pre_dispatch_sm90", "mega_moe_pre_dispatch"])
@pytest.mark.parametrize(("case", "error", "match"), [
    ("int64 topk_idx", TypeError, r"topk_idx must have dtype in \['torch.int32'\], got torch.int64"),
    ("int32 buf_topk_idx", TypeError, r"buf_topk_idx must have dtype in \['torch.int64'\], got torch.int32"),
    ("num_tokens below x's rows", ValueError, r"num_tokens must equal x's rows .* got num_tokens=3, x of shape "
                                              r"\(4, 256\)"),
    ("topk_idx rows", ValueError, r"topk_idx must have shape \(4, 2\), got \(5, 2\)"),
    ("topk_weights rows", ValueError, r"topk_weights must have shape \(4, 2\), got \(3, 2\)"),
])
def test_the_pins_routing_rules(fn: str, case: str, error: type, match: str) -> None:
    """sgl-deep-gemm's pre-dispatch asserts int32 ``topk_idx``, an int64 ``buf_topk_idx``, ``num_tokens == x.size(0)``
    and the routing's rows equal to x's: each violation is refused before anything is written."""
    x = torch.randn(4, 256).bfloat16()
    idx = torch.zeros(5 if case == "topk_idx rows" else 4, 2,
                      dtype=torch.int64 if case == "int64 topk_idx" else torch.int32)
    w = torch.rand(3 if case == "topk_weights rows" else 4, 2)
    sm90 = fn == "mega_moe_pre_dispatch_sm90"
    views = (torch.zeros(8, 256, dtype=torch.float8_e4m3fn),
             torch.zeros(8, 2) if sm90 else torch.zeros(8, 2, dtype=torch.int32),
             torch.full((8, 2), 9, dtype=torch.int32 if case == "int32 buf_topk_idx" else torch.int64),
             torch.full((8, 2), 9.0))
    before = [v.clone() for v in views]
    with pytest.raises(error, match=f"{fn}: {match}"):
        getattr(dg, fn)(x, idx, w, *views, num_tokens=3 if case.startswith("num_tokens") else 4)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(views, before, strict=True))


@pytest.mark.parametrize(("change", "error", "match"), [
    ({"hidden": 384}, ValueError, "multiple of 256"),
    ({"hidden": 8448}, ValueError, r"\(0, 8192\]"),
    ({"transpose_x": True}, ValueError, "x must be contiguous"),
    ({"sliced_view": True}, ValueError, "buf_topk_weights must be contiguous"),
])
def test_refusals_before_any_launch(change: dict, error: type, match: str) -> None:
    hidden = change.get("hidden", 256)
    x = torch.randn(4, hidden).bfloat16()
    if change.get("transpose_x"):
        x = torch.randn(hidden, 4).bfloat16().t()
    idx, w = torch.zeros(4, 2, dtype=torch.int32), torch.rand(4, 2)
    bw = torch.zeros(8, 4)[:, ::2] if change.get("sliced_view") else torch.zeros(8, 2)
    views = (torch.zeros(8, hidden, dtype=torch.float8_e4m3fn), torch.zeros(8, hidden // 128),
             torch.zeros(8, 2, dtype=torch.int64), bw)
    before = [v.clone() for v in views]
    with pytest.raises(error, match=match):
        dg.mega_moe_pre_dispatch_sm90(x, idx, w, *views, num_tokens=4)
    assert all(torch.equal(a, b) for a, b in zip(views, before, strict=True))  # nothing the caller owns changed


def _k32_views(tokens: int, hidden: int = 256) -> tuple[torch.Tensor, ...]:
    """An SM100-layout staging target: FP8 x, packed int32 UE8M0 K32 scales, int64 routing, FP32 weights."""
    return (torch.zeros(tokens, hidden, dtype=torch.float8_e4m3fn),
            torch.zeros(tokens, hidden // 128, dtype=torch.int32), torch.full((tokens, 2), 9, dtype=torch.int64),
            torch.full((tokens, 2), 9.0))


def test_dev_branch_use_fp4_acts_spelling() -> None:
    """sgl-project/DeepGEMM dev's ``use_fp4_acts=False`` by keyword stages exactly what the pin's default
    ``mma_type`` does; ``True`` is FP4 activations (NotImplementedError); a non-bool or a positional bool in the
    pin's ``mma_type`` place is a TypeError naming the spellings; nothing is written by a refused call."""
    x = torch.randn(3, 256).bfloat16()
    idx, w = torch.tensor([[0, 1], [2, -1], [3, 3]], dtype=torch.int32), torch.rand(3, 2)
    pin, dev = _k32_views(4), _k32_views(4)
    dg.mega_moe_pre_dispatch(x, idx, w, *pin, num_tokens=3)
    dg.mega_moe_pre_dispatch(x, idx, w, *dev, num_tokens=3, use_fp4_acts=False)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(pin, dev, strict=True))
    for kwargs, error, match in (({"use_fp4_acts": True}, NotImplementedError, "use_fp4_acts=True stages FP4"),
                                 ({"use_fp4_acts": 1}, TypeError, "use_fp4_acts must be a bool"),
                                 ({"mma_type": False}, TypeError, "use_fp4_acts=False")):
        views = _k32_views(4)
        with pytest.raises(error, match=match):
            dg.mega_moe_pre_dispatch(x, idx, w, *views, num_tokens=3, **kwargs)
        assert views[2].eq(9).all() and views[3].eq(9.0).all()
