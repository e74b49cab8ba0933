// Error record a kernel writes instead of hanging or trapping (a trap would poison the whole CUDA context).
// The host reads it after the launch (gc_moe_compat/runtime/status.py) and raises with the fields below.
#pragma once

namespace gc_moe {

enum StatusCode : unsigned int {
    kStatusOk = 0,
    kStatusTimeout = 1,   // a bounded spin-wait ran out of time
    kStatusMismatch = 2,  // a counter or payload did not hold the value the protocol requires
};

// 32 bytes; mirrored by runtime/status.py (KernelStatus). The first error wins.
struct KernelStatus {
    unsigned int code;
    unsigned int site;  // kernel-defined location of the failing check
    unsigned long long observed;
    unsigned long long expected;
    unsigned long long reserved;
};
static_assert(sizeof(KernelStatus) == 32, "KernelStatus must match runtime/status.py");

__device__ __forceinline__ void report_status(KernelStatus* status, unsigned int code, unsigned int site,
                                              unsigned long long observed, unsigned long long expected) {
    if (atomicCAS(&status->code, (unsigned int)kStatusOk, code) == kStatusOk) {
        status->site = site;
        status->observed = observed;
        status->expected = expected;
        __threadfence_system();
    }
}

}  // namespace gc_moe
