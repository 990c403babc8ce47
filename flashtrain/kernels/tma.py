"""TMA tensor maps (CUtensorMap) for the Hopper kernels, encoded on the host by the CUDA driver.

A kernel's tile of q, k or v is a box of a rank-4 tensor map over (head_dim, rows, heads, batch) -- the packed
(varlen) layout is (head_dim, total rows, heads, 1) -- with 64 16-bit columns (128 bytes, the 128-byte swizzle that
csrc/utils.cuh SmemTile uses) by `box_rows` rows. Columns past head_dim and rows past the tensor are zero-filled
by the copy engine.

The encoder is the driver's cuTensorMapEncodeTiled, called through ctypes on the libcuda that torch has already
loaded (cuda_driver.libcuda): the cuda-python wrapper of the same call costs several times more host time, and a
forward encodes three maps. Encoded maps are cached by (address, layout): a training step's activations come back at
the same addresses from PyTorch's caching allocator, so most calls encode nothing.
"""

from __future__ import annotations

import ctypes
import functools
from collections import OrderedDict

import torch
from torch import Tensor

from flashtrain.kernels.cuda_driver import libcuda

_u32, _u64 = ctypes.c_uint32, ctypes.c_uint64


class TmaDesc(ctypes.Structure):
    """csrc/flash.h TmaDesc: 128 opaque bytes (64-byte aligned in the kernel's parameter struct)."""

    _fields_ = [("opaque", _u64 * 16)]


# cuda.h enums
_DTYPES = {torch.float16: 6, torch.bfloat16: 9, torch.float32: 7}  # CU_TENSOR_MAP_DATA_TYPE_FLOAT16 / ...
INTERLEAVE_NONE, SWIZZLE_NONE, SWIZZLE_64B, SWIZZLE_128B, L2_PROMOTION_256B, OOB_FILL_ZERO = 0, 0, 2, 3, 3, 0
BOX_COLS = 64  # 16-bit columns per box: one 128-byte swizzled column block
# (the hd192 backward's K on 96-key tiles: 32-column boxes, 64-byte swizzle; csrc SmemTile's 32-column blocks)
SWIZZLE_OF_BOX_COLS = {64: SWIZZLE_128B, 32: SWIZZLE_64B}
# The L2 fill size of a copy's misses (CU_TENSOR_MAP_L2_PROMOTION_*: 0 none, 1 64 B, 2 128 B, 3 256 B), every map
L2_PROMOTION = L2_PROMOTION_256B


@functools.lru_cache(maxsize=None)
def _encoder():
    encode = libcuda().cuTensorMapEncodeTiled
    encode.restype = ctypes.c_int
    encode.argtypes = [ctypes.c_void_p, ctypes.c_int, _u32, ctypes.c_void_p, ctypes.POINTER(_u64),
                       ctypes.POINTER(_u64), ctypes.POINTER(_u32), ctypes.POINTER(_u32), ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_int]
    return encode


@functools.lru_cache(maxsize=None)
def _error_string():
    return libcuda().cuGetErrorString


_CACHE: OrderedDict[tuple, TmaDesc] = OrderedDict()
_CACHE_SIZE = 512


def layout(x: Tensor, varlen: bool, box_rows: int, box_cols: int = BOX_COLS) -> tuple:
    """What a tensor map of q/k/v-like x encodes besides its address (dtype, dims, byte strides, box columns and
    rows, swizzle), as tensor_map takes it: x (batch, rows, heads, head_dim), or varlen (total rows, heads,
    head_dim); last dim contiguous, 16-byte aligned address and strides (ops._aligned guarantees both). Computed once
    per call signature (a launch plan keeps it). box_cols: 64 (128-byte swizzle) or 32 (64-byte swizzle)."""
    size = x.element_size()
    if varlen:
        total, heads, head_dim = x.shape
        dims = (head_dim, total, heads, 1)
        # the batch dimension has one entry; its stride only has to be valid (16-byte multiple, < 2^40)
        strides = (x.stride(0) * size, x.stride(1) * size, max(16, x.stride(0) * size * max(total, 1)))
    else:
        batch, rows, heads, head_dim = x.shape
        dims = (head_dim, rows, heads, batch)
        strides = (x.stride(1) * size, x.stride(2) * size, x.stride(0) * size)
    # A dimension of size 1 may carry any stride: give it a valid one. Other strides must be valid as they are.
    strides = tuple(s if (s % 16 == 0 and 0 < s < 2**40) or dim > 1 else 16 for s, dim in zip(strides, dims[1:]))
    return _DTYPES[x.dtype], dims, strides, box_cols, box_rows, SWIZZLE_OF_BOX_COLS[box_cols]


def rows_layout(rows: int, arrays: int, box: int) -> tuple:
    """The layout of a tensor map over `arrays` float32 arrays of `rows` values each, back to back (the Hopper
    backward's padded lse_log2 and softmax_d: csrc/flash.h), in boxes of `box` values of one array, unswizzled."""
    stride = rows * 4
    return _DTYPES[torch.float32], (rows, arrays, 1, 1), (stride, stride * arrays, stride * arrays), box, 1, SWIZZLE_NONE


def accum_layout(rows: int, cols: int, box_rows: int) -> tuple:
    """The layout of a tensor map over `rows` float32 rows of `cols` values (the Hopper backward's dq_accum, counted
    from the start of its workspace), in boxes of 32 columns (128 bytes, 128-byte swizzle) by `box_rows` rows."""
    stride = cols * 4
    return _DTYPES[torch.float32], (cols, rows, 1, 1), (stride, stride * rows, stride * rows), 32, box_rows, SWIZZLE_128B


def tensor_map(address: int, map_layout: tuple) -> TmaDesc:
    """The tensor map of the tensor at `address` with `map_layout` (layout()), encoded once per (address, layout):
    a training step's activations come back at the same addresses from PyTorch's caching allocator."""
    key = (address, map_layout, L2_PROMOTION)
    desc = _CACHE.get(key)
    if desc is not None:
        _CACHE.move_to_end(key)
        return desc
    dtype, dims, strides, box_cols, box_rows, swizzle = map_layout
    if not address or min(dims) <= 0:  # an empty tensor has no valid map; plans map none (calls without work)
        raise ValueError(f"a TMA tensor map over an empty tensor (address {address:#x}, dims {dims}): calls without "
                         f"work launch nothing (ops.no_work)")
    desc = TmaDesc()
    result = _encoder()(ctypes.byref(desc), dtype, 4, ctypes.c_void_p(address), (_u64 * 4)(*dims),
                        (_u64 * 3)(*strides), (_u32 * 4)(box_cols, box_rows, 1, 1), (_u32 * 4)(1, 1, 1, 1),
                        INTERLEAVE_NONE, swizzle, L2_PROMOTION, OOB_FILL_ZERO)
    if result != 0:  # e.g. 710: an earlier kernel's device-side assert left the context unusable
        message = ctypes.c_char_p()
        _error_string()(result, ctypes.byref(message))
        raise RuntimeError(f"cuTensorMapEncodeTiled failed: {(message.value or b'').decode()} (CUresult {result}) "
                           f"for a tensor map of dims {dims}, byte strides {strides}, box rows {box_rows}")
    _CACHE[key] = desc
    if len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return desc
