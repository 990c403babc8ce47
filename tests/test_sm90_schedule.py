"""The Hopper forward's softmax runs beside the warpgroup's own P V GEMM: in the compiled key-block loop (static SASS,
no GPU), a block's exponentials come before the wait for the previous block's P V GEMM. With the stage releases
behind `if (lead_lane)` branches ptxas moved that wait above the whole softmax (flash_fwd_sm90.cuh
FT_FWD_ARRIVE_PRED: none of the 66 exponentials of an hd128 block before it; H200, the forward 1.01-1.06x faster
with them beside it). benchmarks/probes/sm90_spills.py prints the same windows for any forward kernel."""

import importlib.util
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
    windows = probe.pv_wait_windows(probe.sass_instructions(tool, cubin))
    # the loop's two paths (unmasked, masked): 15-18 of 66 exponentials and 156-282 instructions beside the P V GEMM
    # with ptxas 13.0; 0 with the releases behind branches
    assert len(windows) == 2, windows
    assert min(exps for exps, _ in windows) >= 10, windows
    assert min(instrs for _, instrs in windows) >= 100, windows
