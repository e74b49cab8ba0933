"""Setuptools hook: ship ``shims/gc_moe_compat_swap.pth`` at the top of site-packages (wheel and editable).

Besides the package list (found here so that no subpackage is left out), everything is declared in
``pyproject.toml``. A ``.pth`` must sit in the site directory itself, which no
declarative setuptools option can target, so ``build_py`` copies it into the build root next to the packages (wheel
builds), and ``editable_wheel`` copies it into the root of the editable wheel it assembles (``pip install -e``).
``tests/facades/test_swap_install.py`` checks both.
"""

import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = Path(__file__).resolve().parent / "shims" / "gc_moe_compat_swap.pth"


class BuildPyWithPth(build_py):
    """``build_py`` that also places the swap's ``.pth`` in the build root (site-packages once installed)."""

    def run(self) -> None:
        super().run()
        if not self.editable_mode:
            self.copy_file(str(PTH), str(Path(self.build_lib) / PTH.name), preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH.name)]


class EditableWheelWithPth(editable_wheel):
    """``editable_wheel`` that adds the ``.pth`` to the editable wheel's root (setuptools >= 64 internals)."""

    def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):
        result = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
        shutil.copyfile(PTH, Path(unpacked_wheel) / PTH.name)
        return result


# Every subpackage of gc_moe_compat, found rather than listed so none is left out of the wheel, plus kernels/.
PACKAGES = [*find_packages(include=["gc_moe_compat", "gc_moe_compat.*"]), "gc_moe_compat.kernels"]

setup(packages=PACKAGES, cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
