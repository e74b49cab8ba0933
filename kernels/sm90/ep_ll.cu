// Low-latency expert-parallel dispatch and combine behind the deep_ep facade (DeepEP's low_latency_dispatch /
// low_latency_combine semantics), as four kernels so that a caller can split each direction with a receive hook.
//
// Workspace (symmetric, one copy per rank; offsets in EpLlParams). Every persistent word is generation-tagged and
// indexed by the generation's parity, so replays need no host reset and two calls of a kind may be in flight:
//   seq[2]                    last generation taken by dispatch send / combine send (this rank only)
//   arrive[4][2]              grid arrival counter per kernel and parity (this rank only; the last CTA resets it)
//   consumed[2][2]            last generation whose stage this rank has read, per direction and parity (read by peers)
//   ready[P][2]               combine readiness of source rank q for this rank (written by q)
//   counts[E][2]              (generation << 32) | rows of (local expert le, source q) at le*P + q (written by q)
//   recv stage [2][e][P][Tmax] rows of 16 bytes (token, slot) + payload (BF16 row, or FP8 row + FP32 1x128 scales)
//   combine stage [2][Tmax][k] BF16 rows, on the tokens' source rank
//
// Ordering (n = the call's generation, p = n & 1):
//  * dispatch send, warp per global expert e (owner rank r): waits (bounded) until consumed[0][p] on r >= n - 2, so
//    the stage it overwrites was read; stores the rows (peer stores), fence.sys, __syncwarp, then lane 0 stores
//    counts[le*P + own][p] = (n << 32) | rows on r with st.release.sys.
//  * dispatch receive: a warp acquires the counts of every source of its local expert (ld.acquire.sys, wait until
//    the tag reaches n; a later tag is a protocol error) and __syncwarp()s before any lane reads the stage. The grid's
//    last CTA (fence.sys before and after the arrival atomic) stores consumed[0][p] = n with st.release.sys.
//  * combine send: waits until consumed[1][p] on the source rank >= n - 2, stores the rows, and the last CTA stores
//    ready[own][p] = n on every rank with st.release.sys (after the arrival fences: every CTA's rows precede it).
//  * combine receive: threads acquire ready[q][p] >= n for every q and bar.sync before the reduction; the last CTA
//    stores consumed[1][p] = n.
//  * The generation of a call: send kernels read seq at their start and the last CTA stores seq = n and the call's
//    own word call_gen = n, which the receive kernel of that call reads (stream order: it runs after the send).
// Every wait is bounded by timeout_ns and gives up once the kernel's status record holds an error; a failed wait
// leaves its words unpublished (so consumers report too) and every kernel still completes.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "common/peer_table.cuh"
#include "common/status.cuh"
#include "common/sync.cuh"
#include "sm90/ep_ll_params.cuh"

namespace {

using gc_moe::EpLlParams;
using gc_moe::KernelStatus;
using gc_moe::PeerTable;
using gc_moe::peer_ptr;
using gc_moe::u32;
using gc_moe::u64;
typedef unsigned char u8;

constexpr u32 kThreads = 256;
constexpr u32 kWarps = kThreads / 32;
constexpr u32 kCombineColumns = 256;  // combine receive: one warp, 8 BF16 columns (16 bytes) per lane

enum LlKernel : u32 { kDispatchSend = 0, kDispatchRecv = 1, kCombineSend = 2, kCombineRecv = 3 };

__device__ __forceinline__ u64* word(const PeerTable& pt, u64 offset) {
    return reinterpret_cast<u64*>(pt.base + offset);
}

__device__ __forceinline__ KernelStatus* status_of(const PeerTable& pt, const EpLlParams& p, LlKernel k) {
    return reinterpret_cast<KernelStatus*>(pt.base + p.off_status) + k;
}

// Spins until *flag >= target (acquire, system scope); gives up after timeout_ns or once `status` holds an error.
__device__ __forceinline__ bool wait_flag(const u64* flag, u64 target, const EpLlParams& p, KernelStatus* status, u32 site) {
    const u64 start = gc_moe::globaltimer_ns();
    u64 seen = gc_moe::ld_acquire_sys(flag);
    while (seen < target) {
        if (*reinterpret_cast<volatile u32*>(&status->code) != gc_moe::kStatusOk) return false;
        if (gc_moe::globaltimer_ns() - start > p.timeout_ns) {
            gc_moe::report_status(status, gc_moe::kStatusTimeout, site, seen, target);
            return false;
        }
        __nanosleep(GC_MOE_SPIN_SLEEP_NS);
        seen = gc_moe::ld_acquire_sys(flag);
    }
    return true;
}

// Lane 0 waits until `rank` has read generation n - 2 of this parity's stage in direction `dir` (0 dispatch,
// 1 combine); the result is broadcast to the warp.
__device__ __forceinline__ bool wait_consumed(const PeerTable& pt, const EpLlParams& p, u32 rank, u32 dir, u64 gen,
                              KernelStatus* status) {
    bool ok = true;
    if (gen > 2 && (threadIdx.x & 31) == 0) {
        const u64* flag = peer_ptr<u64>(pt, rank, p.off_consumed + (dir * 2 + (gen & 1)) * 8);
        ok = wait_flag(flag, gen - 2, p, status, gc_moe::kLlSiteConsumed << 16 | rank);
    }
    return __shfl_sync(~0u, ok, 0);
}

// Generation-free grid arrival: true in every thread of the CTA that arrives last (which also resets the counter
// for the next launch of this kernel and parity). Fences on both sides of the atomic make every CTA's stores
// visible (system scope) to whatever the last CTA publishes next.
__device__ __forceinline__ bool last_cta(u64* counter) {
    __shared__ u32 is_last;
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        const u64 old = atomicAdd(counter, 1ull);
        is_last = old == gridDim.x - 1;
        if (is_last) {
            atomicExch(counter, 0ull);
            __threadfence_system();
        }
    }
    __syncthreads();
    return is_last != 0;
}

__device__ __forceinline__ long long routed_expert(const EpLlParams& p, u32 f) {
    return p.idx_bytes == 8 ? reinterpret_cast<const long long*>(p.topk_idx)[f]
                            : static_cast<long long>(reinterpret_cast<const int*>(p.topk_idx)[f]);
}

__device__ __forceinline__ float bf16_lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }

// DeepEP's FP8 scale rule: amax floored at 1e-4; scale = 448 / amax, stored inverse = amax * (1/448), or both
// rounded to the power of two at or above the inverse.
__device__ __forceinline__ void fp8_scales(float amax, bool round_scale, float& scale, float& scale_inv) {
    scale_inv = amax * (1.0f / 448.0f);
    scale = 448.0f / amax;
    if (round_scale) {
        const u32 bits = __float_as_uint(scale_inv);
        const int exp = static_cast<int>((bits >> 23) & 0xff) - 127 + ((bits & 0x7fffff) != 0);
        scale_inv = __uint_as_float(static_cast<u32>(exp + 127) << 23);
        scale = __uint_as_float(static_cast<u32>(127 - exp) << 23);
    }
}

__device__ __forceinline__ u32 fp8x4(float a, float b, float c, float d) {
    const u32 q0 = __nv_cvt_float_to_fp8(a, __NV_SATFINITE, __NV_E4M3);
    const u32 q1 = __nv_cvt_float_to_fp8(b, __NV_SATFINITE, __NV_E4M3);
    const u32 q2 = __nv_cvt_float_to_fp8(c, __NV_SATFINITE, __NV_E4M3);
    const u32 q3 = __nv_cvt_float_to_fp8(d, __NV_SATFINITE, __NV_E4M3);
    return q0 | q1 << 8 | q2 << 16 | q3 << 24;
}

// One warp stores token t (slot k) into a receive-stage row: (t, k), then the BF16 row or its FP8 quantization.
// FP8: each lane holds 8 columns per step, so a 128-column scale group is a half warp (shuffles within 16 lanes).
__device__ __forceinline__ void stage_row(const EpLlParams& p, u8* row, u32 t, u32 k, u32 lane) {
    if (lane == 0) *reinterpret_cast<int4*>(row) = make_int4(static_cast<int>(t), static_cast<int>(k), 0, 0);
    const u32 vecs = p.hidden / 8;
    const uint4* src = reinterpret_cast<const uint4*>(p.x) + static_cast<u64>(t) * vecs;
    if (!(p.flags & gc_moe::kLlFp8)) {
        uint4* dst = reinterpret_cast<uint4*>(row + 16);
        for (u32 v = lane; v < vecs; v += 32) dst[v] = __ldg(src + v);
        return;
    }
    u8* payload = row + 16;
    float* scales = reinterpret_cast<float*>(row + 16 + p.hidden);
    for (u32 v0 = 0; v0 < vecs; v0 += 32) {
        const u32 v = v0 + lane;
        const bool valid = v < vecs;  // vecs is a multiple of 16: a half warp is all valid or all not
        const uint4 raw = valid ? __ldg(src + v) : make_uint4(0, 0, 0, 0);
        const float f[8] = {bf16_lo(raw.x), bf16_hi(raw.x), bf16_lo(raw.y), bf16_hi(raw.y),
                            bf16_lo(raw.z), bf16_hi(raw.z), bf16_lo(raw.w), bf16_hi(raw.w)};
        float amax = 1e-4f;
#pragma unroll
        for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(f[j]));
#pragma unroll
        for (int o = 8; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(~0u, amax, o));
        float scale, scale_inv;
        fp8_scales(amax, p.flags & gc_moe::kLlRoundScale, scale, scale_inv);
        if (valid) {
            *reinterpret_cast<uint2*>(payload + static_cast<u64>(v) * 8) =
                make_uint2(fp8x4(f[0] * scale, f[1] * scale, f[2] * scale, f[3] * scale),
                           fp8x4(f[4] * scale, f[5] * scale, f[6] * scale, f[7] * scale));
            if (v % 16 == 0) scales[v / 16] = scale_inv;
        }
    }
}

__device__ __forceinline__ void copy_vectors(uint4* dst, const uint4* src, u32 count, u32 lane) {
    for (u32 v = lane; v < count; v += 32) dst[v] = src[v];
}

__device__ __forceinline__ u32 warp_sum(u32 v) {
#pragma unroll
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(~0u, v, o);
    return v;
}

}  // namespace

extern "C" __global__ void __launch_bounds__(kThreads, 1) gc_ep_ll_dispatch_send(const PeerTable pt,
                                                                             const EpLlParams p) {
    KernelStatus* status = status_of(pt, p, kDispatchSend);
    u64* seq = word(pt, p.off_seq);
    const u64 gen = *reinterpret_cast<volatile u64*>(seq) + 1;
    const u32 parity = static_cast<u32>(gen & 1), lane = threadIdx.x & 31;
    const u32 ranks = static_cast<u32>(pt.world_size), own = static_cast<u32>(pt.rank);
    const u32 entries = p.num_tokens * p.topk;
    for (u32 e = blockIdx.x * kWarps + threadIdx.x / 32; e < p.num_experts; e += gridDim.x * kWarps) {
        const u32 owner = e / p.local_experts, le = e % p.local_experts;
        if (!wait_consumed(pt, p, owner, 0, gen, status)) continue;  // count left unpublished: the owner reports
        const u64 list = (static_cast<u64>(parity) * p.num_experts + le * ranks + own) * p.max_tokens;
        u8* stage = peer_ptr<u8>(pt, owner, p.off_recv_stage + list * p.row_stride);
        u32 rows = 0;
        for (u32 f0 = 0; f0 < entries; f0 += 32) {
            const u32 f = f0 + lane;
            u32 hits = __ballot_sync(~0u, f < entries && routed_expert(p, f) == static_cast<long long>(e));
            while (hits) {
                const u32 entry = f0 + __ffs(hits) - 1;
                hits &= hits - 1;
                stage_row(p, stage + static_cast<u64>(rows) * p.row_stride, entry / p.topk, entry % p.topk, lane);
                ++rows;
            }
        }
        __threadfence_system();
        __syncwarp();
        if (lane == 0) {
            u64* count = peer_ptr<u64>(pt, owner, p.off_counts + ((le * ranks + own) * 2 + parity) * 8);
            gc_moe::st_release_sys(count, gen << 32 | rows);
        }
    }
    if (last_cta(word(pt, p.off_arrive + (kDispatchSend * 2 + parity) * 8)) && threadIdx.x == 0) {
        *seq = gen;
        *reinterpret_cast<u64*>(p.call_gen) = gen;
    }
}

extern "C" __global__ void __launch_bounds__(kThreads, 1) gc_ep_ll_dispatch_recv(const PeerTable pt,
                                                                             const EpLlParams p) {
    KernelStatus* status = status_of(pt, p, kDispatchRecv);
    const u64 gen = *reinterpret_cast<volatile const u64*>(p.call_gen);
    const u32 parity = static_cast<u32>(gen & 1), lane = threadIdx.x & 31;
    const u32 ranks = static_cast<u32>(pt.world_size);
    const u32 chunks = (p.max_tokens + p.unit_rows - 1) / p.unit_rows;
    const u32 units = p.local_experts * ranks * chunks;
    const u64 slots = static_cast<u64>(ranks) * p.max_tokens;  // P * Tmax rows per local expert
    const bool fp8 = p.flags & gc_moe::kLlFp8, ue8m0 = p.flags & gc_moe::kLlUe8m0;
    const u32 groups = p.hidden / 128;
    for (u32 u = blockIdx.x * kWarps + threadIdx.x / 32; u < units; u += gridDim.x * kWarps) {
        const u32 le = u / (ranks * chunks), src = (u / chunks) % ranks, chunk = u % chunks;
        u32 before = 0, rows = 0, total = 0;
        bool ok = true;
        for (u32 q0 = 0; q0 < ranks; q0 += 32) {
            const u32 q = q0 + lane;
            u32 n = 0;
            bool lane_ok = true;
            if (q < ranks) {
                const u64* count = word(pt, p.off_counts + ((le * ranks + q) * 2 + parity) * 8);
                lane_ok = wait_flag(count, gen << 32, p, status, gc_moe::kLlSiteCount << 16 | q);
                const u64 v = gc_moe::ld_acquire_sys(count);
                if (lane_ok && (v >> 32) != gen) {
                    gc_moe::report_status(status, gc_moe::kStatusMismatch, gc_moe::kLlSiteCountAhead << 16 | q,
                                          v >> 32, gen);
                    lane_ok = false;
                }
                n = static_cast<u32>(v);
            }
            ok = __all_sync(~0u, lane_ok) && ok;
            before += warp_sum(q < src ? n : 0);
            rows += warp_sum(q == src ? n : 0);
            total += warp_sum(n);
        }
        __syncwarp();  // the lanes' acquires precede every lane's stage reads
        if (!ok) continue;
        if (chunk == 0 && lane == 0) {
            reinterpret_cast<long long*>(p.layout_range)[le * ranks + src] =
                static_cast<long long>(static_cast<u64>(before) << 32 | rows);
            if (src == 0) {
                reinterpret_cast<int*>(p.recv_count)[le] = static_cast<int>(total);
                if (p.recv_stats) atomicAdd(reinterpret_cast<int*>(p.recv_stats) + le, static_cast<int>(total));
            }
        }
        const u32 end = min(rows, (chunk + 1) * p.unit_rows);
        for (u32 j = chunk * p.unit_rows; j < end; ++j) {
            const u64 list = (static_cast<u64>(parity) * p.num_experts + le * ranks + src) * p.max_tokens;
            const u8* row = reinterpret_cast<const u8*>(pt.base + p.off_recv_stage) + (list + j) * p.row_stride;
            const u64 slot = static_cast<u64>(le) * slots + before + j;
            if (lane == 0) {
                const int4 origin = *reinterpret_cast<const int4*>(row);
                reinterpret_cast<int*>(p.src_info)[slot] = origin.x * static_cast<int>(p.topk) + origin.y;
            }
            const u32 row_bytes = fp8 ? p.hidden : 2 * p.hidden;
            copy_vectors(reinterpret_cast<uint4*>(p.recv_x + slot * row_bytes),
                         reinterpret_cast<const uint4*>(row + 16), row_bytes / 16, lane);
            if (!fp8) continue;
            const float* scales = reinterpret_cast<const float*>(row + 16 + p.hidden);
            for (u32 g = lane; g < groups; g += 32) {
                // Column-major per local expert (TMA-friendly): [e][groups][P*Tmax], or UE8M0 bytes packed four per
                // int32 along the groups: [e][groups/4][P*Tmax] words.
                if (ue8m0) {
                    const u64 w = (static_cast<u64>(le) * (groups / 4) + g / 4) * slots + before + j;
                    reinterpret_cast<u8*>(p.recv_scales)[w * 4 + g % 4] =
                        static_cast<u8>((__float_as_uint(scales[g]) >> 23) & 0xff);
                } else {
                    reinterpret_cast<float*>(p.recv_scales)[(static_cast<u64>(le) * groups + g) * slots + before + j] =
                        scales[g];
                }
            }
        }
    }
    if (last_cta(word(pt, p.off_arrive + (kDispatchRecv * 2 + parity) * 8)) && threadIdx.x == 0)
        gc_moe::st_release_sys(word(pt, p.off_consumed + (0 * 2 + parity) * 8), gen);
}

extern "C" __global__ void __launch_bounds__(kThreads, 1) gc_ep_ll_combine_send(const PeerTable pt,
                                                                            const EpLlParams p) {
    KernelStatus* status = status_of(pt, p, kCombineSend);
    u64* seq = word(pt, p.off_seq) + 1;
    const u64 gen = *reinterpret_cast<volatile u64*>(seq) + 1;
    const u32 parity = static_cast<u32>(gen & 1), lane = threadIdx.x & 31;
    const u32 ranks = static_cast<u32>(pt.world_size), own = static_cast<u32>(pt.rank);
    const u32 chunks = (p.max_tokens + p.unit_rows - 1) / p.unit_rows;
    const u32 units = p.local_experts * ranks * chunks;
    const u64 slots = static_cast<u64>(ranks) * p.max_tokens;
    const u32 row_vecs = p.hidden / 8;  // 16-byte vectors of a BF16 row
    for (u32 u = blockIdx.x * kWarps + threadIdx.x / 32; u < units; u += gridDim.x * kWarps) {
        const u32 le = u / (ranks * chunks), src = (u / chunks) % ranks, chunk = u % chunks;
        const u64 range = static_cast<u64>(reinterpret_cast<const long long*>(p.layout_range)[le * ranks + src]);
        const u32 before = static_cast<u32>(range >> 32), rows = static_cast<u32>(range);
        if (chunk * p.unit_rows >= rows) continue;
        if (!wait_consumed(pt, p, src, 1, gen, status)) continue;
        const u32 end = min(rows, (chunk + 1) * p.unit_rows);
        for (u32 j = chunk * p.unit_rows; j < end; ++j) {
            const u64 slot = static_cast<u64>(le) * slots + before + j;
            const u32 origin = static_cast<u32>(reinterpret_cast<const int*>(p.src_info)[slot]);
            const u64 dst_row = (static_cast<u64>(parity) * p.max_tokens + origin / p.topk) * p.topk + origin % p.topk;
            uint4* dst = peer_ptr<uint4>(pt, src, p.off_combine_stage + dst_row * 2 * p.hidden);
            const uint4* from = reinterpret_cast<const uint4*>(p.x) + slot * row_vecs;
            for (u32 v = lane; v < row_vecs; v += 32) dst[v] = __ldg(from + v);
        }
    }
    if (last_cta(word(pt, p.off_arrive + (kCombineSend * 2 + parity) * 8))) {
        for (u32 q = threadIdx.x; q < ranks; q += kThreads)
            gc_moe::st_release_sys(peer_ptr<u64>(pt, q, p.off_ready + (own * 2 + parity) * 8), gen);
        if (threadIdx.x == 0) {
            *seq = gen;
            *reinterpret_cast<u64*>(p.call_gen) = gen;
        }
    }
}

extern "C" __global__ void __launch_bounds__(kThreads, 1) gc_ep_ll_combine_recv(const PeerTable pt,
                                                                            const EpLlParams p) {
    KernelStatus* status = status_of(pt, p, kCombineRecv);
    const u64 gen = *reinterpret_cast<volatile const u64*>(p.call_gen);
    const u32 parity = static_cast<u32>(gen & 1), lane = threadIdx.x & 31;
    const u32 ranks = static_cast<u32>(pt.world_size);
    bool ok = true;
    for (u32 q = threadIdx.x; q < ranks; q += kThreads) {
        const u64* ready = word(pt, p.off_ready + (q * 2 + parity) * 8);
        if (!wait_flag(ready, gen, p, status, gc_moe::kLlSiteReady << 16 | q)) {
            ok = false;
        } else if (const u64 v = gc_moe::ld_acquire_sys(ready); v != gen) {
            gc_moe::report_status(status, gc_moe::kStatusMismatch, gc_moe::kLlSiteReadyAhead << 16 | q, v, gen);
            ok = false;
        }
    }
    ok = __syncthreads_and(ok);  // the acquires precede every thread's stage reads
    const u32 chunks = (p.hidden + kCombineColumns - 1) / kCombineColumns;
    const u32 units = ok ? p.num_tokens * chunks : 0;
    const u8* stage = reinterpret_cast<const u8*>(pt.base + p.off_combine_stage);
    for (u32 u = blockIdx.x * kWarps + threadIdx.x / 32; u < units; u += gridDim.x * kWarps) {
        const u32 t = u / chunks, col = (u % chunks) * kCombineColumns + lane * 8;
        if (col >= p.hidden) continue;
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (u32 k = 0; k < p.topk; ++k) {
            if (routed_expert(p, t * p.topk + k) < 0) continue;
            const float w = reinterpret_cast<const float*>(p.topk_weights)[t * p.topk + k];
            const u64 row = (static_cast<u64>(parity) * p.max_tokens + t) * p.topk + k;
            const uint4 v = *reinterpret_cast<const uint4*>(stage + (row * p.hidden + col) * 2);
            const float f[8] = {bf16_lo(v.x), bf16_hi(v.x), bf16_lo(v.y), bf16_hi(v.y),
                                bf16_lo(v.z), bf16_hi(v.z), bf16_lo(v.w), bf16_hi(v.w)};
            // Separately rounded multiply and add (no FMA contraction): the torch reference reproduces it bit for bit.
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[j] = __fadd_rn(acc[j], __fmul_rn(w, f[j]));
        }
        __nv_bfloat162 out[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) out[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
        *reinterpret_cast<uint4*>(reinterpret_cast<__nv_bfloat16*>(p.out) + static_cast<u64>(t) * p.hidden + col) =
            *reinterpret_cast<const uint4*>(out);
    }
    if (last_cta(word(pt, p.off_arrive + (kCombineRecv * 2 + parity) * 8)) && threadIdx.x == 0)
        gc_moe::st_release_sys(word(pt, p.off_consumed + (1 * 2 + parity) * 8), gen);
}
