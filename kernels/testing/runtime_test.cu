// Kernels that prove the runtime's properties on the device (tests/runtime/, bench/runtime_sm90.py).
// They carry no MoE logic: each one exercises one property of green contexts, graphs or the symmetric workspace.
#include "common/peer_table.cuh"
#include "common/status.cuh"
#include "common/sync.cuh"

using gc_moe::KernelStatus;
using gc_moe::PeerTable;
using gc_moe::Scope;
using gc_moe::u32;
using gc_moe::u64;

// Device-persistent state of the three-node counter graph; mirrored by tests/kit/runtime_kit.py (CounterState).
struct CounterState {
    u64 arrive_a;  // +1 per block of node A per replay, never reset
    u64 gen_a;     // generation A completed (published by A's last block)
    u64 arrive_b;  // +1 per block of node B per replay
    u64 done_b;    // +1 per block of node B after its wait on gen_a
    u64 gen_b;     // generation B completed
    u64 gen_c;     // generation C verified
    u64 checks;    // number of verifications C ran
    u64 reserved;
};
static_assert(sizeof(CounterState) == 64, "CounterState layout");

// Status sites reported by these kernels (decoded by the tests).
enum Site : u32 {
    kSiteSpin = 1,
    kSiteCounterWaitA = 2,
    kSiteGenA = 3,
    kSiteGenB = 4,
    kSiteArriveA = 5,
    kSiteArriveB = 6,
    kSiteDoneB = 7,
    kSitePeerFlag = 8,
    kSitePeerPayload = 9,
};

extern "C" __global__ void rt_noop() {}

// Each block records the SM it ran on, then stays resident for busy_ns so that the grid spreads over all SMs
// the launching context may use.
extern "C" __global__ void rt_record_smid(u32* smids, u64 busy_ns) {
    if (threadIdx.x == 0) smids[blockIdx.x] = gc_moe::smid();
    gc_moe::busy_wait_ns(busy_ns);
}

extern "C" __global__ void rt_set_flag(u64* flag, u64 value) {
    if (threadIdx.x == 0 && blockIdx.x == 0) gc_moe::st_release_gpu(flag, value);
}

// Every block waits (bounded) for *flag >= target; wait_ns[0] receives the longest wait any block saw.
static __device__ void spin_on_flag(const u64* flag, u64 target, u64 timeout_ns, KernelStatus* status, u64* wait_ns) {
    if (threadIdx.x == 0) {
        const u64 start = gc_moe::globaltimer_ns();
        if (gc_moe::wait_at_least<Scope::kGpu>(flag, target, timeout_ns, status, kSiteSpin)) {
            atomicMax(wait_ns, gc_moe::globaltimer_ns() - start);
        }
    }
    __syncthreads();
}

extern "C" __global__ void rt_spin_on_flag(const u64* flag, u64 target, u64 timeout_ns, KernelStatus* status,
                                           u64* wait_ns) {
    spin_on_flag(flag, target, timeout_ns, status, wait_ns);
}

// rt_spin_on_flag behind launch_dependents: the grid lets a programmatic dependent launch at once, so a dependent that
// sets the flag ends the wait (with a full edge it could not start before the wait timed out).
extern "C" __global__ void rt_open_then_spin(const u64* flag, u64 target, u64 timeout_ns, KernelStatus* status,
                                             u64* wait_ns) {
    gc_moe::launch_dependents();
    spin_on_flag(flag, target, timeout_ns, status, wait_ns);
}

// Lets a programmatic dependent launch, stays busy for delay_ns, then stores value into *word with a plain store.
extern "C" __global__ void rt_open_then_store(u64* word, u64 value, u64 delay_ns) {
    gc_moe::launch_dependents();
    gc_moe::busy_wait_ns(delay_ns);
    if (threadIdx.x == 0 && blockIdx.x == 0) *word = value;
}

// *copy = *word after wait_prerequisites: the value rt_open_then_store left, where its edge to this grid is
// programmatic.
extern "C" __global__ void rt_wait_then_copy(const u64* word, u64* copy) {
    gc_moe::wait_prerequisites();
    if (threadIdx.x == 0 && blockIdx.x == 0) *copy = *reinterpret_cast<const volatile u64*>(word);
}

// Node A (communication partition): arrive; the generation's last block publishes gen_a.
extern "C" __global__ void rt_counter_a(CounterState* s) {
    if (threadIdx.x == 0) {
        bool last = false;
        const u64 gen = gc_moe::arrive_generation(&s->arrive_a, gridDim.x, &last);
        if (last) gc_moe::st_release_gpu(&s->gen_a, gen);
    }
}

// Node B (compute partition, concurrent root): arrive, wait for this generation of A (needs A co-resident),
// then count completion; the generation's last finisher publishes gen_b.
extern "C" __global__ void rt_counter_b(CounterState* s, u64 timeout_ns, KernelStatus* status) {
    if (threadIdx.x == 0) {
        bool last = false;
        const u64 gen = gc_moe::arrive_generation(&s->arrive_b, gridDim.x, &last);
        if (!gc_moe::wait_at_least<Scope::kGpu>(&s->gen_a, gen, timeout_ns, status, kSiteCounterWaitA)) return;
        gc_moe::arrive_generation(&s->done_b, gridDim.x, &last);
        if (last) gc_moe::st_release_gpu(&s->gen_b, gen);
    }
}

__device__ __forceinline__ bool expect_eq(KernelStatus* status, u32 site, u64 observed, u64 expected) {
    if (observed == expected) return true;
    gc_moe::report_status(status, gc_moe::kStatusMismatch, site, observed, expected);
    return false;
}

// Node C (compute partition, depends on A and B): verifies every counter holds exactly its generation's value,
// then publishes gen_c. One thread; the graph edges order it after both roots.
extern "C" __global__ void rt_counter_c(CounterState* s, u32 blocks_a, u32 blocks_b, KernelStatus* status) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const u64 gen = gc_moe::ld_acquire_gpu(&s->gen_c) + 1;
    bool ok = expect_eq(status, kSiteGenA, gc_moe::ld_acquire_gpu(&s->gen_a), gen);
    ok &= expect_eq(status, kSiteGenB, gc_moe::ld_acquire_gpu(&s->gen_b), gen);
    ok &= expect_eq(status, kSiteArriveA, s->arrive_a, gen * blocks_a);
    ok &= expect_eq(status, kSiteArriveB, s->arrive_b, gen * blocks_b);
    ok &= expect_eq(status, kSiteDoneB, s->done_b, gen * blocks_b);
    s->checks += ok ? 1 : 0;
    gc_moe::st_release_gpu(&s->gen_c, gen);
}

// Word i of the payload a signal of `value` carries.
__device__ __forceinline__ u32 payload_word(u64 value, u32 i) { return (u32)(value * 2654435761ull) + i; }

// Region layout used by the peer kernels: a u64 flag at +0, payload words from +128.
constexpr u64 kPayloadOffset = 128;

// One block: writes payload_words words into rank `peer`'s region, then releases the flag (system scope).
extern "C" __global__ void rt_peer_signal(PeerTable table, int peer, u64 region_offset, u64 value,
                                          u32 payload_words) {
    u32* payload = gc_moe::peer_ptr<u32>(table, peer, region_offset + kPayloadOffset);
    for (u32 i = threadIdx.x; i < payload_words; i += blockDim.x) payload[i] = payload_word(value, i);
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        gc_moe::st_release_sys(gc_moe::peer_ptr<u64>(table, peer, region_offset), value);
    }
}

// One block: waits (acquire, system scope, bounded) until this rank's flag reaches `expected`, then checks every
// payload word the peer wrote before releasing the flag.
extern "C" __global__ void rt_peer_wait(PeerTable table, u64 region_offset, u64 expected, u32 payload_words,
                                        u64 timeout_ns, KernelStatus* status) {
    __shared__ int ready;
    if (threadIdx.x == 0) {
        const u64* flag = gc_moe::peer_ptr<u64>(table, table.rank, region_offset);
        ready = gc_moe::wait_at_least<Scope::kSys>(flag, expected, timeout_ns, status, kSitePeerFlag);
    }
    __syncthreads();
    if (!ready) return;
    const u32* payload = gc_moe::peer_ptr<u32>(table, table.rank, region_offset + kPayloadOffset);
    for (u32 i = threadIdx.x; i < payload_words; i += blockDim.x) {
        const u32 want = payload_word(expected, i);
        const u32 got = payload[i];
        if (got != want) gc_moe::report_status(status, gc_moe::kStatusMismatch, kSitePeerPayload, got, want);
    }
}
