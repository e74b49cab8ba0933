"""DeepEP's ``Config`` (the normal-mode chunking parameters) for the facade, with DeepEP's buffer size hints.

The facade's normal mode (:mod:`gc_moe_compat.deep_ep._normal`) reads ``num_sms`` (the grid and the communication
partition's request, two SMs per DeepEP channel); the chunk sizes only enter the size hints, which keep DeepEP's
arithmetic so that callers size ``num_nvl_bytes`` as they do for DeepEP.
"""

from __future__ import annotations

from gc_moe_compat.comm import TOPK_IDX_DTYPE
from gc_moe_compat.config import integer

__all__ = ["BUFFER_ALIGNMENT_BYTES", "C_INT_MAX", "INTERNODE_MISSING", "MAX_LAUNCH_SHAPES", "MAX_NVL_RANKS",
           "TOPK_IDX_DTYPES", "TOPK_IDX_RULE", "Config", "aligned_bytes", "config_field", "recommended_config"]

C_INT_MAX = (1 << 31) - 1
"""DeepEP's sizes and counts are C ``int``s (pybind refuses a larger Python int): the facade's bound for them."""

TOPK_IDX_DTYPES = (TOPK_IDX_DTYPE,)
"""The dtypes a ``topk_idx`` may have in the calls that take one (both modes): DeepEP's ``topk_idx_t`` only. A call
shape's compiled host record holds it, so a ``topk_idx`` of another dtype always reaches the Python path's refusal."""
TOPK_IDX_RULE = f"{TOPK_IDX_DTYPE} (deep_ep.topk_idx_t, which DeepEP asserts)"
"""How a call refusing a ``topk_idx`` of another dtype names the one it takes (the message's rule)."""


def address_rule(vectors: bool, element_size: int) -> str:
    """How a call refusing a tensor's address states the rule it broke: 16-byte aligned where the kernels read it by
    16-byte vectors, aligned to its elements (as any row slice of a torch tensor is) where they read it element by
    element (``vectors`` False)."""
    return "16-byte aligned (16-byte vector accesses)" if vectors else \
        f"aligned to its {element_size}-byte elements (element reads)"

BUFFER_ALIGNMENT_BYTES = 128
"""DeepEP's ``NUM_BUFFER_ALIGNMENT_BYTES``: ``Buffer`` takes ``num_nvl_bytes`` and ``num_rdma_bytes`` in multiples of
it, and both size hints return multiples of it."""


def aligned_bytes(size: int) -> int:
    """``size`` rounded up to a multiple of :data:`BUFFER_ALIGNMENT_BYTES` (a byte count ``Buffer`` takes)."""
    return -(-size // BUFFER_ALIGNMENT_BYTES) * BUFFER_ALIGNMENT_BYTES


MAX_LAUNCH_SHAPES = 1024
"""Call shapes a workspace keeps packed launches for, in either mode (token counts vary from call to call: one entry
per shape seen; past the bound the cache starts again)."""

MAX_NVL_RANKS = 8
"""DeepEP's NVLink domain (``LEGACY_NUM_MAX_NVL_PEERS``): larger groups are internode (NVSHMEM/RDMA) in DeepEP."""
INTERNODE_MISSING = ("groups above 8 ranks: DeepEP runs them internode over NVSHMEM/RDMA, which gc-moe-compat's "
                     "deep_ep facade does not implement (intranode NVLink only)")


class Config:
    """Normal-mode chunking parameters, as ``deep_ep.Config(num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv)``."""

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        values = dict(num_sms=num_sms, num_max_nvl_chunked_send_tokens=num_max_nvl_chunked_send_tokens,
                      num_max_nvl_chunked_recv_tokens=num_max_nvl_chunked_recv_tokens,
                      num_max_rdma_chunked_send_tokens=num_max_rdma_chunked_send_tokens,
                      num_max_rdma_chunked_recv_tokens=num_max_rdma_chunked_recv_tokens)
        for name, value in values.items():  # DeepEP keeps them as C ints
            setattr(self, name, integer("Config", name, value, 0, C_INT_MAX))
        self._check_chunks()

    def _check_chunks(self) -> None:
        """DeepEP's ``Config`` constructor asserts, as ``ValueError`` naming the fields: positive chunk sizes, each
        send chunk below its receive chunk, the RDMA receive chunk rounded up to a multiple of the send chunk at least
        twice it (only the intranode normal mode runs here, which reads no RDMA chunk: the fields keep the given
        values; DeepEP's Config has no readable fields)."""
        nvl_send, nvl_recv = self.num_max_nvl_chunked_send_tokens, self.num_max_nvl_chunked_recv_tokens
        rdma_send, rdma_recv = self.num_max_rdma_chunked_send_tokens, self.num_max_rdma_chunked_recv_tokens
        for kind, send, recv in (("nvl", nvl_send, nvl_recv), ("rdma", rdma_send, rdma_recv)):
            if send <= 0 or recv <= 0:
                raise ValueError(f"Config: num_max_{kind}_chunked_send_tokens and num_max_{kind}_chunked_recv_tokens "
                                 f"must be > 0 (DeepEP's Config), got {send} and {recv}")
        if nvl_send >= nvl_recv:
            raise ValueError(f"Config: num_max_nvl_chunked_send_tokens must be below num_max_nvl_chunked_recv_tokens "
                             f"(DeepEP's Config), got {nvl_send} and {nvl_recv}")
        rounded = -(-rdma_recv // rdma_send) * rdma_send
        if rounded > C_INT_MAX:
            raise ValueError(f"Config: num_max_rdma_chunked_recv_tokens rounded up to a multiple of "
                             f"num_max_rdma_chunked_send_tokens must be a C int (<= {C_INT_MAX}), got {rounded}")
        if rdma_send > rounded // 2:  # also rdma_send < rounded
            raise ValueError(f"Config: num_max_rdma_chunked_send_tokens must be at most half of "
                             f"num_max_rdma_chunked_recv_tokens rounded up to a multiple of it (DeepEP's Config), got "
                             f"{rdma_send} and {rdma_recv} (rounded {rounded})")

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP's NVLink buffer bytes: its chunked queues (``num_sms / 2`` channels per NVLink rank, each of
        ``num_max_nvl_chunked_recv_tokens`` tokens of ``hidden_bytes``, 8 bytes of source metadata, top-k and scales
        provisioned up to 128), rounded up to :data:`BUFFER_ALIGNMENT_BYTES`. The facade's data region holds a whole
        call's rows (no ring): a call needing more raises ``ValueError`` naming the bytes."""
        fn = "Config.get_nvl_buffer_size_hint"
        integer(fn, "hidden_bytes", hidden_bytes, 1, C_INT_MAX)  # DeepEP's C ints: no 400-digit hint
        integer(fn, "num_ranks", num_ranks, 1, C_INT_MAX)
        if num_ranks > MAX_NVL_RANKS and num_ranks % MAX_NVL_RANKS:
            raise ValueError(f"{fn}: num_ranks above {MAX_NVL_RANKS} must be a multiple of it, got {num_ranks}")
        rdma_ranks, nvl_ranks = max(num_ranks // MAX_NVL_RANKS, 1), min(num_ranks, MAX_NVL_RANKS)
        queues = (config_field(fn, self, "num_sms") // 2) * nvl_ranks
        tokens = queues * config_field(fn, self, "num_max_nvl_chunked_recv_tokens")
        size = queues * (2 * rdma_ranks + 3) * 4 + tokens * (hidden_bytes + 8 + 128 * 8 + 128 * 4 + 128 * 4)
        return aligned_bytes(size)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP's RDMA buffer bytes: 0 within one NVLink domain (intranode needs none); larger groups raise
        ``NotImplementedError`` (NVSHMEM/RDMA)."""
        fn = "Config.get_rdma_buffer_size_hint"
        integer(fn, "hidden_bytes", hidden_bytes, 1, C_INT_MAX)
        if integer(fn, "num_ranks", num_ranks, 1) > MAX_NVL_RANKS:
            raise NotImplementedError(f"{fn}: {INTERNODE_MISSING}")
        return 0

    def __repr__(self) -> str:
        return (f"Config(num_sms={self.num_sms}, {self.num_max_nvl_chunked_send_tokens}, "
                f"{self.num_max_nvl_chunked_recv_tokens}, {self.num_max_rdma_chunked_send_tokens}, "
                f"{self.num_max_rdma_chunked_recv_tokens})")


def recommended_config(num_sms: int, chunks: tuple[int, int, int, int]) -> Config:
    """A new ``Config`` of ``num_sms`` and one of DeepEP's recommended ``chunks`` rows (nvl send, nvl recv, rdma
    send, rdma recv), which satisfy the constructor's rules by construction, so their checks are skipped: SGLang's
    default (no ``--deepep-config``) passes ``config=None``, so every dispatch and combine builds one (~0.1 us
    against the checked constructor's ~1.2 us on a CPU host). A ``num_sms`` that is not a C int takes the
    constructor, which refuses it as ``Config(num_sms, ...)`` does."""
    if type(num_sms) is not int or not 0 <= num_sms <= C_INT_MAX:
        return Config(num_sms, *chunks)
    config = object.__new__(Config)
    config.num_sms = num_sms
    (config.num_max_nvl_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens,
     config.num_max_rdma_chunked_send_tokens, config.num_max_rdma_chunked_recv_tokens) = chunks
    return config


def config_field(fn: str, config: Config, name: str) -> int:
    """Field ``name`` of ``config`` as a call reads it, checked as ``Config()`` checks it (``TypeError`` /
    ``ValueError`` naming ``config.<name>`` and the value): an attribute set after construction
    (``config.num_sms = 'x'``) reaches the calls, not the constructor."""
    return integer(fn, f"config.{name}", getattr(config, name), 0, C_INT_MAX)
