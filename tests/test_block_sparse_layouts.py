"""CPU tests of the block-sparse layout helpers (flashtrain/kernels/block_sparse.py) and of the kernels' index lists
(ops.block_sparse_lists)."""

import math
import re

import pytest
import torch

from flashtrain.kernels import BLOCK_SPARSE_SIZE, block_sparse, flash_attn_func, naive_attention


def _docstring_picture(fn) -> str:
    """The first ASCII picture (consecutive lines of '#' and '.') of fn's docstring."""
    lines = [line.strip() for line in fn.__doc__.splitlines()]
    picture = [line for line in lines if line and re.fullmatch(r"[#.]( [#.])*", line)]
    return "\n".join(picture)


@pytest.mark.parametrize("fn, kwargs, blocks", [
    (block_sparse.local_window, dict(window=1), 6),
    (block_sparse.fixed_stride, dict(stride=3, summary=1), 7),
    (block_sparse.bigbird, dict(window=1, num_global=1, num_random=1, seed=0), 7),
    (block_sparse.butterfly, dict(), 8),
], ids=["local_window", "fixed_stride", "bigbird", "butterfly"])
def test_docstring_pictures_are_the_real_masks(fn, kwargs, blocks):
    # a ragged last block (seqlen not a multiple of 128) still counts as a block
    assert block_sparse.render(fn(blocks * BLOCK_SPARSE_SIZE - 5, **kwargs)) == _docstring_picture(fn)


def test_local_window_is_a_band():
    mask = block_sparse.local_window(1000, 2000, window=2)
    assert mask.shape == (8, 16) and mask.dtype == torch.bool
    i, j = torch.meshgrid(torch.arange(8), torch.arange(16), indexing="ij")
    assert torch.equal(mask, (i - j).abs() <= 2)
    assert torch.equal(block_sparse.local_window(512, window=0), torch.eye(4, dtype=torch.bool))


def test_fixed_stride_chunks_and_summary_columns():
    mask = block_sparse.fixed_stride(16 * 128, stride=4, summary=2)
    assert mask[5, 4:8].all() and not mask[5, 0:2].any() and mask[5, 2:4].all()  # own chunk + summary columns
    assert mask.sum(-1).tolist() == [4 + 2 * 3] * 16  # own chunk (4) + 2 summary columns of each other chunk


def test_bigbird_window_global_random_and_seed():
    mask = block_sparse.bigbird(32 * 128, window=1, num_global=2, num_random=3, seed=5)
    assert mask[:2].all() and mask[:, :2].all()  # global rows and columns
    assert all(mask[i, max(0, i - 1) : i + 2].all() for i in range(32))  # the band
    assert (mask[2:].sum(-1) <= 2 + 3 + 3).all() and (mask[2:].sum(-1) >= 2 + 3).all()  # global + band + random
    assert torch.equal(mask, block_sparse.bigbird(32 * 128, window=1, num_global=2, num_random=3, seed=5))
    assert not torch.equal(mask, block_sparse.bigbird(32 * 128, window=1, num_global=2, num_random=3, seed=6))


def test_butterfly_has_log_blocks_per_row():
    mask = block_sparse.butterfly(64 * 128)
    assert mask.sum(-1).tolist() == [1 + 6] * 64 and torch.equal(mask, mask.T)
    limited = block_sparse.butterfly(64 * 128, max_stride=4)  # i XOR j in {0, 1, 2, 4}
    assert limited.sum(-1).tolist() == [4] * 64 and (limited <= mask).all()


def test_random_blocks_exact_density_per_row_and_head():
    mask = block_sparse.random_blocks(64 * 128, density=1 / 8, nheads=3, seed=1)
    assert mask.shape == (3, 64, 64) and (mask.sum(-1) == 8).all()
    assert not torch.equal(mask[0], mask[1])  # a different draw per head
    assert torch.equal(block_sparse.random_blocks(1000, density=1.0), torch.ones(8, 8, dtype=torch.bool))
    assert (block_sparse.random_blocks(300, 5000, density=0.01).sum(-1) == 1).all()  # at least one block per row


@pytest.mark.parametrize("call, match", [
    (lambda: block_sparse.local_window(0, window=1), "seqlen_q"),
    (lambda: block_sparse.local_window(128, 1.5, window=1), "seqlen_k"),
    (lambda: block_sparse.local_window(128, window=-1), "window"),
    (lambda: block_sparse.fixed_stride(128, stride=0), "stride"),
    (lambda: block_sparse.fixed_stride(128, stride=2, summary=3), "summary"),
    (lambda: block_sparse.bigbird(128, num_random=-1), "num_random"),
    (lambda: block_sparse.bigbird(128, num_global=True), "num_global"),
    (lambda: block_sparse.bigbird(128, seed="x"), "seed"),
    (lambda: block_sparse.butterfly(128, max_stride=0), "max_stride"),
    (lambda: block_sparse.random_blocks(128, density=0.0), "density"),
    (lambda: block_sparse.random_blocks(128, density=0.5, nheads=0), "nheads"),
    (lambda: block_sparse.render(torch.ones(2, 2, 2, dtype=torch.bool)), "mask"),
])
def test_arguments_are_validated(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_layout_through_the_reference_matches_naive():
    """A layout as block_mask (causal, GQA) on the CPU path: same out as the materialised-mask oracle."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 520, 4, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 520, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    mask = block_sparse.bigbird(520, window=0, num_global=1, num_random=1, seed=3)
    out = flash_attn_func(q, k, v, causal=True, block_mask=mask)
    expected, _ = naive_attention(q, k, v, causal=True, block_mask=mask)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=0)


def test_kernel_index_lists_of_a_mask():
    """ops.block_sparse_lists: per row / column the count, then the non-zero blocks ascending (CPU tensors here)."""
    from flashtrain.kernels import ops

    mask = torch.rand(3, 5, 7, generator=torch.Generator().manual_seed(0)) < 0.4
    mask[:, 1] = False
    mask[:, :, 2] = False
    rows, cols = ops.block_sparse_lists(mask)
    assert rows.shape == (3, 5, 8) and cols.shape == (3, 7, 6) and rows.dtype == cols.dtype == torch.int32
    for h in range(3):
        for i in range(5):
            assert rows[h, i, 1 : 1 + rows[h, i, 0]].tolist() == mask[h, i].nonzero().flatten().tolist()
        for j in range(7):
            assert cols[h, j, 1 : 1 + cols[h, j, 0]].tolist() == mask[h, :, j].nonzero().flatten().tolist()
    shared_rows, _ = ops.block_sparse_lists(mask[0])
    assert torch.equal(shared_rows, rows[:1])
    assert math.prod(rows.shape) == 3 * 5 * (7 + 1)  # the size of the mask, never seqlen x seqlen


def test_kernel_index_lists_are_cached_per_mask_tensor():
    """A model passes one mask tensor to every layer and step: its lists are built once, rebuilt when the mask is
    written in place, and never served for another tensor."""
    from flashtrain.kernels import ops

    mask = torch.rand(2, 4, 4, generator=torch.Generator().manual_seed(1)) < 0.5
    first = ops.block_sparse_lists(mask)
    again = ops.block_sparse_lists(mask)
    assert again[0] is first[0] and again[1] is first[1]
    mask[:, 0] = ~mask[:, 0]  # in place: the version counter moves
    rows, _ = ops.block_sparse_lists(mask)
    assert rows is not first[0]
    assert rows[0, 0, 1 : 1 + rows[0, 0, 0]].tolist() == mask[0, 0].nonzero().flatten().tolist()
    other = mask.clone()
    other[1, 2] = ~other[1, 2]
    other_rows, _ = ops.block_sparse_lists(other)
    assert other_rows[1, 2, 1 : 1 + other_rows[1, 2, 0]].tolist() == other[1, 2].nonzero().flatten().tolist()
    for _ in range(3 * ops._LISTS_CACHE_SIZE):  # masks that die leave no growing cache behind
        ops.block_sparse_lists(torch.ones(3, 3, dtype=torch.bool))
    assert len(ops._lists_cache) <= ops._LISTS_CACHE_SIZE
