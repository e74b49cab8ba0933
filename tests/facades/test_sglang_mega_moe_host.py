"""SGLang 0.5.23's own Hopper Mega MoE code against the swapped ``deep_gemm`` on a host without CUDA (dry run).

The GPU test's worker (tests/kit/sglang_mega_moe_worker.py, suite ``dry-run``) runs in a fresh interpreter under
torchrun with ``GC_MOE_SWAP=deep_gemm`` on SGLang's real ``mega_moe_sm90.py`` / ``mega_moe.py`` (extracted from the
registry wheel into a temporary directory): the swap, the stubs, SGLang's weight builder and Hopper gate, its buffer
creation and cache, the pre-dispatch and the facade's checks all run; every call must stop at the operator launch
(host memory) with the staged rows equal to the reference's quantization. Skipped, saying so, only when the registry
cannot be reached and the wheel is not cached. A second run replaces the launch by the reference (worker option
``--simulate-launch``) so that the worker's own checks after a call are exercised on CPU too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import sglang_wheel
from test_sglang_mega_moe_sm90 import run_worker  # noqa: E402


@pytest.fixture(scope="module")
def sglang_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("sglang")
    try:
        sglang_wheel.extract(dest)
    except sglang_wheel.RegistryUnreachableError as exc:
        pytest.skip(str(exc))
    return dest


def test_sglang_sm90_path_reaches_the_operator_launch(sglang_src: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GC_MOE_SGLANG_SRC", str(sglang_src))
    out = run_worker("dry-run", 1, "mode: dry run", env={"CUDA_VISIBLE_DEVICES": ""})
    assert out.count("staged inputs checked") == 5


def test_sglang_worker_checks_with_a_simulated_launch(sglang_src: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's checks after a call (accuracy against the reference, cumulative statistics, T = 0) with the
    reference standing in for the launch: they pass on a correct layer (the kernels are the GPU test's)."""
    monkeypatch.setenv("GC_MOE_SGLANG_SRC", str(sglang_src))
    out = run_worker("dry-run", 1, "mode: simulated launch", env={"CUDA_VISIBLE_DEVICES": ""},
                     args=("--simulate-launch",))
    assert out.count("cosine 1.0000000") == 4 and "cumulative_local_expert_recv_stats = reference" in out
