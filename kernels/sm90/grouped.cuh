// Pieces both SM90 grouped expert GEMMs share (fp8_grouped_gemm.cu, fp8_fp4_grouped_gemm.cu): the task table
// read, the WGMMA accumulator's column map and the epilogue arithmetic whose rounding the references model.
#pragma once

#include <cuda_bf16.h>

#include "sm90/ptx.cuh"

namespace gc_moe {
namespace sm90 {

// One unit of work: `tile` of an expert's weight rows against one ring block (expert, valid rows, first row).
struct Task {
    int expert, valid, row_off, tile;
};

// Task `task` of a persistent grid over `num_blocks` ring blocks; consecutive tasks share a weight tile across an
// expert's blocks (L2 reuse).
__device__ __forceinline__ Task load_task(const int* blocks, int task, int num_blocks) {
    const int blk = task % num_blocks;
    return Task{__ldg(blocks + 3 * blk), __ldg(blocks + 3 * blk + 1), __ldg(blocks + 3 * blk + 2), task / num_blocks};
}

// The W1 epilogue rounds the GEMM result to BF16 before SwiGLU (reference.py, semantics 4).
__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// Sigmoid; kFast: __expf and a rounded reciprocal (the paper's fast-math option).
template <bool kFast>
__device__ __forceinline__ float sigmoid(float v) {
    if constexpr (kFast) {
        return __frcp_rn(1.0f + __expf(-v));
    } else {
        return 1.0f / (1.0f + expf(-v));
    }
}

// Accumulator register i of a slab holds column 8*(i/4) + 2*(lane%4) + i%2 and row 16*warp + lane/4 + 8*((i/2)%2).
__device__ __forceinline__ int acc_col(int i, int lane) { return 8 * (i / 4) + 2 * (lane & 3) + (i & 1); }

}  // namespace sm90
}  // namespace gc_moe
