// Backward kernel entry point, one instantiation per compilation (FT_* macros from build.py's dispatch table).
#include "flash_bwd.cuh"

#ifndef FT_DQ_CHUNKS  // dQ in pieces of a warp's columns (head dim 512); the other kernels do not define it
#define FT_DQ_CHUNKS 1
#endif

using Traits = flashtrain::BwdTraits<FT_HEAD_DIM, FT_BLOCK_M, FT_BLOCK_N, FT_NWARPS, FT_WARPS_M_SDP, FT_WARPS_N_DKV,
                                     FT_WARPS_M_DQ, FT_STAGES, FT_SCRAMBLE_DQ, FT_VEC_ROW_STATS, FT_BF16, FT_CAUSAL,
                                     FT_DROPOUT, FT_BLOCK_SPARSE, FT_SCORE_MODS, FT_MASK_MOD,
                                     FT_DQ_CHUNKS>;
static_assert(Traits::kSmemBytes == FT_SMEM_BYTES, "build.py and the kernel disagree on the shared memory size");

extern "C" __global__ void __launch_bounds__(Traits::kNThreads, 1)
    FT_KERNEL_NAME(const __grid_constant__ flashtrain::BwdParams params) {
    flashtrain::flash_bwd<Traits>(params);
}
