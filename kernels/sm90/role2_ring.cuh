// Role2's side of the token ring (paper §4.3), shared by both SM90 grouped GEMMs in operator mode
// (role2_gemm_fp8xfp8.cu and role2_gemm_fp8xfp4.cu with GC_OPERATOR=1): the workspace view of the by-value
// arguments, the bounded waits with the abort rule, the task sequence, the ring acquires before a task's loads and
// the releases after its epilogue. Nothing here depends on a kernel's tile constants (those pieces are in
// sm90/role2_gemm.cuh); the protocol itself is written at the top of role2_gemm.cuh.
#pragma once

#include "common/peer_table.cuh"
#include "common/sync.cuh"
#include "sm90/grouped.cuh"
#include "sm90/role2_gemm_params.cuh"

#ifdef GC_ROLE2_MARKS
// The marked variant's record (bench/layer_marks_sm90.py points it at a device buffer; nothing is recorded while it
// is null). Outside the namespaces, so that the cubin names it plainly (cuLibraryGetGlobal looks it up by name).
__device__ unsigned long long* gc_role2_marks;
#define GC_ROLE2_MARK(...) __VA_ARGS__
#else
// The production build: no global, no marks (the statements inside GC_ROLE2_MARK are not compiled).
#define GC_ROLE2_MARK(...)
#endif

namespace gc_moe {
namespace sm90 {

#ifdef GC_ROLE2_MARKS
// Where one replay's time goes per role2 CTA, in the variant bench/layer_marks_sm90.py builds (GC_ROLE2_MARKS
// defined): u64 words gc_role2_marks[CTA * kRole2MarkFields + field], %globaltimer nanoseconds for the times, sums
// and counts for the waits. A wait is counted only when its first load did not find the signal (the spin path of
// op_wait), so the sums are the time role2 spent waiting on role1's ring fills (L1) and on its own W1 tiles (L2).
enum Role2Mark : u32 {
    kMarkEntry = 0,      // thread 0 at the kernel's start (after the warm-up return)
    kMarkPoolReady = 1,  // thread 0 once role1's pool header (the replay's block count) was acquired
    kMarkL1WaitNs = 2,   // the producer's waits on l1_full_count (role1 filling a ring block), summed
    kMarkL1Waits = 3,    // how many of those waits spun
    kMarkL2WaitNs = 4,   // the producer's waits on l2_full_mask (a W1 tile of the block), summed
    kMarkL2Waits = 5,    // how many of those waits spun
    kMarkFirstLoad = 6,  // the pipelined producer's first task's first K step issued (its ring block acquired)
    kMarkLastTake = 7,   // the pipelined producer found no task left
    kMarkTasks = 8,      // the tasks the pipelined producer took
    kMarkExit = 9,       // consumer thread 0 left the task loop
};
constexpr u32 kRole2MarkFields = 10;
constexpr u32 kRole2MarkCtas = 256;  // CTAs recorded (role2's grid is one CTA per compute SM)
// After the CTA records, a word per combine row (source rank * capacity + token, the first kRole2MarkTokens): the
// latest time a W2 epilogue stored a tile of it, over the token's slots and H tiles (when the token could be combined).
constexpr u32 kRole2MarkTokens = 8192;

__device__ __forceinline__ u64* role2_marks() {
    u64* marks = reinterpret_cast<u64*>(::gc_role2_marks);
    return marks != nullptr && blockIdx.x < kRole2MarkCtas ? marks + blockIdx.x * kRole2MarkFields : nullptr;
}

__device__ __forceinline__ void role2_mark_time(u32 field) {
    if (u64* m = role2_marks()) m[field] = globaltimer_ns();
}

__device__ __forceinline__ void role2_mark_add(u32 field, u64 value) {
    if (u64* m = role2_marks()) atomicAdd(reinterpret_cast<unsigned long long*>(m + field), value);
}

// A W2 epilogue stores its tile of combine row `row` now.
__device__ __forceinline__ void role2_mark_token(u64 row) {
    u64* marks = reinterpret_cast<u64*>(::gc_role2_marks);
    if (marks != nullptr && row < kRole2MarkTokens)
        atomicMax(reinterpret_cast<unsigned long long*>(marks + kRole2MarkCtas * kRole2MarkFields + row),
                  static_cast<unsigned long long>(globaltimer_ns()));
}

// A spun wait of `site` that started at `start` and just saw its signal.
__device__ __noinline__ void role2_mark_wait(u32 site, u64 start) {
    const u32 field = site == kSiteL1Full ? kMarkL1WaitNs : site == kSiteL2Mask ? kMarkL2WaitNs : ~0u;
    if (field == ~0u) return;
    role2_mark_add(field, globaltimer_ns() - start);
    role2_mark_add(field + 1, 1);
}
#endif

__device__ __forceinline__ void red_release_gpu_xor_u64(u64* p, u64 v) {
    asm volatile("red.release.gpu.global.xor.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

__device__ __forceinline__ uint4 ld_shared_v4(u32 addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}

__device__ __forceinline__ void st_global_v4(void* p, uint4 v) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

// Everything role2 reads from its by-value arguments, resolved once per thread.
struct OpArgs {
    const PeerTable& peers;
    const WorkspaceOffsets& off;
    const Role2Params& p;

    template <typename T>
    __device__ __forceinline__ T* at(u64 offset) const {
        return reinterpret_cast<T*>(peers.base + offset);
    }
    __device__ __forceinline__ KernelStatus* status() const { return at<KernelStatus>(off.status) + kRole2Record; }
    __device__ __forceinline__ bool aborted() const {
        const KernelStatus* records = at<KernelStatus>(off.status);
        return *reinterpret_cast<const volatile u32*>(&records[kRole1Record].code) != kStatusOk ||
               *reinterpret_cast<const volatile u32*>(&records[kRole2Record].code) != kStatusOk;
    }
};

// Bounded spin until ready(value of load()) holds. Gives up (false) at once if role1 or role2 recorded an error,
// and on timeout records `site` with the last value seen and `expected`.
template <typename Load, typename Ready>
__device__ __forceinline__ bool op_wait(const OpArgs& a, Load&& load, Ready&& ready, u64 expected, u32 site,
                                        u64& seen) {
    seen = load();
    if (ready(seen)) return true;
    const u64 start = globaltimer_ns();
    while (true) {
        if (a.aborted()) return false;
        if (globaltimer_ns() - start > a.p.timeout_ns) {
            report_status(a.status(), kStatusTimeout, site, seen, expected);
            return false;
        }
        __nanosleep(GC_MOE_SPIN_SLEEP_NS);
        seen = load();
        if (ready(seen)) {
            GC_ROLE2_MARK(role2_mark_wait(site, start));
            return true;
        }
    }
}

// The producer's wait for a free stage, with the operator's abort rule (consumers only stop after an error).
__device__ __forceinline__ bool op_wait_empty(const OpArgs& a, u32 bar, u32 parity) {
    if (mbar_try_wait(bar, parity)) return true;
    const u64 start = globaltimer_ns();
    while (!mbar_try_wait(bar, parity)) {
        if (a.aborted()) return false;
        if (globaltimer_ns() - start > a.p.timeout_ns) {
            report_status(a.status(), kStatusTimeout, kSiteEmpty, parity, bar);
            return false;
        }
    }
    return true;
}

// The consumers' wait for pipeline slot `slot` to fill. A producer that gives up stores the first slot it did not
// issue into `stop` (shared memory, initially ~0): every slot below it was issued and fills, none from it on ever
// does, so all 256 consumer threads leave at the same slot, before any warpgroup-collective instruction or named
// barrier of it. The 2x timeout is a backstop only (the producer's ring wait reports the site first).
__device__ __forceinline__ bool op_wait_full(const OpArgs& a, u32 bar, u32 parity, u32 slot, const volatile u32* stop) {
    if (mbar_try_wait(bar, parity)) return true;
    const u64 start = globaltimer_ns();
    while (!mbar_try_wait(bar, parity)) {
        if (*stop <= slot) return false;
        if (globaltimer_ns() - start > 2 * a.p.timeout_ns) {
            report_status(a.status(), kStatusTimeout, kSiteFull, parity, bar);
            return false;
        }
    }
    return true;
}

// The four tensor maps of a launch (W1 / W2 weights, the workspace's l1_acts / l2_acts) and the L2 policies of the
// weight and token loads.
struct OpMaps {
    const TensorMap *w1, *w2, *l1, *l2;
    u64 policy_w, policy_x;
};

// One task of the sequence: a W1 or W2 tile of pool block `block`.
struct OpTask {
    bool w1;
    int block, tile;
};

// Task `s` of the role2 sequence for n pool blocks, look-ahead w, t1 W1 / t2 W2 tasks per block (role2_gemm.cuh).
__device__ __forceinline__ OpTask role2_task(int s, int n, int w, int t1, int t2) {
    const int a = min(w, n);
    if (s < a * t1) return OpTask{true, s % a, s / a};
    s -= a * t1;
    const int paired = max(n - w, 0), seg = t1 + t2;
    if (s < paired * seg) {
        const int j = s / seg, r = s % seg;
        return r < t2 ? OpTask{false, j, r} : OpTask{true, j + w, r - t2};
    }
    s -= paired * seg;
    return OpTask{false, paired + s / t2, s % t2};
}

// The dynamic schedule (role2_schedule: [0] the next task of the sequence, [1] CTAs done). A CTA takes the next
// task when it is ready for one (its producer thread; consumer thread 0 in the non-pipelined variant), so CTAs that
// drew short W2 tasks (I/128 K steps) take more of them than CTAs in long W1 tasks (H/128): a static c, c + C, ...
// split gave some CTAs 1.1-1.7x the mean work wherever the sequence's period (t1 + t2 tasks per block) divides C.
__device__ __forceinline__ int op_take_task(const OpArgs& a) {
    return static_cast<int>(atomicAdd(a.at<unsigned long long>(a.off.role2_schedule), 1ull));
}

// A stage's task word when the pipelined producer has no task left (role2_gemm.cuh: the consumers leave at it).
constexpr u32 kNoTask = ~0u;

// Every thread that takes tasks, once it takes no more, and consumer thread 0 once its consumers have left the task
// loop: `per_cta` arrivals per CTA (2 with a producer warpgroup: its thread 0 and consumer thread 0, so a consumer
// that leaves at its wait's backstop, before the producer's last take, cannot reset the count under it; 1 without:
// consumer thread 0 takes). The arrival that completes the count stores 0 to both words (after an acquire fence: the
// takes before every other arrival precede the reset), the schedule the next launch starts from.
__device__ __forceinline__ void op_schedule_done(const OpArgs& a, unsigned per_cta) {
    unsigned long long* words = a.at<unsigned long long>(a.off.role2_schedule);
    __threadfence();
    if (atomicAdd(words + 1, 1ull) == static_cast<unsigned long long>(per_cta) * gridDim.x - 1) {
        __threadfence();
        atomicExch(words, 0ull);
        atomicExch(words + 1, 0ull);
    }
}

// The GEMM task of `ot` from the block table (ring rows: rewritten by role1 this replay, L2 loads).
__device__ __forceinline__ Task ring_task(const int* table, const OpTask& ot) {
    const int* row = table + 3 * ot.block;
    return Task{__ldcg(row), __ldcg(row + 1), __ldcg(row + 2), ot.tile};
}

// Thread 0: the pool blocks of this replay from pool_header = (1 << 32) | n (role1's release, gpu scope); 0 after a
// failed wait or a count beyond the pool_table rows (reported).
__device__ __forceinline__ u32 op_pool_blocks(const OpArgs& a) {
    const u64* header = a.at<const u64>(a.off.pool_header);
    u64 seen;
    if (!op_wait(a, [&] { return ld_acquire_gpu(header); }, [](u64 v) { return v >= (1ull << 32); }, 1ull << 32,
                 kSitePoolHeader, seen))
        return 0;
    const u32 n = static_cast<u32>(seen);
    if (n > a.off.pool_blocks) {
        report_status(a.status(), kStatusMismatch, kSitePoolSize, n, a.off.pool_blocks);
        return 0;
    }
    return n;
}

// The ring signal K step kb of task `ot` needs before its loads, acquired by the producer thread (then
// fence.proxy.async.global: the rows were written with generic stores, the TMA reads them through the async proxy):
// W1, first step: l1_full_count[b] >= BM * (g + 1); W2, step kb: bits 2kb, 2kb+1 of l2_full_mask[b] equal
// (g + 1) & 1 (a fresh acquire at the task's first step; `mask_seen` caches the last mask acquired for the task).
// False when the wait gave up.
__device__ __forceinline__ bool op_ring_acquire(const OpArgs& a, const OpTask& ot, int kb, u64& mask_seen) {
    const u32 ring = a.p.ring_blocks, b = static_cast<u32>(ot.block) % ring, g = static_cast<u32>(ot.block) / ring;
    if (ot.w1 && kb == 0) {
        const u32* full = a.at<u32>(a.off.l1_full_count) + b;
        const u64 target = static_cast<u64>(a.p.block_m) * (g + 1);
        u64 seen;
        if (!op_wait(a, [&] { return static_cast<u64>(ld_acquire_gpu_u32(full)); },
                     [&](u64 v) { return v >= target; }, target, kSiteL1Full, seen))
            return false;
        fence_proxy_async_global();
    } else if (!ot.w1) {
        const u64 need = 3ull << (2 * kb), want = ((g + 1) & 1) ? need : 0;
        if (kb == 0 || (mask_seen & need) != want) {
            const u64* mask = a.at<u64>(a.off.l2_full_mask) + b;
            if (!op_wait(a, [&] { return ld_acquire_gpu(mask); }, [&](u64 v) { return (v & need) == want; },
                         want, kSiteL2Mask, mask_seen))
                return false;
            fence_proxy_async_global();
        }
    }
    return true;
}

// After a W1 epilogue (all `threads` consumer threads, named barrier `barrier`): every thread's l2_acts / l2_acts_sf
// stores are ordered before the async proxy (the W2 producers' TMA), then consumer thread 0 toggles the task's two
// bits of l2_full_mask[b] and releases one l1_empty_count[b] (its l1_acts / scale / routing-weight reads are done).
__device__ __forceinline__ void op_release_w1(const OpArgs& a, u32 b, int tile, int local_tid, u32 barrier,
                                              u32 threads) {
    fence_proxy_async_global();
    named_barrier(barrier, threads);
    if (local_tid == 0) {
        __threadfence();
        red_release_gpu_xor_u64(a.at<u64>(a.off.l2_full_mask) + b, 3ull << (2 * tile));
        red_release_gpu_add_u32(a.at<u32>(a.off.l1_empty_count) + b, 1);
    }
}

// After a W2 epilogue's scatter (named barrier `barrier` over the `threads` consumer threads: the l1_source and
// l2_acts reads are done, the staged tile may be rewritten): consumer thread 0 releases one l2_empty_count[b].
__device__ __forceinline__ void op_release_w2(const OpArgs& a, u32 b, int local_tid, u32 barrier, u32 threads) {
    named_barrier(barrier, threads);
    if (local_tid == 0) {
        __threadfence();
        red_release_gpu_add_u32(a.at<u32>(a.off.l2_empty_count) + b, 1);
    }
}

}  // namespace sm90
}  // namespace gc_moe
