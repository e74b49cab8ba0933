"""Host side of the DeepEP-style communication kernels behind the ``deep_ep`` facade, one module per kernel file:
:mod:`.ep_ll` (``kernels/sm90/ep_ll.cu``, low-latency dispatch/combine) and :mod:`.ep_normal`
(``kernels/sm90/ep_normal.cu``, the normal mode)."""

from __future__ import annotations

import torch

__all__ = ["TOPK_IDX_DTYPE"]

TOPK_IDX_DTYPE = torch.int64
"""The dtype of the ``topk_idx`` both kernel files read, DeepEP's ``topk_idx_t`` (the ``deep_ep`` facade's
``topk_idx_t`` is this object): DeepEP asserts it in every call that takes a ``topk_idx``, and so does the facade."""
