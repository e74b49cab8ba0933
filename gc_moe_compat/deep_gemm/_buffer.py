"""``SymmBuffer`` and ``get_symm_buffer_for_mega_moe``: the symmetric buffer callers stage inputs into.

What the facade owns: the caller-facing input views SGLang writes before each call (``x``, ``x_sf``, ``topk_idx``,
``topk_weights``, plus the ``shared_l1_acts*`` aliases and the NVFP4-only ``x_scales``), their byte layout inside
one symmetric allocation, and the allocation itself (torch symmetric memory + rendezvous for more than one rank,
plain ``torch.empty`` for one, zeroed, then a group barrier: DeepGEMM's sequence).

Layout (the SM90 operator's, for both ``fp8xfp4`` and ``fp8xfp8``: the paper's Hopper path consumes "E4M3FN with
contiguous FP32 K128 scales" either way, exactly what SGLang's SM90 pin hands its Hopper kernel):

====================  ==================  ===============  =========================================
view                  dtype               shape            strides
====================  ==================  ===============  =========================================
``x``                 float8_e4m3fn       ``[T, H]``       ``(H, 1)``
``x_sf``              float32             ``[T, H/128]``   ``(H/128, 1)`` (K-major, FP32 1x128 scales)
``topk_idx``          int64               ``[T, k]``       ``(k, 1)``
``topk_weights``      float32             ``[T, k]``       ``(k, 1)``
``shared_l1_acts``    ``x`` itself (the shared expert reads the local tokens, zero copy)
``shared_l1_acts_sf`` ``x_sf`` itself with a shared expert, else an empty byte tensor
``x_scales``          empty byte tensor (NVFP4 only, absent as in SGLang's pin)
====================  ==================  ===============  =========================================

``T`` is ``num_max_tokens_per_rank`` rounded up to ``TOKEN_ALIGNMENT``; each view starts on a 128-byte boundary.
What the operator owns (issue 5): the token ring and L2 activations (``l1_acts``, ``l1_acts_sf``, ``l2_acts``,
``l2_acts_sf``, ``shared_l2_acts``, ``shared_l2_acts_sf``). Reading them goes through
:func:`gc_moe_compat.operator.workspace_view`, which raises until the operator exists; SGLang never reads them.

On a host without CUDA the buffer is allocated in CPU memory (single rank only), so layouts and the pre-dispatch
staging can be inspected and tested anywhere; running the operator still needs the GPU.
"""

from __future__ import annotations

import math
import types
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gc_moe_compat import operator
from gc_moe_compat.deep_gemm import _checks
from gc_moe_compat.deep_gemm._runtime import BLOCK_M_CANDIDATES

__all__ = ["TOKEN_ALIGNMENT", "SymmBuffer", "ViewSpec", "get_symm_buffer_for_mega_moe",
           "get_symm_buffer_for_sm90_mega_moe", "input_views"]

# num_max_tokens_per_rank is rounded up to a multiple of every candidate BM (DeepGEMM rounds to its own LCM).
TOKEN_ALIGNMENT = math.lcm(*BLOCK_M_CANDIDATES)
_VIEW_ALIGN_BYTES = 128
_OPERATOR_VIEWS = ("l1_acts", "l1_acts_sf", "l2_acts", "l2_acts_sf", "shared_l2_acts", "shared_l2_acts_sf")


@dataclass(frozen=True)
class ViewSpec:
    """One caller-facing view: its byte offset in the buffer, shape, dtype and (element) strides."""

    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def stride(self) -> tuple[int, ...]:
        """Row-major strides of ``shape``."""
        return tuple(math.prod(self.shape[i + 1:]) for i in range(len(self.shape)))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def align_tokens(num_max_tokens_per_rank: int) -> int:
    """Round a per-rank capacity up to ``TOKEN_ALIGNMENT``."""
    return -(-num_max_tokens_per_rank // TOKEN_ALIGNMENT) * TOKEN_ALIGNMENT


def input_views(num_max_tokens_per_rank: int, num_topk: int, hidden: int) -> tuple[ViewSpec, ...]:
    """The caller-facing views of the module table for an (already aligned) capacity, packed in order."""
    specs = []
    offset = 0
    for name, shape, dtype in (
        ("x", (num_max_tokens_per_rank, hidden), torch.float8_e4m3fn),
        ("x_sf", (num_max_tokens_per_rank, hidden // 128), torch.float32),
        ("topk_idx", (num_max_tokens_per_rank, num_topk), torch.int64),
        ("topk_weights", (num_max_tokens_per_rank, num_topk), torch.float32),
    ):
        spec = ViewSpec(name, offset, shape, dtype)
        specs.append(spec)
        offset = -(-(offset + spec.nbytes) // _VIEW_ALIGN_BYTES) * _VIEW_ALIGN_BYTES
    return tuple(specs)


def _allocate(group: dist.ProcessGroup, num_bytes: int) -> tuple[torch.Tensor, Any]:
    """One zeroed symmetric allocation and its handle (``handle.buffer_ptrs``), then a group barrier."""
    if group.size() == 1:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        buffer = torch.empty(num_bytes, dtype=torch.int8, device=device)
        handle = types.SimpleNamespace(buffer_ptrs=[buffer.data_ptr()])
    else:
        if not torch.cuda.is_available():
            raise RuntimeError(f"SymmBuffer: group.size()={group.size()} needs CUDA symmetric memory; "
                               "no CUDA device is visible")
        import torch.distributed._symmetric_memory as symm_mem

        buffer = symm_mem.empty(num_bytes, dtype=torch.int8, device="cuda")
        handle = symm_mem.rendezvous(buffer, group=group)
    buffer.zero_()
    group.barrier()
    if buffer.is_cuda:
        torch.cuda.synchronize()
    return buffer, handle


class SymmBuffer:
    """The facade's symmetric buffer: DeepGEMM's attributes, the SM90 operator's input layout (module table)."""

    def __init__(self, group: dist.ProcessGroup,
                 num_experts: int,
                 num_max_tokens_per_rank: int, num_topk: int,
                 hidden: int, intermediate_hidden: int,
                 num_shared_experts: int = 0,
                 mma_type: str = 'fp8xfp4',
                 activation: str = 'swiglu',
                 base: SymmBuffer | None = None):
        fn = "SymmBuffer"
        _checks.choice(fn, "mma_type", mma_type, _checks.SUPPORTED_MMA_TYPES, _checks.DEEPGEMM_ONLY_MMA_TYPES)
        _checks.choice(fn, "activation", activation, _checks.SUPPORTED_ACTIVATIONS,
                       _checks.DEEPGEMM_ONLY_ACTIVATIONS)
        _checks.integer(fn, "num_max_tokens_per_rank", num_max_tokens_per_rank, 1)
        num_max_tokens_per_rank = align_tokens(num_max_tokens_per_rank)
        self.shape = _checks.moe_shape(
            fn, num_experts=num_experts, num_ranks=group.size(), hidden=hidden, intermediate=intermediate_hidden,
            topk=num_topk, num_shared_experts=num_shared_experts, capacity=num_max_tokens_per_rank,
            mma_type=mma_type)
        self.group: dist.ProcessGroup | None = group
        self.num_experts = num_experts
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_topk = num_topk
        self.hidden = hidden
        self.intermediate_hidden = intermediate_hidden
        self.num_shared_experts = num_shared_experts
        self.mma_type = mma_type
        self.activation = activation

        specs = input_views(num_max_tokens_per_rank, num_topk, hidden)
        num_bytes = specs[-1].offset + specs[-1].nbytes
        if base is None:
            self.buffer, self.handle = _allocate(group, num_bytes)
        else:
            if base.buffer is None or base.handle is None or base.group is not group:
                raise ValueError(f"{fn}: base must be a live SymmBuffer of the same group")
            if num_bytes > base.buffer.nbytes:
                raise ValueError(f"{fn}: base holds {base.buffer.nbytes} bytes, this configuration needs {num_bytes}")
            self.buffer, self.handle = base.buffer, base.handle
        for spec in specs:
            raw = self.buffer[spec.offset:spec.offset + spec.nbytes]
            setattr(self, spec.name, raw.view(spec.dtype).view(spec.shape))
        empty = self.buffer[:0]
        self.shared_l1_acts = self.x
        self.shared_l1_acts_sf = self.x_sf if num_shared_experts > 0 else empty
        self.x_scales = empty

    def __getattr__(self, name: str) -> torch.Tensor:
        # Only reached for attributes not set in __init__: the operator-owned workspace views.
        if name in _OPERATOR_VIEWS:
            return operator.workspace_view(self, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def destroy(self):
        """Drop the references to the allocation (DeepGEMM's semantics); the buffer is unusable afterwards."""
        self.handle = None
        self.buffer = None
        self.group = None
        self.x = None
        self.x_sf = None


def get_symm_buffer_for_mega_moe(group: dist.ProcessGroup,
                                 num_experts: int,
                                 num_max_tokens_per_rank: int, num_topk: int,
                                 hidden: int, intermediate_hidden: int,
                                 num_shared_experts: int = 0,
                                 use_fp8_dispatch: bool | None = None,
                                 mma_type: str = 'fp8xfp4',
                                 activation: str = 'swiglu') -> SymmBuffer:
    """DeepGEMM's constructor function; ``use_fp8_dispatch`` is the deprecated spelling of ``mma_type``'s prefix."""
    if use_fp8_dispatch is not None:
        if use_fp8_dispatch != (mma_type.split('x')[0] == 'fp8'):
            raise ValueError(f"get_symm_buffer_for_mega_moe: use_fp8_dispatch={use_fp8_dispatch!r} contradicts "
                             f"mma_type={mma_type!r}")
        warnings.warn("`use_fp8_dispatch` will be deprecated in the future, please use `mma_type`",
                      DeprecationWarning, stacklevel=2)
    return SymmBuffer(group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden,
                      num_shared_experts, mma_type=mma_type, activation=activation)


def get_symm_buffer_for_sm90_mega_moe(group: dist.ProcessGroup,
                                      num_experts: int,
                                      num_max_tokens_per_rank: int, num_topk: int,
                                      hidden: int, intermediate_hidden: int,
                                      use_fp8_dispatch: bool = True,
                                      activation: str = 'swiglu') -> SymmBuffer:
    """SGLang pin's SM90 constructor: FP8 dispatch only (the layout is the same SM90 layout)."""
    if use_fp8_dispatch is not True:
        raise NotImplementedError(f"get_symm_buffer_for_sm90_mega_moe: use_fp8_dispatch={use_fp8_dispatch!r}: "
                                  "GC-MoE's SM90 path dispatches FP8 activations only")
    return SymmBuffer(group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden,
                      mma_type='fp8xfp8', activation=activation)
