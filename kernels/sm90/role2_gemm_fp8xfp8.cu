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
// GC_OPERATOR=1 compiles role2 of the GC-MoE operator instead (entry gc_sm90_fp8_role2: the FP8 kernel policy at
// the end of this file instantiates the grid body template of sm90/role2_gemm.cuh, shared with the FP8xFP4 kernel):
// one persistent grid running both GEMMs over the token ring of the operator workspace, reading the block table role1
// publishes and handshaking with role1 and with itself through the ring signals. GC_OPERATOR=0 (default) is the
// standalone kernel (entry gc_sm90_fp8_grouped_gemm: the policy Fp8Standalone instantiates the grid body template of
// sm90/standalone_gemm.cuh, shared with the FP8xFP4 kernel and role4); both run the same consumer K loop (consume).
// tests/operator/test_role2_operator_host.py keeps the standalone cubins' hashes
// (tests/data/sm90_fp8_standalone_cubins.json, rewritten by scripts/record_sm90_cubins.py when the kernel changes).
// The variant constants, the stage issue and the consumer K loop are sm90/fp8_grouped.cuh's (shared with role4).
#if GC_OPERATOR
#include "sm90/role2_gemm.cuh"  // before the variant constants: its templates see only their policy's
#else
#include "sm90/standalone_gemm.cuh"  // likewise
#endif
#include "sm90/epilogue_w1.cuh"  // likewise
#include "sm90/fp8_grouped.cuh"

namespace gc_moe {
namespace sm90 {

#if GC_OPERATOR
// ============================================================================================ role2 (operator mode)
// role2_body's kernel policy for this variant (the grid, ring handshake and W2 scatter are sm90/role2_gemm.cuh's):
// the variant's constants and the FP8xFP8 hooks. W1 of a ring block: weights [E * 2I, H] against l1_acts with
// role1's FP32 1x128 token scales; W2: weights [E * H, I] against l2_acts with the W1 epilogue's FP32 1x128 scales.
struct Fp8Role2 {
    static constexpr int kBM = sm90::kBM, kMSub = sm90::kMSub, kAcc = sm90::kAcc, kRows = sm90::kRows,
                         kBK = sm90::kBK, kStages = sm90::kStages, kProducerWG = sm90::kProducerWG,
                         kConsumerWGs = sm90::kConsumerWGs, kConsumerThreads = sm90::kConsumerThreads,
                         kProducerRegs = sm90::kProducerRegs, kConsumerRegs = sm90::kConsumerRegs;
    static constexpr bool kUe8m0 = false, kFastMath = sm90::kFastMath, kRingRows = true;  // the W1 epilogue's
    static constexpr u32 kSmemBytes = sm90::kSmemBytes, kOffRed = sm90::kOffRed, kOffOut = sm90::kOffOut,
                         kOutPitch = sm90::kOutPitch;
    static constexpr u32 kConsumerBarrier = 1;  // the W1 epilogue's barrier is over all 256 consumer threads too
    using Pipeline = sm90::Pipeline;

    static __device__ __forceinline__ void op_issue(const OpArgs& a, const Pipeline& pipe, u32 it, const OpTask& ot,
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
    static __device__ __forceinline__ bool op_consume(const OpArgs& a, const Pipeline& pipe, const u8* smem, u32& it,
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

    static __device__ __forceinline__ void op_epilogue_w1(const OpArgs& a, float (&acc)[kMSub][kAcc], const Task& t,
                                                          int cw, int warp, int lane, float* red) {
        epilogue_w1<Fp8Role2>(acc, t, cw, warp, lane, red, a.at<const float>(a.off.l1_routing_weights),
                              a.at<u8>(a.off.l2_acts), a.at<float>(a.off.l2_acts_sf), a.p.inter, a.off.ring_rows,
                              a.p.clamp, a.p.alpha);
    }
};

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
    role2_body<Fp8Role2, GC_OP_SMEM_BYTES>(&tm_w1, &tm_w2, &tm_l1, &tm_l2, peers, off, params);
}

#else  // the standalone kernel

// standalone_body's kernel policy for this variant (the task walk, warpgroup roles and cluster pairs are
// sm90/standalone_gemm.cuh's): fp8_grouped.cuh's constants and consumer K loop, the FP8xFP8 stage issue.
struct Fp8Standalone : Fp8StandaloneBase {
    static constexpr bool kUe8m0 = false;  // the W1 epilogue's FP32 1x128 scales

    static __device__ __forceinline__ void sa_issue(const StandaloneArgs& a, const Pipeline& pipe, u32 it,
                                                    const Task& t, int kb, u64 policy_w, u64 policy_x, bool multicast,
                                                    u32 rank) {
        issue(pipe, it, t, kb, a.tm_w, a.tm_x, a.x_sf_t, a.n_w, a.rows_total, policy_w, policy_x, multicast, rank);
    }
};

}  // namespace sm90
}  // namespace gc_moe

using namespace gc_moe;
using namespace gc_moe::sm90;

// tm_w: [E * n_w, k] FP8 (box 128 x kRows; half of it per CTA in cluster pairs); tm_x: [rows_total, k] FP8 (box
// 128 x GC_BM); w_sf: FP32 [E, n_w/128, k/128]; x_sf_t: FP32 [k/128, rows_total]; blocks: int32 [*, 3] (cluster
// pairs: grouping's pair table); *num_blocks blocks are live.
// W1 (GC_EPI=1): n_w = 2I (interleaved), out = FP8 [rows_total, I], out_sf_t = FP32 [I/128, rows_total].
// W2 (GC_EPI=2): n_w = H, out = BF16 [rows_total, H], out_sf_t and routing_w unused. clamp = +inf for none.
extern "C" __global__ void __launch_bounds__(kThreads, 1)
    gc_sm90_fp8_grouped_gemm(const __grid_constant__ TensorMap tm_w, const __grid_constant__ TensorMap tm_x,
                             const float* __restrict__ w_sf, const float* __restrict__ x_sf_t,
                             const int* __restrict__ blocks, const int* __restrict__ num_blocks,
                             const float* __restrict__ routing_w, void* __restrict__ out, float* __restrict__ out_sf_t,
                             int n_w, int k, int rows_total, float clamp, float alpha, KernelStatus* status,
                             u64 timeout_ns) {
    standalone_body<Fp8Standalone>(StandaloneArgs{&tm_w, &tm_x, w_sf, x_sf_t, blocks, num_blocks, routing_w, out,
                                                  out_sf_t, n_w, k, rows_total, clamp, alpha, status, timeout_ns});
}

#endif  // GC_OPERATOR
