// SM90 FP8xFP8 grouped expert GEMM over ring blocks, with the fused W1 (SwiGLU + FP8 requant) or W2 (BF16) epilogue.
//
// Operand swap (paper §4.4): the expert's weight rows are the WGMMA M operand (each consumer warpgroup owns
// GC_M_SUB slabs of 64 rows) and the block's tokens are N. A task is (ring block, tile of kRows weight rows); a
// persistent grid walks the tasks with stride gridDim.x. Per K128 step the weight tile [kRows x 128] and the token
// tile [GC_BM x 128] arrive by TMA (128-byte swizzle, weights with an evict-first L2 hint) together with the
// block's FP32 1x128 token scales (bulk copy of a transposed [K/128, rows] array) into a GC_STAGES-deep mbarrier
// ring. Each K128 step is accumulated in its own FP32 registers and promoted into the main accumulator with
// w_scale * x_scale (DeepGEMM's recipe (1, 128, 128)); WGMMA N is the block's valid rows rounded up to 8.
//
// Variants (defines): GC_PRODUCER_WG=1 is the 384-thread pipelined kernel (a producer warpgroup at 40 registers
// runs ahead across tasks); GC_PRODUCER_WG=0 the 256-thread non-pipelined one (consumer thread 0 issues the loads of
// its own task only). GC_EPI=1: W1 epilogue, L1 rows interleaved by 8 (layouts.interleave_gate_up), so the thread
// holding gate row r of a 16-row slab holds up row r+8 and SwiGLU is thread-local; the 256 rows of a task are the
// 128 intermediate columns of one FP32 requant group (amax reduced across the 8 consumer warps). GC_EPI=2: W2
// epilogue, BF16 partial rows. Block table rows: (local expert, valid rows, first row); rows live in the same
// grouped order in every row-indexed array (x, routing weights, intermediate, outputs).
//
// GC_OPERATOR=1 compiles role2 of the GC-MoE operator instead (entry gc_sm90_fp8_role2: the FP8 pieces at the end
// of this file, the grid body in sm90/role2_gemm.cuh shared with the FP8xFP4 kernel): one persistent grid running
// both GEMMs over the token ring of the operator workspace, reading the block table role1 publishes and handshaking
// with role1 and with itself through the ring signals. GC_OPERATOR=0 (default) is the standalone kernel (its grid
// body in sm90/standalone_gemm.cuh, shared with the FP8xFP4 kernel); both run the same consumer K loop (consume).
// tests/operator/test_role2_operator_host.py keeps the standalone cubins' hashes
// (tests/data/sm90_fp8_standalone_cubins.json, rewritten by scripts/record_sm90_cubins.py when the kernel changes).
#include <cuda_fp8.h>

#include "sm90/grouped.cuh"
#if GC_OPERATOR
#include "sm90/role2_ring.cuh"
#endif

#ifndef GC_BM
#define GC_BM 16
#endif
#ifndef GC_M_SUB
#define GC_M_SUB 2
#endif
#ifndef GC_STAGES
#define GC_STAGES 5
#endif
#ifndef GC_PRODUCER_WG
#define GC_PRODUCER_WG 1
#endif
#ifndef GC_EPI
#define GC_EPI 1
#endif
#ifndef GC_FAST_MATH
#define GC_FAST_MATH 1
#endif
#ifndef GC_CLUSTER
#define GC_CLUSTER 0
#endif

namespace gc_moe {
namespace sm90 {

constexpr int kBM = GC_BM;
constexpr int kMSub = GC_M_SUB;
constexpr int kStages = GC_STAGES;
constexpr int kProducerWG = GC_PRODUCER_WG;
constexpr int kEpi = GC_EPI;
// Cluster pairs (standalone, pipelined): the two CTAs of a cluster run the same weight tile against an expert's two
// ring blocks and stream it once (PairTask in grouped.cuh; each CTA's producer loads half the tile, multicast to
// both), so each stage is written by both producers and freed by both CTAs' consumers.
constexpr bool kCluster = GC_CLUSTER != 0 && !GC_OPERATOR;
constexpr int kConsumerWGs = 2;
[[maybe_unused]] constexpr int kConsumerThreads = kConsumerWGs * 128;  // the W1 epilogue's and role2's barriers
constexpr int kThreads = (kConsumerWGs + kProducerWG) * 128;
constexpr int kRows = kConsumerWGs * kMSub * 64;
constexpr int kBK = 128;
constexpr int kAcc = kBM / 2;  // accumulator registers per 64-row slab and thread (m64nBMk32)
constexpr u32 kWBytes = kRows * kBK;
constexpr u32 kXBytes = kBM * kBK;
constexpr u32 kSBytes = kBM * 4;
constexpr u32 kStageTx = kWBytes + kXBytes + kSBytes;
constexpr u32 kOffX = kStages * kWBytes;
constexpr u32 kOffS = kOffX + kStages * kXBytes;
constexpr u32 kOffRed = kOffS + kStages * kSBytes;
constexpr u32 kOffOut = kOffRed + kConsumerWGs * 4 * kBM * 4;  // after the amax of each consumer warp per column
// Operator mode: the W2 epilogue's BF16 tile [kBM tokens][kRows] (rows padded by 16 bytes against bank conflicts)
// for 16-byte scatter stores, and 16 bytes holding the pool block count and the producer's stop slot.
constexpr u32 kOutPitch = kRows * 2 + 16;
constexpr u32 kOutBytes = GC_OPERATOR ? kBM * kOutPitch + 16 : 0;
constexpr u32 kOffBar = kOffOut + kOutBytes;
constexpr u32 kSmemBytes = kOffBar + 2 * kStages * 8 + 1024;  // + slack to align the base to 1024

static_assert(kBM % 8 == 0 && kBM >= 8 && kBM <= 64, "GC_BM: WGMMA N must be a multiple of 8 up to 64");
static_assert(kEpi != 1 || kMSub == 2, "W1 epilogue: a task must cover the 256 rows of one 128-column requant group");
static_assert(kEpi == 1 || kEpi == 2, "GC_EPI: 1 (W1) or 2 (W2)");
static_assert(kSmemBytes <= 232448, "shared memory: too many stages for this tile");
static_assert(!kCluster || kProducerWG, "GC_CLUSTER: the pipelined variant only");

using Pipeline = StagePipeline<kOffBar, kStages>;

// Issues the weight tile, token tile and token scales of K step kb into stage `it % kStages` (which is free); in a
// cluster pair, half the weight tile per CTA (load_weights_pair, grouped.cuh).
__device__ __forceinline__ void issue(const Pipeline& pipe, u32 it, const Task& t, int kb, const TensorMap* tm_w,
                                      const TensorMap* tm_x, const float* x_sf_t, int n_w, int rows_total,
                                      u64 policy_w, u64 policy_x, bool multicast = false, u32 rank = 0) {
    const u32 stage = it % kStages;
    const u32 full = pipe.full(stage);
    mbar_arrive_expect_tx(full, kStageTx);
    const u32 w_dst = pipe.base + stage * kWBytes;
    const int w_row = t.expert * n_w + t.tile * kRows;
    if constexpr (kCluster) {
        load_weights_pair<kWBytes>(w_dst, tm_w, kb * kBK, w_row, kRows / 2, full, policy_w, multicast, rank);
    } else {
        tma_load_2d(w_dst, tm_w, kb * kBK, w_row, full, policy_w);
    }
    tma_load_2d(pipe.base + kOffX + stage * kXBytes, tm_x, kb * kBK, t.row_off, full, policy_x);
    bulk_load(pipe.base + kOffS + stage * kSBytes, x_sf_t + static_cast<size_t>(kb) * rows_total + t.row_off, kSBytes,
              full);
}

// The K128 step's four K32 WGMMAs for every slab, with N columns (the block's valid rows rounded up to 8): tmp is
// overwritten (the first MMA of each slab does not accumulate).
template <int N>
__device__ __forceinline__ void mma_k128(float (&tmp)[kMSub][N / 2], u32 a_base, u32 b_base) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
#pragma unroll
        for (int s = 0; s < kMSub; ++s) {
            Wgmma<N>::mma(tmp[s], smem_desc_sw128(a_base + s * 64 * kBK + k * 32), smem_desc_sw128(b_base + k * 32),
                          k > 0);
        }
    }
}

// Scale rows of this thread's slabs for epilogue Epi: W1 tiles hold gate block `tile` and up block I/128 + tile;
// W2: the 128-row block of each slab.
template <int Epi>
__device__ __forceinline__ void scale_rows(const Task& t, int cw, int row_blocks, int kb_count, const float* w_sf,
                                           const float* (&ws_row)[2]) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
        const int block = Epi == 1 ? t.tile + s * (row_blocks / 2)
                                   : (t.tile * kRows + (cw * kMSub + min(s, kMSub - 1)) * 64) / 128;
        ws_row[s] = w_sf + (static_cast<size_t>(t.expert) * row_blocks + block) * kb_count;
    }
}

// Promotes one K128 step of N columns into the main accumulator with w_scale * x_scale (columns from N on stay).
template <int Epi, int N>
__device__ __forceinline__ void promote(float (&acc)[kMSub][kAcc], const float (&tmp)[kMSub][N / 2], float ws0,
                                        float ws1, const float (&xsr)[N / 4]) {
#pragma unroll
    for (int s = 0; s < kMSub; ++s) {
#pragma unroll
        for (int i = 0; i < N / 2; ++i) {
            // W1: registers i%4 in {0,1} are gate rows (scale ws0), {2,3} up rows (ws1); W2: slab s's block.
            const float ws = Epi == 1 ? ((i & 2) ? ws1 : ws0) : (s == 0 ? ws0 : ws1);
            acc[s][i] = fmaf(tmp[s][i], ws * xsr[2 * (i / 4) + (i & 1)], acc[s][i]);
        }
    }
}

// The consumer K loop of one task with N token columns (with_wgmma_n picks N once per task: see grouped.cuh). Per
// K128 step: wait for the stage, its four K32 WGMMAs per slab into a fresh (zeroed) accumulator set, wait for
// them, free the stage, promote. Returns false when a wait gives up.
template <int Epi, int N, typename WaitFull, typename Load>
__device__ __forceinline__ bool consume_n(const Pipeline& pipe, const u8* smem, u32& it, int kb_count,
                                         const float* const (&ws_row)[2], int cw, int lane, int local_tid,
                                         float (&acc)[kMSub][kAcc], WaitFull& wait_full, Load& load) {
    for (int kb = 0; kb < kb_count; ++kb, ++it) {
        const float ws0 = __ldg(ws_row[0] + kb), ws1 = __ldg(ws_row[1] + kb);
        const u32 stage = it % kStages;
        if (!wait_full(pipe.full(stage), (it / kStages) & 1)) return false;
        const float* xs = reinterpret_cast<const float*>(smem + kOffS + stage * kSBytes);
        float xsr[N / 4];
#pragma unroll
        for (int c = 0; c < N / 4; ++c) xsr[c] = xs[acc_col(4 * (c / 2) + (c & 1), lane)];
        float tmp[kMSub][N / 2];
        zero(tmp);
        fence_operands(tmp);
        wgmma_fence();
        mma_k128<N>(tmp, pipe.base + stage * kWBytes + cw * kMSub * 64 * kBK, pipe.base + kOffX + stage * kXBytes);
        wgmma_commit();
        wgmma_wait<0>();
        fence_operands(tmp);
        __syncwarp();
        if (lane == 0) release_stage<kCluster>(pipe.empty(stage));
        if (!kProducerWG && local_tid == 0 && kb + kStages < kb_count) {
            if (!load(it + kStages, kb + kStages)) return false;
        }
        __syncwarp();
        promote<Epi, N>(acc, tmp, ws0, ws1, xsr);
    }
    return true;
}

// The consumer warpgroups' K loop of one task for epilogue Epi, accumulating into `acc` (zeroed here); the
// standalone kernel and role2 (operator mode: one grid runs both GEMMs) share it.
// `wait_full(bar, parity)` waits for a filled stage; `load(slot, kb)` issues K step kb into pipeline slot `slot`
// (non-pipelined variant only: consumer thread 0 loads its own task). Returns false when a wait gives up.
template <int Epi, typename WaitFull, typename Load>
__device__ __forceinline__ bool consume(const Pipeline& pipe, const u8* smem, u32& it, const Task& t, int kb_count,
                                       int row_blocks, const float* w_sf, int cw, int lane, int local_tid,
                                       float (&acc)[kMSub][kAcc], WaitFull&& wait_full, Load&& load) {
    if (!kProducerWG && local_tid == 0) {
        for (int kb = 0; kb < min(kStages, kb_count); ++kb) {
            if (!load(it + kb, kb)) return false;
        }
    }
    __syncwarp();
    zero(acc);
    const float* ws_row[2];
    scale_rows<Epi>(t, cw, row_blocks, kb_count, w_sf, ws_row);
    bool ok = true;
    with_wgmma_n<kBM>(wgmma_n8<kBM>(t.valid), [&](auto n) {
        ok = consume_n<Epi, decltype(n)::value>(pipe, smem, it, kb_count, ws_row, cw, lane, local_tid, acc, wait_full,
                                                load);
    });
    return ok;
}

#include "sm90/epilogue_w1.cuh"

#if GC_OPERATOR
// ============================================================================================ role2 (operator mode)
// The FP8xFP8 pieces of role2 (the grid, ring handshake and W2 scatter are sm90/role2_gemm.cuh's).
constexpr u32 kConsumerBarrier = 1;  // the W1 epilogue's barrier is over all 256 consumer threads too

// role2_gemm.cuh's hooks. W1 of a ring block: weights [E * 2I, H] against l1_acts with role1's FP32 1x128 token
// scales; W2: weights [E * H, I] against l2_acts with the W1 epilogue's FP32 1x128 scales.
__device__ __forceinline__ void op_issue(const OpArgs& a, const Pipeline& pipe, u32 it, const OpTask& ot,
                                         const Task& t, int kb, const OpMaps& maps) {
    if (ot.w1) {
        issue(pipe, it, t, kb, maps.w1, maps.l1, a.at<float>(a.off.l1_acts_sf), 2 * a.p.inter, a.off.ring_rows,
              maps.policy_w, maps.policy_x);
    } else {
        issue(pipe, it, t, kb, maps.w2, maps.l2, a.at<float>(a.off.l2_acts_sf), a.p.hidden, a.off.ring_rows,
              maps.policy_w, maps.policy_x);
    }
}

template <int Epi, typename WaitFull, typename Load>
__device__ __forceinline__ bool op_consume(const OpArgs& a, const Pipeline& pipe, const u8* smem, u32& it,
                                           const Task& t, int cw, int /*warp*/, int lane, int local_tid,
                                           float (&acc)[kMSub][kAcc], WaitFull&& wait_full, Load&& load) {
    if constexpr (Epi == 1) {
        return consume<1>(pipe, smem, it, t, static_cast<int>(a.p.hidden) / kBK, 2 * a.p.inter / 128,
                          reinterpret_cast<const float*>(a.p.w1_sf), cw, lane, local_tid, acc, wait_full, load);
    } else {
        return consume<2>(pipe, smem, it, t, static_cast<int>(a.p.inter) / kBK, a.p.hidden / 128,
                          reinterpret_cast<const float*>(a.p.w2_sf), cw, lane, local_tid, acc, wait_full, load);
    }
}

__device__ __forceinline__ void op_epilogue_w1(const OpArgs& a, float (&acc)[kMSub][kAcc], const Task& t, int cw,
                                               int warp, int lane, float* red) {
    epilogue_w1<false>(acc, t, cw, warp, lane, red, a.at<const float>(a.off.l1_routing_weights),
                       a.at<u8>(a.off.l2_acts), a.at<float>(a.off.l2_acts_sf), a.p.inter, a.off.ring_rows, a.p.clamp,
                       a.p.alpha);
}

#include "sm90/role2_gemm.cuh"

}  // namespace sm90
}  // namespace gc_moe

using namespace gc_moe;
using namespace gc_moe::sm90;

// tm_w1: W1 weights [E * 2I, H] E4M3 (rows interleaved gate/up by 8, box 128 x 256); tm_w2: W2 [E * H, I] (box
// 128 x 256); tm_l1 / tm_l2: the workspace's l1_acts / l2_acts (box 128 x GC_BM); the rest: role2_gemm.cuh.
extern "C" __global__ void __launch_bounds__(kThreads, 1)
    gc_sm90_fp8_role2(const __grid_constant__ TensorMap tm_w1, const __grid_constant__ TensorMap tm_w2,
                      const __grid_constant__ TensorMap tm_l1, const __grid_constant__ TensorMap tm_l2,
                      const __grid_constant__ PeerTable peers, const __grid_constant__ WorkspaceOffsets off,
                      const __grid_constant__ Role2Params params) {
    role2_body(&tm_w1, &tm_w2, &tm_l1, &tm_l2, peers, off, params);
}

#else  // the standalone kernel

constexpr bool kUe8m0 = false;  // the W1 epilogue's FP32 1x128 scales

__device__ __forceinline__ void sa_issue(const StandaloneArgs& a, const Pipeline& pipe, u32 it, const Task& t, int kb,
                                         u64 policy_w, u64 policy_x, bool multicast, u32 rank) {
    issue(pipe, it, t, kb, a.tm_w, a.tm_x, a.x_sf_t, a.n_w, a.rows_total, policy_w, policy_x, multicast, rank);
}

template <typename WaitFull, typename Load>
__device__ __forceinline__ bool sa_consume(const StandaloneArgs& a, const Pipeline& pipe, const u8* smem, u32& it,
                                           const Task& t, int cw, int /*warp*/, int lane, int local_tid,
                                           float (&acc)[kMSub][kAcc], WaitFull&& wait_full, Load&& load) {
    return consume<kEpi>(pipe, smem, it, t, a.k / kBK, a.n_w / 128, a.w_sf, cw, lane, local_tid, acc, wait_full,
                         load);
}

#include "sm90/standalone_gemm.cuh"

}  // namespace sm90
}  // namespace gc_moe

using namespace gc_moe;
using namespace gc_moe::sm90;

// tm_w: [E * n_w, k] FP8 (box 128 x kRows; half of it per CTA in cluster pairs); tm_x: [rows_total, k] FP8 (box
// 128 x GC_BM); w_sf: FP32 [E, n_w/128, k/128]; x_sf_t: FP32 [k/128, rows_total]; blocks: int32 [*, 3] (cluster
// pairs: grouping's pair table); *num_blocks blocks are live.
// W1 (GC_EPI=1): n_w = 2I (interleaved), out = FP8 [rows_total, I], out_sf_t = FP32 [I/128, rows_total].
// W2 (GC_EPI=2): n_w = H, out = BF16 [rows_total, H], out_sf_t and routing_w unused. clamp = +inf for none.
GC_STANDALONE_ENTRY(gc_sm90_fp8_grouped_gemm)

#endif  // GC_OPERATOR
