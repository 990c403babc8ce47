// Hopper (sm_90a) warpgroup MMA: shared-memory matrix descriptors, fences and wgmma.mma_async wrappers.
//
// A warpgroup (4 consecutive warps, 128 threads) computes D (64 x N, fp32) += A (64 x 16) B (16 x N) in one
// asynchronous instruction. Accumulator layout: warp w of the group holds rows 16w .. 16w + 15, exactly as mma.sync
// m16n8k16 lays out a 16 x 8 C tile (utils.cuh), repeated over the N / 8 column tiles: d[j][0..3] = C[16w + g][8j +
// 2t .. + 1], C[16w + g + 8][8j + 2t .. + 1]. A from registers (wgmma_rs) uses mma.sync's A fragment layout, so the
// S accumulators repack into P operands exactly as in the mma.sync forward (acc_to_a_frag).
//
// Shared operands are described by 64-bit descriptors. SmemTile (utils.cuh) stores a tile as column blocks of 64
// 16-bit values: 128-byte rows whose 16-byte chunks are XOR-swizzled by (row % 8) -- bit for bit the hardware's
// 128-byte swizzle, given a 1024-byte aligned tile. So:
//   K-major operand (the reduction dim is the tile's column dim: Q and K in S = Q K^T): 8-row groups are 1024 bytes
//     apart (stride byte offset); the k-th 16-column slice of a column block starts 32 k bytes into it (the hardware
//     applies the swizzle to the final address, so advancing the start address inside the 128-byte row is exact).
//   MN-major operand (transposed B: V in O = P V, whose rows are the reduction dim): the 16 rows of one k-step are two
//     8-row groups 1024 bytes apart (stride byte offset); 64-column blocks are kRows * 128 bytes apart (leading byte
//     offset); the k-th step starts 16 k rows down.
// Bits: 0-13 start address >> 4, 16-29 leading byte offset >> 4, 32-45 stride byte offset >> 4, 62-63 swizzle
// (1 = 128-byte).
#pragma once
#include "utils.cuh"

namespace flashtrain {

// The descriptor of the operand at base + offset_bytes (offset a multiple of 16). FT_DESC_ADD=1 (the default since
// 2026-11-25; 0 for A/Bs): built once from base and moved by one 32-bit add to the start-address field (address / 16
// of a shared-memory address below 256 KB: the add never carries out of it); with 0 each descriptor is built from its
// address (five uniform instructions per wgmma operand in SASS against two; the forward's ping-pong turn, from
// BAR.SYNC to BAR.ARV, 77 -> 47 instructions per block at hd64). 2 (the backward's FT_BWD_LEAN_ADDR kernels, the call
// sites of flash_bwd_sm90.cuh bdesc and flash_fwd_sm90.cuh FT_FWD_DESC64): the address field without its mask and one
// 64-bit add to the whole descriptor, so that ptxas keeps no separate high word per operand. Form 2 needs addresses
// below 256 KB: not in cluster launches (the 2-CTA forward computed wrong outputs with it; bits above 17 of its
// addresses would land in the leading byte offset). Form 3 (call sites only): form 2's add on the masked address, for
// cluster launches.
// kSwizzle: the descriptor's swizzle mode (bits 62-63), 1 = 128-byte (every tile but one), 2 = 64-byte (SmemTile's
// 32-column blocks: the hd192 backward's K tile, flash_bwd_sm90_split_keys_mma; 8-row groups 512 bytes apart).
#ifndef FT_DESC_ADD
#define FT_DESC_ADD 1
#endif
// gmma_desc_form<kForm>: the descriptor in FT_DESC_ADD's form kForm whatever FT_DESC_ADD is (for call sites that pick
// their own: flash_bwd_sm90.cuh bdesc).
template <int kSwizzle = 1, int kForm = FT_DESC_ADD>
__device__ __forceinline__ u64 gmma_desc(u32 smem_addr, u32 leading_bytes, u32 stride_bytes) {
    static_assert(kSwizzle == 1 || kSwizzle == 2, "128-byte or 64-byte swizzle");
    return (u64)((kForm == 2 ? smem_addr : smem_addr & 0x3ffff) >> 4) |
           ((u64)((leading_bytes >> 4) & 0x3fff) << 16) | ((u64)((stride_bytes >> 4) & 0x3fff) << 32) |
           ((u64)kSwizzle << 62);
}
template <int kForm, int kSwizzle = 1>
__device__ __forceinline__ u64 gmma_desc_form(u32 base, u32 offset_bytes, u32 leading_bytes, u32 stride_bytes) {
    if constexpr (kForm == 2) {
        return gmma_desc<kSwizzle, kForm>(base, leading_bytes, stride_bytes) + (u64)(offset_bytes >> 4);
    } else if constexpr (kForm == 3) {  // form 2's 64-bit add on the masked address (any launch)
        return gmma_desc<kSwizzle, 1>(base, leading_bytes, stride_bytes) + (u64)(offset_bytes >> 4);
    } else if constexpr (kForm == 1) {
        const u64 desc = gmma_desc<kSwizzle, kForm>(base, leading_bytes, stride_bytes);
        return ((desc >> 32) << 32) | (u32)((u32)desc + (offset_bytes >> 4));
    } else {
        return gmma_desc<kSwizzle, kForm>(base + offset_bytes, leading_bytes, stride_bytes);
    }
}
template <int kSwizzle = 1>
__device__ __forceinline__ u64 gmma_desc_at(u32 base, u32 offset_bytes, u32 leading_bytes, u32 stride_bytes) {
    return gmma_desc_form<FT_DESC_ADD, kSwizzle>(base, offset_bytes, leading_bytes, stride_bytes);
}
// Before the first wgmma of a batch: the registers it reads (accumulators, A fragments) were written by plain code.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int kPending> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}
// Shared memory written through the generic proxy (st.shared, cp.async) is read by wgmma through the async proxy.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// Pin accumulators in place around an asynchronous batch: the compiler may not move or copy them across this point.
template <int kN> __device__ __forceinline__ void fence_operand(float (&d)[kN][4]) {
#pragma unroll
    for (int i = 0; i < kN; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) asm volatile("" : "+f"(d[i][j])::"memory");
}

// D (64 x N) = A B + (scale_d ? D : 0), A and B in shared memory, both K-major.
template <int N, bool kIsBF16>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 8][4], u64 desc_a, u64 desc_b, int scale_d);
// D (64 x N) = A B + (scale_d ? D : 0), A in registers (4 x 2 16-bit values per thread), B in shared memory, MN-major.
template <int N, bool kIsBF16>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 8][4], const u32 (&a)[4], u64 desc_b, int scale_d);
// D (64 x N) = A B + (scale_d ? D : 0), A and B in shared memory, both MN-major (A's M and B's N are contiguous).
template <int N, bool kIsBF16>
__device__ __forceinline__ void wgmma_ss_tt(float (&d)[N / 8][4], u64 desc_a, u64 desc_b, int scale_d);
// The same with D = A B (scale_d 0): the accumulators are write-only operands (their old values are dead).
template <int N, bool kIsBF16>
__device__ __forceinline__ void wgmma_ss_tt_init(float (&d)[N / 8][4], u64 desc_a, u64 desc_b, int scale_d);
// D (64 x N) = A B + (scale_d ? D : 0), A MN-major (its M contiguous), B K-major; _init: as wgmma_ss_tt_init.
template <int N, bool kIsBF16>
__device__ __forceinline__ void wgmma_ss_tn(float (&d)[N / 8][4], u64 desc_a, u64 desc_b, int scale_d);
template <int N, bool kIsBF16>
__device__ __forceinline__ void wgmma_ss_tn_init(float (&d)[N / 8][4], u64 desc_a, u64 desc_b, int scale_d);

}  // namespace flashtrain

#include "wgmma_ops.cuh"  // the specializations, generated by flashtrain/kernels/gen_wgmma.py
