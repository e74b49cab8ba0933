// Stand-ins that let role1 (kernels/sm90/role1_dispatch.cu) run alone in the tests (tests/operator/test_role1_*.py).
// dt_consume plays role2's side of the token ring: it walks the pool blocks in order like the GEMM's task stream,
// copies every block generation to a capture buffer once l1_full_count says it is complete (so the test sees every
// generation, not only what survives in the ring), then releases l1_empty_count and l2_empty_count (the latter
// optionally delayed) exactly as role2 would (t1 / t2 per generation). dt_finalize plays role3's bookkeeping: the
// receive-count arrival check, the resets of operator/workspace.py's "role3 resets" list, the parity flip and the
// replay_seq advance.
// They carry no GEMM or combine logic.
#include "common/peer_table.cuh"
#include "common/status.cuh"
#include "common/sync.cuh"
#include "sm90/role1_dispatch_params.cuh"

using gc_moe::KernelStatus;
using gc_moe::PeerTable;
using gc_moe::Scope;
using gc_moe::u32;
using gc_moe::u64;
using gc_moe::WorkspaceOffsets;

// Status sites of the stand-ins (tests/kit/role1_kit.py: STANDIN_SITES).
enum StandInSite : u32 {
    kSitePoolHeader = 1,
    kSiteFull = 2,
    kSiteArrival = 3,
};

// Capture buffers of dt_consume, one entry per pool block (pool = off.pool_blocks).
struct Capture {
    unsigned char* acts;  // [pool, BM, H]
    float* scales;        // [pool, BM, H/128] (un-transposed)
    float* weights;       // [pool, BM]
    int4* source;         // [pool, BM]
    u32* full_seen;       // [pool]: l1_full_count when the block was seen complete
    u64* header_seen;     // [1]: pool_header as acquired
};

__device__ __forceinline__ bool wait_u32(const u32* p, u32 target, u64 timeout_ns, KernelStatus* status, u32 site,
                                         u32* seen_out) {
    const u64 start = gc_moe::globaltimer_ns();
    u32 seen;
    for (;;) {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(p) : "memory");
        if (seen >= target) break;
        if (gc_moe::globaltimer_ns() - start > timeout_ns) {
            gc_moe::report_status(status, gc_moe::kStatusTimeout, site, seen, target);
            return false;
        }
        __nanosleep(64);
    }
    *seen_out = seen;
    return true;
}

// One CTA. bm / ring: the call's BM and R; t1 / t2: empty releases per generation; delay_ns > 0: the l2_empty
// releases of generation 0 are held back until every generation-0 block is consumed and the delay has passed, while
// l1_empty is released at once, so every refill wait of role1 passes l1_empty and waits on l2_empty alone.
extern "C" __global__ void dt_consume(const PeerTable peers, const WorkspaceOffsets off, Capture cap, u32 bm,
                                      u32 ring, u32 hidden, u32 t1, u32 t2, u64 delay_ns, u64 timeout_ns,
                                      KernelStatus* status, u32 warmup) {
    if (warmup) return;
    __shared__ u32 s_blocks;
    __shared__ int s_ok;
    unsigned char* base = reinterpret_cast<unsigned char*>(peers.base);
    if (threadIdx.x == 0) {
        const u64* header = reinterpret_cast<const u64*>(base + off.pool_header);
        s_ok = gc_moe::wait_at_least<Scope::kGpu>(header, 1ull << 32, timeout_ns, status, kSitePoolHeader);
        const u64 h = gc_moe::ld_acquire_gpu(header);
        *cap.header_seen = h;
        s_blocks = static_cast<u32>(h);
    }
    __syncthreads();
    if (!s_ok) return;
    u32* full = reinterpret_cast<u32*>(base + off.l1_full_count);
    u32* empty1 = reinterpret_cast<u32*>(base + off.l1_empty_count);
    u32* empty2 = reinterpret_cast<u32*>(base + off.l2_empty_count);
    const unsigned char* acts = base + off.l1_acts;
    const float* acts_sf = reinterpret_cast<const float*>(base + off.l1_acts_sf);
    const float* weights = reinterpret_cast<const float*>(base + off.l1_routing_weights);
    const int4* source = reinterpret_cast<const int4*>(base + off.l1_source);
    const u32 groups = hidden / 128, words = hidden / 4;
    for (u32 q = 0; q < s_blocks; ++q) {
        const u32 b = q % ring, gen = q / ring;
        if (threadIdx.x == 0) {
            u32 seen = 0;
            s_ok = wait_u32(full + b, bm * (gen + 1), timeout_ns, status, kSiteFull, &seen);
            cap.full_seen[q] = seen;
        }
        __syncthreads();
        if (!s_ok) return;
        for (u32 i = threadIdx.x; i < bm * words; i += blockDim.x) {
            const u32 r = i / words, w = i % words;
            const u32* from = reinterpret_cast<const u32*>(acts + static_cast<size_t>(b * bm + r) * hidden) + w;
            reinterpret_cast<u32*>(cap.acts + static_cast<size_t>(q * bm + r) * hidden)[w] = __ldcg(from);
        }
        for (u32 i = threadIdx.x; i < bm * groups; i += blockDim.x) {
            const u32 r = i / groups, g = i % groups;
            cap.scales[static_cast<size_t>(q * bm + r) * groups + g] =
                __ldcg(acts_sf + static_cast<size_t>(g) * off.ring_rows + b * bm + r);
        }
        for (u32 r = threadIdx.x; r < bm; r += blockDim.x) {
            cap.weights[q * bm + r] = __ldcg(weights + b * bm + r);
            cap.source[q * bm + r] = __ldcg(source + b * bm + r);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            atomicAdd(empty1 + b, t1);
            const u32 first_gen = min(ring, s_blocks);
            if (delay_ns == 0 || q >= first_gen) {
                atomicAdd(empty2 + b, t2);
            } else if (q == first_gen - 1) {
                gc_moe::busy_wait_ns(delay_ns);
                __threadfence();
                for (u32 g0 = 0; g0 < first_gen; ++g0) atomicAdd(empty2 + g0, t2);
            }
        }
    }
}

// One CTA, after role1 and dt_consume: role3's bookkeeping for role1's state.
extern "C" __global__ void dt_finalize(const PeerTable peers, const WorkspaceOffsets off, u32 num_experts,
                                       u32 local_experts, u32 dispatch_ctas, KernelStatus* status, u32 warmup) {
    if (warmup) return;
    unsigned char* base = reinterpret_cast<unsigned char*>(peers.base);
    const u32 ranks = static_cast<u32>(peers.world_size);
    u64* parity_word = reinterpret_cast<u64*>(base + off.recv_parity);
    const u64 parity = *parity_word & 1;
    u64* recv = reinterpret_cast<u64*>(base + off.recv_counts) + parity * ranks * local_experts;
    for (u32 le = threadIdx.x; le < local_experts; le += blockDim.x) {
        u64 arrivals = 0;
        for (u32 src = 0; src < ranks; ++src) arrivals += recv[src * local_experts + le] >> 32;
        if (arrivals != static_cast<u64>(dispatch_ctas) * ranks) {
            gc_moe::report_status(status, gc_moe::kStatusMismatch, kSiteArrival, arrivals,
                                  static_cast<u64>(dispatch_ctas) * ranks);
        }
    }
    __syncthreads();
    u64* send = reinterpret_cast<u64*>(base + off.send_counts);
    for (u32 x = threadIdx.x; x < num_experts; x += blockDim.x) send[x] = 0;
    for (u32 i = threadIdx.x; i < ranks * local_experts; i += blockDim.x) recv[i] = 0;
    for (u32 b = threadIdx.x; b < off.ring_blocks; b += blockDim.x) {
        reinterpret_cast<u32*>(base + off.l1_full_count)[b] = 0;
        reinterpret_cast<u32*>(base + off.l1_empty_count)[b] = 0;
        reinterpret_cast<u64*>(base + off.l2_full_mask)[b] = 0;
        reinterpret_cast<u32*>(base + off.l2_empty_count)[b] = 0;
    }
    if (threadIdx.x == 0) {
        *reinterpret_cast<u64*>(base + off.pool_header) = 0;
        *parity_word = parity ^ 1;
        *reinterpret_cast<u64*>(base + off.replay_seq) += 1;
        __threadfence_system();
    }
}
