// Forward kernel entry point. One instantiation per compilation: build.py's dispatch table passes the tile shape and
// the features as FT_* macros and names the kernel (extern "C", so the cubin symbol is exactly FT_KERNEL_NAME).
#include "flash_fwd.cuh"

#ifndef FT_WARPS_D  // warps sharing a row group (head dim 512); the other kernels do not define it
#define FT_WARPS_D 1
#endif

using Traits = flashtrain::FwdTraits<FT_HEAD_DIM, FT_BLOCK_M, FT_BLOCK_N, FT_NWARPS, FT_BF16, FT_CAUSAL, FT_DROPOUT,
                                     FT_BLOCK_SPARSE, FT_SCORE_MODS, FT_MASK_MOD, FT_WARPS_D>;
static_assert(Traits::kSmemBytes == FT_SMEM_BYTES, "build.py and the kernel disagree on the shared memory size");

extern "C" __global__ void __launch_bounds__(Traits::kNThreads, 1)
    FT_KERNEL_NAME(const __grid_constant__ flashtrain::FwdParams params) {
    flashtrain::flash_fwd<Traits>(params);
}
