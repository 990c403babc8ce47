"""Block-sparse attention layouts: bool block masks for flash_attn_func(..., block_mask=...).

Every helper returns a bool tensor (ceil(seqlen_q / 128), ceil(seqlen_k / 128)) in units of BLOCK_SPARSE_SIZE = 128
tokens: block (i, j) True lets queries [128 i, 128 i + 128) attend to keys [128 j, 128 j + 128). Stack several along
a new first dim for a per-head mask (nheads, ...). Causal masking is not part of a layout: pass causal=True to the
attention function, which ANDs it with the mask. With varlen inputs the blocks count from each sequence's start, so
a layout for max_seqlen serves every sequence of the batch. In the pictures below '#' is a computed block, '.' a
skipped one; rows are query blocks, columns key blocks.

    local_window        sliding-window band (Longformer's local attention, in blocks)
    fixed_stride        Sparse Transformer's "fixed" pattern (Child et al. 2019)
    bigbird             window + global + random blocks (Zaheer et al. 2020)
    butterfly           flat block butterfly (Pixelated Butterfly, Chen et al. 2022; FlashAttention's block-sparse runs)
    random_blocks       exactly round(density * n_kblocks) random blocks per row (benchmarks and tests)
"""

import math

import torch
from torch import Tensor

from flashtrain.kernels.reference import BLOCK_SPARSE_SIZE


def _num_blocks(seqlen_q: int, seqlen_k: int | None) -> tuple[int, int]:
    """(n_qblocks, n_kblocks) of the layout; seqlen_k None means seqlen_k = seqlen_q."""
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    for name, value in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    return math.ceil(seqlen_q / BLOCK_SPARSE_SIZE), math.ceil(seqlen_k / BLOCK_SPARSE_SIZE)


def _check_count(name: str, value, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _grid(n_q: int, n_k: int) -> tuple[Tensor, Tensor]:
    """Query block index (n_q, 1) and key block index (1, n_k)."""
    return torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]


def local_window(seqlen_q: int, seqlen_k: int | None = None, *, window: int) -> Tensor:
    """Sliding-window band: query block i sees key blocks j with |i - j| <= window.

    window=1, 6 x 6 blocks (with causal=True only the diagonal and the band below it remain):

        # # . . . .
        # # # . . .
        . # # # . .
        . . # # # .
        . . . # # #
        . . . . # #
    """
    n_q, n_k = _num_blocks(seqlen_q, seqlen_k)
    _check_count("window", window)
    i, j = _grid(n_q, n_k)
    return (i - j).abs() <= window


def fixed_stride(seqlen_q: int, seqlen_k: int | None = None, *, stride: int, summary: int = 1) -> Tensor:
    """Sparse Transformer's fixed pattern: a query block sees every key block of its own chunk of `stride` blocks,
    plus the last `summary` blocks of every chunk (the "summary" columns that carry information between chunks).

    stride=3, summary=1, 7 x 7 blocks:

        # # # . . # .
        # # # . . # .
        # # # . . # .
        . . # # # # .
        . . # # # # .
        . . # # # # .
        . . # . . # #
    """
    n_q, n_k = _num_blocks(seqlen_q, seqlen_k)
    _check_count("stride", stride, 1)
    if isinstance(summary, bool) or not isinstance(summary, int) or not 1 <= summary <= stride:
        raise ValueError(f"summary must be an int in [1, stride = {stride}], got {summary!r}")
    i, j = _grid(n_q, n_k)
    return (i // stride == j // stride) | (j % stride >= stride - summary)


def bigbird(seqlen_q: int, seqlen_k: int | None = None, *, window: int = 1, num_global: int = 1,
            num_random: int = 2, seed: int = 0) -> Tensor:
    """BigBird: the band |i - j| <= window, the first num_global blocks as global rows and columns (they see and are
    seen by everything), and num_random random key blocks per query block (drawn with a CPU generator seeded with
    `seed`: the same arguments give the same mask).

    window=1, num_global=1, num_random=1, seed=0, 7 x 7 blocks:

        # # # # # # #
        # # # . . # .
        # # # # # . .
        # . # # # . #
        # . . # # # #
        # . . . # # #
        # # . . . # #
    """
    n_q, n_k = _num_blocks(seqlen_q, seqlen_k)
    _check_count("window", window)
    _check_count("num_global", num_global)
    _check_count("num_random", num_random)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    i, j = _grid(n_q, n_k)
    mask = ((i - j).abs() <= window) | (i < num_global) | (j < num_global)
    if num_random > 0:
        # per row, num_random distinct key blocks drawn uniformly (argsort of uniform noise = a random permutation)
        noise = torch.rand((n_q, n_k), generator=torch.Generator().manual_seed(seed))
        picks = noise.argsort(dim=-1)[:, : min(num_random, n_k)]
        mask.scatter_(1, picks, True)
    return mask


def butterfly(seqlen_q: int, seqlen_k: int | None = None, *, max_stride: int | None = None) -> Tensor:
    """Flat block butterfly: block (i, j) is kept iff i XOR j is 0 or a power of two below max_stride (default: any),
    i.e. the union of the butterfly factors of sizes 2, 4, ..., 2 * max_stride (Pixelated Butterfly, the pattern of
    FlashAttention's block-sparse experiments). About log2(n) + 1 blocks per row.

    8 x 8 blocks, max_stride None:

        # # # . # . . .
        # # . # . # . .
        # . # # . . # .
        . # # # . . . #
        # . . . # # # .
        . # . . # # . #
        . . # . # . # #
        . . . # . # # #
    """
    n_q, n_k = _num_blocks(seqlen_q, seqlen_k)
    if max_stride is not None:
        _check_count("max_stride", max_stride, 1)
    i, j = _grid(n_q, n_k)
    diff = i ^ j
    mask = (diff & (diff - 1)) == 0  # 0 or a power of two
    if max_stride is not None:
        mask &= diff < 2 * max_stride
    return mask


def random_blocks(seqlen_q: int, seqlen_k: int | None = None, *, density: float, nheads: int | None = None,
                  seed: int = 0) -> Tensor:
    """Exactly max(1, round(density * n_kblocks)) key blocks per query block, chosen uniformly at random (CPU
    generator seeded with `seed`); (nheads, n_qblocks, n_kblocks) with a different draw per head when nheads is given.
    Every row then costs the same, so run time against density is a clean measure of how the kernels scale.

    density=0.25, 4 x 8 blocks (2 per row), e.g.:

        . # . . . . # .
        # . . . # . . .
        . . # . . # . .
        . . . # . . . #
    """
    n_q, n_k = _num_blocks(seqlen_q, seqlen_k)
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1:
        raise ValueError(f"density must be a float in (0, 1], got {density!r}")
    if nheads is not None:
        _check_count("nheads", nheads, 1)
    per_row = max(1, round(density * n_k))
    noise = torch.rand((nheads or 1, n_q, n_k), generator=torch.Generator().manual_seed(seed))
    picks = noise.argsort(dim=-1)[..., :per_row]
    mask = torch.zeros((nheads or 1, n_q, n_k), dtype=torch.bool).scatter_(-1, picks, True)
    return mask if nheads is not None else mask[0]


def render(mask: Tensor) -> str:
    """The ASCII picture of a 2-D block mask ('#' kept, '.' skipped), as in the docstrings above."""
    if mask.dim() != 2:
        raise ValueError(f"mask must be 2-D (n_qblocks, n_kblocks), got shape {tuple(mask.shape)}")
    return "\n".join(" ".join("#" if keep else "." for keep in row) for row in mask.tolist())
