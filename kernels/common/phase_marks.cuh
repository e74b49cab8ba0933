// Phase marks of a kernel's phase-timed variant (built with its file's GC_*_PHASES define; read by the benchmarks'
// phase readers, bench/_phase_marks.py): at a mark the CTA synchronizes its threads, then thread 0 stores
// %globaltimer into times[(direction * kCtas + CTA) * kMarks + mark], `times` being the variant's device-pointer
// global, which the host points at its buffer (nothing is stored while it is null, nor by CTAs past kCtas). A mark is
// when the CTA's slowest warp got there. The production builds define no global and call no mark.
#pragma once

#include "common/sync.cuh"

namespace gc_moe {

template <u32 kMarks, u32 kCtas>
__device__ __forceinline__ void store_phase_mark(u64* times, u32 direction, u32 mark) {
    __syncthreads();
    if (times && threadIdx.x == 0 && blockIdx.x < kCtas)
        times[(static_cast<u64>(direction) * kCtas + blockIdx.x) * kMarks + mark] = globaltimer_ns();
}

}  // namespace gc_moe
