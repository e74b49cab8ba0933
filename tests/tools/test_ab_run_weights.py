"""gc-moe-ab's every-rank experts: each rank holds all ``world`` shares (the P-rank references need them), so a
run that does not fit ends with that arithmetic, not with an allocator traceback (P ranks on one GPU hold P * P)."""

from __future__ import annotations

import types

import pytest
import torch

from gc_moe_compat.ab import run
from gc_moe_compat.ab.inputs import make_weights
from gc_moe_compat.ab.model_config import Workload


def _ranks(world: int, rank: int = 0) -> types.SimpleNamespace:
    return types.SimpleNamespace(world=world, rank=rank, device=torch.device("cpu"))


def _workload() -> Workload:
    return Workload(name="tiny", hidden=256, intermediate=128, num_experts=8, topk=2, ep_size=4)


def test_every_rank_gets_every_share_in_rank_order() -> None:
    w = _workload()
    shares = run._every_ranks_weights(w, ("fp8_block128",), _ranks(3))
    assert len(shares) == 3
    for r, share in enumerate(shares):
        again = make_weights(w.local_experts, w.hidden, w.intermediate, r, ("fp8_block128",), "cpu")
        assert torch.equal(share["bf16"][0].payload, again["bf16"][0].payload)
    assert not torch.equal(shares[0]["bf16"][0].payload, shares[1]["bf16"][0].payload)


def test_out_of_memory_names_the_shares_and_the_ranks_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    w = _workload()
    real = make_weights
    built = []

    def make(*args: object, **kwargs: object) -> object:
        if built:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 768.00 MiB")
        built.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(run, "make_weights", make)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _d: types.SimpleNamespace(total_memory=140 << 30))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    share = run._share_bytes(real(w.local_experts, w.hidden, w.intermediate, 0, ("fp8_block128",), "cpu"))
    with pytest.raises(RuntimeError) as info:
        run._every_ranks_weights(w, ("fp8_block128",), _ranks(8, rank=5))
    text = str(info.value)
    assert "rank 5" in text and "8 shares of" in text and "x 8 ranks on this GPU" in text
    assert f"{8 * share / 2**30:.1f} GiB per rank" in text and "140.0 GiB" in text
    assert "--world-size" in text and info.value.__cause__ is None


def test_share_bytes_counts_payloads_and_scales() -> None:
    w = _workload()
    share = make_weights(w.local_experts, w.hidden, w.intermediate, 0, ("fp8_block128",), "cpu")
    expert_elems = 3 * w.hidden * w.intermediate * w.local_experts
    bf16, fp8 = expert_elems * 2, expert_elems
    assert bf16 + fp8 < run._share_bytes(share) < bf16 + fp8 + expert_elems // 100
