"""What every benchmark script shares: the BENCH_PROTOCOL.md window timing and the result file's ``meta`` block.

The protocol itself lives in the package (:mod:`gc_moe_compat.ab.protocol`, shared with ``gc-moe-ab``) and the PNG
helper in :mod:`gc_moe_compat.ab.report`; this module re-exports them under the names the scripts import.
Benchmarks run as scripts (``python bench/NAME.py``), so this module is imported from the script's own folder.
"""

from __future__ import annotations

from pathlib import Path

from gc_moe_compat.ab.protocol import (
    L2_FLUSH_BYTES,
    PER_WINDOW,
    copy_bandwidth,
    expert_floor_bytes,
    result_meta,
    timed_windows,
    write_partial_result,
)
from gc_moe_compat.ab.report import pyplot

__all__ = ["L2_FLUSH_BYTES", "PER_WINDOW", "REPO", "copy_bandwidth", "expert_floor_bytes", "pyplot", "result_meta",
           "timed_windows", "write_partial_result"]

REPO = Path(__file__).resolve().parents[1]
