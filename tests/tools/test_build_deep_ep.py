"""scripts/build_deep_ep.sh's staging on the host (the build itself needs a CUDA torch: it runs on the GPU host):
from a checkout or a git ref, what it refuses, and the export it prints."""

from __future__ import annotations

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build_deep_ep.sh"


def _run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=60)


def _checkout(root: Path) -> Path:
    """A stand-in DeepEP checkout (setup.py, deep_ep/, csrc/) committed in a git repository."""
    (root / "deep_ep").mkdir(parents=True)
    (root / "csrc").mkdir()
    (root / "setup.py").write_text("# stand-in\n")
    (root / "deep_ep" / "__init__.py").write_text("")
    (root / "csrc" / "deep_ep.cpp").write_text("// stand-in\n")
    for cmd in (["init", "-q"], ["add", "."], ["-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "s"],
                ["tag", "v1.2.1"]):
        subprocess.run(["git", "-C", str(root), *cmd], check=True, capture_output=True)
    return root


def test_stages_a_checkout_and_a_git_ref(tmp_path: Path) -> None:
    src = _checkout(tmp_path / "DeepEP")
    dest = tmp_path / "stage"
    out = _run("--src", src, "--dest", dest)
    assert out.returncode == 0, out.stderr
    assert (dest / "setup.py").is_file() and (dest / "csrc" / "deep_ep.cpp").is_file() and not (dest / ".git").exists()
    assert (dest / "SOURCE").read_text().split()[0] == str(src)
    out = _run("--git-dir", src / ".git", "--ref", "v1.2.1", "--dest", dest)  # replaces the earlier staging
    assert out.returncode == 0, out.stderr
    commit = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert (dest / "SOURCE").read_text().split()[1:] == ["v1.2.1", commit.strip()]
    assert _run("--env", "--dest", dest).stdout.startswith(f"export PYTHONPATH={dest}")


def test_a_restaged_or_plain_tree_names_no_enclosing_repositorys_commit(tmp_path: Path) -> None:
    """Staging from an earlier staging keeps its ref and commit; a plain tree inside another repository (the
    project's .carry/) records "unknown", never the enclosing repository's HEAD."""
    src = _checkout(tmp_path / "DeepEP")
    first, second = tmp_path / "outer" / "stage", tmp_path / "again"
    assert _run("--git-dir", src / ".git", "--ref", "v1.2.1", "--dest", first).returncode == 0
    outer = tmp_path / "outer"
    for cmd in (["init", "-q"], ["-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "--allow-empty", "-mo"]):
        subprocess.run(["git", "-C", str(outer), *cmd], check=True, capture_output=True)
    out = _run("--src", first, "--dest", second)
    assert out.returncode == 0, out.stderr
    assert (second / "SOURCE").read_text() == (first / "SOURCE").read_text()
    (first / "SOURCE").unlink()
    assert _run("--src", first, "--dest", second).returncode == 0
    assert (second / "SOURCE").read_text().split() == [str(first), "unknown"]


def test_refuses_what_it_cannot_stage_or_build(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    src = _checkout(tmp_path / "DeepEP")
    cases = [
        (("--src", tmp_path / "nothing", "--dest", tmp_path / "a"), "is not a DeepEP checkout"),
        (("--git-dir", src / ".git", "--dest", tmp_path / "a"), "--git-dir needs --ref"),
        (("--src", src, "--git-dir", src / ".git", "--ref", "v1.2.1"), "exclude each other"),
        (("--src", src, "--dest", other), "holds no earlier staging"),
        (("--build", "--dest", tmp_path / "empty"), "nothing staged"),
        (("--bogus",), "unknown argument --bogus"),
    ]
    for args, message in cases:
        out = _run(*args)
        assert out.returncode != 0 and message in out.stderr, (args, out.stderr)
    assert (other / "keep.txt").read_text() == "mine"  # a folder that is not a staging is never cleared
