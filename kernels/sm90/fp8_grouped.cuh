// The FP8xFP8 grouped-GEMM mainloop of the SM90 kernels that stream FP8 weights with FP32 128x128 block scales:
// role2_gemm_fp8xfp8.cu (the routed experts' grouped GEMM, standalone and role2 of the operator) and role4_shared.cu
// (role4, the fused shared expert). One source of GEMM truth: the variant constants and shared-memory layout, the
// stage issue of a K128 step (weights, tokens, the tokens' FP32 1x128 scales), the WGMMAs of a step, the promotion
// with w_scale * x_scale and the consumer K loop (consume) live here once; each kernel source adds its grid body and
// epilogues. Defines: GC_BM, GC_M_SUB, GC_STAGES, GC_PRODUCER_WG, GC_EPI, GC_FAST_MATH, GC_CLUSTER, GC_OPERATOR
// (role2_gemm_fp8xfp8.cu's header comment says what each selects), and GC_W_K32 (role4 only, default 0): the
// weights' scale form. 0: FP32 128x128 block scales, one promotion per K128 step. 1: per-row UE8M0 K32 scales
// (DeepGEMM's shared-expert recipe), four codes per int32 word, transposed to [K/128, N] words (word of K step kb
// and weight row r at kb * N + r): one promotion per K32 MMA (consume_n_k32). GC_TASK_SCALES (role4's W1 only,
// default 0): 0, the tokens' FP32 1x128 scales of a K step come with its stage (the issue's bulk copy of a
// transposed [K/128, rows] array); G > 0, a task's token block has its G = K/128 scales per token copied once, by
// the consumer warpgroups at the task's start, from token-major x_sf [rows, K/128] into a region [G][BM] after the
// amax scratch (copy_task_scales), and every K step reads them there.
#pragma once

#include <cuda_fp8.h>

#include "sm90/grouped.cuh"
#include "sm90/gemm_variant.cuh"

#ifndef GC_W_K32
#define GC_W_K32 0
#endif
#ifndef GC_TASK_SCALES
#define GC_TASK_SCALES 0
#endif

namespace gc_moe {
namespace sm90 {

constexpr bool kWeightK32 = GC_W_K32 != 0;
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
constexpr int kTaskScaleGroups = GC_TASK_SCALES;
constexpr bool kTaskScales = kTaskScaleGroups > 0;
constexpr u32 kOffTaskScales = kOffOut + out_bytes(kRows);  // [kTaskScaleGroups][kBM] FP32, GC_TASK_SCALES only
constexpr u32 kOffBar = kOffTaskScales + kTaskScaleGroups * kBM * 4;
constexpr u32 kSmemBytes = smem_bytes(kOffBar);

static_assert(kSmemBytes <= 232448, "shared memory: too many stages for this tile");

static_assert(!kTaskScales || (kEpi == 1 && !GC_OPERATOR), "GC_TASK_SCALES: role4's W1 (standalone) only");

using Pipeline = StagePipeline<kOffBar, kStages>;

// The token scales of K step kb for this thread's first N accumulator columns: from the stage, or from the task's
// region (kTaskScales).
template <int N>
__device__ __forceinline__ void token_scales(const u8* smem, u32 stage, int kb, int lane, float (&xsr)[N / 4]) {
    const float* xs = kTaskScales ? reinterpret_cast<const float*>(smem + kOffTaskScales) + kb * kBM
                                  : reinterpret_cast<const float*>(smem + kOffS + stage * kSBytes);
#pragma unroll
    for (int c = 0; c < N / 4; ++c) xsr[c] = xs[acc_col(4 * (c / 2) + (c & 1), lane)];
}

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

// Frees consumed stage `stage` (one arrival per consumer warp; both CTAs' in a cluster pair) and, in the
// non-pipelined variant, has consumer thread 0 issue K step kb + kStages into it. False when that load gives up.
template <typename Load>
__device__ __forceinline__ bool free_stage(const Pipeline& pipe, u32 stage, u32 it, int kb, int kb_count, int lane,
                                           int local_tid, Load& load) {
    __syncwarp();
    if (lane == 0) release_stage<kCluster>(pipe.empty(stage));
    if (!kProducerWG && local_tid == 0 && kb + kStages < kb_count) {
        if (!load(it + kStages, kb + kStages)) return false;
    }
    __syncwarp();
    return true;
}

// Wide blocks (WGMMA N above kWideN, operator mode: BM = 96). A K128 step issues each slab's four K32 WGMMAs into its
// own temporary (two commit groups), then promotes slab 0 while slab 1's MMAs run (wait_group 1) and slab 1 after
// them, reading the token scales from the stage in shared memory at each use: the main accumulators (48 registers
// per slab at N = 96) and both temporaries leave no room for the scales in registers (the 64-column step holds them).
constexpr int kWideN = 64;

// Promotes slab s's retired temporary into its main accumulators (W1: registers i%4 in {0,1} are gate rows, scale
// ws0, {2,3} up rows, ws1; W2: ws is the slab's block).
template <int Epi, int N>
__device__ __forceinline__ void promote_wide(float (&acc)[kAcc], float (&tmp)[N / 2], float ws, float ws1,
                                             const float* xs, int lane) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) fence_operand(tmp[i]);
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
        const float w = Epi == 1 && (i & 2) ? ws1 : ws;
        acc[i] = fmaf(tmp[i], w * xs[acc_col(i, lane)], acc[i]);
    }
}

// One wide K128 step of both slabs; the caller frees the stage afterwards (the promotions read its token scales).
template <int Epi, int N>
__device__ __forceinline__ void wide_step(float (&acc)[kMSub][kAcc], u32 a_base, u32 b_base, float ws0, float ws1,
                                          const float* xs, int lane) {
    static_assert(kMSub == 2 && N > kWideN, "wide steps: two slabs, N > 64");
    static_assert(!kTaskScales && !kCluster, "wide steps: operator mode (token scales in the stage)");
    float tmp[kMSub][N / 2];
#pragma unroll
    for (int s = 0; s < kMSub; ++s) {
#pragma unroll
        for (int i = 0; i < N / 2; ++i) {
            tmp[s][i] = 0.0f;
            fence_operand(tmp[s][i]);
        }
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            Wgmma<N>::mma(tmp[s], smem_desc_sw128(a_base + s * 64 * kBK + k * 32), smem_desc_sw128(b_base + k * 32),
                          k > 0);
        }
        wgmma_commit();
    }
    wgmma_wait<1>();
    promote_wide<Epi, N>(acc[0], tmp[0], ws0, ws1, xs, lane);
    wgmma_wait<0>();
    promote_wide<Epi, N>(acc[1], tmp[1], Epi == 1 ? ws0 : ws1, ws1, xs, lane);
}

// The consumer K loop of one task with N token columns (with_wgmma_n picks N once per task: see grouped.cuh). Per
// K128 step: wait for the stage, its four K32 WGMMAs per slab into a fresh (zeroed) accumulator set, wait for
// them, free the stage, promote. Above kWideN columns a step runs as a wide step (wide_step) and frees the stage after
// its last promotion, which reads the stage's token scales. Returns false when a wait gives up.
template <int Epi, int N, typename WaitFull, typename Load>
__device__ __forceinline__ bool consume_n(const Pipeline& pipe, const u8* smem, u32& it, int kb_count,
                                         const float* const (&ws_row)[2], int cw, int lane, int local_tid,
                                         float (&acc)[kMSub][kAcc], WaitFull& wait_full, Load& load) {
    for (int kb = 0; kb < kb_count; ++kb, ++it) {
        const float ws0 = __ldg(ws_row[0] + kb), ws1 = __ldg(ws_row[1] + kb);
        const u32 stage = it % kStages;
        if (!wait_full(pipe.full(stage), (it / kStages) & 1)) return false;
        if constexpr (N > kWideN) {
            wide_step<Epi, N>(acc, pipe.base + stage * kWBytes + cw * kMSub * 64 * kBK,
                              pipe.base + kOffX + stage * kXBytes, ws0, ws1,
                              reinterpret_cast<const float*>(smem + kOffS + stage * kSBytes), lane);
            if (!free_stage(pipe, stage, it, kb, kb_count, lane, local_tid, load)) return false;
        } else {
            float xsr[N / 4];
            token_scales<N>(smem, stage, kb, lane, xsr);
            float tmp[kMSub][N / 2];
            zero(tmp);
            fence_operands(tmp);
            wgmma_fence();
            mma_k128<N>(tmp, pipe.base + stage * kWBytes + cw * kMSub * 64 * kBK,
                        pipe.base + kOffX + stage * kXBytes);
            wgmma_commit();
            wgmma_wait<0>();
            fence_operands(tmp);
            if (!free_stage(pipe, stage, it, kb, kb_count, lane, local_tid, load)) return false;
            promote<Epi, N>(acc, tmp, ws0, ws1, xsr);
        }
    }
    return true;
}

// UE8M0 code -> its FP32 value 2^(code - 127) (code 0, 2^-127, is the one subnormal; 255 is refused on the host).
__device__ __forceinline__ float ue8m0_value(u32 code) {
    return __uint_as_float(code ? code << 23 : 0x00400000u);
}

// The K32 promotion of one MMA's N columns (one slab, K32 group k): acc += tmp * (2^w[row] * x_scale[col]), the
// register's row half h = (i / 2) % 2 picking the word of row +0 or +8.
template <int N>
__device__ __forceinline__ void promote_k32(float (&acc)[kAcc], const float (&tmp)[N / 2], u32 w0, u32 w1, int k,
                                            const float (&xsr)[N / 4]) {
    const float ws0 = ue8m0_value((w0 >> (8 * k)) & 0xFFu), ws1 = ue8m0_value((w1 >> (8 * k)) & 0xFFu);
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
        acc[i] = fmaf(tmp[i], ((i & 2) ? ws1 : ws0) * xsr[2 * (i / 4) + (i & 1)], acc[i]);
    }
}

// The consumer K loop of one task with N token columns and per-row K32 weight scales (kWeightK32). A K128 step is
// kMSub * 4 MMA units (slab s, K32 group k), each into its own temporary accumulator and promoted with its rows'
// K32 scale: a block-scaled MMA does this inside the instruction on SM100, WGMMA has no scale operand, so every K32
// result leaves the tensor core before the next scale applies. Two temporaries alternate so that a unit's promotion
// overlaps the next unit's MMA (wait_group 1): the same registers as the K128 loop's kMSub slabs. `words` points at
// this thread's first row in the [K/128, N] word array; its rows are +0/+8 of each slab (+64 per slab).
template <int N, typename WaitFull, typename Load>
__device__ __forceinline__ bool consume_n_k32(const Pipeline& pipe, const u8* smem, u32& it, int kb_count,
                                             const u32* words, int n_w, int cw, int lane, int local_tid,
                                             float (&acc)[kMSub][kAcc], WaitFull& wait_full, Load& load) {
    constexpr int kUnits = 4 * kMSub;
    for (int kb = 0; kb < kb_count; ++kb, ++it) {
        u32 w[kMSub][2];
#pragma unroll
        for (int s = 0; s < kMSub; ++s) {
            w[s][0] = __ldg(words + static_cast<size_t>(kb) * n_w + s * 64);
            w[s][1] = __ldg(words + static_cast<size_t>(kb) * n_w + s * 64 + 8);
        }
        const u32 stage = it % kStages;
        if (!wait_full(pipe.full(stage), (it / kStages) & 1)) return false;
        float xsr[N / 4];
        token_scales<N>(smem, stage, kb, lane, xsr);
        const u32 a_base = pipe.base + stage * kWBytes + cw * kMSub * 64 * kBK;
        const u32 b_base = pipe.base + kOffX + stage * kXBytes;
        float tmp[2][N / 2];
#pragma unroll
        for (int u = 0; u < kUnits; ++u) {
            const int s = u % kMSub, k = u / kMSub;
            // A fresh accumulator (see with_wgmma_n); only this unit's registers are fenced, the other set may
            // still be written by the MMA in flight.
#pragma unroll
            for (int i = 0; i < N / 2; ++i) {
                tmp[u & 1][i] = 0.0f;
                fence_operand(tmp[u & 1][i]);
            }
            wgmma_fence();
            Wgmma<N>::mma(tmp[u & 1], smem_desc_sw128(a_base + s * 64 * kBK + k * 32), smem_desc_sw128(b_base + k * 32),
                          0);
            wgmma_commit();
            if (u > 0) {
                wgmma_wait<1>();
#pragma unroll
                for (int i = 0; i < N / 2; ++i) fence_operand(tmp[(u - 1) & 1][i]);
                const int sp = (u - 1) % kMSub, kp = (u - 1) / kMSub;
                promote_k32<N>(acc[sp], tmp[(u - 1) & 1], w[sp][0], w[sp][1], kp, xsr);
            }
        }
        wgmma_wait<0>();
        fence_operands(tmp);
        if (!free_stage(pipe, stage, it, kb, kb_count, lane, local_tid, load)) return false;
        promote_k32<N>(acc[kMSub - 1], tmp[(kUnits - 1) & 1], w[kMSub - 1][0], w[kMSub - 1][1], 3, xsr);
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
    bool ok = true;
    if constexpr (kWeightK32) {
        // This thread's first row: slab 0 of its warpgroup, row +0 of its quad (acc_col's row map).
        const int n_w = row_blocks * 128;
        const u32* words = reinterpret_cast<const u32*>(w_sf) + static_cast<size_t>(t.expert) * kb_count * n_w +
                           t.tile * kRows + cw * kMSub * 64 + (local_tid / 32 % 4) * 16 + lane / 4;
        with_wgmma_n<kBM>(wgmma_n8<kBM>(t.valid), [&](auto n) {
            ok = consume_n_k32<decltype(n)::value>(pipe, smem, it, kb_count, words, n_w, cw, lane, local_tid, acc,
                                                   wait_full, load);
        });
        return ok;
    }
    const float* ws_row[2];
    scale_rows<Epi>(t, cw, row_blocks, kb_count, w_sf, ws_row);
    with_wgmma_n<kBM>(wgmma_n8<kBM>(t.valid), [&](auto n) {
        ok = consume_n<Epi, decltype(n)::value>(pipe, smem, it, kb_count, ws_row, cw, lane, local_tid, acc, wait_full,
                                                load);
    });
    return ok;
}

// The task-scale copy (kTaskScales), before the task's K loop (inside it, after the first stage loads, the K32 loop
// at BM = 64 spilled): the consumer threads copy the block's token scales from token-major x_sf [rows, kb_count]
// into the region [kb_count][kBM] (0 past the valid rows; consecutive threads read consecutive words of a token's
// row), then meet at the W1 epilogue's barrier. The previous task's readers are past it: they left their K loop
// and met at that barrier at the end of their epilogue. A kb_count beyond the region is reported (kSiteSmem: the
// variant's region is smaller than the GEMM's K needs) and nothing is copied.
__device__ __forceinline__ void copy_task_scales(u8* region, const Task& t, const float* x_sf, int kb_count,
                                                 int local_tid, KernelStatus* status) {
    if (kb_count > kTaskScaleGroups) {
        if (local_tid == 0) report_status(status, kStatusMismatch, kSiteSmem, kb_count, kTaskScaleGroups);
    } else {
        float* ts = reinterpret_cast<float*>(region);
        for (int e = local_tid; e < kBM * kb_count; e += kConsumerThreads) {
            const int c = e / kb_count, g = e - c * kb_count;
            ts[g * kBM + c] = c < t.valid ? __ldg(x_sf + static_cast<size_t>(t.row_off + c) * kb_count + g) : 0.0f;
        }
    }
    named_barrier(1, kConsumerThreads);
}

// What the FP8 kernels' standalone policies (sm90/standalone_gemm.cuh: the standalone grouped GEMM's and role4's)
// share: the variant's constants, its Pipeline and the consumer hook. Each source's policy derives from it and adds
// the W1 epilogue's scale rule (kUe8m0) and the stage issue (sa_issue).
struct Fp8StandaloneBase {
    static constexpr int kBM = sm90::kBM, kMSub = sm90::kMSub, kAcc = sm90::kAcc, kRows = sm90::kRows,
                         kBK = sm90::kBK, kStages = sm90::kStages, kProducerWG = sm90::kProducerWG, kEpi = sm90::kEpi,
                         kConsumerWGs = sm90::kConsumerWGs, kConsumerThreads = sm90::kConsumerThreads,
                         kProducerRegs = sm90::kProducerRegs, kConsumerRegs = sm90::kConsumerRegs;
    static constexpr bool kCluster = sm90::kCluster, kFastMath = sm90::kFastMath, kRingRows = false;
    static constexpr u32 kSmemBytes = sm90::kSmemBytes, kOffRed = sm90::kOffRed;
    using Pipeline = sm90::Pipeline;

    template <typename WaitFull, typename Load>
    static __device__ __forceinline__ bool sa_consume(const StandaloneArgs& a, const Pipeline& pipe, const u8* smem,
                                                      u32& it, const Task& t, int cw, int /*warp*/, int lane,
                                                      int local_tid, float (&acc)[kMSub][kAcc], WaitFull&& wait_full,
                                                      Load&& load) {
        if constexpr (kTaskScales) {
            copy_task_scales(const_cast<u8*>(smem) + kOffTaskScales, t, a.x_sf_t, a.k / kBK, local_tid, a.status);
        }
        return consume<kEpi>(pipe, smem, it, t, a.k / kBK, a.n_w / 128, a.w_sf, cw, lane, local_tid, acc, wait_full,
                             load);
    }
};

}  // namespace sm90
}  // namespace gc_moe
