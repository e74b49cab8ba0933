"""SGLang 0.5.23's own DeepEP low-latency dispatcher against the swapped ``deep_ep`` on H200s (issue 6).

Each test runs ``sglang_deepep_worker.py`` under torchrun with ``GC_MOE_SWAP=deep_ep``: SGLang's ``DeepEPDispatcher``
from the real ``token_dispatcher/deepep.py`` builds its buffer and dispatches / combines decode batches through the
facade, checked bit for bit against the torch references, on one rank and on two, in ``--deepep-mode low_latency``
and in SGLang's default ``--deepep-mode auto`` (one buffer sized for both modes; decode batches in low-latency
mode). The SGLang files come from ``$GC_MOE_SGLANG_SRC`` or ``.carry/sglang-0.5.23`` (``bash
scripts/fetch_device_deps.sh --sglang``); the tests skip, saying so, only when they are absent.
"""

from __future__ import annotations

import pytest
import sglang_deepep_kit
import sglang_kit
from two_rank import MULTI_RANKS, run_ranks

pytestmark = pytest.mark.gpu

WORKER = "sglang_deepep_worker.py"
TIMEOUT_S = 300
BIT_EXACT = "5 batches bit-exact"


def run_worker(suite: str, nproc: int, *expected: str) -> str:
    root = sglang_kit.source_dir()
    missing = sglang_kit.missing_sources(root, sglang_deepep_kit.REAL_MODULES)
    if missing:
        pytest.skip(f"SGLang {sglang_kit.VERSION} sources absent ({missing[0]}): run "
                    "`bash scripts/fetch_device_deps.sh --sglang` and carry .carry to the device")
    env = {"GC_MOE_SWAP": "deep_ep", sglang_kit.SOURCE_ENV: str(root), "GC_MOE_SPIN_TIMEOUT_MS": "30000"}
    return run_ranks(WORKER, nproc, TIMEOUT_S, *expected, env=env, args=("--suite", suite))


@pytest.mark.parametrize("nproc", [1, pytest.param(MULTI_RANKS, marks=pytest.mark.multigpu)])
def test_sglang_deepep_low_latency(nproc: int) -> None:
    assert run_worker("low_latency", nproc, BIT_EXACT).count(BIT_EXACT) == 4 * nproc


@pytest.mark.parametrize("nproc", [1, pytest.param(MULTI_RANKS, marks=pytest.mark.multigpu)])
def test_sglang_deepep_auto_mode_decodes_through_a_two_mode_buffer(nproc: int) -> None:
    assert run_worker("auto", nproc, BIT_EXACT, "--deepep-mode auto buffer").count(BIT_EXACT) == nproc
