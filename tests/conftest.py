"""Skips `gpu` / `multigpu` tests where the hardware they need is absent; the shared single-rank process group.

Tests are grouped by concept (numerics/, runtime/, operator/, facades/, tools/); what they share lives in kit/
(helpers, the two-rank protocol and the torchrun worker scripts), put on ``sys.path`` here for every test, as is
bench/ for the helpers the GEMM tests share with the benchmarks (``_standalone_gemm``, ``_grouping``,
``_gemm_workload``: the standalone GEMM harness, its token grouping and workloads).
"""

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gc_moe_compat.runtime.single_rank import single_rank_group

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent / "kit"))
from two_rank import shared_gpu_ranks  # noqa: E402 - kit/ is on the path from the line above


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpus = _gpu_count()
    shared = shared_gpu_ranks()
    no_gpu = pytest.mark.skip(reason="needs an NVIDIA Hopper GPU (scripts/device_check.sh runs these on an H200)")
    few_gpus = pytest.mark.skip(reason=f"needs >= 2 GPUs on one host, found {gpus} (or one GPU shared by several "
                                       "ranks: scripts/device_check.sh --shared-gpu P)")
    for item in items:
        if "gpu" in item.keywords and gpus == 0:
            item.add_marker(no_gpu)
        if "multigpu" in item.keywords and gpus < 2 and not (shared and gpus):
            item.add_marker(few_gpus)


@pytest.fixture(scope="session")
def group() -> Iterator[dist.ProcessGroup]:
    """A single-rank gloo group on 127.0.0.1 (a free port), destroyed after the session."""
    with single_rank_group() as group:
        yield group
