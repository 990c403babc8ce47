// Mask expressions (mask_mod, flashtrain/kernels/mask_mod.py): the user's C expression over b, h, q_idx, kv_idx and up
// to four integer / bool tensors, compiled in as a device predicate. The build path passes the expression as macros
// (MaskMod.kernel_defines): FT_MASK_DECLS declares each tensor's pointer, sizes and strides from MaskModParams `mm`,
// FT_MASK_EXPR is the expression with every subscript checked against its tensor's size (FT_MM_OOB on a miss: the
// error word is set and the element reads as 0, so a bad subscript never reads outside the tensor).
#pragma once
#include "utils.cuh"

// The entry files' feature switches (build.py passes them): FT_SCORE_MODS (window / softcap / ALiBi; the Hopper
// backward's 1 or 2, not its window-only 3; see flash_bwd_sm90.cuh), FT_MASK_MOD from whether an expression is
// compiled in.
#ifndef FT_SCORE_MODS
#define FT_SCORE_MODS 0
#endif
#ifdef FT_MASK_EXPR
#define FT_MASK_MOD 1
#else
#define FT_MASK_MOD 0
#endif

namespace flashtrain {

// (MaskModParams: flash.h)

__device__ __forceinline__ long long mask_mod_oob(const MaskModParams& mm) {
    if (mm.error != nullptr) atomicOr(mm.error, 1);
    return 0;
}

#ifdef FT_MASK_EXPR
#define FT_MM_OOB() mask_mod_oob(mm)
// Whether query q_idx attends to key kv_idx (positions in the sequence) of sequence b, query head h.
__device__ __forceinline__ bool mask_mod_visible(const MaskModParams& mm, long long b, long long h, long long q_idx,
                                                 long long kv_idx) {
    FT_MASK_DECLS
    return (FT_MASK_EXPR) != 0;
}
#undef FT_MM_OOB
#else
// (kernels built without an expression never call it; declared so that their templates' non-dependent calls resolve)
__device__ __forceinline__ bool mask_mod_visible(const MaskModParams&, long long, long long, long long, long long) {
    return true;
}
#endif

// The expression on a partial tile of an mma.sync S fragment s[kMT][kNT][4] (a warp's rows row0 + 16 mt + g (+ 8),
// columns col0 + 8 nt + 2 t (+ 1); positions in the sequence): -inf where it is false. Pairs past either end are
// masked and never evaluated (a subscript there could leave its tensor and set the error word).
template <int kMT, int kNT>
__device__ __forceinline__ void apply_mask_mod(float (&s)[kMT][kNT][4], const MaskModParams& mm, int batch, int head,
                                               int row0, int col0, int seqlen_q, int seqlen_k, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = row0 + mt * 16 + g + 8 * (e >> 1), col = col0 + nt * 8 + 2 * t + (e & 1);
                if (row >= seqlen_q || col >= seqlen_k || !mask_mod_visible(mm, batch, head, row, col))
                    s[mt][nt][e] = -infinity();
            }
}

}  // namespace flashtrain
