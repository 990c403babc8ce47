// Hopper backward kernel entry point (sm_90a only; flash_bwd_sm90.cuh). build.py names the kernel and passes the tile
// shape and the features as FT_* macros.
#include "flash_bwd_sm90.cuh"

// FT_BLOCK_N: 96 for the hd192 kernel on 96-key tiles (build.py passes it only there); 0: the head dim's default
#ifndef FT_BLOCK_N
#define FT_BLOCK_N 0
#endif
using Traits = flashtrain::BwdSm90Traits<FT_HEAD_DIM, FT_BLOCK_M, FT_STAGES, FT_BF16, FT_CAUSAL, FT_DROPOUT,
                                          FT_BLOCK_SPARSE, FT_DETERMINISTIC, FT_PERSISTENT, FT_HEAD_DIM_EFF,
                                          FT_SCORE_MODS, FT_MASK_MOD, FT_BLOCK_N>;
static_assert(Traits::kSmemBytes == FT_SMEM_BYTES, "build.py and the kernel disagree on the shared memory size");
static_assert(Traits::kNThreads == FT_THREADS, "build.py and the kernel disagree on the block size");

// The dynamic tile scheduler's counters (BwdSm90Params::tile_counter points at one), as the forward's
// (flash_fwd_sm90.cu): zero when the module loads, left at zero by every launch, one per stream.
extern "C" {
__device__ int flashtrain_tile_counters[FT_MAX_STREAMS];
}

// One CTA per SM (__launch_bounds__(threads, 1)): the register cap at entry that setmaxnreg needs.
extern "C" __global__ void __launch_bounds__(Traits::kNThreads, 1)
    FT_KERNEL_NAME(const __grid_constant__ flashtrain::BwdSm90Params params) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    flashtrain::flash_bwd_sm90<Traits>(params);
#endif
}
