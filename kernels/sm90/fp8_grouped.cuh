// The FP8xFP8 grouped-GEMM mainloop of the SM90 kernels that stream FP8 weights with FP32 128x128 block scales:
// role2_gemm_fp8xfp8.cu (the routed experts' grouped GEMM, standalone and role2 of the operator) and role4_shared.cu
// (role4, the fused shared expert). One source of GEMM truth: the variant constants and shared-memory layout, the
// stage issue of a K128 step (weights, tokens, the tokens' FP32 1x128 scales), the WGMMAs of a step, the promotion
// with w_scale * x_scale and the consumer K loop (consume) live here once; each kernel source adds its grid body and
// epilogues. Defines: GC_BM, GC_M_SUB, GC_STAGES, GC_PRODUCER_WG, GC_EPI, GC_FAST_MATH, GC_CLUSTER, GC_OPERATOR
// (role2_gemm_fp8xfp8.cu's header comment says what each selects).
#pragma once

#include <cuda_fp8.h>

#include "sm90/grouped.cuh"
#include "sm90/gemm_variant.cuh"

namespace gc_moe {
namespace sm90 {

constexpr int kRows = kConsumerWGs * kMSub * 64;
constexpr u32 kWBytes = kRows * kBK;
constexpr u32 kXBytes = kBM * kBK;
constexpr u32 kSBytes = kBM * 4;
constexpr u32 kStageTx = kWBytes + kXBytes + kSBytes;
constexpr u32 kOffX = kStages * kWBytes;
constexpr u32 kOffS = kOffX + kStages * kXBytes;
constexpr u32 kOffRed = kOffS + kStages * kSBytes;
constexpr u32 kOffOut = kOffRed + kConsumerWGs * 4 * kBM * 4;  // after the amax of each consumer warp per column
constexpr u32 kOutPitch = out_pitch(kRows);  // the operator-mode W2 tile (gemm_variant.cuh)
constexpr u32 kOffBar = kOffOut + out_bytes(kRows);
constexpr u32 kSmemBytes = smem_bytes(kOffBar);

static_assert(kSmemBytes <= 232448, "shared memory: too many stages for this tile");

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

// standalone_gemm.cuh's consumer hook for the FP8 kernels (the standalone grouped GEMM and role4).
template <typename WaitFull, typename Load>
__device__ __forceinline__ bool sa_consume(const StandaloneArgs& a, const Pipeline& pipe, const u8* smem, u32& it,
                                           const Task& t, int cw, int /*warp*/, int lane, int local_tid,
                                           float (&acc)[kMSub][kAcc], WaitFull&& wait_full, Load&& load) {
    return consume<kEpi>(pipe, smem, it, t, a.k / kBK, a.n_w / 128, a.w_sf, cw, lane, local_tid, acc, wait_full,
                         load);
}

}  // namespace sm90
}  // namespace gc_moe
