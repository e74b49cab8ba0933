"""scripts/bench_trees.sh: each benchmark runs once per tree and round with that tree's package imported, the trees
interleaved within a round, a failing run reported without stopping the others, every run's files packed into one
tarball; usage errors refused before any run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench_trees.sh"
PROBED = "gc_moe_compat/__init__.py"

PROBE = """
import argparse, json, os, sys
import gc_moe_compat
parser = argparse.ArgumentParser()
parser.add_argument("--out")
parser.add_argument("--x")
args = parser.parse_args()
open(args.out, "w").write(json.dumps({"package": gc_moe_compat.__file__, "x": args.x,
                                      "sha": os.environ.get("GC_MOE_GIT_SHA"),
                                      "dirty": os.environ.get("GC_MOE_GIT_DIRTY")}))
print("probe of", gc_moe_compat.__file__)
"""


def _tree(root: Path, name: str) -> Path:
    package = root / name / "gc_moe_compat"
    (package / "ab").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "ab" / "__init__.py").write_text("")
    (package / "ab" / "__main__.py").write_text(PROBE)  # stands in for the tree's gc-moe-ab
    return root / name


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("PYTHONPATH", None)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


def test_each_tree_runs_each_benchmark_per_round_with_its_own_package(tmp_path: Path) -> None:
    benches = tmp_path / "bench"
    benches.mkdir()
    (benches / "probe.py").write_text(PROBE)
    (benches / "fails.py").write_text("import sys; print('broken'); sys.exit(3)\n")
    a, b = _tree(tmp_path, "a"), _tree(tmp_path, "b")
    (a / "SOURCE").write_text("8c86109 8c861092addab3ab1bf89651e27c7fd1ab4074d1\n")  # as stage_base_tree.sh writes
    out = tmp_path / "out"
    run = _run("--out", str(out), "--rounds", "2", "--bench-dir", str(benches), "--tree", f"a={a}", "--tree",
               f"b={b}", "--tree", "work=.", "probe --x 7", "fails")
    ab = _run("--out", str(tmp_path / "ab"), "--tree", f"a={a}", "gc-moe-ab --x 3", "gc-moe-ab --x 4")
    assert ab.returncode == 0, ab.stderr
    # picked twice: each pick's files carry its place among the picks, so the second does not overwrite the first
    assert ab.stdout.splitlines()[1:5] == ["== gc-moe-ab-1_a_1", f"probe of {a / PROBED}", "== gc-moe-ab-2_a_1",
                                           f"probe of {a / PROBED}"]
    with tarfile.open(tmp_path / "ab" / "trees.tar.gz") as tar:
        assert [json.load(tar.extractfile(f"trees/gc-moe-ab-{i}_a_1.json"))["x"] for i in (1, 2)] == ["3", "4"]
    assert run.returncode == 1, run.stderr  # the failing benchmark; every other run still ran
    lines = run.stdout.splitlines()
    assert (f"tree a: gc_moe_compat from {a}/gc_moe_compat/__init__.py (staged from 8c86109 "
            "8c861092addab3ab1bf89651e27c7fd1ab4074d1)") in lines
    assert f"tree b: gc_moe_compat from {b}/gc_moe_compat/__init__.py" in lines
    installed = next(line for line in lines if line.startswith("tree work: "))
    assert str(tmp_path) not in installed and installed.endswith("gc_moe_compat/__init__.py")
    runs = [line.split()[1] for line in lines if line.startswith("== ")]
    order = [(r, tree, bench) for r in (1, 2) for tree in ("a", "b", "work") for bench in ("probe", "fails")]
    assert runs == [f"{bench}_{tree}_{r}" for r, tree, bench in order]
    assert sum("FAILED" in line for line in lines) == 6 and lines.count("broken") == 6
    assert not (out / "trees").exists()
    with tarfile.open(out / "trees.tar.gz") as tar:
        names = set(tar.getnames())
        records = {tree: json.load(tar.extractfile(f"trees/probe_{tree}_2.json")) for tree in ("a", "b", "work")}
    assert {f"trees/{bench}_{tree}_{r}.log" for r in (1, 2) for tree in ("a", "b", "work")
            for bench in ("probe", "fails")} <= names
    sha = "8c861092addab3ab1bf89651e27c7fd1ab4074d1"
    assert records["a"] == {"package": f"{a}/gc_moe_compat/__init__.py", "x": "7", "sha": sha, "dirty": "0"}
    assert records["b"]["package"] == f"{b}/gc_moe_compat/__init__.py" and records["b"]["sha"] is None
    assert records["work"]["package"] == installed.split(" from ")[1] and records["work"]["sha"] is None


@pytest.mark.parametrize(("args", "message"), [
    (["probe"], "at least one --tree"),
    (["--tree", "a=."], "at least one benchmark"),
    (["--tree", "a=/nonexistent", "probe"], "holds no gc_moe_compat"),
    (["--tree", "a=.", "--tree", "a=.", "probe"], "given twice"),
    (["--tree", "a b=.", "probe"], "NAME of letters"),
    (["--rounds", "0", "--tree", "a=.", "probe"], "--rounds: a positive integer"),
])
def test_usage_errors_are_refused_before_any_run(tmp_path: Path, args: list[str], message: str) -> None:
    run = _run("--out", str(tmp_path), *args)
    assert run.returncode == 2 and message in run.stderr, run.stderr
    assert not (tmp_path / "trees").exists()
