// Hopper forward kernel entry point (sm_90a only; flash_fwd_sm90.cuh). build.py names the kernel and passes the tile
// shape and the features as FT_* macros.
#include "flash_fwd_sm90.cuh"

#ifndef FT_HEAD_DIM_EFF
#define FT_HEAD_DIM_EFF FT_HEAD_DIM
#endif
#ifndef FT_CLUSTER
#define FT_CLUSTER 1
#endif

using Traits = flashtrain::FwdSm90Traits<FT_HEAD_DIM, FT_BLOCK_M, FT_BLOCK_N, FT_STAGES, FT_SEPARATE_O, FT_BF16,
                                          FT_CAUSAL, FT_DROPOUT, FT_BLOCK_SPARSE, FT_Q_BUFFERS, FT_SCORE_MODS,
                                          FT_MASK_MOD, FT_HEAD_DIM_EFF, FT_CLUSTER>;
static_assert(Traits::kSmemBytes == FT_SMEM_BYTES, "build.py and the kernel disagree on the shared memory size");
static_assert(Traits::kNThreads == FT_THREADS, "build.py and the kernel disagree on the block size");

// The dynamic tile scheduler's counters (FwdSm90Params::tile_counter points at one): zero when the module loads, left
// at zero by every launch; one per stream (launch.py hands them out), so concurrent launches never share one. They
// live in the module rather than in a torch allocation so that CUDA-graph capture sees no allocation of ours.
extern "C" {
__device__ int flashtrain_tile_counters[FT_MAX_STREAMS];
}

// One CTA per SM (__launch_bounds__(threads, 1)): the register cap at entry that setmaxnreg needs. FT_CLUSTER 2: the
// grid comes in clusters of two CTAs (compile-time cluster dims: a plain launch of an even grid).
#if FT_CLUSTER > 1
#define FT_CLUSTER_DIMS __cluster_dims__(FT_CLUSTER, 1, 1)
#else
#define FT_CLUSTER_DIMS
#endif
extern "C" __global__ void FT_CLUSTER_DIMS __launch_bounds__(Traits::kNThreads, 1)
    FT_KERNEL_NAME(const __grid_constant__ flashtrain::FwdSm90Params params) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    flashtrain::flash_fwd_sm90<Traits>(params);
#endif
}
