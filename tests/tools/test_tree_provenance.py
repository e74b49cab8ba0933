"""scripts/tree_provenance.sh: the commit recorded here is what a copy of the tree reports there, dirty exactly where
the copy's files (tracked or untracked, not ignored) differ from that commit's tree, and nothing where no record was
carried."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "tree_provenance.sh"


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env=env).stdout.strip()


def _provenance(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(repo / "scripts" / "tree_provenance.sh"), *args], capture_output=True,
                          text=True, timeout=60)


def _repo(root: Path) -> Path:
    repo = root / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "scripts")
    (repo / ".gitignore").write_text("/.carry/\n")
    (repo / "a.py").write_text("x = 1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "one")
    return repo


def test_a_copy_names_the_recorded_commit_and_whether_its_files_differ(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    head = _git(repo, "rev-parse", "HEAD")
    made = _provenance(repo)
    assert made.returncode == 0 and (repo / ".carry" / "provenance").read_text().split()[0] == head
    # the copy on the GPU machine: these files, a git whose HEAD is an older commit
    copy = tmp_path / "copy"
    shutil.copytree(repo, copy)
    (copy / "b.py").write_text("old\n")
    _git(copy, "add", "-A")
    _git(copy, "commit", "-qm", "stale")
    (copy / "b.py").unlink()
    assert _provenance(copy, "--env").stdout.strip() == f"export GC_MOE_GIT_SHA={head} GC_MOE_GIT_DIRTY=0"
    (copy / "c.py").write_text("new\n")  # an untracked file that is not ignored is a change
    assert _provenance(copy, "--env").stdout.strip() == f"export GC_MOE_GIT_SHA={head} GC_MOE_GIT_DIRTY=1"
    (copy / "c.py").unlink()
    (copy / "a.py").write_text("x = 2\n")
    assert _provenance(copy, "--env").stdout.strip() == f"export GC_MOE_GIT_SHA={head} GC_MOE_GIT_DIRTY=1"
    (copy / "a.py").write_text("x = 1\n")
    (copy / ".carry" / "other").write_text("ignored\n")
    status = _git(copy, "status", "--porcelain")
    assert _provenance(copy, "--env").stdout.strip() == f"export GC_MOE_GIT_SHA={head} GC_MOE_GIT_DIRTY=0"
    assert _git(copy, "status", "--porcelain") == status == "D b.py"  # the copy's own index left alone


def test_without_a_record_it_prints_nothing_and_says_why(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    run = _provenance(repo, "--env")
    assert run.returncode == 0 and run.stdout == "" and "no .carry/provenance" in run.stderr
    assert _provenance(repo, "--bogus").returncode == 2


def test_both_device_scripts_export_the_recorded_commit_unless_the_caller_set_one() -> None:
    """scripts/device_check.sh and scripts/ab_device.sh both write result files: each reads the carried record."""
    line = '[[ -n "${GC_MOE_GIT_SHA:-}" ]] || eval "$(bash scripts/tree_provenance.sh --env)"'
    for script in ("device_check.sh", "ab_device.sh"):
        assert line in (SCRIPT.parent / script).read_text(), script
