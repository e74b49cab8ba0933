"""The host side of a phase-timed kernel variant (kernels/common/phase_marks.cuh): the device buffer its marks go to,
one call's readout, and the block in which the facade launches the variant. bench/_ep_normal_phases.py and
bench/_ep_ll_phases.py hold what each variant marks and how its marks are summarized.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

import numpy as np
import torch
from _common import point_global


class PhaseTimes:
    """The buffer of one variant's marks, ``[direction][CTA][slot]`` int64 nanoseconds of the GPU's clock, that the
    variant's device-pointer global ``name`` of ``library`` (the loaded variant) points at, and its readout.
    ``marks``: each direction's marks, by name, in the order of the buffer's blocks (``kDispatchPhases``, ...)."""

    def __init__(self, device: torch.device, library: object, name: bytes, marks: Mapping[str, int], ctas: int,
                 slots: int) -> None:
        self.marks, self.ctas, self.slots = dict(marks), ctas, slots
        self.times = torch.zeros(len(self.marks) * ctas * slots, dtype=torch.int64, device=device)
        point_global(library, name, self.times)

    def timed(self, fn: Callable[[], object], direction: str) -> np.ndarray:
        """Runs ``fn`` (one call that launches ``direction``'s kernel) on a cleared buffer and returns that kernel's
        marks, ``[CTAs that ran, marks]`` in ns, in CTA order (rows beyond the grid dropped: all zero)."""
        self.times.zero_()
        torch.cuda.synchronize()
        fn()
        torch.cuda.synchronize()
        block = self.times.view(len(self.marks), self.ctas, self.slots)[list(self.marks).index(direction)]
        rows = block.cpu().numpy()
        ran = rows[rows[:, 0] != 0][:, :self.marks[direction]]
        if not len(ran):
            raise RuntimeError(f"the {direction} kernel stored no phase marks: it did not run the phase-timed variant "
                               "in this context (GC_MOE_DEEP_EP_PARTITION=on launches on a green context, whose copy "
                               "of the global this process did not set)")
        return ran


@contextlib.contextmanager
def swapped(owner: object, name: str, replacement: object) -> Iterator[None]:
    """Within the block ``owner.name`` is ``replacement`` (the facade's kernel lookup, which every launch reads:
    the variant's entry points instead of the production ones); after it, what it was."""
    production = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, production)
