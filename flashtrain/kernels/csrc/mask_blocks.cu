// The block states of a mask expression (mask_mod.cuh): per tile of kMaskBlock x kMaskBlock (query, key) pairs of a
// (sequence, head), 0 when the expression is false for every pair, 2 when true for every pair, 1 otherwise -- the
// skip list of the attention kernels (empty tiles are not computed, full ones need no mask), evaluated exactly on the
// GPU from the same compiled expression. One CTA per tile, kMaskBlocksThreads threads, each evaluating every
// kMaskBlocksThreads-th pair; pairs past a sequence's end do not count. grid (n_kblocks, n_qblocks, B' * H'), B' = 1
// unless the expression reads b (or the sequences are varlen), H' = 1 unless it reads h. FT_KERNEL_NAME is
// build.mask_blocks_kernel's name (one per expression).
#include "mask_mod.cuh"

namespace flashtrain {

constexpr int kMaskBlocksThreads = 256;  // = build.MASK_BLOCKS_THREADS

struct MaskBlocksParams {  // = launch.MaskBlocksParams
    MaskModParams mm;
    unsigned char* states;  // (B', H', n_qblocks, n_kblocks), contiguous
    const int* cu_seqlens_q;  // varlen: (B' + 1,) each; else null
    const int* cu_seqlens_k;
    int heads;  // H'
    int seqlen_q, seqlen_k;  // lengths (varlen: the maximum ones)
    int n_qblocks, n_kblocks;
    int block;  // tile side (128: the kernels' block-sparse size)
};

}  // namespace flashtrain

extern "C" __global__ void __launch_bounds__(flashtrain::kMaskBlocksThreads)
    FT_KERNEL_NAME(const __grid_constant__ flashtrain::MaskBlocksParams p) {
    using namespace flashtrain;
    const int kb = blockIdx.x, qb = blockIdx.y, b = blockIdx.z / p.heads, h = blockIdx.z % p.heads;
    int len_q = p.seqlen_q, len_k = p.seqlen_k;
    if (p.cu_seqlens_q != nullptr) {
        len_q = p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b];
        len_k = p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b];
    }
    const int q0 = qb * p.block, k0 = kb * p.block;
    const int rows = min(p.block, len_q - q0), cols = min(p.block, len_k - k0);  // (<= 0: no pair)
    bool any = false, all = true;
    if (rows > 0 && cols > 0) {
        for (int i = threadIdx.x; i < rows * cols; i += kMaskBlocksThreads) {
            const bool v = mask_mod_visible(p.mm, b, h, q0 + i / cols, k0 + i % cols);
            any |= v;
            all &= v;
        }
    }
    any = __syncthreads_or(any);
    all = __syncthreads_and(all);
    if (threadIdx.x == 0)
        p.states[((i64)blockIdx.z * p.n_qblocks + qb) * p.n_kblocks + kb] =
            !any ? 0 : all ? 2 : 1;
}
