// FlashAttention forward (Algorithm 1 of FlashAttention-2) on Hopper, warp-specialized as in FlashAttention-3:
//
//   warpgroup 0 (producer): after giving its registers away (setmaxnreg.dec), one thread issues TMA copies of the
//     CTA's Q tile and of every key block's K and V tiles into a ring of kStages shared-memory stages, each guarded by
//     a "full" mbarrier (the copy engine completes it) and an "empty" one (the consumers release the stage);
//   warpgroups 1..kNConsumers (consumers, setmaxnreg.inc): warpgroup c owns query rows [64 c, 64 c + 64) of the CTA's
//     kBlockM rows and runs, per key block j (intra-warpgroup pipelining: the S GEMM of block j is issued before the
//     P V GEMM of block j - 1, so the softmax of block j overlaps that P V product on the tensor cores):
//         wait K[j], V[j-1]; [scheduler barrier] issue S_j = Q K[j]^T, then O += P_{j-1} V[j-1]; [hand over]
//         wait S_j; release K[j]; mask; online softmax of S_j (exp, running max and sum); dropout
//         wait P V; release V[j-1]; rescale O by the max's correction; P_j = pack(S_j) (A operand in registers)
//     With two consumers (three, causal), named barriers order their GEMM issues (ping-pong): consumer 0 issues,
//     then consumer 1, then consumer 0 again (or 2, then 0), so one warpgroup's softmax runs while another's GEMMs
//     hold the tensor cores.
//     Head dims above 256 (kSplitD): both consumers own the same 64 rows, each half of O's columns; each issues S over
//     its half of the head dim, and they add their partial S through shared memory before the softmax (no ping-pong).
//   Epilogue: O / l and lse = m * scale + ln(l) per row; O staged through the warpgroup's rows of a shared O tile and
//     written by TMA stores (the warps go on to the next tile; a varlen sequence's partial last tile is written with
//     16-byte stores: rows past its end belong to the next sequence). Head dims 192 / 256 / 512, whose Q + O + K/V
//     stages do not fit in shared memory, write O from the registers.
//   The grid is persistent: each CTA loops over tiles (fwd_tile below). The producer picks the next tile, waits for
//     the consumers' "empty_q" (their last S GEMM of the current tile), writes the tile's index to a shared slot and
//     copies its Q, then its K/V, while the consumers still run the current tile's last P V product and epilogue;
//     the consumers read the slot once "full_q" completes (index -1: no more tiles). With two Q buffers
//     (FwdSm90Traits::kQBuffers; build.py dispatches them to causal hd128 below 1K rows) tile i uses buffer i % 2, its
//     slot, tile record and full_q / empty_q pair, so the producer copies the next tile's Q as soon as the tile before
//     the current one has released that buffer.
//   Clusters (FwdSm90Traits::kCluster; build.py FWD_SM90_CLUSTER: dense non-causal hd128 from 8K keys, and hd64's
//     192-row tiles with FWD_SM90_CLUSTER_HD64): two CTAs on neighbouring query tiles of one (batch, head), tiles in
//     a static round-robin of pairs; each producer copies one half of every K / V tile (hd128: a 64-column box;
//     hd64: half of the box's rows) into both CTAs (TMA multicast) and refills a stage once both CTAs' consumers
//     released it (a hand-over between the producers); the consumers run the one-CTA code.
//
// Key blocks are walked from the last to the first (the blocks that need a mask come first); block-sparse walks the
// non-zero blocks of the query block's row of the block mask (utils.cuh SparseWalkDesc). Dropout draws the same
// Philox bits as flash_fwd.cuh (DropoutRng addresses them by (batch * head, query, key)), so either backward
// regenerates the mask. Causal masking is bottom-right aligned: query i sees key j iff j <= i + seqlen_k - seqlen_q.
// Causal query tiles (no dropout, not block-sparse) end at the sequence's last row, so that a partial tile is the
// first one, whose rows see the fewest keys (FwdSm90Traits::kShiftRows).
// A row with no visible key gets out = 0, lse = -inf.
//
// Tensor maps (flash.h FwdSm90Params; flashtrain/kernels/tma.py): rank 4, (head_dim, rows, heads, batch), boxes of
// 64 columns x kBlockM (Q) or kBlockN (K, V) rows, 128-byte swizzle = SmemTile's layout. Varlen maps are
// (head_dim, total rows, heads, 1) and the row coordinate is the sequence's start plus the block's offset: K/V rows
// past the sequence end belong to the next sequence (masked, so they add exact zeros) or lie past the tensor (zeros).
// Head dims 64, 128, 192, 256 (others padded up by the host; build.py routes the rest to flash_fwd.cuh).
#pragma once
#include "mask_mod.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

// Switches (see their uses; on by default since 2026-11-25, =0 for A/Bs): FT_FWD_TILE_RECORD, the consumers read the
// tile's fields from the producer; FT_FWD_MASK_SHARED, one causal-mask compare per score pair of rows g and g + 8.
#ifndef FT_FWD_TILE_RECORD
#define FT_FWD_TILE_RECORD 1
#endif
#ifndef FT_FWD_MASK_SHARED
#define FT_FWD_MASK_SHARED 1
#endif
// FT_FWD_HALF_FIRST (128-key blocks): a consumer to which the upper half of its tile's first key block is invisible
// (the causal diagonal block of the first 64 rows; a last key block at most half full) computes S for the lower half
// only, its P for the upper half is zero. H200, same process, causal forward 1.07x (hd64) / 1.01x (hd128) at 512,
// 1.03 / 1.02x at 1K, 1.01-1.02x at 2K-4K, 2026-11-25. (Also halving that block's P V product, the step after the
// first block peeled off, measured 1.04x at 512 and 0.97-0.99x at 2K-4K.)
#ifndef FT_FWD_ROUND_ROBIN
#define FT_FWD_ROUND_ROBIN 1
#endif
#ifndef FT_FWD_HALF_FIRST
#define FT_FWD_HALF_FIRST 1
#endif
// FT_FWD_ARRIVE_PRED (default 1; 0 for A/Bs): in the key-block loop a consumer releases its K stage (and, after the
// tile's last S GEMM, Q) right after the S wait, and its V stage after the P V wait, by arrives predicated inside the
// instruction instead of behind `if (lead_lane)` branches: ptxas placed the P V wait right after such a branch, above
// the whole softmax (SASS, hd128 128 x 128: none of a block's 66 exponentials before the P V wait; predicated, 15-18 of
// them and 156-282 instructions), so the softmax ran after the warpgroup's own P V GEMM instead of beside it. H200,
// interleaved CUDA-graph A/B, forward, predicated / branches: hd128 full 4K 1.041, 16K 1.038, causal 1K 1.027, 8K
// 1.044, GQA 32/8 8K 1.051; hd64 full 512 1.008, 16K 1.035, causal 4K 1.023; hd80 causal 4K 1.059, hd256 1.057.
// Not with dropout (ptxas then spills 28 bytes in the hd128 kernel, none before).
#ifndef FT_FWD_ARRIVE_PRED
#define FT_FWD_ARRIVE_PRED 1
#endif
// FT_FWD_EPI_OPAQUE (default 1): the staged epilogue's lane, row and chunk indices hidden from the compiler where the
// epilogue starts, so that it derives them there instead of hoisting them out of the tile loop: those ~14 registers
// were live through the key-block loop, and at 128-row hd128 tiles ptxas then waited for the P V GEMM before more of
// the softmax (18 -> 26 exponentials beside it in the non-causal loop, sm90_spills.py). 1: head dim 128 (not narrowed,
// no score modifications, dropout or block mask); 2: every kernel with the staged epilogue (A/B); 0: none. H200,
// interleaved CUDA-graph A/B, forward, with / without: hd128 non-causal 4K 1.014, 1K 1.013-1.035, causal 4K 1.002,
// 512 1.005; at hd64's 192-row tiles (0 -> 19 exponentials beside the P V GEMM) 0.941-0.966, hd96 0.994.
#ifndef FT_FWD_EPI_OPAQUE
#define FT_FWD_EPI_OPAQUE 1
#endif
// FT_FWD_DESC64 (default 6; 0 for A/Bs): bits of the wgmma descriptors that move by one 64-bit add (wgmma.cuh
// gmma_desc_form 2) in the key-block steps without a mask (1: Q, 2: K, 4: V); the others, and every masked step's, by
// gmma_desc_at (a 32-bit add to the start-address field). H200, interleaved CUDA-graph A/B, forward, K and V by 64-bit
// adds / by 32-bit adds: hd64 full 8K / 16K 1.001 / 1.005, causal 16K 1.002; hd128 full 4K 1.004, causal 512 / 16K
// 1.004; hd96 / GQA / hd256 causal 0.999-1.002, hd192 causal 1.013 (the same build twice: 0.993-1.001). Adding Q too
// (7) measured 0.94-0.95 at hd128 16K. The 2-CTA cluster kernels cannot take form 2, whose outputs it made wrong
// there: it keeps an address's bits above the 18 of the start-address field, and in a cluster launch they are set.
// FT_FWD_DESC64_CLUSTER (default 1; 0 for A/Bs): the cluster kernels move the same descriptors by the 64-bit add on
// the masked address (gmma_desc_form 3). H200, against the 32-bit form: interleaved CUDA-graph A/B, hd128 non-causal
// 8K / 16K forward 1.002 / 1.003 (a second copy of the default 1.000 / 0.998); sustained (3 s x 2 rounds) 1.002 /
// 1.002, with 0.5% more TFLOP/s per GHz of SM clock.
#ifndef FT_FWD_DESC64
#define FT_FWD_DESC64 6
#endif
#ifndef FT_FWD_DESC64_CLUSTER
#define FT_FWD_DESC64_CLUSTER 1
#endif
// FT_FWD_STATIC=1 (A/B): the one-CTA kernels take their tiles in the 2-CTA cluster kernels' static round-robin
// (FwdSm90Traits::kCluster) instead of from the dynamic scheduler.
#ifndef FT_FWD_STATIC
#define FT_FWD_STATIC 0
#endif
// FT_FWD_TAIL_SPLIT (build.py FWD_TAIL_SPLIT, which also sets FwdSm90Params' tail fields; default 0): the kernels of
// FwdSm90Traits::kTailSplit run the last, partial wave of a launch's tiles as pieces over their key blocks
// (utils.cuh tail_unit_tile, fwd_piece_keys, tail_merge), as the backward's FT_BWD_TAIL_SPLIT does over query blocks: a dense
// non-causal launch's tiles all take the same time, so its last wave otherwise leaves the other SMs idle for a tile.
#ifndef FT_FWD_TAIL_SPLIT
#define FT_FWD_TAIL_SPLIT 0
#endif

// The register epilogue (kDirectO) in 8-byte stores of whole sectors (0: 4-byte stores; A/B)
#ifndef FT_FWD_O_SECTORS
#define FT_FWD_O_SECTORS 1
#endif
// Head dim 192 (O: 96 registers per thread): a block's O correction is applied once the next block's S GEMM is issued,
// before its P V GEMM (FlashAttention-3's order above head dim 128), instead of after the P V wait. H200, interleaved
// CUDA-graph replays, forward: hd192 4K causal 1.028, 16K full 1.023, 8K causal 1.036, 2K full 1.010, 1K causal 1.000;
// hd256 4K 1.004-1.005, 16K full 1.014, 1K causal 0.965 (kept after the wait). FT_FWD_RESCALE_EARLY=0 / 1 forces it
// off / on at head dims 192 and 256 (A/B).

namespace flashtrain {

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, bool kSeparateO_, bool kIsBF16_, bool kIsCausal_,
          bool kIsDropout_, bool kIsBlockSparse_, int kQBuffers_ = 1, int kScoreMods_ = 0, bool kMaskMod_ = false,
          int kHeadDimEff_ = kHeadDim_, int kCluster_ = 1>
struct FwdSm90Traits {
    // FT_SCORE_MODS: 1, the local window, softcap and ALiBi of the call's parameters (flash.h), each off
    // when unset; 2, the window and ALiBi only (the calls without softcap: no tanh path, fewer registers); 3, the
    // window only (no ALiBi slope load, branch or row bias)
    static constexpr bool kScoreMods = kScoreMods_ != 0, kSoftcap = kScoreMods_ == 1;
    static constexpr bool kAlibi = kScoreMods_ == 1 || kScoreMods_ == 2;
    static_assert(!(kScoreMods_ && kIsBlockSparse_), "score modifications and a block mask are not combined");
    // a mask expression compiled in (FT_MASK_EXPR, mask_mod.cuh; with the score modifications): the key walk skips
    // the blocks whose 128 x 128 block states (FwdParams::mm_states) are all empty, the expression runs per pair on
    // blocks that overlap a partial state; query tiles of 128 rows (one row of states), key blocks of at most 128
    static constexpr bool kMaskMod = kMaskMod_;
    static_assert(!kMaskMod_ || (kScoreMods_ && kBlockM_ == kBlockSparseSize && kBlockN_ <= kBlockSparseSize),
                  "a mask expression needs the score-modification kernel with 128-row tiles");
    static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_, kStages = kStages_;
    // Q buffers: with two, the producer copies the next tile's Q (and its tile record) into the other buffer as soon
    // as the tile before this one has released it, instead of after this tile's last S GEMM; the consumers' flow is
    // the same (tile i uses buffer i % kQBuffers)
    static constexpr int kQBuffers = kQBuffers_;
    static_assert(kQBuffers == 1 || (kQBuffers == 2 && kSeparateO_), "one Q buffer, or two and O in its own tile");
    // O staged in a tile of its own, or written from the registers (kDirectO: head dims whose Q + O + K/V stages do
    // not fit in shared memory); either way Q is released after the tile's last S GEMM
    static constexpr bool kSeparateO = kSeparateO_;
    // The epilogue writes O with TMA stores from its own tile (not through Q, which was released once read back), with
    // two consumer warpgroups (H200, same run: 128-row tiles 1.00-1.05x; 192-row tiles 0.96-0.99x at 1K-4K)
    static constexpr bool kTmaStoreO = kSeparateO && FT_TMA_STORE && kBlockM == 128;
    // Without a tile of its own, O goes from the accumulator registers straight to global memory (4-byte stores),
    // not through Q's tile: Q is then released after the tile's last S GEMM as with a separate O, so the next tile's
    // Q and K / V copies overlap this tile's last P V product and epilogue, and the epilogue needs no registers for
    // shared-memory addressing. H200, same process, 2026-11-26: hd192 128 x 112 tiles 1.03-1.06x; hd256 1.01-1.04x
    // at 128 x 64 tiles, and its 80-key tiles then spill nothing: 1.10-1.16x of the 64-key ones through Q. (Where O
    // has a tile, its TMA stores are faster than these: 0.84-0.98x with direct stores at hd64 / hd128.)
    static constexpr bool kDirectO = !kSeparateO;
    static constexpr bool kIsBF16 = kIsBF16_, kIsCausal = kIsCausal_, kIsDropout = kIsDropout_;
    static constexpr bool kIsBlockSparse = kIsBlockSparse_;
    // Causal: a sequence's query tiles end at its last row, so that a partial tile (seqlen_q not a multiple of
    // kBlockM) holds its first rows, which see the fewest keys, instead of its last, which see the most. (Block-sparse
    // keeps tiles aligned to its mask blocks; dropout keeps the plain layout, whose Philox rows are never negative.)
    // FT_CAUSAL_SHIFT=0 builds the old layout (A/B).
// FT_FWD_POLY_EXP=1 (off; A/B): with softcap, half the exponentials on the FMA pipe (utils.cuh poly_exp2). H200,
// same process, 2026-11-26: softcap forward / plain 0.73 -> 0.65 (hd128 8K), 0.77 -> 0.67 (2K), and the mods kernel's
// other calls 1-3% slower (two softmax paths: 5352 -> 6792 SASS instructions). The consumers' issue slots, not the
// MUFU pipe alone, bound the softcap step.
#ifndef FT_FWD_POLY_EXP
#define FT_FWD_POLY_EXP 0
#endif
// FT_FWD_LAZY_RESCALE (default 1; 0 for A/Bs; FwdSm90Traits::kLazyRescale): a row's running max moves only when a
// block's exceeds it by more than 2^8 in the exponent (utils.cuh kLazyMax), and a warp rescales O only when one of its
// rows moved (a warp vote), instead of 2 * kDT FMULs per step. H200, interleaved CUDA-graph A/B, forward, with /
// without: hd128 full 512 / 2K / 4K 1.013 / 1.008 / 1.022, causal 512 / 1K / 4K 1.014 / 1.017 / 1.024, GQA 32/8 8K
// causal 1.025; hd192 causal 4K 1.019; hd256 causal 4K 1.028, full 16K 1.023; forward + backward 1.007-1.009. Not
// taken: hd64 0.987-0.995 (its 32 FMULs run in the exponentials' shadow), hd96 on the hd128 tiles 0.994, the 192-key
// tiles of hd128 (the 2-CTA cluster kernels, full 16K 0.985, and their one-CTA twin, bitwise the same; causal 16K
// 1.000).
#ifndef FT_FWD_LAZY_RESCALE
#define FT_FWD_LAZY_RESCALE 1
#endif
// FT_FWD_REF_MAX: the unmasked key-block steps of the kernels without score modifications or dropout skip the block's
// row max: the exponentials are taken against the row's running max as it stands (set by the tile's first, or a
// masked, block), the row sums add up unscaled and O is not rescaled (utils.cuh softmax_exp_row, kRefMax). =2, the
// guarded form: a warp keeps the block's exponentials only where every thread's partial row sums are at most
// 2^kLazyMaxLog2 (so is every exponential, as with kLazyMax); otherwise (a row's max moved by more, an exponential
// overflowed, NaN) it computes its 16 rows of S again by mma.sync from the Q and K tiles in shared memory, which it
// releases only after that check, and runs the plain softmax on them. =1, a probe of what the max, its quad shuffles
// and the O rescale cost the step: no overflow guard (a score 128 binary orders above the running max overflows its
// exponential), so the tests do not run it. =0: the block max everywhere. Unset (-1): =2 in the non-causal kernels at
// head dims 64 and 128 and in the causal ones built with FT_FWD_REF_CAUSAL=1 (kRefMaxMode below), the block max
// elsewhere. H100, 2026-12-07, interleaved CUDA-graph replays (ab_probe.py), forward, =2 (its vote after the P V
// wait) against the block max: hd64 non-causal 4K / 8K / 16K 1.042 / 1.051 / 1.058, hd128 non-causal 4K / 8K / 16K
// 1.017 / 1.023 / 1.025 (sustained 4K / 16K 1.018 / 1.035); causal 0.928-0.999 at 1K-16K, except hd64 causal 4K /
// 16K 1.034 / 1.062 (kernel_ab-h100.json refmax_fwd_ab), with the vote after the P V wait (moved since: below).
#ifndef FT_FWD_REF_MAX
#define FT_FWD_REF_MAX -1
#endif
// The guard votes (and, where it fails, recomputes) right after the exponentials, before the P V wait, and K and Q
// are released right after the vote. H100, 2026-12-08, forward, against the vote after the P V wait: hd128
// non-causal 4K / 16K 1.037 / 1.011, hd64 non-causal 16K 1.012 (kernel_ab-h100.json guard_early_ab). Releasing K and Q
// before the vote, with a failed check reading them from global memory, measured 0.99-1.02 non-causal and 0.59-1.03
// causal. FT_FWD_REF_CAUSAL=1 (build.py FWD_SM90_REF_CAUSAL_SEQLEN sets it for the long causal calls it measured
// faster in): the guarded form in the causal hd64 / hd128 kernels too, against the block max: hd64 causal 4K /
// 16K 1.023 / 1.060, hd128 causal 16K (192-key tiles) 1.030; not taken: hd64 causal 1K 0.925, hd128 causal 1K 0.998.
#ifndef FT_FWD_REF_CAUSAL
#define FT_FWD_REF_CAUSAL 0
#endif
#ifndef FT_CAUSAL_SHIFT
#define FT_CAUSAL_SHIFT 1
#endif
    static constexpr bool kShiftRows = FT_CAUSAL_SHIFT && kIsCausal_ && !kIsDropout_ && !kIsBlockSparse_ && !kScoreMods_;
    // FT_FWD_REF_MAX (above): the unmasked steps' form; by default the guarded form where it measured faster
    static constexpr bool kRefMaxDefault =
        (!kIsCausal_ || FT_FWD_REF_CAUSAL) && (kHeadDim_ == 64 || kHeadDim_ == 128) && kHeadDimEff_ == kHeadDim_;
    static constexpr int kRefMaxMode = FT_FWD_REF_MAX >= 0 ? FT_FWD_REF_MAX : kRefMaxDefault ? 2 : 0;
    // FT_FWD_LAZY_RESCALE (above): the kernels it was measured on (no score modifications or dropout)
    static constexpr bool kLazyRescale = FT_FWD_LAZY_RESCALE && kHeadDim_ >= 128 && kHeadDim_ <= 256 &&
                                         kHeadDimEff_ == kHeadDim_ && kBlockN_ <= 128 && !kScoreMods_ && !kIsDropout_;
    static_assert(!kIsBlockSparse || (kBlockSparseSize % kBlockM == 0 && kBlockSparseSize % kBlockN == 0),
                  "a block-sparse mask block must be a whole number of tiles");
    // Head dims above 256 (kSplitD): O of 64 rows x kHeadDim columns would take kHeadDim / 2 registers per thread, so
    // two consumer warpgroups share the tile's 64 rows, each owning kHeadDim / 2 columns of O. Each computes S over
    // its half of the head dim (its columns of Q and K), the two partial S are added through shared memory (thread i
    // of both warpgroups holds the same elements, and a + b == b + a: both hold the same S bit for bit), and both run
    // the same softmax on it. They issue together (no ping-pong).
    static constexpr bool kSplitD = kHeadDim_ > 256;
    static_assert(!kSplitD || (kBlockM_ == 64 && !kScoreMods_ && !kIsBlockSparse_ && !kSeparateO_ && kQBuffers_ == 1),
                  "the split-head-dim forward: 64-row tiles, O from the registers, no score modifications / block mask");
    static constexpr int kNConsumers = kSplitD ? 2 : kBlockM / 64;  // consumer warpgroups, 64 query rows each
    static constexpr int kNThreads = 128 * (kNConsumers + 1);        // + the producer warpgroup
    // Turns for the GEMM issues: two consumers ping-pong; three (causal) take turns in a ring, 0 -> 1 -> 2 -> 0
    // (FT_FWD_ROUND_ROBIN; H200, graph-interleaved, 2026-11-26, hd64 192-row tiles, causal 512 / 768 / 1K / 4K / 16K
    // 1.011 / 1.011 / 1.015 / 1.009 / 1.002x of issuing freely; non-causal 512 / 2K / 16K 0.998 / 1.000 / 0.992x;
    // FT_FWD_ROUND_ROBIN=2, an A/B build: non-causal too)
    static constexpr bool kRing = FT_FWD_ROUND_ROBIN >= 2 || (kIsCausal_ && FT_FWD_ROUND_ROBIN == 1);
    static constexpr bool kPingPong = !kSplitD && (kNConsumers == 2 || (kNConsumers == 3 && kRing));
    // Registers per thread after reallocation. The CTA's pool is what it got at launch, 65536 / kNThreads rounded
    // down to a multiple of 8 per thread (384 threads: 168); setmaxnreg.inc waits until the pool has the registers,
    // so asking for more than the pool holds hangs the CTA.
    static constexpr int kLaunchRegs = 65536 / kNThreads / 8 * 8;
    static constexpr int kProducerRegs = kNConsumers == 2 ? 24 : 32;
    static constexpr int kConsumerRegs = kNConsumers == 2 ? 240 : 160;
    static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kNConsumers <= kLaunchRegs * kNThreads,
                  "register budget: the launch allocation");
    static constexpr int kNT = kBlockN / 8;   // n8 column tiles of S per thread
    // Columns that can be non-zero: head dims 65-96 run the hd128 tiles (Q, K, V zero-filled past the call's head dim
    // by the TMA copies) with kHeadDimEff 80 or 96, whose S GEMM takes 5 or 6 k-steps instead of 8 and whose P V
    // product and O accumulator have that many columns (the O tile's columns past it are never stored: the tensor map
    // ends at head_dim)
    static constexpr int kHeadDimEff = kHeadDimEff_;
    static_assert(kHeadDimEff == kHeadDim ||
                      (kHeadDim == 128 && (kHeadDimEff == 80 || kHeadDimEff == 96) && !kScoreMods_),
                  "effective head dim 80 or 96 of 128 (kernels without score modifications)");
    static constexpr int kDCols = kSplitD ? kHeadDim / 2 : kHeadDimEff;  // columns of O per consumer warpgroup
    static constexpr int kDT = kDCols / 8;                              // n8 column tiles of O per thread
    static_assert((kNConsumers == 2 || kNConsumers == 3) && kBlockN % 16 == 0 && kBlockN <= 256, "tile shape");
    static_assert(kHeadDim % 64 == 0 && kDCols <= 256, "head dims of 64-column blocks (128-byte swizzle)");
    using TileQ = SmemTile<kBlockM, kHeadDim>;
    using TileKV = SmemTile<kBlockN, kHeadDim>;
    static_assert(TileQ::kBlockCols == 64 && TileKV::kBlockCols == 64, "128-byte rows");
    static constexpr int kColBlocks = kHeadDim / 64;  // TMA boxes per tile
    // Clusters of two CTAs (FT_CLUSTER 2; build.py FWD_SM90_CLUSTER): the two take query tiles 2 i and 2 i + 1 of a
    // static round-robin (every tile of a dense non-causal call has the same key blocks), i.e. neighbouring query
    // blocks of one (batch, head), and each copies one of the two 64-column halves of every K / V tile (head dim 64,
    // one such box: one half of its rows) into both CTAs' shared memory (TMA multicast): each K / V tile is
    // requested from L2 once per pair of query tiles.
    // A stage is refilled once both CTAs' consumers have released it: each producer, once its own consumers have,
    // arrives on the peer's "peer_empty" barrier of the stage and waits on its own (the consumers' code is the
    // one-CTA kernel's).
    static constexpr int kCluster = kCluster_;
    static_assert(kCluster == 1 || (kCluster == 2 && (kColBlocks == 2 || (kColBlocks == 1 && kBlockN_ % 16 == 0)) &&
                                    !kIsCausal_ && !kIsBlockSparse_ && !kScoreMods_ && !kSplitD && kQBuffers_ == 1),
                  "2-CTA clusters: head dim 128 (or 64, halves of 8-row swizzle atoms), dense non-causal, no score "
                  "modifications, one Q buffer");
    // FT_FWD_TAIL_SPLIT: the dense non-causal one-CTA kernels without dropout, with one Q buffer and key blocks of at
    // most 128 (head dims up to 256). Not the 192-key hd128 tiles (one-CTA and 2-CTA clusters): with any code after
    // tail_merge's count (even one store), ptxas moved their loop's P V wait above every exponential (sm90_spills.py:
    // 30 / 21 -> 0 / 0 exponentials ahead of it), out-of-line merge code included.
    static constexpr bool kTailSplit = FT_FWD_TAIL_SPLIT && !kIsCausal_ && !kIsDropout_ && !kIsBlockSparse_ &&
                                       !kScoreMods_ && !kMaskMod_ && !kSplitD && kQBuffers_ == 1 && kCluster_ == 1 &&
                                       kBlockN_ <= 128;
    // Barriers after the tiles: full_q, empty_q, then full_k, empty_k, full_v, empty_v (kStages each), then the second
    // Q buffer's full_q, empty_q, then (clusters) peer_empty_k, peer_empty_v (kStages each); 8 bytes apiece. The
    // area's last 48 bytes per Q buffer: its tile record and slot.
    static constexpr int kBarrierBytes = 256;
    static_assert(!kTailSplit || 8 * (4 + 4 * kStages_) + 16 * kNConsumers <= kBarrierBytes - 48 * kQBuffers_,
                  "barrier area: the tail split's unit copies");
    static_assert(8 * (4 + 4 * kStages + 2 * kStages * (kCluster > 1)) <= kBarrierBytes - 48 * kQBuffers,
                  "barrier area");
    // Q (kQBuffers), O staging (kSeparateO: the next tile's Q is copied while this tile's O is written), K and V
    // stages; + 1024: the tiles start at the first 1024-byte boundary (the 128-byte swizzle repeats every 1024 bytes)
    // kSplitD: each consumer's partial S (fp32, one 16-byte chunk per thread and n8 pair), two buffers by key block
    // parity (a warpgroup may store the next block's while the other still reads this one's)
    static constexpr int kPartialSBytes = kSplitD ? 2 * kNConsumers * 128 * kBlockN / 2 * 4 : 0;
    static constexpr int kSmemBytes = (kQBuffers + (kSeparateO ? 1 : 0)) * TileQ::kBytes +
                                      2 * kStages * TileKV::kBytes + 1024 + kBarrierBytes + kPartialSBytes;
    // Named barrier ids (0 is __syncthreads): 1 + c = consumer c's turn to issue GEMMs, 3 + c = its epilogue;
    // kSplitD: kBarPartialS, the two consumers' partial S stored.
    static constexpr int kBarSchedule = 1, kBarEpilogue = 1 + kNConsumers, kBarPartialS = 1 + 2 * kNConsumers;
};

// kMaskMod: a query tile's row of block states (0 empty, 1 partial, 2 full per 128 x 128 tile of pairs; flash.h
// mm_states) with the range of its non-empty key blocks, and the state of key block n_block: its tiles' common state,
// 1 where they differ (a key block of fewer than 128 keys may straddle two; keys past the sequence's end have none).
struct MaskRow {
    const unsigned char* states;
    int last;  // the last state of the sequence's keys
    int first_block, last_block;  // key blocks (of kBlockN) holding the row's non-empty states (empty: first > last)
};
template <class T> __device__ __forceinline__ MaskRow mask_row(const FwdParams& p, int batch, int head, int m0,
                                                               int seqlen_k) {
    if constexpr (!T::kMaskMod) {
        return MaskRow{nullptr, 0, 0, 0};
    } else {
        const unsigned char* base = p.mm_states + batch * p.mm_states_b_stride + head * p.mm_states_h_stride;
        const int qb = m0 / kBlockSparseSize;
        const int* range = reinterpret_cast<const int*>(base + (i64)p.mm_n_qblocks * p.mm_n_kblocks) + 2 * qb;
        return MaskRow{base + (i64)qb * p.mm_n_kblocks, (seqlen_k - 1) / kBlockSparseSize,
                       range[0] * kBlockSparseSize / T::kBlockN,
                       range[1] < 0 ? -1 : ((range[1] + 1) * kBlockSparseSize - 1) / T::kBlockN};
    }
}
template <class T> __device__ __forceinline__ int mask_block_state(const MaskRow& row, int n_block) {
    const int first = n_block * T::kBlockN / kBlockSparseSize;
    const int state = row.states[first];
    if constexpr (kBlockSparseSize % T::kBlockN == 0) {
        return state;
    } else {
        const int last = min_((n_block * T::kBlockN + T::kBlockN - 1) / kBlockSparseSize, row.last);
        return last == first || row.states[last] == state ? state : 1;
    }
}

// The key blocks a CTA visits, in walk order: dense, n_block_max - 1 down to 0; block-sparse, the tiles of the
// non-zero mask blocks of the query block's row that lie below n_block_max, descending; kMaskMod: the dense walk
// without the blocks whose states are empty. block() is -1 at the end.
template <class T> struct KeyBlockWalk {
    SparseWalkDesc<kBlockSparseSize / T::kBlockN> sparse;
    int n_block;
    int n_block_min;  // kScoreMods: the window's first key block (the walk ends below it)
    MaskRow mask;
    __device__ __forceinline__ KeyBlockWalk(const FwdParams& p, int head, int m0, int n_block_max,
                                            int n_block_min_ = 0, MaskRow mask_ = MaskRow{nullptr, 0, 0, 0}) {
        n_block_min = n_block_min_;
        mask = mask_;
        if constexpr (T::kIsBlockSparse) {
            sparse.init(p.bs_rows + head * p.bs_rows_head_stride + (i64)(m0 / kBlockSparseSize) * (p.bs_n_kblocks + 1));
            n_block = sparse.skip_to_below(n_block_max);
        } else if constexpr (T::kMaskMod) {  // from the row's last non-empty block down to its first
            n_block_min = max_(n_block_min, mask.first_block);
            n_block = settle(min_(n_block_max - 1, mask.last_block));
        } else {
            n_block = settle(n_block_max - 1);
        }
    }
    // kScoreMods: -1 below the window's first block; kMaskMod: past the empty blocks first
    __device__ __forceinline__ int settle(int n) const {
        if constexpr (T::kMaskMod)
            while (n >= n_block_min && mask_block_state<T>(mask, n) == 0) --n;
        if constexpr (T::kScoreMods) return n >= n_block_min ? n : -1;
        return n;
    }
    __device__ __forceinline__ int next() {
        n_block = T::kIsBlockSparse ? sparse.next() : settle(n_block - 1);
        return n_block;
    }
};

// kScoreMods: the first key block of a query block's local window (0 without a left bound).
template <class T> __device__ __forceinline__ int window_block_min(const FwdParams& p, int m0, int seqlen_q,
                                                                    int seqlen_k) {
    if (!T::kScoreMods || p.window_left < 0) return 0;
    return max_(m0 + seqlen_k - seqlen_q - p.window_left, 0) / T::kBlockN;
}

// One tile = kBlockM query rows of one (batch, head). The grid is persistent (at most one CTA per SM): CTA c starts
// with tile c and takes its next tiles from a global atomic counter (dynamic: causal and varlen tiles differ in work),
// so that the producer copies the next tile's Q, K and V while the consumers finish this one. Order: causal, the
// longest query blocks first, over groups of FwdParams::causal_tile_group (batch, head) units (all of them when 0),
// so that a group's K / V stay in L2 between its query blocks; otherwise query blocks fastest (the same reason).
struct FwdTile {
    int m0, batch, head, head_kv, q_start, k_start, seqlen_q, seqlen_k, n_block_max;
};
static_assert(sizeof(FwdTile) == 9 * sizeof(int), "FT_FWD_TILE_RECORD copies FwdTile as 9 ints (fields in order)");
template <class T> __device__ __forceinline__ bool fwd_tile(const FwdParams& p, int tile, int n_mblocks, FwdTile& x) {
    const int n_bh = p.batch * p.nheads;
    int m_block = tile % n_mblocks, bh = tile / n_mblocks;
    if (T::kIsCausal) {
        if (p.causal_tile_group > 0) {
            bh = tile_group_unit(tile, n_mblocks, n_bh, p.causal_tile_group, m_block);
            m_block = n_mblocks - 1 - m_block;
        } else {
            m_block = n_mblocks - 1 - tile / n_bh, bh = tile % n_bh;
        }
    }
    x.batch = bh / p.nheads;
    x.head = bh % p.nheads;
    x.head_kv = x.head / (p.nheads / p.nheads_kv);
    seq_bounds(p, x.batch, x.q_start, x.k_start, x.seqlen_q, x.seqlen_k);
    x.m0 = m_block * T::kBlockM;
    // (kShiftRows: the first tile starts up to kBlockM - 1 rows before the sequence; those rows compute nothing
    // that is kept)
    if constexpr (T::kShiftRows) x.m0 -= ceil_div(x.seqlen_q, T::kBlockM) * T::kBlockM - x.seqlen_q;
    // Key blocks [0, n_block_max) hold every key some row of this block may see.
    x.n_block_max = ceil_div(x.seqlen_k, T::kBlockN);
    if constexpr (T::kIsCausal) {
        const int last_visible = min_(x.seqlen_q, x.m0 + T::kBlockM) + x.seqlen_k - x.seqlen_q;  // exclusive
        x.n_block_max = min_(x.n_block_max, ceil_div(max_(last_visible, 0), T::kBlockN));
    }
    if constexpr (T::kScoreMods && !T::kIsCausal) {  // a window's right bound, as causal's (left: window_block_min)
        int n_block_min = 0;
        window_key_blocks<T::kIsCausal, T::kBlockM, T::kBlockN>(x.m0, x.seqlen_q, x.seqlen_k - x.seqlen_q, -1,
                                                                 p.window_right, n_block_min, x.n_block_max);
    }
    return x.m0 < x.seqlen_q;  // varlen: blocks past a short sequence's end do nothing
}

// The scheduler's unit (utils.cuh tail_unit_tile; without kTailSplit, the tile): its tile and piece (-1: whole)
template <class T> __device__ __forceinline__ int fwd_unit_tile(const FwdSm90Params& params, int unit, int& piece) {
    piece = -1;
    if constexpr (!T::kTailSplit) return unit;
    return tail_unit_tile(unit, params.tail_first, params.tail_pieces, piece);
}
// A piece of tile x: its key blocks [lo, hi) of the tile's ceil(seqlen_k / kBlockN) (non-causal: all of them), evenly
// split, as a tile of its own over the keys from block lo on: k_start and seqlen_k moved, its blocks 0 .. hi - lo - 1
// (the key walk and the masks of the last block unchanged; no dropout, whose bits are addressed by key)
template <class T> __device__ __forceinline__ void fwd_piece_keys(const FwdSm90Params& params, int piece, FwdTile& x) {
    const int n = ceil_div(x.seqlen_k, T::kBlockN), pieces = params.tail_pieces;
    const int lo = piece * n / pieces, hi = (piece + 1) * n / pieces;
    x.k_start += lo * T::kBlockN;
    x.seqlen_k = min_(x.seqlen_k, hi * T::kBlockN) - lo * T::kBlockN;
    x.n_block_max = hi - lo;
}

// kTailSplit, a tail piece's epilogue (one consumer warpgroup cw; its threads' rows g and g + 8 as finish_row left
// them: o normalized, an lse per row): the rows' fp32 O and lse go to the piece's slot of tail_partials (per tail tile,
// piece and warpgroup; float4 k of thread ctid at (k * 128 + ctid) * 4, then its two lse at kDT * 512 + 2 ctid), and
// one thread counts the warpgroup in (an int per tail tile and warpgroup). The warpgroup that completes the count
// writes the rows' result over every piece, lse = log sum_j exp(lse_j) and O = sum_j exp(lse_j - lse) O_j, the pieces
// added in piece order (the same bits whichever piece ends last), straight from the slots to out (4-byte stores of
// column pairs), so that O's registers are free once stored: merging into them kept them live through the merge and
// changed ptxas's allocation of the key-block loop (hd64: 0 -> 20 exponentials ahead of the P V wait; hd256: 832
// bytes of spills).
template <class T, int kDT>
__device__ __forceinline__ void tail_merge(const FwdSm90Params& params, const FwdTile& x, int tail, int piece, int cw,
                                           int ctid, int out_row0, const float (&o)[kDT][4], const float (&lse)[2]) {
    const FwdParams& p = params.fwd;
    constexpr int kFloats = 128 * (4 * kDT + 2);
    auto slot = [&](int j) {
        return params.tail_partials + ((i64)(tail * params.tail_pieces + j) * T::kNConsumers + cw) * kFloats;
    };
    float* mine = slot(piece);
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt)
        *reinterpret_cast<float4*>(mine + 512 * dt + 4 * ctid) = make_float4(o[dt][0], o[dt][1], o[dt][2], o[dt][3]);
    *reinterpret_cast<float2*>(mine + 512 * kDT + 2 * ctid) = make_float2(lse[0], lse[1]);
    if (!tail_count_last(params.tail_counters + tail * T::kNConsumers + cw, params.tail_pieces, T::kBarEpilogue + cw,
                         128, ctid == 0))
        return;
    const int lane = ctid % 32, g = lane >> 2, t = lane & 3;
    const int row = out_row0 + ctid / 32 * 16 + g;  // the thread's first row in the sequence (the second: row + 8)
    float mx[2] = {-infinity(), -infinity()}, total[2] = {0.f, 0.f};
#pragma unroll 1
    for (int j = 0; j < params.tail_pieces; ++j) {
        const float2 l = __ldcg(reinterpret_cast<const float2*>(slot(j) + 512 * kDT + 2 * ctid));
        mx[0] = fmax_(mx[0], l.x), mx[1] = fmax_(mx[1], l.y);
    }
    // exp(lse_j - max) of piece j's two rows (0 for a row no piece saw a key of: its lse stays -inf, O 0)
    auto weights = [&](int j, float (&w)[2]) {
        const float2 l = __ldcg(reinterpret_cast<const float2*>(slot(j) + 512 * kDT + 2 * ctid));
        w[0] = mx[0] == -infinity() ? 0.f : fast_exp2((l.x - mx[0]) * kLog2e);
        w[1] = mx[1] == -infinity() ? 0.f : fast_exp2((l.y - mx[1]) * kLog2e);
    };
#pragma unroll 1
    for (int j = 0; j < params.tail_pieces; ++j) {
        float w[2];
        weights(j, w);
        total[0] += w[0], total[1] += w[1];
    }
    const float inv[2] = {total[0] > 0.f ? 1.f / total[0] : 0.f, total[1] > 0.f ? 1.f / total[1] : 0.f};
    u16* out = (u16*)p.out + x.batch * p.o_batch_stride + (i64)(x.q_start + row) * p.o_row_stride +
               x.head * p.o_head_stride + 2 * t;
    const bool ok0 = row < x.seqlen_q && row >= 0, ok1 = row + 8 < x.seqlen_q && row + 8 >= 0;
#pragma unroll 1
    for (int dt = 0; dt < kDT; ++dt) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 1
        for (int j = 0; j < params.tail_pieces; ++j) {
            float w[2];
            weights(j, w);
            const float4 a = __ldcg(reinterpret_cast<const float4*>(slot(j) + 512 * dt + 4 * ctid));
            acc[0] = fmaf(w[0], a.x, acc[0]), acc[1] = fmaf(w[0], a.y, acc[1]);
            acc[2] = fmaf(w[1], a.z, acc[2]), acc[3] = fmaf(w[1], a.w, acc[3]);
        }
        const bool col_ok = 8 * dt + 2 * t < p.head_dim;  // (the call's head dim; 2 t even: the pair is whole)
        st_global_b32_if(ok0 && col_ok, out + 8 * dt, pack2<T::kIsBF16>(acc[0] * inv[0], acc[1] * inv[0]));
        st_global_b32_if(ok1 && col_ok, out + 8 * p.o_row_stride + 8 * dt,
                         pack2<T::kIsBF16>(acc[2] * inv[1], acc[3] * inv[1]));
    }
    if (t == 0) {
        float* lse_out = p.lse + x.batch * p.lse_batch_stride + x.head * p.lse_head_stride + x.q_start;
        if (ok0) lse_out[row] = total[0] > 0.f ? mx[0] + fast_log2(total[0]) / kLog2e : -infinity();
        if (ok1) lse_out[row + 8] = total[1] > 0.f ? mx[1] + fast_log2(total[1]) / kLog2e : -infinity();
    }
}

// The descriptor of a key-block step's operand kOperand (FT_FWD_DESC64's bit: 1 Q, 2 K, 4 V): in a step without a
// mask (kUnmasked) the bits of FT_FWD_DESC64 pick the 64-bit add (form 2; form 3, on the masked address, in the
// cluster kernels: FT_FWD_DESC64_CLUSTER), otherwise gmma_desc_at's form.
template <class T, int kOperand, bool kUnmasked>
__device__ __forceinline__ u64 fdesc(u32 base, u32 offset_bytes, u32 leading_bytes, u32 stride_bytes) {
    constexpr bool k64 = kUnmasked && (FT_FWD_DESC64 & kOperand) && (T::kCluster == 1 || FT_FWD_DESC64_CLUSTER);
    constexpr int kForm = !k64 ? FT_DESC_ADD : T::kCluster == 1 ? 2 : 3;
    return gmma_desc_form<kForm>(base, offset_bytes, leading_bytes, stride_bytes);
}

template <class T> __device__ __forceinline__ void flash_fwd_sm90(const FwdSm90Params& params) {
    extern __shared__ __align__(128) unsigned char smem[];
    const FwdParams& p = params.fwd;
    constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN, kNT = T::kNT, kDT = T::kDT, kStages = T::kStages;
    using TileQ = typename T::TileQ;
    using TileKV = typename T::TileKV;
    const int tid = threadIdx.x;
    const int wg = warp_uniform(tid / 128);
    const int n_mblocks = ceil_div(p.seqlen_q, kBlockM);
    const int n_tiles = n_mblocks * p.batch * p.nheads;
    const bool varlen = p.cu_seqlens_q != nullptr;  // varlen maps have one batch entry

    const u32 smem_base = (smem_u32(smem) + 1023) & ~1023u;
    // Q buffer b of kQBuffers at sQ0 + b * TileQ::kBytes (tile i in buffer i % kQBuffers); O after them (kSeparateO)
    const u32 sQ0 = smem_base, sO = sQ0 + T::kQBuffers * TileQ::kBytes;
    const u32 sK = T::kSeparateO ? sO + TileQ::kBytes : sO, sV = sK + kStages * TileKV::kBytes;
    const u32 bars = sV + kStages * TileKV::kBytes;
    auto full_q = [&](int b) { return b == 0 ? bars : bars + 8 * (2 + 4 * kStages); };
    auto empty_q = [&](int b) { return full_q(b) + 8; };
    // the tile the consumers work on next, -1 at the end
    auto tile_slot = [&](int b) { return bars + T::kBarrierBytes - 48 * b - 8; };
    // FT_FWD_TILE_RECORD=1: the producer also stores the tile's FwdTile fields (it computes them anyway) for the
    // consumers, whose eight warps would otherwise each redo its divisions and sequence bounds
    auto tile_record = [&](int b) { return bars + T::kBarrierBytes - 48 * b - 48; };
    // kTailSplit: a consumer warpgroup's copy of its tile's unit, read again in the epilogue (after the tile's last S
    // GEMM the producer may write the next unit to the slot), where the clusters' peer barriers would be. The staged
    // epilogue's barriers keep a warpgroup's warps from writing the next tile's unit before all have read this one's;
    // the register epilogue (kDirectO: head dims 192 / 256) has none, so there each warp has a word of its own (its
    // lanes run the tile's wgmmas together: none writes the next unit before all have read this one). (One word per
    // warp everywhere moved hd128's loop: 12 / 12 -> 11 / 11 exponentials ahead of the P V wait.)
    auto unit_copy = [&]() { return bars + 8 * (4 + 4 * kStages) + 4 * (T::kDirectO ? tid / 32 - 4 : wg - 1); };
    auto full_k = [&](int s) { return bars + 8 * (2 + s); };
    auto empty_k = [&](int s) { return bars + 8 * (2 + kStages + s); };
    auto full_v = [&](int s) { return bars + 8 * (2 + 2 * kStages + s); };
    auto empty_v = [&](int s) { return bars + 8 * (2 + 3 * kStages + s); };
    auto peer_empty_k = [&](int s) { return bars + 8 * (4 + 4 * kStages + s); };  // (clusters)
    auto peer_empty_v = [&](int s) { return bars + 8 * (4 + 5 * kStages + s); };
    if (tid == 0) {
#pragma unroll
        for (int b = 0; b < T::kQBuffers; ++b) {
            mbar_init(full_q(b), 1);
            mbar_init(empty_q(b), 4 * T::kNConsumers);  // one arrival per consumer warp
        }
#pragma unroll
        for (int s = 0; s < kStages; ++s) {
            mbar_init(full_k(s), 1);
            mbar_init(full_v(s), 1);
            mbar_init(empty_k(s), 4 * T::kNConsumers);
            mbar_init(empty_v(s), 4 * T::kNConsumers);
            if constexpr (T::kCluster > 1) {
                mbar_init(peer_empty_k(s), 1);  // (the peer's producer)
                mbar_init(peer_empty_v(s), 1);
            }
        }
        mbar_fence_init();
    }
    __syncthreads();
    if constexpr (T::kCluster > 1) cluster_sync();  // both CTAs' barriers are set up before either signals the other's
    if (threadIdx.x == 0) FT_TIMELINE_START();

    if (wg == 0) {
        // ------------------------------------------------------------------------------------------ producer
        setmaxnreg_dec<T::kProducerRegs>();
        if (tid == 0) {
            tma_prefetch_desc(&params.tma_q);
            tma_prefetch_desc(&params.tma_k);
            tma_prefetch_desc(&params.tma_v);
            int it = 0, tile_iter = 0;  // key blocks and tiles so far: stage and phase of the rings
            // Varlen: the tiles past a short sequence's end are skipped here; the consumers see only real ones.
            // (kTailSplit: units, fwd_unit_tile; otherwise units are tiles)
            const int n_units = T::kTailSplit ? tail_units(n_tiles, params.tail_first, params.tail_pieces) : n_tiles;
            auto next_tile = [&](int tile) {
                if constexpr (T::kCluster > 1 || FT_FWD_STATIC) return tile + (int)gridDim.x;  // (static)
                // n_units fetches in all (gridDim.x <= n_units): units gridDim.x .. n_units - 1, then one past the
                // end per CTA; the fetch of n_units - 1 is the launch's last, so it resets the counter.
                const int fetched = atomic_fetch_add(params.tile_counter, 1);
                if (fetched == n_units - 1) atomic_store(params.tile_counter, 0);
                return fetched + (int)gridDim.x;
            };
            FwdTile x;
            for (int tile = blockIdx.x;; tile = next_tile(tile)) {  // (tile: the unit)
                if constexpr (T::kTailSplit) {
                    if (tile < n_units) {
                        int piece;
                        const int tile_index = fwd_unit_tile<T>(params, tile, piece);
                        if (!fwd_tile<T>(p, tile_index, n_mblocks, x)) continue;
                        if (piece >= 0) fwd_piece_keys<T>(params, piece, x);  // (the record holds the piece's keys)
                    }
                } else if (tile < n_tiles && !fwd_tile<T>(p, tile, n_mblocks, x)) {
                    continue;
                }
                const int qb = tile_iter % T::kQBuffers;
                const u32 sQ = sQ0 + qb * TileQ::kBytes;
                // the consumers' last S GEMM of the buffer's previous tile is done
                mbar_wait(empty_q(qb), ((tile_iter / T::kQBuffers) & 1) ^ 1);
                atomic_store_shared(tile_slot(qb), tile < n_units ? tile : -1);  // (ordered by empty_q / full_q)
                if (FT_FWD_TILE_RECORD && tile < n_units) {
                    const int fields[9] = {x.m0,      x.batch,    x.head,     x.head_kv,    x.q_start,
                                           x.k_start, x.seqlen_q, x.seqlen_k, x.n_block_max};
#pragma unroll
                    for (int i = 0; i < 9; ++i) atomic_store_shared(tile_record(qb) + 4 * i, fields[i]);
                }
                if (tile >= n_units) {
                    mbar_arrive(full_q(qb));  // no copy: the consumers read the end mark and stop
                    break;
                }
                const int batch_coord = varlen ? 0 : x.batch;
                mbar_arrive_expect_tx(full_q(qb), TileQ::kBytes);
#pragma unroll
                for (int cb = 0; cb < T::kColBlocks; ++cb)
                    tma_load_4d(sQ + cb * kBlockM * 128, &params.tma_q, full_q(qb), cb * 64, x.q_start + x.m0, x.head,
                                batch_coord);
                KeyBlockWalk<T> walk(p, x.head, x.m0, x.n_block_max,
                                     window_block_min<T>(p, x.m0, x.seqlen_q, x.seqlen_k),
                                     mask_row<T>(p, x.batch, x.head, x.m0, x.seqlen_k));
                for (; walk.n_block >= 0; walk.next(), ++it) {
                    const int stage = it % kStages;
                    const u32 parity = ((it / kStages) & 1) ^ 1;  // the first pass finds every stage empty
                    const int row = x.k_start + walk.n_block * kBlockN;
                    // Clusters: the stage is free once both CTAs' consumers released it (this CTA's did: tell the
                    // peer's producer, wait for its word; the first pass has nothing to release), and this CTA's
                    // half is copied into both CTAs, whose full barriers count both halves. (The multicast also
                    // orders the hand-overs: a CTA's consumers need the peer's half of a stage, copied after the
                    // peer's wait, before they release it again, so no producer completes two phases of the peer's
                    // peer_empty barrier before the peer has waited for the first.) K, then V.
                    auto load = [&](u32 empty, u32 peer_empty, u32 full, u32 dst, const TmaDesc* desc) {
#if defined(FT_STEPS) && FT_STEPS > 1  // (the loader's marks: its own stores sit on its sub-partition)
                        FT_STEP_MARK(0, it, full == full_k(stage) ? 0 : 2);
#endif
                        mbar_wait(empty, parity);
#if defined(FT_STEPS) && FT_STEPS > 1
                        FT_STEP_MARK(0, it, full == full_k(stage) ? 1 : 3);
#endif
                        if constexpr (T::kCluster > 1) {
                            mbar_arrive_peer_if(it >= kStages, peer_empty);
                            mbar_wait(peer_empty, parity);
                        }
                        mbar_arrive_expect_tx(full, TileKV::kBytes);
                        if constexpr (T::kCluster > 1 && T::kColBlocks == 1) {  // (the map's boxes: kBlockN / 2 rows)
                            tma_load_4d_multicast_rows(dst, desc, full, kBlockN / 2 * 128, kBlockN / 2, row,
                                                       x.k_start + x.seqlen_k - 1, x.head_kv, batch_coord);
                        } else if constexpr (T::kCluster > 1) {
                            tma_load_4d_multicast_pair(dst, desc, full, kBlockN * 128, row, x.head_kv, batch_coord);
                        } else {
#pragma unroll
                            for (int cb = 0; cb < T::kColBlocks; ++cb)
                                tma_load_4d(dst + cb * kBlockN * 128, desc, full, cb * 64, row, x.head_kv,
                                            batch_coord);
                        }
                    };
                    load(empty_k(stage), peer_empty_k(stage), full_k(stage), sK + stage * TileKV::kBytes,
                         &params.tma_k);
                    load(empty_v(stage), peer_empty_v(stage), full_v(stage), sV + stage * TileKV::kBytes,
                         &params.tma_v);
                }
                ++tile_iter;
            }
        }
        if constexpr (T::kCluster > 1) cluster_sync();  // (with the consumers' at their end)
        return;
    }

    // ---------------------------------------------------------------------------------------------- consumers
    setmaxnreg_inc<T::kConsumerRegs>();
    const int cw = wg - 1;                     // consumer index: rows [64 cw, 64 cw + 64) of the block
    const int ctid = tid - 128 * wg, lane = tid % 32;
    const int g = lane >> 2, t = lane & 3;
    const int wg_row0 = T::kSplitD ? 0 : cw * 64;      // the warpgroup's first row inside the block
    const int row0 = wg_row0 + ctid / 32 * 16;         // this warp's first row inside the block
    const int col0 = T::kSplitD ? cw * T::kDCols : 0;  // its first column of O (kSplitD: of S's reduction too)
    const bool lead_lane = lane == 0;
    const DropoutRng rng = T::kIsDropout ? DropoutRng(p.rng_state, p.keep_threshold) : DropoutRng{};

    // Ping-pong: consumer c waits for its turn on barrier 1 + c and hands the turn over to the next after issuing
    // (the other one; with three, c + 1 mod 3). All walk the same key blocks of a tile, so they strictly alternate,
    // across tiles too: the last consumer hands the turn over after its last issue of a tile as well, so consumer 0
    // issues the next tile's first S GEMM while the others still run their last P V products and epilogues. Consumer
    // 0 gets the first turn before the first tile and takes the last consumer's last hand-over when there are no
    // more tiles. (H200, same run, forward TFLOP/s vs
    // each tile starting only once consumer 1 was done with the previous one: head dim 128 non-causal 512 / 1K / 4K
    // 522 / 604 / 672 vs 501 / 585 / 628; causal head dim 64 +1-2%, 128 equal.)
    auto schedule_wait = [&]() {
        if constexpr (T::kPingPong) named_bar_sync(T::kBarSchedule + cw, 256);
    };
    auto schedule_pass = [&]() {
        if constexpr (T::kPingPong) named_bar_arrive(T::kBarSchedule + (cw + 1) % T::kNConsumers, 256);
    };
    if constexpr (T::kPingPong)
        if (cw == T::kNConsumers - 1) named_bar_arrive(T::kBarSchedule, 256);

    int it = 0;
    for (int tile_iter = 0;; ++tile_iter) {
        FT_TIMELINE_MARK(wg, tile_iter, 0);
        const int qb = tile_iter % T::kQBuffers;
        const u32 sQ = sQ0 + qb * TileQ::kBytes, empty_qb = empty_q(qb);
        mbar_wait(full_q(qb), (tile_iter / T::kQBuffers) & 1);  // Q landed, or the end mark
        FT_TIMELINE_MARK(wg, tile_iter, 1);
        const int tile = ld_shared_b32(tile_slot(qb));
        if (tile < 0) {
            if constexpr (T::kPingPong)
                if (cw == 0) schedule_wait();  // the last consumer's last hand-over
            break;
        }
        FwdTile x;
        // kTailSplit: a piece is a tile over its keys (fwd_piece_keys; the record holds them), and the unit is kept in
        // shared memory for the epilogue (in registers through the key-block loop it changed ptxas's schedule of the
        // loop: hd64, 0 -> 21 exponentials ahead of the P V wait); every thread stores it (unit_copy).
        if constexpr (T::kTailSplit) st_shared_b32(unit_copy(), tile);
        if constexpr (FT_FWD_TILE_RECORD) {
            int fields[9];
#pragma unroll
            for (int i = 0; i < 9; ++i) fields[i] = ld_shared_b32(tile_record(qb) + 4 * i);
            x = FwdTile{fields[0], fields[1], fields[2], fields[3], fields[4],
                        fields[5], fields[6], fields[7], fields[8]};
        } else {
            int piece = -1;
            fwd_tile<T>(p, T::kTailSplit ? fwd_unit_tile<T>(params, tile, piece) : tile, n_mblocks, x);
            if (T::kTailSplit && piece >= 0) fwd_piece_keys<T>(params, piece, x);
        }
        const int m0 = x.m0, seqlen_q = x.seqlen_q, seqlen_k = x.seqlen_k;
        float o[kDT][4];
#pragma unroll
        for (int i = 0; i < kDT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
        float row_max[2] = {-infinity(), -infinity()}, row_sum[2] = {0.f, 0.f};  // rows g, g + 8 (partial sums)
        u32 pa[kNT / 2][4];  // P of the previous block as wgmma A fragments (16 keys per k-step)
        const int bh = x.batch * p.nheads + x.head;
        [[maybe_unused]] const MaskRow mm_row = mask_row<T>(p, x.batch, x.head, m0, seqlen_k);

        // S of the block's first 8 * (tiles of s) keys (all kBlockN of them, or the lower half: FT_FWD_HALF_FIRST)
        auto issue_s = [&](auto& s, int stage, auto unmasked) {
            constexpr bool kUnmasked = decltype(unmasked)::value;
            constexpr int kCols = sizeof(s) / sizeof(s[0]) * 8;
            const u32 k_tile = sK + stage * TileKV::kBytes;
#pragma unroll
            for (int k = 0; k < T::kDCols / 16; ++k) {
                const int kk = col0 / 16 + k;  // k-step of the head dim
                const u64 desc_q =
                    fdesc<T, 1, kUnmasked>(sQ + wg_row0 * 128, (kk / 4) * kBlockM * 128 + (kk % 4) * 32, 16, 1024);
                const u64 desc_k =
                    fdesc<T, 2, kUnmasked>(k_tile, (kk / 4) * kBlockN * 128 + (kk % 4) * 32, 16, 1024);
                wgmma_ss<kCols, T::kIsBF16>(s, desc_q, desc_k, k > 0);
            }
            wgmma_commit();
        };
        auto issue_pv = [&](int stage, auto unmasked) {
            constexpr bool kUnmasked = decltype(unmasked)::value;
            const u32 v_tile = sV + stage * TileKV::kBytes;
#pragma unroll
            for (int ks = 0; ks < kNT / 2; ++ks)
                wgmma_rs<T::kDCols, T::kIsBF16>(o, pa[ks],
                                                fdesc<T, 4, kUnmasked>(v_tile + (col0 / 64) * kBlockN * 128,
                                                                       ks * 16 * 128, kBlockN * 128, 1024),
                                                1);
            wgmma_commit();
        };
        // FT_FWD_REF_MAX=2 (kRefMaxMode): this warp's 16 rows of S of the key block in stage `stage` again, by mma.sync
        // from the Q and K tiles (utils.cuh warp_gemm_ss: SmemTile's 64-column blocks are TMA's 128-byte swizzle)
        auto recompute_s = [&](float (&s)[kNT][4], int stage) {
            float(&acc)[1][kNT][4] = reinterpret_cast<float(&)[1][kNT][4]>(s);
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
            warp_gemm_ss<T::kIsBF16, 1, kNT, T::kDCols, false, false>(
                acc, a_frag_ptr<TileQ, false>(sQ, row0, col0, lane),
                b_frag_ptr<TileKV, false>(sK + stage * TileKV::kBytes, 0, col0, lane));
        };
        auto mask = [&](auto& s, int n_block) {
            constexpr int kTiles = sizeof(s) / sizeof(s[0]);
            const int n0 = n_block * kBlockN;
            if constexpr (T::kScoreMods) {  // the window's two bounds (causal: the right one is the diagonal)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int row = m0 + row0 + g + 8 * hf;
                    int col_end = T::kIsCausal ? min_(seqlen_k, row + 1 + seqlen_k - seqlen_q) : seqlen_k;
                    if (!T::kIsCausal && p.window_right >= 0)
                        col_end = min_(col_end, row + 1 + seqlen_k - seqlen_q + p.window_right);
                    const int col_begin = p.window_left >= 0 ? row + seqlen_k - seqlen_q - p.window_left : 0;
#pragma unroll
                    for (int nt = 0; nt < kTiles; ++nt)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int col = n0 + nt * 8 + 2 * t + e;
                            if (col >= col_end || col < col_begin) s[nt][2 * hf + e] = -infinity();
                        }
                }
                if constexpr (T::kMaskMod) {  // the expression per pair of a block with a partial state
                    if (mask_block_state<T>(mm_row, n_block) == 1) {
#pragma unroll
                        for (int hf = 0; hf < 2; ++hf) {
                            const int row = m0 + row0 + g + 8 * hf;
                            if (row >= seqlen_q) continue;  // (pairs past either end are never evaluated: a
                                                            // subscript there could leave its tensor)
#pragma unroll
                            for (int nt = 0; nt < kTiles; ++nt)
#pragma unroll
                                for (int e = 0; e < 2; ++e) {
                                    const int col = n0 + nt * 8 + 2 * t + e;
                                    if (col < seqlen_k && !mask_mod_visible(p.mm, x.batch, x.head, row, col))
                                        s[nt][2 * hf + e] = -infinity();
                                }
                        }
                    }
                }
                return;
            }
            if constexpr (T::kIsCausal && FT_FWD_MASK_SHARED) {
                // (FT_FWD_MASK_SHARED=1) Row g + 8 sees 8 more keys than row g, so its test for n8 tile nt is row g's
                // for tile nt - 1: one compare per score pair of the two rows instead of two (104 SASS instructions
                // fewer per kernel; H200, same process, causal forward 1.004-1.013x at 512-4K, hd64 and hd128,
                // 2026-11-25). Rows past seqlen_q, whose limit seqlen_k would clamp, are not stored.
                // row g keeps score (nt, e) iff 8 nt + e < lim
                const int lim = m0 + row0 + g + 1 + seqlen_k - seqlen_q - n0 - 2 * t;
#pragma unroll
                for (int nt = 0; nt < kTiles; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        if (8 * nt + e >= lim) s[nt][e] = -infinity();
                        if (8 * (nt - 1) + e >= lim) s[nt][2 + e] = -infinity();
                    }
                return;
            }
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int row = m0 + row0 + g + 8 * hf;
                const int col_end = T::kIsCausal ? min_(seqlen_k, row + 1 + seqlen_k - seqlen_q) : seqlen_k;
#pragma unroll
                for (int nt = 0; nt < kTiles; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        if (n0 + nt * 8 + 2 * t + e >= col_end) s[nt][2 * hf + e] = -infinity();
            }
        };
        // P as A fragments; the k-steps past a half block's are zero (its P V product runs over the whole block)
        auto pack_p = [&](const auto& s) {
            constexpr int kTiles = sizeof(s) / sizeof(s[0]);
#pragma unroll
            for (int ks = kTiles / 2; ks < kNT / 2; ++ks) pa[ks][0] = pa[ks][1] = pa[ks][2] = pa[ks][3] = 0u;
#pragma unroll
            for (int ks = 0; ks < kTiles / 2; ++ks) {
                pa[ks][0] = pack2<T::kIsBF16>(s[2 * ks][0], s[2 * ks][1]);
                pa[ks][1] = pack2<T::kIsBF16>(s[2 * ks][2], s[2 * ks][3]);
                pa[ks][2] = pack2<T::kIsBF16>(s[2 * ks + 1][0], s[2 * ks + 1][1]);
                pa[ks][3] = pack2<T::kIsBF16>(s[2 * ks + 1][2], s[2 * ks + 1][3]);
            }
        };
        auto needs_mask = [&](int n_block) {
            if constexpr (T::kScoreMods) {  // also where some row's window starts inside the block or ends before it
                const int n0 = n_block * kBlockN, offset = seqlen_k - seqlen_q;
                const int last_row = min_(seqlen_q, m0 + kBlockM) - 1;
                return tile_needs_mask<T::kIsCausal, kBlockN>(m0, n0, seqlen_q, seqlen_k) ||
                       window_cuts_tile<T::kIsCausal, kBlockN>(m0, last_row, n0, offset, p.window_left,
                                                               p.window_right) ||
                       (T::kMaskMod && mask_block_state<T>(mm_row, n_block) == 1);
            }
            return tile_needs_mask<T::kIsCausal, kBlockN>(m0, n_block * kBlockN, seqlen_q, seqlen_k);
        };
        // kSplitD: S = the two warpgroups' partial sums over their halves of the head dim (buffers by key block parity;
        // thread i of both stores / reads the same elements, 16 bytes per n8 tile)
        auto sum_partial_s = [&](auto& s, int block_it) {
            if constexpr (T::kSplitD) {
                constexpr int kTiles = sizeof(s) / sizeof(s[0]);
                const u32 buf = bars + T::kBarrierBytes + (block_it & 1) * (T::kPartialSBytes / 2);
#pragma unroll
                for (int nt = 0; nt < kTiles; ++nt) st_shared_v4f(buf + ((cw * kNT + nt) * 128 + ctid) * 16, s[nt]);
                named_bar_sync(T::kBarPartialS, 256);
#pragma unroll
                for (int nt = 0; nt < kTiles; ++nt) {
                    float other[4];
                    ld_shared_v4f(buf + (((1 - cw) * kNT + nt) * 128 + ctid) * 16, other);
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[nt][e] += other[e];
                }
            }
        };
        // kScoreMods: softcap and ALiBi on a block's scores, before its masks
        const float alibi_scaled = T::kAlibi && p.alibi_slopes != nullptr
                                       ? p.alibi_slopes[x.batch * p.alibi_batch_stride + x.head] / p.softmax_scale
                                       : 0.f;
        // FT_FWD_POLY_EXP (above; off): with softcap, whose tanh shares the MUFU pipe with the exponentials, half of
        // them on the FMA pipe
        const bool poly_exp = T::kSoftcap && FT_FWD_POLY_EXP && p.softcap_scale != 0.f;
        // ALiBi by rows where the warp's block lies on one side of the diagonal (utils.cuh alibi_by_rows: one FFMA per
        // score, each row's bias to softmax_exp_row), else per score (apply_score_mods). Not in the softcap variant
        // (the calls with softcap), which stays as it was: there it added spills (hd256 causal 28 -> 36 bytes).
        constexpr bool kRowBias = T::kAlibi && !T::kSoftcap;
        float row_bias[2] = {0.f, 0.f};
        auto score_mods = [&](auto& s, int n_block) {
            const int col0 = n_block * kBlockN, offset = seqlen_k - seqlen_q;
            if constexpr (T::kSoftcap) {  // softcap first, then ALiBi (the reference's order)
                apply_score_mods(s, p.softcap_scale, p.softcap_unscale, alibi_scaled, m0 + row0, col0, offset, lane);
            } else if constexpr (kRowBias) {
                row_bias[0] = row_bias[1] = 0.f;
                if (alibi_scaled != 0.f &&
                    !alibi_by_rows<T::kIsCausal>(s, alibi_scaled, m0 + row0, col0, offset, lane, row_bias))
                    apply_score_mods(s, 0.f, 0.f, alibi_scaled, m0 + row0, col0, offset, lane);
            }
        };

        KeyBlockWalk<T> walk(p, x.head, m0, x.n_block_max, window_block_min<T>(p, m0, seqlen_q, seqlen_k), mm_row);
        FT_TIMELINE_PUT(wg, tile_iter, 6, (unsigned long long)it);
        // A consumer whose 64 rows all lie past the sequence end (the partial last tile of 192-row tiles at S = 512 /
        // 1K; varlen) computes nothing: it only keeps the stage rings and the turns in step. (H200, each its own
        // process, hd64 non-causal forward TFLOP/s with / without: 512 392 / 370, 1K 448 / 424, 4K 517 / 508.)
        const bool idle = m0 + wg_row0 >= seqlen_q || (T::kShiftRows && m0 + wg_row0 + 64 <= 0);
        if (walk.n_block < 0) {
            if (lead_lane) mbar_arrive(empty_qb);  // nothing to read: Q is free at once
        } else if (idle) {
            for (; walk.n_block >= 0; ++it) {
                const int stage = it % kStages;
                const u32 parity = (it / kStages) & 1;
                mbar_wait(full_k(stage), parity);  // (the stage is released only once filled: arrivals stay in phase)
                schedule_wait();
                const bool last = walk.next() < 0;
                schedule_pass();
                mbar_wait(full_v(stage), parity);
                if (lead_lane) {
                    mbar_arrive(empty_k(stage));
                    mbar_arrive(empty_v(stage));
                    if (last) mbar_arrive(empty_qb);
                }
            }
        } else {
            // First block: S only (there is no P V product to overlap yet). FT_FWD_HALF_FIRST: S of the lower
            // kBlockN / 2 keys when none of the upper half is visible to this warpgroup's rows (the first block is the
            // last one any of its rows sees).
            auto first_block = [&](auto cols_tag) {
                float s[decltype(cols_tag)::value / 8][4];
                const int n_block = walk.n_block, stage = it % kStages;
                FT_STEP_MARK(wg, it, 0);
                mbar_wait(full_k(stage), (it / kStages) & 1);
                schedule_wait();
                FT_STEP_MARK(wg, it, 1);
                wgmma_fence();
                issue_s(s, stage, BoolConstant<false>{});
                FT_STEP_MARK(wg, it, 2);
                const bool last = walk.next() < 0;
                schedule_pass();
                wgmma_wait<0>();
                fence_operand(s);
                FT_STEP_MARK(wg, it, 3);
                FT_TIMELINE_MARK(wg, tile_iter, 2);
                if (lead_lane) {
                    mbar_arrive(empty_k(stage));
                    if (last) mbar_arrive(empty_qb);
                }
                sum_partial_s(s, it);
                score_mods(s, n_block);
                if (needs_mask(n_block)) mask(s, n_block);
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    if (poly_exp)  // (softcap only: no row bias)
                        softmax_exp_row<sizeof(s) / sizeof(s[0]), T::kSoftcap>(s, hf, row_max[hf], row_sum[hf],
                                                                              p.softmax_scale_log2);
                    else softmax_exp_row<sizeof(s) / sizeof(s[0]), false, kRowBias>(
                            s, hf, row_max[hf], row_sum[hf], p.softmax_scale_log2, row_bias[hf]);
                }
                if constexpr (T::kIsDropout) rng.drop(s, bh, m0 + row0 + g, n_block * kBlockN + 2 * t);
                pack_p(s);
                FT_STEP_MARK(wg, it, 6);
                ++it;
            };
            if constexpr (FT_FWD_HALF_FIRST && kBlockN == 128) {
                // keys [0, seen_end) of the sequence are visible to some row of this warpgroup
                const int seen_end =
                    T::kIsCausal ? min_(seqlen_k, m0 + wg_row0 + 64 + seqlen_k - seqlen_q) : seqlen_k;
                if (seen_end <= walk.n_block * kBlockN + kBlockN / 2) first_block(IntConstant<kBlockN / 2>{});
                else first_block(IntConstant<kBlockN>{});
            } else {
                first_block(IntConstant<kBlockN>{});
            }
            // Later blocks: S of this block overlapped with P V of the previous one.
#ifdef FT_FWD_RESCALE_EARLY
            constexpr bool kRescaleEarly = FT_FWD_RESCALE_EARLY && T::kHeadDim > 128 && !T::kSplitD;
#else
            constexpr bool kRescaleEarly = T::kHeadDim == 192;
#endif
            float pending[2] = {1.f, 1.f};  // kRescaleEarly: the correction O still owes (the first block: none)
            // kLazyRescale: O rescaled only where a row of the warp moved its max
            auto rescale_o = [&](const float (&correction)[2]) {
                if (!T::kLazyRescale || __any_sync(0xffffffffu, correction[0] != 1.f || correction[1] != 1.f)) {
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf) rescale_row(o, hf, correction[hf]);
                }
            };
            auto rescale_pending = [&]() {
                if constexpr (kRescaleEarly) {
                    fence_operand(o);
                    rescale_o(pending);
                    fence_operand(o);
                    wgmma_fence();  // (O's registers written since the fence before the S GEMM)
                }
            };
            auto step = [&](auto mask_tag) {
                constexpr bool kMask = decltype(mask_tag)::value;
                const int n_block = walk.n_block;
                const int stage = it % kStages, prev = (it - 1) % kStages;
                float s[kNT][4];
                FT_STEP_MARK(wg, it, 0);
                mbar_wait(full_k(stage), (it / kStages) & 1);
                mbar_wait(full_v(prev), ((it - 1) / kStages) & 1);  // copied before K[stage]: no wait in practice
                schedule_wait();
                FT_STEP_MARK(wg, it, 1);
                wgmma_fence();
                issue_s(s, stage, BoolConstant<!kMask>{});
                rescale_pending();
                issue_pv(prev, BoolConstant<!kMask>{});
                FT_STEP_MARK(wg, it, 2);
                const bool last = walk.next() < 0;
                schedule_pass();
                wgmma_wait<1>();  // S done; P V may still run
                fence_operand(s);
                FT_STEP_MARK(wg, it, 3);
                constexpr bool kArrivePred = FT_FWD_ARRIVE_PRED && !T::kIsDropout;
                // FT_FWD_REF_MAX (above): no block max in the unmasked steps; =2 keeps K and Q until its check
                constexpr bool kRefMax = T::kRefMaxMode && !kMask && !T::kScoreMods && !T::kSplitD && !T::kIsDropout;
                constexpr bool kRefSafe = kRefMax && T::kRefMaxMode == 2;
                if constexpr (!kRefSafe) {
                    if constexpr (kArrivePred) {
                        mbar_arrive_if(lead_lane, empty_k(stage));
                        mbar_arrive_if(lead_lane && last, empty_qb);
                    } else if (lead_lane) {
                        mbar_arrive(empty_k(stage));
                        if (last) mbar_arrive(empty_qb);
                    }
                }
                sum_partial_s(s, it);
                score_mods(s, n_block);
                if constexpr (kMask) mask(s, n_block);
                float correction[2] = {1.f, 1.f}, block_sum[2] = {0.f, 0.f};  // (kRefSafe: the sums, unchecked)
                if constexpr (kRefMax) {
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf)
                        softmax_exp_row<kNT, false, false, false, true>(s, hf, row_max[hf],
                                                                        kRefSafe ? block_sum[hf] : row_sum[hf],
                                                                        p.softmax_scale_log2);
                } else {
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf)
                        correction[hf] =
                            poly_exp ? softmax_exp_row<kNT, T::kSoftcap>(s, hf, row_max[hf], row_sum[hf],
                                                                         p.softmax_scale_log2)
                                     : softmax_exp_row<kNT, false, kRowBias, T::kLazyRescale>(
                                           s, hf, row_max[hf], row_sum[hf], p.softmax_scale_log2, row_bias[hf]);
                }
                if constexpr (T::kIsDropout) rng.drop(s, bh, m0 + row0 + g, n_block * kBlockN + 2 * t);
                // every thread's partial sums at most 2^kLazyMaxLog2 (false for inf and NaN): the exponentials
                // stand; otherwise the warp's S again and the plain softmax
                constexpr float kLimit = 1 << (int)kLazyMaxLog2;
                bool ref_ok = true;
                if constexpr (kRefSafe) {
                    ref_ok = __all_sync(0xffffffffu, block_sum[0] <= kLimit && block_sum[1] <= kLimit);
                    if (ref_ok) {
                        row_sum[0] += block_sum[0];
                        row_sum[1] += block_sum[1];
                    } else {
                        // (O is rescaled once P V is done, below. The max always moves here, lazy kernels too: a row
                        // 3-8 binary orders above the running max would otherwise fail the check again at every block)
                        recompute_s(s, stage);
#pragma unroll
                        for (int hf = 0; hf < 2; ++hf)
                            correction[hf] =
                                softmax_exp_row<kNT>(s, hf, row_max[hf], row_sum[hf], p.softmax_scale_log2);
                    }
                    mbar_arrive_if(lead_lane, empty_k(stage));  // (the releases held back above, after the check)
                    mbar_arrive_if(lead_lane && last, empty_qb);
                }
                FT_STEP_MARK(wg, it, 4);
                wgmma_wait<0>();  // P V done: O and the P registers are free
                fence_operand(o);
                FT_STEP_MARK(wg, it, 5);
                if constexpr (kArrivePred) mbar_arrive_if(lead_lane, empty_v(prev));
                else if (lead_lane) mbar_arrive(empty_v(prev));
                if constexpr (kRefSafe && !kRescaleEarly) {
                    if (!ref_ok) rescale_o(correction);
                }
                if constexpr (kRescaleEarly) pending[0] = correction[0], pending[1] = correction[1];
                else if constexpr (!kRefMax) rescale_o(correction);
                pack_p(s);
                FT_STEP_MARK(wg, it, 6);
                ++it;
            };
            while (walk.n_block >= 0) {
                if (needs_mask(walk.n_block)) step(BoolConstant<true>{});
                else step(BoolConstant<false>{});
            }
            // The last block's P V.
            FT_TIMELINE_MARK(wg, tile_iter, 3);
            const int last_stage = (it - 1) % kStages;
            mbar_wait(full_v(last_stage), ((it - 1) / kStages) & 1);
            fence_operand(o);
            wgmma_fence();
            rescale_pending();
            issue_pv(last_stage, BoolConstant<false>{});
            wgmma_wait<0>();
            fence_operand(o);
            FT_TIMELINE_MARK(wg, tile_iter, 4);
            if (lead_lane) mbar_arrive(empty_v(last_stage));
        }

        // Epilogue: out = O / l, lse = m * scale + ln(l); O from the registers (kDirectO) or staged through this
        // warpgroup's rows of the O buffer.
        float* lse = p.lse + x.batch * p.lse_batch_stride + x.head * p.lse_head_stride + x.q_start;
        // kTailSplit: a tail piece writes out and lse only where it completes the tile (tail_merge)
        bool write = true;
        if constexpr (!T::kTailSplit) {
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const float sum = finish_row<T::kIsDropout>(o, hf, row_sum[hf], p.rp_dropout);
                const int row = m0 + row0 + g + 8 * hf;
                if (t == 0 && row < seqlen_q && row >= 0 && col0 == 0)
                    lse[row] = row_lse(sum, row_max[hf], p.softmax_scale);
            }
        } else {
            float row_lses[2];
#pragma unroll
            for (int hf = 0; hf < 2; ++hf)
                row_lses[hf] = row_lse(finish_row<T::kIsDropout>(o, hf, row_sum[hf], p.rp_dropout), row_max[hf],
                                       p.softmax_scale);
            int unit_piece;
            const int unit_tile = fwd_unit_tile<T>(params, ld_shared_b32(unit_copy()), unit_piece);
            if (unit_piece >= 0) {  // (every tail piece: the one that completes the tile writes its result itself)
                tail_merge<T>(params, x, unit_tile - params.tail_first, unit_piece, cw, ctid, m0 + wg_row0, o,
                              row_lses);
                write = false;
            }
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int row = m0 + row0 + g + 8 * hf;
                if (write && t == 0 && row < seqlen_q && row >= 0 && col0 == 0) lse[row] = row_lses[hf];
            }
        }
        const int rows_valid = seqlen_q - m0 - wg_row0, rows_first = -(m0 + wg_row0);  // rows [rows_first, rows_valid)
        auto out_rows = [&]() {  // the warpgroup's first row of out (the register and 16-byte stores)
            return (u16*)p.out + x.batch * p.o_batch_stride + (i64)(x.q_start + m0 + wg_row0) * p.o_row_stride +
                   x.head * p.o_head_stride + col0;
        };
        if constexpr (T::kDirectO) {
            // Each half-row's pointer is computed once and its kDT stores take immediate offsets from it, predicated on
            // the row (no branches), and on the column where the call's head dim ends before kDCols (the 4-byte
            // form: one warp-uniform branch between the two cases).
            // (Behind a branch per store ptxas rebuilt the 64-bit address for each: ~25 SASS instructions per store,
            // ~1960 per warp and tile at hd256 causal against ~430 this way. H200, interleaved CUDA-graph A/B, forward,
            // this form / branches: hd256 causal 4K 1.017, 1K 1.045, full 2K 1.036, 16K 1.017; hd192 causal 4K 1.019,
            // 1K 1.056, full 16K 1.002.)
            const int cols = p.head_dim - col0;  // columns of the call's head dim from this warpgroup's first
#if FT_FWD_O_SECTORS
            // Whole 32-byte sectors per store: a quad holds a row's 16 columns of an n8 tile pair (2 per lane and
            // tile); one exchange between lanes t and t ^ 1 leaves each lane 4 adjacent columns (even t: the first
            // tile's 2t .. 2t + 3, odd t: the second's 2t - 2 .. 2t + 1), one 8-byte store: half the store
            // instructions, each writing whole sectors where a 4-byte store wrote half of 8 sectors. H200, interleaved
            // CUDA-graph A/B, forward, 4-byte / 8-byte: hd256 causal 4K 0.938, 1K 0.876; hd192 causal 4K 0.943; hd128
            // 192-key tiles at 16K 0.984-0.993; ncu: the same DRAM bytes either way (kernel_ab-h200.json).
            static_assert(kDT % 2 == 0, "n8 tile pairs");
            const bool odd = t & 1;
            u16* out = out_rows() + (odd ? 8 + 2 * (t - 1) : 2 * t);
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int row = row0 - wg_row0 + g + 8 * hf;
                const bool row_ok = write && row < rows_valid && row >= rows_first;
                u16* out_row = out + (i64)row * p.o_row_stride;
#pragma unroll
                for (int dp = 0; dp < kDT / 2; ++dp) {
                    const u32 a = pack2<T::kIsBF16>(o[2 * dp][2 * hf], o[2 * dp][2 * hf + 1]);
                    const u32 b = pack2<T::kIsBF16>(o[2 * dp + 1][2 * hf], o[2 * dp + 1][2 * hf + 1]);
                    const u32 recv = __shfl_xor_sync(0xffffffffu, odd ? a : b, 1);
                    const bool col_ok = cols >= T::kDCols || 16 * dp + (odd ? 8 : 0) < cols;
                    st_global_v2_if(row_ok && col_ok, out_row + 16 * dp, odd ? recv : a, odd ? b : recv);
                }
            }
#else
            u16* out = out_rows() + 2 * t;
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int row = row0 - wg_row0 + g + 8 * hf;
                const bool row_ok = write && row < rows_valid && row >= rows_first;
                u16* out_row = out + (i64)row * p.o_row_stride;
                if (cols >= T::kDCols) {
#pragma unroll
                    for (int dt = 0; dt < kDT; ++dt)
                        st_global_b32_if(row_ok, out_row + 8 * dt,
                                         pack2<T::kIsBF16>(o[dt][2 * hf], o[dt][2 * hf + 1]));
                } else {
#pragma unroll
                    for (int dt = 0; dt < kDT; ++dt)
                        st_global_b32_if(row_ok && 8 * dt < cols, out_row + 8 * dt,
                                         pack2<T::kIsBF16>(o[dt][2 * hf], o[dt][2 * hf + 1]));
                }
            }
#endif
        } else {
            // (the warpgroup's reads of the previous tile's O, or the copy engine's, are done)
            if (T::kTmaStoreO && ctid == 0) bulk_wait_read<0>();
            named_bar_sync(T::kBarEpilogue + cw, 128);
            // (FT_FWD_EPI_OPAQUE: the thread's lane, row and chunk indices opaque here, so derived here)
            int e_lane = lane, e_row0 = row0, e_ctid = ctid;
            constexpr bool kEpiOpaque =
                FT_FWD_EPI_OPAQUE == 2 || (FT_FWD_EPI_OPAQUE == 1 && T::kHeadDim == 128 && T::kHeadDimEff == 128 &&
                                           !T::kScoreMods && !T::kIsDropout && !T::kIsBlockSparse);
            if constexpr (kEpiOpaque) asm volatile("" : "+r"(e_lane), "+r"(e_row0), "+r"(e_ctid));
            float(&o1)[1][kDT][4] = *reinterpret_cast<float(*)[1][kDT][4]>(&o);
            store_acc<T::kIsBF16, TileQ>(sO, o1, e_row0, 0, 1.f, e_lane);
            if (T::kTmaStoreO && (!varlen || rows_valid >= 64) && rows_first <= 0) {
                // TMA stores of the warpgroup's 64 rows (rows past a batch's sequence lie outside the tensor map and
                // are not written; a varlen sequence's partial last tile takes the loop below: its rows past the end
                // belong to the next sequence; so does a shifted first tile's, whose rows before the start belong to
                // the previous one)
                fence_proxy_async();
                named_bar_sync(T::kBarEpilogue + cw, 128);
                if (ctid == 0 && write) {
#pragma unroll
                    for (int cb = 0; cb < T::kColBlocks; ++cb)
                        tma_store_4d(&params.tma_o, sO + cb * kBlockM * 128 + cw * 64 * 128, cb * 64,
                                     x.q_start + m0 + cw * 64, x.head, varlen ? 0 : x.batch);
                    bulk_commit();
                }
            } else {
                named_bar_sync(T::kBarEpilogue + cw, 128);
                u16* out = out_rows();
                constexpr int kChunksPerRow = T::kHeadDim / 8;
#pragma unroll
                for (int i = 0; i < 64 * kChunksPerRow / 128; ++i) {
                    const int chunk = e_ctid + i * 128, row = chunk / kChunksPerRow, col = (chunk % kChunksPerRow) * 8;
                    if (write && row < rows_valid && row >= rows_first && col < p.head_dim) {
                        u32 v[4];
                        ld_shared_v4(TileQ::addr(sO, cw * 64 + row, col), v);
                        st_global_v4(out + row * p.o_row_stride + col, v);
                    }
                }
            }
        }
        FT_TIMELINE_MARK(wg, tile_iter, 5);
        FT_TIMELINE_PUT(wg, tile_iter, 7, (unsigned long long)it);
    }
    if (T::kTmaStoreO && ctid == 0) bulk_wait<0>();  // the last O stores have read shared memory (and landed)
    if constexpr (T::kCluster > 1) cluster_sync();     // no copy or arrive of the peer's still targets this CTA
    FT_TIMELINE_END(wg);
}

}  // namespace flashtrain
