"""Host-side parts of bench/deep_ep_ll.py (the deep_ep facade's benchmark): the NVLink floor, the reference's stand-in
expert rows, the command line, and the committed result file's shape and claims."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import _baseline_sm90 as base  # noqa: E402 - bench/ is a script folder, put on the path above
import deep_ep_ll  # noqa: E402

from gc_moe_compat.references.ep_reference import combine_reference, receive_plan  # noqa: E402


def test_nvlink_bytes_counts_remote_rows_both_ways_for_the_busier_rank() -> None:
    # rank 0 sends 2 rows to rank 1 and 1 to itself; rank 1 sends 3 rows to rank 0
    idx = [torch.tensor([[2, 0], [3, -1]]), torch.tensor([[0, 1], [1, -1]])]
    plans = [base.plan_all_to_all(idx, 4, r) for r in range(2)]
    hidden = 256
    row = (hidden + 4 * hidden // 128) + 2 * hidden
    remote = [2 + 3, 3 + 2]  # per rank: rows it sends to the other rank + rows it receives from it
    assert deep_ep_ll.nvlink_bytes(plans, hidden) == max(remote) * row


def test_expert_rows_are_seeded_and_index_like_the_padded_output() -> None:
    counts = [3, 0, 2]
    a, b = deep_ep_ll.ExpertRows(counts, 128, seed=5), deep_ep_ll.ExpertRows(counts, 128, seed=5)
    assert a.shape == (3, deep_ep_ll.WORLD * deep_ep_ll.TMAX, 128)
    assert all(torch.equal(x, y) for x, y in zip(a.rows, b.rows, strict=True))
    assert torch.equal(a[2, 1], a.rows[2][1])
    # the reference accepts it in place of a padded [e, P*Tmax, H] tensor
    idx = torch.tensor([[0, 2], [2, -1]])
    plan = receive_plan([idx], num_experts=3)
    dense = torch.zeros(a.shape, dtype=torch.bfloat16)
    for le, rows in enumerate(a.rows):
        dense[le, : rows.shape[0]] = rows
    w = torch.rand(2, 2)
    assert torch.equal(combine_reference(0, idx, w, [a], plan), combine_reference(0, idx, w, [dense], plan))


def test_parse_args_rejects_tokens_past_tmax() -> None:
    assert deep_ep_ll.parse_args(["--tokens", "1", "128"]).tokens == [1, 128]
    with pytest.raises(SystemExit):
        deep_ep_ll.parse_args(["--tokens", "129"])


def test_committed_result_is_complete_and_bit_exact() -> None:
    """The committed result file covers both presets at every default T, each point bit-exact and replay-identical,
    with the speedup and efficiencies its table in the README quotes."""
    data = json.loads((REPO / "bench/results/deep_ep_ll_x2.json").read_text())
    meta = data["meta"]
    assert meta["world_size"] == 2 and "bench/deep_ep_ll.py" in meta["command"]
    got = {(p["preset"], p["tokens_per_rank"]) for p in data["points"]}
    assert got == {(pr, t) for pr in deep_ep_ll.PRESETS for t in deep_ep_ll.TOKENS}
    for p in data["points"]:
        acc = p["accuracy"]["deep_ep_facade"]
        assert acc["bit_exact_vs_reference"] and acc["replay_bit_identical"], p
        lat = p["latency_us"]
        assert p["speedup_facade_over_nccl"] == pytest.approx(lat["nccl_all_to_all"] / lat["deep_ep_facade"])
        assert all(max(p["per_rank_us"][op]) == lat[op] for op in deep_ep_ll.OPS)
