// FlashAttention-2 backward (Algorithm 2) on Hopper tensor cores: the same algorithm and outputs as flash_bwd.cuh,
// with the five GEMMs issued as warpgroup MMAs (wgmma.cuh) by one warpgroup per CTA (build.py runs several CTAs per
// SM, so one CTA's softmax-gradient math overlaps another's GEMMs).
//
// One CTA owns kBlockN = 64 keys of one (batch, kv head): K and V stay in shared memory, dK and dV in registers,
// and the CTA walks every query block that can see these keys, for every query head of the GQA group, with Q, dO and
// the row statistics double-buffered. The warpgroup's rows are the keys, so it computes the transposed scores:
//     S^T = K Q^T, dP^T = V dO^T                (wgmma, both operands in shared memory)
//     P^T = exp(scale * S^T - lse), dS^T = P^T * (dP^T - D)          (masked: 0; lse, D per column = query)
//     dV += P^T dO, dK += dS^T Q                (wgmma, P^T / dS^T from registers: they are in A-fragment layout)
//     dS^T -> shared memory; dQ(block) = dS K    (wgmma, 64 columns of head_dim at a time) -> red.global.add.v4
//                                                into dq_accum in the scrambled order of flash_bwd.cuh's add_dq
// then writes dK * scale and dV. The row statistics are read from global memory one iteration ahead (lse already in
// log2 units, +inf where a query sees no key or lies past the end, so that its P is 0) and stored to shared memory
// late in the iteration, so their latency hides behind the GEMMs.
// Block-sparse (kIsBlockSparse; as in flash_bwd.cuh): the CTA walks only the query tiles of the non-zero blocks of its
// key block's column of the block mask, for every query head of the group, cut by causal and the end as the dense walk.
// Dropout: the keep bits are those of the forward (utils.cuh DropoutRng, addressed by (batch * head, query, key));
// a thread's 8 elements of a 16 x 16 tile are the words of 2 lanes of the forward's layout (its rows are keys), so it
// makes 2 Philox calls per tile. Dense attention, not deterministic, head dims 64 and 128 (build.py routes the rest to
// flash_bwd.cuh). flash_aux.cuh runs before (D, zeroing dq_accum) and after (dq = scale * dq_accum).
#pragma once
#include "wgmma.cuh"

namespace flashtrain {

template <int kHeadDim_, bool kIsBF16_, bool kIsCausal_, bool kIsDropout_, bool kIsBlockSparse_>
struct BwdSm90Traits {
    static constexpr int kHeadDim = kHeadDim_, kBlockM = 64, kBlockN = 64, kNThreads = 128, kStages = 2;
    static constexpr bool kIsBF16 = kIsBF16_, kIsCausal = kIsCausal_, kIsDropout = kIsDropout_;
    static constexpr bool kIsBlockSparse = kIsBlockSparse_;
    static constexpr int kNT = kBlockM / 8;   // n8 column tiles of S^T per thread (columns = queries)
    static constexpr int kDT = kHeadDim / 8;  // n8 column tiles of dK, dV per thread
    static_assert(kHeadDim == 64 || kHeadDim == 128, "head dims 64 and 128 (128-byte swizzled column blocks)");
    static_assert(kNThreads == 2 * kBlockM, "one thread per lse / D value of a query block");
    using TileQ = SmemTile<kBlockM, kHeadDim>;   // Q and dO
    using TileKV = SmemTile<kBlockN, kHeadDim>;  // K and V, then dK and dV
    using TileS = SmemTile<kBlockN, kBlockM>;    // dS^T (rows keys, columns queries)
    static constexpr int kStatsBytes = kBlockM * 4;
    static constexpr int kSmemBytes =
        2 * kStages * TileQ::kBytes + 2 * TileKV::kBytes + TileS::kBytes + 2 * kStages * kStatsBytes + 1024;
};

template <class T> __device__ __forceinline__ void flash_bwd_sm90(const BwdParams& p) {
    extern __shared__ __align__(128) unsigned char smem[];
    const FwdParams& f = p.fwd;
    constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN, kNT = T::kNT, kDT = T::kDT, kHeadDim = T::kHeadDim;
    using TileQ = typename T::TileQ;
    using TileKV = typename T::TileKV;
    using TileS = typename T::TileS;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int g = lane >> 2, t = lane & 3;

    const int n_block = blockIdx.x, batch = blockIdx.y, head_kv = blockIdx.z;
    const int group = f.nheads / f.nheads_kv;  // query heads per kv head
    int q_start, k_start, seqlen_q, seqlen_k;
    seq_bounds(f, batch, q_start, k_start, seqlen_q, seqlen_k);
    const int n0 = n_block * kBlockN;
    if (n0 >= seqlen_k) return;
    // Query blocks that see some key of this block: causal rows i >= n0 - (seqlen_k - seqlen_q).
    const int m_block_min = T::kIsCausal ? max_(0, n0 - (seqlen_k - seqlen_q)) / kBlockM : 0;
    const int n_mblocks = max_(0, ceil_div(seqlen_q, kBlockM) - m_block_min);
    const int n_iters = group * n_mblocks;  // (query head, query block) pairs

    const u32 base = (smem_u32(smem) + 1023) & ~1023u;
    const u32 sK = base + 2 * T::kStages * TileQ::kBytes, sV = sK + TileKV::kBytes, sdS = sV + TileKV::kBytes;
    const u32 sStats = sdS + TileS::kBytes;  // lse_log2[kStages][kBlockM], then D[kStages][kBlockM]
    auto sQ = [&](int stage) { return base + stage * TileQ::kBytes; };
    auto sdO = [&](int stage) { return base + (T::kStages + stage) * TileQ::kBytes; };

    const u16* k = (const u16*)f.k + batch * f.k_batch_stride + (i64)(k_start + n0) * f.k_row_stride +
                   head_kv * f.k_head_stride;
    const u16* v = (const u16*)f.v + batch * f.v_batch_stride + (i64)(k_start + n0) * f.v_row_stride +
                   head_kv * f.v_head_stride;
    load_tile_async<TileKV, T::kNThreads>(sK, k, f.k_row_stride, seqlen_k - n0, f.head_dim, tid);
    load_tile_async<TileKV, T::kNThreads>(sV, v, f.v_row_stride, seqlen_k - n0, f.head_dim, tid);

    auto coords = [&](int it, int& head, int& m0) {
        head = head_kv * group + it / n_mblocks;
        m0 = (m_block_min + it % n_mblocks) * kBlockM;
    };
    auto load_q_do = [&](int head, int m0, int stage) {
        const u16* q = (const u16*)f.q + batch * f.q_batch_stride + (i64)(q_start + m0) * f.q_row_stride +
                       head * f.q_head_stride;
        const u16* dout = (const u16*)p.dout + batch * p.do_batch_stride + (i64)(q_start + m0) * p.do_row_stride +
                          head * p.do_head_stride;
        load_tile_async<TileQ, T::kNThreads>(sQ(stage), q, f.q_row_stride, seqlen_q - m0, f.head_dim, tid);
        load_tile_async<TileQ, T::kNThreads>(sdO(stage), dout, p.do_row_stride, seqlen_q - m0, f.head_dim, tid);
    };
    // Thread tid < kBlockM loads lse of query m0 + tid, the others D of query m0 + tid - kBlockM (raw values; rows past
    // the end: lse -inf, D 0), and later stores them converted (lse in log2 units, -inf -> +inf).
    const bool is_d = tid >= kBlockM;
    const int stat_row = tid % kBlockM;
    auto load_stat = [&](int head, int m0) {
        const int row = m0 + stat_row;
        if (row >= seqlen_q) return is_d ? 0.f : -infinity();
        const float* src = (is_d ? p.softmax_d : f.lse) + batch * f.lse_batch_stride + head * f.lse_head_stride +
                           q_start + row;
        return *src;
    };
    auto store_stat = [&](float raw, int stage) {
        const float value = is_d ? raw : (raw == -infinity() ? infinity() : raw * kLog2e);
        asm volatile("st.shared.f32 [%0], %1;" ::"r"(sStats + ((is_d ? T::kStages : 0) + stage) * T::kStatsBytes +
                                                         4 * stat_row),
                     "f"(value));
    };

    // Block-sparse: the (query head, query tile) pairs come from the column list of this key tile's mask block, for
    // each query head of the group (SparseWalkAsc), cut to [m_block_min, m_block_end); sp_* hold the current and the
    // next pair.
    auto col_list = [&](int i) {
        return f.bs_cols + (head_kv * group + i) * f.bs_cols_head_stride +
               (i64)(n0 / kBlockSparseSize) * (f.bs_n_qblocks + 1);
    };
    SparseWalkAsc<kBlockSparseSize / kBlockM> walk;
    const int m_block_end = ceil_div(seqlen_q, kBlockM);
    bool sp_has = false, sp_has_next = false;
    int sp_head = 0, sp_m0 = 0, sp_head_next = 0, sp_m0_next = 0;
    if constexpr (T::kIsBlockSparse) {
        sp_has = walk.settle(col_list, group, m_block_min, m_block_end);
        if (sp_has) {
            sp_head = head_kv * group + walk.head_i;
            sp_m0 = walk.tile(col_list) * kBlockM;
            load_q_do(sp_head, sp_m0, 0);
            store_stat(load_stat(sp_head, sp_m0), 0);
        }
    } else if (n_iters > 0) {
        int head, m0;
        coords(0, head, m0);
        load_q_do(head, m0, 0);
        store_stat(load_stat(head, m0), 0);
    }
    cp_async_commit();

    float acc_dk[kDT][4], acc_dv[kDT][4];
#pragma unroll
    for (int i = 0; i < kDT; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc_dk[i][j] = acc_dv[i][j] = 0.f;
    const int warp_n0 = warp * 16;  // first key row of this warp inside the block (wgmma M rows)
    DropoutRng rng = T::kIsDropout ? DropoutRng(f.rng_state, f.keep_threshold) : DropoutRng{};

    auto step = [&](int it, auto mask_tag) {
        constexpr bool kMask = decltype(mask_tag)::value;
        const int stage = it & 1;
        int head, m0;
        if constexpr (T::kIsBlockSparse) head = sp_head, m0 = sp_m0;
        else coords(it, head, m0);
        cp_async_wait<0>();
        fence_proxy_async();
        __syncthreads();  // Q, dO, stats of `it` landed and stored; every thread is done with iteration it - 1
        float stat_next = 0.f;
        if (T::kIsBlockSparse ? sp_has_next : it + 1 < n_iters) {
            int head_next, m0_next;
            if constexpr (T::kIsBlockSparse) head_next = sp_head_next, m0_next = sp_m0_next;
            else coords(it + 1, head_next, m0_next);
            load_q_do(head_next, m0_next, stage ^ 1);
            stat_next = load_stat(head_next, m0_next);
        }
        cp_async_commit();

        // S^T = K Q^T and dP^T = V dO^T: kHeadDim / 16 k-steps each, step kk reads 16 columns of column block kk / 4.
        float st[kNT][4], dpt[kNT][4];
        // (Two loops: S^T's steps, then dP^T's. One loop interleaving them costs the dropout kernels 4-24 B of spills.)
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 16; ++kk) {
            const u32 off_kv = (kk / 4) * kBlockN * 128 + (kk % 4) * 32;
            const u32 off_q = (kk / 4) * kBlockM * 128 + (kk % 4) * 32;
            wgmma_ss<kBlockM, T::kIsBF16>(st, gmma_desc(sK + off_kv, 16, 1024),
                                          gmma_desc(sQ(stage) + off_q, 16, 1024), kk > 0);
        }
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 16; ++kk) {
            const u32 off_kv = (kk / 4) * kBlockN * 128 + (kk % 4) * 32;
            const u32 off_q = (kk / 4) * kBlockM * 128 + (kk % 4) * 32;
            wgmma_ss<kBlockM, T::kIsBF16>(dpt, gmma_desc(sV + off_kv, 16, 1024),
                                          gmma_desc(sdO(stage) + off_q, 16, 1024), kk > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        fence_operand(st);
        fence_operand(dpt);

        // P^T and dS^T, packed into A fragments (16 queries per k-step of the dV / dK GEMMs).
        const u32 sLse = sStats + stage * T::kStatsBytes, sD = sStats + (T::kStages + stage) * T::kStatsBytes;
        u32 pa[kNT / 2][4], dsa[kNT / 2][4];
        u32 bits[2][4];  // dropout: Philox words of queries 2t and 2t + 1 (mod 8) of the current 16-query tile
#pragma unroll
        for (int j = 0; j < kNT; ++j) {
            if (T::kIsDropout && j % 2 == 0) {
                const int bh = batch * f.nheads + head;
                rng.bits(bits[0], bh, m0 + 8 * j + 2 * t, n0 + warp_n0 + g);
                rng.bits(bits[1], bh, m0 + 8 * j + 2 * t + 1, n0 + warp_n0 + g);
            }
            float lse[2], dsum[2];
            const u32 col_bytes = 4 * (8 * j + 2 * t);  // this thread's two columns (queries) of n8 tile j
            asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(lse[0]), "=f"(lse[1]) : "r"(sLse + col_bytes));
            asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(dsum[0]), "=f"(dsum[1]) : "r"(sD + col_bytes));
            float prob[4], ds[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = st[j][e];
                if constexpr (kMask) {
                    const int key = n0 + warp_n0 + g + 8 * (e >> 1), query = m0 + 8 * j + 2 * t + (e & 1);
                    if (key >= seqlen_k || (T::kIsCausal && key > query + seqlen_k - seqlen_q)) x = -infinity();
                }
                prob[e] = fast_exp2(x * f.softmax_scale_log2 - lse[e & 1]);
                if constexpr (T::kIsDropout) {  // element (query 8j + 2t + e % 2, key g + 8 (e / 2)) of the tile
                    const bool keep = rng.keep_half(bits[e & 1], (j & 1) * 4 + (e >> 1) * 2 + (g & 1));
                    ds[e] = prob[e] * ((keep ? dpt[j][e] * f.rp_dropout : 0.f) - dsum[e & 1]);
                    prob[e] = keep ? prob[e] * f.rp_dropout : 0.f;  // Pd^T for dV
                } else {
                    ds[e] = prob[e] * (dpt[j][e] - dsum[e & 1]);
                }
            }
            // A fragment of k-step j / 2: regs 0, 1 from n8 tile 2 (j / 2), regs 2, 3 from tile 2 (j / 2) + 1
            pa[j / 2][2 * (j % 2)] = pack2<T::kIsBF16>(prob[0], prob[1]);
            pa[j / 2][2 * (j % 2) + 1] = pack2<T::kIsBF16>(prob[2], prob[3]);
            dsa[j / 2][2 * (j % 2)] = pack2<T::kIsBF16>(ds[0], ds[1]);
            dsa[j / 2][2 * (j % 2) + 1] = pack2<T::kIsBF16>(ds[2], ds[3]);
        }

        // dV += P^T dO, dK += dS^T Q: B = dO / Q, rows = queries (the reduction), MN-major.
        fence_operand(acc_dv);
        fence_operand(acc_dk);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kBlockM / 16; ++ks)
            wgmma_rs<kHeadDim, T::kIsBF16>(acc_dv, pa[ks],
                                           gmma_desc(sdO(stage) + ks * 16 * 128, kBlockM * 128, 1024), 1);
#pragma unroll
        for (int ks = 0; ks < kBlockM / 16; ++ks)
            wgmma_rs<kHeadDim, T::kIsBF16>(acc_dk, dsa[ks],
                                           gmma_desc(sQ(stage) + ks * 16 * 128, kBlockM * 128, 1024), 1);
        wgmma_commit();

        // dS^T to shared memory (rows keys, columns queries) for dQ = dS K.
#pragma unroll
        for (int ks = 0; ks < kBlockM / 16; ++ks)
#pragma unroll
            for (int r = 0; r < 4; ++r)  // (row g | g + 8, columns 16 ks + 2t | + 8)
                st_shared_b32(TileS::addr(sdS, warp_n0 + g + 8 * (r & 1), 16 * ks + 8 * (r >> 1) + 2 * t),
                              dsa[ks][r]);
        fence_proxy_async();
        __syncthreads();  // dS^T complete
        if (T::kIsBlockSparse ? sp_has_next : it + 1 < n_iters)
            store_stat(stat_next, stage ^ 1);  // read from iteration it + 1 on (after its barrier)

        // dQ(block) = dS K, 64 columns of head_dim per pass: A = dS (dS^T in shared memory: M-major), B = K (MN-major).
        float* dq_head =
            p.dq_accum + batch * p.dqa_batch_stride + (i64)q_start * f.head_dim + head * p.dqa_head_stride;
        const bool whole = m0 + kBlockM <= seqlen_q && f.head_dim == kHeadDim;
#pragma unroll
        for (int h = 0; h < kHeadDim / 64; ++h) {
            float dq[8][4];
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < kBlockN / 16; ++ks)
                wgmma_ss_tt<64, T::kIsBF16>(dq, gmma_desc(sdS + ks * 16 * 128, kBlockM * 128, 1024),
                                            gmma_desc(sK + h * kBlockN * 128 + ks * 16 * 128, kBlockN * 128, 1024),
                                            ks > 0);
            wgmma_commit();
            wgmma_wait<0>();
            fence_operand(dq);
            if (whole) {
                // Scrambled whole block (flash_bwd.cuh, add_dq; slice width W = 64): 16-row group = this warp's rows,
                // slice h; a lane's 4 accumulators of n8 tile j are 4 consecutive floats.
                float* slice =
                    dq_head + (i64)m0 * kHeadDim + launder((u32)(warp * 16 * kHeadDim + h * 16 * 64 + lane * 4));
#pragma unroll
                for (int j = 0; j < 8; ++j) atomic_add4(slice + j * 128, dq[j]);
            } else {
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int row = m0 + warp * 16 + g + 8 * hf;
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        const int col = 64 * h + 8 * j + 2 * t;
                        if (row < seqlen_q && col < f.head_dim)
                            atomic_add2(dq_head + (i64)row * f.head_dim + col, dq[j][2 * hf], dq[j][2 * hf + 1]);
                    }
                }
            }
        }
    };
    if constexpr (T::kIsBlockSparse) {
        for (int it = 0; sp_has; ++it) {
            walk.advance();
            sp_has_next = walk.settle(col_list, group, m_block_min, m_block_end);
            if (sp_has_next) {
                sp_head_next = head_kv * group + walk.head_i;
                sp_m0_next = walk.tile(col_list) * kBlockM;
            }
            if (tile_needs_mask<T::kIsCausal, kBlockN>(sp_m0, n0, seqlen_q, seqlen_k))
                step(it, BoolConstant<true>{});
            else
                step(it, BoolConstant<false>{});
            sp_has = sp_has_next, sp_head = sp_head_next, sp_m0 = sp_m0_next;
        }
    } else {
        for (int it = 0; it < n_iters; ++it) {
            const int m0 = (m_block_min + it % n_mblocks) * kBlockM;
            if (tile_needs_mask<T::kIsCausal, kBlockN>(m0, n0, seqlen_q, seqlen_k))
                step(it, BoolConstant<true>{});
            else
                step(it, BoolConstant<false>{});
        }
    }

    // Epilogue: dK * scale and dV through the K / V tiles, then 16-byte stores.
    cp_async_wait<0>();
    wgmma_wait<0>();
    fence_operand(acc_dk);
    fence_operand(acc_dv);
    __syncthreads();
    float(&dk1)[1][kDT][4] = *reinterpret_cast<float(*)[1][kDT][4]>(&acc_dk);
    float(&dv1)[1][kDT][4] = *reinterpret_cast<float(*)[1][kDT][4]>(&acc_dv);
    store_acc<T::kIsBF16, TileKV>(sK, dk1, warp_n0, 0, f.softmax_scale, lane);
    store_acc<T::kIsBF16, TileKV>(sV, dv1, warp_n0, 0, 1.f, lane);
    __syncthreads();
    u16* dk = (u16*)p.dk + batch * p.dk_batch_stride + (i64)(k_start + n0) * p.dk_row_stride +
              head_kv * p.dk_head_stride;
    u16* dv = (u16*)p.dv + batch * p.dv_batch_stride + (i64)(k_start + n0) * p.dv_row_stride +
              head_kv * p.dv_head_stride;
    store_tile<TileKV, T::kNThreads>(sK, dk, p.dk_row_stride, seqlen_k - n0, f.head_dim, tid);
    store_tile<TileKV, T::kNThreads>(sV, dv, p.dv_row_stride, seqlen_k - n0, f.head_dim, tid);
}

}  // namespace flashtrain
