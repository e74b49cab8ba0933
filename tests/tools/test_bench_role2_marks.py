"""bench/role2_marks_sm90.py, the marked role2 variant that splits a replay's role2 time per CTA: the summary of the
records (host), the argument checks, the variant compiling beside the production kernels without changing them (and
without spills where the big shapes' large-T points run); on an H200, every CTA of the grid records its entry and
exit in order, every replay takes the same tasks, and the layer's output equals the production kernel's."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist
from nvcc_mark import needs_nvcc

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import role2_marks_sm90 as marks  # noqa: E402 - bench/ is a script folder, put on the path above

from gc_moe_compat.ab import model_config  # noqa: E402
from gc_moe_compat.operator.heuristics import block_m_candidates  # noqa: E402
from gc_moe_compat.operator.sm90 import role2_gemm  # noqa: E402
from gc_moe_compat.runtime import jit  # noqa: E402


def _record(entry: int, pool: int, l1: int, l1n: int, l2: int, l2n: int, first: int, last: int, tasks: int,
            exit_: int) -> list[int]:
    return [entry, pool, l1, l1n, l2, l2n, first, last, tasks, exit_]


def test_summary_reads_times_after_the_earliest_entry_and_waits_in_microseconds() -> None:
    first = np.array([_record(1000, 3000, 50_000, 5, 2000, 1, 4000, 400_000, 3, 410_000),
                      _record(1500, 3500, 10_000, 1, 8000, 2, 4500, 401_000, 2, 420_000),
                      _record(1200, 3200, 30_000, 3, 0, 0, 4200, 402_000, 2, 415_000)], dtype=np.int64)
    second = first.copy()
    second[:, 9] += 10_000  # every CTA leaves 10 us later in the second replay
    got = marks.summary([first, second])
    assert got["entry"] == {"median": pytest.approx(0.2), "max": pytest.approx(0.5)}
    assert got["exit"]["median"] == pytest.approx((414.0 + 424.0) / 2)  # medians of 414 and 424 us
    assert got["exit"]["max"] == pytest.approx((419.0 + 429.0) / 2)
    assert got["span"]["median"] == pytest.approx((419.0 + 429.0) / 2)
    assert got["l1_wait_us"] == {"median": pytest.approx(30.0), "max": pytest.approx(50.0)}
    assert got["l2_wait_us"]["max"] == pytest.approx(8.0)
    assert got["tasks"] == {"median": 2.0, "max": 3.0}
    assert got["pool_ready"]["median"] == pytest.approx(2.2)


def test_a_variant_without_a_producer_leaves_its_producer_times_out() -> None:
    rows = np.array([_record(1000, 2000, 0, 0, 0, 0, 0, 0, 0, 9000)], dtype=np.int64)
    got = marks.summary([rows])
    assert "first_load" not in got and "last_take" not in got
    assert got["exit"]["median"] == pytest.approx(8.0)


@pytest.mark.parametrize("argv", [["--replays", "0"], ["--windows", "0"], ["--tokens", "0"],
                                  ["--preset", "glm52", "--model-config", "x.json"]])
def test_bad_arguments_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        marks.parse_args(argv)


def test_the_fields_are_the_kernels_marks_in_order() -> None:
    source = (REPO / "kernels/sm90/role2_ring.cuh").read_text()
    names = ["kMark" + "".join(p.capitalize() for p in f.split("_")) for f in marks.FIELDS]
    at = [source.index(f"{name} = {i},") for i, name in enumerate(names)]
    assert at == sorted(at)
    assert f"kRole2MarkFields = {len(marks.FIELDS)};" in source and f"kRole2MarkCtas = {marks.CTAS};" in source


@needs_nvcc
def test_the_variant_leaves_the_production_kernels_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The production build has no global and no marks; the variant's global has its plain name; the pipelined
    FP8xFP8 BM = 64 / 96 variants (T = 128 / 256 on the big shapes) keep their registers and do not spill."""
    monkeypatch.setenv("GC_MOE_CACHE_DIR", str(tmp_path))
    for bm in (64, 96):
        v = role2_gemm.Role2Variant(bm, True, True, "fp8xfp8")
        production = jit.compile_cubin(v.source, v.defines)
        variant = jit.compile_cubin(v.source, {**v.defines, **marks.DEFINES})
        assert marks.GLOBAL not in production.path.read_bytes()
        assert b"\0" + marks.GLOBAL + b"\0" in variant.path.read_bytes()
        res, base = variant.resources[v.kernel_name], production.resources[v.kernel_name]
        assert res.spill_stores == 0 and res.spill_loads == 0 and res.stack_bytes == 0, bm
        assert res.registers == base.registers, bm
    assert 96 in block_m_candidates("fp8xfp8")


@pytest.mark.gpu
def test_every_cta_records_its_replay_and_the_output_stays(group: dist.ProcessGroup) -> None:
    w = model_config.explicit(2048, 1024, 64, 8, ep_size=8)
    points, partition = marks.measure(w, [128], group, replays=3, warmup=1, windows=2)
    (point,) = points
    assert point["bit_identical"]
    assert point["ctas"] == partition["compute_sms"]  # one record per CTA of role2's grid
    tasks = point["tasks_per_replay"]
    assert tasks[0] > point["ctas"] and len(set(tasks)) == 1  # pipelined; every replay walks the same tasks
    m = point["marks"]
    assert 0 <= m["entry"]["max"] <= m["pool_ready"]["max"] <= m["exit"]["max"] == m["span"]["max"]
    assert m["first_load"]["median"] <= m["last_take"]["median"] <= m["exit"]["median"]
