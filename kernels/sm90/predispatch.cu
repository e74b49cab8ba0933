// The deep_gemm facade's pre-dispatch (host side: gc_moe_compat/deep_gemm/_predispatch.py): one fused kernel that
// quantizes this rank's BF16 tokens into the Mega MoE buffer's `x` / `x_sf` views and stages the routing, the
// arithmetic of the originals' kernels (sgl-deep-gemm's sm90_mega_moe_pre_dispatch.cuh / sm100_..._pre_dispatch.cuh):
//
//   gc_pre_dispatch_fp32x128 (mega_moe_pre_dispatch_sm90): per 128 columns scale = max(amax, 1e-10) / 448 (FP32),
//     payload = E4M3 saturating(x * (1 / scale)), the scale stored as FP32 [T, H/128].
//   gc_pre_dispatch_ue8m0x32 (mega_moe_pre_dispatch): per 32 columns e = ceil-exponent of max(amax, 1e-4) / 448
//     (UE8M0 byte, clamped to [1, 254]), payload = E4M3 saturating(x * 2^(127-e)), four bytes packed per int32
//     [T, H/128] (byte j of word i = group 4i + j).
//
// Both copy topk_idx rows [0, T) (int32, widened into the int64 view: the originals' dtypes) and topk_weights times
// routed_scaling_factor, and fill the routing rows [T, capacity) with (-1, 0.0). Invalid routing (an id outside
// [-1, id_max]: id_max = the buffer's E - 1, else the int64 maximum; a non-finite scaled weight) is staged as (-1, 0.0)
// and recorded for the host (common/dropped.cuh), so no later kernel sees it. A token whose row of x holds a NaN or
// Inf (no FP8 scale represents it) is dropped whole: zero payload and scales, every slot (-1, 0.0), recorded with
// its row and the column of one such value. Grid: one CTA of H/8 threads per
// token (each thread one 16-byte BF16 vector), then ceil((capacity - T) * k / (H/8)) CTAs for the padding. Compiled
// without fast math: the divisions are IEEE, so a torch model of the same operations reproduces every byte.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "common/dropped.cuh"
#include "sm90/predispatch_params.cuh"

namespace {

using gc_moe::PreDispatchParams;

constexpr unsigned kVec = 8;  // BF16 values per thread: one 16-byte load

// Max over the `lanes` consecutive lanes of a group (lanes a power of two, <= 32, groups aligned in the warp).
__device__ __forceinline__ float group_max(float v, unsigned lanes) {
    for (unsigned offset = lanes / 2; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// UE8M0 exponent byte of the smallest power of two >= s (s positive and finite), clamped to [1, 254].
__device__ __forceinline__ unsigned ceil_ue8m0(float s) {
    const unsigned bits = __float_as_uint(s);
    unsigned e = (bits >> 23) & 0xffu;
    if (bits & 0x7fffffu) e += 1;
    return min(max(e, 1u), 254u);
}

// Routing of one token. An id outside [-1, id_max] or a weight whose product with the factor is not finite is
// staged as the unused slot (-1, 0.0) and recorded (common/dropped.cuh): nothing downstream acts on it. A dropped
// token (`dropped`: its row of x is not finite, already recorded) stages every slot as unused.
__device__ __forceinline__ void stage_routing(const PreDispatchParams& p, unsigned token, bool dropped) {
    for (unsigned j = threadIdx.x; j < p.topk; j += blockDim.x) {
        const unsigned long long off = static_cast<unsigned long long>(token) * p.topk + j;
        long long id = reinterpret_cast<const int*>(p.topk_idx)[off];
        float weight = reinterpret_cast<const float*>(p.topk_weights)[off] * p.routed_scaling_factor;
        const bool bad_id = id < -1 || id > p.id_max;
        const bool bad_weight = !isfinite(weight);
        if (dropped) {
            id = -1;
            weight = 0.0f;
        } else if (bad_id || bad_weight) {
            if (bad_id) {
                gc_moe::report_dropped(p.dropped, p.dropped_mirror, gc_moe::kDroppedPredispatchId,
                                       static_cast<unsigned long long>(id), static_cast<unsigned long long>(p.id_max));
            } else {
                gc_moe::report_dropped(p.dropped, p.dropped_mirror, gc_moe::kDroppedPredispatchWeight,
                                       __float_as_uint(weight), off);
            }
            id = -1;
            weight = 0.0f;
        }
        reinterpret_cast<long long*>(p.buf_topk_idx)[off] = id;
        reinterpret_cast<float*>(p.buf_topk_weights)[off] = weight;
    }
}

__device__ __forceinline__ void fill_padding(const PreDispatchParams& p, unsigned pad_block) {
    const unsigned long long slot = static_cast<unsigned long long>(p.num_tokens) * p.topk +
                                    static_cast<unsigned long long>(pad_block) * blockDim.x + threadIdx.x;
    if (slot >= static_cast<unsigned long long>(p.capacity) * p.topk) return;
    reinterpret_cast<long long*>(p.buf_topk_idx)[slot] = -1;
    reinterpret_cast<float*>(p.buf_topk_weights)[slot] = 0.0f;
}

// One token's payload and scales; `kUe8m0` picks the K32 UE8M0 recipe, else FP32 per 128. A row holding a NaN or
// Inf is recorded (the token's row, the column of this thread's first such value: the first thread to report wins)
// and staged as zero payload and scales; returns whether it was (the same in every thread of the CTA).
template <bool kUe8m0>
__device__ __forceinline__ bool quantize_token(const PreDispatchParams& p, unsigned token) {
    constexpr unsigned kGroup = kUe8m0 ? 32 : 128;
    constexpr unsigned kLanes = kGroup / kVec;
    const unsigned tid = threadIdx.x;
    const unsigned long long row = static_cast<unsigned long long>(token) * p.hidden;
    const uint4 bits = reinterpret_cast<const uint4*>(reinterpret_cast<const __nv_bfloat16*>(p.x) + row)[tid];
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&bits);
    float v[kVec];
    float amax = 0.0f;
    unsigned bad_column = p.hidden;  // this thread's first non-finite column; hidden: none
#pragma unroll
    for (unsigned i = 0; i < kVec / 2; ++i) {
        const float2 f = __bfloat1622float2(pairs[i]);
        v[2 * i] = f.x;
        v[2 * i + 1] = f.y;
        amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
        if (bad_column == p.hidden && !(isfinite(f.x) && isfinite(f.y)))
            bad_column = tid * kVec + 2 * i + (isfinite(f.x) ? 1 : 0);
    }
    const bool dropped = __syncthreads_or(bad_column != p.hidden) != 0;
    if (bad_column != p.hidden) {
        gc_moe::report_dropped(p.dropped, p.dropped_mirror, gc_moe::kDroppedPredispatchX, token, bad_column);
    }
    amax = group_max(amax, kLanes);
    float inv;
    float scale = 0.0f;
    unsigned code = 0;
    if constexpr (kUe8m0) {
        code = ceil_ue8m0(__fdiv_rn(fmaxf(amax, 1e-4f), 448.0f));
        inv = __uint_as_float((254u - code) << 23);
    } else {
        scale = __fdiv_rn(fmaxf(amax, 1e-10f), 448.0f);
        inv = __fdiv_rn(1.0f, scale);
    }
    unsigned long long packed = 0;
#pragma unroll
    for (unsigned i = 0; i < kVec / 2; ++i) {
        const __nv_fp8x2_storage_t q = __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(v[2 * i], inv),
                                                                            __fmul_rn(v[2 * i + 1], inv)),
                                                                __NV_SATFINITE, __NV_E4M3);
        packed |= static_cast<unsigned long long>(q) << (16 * i);
    }
    if (dropped) {  // nothing reads a dropped token's bytes (no slot routes it): zeros, not a NaN's
        packed = 0;
        scale = 0.0f;
        code = 0;
    }
    reinterpret_cast<unsigned long long*>(reinterpret_cast<__nv_fp8_e4m3*>(p.buf_x) + row)[tid] = packed;
    if (tid % kLanes == 0) {
        const unsigned group = tid / kLanes;
        if constexpr (kUe8m0) {
            reinterpret_cast<unsigned char*>(p.buf_x_sf)[static_cast<unsigned long long>(token) * (p.hidden / 32) +
                                                         group] = static_cast<unsigned char>(code);
        } else {
            reinterpret_cast<float*>(p.buf_x_sf)[static_cast<unsigned long long>(token) * (p.hidden / 128) + group] =
                scale;
        }
    }
    return dropped;
}

template <bool kUe8m0>
__device__ __forceinline__ void pre_dispatch(const PreDispatchParams& p) {
    if (blockIdx.x < p.num_tokens) {
        stage_routing(p, blockIdx.x, quantize_token<kUe8m0>(p, blockIdx.x));
    } else {
        fill_padding(p, blockIdx.x - p.num_tokens);
    }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(1024) gc_pre_dispatch_fp32x128(const PreDispatchParams p) {
    pre_dispatch<false>(p);
}

extern "C" __global__ void __launch_bounds__(1024) gc_pre_dispatch_ue8m0x32(const PreDispatchParams p) {
    pre_dispatch<true>(p);
}
