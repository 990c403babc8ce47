// Hopper backward kernel entry point (sm_90a only; flash_bwd_sm90.cuh). build.py names the kernel and passes the
// features as FT_* macros.
#include "flash_bwd_sm90.cuh"

using Traits = flashtrain::BwdSm90Traits<FT_HEAD_DIM, FT_BF16, FT_CAUSAL, FT_DROPOUT, FT_BLOCK_SPARSE>;
static_assert(Traits::kSmemBytes == FT_SMEM_BYTES, "build.py and the kernel disagree on the shared memory size");

extern "C" __global__ void __launch_bounds__(Traits::kNThreads, FT_MIN_BLOCKS)
    FT_KERNEL_NAME(const __grid_constant__ flashtrain::BwdParams params) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    flashtrain::flash_bwd_sm90<Traits>(params);
#endif
}
