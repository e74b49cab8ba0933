"""Direct kernel launches on a stream (outside graphs), e.g. on a green context's stream."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from cuda.bindings import driver

from .cuda import CudaError, as_stream, call
from .jit import Kernel
from .params import Arg, KernelArgs, as_args

Dim3 = tuple[int, int, int]
_SUCCESS = driver.CUresult.CUDA_SUCCESS


def current_stream_handle(device: torch.device) -> int:
    """The raw handle of torch's current stream on CUDA ``device`` (the current device where it names no index):
    where an eager call's kernels go. Read through torch's C binding ``torch._C._cuda_getCurrentRawStream`` (what
    Triton's launcher reads): 0.1 us per call on an H200 host against 3-5 us for
    ``torch.cuda.current_stream(device).cuda_stream``, which builds a ``Stream`` object each time."""
    index = torch.cuda.current_device() if device.index is None else device.index
    return torch._C._cuda_getCurrentRawStream(index)


def dim3(value: int | Sequence[int]) -> Dim3:
    """A grid or block shape as three positive ints."""
    dims = (value, 1, 1) if isinstance(value, int) else tuple(value) + (1,) * (3 - len(value))
    if len(dims) != 3 or any(int(d) < 1 for d in dims):
        raise ValueError(f"launch dimensions must be 1 to 3 positive ints, got {value!r}")
    return (int(dims[0]), int(dims[1]), int(dims[2]))


def cluster_config(
    grid: int | Sequence[int], block: int | Sequence[int], cluster: int, stream: int | driver.CUstream,
    shared_bytes: int = 0,
) -> driver.CUlaunchConfig:
    """The ``cuLaunchKernelEx`` configuration of a launch in clusters of ``cluster`` CTAs along x (the grid's x
    extent must be a multiple of it); also what :func:`max_active_clusters` asks about."""
    g, b = dim3(grid), dim3(block)
    if cluster < 1 or g[0] % cluster:
        raise ValueError(f"cluster: a positive divisor of the grid's x extent {g[0]}, got {cluster}")
    attr = driver.CUlaunchAttribute()
    attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster, 1, 1
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = g
    config.blockDimX, config.blockDimY, config.blockDimZ = b
    config.sharedMemBytes = shared_bytes
    config.hStream = as_stream(stream)
    config.attrs = [attr]
    config.numAttrs = 1
    return config


def max_active_clusters(kernel: Kernel, block: int, cluster: int, shared_bytes: int) -> int:
    """How many clusters of ``cluster`` CTAs of ``kernel`` the device (or the current green context) can hold at
    once: the persistent grid of a cluster kernel, whose SM pairs depend on the GPC layout."""
    config = cluster_config(cluster, block, cluster, 0, shared_bytes)
    return int(call(driver.cuOccupancyMaxActiveClusters, kernel.handle, config))


def launch(
    kernel: Kernel,
    grid: int | Sequence[int],
    block: int | Sequence[int],
    args: KernelArgs | Sequence[Arg],
    stream: int | driver.CUstream,
    shared_bytes: int = 0,
    cluster: int = 1,
) -> None:
    """Launches ``kernel`` on ``stream``, in clusters of ``cluster`` CTAs along x when above 1; a green context's
    stream runs it in that context (on its SMs)."""
    packed = as_args(args)
    if cluster > 1:
        config = cluster_config(grid, block, cluster, stream, shared_bytes)
        call(driver.cuLaunchKernelEx, config, kernel.handle, packed.address, 0)
        return
    launch_packed(kernel.handle, dim3(grid), dim3(block), packed.address, as_stream(stream), shared_bytes)


def launch_packed(function: driver.CUkernel | driver.CUfunction, grid: Dim3, block: Dim3, args: int,
                  stream: driver.CUstream, shared_bytes: int = 0) -> None:
    """``cuLaunchKernel`` of ``function`` with arguments already in the driver's form (``grid`` and ``block`` three
    positive ints, ``args`` the address of the packed ``void*`` array, :attr:`KernelArgs.address`): the path of a
    kernel launched on every call with cached arguments, which :func:`launch` normalizes first."""
    result = driver.cuLaunchKernel(function, *grid, *block, shared_bytes, stream, args, 0)[0]
    if result != _SUCCESS:
        raise CudaError("cuLaunchKernel", result)
