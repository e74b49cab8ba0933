"""scripts/host_path_cpu.py (the CPU stand-in's diagnosis of the deep_ep facade's host path) runs end to end here,
as a user runs it, and reports each call's driver launches as the facade makes them: DeepEP's kernel sequence per call
(low-latency without a hook: send and receive in one launch; layout alone; an uncached dispatch notify, then send and
receive in one launch; a cached one that launch; a combine the send_head rewrite, then send and receive, in one),
at two ranks and at eight (where the rows a combine sends back outnumber those rank 0 receives)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAUNCHES = {"low_latency_dispatch (FP8)": 1, "low_latency_combine": 1, "get_dispatch_layout": 1,
            "dispatch BF16 (uncached)": 2, "dispatch FP8 (uncached)": 2, "dispatch BF16 (cached)": 1, "combine": 1,
            "combine (config=None: SGLang's default)": 1}


@pytest.mark.parametrize("ranks", [2, 8])
def test_the_script_reports_every_call_with_its_launches(ranks: int) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "scripts/host_path_cpu.py", "--mode", "all", "--calls", "3", "--hidden",
                          "1024", "--experts", "16", "--tokens", "8", "--normal-tokens", "64", "--ranks", str(ranks)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = {}
    for line in run.stdout.splitlines():
        match = re.match(r"(.+?): ([0-9.]+) us per call; per call: python calls ([0-9.]+), .*driver launches ([0-9.]+)",
                         line)
        if match:
            name, us, calls, launches = match.groups()
            assert float(us) > 0 and float(calls) > 0, line
            seen[name] = float(launches)
    assert seen == LAUNCHES, run.stdout
