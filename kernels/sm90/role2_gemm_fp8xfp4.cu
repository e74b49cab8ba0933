// SM90 FP8xFP4 grouped expert GEMM over ring blocks (paper §4.4, Hopper path): MXFP4 weights streamed packed by TMA,
// decoded to E4M3 in registers and fed to register-A WGMMA (m64nNk32.e4m3.e4m3), fused W1 (SwiGLU + UE8M0 1x128
// requant) or W2 (BF16) epilogue.
//
// Operand swap as in role2_gemm_fp8xfp8.cu: weight rows are the WGMMA M operand (each consumer warpgroup owns GC_M_SUB
// slabs of 64 rows), the block's tokens N (valid rows rounded up to 8). Weights come window-repacked and
// lane-permuted (gc_moe_compat/operator/sm90/fp4_layout.py): per (expert, K128 step, 64-row slab) one 4352-byte unit =
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
// zero, which is why a table and not an exponent add. So one K128 step is four MMAs into one accumulator per slab,
// promoted with the token's scale of that step (W1: the caller's FP32 1x128 scale; W2: the W1 epilogue's UE8M0
// 1x128 scale, stored as its FP32 value); the per-expert factor 2^base and the x64 headroom are applied once per
// task. (A UE8M0 scale per K32 group of the intermediate, as in DeepGEMM's SM100 recipe, would need one accumulator
// and one promotion per K32 MMA in W2: on an H200 that W2 ran at 30 % of the DRAM bandwidth, issue-bound on the
// promotions and the scale decode; bench/README.md, session 4.)
//
// GC_EPI=1: W1, L1 rows interleaved by 8 (thread-local SwiGLU as in the FP8 kernel); a task's 256 rows are the 128
// intermediate columns of one UE8M0 requant group (sm90/epilogue_w1.cuh, shared with the FP8 kernel). Payload E4M3
// [rows, I], scales as FP32 values [I/128, rows] (what the W2 producer bulk-copies per K128 step). GC_EPI=2: W2,
// BF16 partial rows.
//
// GC_OPERATOR=1 compiles role2 of the GC-MoE operator instead (entry gc_sm90_fp8_fp4_role2: the FP4 kernel policy
// at the end of this file instantiates the templates of sm90/role2_gemm.cuh, the grid body, ring handshake and W2
// scatter shared with the FP8xFP8 kernel). Both GEMMs run in one grid with 256-row tasks (GC_M_SUB=2 for W2 too);
// GC_EPI does not apply. GC_OPERATOR=0 (default) is the standalone kernel (entry gc_sm90_fp8_fp4_grouped_gemm: the
// policy Fp4Standalone instantiates the grid body template of sm90/standalone_gemm.cuh, shared with the FP8xFP8
// kernel and role4). Both modes run the same consumer K loop (consume). tests/operator/test_role2_operator_host.py
// keeps the standalone cubins' hashes (tests/data/sm90_fp4_standalone_cubins.json, rewritten by
// scripts/record_sm90_cubins.py when the kernel changes).
#include <cuda_fp8.h>

#include "sm90/grouped.cuh"
#if GC_OPERATOR
#include "sm90/role2_gemm.cuh"  // before the variant constants: its templates see only their policy's
#else
#include "sm90/standalone_gemm.cuh"  // likewise
#endif
#include "sm90/epilogue_w1.cuh"  // likewise

#include "sm90/gemm_variant.cuh"

namespace gc_moe {
namespace sm90 {

// Cluster pairs (kCluster, gemm_variant.cuh): each producer loads half of the task's slabs, and each CTA decodes the
// whole stage for its own block.
constexpr int kSlabs = kConsumerWGs * kMSub;  // 64-row slabs per task
constexpr int kRows = kSlabs * 64;
constexpr u32 kCodeBytes = 64 * kBK / 2;    // FP4 codes of one slab and K128 step
constexpr u32 kUnitBytes = kCodeBytes + 64 * kBK / 32;  // + one d byte per row and K32 group
constexpr int kUnitRows = kUnitBytes / 128;  // rows of the 128-byte tensor-map view per unit
constexpr u32 kWBytes = kSlabs * kUnitBytes;
constexpr u32 kXBytes = kBM * kBK;
constexpr u32 kSBytes = kBM * 4;  // one FP32 scale per token and K128 step (W2: a UE8M0 value)
constexpr u32 kStageTx = kWBytes + kXBytes + kSBytes;
constexpr u32 kOffW = kStages * kXBytes;  // token tiles first: 128-byte swizzle wants 1024-byte alignment
constexpr u32 kOffS = kOffW + kStages * kWBytes;
constexpr u32 kOffRed = kOffS + kStages * kSBytes;
constexpr u32 kOffOut = kOffRed + kConsumerWGs * 4 * kBM * 4;  // W1 amax per (consumer warp, column)
constexpr u32 kOutPitch = out_pitch(kRows);  // the operator-mode W2 tile (gemm_variant.cuh)
constexpr u32 kOffBar = kOffOut + out_bytes(kRows);
constexpr u32 kSmemBytes = smem_bytes(kOffBar);

static_assert(kUnitBytes % 128 == 0 && kSlabs * kUnitRows <= 256, "weight unit: whole 128-byte rows, TMA box <= 256");
static_assert(kSmemBytes <= 232448, "shared memory: too many stages for this tile");
static_assert(kBM <= 64, "GC_BM: the register-A decode runs at its register limit from BM = 64 (FP8xFP4 max_block_m)");
static_assert(kMSub == 1 || kMSub == 2, "consume_n: one or two slabs per warpgroup (two A register sets)");

using Pipeline = StagePipeline<kOffBar, kStages>;

// Issues the weight units (codes + d), token tile and token scales of K step kb into stage `it % kStages` (which
// is free). Weight units of expert e, step kb, slab j: view row ((e * kb_count + kb) * slabs_w + j) * kUnitRows. In a
// cluster pair, half the task's units per CTA (load_weights_pair, grouped.cuh).
__device__ __forceinline__ void issue(const Pipeline& pipe, u32 it, const Task& t, int kb, int kb_count, int slabs_w,
                                      const TensorMap* tm_w, const TensorMap* tm_x, const float* x_sf_t, int rows_total,
                                      u64 policy_w, u64 policy_x, bool multicast = false, u32 rank = 0) {
    const u32 stage = it % kStages;
    const u32 full = pipe.full(stage);
    mbar_arrive_expect_tx(full, kStageTx);
    const int unit = (t.expert * kb_count + kb) * slabs_w + t.tile * kSlabs;
    const u32 w_dst = pipe.base + kOffW + stage * kWBytes;
    if constexpr (kCluster) {
        load_weights_pair<kWBytes>(w_dst, tm_w, 0, unit * kUnitRows, kSlabs / 2 * kUnitRows, full, policy_w, multicast,
                                   rank);
    } else {
        tma_load_2d(w_dst, tm_w, 0, unit * kUnitRows, full, policy_w);
    }
    tma_load_2d(pipe.base + stage * kXBytes, tm_x, kb * kBK, t.row_off, full, policy_x);
    bulk_load(pipe.base + kOffS + stage * kSBytes, x_sf_t + static_cast<size_t>(kb) * rows_total + t.row_off, kSBytes,
              full);
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

// The A fragments of slab s of this warpgroup for the four K32 groups of a full stage: a[k][j] is A register j of
// K32 group k.
__device__ __forceinline__ void decode_slab(const u8* smem, u32 stage, int cw, int s, int warp, int lane,
                                            u32 (&a)[4][4]) {
    const u8* unit = smem + kOffW + stage * kWBytes + (cw * kMSub + s) * kUnitBytes;
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

// The four K32 MMAs of a stage for one slab with N columns, accumulated into `tmp` (the first one overwrites it).
// `desc_b`: the stage's token-tile descriptor; K32 slice k starts 32 bytes further, 2 in the descriptor's address
// field (in 16-byte units; the tile is 1024-byte aligned, so the field cannot carry), built once per stage because
// this loop is issue-bound.
template <int N>
__device__ __forceinline__ void mma_slab(float (&tmp)[N / 2], const u32 (&a)[4][4], u64 desc_b) {
#pragma unroll
    for (int k = 0; k < 4; ++k) WgmmaRegA<N>::mma(tmp, a[k], desc_b + 2 * k, k > 0);
}

// Promotes a stage's N columns into the main accumulator (columns from N on stay) with each token's FP32 scale of
// the stage's K128 step.
template <int N>
__device__ __forceinline__ void promote(float (&acc)[kMSub][kAcc], const float (&tmp)[kMSub][N / 2],
                                        const float (&xsr)[N / 4]) {
#pragma unroll
    for (int c = 0; c < N / 4; ++c) {
        const int i = 4 * (c / 2) + (c & 1);
#pragma unroll
        for (int s = 0; s < kMSub; ++s) {
            acc[s][i] = fmaf(tmp[s][i], xsr[c], acc[s][i]);
            acc[s][i + 2] = fmaf(tmp[s][i + 2], xsr[c], acc[s][i + 2]);
        }
    }
}

// The token scales of this thread's first N accumulator columns in a full stage.
template <int N>
__device__ __forceinline__ void token_scales(const u8* smem, u32 stage, int lane, float (&xsr)[N / 4]) {
    const float* xs = reinterpret_cast<const float*>(smem + kOffS + stage * kSBytes);
#pragma unroll
    for (int c = 0; c < N / 4; ++c) xsr[c] = xs[acc_col(4 * (c / 2) + (c & 1), lane)];
}

// The window factor 2^base of the task's expert and the decoder's x64 headroom, once per task.
__device__ __forceinline__ void apply_factor(float (&acc)[kMSub][kAcc], const float* factor, int expert) {
    const float f64 = __ldg(factor + expert) * 64.0f;
#pragma unroll
    for (int s = 0; s < kMSub; ++s)
#pragma unroll
        for (int i = 0; i < kAcc; ++i) acc[s][i] *= f64;
}

// Whether consume_n overlaps the decode with the WGMMAs (software pipeline) or decodes and issues in sequence. At
// BM = 8 a slab's MMAs (four m64n8k32) are too short to hide a decode, so the pipeline's second A set and extra
// wait_group per slab cost more than the overlap hides: on an H200 (bench/README.md, session 3) the
// pipelined FP8xFP4 kernels at BM = 8 were 8-11 % slower than the sequential loop before d988dbb, while at BM >= 16
// the pipeline made them 5-21 % faster.
constexpr bool kPipelinedConsume = kBM >= 16;

// The consumer K loop of one task with N token columns (with_wgmma_n picks N once per task: see grouped.cuh). Per
// K128 stage every slab's four K32 MMAs accumulate into a fresh (zeroed) accumulator, promoted after wait_group 0
// with the tokens' scales of that step (W1: the caller's FP32 1x128 scales; W2: the W1 epilogue's UE8M0 ones). The
// order of decodes and MMAs depends on kPipelinedConsume:
// - pipelined: a slab's MMAs are issued asynchronously from one of two A register sets while the next slab's A
//   fragments are decoded into the other set (after wait_group 1 has retired the slab before, which read that set;
//   the next slab may be the first of the next stage, waited for first);
// - sequential: the stage is waited for, every slab is decoded (first A set: slab 0, second: slab 1), then all its
//   MMAs go out as one commit group.
// Both issue the same MMAs on the same A fragments and promote in the same order: the same math. A stage is freed
// after its wait_group 0: every WGMMA reading its token tile has retired and its codes, d bytes and token scales
// have been read.
// `it` is the pipeline slot being waited for (the operator's wait_full reads it); on return it is the task's first
// slot + kb_count. Returns false when a wait gives up (no WGMMA is left in flight then).
template <int N, typename WaitFull, typename Load>
__device__ __forceinline__ bool consume_n(const Pipeline& pipe, const u8* smem, u32& it, int kb_count, int cw,
                                         int warp, int lane, int local_tid, float (&acc)[kMSub][kAcc],
                                         WaitFull& wait_full, Load& load) {
    // Pipelined with one slab: the slabs alternate between the A sets, so a loop iteration covers two stages.
    // Otherwise slab 0 always uses a0 (x) and slab 1 a1 (y).
    constexpr bool kSwapSets = kPipelinedConsume && kMSub == 1;
    constexpr int kIterStages = kSwapSets ? 2 : 1;
    const u32 first = it;
    u32 a0[4][4], a1[4][4];
    if constexpr (kPipelinedConsume) {
        if (!wait_full(pipe.full(it % kStages), (it / kStages) & 1)) return false;
        decode_slab(smem, it % kStages, cw, 0, warp, lane, a0);
    }
    // K step `step`. Pipelined: its slab 0's A fragments are in `x`, its slab 1's (two slabs) go to `y`, and the next
    // stage's slab 0's to y (one slab) or x (two slabs). Sequential: slab 0's go to x, slab 1's to y.
    const auto stage_step = [&](int step, u32 (&x)[4][4], u32 (&y)[4][4]) {
        if (step >= kb_count) return true;  // the second half of the last iteration (odd kb_count, swapped sets)
        const u32 slot = first + step, stage = slot % kStages;
        const u64 b_desc = smem_desc_sw128(pipe.base + stage * kXBytes);
        float tmp[kMSub][N / 2];
        zero(tmp);
        fence_operands(tmp);
        // The next stage's slab 0, decoded into `next` while this stage's last MMAs run.
        const auto decode_next = [&](u32 (&next)[4][4]) {
            if (step + 1 < kb_count) {
                it = slot + 1;
                if (!wait_full(pipe.full(it % kStages), (it / kStages) & 1)) {
                    wgmma_wait<0>();
                    return false;
                }
                decode_slab(smem, it % kStages, cw, 0, warp, lane, next);
            }
            return true;
        };
        if constexpr (!kPipelinedConsume) {
            it = slot;
            if (!wait_full(pipe.full(stage), (slot / kStages) & 1)) return false;
            decode_slab(smem, stage, cw, 0, warp, lane, x);
            if constexpr (kMSub == 2) decode_slab(smem, stage, cw, 1, warp, lane, y);
        }
        wgmma_fence();  // the A registers and the zeroed accumulators were written by this thread
        mma_slab<N>(tmp[0], x, b_desc);
        if constexpr (!kPipelinedConsume) {
            if constexpr (kMSub == 2) mma_slab<N>(tmp[1], y, b_desc);
            wgmma_commit();  // the stage's MMAs, one commit group
        } else if constexpr (kMSub == 1) {
            wgmma_commit();
            if (!decode_next(y)) return false;
        } else {
            wgmma_commit();
            decode_slab(smem, stage, cw, 1, warp, lane, y);
            wgmma_fence();
            mma_slab<N>(tmp[1], y, b_desc);
            wgmma_commit();
            wgmma_wait<1>();  // slab 0's MMAs have retired: x is free
            fence_operands(x);
            if (!decode_next(x)) return false;
        }
        wgmma_wait<0>();
        fence_operands(tmp);
        fence_operands(x);  // the A sets stay live until the waits above
        if constexpr (kPipelinedConsume || kMSub == 2) fence_operands(y);
        float xsr[N / 4];
        token_scales<N>(smem, stage, lane, xsr);
        __syncwarp();  // every WGMMA reading this stage has retired, its shared memory is read
        if (lane == 0) release_stage<kCluster>(pipe.empty(stage));
        if (!kProducerWG && local_tid == 0 && step + kStages < kb_count) {
            if (!load(slot + kStages, step + kStages)) return false;
        }
        __syncwarp();
        promote<N>(acc, tmp, xsr);
        return true;
    };
    for (int kb = 0; kb < kb_count; kb += kIterStages) {
#pragma unroll
        for (int j = 0; j < kIterStages; ++j) {
            if (!kSwapSets || j % 2 == 0) {
                if (!stage_step(kb + j, a0, a1)) return false;
            } else {
                if (!stage_step(kb + j, a1, a0)) return false;
            }
        }
    }
    it = first + kb_count;
    return true;
}

// The consumer warpgroups' K loop of one task into `acc` (zeroed here), then the window factor; the standalone
// kernel and role2 (operator mode: one grid runs both GEMMs) share it, for both GEMMs.
// `wait_full(bar, parity)` waits for a filled stage; `load(slot, kb)` issues K step kb into pipeline slot `slot`
// (non-pipelined variant only: consumer thread 0 loads its own task). Returns false when a wait gives up.
template <typename WaitFull, typename Load>
__device__ __forceinline__ bool consume(const Pipeline& pipe, const u8* smem, u32& it, const Task& t, int kb_count,
                                       const float* factor, int cw, int warp, int lane, int local_tid,
                                       float (&acc)[kMSub][kAcc], WaitFull&& wait_full, Load&& load) {
    if (!kProducerWG && local_tid == 0) {
        for (int kb = 0; kb < min(kStages, kb_count); ++kb) {
            if (!load(it + kb, kb)) return false;
        }
    }
    __syncwarp();
    zero(acc);
    bool ok = true;
    with_wgmma_n<kBM>(wgmma_n8<kBM>(t.valid), [&](auto n) {
        ok = consume_n<decltype(n)::value>(pipe, smem, it, kb_count, cw, warp, lane, local_tid, acc, wait_full, load);
    });
    if (!ok) return false;
    apply_factor(acc, factor, t.expert);
    return true;
}

#if GC_OPERATOR
// ============================================================================================ role2 (operator mode)
// role2_body's kernel policy for this variant (the grid, ring handshake and W2 scatter are sm90/role2_gemm.cuh's):
// the variant's constants and the FP8xFP4 hooks. Its tasks are 256 weight rows in both GEMMs (four slabs: one TMA
// box of 4 units per stage). W1 of a ring block: units of the [E, H/128, 2I/64] W1 slabs against l1_acts with
// role1's FP32 1x128 token scales; W2: units of [E, I/128, H/64] against l2_acts with the W1 epilogue's packed UE8M0
// words.
struct Fp4Role2 {
    static constexpr int kBM = sm90::kBM, kMSub = sm90::kMSub, kAcc = sm90::kAcc, kRows = sm90::kRows,
                         kBK = sm90::kBK, kStages = sm90::kStages, kProducerWG = sm90::kProducerWG,
                         kConsumerWGs = sm90::kConsumerWGs, kConsumerThreads = sm90::kConsumerThreads,
                         kProducerRegs = sm90::kProducerRegs, kConsumerRegs = sm90::kConsumerRegs;
    static constexpr bool kUe8m0 = true, kFastMath = sm90::kFastMath, kRingRows = true;  // the W1 epilogue's
    static constexpr u32 kSmemBytes = sm90::kSmemBytes, kOffRed = sm90::kOffRed, kOffOut = sm90::kOffOut,
                         kOutPitch = sm90::kOutPitch;
    static constexpr u32 kConsumerBarrier = 1;  // the W1 epilogue's barrier is over all 256 consumer threads too
    using Pipeline = sm90::Pipeline;

    static __device__ __forceinline__ void op_issue(const OpArgs& a, const Pipeline& pipe, u32 it, const OpTask& ot,
                                                    const Task& t, int kb, const OpMaps& maps) {
        const int hidden = static_cast<int>(a.p.hidden), inter = static_cast<int>(a.p.inter);
        if (ot.w1) {
            issue(pipe, it, t, kb, hidden / kBK, 2 * inter / 64, maps.w1, maps.l1,
                  a.at<const float>(a.off.l1_acts_sf), a.off.ring_rows, maps.policy_w, maps.policy_x);
        } else {
            issue(pipe, it, t, kb, inter / kBK, hidden / 64, maps.w2, maps.l2, a.at<const float>(a.off.l2_acts_sf),
                  a.off.ring_rows, maps.policy_w, maps.policy_x);
        }
    }

    // Role2Params.w1_sf / w2_sf carry the per-expert window factors 2^base (FP32 [E]) on this path.
    template <int Epi, typename WaitFull, typename Load>
    static __device__ __forceinline__ bool op_consume(const OpArgs& a, const Pipeline& pipe, const u8* smem, u32& it,
                                                      const Task& t, int cw, int warp, int lane, int local_tid,
                                                      float (&acc)[kMSub][kAcc], WaitFull&& wait_full, Load&& load) {
        const int k = static_cast<int>(Epi == 1 ? a.p.hidden : a.p.inter);
        const float* factor = reinterpret_cast<const float*>(Epi == 1 ? a.p.w1_sf : a.p.w2_sf);
        return consume(pipe, smem, it, t, k / kBK, factor, cw, warp, lane, local_tid, acc, wait_full, load);
    }

    static __device__ __forceinline__ void op_epilogue_w1(const OpArgs& a, float (&acc)[kMSub][kAcc], const Task& t,
                                                          int cw, int warp, int lane, float* red) {
        epilogue_w1<Fp4Role2>(acc, t, cw, warp, lane, red, a.at<const float>(a.off.l1_routing_weights),
                              a.at<u8>(a.off.l2_acts), a.at<float>(a.off.l2_acts_sf), static_cast<int>(a.p.inter),
                              static_cast<int>(a.off.ring_rows), a.p.clamp, a.p.alpha);
    }
};

}  // namespace sm90
}  // namespace gc_moe

using namespace gc_moe;
using namespace gc_moe::sm90;

// tm_w1 / tm_w2: the prepared W1 / W2 weight units as [E * (K/128) * (N/64) * 34, 128] bytes (box 128 x 136: one
// task's four units of a K step, no swizzle; gc_moe_compat/operator/sm90/role2_gemm.py builds them); tm_l1 / tm_l2: the
// workspace's l1_acts / l2_acts (box 128 x GC_BM, 128-byte swizzle); the rest: role2_gemm.cuh.
extern "C" __global__ void __launch_bounds__(kThreads, 1)
    gc_sm90_fp8_fp4_role2(const __grid_constant__ TensorMap tm_w1, const __grid_constant__ TensorMap tm_w2,
                          const __grid_constant__ TensorMap tm_l1, const __grid_constant__ TensorMap tm_l2,
                          const __grid_constant__ PeerTable peers, const __grid_constant__ WorkspaceOffsets off,
                          const __grid_constant__ Role2Params params) {
    role2_body<Fp4Role2, GC_OP_SMEM_BYTES>(&tm_w1, &tm_w2, &tm_l1, &tm_l2, peers, off, params);
}

#else  // the standalone kernel

// standalone_body's kernel policy for this variant (the task walk, warpgroup roles and cluster pairs are
// sm90/standalone_gemm.cuh's): the variant's constants and the FP8xFP4 hooks. StandaloneArgs.w_sf carries the
// per-expert window factors 2^base (FP32 [E]).
struct Fp4Standalone {
    static constexpr int kBM = sm90::kBM, kMSub = sm90::kMSub, kAcc = sm90::kAcc, kRows = sm90::kRows,
                         kBK = sm90::kBK, kStages = sm90::kStages, kProducerWG = sm90::kProducerWG, kEpi = sm90::kEpi,
                         kConsumerWGs = sm90::kConsumerWGs, kConsumerThreads = sm90::kConsumerThreads,
                         kProducerRegs = sm90::kProducerRegs, kConsumerRegs = sm90::kConsumerRegs;
    static constexpr bool kCluster = sm90::kCluster, kFastMath = sm90::kFastMath, kRingRows = false;
    static constexpr bool kUe8m0 = true;  // the W1 epilogue's UE8M0 1x128 scales
    static constexpr u32 kSmemBytes = sm90::kSmemBytes, kOffRed = sm90::kOffRed;
    using Pipeline = sm90::Pipeline;

    static __device__ __forceinline__ void sa_issue(const StandaloneArgs& a, const Pipeline& pipe, u32 it,
                                                    const Task& t, int kb, u64 policy_w, u64 policy_x, bool multicast,
                                                    u32 rank) {
        issue(pipe, it, t, kb, a.k / kBK, a.n_w / 64, a.tm_w, a.tm_x, a.x_sf_t, a.rows_total, policy_w, policy_x,
              multicast, rank);
    }

    template <typename WaitFull, typename Load>
    static __device__ __forceinline__ bool sa_consume(const StandaloneArgs& a, const Pipeline& pipe, const u8* smem,
                                                      u32& it, const Task& t, int cw, int warp, int lane,
                                                      int local_tid, float (&acc)[kMSub][kAcc], WaitFull&& wait_full,
                                                      Load&& load) {
        return consume(pipe, smem, it, t, a.k / kBK, a.w_sf, cw, warp, lane, local_tid, acc, wait_full, load);
    }
};

}  // namespace sm90
}  // namespace gc_moe

using namespace gc_moe;
using namespace gc_moe::sm90;

// tm_w: the prepared weight units as [E * (k/128) * (n_w/64) * 34, 128] bytes (box 128 x kSlabs * 34, half of it per
// CTA in cluster pairs; no swizzle);
// tm_x: [rows_total, k] E4M3 (box 128 x GC_BM, 128-byte swizzle); w_sf: the window factors, FP32 [E] (2^base of the
// window repack); x_sf_t: FP32 [k/128, rows_total] token scales (W2: the W1 epilogue's UE8M0 values); blocks: int32
// [*, 3] (cluster pairs: grouping's pair table); *num_blocks blocks are live.
// W1 (GC_EPI=1): n_w = 2I (interleaved), out = E4M3 [rows_total, I], out_sf_t = FP32 UE8M0 values [I/128, rows_total].
// W2 (GC_EPI=2): n_w = H, out = BF16 [rows_total, H]; out_sf_t and routing_w unused. clamp = +inf for none.
extern "C" __global__ void __launch_bounds__(kThreads, 1)
    gc_sm90_fp8_fp4_grouped_gemm(const __grid_constant__ TensorMap tm_w, const __grid_constant__ TensorMap tm_x,
                                 const float* __restrict__ w_sf, const float* __restrict__ x_sf_t,
                                 const int* __restrict__ blocks, const int* __restrict__ num_blocks,
                                 const float* __restrict__ routing_w, void* __restrict__ out,
                                 float* __restrict__ out_sf_t, int n_w, int k, int rows_total, float clamp, float alpha,
                                 KernelStatus* status, u64 timeout_ns) {
    standalone_body<Fp4Standalone>(StandaloneArgs{&tm_w, &tm_x, w_sf, x_sf_t, blocks, num_blocks, routing_w, out,
                                                  out_sf_t, n_w, k, rows_total, clamp, alpha, status, timeout_ns});
}

#endif  // GC_OPERATOR
