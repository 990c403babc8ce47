// Hopper (sm_90) asynchronous building blocks for warp-specialized kernels: mbarriers, TMA tensor copies, named
// barriers and register reallocation. Inline PTX only (no CUDA headers), like utils.cuh.
//
// Roles (flash_fwd_sm90.cuh): one producer warp issues TMA copies global -> shared into a ring of stages; each copy
// completes on the stage's "full" mbarrier (arrive.expect_tx announces the bytes, the copy engine counts them down).
// Consumers wait on "full" with the stage's phase parity, use the stage, then arrive on its "empty" mbarrier; the
// producer waits on "empty" before it reuses the stage. Phase parity of use u of a stage in a ring of S stages:
// (u / S) & 1; the producer's first wait on an empty barrier passes at once (it waits for parity 1 of a fresh barrier).
//
// Tensor maps (TmaDesc, flash.h) are encoded on the host (flashtrain/kernels/tma.py) and passed inside the kernel's
// __grid_constant__ parameter struct; a copy names the map by its generic address and the box by its coordinates,
// innermost first. With 128-byte swizzle, a box of 64 16-bit columns x R rows lands in shared memory exactly as
// SmemTile (utils.cuh) lays out one 64-column block (the XOR of 16-byte chunks with row % 8), given 1024-byte
// alignment; rows or columns outside the tensor are zero-filled.
#pragma once
#include "utils.cuh"

namespace flashtrain {

// ---------------------------------------------------------------------------------------------- mbarriers
__device__ __forceinline__ void mbar_init(u32 bar, u32 arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(arrivals) : "memory");
}
// Make the initialised barriers visible to the async proxy (the copy engine) before anyone uses them.
__device__ __forceinline__ void mbar_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
// One arrival that also announces `bytes` of transactions (the TMA copies that complete on this barrier).
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// (an arrive predicated inside the instruction, not behind a branch)
__device__ __forceinline__ void mbar_arrive_if(bool pred, u32 bar) {
    asm volatile("{ .reg .pred p; setp.ne.u32 p, %1, 0; @p mbarrier.arrive.shared::cta.b64 _, [%0]; }"
                 ::"r"(bar), "r"((u32)pred) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(u32 bar, u32 parity) {
    u32 done;
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    return done != 0;
}
// Wait until the barrier's phase with this parity has completed.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    while (!mbar_try_wait(bar, parity)) {
    }
}

// A shared word handed from one thread to others, the accesses ordered by mbarriers: the store is atomic, so that
// racecheck (which does not follow mbarrier arrive / wait) sees no plain store racing the plain loads. (Atomic loads
// made ptxas spill 40-68 B in the consumer warpgroups.)
__device__ __forceinline__ void atomic_store_shared(u32 addr, int v) {
    asm volatile("atom.shared.exch.b32 _, [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ int ld_shared_b32(u32 addr) {
    int v;
    asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
    return v;
}

__device__ __forceinline__ int atomic_fetch_add(int* ptr, int v) {
    int old;
    asm volatile("atom.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(ptr), "r"(v) : "memory");
    return old;
}
// Persistent causal grids (FwdParams::causal_tile_group): the unit (a (batch, head)-like index) and the `inner` index
// (a query or key block, 0 first) of a tile, when the tiles come in groups of `group` units (the last group also takes
// the remainder of n_units) and, inside a group, inner outer and units inner.
__device__ __forceinline__ int tile_group_unit(int tile, int n_inner, int n_units, int group, int& inner) {
    const int last = max_(n_units / group, 1) - 1;
    const int g = min_(tile / (group * n_inner), last);
    const int r = tile - g * group * n_inner;
    const int units = g == last ? n_units - last * group : group;
    inner = r / units;
    return g * group + r % units;
}

// Inter-CTA ordering (the deterministic backward's per-block turn counters): acquire load, release add.
__device__ __forceinline__ int ld_acquire_gpu(const int* ptr) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
    return v;
}
__device__ __forceinline__ void red_release_gpu_add(int* ptr, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}
// Order this thread's completed bulk (async proxy) writes to global memory before its later generic accesses.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }
// atomicAdd returning the old value, relaxed at GPU scope (no fence: acq_rel costs a MEMBAR.ALL.GPU per call)
__device__ __forceinline__ int atom_add_relaxed_gpu(int* ptr, int v) {
    int old;
    asm volatile("atom.relaxed.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(ptr), "r"(v) : "memory");
    return old;
}
__device__ __forceinline__ void atomic_store(int* ptr, int v) {
    asm volatile("atom.global.exch.b32 _, [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

// ---------------------------------------------------------------------------------------------- TMA
__device__ __forceinline__ void tma_prefetch_desc(const TmaDesc* desc) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(desc) : "memory");
}
// Copy the box at (c0, c1, c2, c3) of a rank-4 tensor map into shared memory at dst; completes on mbarrier bar.
__device__ __forceinline__ void tma_load_4d(u32 dst, const TmaDesc* desc, u32 bar, int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}],"
        " [%2];" ::"r"(dst), "l"(desc), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
}

// ---------------------------------------------------------------------------------------------- clusters
// An arrive on the mbarrier at shared-memory offset bar in the other CTA of a 2-CTA cluster, predicated inside the
// instruction block, which also computes the peer's rank and address (mapa): no registers live outside it. (The
// default semantics, as CUTLASS's cluster barriers; with .release.cluster ptxas puts a MEMBAR.ALL.GPU before it.)
__device__ __forceinline__ void mbar_arrive_peer_if(bool pred, u32 bar) {
    asm volatile("{ .reg .pred p; .reg .b32 r, a; setp.ne.u32 p, %1, 0; mov.u32 r, %%cluster_ctarank; xor.b32 r, r, 1;"
                 " mapa.shared::cluster.u32 a, %0, r; @p mbarrier.arrive.shared::cluster.b64 _, [a]; }"
                 ::"r"(bar), "r"((u32)pred) : "memory");
}
// Every thread of every CTA of the cluster arrives, then waits for all (release / acquire at cluster scope): after
// barrier set-up (before any CTA signals another's barriers) and before exit (no CTA's copies or arrives still target
// an exited one).
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
}
// A 2-CTA cluster's K / V tile of two 64-column boxes: this CTA (rank r) copies box r (columns 64 r.., landing at
// dst + r * box_bytes) into the shared memory of both CTAs (TMA multicast), each copy completing its bytes on the
// mbarrier at bar's offset in that CTA (the rank computed inside the instruction block, as mbar_arrive_peer_if's).
__device__ __forceinline__ void tma_load_4d_multicast_pair(u32 dst, const TmaDesc* desc, u32 bar, u32 box_bytes,
                                                           int c1, int c2, int c3) {
    asm volatile(
        "{ .reg .b32 r, d, c; .reg .b16 m; mov.u32 r, %%cluster_ctarank; mad.lo.u32 d, r, %3, %0; shl.b32 c, r, 6;"
        " mov.b16 m, 3;"
        " cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
        " [d], [%1, {c, %4, %5, %6}], [%2], m; }" ::"r"(dst), "l"(desc), "r"(bar), "r"(box_bytes), "r"(c1), "r"(c2),
        "r"(c3)
        : "memory");
}
// The same for a K / V tile of one 64-column box (head dim 64), split by rows: this CTA (rank r) copies rows c1 + r *
// half_rows.. of the box (a tensor map of half_rows-row boxes), landing at dst + r * half_bytes, into both CTAs. A
// half that would start past last_row (the keys' last row) starts at last_row instead, so that no box lies wholly
// outside the tensor (a box crossing its end is zero-filled there and completes all its bytes; one wholly outside is
// not described by the PTX ISA): those rows are keys past the end, which the last block's mask hides, and they now
// hold real rows' finite values instead of zeros, so P (0 there) times V adds the same zeros.
__device__ __forceinline__ void tma_load_4d_multicast_rows(u32 dst, const TmaDesc* desc, u32 bar, u32 half_bytes,
                                                           int half_rows, int c1, int last_row, int c2, int c3) {
    asm volatile(
        "{ .reg .b32 r, d, c; .reg .b16 m; mov.u32 r, %%cluster_ctarank; mad.lo.u32 d, r, %3, %0;"
        " mad.lo.u32 c, r, %4, %5; min.s32 c, c, %6; mov.b16 m, 3;"
        " cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
        " [d], [%1, {0, c, %7, %8}], [%2], m; }" ::"r"(dst), "l"(desc), "r"(bar), "r"(half_bytes), "r"(half_rows),
        "r"(c1), "r"(last_row), "r"(c2), "r"(c3)
        : "memory");
}

// Epilogues through TMA stores (forward O, backward dK / dV); FT_TMA_STORE=0 builds the 16-byte-store epilogues (A/B).
#ifndef FT_TMA_STORE
#define FT_TMA_STORE 1
#endif
// Copy shared memory at src (laid out as tma_load_4d leaves a box) into the box at (c0, c1, c2, c3) of a rank-4 tensor
// map; elements outside the tensor are not written. Tracked in the issuing thread's bulk groups (bulk_commit;
// bulk_wait_read before src is written again or the CTA exits). The source must be fenced (fence_proxy_async) by the
// threads that wrote it, before the issue.
__device__ __forceinline__ void tma_store_4d(const TmaDesc* desc, u32 src, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];" ::"l"(desc),
                 "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
                 : "memory");
}

// Bulk (non-tensor) copy of `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to shared memory,
// completing on mbarrier bar (expect_tx first). Global data other threads wrote through the generic proxy needs
// fence_proxy_async_global before the issue.
__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

// Bulk (non-tensor) asynchronous reduce-add of `bytes` (a multiple of 16; both addresses 16-byte aligned) fp32 values
// from shared to global memory, tracked per thread in bulk groups: commit closes a group; wait_read<N> returns once
// at most N groups still read their shared source, wait<N> once at most N are incomplete. The shared source must be
// written before the issue and fenced (fence_proxy_async, wgmma.cuh): the copy engine reads it through the async proxy.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, u32 src, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(dst), "r"(src),
                 "r"(bytes)
                 : "memory");
}
// Element-wise reduce-add of shared memory at src (laid out as tma_load_4d leaves a box: the map's element type,
// fp32 for the backward's dq_accum) into the box at (c0, c1, c2, c3) of a rank-4 tensor map; tracked in bulk groups
// and fenced as tma_store_4d.
__device__ __forceinline__ void tma_reduce_add_4d(const TmaDesc* desc, u32 src, int c0, int c1, int c2, int c3) {
    asm volatile("cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];"
                 ::"l"(desc), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
template <int N> __device__ __forceinline__ void bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}

// ---------------------------------------------------------------------------------------------- warpgroups
// Register reallocation between warpgroups (sm_90a): the producer gives registers back, the consumers take them.
// Needs a register cap at kernel entry (__launch_bounds__(threads, 1)).
template <int kRegs> __device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <int kRegs> __device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}
// The warp's index as a value the compiler knows is uniform across the warp.
__device__ __forceinline__ int warp_uniform(int x) {
    int y;
    asm volatile("shfl.sync.idx.b32 %0, %1, 0, 0x1f, 0xffffffff;" : "=r"(y) : "r"(x));
    return y;
}


// Diagnostics (FT_TIMELINE=1 builds only; benchmarks/probes/timeline_probe.py reads them): per CTA (the first
// kTimelineCtas), role (a warpgroup) and tile (the first kTimelineTiles it works on), kTimelineEvents 64-bit slots:
// the SM's clock64 at the kernel's marks, or a count. Compiled out otherwise.
#ifdef FT_TIMELINE
constexpr int kTimelineCtas = 160, kTimelineRoles = 4, kTimelineTiles = 96, kTimelineEvents = 8;
}  // namespace flashtrain
extern "C" __device__ unsigned long long flashtrain_timeline[flashtrain::kTimelineCtas * flashtrain::kTimelineRoles *
                                                            flashtrain::kTimelineTiles * flashtrain::kTimelineEvents];
namespace flashtrain {
__device__ __forceinline__ void timeline_put(int role, int tile, int event, unsigned long long value) {
    if (threadIdx.x % 128 == 0 && blockIdx.x < kTimelineCtas && tile < kTimelineTiles)
        flashtrain_timeline[((blockIdx.x * kTimelineRoles + role) * kTimelineTiles + tile) * kTimelineEvents + event] =
            value;
}
__device__ __forceinline__ unsigned long long timeline_clock() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t));
    return t;
}
#define FT_TIMELINE_MARK(role, tile, event) \
    ::flashtrain::timeline_put(role, tile, event, ::flashtrain::timeline_clock())
// role 0, tile 0: the global timer (ns) and the SM clock at the CTA's start, to align the SMs' clocks
__device__ __forceinline__ void timeline_start() {
    unsigned long long g;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g));
    timeline_put(0, 0, 0, g);
    timeline_put(0, 0, 1, timeline_clock());
}
#define FT_TIMELINE_START() ::flashtrain::timeline_start()
// role 3, tile `role`: the same at a warpgroup's end
__device__ __forceinline__ void timeline_end(int role) {
    unsigned long long g;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g));
    timeline_put(3, role, 0, g);
    timeline_put(3, role, 1, timeline_clock());
}
#define FT_TIMELINE_END(role) ::flashtrain::timeline_end(role)
#define FT_TIMELINE_PUT(role, tile, event, value) ::flashtrain::timeline_put(role, tile, event, value)
#else
#define FT_TIMELINE_MARK(role, tile, event)
#define FT_TIMELINE_PUT(role, tile, event, value)
#define FT_TIMELINE_START()
#define FT_TIMELINE_END(role)
#endif

// Diagnostics (FT_STEPS builds only; benchmarks/probes/step_timeline_probe.py reads them): per CTA (the first
// kStepCtas), role (the producer 0, consumer warpgroups 1..3), warp of the warpgroup and key-block step (the stage
// counter, the first kSteps of the CTA), kStepEvents 64-bit slots of the SM's clock64 at the step's marks, written by
// each warp's first lane (FT_STEPS=2: the forward loader's marks too). Compiled out otherwise.
#ifdef FT_STEPS
constexpr int kStepCtas = 4, kStepRoles = 4, kStepWarps = 4, kSteps = 1024, kStepEvents = 8;
}  // namespace flashtrain
extern "C" __device__ unsigned long long flashtrain_steps[flashtrain::kStepCtas * flashtrain::kStepRoles *
                                                         flashtrain::kStepWarps * flashtrain::kSteps *
                                                         flashtrain::kStepEvents];
namespace flashtrain {
__device__ __forceinline__ void step_mark(int role, int step, int event) {
    if (threadIdx.x % 32 == 0 && blockIdx.x < kStepCtas && step < kSteps) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%clock64;" : "=l"(t)::"memory");
        const int warp = threadIdx.x / 32 % kStepWarps;
        flashtrain_steps[(((blockIdx.x * kStepRoles + role) * kStepWarps + warp) * kSteps + step) * kStepEvents +
                         event] = t;
    }
}
#define FT_STEP_MARK(role, step, event) ::flashtrain::step_mark(role, step, event)
#else
#define FT_STEP_MARK(role, step, event)
#endif
}  // namespace flashtrain
