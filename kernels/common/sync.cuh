// Memory-ordering and timing primitives shared by every GC-MoE kernel (SM90+).
//
// Why raw PTX: the cross-partition and cross-GPU handshakes need explicit acquire/release at .gpu or .sys scope,
// and the bounded spin-waits need the device-wide nanosecond clock (%globaltimer) so that a missing producer ends
// in a reported error instead of a hang.
#pragma once

#include "common/status.cuh"

// Back-off between polls of a spin-wait (a constexpr parameter: the JIT passes it as a define).
#ifndef GC_MOE_SPIN_SLEEP_NS
#define GC_MOE_SPIN_SLEEP_NS 64
#endif

namespace gc_moe {

typedef unsigned int u32;
typedef unsigned long long u64;

// Defines `name()`, returning the one output of the PTX instruction `text` (a `type` register, constraint `c`):
// special registers, L2 policies.
#define GC_PTX_VALUE(type, c, name, text)            \
    __device__ __forceinline__ type name() {         \
        type value;                                  \
        asm volatile(text : "=" c(value));           \
        return value;                                \
    }

// Physical SM index the calling thread runs on (used to prove green-context confinement).
GC_PTX_VALUE(u32, "r", smid, "mov.u32 %0, %%smid;")
// Device-wide nanosecond clock; coarse (about 1 us ticks on Hopper) but monotonic and shared by all SMs.
GC_PTX_VALUE(u64, "l", globaltimer_ns, "mov.u64 %0, %%globaltimer;")

__device__ __forceinline__ u64 ld_acquire_gpu(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ u64 ld_acquire_sys(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// 32-bit ring counters (l1_full_count, l1_empty_count, l2_empty_count): gpu scope, the partitions of one device.
__device__ __forceinline__ u32 ld_acquire_gpu_u32(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void red_release_gpu_add_u32(u32* p, u32 v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void st_release_gpu(u64* p, u64 v) {
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void st_release_sys(u64* p, u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Scope of a flag: kGpu for partitions of one device, kSys for flags in a peer GPU's memory.
enum class Scope { kGpu, kSys };

template <Scope S>
__device__ __forceinline__ u64 ld_acquire(const u64* p) {
    return S == Scope::kGpu ? ld_acquire_gpu(p) : ld_acquire_sys(p);
}

// Spins until *flag >= target (acquire) or timeout_ns elapse. On timeout records kStatusTimeout with `site`,
// the last observed value and the target in `status`, and returns false; the caller must then leave the kernel.
// Generation-tagged flags only grow, so ">=" makes the wait correct across graph replays without a host reset.
template <Scope S>
__device__ __forceinline__ bool wait_at_least(const u64* flag, u64 target, u64 timeout_ns, KernelStatus* status,
                                              u32 site) {
    const u64 start = globaltimer_ns();
    u64 seen = ld_acquire<S>(flag);
    while (seen < target) {
        if (globaltimer_ns() - start > timeout_ns) {
            report_status(status, kStatusTimeout, site, seen, target);
            return false;
        }
        __nanosleep(GC_MOE_SPIN_SLEEP_NS);
        seen = ld_acquire<S>(flag);
    }
    return true;
}

// Programmatic dependent launch (a graph edge of type CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC, runtime/graph.py).
// launch_dependents: this CTA lets the edge's dependent grid launch once every CTA of this grid has called it or
// exited (the dependent then runs beside this grid: it must synchronize with it through memory flags or
// wait_prerequisites). wait_prerequisites: blocks until every grid this one depends on programmatically has completed
// and its memory operations are visible; both are no-ops in a grid launched without such an edge.
__device__ __forceinline__ void launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void wait_prerequisites() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// Busy-waits for `ns` nanoseconds: keeps a block resident so that a grid spreads over every SM it may use.
__device__ __forceinline__ void busy_wait_ns(u64 ns) {
    const u64 start = globaltimer_ns();
    while (globaltimer_ns() - start < ns) {
    }
}

// Generation-tagged arrival on a counter that is never reset: with `blocks` arrivals per generation, the
// returned generation (1-based) is old / blocks + 1, and *last is true for the final arrival of that generation.
__device__ __forceinline__ u64 arrive_generation(u64* counter, u32 blocks, bool* last) {
    __threadfence();
    const u64 old = atomicAdd(counter, 1ull);
    *last = (old % blocks) == blocks - 1;
    return old / blocks + 1;
}

// True in every thread of the CTA that arrives last at `counter` (which that CTA resets for the next launch of the
// phase): a generation-free grid arrival. Fences on both sides of the atomic make every CTA's stores visible to
// whatever the last CTA publishes next: at system scope where that goes to other processes or GPUs (`system`), at GPU
// scope where every reader runs on this GPU in this process (one rank; a host mirror fences on its own). Call it from
// every thread of every CTA (it synchronizes the CTA).
__device__ __forceinline__ bool last_cta(u64* counter, bool system = true) {
    __shared__ u32 is_last;
    if (system) __threadfence_system();
    else __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const u64 old = atomicAdd(counter, 1ull);
        is_last = old == gridDim.x - 1;
        if (is_last) {
            atomicExch(counter, 0ull);
            if (system) __threadfence_system();
            else __threadfence();
        }
    }
    __syncthreads();
    return is_last != 0;
}

}  // namespace gc_moe
