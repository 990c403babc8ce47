"""The CUDA driver library (libcuda.so.1) that torch has loaded, through ctypes, for the calls on the per-launch path:
the cuda-python wrappers of the same calls cost several times more host time. launch (cuLaunchKernel,
cuLaunchKernelEx, cuCtxGetCurrent) and tma (cuTensorMapEncodeTiled) both call it; it imports neither."""

from __future__ import annotations

import ctypes
import functools


@functools.lru_cache(maxsize=None)
def libcuda() -> ctypes.CDLL:
    """The CUDA driver library torch has loaded, for the calls on the per-launch path (cuLaunchKernel,
    cuLaunchKernelEx, cuCtxGetCurrent, cuTensorMapEncodeTiled), declared once."""
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernel.restype = ctypes.c_int
    lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    lib.cuLaunchKernelEx.restype = ctypes.c_int  # (config, function, kernel parameters, extra)
    lib.cuLaunchKernelEx.argtypes = [ctypes.c_void_p] * 4
    lib.cuCtxGetCurrent.restype = ctypes.c_int
    lib.cuCtxGetCurrent.argtypes = [ctypes.c_void_p]
    return lib
