"""Host-side parts of bench/deep_ep_ab.py (the facade against the original DeepEP at P ranks on one GPU): the command
line and its plan, the dry run and the no-GPU refusal, the original's provenance, the buffer sizing, the comparison of
the two implementations' outputs (low-latency rows matched by source whatever their order), the point assembled
from every rank, the floor, the table and the shared-GPU PNG, the spawned ranks' timeout, the original's NVSHMEM
heap, and the device_check.sh wiring."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import deep_ep_ab as ab  # noqa: E402 - bench/ is a script folder, put on the path above
from test_allocations_name_device_and_dtype import violations  # noqa: E402 - this folder's AST rule

from gc_moe_compat.deep_ep import Config  # noqa: E402
from gc_moe_compat.runtime.colocation import SHARED_GPU_LABEL  # noqa: E402


def test_defaults_are_sglangs_shapes_and_sweeps() -> None:
    args = ab.parse_args([])
    assert args.ranks == [2, 4] and args.modes == ["normal", "low_latency"] and args.ll_tmax == 256
    assert {n: (s.hidden, s.topk, s.experts) for n, s in ab.SHAPES.items()} == {
        "deepseek-v3": (7168, 8, 256), "kimi-k2": (7168, 8, 384), "glm": (5120, 8, 160), "qwen": (6144, 8, 128)}
    assert args.tokens == [512, 1024, 2048, 4096, 8192] and args.ll_tokens == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert args.out == Path("deep_ep_ab.json")  # the working directory, never bench/results/ unless named


@pytest.mark.parametrize("argv", [
    ["--ranks", "1"], ["--ranks", "9"],
    ["--ranks", "3"],  # does not divide 256 experts
    ["--ll-tokens", "257"], ["--ll-tmax", "128", "--ll-tokens", "256"], ["--tokens", "0"],
    ["--num-sms", "23"], ["--windows", "0"], ["--ll-original-env", "NVSHMEM_X"],
])
def test_parse_args_refuses_what_no_run_can_do(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        ab.parse_args(argv)


def test_a_rank_count_that_divides_the_chosen_shapes_is_accepted() -> None:
    assert ab.parse_args(["--ranks", "5", "--shapes", "glm"]).ranks == [5]  # 160 = 5 x 32


def test_env_variant_reads_key_value_words() -> None:
    assert ab.env_variant("A=1 B= C=x=y") == {"A": "1", "B": "", "C": "x=y"}
    assert ab.env_variant("A=1+B=P2P,TRANSPORT") == {"A": "1", "B": "P2P,TRANSPORT"}  # one word a try
    with pytest.raises(ValueError, match="KEY=VALUE"):
        ab.env_variant("A=1 =2")


def test_the_static_nvshmem_heap_is_sized_to_the_buffer_only_where_vmm_is_off() -> None:
    need = 3_800_000_000
    env = {"NVSHMEM_DISABLE_CUDA_VMM": "1"}
    ab.size_static_heap(need, env)
    assert int(env["NVSHMEM_SYMMETRIC_SIZE"]) == need + ab.NVSHMEM_DEFAULT_HEAP  # the default 1 GiB would be short
    given = {"NVSHMEM_DISABLE_CUDA_VMM": "1", "NVSHMEM_SYMMETRIC_SIZE": "8G"}
    ab.size_static_heap(need, given)
    assert given["NVSHMEM_SYMMETRIC_SIZE"] == "8G"  # a try's own size is kept
    for vmm in ({}, {"NVSHMEM_DISABLE_CUDA_VMM": "0"}):
        ab.size_static_heap(need, vmm)
        assert "NVSHMEM_SYMMETRIC_SIZE" not in vmm  # VMM's heap grows by itself
    assert "NVSHMEM_DISABLE_CUDA_VMM=1" in ab.LL_ORIGINAL_ENV[0]


def test_dry_run_prints_the_plan_with_the_shared_gpu_label(capsys: pytest.CaptureFixture[str]) -> None:
    assert ab.main(["--dry-run", "--ranks", "2", "4", "8"]) == 0
    out = capsys.readouterr().out
    assert SHARED_GPU_LABEL in out and "all-to-all baseline: omitted" in out and "not capturable" in out
    assert f"points: {3 * 4 * (5 + 9)}" in out
    assert ab.requested_jobs(ab.parse_args(["--ranks", "2", "4", "--modes", "low_latency"])) == \
        ["low_latency P=2", "low_latency P=4"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_without_a_gpu_the_script_says_so() -> None:
    run = subprocess.run([sys.executable, str(REPO / "bench/deep_ep_ab.py"), "--ranks", "2"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 1 and "deep_ep_ab: needs a CUDA GPU" in run.stderr


def test_source_info_reads_the_staging_beside_the_package(tmp_path: Path) -> None:
    (tmp_path / "deep_ep").mkdir()
    origin = tmp_path / "deep_ep/__init__.py"
    origin.write_text("")
    (tmp_path / "setup.py").write_text("setup(name='deep_ep', version='1.2.1' + revision)\n")
    assert ab.source_info(str(origin)) == {
        "location": "<outside the checkout>/deep_ep/__init__.py", "version": "1.2.1",
        "source": "no SOURCE file beside the package (not staged by scripts/build_deep_ep.sh)"}
    sha = "9af0e0d0e74f3577af1979c9b9e1ac2cad0104ee"
    (tmp_path / "SOURCE").write_text(f"/some/clone v1.2.1 {sha}\n")
    info = ab.source_info(str(origin))
    assert info["commit"] == sha and info["ref"] == "v1.2.1" and "/some/clone" not in str(info)
    assert ab.source_info(None) == {"location": None}


def test_errors_name_the_originals_build_folder_without_its_path(tmp_path: Path) -> None:
    origin = tmp_path / "deep_ep/__init__.py"
    root = ab.original_root(str(origin))
    assert root == str(tmp_path.resolve()) and ab.original_root(None) is None
    point = {"job": "normal P=2", "errors": {
        "rank 0: original": f"RuntimeError: Failed: Assertion error {root}/csrc/kernels/intranode.cu:123 'x'"}}
    clean = ab.without_root(point, root)
    assert clean["errors"] == {
        "rank 0: original": "RuntimeError: Failed: Assertion error <original DeepEP>/csrc/kernels/intranode.cu:123 'x'"}
    assert point["errors"]["rank 0: original"].count(root) == 1  # the measured record is not changed in place
    assert ab.without_root({"job": "x"}, root) == {"job": "x"} and ab.without_root(point, None) is point


def test_the_facade_host_path_is_recorded_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GC_MOE_DEEP_EP_HOST_PATH", "python")
    assert ab.facade_host_path() == "python (GC_MOE_DEEP_EP_HOST_PATH=python)"
    # the compiled path's reason names the cache folder it was built in: recorded without the machine's path
    from gc_moe_compat.deep_ep import _compiled_host
    from gc_moe_compat.runtime.jit import cache_dir

    built = {"host_path": "compiled", "reason": f"_compiled_host.cpp built in {cache_dir()}/deep_ep_compiled_host/ab"}
    monkeypatch.setattr(_compiled_host, "host_path", lambda: built)
    assert ab.facade_host_path() == "compiled (_compiled_host.cpp built in <cache dir>/deep_ep_compiled_host/ab)"


def test_the_host_reference_times_bare_launches_in_the_points_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def timed(window, warmup, windows, before_window, launches):  # noqa: ANN001, ANN202 - the protocol's signature
        seen.update(warmup=warmup, windows=windows, before=before_window, launches=launches)
        window()
        return [9.0], 4.25

    monkeypatch.setattr(ab, "timed_windows", timed)
    monkeypatch.setattr(ab.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    monkeypatch.setattr(ab, "cpu_quota", lambda: 4.0)
    args = ab.parse_args(["--ranks", "2", "--calls", "7", "--warmup", "1", "--windows", "5"])
    assert ab.host_reference(torch.device("cpu"), args) == {"launch_us": 4.25, "cpus": 3, "cpu_quota": 4.0}
    assert seen == {"warmup": 1, "windows": 5, "before": ab.barrier, "launches": 7}


@pytest.mark.parametrize(("text", "cpus"), [("max 100000\n", None), ("400000 100000\n", 4.0),
                                            ("150000 100000", 1.5), ("", None)])
def test_the_cpu_quota_is_read_from_the_cgroup(tmp_path: Path, text: str, cpus: float | None) -> None:
    path = tmp_path / "cpu.max"
    path.write_text(text)
    assert ab.cpu_quota(path) == cpus
    assert ab.cpu_quota(tmp_path / "absent") is None


def test_normal_buffers_hold_a_whole_call_in_128_byte_units() -> None:
    size = ab.normal_nvl_bytes(7168, 8192, 4, 24)
    assert size % 128 == 0 and size >= 4 * 8192 * 2 * 7168
    assert size >= Config(24, 8, 256).get_nvl_buffer_size_hint(2 * 7168, 4)


def test_normal_config_fits_every_rank_on_the_one_gpu() -> None:
    """Config.num_sms is the requested 24 where P ranks' CTAs fit an H200's 132 SMs together (P = 2, 4), the rank's
    even share where they would not (P = 8: 8 x 24 = 192 one-SM CTAs, the original's spinning on peers'), and never
    more than asked."""
    assert [ab.normal_num_sms(24, p, 132) for p in (1, 2, 4, 8)] == [24, 24, 24, 16]
    assert ab.normal_num_sms(8, 8, 132) == 8
    assert all(ab.normal_num_sms(24, p, 132) * p <= 132 for p in (1, 2, 4, 8))


def test_mismatch_names_what_differs() -> None:
    a = torch.arange(6, dtype=torch.int32, device="cpu").view(2, 3)
    assert ab.mismatch(a, a.T.contiguous().T.clone()) is None
    assert ab.mismatch(a, a.clone().fill_(0)) == "5 of 6 elements differ"
    assert ab.mismatch(a, a.to(torch.int64)) == "torch.int32 [2, 3] != torch.int64 [2, 3]"
    assert ab.mismatch([1, 2], [1, 2]) is None and ab.mismatch([1], [2]) == "[1] != [2]"
    assert ab.mismatch(a, [1]) == "Tensor != list"
    # compared in slices: the counts of every slice add up, a difference in the last, partial slice included
    b = a.clone().view(-1)
    b[[0, 4, 5]] = -1
    assert all(ab.mismatch(a, b.view(2, 3), chunk=c) == "3 of 6 elements differ" for c in (1, 2, 4, 6, 64))
    got = ab.compare({"x": a, "n": [1], "only_facade": a}, {"x": a + 1, "n": [1]})
    assert got == {"exact": ["n"], "mismatch": {"x": "6 of 6 elements differ"}}


def _ll_call(order: list[int], payload: torch.Tensor, sources: list[tuple[int, int]], tmax: int
             ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """One expert's received rows in ``order`` (within each source rank's block), as DeepEP's handle records them."""
    rows = [sources[i] for i in order]
    recv = torch.zeros((1, tmax, payload.shape[1]), dtype=payload.dtype, device="cpu")
    recv[0, :len(rows)] = payload[order]
    scales = recv[..., :1].float() + 0.5
    src_info = torch.zeros((1, tmax), dtype=torch.int32, device="cpu")
    src_info[0, :len(rows)] = torch.tensor([t for _, t in rows], dtype=torch.int32, device="cpu")
    ranks = [r for r, _ in rows]
    layout = torch.tensor([[(ranks.index(q) << 32) | ranks.count(q) if q in ranks else 0 for q in range(2)]],
                          dtype=torch.int64, device="cpu")
    count = torch.tensor([len(rows)], dtype=torch.int32, device="cpu")
    return (recv, scales), count, src_info, layout


def test_low_latency_rows_are_matched_by_source_whatever_the_order() -> None:
    """DeepEP orders one source rank's rows by its atomics: the canonical order (source rank, token) makes two
    receive orders of the same rows compare equal, and the stand-in expert rows follow each row's source."""
    tokens, tmax = 4, 16
    sources = [(0, 1), (0, 3), (1, 0), (1, 2), (1, 3)]
    payload = torch.arange(5 * 8, dtype=torch.float32, device="cpu").view(5, 8)
    got = {}
    for name, order in (("facade", [0, 1, 2, 3, 4]), ("original", [1, 0, 4, 2, 3])):
        recv, count, src_info, layout = _ll_call(order, payload, sources, tmax)
        flat = ab.ll_row_sources(count, src_info, layout, tokens)
        assert sorted(flat[0].tolist()) == [r * tokens + t for r, t in sources]
        got[name] = ab.ll_received(recv, count, flat)
        x_all = torch.randn((2 * tokens, 8), device="cpu").to(torch.bfloat16)
        rows = ab.ll_expert_rows(flat, x_all, tmax, first_expert=3)
        assert rows.shape == (1, tmax, 8) and rows.dtype == torch.bfloat16 and not rows[0, 5:].any()
        factor = 1 + 3 / 8
        for i, source in enumerate(flat[0].tolist()):
            assert torch.equal(rows[0, i], (x_all[source].float() * factor).to(torch.bfloat16))
    assert ab.compare(got["facade"], got["original"])["mismatch"] == {}
    assert got["facade"]["recv_x"].shape == (5, 8)


def test_a_point_takes_the_slowest_rank_and_every_ranks_mismatches() -> None:
    records = [
        {"latency_us": {"facade/dispatch": 10.0, "original/dispatch": 30.0}, "host_us": {"facade/dispatch": 1.0},
         "graph_us": {"facade/dispatch": 4.0, "original/dispatch": 6.0},
         "accuracy": {"exact": ["recv_x"], "mismatch": {}}},
        {"latency_us": {"facade/dispatch": 20.0}, "host_us": {"facade/dispatch": 2.0},
         "accuracy": {"exact": [], "mismatch": {"recv_x": "1 of 2 bytes differ"}},
         "errors": {"original": "RuntimeError: x"}},
    ]
    p = ab.assemble_point({"mode": "low_latency"}, records, {"dispatch": 1.0}, ("dispatch",), "measured")
    assert p["latency_us"] == {"facade/dispatch": 20.0, "original/dispatch": 30.0}
    assert p["per_rank_us"]["original/dispatch"] == [30.0, None]
    assert p["speedup"] == {"dispatch": 1.5} and p["graph_speedup"] == {"dispatch": 1.5}
    assert p["accuracy"]["mismatch"] == {"rank 1: recv_x": "1 of 2 bytes differ"}
    assert p["errors"] == {"rank 1: original": "RuntimeError: x"}


def test_rounds_alternate_the_implementations_and_keep_the_median_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """--rounds: every round times both implementations, the order reversed every other round; a figure is the
    median round's, each round's GPU time kept; an implementation that raises leaves the later rounds and the
    figures, recorded in the errors."""
    order: list[str] = []
    gpu = iter([10.0, 20.0, 14.0, 26.0, 12.0, 22.0])  # facade, original, original, facade, facade, original
    monkeypatch.setattr(ab, "eager_us", lambda fn, args: (fn(), (next(gpu), 1.0))[1])
    calls = {impl: {"dispatch": lambda impl=impl: order.append(impl)} for impl in ("facade", "original")}
    errors: dict[str, str] = {}
    got = ab.timed_rounds(calls, ("dispatch",), ab.parse_args(["--rounds", "3"]), errors, graph=False)
    assert order == ["facade", "original", "original", "facade", "facade", "original"]
    assert got["rounds_us"] == {"facade/dispatch": [10.0, 26.0, 12.0], "original/dispatch": [20.0, 14.0, 22.0]}
    assert got["latency_us"] == {"facade/dispatch": 12.0, "original/dispatch": 20.0}
    assert got["host_us"] == {"facade/dispatch": 1.0, "original/dispatch": 1.0} and not errors

    def fails() -> None:
        raise RuntimeError("boom")

    order.clear()
    calls["original"] = {"dispatch": fails}
    gpu = iter([10.0, 11.0])
    got = ab.timed_rounds(calls, ("dispatch",), ab.parse_args(["--rounds", "2"]), errors, graph=False)
    assert order == ["facade", "facade"] and errors == {"original": "RuntimeError: boom"}
    assert got["latency_us"] == {"facade/dispatch": 10.5} and list(got["rounds_us"]) == ["facade/dispatch"]


def test_a_normal_points_record_times_both_in_rounds_and_compares_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """normal_rank_record on stand-in implementations: outputs, every op timed in each round, the comparison; the
    implementation whose outputs raise is recorded and the other still timed."""
    timed: list[str] = []
    monkeypatch.setattr(ab, "eager_us", lambda fn, args: (fn(), (5.0, 1.0))[1])
    monkeypatch.setattr(ab, "compare", lambda facade, original: {"exact": ["recv_x"], "mismatch": {}})

    def outputs(buf, module, *rest):
        if buf == "broken":
            raise RuntimeError("no buffer")
        return {"recv_x": torch.zeros(3, 2)}, {op: lambda op=op: timed.append(f"{buf}/{op}") for op in ab.NORMAL_OPS}

    monkeypatch.setattr(ab, "normal_outputs", outputs)
    job = ab.Job("measure", 2, 0, "", ab.parse_args(["--rounds", "2"]), use_original=True)
    device = torch.device("cpu")
    record = ab.normal_rank_record(0, device, job, {"facade": (None, "facade"), "original": (None, "original")},
                                   "glm", 8, 2)
    assert timed == [f"{impl}/{op}" for impl in ("facade", "original", "original", "facade") for op in ab.NORMAL_OPS]
    assert record["recv_rows"] == 3 and record["accuracy"]["exact"] == ["recv_x"] and record["errors"] == {}
    assert record["rounds_us"]["original/combine"] == [5.0, 5.0]
    record = ab.normal_rank_record(0, device, job, {"facade": (None, "facade"), "original": (None, "broken")},
                                   "glm", 8, 2)
    assert record["errors"] == {"original": "RuntimeError: no buffer"} and "accuracy" not in record
    assert list(record["latency_us"]) == [f"facade/{op}" for op in ab.NORMAL_OPS]


def test_a_low_latency_points_record_times_eager_and_graph_calls_in_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """ll_rank_record on stand-in implementations: per round each implementation's eager ops, then its graphs; the
    graph figures are the median round's too, the rounds kept are the eager GPU times."""
    timed: list[str] = []
    monkeypatch.setattr(ab, "eager_us", lambda fn, args: (fn(), (5.0, 1.0))[1])
    graph = iter([3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0])
    monkeypatch.setattr(ab, "graph_us", lambda fn, args: (fn(), next(graph))[1])
    monkeypatch.setattr(ab, "compare", lambda facade, original: {"exact": ["recv_x"], "mismatch": {}})

    def outputs(buf, *rest):
        calls = {op: lambda op=op: timed.append(f"{buf}/{op}") for op in ab.LL_OPS}
        graphs = {f"graph:{op}": lambda op=op: timed.append(f"{buf}/graph:{op}") for op in ab.LL_OPS}
        return {"recv_count": torch.tensor([2, 1])}, calls | graphs

    monkeypatch.setattr(ab, "ll_outputs", outputs)
    job = ab.Job("measure", 2, 0, "", ab.parse_args(["--rounds", "2"]), use_original=True)
    impls = {"facade": (None, "facade"), "original": (None, "original")}
    record = ab.ll_rank_record(0, torch.device("cpu"), job, impls, "glm", 4)
    per_impl = [*ab.LL_OPS, *(f"graph:{op}" for op in ab.LL_OPS)]
    assert timed == [f"{impl}/{op}" for impl in ("facade", "original", "original", "facade") for op in per_impl]
    assert record["recv_rows"] == 3 and record["accuracy"]["exact"] == ["recv_x"]
    facade = f"facade/{ab.LL_OPS[0]}"
    assert record["graph_us"][facade] == statistics.median([3.0, 9.0]) and record["rounds_us"][facade] == [5.0, 5.0]


def test_a_points_rounds_are_the_slowest_rank_per_round_with_their_spread() -> None:
    records = [{"latency_us": {"facade/dispatch": 12.0}, "host_us": {}, "rounds_us": {"facade/dispatch": [10.0, 12.0]}},
               {"latency_us": {"facade/dispatch": 11.0}, "host_us": {}, "rounds_us": {"facade/dispatch": [11.0, 11.5]}}]
    p = ab.assemble_point({"mode": "normal"}, records, {"dispatch": 1.0}, ("dispatch",), "measured")
    assert p["rounds_us"] == {"facade/dispatch": [11.0, 12.0]}
    assert p["round_spread_pct"]["facade/dispatch"] == pytest.approx(100 / 11)
    assert ab.spread(p, "facade/dispatch") == ", rounds 9.1 % apart"
    with pytest.raises(SystemExit):
        ab.parse_args(["--rounds", "0"])


def test_the_floor_counts_every_rank_on_the_one_gpu() -> None:
    bw = 4e12
    normal = ab.normal_floor_us([100, 300], 1024, bw)
    assert normal["dispatch_bf16"] == pytest.approx(2 * 400 * 2048 / bw * 1e6) == normal["combine"]
    assert normal["dispatch_fp8"] == pytest.approx(2 * 400 * (1024 + 32) / bw * 1e6)
    shape = ab.SHAPES["glm"]
    one = ab.ll_floor_bytes(8, shape.hidden, shape.topk)
    assert ab.ll_floor_us(4, 8, shape, bw) == {op: pytest.approx(4 * one[op] / bw * 1e6) for op in ab.LL_OPS}


def _points() -> list[dict[str, object]]:
    points = []
    for mode, ops, tokens in (("normal", ab.NORMAL_OPS, (512, 1024)), ("low_latency", ab.LL_OPS, (1, 2))):
        for ranks in (2, 4):
            for t in tokens:
                lat = {f"{i}/{op}": float(t * (k + 1)) for k, i in enumerate(ab.IMPLS) for op in ops}
                points.append({
                    "mode": mode, "job": ab.job_name(mode, ranks), "world_size": ranks, "preset": "glm",
                    "tokens_per_rank": t, "latency_us": lat, "host_us": lat,
                    "graph_us": lat if mode == "low_latency" else {}, "speedup": {op: 2.0 for op in ops},
                    "accuracy": {"exact": [], "mismatch": {"recv_x": "x"}} if ranks == 2 else {},
                    "original": "did not start: timed out"})
    return points


def test_the_table_has_a_row_per_point_and_op() -> None:
    lines = ab.table_lines(_points())
    assert len(lines) == 2 + 2 * 2 * 3 + 2 * 2 * 2
    assert "| normal P=2 | glm | 512 | dispatch_bf16 | 512.0 | 1024.0 | 2.00 |" in lines[2]
    assert lines[2].endswith("| recv_x |") and lines[-1].endswith("| no comparison |")


def test_the_png_is_a_shared_gpu_figure_one_panel_per_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plt = pytest.importorskip("matplotlib.pyplot")
    figures: list[object] = []
    monkeypatch.setattr(plt, "close", figures.append)
    ab.plot(_points(), tmp_path / "ab.png", "NVIDIA H200")
    assert (tmp_path / "ab.png").read_bytes()[:4] == b"\x89PNG"
    fig = figures[0]
    assert SHARED_GPU_LABEL in fig._suptitle.get_text() and "not NVLink" in fig._suptitle.get_text()
    axes = fig.get_axes()
    assert [ax.get_title().split(":")[0] for ax in axes] == ["normal", "low_latency"]
    assert len(axes[0].get_lines()) == 4  # facade / original x P = 2, 4
    assert ab.pair_us(_points()[0], "facade") == 512.0 + 512.0


def test_a_rank_sees_torchruns_variables_and_the_original_settings() -> None:
    job = ab.Job("measure", 4, 1234, "r.json", ab.parse_args([]), True, {"NVSHMEM_REMOTE_TRANSPORT": "none"})
    env = job.rank_env(3)
    assert env["LOCAL_RANK"] == env["RANK"] == "3" and env["LOCAL_WORLD_SIZE"] == env["WORLD_SIZE"] == "4"
    assert env["MASTER_PORT"] == "1234" and env["NCCL_NVLS_ENABLE"] == "0"
    assert env["NVSHMEM_REMOTE_TRANSPORT"] == "none"


def stand_in_rank(rank: int, job: ab.Job) -> None:
    """A spawned rank of the timeout test: rank 0 writes its file and leaves, rank 1 hangs (as NVSHMEM did)."""
    if rank == 0:
        ab.JobFile(job.result).update(started=True)
        return
    time.sleep(600)


def test_a_hung_rank_is_killed_at_the_timeout_and_rank_0s_file_is_kept(tmp_path: Path) -> None:
    job = ab.Job("probe", 2, ab.free_port(), str(tmp_path / "job.json"), ab.parse_args([]), True)
    outcome = ab.run_job(job, 30.0, target=stand_in_rank)
    assert outcome.timed_out and outcome.exit_codes[0] == 0 and outcome.exit_codes[1] != 0
    assert outcome.data == {"points": [], "started": True}
    assert outcome.status(30.0) == "timed out after 30 s (ranks killed)" and not outcome.ok


def test_every_allocation_of_the_script_names_device_and_dtype() -> None:
    path = REPO / "bench/deep_ep_ab.py"
    assert violations(path.read_text(), str(path)) == []


def test_device_check_runs_it_at_the_shared_gpu_rank_count() -> None:
    text = (REPO / "scripts/device_check.sh").read_text()
    assert "BENCHES_SHARED=(deep_ep_ab)" in text and '"$name --ranks $shared_gpu${spec:${#name}}"' in text
    # a staged original DeepEP is built there and put on the benchmarks' path
    assert "bash scripts/build_deep_ep.sh --build" in text and 'eval "$(bash scripts/build_deep_ep.sh --env)"' in text
    assert subprocess.run(["bash", "-n", str(REPO / "scripts/device_check.sh")]).returncode == 0


def test_an_eager_window_queues_behind_the_barrier_and_one_untimed_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks' windows start together: after timed_windows' flush and synchronization, the gloo barrier, then one
    untimed call (whose exchange releases every rank's GPU at once) that nothing waits for, then the window."""
    order: list[str] = []
    monkeypatch.setattr(ab.dist, "barrier", lambda: order.append("barrier"))
    monkeypatch.setattr(ab, "timed_windows", lambda window, warmup, windows, before_window, launches: (
        before_window(), window(), ([1.0], 2.0))[-1])
    args = ab.parse_args(["--calls", "3"])
    assert ab.eager_us(lambda: order.append("call"), args) == (1.0, 2.0)
    assert order == ["barrier", "call", "call", "call", "call"]


def test_wait_for_device_retries_until_a_fresh_process_gets_the_gpu(tmp_path: Path) -> None:
    flag = tmp_path / "tries"
    # fails twice (as a CUDA init against an MPS server that is not ready), then succeeds
    code = (f"import pathlib, sys; p = pathlib.Path({str(flag)!r}); n = int(p.read_text()) if p.exists() else 0; "
            "p.write_text(str(n + 1)); sys.exit(0 if n >= 2 else print('Error 807: MPS server is not ready', "
            "file=sys.stderr) or 1)")
    ok, why = ab.wait_for_device(30.0, [sys.executable, "-c", code])
    assert ok and why.startswith("the GPU took a new client after") and flag.read_text() == "3"
    ok, why = ab.wait_for_device(1.5, [sys.executable, "-c", "import sys; sys.exit('device busy or unavailable')"])
    assert not ok and why == "the GPU took no new client within 2 s: device busy or unavailable"


def test_a_killed_probe_waits_for_the_gpu_before_the_measurement(tmp_path: Path, monkeypatch) -> None:
    outcome = ab.Outcome()
    outcome.timed_out, outcome.exit_codes, outcome.data = True, [-9, -9], {}
    monkeypatch.setattr(ab, "run_job", lambda job, timeout: outcome)
    calls = []
    one_try = ab.parse_args(["--probe-timeout", "10", "--ll-original-env", "A=1"])
    env, verdict = ab.probe_original_ll(8, one_try, tmp_path,
                                        ready=lambda: calls.append(1) or (True, "the GPU took a new client after 3 s"))
    assert env is None and calls == [1]
    assert verdict.endswith("timed out after 10 s (ranks killed) (rank 0 in the Buffer, before any step finished); "
                            "then the GPU took a new client after 3 s")


def test_a_killed_probe_says_which_step_rank_0_was_in() -> None:
    assert ab.probe_progress({}) == "(rank 0 in the Buffer, before any step finished)"
    assert ab.probe_progress({"probe_done": 1}) == "(rank 0 in a dispatch, after the Buffer)"
    assert ab.probe_progress({"probe_done": 3}) == ("(rank 0 in the closing barrier, after the Buffer, a dispatch, "
                                                    "a combine)")
    assert ab.probe_progress({"probe_done": 4}) == "(every step done on rank 0)"

