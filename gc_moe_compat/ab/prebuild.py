"""Compile, before a run starts, every kernel its points can pick, in parallel. A fresh machine otherwise compiles
each variant at its first eager call, one after the other, inside the run. Failures are not raised here: the
operator that needs the kernel reports them itself at its first call (and the run records it as unavailable).

* GC-MoE's kernels (:func:`kernel_jobs`, :func:`prebuild`): nvcc runs as subprocesses, so threads overlap.
* The originals' JIT kernels (:func:`prebuild_originals`): DeepGEMM compiles a kernel inside its first call of each
  configuration (its heuristics pick the configuration from the token count), so one child process per point
  (``python -m gc_moe_compat.ab.prebuild_child <the run's gc-moe-ab arguments> --tokens T``) builds the operator
  as the run does, on zero weights, and calls it once at that T; the kernels land in the originals' JIT caches
  (``DG_JIT_CACHE_DIR``, Triton's cache) that the timed run then reads.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence

__all__ = ["ORIGINAL_OPS", "PORT_RETRIES", "child_command", "kernel_jobs", "prebuild", "prebuild_originals"]

ORIGINAL_OPS = ("original_deep_gemm", "composed_deepep_deepgemm")
"""The operators whose kernels the originals JIT-compile at their first call of each configuration."""
PORT_RETRIES = 2
"""Reruns of a child whose one-rank process group lost its free port to a sibling (EADDRINUSE: the port is picked
by binding port 0 and released before the group binds it)."""


def kernel_jobs(mma_types: Iterable[str], tokens: Sequence[int], num_ranks: int, topk: int, num_experts: int,
                low_latency: bool = False) -> list[tuple[str, dict[str, int]]]:
    """``(source, defines)`` of role1, role3, the pre-dispatch and every role2 variant (block size of each T per
    the operator's rule, with and without the producer warpgroup) of ``mma_types``; with ``low_latency`` also the
    ``deep_ep`` facade's low-latency kernels (the composed baseline on the facade)."""
    from gc_moe_compat.comm import ep_ll
    from gc_moe_compat.deep_gemm import _predispatch
    from gc_moe_compat.operator.heuristics import block_m_for_call
    from gc_moe_compat.operator.sm90 import role1_dispatch, role2_gemm, role3_finalize

    jobs: list[tuple[str, dict[str, int]]] = [(role1_dispatch.SOURCE, {}), (role3_finalize.SOURCE, {}),
                                              (_predispatch.SOURCE, {})]
    if low_latency:
        jobs.append((ep_ll.SOURCE, {}))
    for mma in sorted(set(mma_types)):
        for bm in sorted({block_m_for_call(t, num_ranks, topk, num_experts, mma_type=mma) for t in tokens}):
            for variant in role2_gemm.variants_of(bm, mma):
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


def child_command(argv: Sequence[str], tokens: int) -> list[str]:
    """The child process of one point: the run's own ``gc-moe-ab`` arguments, the point's ``--tokens`` last (it
    replaces the run's list), ``--ops`` limited to :data:`ORIGINAL_OPS` by the child itself."""
    return [sys.executable, "-m", "gc_moe_compat.ab.prebuild_child", *argv, "--tokens", str(tokens)]


def prebuild_originals(argv: Sequence[str], tokens: Sequence[int], workers: int = 6,
                       timeout: float = 900.0) -> list[str]:
    """One child per point (module docstring), ``workers`` at a time; one line per point (its time, or how it
    failed: the run goes on and the operator reports its own error at its first call)."""
    def one(t: int) -> str:
        start = time.monotonic()
        for _ in range(PORT_RETRIES + 1):
            try:
                proc = subprocess.run(child_command(argv, t), capture_output=True, text=True, timeout=timeout,
                                      check=False, env=dict(os.environ, PYTHONUNBUFFERED="1"))
            except subprocess.TimeoutExpired:
                return f"originals T={t}: timed out after {timeout:.0f} s"
            if proc.returncode == 0 or "EADDRINUSE" not in proc.stdout + proc.stderr:
                break
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
        status = "ok" if proc.returncode == 0 else f"rc={proc.returncode}: {tail[0][:300]}"
        return f"originals T={t}: {status} ({time.monotonic() - start:.1f} s)"

    with cf.ThreadPoolExecutor(max(1, min(workers, len(tokens)))) as pool:
        return list(pool.map(one, tokens))
