// Small memory-bound kernels around the backward, and the test-only dropout-mask kernel. kRowsPerCta query rows per
// CTA, grid (ceil(R / kRowsPerCta), batch, nheads), R = max_seqlen_q (padded: rounded up to whole query blocks of
// dq_block_m rows); the preprocess's rows as one flat range of 16-byte chunks, the conversion's in groups of lanes
// (AuxRowGroup), dq from the scrambled layout in whole slices.
//   preprocess: D[row] = sum_d dout[row, d] * out[row, d] (fp32), minus dlse[row] when the gradient reaches lse
//               (dS = P * (dP - D) + P * dlse: the lse term folds into D; not for rows that saw no key, whose P is 0)
//               and dq_accum[:, row, :] = 0 (fused_dq: also the query blocks' counts, and dq = 0 on rows no key
//               block sees); padded (the Hopper
//               backward, flash.h): also lse_log2[row] = lse * log2(e) (+inf for -inf; lse_bias: -lse / softmax_scale,
//               -inf for -inf), and for the padding rows of a sequence's last query block lse_log2 = +inf (lse_bias:
//               -inf; lse_bias also negates D), D = 0, dq_accum = 0;
//   convert_dq: dq[row, :] = softmax_scale * sum_split dq_accum[split, row, :] in the input dtype (dq_frag: one CTA
//               per 80-row block of the Hopper backward's fragment order, bwd_convert_dq_frag);
//   dropout_mask: mask[row, j] = keep(row, j) for j < seqlen_k, the bits the forward and backward kernels draw.
#pragma once
#include "utils.cuh"

namespace flashtrain {

constexpr int kAuxThreads = 128, kRowsPerCta = 32;
constexpr int kDqFragRows = 80;  // the fragment order's query blocks (bwd_convert_dq_frag)

// Grid order. The Hopper backward takes its units (kv head, batch) in ascending order, so the preprocess and the dQ
// conversion take the grid's CTAs in reverse (row block, batch and head all descending: the last (head, batch)
// first): the preprocess ends on the rows the backward starts with (their zeroed dq_accum and dO still in L2), and
// the conversion starts on the rows the backward ended with (backward 1.005-1.008x at 512-1K tokens, level from 4K).
// FT_AUX_REVERSE (A/B build): bit 0 the preprocess, bit 1 the conversion reversed; 0 is the ascending order.
#ifndef FT_AUX_REVERSE
#define FT_AUX_REVERSE 3
#endif
// This CTA's row block, batch and head (the grid's x, y, z), reversed where FT_AUX_REVERSE has kBit (kBit 0: never)
template <int kBit> struct AuxBlock {
    static constexpr bool kReverse = (FT_AUX_REVERSE & kBit) != 0;
    __device__ __forceinline__ static int x() { return kReverse ? gridDim.x - 1 - blockIdx.x : blockIdx.x; }
    __device__ __forceinline__ static int y() { return kReverse ? gridDim.y - 1 - blockIdx.y : blockIdx.y; }
    __device__ __forceinline__ static int z() { return kReverse ? gridDim.z - 1 - blockIdx.z : blockIdx.z; }
};

// Sequence bounds of CTA B (B::y() = batch); false when this CTA's rows are all past the end (padded: past the
// end of the sequence's last query block). pad_start: the sequence's first row in the padded arrays (padded layouts),
// else q_start.
struct AuxRows {
    int q_start, seqlen_q, k_start, seqlen_k, row_begin, pad_start, rows_end;
    template <class B> __device__ __forceinline__ bool init(const AuxParams& p) {
        q_start = 0, seqlen_q = p.seqlen_q, k_start = 0, seqlen_k = p.seqlen_k;
        if (p.cu_seqlens_q != nullptr) packed_seq(p.cu_seqlens_q, B::y(), p.seqlen_q, p.total_q, q_start, seqlen_q);
        if (p.cu_seqlens_k != nullptr) packed_seq(p.cu_seqlens_k, B::y(), p.seqlen_k, p.total_k, k_start, seqlen_k);
        row_begin = B::x() * kRowsPerCta;
        pad_start = q_start, rows_end = seqlen_q;
        if (p.padded) {
            pad_start = padded_row_start(p.cu_seqlens_q != nullptr, B::y(), q_start, p.seqlen_q, p.dq_block_m);
            rows_end = ceil_div(seqlen_q, p.dq_block_m) * p.dq_block_m;
        }
        return row_begin < rows_end;
    }
};

// The conversion's row-major rows: a row takes `lanes` = the next power of two >= head_dim / 8 lanes (at most 32),
// each 8 columns (32 bytes of dq_accum) at a time, so that every lane of a warp has loads in flight; a warp works on
// 32 / lanes rows at once. (One warp per row left 24 of 32 lanes idle at head dim 64: these kernels are memory-bound,
// and at short sequences their traffic -- dout, out, dq_accum written, read, dq written -- is a tenth of the backward's
// time: with these two kernels the whole backward got 1.02-1.31x faster at S 512-4K, hd64 512 227 -> 285 TFLOP/s, H200
// A/B 2026-11-24, and the two take as long as cuDNN's own pair, 75 + 58 us for 16 x 1K x 32 heads x hd64.)
struct AuxRowGroup {
    int lanes, sub, slot, rows_per_warp;
    __device__ __forceinline__ explicit AuxRowGroup(int head_dim, int lane) {
        lanes = 1;
        while (lanes < 32 && lanes * 8 < head_dim) lanes *= 2;
        sub = lane % lanes, slot = lane / lanes, rows_per_warp = 32 / lanes;
    }
};

// A Hopper backward whose head_dim is below its instantiated one (dqa_cols: head dims 65-96 on the hd128 tiles, 129-192
// on hd192's) adds into dq_accum's permuted blocks either only the columns it computes or zeros past them, and the
// conversions read only the columns < head_dim. In both permuted layouts those columns are a prefix of each block of
// rows, read as plain rows of dqa_cols floats: 16 round_up(head_dim, 8) floats of each 16-row group of slices (n8 tile
// j of a slice at 128 j floats), 80 round_up(head_dim, 16) of each 80-row block of the fragment order (16-column
// slices). The preprocess zeroes that prefix, rounded up to whole rows, and the scrambled conversion reads only the n8
// tiles below head_dim (FT_AUX_NARROW; 0: every column of dqa_cols).
#ifndef FT_AUX_NARROW
#define FT_AUX_NARROW 1
#endif
struct AuxZeroRows {
    int group = 0, rows = 0;  // rows r of a sequence with r % group >= rows are not zeroed (group 0: all are)
    __device__ __forceinline__ explicit AuxZeroRows(const AuxParams& p) {
        if (!FT_AUX_NARROW || !p.padded || p.head_dim >= p.dqa_cols || p.nsplits != 1) return;
        // (whole rows: the prefix rounded up to a row; the slice layouts as bwd_convert_dq reads them)
        const int W = p.dq_slice_width;
        if (p.dq_frag) {
            group = kDqFragRows, rows = ceil_div(kDqFragRows * ((p.head_dim + 15) / 16 * 16), p.dqa_cols);
        } else if (W > 0 && W % 32 == 0 && p.dq_block_m % kRowsPerCta == 0) {
            group = 16, rows = ceil_div(16 * ((p.head_dim + 7) / 8 * 8), p.dqa_cols);
        }
    }
    __device__ __forceinline__ bool zero(int row) const { return group == 0 || row % group < rows; }
};

// The preprocess of a CTA's rows: its rows x head_dim / 8 chunks of 16 bytes of out / dout as one flat range, chunk
// i = row * chunks + c, thread t taking chunks t + kAuxThreads k, kAuxChunks of them per pass with all of a pass's
// loads issued before any is used; each chunk's partial dot product into shared memory, then four threads per row sum
// the row's partials in a fixed order (deterministic) and the first writes D / lse_log2. dq_accum's rows (one
// contiguous range per split) are zeroed as flat float4s while the first pass's loads are in flight. (Before, lanes
// per row as in AuxRowGroup: at head dims whose 16-byte chunks are not a power of two -- 80, 96, 192 -- up to a
// quarter of the lanes idle, and every lane's loads one row at a time.) H200, 2026-12-02, interleaved CUDA-graph
// replays (ab_probe.py), whole backward, flat / lanes per row: hd64 512 non-causal 1.005, hd128 causal 512 1.005,
// hd96 / hd192 causal 4K 1.005 / 1.006, hd64 causal 4K 1.002, GQA 32/8 8K 1.001. kAuxChunks (FT_AUX_CHUNKS, A/B):
// 2 (56 registers); 4 (70) was 0.988 of it at hd64 512, 1.002-1.004 at hd96 / hd128; 8 (110) 0.944-1.001.
#ifndef FT_AUX_CHUNKS
#define FT_AUX_CHUNKS 2
#endif
constexpr int kAuxChunks = FT_AUX_CHUNKS, kAuxMaxChunksPerRow = 512 / 8;  // (head dims up to interface.MAX_HEAD_DIM)
template <bool kIsBF16> __device__ __forceinline__ void bwd_preprocess(const AuxParams& p) {
    __shared__ float partial[kRowsPerCta * kAuxMaxChunksPerRow];
    grid_launch_dependents();  // the Hopper backward may start its prologue (it waits for this grid's writes)
    using B = AuxBlock<1>;
    AuxRows rows;
    if (!rows.init<B>(p)) return;
    const int batch = B::y(), head = B::z(), tid = threadIdx.x;
    const int row_end = min_(rows.rows_end, rows.row_begin + kRowsPerCta), n_rows = row_end - rows.row_begin;
    if (p.fused_dq) {  // the Hopper backward converts dq itself (flash.h AuxParams::fused_dq)
        if (tid == 0 && rows.row_begin % p.dq_block_m == 0)
            p.dq_counts[head * p.dq_counts_head_stride + (rows.pad_start + rows.row_begin) / p.dq_block_m] = 0;
        const int unseen_end = rows.seqlen_k == 0 ? rows.seqlen_q
                               : p.fused_dq == 2  ? max_(0, rows.seqlen_q - rows.seqlen_k)
                                                  : 0;
        const int pieces = p.head_dim / 8, n_pieces = (min_(unseen_end, row_end) - rows.row_begin) * pieces;
        u16* dq0 = (u16*)p.dq + batch * p.dq_batch_stride + head * p.dq_head_stride;
        for (int i = tid; i < n_pieces; i += kAuxThreads) {
            const u32 zeros[4] = {0u, 0u, 0u, 0u};
            st_global_v4(dq0 + (rows.q_start + rows.row_begin + i / pieces) * (i64)p.dq_row_stride + 8 * (i % pieces),
                         zeros);
        }
    }
    const int data_rows = max_(0, min_(n_rows, rows.seqlen_q - rows.row_begin));  // rows with out / dout
    const int chunks = p.head_dim / 8, n_chunks = data_rows * chunks;
    const i64 q_row0 = rows.q_start + rows.row_begin;
    const u16* out0 = (const u16*)p.out + batch * p.o_batch_stride + head * p.o_head_stride + q_row0 * p.o_row_stride;
    const u16* dout0 = (const u16*)p.dout + batch * p.do_batch_stride + head * p.do_head_stride +
                       q_row0 * p.do_row_stride;
    auto zero_accum = [&]() {  // this CTA's dq_accum rows, each split's a contiguous range
        const AuxZeroRows zero_rows(p);
        const int quads = p.dqa_cols / 4, n_quads = n_rows * quads;
        for (int split = 0; split < p.nsplits; ++split) {
            float* acc = (float*)p.dq_accum + split * p.dqa_split_stride + batch * p.dqa_batch_stride +
                         head * p.dqa_head_stride + (rows.pad_start + rows.row_begin) * (i64)p.dqa_cols;
            for (int i = tid; i < n_quads; i += kAuxThreads) {
                if (zero_rows.group != 0 && !zero_rows.zero(rows.row_begin + i / quads)) continue;
                const u32 zeros[4] = {0u, 0u, 0u, 0u};
                st_global_v4(acc + 4 * i, zeros);
            }
        }
    };
    const int row_step = kAuxThreads / chunks, col_step = kAuxThreads % chunks;
    for (int first = 0; first < n_chunks; first += kAuxThreads * kAuxChunks) {
        u32 o[kAuxChunks][4], d[kAuxChunks][4];
        int row = (first + tid) / chunks, col = (first + tid) % chunks;
#pragma unroll
        for (int k = 0; k < kAuxChunks; ++k) {
            if (first + tid + kAuxThreads * k < n_chunks) {
                ld_global_v4(out0 + row * p.o_row_stride + 8 * col, o[k]);
                ld_global_v4(dout0 + row * p.do_row_stride + 8 * col, d[k]);
            }
            row += row_step, col += col_step;
            if (col >= chunks) col -= chunks, ++row;
        }
        if (first == 0) zero_accum();  // while the loads are in flight
#pragma unroll
        for (int k = 0; k < kAuxChunks; ++k) {
            const int i = first + tid + kAuxThreads * k;
            if (i >= n_chunks) break;
            float dot = 0.f;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                float o_lo, o_hi, d_lo, d_hi;
                unpack2<kIsBF16>(o[k][j], o_lo, o_hi);
                unpack2<kIsBF16>(d[k][j], d_lo, d_hi);
                dot += o_lo * d_lo + o_hi * d_hi;
            }
            partial[i] = dot;
        }
    }
    if (n_chunks == 0) zero_accum();  // (a CTA of padding rows alone)
    __syncthreads();
    static_assert(kAuxThreads == 4 * kRowsPerCta, "four threads per row sum its partials");
    const int r = tid / 4, part = tid % 4;
    float dot = 0.f;
    if (r < data_rows)
        for (int c = part; c < chunks; c += 4) dot += partial[r * chunks + c];
    dot += shfl_xor(dot, 1);
    dot += shfl_xor(dot, 2);
    if (part != 0 || r >= n_rows) return;
    const int row = rows.row_begin + r;
    const bool in_seq = row < rows.seqlen_q;  // (padded: rows past the end are padding)
    const i64 at = batch * p.d_batch_stride + head * p.d_head_stride + rows.pad_start + row;
    const i64 lse_at = batch * p.lse_batch_stride + head * p.lse_head_stride + rows.q_start + row;
    if (p.dlse != nullptr && in_seq && p.lse[lse_at] != -infinity()) dot -= p.dlse[lse_at];
    p.softmax_d[at] = p.lse_bias ? -dot : dot;
    if (p.padded) {
        const float raw = in_seq ? p.lse[lse_at] : -infinity();
        p.lse_log2[at] = p.lse_bias ? (raw == -infinity() ? -infinity() : raw * (-1.f / p.softmax_scale))
                                    : (raw == -infinity() ? infinity() : raw * kLog2e);
    }
}

// dq of one 80-row query block (B::x()) whose dQ^T the Hopper backward added in its accumulator's order
// (p.dq_frag; BwdSm90Traits::kDqFrag): the block's 128 x 80 dQ^T is 8 slices of 16 head-dim columns x 80 queries,
// 1280 contiguous floats each, float4 32 j + l of a slice holding (query 8 j + 2 (l % 4), column l / 4), (query + 1,
// column), (query, column + 8), (query + 1, column + 8). A warp converts a slice at a time: coalesced float4 loads
// (the whole slice in flight), then per half of the slice (40 queries) the scaled 16-bit values into the warp's shared
// tile (bwd_convert_dq's, 40 rows x 16 columns, rows padded by 16 bytes) and each row's two 16-byte pieces to dq (rows
// past the sequence's end and columns past head_dim are not written).
// (the half slice's tile: kDqFragRows / 2 rows of kDqFragTileRow bytes)
constexpr int kDqFragSliceCols = 16, kDqFragTileRow = 2 * kDqFragSliceCols + 16;
constexpr int kDqFragTileBytes = kDqFragRows / 2 * kDqFragTileRow;
template <bool kIsBF16, class B> __device__ __forceinline__ void bwd_convert_dq_frag(const AuxParams& p, u32 tile) {
    constexpr int kRows = kDqFragRows, kCols = 128, kSliceCols = kDqFragSliceCols, kTileRow = kDqFragTileRow;
    constexpr int kHalf = kRows / 2;  // rows of the tile: a slice in two halves
    const int batch = B::y(), head = B::z(), warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int q_start = 0, seqlen_q = p.seqlen_q;
    if (p.cu_seqlens_q != nullptr) packed_seq(p.cu_seqlens_q, batch, p.seqlen_q, p.total_q, q_start, seqlen_q);
    const int row0 = B::x() * kRows;
    if (row0 >= seqlen_q) return;
    const int pad_start = padded_row_start(p.cu_seqlens_q != nullptr, batch, q_start, p.seqlen_q, kRows);
    const float* block = p.dq_accum + batch * p.dqa_batch_stride + head * p.dqa_head_stride +
                         (i64)(pad_start + row0) * kCols;
    u16* dq0 = (u16*)p.dq + batch * p.dq_batch_stride + head * p.dq_head_stride + (i64)(q_start + row0) * p.dq_row_stride;
    const int g = lane / 4, t = lane % 4;
    auto st16 = [](u32 addr, u32 v) { asm volatile("st.shared.b16 [%0], %1;" ::"r"(addr), "h"((unsigned short)v)); };
    for (int slice = warp; slice < kCols / kSliceCols && kSliceCols * slice < p.head_dim; slice += kAuxThreads / 32) {
        const float* src = block + slice * kRows * kSliceCols;
        float4 v[kRows / 8];
#pragma unroll
        for (int j = 0; j < kRows / 8; ++j) v[j] = ld_global_f4(src + 4 * (32 * j + lane));
#pragma unroll
        for (int half = 0; half < 2; ++half) {
#pragma unroll
            for (int jj = 0; jj < kHalf / 8; ++jj) {
                const int j = half * (kHalf / 8) + jj;
                const u32 at = tile + (8 * jj + 2 * t) * kTileRow + 2 * g;  // (query 8 j + 2 t, column g)
                const u32 lo = pack2<kIsBF16>(v[j].x * p.softmax_scale, v[j].y * p.softmax_scale);
                const u32 hi = pack2<kIsBF16>(v[j].z * p.softmax_scale, v[j].w * p.softmax_scale);
                st16(at, lo);
                st16(at + kTileRow, lo >> 16);
                st16(at + 16, hi);
                st16(at + kTileRow + 16, hi >> 16);
            }
            asm volatile("bar.warp.sync 0xffffffff;" ::: "memory");
            for (int c = lane; c < 2 * kHalf; c += 32) {
                const int row = half * kHalf + c / 2, col = kSliceCols * slice + 8 * (c % 2);
                if (row0 + row >= seqlen_q || col >= p.head_dim) continue;  // (head_dim: a multiple of 8)
                u32 w[4];
                ld_shared_v4(tile + (c / 2) * kTileRow + 16 * (c % 2), w);
                st_global_v4(dq0 + (i64)row * p.dq_row_stride + col, w);
            }
            asm volatile("bar.warp.sync 0xffffffff;" ::: "memory");  // (the tile is rewritten next)
        }
    }
}

// dq of a CTA's 32 rows. When they lie in a whole query block of the backward (dq_accum scrambled: each 16-row
// group's W-column slice, W = 32 or 64, is 16 W contiguous floats, float4 number 32 j + l holding rows l / 4 and
// l / 4 + 8, columns 8 j + 2 (l % 4) and + 1), a warp converts whole slices through its shared-memory tile: lane l
// reads float4s 32 j + l (coalesced) and stores its two rows' column pairs in the tile (rows padded by 16 bytes: the 8
// rows x 4 pairs of one float4 index fall in 32 banks), then the slice's rows go out as 16-byte pieces, a row's from
// consecutive lanes. (Writing the 4-byte pairs straight to global memory: 82 us against cuDNN's 59 us for its
// conversion, hd128, 16K tokens x 2048 columns, H200 2026-11-25.) Otherwise row-major rows in groups of lanes
// (AuxRowGroup).
template <bool kIsBF16> __device__ __forceinline__ void bwd_convert_dq(const AuxParams& p) {
    constexpr int kMaxSliceWidth = 64;  // = build.py MAX_DQ_SLICE_WIDTH, which checks the backward tiles against it
    __shared__ __align__(16) unsigned char slice_tiles[kAuxThreads / 32][16 * (2 * kMaxSliceWidth + 16)];
    grid_dependency_wait();  // launched programmatically after the Hopper backward: its dq_accum is complete
    static_assert(kDqFragTileBytes <= sizeof(slice_tiles[0]), "half a fragment-order slice fits the tile");
    using B = AuxBlock<2>;
    if (p.dq_frag) {
        bwd_convert_dq_frag<kIsBF16, B>(p, smem_u32(slice_tiles[threadIdx.x / 32]));
        return;
    }
    AuxRows rows;
    if (!rows.init<B>(p) || rows.row_begin >= rows.seqlen_q) return;
    const int batch = B::y(), head = B::z(), warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row_end = min_(rows.seqlen_q, rows.row_begin + kRowsPerCta);
    const int W = p.dq_slice_width;
    // (padded: a sequence's last query block is whole in dq_accum too; its rows past the end are not written)
    const bool scrambled = W > 0 && W % 32 == 0 && p.dq_block_m % kRowsPerCta == 0 &&
                           (p.padded || (rows.row_begin / p.dq_block_m + 1) * p.dq_block_m <= rows.seqlen_q);
    const float* acc0 = p.dq_accum + batch * p.dqa_batch_stride + head * p.dqa_head_stride +
                        (i64)(rows.pad_start - rows.q_start) * p.dqa_cols;
    u16* dq0 = (u16*)p.dq + batch * p.dq_batch_stride + head * p.dq_head_stride;
    if (scrambled) {
        // the layout's slices span dqa_cols (the Hopper backward's padded head dim); columns >= head_dim are not
        // written
        const int slices = p.dqa_cols / W, quads = 16 * W / 4, pieces = W / 8;  // float4s, 16-byte pieces per row
        const int tile_row = 2 * W + 16;                                          // bytes
        const u32 tile = smem_u32(slice_tiles[warp]);
        // (a warp barrier that also orders the tile's shared-memory accesses for the compiler)
        auto warp_sync = []() { asm volatile("bar.warp.sync 0xffffffff;" ::: "memory"); };
        for (int region = warp; region < (kRowsPerCta / 16) * slices; region += kAuxThreads / 32) {
            const int group_row = rows.row_begin + 16 * (region / slices), col0 = W * (region % slices);
            const i64 q_row = rows.q_start + group_row;
            const float* src = acc0 + q_row * p.dqa_cols + col0 * 16;
            // n8 tiles of the slice that hold columns < head_dim (FT_AUX_NARROW; the others are not read)
            const int tiles = FT_AUX_NARROW ? min_(quads / 32, (p.head_dim - col0 + 7) / 8) : quads / 32;
            for (int j0 = 0; j0 < tiles; j0 += 4) {  // 4 float4s in flight per lane
                float4 sum[4];
#pragma unroll
                for (int jj = 0; jj < 4; ++jj)
                    sum[jj] = j0 + jj < tiles ? ld_global_f4(src + 4 * (32 * (j0 + jj) + lane)) : float4{};
                for (int split = 1; split < p.nsplits; ++split) {  // fixed order: deterministic
#pragma unroll
                    for (int jj = 0; jj < 4; ++jj) {
                        if (j0 + jj >= tiles) break;
                        const float4 v = ld_global_f4(src + split * p.dqa_split_stride + 4 * (32 * (j0 + jj) + lane));
                        sum[jj].x += v.x, sum[jj].y += v.y, sum[jj].z += v.z, sum[jj].w += v.w;
                    }
                }
#pragma unroll
                for (int jj = 0; jj < 4; ++jj) {
                    const float4 v = sum[jj];
                    const u32 at = tile + (lane / 4) * tile_row + 16 * (j0 + jj) + 4 * (lane % 4);
                    st_shared_b32(at, pack2<kIsBF16>(v.x * p.softmax_scale, v.y * p.softmax_scale));
                    st_shared_b32(at + 8 * tile_row, pack2<kIsBF16>(v.z * p.softmax_scale, v.w * p.softmax_scale));
                }
            }
            warp_sync();
            for (int c = lane; c < 16 * pieces; c += 32) {
                const int row = c / pieces, col = col0 + 8 * (c % pieces);
                if (col >= p.head_dim || group_row + row >= rows.seqlen_q) continue;  // (head_dim: a multiple of 8)
                u32 v[4];
                ld_shared_v4(tile + row * tile_row + 16 * (c % pieces), v);
                st_global_v4(dq0 + (q_row + row) * p.dq_row_stride + col, v);
            }
            warp_sync();  // (the tile is rewritten by the next region)
        }
        return;
    }
    const AuxRowGroup grp(p.head_dim, lane);
    const int step = grp.rows_per_warp * (kAuxThreads / 32);
    for (int row = rows.row_begin + warp * grp.rows_per_warp + grp.slot; row < row_end; row += step) {
        const i64 q_row = rows.q_start + row;
        u16* dq = dq0 + q_row * p.dq_row_stride;
        for (int c = grp.sub * 8; c < p.head_dim; c += grp.lanes * 8) {
            float sum[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            for (int split = 0; split < p.nsplits; ++split) {  // fixed order: deterministic
                const float* acc_row = acc0 + split * p.dqa_split_stride + q_row * p.dqa_cols;
                u32 lo[4], hi[4];
                ld_global_v4(acc_row + c, lo);
                ld_global_v4(acc_row + c + 4, hi);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    sum[i] += __int_as_float(lo[i]);
                    sum[4 + i] += __int_as_float(hi[i]);
                }
            }
            u32 packed[4];
#pragma unroll
            for (int i = 0; i < 4; ++i)
                packed[i] = pack2<kIsBF16>(sum[2 * i] * p.softmax_scale, sum[2 * i + 1] * p.softmax_scale);
            st_global_v4(dq + c, packed);
        }
    }
}

__device__ __forceinline__ void dropout_mask(const AuxParams& p) {
    AuxRows rows;
    if (!rows.init<AuxBlock<0>>(p)) return;
    const int batch = blockIdx.y, head = blockIdx.z, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row_end = min_(rows.seqlen_q, rows.row_begin + kRowsPerCta);
    const DropoutRng rng(p.rng_state, p.keep_threshold);
    const int bh = batch * p.nheads + head;
    for (int row = rows.row_begin + warp; row < row_end; row += kAuxThreads / 32) {
        unsigned char* mask = p.dropout_mask + batch * p.mask_batch_stride + head * p.mask_head_stride +
                              (rows.q_start + row) * p.mask_row_stride;
        for (int col = lane; col < rows.seqlen_k; col += 32) {
            u32 bits[4];
            rng.bits(bits, bh, row, col);
            mask[col] = rng.keep(bits, row, col) ? 1 : 0;
        }
    }
}

}  // namespace flashtrain
