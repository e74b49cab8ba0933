"""``get_num_sms`` / ``set_num_sms`` and ``get_block_m_for_mega_moe``: pure-host settings and heuristics.

``set_num_sms`` records how many SMs the Mega MoE operator may use in this process (DeepGEMM keeps the same
process-wide value; SGLang lowers it around its Mega MoE calls on Blackwell). The operator splits that budget into
its communication and compute green contexts.
"""

from __future__ import annotations

import torch

from gc_moe_compat.deep_gemm import _checks
from gc_moe_compat.operator.heuristics import BLOCK_M_CANDIDATES, block_m_for_call

__all__ = ["BLOCK_M_CANDIDATES", "get_block_m_for_mega_moe", "get_num_sms", "set_num_sms"]

_num_sms: int | None = None


def _device_num_sms() -> int | None:
    """SM count of the current CUDA device, or None on a host without one."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def get_num_sms() -> int:
    """SMs the operator may use: the value last set, else every SM of the current device.

    Raises RuntimeError on a host with no CUDA device when nothing was set (there is no default to report).
    """
    if _num_sms is not None:
        return _num_sms
    device = _device_num_sms()
    if device is None:
        raise RuntimeError("get_num_sms: no CUDA device is visible and set_num_sms() was not called")
    return device


def set_num_sms(new_num_sms: int, /) -> None:
    """Record ``new_num_sms`` for :func:`get_num_sms`: ``0 < new_num_sms <= device SMs`` (DeepGEMM's own check); on
    a host without CUDA the bound is ``MAX_SMS`` (no GPU has more), so ``10**400`` is refused there too.

    Divergence: DeepGEMM's kernels size their grids by it; the GC-MoE operator does not read it. Its SMs come from its
    own partition (the dispatch SM request ``GC_MOE_DISPATCH_SMS`` and the compute rest, or the rank's share of a
    GPU that several ranks share), which ``gc-moe-ab --check`` reports."""
    global _num_sms
    device = _device_num_sms()
    _num_sms = _checks.integer("set_num_sms", "new_num_sms", new_num_sms, 1,
                               _checks.MAX_SMS if device is None else device)


def get_block_m_for_mega_moe(num_ranks: int, num_experts: int,
                             num_max_tokens_per_rank: int, num_tokens: int,
                             num_topk: int, mma_type: str = 'fp8xfp4',
                             global_num_tokens: int | None = None) -> int:
    """Token block size ``BM`` the SM90 operator picks for this call.

    The expected tokens per expert ``m = T_total * k / E`` with ``T_total = global_num_tokens`` when given (the
    tokens all EP ranks send this call, DeepGEMM's meaning), else ``num_tokens * num_ranks``, goes through the SM90
    kernels' own rule (:func:`gc_moe_compat.operator.heuristics.block_m_for_call`) for ``mma_type``'s role2 kernel,
    so this answer is the BM that kernel runs: :data:`BLOCK_M_CANDIDATES`, and 96 for ``fp8xfp8`` past 64 covered
    rows. ``fp8_mega_moe`` runs the FP8xFP8 kernel on any buffer, so on SGLang's ``fp8xfp4``-typed Hopper buffer it
    may run 96 where this call, asked with the buffer's ``mma_type``, answers 64 (SGLang reads the answer only for
    its SM100 shared-expert staging).
    """
    fn = "get_block_m_for_mega_moe"
    # the routing sizes a buffer accepts (config.check_routing): no answer for a shape the operator refuses
    _checks.routing(fn, num_experts=num_experts, num_ranks=num_ranks, topk=num_topk,
                    capacity=num_max_tokens_per_rank)
    _checks.integer(fn, "num_tokens", num_tokens, 0, num_max_tokens_per_rank)
    _checks.choice(fn, "mma_type", mma_type, _checks.SUPPORTED_MMA_TYPES, _checks.DEEPGEMM_ONLY_MMA_TYPES)
    if global_num_tokens is not None:
        _checks.integer(fn, "global_num_tokens", global_num_tokens, 0, num_ranks * num_max_tokens_per_rank)
    return block_m_for_call(num_tokens, num_ranks, num_topk, num_experts, global_num_tokens, mma_type=mma_type)
