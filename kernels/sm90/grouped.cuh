// Pieces both SM90 grouped expert GEMMs share (role2_gemm_fp8xfp8.cu, role2_gemm_fp8xfp4.cu, and their operator mode):
// the stage ring's barriers and the kernels' common start, the task table read, the WGMMA accumulator's column map,
// the register fences around WGMMA and the epilogue arithmetic whose rounding the references model. Everything is
// __forceinline__: the standalone kernels' cubins are byte-identical to their records
// (tests/operator/test_role2_operator_host.py).
#pragma once

#include <cuda_bf16.h>

#include "sm90/ptx.cuh"

// GC_OPERATOR=1 builds role2 of the GC-MoE operator from a grouped-GEMM source (sm90/role2_gemm.cuh); 0 (default)
// the standalone kernel.
#ifndef GC_OPERATOR
#define GC_OPERATOR 0
#endif

namespace gc_moe {
namespace sm90 {

// Status sites of both kernels (role2 in operator mode adds 4-8: sm90/role2_gemm_params.cuh), generated between the
// markers by gc_moe_compat.operator.sm90.role2_gemm.grouped_header(); tests/operator/test_role2_operator_host.py
// checks that they are identical.
// BEGIN GENERATED
// Generated from gc_moe_compat.operator.sm90.role2_gemm.Role2Site.
enum GroupedSite : unsigned int {
    kSiteSmem = 1,   // role2 dynamic shared memory below the variant's need
    kSiteEmpty = 2,  // role2 producer wait for a free pipeline stage
    kSiteFull = 3,   // role2 consumer wait for a filled pipeline stage
};
// END GENERATED

// The stage ring's mbarriers, 8 bytes each from kOffBar of the 1024-aligned tile area: full[kStages], then
// empty[kStages].
template <u32 kOffBar, int kStages>
struct StagePipeline {
    u32 base;  // shared address of the 1024-aligned tile area
    __device__ __forceinline__ u32 full(u32 stage) const { return base + kOffBar + 8 * stage; }
    __device__ __forceinline__ u32 empty(u32 stage) const { return base + kOffBar + 8 * (kStages + stage); }
    // One thread: one arrival (the producer's expect_tx) fills a stage, `empty_arrivals` (one per consumer warp)
    // free it.
    __device__ __forceinline__ void init(u32 empty_arrivals) const {
        for (u32 s = 0; s < kStages; ++s) {
            mbar_init(full(s), 1);
            mbar_init(empty(s), empty_arrivals);
        }
        fence_barrier_init();
    }
};

// The 1024-aligned tile area in dynamic shared memory (128-byte swizzled tiles want 1024-byte alignment; every
// kernel's kSmemBytes holds 1024 bytes of slack for it). An offset from `raw`, not an integer round trip: the
// compiler then still knows the result points into shared memory and reads through it with LDS (a pointer rebuilt
// from an integer is generic: 64-bit address arithmetic and generic loads in every consumer loop).
__device__ __forceinline__ u8* align_smem_1024(u8* raw) {
    return raw + ((1024u - (smem_addr(raw) & 1023u)) & 1023u);
}

GC_PTX_VALUE(u32, "r", dynamic_smem_bytes, "mov.u32 %0, %%dynamic_smem_size;")

// False when the launch gave less dynamic shared memory than `need` (thread `tid` == 0 records kStatusMismatch at
// `site` with what it got and the need).
__device__ __forceinline__ bool has_dyn_smem(u32 need, int tid, KernelStatus* status, u32 site) {
    const u32 dyn_smem = dynamic_smem_bytes();
    if (dyn_smem < need) {
        if (tid == 0) report_status(status, kStatusMismatch, site, dyn_smem, need);
        return false;
    }
    return true;
}

// Register fences around an asynchronous WGMMA: the compiler neither reads nor moves these values across them.
template <typename T, int A, int B>
__device__ __forceinline__ void fence_operands(T (&x)[A][B]) {
#pragma unroll
    for (int a = 0; a < A; ++a)
#pragma unroll
        for (int b = 0; b < B; ++b) fence_operand(x[a][b]);
}

template <typename T, int A, int B, int C>
__device__ __forceinline__ void fence_operands(T (&x)[A][B][C]) {
#pragma unroll
    for (int a = 0; a < A; ++a) fence_operands(x[a]);
}

template <int A, int B>
__device__ __forceinline__ void zero(float (&x)[A][B]) {
#pragma unroll
    for (int a = 0; a < A; ++a)
#pragma unroll
        for (int b = 0; b < B; ++b) x[a][b] = 0.0f;
}

template <int A, int B, int C>
__device__ __forceinline__ void zero(float (&x)[A][B][C]) {
#pragma unroll
    for (int a = 0; a < A; ++a) zero(x[a]);
}

// The per-task WGMMA N switch's argument: the block's valid rows rounded up to 8, at least 8 (a block without rows
// still runs its K loop, so that every stage it was given is consumed and released).
template <int kBM>
__device__ __forceinline__ int wgmma_n8(int valid) {
    return max(1, (min(valid, kBM) + 7) / 8);
}

// WGMMA N as a type, for with_wgmma_n's callback.
template <int N>
struct WgmmaN {
    static constexpr int value = N;
};

// Calls f(WgmmaN<n8 * 8>{}) for n8 * 8 <= kBM (WGMMA N, the block's valid rows rounded up to 8, is an immediate of
// the instruction); any other n8 does nothing.
// Call it once per task around the whole K loop, never around the MMAs of one stage: with a switch inside the loop
// the accumulators of the N cases merge at every stage and ptxas serializes every WGMMA (C7511, "insufficient
// register resources": each QGMMA waits for the previous one). The same happens when an accumulator's first WGMMA
// (scale-d 0) reads registers that were never written, so the kernels zero a fresh accumulator set before its MMAs.
template <int kBM, typename F>
__device__ __forceinline__ void with_wgmma_n(int n8, F&& f) {
    switch (n8) {
#define GC_MMA_CASE(C)                                    \
    case C:                                               \
        if constexpr (C * 8 <= kBM) f(WgmmaN<C * 8>{});   \
        break;
        GC_MMA_CASE(1)
        GC_MMA_CASE(2)
        GC_MMA_CASE(3)
        GC_MMA_CASE(4)
        GC_MMA_CASE(5)
        GC_MMA_CASE(6)
        GC_MMA_CASE(7)
        GC_MMA_CASE(8)
        GC_MMA_CASE(9)
        GC_MMA_CASE(10)
        GC_MMA_CASE(11)
        GC_MMA_CASE(12)
#undef GC_MMA_CASE
        default:
            break;
    }
}

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

// Frees a stage (one arrival per consumer warp); in a cluster pair on both CTAs' barriers, since both producers
// write into both CTAs' stage.
template <bool kCluster>
__device__ __forceinline__ void release_stage(u32 empty_bar) {
    mbar_arrive(empty_bar);
    if constexpr (kCluster) mbar_arrive_cluster(map_shared_rank(empty_bar, cluster_ctarank() ^ 1));
}

// A cluster pair's load of a task's weight box of one K step (`bytes` at w_dst, TMA coordinates c0, row; the tensor
// map's box is half of it, `half_rows` rows) onto barrier `full`: CTA `rank` loads half `rank` of a `multicast` box
// into both CTAs, or both halves of its own.
template <u32 kBytes>
__device__ __forceinline__ void load_weights_pair(u32 w_dst, const TensorMap* tm_w, int c0, int row, int half_rows,
                                                  u32 full, u64 policy, bool multicast, u32 rank) {
    constexpr u32 kHalf = kBytes / 2;
    if (multicast) {
        tma_load_2d_multicast(w_dst + rank * kHalf, tm_w, c0, row + rank * half_rows, full, 0x3, policy);
    } else {
        tma_load_2d(w_dst, tm_w, c0, row, full, policy);
        tma_load_2d(w_dst + kHalf, tm_w, c0, row + half_rows, full, policy);
    }
}

// Cluster pairs (the GC_CLUSTER standalone variants): the two CTAs of a cluster take pair task j = (tile j / pairs,
// pair j % pairs) of the block table, rank r block 2 * pair + r. Where both blocks belong to one expert (the host
// orders each expert's blocks in aligned pairs first: grouping.py), the CTAs stream the weight tile once, each
// loading half and multicasting it to both. A last pair without a second block gives rank 1 a mirror of rank 0's
// task: it runs the same K loop (the pair's barriers count both CTAs) and stores nothing.
struct PairTask {
    Task t;
    bool multicast;  // both CTAs hold the same expert and tile
    bool mirror;     // rank 1 without a block: no stores
};

__device__ __forceinline__ int pair_count(int num_blocks) { return (num_blocks + 1) / 2; }

__device__ __forceinline__ PairTask load_pair_task(const int* blocks, int j, int num_blocks, u32 rank) {
    const int pairs = pair_count(num_blocks), b0 = 2 * (j % pairs);
    const bool second = b0 + 1 < num_blocks;
    const int b = rank == 1 && second ? b0 + 1 : b0;
    const Task t{__ldg(blocks + 3 * b), __ldg(blocks + 3 * b + 1), __ldg(blocks + 3 * b + 2), j / pairs};
    const bool same = !second || __ldg(blocks + 3 * b0) == __ldg(blocks + 3 * b0 + 3);
    return PairTask{t, same, rank == 1 && !second};
}

// The standalone kernels' parameters, as both entries receive them (sm90/standalone_gemm.cuh; their sources'
// comments say what each holds).
struct StandaloneArgs {
    const TensorMap* tm_w;
    const TensorMap* tm_x;
    const float* w_sf;  // FP8xFP8: FP32 block scales [E, n_w/128, k/128]; FP8xFP4: the window factors [E]
    const float* x_sf_t;
    const int* blocks;
    const int* num_blocks;
    const float* routing_w;
    void* out;
    float* out_sf_t;
    int n_w, k, rows_total;
    float clamp, alpha;
    KernelStatus* status;
    u64 timeout_ns;
};

// The producer warpgroup of the pipelined standalone kernels, at kProducerRegs registers (gemm_variant.cuh): thread `tid` == 0 walks this CTA's tasks
// (first, + stride, ... below num_tasks; task_at(i) reads one) and issues each one's kb_count K steps in order into
// pipeline slot `it`; produce(it, task, kb) false gives up.
template <int kProducerRegs, typename TaskAt, typename Produce>
__device__ __forceinline__ void produce_tasks(int tid, int first, int stride, int num_tasks, int kb_count,
                                              TaskAt&& task_at, Produce&& produce) {
    setmaxnreg_dec<kProducerRegs>();
    if (tid == 0) {
        u32 it = 0;
        for (int i = first; i < num_tasks; i += stride) {
            const auto task = task_at(i);
            for (int kb = 0; kb < kb_count; ++kb, ++it) {
                if (!produce(it, task, kb)) return;
            }
        }
    }
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

// W2 epilogue of the standalone kernels: BF16 partial rows [rows, H] of a task of kRows weight rows (consumer
// warpgroup cw owns kMSub slabs of 64 rows).
template <int kRows, int kMSub, int kAcc>
__device__ __forceinline__ void epilogue_w2(const float (&acc)[kMSub][kAcc], const Task& t, int cw, int warp, int lane,
                                            __nv_bfloat16* out, int n_w) {
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
