"""The record of dropped inputs on the host (gc_moe_compat/runtime/dropped.py): its generated kernel header, how a
recorded drop is raised and cleared, and the torch model of the pre-dispatch's drop rule. The kernels that write it
are tested on the GPU (tests/facades/test_predispatch_kernel.py, tests/operator/test_role1_dropped_gpu.py)."""

from __future__ import annotations

import ctypes
import struct
from pathlib import Path

import pytest
import torch

from gc_moe_compat.deep_gemm import _predispatch
from gc_moe_compat.runtime import dropped
from gc_moe_compat.runtime.status import STATUS_MISMATCH, DeviceCheckError, KernelStatus

KERNELS_DIR = Path(__file__).resolve().parents[2] / "kernels"


def test_header_is_generated_from_the_site_enum() -> None:
    text = (KERNELS_DIR / "common" / "dropped.cuh").read_text()
    assert "// BEGIN GENERATED\n" + dropped.header_block() + "// END GENERATED" in text
    for source in ("sm90/predispatch.cu", "sm90/role1_dispatch.cu"):
        assert '#include "common/dropped.cuh"' in (KERNELS_DIR / source).read_text(), source


def _write(record: dropped.DroppedRecord, site: int, observed: int, expected: int) -> None:
    raw = bytes(KernelStatus(STATUS_MISMATCH, site, observed, expected, 0))
    record.mirror.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    record.record.copy_(record.mirror)


def test_a_recorded_drop_raises_once_naming_site_and_signed_value() -> None:
    record = dropped.DroppedRecord(torch.device("cpu"))
    assert record.record.numel() == record.mirror.numel() == ctypes.sizeof(KernelStatus)
    record.raise_if_dropped("clean")  # nothing recorded: no error
    minus_five = struct.unpack("<Q", struct.pack("<q", -5))[0]
    _write(record, dropped.DroppedSite.ROLE1_EXPERT, minus_five, 64)
    with pytest.raises(DeviceCheckError, match="fp8_fp8_gc_moe: a launch on cpu before this check dropped an invalid "
                                               "input .*role1 dispatch: .*observed -5, expected 64"):
        record.raise_if_dropped("fp8_fp8_gc_moe")
    assert not record.mirror.any() and not record.record.any()  # cleared: the next call runs
    record.raise_if_dropped("next")
    _write(record, dropped.DroppedSite.PREDISPATCH_WEIGHT, 0x7FC00000, 6)  # NaN bits: unsigned, as recorded
    with pytest.raises(DeviceCheckError, match="not finite in FP32 .*observed 2143289344, expected 6"):
        record.raise_if_dropped("mega_moe_pre_dispatch_sm90")


def test_one_record_per_device() -> None:
    cpu = dropped.dropped_record(torch.device("cpu"))
    assert dropped.dropped_record(torch.device("cpu")) is cpu
    assert cpu.record.device.type == "cpu" and cpu.record.dtype == torch.uint8


def test_torch_model_drops_what_the_kernel_drops() -> None:
    """The model of the kernel (the GPU test compares them byte for byte): ids outside [-1, id_max] and weights
    whose scaled value is not finite become (-1, 0.0); everything else is copied and scaled."""
    n, topk, hidden = 3, 4, 256
    x = torch.randn(n, hidden).bfloat16()
    idx = torch.tensor([[0, -1, 15, 16], [-2, 3, 2**32 + 5, 1], [4, 5, 6, 7]], dtype=torch.int64)
    w = torch.tensor([[0.5, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, float("nan")], [3e38, 1.0, float("inf"), 2.0]])
    views = [torch.zeros(4, hidden, dtype=torch.float8_e4m3fn), torch.zeros(4, 2), torch.zeros(4, topk,
                                                                                                 dtype=torch.int32),
             torch.zeros(4, topk)]
    _predispatch.stage_with_torch("fp32x128", x, idx, w, *views, n, 2.0, id_max=15)
    assert views[2].tolist() == [[0, -1, 15, -1], [-1, 3, -1, -1], [-1, 5, -1, 7], [-1, -1, -1, -1]]
    assert views[3].tolist() == [[1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0.0, 2.0, 0.0, 4.0],
                                 [0.0, 0.0, 0.0, 0.0]]
    _predispatch.stage_with_torch("fp32x128", x, idx, w, *views, n, 2.0)  # default: the int32 view's range
    assert views[2][:, 3].tolist() == [16, -1, 7, -1] and views[2][1, 2].item() == -1


@pytest.mark.parametrize("recipe", ["fp32x128", "ue8m0x32"])
def test_torch_model_drops_a_non_finite_token_whole(recipe: str) -> None:
    """A token whose row of x holds a NaN or Inf (issue 32 item 1): zero payload and scales, every slot (-1, 0.0),
    as the kernel stages it; the other tokens as without it. Its record names x, the row and the column."""
    n, topk, hidden = 3, 2, 256
    x = torch.randn(n, hidden).bfloat16()
    idx, w = torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.rand(n, topk)
    sf_dtype = torch.float32 if recipe == "fp32x128" else torch.int32

    def staged(tokens: torch.Tensor) -> list[torch.Tensor]:
        views = [torch.full((4, hidden), 1.0).to(torch.float8_e4m3fn), torch.ones(4, 2).to(sf_dtype),
                 torch.zeros(4, topk, dtype=torch.int64), torch.zeros(4, topk)]
        _predispatch.stage_with_torch(recipe, tokens, idx, w, *views, n, 1.0)
        return views

    clean, bad = x.clone(), x.clone()
    bad[1, 200] = float("nan")
    want, got = staged(clean), staged(bad)
    assert (got[0][1].view(torch.uint8) == 0).all() and (got[1][1] == 0).all()
    assert got[2][1].tolist() == [-1, -1] and got[3][1].tolist() == [0.0, 0.0]
    keep = [0, 2, 3]  # the other tokens and a padding row
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a[keep].view(torch.uint8), b[keep].view(torch.uint8))
    record = dropped.DroppedRecord(torch.device("cpu"))
    _write(record, dropped.DroppedSite.PREDISPATCH_X, 1, 200)
    with pytest.raises(DeviceCheckError, match="mega_moe_pre_dispatch_sm90: .*pre-dispatch: a row of x .*NaN or Inf"
                                               ".*observed 1, expected 200"):
        record.raise_if_dropped("mega_moe_pre_dispatch_sm90")
