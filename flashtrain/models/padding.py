"""Padding removal for the encoders: a right-padded batch (B, T, ...) <-> the packed real tokens (total, ...).

Every layer then runs on the packed tokens only and attention takes them with cu_seqlens (flash_attn_varlen_func),
so no work is spent on padding (flash-attention's bert_padding.py does the same).
"""

import torch
import torch.nn.functional as F
from torch import Tensor


def unpad_indices(attention_mask: Tensor) -> tuple[Tensor, Tensor, int]:
    """attention_mask (B, T), nonzero at real tokens -> (indices, cu_seqlens, max_seqlen).

    indices (total,) int64: positions of the real tokens in the flattened (B * T) batch, row-major, so the packed
    rows of sequence b are cu_seqlens[b]:cu_seqlens[b + 1]. cu_seqlens (B + 1,) int32. max_seqlen: a Python int
    (one host sync).
    """
    is_real = attention_mask.bool()
    seqlens = is_real.sum(dim=1, dtype=torch.int32)  # (B,)
    indices = torch.nonzero(is_real.flatten()).flatten()  # (total,)
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))  # (B + 1,)
    return indices, cu_seqlens, int(seqlens.max())


def pad_packed(packed: Tensor, indices: Tensor, batch: int, seqlen: int) -> Tensor:
    """packed (total, ...) -> (batch, seqlen, ...) with zeros at pad positions; inverse of x.flatten(0, 1)[indices]."""
    padded = packed.new_zeros(batch * seqlen, *packed.shape[1:]).index_copy(0, indices, packed)
    return padded.view(batch, seqlen, *packed.shape[1:])
