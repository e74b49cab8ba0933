#!/usr/bin/env python3
"""Rewrite the standalone SM90 GEMM cubin records (tests/data/sm90_fp8_standalone_cubins.json and
sm90_fp4_standalone_cubins.json) after a deliberate change of the standalone kernels.

What: builds every recorded variant (``recorded_variants`` of bench/_standalone_gemm.py) of each kernel
for sm_90a
with this machine's nvcc, in a fresh cache directory, and writes the sha256 of each cubin, the nvcc build line and
``--note`` (which change wrote the record, and whether that build has been verified on a GPU yet).

Why: tests/operator/test_role2_operator_host.py compares every standalone cubin with its record, so that refactors of
the
shared device code and operator-mode changes cannot move the standalone kernels unnoticed. A change meant to move
them (a new K loop, say) rewrites the records here, in the same commit as the kernel change.

Usage: ``python scripts/record_sm90_cubins.py --note "..." [--only fp8xfp8|fp8xfp4]`` (needs nvcc; no GPU).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from gc_moe_compat.compute_paths import compute_path
from gc_moe_compat.runtime import jit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the standalone GEMM harness lives there

from _standalone_gemm import recorded_variants  # noqa: E402

DATA_DIR = Path(__file__).resolve().parents[1] / "tests" / "data"
RECORDS = {
    "fp8xfp8": DATA_DIR / "sm90_fp8_standalone_cubins.json",
    "fp8xfp4": DATA_DIR / "sm90_fp4_standalone_cubins.json",
}


def record(mma_type: str, note: str) -> dict[str, object]:
    """The record of every recorded variant of the ``mma_type`` standalone kernel, built in a fresh cache."""
    version = subprocess.run([str(jit.find_nvcc()), "--version"], capture_output=True, text=True, check=True).stdout
    build = re.search(r"Build \S+", version)
    if build is None:
        raise RuntimeError(f"nvcc --version has no 'Build' line: {version!r}")
    source = compute_path(mma_type).kernel
    cubins = {}
    with tempfile.TemporaryDirectory() as cache:
        os.environ["GC_MOE_CACHE_DIR"] = cache
        for defines in recorded_variants(mma_type):
            cubin = jit.compile_cubin(source, defines)
            cubins[str(sorted(defines.items()))] = hashlib.sha256(cubin.path.read_bytes()).hexdigest()
    head = f"sha256 of every standalone {mma_type} variant (gemm.recorded_variants), by scripts/record_sm90_cubins.py"
    return {"cubins": dict(sorted(cubins.items())), "note": f"{head}: {note}", "nvcc": build.group(0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--note", required=True, help="which change wrote the record; GPU-verified or not")
    parser.add_argument("--only", choices=sorted(RECORDS), help="rewrite one record only")
    args = parser.parse_args()
    for mma_type, path in RECORDS.items():
        if args.only in (None, mma_type):
            path.write_text(json.dumps(record(mma_type, args.note), indent=1) + "\n")
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
