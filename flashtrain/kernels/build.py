"""Compile the CUDA kernels of flashtrain/kernels/csrc to cubin, at first use, without binding to PyTorch's C++ ABI.

The dispatch table below is the single place that lists the kernel instantiations (head dim x dtype x causal x
dropout, plus the block-sparse set: BLOCK_SPARSE_HEAD_DIMS x dtype x causal x dropout) and their tile shapes; each instantiation is one compilation of an entry file (flash_fwd.cu, flash_bwd.cu,
flash_aux.cu) with FT_* macros. Compilers, in order: NVRTC (libnvrtc from the `nvidia-cuda-nvrtc` wheel that
PyTorch's CUDA builds install, loaded through cuda.bindings), then nvcc. Cubins are cached on disk under
$FLASHTRAIN_KERNEL_CACHE (default ~/.cache/flashtrain/kernels), keyed by the sources' hash, the GPU arch, the
instantiation's macros and the compiler's version.

    python -m flashtrain.kernels.build                        # prebuild every instantiation for this machine's GPU
                                                              # and the C++ host layer (host_library)
    python -m flashtrain.kernels.build --arch sm_90a          # ... for a given arch (no GPU needed)
    python -m flashtrain.kernels.build --check-nvcc sm_80 sm_90a   # compile everything with nvcc, no cache (CI)
    python -m flashtrain.kernels.build --check-nvcc sm_86 --small-smem   # ... the 99 KB tiles that differ (CI)

Tiles follow the GPU's shared memory: each kernel takes the first tile shape of its head dim, in the order FWD_TILES /
BWD_TILES (163 KB: A100, H100), then FWD_TILES_SMALL_SMEM / BWD_TILES_SMALL_SMEM (99 KB: sm_86, sm_89, sm_120), that
fits the device's opt-in limit per block (cuDeviceGetAttribute MAX_SHARED_MEMORY_PER_BLOCK_OPTIN), lowered by
FLASHTRAIN_MAX_SMEM (bytes, or with a K suffix: 99K = 101376) when set, e.g. to run the small-memory tiles on an H100.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
HEAD_DIMS = (32, 64, 96, 128, 192, 256, 512)  # instantiated head dims; others round up to the next one
# Block-sparse kernels (block_mask) exist for these head dims only (head_dim <= 128 rounds up to one of them): half
# the instantiations of the dense set would add ~4 minutes to CI's nvcc check for head dims nobody asked for.
BLOCK_SPARSE_HEAD_DIMS = (64, 128)
BLOCK_SPARSE_SIZE = 128  # = reference.BLOCK_SPARSE_SIZE = csrc/flash.h kBlockSparseSize (tests check all three)
DTYPES = ("fp16", "bf16")


@dataclasses.dataclass(frozen=True)
class FwdTiles:
    block_m: int  # query rows per CTA
    block_n: int  # keys per K/V tile
    nwarps: int  # the query rows are split across the warps
    warps_d: int = 1  # warps sharing a row group, each owning head_dim / warps_d columns of O (flash_fwd.cuh kWarpsD)

    def smem_bytes(self, head_dim: int) -> int:  # Q tile + K tile + V tile, 16-bit values; the warps' partial S
        partial_s = self.block_m * self.warps_d * self.block_n * 4 if self.warps_d > 1 else 0
        return 2 * (self.block_m + 2 * self.block_n) * head_dim + partial_s


@dataclasses.dataclass(frozen=True)
class BwdTiles:
    block_m: int  # query rows per inner iteration
    block_n: int  # keys per CTA
    nwarps: int
    warps_m_sdp: int  # warps along the query rows of S / dP (the others split the keys)
    warps_n_dkv: int  # warps along the keys of dK / dV (the others split head_dim)
    warps_m_dq: int  # warps along the query rows of dQ (the others split head_dim)
    stages: int  # buffers of Q and dO (2: the next block's copy overlaps this block's math; 1: no overlap)
    # atomics into whole blocks of dq_accum in the red.v4-friendly order (flash_bwd.cuh): 0 off (row-major), 1 on,
    # 2 on with one laundered base offset for a block's atomics (same layout; the two differ only in ptxas's spills)
    scramble_dq: int = 0
    # lse / D of a thread's rows stored contiguously in shared memory and read with 16-byte loads (fewer shared-memory
    # instructions per iteration; H100 backward, same process: hd128 +1..3%, hd64 -1..4% (its spills 0 -> 8-32 B))
    vec_row_stats: bool = False
    dq_chunks: int = 1  # dQ computed and added in this many pieces of a warp's columns (fewer registers live)

    def dq_slice_width(self, head_dim: int) -> int:  # columns of dQ per warp (flash_bwd.cuh: kNT_dQ * 8)
        return head_dim // (self.nwarps // self.warps_m_dq)

    def smem_bytes(self, head_dim: int) -> int:  # Q, dO (x stages), K, V, P, dS 16-bit; lse, D (x stages) fp32
        return (2 * (2 * self.stages * self.block_m * head_dim + 2 * self.block_n * head_dim
                     + 2 * self.block_m * self.block_n) + 2 * self.stages * 4 * self.block_m)


# Tile shapes per head dim (FlashAttention-2's choices for sm80/sm90 where they fit this kernel's register budget).
FWD_TILES = {
    32: FwdTiles(128, 128, 4),
    64: FwdTiles(128, 64, 4),
    96: FwdTiles(128, 64, 4),
    128: FwdTiles(128, 64, 4),
    192: FwdTiles(128, 64, 8),
    256: FwdTiles(128, 64, 8),
    # head dim 512 (every GPU with 163 KB: 144 KB): 4 row groups of 16 rows x 2 warps of 256 columns each (O: 128
    # registers per thread), S summed from the two warps' halves of the head dim through shared memory
    512: FwdTiles(64, 32, 8, warps_d=2),
}


def _fwd_tile_overrides() -> None:
    """FLASHTRAIN_FWD_TILES="512=64x64x8x2" (head dim = block_m x block_n x nwarps [x warps_d]) replaces entries of
    FWD_TILES in this process (tile A/B measurements of the mma.sync forward without editing the table)."""
    for item in filter(None, os.environ.get("FLASHTRAIN_FWD_TILES", "").split(",")):
        head_dim, shape = item.split("=")
        FWD_TILES[int(head_dim)] = FwdTiles(*(int(x) for x in shape.split("x")))


_fwd_tile_overrides()


# Hopper (sm_90a) forward, warp-specialized (csrc/flash_fwd_sm90.cuh): a producer warpgroup issuing TMA copies into a
# ring of `stages` K/V buffers, block_m / 64 consumer warpgroups (two: ping-pong scheduled). Dense or block-sparse,
# dropout too, these head dims (a head_dim that rounds up to one of them). FLASHTRAIN_SM90=0 in the environment turns
# the Hopper kernels (forward and backward) off: the mma.sync ones then run on Hopper too (A/B measurements, bitwise
# comparisons with the block-sparse kernels).
@dataclasses.dataclass(frozen=True)
class FwdSm90Tiles:
    block_m: int  # query rows per CTA: one consumer warpgroup per 64
    block_n: int  # keys per K/V tile
    stages: int  # K/V buffers in the TMA ring
    # O staged in a tile of its own (the next tile's Q is copied during this tile's epilogue); False: written from the
    # registers, where Q + O + the K/V stages exceed the 227 KB of shared memory a block can have (head dims 192, 256)
    separate_o: bool = True
    # Q buffers: with 2 the producer copies the next tile's Q while this tile runs (needs separate_o)
    q_buffers: int = 1
    # head dims above 256 (flash_fwd_sm90.cuh kSplitD): two consumer warpgroups on the same 64 rows, each owning half
    # of O's columns, their partial S added through shared memory
    split_d: bool = False
    # CTAs per cluster (flash_fwd_sm90.cuh kCluster): 2, neighbouring query tiles share their K / V copies (TMA
    # multicast), on a static schedule of tile pairs; the grid is even (FWD_SM90_CLUSTER)
    cluster: int = 1
    # causal kernels: the unmasked key-block steps without the block's row max (FWD_SM90_REF_CAUSAL_SEQLEN)
    ref_causal: bool = False

    @property
    def threads(self) -> int:  # consumer warpgroups + the producer warpgroup
        return 128 * ((2 if self.split_d else self.block_m // 64) + 1)

    def smem_bytes(self, head_dim: int) -> int:  # Q, O, K and V stages; 1024 to align them (128-byte swizzle); barriers
        q_and_o = (self.q_buffers + (1 if self.separate_o else 0)) * self.block_m
        partial_s = 2 * 2 * 128 * self.block_n // 2 * 4 if self.split_d else 0  # (two buffers of two warpgroups')
        return 2 * (q_and_o + 2 * self.stages * self.block_n) * head_dim + 1024 + 256 + partial_s


FWD_SM90_TILES = {
    64: FwdSm90Tiles(128, 128, stages=2),
    128: FwdSm90Tiles(128, 128, stages=2),  # also head dims 65-96 on Hopper (rounded_head_dim)
    192: FwdSm90Tiles(128, 112, stages=2, separate_o=False),  # FlashAttention-3's key tile
    256: FwdSm90Tiles(128, 80, stages=2, separate_o=False),  # FA3's too; O from registers: no spills (64 keys: 1.10x)
    # 64 rows shared by two consumer warpgroups (256 columns of O each); 32-key K / V stages (Q 64 KB + 2 x 2 x 32 KB
    # + partial S 32 KB = 225 KB); dense or causal, dropout too; score modifications / mask_mod: flash_fwd.cuh's
    512: FwdSm90Tiles(64, 32, stages=2, separate_o=False, split_d=True),
}
# The Hopper forward's score-modification variant (window, softcap, ALiBi, mask_mod's base): these head dims (not the
# split-head-dim 512, whose mods run flash_fwd.cuh's)
FWD_SM90_MODS_HEAD_DIMS = tuple(head_dim for head_dim, tiles in FWD_SM90_TILES.items() if not tiles.split_d)
# Dense non-causal forward without dropout: three consumer warpgroups at head dim 64 (H200, same process, GPU time:
# 422 -> 480 TFLOP/s at 16K, 343 -> 363 at 512; with dropout they spill, and 192 rows do not divide a 128-token
# block-sparse block). Rows are independent, so the result is bitwise that of FWD_SM90_TILES (same block_n).
FWD_SM90_TILES_NONCAUSAL = {
    64: FwdSm90Tiles(192, 128, stages=2),
}
# Causal without dropout / block-sparse at max_seqlen_q >= LONG_CAUSAL_SEQLEN: three consumer warpgroups at head dim 64
# too (H200, bf16 forward vs cuDNN, 2026-11-25, each variant its own process, two runs each: 1K 0.89 -> 0.93,
# 1.5K 0.89 -> 0.97-0.98, 2K 0.91 -> 0.97-0.98, 3K 0.92-0.96 -> 1.01-1.02, 4K 0.93-0.94 -> 1.05-1.07; 512: 0.87 either
# way). The 1K gain needs the causal tiles to end at the sequence's last row (flash_fwd_sm90.cuh kShiftRows): with
# the partial tile last, 192-row tiles were 0.84-0.86 at 1K. Bitwise the same result (same block_n). From 512 since
# 2026-11-26 (H200, CUDA-graph replays interleaved in one process, benchmarks/probes/ab_probe.py, 192 / 128 rows:
# 512 1.019, 768 1.044; 1.000 and 1.013 of cuDNN).
FWD_SM90_TILES_LONG_CAUSAL = {
    64: FwdSm90Tiles(192, 128, stages=2),
}
LONG_CAUSAL_SEQLEN = 512
# Hopper parts with at most SMALL_L2_BYTES of L2 (the H100's 50 MB, against the H200's 60 MB; its HBM3 also moves
# 3.35 against 4.8 TB/s) spend more of a short causal forward waiting on memory: at hd128 causal 512 our forward and
# cuDNN's both ran at 75% of the H100's DRAM throughput (Nsight Compute). There the head-dim-64 causal tiles of
# FWD_SM90_TILES_LONG_CAUSAL take two Q buffers up to SMALL_L2_Q_BUFFERS_SEQLEN query rows (the producer copies the
# next tile's Q while this one runs), and the short causal forwards at head dims 64 and 128 take smaller tile
# groups (ops.FWD_SHORT_WAVES_SMALL_L2). H100 80GB HBM3, 2026-12-05, interleaved CUDA-graph replays (ab_probe.py), two
# machines, forward, two Q buffers / one: hd64 causal 512 1.021-1.027, 768 1.021-1.023, 1K 1.009-1.014, 12 heads 1K
# (GPT-2 small) 1.003-1.006 (kernel_ab-h100.json). On the H200 two Q buffers measured 0.987 at hd64 causal 512 on
# 128-row tiles (before the 192-row ones); neither rule was measured there, so parts with a larger L2 keep the tiles
# and groups above. A/B: ab_probe.py flashtrain@build.SMALL_L2_BYTES=0 (read at plan time).
SMALL_L2_BYTES = 50 << 20
SMALL_L2_Q_BUFFERS_SEQLEN = 1024


def is_small_l2(l2_bytes: int) -> bool:
    """Whether a GPU with this many bytes of L2 takes the small-L2 rules above (launch.l2_bytes gives a device's)."""
    return l2_bytes <= SMALL_L2_BYTES


# Forward calls whose one score modification is a window (no softcap, no ALiBi, no mask expression) take a variant
# compiled without ALiBi (FT_SCORE_MODS 3, `_window`; the backward's BWD_SM90_WINDOW_ONLY): no slope load, no ALiBi
# branch, no row bias in the exponentials (hd128 causal: 36 bytes of spills -> none, ptxas 13.0) ...
FWD_SM90_WINDOW_ONLY = 1
# ... with two Q buffers (the producer copies the next tile's Q while this one runs, as FWD_SM90_TILES_SHORT_CAUSAL: a
# window's tiles are a few key blocks long). H200, 2026-12-01, interleaved CUDA-graph replays (ab_probe.py), forward
# against the `_nocap` variant with one Q buffer: hd128 causal window 1024 at 16K / 4K 1.048 / 1.038, window 256 at
# 16K 1.042; hd64 window 256 at 16K 1.029, window 1024 at 4K 1.090 (one Q buffer alone: hd128 1.036 / 1.025 / 0.983,
# hd64 1.033 / 1.091); forward + backward 1.009-1.027 (kernel_ab-h200.json). A/B: ab_probe.py
# flashtrain@build.FWD_SM90_WINDOW_ONLY=0 (the `_nocap` kernel), flashtrain@build.FWD_SM90_WINDOW_Q_BUFFERS=1.
FWD_SM90_WINDOW_Q_BUFFERS = 2
# Head dims whose mask-expression forward (mask_mod) runs on the warpgroup-MMA kernel; the others take the mma.sync
# one (with the expression compiled in, the Hopper kernel's 80- / 112-key tiles at head dims 192 / 256 spill 284-552
# bytes per thread, ptxas 13.0, against 4-32 without it).
MASK_SM90_HEAD_DIMS = (64, 128)
# Causal without dropout / block-sparse below SHORT_CAUSAL_SEQLEN query rows (max_seqlen_q known and smaller): two Q
# buffers at head dim 128, so that the producer copies the next tile's Q while this one runs (its 1-4 key blocks
# leave little time after the last S GEMM, when one buffer frees). H200, 2026-11-26, CUDA-graph replays interleaved
# in one process (benchmarks/probes/ab_probe.py), forward q2 / q1: hd128 causal 512 1.034 (1.029 in a second run);
# 1K-16K 0.986-1.010; hd64 causal 512 0.987, so not there. Bitwise the same result (same tile shape).
# Head dims 192 / 256 (O from the registers, no room for a second Q buffer), up to FWD_SM90_WIDE_SHORT_CAUSAL_SEQLEN
# query and key rows: 64-key blocks, three stages at 192. A short causal tile's few key blocks then cover the diagonal
# with less masked work (a 128-row tile's diagonal is two 64-key blocks against two or three of 112 / 80 keys). H200,
# 2026-12-04, interleaved CUDA-graph replays (ab_probe.py, two runs in opposite orders), forward against 128 x 112 x 2
# / 128 x 80 x 2: hd192 causal 512 1.062-1.077, 768 1.021-1.023, GQA 16/2 512 1.042-1.044, but 1000 0.936-0.940, 1K
# 0.989, 2K 0.931; hd256 512 1.032-1.038, 768 1.004-1.009, GQA 16/2 512 1.035, 1000 0.982-0.986, 2K 0.983; forward +
# backward 0.999-1.013 up to 768. (Also measured at hd192: 128 x 64 x 2, 128 x 80, 128 x 96 at 512: 1.048 / 1.018 /
# 1.013; at hd256 128 x 48 x 3: 0.915-1.003.) FWD_SM90_WIDE_SHORT_CAUSAL_SEQLEN = 0 (ab_probe.py
# flashtrain@build.FWD_SM90_WIDE_SHORT_CAUSAL_SEQLEN=0; read at plan time): their default tiles at every length.
FWD_SM90_TILES_SHORT_CAUSAL = {
    128: FwdSm90Tiles(128, 128, stages=2, q_buffers=2),
    192: FwdSm90Tiles(128, 64, stages=3, separate_o=False),
    256: FwdSm90Tiles(128, 64, stages=2, separate_o=False),
}
SHORT_CAUSAL_SEQLEN = 1024
FWD_SM90_WIDE_SHORT_CAUSAL_SEQLEN = 768
# At least LONG_KEYS_SEQLEN keys (dense calls; not varlen, whose maximum says little about its documents), without
# dropout / block-sparse: 192-key tiles at head dim 128, FlashAttention-3's longer key tile for the non-causal hd128
# forward, with O stored from the registers (Q 32 KB + 2 x 2 x 48 KB of K / V leave no room for O's own tile). Fewer,
# longer key blocks per row: less softmax bookkeeping and fewer barrier round trips per FLOP. H200, 2026-11-29,
# CUDA-graph replays interleaved in one process (benchmarks/probes/ab_probe.py), forward 128 x 192 / 128 x 128:
# non-causal 4K 1.002, 8K 1.045, 16K 1.055; causal 8K 0.999, 16K 1.033; but non-causal 1K 0.864 and 2K 0.983 (a
# partial last key block), hence the threshold. O from the registers alone at 128 x 128: 0.946-0.965.
FWD_SM90_TILES_LONG_KEYS = {
    128: FwdSm90Tiles(128, 192, stages=2, separate_o=False),
}
LONG_KEYS_SEQLEN = 8192
# ... causal calls from LONG_KEYS_CAUSAL_SEQLEN keys (a causal query tile of 128 rows ends inside a 192-key block two
# times in three, and that block's keys past the tile's last row are masked for all its rows; 128-key blocks end where
# the tile ends). H200, 2026-12-01, interleaved CUDA-graph replays (ab_probe.py), forward, 128 x 128 / 128 x 192:
# GQA 32 / 8 heads causal 8K 1.026-1.027 (batch 1) and 1.025 (batch 2), hd96 causal 8K 1.010, hd128 causal 12K
# 1.005; forward + backward causal 8K 1.007, GQA 32 / 8 8K 1.006; at 16K 0.999-1.002 (kernel_ab-h200.json). A/B:
# ab_probe.py flashtrain@build.LONG_KEYS_CAUSAL_SEQLEN=8192.
LONG_KEYS_CAUSAL_SEQLEN = 16384
# Causal calls without dropout / block-sparse from this many query rows, on the tiles the table names (FwdSm90Tiles
# .ref_causal; the kernels' names end in _ref): the unmasked key-block steps skip the block's row max, as the
# non-causal head-dim-64 / 128 kernels always do (flash_fwd_sm90.cuh FT_FWD_REF_CAUSAL, its guarded form). H100,
# 2026-12-08, interleaved CUDA-graph replays (ab_probe.py), forward, against the block max: hd64 causal 4K / 16K
# 1.023 / 1.060 (the 192-row tiles), hd128 causal 16K 1.030 (the 192-key tiles); hd64 causal 1K 0.925 and hd128
# causal 1K 0.998 keep the block max (kernel_ab-h100.json guard_early_ab).
FWD_SM90_REF_CAUSAL_SEQLEN = {64: (4096, FWD_SM90_TILES_LONG_CAUSAL[64]),
                              128: (LONG_KEYS_CAUSAL_SEQLEN, FWD_SM90_TILES_LONG_KEYS[128])}
# Dense non-causal head-dim-128 calls without dropout, from FWD_SM90_CLUSTER_SEQLEN keys, whose query tiles per (batch,
# head) are even (not varlen): clusters of two CTAs on neighbouring query tiles, each copying half of every K / V tile
# into both (TMA multicast; FwdSm90Tiles.cluster, flash_fwd_sm90.cuh kCluster), on a static schedule of tile pairs.
# Bitwise the same result. Under sustained load the board's power cap then leaves a higher SM clock: H200, 2026-11-30,
# ab_probe.py --sustained 3 --rounds 2 --clocks, forward, clusters / one CTA: 16K 1.049 and 1.032 in two runs (1645 /
# 1591 and 1620 / 1566 MHz at 685-690 W), 8K 1.040 (1654 / 1609 MHz); the static schedule alone (FT_FWD_STATIC)
# 0.973. Interleaved: 8K 1.002-1.003, 16K 1.000-1.006, GQA 32/8 8K 1.002-1.005. Not below 8K
# keys (the 128 x 128 tiles: 1K / 2K / 4K 0.978 / 0.984 / 0.987) nor at head dims 65-96 (hd80 16K 0.965, hd96 8K /
# 16K 0.995 / 0.990; kernel_ab-h200.json). FWD_SM90_CLUSTER = 0
# (FLASHTRAIN_FWD_SM90_CLUSTER=0, or ab_probe.py flashtrain@build.FWD_SM90_CLUSTER=0; read at plan time): one CTA per
# tile, the dynamic scheduler.
FWD_SM90_CLUSTER = int(os.environ.get("FLASHTRAIN_FWD_SM90_CLUSTER", "1"))
FWD_SM90_CLUSTER_SEQLEN = LONG_KEYS_SEQLEN
FWD_SM90_CLUSTER_HEAD_DIMS = (128,)
# The same clusters for the dense non-causal head-dim-64 forward (192 x 128 tiles, three consumer warpgroups; from
# FWD_SM90_CLUSTER_SEQLEN keys, an even number of 192-row query tiles per (batch, head): 16K, not 8K), each CTA copying
# half of every K / V tile's 128 rows into both (K / V maps of 64-row boxes, ops._fwd_plan). Off: H200, ab_probe.py,
# forward, clusters / one CTA: interleaved 16K 0.984-0.986, 4K (threshold lowered) 0.952; sustained 16K 1.011 at a 35
# MHz higher SM clock but 0.991 of the TFLOP/s per GHz (kernel_ab-h200.json hd64_clusters_ab). FWD_SM90_CLUSTER_HD64 =
# 1 (FLASHTRAIN_FWD_SM90_CLUSTER_HD64=1 at import, or ab_probe.py flashtrain@build.FWD_SM90_CLUSTER_HD64=1; read at
# plan time) turns it on.
FWD_SM90_CLUSTER_HD64 = int(os.environ.get("FLASHTRAIN_FWD_SM90_CLUSTER_HD64", "0"))


def fwd_sm90_cluster_head_dim(head_dim: int) -> bool:
    """Whether the dense non-causal Hopper forward at this head dim runs in 2-CTA clusters (from
    FWD_SM90_CLUSTER_SEQLEN keys, an even number of query tiles per (batch, head))."""
    return bool(FWD_SM90_CLUSTER) and (head_dim in FWD_SM90_CLUSTER_HEAD_DIMS
                                       or (head_dim == 64 and bool(FWD_SM90_CLUSTER_HD64)))


def _tile_overrides() -> None:
    """FLASHTRAIN_FWD_SM90_TILES="64=192x128x2,128=128x128x2" (head dim = block_m x block_n x stages, then "o" or
    "q" for O in a tile of its own or from the registers) replaces entries of FWD_SM90_TILES in this process: tile A/B
    measurements without editing the table (and the head dim's entries of the tables by mask and length)."""
    for item in filter(None, os.environ.get("FLASHTRAIN_FWD_SM90_TILES", "").split(",")):
        head_dim, shape = item.split("=")
        separate_o = shape.endswith("o") or (not shape.endswith("q") and FWD_SM90_TILES[int(head_dim)].separate_o)
        block_m, block_n, stages = (int(x) for x in shape.rstrip("oq").split("x"))
        tiles = FwdSm90Tiles(block_m, block_n, stages, separate_o=separate_o, split_d=int(head_dim) > 256)
        FWD_SM90_TILES[int(head_dim)] = FWD_SM90_TILES_NONCAUSAL[int(head_dim)] = tiles
        for table in (FWD_SM90_TILES_LONG_CAUSAL, FWD_SM90_TILES_SHORT_CAUSAL, FWD_SM90_TILES_LONG_KEYS):
            if int(head_dim) in table:
                table[int(head_dim)] = tiles


_tile_overrides()


@dataclasses.dataclass(frozen=True)
class BwdSm90Tiles:
    """Hopper backward (csrc/flash_bwd_sm90.cuh): a producer warpgroup (TMA copies of Q / dO, row statistics) and two
    MMA warpgroups of 64 keys each (block_n = 128 keys per CTA), walking query blocks of block_m rows through a ring
    of `stages` Q / dO buffers; one CTA per SM. Head dims 192 / 256: block_n = 64 keys shared by both warpgroups,
    which split the head dim (flash_bwd_sm90_split_mma); head dim 192 with block_n = 96: 48 keys per warpgroup
    (flash_bwd_sm90_split_keys_mma, K copied in 32-column boxes). Both dense only, no dropout, not deterministic."""

    block_m: int  # query rows per step
    stages: int = 2
    block_n: int = 128
    threads: int = 384
    scramble_dq: int = 1  # whole query blocks add into dq_accum in the scrambled order of 64-column slices
    persistent: bool = True  # one CTA per SM taking (key block, batch, kv head) tiles; False: one CTA per tile
    # 80-query blocks: each block's dQ^T staged and added to dq_accum in the MMA accumulator's order, converted by
    # flash_aux.cuh bwd_convert_dq_frag (BwdSm90Traits::kDqFrag); False: plain rows by tensor reduce-adds (the hd128
    # causal score-modification kernels, _dq_frag_choice)
    dq_frag: bool = True
    # split keys: each MMA warp stages its block's dQ rows (16 x 96 fp32) and reduce-adds them with one bulk copy,
    # in room made by one dO buffer and single P^T / dS^T tiles (BwdSm90Traits::kSkStageDq); False: dQ added from the
    # registers (red.global.add.v4), two dO stages, P^T / dS^T double-buffered
    stage_dq: bool = False
    # the dQ conversion in the kernel (flash_bwd_sm90.cuh kFusedDq; _bwd_fused_dq_rule): the key block that completes
    # a query block hands it to the converter warps, no conversion kernel runs after the backward
    fused_dq: bool = False
    # K / V buffers (flash_bwd_sm90.cuh kKvStages; _bwd_kv2_rule): 2, tile t's K / V copied into buffer t % 2 before
    # the tile's first Q / dO, under the previous tile's last query blocks; the 128-query hd64 kernels without the
    # fused dQ conversion only (no room for both), and with no alignment slack (the kernel checks the alignment)
    kv_stages: int = 1

    def dq_slice_width(self, head_dim: int) -> int:  # dQ is computed in 64 x 64 pieces (80-query blocks: dQ^T,
        return 0 if self.swap_dq else 64              # added in plain rows)

    @property
    def swap_dq(self) -> bool:
        """80-query blocks (head dim 128): dQ^T = K^T dS^T per warpgroup (64 head-dim rows x 80 queries),
        dS stored row-major by queries (BwdSm90Traits::kSwapDq); dq_accum in fragment order or plain rows (dq_frag)."""
        return self.block_m == 80

    @property
    def split_head_dim(self) -> bool:
        """The head dims above 128 (64- or 96-key tiles): dense only, no dQ writer (split_keys: 96 keys)."""
        return self.block_n in (64, 96)

    @property
    def split_keys(self) -> bool:
        """Head dim 192 on 96-key tiles, 48 keys per MMA warpgroup (BwdSm90Traits::kSplitKeys): P^T and dS^T
        double-buffered, K in 32-column boxes with the 64-byte swizzle (k_box_cols)."""
        return self.block_n == 96

    @property
    def k_box_cols(self) -> int:  # the K tensor map's box columns (64: 128-byte swizzle; 32: 64-byte swizzle)
        return 32 if self.split_keys else 64

    def supports(self, dropout: bool, block_sparse: bool, deterministic: bool) -> bool:
        return not (self.split_head_dim and (dropout or block_sparse or deterministic))

    def smem_bytes(self, head_dim: int) -> int:
        """Q, dO stages; K, V; two 16-bit score tiles (dS^T double-buffered; split head dim: P^T, dS^T; split keys:
        four, P^T and dS^T double-buffered); per MMA warp 4 KB fp32 dQ staging per piece (split head dim: none;
        80-query blocks: the block's fp32 dQ); lse, D stages (128-byte multiples); barriers and tile records; 1024 to
        align the tiles (128-byte swizzle)."""
        pieces = (self.block_m // 64) * (head_dim // 64)
        stage_dq = self.split_keys and self.stage_dq
        dq_staging = (4 * self.block_m * head_dim if stage_dq or self.swap_dq else 0 if self.split_head_dim
                      else 2 * 4 * ((pieces + 1) // 2) * 4096)
        score_tiles = 4 if self.split_keys and not stage_dq else 2
        do_stages = 1 if stage_dq else self.stages
        fused_dq = 2 * 8192 + 1024 if self.fused_dq else 0  # the converter's chunk buffers, 1 KB of control
        return (2 * ((self.stages + do_stages) * self.block_m * head_dim + 2 * self.kv_stages * self.block_n * head_dim
                     + score_tiles * self.block_n * self.block_m) + dq_staging
                + 2 * self.stages * -(-4 * self.block_m // 128) * 128 + fused_dq + 256
                + (1024 if self.kv_stages == 1 else 0))


# Hopper backward: dense or block-sparse, dropout too, deterministic too (not with block-sparse), these head dims
# (65-96 padded to 128); head dims 192 and 256 (129-191, 193-255 padded up) dense without dropout, not deterministic
# (BwdSm90Tiles.supports; the others run flash_bwd.cuh).
BWD_SM90_TILES = {
    64: BwdSm90Tiles(block_m=128),  # H200 backward, same process: 128 queries 0-4% faster than 64 (see the kernel)
    128: BwdSm90Tiles(block_m=64),  # (128 queries: S^T, dP^T, dK, dV accumulators alone exceed the registers)
    # (96 keys: split keys, dQ staged; BWD_SM90_HD192_N96 = 0: BWD_SM90_HD192_N64; BWD_SM90_HD192_STAGE_DQ = 0: dQ from
    # the registers)
    192: BwdSm90Tiles(block_m=64, block_n=96, stage_dq=True),
    256: BwdSm90Tiles(block_m=64, block_n=64),
}

# Head dim 192: 96-key tiles, each MMA warpgroup computing S, dP, dK, dV for its own 48 keys and dQ for half the
# columns over all 96 (flash_bwd_sm90_split_keys_mma; FlashAttention-3 / 4's 64 x 96 shape for this head dim), instead
# of the split-head-dim kernel's 64-key tiles (BWD_SM90_HD192_N64), whose warpgroups hand P^T and dS^T to each other
# in every block. H200, 2026-11-30, interleaved CUDA-graph replays (kernel_ab-h200.json), 96-key / 64-key backward
# TFLOP/s: causal 1K 292.0 / 268.4, 4K 444.1 / 378.9, 16K 481.7 / 398.0; full 4K 436.9 / 378.3, 16K 499.6 / 398.8;
# GQA 16/2 8K causal 443.9 / 372.0; forward + backward 1.07-1.17x. BWD_SM90_HD192_N96 = 0 (FLASHTRAIN_BWD_SM90_HD192_N96=0 at import, or
# ab_probe.py flashtrain@build.BWD_SM90_HD192_N96=0; read at plan time) takes the 64-key kernel.
BWD_SM90_HD192_N64 = BwdSm90Tiles(block_m=64, block_n=64)
BWD_SM90_HD192_N96 = int(os.environ.get("FLASHTRAIN_BWD_SM90_HD192_N96", "1"))
# The 96-key kernel's dQ: each MMA warp stages its block's 16 x 96 fp32 slice in shared memory and reduce-adds it with
# one bulk copy (BwdSm90Tiles.stage_dq; room from one dO buffer and single P^T / dS^T tiles), instead of 12
# red.global.add.v4 per thread, which held the warps for the L2 write path at every block. H200, 2026-12-03,
# interleaved CUDA-graph replays (kernel_ab-h200.json), staged / from the registers, backward TFLOP/s: causal 4K
# 448.9 / 415.4, 1K 303.5 / 294.2, full 16K 506.2 / 458.1, GQA 16/2 8K causal 468.2 / 431.5.
# BWD_SM90_HD192_STAGE_DQ = 0 (FLASHTRAIN_BWD_SM90_HD192_STAGE_DQ=0 at import, or ab_probe.py
# flashtrain@build.BWD_SM90_HD192_STAGE_DQ=0; read at plan time) takes the register form.
BWD_SM90_HD192_STAGE_DQ = int(os.environ.get("FLASHTRAIN_BWD_SM90_HD192_STAGE_DQ", "1"))
BWD_SM90_HD192_REG_DQ = BwdSm90Tiles(block_m=64, block_n=96, stage_dq=False)


# ... and for the head-dim-128 backward without dropout (not block-sparse, not deterministic; head dims 65-96 narrowed
# to 96 columns too: 1.06-1.10x their 64-query blocks at 4K-16K, H200, 2026-11-29, kernel_ab-h200.json):
# 80-query blocks (FlashAttention-3's shape for the non-causal case; BwdSm90Tiles.swap_dq). H200, same process,
# 2026-11-26: non-causal 1.01-1.05x the 64-query blocks at 1K-16K, GQA 16/4 1.06-1.13x (before the kernel's dQ-first
# order, which added 1.01-1.07x); causal (with dQ first) 0.99x at 1K, 1.04 / 1.07 / 1.11 / 1.07x at 2K / 4K / 8K / 16K,
# GQA 16/2 4K 1.04x. FLASHTRAIN_BWD_SM90_Q80=0 takes BWD_SM90_TILES[128] instead (A/B). A deterministic variant
# passed the deterministic tests and racecheck at 0.90-0.96x the 64-query deterministic kernel (H200, same process,
# 2K-16K, MHA and GQA 16/4, 2026-11-26 00:21 UTC): removed; the deterministic backward keeps 64-query blocks.
BWD_SM90_DENSE128_TILES = BwdSm90Tiles(block_m=80)


# ... causal from this query length: 16K. The 64-query kernel issues dQ first, releases K / V early (kDqFirst,
# kKvReleaseLast) and keeps P^T in fp32 with 240 registers for its MMA warps (flash_bwd_sm90.cuh kPtFp32); it is ahead
# below 16K and level at 16K (H200, 2026-11-30 10:37 UTC, interleaved CUDA-graph replays, backward TFLOP/s 64-query /
# 80-query: hd128 causal 4K 558.8 / 543.8, 8K 547.0 / 542.3, 16K 569.9 / 571.7, GQA 32/8 8K 519.2 / 512.2, GQA 16/2 4K
# 493.8 / 478.4; kernel_ab-h200.json). Head dims 81-96: from 8K (below); their 64-query kernel computes the dQ in one
# warpgroup on 256 registers (flash_bwd_sm90.cuh kSplitRegs): H200, 2026-11-30 10:45 UTC, 64-query / 80-query, hd96
# causal 2K 409.1 / 394.7, 4K 456.2 / 452.5 (level: within run-to-run noise; 8K not measured), 16K 504.4 / 521.3;
# non-causal 4K 481.8 / 490.1. With dP^T accumulated onto -D in the 64-query kernels (flash_bwd_sm90.cuh kBiasD),
# from 8K: H200, 2026-12-02 12:29 UTC, 64-query / 80-query, hd96 causal 4K 504.8 / 493.3 (1.023), 8K 494.2 / 498.2,
# 16K 517.6 / 529.3; hd128 causal 16K 580.1 / 583.9, at batch 2 574.4 / 575.6 (the 80-query kernel kept there then).
# Head dim 128 causal now keeps the 64-query blocks at every length (None): with S^T waited for before dP^T is issued
# (flash_bwd_sm90.cuh kStFirst, which only the 64-query kernels take) it ran 16K at 614.4 against the 80-query
# kernel's 601.5 TFLOP/s (1.021x; H200, 2026-12-04, kernel_ab-h200.json). A query length here (A/B:
# flashtrain@build.BWD_SM90_Q80_CAUSAL_SEQLEN=16384) gives the 80-query kernel from that length again.
BWD_SM90_Q80_CAUSAL_SEQLEN: int | None = None
BWD_SM90_NARROW_Q80_CAUSAL_SEQLEN = 8192
# ... except head dims 65-80 causal, which keep the 64-query blocks at every length: there warpgroup 0 computes the
# whole m64n80 dQ (flash_bwd_sm90.cuh FT_BWD_NARROW_DQ), where the 80-query kernel's transposed dQ^T still spends an
# m64 GEMM on head-dim rows 64-127 of which 16 are non-zero. H200, 2026-11-30, interleaved CUDA-graph replays,
# backward TFLOP/s, 64-query / 80-query: hd80 causal 2K 361.2 / 338.0, 4K 422.8 / 401.9, 16K 486.0 / 481.5; non-causal
# 4K 449.3 / 455.6 and 16K 473.6 / 488.7 (kept on 80 queries); hd96 (its dQ then in two pieces) 0.91-0.96x.
# BWD_SM90_HD80_CAUSAL_Q64 = 0: the 80-query kernel there too (A/B: flashtrain@build.BWD_SM90_HD80_CAUSAL_Q64=0).
BWD_SM90_HD80_CAUSAL_Q64 = 1

# The Hopper backward's score-modification variant (local window, softcap, ALiBi, mask expressions): these tiles, and
# at head dim 128, causal, without softcap or a mask expression the 80-query ones from BWD_SM90_MODS_Q80_CAUSAL_SEQLEN
# query tokens (below). ptxas serializes the 80-query kernel's wgmmas (C7512) with
# softcap (its derivative's registers) and in the fp16 non-causal variant; the mask expression's states are per 128
# queries. H200, 2026-11-28, hd128 causal, TFLOP/s (a since-removed per-feature overhead probe) against the 64-query
# nocap kernel: window (S, 0) (plain's work) 8K 547.0 vs 502.7 (plain 562-574), 2K 447.4 vs 433.5; ALiBi 8K 507.9 vs
# 479.8, 2K 433.5 vs 420.3; window 1024 8K 379.6 vs 374.9.
BWD_SM90_MODS_TILES = {64: BWD_SM90_TILES[64], 128: BWD_SM90_TILES[128]}
# ... except a sliding window (a bounded left window), which keeps the 64-query blocks at every length: with dQ first
# and K / V released by a tile's last query block (flash_bwd_sm90.cuh FT_BWD_MODS_DQ_FIRST,
# FT_BWD_MODS_KV_RELEASE_LAST) the 64-query kernel ran hd128 causal window 1024 at 16K 442.3 against the 80-query
# kernel's 431.7 TFLOP/s (1.025x), at 4K 1.036x, window 256 at 16K 1.097x (H200, 2026-11-30, kernel_ab-h200.json).
# A window's tiles are short (window / block_n query blocks), so the 80-query kernel's longer steps gain less there.
# Windows of at most BWD_SM90_WINDOW_Q64_MAX_LEFT keys (the measured ones); a longer window does more of plain causal
# attention's work, where the 80-query kernel led (window (S, 0) at 8K: 1.09x, above, before the 64-query kernel's
# dQ first). BWD_SM90_WINDOW_Q64 = 0: the 80-query kernel for windows too (A/B:
# flashtrain@build.BWD_SM90_WINDOW_Q64=0).
BWD_SM90_WINDOW_Q64 = 1
BWD_SM90_WINDOW_Q64_MAX_LEFT = 1024
# The mods kernels' own 80-query threshold (causal, no window): the query length from which the plain kernel took
# 80-query blocks when the mods ones were measured (ALiBi 2K: 80 / 64 queries 433.5 / 420.3 TFLOP/s, above).
BWD_SM90_MODS_Q80_CAUSAL_SEQLEN = 2048
# Calls whose one score modification is a window (no softcap, no ALiBi, no mask expression) take a variant compiled
# without ALiBi (FT_SCORE_MODS 3, `_window`): no slope load and no ALiBi branch around the exponentials, and at head
# dim 128 the fp32 P^T of the plain 64-query kernels (flash_bwd_sm90.cuh kPtFp32). H200, 2026-11-30, interleaved
# CUDA-graph replays, backward, `_window` / general: hd128 causal window 1024 at 16K 1.033, at 4K 1.015, window 256 at
# 16K 1.001; hd64 causal window 256 at 16K 1.029 (kernel_ab-h200.json). BWD_SM90_WINDOW_ONLY = 0: the general one (A/B).
BWD_SM90_WINDOW_ONLY = 1
# ... and, at head dim 128 (64-query blocks), S^T accumulated onto the lse term as in the plain 64-query kernels
# (BWD_SM90_LSE_BIAS): the window masks scores to -inf like the causal mask. BWD_SM90_WINDOW_LSE_BIAS = 0: the FFMA
# form (A/B: flashtrain@build.BWD_SM90_WINDOW_LSE_BIAS=0).
BWD_SM90_WINDOW_LSE_BIAS = 1
BWD_SM90_MODS_HEAD_DIMS = tuple(BWD_SM90_MODS_TILES)
# ... with softcap (its derivative kept per element for dS^T): head dim 128; at 64 (128-query blocks) those registers
# spilled inside the loop (ptxas, 97 spill instructions between the first and last HGMMA), so the head-dim-64 kernel
# is built without softcap (FT_SCORE_MODS=2, `_mods_nocap`) and a call with softcap runs flash_bwd.cuh's.
BWD_SM90_MODS_SOFTCAP = {64: False, 128: True}


def _mods_variant(softcap: bool, has_softcap_variant: bool = True, window: bool = False) -> int:
    """FT_SCORE_MODS of a Hopper mods kernel: 1 with softcap, 2 without (`_nocap`: a call without softcap; the
    backward's derivative registers free), 3 for a call whose one modification is its window (`_window`; window: such
    a call, where its kernel's switch, FWD_SM90_WINDOW_ONLY / BWD_SM90_WINDOW_ONLY, is on). FLASHTRAIN_MODS_NOCAP=0
    (A/B): the softcap variant for every other call that has one."""
    if window and not softcap:
        return 3
    if softcap or (has_softcap_variant and os.environ.get("FLASHTRAIN_MODS_NOCAP") == "0"):
        return 1
    return 2


def bwd_sm90_q80_enabled() -> bool:
    return os.environ.get("FLASHTRAIN_BWD_SM90_Q80", "1") != "0"


def _bwd_q80(causal: bool, seqlen_q: int | None, head_dim_eff: int | None = None,
             causal_seqlen: int | None = None) -> bool:
    """The hd128 Hopper backward's 80-query blocks for a call of this query length (None: a short one) and MMA width
    (head_dim_eff: one of SM90_NARROW_HEAD_DIMS, or None for all 128 columns); causal_seqlen: the causal threshold
    (None: the plain kernels' for that width; a threshold of None: 64-query blocks at every causal length)."""
    if causal and head_dim_eff == 80 and BWD_SM90_HD80_CAUSAL_Q64:
        return False
    if causal_seqlen is None:
        causal_seqlen = (BWD_SM90_Q80_CAUSAL_SEQLEN if head_dim_eff in (None, 128)
                         else BWD_SM90_NARROW_Q80_CAUSAL_SEQLEN)
    return bwd_sm90_q80_enabled() and (not causal or (causal_seqlen is not None and (seqlen_q or 0) >= causal_seqlen))


def _bwd_tile_overrides() -> None:
    """FLASHTRAIN_BWD_SM90_TILES="64=128x2,128=64x2x0" (head dim = block_m x stages [x persistent]) replaces entries
    of BWD_SM90_TILES in this process (tile A/B measurements)."""
    for item in filter(None, os.environ.get("FLASHTRAIN_BWD_SM90_TILES", "").split(",")):
        head_dim, shape = item.split("=")
        block_m, stages, *persistent = (int(x) for x in shape.split("x"))
        if int(head_dim) > 128 and block_m != 64:
            raise ValueError(f"FLASHTRAIN_BWD_SM90_TILES: head dim {head_dim} takes block_m 64 (the split-head-dim "
                             f"backward), got {block_m}")
        block_n = BWD_SM90_TILES[int(head_dim)].block_n if int(head_dim) in BWD_SM90_TILES else 128
        BWD_SM90_TILES[int(head_dim)] = BwdSm90Tiles(block_m, stages, block_n=block_n,
                                                     persistent=bool(persistent[0]) if persistent else True)


_bwd_tile_overrides()
SM90_ARCH = "sm_90a"
# Head dims 65-96 on Hopper: the hd128 tiles (zero-filled columns) with the MMA work of 80 columns (head dims 65-80) or
# 96 (81-96): forward without a block mask or score modifications, backward dense, not deterministic. H200,
# 2026-11-29, kernel_ab-h200.json: 96 columns 1.07-1.11x all 128 (forward, 1K-16K); hd80 on 80 columns 1.00-1.10x
# (forward) and 1.02-1.05x (backward) its 96. FLASHTRAIN_SM90_NARROW="96" (A/B) narrows to 96 only, "" not at all.
SM90_NARROW_HEAD_DIMS = (80, 96)


def sm90_narrow_width(head_dim: int, effective_head_dim: int | None) -> int | None:
    """The columns of MMA work a call of effective_head_dim runs on the instantiated head_dim's Hopper tiles, where
    fewer than head_dim (SM90_NARROW_HEAD_DIMS), else None."""
    if head_dim != 128 or effective_head_dim is None or effective_head_dim > SM90_NARROW_HEAD_DIMS[-1]:
        return None
    widths = SM90_NARROW_HEAD_DIMS
    if "FLASHTRAIN_SM90_NARROW" in os.environ:
        widths = sorted(int(w) for w in os.environ["FLASHTRAIN_SM90_NARROW"].split(",") if w.strip())
    return next((w for w in widths if effective_head_dim <= w < head_dim), None)
MAX_STREAMS = 64  # streams one process may run the persistent Hopper kernels on (one tile counter each)
BWD_TILES = {
    32: BwdTiles(64, 128, 8, warps_m_sdp=2, warps_n_dkv=8, warps_m_dq=4, stages=2),
    64: BwdTiles(128, 128, 8, warps_m_sdp=2, warps_n_dkv=4, warps_m_dq=4, stages=2, scramble_dq=1),
    96: BwdTiles(64, 128, 8, warps_m_sdp=2, warps_n_dkv=8, warps_m_dq=4, stages=2),
    128: BwdTiles(64, 128, 8, warps_m_sdp=2, warps_n_dkv=4, warps_m_dq=2, stages=2, scramble_dq=2, vec_row_stats=True),
    192: BwdTiles(64, 64, 8, warps_m_sdp=2, warps_n_dkv=4, warps_m_dq=4, stages=2),
    256: BwdTiles(64, 64, 8, warps_m_sdp=2, warps_n_dkv=4, warps_m_dq=4, stages=1),
    # head dim 512: 32 keys per CTA (dK, dV: 128 registers per thread), dQ in four pieces of 64 columns per warp;
    # 205 KB of shared memory: Hopper (227 KB) only
    512: BwdTiles(64, 32, 8, warps_m_sdp=4, warps_n_dkv=2, warps_m_dq=4, stages=1, dq_chunks=4),
}
AUX_THREADS, AUX_ROWS_PER_CTA = 128, 32  # flash_aux.cuh: kAuxThreads, kRowsPerCta

# Opt-in shared memory per block (bytes) of the GPUs the tile sets are made for: FWD_TILES / BWD_TILES fit sm_80's
# 163 KB (A100, A30; H100 allows 227 KB); the *_SMALL_SMEM tiles fit the 99 KB of sm_86, sm_89 and sm_120 (A10G, L4,
# L40S, RTX 30xx / 40xx / 50xx). The hd64-hd256 backward and the hd256 forward need more than 99 KB in the first set.
SMEM_OPTIN_SM80, SMEM_OPTIN_SM86 = 166912, 101376
ARCH_SMEM_OPTIN = {"sm_80": SMEM_OPTIN_SM80, "sm_86": SMEM_OPTIN_SM86, "sm_87": SMEM_OPTIN_SM80,
                   "sm_89": SMEM_OPTIN_SM86, "sm_90a": 232448, "sm_120": SMEM_OPTIN_SM86}
# Within this kernel's tiling rules (flash_bwd.cuh static_asserts), the largest tiles that fit 99 KB: the backward
# keeps K, V, P, dS and one or two stages of Q, dO; hd64: 64 query rows per step instead of 128; hd96: 64 keys per
# CTA; hd128: 64 keys, one stage; hd192: 32 x 64, one stage; hd256: 32 x 32, 4 warps, one stage. ptxas (nvcc 13.0,
# sm_86; registers, spill stores / loads in bytes, over causal x dropout): bwd hd64 240-255, 0 / 0; hd96 202-255, 0-12;
# hd128 226-252, 0 / 0; hd192 249-255, 0-96; hd256 255, 80-112 / 240-320 (the 163 KB hd256 backward: 24 / 40). The
# hd256 forward at 128 x 32 (8 warps) uses 242 registers and spills nothing; 64 x 64 with 4 warps would spill 1 KB.
FWD_TILES_SMALL_SMEM = {
    256: FwdTiles(128, 32, 8),  # 96 KB (128 x 64: 128 KB)
}
BWD_TILES_SMALL_SMEM = {
    64: BwdTiles(64, 128, 8, warps_m_sdp=2, warps_n_dkv=4, warps_m_dq=4, stages=2),  # 97 KB (162 KB)
    96: BwdTiles(64, 64, 8, warps_m_sdp=2, warps_n_dkv=4, warps_m_dq=4, stages=2),  # 89 KB (129 KB)
    128: BwdTiles(64, 64, 8, warps_m_sdp=2, warps_n_dkv=4, warps_m_dq=4, stages=1),  # 80.5 KB (161 KB)
    192: BwdTiles(32, 64, 8, warps_m_sdp=2, warps_n_dkv=4, warps_m_dq=2, stages=1),  # 80.3 KB (161 KB)
    256: BwdTiles(32, 32, 4, warps_m_sdp=2, warps_n_dkv=2, warps_m_dq=2, stages=1),  # 68.3 KB (144.5 KB)
}
SMEM_ENV = "FLASHTRAIN_MAX_SMEM"


def smem_cap() -> int | None:
    """FLASHTRAIN_MAX_SMEM in bytes (a K suffix multiplies by 1024), or None when unset."""
    text = os.environ.get(SMEM_ENV, "").strip()
    if not text:
        return None
    number, scale = (text[:-1], 1024) if text[-1] in "kK" else (text, 1)
    if not number.isdigit() or int(number) * scale < 1024:
        raise ValueError(f"{SMEM_ENV} must be a number of bytes (or KB with a K suffix, e.g. 99K), got {text!r}")
    return int(number) * scale


def _fitting(candidates, head_dim: int, smem_limit: int | None):
    """The first tiles in `candidates` (None entries skipped) whose shared memory fits smem_limit (None: no limit)."""
    for tiles in candidates:
        if tiles is not None and (smem_limit is None or tiles.smem_bytes(head_dim) <= smem_limit):
            return tiles
    return None


def smem_unavailable_reason(head_dim: int, block_sparse: bool, smem_limit: int | None) -> str | None:
    """None when the mma.sync kernels (forward and backward) of this head_dim fit smem_limit bytes per block."""
    head_dim = rounded_head_dim(head_dim, block_sparse)
    for kind, candidates in (("forward", (FWD_TILES[head_dim], FWD_TILES_SMALL_SMEM.get(head_dim))),
                             ("backward", (BWD_TILES[head_dim], BWD_TILES_SMALL_SMEM.get(head_dim)))):
        if _fitting(candidates, head_dim, smem_limit) is None:
            need = min(tiles.smem_bytes(head_dim) for tiles in candidates if tiles is not None)
            return (f"the {kind} kernel for head_dim {head_dim} needs {need} bytes of shared memory per block, the GPU "
                    f"allows {smem_limit}" + (f" ({SMEM_ENV}={os.environ[SMEM_ENV]})" if smem_cap() else ""))
    return None


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One compilation: an entry file, its macros, and the kernels (cubin symbols) it defines."""

    source: str
    defines: tuple[tuple[str, int | str], ...]
    symbols: tuple[str, ...]
    threads: int
    smem_bytes: int
    block_m: int = 0  # forward kernels: query rows per CTA (sizes the grid)
    block_n: int = 0  # backward kernels: keys per CTA (sizes the grid)
    archs: tuple[str, ...] = ()  # the only targets it compiles for (empty: every sm_80+ target)
    tiles: object = None  # the tile shape it was built with (FwdTiles, BwdTiles, ...; None for the aux kernels)
    # forward: at most one CTA per SM, each taking (query block, batch, head) tiles from a dynamic scheduler (an
    # atomic counter: causal and varlen tiles vary in work; a static round-robin measured hd128 causal 16K at 422 vs
    # 588 TFLOP/s for one CTA per tile, H200)
    persistent: bool = False

    def supports(self, arch: str) -> bool:
        return not self.archs or arch in self.archs

    @property
    def name(self) -> str:
        return self.symbols[0] if len(self.symbols) == 1 else os.path.commonprefix(self.symbols).rstrip("_")


def rounded_head_dim(head_dim: int, block_sparse: bool = False, arch: str | None = None) -> int:
    """The instantiated head dim a head_dim (multiple of 8) runs on: the extra columns are zero-filled. On Hopper,
    head dims 65-96 run on the hd128 warpgroup-MMA kernels (still faster than the mma.sync hd96 kernels); their
    forward without block mask or score modifications and their dense backward skip the MMA work of columns 96-127
    (fwd_kernel's and bwd_kernel's effective_head_dim)."""
    head_dims = BLOCK_SPARSE_HEAD_DIMS if block_sparse else HEAD_DIMS
    for instantiated in head_dims:
        if head_dim <= instantiated:
            if instantiated == 96 and arch == SM90_ARCH and sm90_enabled():
                return 128
            return instantiated
    kind = "block-sparse " if block_sparse else ""
    raise ValueError(f"head_dim must be <= {head_dims[-1]} for the {kind}CUDA kernels, got {head_dim}")


def _check_block_sparse_tiles() -> None:
    """A block_mask block must be a whole number of kernel tiles (the kernels static_assert it too)."""
    for head_dim in BLOCK_SPARSE_HEAD_DIMS:
        for tiles in (FWD_TILES[head_dim], BWD_TILES[head_dim]):
            if BLOCK_SPARSE_SIZE % tiles.block_m or BLOCK_SPARSE_SIZE % tiles.block_n:
                raise AssertionError(f"BLOCK_SPARSE_SIZE {BLOCK_SPARSE_SIZE} is not a multiple of the hd{head_dim} "
                                     f"tiles {tiles}")


# flash_aux.cuh bwd_convert_dq stages a scrambled dq_accum slice in shared memory sized for this many columns.
MAX_DQ_SLICE_WIDTH = 64


def _check_dq_slices() -> None:
    """Every backward that adds dq_accum in the scrambled order does so in slices the conversion can stage."""
    tables = [(hd, t) for table in (BWD_TILES, BWD_TILES_SMALL_SMEM) for hd, t in table.items() if t.scramble_dq]
    for head_dim, tiles in tables + list(BWD_SM90_TILES.items()):
        if tiles.dq_slice_width(head_dim) > MAX_DQ_SLICE_WIDTH:
            raise AssertionError(f"hd{head_dim} backward tiles {tiles}: dQ slices of {tiles.dq_slice_width(head_dim)} "
                                 f"columns; bwd_convert_dq stages at most {MAX_DQ_SLICE_WIDTH}")




def _suffix(causal: bool, dropout: bool, block_sparse: bool) -> str:
    return f"{'_causal' if causal else ''}{'_dropout' if dropout else ''}{'_sparse' if block_sparse else ''}"


def fwd_tiles(head_dim: int, causal: bool, dropout: bool, block_sparse: bool = False,
              smem_limit: int | None = None) -> FwdTiles:
    """The forward's tiles: FWD_TILES[head_dim] for every kernel variant (the block-sparse kernels must use the dense
    ones' tiles: density 1 equals dense bitwise); below their shared memory, FWD_TILES_SMALL_SMEM (smem_limit: bytes
    per block, None: no limit)."""
    tiles = FWD_TILES[head_dim]
    if smem_limit is not None and tiles.smem_bytes(head_dim) > smem_limit:
        return _fitting((FWD_TILES_SMALL_SMEM.get(head_dim),), head_dim, smem_limit) or _no_tiles(
            "forward", head_dim, smem_limit)
    return tiles


def bwd_tiles(head_dim: int, smem_limit: int | None = None) -> BwdTiles:
    """The backward's tiles: BWD_TILES, or below their shared memory BWD_TILES_SMALL_SMEM."""
    return _fitting((BWD_TILES[head_dim], BWD_TILES_SMALL_SMEM.get(head_dim)), head_dim, smem_limit) or _no_tiles(
        "backward", head_dim, smem_limit)


def _no_tiles(kind: str, head_dim: int, smem_limit: int):
    raise ValueError(smem_unavailable_reason(head_dim, False, smem_limit) or f"no {kind} tiles for hd{head_dim}")


def sm90_enabled() -> bool:
    return os.environ.get("FLASHTRAIN_SM90", "1") != "0"


def pdl_enabled() -> bool:
    """The Hopper backward's programmatic dependent launches (ops._bwd_plan); FLASHTRAIN_PDL=0 launches its kernels
    one after another instead (A/B measurements; read when a plan is built)."""
    return os.environ.get("FLASHTRAIN_PDL", "1") != "0"


def _fits(spec: KernelSpec, smem_limit: int | None) -> bool:
    return smem_limit is None or spec.smem_bytes <= smem_limit


def _check_score_mods(score_mods: bool, dropout: bool, block_sparse: bool) -> None:
    if score_mods and (dropout or block_sparse):
        raise ValueError("the score-modification kernels (window_size, softcap, alibi_slopes) have no dropout or "
                         f"block-sparse variant (dropout={dropout}, block_sparse={block_sparse})")


def fwd_kernel(head_dim: int, dtype: str, causal: bool, dropout: bool, block_sparse: bool = False,
               arch: str | None = None, smem_limit: int | None = None, seqlen_q: int = 0,
               score_mods: bool = False, softcap: bool = False, mask_defines: tuple = (),
               seqlen_k: int = 0, effective_head_dim: int | None = None, window_only: bool = False,
               small_l2: bool = False) -> KernelSpec:
    """The forward kernel for these features; on arch sm_90a the warpgroup-MMA kernel where it exists and fits
    smem_limit (bytes of shared memory per block; None: no limit). seqlen_q: the call's (maximum) query length;
    seqlen_k: its key length (0: unknown or varlen); effective_head_dim: the call's head dim when smaller than
    head_dim (the instantiated one): on sm_90a head dims 65-96 without block mask or score modifications run the hd128
    tiles with the MMA work of 80 or 96 columns (sm90_narrow_width).
    score_mods (window_size, softcap, alibi_slopes; without dropout or a block mask): the `_mods` variants (SCORE_MODS),
    on sm_90a the warpgroup-MMA forward with FWD_SM90_TILES, built without the tanh path (`_nocap`) unless softcap (the
    call has one); window_only (the call's one modification is its window): without ALiBi's code either (`_window`,
    FWD_SM90_WINDOW_ONLY). small_l2: the GPU has at most SMALL_L2_BYTES of L2 (its short causal tiles)."""
    _check_score_mods(score_mods, dropout, block_sparse)
    if mask_defines:  # a mask expression (MaskMod.kernel_defines) compiled into the mods kernel
        if arch == SM90_ARCH and head_dim in MASK_SM90_HEAD_DIMS and sm90_enabled():
            spec = _fwd_sm90_spec(head_dim, dtype, causal, False, False, FWD_SM90_TILES[head_dim],
                                  _mods_variant(softcap), tuple(mask_defines))
            if _fits(spec, smem_limit):
                return spec
        return _fwd_spec(head_dim, dtype, causal, False, False, fwd_tiles(head_dim, causal, False, False, smem_limit),
                         True, tuple(mask_defines))
    if score_mods:
        if arch == SM90_ARCH and head_dim in FWD_SM90_MODS_HEAD_DIMS and sm90_enabled():
            mods = _mods_variant(softcap, window=window_only and bool(FWD_SM90_WINDOW_ONLY))
            tiles = [FWD_SM90_TILES[head_dim]]
            if mods == 3 and FWD_SM90_WINDOW_Q_BUFFERS > 1 and tiles[0].separate_o:  # (where they fit, else one)
                tiles.insert(0, dataclasses.replace(tiles[0], q_buffers=FWD_SM90_WINDOW_Q_BUFFERS))
            for choice in tiles:
                spec = _fwd_sm90_spec(head_dim, dtype, causal, False, False, choice, mods)
                if _fits(spec, smem_limit):
                    return spec
        return _fwd_spec(head_dim, dtype, causal, dropout, block_sparse,
                         fwd_tiles(head_dim, causal, dropout, block_sparse, smem_limit), True)
    if arch == SM90_ARCH and head_dim in FWD_SM90_TILES and sm90_enabled():
        narrow = None if block_sparse else sm90_narrow_width(head_dim, effective_head_dim)
        for tiles in (fwd_sm90_tiles(head_dim, causal, dropout, block_sparse, seqlen_q, seqlen_k, narrow, small_l2),
                      FWD_SM90_TILES[head_dim]):
            tail_split = _fwd_tail_split(head_dim, causal, dropout, block_sparse, tiles)
            spec = _fwd_sm90_spec(head_dim, dtype, causal, dropout, block_sparse, tiles, head_dim_eff=narrow,
                                  tail_split=tail_split)
            if _fits(spec, smem_limit):  # (under a capped limit the non-causal tiles may not fit, the others may)
                return spec
    return _fwd_spec(head_dim, dtype, causal, dropout, block_sparse,
                     fwd_tiles(head_dim, causal, dropout, block_sparse, smem_limit))


def _tile_suffix(tiles, default_tiles) -> str:
    """'' for a head dim's first-choice tiles, else the shape (the small-memory kernels get their own names)."""
    return "" if tiles == default_tiles else f"_{tiles.block_m}x{tiles.block_n}"


# The specs are built once per (arguments, tiles): building one costs ~10 us of host time, and the forward and backward
# of every attention call look theirs up.
@functools.lru_cache(maxsize=None)
def _fwd_spec(head_dim: int, dtype: str, causal: bool, dropout: bool, block_sparse: bool,
              tiles: FwdTiles, score_mods: bool = False, mask_defines: tuple = ()) -> KernelSpec:
    name = (f"flash_fwd_hdim{head_dim}_{dtype}{_suffix(causal, dropout, block_sparse)}{'_mods' if score_mods else ''}"
            f"{_tile_suffix(tiles, fwd_tiles(head_dim, causal, dropout, block_sparse))}{_mask_suffix(mask_defines)}")
    defines = (("FT_HEAD_DIM", head_dim), ("FT_BLOCK_M", tiles.block_m), ("FT_BLOCK_N", tiles.block_n),
               ("FT_NWARPS", tiles.nwarps), ("FT_BF16", int(dtype == "bf16")), ("FT_CAUSAL", int(causal)),
               ("FT_DROPOUT", int(dropout)), ("FT_BLOCK_SPARSE", int(block_sparse)),
               ("FT_SMEM_BYTES", tiles.smem_bytes(head_dim)), ("FT_KERNEL_NAME", name))
    if tiles.warps_d > 1:  # (only where used: the other kernels' macros, hence their cache keys, stay as they were)
        defines += (("FT_WARPS_D", tiles.warps_d),)
    if score_mods:  # (the other kernels' macros, hence their cache keys, stay as they were)
        defines += (("FT_SCORE_MODS", 1),) + tuple(mask_defines)
    return KernelSpec("flash_fwd.cu", defines, (name,), 32 * tiles.nwarps, tiles.smem_bytes(head_dim),
                      block_m=tiles.block_m, tiles=tiles)


def _mask_suffix(mask_defines: tuple) -> str:
    """A mask expression's kernels are named by a digest of its macros (the expression, its tensors' dtypes / ranks)."""
    return f"_mask{hashlib.sha256(repr(mask_defines).encode()).hexdigest()[:16]}" if mask_defines else ""


def long_keys_seqlen(causal: bool) -> int:
    """The key length from which dense head-dim-128 forwards take FWD_SM90_TILES_LONG_KEYS (causal or not)."""
    return LONG_KEYS_CAUSAL_SEQLEN if causal else LONG_KEYS_SEQLEN


def _short_causal(head_dim: int, seqlen_q: int, seqlen_k: int) -> bool:
    """Whether a causal call takes FWD_SM90_TILES_SHORT_CAUSAL: head dim 128 below SHORT_CAUSAL_SEQLEN query rows;
    above 128 up to FWD_SM90_WIDE_SHORT_CAUSAL_SEQLEN query and key rows (a short query chunk over many keys walks
    long key rows, where the 64-key tiles lose; seqlen_k 0, varlen or unknown, passes)."""
    if head_dim <= 128:
        return 0 < seqlen_q < SHORT_CAUSAL_SEQLEN
    return 0 < seqlen_q <= FWD_SM90_WIDE_SHORT_CAUSAL_SEQLEN and seqlen_k <= FWD_SM90_WIDE_SHORT_CAUSAL_SEQLEN


def fwd_sm90_tiles(head_dim: int, causal: bool, dropout: bool, block_sparse: bool, seqlen_q: int = 0,
                   seqlen_k: int = 0, head_dim_eff: int | None = None, small_l2: bool = False) -> FwdSm90Tiles:
    """The Hopper forward's tiles for a call (seqlen_q / seqlen_k: 0 unknown or varlen; head_dim_eff: a narrowed
    width, sm90_narrow_width, or None; small_l2: the GPU has at most SMALL_L2_BYTES of L2)."""
    plain = not (dropout or block_sparse)  # the tables by mask and length are for calls without either
    if plain and seqlen_k >= long_keys_seqlen(causal) and head_dim in FWD_SM90_TILES_LONG_KEYS:
        tiles = FWD_SM90_TILES_LONG_KEYS[head_dim]
    elif plain and not causal and head_dim in FWD_SM90_TILES_NONCAUSAL:
        tiles = FWD_SM90_TILES_NONCAUSAL[head_dim]
    elif plain and causal and seqlen_q >= LONG_CAUSAL_SEQLEN and head_dim in FWD_SM90_TILES_LONG_CAUSAL:
        tiles = FWD_SM90_TILES_LONG_CAUSAL[head_dim]
        if small_l2 and seqlen_q <= SMALL_L2_Q_BUFFERS_SEQLEN and tiles.separate_o:
            tiles = dataclasses.replace(tiles, q_buffers=2)
    elif plain and causal and head_dim in FWD_SM90_TILES_SHORT_CAUSAL and _short_causal(head_dim, seqlen_q, seqlen_k):
        tiles = FWD_SM90_TILES_SHORT_CAUSAL[head_dim]
    else:
        tiles = FWD_SM90_TILES[head_dim]
    ref_seqlen, ref_tiles = FWD_SM90_REF_CAUSAL_SEQLEN.get(head_dim, (0, None))
    if plain and causal and head_dim_eff in (None, head_dim) and 0 < ref_seqlen <= seqlen_q and tiles == ref_tiles:
        tiles = dataclasses.replace(tiles, ref_causal=True)  # (the tiles all_kernels() builds the `_ref` kernels on)
    # (clusters: query tiles in pairs of one (batch, head), so an even number of them; seqlen_k 0: varlen or unknown)
    if (fwd_sm90_cluster_head_dim(head_dim) and plain and not causal
            and head_dim_eff in (None, head_dim) and seqlen_k >= max(FWD_SM90_CLUSTER_SEQLEN, 1) and seqlen_q > 0
            and -(-seqlen_q // tiles.block_m) % 2 == 0 and tiles.q_buffers == 1):
        return dataclasses.replace(tiles, cluster=2)
    # FLASHTRAIN_FWD_SM90_Q_BUFFERS=N (A/B): N Q buffers wherever O has a tile of its own and shared memory allows
    # (seqlen_q 0: unknown, the tables' first choice)
    q_buffers = os.environ.get("FLASHTRAIN_FWD_SM90_Q_BUFFERS")
    if q_buffers and tiles.separate_o:
        other = dataclasses.replace(tiles, q_buffers=int(q_buffers))
        if other.smem_bytes(head_dim) <= ARCH_SMEM_OPTIN[SM90_ARCH]:
            return other
    return tiles


def fwd_sm90_kernel(head_dim: int, dtype: str, causal: bool, dropout: bool = False,
                    block_sparse: bool = False, seqlen_q: int = 0, seqlen_k: int = 0,
                    head_dim_eff: int | None = None, tail_split: bool | None = None,
                    small_l2: bool = False) -> KernelSpec:
    """head_dim_eff: one of SM90_NARROW_HEAD_DIMS on the hd128 tiles (no block mask); None or head_dim: all columns.
    tail_split: the tail-split variant where there is one (None: FWD_TAIL_SPLIT decides). small_l2: as
    fwd_sm90_tiles'."""
    tiles = fwd_sm90_tiles(head_dim, causal, dropout, block_sparse, seqlen_q, seqlen_k, head_dim_eff, small_l2)
    return _fwd_sm90_spec(head_dim, dtype, causal, dropout, block_sparse, tiles, head_dim_eff=head_dim_eff,
                          tail_split=_fwd_tail_split(head_dim, causal, dropout, block_sparse, tiles, tail_split))


def _fwd_tail_split(head_dim: int, causal: bool, dropout: bool, block_sparse: bool, tiles: FwdSm90Tiles,
                    on: bool | None = None) -> bool:
    """Whether a Hopper forward on these tiles takes the tail split (on: None, FWD_TAIL_SPLIT decides)."""
    return (bool(FWD_TAIL_SPLIT if on is None else on) and not (causal or dropout or block_sparse)
            and head_dim <= 256 and tiles.q_buffers == 1 and tiles.cluster == 1 and tiles.block_n <= 128)


# The Hopper forward's tail split (flash_fwd_sm90.cuh FT_FWD_TAIL_SPLIT; ops._tail_split picks the pieces): the dense
# non-causal one-CTA kernels with one Q buffer and key blocks of at most 128 (head dims up to 256, no dropout; not the
# 192-key hd128 tiles, see the kernel's traits) run the last, partial wave of a launch's tiles as pieces over their key
# blocks, merged by the piece that ends last, as the backward's BWD_TAIL_SPLIT does over query blocks. Off by
# default: the _tail kernels measured slower at hd64 non-causal 2K-16K (docs/kernels.md). FWD_TAIL_SPLIT = 1
# (FLASHTRAIN_FWD_TAIL_SPLIT=1 at import, or ab_probe.py flashtrain@build.FWD_TAIL_SPLIT=1; read at plan time): on.
FWD_TAIL_SPLIT = int(os.environ.get("FLASHTRAIN_FWD_TAIL_SPLIT", "0"))


def fwd_tail_split(spec: KernelSpec) -> bool:
    """Whether this forward kernel runs a launch's tail tiles in pieces (FwdSm90Params' tail fields)."""
    return ("FT_FWD_TAIL_SPLIT", 1) in spec.defines


@functools.lru_cache(maxsize=None)
def _fwd_sm90_spec(head_dim: int, dtype: str, causal: bool, dropout: bool, block_sparse: bool,
                   tiles: FwdSm90Tiles, score_mods: int = 0, mask_defines: tuple = (),
                   head_dim_eff: int | None = None, tail_split: bool = False) -> KernelSpec:
    """score_mods: 0 none, 1 window / softcap / ALiBi, 2 window / ALiBi, 3 window (FwdSm90Traits' FT_SCORE_MODS);
    head_dim_eff: the columns of MMA work (one of SM90_NARROW_HEAD_DIMS of 128, without block mask or score
    modifications; None: head_dim); tail_split: the launch's tail tiles in pieces (FWD_TAIL_SPLIT)."""
    head_dim_eff = head_dim_eff or head_dim
    if tail_split and (causal or dropout or block_sparse or score_mods or head_dim > 256 or tiles.q_buffers > 1
                       or tiles.cluster > 1 or tiles.block_n > 128):
        raise ValueError("the forward's tail split: dense non-causal one-CTA kernels with one Q buffer and key blocks "
                         "of at most 128, head dims up to 256, without dropout or score modifications")
    if head_dim_eff != head_dim and (head_dim != 128 or head_dim_eff not in SM90_NARROW_HEAD_DIMS or block_sparse
                                     or score_mods or tiles.cluster > 1):
        raise ValueError(f"no Hopper forward of head dim {head_dim} narrowed to {head_dim_eff} "
                         f"(block_sparse={block_sparse}, score_mods={score_mods}, cluster={tiles.cluster})")
    smem_bytes = tiles.smem_bytes(head_dim)
    # tiles other than the features' first choice (long causal sequences, a capped shared-memory limit) get names of
    # their own: a process may load both, and kernels are looked up by name
    first_choice = fwd_sm90_tiles(head_dim, causal, dropout, block_sparse)
    same_shape = (dataclasses.replace(tiles, q_buffers=first_choice.q_buffers, cluster=1, ref_causal=False)
                  == first_choice)
    name = (f"flash_fwd_sm90_hdim{head_dim_eff}_{dtype}{_suffix(causal, dropout, block_sparse)}"
            f"{'' if same_shape else f'_{tiles.block_m}x{tiles.block_n}'}{'' if tiles.q_buffers == 1 else '_q2'}"
            f"{'' if tiles.cluster == 1 else f'_c{tiles.cluster}'}"
            f"{'_mods' if score_mods else ''}{'_nocap' if score_mods == 2 else ''}"
            f"{'_window' if score_mods == 3 else ''}{_mask_suffix(mask_defines)}{'_tail' if tail_split else ''}"
            f"{'_ref' if tiles.ref_causal else ''}")
    defines = (("FT_HEAD_DIM", head_dim), ("FT_BLOCK_M", tiles.block_m), ("FT_BLOCK_N", tiles.block_n),
               ("FT_STAGES", tiles.stages), ("FT_SEPARATE_O", int(tiles.separate_o)), ("FT_THREADS", tiles.threads),
               ("FT_Q_BUFFERS", tiles.q_buffers),
               ("FT_BF16", int(dtype == "bf16")),
               ("FT_CAUSAL", int(causal)), ("FT_DROPOUT", int(dropout)), ("FT_BLOCK_SPARSE", int(block_sparse)),
               ("FT_SMEM_BYTES", smem_bytes), ("FT_MAX_STREAMS", MAX_STREAMS), ("FT_KERNEL_NAME", name))
    if score_mods:  # (the other kernels' macros, hence their cache keys, stay as they were)
        defines += (("FT_SCORE_MODS", int(score_mods)),) + tuple(mask_defines)
    if head_dim_eff != head_dim:  # (likewise)
        defines += (("FT_HEAD_DIM_EFF", head_dim_eff),)
    if tiles.cluster > 1:  # (likewise)
        defines += (("FT_CLUSTER", tiles.cluster),)
    if tail_split:  # (likewise)
        defines += (("FT_FWD_TAIL_SPLIT", 1),)
    if tiles.ref_causal:  # (likewise)
        defines += (("FT_FWD_REF_CAUSAL", 1),)
    return KernelSpec("flash_fwd_sm90.cu", defines, (name,), tiles.threads, smem_bytes, block_m=tiles.block_m,
                      archs=(SM90_ARCH,), tiles=tiles, persistent=True)


def bwd_kernel(head_dim: int, dtype: str, causal: bool, dropout: bool, block_sparse: bool = False,
               arch: str | None = None, deterministic: bool = False, smem_limit: int | None = None,
               effective_head_dim: int | None = None, seqlen_q: int | None = None,
               score_mods: bool = False, softcap: bool = False, mask_defines: tuple = (),
               window_left: int = -1, window_only: bool = False) -> KernelSpec:
    """The backward kernel for these features (head_dim: the instantiated one, rounded_head_dim; effective_head_dim:
    the call's own, when smaller); on arch sm_90a the warpgroup-MMA kernel where it exists and fits smem_limit (bytes
    of shared memory per block; None: no limit): head dims 65-96 there run the hd128 tiles with the MMA work of 80 or
    96 columns (sm90_narrow_width; dense, not deterministic). seqlen_q: the call's (max) query length, which picks the
    causal hd128 tiles (None: the short ones). score_mods (SCORE_MODS): the `_mods` variants, on sm_90a the warpgroup-MMA backward at
    head dims 64 / 128 (not deterministic: flash_bwd.cuh runs that; softcap (a call with one) at head dim 64 neither:
    BWD_SM90_MODS_SOFTCAP); window_left: the call's left window bound, -1 for none (its tiles: bwd_sm90_mods_kernel);
    window_only: the call's one score modification is its window (no softcap, no ALiBi): the Hopper kernel without
    ALiBi's code (bwd_sm90_mods_kernel)."""
    _check_score_mods(score_mods, dropout, block_sparse)
    if mask_defines:  # a mask expression (MaskMod.kernel_defines) compiled into the mods kernel
        if (arch == SM90_ARCH and head_dim in BWD_SM90_MODS_HEAD_DIMS and head_dim in MASK_SM90_HEAD_DIMS
                and sm90_enabled() and not deterministic and (not softcap or BWD_SM90_MODS_SOFTCAP[head_dim])):
            spec = bwd_sm90_mods_kernel(head_dim, dtype, causal, tuple(mask_defines), softcap)
            if _fits(spec, smem_limit):
                return spec
        return _bwd_spec(head_dim, dtype, causal, False, False, bwd_tiles(head_dim, smem_limit), True,
                         tuple(mask_defines))
    if score_mods:
        if (arch == SM90_ARCH and head_dim in BWD_SM90_MODS_HEAD_DIMS and sm90_enabled() and not deterministic
                and (not softcap or BWD_SM90_MODS_SOFTCAP[head_dim])):
            spec = bwd_sm90_mods_kernel(head_dim, dtype, causal, softcap=softcap, seqlen_q=seqlen_q,
                                        window_left=window_left, window_only=window_only and not softcap)
            if _fits(spec, smem_limit):
                return spec
        return _bwd_spec(head_dim, dtype, causal, dropout, block_sparse, bwd_tiles(head_dim, smem_limit), True)
    if (arch == SM90_ARCH and not (deterministic and block_sparse) and head_dim in BWD_SM90_TILES and sm90_enabled()
            and BWD_SM90_TILES[head_dim].supports(dropout, block_sparse, deterministic)):
        narrow = None if block_sparse or deterministic else sm90_narrow_width(head_dim, effective_head_dim)
        spec = bwd_sm90_kernel(head_dim, dtype, causal, dropout, block_sparse, deterministic,
                               head_dim_eff=narrow, seqlen_q=seqlen_q)
        if _fits(spec, smem_limit):
            return spec
    return _bwd_spec(head_dim, dtype, causal, dropout, block_sparse, bwd_tiles(head_dim, smem_limit))


def bwd_sm90_kernel(head_dim: int, dtype: str, causal: bool, dropout: bool = False, block_sparse: bool = False,
                    deterministic: bool = False, head_dim_eff: int | None = None,
                    seqlen_q: int | None = None, tail_split: bool | None = None) -> KernelSpec:
    """head_dim_eff: one of SM90_NARROW_HEAD_DIMS on the hd128 tiles (dense, not deterministic); None or head_dim:
    all. tail_split: the tail-split variant where there is one (None: BWD_TAIL_SPLIT decides)."""
    tiles = BWD_SM90_TILES[head_dim]
    head_dim_eff = None if head_dim_eff == head_dim else head_dim_eff
    if not tiles.supports(dropout, block_sparse, deterministic):
        raise ValueError(f"the Hopper backward at head dim {head_dim} has no dropout, block-sparse or deterministic "
                         f"variant (dropout={dropout}, block_sparse={block_sparse}, deterministic={deterministic})")
    if head_dim_eff is not None and (head_dim != 128 or head_dim_eff not in SM90_NARROW_HEAD_DIMS or block_sparse
                                     or deterministic):
        raise ValueError(f"no Hopper backward of head dim {head_dim} narrowed to {head_dim_eff} "
                         f"(block_sparse={block_sparse}, deterministic={deterministic})")
    plain = not (dropout or block_sparse or deterministic)
    if head_dim == 192 and tiles.split_keys and not BWD_SM90_HD192_N96:
        tiles = BWD_SM90_HD192_N64
    if tiles.split_keys and not BWD_SM90_HD192_STAGE_DQ:
        tiles = BWD_SM90_HD192_REG_DQ
    if head_dim == 128 and plain and _bwd_q80(causal, seqlen_q, head_dim_eff):
        tiles = _dq_frag_choice(BWD_SM90_DENSE128_TILES, causal, head_dim_eff or head_dim, False)
    if _bwd_fused_dq_rule(head_dim, causal, plain and head_dim_eff is None, seqlen_q, tiles):
        tiles = dataclasses.replace(tiles, fused_dq=True)
    if _bwd_kv2_rule(head_dim, causal, plain and head_dim_eff is None, seqlen_q, tiles):
        tiles = dataclasses.replace(tiles, kv_stages=2, fused_dq=False)
    tail_split = (bool(BWD_TAIL_SPLIT if tail_split is None else tail_split)
                  and not (causal or block_sparse or deterministic) and head_dim <= 128 and tiles.persistent)
    lse_plain = not (dropout or block_sparse or (deterministic and not BWD_SM90_DET_LSE_BIAS))
    lse_bias = _bwd_lse_bias_rule(head_dim, head_dim_eff, lse_plain, tiles)
    return _bwd_sm90_spec(head_dim, dtype, causal, dropout, block_sparse, deterministic, tiles,
                          head_dim_eff or head_dim, lse_bias=lse_bias, tail_split=tail_split)


# The Hopper backward's tail split (flash_bwd_sm90.cuh FT_BWD_TAIL_SPLIT; ops._tail_split picks the pieces): the
# dense non-causal kernels of head dims up to 128 (not block-sparse or deterministic; dropout too) run the last,
# partial wave of a launch's tiles as pieces over their query blocks, so that the SMs the last wave leaves idle share
# its work. H200, ab_probe.py, backward against whole tiles (a second copy of those: 0.999-1.017): hd64 16K / 8K / 4K
# / 2K 1.023 / 1.022 / 1.016 / 1.010, hd128 16K / 8K / 4K 1.025 / 1.022 / 1.012; forward + backward 1.007-1.015
# (kernel_ab-h200.json tail_split_ab). BWD_TAIL_SPLIT = 0 (FLASHTRAIN_BWD_TAIL_SPLIT=0 at import, or ab_probe.py
# flashtrain@build.BWD_TAIL_SPLIT=0; read at plan time): whole tiles only.
BWD_TAIL_SPLIT = int(os.environ.get("FLASHTRAIN_BWD_TAIL_SPLIT", "1"))


# The Hopper backward's dQ conversion in the kernel (flash_bwd_sm90.cuh kFusedDq; BwdSm90Tiles.fused_dq): with
# BWD_FUSED_DQ >= 1 the dense causal backward without dropout at head dim 64 (128-query blocks) converts
# dq itself, with no conversion kernel after it, for query lengths up to BWD_FUSED_DQ_MAX_SEQLEN (None: a short call).
# Interleaved CUDA-graph replays, backward against the conversion kernel: H200 hd64 causal 512 1.063, 1K (12 heads)
# 1.034, 4K 1.011, 16K 0.981; at head dim 128 (64-query blocks) 0.81-0.89 at 512-16K (kernel_ab-h200.json
# bwd_fused_dq_ab); H100 hd64 causal 512 0.994, 1K 1.050, 2K 1.038, 4K 1.022, 8K 1.000 (kernel_ab-h100.json
# bwd_fused_dq_validation_hd64_ab). Its GPU tests and memcheck grid: gpu_tests_all-h100.json fused_dq_on_run. Head
# dim 128 gained only with the query blocks walked from the last down, at 1K queries (bwd_walk_rev_fused_hd128_ab).
# Since the converters drop the converted lines of dq_accum from L2 (flash_bwd_sm90.cuh FT_BWD_FDQ_DISCARD), H100: hd64
# causal 512 1.066-1.080 over the kernel without the drop, 1K 1.018-1.021, 2K-4K 0.998-1.001; the reach rechecked with
# it: fused past 4K 0.985-0.993 at 8K / 16K, head dim 128 on the ascending walk 0.875-0.928, hd64 non-causal 0.92-0.93
# of the two K / V buffers (kernel_ab-h100.json bwd_fdq_discard_ab, bwd_fdq_reach_ab).
# With BWD_FUSED_DQ = 2 head dim 128 (64-query blocks) takes it for causal calls up to BWD_FUSED_DQ_HD128_MAX_SEQLEN
# queries, in a kernel whose walk visits each head's query blocks from the last down, with 40 producer registers
# (flash_bwd_sm90.cuh QueryBlockWalk::kRev, kProducerRegs): H100, backward against the conversion kernel, causal 512
# 1.013, 768 1.049, 1K 1.059, 1536 1.004, 2K 1.011; forward + backward 512 1.016, 1K 1.037 (kernel_ab-h100.json
# bwd_fdq_rev_hd128_ab). Its GPU tests and memcheck grid: gpu_tests_all-h100.json fused_dq_hd128_default_run.
# BWD_FUSED_DQ (FLASHTRAIN_BWD_FUSED_DQ at import, or ab_probe.py flashtrain@build.BWD_FUSED_DQ=N; read at plan time):
# 0 the conversion kernel everywhere, 1 head dim 64 only, 2 head dims 64 and 128 (the default).
BWD_FUSED_DQ = int(os.environ.get("FLASHTRAIN_BWD_FUSED_DQ", "2"))
BWD_FUSED_DQ_MAX_SEQLEN = int(os.environ.get("FLASHTRAIN_BWD_FUSED_DQ_MAX_SEQLEN", "4096"))
BWD_FUSED_DQ_HD128_MAX_SEQLEN = int(os.environ.get("FLASHTRAIN_BWD_FUSED_DQ_HD128_MAX_SEQLEN", "1024"))


def _bwd_fused_dq_rule(head_dim: int, causal: bool, plain: bool, seqlen_q: int | None, tiles: BwdSm90Tiles) -> bool:
    """Whether the Hopper backward of these tiles converts dq itself (plain: dense, no dropout, all head-dim columns)."""
    head_dims = {1: (64,), 2: (64, 128)}.get(BWD_FUSED_DQ, ())
    limit = BWD_FUSED_DQ_HD128_MAX_SEQLEN if head_dim == 128 else BWD_FUSED_DQ_MAX_SEQLEN
    return (plain and causal and head_dim in head_dims and tiles.block_m * head_dim == 8192
            and (seqlen_q is None or seqlen_q <= limit))


# The Hopper backward's second K / V buffer (flash_bwd_sm90.cuh kKvStages; BwdSm90Tiles.kv_stages = 2): the dense
# hd64 backward without dropout (128-query blocks) with a known query length up to BWD_SM90_HD64_KV2_FULL_SEQLEN
# (non-causal) / BWD_SM90_HD64_KV2_CAUSAL_SEQLEN (causal; in place of the fused dQ conversion) takes it. H100,
# 2026-12-06, interleaved CUDA-graph replays (ab_probe.py), backward against one buffer: non-causal 512 1.018-1.020
# (12 heads 1.019), 768 1.014, 1K 1.009, 2K 1.002, 4K / 8K 1.001-1.002, forward + backward 512 1.012-1.017, 1K
# 1.008, 2K 0.993; causal 512 1.012-1.022, the same as the conversion kernel without the second buffer
# (BWD_FUSED_DQ = 0), and 768-4K 0.969-0.989 against the fused conversion it replaces (kernel_ab-h100.json
# bwd_kv2_ab): non-causal up to 1K, never causal. 0: never (FLASHTRAIN_BWD_SM90_HD64_KV2_FULL_SEQLEN /
# _CAUSAL_SEQLEN at import, or ab_probe.py flashtrain@build.BWD_SM90_HD64_KV2_FULL_SEQLEN=N; read at plan time).
BWD_SM90_HD64_KV2_FULL_SEQLEN = int(os.environ.get("FLASHTRAIN_BWD_SM90_HD64_KV2_FULL_SEQLEN", "1024"))
BWD_SM90_HD64_KV2_CAUSAL_SEQLEN = int(os.environ.get("FLASHTRAIN_BWD_SM90_HD64_KV2_CAUSAL_SEQLEN", "0"))


def _bwd_kv2_rule(head_dim: int, causal: bool, plain: bool, seqlen_q: int | None, tiles: BwdSm90Tiles) -> bool:
    """Whether the Hopper backward of these tiles takes two K / V buffers (plain: dense, no dropout, all columns)."""
    limit = BWD_SM90_HD64_KV2_CAUSAL_SEQLEN if causal else BWD_SM90_HD64_KV2_FULL_SEQLEN
    return (plain and head_dim == 64 and tiles.block_m == 128 and seqlen_q is not None and seqlen_q <= limit)


def bwd_fused_dq(spec: KernelSpec) -> bool:
    """Whether this backward kernel converts dq itself (BwdParams.dq, dq_counts; no conversion launch)."""
    return ("FT_BWD_FUSED_DQ", 1) in spec.defines


def bwd_tail_split(spec: KernelSpec) -> bool:
    """Whether this backward kernel runs a launch's tail tiles in pieces (BwdParams' tail fields; ops._tail_split)."""
    return ("FT_BWD_TAIL_SPLIT", 1) in spec.defines


# The Hopper backward kernels that accumulate S^T onto each query's lse term (flash_bwd_sm90.cuh kBiasS; the
# preprocess writes lse in raw score units for them, AuxParams.lse_bias): P^T = exp2(S^T scale), the lse loads ahead of
# the GEMM. The narrowed kernels (head dims 65-96) and the hd128 64-query ones, without dropout, a block mask or
# determinism. H200, 2026-12-01, interleaved CUDA-graph A/B, backward, biased / FFMA form: hd80 / hd96 causal 4K
# 1.029 / 1.032, hd80 non-causal 4K 1.041, hd96 causal 16K 1.044, hd96 GQA 32/8 8K 1.038, hd80 causal 1K 1.014;
# forward + backward, causal 4K 1.021 / 1.024; hd128 64-query causal 2K / 4K / 8K 1.015 / 1.019 / 1.022, GQA 32/8 8K
# 1.020, 1K 1.007 (08:41 UTC; as the default at 09:45 UTC: 8K 1.022, GQA 1.021, 1K 1.008; kernel_ab-h200.json). The hd64 and hd128 80-query kernels measured 0.77-0.96 with it and keep the
# FFMA (hd128 80-query: ptxas serializes the wgmmas for lack of registers, C7512, even with the accumulator started at
# zero); the dropout kernels keep it too (not measured).
# BWD_SM90_LSE_BIAS = 0 (FLASHTRAIN_BWD_SM90_LSE_BIAS=0 at import, or ab_probe.py flashtrain@build.BWD_SM90_LSE_BIAS=0;
# read at plan time): none.
BWD_SM90_LSE_BIAS = int(os.environ.get("FLASHTRAIN_BWD_SM90_LSE_BIAS", "1"))
# The deterministic hd128 kernels (64-query blocks, no dropout or block mask) start S^T at the lse term too, with fp32
# P^T (flash_bwd_sm90.cuh FT_BWD_DET_PT_FP32): H100, interleaved CUDA-graph replays, deterministic / default backward,
# without -> with both: hd128 full 16K 0.838 -> 0.850, 8K 0.858 -> 0.867, 4K 0.861 -> 0.878; causal 16K 0.848 ->
# 0.869, 8K 0.856 -> 0.873, 4K 0.875 -> 0.898, 2K 0.887 -> 0.901; either alone less (kernel_ab-h100.json
# det_hd128_builds_ab). BWD_SM90_DET_LSE_BIAS = 0 (FLASHTRAIN_BWD_SM90_DET_LSE_BIAS=0 at import, or ab_probe.py
# flashtrain-det@build.BWD_SM90_DET_LSE_BIAS=0; read at plan time): S^T from zero.
BWD_SM90_DET_LSE_BIAS = int(os.environ.get("FLASHTRAIN_BWD_SM90_DET_LSE_BIAS", "1"))


def bwd_lse_bias(spec: KernelSpec) -> bool:
    """Whether this backward kernel reads the lse in raw score units (AuxParams.lse_bias for its preprocess)."""
    return ("FT_BWD_LSE_BIAS", 1) in spec.defines


def _bwd_lse_bias_rule(head_dim: int, head_dim_eff: int | None, plain: bool, tiles: BwdSm90Tiles) -> bool:
    """Whether BWD_SM90_LSE_BIAS starts this Hopper backward kernel's S^T at the lse term (head_dim_eff: None or
    head_dim for all columns; plain: no dropout, block mask or determinism)."""
    if not BWD_SM90_LSE_BIAS or not plain:
        return False
    return head_dim_eff not in (None, head_dim) or (head_dim == 128 and tiles.block_m == 64)


# The 80-query backward's dQ^T in fragment order (BwdSm90Tiles.dq_frag) where it measured faster: every kernel
# without score modifications (non-causal; causal where BWD_SM90_Q80_CAUSAL_SEQLEN gives them; head dims 65-96).
# H200, interleaved CUDA-graph replays (ab_probe.py --pass bwd), fragment order / plain rows: hd128 full 4K
# 1.005-1.009, 16K 1.007-1.014; hd80 causal 4K 1.043, hd96 1.031 (2026-11-29, two runs in either order); hd128 causal
# 16K 1.017 at batch 1, 1.016 at batch 2 (2026-12-01, noise 1.000). (At causal 8K, when the 80-query kernel still
# ran it: 0.973-0.975, GQA 32/8 0.973.) The score-modification kernels at head dim 128 causal keep the plain rows
# (not measured with fragment order). BWD_DQ_FRAG = 0 (or FLASHTRAIN_BWD_DQ_FRAG=0 at import): plain rows
# everywhere; 2: fragment order everywhere (A/B: ab_probe.py flashtrain@build.BWD_DQ_FRAG=0).
BWD_DQ_FRAG = int(os.environ.get("FLASHTRAIN_BWD_DQ_FRAG", "1"))


# The Hopper backward's loop with less address arithmetic (flash_bwd_sm90.cuh FT_BWD_LEAN_ADDR): the 80-query kernels
# without score modifications and the dense hd64 non-causal one. H200, 2026-11-29, interleaved CUDA-graph A/B,
# backward, lean / plain: hd128 full 16K 1.025, 4K 1.023; hd128 causal 8K 1.008, 16K 1.005; GQA 32/8 8K 1.008; hd80
# / hd96 causal 4K 1.004 / 1.003; hd64 full 16K 1.018; but hd64 causal 4K 0.982, hd128 causal 1K (64-query blocks)
# 0.988 and the deterministic hd128 causal 16K 0.992, which keep the plain form (kernel_ab-h200.json). A/B: ab_probe.py
# flashtrain+FT_BWD_LEAN_ADDR=0 (the extra define comes last and overrides).
def _bwd_lean_addr(head_dim: int, causal: bool, dropout: bool, block_sparse: bool, deterministic: bool,
                   tiles: BwdSm90Tiles, score_mods: int) -> bool:
    plain = not (dropout or block_sparse or deterministic or score_mods)
    return plain and (tiles.swap_dq or (head_dim == 64 and not causal))


def _dq_frag_choice(tiles: BwdSm90Tiles, causal: bool, head_dim_eff: int, score_mods: bool) -> BwdSm90Tiles:
    frag = BWD_DQ_FRAG == 2 or (BWD_DQ_FRAG == 1 and not (score_mods and causal and head_dim_eff == 128))
    return tiles if not tiles.swap_dq or frag == tiles.dq_frag else dataclasses.replace(tiles, dq_frag=frag)


def bwd_sm90_mods_kernel(head_dim: int, dtype: str, causal: bool, mask_defines: tuple = (),
                         softcap: bool = False, seqlen_q: int | None = None, window_left: int = -1,
                         window_only: bool = False) -> KernelSpec:
    """The Hopper backward's score-modification variant (window, softcap, ALiBi; dense, no dropout), with a mask
    expression compiled in when mask_defines is given. softcap=False (a call without one): the variant without
    softcap's derivative (`_nocap`, _mods_variant; the only one at head dim 64, BWD_SM90_MODS_SOFTCAP), at head dim
    128 causal on 80-query blocks from BWD_SM90_MODS_Q80_CAUSAL_SEQLEN queries (the call's (max) query length
    seqlen_q), unless window_left (the window's left bound, -1: none) makes it a sliding window of at most
    BWD_SM90_WINDOW_Q64_MAX_LEFT keys (BWD_SM90_WINDOW_Q64). window_only (a call whose one modification is its
    window, no mask expression): the variant without ALiBi (`_window`, FT_SCORE_MODS 3; BWD_SM90_WINDOW_ONLY)."""
    if softcap and not BWD_SM90_MODS_SOFTCAP[head_dim]:
        raise ValueError(f"the Hopper backward at head dim {head_dim} has no softcap variant (BWD_SM90_MODS_SOFTCAP)")
    if window_only and (softcap or mask_defines):
        raise ValueError("window_only: a call with softcap or a mask expression takes the general variant")
    mods = _mods_variant(softcap, BWD_SM90_MODS_SOFTCAP[head_dim], window_only and bool(BWD_SM90_WINDOW_ONLY))
    tiles = BWD_SM90_MODS_TILES[head_dim]
    sliding = BWD_SM90_WINDOW_Q64 and 0 <= window_left <= BWD_SM90_WINDOW_Q64_MAX_LEFT
    if (head_dim == 128 and mods in (2, 3) and causal and not mask_defines and not sliding
            and _bwd_q80(causal, seqlen_q, causal_seqlen=BWD_SM90_MODS_Q80_CAUSAL_SEQLEN)):
        tiles = BWD_SM90_DENSE128_TILES
    tiles = _dq_frag_choice(tiles, causal, head_dim, True)
    lse_bias = mods == 3 and bool(BWD_SM90_WINDOW_LSE_BIAS) and _bwd_lse_bias_rule(head_dim, head_dim, True, tiles)
    return _bwd_sm90_spec(head_dim, dtype, causal, False, False, False, tiles, head_dim, mods, tuple(mask_defines),
                          lse_bias=lse_bias)


@functools.lru_cache(maxsize=None)
def _bwd_sm90_spec(head_dim: int, dtype: str, causal: bool, dropout: bool, block_sparse: bool, deterministic: bool,
                   tiles: BwdSm90Tiles, head_dim_eff: int, score_mods: int = 0,
                   mask_defines: tuple = (), lse_bias: bool = False, tail_split: bool = False) -> KernelSpec:
    """score_mods: 0 none, 1 window / softcap / ALiBi, 2 window / ALiBi, 3 window (BwdSm90Traits' FT_SCORE_MODS).
    lse_bias: S^T accumulated onto the lse term (BWD_SM90_LSE_BIAS; no score modifications but a window). tail_split:
    the launch's tail tiles in pieces (BWD_TAIL_SPLIT)."""
    if lse_bias and score_mods not in (0, 3):
        raise ValueError("lse_bias: softcap and ALiBi apply to the raw score")
    if tail_split and (causal or block_sparse or deterministic or score_mods or head_dim > 128
                       or not tiles.persistent):
        raise ValueError("the tail split: dense non-causal persistent kernels of head dims up to 128, not "
                         "deterministic, without score modifications")
    smem_bytes = tiles.smem_bytes(head_dim)
    name = (f"flash_bwd_sm90_hdim{head_dim_eff}_{dtype}{_suffix(causal, dropout, block_sparse)}"
            f"{'_det' if deterministic else ''}{'' if tiles.persistent else '_grid'}"
            f"{'_q80' if tiles.swap_dq else ''}{'_dqrows' if tiles.swap_dq and not tiles.dq_frag else ''}"
            f"{'_n96' if tiles.split_keys else ''}{'_dqreg' if tiles.split_keys and not tiles.stage_dq else ''}"
            f"{'_mods' if score_mods else ''}{'_nocap' if score_mods == 2 else ''}"
            f"{'_window' if score_mods == 3 else ''}{_mask_suffix(mask_defines)}{'_lsebias' if lse_bias else ''}"
            f"{'_tail' if tail_split else ''}{'_fdq' if tiles.fused_dq else ''}{'_kv2' if tiles.kv_stages == 2 else ''}")
    defines = (("FT_HEAD_DIM", head_dim), ("FT_HEAD_DIM_EFF", head_dim_eff), ("FT_BLOCK_M", tiles.block_m),
               ("FT_STAGES", tiles.stages), ("FT_THREADS", tiles.threads), ("FT_BF16", int(dtype == "bf16")), ("FT_CAUSAL", int(causal)),
               ("FT_DROPOUT", int(dropout)), ("FT_BLOCK_SPARSE", int(block_sparse)),
               ("FT_DETERMINISTIC", int(deterministic)), ("FT_PERSISTENT", int(tiles.persistent)),
               ("FT_SMEM_BYTES", smem_bytes), ("FT_MAX_STREAMS", MAX_STREAMS), ("FT_KERNEL_NAME", name))
    if score_mods:  # (the other kernels' macros, hence their cache keys, stay as they were)
        defines += (("FT_SCORE_MODS", score_mods),) + tuple(mask_defines)
    if tiles.swap_dq and not tiles.dq_frag:
        defines += (("FT_BWD_DQ_FRAG", 0),)
    if tiles.split_keys:  # (the other kernels' macros, hence their cache keys, stay as they were)
        defines += (("FT_BLOCK_N", tiles.block_n),) + ((("FT_BWD_SK_STAGE_DQ", 1),) if tiles.stage_dq else ())
    if _bwd_lean_addr(head_dim, causal, dropout, block_sparse, deterministic, tiles, score_mods):
        defines += (("FT_BWD_LEAN_ADDR", 1),)
    if lse_bias:  # (the other kernels' macros, hence their cache keys, stay as they were)
        defines += (("FT_BWD_LSE_BIAS", 1),)
    if tail_split:  # (the same)
        defines += (("FT_BWD_TAIL_SPLIT", 1),)
    if tiles.fused_dq:  # (the same)
        defines += (("FT_BWD_FUSED_DQ", 1),)
    if tiles.kv_stages != 1:  # (the same)
        defines += (("FT_BWD_KV_STAGES", tiles.kv_stages),)
    return KernelSpec("flash_bwd_sm90.cu", defines, (name,), tiles.threads, smem_bytes, block_m=tiles.block_m,
                      block_n=tiles.block_n, archs=(SM90_ARCH,), tiles=tiles, persistent=True)


@functools.lru_cache(maxsize=None)
def _bwd_spec(head_dim: int, dtype: str, causal: bool, dropout: bool, block_sparse: bool,
              tiles: BwdTiles, score_mods: bool = False, mask_defines: tuple = ()) -> KernelSpec:
    name = (f"flash_bwd_hdim{head_dim}_{dtype}{_suffix(causal, dropout, block_sparse)}{'_mods' if score_mods else ''}"
            f"{_tile_suffix(tiles, BWD_TILES[head_dim])}{_mask_suffix(mask_defines)}")
    defines = (("FT_HEAD_DIM", head_dim), ("FT_BLOCK_M", tiles.block_m), ("FT_BLOCK_N", tiles.block_n),
               ("FT_NWARPS", tiles.nwarps), ("FT_WARPS_M_SDP", tiles.warps_m_sdp),
               ("FT_WARPS_N_DKV", tiles.warps_n_dkv), ("FT_WARPS_M_DQ", tiles.warps_m_dq),
               ("FT_STAGES", tiles.stages), ("FT_SCRAMBLE_DQ", tiles.scramble_dq),
               ("FT_VEC_ROW_STATS", int(tiles.vec_row_stats)),
               ("FT_BF16", int(dtype == "bf16")), ("FT_CAUSAL", int(causal)), ("FT_DROPOUT", int(dropout)),
               ("FT_BLOCK_SPARSE", int(block_sparse)), ("FT_SMEM_BYTES", tiles.smem_bytes(head_dim)),
               ("FT_KERNEL_NAME", name))
    if tiles.dq_chunks > 1:
        defines += (("FT_DQ_CHUNKS", tiles.dq_chunks),)
    if score_mods:  # (the other kernels' macros, hence their cache keys, stay as they were)
        defines += (("FT_SCORE_MODS", 1),) + tuple(mask_defines)
    return KernelSpec("flash_bwd.cu", defines, (name,), 32 * tiles.nwarps, tiles.smem_bytes(head_dim),
                      block_m=tiles.block_m, block_n=tiles.block_n, tiles=tiles)


@functools.lru_cache(maxsize=None)
def aux_kernels(dtype: str) -> KernelSpec:
    prefix = f"flash_aux_{dtype}"
    symbols = tuple(f"{prefix}_{kind}" for kind in ("preprocess", "convert_dq", "dropout_mask"))
    defines = (("FT_BF16", int(dtype == "bf16")), ("FT_KERNEL_PREFIX", prefix))
    return KernelSpec("flash_aux.cu", defines, symbols, AUX_THREADS, 0)


# The score-modification variant of the mma.sync kernels (the `_mods` kernels): a local window, softcap and ALiBi, each
# read from the parameters and off when unset (one variant instead of one per combination), without dropout or a
# block mask, dense and varlen, every head dim (the Hopper kernels do not have them yet).
SCORE_MODS = ("window_size", "softcap", "alibi_slopes")
CE_THREADS = 256  # csrc/cross_entropy.cu kCeThreads
MASK_BLOCKS_THREADS = 256  # csrc/mask_blocks.cu kMaskBlocksThreads


def mask_blocks_kernel(mask) -> KernelSpec:
    """The block-state kernel of a mask expression (csrc/mask_blocks.cu; mask: mask_mod.MaskMod), one per expression
    and tensor dtypes / ranks: named by a digest of its macros, cached like every kernel (by the macros' text)."""
    defines = mask.kernel_defines()
    name = f"ft_mask_blocks_{hashlib.sha256(repr(defines).encode()).hexdigest()[:16]}"
    return KernelSpec("mask_blocks.cu", defines + (("FT_KERNEL_NAME", name),), (name,), MASK_BLOCKS_THREADS, 0)
CE_DTYPES = ("fp32", "fp16", "bf16")  # FT_CE_KIND 0, 1, 2


@functools.lru_cache(maxsize=None)
def cross_entropy_kernels(dtype: str) -> KernelSpec:
    """The fused cross-entropy's forward and backward for logits of `dtype` (csrc/cross_entropy.cu)."""
    prefix = f"ft_cross_entropy_{dtype}"
    defines = (("FT_CE_KIND", CE_DTYPES.index(dtype)), ("FT_KERNEL_PREFIX", prefix))
    return KernelSpec("cross_entropy.cu", defines, (f"{prefix}_fwd", f"{prefix}_bwd"), CE_THREADS, 0)


def all_kernels(smem_limit: int | None = None) -> list[KernelSpec]:
    """Every instantiation a GPU with smem_limit bytes of opt-in shared memory per block dispatches to (None: the
    first-choice tiles); the Hopper kernels are listed whenever they fit (they compile for sm_90a only)."""
    _check_block_sparse_tiles()
    _check_dq_slices()
    specs = [aux_kernels(dtype) for dtype in DTYPES] + [cross_entropy_kernels(dtype) for dtype in CE_DTYPES]
    specs += [kernel(head_dim, dtype, causal, False, score_mods=True, smem_limit=smem_limit)
              for kernel in (fwd_kernel, bwd_kernel) for head_dim in HEAD_DIMS for dtype in DTYPES
              for causal in (False, True) if smem_unavailable_reason(head_dim, False, smem_limit) is None]
    specs += [spec for head_dim in FWD_SM90_MODS_HEAD_DIMS for dtype in DTYPES for causal in (False, True)  # Hopper
              for mods in (1, 2)
              if _fits(spec := _fwd_sm90_spec(head_dim, dtype, causal, False, False, FWD_SM90_TILES[head_dim], mods),
                       smem_limit)]
    specs += [spec for head_dim in FWD_SM90_MODS_HEAD_DIMS for dtype in DTYPES for causal in (False, True)  # a window
              if _fits(spec := fwd_kernel(head_dim, dtype, causal, False, arch=SM90_ARCH, score_mods=True,
                                          window_only=True), smem_limit)]
    specs += [spec for head_dim in BWD_SM90_MODS_HEAD_DIMS for dtype in DTYPES for causal in (False, True)
              for softcap, window_only in ((False, False), (True, False), (False, True))
              if not softcap or BWD_SM90_MODS_SOFTCAP[head_dim]
              for seqlen_q in (1, 1 << 20)
              if _fits(spec := bwd_sm90_mods_kernel(head_dim, dtype, causal, softcap=softcap, seqlen_q=seqlen_q,
                                                    window_only=window_only), smem_limit)]
    for block_sparse, head_dims in ((False, HEAD_DIMS), (True, BLOCK_SPARSE_HEAD_DIMS)):
        for head_dim in head_dims:
            if smem_unavailable_reason(head_dim, block_sparse, smem_limit) is not None:
                continue
            for dtype in DTYPES:
                for causal in (False, True):
                    for dropout in (False, True):
                        specs += [fwd_kernel(head_dim, dtype, causal, dropout, block_sparse, smem_limit=smem_limit),
                                  bwd_kernel(head_dim, dtype, causal, dropout, block_sparse, smem_limit=smem_limit)]
    for sm90_kernel, head_dims in ((fwd_sm90_kernel, FWD_SM90_TILES), (bwd_sm90_kernel, BWD_SM90_TILES)):
        specs += [spec for head_dim in head_dims for dtype in DTYPES for causal in (False, True)
                  for dropout in (False, True) for block_sparse in (False, True)
                  if head_dim in BLOCK_SPARSE_HEAD_DIMS or not block_sparse
                  if sm90_kernel is fwd_sm90_kernel or BWD_SM90_TILES[head_dim].supports(dropout, block_sparse, False)
                  if _fits(spec := sm90_kernel(head_dim, dtype, causal, dropout, block_sparse), smem_limit)]
    specs += [spec for head_dim in FWD_SM90_TILES_LONG_CAUSAL for dtype in DTYPES  # causal, long sequences (and
              for small_l2 in (False, True)                                    # short ones on a small L2)
              if _fits(spec := fwd_sm90_kernel(head_dim, dtype, True, seqlen_q=LONG_CAUSAL_SEQLEN, small_l2=small_l2),
                       smem_limit)]
    specs += [spec for head_dim, (seqlen, _) in FWD_SM90_REF_CAUSAL_SEQLEN.items() for dtype in DTYPES  # causal,
              if _fits(spec := fwd_sm90_kernel(head_dim, dtype, True, seqlen_q=seqlen, seqlen_k=seqlen),  # without
                       smem_limit)]                                                                # the block max
    specs += [spec for head_dim in FWD_SM90_TILES_SHORT_CAUSAL for dtype in DTYPES  # causal, short sequences
              if _fits(spec := fwd_sm90_kernel(head_dim, dtype, True, seqlen_q=1), smem_limit)]
    specs += [spec for head_dim in FWD_SM90_TILES_LONG_KEYS for dtype in DTYPES for causal in (False, True)  # long
              if _fits(spec := fwd_sm90_kernel(head_dim, dtype, causal, seqlen_k=long_keys_seqlen(causal)),
                       smem_limit)]
    specs += [spec for narrow in SM90_NARROW_HEAD_DIMS for dtype in DTYPES for causal in (False, True)  # 65-96
              for dropout in (False, True) for seqlen_q in (None, 1 << 20)
              if _fits(spec := bwd_sm90_kernel(128, dtype, causal, dropout, head_dim_eff=narrow, seqlen_q=seqlen_q),
                       smem_limit)]
    # the dense backward with and without the tail split (BWD_TAIL_SPLIT)
    specs += [spec for head_dim in (64, 128, *SM90_NARROW_HEAD_DIMS) for dtype in DTYPES
              for dropout in (False, True) for seqlen_q in (None, 1 << 20) for tail in (True, False)
              if _fits(spec := bwd_sm90_kernel(64 if head_dim == 64 else 128, dtype, False, dropout, seqlen_q=seqlen_q,
                                               head_dim_eff=head_dim, tail_split=tail), smem_limit)]
    specs += [spec for head_dim in (*(d for d in FWD_SM90_TILES if d <= 256), *SM90_NARROW_HEAD_DIMS)  # ... forward
              for dtype in DTYPES
              if _fits(spec := fwd_sm90_kernel(head_dim if head_dim in FWD_SM90_TILES else 128, dtype, False,
                                               head_dim_eff=head_dim, tail_split=True), smem_limit)
              and fwd_tail_split(spec)]
    specs += [spec for narrow in SM90_NARROW_HEAD_DIMS for dtype in DTYPES for causal in (False, True)  # ... forward
              for dropout in (False, True)
              for seqlen_q, seqlen_k in ((0, 0), (1, 0), (0, long_keys_seqlen(causal)))  # (hd128: no long-causal tiles)
              if _fits(spec := fwd_sm90_kernel(128, dtype, causal, dropout, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                                               head_dim_eff=narrow), smem_limit)]
    # non-causal hd128 from FWD_SM90_CLUSTER_SEQLEN keys in 2-CTA clusters (and hd64: FWD_SM90_CLUSTER_HD64)
    specs += [spec for head_dim in (64, 128) for dtype in DTYPES
              if _fits(spec := _fwd_sm90_spec(head_dim, dtype, False, False, False, dataclasses.replace(
                  fwd_sm90_tiles(head_dim, False, False, False, 0, FWD_SM90_CLUSTER_SEQLEN), cluster=2)), smem_limit)]
    specs += [spec for dtype in DTYPES  # the hd128 causal 80-query backward with plain-row dQ^T (A/B: BWD_DQ_FRAG=0)
              if _fits(spec := _bwd_sm90_spec(128, dtype, True, False, False, False, dataclasses.replace(
                  BWD_SM90_DENSE128_TILES, dq_frag=False), 128), smem_limit)]
    specs += [spec for dtype in DTYPES  # the hd128 backward's other query block (A/B: FLASHTRAIN_BWD_SM90_Q80)
              for causal in (False, True) for tiles in (BWD_SM90_TILES[128], BWD_SM90_DENSE128_TILES)
              for head_dim_eff in (128, *SM90_NARROW_HEAD_DIMS)
              if _fits(spec := _bwd_sm90_spec(128, dtype, causal, False, False, False, tiles, head_dim_eff,
                                              lse_bias=_bwd_lse_bias_rule(128, head_dim_eff, True, tiles)), smem_limit)]
    specs += [spec for head_dim in (64, 128) for dtype in DTYPES  # the causal backward converting dq itself and
              for fused in (True, False)                            # with the conversion kernel (BWD_FUSED_DQ)
              if _fits(spec := _bwd_sm90_spec(head_dim, dtype, True, False, False, False,
                                              dataclasses.replace(BWD_SM90_TILES[head_dim], fused_dq=fused), head_dim,
                                              lse_bias=_bwd_lse_bias_rule(head_dim, None, True,
                                                                          BWD_SM90_TILES[head_dim])), smem_limit)]
    # the hd64 backward with two K / V buffers (short calls, where BWD_SM90_HD64_KV2_*_SEQLEN has them), with and
    # without the tail split
    specs += [spec for dtype in DTYPES for causal in (False, True)
              if (BWD_SM90_HD64_KV2_CAUSAL_SEQLEN if causal else BWD_SM90_HD64_KV2_FULL_SEQLEN)
              for tail in (True, False)
              if _fits(spec := bwd_sm90_kernel(64, dtype, causal, seqlen_q=1, tail_split=tail), smem_limit)]
    specs += [spec for dtype in DTYPES for causal in (False, True)  # the hd192 backward's other key tile (A/B:
              for tiles in (BWD_SM90_TILES[192], BWD_SM90_HD192_N64, BWD_SM90_HD192_REG_DQ)
              if _fits(spec := _bwd_sm90_spec(192, dtype, causal, False, False, False, tiles, 192), smem_limit)]
    specs += [spec for head_dim in BWD_SM90_TILES for dtype in DTYPES for causal in (False, True)  # deterministic
              for dropout in (False, True) if BWD_SM90_TILES[head_dim].supports(dropout, False, True)
              if _fits(spec := bwd_sm90_kernel(head_dim, dtype, causal, dropout, deterministic=True), smem_limit)]
    return list(dict.fromkeys(specs))


def small_smem_kernels() -> list[KernelSpec]:
    """The instantiations that GPUs with 99 KB of shared memory run and 163 KB ones do not (the *_SMALL_SMEM tiles)."""
    default = set(all_kernels())
    return [spec for spec in all_kernels(SMEM_OPTIN_SM86) if spec not in default and not spec.archs]


# ------------------------------------------------------------------------------------------------------ compilers
def _sources() -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(CSRC.iterdir()) if path.suffix in (".cu", ".cuh", ".h")}


@functools.lru_cache(maxsize=None)
def sources_hash() -> str:
    digest = hashlib.sha256()
    for name, text in _sources().items():
        digest.update(name.encode() + b"\0" + text + b"\0")
    return digest.hexdigest()


@functools.lru_cache(maxsize=None)
def nvrtc_version() -> str | None:
    """NVRTC's version as 'major.minor', or None when cuda.bindings or libnvrtc cannot be loaded."""
    try:
        from cuda.bindings import nvrtc
        err, major, minor = nvrtc.nvrtcVersion()
    except Exception:  # ImportError, or the library not found (cuda.pathfinder raises its own error types)
        return None
    return f"{major}.{minor}" if err == nvrtc.nvrtcResult.NVRTC_SUCCESS else None


def nvcc_path() -> str | None:
    found = shutil.which("nvcc")
    if found is None:
        for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
            if root and (Path(root) / "bin" / "nvcc").is_file():
                return str(Path(root) / "bin" / "nvcc")
    return found


@functools.lru_cache(maxsize=None)
def nvcc_version() -> str | None:
    path = nvcc_path()
    if path is None:
        return None
    out = subprocess.run([path, "--version"], capture_output=True, text=True, check=False).stdout
    return out.strip().splitlines()[-1] if out.strip() else None


def cuda_python_version() -> str | None:
    """The installed cuda-python (its cuda-bindings package since 12.6), or None."""
    import importlib.metadata

    for distribution in ("cuda-bindings", "cuda-python"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def cuda_version_mismatch(torch_cuda: str | None = None, cuda_python: str | None = None) -> str | None:
    """A sentence naming the mismatch and the fix when cuda-python (and the NVRTC it loads) is for another CUDA major
    version than the one torch was built with (torch.version.cuda), else None. Defaults: the installed versions."""
    if torch_cuda is None:
        import torch

        torch_cuda = torch.version.cuda
    cuda_python = cuda_python if cuda_python is not None else cuda_python_version()
    if torch_cuda is None or cuda_python is None:
        return None
    torch_major, bindings_major = int(torch_cuda.split(".")[0]), int(cuda_python.split(".")[0])
    if torch_major == bindings_major:
        return None
    lowest = "12.4" if torch_major == 12 else f"{torch_major}.0"  # = pyproject.toml's cuda12 / cuda13 extras
    return (f"cuda-python {cuda_python} is for CUDA {bindings_major} but torch was built with CUDA {torch_cuda}: its "
            f"NVRTC (libnvrtc.so.{bindings_major}) is not the one torch's wheel installs. Fix: pip install "
            f"'cuda-python>={lowest},<{torch_major + 1}' (or pip install -e '.[cuda{torch_major}]')")


def compiler_unavailable_reason() -> str | None:
    if nvrtc_version() is None and nvcc_version() is None:
        mismatch = cuda_version_mismatch()
        if mismatch is not None:
            return f"no CUDA compiler found: {mismatch}"
        return ("no CUDA compiler found: neither NVRTC (pip install nvidia-cuda-nvrtc cuda-python) nor nvcc "
                "(CUDA toolkit on PATH or CUDA_HOME)")
    return None


_COMMON_FLAGS = ("-std=c++17",)


def _extra_defines() -> tuple[str, ...]:
    """FLASHTRAIN_EXTRA_DEFINES="FT_BWD_DEFER_DQ=0,..." adds macros to every compilation (kernel A/B probes: the
    cubin cache key includes them)."""
    return tuple(filter(None, os.environ.get("FLASHTRAIN_EXTRA_DEFINES", "").split(",")))


def _macro_flags(spec: KernelSpec) -> list[str]:
    return [f"-D{key}={value}" for key, value in spec.defines] + [f"-D{item}" for item in _extra_defines()]


def _compile_nvrtc(spec: KernelSpec, arch: str) -> bytes:
    from cuda.bindings import nvrtc

    sources = _sources()
    headers = [name for name in sources if name != spec.source]
    err, program = nvrtc.nvrtcCreateProgram(sources[spec.source], spec.source.encode(), len(headers),
                                            [sources[name] for name in headers], [name.encode() for name in headers])
    _check_nvrtc(err, "nvrtcCreateProgram")
    try:
        # -default-device: the kernels' lambdas carry no __device__ (nvcc infers it inside device functions)
        options = [f"--gpu-architecture={arch}", "-default-device", *_COMMON_FLAGS, *_macro_flags(spec)]
        (err,) = nvrtc.nvrtcCompileProgram(program, len(options), [option.encode() for option in options])
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, size = nvrtc.nvrtcGetProgramLogSize(program)
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(program, log)
            raise RuntimeError(f"NVRTC failed to compile {spec.name} for {arch}:\n{log.decode(errors='replace')}")
        err, size = nvrtc.nvrtcGetCUBINSize(program)
        _check_nvrtc(err, "nvrtcGetCUBINSize")
        cubin = b" " * size
        (err,) = nvrtc.nvrtcGetCUBIN(program, cubin)
        _check_nvrtc(err, "nvrtcGetCUBIN")
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(program)


def _check_nvrtc(err, what: str) -> None:
    from cuda.bindings import nvrtc

    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"{what} failed: {nvrtc.nvrtcGetErrorString(err)[1].decode()}")


def _nvcc_target(arch: str) -> str:
    # sm_90a needs the -gencode spelling (the -arch shorthand also runs a plain sm_90 pass on some nvcc versions).
    number = arch.removeprefix("sm_")
    return f"-gencode=arch=compute_{number},code=sm_{number}"


def _compile_nvcc(spec: KernelSpec, arch: str, output: Path, ptxas_verbose: bool = False) -> str:
    """Compile to `output`; returns ptxas's resource line ("N registers, S bytes spill stores, L bytes spill loads")
    when ptxas_verbose, else ""."""
    command = [nvcc_path(), "-cubin", "-O3", _nvcc_target(arch), *_COMMON_FLAGS, *_macro_flags(spec),
               *(["-Xptxas", "-v"] if ptxas_verbose else []), "-I", str(CSRC), "-o", str(output),
               str(CSRC / spec.source)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"nvcc failed to compile {spec.name} for {arch}:\n{' '.join(command)}\n{result.stderr}")
    if not ptxas_verbose:
        return ""
    registers = re.findall(r"Used (\d+) registers", result.stderr)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", result.stderr)
    serialized = sorted(set(re.findall(r"\((C75\d\d)\) Potential Performance Loss: wgmma", result.stderr)))
    line = ", ".join(f"{r} registers, {s} / {l} bytes spilled (stores / loads)" for r, (s, l) in zip(registers, spills))
    return line + (f", wgmma serialized ({', '.join(serialized)})" if serialized else "")


def cache_dir() -> Path:
    return Path(os.environ.get("FLASHTRAIN_KERNEL_CACHE", Path.home() / ".cache" / "flashtrain" / "kernels"))


def cubin_path(spec: KernelSpec, arch: str, compiler: str) -> Path:
    version = nvrtc_version() if compiler == "nvrtc" else nvcc_version()
    key = hashlib.sha256(repr((sources_hash(), spec.source, spec.defines, arch, compiler, version,
                               _COMMON_FLAGS) + ((_extra_defines(),) if _extra_defines() else ())
                              ).encode()).hexdigest()[:24]
    return cache_dir() / f"{spec.name}.{arch}.{key}.cubin"


def compile_kernel(spec: KernelSpec, arch: str) -> bytes:
    """The cubin of `spec` for `arch` (e.g. 'sm_90a'), from the disk cache or freshly compiled into it."""
    if not spec.supports(arch):
        raise ValueError(f"{spec.name} is for {', '.join(spec.archs)} only, not {arch}")
    compiler = "nvrtc" if nvrtc_version() is not None else "nvcc" if nvcc_version() is not None else None
    if compiler is None:
        raise RuntimeError(compiler_unavailable_reason())
    path = cubin_path(spec, arch, compiler)
    if path.is_file():
        return path.read_bytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write to a private name, then rename: concurrent processes compiling the same kernel never see half a file.
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        tmp_path = Path(tmp) / path.name
        if compiler == "nvrtc":
            tmp_path.write_bytes(_compile_nvrtc(spec, arch))
        else:
            _compile_nvcc(spec, arch, tmp_path)
        os.replace(tmp_path, path)
    return path.read_bytes()


# ------------------------------------------------------------------------------------------------------ host layer
HOST_SOURCE = Path(__file__).resolve().parent / "host" / "flash_host.cpp"
_HOST_FLAGS = ("-shared", "-fPIC", "-O2", "-std=c++20", "-Wall", "-Wno-unused-parameter")


def cxx_path() -> str | None:
    """The C++ compiler for the host layer: $CXX, else g++ on PATH."""
    return shutil.which(os.environ.get("CXX", "g++"))


@functools.lru_cache(maxsize=None)
def _cxx_version(path: str) -> str:
    result = subprocess.run([path, "--version"], capture_output=True, text=True, check=False)
    return result.stdout.splitlines()[0] if result.stdout else "?"


def host_command(output: Path, object_only: bool = False) -> list[str]:
    """The compiler command that builds HOST_SOURCE against the installed torch (its headers, libc10 and
    libtorch_cpu: the driver is reached through dlopen, the stream through c10's device-generic interface, so no CUDA
    toolkit or torch CUDA library is needed to build it); object_only: compile only (-c), no link."""
    import torch

    root = Path(torch.__file__).resolve().parent
    cxx = cxx_path()
    if cxx is None:
        raise RuntimeError(f"no C++ compiler for the flashtrain host layer ({HOST_SOURCE.name}): install g++ or "
                           "set CXX")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    command = [cxx, *_HOST_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-I", str(root / "include"), "-I",
               str(root / "include" / "torch" / "csrc" / "api" / "include"), str(HOST_SOURCE), "-o", str(output)]
    if object_only:
        return [x for x in command if x != "-shared"] + ["-c"]
    return command + ["-L", str(root / "lib"), f"-Wl,-rpath,{root / 'lib'}", "-lc10", "-ltorch_cpu", "-ldl"]


def host_library_path() -> Path:
    """Where the host layer of this source, torch and compiler is cached."""
    import torch

    cxx = cxx_path() or "?"
    key = hashlib.sha256(repr((HOST_SOURCE.read_bytes(), torch.__version__, str(Path(torch.__file__).parent), cxx,
                               _cxx_version(cxx) if cxx != "?" else "", _HOST_FLAGS)).encode()).hexdigest()[:24]
    return cache_dir() / f"flash_host.{key}.so"


def host_library() -> Path:
    """The C++ host layer (host/flash_host.cpp: the torch ops and their launch executor) as a shared library, from
    the disk cache or compiled into it (~30 s; one process compiles while the others wait on a lock file). Raises
    RuntimeError naming what is missing or the compiler's error."""
    import fcntl

    path = host_library_path()
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / "flash_host.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():  # another process built it while this one waited
            return path
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            tmp_path = Path(tmp) / path.name
            command = host_command(tmp_path)
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                raise RuntimeError(f"the flashtrain host layer failed to compile:\n{' '.join(command)}\n"
                                   f"{result.stderr[-6000:]}")
            os.replace(tmp_path, path)
    return path


def arch_of_capability(major: int, minor: int) -> str:
    """The compile target of a compute capability: sm_90a on Hopper, sm_XY elsewhere (sm_80 and newer)."""
    return "sm_90a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"


# ------------------------------------------------------------------------------------------------------ command line
def _run_all(specs: list[KernelSpec], jobs: int, compile_one) -> int:
    failures = 0
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(compile_one, spec): spec for spec in specs}
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            spec = futures[future]
            try:
                note = future.result()
                note = f": {note}" if isinstance(note, str) and note else ""
                print(f"[{done}/{len(specs)}] {spec.name} ok ({time.perf_counter() - start:.0f} s){note}", flush=True)
            except Exception as error:  # report every failure, not only the first
                failures += 1
                print(f"[{done}/{len(specs)}] {spec.name} FAILED\n{error}", file=sys.stderr, flush=True)
    print(f"{len(specs) - failures}/{len(specs)} compiled in {time.perf_counter() - start:.0f} s")
    return 1 if failures else 0


# The Hopper kernels whose wgmmas ptxas serializes (C7514: the deferred dQ piece of the hd64 dropout / deterministic
# backward, and the hd128 deterministic dropout one, read under a wait_group ptxas cannot pair), measured not to bound
# them (measured: retiring it with wait_group 0 instead was 0.97-1.04x). check_nvcc fails on any other: a
# serialized wgmma pipeline cost the 2026-11-25 forward overlap 13-15% and the 2026-11-28 mods backward on 80-query
# blocks 9%, and ptxas only mentions it.
WGMMA_SERIALIZED_KNOWN = re.compile(r"^flash_bwd_sm90_hdim(64_\w+_dropout\w*|128_\w+_dropout_det)$")


def check_nvcc(archs: list[str], jobs: int, specs: list[KernelSpec] | None = None, ptxas_verbose: bool = False) -> int:
    """Compile every instantiation (or `specs`) for every arch with nvcc, compile only; 0 when all succeed and no
    sm_90a kernel outside WGMMA_SERIALIZED_KNOWN has its wgmmas serialized by ptxas. ptxas_verbose: print each
    kernel's registers and spills."""
    if nvcc_path() is None:
        print("nvcc not found", file=sys.stderr)
        return 1
    specs = all_kernels() if specs is None else specs
    with tempfile.TemporaryDirectory() as tmp:
        def compile_one(item):
            spec, arch = item
            resources = _compile_nvcc(spec, arch, Path(tmp) / f"{spec.name}.{arch}.cubin",
                                      ptxas_verbose or arch == SM90_ARCH)
            if "wgmma serialized" in resources and not WGMMA_SERIALIZED_KNOWN.match(spec.name):
                raise RuntimeError(f"ptxas serialized the wgmmas of {spec.name} ({resources}): each wgmma then waits "
                                   f"for the previous one (build.WGMMA_SERIALIZED_KNOWN lists the accepted ones)")
            return resources if ptxas_verbose else ""

        items = [(spec, arch) for arch in archs for spec in specs if spec.supports(arch)]
        wrapped = [dataclasses.replace(spec, symbols=tuple(f"{s}@{arch}" for s in spec.symbols)) for spec, arch in items]
        lookup = dict(zip(wrapped, items))
        return _run_all(wrapped, jobs, lambda spec: compile_one(lookup[spec]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", help="target such as sm_80 or sm_90a (default: the current GPU's)")
    parser.add_argument("--check-nvcc", nargs="+", metavar="ARCH", help="compile everything with nvcc for ARCHs, no cache")
    parser.add_argument("--small-smem", action="store_true",
                        help="with --check-nvcc: only the 99 KB tiles that 163 KB GPUs do not use")
    parser.add_argument("--ptxas", action="store_true", help="with --check-nvcc: print registers and spills")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="parallel compilations")
    parser.add_argument("--only", metavar="REGEX",
                        help="only the instantiations whose name matches (re.search; also with --check-nvcc)")
    args = parser.parse_args(argv)
    if args.check_nvcc:
        specs = small_smem_kernels() if args.small_smem else None
        if args.only is not None:
            specs = [spec for spec in (specs if specs is not None else all_kernels()) if re.search(args.only, spec.name)]
        return check_nvcc(args.check_nvcc, args.jobs, specs, args.ptxas)
    arch = args.arch
    if arch is None:
        import torch

        if not torch.cuda.is_available():
            parser.error("no CUDA GPU visible: pass --arch")
        arch = arch_of_capability(*torch.cuda.get_device_capability())
    smem_limit = min(ARCH_SMEM_OPTIN.get(arch, SMEM_OPTIN_SM86), smem_cap() or 1 << 30)
    print(f"prebuilding for {arch} ({smem_limit} bytes of shared memory per block) into {cache_dir()}")
    specs = [spec for spec in all_kernels(smem_limit) if spec.supports(arch)
             and (args.only is None or re.search(args.only, spec.name))]
    status = _run_all(specs, args.jobs, lambda spec: compile_kernel(spec, arch))
    start = time.perf_counter()
    try:
        path = host_library()
    except RuntimeError as error:
        print(f"host layer FAILED\n{error}", file=sys.stderr)
        return 1
    print(f"host layer {path} ({time.perf_counter() - start:.0f} s)")
    return status


if __name__ == "__main__":
    sys.exit(main())
