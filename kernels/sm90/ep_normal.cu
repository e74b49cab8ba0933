// DeepEP's normal-mode (high-throughput) intranode dispatch and combine behind the deep_ep facade: the layout
// kernel, the count exchange (notify), one kernel per direction (its send half, then its receive half), all on the
// symmetric workspace (num_nvl_bytes), and the combine's rewrite of the handle's send_head; launched on the
// communication green context.
//
// Workspace (one copy per rank; offsets in EpNormalParams):
//   arrive[P]   u64  notify barrier: rank q stores op into arrive[q] of every rank after writing its counts
//   ready[P]    u64  rank q stores op into ready[q] of every rank once its rows for op are in that rank's data region
//   released[P] u64  rank q stores op into released[q] of every rank once it has read its own data region for op
//   status[7]        KernelStatus per kernel (gc_moe::NormalKernel)
//   layout/notify arrival counters and the layout's cross-CTA histogram (reset by the last CTA)
//   counts[P][P] u32, expert_counts[P][L] u32, recv_chan[P][C] i32: the op's exchanged counts (transient)
//   data region: dispatch rows (16 bytes source token, payload, scales, top-k) at the receiver, ordered by source
//                rank, then channel, then token (DeepEP's recv order); combine rows (BF16 row, top-k weights) at the
//                tokens' source rank, ordered by destination rank, then channel, then token.
// Ordering (op n = the Buffer's collective-op counter, the same on every rank; every word only grows):
//  * notify: CTA 0 stores this rank's per-rank and per-expert counts into every rank's counts, fence, then
//    st.release.sys arrive[own] = n on every rank, then acquires arrive[q] >= n for every q and reduces the matrix.
//  * a send half first acquires released[r] >= n - 1 of every rank r it may write to (that rank read op n - 1's
//    rows), writes its rows with peer stores, and its last CTA (fences around the arrival atomic) stores
//    ready[own] = n on every rank; a receive half acquires ready[q] >= n before reading rows of rank q (the
//    dispatch's per source, in the order the sources land; the combine's for every q first), and its last CTA stores
//    released[own] = n on every rank. Each CTA runs the send half, then the receive half: a CTA's receive half
//    waits on its own grid's send half (ready[own]), so the grid is at most the CTAs the launch can hold at once (the
//    host bounds it by the rank's share of the SMs), as DeepEP's one dispatch kernel.
// At one rank (P = 1) the rows skip the data region: the dispatch copies x straight into its outputs and the combine
// reads x in place (dispatch_direct, combine_direct), each publishing ready and released for its op as above.
// Every wait is bounded by timeout_ns and ends early once the kernel's status record holds an error (the dispatch's
// receive: a timeout; its row-count mismatch still reads every row); a failed wait leaves its words unpublished (so
// peers report too) and every kernel still completes.
#include <cuda_bf16.h>

#include "common/peer_table.cuh"
#include "common/phase_marks.cuh"
#include "common/status.cuh"
#include "common/sync.cuh"
#include "sm90/ep_normal_params.cuh"

#ifdef GC_EP_NORMAL_PHASES
// Outside the anonymous namespace, so that the cubin names it plainly (cuLibraryGetGlobal looks it up by name).
__device__ unsigned long long* gc_ep_normal_phase_times;
#endif

namespace {

using gc_moe::EpNormalParams;
using gc_moe::KernelStatus;
using gc_moe::PeerTable;
using gc_moe::peer_ptr;
using gc_moe::u32;
using gc_moe::last_cta;
using gc_moe::u64;
typedef unsigned char u8;

constexpr u32 kThreads = 384;  // 12 warps (ep_normal.py: THREADS): the row copies are bound by the loads a CTA has in
                               // flight, not by one warp's bytes; kRowBatch = 14 keeps the direction kernels at <= 168
                               // registers, so 12 warps fit (bench/README.md, thirty-first session, has the profile)
constexpr u32 kWarps = kThreads / 32;
constexpr u32 kMaxExperts = 2048;  // the layout histogram (config.MAX_EXPERTS)
constexpr u32 kMaxRanks = 72;      // gc_moe::kMaxPeers
constexpr u32 kRankWords = (kMaxRanks + 31) / 32;  // words of one rank per lane (lane l: ranks l, l + 32, ...)
constexpr u32 kBatch = 8;          // loads in flight per lane: combine receive's vectors per rank, combine heads'
                                   // and notify's 32-token chunks, the layout's top-k slots
constexpr u32 kRowBatch = 14;      // a row copy's 16-byte vectors in flight per lane (7 KB per warp: a 7168-column
                                   // FP8 row in one round, a BF16 row in two; each round costs a memory latency)
constexpr u32 kPairRanksMax = 4;  // combine receive: two ranks' rows in flight per round up to this many ranks (one
                                   // H200, ranks under MPS: 5-15 % faster at P = 2 / 4, 3.5-5 % slower at P = 8)
constexpr u32 kEarlyScaleWords = 2;  // dispatch send and receive: a row's first 64 scale words, loaded ahead of its payload

#ifdef GC_EP_NORMAL_PHASES
// Phase timing, in the variant bench/_ep_normal_phases.py builds (GC_EP_NORMAL_PHASES defined: a direction
// kernel's marks go to gc_ep_normal_phase_times, common/phase_marks.cuh). The marks: entry, send half's wait done,
// send half's rows done, receive half's wait done, receive half's rows done, exit (the combine's send_head rewrite
// runs between entry and its send wait). The production build has no global and no marks.
constexpr u32 kPhaseMarks = 6;
constexpr u32 kPhaseCtas = 256;

__device__ __forceinline__ void phase_mark(u32 direction, u32 mark) {
    gc_moe::store_phase_mark<kPhaseMarks, kPhaseCtas>(::gc_ep_normal_phase_times, direction, mark);
}
#else
__device__ __forceinline__ void phase_mark(u32, u32) {}
#endif
constexpr u32 kDispatchPhases = 0, kCombinePhases = 1;  // phase_mark's directions

__device__ __forceinline__ u8* base_of(const PeerTable& pt, u32 rank, u64 offset) {
    return peer_ptr<u8>(pt, rank, offset);
}

__device__ __forceinline__ KernelStatus* status_of(const PeerTable& pt, const EpNormalParams& p, u32 kernel) {
    return reinterpret_cast<KernelStatus*>(pt.base + p.off_status) + kernel;
}

__device__ __forceinline__ bool failed(KernelStatus* status) {
    return *reinterpret_cast<volatile u32*>(&status->code) != gc_moe::kStatusOk;
}

__device__ __forceinline__ bool timed_out(KernelStatus* status) {
    return *reinterpret_cast<volatile u32*>(&status->code) == gc_moe::kStatusTimeout;
}

// Thread q < P of the CTA waits until word[q] (of this rank's copy) >= target; true in every thread when all did.
__device__ __forceinline__ bool wait_all_ranks(const PeerTable& pt, u64 offset, u64 target, const EpNormalParams& p,
                                               KernelStatus* status, u32 kind) {
    bool ok = true;
    for (u32 q = threadIdx.x; q < static_cast<u32>(pt.world_size); q += kThreads) {
        const u64* word = reinterpret_cast<const u64*>(pt.base + offset) + q;
        ok = !failed(status) && gc_moe::wait_at_least<gc_moe::Scope::kSys>(word, target, p.timeout_ns, status,
                                                                            kind << 16 | q) && ok;
    }
    return __syncthreads_and(ok);
}

// Stores value into word[own] of every rank (release, system scope), after every CTA's stores (callers fence).
__device__ __forceinline__ void publish(const PeerTable& pt, u64 offset, u64 value) {
    for (u32 q = threadIdx.x; q < static_cast<u32>(pt.world_size); q += kThreads)
        gc_moe::st_release_sys(reinterpret_cast<u64*>(base_of(pt, q, offset)) + pt.rank, value);
}

// Copies the status records into the pinned host mirror, so that the host sees errors without synchronizing.
__device__ __forceinline__ void mirror_status(const PeerTable& pt, const EpNormalParams& p) {
    constexpr u32 kWords = gc_moe::kNormalKernelCount * sizeof(KernelStatus) / 4;
    if (p.status_mirror && threadIdx.x < kWords) {
        const volatile u32* src = reinterpret_cast<const volatile u32*>(pt.base + p.off_status);
        reinterpret_cast<volatile u32*>(p.status_mirror)[threadIdx.x] = src[threadIdx.x];
    }
    __threadfence_system();
}

// A routing entry's global expert (p.topk_idx is int64: DeepEP's topk_idx_t, the only dtype the host passes); -1 for
// an unused slot. An id >= num_experts or < -1 is reported (when `status` is given; a negative one as its negation,
// as the low-latency kernels do) and treated as unused, never used as an address. It takes the loaded id: callers load
// a token's ids with its other loads and check them where they are used (a check right after the load would make the
// warp wait for the id before issuing the loads after it).
__device__ __forceinline__ long long checked_expert(const EpNormalParams& p, long long e,
                                                    KernelStatus* status = nullptr) {
    if (e >= static_cast<long long>(p.num_experts)) {
        if (status) gc_moe::report_status(status, gc_moe::kStatusMismatch, gc_moe::kNormalSiteExpertRange << 16,
                                          static_cast<u64>(e), p.num_experts);
        return -1;
    }
    if (e < -1) {
        if (status) gc_moe::report_status(status, gc_moe::kStatusMismatch, gc_moe::kNormalSiteExpertNegative << 16,
                                          0ull - static_cast<u64>(e), 1);
        return -1;
    }
    return e;
}

// A warp copies `count` elements (16-byte vectors, or scale words), kRowBatch loads in flight per lane before their
// stores.
template <typename T>
__device__ __forceinline__ void warp_copy(T* dst, const T* src, u32 count, u32 lane) {
    for (u32 v0 = lane; v0 < count; v0 += 32 * kRowBatch) {
        T r[kRowBatch];
#pragma unroll
        for (u32 i = 0; i < kRowBatch; ++i)
            if (v0 + 32 * i < count) r[i] = src[v0 + 32 * i];
#pragma unroll
        for (u32 i = 0; i < kRowBatch; ++i)
            if (v0 + 32 * i < count) dst[v0 + 32 * i] = r[i];
    }
}

// Calls f(rank, row) for every rank whose bit is set in held, in increasing rank order; lane l holds the row of rank
// 32 w + l in rows[w]. Warp-uniform.
template <typename Row, typename F>
__device__ __forceinline__ void for_each_rank(const u32 (&held)[kRankWords], const Row (&rows)[kRankWords], F&& f) {
#pragma unroll
    for (u32 w = 0; w < kRankWords; ++w) {
        for (u32 m = held[w]; m; m &= m - 1) {
            const u32 bit = __ffs(m) - 1;
            f(32 * w + bit, __shfl_sync(~0u, rows[w], bit));
        }
    }
}

// Calls f(first, second, true) for the rows of consecutive pairs of the ranks set in held (increasing rank order, as
// for_each_rank), and f(last, last, false) for an odd one out: two ranks' loads can be in flight together. Warp-uniform.
template <typename Row, typename F>
__device__ __forceinline__ void for_each_rank_pair(const u32 (&held)[kRankWords], const Row (&rows)[kRankWords],
                                                   F&& f) {
    bool pending = false;
    Row first = 0;
#pragma unroll
    for (u32 w = 0; w < kRankWords; ++w) {
        for (u32 m = held[w]; m; m &= m - 1) {
            const u32 bit = __ffs(m) - 1;
            const Row row = __shfl_sync(~0u, rows[w], bit);
            if (pending) f(first, row, true);
            else first = row;
            pending = !pending;
        }
    }
    if (pending) f(first, first, false);
}

__device__ __forceinline__ const int* matrix(const EpNormalParams& p) {
    return reinterpret_cast<const int*>(p.rank_prefix);
}

// Inclusive rank-prefix matrix entry M[s][r] (tokens from ranks <= s to rank r); M[-1][r] = 0.
__device__ __forceinline__ int prefix_at(const EpNormalParams& p, int s, u32 r, u32 ranks) {
    return s < 0 ? 0 : matrix(p)[static_cast<u32>(s) * ranks + r];
}

// Tokens rank s sends to rank r.
__device__ __forceinline__ int sent(const EpNormalParams& p, u32 s, u32 r, u32 ranks) {
    return prefix_at(p, static_cast<int>(s), r, ranks) - prefix_at(p, static_cast<int>(s) - 1, r, ranks);
}

// The exclusive channel prefix of (destination r, channel c) in a sender's channel-prefix matrix (inclusive).
__device__ __forceinline__ int channel_start(const EpNormalParams& p, u32 r, u32 c) {
    return c == 0 ? 0 : reinterpret_cast<const int*>(p.channel_prefix)[r * p.num_channels + c - 1];
}

__device__ __forceinline__ u32 channel_of(const EpNormalParams& p, u32 t) {
    const u32 per = (p.num_tokens + p.num_channels - 1) / p.num_channels;  // DeepEP's get_channel_task_range
    return t / per;
}

__device__ __forceinline__ float bf16_lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }

__device__ __forceinline__ void add_bf16x8(float* acc, const uint4 v) {
    acc[0] += bf16_lo(v.x), acc[1] += bf16_hi(v.x), acc[2] += bf16_lo(v.y), acc[3] += bf16_hi(v.y);
    acc[4] += bf16_lo(v.z), acc[5] += bf16_hi(v.z), acc[6] += bf16_lo(v.w), acc[7] += bf16_hi(v.w);
}

// A combine's FP32 sums of 8 columns before any rank's row: bias_0 + bias_1 (DeepEP's order), an absent one 0
// (b0 / b1 read only where has_0 / has_1).
__device__ __forceinline__ void start_sums(float (&acc)[8], bool has_0, const uint4 b0, bool has_1, const uint4 b1) {
    float second[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.f;
    if (has_0) add_bf16x8(acc, b0);
    if (has_1) add_bf16x8(second, b1);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = __fadd_rn(acc[e], second[e]);
}

}  // namespace

// get_dispatch_layout: per-rank and per-expert token counts and is_token_in_rank from topk_idx. Each CTA counts its
// tokens in shared memory and adds them to the workspace histogram; the last CTA writes the outputs and clears it.
extern "C" __global__ void __launch_bounds__(kThreads, 1) gc_ep_normal_layout(const PeerTable pt,
                                                                          const EpNormalParams p) {
    __shared__ u32 experts[kMaxExperts];
    __shared__ u32 ranks_hist[kMaxRanks];
    KernelStatus* status = status_of(pt, p, gc_moe::kNormalLayout);
    const u32 ranks = static_cast<u32>(pt.world_size);
    for (u32 i = threadIdx.x; i < p.num_experts; i += kThreads) experts[i] = 0;
    for (u32 i = threadIdx.x; i < ranks; i += kThreads) ranks_hist[i] = 0;
    __syncthreads();
    for (u32 t = blockIdx.x * kThreads + threadIdx.x; t < p.num_tokens; t += gridDim.x * kThreads) {
        u64 mask_lo = 0, mask_hi = 0;  // destination ranks of token t (P <= 72 < 128)
        // kBatch slots' ids loaded before any is counted: one memory round trip per kBatch slots, not per slot
        const long long* ids = reinterpret_cast<const long long*>(p.topk_idx) + static_cast<u64>(t) * p.topk;
        for (u32 k0 = 0; k0 < p.topk; k0 += kBatch) {
            long long raw[kBatch];
#pragma unroll
            for (u32 i = 0; i < kBatch; ++i) raw[i] = k0 + i < p.topk ? ids[k0 + i] : -1;
#pragma unroll
            for (u32 i = 0; i < kBatch; ++i) {
                const long long e = k0 + i < p.topk ? checked_expert(p, raw[i], status) : -1;
                if (e < 0) continue;
                atomicAdd(&experts[e], 1u);
                const u32 r = static_cast<u32>(e) / p.local_experts;
                if (r < 64) mask_lo |= 1ull << r;
                else mask_hi |= 1ull << (r - 64);
            }
        }
        for (u32 r = 0; r < ranks; ++r) {
            const bool in = ((r < 64 ? mask_lo >> r : mask_hi >> (r - 64)) & 1) != 0;
            reinterpret_cast<bool*>(p.is_token_in_rank)[static_cast<u64>(t) * ranks + r] = in;
            if (in) atomicAdd(&ranks_hist[r], 1u);
        }
    }
    __syncthreads();
    u32* hist = reinterpret_cast<u32*>(pt.base + p.off_scratch);
    for (u32 i = threadIdx.x; i < p.num_experts; i += kThreads)
        if (experts[i]) atomicAdd(hist + i, experts[i]);
    for (u32 i = threadIdx.x; i < ranks; i += kThreads)
        if (ranks_hist[i]) atomicAdd(hist + kMaxExperts + i, ranks_hist[i]);
    if (last_cta(reinterpret_cast<u64*>(pt.base + p.off_layout_arrive))) {
        for (u32 i = threadIdx.x; i < p.num_experts; i += kThreads) {
            reinterpret_cast<int*>(p.num_tokens_per_expert)[i] = static_cast<int>(atomicExch(hist + i, 0u));
        }
        for (u32 i = threadIdx.x; i < ranks; i += kThreads)
            reinterpret_cast<int*>(p.num_tokens_per_rank)[i] = static_cast<int>(atomicExch(hist + kMaxExperts + i, 0u));
        mirror_status(pt, p);
    }
}

// notify (uncached dispatch): CTA 0 exchanges the per-rank / per-expert counts with every rank and reduces them
// (rank_prefix_matrix; the received and aligned per-expert counts into the pinned host record); the other CTAs
// scan the channels (send_head, per-channel counts); the last CTA turns the counts into channel_prefix_matrix.
extern "C" __global__ void __launch_bounds__(kThreads, 1) gc_ep_normal_notify(const PeerTable pt,
                                                                          const EpNormalParams p) {
    KernelStatus* status = status_of(pt, p, gc_moe::kNormalNotify);
    const u32 ranks = static_cast<u32>(pt.world_size), own = static_cast<u32>(pt.rank);
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x / 32;
    const u32 local = p.local_experts;
    if (blockIdx.x == 0) {
        const int* per_rank = reinterpret_cast<const int*>(p.num_tokens_per_rank);
        const int* per_expert = reinterpret_cast<const int*>(p.num_tokens_per_expert);
        for (u32 i = threadIdx.x; i < ranks * ranks; i += kThreads) {
            const u32 q = i / ranks, r = i % ranks;
            reinterpret_cast<int*>(base_of(pt, q, p.off_counts))[own * ranks + r] = per_rank[r];
        }
        for (u32 i = threadIdx.x; i < p.num_experts; i += kThreads) {
            const u32 q = i / local, le = i % local;
            reinterpret_cast<int*>(base_of(pt, q, p.off_expert_counts))[own * local + le] = per_expert[i];
        }
        __threadfence_system();
        __syncthreads();
        if (threadIdx.x == 0) {
            for (u32 q = 0; q < ranks; ++q)
                gc_moe::st_release_sys(reinterpret_cast<u64*>(base_of(pt, q, p.off_arrive)) + own, p.op);
        }
        if (wait_all_ranks(pt, p.off_arrive, p.op, p, status, gc_moe::kNormalSiteArrive)) {
            const int* counts = reinterpret_cast<const int*>(pt.base + p.off_counts);
            int* prefix = reinterpret_cast<int*>(p.rank_prefix);
            int* host = reinterpret_cast<int*>(p.host_counts);
            __shared__ int most_recv, most_sent;
            if (threadIdx.x == 0) most_recv = 0, most_sent = 0;
            __syncthreads();
            for (u32 r = threadIdx.x; r < ranks; r += kThreads) {
                int sum = 0, row = 0;
                for (u32 s = 0; s < ranks; ++s) {
                    sum += counts[s * ranks + r];
                    prefix[s * ranks + r] = sum;
                    row += counts[r * ranks + s];
                }
                if (r == own) host[gc_moe::kHostRecv] = sum;
                atomicMax(&most_recv, sum);
                atomicMax(&most_sent, row);
            }
            const int* experts = reinterpret_cast<const int*>(pt.base + p.off_expert_counts);
            for (u32 le = threadIdx.x; le < local; le += kThreads) {
                int sum = 0;
                for (u32 s = 0; s < ranks; ++s) sum += experts[s * local + le];
                host[gc_moe::kHostExperts + le] = (sum + static_cast<int>(p.expert_alignment) - 1) /
                                          static_cast<int>(p.expert_alignment) * static_cast<int>(p.expert_alignment);
            }
            __syncthreads();
            if (threadIdx.x == 0) host[gc_moe::kHostMostRecv] = most_recv, host[gc_moe::kHostMostSent] = most_sent;
            // The tag last: the host reads the counts as soon as it sees this call's op there (DeepEP's CPU wait
            // polls its pinned counters the same way), not when the kernel ends.
            __threadfence_system();
            __syncthreads();
            if (threadIdx.x == 0) gc_moe::st_release_sys(reinterpret_cast<u64*>(host + gc_moe::kHostTag), p.op);
        }
    } else {
        // A warp per (destination rank, channel): send_head[t][r] = the token's index among the channel's tokens to
        // r (-1 when it does not go to r), and the channel's count. kBatch 32-token chunks are loaded before they are
        // scanned (one memory round trip per 256 tokens instead of per 32: a channel of 683 tokens, one rank at T =
        // 8192, took 22).
        const u32 units = ranks * p.num_channels;
        const bool* in_rank = reinterpret_cast<const bool*>(p.is_token_in_rank);
        for (u32 u = (blockIdx.x - 1) * kWarps + warp; u < units; u += (gridDim.x - 1) * kWarps) {
            const u32 r = u / p.num_channels, c = u % p.num_channels;
            const u32 per = (p.num_tokens + p.num_channels - 1) / p.num_channels;
            const u32 start = min(per * c, p.num_tokens), end = min(start + per, p.num_tokens);
            int running = 0;
            for (u32 base = start; base < end; base += 32 * kBatch) {
                bool in[kBatch];
#pragma unroll
                for (u32 i = 0; i < kBatch; ++i) {
                    const u32 t = base + 32 * i + lane;
                    in[i] = t < end && in_rank[static_cast<u64>(t) * ranks + r];
                }
#pragma unroll
                for (u32 i = 0; i < kBatch; ++i) {
                    const u32 t = base + 32 * i + lane;
                    const u32 ballot = __ballot_sync(~0u, in[i]);
                    if (t < end)
                        reinterpret_cast<int*>(p.send_head)[static_cast<u64>(t) * ranks + r] =
                            in[i] ? running + __popc(ballot & ((1u << lane) - 1)) : -1;
                    running += __popc(ballot);
                }
            }
            if (lane == 0) reinterpret_cast<int*>(p.channel_prefix)[r * p.num_channels + c] = running;
        }
    }
    if (last_cta(reinterpret_cast<u64*>(pt.base + p.off_notify_arrive))) {
        for (u32 r = threadIdx.x; r < ranks; r += kThreads) {
            int* row = reinterpret_cast<int*>(p.channel_prefix) + r * p.num_channels;
            for (u32 c = 1; c < p.num_channels; ++c) row[c] += row[c - 1];
        }
        mirror_status(pt, p);
    }
}

// dispatch, send half: every token's row goes to each rank it is in, at DeepEP's receive position
// M[own-1][r] + channel start + send_head. A warp per token: its top-k slots, first scale words and first kRowBatch
// vectors per lane are loaded before lane r finds the row at rank r (the routing's loads then overlap the payload's
// instead of preceding them: one memory latency per token fewer), then each batch of the token's vectors is loaded once
// and stored to every rank.
static __device__ __forceinline__ void dispatch_send(const PeerTable& pt, const EpNormalParams& p) {
    KernelStatus* status = status_of(pt, p, gc_moe::kNormalDispatchSend);
    const u32 ranks = static_cast<u32>(pt.world_size), own = static_cast<u32>(pt.rank);
    const u32 lane = threadIdx.x & 31;
    const bool ok = wait_all_ranks(pt, p.off_released, p.op - 1, p, status, gc_moe::kNormalSiteReleased);
    phase_mark(kDispatchPhases, 1);
    const u32 vecs = p.row_bytes / 16;
    for (u32 t = blockIdx.x * kWarps + threadIdx.x / 32; ok && t < p.num_tokens; t += gridDim.x * kWarps) {
        // What does not depend on the routing goes out first (a token of unused slots only wastes these loads).
        long long expert = -1;
        float weight = 0.f;
        if (lane < p.topk) {
            expert = reinterpret_cast<const long long*>(p.topk_idx)[static_cast<u64>(t) * p.topk + lane];  // raw
            weight = reinterpret_cast<const float*>(p.topk_weights)[static_cast<u64>(t) * p.topk + lane];
        }
        // The token's first scale words (strided: DeepEP's scales are column-major).
        u32 early[kEarlyScaleWords];
#pragma unroll
        for (u32 k = 0; k < kEarlyScaleWords; ++k) {
            const u32 i = 32 * k + lane;
            early[k] = i < p.num_scales ? reinterpret_cast<const u32*>(p.x_scales)[
                static_cast<u64>(t) * p.scale_token_stride + static_cast<u64>(i) * p.scale_hidden_stride] : 0u;
        }
        const uint4* src = reinterpret_cast<const uint4*>(p.x) + static_cast<u64>(t) * vecs;
        uint4 v[kRowBatch];
#pragma unroll
        for (u32 i = 0; i < kRowBatch; ++i)
            if (lane + 32 * i < vecs) v[i] = src[lane + 32 * i];
        const u32 c = channel_of(p, t);
        u64 rows[kRankWords];
        u32 held[kRankWords];  // bit l of held[w]: the token goes to rank 32 w + l, at rows[w] of lane l
#pragma unroll
        for (u32 w = 0; w < kRankWords; ++w) {
            const u32 r = 32 * w + lane;
            bool in = false;
            rows[w] = 0;
            if (r < ranks) {
                const int head = reinterpret_cast<const int*>(p.send_head)[static_cast<u64>(t) * ranks + r];
                rows[w] = static_cast<u64>(prefix_at(p, static_cast<int>(own) - 1, r, ranks) + channel_start(p, r, c) +
                                           head);
                in = head >= 0;
            }
            const u32 past = __ballot_sync(~0u, in && rows[w] >= p.data_rows);
            if (past && lane == __ffs(past) - 1)  // the lowest such rank, as a rank-order scan reports first
                gc_moe::report_status(status, gc_moe::kStatusMismatch, gc_moe::kNormalSiteCapacity << 16 | r, rows[w],
                                      p.data_rows);
            held[w] = __ballot_sync(~0u, in && rows[w] < p.data_rows);
        }
        u32 any = 0;
#pragma unroll
        for (u32 w = 0; w < kRankWords; ++w) any |= held[w];
        if (!any) continue;  // a token of unused slots only: nothing to send
        const auto row_at = [&](u32 r, u64 row) { return base_of(pt, r, p.off_data) + row * p.row_stride; };
        for_each_rank(held, rows, [&](u32 r, u64 row) {
            if (lane == 0) *reinterpret_cast<int4*>(row_at(r, row)) = make_int4(static_cast<int>(t), 0, 0, 0);
        });
        // Warp-uniform loops (for_each_rank shuffles across the warp); the first batch is already in v.
        for (u32 base = 0; base < vecs; base += 32 * kRowBatch) {
            const u32 v0 = base + lane;
            if (base > 0) {
#pragma unroll
                for (u32 i = 0; i < kRowBatch; ++i)
                    if (v0 + 32 * i < vecs) v[i] = src[v0 + 32 * i];
            }
            for_each_rank(held, rows, [&](u32 r, u64 row) {
                uint4* dst = reinterpret_cast<uint4*>(row_at(r, row) + 16);
#pragma unroll
                for (u32 i = 0; i < kRowBatch; ++i)
                    if (v0 + 32 * i < vecs) dst[v0 + 32 * i] = v[i];
            });
        }
#pragma unroll
        for (u32 k = 0; k < kEarlyScaleWords; ++k) {
            if (32 * k >= p.num_scales) break;  // warp-uniform
            const u32 i = 32 * k + lane;
            const bool live = i < p.num_scales;
            for_each_rank(held, rows, [&](u32 r, u64 row) {
                if (live) reinterpret_cast<u32*>(row_at(r, row) + p.off_row_scales)[i] = early[k];
            });
        }
        for (u32 base = 32 * kEarlyScaleWords; base < p.num_scales; base += 32) {
            const u32 i = base + lane;
            const bool live = i < p.num_scales;
            const u64 at = static_cast<u64>(t) * p.scale_token_stride + static_cast<u64>(i) * p.scale_hidden_stride;
            const u32 scale = live ? reinterpret_cast<const u32*>(p.x_scales)[at] : 0u;
            for_each_rank(held, rows, [&](u32 r, u64 row) {
                if (live) reinterpret_cast<u32*>(row_at(r, row) + p.off_row_scales)[i] = scale;
            });
        }
        for_each_rank(held, rows, [&](u32 r, u64 row) {
            if (lane >= p.topk) return;
            // DeepEP's transform: the destination's local expert id, or -1 (weight 0) for another rank's expert.
            const long long begin = static_cast<long long>(r) * p.local_experts;
            // checked here, not where it is loaded: a check there waits for the id between the payload's loads
            const long long g = checked_expert(p, expert);
            const long long e = (g >= begin && g < begin + p.local_experts) ? g - begin : -1;
            u8* topk = row_at(r, row) + p.off_row_topk;
            reinterpret_cast<long long*>(topk)[lane] = e;
            reinterpret_cast<float*>(topk + 8 * p.topk)[lane] = e >= 0 ? weight : 0.0f;
        });
    }
    phase_mark(kDispatchPhases, 2);
    if (last_cta(reinterpret_cast<u64*>(pt.base + p.off_send_arrive))) {
        // The receivers' recv_channel_prefix_matrix rows: this rank's exclusive channel starts toward each rank.
        for (u32 i = threadIdx.x; i < ranks * p.num_channels; i += kThreads) {
            const u32 r = i / p.num_channels, c = i % p.num_channels;
            reinterpret_cast<int*>(base_of(pt, r, p.off_recv_chan))[own * p.num_channels + c] = channel_start(p, r, c);
        }
        __threadfence_system();
        __syncthreads();
        if (!timed_out(status)) publish(pt, p.off_ready, p.op);
    }
}

// The first row >= lo that warp `w` of `warps` takes (rows w, w + warps, ...).
__device__ __forceinline__ u32 first_row_of(u32 lo, u32 w, u32 warps) {
    return lo + (w + warps - lo % warps) % warps;
}

// dispatch, receive one row: data region row j into DeepEP's outputs; a warp.
static __device__ __forceinline__ void dispatch_recv_row(const PeerTable& pt, const EpNormalParams& p, u32 j,
                                                         u32 lane) {
    const u32 vecs = p.row_bytes / 16;
    const u8* src = reinterpret_cast<const u8*>(pt.base + p.off_data) + static_cast<u64>(j) * p.row_stride;
    // The source index, top-k slots and first scale words are loaded first, in flight with the row's first
    // vectors (the scales are not one more memory latency after the payload's stores).
    const bool slot = lane < p.topk && p.recv_topk_idx;
    int src_idx = 0;
    long long e = -1;
    float weight = 0.f;
    if (lane == 0) src_idx = *reinterpret_cast<const int*>(src);
    if (slot) {
        e = reinterpret_cast<const long long*>(src + p.off_row_topk)[lane];
        weight = reinterpret_cast<const float*>(src + p.off_row_topk + 8 * p.topk)[lane];
    }
    const u32* scales = reinterpret_cast<const u32*>(src + p.off_row_scales);
    u32 early[kEarlyScaleWords];
#pragma unroll
    for (u32 k = 0; k < kEarlyScaleWords; ++k) {
        const u32 i = 32 * k + lane;
        early[k] = i < p.num_scales ? scales[i] : 0u;
    }
    warp_copy(reinterpret_cast<uint4*>(p.recv_x) + static_cast<u64>(j) * vecs,
              reinterpret_cast<const uint4*>(src + 16), vecs, lane);
    u32* recv_scales = reinterpret_cast<u32*>(p.recv_scales) + static_cast<u64>(j) * p.num_scales;
#pragma unroll
    for (u32 k = 0; k < kEarlyScaleWords; ++k) {
        const u32 i = 32 * k + lane;
        if (i < p.num_scales) recv_scales[i] = early[k];
    }
    if (p.num_scales > 32 * kEarlyScaleWords)
        warp_copy(recv_scales + 32 * kEarlyScaleWords, scales + 32 * kEarlyScaleWords,
                  p.num_scales - 32 * kEarlyScaleWords, lane);
    if (lane == 0) reinterpret_cast<int*>(p.recv_src_idx)[j] = src_idx;
    if (slot) {
        const u64 f = static_cast<u64>(j) * p.topk + lane;
        reinterpret_cast<long long*>(p.recv_topk_idx)[f] = e;
        reinterpret_cast<float*>(p.recv_topk_weights)[f] = weight;
    }
}

// dispatch, receive half: this rank's data region rows [0, num_recv) into DeepEP's outputs, a warp per row; rows past
// num_recv up to a worst-case allocation get top-k index -1. The rows are ordered by source rank, and a source's rows
// are read once that rank's ready word says its send half is done; each warp takes its rows (j = w, w + warps, ...)
// source by source in the order the sources become ready (its lanes poll the pending sources' words, lane l ranks
// l, l + 32, ...; every lane then acquires the chosen word itself before reading), so the rows of the ranks that
// finished sending are copied while a late rank still sends (a wait for every rank before any row left the receive
// idle until the slowest sender finished: under MPS 20-60 us per call at P = 4).
static __device__ __forceinline__ void dispatch_recv(const PeerTable& pt, const EpNormalParams& p) {
    KernelStatus* status = status_of(pt, p, gc_moe::kNormalDispatchRecv);
    const u32 ranks = static_cast<u32>(pt.world_size), own = static_cast<u32>(pt.rank);
    const u32 lane = threadIdx.x & 31;
    phase_mark(kDispatchPhases, 3);
    const u32 num_recv = static_cast<u32>(prefix_at(p, static_cast<int>(ranks) - 1, own, ranks));
    const u32 rows = min(num_recv, p.recv_rows);
    const u32 warp = blockIdx.x * kWarps + threadIdx.x / 32, warps = gridDim.x * kWarps;
    const u64* ready = reinterpret_cast<const u64*>(pt.base + p.off_ready);
    // This warp's pending sources: those with a row of this warp below `rows`.
    u32 pending[kRankWords];
#pragma unroll
    for (u32 w = 0; w < kRankWords; ++w) {
        const u32 q = 32 * w + lane;
        bool mine = false;
        if (q < ranks) {
            const u32 lo = static_cast<u32>(prefix_at(p, static_cast<int>(q) - 1, own, ranks));
            const u32 hi = min(static_cast<u32>(prefix_at(p, static_cast<int>(q), own, ranks)), rows);
            mine = lo < hi && first_row_of(lo, warp, warps) < hi;
        }
        pending[w] = __ballot_sync(~0u, mine);
    }
    bool ok = true;
    u64 start = gc_moe::globaltimer_ns();  // of the current wait: reset whenever a source lands
    for (;;) {
        u32 any = 0, landed[kRankWords];
#pragma unroll
        for (u32 w = 0; w < kRankWords; ++w) {
            const bool poll = (pending[w] >> lane) & 1u;
            landed[w] = __ballot_sync(~0u, poll && gc_moe::ld_acquire_sys(ready + 32 * w + lane) >= p.op);
            any |= pending[w];
        }
        if (!any) break;
        u32 q = ranks;  // the lowest landed source: its bit is taken off its word
#pragma unroll
        for (u32 w = 0; w < kRankWords; ++w) {
            const u32 bit = q == ranks ? landed[w] & (0u - landed[w]) : 0u;
            if (bit) q = 32 * w + __ffs(bit) - 1;
            pending[w] &= ~bit;
        }
        if (q == ranks) {  // none landed yet: bounded wait, given up once another warp of the grid timed out
            // both decisions warp-uniform (lane 0's reads): the loop's ballots need every lane. Only a timeout ends
            // the wait early: the receive's other error (block 0's row-count mismatch) still lets every row be read
            // before released is published.
            const bool gave_up = __shfl_sync(~0u, timed_out(status), 0);
            const bool late_now = __shfl_sync(~0u, gc_moe::globaltimer_ns() - start > p.timeout_ns, 0);
            if (gave_up) {
                ok = false;
                break;
            }
            if (late_now) {
                u32 late = ranks;
#pragma unroll
                for (u32 w = 0; w < kRankWords; ++w)
                    if (late == ranks && pending[w]) late = 32 * w + __ffs(pending[w]) - 1;
                const u64 seen = __shfl_sync(~0u, gc_moe::ld_acquire_sys(ready + late), 0);
                if (seen >= p.op) continue;  // it landed since the poll: take it on the next round
                if (lane == 0)
                    gc_moe::report_status(status, gc_moe::kStatusTimeout, gc_moe::kNormalSiteReady << 16 | late, seen,
                                          p.op);
                ok = false;
                break;
            }
            __nanosleep(GC_MOE_SPIN_SLEEP_NS);
            continue;
        }
        // every lane's own acquire of the word lane q % 32 saw landed (the ballot orders nothing), before its loads;
        // the word only grows, so this ends at once
        while (gc_moe::ld_acquire_sys(ready + q) < p.op) {
        }
        const u32 hi = min(static_cast<u32>(prefix_at(p, static_cast<int>(q), own, ranks)), rows);
        const u32 lo = static_cast<u32>(prefix_at(p, static_cast<int>(q) - 1, own, ranks));
        for (u32 j = first_row_of(lo, warp, warps); j < hi; j += warps) dispatch_recv_row(pt, p, j, lane);
        start = gc_moe::globaltimer_ns();  // the copy's time is not the next wait's
    }
    ok = __syncthreads_and(ok);
    // the senders' channel starts, written in their send halves before their ready words: every rank's word first
    if (ok && p.recv_channel_prefix && blockIdx.x == 0 &&
        wait_all_ranks(pt, p.off_ready, p.op, p, status, gc_moe::kNormalSiteReady)) {
        for (u32 i = threadIdx.x; i < ranks * p.num_channels; i += kThreads)
            reinterpret_cast<int*>(p.recv_channel_prefix)[i] = reinterpret_cast<const int*>(pt.base + p.off_recv_chan)[i];
    }
    if (ok && p.recv_topk_idx) {  // worst-case rows past the received count: top-k index -1 (DeepEP's rule)
        const u64 first = static_cast<u64>(rows) * p.topk, last = static_cast<u64>(p.recv_rows) * p.topk;
        for (u64 f = first + blockIdx.x * kThreads + threadIdx.x; f < last; f += gridDim.x * kThreads)
            reinterpret_cast<long long*>(p.recv_topk_idx)[f] = -1;
    }
    phase_mark(kDispatchPhases, 4);
    if (last_cta(reinterpret_cast<u64*>(pt.base + p.off_recv_arrive))) {
        if (!timed_out(status)) publish(pt, p.off_released, p.op);
        // The row-count check last, once every CTA has read its rows: reported earlier it would be the record's first
        // error and hide a later timeout, and released would then go out with a source's rows unread.
        if (threadIdx.x == 0 && num_recv > p.recv_rows)
            gc_moe::report_status(status, gc_moe::kStatusMismatch, gc_moe::kNormalSiteRecvRows << 16, num_recv,
                                  p.recv_rows);
        __syncthreads();  // the report before the mirror's copy
        mirror_status(pt, p);
    }
}

// The one-rank paths' row of token t (dispatch_direct, combine_direct): lane k of the warp returns the row j the
// dispatch gives token first + k * step (its channel's start plus its send_head entry), or -1 for none (a token of
// unused slots, or t past the tokens). One load round for 32 tokens, instead of two dependent loads per token.
__device__ __forceinline__ int direct_row_of(const EpNormalParams& p, u32 first, u32 step, u32 lane) {
    const u32 t = first + lane * step;
    if (t >= p.num_tokens) return -1;
    const int head = reinterpret_cast<const int*>(p.send_head)[t];  // entry (t, rank 0) of [T, 1]
    const int start = channel_start(p, 0, channel_of(p, t));
    return head < 0 ? -1 : start + head;
}

// dispatch at one rank (P = 1): every row goes from the caller's x straight into DeepEP's outputs at its receive
// position (channel start + send_head), as the two halves would leave it, without the data region: the bytes of one
// copy instead of two (the receive half is the second), so the one-rank dispatch is bound by one copy's bandwidth. A
// warp per token, its rows found 32 tokens at a time (direct_row_of) and its top-k and first scale loads issued with
// its row's, so that a token costs one memory round trip (an FP8 row of up to 7168 columns); the top-k entries take
// DeepEP's transform for rank 0 (every expert is local). Then, as the receive
// half: top-k index -1 in the worst-case rows past the received count, and in the last CTA the receivers' channel
// starts (this rank's own), ready and released for the op (what a later op's waits read), the row-count check and
// the status mirror.
static __device__ __forceinline__ void dispatch_direct(const PeerTable& pt, const EpNormalParams& p) {
    KernelStatus* status = status_of(pt, p, gc_moe::kNormalDispatchRecv);
    const u32 lane = threadIdx.x & 31;
    const u32 vecs = p.row_bytes / 16;
    const u32 num_recv = static_cast<u32>(prefix_at(p, 0, 0, 1));
    const u32 rows = min(num_recv, p.recv_rows);
    const u32 step = gridDim.x * kWarps;
    phase_mark(kDispatchPhases, 1);  // the two-half path's marks, so that a phase read finds every one
    for (u32 first = blockIdx.x * kWarps + threadIdx.x / 32; first < p.num_tokens; first += 32 * step) {
        const int row_of_lane = direct_row_of(p, first, step, lane);
        for (u32 k = 0; k < 32 && first + k * step < p.num_tokens; ++k) {
            const u32 t = first + k * step;
            const int row = __shfl_sync(~0u, row_of_lane, k);
            if (row < 0 || static_cast<u32>(row) >= rows) continue;  // none, or past the outputs (the last CTA
                                                                      // reports the count)
            const u32 j = static_cast<u32>(row);
            // the token's small loads before its row's, so that all are in flight together
            long long e = -1;
            float weight = 0.f;
            const bool slot = lane < p.topk && p.recv_topk_idx;
            if (slot) {
                const u64 f = static_cast<u64>(t) * p.topk + lane;
                e = reinterpret_cast<const long long*>(p.topk_idx)[f];  // raw: checked at its store (dispatch_send)
                weight = reinterpret_cast<const float*>(p.topk_weights)[f];
            }
            const u32* scales = reinterpret_cast<const u32*>(p.x_scales) + static_cast<u64>(t) * p.scale_token_stride;
            u32 early[kEarlyScaleWords];
#pragma unroll
            for (u32 w = 0; w < kEarlyScaleWords; ++w) {
                const u32 i = w * 32 + lane;
                if (i < p.num_scales) early[w] = scales[static_cast<u64>(i) * p.scale_hidden_stride];
            }
            warp_copy(reinterpret_cast<uint4*>(p.recv_x) + static_cast<u64>(j) * vecs,
                      reinterpret_cast<const uint4*>(p.x) + static_cast<u64>(t) * vecs, vecs, lane);
            u32* recv_scales = reinterpret_cast<u32*>(p.recv_scales) + static_cast<u64>(j) * p.num_scales;
#pragma unroll
            for (u32 w = 0; w < kEarlyScaleWords; ++w) {
                const u32 i = w * 32 + lane;
                if (i < p.num_scales) recv_scales[i] = early[w];
            }
            for (u32 i = 32 * kEarlyScaleWords + lane; i < p.num_scales; i += 32)
                recv_scales[i] = scales[static_cast<u64>(i) * p.scale_hidden_stride];
            if (slot) {
                e = checked_expert(p, e);
                e = e < static_cast<long long>(p.local_experts) ? e : -1;
                reinterpret_cast<long long*>(p.recv_topk_idx)[static_cast<u64>(j) * p.topk + lane] = e;
                reinterpret_cast<float*>(p.recv_topk_weights)[static_cast<u64>(j) * p.topk + lane] =
                    e >= 0 ? weight : 0.f;
            }
            if (lane == 0) reinterpret_cast<int*>(p.recv_src_idx)[j] = static_cast<int>(t);
        }
    }
    phase_mark(kDispatchPhases, 2);
    phase_mark(kDispatchPhases, 3);
    if (p.recv_topk_idx) {  // worst-case rows past the received count: top-k index -1 (DeepEP's rule)
        const u64 first = static_cast<u64>(rows) * p.topk, last = static_cast<u64>(p.recv_rows) * p.topk;
        for (u64 f = first + blockIdx.x * kThreads + threadIdx.x; f < last; f += gridDim.x * kThreads)
            reinterpret_cast<long long*>(p.recv_topk_idx)[f] = -1;
    }
    phase_mark(kDispatchPhases, 4);
    if (last_cta(reinterpret_cast<u64*>(pt.base + p.off_recv_arrive))) {
        if (p.recv_channel_prefix) {
            for (u32 c = threadIdx.x; c < p.num_channels; c += kThreads)
                reinterpret_cast<int*>(p.recv_channel_prefix)[c] = channel_start(p, 0, c);
        }
        __syncthreads();
        publish(pt, p.off_ready, p.op);
        publish(pt, p.off_released, p.op);
        if (threadIdx.x == 0 && num_recv > p.recv_rows)
            gc_moe::report_status(status, gc_moe::kStatusMismatch, gc_moe::kNormalSiteRecvRows << 16, num_recv,
                                  p.recv_rows);
        __syncthreads();  // the report before the mirror's copy
        mirror_status(pt, p);
    }
}

// combine heads (DeepEP's in-place rewrite of the handle's send_head at the start of an intranode combine): within
// each channel's tokens and each rank column, the entry of a token that does not go to the rank (negative) becomes
// -h - 1, h the head of the nearest later token of the channel that does, or -kNoLaterHead - 1 where none does; heads
// stay. It reads heads only, so a second combine on the same handle stores nothing, and every reader of send_head
// (dispatch send, combine receive: head >= 0) reads either encoding alike. A warp per (channel, rank), warps of a CTA
// on adjacent columns of the same rows: lane l holds the entry l tokens further from the channel's end than the
// chunk's first, kBatch chunks loaded before they are scanned, the nearest later head carried from chunk to chunk.
// The combine kernel runs it first (before its send half's wait: it touches the caller's send_head only); the
// receive half reads send_head after every CTA of this rank arrived past it (ready is published after the last
// arrival, each CTA's stores fenced before its own); at one rank it reads them without that wait, which is safe
// because a rewrite turns a negative entry into another negative one and never touches a head: the sign the receive
// tests and the heads it uses are the same before and after.
static __device__ __forceinline__ void combine_heads(const PeerTable& pt, const EpNormalParams& p) {
    constexpr int kNoLaterHead = 1 << 25;  // DeepEP's: above any channel's queue position
    const u32 ranks = static_cast<u32>(pt.world_size);
    const u32 lane = threadIdx.x & 31;
    const u32 per = (p.num_tokens + p.num_channels - 1) / p.num_channels;  // DeepEP's get_channel_task_range
    int* heads = reinterpret_cast<int*>(p.send_head);
    for (u32 u = blockIdx.x * kWarps + threadIdx.x / 32; u < ranks * p.num_channels; u += gridDim.x * kWarps) {
        const u32 r = u % ranks, c = u / ranks;
        const u32 start = min(per * c, p.num_tokens), count = min(start + per, p.num_tokens) - start;
        // entry `back` tokens before the channel's last one
        const auto at = [&](u32 back) { return static_cast<u64>(start + count - 1 - back) * ranks + r; };
        int later = kNoLaterHead;  // the head of the nearest token after the current chunk that goes to r
        for (u32 done = 0; done < count; done += 32 * kBatch) {
            int h[kBatch];
#pragma unroll
            for (u32 i = 0; i < kBatch; ++i) {
                const u32 back = done + 32 * i + lane;
                h[i] = back < count ? heads[at(back)] : -1;
            }
#pragma unroll
            for (u32 i = 0; i < kBatch; ++i) {
                const u32 back = done + 32 * i + lane;
                const u32 mask = __ballot_sync(~0u, h[i] >= 0);        // lanes holding a head
                const u32 after = mask & ((1u << lane) - 1);           // of them, those of later tokens
                const int nearest = __shfl_sync(~0u, h[i], after ? 31 - __clz(after) : lane);
                const int want = -(after ? nearest : later) - 1;
                if (back < count && h[i] < 0 && h[i] != want) heads[at(back)] = want;
                const int first = __shfl_sync(~0u, h[i], mask ? 31 - __clz(mask) : 0);  // the chunk's earliest head
                if (mask) later = first;
            }
        }
    }
}

// The rewrite alone, one launch: what the kernel test launches to check DeepEP's bytes on any grid (the facade's
// combine runs it inside gc_ep_normal_combine).
extern "C" __global__ void __launch_bounds__(kThreads, 1) gc_ep_normal_combine_heads(const PeerTable pt,
                                                                                 const EpNormalParams p) {
    combine_heads(pt, p);
}

// combine, send half: received row j (from source rank s) goes back to s, at row sum_{r' < own} sent(s, r') + (j - M[s-1][own])
// of s's data region; a warp per row (its top-k weights loaded in flight with its first vectors), both terms per
// source rank in shared memory.
static __device__ __forceinline__ void combine_send(const PeerTable& pt, const EpNormalParams& p) {
    __shared__ u32 recv_end[kMaxRanks];  // M[s][own]: the end of source rank s's rows in this rank's received rows
    __shared__ u32 back_start[kMaxRanks];  // sum_{r' < own} sent(s, r'): the first row of own's rows at rank s
    KernelStatus* status = status_of(pt, p, gc_moe::kNormalCombineSend);
    const u32 ranks = static_cast<u32>(pt.world_size), own = static_cast<u32>(pt.rank);
    const u32 lane = threadIdx.x & 31;
    for (u32 s = threadIdx.x; s < ranks; s += kThreads) {
        u32 before = 0;
        for (u32 r = 0; r < own; ++r) before += static_cast<u32>(sent(p, s, r, ranks));
        recv_end[s] = static_cast<u32>(prefix_at(p, static_cast<int>(s), own, ranks));
        back_start[s] = before;
    }
    const bool ok = wait_all_ranks(pt, p.off_released, p.op - 1, p, status, gc_moe::kNormalSiteReleased);
    phase_mark(kCombinePhases, 1);
    const u32 num_recv = static_cast<u32>(prefix_at(p, static_cast<int>(ranks) - 1, own, ranks));
    const u32 rows = ok ? min(num_recv, p.recv_rows) : 0;
    const u32 vecs = p.row_bytes / 16;
    for (u32 j = blockIdx.x * kWarps + threadIdx.x / 32; j < rows; j += gridDim.x * kWarps) {
        u32 s = 0;
        while (s + 1 < ranks && recv_end[s] <= j) ++s;
        const u64 row = back_start[s] + (j - (s == 0 ? 0u : recv_end[s - 1]));
        if (row >= p.data_rows) {
            if (lane == 0) gc_moe::report_status(status, gc_moe::kStatusMismatch, gc_moe::kNormalSiteCapacity << 16 | s,
                                                 row, p.data_rows);
            continue;
        }
        float weight = 0.f;
        if (lane < p.topk) weight = reinterpret_cast<const float*>(p.topk_weights)[static_cast<u64>(j) * p.topk + lane];
        u8* dst = base_of(pt, s, p.off_data) + row * p.row_stride;
        warp_copy(reinterpret_cast<uint4*>(dst), reinterpret_cast<const uint4*>(p.x) + static_cast<u64>(j) * vecs, vecs,
                  lane);
        if (lane < p.topk) reinterpret_cast<float*>(dst + p.off_row_topk)[lane] = weight;
    }
    phase_mark(kCombinePhases, 2);
    if (last_cta(reinterpret_cast<u64*>(pt.base + p.off_send_arrive))) {
        if (!timed_out(status)) publish(pt, p.off_ready, p.op);
    }
}

// acc[i] += the BF16 vector v[i] for every i < kBatch, or for the first half only unless full (warp-uniform): a
// round whose second half lies past the row (hidden 7168: the last of four per lane) skips its sums.
static __device__ __forceinline__ void add_vectors(float (&acc)[kBatch][8], const uint4 (&v)[kBatch], bool full) {
#pragma unroll
    for (u32 i = 0; i < kBatch / 2; ++i) add_bf16x8(acc[i], v[i]);
    if (full) {
#pragma unroll
        for (u32 i = kBatch / 2; i < kBatch; ++i) add_bf16x8(acc[i], v[i]);
    }
}

// combine, receive half: out[t] = BF16(bias_0 + bias_1 + sum over the ranks t went to, in rank order, of their rows) in
// FP32 (DeepEP's order), and the top-k weights summed the same way. A warp per token: lane l finds the token's row
// from rank l (l + 32, ...) once and sums the row's 16-byte vectors l, l + 32, ...: per kBatch of them it starts its
// sums (kBiased: from the biases; else at +0, which gives the same bits as adding absent biases: +0 + +0), then for
// each pair of ranks in order loads their kBatch vectors each before summing them (2 kBatch loads in flight per lane;
// one rank at a time past kPairRanksMax ranks).
template <bool kBiased>
static __device__ __forceinline__ void combine_recv_tokens(const PeerTable& pt, const EpNormalParams& p,
                                                           const u32 (&rank_start)[kMaxRanks], u32 tokens) {
    const u32 ranks = static_cast<u32>(pt.world_size), lane = threadIdx.x & 31;
    const u8* data = reinterpret_cast<const u8*>(pt.base + p.off_data);
    const uint4* bias_0 = reinterpret_cast<const uint4*>(p.bias_0);
    const uint4* bias_1 = reinterpret_cast<const uint4*>(p.bias_1);
    const u32 vecs = p.hidden / 8;                  // 16-byte vectors of a BF16 row
    const u32 warp_vecs = (vecs + 31) / 32;         // lane 0's vectors: the warp's rounds
    const u32 lane_vecs = (vecs + 31 - lane) / 32;  // this lane's: warp_vecs or one fewer (0 when vecs <= lane)
    // Two ranks' vectors (the biases' first when kBiased); zeroed once: a vector past the row is never loaded, so it
    // holds 0 or an earlier round's vector, and its sums are never stored.
    uint4 a[kBatch], b[kBatch];
#pragma unroll
    for (u32 i = 0; i < kBatch; ++i) a[i] = b[i] = make_uint4(0, 0, 0, 0);
    for (u32 t = blockIdx.x * kWarps + threadIdx.x / 32; t < tokens; t += gridDim.x * kWarps) {
        const u32 c = channel_of(p, t);
        u32 rows[kRankWords], held[kRankWords];  // lane l: the row from rank 32 w + l; bit l of held[w]: it exists
#pragma unroll
        for (u32 w = 0; w < kRankWords; ++w) {
            const u32 r = 32 * w + lane;
            bool in = false;
            rows[w] = 0;
            if (r < ranks) {
                const int head = reinterpret_cast<const int*>(p.send_head)[static_cast<u64>(t) * ranks + r];
                rows[w] = rank_start[r] + channel_start(p, r, c) + head;
                in = head >= 0 && rows[w] < p.data_rows;  // a row past the region: the sender reported it
            }
            held[w] = __ballot_sync(~0u, in);
        }
        for (u32 j0 = 0; j0 < warp_vecs; j0 += kBatch) {
            const u32 first = 32 * j0 + lane;  // this lane's vector i of the round: first + 32 i
            const u32 live = lane_vecs - j0;   // its vectors i < live are in the row (j0 < warp_vecs <= lane_vecs + 1)
            float acc[kBatch][8];
            if constexpr (kBiased) {  // bias_0 + bias_1 first (DeepEP), an absent one 0
                const u64 at = static_cast<u64>(t) * vecs + first;
#pragma unroll
                for (u32 i = 0; i < kBatch; ++i) {
                    if (i < live && bias_0) a[i] = bias_0[at + 32 * i];
                    if (i < live && bias_1) b[i] = bias_1[at + 32 * i];
                }
#pragma unroll
                for (u32 i = 0; i < kBatch; ++i) start_sums(acc[i], bias_0, a[i], bias_1, b[i]);
            } else {
#pragma unroll
                for (u32 i = 0; i < kBatch; ++i)
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[i][e] = 0.f;
            }
            const bool full = warp_vecs - j0 > kBatch / 2;  // lane 0's (the most) vectors reach the second half
            const bool weights = j0 == 0 && lane < p.topk;  // the first round also sums the top-k weights
            float weight = 0.f;
            // Up to kPairRanksMax ranks two ranks' vectors in flight per round, summed in rank order (the first's,
            // then the second's); with more ranks one rank's at a time.
            const auto add_rows = [&](u32 row_a, u32 row_b, bool two) {
                const u8* src_a = data + static_cast<u64>(row_a) * p.row_stride;
                const u8* src_b = data + static_cast<u64>(row_b) * p.row_stride;
                const uint4* vec_a = reinterpret_cast<const uint4*>(src_a) + first;
                const uint4* vec_b = reinterpret_cast<const uint4*>(src_b) + first;
                float wt_a = 0.f, wt_b = 0.f;
                if (weights) {
                    wt_a = reinterpret_cast<const float*>(src_a + p.off_row_topk)[lane];
                    if (two) wt_b = reinterpret_cast<const float*>(src_b + p.off_row_topk)[lane];
                }
#pragma unroll
                for (u32 i = 0; i < kBatch; ++i) {
                    if (i < live) a[i] = vec_a[32 * i];
                    if (i < live && two) b[i] = vec_b[32 * i];
                }
                add_vectors(acc, a, full);
                weight += wt_a;
                if (two) {
                    add_vectors(acc, b, full);
                    weight += wt_b;
                }
            };
            if (ranks <= kPairRanksMax) for_each_rank_pair(held, rows, add_rows);
            else for_each_rank(held, rows, [&](u32, u32 row) { add_rows(row, row, false); });
            uint4* out = reinterpret_cast<uint4*>(p.out) + static_cast<u64>(t) * vecs + first;
#pragma unroll
            for (u32 i = 0; i < kBatch; ++i) {
                __nv_bfloat162 o[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) o[e] = __floats2bfloat162_rn(acc[i][2 * e], acc[i][2 * e + 1]);
                if (i < live) out[32 * i] = *reinterpret_cast<const uint4*>(o);
            }
            if (weights && p.out_topk_weights)
                reinterpret_cast<float*>(p.out_topk_weights)[static_cast<u64>(t) * p.topk + lane] = weight;
        }
    }
}

// combine, receive half: waits for every rank's rows, sums its tokens (the bias decided once for all of them), then
// its last CTA publishes released.
static __device__ __forceinline__ void combine_recv(const PeerTable& pt, const EpNormalParams& p) {
    __shared__ u32 rank_start[kMaxRanks];  // first row of each destination rank's rows in this rank's data region
    KernelStatus* status = status_of(pt, p, gc_moe::kNormalCombineRecv);
    const u32 ranks = static_cast<u32>(pt.world_size), own = static_cast<u32>(pt.rank);
    if (threadIdx.x == 0) {
        u32 sum = 0;
        for (u32 r = 0; r < ranks; ++r) rank_start[r] = sum, sum += static_cast<u32>(sent(p, own, r, ranks));
    }
    // wait_all_ranks' CTA barrier also orders rank_start before any warp reads it
    const bool ok = wait_all_ranks(pt, p.off_ready, p.op, p, status, gc_moe::kNormalSiteReady);
    phase_mark(kCombinePhases, 3);
    const u32 tokens = ok ? p.num_tokens : 0;
    if (p.bias_0 || p.bias_1) combine_recv_tokens<true>(pt, p, rank_start, tokens);
    else combine_recv_tokens<false>(pt, p, rank_start, tokens);
    phase_mark(kCombinePhases, 4);
    if (last_cta(reinterpret_cast<u64*>(pt.base + p.off_recv_arrive))) {
        if (!timed_out(status)) publish(pt, p.off_released, p.op);
        mirror_status(pt, p);
    }
}

// combine_direct's sums of one 16-byte vector (8 BF16 columns) in FP32, rounded to BF16 as the receive half does:
// from_zero is 0 + x (no bias: the same roundings, e.g. -0 becomes +0, in about a third of the instructions),
// biased_vector is (bias_0 + bias_1) + x, x counted only when held (else the biases alone).
__device__ __forceinline__ u32 bf16x2_from(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const u32*>(&v);
}

__device__ __forceinline__ uint4 from_zero(const uint4 x) {
    const auto word = [](u32 w) { return bf16x2_from(__fadd_rn(0.f, bf16_lo(w)), __fadd_rn(0.f, bf16_hi(w))); };
    return make_uint4(word(x.x), word(x.y), word(x.z), word(x.w));
}

__device__ __forceinline__ uint4 biased_vector(const uint4* bias_0, const uint4* bias_1, u64 at, const uint4 x,
                                               bool held) {
    const uint4 zero = make_uint4(0, 0, 0, 0);
    float acc[8];
    start_sums(acc, bias_0, bias_0 ? bias_0[at] : zero, bias_1, bias_1 ? bias_1[at] : zero);
    if (held) add_bf16x8(acc, x);
    return make_uint4(bf16x2_from(acc[0], acc[1]), bf16x2_from(acc[2], acc[3]), bf16x2_from(acc[4], acc[5]),
                      bf16x2_from(acc[6], acc[7]));
}

// combine at one rank (P = 1): out[t] = BF16(bias_0 + bias_1 + x[j]) in FP32, j the row the dispatch gave token t
// (the data region row the send half would have copied row j into is j there, so x and topk_weights are read in place
// at row j), and its top-k weights copied from row j: the receive half's sums with one term, stored by the same
// roundings. No send half and no wait. A warp per token, its rows found 32 tokens at a time (direct_row_of), its
// weights and kRowBatch vectors per lane loaded before any is summed (a BF16 row of up to 3584 columns in one
// memory round trip); the last CTA publishes ready as well as released (a later op's waits read both).
static __device__ __forceinline__ void combine_direct(const PeerTable& pt, const EpNormalParams& p) {
    KernelStatus* status = status_of(pt, p, gc_moe::kNormalCombineRecv);
    const u32 lane = threadIdx.x & 31;
    const u32 step = gridDim.x * kWarps;
    phase_mark(kCombinePhases, 3);
    const uint4* bias_0 = reinterpret_cast<const uint4*>(p.bias_0);
    const uint4* bias_1 = reinterpret_cast<const uint4*>(p.bias_1);
    const bool biased = bias_0 || bias_1;
    for (u32 first = blockIdx.x * kWarps + threadIdx.x / 32; first < p.num_tokens; first += 32 * step) {
        const int row_of_lane = direct_row_of(p, first, step, lane);
        for (u32 k = 0; k < 32 && first + k * step < p.num_tokens; ++k) {
            const u32 t = first + k * step;
            const int row = __shfl_sync(~0u, row_of_lane, k);
            const bool held = row >= 0 && static_cast<u32>(row) < p.recv_rows;  // else the biases alone
            const u32 j = held ? static_cast<u32>(row) : 0;
            const uint4* x_row = reinterpret_cast<const uint4*>(reinterpret_cast<const u8*>(p.x) +
                                                                static_cast<u64>(j) * p.row_bytes);
            const bool slot = lane < p.topk && p.out_topk_weights;
            const float weight = slot && held ? reinterpret_cast<const float*>(p.topk_weights)[
                static_cast<u64>(j) * p.topk + lane] : 0.f;
            const u32 vecs = p.hidden / 8;  // 16-byte vectors of a BF16 row
            uint4* out_row = reinterpret_cast<uint4*>(p.out) + static_cast<u64>(t) * vecs;
            for (u32 v0 = lane; v0 < vecs; v0 += 32 * kRowBatch) {
                uint4 v[kRowBatch];
#pragma unroll
                for (u32 i = 0; i < kRowBatch; ++i) {
                    v[i] = make_uint4(0, 0, 0, 0);
                    if (held && v0 + 32 * i < vecs) v[i] = x_row[v0 + 32 * i];
                }
#pragma unroll
                for (u32 i = 0; i < kRowBatch; ++i) {
                    const u32 at = v0 + 32 * i;
                    if (at >= vecs) break;
                    out_row[at] = biased ? biased_vector(bias_0, bias_1, static_cast<u64>(t) * vecs + at, v[i], held)
                                         : from_zero(v[i]);
                }
            }
            if (slot) reinterpret_cast<float*>(p.out_topk_weights)[static_cast<u64>(t) * p.topk + lane] = 0.f + weight;
        }
    }
    phase_mark(kCombinePhases, 4);
    if (last_cta(reinterpret_cast<u64*>(pt.base + p.off_recv_arrive))) {
        publish(pt, p.off_ready, p.op);
        if (!timed_out(status)) publish(pt, p.off_released, p.op);
        mirror_status(pt, p);
    }
}

// The two directions' kernels: each CTA runs the send half, then the receive half (the halves' status records stay
// apart: gc_moe::kNormalDispatchSend / Recv, kNormalCombineSend / Recv); the combine's CTAs first rewrite send_head.
extern "C" __global__ void __launch_bounds__(kThreads, 1) gc_ep_normal_dispatch(const PeerTable pt,
                                                                            const EpNormalParams p) {
    phase_mark(kDispatchPhases, 0);
    if (pt.world_size == 1) {
        dispatch_direct(pt, p);
    } else {
        dispatch_send(pt, p);
        dispatch_recv(pt, p);
    }
    phase_mark(kDispatchPhases, 5);
}

extern "C" __global__ void __launch_bounds__(kThreads, 1) gc_ep_normal_combine(const PeerTable pt,
                                                                           const EpNormalParams p) {
    phase_mark(kCombinePhases, 0);
    combine_heads(pt, p);
    if (pt.world_size == 1) {  // one rank: the rows are read from x in place
        phase_mark(kCombinePhases, 1);  // the send half's marks, so that a phase read finds every one
        phase_mark(kCombinePhases, 2);
        combine_direct(pt, p);
    } else {
        combine_send(pt, p);
        combine_recv(pt, p);
    }
    phase_mark(kCombinePhases, 5);
}
