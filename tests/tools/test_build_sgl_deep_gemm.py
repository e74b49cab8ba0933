"""scripts/build_sgl_deep_gemm.sh's staging on the host (the build needs a CUDA torch: it runs on the GPU host): every
module of sgl_deep_gemm/ lands beside its __init__.py, and the source line names a commit only of a real checkout."""

from __future__ import annotations

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build_sgl_deep_gemm.sh"
FILES = ("sgl_deep_gemm/__init__.py", "sgl_deep_gemm/cuda_helpers.py", "sgl_deep_gemm/VERSION", "csrc/tvm_ffi_api.cpp",
         "csrc/apis/sm90_mega.hpp", "deep_gemm/include/deep_gemm/impls/sm90_fp8_mega_moe.cuh",
         "deep_gemm/mega/__init__.py", "deep_gemm/utils/__init__.py", "deep_gemm/testing/__init__.py",
         "deep_gemm/legacy/__init__.py", "third-party/cutlass/include/cute/x.h",
         "third-party/cutlass/include/cutlass/x.h", "third-party/fmt/include/fmt/x.h")


def _tree(root: Path) -> Path:
    """A stand-in of the SM90 Mega MoE branch's tree (PR 323's sgl_deep_gemm/ has a second module)."""
    for name in FILES:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("1.0\n" if name.endswith("VERSION") else "# stand-in\n")
    return root


def _stage(src: Path, dest: Path, *more: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), "--src", str(src), "--dest", str(dest), *more], capture_output=True,
                          text=True, timeout=60)


def test_stages_every_module_beside_init_and_names_no_enclosing_commit(tmp_path: Path) -> None:
    outer = tmp_path / "outer"
    src = _tree(outer / "tree")
    for cmd in (["init", "-q"], ["-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "--allow-empty", "-mo"]):
        subprocess.run(["git", "-C", str(outer), *cmd], check=True, capture_output=True)
    out = _stage(src, tmp_path / "stage")
    assert out.returncode == 0, out.stderr
    package = tmp_path / "stage" / "deep_gemm"
    assert (package / "__init__.py").is_file() and (package / "cuda_helpers.py").is_file()
    assert "a tree that is not a git checkout" in (tmp_path / "stage" / "SOURCE").read_text()
    for cmd in (["init", "-q"], ["add", "."], ["-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "s"]):
        subprocess.run(["git", "-C", str(src), *cmd], check=True, capture_output=True)
    head = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert _stage(src, tmp_path / "stage").returncode == 0
    assert f"at {head}" in (tmp_path / "stage" / "SOURCE").read_text()


def test_a_second_staging_links_the_first_ones_third_party(tmp_path: Path) -> None:
    """--third-party-of: two stagings travel together within the device tool's 64 MiB; the second's cutlass and fmt
    are the first's through a relative link (valid wherever both folders are carried), and a staging elsewhere than
    beside it is refused."""
    src = _tree(tmp_path / "tree")
    assert _stage(src, tmp_path / "carry" / "first").returncode == 0
    out = _stage(src, tmp_path / "carry" / "second", "--third-party-of", str(tmp_path / "carry" / "first"))
    assert out.returncode == 0, out.stderr
    second = tmp_path / "carry" / "second"
    assert (second / "third-party").is_symlink() and str((second / "third-party").readlink()) == "../first/third-party"
    assert (second / "deep_gemm" / "include" / "cute" / "x.h").read_text() == "# stand-in\n"
    assert "third-party linked to ../first/third-party" in (second / "SOURCE").read_text()
    elsewhere = _stage(src, tmp_path / "other" / "third", "--third-party-of", str(tmp_path / "carry" / "first"))
    assert elsewhere.returncode != 0 and "is not beside --dest" in elsewhere.stderr
