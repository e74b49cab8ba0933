// Role1 of the GC-MoE operator on SM90: the dispatch kernel of the communication partition (paper §4.1-4.3).
//
// One CTA of 512 threads per dispatch SM; every rank launches the same grid size D. Per replay n:
//   A. Routing entries (this rank's topk_idx, flat index f = token*k + slot, -1 slots skipped; ids outside [-1, E)
//      skipped too and reported as dropped inputs). CTA c owns the contiguous range [c*ceil(Tk/D), ...) of f. Its
//      shared-memory histogram of the entries BEFORE its range gives, per global expert, the position of its first
//      entry in that expert's list (a redundant prefix count: no cross-CTA communication). It then walks its range in
//      chunks of 512 entries in f order: __match_any_sync gives each entry its rank among equal experts of its warp,
//      and the warps take their per-expert cursors in warp order (one __syncthreads per warp), so positions grow with
//      f. Entry f goes to the target rank's src_index[le][own][pos] (a peer store): every (le, own) list is ascending,
//      i.e. sorted by (token, slot), the order of reference.dispatch_plan, independent of D and of timing.
//   B. After a system fence (GPU scope at one rank: every reader is a kernel of this GPU) every CTA adds
//      (1 << 32) | count to the local send_counts of EVERY global expert (also count 0): the high word counts
//      contributing CTAs. That is also the grid barrier: block 0 waits (bounded,
//      acquire) until every send_counts high word is D, so all src_index stores of all CTAs are ordered before it.
//      It needs no extra persistent state: role3 resets send_counts between replays.
//   C. Block 0 stores send_counts[dst*e + le] into rank dst's recv_counts[parity][own][le] and, after a system
//      fence, adds 1 to every rank's tag1_barrier (release, system scope; at one rank both at GPU scope, and the
//      wait below acquires at GPU scope). Every CTA then waits (bounded) until its
//      own tag1_barrier >= P*(n+1): every rank's counts and src_index entries for this replay are visible.
//   D. Every CTA reads recv_counts[parity] ([P, e] packed words), checks the arrival (high words sum to D*P per
//      local expert) and scans them into exclusive prefixes: rows per (le, src), rows and pool blocks per le.
//      Block 0 writes pool_table (local expert, valid rows, ring row offset) and releases
//      pool_header = (1 << 32) | pool blocks (gpu scope: role2 runs on the same GPU).
//   E. Pull: received rows j (local-expert order, then src_rank, then src_index position: dispatch_plan order) go
//      round-robin to the 16*D warps, each warp in increasing j. Row j of expert le is row i of le's list, pool
//      block p = first block of le + i/BM, ring block b = p mod R, generation g = p div R, ring row b*BM + i%BM.
//      Before the first row of a block with g >= 1 the warp waits for l1_empty_count[b] >= t1*g and
//      l2_empty_count[b] >= t2*g (ring.RingPlan.refill_waits). It copies the FP8 row (16-byte non-coherent vector
//      loads through the peer pointer), the FP32 1x128 scales into the transposed l1_acts_sf, the routing weight
//      and l1_source = (src_rank, src_token, slot, p); then a generic->async proxy fence (role2 reads the ring with
//      TMA), __syncwarp and one release add (gpu scope) of 1 to l1_full_count[b], plus the padding BM - valid for
//      the block's last valid row, so generation g completes at exactly BM*(g+1). Padding rows are not written.
//      A warp only waits on a block after finishing all its smaller rows, so the smallest blocked row always has
//      every earlier row landed: no deadlock beyond what the ring capacity rules out (ring.py).
// One rank, T*k <= 512 (one routing entry per thread): every CTA ranks all entries itself (A with the whole range),
// so no CTA waits on another: B's arrival wait, C's tag-1 barrier and D's read of recv_counts are skipped, the
// received rows' entries stay in each CTA's shared memory. Block 0 still stores what the staged protocol leaves for
// role3 and the checks (src_index, send_counts and recv_counts[parity] as the grid's adds would have made them, the
// tag-1 phase: its add finds P*n there, else the replay is out of phase and reported at the tag-1 site, without the
// staged path's wait), publishes the block table as in D, and E pulls the same rows from the same entries.
// Every wait is bounded by DispatchParams.timeout_ns and ends in role1's status record (status region, record 0);
// waits also give up as soon as that record holds an error, so a failure ends the whole grid within one timeout.
#include "common/dropped.cuh"
#include "common/peer_table.cuh"
#include "common/status.cuh"
#include "common/sync.cuh"
#include "sm90/role1_dispatch_params.cuh"

#ifdef GC_ROLE1_MARKS
// The marked variant's record (bench/layer_marks_sm90.py points it at a device buffer; nothing is recorded while it
// is null). Outside the namespace, so that the cubin names it plainly (cuLibraryGetGlobal looks it up by name).
__device__ unsigned long long* gc_role1_marks;
#define GC_ROLE1_MARK(...) __VA_ARGS__
#else
// The production build: no global, no marks (the statements inside GC_ROLE1_MARK are not compiled).
#define GC_ROLE1_MARK(...)
#endif

namespace {

using gc_moe::DispatchParams;
using gc_moe::KernelStatus;
using gc_moe::PeerTable;
using gc_moe::u32;
using gc_moe::u64;
using gc_moe::WorkspaceOffsets;
using gc_moe::ld_acquire_gpu_u32;
using gc_moe::red_release_gpu_add_u32;

constexpr u32 kThreads = 512;
constexpr u32 kWarps = kThreads / 32;
constexpr u32 kMaxExperts = 2048;          // gc_moe_compat.config.MAX_EXPERTS (E <= 2048)
constexpr u32 kMaxLocal = kThreads;        // config: e <= 512, one scan thread per local expert
constexpr u32 kCopyUnroll = 8;             // 16-byte vectors in flight per lane
constexpr u32 kScratch = 2 * kMaxExperts;  // phase A: two histograms; phase D: [e][P+1] prefixes (E + e words)

#ifdef GC_ROLE1_MARKS
// Where one replay's role1 time goes per warp, in the variant bench/layer_marks_sm90.py builds (GC_ROLE1_MARKS
// defined): u64 words gc_role1_marks[(CTA * kWarps + warp) * kRole1MarkFields + field], written by the warp's lane 0
// only: %globaltimer nanoseconds for the times, a sum and counts for the rest. The refill waits are E's waits on a
// ring block's two empty counts before its first row of generation >= 1, timed whether or not they spun.
enum Role1Mark : u32 {
    kMarkEntry = 0,         // the kernel's start (after the warm-up return)
    kMarkPullStart = 1,     // E begins (the block table is published, this CTA's prefixes are known)
    kMarkFirstRow = 2,      // the warp's first row released into the ring
    kMarkRefillWaitNs = 3,  // E's refill waits, summed
    kMarkRefills = 4,       // how many refill waits
    kMarkRows = 5,          // rows the warp pulled
    kMarkExit = 6,          // E done
};
constexpr u32 kRole1MarkFields = 7;
constexpr u32 kRole1MarkWarps = 4096;  // warps recorded (256 CTAs of 16)

// This warp's record (null while the global is null or past the recorded warps).
__device__ __forceinline__ u64* role1_marks() {
    u64* marks = reinterpret_cast<u64*>(::gc_role1_marks);
    const u32 w = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    return marks != nullptr && w < kRole1MarkWarps ? marks + static_cast<u64>(w) * kRole1MarkFields : nullptr;
}

// Lane 0 stores the time into `field`.
__device__ __forceinline__ void role1_mark_time(u32 field) {
    if (threadIdx.x % 32 != 0) return;
    if (u64* m = role1_marks()) m[field] = gc_moe::globaltimer_ns();
}

// Lane 0 only: adds `value` to `field`.
__device__ __forceinline__ void role1_mark_add(u32 field, u64 value) {
    if (u64* m = role1_marks()) m[field] += value;
}

// Lane 0 only: one more row released (the first one's time kept).
__device__ __forceinline__ void role1_mark_row() {
    if (u64* m = role1_marks()) {
        if (m[kMarkRows] == 0) m[kMarkFirstRow] = gc_moe::globaltimer_ns();
        m[kMarkRows] += 1;
    }
}
#endif

__device__ __forceinline__ void red_release_sys_add_u64(u64* p, u64 v) {
    asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void red_release_gpu_add_u64(u64* p, u64 v) {
    asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void st_release_gpu_u64(u64* p, u64 v) { gc_moe::st_release_gpu(p, v); }

// Read-only data of another kernel or rank, unchanged while this kernel runs: non-coherent path, no L1 allocation.
__device__ __forceinline__ uint4 ld_nc_v4(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ u32 ld_nc_u32(const u32* p) {
    u32 v;
    asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ u64 ld_volatile_u64(const u64* p) { return *reinterpret_cast<const volatile u64*>(p); }

// Orders this thread's generic-proxy ring stores before later async-proxy (TMA) reads of them by role2.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

__device__ __forceinline__ bool has_error(const KernelStatus* status) {
    return *reinterpret_cast<const volatile u32*>(&status->code) != gc_moe::kStatusOk;
}

// Bounded spin until load() >= target. Gives up (false) on timeout, recording `site`, or at once when the status
// record already holds an error (another wait of this kernel failed).
template <typename T, typename Load>
__device__ __forceinline__ bool wait_ge(Load load, T target, u64 timeout_ns, KernelStatus* status, u32 site) {
    const u64 start = gc_moe::globaltimer_ns();
    T seen = load();
    while (seen < target) {
        if (has_error(status)) return false;
        if (gc_moe::globaltimer_ns() - start > timeout_ns) {
            gc_moe::report_status(status, gc_moe::kStatusTimeout, site, seen, target);
            return false;
        }
        __nanosleep(GC_MOE_SPIN_SLEEP_NS);
        seen = load();
    }
    return true;
}

// Largest index i in [0, n) with prefix[i] <= v (prefix non-decreasing, prefix[0] <= v).
__device__ __forceinline__ u32 last_at_most(const u32* prefix, u32 n, u32 v) {
    u32 lo = 0, hi = n;
    while (hi - lo > 1) {
        const u32 mid = (lo + hi) / 2;
        if (prefix[mid] <= v) lo = mid; else hi = mid;
    }
    return lo;
}

// Global expert of routing entry f, or -1 for an unused slot. An id outside [-1, E), or a valid id whose routing
// weight is not finite, is skipped like an unused slot and reported in the device's record of dropped inputs
// (common/dropped.cuh), not in role1's status record: the protocol goes on (every CTA skips the same entries, so
// counts stay consistent) and no wait gives up. role3 applies the same rule to the same local entries.
__device__ __forceinline__ int expert_of(const void* idx, const float* weights, u32 idx_bytes, u32 f,
                                         const DispatchParams& p) {
    const long long x = idx_bytes == 8 ? static_cast<const long long*>(idx)[f] : static_cast<const int*>(idx)[f];
    if (x == -1) return -1;
    if (x < -1 || x >= p.num_experts) {
        gc_moe::report_dropped(p.dropped, p.dropped_mirror, gc_moe::kDroppedRole1Expert,
                               static_cast<unsigned long long>(x), p.num_experts);
        return -1;
    }
    const float w = weights[f];
    if (!isfinite(w)) {
        gc_moe::report_dropped(p.dropped, p.dropped_mirror, gc_moe::kDroppedRole1Weight, __float_as_uint(w), f);
        return -1;
    }
    return static_cast<int>(x);
}

// Exclusive block-wide prefix sum of one value per thread; *total receives the sum of all values.
__device__ __forceinline__ u64 block_exclusive_scan(u64 v, u64* s_warp, u64* total) {
    const u32 lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    u64 inc = v;
#pragma unroll
    for (u32 d = 1; d < 32; d *= 2) {
        const u64 t = __shfl_up_sync(~0u, inc, d);
        if (lane >= d) inc += t;
    }
    if (lane == 31) s_warp[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        u64 w = lane < kWarps ? s_warp[lane] : 0;
#pragma unroll
        for (u32 d = 1; d < 32; d *= 2) {
            const u64 t = __shfl_up_sync(~0u, w, d);
            if (lane >= d) w += t;
        }
        if (lane < kWarps) s_warp[lane] = w;
    }
    __syncthreads();
    *total = s_warp[kWarps - 1];
    const u64 out = inc - v + (warp ? s_warp[warp - 1] : 0);
    __syncthreads();  // s_warp is reused by the caller's next scan
    return out;
}

// The position of this thread's entry (expert x, -1 for none) among the entries of x: the entries of earlier warps
// of this chunk, then earlier lanes of this warp, after s_cursor[x]; advances s_cursor. Every thread of the CTA
// calls it (one __syncthreads per warp): the warps take their cursors in f order.
__device__ __forceinline__ u32 rank_in_chunk(int x, u32* s_cursor, u32 warp, u32 lane) {
    const u32 same = __match_any_sync(~0u, x);
    const u32 leader = __ffs(same) - 1;
    u32 first = 0;
    for (u32 w = 0; w < kWarps; ++w) {
        if (warp == w && x >= 0 && lane == leader) {
            first = s_cursor[x];
            s_cursor[x] = first + __popc(same);
        }
        __syncthreads();
    }
    return __shfl_sync(~0u, first, leader) + __popc(same & ((1u << lane) - 1));
}

// D's scan: from each local expert's received rows (rows_le, thread tid < local_e), the exclusive prefixes of rows
// and pool blocks into s_rows / s_blocks [local_e + 1]. True where the pool blocks exceed the workspace's (reported).
__device__ __forceinline__ bool scan_rows(u32 rows_le, u32 local_e, u32 bm, u32 pool_blocks, u32* s_rows,
                                          u32* s_blocks, u64* s_warp, KernelStatus* status) {
    const u32 tid = threadIdx.x;
    u64 total_rows, total_blocks;
    const u32 row0 = static_cast<u32>(block_exclusive_scan(rows_le, s_warp, &total_rows));
    const u32 block0 = static_cast<u32>(block_exclusive_scan((rows_le + bm - 1) / bm, s_warp, &total_blocks));
    bool bad = false;
    if (tid < local_e) {
        s_rows[tid] = row0;
        s_blocks[tid] = block0;
    }
    if (tid == 0) {
        s_rows[local_e] = static_cast<u32>(total_rows);
        s_blocks[local_e] = static_cast<u32>(total_blocks);
        if (total_blocks > pool_blocks) {
            bad = true;
            gc_moe::report_status(status, gc_moe::kStatusMismatch, gc_moe::kSitePoolOverflow, total_blocks,
                                  pool_blocks);
        }
    }
    return bad;
}

// D's block table (block 0): pool_table rows (local expert, valid rows, ring row offset), then the release of
// pool_header = (1 << 32) | blocks (gpu scope: role2 runs on the same GPU).
__device__ __forceinline__ void publish_pool_table(unsigned char* base, const WorkspaceOffsets& off, const u32* s_rows,
                                                   const u32* s_blocks, u32 local_e, u32 bm, u32 ring) {
    const u32 tid = threadIdx.x, n_blocks = s_blocks[local_e];
    int* table = reinterpret_cast<int*>(base + off.pool_table);
    for (u32 q = tid; q < n_blocks; q += kThreads) {
        const u32 le = last_at_most(s_blocks, local_e, q);
        const u32 done = (q - s_blocks[le]) * bm;
        table[3 * q + 0] = static_cast<int>(le);
        table[3 * q + 1] = static_cast<int>(min(bm, s_rows[le + 1] - s_rows[le] - done));
        table[3 * q + 2] = static_cast<int>((q % ring) * bm);
    }
    __syncthreads();
    if (tid == 0) {
        __threadfence();
        st_release_gpu_u64(reinterpret_cast<u64*>(base + off.pool_header), (1ull << 32) | n_blocks);
    }
}

// E: pulls the received rows into the ring. entry_of(le, i, j) gives row j's (i-th of local expert le) source rank
// and routing entry token*k + slot.
template <typename EntryOf>
__device__ __forceinline__ void pull_rows(const PeerTable& peers, const WorkspaceOffsets& off, const DispatchParams& p,
                                          unsigned char* base, const u32* s_rows, const u32* s_blocks, u32 local_e,
                                          KernelStatus* status, EntryOf entry_of) {
    const u32 lane = threadIdx.x % 32, warp = threadIdx.x / 32, cta = blockIdx.x, grid = gridDim.x;
    const u32 k = p.topk, bm = p.block_m, ring = p.ring_blocks, n_rows = s_rows[local_e];
    unsigned char* acts = base + off.l1_acts;
    float* acts_sf = reinterpret_cast<float*>(base + off.l1_acts_sf);
    float* weights = reinterpret_cast<float*>(base + off.l1_routing_weights);
    int4* source = reinterpret_cast<int4*>(base + off.l1_source);
    u32* full = reinterpret_cast<u32*>(base + off.l1_full_count);
    const u32* empty1 = reinterpret_cast<const u32*>(base + off.l1_empty_count);
    const u32* empty2 = reinterpret_cast<const u32*>(base + off.l2_empty_count);
    const u32 hidden = p.hidden, vectors = hidden / 16, groups = hidden / 128;
    u32 ready = ~0u;  // the pool block whose refill condition this warp last established
    for (u32 j = warp * grid + cta; j < n_rows; j += kWarps * grid) {
        const u32 le = last_at_most(s_rows, local_e, j);
        const u32 i = j - s_rows[le], n_le = s_rows[le + 1] - s_rows[le];
        const u32 q = s_blocks[le] + i / bm, b = q % ring, gen = q / ring, r = i % bm;
        const u32 valid = min(bm, n_le - (i / bm) * bm);
        const u32 row = b * bm + r;
        if (q != ready) {
            int ok = 1;
            if (gen > 0 && lane == 0) {
                GC_ROLE1_MARK(const u64 waited_from = gc_moe::globaltimer_ns());
                ok = wait_ge<u32>([&] { return ld_acquire_gpu_u32(empty1 + b); }, p.w1_tasks * gen, p.timeout_ns,
                                  status, gc_moe::kSiteRefillL1) &&
                     wait_ge<u32>([&] { return ld_acquire_gpu_u32(empty2 + b); }, p.w2_tasks * gen, p.timeout_ns,
                                  status, gc_moe::kSiteRefillL2);
                GC_ROLE1_MARK(role1_mark_add(kMarkRefillWaitNs, gc_moe::globaltimer_ns() - waited_from);
                              role1_mark_add(kMarkRefills, 1));
            }
            if (!__shfl_sync(~0u, ok, 0)) return;
            ready = q;
        }
        const uint2 from_entry = entry_of(le, i, j);  // (source rank, token*k + slot)
        const u32 src = from_entry.x, token = from_entry.y / k, slot = from_entry.y % k;
        const unsigned char* peer = gc_moe::peer_ptr<unsigned char>(peers, static_cast<int>(src), 0);
        const uint4* from = reinterpret_cast<const uint4*>(peer + off.x + static_cast<size_t>(token) * hidden);
        uint4* to = reinterpret_cast<uint4*>(acts + static_cast<size_t>(row) * hidden);
        for (u32 v0 = lane; v0 < vectors; v0 += 32 * kCopyUnroll) {
            uint4 buf[kCopyUnroll];
#pragma unroll
            for (u32 u = 0; u < kCopyUnroll; ++u) {
                if (v0 + 32 * u < vectors) buf[u] = ld_nc_v4(from + v0 + 32 * u);
            }
#pragma unroll
            for (u32 u = 0; u < kCopyUnroll; ++u) {
                if (v0 + 32 * u < vectors) to[v0 + 32 * u] = buf[u];
            }
        }
        const u32* sf = reinterpret_cast<const u32*>(peer + off.x_sf) + static_cast<size_t>(token) * groups;
        for (u32 g = lane; g < groups; g += 32) {
            reinterpret_cast<u32*>(acts_sf)[static_cast<size_t>(g) * off.ring_rows + row] = ld_nc_u32(sf + g);
        }
        if (lane == 0) {
            const u32* w = reinterpret_cast<const u32*>(peer + off.topk_weights);
            reinterpret_cast<u32*>(weights)[row] = ld_nc_u32(w + static_cast<size_t>(token) * k + slot);
            source[row] = make_int4(static_cast<int>(src), static_cast<int>(token), static_cast<int>(slot),
                                    static_cast<int>(q));
        }
        fence_proxy_async_global();
        __syncwarp();
        if (lane == 0) red_release_gpu_add_u32(full + b, r == valid - 1 ? 1 + bm - valid : 1);
        GC_ROLE1_MARK(if (lane == 0) role1_mark_row());
    }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(kThreads, 1)
    gc_sm90_dispatch(const PeerTable peers, const WorkspaceOffsets off, const DispatchParams p) {
    // role2, where a programmatic edge follows this grid (the roles in sequence on a GPU this rank has alone:
    // operator/sm90/layer.py), starts now and waits on the ring signals as it does beside role1 when partitioned
    gc_moe::launch_dependents();
    if (p.flags & gc_moe::kDispatchWarmup) return;
    GC_ROLE1_MARK(role1_mark_time(kMarkEntry));
    __shared__ u32 s_scratch[kScratch];
    __shared__ u32 s_rows[kMaxLocal + 1];    // exclusive prefix of received rows per local expert
    __shared__ u32 s_blocks[kMaxLocal + 1];  // exclusive prefix of pool blocks per local expert
    __shared__ u64 s_warp[kWarps];
    __shared__ int s_flag;

    const u32 tid = threadIdx.x, lane = tid % 32, warp = tid / 32, cta = blockIdx.x, grid = gridDim.x;
    const int own = peers.rank;
    const u32 ranks = static_cast<u32>(peers.world_size);
    const u32 num_e = p.num_experts, local_e = p.local_experts, k = p.topk, cap = off.capacity;
    unsigned char* base = reinterpret_cast<unsigned char*>(peers.base);
    KernelStatus* status = reinterpret_cast<KernelStatus*>(base + off.status) + gc_moe::kRole1Record;
    const u64 replay = ld_volatile_u64(reinterpret_cast<const u64*>(base + off.replay_seq));
    const u32 parity = static_cast<u32>(ld_volatile_u64(reinterpret_cast<const u64*>(base + off.recv_parity)) & 1);

    const void* idx = base + off.topk_idx;
    const float* topk_w = reinterpret_cast<const float*>(base + off.topk_weights);
    const u32 entries = p.num_tokens * k;
    const u32 bm = p.block_m, ring = p.ring_blocks;
    int* src_index = reinterpret_cast<int*>(base + off.src_index);

    // ---- One rank, one entry per thread: A over every entry in every CTA, no wait on another CTA (header)
    if (ranks == 1 && entries <= kThreads && num_e == local_e) {  // one rank: every expert local (e <= 512)
        u32* s_cursor = s_scratch;              // [num_e] entries of each expert so far
        u32* s_entry = s_scratch + kMaxLocal;   // [entries] the routing entry of each received row, in row order
        for (u32 x = tid; x < num_e; x += kThreads) s_cursor[x] = 0;
        __syncthreads();
        const int x = tid < entries ? expert_of(idx, topk_w, p.idx_bytes, tid, p) : -1;
        const u32 pos = rank_in_chunk(x, s_cursor, warp, lane);
        const bool bad = __syncthreads_or(scan_rows(tid < local_e ? s_cursor[tid] : 0, local_e, bm, off.pool_blocks,
                                                    s_rows, s_blocks, s_warp, status));
        if (x >= 0) s_entry[s_rows[x] + pos] = tid;
        if (cta == 0) {  // what B, C and the grid's adds leave behind (role3 checks and consumes recv_counts)
            if (x >= 0) {
                if (pos < cap) {
                    src_index[static_cast<size_t>(x) * cap + pos] = static_cast<int>(tid);
                } else {
                    gc_moe::report_status(status, gc_moe::kStatusMismatch, gc_moe::kSiteSrcIndexOverflow, pos, cap);
                }
            }
            u64* send = reinterpret_cast<u64*>(base + off.send_counts);
            u64* recv = reinterpret_cast<u64*>(base + off.recv_counts) + static_cast<size_t>(parity) * local_e;
            for (u32 e = tid; e < num_e; e += kThreads) {
                const u64 packed = (static_cast<u64>(grid) << 32) | s_cursor[e];
                send[e] = packed;
                recv[e] = packed;
            }
            // the phase is checked, not waited for: this replay's arrival is the only one (a tag-1 phase ahead of
            // replay_seq, which the staged wait would pass, is refused here too: no path leaves it behind)
            if (tid == 0) {
                const u64 before = atomicAdd(reinterpret_cast<unsigned long long*>(base + off.tag1_barrier), 1ull);
                s_flag = before == replay;
                if (!s_flag) {
                    gc_moe::report_status(status, gc_moe::kStatusMismatch, gc_moe::kSiteTag1, before, replay);
                }
            }
        }
        if (bad) return;
        __syncthreads();  // every s_entry store; block 0: s_flag
        // no block table for a replay out of phase (role2's wait gives up; the other CTAs still pull their rows)
        if (cta == 0 && !s_flag) return;
        if (cta == 0) publish_pool_table(base, off, s_rows, s_blocks, local_e, bm, ring);
        GC_ROLE1_MARK(role1_mark_time(kMarkPullStart));
        pull_rows(peers, off, p, base, s_rows, s_blocks, local_e, status,
                  [&](u32, u32, u32 j) { return make_uint2(0, s_entry[j]); });
        GC_ROLE1_MARK(role1_mark_time(kMarkExit));
        return;
    }

    // ---- A. per-expert positions of this CTA's entries, src_index peer stores (ascending per list)
    u32* s_first = s_scratch;                 // entries before this CTA's range, per global expert
    u32* s_cursor = s_scratch + kMaxExperts;  // next position per global expert
    for (u32 x = tid; x < num_e; x += kThreads) s_first[x] = 0;
    __syncthreads();
    const u32 span = (entries + grid - 1) / grid;
    const u32 begin = min(cta * span, entries), end = min(begin + span, entries);
    for (u32 f = tid; f < begin; f += kThreads) {
        const int x = expert_of(idx, topk_w, p.idx_bytes, f, p);
        if (x >= 0) atomicAdd(&s_first[x], 1u);
    }
    __syncthreads();
    for (u32 x = tid; x < num_e; x += kThreads) s_cursor[x] = s_first[x];
    __syncthreads();
    for (u32 chunk = begin; chunk < end; chunk += kThreads) {
        const u32 f = chunk + tid;
        const int x = f < end ? expert_of(idx, topk_w, p.idx_bytes, f, p) : -1;
        const u32 pos = rank_in_chunk(x, s_cursor, warp, lane);
        if (x >= 0) {
            const u32 dst = x / local_e, le = x % local_e;
            if (pos < cap) {
                int* list = gc_moe::peer_ptr<int>(peers, dst, off.src_index);
                list[(static_cast<size_t>(le) * ranks + own) * cap + pos] = static_cast<int>(f);
            } else {
                gc_moe::report_status(status, gc_moe::kStatusMismatch, gc_moe::kSiteSrcIndexOverflow, pos, cap);
            }
        }
    }

    // ---- B. packed send counts: token count + one contributor per CTA, for every expert; also the grid barrier
    __syncthreads();
    // every src_index store of this CTA (ordered by the barrier) before the adds: at system scope where peers read
    // them, at GPU scope at one rank (every reader is a kernel of this GPU)
    if (ranks > 1) __threadfence_system();
    else __threadfence();
    u64* send = reinterpret_cast<u64*>(base + off.send_counts);
    for (u32 x = tid; x < num_e; x += kThreads) atomicAdd(send + x, (1ull << 32) | (s_cursor[x] - s_first[x]));

    // ---- C. block 0: counts to every peer, then the tag-1 arrival on every rank
    if (cta == 0) {
        bool ok = true;
        for (u32 x = tid; x < num_e && ok; x += kThreads) {
            ok = wait_ge<u64>([&] { return gc_moe::ld_acquire_gpu(send + x); }, static_cast<u64>(grid) << 32,
                              p.timeout_ns, status, gc_moe::kSiteGridArrival);
        }
        if (__syncthreads_and(ok)) {
            for (u32 i = tid; i < num_e; i += kThreads) {
                const u32 dst = i / local_e, le = i % local_e;
                u64* counts = gc_moe::peer_ptr<u64>(peers, dst, off.recv_counts);
                counts[(static_cast<size_t>(parity) * ranks + own) * local_e + le] = ld_volatile_u64(send + i);
            }
            __syncthreads();
            if (tid < ranks) {
                u64* tag1 = gc_moe::peer_ptr<u64>(peers, tid, off.tag1_barrier);
                if (ranks > 1) {
                    __threadfence_system();
                    red_release_sys_add_u64(tag1, 1);
                } else {
                    __threadfence();
                    red_release_gpu_add_u64(tag1, 1);
                }
            }
        }
    }
    if (tid == 0) {
        const u64* tag1 = reinterpret_cast<const u64*>(base + off.tag1_barrier);
        s_flag = wait_ge<u64>([&] { return ranks > 1 ? gc_moe::ld_acquire_sys(tag1) : gc_moe::ld_acquire_gpu(tag1); },
                              static_cast<u64>(ranks) * (replay + 1),
                              p.timeout_ns, status, gc_moe::kSiteTag1);
    }
    __syncthreads();
    if (!s_flag) return;

    // ---- D. receive counts -> prefixes; block 0 publishes the block table
    const u32 stride = ranks + 1;  // s_src[le * stride + src]: first row of (src, le) inside le's list
    u32* s_src = s_scratch;
    const u64* recv = reinterpret_cast<const u64*>(base + off.recv_counts) + static_cast<size_t>(parity) * ranks *
                                                                               local_e;
    u32 rows_le = 0;
    bool bad = false;
    if (tid < local_e) {
        u64 arrivals = 0;
        for (u32 src = 0; src < ranks; ++src) {
            const u64 v = ld_volatile_u64(recv + static_cast<size_t>(src) * local_e + tid);
            s_src[tid * stride + src] = rows_le;
            rows_le += static_cast<u32>(v);
            arrivals += v >> 32;
        }
        s_src[tid * stride + ranks] = rows_le;
        if (arrivals != static_cast<u64>(grid) * ranks) {
            bad = true;
            gc_moe::report_status(status, gc_moe::kStatusMismatch, gc_moe::kSiteArrivalCheck, arrivals,
                                  static_cast<u64>(grid) * ranks);
        }
    }
    bad |= scan_rows(rows_le, local_e, bm, off.pool_blocks, s_rows, s_blocks, s_warp, status);
    if (__syncthreads_or(bad)) return;
    if (cta == 0) publish_pool_table(base, off, s_rows, s_blocks, local_e, bm, ring);

    // ---- E. pull the received rows into the ring
    GC_ROLE1_MARK(role1_mark_time(kMarkPullStart));
    pull_rows(peers, off, p, base, s_rows, s_blocks, local_e, status, [&](u32 le, u32 i, u32) {
        const u32 src = last_at_most(s_src + le * stride, ranks, i);
        const u32 pos = i - s_src[le * stride + src];
        return make_uint2(src, static_cast<u32>(__ldcg(src_index + (static_cast<size_t>(le) * ranks + src) * cap +
                                                       pos)));
    });
    GC_ROLE1_MARK(role1_mark_time(kMarkExit));
}
