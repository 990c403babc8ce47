"""Attention kernels: the public entry points, the plain-PyTorch reference and the naive test oracle."""

from flashtrain.kernels.interface import flash_attn_func, flash_attn_varlen_func
from flashtrain.kernels.naive import naive_attention
from flashtrain.kernels.reference import BLOCK_SPARSE_SIZE, flash_attn_reference

__all__ = [
    "BLOCK_SPARSE_SIZE",
    "flash_attn_func",
    "flash_attn_reference",
    "flash_attn_varlen_func",
    "naive_attention",
]
