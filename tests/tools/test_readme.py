"""The README a user reads: short, its two commands the ones CI runs, every file it names present, and its map of the
tree complete (every top-level folder, every tests/ folder, every script) with no stale entry."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
MAX_LINES = 150


def _tracked() -> list[str]:
    out = subprocess.run(["git", "-C", str(REPO), "ls-files"], capture_output=True, text=True, check=True).stdout
    return out.split()


def _map() -> str:
    section = README[README.index("## Where things live"):]
    return section[section.index("```") + 3: section.rindex("```")]


def test_the_readme_is_short() -> None:
    assert README.count("\n") <= MAX_LINES


def test_ci_runs_the_readmes_two_commands_verbatim() -> None:
    lines = (REPO / ".ci/run").read_text().splitlines()
    commands = [line for line in lines if line and not line.startswith(("#", "set ", "cd "))]
    assert len(commands) == 2
    for command in commands:
        assert command in README.splitlines(), command


def test_every_file_the_readme_names_exists() -> None:
    names = {t for t in re.findall(r"`([^`\s]+)`", README) if re.fullmatch(r"[\w.\-/]+(\.(py|md|sh|json|png)|/)", t)}
    assert names
    bases = (REPO, REPO / "bench" / "results", REPO / "scripts")
    missing = sorted(n for n in names if not any((b / n).exists() for b in bases))
    assert missing == []


def test_the_map_covers_the_tree() -> None:
    tree = _map()
    words = set(re.findall(r"[\w.\-]+/?", tree))
    tracked = _tracked()
    top = {p.split("/")[0] + "/" for p in tracked if "/" in p and not p.startswith(".")}
    tests = {p.split("/")[1] + "/" for p in tracked if p.startswith("tests/") and p.count("/") >= 2}
    scripts = {Path(p).name for p in tracked if p.startswith("scripts/") and p.count("/") == 1
               and p.endswith((".sh", ".py"))}
    listed_scripts = {w for w in words if w.endswith((".sh", ".py"))}
    assert sorted(top - words) == []
    assert sorted(tests - words) == []
    assert sorted(scripts - listed_scripts - {"device_summary.py"}) == []  # the map's "..." stands for the last one


def test_the_maps_entries_exist() -> None:
    tracked = _tracked()
    dirs = {part + "/" for p in tracked for part in Path(p).parent.parts}
    files = {Path(p).name for p in tracked}
    stale = [w for w in re.findall(r"\b[a-z_][\w\-]*(?:\.(?:py|sh|md)|/)", _map()) if w not in dirs | files]
    assert stale == []
