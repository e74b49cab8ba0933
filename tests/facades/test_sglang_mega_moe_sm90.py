"""SGLang 0.5.23's own Hopper Mega MoE functions against the swapped ``deep_gemm`` on H200s (issue 6).

Each test runs ``sglang_mega_moe_worker.py`` under torchrun with ``GC_MOE_SWAP=deep_gemm`` (so ``import deep_gemm``
in SGLang's files is gc-moe-compat's facade): SGLang's ``build_sm90_mega_moe_experts_weights``,
``run_sm90_mega_routed`` and ``run_mega_routed_experts`` from the real sources, every rank's ``y`` against the
quantization-faithful reference (cosine >= 0.9999, processed diff <= 1e-4 for dsv41-flash), rank-local and EP2, at
the protocol's capacity (256, docs/bench_protocol.md; with a CUDA graph capture) and at SGLang's default capacity
(8192). The SGLang files
come from ``$GC_MOE_SGLANG_SRC`` or ``.carry/sglang-0.5.23`` (``bash scripts/fetch_device_deps.sh --sglang``; carry
``.carry`` to the device); the tests skip, saying so, only when they are absent.
"""

from __future__ import annotations

import pytest
import sglang_kit
from two_rank import run_ranks

pytestmark = pytest.mark.gpu

WORKER = "sglang_mega_moe_worker.py"
HARD_TIMEOUT_S = 590
STATS_OK = "cumulative_local_expert_recv_stats = reference"


def run_worker(suite: str, nproc: int, *expected: str, env: dict[str, str] | None = None,
               args: tuple[str, ...] = ()) -> str:
    """Runs the worker's ``suite`` on ``nproc`` ranks with the swap on (skips if the SGLang files are absent)."""
    root = sglang_kit.source_dir()
    missing = sglang_kit.missing_sources(root)
    if missing:
        pytest.skip(f"SGLang {sglang_kit.VERSION} sources absent ({missing[0]}): run "
                    "`bash scripts/fetch_device_deps.sh --sglang` and carry .carry to the device")
    env = {"GC_MOE_SWAP": "deep_gemm", sglang_kit.SOURCE_ENV: str(root), "GC_MOE_SPIN_TIMEOUT_MS": "30000",
           **(env or {})}
    return run_ranks(WORKER, nproc, HARD_TIMEOUT_S, *expected, env=env, args=("--suite", suite, *args))


def test_sglang_sm90_mega_moe_rank_local() -> None:
    run_worker("local", 1, STATS_OK)


def test_sglang_sm90_mega_moe_rank_local_default_capacity() -> None:
    run_worker("local-8192", 1)


@pytest.mark.multigpu
def test_sglang_sm90_mega_moe_ep2() -> None:
    assert run_worker("ep2", 2, STATS_OK).count(STATS_OK) == 2


@pytest.mark.multigpu
def test_sglang_sm90_mega_moe_ep2_default_capacity() -> None:
    run_worker("ep2-8192", 2)
