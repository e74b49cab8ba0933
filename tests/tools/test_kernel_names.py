"""Host module and kernel file are named one to one: each role / communication module compiles the kernel files whose
names start with its own, and every shipped kernel file under ``kernels/sm90/`` has such a host module.

``operator/sm90/role1_dispatch.py`` <-> ``kernels/sm90/role1_dispatch.cu``; ``role2_gemm.py`` <->
``role2_gemm_fp8xfp8.cu`` / ``role2_gemm_fp8xfp4.cu`` (one per weight format); ``role3_finalize.py`` <->
``role3_finalize.cu``; ``role4_shared.py`` <-> ``role4_shared.cu``; ``comm/ep_ll.py`` <-> ``ep_ll.cu``;
``comm/ep_normal.py`` <-> ``ep_normal.cu``;
``deep_gemm/_predispatch.py`` <-> ``predispatch.cu`` (a private module's leading underscore aside). Headers
(``.cuh``) are shared pieces and need no module.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from gc_moe_compat.comm import ep_ll, ep_normal
from gc_moe_compat.compute_paths import MMA_TYPES
from gc_moe_compat.deep_gemm import _predispatch
from gc_moe_compat.operator.sm90 import role1_dispatch, role2_gemm, role3_finalize, role4_shared

KERNELS_DIR = Path(__file__).resolve().parents[2] / "kernels"
HOST_MODULES = (role1_dispatch, role2_gemm, role3_finalize, role4_shared, ep_ll, ep_normal, _predispatch)


def compiled_sources(module: ModuleType) -> set[str]:
    """The kernel sources (relative to ``kernels/``) a host module compiles: its ``SOURCE``; role2's, its variants'
    sources, one per compute path (the registry, :mod:`gc_moe_compat.compute_paths`, names them)."""
    if module is role2_gemm:
        return {role2_gemm.Role2Variant(8, False, mma_type=mma_type).source for mma_type in MMA_TYPES}
    return {module.SOURCE}


@pytest.mark.parametrize("module", HOST_MODULES, ids=lambda m: m.__name__)
def test_a_host_module_compiles_kernels_named_like_it(module: ModuleType) -> None:
    stem = module.__name__.rsplit(".", 1)[1].lstrip("_")
    for source in compiled_sources(module):
        assert (KERNELS_DIR / source).is_file(), f"{module.__name__}: {source} does not exist"
        assert Path(source).name.startswith(stem), f"{module.__name__} compiles {source}: not named like the module"


def test_every_shipped_kernel_file_has_its_host_module() -> None:
    owned = {source for module in HOST_MODULES for source in compiled_sources(module)}
    shipped = {p.relative_to(KERNELS_DIR).as_posix() for p in (KERNELS_DIR / "sm90").glob("*.cu")}
    assert shipped == owned, f"kernel files without a host module: {sorted(shipped - owned)}"
