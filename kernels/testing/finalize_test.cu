// Stand-ins for role1/role2 in role3's GPU tests (tests/operator/test_role3_finalize_gpu.py, role3_two_rank_worker.py).
// No MoE logic: they leave the workspace in the state role1/role2 leave it, and check what role3 left behind.
#include "common/peer_table.cuh"
#include "common/status.cuh"
#include "common/sync.cuh"
#include "common/workspace_offsets.cuh"

using gc_moe::KernelStatus;
using gc_moe::PeerTable;
using gc_moe::u32;
using gc_moe::u64;
using gc_moe::WorkspaceOffsets;

// Status sites of ft_stand_in (decoded by tests/operator/test_role3_finalize_gpu.py).
enum StandInSite : u32 {
    kSiteReplaySeq = 1,
    kSiteParity = 2,
    kSiteCombineReady = 3,
    kSiteArrive = 4,
    kSiteRecvCounts = 5,
    kSiteSendCounts = 6,
    kSitePoolHeader = 7,
    kSiteL1Full = 8,
    kSiteL1Empty = 9,
    kSiteL2Mask = 10,
    kSiteL2Empty = 11,
};

// Rows source `src` sends to local expert `le` in stand-in replay `n` (the low word of its packed counter).
__device__ __forceinline__ u64 stand_in_count(u64 n, u32 src, u32 le) { return (n * 7 + src * 3 + le) % 97; }

template <typename T>
__device__ __forceinline__ void expect_zero(const T* p, u64 count, KernelStatus* status, u32 site) {
    for (u64 i = threadIdx.x; i < count; i += blockDim.x) {
        if (p[i] != 0) gc_moe::report_status(status, gc_moe::kStatusMismatch, site, (u64)p[i], 0);
    }
}

template <typename T>
__device__ __forceinline__ T* at(const PeerTable& peers, u64 offset) {
    return reinterpret_cast<T*>(peers.base + offset);
}

// One CTA, one replay `n` (= *test_seq) of a single-rank workspace: checks that role3 of replay n-1 left exactly the
// state the protocol requires (replay_seq = n, parity = n&1, combine_ready = n, every reset region 0), then writes
// what role1/role2 of replay n leave for role3: recv_counts[n&1] with high word dispatch_sms, non-zero send
// counters, pool header and ring signals.
extern "C" __global__ void ft_stand_in(const PeerTable peers, const WorkspaceOffsets off, u64* test_seq,
                                       KernelStatus* status, u32 dispatch_sms, u32 num_experts, u32 local_experts,
                                       u32 flags) {
    if (flags & 1) return;
    __shared__ u64 s_n;
    if (threadIdx.x == 0) s_n = *test_seq;
    __syncthreads();
    const u64 n = s_n;
    const u32 ranks = (u32)peers.world_size;
    const u64 blocks = off.ring_blocks;
    u64* recv = at<u64>(peers, off.recv_counts);
    if (threadIdx.x == 0) {
        const u64 seq = *at<u64>(peers, off.replay_seq), parity = *at<u64>(peers, off.recv_parity);
        const u64 arrive = *at<u64>(peers, off.finalize_arrive);
        if (seq != n) gc_moe::report_status(status, gc_moe::kStatusMismatch, kSiteReplaySeq, seq, n);
        if (parity != (n & 1)) gc_moe::report_status(status, gc_moe::kStatusMismatch, kSiteParity, parity, n & 1);
        if (arrive != 0) gc_moe::report_status(status, gc_moe::kStatusMismatch, kSiteArrive, arrive, 0);
    }
    for (u32 r = threadIdx.x; r < ranks; r += blockDim.x) {
        const u64 ready = at<u64>(peers, off.combine_ready)[r];
        if (ready != n) gc_moe::report_status(status, gc_moe::kStatusMismatch, kSiteCombineReady, ready, n);
    }
    expect_zero(recv, 2ull * ranks * local_experts, status, kSiteRecvCounts);
    expect_zero(at<u64>(peers, off.send_counts), num_experts, status, kSiteSendCounts);
    expect_zero(at<u64>(peers, off.pool_header), 1, status, kSitePoolHeader);
    expect_zero(at<u32>(peers, off.l1_full_count), blocks, status, kSiteL1Full);
    expect_zero(at<u32>(peers, off.l1_empty_count), blocks, status, kSiteL1Empty);
    expect_zero(at<u64>(peers, off.l2_full_mask), blocks, status, kSiteL2Mask);
    expect_zero(at<u32>(peers, off.l2_empty_count), blocks, status, kSiteL2Empty);
    __syncthreads();
    u64* counts = recv + (n & 1) * ranks * local_experts;
    for (u32 i = threadIdx.x; i < ranks * local_experts; i += blockDim.x) {
        counts[i] = (u64)dispatch_sms << 32 | stand_in_count(n, i / local_experts, i % local_experts);
    }
    for (u32 g = threadIdx.x; g < num_experts; g += blockDim.x) at<u64>(peers, off.send_counts)[g] = 1ull << 32 | g;
    for (u64 b = threadIdx.x; b < blocks; b += blockDim.x) {
        at<u32>(peers, off.l1_full_count)[b] = (u32)b + 1;
        at<u32>(peers, off.l1_empty_count)[b] = (u32)b + 2;
        at<u64>(peers, off.l2_full_mask)[b] = ~0ull;
        at<u32>(peers, off.l2_empty_count)[b] = (u32)b + 3;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        *at<u64>(peers, off.pool_header) = 1ull << 32 | 3;
        *test_seq = n + 1;
    }
}

// Role2's W2 scatter: row i of `data` (BF16 [n, hidden]) goes to rank rows[i].x's combine buffer at slot rows[i].y,
// token rows[i].z, with 16-byte stores through the peer table.
extern "C" __global__ void ft_scatter_rows(const PeerTable peers, u64 combine_offset, u32 capacity, u32 hidden,
                                           const int4* rows, const uint4* data, u32 n) {
    const u32 vecs = hidden / 8;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (u64)n * vecs; i += (u64)gridDim.x * blockDim.x) {
        const int4 row = rows[i / vecs];
        uint4* dst = gc_moe::peer_ptr<uint4>(peers, row.x, combine_offset);
        dst[((u64)row.y * capacity + row.z) * vecs + i % vecs] = data[i];
    }
}

// Keeps one thread busy for `ns` nanoseconds: delays the kernels queued after it on the stream.
extern "C" __global__ void ft_delay(u64 ns) {
    if (threadIdx.x == 0 && blockIdx.x == 0) gc_moe::busy_wait_ns(ns);
}
