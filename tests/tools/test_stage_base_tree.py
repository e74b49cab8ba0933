"""scripts/stage_base_tree.sh: a commit's package staged importable (kernels inside it), its SOURCE, the refusals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts/stage_base_tree.sh"


def _git_checkout() -> bool:
    done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "HEAD^{commit}"], capture_output=True)
    return done.returncode == 0


pytestmark = pytest.mark.skipif(not _git_checkout(), reason="not a git checkout: nothing to archive")


def _stage(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True)


def test_a_staged_commit_imports_with_its_kernels(tmp_path: Path) -> None:
    dest = tmp_path / "base"
    done = _stage("HEAD", "--dest", str(dest))
    assert done.returncode == 0, done.stderr
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert (dest / "SOURCE").read_text().split() == ["HEAD", head.strip()]
    probe = ("import gc_moe_compat, importlib.resources as r; print(gc_moe_compat.__file__); "
             "print((r.files('gc_moe_compat.kernels') / 'sm90' / 'ep_ll.cu').is_file())")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path,
                         env={"PYTHONPATH": str(dest), "PATH": "/usr/bin:/bin"}).stdout.split()
    assert out == [str(dest / "gc_moe_compat" / "__init__.py"), "True"]
    assert _stage("HEAD", "--dest", str(dest)).returncode == 0  # an earlier staging is replaced


def test_refusals(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("not a staging")
    done = _stage("HEAD", "--dest", str(foreign))
    assert done.returncode == 2 and "holds no earlier staging" in done.stderr
    assert (foreign / "keep.txt").read_text() == "not a staging"
    assert _stage().returncode == 2
    assert _stage("HEAD", "HEAD~1").returncode == 2
    assert _stage("no-such-ref-xyz", "--dest", str(tmp_path / "x")).returncode != 0
