// Mask expressions (issue 20, flashtrain/kernels/mask_mod.py): the user's C expression over b, h, q_idx, kv_idx and up
// to four integer / bool tensors, compiled in as a device predicate. The build path passes the expression as macros
// (MaskMod.kernel_defines): FT_MASK_DECLS declares each tensor's pointer, sizes and strides from MaskModParams `mm`,
// FT_MASK_EXPR is the expression with every subscript checked against its tensor's size (FT_MM_OOB on a miss: the
// error word is set and the element reads as 0, so a bad subscript never reads outside the tensor).
#pragma once
#include "utils.cuh"

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

}  // namespace flashtrain
