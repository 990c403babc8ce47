"""The Hopper forward's softmax runs beside the warpgroup's own P V GEMM: in the compiled key-block loop (static SASS,
no GPU), a block's exponentials come before the wait for the previous block's P V GEMM. With the stage releases
behind `if (lead_lane)` branches ptxas moved that wait above the whole softmax (flash_fwd_sm90.cuh
FT_FWD_ARRIVE_PRED: none of the 66 exponentials of an hd128 block before it; H200, the forward 1.01-1.06x faster
with them beside it). benchmarks/probes/sm90_spills.py prints the same windows for any forward kernel."""

import importlib.util
import re
from pathlib import Path

import pytest

from flashtrain.kernels import build

ROOT = Path(__file__).resolve().parent.parent


def _probe():
    spec = importlib.util.spec_from_file_location("sm90_spills", ROOT / "benchmarks" / "probes" / "sm90_spills.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pv_wait_windows_count_what_lies_between_the_two_waits():
    code = ["HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24, gsb0",
            "WARPGROUP.DEPBAR.LE gsb0, 0x1",
            "FFMA R1, R2, R3, -R4", "MUFU.EX2 R5, R1", "@P0 SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR5], RZ", "MUFU.EX2 R6, R7",
            "WARPGROUP.DEPBAR.LE gsb0, 0x0",
            "FMUL R8, R8, R9",
            "WARPGROUP.DEPBAR.LE gsb0, 0x1", "WARPGROUP.DEPBAR.LE gsb0, 0x0",
            "MUFU.EX2 R10, R11", "WARPGROUP.DEPBAR.LE gsb0, 0x0"]
    assert _probe().pv_wait_windows(code) == [(2, 4), (0, 0)]


@pytest.mark.slow
def test_hd128_forward_exponentials_precede_the_pv_wait(tmp_path):
    probe = _probe()
    tool = probe.disassembler()
    if build.nvcc_path() is None or tool is None:
        pytest.skip("needs nvcc and nvdisasm or cuobjdump (pip install -e '.[dev]' brings nvidia-cuda-nvdisasm)")
    spec = build.fwd_sm90_kernel(128, "bf16", False, seqlen_q=4096, seqlen_k=4096)  # the 128 x 128 tiles
    cubin = tmp_path / "fwd.cubin"
    build._compile_nvcc(spec, build.SM90_ARCH, cubin)
    code = probe.sass_instructions(tool, cubin)
    windows = probe.pv_wait_windows(code)
    # the unmasked steps' K and V descriptors move by one 64-bit add each (FT_FWD_DESC64): 14 UIADD3.64 with ptxas
    # 13.0, 0 with FT_FWD_DESC64=0
    assert sum(ins.split()[0] == "UIADD3.64" for ins in code) >= 8
    # the loop's two paths (unmasked, masked): 16 and 11 exponentials and 95 / 291 instructions beside the P V GEMM
    # with ptxas 13.0 (the unmasked step without the block max, kRefMaxMode; 12 / 12 and 184 / 294 with the block max,
    # FT_FWD_REF_MAX=0; 25-26 and 197-318 with O rescaled every step, FT_FWD_LAZY_RESCALE=0); 3 with the epilogue's
    # indices derived before the tile loop (FT_FWD_EPI_OPAQUE=0), 0 with the releases behind branches
    assert len(windows) == 2, windows
    assert min(exps for exps, _ in windows) >= 8, windows
    assert min(instrs for _, instrs in windows) >= 80, windows


@pytest.mark.slow
def test_cluster_forward_moves_descriptors_on_the_masked_address(tmp_path):
    """The 2-CTA cluster forward moves its K / V descriptors by 64-bit adds on the address masked to the start-address
    field (wgmma.cuh form 3, FT_FWD_DESC64_CLUSTER): with the unmasked form 2 of the one-CTA kernels it computed wrong
    outputs on an H200."""
    probe = _probe()
    tool = probe.disassembler()
    if build.nvcc_path() is None or tool is None:
        pytest.skip("needs nvcc and nvdisasm or cuobjdump (pip install -e '.[dev]' brings nvidia-cuda-nvdisasm)")
    spec = build.fwd_kernel(128, "bf16", False, False, arch=build.SM90_ARCH, seqlen_q=16384, seqlen_k=16384)
    assert spec.name.endswith("_c2"), spec.name
    cubin = tmp_path / "fwd_c2.cubin"
    build._compile_nvcc(spec, build.SM90_ARCH, cubin)
    code = probe.sass_instructions(tool, cubin)
    assert sum("HGMMA" in ins for ins in code) >= 50
    # the unmasked steps' K / V descriptors moved by UIADD3.64: 15 with ptxas 13.0, 0 with FT_FWD_DESC64_CLUSTER=0
    assert sum(ins.split()[0] == "UIADD3.64" for ins in code) >= 8


@pytest.mark.slow
def test_hd64_cluster_forward_multicasts_kv_and_keeps_the_one_cta_loop(tmp_path, monkeypatch):
    """The hd64 forward in 2-CTA clusters (build.FWD_SM90_CLUSTER_HD64) copies K and V by TMA multicast (half a key
    block's rows each, tma_load_4d_multicast_rows), Q by a plain copy, moves its descriptors on the masked address as
    the hd128 cluster kernel does, and keeps the one-CTA kernel's key-block loop: no spills, the same P V wait
    windows (ptxas 13.0: 0 / 2 exponentials ahead of the wait, both kernels). Both with the block max in every step
    (FT_FWD_REF_MAX=0), the loop this comparison was made on."""
    probe = _probe()
    tool = probe.disassembler()
    if build.nvcc_path() is None or tool is None:
        pytest.skip("needs nvcc and nvdisasm or cuobjdump (pip install -e '.[dev]' brings nvidia-cuda-nvdisasm)")
    monkeypatch.setattr(build, "FWD_SM90_CLUSTER", 1)
    monkeypatch.setattr(build, "FWD_TAIL_SPLIT", 0)
    monkeypatch.setenv("FLASHTRAIN_EXTRA_DEFINES", "FT_FWD_REF_MAX=0")
    windows = {}
    for cluster in (0, 1):
        monkeypatch.setattr(build, "FWD_SM90_CLUSTER_HD64", cluster)
        spec = build.fwd_kernel(64, "bf16", False, False, arch=build.SM90_ARCH, seqlen_q=16384, seqlen_k=16384)
        assert spec.tiles.cluster == 1 + cluster, spec.name
        cubin = tmp_path / f"fwd64_{cluster}.cubin"
        resources = build._compile_nvcc(spec, build.SM90_ARCH, cubin, ptxas_verbose=True)
        assert "0 / 0 bytes spilled" in resources, resources
        code = probe.sass_instructions(tool, cubin)
        loads = [ins.split()[0] for ins in code if ins.split()[0].startswith("UTMALDG")]
        assert loads == (["UTMALDG.4D"] + ["UTMALDG.4D.MULTICAST"] * 2 if cluster else ["UTMALDG.4D"] * 3), loads
        # (ptxas 13.0: 10 UIADD3.64 in the one-CTA kernel, 7 in the cluster kernel; 0 there with
        # FT_FWD_DESC64_CLUSTER=0)
        assert sum(ins.split()[0] == "UIADD3.64" for ins in code) >= 5
        windows[cluster] = probe.pv_wait_windows(code)
    assert windows[1] == [(e, windows[1][i][1]) for i, (e, _) in enumerate(windows[0])], windows


def test_between_hgmma_counts_the_gaps_inside_a_gemm():
    code = ["HGMMA.64x96x16.F32.BF16 R24, gdesc[UR20], RZ, !UPT", "UIADD3.64 UR22, UR18, 0x80, URZ",
            "HGMMA.64x96x16.F32.BF16 R24, gdesc[UR20], R24, gsb0"] + ["FMUL R1, R1, R2"] * 13 + [
            "HGMMA.64x96x16.F32.BF16 R24, gdesc[UR20], RZ, !UPT", "HGMMA.64x96x16.F32.BF16 R24, gdesc[UR20], R24"]
    assert _probe().between_hgmma(code) == 1  # (the 13-instruction gap lies between two GEMMs)


@pytest.mark.slow
def test_hd192_backward_moves_descriptors_by_64_bit_adds(tmp_path):
    """The split-keys hd192 backward's dO, dK / dV and dQ descriptors move by one 64-bit add each (flash_bwd_sm90.cuh
    FT_BWD_DESC64): ptxas emits UIADD3.64 for them instead of an add and a move of the high word."""
    probe = _probe()
    tool = probe.disassembler()
    if build.nvcc_path() is None or tool is None:
        pytest.skip("needs nvcc and nvdisasm or cuobjdump (pip install -e '.[dev]' brings nvidia-cuda-nvdisasm)")
    # ptxas 13.0, the register form (build.BWD_SM90_HD192_STAGE_DQ = 0): 151 UIADD3.64 and 579 instructions between
    # the HGMMAs of a GEMM; 0 and 678 with every site in the 32-bit form (FT_BWD_DESC64=0). The staged form (the
    # default): 85 and 751; 0 and 654 in the 32-bit form.
    for stage_dq, least_adds, most_between in ((0, 100, 620), (1, 60, 800)):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(build, "BWD_SM90_HD192_STAGE_DQ", stage_dq)
            spec = build.bwd_sm90_kernel(192, "bf16", True)
        assert spec.tiles.block_n == 96 and spec.tiles.stage_dq == bool(stage_dq)  # the split-keys kernel
        cubin = tmp_path / f"bwd{stage_dq}.cubin"
        build._compile_nvcc(spec, build.SM90_ARCH, cubin)
        code = probe.sass_instructions(tool, cubin)
        assert sum(ins.split()[0] == "UIADD3.64" for ins in code) >= least_adds
        assert probe.between_hgmma(code) <= most_between


@pytest.mark.slow
def test_hd128_backward_starts_its_accumulators_at_the_statistics(tmp_path):
    """The hd128 64-query backward (plain causal, and the window-only kernel) starts S^T at -lse / scale and dP^T at -D
    (flash_bwd_sm90.cuh kBiasS, kBiasD; the preprocess writes both negated): its loop has no FFMA for the exponents'
    lse and no FADD for dP^T - D."""
    probe = _probe()
    tool = probe.disassembler()
    if build.nvcc_path() is None or tool is None:
        pytest.skip("needs nvcc and nvdisasm or cuobjdump (pip install -e '.[dev]' brings nvidia-cuda-nvdisasm)")
    for spec in (build.bwd_sm90_kernel(128, "bf16", True),
                 build.bwd_sm90_mods_kernel(128, "bf16", True, window_left=1024, window_only=True)):
        assert build.bwd_lse_bias(spec) and spec.tiles.block_m == 64, spec.name
        cubin = tmp_path / f"{spec.name}.cubin"
        build._compile_nvcc(spec, build.SM90_ARCH, cubin)
        loop = [ins.split()[0] for ins in probe.loop_instructions(probe.sass_instructions(tool, cubin))]
        # ptxas 13.0: 64 MUFU.EX2 (two paths of 32 scores), 0 FADD / FFMA; 64 FADD with FT_BWD_D_BIAS=0
        assert sum(op.startswith("MUFU.EX2") for op in loop) >= 32, spec.name
        assert not any(op.split(".")[0] in ("FADD", "FFMA") for op in loop), spec.name


NVDISASM_LOOP = """
        /*0100*/                   MOV R1, c[0x0][0x28] ;
.L_x_7:
        /*0110*/                   ISETP.GE.AND P0, PT, R2, R3, PT ;
        /*0120*/              @P0 BRA `(.L_x_8) ;
        /*0130*/                   HGMMA.64x80x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT ;
        /*0140*/                   UIADD3.64 UR10, UR8, 0x2, URZ ;
        /*0150*/                   HGMMA.64x80x16.F32.BF16 R24, gdesc[UR10], R24 ;
        /*0160*/                   BRA `(.L_x_9) ;
.L_x_8:
        /*0170*/                   HGMMA.64x80x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT ;
        /*0180*/                   FSEL R24, R24, -INF , !P1 ;
        /*0190*/                   HGMMA.64x80x16.F32.BF16 R24, gdesc[UR10], R24 ;
        /*01a0*/                   HGMMA.64x80x16.F32.BF16 R24, gdesc[UR12], R24 ;
.L_x_9:
        /*01b0*/                   IADD3 R2, R2, 0x1, RZ ;
        /*01c0*/              @P2 BRA `(.L_x_7) ;
        /*01d0*/                   EXIT ;
.L_x_10:
        /*01e0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R9 ;
        /*01f0*/              @!P0 BRA `(.L_x_10) ;
        /*0200*/                   BRA `(.L_x_8) ;
"""


def test_unmasked_step_is_the_loop_piece_without_mask_selects():
    """sm90_spills.py's unmasked step: in the innermost loop issuing HGMMAs, the piece between unconditional branches
    with the most HGMMAs and no FSEL (the masked copy has more HGMMAs here, but selects masked scores)."""
    probe = _probe()
    code, addresses, labels = probe.sass_listing(NVDISASM_LOOP)
    assert labels == {".L_x_7": 0x110, ".L_x_8": 0x170, ".L_x_9": 0x1b0, ".L_x_10": 0x1e0} and len(code) == 17
    # the loop, and the retry block's wait loop; not the retry block's branch back into the loop (EXIT between)
    assert probe.loops(code, addresses, labels) == [(1, 12), (14, 15)]
    step = probe.unmasked_step(code, addresses, labels)
    assert step == code[1:7]  # loop head to the unconditional branch: 2 HGMMAs, no FSEL
    # cuobjdump -sass names branch targets by address, without labels: the same loop and step
    cuobjdump = re.sub(r"^\.L_x_\d+:\n", "", NVDISASM_LOOP, flags=re.M)
    for name, address in labels.items():
        cuobjdump = cuobjdump.replace(f"`({name})", f"0x{address:x}")
    code2, addresses2, labels2 = probe.sass_listing(cuobjdump)
    assert labels2 == {} and probe.loops(code2, addresses2, labels2) == [(1, 12), (14, 15)]
    assert [unpredicated_op(x) for x in probe.unmasked_step(code2, addresses2, labels2)] == \
        [unpredicated_op(x) for x in step]
    # without a loop (straight-line code) there is no step
    assert probe.unmasked_step(code[:8], addresses[:8], {}) is None


def unpredicated_op(ins: str) -> str:
    return ins.split("`")[0].split(" 0x")[0].strip()


@pytest.mark.slow
def test_causal_backward_step_against_the_non_causal_one(tmp_path, monkeypatch):
    """The hd128 80-query backward's unmasked step as ptxas compiles it: the non-causal kernel's with one UIADD3.64 per
    descriptor move; the causal kernel's (which calls reach only with build.BWD_SM90_Q80_CAUSAL_SEQLEN set, as here), in
    one loop with its masked and hidden copies, longer (ptxas 13.0: 450 against 499 instructions, 0 against 21
    UIADD3.X; kernel_ab-h200.json sass_causal_bwd_unmasked_step)."""
    monkeypatch.setattr(build, "BWD_SM90_Q80_CAUSAL_SEQLEN", 16384)
    monkeypatch.setattr(build, "BWD_TAIL_SPLIT", 0)  # (the whole-tile kernel: the tail split's step is 451)
    probe = _probe()
    tool = probe.disassembler()
    if build.nvcc_path() is None or tool is None:
        pytest.skip("needs nvcc and nvdisasm or cuobjdump (pip install -e '.[dev]' brings nvidia-cuda-nvdisasm)")
    steps = {}
    for causal in (False, True):
        spec = build.bwd_sm90_kernel(128, "bf16", causal, seqlen_q=16384)
        assert spec.tiles.block_m == 80
        cubin = tmp_path / f"{spec.name}.cubin"
        build._compile_nvcc(spec, build.SM90_ARCH, cubin)
        steps[causal] = probe.unmasked_step(*probe.sass_listing(probe.disassemble(tool, cubin)))
    for step in steps.values():
        assert sum("HGMMA" in x for x in step) == 34  # S^T, dP^T 8 + 8; dV, dK 5 + 5; dQ^T 8
    assert not any(probe.unpredicated(x).startswith("UIADD3.X") for x in steps[False])
    if "cuda_13.0" in (build.nvcc_version() or ""):  # (another ptxas schedules otherwise)
        assert (len(steps[False]), len(steps[True])) == (450, 499)
    assert len(steps[False]) < len(steps[True])


def test_kernel_items_pick_the_kernel_a_call_of_that_length_runs():
    """sm90_spills.py's kind:head_dim[:flags][:sN]: with sN the forward kernel build dispatches for N query and key
    tokens (its tiles by length), without it the default tiles."""
    probe = _probe()
    assert probe.kernel_spec("fwd:128:s16384").name == build.fwd_kernel(
        128, "bf16", False, False, arch=build.SM90_ARCH, seqlen_q=16384, seqlen_k=16384).name
    assert probe.kernel_spec("fwd:128:s16384").name != probe.kernel_spec("fwd:128").name
    assert probe.kernel_spec("fwd:64:causal:s4096").name == build.fwd_kernel(
        64, "bf16", True, False, arch=build.SM90_ARCH, seqlen_q=4096, seqlen_k=4096).name
    with pytest.raises(SystemExit, match="kind:head_dim"):
        probe.kernel_spec("fwd:128:sx")
    # backward: the kernel a call of N query tokens runs (hd128: 80-query blocks non-causal, causal 64 at every length
    # unless build.BWD_SM90_Q80_CAUSAL_SEQLEN gives a threshold)
    assert probe.kernel_spec("bwd:128:causal:s16384").name == build.bwd_sm90_kernel(
        128, "bf16", True, seqlen_q=16384).name
    assert probe.kernel_spec("bwd:128:s16384").tiles.block_m == 80
    assert probe.kernel_spec("bwd:128:causal:s16384").tiles.block_m == 64
    assert probe.kernel_spec("bwd:128:causal:s4096").tiles.block_m == 64
    with pytest.raises(SystemExit, match="sN: not with mods / window"):
        probe.kernel_spec("bwd:128:causal:window:s4096")
    # window: the backward a causal sliding window of 1024 keys runs (the window-only variant)
    assert probe.kernel_spec("bwd:128:causal:window").name == build.bwd_sm90_mods_kernel(
        128, "bf16", True, window_left=1024, window_only=True).name
    with pytest.raises(SystemExit, match="window: bwd only"):
        probe.kernel_spec("fwd:128:causal:window")


@pytest.mark.slow
def test_register_epilogue_stores_whole_sectors(tmp_path):
    """The hd192 / hd256 forward writes O from its registers (kDirectO) in 8-byte stores after one exchange between
    neighbouring lanes, so that each store instruction of a warp writes whole 32-byte sectors (flash_fwd_sm90.cuh
    FT_FWD_O_SECTORS; the 4-byte stores, twice as many and each writing half-sectors, made the hd192 / hd256 forward
    6-12% slower on an H200)."""
    probe = _probe()
    tool = probe.disassembler()
    if build.nvcc_path() is None or tool is None:
        pytest.skip("needs nvcc and nvdisasm or cuobjdump (pip install -e '.[dev]' brings nvidia-cuda-nvdisasm)")
    spec = build.fwd_sm90_kernel(256, "bf16", True, seqlen_q=4096, seqlen_k=4096)
    cubin = tmp_path / "fwd256.cubin"
    build._compile_nvcc(spec, build.SM90_ARCH, cubin)
    stores = [probe.unpredicated(ins).split()[0] for ins in probe.sass_instructions(tool, cubin) if "STG" in ins]
    # per thread: 2 rows x 16 pairs of n8 tiles, one 8-byte store each (ptxas 13.0: 32 STG.E.64); the 4-byte stores
    # left are the row statistics (lse), 2 (with FT_FWD_O_SECTORS=0: 130 STG.E, no STG.E.64)
    assert stores.count("STG.E.64") == 32, stores
    assert stores.count("STG.E") <= 4, stores


def _listing(lines):
    """cuobjdump-style code and addresses from lines whose branch targets are {name}s of labelled lines (name: ...)."""
    names = {line.split(":")[0]: 0x10 * i for i, line in enumerate(lines) if re.match(r"\w+: ", line)}
    code = [re.sub(r"^\w+: ", "", line).format(**{k: f"0x{v:x}" for k, v in names.items()}) for line in lines]
    return code, [0x10 * i for i in range(len(lines))]


def test_forward_step_path_follows_the_unmasked_copy_without_retries():
    """sm90_spills.py's forward step: from the loop head to the branch back, the path with no masked selects and no
    wait retry (the retry block lies after EXIT; the masked copy selects with FSEL); an unconditional branch to the
    loop's latch is followed."""
    gemm = ["HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24, gsb0"] * 4
    lines = ["MOV R1, RZ",
             "head: ISETP.GT.AND P0, PT, R2, R3, PT",
             "@P0 BRA {masked}",
             "wait: SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4], R2",
             "@!P1 BRA {retry}",
             *gemm, "WARPGROUP.DEPBAR.LE gsb0, 0x1", "MUFU.EX2 R5, R6", "FSEL R9, R9, RZ, P2",
             "BRA {latch}",
             "masked: ISETP.GE.AND P3, PT, R7, R8, PT", *gemm, "WARPGROUP.DEPBAR.LE gsb0, 0x1",
             "FSEL R5, R5, -INF , P3", "FSEL R6, R6, -INF , P3", "MUFU.EX2 R5, R5",
             "latch: IADD3 R2, R2, 0x1, RZ",
             "@P4 BRA {head}",
             "EXIT",
             "retry: SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4], R2",
             "@!P1 BRA {retry}",
             "BRA {wait}"]
    code, addresses = _listing(lines)
    probe = _probe()
    step = probe.forward_step_path(code, addresses, {})
    unmasked = code[1:13] + code[22:24]  # head ... BRA latch, then the latch and its branch back
    assert step == unmasked and len(step) == 14
    assert sum(x.startswith("FSEL") for x in step) == 1  # (a select of the unmasked copy's own stays in)
    # no loop issuing 8 HGMMAs with a one-group wait: no step
    assert probe.forward_step_path(code[:13], addresses[:13], {}) is None


@pytest.mark.slow
def test_forward_step_path_of_the_hd64_forward(tmp_path, monkeypatch):
    """forward_step_path on the compiled hd64 192-row non-causal forward: the unmasked key-block step it finds holds
    the step's 12 HGMMAs (4 for S, 8 for P V) and 66 exponentials (64 scores, 2 corrections), and with ptxas 13.0 it
    is the 423 SASS instructions Nsight Compute counts per step on that kernel. Built with the block max in every step
    (FT_FWD_REF_MAX=0), the step those counts were taken on; the default's unmasked step has no block max (314)."""
    probe = _probe()
    tool = probe.disassembler()
    if build.nvcc_path() is None or tool is None:
        pytest.skip("needs nvcc and nvdisasm or cuobjdump (pip install -e '.[dev]' brings nvidia-cuda-nvdisasm)")
    monkeypatch.setenv("FLASHTRAIN_EXTRA_DEFINES", "FT_FWD_REF_MAX=0")
    spec = build.fwd_sm90_kernel(64, "bf16", False, seqlen_q=16384, seqlen_k=16384)
    assert spec.tiles.block_m == 192
    cubin = tmp_path / "fwd.cubin"
    resources = build._compile_nvcc(spec, build.SM90_ARCH, cubin, ptxas_verbose=True)
    assert "0 / 0 bytes spilled" in resources, resources
    step = probe.forward_step_path(*probe.sass_listing(probe.disassemble(tool, cubin)))
    assert sum("HGMMA" in x for x in step) == 12 and sum("MUFU.EX2" in x for x in step) == 66
    if "cuda_13.0" in (build.nvcc_version() or ""):  # (another ptxas schedules otherwise)
        assert len(step) == 423
