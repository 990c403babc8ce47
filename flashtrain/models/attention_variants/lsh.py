"""Reformer's LSH attention (Kitaev et al. 2020, "Reformer: The Efficient Transformer"): each query attends, with
exact softmax, only to the keys that fall in its hash bucket, found by sorting instead of comparing every pair.

Shared QK: the keys are the unit-normalised queries (k_j = q_j / |q_j|; the layer's key projection is not used), so a
query and its nearest keys hash alike. Per hashing round r (num_hashes of them), with a random rotation R_r (D, b / 2)
drawn once per layer (a buffer) and b = num_buckets:

    bucket_r(x) = argmax([x R_r, -x R_r])                    (angular LSH: close directions share a bucket)
    order       positions sorted by (bucket_r, position), pads last, cut into chunks of chunk_len
    visible     query i sees key j iff bucket_r(i) == bucket_r(j), j is real, and j's chunk is i's chunk or the one
                before it (chunk 0's "before" is the last chunk)
    scores      q_i . k_j / sqrt(D); a query's own key scores -1e5 (used only when it sees nothing else)
    out_r, lse_r  softmax attention over the visible keys, and the log of its normaliser

and the rounds combine as out_i = sum_r exp(lse_r(i) - logsumexp_r lse_r(i)) out_r(i) (a key seen in several rounds
counts in each). Scores and softmax in float32 (float64 for float64 inputs); dropout drops probabilities; a query that
sees no key (a pad query) outputs 0. Time and memory: T * 2 chunk_len scores per round and head.
"""

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from flashtrain.models.attention import AttentionConfig, check_padded

SELF_SCORE = -1e5  # Reformer's score for a query's own key


@dataclass
class LSHAttentionConfig(AttentionConfig):
    name: ClassVar[str] = "lsh"
    num_hashes: int = 2  # hashing rounds
    num_buckets: int = 64  # buckets per round (even)
    chunk_len: int = 64  # sorted positions per chunk; a chunk attends to itself and the chunk before

    def __post_init__(self):
        for name in ("num_hashes", "num_buckets", "chunk_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"attention.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_buckets % 2:
            raise ValueError(f"attention.num_buckets must be even (argmax over [xR, -xR]), got {self.num_buckets}")

    def build(self, *, d_model: int, n_head: int, max_len: int, attn_impl: str) -> nn.Module:
        return LSHAttention(d_model // n_head, self.num_hashes, self.num_buckets, self.chunk_len)


class LSHAttention(nn.Module):
    def __init__(self, head_dim: int, num_hashes: int, num_buckets: int, chunk_len: int):
        super().__init__()
        self.num_buckets, self.chunk_len = num_buckets, chunk_len
        self.register_buffer("rotations", torch.randn(num_hashes, head_dim, num_buckets // 2))  # (R, D, b / 2)

    def buckets(self, x: Tensor) -> Tensor:
        """x (B, T, H, D) -> bucket of each position in each round, int64 (B, H, R, T)."""
        rotated = torch.einsum("bthd,rdn->bhrtn", x, self.rotations.to(x.dtype))
        return torch.cat([rotated, -rotated], dim=-1).argmax(dim=-1)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, dropout_p: float, cu_seqlens: Tensor | None,
                max_seqlen: int | None, key_padding_mask: Tensor | None, block_mask: Tensor | None) -> Tensor:
        """Padded q, k, v (B, T, H, D), key_padding_mask (B, T) (True at real tokens) or None -> (B, T, H, D).
        k is not used (shared QK)."""
        check_padded("lsh", cu_seqlens, block_mask)
        B, T, H, D = q.shape
        num_chunks = math.ceil(T / self.chunk_len)
        length = num_chunks * self.chunk_len  # L: positions from T on are pads
        real = q.new_ones(B, T, dtype=torch.bool) if key_padding_mask is None else key_padding_mask
        real = F.pad(real, (0, length - T))  # (B, L)
        # pads get bucket num_buckets: they sort after every real token, whose chunks then do not depend on padding
        buckets = F.pad(self.buckets(q), (0, length - T)).masked_fill(~real[:, None, None], self.num_buckets)
        order = (buckets * length + torch.arange(length, device=q.device)).argsort(dim=-1)  # slot -> position

        def chunked(x: Tensor) -> Tensor:
            return x.unflatten(3, (num_chunks, self.chunk_len))  # (B, H, R, L, ...) -> (B, H, R, n, c, ...)

        def sorted_rows(x: Tensor) -> Tensor:  # (B, T, H, D) -> each round's sorted order (B, H, R, n, c, D)
            x = F.pad(x.transpose(1, 2), (0, 0, 0, length - T))  # (B, H, L, D)
            index = order[..., None].expand(*order.shape, D)
            return chunked(x[:, :, None].expand(-1, -1, order.shape[2], -1, -1).gather(3, index))

        def with_previous(x: Tensor) -> Tensor:  # (B, H, R, n, c, ...) -> chunk, then the one before: 2c rows
            return torch.cat([x, x.roll(1, dims=3)], dim=4)

        queries, values = sorted_rows(q), with_previous(sorted_rows(v))  # (B, H, R, n, c | 2c, D)
        keys = with_previous(F.normalize(queries, dim=-1))
        query_bucket, query_pos = chunked(buckets.gather(-1, order)), chunked(order)  # (B, H, R, n, c)
        query_real = chunked(real[:, None, None].expand_as(order).gather(-1, order))
        key_bucket, key_pos, key_real = (with_previous(x) for x in (query_bucket, query_pos, query_real))

        visible = (query_bucket[..., :, None] == key_bucket[..., None, :]) & key_real[..., None, :]  # (.., c, 2c)
        sees_key = visible.any(dim=-1, keepdim=True)
        compute = torch.promote_types(q.dtype, torch.float32)
        scores = (queries @ keys.transpose(-1, -2)).to(compute) * D**-0.5  # (B, H, R, n, c, 2c)
        scores = scores.masked_fill(query_pos[..., :, None] == key_pos[..., None, :], SELF_SCORE)
        # rows that see no key get finite dummy scores (no NaN forward or backward), then probabilities 0
        scores = scores.masked_fill(~visible, -math.inf).masked_fill(~sees_key, 0.0)
        lse = scores.logsumexp(dim=-1, keepdim=True)  # (..., c, 1)
        probs = (torch.exp(scores - lse) * sees_key).to(v.dtype)
        if dropout_p > 0:
            probs = F.dropout(probs, dropout_p)
        out = (probs @ values).flatten(3, 4)  # (B, H, R, L, D), sorted order
        lse = lse.masked_fill(~sees_key, -math.inf).flatten(3, 5)  # (B, H, R, L)

        unsort = order.argsort(dim=-1)  # position -> slot
        out = out.gather(3, unsort[..., None].expand(*unsort.shape, D))
        lse = lse.gather(-1, unsort)
        # rounds weighted by their share of the total normaliser; a query no round gave a key to outputs 0
        seen = (lse > -math.inf).any(dim=2, keepdim=True)  # (B, H, 1, L)
        weights = torch.softmax(lse.masked_fill(~seen, 0.0), dim=2) * seen  # (B, H, R, L)
        out = (weights[..., None].to(out.dtype) * out).sum(dim=2)[:, :, :T]  # (B, H, T, D)
        return out.transpose(1, 2)  # (B, T, H, D)
