"""bench/_ep_ll_phases.py, the phase-timed low-latency kernels that ``bench/deep_ep_sm90.py --phases`` (one rank) and
``bench/deep_ep_ab.py --phases`` (P ranks, every CTA a mover) read: the summary of the marks with the one-rank
checker apart (host), the printed lines, ``--phases``' bound, the variant
compiling beside the production kernels without spills and without changing them; on an H200, every CTA of a
dispatch and a combine marks its steps in order, the outputs equal the production kernels', and the production
kernels are back after the block."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from nvcc_mark import needs_nvcc

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import _ep_ll_phases as phases  # noqa: E402 - bench/ is a script folder, put on the path above
import _phase_marks  # noqa: E402
import deep_ep_ab as ab  # noqa: E402
import deep_ep_sm90 as bench  # noqa: E402

from gc_moe_compat.comm import ep_ll  # noqa: E402
from gc_moe_compat.comm.ep_ll import THREADS, Kernel, LlShape  # noqa: E402
from gc_moe_compat.deep_ep import Buffer  # noqa: E402
from gc_moe_compat.runtime import jit  # noqa: E402


def _combine_calls() -> list[np.ndarray]:
    """Two calls of a three-CTA combine: two movers, then the checker (the grid's last CTA)."""
    first = np.array([[1000, 4000, 5000],
                      [1200, 6000, 6500],
                      [1100, 2000, 3000]], dtype=np.int64)
    second = first + 10_000
    second[1, 1:] += 2000  # a slower second mover in the second call
    return [first, second]


def test_summary_keeps_the_checker_apart_and_names_the_last_cta() -> None:
    got = phases.summary(_combine_calls(), "combine", checker=True)
    assert got["ctas"] == 3 and got["last_exit_cta"] == 1
    assert list(got["median_us"]) == list(phases.MARKS["combine"])
    assert got["median_us"]["summed"] == pytest.approx(((3.0 + 5.0) / 2 + (3.0 + 7.0) / 2) / 2)  # the movers only
    assert got["latest_us"]["exit"] == pytest.approx((5.5 + 7.5) / 2)
    assert got["checker_us"] == pytest.approx({"entry": 0.1, "decided": 1.0, "exit": 2.0})
    together = phases.summary(_combine_calls(), "combine", checker=False)  # more ranks: no checker
    assert "checker_us" not in together and together["latest_us"]["summed"] == pytest.approx((5.0 + 7.0) / 2)


def test_a_lone_cta_is_no_separate_checker() -> None:
    lone = [np.array([[1000, 1500, 2000]], dtype=np.int64)]
    got = phases.summary(lone, "combine", checker=True)
    assert "checker_us" not in got and got["latest_us"]["exit"] == pytest.approx(1.0)


def test_phase_lines_print_each_op_and_the_output_check() -> None:
    point = {"tokens_per_rank": 128, "phases": {
        op: phases.summary(_combine_calls(), "combine", checker=True) for op in bench.LL_OPS} | {
        "outputs_identical": True}}
    lines = bench.phase_lines(point)
    assert len(lines) == len(bench.LL_OPS) + 1
    assert "T=128 dispatch (3 CTAs, last exit CTA 1)" in lines[0] and "| checker entry 0.10 decided 1.00" in lines[0]
    assert lines[-1].endswith("production kernels': True")
    assert bench.phase_lines({"tokens_per_rank": 1}) == []


def test_the_swapped_lookup_is_restored_even_when_the_block_raises() -> None:
    production = ep_ll.kernel_of
    with pytest.raises(RuntimeError, match="inside"), _phase_marks.swapped(ep_ll, "kernel_of", phases._variant_kernel):
        assert ep_ll.kernel_of is phases._variant_kernel
        raise RuntimeError("inside")
    assert ep_ll.kernel_of is production


def test_phases_must_not_be_negative() -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--phases", "-1"])
    assert bench.parse_args([]).phases == 0 and bench.parse_args(["--phases", "4"]).phases == 4


def test_deep_ep_ab_times_each_op_on_the_variant_with_every_cta_a_mover(monkeypatch: pytest.MonkeyPatch,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    made: list[str] = []

    class Times:  # the variant's buffer: each op's marks, two CTAs, the second one later at every mark
        def timed(self, fn: Callable[[], object], direction: str) -> np.ndarray:
            fn()
            marks = len(phases.MARKS[direction])
            first = np.arange(1, marks + 1, dtype=np.int64) * 1000
            return np.stack([first, first + 500])

    @contextlib.contextmanager
    def variant(device: torch.device) -> Iterator[Times]:
        yield Times()

    monkeypatch.setattr(phases, "variant", variant)
    calls = {op: (lambda op=op: made.append(op)) for op in ab.LL_OPS}
    got = ab.ll_phases(torch.device("cpu"), calls, 3)
    assert made == ["dispatch"] * 3 + ["combine"] * 3
    assert set(got) == set(ab.LL_OPS) and all("checker_us" not in s for s in got.values())  # no checker above P = 1
    assert got["dispatch"]["ctas"] == 2 and got["dispatch"]["latest_us"]["exit"] == pytest.approx(5.5)
    point = {"job": "low_latency P=2", "preset": "glm", "tokens_per_rank": 8, "latency_us": {}, "host_us": {},
             "accuracy": {}, "phases": [got, got]}
    ab.record_point(type("Out", (), {"add_point": lambda self, p: None})(), point)
    out = capsys.readouterr().out
    assert "phases rank 1 combine: median CTA entry 0.2 / summed 1.2 / exit 2.2 us; latest CTA's exit 2.5 us" in out


@needs_nvcc
def test_the_variant_compiles_beside_the_production_kernels_without_spills(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The marks cost the kernels at most a few registers, no spill, and leave two CTAs of either an SM; the production
    build (no define) has no global for them; the variant's global has its plain name (outside any namespace)."""
    monkeypatch.setenv("GC_MOE_CACHE_DIR", str(tmp_path))
    production = jit.compile_cubin(ep_ll.SOURCE).resources
    variant = jit.compile_cubin(ep_ll.SOURCE, phases.DEFINES).resources
    assert set(variant) == set(production) == set(ep_ll._MANGLED.values())
    for name, res in variant.items():
        assert res.spill_stores == 0 and res.spill_loads == 0 and res.stack_bytes == 0, name
        assert res.registers <= production[name].registers + 8, name
        assert res.registers * THREADS * ep_ll.CTAS_PER_SM <= 65536, name
    symbol = b"\0" + phases.GLOBAL + b"\0"  # the plain name in the string table: what cuLibraryGetGlobal finds
    assert phases.GLOBAL not in jit.compile_cubin(ep_ll.SOURCE).path.read_bytes()
    assert symbol in jit.compile_cubin(ep_ll.SOURCE, phases.DEFINES).path.read_bytes()


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 128])
def test_every_cta_marks_its_steps_in_order_and_the_outputs_stay(group: dist.ProcessGroup, tokens: int) -> None:
    hidden, topk, experts, tmax = 7168, 8, 288, 128
    device = torch.device("cuda", torch.cuda.current_device())
    buf = Buffer(group, 0, Buffer.get_low_latency_rdma_size_hint(tmax, hidden, 1, experts), low_latency_mode=True,
                 explicitly_destroy=True)
    try:
        g = torch.Generator().manual_seed(11 + tokens)
        x = torch.randn(tokens, hidden, generator=g).to(device=device, dtype=torch.bfloat16)
        idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)]).to(device)
        w = torch.rand(tokens, topk, generator=g).to(device)
        want_recv, want_count, handle, _, _ = buf.low_latency_dispatch(x, idx, tmax, experts, use_fp8=False)
        want_out = buf.low_latency_combine(want_recv, idx, w, handle)[0]
        torch.cuda.synchronize()
        got: dict[str, tuple] = {}
        production = ep_ll.kernel_of
        with phases.variant(device) as times:
            assert ep_ll.kernel_of is phases._variant_kernel
            marks = {"dispatch": times.timed(lambda: got.update(
                dispatch=buf.low_latency_dispatch(x, idx, tmax, experts, use_fp8=False)), "dispatch")}
            marks["combine"] = times.timed(lambda: got.update(combine=buf.low_latency_combine(
                got["dispatch"][0], idx, w, got["dispatch"][2])), "combine")
        assert ep_ll.kernel_of is production
        count = got["dispatch"][1]
        assert torch.equal(count, want_count)
        for e in range(count.numel()):
            assert torch.equal(got["dispatch"][0][e, :int(count[e])], want_recv[e, :int(count[e])]), e
        assert torch.equal(got["combine"][0], want_out)
        shape = LlShape(1, experts, tmax, hidden, topk)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        for direction, kernel in (("dispatch", Kernel.DISPATCH_SEND), ("combine", Kernel.COMBINE_SEND)):
            m = marks[direction]
            assert m.shape == (ep_ll.fused_grid(kernel, shape, tokens, sms), len(phases.MARKS[direction])), direction
            assert (np.diff(m, axis=1) >= 0).all(), direction  # movers' and the checker's steps alike
    finally:
        buf.destroy()
