"""Block-sparse attention (Longformer, BigBird and butterfly patterns): exact softmax attention restricted to a
pattern of 128 x 128 (query block, key block) tiles, run by flashtrain's kernels through the `block_mask` argument
(the CUDA kernels visit only the kept tiles; the reference skips the others).

Layouts come from flashtrain.kernels.block_sparse:
    local_global  Longformer: a sliding window of blocks (block i sees blocks j with |i - j| <= local_blocks) and
                  global blocks (the first global_blocks blocks see and are seen by every block; the LRA encoder's
                  CLS token sits in block 0)
    bigbird       BigBird: the same plus random_blocks random key blocks per query block (drawn with `seed`: the same
                  mask in every step and process)
    butterfly     the flat block butterfly of FlashAttention's block-sparse experiments, plus the global blocks
Padding is removed, not masked (the blocks count from each sequence's start), as for dense attention.
"""

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn
from torch import Tensor

from flashtrain.kernels import block_sparse
from flashtrain.models.attention import AttentionConfig, ExactAttention, check_backend, runs_packed

BLOCK_SPARSE_KINDS = ("local_global", "bigbird", "butterfly")


@dataclass
class BlockSparseConfig(AttentionConfig):
    name: ClassVar[str] = "block_sparse"
    kind: str = "local_global"  # the layout: local_global (Longformer) | bigbird | butterfly (module docstring)
    local_blocks: int = 1  # local_global, bigbird: a query block sees this many key blocks on each side of its own
    global_blocks: int = 1  # the first global_blocks blocks see every block and every block sees them
    random_blocks: int = 0  # bigbird: random key blocks per query block (drawn with `seed`)
    seed: int = 0  # bigbird: the random blocks' seed (the same mask in every step and process)

    def __post_init__(self):
        if self.kind not in BLOCK_SPARSE_KINDS:
            raise ValueError(f"attention.kind must be one of {BLOCK_SPARSE_KINDS}, got {self.kind!r}")
        for name in ("local_blocks", "global_blocks", "random_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"attention.{name} must be >= 0, got {getattr(self, name)}")

    def build(self, *, d_model: int, n_head: int, max_len: int, attn_impl: str) -> nn.Module:
        return ExactAttention(attn_impl)

    def check_attn_impl(self, attn_impl: str) -> None:
        if attn_impl == "sdpa":
            raise ValueError("block_sparse attention needs attn_impl flash, reference or auto (sdpa takes no block "
                             "mask)")

    def runs_packed(self, attn_impl: str, x: Tensor, head_dim: int) -> bool:
        return runs_packed(attn_impl, x, head_dim, block_mask=True)

    def attention_flops_fraction(self, seqlen: int) -> float:
        return float(self.block_mask(seqlen).float().mean())  # the kept tiles

    def block_mask(self, seqlen: int) -> Tensor:
        """bool (n, n), n = ceil(seqlen / 128): True where query block i attends to key block j."""
        if self.kind == "butterfly":
            mask = block_sparse.butterfly(seqlen)
            mask[:self.global_blocks], mask[:, :self.global_blocks] = True, True
            return mask
        random_blocks = self.random_blocks if self.kind == "bigbird" else 0
        return block_sparse.bigbird(seqlen, window=self.local_blocks, num_global=self.global_blocks,
                                    num_random=random_blocks, seed=self.seed)

    def backend(self, attn_impl: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
        return f"block_sparse {self.kind}: " + check_backend(attn_impl, device, dtype, head_dim, block_mask=True)
