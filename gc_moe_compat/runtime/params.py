"""By-value kernel parameters packed for ``cuLaunchKernel`` and ``CUDA_KERNEL_NODE_PARAMS``.

Arguments are ctypes instances (scalars, or structures such as the workspace peer table) so that each one's exact
by-value bytes are known: the driver copies them at launch / node creation, and the same bytes form the parameter
signature that graph cache keys use.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence

import torch

Arg = ctypes._SimpleCData | ctypes.Structure | ctypes.Array


def ptr(tensor: torch.Tensor) -> ctypes.c_uint64:
    """A device pointer argument for ``tensor`` (which must be a CUDA tensor)."""
    if not tensor.is_cuda:
        raise ValueError(f"kernel pointer arguments must be CUDA tensors, got a {tensor.device} tensor")
    return ctypes.c_uint64(tensor.data_ptr())


class KernelArgs:
    """Packed arguments: ``address`` is the ``void**`` array the driver reads; ``signature`` identifies them."""

    def __init__(self, *args: Arg) -> None:
        for i, arg in enumerate(args):
            if not isinstance(arg, ctypes._SimpleCData | ctypes.Structure | ctypes.Array):
                raise TypeError(f"kernel argument {i} must be a ctypes value (c_uint64, a Structure...), got {arg!r}")
        self._args: tuple[Arg, ...] = args
        self._pointers = (ctypes.c_void_p * max(1, len(args)))(*(ctypes.addressof(a) for a in args))

    @property
    def address(self) -> int:
        """Address of the ``void*`` array (valid while this object lives)."""
        return ctypes.addressof(self._pointers)

    @property
    def signature(self) -> tuple[tuple[str, bytes], ...]:
        """(type name, by-value bytes) of every argument."""
        return tuple((type(a).__name__, ctypes.string_at(ctypes.addressof(a), ctypes.sizeof(a))) for a in self._args)

    def __len__(self) -> int:
        return len(self._args)


def fields_before(struct: type[ctypes.Structure], name: str) -> frozenset[str]:
    """The names of ``struct``'s fields declared before field ``name``: a parameter struct's leading run of fields
    of one kind (its pointers, which a call sets), named without listing them twice."""
    names = [field for field, _ in struct._fields_]
    return frozenset(names[:names.index(name)])


def as_args(args: KernelArgs | Sequence[Arg]) -> KernelArgs:
    """``args`` as :class:`KernelArgs`."""
    return args if isinstance(args, KernelArgs) else KernelArgs(*args)


_C_TYPES = {ctypes.c_uint64: "unsigned long long", ctypes.c_uint32: "unsigned int", ctypes.c_int64: "long long",
            ctypes.c_int32: "int", ctypes.c_float: "float"}


def c_struct_declaration(struct: type[ctypes.Structure], c_name: str, origin: str) -> str:
    """The C++ declaration of a flat ctypes parameter struct, with a ``static_assert`` on its size, so kernel
    headers are generated from (and checked against) the one Python definition in ``origin``."""
    fields = "\n".join(f"    {_C_TYPES[kind]} {name};" for name, kind in struct._fields_)
    return (f"struct {c_name} {{\n{fields}\n}};\n"
            f"static_assert(sizeof({c_name}) == {ctypes.sizeof(struct)}, \"{c_name} must match {origin}\");\n")


def c_identifier(prefix: str, name: str) -> str:
    """The C spelling of a host enum member: ``prefix`` + ``name`` in CamelCase (``"kSite"``, ``"GRID_ARRIVAL"`` ->
    ``kSiteGridArrival``), so the kernels keep their ``k``-prefixed constants while the host keeps Python names."""
    return prefix + "".join(part.capitalize() for part in name.split("_"))


def c_enum_declaration(c_name: str, members: Mapping[str, int], origin: str,
                       comments: Mapping[str, str] | None = None) -> str:
    """The C++ declaration of an ``unsigned int`` enum with ``members`` (C name -> value, in order), each with its
    comment from ``comments`` if any, under a line naming ``origin``: kernel constants the host also reads (status
    sites, record indices) are generated from the one Python definition there instead of written twice."""
    comments = comments or {}
    entries = {name: f"{name} = {value}," for name, value in members.items()}
    width = max(map(len, entries.values()), default=0)
    lines = "".join(f"    {entry:<{width}}  // {comments[name]}\n" if name in comments else f"    {entry}\n"
                    for name, entry in entries.items())
    return f"// Generated from {origin}.\nenum {c_name} : unsigned int {{\n{lines}}};\n"
