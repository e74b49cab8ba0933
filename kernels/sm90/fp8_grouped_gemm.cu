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
// GC_OPERATOR=1 compiles role2 of the GC-MoE operator instead (entry gc_sm90_fp8_role2, the section at the end of
// this file): one persistent grid running both GEMMs over the token ring of the operator workspace, reading the
// block table role1 publishes and handshaking with role1 and with itself through the ring signals. GC_OPERATOR=0
// (default) is the standalone kernel above, unchanged: its cubins are byte-identical to those before operator mode
// existed (tests/test_role2_operator_host.py keeps the hashes).
#include <cuda_fp8.h>

#include "sm90/grouped.cuh"

#ifndef GC_OPERATOR
#define GC_OPERATOR 0
#endif
#if GC_OPERATOR
#include "common/peer_table.cuh"
#include "sm90/role2_params.cuh"
// Ring rows are rewritten by role1 while role2 runs: never the non-coherent read-only path.
#define GC_RING_LOAD(p) __ldcg(p)
#else
#define GC_RING_LOAD(p) __ldg(p)
#endif

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
constexpr u32 kOffOut = kOffRed + kConsumerWGs * 4 * kBM * 4;  // after the amax of each consumer warp per column
// Operator mode: the W2 epilogue's BF16 tile [kBM tokens][kRows] (rows padded by 16 bytes against bank conflicts)
// for 16-byte scatter stores, and 16 bytes holding the pool block count and the producer's stop slot.
constexpr u32 kOutPitch = kRows * 2 + 16;
constexpr u32 kOutBytes = GC_OPERATOR ? kBM * kOutPitch + 16 : 0;
constexpr u32 kOffBar = kOffOut + kOutBytes;
constexpr u32 kSmemBytes = kOffBar + 2 * kStages * 8 + 1024;  // + slack to align the base to 1024
constexpr int kSiteSmem = 1, kSiteEmpty = 2, kSiteFull = 3;

static_assert(kBM % 8 == 0 && kBM >= 8 && kBM <= 64, "GC_BM: WGMMA N must be a multiple of 8 up to 64");
static_assert(kEpi != 1 || kMSub == 2, "W1 epilogue: a task must cover the 256 rows of one 128-column requant group");
static_assert(kEpi == 1 || kEpi == 2, "GC_EPI: 1 (W1) or 2 (W2)");
static_assert(!GC_OPERATOR || kMSub == 2, "operator mode: W1 and W2 tasks of 256 rows (ring.DEFAULT_GEOMETRY)");
static_assert(kSmemBytes <= 232448, "shared memory: too many stages for this tile");

using Pipeline = StagePipeline<kOffBar, kStages>;

// Issues the weight tile, token tile and token scales of K step kb into stage `it % kStages` (which is free).
__device__ __forceinline__ void issue(const Pipeline& pipe, u32 it, const Task& t, int kb, const TensorMap* tm_w,
                                      const TensorMap* tm_x, const float* x_sf_t, int n_w, int rows_total,
                                      u64 policy_w, u64 policy_x) {
    const u32 stage = it % kStages;
    const u32 full = pipe.full(stage);
    mbar_arrive_expect_tx(full, kStageTx);
    tma_load_2d(pipe.base + stage * kWBytes, tm_w, kb * kBK, t.expert * n_w + t.tile * kRows, full, policy_w);
    tma_load_2d(pipe.base + kOffX + stage * kXBytes, tm_x, kb * kBK, t.row_off, full, policy_x);
    bulk_load(pipe.base + kOffS + stage * kSBytes, x_sf_t + static_cast<size_t>(kb) * rows_total + t.row_off, kSBytes,
              full);
}

// Waits for stage `it % kStages` to be free and issues K step kb (the operator's op_produce adds its ring waits and
// abort rule to the same loads).
__device__ __forceinline__ bool produce(const Pipeline& pipe, u32 it, const Task& t, int kb, const TensorMap* tm_w,
                                        const TensorMap* tm_x, const float* x_sf_t, int n_w, int rows_total,
                                        u64 policy_w, u64 policy_x, KernelStatus* status, u64 timeout_ns) {
    const u32 stage = it % kStages, parity = ((it / kStages) & 1) ^ 1;
    if (!mbar_wait(pipe.empty(stage), parity, timeout_ns, status, kSiteEmpty)) return false;
    issue(pipe, it, t, kb, tm_w, tm_x, x_sf_t, n_w, rows_total, policy_w, policy_x);
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
    with_wgmma_n<kBM>(n8, [&](auto n) { mma_k128<decltype(n)::value>(tmp, a_base, b_base); });
}

// Scale rows of this thread's slabs for epilogue Epi: W1 tiles hold gate block `tile` and up block I/128 + tile;
// W2: the 128-row block of each slab.
template <int Epi>
__device__ __forceinline__ void scale_rows(const Task& t, int cw, int row_blocks, int kb_count, const float* w_sf,
                                           const float* (&ws_row)[2]) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
        const int block = Epi == 1 ? t.tile + s * (row_blocks / 2)
                                   : (t.tile * kRows + (cw * kMSub + min(s, kMSub - 1)) * 64) / 128;
        ws_row[s] = w_sf + (static_cast<size_t>(t.expert) * row_blocks + block) * kb_count;
    }
}

// Promotes one K128 step into the main accumulator with w_scale * x_scale.
template <int Epi>
__device__ __forceinline__ void promote(float (&acc)[kMSub][kAcc], const float (&tmp)[kMSub][kAcc], float ws0,
                                        float ws1, const float (&xsr)[kAcc / 2]) {
#pragma unroll
    for (int s = 0; s < kMSub; ++s) {
#pragma unroll
        for (int i = 0; i < kAcc; ++i) {
            // W1: registers i%4 in {0,1} are gate rows (scale ws0), {2,3} up rows (ws1); W2: slab s's block.
            const float ws = Epi == 1 ? ((i & 2) ? ws1 : ws0) : (s == 0 ? ws0 : ws1);
            acc[s][i] = fmaf(tmp[s][i], ws * xsr[2 * (i / 4) + (i & 1)], acc[s][i]);
        }
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
        const float rw = col < t.valid ? GC_RING_LOAD(routing_w + t.row_off + col) : 0.0f;
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

#if GC_OPERATOR
// ============================================================================================ role2 (operator mode)
// Role2 of the GC-MoE operator (paper §4.3-4.5): one persistent grid of C CTAs (one per compute-partition SM, all
// co-resident) runs both GEMMs over the token ring of the operator workspace. Every task is 256 weight rows (two
// consumer warpgroups x 2 slabs, W1 and W2 alike: ring.DEFAULT_GEOMETRY) against one pool block.
//
// Block table. Thread 0 acquires pool_header = (1 << 32) | n (role1, gpu scope) and reads pool_table rows (local
// expert, valid rows, ring row offset) with L2 loads (role1 rewrote them this replay). Pool block p lives in ring
// block b = p mod R as generation g = p div R (ring.RingPlan.slot).
//
// Task sequence (ring.py's live-block model, role2_task below; gc_moe_compat/sm90/role2.task_sequence mirrors it):
// the W1 tasks of pool blocks 0..min(w, n)-1 (tile-major), then for j = 0..n-1 the t2 W2 tasks of block j followed
// by the t1 W1 tasks of block j + w (while j + w < n). CTA c runs tasks c, c + C, c + 2C, ... in order; its
// producer runs ahead in the same order. A task waits only on strictly earlier tasks: W2 of j on W1 of j; W1 of p on
// role1's pull of p, which (for g >= 1) waits on W1 and W2 of p - R, and W2 of p - R precedes W1 of p iff R >= w
// (W2 of j sits in segment j, W1 of j + w in the same segment after it). Hence, with every CTA resident, the
// smallest unfinished task always has its dependencies done and its CTA at it (both warpgroup roles of a CTA walk
// tasks in sequence order, the producer never behind the consumers): no deadlock for R >= min(n, w)
// (ring.RingModel.deadlock_free_blocks; the host checks the larger live-block need).
//
// Signals (producer thread, before issuing the TMA loads; acquire at gpu scope, then fence.proxy.async.global:
// role1 / the W1 epilogue wrote the rows with generic stores, the TMA reads them through the async proxy):
//   W1 of p: l1_full_count[b] >= BM * (g + 1) before its first K step.
//   W2 of p, K step j: bits 2j, 2j+1 of l2_full_mask[b] (the two N128 tiles of W1 task j, which produced
//     intermediate columns [128j, 128j + 128)) equal (g + 1) & 1; a fresh acquire at the task's first step.
// Releases (consumer thread 0 after a named barrier of all 256 consumer threads; __threadfence + release):
//   W1 epilogue: every thread's l2_acts / l2_acts_sf stores, fence.proxy.async.global, barrier, then
//     atom.xor.release.gpu l2_full_mask[b] ^= 3 << 2*tile and red.release.gpu l1_empty_count[b] += 1 (the task's
//     l1_acts / scales / routing-weight reads are done: the loads completed and the epilogue read the weights).
//   W2 epilogue: BF16 tile staged in shared memory, 16-byte stores of each valid row straight into the source rank's
//     combine[slot, src_token, tile*256 : +256] (l1_source = (src_rank, src_token, slot, pool block), checked
//     against p), barrier, then red.release.gpu l2_empty_count[b] += 1 (l1_source and l2_acts reads are done).
// Padding rows (beyond the block's valid count) are computed by the WGMMA (N rounds up to 8) and never stored.
//
// Remote writes and role3. Each consumer thread ends with fence.sc.sys (__threadfence_system) after its last
// scatter store, so its combine stores are performed at system scope before the kernel completes; the graph orders
// role3 after role2, and role3's bookkeeping executes fence.sc.sys and st.release.sys combine_ready[rank] = n + 1
// on every peer; a peer's combine CTAs ld.acquire.sys it before loading combine (finalize.cu's ordering chain).
//
// Errors: every producer wait is bounded (Role2Params.timeout_ns) and gives up at once when role1's or role2's
// status record holds an error (role1 failing ends role2 within one poll; a failed role2 wait ends the other CTAs
// likewise); the consumers then leave together at the first pipeline slot their producer did not issue
// (op_wait_full), so no warpgroup-collective instruction or named barrier is ever left half-joined.
// The consumer warpgroups' K loop of one task for epilogue Epi, accumulating into `acc` (zeroed here): the standalone
// kernel's loop, made a template because one operator grid runs both GEMMs (the standalone kernel keeps its inline
// copy of the loop, sharing its pieces: calling consume<kEpi> from it changes its machine code, all 18 recorded
// cubins, and those must stay byte-identical).
// `wait_full(bar, parity)` waits for a filled stage; `load(slot, kb)` issues K step kb into pipeline slot `slot`
// (non-pipelined variant only: consumer thread 0 loads its own task). Returns false when the wait gives up.
template <int Epi, typename WaitFull, typename Load>
__device__ __forceinline__ bool consume(const Pipeline& pipe, const u8* smem, u32& it, const Task& t, int kb_count,
                                       int row_blocks, const float* w_sf, int cw, int lane, int local_tid,
                                       float (&acc)[kMSub][kAcc], WaitFull&& wait_full, Load&& load) {
    const int n8 = (min(t.valid, kBM) + 7) / 8;
    if (!kProducerWG && local_tid == 0) {
        for (int kb = 0; kb < min(kStages, kb_count); ++kb) {
            if (!load(it + kb, kb)) return false;
        }
    }
    __syncwarp();
    zero(acc);
    const float* ws_row[2];
    scale_rows<Epi>(t, cw, row_blocks, kb_count, w_sf, ws_row);
    for (int kb = 0; kb < kb_count; ++kb, ++it) {
        const float ws0 = __ldg(ws_row[0] + kb), ws1 = __ldg(ws_row[1] + kb);
        const u32 stage = it % kStages;
        if (!wait_full(pipe.full(stage), (it / kStages) & 1)) return false;
        const float* xs = reinterpret_cast<const float*>(smem + kOffS + stage * kSBytes);
        float xsr[kAcc / 2];
#pragma unroll
        for (int c = 0; c < kAcc / 2; ++c) xsr[c] = xs[acc_col(4 * (c / 2) + (c & 1), lane)];
        float tmp[kMSub][kAcc];
        fence_operands(tmp);
        wgmma_fence();
        mma_k128_n(n8, tmp, pipe.base + stage * kWBytes + cw * kMSub * 64 * kBK, pipe.base + kOffX + stage * kXBytes);
        wgmma_commit();
        wgmma_wait_all();
        fence_operands(tmp);
        __syncwarp();
        if (lane == 0) mbar_arrive(pipe.empty(stage));
        if (!kProducerWG && local_tid == 0 && kb + kStages < kb_count) {
            if (!load(it + kStages, kb + kStages)) return false;
        }
        __syncwarp();
        promote<Epi>(acc, tmp, ws0, ws1, xsr);
    }
    return true;
}

constexpr u32 kRole1Record = 0, kRole2Record = 1;
// The host's shared-memory formula (gc_moe_compat/sm90/role2.py: operator_smem_bytes) arrives as a define in every
// build, so a drift between the two fails to compile instead of failing the launch-time check.
static_assert(kSmemBytes == GC_OP_SMEM_BYTES, "GC_OP_SMEM_BYTES: role2.operator_smem_bytes differs from kSmemBytes");

__device__ __forceinline__ u32 ld_acquire_gpu_u32(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void red_release_gpu_add_u32(u32* p, u32 v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void red_release_gpu_xor_u64(u64* p, u64 v) {
    asm volatile("red.release.gpu.global.xor.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

__device__ __forceinline__ uint4 ld_shared_v4(u32 addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}

__device__ __forceinline__ void st_global_v4(void* p, uint4 v) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

// Everything role2 reads from its by-value arguments, resolved once per thread.
struct OpArgs {
    const PeerTable& peers;
    const WorkspaceOffsets& off;
    const Role2Params& p;

    template <typename T>
    __device__ __forceinline__ T* at(u64 offset) const {
        return reinterpret_cast<T*>(peers.base + offset);
    }
    __device__ __forceinline__ KernelStatus* status() const { return at<KernelStatus>(off.status) + kRole2Record; }
    __device__ __forceinline__ bool aborted() const {
        const KernelStatus* records = at<KernelStatus>(off.status);
        return *reinterpret_cast<const volatile u32*>(&records[kRole1Record].code) != kStatusOk ||
               *reinterpret_cast<const volatile u32*>(&records[kRole2Record].code) != kStatusOk;
    }
};

// Bounded spin until ready(value of load()) holds. Gives up (false) at once if role1 or role2 recorded an error,
// and on timeout records `site` with the last value seen and `expected`.
template <typename Load, typename Ready>
__device__ __forceinline__ bool op_wait(const OpArgs& a, Load&& load, Ready&& ready, u64 expected, u32 site,
                                        u64& seen) {
    seen = load();
    if (ready(seen)) return true;
    const u64 start = globaltimer_ns();
    while (true) {
        if (a.aborted()) return false;
        if (globaltimer_ns() - start > a.p.timeout_ns) {
            report_status(a.status(), kStatusTimeout, site, seen, expected);
            return false;
        }
        __nanosleep(GC_MOE_SPIN_SLEEP_NS);
        seen = load();
        if (ready(seen)) return true;
    }
}

// The producer's wait for a free stage, with the operator's abort rule (consumers only stop after an error).
__device__ __forceinline__ bool op_wait_empty(const OpArgs& a, u32 bar, u32 parity) {
    if (mbar_try_wait(bar, parity)) return true;
    const u64 start = globaltimer_ns();
    while (!mbar_try_wait(bar, parity)) {
        if (a.aborted()) return false;
        if (globaltimer_ns() - start > a.p.timeout_ns) {
            report_status(a.status(), kStatusTimeout, kSiteEmpty, parity, bar);
            return false;
        }
    }
    return true;
}

// The consumers' wait for pipeline slot `slot` to fill. A producer that gives up stores the first slot it did not
// issue into `stop` (shared memory, initially ~0): every slot below it was issued and fills, none from it on ever
// does, so all 256 consumer threads leave at the same slot, before any warpgroup-collective instruction or named
// barrier of it. The 2x timeout is a backstop only (the producer's ring wait reports the site first).
__device__ __forceinline__ bool op_wait_full(const OpArgs& a, u32 bar, u32 parity, u32 slot, const volatile u32* stop) {
    if (mbar_try_wait(bar, parity)) return true;
    const u64 start = globaltimer_ns();
    while (!mbar_try_wait(bar, parity)) {
        if (*stop <= slot) return false;
        if (globaltimer_ns() - start > 2 * a.p.timeout_ns) {
            report_status(a.status(), kStatusTimeout, kSiteFull, parity, bar);
            return false;
        }
    }
    return true;
}

// One task of the sequence: a W1 or W2 tile of pool block `block`.
struct OpTask {
    bool w1;
    int block, tile;
};

// Task `s` of the role2 sequence for n pool blocks, look-ahead w, t1 W1 / t2 W2 tasks per block (header comment).
__device__ __forceinline__ OpTask role2_task(int s, int n, int w, int t1, int t2) {
    const int a = min(w, n);
    if (s < a * t1) return OpTask{true, s % a, s / a};
    s -= a * t1;
    const int paired = max(n - w, 0), seg = t1 + t2;
    if (s < paired * seg) {
        const int j = s / seg, r = s % seg;
        return r < t2 ? OpTask{false, j, r} : OpTask{true, j + w, r - t2};
    }
    s -= paired * seg;
    return OpTask{false, paired + s / t2, s % t2};
}

// The GEMM task of `ot` from the block table (ring rows: rewritten by role1 this replay, L2 loads).
__device__ __forceinline__ Task ring_task(const int* table, const OpTask& ot) {
    const int* row = table + 3 * ot.block;
    return Task{__ldcg(row), __ldcg(row + 1), __ldcg(row + 2), ot.tile};
}

// Producer side of K step kb of task `ot`: the ring wait it needs, then the stage wait and the loads.
// `mask_seen` caches the last acquired l2_full_mask of the current W2 task.
__device__ __forceinline__ bool op_produce(const OpArgs& a, const Pipeline& pipe, u32 it, const OpTask& ot,
                                           const Task& t, int kb, const TensorMap* tm_w1, const TensorMap* tm_w2,
                                           const TensorMap* tm_l1, const TensorMap* tm_l2, u64 policy_w, u64 policy_x,
                                           u64& mask_seen) {
    const u32 ring = a.p.ring_blocks, b = static_cast<u32>(ot.block) % ring, g = static_cast<u32>(ot.block) / ring;
    if (ot.w1 && kb == 0) {
        const u32* full = a.at<u32>(a.off.l1_full_count) + b;
        const u64 target = static_cast<u64>(a.p.block_m) * (g + 1);
        u64 seen;
        if (!op_wait(a, [&] { return static_cast<u64>(ld_acquire_gpu_u32(full)); },
                     [&](u64 v) { return v >= target; }, target, kSiteL1Full, seen))
            return false;
        fence_proxy_async_global();
    } else if (!ot.w1) {
        const u64 need = 3ull << (2 * kb), want = ((g + 1) & 1) ? need : 0;
        if (kb == 0 || (mask_seen & need) != want) {
            const u64* mask = a.at<u64>(a.off.l2_full_mask) + b;
            if (!op_wait(a, [&] { return ld_acquire_gpu(mask); }, [&](u64 v) { return (v & need) == want; },
                         want, kSiteL2Mask, mask_seen))
                return false;
            fence_proxy_async_global();
        }
    }
    const u32 stage = it % kStages, parity = ((it / kStages) & 1) ^ 1;
    if (!op_wait_empty(a, pipe.empty(stage), parity)) return false;
    if (ot.w1) {
        issue(pipe, it, t, kb, tm_w1, tm_l1, a.at<float>(a.off.l1_acts_sf), 2 * a.p.inter, a.off.ring_rows, policy_w,
              policy_x);
    } else {
        issue(pipe, it, t, kb, tm_w2, tm_l2, a.at<float>(a.off.l2_acts_sf), a.p.hidden, a.off.ring_rows, policy_w,
              policy_x);
    }
    return true;
}

// W2 epilogue in operator mode: the BF16 tile [kRows x valid] of this task, staged transposed in shared memory,
// then 16-byte stores of each valid token row into its source rank's combine buffer at (slot, src_token).
// A row whose l1_source names another pool block is reported (kSiteSource) and not stored; the kernel goes on (the
// record then stops the producers, and the consumers leave at the first slot not issued).
__device__ __forceinline__ void op_epilogue_w2(const OpArgs& a, const float (&acc)[kMSub][kAcc], const Task& t,
                                               int pool_block, int cw, int warp, int lane, int local_tid, u8* out_tile) {
#pragma unroll
    for (int s = 0; s < kMSub; ++s) {
#pragma unroll
        for (int i = 0; i < kAcc; ++i) {
            const int col = acc_col(i, lane);
            const int h = (cw * kMSub + s) * 64 + warp * 16 + lane / 4 + 8 * ((i >> 1) & 1);
            *reinterpret_cast<__nv_bfloat16*>(out_tile + col * kOutPitch + h * 2) = __float2bfloat16_rn(acc[s][i]);
        }
    }
    named_barrier(1, kConsumerThreads);
    constexpr int kChunks = kRows / 8;  // 16-byte chunks per token row
    const int4* source = a.at<const int4>(a.off.l1_source);
    for (int u = local_tid; u < t.valid * kChunks; u += kConsumerThreads) {
        const int col = u / kChunks, c = u % kChunks;
        const int4 src = __ldcg(source + t.row_off + col);  // (src_rank, src_token, slot, pool block)
        if (src.w != pool_block) {
            report_status(a.status(), kStatusMismatch, kSiteSource, static_cast<u64>(src.w), pool_block);
            continue;
        }
        const uint4 v = ld_shared_v4(smem_addr(out_tile + col * kOutPitch + c * 16));
        const size_t elem = (static_cast<size_t>(src.z) * a.off.capacity + src.y) * a.p.hidden + t.tile * kRows + c * 8;
        st_global_v4(peer_ptr<__nv_bfloat16>(a.peers, src.x, a.off.combine) + elem, v);
    }
}

}  // namespace sm90
}  // namespace gc_moe

using namespace gc_moe;
using namespace gc_moe::sm90;

// tm_w1: W1 weights [E * 2I, H] E4M3 (rows interleaved gate/up by 8, box 128 x 256); tm_w2: W2 [E * H, I] (box
// 128 x 256); tm_l1 / tm_l2: the workspace's l1_acts [ring rows, H] / l2_acts [ring rows, I] (box 128 x GC_BM).
// Everything else comes from the workspace (peers.base + off.*) and Role2Params.
extern "C" __global__ void __launch_bounds__(kThreads, 1)
    gc_sm90_fp8_role2(const __grid_constant__ TensorMap tm_w1, const __grid_constant__ TensorMap tm_w2,
                      const __grid_constant__ TensorMap tm_l1, const __grid_constant__ TensorMap tm_l2,
                      const __grid_constant__ PeerTable peers, const __grid_constant__ WorkspaceOffsets off,
                      const __grid_constant__ Role2Params params) {
    if (params.flags & kRole2Warmup) return;
    const OpArgs a{peers, off, params};
    extern __shared__ u8 smem_raw[];
    u8* smem = align_smem_1024(smem_raw);
    const Pipeline pipe{smem_addr(smem)};
    u8* out_tile = smem + kOffOut;
    volatile u32* words = reinterpret_cast<volatile u32*>(out_tile + kBM * kOutPitch);  // [0] pool blocks, [1] stop
    const int tid = threadIdx.x;
    if (!has_dyn_smem(kSmemBytes, tid, a.status(), kSiteSmem)) return;
    if (tid == 0) {
        pipe.init(kConsumerWGs * 4);
        prefetch_tensormap(&tm_w1);
        prefetch_tensormap(&tm_w2);
        prefetch_tensormap(&tm_l1);
        prefetch_tensormap(&tm_l2);
        const u64* header = a.at<const u64>(off.pool_header);
        u64 seen;
        u32 n = 0;
        if (op_wait(a, [&] { return ld_acquire_gpu(header); }, [](u64 v) { return v >= (1ull << 32); }, 1ull << 32,
                    kSitePoolHeader, seen)) {
            n = static_cast<u32>(seen);
            if (n > off.pool_blocks) {
                report_status(a.status(), kStatusMismatch, kSitePoolSize, n, off.pool_blocks);
                n = 0;
            }
        }
        words[0] = n;
        words[1] = ~0u;
    }
    __syncthreads();

    const int n = static_cast<int>(words[0]);
    const int t1 = static_cast<int>(params.w1_tasks), t2 = static_cast<int>(params.w2_tasks);
    const int w = static_cast<int>(params.lookahead);
    const int num_tasks = n * (t1 + t2);
    const int* table = a.at<const int>(off.pool_table);
    const u64 policy_w = evict_first_policy();
    const u64 policy_x = evict_last_policy();
    const int wg = tid / 128;

    if (kProducerWG && wg == 0) {
        setmaxnreg_dec<40>();
        if (tid == 0) {
            u32 it = 0;
            u64 mask_seen = 0;
            for (int s = blockIdx.x; s < num_tasks; s += gridDim.x) {
                const OpTask ot = role2_task(s, n, w, t1, t2);
                const Task t = ring_task(table, ot);
                const int kb_count = static_cast<int>(ot.w1 ? params.hidden : params.inter) / kBK;
                for (int kb = 0; kb < kb_count; ++kb, ++it) {
                    if (!op_produce(a, pipe, it, ot, t, kb, &tm_w1, &tm_w2, &tm_l1, &tm_l2, policy_w, policy_x,
                                    mask_seen)) {
                        words[1] = it;
                        return;
                    }
                }
            }
        }
        return;
    }
    if (kProducerWG) setmaxnreg_inc<232>();

    const int cw = wg - kProducerWG, warp = (tid / 32) & 3, lane = tid & 31;
    const int local_tid = tid - kProducerWG * 128;
    float* red = reinterpret_cast<float*>(smem + kOffRed);
    const float* w_sf[2] = {reinterpret_cast<const float*>(params.w1_sf), reinterpret_cast<const float*>(params.w2_sf)};
    u32* l1_empty = a.at<u32>(off.l1_empty_count);
    u32* l2_empty = a.at<u32>(off.l2_empty_count);
    u64* l2_mask = a.at<u64>(off.l2_full_mask);
    u32 it = 0;
    u64 mask_seen = 0;  // non-pipelined variant: consumer thread 0 is the producer
    for (int s = blockIdx.x; s < num_tasks; s += gridDim.x) {
        const OpTask ot = role2_task(s, n, w, t1, t2);
        const Task t = ring_task(table, ot);
        const u32 b = static_cast<u32>(ot.block) % params.ring_blocks;
        const auto wait_full = [&](u32 bar, u32 parity) { return op_wait_full(a, bar, parity, it, words + 1); };
        const auto load = [&](u32 slot, int kb) {
            if (words[1] == ~0u && !op_produce(a, pipe, slot, ot, t, kb, &tm_w1, &tm_w2, &tm_l1, &tm_l2, policy_w,
                                               policy_x, mask_seen))
                words[1] = slot;
            return true;  // the consumers leave together at the stop slot (op_wait_full)
        };
        float acc[kMSub][kAcc];
        if (ot.w1) {
            const int kb_count = static_cast<int>(params.hidden) / kBK;
            if (!consume<1>(pipe, smem, it, t, kb_count, 2 * params.inter / 128, w_sf[0], cw, lane, local_tid, acc,
                            wait_full, load))
                return;
            epilogue_w1(acc, t, cw, warp, lane, red, a.at<const float>(off.l1_routing_weights), a.at<u8>(off.l2_acts),
                        a.at<float>(off.l2_acts_sf), params.inter, off.ring_rows, params.clamp, params.alpha);
            fence_proxy_async_global();  // l2_acts / l2_acts_sf are read by W2 producers' TMA (async proxy)
            named_barrier(1, kConsumerThreads);
            if (local_tid == 0) {
                __threadfence();
                red_release_gpu_xor_u64(l2_mask + b, 3ull << (2 * t.tile));
                red_release_gpu_add_u32(l1_empty + b, 1);
            }
        } else {
            const int kb_count = static_cast<int>(params.inter) / kBK;
            if (!consume<2>(pipe, smem, it, t, kb_count, params.hidden / 128, w_sf[1], cw, lane, local_tid, acc,
                            wait_full, load))
                return;
            op_epilogue_w2(a, acc, t, ot.block, cw, warp, lane, local_tid, out_tile);
            named_barrier(1, kConsumerThreads);  // l1_source reads done; out_tile is rewritten by the next W2 task
            if (local_tid == 0) {
                __threadfence();
                red_release_gpu_add_u32(l2_empty + b, 1);
            }
        }
    }
    __threadfence_system();  // this thread's combine stores (local and peers') performed at system scope
}

#else  // the standalone kernel

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
    const int num_tasks = nb * (n_w / kRows);
    const u64 policy_w = evict_first_policy();
    const u64 policy_x = evict_last_policy();  // token tiles are re-read by every weight tile of their block
    const int wg = tid / 128;

    if (kProducerWG && wg == 0) {
        produce_tasks(tid, blocks, nb, num_tasks, kb_count, [&](u32 it, const Task& t, int kb) {
            return produce(pipe, it, t, kb, &tm_w, &tm_x, x_sf_t, n_w, rows_total, policy_w, policy_x, status,
                           timeout_ns);
        });
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
        zero(acc);
        const float* ws_row[2];
        scale_rows<kEpi>(t, cw, row_blocks, kb_count, w_sf, ws_row);
        for (int kb = 0; kb < kb_count; ++kb, ++it) {
            const float ws0 = __ldg(ws_row[0] + kb), ws1 = __ldg(ws_row[1] + kb);
            const u32 stage = it % kStages;
            if (!mbar_wait(pipe.full(stage), (it / kStages) & 1, timeout_ns, status, kSiteFull)) return;
            const float* xs = reinterpret_cast<const float*>(smem + kOffS + stage * kSBytes);
            float xsr[kAcc / 2];
#pragma unroll
            for (int c = 0; c < kAcc / 2; ++c) xsr[c] = xs[acc_col(4 * (c / 2) + (c & 1), lane)];
            float tmp[kMSub][kAcc];
            fence_operands(tmp);
            wgmma_fence();
            mma_k128_n(n8, tmp, pipe.base + stage * kWBytes + cw * kMSub * 64 * kBK, pipe.base + kOffX + stage * kXBytes);
            wgmma_commit();
            wgmma_wait_all();
            fence_operands(tmp);
            __syncwarp();
            if (lane == 0) mbar_arrive(pipe.empty(stage));
            if (!kProducerWG && local_tid == 0 && kb + kStages < kb_count) {
                if (!produce(pipe, it + kStages, t, kb + kStages, &tm_w, &tm_x, x_sf_t, n_w, rows_total, policy_w,
                             policy_x, status, timeout_ns))
                    return;
            }
            __syncwarp();
            promote<kEpi>(acc, tmp, ws0, ws1, xsr);
        }
        if constexpr (kEpi == 1) {
            epilogue_w1(acc, t, cw, warp, lane, red, routing_w, static_cast<u8*>(out), out_sf_t, n_w / 2, rows_total,
                        clamp, alpha);
        } else {
            epilogue_w2<kRows>(acc, t, cw, warp, lane, static_cast<__nv_bfloat16*>(out), n_w);
        }
    }
}

#endif  // GC_OPERATOR
