"""Attention kernels: the public entry points, the plain-PyTorch reference, the naive test oracle and the
block-sparse layouts."""

from flashtrain.kernels import block_sparse
from flashtrain.kernels.block_sparse import bigbird, butterfly, fixed_stride, local_window, random_blocks
from flashtrain.kernels.interface import check_cu_seqlens, flash_attn_func, flash_attn_varlen_func
from flashtrain.kernels.naive import naive_attention
from flashtrain.kernels.reference import BLOCK_SPARSE_SIZE, flash_attn_reference

__all__ = [
    "BLOCK_SPARSE_SIZE",
    "bigbird",
    "block_sparse",
    "butterfly",
    "check_cu_seqlens",
    "fixed_stride",
    "flash_attn_func",
    "flash_attn_reference",
    "flash_attn_varlen_func",
    "local_window",
    "naive_attention",
    "random_blocks",
]
