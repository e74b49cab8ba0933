"""scripts/run_deepep_legacy_tests.sh on a stand-in DeepEP checkout and a stand-in Python: after a failed test the
next one waits for the GPU to accept a new CUDA client, and is NOT RUN (with the reason) when it never does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _checkout(tmp_path: Path) -> Path:
    """A DeepEP-shaped folder whose first legacy test fails and whose second passes."""
    deepep = tmp_path / "DeepEP"
    (deepep / "deep_ep" / "utils").mkdir(parents=True)
    legacy = deepep / "tests" / "legacy"
    legacy.mkdir(parents=True)
    (legacy / "test_a.py").write_text("import sys\nprint('a ran')\nsys.exit(1)\n")
    (legacy / "test_b.py").write_text("print('b ran')\n")
    return deepep


def _python(tmp_path: Path, gpu_accepts: bool) -> Path:
    """A stand-in interpreter: the GPU probe succeeds or fails as told, the swap check and device count answer
    without torch, everything else is the real interpreter."""
    fake = tmp_path / "python"
    probe_rc = 0 if gpu_accepts else 1
    fake.write_text(f"""#!/usr/bin/env bash
case "$*" in
  *torch.zeros*) echo probe >> {tmp_path}/probes.log; exit {probe_rc} ;;
  *device_count*) echo 1; exit 0 ;;
  *gc_moe_compat.swap*) echo swap; exit 0 ;;
esac
exec {sys.executable} "$@"
""")
    fake.chmod(0o755)
    return fake


def _run(tmp_path: Path, gpu_accepts: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": str(_python(tmp_path, gpu_accepts)), "GC_MOE_GPU_READY_S": "3"}
    return subprocess.run(["bash", str(ROOT / "scripts" / "run_deepep_legacy_tests.sh"), "--deepep",
                           str(_checkout(tmp_path)), "--logs", str(tmp_path / "logs"), "--tests",
                           "test_a.py test_b.py"], capture_output=True, text=True, env=env, timeout=60)


def test_after_a_failed_test_the_next_waits_for_the_gpu_and_runs(tmp_path: Path) -> None:
    out = _run(tmp_path, gpu_accepts=True)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "FAIL test_a.py rc=1" in out.stdout and "PASS test_b.py rc=0" in out.stdout
    assert (tmp_path / "probes.log").read_text().count("probe") == 1  # probed once, after the failure only
    assert "b ran" in (tmp_path / "logs" / "test_b.log").read_text()


def test_a_gpu_that_keeps_refusing_clients_leaves_the_next_test_not_run_with_the_reason(tmp_path: Path) -> None:
    out = _run(tmp_path, gpu_accepts=False)
    assert out.returncode == 1, out.stdout + out.stderr
    reason = "the GPU refused new CUDA clients for 3 s after a failed test"
    assert f"NOT RUN test_b.py: {reason}" in out.stdout
    assert (tmp_path / "logs" / "test_b.log").read_text().strip() == f"NOT RUN: {reason}"
    assert (tmp_path / "probes.log").read_text().count("probe") >= 2  # polled, not given up at once
