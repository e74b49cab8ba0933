"""Where the time of one normal-mode dispatch or combine goes, per CTA, from inside the kernels: the phase-timed
variant of kernels/sm90/ep_normal.cu (``GC_EP_NORMAL_PHASES`` defined: at six marks per direction kernel each CTA's
thread 0 stores ``%globaltimer`` into a device buffer the host points it at). ``bench/deep_ep_ab.py --phases N``
uses it for the facade: the eager timing runs first on the production kernels, then N more calls per op on the
variant, each read back after a synchronization. Nsight Compute cannot split the fused send and receive halves of a
launch, and does not profile ranks that share a GPU under MPS; the marks can.

The marks (:data:`MARKS`): the kernel's entry, the send half's wait for every rank's previous release done, the send
half's rows done, the receive half's wait for every rank's ready done (the dispatch's receive waits per source rank
inside its rows, so its mark is the receive half's start), the receive half's rows done, the exit (the combine's
send_head rewrite runs between its entry and its send wait). A CTA
synchronizes its threads before each mark, so a mark is when its slowest warp got there. ``%globaltimer`` is one clock
per GPU, so the ranks sharing it can be compared directly.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
from collections.abc import Iterator, Sequence

import _phase_marks
import numpy as np
import torch

from gc_moe_compat.comm import ep_normal
from gc_moe_compat.deep_ep import _normal
from gc_moe_compat.runtime import jit

DEFINES = {"GC_EP_NORMAL_PHASES": 1}
"""The variant's JIT defines."""
MARKS = ("entry", "send_wait", "send_rows", "recv_wait", "recv_rows", "exit")
"""The kernel's marks, in order (``kPhaseMarks`` of the kernel)."""
CTAS = 256
"""CTAs per direction the buffer holds (``kPhaseCtas``)."""
DIRECTIONS = ("dispatch", "combine")
"""The direction kernels' blocks of the buffer, in order (``kDispatchPhases`` / ``kCombinePhases``)."""
GLOBAL = b"gc_ep_normal_phase_times"


@functools.cache
def _variant_kernel(entry: ep_normal.Entry) -> jit.Kernel:
    """``entry`` of the phase-timed variant (what :func:`variant` makes the facade launch)."""
    return jit.load_module(ep_normal.SOURCE, DEFINES).kernel(ep_normal.ENTRY_NAMES[entry])


@functools.cache
def phase_times(device: torch.device) -> _phase_marks.PhaseTimes:
    """This process's buffer on ``device`` (one: the variant's global points at it)."""
    return _phase_marks.PhaseTimes(device, jit.load_module(ep_normal.SOURCE, DEFINES).library, GLOBAL,
                                   dict.fromkeys(DIRECTIONS, len(MARKS)), CTAS, len(MARKS))


@contextlib.contextmanager
def variant(device: torch.device) -> Iterator[_phase_marks.PhaseTimes]:
    """Within the block the facade's normal-mode calls launch the phase-timed variant (the normal mode's
    ``kernel_of``, which it reads at every launch, swapped), whose marks go to the returned buffer; after it, the
    production kernels again."""
    times = phase_times(device)
    with _phase_marks.swapped(_normal, "kernel_of", _variant_kernel):
        yield times


def summary(calls: Sequence[np.ndarray]) -> dict[str, object]:
    """Per mark, over the calls' medians: each mark's median and latest CTA in µs after the call's first entry, and
    the calls' first entries (ns of the GPU's clock: ranks sharing the GPU compare them)."""
    median: dict[str, list[float]] = {m: [] for m in MARKS}
    latest: dict[str, list[float]] = {m: [] for m in MARKS}
    for marks in calls:
        start = marks[:, 0].min()
        for i, name in enumerate(MARKS):
            after = (marks[:, i] - start) / 1e3
            median[name].append(float(np.median(after)))
            latest[name].append(float(after.max()))
    return {"median_us": {m: statistics.median(v) for m, v in median.items()},
            "latest_us": {m: statistics.median(v) for m, v in latest.items()},
            "ctas": int(calls[0].shape[0]) if calls else 0,
            "first_entry_ns": [int(marks[:, 0].min()) for marks in calls]}
