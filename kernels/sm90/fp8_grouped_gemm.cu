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
#include <cuda_fp8.h>

#include "sm90/grouped.cuh"

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

namespace gc_moe {
namespace sm90 {

constexpr int kBM = GC_BM;
constexpr int kMSub = GC_M_SUB;
constexpr int kStages = GC_STAGES;
constexpr int kProducerWG = GC_PRODUCER_WG;
constexpr int kEpi = GC_EPI;
constexpr int kConsumerWGs = 2;
constexpr int kConsumerThreads = kConsumerWGs * 128;
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
constexpr u32 kOffBar = kOffRed + kConsumerWGs * 4 * kBM * 4;  // amax of each consumer warp per column
constexpr u32 kSmemBytes = kOffBar + 2 * kStages * 8 + 1024;  // + slack to align the base to 1024
constexpr int kSiteSmem = 1, kSiteEmpty = 2, kSiteFull = 3;

static_assert(kBM % 8 == 0 && kBM >= 8 && kBM <= 64, "GC_BM: WGMMA N must be a multiple of 8 up to 64");
static_assert(kEpi != 1 || kMSub == 2, "W1 epilogue: a task must cover the 256 rows of one 128-column requant group");
static_assert(kEpi == 1 || kEpi == 2, "GC_EPI: 1 (W1) or 2 (W2)");
static_assert(kSmemBytes <= 232448, "shared memory: too many stages for this tile");

struct Pipeline {
    u32 base;  // shared address of the 1024-aligned tile area
    __device__ __forceinline__ u32 full(u32 stage) const { return base + kOffBar + 8 * stage; }
    __device__ __forceinline__ u32 empty(u32 stage) const { return base + kOffBar + 8 * (kStages + stage); }
};

// Waits for stage `it % kStages` to be free and issues the weight tile, token tile and token scales of K step kb.
__device__ __forceinline__ bool produce(const Pipeline& pipe, u32 it, const Task& t, int kb, const TensorMap* tm_w,
                                        const TensorMap* tm_x, const float* x_sf_t, int n_w, int rows_total,
                                        u64 policy_w, u64 policy_x, KernelStatus* status, u64 timeout_ns) {
    const u32 stage = it % kStages, parity = ((it / kStages) & 1) ^ 1;
    if (!mbar_wait(pipe.empty(stage), parity, timeout_ns, status, kSiteEmpty)) return false;
    const u32 full = pipe.full(stage);
    mbar_arrive_expect_tx(full, kStageTx);
    tma_load_2d(pipe.base + stage * kWBytes, tm_w, kb * kBK, t.expert * n_w + t.tile * kRows, full, policy_w);
    tma_load_2d(pipe.base + kOffX + stage * kXBytes, tm_x, kb * kBK, t.row_off, full, policy_x);
    bulk_load(pipe.base + kOffS + stage * kSBytes, x_sf_t + static_cast<size_t>(kb) * rows_total + t.row_off, kSBytes,
              full);
    return true;
}

// The K128 step's four K32 WGMMAs for every slab, with N = n8 * 8 columns (the block's valid rows rounded up).
template <int N>
__device__ __forceinline__ void mma_k128(float (&tmp)[kMSub][kAcc], u32 a_base, u32 b_base) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
#pragma unroll
        for (int s = 0; s < kMSub; ++s) {
            Wgmma<N>::mma(tmp[s], smem_desc_sw128(a_base + s * 64 * kBK + k * 32), smem_desc_sw128(b_base + k * 32),
                          k > 0);
        }
    }
}

__device__ __forceinline__ void mma_k128_n(int n8, float (&tmp)[kMSub][kAcc], u32 a_base, u32 b_base) {
    switch (n8) {
#define GC_MMA_CASE(C) \
    case C:            \
        if constexpr (C * 8 <= kBM) mma_k128<C * 8>(tmp, a_base, b_base); \
        break;
        GC_MMA_CASE(1)
        GC_MMA_CASE(2)
        GC_MMA_CASE(3)
        GC_MMA_CASE(4)
        GC_MMA_CASE(5)
        GC_MMA_CASE(6)
        GC_MMA_CASE(7)
        GC_MMA_CASE(8)
#undef GC_MMA_CASE
        default:
            break;
    }
}

// W1: SwiGLU(gate, up) * routing weight, amax over the task's 128 intermediate columns per token, FP32 scale
// (amax / 448, stored transposed [I/128, rows] where the W2 producer bulk-copies it) and E4M3 payload [rows, I].
__device__ __forceinline__ void epilogue_w1(float (&acc)[kMSub][kAcc], const Task& t, int cw, int warp, int lane,
                                            float* red, const float* routing_w, u8* out, float* out_sf_t,
                                            int inter, int rows_total, float clamp, float alpha) {
    float amax[kAcc / 2];
#pragma unroll
    for (int c = 0; c < kAcc / 2; ++c) {
        const int i = 4 * (c / 2) + (c & 1), col = acc_col(i, lane);
        const float rw = col < t.valid ? __ldg(routing_w + t.row_off + col) : 0.0f;
        float m = 0.0f;
#pragma unroll
        for (int s = 0; s < kMSub; ++s) {
            const float gate = fminf(round_bf16(acc[s][i]), clamp);
            const float up = fminf(fmaxf(round_bf16(acc[s][i + 2]), -clamp), clamp);
            const float act = gate * sigmoid<GC_FAST_MATH != 0>(alpha * gate) * up * rw;
            acc[s][i] = act;
            m = fmaxf(m, fabsf(act));
        }
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
        amax[c] = m;
    }
    if (lane < 4) {
#pragma unroll
        for (int c = 0; c < kAcc / 2; ++c) red[(cw * 4 + warp) * kBM + acc_col(4 * (c / 2) + (c & 1), lane)] = amax[c];
    }
    named_barrier(1, kConsumerThreads);
#pragma unroll
    for (int c = 0; c < kAcc / 2; ++c) {
        const int i = 4 * (c / 2) + (c & 1), col = acc_col(i, lane);
        float m = red[col];
#pragma unroll
        for (int w = 1; w < kConsumerWGs * 4; ++w) m = fmaxf(m, red[w * kBM + col]);
        const float scale = fmaxf(m, 1e-10f) / 448.0f;
        if (col < t.valid) {
            const size_t row = static_cast<size_t>(t.row_off + col);
#pragma unroll
            for (int s = 0; s < kMSub; ++s) {
                const int icol = (t.tile * 16 + cw * 8 + s * 4 + warp) * 8 + lane / 4;
                const __nv_fp8_e4m3 q(acc[s][i] / scale);
                out[row * inter + icol] = q.__x;
            }
            if (cw == 0 && warp == 0 && lane < 4) out_sf_t[static_cast<size_t>(t.tile) * rows_total + row] = scale;
        }
    }
    named_barrier(1, kConsumerThreads);  // `red` is rewritten by the next task
}

// W2: BF16 partial rows [rows, H].
__device__ __forceinline__ void epilogue_w2(const float (&acc)[kMSub][kAcc], const Task& t, int cw, int warp,
                                            int lane, __nv_bfloat16* out, int n_w) {
#pragma unroll
    for (int s = 0; s < kMSub; ++s) {
#pragma unroll
        for (int i = 0; i < kAcc; ++i) {
            const int col = acc_col(i, lane);
            const int h = t.tile * kRows + (cw * kMSub + s) * 64 + warp * 16 + lane / 4 + 8 * ((i >> 1) & 1);
            if (col < t.valid) out[static_cast<size_t>(t.row_off + col) * n_w + h] = __float2bfloat16_rn(acc[s][i]);
        }
    }
}

}  // namespace sm90
}  // namespace gc_moe

using namespace gc_moe;
using namespace gc_moe::sm90;

// tm_w: [E * n_w, k] FP8 (box 128 x kRows); tm_x: [rows_total, k] FP8 (box 128 x GC_BM); w_sf: FP32
// [E, n_w/128, k/128]; x_sf_t: FP32 [k/128, rows_total]; blocks: int32 [*, 3]; *num_blocks blocks are live.
// W1 (GC_EPI=1): n_w = 2I (interleaved), out = FP8 [rows_total, I], out_sf_t = FP32 [I/128, rows_total].
// W2 (GC_EPI=2): n_w = H, out = BF16 [rows_total, H], out_sf_t and routing_w unused. clamp = +inf for none.
extern "C" __global__ void __launch_bounds__(kThreads, 1)
    gc_sm90_fp8_grouped_gemm(const __grid_constant__ TensorMap tm_w, const __grid_constant__ TensorMap tm_x,
                             const float* __restrict__ w_sf, const float* __restrict__ x_sf_t,
                             const int* __restrict__ blocks, const int* __restrict__ num_blocks,
                             const float* __restrict__ routing_w, void* __restrict__ out, float* __restrict__ out_sf_t,
                             int n_w, int k, int rows_total, float clamp, float alpha, KernelStatus* status,
                             u64 timeout_ns) {
    extern __shared__ u8 smem_raw[];
    u8* smem = reinterpret_cast<u8*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~static_cast<uintptr_t>(1023));
    const Pipeline pipe{smem_addr(smem)};
    const int tid = threadIdx.x;
    u32 dyn_smem;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
    if (dyn_smem < kSmemBytes) {
        if (tid == 0) report_status(status, kStatusMismatch, kSiteSmem, dyn_smem, kSmemBytes);
        return;
    }
    if (tid == 0) {
        for (u32 s = 0; s < kStages; ++s) {
            mbar_init(pipe.full(s), 1);
            mbar_init(pipe.empty(s), kConsumerWGs * 4);
        }
        fence_barrier_init();
        prefetch_tensormap(&tm_w);
        prefetch_tensormap(&tm_x);
    }
    __syncthreads();

    const int nb = __ldg(num_blocks);
    const int kb_count = k / kBK;
    const int num_tasks = nb * (n_w / kRows);
    const u64 policy_w = evict_first_policy();
    const u64 policy_x = evict_last_policy();  // token tiles are re-read by every weight tile of their block
    const int wg = tid / 128;

    if (kProducerWG && wg == 0) {
        setmaxnreg_dec<40>();
        if (tid == 0) {
            u32 it = 0;
            for (int task = blockIdx.x; task < num_tasks; task += gridDim.x) {
                const Task t = load_task(blocks, task, nb);
                for (int kb = 0; kb < kb_count; ++kb, ++it) {
                    if (!produce(pipe, it, t, kb, &tm_w, &tm_x, x_sf_t, n_w, rows_total, policy_w, policy_x, status,
                                 timeout_ns))
                        return;
                }
            }
        }
        return;
    }
    if (kProducerWG) setmaxnreg_inc<232>();

    const int cw = wg - kProducerWG, warp = (tid / 32) & 3, lane = tid & 31;
    const int local_tid = tid - kProducerWG * 128;
    float* red = reinterpret_cast<float*>(smem + kOffRed);
    const int row_blocks = n_w / 128;
    u32 it = 0;
    for (int task = blockIdx.x; task < num_tasks; task += gridDim.x) {
        const Task t = load_task(blocks, task, nb);
        const int n8 = (min(t.valid, kBM) + 7) / 8;
        if (!kProducerWG && local_tid == 0) {
            for (int kb = 0; kb < min(kStages, kb_count); ++kb) {
                if (!produce(pipe, it + kb, t, kb, &tm_w, &tm_x, x_sf_t, n_w, rows_total, policy_w, policy_x, status,
                             timeout_ns))
                    return;
            }
        }
        __syncwarp();
        float acc[kMSub][kAcc];
#pragma unroll
        for (int s = 0; s < kMSub; ++s)
#pragma unroll
            for (int i = 0; i < kAcc; ++i) acc[s][i] = 0.0f;
        // Scale rows of this thread's slabs: W1 tiles hold gate block `tile` and up block I/128 + tile.
        const float* ws_row[2];
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            const int block = kEpi == 1 ? t.tile + s * (row_blocks / 2)
                                        : (t.tile * kRows + (cw * kMSub + min(s, kMSub - 1)) * 64) / 128;
            ws_row[s] = w_sf + (static_cast<size_t>(t.expert) * row_blocks + block) * kb_count;
        }
        for (int kb = 0; kb < kb_count; ++kb, ++it) {
            const float ws0 = __ldg(ws_row[0] + kb), ws1 = __ldg(ws_row[1] + kb);
            const u32 stage = it % kStages;
            if (!mbar_wait(pipe.full(stage), (it / kStages) & 1, timeout_ns, status, kSiteFull)) return;
            const float* xs = reinterpret_cast<const float*>(smem + kOffS + stage * kSBytes);
            float xsr[kAcc / 2];
#pragma unroll
            for (int c = 0; c < kAcc / 2; ++c) xsr[c] = xs[acc_col(4 * (c / 2) + (c & 1), lane)];
            float tmp[kMSub][kAcc];
#pragma unroll
            for (int s = 0; s < kMSub; ++s)
#pragma unroll
                for (int i = 0; i < kAcc; ++i) fence_operand(tmp[s][i]);
            wgmma_fence();
            mma_k128_n(n8, tmp, pipe.base + stage * kWBytes + cw * kMSub * 64 * kBK, pipe.base + kOffX + stage * kXBytes);
            wgmma_commit();
            wgmma_wait_all();
#pragma unroll
            for (int s = 0; s < kMSub; ++s)
#pragma unroll
                for (int i = 0; i < kAcc; ++i) fence_operand(tmp[s][i]);
            __syncwarp();
            if (lane == 0) mbar_arrive(pipe.empty(stage));
            if (!kProducerWG && local_tid == 0 && kb + kStages < kb_count) {
                if (!produce(pipe, it + kStages, t, kb + kStages, &tm_w, &tm_x, x_sf_t, n_w, rows_total, policy_w,
                             policy_x, status, timeout_ns))
                    return;
            }
            __syncwarp();
#pragma unroll
            for (int s = 0; s < kMSub; ++s) {
#pragma unroll
                for (int i = 0; i < kAcc; ++i) {
                    // W1: registers i%4 in {0,1} are gate rows (scale ws0), {2,3} up rows (ws1); W2: slab s's block.
                    const float ws = kEpi == 1 ? ((i & 2) ? ws1 : ws0) : (s == 0 ? ws0 : ws1);
                    acc[s][i] = fmaf(tmp[s][i], ws * xsr[2 * (i / 4) + (i & 1)], acc[s][i]);
                }
            }
        }
        if constexpr (kEpi == 1) {
            epilogue_w1(acc, t, cw, warp, lane, red, routing_w, static_cast<u8*>(out), out_sf_t, n_w / 2, rows_total,
                        clamp, alpha);
        } else {
            epilogue_w2(acc, t, cw, warp, lane, static_cast<__nv_bfloat16*>(out), n_w);
        }
    }
}
