"""The host path of eager low-latency ``deep_ep`` calls on a CPU-only machine: microseconds and Python function calls
per ``low_latency_dispatch`` (FP8) and ``low_latency_combine``, and per call the counts of what costs far more on a
GPU than here (``torch.empty``: ~5-10 us each for a CUDA tensor; driver launches: ~5-10 us each through
cuda-bindings; ``torch.cuda.current_stream`` lookups; environment reads).

The whole Python path of ``gc_moe_compat.deep_ep._low_latency`` runs, down to the launch plumbing of
``gc_moe_compat.comm.ep_ll`` and ``gc_moe_compat.runtime.launch``; only the driver is replaced: the kernel load
(``jit.load_module``, which needs nvcc) by a fake module, ``cuLaunchKernel`` by a counter, and
``torch.cuda.current_stream`` by a stand-in stream. The workspace is the host tests' stand-in (a CPU tensor of the
hint's size, tests/facades/test_ep_ll_host.py), so the path is the partition-off one (the default), without the
capture check and the partition-mode read a CUDA workspace adds; CPU ``torch.empty`` of a large tensor is an mmap
here, not a caching-allocator hit. A diagnosis of the host work, not a benchmark of the GPU path
(bench/profile_deep_ep_host.py is, on an H200).

``PYTHONPATH=. python scripts/host_path_cpu.py [--calls 2000] [--hidden 7168] [--experts 256] [--tokens 128]``
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from cuda.bindings import driver

from gc_moe_compat.comm import ep_ll
from gc_moe_compat.deep_ep import _low_latency
from gc_moe_compat.runtime import jit
from gc_moe_compat.runtime.workspace import PeerTable


@dataclass(eq=False)
class _Workspace:
    """What the low-latency calls read of a ``SymmetricWorkspace`` (as tests/facades/test_ep_ll_host.py's)."""

    device: torch.device
    world_size: int
    buffer: torch.Tensor
    peer_table: PeerTable
    placement: None = None
    sm_share: int = ep_ll.MAX_SMS


class _Counts:
    """Driver launches and current-stream lookups made through the stand-ins."""

    def __init__(self) -> None:
        self.launches = self.streams = 0


def _stand_ins(counts: _Counts) -> None:
    """Replaces the kernel load, the driver launch and torch's current stream (see the module docstring)."""
    fake = SimpleNamespace(kernel=lambda name: jit.Kernel(name, "host", driver.CUkernel(0), None))
    jit.load_module = lambda source, *args, **kwargs: fake
    success = (driver.CUresult.CUDA_SUCCESS,)

    def launch(*args: object) -> tuple:
        counts.launches += 1
        return success

    driver.cuLaunchKernel = launch
    stream = SimpleNamespace(cuda_stream=0)

    def current_stream(device: object = None) -> SimpleNamespace:
        counts.streams += 1
        return stream

    torch.cuda.current_stream = current_stream


def _calls(hidden: int, experts: int, tokens: int, topk: int) -> dict[str, Callable[[], object]]:
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


def _per_call(fn: Callable[[], object], calls: int) -> float:
    for _ in range(min(calls, 50)):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def _profiled(fn: Callable[[], object], calls: int, counts: _Counts) -> dict[str, float]:
    """Python function calls, ``torch.empty`` calls, driver launches and current-stream lookups per call (the
    stand-ins' own frames are not counted as function calls)."""
    counts.launches = counts.streams = 0
    environ_get = os.environ.get
    reads = [0]

    def get(key: str, default: object = None) -> object:
        reads[0] += 1
        return environ_get(key, default)

    os.environ.get = get  # type: ignore[method-assign]
    prof = cProfile.Profile()
    try:
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
    finally:
        del os.environ.get
    stats = pstats.Stats(prof).stats
    stand_in = sum(cc for (path, _, name), (cc, *_rest) in stats.items()
                   if path == __file__ and name in ("launch", "current_stream", "get"))
    empty = sum(cc for (_, _, name), (cc, *_rest) in stats.items() if name == "<built-in method torch.empty>")
    total = sum(cc for cc, *_rest in stats.values()) - stand_in
    return {"python calls": total / calls, "torch.empty": empty / calls, "driver launches": counts.launches / calls,
            "current_stream": counts.streams / calls, "environ reads": reads[0] / calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=128, help="T = Tmax")
    parser.add_argument("--topk", type=int, default=8)
    args = parser.parse_args()
    counts = _Counts()
    _stand_ins(counts)
    for name, fn in _calls(args.hidden, args.experts, args.tokens, args.topk).items():
        wall = min(_per_call(fn, args.calls) for _ in range(3))
        counted = _profiled(fn, max(1, args.calls // 10), counts)
        detail = ", ".join(f"{key} {value:g}" for key, value in counted.items())
        print(f"{name}: {wall:.1f} us per call; per call: {detail}")


if __name__ == "__main__":
    main()
