// SM90 FP8xFP4 grouped expert GEMM over ring blocks (paper §4.4, Hopper path): MXFP4 weights streamed packed by TMA,
// decoded to E4M3 in registers and fed to register-A WGMMA (m64nNk32.e4m3.e4m3), fused W1 (SwiGLU + UE8M0 1x32
// requant) or W2 (BF16) epilogue.
//
// Operand swap as in fp8_grouped_gemm.cu: weight rows are the WGMMA M operand (each consumer warpgroup owns GC_M_SUB
// slabs of 64 rows), the block's tokens N (valid rows rounded up to 8). Weights come window-repacked and
// lane-permuted (gc_moe_compat/sm90/fp4_layout.py): per (expert, K128 step, 64-row slab) one 4352-byte unit =
// 4096 bytes of FP4 codes in the order the A fragment wants ([warp][K64 half][lane][16 bytes], one LDS.128 per half
// and thread, conflict-free) + 256 bytes of per-K32 relative exponents d in [0, 10] ([warp][lane/4][row +0/+8][K32]).
// A task's slabs for one K step are consecutive units: ONE 2D TMA (128-byte rows, no swizzle) per stage brings the
// codes and their scales; the token tile (E4M3, 128-byte swizzle) and the block's activation scales come as in the
// FP8 kernel.
//
// Decode (per thread, slab and K32 group: two 32-bit words -> the four A registers): a word holds 8 values of one
// weight row; its 3-bit magnitudes sit in nibbles 0-3 (A register of columns 4t..4t+3) and 4-7 (columns +16), the
// signs in the nibbles' bit 3 (odd nibbles: first register, even nibbles: second), so that
//   r0 = PRMT(table, mag & 0xFFFF) | (w & 0x80808080),  r1 = PRMT(table, mag >> 16) | ((w << 4) & 0x80808080).
// The 8-entry byte table is E4M3(e2m1(c) * 2^d / 64) for the row's K32 group: the weight scale 2^d is folded into
// the E4M3 exponent, exact for d <= 10 (layouts.window_repack_mxfp4 proves it), including the FP4 subnormal 0.5 and
// zero, which is why a table and not an exponent add. So one K128 step of W1 is four MMAs into one accumulator,
// promoted with the token's FP32 1x128 scale; the per-expert factor 2^base and the x64 headroom are applied once per
// task. W2's activations (the W1 epilogue's E4M3 payload) carry a UE8M0 scale per token and K32 group: there each
// K32 MMA has its own accumulator, promoted with that power of two.
//
// GC_EPI=1: W1, L1 rows interleaved by 8 (thread-local SwiGLU as in the FP8 kernel); a task's 256 rows are 128
// intermediate columns = four UE8M0 requant groups of 32, one per (consumer warpgroup, slab): amax across that
// warpgroup's 4 warps. Payload E4M3 [rows, I], scales as packed UE8M0 words [I/128, rows] (group 4*kb + j in byte j:
// exactly what the W2 producer bulk-copies per K128 step). GC_EPI=2: W2, BF16 partial rows.
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
constexpr int kThreads = (kConsumerWGs + kProducerWG) * 128;
constexpr int kSlabs = kConsumerWGs * kMSub;  // 64-row slabs per task
constexpr int kRows = kSlabs * 64;
constexpr int kBK = 128;
constexpr int kAcc = kBM / 2;               // accumulator registers per 64-row slab and thread (m64nBMk32)
constexpr int kSplit = kEpi == 1 ? 1 : 4;   // accumulators per K128 step: W2's token scales change every K32
constexpr u32 kCodeBytes = 64 * kBK / 2;    // FP4 codes of one slab and K128 step
constexpr u32 kUnitBytes = kCodeBytes + 64 * kBK / 32;  // + one d byte per row and K32 group
constexpr int kUnitRows = kUnitBytes / 128;  // rows of the 128-byte tensor-map view per unit
constexpr u32 kWBytes = kSlabs * kUnitBytes;
constexpr u32 kXBytes = kBM * kBK;
constexpr u32 kSBytes = kBM * 4;  // W1: FP32 1x128 scale per token; W2: four UE8M0 codes per token
constexpr u32 kStageTx = kWBytes + kXBytes + kSBytes;
constexpr u32 kOffW = kStages * kXBytes;  // token tiles first: 128-byte swizzle wants 1024-byte alignment
constexpr u32 kOffS = kOffW + kStages * kWBytes;
constexpr u32 kOffRed = kOffS + kStages * kSBytes;
constexpr u32 kOffBar = kOffRed + kConsumerWGs * kMSub * 4 * kBM * 4;  // amax per (warpgroup, slab, warp, column)
constexpr u32 kSmemBytes = kOffBar + 2 * kStages * 8 + 1024;           // + slack to align the base to 1024
constexpr int kSiteSmem = 1, kSiteEmpty = 2, kSiteFull = 3;

static_assert(kBM % 8 == 0 && kBM >= 8 && kBM <= 64, "GC_BM: WGMMA N must be a multiple of 8 up to 64");
static_assert(kEpi != 1 || kMSub == 2, "W1 epilogue: a task must cover the 256 rows of 128 intermediate columns");
static_assert(kEpi == 1 || kEpi == 2, "GC_EPI: 1 (W1) or 2 (W2)");
static_assert(kUnitBytes % 128 == 0 && kSlabs * kUnitRows <= 256, "weight unit: whole 128-byte rows, TMA box <= 256");
static_assert(kSmemBytes <= 232448, "shared memory: too many stages for this tile");

using Pipeline = StagePipeline<kOffBar, kStages>;

// Waits for stage `it % kStages` to be free and issues the weight units (codes + d), token tile and token scales of
// K step kb. Weight units of expert e, step kb, slab j: view row ((e * kb_count + kb) * slabs_w + j) * kUnitRows.
__device__ __forceinline__ bool produce(const Pipeline& pipe, u32 it, const Task& t, int kb, int kb_count,
                                        int slabs_w, const TensorMap* tm_w, const TensorMap* tm_x, const u32* x_sf_t,
                                        int rows_total, u64 policy_w, u64 policy_x, KernelStatus* status,
                                        u64 timeout_ns) {
    const u32 stage = it % kStages, parity = ((it / kStages) & 1) ^ 1;
    if (!mbar_wait(pipe.empty(stage), parity, timeout_ns, status, kSiteEmpty)) return false;
    const u32 full = pipe.full(stage);
    mbar_arrive_expect_tx(full, kStageTx);
    const int unit = (t.expert * kb_count + kb) * slabs_w + t.tile * kSlabs;
    tma_load_2d(pipe.base + kOffW + stage * kWBytes, tm_w, 0, unit * kUnitRows, full, policy_w);
    tma_load_2d(pipe.base + stage * kXBytes, tm_x, kb * kBK, t.row_off, full, policy_x);
    bulk_load(pipe.base + kOffS + stage * kSBytes, x_sf_t + static_cast<size_t>(kb) * rows_total + t.row_off, kSBytes,
              full);
    return true;
}

// The 8-entry byte table E4M3(e2m1(c) * 2^d / 64), c = 0..7, as two words (c 0..3 in `lo`, 4..7 in `hi`). Normal
// codes c >= 2 are 4c + 8d (exponent field 1 + (c-2)/2 + d); c = 1 (0.5) is the subnormal 0x04 at d = 0 and 8d
// (exponent d, mantissa 0) above, hence the max; c = 0 stays 0. Largest byte 0x6C (96) at d = 10: no carries.
__device__ __forceinline__ void fp4_table(u32 d, u32& lo, u32& hi) {
    hi = d * 0x08080808u + 0x1C181410u;
    lo = max(d * 0x08080800u + 0x0C080000u, 0x0C080400u);
}

// One lane word (8 FP4 values of one weight row, layout in the file comment) -> two A registers.
__device__ __forceinline__ void decode_word(u32 w, u32 lo, u32 hi, u32& r0, u32& r1) {
    const u32 mag = w & 0x77777777u;  // bit 3 of every selector nibble clear: plain byte select
    r0 = __byte_perm(lo, hi, mag) | (w & 0x80808080u);
    r1 = __byte_perm(lo, hi, mag >> 16) | ((w << 4) & 0x80808080u);
}

// The A fragments of one slab for the four K32 groups of a stage: a[k][j] is A register j of K32 group k.
__device__ __forceinline__ void decode_slab(const u8* unit, int warp, int lane, u32 (&a)[4][4]) {
    const uint4 q0 = *reinterpret_cast<const uint4*>(unit + (warp * 2 + 0) * 512 + lane * 16);
    const uint4 q1 = *reinterpret_cast<const uint4*>(unit + (warp * 2 + 1) * 512 + lane * 16);
    const uint2 d = *reinterpret_cast<const uint2*>(unit + kCodeBytes + (warp * 8 + lane / 4) * 8);
    const u32 w[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};  // [K32 group][row +0, row +8]
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        u32 lo0, hi0, lo1, hi1;
        fp4_table((d.x >> (8 * k)) & 0xFFu, lo0, hi0);
        fp4_table((d.y >> (8 * k)) & 0xFFu, lo1, hi1);
        decode_word(w[2 * k], lo0, hi0, a[k][0], a[k][2]);
        decode_word(w[2 * k + 1], lo1, hi1, a[k][1], a[k][3]);
    }
}

// The stage's MMAs for every slab with N columns: W1 accumulates the four K32 groups into tmp[0], W2 keeps one
// accumulator per K32 group (its token scales differ per group).
template <int N>
__device__ __forceinline__ void mma_stage(float (&tmp)[kSplit][kMSub][kAcc], const u32 (&a)[kMSub][4][4],
                                          u32 b_base) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
#pragma unroll
        for (int s = 0; s < kMSub; ++s) {
            WgmmaRegA<N>::mma(tmp[kSplit == 1 ? 0 : k][s], a[s][k], smem_desc_sw128(b_base + k * 32),
                              kSplit == 1 && k > 0);
        }
    }
}

__device__ __forceinline__ void mma_stage_n(int n8, float (&tmp)[kSplit][kMSub][kAcc], const u32 (&a)[kMSub][4][4],
                                            u32 b_base) {
    with_wgmma_n<kBM>(n8, [&](auto n) { mma_stage<decltype(n)::value>(tmp, a, b_base); });
}

// UE8M0 scale of a 32-value group (quant.ue8m0_scale(amax, 448)): the smallest 2^k with max(amax, 1e-10) <= 448 * 2^k,
// returned as its biased exponent k + 127. frexp: a = m * 2^e, m in [0.5, 1), and 448 = 0.875 * 2^9, so k is e - 9
// or e - 8, settled by one exact comparison. a >= 1e-10 keeps k in [-42, 120]: normal floats throughout.
__device__ __forceinline__ int ue8m0_code_448(float amax) {
    const float a = fmaxf(amax, 1e-10f);
    int k = static_cast<int>((__float_as_uint(a) >> 23) & 0xFFu) - 126 - 9;
    if (a > 448.0f * __uint_as_float(static_cast<u32>(k + 127) << 23)) ++k;
    return k + 127;
}

// W1: SwiGLU(gate, up) * routing weight; amax per token over each 32-column group (one per warpgroup and slab:
// 4 warps x 8 columns), UE8M0 scale, E4M3 payload [rows, I] and packed codes [I/128, rows] (byte cw * kMSub + s).
__device__ __forceinline__ void epilogue_w1(float (&acc)[kMSub][kAcc], const Task& t, int cw, int warp, int lane,
                                            float* red, const float* routing_w, u8* out, u8* out_sf, int inter,
                                            int rows_total, float clamp, float alpha) {
    float* red_wg = red + cw * kMSub * 4 * kBM;
#pragma unroll
    for (int c = 0; c < kAcc / 2; ++c) {
        const int i = 4 * (c / 2) + (c & 1), col = acc_col(i, lane);
        const float rw = col < t.valid ? __ldg(routing_w + t.row_off + col) : 0.0f;
#pragma unroll
        for (int s = 0; s < kMSub; ++s) {
            const float gate = fminf(round_bf16(acc[s][i]), clamp);
            const float up = fminf(fmaxf(round_bf16(acc[s][i + 2]), -clamp), clamp);
            const float act = gate * sigmoid<GC_FAST_MATH != 0>(alpha * gate) * up * rw;
            acc[s][i] = act;
            float m = fabsf(act);
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
            if (lane < 4) red_wg[(s * 4 + warp) * kBM + col] = m;
        }
    }
    named_barrier(1 + cw, 128);  // the warpgroup's 4 warps hold its 32-column groups
#pragma unroll
    for (int c = 0; c < kAcc / 2; ++c) {
        const int i = 4 * (c / 2) + (c & 1), col = acc_col(i, lane);
        if (col < t.valid) {
            const size_t row = static_cast<size_t>(t.row_off + col);
#pragma unroll
            for (int s = 0; s < kMSub; ++s) {
                float m = red_wg[s * 4 * kBM + col];
#pragma unroll
                for (int w = 1; w < 4; ++w) m = fmaxf(m, red_wg[(s * 4 + w) * kBM + col]);
                const int code = ue8m0_code_448(m);
                const float inv = __uint_as_float(static_cast<u32>(254 - code) << 23);  // 2^-k, exact
                const int icol = (t.tile * 16 + (cw * kMSub + s) * 4 + warp) * 8 + lane / 4;
                const __nv_fp8_e4m3 q(acc[s][i] * inv);
                out[row * inter + icol] = q.__x;
                if (warp == 0 && lane < 4) {
                    out_sf[(static_cast<size_t>(t.tile) * rows_total + row) * 4 + cw * kMSub + s] =
                        static_cast<u8>(code);
                }
            }
        }
    }
    named_barrier(1 + cw, 128);  // `red` is rewritten by the next task
}

}  // namespace sm90
}  // namespace gc_moe

using namespace gc_moe;
using namespace gc_moe::sm90;

// tm_w: the prepared weight units as [E * (k/128) * (n_w/64) * 34, 128] bytes (box 128 x kSlabs * 34, no swizzle);
// tm_x: [rows_total, k] E4M3 (box 128 x GC_BM, 128-byte swizzle); factor: FP32 [E] (2^base of the window repack);
// x_sf_t: [k/128, rows_total] 32-bit words (W1: FP32 1x128 token scales; W2: packed UE8M0 codes of the four K32
// groups); blocks: int32 [*, 3]; *num_blocks blocks are live.
// W1 (GC_EPI=1): n_w = 2I (interleaved), out = E4M3 [rows_total, I], out_sf = packed UE8M0 [I/128, rows_total, 4].
// W2 (GC_EPI=2): n_w = H, out = BF16 [rows_total, H]; out_sf and routing_w unused. clamp = +inf for none.
extern "C" __global__ void __launch_bounds__(kThreads, 1)
    gc_sm90_fp8_fp4_grouped_gemm(const __grid_constant__ TensorMap tm_w, const __grid_constant__ TensorMap tm_x,
                                 const float* __restrict__ factor, const u32* __restrict__ x_sf_t,
                                 const int* __restrict__ blocks, const int* __restrict__ num_blocks,
                                 const float* __restrict__ routing_w, void* __restrict__ out, u8* __restrict__ out_sf,
                                 int n_w, int k, int rows_total, float clamp, float alpha, KernelStatus* status,
                                 u64 timeout_ns) {
    extern __shared__ u8 smem_raw[];
    u8* smem = align_smem_1024(smem_raw);
    const Pipeline pipe{smem_addr(smem)};
    const int tid = threadIdx.x;
    if (!has_dyn_smem(kSmemBytes, tid, status, kSiteSmem)) return;
    if (tid == 0) {
        pipe.init(kConsumerWGs * 4);
        prefetch_tensormap(&tm_w);
        prefetch_tensormap(&tm_x);
    }
    __syncthreads();

    const int nb = __ldg(num_blocks);
    const int kb_count = k / kBK;
    const int slabs_w = n_w / 64;
    const int num_tasks = nb * (n_w / kRows);
    const u64 policy_w = evict_first_policy();
    const u64 policy_x = evict_last_policy();  // token tiles are re-read by every weight tile of their block
    const int wg = tid / 128;

    if (kProducerWG && wg == 0) {
        produce_tasks(tid, blocks, nb, num_tasks, kb_count, [&](u32 it, const Task& t, int kb) {
            return produce(pipe, it, t, kb, kb_count, slabs_w, &tm_w, &tm_x, x_sf_t, rows_total, policy_w, policy_x,
                           status, timeout_ns);
        });
        return;
    }
    if (kProducerWG) setmaxnreg_inc<232>();

    const int cw = wg - kProducerWG, warp = (tid / 32) & 3, lane = tid & 31;
    const int local_tid = tid - kProducerWG * 128;
    float* red = reinterpret_cast<float*>(smem + kOffRed);
    u32 it = 0;
    for (int task = blockIdx.x; task < num_tasks; task += gridDim.x) {
        const Task t = load_task(blocks, task, nb);
        const int n8 = (min(t.valid, kBM) + 7) / 8;
        if (!kProducerWG && local_tid == 0) {
            for (int kb = 0; kb < min(kStages, kb_count); ++kb) {
                if (!produce(pipe, it + kb, t, kb, kb_count, slabs_w, &tm_w, &tm_x, x_sf_t, rows_total, policy_w,
                             policy_x, status, timeout_ns))
                    return;
            }
        }
        __syncwarp();
        float acc[kMSub][kAcc];
        zero(acc);
        for (int kb = 0; kb < kb_count; ++kb, ++it) {
            const u32 stage = it % kStages;
            if (!mbar_wait(pipe.full(stage), (it / kStages) & 1, timeout_ns, status, kSiteFull)) return;
            u32 a[kMSub][4][4];
#pragma unroll
            for (int s = 0; s < kMSub; ++s)
                decode_slab(smem + kOffW + stage * kWBytes + (cw * kMSub + s) * kUnitBytes, warp, lane, a[s]);
            const u32* xs = reinterpret_cast<const u32*>(smem + kOffS + stage * kSBytes);
            u32 xsr[kAcc / 2];
#pragma unroll
            for (int c = 0; c < kAcc / 2; ++c) xsr[c] = xs[acc_col(4 * (c / 2) + (c & 1), lane)];
            float tmp[kSplit][kMSub][kAcc];
            fence_operands(tmp);
            wgmma_fence();  // the decoded A registers were written by this thread
            mma_stage_n(n8, tmp, a, pipe.base + stage * kXBytes);
            wgmma_commit();
            wgmma_wait_all();
            fence_operands(tmp);
            fence_operands(a);  // A stays live until the wait above
            __syncwarp();
            if (lane == 0) mbar_arrive(pipe.empty(stage));
            if (!kProducerWG && local_tid == 0 && kb + kStages < kb_count) {
                if (!produce(pipe, it + kStages, t, kb + kStages, kb_count, slabs_w, &tm_w, &tm_x, x_sf_t, rows_total,
                             policy_w, policy_x, status, timeout_ns))
                    return;
            }
            __syncwarp();
#pragma unroll
            for (int q = 0; q < kSplit; ++q) {
#pragma unroll
                for (int c = 0; c < kAcc / 2; ++c) {
                    // W1: the token's FP32 scale; W2: 2^(code - 127) of K32 group q (UE8M0 codes are >= 1 here).
                    const float sc = kEpi == 1 ? __uint_as_float(xsr[c]) : __uint_as_float(((xsr[c] >> (8 * q)) & 0xFFu) << 23);
                    const int i = 4 * (c / 2) + (c & 1);
#pragma unroll
                    for (int s = 0; s < kMSub; ++s) {
                        acc[s][i] = fmaf(tmp[q][s][i], sc, acc[s][i]);
                        acc[s][i + 2] = fmaf(tmp[q][s][i + 2], sc, acc[s][i + 2]);
                    }
                }
            }
        }
        const float f64 = __ldg(factor + t.expert) * 64.0f;  // window factor 2^base and the decoder's x64 headroom
#pragma unroll
        for (int s = 0; s < kMSub; ++s)
#pragma unroll
            for (int i = 0; i < kAcc; ++i) acc[s][i] *= f64;
        if constexpr (kEpi == 1) {
            epilogue_w1(acc, t, cw, warp, lane, red, routing_w, static_cast<u8*>(out), out_sf, n_w / 2, rows_total,
                        clamp, alpha);
        } else {
            epilogue_w2<kRows>(acc, t, cw, warp, lane, static_cast<__nv_bfloat16*>(out), n_w);
        }
    }
}
