// Small memory-bound kernels around the backward, and the test-only dropout-mask kernel. One warp per query row,
// kRowsPerCta rows per CTA; grid (ceil(max_seqlen_q / kRowsPerCta), batch, nheads).
//   preprocess: D[row] = sum_d dout[row, d] * out[row, d] (fp32) and dq_accum[:, row, :] = 0;
//   convert_dq: dq[row, :] = softmax_scale * sum_split dq_accum[split, row, :] in the input dtype;
//   dropout_mask: mask[row, j] = keep(row, j) for j < seqlen_k, the bits the forward and backward kernels draw.
#pragma once
#include "utils.cuh"

namespace flashtrain {

constexpr int kAuxThreads = 128, kRowsPerCta = 32;

// Sequence bounds of CTA (blockIdx.y = batch); false when this CTA's rows are all past the end.
struct AuxRows {
    int q_start, seqlen_q, k_start, seqlen_k, row_begin;
    __device__ __forceinline__ bool init(const AuxParams& p) {
        q_start = 0, seqlen_q = p.seqlen_q, k_start = 0, seqlen_k = p.seqlen_k;
        if (p.cu_seqlens_q != nullptr) packed_seq(p.cu_seqlens_q, blockIdx.y, p.seqlen_q, p.total_q, q_start, seqlen_q);
        if (p.cu_seqlens_k != nullptr) packed_seq(p.cu_seqlens_k, blockIdx.y, p.seqlen_k, p.total_k, k_start, seqlen_k);
        row_begin = blockIdx.x * kRowsPerCta;
        return row_begin < seqlen_q;
    }
};

template <bool kIsBF16> __device__ __forceinline__ void bwd_preprocess(const AuxParams& p) {
    AuxRows rows;
    if (!rows.init(p)) return;
    const int batch = blockIdx.y, head = blockIdx.z, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row_end = min_(rows.seqlen_q, rows.row_begin + kRowsPerCta);
    for (int row = rows.row_begin + warp; row < row_end; row += kAuxThreads / 32) {
        const i64 q_row = rows.q_start + row;
        const u16* out = (const u16*)p.out + batch * p.o_batch_stride + q_row * p.o_row_stride + head * p.o_head_stride;
        const u16* dout =
            (const u16*)p.dout + batch * p.do_batch_stride + q_row * p.do_row_stride + head * p.do_head_stride;
        float dot = 0.f;
        for (int c = lane * 8; c < p.head_dim; c += 32 * 8) {
            u32 o4[4], d4[4];
            ld_global_v4(out + c, o4);
            ld_global_v4(dout + c, d4);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float o_lo, o_hi, d_lo, d_hi;
                unpack2<kIsBF16>(o4[i], o_lo, o_hi);
                unpack2<kIsBF16>(d4[i], d_lo, d_hi);
                dot += o_lo * d_lo + o_hi * d_hi;
            }
        }
#pragma unroll
        for (int mask = 16; mask > 0; mask /= 2) dot += shfl_xor(dot, mask);
        if (lane == 0) p.softmax_d[batch * p.d_batch_stride + head * p.d_head_stride + q_row] = dot;
        for (int split = 0; split < p.nsplits; ++split) {
            float* acc = (float*)p.dq_accum + split * p.dqa_split_stride + batch * p.dqa_batch_stride +
                         head * p.dqa_head_stride + q_row * p.dqa_cols;
            for (int c = lane * 4; c < p.dqa_cols; c += 32 * 4) {
                const u32 zeros[4] = {0u, 0u, 0u, 0u};
                st_global_v4(acc + c, zeros);
            }
        }
    }
}

template <bool kIsBF16> __device__ __forceinline__ void bwd_convert_dq(const AuxParams& p) {
    AuxRows rows;
    if (!rows.init(p)) return;
    const int batch = blockIdx.y, head = blockIdx.z, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row_end = min_(rows.seqlen_q, rows.row_begin + kRowsPerCta);
    for (int row = rows.row_begin + warp; row < row_end; row += kAuxThreads / 32) {
        const i64 q_row = rows.q_start + row;
        u16* dq = (u16*)p.dq + batch * p.dq_batch_stride + q_row * p.dq_row_stride + head * p.dq_head_stride;
        // Row in a scrambled 16-row group (flash_bwd.cuh, add_dq): its block of dq_block_m rows is whole.
        const bool scrambled = p.dq_slice_width > 0 && (row / p.dq_block_m + 1) * p.dq_block_m <= rows.seqlen_q;
        const int r = row % 16, W = p.dq_slice_width;
        for (int c = lane * 8; c < p.head_dim; c += 32 * 8) {
            float sum[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            for (int split = 0; split < p.nsplits; ++split) {  // fixed order: deterministic
                const float* acc_row = p.dq_accum + split * p.dqa_split_stride + batch * p.dqa_batch_stride +
                                       head * p.dqa_head_stride + q_row * p.dqa_cols;
                if (scrambled) {  // columns c + 2i, c + 2i + 1 (i < 4): 2 floats each, 16 bytes apart
                    const float* src = acc_row - r * p.dqa_cols + (c / W) * 16 * W + ((c % W) / 8) * 128 +
                                       (r % 8) * 16 + (r / 8) * 2;
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        sum[2 * i] += src[4 * i];
                        sum[2 * i + 1] += src[4 * i + 1];
                    }
                    continue;
                }
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
    if (!rows.init(p)) return;
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
