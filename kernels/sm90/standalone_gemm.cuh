// The standalone SM90 grouped expert GEMM (GC_OPERATOR=0): the grid body both weight formats and role4 compile to
// (role2_gemm_fp8xfp8.cu: gc_sm90_fp8_grouped_gemm; role2_gemm_fp8xfp4.cu: gc_sm90_fp8_fp4_grouped_gemm;
// role4_shared.cu: gc_sm90_role4_shared), as role2_gemm.cuh is for the operator.
//
// A template: each source's extern "C" entry instantiates standalone_body<K> with its kernel policy K, a struct of
//   constants  kSmemBytes, kStages, kConsumerWGs, kProducerWG, kEpi, kMSub, kAcc, kRows, kBK, kOffRed, kCluster
//              (cluster pairs, PairTask in grouped.cuh), kProducerRegs, kConsumerRegs (the pipelined variant's
//              setmaxnreg counts) and the W1 epilogue's (kBM, kConsumerThreads, kUe8m0,
//              kFastMath, kRingRows = false: K is epilogue_w1's policy too, sm90/epilogue_w1.cuh);
//   Pipeline   its StagePipeline;
//   hooks      static member functions:
//   sa_issue(a, pipe, it, t, kb, policy_w, policy_x, multicast, rank)
//              issues K step kb of task t into the free slot `it`;
//   sa_consume(a, pipe, smem, it, t, cw, warp, lane, local_tid, acc, wait_full, load)
//              the consumer K loop of task t into acc[kMSub][kAcc], weight scales included.
// The header reads no macro and no name of its includer (each source includes it before its variant constants, so
// the templates see only their policy's). What is specific to a weight format stays in its source; the task walk,
// the warpgroup roles, the cluster pairs and the epilogue calls are written once, here. The entry (its name and
// parameters, StandaloneArgs in grouped.cuh) is each source's own.
//
// A persistent grid walks the tasks (ring block, or a cluster's pair of blocks, x tile of kRows weight rows) with
// the grid's stride: the pipelined variant's producer warpgroup runs ahead across them (produce_tasks), the consumer
// warpgroups run each task's K loop and its epilogue (kEpi 1: W1, sm90/epilogue_w1.cuh; 2: W2, BF16 partial rows).
#pragma once

#include "sm90/epilogue_w1.cuh"

namespace gc_moe {
namespace sm90 {

// Waits for slot `it` to be free and issues K step kb of pair task pt into it.
template <typename K>
__device__ __forceinline__ bool sa_produce(const StandaloneArgs& a, const typename K::Pipeline& pipe, u32 it,
                                           const PairTask& pt, int kb, u64 policy_w, u64 policy_x, u32 rank) {
    const u32 stage = it % K::kStages, parity = ((it / K::kStages) & 1) ^ 1;
    if (!mbar_wait(pipe.empty(stage), parity, a.timeout_ns, a.status, kSiteEmpty)) return false;
    K::sa_issue(a, pipe, it, pt.t, kb, policy_w, policy_x, pt.multicast, rank);
    return true;
}

template <typename K>
__device__ __forceinline__ void standalone_body(const StandaloneArgs& a) {
    static_assert(!K::kRingRows, "standalone: the routing weights are read-only for the launch");
    using Pipeline = typename K::Pipeline;
    extern __shared__ u8 smem_raw[];
    u8* smem = align_smem_1024(smem_raw);
    const Pipeline pipe{smem_addr(smem)};
    const int tid = threadIdx.x;
    if (!has_dyn_smem(K::kSmemBytes, tid, a.status, kSiteSmem)) return;
    if (tid == 0) {
        pipe.init(K::kConsumerWGs * 4 * (K::kCluster ? 2 : 1));  // in a cluster pair both CTAs' consumers free a stage
        prefetch_tensormap(a.tm_w);
        prefetch_tensormap(a.tm_x);
    }
    if constexpr (K::kCluster) {
        cluster_sync();  // both CTAs' barriers exist before either producer or consumer touches the other's
    } else {
        __syncthreads();
    }

    const int nb = __ldg(a.num_blocks);
    const int kb_count = a.k / K::kBK;
    const u32 rank = K::kCluster ? cluster_ctarank() : 0;
    const int first = K::kCluster ? static_cast<int>(cluster_id_x()) : static_cast<int>(blockIdx.x);
    const int stride = K::kCluster ? static_cast<int>(cluster_count_x()) : static_cast<int>(gridDim.x);
    const int num_tasks = (K::kCluster ? pair_count(nb) : nb) * (a.n_w / K::kRows);
    const auto task_at = [&](int i) {
        return K::kCluster ? load_pair_task(a.blocks, i, nb, rank) : PairTask{load_task(a.blocks, i, nb), false, false};
    };
    const u64 policy_w = evict_first_policy();
    const u64 policy_x = evict_last_policy();  // token tiles are re-read by every weight tile of their block
    const int wg = tid / 128;

    if (K::kProducerWG && wg == 0) {
        const auto produce_step = [&](u32 it, const PairTask& pt, int kb) {
            return sa_produce<K>(a, pipe, it, pt, kb, policy_w, policy_x, rank);
        };
        produce_tasks<K::kProducerRegs>(tid, first, stride, num_tasks, kb_count, task_at, produce_step);
        return;
    }
    if (K::kProducerWG) setmaxnreg_inc<K::kConsumerRegs>();

    const int cw = wg - K::kProducerWG, warp = (tid / 32) & 3, lane = tid & 31;
    const int local_tid = tid - K::kProducerWG * 128;
    float* red = reinterpret_cast<float*>(smem + K::kOffRed);
    const auto wait_full = [&](u32 bar, u32 parity) {
        return mbar_wait(bar, parity, a.timeout_ns, a.status, kSiteFull);
    };
    u32 it = 0;
    for (int i = first; i < num_tasks; i += stride) {
        const PairTask pt = task_at(i);
        const Task& t = pt.t;
        float acc[K::kMSub][K::kAcc];
        // The non-pipelined variant's own loads (no cluster there).
        const auto load = [&](u32 slot, int kb) {
            return sa_produce<K>(a, pipe, slot, PairTask{t, false, false}, kb, policy_w, policy_x, 0);
        };
        if (!K::sa_consume(a, pipe, smem, it, t, cw, warp, lane, local_tid, acc, wait_full, load)) return;
        const Task stored{t.expert, pt.mirror ? 0 : t.valid, t.row_off, t.tile};  // a mirror stores nothing
        if constexpr (K::kEpi == 1) {
            epilogue_w1<K>(acc, stored, cw, warp, lane, red, a.routing_w, static_cast<u8*>(a.out), a.out_sf_t,
                           a.n_w / 2, a.rows_total, a.clamp, a.alpha);
        } else {
            epilogue_w2<K::kRows>(acc, stored, cw, warp, lane, static_cast<__nv_bfloat16*>(a.out), a.n_w);
        }
    }
    if constexpr (K::kCluster) cluster_sync();  // the other CTA arrives on this one's barriers until it is done
}

}  // namespace sm90
}  // namespace gc_moe
