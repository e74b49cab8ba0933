"""SGLang 0.5.23's sources from the registry wheel: the call-site tests read them, the SGLang tests run them.

The wheel (``sglang==0.5.23``, 38 MB) is downloaded once into ``~/.cache/gc_moe_compat/registry``; single files are
read out of it (:func:`read_sources`: the two files of the Mega MoE path by default, any member by its path inside
the wheel). Nothing from it is committed. ``python tests/kit/sglang_wheel.py DEST`` extracts the :data:`FILES` under
``DEST/sglang/...`` (``scripts/fetch_device_deps.sh --sglang`` does this into the git-ignored ``.carry/``, which the
device machine, having no network, gets carried).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import zipfile
from collections.abc import Iterable
from pathlib import Path

NAME, VERSION = "sglang", "0.5.23"
CACHE = Path.home() / ".cache" / "gc_moe_compat" / "registry"
FILES = ("sglang/srt/layers/moe/mega_moe_sm90.py", "sglang/srt/layers/moe/mega_moe.py")
"""The Hopper Mega MoE path (``build_sm90_mega_moe_experts_weights``, ``run_sm90_mega_routed``) and the shared
entry that calls it (``run_mega_routed_experts``, the buffer cache), in import order."""
DEEPEP_FILES = ("sglang/srt/layers/moe/token_dispatcher/base.py", "sglang/srt/layers/moe/token_dispatcher/deepep.py")
"""SGLang's DeepEP token dispatcher and the base classes it imports (tests/facades/test_sglang_deepep.py runs them)."""
CARRIED = FILES + DEEPEP_FILES
"""What :func:`extract` writes for the device (which has no network)."""


class RegistryUnreachableError(RuntimeError):
    """The wheel is not cached and the package registry cannot be reached (tests skip, naming this)."""


def _registry_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
        return True
    except OSError:
        return False


def wheel() -> Path:
    """The cached ``sglang-0.5.23-*.whl``, downloaded with pip (no dependencies) if absent.

    Raises :class:`RegistryUnreachableError` when it is absent and pypi.org cannot be reached, ``RuntimeError`` with
    pip's output when the download fails otherwise.
    """
    CACHE.mkdir(parents=True, exist_ok=True)
    cached = sorted(CACHE.glob(f"{NAME}-{VERSION}-*.whl"))
    if cached:
        return cached[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.11",
           "--platform", "manylinux_2_34_x86_64", "-q", "-d", str(CACHE), f"{NAME}=={VERSION}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        if not _registry_reachable():
            raise RegistryUnreachableError(f"the package registry (pypi.org) is unreachable, cannot fetch "
                                      f"{NAME}=={VERSION}")
        raise RuntimeError(f"pip download {NAME}=={VERSION} failed:\n{proc.stderr}")
    (path,) = CACHE.glob(f"{NAME}-{VERSION}-*.whl")
    return path


def read_sources(paths: Iterable[str] = FILES) -> dict[str, str]:
    """The text of each file of ``paths`` (default :data:`FILES`), by its path inside the wheel
    (``sglang/srt/...``); ``KeyError`` naming a path the wheel lacks."""
    with zipfile.ZipFile(wheel()) as zf:
        names = set(zf.namelist())
        found = {}
        for path in paths:
            if path not in names:
                raise KeyError(f"{path} is not in {NAME}=={VERSION}'s wheel")
            found[path] = zf.read(path).decode()
    return found


def extract(dest: Path) -> list[Path]:
    """Writes :data:`CARRIED` under ``dest`` (``dest/sglang/srt/layers/moe/...``); returns the written paths."""
    written = []
    for path, text in read_sources(CARRIED).items():
        target = Path(dest) / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        written.append(target)
    return written


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} DEST  (writes {', '.join(CARRIED)} under DEST)")
    for p in extract(Path(sys.argv[1])):
        print(p)
