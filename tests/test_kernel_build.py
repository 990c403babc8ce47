"""CPU tests of the kernel build (flashtrain/kernels/build.py): the dispatch table, the disk cache, and an nvcc
compile check of the most demanding instantiations for sm_80 and sm_90a (skipped without nvcc). The compile check of
every instantiation (324 compilations: 196 dense + 64 block-sparse + 64 Hopper-only, ~7 minutes on 2 idle
cores) runs from .ci/run:
python -m flashtrain.kernels.build --check-nvcc sm_80 sm_90a -j 2
"""

import ctypes
import dataclasses
import importlib
import re
import shutil
import subprocess
import sys
import types

import pytest

from flashtrain.kernels import build

SM90_MAX_SMEM = 227 * 1024  # opt-in shared memory per block on H100 / H200
SM80_MAX_SMEM = 163 * 1024  # dynamic shared memory a CTA may opt in to on A100 (H100: 227 KB)


def _fdq(head_dim: int, seqlen_q: int | None = None) -> str:
    """The name suffix of the dense causal Hopper backward where build.BWD_FUSED_DQ has it convert dq itself (1: head
    dim 64; 2: 64 and 128), up to build.BWD_FUSED_DQ_MAX_SEQLEN (hd128: BWD_FUSED_DQ_HD128_MAX_SEQLEN) queries."""
    head_dims = {1: (64,), 2: (64, 128)}.get(build.BWD_FUSED_DQ, ())
    limit = build.BWD_FUSED_DQ_HD128_MAX_SEQLEN if head_dim == 128 else build.BWD_FUSED_DQ_MAX_SEQLEN
    short = seqlen_q is None or seqlen_q <= limit
    return "_fdq" if head_dim in head_dims and short else ""


def test_fused_dq_rule(monkeypatch):
    """With BWD_FUSED_DQ = 1 the causal hd64 Hopper backward converts dq itself up to 4K queries; head dim 128 only
    with BWD_FUSED_DQ = 2; never with dropout, deterministic, block-sparse or non-causal; 0: never."""
    assert build.BWD_FUSED_DQ_MAX_SEQLEN == 4096
    monkeypatch.setattr(build, "BWD_FUSED_DQ", 1)

    def fused(head_dim=64, causal=True, seqlen_q=None, **kw):
        return build.bwd_fused_dq(build.bwd_sm90_kernel(head_dim, "bf16", causal, seqlen_q=seqlen_q, **kw))

    assert fused() and fused(seqlen_q=4096) and not fused(seqlen_q=4097)
    assert build.bwd_sm90_kernel(64, "fp16", True).name == "flash_bwd_sm90_hdim64_fp16_causal_fdq"
    assert not fused(causal=False) and not fused(dropout=True) and not fused(deterministic=True)
    assert not fused(block_sparse=True) and not fused(128)
    monkeypatch.setattr(build, "BWD_FUSED_DQ", 2)
    assert fused(128, seqlen_q=1024) and not fused(128, seqlen_q=8192) and fused()
    monkeypatch.setattr(build, "BWD_FUSED_DQ", 0)
    assert not fused() and not fused(128)


def test_two_kv_buffers_rule(monkeypatch):
    """The hd64 Hopper backward's two K / V buffers (BwdSm90Tiles.kv_stages): by default the dense non-causal calls
    without dropout of known query length up to 1K (tail split or not), never the causal ones; with the causal switch
    set, those up to it in place of the fused dQ conversion. The second K / V buffer adds 32 KB of shared memory and
    drops the 1 KB alignment slack (within the 227 KB a block may have); never at head dim 128, with dropout,
    deterministic or block-sparse."""
    def spec(head_dim=64, causal=False, seqlen_q=1024, **kw):
        return build.bwd_sm90_kernel(head_dim, "bf16", causal, seqlen_q=seqlen_q, **kw)

    assert (build.BWD_SM90_HD64_KV2_FULL_SEQLEN, build.BWD_SM90_HD64_KV2_CAUSAL_SEQLEN) == (1024, 0)
    two = spec()
    assert two.name == "flash_bwd_sm90_hdim64_bf16_tail_kv2" and ("FT_BWD_KV_STAGES", 2) in two.defines
    assert spec(seqlen_q=512, tail_split=False).name == "flash_bwd_sm90_hdim64_bf16_kv2"
    one = spec(seqlen_q=1025)
    assert one.name == "flash_bwd_sm90_hdim64_bf16_tail" and spec(seqlen_q=None).name == one.name
    assert two.smem_bytes == one.smem_bytes + 2 * 128 * 64 * 2 - 1024 == 231680 <= SM90_MAX_SMEM
    for kw in ({"dropout": True}, {"deterministic": True}, {"block_sparse": True}):
        assert not spec(**kw).name.endswith("_kv2")
    assert not spec(128).name.endswith("_kv2") and spec(causal=True).name.endswith("_causal_fdq")
    assert sorted(s.name for s in build.all_kernels() if s.name.endswith("_kv2")) == [
        f"flash_bwd_sm90_hdim64_{dtype}{tail}_kv2" for dtype in ("bf16", "fp16") for tail in ("", "_tail")]
    monkeypatch.setattr(build, "BWD_SM90_HD64_KV2_CAUSAL_SEQLEN", 2048)
    causal = spec(causal=True, seqlen_q=2048)
    assert causal.name == "flash_bwd_sm90_hdim64_bf16_causal_kv2" and not build.bwd_fused_dq(causal)
    assert spec(causal=True, seqlen_q=2049).name.endswith("_fdq")
    monkeypatch.setattr(build, "BWD_SM90_HD64_KV2_FULL_SEQLEN", 0)
    assert not spec(seqlen_q=512).name.endswith("_kv2")


def test_rounded_head_dim():
    assert [build.rounded_head_dim(d) for d in (8, 32, 40, 64, 72, 96, 128, 136, 160, 192, 200, 256, 264, 512)] == [
        32, 32, 64, 64, 96, 96, 128, 192, 192, 192, 256, 256, 512, 512]
    with pytest.raises(ValueError, match="head_dim"):
        build.rounded_head_dim(520)


def test_dispatch_table_covers_every_instantiation_once():
    specs = build.all_kernels()
    names = [spec.name for spec in specs]
    dense, sparse = len(build.HEAD_DIMS), len(build.BLOCK_SPARSE_HEAD_DIMS)
    # Hopper-only (warpgroup MMA): head dims x dtype x causal x dropout (x block-sparse at BLOCK_SPARSE_HEAD_DIMS)
    hopper_dims = [head_dim for table in (build.FWD_SM90_TILES, build.BWD_SM90_TILES) for head_dim in table]
    hopper_sparse = sum(2 * 2 * 2 for head_dim in hopper_dims if head_dim in build.BLOCK_SPARSE_HEAD_DIMS)
    # the backward at split head dims (192, 256): dense, no dropout, not deterministic
    split = [head_dim for head_dim, tiles in build.BWD_SM90_TILES.items() if tiles.split_head_dim]
    assert split == [192, 256]
    hopper_det = (len(build.BWD_SM90_TILES) - len(split)) * 2 * 2 * 2  # the deterministic backward (dense only)
    hopper_long = len(build.FWD_SM90_TILES_LONG_CAUSAL) * 2  # the causal forward's long-sequence tiles (x dtype)
    hopper_long += len(build.FWD_SM90_TILES_LONG_CAUSAL) * 2  # ... with two Q buffers (short calls, small L2)
    hopper_long += len(build.FWD_SM90_TILES_SHORT_CAUSAL) * 2  # ... and its short-sequence ones
    hopper_long += len(build.FWD_SM90_TILES_LONG_KEYS) * 2 * 2  # the forward's long-key tiles (x dtype x causal)
    hopper_long += 2 * 2  # ... non-causal in 2-CTA clusters (head dims 64 and 128), x dtype
    hopper_long += len(build.FWD_SM90_REF_CAUSAL_SEQLEN) * 2  # ... causal without the block max (`_ref`), x dtype
    assert sum(name.endswith("_ref") for name in names) == len(build.FWD_SM90_REF_CAUSAL_SEQLEN) * 2
    assert sum(name.endswith("_c2") for name in names) == 4
    # head dims 65-96 (x the narrowed widths 80, 96): the hd128 backward with that many columns of MMA work, x dtype x
    # causal x dropout, and its other query block (64 or 80 rows) x dtype x causal; the forward's (x dtype): causal or
    # not, the short causal and the long-key tiles (x causal), with dropout (x causal)
    hopper_narrow = len(build.SM90_NARROW_HEAD_DIMS) * (2 * 2 * 2 + 2 * 2 + (2 + 1 + 2 + 2) * 2)
    hopper_q80 = 2 * 2  # the hd128 backward's other query block (64 rows, or 80 with FLASHTRAIN_BWD_SM90_Q80=0), x dtype
    # x causal
    hopper_q80 += 2  # the hd128 causal 80-query backward with plain-row dQ^T (A/B: BWD_DQ_FRAG=0), x dtype
    hopper_q80 += 2 * 2  # the hd192 backward's other key tile (64 keys, or 96 with BWD_SM90_HD192_N96=0), x dtype x causal
    hopper_q80 += 2 * 2  # ... and its 96-key form with dQ from the registers (BWD_SM90_HD192_STAGE_DQ=0)
    # the forward and (head dims 64 / 128) the backward with score modifications, x dtype x causal, each without
    # softcap (`_nocap`, the calls without one) and with it (the backward where it has that variant: head dim 128)
    nocap = (len(build.FWD_SM90_MODS_HEAD_DIMS) + len(build.BWD_SM90_MODS_HEAD_DIMS)) * 2 * 2
    nocap += 2  # the hd128 causal backward on 80-query blocks too (long sequences), x dtype
    # ... and the forward and backward of calls whose one modification is a window (`_window`, without ALiBi's code),
    # the same instantiations as `_nocap`'s
    window = (len(build.FWD_SM90_MODS_HEAD_DIMS) + len(build.BWD_SM90_MODS_HEAD_DIMS)) * 2 * 2 + 2
    hopper_mods = nocap + window + (len(build.FWD_SM90_MODS_HEAD_DIMS) + sum(build.BWD_SM90_MODS_SOFTCAP.values())) * 2 * 2
    assert sum(name.endswith("_mods_nocap") for name in names) == nocap
    # (at head dim 128 on 64-query blocks with S^T onto the lse term: `_mods_window_lsebias`)
    assert sum(name.endswith(("_mods_window", "_mods_window_lsebias")) for name in names) == window
    # the dense non-causal kernels with the tail split (BWD_TAIL_SPLIT, FWD_TAIL_SPLIT): the backward at head dims 64,
    # 128 and the narrowed 80, 96, x dtype x dropout; the forward without dropout at head dims 64-256 and 80, 96
    # (not on the 192-key tiles), x dtype
    narrow = len(build.SM90_NARROW_HEAD_DIMS)
    hopper_tail = (2 + narrow) * 2 * 2 + (sum(d <= 256 for d in build.FWD_SM90_TILES) + narrow) * 2
    assert sum(name.endswith("_tail") for name in names) == hopper_tail
    # the causal hd64 / hd128 backward converting dq itself (`_fdq`) and with the conversion kernel after it
    # (build.BWD_FUSED_DQ picks one), x dtype
    hopper_fused = 2 * 2
    assert sum(name.endswith("_fdq") for name in names) == hopper_fused
    # the non-causal hd64 backward with two K / V buffers (`_kv2`, short calls: BWD_SM90_HD64_KV2_FULL_SEQLEN), with
    # and without the tail split, x dtype
    hopper_kv2 = 2 * 2
    assert sum(name.endswith("_kv2") for name in names) == hopper_kv2
    hopper = (len(hopper_dims) * 2 * 2 * 2 - len(split) * 2 * 2 + hopper_sparse + hopper_det + hopper_long + hopper_narrow
              + hopper_q80 + hopper_mods + hopper_tail + hopper_fused + hopper_kv2)
    cross_entropy = len(build.CE_DTYPES)  # the fused cross-entropy, one module per logits dtype
    # the mma.sync forward and backward with score modifications (window, softcap, ALiBi): head dims x dtype x causal
    local_softcap = 2 * dense * 2 * 2
    assert len(names) == len(set(names)) == (2 + cross_entropy + 2 * (dense + sparse) * 2 * 2 * 2 + hopper
                                             + local_softcap)
    assert sum(name.endswith("_sparse") for name in names) == 2 * sparse * 2 * 2 * 2 + hopper_sparse
    assert [spec.archs for spec in specs if "_sm90_" in spec.name] == [("sm_90a",)] * hopper
    for spec in specs:
        if spec.supports("sm_80"):  # (the head-dim-512 backward: 205 KB, Hopper's 227 KB only)
            limit = SM90_MAX_SMEM if spec.name.startswith("flash_bwd_hdim512") else SM80_MAX_SMEM
            assert spec.smem_bytes <= limit, f"{spec.name} needs {spec.smem_bytes} bytes of shared memory"
            assert spec.threads in (128, 256)
        else:  # the warp-specialized Hopper forward: a producer warpgroup + 2 or 3 consumer warpgroups
            assert spec.smem_bytes <= SM90_MAX_SMEM and spec.threads in (128, 384, 512)


def test_score_mods_have_no_dropout_or_block_sparse_variant():
    for kernel in (build.fwd_kernel, build.bwd_kernel):
        for arch in ("sm_80", "sm_90a"):
            for dropout, block_sparse in ((True, False), (False, True)):
                with pytest.raises(ValueError, match="no dropout or block-sparse variant"):
                    kernel(128, "bf16", True, dropout, block_sparse, arch=arch, score_mods=True)


def test_short_causal_forward_tiles():
    """Causal forward at head dim 128 below SHORT_CAUSAL_SEQLEN query rows: two Q buffers (a kernel of its own name,
    32 KB more shared memory, within the 227 KB an sm_90 block can have); unknown length (0), longer, non-causal,
    dropout, block-sparse and head dim 64 keep one; FLASHTRAIN_FWD_SM90_Q_BUFFERS overrides it both ways."""
    short = build.SHORT_CAUSAL_SEQLEN - 1
    spec = build.fwd_kernel(128, "bf16", True, False, arch="sm_90a", seqlen_q=short)
    assert (spec.name, spec.block_m, spec.smem_bytes) == ("flash_fwd_sm90_hdim128_bf16_causal_q2", 128, 230656)
    assert spec.smem_bytes == build.FwdSm90Tiles(128, 128, 2).smem_bytes(128) + 128 * 128 * 2 <= SM90_MAX_SMEM
    assert ("FT_Q_BUFFERS", 2) in spec.defines
    for other in (build.fwd_kernel(128, "bf16", True, False, arch="sm_90a", seqlen_q=0),
                  build.fwd_kernel(128, "bf16", True, False, arch="sm_90a", seqlen_q=short + 1),
                  build.fwd_kernel(128, "bf16", False, False, arch="sm_90a", seqlen_q=short),
                  build.fwd_kernel(128, "bf16", True, True, arch="sm_90a", seqlen_q=short),
                  build.fwd_kernel(128, "bf16", True, False, True, arch="sm_90a", seqlen_q=short),
                  build.fwd_kernel(64, "bf16", True, False, arch="sm_90a", seqlen_q=short)):
        assert ("FT_Q_BUFFERS", 1) in other.defines and not other.name.endswith("_q2")
    assert build.fwd_kernel(128, "fp16", True, False, arch="sm_80", seqlen_q=short).name == "flash_fwd_hdim128_fp16_causal"


def test_short_causal_forward_tiles_wide_head_dims(monkeypatch):
    """Causal forward at head dims 192 / 256 up to FWD_SM90_WIDE_SHORT_CAUSAL_SEQLEN query and key rows: 64-key blocks
    (three stages at 192, two at 256; O from the registers), a kernel of its own name; longer queries or keys, unknown
    length, non-causal and dropout keep the default tiles, and the switch at 0 turns the rule off."""
    short = build.FWD_SM90_WIDE_SHORT_CAUSAL_SEQLEN
    assert 0 < short < build.SHORT_CAUSAL_SEQLEN
    for head_dim, stages in ((192, 3), (256, 2)):
        default = build.FWD_SM90_TILES[head_dim]
        for seqlen_q in (1, 512, short):
            spec = build.fwd_kernel(head_dim, "bf16", True, False, arch="sm_90a", seqlen_q=seqlen_q)
            assert spec.name == f"flash_fwd_sm90_hdim{head_dim}_bf16_causal_128x64"
            assert (spec.tiles.block_m, spec.tiles.block_n, spec.tiles.stages) == (128, 64, stages)
            assert not spec.tiles.separate_o and spec.smem_bytes <= SM90_MAX_SMEM
            assert ("FT_BLOCK_N", 64) in spec.defines and ("FT_STAGES", stages) in spec.defines
        for other in (build.fwd_kernel(head_dim, "bf16", True, False, arch="sm_90a", seqlen_q=short + 1),
                      build.fwd_kernel(head_dim, "bf16", True, False, arch="sm_90a", seqlen_q=0),
                      build.fwd_kernel(head_dim, "bf16", True, False, arch="sm_90a", seqlen_q=512,
                                       seqlen_k=short + 1),  # (a short query chunk over longer keys)
                      build.fwd_kernel(head_dim, "bf16", False, False, arch="sm_90a", seqlen_q=512),
                      build.fwd_kernel(head_dim, "bf16", True, True, arch="sm_90a", seqlen_q=512)):
            assert other.tiles == default and not other.name.endswith("_128x64")
        assert build.fwd_kernel(head_dim, "bf16", True, False, arch="sm_90a", seqlen_q=short,
                                seqlen_k=short).tiles.block_n == 64
        monkeypatch.setattr(build, "FWD_SM90_WIDE_SHORT_CAUSAL_SEQLEN", 0)
        assert build.fwd_kernel(head_dim, "bf16", True, False, arch="sm_90a", seqlen_q=512).tiles == default
        # the threshold is its own, not capped by the hd128 rule's SHORT_CAUSAL_SEQLEN
        monkeypatch.setattr(build, "FWD_SM90_WIDE_SHORT_CAUSAL_SEQLEN", 4 * build.SHORT_CAUSAL_SEQLEN)
        assert build.fwd_kernel(head_dim, "bf16", True, False, arch="sm_90a",
                                seqlen_q=2 * build.SHORT_CAUSAL_SEQLEN).tiles.block_n == 64
        monkeypatch.undo()


def test_fwd_q_buffers_switch(monkeypatch):
    monkeypatch.setenv("FLASHTRAIN_FWD_SM90_Q_BUFFERS", "1")
    assert build.fwd_kernel(128, "bf16", True, False, arch="sm_90a", seqlen_q=512).name == (
        "flash_fwd_sm90_hdim128_bf16_causal")
    monkeypatch.setenv("FLASHTRAIN_FWD_SM90_Q_BUFFERS", "2")
    assert build.fwd_kernel(64, "bf16", False, False, arch="sm_90a", seqlen_q=4096).name == "flash_fwd_sm90_hdim64_bf16_q2"
    # head dim 192 stages O in Q: one buffer whatever the switch says
    assert build.fwd_kernel(192, "bf16", False, False, arch="sm_90a").name == "flash_fwd_sm90_hdim192_bf16"


def test_long_causal_forward_tiles():
    """Causal forward at head dim 64 from LONG_CAUSAL_SEQLEN query rows on: three consumer warpgroups (a kernel of
    its own name); shorter, non-causal, dropout and block-sparse calls keep their tiles."""
    long = build.LONG_CAUSAL_SEQLEN
    spec = build.fwd_kernel(64, "bf16", True, False, arch="sm_90a", seqlen_q=long)
    assert (spec.block_m, spec.threads, spec.name) == (192, 512, "flash_fwd_sm90_hdim64_bf16_causal_192x128")
    assert build.fwd_kernel(64, "bf16", True, False, arch="sm_90a", seqlen_q=long - 1).block_m == 128
    assert build.fwd_kernel(64, "bf16", True, True, arch="sm_90a", seqlen_q=long).block_m == 128  # dropout
    assert build.fwd_kernel(64, "bf16", True, False, True, arch="sm_90a", seqlen_q=long).block_m == 128  # sparse
    assert build.fwd_kernel(128, "bf16", True, False, arch="sm_90a", seqlen_q=long).block_m == 128
    assert build.fwd_kernel(64, "bf16", True, False, arch="sm_80", seqlen_q=long).name == "flash_fwd_hdim64_bf16_causal"


def test_long_keys_forward_tiles(monkeypatch):
    """Head dim 128 from LONG_KEYS_SEQLEN keys on (dense calls; causal ones from LONG_KEYS_CAUSAL_SEQLEN): 192-key
    tiles with O from the registers (a kernel of its own name, within the 227 KB an sm_90 block can have); fewer keys,
    unknown (0: varlen), dropout, block-sparse, score modifications, head dim 64 and sm_80 keep their tiles."""
    monkeypatch.setattr(build, "FWD_SM90_CLUSTER", 1)  # (the default: non-causal in clusters, whatever the environment)
    assert build.LONG_KEYS_SEQLEN == 8192 and build.LONG_KEYS_CAUSAL_SEQLEN == 16384
    # causal calls between the two thresholds keep 128-key tiles
    for seqlen in (build.LONG_KEYS_SEQLEN, build.LONG_KEYS_CAUSAL_SEQLEN - 1):
        assert build.fwd_kernel(128, "bf16", True, False, arch="sm_90a", seqlen_q=seqlen,
                                seqlen_k=seqlen).name == "flash_fwd_sm90_hdim128_bf16_causal"
    # (non-causal: in 2-CTA clusters, test_cluster_forward_tiles)
    for causal, name in ((False, "hdim128_bf16_128x192_c2"), (True, "hdim128_bf16_causal_128x192_ref")):
        long = build.long_keys_seqlen(causal)
        spec = build.fwd_kernel(128, "bf16", causal, False, arch="sm_90a", seqlen_q=long, seqlen_k=long)
        assert (spec.name, spec.block_m, spec.tiles.block_n) == (f"flash_fwd_sm90_{name}", 128, 192)
        assert ("FT_SEPARATE_O", 0) in spec.defines and spec.smem_bytes <= SM90_MAX_SMEM
        assert spec in build.all_kernels()
        # a short causal query block against many keys takes the long-key tiles too
        assert build.fwd_kernel(128, "bf16", causal, False, arch="sm_90a", seqlen_q=300, seqlen_k=long).tiles.block_n == 192
    long = build.LONG_KEYS_SEQLEN
    for other in (build.fwd_kernel(128, "bf16", False, False, arch="sm_90a", seqlen_k=long - 1),
                  build.fwd_kernel(128, "bf16", False, False, arch="sm_90a", seqlen_q=long, seqlen_k=0),
                  build.fwd_kernel(128, "bf16", False, True, arch="sm_90a", seqlen_k=long),
                  build.fwd_kernel(128, "bf16", False, False, True, arch="sm_90a", seqlen_k=long),
                  build.fwd_kernel(128, "bf16", False, False, arch="sm_90a", seqlen_k=long, score_mods=True),
                  build.fwd_kernel(64, "bf16", False, False, arch="sm_90a", seqlen_k=long)):
        assert other.tiles.block_n == 128
    assert build.fwd_kernel(128, "bf16", False, False, arch="sm_80", seqlen_k=long).name == "flash_fwd_hdim128_bf16"


def test_cluster_forward_tiles(monkeypatch):
    """The dense non-causal forward at head dim 128 from FWD_SM90_CLUSTER_SEQLEN keys, with an even number of query
    tiles per head: the long-key tiles in 2-CTA clusters (FT_CLUSTER 2, `_c2`); head dims 65-96 (narrowed), causal,
    dropout, block-sparse, score modifications, varlen (seqlen_k 0), an unknown query length, an odd number of query
    tiles, fewer keys, head dim 64 (unless FWD_SM90_CLUSTER_HD64), and the switch off (FWD_SM90_CLUSTER = 0) keep
    one CTA per tile."""
    monkeypatch.setattr(build, "FWD_SM90_CLUSTER", 1)  # (the default, whatever the environment says)
    monkeypatch.setattr(build, "FWD_SM90_CLUSTER_HD64", 0)  # (likewise)
    long = build.FWD_SM90_CLUSTER_SEQLEN
    for dtype in ("bf16", "fp16"):
        spec = build.fwd_kernel(128, dtype, False, False, arch="sm_90a", seqlen_q=long, seqlen_k=long)
        assert spec.name == f"flash_fwd_sm90_hdim128_{dtype}_128x192_c2" and spec.tiles.cluster == 2
        assert ("FT_CLUSTER", 2) in spec.defines and spec in build.all_kernels()
    # (a query length of 130 x 128 - 5 rows: 130 tiles, the last one partial)
    assert build.fwd_kernel(128, "fp16", False, False, arch="sm_90a", seqlen_q=130 * 128 - 5,
                            seqlen_k=long).tiles.cluster == 2
    for other in (build.fwd_kernel(128, "bf16", True, False, arch="sm_90a", seqlen_q=long, seqlen_k=long),
                  build.fwd_kernel(128, "bf16", False, True, arch="sm_90a", seqlen_q=long, seqlen_k=long),
                  build.fwd_kernel(128, "bf16", False, False, True, arch="sm_90a", seqlen_q=long, seqlen_k=long),
                  build.fwd_kernel(128, "bf16", False, False, arch="sm_90a", seqlen_q=long, seqlen_k=long,
                                   score_mods=True),
                  build.fwd_kernel(128, "bf16", False, False, arch="sm_90a", seqlen_q=long, seqlen_k=0),
                  build.fwd_kernel(128, "bf16", False, False, arch="sm_90a", seqlen_q=0, seqlen_k=long),
                  build.fwd_kernel(128, "bf16", False, False, arch="sm_90a", seqlen_q=long + 128, seqlen_k=long),
                  build.fwd_kernel(128, "bf16", False, False, arch="sm_90a", seqlen_q=long, seqlen_k=long - 1),
                  build.fwd_kernel(64, "bf16", False, False, arch="sm_90a", seqlen_q=long, seqlen_k=long),
                  build.fwd_kernel(128, "bf16", False, False, arch="sm_90a", seqlen_q=long, seqlen_k=long,
                                   effective_head_dim=96),
                  build.fwd_kernel(128, "bf16", False, False, arch="sm_90a", seqlen_q=long, seqlen_k=long,
                                   effective_head_dim=80)):
        assert other.tiles.cluster == 1 and "_c2" not in other.name and ("FT_CLUSTER", 2) not in other.defines
    monkeypatch.setattr(build, "FWD_SM90_CLUSTER", 0)
    assert build.fwd_kernel(128, "bf16", False, False, arch="sm_90a", seqlen_q=long,
                            seqlen_k=long).name == "flash_fwd_sm90_hdim128_bf16_128x192"


def test_narrow_head_dims_on_hopper(monkeypatch):
    """Head dims 65-96 on sm_90a run the hd128 tiles with the MMA work of 80 columns (65-80) or 96 (81-96) (kernels
    named hdim80 / hdim96, built with FT_HEAD_DIM_EFF): the forward without a block mask or score modifications
    (every tile shape: default, short causal, long keys; dropout too), the backward dense and not deterministic
    (80-query blocks where hd128 takes them). Head dims above 96, block-sparse, the score-modification kernels and
    sm_80 keep all 128 columns; FLASHTRAIN_SM90_NARROW (A/B) picks the widths."""
    monkeypatch.setattr(build, "BWD_TAIL_SPLIT", 0)  # (the whole-tile kernels' names; the tail split: its own tests)
    monkeypatch.delenv("FLASHTRAIN_SM90_NARROW", raising=False)
    for causal, suffix in ((False, ""), (True, "_causal")):
        long = build.long_keys_seqlen(causal)
        for seqlen_q, seqlen_k, shape in ((0, 0, ""), (long, long, "_128x192")):
            spec = build.fwd_kernel(128, "bf16", causal, False, arch="sm_90a", seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                                    effective_head_dim=96)
            wide = build.fwd_kernel(128, "bf16", causal, False, arch="sm_90a", seqlen_q=seqlen_q, seqlen_k=seqlen_k)
            assert spec.name == f"flash_fwd_sm90_hdim96_bf16{suffix}{shape}" and ("FT_HEAD_DIM_EFF", 96) in spec.defines
            # (the same tiles, but not in 2-CTA clusters, test_cluster_forward_tiles, nor without the block max)
            assert (spec.tiles, spec.smem_bytes) == (dataclasses.replace(wide.tiles, cluster=1, ref_causal=False),
                                                     wide.smem_bytes)
            assert spec in build.all_kernels()
        bwd = build.bwd_kernel(128, "bf16", causal, False, arch="sm_90a", effective_head_dim=96, seqlen_q=long)
        assert bwd.name == f"flash_bwd_sm90_hdim96_bf16{suffix}_q80_lsebias" and bwd in build.all_kernels()
    short = build.fwd_kernel(128, "fp16", True, True, arch="sm_90a", seqlen_q=300, effective_head_dim=88)
    assert short.name == "flash_fwd_sm90_hdim96_fp16_causal_dropout"
    for head_dim in (72, 80):
        assert build.fwd_kernel(128, "bf16", False, False, arch="sm_90a", effective_head_dim=head_dim).name == (
            "flash_fwd_sm90_hdim80_bf16")
        bwd80 = build.bwd_kernel(128, "bf16", True, True, arch="sm_90a", effective_head_dim=head_dim)
        assert bwd80.name == "flash_bwd_sm90_hdim80_bf16_causal_dropout" and ("FT_HEAD_DIM_EFF", 80) in bwd80.defines
    monkeypatch.setenv("FLASHTRAIN_SM90_NARROW", "96")
    assert build.fwd_kernel(128, "bf16", False, False, arch="sm_90a", effective_head_dim=80).name == (
        "flash_fwd_sm90_hdim96_bf16")
    monkeypatch.setenv("FLASHTRAIN_SM90_NARROW", "")
    assert build.fwd_kernel(128, "bf16", False, False, arch="sm_90a", effective_head_dim=80).name == (
        "flash_fwd_sm90_hdim128_bf16")
    monkeypatch.delenv("FLASHTRAIN_SM90_NARROW")
    assert build.fwd_kernel(128, "bf16", True, False, arch="sm_90a", seqlen_q=300,
                            effective_head_dim=96).name == "flash_fwd_sm90_hdim96_bf16_causal_q2"
    for wide in (build.fwd_kernel(128, "bf16", False, False, arch="sm_90a", effective_head_dim=104),
                 build.fwd_kernel(128, "bf16", False, False, True, arch="sm_90a", effective_head_dim=80),
                 build.fwd_kernel(128, "bf16", False, False, arch="sm_90a", effective_head_dim=80, score_mods=True),
                 build.fwd_kernel(128, "bf16", False, False, arch="sm_80", effective_head_dim=80)):
        assert "hdim96" not in wide.name and ("FT_HEAD_DIM_EFF", 96) not in wide.defines
    with pytest.raises(ValueError, match="narrowed to 96"):
        build.fwd_sm90_kernel(128, "bf16", False, block_sparse=True, head_dim_eff=96)
    with pytest.raises(ValueError, match="narrowed to 64"):
        build.bwd_sm90_kernel(128, "bf16", False, head_dim_eff=64)


def test_kernel_scale():
    """The kernels take a positive scale of at least 2^-64; ops.kernel_scale folds the rest of the caller's scale into
    q (a factor whose product with the scale is the caller's): -1 for a negative scale, s 2^64 below 2^-64."""
    from flashtrain.kernels import ops

    assert ops.kernel_scale(0.125) == (1.0, 0.125) and ops.kernel_scale(2.0 ** -64) == (1.0, 2.0 ** -64)
    assert ops.kernel_scale(-0.4) == (-1.0, 0.4) and ops.kernel_scale(0.0) == (0.0, 2.0 ** -64)
    for scale in (1e-30, -1e-30, -2.0 ** -70, 5e-324):
        q_factor, kernel = ops.kernel_scale(scale)
        assert kernel == 2.0 ** -64 and q_factor * kernel == pytest.approx(scale, rel=1e-12, abs=0)
    # ops.kernel_query: the query the kernels take (q itself at factor 1, else the product) with the same factors
    import torch

    q = torch.randn(2, 3, 4)
    same, factor, kernel = ops.kernel_query(q, 0.125)
    assert same is q and (factor, kernel) == (1.0, 0.125)
    negated, factor, kernel = ops.kernel_query(q, -0.4)
    assert torch.equal(negated, -q) and (factor, kernel) == (-1.0, 0.4)


def test_lse_bias_kernels(monkeypatch):
    """The Hopper backward without dropout, block mask or determinism accumulates S^T onto the lse term (`_lsebias`,
    FT_BWD_LSE_BIAS; bwd_lse_bias tells the preprocess to write lse in raw score units) in the narrowed kernels and the
    hd128 64-query ones, and the hd128 64-query window-only kernels (BWD_SM90_WINDOW_LSE_BIAS); dropout, the hd128
    80-query kernels, the other head dims and the other score-modification kernels keep the FFMA with lse;
    BWD_SM90_LSE_BIAS = 0 (A/B) none."""
    def bwd(head_dim, effective, dropout=False, causal=True, **kw):
        return build.bwd_kernel(head_dim, "bf16", causal, dropout, arch="sm_90a", effective_head_dim=effective, **kw)

    for effective in (72, 80, 88, 96):
        for seqlen_q in (None, 1 << 16):
            spec = bwd(128, effective, seqlen_q=seqlen_q)
            assert build.bwd_lse_bias(spec) and spec.name.endswith("_lsebias") and spec in build.all_kernels()
        assert not build.bwd_lse_bias(bwd(128, effective, dropout=True))
    causal64 = bwd(128, 128)
    assert causal64.tiles.block_m == 64 and build.bwd_lse_bias(causal64) and causal64 in build.all_kernels()
    assert causal64.name == "flash_bwd_sm90_hdim128_bf16_causal_lsebias" + _fdq(128)
    long64 = bwd(128, 128, seqlen_q=1 << 16)
    assert long64.name == "flash_bwd_sm90_hdim128_bf16_causal_lsebias" + _fdq(128, 1 << 16)
    assert long64.tiles.block_m == 64 and build.bwd_lse_bias(long64) and long64 in build.all_kernels()
    for spec in (bwd(128, 128, causal=False),  # (80-query blocks)
                 bwd(128, 128, dropout=True), bwd(64, 64), bwd(192, 192), bwd(256, 256),
                 bwd(128, 128, score_mods=True), bwd(64, 64, score_mods=True),
                 build.bwd_kernel(128, "bf16", True, False, True, arch="sm_90a"),
                 build.bwd_kernel(128, "bf16", True, False, arch="sm_80", effective_head_dim=96)):
        assert not build.bwd_lse_bias(spec) and "lsebias" not in spec.name, spec.name
    assert bwd(128, 128, causal=False, seqlen_q=1 << 16).tiles.block_m == 80
    for causal in (False, True):  # a sliding window alone: the 64-query window-only kernel
        window = build.bwd_sm90_mods_kernel(128, "bf16", causal, window_left=1024, window_only=True)
        assert window.tiles.block_m == 64 and build.bwd_lse_bias(window) and window in build.all_kernels()
        assert window.name.endswith("_mods_window_lsebias")
    for spec in (build.bwd_sm90_mods_kernel(64, "bf16", True, window_left=1024, window_only=True),
                 build.bwd_sm90_mods_kernel(128, "bf16", True, window_left=4096, window_only=True, seqlen_q=1 << 16)):
        assert not build.bwd_lse_bias(spec) and spec.name.endswith("_mods_window"), spec.name
    monkeypatch.setattr(build, "BWD_SM90_WINDOW_LSE_BIAS", 0)
    window = build.bwd_sm90_mods_kernel(128, "bf16", True, window_left=1024, window_only=True)
    assert not build.bwd_lse_bias(window) and window.name.endswith("_mods_window")
    monkeypatch.setattr(build, "BWD_SM90_LSE_BIAS", 0)
    for effective, name in ((96, "flash_bwd_sm90_hdim96_bf16_causal"), (128, "flash_bwd_sm90_hdim128_bf16_causal" + _fdq(128))):
        plain = bwd(128, effective)
        assert not build.bwd_lse_bias(plain) and plain.name == name
    with pytest.raises(ValueError, match="lse_bias"):
        build._bwd_sm90_spec(128, "bf16", True, False, False, False, build.BWD_SM90_TILES[128], 128, 2, lse_bias=True)
    # the deterministic hd128 kernels too (BWD_SM90_DET_LSE_BIAS, with BWD_SM90_LSE_BIAS), not hd64's; 0: from zero
    monkeypatch.setattr(build, "BWD_SM90_LSE_BIAS", 1)
    for det_bias in (1, 0):
        monkeypatch.setattr(build, "BWD_SM90_DET_LSE_BIAS", det_bias)
        for causal in (False, True):
            det = build.bwd_kernel(128, "bf16", causal, False, arch="sm_90a", deterministic=True)
            assert build.bwd_lse_bias(det) == bool(det_bias) and det.tiles.block_m == 64
            assert det.name == f"flash_bwd_sm90_hdim128_bf16{'_causal' if causal else ''}_det{'_lsebias' * det_bias}"
            assert det_bias == 0 or det in build.all_kernels()
    det64 = build.bwd_kernel(64, "bf16", True, False, arch="sm_90a", deterministic=True)
    assert not build.bwd_lse_bias(det64) and det64.name == "flash_bwd_sm90_hdim64_bf16_causal_det"


def test_head_dim_512_dispatch(monkeypatch):
    """Head dims 257-512 run the head-dim-512 kernels: on sm_90a the warpgroup-MMA forward with two consumer
    warpgroups sharing 64 rows (split_d: 384 threads, 225 KB) and the mma.sync backward (205 KB); the score
    modifications and mask expressions there, and every kernel on sm_80, the mma.sync ones (their forward's warp pairs
    split O's columns); 163 KB refuses the head dim by name (the backward's shared memory). FLASHTRAIN_FWD_SM90_TILES
    keeps the split at head dim 512."""
    assert build.rounded_head_dim(300) == build.rounded_head_dim(500, arch="sm_90a") == 512
    fwd = build.fwd_kernel(512, "bf16", True, True, arch="sm_90a")
    assert (fwd.name, fwd.threads, fwd.smem_bytes) == ("flash_fwd_sm90_hdim512_bf16_causal_dropout", 384, 230656)
    assert fwd.tiles.split_d and fwd.smem_bytes <= build.ARCH_SMEM_OPTIN["sm_90a"]
    mods = build.fwd_kernel(512, "bf16", True, False, arch="sm_90a", score_mods=True)
    assert mods.name == "flash_fwd_hdim512_bf16_causal_mods" and mods.tiles.warps_d == 2
    assert 512 not in build.FWD_SM90_MODS_HEAD_DIMS
    bwd = build.bwd_kernel(512, "bf16", False, False, arch="sm_90a", deterministic=True)
    assert (bwd.source, bwd.smem_bytes, bwd.tiles.dq_chunks) == ("flash_bwd.cu", 205312, 4)
    assert ("FT_DQ_CHUNKS", 4) in bwd.defines
    sm80 = build.fwd_kernel(512, "bf16", False, False, arch="sm_80")
    assert (sm80.source, sm80.threads, sm80.smem_bytes) == ("flash_fwd.cu", 256, 147456)
    assert ("FT_WARPS_D", 2) in sm80.defines
    # the other head dims' macros (hence their cache keys) carry neither switch
    assert not any(name in ("FT_WARPS_D", "FT_DQ_CHUNKS") for spec in (build.fwd_kernel(128, "bf16", True, False),
                                                                       build.bwd_kernel(256, "bf16", True, False))
                   for name, _ in spec.defines)
    assert "205312 bytes" in build.smem_unavailable_reason(512, False, build.SMEM_OPTIN_SM80)
    monkeypatch.setenv("FLASHTRAIN_FWD_SM90_TILES", "512=64x32x2q")
    monkeypatch.setattr(build, "FWD_SM90_TILES", dict(build.FWD_SM90_TILES))
    monkeypatch.setattr(build, "FWD_SM90_TILES_NONCAUSAL", dict(build.FWD_SM90_TILES_NONCAUSAL))
    monkeypatch.setattr(build, "FWD_SM90_TILES_LONG_CAUSAL", dict(build.FWD_SM90_TILES_LONG_CAUSAL))
    build._tile_overrides()
    assert build.FWD_SM90_TILES[512].split_d and build.FWD_SM90_TILES[512].threads == 384


def test_hopper_dispatch(monkeypatch):
    """sm_90a runs the warpgroup-MMA forward at head dims 64, 128, 192, 256 and backward at 64, 128 (dense or
    block-sparse, dropout too; the backward deterministic too, except block-sparse) and at 192, 256 (dense, no
    dropout, not deterministic); head dims 65-96 round up to 128 there; head dims <= 32 and other GPUs run the mma.sync kernels; FLASHTRAIN_SM90=0 turns the Hopper kernels off."""
    monkeypatch.setattr(build, "BWD_TAIL_SPLIT", 0)  # (the whole-tile kernels' names; the tail split: its own tests)
    def name(head_dim, arch, causal=False, dropout=False, block_sparse=False):
        return build.fwd_kernel(head_dim, "fp16", causal, dropout, block_sparse, arch=arch).name

    assert name(64, "sm_90a") == "flash_fwd_sm90_hdim64_fp16"
    assert name(128, "sm_90a", causal=True) == "flash_fwd_sm90_hdim128_fp16_causal"
    assert build.fwd_kernel(128, "bf16", True, False, arch="sm_90a").block_m == build.FWD_SM90_TILES[128].block_m
    assert name(64, "sm_80") == "flash_fwd_hdim64_fp16"
    assert name(64, "sm_90a", dropout=True) == "flash_fwd_sm90_hdim64_fp16_dropout"
    assert name(64, "sm_90a", block_sparse=True) == "flash_fwd_sm90_hdim64_fp16_sparse"
    assert name(64, "sm_80", block_sparse=True) == "flash_fwd_hdim64_fp16_sparse"
    assert name(32, "sm_90a") == "flash_fwd_hdim32_fp16" and name(256, "sm_90a") == "flash_fwd_sm90_hdim256_fp16"
    assert name(192, "sm_90a") == "flash_fwd_sm90_hdim192_fp16" and name(192, "sm_80") == "flash_fwd_hdim192_fp16"
    assert [build.rounded_head_dim(d, arch=arch) for d, arch in ((72, "sm_90a"), (96, "sm_90a"), (96, "sm_80"))] == [
        128, 128, 96]
    assert name(64, "sm_80", dropout=True) == "flash_fwd_hdim64_fp16_dropout"
    def bwd_name(head_dim, arch, dropout=False, block_sparse=False, deterministic=False):
        return build.bwd_kernel(head_dim, "fp16", False, dropout, block_sparse, arch=arch,
                                deterministic=deterministic).name

    assert bwd_name(64, "sm_90a") == "flash_bwd_sm90_hdim64_fp16" and bwd_name(128, "sm_80") == "flash_bwd_hdim128_fp16"
    assert build.bwd_kernel(128, "bf16", True, False, arch="sm_90a").block_n == build.BWD_SM90_TILES[128].block_n
    assert bwd_name(64, "sm_90a", dropout=True) == "flash_bwd_sm90_hdim64_fp16_dropout"
    assert bwd_name(64, "sm_90a", block_sparse=True) == "flash_bwd_sm90_hdim64_fp16_sparse"
    assert bwd_name(64, "sm_90a", deterministic=True) == "flash_bwd_sm90_hdim64_fp16_det"
    assert bwd_name(64, "sm_90a", block_sparse=True, deterministic=True) == "flash_bwd_hdim64_fp16_sparse"
    assert bwd_name(96, "sm_90a") == "flash_bwd_hdim96_fp16"
    # head dims 81-96: the hd128 backward tiles with 96 columns of MMA work (dense, dropout too, not deterministic)
    narrow = build.bwd_kernel(128, "bf16", True, True, arch="sm_90a", effective_head_dim=88)
    assert narrow.name == "flash_bwd_sm90_hdim96_bf16_causal_dropout" and ("FT_HEAD_DIM_EFF", 96) in narrow.defines
    assert narrow.smem_bytes == build.bwd_kernel(128, "bf16", True, True, arch="sm_90a").smem_bytes
    assert build.bwd_kernel(128, "bf16", True, False, arch="sm_90a", effective_head_dim=128).name.startswith(
        "flash_bwd_sm90_hdim128")
    assert build.bwd_kernel(128, "bf16", True, False, arch="sm_90a", deterministic=True,
                            effective_head_dim=96).name == "flash_bwd_sm90_hdim128_bf16_causal_det_lsebias"
    assert build.bwd_kernel(128, "bf16", True, False, True, arch="sm_90a",
                            effective_head_dim=96).name == "flash_bwd_sm90_hdim128_bf16_causal_sparse"
    # head dims 192 / 256: the split-head-dim Hopper backward, dense without dropout, not deterministic
    assert bwd_name(192, "sm_90a") == "flash_bwd_sm90_hdim192_fp16_n96" and bwd_name(256, "sm_90a").startswith("flash_bwd_sm90")
    # (96-key tiles, 48 keys per warpgroup; BWD_SM90_HD192_N96 = 0: the 64-key split-head-dim kernel)
    n96 = build.bwd_kernel(192, "bf16", True, False, arch="sm_90a")
    assert (n96.block_n, n96.smem_bytes, ("FT_BLOCK_N", 96) in n96.defines) == (96, 223488, True)
    # Q 2 stages, dO 1, K, V, single P^T and dS^T, 8 warps' 6 KB dQ slices, lse / D stages, barriers, alignment
    assert n96.smem_bytes == 3 * 24576 + 2 * 36864 + 2 * 12288 + 8 * 6144 + 2 * 2 * 256 + 256 + 1024 <= SM90_MAX_SMEM
    assert ("FT_BWD_SK_STAGE_DQ", 1) in n96.defines
    with monkeypatch.context() as patch:  # dQ from the registers: two dO stages, P^T / dS^T double-buffered
        patch.setattr(build, "BWD_SM90_HD192_STAGE_DQ", 0)
        reg = build.bwd_kernel(192, "bf16", True, False, arch="sm_90a")
        assert (reg.name, ("FT_BWD_SK_STAGE_DQ", 1) in reg.defines) == ("flash_bwd_sm90_hdim192_bf16_causal_n96_dqreg", False)
        assert reg.smem_bytes == 2 * 2 * 24576 + 2 * 36864 + 4 * 12288 + 2 * 2 * 256 + 256 + 1024 <= SM90_MAX_SMEM
    with monkeypatch.context() as patch:
        patch.setattr(build, "BWD_SM90_HD192_N96", 0)
        n64 = build.bwd_kernel(192, "bf16", True, False, arch="sm_90a")
        assert (n64.name, n64.block_n) == ("flash_bwd_sm90_hdim192_bf16_causal", 64)
        assert n64.smem_bytes == 2 * 2 * 24576 + 2 * 24576 + 2 * 8192 + 2 * 2 * 256 + 256 + 1024
    assert build.bwd_kernel(256, "bf16", True, False, arch="sm_90a").block_n == 64
    assert bwd_name(256, "sm_90a", dropout=True) == "flash_bwd_hdim256_fp16_dropout"
    assert bwd_name(192, "sm_90a", deterministic=True) == "flash_bwd_hdim192_fp16"
    with pytest.raises(ValueError, match="dropout=True"):
        build.bwd_sm90_kernel(256, "fp16", False, dropout=True)
    monkeypatch.setenv("FLASHTRAIN_SM90", "0")
    assert name(64, "sm_90a") == "flash_fwd_hdim64_fp16" and bwd_name(64, "sm_90a") == "flash_bwd_hdim64_fp16"
    assert build.rounded_head_dim(96, arch="sm_90a") == 96
    with pytest.raises(ValueError, match="sm_90a"):
        build.compile_kernel(build.fwd_sm90_kernel(64, "fp16", False), "sm_80")


def test_block_sparse_size_agrees_everywhere_and_is_whole_tiles():
    """reference.BLOCK_SPARSE_SIZE (the API's unit) = build.BLOCK_SPARSE_SIZE = csrc/flash.h kBlockSparseSize, and a
    mask block is a whole number of every block-sparse kernel tile."""
    from flashtrain.kernels import BLOCK_SPARSE_SIZE

    header = (build.CSRC / "flash.h").read_text()
    assert int(re.search(r"constexpr int kBlockSparseSize = (\d+);", header).group(1)) == BLOCK_SPARSE_SIZE
    assert build.BLOCK_SPARSE_SIZE == BLOCK_SPARSE_SIZE
    for head_dim in build.BLOCK_SPARSE_HEAD_DIMS:
        for tiles in (build.FWD_TILES[head_dim], build.BWD_TILES[head_dim]):
            assert BLOCK_SPARSE_SIZE % tiles.block_m == 0 and BLOCK_SPARSE_SIZE % tiles.block_n == 0
    assert [build.rounded_head_dim(d, block_sparse=True) for d in (8, 32, 64, 72, 128)] == [64, 64, 64, 128, 128]
    with pytest.raises(ValueError, match="block-sparse"):
        build.rounded_head_dim(136, block_sparse=True)


def test_tiles_split_evenly_across_warps():
    for head_dim, tiles in [*build.FWD_TILES.items(), *build.FWD_TILES_SMALL_SMEM.items()]:
        assert tiles.block_m % (16 * tiles.nwarps // tiles.warps_d) == 0 and tiles.block_n % 16 == 0
        assert head_dim % (64 * tiles.warps_d) == 0 if tiles.warps_d > 1 else head_dim % 32 == 0
    for head_dim, tiles in [*build.BWD_TILES.items(), *build.BWD_TILES_SMALL_SMEM.items()]:
        assert tiles.block_m % (16 * tiles.warps_m_sdp) == 0
        assert tiles.block_n % (16 * tiles.warps_n_dkv) == 0 and tiles.block_m % (16 * tiles.warps_m_dq) == 0
        assert head_dim % (16 * (tiles.nwarps // tiles.warps_n_dkv)) == 0
        assert head_dim % (16 * (tiles.nwarps // tiles.warps_m_dq) * tiles.dq_chunks) == 0


@pytest.mark.parametrize("smem_limit", [build.SMEM_OPTIN_SM80, build.SMEM_OPTIN_SM86])
def test_every_kernel_fits_the_shared_memory_of_its_gpu(smem_limit):
    """A100-class GPUs (163 KB per block) and sm_86 / sm_89 / sm_120 (99 KB) run every head dim up to 256, dtype and
    feature with tiles that fit; 163 KB keeps the first-choice tiles, 99 KB replaces exactly the ones that do not fit.
    Head dim 512 needs Hopper's 227 KB (its backward: 205 KB) and is refused by name below that."""
    specs = build.all_kernels(smem_limit)
    assert all(spec.smem_bytes <= smem_limit for spec in specs)
    assert len({spec.name for spec in specs}) == len(specs)
    assert build.smem_unavailable_reason(512, False, smem_limit) == (
        f"the backward kernel for head_dim 512 needs 205312 bytes of shared memory per block, the GPU allows "
        f"{smem_limit}" if smem_limit == build.SMEM_OPTIN_SM80 else
        f"the forward kernel for head_dim 512 needs 147456 bytes of shared memory per block, the GPU allows {smem_limit}")
    assert not any("hdim512" in spec.name for spec in specs)
    for head_dim in build.HEAD_DIMS[:-1]:
        assert build.smem_unavailable_reason(head_dim, False, smem_limit) is None
        fwd = build.fwd_kernel(head_dim, "bf16", True, True, smem_limit=smem_limit)
        bwd = build.bwd_kernel(head_dim, "bf16", True, True, smem_limit=smem_limit)
        for spec, first_choice in ((fwd, build.FWD_TILES[head_dim]), (bwd, build.BWD_TILES[head_dim])):
            fits = first_choice.smem_bytes(head_dim) <= smem_limit
            assert (spec.tiles == first_choice) == fits and spec.name.endswith("_dropout") == fits
    if smem_limit == build.SMEM_OPTIN_SM80:  # the same kernels as with no limit (the Hopper-only ones and hd512 aside)
        assert {spec for spec in specs if not spec.archs} == {spec for spec in build.all_kernels() if not spec.archs
                                                              and "hdim512" not in spec.name}
    else:
        small = build.small_smem_kernels()
        # 5 bwd + 1 fwd head dims (+ sparse), and their score-modification variants
        assert len(small) == 64 + 6 * 2 * 2 and all(spec in specs for spec in small)


def test_gpus_with_less_shared_memory_are_refused_by_name():
    reason = build.smem_unavailable_reason(256, False, 64 * 1024)
    assert reason == "the forward kernel for head_dim 256 needs 98304 bytes of shared memory per block, the GPU allows 65536"
    assert build.smem_unavailable_reason(40, True, 64 * 1024) == (  # block-sparse hd40 runs the hd64 kernels
        "the backward kernel for head_dim 64 needs 99328 bytes of shared memory per block, the GPU allows 65536")
    with pytest.raises(ValueError, match="needs 98304 bytes"):
        build.fwd_kernel(256, "fp16", False, False, smem_limit=64 * 1024)
    # the Hopper backward (hd128: 106 KB) gives way to the mma.sync 99 KB tiles under such a limit
    assert build.bwd_kernel(128, "bf16", False, False, arch="sm_90a").source == "flash_bwd_sm90.cu"
    assert build.bwd_kernel(128, "bf16", False, False, arch="sm_90a", smem_limit=build.SMEM_OPTIN_SM86).tiles == (
        build.BWD_TILES_SMALL_SMEM[128])


def test_hd128_backward_query_blocks(monkeypatch):
    """The Hopper hd128 backward without dropout runs 80-query blocks (dQ^T): non-causal always, causal from
    BWD_SM90_Q80_CAUSAL_SEQLEN query tokens (None, the default: never at full width), head dims 65-96 (narrowed to
    80 / 96 columns) too (81-96 causal from BWD_SM90_NARROW_Q80_CAUSAL_SEQLEN) but 65-80 causal;
    deterministic, dropout and block-sparse keep 64; FLASHTRAIN_BWD_SM90_Q80=0 turns it off. dq_accum in the accumulator's fragment order
    (the hd128 causal score-modification kernels: plain rows, `_dqrows`); BWD_DQ_FRAG 0 / 2: plain rows / fragment
    order everywhere."""
    monkeypatch.setattr(build, "BWD_TAIL_SPLIT", 0)  # (the whole-tile kernels' names; the tail split: its own tests)
    monkeypatch.delenv("FLASHTRAIN_BWD_SM90_Q80", raising=False)

    def spec(causal=False, seqlen_q=None, **kwargs):
        return build.bwd_kernel(128, "bf16", causal, kwargs.pop("dropout", False), arch="sm_90a", seqlen_q=seqlen_q,
                                **kwargs)

    q80 = spec()
    assert q80.name == "flash_bwd_sm90_hdim128_bf16_q80" and q80.block_m == 80 and q80.tiles.swap_dq
    assert q80.tiles.dq_slice_width(128) == 0 and q80.tiles.dq_frag  # (not the 64-column slices: fragment order)
    assert ("FT_BWD_DQ_FRAG", 0) not in q80.defines
    # Q / dO stages 80 KB, K / V 64 KB, two dS tiles 40 KB, dQ staging 40 KB, statistics in 128-byte slots 1.5 KB,
    # barriers, alignment: under the 227 KB a Hopper block may opt in to
    assert q80.smem_bytes == 81920 + 65536 + 40960 + 40960 + 1536 + 256 + 1024 == 232192 <= SM90_MAX_SMEM
    # full-width causal: 64-query blocks at every length by default (S^T before dP^T's issue, kStFirst)
    assert build.BWD_SM90_Q80_CAUSAL_SEQLEN is None
    assert spec(causal=True, seqlen_q=1 << 20).name == "flash_bwd_sm90_hdim128_bf16_causal_lsebias" + _fdq(128, 1 << 20)
    monkeypatch.setattr(build, "BWD_SM90_Q80_CAUSAL_SEQLEN", 16384)  # (the A/B setting: 80-query from 16K)
    causal80 = spec(causal=True, seqlen_q=build.BWD_SM90_Q80_CAUSAL_SEQLEN)
    assert causal80.name == "flash_bwd_sm90_hdim128_bf16_causal_q80" and causal80.tiles.dq_frag
    assert ("FT_BWD_DQ_FRAG", 0) not in causal80.defines and causal80.smem_bytes == q80.smem_bytes
    mods80 = build.bwd_sm90_mods_kernel(128, "bf16", True, seqlen_q=build.BWD_SM90_Q80_CAUSAL_SEQLEN)  # (no softcap)
    assert mods80.name == "flash_bwd_sm90_hdim128_bf16_causal_q80_dqrows_mods_nocap" and not mods80.tiles.dq_frag
    assert ("FT_BWD_DQ_FRAG", 0) in mods80.defines
    # head dims 65-80 causal: 64-query blocks at every length (warpgroup 0's m64n80 dQ); non-causal and hd96: 80
    assert spec(causal=True, seqlen_q=4096, effective_head_dim=80).name == "flash_bwd_sm90_hdim80_bf16_causal_lsebias"
    # ... from BWD_SM90_NARROW_Q80_CAUSAL_SEQLEN (8K) queries there, hd128 from BWD_SM90_Q80_CAUSAL_SEQLEN (16K)
    narrow, long = build.BWD_SM90_NARROW_Q80_CAUSAL_SEQLEN, build.BWD_SM90_Q80_CAUSAL_SEQLEN
    assert narrow == 8192 and spec(causal=True, seqlen_q=4096, effective_head_dim=96).block_m == 64
    assert (spec(causal=True, seqlen_q=narrow, effective_head_dim=96).name
            == "flash_bwd_sm90_hdim96_bf16_causal_q80_lsebias")
    assert (spec(causal=True, seqlen_q=narrow - 1, effective_head_dim=96).name
            == "flash_bwd_sm90_hdim96_bf16_causal_lsebias")
    assert spec(causal=True, seqlen_q=long // 2).block_m == 64 and spec(causal=True, seqlen_q=long).block_m == 80
    assert spec(seqlen_q=4096, effective_head_dim=80).name == "flash_bwd_sm90_hdim80_bf16_q80_lsebias"
    monkeypatch.setattr(build, "BWD_SM90_HD80_CAUSAL_Q64", 0)
    assert (spec(causal=True, seqlen_q=narrow, effective_head_dim=80).name
            == "flash_bwd_sm90_hdim80_bf16_causal_q80_lsebias")
    monkeypatch.setattr(build, "BWD_SM90_HD80_CAUSAL_Q64", 1)
    monkeypatch.setattr(build, "BWD_DQ_FRAG", 2)
    assert spec(causal=True, seqlen_q=long).name == "flash_bwd_sm90_hdim128_bf16_causal_q80"
    assert build.bwd_sm90_mods_kernel(128, "bf16", True, seqlen_q=long).tiles.dq_frag
    monkeypatch.setattr(build, "BWD_DQ_FRAG", 0)
    assert spec().name == "flash_bwd_sm90_hdim128_bf16_q80_dqrows"
    assert spec(causal=True, seqlen_q=long).name == "flash_bwd_sm90_hdim128_bf16_causal_q80_dqrows"
    monkeypatch.setattr(build, "BWD_DQ_FRAG", 1)
    assert (spec(causal=True, seqlen_q=build.BWD_SM90_Q80_CAUSAL_SEQLEN - 1).name
            == "flash_bwd_sm90_hdim128_bf16_causal_lsebias" + _fdq(128, build.BWD_SM90_Q80_CAUSAL_SEQLEN - 1))
    assert spec(causal=True).block_m == 64
    assert spec(deterministic=True).name == "flash_bwd_sm90_hdim128_bf16_det_lsebias"
    assert spec(dropout=True).block_m == 64 and spec(block_sparse=True).block_m == 64
    assert spec(effective_head_dim=96).name == "flash_bwd_sm90_hdim96_bf16_q80_lsebias"  # (head dims 65-96 too)
    assert spec(effective_head_dim=96, dropout=True).block_m == 64
    monkeypatch.setenv("FLASHTRAIN_BWD_SM90_Q80", "0")
    assert spec().name == "flash_bwd_sm90_hdim128_bf16_lsebias" and spec().block_m == 64
    assert spec(effective_head_dim=96).name == "flash_bwd_sm90_hdim96_bf16_lsebias"


def test_accum_tensor_map_layout():
    """tma_dq: float32 rows of the head dim, boxes of 32 columns (128 bytes, the 128-byte swizzle) x one query block."""
    from flashtrain.kernels import tma

    dtype, dims, strides, box_cols, box_rows, swizzle = tma.accum_layout(1000, 128, 80)
    assert (dims, strides, box_cols, box_rows, swizzle) == ((128, 1000, 1, 1), (512, 512000, 512000), 32, 80,
                                                            tma.SWIZZLE_128B)
    assert box_cols * 4 == 128


@pytest.mark.parametrize("value,expected", [(None, None), ("101376", 101376), ("99K", 101376), ("163k", 166912)])
def test_max_smem_environment_variable(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(build.SMEM_ENV, raising=False)
    else:
        monkeypatch.setenv(build.SMEM_ENV, value)
    assert build.smem_cap() == expected


@pytest.mark.parametrize("value", ["99KB", "-5", "lots", "12"])
def test_bad_max_smem_names_the_variable(monkeypatch, value):
    monkeypatch.setenv(build.SMEM_ENV, value)
    with pytest.raises(ValueError, match="FLASHTRAIN_MAX_SMEM"):
        build.smem_cap()


def test_ctypes_params_match_the_header(launch_module):
    """launch.py's structs mirror csrc/flash.h field for field, in order."""
    launch = launch_module
    header = (build.CSRC / "flash.h").read_text()
    for struct in (launch.FwdParams, launch.BwdParams, launch.AuxParams):
        body = re.search(rf"struct {struct.__name__} {{(.*?)\n}};", header, re.S).group(1)
        body = re.sub(r"//.*", "", body)
        fields = [name for decl in body.split(";") for name in re.findall(r"(\w+)\s*(?:,|$)", decl.strip())]
        assert fields == [name for name, _ in struct._fields_], struct.__name__
    assert ctypes.sizeof(launch.FwdParams) % 8 == 0 and ctypes.sizeof(launch.BwdParams) % 8 == 0


@pytest.fixture
def launch_module(monkeypatch):
    """flashtrain.kernels.launch, importable without cuda-python (its structs need no driver): with a stand-in
    cuda.bindings.driver module, removed again after the test together with the launch module built on it."""
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        driver = types.ModuleType("cuda.bindings.driver")
        bindings = types.ModuleType("cuda.bindings")
        bindings.driver = driver
        cuda = types.ModuleType("cuda")
        cuda.bindings = bindings
        for name, module in (("cuda", cuda), ("cuda.bindings", bindings), ("cuda.bindings.driver", driver)):
            monkeypatch.setitem(sys.modules, name, module)
        import flashtrain.kernels as kernels

        sys.modules.pop("flashtrain.kernels.launch", None)
        yield importlib.import_module("flashtrain.kernels.launch")
        sys.modules.pop("flashtrain.kernels.launch", None)
        if hasattr(kernels, "launch"):
            delattr(kernels, "launch")
    else:
        yield importlib.import_module("flashtrain.kernels.launch")


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (flash.h is plain C++)")
def test_ctypes_params_have_the_headers_layout(tmp_path, launch_module):
    """Every field of launch.py's parameter structs sits at the offset the compiled csrc/flash.h gives it, and the
    structs have the header's size (a kernel reads its parameters by offset: a mismatch is silent garbage)."""
    launch = launch_module
    structs = (launch.FwdParams, launch.BwdParams, launch.AuxParams, launch.FwdSm90Params, launch.BwdSm90Params)
    padded = (launch.FwdSm90Params, launch.BwdSm90Params)  # their pad_ is the compiler's tail padding
    lines = ['#include <cstddef>', '#include <cstdio>', '#include "flash.h"', "using namespace flashtrain;",
             "int main() {"]
    for struct in structs:
        name = struct.__name__
        lines.append(f'std::printf("{name} size %zu\\n", sizeof({name}));')
        lines += [f'std::printf("{name} {field} %zu\\n", offsetof({name}, {field}));'
                  for field, _ in struct._fields_ if field != "pad_" or struct not in padded]
    source = tmp_path / "layout.cpp"
    source.write_text("\n".join(lines + ["}"]))
    subprocess.run(["g++", "-std=c++17", "-I", str(build.CSRC), str(source), "-o", str(tmp_path / "layout")],
                   check=True)
    compiled = subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True, check=True).stdout.split("\n")
    for struct in structs:
        expected = {f"{struct.__name__} size {ctypes.sizeof(struct)}"}
        expected |= {f"{struct.__name__} {field} {getattr(struct, field).offset}" for field, _ in struct._fields_
                     if field != "pad_" or struct not in padded}
        assert expected <= set(compiled), sorted(expected - set(compiled))


def test_cache_key_changes_with_macros_and_arch(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHTRAIN_KERNEL_CACHE", str(tmp_path))
    spec = build.fwd_kernel(64, "bf16", causal=True, dropout=False)
    other = build.fwd_kernel(64, "bf16", causal=False, dropout=False)
    paths = {build.cubin_path(spec, "sm_80", "nvcc"), build.cubin_path(spec, "sm_90a", "nvcc"),
             build.cubin_path(other, "sm_80", "nvcc"), build.cubin_path(spec, "sm_80", "nvrtc")}
    assert len(paths) == 4 and all(path.parent == tmp_path for path in paths)


@pytest.mark.skipif(build.nvcc_path() is None, reason="nvcc not installed")
@pytest.mark.slow
def test_nvcc_compiles_the_hardest_instantiations():
    """hdim 128 forward, hdim 256 backward and the block-sparse hdim 128 backward (the dense one differs only in its
    loop over query blocks), with causal masking and dropout, plus the auxiliary kernels."""
    specs = [build.aux_kernels("fp16"), build.fwd_kernel(128, "bf16", True, True),
             build.bwd_kernel(128, "bf16", True, True, block_sparse=True), build.bwd_kernel(256, "fp16", True, True),
             build.fwd_sm90_kernel(128, "bf16", True, True, True),  # sm_90a only
             build.bwd_sm90_kernel(128, "bf16", True, True, True)]
    assert build.check_nvcc(["sm_80", "sm_90a"], jobs=2, specs=specs) == 0
    small = [build.fwd_kernel(256, "bf16", True, True, smem_limit=build.SMEM_OPTIN_SM86),  # the 99 KB tiles
             build.bwd_kernel(256, "bf16", True, True, smem_limit=build.SMEM_OPTIN_SM86)]
    assert build.check_nvcc(["sm_86"], jobs=2, specs=small) == 0


@pytest.mark.skipif(build.nvcc_version() is None, reason="nvcc not installed")
def test_compile_kernel_caches_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHTRAIN_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "nvrtc_version", lambda: None)  # force the nvcc path
    spec = build.aux_kernels("bf16")
    cubin = build.compile_kernel(spec, "sm_80")
    assert cubin[:4] == b"\x7fELF"
    for symbol in spec.symbols:
        assert symbol.encode() in cubin
    monkeypatch.setattr(build, "_compile_nvcc", lambda *args: pytest.fail("cache miss"))
    assert build.compile_kernel(spec, "sm_80") == cubin


def test_generated_wgmma_wrappers_are_current():
    """csrc/wgmma_ops.cuh is what flashtrain/kernels/gen_wgmma.py writes (regenerate after changing the script)."""
    from flashtrain.kernels import gen_wgmma

    assert gen_wgmma.OUTPUT.read_text() == gen_wgmma.generate()


@pytest.mark.parametrize("group, seqlen, n_bh, causal, expected", [
    (8, 4096, 4 * 2, True, 4),     # GQA 16/2, batch 4, 4K causal (the workload row): the whole group per tile
    (4, 8192, 2 * 8, True, 2),     # GQA 32/8, batch 2, 8K causal
    (4, 4096, 2 * 8, False, 2),    # non-causal 4K, 16 (batch, kv head) pairs
    (4, 16384, 64 * 8, False, 1),  # plenty of tiles: the group stays whole
    (6, 100, 1, True, 6),          # tiny: one query head per tile
])
def test_gqa_splits_balance_the_hopper_backward(group, seqlen, n_bh, causal, expected):
    """ops._gqa_splits: the fewest parts (a divisor of the group) whose longest tile is at most a quarter of an SM's
    share of the backward's query-block steps (132 SMs), or one query head per tile."""
    from flashtrain.kernels import ops

    tiles = build.BWD_SM90_TILES[128]
    splits = ops._gqa_splits(group, seqlen, seqlen, tiles, causal, n_bh, 132)
    assert splits == expected and group % splits == 0
    m_blocks, n_blocks = -(-seqlen // tiles.block_m), -(-seqlen // tiles.block_n)
    visible = [m_blocks - (j * tiles.block_n // tiles.block_m if causal else 0) for j in range(n_blocks)]
    share = n_bh * group * sum(visible) / 132
    longest = group // splits * max(visible)
    assert longest <= share / 4 or splits == group
    if splits > 1:  # one part fewer would not do
        fewer = max(d for d in range(1, splits) if group % d == 0)
        assert group // fewer * max(visible) > share / 4


@pytest.mark.parametrize("n_blocks, n_units, waves, expected", [
    (32, 64, 2.0, 9),              # hd128 4K causal backward: 32 key blocks, 64 (batch, head) units -> 9 per group
    (4, 512, 2.0, 66),             # hd128 512 causal forward: 4 query blocks, 512 units
    (8, 16, 2.0, 16),              # fewer units than a group: one group
    (32, 64, 0.0, 1),              # the backward's earlier order (key blocks fastest)
    (32, 64, float("inf"), 64),    # the forward's earlier order (longest first over all units)
])
def test_causal_tile_groups(n_blocks, n_units, waves, expected, monkeypatch):
    """ops._causal_tile_group: units per group of the Hopper causal kernels' tile order, sized so that a group's
    tiles fill the 132 SMs `waves` times (the kernels' last group takes the remainder too)."""
    from flashtrain.kernels import ops

    monkeypatch.setattr(ops, "CAUSAL_GROUP_WAVES", waves)
    group = ops._causal_tile_group(n_blocks, n_units, 132)
    assert group == expected and 1 <= group <= n_units
    if 1 < group < n_units:  # the smallest group whose tiles fill the SMs `waves` times over
        assert group * n_blocks >= waves * 132 > (group - 1) * n_blocks


def test_short_hd128_causal_tile_groups_fill_one_wave(monkeypatch):
    """Head-dim-128 causal calls on 128-row blocks take groups of one wave (ops.CAUSAL_GROUP_WAVES_SHORT = 1) up to
    CAUSAL_GROUP_SHORT_BLOCKS blocks (1K tokens), two above; head dims 65-96 on the hd128 tiles, hd64 and other block
    sizes keep two; CAUSAL_GROUP_WAVES_SHORT = 2 (A/B) gives every call two."""
    from flashtrain.kernels import ops

    assert ops.CAUSAL_GROUP_WAVES_SHORT == 1.0 and ops.CAUSAL_GROUP_WAVES == 2.0
    assert ops.CAUSAL_GROUP_SHORT_BLOCKS == 8
    assert ops._causal_tile_group(4, 512, 132, short_hd128=True) == 33  # 512 tokens: 33 units x 4 blocks = 132 tiles
    assert ops._causal_tile_group(4, 512, 132) == 66
    assert ops._causal_tile_group(8, 256, 132, short_hd128=True) == 17  # 1K
    assert ops._causal_tile_group(16, 128, 132, short_hd128=True) == ops._causal_tile_group(16, 128, 132) == 17  # 2K
    assert ops._short_group_hd128(128, 128, 128) and ops._short_group_hd128(128, 120, 128)
    assert not ops._short_group_hd128(128, 96, 128) and not ops._short_group_hd128(128, 80, 128)  # (narrowed)
    assert not ops._short_group_hd128(64, 64, 128) and not ops._short_group_hd128(128, 128, 192)
    monkeypatch.setattr(ops, "CAUSAL_GROUP_WAVES_SHORT", 2.0)
    assert ops._causal_tile_group(4, 512, 132, short_hd128=True) == ops._causal_tile_group(4, 512, 132) == 66


def test_tall_causal_forward_tile_groups_fill_four_waves(monkeypatch):
    """The forward's causal tiles of more than 128 rows (hd64: 192) take groups of four waves
    (ops.FWD_TALL_CAUSAL_GROUP_WAVES) from FWD_TALL_CAUSAL_GROUP_SEQLEN query rows; shorter calls keep two."""
    from flashtrain.kernels import ops

    assert ops.FWD_TALL_CAUSAL_GROUP_WAVES == 4.0 and ops.FWD_TALL_CAUSAL_GROUP_SEQLEN == 2048
    # hd64 causal 16K, batch 1, 32 heads: 86 query tiles of 192 rows per head; 4 x 132 / 86 -> 7 heads per group
    assert ops._causal_tile_group(86, 32, 132, tall=True) == 7
    assert ops._causal_tile_group(86, 32, 132) == 4  # (two waves)
    assert ops._causal_tile_group(11, 128, 132, tall=True) == 48  # 2K
    # the tall switch outranks the short hd128 one (a 192-row call is never short_hd128 in dispatch)
    assert ops._causal_tile_group(4, 512, 132, short_hd128=True, tall=True) == 132
    monkeypatch.setattr(ops, "FWD_TALL_CAUSAL_GROUP_WAVES", 2.0)
    assert ops._causal_tile_group(86, 32, 132, tall=True) == 4


def test_all_kernels_lists_what_calls_dispatch_to():
    """Every Hopper backward that a dense call at head dim 128 (causal or not, short or long, with or without a
    window) dispatches to is in all_kernels (which CI compiles and `python -m flashtrain.kernels.build` prebuilds)."""
    names = {spec.name for spec in build.all_kernels()}
    for causal in (False, True):
        for seqlen_q in (None, 1 << 20):
            assert build.bwd_kernel(128, "bf16", causal, False, arch=build.SM90_ARCH, seqlen_q=seqlen_q).name in names
            for window_left in (-1, 256):
                assert build.bwd_kernel(128, "bf16", causal, False, arch=build.SM90_ARCH, seqlen_q=seqlen_q,
                                        score_mods=True, window_left=window_left).name in names


@pytest.mark.parametrize("steps_per_tile, n_units, unit_bytes, n_kblocks, expected", [
    (32, 128, 2 << 20, 16, 9),      # hd128 2K non-causal (64-query blocks): ceil(2 * 132 / 32) units per group
    (256, 16, 16 << 20, 128, 2),    # hd128 16K: the L2 bound (24 MiB / 16 MiB) is 1 unit, 128 tiles for 132 SMs
    (128, 32, 8 << 20, 64, 3),      # hd128 8K: ceil(2 * 132 / 128) units, within the L2 bound
    (16, 256, 1 << 20, 8, 17),      # hd64 2K (128-query blocks)
    (16.5, 4, 1 << 20, 16, 4),      # fewer units than a group: one group
    (4, 512, 4 << 20, 64, 6),       # the L2 bound: 24 MiB / 4 MiB (6 x 64 tiles fill the SMs)
])
def test_deterministic_tile_groups(steps_per_tile, n_units, unit_bytes, n_kblocks, expected, monkeypatch):
    """ops._det_tile_group: units per group of the Hopper deterministic backward's tiles: DET_GROUP_STEPS waves of
    steps, at most DET_GROUP_L2_BYTES of rows, at least one tile per SM (DET_GROUP_FULL_WAVE)."""
    from flashtrain.kernels import ops

    group = ops._det_tile_group(steps_per_tile, n_units, unit_bytes, 132, n_kblocks, ops.DET_GROUP_STEPS)
    assert group == expected and 1 <= group <= n_units
    assert (group == n_units or group * unit_bytes <= ops.DET_GROUP_L2_BYTES or group == 1
            or (group - 1) * n_kblocks < 132)
    monkeypatch.setattr(ops, "DET_GROUP_FULL_WAVE", 0)  # the L2 bound alone
    group = ops._det_tile_group(steps_per_tile, n_units, unit_bytes, 132, n_kblocks, ops.DET_GROUP_STEPS)
    assert group == n_units or group * unit_bytes <= ops.DET_GROUP_L2_BYTES or group == 1


def test_hopper_mods_kernels_without_softcap_run_the_nocap_variants(monkeypatch):
    """A call without softcap runs the Hopper kernels built without softcap (the forward without the tanh path, the
    backward without the derivative's registers); one with softcap the variants that have it (the backward: head dim
    128). FLASHTRAIN_MODS_NOCAP=0 (A/B) runs the softcap variants for every call."""
    for causal in (False, True):
        fwd = build.fwd_kernel(128, "bf16", causal, False, arch=build.SM90_ARCH, score_mods=True)
        assert fwd.name.endswith("_mods_nocap") and ("FT_SCORE_MODS", 2) in fwd.defines
        assert build.fwd_kernel(128, "bf16", causal, False, arch=build.SM90_ARCH, score_mods=True,
                                softcap=True).name.endswith("_mods")
        plain = build.bwd_kernel(128, "bf16", causal, False, arch=build.SM90_ARCH, score_mods=True)
        capped = build.bwd_kernel(128, "bf16", causal, False, arch=build.SM90_ARCH, score_mods=True, softcap=True)
        assert plain.name.endswith("_mods_nocap") and ("FT_SCORE_MODS", 2) in plain.defines
        assert capped.name.endswith("_mods") and ("FT_SCORE_MODS", 1) in capped.defines
        assert build.bwd_kernel(64, "bf16", causal, False, arch=build.SM90_ARCH, score_mods=True).name.endswith(
            "_mods_nocap")
        assert build.bwd_kernel(64, "bf16", causal, False, arch=build.SM90_ARCH, score_mods=True,
                                softcap=True).source == "flash_bwd.cu"
    with pytest.raises(ValueError, match="no softcap variant"):
        build.bwd_sm90_mods_kernel(64, "bf16", True, softcap=True)
    # causal without softcap or a mask expression, the hd128 backward's 80-query blocks from the mods kernels' own
    # threshold (BWD_SM90_MODS_Q80_CAUSAL_SEQLEN) on, at it and at the benchmark's longest rows (16K)
    for long in (build.BWD_SM90_MODS_Q80_CAUSAL_SEQLEN, 16384):
        for causal, seqlen_q, block_m in ((False, long, 64), (True, None, 64), (True, long, 80)):
            spec = build.bwd_kernel(128, "bf16", causal, False, arch=build.SM90_ARCH, score_mods=True,
                                    seqlen_q=seqlen_q)
            assert spec.block_m == block_m and spec.name.endswith("_mods_nocap"), spec.name
            assert build.bwd_kernel(128, "bf16", causal, False, arch=build.SM90_ARCH, score_mods=True, softcap=True,
                                    seqlen_q=seqlen_q).block_m == 64
        assert build.bwd_kernel(128, "bf16", True, False, arch=build.SM90_ARCH, score_mods=True, seqlen_q=long,
                                mask_defines=(("FT_MASK_MOD", 1),)).block_m == 64
    long = build.BWD_SM90_MODS_Q80_CAUSAL_SEQLEN
    assert build.bwd_kernel(128, "bf16", True, False, arch=build.SM90_ARCH, score_mods=True,
                            seqlen_q=long - 1).block_m == 64
    # ... but a sliding window of at most BWD_SM90_WINDOW_Q64_MAX_LEFT keys keeps the 64-query blocks
    # (BWD_SM90_WINDOW_Q64; A/B switch 0: the 80-query ones); a longer window, or none, takes 80
    def window_blocks(left, seqlen_q=long):
        return build.bwd_kernel(128, "bf16", True, False, arch=build.SM90_ARCH, score_mods=True, seqlen_q=seqlen_q,
                                window_left=left).block_m

    for seqlen_q in (long, 16384):
        assert [window_blocks(left, seqlen_q) for left in (0, 256, build.BWD_SM90_WINDOW_Q64_MAX_LEFT,
                                                           build.BWD_SM90_WINDOW_Q64_MAX_LEFT + 1, -1)] == \
            [64, 64, 64, 80, 80]
    assert build.bwd_kernel(128, "bf16", True, False, arch=build.SM90_ARCH, score_mods=True, seqlen_q=long,
                            window_left=256).name.endswith("_mods_nocap")
    monkeypatch.setattr(build, "BWD_SM90_WINDOW_Q64", 0)
    assert window_blocks(256) == 80
    monkeypatch.setenv("FLASHTRAIN_MODS_NOCAP", "0")
    assert build.fwd_kernel(128, "bf16", True, False, arch=build.SM90_ARCH, score_mods=True).name.endswith("_mods")
    assert build.bwd_kernel(128, "bf16", True, False, arch=build.SM90_ARCH, score_mods=True).name.endswith("_mods")
    assert build.bwd_kernel(64, "bf16", True, False, arch=build.SM90_ARCH, score_mods=True).name.endswith("_nocap")


def test_hopper_window_only_calls_run_the_window_variant(monkeypatch):
    """A call whose one score modification is its window runs the Hopper backward built without ALiBi (`_window`,
    FT_SCORE_MODS 3), on the tiles the general variant would take; softcap or a mask expression keep the general ones,
    and BWD_SM90_WINDOW_ONLY = 0 (A/B) the `_nocap` variant."""
    long = build.BWD_SM90_MODS_Q80_CAUSAL_SEQLEN
    for head_dim in build.BWD_SM90_MODS_HEAD_DIMS:
        for causal in (False, True):
            for seqlen_q, left in ((None, 100), (long, 256), (long, build.BWD_SM90_WINDOW_Q64_MAX_LEFT + 1)):
                def spec(**options):
                    return build.bwd_kernel(head_dim, "bf16", causal, False, arch=build.SM90_ARCH, score_mods=True,
                                            seqlen_q=seqlen_q, window_left=left, **options)

                window, general = spec(window_only=True), spec()
                # (hd128 on 64-query blocks: S^T onto the lse term too, `_lsebias`)
                bias = head_dim == 128 and window.block_m == 64
                assert window.name.endswith("_mods_window_lsebias" if bias else "_mods_window"), window.name
                assert ("FT_SCORE_MODS", 3) in window.defines
                assert general.name.endswith("_mods_nocap")
                assert window.block_m == general.block_m
                assert window.name.replace("_window", "_nocap").removesuffix("_lsebias") == general.name
                if head_dim == 128:  # softcap: the variant that has it
                    assert spec(window_only=True, softcap=True).name.endswith("_mods")
                # a long causal call with a window past BWD_SM90_WINDOW_Q64_MAX_LEFT: the 80-query `_window` kernel
                long_window = head_dim == 128 and causal and left > build.BWD_SM90_WINDOW_Q64_MAX_LEFT
                assert (window.block_m == 80) == long_window and ("_q80" in window.name) == long_window
    masked = build.bwd_kernel(128, "bf16", True, False, arch=build.SM90_ARCH, score_mods=True,
                              mask_defines=(("FT_MASK_MOD", 1),), window_only=True)
    assert "_window" not in masked.name
    with pytest.raises(ValueError, match="window_only"):
        build.bwd_sm90_mods_kernel(128, "bf16", True, softcap=True, window_only=True)
    monkeypatch.setattr(build, "BWD_SM90_WINDOW_ONLY", 0)
    assert build.bwd_kernel(128, "bf16", True, False, arch=build.SM90_ARCH, score_mods=True,
                            window_only=True).name.endswith("_mods_nocap")


def test_hopper_window_only_forward_calls_run_the_window_variant(monkeypatch):
    """The forward of a call whose one score modification is its window runs the Hopper kernel built without ALiBi
    (`_window`, FT_SCORE_MODS 3) on the general variant's tiles with FWD_SM90_WINDOW_Q_BUFFERS Q buffers (2); softcap or
    a mask expression keep the general ones, FWD_SM90_WINDOW_ONLY = 0 (A/B) the `_nocap` one."""
    for head_dim in build.FWD_SM90_MODS_HEAD_DIMS:
        for causal in (False, True):
            def spec(**options):
                return build.fwd_kernel(head_dim, "bf16", causal, False, arch=build.SM90_ARCH, score_mods=True,
                                        **options)

            window, general = spec(window_only=True), spec()
            assert window.name.endswith("_mods_window") and ("FT_SCORE_MODS", 3) in window.defines, window.name
            assert window.name.replace("_q2_", "_").replace("_window", "_nocap") == general.name
            assert spec(window_only=True, softcap=True).name.endswith("_mods")
            assert "_window" not in spec(window_only=True, mask_defines=(("FT_MASK_MOD", 1),)).name
            # (two Q buffers where O has a tile of its own)
            assert window.tiles.q_buffers == (build.FWD_SM90_WINDOW_Q_BUFFERS if general.tiles.separate_o else 1)
            assert window.tiles == dataclasses.replace(general.tiles, q_buffers=window.tiles.q_buffers)
    two = build.fwd_kernel(128, "bf16", True, False, arch=build.SM90_ARCH, score_mods=True, window_only=True)
    capped = build.fwd_kernel(128, "bf16", True, False, arch=build.SM90_ARCH, score_mods=True, window_only=True,
                              smem_limit=two.smem_bytes - 1)  # two Q buffers do not fit: one
    assert capped.tiles.q_buffers == 1 and capped.name.endswith("_mods_window")
    monkeypatch.setattr(build, "FWD_SM90_WINDOW_Q_BUFFERS", 1)
    one = build.fwd_kernel(128, "bf16", True, False, arch=build.SM90_ARCH, score_mods=True, window_only=True)
    assert one.tiles.q_buffers == 1 and one.name.endswith("_causal_mods_window")
    monkeypatch.setattr(build, "FWD_SM90_WINDOW_ONLY", 0)
    assert build.fwd_kernel(128, "bf16", True, False, arch=build.SM90_ARCH, score_mods=True,
                            window_only=True).name.endswith("_mods_nocap")


def test_check_nvcc_fails_on_a_new_serialized_wgmma_pipeline(monkeypatch, capsys):
    """ptxas serializing a Hopper kernel's wgmmas (C75xx, a warning only) fails the nvcc check, except for the kernels
    WGMMA_SERIALIZED_KNOWN accepts; the other archs' kernels are compiled without ptxas's report."""
    reports = {}

    def fake_compile(spec, arch, output, ptxas_verbose=False):
        reports[spec.name, arch] = ptxas_verbose
        return "168 registers, 0 / 0 bytes spilled (stores / loads), wgmma serialized (C7512)" if ptxas_verbose else ""

    monkeypatch.setattr(build, "nvcc_path", lambda: "/usr/bin/nvcc")
    monkeypatch.setattr(build, "_compile_nvcc", fake_compile)
    fwd = build.fwd_kernel(128, "bf16", True, False, arch=build.SM90_ARCH)
    known = build.bwd_kernel(64, "bf16", True, True, arch=build.SM90_ARCH)
    assert known.name == "flash_bwd_sm90_hdim64_bf16_causal_dropout" and build.WGMMA_SERIALIZED_KNOWN.match(known.name)
    assert not build.WGMMA_SERIALIZED_KNOWN.match(fwd.name)
    assert build.check_nvcc([build.SM90_ARCH], 1, [known]) == 0
    assert build.check_nvcc([build.SM90_ARCH], 1, [fwd]) == 1
    assert "ptxas serialized the wgmmas of flash_fwd_sm90_hdim128_bf16_causal" in capsys.readouterr().err
    sm80 = build.fwd_kernel(128, "bf16", True, False, arch="sm_80")
    assert build.check_nvcc(["sm_80"], 1, [sm80]) == 0 and reports[sm80.name, "sm_80"] is False


def test_hd64_cluster_forward_tiles(monkeypatch):
    """FWD_SM90_CLUSTER_HD64: the dense non-causal hd64 forward (192 x 128 tiles, three consumer warpgroups) from
    FWD_SM90_CLUSTER_SEQLEN keys in 2-CTA clusters where a head has an even number of 192-row query tiles (16K: 86;
    8K: 43, odd); causal, dropout, fewer keys and either switch off keep one CTA per tile. Both dtypes' kernels are in
    all_kernels (CI compiles them) and fit the shared memory of one CTA per SM."""
    monkeypatch.setattr(build, "FWD_SM90_CLUSTER", 1)
    monkeypatch.setattr(build, "FWD_SM90_CLUSTER_HD64", 1)
    monkeypatch.setattr(build, "FWD_TAIL_SPLIT", 0)
    long = build.FWD_SM90_CLUSTER_SEQLEN

    def tiles(seqlen_q, seqlen_k, causal=False, dropout=False):
        return build.fwd_kernel(64, "bf16", causal, dropout, arch="sm_90a", seqlen_q=seqlen_q, seqlen_k=seqlen_k).tiles

    for dtype in ("bf16", "fp16"):
        spec = build.fwd_kernel(64, dtype, False, False, arch="sm_90a", seqlen_q=2 * long, seqlen_k=2 * long)
        assert spec.name == f"flash_fwd_sm90_hdim64_{dtype}_c2" and ("FT_CLUSTER", 2) in spec.defines
        assert (spec.tiles.block_m, spec.tiles.block_n, spec.tiles.cluster) == (192, 128, 2)
        assert spec in build.all_kernels() and spec.smem_bytes <= SM90_MAX_SMEM
    assert tiles(2 * long, long).cluster == 2 and tiles(4 * 192 - 7, long).cluster == 2  # (a partial last tile)
    assert tiles(long, long).cluster == 1  # 43 query tiles per head
    assert tiles(2 * long, long - 1).cluster == 1 and tiles(2 * long, 2 * long, causal=True).cluster == 1
    assert tiles(2 * long, 2 * long, dropout=True).cluster == 1
    monkeypatch.setattr(build, "FWD_SM90_CLUSTER_HD64", 0)
    assert tiles(2 * long, 2 * long).cluster == 1
    monkeypatch.setattr(build, "FWD_SM90_CLUSTER_HD64", 1)
    monkeypatch.setattr(build, "FWD_SM90_CLUSTER", 0)
    assert tiles(2 * long, 2 * long).cluster == 1


def test_long_causal_forwards_without_the_block_max():
    """Causal Hopper forwards of FWD_SM90_REF_CAUSAL_SEQLEN query rows or more on the tiles it names take the kernels
    whose unmasked steps skip the block's row max (`_ref`, FT_FWD_REF_CAUSAL=1): head dim 64 from 4K rows (the
    192-row tiles), head dim 128 on the 192-key tiles (16K keys); shorter calls, other tiles, dropout, varlen (length
    unknown) and the narrowed head dims keep the block max."""
    ref = ("FT_FWD_REF_CAUSAL", 1)

    def spec(head_dim, seqlen_q, seqlen_k=None, **kw):
        return build.fwd_kernel(head_dim, "bf16", True, kw.pop("dropout", False), arch="sm_90a", seqlen_q=seqlen_q,
                                seqlen_k=seqlen_q if seqlen_k is None else seqlen_k, **kw)

    assert {head_dim: seqlen for head_dim, (seqlen, _) in build.FWD_SM90_REF_CAUSAL_SEQLEN.items()} == {
        64: 4096, 128: build.LONG_KEYS_CAUSAL_SEQLEN}
    for head_dim, seqlen, name in ((64, 4096, "hdim64_bf16_causal_192x128_ref"),
                                   (64, 16384, "hdim64_bf16_causal_192x128_ref"),
                                   (128, 16384, "hdim128_bf16_causal_128x192_ref")):
        kernel = spec(head_dim, seqlen)
        assert kernel.name == f"flash_fwd_sm90_{name}" and ref in kernel.defines and kernel.tiles.ref_causal
        assert kernel in build.all_kernels()
    # one row short of the thresholds (hd128: the 128-key tiles), and other calls: the block max
    for other in (spec(64, 4095), spec(128, 16383), spec(64, 2048), spec(64, 16384, dropout=True), spec(64, 0, 0),
                  spec(128, 8192), spec(128, 16384, 8192), spec(128, 300, 16384),
                  spec(128, 16384, effective_head_dim=96)):
        assert ref not in other.defines and not other.tiles.ref_causal, other.name
    assert ref not in build.fwd_kernel(64, "bf16", False, False, arch="sm_90a", seqlen_q=16384,
                                       seqlen_k=16384).defines
