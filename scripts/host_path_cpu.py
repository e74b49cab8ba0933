"""The host path of eager ``deep_ep`` calls on a CPU-only machine: microseconds and Python function calls per call,
and per call the counts of what costs far more on a GPU than here (allocations, ``torch.empty`` / ``empty_strided``:
~2-7 us each for a CUDA tensor on an H200 host; driver launches: ~4.5 us each, the driver's own cost; current-stream
lookups; environment reads, through ``os.environ.get`` or :func:`gc_moe_compat.runtime.env.env_get`).

``--mode ll``: ``low_latency_dispatch`` (FP8) and ``low_latency_combine`` (``gc_moe_compat.deep_ep._low_latency``);
``--mode normal``: the normal mode's ``get_dispatch_layout``, ``dispatch`` (BF16 and FP8 uncached, BF16 cached) and
``combine`` (with the dispatch's config, and without one: SGLang's default) through ``Buffer``
(``gc_moe_compat.deep_ep._normal``), seen from rank 0 of a ``--ranks`` world; ``--mode all`` (the default): both.
The whole Python path runs, down to the launch plumbing of ``gc_moe_compat.comm`` and
``gc_moe_compat.runtime.launch``; only the driver is replaced: the kernel load (``jit.load_module``, which needs
nvcc) by a fake module, ``cuLaunchKernel`` by a counter (which, for the normal mode's notify kernel, writes the host
record of received counts and the tag the kernel would: the uncached dispatch reads them in its CPU wait),
``cuStreamQuery`` by a stand-in (the stream has always run dry), and torch's current-stream lookup
(``torch._C._cuda_getCurrentRawStream``), ``torch.cuda.current_device`` (the low-latency stand-in's CPU workspace
names no device index) and ``is_current_stream_capturing`` by stand-ins.
The workspaces are the host tests' stand-ins (CPU tensors: tests/facades/test_ep_ll_host.py's, and for the normal
mode tests/fuzz/conftest.py's ``HostWorkspace`` of ``--ranks`` ranks, its GPU refusal lifted), so the path is the
partition-off one (the default); the low-latency path skips the capture check and the partition-mode read a CUDA
workspace adds. CPU ``torch.empty`` of a large tensor is an mmap here, not a caching-allocator hit. A diagnosis of
the host work, not a benchmark of the GPU path (bench/profile_deep_ep_host.py is, on an H200).

The calls take the host path ``GC_MOE_DEEP_EP_HOST_PATH`` selects (printed first: the compiled one by default, whose
checks, allocations and pointer stores are one C++ call per call, two for an uncached normal dispatch, its
``at::empty`` not counted as allocations; ``python``: the Python path), so an A/B is two runs, one with the variable
set.

``PYTHONPATH=. python scripts/host_path_cpu.py [--mode all|ll|normal] [--calls 2000] [--hidden 7168]
[--experts 256] [--tokens 128] [--normal-tokens 4096] [--ranks 2]``
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import os
import pstats
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from cuda.bindings import driver

from gc_moe_compat.comm import ep_ll, ep_normal
from gc_moe_compat.deep_ep import Buffer, _compiled_host, _low_latency, _normal
from gc_moe_compat.deep_ep._config import aligned_bytes
from gc_moe_compat.runtime import env as runtime_env
from gc_moe_compat.runtime import jit
from gc_moe_compat.runtime.single_rank import single_rank_group
from gc_moe_compat.runtime.workspace import LayoutPlanner, PeerTable
from gc_moe_compat.testing.ep_normal_reference import layout_reference

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kit"))
import normal_host_kit  # noqa: E402 (the tests' kit, put on the path above)
from normal_host_kit import lift_gpu_refusal  # noqa: E402

_STAND_INS = frozenset({"launch", "current_stream", "current_device", "capturing", "query", "get",
                        "begin_on_gpu"})
"""The stand-ins' frames, not counted as the path's function calls."""
_ALLOCATIONS = frozenset({"<built-in method torch.empty>", "<built-in method torch.empty_strided>"})
"""The profiler's names of the calls that allocate a CUDA tensor on the path (counted as ``allocations``)."""
_OWN_WORK = frozenset({"launch"})
"""Stand-ins whose callees are the stand-in's own work (the fake notify's record write), not counted either; the
environment read's stand-in (``get``) calls the real ``os.environ.get``, which is counted."""


@dataclass(eq=False)
class _Workspace:
    """What the low-latency calls read of a ``SymmetricWorkspace`` (as tests/facades/test_ep_ll_host.py's)."""

    device: torch.device
    world_size: int
    buffer: torch.Tensor
    peer_table: PeerTable
    placement: None = None
    sm_share: int = ep_ll.MAX_SMS


class _NormalWorkspace(_Workspace):
    """What the normal mode reads of a ``SymmetricWorkspace`` (as tests/fuzz/conftest.py's ``HostWorkspace``): a
    ``world_size``-rank workspace seen from rank 0, one region."""

    rank = 0

    def region(self, name: str) -> torch.Tensor:
        return self.buffer


class _Counts:
    """Driver launches and current-stream lookups made through the stand-ins; ``notify`` / ``record``: the normal
    mode's notify kernel (its handle once loaded) and the host record of counts it writes."""

    def __init__(self) -> None:
        self.launches = self.streams = 0
        self.notify: object = None
        self.record = b""


def _stand_ins(counts: _Counts) -> None:
    """Replaces the kernel load, the driver launch and stream query and torch's current stream and capture check
    (see the module docstring)."""
    handles: dict[str, driver.CUkernel] = {}

    def kernel(name: str) -> jit.Kernel:
        handle = handles.setdefault(name, driver.CUkernel(len(handles) + 1))
        if name == ep_normal.ENTRY_NAMES[ep_normal.Entry.NOTIFY]:
            counts.notify = handle
        return jit.Kernel(name, "host", handle, None)

    fake = SimpleNamespace(kernel=kernel)
    jit.load_module = lambda source, *args, **kwargs: fake
    success = (driver.CUresult.CUDA_SUCCESS,)

    def launch(function: object, *args: object) -> tuple:
        counts.launches += 1
        if function is counts.notify:  # the kernel's host record: what the uncached dispatch reads after its wait
            params = ep_normal.EpNormalParams.from_address(ctypes.c_void_p.from_address(args[-2] + 8).value)
            ctypes.memmove(params.host_counts + 4 * ep_normal.HostRecord.RECV, counts.record, len(counts.record))
            ctypes.c_int64.from_address(params.host_counts + 4 * ep_normal.HostRecord.TAG).value = params.op
        return success

    def query(stream: object) -> tuple:
        return success

    driver.cuLaunchKernel = launch
    driver.cuStreamQuery = query

    def current_stream(index: int) -> int:
        counts.streams += 1
        return 0

    def current_device() -> int:  # the low-latency stand-in's workspace is a CPU one: its device has no index
        return 0

    def capturing() -> bool:
        return False

    torch._C._cuda_getCurrentRawStream = current_stream
    torch.cuda.current_device = current_device
    torch.cuda.is_current_stream_capturing = capturing


def _ll_calls(hidden: int, experts: int, tokens: int, topk: int) -> dict[str, Callable[[], object]]:
    shape = ep_ll.LlShape(1, experts, tokens, hidden, ep_ll.HINT_TOPK)
    ws = _Workspace(torch.device("cpu"), 1, torch.empty(ep_ll.required_bytes(shape, True), dtype=torch.uint8),
                    PeerTable())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])
    w = torch.rand(tokens, topk, generator=g)
    kwargs = dict(recv_stats=None, use_fp8=True, round_scale=False, use_ue8m0=False, async_finish=False,
                  return_recv_hook=False, shrink=False, num_sms=20)
    _, _, handle, _ = _low_latency.dispatch(ws, x, idx, tokens, experts, **kwargs)
    y = torch.zeros(experts, tokens, hidden, dtype=torch.bfloat16)
    return {
        "low_latency_dispatch (FP8)": lambda: _low_latency.dispatch(ws, x, idx, tokens, experts, **kwargs),
        "low_latency_combine": lambda: _low_latency.combine(
            ws, y, idx, w, handle, out=None, zero_copy=False, async_finish=False, return_recv_hook=False,
            shrink=False, num_sms=20),
    }


def _host_record(in_rank: torch.Tensor, per_expert: torch.Tensor, ranks: int) -> bytes:
    """The notify kernel's host record for rank 0 when every rank of the group routes as ``in_rank`` /
    ``per_expert`` do: received rows, the most any rank receives, the most any rank sends, the per-local-expert
    counts."""
    received = ranks * int(in_rank[:, 0].sum())
    local = per_expert.shape[0] // ranks
    record = [received, received, int(in_rank.sum()), *(ranks * per_expert[:local]).tolist()]
    return bytes(torch.tensor(record, dtype=torch.int32).numpy())


def _normal_calls(group: object, counts: _Counts, hidden: int, experts: int, tokens: int, topk: int, ranks: int,
                  num_sms: int = 24) -> dict[str, Callable[[], object]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])
    w = torch.rand(tokens, topk, generator=g)
    x_fp8 = (x.float().to(torch.float8_e4m3fn), torch.ones(tokens, hidden // 128))
    per_rank, per_expert, in_rank = layout_reference(idx, experts, ranks)
    counts.record = _host_record(in_rank, per_expert, ranks)
    # room for each direction's rows at once: the dispatch's received rows, the combine's rows sent back (the
    # record's "most sent"), which carry their weights in a wider stride
    dispatch_bytes = (ep_normal.data_offset(ranks, experts // ranks, num_sms // 2).data
                      + ranks * int(in_rank[:, 0].sum()) * ep_normal.dispatch_row_layout(2 * hidden, 0, topk).stride)
    combine_bytes = (ep_normal.data_offset(ranks, 1, num_sms // 2).data
                     + int(in_rank.sum()) * ep_normal.combine_row_layout(2 * hidden, topk).stride)
    nvl = aligned_bytes(max(dispatch_bytes, combine_bytes))

    def workspace(layout: LayoutPlanner, group: object = None, device: object = None,
                  where: object = None) -> _NormalWorkspace:
        return _NormalWorkspace(torch.device("cpu"), ranks, torch.zeros(layout.size, dtype=torch.uint8), PeerTable())

    _normal.SymmetricWorkspace = workspace
    lift_gpu_refusal(setattr)
    buf = Buffer(group, nvl, 0)
    config = _normal.dispatch_config(ranks, num_sms)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=idx, topk_weights=w, config=config)
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, **layout)
    default = {key: value for key, value in layout.items() if key != "config"}  # Buffer.num_sms's config
    default_x, _, default_w, _, default_handle, _ = buf.dispatch(x, **default)
    return {
        "get_dispatch_layout": lambda: buf.get_dispatch_layout(idx, experts),
        "dispatch BF16 (uncached)": lambda: buf.dispatch(x, **layout),
        "dispatch FP8 (uncached)": lambda: buf.dispatch(x_fp8, **layout),
        "dispatch BF16 (cached)": lambda: buf.dispatch(x, handle, config=config),
        "combine": lambda: buf.combine(recv_x, handle, recv_w, config=config),
        "combine (config=None: SGLang's default)": lambda: buf.combine(default_x, default_handle, default_w),
    }


def _per_call(fn: Callable[[], object], calls: int) -> float:
    for _ in range(min(calls, 50)):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def _profiled(fn: Callable[[], object], calls: int, counts: _Counts) -> dict[str, float]:
    """Python function calls, ``torch.empty`` calls, driver launches and current-stream lookups per call (the
    stand-ins' own frames and work are not counted as function calls)."""
    counts.launches = counts.streams = 0
    environ_get = os.environ.get
    reads = [0]

    def get(key: str, default: object = None) -> object:
        reads[0] += 1
        return environ_get(key, default)

    class _Counted:  # runtime.env's dict of the variables, its reads counted
        def get(self, key: bytes) -> bytes | None:
            reads[0] += 1
            return variables.get(key)

    variables = runtime_env._data
    os.environ.get = get  # type: ignore[method-assign]
    runtime_env._data = _Counted()
    prof = cProfile.Profile()
    try:
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
    finally:
        del os.environ.get
        runtime_env._data = variables
    stats = pstats.Stats(prof).stats
    stand_ins = {key for key in stats if key[0] in (__file__, normal_host_kit.__file__) and key[2] in _STAND_INS}
    own_work = {key for key in stand_ins if key[2] in _OWN_WORK}
    excluded = sum(stats[key][0] for key in stand_ins) + sum(
        calls_from[0] for _, _, _, _, callers in stats.values() for caller, calls_from in callers.items()
        if caller in own_work)
    allocations = sum(cc for (_, _, name), (cc, *_rest) in stats.items() if name in _ALLOCATIONS)
    total = sum(cc for cc, *_rest in stats.values()) - excluded
    return {"python calls": total / calls, "allocations": allocations / calls,
            "driver launches": counts.launches / calls, "current_stream": counts.streams / calls,
            "environ reads": reads[0] / calls}


def _report(calls: dict[str, Callable[[], object]], counts: _Counts, n: int) -> None:
    for name, fn in calls.items():
        wall = min(_per_call(fn, n) for _ in range(3))
        counted = _profiled(fn, max(1, n // 10), counts)
        detail = ", ".join(f"{key} {value:g}" for key, value in counted.items())
        print(f"{name}: {wall:.1f} us per call; per call: {detail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("all", "ll", "normal"), default="all")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=128, help="low-latency T = Tmax")
    parser.add_argument("--normal-tokens", type=int, default=4096, help="normal-mode T (each rank's)")
    parser.add_argument("--ranks", type=int, default=2, help="normal-mode world (the calls of rank 0)")
    parser.add_argument("--topk", type=int, default=8)
    args = parser.parse_args()
    counts = _Counts()
    _stand_ins(counts)
    where = _compiled_host.host_path()
    print(f"host path: {where['host_path']} ({where['reason']})")
    if args.mode in ("all", "ll"):
        _report(_ll_calls(args.hidden, args.experts, args.tokens, args.topk), counts, args.calls)
    if args.mode in ("all", "normal"):
        with single_rank_group() as group:
            _report(_normal_calls(group, counts, args.hidden, args.experts, args.normal_tokens, args.topk,
                                  args.ranks), counts, args.calls)


if __name__ == "__main__":
    main()
