// The block states of a mask expression (mask_mod.cuh): per tile of `block` x `block` (query, key) pairs of a
// (sequence, head), 0 when the expression is false for every pair, 2 when true for every pair, 1 otherwise -- the
// skip list of the attention kernels (empty tiles are not computed, full ones need no mask), evaluated exactly on the
// GPU from the same compiled expression. One CTA per tile, kMaskBlocksThreads threads: thread t evaluates column
// t % block of rows t / block, t / block + kMaskBlocksThreads / block, ... (block: a power of two <= 256, no
// division per pair); pairs past a sequence's end do not count. A tile that the call's causal mask or window hides
// entirely is 0 without evaluating it (the attention kernels never visit it). grid (n_kblocks * B' * H', n_qblocks),
// B' = 1 unless the expression reads b (or the sequences are varlen), H' = 1 unless it reads h. FT_KERNEL_NAME is
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
    int block;  // tile side (128: the kernels' block-sparse size); a power of two <= kMaskBlocksThreads
    int window_left, window_right;  // the call's window in keys before / after the diagonal (causal: right 0); -1: none
};

}  // namespace flashtrain

extern "C" __global__ void __launch_bounds__(flashtrain::kMaskBlocksThreads)
    FT_KERNEL_NAME(const __grid_constant__ flashtrain::MaskBlocksParams p) {
    using namespace flashtrain;
    const int kb = blockIdx.x % p.n_kblocks, bh = blockIdx.x / p.n_kblocks, qb = blockIdx.y;
    const int b = bh / p.heads, h = bh % p.heads;
    int len_q = p.seqlen_q, len_k = p.seqlen_k;
    if (p.cu_seqlens_q != nullptr) {
        len_q = p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b];
        len_k = p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b];
    }
    const int q0 = qb * p.block, k0 = kb * p.block;
    const int rows = min(p.block, len_q - q0), cols = min(p.block, len_k - k0);  // (<= 0: no pair)
    // the tile's key - query distances, from the diagonal (bottom-right aligned: key = query + len_k - len_q)
    const int lowest = k0 - (q0 + rows - 1) - (len_k - len_q), highest = k0 + cols - 1 - q0 - (len_k - len_q);
    const bool hidden = (p.window_right >= 0 && lowest > p.window_right) ||
                        (p.window_left >= 0 && highest < -p.window_left);
    bool any = false, all = true;
    if (rows > 0 && cols > 0 && !hidden) {
        const int col = threadIdx.x % p.block, row_step = kMaskBlocksThreads / p.block;
        if (col < cols) {
            for (int row = threadIdx.x / p.block; row < rows; row += row_step) {
                const bool v = mask_mod_visible(p.mm, b, h, q0 + row, k0 + col);
                any |= v;
                all &= v;
            }
        }
    }
    any = __syncthreads_or(any);
    all = __syncthreads_and(all);
    if (threadIdx.x == 0)
        p.states[((i64)bh * p.n_qblocks + qb) * p.n_kblocks + kb] = !any ? 0 : all ? 2 : 1;
}
