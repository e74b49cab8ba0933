// By-value peer address table: kernels reach rank r's copy of a symmetric workspace at base + offsets[r].
// Mirrored byte for byte by gc_moe_compat/runtime/workspace.py (PeerTable, 592 bytes, up to 72 ranks).
#pragma once

namespace gc_moe {

constexpr int kMaxPeers = 72;

struct PeerTable {
    unsigned long long base;       // this rank's workspace address
    long long offsets[kMaxPeers];  // rank r's mapping of the workspace, relative to base
    int rank;                      // own rank index
    int world_size;
};
static_assert(sizeof(PeerTable) == 592, "PeerTable must match runtime/workspace.py");

// Address of byte `offset` of rank `r`'s workspace, as mapped in this process.
template <typename T>
__device__ __forceinline__ T* peer_ptr(const PeerTable& table, int r, unsigned long long offset) {
    return reinterpret_cast<T*>(table.base + table.offsets[r] + offset);
}

}  // namespace gc_moe
