"""The compatibility matrix's world-size-2 layer cells without a GPU: why they are not run here (no GPU, one GPU
without ``--shared-gpu``, ``--shared-gpu`` without CUDA MPS), the flags that ask for them, how the ranks' outcomes
become one cell (every rank passes -> pass; a failing, silent or stopped rank -> fail naming it), and the rank
processes' deadline, run with stand-in rank scripts that only write reports."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from gc_moe_compat.ab import matrix, matrix_gpu
from gc_moe_compat.ab.matrix_gpu import Outcome
from gc_moe_compat.runtime.colocation import SHARED_GPU_LABEL

ENTRY = "gc_moe.fp8_fp8_gc_moe"
AXES = {"mma_type": "fp8xfp8", "buffer_mma_type": "fp8xfp8", "shared": 0, "scale_format": "FP8 128x128 blocks"}
Plan = Callable[..., list[tuple[str, str]]]
"""The stand-in ranks' plan setter (:func:`stand_in`)."""
WHERE = f"2 {SHARED_GPU_LABEL}, NVIDIA H200 (rendezvous cuda-ipc, MPS on)"


def _ok(cosine: float, processed: float) -> Outcome:
    return Outcome("pass", f"cosine {cosine:.6f}, processed diff {processed:.2e}",
                   {"cosine": cosine, "processed_diff": processed})


def _merge(*per_rank: Outcome | None, t: int = 7) -> matrix.Cell:
    key = (ENTRY, matrix_gpu.case_label(AXES, t, len(per_rank)))
    ranks = [{} if o is None else {key: o} for o in per_rank]
    (cell,) = matrix_gpu.merge_ranks([(ENTRY, AXES, t)], ranks, WHERE, "rank 1 exited rc=1: boom")
    return cell


def test_the_two_rank_cells_say_why_they_cannot_run_and_which_flag_runs_them() -> None:
    reason = matrix_gpu.two_rank_reason
    assert reason(2, False) is None and reason(8, False) is None  # a GPU per rank: no flag needed
    assert reason(1, True, mps=True) is None
    none = reason(0, True, mps=True)
    assert "no CUDA GPU here" in none and "needs 2 GPUs on one host" in none
    one = reason(1, False)
    assert "1 GPU here and no --shared-gpu" in one and "mps_start" in one
    no_mps = reason(1, True, mps=False)
    assert "CUDA MPS does not serve this GPU" in no_mps and "would hang" in no_mps and "mps_start" in no_mps
    assert reason(1, True) == no_mps  # MPS unknown: not started either


def test_the_matrix_flags_for_the_two_rank_cells_and_the_kinds() -> None:
    args = matrix.build_parser().parse_args([])
    assert not args.shared_gpu and args.two_rank_timeout == matrix_gpu.TWO_RANK_TIMEOUT_S
    assert matrix.selected_kinds(args) == matrix.KINDS
    args = matrix.build_parser().parse_args(["--shared-gpu", "--two-rank-timeout", "120", "--kinds", "layer"])
    assert args.shared_gpu and args.two_rank_timeout == 120.0 and matrix.selected_kinds(args) == ("layer",)
    args = matrix.build_parser().parse_args(["--cpu-only", "--kinds", "swap", "layer", "signature"])
    assert matrix.selected_kinds(args) == ("signature", "swap")  # in the matrix's order, the GPU kinds dropped
    assert matrix.selected_kinds(matrix.build_parser().parse_args(["--cpu-only"])) == matrix.CPU_KINDS
    with pytest.raises(SystemExit):
        matrix.build_parser().parse_args(["--kinds", "bogus"])


def test_the_matrix_hands_the_flags_to_the_layer_cells_and_runs_only_the_kinds_asked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []

    def layer_cells(shared_gpu: bool, timeout: float) -> list[matrix.Cell]:
        seen.append((shared_gpu, timeout))
        return [matrix.Cell("layer", ENTRY, "x", "pass", "", {"world_size": 2})]

    monkeypatch.setattr(matrix_gpu, "layer_cells", layer_cells)
    monkeypatch.setattr(matrix_gpu, "suite_cells", lambda *a: pytest.fail("suites were not asked for"))
    assert matrix.main(["--kinds", "layer", "--shared-gpu", "--two-rank-timeout", "9", "--out-dir", str(tmp_path)]) == 0
    assert seen == [(True, 9.0)]
    data = json.loads((tmp_path / "compat_matrix.json").read_text())
    assert [c["kind"] for c in data["cells"]] == ["layer"] and data["meta"]["kinds"] == ["layer"]
    assert "**Kinds selected** (`--kinds`): layer" in (tmp_path / "compat_matrix.md").read_text()


def test_a_cell_passes_only_when_every_rank_passes_and_names_the_worst_rank() -> None:
    cell = _merge(_ok(0.999990, 2e-6), _ok(0.999999, 1e-7))
    assert cell.result == "pass" and cell.case.endswith("T=7, world 2")
    assert cell.axes == {**AXES, "tokens": 7, "world_size": 2}
    assert cell.detail.startswith(WHERE + "; worst rank 0: cosine 0.999990")
    assert "; rank 1: cosine 0.999999" in cell.detail
    assert _merge(_ok(0.999999, 1e-7), _ok(0.999990, 2e-6)).detail.startswith(WHERE + "; worst rank 1: ")


def test_one_failing_rank_fails_the_cell_naming_that_rank() -> None:
    bad = Outcome("fail", "assert cosine >= 0.9999 and processed diff <= 0.0001: cosine 0.5", {"cosine": 0.5})
    cell = _merge(_ok(0.99999, 1e-6), bad)
    assert cell.result == "fail" and f"{WHERE}; rank 1: assert cosine" in cell.detail and "rank 0" not in cell.detail
    silent = _merge(None, _ok(0.99999, 1e-6))
    assert silent.result == "fail" and "no result from rank 0 (rank 1 exited rc=1: boom)" in silent.detail


def test_ranks_that_refuse_alike_are_not_supported_and_ranks_that_disagree_fail() -> None:
    refused = Outcome("not supported", "NotImplementedError: no shared expert here")
    assert _merge(refused, refused).result == "not supported"
    assert _merge(refused, refused).detail == refused.detail
    mixed = _merge(_ok(0.99999, 1e-6), refused)
    assert mixed.result == "fail" and "the ranks disagree: rank 0: pass" in mixed.detail
    assert "rank 1: not supported: NotImplementedError" in mixed.detail


def test_the_placement_of_a_cell() -> None:
    shared = {"rendezvous": "cuda-ipc", "ranks_on_device": 2, "mps": True, "label": f"2 {SHARED_GPU_LABEL}",
              "gpu": "NVIDIA H200"}
    assert matrix_gpu.placement_text(shared, 2) == WHERE
    own = {"rendezvous": "torch-symm-mem", "ranks_on_device": 1, "gpu": "NVIDIA H200"}
    assert matrix_gpu.placement_text(own, 2) == "2 ranks, one GPU each, NVIDIA H200 (rendezvous torch-symm-mem)"
    assert matrix_gpu.placement_text(None, 2) == "2 ranks (placement not reported)"


STAND_IN = """
import json, os, sys, time
plan = json.load(open(os.environ["MATRIX_TEST_PLAN"]))
rank = os.environ["RANK"]
mine = plan[rank]
result = sys.argv[sys.argv.index("--result") + 1]
with open(result, "w") as f:
    json.dump({"rank": int(rank), "placement": plan["placement"], "outcomes": mine["outcomes"]}, f)
print("env", *(f"{k}={os.environ[k]}" for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
      "MASTER_ADDR")), flush=True)
time.sleep(mine.get("sleep", 0))
sys.exit(mine.get("rc", 0))
"""


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Plan:
    """Replace the rank processes by a script that writes the outcomes a plan gives each rank, then sleeps and
    exits as told; returns the function that sets the plan."""
    script = tmp_path / "rank.py"
    script.write_text(STAND_IN)
    monkeypatch.setattr(matrix_gpu, "_rank_command", lambda: [sys.executable, str(script)])
    monkeypatch.setenv("MATRIX_TEST_PLAN", str(tmp_path / "plan.json"))
    monkeypatch.setenv("OUT", str(tmp_path))  # the ranks' folder goes there
    cases = [(entry, matrix_gpu.case_label(axes, t, 2)) for entry, axes, _ in matrix_gpu._entries()
             for t in matrix_gpu.LAYER_TOKENS]

    def plan(rank0: dict, rank1: dict, reported: tuple[int | None, int | None] = (None, None)
             ) -> list[tuple[str, str]]:
        outcome = {"result": "pass", "detail": "cosine 0.999999, processed diff 1.00e-07",
                   "metrics": {"cosine": 0.999999}}
        for rank, count in zip((rank0, rank1), reported, strict=True):  # each rank's first `count` cells
            rank.setdefault("outcomes", [{"entry": e, "case": c, **outcome} for e, c in cases[:count]])
        placement = {"rendezvous": "cuda-ipc", "ranks_on_device": 2, "mps": True, "label": f"2 {SHARED_GPU_LABEL}"}
        (tmp_path / "plan.json").write_text(json.dumps({"0": rank0, "1": rank1, "placement": placement}))
        return cases

    return plan


def test_two_rank_processes_that_report_every_cell_pass(stand_in: Plan) -> None:
    cases = stand_in({}, {})
    cells = matrix_gpu.two_rank_cells(timeout=60)
    assert [(c.entry, c.case) for c in cells] == cases and len(cells) == len(matrix_gpu._entries()) * 4
    assert all(c.result == "pass" and c.detail.startswith(f"2 {SHARED_GPU_LABEL} (rendezvous cuda-ipc, MPS on)")
               for c in cells)


def test_a_rank_that_exits_early_fails_the_cells_it_did_not_report(stand_in: Plan, tmp_path: Path) -> None:
    stand_in({}, {"rc": 1}, reported=(None, 3))
    cells = matrix_gpu.two_rank_cells(timeout=60)
    assert [c.result for c in cells[:3]] == ["pass"] * 3
    rest = cells[3:]
    assert rest and all(c.result == "fail" and "no result from rank 1 (rank 1 exited rc=1" in c.detail for c in rest)
    assert "the ranks' logs: " + str(tmp_path / "matrix_two_rank_") in rest[0].detail
    assert "env RANK=1 LOCAL_RANK=1 WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1" in rest[0].detail


def test_ranks_past_the_deadline_are_stopped_and_their_cells_fail(stand_in: Plan) -> None:
    stand_in({"sleep": 120}, {"sleep": 120}, reported=(0, 0))
    cells = matrix_gpu.two_rank_cells(timeout=2)
    assert cells and all(c.result == "fail" for c in cells)
    assert "no result from rank 0 and 1 (rank 0 ran past the 2 s deadline and was stopped" in cells[0].detail
    assert "rank 1 ran past the 2 s deadline" in cells[0].detail


def test_a_rank_waiting_for_a_failed_peer_is_stopped_after_the_grace(stand_in: Plan,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(matrix_gpu, "PEER_GRACE_S", 1)
    stand_in({"rc": 2}, {"sleep": 120}, reported=(0, 0))
    cells = matrix_gpu.two_rank_cells(timeout=100)
    detail = cells[0].detail
    assert cells[0].result == "fail" and "rank 0 exited rc=2" in detail
    assert "rank 1 stopped 1 s after its peer failed" in detail
