"""Helpers shared by the SM90 grouped-GEMM GPU tests (FP8xFP8 and FP8xFP4): variant configs, poisoned runs, the
boundary-expert token set and the SASS / resource report of a compiled variant."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

import torch
from _grouping import GroupedTokens, group_tokens
from _standalone_gemm import ExpertGemmSM90, Workspace
from _standalone_heuristics import KernelConfig, max_stages, w2_slabs

from gc_moe_compat.operator.heuristics import W1_SLABS
from gc_moe_compat.runtime import jit
from gc_moe_compat.testing.reference import quantize_activations


def config(
    bm: int, pipelined: bool, mma_type: str = "fp8xfp8", cluster: bool = False, slabs: int | None = None
) -> KernelConfig:
    """The variant ``(bm, pipelined)`` with as many stages as shared memory holds and the heuristic's W2 task size
    unless ``slabs`` names one (``cluster``: in cluster pairs)."""
    slabs = slabs or w2_slabs(bm, mma_type)
    stages = max_stages(bm, W1_SLABS, mma_type), max_stages(bm, slabs, mma_type)
    return KernelConfig(bm, pipelined, *stages, slabs, cluster)


def run_poisoned(gemm: ExpertGemmSM90, grouped: GroupedTokens) -> Workspace:
    """Run W1 -> W2 once with every output byte poisoned first (0xFF: NaN in FP8 and BF16), then check the status."""
    ws = gemm.workspace(grouped)
    for t in (ws.inter, ws.out, ws.inter_sf_t):
        t.view(torch.uint8).fill_(0xFF)
    gemm.run(grouped, ws)
    torch.cuda.synchronize()
    gemm.check()
    return ws


@dataclass(frozen=True)
class BoundaryTokens:
    """Tokens routed one slot each to experts holding 0, 1, BM and BM+1 rows, grouped into ring blocks of BM."""

    x_dequant: torch.Tensor  # [n, H] FP32 values of the E4M3 activations the kernel reads
    topk_weights: torch.Tensor  # [n, 1]
    grouped: GroupedTokens
    block_m: int

    def rows_of(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(mask over the grouped rows of ``expert``, the source token of each of those rows)."""
        g = self.grouped
        rows = (g.row_token >= 0) & (torch.repeat_interleave(g.blocks[:, 0].long(), self.block_m) == expert)
        return rows, g.row_token[rows]


def boundary_tokens(bm: int, hidden: int, gen: torch.Generator, counts: list[int] | None = None) -> BoundaryTokens:
    """Fresh activations (FP8, FP32 1x128 scales) for experts with ``counts`` rows (default: the boundary experts
    0, 1, BM, BM+1), drawn from ``gen``."""
    device = gen.device
    counts = counts or [0, 1, bm, bm + 1]
    n = sum(counts)
    x = torch.randn(n, hidden, generator=gen, device=device) * 2
    idx = torch.repeat_interleave(torch.arange(len(counts), device=device), torch.tensor(counts, device=device))
    idx = idx[torch.randperm(n, generator=gen, device=device)].unsqueeze(1)
    weights = torch.rand(n, 1, generator=gen, device=device) + 0.5
    x_fp8, x_sf = quantize_activations(x, "fp32_128")
    grouped = group_tokens(x_fp8, x_sf, idx, weights, len(counts), bm)
    return BoundaryTokens(x_fp8.float() * x_sf.repeat_interleave(128, dim=1), weights, grouped, bm)


def sass_report(source: str, defines: dict[str, int], kernel: str, ops: tuple[str, ...]
                ) -> tuple[jit.KernelResources, dict[str, int]]:
    """Compile one variant and return its resource report and how often each SASS op in ``ops`` occurs."""
    cuobjdump = shutil.which("cuobjdump") or "/usr/local/cuda/bin/cuobjdump"
    cubin = jit.compile_cubin(source, defines)
    sass = subprocess.run([cuobjdump, "--dump-sass", str(cubin.path)], capture_output=True, text=True, check=True)
    return cubin.resources[kernel], {op: sass.stdout.count(op) for op in ops}
