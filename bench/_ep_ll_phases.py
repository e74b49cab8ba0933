"""Where the time of one low-latency dispatch or combine goes, per CTA, from inside the kernels: the phase-timed
variant of kernels/sm90/ep_ll.cu (``GC_EP_LL_PHASES`` defined: at each mark a CTA's thread 0 stores
``%globaltimer`` into a device buffer the host points it at). ``bench/deep_ep_sm90.py --parts low_latency --phases
N`` uses it: each point's graph timing runs first on the production kernels, then N eager calls per op on the
variant, each read back after a synchronization. Nsight Compute gives a kernel's duration and its stall sites, not
which CTA ends it or after which step; the marks do.

The marks (:data:`MARKS`, per direction): dispatch's entry, the token's routing checked, the prefix count of its
rows done (the row index in each expert's list), its slots' rows placed, its row's copies complete, the exit;
combine's entry, the CTA's units summed, the exit. At one rank the grid's last CTA is the checker (it counts,
reports and publishes while the others move rows); its marks between entry and exit are its own steps
(:data:`CHECKER_MARKS`), so the summary keeps it apart. A CTA synchronizes its threads before each mark, so a mark
is when its slowest warp got there, and the variant's barriers make it a little slower than the production kernels.
Time calls without a receive hook: a hook's second launch of the same kernel would store its own marks over CTA 0's.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
from collections.abc import Iterator, Sequence

import _phase_marks
import numpy as np
import torch

from gc_moe_compat.comm import ep_ll
from gc_moe_compat.runtime import jit

DEFINES = {"GC_EP_LL_PHASES": 1}
"""The variant's JIT defines."""
MARKS = {"dispatch": ("entry", "routing", "prefix", "placed", "stored", "exit"),
         "combine": ("entry", "summed", "exit")}
"""Each direction's marks, in order (the kernel's ``phase_mark`` indices), in the order of the directions' blocks
of the buffer (``kDispatchPhases`` / ``kCombinePhases``)."""
CHECKER_MARKS = {"dispatch": ("entry", "cleared", "counted", "published", "mirrored", "exit"),
                 "combine": ("entry", "decided", "exit")}
"""The one-rank checker CTA's marks, in order."""
SLOTS = 6
"""Marks per CTA the buffer holds (``kPhaseMarks``)."""
CTAS = 512
"""CTAs per direction the buffer holds (``kPhaseCtas``)."""
GLOBAL = b"gc_ep_ll_phase_times"


@functools.cache
def _variant_kernel(kernel: ep_ll.Kernel) -> jit.Kernel:
    """``kernel``'s entry point in the phase-timed variant (what :func:`variant` makes the facade launch)."""
    return jit.load_module(ep_ll.SOURCE, DEFINES).kernel(ep_ll._MANGLED[kernel.entry])


@functools.cache
def phase_times(device: torch.device) -> _phase_marks.PhaseTimes:
    """This process's buffer on ``device`` (one: the variant's global points at it)."""
    return _phase_marks.PhaseTimes(device, jit.load_module(ep_ll.SOURCE, DEFINES).library, GLOBAL,
                                   {direction: len(marks) for direction, marks in MARKS.items()}, CTAS, SLOTS)


@contextlib.contextmanager
def variant(device: torch.device) -> Iterator[_phase_marks.PhaseTimes]:
    """Within the block the facade's low-latency calls launch the phase-timed variant (``ep_ll.kernel_of``, which
    every launch reads, swapped), whose marks go to the returned buffer; after it, the production kernels again."""
    times = phase_times(device)
    with _phase_marks.swapped(ep_ll, "kernel_of", _variant_kernel):
        yield times


def summary(calls: Sequence[np.ndarray], direction: str, checker: bool) -> dict[str, object]:
    """Over the calls (each :meth:`_phase_marks.PhaseTimes.timed`'s marks), the median per mark of: the median and
    the latest moving CTA, and (``checker``: one rank, the grid's last CTA, when it is not alone) the checker, each in
    µs after the call's first entry; the CTAs of the grid, and which CTA exited last in most calls."""
    marks = MARKS[direction]
    split = checker and calls and calls[0].shape[0] > 1
    median: dict[str, list[float]] = {m: [] for m in marks}
    latest: dict[str, list[float]] = {m: [] for m in marks}
    own: dict[str, list[float]] = {m: [] for m in CHECKER_MARKS[direction]}
    last_exit: list[int] = []
    for call in calls:
        start = call[:, 0].min()
        after = (call - start) / 1e3
        movers = after[:-1] if split else after
        for i, name in enumerate(marks):
            median[name].append(float(np.median(movers[:, i])))
            latest[name].append(float(movers[:, i].max()))
        if split:
            for i, name in enumerate(CHECKER_MARKS[direction]):
                own[name].append(float(after[-1, i]))
        last_exit.append(int(np.argmax(call[:, -1])))
    result: dict[str, object] = {
        "median_us": {m: statistics.median(v) for m, v in median.items()},
        "latest_us": {m: statistics.median(v) for m, v in latest.items()},
        "ctas": int(calls[0].shape[0]) if calls else 0,
        "last_exit_cta": statistics.mode(last_exit) if last_exit else None}
    if split:
        result["checker_us"] = {m: statistics.median(v) for m, v in own.items()}
    return result
