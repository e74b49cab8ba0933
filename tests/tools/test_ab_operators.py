"""gc-moe-ab's adapters and inputs on the CPU (one gloo rank, the facade's workspace in host memory): SGLang's Hopper
sequence stages exactly the bytes the native operators are handed (so every operator reads identical inputs), it
reaches the launch (which needs the GPU), the references and floors of a point, and the prebuild's job list."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gc_moe_compat.ab import inputs, model_config, operators, prebuild, protocol, run
from gc_moe_compat.runtime.single_rank import single_rank_group


@pytest.fixture(scope="module")
def group() -> Iterator[dist.ProcessGroup]:
    """A gloo group of one for this module (destroyed after it, so other tests can create their own)."""
    with single_rank_group() as group:
        yield group


WORKLOAD = model_config.explicit(512, 256, 8, 2, ep_size=2, routed_scaling_factor=2.5, activation_clamp=10.0,
                                 capacity=64)


def test_the_facade_sequence_stages_the_bytes_every_operator_reads(group: dist.ProcessGroup) -> None:
    weights = inputs.make_weights(WORKLOAD.local_experts, 512, 256, 0, ("fp8_block128",), "cpu")
    ctx = operators.Context(group, WORKLOAD, 1, 0, weights, torch.device("cpu"))
    seq = operators.MegaMoeSequence(operators._facade(), ctx)
    tokens = inputs.make_tokens(3, 4, 2, 512, 0, 1, 2.5, "cpu")
    seq.stage(tokens)
    with pytest.raises(RuntimeError, match="running the layer needs the GPU"):
        seq.run()  # the pre-dispatch ran (torch model on the host); fp8_mega_moe passed validation
    staged, buf = tokens.staged, seq.buf
    assert torch.equal(buf.x[:3].view(torch.uint8), staged.x.view(torch.uint8))
    assert torch.equal(buf.x_sf[:3], staged.x_sf) and torch.equal(buf.topk_idx[:3], staged.topk_idx)
    assert torch.equal(buf.topk_weights[:3], tokens.topk_weights * 2.5)
    assert bool((buf.topk_idx[3:] == -1).all()) and bool((buf.topk_weights[3:] == 0).all())
    # SGLang's load-time transform interleaves the L1 rows by 8; the scales and L2 stay
    l1, l2 = weights["fp8_block128"]
    assert torch.equal(seq.l1[1], l1.scales) and seq.l2[0] is l2.payload
    assert torch.equal(seq.l1[0][:, 8:16].view(torch.uint8), l1.payload[:, 256:264].view(torch.uint8))
    seq.close()


def test_tokens_and_weights_are_seeded_per_rank_and_point() -> None:
    a = inputs.make_tokens(5, 8, 2, 512, 1, 2, 1.0, "cpu")
    b = inputs.make_tokens(5, 8, 2, 512, 1, 2, 1.0, "cpu")
    c = inputs.make_tokens(5, 8, 2, 512, 0, 2, 1.0, "cpu")
    assert torch.equal(a.x, b.x) and torch.equal(a.topk_idx, b.topk_idx) and not torch.equal(a.x, c.x)
    assert a.topk_idx.dtype == torch.int32 and a.x.dtype == torch.bfloat16
    assert all(len(set(row.tolist())) == 2 for row in a.topk_idx)  # top-k without repetition
    w = inputs.make_weights(2, 256, 128, 0, ("fp8_block128", "mxfp4"), "cpu")
    assert sorted(w.formats) == ["bf16", "fp8_block128", "mxfp4"] and w["mxfp4"][0].payload.shape == (2, 256, 128)
    with pytest.raises(KeyError, match="format 'fp8_k32' was not built"):
        w["fp8_k32"]
    with pytest.raises(ValueError, match="formats: must be drawn from"):
        inputs.make_weights(1, 256, 128, 0, ("nvfp4",), "cpu")


def test_references_and_floor_of_a_point() -> None:
    weights = [inputs.make_weights(2, 512, 256, r, ("fp8_block128", "mxfp4"), "cpu") for r in range(2)]
    tokens = [inputs.make_tokens(4, 4, 2, 512, r, 2, 2.5, "cpu") for r in range(2)]
    refs = run._references(tokens, weights, {"fp8_block128", "mxfp4"}, 10.0, 1)
    fp8, fp4 = refs["fp8_block128"], refs["mxfp4"]
    assert fp8["faithful"].shape == (4, 512) and fp8["bf16_model"] is fp4["bf16_model"]
    from gc_moe_compat.references.reference import accuracy_metrics

    assert accuracy_metrics(fp8["faithful"].float(), fp8["bf16_model"].float())["cosine"] > 0.99
    assert accuracy_metrics(fp4["faithful"].float(), fp4["bf16_model"].float())["cosine"] > 0.95
    floor = run._floor_bytes(tokens, WORKLOAD, 4, 1)
    from gc_moe_compat.references.reference import dispatch_plan

    plan = dispatch_plan([t.topk_idx.long() for t in tokens], 4)[1]
    active, rows = sum(1 for r in plan if len(r)), sum(len(r) for r in plan)
    assert floor["fp8xfp8"] == protocol.expert_floor_bytes(512, 256, active, rows, "fp8xfp8")
    assert floor["fp8xfp4"] < floor["fp8xfp8"]


def test_prebuild_lists_every_variant_the_points_can_pick() -> None:
    jobs = prebuild.kernel_jobs(["fp8xfp8", "fp8xfp4"], [1, 8, 256], 1, 8, 32)
    sources = [s for s, _ in jobs]
    assert sources[:3] == ["sm90/role1_dispatch.cu", "sm90/role3_finalize.cu", "sm90/predispatch.cu"]
    assert {"sm90/role2_gemm_fp8xfp8.cu", "sm90/role2_gemm_fp8xfp4.cu"} <= set(sources)
    assert len({(s, tuple(sorted(d.items()))) for s, d in jobs}) == len(jobs)


def test_prebuild_adds_the_low_latency_kernels_for_the_composed_baseline() -> None:
    from gc_moe_compat.comm import ep_ll

    plain = prebuild.kernel_jobs(["fp8xfp8"], [1, 8], 1, 8, 32)
    with_ll = prebuild.kernel_jobs(["fp8xfp8"], [1, 8], 1, 8, 32, low_latency=True)
    assert (ep_ll.SOURCE, {}) in with_ll and (ep_ll.SOURCE, {}) not in plain
    assert [j for j in with_ll if j != (ep_ll.SOURCE, {})] == plain


def test_the_originals_prebuild_runs_one_child_per_point_and_reports_its_failure() -> None:
    """A child replays the run's own arguments with the point's --tokens last; here (no GPU) each child fails at
    its process group and the line says so instead of raising."""
    import sys

    argv = ["--preset", "glm52", "--tokens", "1", "8", "--quick"]
    assert prebuild.child_command(argv, 8) == [sys.executable, "-m", "gc_moe_compat.ab.prebuild_child", *argv,
                                               "--tokens", "8"]
    lines = prebuild.prebuild_originals(argv, [1, 8], workers=2, timeout=120)
    assert [line.split(":")[0] for line in lines] == ["originals T=1", "originals T=8"]
    assert all("rc=" in line for line in lines), lines


def test_a_child_that_lost_its_port_to_a_sibling_is_rerun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first attempt fails as a port race does (EADDRINUSE), the rerun succeeds; any other failure is final."""
    import sys

    marker = tmp_path / "tried"
    code = ("import pathlib, sys; m = pathlib.Path(sys.argv[1]); first = not m.exists(); m.touch(); "
            "print('DistNetworkError: EADDRINUSE, address already in use' if first else 'ok'); sys.exit(int(first))")
    monkeypatch.setattr(prebuild, "child_command", lambda argv, t: [sys.executable, "-c", code, str(marker)])
    assert prebuild.prebuild_originals([], [1], workers=1)[0].startswith("originals T=1: ok")
    fail = "import sys; print('RuntimeError: something else'); sys.exit(3)"
    monkeypatch.setattr(prebuild, "child_command", lambda argv, t: [sys.executable, "-c", fail])
    assert "rc=3: RuntimeError: something else" in prebuild.prebuild_originals([], [2], workers=1)[0]


def test_the_prebuild_child_refuses_a_workload_outside_the_constraints_before_any_allocation(
        capsys: pytest.CaptureFixture[str]) -> None:
    from gc_moe_compat.ab import prebuild_child

    assert prebuild_child.main(["--preset", "glm52", "--tokens", "999"]) == 2
    assert "--tokens: every T must lie in [1, --capacity=256], got [999]" in capsys.readouterr().err
