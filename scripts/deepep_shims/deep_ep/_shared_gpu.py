"""DeepEP's legacy tests with more processes than GPUs (several ranks on one GPU under CUDA MPS): what their
``init_dist`` needs there, installed by the shim package when ``GC_MOE_DEEPEP_SHARED_GPU=1``.

DeepEP's ``deep_ep/utils/envs.py:init_dist`` joins an NCCL group and binds local rank ``r`` to ``cuda:r``; NCCL refuses
two ranks on one GPU and ``cuda:r`` does not exist past the GPU count. The replacement does what it does (the same
rendezvous variables and rank numbering, ``_local_rank``, default dtype BF16, default device ``cuda``, the seed, a
new group of every rank) with a gloo group and the GPU ``gc_moe_compat.runtime.colocation.local_device`` picks; with
a GPU per rank it calls DeepEP's own. gloo has no ``all_gather_into_tensor`` (``test_low_latency.py`` gathers the
routing with it), so under gloo that becomes an ``all_gather`` into the output's rank chunks. DeepEP's files stay
unmodified.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from gc_moe_compat.runtime.colocation import host_backend, local_device

from .utils import envs

_deepep_init_dist = envs.init_dist
_all_gather_into_tensor = dist.all_gather_into_tensor


def _gloo_all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None,
                                 async_op: bool = False) -> object:
    if dist.get_backend(group) != "gloo":
        return _all_gather_into_tensor(output, input, group=group, async_op=async_op)
    chunks = list(output.view(dist.get_world_size(group), *input.shape).unbind(0))  # rank r's rows, input's shape
    return dist.all_gather(chunks, input, group=group, async_op=async_op)


def init_dist(local_rank: int, num_local_ranks: int, seed: int = 0) -> tuple[int, int, dist.ProcessGroup]:
    """DeepEP's ``init_dist`` on a gloo group when its ranks share GPUs (see the module docstring)."""
    gpus = torch.cuda.device_count()
    backend, reason = host_backend(num_local_ranks, gpus)
    if backend == "nccl":
        return _deepep_init_dist(local_rank, num_local_ranks, seed)
    if local_rank == 0:
        print(f"deep_ep legacy-test shim: {reason}", flush=True)
    ip, port = os.getenv("MASTER_ADDR", "127.0.0.1"), int(os.getenv("MASTER_PORT", "8361"))
    num_nodes, node_rank = int(os.getenv("WORLD_SIZE", 1)), int(os.getenv("RANK", 0))
    envs._local_rank = local_rank
    dist.init_process_group(backend="gloo", init_method=f"tcp://{ip}:{port}", world_size=num_nodes * num_local_ranks,
                            rank=node_rank * num_local_ranks + local_rank)
    dist.all_gather_into_tensor = _gloo_all_gather_into_tensor
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device("cuda")
    torch.cuda.set_device(local_device(local_rank, num_local_ranks, gpus))
    envs.init_seed(seed)
    return dist.get_rank(), dist.get_world_size(), dist.new_group(list(range(num_local_ranks * num_nodes)))


envs.init_dist = init_dist
