"""bench/_common.py's GPU check: on a machine without the GPUs a benchmark measures on, every script ends with one
line that says what it needs (in GPUs, not machine names) instead of a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import _common  # noqa: E402 - bench/ is a script folder, put on the path above

SCRIPTS = sorted(p for p in (REPO / "bench").glob("*.py") if not p.name.startswith("_"))


def test_shortfall_speaks_of_gpus() -> None:
    assert _common.gpu_shortfall("x", 1, 1) is None and _common.gpu_shortfall("x", 2, 3) is None
    assert _common.gpu_shortfall("x", 1, 0) == "x: needs a CUDA GPU (torch sees no CUDA device)"
    assert _common.gpu_shortfall("x", 2, 1, "try --dry-run") == "x: needs 2 GPUs on one host (found 1); try --dry-run"


def test_every_benchmark_checks_its_gpus_first() -> None:
    assert SCRIPTS
    missing = [p.name for p in SCRIPTS if "require_gpus(" not in p.read_text()]
    assert missing == []
    named = [p.name for p in SCRIPTS if "nvidia-h200" in p.read_text()]
    assert named == []  # users have GPUs, not the lent machines' kind names


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message of a machine without a CUDA GPU")
@pytest.mark.parametrize("script", ["runtime_sm90.py", "operator_sm90.py"])
def test_a_benchmark_on_a_cpu_machine_says_it_needs_a_gpu(script: str, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "bench" / script), "--out", str(tmp_path / "r.json")],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    need = "needs 2 GPUs on one host" if script == "operator_sm90.py" else "needs a CUDA GPU"
    assert proc.stderr.strip() == f"{script[:-3]}: {need} (torch sees no CUDA device)"
    assert not (tmp_path / "r.json").exists()
