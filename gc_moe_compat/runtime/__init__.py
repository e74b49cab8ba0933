"""The machinery the GC-MoE operator runs on: green-context partitions, kernel JIT, graphs, symmetric workspace.

Modules: ``cuda`` (checked driver calls), ``split`` (SM split arithmetic), ``green`` (partitions), ``jit``
(compile/cache/load), ``params`` / ``launch`` (kernel arguments and direct launches), ``graph`` (green-context
graphs and capture attach), ``workspace`` (symmetric memory and peer table), ``status`` (device error records),
``env`` (the settings' reads at every call).
"""

from .cuda import CudaError
from .split import PartitionError, dispatch_request, plan_split, validate_split
from .status import DeviceCheckError, DeviceTimeoutError

__all__ = [
    "CudaError",
    "DeviceCheckError",
    "DeviceTimeoutError",
    "PartitionError",
    "dispatch_request",
    "plan_split",
    "validate_split",
]
