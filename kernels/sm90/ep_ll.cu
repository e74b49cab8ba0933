// Low-latency expert-parallel dispatch and combine behind the deep_ep facade (DeepEP's low_latency_dispatch /
// low_latency_combine semantics). Two entry points, gc_moe::ep_ll::dispatch and gc_moe::ep_ll::combine (one kernel
// name per direction, as DeepEP's bench_kineto expects), each running its direction's send half and receive half as
// EpLlParams.phase says: kLlPhaseBoth runs both in one launch (a call without a receive hook, as DeepEP's own kernels
// do: send, then wait for the words and receive), kLlPhaseSend / kLlPhaseRecv one half each (a call with a receive
// hook: the hook launches the receive half later, DeepEP's contract).
//
// Workspace (symmetric, one copy per rank; offsets in EpLlParams). Every persistent word is generation-tagged and
// indexed by the generation's parity, so replays need no host reset and two calls of a kind may be in flight:
//   seq[2]                    last generation taken by dispatch send / combine send (combine receive at one rank)
//                             (this rank only)
//   arrive[4][2]              grid arrival counter per half (LlKernel) and parity (this rank only; the last CTA
//                             resets it); a fused launch arrives at both of its direction's, as it reports
//                             into both halves' status records (at one rank none: the checker CTA stands in)
//   consumed[2][2]            last generation whose stage this rank has read, per direction and parity (read by peers)
//   ready[P][2]               combine readiness of source rank q for this rank (written by q)
//   mask[P]                   u32, this rank's rank mask (DeepEP's shrink mode; read only with kLlShrink)
//   counts[E][2]              (generation << 32) | rows of (local expert le, source q) at le*P + q (written by q)
//   recv stage [2][e][P][Tmax] rows of 16 bytes (token, slot) + payload (BF16 row, or FP8 row + FP32 1x128 scales)
//   combine stage [2][Tmax][k] BF16 rows, on the tokens' source rank
//   (zero-copy combine send rows [e][P*Tmax][H] BF16 follow, when the host uses them: they are a plain input here)
//
// Routing: an entry of topk_idx is -1 (unused), an expert in [0, E), or invalid: outside [-1, E), or an expert an
// earlier slot of the same token already names (a stage list holds at most Tmax rows: one per token). Invalid
// entries are dropped (never used as an address) and reported in the status record. Dispatch send writes into
// EpLlParams.routing (int32 [2][T, k], which the handle keeps for the combine) the checked routing (-1 where dropped),
// then each slot's row in its expert's list of this rank's rows (-1 where no row was sent: a dropped slot, a masked
// owner, a CTA whose wait failed); combine receive sums a slot only where the caller's entry equals the checked one,
// the weight is finite and the owner is not masked (a differing entry or a non-finite weight is reported and
// dropped), and on the direct path only where a row was sent.
//
// One rank (the direct path, world_size 1): no peer, so no stage and no wait. Dispatch send stores each slot's row
// straight into recv_x (its scales into recv_scales, its source into src_info / src_route) at the row the receive
// would give it (one source: the row in the expert's list); combine receive reads each slot's row of x in place, at
// the row the dispatch's routing names. A dispatch is then its send half and a combine its receive half, each run by
// the direction's first launch (fused, or a hooked call's send launch: a hook's launch returns at once), so each byte
// moves once instead of through a stage, and no CTA waits on a word. Nor does any CTA wait for the others: the grid's
// last CTA is a checker (direct_checker; with a grid of one CTA, that CTA after its share of the work) which
// re-derives from the caller's inputs what every other CTA decides (the checked routing and the rows per expert;
// the combine's slot decisions), is the only one to report a dropped input, writes recv_count, layout_range and the
// statistics (dispatch), takes and stores seq and call_gen and mirrors the status records, while the other CTAs move
// the rows; no arrival counter is used. The ordering and co-residency rules below are those of more than one rank.
//
// Ordering (n = the call's generation, p = n & 1):
//  * dispatch send, a CTA per token (or column part of it: send_parts): waits (bounded) until consumed[0][p] on
//    every rank >= n - 2, so the stages it overwrites were read; stores the token's row (its part) for each slot into
//    the slot owner's stage (peer bulk copies, which their issuing threads wait to complete before the arrival) at
//    the row given by the earlier entries with that expert. The grid's last CTA (fences around the arrival atomic:
//    every CTA's rows and checked routing precede it) counts the rows per expert from the checked routing and stores
//    counts[le*P + own][p] = (n << 32) | rows on every owner with st.release.sys.
//  * dispatch receive: a CTA owns whole local experts (expert_split); a thread per (expert, source) acquires its
//    count once (ld.acquire.sys, wait until the tag reaches n; a later tag is a protocol error), and the CTA
//    bar.syncs before any thread reads the stage; its warps then share the experts' rows. The grid's last CTA
//    (fence.sys before and after the arrival atomic) stores consumed[0][p] = n with st.release.sys.
//  * combine send: the same split; a thread per source rank with rows in the CTA's experts waits until
//    consumed[1][p] on that rank >= n - 2, the warps store the rows, and the last CTA stores ready[own][p] = n on
//    every rank with st.release.sys (after the arrival fences: every CTA's rows precede it).
//  * combine receive: threads acquire ready[q][p] >= n for every q and bar.sync before the reduction; the last CTA
//    stores consumed[1][p] = n.
//  * The generation of a call: send halves read seq at their start and the last CTA stores seq = n and the call's
//    own word call_gen = n. A receive launch (kLlPhaseRecv) reads call_gen (stream order: it runs after the send
//    launch); a fused launch's call_gen is never read (the host gives every unhooked combine one shared word). A
//    fused launch's receive half takes the n its own CTA's send half computed: every CTA reads seq before its
//    arrival and the last CTA stores seq after every arrival, so the grid agrees on n, while call_gen may not be
//    stored yet when another CTA starts receiving.
//  * A fused launch's receive half has no launch boundary after the send half: it reads nothing the send half wrote
//    except through the words above. Its own rank's stage rows are ordered like a peer's, by the counts / ready word
//    the send half's last CTA publishes after every CTA's arrival; the checked routing is read only by the send
//    half's last CTA (after the arrival) and by a later combine. A rank mask a send half's timeout sets (kLlShrink) is
//    seen by the combine receive (unless its own rank is masked, it acquires its own rank's ready word, published
//    after every send-half arrival, before the bar.sync that precedes its slot decisions); a dispatch receive thread
//    sees it once visible, and a source whose count it acquired first is received (its rows are complete: it
//    published them).
// Every wait is bounded by timeout_ns and gives up once the phase's status record holds a timeout; a failed wait
// leaves its words unpublished (so consumers report too) and every kernel still completes.
//
// Co-residency (kLlPhaseBoth): receiving CTAs spin on words that the grid's own last CTA publishes (its rank's counts
// or ready word), so every CTA of the grid must be resident at once: a waiting CTA must never hold the SM that a CTA
// of its grid that has not started needs. The host's fused grid (ep_ll.fused_grid) is the larger of the two halves'
// grids, so at most the SMs the launch may use, like theirs: the device's, the rank's share where ranks share the GPU
// (their kernels together then fill each SM at most once), or the communication partition's; and one CTA fits an
// empty SM (__launch_bounds__: at most 128 registers a thread, two CTAs of either kernel fit; static shared memory
// under 48 KiB, which the compile test checks). Work on other streams only delays CTAs (it
// completes without these kernels); as the shared-GPU rule does, this assumes one low-latency kernel of a rank
// resident at a time. Each half loops over its
// work with a grid stride (a CTA without work in a half only arrives), so one grid serves both. Every launch path
// meets the bound, so only a receive hook keeps the two launches.
//
// Rank masking (kLlShrink, DeepEP's enable_shrink): a rank whose mask word is set is neither waited for nor sent to;
// its rows count as zero and its experts' combine slots are skipped. A wait on an unmasked rank that times out masks
// that rank (DeepEP's rule) instead of recording a timeout. Without kLlShrink a timeout is recorded (naming the rank).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "common/peer_table.cuh"
#include "common/phase_marks.cuh"
#include "common/status.cuh"
#include "common/sync.cuh"
#include "sm90/ep_ll_params.cuh"
#include "sm90/ptx.cuh"

#ifdef GC_EP_LL_PHASES
// Outside the anonymous namespace, so that the cubin names it plainly (cuLibraryGetGlobal looks it up by name).
__device__ unsigned long long* gc_ep_ll_phase_times;
#endif

namespace {

using gc_moe::EpLlParams;
using gc_moe::KernelStatus;
using gc_moe::PeerTable;
using gc_moe::peer_ptr;
using gc_moe::u32;
using gc_moe::last_cta;
using gc_moe::u64;
typedef unsigned char u8;

constexpr u32 kThreads = 256;
constexpr u32 kWarps = kThreads / 32;
constexpr u32 kCombineColumns = 256;  // combine receive: one warp, 8 BF16 columns (16 bytes) per lane
constexpr u32 kCombineUnroll = 8;     // combine receive: slots' loads in flight per lane
constexpr u32 kCopyUnroll = 8;        // 16-byte vectors in flight per lane in the row copies
constexpr u32 kSendUnroll = 4;        // dispatch send: a row's 16-byte vectors (and routing ids) in flight per thread
constexpr u32 kBatch = kThreads * kSendUnroll;  // dispatch send: a pass's vectors, a batch's routing ids (load_ids)
constexpr u32 kMinPartGroups = 8;  // dispatch send: scale groups (128 columns) of a column part, at least (send_parts)
constexpr u32 kMaxTopk = 32;          // routing slots per token (EpLlParams.topk)
constexpr u32 kMaxExperts = 1024;     // global experts (the count table's rows per parity, EpLlParams)

#ifdef GC_EP_LL_PHASES
// Phase timing, in the variant bench/_ep_ll_phases.py builds (GC_EP_LL_PHASES defined: the marks go to
// gc_ep_ll_phase_times, common/phase_marks.cuh). Dispatch's marks: entry, the token's routing checked, the prefix
// count of its rows done, its slots' rows placed, its row's copies complete, exit (a CTA with several tokens keeps
// its last token's, one without a token marks 1-4 where its token loop ends); at one rank the checker CTA's marks 1-4
// are its own: its table cleared, the routing counted, the counts published, the status mirrored (a lone CTA keeps
// the checker's). Combine's: entry, the CTA's units summed (one rank: the checker's slots decided again), exit; at more
// ranks the send half lies between the entry and mark 1. The production build has no global and no marks.
constexpr u32 kPhaseMarks = 6;
constexpr u32 kPhaseCtas = 512;

__device__ __forceinline__ void phase_mark(u32 direction, u32 mark) {
    gc_moe::store_phase_mark<kPhaseMarks, kPhaseCtas>(::gc_ep_ll_phase_times, direction, mark);
}
#else
__device__ __forceinline__ void phase_mark(u32, u32) {}
#endif
constexpr u32 kDispatchPhases = 0, kCombinePhases = 1;  // phase_mark's directions

// Outcome of a wait on a peer's word.
enum Wait : u32 {
    kArrived = 0,  // the word reached its target
    kMasked = 1,   // the rank is masked (before the wait, or by its timeout in shrink mode): skip it
    kFailed = 2,   // timed out (recorded) or an error was already recorded: give up
};

__device__ __forceinline__ u64* word(const PeerTable& pt, u64 offset) {
    return reinterpret_cast<u64*>(pt.base + offset);
}

__device__ __forceinline__ KernelStatus* status_of(const PeerTable& pt, const EpLlParams& p, gc_moe::LlKernel k) {
    return reinterpret_cast<KernelStatus*>(pt.base + p.off_status) + k;
}

__device__ __forceinline__ u32* mask_word(const PeerTable& pt, const EpLlParams& p, u32 rank) {
    return reinterpret_cast<u32*>(pt.base + p.off_mask) + rank;
}

// True when shrink mode is on and `rank` is masked in this rank's mask.
__device__ __forceinline__ bool is_masked(const PeerTable& pt, const EpLlParams& p, u32 rank) {
    return (p.flags & gc_moe::kLlShrink) && *reinterpret_cast<volatile u32*>(mask_word(pt, p, rank)) != 0;
}

// Spins until *flag >= target (acquire, system scope), the wait of `rank`'s word. Gives up after timeout_ns (shrink
// mode: masks `rank`; otherwise records the timeout at `site`) or once `status` holds a timeout (a dropped input,
// also recorded there, does not stop the others' waits). On kArrived, `*value` (when given) is the word as the
// arriving acquire read it: callers check it instead of paying a second serialized ld.acquire.sys round trip.
__device__ __forceinline__ Wait wait_rank(const PeerTable& pt, const EpLlParams& p, const u64* flag, u64 target,
                                          KernelStatus* status, u32 site, u32 rank, u64* value = nullptr) {
    if (is_masked(pt, p, rank)) return kMasked;
    const u64 start = gc_moe::globaltimer_ns();
    u64 seen = gc_moe::ld_acquire_sys(flag);
    if (value) *value = seen;
    while (seen < target) {
        if (is_masked(pt, p, rank)) return kMasked;
        if (*reinterpret_cast<volatile u32*>(&status->code) == gc_moe::kStatusTimeout) return kFailed;
        if (gc_moe::globaltimer_ns() - start > p.timeout_ns) {
            if (p.flags & gc_moe::kLlShrink) {
                atomicExch(mask_word(pt, p, rank), 1u);
                return kMasked;
            }
            gc_moe::report_status(status, gc_moe::kStatusTimeout, site, seen, target);
            return kFailed;
        }
        __nanosleep(GC_MOE_SPIN_SLEEP_NS);
        seen = gc_moe::ld_acquire_sys(flag);
        if (value) *value = seen;
    }
    return kArrived;
}

// The calling thread waits until `rank` has read generation n - 2 of this parity's stage in direction `dir`
// (0 dispatch, 1 combine).
__device__ __forceinline__ Wait wait_consumed(const PeerTable& pt, const EpLlParams& p, u32 rank, u32 dir, u64 gen,
                                              KernelStatus* status) {
    if (gen > 2) {
        const u64* flag = peer_ptr<u64>(pt, rank, p.off_consumed + (dir * 2 + (gen & 1)) * 8);
        return wait_rank(pt, p, flag, gen - 2, status, gc_moe::kLlSiteConsumed << 16 | rank, rank);
    }
    return is_masked(pt, p, rank) ? kMasked : kArrived;
}

// Routing entry f of p.topk_idx as given (int64: DeepEP's topk_idx_t, the only dtype the host passes).
__device__ __forceinline__ long long raw_id(const EpLlParams& p, u32 f) {
    return reinterpret_cast<const long long*>(p.topk_idx)[f];
}

// Whether entry f (whose raw id is the valid expert e) is the first of its token's slots naming e, i.e. its checked
// expert is e (checked_expert's repeat rule); `token` holds the raw ids of its token.
__device__ __forceinline__ bool first_in_token(const EpLlParams& p, u32 f, long long e, const long long* token) {
    for (u32 g = 0; g < f % p.topk; ++g)
        if (token[g] == e) return false;
    return true;
}

// The checked expert of routing entry f of p.topk_idx, whose raw id `e` the caller loaded: -1 for an unused slot or
// a dropped one (an id outside [-1, num_experts), or the expert of an earlier slot of the same token), recorded in
// `status` when given. `token` holds the raw ids of f's token, slot 0 first: p.topk_idx itself, or a copy in shared
// memory (dispatch send), so that the repeat rule costs no round trip there.
__device__ __forceinline__ int checked_expert(const EpLlParams& p, u32 f, long long e, KernelStatus* status,
                                              const long long* token) {
    if (e == -1) return -1;
    if (e < -1 || e >= static_cast<long long>(p.num_experts)) {
        if (status) {
            if (e < 0) {
                gc_moe::report_status(status, gc_moe::kStatusMismatch, gc_moe::kLlSiteExpertNegative << 16,
                                      static_cast<u64>(-e), 1);
            } else {
                gc_moe::report_status(status, gc_moe::kStatusMismatch, gc_moe::kLlSiteExpertRange << 16,
                                      static_cast<u64>(e), p.num_experts);
            }
        }
        return -1;
    }
    if (!first_in_token(p, f, e, token)) {
        if (status) gc_moe::report_status(status, gc_moe::kStatusMismatch, gc_moe::kLlSiteExpertRepeat << 16,
                                          static_cast<u64>(e), f % p.topk);
        return -1;
    }
    return static_cast<int>(e);
}

// The raw ids of the token of routing entry f, in p.topk_idx.
__device__ __forceinline__ const long long* token_ids(const EpLlParams& p, u32 f) {
    return reinterpret_cast<const long long*>(p.topk_idx) + (f - f % p.topk);
}

// The checked expert of routing entry f (checked_expert of its raw id).
__device__ __forceinline__ int slot_expert(const EpLlParams& p, u32 f, KernelStatus* status = nullptr) {
    return checked_expert(p, f, raw_id(p, f), status, token_ids(p, f));
}

// Copies the four status records into the pinned host mirror (the last CTA of each receive half; at one rank the
// checker of each direction), so that the host sees errors of asynchronous, hooked and graph-replayed calls without
// synchronizing.
__device__ __forceinline__ void mirror_status(const PeerTable& pt, const EpLlParams& p) {
    constexpr u32 kWords = 4 * sizeof(KernelStatus) / 4;
    if (p.status_mirror && threadIdx.x < kWords) {
        const volatile u32* src = reinterpret_cast<const volatile u32*>(pt.base + p.off_status);
        reinterpret_cast<volatile u32*>(p.status_mirror)[threadIdx.x] = src[threadIdx.x];
    }
    __threadfence_system();
}

__device__ __forceinline__ float bf16_lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }

// DeepEP's FP8 scale rule: amax floored at 1e-4; scale = 448 / amax, stored inverse = amax * (1/448), or both
// rounded to the power of two at or above the inverse.
__device__ __forceinline__ void fp8_scales(float amax, bool round_scale, float& scale, float& scale_inv) {
    scale_inv = amax * (1.0f / 448.0f);
    scale = 448.0f / amax;
    if (round_scale) {
        const u32 bits = __float_as_uint(scale_inv);
        const int exp = static_cast<int>((bits >> 23) & 0xff) - 127 + ((bits & 0x7fffff) != 0);
        scale_inv = __uint_as_float(static_cast<u32>(exp + 127) << 23);
        scale = __uint_as_float(static_cast<u32>(127 - exp) << 23);
    }
}

// Four E4M3 bytes, a first (lowest), two conversions of a pair each.
__device__ __forceinline__ u32 fp8x4(float a, float b, float c, float d) {
    const u32 lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
    const u32 hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
    return lo | hi << 16;
}

// The E4M3 quantization of one 16-byte vector (8 BF16 columns) of a row, DeepEP's rule. Each lane holds 8 columns,
// so a 128-column scale group is a half warp: the amax is reduced over 16 lanes (every lane must call this).
__device__ __forceinline__ uint2 quantize_vector(const uint4 raw, bool round_scale, float& scale_inv) {
    const float f[8] = {bf16_lo(raw.x), bf16_hi(raw.x), bf16_lo(raw.y), bf16_hi(raw.y),
                        bf16_lo(raw.z), bf16_hi(raw.z), bf16_lo(raw.w), bf16_hi(raw.w)};
    float amax = 1e-4f;
#pragma unroll
    for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(f[j]));
#pragma unroll
    for (int o = 8; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(~0u, amax, o));
    float scale;
    fp8_scales(amax, round_scale, scale, scale_inv);
    return make_uint2(fp8x4(f[0] * scale, f[1] * scale, f[2] * scale, f[3] * scale),
                      fp8x4(f[4] * scale, f[5] * scale, f[6] * scale, f[7] * scale));
}

// A warp copies `count` 16-byte vectors with kCopyUnroll loads in flight per lane (all loads, then all stores).
__device__ __forceinline__ void copy_vectors(uint4* dst, const uint4* src, u32 count, u32 lane) {
    for (u32 v0 = lane; v0 < count; v0 += 32 * kCopyUnroll) {
        uint4 r[kCopyUnroll];
#pragma unroll
        for (u32 i = 0; i < kCopyUnroll; ++i)
            if (v0 + 32 * i < count) r[i] = src[v0 + 32 * i];
#pragma unroll
        for (u32 i = 0; i < kCopyUnroll; ++i)
            if (v0 + 32 * i < count) dst[v0 + 32 * i] = r[i];
    }
}

// One pass of a token row's loads in dispatch send: vector first + i * kThreads + warp * 32 + lane into raw[i] (zero
// from `end` on), all in flight at once. first and end are multiples of 16: a half warp is all before `end` or all
// past it.
__device__ __forceinline__ void load_row_pass(uint4 (&raw)[kSendUnroll], const uint4* src, u32 first, u32 end) {
#pragma unroll
    for (u32 i = 0; i < kSendUnroll; ++i) {
        const u32 v = first + i * kThreads + threadIdx.x;
        raw[i] = v < end ? __ldg(src + v) : make_uint4(0, 0, 0, 0);
    }
}

// Dispatch send's column parts: with fewer tokens than sending CTAs, `parts` CTAs share a token's row, each
// quantizing and copying a range of whole scale groups (all but the last at least kMinPartGroups) to every slot, so
// that a small batch's rows leave through several SMs; one part per token when the tokens fill the senders.
struct SendParts {
    u32 parts;        // CTAs per token
    u32 stride;       // tokens in flight: the CTAs' token step
    u32 part;         // this CTA's part (0 writes the token's routing, headers and sources)
    u32 first, end;   // its vectors of the row
};

__device__ __forceinline__ SendParts send_parts(u32 senders, u32 num_tokens, u32 vecs) {
    const u32 groups = vecs / 16;
    const u32 parts = max(1u, min(senders / max(1u, num_tokens), groups / kMinPartGroups));
    const u32 part = blockIdx.x % parts, part_groups = (groups + parts - 1) / parts;
    return {parts, senders / parts, part, min(vecs, part * part_groups * 16), min(vecs, (part + 1) * part_groups * 16)};
}

// Routing entries f0 + i * kThreads (those below `end`; -1 past it) of p.topk_idx into ids, all in flight at once.
__device__ __forceinline__ void load_ids(const EpLlParams& p, long long (&ids)[kSendUnroll], u32 f0, u32 end) {
#pragma unroll
    for (u32 i = 0; i < kSendUnroll; ++i) ids[i] = f0 + i * kThreads < end ? raw_id(p, f0 + i * kThreads) : -1;
}

// The raw ids of the token of routing entry f: in `batch` (a copy in shared memory of the entries from `base` on)
// when the token starts there, otherwise in p.topk_idx; so that the repeat rule reads no global memory for a token
// inside the batch.
__device__ __forceinline__ const long long* batch_token(const EpLlParams& p, u32 f, const long long* batch, u32 base) {
    const u32 first = f - f % p.topk;
    return first >= base ? batch + (first - base) : token_ids(p, f);
}

// The slot of the current token whose checked expert is the raw id e, or -1 (none, or e not a valid expert): two
// shared-memory reads, no loop over the slots (the slots' valid experts are distinct).
__device__ __forceinline__ int slot_named(const EpLlParams& p, long long e, const int* slot_of,
                                          const u8* slot_of_expert) {
    if (e < 0 || e >= static_cast<long long>(p.num_experts)) return -1;
    const u32 k = slot_of_expert[e];
    return k < p.topk && slot_of[k] == e ? static_cast<int>(k) : -1;
}

// A batch of routing ids copied to shared memory: entry base + j in batch[j] (kSendUnroll per thread, as load_ids
// holds them). Every thread of the CTA calls it; the caller synchronizes again before the next batch overwrites it.
__device__ __forceinline__ void stage_ids(long long* batch, const long long (&ids)[kSendUnroll]) {
#pragma unroll
    for (u32 i = 0; i < kSendUnroll; ++i) batch[i * kThreads + threadIdx.x] = ids[i];
    __syncthreads();
}

// Stores the scale of group g (128 columns) of a dispatched FP8 row whose scales start at `base`: the stage's FP32
// words after the payload, or (direct) the row's column of recv_scales, column-major per local expert with `slots`
// rows: FP32 words, or UE8M0 bytes four groups a word (the layouts dispatch receive packs).
__device__ __forceinline__ void store_scale(u8* base, u32 g, float scale_inv, bool direct, bool ue8m0, u64 slots) {
    if (!direct) {
        reinterpret_cast<float*>(base)[g] = scale_inv;
    } else if (ue8m0) {
        base[static_cast<u64>(g / 4) * slots * 4 + g % 4] = static_cast<u8>((__float_as_uint(scale_inv) >> 23) & 0xff);
    } else {
        *reinterpret_cast<float*>(base + static_cast<u64>(g) * slots * 4) = scale_inv;
    }
}

// Direct path (one rank): the grid's CTAs that move rows (all but the checker, the last CTA; one CTA does both), and
// whether this CTA is the checker.
__device__ __forceinline__ u32 direct_movers() { return gridDim.x > 1 ? gridDim.x - 1 : 1; }
__device__ __forceinline__ bool direct_checker() { return blockIdx.x == gridDim.x - 1; }

// Returns the call's generation n (the one this CTA read from seq).
__device__ __forceinline__ u64 dispatch_send(const PeerTable& pt, const EpLlParams& p) {
    __shared__ long long slot_raw[kMaxTopk];  // the current token's raw ids
    __shared__ long long batch_ids[kBatch];   // a batch of routing ids (stage_ids)
    __shared__ alignas(128) uint4 row_stage[kBatch];  // a pass of the token's row as sent (BF16, or E4M3 packed)
    __shared__ float pass_scales[kBatch / 16];        // that pass's FP8 scales, one a group of 128 columns
    __shared__ int slot_of[kMaxTopk];      // the current token's checked experts (-1: unused or dropped)
    __shared__ u8 slot_of_expert[kMaxExperts];  // expert e's slot k in the current token where slot_of[k] == e (any
                                                // other entry is stale or unset: slot_named rejects it)
    __shared__ u32 slot_row[kMaxTopk];     // its row in each expert's list: earlier entries with that expert
    __shared__ u8* slot_dst[kMaxTopk];     // that row's payload in the owner's receive stage, or (direct) in recv_x
                                           // (null: unused, or owner masked)
    __shared__ u8* slot_scales[kMaxTopk];  // where that row's FP8 scales start (store_scale)
    __shared__ u32 rows_of[kMaxExperts];   // last CTA: rows per global expert
    KernelStatus* status = status_of(pt, p, gc_moe::kDispatchSend);
    u64* seq = word(pt, p.off_seq);
    const u64 gen = *reinterpret_cast<volatile u64*>(seq) + 1;
    const u32 parity = static_cast<u32>(gen & 1);
    const u32 ranks = static_cast<u32>(pt.world_size), own = static_cast<u32>(pt.rank);
    const u32 k_slots = p.topk, entries = p.num_tokens * p.topk, vecs = p.hidden / 8;
    const bool fp8 = p.flags & gc_moe::kLlFp8, round_scale = p.flags & gc_moe::kLlRoundScale;
    const bool ue8m0 = p.flags & gc_moe::kLlUe8m0, direct = ranks == 1;
    const u64 slots = p.max_tokens;  // rows per local expert in recv_x at one rank (direct)
    // The CTAs that send tokens (direct: all but the checker), `parts` a token (send_parts), grid-strided. A token's
    // part 0 writes its routing, headers and sources and reports its dropped entries; direct, none reports (the
    // checker reports every dropped entry).
    const u32 senders = direct ? direct_movers() : gridDim.x;
    const SendParts sp = send_parts(senders, p.num_tokens, vecs);
    const bool lead = sp.part == 0, sending = blockIdx.x < sp.stride * sp.parts;
    const u32 first_token = blockIdx.x / sp.parts;
    KernelStatus* report = direct || !lead ? nullptr : status;
    // The first token's row loads go out before the wait and the routing work, which hide their latency.
    uint4 raw[kSendUnroll];
    if (first_token < p.num_tokens && sending)
        load_row_pass(raw, reinterpret_cast<const uint4*>(p.x) + static_cast<u64>(first_token) * vecs, sp.first,
                      sp.end);
    // Every stage this CTA may write must have been read two generations back (bounded wait, usually satisfied; none
    // on the direct path).
    bool ok = true;
    for (u32 q = threadIdx.x; q < ranks && gen > 2 && !direct; q += kThreads) {
        const u64* flag = peer_ptr<u64>(pt, q, p.off_consumed + (0 * 2 + parity) * 8);
        ok = wait_rank(pt, p, flag, gen - 2, status, gc_moe::kLlSiteConsumed << 16 | q, q) != kFailed && ok;
    }
    ok = __syncthreads_and(ok);
    for (u32 t = first_token; t < p.num_tokens && sending; t += sp.stride) {
        const uint4* src = reinterpret_cast<const uint4*>(p.x) + static_cast<u64>(t) * vecs;
        // One round trip for the routing: the token's own ids (copied to shared memory, where the repeat rule reads
        // them) and the first batch of the earlier tokens' ids, all in flight together.
        const u32 earlier = t * k_slots;
        if (threadIdx.x < k_slots) slot_raw[threadIdx.x] = raw_id(p, earlier + threadIdx.x);
        long long ids[kSendUnroll];
        load_ids(p, ids, threadIdx.x, earlier);
        __syncthreads();
        if (threadIdx.x < k_slots) {
            const int e = checked_expert(p, earlier + threadIdx.x, slot_raw[threadIdx.x], report, slot_raw);
            slot_of[threadIdx.x] = e;
            if (e >= 0) slot_of_expert[e] = static_cast<u8>(threadIdx.x);
            slot_row[threadIdx.x] = 0;
            if (lead) reinterpret_cast<int*>(p.routing)[earlier + threadIdx.x] = e;  // the handle's checked routing
            if (lead && !ok) reinterpret_cast<int*>(p.routing)[static_cast<u64>(entries) + earlier + threadIdx.x] = -1;
        }
        __syncthreads();
        phase_mark(kDispatchPhases, 1);
        if (!ok) continue;  // CTA-uniform; the routing is still written, the rows are not
        // Checked entries f < t*k + slot with the slot's expert, counted by the whole CTA: rows are in (token, slot)
        // order. A valid slot's expert is named by no earlier slot of token t, so only earlier tokens count, each
        // once (the first of its slots naming the expert). The repeat rule is looked at only for an entry that
        // names one of the slots' experts.
        for (u32 base = 0; base < earlier; base += kBatch) {
            if (base > 0) load_ids(p, ids, base + threadIdx.x, earlier);
            stage_ids(batch_ids, ids);
#pragma unroll
            for (u32 i = 0; i < kSendUnroll; ++i) {
                const int k = slot_named(p, ids[i], slot_of, slot_of_expert);
                if (k < 0) continue;
                const u32 f = base + i * kThreads + threadIdx.x;
                if (first_in_token(p, f, ids[i], batch_token(p, f, batch_ids, base))) atomicAdd(&slot_row[k], 1u);
            }
            __syncthreads();  // batch_ids is rewritten by the next batch
        }
        __syncthreads();
        phase_mark(kDispatchPhases, 2);
        if (threadIdx.x < k_slots) {
            const int e = slot_of[threadIdx.x];
            const u32 j = slot_row[threadIdx.x];
            u8* row = nullptr;
            u8* scales = nullptr;
            const u32 owner = e >= 0 ? static_cast<u32>(e) / p.local_experts : 0;
            if (e >= 0 && !is_masked(pt, p, owner)) {
                const u32 le = static_cast<u32>(e) % p.local_experts;
                if (direct) {  // the row recv_x packs it at: source 0, row j of the expert's list
                    const u64 slot = static_cast<u64>(le) * slots + j;
                    row = reinterpret_cast<u8*>(p.recv_x) + slot * (fp8 ? p.hidden : 2 * p.hidden);
                    const u64 group_rows = static_cast<u64>(le) * (ue8m0 ? p.hidden / 512 : p.hidden / 128) * slots;
                    scales = fp8 ? reinterpret_cast<u8*>(p.recv_scales) + (group_rows + j) * 4 : nullptr;
                    if (lead) {
                        reinterpret_cast<int*>(p.src_info)[slot] = static_cast<int>(t);
                        reinterpret_cast<int*>(p.src_route)[slot] = static_cast<int>(t * k_slots + threadIdx.x);
                    }
                } else {
                    const u64 list = (static_cast<u64>(parity) * p.num_experts + le * ranks + own) * p.max_tokens;
                    row = peer_ptr<u8>(pt, owner, p.off_recv_stage + (list + j) * p.row_stride);
                    if (lead)
                        *reinterpret_cast<int4*>(row) = make_int4(static_cast<int>(t), static_cast<int>(threadIdx.x),
                                                                  0, 0);
                    row += 16;  // the payload follows the (token, slot) header
                    scales = row + p.hidden;
                }
            }
            slot_dst[threadIdx.x] = row;
            slot_scales[threadIdx.x] = scales;
            if (lead)
                reinterpret_cast<int*>(p.routing)[static_cast<u64>(entries) + t * k_slots + threadIdx.x] =
                    row != nullptr ? static_cast<int>(j) : -1;
        }
        __syncthreads();
        phase_mark(kDispatchPhases, 3);
        // The CTA's columns of the row, a pass of kBatch vectors at a time (kSendUnroll per thread in flight),
        // quantized once into shared memory; each slot's part of the pass is then one bulk copy issued by the slot's
        // thread (the TMA unit writes the slots' rows: no store instruction per slot and vector). An FP8 scale group
        // (128 columns) is a half warp; a pass's scales are stored by the threads, a (slot, group) pair each.
        for (u32 pass = sp.first; pass < sp.end; pass += kBatch) {
            if (pass > sp.first) load_row_pass(raw, src, pass, sp.end);
            const u32 pass_vecs = min(kBatch, sp.end - pass), vec_bytes = fp8 ? 8 : 16;
            if (threadIdx.x < k_slots) gc_moe::sm90::bulk_wait_read();  // the last pass's copies read row_stage
            __syncthreads();
#pragma unroll
            for (u32 i = 0; i < kSendUnroll; ++i) {
                const u32 j = i * kThreads + threadIdx.x;  // the vector's place in the pass
                if (!fp8) {
                    if (j < pass_vecs) row_stage[j] = raw[i];
                    continue;
                }
                float scale_inv;
                const uint2 q = quantize_vector(raw[i], round_scale, scale_inv);  // every lane: the amax shuffles
                if (j < pass_vecs) reinterpret_cast<uint2*>(row_stage)[j] = q;
                if (j < pass_vecs && j % 16 == 0) pass_scales[j / 16] = scale_inv;
            }
            gc_moe::sm90::fence_proxy_async_shared();
            __syncthreads();
            if (threadIdx.x < k_slots && slot_dst[threadIdx.x] != nullptr) {
                gc_moe::sm90::bulk_store(slot_dst[threadIdx.x] + static_cast<u64>(pass) * vec_bytes,
                                         gc_moe::sm90::smem_addr(row_stage), pass_vecs * vec_bytes);
                gc_moe::sm90::bulk_commit();
            }
            const u32 groups = fp8 ? pass_vecs / 16 : 0;
            for (u32 j = threadIdx.x; j < groups * k_slots; j += kThreads) {
                const u32 k = j / groups, g = j % groups;
                if (slot_dst[k] != nullptr)
                    store_scale(slot_scales[k], pass / 16 + g, pass_scales[g], direct, ue8m0, slots);
            }
        }
        if (threadIdx.x < k_slots) gc_moe::sm90::bulk_wait_all();  // the rows written before the marks and arrival
        phase_mark(kDispatchPhases, 4);
        // The next token's first loads go out before the barrier.
        if (t + sp.stride < p.num_tokens)
            load_row_pass(raw, src + static_cast<u64>(sp.stride) * vecs, sp.first, sp.end);
        __syncthreads();  // slot_* are rewritten for the next token
    }
    if (first_token >= p.num_tokens || !sending)  // no token here: marks 1-4 where the loop ends
        for (u32 mark = 1; mark <= 4; ++mark) phase_mark(kDispatchPhases, mark);
    if (direct) {
        // One rank: the checker counts the rows per expert from the caller's routing itself (slot_expert, the rule
        // every sender applies), reports each dropped entry, and writes what dispatch receive writes at more ranks:
        // every expert's rows come from source 0 (none when this rank is masked). Nothing waits for the senders.
        if (!direct_checker()) return gen;
        for (u32 e = threadIdx.x; e < p.num_experts; e += kThreads) rows_of[e] = 0;
        __syncthreads();
        phase_mark(kDispatchPhases, 1);
        for (u32 base = 0; base < entries; base += kBatch) {
            long long ids[kSendUnroll];  // all in flight
            load_ids(p, ids, base + threadIdx.x, entries);
            stage_ids(batch_ids, ids);
#pragma unroll
            for (u32 i = 0; i < kSendUnroll; ++i) {
                const u32 f = base + i * kThreads + threadIdx.x;
                const long long* token = batch_token(p, f, batch_ids, base);
                const int e = ids[i] == -1 ? -1 : checked_expert(p, f, ids[i], status, token);
                if (e >= 0) atomicAdd(&rows_of[e], 1u);
            }
            __syncthreads();  // batch_ids is rewritten by the next batch
        }
        __syncthreads();
        phase_mark(kDispatchPhases, 2);
        const bool masked = is_masked(pt, p, own);
        for (u32 le = threadIdx.x; le < p.local_experts; le += kThreads) {
            const int rows = masked ? 0 : static_cast<int>(rows_of[le]);
            reinterpret_cast<int*>(p.recv_count)[le] = rows;
            reinterpret_cast<long long*>(p.layout_range)[le] = rows;  // (first slot 0) << 32 | rows
            if (p.recv_stats) atomicAdd(reinterpret_cast<int*>(p.recv_stats) + le, rows);
        }
        if (threadIdx.x == 0) {
            *seq = gen;
            *reinterpret_cast<u64*>(p.call_gen) = gen;
        }
        __syncthreads();     // every thread's reports precede the mirror
        phase_mark(kDispatchPhases, 3);
        mirror_status(pt, p);  // no receive half follows
        phase_mark(kDispatchPhases, 4);
        return gen;
    }
    // The counts follow every CTA's rows: the last CTA to arrive publishes every expert's (generation, rows), counted
    // from the checked routing every CTA wrote before arriving (the arrival's fences make it visible here).
    if (last_cta(word(pt, p.off_arrive + (gc_moe::kDispatchSend * 2 + parity) * 8))) {
        for (u32 e = threadIdx.x; e < p.num_experts; e += kThreads) rows_of[e] = 0;
        __syncthreads();
        const volatile int* routing = reinterpret_cast<const volatile int*>(p.routing);  // other CTAs' stores
        for (u32 f0 = threadIdx.x; f0 < entries; f0 += kBatch) {
            int es[kSendUnroll];
#pragma unroll
            for (u32 i = 0; i < kSendUnroll; ++i)
                es[i] = f0 + i * kThreads < entries ? routing[f0 + i * kThreads] : -1;
#pragma unroll
            for (u32 i = 0; i < kSendUnroll; ++i)
                if (es[i] >= 0) atomicAdd(&rows_of[es[i]], 1u);
        }
        __syncthreads();
        // A CTA whose wait timed out wrote no rows: leave the counts unpublished so that the owners report it too
        // (a dropped slot is reported, but the other rows are complete and published). Masked owners get nothing.
        if (*reinterpret_cast<volatile u32*>(&status->code) != gc_moe::kStatusTimeout) {
            for (u32 e = threadIdx.x; e < p.num_experts; e += kThreads) {
                const u32 owner = e / p.local_experts, le = e % p.local_experts;
                if (is_masked(pt, p, owner)) continue;
                u64* count = peer_ptr<u64>(pt, owner, p.off_counts + ((le * ranks + own) * 2 + parity) * 8);
                gc_moe::st_release_sys(count, gen << 32 | rows_of[e]);
            }
        }
        if (threadIdx.x == 0) {
            *seq = gen;
            *reinterpret_cast<u64*>(p.call_gen) = gen;
        }
    }
    return gen;
}

// The work split of dispatch receive and combine send (DeepEP's: a warp group per expert): a CTA owns whole local
// experts, so one count (or layout) read per (expert, source) serves all of its rows, and the CTA's warps share the
// rows of the experts it owns (rows dealt round-robin, so no warp serializes more than its share). With at least as
// many CTAs as local experts, expert b % L is owned by `stripes` CTAs (the rows dealt over stripes * kWarps warps);
// otherwise CTA b owns experts b, b + grid, ... Experts are taken in batches of whole experts with at most kThreads
// (expert, source) pairs: thread i holds pair (expert g = i / P of the batch, source q = i % P).
struct ExpertSplit {
    u32 first;    // the CTA's first local expert (local_experts: none)
    u32 step;     // distance between the CTA's experts
    u32 stripes;  // CTAs per expert
    u32 stripe;   // this CTA's stripe of its experts' rows
    u32 batch;    // experts per batch
};

__device__ __forceinline__ ExpertSplit expert_split(u32 local_experts, u32 ranks) {
    ExpertSplit s;
    s.batch = kThreads / ranks;  // ranks <= MAX_RANKS (72) < kThreads
    if (gridDim.x >= local_experts) {
        s.stripes = gridDim.x / local_experts;
        s.stripe = blockIdx.x / local_experts;
        s.first = s.stripe < s.stripes ? blockIdx.x % local_experts : local_experts;
        s.step = local_experts;  // one expert per CTA
    } else {
        s.stripes = 1;
        s.stripe = 0;
        s.first = blockIdx.x;
        s.step = gridDim.x;
    }
    return s;
}

// Exclusive prefix sum over the CTA of one value per thread (thread order), and the CTA's total. Every thread of
// the CTA calls it; it synchronizes the CTA.
__device__ __forceinline__ u32 cta_exclusive_scan(u32 v, u32& total) {
    __shared__ u32 warp_sums[kWarps];
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x / 32;
    u32 inclusive = v;
#pragma unroll
    for (u32 o = 1; o < 32; o <<= 1) {
        const u32 n = __shfl_up_sync(~0u, inclusive, o);
        if (lane >= o) inclusive += n;
    }
    if (lane == 31) warp_sums[warp] = inclusive;
    __syncthreads();
    u32 before = 0;
    total = 0;
#pragma unroll
    for (u32 w = 0; w < kWarps; ++w) {
        const u32 x = warp_sums[w];
        before += w < warp ? x : 0;
        total += x;
    }
    __syncthreads();  // warp_sums is rewritten by the next call
    return before + inclusive - v;
}

// The pair holding row r of the batch: the last i with first_row[i] <= r (first_row: non-decreasing, from 0, over
// kThreads pairs; pairs without rows share their successor's first row and are never returned for a row < total).
__device__ __forceinline__ u32 pair_of_row(const u32* first_row, u32 r) {
    u32 lo = 0, hi = kThreads;
    while (hi - lo > 1) {
        const u32 mid = (lo + hi) / 2;
        if (first_row[mid] <= r) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    return lo;
}

// Receives generation `gen` (receive_generation).
__device__ __forceinline__ void dispatch_recv(const PeerTable& pt, const EpLlParams& p, u64 gen) {
    __shared__ u32 pair_first[kThreads];   // the batch's pairs: first row in the batch's row list
    __shared__ u32 pair_before[kThreads];  // the pair's first slot in its expert's list: rows of earlier sources
    __shared__ u32 expert_bad[kThreads];   // the batch's experts: a source's count failed (no rows, no layout)
    KernelStatus* status = status_of(pt, p, gc_moe::kDispatchRecv);
    const u32 parity = static_cast<u32>(gen & 1), lane = threadIdx.x & 31, warp = threadIdx.x / 32;
    const u32 ranks = static_cast<u32>(pt.world_size);
    const u64 slots = static_cast<u64>(ranks) * p.max_tokens;  // P * Tmax rows per local expert
    const bool fp8 = p.flags & gc_moe::kLlFp8, ue8m0 = p.flags & gc_moe::kLlUe8m0;
    const u32 groups = p.hidden / 128;
    const ExpertSplit split = expert_split(p.local_experts, ranks);
    const u32 g = threadIdx.x / ranks, q = threadIdx.x % ranks;
    for (u32 e0 = split.first; e0 < p.local_experts; e0 += split.batch * split.step) {
        const u32 le = e0 + g * split.step;
        const bool valid = g < split.batch && le < p.local_experts;
        expert_bad[threadIdx.x] = 0;
        __syncthreads();
        // One acquire per (expert, source), all of the batch's in flight at once (a masked source counts zero).
        u32 n = 0;
        if (valid) {
            const u64* count = word(pt, p.off_counts + ((le * ranks + q) * 2 + parity) * 8);
            u64 v = 0;
            const Wait w = wait_rank(pt, p, count, gen << 32, status, gc_moe::kLlSiteCount << 16 | q, q, &v);
            bool pair_ok = w != kFailed;
            if (w == kArrived) {
                if ((v >> 32) != gen) {
                    gc_moe::report_status(status, gc_moe::kStatusMismatch, gc_moe::kLlSiteCountAhead << 16 | q,
                                          v >> 32, gen);
                    pair_ok = false;
                } else if (static_cast<u32>(v) > p.max_tokens) {  // a list holds Tmax rows: never read past it
                    gc_moe::report_status(status, gc_moe::kStatusMismatch, gc_moe::kLlSiteCountRange << 16 | q,
                                          static_cast<u32>(v), p.max_tokens);
                    pair_ok = false;
                } else {
                    n = static_cast<u32>(v);
                }
            }
            if (!pair_ok) expert_bad[g] = 1;
        }
        __syncthreads();  // the threads' acquires precede every thread's stage reads
        const bool ok = valid && !expert_bad[g];
        if (!ok) n = 0;
        u32 total;
        const u32 first = cta_exclusive_scan(n, total);
        pair_first[threadIdx.x] = first;
        __syncthreads();
        const u32 expert_first = pair_first[g * ranks];  // g * ranks <= threadIdx.x
        const u32 before = first - expert_first;
        pair_before[threadIdx.x] = before;
        if (ok && split.stripe == 0) {
            reinterpret_cast<long long*>(p.layout_range)[le * ranks + q] =
                static_cast<long long>(static_cast<u64>(before) << 32 | n);
            if (q == 0) {
                const u32 next = (g + 1) * ranks;  // the next expert's first pair (pairs past the batch hold no rows)
                const int rows = static_cast<int>((next < kThreads ? pair_first[next] : total) - expert_first);
                reinterpret_cast<int*>(p.recv_count)[le] = rows;
                if (p.recv_stats) atomicAdd(reinterpret_cast<int*>(p.recv_stats) + le, rows);
            }
        }
        __syncthreads();
        // The batch's rows, dealt round-robin over the warps of the experts' stripes.
        for (u32 r = split.stripe * kWarps + warp; r < total; r += split.stripes * kWarps) {
            const u32 pair = pair_of_row(pair_first, r);
            const u32 row_le = e0 + (pair / ranks) * split.step, src = pair % ranks, j = r - pair_first[pair];
            const u64 list = (static_cast<u64>(parity) * p.num_experts + row_le * ranks + src) * p.max_tokens;
            const u8* row = reinterpret_cast<const u8*>(pt.base + p.off_recv_stage) + (list + j) * p.row_stride;
            const u64 slot = static_cast<u64>(row_le) * slots + pair_before[pair] + j;
            if (lane == 0) {
                const int4 origin = *reinterpret_cast<const int4*>(row);
                reinterpret_cast<int*>(p.src_info)[slot] = origin.x;  // DeepEP's src_info: the source token
                reinterpret_cast<int*>(p.src_route)[slot] = origin.x * static_cast<int>(p.topk) + origin.y;
            }
            const u32 row_bytes = fp8 ? p.hidden : 2 * p.hidden;
            copy_vectors(reinterpret_cast<uint4*>(p.recv_x + slot * row_bytes),
                         reinterpret_cast<const uint4*>(row + 16), row_bytes / 16, lane);
            if (!fp8) continue;
            const float* scales = reinterpret_cast<const float*>(row + 16 + p.hidden);
            const u64 column = slot - static_cast<u64>(row_le) * slots;  // the row's column in its expert's scales
            for (u32 g0 = lane; g0 < groups; g0 += 32) {
                // Column-major per local expert (TMA-friendly): [e][groups][P*Tmax], or UE8M0 bytes packed four per
                // int32 along the groups: [e][groups/4][P*Tmax] words.
                if (ue8m0) {
                    const u64 w = (static_cast<u64>(row_le) * (groups / 4) + g0 / 4) * slots + column;
                    reinterpret_cast<u8*>(p.recv_scales)[w * 4 + g0 % 4] =
                        static_cast<u8>((__float_as_uint(scales[g0]) >> 23) & 0xff);
                } else {
                    reinterpret_cast<float*>(p.recv_scales)[(static_cast<u64>(row_le) * groups + g0) * slots + column] =
                        scales[g0];
                }
            }
        }
        __syncthreads();  // the batch's shared words are rewritten by the next batch
    }
    if (last_cta(word(pt, p.off_arrive + (gc_moe::kDispatchRecv * 2 + parity) * 8), pt.world_size > 1)) {
        if (threadIdx.x == 0) gc_moe::st_release_sys(word(pt, p.off_consumed + (0 * 2 + parity) * 8), gen);
        mirror_status(pt, p);
    }
}

// Returns the call's generation n (the one this CTA read from seq).
__device__ __forceinline__ u64 combine_send(const PeerTable& pt, const EpLlParams& p) {
    __shared__ u32 pair_first[kThreads];    // the batch's pairs: first row in the batch's row list
    __shared__ u32 pair_before[kThreads];   // the pair's first slot in its expert's list (its layout_range)
    __shared__ u32 source_state[kThreads];  // per source rank: 0 no rows in the batch, else 1 + its wait's outcome
    KernelStatus* status = status_of(pt, p, gc_moe::kCombineSend);
    u64* seq = word(pt, p.off_seq) + 1;
    const u64 gen = *reinterpret_cast<volatile u64*>(seq) + 1;
    const u32 parity = static_cast<u32>(gen & 1), lane = threadIdx.x & 31, warp = threadIdx.x / 32;
    const u32 ranks = static_cast<u32>(pt.world_size), own = static_cast<u32>(pt.rank);
    const u64 slots = static_cast<u64>(ranks) * p.max_tokens;
    const u32 row_vecs = p.hidden / 8;  // 16-byte vectors of a BF16 row
    const ExpertSplit split = expert_split(p.local_experts, ranks);
    const u32 g = threadIdx.x / ranks, q = threadIdx.x % ranks;
    for (u32 e0 = split.first; e0 < p.local_experts; e0 += split.batch * split.step) {
        const u32 le = e0 + g * split.step;
        const bool valid = g < split.batch && le < p.local_experts;
        source_state[threadIdx.x] = 0;
        __syncthreads();
        u32 rows = 0, before = 0;
        if (valid) {
            const u64 range = static_cast<u64>(reinterpret_cast<const long long*>(p.layout_range)[le * ranks + q]);
            before = static_cast<u32>(range >> 32);
            rows = static_cast<u32>(range);
            if (rows) source_state[q] = 1;
        }
        __syncthreads();
        // One wait per source rank with rows in the batch: its stage was read two generations back.
        if (threadIdx.x < ranks && source_state[threadIdx.x])
            source_state[threadIdx.x] = 1 + wait_consumed(pt, p, threadIdx.x, 1, gen, status);
        __syncthreads();
        // A failed wait or a masked source: its rows are not sent.
        const u32 n = valid && source_state[q] == 1 + kArrived ? rows : 0;
        u32 total;
        pair_first[threadIdx.x] = cta_exclusive_scan(n, total);
        pair_before[threadIdx.x] = before;
        __syncthreads();
        for (u32 r = split.stripe * kWarps + warp; r < total; r += split.stripes * kWarps) {
            const u32 pair = pair_of_row(pair_first, r);
            const u32 row_le = e0 + (pair / ranks) * split.step, src = pair % ranks, j = r - pair_first[pair];
            const u64 slot = static_cast<u64>(row_le) * slots + pair_before[pair] + j;
            const u32 origin = static_cast<u32>(reinterpret_cast<const int*>(p.src_route)[slot]);
            const u64 dst_row = (static_cast<u64>(parity) * p.max_tokens + origin / p.topk) * p.topk + origin % p.topk;
            copy_vectors(peer_ptr<uint4>(pt, src, p.off_combine_stage + dst_row * 2 * p.hidden),
                         reinterpret_cast<const uint4*>(p.x) + slot * row_vecs, row_vecs, lane);
        }
        __syncthreads();  // the batch's shared words are rewritten by the next batch
    }
    if (last_cta(word(pt, p.off_arrive + (gc_moe::kCombineSend * 2 + parity) * 8), pt.world_size > 1)) {
        for (u32 rank = threadIdx.x; rank < ranks; rank += kThreads) {
            if (is_masked(pt, p, rank)) continue;
            gc_moe::st_release_sys(peer_ptr<u64>(pt, rank, p.off_ready + (own * 2 + parity) * 8), gen);
        }
        if (threadIdx.x == 0) {
            *seq = gen;
            *reinterpret_cast<u64*>(p.call_gen) = gen;
        }
    }
    return gen;
}

// Whether combine receive sums slot f: the dispatch's checked expert, equal to the caller's checked entry, with a
// finite weight and an unmasked owner. Reports (when `status` is given) a differing entry or a non-finite weight.
// (Evaluated once per slot and column unit by one lane, so a token's k slots are decided in parallel.)
__device__ __forceinline__ bool combine_slot(const PeerTable& pt, const EpLlParams& p, u32 f, float weight,
                                             KernelStatus* status = nullptr) {
    const int dispatched = reinterpret_cast<const int*>(p.routing)[f];
    const int caller = slot_expert(p, f);
    if (caller != dispatched) {
        if (status) gc_moe::report_status(status, gc_moe::kStatusMismatch, gc_moe::kLlSiteTopkMismatch << 16,
                                          static_cast<u64>(static_cast<long long>(raw_id(p, f))), f);
        return false;
    }
    if (dispatched < 0) return false;
    if (!isfinite(weight)) {
        if (status) gc_moe::report_status(status, gc_moe::kStatusMismatch, gc_moe::kLlSiteWeight << 16,
                                          __float_as_uint(weight), f);
        return false;
    }
    return !is_masked(pt, p, static_cast<u32>(dispatched) / p.local_experts);
}

// Receives generation `gen` (receive_generation), or on the direct path (one rank: no send half) reduces the rows of
// x in place, its checker taking the generation from seq and storing it as a send half does.
__device__ __forceinline__ void combine_recv(const PeerTable& pt, const EpLlParams& p, u64 gen) {
    KernelStatus* status = status_of(pt, p, gc_moe::kCombineRecv);
    const u32 ranks = static_cast<u32>(pt.world_size);
    const bool direct = ranks == 1;
    u64* seq = word(pt, p.off_seq) + 1;
    if (direct) gen = *reinterpret_cast<volatile u64*>(seq) + 1;
    const u32 parity = static_cast<u32>(gen & 1), lane = threadIdx.x & 31;
    bool ok = true;
    for (u32 q = threadIdx.x; q < ranks && !direct; q += kThreads) {
        const u64* ready = word(pt, p.off_ready + (q * 2 + parity) * 8);
        u64 v = 0;
        const Wait w = wait_rank(pt, p, ready, gen, status, gc_moe::kLlSiteReady << 16 | q, q, &v);
        if (w == kFailed) {
            ok = false;
        } else if (w == kArrived) {
            if (v != gen) {
                gc_moe::report_status(status, gc_moe::kStatusMismatch, gc_moe::kLlSiteReadyAhead << 16 | q, v, gen);
                ok = false;
            }
        }
    }
    ok = __syncthreads_and(ok);  // the acquires precede every thread's stage reads
    const float* weights = reinterpret_cast<const float*>(p.topk_weights);
    const int* routing = reinterpret_cast<const int*>(p.routing);
    const int* entry_rows = routing + static_cast<u64>(p.num_tokens) * p.topk;  // the routing's second plane
    // A warp's unit is `span` consecutive column chunks of one token, span the smallest that gives every warp of the
    // grid at most one unit: the token's slot decisions, rows and weights are read once per unit (a lane per slot,
    // broadcast by shuffles), and the next chunk's first vectors load while the current chunk is summed, so a warp
    // waits on about two round trips per unit instead of two per chunk.
    const u32 chunks = (p.hidden + kCombineColumns - 1) / kCombineColumns;
    const u32 reducers = direct ? direct_movers() : gridDim.x;  // direct: all but the checker (unless it is alone)
    const u32 warps = reducers * kWarps;
    const u32 span = ok ? max(1u, (p.num_tokens * chunks + warps - 1) / warps) : 1;  // 1 at T = 0 (no units)
    const u32 groups = (chunks + span - 1) / span;
    const u32 units = ok ? p.num_tokens * groups : 0;
    // The rows summed: the combine stage's [parity][token][slot] rows, or (direct) x's [local expert][Tmax] rows.
    const u8* rows = reinterpret_cast<const u8*>(direct ? p.x : pt.base + p.off_combine_stage);
    for (u32 u = blockIdx.x * kWarps + threadIdx.x / 32; u < units && blockIdx.x < reducers; u += warps) {
        const u32 t = u / groups, first = (u % groups) * span, last = min(chunks, first + span);
        const u64 token_rows = (static_cast<u64>(parity) * p.max_tokens + t) * p.topk;  // the token's first slot row
        // Lane k's slot: its row in `rows` (-1: nothing to read: on the direct path no row was sent), its weight, and
        // whether it is summed (reported by the token's first unit only).
        long long slot_row = -1;
        float slot_weight = 0.f;
        bool decided = false;
        if (lane < p.topk) {
            const u32 f = t * p.topk + lane;
            slot_weight = weights[f];
            if (!direct) {
                slot_row = static_cast<long long>(token_rows + lane);
            } else {
                const int e = routing[f], j = entry_rows[f];
                if (e >= 0 && j >= 0) slot_row = static_cast<long long>(static_cast<u32>(e) % p.local_experts) *
                                                     p.max_tokens + j;
            }
            // Reported once per slot, by the token's first unit (direct: by the checker alone).
            decided = combine_slot(pt, p, f, slot_weight, first == 0 && !direct ? status : nullptr) && slot_row >= 0;
        }
        const u32 used_slots = __ballot_sync(~0u, decided);
        // Slot k's 16-byte vector at column `col` (zero for a slot not summed: the sum skips it).
        const auto load = [&](u32 k, u32 col) -> uint4 {
            const long long r = __shfl_sync(~0u, slot_row, k);
            if (!(used_slots >> k & 1u) || col >= p.hidden) return make_uint4(0, 0, 0, 0);
            return *reinterpret_cast<const uint4*>(rows + (static_cast<u64>(r) * p.hidden + col) * 2);
        };
        uint4 next[kCombineUnroll];  // the first kCombineUnroll slots of the chunk summed next, in flight
#pragma unroll
        for (u32 i = 0; i < kCombineUnroll; ++i) next[i] = load(i, first * kCombineColumns + lane * 8);
        for (u32 c = first; c < last; ++c) {
            const u32 col = c * kCombineColumns + lane * 8;
            uint4 v[kCombineUnroll];
#pragma unroll
            for (u32 i = 0; i < kCombineUnroll; ++i) v[i] = next[i];
            if (c + 1 < last) {
#pragma unroll
                for (u32 i = 0; i < kCombineUnroll; ++i) next[i] = load(i, col + kCombineColumns);
            }
            float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            for (u32 k0 = 0; k0 < p.topk; k0 += kCombineUnroll) {
                if (k0 > 0) {
#pragma unroll
                    for (u32 i = 0; i < kCombineUnroll; ++i) v[i] = load(min(k0 + i, 31u), col);  // past topk: unused
                }
#pragma unroll
                for (u32 i = 0; i < kCombineUnroll; ++i) {  // slot order: the reference's summation order
                    const u32 k = k0 + i;
                    const float w = __shfl_sync(~0u, slot_weight, min(k, 31u));
                    if (k >= p.topk || !(used_slots >> k & 1u)) continue;
                    const float f[8] = {bf16_lo(v[i].x), bf16_hi(v[i].x), bf16_lo(v[i].y), bf16_hi(v[i].y),
                                        bf16_lo(v[i].z), bf16_hi(v[i].z), bf16_lo(v[i].w), bf16_hi(v[i].w)};
                    // Separately rounded multiply and add (no FMA contraction): the torch reference reproduces it.
#pragma unroll
                    for (int j = 0; j < 8; ++j) acc[j] = __fadd_rn(acc[j], __fmul_rn(w, f[j]));
                }
            }
            if (col >= p.hidden) continue;
            __nv_bfloat162 out[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) out[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
            *reinterpret_cast<uint4*>(reinterpret_cast<__nv_bfloat16*>(p.out) + static_cast<u64>(t) * p.hidden +
                                      col) = *reinterpret_cast<const uint4*>(out);
        }
    }
    if (!direct || !direct_checker() || reducers == 1) phase_mark(kCombinePhases, 1);
    if (direct) {
        // One rank: the checker decides every slot again (combine_slot, the reducers' rule), reports each dropped one,
        // takes the generation and mirrors the status records; nothing waits for the reducers.
        if (!direct_checker()) return;
        for (u32 f = threadIdx.x; f < p.num_tokens * p.topk; f += kThreads) combine_slot(pt, p, f, weights[f], status);
        if (reducers > 1) phase_mark(kCombinePhases, 1);
        if (threadIdx.x == 0) {
            *seq = gen;
            *reinterpret_cast<u64*>(p.call_gen) = gen;
        }
        __syncthreads();  // every thread's reports precede the mirror
        mirror_status(pt, p);
        return;
    }
    if (last_cta(word(pt, p.off_arrive + (gc_moe::kCombineRecv * 2 + parity) * 8))) {
        if (threadIdx.x == 0) gc_moe::st_release_sys(word(pt, p.off_consumed + (1 * 2 + parity) * 8), gen);
        mirror_status(pt, p);
    }
}

// The generation a receive half serves: in a fused launch the one this CTA's send half read from seq (`sent`; the
// send half's last CTA stores call_gen after every arrival, which no launch boundary orders before this read), in a
// receive launch the one the call's send launch stored in call_gen (stream order). The one read of call_gen: only a
// receive launch may read it (the host points every unhooked combine at one shared, unread word).
__device__ __forceinline__ u64 receive_generation(const EpLlParams& p, u64 sent) {
    if (p.phase == gc_moe::kLlPhaseBoth) return sent;
    return *reinterpret_cast<volatile const u64*>(p.call_gen);
}

}  // namespace

namespace gc_moe::ep_ll {

// Dispatch: the send half sends this rank's tokens, the receive half receives and packs them (DeepEP's layout). Two
// CTAs fit an SM (at most 128 registers a thread): at one rank, where nothing waits, a grid of more tokens than SMs
// may be twice the SMs, so a CTA sends one token where it would send two, and an SM overlaps two tokens' chains
// (ep_ll.ll_grid).
__global__ void __launch_bounds__(kThreads, 2) dispatch(const PeerTable pt, const EpLlParams p) {
    phase_mark(kDispatchPhases, 0);
    u64 gen = 0;
    if (p.phase != kLlPhaseRecv) gen = dispatch_send(pt, p);
    if (p.phase != kLlPhaseSend && pt.world_size > 1) dispatch_recv(pt, p, receive_generation(p, gen));
    phase_mark(kDispatchPhases, 5);
}

// Combine: the send half sends the expert outputs back to their tokens' ranks, the receive half reduces them. Two
// CTAs fit an SM (at most 128 registers a thread): at one rank, where nothing waits, the grid may be twice the SMs, so
// each warp sums half the column chunks of a token with twice the loads in flight per SM (ep_ll.ll_grid).
__global__ void __launch_bounds__(kThreads, 2) combine(const PeerTable pt, const EpLlParams p) {
    phase_mark(kCombinePhases, 0);
    if (pt.world_size == 1) {  // the direct path: the receive half alone, run by the call's first launch
        if (p.phase != kLlPhaseRecv) combine_recv(pt, p, 0);
        phase_mark(kCombinePhases, 2);
        return;
    }
    u64 gen = 0;
    if (p.phase != kLlPhaseRecv) gen = combine_send(pt, p);
    if (p.phase != kLlPhaseSend) combine_recv(pt, p, receive_generation(p, gen));
    phase_mark(kCombinePhases, 2);
}

}  // namespace gc_moe::ep_ll
