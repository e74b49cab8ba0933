// Role3 of the GC-MoE operator on SM90 (paper §4.6): one kernel, two halves running concurrently in one grid.
//
// Bookkeeping half (warps 0..3 of CTA 0): publish combine readiness to every rank, consume this replay's receive
// counts (arrival check, optional statistics), reset the per-replay state of the next replay, flip the parity.
// Combine half (every other warp): wait for every peer's readiness, then y[t] = BF16(sum over valid slots, in slot
// order, of the FP32-widened BF16 partials in this rank's combine buffer [k+S, Tmax, H]).
//
// Ordering chain (why no cross-rank barrier is needed between replays; n = replay_seq at kernel start):
//  * Partials complete. Rank r's role2 (and role4, slot k) store every partial of replay n before that kernel ends; the
//    graph runs role3 after role1 and role2 (and role4; role2's edge is programmatic: every thread of role3 first
//    waits in wait_prerequisites until role2 has completed and its stores are visible). Role3's bookkeeping then executes fence.sc.sys and stores
//    combine_ready[r] = n+1 with st.release.sys on every rank (at one rank fence.sc.gpu and st.release.gpu: no peer
//    reads it, the own rank's partials are ordered by the graph edges). A combine CTA of rank t acquires
//    (ld.acquire.sys) combine_ready[r] >= n+1 for every peer r != t, then bar.syncs its warps before they load: every
//    partial any peer scattered into t's combine buffer for replay n is visible. Rank t's own partials need no flag:
//    the graph edges order t's role2/role4 before this kernel.
//  * Readiness is phase-encoded and never reset: a peer cannot publish n+2 while this kernel runs (its role3 of n+1
//    follows its role1 of n+1, which cannot pass tag-1 barrier n+1 before this rank's role1 of n+1 arrives, after
//    this kernel), so the value seen is n or n+1; anything past n+1 is reported as a protocol mismatch.
//  * Receive counts. Peers' role1 of n wrote recv_counts[n&1] before arriving at tag-1 barrier n; this rank's role1
//    passed that barrier before this kernel (graph edge), so the counts are complete here: a check, not a wait.
//    A fast peer's role1 of n+1 may publish while this kernel runs, but into recv_counts[(n+1)&1], which this kernel
//    never touches. The reset of recv_counts[n&1] here precedes its next writer, peers' role1 of n+2: that runs
//    after the peer passed tag-1 barrier n+1, which needs this rank's role1 of n+1, which follows this kernel.
//  * The combine buffer is rewritten by peers' role2 of n+1 only after they pass tag-1 barrier n+1 (same argument),
//    i.e. after this kernel finished reading it.
//  * send_counts, pool_header, the ring signals, recv_parity, replay_seq and finalize_arrive are read and written
//    only by this rank's roles; stream order (next replay after this kernel) covers them.
//  * replay_seq is the readiness target every CTA reads at its start while this kernel advances it: each CTA reads
//    it, then arrives on finalize_arrive with an acq_rel atomic; the arrival completing the grid stores n+1 and
//    resets the counter. No CTA waits on another CTA (no co-residency or launch-order assumption).
//
// A failed check or wait writes role3's KernelStatus record (first error wins) and the kernel still completes:
// readiness is always published and the per-replay state always reset and advanced, so peers never hang on it.
#include <cuda_bf16.h>

#include "common/peer_table.cuh"
#include "common/status.cuh"
#include "common/sync.cuh"
#include "common/workspace_offsets.cuh"
#include "sm90/role3_finalize_params.cuh"

namespace gc_moe {

// The three by-value arguments, referenced in parameter space (__grid_constant__: no per-thread copy).
struct Args {
    const PeerTable& peers;
    const WorkspaceOffsets& off;
    const FinalizeParams& p;
};

constexpr u32 kThreads = 384;
constexpr u32 kWarps = kThreads / 32;
constexpr u32 kBookWarps = 4;                 // CTA 0's bookkeeping warps
constexpr u32 kBookThreads = kBookWarps * 32;
constexpr u32 kChunk = 256;                   // hidden elements per combine unit: 32 lanes x 8 BF16 (16 bytes)
constexpr u32 kBatch = 8;                     // slot loads in flight per lane
constexpr u32 kCombineBarrier = 1;            // named barrier of a CTA's combine warps (0 is __syncthreads)

// Status site of a check: kind << 16 | index (SiteKind: sm90/role3_finalize_params.cuh).
__device__ __forceinline__ u32 site(SiteKind kind, u32 index) { return (u32)kind << 16 | index; }

__device__ __forceinline__ u64 atom_add_acq_rel_gpu(u64* p, u64 v) {
    u64 old;
    asm volatile("atom.acq_rel.gpu.global.add.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
    return old;
}

__device__ __forceinline__ void bar_sync(u32 id, u32 threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// 16-byte load cached in L2 only: peers' NVLink stores land in this GPU's L2, never in a stale L1 line.
__device__ __forceinline__ uint4 ld_cg_v4(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// This rank's region at byte `offset`.
template <typename T>
__device__ __forceinline__ T* region(const Args& a, u64 offset) {
    return reinterpret_cast<T*>(a.peers.base + offset);
}

__device__ __forceinline__ KernelStatus* status_record(const Args& a) {
    return region<KernelStatus>(a, a.off.status) + kRole3Record;
}

template <typename T>
__device__ __forceinline__ void zero(T* ptr, u64 count, u32 tid, u32 threads) {
    for (u64 i = tid; i < count; i += threads) ptr[i] = 0;
}

// Bookkeeping half: tid in [0, kBookThreads) of CTA 0. `seq` = replay_seq and `parity` = recv_parity at entry.
__device__ void bookkeeping(const Args& a, u64 seq, u64 parity, u32 tid) {
    const u32 ranks = (u32)a.peers.world_size, own = (u32)a.peers.rank;
    KernelStatus* status = status_record(a);
    // 1. Readiness first (peers may be waiting): role2's stores precede this kernel; the system fence makes them
    //    visible to every GPU before the release store that announces them.
    //    At one rank the word is this GPU's alone: GPU scope.
    for (u32 r = tid; r < ranks; r += kBookThreads) {
        u64* ready = peer_ptr<u64>(a.peers, (int)r, a.off.combine_ready) + own;
        if (ranks > 1) {
            __threadfence_system();
            st_release_sys(ready, seq + 1);
        } else {
            __threadfence();
            st_release_gpu(ready, seq + 1);
        }
    }
    // 2. Consume recv_counts[parity]: arrival check, statistics, reset. Complete since role1 passed the tag-1 barrier.
    const u32 local = a.p.num_local_experts;
    u64* counts = region<u64>(a, a.off.recv_counts) + parity * ranks * local;
    int* stats = reinterpret_cast<int*>(a.p.recv_stats);
    const u64 arrivals = (u64)a.p.dispatch_sms * ranks;
    for (u32 le = tid; le < local; le += kBookThreads) {
        u64 high = 0, low = 0;
        for (u32 src = 0; src < ranks; ++src) {
            volatile u64* c = counts + (u64)src * local + le;
            const u64 v = *c;
            high += v >> 32;
            low += v & 0xffffffffull;
            *c = 0;
        }
        if (high != arrivals) report_status(status, kStatusMismatch, site(kSiteArrival, le), high, arrivals);
        if (stats != nullptr) stats[le] += (int)low;
    }
    // 3. Reset what the next replay's role1/role2 expect at zero (read and written only by this rank's roles).
    const u64 blocks = a.off.ring_blocks;
    zero(region<u64>(a, a.off.send_counts), a.p.num_experts, tid, kBookThreads);
    zero(region<u64>(a, a.off.pool_header), 1, tid, kBookThreads);
    zero(region<u32>(a, a.off.l1_full_count), blocks, tid, kBookThreads);
    zero(region<u32>(a, a.off.l1_empty_count), blocks, tid, kBookThreads);
    zero(region<u64>(a, a.off.l2_full_mask), blocks, tid, kBookThreads);
    zero(region<u32>(a, a.off.l2_empty_count), blocks, tid, kBookThreads);
    // 4. Flip the parity (read by thread 0 before the CTA's first barrier; no other reader in this kernel).
    if (tid == 0) *region<volatile u64>(a, a.off.recv_parity) = parity ^ 1;
}

// One warp waits until every peer's readiness equals `target` (bounded); returns the warp-uniform outcome.
__device__ bool wait_peers_ready(const Args& a, u64 target, u32 lane) {
    const u64* ready = region<const u64>(a, a.off.combine_ready);
    KernelStatus* status = status_record(a);
    const u64 start = globaltimer_ns();
    bool ok = true;
    for (u32 r = lane; ok && r < (u32)a.peers.world_size; r += 32) {
        if (r == (u32)a.peers.rank) continue;  // own partials are ordered by the graph edges
        u64 seen = ld_acquire_sys(ready + r);
        while (seen < target) {
            if (globaltimer_ns() - start > a.p.timeout_ns) {
                report_status(status, kStatusTimeout, site(kSiteReadyTimeout, r), seen, target);
                ok = false;
                break;
            }
            __nanosleep(GC_MOE_SPIN_SLEEP_NS);
            seen = ld_acquire_sys(ready + r);
        }
        if (ok && seen != target) {
            report_status(status, kStatusMismatch, site(kSiteReadyAhead, r), seen, target);
            ok = false;
        }
    }
    return __all_sync(0xffffffffu, ok);
}

__device__ __forceinline__ void accumulate(float (&acc)[8], const uint4& v) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        acc[2 * i] += __uint_as_float(w[i] << 16);
        acc[2 * i + 1] += __uint_as_float(w[i] & 0xffff0000u);
    }
}

__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const u32*>(&v);
}

// One combine unit: token t, hidden columns [c * kChunk, (c + 1) * kChunk); lane owns 8 columns.
__device__ __forceinline__ void combine_unit(const Args& a, u32 t, u32 c, u32 lane) {
    const u32 k = a.p.topk;
    bool valid = false;
    if (lane < k) {
        const u64 at = (u64)t * k + lane;
        const long long idx = a.p.idx_bytes == 8 ? region<const long long>(a, a.off.topk_idx)[at]
                                                  : (long long)region<const int>(a, a.off.topk_idx)[at];
        // role1 dropped ids outside [-1, E) and entries with a non-finite weight (its expert_of): no partial
        valid = idx >= 0 && idx < a.p.num_experts && isfinite(region<const float>(a, a.off.topk_weights)[at]);
    }
    u32 slots = __ballot_sync(0xffffffffu, valid);
    if (a.p.num_shared) slots |= 1u << k;

    const u64 column = (u64)c * kChunk + lane * 8;
    const u64 slot_stride = (u64)a.off.capacity * a.p.hidden / 8;  // in uint4
    const uint4* src = region<const uint4>(a, a.off.combine) + ((u64)t * a.p.hidden + column) / 8;
    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
    while (slots) {  // warp-uniform
        uint4 v[kBatch];
        u32 n = 0;
#pragma unroll
        for (u32 j = 0; j < kBatch; ++j) {
            v[j] = make_uint4(0, 0, 0, 0);
            if (slots) {
                const u32 s = __ffs(slots) - 1;
                slots &= slots - 1;
                v[j] = ld_cg_v4(src + s * slot_stride);
                n = j + 1;
            }
        }
#pragma unroll
        for (u32 j = 0; j < kBatch; ++j) {
            if (j < n) accumulate(acc, v[j]);  // slot order: ascending s, one FP32 add per slot
        }
    }
    uint4 out;
    out.x = pack_bf16x2(acc[0], acc[1]);
    out.y = pack_bf16x2(acc[2], acc[3]);
    out.z = pack_bf16x2(acc[4], acc[5]);
    out.w = pack_bf16x2(acc[6], acc[7]);
    reinterpret_cast<uint4*>(a.p.y)[((u64)t * a.p.hidden + column) / 8] = out;
}

// Combine half: combine warp `cw` of `num_cw` takes units cw, cw + num_cw, ... (unit = token x chunk).
__device__ void combine(const Args& a, u64 seq, u32 warp, u32 lane) {
    const u32 chunks = a.p.hidden / kChunk;
    const u64 units = (u64)a.p.num_tokens * chunks;
    const u32 first_warp = blockIdx.x == 0 ? kBookWarps : 0;     // this CTA's first combine warp
    const u64 cta_first = (u64)blockIdx.x * kWarps - (blockIdx.x == 0 ? 0 : kBookWarps);
    if (cta_first >= units) return;                              // CTA-uniform: no work, no wait
    __shared__ int ready;
    if (warp == first_warp) {
        const bool ok = wait_peers_ready(a, seq + 1, lane);
        if (lane == 0) ready = ok;
    }
    bar_sync(kCombineBarrier, (kWarps - first_warp) * 32);       // orders the acquire before every warp's loads
    if (!ready) return;
    const u64 num_cw = (u64)gridDim.x * kWarps - kBookWarps;
    for (u64 u = cta_first + (warp - first_warp); u < units; u += num_cw) {
        combine_unit(a, (u32)(u / chunks), (u32)(u % chunks), lane);
    }
}

}  // namespace gc_moe

using gc_moe::FinalizeParams;
using gc_moe::PeerTable;
using gc_moe::WorkspaceOffsets;

// Two CTAs fit an SM (at most 85 registers a thread): the host's grid is up to twice the compute SMs
// (role3_finalize.finalize_grid), so each warp sums fewer units one after another.
extern "C" __global__ void __launch_bounds__(gc_moe::kThreads, 2)
    gc_sm90_finalize(const __grid_constant__ PeerTable peers, const __grid_constant__ WorkspaceOffsets off,
                     const __grid_constant__ FinalizeParams p) {
    using namespace gc_moe;
    // behind role2's programmatic edge (operator/sm90/layer.py) this grid may start while role2 runs: nothing below
    // reads the workspace before role2 has completed and its stores are visible
    wait_prerequisites();
    if (p.flags & kFlagWarmup) return;
    const Args a{peers, off, p};
    __shared__ u64 s_seq, s_parity;
    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (threadIdx.x == 0) {
        u64* replay_seq = region<u64>(a, off.replay_seq);
        const u64 seq = *reinterpret_cast<volatile u64*>(replay_seq);
        s_seq = seq;
        if (blockIdx.x == 0) s_parity = *region<volatile u64>(a, off.recv_parity) & 1;
        // The acq_rel arrival orders this CTA's read of replay_seq before the advance by the completing arrival.
        u64* arrive = region<u64>(a, off.finalize_arrive);
        if (atom_add_acq_rel_gpu(arrive, 1) == gridDim.x - 1) {
            *reinterpret_cast<volatile u64*>(arrive) = 0;
            *reinterpret_cast<volatile u64*>(replay_seq) = seq + 1;
        }
    }
    __syncthreads();
    if (blockIdx.x == 0 && warp < kBookWarps) {
        bookkeeping(a, s_seq, s_parity, threadIdx.x);
        return;
    }
    combine(a, s_seq, warp, lane);
}
