"""The GC_MOE_SWAP import hook in fresh interpreters: on, off, partial, bad values, originals beside the facade.

Each case runs ``sys.executable -c ...`` with its own environment, so the ``.pth`` installed with the package sees the
variable at interpreter start exactly as a serving process does. A tiny stand-in ``deep_gemm`` / ``deep_ep`` on
``PYTHONPATH`` plays the installed originals.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gc_moe_compat.swap import MODULES

FACADE = "gc_moe_compat.deep_gemm"
EP_FACADE = "gc_moe_compat.deep_ep"


@pytest.fixture(scope="module")
def originals_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stand-ins for the real packages: relative imports only, like both DeepGEMM builds."""
    root = tmp_path_factory.mktemp("originals")
    pkg = root / "deep_gemm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from . import _impl\nfrom ._impl import fp8_gemm_nt\nORIGINAL = True\n")
    (pkg / "_impl.py").write_text("def fp8_gemm_nt(a, b, d):\n    return 'original fp8_gemm_nt'\n")
    (pkg / "utils.py").write_text("from . import _impl\nWHO = 'original utils'\n")
    (root / "deep_ep").mkdir()
    (root / "deep_ep" / "__init__.py").write_text(
        "ORIGINAL = True\nclass ElasticBuffer:\n    WHO = 'original ElasticBuffer'\n")
    return root


def _run(code: str, swap: str | None, path: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GC_MOE_SWAP", "PYTHONPATH")}
    if swap is not None:
        env["GC_MOE_SWAP"] = swap
    if path is not None:
        env["PYTHONPATH"] = str(path)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=120)


def _ok(code: str, swap: str | None, path: Path | None = None) -> str:
    proc = _run(code, swap, path)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("swap", [None, "0", ""])
def test_off_imports_nothing_and_keeps_originals(originals_dir: Path, swap: str | None) -> None:
    out = _ok("""
        import sys
        print('gc_moe_compat' in sys.modules)
        import deep_gemm, deep_ep
        print(deep_gemm.__name__, deep_gemm.ORIGINAL, deep_ep.ORIGINAL)
    """, swap, originals_dir)
    assert out.split() == ["False", "deep_gemm", "True", "True"]


@pytest.mark.parametrize("swap", ["1", "deep_gemm"])
def test_deep_gemm_swapped_with_original_beside(originals_dir: Path, swap: str) -> None:
    out = _ok("""
        import sys
        import deep_gemm
        import deep_gemm.mega
        from deep_gemm import fp8_mega_moe, mega_moe_pre_dispatch_sm90
        import deep_gemm.utils
        from gc_moe_compat import originals
        print(deep_gemm.__name__, deep_gemm.mega.__name__, fp8_mega_moe.__module__)
        print(deep_gemm.fp8_gemm_nt(1, 2, 3).replace(' ', '_'))
        print(deep_gemm.utils.WHO.replace(' ', '_'), deep_gemm.utils.__name__)
        print(originals.load('deep_gemm').ORIGINAL, sys.modules['deep_gemm'] is deep_gemm)
    """, swap, originals_dir)
    assert out.split() == [
        FACADE, f"{FACADE}.mega", f"{FACADE}._mega",
        "original_fp8_gemm_nt",
        "original_utils", "gc_moe_compat.originals.deep_gemm.utils",
        "True", "True",
    ]


@pytest.mark.parametrize(
    ("swapped", "other", "facade"), [("deep_gemm", "deep_ep", FACADE), ("deep_ep", "deep_gemm", EP_FACADE)]
)
def test_swap_one_leaves_the_other(originals_dir: Path, swapped: str, other: str, facade: str) -> None:
    out = _ok(f"import deep_gemm, deep_ep; print({swapped}.__name__, {other}.ORIGINAL)", swapped, originals_dir)
    assert out.split() == [facade, "True"]


def test_every_swappable_module_has_a_facade() -> None:
    """The hook maps each name of MODULES to ``gc_moe_compat.<name>`` unconditionally (no "missing facade" path)."""
    assert all(importlib.util.find_spec(f"gc_moe_compat.{name}") is not None for name in MODULES)


@pytest.mark.parametrize("swap", ["1", "deep_ep"])
def test_deep_ep_swapped_with_original_beside(originals_dir: Path, swap: str) -> None:
    out = _ok("""
        import sys
        import deep_ep
        from deep_ep import Buffer, Config
        import gc_moe_compat.deep_ep as facade
        from gc_moe_compat import originals
        print(deep_ep.__name__, deep_ep is facade, Buffer is facade.Buffer, Config is facade.Config)
        print(Buffer.__module__, Config.__module__)
        original = originals.load('deep_ep')
        print(deep_ep.ElasticBuffer.WHO.replace(' ', '_'), deep_ep.ElasticBuffer is original.ElasticBuffer)
        print(original.ORIGINAL, sys.modules['deep_ep'] is deep_ep)
    """, swap, originals_dir)
    assert out.split() == [
        EP_FACADE, "True", "True", "True",
        f"{EP_FACADE}._buffer", f"{EP_FACADE}._config",
        "original_ElasticBuffer", "True",
        "True", "True",
    ]


def test_deep_ep_forwarding_without_original() -> None:
    out = _ok("""
        import deep_ep
        from deep_ep import Buffer, MissingOriginalError
        print(deep_ep.__name__, Buffer.__module__, hasattr(deep_ep, 'ElasticBuffer'))
        try:
            deep_ep.ElasticBuffer
        except MissingOriginalError as exc:
            print(type(exc).__name__, isinstance(exc, AttributeError), '|', exc)
    """, "deep_ep")
    lines = out.splitlines()
    assert lines[0] == f"{EP_FACADE} {EP_FACADE}._buffer False"
    assert lines[1].startswith("MissingOriginalError True | deep_ep.ElasticBuffer is not part of gc-moe-compat's ")
    assert "no original deep_ep could be loaded" in lines[1] and "sgl-deep-ep==0.1.2.post1" in lines[1]


def test_forwarding_without_original() -> None:
    out = _ok("""
        import deep_gemm
        print(hasattr(deep_gemm, 'get_compile_mode'))
        try:
            deep_gemm.fp8_gemm_nt
        except AttributeError as exc:
            print(type(exc).__name__, '|', exc)
        try:
            import deep_gemm.utils
        except ImportError as exc:
            print(type(exc).__name__, '|', exc)
    """, "deep_gemm")
    lines = out.splitlines()
    assert lines[0] == "False"
    assert lines[1].startswith("MissingOriginalError | deep_gemm.fp8_gemm_nt is not part of gc-moe-compat's Mega MoE")
    assert "sgl-deep-gemm==0.2.3.post2" in lines[1] and "deepinfer-gemm==2.8.2" in lines[1]
    assert lines[2].startswith("ModuleNotFoundError | No module named 'deep_gemm.utils': the gc_moe_compat.deep_gemm "
                               "facade has no 'utils'")


@pytest.mark.parametrize("value", ["bogus", "true", "deep_gemm,deep_ep", "2"])
def test_bad_value_fails_on_import_only(originals_dir: Path, value: str) -> None:
    quiet = _run("import json; print('fine')", value, originals_dir)  # unrelated programs are unaffected, silently
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, "fine\n", "")
    out = _ok("""
        try:
            import deep_gemm
        except ImportError:
            print('swallowed as ImportError')
        except RuntimeError as exc:
            print(type(exc).__name__, '|', exc)
    """, value, originals_dir)
    assert out == (f"SwapConfigError | GC_MOE_SWAP={value!r} is not a valid value: use 1 (deep_gemm and deep_ep), "
                   "deep_gemm, deep_ep, or 0 / unset (off)\n")
    check = _run("from gc_moe_compat.swap import main; raise SystemExit(main(['--check']))", value)
    assert check.returncode == 2 and "configuration error" in check.stdout


def test_logs_once() -> None:
    proc = _run("""
        import logging
        logging.basicConfig(level=logging.INFO, format='%(name)s %(message)s')
        import deep_gemm, deep_gemm.mega
        import importlib; importlib.reload(deep_gemm.mega)
    """, "1")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("gc_moe_compat.swap")]
    assert lines == ["gc_moe_compat.swap gc_moe_compat.swap (GC_MOE_SWAP=1): deep_gemm -> gc_moe_compat.deep_gemm, "
                     "deep_ep -> gc_moe_compat.deep_ep"]


def test_check_command(originals_dir: Path) -> None:
    env = {**os.environ, "GC_MOE_SWAP": "deep_gemm", "PYTHONPATH": str(originals_dir)}
    proc = subprocess.run([sys.executable, "-m", "gc_moe_compat.swap", "--check"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert lines[:2] == ["GC_MOE_SWAP='deep_gemm'", "hook: installed, swapping deep_gemm"]
    assert lines[2].startswith(f"deep_gemm: GC-MoE facade {FACADE} (")
    assert lines[2].endswith(f"original: {originals_dir / 'deep_gemm' / '__init__.py'}")
    assert lines[3] == f"deep_ep: original ({originals_dir / 'deep_ep' / '__init__.py'})"


def test_check_command_both(originals_dir: Path) -> None:
    env = {**os.environ, "GC_MOE_SWAP": "1", "PYTHONPATH": str(originals_dir)}
    proc = subprocess.run([sys.executable, "-m", "gc_moe_compat.swap", "--check"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert lines[1] == "hook: installed, swapping deep_gemm, deep_ep"
    assert lines[3].startswith(f"deep_ep: GC-MoE facade {EP_FACADE} (")
    assert lines[3].endswith(f"original: {originals_dir / 'deep_ep' / '__init__.py'}")


@pytest.mark.parametrize("swap", [None, "0"])
def test_check_command_off_says_how_to_swap(originals_dir: Path, swap: str | None) -> None:
    """Off, the installed hook does nothing: --check says so and names the value that swaps."""
    proc = _run("from gc_moe_compat.swap import main; raise SystemExit(main(['--check']))", swap, originals_dir)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[1] == "off: the real packages load; set GC_MOE_SWAP=1 to swap"
    assert lines[2] == f"deep_gemm: original ({originals_dir / 'deep_gemm' / '__init__.py'})"


@pytest.mark.parametrize(("value", "status", "start"), [
    (None, 0, "off: the real packages load; gc_moe_compat_swap.pth is missing from site-packages"),
    ("1", 2, "hook: not installed: GC_MOE_SWAP is set but gc_moe_compat_swap.pth is missing"),
    ("bogus", 2, "hook: not installed: GC_MOE_SWAP is set but gc_moe_compat_swap.pth is missing"),
])
def test_check_without_the_pth_names_the_reinstall(monkeypatch: pytest.MonkeyPatch, value: str | None, status: int,
                                                   start: str) -> None:
    from gc_moe_compat import swap

    monkeypatch.setattr(swap, "installed", lambda: None)
    monkeypatch.setattr(swap, "pth_location", lambda: None)
    line, got = swap._hook_line(value)
    assert (got, line.startswith(start), line.endswith("(python -m pip install -e .)")) == (status, True, True)


def test_pth_location_is_this_environments_hook() -> None:
    from gc_moe_compat import swap

    where = swap.pth_location()
    assert where is not None and Path(where).read_text().startswith("import os; os.environ.get(\"GC_MOE_SWAP\"")
