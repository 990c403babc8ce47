// FlashAttention backward (Algorithm 2 of FlashAttention-2) on Hopper, warp-specialized in FlashAttention-3's way:
//
//   A tile is kBlockN = 128 keys of one (batch, kv head) (64 at head dims 192 / 256: flash_bwd_sm90_split_mma; 96 at
//   head dim 192 by default: flash_bwd_sm90_split_keys_mma, build.py BWD_SM90_HD192_N96). K
//   and V are copied into shared memory once per tile (TMA) and stay; dK and dV accumulate in registers. The tile
//   walks every query block that can see these keys, for every query head of the GQA group (dK, dV summed over the
//   group in registers, no extra memory) -- or for a part of the group when BwdParams::kv_splits > 1 (few, long
//   tiles: fp32 partials summed by the convert kernel). The grid is
//   persistent: one CTA per SM takes tiles from a dynamic scheduler (an atomic counter, as the forward's); the
//   producer publishes each tile in a shared-memory slot (2 slots, mbarriers) and copies the next tile's first Q / dO
//   while the MMA warps finish the current one, and its K / V once their last GEMMs are done (head dims 192 / 256:
//   once they have stored dK / dV through the K / V tiles).
//   warpgroup 0 (producer; setmaxnreg.dec): one thread issues the TMA copies of each query block's Q and dO into a
//     ring of kStages stages, and of its row statistics (lse in log2 units, +inf for rows past the end, so that
//     their P is 0; D = rowsum(dO * O)), which the preprocess (flash_aux.cuh) writes in whole blocks of padded rows
//     (flash.h). Each stage has a "full" mbarrier (the copy engine's bytes) and an "empty" one (the 8 MMA warps
//     release the stage). (Until 2026-11-25 a statistics warp stored lse / D into the stage; compute-sanitizer
//     racecheck, which does not follow mbarriers, reported its stores against the MMA warps' loads. A non-tensor
//     bulk copy is reported the same way; tensor copies are not.)
//   warpgroups 1, 2 (MMA; setmaxnreg.inc): warpgroup w owns keys [64 w, 64 w + 64) of the block, the M = 64 rows of
//     its warpgroup MMAs, so it computes transposed scores (swap-AB: the 64-key atom, queries along N):
//         S^T = K_w Q^T, dP^T = V_w dO^T           (both operands in shared memory; two commit groups)
//         P^T = exp2(S^T scale - lse)             (as soon as S^T is done; masked: 0) -> A fragments
//         dV_w += P^T dO                          (P^T from registers: issued while dP^T may still run)
//         dS^T = P^T (dP^T - D)                   -> A fragments and the shared dS^T tile (double-buffered,
//                                                     stmatrix); P^T from the 16-bit fragments while dV runs
//                                                     (128-query blocks without dropout)
//         dK_w += dS^T Q                          (dS^T from registers)
//     Once both warpgroups' dS^T rows are in shared memory (named barrier), dQ(block) = dS K is computed in 64 x 64
//     pieces (query rows x head_dim columns), half of them per warpgroup, with both operands MN-major in shared memory.
//     Each warp stages its 16 x 64 fp32 slice of a piece in shared memory in dq_accum's scrambled order (flash_aux.cuh
//     convert_dq: a 16-row group's 64-column slice is 4 KB contiguous) and one lane adds it to global memory with an
//     asynchronous bulk reduce-add (cp.reduce.async.bulk .add.f32): the warpgroups never wait for dQ to reach global
//     memory (only, one iteration later, for the copy engine to have read the staging slice). A sequence's last query
//     block is a whole block of dq_accum's padded rows: its rows past the end add zeros there.
//   Head dim 128 without dropout (not block-sparse, not deterministic; causal too): 80-query blocks (kSwapDq,
//   FlashAttention-3's shape for the non-causal case): S^T, dP^T are m64n80; dS is stored by queries (stmatrix .trans) and dQ is
//   computed transposed, dQ^T = K^T dS^T, warpgroup w taking head-dim rows [64 w, 64 w + 64) of all 80 queries; it
//   is issued before dK's GEMM, and staged as fp32 boxes of 32 columns (128-byte swizzle, scalar stores on 32 banks)
//   that the dQ writer adds to dq_accum's plain rows with tensor reduce-adds (tma_dq). A fifth fewer steps per tile,
//   the B operands of S^T / dP^T read once for 80 queries: H200, same process, 1.01-1.05x the 64-query kernel, GQA
//   16/4 1.06-1.13x; with dQ first 1.01-1.07x more (hd128 16K backward 588 TFLOP/s, 2026-11-26); causal 1.04-1.11x
//   at 2K-16K, 0.99x at 1K. (A deterministic variant passed the tests at 0.90-0.96x the 64-query one: removed.)
//   Epilogue: dK * scale and dV staged in the score tiles and dQ slices (K / V are released first), then TMA stores
//   of the warpgroup's rows (head dims 192 / 256 and a varlen sequence's partial last tile: 16-byte stores).
//
// Masking (causal bottom-right aligned, keys past the end) as in the forward; rows past a sequence's end get lse =
// +inf, so P = 0 and dS = 0 there (their Q / dO rows are zeros or the next sequence's). Dropout regenerates the
// forward's keep bits (utils.cuh DropoutRng, addressed by (batch * head, query, key)): a thread's 8 elements of a
// 16 x 16 tile are half the words of 2 lanes of the forward's layout (its rows are keys), and lane ^ 4 needs the
// other halves: one Philox call per tile and two shuffles (DropoutRng::bits_transposed; 1.08-1.13x over two calls
// per tile, H200 same process). The keep decisions of P^T are kept as bits for dS^T. Block-sparse walks the query
// tiles of the non-zero mask blocks of the key block's column (utils.cuh SparseWalkAsc), for each query head of the
// group. Not deterministic (dQ is summed by reductions in arrival order) unless kIsDeterministic (below: key blocks
// take turns per query block); block-sparse with deterministic=True runs flash_bwd.cuh. Head dims 64 and 128 (65-96 are
// padded up by the host; columns past head_dim are zero-filled by the copies and not written). Head dims 192 and 256
// (129-255 padded up; dense, no dropout, not deterministic) keep the producer but tile 64 keys and split the head dim
// over the MMA warpgroups (flash_bwd_sm90_split_mma); head dim 192 by default tiles 96 keys, 48 per warpgroup
// (flash_bwd_sm90_split_keys_mma). flash_aux.cuh runs before (D and lse in log2 units in padded
// rows, zeroing dq_accum) and after (dq = scale * dq_accum).
#pragma once
// FT_BWD_LEAN_ADDR=1 (build.py _bwd_lean_addr picks the kernels): the MMA warps' loop with less address arithmetic.
// wgmma descriptors moved by one 64-bit add (wgmma.cuh FT_DESC_ADD 2), the stage index and phase from an unsigned
// count, the statistics base opaque to the compiler (so that the loads keep immediate offsets from it), the dS
// stmatrix address split into a per-lane part and constants, and the K base of the transposed dQ GEMM per warpgroup:
// the non-causal hd128 80-query loop 534 -> 450 SASS instructions per block (FA4's: 463), spills 128 / 148 -> 116 /
// 136 bytes. (Every kernel addresses the statistics as base + 8 t + 32 j; without the opaque base ptxas schedules that
// as before the lean form, with fewer spills in some kernels: hd64 causal 32 / 72 -> 12 / 20 bytes.)
#ifndef FT_BWD_LEAN_ADDR
#define FT_BWD_LEAN_ADDR 0
#endif
#ifndef FT_DESC_ADD
#define FT_DESC_ADD (FT_BWD_LEAN_ADDR ? 2 : 1)
#endif
#include "mask_mod.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

#ifndef FT_BWD_WALK_INC
#define FT_BWD_WALK_INC 1
#endif
// FT_BWD_DET_NO_TURNS=1: diagnostic builds only (not deterministic): the deterministic kernels without the turns (no
// waiting, no completion wait, no counting), to measure what the turns cost against the kernel's other differences.
#ifndef FT_BWD_DET_NO_TURNS
#define FT_BWD_DET_NO_TURNS 0
#endif
// FT_BWD_DET_WRITERS (deterministic, head dims 64 / 128; default 2, 1 for A/Bs): two dQ writer warps take the query
// blocks in turn, so that one waits for its block's reduce-adds to complete (and releases the turn) while the other
// takes the next block's slices: the writer's cycle per block is then two MMA steps long. H200, same process,
// 2026-11-25 23:39 UTC, deterministic / default backward, 2K-16K, one writer -> two: hd128 0.78-0.87 -> 0.95-0.99,
// hd64 0.89-0.93 -> 0.92-0.99.
#ifndef FT_BWD_DET_WRITERS
#define FT_BWD_DET_WRITERS 2
#endif
// FT_BWD_DET_SPIN_NS (deterministic; default 200, 0 for A/Bs): the dQ writer's lane sleeps this many nanoseconds
// between two polls of a turn counter. Polling back to back slowed the whole CTA (a writer warp shares its SM
// sub-partition's issue slots with an MMA warp, and each poll is an L2 load): H200, 2026-11-30 17:16 UTC, interleaved
// CUDA-graph replays, deterministic backward 200 ns / none: hd128 non-causal 2K-16K 1.037-1.041, 512 1.023, causal 4K
// / 16K 1.037 / 1.042, GQA 32/8 8K 1.039, hd64 non-causal 8K 1.051, causal 2K 1.049; 100, 500 and 1000 ns within 0.6%
// of 200 (kernel_ab-h200.json).
#ifndef FT_BWD_DET_SPIN_NS
#define FT_BWD_DET_SPIN_NS 200
#endif
// FT_BWD_DET_MEMBAR=1 (A/B): the dQ writer issues a membar.gl before a turn's release add. Not needed: the completed
// bulk reduce-adds are ordered before the add by the async-proxy fence and the add's release semantics; without it
// the deterministic backward is 1.03-1.07x (H200, same process, hd64 / hd128 2K-16K, 2026-11-25 22:25 UTC).
#ifndef FT_BWD_DET_MEMBAR
#define FT_BWD_DET_MEMBAR 0
#endif
// FT_BWD_SKIP_HIDDEN (default 1; 0 for A/Bs): a warpgroup none of whose 64 keys is visible to any row of the query
// block (the causal diagonal's first 64-query block for keys 64-127 at head dim 128; a key tile's part past seqlen_k)
// skips its S^T, dP^T, dV and dK GEMMs and stores a zero dS^T for the block's dQ. H200, same process, hd128 causal
// backward 1.01x at 512-2K, 1.03x at 4K, 1.00x at 16K; hd64 (128-query blocks: never hidden) and GQA 16/2 1.00x.
#ifndef FT_BWD_SKIP_HIDDEN
#define FT_BWD_SKIP_HIDDEN 1
#endif
// FT_BWD_TILE_RECORD (default 1; 0 for A/Bs): the producer publishes each tile's decoded indices (n_block, batch,
// head_kv, split) with the tile in its slot, and the MMA warps and the dQ writer read them (read_tile) instead of
// each redoing the tile's 5 integer divisions (tile_group_unit, unit -> split / batch / head_kv); the query-block
// walk's 2 (BwdTile::group / heads, kernel-wide) are done once per CTA into shared memory, which every role reads
// (as the forward's FT_FWD_TILE_RECORD). The sequence bounds stay computed by each reader (bwd_tile_bounds): without
// varlen they are kernel parameters, which ptxas reloads where needed instead of keeping loaded values live (a
// record of every BwdTile field raised the spills: hd64 causal MMA warps 12 / 20 -> 32 / 48 bytes; the head counts
// computed per tile by the producer for the record spilled its loop: hd128 causal 0 -> 16 bytes).
#ifndef FT_BWD_SK_STAGE_DQ
#define FT_BWD_SK_STAGE_DQ 0
#endif
#ifndef FT_BWD_TILE_RECORD
#define FT_BWD_TILE_RECORD 1
#endif
// FT_BWD_TAIL_SPLIT (build.py BWD_TAIL_SPLIT, which also sets BwdParams' tail fields; default 0): the kernels of
// BwdSm90Traits::kTailSplit run the last, partial wave of a launch's tiles as pieces over their query blocks
// (BwdParams::tail_first / tail_pieces; utils.cuh tail_unit_tile, QueryBlockWalk, tail_sum). A dense non-causal launch's tiles all
// take the same time, so its last wave of n_tiles % SMs tiles otherwise leaves the other SMs idle for a whole tile.
#ifndef FT_BWD_TAIL_SPLIT
#define FT_BWD_TAIL_SPLIT 0
#endif

namespace flashtrain {

// FT_BWD_DESC64 / FT_BWD_DESC32: a bit per wgmma descriptor call site of this file (bdesc's kSite, numbered in source
// order) whose descriptor moves by one 64-bit add / by a 32-bit add to its address field (wgmma.cuh FT_DESC_ADD's forms
// 2 / 1); the other sites take FT_DESC_ADD's form. Default: the split-keys kernel's dO (S / dP GEMM), dK /
// dV and dQ operands (sites 17, 19, 20, 21) by 64-bit adds, for which ptxas emits one UIADD3.64 each instead of an
// add and a move of the high word (99 fewer instructions between the kernel's HGMMAs). H200, interleaved CUDA-graph
// A/B, hd192 causal 4K backward with / without 1.011. (The other kernels keep FT_DESC_ADD's form: fewer instructions
// there did not make them faster.)
#ifndef FT_BWD_DESC64
#define FT_BWD_DESC64 0x3a0000ull
#endif
#ifndef FT_BWD_DESC32
#define FT_BWD_DESC32 0ull
#endif
template <int kSite, int kSwizzle = 1>
__device__ __forceinline__ u64 bdesc(u32 base, u32 offset_bytes, u32 leading_bytes, u32 stride_bytes) {
    constexpr int kForm = ((unsigned long long)(FT_BWD_DESC64) >> kSite) & 1   ? 2
                          : ((unsigned long long)(FT_BWD_DESC32) >> kSite) & 1 ? 1
                                                                                : FT_DESC_ADD;
    return gmma_desc_form<kForm, kSwizzle>(base, offset_bytes, leading_bytes, stride_bytes);
}

template <int kHeadDim_, int kBlockM_, int kStages_, bool kIsBF16_, bool kIsCausal_, bool kIsDropout_,
          bool kIsBlockSparse_, bool kIsDeterministic_, bool kPersistent_ = true, int kHeadDimEff_ = kHeadDim_,
          int kScoreMods_ = 0, bool kMaskMod_ = false, int kBlockN_ = 0>
struct BwdSm90Traits {
    // FT_SCORE_MODS: 1, a local window, softcap and ALiBi read from FwdParams (each off when unset), as the
    // forward's; 2, the window and ALiBi only (head dim 64: softcap's derivative, kept for dS^T, spilled inside the
    // loop there; flash_bwd.cuh runs softcap at head dim 64). The query-block walk covers the window only
    // (QueryBlockWalk). Head dims 64 / 128, dense, without dropout, not deterministic (the deterministic turns assume
    // every key block from 0 visits a query block): flash_bwd.cuh runs the others.
    // 3, the window only (no ALiBi: no slope load, no ALiBi branches around the exponentials; on the 64-query hd128
    // tiles with fp32 P^T, kPtFp32 below).
    static constexpr bool kScoreMods = kScoreMods_ != 0, kSoftcap = kScoreMods_ == 1;
    static constexpr bool kAlibi = kScoreMods_ == 1 || kScoreMods_ == 2;
    static_assert(!kScoreMods || (kHeadDim_ <= 128 && !kIsDropout_ && !kIsBlockSparse_ && !kIsDeterministic_),
                  "score modifications: head dims 64 / 128, dense, no dropout, not deterministic");
    // a mask expression compiled in (FT_MASK_EXPR, mask_mod.cuh; with the score modifications): the query-block walk
    // skips the (head, query block) pairs whose 128 x 128 block state (FwdParams::mm_states) is empty, the expression
    // runs per pair where it is partial (128-key tiles: one state per block)
    static constexpr bool kMaskMod = kMaskMod_;
    static_assert(!kMaskMod_ || (kScoreMods_ != 0 && kScoreMods_ != 3 && kBlockSparseSize % kBlockM_ == 0),
                  "a mask expression needs the general score-modification kernel (not the window-only one) with query "
                  "blocks inside 128-row states");
    // Head dims 192 and 256 (kSplitHd: dense only, no dQ writer, the epilogue through K / V) split the head dim over
    // the warpgroups (flash_bwd_sm90_split_mma): 64-key tiles. Head dim 192 with kBlockN_ = 96 (build.py
    // BWD_SM90_HD192_N96): 96-key tiles, each warpgroup owning 48 keys (flash_bwd_sm90_split_keys_mma, kSplitKeys).
    static constexpr bool kSplitHd = kHeadDim_ > 128;
    static constexpr bool kSplitKeys = kSplitHd && kBlockN_ == 96;
    static_assert(kBlockN_ == 0 || (kBlockN_ == 96 && kHeadDim_ == 192), "96-key tiles: head dim 192 only");
    static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kStages = kStages_;
    static constexpr int kBlockN = kSplitKeys ? 96 : kSplitHd ? 64 : 128;
    static constexpr bool kPersistent = kPersistent_;  // one CTA per SM taking tiles from the dynamic scheduler
    static constexpr bool kIsBF16 = kIsBF16_, kIsCausal = kIsCausal_, kIsDropout = kIsDropout_;
    static constexpr bool kIsBlockSparse = kIsBlockSparse_, kIsDeterministic = kIsDeterministic_;
    static_assert(!(kIsBlockSparse && kIsDeterministic), "deterministic block-sparse runs flash_bwd.cuh");
    static constexpr int kNMma = 2;                     // MMA warpgroups, 64 keys each (kSplitKeys: 48)
    static constexpr int kNThreads = 128 * (kNMma + 1);  // + the producer warpgroup
    static constexpr int kLaunchRegs = 65536 / kNThreads / 8 * 8;
    static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 192 || kHeadDim == 256,
                  "head dims 64, 128, 192, 256 (128-byte swizzled column blocks)");
    static_assert(!kSplitHd || (kBlockM == 64 && !kIsDropout && !kIsBlockSparse && !kIsDeterministic),
                  "head dims 192 / 256: 64-query blocks, dense, no dropout, not deterministic (flash_bwd.cuh runs those)");
    // 80-query blocks (head dim 128, dense; FlashAttention-3's shape for it): S^T, dP^T are m64n80 (a fifth fewer
    // steps, and their B operand read for 80 queries instead of 64), dQ is computed transposed, dQ^T = K^T dS^T, by
    // each warpgroup for 64 head-dim rows x all 80 queries (dS stored row-major by queries), staged in fp32 boxes of
    // 32 columns (128-byte swizzle) and added to dq_accum's plain rows by tensor reduce-adds (tma_dq).
    static constexpr bool kSwapDq = kBlockM_ == 80;
    // ... and the staged dQ^T in the accumulator's own order (kDqFrag; build.py BwdSm90Tiles.dq_frag picks the kernels
    // that take it, the others compile with FT_BWD_DQ_FRAG=0): each thread's
    // n8 tile j is one 16-byte store, warp (w, ww)'s 16 head-dim rows x 80 queries one contiguous 5 KB slice, added to
    // the block's 40 KB of dq_accum by two 1-D bulk reduce-adds (one per warpgroup) in that order, which
    // flash_aux.cuh bwd_convert_dq_frag unpermutes (FlashAttention-4's dQ accumulation); FT_BWD_DQ_FRAG=0: the boxes
    // of plain rows (4-byte stores, 128-byte swizzle) reduce-added by tensor copies (tma_dq)
#ifndef FT_BWD_DQ_FRAG
#define FT_BWD_DQ_FRAG 1
#endif
    static constexpr bool kDqFrag = kSwapDq && FT_BWD_DQ_FRAG;
    static_assert(kBlockM == 64 || kBlockM == 128 || kSwapDq, "query blocks of 64, 80 or 128 rows");
    static_assert(!kSwapDq || (kHeadDim == 128 && !kIsDropout && !kIsBlockSparse && !kIsDeterministic),
                  "80-query blocks: head dim 128, no dropout, not block-sparse, not deterministic");
    static_assert(!kIsBlockSparse || kBlockSparseSize % kBlockM == 0, "a mask block is whole query tiles");
    static constexpr int kNT = kBlockM / 8;   // n8 column tiles of S^T per thread (columns = queries)
    // Columns that can be non-zero: head dims 65-96 run the hd128 tiles (zero-filled past head_dim) with kHeadDimEff
    // 80 or 96, so that S^T / dP^T skip the zero k-steps and dK / dV are m64n80 / m64n96
    static constexpr int kHeadDimEff = kHeadDimEff_;
    static_assert(kHeadDimEff == kHeadDim || (kHeadDim == 128 && (kHeadDimEff == 80 || kHeadDimEff == 96)),
                  "effective head dim 80 or 96 of 128");
    static constexpr int kDT = kHeadDimEff / 8;  // n8 column tiles of dK, dV per thread
    // Registers per thread after setmaxnreg: the producer warpgroup (TMA copies, dQ writer) and the
    // MMA warpgroups share the launch pool (168 x 384). On 24 the producer warpgroup's loops spill (ptxas 188-236 bytes
    // per kernel), and where ptxas puts those spills moved the whole kernel's speed: the causal steps ran 8-18% slower
    // than the dense ones. 32 or 40 leave the MMA warpgroups 232: enough for 64-column work (40: hd64 causal backward
    // +3-7%, hd96 causal +11%, deterministic +1-9%) and for head dim 128 with dS^T taken from the packed P^T
    // (kHd128DsFromPa, kDsFromPa below; 40: causal +1-5%, GQA +2%, deterministic dense +6%; 32: dense +1-4%, 40
    // there 0.99-1.03x), not for hd128 dropout (dK accumulator spills: 0.86-0.96x), hd64 dense (0.93-1.01x) or the
    // split head dims (0.82x), which keep 24. (H200, 2026-11-25.) The plain 64-query kernels (kPtFp32 below) take 24
    // again with the fp32 P^T: their MMA warps need 240 for it, and the producer's spills then measured 1.01-1.02x
    // faster overall.
    // FT_BWD_PRODUCER_REGS=n forces n (A/B).
    // (FT_BWD_NARROW_PA, default 1; 0 for A/Bs: the 64-query kernels of head dims 65-96 too, whose dK / dV
    // accumulators are 80 or 96 columns: this class, and with it dQ before dK and (kPtFp32) the fp32 P^T, as at
    // head dim 128)
#ifndef FT_BWD_NARROW_PA
#define FT_BWD_NARROW_PA 1
#endif
    static constexpr bool kHd128DsFromPa =
        (kHeadDimEff == 128 || (FT_BWD_NARROW_PA && kHeadDim == 128 && !kSwapDq)) && !kIsDropout && !kIsBlockSparse;
    // The 64-query kernels of that class without score modifications and not deterministic (FT_BWD_PT_FP32, default 1;
    // 0 for A/Bs) instead keep P^T in fp32 for dS^T (FlashAttention-4's form) and give the producer 24 registers, so
    // that the MMA warps have 240: the step's loop has no spills and 32 fewer unpacking instructions per query block;
    // the producer's loops spill (~120 bytes). H200, interleaved CUDA-graph replays, backward, this / packed P^T:
    // hd128 causal 2K 1.010, 4K 1.017, 16K 1.021 (64-query blocks at both), GQA 16/2 2K 1.016, hd80 causal 4K 1.013,
    // hd96 causal 2K 1.011, hd128 causal 1K 0.993 (kernel_ab-h200.json).
#ifndef FT_BWD_PT_FP32
#define FT_BWD_PT_FP32 1
#endif
    // ... and the deterministic hd128 kernels (FT_BWD_DET_PT_FP32, default 1; 0 for A/Bs), their producer and dQ writer
    // warps then on 24 registers (nvcc 13.0 sm_90a: 124-148 bytes spilled, none in the MMA loop); with the lse start
    // of S^T (build.BWD_SM90_DET_LSE_BIAS) hd128 8K / 16K 1.010-1.025x of neither (kernel_ab-h100.json
    // det_hd128_builds_ab)
#ifndef FT_BWD_DET_PT_FP32
#define FT_BWD_DET_PT_FP32 1
#endif
    // ... and the window-only score-modification kernels (FT_SCORE_MODS 3; FT_BWD_WINDOW_PT_FP32,
    // default 1; 0 for A/Bs): H200, interleaved CUDA-graph replays, backward against the general variant, hd128 causal
    // window 1024 at 16K 1.033, at 4K 1.015, window 256 at 16K 1.001 (kernel_ab-h200.json).
#ifndef FT_BWD_WINDOW_PT_FP32
#define FT_BWD_WINDOW_PT_FP32 1
#endif
    static constexpr bool kPtFp32 =
        FT_BWD_PT_FP32 && kHd128DsFromPa && !kSwapDq && (!kIsDeterministic || FT_BWD_DET_PT_FP32) && !kIsDropout &&
        (!kScoreMods || (kScoreMods_ == 3 && FT_BWD_WINDOW_PT_FP32));
#ifndef FT_BWD_FUSED_DQ  // (the in-kernel dQ conversion: kFusedDq below)
#define FT_BWD_FUSED_DQ 0
#endif
#ifdef FT_BWD_PRODUCER_REGS
    static constexpr int kProducerRegs = FT_BWD_PRODUCER_REGS;
#else
    // 80-query blocks: 24 (their MMA warps need 240: on 232 ptxas serializes the wgmmas, C7512). The hd128 kernel
    // with the in-kernel dQ conversion: 40, for the converter warps' loops (H100, backward, 40 / 24: causal 512 1.038,
    // 1K 1.066, 4K 1.138; kernel_ab-h100.json bwd_fused_dq_hd128_producer_regs_ab).
    static constexpr int kProducerRegs =
        FT_BWD_FUSED_DQ != 0 && kHeadDim == 128 ? 40
        : kSwapDq || kPtFp32 ? 24
        : kIsDeterministic || (kIsCausal && (kHeadDimEff <= 96 || kHd128DsFromPa)) ? 40 : kHd128DsFromPa ? 32 : 24;
#endif
    // (the rest, in multiples of 8)
    static constexpr int kMmaRegs = (kLaunchRegs * kNThreads - kProducerRegs * 128) / (128 * kNMma) / 8 * 8;
    static_assert(kProducerRegs * 128 + kMmaRegs * 128 * kNMma <= kLaunchRegs * kNThreads, "register budget");
    // dQ(block) in 64 x 64 pieces (mi = query rows / 64, hj = columns / 64); warpgroup w computes pieces w, w + 2, ..
    // (one piece, head dim 64 x 64 queries: warpgroup 0 alone; the other's GEMMs meanwhile keep the tensor cores busy)
    static constexpr int kPieces = (kBlockM / 64) * (kHeadDim / 64);
    static_assert(kSplitHd || kSwapDq || kPieces == kNMma, "one dQ piece per warpgroup (every MMA warp stages one slice per block)");
    static constexpr int kPiecesPerWg = 1;
    // Head dims 65-96 on the 64-query hd128 tiles without dropout (FT_BWD_NARROW_DQ, default 1; 0 for A/Bs):
    // warpgroup 0 computes the block's whole dQ, m64n80 or m64n96 (FlashAttention-4's single-warpgroup dQ at these
    // head dims), and warpgroup 1 none, instead of a 64-column piece each, of which 48 or 32 columns of the second are
    // zeros. Its warps stage columns 0-63 as the first piece's slices and 64.. as the first n8 tiles of the second's
    // (the first 1 or 2 KB of each 4 KB slice in dq_accum's scrambled order), and the writer adds only those (the rest
    // of dq_accum stays zero). At 96 columns the two MMA warpgroups run on unequal registers (kSplitRegs), as in FA4:
    // warpgroup 0 on 256, warpgroup 1 on the rest, each with its own instantiation of the MMA loop
    // (flash_bwd_sm90_mma<T, w>); on equal registers ptxas serializes m64n96's wgmmas (C7512). H200, interleaved
    // CUDA-graph replays, backward, hd96 causal, this / two pieces: 1K 1.053, 2K 1.045 (1.036 over the 80-query
    // kernel), 4K 1.037 (1.008); at hd80 the unequal registers measured 0.994-1.014 (kernel_ab-h200.json).
    // (ptxas 13.0: warpgroup 1 issuing m64n16 for its piece instead serializes the wgmmas, C7511, as does dropout's
    // spilling.)
#ifndef FT_BWD_NARROW_DQ
#define FT_BWD_NARROW_DQ 1
#endif
// Head dims 65-96 on 80-query blocks (fragment-order dQ^T): warpgroup 1 reduce-adds only its slices below kHeadDimEff
// (1: 16 or 32 of its 64 columns; 0: all 64)
#ifndef FT_BWD_NARROW_FRAG_ADD
#define FT_BWD_NARROW_FRAG_ADD 1
#endif
    static constexpr bool kNarrowDq = FT_BWD_NARROW_DQ && (kHeadDimEff == 80 || kHeadDimEff == 96) &&
                                      kHeadDim == 128 && kBlockM == 64 && !kSwapDq && !kIsDropout;
    static constexpr int kDqCols = kNarrowDq ? kHeadDimEff : 64;  // dQ columns of a warpgroup's GEMM
    static constexpr int kDqN1 = kDqCols - 64;                      // kNarrowDq: the second piece's columns
    static_assert(!kNarrowDq || kPieces == 2, "narrow dQ: two 64-column pieces");
    static constexpr bool kSplitRegs = kNarrowDq && kHeadDimEff == 96;
    static_assert(!kSplitRegs || kNMma == 2, "unequal registers: two MMA warpgroups");
    // (the two warpgroups' registers sum to kNMma x kMmaRegs, within the budget checked above)
    static constexpr int kMmaRegs0 = kSplitRegs ? 256 : kMmaRegs;
    static constexpr int kMmaRegs1 = kSplitRegs ? kNMma * kMmaRegs - kMmaRegs0 : kMmaRegs;
    static_assert(kMmaRegs0 % 8 == 0 && kMmaRegs1 % 8 == 0 && kMmaRegs0 <= 256 && kMmaRegs1 >= kLaunchRegs,
                  "setmaxnreg.inc: multiples of 8, up to 256, not below the launch's count");
    // The dQ piece of a query block is waited for and staged at once (0), or once the next block's S^T GEMM (2) or
    // its S^T and dP^T GEMMs (1) are issued. H200, same process, backward TFLOP/s with the dQ writer warp: hd128 0
    // beats 2 by 10-15% (16K 524 vs 473); hd64 x 128 queries 0 beats 2 by 3-6% (16K 434 vs 418) despite 120 B of
    // spills. Dropout 0.1, same process (Philox 7 rounds), 0 / 2: hd128 1.03-1.12x (4K 367 vs 337), hd64 0.88-0.95x:
    // hd64 dropout keeps 2. The deterministic hd64 kernel kept 2 while its turns bounded it (key blocks fastest);
    // with the tile groups (ops._det_tile_group) 0 and kDsFirst are 1.04-1.14x (H200, same process, 2K-16K,
    // 2026-11-25 22:15 UTC).
#ifdef FT_BWD_DEFER_DQ
    static constexpr int kDeferDq = FT_BWD_DEFER_DQ;
#else
    static constexpr int kDeferDq = kHeadDim == 64 && kIsDropout ? 2 : 0;
#endif
    // Each step waits for S^T (and the GEMMs issued before it) before issuing dP^T, so that the exponentials of P^T
    // run while dP^T is issued and computed, instead of issuing S^T and dP^T back to back and waiting for S^T after:
    // the 64-query hd128 causal kernels with the fp32 P^T (kPtFp32: plain and window-only). H200, interleaved
    // CUDA-graph replays, backward, this / back to back: hd128 causal 4K 1.023, 8K 1.026, GQA 32/8 8K 1.024, window
    // 1024 at 16K 1.023, 16K 1.021 (on 64-query blocks, against the 80-query kernel), 512 / 1K 1.001 / 1.004; the
    // same order lost on the 80-query non-causal kernel (16K 0.981) and at head dim 64 (0.979-0.992), was level at
    // head dims 65-96 (1.002) (kernel_ab-h200.json). FT_BWD_ST_FIRST=0 / 1 forces it off / on (A/B).
#ifdef FT_BWD_ST_FIRST
    static constexpr bool kStFirst = FT_BWD_ST_FIRST && kDeferDq == 0;
#else
    static constexpr bool kStFirst = kPtFp32 && kIsCausal && kHeadDimEff == 128 && kDeferDq == 0;
#endif
    // 128-query blocks without dropout take P^T for dS^T = P^T (dP^T - D) from its 16-bit A fragments (the values
    // dV's GEMM reads): the fp32 P^T is dead once packed, which frees the 64 registers that let dS^T run while dV's
    // GEMM does. H200, same process, hd64 backward 1.03-1.13x (4K causal 352 -> 390 TFLOP/s); at hd128 (64-query
    // blocks, no wait to remove) 0.94-1.04x: not used there. The gradient checks pass unchanged (P^T carries one
    // more 16-bit rounding into dS^T, which is rounded to 16 bits for its GEMMs anyway).
    // With 32-40 producer registers the hd128 steps fit the MMA warps' 232 registers only this way (kHd128DsFromPa;
    // ptxas spills 232 / 244 -> 36 / 32 bytes causal, none in the loop), so those kernels take it too.
    // FT_BWD_DS_FROM_PA=0/1 forces it off / on (A/B).
#ifdef FT_BWD_DS_FROM_PA
    static constexpr bool kDsFromPa = FT_BWD_DS_FROM_PA && !kIsDropout;
#else
    static constexpr bool kDsFromPa = (kBlockM == 128 || kHd128DsFromPa) && !kIsDropout && !kPtFp32;
#endif
    // 128-query blocks with dropout: dS^T is computed once dV is done (ptxas keeps the A fragments of an unfinished
    // wgmma alive, and 64 more live registers would spill)
    static constexpr bool kWaitDv = kBlockM == 128 && !kDsFromPa;
    // 128-query blocks with the dQ piece staged at once (head dim 64 without dropout): dS^T is
    // stored before dK's GEMM is issued (its stores complete meanwhile, so the proxy fence before the dS^T barrier
    // waits less), and a dQ slice's proxy fence and hand-over to the writer come after the next block's GEMMs are
    // issued (ncu, hd128: the MMA warps stalled on these fences in ~10% of their samples). H200, same process,
    // backward TFLOP/s both / neither: hd64 full 1K 424 / 397, 4K 491 / 465, 16K 505 / 478; causal 1K 289 / 272,
    // 4K 426 / 412, 16K 458 / 450. At hd128 they cost 1-15% (the dQ writer is on that kernel's critical path: a later
    // hand-over delays it), as did the lse / D rows loaded into registers before the GEMMs (0.87-0.95x).
    // FT_BWD_LATE_DQ=0 / 1 and FT_BWD_DS_FIRST=0 / 1 force either off / on (A/B).
#ifdef FT_BWD_LATE_DQ
    static constexpr bool kLateDq = FT_BWD_LATE_DQ && kDeferDq == 0;
#else
    // (80-query blocks too: H200, same process, 2026-11-26 00:01 UTC, with both / neither, hd128 full 4K / 8K / 16K
    // 592 / 584, 569 / 551, 568 / 563 TFLOP/s)
    static constexpr bool kLateDq = (kBlockM == 128 || kSwapDq) && kDeferDq == 0;
#endif
    // 80-query blocks: the dQ GEMM is issued before dK's (FT_BWD_DQ_FIRST, default 1; 0 for A/Bs), so that the dQ
    // staging and its hand-over run while dK's GEMM holds the tensor cores, instead of after the block's last GEMM.
#ifndef FT_BWD_DQ_FIRST
#define FT_BWD_DQ_FIRST 1
#endif
    // ... and 64-query blocks at head dim 128 without dropout or score modifications (FT_BWD_DQ_FIRST64, default 1; 0
    // for A/Bs): FA4's order for its 64 x 128 tiles (dQ, then dK, the dQ staging under dK), instead of dK before the
    // dS^T barrier and the staging after the block's last GEMM.
#ifndef FT_BWD_DQ_FIRST64
#define FT_BWD_DQ_FIRST64 1
#endif
    // ... and the 64-query score-modification kernels without softcap or a mask expression (FT_BWD_MODS_DQ_FIRST,
    // default 1; 0 for A/Bs): with the early K / V release below, the sliding-window backward 1.02-1.04x over neither
    // (H200, hd128 causal window 1024 at 4K / 16K, window 256 at 16K; kernel_ab-h200.json)
#ifndef FT_BWD_MODS_DQ_FIRST
#define FT_BWD_MODS_DQ_FIRST 1
#endif
    static constexpr bool kDqFirst =
        kDeferDq == 0 &&
        ((FT_BWD_DQ_FIRST && kSwapDq) ||
         (FT_BWD_DQ_FIRST64 && kBlockM == 64 && !kSplitHd && kHd128DsFromPa &&
          (!kScoreMods || (FT_BWD_MODS_DQ_FIRST && !kSoftcap && !kMaskMod))));
    // FT_BWD_SKIP_HIDDEN (the skipping step keeps no wgmma group across blocks: not with a deferred dQ)
    static constexpr bool kSkipHidden = FT_BWD_SKIP_HIDDEN && kDeferDq == 0;
    // FT_BWD_TAIL_SPLIT: the dense non-causal persistent kernels whose MMA warpgroups own 64 keys each (head dims up to
    // 128), not deterministic (its dQ turns are per key block)
    static constexpr bool kTailSplit = FT_BWD_TAIL_SPLIT && FT_BWD_WALK_INC && kPersistent_ && !kIsCausal_ &&
                                       !kIsDeterministic_ && !kIsBlockSparse_ && !kScoreMods && !kMaskMod && !kSplitHd;
    // The row statistics (lse for P^T, D for dS^T) of n8 tile j are read from shared memory kStatsAhead tiles before
    // their use (the first ones while the S^T / dP^T GEMMs finish), so that the FFMA / FADD consuming them do not wait
    // on the load (ncu, hd128 80-query blocks: those waits were 6-8% of the MMA warps' stall samples).
    // FT_BWD_STATS_AHEAD=n forces n (0: each pair loaded where it is used; A/B).
#ifndef FT_BWD_STATS_AHEAD
#define FT_BWD_STATS_AHEAD 2
#endif
    static constexpr int kStatsAhead = FT_BWD_STATS_AHEAD;
    // The first kStatsAhead lse pairs are loaded before the S^T GEMM is issued (kStatsEarly), not after: there the
    // loads queued behind the GEMMs' instructions in the MIO pipe, and the first exponentials' FFMAs waited on them
    // past the S^T wait (ncu, hd96 causal 4K on 80-query blocks: 3.8% of the kernel's stall samples). The 80- and
    // 128-query kernels without dropout, score modifications, a block mask or determinism take it: H200, interleaved CUDA-graph replays, backward, early / late: hd128 full 1K 1.011,
    // 2K-16K 1.021-1.024, causal 16K 1.034, hd64 causal 1K-16K 1.020-1.022, hd80 full 4K 1.015, hd96 causal 4K 1.005,
    // hd64 full 0.991-1.001 (kernel_ab-h200.json); the 64-query kernels measured level (0.997-1.002) and keep the
    // late loads (as did the first D pairs before dV's GEMM: 0.988-1.028).
    // FT_BWD_STATS_EARLY=0 / 1 forces it off / on (A/B).
    // The S^T GEMM accumulates onto the lse term (FT_BWD_LSE_BIAS, set by build.py; the preprocess then writes
    // lse_log2 as -lse / softmax_scale, AuxParams::lse_bias): each n8 tile of S^T starts at its two queries' values,
    // loaded before the GEMM is issued, and P^T = exp2(S^T scale) -- an FMUL where the FFMA with lse was, and no lse
    // loads next to the exponentials.
#ifndef FT_BWD_LSE_BIAS
#define FT_BWD_LSE_BIAS 0
#endif
    static constexpr bool kBiasS = FT_BWD_LSE_BIAS;
    // (the window-only kernels too: the window masks scores to -inf like the causal mask, which the lse term does not
    // change; softcap and ALiBi apply to the raw score)
    static_assert(!kBiasS || !kScoreMods || kScoreMods_ == 3,
                  "softcap and ALiBi apply to the raw score: no lse term in their S^T");
    // With it the preprocess writes -D (AuxParams::lse_bias), and the 64-query kernels' dP^T GEMM accumulates onto it
    // (FT_BWD_D_BIAS, default 1; 0 for A/Bs): each n8 tile of dP^T starts at its two queries' -D, loaded with the lse
    // term, so that dS^T = P^T (dP^T - D) is one FMUL: no FADD and no D loads next to dS^T. H200, interleaved
    // CUDA-graph replays, backward, with / without: hd128 causal 512 1.004, 2K 1.009, 4K 1.013, GQA 32/8 8K 1.013, GQA
    // 16/2 4K 1.012, hd80 causal 4K 1.010, window 1024 at 16K / 4K 1.000 / 1.002; the 80-query kernels of head dims
    // 65-96 lost (hd96 causal 4K 0.972, hd80 non-causal 4K 0.884: 20 more loads and moves before their GEMMs) and
    // keep the FADD (kernel_ab-h200.json).
#ifndef FT_BWD_D_BIAS
#define FT_BWD_D_BIAS 1
#endif
    static constexpr bool kBiasD = kBiasS && !kSwapDq && FT_BWD_D_BIAS;
#ifdef FT_BWD_STATS_EARLY
    static constexpr bool kStatsEarly = FT_BWD_STATS_EARLY;
#else
    static constexpr bool kStatsEarly =
        (kSwapDq || kBlockM == 128) && !kIsDropout && !kScoreMods && !kIsBlockSparse && !kIsDeterministic;
#endif
    // The dS^T order alone also helps 128-query blocks with dropout (H200, same process, dropout 0.1, backward
    // TFLOP/s first / after dK: full 512 224 / 218, 2K 284 / 275; causal 512 142 / 131, 2K 235 / 211); deterministic
    // hd64 too since its tile groups (above, kDeferDq).
#ifdef FT_BWD_DS_FIRST
    static constexpr bool kDsFirst = FT_BWD_DS_FIRST;
#else
    static constexpr bool kDsFirst = kBlockM == 128 || kSwapDq;
#endif
    using TileQ = SmemTile<kBlockM, kHeadDim>;   // Q and dO stages
    using TileKV = SmemTile<kBlockN, kHeadDim>;  // K and V, then dK and dV
    // K's tile: TileKV, or (kSplitKeys) 32-column blocks in the 64-byte swizzle, copied in boxes of kKBoxCols columns
    // (ops.py: the K tensor map's box and swizzle), so that each warpgroup's 96 dQ columns start on a swizzle atom of
    // the dQ GEMM's MN-major B operand (96 is not a multiple of the 128-byte swizzle's 64 columns)
    static constexpr int kKBoxCols = kSplitKeys ? 32 : 64;
    using TileK = SmemTile<kBlockN, kHeadDim, kKBoxCols>;
    static_assert(TileK::kBytes == TileKV::kBytes, "K and V tiles of one size");
    // dS^T (rows keys, columns queries), two buffers; 80-query blocks: dS (rows queries, columns keys)
    using TileS = SmemTile<kSwapDq ? kBlockM : kBlockN, kSwapDq ? kBlockN : kBlockM>;
    // a block's lse (or D): kStatsBoxBytes copied, in kStatsBytes (tensor copies land 128-byte aligned)
    static constexpr int kStatsBoxBytes = kBlockM * 4, kStatsBytes = (kStatsBoxBytes + 127) / 128 * 128;
    // one warp's 16 x 64 fp32 slice of a dQ piece (80-query blocks: 16 head-dim rows x 80 queries of dQ^T)
    static constexpr int kDqSliceBytes = 16 * (kSwapDq ? kBlockM : 64) * 4;
    static constexpr int kDqBoxBytes = 32 * kBlockM * 4;  // kSwapDq: a tma_dq box (32 columns, 128-byte swizzle)
    // mbarriers: K / V full and empty, Q / dO stages full and empty, dQ staging full and empty, tile slots full and
    // empty (2 each); then the 2 tile slots (ints); then (kDqWriters == 2) the odd blocks' dQ staging full; then
    // (FT_BWD_TILE_RECORD) the 2 slots' tile records (4 ints each, 16-byte aligned) and the group's head counts
    static constexpr int kBarrierBytes = 256;
    static_assert(8 * (4 + 2 * kStages + 4) + 16 + 2 * 16 + 8 <= kBarrierBytes, "barrier area");
    // Split head dims add their dQ pieces to global memory from the registers (no staging, no dQ writer warp):
    // staged through shared memory for the writer's bulk reduce-adds (two rounds of 8 slices, 64 KB, fit at hd192)
    // they ran 0.72-0.81x as fast (H200, same process): the MMA warps waited for the writer at every block.
    // Head dim 192 on 96-key tiles with kSkStageDq (build.py BwdSm90Tiles.stage_dq): each MMA warp stages its 16 rows x
    // 96 columns of a block's dQ (6 KB, contiguous in dq_accum's scrambled order) and reduce-adds them with one bulk copy
    // that it issues itself; one dO buffer and single P^T / dS^T tiles make the room (kDoStages, kScoreTiles).
    static constexpr bool kSkStageDq = kSplitKeys && FT_BWD_SK_STAGE_DQ;
    static constexpr int kDoStages = kSkStageDq ? 1 : kStages;
    static constexpr int kSkDqSliceBytes = 16 * (kHeadDim / 2) * 4;
    static constexpr int kDqStagingBytes = kSkStageDq ? kNMma * 4 * kSkDqSliceBytes
                                           : kSplitHd ? 0 : kNMma * 4 * kPiecesPerWg * kDqSliceBytes;
    // dQ writer warps (producer warpgroup warps 2, 3): FT_BWD_DET_WRITERS for the deterministic kernels, else one
    static constexpr int kDqWriters = kIsDeterministic && !kSplitHd && FT_BWD_DET_WRITERS == 2 ? 2 : 1;
    // The dQ conversion in the kernel (FT_BWD_FUSED_DQ, defined by build.py for BwdSm90Tiles.fused_dq; by default
    // build.BWD_FUSED_DQ = 2: the causal hd64 kernel up to 4K queries, hd128 up to 1K, build._bwd_fused_dq_rule):
    // once the dQ writer's reduce-adds of a query block have completed, it counts them in (BwdParams::dq_counts); the
    // key block that completes the count -- every key block that sees the query block has added to it -- posts the
    // block to the converter warps (producer warps 3 and 1), which copy its 32 KB of dq_accum from L2 into shared
    // memory in 4 KB chunks (bulk copies) and write dq = softmax_scale * dq_accum, so that no conversion kernel
    // re-reads dq_accum from memory after the backward. The scrambled layout's 64-query (hd128) and 128-query (hd64)
    // blocks, dense, not deterministic. At hd128 (causal calls up to 1K queries) the walk visits each head's query
    // blocks from the last down (QueryBlockWalk::kRev).
    static constexpr bool kFusedDq = FT_BWD_FUSED_DQ != 0;
    static_assert(!kFusedDq || (!kSplitHd && !kSwapDq && !kNarrowDq && !kIsDeterministic && !kIsBlockSparse &&
                                !kScoreMods && !kMaskMod && kDqWriters == 1 && kHeadDimEff == kHeadDim &&
                                kBlockM * kHeadDim == 8192),
                  "the fused dQ conversion: dense scrambled 32 KB query blocks, one dQ writer");
    // its shared memory: the two converter warps' 4 KB chunk buffers (two each), then a 1 KB control area: the
    // barriers (request full / empty, kFdqReqs each; chunk full, one per buffer), the request ring (kFdqReqs slots of
    // 32 bytes: the writer posts without waiting for the converters while it has free slots) and the dQ writer's
    // records of its last blocks (16 of 32 bytes)
    static constexpr int kFdqReqs = 8, kFdqConverters = 2, kFdqChunkBytes = 4096;
    static constexpr int kFdqBufBytes = 2 * kFdqConverters * kFdqChunkBytes;
    static constexpr int kFdqBytes = kFusedDq ? kFdqBufBytes + 1024 : 0;
    // the dQ writer's blocks in flight before it waits for the oldest one's reduce-adds to complete (FT_BWD_FDQ_DEPTH;
    // kFdqDepth + 1 records of 32 bytes in the converter's control area)
#ifndef FT_BWD_FDQ_DEPTH
#define FT_BWD_FDQ_DEPTH 1
#endif
    static constexpr int kFdqDepth = FT_BWD_FDQ_DEPTH;
    // FT_BWD_FDQ_DISCARD (default 1; 0 is the A/B build without it): each converter lane drops its 128-byte line of a
    // chunk of dq_accum from L2 once the chunk's copy has landed (discard_l2_line: a converted block of dq_accum is read
    // no more -- each sequence's blocks are whole blocks of padded rows, zero-filled again by the next call's
    // preprocess -- so its lines, dirty from the reduce-adds, are never written back to memory)
#ifndef FT_BWD_FDQ_DISCARD
#define FT_BWD_FDQ_DISCARD 1
#endif
    static_assert(kFdqDepth >= 1 && kFdqDepth <= 15, "kFdqDepth + 1 records fit");
    // FT_BWD_FDQ_DIAG (timing diagnostics only, wrong dq): 1 the writer waits and counts but hands nothing to the
    // converter; 2 the writer neither waits nor counts
#ifndef FT_BWD_FDQ_DIAG
#define FT_BWD_FDQ_DIAG 0
#endif
    // Head dims 64 / 128: the epilogue stages dK and dV in the score tiles and the dQ staging slices (one area, free
    // once both warpgroups' last GEMMs are done and the dQ writer has taken the last slices) instead of in K / V, so
    // K / V are released before the epilogue and the next tile's copy overlaps it. Split head dims: no room;
    // deterministic hd128: dV would wait for the dQ writer, which waits for its turn.
    // (FT_BWD_KV_EARLY=0 builds the epilogue through K / V: A/B)
#ifndef FT_BWD_KV_EARLY
#define FT_BWD_KV_EARLY 1
#endif
    static constexpr bool kEarlyKv =
        FT_BWD_KV_EARLY && !kSplitHd && (!kIsDeterministic || TileKV::kBytes <= TileS::kBytes);
    static_assert(!kEarlyKv || 2 * TileKV::kBytes <= 2 * TileS::kBytes + kDqStagingBytes, "dK / dV staging area");
    // With dQ first, the last query block of a tile releases K / V once its dQ GEMM is done (V's last reader, dP^T,
    // and K's, dQ, have finished; dK reads Q) instead of in the epilogue after the dQ staging and dK's GEMM, so that
    // the next tile's K / V copy starts that much earlier (FT_BWD_KV_RELEASE_LAST, default 1; 0 for A/Bs). Not
    // block-sparse (its walk cannot tell the last block in advance), the score-modification kernels as
    // FT_BWD_MODS_KV_RELEASE_LAST says (below), and
    // only where the epilogue stages dK / dV outside K / V (kEarlyKv; the deterministic hd128 kernel stages them in K /
    // V, which the next tile's copy would overwrite). Not the causal 80-query kernel: there the next tile's K / V copy
    // then overlaps the last block's dK GEMM and dQ staging, 0.987-0.995x at 16K (H200, three same-process A/Bs).
#ifndef FT_BWD_KV_RELEASE_LAST
#define FT_BWD_KV_RELEASE_LAST 1
#endif
    // The score-modification kernels without a mask expression: the 64-query ones (FT_BWD_MODS_KV_RELEASE_LAST,
    // default 1: a sliding window's tiles are short, so the next tile's K / V wait counts more; 0: none, 2: the
    // 80-query ones too, for A/Bs)
#ifndef FT_BWD_MODS_KV_RELEASE_LAST
#define FT_BWD_MODS_KV_RELEASE_LAST 1
#endif
    static constexpr bool kKvReleaseLast =
        FT_BWD_KV_RELEASE_LAST && kDqFirst && kEarlyKv && !kIsBlockSparse &&
        (kScoreMods ? (FT_BWD_MODS_KV_RELEASE_LAST == 2 || (FT_BWD_MODS_KV_RELEASE_LAST == 1 && !kSwapDq)) &&
                          !kMaskMod
                    : !(kSwapDq && kIsCausal));
    // dK / dV written from there by TMA stores, so that the MMA warps go on to the next tile at once
    static constexpr bool kTmaStoreDkv = kEarlyKv && FT_TMA_STORE;
    // Where kEarlyKv stages a warpgroup's 64 rows of dK and dV. 64 / 128-query blocks: TileKV rows [64 w, 64 w + 64)
    // over the two score tiles (dK) and the dQ staging (dV): a warpgroup's dK rows are the bytes of its own dS^T rows
    // (the other warpgroup's next dS^T stores cannot land on them while their TMA store reads them). 80-query blocks:
    // dS's columns are keys, so its rows do not line up with TileKV's; warpgroup w's dK column blocks go into its own
    // dS columns of the two score tiles (TileDk: 64 rows, column blocks a score tile apart, from w * 10 KB) and its dV
    // into the dQ staging (TileDv, from w * 16 KB).
    using TileDk = SmemTile<kSwapDq ? 2 * kBlockM : kBlockN, kHeadDim>;
    using TileDv = SmemTile<kSwapDq ? 64 : kBlockN, kHeadDim>;
    static_assert(!kSwapDq || (kEarlyKv && (TileS::kBytes / 2) % 1024 == 0 && 2 * TileDv::kBytes <= kDqStagingBytes),
                  "80-query blocks: dK column blocks 1024-byte aligned (TMA stores), dV in the dQ staging");
    // score tiles: dS^T double-buffered, or (split head dims) P^T and dS^T, or (kSplitKeys) P^T and dS^T both
    // double-buffered (kSkStageDq: single)
    static constexpr int kScoreTiles = kSplitKeys && !kSkStageDq ? 4 : 2;
    // K / V buffers (FT_BWD_KV_STAGES, defined by build.py for BwdSm90Tiles.kv_stages): 2, tile t's K / V in buffer
    // t % 2 (its own full / empty barriers), copied by the producer before the tile's first Q / dO, so that the copy
    // runs under the previous tile's last query blocks instead of after its release. The 128-query head-dim-64
    // kernels without the fused dQ conversion only (shared memory: 231,680 of 232,448 bytes, with no 1 KB alignment
    // slack: the dynamic shared memory must start 1024-aligned, which the kernel checks).
#ifndef FT_BWD_KV_STAGES
#define FT_BWD_KV_STAGES 1
#endif
    static constexpr int kKvStages = FT_BWD_KV_STAGES;
    static_assert(kKvStages == 1 || (kKvStages == 2 && kHeadDim == 64 && kBlockM == 128 && !kFusedDq && kEarlyKv &&
                                     !kIsDeterministic && kDqWriters == 1),
                  "two K / V buffers: the 128-query head-dim-64 kernels without the fused dQ conversion");
    static constexpr int kAlignSlack = kKvStages > 1 ? 0 : 1024;
    static_assert(8 * (16 + 2 * kStages) + 8 <= kBarrierBytes, "barrier area (the second K / V buffer's barriers)");
    static constexpr int kSmemBytes = (kStages + kDoStages) * TileQ::kBytes + 2 * kKvStages * TileKV::kBytes +
                                      kScoreTiles * TileS::kBytes + kDqStagingBytes + 2 * kStages * kStatsBytes +
                                      kFdqBytes + kBarrierBytes + kAlignSlack;
    // Named barriers (0 is __syncthreads): both warpgroups' dS^T rows stored; both done reading K (epilogue), then
    // one per warpgroup (its rows -- split head dims: columns -- of dK / dV staged); head dims 192 / 256: P^T stored
    // (warpgroup 0 to 1); kSplitKeys: kBarP + w, warpgroup w's P^T rows stored (its 128 threads).
    static constexpr int kBarDs = 1, kBarEpilogue = 2, kBarP = 5;
};

// A tile is one key block of one unit = (batch, kv head, GQA split: BwdParams::kv_splits > 1 splits the group's query
// heads over that many tiles per key block), unit = (head_kv * batch + batch) * kv_splits + split. Order: tile =
// unit * n_kblocks + n_block, key blocks fastest, so that concurrent tiles share the head's Q / dO and dQ rows in L2
// and the deterministic turns find the key blocks they wait for taken earlier (deterministic causal: the highest key
// block first; see the dQ writer). Causal, and deterministic (below): the units in groups of
// FwdParams::causal_tile_group (tile_group_unit), and inside a group the key blocks outer, units inner: the longest
// tiles (key block 0 sees every query block) start first and the shortest end the launch (key blocks fastest leaves
// one unit's long first tile to run alone at the end). Groups keep the L2 locality that all units inner loses
// (0.76-0.84x at 1K / 2K, 2026-11-25).
// Deterministic with causal_tile_group > 1 (ops._det_tile_group): the same groups (causal: key blocks descending
// inside a group, the turns' order), so that fewer key blocks of a unit run at once and wait in one chain of turns
// (one dq_accum). H200, 2026-11-25 22:07 UTC, against key blocks fastest with 2-4 chains of
// their own dq_accum: non-causal 1.01-1.17x, causal 0.99-1.02x; one chain without the groups was 0.49-0.83x of the
// default backward.
struct BwdTile {
    int n_block, n0, batch, head_kv, q_start, k_start, seqlen_q, seqlen_k, split;
    int q_pad;  // the sequence's first row in lse_log2 / softmax_d / dq_accum (utils.cuh padded_row_start)
    int group, heads;  // query heads per kv head; this tile's of them (group / kv_splits; QueryBlockWalk)
    int piece;  // kTailSplit: the piece of a tail tile (its query blocks: QueryBlockWalk), -1 for a whole tile
    int tail;   // kTailSplit, piece >= 0: the tile's index among the tail tiles (tile - tail_first)
};
// The scheduler's unit (utils.cuh tail_unit_tile; without kTailSplit, the tile): its tile, and x.piece / x.tail
template <class T> __device__ __forceinline__ int bwd_unit_tile(const BwdParams& p, int unit, BwdTile& x) {
    x.piece = -1;
    if constexpr (!T::kTailSplit) return unit;
    const int tile = tail_unit_tile(unit, p.tail_first, p.tail_pieces, x.piece);
    x.tail = tile - p.tail_first;
    return tile;
}
// The fields of tile x that follow from x.n_block and x.batch (true: x has keys; varlen: key blocks past a short
// sequence's end do nothing); and (bwd_tile_heads) the group's head counts, kernel-wide.
template <class T> __device__ __forceinline__ bool bwd_tile_bounds(const BwdParams& p, BwdTile& x) {
    const FwdParams& f = p.fwd;
    seq_bounds(f, x.batch, x.q_start, x.k_start, x.seqlen_q, x.seqlen_k);
    x.q_pad = padded_row_start(f.cu_seqlens_q != nullptr, x.batch, x.q_start, f.seqlen_q, T::kBlockM);
    x.n0 = x.n_block * T::kBlockN;
    return x.n0 < x.seqlen_k;
}
__device__ __forceinline__ void bwd_tile_heads(const BwdParams& p, BwdTile& x) {
    x.group = p.fwd.nheads / p.fwd.nheads_kv;
    x.heads = x.group / p.kv_splits;
}
// Tile `tile`'s fields but x.group / x.heads (bwd_tile_heads)
template <class T> __device__ __forceinline__ bool bwd_tile(const BwdParams& p, int tile, int n_kblocks, BwdTile& x) {
    const FwdParams& f = p.fwd;
    int unit;
    if ((T::kIsCausal || T::kIsDeterministic) && f.causal_tile_group > 1) {
        int r;
        unit = tile_group_unit(tile, n_kblocks, f.batch * f.nheads_kv * p.kv_splits, f.causal_tile_group, r);
        x.n_block = T::kIsDeterministic && T::kIsCausal ? n_kblocks - 1 - r : r;
    } else {
        x.n_block = T::kIsDeterministic && T::kIsCausal ? n_kblocks - 1 - tile % n_kblocks : tile % n_kblocks;
        unit = tile / n_kblocks;
    }
    x.split = unit % p.kv_splits;
    const int bh = unit / p.kv_splits;
    x.batch = bh % f.batch;
    x.head_kv = bh / f.batch;
    return bwd_tile_bounds<T>(p, x);
}

// The deterministic turns: the counter of (batch, query head, query block m0) and the count at which it is key block
// x.n_block's turn to add it. Non-causal: ascending key blocks (key block n after n - 1, n - 2, ...); causal:
// descending from the highest key block that sees the query block (n_last), which visits it first. Either way the
// tiles a turn waits for are taken from the scheduler earlier (bwd_tile's order). (Until 2026-11-26 non-causal key
// blocks could add to dq_splits copies of dq_accum in separate chains; one chain in tile groups replaced them.)
template <class T>
__device__ __forceinline__ int* det_turn(const BwdParams& p, const BwdTile& x, int head, int m0, int& turn) {
    const FwdParams& f = p.fwd;
    turn = x.n_block;
    if constexpr (T::kIsCausal) {
        const int row_last = min_(m0 + T::kBlockM, x.seqlen_q) - 1;
        turn = (row_last + x.seqlen_k - x.seqlen_q) / T::kBlockN - x.n_block;
    }
    return p.dq_semaphore + ((i64)x.batch * f.nheads + head) * p.dq_sem_mblocks + m0 / T::kBlockM;
}
__device__ __forceinline__ void wait_turn(const int* counter, int turn) {
    while (ld_acquire_gpu(counter) < turn) {
        if (FT_BWD_DET_SPIN_NS > 0) __nanosleep(FT_BWD_DET_SPIN_NS);
    }
}

// The (query head, query block) pairs a CTA visits, in order: dense, every query block from the first that sees the
// key block, for each query head of the group; block-sparse, the column list of the key block's mask block.
// FT_BWD_WALK_INC=1 (default since 2026-11-25; 0 for A/Bs): the dense walk advances (head, query block) by additions
// instead of a division and a remainder per block; every role of the CTA runs the walk, the producer warpgroup's on
// 24-40 registers. kRev, the hd128 kernel with the in-kernel dQ conversion (dense, causal, not deterministic): each
// head's query blocks from the last down, so that the key blocks of a head visit a query block at the same step of
// their walks; ascending, the lowest key block of a head (the longest tile) adds to each query block last and so
// converts all of them. H100, backward against the conversion kernel (both with dq_accum's converted lines dropped from
// L2): causal 512 1.013, 768 1.049, 1K 1.059, 1536 1.004, 2K 1.011, ascending 0.939-0.972 at 512-1K
// (kernel_ab-h100.json bwd_fdq_rev_hd128_ab); the descending walk without the conversion: hd64 causal 512 / 1K 0.977 /
// 0.968, hd128 1.00-1.01 (bwd_walk_rev_ab); the hd64 kernel with the conversion on the descending walk, long causal
// calls, against the conversion kernel: 16K 0.996, 8K 0.988, 4K 1.001 (kernel_ab-h100.json bwd_fdq_rev_hd64_ab).
template <class T> struct QueryBlockWalk {
    static constexpr bool kRev = T::kFusedDq && T::kHeadDim == 128 && T::kIsCausal;  // (kFusedDq: dense, plain)
    SparseWalkAsc<kBlockSparseSize / T::kBlockM> sparse;
    int it = 0, n_iters = 0, n_mblocks = 0, m_block_min = 0, m_block_end = 0, group = 0, heads = 0, head0 = 0;
    int m_i = 0, head_i = 0;  // FT_BWD_WALK_INC: query block and head of step it
    int head_kv = 0, n0 = 0;
    bool has = false;
    int head = 0, m0 = 0;
    int mm_state = 2;  // kMaskMod: the block state of (head, m0) and this key block (0 never: skipped)
    const unsigned char* mm_col = nullptr;  // kMaskMod: the states of this key block's column (head 0, row 0)
    const BwdParams* p;
    __device__ __forceinline__ const int* col_list(int i) const {
        const FwdParams& f = p->fwd;
        return f.bs_cols + (head_kv * group + i) * f.bs_cols_head_stride +
               (i64)(n0 / kBlockSparseSize) * (f.bs_n_qblocks + 1);
    }
    __device__ __forceinline__ void settle() {
        if constexpr (T::kIsBlockSparse) {
            has = sparse.settle([&](int i) { return col_list(i); }, group, m_block_min, m_block_end);
            if (has) {
                head = head_kv * group + sparse.head_i;
                m0 = sparse.tile([&](int i) { return col_list(i); }) * T::kBlockM;
            }
        } else {
            for (;;) {  // kMaskMod: past the pairs whose state is empty
                has = it < n_iters;
                if (!has) break;
                if constexpr (FT_BWD_WALK_INC) {
                    head = head_kv * group + head0 + head_i;
                    m0 = (kRev ? m_block_end - 1 - m_i : m_block_min + m_i) * T::kBlockM;
                } else {
                    head = head_kv * group + head0 + it / n_mblocks;
                    m0 = (kRev ? m_block_end - 1 - it % n_mblocks : m_block_min + it % n_mblocks) * T::kBlockM;
                }
                if constexpr (!T::kMaskMod) {
                    break;
                } else {
                    const FwdParams& f = p->fwd;
                    mm_state = mm_col[head * f.mm_states_h_stride + (i64)(m0 / kBlockSparseSize) * f.mm_n_kblocks];
                    if (mm_state != 0) break;
                    ++it;
                    if constexpr (FT_BWD_WALK_INC)
                        if (++m_i == n_mblocks) m_i = 0, ++head_i;
                }
            }
        }
    }
    __device__ __forceinline__ QueryBlockWalk(const BwdParams& params, const BwdTile& x)
        : head_kv(x.head_kv), n0(x.n0), p(&params) {
        const int seqlen_q = x.seqlen_q, seqlen_k = x.seqlen_k;
        group = x.group;
        heads = x.heads;  // this tile's query heads: head0 .. head0 + heads - 1 of the group
        head0 = x.split * heads;
        // Query blocks that see some key of this block: causal rows i >= n0 - (seqlen_k - seqlen_q).
        m_block_min = T::kIsCausal ? max_(0, n0 - (seqlen_k - seqlen_q)) / T::kBlockM : 0;
        m_block_end = ceil_div(seqlen_q, T::kBlockM);
        if constexpr (T::kScoreMods)  // rows i + offset - left <= j <= i + offset + right for some key j of the block
            window_query_blocks<T::kIsCausal, T::kBlockM, T::kBlockN>(n0, seqlen_k - seqlen_q, params.fwd.window_left,
                                                                       params.fwd.window_right, m_block_min,
                                                                       m_block_end);
        if constexpr (T::kMaskMod) {  // and only the query blocks that some head's states show this key block to
            const FwdParams& f = params.fwd;
            const unsigned char* base = f.mm_states + x.batch * f.mm_states_b_stride;
            mm_col = base + n0 / kBlockSparseSize;
            const int* range = reinterpret_cast<const int*>(base + (i64)f.mm_n_qblocks * (f.mm_n_kblocks + 8)) +
                               2 * (n0 / kBlockSparseSize);
            m_block_min = max_(m_block_min, range[0] * (kBlockSparseSize / T::kBlockM));
            m_block_end = min_(m_block_end, (range[1] + 1) * (kBlockSparseSize / T::kBlockM));
        }
        n_mblocks = max_(0, m_block_end - m_block_min);
        n_iters = heads * n_mblocks;
        if (T::kTailSplit && x.piece >= 0 && n_iters > 0) {
            // a tail piece: steps [lo, hi) of the tile's walk, counted from 0 (FT_BWD_WALK_INC: from m_i, head_i)
            const int pieces = params.tail_pieces, lo = x.piece * n_iters / pieces;
            n_iters = (x.piece + 1) * n_iters / pieces - lo;
            m_i = lo % n_mblocks, head_i = lo / n_mblocks;
        }
        settle();
    }
    __device__ __forceinline__ void next() {
        ++it;
        if constexpr (T::kIsBlockSparse) sparse.advance();
        if constexpr (!T::kIsBlockSparse && FT_BWD_WALK_INC) {
            if (++m_i == n_mblocks) m_i = 0, ++head_i;
        }
        settle();
    }
};

// The kernel's shared memory (tiles 1024-byte aligned for the 128-byte swizzle): kStages Q and kStages dO stages, K,
// V, two 16 x 16-bit score tiles (dS^T double-buffered; head dims 192 / 256: P^T and dS^T), the dQ staging slices
// (head dims 64 / 128), lse and D per stage, mbarriers, tile slots; and the reader side of the tile slots.
template <class T> struct BwdSm90Smem {
    u32 base, sK, sV, sdS0, sdQ, sStats, sFdq, bars, full_kv, empty_kv, dq_full, dq_empty, dq_full1;
    const BwdParams* p;
    int n_kblocks;
    __device__ __forceinline__ BwdSm90Smem(const unsigned char* smem, const BwdParams& params) : p(&params) {
        base = T::kAlignSlack ? (smem_u32(smem) + 1023) & ~1023u : smem_u32(smem);
        // (T::kKvStages == 2: buffer b's K at sK + b * kKvBytes, its V kKvBytes / 2 after it)
        sK = base + (T::kStages + T::kDoStages) * T::TileQ::kBytes, sV = sK + T::TileKV::kBytes;
        sdS0 = sV + T::TileKV::kBytes + (T::kKvStages - 1) * kKvBytes;
        sdQ = sdS0 + T::kScoreTiles * T::TileS::kBytes;
        sStats = sdQ + T::kDqStagingBytes;  // lse[kStages][M], D[kStages][M]
        sFdq = sStats + 2 * T::kStages * T::kStatsBytes;  // kFusedDq: the converter's chunks, barriers, requests
        bars = sFdq + T::kFdqBytes;
        full_kv = bars, empty_kv = bars + 8;
        dq_full = bars + 8 * (2 + 2 * T::kStages), dq_empty = dq_full + 8;  // the dQ staging slices
        dq_full1 = bars + 8 * (9 + 2 * T::kStages);  // two writers: the odd blocks' (after the tile slots)
        // (kSkStageDq, no dQ writer: dq_full / dq_empty are the dO buffer's full / empty, dq_full1 mma_done)
        n_kblocks = ceil_div(params.fwd.seqlen_k, T::kBlockN);
    }
    static constexpr u32 kKvBytes = 2 * T::TileKV::kBytes;  // one K / V buffer
    // K / V buffer b's full / empty barriers (b = 1: after the tile records and head counts)
    __device__ __forceinline__ u32 kv_full(int b) const { return b ? bars + 8 * (15 + 2 * T::kStages) : full_kv; }
    __device__ __forceinline__ u32 kv_empty(int b) const { return b ? bars + 8 * (16 + 2 * T::kStages) : empty_kv; }
    // tile_iter's K / V buffer and the parity of its barriers' phase
    __device__ __forceinline__ static int kv_buf(int tile_iter) { return T::kKvStages > 1 ? tile_iter & 1 : 0; }
    __device__ __forceinline__ static u32 kv_parity(int tile_iter) {
        return (T::kKvStages > 1 ? tile_iter >> 1 : tile_iter) & 1;
    }
    __device__ __forceinline__ u32 fdq_chunk(int i) const { return sFdq + i * T::kFdqChunkBytes; }
    __device__ __forceinline__ u32 fdq_req_full(int i) const { return sFdq + T::kFdqBufBytes + 8 * i; }
    __device__ __forceinline__ u32 fdq_req_empty(int i) const { return sFdq + T::kFdqBufBytes + 64 + 8 * i; }
    __device__ __forceinline__ u32 fdq_chunk_full(int i) const { return sFdq + T::kFdqBufBytes + 128 + 8 * i; }
    __device__ __forceinline__ u32 fdq_req(int i) const { return sFdq + T::kFdqBufBytes + 256 + 32 * i; }
    __device__ __forceinline__ u32 fdq_rec(int i) const { return sFdq + T::kFdqBufBytes + 512 + 32 * i; }
    __device__ __forceinline__ u32 sQ(int s) const { return base + s * T::TileQ::kBytes; }
    __device__ __forceinline__ u32 sdO(int s) const { return base + (T::kStages + s) * T::TileQ::kBytes; }
    __device__ __forceinline__ u32 sLse(int s) const { return sStats + s * T::kStatsBytes; }
    __device__ __forceinline__ u32 sD(int s) const { return sStats + (T::kStages + s) * T::kStatsBytes; }
    __device__ __forceinline__ u32 full(int s) const { return bars + 8 * (2 + s); }
    // kSkStageDq: the dO buffer's full / empty (the TMA thread's copy; one arrival per MMA warp after its dV^T GEMM),
    // and the MMA warps' block-done barrier (one arrival per MMA warp after all its GEMMs of the block)
    __device__ __forceinline__ u32 do_full() const { return dq_full; }
    __device__ __forceinline__ u32 do_empty() const { return dq_empty; }
    __device__ __forceinline__ u32 mma_done() const { return dq_full1; }
    __device__ __forceinline__ u32 empty(int s) const { return bars + 8 * (2 + T::kStages + s); }
    // Tile slots: the producer publishes each tile it takes (-1: no more) to the dQ writer (head dims 64 / 128) and
    // the MMA warps, two tiles ahead at most.
    static constexpr int kTileReaders = (T::kSplitHd ? 0 : T::kDqWriters) + 4 * T::kNMma;
    __device__ __forceinline__ u32 tile_full(int i) const { return bars + 8 * (4 + 2 * T::kStages + i); }
    __device__ __forceinline__ u32 tile_empty(int i) const { return bars + 8 * (6 + 2 * T::kStages + i); }
    __device__ __forceinline__ u32 tile_slot(int i) const { return bars + 8 * (8 + 2 * T::kStages) + 4 * i; }
    // FT_BWD_TILE_RECORD: slot i's record n0, batch, head_kv, split (after dq_full1; bars is 128-byte
    // aligned), then the group's head counts (BwdTile::group, heads; stored before the roles start)
    __device__ __forceinline__ u32 tile_record(int i) const { return bars + 8 * (10 + 2 * T::kStages) + 16 * i; }
    __device__ __forceinline__ u32 heads_record() const { return bars + 8 * (10 + 2 * T::kStages) + 32; }
    __device__ __forceinline__ void init_heads() const {  // one thread, before the __syncthreads that starts the roles
        if constexpr (FT_BWD_TILE_RECORD) {
            BwdTile x;
            bwd_tile_heads(*p, x);
            st_shared_b32(heads_record(), x.group);
            st_shared_b32(heads_record() + 4, x.heads);
        }
    }
    __device__ __forceinline__ void tile_heads(BwdTile& x) const {
        if constexpr (FT_BWD_TILE_RECORD)
            asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];" : "=r"(x.group), "=r"(x.heads) : "r"(heads_record()));
        else
            bwd_tile_heads(*p, x);
    }
    // The producer's side: publish tile (the scheduler's unit: bwd_unit_tile; -1: no more) and, FT_BWD_TILE_RECORD,
    // its record in slot i (the slot is free: tile_empty waited for; tile_full's arrive orders these stores before
    // the readers' loads).
    __device__ __forceinline__ void publish_tile(int i, int tile, const BwdTile& x) const {
        atomic_store_shared(tile_slot(i), tile);
        if (FT_BWD_TILE_RECORD && tile >= 0) {
            const int fields[4] = {x.n0, x.batch, x.head_kv, x.split};  // (n0: live in the producer's loop)
#pragma unroll
            for (int j = 0; j < 4; ++j) atomic_store_shared(tile_record(i) + 4 * j, fields[j]);
        }
    }
    // The tile a role works on next (false: none): waits for the producer to publish it, then releases the slot.
    __device__ __forceinline__ bool read_tile(int tile_iter, BwdTile& x) const {
        const int slot = tile_iter & 1;
        mbar_wait(tile_full(slot), (tile_iter >> 1) & 1);
        const int tile = ld_shared_b32(tile_slot(slot));
        int v[4];  // FT_BWD_TILE_RECORD: read before the slot is released (unused after the end mark)
        if constexpr (FT_BWD_TILE_RECORD)
            asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
                         : "r"(tile_record(slot))
                         : "memory");
        __syncwarp();
        if (threadIdx.x % 32 == 0) mbar_arrive(tile_empty(slot));
        if constexpr (FT_BWD_TILE_RECORD)  // (unconditionally: no old fields kept live across the tile loop)
            x.n_block = (int)((u32)v[0] / T::kBlockN), x.batch = v[1], x.head_kv = v[2], x.split = v[3];
        if (tile >= 0) {
            const int tile_index = bwd_unit_tile<T>(*p, tile, x);
            if constexpr (FT_BWD_TILE_RECORD) {
                bwd_tile_bounds<T>(*p, x);
            } else {
                bwd_tile<T>(*p, tile_index, n_kblocks, x);
            }
            tile_heads(x);
        }
        return tile >= 0;
    }
};

// Two consecutive floats of a stage's row statistics (lse or D of queries q, q + 1) at shared address addr.
__device__ __forceinline__ void ld_stats2(u32 addr, float (&v)[2]) {
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v[0]), "=f"(v[1]) : "r"(addr));
}
// An accumulator n8 tile (rows keys, columns queries q, q + 1) set to the statistics of its two queries. (One load and
// two moves: a second load instead, kept apart by ld.volatile, ran the hd80 / hd96 backward 1-3% slower.)
__device__ __forceinline__ void ld_stats_acc(u32 addr, float (&acc)[4]) {
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(acc[0]), "=f"(acc[1]) : "r"(addr));
    acc[2] = acc[0], acc[3] = acc[1];
}

// Epilogue of a tile: rows [row_begin, row_begin + kRows) of dK and dV, staged from row srow of T::TileDk / TileDv at
// sdK / sdV (TileKV: srow = row_begin), to
// global memory with 16-byte stores by the 128 threads of one warpgroup (ctid); kCols: the columns that can be
// non-zero.
template <class T, int kRows, int kCols>
__device__ __forceinline__ void store_dkv_rows(const BwdParams& p, u32 sdK, u32 sdV, const BwdTile& x, int row_begin,
                                               int ctid, int srow) {
    using TileDk = typename T::TileDk;
    using TileDv = typename T::TileDv;
    u16* dk = (u16*)p.dk + x.batch * p.dk_batch_stride + (i64)(x.k_start + x.n0 + row_begin) * p.dk_row_stride +
              x.head_kv * p.dk_head_stride;
    u16* dv = (u16*)p.dv + x.batch * p.dv_batch_stride + (i64)(x.k_start + x.n0 + row_begin) * p.dv_row_stride +
              x.head_kv * p.dv_head_stride;
    const int rows_valid = x.seqlen_k - x.n0 - row_begin;
    constexpr int kChunksPerRow = kCols / 8;
#pragma unroll
    for (int i = 0; i < kRows * kChunksPerRow / 128; ++i) {
        const int chunk = ctid + i * 128, row = chunk / kChunksPerRow, col = (chunk % kChunksPerRow) * 8;
        if (row < rows_valid && col < p.fwd.head_dim) {
            u32 v[4];
            ld_shared_v4(TileDk::addr(sdK, srow + row, col), v);
            st_global_v4(dk + row * p.dk_row_stride + col, v);
            ld_shared_v4(TileDv::addr(sdV, srow + row, col), v);
            st_global_v4(dv + row * p.dv_row_stride + col, v);
        }
    }
}

// Epilogue of a split-head-dim tile: columns [col0, col0 + kCols) of the kRows rows of a gradient staged in TileKV
// layout at src (the warpgroup's own columns: no other warpgroup's stores to wait for), to global memory at dst
// (rows of row_stride elements) with 16-byte stores by the 128 threads of one warpgroup (ctid).
template <class T, int kRows, int kCols>
__device__ __forceinline__ void store_cols(u32 src, u16* dst, i64 row_stride, int rows_valid, int col0, int head_dim,
                                           int ctid) {
    constexpr int kChunksPerRow = kCols / 8;
    static_assert(kRows * kChunksPerRow % 128 == 0, "whole 16-byte chunks per thread");
#pragma unroll
    for (int i = 0; i < kRows * kChunksPerRow / 128; ++i) {
        const int chunk = ctid + i * 128, row = chunk / kChunksPerRow, col = col0 + (chunk % kChunksPerRow) * 8;
        if (row < rows_valid && col < head_dim) {
            u32 v[4];
            ld_shared_v4(T::TileKV::addr(src, row, col), v);
            st_global_v4(dst + row * row_stride + col, v);
        }
    }
}

// kTailSplit, a tail piece's end (both MMA warpgroups, after their last GEMM; x.piece >= 0): the piece's fp32 dK / dV
// sums go to its slot of tail_partials (per warpgroup w, float4 k of thread ctid at (k * 128 + ctid) * 4: dK's kDT
// float4, then dV's), and one thread counts the piece in. The piece that completes the count (true) then holds in dk /
// dv the sum of every piece's slot, added in piece order (the same bits whichever piece finishes last) and goes on to
// the tile's epilogue; the others (false) are done with the tile.
template <class T, int kDT>
__device__ __forceinline__ bool tail_sum(const BwdParams& p, const BwdTile& x, int w, int ctid, float (&dk)[kDT][4],
                                         float (&dv)[kDT][4]) {
    const int tail = x.tail;
    auto slot = [&](int piece) {
        return p.tail_partials + ((i64)(tail * p.tail_pieces + piece) * T::kNMma + w) * (128 * 8 * kDT) + 4 * ctid;
    };
    float* mine = slot(x.piece);
#pragma unroll
    for (int j = 0; j < kDT; ++j) {
        *reinterpret_cast<float4*>(mine + 512 * j) = make_float4(dk[j][0], dk[j][1], dk[j][2], dk[j][3]);
        *reinterpret_cast<float4*>(mine + 512 * (kDT + j)) = make_float4(dv[j][0], dv[j][1], dv[j][2], dv[j][3]);
    }
    if (!tail_count_last(p.tail_counters + tail, p.tail_pieces, T::kBarEpilogue, 128 * T::kNMma, w == 0 && ctid == 0))
        return false;
#pragma unroll
    for (int j = 0; j < kDT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[j][e] = dv[j][e] = 0.f;
#pragma unroll 1
    for (int piece = 0; piece < p.tail_pieces; ++piece) {
        const float* src = slot(piece);
#pragma unroll
        for (int j = 0; j < kDT; ++j) {
            const float4 a = __ldcg(reinterpret_cast<const float4*>(src + 512 * j));
            const float4 b = __ldcg(reinterpret_cast<const float4*>(src + 512 * (kDT + j)));
            dk[j][0] += a.x, dk[j][1] += a.y, dk[j][2] += a.z, dk[j][3] += a.w;
            dv[j][0] += b.x, dv[j][1] += b.y, dv[j][2] += b.z, dv[j][3] += b.w;
        }
    }
    return true;
}

// The MMA warpgroups (head dims 64 / 128): warpgroup w owns keys [64 w, 64 w + 64) of each 128-key tile.
// kW: the warpgroup, fixed at compile time (T::kSplitRegs), or -1: from the thread index.
template <class T, int kW = -1> __device__ __forceinline__ void flash_bwd_sm90_mma(const BwdSm90Params& params,
                                                                                const BwdSm90Smem<T>& sm) {
    const BwdParams& p = params.bwd;
    const FwdParams& f = p.fwd;
    constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN, kNT = T::kNT, kDT = T::kDT, kStages = T::kStages;
    constexpr int kHeadDim = T::kHeadDim;
    using TileKV = typename T::TileKV;
    using TileS = typename T::TileS;
    const int tid = threadIdx.x, lane = tid % 32;
    const int wg = warp_uniform(tid / 128);
    const int w = kW >= 0 ? kW : wg - 1;         // keys [64 w, 64 w + 64) of the block
    const int ctid = tid - 128 * wg, wwarp = ctid / 32;
    const int g = lane >> 2, t = lane & 3;
    const int key_row0 = 64 * w + 16 * wwarp;   // this warp's first key row inside the block (wgmma M rows)
    const bool lead_lane = lane == 0;
    const u32 sK_w0 = sm.sK + 64 * w * 128, sV_w0 = sm.sV + 64 * w * 128;  // the warpgroup's 64 rows of each column block
    DropoutRng rng = T::kIsDropout ? DropoutRng(f.rng_state, f.keep_threshold) : DropoutRng{};
    const u32 sdQ_warp = sm.sdQ + (w * 4 + wwarp) * T::kDqSliceBytes;

    float acc_dk[kDT][4], acc_dv[kDT][4];
    BwdTile x{};  // the tile being worked on
    // dQ: this warpgroup's 64 x 64 piece (mi, hj) of each query block (none for warpgroup 1 when there is one piece).
    const int mi = w / (kHeadDim / 64), hj = w % (kHeadDim / 64);
    // (80-query blocks: dQ^T, head-dim rows [64 w, 64 w + 64) x the block's 80 queries)
    float dq[T::kSwapDq ? kNT : T::kDqCols / 8][4];
    // kSwapDq: where this thread's dQ^T elements go in the staged tma_dq boxes (box hd_row / 32; element (query q,
    // column c) at 128 q + 16 ((c / 4) ^ (q % 8)) + 4 (c % 4)): elements e of n8 tile j (queries 8 j + 2 t + e % 2,
    // head-dim row hd_row + 8 (e / 2)) at dq_st[e] + 1024 j. Per store instruction the 32 lanes hit 32 banks.
    // kDqFrag: n8 tile j of this thread at dq_frag + 512 j (slice w * 4 + wwarp, float4 32 j + lane of it)
    const u32 dq_frag = sm.sdQ + ((w * 4 + wwarp) * kNT * 32 + lane) * 16;
    u32 dq_st[4];
    if constexpr (T::kSwapDq && !T::kDqFrag) {
        const int hd_row = 64 * w + 16 * wwarp + g, c = hd_row % 32;
        const u32 box = sm.sdQ + (hd_row / 32) * T::kDqBoxBytes;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int q = 2 * t + (e & 1), col = c + 8 * (e >> 1);
            dq_st[e] = box + 128 * q + 16 * ((col / 4) ^ q) + 4 * (col % 4);
        }
    }
    int dq_m0 = -1, dq_head = 0;  // deferred: the query block whose dQ piece is still in flight (-1: none)
    // This warp's slice of the block's dQ piece, in dq_accum's scrambled order (n8 tile j, lane l -> floats 128 j +
    // 4 l), to its staging area once the dQ writer has released it; the writer adds it to global memory.
    int dq_count = 0;
    // The previous tile's dK / dV TMA stores may still read their staging (the score tiles, the dQ slices): this
    // warpgroup's issuing thread waits for them before the warpgroup writes dS^T again.
    bool staged_out = false;
    bool dq_pending = false;  // kLateDq: this warp's slice is stored, not yet handed to the writer
    auto wait_dq_free = [&]() {  // before the staging area is written again (dQ slices, or dV over them)
        mbar_wait(sm.dq_empty, (dq_count & 1) ^ 1);
    };
    auto commit_dq = [&]() {
        fence_proxy_async();
        __syncwarp();
        if (lead_lane) mbar_arrive(T::kDqWriters == 2 && (dq_count & 1) ? sm.dq_full1 : sm.dq_full);
        ++dq_count;
    };
    auto write_dq = [&](int, int) {
        fence_operand(dq);
        wait_dq_free();  // (the first wait passes at once)
        if constexpr (T::kDqFrag) {
#pragma unroll
            for (int j = 0; j < kNT; ++j)
                asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(dq_frag + 512 * j), "f"(dq[j][0]),
                             "f"(dq[j][1]), "f"(dq[j][2]), "f"(dq[j][3])
                             : "memory");
        } else if constexpr (T::kSwapDq) {
#pragma unroll
            for (int j = 0; j < kNT; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    asm volatile("st.shared.f32 [%0], %1;" ::"r"(dq_st[e] + 1024 * j), "f"(dq[j][e]) : "memory");
        } else {
#pragma unroll
            for (int j = 0; j < T::kDqCols / 8; ++j)
                if (!T::kNarrowDq || w == 0)  // (kNarrowDq: n8 tiles 8.. to the second piece's slice of these rows)
                asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};"
                             ::"r"(sdQ_warp + (j < 8 ? 512 * j : 4 * T::kDqSliceBytes + 512 * (j - 8)) + 16 * lane),
                             "f"(dq[j][0]), "f"(dq[j][1]), "f"(dq[j][2]), "f"(dq[j][3])
                             : "memory");
        }
        if constexpr (T::kLateDq) dq_pending = true;
        else commit_dq();
    };
    auto flush_dq = [&]() {  // kLateDq: hand over the slice write_dq left pending
        if (T::kLateDq && dq_pending) {
            commit_dq();
            dq_pending = false;
        }
    };
    // kHidden: none of this warpgroup's keys is visible to the block (FT_BWD_SKIP_HIDDEN): only its zero dS^T and its
    // dQ piece
    bool kv_released = false;  // kKvReleaseLast: this tile's K / V released by its last query block
    int kvb = 0;       // the tile's K / V buffer (T::kKvStages)
    u32 kv_off = 0;    // ... its offset from buffer 0
    auto step = [&](const QueryBlockWalk<T>& walk, int gs, auto mask_tag, auto hidden_tag) {
        constexpr bool kMask = decltype(mask_tag)::value, kHidden = decltype(hidden_tag)::value;
        const int head = walk.head, m0 = walk.m0, n0 = x.n0, seqlen_q = x.seqlen_q, seqlen_k = x.seqlen_k;
        // gs: query blocks so far over every tile of the CTA
        const int s = FT_BWD_LEAN_ADDR ? (unsigned)gs % kStages : gs % kStages;
        const u32 sdS = sm.sdS0 + (gs & 1) * TileS::kBytes;
        // Shared-memory addresses re-derived per block (opaque to the compiler): hoisting the loop-invariant
        // descriptors out of the tile loop costs more registers than recomputing them (hd128 spills 452 -> 60 bytes,
        // 5-10% faster; H200 A/B 2026-11-24)
        u32 sK_w = sK_w0, sV_w = sV_w0, sK_all = sm.sK + (T::kSwapDq && FT_BWD_LEAN_ADDR ? w * kBlockN * 128 : 0);
        if constexpr (T::kKvStages > 1) sK_w += kv_off, sV_w += kv_off, sK_all += kv_off;
        u32 sQ_s = sm.sQ(s), sdO_s = sm.sdO(s);
        asm volatile("" : "+r"(sK_w), "+r"(sV_w), "+r"(sK_all), "+r"(sQ_s), "+r"(sdO_s));
        // kScoreMods: ALiBi's slope of this (batch, head) in raw score units (0: none), loaded while the GEMMs run
        [[maybe_unused]] float alibi_scaled = 0.f;
        if constexpr (T::kAlibi && !kHidden)
            if (f.alibi_slopes != nullptr)
                alibi_scaled = f.alibi_slopes[x.batch * f.alibi_batch_stride + head] / f.softmax_scale;
        mbar_wait(sm.full(s), (FT_BWD_LEAN_ADDR ? (unsigned)gs / kStages : gs / kStages) & 1);

        u32 dsa[kNT / 2][4];  // dS^T as A fragments
        // acc += A B over the block's queries: A (64 keys x queries) from registers, B (queries x head dim) = the
        // stage's Q or dO tile, MN-major
        auto rs_gemm = [&](float (&acc)[kDT][4], const u32 (&a)[kNT / 2][4], u32 b_tile) {
            fence_operand(acc);
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < kBlockM / 16; ++ks)
                wgmma_rs<T::kHeadDimEff, T::kIsBF16>(acc, a[ks], bdesc<0>(b_tile, ks * 16 * 128, kBlockM * 128, 1024),
                                                     1);
            wgmma_commit();
        };
        auto dk_gemm = [&]() { rs_gemm(acc_dk, dsa, sQ_s); };  // dK_w += dS^T Q
        // dS^T rows of this warp to the shared tile (rows keys, columns queries) for dQ = dS K.
        // One stmatrix per 16 x 16 piece (lane l addresses row l % 8 (+ 8 for matrices 1, 3) at columns 16 ks (+ 8 for
        // matrices 2, 3)) instead of four 4-byte stores: hd64 1.00-1.09x, hd128 0.97-1.06x (H200, same process).
        auto store_ds = [&]() {
            if (T::kTmaStoreDkv && staged_out) {
                if (ctid == 0) bulk_wait_read<0>();
                named_bar_sync(T::kBarEpilogue + 1 + w, 128);
                staged_out = false;
            }
#pragma unroll
            for (int ks = 0; ks < kBlockM / 16; ++ks) {
                if constexpr (T::kSwapDq)  // dS (rows queries): each 8 x 8 matrix transposed
                    stmatrix_x4_trans(FT_BWD_LEAN_ADDR ? TileS::addr_split(sdS, 16 * ks + 8 * (lane / 16), lane % 8,
                                                                            key_row0 + 8 * ((lane / 8) & 1))
                                                       : TileS::addr(sdS, 16 * ks + lane % 8 + 8 * (lane / 16),
                                                                     key_row0 + 8 * ((lane / 8) & 1)), dsa[ks]);
                else
                    stmatrix_x4(TileS::addr(sdS, key_row0 + lane % 8 + 8 * ((lane / 8) & 1), 16 * ks + 8 * (lane / 16)),
                                dsa[ks]);
            }
        };
        if constexpr (kHidden) {
            flush_dq();  // the previous block's dQ slice
#pragma unroll
            for (int ks = 0; ks < kNT / 2; ++ks) dsa[ks][0] = dsa[ks][1] = dsa[ks][2] = dsa[ks][3] = 0u;
            store_ds();
        } else {
            // S^T = K_w Q^T, then dP^T = V_w dO^T: kHeadDimEff / 16 k-steps each, step kk reads 16 columns of block
            // kk / 4.
            float st[kNT][4], dpt[kNT][4];
            // lse of the first kStatsAhead n8 tiles (lse_r[j]: tile j's pair; registers only while live)
            float lse_r[kNT][2];
            // lse pair of n8 tile j at stats_t + 32 j, D's at + kDOff: opaque, so that the offsets stay adds (LDS
            // immediates) instead of ORs into a register per pair (the compiler knows the base's alignment)
            u32 stats_t = sm.sLse(s) + 8 * t;
            auto load_first_lse = [&]() {  // before the S^T GEMM's issue (kStatsEarly) or after both GEMMs'
                if (FT_BWD_LEAN_ADDR) asm volatile("" : "+r"(stats_t));
#pragma unroll
                for (int j = 0; j < T::kStatsAhead && j < kNT; ++j) ld_stats2(stats_t + 32 * j, lse_r[j]);
            };
            constexpr u32 kDOff = T::kStages * T::kStatsBytes;  // sD(s) - sLse(s)
            if constexpr (T::kBiasS) {  // S^T accumulated onto the lse term (kBiasS), dP^T onto D (kBiasD)
                if (FT_BWD_LEAN_ADDR) asm volatile("" : "+r"(stats_t));
#pragma unroll
                for (int j = 0; j < kNT; ++j) ld_stats_acc(stats_t + 32 * j, st[j]);
                if constexpr (T::kBiasD)  // (-D: the preprocess negates D with the lse term)
#pragma unroll
                    for (int j = 0; j < kNT; ++j) ld_stats_acc(stats_t + kDOff + 32 * j, dpt[j]);
            } else if constexpr (T::kStatsEarly) {
                load_first_lse();
            }
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < T::kHeadDimEff / 16; ++kk) {
                const u32 off_kv = (kk / 4) * kBlockN * 128 + (kk % 4) * 32;
                const u32 off_q = (kk / 4) * kBlockM * 128 + (kk % 4) * 32;
                wgmma_ss<kBlockM, T::kIsBF16>(st, bdesc<1>(sK_w, off_kv, 16, 1024),
                                              bdesc<2>(sQ_s, off_q, 16, 1024), T::kBiasS || kk > 0);
            }
            wgmma_commit();
            if constexpr (T::kStFirst) {  // S^T done before dP^T is issued (kStFirst)
                wgmma_wait<0>();
                fence_operand(st);
            }
            if (T::kDeferDq == 2 && dq_m0 >= 0) {  // the previous block's dQ piece (issued before S^T)
                wgmma_wait<1>();
                write_dq(dq_m0, dq_head);
                dq_m0 = -1;
                wgmma_fence();
            }
#pragma unroll
            for (int kk = 0; kk < T::kHeadDimEff / 16; ++kk) {
                const u32 off_kv = (kk / 4) * kBlockN * 128 + (kk % 4) * 32;
                const u32 off_q = (kk / 4) * kBlockM * 128 + (kk % 4) * 32;
                wgmma_ss<kBlockM, T::kIsBF16>(dpt, bdesc<3>(sV_w, off_kv, 16, 1024),
                                              bdesc<4>(sdO_s, off_q, 16, 1024), T::kBiasD || kk > 0);
            }
            wgmma_commit();
            flush_dq();  // the previous block's dQ slice, stored before these GEMMs were issued
            if (T::kDeferDq == 1 && dq_m0 >= 0) {  // the previous block's dQ piece (issued before these two GEMMs)
                wgmma_wait<2>();
                write_dq(dq_m0, dq_head);
                dq_m0 = -1;
            }
            if constexpr (!T::kStatsEarly && !T::kBiasS) load_first_lse();
            if constexpr (!T::kStFirst) {
                wgmma_wait<1>();  // S^T done (dP^T may still run)
                fence_operand(st);
            }

            // P^T (kept in st, fp32, for dS^T) and its A fragments (dropped and rescaled with dropout) for dV.
            // kScoreMods: softcap and ALiBi on S^T before the masks (the forward's order), each in a loop of its own
            // behind a uniform branch (nothing per element when unset); softcap's derivative 1 - tanh^2 is kept 16-bit
            // packed (dcap) for dS^T, which is rounded to 16 bits anyway. (Recovering it from the 16-bit P^T and lse
            // instead, log2 P = capped * scale_log2 - lse, saved the registers but lost precision where tanh
            // saturates -- dq 3x the error bound at softcap 0.5 -- and ran 0.65-0.7x as fast: H200, 2026-11-26.)
            u32 pa[kNT / 2][4];
            [[maybe_unused]] u32 dcap[T::kSoftcap ? kNT : 1][2];
            if constexpr (T::kSoftcap) {
                if (f.softcap_scale != 0.f) {
#pragma unroll
                    for (int j = 0; j < kNT; ++j) {
                        float dc[4];
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const float th = fast_tanh(st[j][e] * f.softcap_scale);
                            st[j][e] = f.softcap_unscale * th;
                            dc[e] = 1.f - th * th;
                        }
                        dcap[j][0] = pack2<T::kIsBF16>(dc[0], dc[1]);
                        dcap[j][1] = pack2<T::kIsBF16>(dc[2], dc[3]);
                    }
                }
            }
            // ALiBi: where every pair of the warp's 16 keys x kBlockM queries lies on one side of the diagonal (with
            // causal masking every visible pair does), -slope |d| = -sg slope d with d = d0 + 8 j + e % 2 - 8 (e / 2)
            // goes into the exponent's constant instead of the score: a per-lane term per key row (alibi_rk) plus one
            // per query column, folded into -lse per n8 tile (2 FFMA + 4 FADD per 4 scores instead of 4 FADD + 4
            // FFMA). Else per score, as utils.cuh apply_score_mods (d in fp32 from one conversion). Not in the softcap
            // variant (kSoftcap, the calls with softcap: the shifts' registers added spills, hd128 44 -> 52 bytes), nor
            // on the 80-query tiles (kSwapDq: ptxas serialized the wgmmas, C7512).
            constexpr bool kAlibiRows = T::kAlibi && !T::kSoftcap && !T::kSwapDq;
            [[maybe_unused]] bool alibi_rows = false;
            [[maybe_unused]] float alibi_b = 0.f, alibi_rk[2] = {0.f, 0.f};
            if constexpr (T::kAlibi) {
                if (alibi_scaled != 0.f) {
                    const int offset = seqlen_k - seqlen_q, key0 = n0 + key_row0;
                    const float d0 = (float)(m0 + 2 * t + offset - (key0 + g));
                    const float sg = T::kIsCausal || m0 + offset - (key0 + 15) >= 0 ? 1.f
                                     : m0 + kBlockM - 1 + offset - key0 <= 0   ? -1.f
                                                                               : 0.f;
                    if (kAlibiRows && sg != 0.f) {
                        alibi_rows = true;
                        alibi_b = -sg * alibi_scaled * f.softmax_scale_log2;
                        alibi_rk[0] = alibi_b * d0;
                        alibi_rk[1] = alibi_b * (d0 - 8.f);
                    } else {
#pragma unroll
                        for (int j = 0; j < kNT; ++j)
#pragma unroll
                            for (int e = 0; e < 4; ++e)
                                st[j][e] = fmaf(-alibi_scaled, fabsf(d0 + (float)(8 * j + (e & 1) - 8 * (e >> 1))),
                                                st[j][e]);
                    }
                }
            }
            u32 keep_bits[(kNT * 4 + 31) / 32];
#pragma unroll
            for (int i = 0; i < (kNT * 4 + 31) / 32; ++i) keep_bits[i] = 0;
            u32 qbits[2][2];  // dropout: the keep words of the current 16-query tile (DropoutRng::bits_transposed)
            // rows_tag: ALiBi by rows (alibi_rows), chosen once for the block. (A branch per n8 tile split the
            // exponentials into a basic block each, which ptxas scheduled one at a time; H200, interleaved CUDA-graph
            // A/B, backward of a causal window, this form / that: hd64 16K window 256 1.031, hd128 16K window 1024
            // 1.001.)
            auto exponentials = [&](auto rows_tag) {
                [[maybe_unused]] constexpr bool kRowsShift = decltype(rows_tag)::value;
#pragma unroll
                for (int j = 0; j < kNT; ++j) {
                    if (T::kIsDropout && j % 2 == 0) {
                        const int bh = x.batch * f.nheads + head;
                        rng.bits_transposed(qbits, bh, m0 + 8 * j + 2 * t, n0 + key_row0 + g, lane);
                    }
                    if (!T::kBiasS && j + T::kStatsAhead < kNT)
                        ld_stats2(stats_t + 32 * (j + T::kStatsAhead), lse_r[j + T::kStatsAhead]);
                    [[maybe_unused]] const float(&lse)[2] = lse_r[j];  // (not read with kBiasS)
                    [[maybe_unused]] float shift[4];  // ALiBi by rows: the exponent's constant per score
                    if constexpr (kAlibiRows) {
                        if constexpr (kRowsShift) {
                            const float c0 = fmaf(alibi_b, (float)(8 * j), -lse[0]);
                            const float c1 = fmaf(alibi_b, (float)(8 * j + 1), -lse[1]);
                            shift[0] = c0 + alibi_rk[0];
                            shift[1] = c1 + alibi_rk[0];
                            shift[2] = c0 + alibi_rk[1];
                            shift[3] = c1 + alibi_rk[1];
                        } else {
#pragma unroll
                            for (int e = 0; e < 4; ++e) shift[e] = -lse[e & 1];
                        }
                    }
                    float dropped[4];
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        float score = st[j][e];
                        if constexpr (kMask) {
                            const int key = n0 + key_row0 + g + 8 * (e >> 1);
                            const int query = m0 + 8 * j + 2 * t + (e & 1);
                            if (key >= seqlen_k || (T::kIsCausal && key > query + seqlen_k - seqlen_q))
                                score = -infinity();
                            // the window's bounds (causal: the right one is the diagonal)
                            if constexpr (T::kScoreMods) {
                                const int diag = query + seqlen_k - seqlen_q;
                                if ((!T::kIsCausal && f.window_right >= 0 && key > diag + f.window_right) ||
                                    (f.window_left >= 0 && key < diag - f.window_left))
                                    score = -infinity();
                            }
                            // kMaskMod: the expression on a partial state (pairs past either end never evaluated)
                            if constexpr (T::kMaskMod)
                                if (walk.mm_state == 1 && key < seqlen_k && query < seqlen_q &&
                                    !mask_mod_visible(f.mm, x.batch, head, query, key))
                                    score = -infinity();
                        }
                        if constexpr (kAlibiRows)
                            st[j][e] = fast_exp2(fmaf(score, f.softmax_scale_log2, shift[e]));
                        else if constexpr (T::kBiasS)
                            st[j][e] = fast_exp2(score * f.softmax_scale_log2);
                        else st[j][e] = fast_exp2(score * f.softmax_scale_log2 - lse[e & 1]);
                        dropped[e] = st[j][e];
                        // dropout: element (query 8j + 2t + e % 2, key g + 8 (e / 2)) of the tile
                        if constexpr (T::kIsDropout) {
                            const bool keep = rng.keep16(qbits[e & 1][j & 1], e >> 1);
                            if (keep) keep_bits[(4 * j + e) / 32] |= 1u << ((4 * j + e) % 32);
                            dropped[e] = keep ? dropped[e] * f.rp_dropout : 0.f;
                        }
                    }
                    // A fragment of k-step j / 2: regs 0, 1 from n8 tile 2 (j / 2), regs 2, 3 from tile 2 (j / 2) + 1
                    pa[j / 2][2 * (j % 2)] = pack2<T::kIsBF16>(dropped[0], dropped[1]);
                    pa[j / 2][2 * (j % 2) + 1] = pack2<T::kIsBF16>(dropped[2], dropped[3]);
                }
            };
            if constexpr (kAlibiRows) {
                if (alibi_rows) exponentials(BoolConstant<true>{});
                else exponentials(BoolConstant<false>{});
            } else {
                exponentials(BoolConstant<false>{});
            }

            rs_gemm(acc_dv, pa, sdO_s);  // dV_w += P^T dO (rows of dO = queries, the reduction)
            float d_r[kNT][2];  // D of the first kStatsAhead n8 tiles, as lse above (not with kBiasD)
            if constexpr (!T::kBiasD)
#pragma unroll
                for (int j = 0; j < T::kStatsAhead && j < kNT; ++j) ld_stats2(stats_t + kDOff + 32 * j, d_r[j]);
            // dP^T done; dV may still run unless its P^T registers are needed for dS^T (128-query blocks: ptxas keeps
            // the A fragments of an unfinished wgmma alive, and 64 more live registers would spill)
            if constexpr (T::kWaitDv) wgmma_wait<0>();
            else wgmma_wait<1>();
            fence_operand(dpt);

            // dS^T = P^T (dP^T - D) (with dropout: dP^T of the kept entries / (1 - p)), A fragments and shared dS^T.
#pragma unroll
            for (int j = 0; j < kNT; ++j) {
                if (!T::kBiasD && j + T::kStatsAhead < kNT)
                    ld_stats2(stats_t + kDOff + 32 * (j + T::kStatsAhead), d_r[j + T::kStatsAhead]);
                [[maybe_unused]] const float(&dsum)[2] = d_r[j];  // (not read with kBiasD)
                float ds[4], pt[4];
                if constexpr (T::kDsFromPa) {
                    unpack2<T::kIsBF16>(pa[j / 2][2 * (j % 2)], pt[0], pt[1]);
                    unpack2<T::kIsBF16>(pa[j / 2][2 * (j % 2) + 1], pt[2], pt[3]);
                } else {
#pragma unroll
                    for (int e = 0; e < 4; ++e) pt[e] = st[j][e];
                }
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float dp = dpt[j][e];
                    if constexpr (T::kIsDropout)
                        dp = (keep_bits[(4 * j + e) / 32] >> ((4 * j + e) % 32)) & 1 ? dp * f.rp_dropout : 0.f;
                    if constexpr (T::kBiasD) ds[e] = pt[e] * dp;  // (dpt started at -D)
                    else if constexpr (T::kBiasS) ds[e] = pt[e] * (dp + dsum[e & 1]);  // (-D with the lse term)
                    else ds[e] = pt[e] * (dp - dsum[e & 1]);
                }
                if constexpr (T::kSoftcap) {  // softcap: d(capped) / d(score) = 1 - tanh^2
                    if (f.softcap_scale != 0.f) {
                        float dc[4];
                        unpack2<T::kIsBF16>(dcap[j][0], dc[0], dc[1]);
                        unpack2<T::kIsBF16>(dcap[j][1], dc[2], dc[3]);
#pragma unroll
                        for (int e = 0; e < 4; ++e) ds[e] *= dc[e];
                    }
                }
                dsa[j / 2][2 * (j % 2)] = pack2<T::kIsBF16>(ds[0], ds[1]);
                dsa[j / 2][2 * (j % 2) + 1] = pack2<T::kIsBF16>(ds[2], ds[3]);
            }
            if constexpr (T::kDsFirst) store_ds();
            if constexpr (!T::kDqFirst) dk_gemm();
            if constexpr (!T::kDsFirst) store_ds();

        }
        fence_proxy_async();
        named_bar_sync(T::kBarDs, 128 * T::kNMma);  // both warpgroups' dS^T rows stored

        // dQ(block) piece of this warpgroup = dS K: A = dS (dS^T in shared memory: M-major), B = K (MN-major).
        // 80-query blocks: dQ^T rows [64 w, 64 w + 64) = K^T dS^T: A = K^T (MN-major), B = dS^T (dS: K-major).
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kBlockN / 16; ++ks) {
            if constexpr (T::kSwapDq) {
                const u64 desc_a = bdesc<5>(sK_all, (FT_BWD_LEAN_ADDR ? 0 : w * kBlockN * 128) + ks * 16 * 128,
                                            kBlockN * 128, 1024);
                const u64 desc_b = bdesc<6>(sdS, (ks / 4) * kBlockM * 128 + (ks % 4) * 32, 16, 1024);
                if (ks == 0) wgmma_ss_tn_init<kBlockM, T::kIsBF16>(dq, desc_a, desc_b, 0);
                else wgmma_ss_tn<kBlockM, T::kIsBF16>(dq, desc_a, desc_b, 1);
            } else {
                const u64 desc_a = bdesc<7>(sdS, mi * kBlockN * 128 + ks * 16 * 128, kBlockN * 128, 1024);
                const u64 desc_b = bdesc<8>(sK_all, hj * kBlockN * 128 + ks * 16 * 128, kBlockN * 128, 1024);
                if (!T::kNarrowDq || w == 0) {  // (kNarrowDq: warpgroup 0's whole dQ, hj = 0)
                    if (ks == 0) wgmma_ss_tt_init<T::kDqCols, T::kIsBF16>(dq, desc_a, desc_b, 0);  // old values dead
                    else wgmma_ss_tt<T::kDqCols, T::kIsBF16>(dq, desc_a, desc_b, 1);
                }
            }
        }
        wgmma_commit();
        if constexpr (T::kDqFirst && !kHidden) {
            dk_gemm();
            wgmma_wait<1>();  // dV and dQ done (dK may still run)
            if constexpr (T::kKvReleaseLast) {
                if (walk.it + 1 >= walk.n_iters) {  // the tile's last query block: K / V are read no more
                    __syncwarp();
                    if (lead_lane) mbar_arrive(sm.kv_empty(kvb));
                    kv_released = true;
                }
            }
            write_dq(m0, head);
            wgmma_wait<0>();  // dK done: Q, dO, the statistics of stage s are free
            if (lead_lane) mbar_arrive(sm.empty(s));
            return;
        }
        wgmma_wait<1>();  // dV and dK done (dQ may still run): Q, dO, the statistics of stage s are free
        if (lead_lane) mbar_arrive(sm.empty(s));
        if constexpr (T::kDeferDq != 0) {  // finished after the next block's GEMMs are issued
            dq_m0 = m0, dq_head = head;
        } else {
            wgmma_wait<0>();
            write_dq(m0, head);
        }
    };
    int gs = 0;
    for (int tile_iter = 0; sm.read_tile(tile_iter, x); ++tile_iter) {
        FT_TIMELINE_MARK(wg, tile_iter, 0);
        FT_TIMELINE_PUT(wg, tile_iter, 6, (unsigned long long)gs);
#pragma unroll
        for (int i = 0; i < kDT; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc_dk[i][j] = acc_dv[i][j] = 0.f;
        kv_released = false;
        kvb = sm.kv_buf(tile_iter), kv_off = kvb * sm.kKvBytes;
        mbar_wait(sm.kv_full(kvb), sm.kv_parity(tile_iter));
        FT_TIMELINE_MARK(wg, tile_iter, 1);
        // (FT_BWD_SKIP_HIDDEN) the warpgroup's first key, and the last one some row of a block ending at row m_end sees
        const int wg_key0 = x.n0 + 64 * w;
        const int offset = x.seqlen_k - x.seqlen_q;
        auto hidden = [&](int m0, int m_end) {
            bool none = wg_key0 >= x.seqlen_k || (T::kIsCausal && wg_key0 > m_end - 1 + offset);
            if constexpr (T::kScoreMods)  // every key before the window of the block's first row, or after its last's
                none = none || (f.window_left >= 0 && wg_key0 + 63 < m0 + offset - f.window_left) ||
                       (!T::kIsCausal && f.window_right >= 0 && wg_key0 > m_end - 1 + offset + f.window_right);
            return none;
        };
        auto needs_mask = [&](int m0, int mm_state) {
            bool mask = tile_needs_mask<T::kIsCausal, kBlockN>(m0, x.n0, x.seqlen_q, x.seqlen_k) ||
                        (T::kMaskMod && mm_state == 1);
            if constexpr (T::kScoreMods)  // some row's window starts inside the key block or ends before its end
                mask = mask || window_cuts_tile<T::kIsCausal, kBlockN>(m0, min_(x.seqlen_q, m0 + kBlockM) - 1, x.n0,
                                                                       offset, f.window_left, f.window_right);
            return mask;
        };
        for (QueryBlockWalk<T> walk(p, x); walk.has; walk.next(), ++gs) {
            if (needs_mask(walk.m0, walk.mm_state)) {
                if (T::kSkipHidden && hidden(walk.m0, walk.m0 + kBlockM))
                    step(walk, gs, BoolConstant<true>{}, BoolConstant<T::kSkipHidden>{});
                else
                    step(walk, gs, BoolConstant<true>{}, BoolConstant<false>{});
            } else {
                step(walk, gs, BoolConstant<false>{}, BoolConstant<false>{});
            }
        }
        if (T::kDeferDq && dq_m0 >= 0) {
            wgmma_wait<0>();
            write_dq(dq_m0, dq_head);
            dq_m0 = -1;
        }
        flush_dq();
        FT_TIMELINE_MARK(wg, tile_iter, 2);
        FT_TIMELINE_PUT(wg, tile_iter, 7, (unsigned long long)gs);
        // Epilogue (kEarlyKv: dK, dV staged outside K / V, TMA stores; see the traits). (Stores straight from the
        // accumulators, 4 bytes per row pair, with the next K / V copied meanwhile: 1-7% slower at S <= 4K, H200 A/B
        // 2026-11-24.)
        wgmma_wait<0>();
        fence_operand(acc_dk);
        fence_operand(acc_dv);
        // kTailSplit, a tail piece: its sums to tail_partials; the piece that completes the tile writes dK, dV, the
        // others go through the epilogue without its global stores (a `continue` here, as the GQA split's below, made
        // ptxas allocate the query-block loop differently: hd128 80-query unmasked step 450 -> 659 SASS instructions,
        // 41 spill instructions in the loop)
        bool write = true;
        if constexpr (T::kTailSplit) {
            if (x.piece >= 0) {
                if constexpr (T::kEarlyKv) {  // (K / V read no more: the next unit's copy need not wait for the sums)
                    __syncwarp();
                    if (lead_lane && !kv_released) mbar_arrive(sm.kv_empty(kvb));
                    kv_released = true;
                }
                write = tail_sum<T>(p, x, w, ctid, acc_dk, acc_dv);
            }
        }
        if (p.kv_splits > 1) {
            // GQA split: this tile's fp32 partial sums (dK unscaled) straight from the accumulators (8-byte pairs),
            // reduce-added into one zero-filled copy per gradient (H200, 8K 32/8 causal at batch 1 and 4K 16/2:
            // forward + backward 1.017x over a copy per split); deterministic calls write a copy per split, summed
            // in split order by the convert kernel. K / V are released at once.
            __syncwarp();
            if (lead_lane && !kv_released) mbar_arrive(sm.kv_empty(kvb));
            constexpr bool kReduce = !T::kIsDeterministic;  // one zero-filled copy, reduce-added in L2
            const i64 base = (kReduce ? 0 : x.split * p.dkv_split_stride) + x.batch * p.dkv_batch_stride +
                             x.head_kv * p.dkv_head_stride + (i64)(x.k_start + x.n0 + key_row0 + g) * p.dkv_cols + 2 * t;
            float* dk_part = p.dkv_accum + base;
            float* dv_part = p.dkv_accum + (kReduce ? 1 : p.kv_splits) * p.dkv_split_stride + base;
            const int rows_valid = x.seqlen_k - x.n0 - key_row0;
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                if (g + 8 * hf < rows_valid) {
#pragma unroll
                    for (int j = 0; j < kDT; ++j) {
                        const int offset = 8 * hf * p.dkv_cols + 8 * j;
                        if constexpr (kReduce) {
                            atomic_add2(dk_part + offset, acc_dk[j][2 * hf], acc_dk[j][2 * hf + 1]);
                            atomic_add2(dv_part + offset, acc_dv[j][2 * hf], acc_dv[j][2 * hf + 1]);
                        } else {
                            *reinterpret_cast<float2*>(dk_part + offset) = make_float2(acc_dk[j][2 * hf], acc_dk[j][2 * hf + 1]);
                            *reinterpret_cast<float2*>(dv_part + offset) = make_float2(acc_dv[j][2 * hf], acc_dv[j][2 * hf + 1]);
                        }
                    }
                }
            }
            continue;
        }
        u32 sdK = sm.sK, sdV = sm.sV;
        // the warpgroup's first row in the staging tiles (TileDk, TileDv; see the traits)
        const int srow = T::kSwapDq ? 0 : 64 * w;
        using TileDk = typename T::TileDk;
        using TileDv = typename T::TileDv;
        if constexpr (T::kEarlyKv) {
            // (each warp after its warpgroup's last GEMM: the K / V copy of the next tile overlaps this epilogue)
            __syncwarp();
            if (lead_lane && !kv_released) mbar_arrive(sm.kv_empty(kvb));
            if constexpr (T::kSwapDq) sdK = sm.sdS0 + w * (TileS::kBytes / 2), sdV = sm.sdQ + w * TileDv::kBytes;
            else sdK = sm.sdS0, sdV = sm.sdS0 + TileKV::kBytes;
            // (a tile without query blocks has written no dS^T, so nothing has waited for the last stores yet)
            if (T::kTmaStoreDkv && staged_out && ctid == 0) bulk_wait_read<0>();
        }
        // both warpgroups are done reading K (their dQ GEMMs) and the score tiles
        named_bar_sync(T::kBarEpilogue, 128 * T::kNMma);
        FT_TIMELINE_MARK(wg, tile_iter, 5);
        float(&dk1)[1][kDT][4] = *reinterpret_cast<float(*)[1][kDT][4]>(&acc_dk);
        float(&dv1)[1][kDT][4] = *reinterpret_cast<float(*)[1][kDT][4]>(&acc_dv);
        // dV staged over the dQ slices (head dim 128) once the dQ writer has taken the last ones
        constexpr bool kDvWaitsDq = T::kEarlyKv && 2 * TileKV::kBytes > 2 * TileS::kBytes;
        // (rows of this warpgroup only: the other warpgroup's next dS^T / dQ stores land in other bytes, or, dQ
        // slices over these dV rows, after the next block's dS^T barrier, which waits for this warpgroup)
        if (T::kTmaStoreDkv && (f.cu_seqlens_q == nullptr || x.seqlen_k - x.n0 - 64 * w >= 64)) {
            // TMA stores of the warpgroup's 64 rows of dK and dV (rows past a batch's sequence lie outside the maps;
            // a varlen sequence's partial last tile takes store_dkv_rows: its rows past the end are the next one's).
            // dK first, so that its staging and store overlap the dQ writer's last reduction.
            // (column blocks block_rows rows apart)
            auto store_rows = [&](const TmaDesc* desc, u32 tile, int block_rows) {
                if (ctid == 0 && write) {
                    const int row = x.k_start + x.n0 + 64 * w, batch = f.cu_seqlens_q != nullptr ? 0 : x.batch;
#pragma unroll
                    for (int cb = 0; cb < kHeadDim / 64; ++cb)
                        if (cb * 64 < T::kHeadDimEff)
                            tma_store_4d(desc, tile + cb * block_rows * 128 + srow * 128, cb * 64, row, x.head_kv,
                                         batch);
                }
            };
            store_acc<T::kIsBF16, TileDk>(sdK, dk1, srow + 16 * wwarp, 0, f.softmax_scale, lane);
            if constexpr (kDvWaitsDq) {
                fence_proxy_async();
                named_bar_sync(T::kBarEpilogue + 1 + w, 128);
                store_rows(&params.tma_dk, sdK, TileDk::kNumRows);
                wait_dq_free();
            }
            FT_TIMELINE_MARK(wg, tile_iter, 3);
            store_acc<T::kIsBF16, TileDv>(sdV, dv1, srow + 16 * wwarp, 0, 1.f, lane);
            fence_proxy_async();
            named_bar_sync(T::kBarEpilogue + 1 + w, 128);
            if constexpr (!kDvWaitsDq) store_rows(&params.tma_dk, sdK, TileDk::kNumRows);
            store_rows(&params.tma_dv, sdV, TileDv::kNumRows);
            if (ctid == 0) bulk_commit();
            staged_out = true;
        } else {
            if constexpr (kDvWaitsDq) wait_dq_free();
            FT_TIMELINE_MARK(wg, tile_iter, 3);
            store_acc<T::kIsBF16, TileDk>(sdK, dk1, srow + 16 * wwarp, 0, f.softmax_scale, lane);
            store_acc<T::kIsBF16, TileDv>(sdV, dv1, srow + 16 * wwarp, 0, 1.f, lane);
            named_bar_sync(T::kBarEpilogue + 1 + w, 128);
            if (write) store_dkv_rows<T, 64, T::kHeadDimEff>(p, sdK, sdV, x, 64 * w, ctid, srow);
        }
        if constexpr (!T::kEarlyKv) {
            __syncwarp();
            if (lead_lane && !kv_released) mbar_arrive(sm.kv_empty(kvb));  // (this warp's reads of K / V are done)
        }
        FT_TIMELINE_MARK(wg, tile_iter, 4);
    }
    if (T::kTmaStoreDkv && ctid == 0) bulk_wait<0>();  // the last dK / dV stores have read shared memory (and landed)
    FT_TIMELINE_END(wg);
}


// The MMA warpgroups at head dims 192 / 256 (T::kSplitHd). A warpgroup owning 64 keys would keep dK and dV for every
// head-dim column, 2 x 64 x 256 fp32 = 256 registers per thread at hd256. Here a tile is 64 keys, and per 64-query
// block (lo = columns [0, 128), hi = [128, head_dim))
//   warpgroup 0: S^T = K Q^T -> P^T (A fragments; the shared P^T tile for warpgroup 1) -> dV[:, lo] += P^T dO[:, lo];
//                dS^T from the shared tile -> dK[:, hi] += dS^T Q[:, hi]
//   warpgroup 1: dP^T = V dO^T; P^T from the shared tile -> dV[:, hi] += P^T dO[:, hi]; dS^T = P^T (dP^T - D) ->
//                A fragments and the shared dS^T tile -> dK[:, lo] += dS^T Q[:, lo]
// so each warpgroup accumulates head_dim columns of dK and dV together (96 or 128 registers). S^T and dP^T are
// m64n64 GEMMs with both operands in shared memory (4 KB per 32-cycle k-step, the SM's shared-memory bandwidth), run
// by the two warpgroups at the same time. dQ = dS K in 64 x 64 pieces (64-column blocks of K), even pieces on one
// warpgroup and odd on the other (hd192: swapped every other block), added to dq_accum from the registers with vector
// reductions (in convert_dq's scrambled order; a sequence's last block too, in padded rows). The shared P^T
// and dS^T tiles need one buffer each: warpgroup 0 stores the next P^T only after the dS^T barrier, which warpgroup 1
// reaches after reading this P^T, and warpgroup 1 stores the next dS^T only after the next P^T barrier, which
// warpgroup 0 reaches after its dQ GEMMs (the last readers of dS^T) are done.
// The 64-column piece of dQ that warpgroup w computes first (r = 0) or second (r = 1) in a query block, odd or not
// (>= kHeadDim / 64: none): hd256 pieces w and w + 2; hd192 pieces 0 and 2 on one warpgroup, 1 on the other, the
// warpgroups swapping every other block.
template <class T> __host__ __device__ constexpr int split_dq_piece(int r, int w, bool odd) {
    return 2 * r + ((w + (T::kHeadDim / 64 == 3 && odd)) & 1);
}

template <class T, int W>
__device__ __forceinline__ void flash_bwd_sm90_split_mma(const BwdSm90Params& params, const BwdSm90Smem<T>& sm) {
    const BwdParams& p = params.bwd;
    const FwdParams& f = p.fwd;
    constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN, kStages = T::kStages, kHeadDim = T::kHeadDim;
    constexpr int kNT = kBlockM / 8, kKS = kBlockM / 16, kCB = kHeadDim / 64;
    constexpr int kLo = 128, kHi = kHeadDim - kLo;
    constexpr int kDvCol = W == 0 ? 0 : kLo, kDvN = W == 0 ? kLo : kHi;  // this warpgroup's columns of dV, dK
    constexpr int kDkCol = W == 0 ? kLo : 0, kDkN = W == 0 ? kHi : kLo;
    using TileKV = typename T::TileKV;
    using TileS = typename T::TileS;
    const int tid = threadIdx.x, lane = tid % 32, ctid = tid % 128, wwarp = ctid / 32;
    const int g = lane >> 2, t = lane & 3;
    const int row0 = 16 * wwarp;  // this warp's first M row: keys of S^T, dP^T, dK, dV; queries of dQ
    const bool lead_lane = lane == 0;
    const u32 sP = sm.sdS0, sdS = sm.sdS0 + TileS::kBytes;
    // stmatrix / ldmatrix address of this lane for the 16 x 16 piece ks of the warp's rows of a score tile (lane l:
    // row l % 8 (+ 8 for matrices 1, 3), columns 16 ks (+ 8 for matrices 2, 3)): the registers are A fragments
    auto frag_addr = [&](u32 tile, int ks) {
        return TileS::addr(tile, row0 + lane % 8 + 8 * ((lane / 8) & 1), 16 * ks + 8 * (lane / 16));
    };
    float acc_dk[kDkN / 8][4], acc_dv[kDvN / 8][4];
    BwdTile x{};
    // A dQ piece (64-column block cb) of query block m0 of head `head` into dq_accum (this warp's 16 rows).
    auto add_dq = [&](float (&dq)[8][4], int m0, int head, int cb) {
        fence_operand(dq);
        // (a sequence's last block too: its rows past the end are padding, and add zeros). x.q_pad recomputed: read
        // from x, the field stayed in a register through the loop (ptxas spills at hd256 112 -> 164 bytes).
        const int q_pad = padded_row_start(f.cu_seqlens_q != nullptr, x.batch, x.q_start, f.seqlen_q, kBlockM);
        float* dst = p.dq_accum + head * p.dqa_head_stride + (i64)(q_pad + m0 + row0) * kHeadDim +
                     cb * 64 * 16 + 4 * lane;
#pragma unroll
        for (int j = 0; j < 8; ++j) atomic_add4(dst + 128 * j, dq[j]);
    };

    // kOdd: hd192 swaps the warpgroups' dQ pieces on odd blocks (compile-time, so that ptxas sees every wgmma wait)
    auto step = [&](const QueryBlockWalk<T>& walk, int gs, auto mask_tag, auto odd_tag) {
        [[maybe_unused]] constexpr bool kMask = decltype(mask_tag)::value;
        constexpr bool kOdd = decltype(odd_tag)::value;
        const int head = walk.head, m0 = walk.m0;
        const int s = gs % kStages;
        u32 sK = sm.sK, sV = sm.sV, sQ_s = sm.sQ(s), sdO_s = sm.sdO(s);  // (opaque: see flash_bwd_sm90_mma)
        asm volatile("" : "+r"(sK), "+r"(sV), "+r"(sQ_s), "+r"(sdO_s));
        mbar_wait(sm.full(s), (gs / kStages) & 1);

        // S^T = K Q^T (warpgroup 0) or dP^T = V dO^T (warpgroup 1): kHeadDim / 16 k-steps over 64-column blocks
        float sdp[kNT][4];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 16; ++kk) {
            const u32 off_kv = (kk / 4) * kBlockN * 128 + (kk % 4) * 32;
            const u32 off_q = (kk / 4) * kBlockM * 128 + (kk % 4) * 32;
            wgmma_ss<kBlockM, T::kIsBF16>(sdp, bdesc<9>(W == 0 ? sK : sV, off_kv, 16, 1024),
                                          bdesc<10>(W == 0 ? sQ_s : sdO_s, off_q, 16, 1024), kk > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        fence_operand(sdp);

        u32 pa[kKS][4], dsa[kKS][4];  // P^T and dS^T as A fragments (k-step ks: queries 16 ks ..)
        auto dv_gemm = [&]() {  // dV[:, cols] += P^T dO[:, cols]: B = dO, rows = queries (the reduction), MN-major
            fence_operand(acc_dv);
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < kKS; ++ks)
                wgmma_rs<kDvN, T::kIsBF16>(acc_dv, pa[ks],
                                           bdesc<11>(sdO_s, (kDvCol / 64) * kBlockM * 128 + ks * 16 * 128,
                                                     kBlockM * 128, 1024), 1);
            wgmma_commit();
        };
        if constexpr (W == 0) {
            // P^T = exp2(S^T scale - lse) (masked: 0)
#pragma unroll
            for (int j = 0; j < kNT; ++j) {
                float lse[2];
                ld_stats2(sm.sLse(s) + 4 * (8 * j + 2 * t), lse);
                float pt[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float score = sdp[j][e];
                    if constexpr (kMask) {
                        const int key = x.n0 + row0 + g + 8 * (e >> 1), query = m0 + 8 * j + 2 * t + (e & 1);
                        if (key >= x.seqlen_k || (T::kIsCausal && key > query + x.seqlen_k - x.seqlen_q))
                            score = -infinity();
                    }
                    pt[e] = fast_exp2(score * f.softmax_scale_log2 - lse[e & 1]);
                }
                pa[j / 2][2 * (j % 2)] = pack2<T::kIsBF16>(pt[0], pt[1]);
                pa[j / 2][2 * (j % 2) + 1] = pack2<T::kIsBF16>(pt[2], pt[3]);
            }
#pragma unroll
            for (int ks = 0; ks < kKS; ++ks) stmatrix_x4(frag_addr(sP, ks), pa[ks]);
            named_bar_arrive(T::kBarP, 256);  // P^T stored
            dv_gemm();
            named_bar_sync(T::kBarDs, 256);  // dS^T stored
#pragma unroll
            for (int ks = 0; ks < kKS; ++ks) ldmatrix_x4(dsa[ks], frag_addr(sdS, ks));
        } else {
            named_bar_sync(T::kBarP, 256);
#pragma unroll
            for (int ks = 0; ks < kKS; ++ks) ldmatrix_x4(pa[ks], frag_addr(sP, ks));
            dv_gemm();
            // dS^T = P^T (dP^T - D)
#pragma unroll
            for (int j = 0; j < kNT; ++j) {
                float dsum[2];
                ld_stats2(sm.sD(s) + 4 * (8 * j + 2 * t), dsum);
                float pt[4], ds[4];
                unpack2<T::kIsBF16>(pa[j / 2][2 * (j % 2)], pt[0], pt[1]);
                unpack2<T::kIsBF16>(pa[j / 2][2 * (j % 2) + 1], pt[2], pt[3]);
#pragma unroll
                for (int e = 0; e < 4; ++e) ds[e] = pt[e] * (sdp[j][e] - dsum[e & 1]);
                dsa[j / 2][2 * (j % 2)] = pack2<T::kIsBF16>(ds[0], ds[1]);
                dsa[j / 2][2 * (j % 2) + 1] = pack2<T::kIsBF16>(ds[2], ds[3]);
            }
#pragma unroll
            for (int ks = 0; ks < kKS; ++ks) stmatrix_x4(frag_addr(sdS, ks), dsa[ks]);
            fence_proxy_async();  // (the dQ GEMMs read dS^T through the async proxy)
            named_bar_sync(T::kBarDs, 256);
        }
        // dK[:, cols] += dS^T Q[:, cols]
        fence_operand(acc_dk);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kKS; ++ks)
            wgmma_rs<kDkN, T::kIsBF16>(acc_dk, dsa[ks],
                                       bdesc<12>(sQ_s, (kDkCol / 64) * kBlockM * 128 + ks * 16 * 128,
                                                 kBlockM * 128, 1024), 1);
        wgmma_commit();
        wgmma_wait<1>();  // dV done: its A fragments (P^T) are dead before the dQ accumulators are live

        // dQ pieces cb0 (and cb1) = dS K[:, 64 cb ..]: A = dS (dS^T in shared memory: M-major), B = K (MN-major).
        // (Adding the last piece once the next block's S^T / dP^T GEMM is issued: 0.89-0.95x, ptxas serializes the
        // wgmmas around the accumulators kept across blocks. Without the dQ adds at all the kernel would run 1.10-1.53x
        // as fast, with plain stores instead of reductions 1.02-1.06x: the cost is the 64 KB of dQ per block leaving
        // the SM, as much as the Q / dO it reads; more keys per tile would cut both.)
        constexpr int cb0 = split_dq_piece<T>(0, W, kOdd), cb1 = split_dq_piece<T>(1, W, kOdd);
        constexpr bool two = cb1 < kCB;
        float dq0[8][4], dq1[8][4];
        auto dq_gemm = [&](float (&dq)[8][4], int cb) {
#pragma unroll
            for (int ks = 0; ks < kBlockN / 16; ++ks) {
                const u64 desc_a = bdesc<13>(sdS, ks * 16 * 128, kBlockN * 128, 1024);
                const u64 desc_b = bdesc<14>(sK + cb * kBlockN * 128, ks * 16 * 128, kBlockN * 128, 1024);
                if (ks == 0) wgmma_ss_tt_init<64, T::kIsBF16>(dq, desc_a, desc_b, 0);
                else wgmma_ss_tt<64, T::kIsBF16>(dq, desc_a, desc_b, 1);
            }
            wgmma_commit();
        };
        wgmma_fence();
        dq_gemm(dq0, cb0);
        if constexpr (two) dq_gemm(dq1, cb1);
        if constexpr (two) wgmma_wait<2>();
        else wgmma_wait<1>();
        if (lead_lane) mbar_arrive(sm.empty(s));  // dK done: Q, dO, the statistics of stage s are free
        if constexpr (two) {
            wgmma_wait<1>();
            add_dq(dq0, m0, head, cb0);
            wgmma_wait<0>();
            add_dq(dq1, m0, head, cb1);
        } else {
            wgmma_wait<0>();
            add_dq(dq0, m0, head, cb0);
        }
    };

    int gs = 0;
    for (int tile_iter = 0; sm.read_tile(tile_iter, x); ++tile_iter) {
#pragma unroll
        for (int i = 0; i < kDkN / 8; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc_dk[i][j] = 0.f;
#pragma unroll
        for (int i = 0; i < kDvN / 8; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc_dv[i][j] = 0.f;
        mbar_wait(sm.full_kv, tile_iter & 1);
        for (QueryBlockWalk<T> walk(p, x); walk.has; walk.next(), ++gs) {
            auto masked = [&](auto odd_tag) {
                if (tile_needs_mask<T::kIsCausal, kBlockN>(walk.m0, x.n0, x.seqlen_q, x.seqlen_k))
                    step(walk, gs, BoolConstant<true>{}, odd_tag);
                else
                    step(walk, gs, BoolConstant<false>{}, odd_tag);
            };
            if (kCB % 2 == 1 && gs % 2 == 1) masked(BoolConstant<true>{});
            else masked(BoolConstant<false>{});
        }
        wgmma_wait<0>();
        fence_operand(acc_dk);
        fence_operand(acc_dv);
        // GQA split: fp32 partial sums (dK unscaled), as flash_bwd_sm90_mma. (Not a helper shared with it: ptxas
        // then allocated the hd64 / hd128 kernels differently, and one call per gradient spilled 96 -> 308 B at hd256.)
        if (p.kv_splits > 1) {
            __syncwarp();
            if (lead_lane) mbar_arrive(sm.empty_kv);
            constexpr bool kReduce = !T::kIsDeterministic;  // one zero-filled copy, reduce-added in L2
            const i64 base = (kReduce ? 0 : x.split * p.dkv_split_stride) + x.batch * p.dkv_batch_stride +
                             x.head_kv * p.dkv_head_stride + (i64)(x.k_start + x.n0 + row0 + g) * p.dkv_cols + 2 * t;
            float* dk_part = p.dkv_accum + base + kDkCol;
            float* dv_part = p.dkv_accum + (kReduce ? 1 : p.kv_splits) * p.dkv_split_stride + base + kDvCol;
            const int rows_valid = x.seqlen_k - x.n0 - row0;
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                if (g + 8 * hf < rows_valid) {
                    const int offset = 8 * hf * p.dkv_cols;
#pragma unroll
                    for (int j = 0; j < kDkN / 8; ++j) {
                        if constexpr (kReduce)
                            atomic_add2(dk_part + offset + 8 * j, acc_dk[j][2 * hf], acc_dk[j][2 * hf + 1]);
                        else
                            *reinterpret_cast<float2*>(dk_part + offset + 8 * j) =
                                make_float2(acc_dk[j][2 * hf], acc_dk[j][2 * hf + 1]);
                    }
#pragma unroll
                    for (int j = 0; j < kDvN / 8; ++j) {
                        if constexpr (kReduce)
                            atomic_add2(dv_part + offset + 8 * j, acc_dv[j][2 * hf], acc_dv[j][2 * hf + 1]);
                        else
                            *reinterpret_cast<float2*>(dv_part + offset + 8 * j) =
                                make_float2(acc_dv[j][2 * hf], acc_dv[j][2 * hf + 1]);
                    }
                }
            }
            continue;
        }
        // Epilogue: each warpgroup's columns of dK * scale and dV into the K / V tiles (both warpgroups done reading
        // them), then the same columns of every row to global memory with 16-byte stores. (Each warpgroup storing
        // half of the rows of every column instead needed a barrier of both warpgroups between the shared stores and
        // loads, which compute-sanitizer racecheck reported as hazards, 2026-11-25.)
        named_bar_sync(T::kBarEpilogue, 256);
        float(&dk1)[1][kDkN / 8][4] = *reinterpret_cast<float(*)[1][kDkN / 8][4]>(&acc_dk);
        float(&dv1)[1][kDvN / 8][4] = *reinterpret_cast<float(*)[1][kDvN / 8][4]>(&acc_dv);
        store_acc<T::kIsBF16, TileKV>(sm.sK, dk1, row0, kDkCol, f.softmax_scale, lane);
        store_acc<T::kIsBF16, TileKV>(sm.sV, dv1, row0, kDvCol, 1.f, lane);
        named_bar_sync(T::kBarEpilogue + 1 + W, 128);
        {
            const i64 row = x.k_start + x.n0;
            u16* dk = (u16*)p.dk + x.batch * p.dk_batch_stride + row * p.dk_row_stride + x.head_kv * p.dk_head_stride;
            u16* dv = (u16*)p.dv + x.batch * p.dv_batch_stride + row * p.dv_row_stride + x.head_kv * p.dv_head_stride;
            store_cols<T, kBlockN, kDkN>(sm.sK, dk, p.dk_row_stride, x.seqlen_k - x.n0, kDkCol, f.head_dim, ctid);
            store_cols<T, kBlockN, kDvN>(sm.sV, dv, p.dv_row_stride, x.seqlen_k - x.n0, kDvCol, f.head_dim, ctid);
        }
        __syncwarp();
        if (lead_lane) mbar_arrive(sm.empty_kv);
    }
}

// The MMA warpgroups at head dim 192 with 96-key tiles (T::kSplitKeys; build.py BWD_SM90_HD192_N96, default on; off:
// flash_bwd_sm90_split_mma's 64-key tiles, kept for A/Bs). The 64-key split kernel hands P^T from warpgroup 0 to 1 and
// dS^T from 1 to 0 in every query block (each waits for the other twice per block), and per 64 keys reads a 48 KB
// Q / dO stage and adds 48 KB of dQ. Here warpgroup w owns keys [48 w, 48 w + 48) of the 96-key tile and computes
// its own S and dP with the queries as M (FlashAttention-3 / 4's shape for this head dim: S not transposed, dK / dV
// transposed), so the warpgroups meet once per block, where dQ needs both halves of dS. Per 64-query block, for
// warpgroup w (n8: columns of an accumulator; queries 16 wwarp + g (+ 8) are this thread's rows):
//   S_w  = Q K_w^T, dP_w = dO V_w^T         m64n48k16 x 12 each, A = the stage's Q / dO (K-major), B = K_w / V_w
//                                            rows (K-major); S, dP 6 n8 tiles = 24 + 24 registers
//   P_w  = exp2(S_w scale - lse) (masked 0)  -> 16-bit A-fragment layout (12 registers) -> P_w^T into rows
//                                            [48 w, 48 w + 48) of the P^T tile (stmatrix .trans), kBarP + w
//   dV_w^T += dO^T P_w                       head-dim rows as M: 3 m64 tiles x 4 k-steps of m64n48k16, A = dO^T
//                                            (the stage's dO, MN-major), B = P_w^T rows (K-major); 72 registers
//   dS_w = P_w (dP_w - D)                    (P_w from its 16-bit values, as kDsFromPa) -> dS_w^T rows, kBarDs (both)
//   dQ[:, 96 w .. 96 w + 96) = dS K          all 96 keys: 6 k-steps of m64n96k16, A = dS^T (MN-major: the queries
//                                            contiguous), B = K (MN-major); 48 registers, in convert_dq's scrambled
//                                            order (column c of a 16-row group at float 16 c) a contiguous 6 KB per
//                                            warp: staged (12 st.shared.v4 per thread) and reduce-added into dq_accum
//                                            by one bulk copy the warp's lead lane issues (T::kSkStageDq; without it,
//                                            12 red.global.add.v4.f32 per thread from the registers)
//   dK_w^T += Q^T dS_w                       as dV; 72 registers
// With the queries as the rows of S / dP a thread needs the lse / D of its 2 rows only (4 shared loads per block,
// against 16 in the transposed split kernel). The dQ GEMM reads K as an MN-major B operand, and warpgroup 1's 96
// columns would start at column 96, inside a 64-column block of the 128-byte swizzle; so K (only K) is copied in
// 32-column boxes with the 64-byte swizzle (TileK, T::kKBoxCols; ops.py maps K so; descriptors with swizzle mode 2,
// 8-row groups 512 bytes apart, MN-major atoms of 32 columns kBlockN * 64 bytes apart): each warpgroup's columns start
// at block 3 w. dK is staged through K in that layout too. Every stmatrix .trans here (P^T, dS^T, dK, dV) writes 8
// consecutive rows at one logical 16-byte chunk per 8-lane phase: 8 distinct bank groups in both swizzles.
// Registers (240 per MMA thread, the producer on 24): dK^T, dV^T 144 for the whole tile; per block S + dP 48 and the
// 12 packed P values (S dies as it is packed), then dP + P + dS 48, then dQ 48 (S, dP dead): 192 + addresses.
// Shared memory (kSkStageDq): Q 2 stages and dO 1 x 24 KB (72 KB), K, V 36 KB each, the P^T and dS^T tiles (96 keys
// x 64 queries, 12 KB each), the 8 warps' dQ slices (48 KB), lse / D 1 KB, barriers 256 B, alignment 1 KB: 223,488 of
// 232,448 bytes. (Without kSkStageDq: dO 2 stages, P^T and dS^T double-buffered, no slices; the same total.)
// Ordering of the staged form's buffers (gs: the CTA's query-block count, the same walk in both warpgroups):
//   P^T, dS^T: before a warp stores its P^T rows at block gs it waits on mma_done's phase gs - 1, which every MMA warp
//     arrives on after its wait_group 0 at the end of block gs - 1: every reader of both tiles (dV^T, dK^T, both dQ
//     GEMMs) of the previous block is done. The readers of block gs wait for the writes as below (kBarP + w, kBarDs).
//   dO: the TMA thread copies block gs's once do_empty's phase gs - 1 completed (8 arrivals, each warp's after its
//     wait_group 1: dP and dV^T, dO's readers, are done); the warps wait on do_full before the dP GEMM. Q / lse / D
//     stay in stages (Q's last reader, dK^T, is the block's last GEMM).
//   dQ slice of a warp: written by its 32 lanes after the lead lane's bulk wait_group.read 0 (the previous block's
//     reduce-add has read it) and __syncwarp; proxy fence and __syncwarp before the lead lane's bulk reduce-add.
// Ordering of the register form's buffers (b = gs & 1):
//   P^T buffer b, rows of warpgroup w: written (stmatrix) by w's warps only, read only by w's dV^T GEMM. Before a
//     warp writes it at block gs, dV^T(gs - 2) -- its last reader, by all 4 warps' parts -- is done: every warp of w
//     waited for it (wait_group 0 at the end of block gs - 2) before it arrived at block gs - 1's dS^T barrier, which
//     the writing warp has passed. Its reader waits for the 4 warps' rows: proxy fence, then named barrier kBarP + w
//     (128 threads).
//   dS^T buffer b, rows of w: written by w's warps; read by w's dK^T GEMM (its rows) and both warpgroups' dQ GEMMs
//     (all 96 rows). Before a warp writes it at block gs, every warp of both warpgroups has waited for its dQ(gs - 2)
//     and dK^T(gs - 2) (wait_group 0) and then arrived at block gs - 1's dS^T barrier, which the writer has passed.
//     Its readers: proxy fence, then kBarDs (256 threads) after both warpgroups' rows are stored.
//   Q / dO / lse / D stage s: each of the 8 MMA warps arrives on empty(s) after its wait_group 0 (dK^T reads Q last,
//     dV^T dO; lse / D were loaded into registers), as in the other kernels.
//   K / V: after the tile's last block, kBarEpilogue (256: every warp's last dQ GEMM, the last reader of all of K,
//     and dP, of V, are waited for), then warpgroup w writes dK * scale and dV into its own 48 rows of K / V
//     (stmatrix .trans from the transposed accumulators), kBarEpilogue + 1 + w (128), 16-byte global stores of those
//     rows, and each warp arrives on empty_kv (8 arrivals) after its loads, before the producer copies the next K / V.
//   Every barrier is reached the same number of times by its participants: both warpgroups run the same walk with one
//   kBarDs per block (masked or not: each warpgroup decides masking for its own 48 keys) and one kBarEpilogue per tile.
// Static checks (register form, 2026-11-30, nvcc 13.0): the MMA warpgroups' code uses registers R0-R223 of their
// 240 and spills nothing (the kernel's 64-72 spilled bytes are the producer's, as in the 64-key kernel); a block is
// 473-475 SASS instructions per warpgroup unmasked, 548-551 masked (bf16; 54 wgmmas, 24 MUFU.EX2, 6 stmatrix, 12
// red.v4, 2 named barriers); benchmarks/probes/hd192_layout_model.py replays this function's offsets, descriptors
// and fragments on a model of shared memory and the canonical wgmma layouts against numpy. The staged form spills
// nothing between the first and last HGMMA either (the producer's 52-60 bytes).
// Not done (next steps): skipping a warpgroup whose 48 keys are all hidden from a block (causal diagonal: half the
// tiles have one such block), issuing the next block's S / dP before this block's dK^T is waited for.
template <class T, int W>
__device__ __forceinline__ void flash_bwd_sm90_split_keys_mma(const BwdSm90Params& params, const BwdSm90Smem<T>& sm) {
    const BwdParams& p = params.bwd;
    const FwdParams& f = p.fwd;
    constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN, kStages = T::kStages, kHeadDim = T::kHeadDim;
    constexpr int kKeys = kBlockN / 2;   // this warpgroup's keys [kKeys W, kKeys W + kKeys) of the tile
    constexpr int kNK = kKeys / 8;       // n8 tiles of S, dP (columns = keys), and of each m64 tile of dK^T, dV^T
    constexpr int kKP = kKeys / 16;      // 16-key pieces (A-fragment k-steps, stmatrix x4 pieces)
    constexpr int kMT = kHeadDim / 64;   // m64 tiles of dK^T, dV^T (rows = head-dim columns)
    constexpr int kKQ = kBlockM / 16;    // k-steps of dK^T, dV^T (queries)
    constexpr int kDqN = kHeadDim / 2;   // this warpgroup's dQ columns [kDqN W, kDqN W + kDqN)
    constexpr int kKB = T::kKBoxCols;    // K's column blocks (64-byte rows)
    static_assert(kKeys % 16 == 0 && kDqN % kKB == 0 && kKB == 32 && kBlockM == 64, "96-key tiles at head dim 192");
    static_assert(!T::kIsDeterministic && !T::kIsDropout && !T::kIsBlockSparse, "dense only");
    using TileK = typename T::TileK;
    using TileV = typename T::TileKV;
    using TileS = typename T::TileS;  // rows keys (96), columns queries (64)
    const int tid = threadIdx.x, lane = tid % 32, ctid = tid % 128, wwarp = ctid / 32;
    const int g = lane >> 2, t = lane & 3;
    const int row0 = 16 * wwarp;  // this warp's first M row: queries of S, dP, dQ; head-dim rows of an m64 tile of dK^T
    const bool lead_lane = lane == 0;
    // stmatrix .trans of a 16 x 16 A-fragment piece (rows: this warp's 16 rows from row0 -- queries, or head-dim
    // columns of an m64 tile --, columns: keys 16 kp .. of this warpgroup's) into a tile whose rows are keys: lane l
    // addresses key 16 kp + l % 8 + 8 (l / 16) (matrices 0, 1: the piece's first 8 keys; 2, 3: the next 8) at column
    // row0 + 8 ((l / 8) % 2) (matrices 1, 3: the piece's rows 8-15)
    const int st_key = kKeys * W + lane % 8 + 8 * (lane / 16), st_col = row0 + 8 * ((lane / 8) & 1);
    float acc_dk[kMT][kNK][4], acc_dv[kMT][kNK][4];  // dK^T, dV^T: rows head-dim columns, columns this warpgroup's keys
    BwdTile x{};
    // This warpgroup's dQ columns of query block m0 of head `head` into dq_accum (this warp's 16 rows): column c of the
    // 16-row group (64-column slice c / 64, its n8 tile (c % 64) / 8, lane l's float4 at 4 l) at float 16 c + 4 l.
    auto add_dq = [&](float (&dq)[kDqN / 8][4], int m0, int head) {
        fence_operand(dq);
        // (a sequence's last block too: its rows past the end are padding and add zeros; q_pad recomputed, as
        // flash_bwd_sm90_split_mma)
        const int q_pad = padded_row_start(f.cu_seqlens_q != nullptr, x.batch, x.q_start, f.seqlen_q, kBlockM);
        float* dst = p.dq_accum + head * p.dqa_head_stride + (i64)(q_pad + m0 + row0) * kHeadDim + 16 * kDqN * W +
                     4 * lane;
        if constexpr (T::kSkStageDq) {
            // this warp's 6 KB slice: the copy engine has read the previous block's (lead lane), then the 12 float4s
            // in dq_accum's order, then one bulk reduce-add
            const u32 slice = sm.sdQ + (4 * W + wwarp) * T::kSkDqSliceBytes;
            if (lead_lane) bulk_wait_read<0>();
            __syncwarp();
#pragma unroll
            for (int j = 0; j < kDqN / 8; ++j) st_shared_v4f(slice + (128 * j + 4 * lane) * 4, dq[j]);
            fence_proxy_async();
            __syncwarp();
            if (lead_lane) {
                // (the warp's base: dst less the lane's offset, the measured schedule; a base of its own made ptxas
                // emit 8 more instructions)
                bulk_reduce_add_f32(dst - 4 * lane, slice, T::kSkDqSliceBytes);
                bulk_commit();
            }
        } else {
#pragma unroll
            for (int j = 0; j < kDqN / 8; ++j) atomic_add4(dst + 128 * j, dq[j]);
        }
    };

    auto step = [&](const QueryBlockWalk<T>& walk, int gs, auto mask_tag) {
        constexpr bool kMask = decltype(mask_tag)::value;
        const int head = walk.head, m0 = walk.m0;
        const int s = gs % kStages;
        const u32 buf = T::kSkStageDq ? 0 : (gs & 1) * TileS::kBytes;
        // (opaque to the compiler, as in the other kernels: re-derived per block instead of kept across the loop)
        u32 sK = sm.sK, sV = sm.sV, sQ_s = sm.sQ(s), sdO_s = sm.sdO(T::kSkStageDq ? 0 : s), sP = sm.sdS0 + buf,
            sdS = sm.sdS0 + (T::kSkStageDq ? 1 : 2) * TileS::kBytes + buf;
        asm volatile("" : "+r"(sK), "+r"(sV), "+r"(sQ_s), "+r"(sdO_s), "+r"(sP), "+r"(sdS));
        mbar_wait(sm.full(s), (gs / kStages) & 1);

        // S_w = Q K_w^T, then dP_w = dO V_w^T: kHeadDim / 16 k-steps; Q / dO step kk in 64-column block kk / 4, K's
        // in 32-column block kk / 2 (64-byte swizzle), V's in block kk / 4
        float st[kNK][4], dpt[kNK][4];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 16; ++kk) {
            const u32 off_q = (kk / 4) * kBlockM * 128 + (kk % 4) * 32;
            const u32 off_k = (kk / (kKB / 16)) * kBlockN * kKB * 2 + kKeys * W * kKB * 2 + (kk % (kKB / 16)) * 32;
            wgmma_ss<kKeys, T::kIsBF16>(st, bdesc<15>(sQ_s, off_q, 16, 1024),
                                        bdesc<16, 2>(sK, off_k, 16, 8 * kKB * 2), kk > 0);
        }
        wgmma_commit();
        if constexpr (T::kSkStageDq) mbar_wait(sm.do_full(), gs & 1);
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 16; ++kk) {
            const u32 off_q = (kk / 4) * kBlockM * 128 + (kk % 4) * 32;
            const u32 off_v = (kk / 4) * kBlockN * 128 + kKeys * W * 128 + (kk % 4) * 32;
            wgmma_ss<kKeys, T::kIsBF16>(dpt, bdesc<17>(sdO_s, off_q, 16, 1024), bdesc<18>(sV, off_v, 16, 1024),
                                        kk > 0);
        }
        wgmma_commit();
        // lse of this thread's rows (queries row0 + g, + 8), loaded while the GEMMs run
        const u32 stat = sm.sLse(s) + 4 * (row0 + g);
        const float lse[2] = {ld_shared_f32(stat), ld_shared_f32(stat + 32)};
        wgmma_wait<1>();  // S done (dP may still run)
        fence_operand(st);

        // P_w = exp2(S_w scale - lse) (masked: 0), as A fragments (piece kp: keys 16 kp ..)
        u32 pa[kKP][4];
#pragma unroll
        for (int j = 0; j < kNK; ++j) {
            float pt[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float score = st[j][e];
                if constexpr (kMask) {
                    const int key = x.n0 + kKeys * W + 8 * j + 2 * t + (e & 1);
                    const int query = m0 + row0 + g + 8 * (e >> 1);
                    if (key >= x.seqlen_k || (T::kIsCausal && key > query + x.seqlen_k - x.seqlen_q))
                        score = -infinity();
                }
                pt[e] = fast_exp2(score * f.softmax_scale_log2 - lse[e >> 1]);
            }
            pa[j / 2][2 * (j % 2)] = pack2<T::kIsBF16>(pt[0], pt[1]);
            pa[j / 2][2 * (j % 2) + 1] = pack2<T::kIsBF16>(pt[2], pt[3]);
        }
        // P_w^T: this warpgroup's key rows of P^T buffer b (see the ordering above), then the 4 warps' rows are there
        // (kSkStageDq, one buffer each: once every MMA warp is done with the previous block's GEMMs)
        if (T::kSkStageDq && gs > 0) mbar_wait(sm.mma_done(), (gs - 1) & 1);
#pragma unroll
        for (int kp = 0; kp < kKP; ++kp) stmatrix_x4_trans(TileS::addr(sP, st_key + 16 * kp, st_col), pa[kp]);
        fence_proxy_async();
        named_bar_sync(T::kBarP + W, 128);

        // acc^T += X^T Y_w (dV^T: X = dO, Y = P; dK^T: X = Q, Y = dS): m64 tile i = head-dim columns [64 i, 64 i + 64)
        // (X's column block i, MN-major), k-step ks = queries [16 ks, 16 ks + 16) (B: 32 bytes into Y^T's rows of
        // this warpgroup's keys, K-major); first: the batch's first GEMMs (wgmma_fence after the operand fences)
        auto gemm_t = [&](float (&acc)[kMT][kNK][4], u32 x_tile, u32 yt_tile, bool first) {
#pragma unroll
            for (int i = 0; i < kMT; ++i) fence_operand(acc[i]);
            if (first) wgmma_fence();
#pragma unroll
            for (int i = 0; i < kMT; ++i)
#pragma unroll
                for (int ks = 0; ks < kKQ; ++ks)
                    wgmma_ss_tn<kKeys, T::kIsBF16>(acc[i],
                                                   bdesc<19>(x_tile, i * kBlockM * 128 + ks * 16 * 128,
                                                             kBlockM * 128, 1024),
                                                   bdesc<20>(yt_tile, kKeys * W * 128 + ks * 32, 16, 1024), 1);
        };
        // dV_w^T += dO^T P_w
        gemm_t(acc_dv, sdO_s, sP, true);
        wgmma_commit();
        const u32 stat_d = sm.sD(s) + 4 * (row0 + g);
        const float dsum[2] = {ld_shared_f32(stat_d), ld_shared_f32(stat_d + 32)};
        wgmma_wait<1>();  // dP done (dV^T may still run)
        fence_operand(dpt);

        // dS_w = P_w (dP_w - D), A fragments -> dS_w^T rows of dS^T buffer b
        u32 dsa[kKP][4];
#pragma unroll
        for (int j = 0; j < kNK; ++j) {
            float pt[4], ds[4];
            unpack2<T::kIsBF16>(pa[j / 2][2 * (j % 2)], pt[0], pt[1]);
            unpack2<T::kIsBF16>(pa[j / 2][2 * (j % 2) + 1], pt[2], pt[3]);
#pragma unroll
            for (int e = 0; e < 4; ++e) ds[e] = pt[e] * (dpt[j][e] - dsum[e >> 1]);
            dsa[j / 2][2 * (j % 2)] = pack2<T::kIsBF16>(ds[0], ds[1]);
            dsa[j / 2][2 * (j % 2) + 1] = pack2<T::kIsBF16>(ds[2], ds[3]);
        }
#pragma unroll
        for (int kp = 0; kp < kKP; ++kp) stmatrix_x4_trans(TileS::addr(sdS, st_key + 16 * kp, st_col), dsa[kp]);
        fence_proxy_async();  // (the GEMMs read dS^T through the async proxy)
        named_bar_sync(T::kBarDs, 256);  // both warpgroups' dS^T rows stored

        // dQ[:, kDqN W ..] = dS K over the 96 keys: k-step ks = keys [16 ks, 16 ks + 16); A = dS^T rows (the queries
        // contiguous: MN-major), B = K rows from column block kDqN W / kKB (MN-major, 32-column atoms kBlockN * 64
        // bytes apart, 8-row groups 512)
        float dq[kDqN / 8][4];
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kBlockN / 16; ++ks) {
            const u64 desc_a = bdesc<21>(sdS, ks * 16 * 128, kBlockN * 128, 1024);
            const u64 desc_b = bdesc<22, 2>(sK, (kDqN * W / kKB) * kBlockN * kKB * 2 + ks * 16 * kKB * 2,
                                            kBlockN * kKB * 2, 8 * kKB * 2);
            if (ks == 0) wgmma_ss_tt_init<kDqN, T::kIsBF16>(dq, desc_a, desc_b, 0);  // dq's old values are dead
            else wgmma_ss_tt<kDqN, T::kIsBF16>(dq, desc_a, desc_b, 1);
        }
        wgmma_commit();
        // dK_w^T += Q^T dS_w
        gemm_t(acc_dk, sQ_s, sdS, false);
        wgmma_commit();
        wgmma_wait<1>();  // dV^T and dQ done (dK^T may still run)
        if (T::kSkStageDq && lead_lane) mbar_arrive(sm.do_empty());  // (dO's readers: dP, dV^T)
        add_dq(dq, m0, head);
        wgmma_wait<0>();  // dK^T done: Q, dO, the statistics of stage s are free
        if (lead_lane) mbar_arrive(sm.empty(s));
        if (T::kSkStageDq && lead_lane) mbar_arrive(sm.mma_done());
    };

    int gs = 0;
    for (int tile_iter = 0; sm.read_tile(tile_iter, x); ++tile_iter) {
#pragma unroll
        for (int i = 0; i < kMT; ++i)
#pragma unroll
            for (int j = 0; j < kNK; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_dk[i][j][e] = acc_dv[i][j][e] = 0.f;
        mbar_wait(sm.full_kv, tile_iter & 1);
        for (QueryBlockWalk<T> walk(p, x); walk.has; walk.next(), ++gs) {
            // (this warpgroup's 48 keys: the other's may need the mask where these do not)
            if (tile_needs_mask<T::kIsCausal, kKeys>(walk.m0, x.n0 + kKeys * W, x.seqlen_q, x.seqlen_k))
                step(walk, gs, BoolConstant<true>{});
            else
                step(walk, gs, BoolConstant<false>{});
        }
        // (every step ended with wait_group 0)
#pragma unroll
        for (int i = 0; i < kMT; ++i) {
            fence_operand(acc_dk[i]);
            fence_operand(acc_dv[i]);
        }
        const int key0 = x.n0 + kKeys * W;  // this warpgroup's first key
        if (p.kv_splits > 1) {
            // GQA split: fp32 partial sums (dK unscaled) reduce-added into the zero-filled copy, as the other kernels;
            // the transposed accumulators' pairs are two keys of one column: 4-byte reductions. K / V released at once.
            __syncwarp();
            if (lead_lane) mbar_arrive(sm.empty_kv);
            const i64 base = x.batch * p.dkv_batch_stride + x.head_kv * p.dkv_head_stride +
                             (i64)(x.k_start + key0) * p.dkv_cols + row0 + g;
            float* dk_part = p.dkv_accum + base;
            float* dv_part = p.dkv_accum + p.dkv_split_stride + base;
            const int rows_valid = x.seqlen_k - key0;
#pragma unroll
            for (int j = 0; j < kNK; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = 8 * j + 2 * t + (e & 1);
                    if (key < rows_valid) {
#pragma unroll
                        for (int i = 0; i < kMT; ++i) {
                            const i64 at = (i64)key * p.dkv_cols + 64 * i + 8 * (e >> 1);
                            atomicAdd(dk_part + at, acc_dk[i][j][e]);
                            atomicAdd(dv_part + at, acc_dv[i][j][e]);
                        }
                    }
                }
            continue;
        }
        // Epilogue: both warpgroups done reading K (their dQ GEMMs) and V; this warpgroup's 48 rows of dK * scale and
        // dV into its rows of K / V (the accumulators transposed by stmatrix .trans: A-fragment pieces of 16 keys),
        // then those rows to global memory with 16-byte stores.
        named_bar_sync(T::kBarEpilogue, 256);
        // (addresses opaque here, so that ptxas derives them in the epilogue instead of keeping 18 per-thread
        // addresses from before the tile loop: those were spilled, 26 stores before the loop and loads here)
        u32 sK_e = sm.sK, sV_e = sm.sV;
        int e_key = st_key, e_col = st_col, e_tid = ctid;
        asm volatile("" : "+r"(sK_e), "+r"(sV_e), "+r"(e_key), "+r"(e_col), "+r"(e_tid));
#pragma unroll
        for (int i = 0; i < kMT; ++i)
#pragma unroll
            for (int kp = 0; kp < kKP; ++kp) {
                u32 a[4];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    a[2 * h] = pack2<T::kIsBF16>(acc_dk[i][2 * kp + h][0] * f.softmax_scale,
                                                 acc_dk[i][2 * kp + h][1] * f.softmax_scale);
                    a[2 * h + 1] = pack2<T::kIsBF16>(acc_dk[i][2 * kp + h][2] * f.softmax_scale,
                                                     acc_dk[i][2 * kp + h][3] * f.softmax_scale);
                }
                stmatrix_x4_trans(TileK::addr(sK_e, e_key + 16 * kp, 64 * i + e_col), a);
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    a[2 * h] = pack2<T::kIsBF16>(acc_dv[i][2 * kp + h][0], acc_dv[i][2 * kp + h][1]);
                    a[2 * h + 1] = pack2<T::kIsBF16>(acc_dv[i][2 * kp + h][2], acc_dv[i][2 * kp + h][3]);
                }
                stmatrix_x4_trans(TileV::addr(sV_e, e_key + 16 * kp, 64 * i + e_col), a);
            }
        named_bar_sync(T::kBarEpilogue + 1 + W, 128);
        {
            const i64 row = x.k_start + key0;
            u16* dk = (u16*)p.dk + x.batch * p.dk_batch_stride + row * p.dk_row_stride + x.head_kv * p.dk_head_stride;
            u16* dv = (u16*)p.dv + x.batch * p.dv_batch_stride + row * p.dv_row_stride + x.head_kv * p.dv_head_stride;
            const int rows_valid = x.seqlen_k - key0;
            constexpr int kChunksPerRow = kHeadDim / 8;
            static_assert(kKeys * kChunksPerRow % 128 == 0, "whole 16-byte chunks per thread");
#pragma unroll
            for (int it = 0; it < kKeys * kChunksPerRow / 128; ++it) {
                const int chunk = e_tid + it * 128, r = chunk / kChunksPerRow, col = (chunk % kChunksPerRow) * 8;
                if (r < rows_valid && col < f.head_dim) {
                    u32 v[4];
                    ld_shared_v4(TileK::addr(sK_e, kKeys * W + r, col), v);
                    st_global_v4(dk + r * p.dk_row_stride + col, v);
                    ld_shared_v4(TileV::addr(sV_e, kKeys * W + r, col), v);
                    st_global_v4(dv + r * p.dv_row_stride + col, v);
                }
            }
        }
        __syncwarp();
        if (lead_lane) mbar_arrive(sm.empty_kv);
    }
    // (kSkStageDq: the last block's reduce-add has read its slice before the CTA's shared memory goes away)
    if (T::kSkStageDq && lead_lane) bulk_wait<0>();
}

// kFusedDq: a query block of a head whose dQ the dQ writer has added (one key block's part): where it goes in dq
// and dq_accum (elements from their bases), its rows in the sequence (at most kBlockM), its count (BwdParams::
// dq_counts) and the count that completes it: the key blocks whose walk (QueryBlockWalk) visits it -- all of the
// sequence's, or (causal, bottom-right aligned) those whose first key lies at or before the block's last row's
// diagonal.
struct FdqBlock {
    i64 dq_off, acc_off;
    int rows, count_at, target;
};
template <class T>
__device__ __forceinline__ FdqBlock fdq_block(const BwdParams& p, const BwdTile& x, int head, int m0) {
    FdqBlock b;
    b.dq_off = x.batch * p.dq_batch_stride + head * p.dq_head_stride + (i64)(x.q_start + m0) * p.dq_row_stride;
    b.acc_off = head * p.dqa_head_stride + (i64)(x.q_pad + m0) * T::kHeadDim;
    b.rows = min_(x.seqlen_q - m0, T::kBlockM);
    b.count_at = head * p.dq_counts_head_stride + (x.q_pad + m0) / T::kBlockM;
    const int n_kblocks = ceil_div(x.seqlen_k, T::kBlockN);
    b.target = T::kIsCausal ? min_(n_kblocks, ceil_div(m0 + T::kBlockM + x.seqlen_k - x.seqlen_q, T::kBlockN))
                            : n_kblocks;
    return b;
}

template <class T> __device__ __forceinline__ void flash_bwd_sm90(const BwdSm90Params& params) {
    extern __shared__ __align__(128) unsigned char smem[];
    const BwdParams& p = params.bwd;
    const FwdParams& f = p.fwd;
    constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN, kStages = T::kStages, kHeadDim = T::kHeadDim;
    using TileQ = typename T::TileQ;
    using TileKV = typename T::TileKV;
    const int tid = threadIdx.x, lane = tid % 32;
    const int wg = warp_uniform(tid / 128);

    const BwdSm90Smem<T> sm(smem, p);
    const int n_kblocks = sm.n_kblocks;
    const int n_tiles = n_kblocks * f.batch * f.nheads_kv * p.kv_splits;
    const bool varlen = f.cu_seqlens_q != nullptr;  // varlen maps have one batch entry
    if (tid == 0) {
        if constexpr (T::kSkStageDq) {
            mbar_init(sm.do_full(), 1);
            mbar_init(sm.do_empty(), 4 * T::kNMma);
            mbar_init(sm.mma_done(), 4 * T::kNMma);
        } else {
            mbar_init(sm.dq_full, 4 * T::kNMma);  // one arrival per MMA warp (its slice is staged)
            if (T::kDqWriters == 2) mbar_init(sm.dq_full1, 4 * T::kNMma);
            mbar_init(sm.dq_empty, 1);            // the dQ writer (the copy engine has read the slices)
        }
#pragma unroll
        for (int b = 0; b < T::kKvStages; ++b) {
            mbar_init(sm.kv_full(b), 1);
            mbar_init(sm.kv_empty(b), 4 * T::kNMma);  // one arrival per MMA warp (its last GEMM reading K / V is done)
        }
        if (T::kAlignSlack == 0 && (smem_u32(smem) & 1023u) != 0) __trap();  // (the tiles' 128-byte swizzle)
        if constexpr (T::kFusedDq) {
#pragma unroll
            for (int i = 0; i < T::kFdqReqs; ++i) {
                mbar_init(sm.fdq_req_full(i), 1);   // the dQ writer's lane 0 (a request stored)
                mbar_init(sm.fdq_req_empty(i), T::kFdqConverters);  // the converters' lanes 0 (request read)
            }
#pragma unroll
            for (int i = 0; i < 2 * T::kFdqConverters; ++i)
                mbar_init(sm.fdq_chunk_full(i), 1);  // a converter's expect_tx arrival (its bulk copy)
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            mbar_init(sm.tile_full(i), 1);
            mbar_init(sm.tile_empty(i), sm.kTileReaders);
        }
#pragma unroll
        for (int s = 0; s < kStages; ++s) {
            mbar_init(sm.full(s), 1);  // the TMA thread's expect_tx arrival (Q, dO and the row statistics)
            mbar_init(sm.empty(s), 4 * T::kNMma);  // one arrival per MMA warp
        }
        mbar_fence_init();
        sm.init_heads();
    }
    __syncthreads();
    if (threadIdx.x == 0) FT_TIMELINE_START();
    // Launched programmatically after the preprocess (ops.py _Launch.pdl): lse_log2, softmax_d and the zeroed
    // dq_accum are its writes. Every thread waits for them here, the TMA thread once it has prefetched the tensor
    // maps. (Waiting only before the first statistics copy, or signalling the dq conversion when the producer runs out
    // of tiles, changed ptxas's allocation of the producer loops: more spills in the hd64 / hd128 kernels.)
    const bool tma_thread = tid == 0;
    if (!tma_thread) grid_dependency_wait();

    if (wg == 0) {
        // ------------------------------------------------------------------------------------------ producer
        setmaxnreg_dec<T::kProducerRegs>();
        const int warp = tid / 32;
        if (tma_thread) {
            tma_prefetch_desc(&params.tma_q);
            tma_prefetch_desc(&params.tma_do);
            tma_prefetch_desc(&params.tma_stats);
            grid_dependency_wait();
            // Persistent: units (bwd_unit_tile; without a tail split, tiles) gridDim.x .. n_units - 1 from the
            // counter, then one past the end per CTA (n_units fetches in all; the fetch of n_units - 1 is the
            // launch's last, so it resets the counter to 0).
            const int n_units = T::kTailSplit ? tail_units(n_tiles, p.tail_first, p.tail_pieces) : n_tiles;
            auto next_tile = [&](int tile) {
                if constexpr (!T::kPersistent) {
                    return n_units;
                } else {
                    const int fetched = atomic_fetch_add(params.tile_counter, 1);
                    if (fetched == n_units - 1) atomic_store(params.tile_counter, 0);
                    return fetched + (int)gridDim.x;
                }
            };
            int gs = 0, tile_iter = 0;  // query blocks and tiles so far: stages and phases of the rings
            BwdTile x;
            for (int tile = blockIdx.x;; tile = next_tile(tile)) {  // (tile: the unit)
                if (tile < n_units) {
                    const int tile_index = bwd_unit_tile<T>(p, tile, x);
                    if (!bwd_tile<T>(p, tile_index, n_kblocks, x)) continue;
                }
                const int slot = tile_iter & 1;
                mbar_wait(sm.tile_empty(slot), ((tile_iter >> 1) & 1) ^ 1);  // (the first two pass at once)
                sm.publish_tile(slot, tile < n_units ? tile : -1, x);
                mbar_arrive(sm.tile_full(slot));
                FT_TIMELINE_MARK(0, tile_iter, 2);
                if (tile >= n_units) break;
                const int batch_coord = varlen ? 0 : x.batch;
                // K / V once the MMA warps are done with the previous tile's (after this tile's first Q / dO copy,
                // which so overlaps the previous tile's last block); two buffers (kKvStages): before it, into the
                // buffer that the tile before the previous one has released
                bool kv_loaded = false;
                auto load_kv = [&]() {
                    const int kvb = sm.kv_buf(tile_iter);
                    const u32 kv_full = sm.kv_full(kvb), sK = sm.sK + kvb * sm.kKvBytes, sV = sm.sV + kvb * sm.kKvBytes;
                    mbar_wait(sm.kv_empty(kvb), sm.kv_parity(tile_iter) ^ 1);
                    mbar_arrive_expect_tx(kv_full, 2 * TileKV::kBytes);
                    if constexpr (T::kKBoxCols == 64) {
#pragma unroll
                        for (int cb = 0; cb < kHeadDim / 64; ++cb) {
                            tma_load_4d(sK + cb * kBlockN * 128, &params.tma_k, kv_full, cb * 64,
                                        x.k_start + x.n0, x.head_kv, batch_coord);
                            tma_load_4d(sV + cb * kBlockN * 128, &params.tma_v, kv_full, cb * 64,
                                        x.k_start + x.n0, x.head_kv, batch_coord);
                        }
                    } else {  // K in T::TileK's 32-column blocks (the K map's boxes: 32 columns, 64-byte swizzle)
                        constexpr int kKB = T::kKBoxCols;
#pragma unroll
                        for (int cb = 0; cb < kHeadDim / kKB; ++cb)
                            tma_load_4d(sK + cb * kBlockN * kKB * 2, &params.tma_k, kv_full, cb * kKB,
                                        x.k_start + x.n0, x.head_kv, batch_coord);
#pragma unroll
                        for (int cb = 0; cb < kHeadDim / 64; ++cb)
                            tma_load_4d(sV + cb * kBlockN * 128, &params.tma_v, kv_full, cb * 64,
                                        x.k_start + x.n0, x.head_kv, batch_coord);
                    }
                    kv_loaded = true;
                    FT_TIMELINE_MARK(0, tile_iter, 3);
                };
                if constexpr (T::kKvStages > 1) load_kv();
                const int q_pad = x.q_pad;
                sm.tile_heads(x);
                for (QueryBlockWalk<T> walk(p, x); walk.has;
                     walk.next(), ++gs) {
                    const int s = gs % kStages;
                    mbar_wait(sm.empty(s), ((gs / kStages) & 1) ^ 1);  // the first pass finds every stage empty
                    mbar_arrive_expect_tx(sm.full(s), (T::kSkStageDq ? 1 : 2) * TileQ::kBytes + 2 * T::kStatsBoxBytes);
#pragma unroll
                    for (int cb = 0; cb < kHeadDim / 64; ++cb) {
                        tma_load_4d(sm.sQ(s) + cb * kBlockM * 128, &params.tma_q, sm.full(s), cb * 64, x.q_start + walk.m0,
                                    walk.head, batch_coord);
                        if constexpr (!T::kSkStageDq)
                            tma_load_4d(sm.sdO(s) + cb * kBlockM * 128, &params.tma_do, sm.full(s), cb * 64,
                                        x.q_start + walk.m0, walk.head, batch_coord);
                    }
                    // the block's row statistics: a whole block of the padded rows (+inf / 0 past the end)
                    tma_load_4d(sm.sLse(s), &params.tma_stats, sm.full(s), q_pad + walk.m0, walk.head, 0, 0);
                    tma_load_4d(sm.sD(s), &params.tma_stats, sm.full(s), q_pad + walk.m0, f.nheads + walk.head, 0, 0);
                    if constexpr (T::kSkStageDq) {  // dO into its one buffer once the previous block's dV^T is done
                        mbar_wait(sm.do_empty(), (gs & 1) ^ 1);
                        mbar_arrive_expect_tx(sm.do_full(), TileQ::kBytes);
#pragma unroll
                        for (int cb = 0; cb < kHeadDim / 64; ++cb)
                            tma_load_4d(sm.sdO(0) + cb * kBlockM * 128, &params.tma_do, sm.do_full(), cb * 64,
                                        x.q_start + walk.m0, walk.head, batch_coord);
                    }
                    if (!kv_loaded) load_kv();
                }
                if (!kv_loaded) load_kv();  // no query block sees these keys: dK = dV = 0
                ++tile_iter;
            }
        } else if (!T::kSplitHd && (warp == 2 || (T::kDqWriters == 2 && warp == 3))) {
            // dQ writer: per query block, once the MMA warps have staged their 16 x 64 slices (scrambled order of
            // flash_aux.cuh convert_dq), add them to dq_accum with 8 bulk reduce-adds (a sequence's last block too:
            // its rows past the end are padding rows and add zeros) and release the staging area. Deterministic:
            // after the key blocks below this one have added this query block (their turn counter), and count this
            // one in when done. Two writers (kDqWriters): warp 2 + w takes the CTA's blocks n with n % 2 == w, each
            // with its own "full" mbarrier (one barrier's parity could not tell a writer's next block from the
            // other's); the "empty" arrivals alternate in block order (block n + 1 is staged after block n's).
            int n = 0;
            BwdTile x;
            // kFusedDq (lane 0): the blocks whose reduce-adds were issued last (kFdqDepth of them, their records in
            // shared memory, sm.fdq_rec: the writer's registers are few); the oldest is counted in once its reduce-adds
            // have completed, and the count's old value read one block later (the atomic's round trip overlaps the
            // wait for the next block); the requests handed to the converter warp so far
            int n_blk = 0;  // blocks recorded
            int n_req = 0;
            int pend_old = 0, pend_target = -1;  // the last count's old value and its block's target (-1: none)
            u32 pend_rec = 0;
            auto fdq_store = [&](u32 at, const FdqBlock& b) {
                st_shared_b32(at, (u32)b.dq_off);
                st_shared_b32(at + 4, (u32)(b.dq_off >> 32));
                st_shared_b32(at + 8, (u32)b.acc_off);
                st_shared_b32(at + 12, (u32)(b.acc_off >> 32));
                st_shared_b32(at + 16, (u32)b.rows);
                st_shared_b32(at + 20, (u32)b.count_at);
                st_shared_b32(at + 24, (u32)b.target);
            };
            auto fdq_post = [&](bool stop, u32 rec) {  // block rec (stop: rows -1, no more) to the converter
                const int slot = n_req % T::kFdqReqs;  // (the ring's first pass waits for nothing)
                mbar_wait(sm.fdq_req_empty(slot), ((n_req / T::kFdqReqs) & 1) ^ 1);
                const u32 at = sm.fdq_req(slot);
                if (stop) {
                    st_shared_b32(at + 16, (u32)-1);
                } else {
                    u32 w[4];
                    ld_shared_v4(rec, w);
                    st_shared_v4(at, w);
                    st_shared_b32(at + 16, ld_shared_b32(rec + 16));
                }
                mbar_arrive(sm.fdq_req_full(slot));
                ++n_req;
            };
            auto fdq_resolve = [&]() {  // the last count: the block it completed goes to the converter
                asm volatile("" : "+r"(pend_old));  // (its first use here, not right after the atomic)
                if (pend_old + 1 == pend_target && FT_BWD_FDQ_DIAG == 0) fdq_post(false, pend_rec);
                pend_target = -1;
            };
            auto fdq_count = [&](u32 rec) {  // block rec's reduce-adds have completed (bulk wait)
                fence_proxy_async_global();
                pend_target = ld_shared_b32(rec + 24), pend_rec = rec;
                // (relaxed: the block's reduce-adds have completed in L2, the coherence point that the converter's
                // bulk copy reads; an acq_rel atomic's MEMBAR.ALL.GPU held the writer at every block)
                pend_old = atom_add_relaxed_gpu(p.dq_counts + ld_shared_b32(rec + 20), 1);
            };
            for (int tile_iter = 0; sm.read_tile(tile_iter, x); ++tile_iter) {
                for (QueryBlockWalk<T> walk(p, x); walk.has; walk.next(), ++n) {
                    if (T::kDqWriters == 2 && n % 2 != warp - 2) continue;
                    if (T::kDqWriters == 2) mbar_wait(warp == 3 ? sm.dq_full1 : sm.dq_full, (n / 2) & 1);
                    else mbar_wait(sm.dq_full, n & 1);
                    const int m0 = walk.m0;
                    float* dq_acc = p.dq_accum + walk.head * p.dqa_head_stride + (i64)x.q_pad * kHeadDim;
                    int turn = 0;
                    int* counter = T::kIsDeterministic ? det_turn<T>(p, x, walk.head, m0, turn) : nullptr;
                    if (T::kIsDeterministic && !FT_BWD_DET_NO_TURNS) {
                        if (lane == 0) wait_turn(counter, turn);
                        __syncwarp();
                    }
                    if (T::kDqFrag && lane == 0) {  // the block's dQ^T in fragment order: a warpgroup's 20 KB each
                        // (head dims 65-96, FT_BWD_NARROW_FRAG_ADD: of warpgroup 1's 16-column slices only those below
                        // kHeadDimEff, a prefix of its 20 KB; the others hold zeros and are never read)
                        constexpr int kHalf1Cols = FT_BWD_NARROW_FRAG_ADD ? T::kHeadDimEff - 64 : 64;
#pragma unroll
                        for (int half = 0; half < 2; ++half)
                            bulk_reduce_add_f32(dq_acc + (i64)m0 * kHeadDim + half * kBlockM * 64,
                                                sm.sdQ + half * kBlockM * 64 * 4, kBlockM * (half ? kHalf1Cols : 64) * 4);
                        bulk_commit();
                        bulk_wait_read<0>();
                        mbar_arrive(sm.dq_empty);
                    } else if (T::kSwapDq && lane == 0) {  // the block's dQ^T boxes, reduce-added into plain rows
                        const int row = p.dq_map_row0 + walk.head * (int)(p.dqa_head_stride / kHeadDim) + x.q_pad + m0;
#pragma unroll
                        for (int b = 0; b < kHeadDim / 32; ++b)
                            tma_reduce_add_4d(&params.tma_dq, sm.sdQ + b * T::kDqBoxBytes, 32 * b, row, 0, 0);
                        bulk_commit();
                        bulk_wait_read<0>();
                        mbar_arrive(sm.dq_empty);
                    } else if (lane == 0) {
#pragma unroll 1
                        for (int slice = 0; slice < 4 * T::kNMma; ++slice) {
                            const int piece = slice / 4, row0 = m0 + 16 * ((piece / (kHeadDim / 64)) * 4 + slice % 4);
                            const int col0 = 64 * (piece % (kHeadDim / 64));
                            // (kNarrowDq: piece 1's first kDqN1 / 8 n8 tiles, 512 bytes each)
                            bulk_reduce_add_f32(dq_acc + (i64)row0 * kHeadDim + col0 * 16,
                                                sm.sdQ + slice * T::kDqSliceBytes,
                                                T::kNarrowDq && piece == 1 ? T::kDqN1 * 64 : T::kDqSliceBytes);
                        }
                        bulk_commit();
                        bulk_wait_read<0>();
                        mbar_arrive(sm.dq_empty);
                        if constexpr (T::kFusedDq) {
                            // the last count resolved (its record's slot is this block's), then the block
                            // kFdqDepth before this one counted: its reduce-adds have landed (the later ones' may run)
                            if (pend_target >= 0) fdq_resolve();
                            if (n_blk >= T::kFdqDepth && FT_BWD_FDQ_DIAG != 2) {
                                bulk_wait<T::kFdqDepth>();
                                fdq_count(sm.fdq_rec((n_blk - T::kFdqDepth) % (T::kFdqDepth + 1)));
                            }
                            fdq_store(sm.fdq_rec(n_blk % (T::kFdqDepth + 1)), fdq_block<T>(p, x, walk.head, m0));
                            ++n_blk;
                        }
                    }
                    __syncwarp();
                    if (T::kIsDeterministic && !FT_BWD_DET_NO_TURNS) {  // complete (not only read) before the
                        if (lane == 0) {                                   // next key block's turn
                            bulk_wait<0>();
                            fence_proxy_async_global();
                        }
                        if (FT_BWD_DET_MEMBAR) __threadfence();
                        __syncwarp();
                        if (lane == 0) red_release_gpu_add(counter, 1);
                    }
                }
            }
            if (lane == 0) {
                bulk_wait<0>();  // the reductions are complete before the CTA's shared memory goes away
                if constexpr (T::kFusedDq) {
                    if (pend_target >= 0) fdq_resolve();
                    for (int i = max_(0, n_blk - T::kFdqDepth); i < n_blk && FT_BWD_FDQ_DIAG != 2; ++i) {
                        fdq_count(sm.fdq_rec(i % (T::kFdqDepth + 1)));
                        fdq_resolve();
                    }
                    fdq_post(true, 0);
                }
            }
        } else if (T::kFusedDq && (warp == 3 || warp == 1)) {
            // The converters (warps 3 and 1, each taking every other chunk of every request): per
            // request, the query block's 32 KB of dq_accum (8 slices of 16 rows x 64 columns in the scrambled order,
            // flash_aux.cuh convert_dq) in 4 KB chunks, a converter's through its two buffers, each
            // slice's float4 32 j + l holding rows l / 4 and l / 4 + 8, columns 8 j + 2 (l % 4) and + 1 of its 16-row
            // group; dq = softmax_scale * dq_accum in 4-byte pairs (rows past the sequence's end and columns past
            // head_dim are not written).
            constexpr int kConv = T::kFdqConverters, kChunk = T::kFdqChunkBytes;
            constexpr int kMine = kBlockM * kHeadDim * 4 / kChunk / kConv;  // chunks per request and converter
            constexpr int kSlicesPerRow = kHeadDim / 64, kSlicesPerChunk = kChunk / 4096;
            const int ci = warp == 3 ? 0 : 1;  // chunks ci + kConv k, in buffers 2 ci + k % 2
            const float scale = f.softmax_scale;
            const int rs = (int)p.dq_row_stride;
            for (int r = 0;; ++r) {
                const int slot = r % T::kFdqReqs;
                mbar_wait(sm.fdq_req_full(slot), (r / T::kFdqReqs) & 1);
                const u32 at = sm.fdq_req(slot);
                const i64 dq_off = (i64)(u32)ld_shared_b32(at) | ((i64)ld_shared_b32(at + 4) << 32);
                const i64 acc_off = (i64)(u32)ld_shared_b32(at + 8) | ((i64)ld_shared_b32(at + 12) << 32);
                const int rows = ld_shared_b32(at + 16);
                __syncwarp();
                if (lane == 0) mbar_arrive(sm.fdq_req_empty(slot));
                if (rows < 0) break;
                const float* src = p.dq_accum + acc_off;
                u16* dq0 = (u16*)p.dq + dq_off;
                const bool full = rows == kBlockM && f.head_dim == kHeadDim;  // (a whole block: no guards)
                if (lane == 0) {
                    fence_proxy_async_global();  // (the counts' acquire, then the copy engine's reads)
#pragma unroll
                    for (int k = 0; k < 2 && k < kMine; ++k) {
                        const int buf = 2 * ci + k;
                        mbar_arrive_expect_tx(sm.fdq_chunk_full(buf), kChunk);
                        bulk_load(sm.fdq_chunk(buf), src + (ci + kConv * k) * (kChunk / 4), kChunk,
                                  sm.fdq_chunk_full(buf));
                    }
                }
#pragma unroll 1
                for (int k = 0; k < kMine; ++k) {
                    const int c = ci + kConv * k, buf = 2 * ci + (k & 1);
                    mbar_wait(sm.fdq_chunk_full(buf), (k >> 1) & 1);  // (each buffer fills kMine / 2 times a block)
                    if constexpr (FT_BWD_FDQ_DISCARD != 0) {
                        static_assert(kChunk == 32 * 128, "one 128-byte line per lane");
                        discard_l2_line(src + c * (kChunk / 4) + 32 * lane);
                    }
#pragma unroll 1
                    for (int i = 0; i < kSlicesPerChunk; ++i) {  // (few registers: the producer warpgroup's)
                        const int slice = c * kSlicesPerChunk + i;
                        const int row = 16 * (slice / kSlicesPerRow) + lane / 4;
                        const int col0 = 64 * (slice % kSlicesPerRow) + 2 * (lane % 4);
                        u16* d0 = dq0 + row * rs + col0;
                        u16* d8 = d0 + 8 * rs;
                        const u32 a = sm.fdq_chunk(buf) + 4096 * i + 16 * lane;
                        if (full) {
#pragma unroll
                            for (int j = 0; j < 8; ++j) {
                                float v[4];
                                ld_shared_v4f(a + 512 * j, v);
                                *(u32*)(d0 + 8 * j) = pack2<T::kIsBF16>(v[0] * scale, v[1] * scale);
                                *(u32*)(d8 + 8 * j) = pack2<T::kIsBF16>(v[2] * scale, v[3] * scale);
                            }
                            continue;
                        }
                        const bool in0 = row < rows, in8 = row + 8 < rows;
                        const int cols = f.head_dim - col0;  // (column col0 + 8 j is written where 8 j < cols)
#pragma unroll 2
                        for (int j = 0; j < 8; ++j) {
                            float v[4];
                            ld_shared_v4f(a + 512 * j, v);
                            if (8 * j >= cols) continue;
                            if (in0) *(u32*)(d0 + 8 * j) = pack2<T::kIsBF16>(v[0] * scale, v[1] * scale);
                            if (in8) *(u32*)(d8 + 8 * j) = pack2<T::kIsBF16>(v[2] * scale, v[3] * scale);
                        }
                    }
                    __syncwarp();
                    if (k + 2 < kMine && lane == 0) {  // the buffer's next chunk (its reads above are done)
                        fence_proxy_async();
                        mbar_arrive_expect_tx(sm.fdq_chunk_full(buf), kChunk);
                        bulk_load(sm.fdq_chunk(buf), src + (c + 2 * kConv) * (kChunk / 4), kChunk,
                                  sm.fdq_chunk_full(buf));
                    }
                }
            }
        }
        return;
    }

    // -------------------------------------------------------------------------------------------------- MMA
    if constexpr (T::kSplitRegs) {
        if (wg == 1) {
            setmaxnreg_inc<T::kMmaRegs0>();
            flash_bwd_sm90_mma<T, 0>(params, sm);
        } else {
            setmaxnreg_inc<T::kMmaRegs1>();
            flash_bwd_sm90_mma<T, 1>(params, sm);
        }
        return;
    }
    setmaxnreg_inc<T::kMmaRegs>();
    if constexpr (T::kSplitKeys) {
        if (wg == 1) flash_bwd_sm90_split_keys_mma<T, 0>(params, sm);
        else flash_bwd_sm90_split_keys_mma<T, 1>(params, sm);
    } else if constexpr (T::kSplitHd) {
        if (wg == 1) flash_bwd_sm90_split_mma<T, 0>(params, sm);
        else flash_bwd_sm90_split_mma<T, 1>(params, sm);
    } else {
        flash_bwd_sm90_mma<T>(params, sm);
    }
}

}  // namespace flashtrain
