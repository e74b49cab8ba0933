"""gc-moe-ab's command line on a CPU machine: ``--check`` (what would run, what is missing; exit 2 where a constraint
blocks a requested point), constraint failures before anything is allocated (exit 2), ``--help``, where results go,
the workload sources, the operators' labels and probes."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from gc_moe_compat.ab import cli, operators, run
from gc_moe_compat.config import MoEShape
from tests.tools.test_ab_model_config import DEEPSEEK_V3, MIXTRAL_8X7B

REPO = Path(__file__).resolve().parents[2]


def test_check_on_a_cpu_machine_says_what_would_run_and_what_is_missing_and_exits_0() -> None:
    """No GPU is no constraint: the shape is runnable, so --check exits 0 and says why each operator cannot run."""
    proc = subprocess.run([sys.executable, "-m", "gc_moe_compat.ab", "--check", "--preset", "glm52", "--tokens", "1",
                           "8"], capture_output=True, text=True, cwd=REPO, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "workload: glm52: H=6144 I=2048 E=256 top-8" in out and "-> 32 experts per rank" in out
    assert "constraints: the shape is inside the operator's envelope" in out
    for spec in operators.operator_specs():
        assert f"cannot run: {spec.name} - {spec.label}" in out  # no GPU here: every operator says why
    assert out.count("why: needs a CUDA GPU (none visible)") == len(operators.operator_specs())
    assert "original deep_gemm" in out and "scripts/build_sgl_deep_gemm.sh" in out  # what would install it
    assert "package rich:" in out and "package matplotlib:" in out
    assert "ranks: 1 on 1 GPU(s): peers mapped by local, host collectives nccl" in out
    assert "deep_gemm.set_num_sms is kept for get_num_sms and does not shape it" in out
    # glm52's share at one rank: 32 experts, top-8, so T * 8 / 32 < 32 up to T = 127
    assert "partition per call: off for T <= 127 (fewer than 32 expected rows per expert), on above" in out


@pytest.mark.parametrize(("world", "gpus", "env", "want"), [
    (1, 1, None, "off for T <= 255 (fewer than 32 expected rows per expert), on above (GC_MOE_PARTITION=auto)"),
    (1, 1, "on", "on at every T (GC_MOE_PARTITION=on)"),
    (2, 2, None, "on at every T (2 ranks: the rule that runs small calls in sequence is measured on one rank"),
    (2, 1, None, "off at every T (ranks share a GPU)"),
])
def test_check_says_which_calls_run_with_the_partition_off(monkeypatch: pytest.MonkeyPatch, world: int, gpus: int,
                                                           env: str | None, want: str) -> None:
    from gc_moe_compat.ab.cli import partition_rule_line, workload_from_args

    if env is None:
        monkeypatch.delenv("GC_MOE_PARTITION", raising=False)
    else:
        monkeypatch.setenv("GC_MOE_PARTITION", env)
    args, _, _ = cli.parse(["--preset", "dsv41-flash"])
    line = partition_rule_line(workload_from_args(args), world, gpus)
    assert line.startswith(f"partition per call: {want}"), line


@pytest.mark.parametrize(("world", "gpus", "want"), [
    (2, 2, "ranks: 2 on 2 GPU(s): peers mapped by torch-symm-mem, host collectives nccl"),
    (4, 0, "ranks: 4 on 1 GPU(s): peers mapped by cuda-ipc, host collectives gloo (4 ranks share 1 GPU(s)"),
])
def test_check_says_how_the_ranks_are_placed(world: int, gpus: int, want: str) -> None:
    from gc_moe_compat.ab.cli import placement_lines

    lines = placement_lines(world, gpus)
    assert lines[0].startswith(want), lines
    shared = [line for line in lines if line.startswith("  shared GPU:")]
    assert len(shared) == (gpus < world), lines
    if shared:
        assert "CUDA MPS off (start CUDA MPS first" in shared[0] and "not NVLink ones" in shared[0]


def test_check_reports_a_failing_constraint_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(MIXTRAL_8X7B))
    assert cli.main(["--check", "--model-config", str(path), "--ep-size", "2"]) == 2
    out = capsys.readouterr().out
    assert "constraint: mixtral at 1 rank(s), fp8xfp8: intermediate: must be in [1, 4096]" in out
    assert "cannot run: facade" in out  # the rest of the report is still printed
    assert cli.main(["--check", "--preset", "glm52", "--tokens", "1", "300"]) == 2  # one T beyond the capacity
    assert "--tokens: every T must lie in [1, --capacity=256], got [300]" in capsys.readouterr().out
    assert cli.main(["--check", "--preset", "glm52", "--tokens", "1", "256"]) == 0


def test_help_lists_the_subcommand_the_operators_and_the_defaults() -> None:
    text = cli.build_parser().format_help()
    assert "gc-moe-ab matrix" in text and "gc-moe-matrix" in text
    for spec in operators.operator_specs():
        assert f"  {spec.name}: " in text
    assert "facade_dispatch_sms_N (N = 4, 8, 16, 24" in text
    for default in ("(default 8)", "(default 256)", "(default 1 2 4 8 16 32 64 128 256)", "(default 10)",
                    "(default 30)", "their spread (default 2)", "ab_<workload>.json in the working directory",
                    "every visible one"):
        assert default in " ".join(text.split()), default


def test_results_go_to_the_working_directory_unless_out_names_a_file(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[run.RunConfig] = []
    monkeypatch.setattr(run, "main_ranks", lambda cfg: seen.append(cfg) or 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cli, "kernel_sources", lambda: "/kernels")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["--preset", "glm52", "--tokens", "1"]) == 0
    assert cli.main(["--model-config", str(REPO / "tests/data/deepseek_v3/config.json"), "--tokens", "1"]) == 0
    assert cli.main(["--preset", "glm52", "--tokens", "1", "--out", "bench/results/ab_glm52.json"]) == 0
    assert [c.out for c in seen] == [tmp_path / "ab_glm52.json", tmp_path / "ab_DeepSeek-V3.json",
                                     Path("bench/results/ab_glm52.json")]
    assert [c.repeats for c in seen] == [2, 2, 2]  # the default: two timing rounds per point
    assert cli.main(["--preset", "glm52", "--tokens", "1", "--repeats", "5"]) == 0 and seen[-1].repeats == 5


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_repeats_below_one_is_refused_naming_the_option(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--check", "--preset", "glm52", "--repeats", value])
    assert exit_.value.code == 2
    assert (f"argument --repeats: must be a whole number >= 1 (timing rounds per point), got '{value}'"
            in capsys.readouterr().err)


def test_the_matrix_writes_to_the_working_directory_by_default(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from gc_moe_compat.ab import matrix

    committed = (REPO / "bench/results/compat_matrix.json").read_bytes()
    monkeypatch.setattr(matrix, "cpu_cells", lambda kinds: [])  # no cells: only where the files go
    monkeypatch.chdir(tmp_path)
    assert cli.main(["matrix", "--cpu-only"]) == 0
    assert json.loads((tmp_path / "compat_matrix.json").read_text())["cells"] == []
    assert (tmp_path / "compat_matrix.md").is_file()
    assert (REPO / "bench/results/compat_matrix.json").read_bytes() == committed


def test_a_failing_constraint_stops_the_run_before_anything_is_allocated(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the run started although a constraint failed")

    monkeypatch.setattr(run, "run", never)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(MIXTRAL_8X7B))
    assert cli.main(["--model-config", str(path), "--ep-size", "2"]) == 2
    assert "gc-moe-ab: constraint: mixtral at 1 rank(s), fp8xfp8: intermediate" in capsys.readouterr().err
    assert cli.main(["--hidden", "7168", "--intermediate", "2048", "--experts", "256", "--topk", "40"]) == 2
    assert "topk: must be in [1, 32]" in capsys.readouterr().err
    assert cli.main(["--preset", "glm52", "--tokens", "0", "300"]) == 2
    assert "--tokens: every T must lie in [1, --capacity=256], got [0, 300]" in capsys.readouterr().err


def test_the_workload_comes_from_exactly_one_source(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--check"]) == 2
    assert "give exactly one of --preset, --model-config" in capsys.readouterr().err
    assert cli.main(["--check", "--preset", "glm52", "--hidden", "512"]) == 2
    assert cli.main(["--check", "--hidden", "512", "--topk", "2"]) == 2
    assert "explicit sizes need ['--intermediate', '--experts'] too" in capsys.readouterr().err
    assert cli.main(["--check", "--preset", "glm52", "--ops", "facade", "nonsense"]) == 2
    assert "--ops: unknown operator(s) ['nonsense']" in capsys.readouterr().err


def test_model_config_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(DEEPSEEK_V3))
    _, w, problems = cli.parse(["--model-config", str(path), "--ep-size", "8", "--activation-clamp", "7.5"])
    assert problems == [] and w.local_experts == 32 and w.activation_clamp == 7.5
    assert w.fields["activation_clamp"] == "argument" and w.routed_scaling_factor == 2.5
    _, explicit, _ = cli.parse(["--hidden", "7168", "--intermediate", "2048", "--experts", "256", "--topk", "8",
                                "--routed-scaling-factor", "2.5"])
    assert explicit.shape(1) == MoEShape(32, 1, 7168, 2048, 8, 0, 256, "fp8xfp8") == w.shape(1)
    assert explicit.routed_scaling_factor == 2.5


def test_every_operator_is_labelled_and_the_sweep_adds_the_dispatch_requests() -> None:
    specs = operators.operator_specs(partition_sweep=True)
    names = [s.name for s in specs]
    assert names[0] == operators.REFERENCE_OP == "facade"
    assert {"facade_partition_off", "native_fp8xfp4", "original_deep_gemm", "composed_deepep_deepgemm",
            "facade_partition_on"} <= set(names)
    assert "facade_partition_on" not in operators.default_ops()  # the sweep's, like the dispatch requests'
    assert [s.name for s in operators.select(["facade_partition_on"], False)] == ["facade_partition_on"]
    assert [n for n in names if n.startswith("facade_dispatch_sms_")] == [
        f"facade_dispatch_sms_{n}" for n in operators.DISPATCH_SWEEP] == [
        "facade_dispatch_sms_4", "facade_dispatch_sms_8", "facade_dispatch_sms_16", "facade_dispatch_sms_24"]
    assert all(len(s.label) > 40 for s in specs)
    assert {s.name: s.mma_type for s in specs}["native_fp8xfp4"] == "fp8xfp4"
    assert [s.name for s in operators.select(["native_fp8xfp4", "facade"], False)] == ["facade", "native_fp8xfp4"]


def test_the_composed_baseline_without_an_original_deep_gemm_says_what_would_install_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def missing() -> None:
        raise ImportError("no original deep_gemm package is installed on sys.path")

    monkeypatch.setattr(operators, "_original_deep_gemm", missing)
    reason = {s.name: s for s in operators.operator_specs()}["composed_deepep_deepgemm"].probe()
    assert "masked FP8 grouped GEMM" in reason and "no original deep_gemm package is installed" in reason
    assert "build_sgl_deep_gemm.sh" in reason and "deepinfer-gemm==2.8.2" in reason


def test_the_original_probe_names_what_would_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing() -> None:
        raise ImportError("no original deep_gemm package is installed on sys.path")

    monkeypatch.setattr(operators, "_original_deep_gemm", missing)
    reason = {s.name: s for s in operators.operator_specs()}["original_deep_gemm"].probe()
    assert "no original deep_gemm package is installed" in reason and "build_sgl_deep_gemm.sh" in reason

    class Sm100Only:
        __file__ = "/x/deep_gemm/__init__.py"
        get_symm_buffer_for_mega_moe = fp8_fp4_mega_moe = object()

    monkeypatch.setattr(operators, "_original_deep_gemm", lambda: Sm100Only)
    reason = {s.name: s for s in operators.operator_specs()}["original_deep_gemm"].probe()
    assert "has no SM90 Mega MoE (transform_weights_for_mega_moe_sm90, fp8_mega_moe missing" in reason


def test_the_original_that_runs_is_named_with_the_ref_it_was_staged_from(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    """Two builds of the original share one label: a result file tells them apart by the op's source, the staging's
    SOURCE line (scripts/build_sgl_deep_gemm.sh writes it beside the package), else the package path alone."""
    package = tmp_path / "sgl_deep_gemm_pr323" / "deep_gemm"
    package.mkdir(parents=True)
    staged = types.SimpleNamespace(__file__=str(package / "__init__.py"))
    monkeypatch.setattr(operators, "_original_deep_gemm", lambda: staged)
    specs = {s.name: s for s in operators.operator_specs()}
    where = specs["original_deep_gemm"].source_fn()
    assert where == "<outside the checkout>/deep_gemm/__init__.py"  # as every result file writes a path
    (package.parent / "SOURCE").write_text("refs/pull/323/head = 8ddf7f9 from mirror; cutlass x; fmt y\n")
    for name in ("original_deep_gemm", "composed_deepep_deepgemm"):
        assert specs[name].source_fn() == f"{where} (refs/pull/323/head = 8ddf7f9 from mirror)"
    assert specs["facade"].source_fn() is None
    args, workload, _ = cli.parse(["--check", "--preset", "glm52", "--ops", "facade", "original_deep_gemm"])
    plan = "\n".join(cli.plan_lines(args, workload, []))
    assert f"original_deep_gemm - {specs['original_deep_gemm'].label}\n      build: {where} (refs/pull/323" in plan

    def missing() -> None:
        raise ImportError("no original deep_gemm package is installed on sys.path")

    monkeypatch.setattr(operators, "_original_deep_gemm", missing)
    assert specs["original_deep_gemm"].source_fn() is None
    monkeypatch.setattr(operators, "_original_deep_gemm", lambda: staged)
    meta = run.ops_meta([specs["facade"], specs["original_deep_gemm"], specs["composed_deepep_deepgemm"]],
                        {"composed_deepep_deepgemm": "needs the masked GEMM"})
    assert "source" not in meta["facade"] and meta["facade"]["status"] == "measured"
    assert meta["original_deep_gemm"]["source"] == f"{where} (refs/pull/323/head = 8ddf7f9 from mirror)"
    assert meta["composed_deepep_deepgemm"] == {"label": specs["composed_deepep_deepgemm"].label,
                                                "mma_type": "fp8xfp8", "weight_format": "fp8_block128",
                                                "status": "not run: needs the masked GEMM"}
    # a path in the SOURCE line (the clone it was staged from) is written as every result file writes one
    (package.parent / "SOURCE").write_text("refs/pull/36/head = 3f9268b from /srv/mirrors/DeepGEMM/repo; cutlass x\n")
    assert specs["original_deep_gemm"].source_fn() == (f"{where} (refs/pull/36/head = 3f9268b from "
                                                       "<outside the checkout>/DeepGEMM/repo)")


def test_console_scripts_are_declared() -> None:
    text = (REPO / "pyproject.toml").read_text()
    assert 'gc-moe-ab = "gc_moe_compat.ab.cli:main"' in text


def test_a_python_without_the_installed_kernels_stops_before_the_run(monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Seen on the H200: ``pip`` of another interpreter installed the package, ``python -m gc_moe_compat.ab`` then
    imported it from the checkout without the editable ``kernels/`` mapping; every operator failed at its first
    launch. The tool now says so up front (and ``--check`` names where the sources are)."""
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the run started without the kernel sources")

    monkeypatch.setattr(run, "run", never)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cli, "kernel_sources", lambda: None)
    assert cli.main(["--preset", "glm52", "--tokens", "1"]) == 2
    assert "gc_moe_compat.kernels is not importable" in capsys.readouterr().err
    monkeypatch.undo()
    assert cli.kernel_sources() == str(REPO / "kernels")  # this checkout's editable install


def test_several_gpus_start_one_process_per_gpu_under_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, object] = {}

    def call(cmd: list[str], env: dict[str, str]) -> int:
        seen.update(cmd=cmd, env=env)
        return 0

    monkeypatch.setattr(cli.subprocess, "call", call)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cli, "kernel_sources", lambda: "/kernels")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert cli.main(["--preset", "glm52", "--tokens", "1", "8", "--quick"]) == 0
    assert seen["cmd"][1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                               "gc_moe_compat.ab", "--preset", "glm52", "--tokens", "1", "8", "--quick"]
    assert seen["env"]["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1" and seen["env"]["NCCL_NVLS_ENABLE"] == "0"
    _, w, problems = cli.parse(["--preset", "glm52", "--world-size", "2"])
    assert problems == [] and w.shape(2).num_experts == 64  # the per-rank share on two GPUs


def test_more_ranks_than_gpus_needs_shared_gpu(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """--world-size beyond the visible GPUs is refused naming --shared-gpu; with it the ranks are launched."""
    launched: list = []
    monkeypatch.setattr(cli, "_visible_gpus", lambda: 1)
    monkeypatch.setattr(cli, "kernel_sources", lambda: "kernels/")
    monkeypatch.setattr(cli, "_launch_ranks", lambda world, argv: launched.append((world, argv)) or 0)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    argv = ["--preset", "glm52", "--world-size", "4", "--tokens", "1"]
    assert cli.main(argv) == 2 and launched == []
    assert "--world-size 4 exceeds the 1 visible GPU(s); --shared-gpu runs several ranks" in capsys.readouterr().err
    assert cli.main([*argv, "--shared-gpu"]) == 0 and launched == [(4, [*argv, "--shared-gpu"])]


def test_gpu_setup_labels_ranks_sharing_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from gc_moe_compat.ab import protocol

    monkeypatch.setattr(protocol.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(protocol.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(protocol, "_gpu_name", lambda: "NVIDIA H200")
    assert protocol.gpu_setup(1) == "1 x NVIDIA H200"
    assert protocol.gpu_setup(4) == "4 ranks on 1 NVIDIA H200: ranks on one GPU under CUDA MPS: no NVLink"
