"""The symmetric workspace's collective allocation on the host: two processes in a gloo group agree on what each
allocated before either maps a peer (:func:`~gc_moe_compat.runtime.workspace.agree`), so a rank that
could not allocate makes both raise ``WorkspaceAllocationError`` naming it, instead of leaving its peer in the
exchange; where both allocated, each gets every rank's shared value; a group of one exchanges nothing. What a
failed allocation becomes (its text), and torch symmetric memory's one retry after torch's cache is emptied. The
GPU paths that call them (CUDA IPC between ranks on one GPU, torch symmetric memory) are the runtime's two-rank GPU
tests'."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gc_moe_compat.runtime.workspace import WorkspaceAllocationError, _symmetric_empty, _try, agree


def _rank(rank: int, port: int, failing: tuple[int, ...], out: str) -> None:
    """Rank ``rank`` of two: its allocation failed where it is in ``failing``; writes what the agreement returned
    or raised to ``out``."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        failure = "OutOfMemoryError: CUDA out of memory" if rank in failing else None
        try:
            result = repr(agree(dist.group.WORLD, "allocate and share 4096 bytes", ("handle", rank), failure))
        except WorkspaceAllocationError as exc:
            result = f"raised: {exc}"
        Path(out, f"rank{rank}").write_text(result)
    finally:
        dist.destroy_process_group()


def _agree(tmp_path: Path, failing: tuple[int, ...]) -> list[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(port, failing, str(tmp_path)), nprocs=2, start_method="spawn", join=True)
    return [(tmp_path / f"rank{r}").read_text() for r in range(2)]


@pytest.mark.parametrize(("failing", "named"), [((1,), "1 of 2 rank(s) could not allocate and share 4096 bytes "
                                                       "(rank 1: OutOfMemoryError: CUDA out of memory)"),
                                                ((0, 1), "2 of 2 rank(s) could not allocate and share 4096 bytes "
                                                         "(rank 0: OutOfMemoryError: CUDA out of memory; rank 1: "
                                                         "OutOfMemoryError: CUDA out of memory)")],
                         ids=["one-rank", "both-ranks"])
def test_a_rank_that_could_not_allocate_makes_every_rank_raise(tmp_path: Path, failing: tuple[int, ...],
                                                               named: str) -> None:
    assert _agree(tmp_path, failing) == [f"raised: symmetric workspace: {named}"] * 2


def test_every_rank_gets_every_ranks_value_where_all_allocated(tmp_path: Path) -> None:
    assert _agree(tmp_path, ()) == [repr([("handle", 0), ("handle", 1)])] * 2


def test_one_rank_exchanges_nothing_and_raises_its_own_failure(group: dist.ProcessGroup) -> None:
    assert agree(group, "allocate and share 64 bytes", "mine", None) == ["mine"]
    assert agree(None, "allocate and share 64 bytes", "mine", None) == ["mine"]
    with pytest.raises(WorkspaceAllocationError, match=r"^symmetric workspace: 1 of 1 rank\(s\) could not allocate "
                                                        r"and share 64 bytes \(rank 0: OutOfMemoryError: no room\)$"):
        agree(None, "allocate and share 64 bytes", "mine", "OutOfMemoryError: no room")


def test_an_allocation_failure_becomes_the_text_the_ranks_agree_on() -> None:
    """Any RuntimeError of an allocation (torch's OutOfMemoryError, a driver error) is this rank's failure, its first
    line what the agreement names; an allocation that succeeds is returned as it is."""
    t = torch.zeros(3)
    assert _try(lambda: t) == (t, None)

    def out_of_memory() -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")

    assert _try(out_of_memory) == (None, "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")


def test_symmetric_memory_is_retried_once_after_torchs_cache_is_emptied(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch symmetric memory maps memory of its own, which the blocks torch's caching allocator keeps are not free
    to: a first failure returns them to the driver and tries once more; a second failure is raised."""
    from torch.distributed import _symmetric_memory as symm_mem

    events: list[str] = []
    outcomes = iter([RuntimeError("CUDA driver error: out of memory"), torch.zeros(8, dtype=torch.uint8)])

    def empty(nbytes: int, dtype: torch.dtype, device: object) -> torch.Tensor:
        events.append(f"empty {nbytes}")
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(symm_mem, "empty", empty)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    assert _symmetric_empty(8, torch.device("cpu")).numel() == 8
    assert events == ["empty 8", "empty_cache", "empty 8"]
    outcomes = iter([RuntimeError("first"), RuntimeError("second")])
    with pytest.raises(RuntimeError, match="second"):
        _symmetric_empty(8, torch.device("cpu"))
