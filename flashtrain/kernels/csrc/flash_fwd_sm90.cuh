// FlashAttention-2 forward (Algorithm 1) on Hopper tensor cores: the same algorithm, tiling and outputs as
// flash_fwd.cuh, with the two GEMMs issued as warpgroup MMAs (wgmma.cuh) instead of mma.sync.
//
// One CTA computes kBlockM query rows of one (batch, head) with kBlockM / 64 warpgroups; warpgroup w owns rows
// [64 w, 64 w + 64). build.py picks one warpgroup per CTA and several CTAs per SM (FT_MIN_BLOCKS): their barriers
// are independent, so one CTA's softmax runs while another's GEMMs occupy the tensor cores. K/V are streamed through
// shared memory in blocks of kBlockN keys, from the last block to the first, by every thread with cp.async, each
// copy overlapping the math of the other operand:
//     wait K[n]; issue V[n]    S = Q K[n]^T (wgmma, Q and K from shared memory)    mask
//     wait V[n]; issue K[n-1]  online softmax (as in flash_fwd.cuh)
//                              O += P V[n] (wgmma, P from registers)
// At the end out = O / l and lse = m * scale + ln(l); a row with no visible key gets out = 0, lse = -inf.
// Block-sparse (kIsBlockSparse; as in flash_fwd.cuh): the CTA walks only the key tiles of the non-zero blocks of its
// query block's row of the block mask, from the last to the first, cut and masked by causal and the end as the dense
// walk. Dropout: the same Philox bits as flash_fwd.cuh (utils.cuh DropoutRng addresses them by (batch * head, query,
// key) only). Head dims 64 and 128 (build.py routes everything else to flash_fwd.cuh).
// Causal masking is bottom-right aligned: query i sees key j iff j <= i + seqlen_k - seqlen_q.
#pragma once
#include "wgmma.cuh"

namespace flashtrain {

template <int kHeadDim_, int kBlockM_, int kBlockN_, bool kIsBF16_, bool kIsCausal_, bool kIsDropout_,
          bool kIsBlockSparse_>
struct FwdSm90Traits {
    static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_;
    static constexpr bool kIsBF16 = kIsBF16_, kIsCausal = kIsCausal_, kIsDropout = kIsDropout_;
    static constexpr bool kIsBlockSparse = kIsBlockSparse_;
    static_assert(!kIsBlockSparse || (kBlockSparseSize % kBlockM == 0 && kBlockSparseSize % kBlockN == 0),
                  "a block-sparse mask block must be a whole number of tiles");
    static constexpr int kNWarpGroups = kBlockM / 64, kNThreads = 128 * kNWarpGroups;
    static constexpr int kNT = kBlockN / 8;  // n8 column tiles of S per thread
    static constexpr int kDT = kHeadDim / 8;  // n8 column tiles of O per thread
    static_assert(kBlockM % 64 == 0 && (kBlockN == 64 || kBlockN == 128), "tile shape");
    static_assert(kHeadDim == 64 || kHeadDim == 128, "head dims 64 and 128 (128-byte swizzled column blocks)");
    using TileQ = SmemTile<kBlockM, kHeadDim>;
    using TileKV = SmemTile<kBlockN, kHeadDim>;
    static_assert(TileQ::kBlockCols == 64 && TileKV::kBlockCols == 64, "128-byte rows");
    // + 1024: the tiles start at the first 1024-byte boundary (the 128-byte swizzle repeats every 1024 bytes)
    static constexpr int kSmemBytes = TileQ::kBytes + 2 * TileKV::kBytes + 1024;
};

template <class T> __device__ __forceinline__ void flash_fwd_sm90(const FwdParams& p) {
    extern __shared__ __align__(128) unsigned char smem[];
    constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN, kNT = T::kNT, kDT = T::kDT;
    using TileQ = typename T::TileQ;
    using TileKV = typename T::TileKV;
    const int tid = threadIdx.x, lane = tid % 32;
    const int g = lane >> 2, t = lane & 3;
    const int wg = tid / 128;
    const int warp_m0 = wg * 64 + (tid % 128) / 32 * 16;  // first row of this warp inside the block

    // Causal: launch the longest rows first so that short blocks fill the tail of the grid.
    const int m_block = T::kIsCausal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int batch = blockIdx.y, head = blockIdx.z;
    const int head_kv = head / (p.nheads / p.nheads_kv);
    int q_start, k_start, seqlen_q, seqlen_k;
    seq_bounds(p, batch, q_start, k_start, seqlen_q, seqlen_k);
    const int m0 = m_block * kBlockM;
    if (m0 >= seqlen_q) return;

    const u16* q = (const u16*)p.q + batch * p.q_batch_stride + (i64)(q_start + m0) * p.q_row_stride +
                   head * p.q_head_stride;
    const u16* k = (const u16*)p.k + batch * p.k_batch_stride + (i64)k_start * p.k_row_stride +
                   head_kv * p.k_head_stride;
    const u16* v = (const u16*)p.v + batch * p.v_batch_stride + (i64)k_start * p.v_row_stride +
                   head_kv * p.v_head_stride;

    // Key blocks [0, n_block_max) hold every key some row of this block may see.
    int n_block_max = ceil_div(seqlen_k, kBlockN);
    if constexpr (T::kIsCausal) {
        const int last_visible = min_(seqlen_q, m0 + kBlockM) + seqlen_k - seqlen_q;  // exclusive
        n_block_max = min_(n_block_max, ceil_div(max_(last_visible, 0), kBlockN));
    }

    // Key tiles in walk order: dense, n_block_max - 1 down to 0; block-sparse, those of the row's non-zero mask blocks
    // below n_block_max, descending (walk.next() gives the one after the current tile, -1 at the end).
    SparseWalkDesc<kBlockSparseSize / kBlockN> walk;
    int first_block = n_block_max - 1;
    if constexpr (T::kIsBlockSparse) {
        walk.init(p.bs_rows + head * p.bs_rows_head_stride + (i64)(m0 / kBlockSparseSize) * (p.bs_n_kblocks + 1));
        first_block = walk.skip_to_below(n_block_max);
    }

    const u32 smem_base = (smem_u32(smem) + 1023) & ~1023u;
    const u32 sQ = smem_base, sK = sQ + TileQ::kBytes, sV = sK + TileKV::kBytes;
    load_tile_async<TileQ, T::kNThreads>(sQ, q, p.q_row_stride, seqlen_q - m0, p.head_dim, tid);
    cp_async_commit();
    if (T::kIsBlockSparse ? first_block >= 0 : n_block_max > 0) {
        const int n0 = (T::kIsBlockSparse ? first_block : n_block_max - 1) * kBlockN;
        load_tile_async<TileKV, T::kNThreads>(sK, k + n0 * p.k_row_stride, p.k_row_stride, seqlen_k - n0,
                                              p.head_dim, tid);
        cp_async_commit();
    }

    float o[kDT][4];
#pragma unroll
    for (int i = 0; i < kDT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float row_max[2] = {-infinity(), -infinity()}, row_sum[2] = {0.f, 0.f};  // rows g, g + 8 (partial sums)
    DropoutRng rng = T::kIsDropout ? DropoutRng(p.rng_state, p.keep_threshold) : DropoutRng{};
    const int bh = batch * p.nheads + head;

    // One key block; kMask: some key of it is past the end or right of the diagonal for some row of this block.
    // Block-sparse: n_block_next is the block walked after this one (its K is copied during this step), -1 for none;
    // dense: n_block - 1.
    auto step = [&](int n_block, int n_block_next, auto mask_tag) {
        constexpr bool kMask = decltype(mask_tag)::value;
        const int n0 = n_block * kBlockN;
        cp_async_wait<0>();
        fence_proxy_async();
        __syncthreads();  // K[n] landed; every warpgroup is done with V[n + 1]
        load_tile_async<TileKV, T::kNThreads>(sV, v + n0 * p.v_row_stride, p.v_row_stride, seqlen_k - n0,
                                              p.head_dim, tid);
        cp_async_commit();

        // S = Q K^T: kHeadDim / 16 k-steps; step kk reads 16 columns of Q's and K's column block kk / 4.
        float s[kNT][4];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < T::kHeadDim / 16; ++kk) {
            const u64 desc_q = gmma_desc(sQ + (kk / 4) * kBlockM * 128 + wg * 64 * 128 + (kk % 4) * 32, 16, 1024);
            const u64 desc_k = gmma_desc(sK + (kk / 4) * kBlockN * 128 + (kk % 4) * 32, 16, 1024);
            wgmma_ss<kBlockN, T::kIsBF16>(s, desc_q, desc_k, kk > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        fence_operand(s);

        if constexpr (kMask) {
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int row = m0 + warp_m0 + g + 8 * hf;
                const int col_end = T::kIsCausal ? min_(seqlen_k, row + 1 + seqlen_k - seqlen_q) : seqlen_k;
#pragma unroll
                for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        if (n0 + nt * 8 + 2 * t + e >= col_end) s[nt][2 * hf + e] = -infinity();
            }
        }

        cp_async_wait<0>();
        fence_proxy_async();
        __syncthreads();  // V[n] landed; every warpgroup is done with K[n]
        if (T::kIsBlockSparse ? n_block_next >= 0 : n_block > 0) {
            const int n0_next = T::kIsBlockSparse ? n_block_next * kBlockN : n0 - kBlockN;
            load_tile_async<TileKV, T::kNThreads>(sK, k + n0_next * p.k_row_stride, p.k_row_stride,
                                                  seqlen_k - n0_next, p.head_dim, tid);
            cp_async_commit();
        }

        // Online softmax in base 2: p = exp2(s * scale_log2 - m * scale_log2).
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) softmax_update_row(s, o, hf, row_max[hf], row_sum[hf], p.softmax_scale_log2);
        if constexpr (T::kIsDropout) rng.drop(s, bh, m0 + warp_m0 + g, n0 + 2 * t);  // l keeps the un-dropped sum

        // O += P V: P re-packed from the S accumulators (A fragments, 16 keys per step); V[16 ks .. +16][:] is the
        // MN-major B operand of step ks.
        u32 a[kNT / 2][4];
#pragma unroll
        for (int ks = 0; ks < kNT / 2; ++ks) {
            a[ks][0] = pack2<T::kIsBF16>(s[2 * ks][0], s[2 * ks][1]);
            a[ks][1] = pack2<T::kIsBF16>(s[2 * ks][2], s[2 * ks][3]);
            a[ks][2] = pack2<T::kIsBF16>(s[2 * ks + 1][0], s[2 * ks + 1][1]);
            a[ks][3] = pack2<T::kIsBF16>(s[2 * ks + 1][2], s[2 * ks + 1][3]);
        }
        fence_operand(o);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kNT / 2; ++ks)
            wgmma_rs<T::kHeadDim, T::kIsBF16>(o, a[ks], gmma_desc(sV + ks * 16 * 128, kBlockN * 128, 1024), 1);
        wgmma_commit();
        wgmma_wait<0>();
        fence_operand(o);
    };
    auto needs_mask = [&](int n_block) {
        return tile_needs_mask<T::kIsCausal, kBlockN>(m0, n_block * kBlockN, seqlen_q, seqlen_k);
    };
    // (dense: n_block_max - 1 spelled out -- through first_block ptxas spilled 16 B in the Hopper forward)
    walk_key_blocks<T::kIsBlockSparse>(T::kIsBlockSparse ? first_block : n_block_max - 1, walk, needs_mask, step);

    // Epilogue: out = O / l, lse = m * scale + ln(l); staged through Q's shared tile for 16-byte stores.
    cp_async_wait<0>();
    __syncthreads();  // every warpgroup is done reading Q
    float* lse = p.lse + batch * p.lse_batch_stride + head * p.lse_head_stride + q_start;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const float sum = finish_row<T::kIsDropout>(o, hf, row_sum[hf], p.rp_dropout);
        const int row = m0 + warp_m0 + g + 8 * hf;
        if (t == 0 && row < seqlen_q) lse[row] = row_lse(sum, row_max[hf], p.softmax_scale);
    }
    float(&o1)[1][kDT][4] = *reinterpret_cast<float(*)[1][kDT][4]>(&o);
    store_acc<T::kIsBF16, TileQ>(sQ, o1, warp_m0, 0, 1.f, lane);
    __syncthreads();
    u16* out = (u16*)p.out + batch * p.o_batch_stride + (i64)(q_start + m0) * p.o_row_stride + head * p.o_head_stride;
    store_tile<TileQ, T::kNThreads>(sQ, out, p.o_row_stride, seqlen_q - m0, p.head_dim, tid);
}

}  // namespace flashtrain
