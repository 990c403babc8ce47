"""Linformer (Wang et al. 2020, "Linformer: Self-Attention with Linear Complexity"): keys and values are projected
along the sequence onto k rows before exact softmax attention,

    out = softmax(q (E k)^T / sqrt(D)) (F v),   E, F: (k, N) learned, N = the model's longest sequence,

so the score matrix is (N, k) instead of (N, N). Each layer has its own E and F, shared by the heads (the paper's
headwise sharing). A sequence of T <= N tokens uses the first T columns; pad keys and values are zeroed before the
projection, so padding never reaches the output. The (N, k) softmax runs through the model's attention entry with its
attn_impl (flashtrain's kernel or reference, or SDPA), dropout included.
"""

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
import torch.nn as nn
from torch import Tensor

from flashtrain.models.attention import AttentionConfig, attention, check_backend, check_padded


@dataclass
class LinformerConfig(AttentionConfig):
    name: ClassVar[str] = "linformer"
    k: Optional[int] = 256  # projected length (the paper's k); null: the model's max_len // 8

    def __post_init__(self):
        if self.k is not None and self.k < 1:
            raise ValueError(f"attention.k must be >= 1 (or null: max_len // 8), got {self.k}")

    def projected_len(self, max_len: int) -> int:
        return self.k if self.k is not None else max(1, max_len // 8)

    def build(self, *, d_model: int, n_head: int, max_len: int, attn_impl: str) -> nn.Module:
        return Linformer(max_len, self.projected_len(max_len), attn_impl)

    def backend(self, attn_impl: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
        return "linformer, its (N, k) softmax: " + check_backend(attn_impl, device, dtype, head_dim)


class Linformer(nn.Module):
    def __init__(self, max_len: int, k: int, attn_impl: str):
        super().__init__()
        self.attn_impl = attn_impl
        # N(0, 1 / max_len): a projected row sums up to max_len tokens, so its scale stays that of one token's
        self.proj_k = nn.Parameter(torch.randn(k, max_len) / max_len**0.5)  # E: (k, N)
        self.proj_v = nn.Parameter(torch.randn(k, max_len) / max_len**0.5)  # F: (k, N)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, dropout_p: float, cu_seqlens: Tensor | None,
                max_seqlen: int | None, key_padding_mask: Tensor | None, block_mask: Tensor | None) -> Tensor:
        """Padded q, k, v (B, T, H, D), key_padding_mask (B, T) (True at real tokens) or None -> (B, T, H, D)."""
        check_padded("linformer", cu_seqlens, block_mask)
        T = k.shape[1]
        if T > self.proj_k.shape[1]:
            raise ValueError(f"linformer: sequences of {T} tokens, but E and F have {self.proj_k.shape[1]} columns "
                             f"(the model's max_len)")
        if key_padding_mask is not None:  # zero pad keys and values: their columns of E and F then add nothing
            real = key_padding_mask[:, :, None, None].to(k.dtype)  # (B, T, 1, 1)
            k, v = k * real, v * real
        proj_k, proj_v = self.proj_k[:, :T].to(k.dtype), self.proj_v[:, :T].to(v.dtype)  # (k, T)
        k = torch.einsum("nt,bthd->bnhd", proj_k, k)  # (B, k, H, D)
        v = torch.einsum("nt,bthd->bnhd", proj_v, v)
        return attention(q, k, v, self.attn_impl, dropout_p=dropout_p)  # (B, T, H, D)
