"""bench/layer_marks_sm90.py, the marked role1 and role2 variants that split a layer replay's time per warp / CTA: the
summary of the records (host), the argument checks, the fields matching the kernels' marks, the variants compiling
beside the production kernels without changing them (and without spills where the big shapes' large-T points run);
on an H200, every role2 CTA and role1 warp records its replay in order, every replay takes the same tasks and rows,
and the layer's output equals the production kernels'."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist
from nvcc_mark import needs_nvcc

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import layer_marks_sm90 as marks  # noqa: E402 - bench/ is a script folder, put on the path above

from gc_moe_compat.ab import model_config  # noqa: E402
from gc_moe_compat.operator.sm90 import role1_dispatch, role2_gemm  # noqa: E402
from gc_moe_compat.runtime import jit  # noqa: E402


def _role2(entry: int, pool: int, l1: int, l1n: int, l2: int, l2n: int, first: int, last: int, tasks: int,
           exit_: int) -> list[int]:
    return [entry, pool, l1, l1n, l2, l2n, first, last, tasks, exit_]


def _role1(entry: int, pull: int, first: int, refill: int, refills: int, rows: int, exit_: int) -> list[int]:
    return [entry, pull, first, refill, refills, rows, exit_]


def test_summary_reads_both_roles_after_the_earliest_entry_of_either() -> None:
    role2 = np.array([_role2(1000, 3000, 50_000, 5, 2000, 1, 4000, 400_000, 3, 410_000),
                      _role2(1500, 3500, 10_000, 1, 8000, 2, 4500, 401_000, 2, 420_000),
                      _role2(1200, 3200, 30_000, 3, 0, 0, 4200, 402_000, 2, 415_000)], dtype=np.int64)
    role1 = np.array([_role1(800, 2800, 6800, 0, 0, 10, 120_800),
                      _role1(900, 2900, 0, 0, 0, 0, 2900)], dtype=np.int64)  # a warp without rows
    later = role2.copy()
    later[:, 9] += 10_000  # every role2 CTA leaves 10 us later in the second replay
    got = marks.summary([{"role1": role1, "role2": role2}, {"role1": role1, "role2": later}])
    r1, r2 = got["role1"], got["role2"]
    assert r2["entry"] == {"median": pytest.approx(0.4), "max": pytest.approx(0.7)}  # after role1's 800 ns
    assert r2["exit"]["median"] == pytest.approx((414.2 + 424.2) / 2)
    assert r2["span"]["median"] == pytest.approx((419.2 + 429.2) / 2)
    assert r2["l1_wait_us"] == {"median": pytest.approx(30.0), "max": pytest.approx(50.0)}
    assert r2["tasks"] == {"median": 2.0, "max": 3.0}
    assert r1["first_row"] == {"median": pytest.approx(6.0), "max": pytest.approx(6.0)}  # the row-less warp left out
    assert r1["rows"] == {"median": 5.0, "max": 10.0}
    assert r1["span"]["median"] == pytest.approx(120.0)


def test_one_replays_records_are_kept_on_the_summarys_scale() -> None:
    role2 = np.array([_role2(1500, 3500, 10_000, 1, 0, 0, 0, 0, 0, 420_000)], dtype=np.int64)
    role1 = np.array([_role1(1000, 2000, 0, 4000, 2, 0, 9000)], dtype=np.int64)
    got = marks.raw({"role1": role1, "role2": role2})
    assert got["role1"] == [[0.0, 1.0, 0.0, 4.0, 2.0, 0.0, 8.0]]  # no first row: left 0
    assert got["role2"] == [[0.5, 2.5, 10.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 419.0]]


def test_combinable_reads_the_tokens_times_against_role2s_latest_exit() -> None:
    """Tokens complete 60 / 90 / 95 / 99 us after the origin (role1's entry at 1 us), role2's latest exit at 101 us;
    a fifth token without a time is left out and counted; two identical replays give their own values."""
    role2 = np.array([_role2(2000, 3000, 0, 0, 0, 0, 4000, 90_000, 3, 101_000),
                      _role2(1500, 3000, 0, 0, 0, 0, 4000, 90_000, 3, 95_000)], dtype=np.int64)
    role1 = np.array([_role1(1000, 2000, 3000, 0, 0, 5, 50_000)], dtype=np.int64)
    tokens = np.array([61_000, 91_000, 96_000, 100_000, 0], dtype=np.int64)
    replay = ({"role1": role1, "role2": role2}, tokens)
    got = marks.combinable([replay, replay])
    assert got["done_us"] == {"median": pytest.approx(92.5), "max": pytest.approx(99.0)}
    assert got["before_exit_us"]["p50"] == pytest.approx(7.5)  # leads 40, 10, 5, 1 us
    assert got["share_before_exit"] == {"5.0": 0.75, "10.0": 0.5, "20.0": 0.25, "40.0": 0.25}
    assert got["tokens_without_time"] == 1


def test_combinable_without_any_time_says_so() -> None:
    role2 = np.array([_role2(1000, 2000, 0, 0, 0, 0, 0, 0, 0, 9000)], dtype=np.int64)
    got = marks.combinable([({"role2": role2}, np.zeros(3, dtype=np.int64))])
    assert got["done_us"] == {"median": None, "max": None} and got["tokens_without_time"] == 3


def test_a_role2_variant_without_a_producer_leaves_its_producer_times_out() -> None:
    role2 = np.array([_role2(1000, 2000, 0, 0, 0, 0, 0, 0, 0, 9000)], dtype=np.int64)
    got = marks.summary([{"role2": role2}])["role2"]
    assert "first_load" not in got and "last_take" not in got
    assert got["exit"]["median"] == pytest.approx(8.0)


@pytest.mark.parametrize("argv", [["--replays", "0"], ["--windows", "0"], ["--tokens", "0"], ["--tokens", "8193"],
                                  ["--preset", "glm52", "--model-config", "x.json"]])
def test_bad_arguments_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        marks.parse_args(argv)


@pytest.mark.parametrize(("spec", "kernel", "prefix", "records"), [
    (marks.ROLE1, "kernels/sm90/role1_dispatch.cu", "kRole1Mark", "Warps"),
    (marks.ROLE2, "kernels/sm90/role2_ring.cuh", "kRole2Mark", "Ctas"),
])
def test_the_fields_are_the_kernels_marks_in_order(spec: marks.Recorded, kernel: str, prefix: str,
                                                   records: str) -> None:
    source = (REPO / kernel).read_text()
    at = [source.index(f"kMark{''.join(p.capitalize() for p in f.split('_'))} = {i},")
          for i, f in enumerate(spec.fields)]
    assert at == sorted(at)
    assert f"{prefix}Fields = {len(spec.fields)};" in source
    assert f"{prefix}{records} = {spec.records};" in source
    assert spec.tail == 0 or f"{prefix}Tokens = {spec.tail};" in source
    assert set(spec.times) | set(spec.waits) | set(spec.counts) == set(spec.fields) - {"entry"}


@needs_nvcc
def test_the_variants_leave_the_production_kernels_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The production builds have no global and no marks; each variant's global has its plain name; role1's variant
    and the pipelined FP8xFP8 BM = 64 / 96 role2 variants (T = 128 / 256 on the big shapes) do not spill, and role2's
    keep their registers."""
    monkeypatch.setenv("GC_MOE_CACHE_DIR", str(tmp_path))
    builds = [(marks.ROLE1, role1_dispatch.SOURCE, {}, role1_dispatch.KERNEL)]
    for bm in (64, 96):
        v = role2_gemm.Role2Variant(bm, True, True, "fp8xfp8")
        builds.append((marks.ROLE2, v.source, v.defines, v.kernel_name))
    for spec, source, defines, name in builds:
        production = jit.compile_cubin(source, defines)
        variant = jit.compile_cubin(source, {**defines, spec.define: 1})
        assert spec.global_name not in production.path.read_bytes()
        assert b"\0" + spec.global_name + b"\0" in variant.path.read_bytes()
        res, base = variant.resources[name], production.resources[name]
        assert res.spill_stores == 0 and res.spill_loads == 0 and res.stack_bytes == 0, (spec.role, defines)
        if spec is marks.ROLE2:
            assert res.registers == base.registers, defines


@pytest.mark.gpu
def test_every_record_of_a_replay_is_in_order_and_the_output_stays(group: dist.ProcessGroup) -> None:
    w = model_config.explicit(2048, 1024, 64, 8, ep_size=8)
    points, partition = marks.measure(w, [128], group, replays=3, warmup=1, windows=2)
    (point,) = points
    assert point["bit_identical"]
    assert point["records"]["role2"] == partition["compute_sms"]  # one record per CTA of role2's grid
    assert point["records"]["role1"] == 16 * partition["dispatch_sms"]  # one per warp of role1's grid
    tasks = point["role2_tasks_per_replay"]
    assert tasks[0] > point["records"]["role2"] and len(set(tasks)) == 1  # pipelined; the same tasks every replay
    r1, r2 = point["marks"]["role1"], point["marks"]["role2"]
    assert 0 <= r2["entry"]["max"] <= r2["pool_ready"]["max"] <= r2["exit"]["max"] == r2["span"]["max"]
    assert r2["first_load"]["median"] <= r2["last_take"]["median"] <= r2["exit"]["median"]
    assert r1["pull_start"]["max"] <= r1["exit"]["max"] and r1["first_row"]["median"] <= r1["exit"]["median"]
    assert point["role1_rows_per_replay"] == [128 * 8] * 3  # top-8 of 8 experts: every entry is a row
    assert [len(point["last_replay"][r]) for r in ("role1", "role2")] == [point["records"]["role1"],
                                                                        point["records"]["role2"]]
    done = point["combinable"]
    assert done["tokens_without_time"] == 0  # every token has a stored slot
    assert r2["pool_ready"]["median"] < done["done_us"]["median"] <= done["done_us"]["max"] <= r2["span"]["max"]
    assert 0 <= done["before_exit_us"]["p10"] <= done["before_exit_us"]["p50"] <= done["before_exit_us"]["p90"]
