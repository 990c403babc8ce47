"""Bidirectional multi-head self-attention shared by the encoders (BERT/RoBERTa, LRA), on flashtrain's attention API."""

import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from flashtrain.kernels import flash_attn_func, flash_attn_varlen_func


class BidirectionalSelfAttention(nn.Module):
    """Non-causal attention with a fused q|k|v projection (`qkv`) and an output projection (`out`).

    attn_impl "flash" (flashtrain's kernel / reference, impl="auto") | "reference" | "sdpa" (PyTorch's
    scaled_dot_product_attention, the padded baseline).
    """

    def __init__(self, d_model: int, n_head: int, attn_impl: str, attn_dropout: float):
        super().__init__()
        self.n_head = n_head
        self.head_dim = d_model // n_head
        self.attn_impl = attn_impl
        self.attn_dropout = attn_dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)  # output columns [q | k | v]
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor, cu_seqlens: Tensor | None, max_seqlen: int, key_padding_mask: Tensor | None,
                block_mask: Tensor | None = None) -> Tensor:
        """Packed x (total, C) with cu_seqlens (B + 1,) int32 (padding removed), or padded x (B, T, C) with
        cu_seqlens None and key_padding_mask (B, 1, 1, T) bool (True at real tokens; sdpa only) or None (no padding).
        block_mask: None (dense) or the attention API's bool (ceil(max_seqlen / 128),) * 2 (not with sdpa)."""
        dropout_p = self.attn_dropout if self.training else 0.0
        impl = "auto" if self.attn_impl == "flash" else "reference"
        q, k, v = self.qkv(x).unflatten(-1, (3, self.n_head, self.head_dim)).unbind(dim=-3)  # each (..., H, D)
        if cu_seqlens is not None:
            y = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                                       block_mask=block_mask, impl=impl)
        elif self.attn_impl == "sdpa":
            if block_mask is not None:
                raise ValueError("block_mask: attn_impl sdpa takes no block mask; use flash or reference")
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               attn_mask=key_padding_mask, dropout_p=dropout_p).transpose(1, 2)
        else:
            y = flash_attn_func(q, k, v, dropout_p, block_mask=block_mask, impl=impl)  # (B, T, H, D)
        return self.out(y.flatten(-2, -1))  # (..., C)
