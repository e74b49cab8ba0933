"""Role3 (SM90 finalize) host side, no GPU: the kernel builds without spills, its headers are the generated C
declarations of the by-value structs and status enums, parameters pack the buffer, arguments are validated, the grid
rule."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ctypes_layout import natural_layout_size
from nvcc_mark import needs_nvcc

from gc_moe_compat import config
from gc_moe_compat.operator import api
from gc_moe_compat.operator.buffer import get_symm_buffer_for_gc_moe
from gc_moe_compat.operator.sm90 import role3_finalize
from gc_moe_compat.operator.sm90.role3_finalize import BOOK_WARPS, CHUNK, THREADS, FinalizeParams
from gc_moe_compat.operator.workspace import StatusRecord, WorkspaceOffsets
from gc_moe_compat.runtime import jit
from gc_moe_compat.runtime.status import DeviceCheckError, DeviceTimeoutError

TEST_SOURCE = "testing/finalize_test.cu"
E, K, H, TMAX = 8, 2, 512, 16


def _buffer(group: dist.ProcessGroup, **kw: object) -> api.GcMoeBuffer:
    args = dict(num_experts=E, capacity=TMAX, topk=K, hidden=H, intermediate=256, mma_type="fp8xfp8",
                dispatch_sms=6, partition="off", compute_sms=64)
    args.update(kw)
    return get_symm_buffer_for_gc_moe(group, **args)


def test_role3_offsets_header_is_the_generated_declaration() -> None:
    header = (jit.kernels_root() / "common" / "workspace_offsets.cuh").read_text()
    assert WorkspaceOffsets.c_declaration() in header, "regenerate kernels/common/workspace_offsets.cuh"
    assert StatusRecord.c_declaration() in header, "regenerate kernels/common/workspace_offsets.cuh"


def test_role3_params_header_is_generated_from_the_ctypes_struct() -> None:
    """The block between the markers is :func:`role3_finalize.params_header`, and the kernel includes the header."""
    header = (jit.kernels_root() / "sm90" / "role3_finalize_params.cuh").read_text()
    assert "// BEGIN GENERATED\n" + role3_finalize.params_header() + "// END GENERATED" in header
    assert '#include "sm90/role3_finalize_params.cuh"' in (jit.kernels_root() / role3_finalize.SOURCE).read_text()


def test_role3_params_struct_layout() -> None:
    """Every field at its natural C offset, no hidden padding (the static_assert in the header pins the size)."""
    assert ctypes.sizeof(FinalizeParams) == natural_layout_size(FinalizeParams) == 64
    assert [getattr(FinalizeParams, n).offset for n in ("y", "recv_stats", "timeout_ns", "num_tokens", "flags")] == [
        0, 8, 16, 24, 56]


@needs_nvcc
def test_role3_compiles_for_sm90a_without_spills(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Role3 and its GPU-test stand-ins build for sm_90a: no stack frame, no spills, two 384-thread role3 CTAs fit an
    SM's registers (``CTAS_PER_SM``, the grid's bound per SM)."""
    monkeypatch.setenv("GC_MOE_CACHE_DIR", str(tmp_path))
    res = jit.compile_cubin(role3_finalize.SOURCE).resources
    assert set(res) == {role3_finalize.KERNEL}
    r = res[role3_finalize.KERNEL]
    print(f"{role3_finalize.KERNEL}: {r}")
    assert (r.stack_bytes, r.spill_stores, r.spill_loads) == (0, 0, 0)
    assert r.registers * THREADS * role3_finalize.CTAS_PER_SM <= 65536
    stand_ins = jit.compile_cubin(TEST_SOURCE).resources
    assert set(stand_ins) == {"ft_stand_in", "ft_scatter_rows", "ft_delay"}
    assert all((s.stack_bytes, s.spill_stores, s.spill_loads) == (0, 0, 0) for s in stand_ins.values()), stand_ins


@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
def test_role3_args_pack_the_buffer(group: dist.ProcessGroup, idx_dtype: torch.dtype,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GC_MOE_SPIN_TIMEOUT_MS", "250")
    buf = _buffer(group, num_shared_experts=1, topk_idx_dtype=idx_dtype)
    y = torch.empty(5, H, dtype=torch.bfloat16)
    stats = torch.zeros(E, dtype=torch.int32)
    p = role3_finalize.finalize_params(buf, y, recv_stats=stats)
    assert (p.y, p.recv_stats, p.timeout_ns) == (y.data_ptr(), stats.data_ptr(), 250_000_000)
    assert (p.num_tokens, p.topk, p.num_shared, p.hidden, p.num_experts, p.num_local_experts) == (5, K, 1, H, E, E)
    assert (p.dispatch_sms, p.idx_bytes, p.flags) == (6, idx_dtype.itemsize, 0)
    p = role3_finalize.finalize_params(buf, y, timeout_ms=3, dispatch_sms=9, warmup=True)
    assert (p.recv_stats, p.timeout_ns, p.dispatch_sms, p.flags) == (0, 3_000_000, 9, role3_finalize.WARMUP)
    args = role3_finalize.finalize_args(buf, y)
    sig = args.signature
    assert [name for name, _ in sig] == ["PeerTable", "WorkspaceOffsets", "FinalizeParams"]
    assert sig[0][1] == bytes(buf.peer_table) and sig[1][1] == bytes(buf.offsets) and len(sig[2][1]) == 64


def test_role3_params_reject_bad_arguments(group: dist.ProcessGroup) -> None:
    buf = _buffer(group)
    good = torch.empty(TMAX, H, dtype=torch.bfloat16)
    bad_y = {
        "must be a bfloat16 tensor": [good.float(), good[:, :256], good[0], "y"],
        r"must be <= capacity=16": [torch.empty(TMAX + 1, H, dtype=torch.bfloat16)],
        "must be contiguous": [torch.empty(H, TMAX, dtype=torch.bfloat16).t()],
        "must be 16-byte aligned": [torch.empty(4 * H + 1, dtype=torch.bfloat16)[1:].view(4, H)],
    }
    for message, ys in bad_y.items():
        for y in ys:
            with pytest.raises(ValueError, match=f"y.*{message}"):
                role3_finalize.finalize_params(buf, y)
    for stats in (torch.zeros(E, dtype=torch.int64), torch.zeros(E + 1, dtype=torch.int32), [0] * E):
        with pytest.raises(ValueError, match=r"recv_stats: must be a contiguous int32 tensor \[8\]"):
            role3_finalize.finalize_params(buf, good, recv_stats=stats)
    for dispatch in (0, True, 2.0):
        with pytest.raises(ValueError, match="dispatch_sms: must be an int >= 1"):
            role3_finalize.finalize_params(buf, good, dispatch_sms=dispatch)
    with pytest.raises(ValueError, match="spin timeout must be positive"):
        role3_finalize.finalize_params(buf, good, timeout_ms=0)
    with pytest.raises(ValueError, match="max_ctas: must be an int >= 1"):
        role3_finalize.finalize_node(buf, good, max_ctas=0)
    buf.peer_table.world_size = 2
    with pytest.raises(ValueError, match="buffer.peer_table: holds 2 ranks, the shape has P=1"):
        role3_finalize.finalize_params(buf, good)
    buf.destroy()
    with pytest.raises(ValueError, match="buffer: was destroyed"):
        role3_finalize.finalize_params(buf, good)


def test_role3_grid_rule() -> None:
    per_cta = THREADS // 32
    assert role3_finalize.finalize_grid(0, 7168, 132) == 1  # bookkeeping runs even without tokens
    assert role3_finalize.finalize_grid(1, 7168, 132) == -(-(7168 // CHUNK + BOOK_WARPS) // per_cta) == 3
    assert role3_finalize.finalize_grid(1, CHUNK, 132) == 1  # 1 combine warp + 4 bookkeeping warps
    assert role3_finalize.finalize_grid(2, CHUNK * 4, 132) == 1 and role3_finalize.finalize_grid(2, CHUNK * 5, 132) == 2
    # two CTAs an SM: up to twice the compute SMs
    assert role3_finalize.finalize_grid(4096, 7168, 132) == 264 and role3_finalize.finalize_grid(4096, 7168, 1) == 2
    assert config.HIDDEN_ALIGN % CHUNK == 0  # every valid H is whole combine units


def test_role3_status_sites_name_the_rank_or_expert(group: dist.ProcessGroup) -> None:
    sites = role3_finalize.finalize_sites(3, 2)
    assert sites[1 << 16 | 1].startswith("role3 receive-count arrival check of local expert 1")
    assert sites[2 << 16 | 2] == "role3 combine waiting for rank 2's combine readiness"
    assert sites[3 << 16 | 0] == "role3 combine readiness of rank 0 past this replay"
    assert len(sites) == 2 + 2 * 3
    buf = _buffer(group)
    role3_finalize.raise_for_finalize_status(buf)  # zero record: nothing to raise
    record = buf.status[StatusRecord.ROLE3]
    record.view(torch.int32)[:2] = torch.tensor([1, 2 << 16 | 0], dtype=torch.int32)
    record.view(torch.int64)[1:3] = torch.tensor([3, 4])
    with pytest.raises(DeviceTimeoutError, match="waiting for rank 0's combine readiness: observed 3, expected 4"):
        role3_finalize.raise_for_finalize_status(buf)
    assert int(record.sum()) == 0  # cleared before raising
    record.view(torch.int32)[:2] = torch.tensor([2, 1 << 16 | 5], dtype=torch.int32)
    with pytest.raises(DeviceCheckError, match="x: role3 receive-count arrival check of local expert 5"):
        role3_finalize.raise_for_finalize_status(buf, "x")
