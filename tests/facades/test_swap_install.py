"""The swap's ``.pth`` reaches site-packages: in this (editable) install and inside a built wheel."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PTH = ROOT / "shims" / "gc_moe_compat_swap.pth"


def test_pth_is_cheap_when_off() -> None:
    """The one line does an env lookup and imports nothing unless the variable is set (``import os`` is free)."""
    line = PTH.read_text()
    assert line.count("\n") == 1 and line.startswith("import os; ")
    assert 'os.environ.get("GC_MOE_SWAP", "0") not in ("", "0") and ' in line


def test_pth_installed_in_this_environment() -> None:
    installed = Path(sysconfig.get_paths()["purelib"]) / PTH.name
    assert installed.read_text() == PTH.read_text(), "reinstall: pip install -e '.[test]'"


def test_wheel_ships_pth_packages_and_kernels(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(ROOT)], check=True, timeout=300)
    (wheel,) = tmp_path.glob("gc_moe_compat-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        assert zf.read(PTH.name) == PTH.read_bytes()
    assert "gc_moe_compat/_swap_hook.py" in names
    subpackages = [p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "gc_moe_compat").rglob("__init__.py")]
    for package in subpackages:
        assert f"{package}/__init__.py" in names, f"{package} missing from the wheel"
    kernel_sources = [p.relative_to(ROOT / "kernels").as_posix() for p in (ROOT / "kernels").rglob("*.cu*")]
    shipped = [s for s in kernel_sources if not s.startswith("testing/")]
    assert shipped and len(shipped) < len(kernel_sources), "kernels/ holds no shipped or no test CUDA sources"
    for source in kernel_sources:
        if source in shipped:
            assert f"gc_moe_compat/kernels/{source}" in names, f"kernels/{source} missing from the wheel"
        else:
            assert f"gc_moe_compat/kernels/{source}" not in names, f"test kernel kernels/{source} ships in the wheel"
