// FlashAttention-2 backward (Dao 2023, Algorithm 2): recompute the attention probabilities from Q, K and the saved
// logsumexp instead of storing them.
//
// One CTA owns one block of kBlockN keys of one (batch, kv head). K and V stay in shared memory; the CTA walks every
// query block that can see these keys, for every query head of the GQA group, with Q and dO double-buffered:
//     S = Q K^T, dP = dO V^T                       (warps tiled kWarpsM_SdP x kWarpsN_SdP over kBlockM x kBlockN)
//     P = exp(scale * S - lse)                     (masked: 0; dropout: Pd = P * keep / (1 - p))
//     dS = P * (dPd - D), D = rowsum(dO * out)     (dPd = dP * keep / (1 - p))
//     P, dS -> shared memory (16-bit)
//     dV += Pd^T dO, dK += dS^T Q                  (registers, warps tiled over kBlockN x kHeadDim)
//     dQ(block) = dS K  -> added in fp32 to dq_accum (red.global.add; or, deterministic, by the one CTA owning a
//                          split of dq_accum with plain loads and stores, the splits summed in order afterwards)
// then writes dK * scale and dV. flash_aux.cuh holds the kernels that run before (D, zeroing dq_accum) and after
// (dq = scale * dq_accum in the input dtype).
//
// Shared memory: Q[kStages], dO[kStages] (kBlockM x kHeadDim), K, V (kBlockN x kHeadDim), P, dS (kBlockM x kBlockN),
// lse[kStages], D[kStages] (kBlockM floats, copied with Q and dO: no global load latency, no registers held).
//
// Block-sparse (kIsBlockSparse; FlashAttention, backward of Algorithm 5): for each query head of the group the CTA
// walks only the query tiles of the non-zero blocks of its key block's column of the block mask (params.bs_cols: a
// count, then the query blocks ascending; a mask block of kBlockSparseSize rows is kBlockSparseSize / kBlockM tiles),
// cut by causal and the sequence end as in the dense walk.
#pragma once
#include "mask_mod.cuh"
#include "utils.cuh"

namespace flashtrain {

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kWarpsM_SdP_, int kWarpsN_dKV_,
          int kWarpsM_dQ_, int kStages_, int kScrambleDq_, bool kVecRowStats_, bool kIsBF16_, bool kIsCausal_,
          bool kIsDropout_, bool kIsBlockSparse_, bool kScoreMods_ = false, bool kMaskMod_ = false, int kDqChunks_ = 1>
struct BwdTraits {
    // the local window, softcap and ALiBi (flash.h FwdParams), each off when unset
    static constexpr bool kScoreMods = kScoreMods_;
    // a mask expression compiled in (FT_MASK_EXPR, mask_mod.cuh): the query walk skips the (head, query block)
    // iterations the block states mark empty, the expression per pair on the partial ones
    static constexpr bool kMaskMod = kMaskMod_;
    static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_, kNWarps = kNWarps_;
    static constexpr int kStages = kStages_;
    // dq_accum layout of whole blocks (see add_dq): 0 row-major; 1 or 2 scrambled (2: one laundered base offset)
    static constexpr int kScrambleDq = kScrambleDq_;
    // lse / D in shared memory permuted so that each thread's 2 * kMT_SdP rows are contiguous (16-byte loads): row
    // r = (warp row) * kMT_SdP * 16 + i * 8 + gg (i = 2 mt + hf, gg = lane / 4) sits at (warp row) * kMT_SdP * 16 +
    // gg * 2 * kMT_SdP + i.
    static constexpr bool kVecRowStats = kVecRowStats_;
    static constexpr bool kIsBF16 = kIsBF16_, kIsCausal = kIsCausal_, kIsDropout = kIsDropout_;
    static constexpr bool kIsBlockSparse = kIsBlockSparse_;
    static_assert(!kIsBlockSparse || (kBlockSparseSize % kBlockM == 0 && kBlockSparseSize % kBlockN == 0),
                  "a block-sparse mask block must be a whole number of tiles");
    static constexpr int kNThreads = kNWarps * 32;
    // S and dP (kBlockM x kBlockN)
    static constexpr int kWarpsM_SdP = kWarpsM_SdP_, kWarpsN_SdP = kNWarps / kWarpsM_SdP;
    static constexpr int kMT_SdP = kBlockM / (16 * kWarpsM_SdP), kNT_SdP = kBlockN / (8 * kWarpsN_SdP);
    // dK and dV (kBlockN x kHeadDim)
    static constexpr int kWarpsN_dKV = kWarpsN_dKV_, kWarpsD_dKV = kNWarps / kWarpsN_dKV;
    static constexpr int kMT_dKV = kBlockN / (16 * kWarpsN_dKV), kNT_dKV = kHeadDim / (8 * kWarpsD_dKV);
    // dQ (kBlockM x kHeadDim)
    static constexpr int kWarpsM_dQ = kWarpsM_dQ_, kWarpsD_dQ = kNWarps / kWarpsM_dQ;
    static constexpr int kMT_dQ = kBlockM / (16 * kWarpsM_dQ), kNT_dQ = kHeadDim / (8 * kWarpsD_dQ);
    static_assert(kMT_SdP * 16 * kWarpsM_SdP == kBlockM && kNT_SdP * 8 * kWarpsN_SdP == kBlockN, "S tiling");
    static_assert(kMT_dKV * 16 * kWarpsN_dKV == kBlockN && kNT_dKV * 8 * kWarpsD_dKV == kHeadDim, "dKV tiling");
    static_assert(kMT_dQ * 16 * kWarpsM_dQ == kBlockM && kNT_dQ * 8 * kWarpsD_dQ == kHeadDim, "dQ tiling");
    // dQ of a block computed and added in kDqChunks pieces of a warp's columns (head dim 512: a warp's 64 x 512 / 2
    // dQ slice alone would take 128 registers next to dK and dV's 128)
    static constexpr int kDqChunks = kDqChunks_, kNT_dQc = kNT_dQ / kDqChunks;
    static_assert(kNT_dQc * kDqChunks == kNT_dQ && kNT_dQc % 2 == 0 && (kDqChunks == 1 || kScrambleDq_ == 0),
                  "dQ chunks: whole pairs of n8 tiles, row-major dq_accum");
    static_assert(kNT_SdP % 2 == 0 && kNT_dKV % 2 == 0 && kNT_dQ % 2 == 0, "warp tiles are pairs of n8 tiles");
    static_assert(kStages == 1 || kStages == 2, "kStages");
    static_assert(!kVecRowStats || kMT_SdP % 2 == 0, "16-byte lse / D loads need an even number of m16 tiles");
    __device__ __forceinline__ static int row_stats_slot(int row) {
        if constexpr (!kVecRowStats) return row;
        constexpr int kRows = kMT_SdP * 16;
        const int local = row % kRows;
        return row - local + (local % 8) * (2 * kMT_SdP) + local / 8;
    }
    static_assert(xor_safe(kWarpsN_SdP, kNT_SdP * 8) && xor_safe(kWarpsN_dKV, kMT_dKV * 16), "power-of-two tiles");
    static constexpr bool kXorSafe_dKV = xor_safe(kWarpsD_dKV, kNT_dKV * 8);
    static constexpr bool kXorSafe_dQ = xor_safe(kWarpsD_dQ * kDqChunks, kNT_dQc * 8);
    using TileQ = SmemTile<kBlockM, kHeadDim>;   // Q and dO
    using TileKV = SmemTile<kBlockN, kHeadDim>;  // K and V, then dK and dV
    using TileP = SmemTile<kBlockM, kBlockN>;    // P and dS
    static constexpr int kRowStatsBytes = kBlockM * 4;  // lse or D of one query block, float32
    static constexpr int kSmemBytes =
        2 * kStages * TileQ::kBytes + 2 * TileKV::kBytes + 2 * TileP::kBytes + 2 * kStages * kRowStatsBytes;
};

template <class T> __device__ __forceinline__ void flash_bwd(const BwdParams& p) {
    extern __shared__ __align__(128) unsigned char smem[];
    const FwdParams& f = p.fwd;
    constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN;
    constexpr int kMT_S = T::kMT_SdP, kNT_S = T::kNT_SdP;
    using TileQ = typename T::TileQ;
    using TileKV = typename T::TileKV;
    using TileP = typename T::TileP;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane >> 2, t = lane & 3;

    const int batch = blockIdx.y, head_kv = blockIdx.z;
    const int group = f.nheads / f.nheads_kv;  // query heads per kv head
    int q_start, k_start, seqlen_q, seqlen_k;
    seq_bounds(f, batch, q_start, k_start, seqlen_q, seqlen_k);
    const int n_kblocks = ceil_div(seqlen_k, kBlockN);
    // dq_accum of this (split, batch) and the warp's coordinates in the three tilings. Recomputed where used (from
    // a laundered warp index): kept live across the main loop they would be spilled.
    auto dq_accum_base = [&]() {
        return p.dq_accum + (p.deterministic ? blockIdx.x * p.dqa_split_stride : 0) + batch * p.dqa_batch_stride +
               (i64)q_start * f.head_dim;
    };
    auto s_m0 = [&](int w) { return (w / T::kWarpsN_SdP) * kMT_S * 16; };
    auto s_n0 = [&](int w) { return (w % T::kWarpsN_SdP) * kNT_S * 8; };
    auto kv_n0 = [&](int w) { return (w / T::kWarpsD_dKV) * T::kMT_dKV * 16; };
    auto kv_d0 = [&](int w) { return (w % T::kWarpsD_dKV) * T::kNT_dKV * 8; };
    auto dq_m0 = [&](int w) { return (w / T::kWarpsD_dQ) * T::kMT_dQ * 16; };
    auto dq_d0 = [&](int w) { return (w % T::kWarpsD_dQ) * T::kNT_dQ * 8; };

    const u32 smem_base = smem_u32(smem);
    DropoutRng rng = T::kIsDropout ? DropoutRng(f.rng_state, f.keep_threshold) : DropoutRng{};

    for (int n_block = blockIdx.x; n_block < n_kblocks; n_block += gridDim.x) {
        const int n0 = n_block * kBlockN;
        // Query blocks that see some key of this block: causal rows i >= n0 - (seqlen_k - seqlen_q).
        int m_block_min = T::kIsCausal ? max_(0, n0 - (seqlen_k - seqlen_q)) / kBlockM : 0;
        int m_block_last = ceil_div(seqlen_q, kBlockM);  // exclusive
        if constexpr (T::kScoreMods)  // rows i + offset - left <= j <= i + offset + right for some key j of the block
            window_query_blocks<T::kIsCausal, kBlockM, kBlockN>(n0, seqlen_k - seqlen_q, f.window_left,
                                                                 f.window_right, m_block_min, m_block_last);
        if constexpr (T::kMaskMod) {  // the query blocks some head's states show this key block to (pack_states)
            const int* range = reinterpret_cast<const int*>(f.mm_states + batch * f.mm_states_b_stride +
                                                            (i64)f.mm_n_qblocks * (f.mm_n_kblocks + 8)) +
                               2 * (n0 / kBlockSparseSize);
            m_block_min = max_(m_block_min, range[0] * (kBlockSparseSize / kBlockM));
            m_block_last = min_(m_block_last, (range[1] + 1) * (kBlockSparseSize / kBlockM));
        }
        const int n_mblocks = max_(0, m_block_last - m_block_min);
        const int n_iters = group * n_mblocks;  // (query head, query block) pairs; dense
        // Block-sparse: the column list of query head head_kv * group + i for this key tile's mask block.
        auto col_list = [&](int i) {
            return f.bs_cols + (head_kv * group + i) * f.bs_cols_head_stride +
                   (i64)(n0 / kBlockSparseSize) * (f.bs_n_qblocks + 1);
        };
        SparseWalkAsc<kBlockSparseSize / kBlockM> walk;
        const int m_block_end = ceil_div(seqlen_q, kBlockM);
        bool has_iter = n_iters > 0;
        if constexpr (T::kIsBlockSparse) has_iter = walk.settle(col_list, group, m_block_min, m_block_end);

        const u32 sK = smem_base + 2 * T::kStages * TileQ::kBytes, sV = sK + TileKV::kBytes;
        const u16* k = (const u16*)f.k + batch * f.k_batch_stride + (i64)(k_start + n0) * f.k_row_stride +
                       head_kv * f.k_head_stride;
        const u16* v = (const u16*)f.v + batch * f.v_batch_stride + (i64)(k_start + n0) * f.v_row_stride +
                       head_kv * f.v_head_stride;
        load_tile_async<TileKV, T::kNThreads>(sK, k, f.k_row_stride, seqlen_k - n0, f.head_dim, tid);
        load_tile_async<TileKV, T::kNThreads>(sV, v, f.v_row_stride, seqlen_k - n0, f.head_dim, tid);

        // Issue the copies of Q and dO of (query head, query block starting at row m0) into stage `stage`.
        auto load_q_do = [&](int head, int m0, int stage) {
            const u32 sQ = smem_base + stage * TileQ::kBytes, sdO = sQ + T::kStages * TileQ::kBytes;
            const u16* q = (const u16*)f.q + batch * f.q_batch_stride + (i64)(q_start + m0) * f.q_row_stride +
                           head * f.q_head_stride;
            const u16* dout = (const u16*)p.dout + batch * p.do_batch_stride +
                              (i64)(q_start + m0) * p.do_row_stride + head * p.do_head_stride;
            load_tile_async<TileQ, T::kNThreads>(sQ, q, f.q_row_stride, seqlen_q - m0, f.head_dim, tid);
            load_tile_async<TileQ, T::kNThreads>(sdO, dout, p.do_row_stride, seqlen_q - m0, f.head_dim, tid);
            // lse and D of the block's rows, 4 bytes per thread (rows past the end are zero-filled: their Q and dO
            // rows are zero, so whatever P they get contributes nothing).
            static_assert(2 * kBlockM <= T::kNThreads, "one thread per lse / D value");
            if (tid < 2 * kBlockM) {
                const int row = tid % kBlockM;
                const float* src = (tid < kBlockM ? f.lse : p.softmax_d) + batch * f.lse_batch_stride +
                                   head * f.lse_head_stride + q_start + m0;
                const u32 dst = smem_base + T::kSmemBytes - 2 * T::kStages * T::kRowStatsBytes +
                                ((tid < kBlockM ? 0 : T::kStages) + stage) * T::kRowStatsBytes +
                                4 * T::row_stats_slot(row);
                cp_async_4(dst, src + (m0 + row < seqlen_q ? row : 0), m0 + row < seqlen_q);
            }
        };
        // kMaskMod: the block state of iteration it (query head, query block) for this key block, and the first
        // iteration from it on that is not empty (n_iters: none)
        [[maybe_unused]] auto mm_state = [&](int it) -> int {
            const int head = head_kv * group + it / n_mblocks, m_block = m_block_min + it % n_mblocks;
            return f.mm_states[batch * f.mm_states_b_stride + head * f.mm_states_h_stride +
                               (i64)(m_block * kBlockM / kBlockSparseSize) * f.mm_n_kblocks + n0 / kBlockSparseSize];
        };
        [[maybe_unused]] auto visible_from = [&](int it) {
            if constexpr (T::kMaskMod)
                while (it < n_iters && mm_state(it) == 0) ++it;
            return it;
        };
        // Iterations run over query blocks [m_block_min, m_block_min + n_mblocks) of each query head of the group.
        if constexpr (T::kIsBlockSparse) {
            if (has_iter) load_q_do(head_kv * group + walk.head_i, walk.tile(col_list) * kBlockM, 0);
        } else if (const int first = visible_from(0); first < n_iters) {
            load_q_do(head_kv * group + first / n_mblocks, (m_block_min + first % n_mblocks) * kBlockM, 0);
        }
        cp_async_commit();

        float acc_dk[T::kMT_dKV][T::kNT_dKV][4], acc_dv[T::kMT_dKV][T::kNT_dKV][4];
        zero(acc_dk);
        zero(acc_dv);

        // One (query head, query block) iteration; kMask: the block holds keys past the end or above the diagonal.
        // head_next / m0_next: the following iteration's, whose Q and dO are copied during this one (2 stages);
        // has_next (block-sparse; dense: it + 1 < n_iters): there is one.
        auto step = [&](int it, int head, int m0, int head_next, int m0_next, bool has_next, auto mask_tag) {
            constexpr bool kMask = decltype(mask_tag)::value;
            const int stage = T::kStages == 2 ? (it & 1) : 0;
            cp_async_wait<0>();
            __syncthreads();  // Q[it], dO[it] (and K, V) landed; every warp is done with iteration it - 1
            if (T::kStages == 2 && (T::kIsBlockSparse || T::kMaskMod ? has_next : it + 1 < n_iters)) {
                load_q_do(head_next, m0_next, stage ^ 1);
                cp_async_commit();
            }

            const u32 base = launder(smem_base);
            const int w = (int)launder((u32)warp);
            const int s_m0_ = s_m0(w), s_n0_ = s_n0(w), kv_n0_ = kv_n0(w), kv_d0_ = kv_d0(w);
            const int dq_m0_ = dq_m0(w), dq_d0_ = dq_d0(w);
            const u32 sQ = base + stage * TileQ::kBytes, sdO = sQ + T::kStages * TileQ::kBytes;
            const u32 sK = base + 2 * T::kStages * TileQ::kBytes, sV = sK + TileKV::kBytes;
            const u32 sP = sV + TileKV::kBytes, sdS = sP + TileP::kBytes;

            float s[kMT_S][kNT_S][4], dp[kMT_S][kNT_S][4];
            zero(s);
            zero(dp);
            warp_gemm_ss<T::kIsBF16, kMT_S, kNT_S, T::kHeadDim, false, false>(
                s, a_frag_ptr<TileQ, false>(sQ, s_m0_, 0, lane), b_frag_ptr<TileKV, false>(sK, s_n0_, 0, lane));
            warp_gemm_ss<T::kIsBF16, kMT_S, kNT_S, T::kHeadDim, false, false>(
                dp, a_frag_ptr<TileQ, false>(sdO, s_m0_, 0, lane), b_frag_ptr<TileKV, false>(sV, s_n0_, 0, lane));

            float alibi_scaled = 0.f;  // ALiBi slope of this (batch, head) in raw score units
            if constexpr (T::kScoreMods) {  // the forward's softcap and ALiBi
                if (f.alibi_slopes != nullptr)
                    alibi_scaled = f.alibi_slopes[batch * f.alibi_batch_stride + head] / f.softmax_scale;
                apply_score_mods(s, f.softcap_scale, f.softcap_unscale, alibi_scaled, m0 + s_m0_, n0 + s_n0_,
                                 seqlen_k - seqlen_q, lane);
            }
            if constexpr (T::kMaskMod) {  // the expression per pair of a partial tile (positions in the sequence)
                const int state = f.mm_states[batch * f.mm_states_b_stride + head * f.mm_states_h_stride +
                                               (i64)(m0 / kBlockSparseSize) * f.mm_n_kblocks + n0 / kBlockSparseSize];
                if (state == 1)
                    apply_mask_mod(s, f.mm, batch, head, m0 + s_m0_, n0 + s_n0_, seqlen_q, seqlen_k, lane);
            }
            // ALiBi's bias of element (mt, n8 tile 2 ks + nt2, e) of the S fragment (0 without)
            auto alibi_bias = [&](int mt, int ks, int nt2, int e) -> float {
                const int d = m0 + s_m0_ + mt * 16 + g + 8 * (e >> 1) + seqlen_k - seqlen_q -
                              (n0 + s_n0_ + (2 * ks + nt2) * 8 + 2 * t + (e & 1));
                return alibi_scaled * (float)(d < 0 ? -d : d);
            };
            if constexpr (kMask) {
#pragma unroll
                for (int mt = 0; mt < kMT_S; ++mt)
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf) {
                        const int row = m0 + s_m0_ + mt * 16 + g + 8 * hf;
                        int col_end = T::kIsCausal ? min_(seqlen_k, row + 1 + seqlen_k - seqlen_q) : seqlen_k;
                        int col_begin = 0;
                        if constexpr (T::kScoreMods) {
                            if (!T::kIsCausal && f.window_right >= 0)
                                col_end = min_(col_end, row + 1 + seqlen_k - seqlen_q + f.window_right);
                            if (f.window_left >= 0) col_begin = row + seqlen_k - seqlen_q - f.window_left;
                        }
#pragma unroll
                        for (int nt = 0; nt < kNT_S; ++nt)
#pragma unroll
                            for (int e = 0; e < 2; ++e) {
                                const int col = n0 + s_n0_ + nt * 8 + 2 * t + e;
                                if (col >= col_end || (T::kScoreMods && col < col_begin))
                                    s[mt][nt][2 * hf + e] = -infinity();
                            }
                    }
            }

            // lse (log2 units; rows that saw no key: +inf, so that P = 0) and D of this thread's rows.
            const u32 sLse = base + T::kSmemBytes - 2 * T::kStages * T::kRowStatsBytes + stage * T::kRowStatsBytes;
            const u32 sD = sLse + T::kStages * T::kRowStatsBytes;
            float lse_log2[kMT_S][2], dsum[kMT_S][2];
            if constexpr (T::kVecRowStats) {
#pragma unroll
                for (int j = 0; j < kMT_S / 2; ++j) {  // rows of m16 tiles 2j and 2j + 1
                    const u32 slot = 4 * (s_m0_ + g * 2 * kMT_S + 4 * j);
                    u32 l4[4], d4[4];
                    ld_shared_v4(sLse + slot, l4);
                    ld_shared_v4(sD + slot, d4);
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const float lse = __uint_as_float(l4[i]);
                        lse_log2[2 * j + i / 2][i % 2] = lse == -infinity() ? infinity() : lse * kLog2e;
                        dsum[2 * j + i / 2][i % 2] = __uint_as_float(d4[i]);
                    }
                }
            } else {
#pragma unroll
                for (int mt = 0; mt < kMT_S; ++mt)
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf) {
                        const int row = s_m0_ + mt * 16 + g + 8 * hf;
                        const float lse = ld_shared_f32(sLse + 4 * row);
                        lse_log2[mt][hf] = lse == -infinity() ? infinity() : lse * kLog2e;
                        dsum[mt][hf] = ld_shared_f32(sD + 4 * row);
                    }
            }

            // s <- P (with dropout: Pd = P * keep / (1 - p)), dp <- dS = P * (dPd - D), dPd = dP * keep / (1 - p).
            const int bh = batch * f.nheads + head;
#pragma unroll
            for (int mt = 0; mt < kMT_S; ++mt)
#pragma unroll
                for (int ks = 0; ks < kNT_S / 2; ++ks) {
                    u32 bits[4];
                    if constexpr (T::kIsDropout)
                        rng.bits(bits, bh, m0 + s_m0_ + mt * 16 + g, n0 + s_n0_ + ks * 16 + 2 * t);
#pragma unroll
                    for (int nt2 = 0; nt2 < 2; ++nt2)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            float& x = s[mt][2 * ks + nt2][e];
                            float& y = dp[mt][2 * ks + nt2][e];
                            const float prob = fast_exp2(x * f.softmax_scale_log2 - lse_log2[mt][e >> 1]);
                            // softcap: d(capped score) / d(score) = 1 - tanh^2, tanh = capped * softcap_scale (0 where
                            // masked: -inf there)
                            float dcap = 1.f;
                            if constexpr (T::kScoreMods) {
                                if (f.softcap_scale != 0.f) {
                                    // tanh = capped * softcap_scale, before ALiBi's bias: recover it from x + bias
                                    const float th = (x + alibi_bias(mt, ks, nt2, e)) * f.softcap_scale;
                                    dcap = fmax_(1.f - th * th, 0.f);
                                }
                            }
                            if constexpr (T::kIsDropout) {
                                const bool keep = rng.keep_half(bits, (e >> 1) * 4 + nt2 * 2 + (e & 1));
                                y = prob * ((keep ? y * f.rp_dropout : 0.f) - dsum[mt][e >> 1]) * dcap;
                                x = keep ? prob * f.rp_dropout : 0.f;
                            } else {
                                y = prob * (y - dsum[mt][e >> 1]) * dcap;
                                x = prob;
                            }
                        }
                }
            store_acc<T::kIsBF16, TileP>(sP, s, s_m0_, s_n0_, 1.f, lane);
            store_acc<T::kIsBF16, TileP>(sdS, dp, s_m0_, s_n0_, 1.f, lane);
            __syncthreads();  // P and dS visible to all warps

            // dV += Pd^T dO and dK += dS^T Q: A = P^T read transposed from [m][n], B = dO / Q read transposed.
            warp_gemm_ss<T::kIsBF16, T::kMT_dKV, T::kNT_dKV, kBlockM, true, true>(
                acc_dv, a_frag_ptr<TileP, true>(sP, 0, kv_n0_, lane),
                b_frag_ptr<TileQ, true, T::kXorSafe_dKV>(sdO, 0, kv_d0_, lane));
            warp_gemm_ss<T::kIsBF16, T::kMT_dKV, T::kNT_dKV, kBlockM, true, true>(
                acc_dk, a_frag_ptr<TileP, true>(sdS, 0, kv_n0_, lane),
                b_frag_ptr<TileQ, true, T::kXorSafe_dKV>(sQ, 0, kv_d0_, lane));

            // dQ(block) = dS K, added to dq_accum in fp32 (in kDqChunks pieces of the warp's columns).
#pragma unroll
            for (int chunk = 0; chunk < T::kDqChunks; ++chunk) {
                const int dq_c0 = dq_d0_ + chunk * T::kNT_dQc * 8;
                float acc_dq[T::kMT_dQ][T::kNT_dQc][4];
                zero(acc_dq);
                warp_gemm_ss<T::kIsBF16, T::kMT_dQ, T::kNT_dQc, kBlockN, false, true>(
                    acc_dq, a_frag_ptr<TileP, false>(sdS, dq_m0_, 0, lane),
                    b_frag_ptr<TileKV, true, T::kXorSafe_dQ>(sK, 0, dq_c0, lane));
                float* dq_head = dq_accum_base() + head * p.dqa_head_stride;
                // kGuard: some row of the block is past the end, or head_dim < kHeadDim.
                auto add_dq = [&](auto deterministic_tag, auto guard_tag) {
#pragma unroll
                    for (int mt = 0; mt < T::kMT_dQ; ++mt)
#pragma unroll
                        for (int hf = 0; hf < 2; ++hf) {
                            const int row = m0 + dq_m0_ + mt * 16 + g + 8 * hf;
                            float* dq_row = dq_head + (i64)row * f.head_dim;
#pragma unroll
                            for (int nt = 0; nt < T::kNT_dQc; ++nt) {
                                const int col = dq_c0 + nt * 8 + 2 * t;
                                if (decltype(guard_tag)::value && (row >= seqlen_q || col >= f.head_dim)) continue;
                                const float a = acc_dq[mt][nt][2 * hf], b = acc_dq[mt][nt][2 * hf + 1];
                                if constexpr (decltype(deterministic_tag)::value) {
                                    dq_row[col] += a;  // this thread is the only writer of this split's element
                                    dq_row[col + 1] += b;
                                } else {
                                    atomic_add2(dq_row + col, a, b);
                                }
                            }
                        }
                };
                const bool guard = m0 + kBlockM > seqlen_q || f.head_dim != T::kHeadDim;
                if (p.deterministic) add_dq(BoolConstant<true>{}, BoolConstant<true>{});
                else if (guard) add_dq(BoolConstant<false>{}, BoolConstant<true>{});
                else if constexpr (T::kScrambleDq == 0) add_dq(BoolConstant<false>{}, BoolConstant<false>{});
                else {
                    // Whole block, atomics, kScrambleDq: dq_accum holds this block's 16-row groups scrambled so that a
                    // lane's 4 accumulators acc_dq[mt][nt][0..3] are 4 consecutive floats and a warp's red.v4 covers 512
                    // contiguous bytes (row-major: 8 rows, 8 cache lines per instruction -> lg_throttle stalls). Group
                    // (16 rows x kHeadDim, contiguous) = kWarpsD_dQ slices of 16 x W; element (r, c) of a slice at
                    // (c / 8) * 128 + ((r % 8) * 4 + (c % 8) / 2) * 4 + (r / 8) * 2 + c % 2. flash_aux.cuh reads it back.
                    constexpr int W = T::kNT_dQ * 8;
                    if constexpr (T::kScrambleDq == 2) {
                        // One base pointer for all the block's atomics, its lane offset laundered (hd128: ptxas spills
                        // 8 B / 16 B instead of 32 B / 28 B with per-mt pointers; hd64 the other way round).
                        float* slice = dq_head + (i64)m0 * T::kHeadDim +
                                       launder((u32)(dq_m0_ * T::kHeadDim + (dq_d0_ / W) * 16 * W + lane * 4));
#pragma unroll
                        for (int mt = 0; mt < T::kMT_dQ; ++mt)
#pragma unroll
                            for (int nt = 0; nt < T::kNT_dQ; ++nt)
                                atomic_add4(slice + mt * 16 * T::kHeadDim + nt * 128, acc_dq[mt][nt]);
                    } else {
#pragma unroll
                        for (int mt = 0; mt < T::kMT_dQ; ++mt) {
                            float* slice = dq_head + (i64)(m0 + dq_m0_ + mt * 16) * T::kHeadDim +
                                           (dq_d0_ / W) * 16 * W + launder((u32)lane) * 4;
#pragma unroll
                            for (int nt = 0; nt < T::kNT_dQ; ++nt) atomic_add4(slice + nt * 128, acc_dq[mt][nt]);
                        }
                    }
                }
            }  // chunk
            if (T::kStages == 1 && (T::kIsBlockSparse || T::kMaskMod ? has_next : it + 1 < n_iters)) {
                __syncthreads();  // every warp is done with Q and dO
                load_q_do(head_next, m0_next, 0);
                cp_async_commit();
            }
        };
        auto needs_mask = [&](int m0) {
            bool mask = tile_needs_mask<T::kIsCausal, kBlockN>(m0, n0, seqlen_q, seqlen_k);
            if constexpr (T::kScoreMods)  // some row's window starts inside the key block or ends before its end
                mask = mask || window_cuts_tile<T::kIsCausal, kBlockN>(m0, min_(seqlen_q, m0 + kBlockM) - 1, n0,
                                                                       seqlen_k - seqlen_q, f.window_left,
                                                                       f.window_right);
            return mask;
        };
        if constexpr (T::kIsBlockSparse) {
            for (int it = 0; has_iter; ++it) {
                const int head = head_kv * group + walk.head_i, m0 = walk.tile(col_list) * kBlockM;
                walk.advance();
                has_iter = walk.settle(col_list, group, m_block_min, m_block_end);
                const int head_next = has_iter ? head_kv * group + walk.head_i : head;
                const int m0_next = has_iter ? walk.tile(col_list) * kBlockM : m0;
                if (needs_mask(m0)) step(it, head, m0, head_next, m0_next, has_iter, BoolConstant<true>{});
                else step(it, head, m0, head_next, m0_next, has_iter, BoolConstant<false>{});
            }
        } else if constexpr (T::kMaskMod) {  // the iterations the states do not mark empty
            for (int it = visible_from(0), i = 0; it < n_iters; ++i) {
                const int next = visible_from(it + 1);
                const int head = head_kv * group + it / n_mblocks, m0 = (m_block_min + it % n_mblocks) * kBlockM;
                const int head_next = next < n_iters ? head_kv * group + next / n_mblocks : head;
                const int m0_next = next < n_iters ? (m_block_min + next % n_mblocks) * kBlockM : m0;
                if (needs_mask(m0)) step(i, head, m0, head_next, m0_next, next < n_iters, BoolConstant<true>{});
                else step(i, head, m0, head_next, m0_next, next < n_iters, BoolConstant<false>{});
                it = next;
            }
        } else {
            for (int it = 0; it < n_iters; ++it) {
                // (query head, query block) of this iteration and of the next one (whose Q / dO are prefetched)
                const int head = head_kv * group + it / n_mblocks, m0 = (m_block_min + it % n_mblocks) * kBlockM;
                const int head_next = head_kv * group + (it + 1) / n_mblocks;
                const int m0_next = (m_block_min + (it + 1) % n_mblocks) * kBlockM;
                if (needs_mask(m0))
                    step(it, head, m0, head_next, m0_next, false, BoolConstant<true>{});
                else
                    step(it, head, m0, head_next, m0_next, false, BoolConstant<false>{});
            }
        }

        // Epilogue: dK * scale and dV through the K / V tiles, then 16-byte stores.
        cp_async_wait<0>();
        __syncthreads();
        store_acc<T::kIsBF16, TileKV, T::kXorSafe_dKV>(sK, acc_dk, kv_n0(warp), kv_d0(warp), f.softmax_scale, lane);
        store_acc<T::kIsBF16, TileKV, T::kXorSafe_dKV>(sV, acc_dv, kv_n0(warp), kv_d0(warp), 1.f, lane);
        __syncthreads();
        u16* dk = (u16*)p.dk + batch * p.dk_batch_stride + (i64)(k_start + n0) * p.dk_row_stride +
                  head_kv * p.dk_head_stride;
        u16* dv = (u16*)p.dv + batch * p.dv_batch_stride + (i64)(k_start + n0) * p.dv_row_stride +
                  head_kv * p.dv_head_stride;
        store_tile<TileKV, T::kNThreads>(sK, dk, p.dk_row_stride, seqlen_k - n0, f.head_dim, tid);
        store_tile<TileKV, T::kNThreads>(sV, dv, p.dv_row_stride, seqlen_k - n0, f.head_dim, tid);
        __syncthreads();  // the next key block reloads K and V into these tiles
    }
}

}  // namespace flashtrain
