"""The registry of compute paths (:mod:`gc_moe_compat.compute_paths`) agrees with what it names: the kernel source and
its entry points, the layer calls of the native API and the deep_gemm facade, the references' vocabulary, and the
rest of the registry (one path per recipe, per weight format)."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest

import gc_moe_compat.deep_gemm as dg
from gc_moe_compat import compute_paths, config
from gc_moe_compat.compute_paths import MMA_TYPES, PATHS, ComputePath, compute_path
from gc_moe_compat.operator import api
from gc_moe_compat.testing import reference

KERNELS_DIR = Path(__file__).resolve().parents[2] / "kernels"


@pytest.mark.parametrize("path", PATHS.values(), ids=MMA_TYPES)
def test_every_path_names_what_exists(path: ComputePath) -> None:
    source = (KERNELS_DIR / path.kernel).read_text()
    assert re.search(rf"\b{path.operator_entry}\(", source), f"{path.kernel} has no entry {path.operator_entry}"
    assert re.search(rf"\b{path.standalone_entry}\b", source), f"{path.kernel} has no entry {path.standalone_entry}"
    assert callable(getattr(api, path.native_fn)) and callable(getattr(dg, path.facade_fn))
    assert path.weight_format in typing.get_args(reference.WeightFormat)
    assert path.intermediate_quant in typing.get_args(reference.ActivationQuant)
    assert compute_path(path.name) is path


def test_the_registry_is_the_one_list_of_paths() -> None:
    assert config.MMA_TYPES == MMA_TYPES == tuple(p.name for p in PATHS.values())
    for field in ("recipe", "weight_format", "kernel", "native_fn", "facade_fn"):
        values = [getattr(p, field) for p in PATHS.values()]
        assert len(set(values)) == len(values), f"two paths share a {field}"
    assert compute_paths.FP8XFP4.fp4 and not compute_paths.FP8XFP8.fp4


def test_unknown_paths_are_refused() -> None:
    with pytest.raises(ValueError, match=r"mma_type: must be one of \('fp8xfp4', 'fp8xfp8'\) \(supported compute "
                                         r"paths\), got 'fp8xbf16'"):
        compute_path("fp8xbf16")
    with pytest.raises(TypeError, match="mma_type: must be one of .* got None"):
        compute_path(None)
