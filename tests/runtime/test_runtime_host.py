"""Host-side runtime pieces that need no GPU: workspace layout, peer table, kernel arguments, status records."""

import ctypes
from types import SimpleNamespace

import pytest
import torch

from gc_moe_compat.runtime.graph import KernelNode, edge_adder
from gc_moe_compat.runtime.params import KernelArgs, c_enum_declaration, c_identifier, ptr
from gc_moe_compat.runtime.status import (
    STATUS_MISMATCH,
    STATUS_TIMEOUT,
    DeviceCheckError,
    DeviceTimeoutError,
    KernelStatus,
    StatusSite,
    raise_for_status,
    spin_timeout_ns,
)
from gc_moe_compat.runtime.workspace import MAX_RANKS, LayoutPlanner, PeerTable, make_peer_table


def test_peer_table_matches_device_struct():
    assert ctypes.sizeof(PeerTable) == 592  # static_assert in kernels/common/peer_table.cuh
    assert PeerTable.offsets.offset == 8 and PeerTable.rank.offset == 584 and PeerTable.world_size.offset == 588


def test_make_peer_table_offsets():
    table = make_peer_table([0x7000_0000, 0x5000_0000, 0x9000_0000], rank=1)
    assert table.base == 0x5000_0000 and table.rank == 1 and table.world_size == 3
    assert [table.offsets[r] for r in range(3)] == [0x2000_0000, 0, 0x4000_0000]
    assert table.base + table.offsets[2] == 0x9000_0000


def test_make_peer_table_limits():
    with pytest.raises(ValueError, match="1 to 72 ranks"):
        make_peer_table(list(range(MAX_RANKS + 1)), 0)
    with pytest.raises(ValueError, match="outside a group"):
        make_peer_table([1, 2], 2)


def test_layout_planner_aligns_regions():
    plan = LayoutPlanner()
    a = plan.add("flags", 8)
    b = plan.add("ring", 1000, alignment=1024)
    c = plan.add("tail", 3, alignment=16)
    assert (a.offset, b.offset, c.offset) == (0, 1024, 2032)
    assert plan.size == 2048  # 2035 bytes rounded up to the largest alignment
    assert set(plan.regions) == {"flags", "ring", "tail"}


@pytest.mark.parametrize(("nbytes", "alignment", "message"), [(0, 256, "positive"), (8, 3, "power of two")])
def test_layout_planner_rejects(nbytes, alignment, message):
    with pytest.raises(ValueError, match=message):
        LayoutPlanner().add("x", nbytes, alignment)


def test_layout_planner_rejects_duplicates():
    plan = LayoutPlanner()
    plan.add("x", 8)
    with pytest.raises(ValueError, match="already planned"):
        plan.add("x", 8)


def test_kernel_args_bytes_and_pointers():
    table = make_peer_table([0x1000, 0x2000], 0)
    args = KernelArgs(ctypes.c_uint64(0xDEAD), ctypes.c_uint32(7), table)
    sig = args.signature
    assert sig[0] == ("c_ulong", (0xDEAD).to_bytes(8, "little")) or sig[0][1] == (0xDEAD).to_bytes(8, "little")
    assert sig[1][1] == (7).to_bytes(4, "little") and len(sig[2][1]) == 592
    pointers = (ctypes.c_void_p * 3).from_address(args.address)
    assert ctypes.c_uint32.from_address(pointers[1]).value == 7


def test_kernel_args_reject_python_values():
    with pytest.raises(TypeError, match="ctypes value"):
        KernelArgs(5)
    with pytest.raises(ValueError, match="CUDA tensors"):
        ptr(torch.zeros(1))


def _status(code: int, site: int, observed: int, expected: int) -> torch.Tensor:
    record = KernelStatus(code, site, observed, expected, 0)
    return torch.frombuffer(bytearray(bytes(record)), dtype=torch.uint8)


def test_status_records_raise_named_errors():
    assert ctypes.sizeof(KernelStatus) == 32
    raise_for_status(_status(0, 0, 0, 0), "ok")
    with pytest.raises(DeviceTimeoutError, match="peer flag: observed 0, expected 3"):
        raise_for_status(_status(STATUS_TIMEOUT, 8, 0, 3), "rt_peer_wait", {8: "peer flag"})
    with pytest.raises(DeviceCheckError, match="site 5: observed 9, expected 10"):
        raise_for_status(_status(STATUS_MISMATCH, 5, 9, 10), "rt_counter_c")


class _Sites(StatusSite):
    GRID_ARRIVAL = 1, "grid arrival"
    REFILL_L1 = 7, "ring refill"


def test_c_enum_declaration_aligns_comments_and_names_its_origin():
    assert c_identifier("kSite", "REFILL_L1") == "kSiteRefillL1" and c_identifier("k", "TAG1") == "kTag1"
    assert c_enum_declaration("Kind", {"kA": 1, "kLonger": 20}, "host.py", {"kA": "first"}) == (
        "// Generated from host.py.\n"
        "enum Kind : unsigned int {\n"
        "    kA = 1,        // first\n"
        "    kLonger = 20,\n"
        "};\n")


def test_status_sites_name_records_and_generate_their_c_enum():
    assert _Sites.REFILL_L1 == 7 and _Sites(1).description == "grid arrival"
    assert _Sites.names() == {1: "grid arrival", 7: "ring refill"}
    with pytest.raises(DeviceCheckError, match="k: ring refill: observed 9, expected 10"):
        raise_for_status(_status(STATUS_MISMATCH, _Sites.REFILL_L1, 9, 10), "k", _Sites.names())
    assert _Sites.c_declaration("Site", "kSite", [_Sites.REFILL_L1]) == (
        f"// Generated from {__name__}._Sites.\n"
        "enum Site : unsigned int {\n"
        "    kSiteRefillL1 = 7,  // ring refill\n"
        "};\n")


def test_spin_timeout(monkeypatch):
    monkeypatch.delenv("GC_MOE_SPIN_TIMEOUT_MS", raising=False)
    assert spin_timeout_ns() == 10_000_000_000
    monkeypatch.setenv("GC_MOE_SPIN_TIMEOUT_MS", "250")
    assert spin_timeout_ns() == 250_000_000
    assert spin_timeout_ns(1.5) == 1_500_000
    with pytest.raises(ValueError, match="positive"):
        spin_timeout_ns(0)


def test_kernel_node_programmatic_dependencies_must_be_dependencies():
    kernel = SimpleNamespace(module_key="m", name="k")
    node = KernelNode.make("b", kernel, None, 1, 32, KernelArgs(), deps=("a",), programmatic=("a",))
    assert (node.deps, node.programmatic) == (("a",), ("a",))
    assert node.signature() != KernelNode.make("b", kernel, None, 1, 32, KernelArgs(), deps=("a",)).signature()
    with pytest.raises(ValueError, match=r"node 'b': programmatic dependencies \['c'\] are not among its deps"):
        KernelNode.make("b", None, None, 1, 32, KernelArgs(), deps=("a",), programmatic=("c",))


def test_programmatic_edges_use_the_bindings_call_that_takes_edge_data():
    def v13(*args):  # CUDA 13 bindings: the plain name takes edge data
        return args

    def v2(*args):  # 12.x bindings: the plain name does not, its _v2 does
        return args

    assert edge_adder(SimpleNamespace(cuGraphAddDependencies=v13)) is v13
    assert edge_adder(SimpleNamespace(cuGraphAddDependencies=lambda *a: a, cuGraphAddDependencies_v2=v2)) is v2
