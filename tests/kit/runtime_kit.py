"""Shared helpers of the runtime's GPU tests: the test kernels, their device-state mirrors and status sites."""

from __future__ import annotations

import ctypes

import torch
from cuda.bindings import driver

from gc_moe_compat.runtime import jit
from gc_moe_compat.runtime.cuda import call
from gc_moe_compat.runtime.green import GreenSide

SOURCE = "testing/runtime_test.cu"

#: Status sites of kernels/testing/runtime_test.cu (enum Site).
SITES = {
    1: "spin on flag",
    2: "node B waiting for node A's generation",
    3: "gen_a",
    4: "gen_b",
    5: "arrive_a",
    6: "arrive_b",
    7: "done_b",
    8: "peer flag",
    9: "peer payload",
}


class CounterState(ctypes.Structure):
    """Mirror of CounterState in runtime_test.cu (8 x u64)."""

    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("arrive_a", "gen_a", "arrive_b", "done_b", "gen_b", "gen_c", "checks", "reserved")
    ]


def module() -> jit.Module:
    """The runtime test kernels, compiled (or taken from the cache) and loaded."""
    return jit.load_module(SOURCE)


def u64(v: int) -> ctypes.c_uint64:
    return ctypes.c_uint64(v)


def u32(v: int) -> ctypes.c_uint32:
    return ctypes.c_uint32(v)


def i32(v: int) -> ctypes.c_int32:
    return ctypes.c_int32(v)


def sync(*sides: GreenSide) -> None:
    """Waits for the green streams of ``sides``."""
    for side in sides:
        call(driver.cuStreamSynchronize, side.stream)


def counters(state: torch.Tensor) -> dict[str, int]:
    """The counter state on the host, by field name."""
    values = state.cpu().tolist()
    return {name: values[i] for i, (name, _) in enumerate(CounterState._fields_)}
