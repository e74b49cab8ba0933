"""The host paths give the same bits under a caller's torch defaults as under torch's own (issue 18, first bullet).

:mod:`test_allocations_name_device_and_dtype` checks the source; this checks the behaviour. Each case runs once
under torch's defaults and once under ``torch.set_default_device('meta')`` + ``torch.set_default_dtype(float64)``
(restored afterwards), on the same CPU inputs, and the two results must be bit-identical tensors of the same device
(the inputs'), dtype, shape and strides. ``meta`` makes a leak loud: a tensor that followed the default device has no
data (a comparison or ``.tolist()`` of it fails), one that followed the default dtype is float64. Cached tables are
rebuilt under the caller's defaults; importing the package under them is checked in a fresh interpreter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
import sys
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import gc_moe_compat.deep_gemm as dg
from gc_moe_compat import layouts, quant
from gc_moe_compat.comm import ep_ll
from gc_moe_compat.operator import api, ring
from gc_moe_compat.operator.sm90 import fp4_layout, role1_dispatch
from gc_moe_compat.runtime.status import new_status

CALLER_DEVICE, CALLER_DTYPE = "meta", torch.float64
H, N_I, E = 512, 256, 4


@contextlib.contextmanager
def caller_defaults() -> Iterator[None]:
    """torch's default device and dtype set as a caller might (``meta``, float64), restored on exit."""
    device, dtype = torch.get_default_device(), torch.get_default_dtype()
    torch.set_default_device(CALLER_DEVICE)
    torch.set_default_dtype(CALLER_DTYPE)
    try:
        yield
    finally:
        torch.set_default_device(None if device.type == "cpu" else device)
        torch.set_default_dtype(dtype)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("GC_MOE_PARTITION", "GC_MOE_DEEP_EP_PARTITION", "GC_MOE_DISPATCH_SMS", "GC_MOE_SM90_DISPATCH_SMS"):
        monkeypatch.delenv(name, raising=False)


def assert_same(got: object, want: object, where: str = "result") -> None:
    """``got`` equals ``want`` bit for bit: tensors by device, dtype, shape, strides and bytes; containers and
    dataclasses member by member; anything else by ``==``."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__}, want a tensor"
        assert (got.device, got.dtype, got.shape, got.stride()) == (want.device, want.dtype, want.shape,
                                                                    want.stride()), (
            f"{where}: {got.device} {got.dtype} {tuple(got.shape)} {got.stride()}, want {want.device} {want.dtype} "
            f"{tuple(want.shape)} {want.stride()}")
        assert torch.equal(got.reshape(-1).contiguous().view(torch.uint8),
                           want.reshape(-1).contiguous().view(torch.uint8)), f"{where}: the bits differ"
    elif dataclasses.is_dataclass(want):
        assert type(got) is type(want), f"{where}: {type(got).__name__}, want {type(want).__name__}"
        for field in dataclasses.fields(want):
            assert_same(getattr(got, field.name), getattr(want, field.name), f"{where}.{field.name}")
    elif isinstance(want, tuple | list):
        assert type(got) is type(want) and len(got) == len(want), f"{where}: {got!r:.80}, want {want!r:.80}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), f"{where}: keys {sorted(got)}, want {sorted(want)}"
        for key, w in want.items():
            assert_same(got[key], w, f"{where}[{key!r}]")
    else:
        assert got == want, f"{where}: {got!r}, want {want!r}"


def check_defaults_ignored(fn: Callable[[], object]) -> object:
    """Runs ``fn`` under torch's defaults and under the caller's, asserts the results are the same; returns it."""
    want = fn()
    layouts._lut_cpu.cache_clear()  # the FP4 shift table is rebuilt under the caller's defaults
    with caller_defaults():
        got = fn()
    assert_same(got, want)
    return want


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------------------------------
# quant, layouts


def _spread(shape: tuple[int, ...], steps: int, g: torch.Generator) -> torch.Tensor:
    """Normal values whose K32 groups span ``steps`` powers of two (so UE8M0 exponents and window clips vary)."""
    scale = torch.exp2(-torch.randint(0, steps, (*shape[:-1], shape[-1] // 32), generator=g).float())
    return torch.randn(shape, generator=g) * scale.repeat_interleave(32, -1)


@pytest.fixture(scope="module")
def t() -> SimpleNamespace:
    """The CPU inputs of the quant and layouts cases."""
    g = _gen(0)
    block_sf = torch.rand(E, 2 * N_I // 128, H // 128, generator=g)
    block_sf[:, N_I // 128:] = block_sf[:, :N_I // 128]  # gate and up blocks share scales: an exact interleave
    w = _spread((E, 2 * N_I, H), 14, g)
    packed, sf = quant.quantize_mxfp4(w)
    return SimpleNamespace(
        x=torch.randn(6, 256, generator=g) * 5, w=w, packed=packed, sf=sf, block_sf=block_sf,
        amax=torch.rand(6, 8, generator=g) * 1000, codes=torch.randint(0, 16, (6, 64), dtype=torch.uint8, generator=g),
        ue8m0=torch.randint(100, 150, (6, 64), dtype=torch.uint8, generator=g),
        rows_sf=torch.randint(0, 2**31, (2, 256, 4), dtype=torch.int32, generator=g),
        tokens_sf=torch.rand(37, 4, generator=g))


CASES: dict[str, Callable[[SimpleNamespace], object]] = {
    "e4m3": lambda t: (quant.to_e4m3(t.x), quant.e4m3_decode(quant.e4m3_encode(t.x))),
    "fp8_groups-fp32": lambda t: quant.dequantize_fp8_groups(*quant.quantize_fp8_groups(t.x, 128)),
    "fp8_groups-ue8m0": lambda t: quant.quantize_fp8_groups(t.x, 32, "ue8m0"),
    "fp8_pre_dispatch": lambda t: tuple(quant.quantize_fp8_pre_dispatch(t.x.to(torch.bfloat16), recipe)
                                        for recipe in quant.PRE_DISPATCH_RECIPES),
    "fp8_blocks": lambda t: (quant.quantize_fp8_blocks(t.w[:, :200, :300]),
                             quant.dequantize_fp8_blocks(*quant.quantize_fp8_blocks(t.w))),
    "ue8m0": lambda t: (quant.ue8m0_scale(t.amax, 448.0),
                        quant.ue8m0_decode(quant.ue8m0_encode(quant.ue8m0_scale(t.amax, 6.0))),
                        quant.unpack_ue8m0_k32(quant.pack_ue8m0_k32(t.ue8m0))),
    "e2m1": lambda t: (quant.e2m1_encode(t.x), quant.e2m1_decode(t.codes), quant.unpack_fp4(quant.pack_fp4(t.codes))),
    "mxfp4": lambda t: (quant.quantize_mxfp4(t.w), quant.dequantize_mxfp4(t.packed, t.sf)),
    "source_rows-default_device": lambda t: (layouts.gate_up_source_rows(2 * N_I), layouts.shared_scale_rows(37, 16)),
    "gate_up": lambda t: (layouts.interleave_gate_up(t.w), layouts.deinterleave_gate_up(t.sf)),
    "block_scales": lambda t: (layouts.collapse_row_scales(layouts.expand_block_scales(t.block_sf)),
                               layouts.interleave_gate_up_block_scales(t.block_sf)),
    "prepack_k128": lambda t: layouts.unprepack_k128(layouts.prepack_k128(t.packed)),
    "utccp": lambda t: (layouts.utccp_permute_scales(t.rows_sf), layouts.utccp_unpermute_scales(t.rows_sf)),
    "stage_shared_scales": lambda t: layouts.stage_shared_scales(t.tokens_sf, 16, 40),
    "fp4_tables": lambda t: (layouts.fp4_shift_lut(), layouts.fp4_shift_lut("cpu"),
                             layouts.fp4_to_e4m3_bits(t.sf & 15)),
    "window_repack": lambda t: (layouts.window_repack_mxfp4(t.packed, t.sf),
                                layouts.window_dequantize(layouts.window_repack_mxfp4(t.packed, t.sf)),
                                layouts.window_unrepack_mxfp4(layouts.window_repack_mxfp4(t.packed, t.sf))),
}
"""The quant and layouts cases by name: the public functions of both modules, on ``t``'s inputs."""


@pytest.mark.parametrize("name", CASES)
def test_quant_and_layouts_ignore_caller_defaults(name: str, t: SimpleNamespace) -> None:
    check_defaults_ignored(lambda: CASES[name](t))


# ------------------------------------------------------------------------------------------------------------------
# Ring, role1 arithmetic, FP4 lane units


def test_ring_tables_and_role1_rows_ignore_caller_defaults() -> None:
    plan = ring.RingPlan(16, 4, 1, 1, 2)
    g = _gen(2)
    received = [torch.randint(0, 40, (n, 3), dtype=torch.int32, generator=g) for n in (17, 0, 33)]
    per_expert = torch.tensor([17, 0, 33], dtype=torch.int64)
    counts = torch.tensor([[5, 0, 20], [12, 0, 13]], dtype=torch.int32)
    check_defaults_ignored(lambda: (ring.pool_table(per_expert, plan), ring.pool_rows(received, plan),
                                    ring.pool_rows([], plan), role1_dispatch.assign_rows(counts, plan)))


def test_fp4_lane_units_ignore_caller_defaults() -> None:
    rep = layouts.window_repack_mxfp4(*quant.quantize_mxfp4(_spread((2, 128, 512), 11, _gen(3))))
    units = fp4_layout.permute_units(rep.packed, rep.rel_exp)
    check_defaults_ignored(lambda: (fp4_layout.permute_units(rep.packed, rep.rel_exp),
                                    fp4_layout.unpermute_units(units), fp4_layout.decode_units(units)))


# ------------------------------------------------------------------------------------------------------------------
# Weight transforms


def _fp4_pairs() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    g = _gen(4)
    return quant.quantize_mxfp4(_spread((E, 2 * N_I, H), 16, g)), quant.quantize_mxfp4(_spread((E, H, N_I), 4, g))


def _fp8_pairs() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    g = _gen(5)
    return (quant.quantize_fp8_blocks(torch.randn(E, 2 * N_I, H, generator=g)),
            quant.quantize_fp8_blocks(torch.randn(E, H, N_I, generator=g)))


def test_weight_transforms_ignore_caller_defaults() -> None:
    """The native transform (both formats) and the deep_gemm facade's (per-row FP4 scales, SM90 block scales)."""
    fp4, fp8 = _fp4_pairs(), _fp8_pairs()
    (l1w, l1s), (l2w, l2s) = fp4
    l1s, l2 = quant.pack_ue8m0_k32(l1s), (l2w, quant.pack_ue8m0_k32(l2s))  # the originals' int32 scale form
    out = check_defaults_ignored(lambda: (
        api.transform_weights_for_gc_moe(*fp4, mma_type="fp8xfp4"),
        api.transform_weights_for_gc_moe(*fp8, mma_type="fp8xfp8"),
        dg.transform_weights_for_mega_moe((l1w, l1s), l2),
        dg.transform_weights_for_mega_moe((l1w[0], l1s[0]), (l2[0][0], l2[1][0])),
        dg.transform_weights_for_mega_moe_sm90(*fp8)))
    assert bool(out[0][0].scales.any())  # the window repack ran on spread exponents


# ------------------------------------------------------------------------------------------------------------------
# Buffers and the status mirror


def _buffer_state(buf: api.GcMoeBuffer) -> dict[str, object]:
    """What a workspace is, address-free: storage, every view (and its byte offset), offsets, peer table, plan."""
    base = buf.storage.data_ptr()
    table = buf.peer_table
    return {"storage": buf.storage, "views": dict(buf.views),
            "view offsets": {n: v.data_ptr() - base for n, v in buf.views.items()},
            "offsets": bytes(buf.offsets), "describe": buf.describe(),
            "peer table": (table.base == base, table.rank, table.world_size, list(table.offsets))}


def test_operator_buffer_ignores_caller_defaults(group: dist.ProcessGroup) -> None:
    def build() -> dict[str, object]:
        buf = api.get_symm_buffer_for_gc_moe(group, num_experts=8, capacity=32, topk=2, hidden=H, intermediate=N_I,
                                             num_shared_experts=1, compute_sms=64)
        return _buffer_state(buf)

    assert check_defaults_ignored(build)["storage"].device == torch.device("cpu")


def test_deep_gemm_buffer_ignores_caller_defaults(group: dist.ProcessGroup) -> None:
    def build() -> dict[str, object]:
        buf = dg.get_symm_buffer_for_mega_moe(group, num_experts=16, num_max_tokens_per_rank=40, num_topk=4,
                                              hidden=H, intermediate_hidden=N_I, num_shared_experts=1)
        attrs = ("buffer", "x", "x_sf", "topk_idx", "topk_weights", "shared_l1_acts", "shared_l1_acts_sf", "x_scales")
        return {"workspace": _buffer_state(buf.workspace), **{a: getattr(buf, a) for a in attrs},
                "l1_acts": buf.l1_acts}

    check_defaults_ignored(build)


def test_status_records_and_mirror_are_host_tensors_under_caller_defaults() -> None:
    mirror = check_defaults_ignored(lambda: (ep_ll.new_status_mirror(torch.device("cpu")), new_status("cpu")))[0]
    assert (mirror.device, mirror.dtype, tuple(mirror.shape), bool(mirror.any())) == (torch.device("cpu"),
                                                                                      torch.uint8, (4, 32), False)


def test_import_under_caller_defaults() -> None:
    """Module-level tables (``quant.E2M1_VALUES``) are host float32 whatever the defaults at import time."""
    code = (f"import torch; torch.set_default_device({CALLER_DEVICE!r}); torch.set_default_dtype({CALLER_DTYPE}); "
            "import gc_moe_compat, gc_moe_compat.deep_ep, gc_moe_compat.deep_gemm; from gc_moe_compat import quant; "
            "v = quant.E2M1_VALUES; assert (v.device.type, v.dtype) == ('cpu', torch.float32), (v.device, v.dtype); "
            "assert quant.e2m1_decode(torch.arange(16, dtype=torch.uint8, device='cpu')).tolist() == v.tolist()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
