// The launch variant of the SM90 grouped-GEMM kernels (role2_gemm_fp8xfp8.cu, role2_gemm_fp8xfp4.cu, role4_shared.cu):
// the defaults of the variant defines and the constants every variant derives from them the same way. Defines:
// GC_BM (token block, WGMMA N), GC_M_SUB (64-row slabs per consumer warpgroup), GC_STAGES, GC_PRODUCER_WG (a
// pipelined producer warpgroup), GC_EPI (1: W1 epilogue, 2: W2), GC_FAST_MATH, GC_CLUSTER (standalone cluster pairs),
// GC_OPERATOR (sm90/grouped.cuh). The weight-format specific sizes stay in each kernel source.
#pragma once

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
#ifndef GC_CLUSTER
#define GC_CLUSTER 0
#endif

namespace gc_moe {
namespace sm90 {

constexpr int kBM = GC_BM;
constexpr int kMSub = GC_M_SUB;
constexpr int kStages = GC_STAGES;
constexpr int kProducerWG = GC_PRODUCER_WG;
constexpr int kEpi = GC_EPI;
constexpr bool kFastMath = GC_FAST_MATH != 0;  // the W1 epilogue's sigmoid (grouped.cuh: sigmoid<kFast>)
// Cluster pairs (standalone, pipelined): the two CTAs of a cluster run the same weight tile against an expert's two
// ring blocks and stream it once (PairTask in grouped.cuh; each producer loads half of the task's weights, multicast
// to both), so each stage is written by both producers and freed by both CTAs' consumers.
constexpr bool kCluster = GC_CLUSTER != 0 && !GC_OPERATOR;
constexpr int kConsumerWGs = 2;
[[maybe_unused]] constexpr int kConsumerThreads = kConsumerWGs * 128;  // the W1 epilogue's and role2's barriers
constexpr int kThreads = (kConsumerWGs + kProducerWG) * 128;
// Registers per thread after the pipelined variants' setmaxnreg. The CTA's pool is what the launch allocated (the
// most __launch_bounds__ allows in steps of 8, 168 at 384 threads, times the threads): setmaxnreg.inc retries until
// the pool has the registers, so the producer's count plus the consumers' must fit it (above it the consumers never
// start and the kernel hangs). The producer warpgroup drops to kProducerRegs, the consumers take the rest in steps of
// 8 (232).
constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = (kLaunchRegs * kThreads - 128 * kProducerRegs) / (128 * kConsumerWGs) / 8 * 8;
static_assert(kConsumerRegs <= 256 && 128 * (kProducerRegs + kConsumerWGs * kConsumerRegs) <= kLaunchRegs * kThreads,
              "setmaxnreg: the warpgroups' registers must fit the CTA's launch allocation");
constexpr int kBK = 128;
constexpr int kAcc = kBM / 2;  // accumulator registers per 64-row slab and thread (m64nBMk32)

// The shared-memory tail after a kernel's stages and amax scratch: in operator mode the W2 epilogue's BF16 tile
// [kBM tokens][rows] (rows padded by 16 bytes against bank conflicts) for 16-byte scatter stores, and kOpWords
// 32-bit words in whole 16-byte units (the pool block count, the producer's stop slot, then per stage the task whose
// first K step fills it: sm90/role2_gemm.cuh); then the stage barriers and slack to align the base to 1024.
constexpr u32 kOpWords = 2 + kStages;
constexpr u32 out_pitch(int rows) { return rows * 2 + 16; }
constexpr u32 out_bytes(int rows) { return GC_OPERATOR ? kBM * out_pitch(rows) + (4 * kOpWords + 15) / 16 * 16 : 0; }
constexpr u32 smem_bytes(u32 off_bar) { return off_bar + 2 * kStages * 8 + 1024; }

// Up to 64 in every variant; 96 in the FP8xFP8 operator mode (role2: compute_paths.max_block_m), whose K loop then
// runs wide steps (fp8_grouped.cuh: wide_step); the FP8xFP4 sources keep 64 (their register-A decode); 128 spills.
static_assert(kBM % 8 == 0 && kBM >= 8 && (kBM <= 64 || (kBM == 96 && GC_OPERATOR)),
              "GC_BM: WGMMA N must be a multiple of 8 up to 64 (or 96 in operator mode)");
static_assert(kEpi != 1 || kMSub == 2, "W1 epilogue: a task must cover the 256 rows of one 128-column requant group");
static_assert(kEpi == 1 || kEpi == 2, "GC_EPI: 1 (W1) or 2 (W2)");
static_assert(!kCluster || kProducerWG, "GC_CLUSTER: the pipelined variant only");

}  // namespace sm90
}  // namespace gc_moe
