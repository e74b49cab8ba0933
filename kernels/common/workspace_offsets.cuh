// By-value byte offsets of every region of the operator's symmetric workspace (NO_REGION = ~0 for a region
// the layout lacks), plus the ring sizes, and the index of each role's KernelStatus record in the status region.
// Generated from gc_moe_compat/operator/workspace.py (WorkspaceOffsets.c_declaration(),
// StatusRecord.c_declaration()); tests/operator/test_role3_finalize_host.py fails when they differ.
#pragma once

namespace gc_moe {

struct WorkspaceOffsets {
    unsigned long long x;
    unsigned long long x_sf;
    unsigned long long topk_idx;
    unsigned long long topk_weights;
    unsigned long long tag1_barrier;
    unsigned long long replay_seq;
    unsigned long long recv_parity;
    unsigned long long send_counts;
    unsigned long long recv_counts;
    unsigned long long combine_ready;
    unsigned long long finalize_arrive;
    unsigned long long src_index;
    unsigned long long pool_header;
    unsigned long long pool_table;
    unsigned long long role2_schedule;
    unsigned long long l1_acts;
    unsigned long long l1_acts_sf;
    unsigned long long l1_routing_weights;
    unsigned long long l1_source;
    unsigned long long l1_full_count;
    unsigned long long l1_empty_count;
    unsigned long long l2_full_mask;
    unsigned long long l2_empty_count;
    unsigned long long l2_acts;
    unsigned long long l2_acts_sf;
    unsigned long long shared_l2_acts;
    unsigned long long shared_l2_acts_sf;
    unsigned long long combine;
    unsigned long long status;
    unsigned int capacity;
    unsigned int ring_rows;
    unsigned int ring_blocks;
    unsigned int pool_blocks;
};
static_assert(sizeof(WorkspaceOffsets) == 248, "WorkspaceOffsets must match gc_moe_compat/operator/workspace.py");

// Generated from gc_moe_compat.operator.workspace.StatusRecord.
enum StatusRecord : unsigned int {
    kRole1Record = 0,
    kRole2Record = 1,
    kRole3Record = 2,
    kRole4Record = 3,
};

}  // namespace gc_moe
