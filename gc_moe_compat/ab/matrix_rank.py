"""One rank of the compatibility matrix's world-size-2 layer cells: ``python -m gc_moe_compat.ab.matrix_rank
--result PATH``, started once per rank by :func:`gc_moe_compat.ab.matrix_gpu.two_rank_cells` with torchrun's
environment variables set (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``).

The rank joins the group on its GPU (:func:`gc_moe_compat.runtime.colocation.init_rank_group`: NCCL with a GPU per
rank, gloo where the ranks share one), records where it runs (:func:`~gc_moe_compat.runtime.colocation.describe`),
refuses to go on where its GPU is shared without CUDA MPS (the ranks would hang spinning for each other), then runs
the one-rank cells' own code (:func:`gc_moe_compat.ab.matrix_gpu.layer_outcomes`) and rewrites ``PATH`` after every
cell, so that a rank stopped at the matrix's deadline still reports the cells it finished. The matrix merges the
ranks' reports (:func:`gc_moe_compat.ab.matrix_gpu.merge_ranks`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

__all__ = ["main"]

NO_MPS_EXIT = 3
"""The exit status of a rank whose GPU is shared by the group's ranks but not served by CUDA MPS."""


def _write(path: Path, record: dict[str, object]) -> None:
    """``record`` as JSON at ``path``, replaced whole (the matrix may read it after stopping this rank)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def main(argv: Sequence[str] | None = None) -> int:
    """Run this rank's layer cells (module docstring); exits the process (no teardown) when done."""
    parser = argparse.ArgumentParser(prog="python -m gc_moe_compat.ab.matrix_rank", description=__doc__.split("\n")[0])
    parser.add_argument("--result", type=Path, required=True, help="where this rank writes its report (JSON)")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))

    import torch
    import torch.distributed as dist

    from gc_moe_compat.ab import matrix_gpu
    from gc_moe_compat.runtime import colocation

    device = colocation.init_rank_group()
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    where = colocation.placement(group, device.index)
    info = {**colocation.describe(where, device.index), "gpu": torch.cuda.get_device_name(device)}
    record: dict[str, object] = {"rank": rank, "world_size": world, "placement": info, "outcomes": [], "done": False}
    _write(args.result, record)
    if where.shares_device and not info.get("mps"):
        print(f"rank {rank}: {where.ranks_on_device} ranks share GPU {device.index} but CUDA MPS does not serve it: "
              "not starting the layer (the ranks would hang spinning for each other); start MPS first "
              "(source scripts/mps.sh; mps_start)", flush=True)
        sys.stdout.flush()
        os._exit(NO_MPS_EXIT)
    outcomes: list[dict[str, object]] = record["outcomes"]
    for entry, axes, t, outcome in matrix_gpu.layer_outcomes(group, world, rank, device):
        outcomes.append({"entry": entry, "case": matrix_gpu.case_label(axes, t, world), **asdict(outcome)})
        print(f"rank {rank}: {entry} {outcomes[-1]['case']}: {outcome.result}", flush=True)
        _write(args.result, record)
    record["done"] = True
    _write(args.result, record)
    dist.barrier()  # no rank leaves while a peer may still touch its symmetric memory
    sys.stdout.flush()
    os._exit(0)  # docs/platform_notes.md: destroy_process_group() after the facades' NCCL use can hang at exit


if __name__ == "__main__":
    main()
