// Raw PTX for the SM90 expert GEMMs: mbarriers (with bounded waits), TMA tile and bulk copies, WGMMA on E4M3.
//
// Why raw PTX: these are the few Hopper instructions the kernels need (DESIGN.md allows raw PTX instead of the
// CUTLASS headers, which would have to travel to the device). Every wait is bounded by %globaltimer so that a
// broken pipeline ends in a reported error (common/status.cuh) instead of a hang.
#pragma once

#include <cstdint>

#include "common/sync.cuh"

namespace gc_moe {
namespace sm90 {

typedef unsigned char u8;
typedef unsigned short u16;

// A CUtensorMap as the kernel receives it: 128 opaque bytes, 64-byte aligned, passed by value (__grid_constant__).
struct alignas(64) TensorMap {
    u64 opaque[16];
};

__device__ __forceinline__ u32 smem_addr(const void* p) { return static_cast<u32>(__cvta_generic_to_shared(p)); }

// ------------------------------------------------------------------------------------------------------ mbarrier
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

// Makes barrier initialisation visible to the async proxy (TMA completes transactions on these barriers).
__device__ __forceinline__ void fence_barrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ bool mbar_try_wait(u32 bar, u32 parity) {
    u32 done;
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    return done != 0;
}

// Waits until the phase of parity `parity` of `bar` has completed, or records a timeout (site) and returns false.
__device__ __forceinline__ bool mbar_wait(u32 bar, u32 parity, u64 timeout_ns, KernelStatus* status, u32 site) {
    if (mbar_try_wait(bar, parity)) return true;
    const u64 start = globaltimer_ns();
    while (!mbar_try_wait(bar, parity)) {
        if (globaltimer_ns() - start > timeout_ns) {
            report_status(status, kStatusTimeout, site, parity, bar);
            return false;
        }
    }
    return true;
}

// ----------------------------------------------------------------------------------------------------------- TMA
// An L2 policy that evicts the streamed weights first: each weight tile is read once per layer call.
GC_PTX_VALUE(u64, "l", evict_first_policy, "createpolicy.fractional.L2::evict_first.b64 %0, 1.0;")
// An L2 policy that keeps the token tiles: every weight tile of a block re-reads them.
GC_PTX_VALUE(u64, "l", evict_last_policy, "createpolicy.fractional.L2::evict_last.b64 %0, 1.0;")

__device__ __forceinline__ void prefetch_tensormap(const TensorMap* map) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<u64>(map)) : "memory");
}

// 2D tile load (coordinates innermost first) completing `bytes` on `bar`, with an L2 cache hint.
__device__ __forceinline__ void tma_load_2d(u32 dst, const TensorMap* map, int c0, int c1, u32 bar, u64 policy) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(dst),
        "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(bar), "l"(policy)
        : "memory");
}

// Contiguous bulk copy global -> shared (bytes and both addresses multiples of 16) completing on `bar`.
__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

// Contiguous bulk copy shared -> global (bytes and both addresses multiples of 16) in the thread's bulk group; the
// shared source must have been made visible to the async proxy first (fence_proxy_async_shared, then a barrier).
__device__ __forceinline__ void bulk_store(void* dst, u32 src, u32 bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(src), "r"(bytes)
                 : "memory");
}

// Closes the thread's bulk group of the bulk stores issued so far.
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Waits until the thread's committed bulk stores have read their shared sources (which may then be rewritten).
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }

// Waits until the thread's committed bulk stores are complete: their writes are visible to the thread, and to others
// through its later release (a fence, or a barrier before another thread's).
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// Orders this thread's generic-proxy shared-memory writes before later async-proxy reads of them (bulk_store).
__device__ __forceinline__ void fence_proxy_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// 2D tile load multicast to the CTAs of the cluster in `cta_mask`: in each, the tile lands at `dst` and completes its
// bytes on `bar` (the same shared offsets in every CTA).
__device__ __forceinline__ void tma_load_2d_multicast(u32 dst, const TensorMap* map, int c0, int c1, u32 bar,
                                                      u16 cta_mask, u64 policy) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
        ".L2::cache_hint [%0], [%1, {%2, %3}], [%4], %5, %6;" ::"r"(dst),
        "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(bar), "h"(cta_mask), "l"(policy)
        : "memory");
}

// ------------------------------------------------------------------------------------------------------- cluster
// This CTA's rank in its cluster, the cluster's index along x and the clusters along x.
GC_PTX_VALUE(u32, "r", cluster_ctarank, "mov.u32 %0, %%cluster_ctarank;")
GC_PTX_VALUE(u32, "r", cluster_id_x, "mov.u32 %0, %%clusterid.x;")
GC_PTX_VALUE(u32, "r", cluster_count_x, "mov.u32 %0, %%nclusterid.x;")

// Every non-exited thread of the cluster arrives (releasing its prior memory operations) and waits for the others.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}

// The shared::cluster address of this CTA's shared address `addr` in CTA `rank` of the cluster.
__device__ __forceinline__ u32 map_shared_rank(u32 addr, u32 rank) {
    u32 r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
    return r;
}

// One arrival on the mbarrier at shared::cluster address `bar` (another CTA's). Default semantics (release at CTA
// scope): it orders this warp's retired WGMMA reads of its own stage before the other CTA's producer refills it, as
// the multicast pipelines of CUTLASS do; `.release.cluster` costs a cluster-scope fence per arrival (Nsight Compute:
// 40 % of the warps' stall cycles on the memory barrier, 1.5-2.3x slower GEMMs).
__device__ __forceinline__ void mbar_arrive_cluster(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(bar) : "memory");
}

// --------------------------------------------------------------------------------------------------------- WGMMA
// Shared-memory matrix descriptor of a K-major tile written by TMA with 128-byte swizzle: rows of 128 bytes,
// 8-row core groups 1024 bytes apart (stride byte offset), the tile base 1024-byte aligned (base offset 0).
// Advancing the start address by 32 bytes selects the next K32 slice inside the swizzle atom.
__device__ __forceinline__ u64 smem_desc_sw128(u32 addr) {
    return static_cast<u64>((addr & 0x3FFFF) >> 4) | (static_cast<u64>(1) << 16) |
           (static_cast<u64>(1024 >> 4) << 32) | (static_cast<u64>(1) << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// Waits until at most N committed WGMMA groups of this warpgroup are still in flight (N = 0: all retired).
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Keeps the compiler from moving accesses of an accumulator register across the asynchronous MMA.
__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void fence_operand(u32& r) { asm volatile("" : "+r"(r)::"memory"); }

// The accumulator operands of an m64nNk32 WGMMA: N/2 FP32 registers d[0..N/2) ("+f": read and written), and the
// text of their register list, built in steps of 8 (the shapes below use N = 8, 16, ..., 96: 72-96 for
// role2's wide block; the register-A shapes stop at 64).
#define GC_ACC4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define GC_ACC8(i) GC_ACC4(i), GC_ACC4(i + 4)
#define GC_ACC_N8 GC_ACC4(0)
#define GC_ACC_N16 GC_ACC8(0)
#define GC_ACC_N24 GC_ACC_N16, GC_ACC4(8)
#define GC_ACC_N32 GC_ACC_N16, GC_ACC8(8)
#define GC_ACC_N40 GC_ACC_N32, GC_ACC4(16)
#define GC_ACC_N48 GC_ACC_N32, GC_ACC8(16)
#define GC_ACC_N56 GC_ACC_N48, GC_ACC4(24)
#define GC_ACC_N64 GC_ACC_N48, GC_ACC8(24)
#define GC_ACC_N72 GC_ACC_N64, GC_ACC4(32)
#define GC_ACC_N80 GC_ACC_N72, GC_ACC4(36)
#define GC_ACC_N88 GC_ACC_N80, GC_ACC4(40)
#define GC_ACC_N96 GC_ACC_N88, GC_ACC4(44)
#define GC_REGS_N8 "%0, %1, %2, %3"
#define GC_REGS_N16 GC_REGS_N8 ", %4, %5, %6, %7"
#define GC_REGS_N24 GC_REGS_N16 ", %8, %9, %10, %11"
#define GC_REGS_N32 GC_REGS_N24 ", %12, %13, %14, %15"
#define GC_REGS_N40 GC_REGS_N32 ", %16, %17, %18, %19"
#define GC_REGS_N48 GC_REGS_N40 ", %20, %21, %22, %23"
#define GC_REGS_N56 GC_REGS_N48 ", %24, %25, %26, %27"
#define GC_REGS_N64 GC_REGS_N56 ", %28, %29, %30, %31"
#define GC_REGS_N72 GC_REGS_N64 ", %32, %33, %34, %35"
#define GC_REGS_N80 GC_REGS_N72 ", %36, %37, %38, %39"
#define GC_REGS_N88 GC_REGS_N80 ", %40, %41, %42, %43"
#define GC_REGS_N96 GC_REGS_N88 ", %44, %45, %46, %47"
// The instruction text up to its A operand: `p` is the operand number of the accumulate flag.
#define GC_WGMMA_HEAD(N, p)                                                                                        \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %" #p ", 0;\n"                                                               \
    "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 {" GC_REGS_N##N "}, "

// D[64 x N] (+)= A[64 x 32] * B[N x 32]^T, E4M3 inputs from shared memory, FP32 accumulators
// (`accumulate` = 0 overwrites D). One specialisation per token tile width N; `a`, `b`, `p`: the operand numbers
// of desc_a, desc_b and the accumulate flag, after the N/2 accumulators.
template <int N>
struct Wgmma;

#define GC_WGMMA_SS(N, a, b, p)                                                                                    \
    template <>                                                                                                    \
    struct Wgmma<N> {                                                                                              \
        __device__ __forceinline__ static void mma(float* d, u64 desc_a, u64 desc_b, u32 accumulate) {             \
            asm volatile(GC_WGMMA_HEAD(N, p) "%" #a ", %" #b ", p, 1, 1;\n}\n"                                     \
                         : GC_ACC_N##N                                                                             \
                         : "l"(desc_a), "l"(desc_b), "r"(accumulate));                                             \
        }                                                                                                          \
    };
GC_WGMMA_SS(8, 4, 5, 6)
GC_WGMMA_SS(16, 8, 9, 10)
GC_WGMMA_SS(24, 12, 13, 14)
GC_WGMMA_SS(32, 16, 17, 18)
GC_WGMMA_SS(40, 20, 21, 22)
GC_WGMMA_SS(48, 24, 25, 26)
GC_WGMMA_SS(56, 28, 29, 30)
GC_WGMMA_SS(64, 32, 33, 34)
GC_WGMMA_SS(72, 36, 37, 38)
GC_WGMMA_SS(80, 40, 41, 42)
GC_WGMMA_SS(88, 44, 45, 46)
GC_WGMMA_SS(96, 48, 49, 50)
#undef GC_WGMMA_SS

// D[64 x N] (+)= A[64 x 32] * B[N x 32]^T with A from REGISTERS: four 32-bit registers of four E4M3 values each,
// the m64nNk32 8-bit A fragment (register j: row 16*warp + lane/4 + 8*(j%2), columns 4*(lane%4) + 16*(j/2) + byte;
// the lowest byte holds the lowest column), B from shared memory through its descriptor. The A registers must not
// be rewritten before the wgmma.wait_group that retires this instruction (wgmma_fence before the first use).
// `a0`..`a3`, `b`, `p`: the operand numbers of the A registers, desc_b and the accumulate flag.
template <int N>
struct WgmmaRegA;

#define GC_WGMMA_RS(N, a0, a1, a2, a3, b, p)                                                                       \
    template <>                                                                                                    \
    struct WgmmaRegA<N> {                                                                                          \
        __device__ __forceinline__ static void mma(float* d, const u32* a, u64 desc_b, u32 accumulate) {           \
            asm volatile(GC_WGMMA_HEAD(N, p) "{%" #a0 ", %" #a1 ", %" #a2 ", %" #a3 "}, %" #b ", p, 1, 1;\n}\n"    \
                         : GC_ACC_N##N                                                                             \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));              \
        }                                                                                                          \
    };
GC_WGMMA_RS(8, 4, 5, 6, 7, 8, 9)
GC_WGMMA_RS(16, 8, 9, 10, 11, 12, 13)
GC_WGMMA_RS(24, 12, 13, 14, 15, 16, 17)
GC_WGMMA_RS(32, 16, 17, 18, 19, 20, 21)
GC_WGMMA_RS(40, 20, 21, 22, 23, 24, 25)
GC_WGMMA_RS(48, 24, 25, 26, 27, 28, 29)
GC_WGMMA_RS(56, 28, 29, 30, 31, 32, 33)
GC_WGMMA_RS(64, 32, 33, 34, 35, 36, 37)
#undef GC_WGMMA_RS

// ----------------------------------------------------------------------------------------------------- registers
template <u32 N>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}

template <u32 N>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}

// Named barrier `id` over `threads` threads (the consumer warpgroups only; id 0 is __syncthreads).
__device__ __forceinline__ void named_barrier(u32 id, u32 threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace sm90
}  // namespace gc_moe
