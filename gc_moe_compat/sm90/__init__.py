"""SM90 (Hopper) expert GEMMs of the compute role: grouped W1 -> W2 over ring blocks on one H200.

Modules: ``heuristics`` (block size and variant from the expected tokens per expert, shared-memory budget),
``grouping`` (tokens grouped per local expert into ring blocks of BM rows, and back), ``tensormap`` (TMA
descriptors through the driver), ``gemm`` (weights prepared for the kernels, compilation of every variant, the
host entry point :class:`ExpertGemmSM90`).
"""

from .grouping import GroupedTokens, group_tokens, scatter_partials
from .heuristics import KernelConfig, select_config

__all__ = ["GroupedTokens", "KernelConfig", "group_tokens", "scatter_partials", "select_config"]
