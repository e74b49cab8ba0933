// Role2 of the GC-MoE operator (paper §4.3-4.5): the body of the persistent grid both SM90 grouped GEMMs compile to
// with GC_OPERATOR=1 (role2_gemm_fp8xfp8.cu: gc_sm90_fp8_role2; role2_gemm_fp8xfp4.cu: gc_sm90_fp8_fp4_role2).
//
// Templates: each weight format's source instantiates them from its entry, role2_body<K, kHostSmemBytes>, with K its
// kernel policy, a struct of
//   constants  kBM, kMSub, kAcc, kRows, kBK, kStages, kProducerWG, kConsumerThreads, kProducerRegs, kConsumerRegs
//              (the pipelined variant's setmaxnreg counts), kSmemBytes, kOffRed, kOffOut,
//              kOutPitch (the W2 epilogue's staged tile [kBM][kOutPitch bytes] at kOffOut, 16 more bytes after it)
//              and kConsumerBarrier (a named-barrier id over the kConsumerThreads consumer threads that its own
//              epilogues never use with another thread count);
//   Pipeline   its StagePipeline;
//   hooks      static member functions:
//   op_issue(a, pipe, it, ot, t, kb, maps)                    issues K step kb of task t into slot `it` (free);
//   op_consume<Epi>(a, pipe, smem, it, t, cw, warp, lane, local_tid, acc, wait_full, load)
//                                                             the consumer K loop of a W1 (Epi 1) / W2 (2) task
//                                                             into acc[kMSub][kAcc], final weight scaling included;
//   op_epilogue_w1(a, acc, t, cw, warp, lane, red)           the W1 epilogue into l2_acts / l2_acts_sf;
// and kHostSmemBytes the host's shared-memory formula (role2_body). What is specific to a weight format stays in its
// source; the task sequence, the ring handshake (its pieces: sm90/role2_ring.cuh), the W2 scatter and the error rule
// are written once, here.
//
// One persistent grid of C CTAs (one per compute-partition SM, all co-resident) runs both GEMMs over the token ring
// of the operator workspace. Every task is 256 weight rows (two consumer warpgroups x 2 slabs, W1 and W2 alike:
// ring.DEFAULT_GEOMETRY) against one pool block.
// Role2 may run beside role1 in both modes: a concurrent root when partitioned, and behind a programmatic edge that
// role1 opens at its start when the roles run in sequence on a GPU the rank has alone (operator/sm90/layer.py), so
// every read of role1's output waits on the signals below, never on the kernel boundary.
//
// Block table. Thread 0 acquires pool_header = (1 << 32) | n (role1, gpu scope) and reads pool_table rows (local
// expert, valid rows, ring row offset) with L2 loads (role1 rewrote them this replay). Pool block p lives in ring
// block b = p mod R as generation g = p div R (ring.RingPlan.slot).
//
// Task sequence (ring.py's live-block model, role2_task; operator/sm90/role2_gemm.task_sequence mirrors it):
// the W1 tasks of pool blocks 0..min(w, n)-1 (tile-major), then for j = 0..n-1 the t2 W2 tasks of block j followed
// by the t1 W1 tasks of block j + w (while j + w < n). A CTA takes the next task of the sequence whenever its
// producer is ready for one (role2_ring.cuh: op_take_task; the last to leave resets the count), so each CTA's
// tasks are in sequence order; its producer runs ahead in the same order and hands each task's sequence index to
// the consumers in a shared word of the stage its first K step fills. A task waits only on strictly earlier tasks:
// W2 of j on W1 of j; W1 of p on
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
//     intermediate columns [128j, 128j + 128), payload and scales) equal (g + 1) & 1; a fresh acquire at the
//     task's first step.
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
// scatter store (none at one rank, where every store is local and the kernel boundary orders it), so its combine
// stores are performed at system scope before the kernel completes; the graph orders
// role3 after role2, and role3's bookkeeping executes fence.sc.sys and st.release.sys combine_ready[rank] = n + 1
// on every peer; a peer's combine CTAs ld.acquire.sys it before loading combine (finalize.cu's ordering chain).
//
// Errors: every producer wait is bounded (Role2Params.timeout_ns) and gives up at once when role1's or role2's
// status record holds an error (role1 failing ends role2 within one poll; a failed role2 wait ends the other CTAs
// likewise); the consumers then leave together at the first pipeline slot their producer did not issue
// (op_wait_full), so no warpgroup-collective instruction or named barrier is ever left half-joined.
#pragma once

#include "sm90/role2_ring.cuh"

namespace gc_moe {
namespace sm90 {

// Producer side of K step kb of task `ot`: the ring signal it needs, the stage wait, then the kernel's loads.
// `mask_seen` caches the last acquired l2_full_mask of the current W2 task.
// `task_words` (the pipelined producer, a task's first K step): the stage's shared word receives the task's sequence
// index `s` once the stage is free, before the issue's arrival publishes the stage (release; the consumers read the
// word after their full wait, before they free the stage again).
template <typename K>
__device__ __forceinline__ bool op_produce(const OpArgs& a, const typename K::Pipeline& pipe, u32 it,
                                           const OpTask& ot, const Task& t, int kb, const OpMaps& maps,
                                           u64& mask_seen, volatile u32* task_words = nullptr, int s = 0) {
    if (!op_ring_acquire(a, ot, kb, mask_seen)) return false;
    const u32 stage = it % K::kStages, parity = ((it / K::kStages) & 1) ^ 1;
    if (!op_wait_empty(a, pipe.empty(stage), parity)) return false;
    if (task_words != nullptr) {
        task_words[stage] = static_cast<u32>(s);
        __threadfence_block();
    }
    K::op_issue(a, pipe, it, ot, t, kb, maps);
    return true;
}

// W2 epilogue in operator mode: the BF16 tile [kRows x valid] of this task, staged transposed in shared memory,
// then 16-byte stores of each valid token row into its source rank's combine buffer at (slot, src_token).
// A row whose l1_source names another pool block is reported (kSiteSource) and not stored; the kernel goes on (the
// record then stops the producers, and the consumers leave at the first slot not issued).
template <typename K>
__device__ __forceinline__ void op_epilogue_w2(const OpArgs& a, const float (&acc)[K::kMSub][K::kAcc],
                                               const Task& t, int pool_block, int cw, int warp, int lane,
                                               int local_tid, u8* out_tile) {
#pragma unroll
    for (int s = 0; s < K::kMSub; ++s) {
#pragma unroll
        for (int i = 0; i < K::kAcc; ++i) {
            const int col = acc_col(i, lane);
            const int h = (cw * K::kMSub + s) * 64 + warp * 16 + lane / 4 + 8 * ((i >> 1) & 1);
            *reinterpret_cast<__nv_bfloat16*>(out_tile + col * K::kOutPitch + h * 2) = __float2bfloat16_rn(acc[s][i]);
        }
    }
    named_barrier(K::kConsumerBarrier, K::kConsumerThreads);
    constexpr int kChunks = K::kRows / 8;  // 16-byte chunks per token row
    const int4* source = a.at<const int4>(a.off.l1_source);
    for (int u = local_tid; u < t.valid * kChunks; u += K::kConsumerThreads) {
        const int col = u / kChunks, c = u % kChunks;
        const int4 src = __ldcg(source + t.row_off + col);  // (src_rank, src_token, slot, pool block)
        if (src.w != pool_block) {
            report_status(a.status(), kStatusMismatch, kSiteSource, static_cast<u64>(src.w), pool_block);
            continue;
        }
        const uint4 v = ld_shared_v4(smem_addr(out_tile + col * K::kOutPitch + c * 16));
        const size_t elem =
            (static_cast<size_t>(src.z) * a.off.capacity + src.y) * a.p.hidden + t.tile * K::kRows + c * 8;
        st_global_v4(peer_ptr<__nv_bfloat16>(a.peers, src.x, a.off.combine) + elem, v);
        GC_ROLE2_MARK(if (c == 0) role2_mark_token(static_cast<u64>(src.x) * a.off.capacity + src.y));
    }
}

// The kernel body: tm_w1 / tm_w2 the weight maps, tm_l1 / tm_l2 the workspace's l1_acts [ring rows, H] and l2_acts
// [ring rows, I] (box 128 x kBM); everything else from the workspace (peers.base + off.*) and Role2Params.
// The host's shared-memory formula (gc_moe_compat/operator/sm90/role2_gemm.py: operator_smem_bytes) arrives as
// kHostSmemBytes (the build's GC_OP_SMEM_BYTES), so a drift between the two fails to compile instead of failing the
// launch-time check.
template <typename K, u32 kHostSmemBytes>
__device__ __forceinline__ void role2_body(const TensorMap* tm_w1, const TensorMap* tm_w2, const TensorMap* tm_l1,
                                           const TensorMap* tm_l2, const PeerTable& peers,
                                           const WorkspaceOffsets& off, const Role2Params& params) {
    static_assert(K::kSmemBytes == kHostSmemBytes,
                  "GC_OP_SMEM_BYTES: role2.operator_smem_bytes differs from kSmemBytes");
    static_assert(K::kMSub == 2, "operator mode: W1 and W2 tasks of 256 rows (ring.DEFAULT_GEOMETRY)");
    static_assert(K::kOffOut % 16 == 0 && K::kOutPitch % 16 == 0, "W2 staged tile: 16-byte rows for the vector stores");
    using Pipeline = typename K::Pipeline;
    // role3 (a programmatic edge: operator/sm90/layer.py) may launch now; it waits for this grid's end and memory
    // (wait_prerequisites) before it reads anything, and its CTAs take SMs only as this grid's CTAs leave them
    launch_dependents();
    if (params.flags & kRole2Warmup) return;
    const OpArgs a{peers, off, params};
    extern __shared__ u8 smem_raw[];
    u8* smem = align_smem_1024(smem_raw);
    const Pipeline pipe{smem_addr(smem)};
    u8* out_tile = smem + K::kOffOut;
    // [0] pool blocks, [1] stop slot, [2 + stage] the task whose first K step fills the stage (the pipelined
    // producer's), [2] also the non-pipelined consumers' next task (gemm_variant.cuh: kOpWords)
    volatile u32* words = reinterpret_cast<volatile u32*>(out_tile + K::kBM * K::kOutPitch);
    const int tid = threadIdx.x;
    if (!has_dyn_smem(K::kSmemBytes, tid, a.status(), kSiteSmem)) return;
    if (tid == 0) {
        GC_ROLE2_MARK(role2_mark_time(kMarkEntry));
        pipe.init(K::kConsumerThreads / 32);
        prefetch_tensormap(tm_w1);
        prefetch_tensormap(tm_w2);
        prefetch_tensormap(tm_l1);
        prefetch_tensormap(tm_l2);
        words[0] = op_pool_blocks(a);
        GC_ROLE2_MARK(role2_mark_time(kMarkPoolReady));
        words[1] = ~0u;
    }
    __syncthreads();

    const int t1 = static_cast<int>(params.w1_tasks), t2 = static_cast<int>(params.w2_tasks);
    const int w = static_cast<int>(params.lookahead);
    // The pool block count n and the task count n * (t1 + t2), re-read from shared memory at every step instead of
    // held in a register across the loops (the FP8xFP4 consumers at BM = 64 and the FP8xFP8 ones at BM = 96 run near
    // their 232-register limit; ptxas spilled n in an earlier BM = 96 step).
    const auto pool_blocks = [&] { return static_cast<int>(words[0]); };
    const auto num_tasks = [&] { return pool_blocks() * (t1 + t2); };
    // The block table's address, recomputed from the parameters at each task (one 64-bit value fewer held across
    // the consumers' K loops, which run at the register limit in the FP8xFP4 W1 + W2 grid).
    const auto table = [&] { return a.at<const int>(off.pool_table); };
    const OpMaps maps{tm_w1, tm_w2, tm_l1, tm_l2, evict_first_policy(), evict_last_policy()};
    const int wg = tid / 128;

    if (K::kProducerWG && wg == 0) {
        setmaxnreg_dec<K::kProducerRegs>();
        if (tid == 0) {
            u32 it = 0;
            u64 mask_seen = 0;
            for (int s = op_take_task(a); s < num_tasks(); s = op_take_task(a)) {
                const OpTask ot = role2_task(s, pool_blocks(), w, t1, t2);
                const Task t = ring_task(table(), ot);
                const int kb_count = static_cast<int>(ot.w1 ? params.hidden : params.inter) / K::kBK;
                for (int kb = 0; kb < kb_count; ++kb, ++it) {
                    if (!op_produce<K>(a, pipe, it, ot, t, kb, maps, mask_seen, kb == 0 ? words + 2 : nullptr, s)) {
                        words[1] = it;
                        op_schedule_done(a, 2);
                        return;
                    }
                    GC_ROLE2_MARK(if (it == 0) role2_mark_time(kMarkFirstLoad));
                }
                GC_ROLE2_MARK(role2_mark_add(kMarkTasks, 1));
            }
            GC_ROLE2_MARK(role2_mark_time(kMarkLastTake));
            // No task left: the stage after the last one is published with kNoTask in its word (an arrival without
            // bytes completes its full phase), so the consumers, waiting for it in mbarrier.try_wait, wake and leave at
            // once; the stop slot alone would leave them suspended until try_wait's time limit ran out.
            const u32 stage = it % K::kStages;
            if (op_wait_empty(a, pipe.empty(stage), ((it / K::kStages) & 1) ^ 1)) {
                words[2 + stage] = kNoTask;
                __threadfence_block();
                mbar_arrive(pipe.full(stage));
            }
            __threadfence_block();  // the last take before the stop the consumers leave at
            words[1] = it;
            op_schedule_done(a, 2);
        }
        return;
    }
    if (K::kProducerWG) setmaxnreg_inc<K::kConsumerRegs>();

    const int cw = wg - K::kProducerWG, warp = (tid / 32) & 3, lane = tid & 31;
    const int local_tid = tid - K::kProducerWG * 128;
    float* red = reinterpret_cast<float*>(smem + K::kOffRed);
    u32 it = 0;
    u64 mask_seen = 0;  // non-pipelined variant: consumer thread 0 is the producer
    while (true) {
        // The next task: from the stage its first K step fills (pipelined; kNoTask there, or the producer's stop
        // slot after a failure, ends the loop),
        // or taken by consumer thread 0 and passed through a shared word (non-pipelined; every consumer thread has
        // read the previous one: the epilogue's barriers lie between).
        int s;
        if constexpr (K::kProducerWG) {
            const u32 stage = it % K::kStages;
            if (!op_wait_full(a, pipe.full(stage), (it / K::kStages) & 1, it, words + 1)) break;
            const u32 word = words[2 + stage];
            if (word == kNoTask) break;
            s = static_cast<int>(word);
        } else {
            if (local_tid == 0) words[2] = static_cast<u32>(op_take_task(a));
            named_barrier(K::kConsumerBarrier, K::kConsumerThreads);
            s = static_cast<int>(words[2]);
            if (s >= num_tasks()) break;
        }
        const OpTask ot = role2_task(s, pool_blocks(), w, t1, t2);
        const Task t = ring_task(table(), ot);
        const u32 b = static_cast<u32>(ot.block) % params.ring_blocks;
        const auto wait_full = [&](u32 bar, u32 parity) { return op_wait_full(a, bar, parity, it, words + 1); };
        const auto load = [&](u32 slot, int kb) {
            if (words[1] == ~0u && !op_produce<K>(a, pipe, slot, ot, t, kb, maps, mask_seen)) words[1] = slot;
            return true;  // the consumers leave together at the stop slot (op_wait_full)
        };
        float acc[K::kMSub][K::kAcc];
        if (ot.w1) {
            if (!K::template op_consume<1>(a, pipe, smem, it, t, cw, warp, lane, local_tid, acc, wait_full, load)) {
                break;
            }
            K::op_epilogue_w1(a, acc, t, cw, warp, lane, red);
            op_release_w1(a, b, t.tile, local_tid, K::kConsumerBarrier, K::kConsumerThreads);
        } else {
            if (!K::template op_consume<2>(a, pipe, smem, it, t, cw, warp, lane, local_tid, acc, wait_full, load)) {
                break;
            }
            op_epilogue_w2<K>(a, acc, t, ot.block, cw, warp, lane, local_tid, out_tile);
            op_release_w2(a, b, local_tid, K::kConsumerBarrier, K::kConsumerThreads);
        }
    }
    // this thread's combine stores (local and peers') performed at system scope; at one rank every store is local
    // and the kernel's end orders it before role3 (a programmatic graph edge: role3's wait_prerequisites)
    if (a.peers.world_size > 1) __threadfence_system();
    GC_ROLE2_MARK(if (local_tid == 0) role2_mark_time(kMarkExit));
    if (local_tid == 0) op_schedule_done(a, K::kProducerWG ? 2 : 1);
}

}  // namespace sm90
}  // namespace gc_moe
