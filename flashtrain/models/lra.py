"""Long Range Arena classifier: a Transformer encoder over token ids, pooled to one vector, then an MLP head.

Pre-LN blocks (x + attn(LN(x)), x + mlp(LN(x)), a final LN), as LRA's own Transformer encoder, and more stable at
LRA's high learning rates than post-LN. Positions are learned or fixed sinusoids. Pooling is "cls" (a learned
vector prepended at position 0, read out at the end) or "mean" (the mean over real tokens only). The head is
LRA's: Linear(d_model, d_ff) -> ReLU -> Linear(d_ff, num_classes).

Padding is removed, not masked (as in bert.py): with a pad_id, the real tokens are packed into (total, d_model) and
attend through flash_attn_varlen_func; pad tokens cost nothing and never reach the pooled vector. Inputs are
right-padded, so positions of real tokens do not depend on the padding. pad_id None means every token is real
(Pathfinder: pixel 0 is black, not padding) and attention runs on (B, T) through flash_attn_func.
attn_impl="sdpa" is the padded baseline: PyTorch's scaled_dot_product_attention with a key-padding mask.
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from flashtrain.models.attention import BidirectionalSelfAttention
from flashtrain.models.bert import unpad_indices

ATTN_IMPLS = ("flash", "sdpa", "reference")
POSITIONS = ("learned", "sinusoidal")
POOLINGS = ("cls", "mean")


@dataclass
class LRAConfig:
    vocab_size: int = 16  # token ids (ListOps: 16; pixel tasks: 256)
    max_len: int = 2048  # rows of the position table; pooling "cls" takes one, so inputs are up to max_len - 1
    n_layer: int = 4  # encoder blocks
    n_head: int = 8  # attention heads; head_dim = d_model // n_head
    d_model: int = 512  # model width
    d_ff: int = 1024  # width of the MLP in each block and of the classifier head
    dropout: float = 0.1  # on embeddings, on each residual branch and in the head
    attn_dropout: float = 0.1  # on attention probabilities, training only
    positions: str = "sinusoidal"  # "learned" | "sinusoidal" (fixed)
    pooling: str = "cls"  # "cls" (prepended learned token) | "mean" (over real tokens)
    num_classes: int = 10  # outputs of the head
    pad_id: Optional[int] = 0  # padding token id, removed before attention; None: no padding, every token is real
    layer_norm_eps: float = 1e-6  # LayerNorm epsilon (Flax's default, as LRA)
    attn_impl: str = "flash"  # "flash" (flashtrain kernel, "auto" dispatch) | "sdpa" (PyTorch, padded) | "reference"

    def __post_init__(self):
        for name, value, allowed in (("attn_impl", self.attn_impl, ATTN_IMPLS), ("positions", self.positions, POSITIONS),
                                     ("pooling", self.pooling, POOLINGS)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        for name in ("vocab_size", "max_len", "n_layer", "n_head", "d_model", "d_ff"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_head != 0:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if self.num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {self.num_classes}")
        if self.pad_id is not None and not 0 <= self.pad_id < self.vocab_size:
            raise ValueError(f"pad_id must be None or in [0, vocab_size={self.vocab_size}), got {self.pad_id}")
        for name in ("dropout", "attn_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")

    @property
    def max_tokens(self) -> int:
        """Longest input, padding included."""
        return self.max_len - (self.pooling == "cls")


def sinusoidal_positions(n_positions: int, dim: int) -> Tensor:
    """(n_positions, dim) float32, Vaswani et al.'s table (as LRA's fixed positions): column 2i is
    sin(t / 10000^(2i / dim)), column 2i + 1 the cos of the same angle."""
    inv_freq = torch.exp(-math.log(10000.0) * torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # (ceil(dim/2),)
    angles = torch.arange(n_positions, dtype=torch.float64)[:, None] * inv_freq  # (n_positions, ceil(dim/2))
    table = torch.zeros(n_positions, dim, dtype=torch.float64)
    table[:, 0::2], table[:, 1::2] = torch.sin(angles), torch.cos(angles[:, :dim // 2])
    return table.float()


class Block(nn.Module):
    def __init__(self, config: LRAConfig):
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.attn = BidirectionalSelfAttention(config.d_model, config.n_head, config.attn_impl, config.attn_dropout)
        self.mlp_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.mlp = nn.Sequential(nn.Linear(config.d_model, config.d_ff), nn.GELU(), nn.Dropout(config.dropout),
                                 nn.Linear(config.d_ff, config.d_model))
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, cu_seqlens: Tensor | None, max_seqlen: int, key_padding_mask: Tensor | None) -> Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x), cu_seqlens, max_seqlen, key_padding_mask))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


class LRAClassifier(nn.Module):
    def __init__(self, config: LRAConfig):
        super().__init__()
        self.config = config
        C = config.d_model
        self.tok_emb = nn.Embedding(config.vocab_size, C)
        # learned: an nn.Embedding, so optim.decay_embeddings decides its weight decay; fixed: a buffer, not saved
        self.pos_emb = nn.Embedding(config.max_len, C) if config.positions == "learned" else None
        self.register_buffer("pos_table", sinusoidal_positions(config.max_len, C) if self.pos_emb is None else None,
                             persistent=False)
        self.cls = nn.Parameter(torch.empty(C)) if config.pooling == "cls" else None
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.final_norm = nn.LayerNorm(C, eps=config.layer_norm_eps)
        self.head = nn.Sequential(nn.Linear(C, config.d_ff), nn.ReLU(), nn.Dropout(config.dropout),
                                  nn.Linear(config.d_ff, config.num_classes))
        self.apply(self._init_weights)
        if self.cls is not None:
            nn.init.normal_(self.cls, std=0.02)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, tokens: Tensor, labels: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """tokens (B, T) int64, right-padded with pad_id -> (logits (B, num_classes), mean cross-entropy or None)."""
        cfg = self.config
        if tokens.dim() != 2 or tokens.shape[1] > cfg.max_tokens:
            raise ValueError(f"tokens must be (batch, seqlen <= {cfg.max_tokens}), got shape {tuple(tokens.shape)}")
        if labels is not None and labels.shape != tokens.shape[:1]:
            raise ValueError(f"labels must have shape {tuple(tokens.shape[:1])}, got {tuple(labels.shape)}")
        is_real = tokens.ne(cfg.pad_id) if cfg.pad_id is not None else None  # (B, T) or None: no padding
        x = self.tok_emb(tokens)  # (B, T, C)
        if self.cls is not None:
            x = torch.cat([self.cls.to(x.dtype).expand(x.shape[0], 1, -1), x], dim=1)  # (B, 1 + T, C)
            is_real = F.pad(is_real, (1, 0), value=True) if is_real is not None else None
        B, T, C = x.shape
        positions = self.pos_emb.weight if self.pos_emb is not None else self.pos_table  # (max_len, C)
        x = self.drop(x + positions[:T].to(x.dtype))
        if is_real is not None and not bool(is_real.any(dim=1).all()):
            raise ValueError("tokens: a row holds only pad tokens (pooling mean has nothing to average)")

        if is_real is None or cfg.attn_impl == "sdpa":  # padded (B, T, C)
            mask = is_real[:, None, None, :] if is_real is not None else None  # (B, 1, 1, T) keys
            for block in self.blocks:
                x = block(x, None, T, mask)
            x = self.final_norm(x)
            if cfg.pooling == "cls":
                pooled = x[:, 0]
            elif is_real is None:
                pooled = x.mean(dim=1)
            else:
                weights = is_real.to(x.dtype)[:, :, None]  # (B, T, 1)
                pooled = (x * weights).sum(dim=1) / weights.sum(dim=1)
        else:  # packed (total, C): pad tokens removed
            indices, cu_seqlens, max_seqlen = unpad_indices(is_real)
            x = x.flatten(0, 1)[indices]  # (total, C)
            for block in self.blocks:
                x = block(x, cu_seqlens, max_seqlen, None)
            x = self.final_norm(x)
            if cfg.pooling == "cls":
                pooled = x[cu_seqlens[:-1].long()]  # first token of each sequence
            else:
                seqlens = cu_seqlens.diff().to(x.dtype)[:, None]  # (B, 1)
                pooled = x.new_zeros(B, C).index_add_(0, indices // T, x) / seqlens

        logits = self.head(pooled)  # (B, num_classes)
        loss = F.cross_entropy(logits.float(), labels) if labels is not None else None
        return logits, loss
