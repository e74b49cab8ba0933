"""Runtime properties on one H200: partitions, SM confinement, co-residency, the three-node graph, timeouts."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from runtime_kit import SITES, counters, i32, module, sync, u32, u64

from gc_moe_compat.runtime.colocation import mps_enabled
from gc_moe_compat.runtime.graph import KernelNode, get_graph
from gc_moe_compat.runtime.green import WORKQUEUE_BALANCED, Partition, Role, get_partition
from gc_moe_compat.runtime.launch import launch
from gc_moe_compat.runtime.params import KernelArgs, ptr
from gc_moe_compat.runtime.status import DeviceTimeoutError, new_status, raise_for_status, spin_timeout_ns
from gc_moe_compat.runtime.workspace import LayoutPlanner, SymmetricWorkspace, WorkspaceBusyError

pytestmark = pytest.mark.gpu

REPLAYS, CHECK_EVERY = 10_000, 1_000


def total_sms() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


@pytest.mark.parametrize("wanted", [4, 16])
def test_partition_split_and_cache(wanted):
    part = get_partition(wanted)
    assert get_partition(wanted) is part
    total = total_sms()
    assert part.compute_sms == (total - wanted) // part.alignment * part.alignment
    assert part.dispatch_sms + part.compute_sms == total and part.dispatch_sms >= wanted
    if part.workqueue_mode != WORKQUEUE_BALANCED:
        assert "CUDA_ERROR_INVALID_RESOURCE_TYPE" in part.workqueue_fallback_reason
    print(f"partition (request {wanted}):", part.describe())
    other: list[Partition] = []
    thread = threading.Thread(target=lambda: other.append(get_partition(wanted)))
    thread.start()
    thread.join()
    assert other[0] is not part  # cached per thread


def test_partition_teardown():
    part = Partition(torch.cuda.current_device(), 16)
    kernel = module().kernel("rt_noop")
    launch(kernel, 1, 32, KernelArgs(), part.compute.stream)
    part.close()
    assert part.closed
    with pytest.raises(RuntimeError, match="after close"):
        part.side(Role.COMM)
    part.close()  # idempotent


@pytest.mark.parametrize("wanted", [4, 16])
def test_sm_confinement(wanted):
    if mps_enabled(torch.cuda.current_device()):
        pytest.skip("CUDA MPS serves this GPU: green contexts do not confine there (measured on an H200), so ranks "
                    "that share a GPU run with the partition off (gc_moe_compat.runtime.colocation)")
    part = get_partition(wanted)
    kernel = module().kernel("rt_record_smid")
    seen = {}
    for side in (part.comm, part.compute):
        blocks = 4 * side.sm_count
        smids = torch.full((blocks,), -1, dtype=torch.int32, device="cuda")
        torch.cuda.synchronize()
        launch(kernel, blocks, 1024, [ptr(smids), u64(200_000)], side.stream)
        sync(side)
        seen[side.role] = set(smids.tolist())
        assert -1 not in seen[side.role]
    print(f"request {wanted}: comm SMs {sorted(seen[Role.COMM])}")
    assert len(seen[Role.COMM]) == part.dispatch_sms
    assert len(seen[Role.COMPUTE]) == part.compute_sms
    assert not seen[Role.COMM] & seen[Role.COMPUTE]
    assert max(seen[Role.COMM] | seen[Role.COMPUTE]) < total_sms()


def test_graph_nodes_stay_on_their_partition():
    """Kernel nodes bound to green contexts run on their partition, launched directly and inside a torch capture."""
    part = get_partition(16)
    kernel = module().kernel("rt_record_smid")
    comm = torch.full((4 * part.dispatch_sms,), -1, dtype=torch.int32, device="cuda")
    compute = torch.full((4 * part.compute_sms,), -1, dtype=torch.int32, device="cuda")
    graph = get_graph(
        [
            KernelNode.make("comm", kernel, Role.COMM, comm.numel(), 1024, KernelArgs(ptr(comm), u64(100_000))),
            KernelNode.make(
                "compute", kernel, Role.COMPUTE, compute.numel(), 1024, KernelArgs(ptr(compute), u64(100_000))
            ),
        ],
        part,
    )
    outer = torch.cuda.CUDAGraph()
    with torch.cuda.graph(outer):
        graph.launch()
    for run in (graph.launch, outer.replay):
        comm.fill_(-1)
        compute.fill_(-1)
        run()
        torch.cuda.synchronize()
        a, b = set(comm.tolist()), set(compute.tolist())
        assert -1 not in a | b
        assert (len(a), len(b)) == (part.dispatch_sms, part.compute_sms) and not a & b


def _spin_setter_nodes(part, flag, target, status, wait_ns, scratch, setter_first):
    mod = module()
    spinner = KernelNode.make(
        "spinner",
        mod.kernel("rt_spin_on_flag"),
        Role.COMPUTE,
        2 * part.compute_sms,
        1024,
        KernelArgs(ptr(flag), u64(target), u64(spin_timeout_ns(2_000)), ptr(status), ptr(wait_ns)),
        warmup_args=KernelArgs(ptr(scratch), u64(0), u64(spin_timeout_ns(2_000)), ptr(scratch[1:]), ptr(scratch)),
    )
    setter = KernelNode.make(
        "setter",
        mod.kernel("rt_set_flag"),
        Role.COMM,
        1,
        32,
        KernelArgs(ptr(flag), u64(target)),
        warmup_args=KernelArgs(ptr(scratch), u64(0)),
    )
    return [setter, spinner] if setter_first else [spinner, setter]


@pytest.mark.parametrize("setter_first", [False, True])
def test_coresidency_in_one_graph(setter_first):
    """A grid filling the compute partition waits on a flag set by a root on the communication partition."""
    part = get_partition()
    flag = torch.zeros(1, dtype=torch.int64, device="cuda")
    wait_ns = torch.zeros(1, dtype=torch.int64, device="cuda")
    status = new_status("cuda")
    scratch = torch.zeros(8, dtype=torch.int64, device="cuda")
    graph = get_graph(_spin_setter_nodes(part, flag, 1, status, wait_ns, scratch, setter_first), part)
    for _ in range(3):
        flag.zero_()
        graph.launch()
        torch.cuda.synchronize()
        raise_for_status(status, "co-residency graph", SITES)
    print(f"co-residency in one graph (setter first={setter_first}): flag seen after {wait_ns.item() / 1e3:.1f} us")


@pytest.mark.parametrize("captured", [False, True])
def test_programmatic_edge_launches_the_dependent_beside_its_primary(captured):
    """A grid that opens its programmatic port and then waits for a flag is released by its dependent, which sets
    the flag: the dependent launched while the primary ran (behind a full edge the wait would time out); eager and
    as a child of a torch capture (how a serving engine's graph runs the layer)."""
    mod = module()
    flag = torch.zeros(1, dtype=torch.int64, device="cuda")
    wait_ns = torch.zeros(1, dtype=torch.int64, device="cuda")
    status, scratch = new_status("cuda"), torch.zeros(8, dtype=torch.int64, device="cuda")
    graph = get_graph([
        KernelNode.make("spinner", mod.kernel("rt_open_then_spin"), None, 1, 32,
                        KernelArgs(ptr(flag), u64(1), u64(spin_timeout_ns(2_000)), ptr(status), ptr(wait_ns)),
                        warmup_args=KernelArgs(ptr(scratch), u64(0), u64(spin_timeout_ns(2_000)), ptr(scratch[1:]),
                                               ptr(scratch))),
        KernelNode.make("setter", mod.kernel("rt_set_flag"), None, 1, 32, KernelArgs(ptr(flag), u64(1)),
                        deps=("spinner",), programmatic=("spinner",), warmup_args=KernelArgs(ptr(scratch), u64(0))),
    ], None)
    outer = None
    if captured:
        outer = torch.cuda.CUDAGraph()
        with torch.cuda.graph(outer):
            graph.launch()
    for _ in range(3):
        flag.zero_()
        outer.replay() if captured else graph.launch()
        torch.cuda.synchronize()
        raise_for_status(status, "programmatic edge", SITES)
        assert flag.item() == 1
    print(f"programmatic edge (captured={captured}): the dependent released its primary after "
          f"{wait_ns.item() / 1e3:.1f} us")


def test_programmatic_dependent_sees_its_primary_after_waiting():
    """A dependent behind a programmatic edge launches while its primary still runs, and after
    ``griddepcontrol.wait`` reads the value the primary stored last."""
    mod = module()
    word = torch.zeros(1, dtype=torch.int64, device="cuda")
    copy = torch.full((1,), -1, dtype=torch.int64, device="cuda")
    scratch = torch.zeros(2, dtype=torch.int64, device="cuda")
    for value in (7, 1 << 40, 3):
        graph = get_graph([
            KernelNode.make("store", mod.kernel("rt_open_then_store"), None, 4, 32,
                            KernelArgs(ptr(word), u64(value), u64(200_000)),
                            warmup_args=KernelArgs(ptr(scratch), u64(0), u64(0))),
            KernelNode.make("copy", mod.kernel("rt_wait_then_copy"), None, 1, 32, KernelArgs(ptr(word), ptr(copy)),
                            deps=("store",), programmatic=("store",),
                            warmup_args=KernelArgs(ptr(scratch), ptr(scratch[1:]))),
        ], None)
        copy.fill_(-1)
        graph.launch()
        torch.cuda.synchronize()
        assert copy.item() == value


def test_undivided_device_contrast():
    """The same two kernels on two streams of the undivided device: reported, never failed on
    (docs/platform_notes.md)."""
    mod = module()
    spin, setter = mod.kernel("rt_spin_on_flag"), mod.kernel("rt_set_flag")
    flag = torch.zeros(1, dtype=torch.int64, device="cuda")
    wait_ns = torch.zeros(1, dtype=torch.int64, device="cuda")
    status, scratch = new_status("cuda"), torch.zeros(8, dtype=torch.int64, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    timeout = spin_timeout_ns(1_000)
    launch(spin, 1, 32, [ptr(scratch), u64(0), u64(timeout), ptr(scratch[1:]), ptr(scratch)], s1.cuda_stream)
    launch(setter, 1, 32, [ptr(scratch), u64(0)], s2.cuda_stream)
    torch.cuda.synchronize()
    blocks = 2 * total_sms()
    launch(spin, blocks, 1024, [ptr(flag), u64(1), u64(timeout), ptr(status), ptr(wait_ns)], s1.cuda_stream)
    launch(setter, 1, 32, [ptr(flag), u64(1)], s2.cuda_stream)
    torch.cuda.synchronize()
    try:
        raise_for_status(status, "undivided spinner", SITES)
        outcome = f"flag seen after {wait_ns.item() / 1e3:.1f} us (kernels overlapped)"
    except DeviceTimeoutError:
        outcome = "flag not seen within 1 s (kernels serialized)"
    print(f"undivided device, {blocks} x 1024 spinner + setter on two streams: {outcome}")


def _counter_nodes(part, state, status, scratch, scratch_status):
    mod = module()
    ga, gb = part.dispatch_sms, part.compute_sms
    timeout = u64(spin_timeout_ns(2_000))
    return [
        KernelNode.make(
            "A", mod.kernel("rt_counter_a"), Role.COMM, ga, 128, KernelArgs(ptr(state)),
            warmup_args=KernelArgs(ptr(scratch)),
        ),
        KernelNode.make(
            "B", mod.kernel("rt_counter_b"), Role.COMPUTE, gb, 256, KernelArgs(ptr(state), timeout, ptr(status)),
            warmup_args=KernelArgs(ptr(scratch), timeout, ptr(scratch_status)),
        ),
        KernelNode.make(
            "C", mod.kernel("rt_counter_c"), Role.COMPUTE, 1, 32,
            KernelArgs(ptr(state), u32(ga), u32(gb), ptr(status)),
            deps=("A", "B"),
            warmup_args=KernelArgs(ptr(scratch), u32(ga), u32(gb), ptr(scratch_status)),
        ),
    ]  # fmt: skip


def _expected(n: int, ga: int, gb: int) -> dict[str, int]:
    return {"arrive_a": n * ga, "gen_a": n, "arrive_b": n * gb, "done_b": n * gb, "gen_b": n, "gen_c": n,
            "checks": n, "reserved": 0}  # fmt: skip


def _counter_fixture(part):
    state = torch.zeros(8, dtype=torch.int64, device="cuda")
    scratch = torch.zeros(8, dtype=torch.int64, device="cuda")
    scratch[1] = 1 << 62  # warm-up of B must not wait on A
    status, scratch_status = new_status("cuda"), new_status("cuda")
    return state, status, _counter_nodes(part, state, status, scratch, scratch_status)


def test_three_node_graph_10k_replays_no_host_reset():
    part = get_partition()
    state, status, nodes = _counter_fixture(part)
    graph = get_graph(nodes, part)
    assert get_graph(nodes, part) is graph  # cached by kernels, shapes, parameters, partition
    for n in range(CHECK_EVERY, REPLAYS + 1, CHECK_EVERY):
        for _ in range(CHECK_EVERY):
            graph.launch()
        torch.cuda.synchronize()
        raise_for_status(status, f"three-node graph after {n} replays", SITES)
        assert counters(state) == _expected(n, part.dispatch_sms, part.compute_sms), n


def test_three_node_graph_inside_torch_capture():
    part = get_partition()
    state, status, nodes = _counter_fixture(part)
    graph = get_graph(nodes, part)  # built (and warmed up) before capture
    before = torch.zeros(1, dtype=torch.int64, device="cuda")
    after = torch.zeros(1, dtype=torch.int64, device="cuda")
    outer = torch.cuda.CUDAGraph()
    with torch.cuda.graph(outer):
        before.add_(1)
        graph.launch()
        after.copy_(state[5:6])  # gen_c: must see this replay's node C
    torch.cuda.synchronize()
    assert counters(state)["gen_c"] == 0  # capture ran nothing
    for n in range(CHECK_EVERY, REPLAYS + 1, CHECK_EVERY):
        for _ in range(CHECK_EVERY):
            outer.replay()
        torch.cuda.synchronize()
        raise_for_status(status, f"captured three-node graph after {n} replays", SITES)
        assert counters(state) == _expected(n, part.dispatch_sms, part.compute_sms), n
        assert before.item() == n and after.item() == n


def test_missing_producer_times_out_with_exception():
    part = get_partition()
    spin = module().kernel("rt_spin_on_flag")
    flag, wait_ns = torch.zeros(1, dtype=torch.int64, device="cuda"), torch.zeros(1, dtype=torch.int64, device="cuda")
    status = new_status("cuda")
    torch.cuda.synchronize()
    start = time.monotonic()
    launch(spin, part.compute_sms, 256, [ptr(flag), u64(1), u64(spin_timeout_ns(200)), ptr(status), ptr(wait_ns)],
           part.compute.stream)  # fmt: skip
    sync(part.compute)
    with pytest.raises(DeviceTimeoutError, match="spin on flag: observed 0, expected 1"):
        raise_for_status(status, "lonely spinner", SITES)
    assert 0.15 < time.monotonic() - start < 5


def test_single_rank_workspace_and_self_signal():
    part = get_partition()
    plan = LayoutPlanner()
    plan.add("head", 64)
    plan.add("signal", 128 + 4 * 4096, alignment=4096)
    ws = SymmetricWorkspace(plan)
    assert ws.world_size == 1 and ws.peer_table.base == ws.buffer.data_ptr() and ws.peer_table.offsets[0] == 0
    assert ws.offset("signal") == 4096
    with ws.exclusive(), pytest.raises(WorkspaceBusyError), ws.exclusive():
        pass
    mod = module()
    status = new_status("cuda")
    off = u64(ws.offset("signal"))
    launch(mod.kernel("rt_peer_signal"), 1, 256, [ws.peer_table, i32(0), off, u64(7), u32(4096)], part.comm.stream)
    sync(part.comm)
    wait_args = [ws.peer_table, off, u64(7), u32(4096), u64(spin_timeout_ns(1_000)), ptr(status)]
    launch(mod.kernel("rt_peer_wait"), 1, 256, wait_args, part.compute.stream)
    sync(part.compute)
    raise_for_status(status, "self signal", SITES)
    assert ws.region("signal", torch.int64)[0].item() == 7
