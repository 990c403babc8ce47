"""Load the cubins built by flashtrain.kernels.build through NVIDIA's cuda-python driver bindings
(cuda.bindings.driver), and launch them on the current torch stream from Python: the launch plans (ops.py) hold the
loaded kernels; the C++ host layer launches them on every call, the Python executor here (tests' reference, and
dropout_mask_for_testing).

The ctypes structs below mirror csrc/flash.h field by field (8-byte fields first, then 4-byte ones; FwdParams' block-
sparse fields come after an even number of 4-byte ones, then total_q / total_k); each kernel takes one such struct by
value.
"""

from __future__ import annotations

import ctypes
import threading

import torch
from cuda.bindings import driver

from flashtrain.kernels import build
from flashtrain.kernels.cuda_driver import libcuda
from flashtrain.kernels.tma import TmaDesc

_i64, _i32, _u32, _f32, _ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_uint32, ctypes.c_float, ctypes.c_void_p


class MaskModParams(ctypes.Structure):
    """csrc/flash.h MaskModParams."""

    _fields_ = [("ptr", _ptr * 4), ("size", (_i64 * 4) * 4), ("stride", (_i64 * 4) * 4), ("error", _ptr)]


class FwdParams(ctypes.Structure):
    _fields_ = [
        ("q", _ptr), ("k", _ptr), ("v", _ptr), ("out", _ptr), ("lse", _ptr),
        ("cu_seqlens_q", _ptr), ("cu_seqlens_k", _ptr), ("rng_state", _ptr),
        ("q_batch_stride", _i64), ("q_row_stride", _i64), ("q_head_stride", _i64),
        ("k_batch_stride", _i64), ("k_row_stride", _i64), ("k_head_stride", _i64),
        ("v_batch_stride", _i64), ("v_row_stride", _i64), ("v_head_stride", _i64),
        ("o_batch_stride", _i64), ("o_row_stride", _i64), ("o_head_stride", _i64),
        ("lse_batch_stride", _i64), ("lse_head_stride", _i64),
        ("batch", _i32), ("nheads", _i32), ("nheads_kv", _i32), ("head_dim", _i32),
        ("seqlen_q", _i32), ("seqlen_k", _i32),
        ("softmax_scale", _f32), ("softmax_scale_log2", _f32), ("keep_threshold", _u32), ("rp_dropout", _f32),
        ("bs_n_qblocks", _i32), ("bs_n_kblocks", _i32),
        ("bs_rows", _ptr), ("bs_cols", _ptr), ("bs_rows_head_stride", _i64), ("bs_cols_head_stride", _i64),
        ("total_q", _i32), ("total_k", _i32), ("causal_tile_group", _i32), ("pad_", _i32),
        ("window_left", _i32), ("window_right", _i32), ("softcap_scale", _f32), ("softcap_unscale", _f32),
        ("alibi_slopes", _ptr), ("alibi_batch_stride", _i64),
        ("mm", MaskModParams), ("mm_states", _ptr), ("mm_states_b_stride", _i64), ("mm_states_h_stride", _i64),
        ("mm_n_kblocks", _i32), ("mm_n_qblocks", _i32),
    ]


class FwdSm90Params(ctypes.Structure):
    """csrc/flash.h FwdSm90Params: four 128-byte tensor maps (q, k, v, out), FwdParams (from 512), the tile counter,
    the tail split's fields, then padding to a multiple of the struct's 64-byte alignment (the driver copies that many
    bytes)."""

    _fields_ = [("tma_q", TmaDesc), ("tma_k", TmaDesc), ("tma_v", TmaDesc), ("tma_o", TmaDesc), ("fwd", FwdParams),
                ("tile_counter", _ptr), ("tail_partials", _ptr), ("tail_counters", _ptr), ("tail_first", _i32),
                ("tail_pieces", _i32),
                ("pad_", ctypes.c_uint8 * (-(4 * ctypes.sizeof(TmaDesc) + ctypes.sizeof(FwdParams) + 32) % 64))]


class BwdParams(ctypes.Structure):
    _fields_ = [
        ("fwd", FwdParams),
        ("dout", _ptr), ("dk", _ptr), ("dv", _ptr), ("dq_accum", _ptr), ("softmax_d", _ptr),
        ("do_batch_stride", _i64), ("do_row_stride", _i64), ("do_head_stride", _i64),
        ("dk_batch_stride", _i64), ("dk_row_stride", _i64), ("dk_head_stride", _i64),
        ("dv_batch_stride", _i64), ("dv_row_stride", _i64), ("dv_head_stride", _i64),
        ("dqa_split_stride", _i64), ("dqa_batch_stride", _i64), ("dqa_head_stride", _i64),
        ("deterministic", _i32),
        ("dq_semaphore", _ptr), ("dq_sem_mblocks", _i32), ("dq_map_row0", _i32),
        ("dkv_accum", _ptr), ("dkv_split_stride", _i64), ("dkv_batch_stride", _i64), ("dkv_head_stride", _i64),
        ("kv_splits", _i32), ("dkv_cols", _i32),
        ("tail_partials", _ptr), ("tail_counters", _ptr), ("tail_first", _i32), ("tail_pieces", _i32),
        ("dq", _ptr), ("dq_batch_stride", _i64), ("dq_row_stride", _i64), ("dq_head_stride", _i64),
        ("dq_counts", _ptr), ("dq_counts_head_stride", _i32),
    ]


class BwdSm90Params(ctypes.Structure):
    """csrc/flash.h BwdSm90Params: eight 128-byte tensor maps (q, k, v, dout, dk, dv, stats, dq), BwdParams (from 1024),
    the tile counter, then padding to a multiple of the struct's 64-byte alignment."""

    _fields_ = [("tma_q", TmaDesc), ("tma_k", TmaDesc), ("tma_v", TmaDesc), ("tma_do", TmaDesc), ("tma_dk", TmaDesc),
                ("tma_dv", TmaDesc), ("tma_stats", TmaDesc), ("tma_dq", TmaDesc), ("bwd", BwdParams),
                ("tile_counter", _ptr),
                ("pad_", ctypes.c_uint8 * (-(8 * ctypes.sizeof(TmaDesc) + ctypes.sizeof(BwdParams) + 8) % 64))]


class AuxParams(ctypes.Structure):
    _fields_ = [
        ("out", _ptr), ("dout", _ptr), ("dq", _ptr), ("softmax_d", _ptr), ("dq_accum", _ptr), ("dropout_mask", _ptr),
        ("cu_seqlens_q", _ptr), ("cu_seqlens_k", _ptr), ("rng_state", _ptr),
        ("lse", _ptr), ("lse_log2", _ptr), ("dlse", _ptr),
        ("o_batch_stride", _i64), ("o_row_stride", _i64), ("o_head_stride", _i64),
        ("do_batch_stride", _i64), ("do_row_stride", _i64), ("do_head_stride", _i64),
        ("dq_batch_stride", _i64), ("dq_row_stride", _i64), ("dq_head_stride", _i64),
        ("d_batch_stride", _i64), ("d_head_stride", _i64), ("lse_batch_stride", _i64), ("lse_head_stride", _i64),
        ("dqa_split_stride", _i64), ("dqa_batch_stride", _i64), ("dqa_head_stride", _i64),
        ("mask_batch_stride", _i64), ("mask_head_stride", _i64), ("mask_row_stride", _i64),
        ("batch", _i32), ("nheads", _i32), ("head_dim", _i32), ("seqlen_q", _i32), ("seqlen_k", _i32),
        ("nsplits", _i32), ("softmax_scale", _f32), ("keep_threshold", _u32),
        ("dq_slice_width", _i32), ("dq_block_m", _i32), ("total_q", _i32), ("total_k", _i32),
        ("dqa_cols", _i32), ("padded", _i32), ("dq_frag", _i32), ("lse_bias", _i32),
        ("fused_dq", _i32), ("dq_counts", _ptr), ("dq_counts_head_stride", _i32),
    ]


class CeParams(ctypes.Structure):
    """csrc/cross_entropy.cu CeParams."""

    _fields_ = [
        ("logits", _ptr), ("targets", _ptr), ("lse", _ptr), ("loss", _ptr), ("grad", _ptr), ("scale", _ptr),
        ("row_stride", _i64), ("grad_row_stride", _i64), ("ignore_index", _i64),
        ("rows", _i32), ("vocab", _i32), ("width", _i32), ("vectorized", _i32),
    ]


class MaskBlocksParams(ctypes.Structure):
    """csrc/mask_blocks.cu MaskBlocksParams."""

    _fields_ = [
        ("mm", MaskModParams), ("states", _ptr), ("cu_seqlens_q", _ptr), ("cu_seqlens_k", _ptr),
        ("heads", _i32), ("seqlen_q", _i32), ("seqlen_k", _i32), ("n_qblocks", _i32), ("n_kblocks", _i32),
        ("block", _i32), ("window_left", _i32), ("window_right", _i32),
    ]


def _check(result, what: str):
    """cuda.bindings calls return (error, *values): raise on error, return the values."""
    err, *values = result
    if err != driver.CUresult.CUDA_SUCCESS:  # e.g. "CUDA_ERROR_ASSERT (device-side assert triggered)"
        _, name = driver.cuGetErrorName(err)
        _, text = driver.cuGetErrorString(err)
        raise RuntimeError(f"{what} failed: {name.decode() if name else err} ({text.decode() if text else '?'})")
    return values[0] if len(values) == 1 else values


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # CUDA builds of torch


def _current_stream(device: torch.device) -> int:
    """torch.cuda.current_stream(device).cuda_stream, without building a Stream object (host time per launch)."""
    return _raw_stream(device.index) if _raw_stream is not None else torch.cuda.current_stream(device).cuda_stream


class _LaunchAttribute(ctypes.Structure):  # cuda.h CUlaunchAttribute: a 4-byte id, a 64-byte value at offset 8
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):  # cuda.h CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attributes", ctypes.POINTER(_LaunchAttribute)),
                ("attribute_count", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class Kernel:
    """One loaded kernel: a CUfunction plus its block size and dynamic shared memory."""

    def __init__(self, function, threads: int, smem_bytes: int):
        self.function, self.threads, self.smem_bytes = function, threads, smem_bytes
        self.handle = ctypes.c_void_p(int(function))  # the CUfunction for ctypes calls
        self.tile_counters = 0  # persistent kernels: device address of their module's tile counters
        if smem_bytes > 48 * 1024:  # above 48 KB a kernel must opt in to its dynamic shared memory
            _check(driver.cuFuncSetAttribute(
                function, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_bytes),
                "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)")

    def launch(self, grid: tuple[int, int, int], params: ctypes.Structure, device: torch.device) -> None:
        self.launch_on(grid, params, stream_of(device))

    def launch_on(self, grid: tuple[int, int, int], params: ctypes.Structure, stream: int, pdl: bool = False) -> None:
        """Launch on `stream` (stream_of's handle: the device's context already current on this thread); an empty
        grid launches nothing. pdl: a programmatic dependent launch (ops._Launch.pdl)."""
        if min(grid) <= 0:
            return
        args = (ctypes.c_void_p * 1)(ctypes.addressof(params))
        if pdl:
            attribute = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
            config = _LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(self.threads, 1, 1),
                                   self.smem_bytes, stream, ctypes.pointer(attribute), 1)
            result = libcuda().cuLaunchKernelEx(ctypes.addressof(config), self.handle, ctypes.addressof(args), None)
            if result != 0:
                _check((driver.CUresult(result),), "cuLaunchKernelEx")
            return
        # the driver's cuLaunchKernel through ctypes: the cuda-python wrapper of the same call costs several times
        # more host time, which small attention calls feel (benchmarks/host_overhead.py)
        result = libcuda().cuLaunchKernel(self.handle, *grid, self.threads, 1, 1, self.smem_bytes, stream,
                                          ctypes.addressof(args), None)
        if result != 0:
            _check((driver.CUresult(result),), "cuLaunchKernel")


def stream_of(device: torch.device) -> int:
    """The current torch stream of `device`, with the device's context made current on this thread: call once per
    attention op, then launch its kernels with Kernel.launch_on."""
    _make_current(device.index)
    return _current_stream(device)


_lock = threading.RLock()
_contexts: dict[int, driver.CUcontext] = {}  # device index -> primary context (the one torch uses)
_modules: dict[tuple[int, str], driver.CUmodule] = {}  # (device index, spec name) -> loaded cubin
_kernels: dict[tuple[int, str], Kernel] = {}  # (device index, symbol) -> kernel


def _make_current(device_index: int) -> None:
    """Make the device's primary context current on this thread (autograd runs backward on its own threads)."""
    context = _contexts.get(device_index)
    if context is None:
        with _lock:
            torch.cuda.init()
            device = _check(driver.cuDeviceGet(device_index), "cuDeviceGet")
            context = _contexts.setdefault(device_index, _check(driver.cuDevicePrimaryCtxRetain(device),
                                                                "cuDevicePrimaryCtxRetain"))
    current = ctypes.c_void_p()
    if libcuda().cuCtxGetCurrent(ctypes.byref(current)) != 0 or current.value != int(context):
        _check(driver.cuCtxSetCurrent(context), "cuCtxSetCurrent")


_archs: dict[int, str] = {}  # device index -> compile target


def device_arch(device: torch.device) -> str:
    """The compile target of a CUDA device ('sm_90a' on Hopper; build.arch_of_capability)."""
    arch = _archs.get(device.index)
    if arch is None:
        arch = _archs.setdefault(device.index, build.arch_of_capability(*torch.cuda.get_device_capability(device)))
    return arch


_sm_counts: dict[int, int] = {}  # device index -> multiprocessors


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (persistent grids), read once."""
    count = _sm_counts.get(device.index)
    if count is None:
        count = _sm_counts.setdefault(device.index, torch.cuda.get_device_properties(device).multi_processor_count)
    return count


_l2_bytes: dict[int, int] = {}  # device index -> bytes of L2 cache


def l2_bytes(device: torch.device) -> int:
    """Bytes of L2 cache of a CUDA device (the dispatch's memory-system rules, build.SMALL_L2_BYTES), read once."""
    size = _l2_bytes.get(device.index)
    if size is None:
        size = _l2_bytes.setdefault(device.index, torch.cuda.get_device_properties(device).L2_cache_size)
    return size


_stream_slots: dict[tuple[int, int], int] = {}  # (device index, stream handle) -> tile counter slot


def tile_counter(kernel: "Kernel", device: torch.device, stream: int | None = None) -> int:
    """Address of the dynamic tile scheduler's counter of `kernel` for `stream` (default: the current stream of
    `device`; csrc/flash_fwd_sm90.cu flashtrain_tile_counters): zero when the module loads, reset to 0 by every
    launch, one slot per stream so that concurrent launches never share one."""
    key = (device.index, _current_stream(device) if stream is None else stream)
    slot = _stream_slots.get(key)
    if slot is None:
        with _lock:
            slot = _stream_slots.setdefault(key, sum(k[0] == device.index for k in _stream_slots))
    if slot >= build.MAX_STREAMS:
        raise RuntimeError(f"the persistent Hopper kernels ran on more than build.MAX_STREAMS = {build.MAX_STREAMS} "
                           f"CUDA streams of cuda:{device.index} in this process (one tile counter each)")
    return kernel.tile_counters + 4 * slot


# Called with no arguments when a device's shared-memory limit changes: ops.load_host adds the C++ executor's
# clear_host_plans (this module is below ops and does not import it).
smem_limit_listeners: list = []


class _SmemLimits(dict):
    """device index -> shared memory per block the kernels may use. Launch plans depend on it: a change (tests lower
    it) makes the C++ executor forget its plans (smem_limit_listeners; the Python executor's keys include the
    limit)."""

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        for listener in smem_limit_listeners:
            listener()

    def __delitem__(self, key):
        super().__delitem__(key)
        for listener in smem_limit_listeners:
            listener()


_smem_limits: dict[int, int] = _SmemLimits()


def device_smem_limit(device: torch.device) -> int:
    """Bytes of shared memory a block may opt in to on `device` (cuDeviceGetAttribute
    MAX_SHARED_MEMORY_PER_BLOCK_OPTIN), lowered to FLASHTRAIN_MAX_SMEM when that is set; read once per device."""
    limit = _smem_limits.get(device.index)
    if limit is None:
        torch.cuda.init()
        handle = _check(driver.cuDeviceGet(device.index), "cuDeviceGet")
        attribute = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
        limit = _check(driver.cuDeviceGetAttribute(attribute, handle), "cuDeviceGetAttribute(SMEM_PER_BLOCK_OPTIN)")
        cap = build.smem_cap()
        limit = _smem_limits.setdefault(device.index, min(limit, cap) if cap is not None else limit)
    return limit


def get_kernel(spec: build.KernelSpec, symbol: str, device: torch.device) -> Kernel:
    """The kernel `symbol` of `spec` loaded on `device`, compiling its cubin on first use (then cached on disk)."""
    key = (device.index, symbol)
    kernel = _kernels.get(key)
    if kernel is not None:
        return kernel
    with _lock:
        if key not in _kernels:
            module_key = (device.index, spec.name)
            if module_key not in _modules:
                cubin = build.compile_kernel(spec, device_arch(device))
                _make_current(device.index)
                _modules[module_key] = _check(driver.cuModuleLoadData(cubin), f"cuModuleLoadData({spec.name})")
            function = _check(driver.cuModuleGetFunction(_modules[module_key], symbol.encode()),
                              f"cuModuleGetFunction({symbol})")
            kernel = Kernel(function, spec.threads, spec.smem_bytes)
            if spec.persistent:
                counters, _ = _check(driver.cuModuleGetGlobal(_modules[module_key], b"flashtrain_tile_counters"),
                                     "cuModuleGetGlobal(flashtrain_tile_counters)")
                kernel.tile_counters = int(counters)
            _kernels[key] = kernel
    return _kernels[key]
