// FlashAttention-2 forward (Dao 2023, Algorithm 1).
//
// One CTA computes one block of kBlockM query rows of one (batch, head): out = softmax(scale * Q K^T) V and the
// logsumexp of each row. Q is split across warps (warp w owns rows [w * kMT * 16, (w + 1) * kMT * 16) of the block),
// K/V are streamed through shared memory in blocks of kBlockN keys, from the last key block to the first:
//     wait K[n]; issue V[n]    S = Q K[n]^T (mma.sync)     mask    wait V[n]; issue K[n-1]
//     online softmax: m = max(m, rowmax S); O *= exp(m_old - m); P = exp(S - m); l = l * exp(m_old - m) + rowsum P
//     (dropout: zero dropped P entries; l keeps the un-dropped sum)      O += P V (P stays in registers)
// so each copy overlaps the math of the other operand. At the end out = O / l (times 1 / (1 - p) with dropout) and
// lse = m * scale + log(l). A row with no visible key keeps l = 0 and gets out = 0, lse = -inf.
//
// Shared memory: Q (kBlockM x kHeadDim), K and V (kBlockN x kHeadDim), swizzled tiles; Q's space stages the output.
// Causal masking is bottom-right aligned: query i sees key j iff j <= i + seqlen_k - seqlen_q.
//
// Block-sparse (kIsBlockSparse; FlashAttention, Algorithm 5): the CTA walks only the key tiles of the non-zero blocks
// of its query block's row of the block mask (params.bs_rows: a count, then the key blocks ascending), from the last
// to the first; a mask block of kBlockSparseSize keys is kBlockSparseSize / kBlockN tiles. Causal and the sequence end
// still cut and mask tiles exactly as in the dense walk, so the computed tiles are the dense ones minus the zero blocks.
#pragma once
#include "mask_mod.cuh"
#include "utils.cuh"

namespace flashtrain {

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, bool kIsBF16_, bool kIsCausal_, bool kIsDropout_,
          bool kIsBlockSparse_, bool kScoreMods_ = false, bool kMaskMod_ = false, int kWarpsD_ = 1>
struct FwdTraits {
    static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_, kNWarps = kNWarps_;
    // Warps sharing the same rows, each owning kHeadDim / kWarpsD columns of O (head dim 512: O of 16 rows x 512
    // columns would take 256 registers per thread). Each computes S over its columns of Q and K only; the partial
    // S of the kWarpsD warps are added through shared memory (kWarpsD == 2: both warps then hold the same S, bit
    // for bit, since a + b == b + a) and both run the same softmax, so P and the row statistics agree.
    static constexpr int kWarpsD = kWarpsD_;
    static_assert(kWarpsD == 1 || kWarpsD == 2, "kWarpsD: 1 or 2 warps per row group");
    static constexpr int kWarpsM = kNWarps / kWarpsD;  // row groups
    static constexpr int kDCols = kHeadDim / kWarpsD;  // head-dim columns per warp
    static constexpr bool kIsBF16 = kIsBF16_, kIsCausal = kIsCausal_, kIsDropout = kIsDropout_;
    static constexpr bool kIsBlockSparse = kIsBlockSparse_;
    // the local window, softcap and ALiBi of the call's parameters (flash.h: window_left / window_right,
    // softcap_scale / _unscale, alibi_slopes), each off when unset
    static constexpr bool kScoreMods = kScoreMods_;
    static_assert(!(kScoreMods && kIsBlockSparse), "score modifications and a block mask are not combined");
    // a mask expression compiled in (FT_MASK_EXPR, mask_mod.cuh): the key walk skips the tiles its block states mark
    // empty, and applies the expression per pair on the partial ones (a variant of the score-modification kernels)
    static constexpr bool kMaskMod = kMaskMod_;
    static_assert(!kMaskMod || (kScoreMods && kBlockSparseSize % kBlockM == 0 && kBlockSparseSize % kBlockN == 0),
                  "a mask expression: the score-modification kernels, tiles inside the states' 128 x 128 tiles");
    static_assert(!kIsBlockSparse || (kBlockSparseSize % kBlockM == 0 && kBlockSparseSize % kBlockN == 0),
                  "a block-sparse mask block must be a whole number of tiles");
    static constexpr int kNThreads = kNWarps * 32;
    static constexpr int kMT = kBlockM / (16 * kWarpsM);  // m16 tiles per warp
    static constexpr int kNT = kBlockN / 8;               // n8 tiles of S per warp
    static constexpr int kDT = kDCols / 8;                // n8 tiles of O per warp
    static_assert(kMT * 16 * kWarpsM == kBlockM, "kBlockM must be a multiple of 16 * (kNWarps / kWarpsD)");
    static_assert(kBlockN % 16 == 0 && kHeadDim % 32 == 0 && (kWarpsD == 1 || kDCols % 64 == 0), "bad tile shape");
    using TileQ = SmemTile<kBlockM, kHeadDim>;
    using TileKV = SmemTile<kBlockN, kHeadDim>;
    // kWarpsD > 1: each warp's partial S (fp32, in its fragment layout) after the K / V tiles
    static constexpr int kPartialSBytes = kWarpsD > 1 ? kNWarps * kMT * kNT * 32 * 16 : 0;
    static constexpr int kSmemBytes = TileQ::kBytes + 2 * TileKV::kBytes + kPartialSBytes;
};

template <class T> __device__ __forceinline__ void flash_fwd(const FwdParams& p) {
    extern __shared__ __align__(128) unsigned char smem[];
    constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN, kMT = T::kMT, kNT = T::kNT, kDT = T::kDT;
    using TileQ = typename T::TileQ;
    using TileKV = typename T::TileKV;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane >> 2, t = lane & 3;

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
    // Local window: key blocks [n_block_min, n_block_max) hold every key some row of the block sees (n_block_max as
    // causal's with the right bound; n_block_min from the first row's left bound).
    int n_block_min = 0;
    if constexpr (T::kScoreMods)
        window_key_blocks<T::kIsCausal, kBlockM, kBlockN>(m0, seqlen_q, seqlen_k - seqlen_q, p.window_left,
                                                           p.window_right, n_block_min, n_block_max);

    // kMaskMod: the block states of this query block's row of tiles (0 empty, 1 partial, 2 full)
    [[maybe_unused]] const unsigned char* mm_row =
        T::kMaskMod ? p.mm_states + batch * p.mm_states_b_stride + head * p.mm_states_h_stride +
                          (i64)(m0 / kBlockSparseSize) * p.mm_n_kblocks
                    : nullptr;
    auto mm_state = [&](int n_block) -> int { return mm_row[n_block * kBlockN / kBlockSparseSize]; };
    if constexpr (T::kMaskMod) {  // the row's non-empty key blocks (pack_states): the walk starts and ends there
        const int* range = reinterpret_cast<const int*>(p.mm_states + batch * p.mm_states_b_stride +
                                                        head * p.mm_states_h_stride +
                                                        (i64)p.mm_n_qblocks * p.mm_n_kblocks) +
                           2 * (m0 / kBlockSparseSize);
        n_block_min = max_(n_block_min, range[0] * (kBlockSparseSize / kBlockN));
        n_block_max = min_(n_block_max, (range[1] + 1) * (kBlockSparseSize / kBlockN));
    }
    // the next key block at or below n that is not empty (below n_block_min: -1)
    [[maybe_unused]] auto visible_from = [&](int n) {
        if constexpr (T::kMaskMod)
            while (n >= n_block_min && mm_state(n) == 0) --n;
        return n >= n_block_min ? n : -1;
    };

    // Key tiles in walk order: dense, n_block_max - 1 down to 0; block-sparse, those of the row's non-zero mask blocks
    // below n_block_max, descending (walk.next() gives the one after the current tile, -1 at the end).
    SparseWalkDesc<kBlockSparseSize / kBlockN> walk;
    int first_block = n_block_max - 1;
    if constexpr (T::kIsBlockSparse) {
        walk.init(p.bs_rows + head * p.bs_rows_head_stride + (i64)(m0 / kBlockSparseSize) * (p.bs_n_kblocks + 1));
        first_block = walk.skip_to_below(n_block_max);
    }
    if constexpr (T::kMaskMod) first_block = visible_from(n_block_max - 1);

    const u32 smem_base = smem_u32(smem);
    const u32 sQ = smem_base, sK = sQ + TileQ::kBytes, sV = sK + TileKV::kBytes;
    load_tile_async<TileQ, T::kNThreads>(sQ, q, p.q_row_stride, seqlen_q - m0, p.head_dim, tid);
    cp_async_commit();
    if (T::kIsBlockSparse || T::kMaskMod ? first_block >= 0 : n_block_max > n_block_min) {
        const int n0 = (T::kIsBlockSparse || T::kMaskMod ? first_block : n_block_max - 1) * kBlockN;
        load_tile_async<TileKV, T::kNThreads>(sK, k + n0 * p.k_row_stride, p.k_row_stride, seqlen_k - n0,
                                              p.head_dim, tid);
        cp_async_commit();
    }

    const int warp_m0 = (warp / T::kWarpsD) * kMT * 16;  // first row of this warp inside the block
    const int warp_d0 = (warp % T::kWarpsD) * T::kDCols;  // first head-dim column of its O (and of its part of S)
    float o[kMT][kDT][4];
    zero(o);
    float row_max[kMT][2], row_sum[kMT][2];  // per (m16 tile, row g / g + 8); row_sum is this thread's partial sum
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) row_max[mt][hf] = -infinity(), row_sum[mt][hf] = 0.f;

    DropoutRng rng = T::kIsDropout ? DropoutRng(p.rng_state, p.keep_threshold) : DropoutRng{};
    const int bh = batch * p.nheads + head;
    // ALiBi slope of this (batch, head) in raw score units
    const float alibi_scaled = T::kScoreMods && p.alibi_slopes != nullptr
                                   ? p.alibi_slopes[batch * p.alibi_batch_stride + head] / p.softmax_scale
                                   : 0.f;

    // One key block; kMask: some key of it is past the end or right of the diagonal for some row of this block.
    // Block-sparse: n_block_next is the block walked after this one (its K is copied during this step), -1 for none;
    // dense: n_block - 1.
    auto step = [&](int n_block, int n_block_next, auto mask_tag) {
        constexpr bool kMask = decltype(mask_tag)::value;
        const int n0 = n_block * kBlockN;
        const u32 sQ = launder(smem_base), sK = sQ + TileQ::kBytes, sV = sK + TileKV::kBytes;
        cp_async_wait<0>();
        __syncthreads();  // K[n] landed; every warp is done with V[n + 1]
        load_tile_async<TileKV, T::kNThreads>(sV, v + n0 * p.v_row_stride, p.v_row_stride, seqlen_k - n0,
                                              p.head_dim, tid);
        cp_async_commit();

        float s[kMT][kNT][4];
        zero(s);
        warp_gemm_ss<T::kIsBF16, kMT, kNT, T::kDCols, false, false>(
            s, a_frag_ptr<TileQ, false>(sQ, warp_m0, warp_d0, lane), b_frag_ptr<TileKV, false>(sK, 0, warp_d0, lane));
        if constexpr (T::kWarpsD > 1) {  // S = the two warps' partial sums (lane l of both holds the same elements)
            const u32 mine = sV + TileKV::kBytes + (warp * kMT * kNT * 32 + lane) * 16;
            const u32 other = sV + TileKV::kBytes + ((warp ^ 1) * kMT * kNT * 32 + lane) * 16;  // the partner's
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                for (int nt = 0; nt < kNT; ++nt) st_shared_v4f(mine + (mt * kNT + nt) * 32 * 16, s[mt][nt]);
            named_bar_sync(1 + warp / 2, 64);  // the pair's partial sums stored
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                for (int nt = 0; nt < kNT; ++nt) {
                    float x[4];
                    ld_shared_v4f(other + (mt * kNT + nt) * 32 * 16, x);
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[mt][nt][e] += x[e];
                }
        }

        if constexpr (T::kScoreMods)  // softcap, ALiBi (before the masks)
            apply_score_mods(s, p.softcap_scale, p.softcap_unscale, alibi_scaled, m0 + warp_m0, n0, seqlen_k - seqlen_q,
                             lane);
        if constexpr (T::kMaskMod) {  // the expression per pair of a partial tile (positions in the sequence)
            if (mm_state(n_block) == 1)
                apply_mask_mod(s, p.mm, batch, head, m0 + warp_m0, n0, seqlen_q, seqlen_k, lane);
        }

        // Mask keys past the end and, when causal, keys right of the diagonal (local: outside the window).
        if constexpr (kMask) {
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int row = m0 + warp_m0 + mt * 16 + g + 8 * hf;
                    int col_end = T::kIsCausal ? min_(seqlen_k, row + 1 + seqlen_k - seqlen_q) : seqlen_k;
                    int col_begin = 0;
                    if constexpr (T::kScoreMods) {
                        if (!T::kIsCausal && p.window_right >= 0)
                            col_end = min_(col_end, row + 1 + seqlen_k - seqlen_q + p.window_right);
                        if (p.window_left >= 0) col_begin = row + seqlen_k - seqlen_q - p.window_left;
                    }
#pragma unroll
                    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int col = n0 + nt * 8 + 2 * t + e;
                            if (col >= col_end || (T::kScoreMods && col < col_begin)) s[mt][nt][2 * hf + e] = -infinity();
                        }
                }
        }

        cp_async_wait<0>();
        __syncthreads();  // V[n] landed; every warp is done with K[n]
        if (T::kIsBlockSparse || T::kMaskMod ? n_block_next >= 0 : n_block > n_block_min) {
            const int n0_next = T::kIsBlockSparse || T::kMaskMod ? n_block_next * kBlockN : n0 - kBlockN;
            load_tile_async<TileKV, T::kNThreads>(sK, k + n0_next * p.k_row_stride, p.k_row_stride,
                                                  seqlen_k - n0_next, p.head_dim, tid);
            cp_async_commit();
        }

        // Online softmax in base 2: p = exp2(s * scale_log2 - m * scale_log2).
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf)
                softmax_update_row(s[mt], o[mt], hf, row_max[mt][hf], row_sum[mt][hf], p.softmax_scale_log2);

        if constexpr (T::kIsDropout) {  // zero the dropped P entries (l keeps the un-dropped sum)
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) rng.drop(s[mt], bh, m0 + warp_m0 + mt * 16 + g, n0 + 2 * t);
        }

        // O += P V: P is re-packed from the S accumulators (k = key) and V[k][d] is read transposed.
        const TilePtr<TileKV> v_ptr = b_frag_ptr<TileKV, true>(sV, 0, warp_d0, lane);
#pragma unroll
        for (int ks = 0; ks < kNT / 2; ++ks) {
            u32 a[kMT][4];
            acc_to_a_frag<T::kIsBF16>(a, s, ks);
#pragma unroll
            for (int dp = 0; dp < kDT / 2; ++dp) {
                u32 b[4];
                ldmatrix_x4_trans(b, v_ptr.at(ks * 16, dp * 16));
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt) {
                    mma_16816<T::kIsBF16>(o[mt][2 * dp], a[mt], b[0], b[1]);
                    mma_16816<T::kIsBF16>(o[mt][2 * dp + 1], a[mt], b[2], b[3]);
                }
            }
        }
    };
    auto needs_mask = [&](int n_block) {
        const int n0 = n_block * kBlockN;
        bool mask = tile_needs_mask<T::kIsCausal, kBlockN>(m0, n0, seqlen_q, seqlen_k);
        if constexpr (T::kScoreMods)  // some row's window starts inside the tile or ends before its last key
            mask = mask || window_cuts_tile<T::kIsCausal, kBlockN>(m0, min_(seqlen_q, m0 + kBlockM) - 1, n0,
                                                                   seqlen_k - seqlen_q, p.window_left, p.window_right);
        return mask;
    };
    if constexpr (T::kMaskMod) {  // the tiles the states do not mark empty, descending
        for (int n_block = first_block; n_block >= 0;) {
            const int next = visible_from(n_block - 1);
            if (needs_mask(n_block)) step(n_block, next, BoolConstant<true>{});
            else step(n_block, next, BoolConstant<false>{});
            n_block = next;
        }
    } else if constexpr (T::kScoreMods) {  // masked tiles at both edges of the window, unmasked ones between
        for (int n_block = n_block_max - 1; n_block >= n_block_min; --n_block) {
            if (needs_mask(n_block)) step(n_block, -1, BoolConstant<true>{});
            else step(n_block, -1, BoolConstant<false>{});
        }
    } else {
        // (dense: n_block_max - 1 spelled out -- through first_block ptxas spilled 16 B in the Hopper forward)
        walk_key_blocks<T::kIsBlockSparse>(T::kIsBlockSparse ? first_block : n_block_max - 1, walk, needs_mask,
                                           step);
    }

    // Epilogue: out = O / l, lse = m * scale + ln(l); staged through Q's shared tile for 16-byte stores.
    cp_async_wait<0>();
    __syncthreads();
    float* lse = p.lse + batch * p.lse_batch_stride + head * p.lse_head_stride + q_start;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const float sum = finish_row<T::kIsDropout>(o[mt], hf, row_sum[mt][hf], p.rp_dropout);
            const int row = m0 + warp_m0 + mt * 16 + g + 8 * hf;
            if (t == 0 && row < seqlen_q && warp_d0 == 0) lse[row] = row_lse(sum, row_max[mt][hf], p.softmax_scale);
        }
    store_acc<T::kIsBF16, TileQ>(sQ, o, warp_m0, warp_d0, 1.f, lane);
    __syncthreads();
    u16* out = (u16*)p.out + batch * p.o_batch_stride + (i64)(q_start + m0) * p.o_row_stride + head * p.o_head_stride;
    store_tile<TileQ, T::kNThreads>(sQ, out, p.o_row_stride, seqlen_q - m0, p.head_dim, tid);
}

}  // namespace flashtrain
