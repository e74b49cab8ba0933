// Role4 of the GC-MoE operator on SM90: the fused shared expert on this rank's T local tokens (paper §4.5), its BF16
// partial rows written into this rank's combine slot k, which role3 sums after the k routed slots (slot order).
//
// One source, two entries' worth of variants (GC_EPI): the W1 variant reads the staged tokens in place (the buffer's
// x [Tmax, H] E4M3 by TMA, x_sf [Tmax, H/128] FP32 row-major: zero copy) against the shared W1 [2I, H] (gate/up rows
// interleaved by 8) with FP32 128x128 block scales, runs the routed path's fused SwiGLU epilogue (same clamp, alpha,
// BF16 rounding; routing weight 1.0) and requantizes into the workspace's shared_l2_acts [Tmax, I] /
// shared_l2_acts_sf [I/128, Tmax] (FP32 amax/448 like the FP8xFP8 routed path, or UE8M0 with GC_SHARED_UE8M0=1 like
// the FP8xFP4 routed path); the W2 variant reads them against the shared W2 [H, I] and stores BF16 rows into
// combine[k] [Tmax, H]. The token blocks are the host's table of ceil(T/BM) rows (expert 0, valid rows, first token).
//
// Reused, not rewritten: the FP8 mainloop (sm90/fp8_grouped.cuh: constants, stage issue, consumer K loop with the
// w_scale * x_scale promotion), the W1 epilogue (sm90/epilogue_w1.cuh), the standalone grid body (task walk, warpgroup
// roles, bounded mbarrier waits, status sites 1-3: sm90/standalone_gemm.cuh). What is role4's own is the W1 stage
// issue: the mainloop's issue bulk-copies a K step's token scales from a transposed [K/128, rows] array, but x_sf
// is token-major. With GC_TASK_SCALES = H/128 (the host's default) the consumer warpgroups copy the block's whole
// [BM, H/128] scales once per task into shared memory (fp8_grouped.cuh's copy_task_scales, coalesced), and a stage
// brings only the weight and token tiles. With GC_TASK_SCALES = 0 (kept to measure the difference) the issuing
// thread copies the block's BM scales of step kb into the stage with plain loads (L1-resident after the first step)
// and shared stores before its arrive.expect_tx (release at CTA scope: the consumers' acquire on the full barrier
// sees them): BM dependent load/store pairs per K step on one thread, in the consumer warpgroup's own K loop when
// there is no producer warpgroup (bench/README.md, "SGLang's Hopper sequence", measured both).
//
// Shared weight scales (GC_W_K32): 0, FP32 128x128 block scales [1, N/128, K/128] (recipe (1, 128, 128)), one
// promotion per K128 step; 1, DeepGEMM's shared recipe, per-row UE8M0 K32 scales as int32 words [K/128, N] (four
// codes each; role4_shared.Role4Weights transposes the packed [N, K/128] once), promoted per K32 MMA
// (fp8_grouped.cuh's consume_n_k32). The activations' FP32 1x128 scales (W2: the W1 epilogue's) apply per K128 in both.
#include "sm90/standalone_gemm.cuh"  // before the variant constants: its templates see only their policy's
#include "sm90/fp8_grouped.cuh"

#ifndef GC_SHARED_UE8M0
#define GC_SHARED_UE8M0 0
#endif

#if GC_OPERATOR || GC_CLUSTER
#error "role4_shared.cu: standalone grid body without cluster pairs (GC_OPERATOR=0, GC_CLUSTER=0)"
#endif
#if GC_W_K32 && GC_CLUSTER
#error "GC_W_K32: the K32 loop has no cluster-pair weight split"
#endif
#if GC_TASK_SCALES && GC_EPI != 1
#error "GC_TASK_SCALES: the W1 variant only (W2 reads the transposed shared_l2_acts_sf through the mainloop's issue)"
#endif
#ifndef GC_ROLE4_SMEM_BYTES
#error "GC_ROLE4_SMEM_BYTES: the host's shared-memory formula (role4_shared.Role4Variant.smem) must be defined"
#endif

namespace gc_moe {
namespace sm90 {

// The host's formula arrives as a define, so a drift between the two fails to compile instead of the launch check.
static_assert(kSmemBytes == GC_ROLE4_SMEM_BYTES, "GC_ROLE4_SMEM_BYTES: Role4Variant.smem differs from kSmemBytes");

__device__ __forceinline__ void st_shared_f32(u32 addr, float v) {
    asm volatile("st.shared.f32 [%0], %1;" ::"r"(addr), "f"(v) : "memory");
}

// W1 stage issue: without task scales, the block's token scales of K step kb copied from x_sf [rows, k_groups]
// (token-major) into the stage (0 past the block's valid rows); then the arrival with the TMA bytes and the weight /
// token tile loads.
__device__ __forceinline__ void issue_w1_token_major(const Pipeline& pipe, u32 it, const Task& t, int kb,
                                                     const TensorMap* tm_w, const TensorMap* tm_x, const float* x_sf,
                                                     int k_groups, int n_w, u64 policy_w, u64 policy_x) {
    const u32 stage = it % kStages;
    const u32 full = pipe.full(stage);
    if constexpr (!kTaskScales) {
        const u32 s_dst = pipe.base + kOffS + stage * kSBytes;
#pragma unroll 8
        for (int c = 0; c < kBM; ++c) {
            const float v = c < t.valid ? __ldg(x_sf + static_cast<size_t>(t.row_off + c) * k_groups + kb) : 0.0f;
            st_shared_f32(s_dst + 4 * c, v);
        }
    }
    mbar_arrive_expect_tx(full, kWBytes + kXBytes);
    tma_load_2d(pipe.base + stage * kWBytes, tm_w, kb * kBK, t.expert * n_w + t.tile * kRows, full, policy_w);
    tma_load_2d(pipe.base + kOffX + stage * kXBytes, tm_x, kb * kBK, t.row_off, full, policy_x);
}

// standalone_body's kernel policy (sm90/standalone_gemm.cuh): fp8_grouped.cuh's constants and consumer K loop, the
// routed path's scale rule of the format, role4's stage issue. W1: a.x_sf_t is the buffer's token-major x_sf; W2:
// the transposed shared_l2_acts_sf [I/128, Tmax] the W1 epilogue wrote, through the mainloop's own issue.
struct Role4Shared : Fp8StandaloneBase {
    static constexpr bool kUe8m0 = GC_SHARED_UE8M0 != 0;  // the W1 epilogue's scale rule

    static __device__ __forceinline__ void sa_issue(const StandaloneArgs& a, const Pipeline& pipe, u32 it,
                                                    const Task& t, int kb, u64 policy_w, u64 policy_x,
                                                    bool /*multicast*/, u32 /*rank*/) {
        if constexpr (kEpi == 1) {
            issue_w1_token_major(pipe, it, t, kb, a.tm_w, a.tm_x, a.x_sf_t, a.k / kBK, a.n_w, policy_w, policy_x);
        } else {
            issue(pipe, it, t, kb, a.tm_w, a.tm_x, a.x_sf_t, a.n_w, a.rows_total, policy_w, policy_x);
        }
    }
};

}  // namespace sm90
}  // namespace gc_moe

using namespace gc_moe;
using namespace gc_moe::sm90;

// GC_EPI=1 (W1): tm_w the shared W1 [2I, H] E4M3 (interleaved, box 128 x 256), tm_x the buffer's x [Tmax, H] (box
// 128 x GC_BM), w_sf FP32 [1, 2I/128, H/128] (GC_W_K32: int32 words [H/128, 2I], rows interleaved), x_sf_t the
// buffer's x_sf [Tmax, H/128], routing_w FP32 ones [>= T], out shared_l2_acts [Tmax, I], out_sf_t
// shared_l2_acts_sf [I/128, Tmax], n_w = 2I, k = H, rows_total = Tmax.
// GC_EPI=2 (W2): tm_w the shared W2 [H, I] (box 128 x kRows), tm_x shared_l2_acts (box 128 x GC_BM), w_sf FP32
// [1, H/128, I/128] (GC_W_K32: int32 words [I/128, H]), x_sf_t shared_l2_acts_sf, out combine[k] [Tmax, H] BF16,
// n_w = H, k = I. blocks: int32 [*, 3] (0, valid rows, first token), *num_blocks of them live; status: the
// workspace's role4 record.
extern "C" __global__ void __launch_bounds__(kThreads, 1)
    gc_sm90_role4_shared(const __grid_constant__ TensorMap tm_w, const __grid_constant__ TensorMap tm_x,
                         const float* __restrict__ w_sf, const float* __restrict__ x_sf_t,
                         const int* __restrict__ blocks, const int* __restrict__ num_blocks,
                         const float* __restrict__ routing_w, void* __restrict__ out, float* __restrict__ out_sf_t,
                         int n_w, int k, int rows_total, float clamp, float alpha, KernelStatus* status,
                         u64 timeout_ns) {
    standalone_body<Role4Shared>(StandaloneArgs{&tm_w, &tm_x, w_sf, x_sf_t, blocks, num_blocks, routing_w, out,
                                                out_sf_t, n_w, k, rows_total, clamp, alpha, status, timeout_ns});
}
