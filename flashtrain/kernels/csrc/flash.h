// Kernel parameters: plain structs of raw pointers, strides and sizes (no torch, no CUDA headers).
//
// Layouts (strides in elements, the last dimension of every tensor contiguous):
//   q, out, dout, dq   (batch, seqlen_q, nheads,    head_dim)   or varlen (total_q, nheads,    head_dim)
//   k, v, dk, dv       (batch, seqlen_k, nheads_kv, head_dim)   or varlen (total_k, nheads_kv, head_dim)
//   lse, softmax_d     float32 (batch, nheads, seqlen_q)        or varlen (nheads, total_q)
//   dq_accum           float32 (nsplits, batch, nheads, seqlen_q, C) or varlen (nsplits, nheads, total_q, C): C = head_dim
// The Hopper backward's workspaces use padded rows instead (utils.cuh padded_row_start: sequence b starts at a
// multiple of its query block M and owns whole blocks; rows_pad per head = batch * ceil(seqlen_q / M) * M, varlen
// total_q + batch * M rounded up to M; batch stride 0):
//   lse_log2, softmax_d float32 (nheads, rows_pad): lse * log2(e) (+inf past a sequence's end and for rows that saw
//                      no key), D (0 past the end); for the kernels whose S^T GEMM accumulates onto the lse term
//                      (AuxParams::lse_bias) lse_log2 holds -lse / softmax_scale instead (-inf there) and
//                      softmax_d holds -D
//   dq_accum           float32 (nsplits, nheads, rows_pad, C): C = the instantiated head dim (AuxParams::dqa_cols)
// Varlen: cu_seqlens_q/k (batch + 1, int32) give each sequence's first row; the batch strides are then 0.
//   bs_rows            int32 (mask heads, n_qblocks, n_kblocks + 1): per query block of the block mask, the number c
//                      of its non-zero key blocks, then those key blocks in ascending order (entries past c unused)
//   bs_cols            int32 (mask heads, n_kblocks, n_qblocks + 1): per key block, the same list of query blocks
// Block-sparse masks count blocks of kBlockSparseSize tokens from the start of each sequence (varlen included);
// mask heads is nheads, or 1 with head stride 0 (one mask shared by all heads).
//
// The Python side (flashtrain/kernels/launch.py) mirrors these structs with ctypes: keep the field order, and keep
// every 8-byte field before the 4-byte ones (or after an even number of them) so that both sides lay them out without
// padding surprises.
#pragma once

namespace flashtrain {

// Tokens per side of a block_mask block (= flashtrain.kernels.reference.BLOCK_SPARSE_SIZE; tests/test_kernel_build.py
// checks both). Every block-sparse kernel tile divides it, so that a mask block is a whole number of tiles.
constexpr int kBlockSparseSize = 128;

using i64 = long long;
using u64 = unsigned long long;
using u32 = unsigned int;

// A mask expression's tensors (mask_mod.py MaskMod; at most kMaskModTensors, of at most 4 dimensions): pointers, sizes
// and strides in elements, read by the predicate mask_mod.cuh builds; error: set nonzero when a subscript left its
// tensor (the element reads 0).
constexpr int kMaskModTensors = 4;  // = mask_mod.MAX_TENSORS
struct MaskModParams {
    const void* ptr[kMaskModTensors];
    i64 size[kMaskModTensors][4];
    i64 stride[kMaskModTensors][4];
    int* error;
};

struct FwdParams {
    const void* q;
    const void* k;
    const void* v;
    void* out;
    float* lse;
    const int* cu_seqlens_q;  // nullptr in batch mode
    const int* cu_seqlens_k;
    const u64* rng_state;     // device pointer to {seed, offset}; read only when dropout is compiled in
    i64 q_batch_stride, q_row_stride, q_head_stride;
    i64 k_batch_stride, k_row_stride, k_head_stride;
    i64 v_batch_stride, v_row_stride, v_head_stride;
    i64 o_batch_stride, o_row_stride, o_head_stride;
    i64 lse_batch_stride, lse_head_stride;  // lse row stride is 1
    int batch, nheads, nheads_kv, head_dim;
    int seqlen_q, seqlen_k;   // batch mode: the lengths; varlen: max_seqlen (only sizes the grid)
    float softmax_scale;      // multiplies q.k
    float softmax_scale_log2; // softmax_scale * log2(e): the kernels work with exp2
    u32 keep_threshold;       // dropout: keep iff a 16-bit random number < keep_threshold = round((1 - p) * 65536)
    float rp_dropout;         // 1 / (1 - p)
    int bs_n_qblocks, bs_n_kblocks;  // block mask grid: ceil(seqlen_q / kBlockSparseSize) x ceil(seqlen_k / ...)
    // Block-sparse kernels only (layouts above; nullptr otherwise). Last, so that the dense kernels' parameter
    // offsets are those they were tuned with; 8-byte aligned since the 4-byte fields above come in an even number.
    const int* bs_rows;
    const int* bs_cols;
    i64 bs_rows_head_stride, bs_cols_head_stride;  // 0: one mask for all heads
    int total_q, total_k;     // varlen: rows of q / k (every sequence is clamped into them; utils.cuh packed_seq)
    // Hopper causal kernels and the deterministic Hopper backward: the persistent grid's tiles in groups of this many
    // (batch, head) units -- the backward's: (batch, kv head, GQA split) --, longest tiles first inside a group (a
    // short tail; deterministic causal: key blocks descending, the turns' order) while a group's K / V (Q / dO) stay
    // in L2; 0: longest first over all units (forward) or key blocks fastest (backward, also for 1)
    int causal_tile_group;
    int pad_;
    // Kernels built with the score modifications only (FT_SCORE_MODS: window, softcap, ALiBi), last so that the
    // other kernels' parameter offsets stay as they were tuned. Window (flash-attn's definition): query i sees key j
    // iff i + seqlen_k - seqlen_q - window_left <= j <= i + seqlen_k - seqlen_q + window_right; -1: unbounded (causal
    // kernels: window_right is 0). Softcap: scores s of q.k become softcap_unscale * tanh(s * softcap_scale), i.e.
    // softcap * tanh(softmax_scale * s / softcap) / softmax_scale, so that the softmax's scale still applies.
    int window_left, window_right;
    float softcap_scale;      // softmax_scale / softcap (0: no softcap)
    float softcap_unscale;    // softcap / softmax_scale
    // ALiBi: float32 slopes of (batch, nheads) (batch stride 0: one row for all), the bias -slope * |i + seqlen_k -
    // seqlen_q - j| added to the scaled (and capped) scores; nullptr: none
    const float* alibi_slopes;
    i64 alibi_batch_stride;
    // Kernels built with a mask expression (FT_MASK_EXPR; mask_mod.cuh): its tensors, and the states of
    // MaskMod.block_states per tile of kBlockSparseSize x kBlockSparseSize (query, key) pairs (0 none visible:
    // skipped, 1 some: the expression per pair, 2 all: no test), packed per (b, h) by mask_mod.pack_states:
    // mm_n_qblocks rows of mm_n_kblocks bytes (the row stride: the key blocks rounded up to 4), then per query block
    // the int32 pair (first, last) of its non-empty key blocks, then per key block the int32 pair (first, last) of
    // the query blocks non-empty in some head (empty: first > last). A stride is 0 where the expression reads
    // neither b nor h (and the sequences are not varlen).
    MaskModParams mm;
    const unsigned char* mm_states;
    i64 mm_states_b_stride, mm_states_h_stride;
    int mm_n_kblocks, mm_n_qblocks;
};

// A TMA tensor map (CUtensorMap): 128 opaque bytes encoded on the host by cuTensorMapEncodeTiled
// (flashtrain/kernels/tma.py), 64-byte aligned, read by the copy engine from the kernel's parameter space.
struct alignas(64) TmaDesc {
    u64 opaque[16];
};

// Parameters of the Hopper TMA forward (flash_fwd_sm90.cuh): tensor maps of q, k, v (and out) as rank-4 tensors
// (head_dim, rows, heads, batch) -- varlen: (head_dim, total rows, heads, 1) -- then the plain parameters.
// tile_counter: an int in global memory, 0 at launch, for the persistent grid's dynamic tile scheduler; the kernel
// leaves it at 0 again (one counter per stream: launches on one stream never overlap). The struct's size is padded to
// its 64-byte alignment; launch.py pads its mirror the same way.
struct FwdSm90Params {
    TmaDesc tma_q, tma_k, tma_v;
    TmaDesc tma_o;  // out, boxes of 64 rows (a consumer warpgroup's): the epilogue's TMA stores
    FwdParams fwd;
    int* tile_counter;
    // Tail split (FwdSm90Traits::kTailSplit; ops._tail_split), as BwdParams' over key blocks: tiles tail_first ..
    // n_tiles - 1 run as tail_pieces runs of their key blocks each. Each consumer warpgroup of a piece writes its rows'
    // fp32 O (normalized) and lse to tail_partials and counts itself in tail_counters (one int per tail tile and
    // consumer warpgroup, zero-filled per call); the one that completes the count merges the pieces' rows in piece
    // order and writes out and lse. tail_pieces 0 or 1: no split.
    float* tail_partials;
    int* tail_counters;
    int tail_first, tail_pieces;
};

struct BwdParams {
    FwdParams fwd;            // q, k, v, out, lse, seqlens, rng, scales as in the forward
    const void* dout;
    void* dk;
    void* dv;
    float* dq_accum;
    float* softmax_d;         // D = rowsum(dout * out), same layout as lse (Hopper: padded rows, tma_stats)
    i64 do_batch_stride, do_row_stride, do_head_stride;
    i64 dk_batch_stride, dk_row_stride, dk_head_stride;
    i64 dv_batch_stride, dv_row_stride, dv_head_stride;
    i64 dqa_split_stride, dqa_batch_stride, dqa_head_stride;  // dq_accum row stride is head_dim
    int deterministic;        // 1: CTA x owns dq_accum split x and adds with plain loads/stores (no atomics); Hopper:
                              // the key blocks add to each query block in a fixed order (dq_semaphore)
    // Hopper deterministic backward: per (batch, query head, query block of the kernel) the number of key blocks that
    // have added their dQ to it (non-causal: the lower ones; causal: the higher ones, descending); (batch, nheads,
    // dq_sem_mblocks) int32, zeroed before the launch
    int* dq_semaphore;
    int dq_sem_mblocks;
    // Hopper backward at 80-query blocks (BwdSm90Traits::kSwapDq): dq_accum's first row in tma_dq, a map of rows of
    // dqa_cols floats from lse_log2's address (ops rounds softmax_d's extent up to whole rows)
    int dq_map_row0;
    // Hopper backward, GQA / MQA: the query heads of a group split over kv_splits tiles per key block (> 1 when the
    // whole group per tile would leave too few tiles to balance the SMs); each writes its fp32 partial dK (unscaled)
    // and dV to dkv_accum: dK at split * dkv_split_stride, dV at (kv_splits + split) * dkv_split_stride, rows of
    // dkv_cols floats in k's (batch, head, row) order; flash_aux.cuh convert_dq sums them into dk, dv. 1: no split.
    float* dkv_accum;
    i64 dkv_split_stride, dkv_batch_stride, dkv_head_stride;
    int kv_splits, dkv_cols;
    // Hopper backward, tail split (BwdSm90Traits::kTailSplit; ops._tail_split): tiles tail_first .. n_tiles - 1 (the
    // launch's last, partial wave of equally long tiles) run as tail_pieces pieces each, a piece one run of the tile's
    // query blocks. Each piece writes its fp32 dK / dV sums to tail_partials (per tail tile, piece and MMA warpgroup,
    // in the threads' accumulator order) and counts itself in tail_counters (one int per tail tile, zero-filled per
    // call); the piece that completes the count adds all pieces' sums in piece order and writes dK, dV. tail_pieces
    // 0 or 1: no split.
    float* tail_partials;
    int* tail_counters;
    int tail_first, tail_pieces;
    // Hopper backward with the dQ conversion in the kernel (BwdSm90Traits::kFusedDq; build.py BwdSm90Tiles.fused_dq):
    // dq itself (q's layout), and per (query head, query block of the padded rows) the number of key blocks whose
    // dQ has landed in dq_accum (zeroed by the preprocess, dq_counts_head_stride ints per head); the key block that
    // completes a query block's count converts it into dq.
    void* dq;
    i64 dq_batch_stride, dq_row_stride, dq_head_stride;
    int* dq_counts;
    int dq_counts_head_stride;
};

// Parameters of the Hopper TMA backward (flash_bwd_sm90.cuh): tensor maps of q, k, v, dout, dk, dv, stats, dq (as
// FwdSm90Params'), the plain parameters, the persistent grid's tile counter (as FwdSm90Params'); padded to the 64-byte
// alignment (launch.py pads its mirror the same way).
struct BwdSm90Params {
    TmaDesc tma_q, tma_k, tma_v, tma_do;
    TmaDesc tma_dk, tma_dv;  // dk, dv, boxes of 64 rows (an MMA warpgroup's): the epilogue's TMA stores
    // the padded lse_log2 and softmax_d (above) as one float32 tensor (rows_pad, 2 nheads): boxes of one query
    // block's rows (lse_log2 of head h: column h; D: column nheads + h)
    TmaDesc tma_stats;
    // dq_accum (80-query blocks, kSwapDq): float32 rows of the head dim from lse_log2's address, boxes of 32 columns x
    // one query block (128-byte swizzle) that the dQ writer reduce-adds
    TmaDesc tma_dq;
    BwdParams bwd;
    int* tile_counter;
};

// Auxiliary kernels of the backward (and the test-only dropout-mask kernel).
struct AuxParams {
    const void* out;
    const void* dout;
    void* dq;
    float* softmax_d;
    const float* dq_accum;
    unsigned char* dropout_mask;  // test only: keep-mask (batch, nheads, seqlen_q, seqlen_k) or varlen (nheads, total_q, max_seqlen_k)
    const int* cu_seqlens_q;
    const int* cu_seqlens_k;
    const u64* rng_state;
    const float* lse;         // padded: the forward's lse, read into lse_log2
    float* lse_log2;
    const float* dlse;        // the gradient reaching lse (lse's layout), or null: the preprocess takes D - dlse
    i64 o_batch_stride, o_row_stride, o_head_stride;
    i64 do_batch_stride, do_row_stride, do_head_stride;
    i64 dq_batch_stride, dq_row_stride, dq_head_stride;
    i64 d_batch_stride, d_head_stride;                        // softmax_d (and lse_log2), like lse or padded
    i64 lse_batch_stride, lse_head_stride;
    i64 dqa_split_stride, dqa_batch_stride, dqa_head_stride;
    i64 mask_batch_stride, mask_head_stride, mask_row_stride;
    int batch, nheads, head_dim, seqlen_q, seqlen_k, nsplits;
    float softmax_scale;
    u32 keep_threshold;
    // dq_accum layout (flash_bwd.cuh, add_dq): 0 = row-major; else the width W of the backward's dQ warp slices, and
    // query blocks of dq_block_m rows that lie wholly inside the sequence hold scrambled 16-row groups
    int dq_slice_width, dq_block_m;
    int total_q, total_k;     // varlen: rows of q / k, as in FwdParams
    int dqa_cols;             // dq_accum row length: head_dim, or the Hopper backward's padded head dim (zeros past
                              // head_dim)
    int padded;               // 1: the Hopper backward's padded rows (dq_block_m = M): the preprocess also writes
                              // lse_log2 and the padding rows, the conversion reads whole blocks
    int dq_frag;              // 1: dq_accum's blocks of dq_block_m (80) rows hold the Hopper backward's dQ^T in its
                              // accumulator's order (BwdSm90Traits::kDqFrag); the conversion's grid is one CTA per
                              // block (flash_aux.cuh bwd_convert_dq_frag)
    int lse_bias;             // 1 (padded): lse_log2 = -lse / softmax_scale, the lse in raw score units, onto which the
                              // Hopper backward built with FT_BWD_LSE_BIAS accumulates S^T (flash_bwd_sm90.cuh kBiasS),
                              // and softmax_d = -D, onto which it accumulates dP^T (kBiasD)
    // The Hopper backward converts dq itself (BwdParams::dq_counts): 0 no (the conversion kernel runs); 1 (non-causal),
    // 2 (causal): the preprocess also zeroes each query block's count, and writes dq = 0 for the rows that no key
    // block sees (all of a sequence without keys; causal, the rows above the first key's diagonal), which no
    // conversion reaches
    int fused_dq;
    int* dq_counts;
    int dq_counts_head_stride;
};

}  // namespace flashtrain
