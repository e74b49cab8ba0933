"""Skips `gpu` / `multigpu` tests where the hardware they need is absent."""

import pytest
import torch


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpus = _gpu_count()
    no_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (scripts/device_check.sh runs it on the lent H200)")
    few_gpus = pytest.mark.skip(reason=f"needs >= 2 GPUs, found {gpus} (nvidia-h200-x2)")
    for item in items:
        if "gpu" in item.keywords and gpus == 0:
            item.add_marker(no_gpu)
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(few_gpus)
