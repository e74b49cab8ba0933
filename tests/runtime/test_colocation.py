"""Several ranks on one GPU, on the host: the rendezvous each placement picks, the host backend and device of each
local rank, the SM share that keeps every rank's spinning kernels resident, and scripts/mps.sh's start/stop (with a
stand-in ``nvidia-cuda-mps-control`` that records what it was asked)."""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch.distributed as dist

from gc_moe_compat.runtime import colocation
from gc_moe_compat.runtime.colocation import Placement, host_backend, local_device, ranks_per_device
from gc_moe_compat.runtime.split import PartitionError, shared_device_sms

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("uuids", "rank", "rendezvous", "on_device", "shares"), [
    (("GPU-a",), 0, "local", 1, False),
    (("GPU-a", "GPU-b"), 1, "torch-symm-mem", 1, False),
    (("GPU-a", "GPU-a"), 1, "cuda-ipc", 2, True),
    (("GPU-a", "GPU-a", "GPU-b", "GPU-b"), 2, "cuda-ipc", 2, True),
    (("GPU-a", "GPU-b", "GPU-b"), 0, "cuda-ipc", 1, True),  # rank 0 alone on its GPU, but its peers share one
])
def test_placement_picks_the_rendezvous(uuids: tuple[str, ...], rank: int, rendezvous: str, on_device: int,
                                        shares: bool) -> None:
    where = Placement(rank=rank, device_uuids=uuids)
    assert (where.rendezvous, where.ranks_on_device, where.shares_device) == (rendezvous, on_device, shares)


def test_placement_gathers_the_ranks_uuids_over_the_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(colocation, "device_uuid", lambda index: f"GPU-{index}")
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 3)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)

    def gather(out: list, obj: object, group: object = None) -> None:
        out[:] = ["GPU-0", obj, "GPU-0"]

    monkeypatch.setattr(dist, "all_gather_object", gather)
    where = colocation.placement(object(), 0)
    assert where == Placement(rank=1, device_uuids=("GPU-0", "GPU-0", "GPU-0")) and where.rendezvous == "cuda-ipc"


def test_placement_over_nccl_with_a_shared_gpu_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(colocation, "device_uuid", lambda index: "GPU-0")
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")

    def refuse(out: list, obj: object, group: object = None) -> None:
        raise dist.DistBackendError("Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 0")

    monkeypatch.setattr(dist, "all_gather_object", refuse)
    with pytest.raises(RuntimeError, match="Duplicate GPU detected.*ranks that share a GPU need a gloo group"):
        colocation.placement(object(), 0)


@pytest.mark.parametrize(("local_world", "gpus", "backend", "devices"), [
    (1, 1, "nccl", [0]),
    (2, 2, "nccl", [0, 1]),
    (8, 8, "nccl", list(range(8))),
    (2, 1, "gloo", [0, 0]),
    (8, 1, "gloo", [0] * 8),
    (4, 2, "gloo", [0, 0, 1, 1]),
    (3, 2, "gloo", [0, 0, 1]),
])
def test_host_backend_falls_back_to_gloo_when_ranks_share_a_gpu(local_world: int, gpus: int, backend: str,
                                                               devices: list[int]) -> None:
    picked, reason = host_backend(local_world, gpus)
    assert picked == backend
    assert (reason is None) == (backend == "nccl")
    if reason is not None:
        assert f"{local_world} ranks share {gpus} GPU(s)" in reason and "NCCL refuses" in reason
    assert [local_device(r, local_world, gpus) for r in range(local_world)] == devices


def test_ranks_per_device_refuses_empty_counts() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        ranks_per_device(2, 0)


@pytest.mark.parametrize(("ranks", "share"), [(1, 132), (2, 66), (3, 44), (4, 32), (8, 16), (16, 8)])
def test_shared_device_sms_keeps_every_ranks_kernels_resident(ranks: int, share: int) -> None:
    assert shared_device_sms(132, ranks, 4) == share
    assert share % 2 == 0 and ranks * share <= 132  # one CTA per SM of every rank at once still fits


def test_shared_device_sms_refuses_a_share_below_role1s_grid() -> None:
    with pytest.raises(PartitionError, match="leave 6 SMs per rank, fewer than role1's 8 CTAs"):
        shared_device_sms(132, 20, 8)
    with pytest.raises(PartitionError, match="must be >= 1"):
        shared_device_sms(132, 0, 4)


def _fake_control(tmp_path: Path) -> Path:
    """A stand-in nvidia-cuda-mps-control: appends its arguments, stdin and pipe directory to calls.log."""
    fake = tmp_path / "fake-mps-control"
    fake.write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        if [[ "${{1:-}}" == -d ]]; then
          echo "start $CUDA_MPS_PIPE_DIRECTORY" >> {tmp_path}/calls.log; exit "${{FAIL:-0}}"
        fi
        echo "stdin $(cat)" >> {tmp_path}/calls.log
        """))
    fake.chmod(0o755)
    return fake


def _run(tmp_path: Path, body: str, **env: str) -> subprocess.CompletedProcess[str]:
    script = f"source {ROOT / 'scripts' / 'mps.sh'}\n{body}"
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "MPS_CONTROL": str(_fake_control(tmp_path)), "TMPDIR": str(tmp_path),
                               **env})


def test_mps_start_and_stop_on_exit(tmp_path: Path) -> None:
    out = _run(tmp_path, 'mps_start && echo "dir $MPS_DIR" && test -d "$CUDA_MPS_LOG_DIRECTORY"')
    assert out.returncode == 0, out.stderr
    assert "mps: started" in out.stdout and "mps: stopped" in out.stdout  # the EXIT trap stopped it
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert calls[0].startswith("start ") and calls[0].endswith("/pipe") and calls[1] == "stdin quit"
    mps_dir = next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("dir "))
    assert not Path(mps_dir).exists()  # removed by the stop


def test_mps_stop_is_safe_twice_and_without_a_start(tmp_path: Path) -> None:
    out = _run(tmp_path, "mps_stop; mps_start; mps_stop; mps_stop")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "calls.log").read_text().splitlines()[1:] == ["stdin quit"]  # one quit, for the one start
    assert out.stdout.count("mps: stopped") == 1


def test_mps_start_failure_is_reported_and_cleaned_up(tmp_path: Path) -> None:
    out = _run(tmp_path, "mps_start || echo failed=$?", FAIL="1")
    assert "failed=1" in out.stdout and "the control daemon did not start" in out.stderr
    assert not list(tmp_path.glob("gc_moe_mps.*"))


def test_mps_start_without_the_control_binary(tmp_path: Path) -> None:
    out = _run(tmp_path, "mps_start || echo failed=$?", MPS_CONTROL="no-such-mps-control")
    assert "failed=1" in out.stdout and "is not on PATH" in out.stderr


def test_operator_buffer_repr_says_where_it_runs(group: dist.ProcessGroup) -> None:
    from gc_moe_compat.operator import api

    buf = api.get_symm_buffer_for_gc_moe(group, 8, 64, 2, 512, 256, "fp8xfp8", partition="off", compute_sms=112)
    assert repr(buf) == ("GcMoeBuffer(ranks=1, experts=8, hidden=512, intermediate=256, topk=2, mma_type='fp8xfp8', "
                         "partition='off', dispatch_sms=4, compute_sms=112)")
    assert buf.describe()["partition_reason"] is None
    buf.destroy()
    assert repr(buf) == "GcMoeBuffer(destroyed)"


def test_the_buffer_reads_one_partition_plan(group: dist.ProcessGroup) -> None:
    """The buffer's partition, role1 grid, reason and ranks on the GPU are fields of its one plan, which every launch
    reads (launch_partition: no green partition with the partition off)."""
    from gc_moe_compat.operator import api
    from gc_moe_compat.runtime.green import launch_partition
    from gc_moe_compat.runtime.split import PartitionPlan

    buf = api.get_symm_buffer_for_gc_moe(group, 8, 64, 2, 512, 256, "fp8xfp8", partition="off", dispatch_sms=6,
                                         compute_sms=112)
    assert buf.plan == PartitionPlan("off", 6, 6, 112)
    assert (buf.partition, buf.dispatch_sms, buf.partition_reason, buf.ranks_on_device) == ("off", 6, None, 1)
    assert buf.describe()["requested_dispatch_sms"] == 6 and buf.describe()["ring_compute_sms"] == 112
    assert launch_partition(buf.plan, 0) is None
    assert buf.retyped("fp8xfp4").plan is buf.plan  # an alias shares the plan with its workspace
    buf.destroy()
