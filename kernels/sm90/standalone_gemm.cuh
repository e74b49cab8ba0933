// The standalone SM90 grouped expert GEMM (GC_OPERATOR=0): the grid body both weight formats compile to
// (role2_gemm_fp8xfp8.cu: gc_sm90_fp8_grouped_gemm; role2_gemm_fp8xfp4.cu: gc_sm90_fp8_fp4_grouped_gemm), as
// role2_gemm.cuh is for the operator.
//
// A source fragment: a kernel source includes it in its standalone section, inside namespace gc_moe::sm90, after
// defining
//   constants  kThreads, kSmemBytes, kStages, kConsumerWGs, kProducerWG, kEpi, kMSub, kAcc, kRows, kBK, kOffRed,
//              kCluster (cluster pairs, PairTask in grouped.cuh), kFastMath and kUe8m0 (the W1 epilogue's sigmoid and
//              scale rule: its policy StandaloneW1 below);
//   Pipeline   its StagePipeline;
//   sa_issue(a, pipe, it, t, kb, policy_w, policy_x, multicast, rank)
//              issues K step kb of task t into the free slot `it`;
//   sa_consume(a, pipe, smem, it, t, cw, warp, lane, local_tid, acc, wait_full, load)
//              the consumer K loop of task t into acc[kMSub][kAcc], weight scales included.
// What is specific to a weight format stays in its source; the task walk, the warpgroup roles, the cluster pairs and
// the epilogue calls are written once, here.
//
// A persistent grid walks the tasks (ring block, or a cluster's pair of blocks, x tile of kRows weight rows) with
// the grid's stride: the pipelined variant's producer warpgroup runs ahead across them (produce_tasks), the consumer
// warpgroups run each task's K loop and its epilogue (GC_EPI=1: W1, sm90/epilogue_w1.cuh; 2: W2, BF16 partial rows).
#pragma once

#if GC_OPERATOR
#error "sm90/standalone_gemm.cuh is the standalone body (GC_OPERATOR=0)"
#endif

// The W1 epilogue's policy (sm90/epilogue_w1.cuh): the variant's constants; the routing weights are read-only for
// the launch.
struct StandaloneW1 {
    static constexpr int kBM = sm90::kBM, kMSub = sm90::kMSub, kAcc = sm90::kAcc, kConsumerWGs = sm90::kConsumerWGs,
                         kConsumerThreads = sm90::kConsumerThreads;
    static constexpr bool kUe8m0 = sm90::kUe8m0, kFastMath = sm90::kFastMath, kRingRows = false;
};

// Waits for slot `it` to be free and issues K step kb of pair task pt into it.
__device__ __forceinline__ bool sa_produce(const StandaloneArgs& a, const Pipeline& pipe, u32 it, const PairTask& pt,
                                           int kb, u64 policy_w, u64 policy_x, u32 rank) {
    const u32 stage = it % kStages, parity = ((it / kStages) & 1) ^ 1;
    if (!mbar_wait(pipe.empty(stage), parity, a.timeout_ns, a.status, kSiteEmpty)) return false;
    sa_issue(a, pipe, it, pt.t, kb, policy_w, policy_x, pt.multicast, rank);
    return true;
}

__device__ __forceinline__ void standalone_body(const StandaloneArgs& a) {
    extern __shared__ u8 smem_raw[];
    u8* smem = align_smem_1024(smem_raw);
    const Pipeline pipe{smem_addr(smem)};
    const int tid = threadIdx.x;
    if (!has_dyn_smem(kSmemBytes, tid, a.status, kSiteSmem)) return;
    if (tid == 0) {
        pipe.init(kConsumerWGs * 4 * (kCluster ? 2 : 1));  // in a cluster pair both CTAs' consumers free a stage
        prefetch_tensormap(a.tm_w);
        prefetch_tensormap(a.tm_x);
    }
    if constexpr (kCluster) {
        cluster_sync();  // both CTAs' barriers exist before either producer or consumer touches the other's
    } else {
        __syncthreads();
    }

    const int nb = __ldg(a.num_blocks);
    const int kb_count = a.k / kBK;
    const u32 rank = kCluster ? cluster_ctarank() : 0;
    const int first = kCluster ? static_cast<int>(cluster_id_x()) : static_cast<int>(blockIdx.x);
    const int stride = kCluster ? static_cast<int>(cluster_count_x()) : static_cast<int>(gridDim.x);
    const int num_tasks = (kCluster ? pair_count(nb) : nb) * (a.n_w / kRows);
    const auto task_at = [&](int i) {
        return kCluster ? load_pair_task(a.blocks, i, nb, rank) : PairTask{load_task(a.blocks, i, nb), false, false};
    };
    const u64 policy_w = evict_first_policy();
    const u64 policy_x = evict_last_policy();  // token tiles are re-read by every weight tile of their block
    const int wg = tid / 128;

    if (kProducerWG && wg == 0) {
        const auto produce_step = [&](u32 it, const PairTask& pt, int kb) {
            return sa_produce(a, pipe, it, pt, kb, policy_w, policy_x, rank);
        };
        produce_tasks(tid, first, stride, num_tasks, kb_count, task_at, produce_step);
        return;
    }
    if (kProducerWG) setmaxnreg_inc<232>();

    const int cw = wg - kProducerWG, warp = (tid / 32) & 3, lane = tid & 31;
    const int local_tid = tid - kProducerWG * 128;
    float* red = reinterpret_cast<float*>(smem + kOffRed);
    const auto wait_full = [&](u32 bar, u32 parity) {
        return mbar_wait(bar, parity, a.timeout_ns, a.status, kSiteFull);
    };
    u32 it = 0;
    for (int i = first; i < num_tasks; i += stride) {
        const PairTask pt = task_at(i);
        const Task& t = pt.t;
        float acc[kMSub][kAcc];
        // The non-pipelined variant's own loads (no cluster there).
        const auto load = [&](u32 slot, int kb) {
            return sa_produce(a, pipe, slot, PairTask{t, false, false}, kb, policy_w, policy_x, 0);
        };
        if (!sa_consume(a, pipe, smem, it, t, cw, warp, lane, local_tid, acc, wait_full, load)) return;
        const Task stored{t.expert, pt.mirror ? 0 : t.valid, t.row_off, t.tile};  // a mirror stores nothing
        if constexpr (kEpi == 1) {
            epilogue_w1<StandaloneW1>(acc, stored, cw, warp, lane, red, a.routing_w, static_cast<u8*>(a.out),
                                      a.out_sf_t, a.n_w / 2, a.rows_total, a.clamp, a.alpha);
        } else {
            epilogue_w2<kRows>(acc, stored, cw, warp, lane, static_cast<__nv_bfloat16*>(a.out), a.n_w);
        }
    }
    if constexpr (kCluster) cluster_sync();  // the other CTA arrives on this one's barriers until it is done
}

// The entry of a standalone kernel `name` (its parameters: the kernel source's comment above the macro's use).
#define GC_STANDALONE_ENTRY(name)                                                                                  \
    extern "C" __global__ void __launch_bounds__(kThreads, 1)                                                      \
        name(const __grid_constant__ TensorMap tm_w, const __grid_constant__ TensorMap tm_x,                      \
             const float* __restrict__ w_sf, const float* __restrict__ x_sf_t, const int* __restrict__ blocks,    \
             const int* __restrict__ num_blocks, const float* __restrict__ routing_w, void* __restrict__ out,     \
             float* __restrict__ out_sf_t, int n_w, int k, int rows_total, float clamp, float alpha,              \
             KernelStatus* status, u64 timeout_ns) {                                                               \
        standalone_body(StandaloneArgs{&tm_w, &tm_x, w_sf, x_sf_t, blocks, num_blocks, routing_w, out, out_sf_t,  \
                                       n_w, k, rows_total, clamp, alpha, status, timeout_ns});                    \
    }
