"""Local (sliding-window) attention: query i attends, with exact softmax, to the real keys j with |i - j| <= window
(2 window + 1 positions), as the local attention of Longformer (Beltagy et al. 2020) and of LRA's "Local Attention"
baseline, at token granularity (the block-sparse layouts are the 128-token-block version that runs on our kernel).

Computed in chunks of c = window queries: chunk b's queries can only see keys of chunks b - 1, b and b + 1, so the
scores are (T / c, c, 3 c) per sequence and head, never (T, T): time and memory linear in T. The band, the sequence
end and the key-padding mask are applied to those scores; the softmax is in float32 (float64 for float64 inputs);
dropout drops probabilities. A query that sees no key (a pad query whose window holds only pads) outputs 0.
"""

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from flashtrain.models.attention import AttentionConfig, check_padded


@dataclass
class LocalAttentionConfig(AttentionConfig):
    name: ClassVar[str] = "local"
    window: int = 128  # query i sees the keys j with |i - j| <= window

    def __post_init__(self):
        if self.window < 0:
            raise ValueError(f"attention.window must be >= 0, got {self.window}")

    def build(self, *, d_model: int, n_head: int, max_len: int, attn_impl: str) -> nn.Module:
        return LocalAttention(self.window)


def chunk_windows(x: Tensor, chunk: int, num_chunks: int) -> Tensor:
    """x (B, H, T, ...) -> (B, H, num_chunks, 3 chunk, ...): for chunk b, the rows [(b - 1) chunk, (b + 2) chunk) of x,
    zero-filled outside [0, T)."""
    T = x.shape[2]
    trailing = [0, 0] * (x.dim() - 3)
    padded = F.pad(x, (*trailing, chunk, (num_chunks + 1) * chunk - T))  # (B, H, (num_chunks + 2) chunk, ...)
    windows = padded.unfold(2, 3 * chunk, chunk)  # (B, H, num_chunks, ..., 3 chunk)
    return windows.movedim(-1, 3)


class LocalAttention(nn.Module):
    def __init__(self, window: int):
        super().__init__()
        self.window = window

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, dropout_p: float, cu_seqlens: Tensor | None,
                max_seqlen: int | None, key_padding_mask: Tensor | None, block_mask: Tensor | None) -> Tensor:
        """Padded q, k, v (B, T, H, D), key_padding_mask (B, T) (True at real tokens) or None -> (B, T, H, D)."""
        check_padded("local", cu_seqlens, block_mask)
        B, T, H, D = q.shape
        chunk = max(self.window, 1)
        num_chunks = math.ceil(T / chunk)
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # (B, H, T, D)
        queries = F.pad(q, (0, 0, 0, num_chunks * chunk - T)).unflatten(2, (num_chunks, chunk))  # (B, H, n, c, D)
        keys, values = chunk_windows(k, chunk, num_chunks), chunk_windows(v, chunk, num_chunks)  # (B, H, n, 3c, D)

        # positions: query i = b c + r, key j = (b - 1) c + s
        query_pos = torch.arange(num_chunks * chunk, device=q.device).view(num_chunks, chunk, 1)  # (n, c, 1)
        key_pos = (torch.arange(num_chunks, device=q.device)[:, None] * chunk - chunk
                   + torch.arange(3 * chunk, device=q.device))[:, None, :]  # (n, 1, 3c)
        visible = ((query_pos - key_pos).abs() <= self.window) & (key_pos >= 0) & (key_pos < T)  # (n, c, 3c)
        if key_padding_mask is not None:
            real = chunk_windows(key_padding_mask[:, None, :, None], chunk, num_chunks)  # (B, 1, n, 3c, 1)
            visible = visible & real.transpose(-1, -2)  # (B, 1, n, c, 3c)
        sees_key = visible.any(dim=-1, keepdim=True)  # (..., n, c, 1)

        scores = queries @ keys.transpose(-1, -2) * D**-0.5  # (B, H, n, c, 3c)
        # rows that see no key get finite dummy scores (no NaN forward or backward), then probabilities 0
        scores = scores.masked_fill(~visible, -math.inf).masked_fill(~sees_key, 0.0)
        probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
        probs = (probs * sees_key).to(v.dtype)
        if dropout_p > 0:
            probs = F.dropout(probs, dropout_p)
        out = (probs @ values).flatten(2, 3)[:, :, :T]  # (B, H, T, D)
        return out.transpose(1, 2)  # (B, T, H, D)
