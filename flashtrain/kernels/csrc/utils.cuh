// Building blocks shared by the forward and backward kernels, written with inline PTX so that the sources need no
// header at all (they compile the same under NVRTC and nvcc):
//   - cp.async global->shared copies of 16 bytes with zero fill (rows past the sequence end, columns past head_dim);
//   - swizzled shared-memory tiles read by ldmatrix without bank conflicts;
//   - warp-level GEMMs on mma.sync.m16n8k16 (fp16/bf16 inputs, fp32 accumulators);
//   - counter-based Philox4x32 (7 rounds) for dropout, addressed by (batch*head, query row, key column) only, so the
//     forward, the backward and the test-only mask kernel draw the same bits whatever their thread layout.
//
// Fragment layout of mma.m16n8k16 (g = lane / 4, t = lane % 4), which every kernel relies on:
//   A (16x16, row-major): a0 = A[g][2t..2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..]
//   B (16x8,  "col"):     b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]
//   C (16x8, fp32):       c0, c1 = C[g][2t], C[g][2t+1];  c2, c3 = C[g+8][2t], C[g+8][2t+1]
#pragma once
#include "flash.h"

namespace flashtrain {

using u16 = unsigned short;

constexpr float kLog2e = 1.4426950408889634f;

template <bool kValue> struct BoolConstant {
    static constexpr bool value = kValue;
};
template <int kValue> struct IntConstant {
    static constexpr int value = kValue;
};

// ---------------------------------------------------------------------------------------------- scalar helpers
// Drops the 128-byte line at `line` (global, 128-byte aligned) from L2 without writing it back to memory: its
// contents become indeterminate until written again (PTX discard.global.L2, sm_80+). For a scratch buffer whose
// values were read for the last time.
__device__ __forceinline__ void discard_l2_line(const void* line) {
    asm volatile("discard.global.L2 [%0], 128;" ::"l"(line) : "memory");
}

__device__ __forceinline__ float infinity() { return __int_as_float(0x7f800000); }
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float fast_log2(float x) {
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float fast_tanh(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
// 2^x on the FMA and integer pipes instead of MUFU (FlashAttention-4's trick on Blackwell; here it relieves the MUFU
// pipe where softcap's tanh shares it, FT_FWD_POLY_EXP): x clamped to -127 (masked scores' -inf too), x = j + f with
// j = round(x) (the low bits of x + 1.5 * 2^23), |f| <= 1/2; 2^f by a cubic with p(0) = 1 (relative error 1.0e-4 =
// 2^-13.3, below the 2^-9 of the 16-bit P it becomes); j added to the exponent bits. x = -127 gives exactly 0 (p = 1
// and the exponent field 0 after the add), as ex2.approx.ftz gives 0 below 2^-126; up to 2^-126 between -127 and -126.
__device__ __forceinline__ float poly_exp2(float x) {
    x = fmaxf(x, -127.f);
    const float t = x + 12582912.f;
    const float f = x - (t - 12582912.f);
    float p = fmaf(0.05500858f, f, 0.24221037f);
    p = fmaf(p, f, 0.6932829f);
    p = fmaf(p, f, 1.f);
    return __int_as_float(__float_as_int(p) + (__float_as_int(t) << 23));
}
__device__ __forceinline__ float fmax_(float a, float b) {
    float y;
    asm("max.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
    return y;
}
__device__ __forceinline__ float shfl_xor(float x, int lane_mask) {
    float y;
    asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=f"(y) : "f"(x), "r"(lane_mask));
    return y;
}
// Hide a value from the optimizer: addresses derived from it are then recomputed where they are used instead of
// being hoisted out of the main loop into dozens of live registers.
__device__ __forceinline__ u32 launder(u32 x) {
    asm volatile("" : "+r"(x));
    return x;
}
__device__ __forceinline__ i64 launder(i64 x) {
    asm volatile("" : "+l"(x));
    return x;
}
__device__ __forceinline__ int min_(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int max_(int a, int b) { return a > b ? a : b; }
__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Two floats -> one register of two 16-bit values (lo in the low half).
template <bool kIsBF16> __device__ __forceinline__ u32 pack2(float lo, float hi);
template <> __device__ __forceinline__ u32 pack2<false>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
template <> __device__ __forceinline__ u32 pack2<true>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
// One register of two 16-bit values -> two floats.
template <bool kIsBF16> __device__ __forceinline__ void unpack2(u32 v, float& lo, float& hi);
template <> __device__ __forceinline__ void unpack2<false>(u32 v, float& lo, float& hi) {
    asm("{ .reg .f16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h; }"
        : "=f"(lo), "=f"(hi) : "r"(v));
}
template <> __device__ __forceinline__ void unpack2<true>(u32 v, float& lo, float& hi) {
    asm("mov.b32 %0, %2;\n mov.b32 %1, %3;" : "=f"(lo), "=f"(hi) : "r"(v << 16), "r"(v & 0xffff0000u));
}

// ---------------------------------------------------------------------------------------------- memory helpers
__device__ __forceinline__ u32 smem_u32(const void* ptr) {
    u32 addr;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(addr) : "l"(ptr));
    return addr;
}
// 16-byte async copy; with pred false nothing is read and the 16 shared bytes are zero-filled.
__device__ __forceinline__ void cp_async_16(u32 smem_addr, const void* gmem, bool pred) {
    const int src_bytes = pred ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr), "l"(gmem), "r"(src_bytes));
}
// 4-byte async copy (zero-filled when pred is false).
__device__ __forceinline__ void cp_async_4(u32 smem_addr, const void* gmem, bool pred) {
    const int src_bytes = pred ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_addr), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ float ld_shared_f32(u32 smem_addr) {
    float v;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(smem_addr));
    return v;
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int kPending> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(kPending));
}
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 smem_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr));
}
// Four 8 x 8 16-bit matrices from the MMA accumulator layout (register i: row lane / 4, columns 2 (lane % 4) and + 1
// of matrix i) to shared memory; lane l gives the address of row l % 8 of matrix l / 8 (16 contiguous bytes).
__device__ __forceinline__ void stmatrix_x4(u32 smem_addr, const u32 (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(smem_addr), "r"(r[0]),
                 "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
}
// The same, each 8 x 8 matrix transposed: lane l gives the address of row l % 8 of transposed matrix l / 8 (that is,
// column l % 8 of matrix l / 8 of the accumulator layout).
__device__ __forceinline__ void stmatrix_x4_trans(u32 smem_addr, const u32 (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(smem_addr), "r"(r[0]),
                 "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 smem_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr));
}
__device__ __forceinline__ void st_shared_b32(u32 smem_addr, u32 v) {
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(smem_addr), "r"(v));
}
__device__ __forceinline__ void ld_shared_v4(u32 smem_addr, u32 (&v)[4]) {
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3]) : "r"(smem_addr));
}
__device__ __forceinline__ void st_shared_v4(u32 smem_addr, const u32 (&v)[4]) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(smem_addr), "r"(v[0]), "r"(v[1]), "r"(v[2]),
                 "r"(v[3]));
}
__device__ __forceinline__ void st_shared_v4f(u32 smem_addr, const float (&v)[4]) {
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(smem_addr), "f"(v[0]), "f"(v[1]), "f"(v[2]),
                 "f"(v[3]));
}
__device__ __forceinline__ void ld_shared_v4f(u32 smem_addr, float (&v)[4]) {
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v[0]), "=f"(v[1]), "=f"(v[2]), "=f"(v[3]) : "r"(smem_addr));
}
// Named barrier `id` (1..15; 0 is __syncthreads) over `threads` threads (a multiple of 32): sync waits, arrive
// counts this warp in without waiting.
__device__ __forceinline__ void named_bar_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// named_bar_sync that also returns whether `pred` held in any of the `threads` threads (bar.red.or)
__device__ __forceinline__ bool named_bar_sync_or(int id, int threads, bool pred) {
    u32 any;
    asm volatile(
        "{ .reg .pred p, q; setp.ne.u32 p, %1, 0; bar.red.or.pred q, %2, %3, p; selp.u32 %0, 1, 0, q; }"
        : "=r"(any) : "r"((u32)pred), "r"(id), "r"(threads) : "memory");
    return any != 0;
}

// The tail split of the persistent Hopper kernels (flash_fwd_sm90.cuh / flash_bwd_sm90.cuh kTailSplit). The scheduler
// hands out units: unit u < tail_first is tile u, unit tail_first + r is piece r % pieces of tile tail_first + r /
// pieces (tail_units of them in all); tail_unit_tile gives a unit's tile and piece (-1: a whole tile).
__device__ __forceinline__ int tail_units(int n_tiles, int tail_first, int pieces) {
    return pieces > 1 ? n_tiles + (n_tiles - tail_first) * (pieces - 1) : n_tiles;
}
__device__ __forceinline__ int tail_unit_tile(int unit, int tail_first, int pieces, int& piece) {
    piece = -1;
    if (pieces <= 1 || unit < tail_first) return unit;
    piece = (unit - tail_first) % pieces;
    return tail_first + (unit - tail_first) / pieces;
}
// A tail piece's count, once each of the `threads` threads at named barrier `id` has stored its part of the piece's
// results: one thread (counting) counts the piece in; true, in every thread, in the piece that completes the count of
// `pieces`, whose threads then see the other pieces' stores. (Release: each thread's fence, the barrier, the counting
// thread's fence before its add; acquire: its fence after the add, before the barrier that hands the result on.)
__device__ __forceinline__ bool tail_count_last(int* counter, int pieces, int id, int threads, bool counting) {
    __threadfence();
    named_bar_sync(id, threads);
    bool last = false;
    if (counting) {
        __threadfence();
        last = atomicAdd(counter, 1) == pieces - 1;
        __threadfence();
    }
    return named_bar_sync_or(id, threads, last);
}
__device__ __forceinline__ void st_global_v4(void* ptr, const u32 (&v)[4]) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3])
                 : "memory");
}
__device__ __forceinline__ void st_global_b32(void* ptr, u32 v) {
    asm volatile("st.global.b32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}
__device__ __forceinline__ void st_global_b32_if(bool pred, void* ptr, u32 v) {  // predicated, no branch
    asm volatile("{ .reg .pred p; setp.ne.u32 p, %2, 0; @p st.global.b32 [%0], %1; }" ::"l"(ptr), "r"(v),
                 "r"((u32)pred) : "memory");
}
__device__ __forceinline__ void st_global_v2_if(bool pred, void* ptr, u32 a, u32 b) {  // (8-byte aligned ptr)
    asm volatile("{ .reg .pred p; setp.ne.u32 p, %3, 0; @p st.global.v2.b32 [%0], {%1, %2}; }" ::"l"(ptr), "r"(a),
                 "r"(b), "r"((u32)pred) : "memory");
}
__device__ __forceinline__ float4 ld_global_f4(const float* ptr) { return *reinterpret_cast<const float4*>(ptr); }
__device__ __forceinline__ void ld_global_v4(const void* ptr, u32 (&v)[4]) {
    asm volatile("ld.global.nc.v4.b32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3]) : "l"(ptr));
}
// dq_accum[ptr..ptr+1] += (a, b) in fp32, atomically (one vector atomic on sm_90+).
__device__ __forceinline__ void atomic_add2(float* ptr, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(ptr), "f"(a), "f"(b) : "memory");
#else
    asm volatile("red.global.add.f32 [%0], %1;" ::"l"(ptr), "f"(a) : "memory");
    asm volatile("red.global.add.f32 [%0], %1;" ::"l"(ptr + 1), "f"(b) : "memory");
#endif
}
// dq_accum[ptr..ptr+3] += v in fp32, atomically; ptr 16-byte aligned (one vector atomic on sm_90+).
__device__ __forceinline__ void atomic_add4(float* ptr, const float (&v)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3])
                 : "memory");
#else
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("red.global.add.f32 [%0], %1;" ::"l"(ptr + i), "f"(v[i]) : "memory");
#endif
}

// Programmatic dependent launch (sm_90 and later; nothing on older targets). A kernel launched with the
// programmatic-stream-serialization attribute (ops.py _Launch.pdl) may start before the kernel ahead of it in the
// stream has finished: grid_dependency_wait blocks the calling thread until that kernel has completed and its memory
// is visible (a no-op when the launch had no such dependency); grid_launch_dependents lets the next such launch start
// once every CTA of this grid has called it or exited.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// ---------------------------------------------------------------------------------------------- shared tiles
// A kRows x kCols tile of 16-bit values, stored as column blocks of 64 (32 when kCols % 64 != 0, or when asked for
// by kBlockCols_) values; inside a block each row's 16-byte chunks are XOR-swizzled with the row index, so that the 8
// rows one ldmatrix phase reads (same logical chunk, 8 consecutive rows) fall in 8 different bank groups. 64-column
// blocks: bit for bit the hardware's 128-byte swizzle (TMA, wgmma; 1024-byte aligned blocks); 32-column blocks: its
// 64-byte swizzle (chunk ^ (row / 2) % 4 in 64-byte rows; 512-byte aligned blocks).
template <int kRows, int kCols, int kBlockCols_ = (kCols % 64 == 0 ? 64 : 32)> struct SmemTile {
    static_assert(kCols % 32 == 0, "tile width must be a multiple of 32");
    static_assert(kBlockCols_ == 64 || kBlockCols_ == 32, "column blocks of 64 or 32 values");
    static_assert(kCols % kBlockCols_ == 0, "whole column blocks");
    static constexpr int kBlockCols = kBlockCols_;
    static constexpr int kNumRows = kRows, kNumCols = kCols;
    static constexpr int kElems = kRows * kCols;
    static constexpr int kBytes = kElems * 2;
    // Element offset of (row, col); col % 8 may be non-zero (it stays inside its 16-byte chunk).
    __device__ __forceinline__ static int offset(int row, int col) {
        return offset_split(row & ~7, row & 7, col);
    }
    // Same with row = row8 + r, row8 a multiple of 8 and r in [0, 8): the swizzle then depends on r alone, which
    // callers take from the lane index, so that the compiler folds the rest of the address into immediates.
    __device__ __forceinline__ static int offset_split(int row8, int r, int col) {
        const int block = col / kBlockCols;
        const int chunk = (col % kBlockCols) / 8;
        const int swizzled = chunk ^ (kBlockCols == 64 ? r : (r >> 1));
        return block * (kRows * kBlockCols) + (row8 + r) * kBlockCols + swizzled * 8 + (col & 7);
    }
    __device__ __forceinline__ static u32 addr(u32 base, int row, int col) { return base + 2 * offset(row, col); }
    __device__ __forceinline__ static u32 addr_split(u32 base, int row8, int r, int col) {
        return base + 2 * offset_split(row8, r, col);
    }
};

// Thread tid handles 16-byte chunks tid, tid + kNThreads, ... of a tile in row-major chunk order (coalesced in global
// memory). When kNThreads is a multiple of the chunks per row, a thread keeps one column and steps by whole rows.
template <class Tile, int kNThreads> struct TileCopy {
    static constexpr int kChunksPerRow = Tile::kNumCols / 8;
    static constexpr int kIters = Tile::kElems / 8 / kNThreads;
    static_assert((Tile::kElems / 8) % kNThreads == 0, "tile chunks must divide evenly among threads");
    static constexpr bool kFixedCol = kNThreads % kChunksPerRow == 0 && (kNThreads / kChunksPerRow) % 8 == 0;
    __device__ __forceinline__ static void coords(int tid, int it, int& row, int& col) {
        if constexpr (kFixedCol) {
            row = tid / kChunksPerRow + it * (kNThreads / kChunksPerRow);
            col = (tid % kChunksPerRow) * 8;
        } else {
            const int chunk = tid + it * kNThreads;
            row = chunk / kChunksPerRow;
            col = (chunk % kChunksPerRow) * 8;
        }
    }
};

// Copy rows [0, rows_valid) x columns [0, cols_valid) of a global tile into a shared tile with cp.async, zero-filling
// the rest. gmem points at the tile's first row, which must exist (rows_valid > 0): the zero-fill lanes point there.
template <class Tile, int kNThreads>
__device__ __forceinline__ void load_tile_async(u32 smem, const u16* gmem, i64 row_stride, int rows_valid,
                                                int cols_valid, int tid) {
    using Copy = TileCopy<Tile, kNThreads>;
    if constexpr (Copy::kFixedCol) {
        // One column per thread, rows step by a multiple of 8: the shared address advances by a constant.
        constexpr int kRowStep = kNThreads / Copy::kChunksPerRow;
        const int row0 = tid / Copy::kChunksPerRow, col = (tid % Copy::kChunksPerRow) * 8;
        const u32 dst = Tile::addr(smem, row0, col);
        const i64 src = row0 * row_stride + col, step = launder(kRowStep * row_stride);
#pragma unroll
        for (int it = 0; it < Copy::kIters; ++it) {
            const bool pred = row0 + it * kRowStep < rows_valid && col < cols_valid;
            cp_async_16(dst + it * kRowStep * Tile::kBlockCols * 2, gmem + (pred ? src + it * step : 0), pred);
        }
    } else {
#pragma unroll
        for (int it = 0; it < Copy::kIters; ++it) {
            int row, col;
            Copy::coords(tid, it, row, col);
            const bool pred = row < rows_valid && col < cols_valid;
            cp_async_16(Tile::addr(smem, row, col), gmem + (pred ? row * row_stride + col : 0), pred);
        }
    }
}

// Copy rows [0, rows_valid) x columns [0, cols_valid) of a shared tile to global memory in 16-byte stores.
template <class Tile, int kNThreads>
__device__ __forceinline__ void store_tile(u32 smem, u16* gmem, i64 row_stride, int rows_valid, int cols_valid,
                                           int tid) {
    using Copy = TileCopy<Tile, kNThreads>;
#pragma unroll
    for (int it = 0; it < Copy::kIters; ++it) {
        int row, col;
        Copy::coords(tid, it, row, col);
        if (row < rows_valid && col < cols_valid) {
            u32 v[4];
            ld_shared_v4(Tile::addr(smem, row, col), v);
            st_global_v4(gmem + row * row_stride + col, v);
        }
    }
}

// ---------------------------------------------------------------------------------------------- warp GEMMs
template <bool kIsBF16>
__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    if constexpr (kIsBF16) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// A lane's address inside a swizzled tile, moved by compile-time offsets: at(drow, dcol) is the address of
// (row + drow, col + dcol) for drow % 8 == 0 and dcol % 8 == 0. With kXorSafe it costs one XOR: the 16-byte chunk index
// of col (within its column block) and that of dcol must then have no bit in common, which holds when a warp's columns
// start at a multiple of a power-of-two warp width and dcol stays inside that width (xor_safe() below). Otherwise the
// whole swizzle is recomputed.
template <class Tile, bool kXorSafe = true> struct TilePtr {
    u32 base, lane_addr;
    int row8, r, col;
    __device__ __forceinline__ TilePtr(u32 base_, int row8_, int r_, int col_)
        : base(base_), lane_addr(Tile::addr_split(base_, row8_, r_, col_)), row8(row8_), r(r_), col(col_) {}
    __device__ __forceinline__ u32 at(int drow, int dcol) const {
        constexpr int W = Tile::kBlockCols;
        if constexpr (kXorSafe) return (lane_addr ^ (((dcol % W) / 8) << 4)) + 2 * (drow * W + (dcol / W) * Tile::kNumRows * W);
        else return Tile::addr_split(base, row8 + drow, r, col + dcol);
    }
};
// Whether warps that split a tile dimension into kWarps slices of kWidth columns each can use the XOR shortcut.
__host__ __device__ constexpr bool xor_safe(int kWarps, int kWidth) { return kWarps == 1 || (kWidth & (kWidth - 1)) == 0; }

// ldmatrix.x4 operand addresses of a warp (lane's row and column inside the 4 8x8 matrices):
//   A from a tile holding A as [m][k] (kTrans false) or as A^T, [k][m]: at(m, k) / at(k, m) gives a0..a3 of the
//     16x16 A tile at (m, k);
//   B from a tile holding B as [n][k] (kTrans false) or as [k][n]: at(n, k) / at(k, n) gives b0, b1 of the n8 tile n
//     and b0, b1 of the n8 tile n + 8.
// row0 / col0 are the warp's offsets in the tile's own coordinates (multiples of 16).
template <class Tile, bool kTrans, bool kXorSafe = true>
__device__ __forceinline__ TilePtr<Tile, kXorSafe> a_frag_ptr(u32 base, int row0, int col0, int lane) {
    if constexpr (!kTrans) return TilePtr<Tile, kXorSafe>(base, row0 + (lane & 8), lane & 7, col0 + (lane >> 4) * 8);
    else return TilePtr<Tile, kXorSafe>(base, row0 + ((lane >> 4) << 3), lane & 7, col0 + ((lane >> 3) & 1) * 8);
}
template <class Tile, bool kTrans, bool kXorSafe = true>
__device__ __forceinline__ TilePtr<Tile, kXorSafe> b_frag_ptr(u32 base, int row0, int col0, int lane) {
    if constexpr (!kTrans)
        return TilePtr<Tile, kXorSafe>(base, row0 + ((lane >> 4) << 3), lane & 7, col0 + ((lane >> 3) & 1) * 8);
    else return TilePtr<Tile, kXorSafe>(base, row0 + (((lane >> 3) & 1) << 3), lane & 7, col0 + (lane >> 4) * 8);
}
template <bool kTrans> __device__ __forceinline__ void ldmatrix(u32 (&r)[4], u32 addr) {
    if constexpr (kTrans) ldmatrix_x4_trans(r, addr);
    else ldmatrix_x4(r, addr);
}

// acc[kMT][kNT] (a (kMT*16) x (kNT*8) warp tile) += A[m.., 0..kK) * B[0..kK, n..), both from shared memory, through
// the operand pointers built by a_frag_ptr / b_frag_ptr (which hold the warp's offsets).
template <bool kIsBF16, int kMT, int kNT, int kK, bool kTransA, bool kTransB, class PtrA, class PtrB>
__device__ __forceinline__ void warp_gemm_ss(float (&acc)[kMT][kNT][4], const PtrA& a_ptr, const PtrB& b_ptr) {
    static_assert(kNT % 2 == 0 && kK % 16 == 0, "warp tile must be a multiple of 16 columns and 16 k");
#pragma unroll
    for (int ks = 0; ks < kK / 16; ++ks) {
        u32 a[kMT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
            ldmatrix<kTransA>(a[mt], kTransA ? a_ptr.at(ks * 16, mt * 16) : a_ptr.at(mt * 16, ks * 16));
#pragma unroll
        for (int np = 0; np < kNT / 2; ++np) {
            u32 b[4];
            ldmatrix<kTransB>(b, kTransB ? b_ptr.at(ks * 16, np * 16) : b_ptr.at(np * 16, ks * 16));
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) {
                mma_16816<kIsBF16>(acc[mt][2 * np], a[mt], b[0], b[1]);
                mma_16816<kIsBF16>(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// Accumulator fragment (row g, cols 2t..2t+1 / row g+8) of C[mt][nt] -> A fragment for the next GEMM: the output
// columns of one GEMM become the k dimension of the next without leaving registers (P = softmax(S) feeding P @ V).
template <bool kIsBF16, int kMT, int kNT>
__device__ __forceinline__ void acc_to_a_frag(u32 (&a)[kMT][4], const float (&c)[kMT][kNT][4], int kslice) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
        a[mt][0] = pack2<kIsBF16>(c[mt][2 * kslice][0], c[mt][2 * kslice][1]);
        a[mt][1] = pack2<kIsBF16>(c[mt][2 * kslice][2], c[mt][2 * kslice][3]);
        a[mt][2] = pack2<kIsBF16>(c[mt][2 * kslice + 1][0], c[mt][2 * kslice + 1][1]);
        a[mt][3] = pack2<kIsBF16>(c[mt][2 * kslice + 1][2], c[mt][2 * kslice + 1][3]);
    }
}

// Write a warp's accumulator tile (rows m0.., cols n0..), multiplied by scale, as 16-bit values into a shared tile.
template <bool kIsBF16, class Tile, bool kXorSafe = true, int kMT, int kNT>
__device__ __forceinline__ void store_acc(u32 smem, const float (&c)[kMT][kNT][4], int m0, int n0, float scale,
                                          int lane) {
    const TilePtr<Tile, kXorSafe> ptr(smem, m0, lane >> 2, n0 + 2 * (lane & 3));
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int half = 0; half < 2; ++half)
                st_shared_b32(ptr.at(mt * 16 + 8 * half, nt * 8),
                              pack2<kIsBF16>(c[mt][nt][2 * half] * scale, c[mt][nt][2 * half + 1] * scale));
}

template <int kMT, int kNT> __device__ __forceinline__ void zero(float (&c)[kMT][kNT][4]) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) c[mt][nt][e] = 0.f;
}

// ---------------------------------------------------------------------------------------------- dropout
// Philox4x32 (Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3") with 7 rounds: the paper finds
// Philox4x32 passing TestU01's BigCrush from 7 rounds on (cuRAND and PyTorch run 10 for extra margin). The bits are
// only dropout keep decisions, 16 per call; the backward regenerates them, so the rounds are on the critical path
// of both passes: H200, same process, dropout 0.1 backward with 7 vs 10 rounds: head dim 64 512 / 1K 1.08-1.13x,
// head dim 128 1.03-1.06x. FT_PHILOX_ROUNDS=10 builds the cuRAND round count (it changes every mask).
#ifndef FT_PHILOX_ROUNDS
#define FT_PHILOX_ROUNDS 7
#endif
__device__ __forceinline__ void philox(u32 (&ctr)[4], u32 key0, u32 key1) {
#pragma unroll
    for (int round = 0; round < FT_PHILOX_ROUNDS; ++round) {
        const u64 p0 = (u64)0xD2511F53u * ctr[0];
        const u64 p1 = (u64)0xCD9E8D57u * ctr[2];
        const u32 hi0 = (u32)(p0 >> 32), lo0 = (u32)p0, hi1 = (u32)(p1 >> 32), lo1 = (u32)p1;
        ctr[0] = hi1 ^ ctr[1] ^ key0;
        ctr[1] = lo1;
        ctr[2] = hi0 ^ ctr[3] ^ key1;
        ctr[3] = lo0;
        key0 += 0x9E3779B9u;
        key1 += 0xBB67AE85u;
    }
}

// The random bits of query row i, key column j live in a 16x16 tile of (i, j): one Philox call per (tile, lane) where
// lane = (i % 8) * 4 + (j / 2) % 4 is exactly the mma accumulator lane owning (i, j); its 8 16-bit outputs cover that
// lane's 8 elements of the tile. philox_bits(i, j) returns the 4 words of the call containing (i, j).
struct DropoutRng {
    u32 key0, key1, offset, keep_threshold;
    DropoutRng() = default;
    __device__ __forceinline__ DropoutRng(const u64* rng_state, u32 keep_threshold_)
        : key0((u32)rng_state[0]), key1((u32)(rng_state[0] >> 32)), offset((u32)rng_state[1]),
          keep_threshold(keep_threshold_) {}
    __device__ __forceinline__ void bits(u32 (&r)[4], int bh, int i, int j) const {
        r[0] = (u32)(j >> 4);
        r[1] = (u32)(i >> 4);
        r[2] = (u32)bh;
        r[3] = (u32)(((i & 7) << 2) | ((j >> 1) & 3)) | (offset << 5);
        philox(r, key0, key1);
    }
    // Keep decision of element (i, j) from the words of its call (i, j only matter modulo the tile).
    __device__ __forceinline__ bool keep(const u32 (&r)[4], int i, int j) const {
        return keep_half(r, ((i >> 3) & 1) * 4 + ((j >> 3) & 1) * 2 + (j & 1));
    }
    // half = (i / 8 % 2) * 4 + (j / 8 % 2) * 2 + j % 2: a compile-time constant inside the kernels' unrolled loops.
    __device__ __forceinline__ bool keep_half(const u32 (&r)[4], int half) const {
        return keep16(r[half >> 1], half & 1);
    }
    // The keep decision of one element: the low (hi = 0) or high 16 bits of a word against the threshold.
    __device__ __forceinline__ bool keep16(u32 word, int hi) const {
        return ((word >> (16 * hi)) & 0xffffu) < keep_threshold;
    }
    // Backward of the Hopper kernel, whose tiles are transposed (rows keys, columns queries): lane (g, t) holds, of a
    // 16 x 16 tile, queries 2t + c + 8a (c, a in {0, 1}) of keys g + 8b. Those 8 elements come from two of the forward's
    // calls, (query & 7 = 2t + c, key / 2 % 4 = g / 2) for c = 0, 1, the 4 halves of each with key parity g % 2; the
    // lane with g ^ 1 (lane ^ 4) needs the other 4 halves of the same two calls. So each lane makes one call, c = g % 2,
    // and swaps the 4 halves its partner needs for the 4 it needs of the partner's call (2 shuffles instead of a second
    // Philox call). q[c][a]: halves (b = 0, b = 1) of query parity c, query half a (keep16(q[c][a], b)).
    __device__ __forceinline__ void bits_transposed(u32 (&q)[2][2], int bh, int query0, int key, int lane) const {
        const int p = (lane >> 2) & 1;  // g % 2
        u32 r[4];
        bits(r, bh, query0 + p, key);
        const u32 sel_mine = p ? 0x7632u : 0x5410u, sel_send = p ? 0x5410u : 0x7632u;
#pragma unroll
        for (int a = 0; a < 2; ++a) {
            const u32 mine = __byte_perm(r[2 * a], r[2 * a + 1], sel_mine);
            const u32 recv = __shfl_xor_sync(0xffffffffu, __byte_perm(r[2 * a], r[2 * a + 1], sel_send), 4);
            q[0][a] = p ? recv : mine;
            q[1][a] = p ? mine : recv;
        }
    }
    // Forward: zero the dropped entries of a thread's P fragment p[kNT][4] (mma / wgmma accumulator layout) whose row g
    // is query `row` and whose first column is key `col` (= n0 + 2t).
    template <int kNT> __device__ __forceinline__ void drop(float (&p)[kNT][4], int bh, int row, int col) const {
#pragma unroll
        for (int ks = 0; ks < kNT / 2; ++ks) {
            u32 r[4];
            bits(r, bh, row, col + ks * 16);
#pragma unroll
            for (int nt2 = 0; nt2 < 2; ++nt2)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (!keep_half(r, (e >> 1) * 4 + nt2 * 2 + (e & 1))) p[2 * ks + nt2][e] = 0.f;
        }
    }
};

// ---------------------------------------------------------------------------------------------- shared by the kernels
// Sequence `batch` of a packed (varlen) tensor of `total` rows: rows [start, start + len). Clamped to [0, total) and
// to max_len rows: cu_seqlens is checked by an asynchronous device assert (interface.py) that may fire only after the
// kernels ran, and the grid, the dropout mask's columns and the block-sparse lists are sized by max_len.
__device__ __forceinline__ void packed_seq(const int* cu_seqlens, int batch, int max_len, int total, int& start,
                                           int& len) {
    start = min_(max_(cu_seqlens[batch], 0), total);
    len = min_(min_(max_(cu_seqlens[batch + 1], start), total) - start, max_len);
}
// Where batch entry `batch` lives: varlen reads cu_seqlens, the batch form has start 0 and the fixed lengths.
__device__ __forceinline__ void seq_bounds(const FwdParams& p, int batch, int& q_start, int& k_start, int& seqlen_q,
                                           int& seqlen_k) {
    q_start = 0, k_start = 0, seqlen_q = p.seqlen_q, seqlen_k = p.seqlen_k;
    if (p.cu_seqlens_q != nullptr) {
        packed_seq(p.cu_seqlens_q, batch, p.seqlen_q, p.total_q, q_start, seqlen_q);
        packed_seq(p.cu_seqlens_k, batch, p.seqlen_k, p.total_k, k_start, seqlen_k);
    }
}
// The Hopper backward's padded rows (flash.h): batch entry `batch` starts at this row of lse_log2 / softmax_d /
// dq_accum, a multiple of block_m after the whole blocks of the entries before it, so that its query blocks, the last
// included, are whole blocks of those arrays (read by tensor copies, added by bulk reduce-adds). Batch mode: entries
// of ceil(seqlen_q / block_m) blocks (batch * that many rows in all; no padding when block_m divides seqlen_q).
// Varlen (first row q_start): all entries fit in total_q + batch * block_m rows.
__device__ __forceinline__ int padded_row_start(bool varlen, int batch, int q_start, int seqlen_q, int block_m) {
    if (!varlen) return batch * (ceil_div(seqlen_q, block_m) * block_m);
    return (q_start + batch * block_m) / block_m * block_m;
}
// The tile of queries from m0 and kBlockN keys from n0 needs masking: it holds keys past the end or, causal (bottom-
// right aligned), keys right of the diagonal of its first query.
template <bool kIsCausal, int kBlockN>
__device__ __forceinline__ bool tile_needs_mask(int m0, int n0, int seqlen_q, int seqlen_k) {
    return n0 + kBlockN > seqlen_k || (kIsCausal && n0 + kBlockN - 1 > m0 + seqlen_k - seqlen_q);
}

// Local window (a score modification, FwdParams window_left / window_right): row i sees key j iff
// i + offset - left <= j <= i + offset + right, offset = seqlen_k - seqlen_q, a bound < 0 unbounded (causal: the right
// bound is the diagonal, which the causal code handles). The helpers below are each kernel's window arithmetic.
// Whether some row of [m0, last_row] has its window's start inside the key tile [n0, n0 + kBlockN), or its end before
// the tile's last key: the tile needs the window's per-element mask.
template <bool kIsCausal, int kBlockN>
__device__ __forceinline__ bool window_cuts_tile(int m0, int last_row, int n0, int offset, int left, int right) {
    return (left >= 0 && last_row + offset - left > n0) ||
           (!kIsCausal && right >= 0 && n0 + kBlockN - 1 > m0 + offset + right);
}
// Narrows the key blocks [n_block_min, n_block_max) of the query block at m0 to those holding a key some row sees.
template <bool kIsCausal, int kBlockM, int kBlockN>
__device__ __forceinline__ void window_key_blocks(int m0, int seqlen_q, int offset, int left, int right,
                                                  int& n_block_min, int& n_block_max) {
    if (!kIsCausal && right >= 0) {
        const int last_visible = min_(seqlen_q, m0 + kBlockM) + offset + right;  // exclusive
        n_block_max = min_(n_block_max, ceil_div(max_(last_visible, 0), kBlockN));
    }
    if (left >= 0) n_block_min = max_(m0 + offset - left, 0) / kBlockN;
}
// Narrows the query blocks [m_block_min, m_block_end) of the key tile at n0 to those with a row that sees one of its
// keys.
template <bool kIsCausal, int kBlockM, int kBlockN>
__device__ __forceinline__ void window_query_blocks(int n0, int offset, int left, int right, int& m_block_min,
                                                    int& m_block_end) {
    if (!kIsCausal && right >= 0) m_block_min = max_(0, n0 - offset - right) / kBlockM;
    if (left >= 0) {
        const int last_row = n0 + kBlockN - 1 - offset + left;  // inclusive
        m_block_end = last_row < 0 ? 0 : min_(m_block_end, last_row / kBlockM + 1);
    }
}

// Forward, one row (half hf: row g or g + 8) of a thread's S fragment s[kNT][4] in the mma / wgmma accumulator layout:
// online softmax in base 2. Updates the running max m and the thread's partial sum l, turns s into
// p = exp2(s * scale_log2 - m * scale_log2) and returns the factor the row's O accumulators must be rescaled by
// (rescale_row; kept apart so that a kernel can rescale O only once an asynchronous P V product into it is done).
// kPolyExp: the odd n8 tiles' exponentials on the FMA pipe (poly_exp2), the even ones' on MUFU.
// kLazyMax: the row keeps its running max unless the block's exceeds it by more than kLazyMaxLog2 binary orders of
// the exponent (FlashAttention-4's conditional rescaling): p is then up to 2^kLazyMaxLog2, and the correction exactly 1,
// so that the caller may skip rescaling O (the Hopper forward, where no row of the warp moved its max).
// kRefMax (the Hopper forward's unmasked steps, flash_fwd_sm90.cuh FT_FWD_REF_MAX): no block max; the exponentials
// against the running max as it stands (finite: set by an earlier block), the correction exactly 1. No overflow guard
// here (a score 128 binary orders above the running max gives inf): the caller checks the sums (FT_FWD_REF_MAX=2).
constexpr float kLazyMaxLog2 = 8.f;
template <int kNT, bool kPolyExp = false, bool kRowBias = false, bool kLazyMax = false, bool kRefMax = false>
__device__ __forceinline__ float softmax_exp_row(float (&s)[kNT][4], int hf, float& row_max, float& row_sum,
                                                 float scale_log2, float row_bias = 0.f) {
    static_assert(!(kPolyExp && kRowBias), "the FMA-pipe exponentials are softcap's, the row bias ALiBi's without it");
    static_assert(!kRefMax || !(kPolyExp || kRowBias || kLazyMax), "kRefMax: the plain exponentials only");
    float m_scaled, correction = 1.f;
    if constexpr (kRefMax) {
        m_scaled = row_max * scale_log2;
    } else {
        float mx = kRowBias ? -infinity() : row_max;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) mx = fmax_(mx, fmax_(s[nt][2 * hf], s[nt][2 * hf + 1]));
        // kRowBias: this lane's scores are s + row_bias (alibi_by_rows; the bias differs between a quad's lanes)
        if constexpr (kRowBias) mx = fmax_(row_max, mx + row_bias);
        mx = fmax_(mx, shfl_xor(mx, 1));  // the 4 lanes of a quad share a row
        mx = fmax_(mx, shfl_xor(mx, 2));
        // (kLazyMax: an m of -inf always moves to a finite block max; -inf - -inf is NaN: kept)
        if constexpr (kLazyMax) mx = (mx - row_max) * scale_log2 > kLazyMaxLog2 ? mx : row_max;
        // A row that saw only masked keys so far keeps m = -inf; subtract 0 instead to avoid inf - inf.
        m_scaled = mx == -infinity() ? 0.f : mx * scale_log2;
        // (kLazyMax: exactly 1 kept)
        correction = kLazyMax && mx == row_max ? 1.f : fast_exp2(row_max * scale_log2 - m_scaled);
        row_max = mx;
    }
    // kRowBias: exp2((s + row_bias) scale_log2 - m_scaled) with the bias in the constant
    const float shift = kRowBias ? fmaf(row_bias, scale_log2, -m_scaled) : -m_scaled;
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            float& x = s[nt][2 * hf + e];
            if constexpr (kRowBias)
                x = fast_exp2(fmaf(x, scale_log2, shift));
            else
                x = kPolyExp && nt % 2 == 1 ? poly_exp2(x * scale_log2 - m_scaled)
                                            : fast_exp2(x * scale_log2 - m_scaled);
            sum += x;
        }
    row_sum = row_sum * correction + sum;  // the max moved: rescale the running sum
    return correction;
}
template <int kDT> __device__ __forceinline__ void rescale_row(float (&o)[kDT][4], int hf, float correction) {
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
        o[dt][2 * hf] *= correction;
        o[dt][2 * hf + 1] *= correction;
    }
}
template <int kNT, int kDT>
__device__ __forceinline__ void softmax_update_row(float (&s)[kNT][4], float (&o)[kDT][4], int hf, float& row_max,
                                                   float& row_sum, float scale_log2) {
    rescale_row(o, hf, softmax_exp_row(s, hf, row_max, row_sum, scale_log2));
}

// Forward epilogue of one row (half hf): sums the quad's partial sums l, scales the row's O accumulators by 1 / l
// (times 1 / (1 - p) with dropout; 0 for a row with no visible key or an underflowed sum) and returns l.
template <bool kIsDropout, int kDT>
__device__ __forceinline__ float finish_row(float (&o)[kDT][4], int hf, float row_sum, float rp_dropout) {
    float sum = row_sum;
    sum += shfl_xor(sum, 1);
    sum += shfl_xor(sum, 2);
    const float inv = !(sum > 0.f) ? 0.f : (kIsDropout ? rp_dropout : 1.f) / sum;
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
        o[dt][2 * hf] *= inv;
        o[dt][2 * hf + 1] *= inv;
    }
    return sum;
}
// Forward key-block walk, from the last block to the first: block-sparse, the tiles of `walk` from first_block on
// (step(n_block, next tile or -1, mask tag)); dense, first_block down to 0, the blocks that need a mask first (in this
// order they come first) with the masked copy of the step, then the mask-free copy (step(n_block, -1, tag)).
template <bool kIsBlockSparse, class Walk, class NeedsMask, class Step>
__device__ __forceinline__ void walk_key_blocks(int first_block, Walk& walk, const NeedsMask& needs_mask,
                                                const Step& step) {
    if constexpr (kIsBlockSparse) {
        for (int n_block = first_block; n_block >= 0;) {
            const int n_block_next = walk.next();
            if (needs_mask(n_block)) step(n_block, n_block_next, BoolConstant<true>{});
            else step(n_block, n_block_next, BoolConstant<false>{});
            n_block = n_block_next;
        }
    } else {
        int n_block = first_block;
        for (; n_block >= 0; --n_block) {
            if (!needs_mask(n_block)) break;
            step(n_block, -1, BoolConstant<true>{});
        }
        for (; n_block >= 0; --n_block) step(n_block, -1, BoolConstant<false>{});
    }
}
// Score modifications of the FT_SCORE_MODS kernels (flash.h FwdParams), on a warp's S fragment s[kMT][kNT][4]
// (mma layout: element (mt, nt, e) is row row0 + mt * 16 + g + 8 * (e / 2), column col0 + nt * 8 + 2 * t + e % 2), in
// raw q.k units: softcap s -> softcap_unscale * tanh(s * softcap_scale), then ALiBi s -= slope / scale * |i + offset - j|
// (alibi_scaled: slope / softmax_scale of this (batch, head); 0: none). Each off when its parameter is 0.
// One warp's m16 rows: s[kNT][4] (also the wgmma accumulator of a warp's 16 rows), rows row0 + g, row0 + g + 8.
template <int kNT>
__device__ __forceinline__ void apply_score_mods(float (&s)[kNT][4], float softcap_scale, float softcap_unscale,
                                                 float alibi_scaled, int row0, int col0, int offset, int lane) {
    const int g = lane >> 2, t = lane & 3;
    if (softcap_scale != 0.f) {
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nt][e] = softcap_unscale * fast_tanh(s[nt][e] * softcap_scale);
    }
    if (alibi_scaled != 0.f) {
        // the distance in fp32 (exact below 2^24) from one conversion: an int-to-float per score would run on the
        // MUFU pipe, which the exponentials need
        const float d0 = (float)(row0 + g + offset - col0 - 2 * t);
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                s[nt][e] = fmaf(-alibi_scaled, fabsf(d0 + (float)(8 * (e >> 1) - nt * 8 - (e & 1))), s[nt][e]);
    }
}
// ALiBi on one warp's m16 rows at one FFMA per score (the Hopper forward; apply_score_mods spends an FADD and an FFMA):
// where every pair of the warp's 16 rows x kNT * 8 columns lies on one side of the diagonal (sign sg of
// i + offset - j; with causal masking every visible pair does), -slope |d| = sg slope (8 nt + e % 2) + bias_r with
// bias_r = -sg slope (row0 + g + 8 r + offset - col0 - 2 t) the same for all of a lane's scores in row r: the scores
// get the first term, and the lane's bias goes to softmax_exp_row (kRowBias), which adds it to the lane's maximum
// before the quad's shuffles and to the exponent's constant, at no cost per score. Returns false, changing nothing,
// where the warp's pairs straddle the diagonal (not causal): apply_score_mods' ALiBi then.
template <bool kIsCausal, int kNT>
__device__ __forceinline__ bool alibi_by_rows(float (&s)[kNT][4], float alibi_scaled, int row0, int col0, int offset,
                                              int lane, float (&row_bias)[2]) {
    float sg = 1.f;
    if constexpr (!kIsCausal) {
        if (row0 + offset - (col0 + kNT * 8 - 1) < 0) {  // not all of them at or below it
            if (row0 + 15 + offset - col0 > 0) return false;
            sg = -1.f;
        }
    }
    const int g = lane >> 2, t = lane & 3;
    const float a = sg * alibi_scaled, d0 = (float)(row0 + g + offset - col0 - 2 * t);
    row_bias[0] = -a * d0;
    row_bias[1] = -a * (d0 + 8.f);
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] = fmaf(a, (float)(8 * nt + (e & 1)), s[nt][e]);
    return true;
}
template <int kMT, int kNT>
__device__ __forceinline__ void apply_score_mods(float (&s)[kMT][kNT][4], float softcap_scale, float softcap_unscale,
                                                 float alibi_scaled, int row0, int col0, int offset, int lane) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
        apply_score_mods(s[mt], softcap_scale, softcap_unscale, alibi_scaled, row0 + mt * 16, col0, offset, lane);
}

// lse = m * scale + ln(l) of a row finish_row returned l for; -inf for a row with no visible key.
__device__ __forceinline__ float row_lse(float sum, float row_max, float softmax_scale) {
    return !(sum > 0.f) ? -infinity() : row_max * softmax_scale + fast_log2(sum) / kLog2e;
}

// ---------------------------------------------------------------------------------------------- block sparsity
// A list of non-zero block-mask blocks (flash.h, bs_rows / bs_cols) is list[0] = count, then count mask blocks
// ascending; mask block b covers kernel tiles b * kSub .. b * kSub + kSub - 1 (kSub = kBlockSparseSize / tile size).

// Forward: the tiles of one list from the last to the first.
template <int kSub> struct SparseWalkDesc {
    const int* list;
    int entry, sub;  // current tile = list[1 + entry] * kSub + sub; entry < 0: walk done
    __device__ __forceinline__ void init(const int* list_) {
        list = list_;
        entry = list_[0] - 1;
        sub = kSub - 1;
    }
    __device__ __forceinline__ int tile() const { return entry < 0 ? -1 : list[1 + entry] * kSub + sub; }
    __device__ __forceinline__ int next() {  // the tile after the current one, -1 at the end
        if (--sub < 0) sub = kSub - 1, --entry;
        return tile();
    }
    __device__ __forceinline__ int skip_to_below(int end) {  // first tile < end (-1: none), the walk left there
        int t = tile();
        while (t >= end) t = next();
        return t;
    }
};

// Backward: (query head, query tile) pairs of one key tile, ascending: for each query head of the GQA group
// (head_i = 0 .. group - 1), the tiles in [tile_begin, tile_end) of its list (list_of(head_i)).
template <int kSub> struct SparseWalkAsc {
    int head_i = 0, entry = 0, sub = 0;  // current tile = list_of(head_i)[1 + entry] * kSub + sub
    // Move to the first valid pair at or after the current position; false when there is none.
    template <class ListOf>
    __device__ __forceinline__ bool settle(const ListOf& list_of, int group, int tile_begin, int tile_end) {
        for (; head_i < group; ++head_i, entry = 0, sub = 0) {
            const int* list = list_of(head_i);
            for (const int count = list[0]; entry < count;) {
                const int t = list[1 + entry] * kSub + sub;
                if (t >= tile_end) break;  // ascending: the rest of this head's list is past the end too
                if (t >= tile_begin) return true;
                advance();
            }
        }
        return false;
    }
    __device__ __forceinline__ void advance() {
        if (++sub == kSub) sub = 0, ++entry;
    }
    template <class ListOf> __device__ __forceinline__ int tile(const ListOf& list_of) const {
        return list_of(head_i)[1 + entry] * kSub + sub;
    }
};

}  // namespace flashtrain
