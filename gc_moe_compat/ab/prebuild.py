"""Compile, before a run starts, every kernel variant its points can pick, in parallel threads (nvcc runs as
subprocesses, so threads overlap). A fresh machine otherwise compiles each variant at its first eager call, one
after the other, inside the run. Failures are not raised here: the operator that needs the kernel reports them
itself at its first call (and the run records it as unavailable)."""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Iterable, Sequence

__all__ = ["kernel_jobs", "prebuild"]


def kernel_jobs(mma_types: Iterable[str], tokens: Sequence[int], num_ranks: int, topk: int, num_experts: int
                ) -> list[tuple[str, dict[str, int]]]:
    """``(source, defines)`` of role1, role3, the pre-dispatch and every role2 variant (block size of each T per
    the operator's rule, with and without the producer warpgroup) of ``mma_types``."""
    from gc_moe_compat.deep_gemm import _predispatch
    from gc_moe_compat.operator.heuristics import block_m_for_call
    from gc_moe_compat.operator.sm90 import role1_dispatch, role2_gemm, role3_finalize

    jobs: list[tuple[str, dict[str, int]]] = [(role1_dispatch.SOURCE, {}), (role3_finalize.SOURCE, {}),
                                              (_predispatch.SOURCE, {})]
    bms = sorted({block_m_for_call(t, num_ranks, topk, num_experts) for t in tokens})
    for mma in sorted(set(mma_types)):
        for bm in bms:
            for pipelined in (False, True):
                variant = role2_gemm.Role2Variant(bm, pipelined, mma_type=mma)
                jobs.append((variant.source, variant.defines))
    return jobs


def prebuild(jobs: Sequence[tuple[str, dict[str, int]]], workers: int = 8) -> list[str]:
    """Compile ``jobs`` into the shared cubin cache; one line per job (cached, built, or the error)."""
    from gc_moe_compat.runtime import jit

    def one(job: tuple[str, dict[str, int]]) -> str:
        source, defines = job
        try:
            cubin = jit.compile_cubin(source, defines)
        except Exception as exc:  # noqa: BLE001 - reported by the operator that needs it
            return f"{source} {defines}: FAILED {type(exc).__name__}: {str(exc)[:200]}"
        return f"{source} {defines}: {'cached' if cubin.from_cache else 'built'}"

    with cf.ThreadPoolExecutor(max(1, min(workers, len(jobs)))) as pool:
        return list(pool.map(one, jobs))
