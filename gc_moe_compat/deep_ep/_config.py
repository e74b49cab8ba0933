"""DeepEP's ``Config`` (the normal-mode chunking parameters) for the facade.

The facade implements DeepEP's low-latency mode only, so a ``Config`` is kept for callers that build one (SGLang's
``--deepep-config``), while the normal-mode size hints raise ``NotImplementedError``.
"""

from __future__ import annotations

__all__ = ["NORMAL_MODE_MISSING", "Config"]

NORMAL_MODE_MISSING = (
    "DeepEP's normal (high-throughput) mode is not implemented by gc-moe-compat's deep_ep facade, which implements "
    "the low-latency mode (decode); run SGLang with --deepep-mode low_latency, or unset GC_MOE_SWAP / use "
    "GC_MOE_SWAP=deep_gemm to keep the original deep_ep")


class Config:
    """Normal-mode chunking parameters, as ``deep_ep.Config(num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv)``."""

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        values = dict(num_sms=num_sms, num_max_nvl_chunked_send_tokens=num_max_nvl_chunked_send_tokens,
                      num_max_nvl_chunked_recv_tokens=num_max_nvl_chunked_recv_tokens,
                      num_max_rdma_chunked_send_tokens=num_max_rdma_chunked_send_tokens,
                      num_max_rdma_chunked_recv_tokens=num_max_rdma_chunked_recv_tokens)
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Config: {name} must be a non-negative int, got {value!r}")
            setattr(self, name, value)

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Normal mode only: raises ``NotImplementedError``."""
        raise NotImplementedError(NORMAL_MODE_MISSING)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Normal mode only: raises ``NotImplementedError``."""
        raise NotImplementedError(NORMAL_MODE_MISSING)

    def __repr__(self) -> str:
        return (f"Config(num_sms={self.num_sms}, {self.num_max_nvl_chunked_send_tokens}, "
                f"{self.num_max_nvl_chunked_recv_tokens}, {self.num_max_rdma_chunked_send_tokens}, "
                f"{self.num_max_rdma_chunked_recv_tokens})")
