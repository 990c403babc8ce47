"""Long Range Arena classifier: a Transformer encoder over token ids, pooled to one vector, then an MLP head.

Pre-LN blocks (x + attn(LN(x)), x + mlp(LN(x)), a final LN), as LRA's own Transformer encoder, and more stable at
LRA's high learning rates than post-LN. Positions are learned or fixed sinusoids. Pooling is "cls" (a learned
vector prepended at position 0, read out at the end) or "mean" (the mean over real tokens only). The head is
LRA's: Linear(d_model, d_ff) -> ReLU -> Linear(d_ff, num_classes).

dual=True is LRA's dual-tower head for Retrieval: each input row holds two documents side by side, (B, 2 L) = [doc 1
right-padded to L | doc 2 right-padded to L]; one encoder (shared weights) encodes and pools each document alone into
e1, e2, and the head reads [e1, e2, e1 * e2, e1 - e2] (LRA's classifier_head_dual with interaction "NLI"):
Linear(4 d_model, d_ff) -> ReLU -> Linear(d_ff, d_ff // 2) -> ReLU -> Linear(d_ff // 2, num_classes).

attention (an AttentionConfig of flashtrain.models.attention_variants; None: dense) picks the attention: dense
exact attention; block-sparse patterns on flashtrain's kernel (Longformer, BigBird, butterfly: a block mask built from
the sequence length, one bit per 128 x 128 (query block, key block), built once per length and device); or an
approximate variant in plain PyTorch (Linformer, Performer, local window, LSH). Its config builds every layer's inner
attention module and says whether the blocks run packed.

Padding is removed, not masked (as in bert.py): with a pad_id, the real tokens are packed into (total, d_model) and
attend through flash_attn_varlen_func; pad tokens cost nothing and never reach the pooled vector. Inputs are
right-padded, so positions of real tokens do not depend on the padding. pad_id None means every token is real
(Pathfinder: pixel 0 is black, not padding) and attention runs on (B, T) through flash_attn_func. Finding the real
tokens of CUDA tokens costs one host sync; `model.unpadding(tokens)` on the host batch, moved with .to(device) and
passed to forward, costs none.
Where attention runs PyTorch's SDPA (attn_impl sdpa, or auto without the kernel), or an approximate variant, the
blocks run padded, with a key-padding mask.
"""

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from flashtrain.models.attention import BidirectionalSelfAttention, DenseAttentionConfig, check_attn_impl
from flashtrain.models.attention_variants import VARIANTS
from flashtrain.models.flops import training_flops_per_token
from flashtrain.models.padding import Unpadding, check_values

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
    attn_impl: str = "flash"  # flash | sdpa | reference | auto (flashtrain.models.attention); sdpa runs padded
    dual: bool = False  # Retrieval: rows hold two documents [doc 1 | doc 2]; dual-tower head on [e1, e2, e1*e2, e1-e2]
    # the attention variant's config (model/attention=NAME: conf/model/attention/, flashtrain.models.attention_variants)
    attention: Any = None  # None: dense (DenseAttentionConfig)

    def __post_init__(self):
        check_attn_impl(self.attn_impl)
        for name, value, allowed in (("positions", self.positions, POSITIONS), ("pooling", self.pooling, POOLINGS)):
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
        if self.attention is None:
            self.attention = DenseAttentionConfig()
        if isinstance(self.attention, str):  # model.attention=NAME on the command line sets the node to a string
            raise ValueError(f"model.attention={self.attention!r}: the attention variant is a config group, chosen "
                             f"with model/attention={self.attention} (a file of conf/model/attention/; its options "
                             f"model.attention.KEY=VALUE); the variants' configs: {', '.join(VARIANTS)}")
        self.attention.check_attn_impl(self.attn_impl)
        if self.dual and self.d_ff < 2:
            raise ValueError(f"dual needs d_ff >= 2 (its head has a d_ff // 2 layer), got {self.d_ff}")

    @property
    def max_tokens(self) -> int:
        """Longest input, padding included."""
        return self.max_len - (self.pooling == "cls")

    def build(self) -> "LRAClassifier":
        return LRAClassifier(self)

    def attention_backend(self, device: torch.device, dtype: torch.dtype) -> str:
        return self.attention.backend(self.attn_impl, device, dtype, self.d_model // self.n_head)

    def check_data(self, data) -> None:
        """Raise ValueError when the data (a flashtrain.data.task.DataSpec) is not what this model reads; a field
        that is None (a preview, before the data is prepared) is not checked."""
        if data.task != "classification":
            raise ValueError(f"the LRA classifier trains on classification data (token rows, one label each); the "
                             f"data is {data.task}")
        if self.vocab_size < data.vocab_size:
            raise ValueError(f"model.vocab_size={self.vocab_size} is smaller than the data's vocabulary "
                             f"({data.vocab_size})")
        if data.num_classes is not None and self.num_classes != data.num_classes:
            raise ValueError(f"model.num_classes={self.num_classes} differs from the data's {data.num_classes}")
        if self.pad_id != data.pad_id:
            raise ValueError(f"model.pad_id={self.pad_id} differs from the data's padding id {data.pad_id}")
        if self.dual != data.paired:
            raise ValueError(f"model.dual={self.dual}, but the data's rows are "
                             f"{'document pairs' if data.paired else 'single sequences'}")
        if data.max_length is not None and data.max_length > self.max_tokens:
            raise ValueError(f"the data's longest sample has {data.max_length} tokens, more than the model takes "
                             f"({self.max_tokens}: model.max_len={self.max_len}, pooling={self.pooling!r}); "
                             f"raise model.max_len")


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
        inner = config.attention.build(d_model=config.d_model, n_head=config.n_head, max_len=config.max_len,
                                       attn_impl=config.attn_impl)
        self.attn = BidirectionalSelfAttention(config.d_model, config.n_head, inner, config.attn_dropout)
        self.mlp_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.mlp = nn.Sequential(nn.Linear(config.d_model, config.d_ff), nn.GELU(), nn.Dropout(config.dropout),
                                 nn.Linear(config.d_ff, config.d_model))
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, cu_seqlens: Tensor | None, max_seqlen: int, key_padding_mask: Tensor | None,
                block_mask: Tensor | None = None) -> Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x), cu_seqlens, max_seqlen, key_padding_mask, block_mask))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


class LRAClassifier(nn.Module):
    # the repeated unit: FSDP shards each Block on its own; trainer.activation_checkpointing recomputes per Block
    _no_split_modules = ["Block"]

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
        if config.dual:
            self.head = nn.Sequential(nn.Linear(4 * C, config.d_ff), nn.ReLU(), nn.Dropout(config.dropout),
                                      nn.Linear(config.d_ff, config.d_ff // 2), nn.ReLU(), nn.Dropout(config.dropout),
                                      nn.Linear(config.d_ff // 2, config.num_classes))
        else:
            self.head = nn.Sequential(nn.Linear(C, config.d_ff), nn.ReLU(), nn.Dropout(config.dropout),
                                      nn.Linear(config.d_ff, config.num_classes))
        self._init_weights()
        self._block_masks: dict[tuple[int, str], Tensor | None] = {}  # (max_seqlen, device) -> block_mask

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token at seq_len tokens (default max_len; flashtrain.models.flops); the attention term
        scaled by the share of the score matrix the variant computes (its attention_flops_fraction)."""
        c, seq_len = self.config, seq_len or self.config.max_len
        return training_flops_per_token(self, [self.tok_emb, self.pos_emb], c.n_layer, c.d_model, seq_len,
                                        c.attention.attention_flops_fraction(seq_len))

    def load_pretrained(self, init_from: str, position_extension: str = "repeat") -> str:
        """init_from= (flashtrain.train.model_init): a flashtrain LRA checkpoint, a run directory (its newest intact
        checkpoint) or a directory of runs (the newest intact checkpoint of its newest run), verified, an error when
        none is intact; learned positions of a smaller square image grid are upsampled in 2D (position_extension is not used). Returns the one-line note the run prints."""
        from flashtrain.models.pretrained_weights import load_lra_weights

        return load_lra_weights(self, self.config, init_from, position_extension)

    def _init_weights(self) -> None:
        """LRA's initialisation (its Flax TransformerEncoder): token embeddings N(0, 1), so that the tokens are not
        drowned by the fixed sinusoids (amplitude 1) -- with GPT-style N(0, 0.02) token embeddings ListOps stays at
        the class prior at LRA's learning rate; learned positions N(0, 0.02); the CLS vector zeros; every Linear
        Xavier-uniform with zero bias."""
        nn.init.normal_(self.tok_emb.weight, mean=0.0, std=1.0)
        if self.pos_emb is not None:
            nn.init.normal_(self.pos_emb.weight, mean=0.0, std=0.02)
        if self.cls is not None:
            nn.init.zeros_(self.cls)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, tokens: Tensor, labels: Tensor | None = None,
                unpadding: Unpadding | None = None) -> tuple[Tensor, Tensor | None]:
        """tokens (B, T) int64, right-padded with pad_id -> (logits (B, num_classes), mean cross-entropy or None).
        dual: tokens (B, 2 L), two documents each right-padded to L. unpadding: self.unpadding(tokens) when the caller
        built it (on the host batch: no host sync here), else computed here."""
        cfg = self.config
        if labels is not None and labels.shape != tokens.shape[:1]:
            raise ValueError(f"labels must have shape {tuple(tokens.shape[:1])}, got {tuple(labels.shape)}")
        if cfg.dual:
            if tokens.dim() != 2 or tokens.shape[1] % 2 or tokens.shape[1] // 2 > cfg.max_tokens:
                raise ValueError(f"tokens must be (batch, 2 * L) with L <= {cfg.max_tokens} (dual: two documents), "
                                 f"got shape {tuple(tokens.shape)}")
            B = tokens.shape[0]
            both = self.encode(self._documents(tokens), unpadding)  # (2 B, C): docs 1, docs 2
            e1, e2 = both[:B], both[B:]
            logits = self.head(torch.cat([e1, e2, e1 * e2, e1 - e2], dim=-1))  # (B, num_classes)
        else:
            logits = self.head(self.encode(tokens, unpadding))  # (B, num_classes)
        loss = F.cross_entropy(logits.float(), labels) if labels is not None else None
        return logits, loss

    @staticmethod
    def _documents(tokens: Tensor) -> Tensor:
        """dual: (B, 2 L) rows of two documents -> (2 B, L), the first documents of every row, then the second."""
        return tokens.view(tokens.shape[0], 2, -1).transpose(0, 1).reshape(2 * tokens.shape[0], -1)

    def unpadding(self, tokens: Tensor) -> Unpadding | None:
        """The packed layout forward(tokens) runs on (the CLS vector counts as a real token): build it on the host
        batch and pass it, moved with .to(device), to forward. None when nothing is padded (pad_id None)."""
        if self.config.pad_id is None:
            return None
        is_real = (self._documents(tokens) if self.config.dual else tokens).ne(self.config.pad_id)
        if self.cls is not None:
            is_real = F.pad(is_real, (1, 0), value=True)
        return Unpadding.of(is_real)

    def block_mask(self, max_seqlen: int, device: torch.device) -> Tensor | None:
        """The attention block mask (ceil(max_seqlen / 128),) * 2 of config.attention, or None (no block mask); built
        once per length and device (a fresh copy to the GPU in every step would wait for the host)."""
        key = (max_seqlen, str(device))
        if key not in self._block_masks:
            mask = self.config.attention.block_mask(max_seqlen)
            self._block_masks[key] = None if mask is None else mask.to(device)
        return self._block_masks[key]

    def encode(self, tokens: Tensor, unpadding: Unpadding | None = None) -> Tensor:
        """tokens (B, T) int64, right-padded with pad_id -> the pooled vectors (B, d_model); unpadding as in
        forward (for these tokens)."""
        cfg = self.config
        if tokens.dim() != 2 or tokens.shape[1] > cfg.max_tokens:
            raise ValueError(f"tokens must be (batch, seqlen <= {cfg.max_tokens}), got shape {tuple(tokens.shape)}")
        is_real = tokens.ne(cfg.pad_id) if cfg.pad_id is not None else None  # (B, T) or None: no padding
        x = self.tok_emb(tokens)  # (B, T, C)
        if self.cls is not None:
            x = torch.cat([self.cls.to(x.dtype).expand(x.shape[0], 1, -1), x], dim=1)  # (B, 1 + T, C)
            is_real = F.pad(is_real, (1, 0), value=True) if is_real is not None else None
        B, T, C = x.shape
        positions = self.pos_emb.weight if self.pos_emb is not None else self.pos_table  # (max_len, C)
        x = self.drop(x + positions[:T].to(x.dtype))
        if is_real is not None:
            check_values(is_real.any(dim=1).all(), "tokens: a row holds only pad tokens (pooling mean has nothing to "
                                                   "average)")

        packed = cfg.attention.runs_packed(cfg.attn_impl, x, C // cfg.n_head)
        if is_real is None or not packed:  # padded (B, T, C), is_real the key-padding mask
            block_mask = self.block_mask(T, x.device)
            for block in self.blocks:
                x = block(x, None, T, is_real, block_mask)
            x = self.final_norm(x)
            if cfg.pooling == "cls":
                pooled = x[:, 0]
            elif is_real is None:
                pooled = x.mean(dim=1)
            else:
                weights = is_real.to(x.dtype)[:, :, None]  # (B, T, 1)
                pooled = (x * weights).sum(dim=1) / weights.sum(dim=1)
        else:  # packed (total, C): pad tokens removed
            indices, cu_seqlens, max_seqlen = (unpadding if unpadding is not None else Unpadding.of(is_real))[:3]
            x = x.flatten(0, 1)[indices]  # (total, C)
            block_mask = self.block_mask(max_seqlen, x.device)  # blocks counted from each sequence's start
            for block in self.blocks:
                x = block(x, cu_seqlens, max_seqlen, None, block_mask)
            x = self.final_norm(x)
            if cfg.pooling == "cls":
                pooled = x[cu_seqlens[:-1].long()]  # first token of each sequence
            else:
                seqlens = cu_seqlens.diff().to(x.dtype)[:, None]  # (B, 1)
                pooled = x.new_zeros(B, C).index_add_(0, indices // T, x) / seqlens
        return pooled
