"""``SymmBuffer`` and ``get_symm_buffer_for_mega_moe``: the symmetric buffer callers stage inputs into.

A ``SymmBuffer`` is backed by the GC-MoE operator's workspace, a :class:`gc_moe_compat.operator.api.GcMoeBuffer`
(``buffer.workspace``: one symmetric allocation, torch symmetric memory + rendezvous for more than one rank, a
plain zeroed allocation for one; created collectively, then a group barrier: DeepGEMM's sequence). DeepGEMM's
attributes are views of it:

====================  ==================  ===============  =========================================
attribute             dtype               shape            strides
====================  ==================  ===============  =========================================
``x``                 float8_e4m3fn       ``[T, H]``       ``(H, 1)``
``x_sf``              float32             ``[T, H/128]``   ``(H/128, 1)`` (K-major, FP32 1x128 scales)
``topk_idx``          int64               ``[T, k]``       ``(k, 1)``
``topk_weights``      float32             ``[T, k]``       ``(k, 1)``
``shared_l1_acts``    ``x`` itself (the shared expert, role4, reads the local tokens, zero copy)
``shared_l1_acts_sf`` ``x_sf`` itself with a shared expert (no Eq. (3) restaging on SM90), else an empty byte tensor
``x_scales``          empty byte tensor (NVFP4 only, absent as in SGLang's pin)
``buffer``            int8                the whole workspace (``handle.buffer_ptrs``: every rank's base)
====================  ==================  ===============  =========================================

``x`` ... ``topk_weights`` ARE the workspace's staging regions (:mod:`gc_moe_compat.operator.workspace`), so what the
pre-dispatch writes is what the operator's role1 reads; there is no copy. ``T`` is ``num_max_tokens_per_rank``
rounded up to ``TOKEN_ALIGNMENT``. ``topk_idx`` is int64 as in DeepGEMM 2.8.2; SGLang passes int32 ids to the
pre-dispatch, which converts them (the operator reads either width, the facade keeps DeepGEMM's). The layout is the
SM90 operator's for both ``mma_type`` values ("E4M3FN with contiguous FP32 K128 scales", what SGLang's SM90 pin hands
its Hopper kernel): SGLang creates its Hopper buffer with ``mma_type='fp8xfp4'`` and calls ``fp8_mega_moe`` on it.
``num_shared_experts=1`` is kept on SM90 (SGLang's pin drops it there): ``fp8_fp4_mega_moe`` then runs the fused
shared expert (:mod:`gc_moe_compat.deep_gemm._mega` says which weight form it takes).

The operator's own regions (token ring and L2 activations: ``l1_acts``, ``l1_acts_sf``, ``l2_acts``, ``l2_acts_sf``,
and with a shared expert ``shared_l2_acts``, ``shared_l2_acts_sf``) are readable as attributes through
:func:`gc_moe_compat.deep_gemm._seam.workspace_view`; their shapes are the operator's, not DeepGEMM's (SGLang never
reads
them). On a host without CUDA the workspace is host memory (single rank only), so layouts and the pre-dispatch
staging can be inspected and tested anywhere; running the operator needs the GPU.
"""

from __future__ import annotations

import dataclasses
import math
import types
import warnings
import weakref

import torch
import torch.distributed as dist

from gc_moe_compat import config
from gc_moe_compat.deep_gemm import _checks, _seam
from gc_moe_compat.deep_gemm._runtime import BLOCK_M_CANDIDATES
from gc_moe_compat.operator import api
from gc_moe_compat.operator.workspace import OperatorLayout

__all__ = ["HOST_COMPUTE_SMS", "TOKEN_ALIGNMENT", "SymmBuffer", "buffer_of", "get_symm_buffer_for_mega_moe",
           "get_symm_buffer_for_sm90_mega_moe"]

# num_max_tokens_per_rank is rounded up to a multiple of every BM the kernels share (DeepGEMM rounds to its own LCM);
# role2's wide block needs no alignment of the capacity (its ring is sized for it).
TOKEN_ALIGNMENT = math.lcm(*BLOCK_M_CANDIDATES)
HOST_COMPUTE_SMS = 128
"""Compute SMs the token ring is sized for on a host without CUDA (an H200's compute partition at the default
dispatch request); on a GPU the workspace sizes it from the device's partition."""
_INPUT_VIEWS = ("x", "x_sf", "topk_idx", "topk_weights")
_OPERATOR_VIEWS = ("l1_acts", "l1_acts_sf", "l2_acts", "l2_acts_sf", "shared_l2_acts", "shared_l2_acts_sf")


def align_tokens(num_max_tokens_per_rank: int) -> int:
    """Round a per-rank capacity up to ``TOKEN_ALIGNMENT``."""
    return -(-num_max_tokens_per_rank // TOKEN_ALIGNMENT) * TOKEN_ALIGNMENT


def _workspace(fn: str, group: dist.ProcessGroup, shape: config.MoEShape) -> api.GcMoeBuffer:
    """A fresh operator workspace for ``shape`` (collective), errors re-worded in the facade's argument names."""
    try:
        return api.get_symm_buffer_for_gc_moe(
            group, shape.num_experts, shape.capacity, shape.topk, shape.hidden, shape.intermediate, shape.mma_type,
            shape.num_shared_experts, compute_sms=None if torch.cuda.is_available() else HOST_COMPUTE_SMS)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{fn}: {exc}") from exc


class SymmBuffer:
    """The facade's symmetric buffer: DeepGEMM's attributes as views of the operator workspace (module docstring)."""

    def __init__(self, group: dist.ProcessGroup,
                 num_experts: int,
                 num_max_tokens_per_rank: int, num_topk: int,
                 hidden: int, intermediate_hidden: int,
                 num_shared_experts: int = 0,
                 mma_type: str = 'fp8xfp4',
                 activation: str = 'swiglu',
                 base: SymmBuffer | None = None):
        fn = "SymmBuffer"
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"{fn}: group must be a torch.distributed ProcessGroup, got {type(group).__name__}")
        _checks.choice(fn, "mma_type", mma_type, _checks.SUPPORTED_MMA_TYPES, _checks.DEEPGEMM_ONLY_MMA_TYPES)
        _checks.choice(fn, "activation", activation, _checks.SUPPORTED_ACTIVATIONS,
                       _checks.DEEPGEMM_ONLY_ACTIVATIONS)
        # bounded as requested (before the rounding up, so an error shows the caller's value)
        _checks.integer(fn, "num_max_tokens_per_rank", num_max_tokens_per_rank, 1, config.MAX_CAPACITY)
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

        if base is None:
            self.workspace: api.GcMoeBuffer | None = _workspace(fn, group, self.shape)
        else:
            self.workspace = self._share(fn, base)
        self.buffer = self.workspace.storage.view(torch.int8)
        table = self.workspace.peer_table
        self.handle = types.SimpleNamespace(
            buffer_ptrs=[table.base + table.offsets[r] for r in range(table.world_size)])
        for name in _INPUT_VIEWS:
            setattr(self, name, self.workspace.views[name])
        empty = self.buffer[:0]
        self.shared_l1_acts = self.x
        self.shared_l1_acts_sf = self.x_sf if num_shared_experts > 0 else empty
        self.x_scales = empty
        _live.add(self)

    def _share(self, fn: str, base: SymmBuffer) -> api.GcMoeBuffer:
        """``base``'s workspace, when this configuration is ``base``'s (up to ``mma_type``: both compute paths run
        on one workspace). DeepGEMM reuses a base's bytes for any smaller configuration; here the workspace also
        holds the persistent synchronization state of its layout, so another layout cannot overlay it."""
        if not isinstance(base, SymmBuffer) or base.workspace is None or base.group is not self.group:
            raise ValueError(f"{fn}: base must be a live SymmBuffer of the same group")
        ours, theirs = self.shape, base.workspace.shape
        if ours == dataclasses.replace(theirs, mma_type=ours.mma_type):
            return base.workspace
        needed = OperatorLayout.build(ours, base.workspace.layout.compute_sms).total_bytes
        if needed > base.buffer.nbytes:
            raise ValueError(f"{fn}: base holds {base.buffer.nbytes} bytes, this configuration needs {needed}")
        raise NotImplementedError(f"{fn}: base: sharing a workspace between two configurations ({theirs} and {ours}) "
                                  "is not supported: each layout keeps persistent synchronization counters in it")

    def __getattr__(self, name: str) -> torch.Tensor:
        # Only reached for attributes not set in __init__: the operator-owned workspace regions.
        if name in _OPERATOR_VIEWS:
            try:
                return _seam.workspace_view(self, name)
            except KeyError as exc:
                raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}: the workspace has "
                                     "it only with num_shared_experts=1") from exc
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        """DeepGEMM's sizes and the operator buffer under them (its partition and how it maps the peers)."""
        return (f"SymmBuffer(num_experts={self.num_experts}, num_max_tokens_per_rank={self.num_max_tokens_per_rank}, "
                f"mma_type={self.mma_type!r}, workspace={self.__dict__.get('workspace')!r})")

    def destroy(self):
        """Drop the references to the workspace (DeepGEMM's semantics); the buffer is unusable afterwards. The
        memory is freed once nothing else (a ``base`` sharer, a captured graph's caller) holds it."""
        _live.discard(self)
        self.handle = None
        self.buffer = None
        self.group = None
        self.workspace = None
        for name in _INPUT_VIEWS:
            setattr(self, name, None)
        self.shared_l1_acts = self.shared_l1_acts_sf = self.x_scales = None


_live: weakref.WeakSet[SymmBuffer] = weakref.WeakSet()
"""The live (not destroyed) facade buffers, for :func:`buffer_of`."""


def buffer_of(t: torch.Tensor) -> SymmBuffer | None:
    """The live facade buffer whose workspace holds ``t``'s bytes, or None (a tensor of no facade buffer, a meta
    tensor). Why: the pre-dispatch gets bare views; this finds their buffer's expert count and checks that they are
    its own views, each in its place."""
    if t.is_meta:
        return None
    storage = t.untyped_storage().data_ptr()
    return next((buf for buf in list(_live)
                 if buf.workspace is not None and buf.workspace.storage.untyped_storage().data_ptr() == storage), None)


def get_symm_buffer_for_mega_moe(group: dist.ProcessGroup,
                                 num_experts: int,
                                 num_max_tokens_per_rank: int, num_topk: int,
                                 hidden: int, intermediate_hidden: int,
                                 num_shared_experts: int = 0,
                                 use_fp8_dispatch: bool | None = None,
                                 mma_type: str = 'fp8xfp4',
                                 activation: str = 'swiglu') -> SymmBuffer:
    """DeepGEMM's constructor function; ``use_fp8_dispatch`` is the deprecated spelling of ``mma_type``'s prefix."""
    fn = "get_symm_buffer_for_mega_moe"
    _checks.boolean(fn, "use_fp8_dispatch", use_fp8_dispatch, none_ok=True)  # None: derive it from mma_type
    _checks.choice(fn, "mma_type", mma_type, _checks.SUPPORTED_MMA_TYPES, _checks.DEEPGEMM_ONLY_MMA_TYPES)
    if use_fp8_dispatch is not None:
        if use_fp8_dispatch != (mma_type.split('x')[0] == 'fp8'):
            raise ValueError(f"get_symm_buffer_for_mega_moe: use_fp8_dispatch={use_fp8_dispatch!r} contradicts "
                             f"mma_type={mma_type!r}")
        warnings.warn("`use_fp8_dispatch` will be deprecated in the future, please use `mma_type`",
                      DeprecationWarning, stacklevel=2)
    return SymmBuffer(group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden,
                      num_shared_experts, mma_type=mma_type, activation=activation)


def _fp8_dispatch_only(fn: str, use_fp8_dispatch: object) -> None:
    """The SM90 constructors' ``use_fp8_dispatch``: a bool, and True (GC-MoE's SM90 path dispatches FP8 only)."""
    _checks.boolean(fn, "use_fp8_dispatch", use_fp8_dispatch)
    if use_fp8_dispatch is not True:
        raise NotImplementedError(f"{fn}: use_fp8_dispatch={use_fp8_dispatch!r}: GC-MoE's SM90 path dispatches FP8 "
                                  "activations only")


class SM90SymmBuffer(SymmBuffer):
    """The pin's SM90 buffer class, with its constructor's signature (the facade's views and layout are
    :class:`SymmBuffer`'s): FP8 dispatch only, no shared expert."""

    def __init__(self, group: dist.ProcessGroup,
                 num_experts: int,
                 num_max_tokens_per_rank: int, num_topk: int,
                 hidden: int, intermediate_hidden: int,
                 use_fp8_dispatch: bool = True,
                 activation: str = 'swiglu') -> None:
        _fp8_dispatch_only("SM90SymmBuffer", use_fp8_dispatch)
        super().__init__(group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden,
                         mma_type='fp8xfp8', activation=activation)


def get_symm_buffer_for_sm90_mega_moe(group: dist.ProcessGroup,
                                      num_experts: int,
                                      num_max_tokens_per_rank: int, num_topk: int,
                                      hidden: int, intermediate_hidden: int,
                                      use_fp8_dispatch: bool = True,
                                      activation: str = 'swiglu') -> SM90SymmBuffer:
    """SGLang pin's SM90 constructor: an :class:`SM90SymmBuffer`, FP8 dispatch only."""
    _fp8_dispatch_only("get_symm_buffer_for_sm90_mega_moe", use_fp8_dispatch)
    return SM90SymmBuffer(group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden,
                          activation=activation)
