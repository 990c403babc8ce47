"""Compile the CUDA kernels of flashtrain/kernels/csrc to cubin, at first use, without binding to PyTorch's C++ ABI.

The dispatch table below is the single place that lists the kernel instantiations (head dim x dtype x causal x
dropout, plus the block-sparse set: BLOCK_SPARSE_HEAD_DIMS x dtype x causal x dropout) and their tile shapes; each instantiation is one compilation of an entry file (flash_fwd.cu, flash_bwd.cu,
flash_aux.cu) with FT_* macros. Compilers, in order: NVRTC (libnvrtc from the `nvidia-cuda-nvrtc` wheel that
PyTorch's CUDA builds install, loaded through cuda.bindings), then nvcc. Cubins are cached on disk under
$FLASHTRAIN_KERNEL_CACHE (default ~/.cache/flashtrain/kernels), keyed by the sources' hash, the GPU arch, the
instantiation's macros and the compiler's version.

    python -m flashtrain.kernels.build                        # prebuild every instantiation for this machine's GPU
    python -m flashtrain.kernels.build --arch sm_90a          # ... for a given arch (no GPU needed)
    python -m flashtrain.kernels.build --check-nvcc sm_80 sm_90a   # compile everything with nvcc, no cache (CI)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
HEAD_DIMS = (32, 64, 96, 128, 192, 256)  # instantiated head dims; others round up to the next one
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

    def smem_bytes(self, head_dim: int) -> int:  # Q tile + K tile + V tile, 16-bit values
        return 2 * (self.block_m + 2 * self.block_n) * head_dim


@dataclasses.dataclass(frozen=True)
class BwdTiles:
    block_m: int  # query rows per inner iteration
    block_n: int  # keys per CTA
    nwarps: int
    warps_m_sdp: int  # warps along the query rows of S / dP (the others split the keys)
    warps_n_dkv: int  # warps along the keys of dK / dV (the others split head_dim)
    warps_m_dq: int  # warps along the query rows of dQ (the others split head_dim)
    stages: int  # buffers of Q and dO (2: the next block's copy overlaps this block's math)
    # atomics into whole blocks of dq_accum in the red.v4-friendly order (flash_bwd.cuh): 0 off (row-major), 1 on,
    # 2 on with one laundered base offset for a block's atomics (same layout; the two differ only in ptxas's spills)
    scramble_dq: int = 0
    # lse / D of a thread's rows stored contiguously in shared memory and read with 16-byte loads (fewer shared-memory
    # instructions per iteration; H100 backward, same process: hd128 +1..3%, hd64 -1..4% (its spills 0 -> 8-32 B))
    vec_row_stats: bool = False

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
}
# Hopper (sm_90a) forward on warpgroup MMAs (csrc/flash_fwd_sm90.cuh): dense or block-sparse, dropout too, these
# head dims (a head_dim that rounds up to one of them). nwarps = 4 per 64 query rows. FLASHTRAIN_SM90=0 in the environment turns the Hopper
# kernels (forward and backward) off: the mma.sync ones then run on Hopper too (A/B measurements, bitwise comparisons
# with the block-sparse kernels).
@dataclasses.dataclass(frozen=True)
class FwdSm90Tiles:
    block_m: int  # query rows per CTA: one warpgroup (4 warps) per 64
    block_n: int  # keys per K/V tile
    min_blocks: int = 1  # CTAs per SM the registers are budgeted for (__launch_bounds__)

    @property
    def nwarps(self) -> int:
        return self.block_m // 16

    def smem_bytes(self, head_dim: int) -> int:  # Q, K, V tiles + 1024 to align them (the 128-byte swizzle)
        return 2 * (self.block_m + 2 * self.block_n) * head_dim + 1024


# One warpgroup per CTA, several CTAs per SM: a CTA's softmax overlaps another's GEMMs (H100, same process, forward
# vs FA2: hd64 64x128 x3 CTAs 1.21-1.42x, 128x128 x1 0.80-1.16x; hd128 64x128 x2 1.12-1.69x, 128x128 x1 0.99-1.69x).
FWD_SM90_TILES = {
    64: FwdSm90Tiles(64, 128, min_blocks=3),
    128: FwdSm90Tiles(64, 128, min_blocks=2),
}


@dataclasses.dataclass(frozen=True)
class BwdSm90Tiles:
    min_blocks: int  # CTAs per SM the registers are budgeted for; a CTA = one warpgroup, 64 keys x 64-query steps
    min_blocks_dropout: int  # the same with dropout (Philox needs registers)
    block_m: int = 64
    block_n: int = 64
    nwarps: int = 4
    scramble_dq: int = 1  # whole blocks add into dq_accum in the scrambled order (as BwdTiles), 64-column slices

    def dq_slice_width(self, head_dim: int) -> int:  # flash_bwd_sm90.cuh computes dQ 64 columns per pass
        return 64

    def smem_bytes(self, head_dim: int) -> int:  # Q, dO x 2 stages, K, V, dS^T 16-bit; lse, D x 2 stages; align
        return 2 * (4 * self.block_m * head_dim + 2 * self.block_n * head_dim + self.block_m * self.block_n) \
            + 4 * 4 * self.block_m + 1024


# Hopper backward on warpgroup MMAs (csrc/flash_bwd_sm90.cuh): dense or block-sparse, dropout too, not deterministic,
# these head dims.
# H100, same process, backward vs FA2: hd64 3 CTAs/SM 0.96-1.26x (2 CTAs: 0.97-1.28x), hd128 2 CTAs/SM 0.96-1.33x.
BWD_SM90_TILES = {
    64: BwdSm90Tiles(min_blocks=3, min_blocks_dropout=2),  # dropout with 3: 168 registers + 268-296 B of spills
    128: BwdSm90Tiles(min_blocks=2, min_blocks_dropout=2),
}
SM90_ARCH = "sm_90a"
BWD_TILES = {
    32: BwdTiles(64, 128, 8, warps_m_sdp=2, warps_n_dkv=8, warps_m_dq=4, stages=2),
    64: BwdTiles(128, 128, 8, warps_m_sdp=2, warps_n_dkv=4, warps_m_dq=4, stages=2, scramble_dq=1),
    96: BwdTiles(64, 128, 8, warps_m_sdp=2, warps_n_dkv=8, warps_m_dq=4, stages=2),
    128: BwdTiles(64, 128, 8, warps_m_sdp=2, warps_n_dkv=4, warps_m_dq=2, stages=2, scramble_dq=2, vec_row_stats=True),
    192: BwdTiles(64, 64, 8, warps_m_sdp=2, warps_n_dkv=4, warps_m_dq=4, stages=2),
    256: BwdTiles(64, 64, 8, warps_m_sdp=2, warps_n_dkv=4, warps_m_dq=4, stages=1),
}
AUX_THREADS, AUX_ROWS_PER_CTA = 128, 32  # flash_aux.cuh: kAuxThreads, kRowsPerCta


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

    def supports(self, arch: str) -> bool:
        return not self.archs or arch in self.archs

    @property
    def name(self) -> str:
        return self.symbols[0] if len(self.symbols) == 1 else os.path.commonprefix(self.symbols).rstrip("_")


def rounded_head_dim(head_dim: int, block_sparse: bool = False) -> int:
    """The instantiated head dim a head_dim (multiple of 8) runs on: the extra columns are zero-filled."""
    head_dims = BLOCK_SPARSE_HEAD_DIMS if block_sparse else HEAD_DIMS
    for instantiated in head_dims:
        if head_dim <= instantiated:
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


def _suffix(causal: bool, dropout: bool, block_sparse: bool) -> str:
    return f"{'_causal' if causal else ''}{'_dropout' if dropout else ''}{'_sparse' if block_sparse else ''}"


def fwd_tiles(head_dim: int, causal: bool, dropout: bool, block_sparse: bool = False) -> FwdTiles:
    """The forward's tiles: FWD_TILES[head_dim] for every kernel variant (the block-sparse kernels must use the dense
    ones' tiles: density 1 equals dense bitwise)."""
    return FWD_TILES[head_dim]


def sm90_enabled() -> bool:
    return os.environ.get("FLASHTRAIN_SM90", "1") != "0"


def fwd_kernel(head_dim: int, dtype: str, causal: bool, dropout: bool, block_sparse: bool = False,
               arch: str | None = None) -> KernelSpec:
    """The forward kernel for these features; on arch sm_90a the warpgroup-MMA kernel where it exists."""
    if arch == SM90_ARCH and head_dim in FWD_SM90_TILES and sm90_enabled():
        return fwd_sm90_kernel(head_dim, dtype, causal, dropout, block_sparse)
    return _fwd_spec(head_dim, dtype, causal, dropout, block_sparse, fwd_tiles(head_dim, causal, dropout, block_sparse))


# The specs are built once per (arguments, tiles): building one costs ~10 us of host time, and the forward and backward
# of every attention call look theirs up.
@functools.lru_cache(maxsize=None)
def _fwd_spec(head_dim: int, dtype: str, causal: bool, dropout: bool, block_sparse: bool,
              tiles: FwdTiles) -> KernelSpec:
    name = f"flash_fwd_hdim{head_dim}_{dtype}{_suffix(causal, dropout, block_sparse)}"
    defines = (("FT_HEAD_DIM", head_dim), ("FT_BLOCK_M", tiles.block_m), ("FT_BLOCK_N", tiles.block_n),
               ("FT_NWARPS", tiles.nwarps), ("FT_BF16", int(dtype == "bf16")), ("FT_CAUSAL", int(causal)),
               ("FT_DROPOUT", int(dropout)), ("FT_BLOCK_SPARSE", int(block_sparse)),
               ("FT_SMEM_BYTES", tiles.smem_bytes(head_dim)), ("FT_KERNEL_NAME", name))
    return KernelSpec("flash_fwd.cu", defines, (name,), 32 * tiles.nwarps, tiles.smem_bytes(head_dim),
                      block_m=tiles.block_m)


def fwd_sm90_kernel(head_dim: int, dtype: str, causal: bool, dropout: bool = False,
                    block_sparse: bool = False) -> KernelSpec:
    return _fwd_sm90_spec(head_dim, dtype, causal, dropout, block_sparse, FWD_SM90_TILES[head_dim])


@functools.lru_cache(maxsize=None)
def _fwd_sm90_spec(head_dim: int, dtype: str, causal: bool, dropout: bool, block_sparse: bool,
                   tiles: FwdSm90Tiles) -> KernelSpec:
    smem_bytes = tiles.smem_bytes(head_dim)
    name = f"flash_fwd_sm90_hdim{head_dim}_{dtype}{_suffix(causal, dropout, block_sparse)}"
    defines = (("FT_HEAD_DIM", head_dim), ("FT_BLOCK_M", tiles.block_m), ("FT_BLOCK_N", tiles.block_n),
               ("FT_MIN_BLOCKS", tiles.min_blocks), ("FT_BF16", int(dtype == "bf16")), ("FT_CAUSAL", int(causal)),
               ("FT_DROPOUT", int(dropout)), ("FT_BLOCK_SPARSE", int(block_sparse)), ("FT_SMEM_BYTES", smem_bytes),
               ("FT_KERNEL_NAME", name))
    return KernelSpec("flash_fwd_sm90.cu", defines, (name,), 32 * tiles.nwarps, smem_bytes, block_m=tiles.block_m,
                      archs=(SM90_ARCH,))


def bwd_kernel(head_dim: int, dtype: str, causal: bool, dropout: bool, block_sparse: bool = False,
               arch: str | None = None, deterministic: bool = False) -> KernelSpec:
    """The backward kernel for these features; on arch sm_90a the warpgroup-MMA kernel where it exists."""
    if arch == SM90_ARCH and not deterministic and head_dim in BWD_SM90_TILES and sm90_enabled():
        return bwd_sm90_kernel(head_dim, dtype, causal, dropout, block_sparse)
    return _bwd_spec(head_dim, dtype, causal, dropout, block_sparse, BWD_TILES[head_dim])


def bwd_sm90_kernel(head_dim: int, dtype: str, causal: bool, dropout: bool = False,
                    block_sparse: bool = False) -> KernelSpec:
    return _bwd_sm90_spec(head_dim, dtype, causal, dropout, block_sparse, BWD_SM90_TILES[head_dim])


@functools.lru_cache(maxsize=None)
def _bwd_sm90_spec(head_dim: int, dtype: str, causal: bool, dropout: bool, block_sparse: bool,
                   tiles: BwdSm90Tiles) -> KernelSpec:
    smem_bytes = tiles.smem_bytes(head_dim)
    name = f"flash_bwd_sm90_hdim{head_dim}_{dtype}{_suffix(causal, dropout, block_sparse)}"
    min_blocks = tiles.min_blocks_dropout if dropout else tiles.min_blocks
    defines = (("FT_HEAD_DIM", head_dim), ("FT_MIN_BLOCKS", min_blocks), ("FT_BF16", int(dtype == "bf16")),
               ("FT_CAUSAL", int(causal)), ("FT_DROPOUT", int(dropout)), ("FT_BLOCK_SPARSE", int(block_sparse)),
               ("FT_SMEM_BYTES", smem_bytes), ("FT_KERNEL_NAME", name))
    return KernelSpec("flash_bwd_sm90.cu", defines, (name,), 32 * tiles.nwarps, smem_bytes, block_m=tiles.block_m,
                      block_n=tiles.block_n, archs=(SM90_ARCH,))


@functools.lru_cache(maxsize=None)
def _bwd_spec(head_dim: int, dtype: str, causal: bool, dropout: bool, block_sparse: bool,
              tiles: BwdTiles) -> KernelSpec:
    name = f"flash_bwd_hdim{head_dim}_{dtype}{_suffix(causal, dropout, block_sparse)}"
    defines = (("FT_HEAD_DIM", head_dim), ("FT_BLOCK_M", tiles.block_m), ("FT_BLOCK_N", tiles.block_n),
               ("FT_NWARPS", tiles.nwarps), ("FT_WARPS_M_SDP", tiles.warps_m_sdp),
               ("FT_WARPS_N_DKV", tiles.warps_n_dkv), ("FT_WARPS_M_DQ", tiles.warps_m_dq),
               ("FT_STAGES", tiles.stages), ("FT_SCRAMBLE_DQ", tiles.scramble_dq),
               ("FT_VEC_ROW_STATS", int(tiles.vec_row_stats)),
               ("FT_BF16", int(dtype == "bf16")), ("FT_CAUSAL", int(causal)), ("FT_DROPOUT", int(dropout)),
               ("FT_BLOCK_SPARSE", int(block_sparse)), ("FT_SMEM_BYTES", tiles.smem_bytes(head_dim)),
               ("FT_KERNEL_NAME", name))
    return KernelSpec("flash_bwd.cu", defines, (name,), 32 * tiles.nwarps, tiles.smem_bytes(head_dim),
                      block_m=tiles.block_m, block_n=tiles.block_n)


@functools.lru_cache(maxsize=None)
def aux_kernels(dtype: str) -> KernelSpec:
    prefix = f"flash_aux_{dtype}"
    symbols = tuple(f"{prefix}_{kind}" for kind in ("preprocess", "convert_dq", "dropout_mask"))
    defines = (("FT_BF16", int(dtype == "bf16")), ("FT_KERNEL_PREFIX", prefix))
    return KernelSpec("flash_aux.cu", defines, symbols, AUX_THREADS, 0)


def all_kernels() -> list[KernelSpec]:
    _check_block_sparse_tiles()
    specs = [aux_kernels(dtype) for dtype in DTYPES]
    for block_sparse, head_dims in ((False, HEAD_DIMS), (True, BLOCK_SPARSE_HEAD_DIMS)):
        for head_dim in head_dims:
            for dtype in DTYPES:
                for causal in (False, True):
                    for dropout in (False, True):
                        specs += [fwd_kernel(head_dim, dtype, causal, dropout, block_sparse),
                                  bwd_kernel(head_dim, dtype, causal, dropout, block_sparse)]
    for sm90_kernel, head_dims in ((fwd_sm90_kernel, FWD_SM90_TILES), (bwd_sm90_kernel, BWD_SM90_TILES)):
        specs += [sm90_kernel(head_dim, dtype, causal, dropout, block_sparse) for head_dim in head_dims
                  for dtype in DTYPES for causal in (False, True) for dropout in (False, True)
                  for block_sparse in (False, True)]
    return specs


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


def compiler_unavailable_reason() -> str | None:
    if nvrtc_version() is None and nvcc_version() is None:
        return ("no CUDA compiler found: neither NVRTC (pip install nvidia-cuda-nvrtc cuda-python) nor nvcc "
                "(CUDA toolkit on PATH or CUDA_HOME)")
    return None


_COMMON_FLAGS = ("-std=c++17",)


def _macro_flags(spec: KernelSpec) -> list[str]:
    return [f"-D{key}={value}" for key, value in spec.defines]


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


def _compile_nvcc(spec: KernelSpec, arch: str, output: Path) -> None:
    command = [nvcc_path(), "-cubin", "-O3", _nvcc_target(arch), *_COMMON_FLAGS, *_macro_flags(spec),
               "-I", str(CSRC), "-o", str(output), str(CSRC / spec.source)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"nvcc failed to compile {spec.name} for {arch}:\n{' '.join(command)}\n{result.stderr}")


def cache_dir() -> Path:
    return Path(os.environ.get("FLASHTRAIN_KERNEL_CACHE", Path.home() / ".cache" / "flashtrain" / "kernels"))


def cubin_path(spec: KernelSpec, arch: str, compiler: str) -> Path:
    version = nvrtc_version() if compiler == "nvrtc" else nvcc_version()
    key = hashlib.sha256(repr((sources_hash(), spec.source, spec.defines, arch, compiler, version,
                               _COMMON_FLAGS)).encode()).hexdigest()[:24]
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
                future.result()
                print(f"[{done}/{len(specs)}] {spec.name} ok ({time.perf_counter() - start:.0f} s)", flush=True)
            except Exception as error:  # report every failure, not only the first
                failures += 1
                print(f"[{done}/{len(specs)}] {spec.name} FAILED\n{error}", file=sys.stderr, flush=True)
    print(f"{len(specs) - failures}/{len(specs)} compiled in {time.perf_counter() - start:.0f} s")
    return 1 if failures else 0


def check_nvcc(archs: list[str], jobs: int, specs: list[KernelSpec] | None = None) -> int:
    """Compile every instantiation (or `specs`) for every arch with nvcc, compile only; 0 when all succeed."""
    if nvcc_path() is None:
        print("nvcc not found", file=sys.stderr)
        return 1
    specs = all_kernels() if specs is None else specs
    with tempfile.TemporaryDirectory() as tmp:
        def compile_one(item):
            spec, arch = item
            _compile_nvcc(spec, arch, Path(tmp) / f"{spec.name}.{arch}.cubin")

        items = [(spec, arch) for arch in archs for spec in specs if spec.supports(arch)]
        wrapped = [dataclasses.replace(spec, symbols=tuple(f"{s}@{arch}" for s in spec.symbols)) for spec, arch in items]
        lookup = dict(zip(wrapped, items))
        return _run_all(wrapped, jobs, lambda spec: compile_one(lookup[spec]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", help="target such as sm_80 or sm_90a (default: the current GPU's)")
    parser.add_argument("--check-nvcc", nargs="+", metavar="ARCH", help="compile everything with nvcc for ARCHs, no cache")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="parallel compilations")
    args = parser.parse_args(argv)
    if args.check_nvcc:
        return check_nvcc(args.check_nvcc, args.jobs)
    arch = args.arch
    if arch is None:
        import torch

        if not torch.cuda.is_available():
            parser.error("no CUDA GPU visible: pass --arch")
        arch = arch_of_capability(*torch.cuda.get_device_capability())
    print(f"prebuilding for {arch} into {cache_dir()}")
    specs = [spec for spec in all_kernels() if spec.supports(arch)]
    return _run_all(specs, args.jobs, lambda spec: compile_kernel(spec, arch))


if __name__ == "__main__":
    sys.exit(main())
