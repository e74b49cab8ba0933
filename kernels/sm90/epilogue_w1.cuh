// The fused W1 epilogue of the SM90 expert GEMMs (FP8xFP8 and FP8xFP4, standalone, role2 and role4): SwiGLU on the
// interleaved gate/up accumulators, routing weight, one requant group per token over the task's 128 intermediate
// columns, E4M3 payload and the group's scale where the W2 stage reads them.
//
// A template over the caller's policy type K, a struct of static constexpr members:
//   kBM, kMSub, kAcc   the variant's token rows, 64-row slabs per consumer warpgroup (2: a W1 task is 256
//                      interleaved rows = 128 intermediate columns) and accumulator registers per slab and thread;
//   kConsumerWGs, kConsumerThreads
//                      the consumer warpgroups, whose warps reduce the amax, and the thread count of their barrier;
//   kUe8m0             the scale rule (below);
//   kFastMath          the sigmoid's (grouped.cuh's sigmoid<kFast>: the host's GC_FAST_MATH);
//   kRingRows          true where the routing weights are ring rows role1 rewrites while the grid runs (role2): they
//                      are loaded through L2 (__ldcg), never the non-coherent read-only path; false where they are
//                      read-only for the launch (the standalone kernels, role4): __ldg.
// It reads no macro and no name of its includer (each source includes it before its variant constants, so the
// template sees only its policy's). The policies are the kernel sources' kernel policies: Fp8Role2 / Fp4Role2
// (role2), Fp8Standalone / Fp4Standalone (the standalone kernels) and Role4Shared (role4). Only the scale rule
// differs between the formats: FP32 amax / 448 (the FP8xFP8 path, SGLang's and DeepGEMM's SM90 recipe) or UE8M0, the
// smallest power of two 2^k with amax <= 448 * 2^k (the FP8xFP4 path: a power of two scales the payload exactly, and
// the W2 kernel promotes with it once per K128 step like W1). Both are stored as FP32 values in the transposed
// [I/128, rows] array.
#pragma once

#include <cuda_fp8.h>

#include "sm90/grouped.cuh"

namespace gc_moe {
namespace sm90 {

// UE8M0 scale of a group (quant.ue8m0_scale(amax, 448)): the smallest 2^k with max(amax, 1e-10) <= 448 * 2^k,
// returned as its biased exponent k + 127. frexp: a = m * 2^e, m in [0.5, 1), and 448 = 0.875 * 2^9, so k is e - 9
// or e - 8, settled by one exact comparison. a >= 1e-10 keeps k in [-42, 120]: normal floats throughout.
__device__ __forceinline__ int ue8m0_code_448(float amax) {
    const float a = fmaxf(amax, 1e-10f);
    int k = static_cast<int>((__float_as_uint(a) >> 23) & 0xFFu) - 126 - 9;
    if (a > 448.0f * __uint_as_float(static_cast<u32>(k + 127) << 23)) ++k;
    return k + 127;
}

// A routing weight: through L2 (kRingRows: a ring row another role may rewrite during the launch) or the read-only
// path.
template <bool kRingRows>
__device__ __forceinline__ float load_routing_weight(const float* p) {
    if constexpr (kRingRows) {
        return __ldcg(p);
    } else {
        return __ldg(p);
    }
}

// W1 of one task: SwiGLU(gate, up) * routing weight, amax per token over the task's 128 intermediate columns
// (reduced across the K::kConsumerWGs * 4 consumer warps through `red`, K::kConsumerWGs * 4 * K::kBM floats), the
// scale (K::kUe8m0: UE8M0, else FP32 amax / 448), the E4M3 payload into out [rows, I] and the scale into out_sf_t
// [I/128, rows]. Rows past the block's valid count are not written.
template <typename K>
__device__ __forceinline__ void epilogue_w1(float (&acc)[K::kMSub][K::kAcc], const Task& t, int cw, int warp,
                                            int lane, float* red, const float* routing_w, u8* out, float* out_sf_t,
                                            int inter, int rows_total, float clamp, float alpha) {
    constexpr int kBM = K::kBM, kMSub = K::kMSub, kAcc = K::kAcc, kConsumerWGs = K::kConsumerWGs,
                  kConsumerThreads = K::kConsumerThreads;
    constexpr bool kUe8m0 = K::kUe8m0;
    float amax[kAcc / 2];
#pragma unroll
    for (int c = 0; c < kAcc / 2; ++c) {
        const int i = 4 * (c / 2) + (c & 1), col = acc_col(i, lane);
        const float rw = col < t.valid ? load_routing_weight<K::kRingRows>(routing_w + t.row_off + col) : 0.0f;
        float m = 0.0f;
#pragma unroll
        for (int s = 0; s < kMSub; ++s) {
            const float gate = fminf(round_bf16(acc[s][i]), clamp);
            const float up = fminf(fmaxf(round_bf16(acc[s][i + 2]), -clamp), clamp);
            const float act = gate * sigmoid<K::kFastMath>(alpha * gate) * up * rw;
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
        float scale, inv = 1.0f;  // UE8M0: 2^k and 2^-k, both exact
        if constexpr (kUe8m0) {
            const int code = ue8m0_code_448(m);
            scale = __uint_as_float(static_cast<u32>(code) << 23);
            inv = __uint_as_float(static_cast<u32>(254 - code) << 23);
        } else {
            scale = fmaxf(m, 1e-10f) / 448.0f;
        }
        if (col < t.valid) {
            const size_t row = static_cast<size_t>(t.row_off + col);
#pragma unroll
            for (int s = 0; s < kMSub; ++s) {
                const int icol = (t.tile * 16 + cw * 8 + s * 4 + warp) * 8 + lane / 4;
                const __nv_fp8_e4m3 q(kUe8m0 ? acc[s][i] * inv : acc[s][i] / scale);
                out[row * inter + icol] = q.__x;
            }
            if (cw == 0 && warp == 0 && lane < 4) out_sf_t[static_cast<size_t>(t.tile) * rows_total + row] = scale;
        }
    }
    named_barrier(1, kConsumerThreads);  // `red` is rewritten by the next task
}

}  // namespace sm90
}  // namespace gc_moe
