"""The low-latency EP kernels (kernels/sm90/ep_ll.cu) on the host: nvcc builds, the generated parameter struct, the
workspace arithmetic the kernels index with, the launch grids and the status records."""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from ctypes_layout import natural_layout_size
from hypothesis import given, settings
from hypothesis import strategies as st
from ll_launches import COMBINE, DISPATCH, Launch, record_ll_launches
from nvcc_mark import needs_nvcc

from gc_moe_compat.comm import ep_ll, ep_normal
from gc_moe_compat.comm.ep_ll import HEADER_BYTES, MAX_EXPERTS, MAX_SMS, THREADS, Kernel, LlShape
from gc_moe_compat.deep_ep import _low_latency
from gc_moe_compat.deep_ep._low_latency import LowLatencyHandle
from gc_moe_compat.runtime import jit
from gc_moe_compat.runtime.status import DeviceCheckError, DeviceTimeoutError, KernelStatus, status_codes
from gc_moe_compat.runtime.workspace import MAX_RANKS, PeerTable

KERNELS_DIR = Path(__file__).resolve().parents[2] / "kernels"
HEADER = KERNELS_DIR / "sm90" / "ep_ll_params.cuh"


@needs_nvcc
def test_ep_ll_compiles_for_sm90a_without_spills(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both entry points (C++ names, so a profiler shows ``gc_moe::ep_ll::dispatch`` / ``::combine``) build for
    sm_90a: no stack frame, no spills, two 256-thread CTAs of either fit an SM's registers
    (:data:`ep_ll.CTAS_PER_SM`), and the static shared memory stays under the 48 KiB static limit."""
    monkeypatch.setenv("GC_MOE_CACHE_DIR", str(tmp_path))
    resources = jit.compile_cubin(ep_ll.SOURCE).resources
    assert set(resources) == set(ep_ll._MANGLED.values())
    for name, res in resources.items():
        assert (res.stack_bytes, res.spill_stores, res.spill_loads) == (0, 0, 0), name
        assert res.registers * THREADS * ep_ll.CTAS_PER_SM <= 65536, name
        assert res.shared_bytes < 48 * 1024, name


def test_params_header_is_generated_from_the_ctypes_struct() -> None:
    """The block between the markers is :func:`ep_ll.params_header` (up to blank lines before the end marker)."""
    text = HEADER.read_text()
    assert text.count("// BEGIN GENERATED\n") == 1 and text.count("// END GENERATED") == 1
    block = text.split("// BEGIN GENERATED\n")[1].split("// END GENERATED")[0]
    assert block.rstrip("\n") == ep_ll.params_header().rstrip("\n")


def test_params_struct_layout() -> None:
    """Every field at its natural C offset, no hidden padding (the static_assert in the header pins the size)."""
    assert ctypes.sizeof(ep_ll.EpLlParams) == natural_layout_size(ep_ll.EpLlParams) == 232
    assert f"sizeof(EpLlParams) == {ctypes.sizeof(ep_ll.EpLlParams)}" in HEADER.read_text()


def _constants(pattern: str) -> dict[str, int]:
    return {m[0]: int(m[1]) for m in re.findall(pattern, HEADER.read_text())}


def test_header_flags_and_kernel_constants_equal_the_host() -> None:
    """The hand-written constants: the header's flag bits, the kernel file's CTA size and table bounds, and the two
    entry points in ``gc_moe::ep_ll`` whose symbols the host loads, as the host packs and names them (the sites and
    indices are generated)."""
    flags = _constants(r"constexpr unsigned int (kLl\w+) = (\d+)u;")
    assert flags == {"kLlFp8": ep_ll.FLAG_FP8, "kLlRoundScale": ep_ll.FLAG_ROUND_SCALE, "kLlUe8m0": ep_ll.FLAG_UE8M0,
                     "kLlShrink": ep_ll.FLAG_SHRINK, "kLlPhaseSend": ep_ll.PHASE_SEND,
                     "kLlPhaseRecv": ep_ll.PHASE_RECV, "kLlPhaseBoth": ep_ll.PHASE_BOTH}
    source = (KERNELS_DIR / "sm90" / "ep_ll.cu").read_text()
    assert f"constexpr u32 kThreads = {THREADS};" in source
    assert f"constexpr u32 kMaxTopk = {ep_ll.MAX_TOPK};" in source
    assert f"constexpr u32 kMaxExperts = {MAX_EXPERTS};" in source
    assert "namespace gc_moe::ep_ll {" in source
    assert {kernel.entry for kernel in Kernel} == set(ep_ll._MANGLED) == {"gc_moe::ep_ll::dispatch",
                                                                         "gc_moe::ep_ll::combine"}
    for entry, symbol in ep_ll._MANGLED.items():
        name = entry.rsplit("::", 1)[1]
        assert f"__global__ void __launch_bounds__(kThreads, {ep_ll.CTAS_PER_SM}) {name}(const PeerTable pt, " \
               "const EpLlParams p)" in source
        assert symbol == f"_ZN6gc_moe5ep_ll{len(name)}{name}ENS_9PeerTableENS_10EpLlParamsE"  # Itanium mangling


def test_one_kernel_name_per_direction_as_deepep_profiling_matches() -> None:
    """DeepEP's bench_kineto(kernel_names=('dispatch', 'combine')) wants each name in one profile line and
    ``::dispatch`` / ``::combine`` in the trace events: each direction's halves (launched together or one each) are
    one entry point, and no entry point's name holds the other direction's."""
    assert [k.entry for k in Kernel].count("gc_moe::ep_ll::dispatch") == 2
    for kernel in Kernel:
        other = "combine" if "dispatch" in kernel.entry else "dispatch"
        assert other not in kernel.entry and kernel.entry.count("::") == 2
        assert kernel.send.entry == kernel.receive.entry == kernel.entry
        assert (kernel.send.phase, kernel.receive.phase) == (ep_ll.PHASE_SEND, ep_ll.PHASE_RECV)
    assert [k.phase for k in Kernel] == [ep_ll.PHASE_SEND, ep_ll.PHASE_RECV] * 2 == [0, 1, 0, 1]
    assert ep_ll.PHASE_BOTH not in (ep_ll.PHASE_SEND, ep_ll.PHASE_RECV)


def test_packed_launches_set_each_launch_phase_and_pass_the_shared_arguments(monkeypatch: pytest.MonkeyPatch
                                                                           ) -> None:
    """Every launch of a call shape passes the same packed arguments (the peer table, then the parameters the call
    set), with its own phase and the full-device grid; a detached copy (a receive hook's) keeps the pointers it had
    when a later call sets new ones."""
    launched: list[tuple] = []
    monkeypatch.setattr(ep_ll, "kernel_of", lambda kernel: jit.Kernel(kernel.entry, "host", kernel, None))
    monkeypatch.setattr(ep_ll, "launch_packed", lambda function, grid, block, args, stream: launched.append(
        (function, grid, block, args, ep_ll.EpLlParams.from_buffer_copy(ep_ll.EpLlParams.from_address(
            ctypes.c_void_p.from_address(args + 8).value)))))
    table = PeerTable(base=0x1000, rank=0, world_size=1)
    shape = LlShape(1, 8, 8, 128, 2)
    launches = ep_ll.new_launches(table, shape, num_tokens=3, flags=0, timeout_ms=None, max_ctas=20,
                                  status_mirror=0x40)
    launches.params.x = 0x100
    hook = launches.detached()
    launches.params.x = 0x200
    for kernel in Kernel:
        launches.launch(kernel, "stream")
    hook.launch(Kernel.DISPATCH_RECV, "stream")
    assert [f for f, *_ in launched] == [*Kernel, Kernel.DISPATCH_RECV]
    assert {a for _, _, _, a, _ in launched[:4]} == {launches.args.address} != {launched[4][3]}
    for (kernel, grid, block, _, params) in launched[:4]:
        assert grid == (ep_ll.ll_grid(kernel, shape, 3, 20), 1, 1) and block == (THREADS, 1, 1)
        assert (params.phase, params.num_tokens, params.x, params.status_mirror) == (kernel.phase, 3, 0x200, 0x40)
    assert (launched[4][4].phase, launched[4][4].x, launched[4][4].status_mirror) == (1, 0x100, 0x40)
    table_arg = PeerTable.from_address(ctypes.c_void_p.from_address(launches.args.address).value)
    assert bytes(table_arg) == bytes(table) and ctypes.addressof(table_arg) != ctypes.addressof(table)


def test_fused_launches_run_both_halves_with_the_fused_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fused launch passes the packed arguments with phase PHASE_BOTH to its direction's entry point (named by
    either half), with :func:`ep_ll.fused_grid`'s grid: the full-device one (at most the rank's share) without a
    partition, the one for the partition's SMs with one; a half's launch after it sets its own phase again."""
    launched: list[tuple[str, int, int]] = []
    monkeypatch.setattr(ep_ll, "kernel_of", lambda kernel: jit.Kernel(kernel.entry, "host", kernel, None))

    def record(handle: Kernel, grid: tuple[int, int, int] | int, args: int) -> None:
        params = ep_ll.EpLlParams.from_address(ctypes.c_void_p.from_address(args + 8).value)
        launched.append((handle.entry, grid if isinstance(grid, int) else grid[0], params.phase))

    monkeypatch.setattr(ep_ll, "launch_packed", lambda function, grid, block, args, stream: record(
        function, grid, args))
    monkeypatch.setattr(ep_ll, "launch_on", lambda partition, role, kernel, grid, block, args, stream: record(
        kernel.handle, grid, args.address))
    shape = LlShape(8, 288, 128, 7168, 8)  # 36 local experts
    launches = ep_ll.new_launches(PeerTable(), shape, num_tokens=5, flags=0, timeout_ms=None,
                                  max_ctas=100)
    for kernel in Kernel:
        launches.launch_fused(kernel, "stream")
        launches.launch_fused(kernel, "stream", SimpleNamespace(dispatch_sms=20))
    launches.launch(Kernel.COMBINE_RECV, "stream")
    dispatch, combine, both = "gc_moe::ep_ll::dispatch", "gc_moe::ep_ll::combine", ep_ll.PHASE_BOTH
    # Dispatch: max(5 tokens, 36 * (100 // 36) = 72 expert CTAs) = 72, max(5, 20) = 20 on the partition; combine:
    # max(72 expert CTAs, 5 * 28 / 8 -> 18 column-unit CTAs) = 72, max(20, 18) = 20; the receive half alone: 18.
    assert launched == [(dispatch, 72, both), (dispatch, 20, both)] * 2 + \
        [(combine, 72, both), (combine, 20, both)] * 2 + [(combine, 18, ep_ll.PHASE_RECV)]


def test_every_generated_constant_is_used_by_the_kernels() -> None:
    """Each generated site kind and kernel index is one the kernel source reports or indexes with."""
    names = re.findall(r"^    (k\w+) = \d+,", ep_ll.params_header(), re.MULTILINE)
    source = (KERNELS_DIR / "sm90" / "ep_ll.cu").read_text()
    assert len(names) == len(ep_ll.LlSite) + len(Kernel)
    assert all(f"gc_moe::{name}" in source for name in names), names


def test_header_regions_do_not_overlap() -> None:
    """The fixed header: seq u64[2], arrive u64[4][2], consumed u64[2][2], ready u64[MAX_RANKS][2], four status
    records, the rank mask u32[MAX_RANKS], counts u64[MAX_EXPERTS][2], in this order without overlap."""
    regions = [(ep_ll._SEQ, 2 * 8), (ep_ll._ARRIVE, 4 * 2 * 8), (ep_ll._CONSUMED, 2 * 2 * 8),
               (ep_ll._READY, MAX_RANKS * 2 * 8), (ep_ll._STATUS, 4 * ctypes.sizeof(KernelStatus)),
               (ep_ll._MASK, MAX_RANKS * 4), (ep_ll._COUNTS, MAX_EXPERTS * 2 * 8)]
    for (start, size), (next_start, _) in zip(regions, regions[1:], strict=False):
        assert start % 8 == 0 and start + size <= next_start
    assert regions[-1][0] + regions[-1][1] == HEADER_BYTES == 18432


shapes = st.builds(
    lambda ranks, local, tmax, groups, k: LlShape(ranks, ranks * local, tmax, 128 * groups, k),
    st.integers(1, 8), st.integers(1, 32), st.integers(1, 512), st.integers(1, 64), st.integers(1, 16))


@settings(max_examples=200, deadline=None)
@given(shapes)
def test_shape_arithmetic(shape: LlShape) -> None:
    """Receive stage ``[2][E][Tmax]`` rows of ``16 + 2H`` bytes (an FP8 row and its FP32 1x128 scales fit in the
    BF16 row's bytes), then the combine stage ``[2][Tmax][k]`` BF16 rows; every row 16-byte aligned."""
    e, t, h, k = shape.num_experts, shape.max_tokens, shape.hidden, shape.topk
    assert shape.local_experts * shape.num_ranks == e
    assert shape.row_stride == 16 + 2 * h and h + 4 * (h // 128) <= 2 * h
    assert shape.recv_stage_offset == HEADER_BYTES
    assert shape.recv_stage_bytes == 2 * e * t * shape.row_stride
    assert shape.combine_stage_offset == HEADER_BYTES + shape.recv_stage_bytes
    assert shape.combine_stage_bytes == 2 * t * k * 2 * h
    assert ep_ll.required_bytes(shape) == HEADER_BYTES + 2 * e * t * (16 + 2 * h) + 4 * t * k * h
    for offset in (shape.recv_stage_offset, shape.combine_stage_offset, shape.row_stride, 2 * h):
        assert offset % 16 == 0


def test_required_bytes_example() -> None:
    """DeepSeek-V3 decode on 8 ranks: 256 experts, Tmax 128, H 7168, top-8."""
    shape = LlShape(8, 256, 128, 7168, 8)
    assert ep_ll.required_bytes(shape) == 18432 + 2 * 256 * 128 * 14352 + 2 * 128 * 8 * 14336 == 969_951_232


@settings(max_examples=200, deadline=None)
@given(shapes, st.integers(0, 512), st.integers(1, 200))
def test_ll_grid_bounds(shape: LlShape, num_tokens: int, max_ctas: int) -> None:
    """At least one CTA, at most the cap; dispatch send has a CTA per token and column part; dispatch receive and
    combine send use every CTA up to the cap, or an equal number per local expert below it; combine receive a warp
    per (token, 256 columns) (8 per CTA), up to the cap, and no CTA without work below it. At one rank (the direct
    path) the working grids go up to CTAS_PER_SM times the cap (nothing waits there): the combine's send launch,
    which reduces, with combine receive's grid, and dispatch send's where its tokens and checker exceed the cap;
    the receive launches one CTA; a working launch there has one CTA more, its checker, below that."""
    cap = max(1, min(MAX_SMS, max_ctas))
    direct = shape.num_ranks == 1
    limit = ep_ll.CTAS_PER_SM * cap if direct else cap
    parts = max(1, shape.hidden // 128 // ep_ll.MIN_PART_GROUPS)
    expected = max(1, min(limit if num_tokens + direct > cap else cap, num_tokens * parts + direct))
    assert ep_ll.ll_grid(Kernel.DISPATCH_SEND, shape, num_tokens, max_ctas) == expected
    units = num_tokens * -(-shape.hidden // 256)
    if direct:  # the direct path: the combine's send launch reduces, the receive launches return
        assert ep_ll.ll_grid(Kernel.DISPATCH_RECV, shape, num_tokens, max_ctas) == 1
        assert ep_ll.ll_grid(Kernel.COMBINE_RECV, shape, num_tokens, max_ctas) == 1
        grid = ep_ll.ll_grid(Kernel.COMBINE_SEND, shape, num_tokens, max_ctas)
        reducers = max(1, grid - 1)  # the checker is the last CTA (a lone CTA does both)
        assert 1 <= grid <= limit and (grid == limit or reducers * (THREADS // 32) >= units)
        assert reducers == 1 or (reducers - 1) * (THREADS // 32) < units
        return
    local = shape.local_experts
    for kernel in (Kernel.DISPATCH_RECV, Kernel.COMBINE_SEND):
        grid = ep_ll.ll_grid(kernel, shape, num_tokens, max_ctas)
        assert 1 <= grid <= cap
        assert grid == cap if local >= cap else (grid % local == 0 and grid + local > cap), kernel
    grid = ep_ll.ll_grid(Kernel.COMBINE_RECV, shape, num_tokens, max_ctas)
    assert 1 <= grid <= cap
    assert grid == cap or grid * (THREADS // 32) >= units
    assert grid == 1 or (grid - 1) * (THREADS // 32) < units  # no CTA without work below the cap


def test_ll_grid_examples() -> None:
    shape = LlShape(2, 256, 128, 7168, 8)
    assert ep_ll.ll_grid(Kernel.DISPATCH_SEND, shape, 16) == 112  # 56 scale groups: 7 parts a token
    assert ep_ll.ll_grid(Kernel.DISPATCH_SEND, shape, 128) == MAX_SMS
    assert ep_ll.ll_grid(Kernel.DISPATCH_SEND, shape, 0) == 1
    assert ep_ll.ll_grid(Kernel.DISPATCH_SEND, LlShape(2, 256, 128, 512, 8), 16) == 16  # 4 groups: one part
    assert ep_ll.ll_grid(Kernel.DISPATCH_RECV, shape, 128) == 128  # 128 local experts, one CTA each
    assert ep_ll.ll_grid(Kernel.DISPATCH_RECV, LlShape(4, 1024, 128, 7168, 8), 128) == MAX_SMS  # 256 local
    assert ep_ll.ll_grid(Kernel.DISPATCH_RECV, LlShape(1, 256, 128, 7168, 8), 128) == 1  # one rank: nothing to do
    assert ep_ll.ll_grid(Kernel.COMBINE_SEND, LlShape(1, 256, 128, 7168, 8), 1) == 5  # one rank: 4 reduce, 1 checks
    # One rank, T = 128: 3584 warps' worth of (token, 256 columns), two CTAs per SM: each warp sums 2 chunks, not 4.
    assert ep_ll.ll_grid(Kernel.COMBINE_SEND, LlShape(1, 256, 128, 7168, 8), 128) == 2 * MAX_SMS
    assert ep_ll.ll_grid(Kernel.COMBINE_SEND, LlShape(1, 256, 128, 7168, 8), 128, max_ctas=20) == 40
    assert ep_ll.ll_grid(Kernel.DISPATCH_SEND, LlShape(1, 256, 128, 7168, 8), 1) == 8  # 7 parts + checker
    # One rank: at T = 128 a token a CTA fits one CTA an SM; at T = 256 two CTAs an SM send a token each (not two).
    assert ep_ll.ll_grid(Kernel.DISPATCH_SEND, LlShape(1, 256, 128, 7168, 8), 128) == MAX_SMS
    assert ep_ll.ll_grid(Kernel.DISPATCH_SEND, LlShape(1, 256, 128, 7168, 8), 256) == 2 * MAX_SMS
    assert ep_ll.ll_grid(Kernel.DISPATCH_SEND, LlShape(1, 256, 128, 7168, 8), 131) == MAX_SMS
    assert ep_ll.ll_grid(Kernel.DISPATCH_SEND, LlShape(1, 256, 128, 7168, 8), 132) == 2 * MAX_SMS
    assert ep_ll.ll_grid(Kernel.DISPATCH_RECV, shape, 128, max_ctas=20) == 20
    assert ep_ll.ll_grid(Kernel.COMBINE_SEND, LlShape(8, 256, 128, 7168, 8), 1) == 128  # 32 experts * 4 CTAs
    assert ep_ll.ll_grid(Kernel.COMBINE_SEND, LlShape(8, 288, 256, 7168, 8), 1) == 108  # 36 experts * 3 CTAs
    assert ep_ll.ll_grid(Kernel.COMBINE_RECV, shape, 0) == 1
    assert ep_ll.ll_grid(Kernel.COMBINE_RECV, shape, 3) == 11  # 3 tokens * 28 column chunks = 84 warps


def _send_parts(senders: int, num_tokens: int, hidden: int) -> tuple[int, int, list[tuple[int, int]]]:
    """The kernel's split of dispatch send's CTAs (kernels/sm90/ep_ll.cu, ``send_parts``): parts a token, the token
    stride, and each part's vector range."""
    vecs = hidden // 8
    groups = vecs // 16
    parts = max(1, min(senders // max(1, num_tokens), groups // ep_ll.MIN_PART_GROUPS))
    per = -(-groups // parts)
    return parts, senders // parts, [(min(vecs, q * per * 16), min(vecs, (q + 1) * per * 16)) for q in range(parts)]


def test_min_part_groups_is_the_kernels() -> None:
    """The host's MIN_PART_GROUPS is the kernel's kMinPartGroups (one rule, sized on both sides)."""
    text = (KERNELS_DIR / ep_ll.SOURCE).read_text()
    assert f"constexpr u32 kMinPartGroups = {ep_ll.MIN_PART_GROUPS};" in text


@settings(max_examples=300, deadline=None)
@given(shapes, st.integers(0, 300), st.integers(1, 200))
def test_dispatch_send_parts_cover_every_row(shape: LlShape, num_tokens: int, max_ctas: int) -> None:
    """Whatever grid dispatch send gets (its own, or a fused one), the kernel's parts cover each token's row once in
    whole scale groups (16 vectors), each part but the last at least MIN_PART_GROUPS groups, and the token stride
    reaches every token; with its own grid below the cap every token gets the host's parts."""
    direct = shape.num_ranks == 1
    for grid in (ep_ll.ll_grid(Kernel.DISPATCH_SEND, shape, num_tokens, max_ctas),
                 ep_ll.fused_grid(Kernel.DISPATCH_SEND, shape, num_tokens, max_ctas)):
        senders = max(1, grid - 1) if direct else grid
        parts, stride, ranges = _send_parts(senders, num_tokens, shape.hidden)
        vecs = shape.hidden // 8
        covered = [v for first, end in ranges for v in range(first, end)]
        assert covered == list(range(vecs))
        assert all(first % 16 == 0 and end % 16 == 0 for first, end in ranges)
        assert all(end - first >= 16 * ep_ll.MIN_PART_GROUPS for first, end in ranges[:-1])
        assert stride >= 1 and stride * parts <= senders
    cap = max(1, min(MAX_SMS, max_ctas))
    host_parts = max(1, shape.hidden // 128 // ep_ll.MIN_PART_GROUPS)
    if num_tokens and num_tokens * host_parts + direct <= cap:
        grid = ep_ll.ll_grid(Kernel.DISPATCH_SEND, shape, num_tokens, max_ctas)
        assert _send_parts(max(1, grid - 1) if direct else grid, num_tokens, shape.hidden)[0] == host_parts


@settings(max_examples=200, deadline=None)
@given(shapes, st.integers(0, 512), st.integers(1, 200))
def test_fused_grid_is_the_larger_half_within_the_cap(shape: LlShape, num_tokens: int, max_ctas: int) -> None:
    """A direction's fused grid (named by either half) is the larger of its halves' grids, so every CTA either half
    would launch is there and the grid stays within the cap the halves' grids keep: the SMs the launch may use, every
    CTA resident at once (the kernel's receive half waits for words of its own grid); at one rank, where nothing
    waits, up to CTAS_PER_SM per SM, all resident too."""
    cap = max(1, min(MAX_SMS, max_ctas))
    for send in (Kernel.DISPATCH_SEND, Kernel.COMBINE_SEND):
        per_sm = ep_ll.CTAS_PER_SM if shape.num_ranks == 1 else 1
        halves = [ep_ll.ll_grid(k, shape, num_tokens, max_ctas) for k in (send, send.receive)]
        for kernel in (send, send.receive):
            assert ep_ll.fused_grid(kernel, shape, num_tokens, max_ctas) == max(halves) <= per_sm * cap


def test_fused_grid_examples() -> None:
    """The issue's shape at one rank (256 experts, H 7168; the direct path): a CTA per token and column part (7 a token:
    56 scale groups, 8 a part at least) for the dispatch, a warp per (token, 256 columns) for the combine, and the
    checker CTA, each within twice the SMs the launch may use; at eight ranks the larger half (the expert CTAs of the
    receive half where dispatch send has fewer tokens)."""
    one = LlShape(1, 256, 128, 7168, 8)
    assert ep_ll.fused_grid(Kernel.DISPATCH_SEND, one, 1) == 8
    assert ep_ll.fused_grid(Kernel.DISPATCH_RECV, one, 128) == MAX_SMS  # 897 token parts, capped
    assert ep_ll.fused_grid(Kernel.DISPATCH_RECV, one, 256) == 2 * MAX_SMS  # 257 CTAs' worth: two an SM
    assert ep_ll.fused_grid(Kernel.COMBINE_SEND, one, 1) == 5  # 28 column-unit warps
    assert ep_ll.fused_grid(Kernel.COMBINE_RECV, one, 128) == 2 * MAX_SMS  # 3584 column-unit warps, two CTAs an SM
    assert ep_ll.fused_grid(Kernel.DISPATCH_SEND, one, 128, max_ctas=66) == 132  # a 66-SM share, 129 > 66
    assert ep_ll.fused_grid(Kernel.COMBINE_RECV, one, 128, max_ctas=20) == 40  # a 20-SM partition
    eight = LlShape(8, 288, 128, 7168, 8)  # 36 local experts: 108 expert CTAs
    assert ep_ll.fused_grid(Kernel.DISPATCH_SEND, eight, 128) == MAX_SMS  # a CTA per token and part, capped
    assert ep_ll.fused_grid(Kernel.DISPATCH_SEND, eight, 7) == 108  # 49 send CTAs, 108 expert CTAs
    assert ep_ll.fused_grid(Kernel.COMBINE_SEND, eight, 1) == 108
    assert ep_ll.fused_grid(Kernel.COMBINE_SEND, eight, 128) == MAX_SMS  # 448 column-unit CTAs, capped


def test_make_params() -> None:
    shape = LlShape(4, 64, 32, 1024, 6)
    p = ep_ll.make_params(shape, num_tokens=17, flags=ep_ll.FLAG_FP8 | ep_ll.FLAG_UE8M0,
                          timeout_ms=250, x=0x1000, call_gen=0x2000)
    assert (p.x, p.call_gen, p.topk_weights, p.out) == (0x1000, 0x2000, 0, 0)
    assert p.timeout_ns == 250_000_000
    assert (p.off_seq, p.off_arrive, p.off_consumed, p.off_ready, p.off_status, p.off_counts) == (
        ep_ll._SEQ, ep_ll._ARRIVE, ep_ll._CONSUMED, ep_ll._READY, ep_ll._STATUS, ep_ll._COUNTS)
    assert (p.off_recv_stage, p.off_combine_stage) == (shape.recv_stage_offset, shape.combine_stage_offset)
    assert (p.num_tokens, p.topk, p.hidden, p.num_experts, p.local_experts, p.max_tokens) == (17, 6, 1024, 64, 16, 32)
    assert (p.flags, p.row_stride) == (5, 16 + 2048)


def test_check_rank_count() -> None:
    ep_ll.check_rank_count(1)
    ep_ll.check_rank_count(MAX_RANKS)
    for bad in (0, MAX_RANKS + 1):
        with pytest.raises(ValueError, match=f"group: the low-latency kernels support 1 to {MAX_RANKS} ranks"):
            ep_ll.check_rank_count(bad)


def _workspace_with(kernel: Kernel, code: int, site: int, observed: int, expected: int) -> torch.Tensor:
    workspace = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    record = KernelStatus(code=code, site=site, observed=observed, expected=expected)
    ep_ll.status_records(workspace)[kernel] = torch.frombuffer(bytearray(bytes(record)), dtype=torch.uint8)
    return workspace


def test_status_records_raise_naming_kernel_and_site_then_clear() -> None:
    clean = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    ep_ll.raise_for_mirrored_status(clean, ep_ll.status_records(clean).clone(), 2)
    ws = _workspace_with(Kernel.DISPATCH_RECV, 1, ep_ll.LlSite.COUNT << 16 | 1, 0, 7 << 32)
    with pytest.raises(DeviceTimeoutError, match=r"dispatch receive \(gc_moe::ep_ll::dispatch\).*: dispatch receive "
                                                 "waiting for rank 1's token counts"):
        ep_ll.raise_for_mirrored_status(ws, ep_ll.status_records(ws).clone(), 2)
    assert not ws.any()  # cleared, so the next call starts clean
    ws = _workspace_with(Kernel.COMBINE_RECV, 2, ep_ll.LlSite.READY_AHEAD << 16 | 0, 9, 8)
    with pytest.raises(DeviceCheckError, match=r"combine receive \(gc_moe::ep_ll::combine\).*: rank 0's combine "
                                               "readiness is past"):
        ep_ll.raise_for_mirrored_status(ws, ep_ll.status_records(ws).clone(), 2)


def test_sites_name_every_rank() -> None:
    sites = ep_ll.ll_sites(3)
    assert len(sites) == 6 * 3 + 5  # six per rank, and the five dropped-input checks
    assert "num_experts" in sites[ep_ll.LlSite.EXPERT_RANGE << 16]
    assert sites[ep_ll.LlSite.CONSUMED << 16 | 2].endswith("rank 2 has read the stage two generations back")


def test_mirrored_status_raises_once_and_clears_records_and_mirror() -> None:
    """An error the receive kernels copied into the host mirror is raised by the next call, naming the kernel, the
    site and that an earlier call recorded it; records and mirror are cleared, so the call after that is clean."""
    ws = _workspace_with(Kernel.DISPATCH_SEND, 2, ep_ll.LlSite.EXPERT_RANGE << 16, 300, 16)
    mirror = ep_ll.new_status_mirror(torch.device("cpu"))
    mirror.copy_(ep_ll.status_records(ws))
    with pytest.raises(DeviceCheckError, match=r"dispatch send \(gc_moe::ep_ll::dispatch\) \(recorded by an "
                                               r"earlier .*\): a topk_idx entry .* >= num_experts .*observed 300, "
                                               r"expected 16"):
        ep_ll.raise_for_mirrored_status(ws, mirror, 2)
    assert not ws.any() and not mirror.any()
    ep_ll.raise_for_mirrored_status(ws, mirror, 2)  # nothing left: no error


# ------------------------------------------------------------------------------------------------------------------
# The facade half (deep_ep/_low_latency.py) on the host: the checks of values the host can see (issue 19 item 7),
# the zero-copy rows, the rank mask. A workspace stand-in (device, group size, buffer, peer table: what the calls
# read) and recorded launches replace the symmetric memory and the kernels.

T_MAX, HIDDEN, EXPERTS, TOPK, TOKENS = 8, 256, 8, 4, 5


@dataclass(eq=False)
class _Workspace:
    device: torch.device
    world_size: int
    buffer: torch.Tensor
    peer_table: PeerTable
    sm_share: int = MAX_SMS


def _workspace(ranks: int = 1, zero_copy: bool = True) -> _Workspace:
    """A host workspace sized as the hint sizes it, or (``zero_copy=False``) just large enough for the calls' top-k
    without the zero-copy rows."""
    shape = LlShape(ranks, EXPERTS, T_MAX, HIDDEN, ep_ll.HINT_TOPK if zero_copy else TOPK)
    buffer = torch.zeros(ep_ll.required_bytes(shape, zero_copy), dtype=torch.uint8)
    return _Workspace(torch.device("cpu"), ranks, buffer, PeerTable())


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[Launch]:
    return record_ll_launches(monkeypatch)


def _dispatch(ws: _Workspace, topk_idx: torch.Tensor | None = None, experts: int = EXPERTS,
              shrink: bool = False) -> tuple:
    topk_idx = torch.randint(-1, EXPERTS, (TOKENS, TOPK)) if topk_idx is None else topk_idx
    x = torch.randn(TOKENS, HIDDEN).to(torch.bfloat16)
    return _low_latency.dispatch(ws, x, topk_idx, T_MAX, experts, recv_stats=None, use_fp8=False, round_scale=False,
                                 use_ue8m0=False, async_finish=False, return_recv_hook=False, shrink=shrink,
                                 num_sms=20) + (topk_idx,)


def _combine(ws: _Workspace, handle: object, topk_idx: torch.Tensor, zero_copy: bool = False) -> torch.Tensor:
    x = torch.zeros(EXPERTS // ws.world_size, ws.world_size * T_MAX, HIDDEN, dtype=torch.bfloat16)
    out, _ = _low_latency.combine(ws, x, topk_idx, torch.ones(TOKENS, TOPK), handle, out=None, zero_copy=zero_copy,
                                  async_finish=False, return_recv_hook=False, shrink=False, num_sms=20)
    return out


def test_handle_holds_deepep_contents_and_what_the_combine_needs(launches: list) -> None:
    ws = _workspace()
    _, _, handle, _, topk_idx = _dispatch(ws)
    src_info, layout_range, tmax, hidden, experts = handle
    assert (src_info.dtype, tuple(src_info.shape), layout_range.dtype, (tmax, hidden, experts)) == (
        torch.int32, (EXPERTS, T_MAX), torch.int64, (T_MAX, HIDDEN, EXPERTS))
    assert (handle.src_route.shape, handle.routing.shape, handle.routing.dtype) == (src_info.shape, (2, TOKENS, TOPK),
                                                                                     torch.int32)
    p = launches[0][1]
    assert (p.src_info, p.src_route, p.routing) == (src_info.data_ptr(), handle.src_route.data_ptr(),
                                                    handle.routing.data_ptr())
    _combine(ws, handle, topk_idx)
    p = launches[-1][1]
    assert [what for what, _ in launches] == [DISPATCH, COMBINE]
    assert (p.src_route, p.routing, p.topk_idx) == (handle.src_route.data_ptr(), handle.routing.data_ptr(),
                                                    topk_idx.data_ptr())


def test_host_visible_bad_routing_and_handles_are_refused_before_any_launch(launches: list) -> None:
    """k > experts; a handle of another Buffer, a plain tuple, a member of another dtype or rank or type: each names
    the argument, the rule and the value, and nothing is launched. As for normal mode's handle members, a member
    that is a tensor of the wrong dtype or rank is a ValueError, one that is no tensor a TypeError (combine and the
    zero-copy buffer alike). (Values of the tensors are the device's: GPU tests.)"""
    ws, other = _workspace(), _workspace()
    with pytest.raises(ValueError, match=r"topk_idx: its k .* must be <= num_experts=2, got k=4"):
        _dispatch(_workspace(), torch.zeros(TOKENS, TOPK, dtype=torch.int64), experts=2)
    assert launches == []
    _, _, handle, _, topk_idx = _dispatch(ws)
    launches.clear()
    with pytest.raises(ValueError, match="low_latency_combine: handle comes from another Buffer's"):
        _combine(other, handle, topk_idx)
    with pytest.raises(ValueError, match="get_next_low_latency_combine_buffer: handle comes from another Buffer's"):
        _low_latency.next_combine_buffer(other, handle)
    with pytest.raises(TypeError, match="handle: must be the handle low_latency_dispatch returned .* got tuple"):
        _combine(ws, tuple(handle), topk_idx)
    src_info, layout_range = handle[0], handle[1]
    for member, error, match in (
            (0, (src_info.float(), layout_range), rf"handle\[0\] \(src_info\) must be a 2-D torch.int32 tensor "
                                                  rf"\(the dispatch's\), got \[{EXPERTS}, {T_MAX}\] torch.float32"),
            (1, (src_info, layout_range.int()), r"handle\[1\] \(layout_range\) must be a 2-D torch.int64 tensor .* "
                                                r"got \[\d+, 1\] torch.int32"),
            (2, (src_info[0], layout_range), rf"handle\[0\] \(src_info\) must be a 2-D torch.int32 tensor .* got "
                                             rf"\[{T_MAX}\] torch.int32"),
            (3, (src_info.tolist(), layout_range), r"handle\[0\] \(src_info\) must be a torch.Tensor .* got list")):
        forged = LowLatencyHandle((*error, *handle[2:]), topk=TOPK, num_tokens=TOKENS, src_route=handle.src_route,
                                  routing=handle.routing, workspace=ws)
        want = TypeError if member == 3 else ValueError
        with pytest.raises(want, match=f"low_latency_combine: {match}"):
            _combine(ws, forged, topk_idx)
        with pytest.raises(want, match=f"get_next_low_latency_combine_buffer: {match}"):
            _low_latency.next_combine_buffer(ws, forged)
    assert launches == []


def test_zero_copy_rows_live_in_the_workspace(launches: list) -> None:
    """get_next_low_latency_combine_buffer is a BF16 [E/P, P*Tmax, H] view of the workspace after the combine stage;
    a zero-copy combine sends from there (its x is only checked); the hint provisions the rows, a smaller buffer is
    refused naming num_rdma_bytes."""
    ws = _workspace()
    _, _, handle, _, topk_idx = _dispatch(ws)
    rows = _low_latency.next_combine_buffer(ws, handle)
    shape = LlShape(1, EXPERTS, T_MAX, HIDDEN, TOPK)
    assert (tuple(rows.shape), rows.dtype) == ((EXPERTS, T_MAX, HIDDEN), torch.bfloat16)
    assert rows.data_ptr() == ws.buffer.data_ptr() + shape.zero_copy_offset
    assert shape.zero_copy_offset + shape.zero_copy_bytes <= ws.buffer.numel()
    _combine(ws, handle, topk_idx, zero_copy=True)
    assert launches[-1][1].x == rows.data_ptr()
    _combine(ws, handle, topk_idx)
    assert launches[-1][1].x != rows.data_ptr()
    small = _workspace(zero_copy=False)
    _, _, handle, _, topk_idx = _dispatch(small)
    with pytest.raises(ValueError, match="num_rdma_bytes: this call .*zero-copy\\) needs"):
        _low_latency.next_combine_buffer(small, handle)
    with pytest.raises(ValueError, match="num_rdma_bytes: this call .*zero-copy\\) needs"):
        _combine(small, handle, topk_idx, zero_copy=True)


def test_rank_mask_update_query_clean_and_their_checks(launches: list) -> None:
    ws = _workspace(ranks=4)
    status = torch.full((4,), 9, dtype=torch.int32)
    _low_latency.query_mask(ws, status)
    assert status.tolist() == [0, 0, 0, 0]
    _low_latency.update_mask(ws, 2, True)
    _low_latency.update_mask(ws, 3, True)
    _low_latency.update_mask(ws, 3, False)
    _low_latency.query_mask(ws, status)
    assert status.tolist() == [0, 0, 1, 0] and ep_ll.mask_words(ws.buffer, 4).tolist() == [0, 0, 1, 0]
    _low_latency.clean_mask(ws)
    _low_latency.query_mask(ws, status)
    assert status.tolist() == [0, 0, 0, 0]
    for bad, error, match in ((4, ValueError, r"rank_to_mask must be in \[0, 3\], got 4"),
                              (-1, ValueError, r"rank_to_mask must be in \[0, 3\], got -1"),
                              (True, TypeError, r"rank_to_mask must be an int, got bool")):
        with pytest.raises(error, match=f"low_latency_update_mask_buffer: {match}"):
            _low_latency.update_mask(ws, bad, True)
    with pytest.raises(TypeError, match="low_latency_update_mask_buffer: mask must be a bool, got str"):
        _low_latency.update_mask(ws, 1, "yes")
    _low_latency.update_mask(ws, 1, True)
    _low_latency.update_mask(ws, 2, True)
    # DeepEP checks numel() == num_ranks and int32 only: any shape, rank r in row-major element r; views get their
    # own elements (the rest of the base stays as it was).
    for shape in ((2, 2), (4, 1), (1, 4), (1, 2, 1, 2)):
        status = torch.full(shape, 9, dtype=torch.int32)
        _low_latency.query_mask(ws, status)
        assert status.flatten().tolist() == [0, 1, 1, 0], shape
    transposed = torch.full((2, 2), 9, dtype=torch.int32).t()
    _low_latency.query_mask(ws, transposed)
    assert transposed.tolist() == [[0, 1], [1, 0]] and transposed.t().tolist() == [[0, 1], [1, 0]]
    base = torch.full((3, 4), 9, dtype=torch.int32)
    _low_latency.query_mask(ws, base[1:, 1::2])
    assert base.tolist() == [[9, 9, 9, 9], [9, 0, 9, 1], [9, 1, 9, 0]]
    single = _workspace(ranks=1)
    scalar = torch.tensor(9, dtype=torch.int32)
    _low_latency.query_mask(single, scalar)
    assert scalar.item() == 0
    fn = "low_latency_query_mask_buffer: mask_status"
    wide = torch.full((8,), 9, dtype=torch.int32)
    for bad, error, match in (
            ([0, 0, 0, 0], TypeError, " must be a torch.Tensor, got list"),
            (torch.zeros(4, dtype=torch.int64), ValueError, r" must be a torch.int32 tensor .* got torch.int64"),
            (torch.zeros(2, 2, dtype=torch.float32), ValueError, r" must be a torch.int32 tensor .* got torch.float32"),
            (torch.zeros(3, dtype=torch.int32), ValueError,
             r" must have numel\(\) == num_ranks=4 \(any shape, DeepEP's check\), got 3 elements of shape \[3\]"),
            (torch.zeros(2, 4, dtype=torch.int32), ValueError, r" must have numel\(\) .* got 8 elements"),
            (torch.zeros(4, dtype=torch.int32, device="meta"), ValueError, " must be on cpu .* got meta"),
            (wide[:1].expand(4), ValueError, r"'s 4 elements must be distinct .* shape \[4\] with strides \[0\]"),
            (wide[:2].view(2, 1).expand(2, 2), ValueError, r"'s 4 elements must be distinct .* strides \[1, 0\]"),
            (wide.as_strided((2, 2), (1, 1)), ValueError, r"'s 4 elements must be distinct .* strides \[1, 1\]")):
        with pytest.raises(error, match=f"{fn}{match}"):
            _low_latency.query_mask(ws, bad)
    assert wide.tolist() == [9] * 8  # a refused query writes nothing
    _dispatch(_workspace(), shrink=True)
    assert launches[-1][1].flags & ep_ll.FLAG_SHRINK and launches[-1][1].off_mask == ep_ll._MASK
    assert _low_latency.comm_partition(ws, 20) is None  # not a CUDA workspace: the caller's stream
    assert _low_latency.partition_report(ws, 20)["partition"] == "off"


# ------------------------------------------------------------------------------------------------------------------
# The cheap mirror check (no call synchronizes: errors come from the host mirror at the next call) and the cached
# parameter templates.


def test_status_codes_view_the_mirror_and_raise_only_when_a_record_is_set() -> None:
    """The codes view shares the mirror's memory (a record the kernels store later is seen through a view taken
    before); a clean mirror raises nothing, a set one raises naming kernel and site, in both modules."""
    ws = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    mirror = ep_ll.new_status_mirror(torch.device("cpu"))
    codes = status_codes(mirror)
    assert codes.shape == (4,) and not codes.any()
    ep_ll.raise_for_mirrored_status(ws, mirror, 2, codes)  # clean: nothing
    mirror.copy_(ep_ll.status_records(_workspace_with(Kernel.COMBINE_RECV, 1, ep_ll.LlSite.READY << 16 | 1, 0, 3)))
    assert codes.tolist() == [0, 0, 0, 1]
    with pytest.raises(DeviceTimeoutError, match=r"combine receive \(gc_moe::ep_ll::combine\) \(recorded by an "
                                                 r"earlier call\): combine receive waiting for rank 1's rows"):
        ep_ll.raise_for_mirrored_status(ws, mirror, 2, codes)
    assert not codes.any() and not mirror.any()
    with pytest.raises(ValueError, match="status mirror"):
        status_codes(mirror.t())
    nws = torch.zeros(ep_normal.HEADER_BYTES, dtype=torch.uint8)
    nmirror = ep_normal.new_status_mirror(torch.device("cpu"))
    ncodes = status_codes(nmirror)
    ep_normal.raise_for_mirrored_status(nws, nmirror, 2, ncodes)
    record = KernelStatus(code=1, site=ep_normal.NormalSite.ARRIVE << 16 | 1, observed=0, expected=1)
    nmirror[ep_normal.Kernel.NOTIFY] = torch.frombuffer(bytearray(bytes(record)), dtype=torch.uint8)
    with pytest.raises(DeviceTimeoutError, match="gc_ep_normal_notify: notify waiting for rank 1's token counts"):
        ep_normal.raise_for_mirrored_status(nws, nmirror, 2, ncodes, when="")
    assert not nmirror.any()


def test_recorded_error_raises_at_the_next_call_before_any_launch(launches: list) -> None:
    """A synchronous call returns without waiting; what its kernels copied into the mirror is raised by the next
    call (before any launch, naming kernel and site) or by ``raise_recorded`` (Buffer.destroy's check)."""
    ws = _workspace()
    _, _, handle, _, topk_idx = _dispatch(ws)
    assert len(launches) == 1
    mirror = _low_latency._states[ws].mirror
    record = KernelStatus(code=2, site=ep_ll.LlSite.EXPERT_RANGE << 16, observed=300, expected=EXPERTS)
    mirror[Kernel.DISPATCH_SEND] = torch.frombuffer(bytearray(bytes(record)), dtype=torch.uint8)
    with pytest.raises(DeviceCheckError, match=r"dispatch send .*\(recorded by an earlier call\).*observed 300"):
        _combine(ws, handle, topk_idx)
    assert len(launches) == 1 and not mirror.any()
    _low_latency.raise_recorded(ws)  # clean
    mirror[Kernel.DISPATCH_SEND] = torch.frombuffer(bytearray(bytes(record)), dtype=torch.uint8)
    with pytest.raises(DeviceCheckError, match="recorded by an earlier call"):
        _low_latency.raise_recorded(ws)
    _combine(ws, handle, topk_idx)
    assert len(launches) == 2


def test_params_come_from_a_cached_template_with_fresh_pointers(monkeypatch: pytest.MonkeyPatch) -> None:
    """make_params: every field as a full construction gives it, a new struct per call (a later call's pointers do
    not change an earlier one's), the spin timeout read per call, an unknown pointer name refused."""
    shape = LlShape(2, EXPERTS, T_MAX, HIDDEN, TOPK)
    a = ep_ll.make_params(shape, num_tokens=3, flags=ep_ll.FLAG_SHRINK, x=16, call_gen=32)
    b = ep_ll.make_params(shape, num_tokens=3, flags=ep_ll.FLAG_SHRINK, x=48)
    want = ep_ll.EpLlParams(x=16, call_gen=32, timeout_ns=ep_ll.spin_timeout_ns(), off_seq=ep_ll._SEQ,
                            off_arrive=ep_ll._ARRIVE, off_consumed=ep_ll._CONSUMED, off_ready=ep_ll._READY,
                            off_status=ep_ll._STATUS, off_mask=ep_ll._MASK, off_counts=ep_ll._COUNTS,
                            off_recv_stage=shape.recv_stage_offset, off_combine_stage=shape.combine_stage_offset,
                            num_tokens=3, topk=TOPK, hidden=HIDDEN, num_experts=EXPERTS,
                            local_experts=shape.local_experts, max_tokens=T_MAX, flags=ep_ll.FLAG_SHRINK,
                            row_stride=shape.row_stride)
    assert bytes(a) == bytes(want)
    assert (b.x, b.call_gen, a.x) == (48, 0, 16)
    monkeypatch.setenv("GC_MOE_SPIN_TIMEOUT_MS", "5")
    assert ep_ll.make_params(shape, num_tokens=3).timeout_ns == 5_000_000
    with pytest.raises(TypeError, match="not pointer fields of EpLlParams: \\['num_tokens_typo'\\]"):
        ep_ll.make_params(shape, num_tokens=3, num_tokens_typo=1)


def test_packed_launches_are_per_workspace_and_see_a_spin_timeout_change(launches: list,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls of one shape on one workspace reuse one packed set of arguments; another workspace (Buffer) packs its
    own (its status mirror); a change of GC_MOE_SPIN_TIMEOUT_MS between calls is seen by the next call; sizes of
    another type than int are checked on every call, whatever was cached for their value."""
    monkeypatch.delenv("GC_MOE_SPIN_TIMEOUT_MS", raising=False)
    ws, other = _workspace(), _workspace()
    _, _, handle, _, topk_idx = _dispatch(ws)
    _dispatch(ws)
    state = _low_latency._states[ws]
    assert len(state.launches) == 1
    assert launches[0][1].timeout_ns == ep_ll.spin_timeout_ns() == 10_000_000_000
    _dispatch(other)
    assert launches[-1][1].status_mirror == _low_latency._states[other].mirror.data_ptr() != \
        state.mirror.data_ptr() == launches[0][1].status_mirror
    monkeypatch.setenv("GC_MOE_SPIN_TIMEOUT_MS", "5")
    _dispatch(ws)
    _combine(ws, handle, topk_idx)
    assert [p.timeout_ns for _, p in launches[-2:]] == [5_000_000] * 2
    monkeypatch.delenv("GC_MOE_SPIN_TIMEOUT_MS")
    _dispatch(ws)
    assert launches[-1][1].timeout_ns == 10_000_000_000
    x = torch.zeros(TOKENS, HIDDEN, dtype=torch.bfloat16)
    for bad, error in ((float(T_MAX), TypeError), (True, TypeError)):
        with pytest.raises(error, match="num_max_dispatch_tokens_per_rank: must be an int"):
            _low_latency.dispatch(ws, x, topk_idx, bad, EXPERTS, recv_stats=None, use_fp8=False, round_scale=False,
                                  use_ue8m0=False, async_finish=False, return_recv_hook=False, shrink=False,
                                  num_sms=20)


def test_a_receive_hook_keeps_its_call_pointers(launches: list) -> None:
    """A hook launches with its own call's pointers, even after later calls of the same shape set theirs."""
    ws = _workspace()
    x = torch.randn(TOKENS, HIDDEN).to(torch.bfloat16)
    topk_idx = torch.randint(-1, EXPERTS, (TOKENS, TOPK))
    kwargs = dict(recv_stats=None, use_fp8=False, round_scale=False, use_ue8m0=False, async_finish=False,
                  return_recv_hook=True, shrink=False, num_sms=20)
    first, _, _, hook = _low_latency.dispatch(ws, x, topk_idx, T_MAX, EXPERTS, **kwargs)
    second, _, _, _ = _low_latency.dispatch(ws, x, topk_idx, T_MAX, EXPERTS, **kwargs)
    hook()
    assert [k for k, _ in launches] == [Kernel.DISPATCH_SEND] * 2 + [Kernel.DISPATCH_RECV]
    assert launches[1][1].recv_x == second.data_ptr() != first.data_ptr() == launches[2][1].recv_x


def test_a_call_without_a_hook_is_one_launch_per_direction(launches: list) -> None:
    """Without ``return_recv_hook`` a dispatch or a combine is one launch running both halves (one fixed kernel cost
    per direction, as DeepEP's kernels); with it the call launches the send half and its hook the receive half
    (DeepEP's contract), both with the call's parameters."""
    ws = _workspace()
    x = torch.randn(TOKENS, HIDDEN).to(torch.bfloat16)
    topk_idx = torch.randint(-1, EXPERTS, (TOKENS, TOPK))
    y = torch.zeros(EXPERTS, T_MAX, HIDDEN, dtype=torch.bfloat16)
    common = dict(async_finish=False, shrink=False, num_sms=20)

    def dispatch(hooked: bool) -> tuple:
        return _low_latency.dispatch(ws, x, topk_idx, T_MAX, EXPERTS, recv_stats=None, use_fp8=True, round_scale=False,
                                     use_ue8m0=False, return_recv_hook=hooked, **common)

    def combine(handle: LowLatencyHandle, hooked: bool) -> tuple:
        return _low_latency.combine(ws, y, topk_idx, torch.ones(TOKENS, TOPK), handle, out=None, zero_copy=False,
                                    return_recv_hook=hooked, **common)

    recv, _, handle, hook = dispatch(False)
    assert hook is None and [what for what, _ in launches] == [DISPATCH]
    assert launches[0][1].recv_x == recv[0].data_ptr()
    out, hook = combine(handle, False)
    assert hook is None and [what for what, _ in launches] == [DISPATCH, COMBINE]
    assert launches[1][1].out == out.data_ptr()
    launches.clear()
    _, _, handle, hook = dispatch(True)
    assert [what for what, _ in launches] == [Kernel.DISPATCH_SEND]
    hook()
    _, hook = combine(handle, True)
    assert [what for what, _ in launches] == [Kernel.DISPATCH_SEND, Kernel.DISPATCH_RECV, Kernel.COMBINE_SEND]
    hook()
    assert [what for what, _ in launches][3:] == [Kernel.COMBINE_RECV]
    assert bytes(launches[0][1]) == bytes(launches[1][1]) and bytes(launches[2][1]) == bytes(launches[3][1])
