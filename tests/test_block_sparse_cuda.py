"""GPU tests of the block-sparse CUDA kernels (block_mask) against the fp32 reference, which computes the same masks
tile by tile (a per-head mask is given to the reference one query head at a time, as a shared mask: the reference's
per-head masks do not work on CUDA tensors yet).

Tolerance rule of FlashAttention-2, as in tests/test_cuda_kernels.py: for out, dq, dk and dv, the kernel's max error
against the fp32 reference is at most twice that of plain PyTorch attention (naive_attention, same block_mask) in
fp16/bf16, plus the rounding of the reference's values to that dtype.

    pytest -m cuda tests/test_block_sparse_cuda.py
"""

import math

import pytest
import torch

from flashtrain.kernels import BLOCK_SPARSE_SIZE, block_sparse, flash_attn_func, flash_attn_varlen_func, naive_attention
from test_cuda_kernels import _assert_fa2_rule, _run  # the dense kernel tests' comparison rule and runner

pytestmark = pytest.mark.cuda
DTYPES = (torch.float16, torch.bfloat16)


def _ops():
    from flashtrain.kernels import ops

    return ops


def _inputs(shape_q, shape_k, dtype, seed=0):
    gen = torch.Generator("cuda").manual_seed(seed)
    q, k, v = (torch.randn(shape, device="cuda", generator=gen).to(dtype) for shape in (shape_q, shape_k, shape_k))
    dout = torch.randn(shape_q, device="cuda", generator=gen).to(dtype)
    return q, k, v, dout


def _random_mask(shape, density=0.5, seed=0):
    """Random bool block mask on the GPU with query block 1 (if any) empty and key block 0 of the last query block
    dropped: rows with no key, and columns whose key tile the backward never visits for some rows."""
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < density
    if shape[-2] > 1:
        mask[..., 1, :] = False
    mask[..., -1, 0] = False
    return mask.cuda()


def _check(q, k, v, dout, block_mask, *, causal, dropout_p=0.0, seed=None, **varlen):
    """Kernel vs fp32 reference vs naive attention in q.dtype, all with block_mask; returns the kernel's results."""
    dropout_mask = None
    if dropout_p > 0:
        dropout_mask = _ops().dropout_mask_for_testing(
            q, k, dropout_p=dropout_p, generator=torch.Generator("cuda").manual_seed(seed), **varlen)
    options = dict(causal=causal, dropout_p=dropout_p, return_lse=True)
    if varlen:
        cu_q, cu_k, max_q, max_k = (varlen[key] for key in ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                                              "max_seqlen_k"))

        def attn(q, k, v, impl, **kw):
            return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, impl=impl, **options, **kw)

        def naive(q, k, v):
            return naive_attention(q, k, v, cu_q, cu_k, causal=causal, block_mask=block_mask, dropout_p=dropout_p,
                                   dropout_mask=dropout_mask)
    else:
        def attn(q, k, v, impl, **kw):
            return flash_attn_func(q, k, v, impl=impl, **options, **kw)

        def naive(q, k, v):
            return naive_attention(q, k, v, causal=causal, block_mask=block_mask, dropout_p=dropout_p,
                                   dropout_mask=dropout_mask)

    gen = {} if dropout_p == 0 else {"generator": torch.Generator("cuda").manual_seed(seed)}
    kernel = _run(lambda q, k, v: attn(q, k, v, "cuda", block_mask=block_mask, **gen), q, k, v, dout)
    reference = _run(lambda q, k, v: _head_by_head(attn, q, k, v, block_mask, dropout_mask, varlen=bool(varlen)),
                     q.float(), k.float(), v.float(), dout.float())
    lowp = _run(naive, q, k, v, dout)
    for name, got, ref, low in zip(("out", "lse", "dq", "dk", "dv"), kernel, reference, lowp):
        if name == "lse":
            assert torch.equal(got == -math.inf, ref == -math.inf), "lse: -inf rows differ"
            finite = ref > -math.inf
            torch.testing.assert_close(got[finite], ref[finite], atol=2e-3, rtol=1e-3)
        else:
            _assert_fa2_rule(got, ref, low, q.dtype, name)
    return kernel


def _head_by_head(attn, q, k, v, block_mask, dropout_mask, *, varlen):
    """attn(q, k, v, "reference", block_mask=..., dropout_mask=...) -> (out, lse), called once per query head with
    that head's 2-D mask when block_mask is per head; outs and lses concatenated along their head dims."""
    if block_mask.dim() == 2:
        return attn(q, k, v, "reference", block_mask=block_mask,
                    **({} if dropout_mask is None else {"dropout_mask": dropout_mask}))
    group = q.shape[-2] // k.shape[-2]
    head_dim_of_lse = 0 if varlen else 1  # lse (nheads, total_q) or (batch, nheads, seqlen_q); dropout_mask alike
    outs, lses = [], []
    for h in range(q.shape[-2]):
        kv = slice(h // group, h // group + 1)
        drop = {} if dropout_mask is None else {"dropout_mask": dropout_mask.narrow(head_dim_of_lse, h, 1)}
        out, lse = attn(q[..., h : h + 1, :], k[..., kv, :], v[..., kv, :], "reference", block_mask=block_mask[h],
                        **drop)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=head_dim_of_lse)


def _blocks(seqlen_q, seqlen_k):
    return math.ceil(seqlen_q / BLOCK_SPARSE_SIZE), math.ceil(seqlen_k / BLOCK_SPARSE_SIZE)


# hd 40 runs on the hd64 kernel (zero-padded columns), 72 on hd128; (300, 650) and (650, 300): seqlen_q != seqlen_k
SHAPES = [(640, 640), (1025, 1025), (300, 650), (650, 300)]


@pytest.mark.parametrize("head_dim", [64, 128, 40, 72])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_random_masks_match_reference(head_dim, dtype, causal):
    for index, (seqlen_q, seqlen_k) in enumerate(SHAPES):
        nheads, nheads_kv = (4, 2) if index % 2 else (3, 3)  # GQA on every other shape
        per_head = index in (1, 2)
        shape = (nheads, *_blocks(seqlen_q, seqlen_k)) if per_head else _blocks(seqlen_q, seqlen_k)
        mask = _random_mask(shape, seed=index)
        q, k, v, dout = _inputs((2, seqlen_q, nheads, head_dim), (2, seqlen_k, nheads_kv, head_dim), dtype, seed=index)
        out, lse, dq, _, _ = _check(q, k, v, dout, mask, causal=causal)
        rows = slice(BLOCK_SPARSE_SIZE, 2 * BLOCK_SPARSE_SIZE)  # query block 1: no key at all
        assert torch.equal(out[:, rows], torch.zeros_like(out[:, rows])) and (lse[:, :, rows] == -math.inf).all()
        assert torch.equal(dq[:, rows], torch.zeros_like(dq[:, rows]))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("sm90", ["0", "1"], ids=["mma_sync", "hopper"])
def test_density_one_equals_dense_bitwise(dtype, head_dim, sm90, monkeypatch):
    """A mask of ones walks the dense kernels' tiles in the same order with the same arithmetic: out and lse are
    bitwise those of the dense kernel, and so are the gradients with the deterministic backward (mma.sync). On Hopper
    both kernel families are compared (FLASHTRAIN_SM90=0 / 1); elsewhere both runs are the mma.sync kernels. The
    Hopper backward is compared without deterministic=True (the block-sparse one, deterministic, runs the mma.sync
    kernel): dq (summed by reductions in arrival order) and, for these GQA shapes, dk and dv (the dense backward may
    split a group's query heads over several tiles and sum their float32 partials: ops._gqa_splits) equal to float32
    rounding of the additions."""
    monkeypatch.setenv("FLASHTRAIN_SM90", sm90)
    ops = _ops()
    hopper = sm90 == "1" and torch.cuda.get_device_capability()[0] == 9
    for causal, (seqlen_q, seqlen_k) in ((False, (1000, 1000)), (True, (1000, 1000)), (True, (300, 700))):
        q, k, v, dout = _inputs((2, seqlen_q, 4, head_dim), (2, seqlen_k, 2, head_dim), dtype)
        ones = torch.ones(_blocks(seqlen_q, seqlen_k), dtype=torch.bool, device="cuda")

        def attn(block_mask):
            return lambda q, k, v: ops.flash_attn_cuda(
                q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=seqlen_q, max_seqlen_k=seqlen_k,
                dropout_p=0.0, softmax_scale=0.1, causal=causal, generator=None, deterministic=not hopper,
                block_mask=block_mask)

        dense, sparse = _run(attn(None), q, k, v, dout), _run(attn(ones), q, k, v, dout)
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), dense, sparse):
            if name in ("dq", "dk", "dv") and hopper:  # fp32 sums of the same terms in another order, then rounded
                torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2 * b.abs().max().item())
            else:
                assert torch.equal(a, b), f"{name} differs (causal={causal}, {seqlen_q}x{seqlen_k})"


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_blocks_count_from_each_sequence_start(dtype, causal):
    lengths_q = [0, 1, 200, 129, 300, 97]
    lengths_k = [3, 1, 0, 250, 300, 40]
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    for head_dim, per_head in ((64, False), (128, True)):
        blocks = _blocks(max(lengths_q), max(lengths_k))
        mask = _random_mask((4, *blocks) if per_head else blocks, density=0.6, seed=head_dim)
        q, k, v, dout = _inputs((sum(lengths_q), 4, head_dim), (sum(lengths_k), 2, head_dim), dtype)
        _check(q, k, v, dout, mask, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
               max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dropout_uses_the_dense_kernels_philox_mask(dtype, causal):
    """The computed tiles draw the same keep bits as the dense kernels (dropout_mask_for_testing materialises them)."""
    for head_dim, per_head in ((64, True), (128, False)):
        q, k, v, dout = _inputs((2, 600, 4, head_dim), (2, 520, 2, head_dim), dtype)
        blocks = _blocks(600, 520)
        mask = _random_mask((4, *blocks) if per_head else blocks, seed=3)
        _check(q, k, v, dout, mask, causal=causal, dropout_p=0.17, seed=1234)
    lengths = [17, 300, 1, 200]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v, dout = _inputs((sum(lengths), 2, 64), (sum(lengths), 2, 64), dtype)
    _check(q, k, v, dout, _random_mask(_blocks(300, 300), seed=4), causal=causal, dropout_p=0.3, seed=7,
           cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=300, max_seqlen_k=300)


def test_layouts_run_on_the_kernel():
    """Each layout helper's mask through the kernel (MQA, causal) against the reference."""
    seqlen = 1100
    layouts = [block_sparse.local_window(seqlen, window=1), block_sparse.fixed_stride(seqlen, stride=3),
               block_sparse.bigbird(seqlen, seed=1), block_sparse.butterfly(seqlen),
               block_sparse.random_blocks(seqlen, density=0.25, nheads=4, seed=2)]
    for index, mask in enumerate(layouts):
        q, k, v, dout = _inputs((1, seqlen, 4, 64), (1, seqlen, 1, 64), torch.bfloat16, seed=index)
        _check(q, k, v, dout, mask.cuda(), causal=True)


def test_skipped_blocks_are_never_read():
    """NaN keys and values in blocks that must be skipped would reach out through 0 * NaN (and dk, dv, dq through
    the backward) if the kernels computed and masked them instead of skipping them."""
    q, k, v, dout = _inputs((1, 512, 2, 64), (1, 512, 2, 64), torch.bfloat16)
    mask = torch.tensor([[1, 0, 1, 0], [1, 0, 0, 0], [0, 0, 1, 1], [1, 0, 1, 1]], dtype=torch.bool, device="cuda")
    poisoned = torch.zeros(512, dtype=torch.bool, device="cuda")
    poisoned[128:256] = True  # key block 1: never allowed
    k_bad, v_bad = (x.masked_fill(poisoned[None, :, None, None], math.nan) for x in (k, v))
    got = _run(lambda q, k, v: flash_attn_func(q, k, v, block_mask=mask, return_lse=True, impl="cuda"),
               q, k_bad, v_bad, dout)
    expected = _run(lambda q, k, v: flash_attn_func(q, k, v, block_mask=mask, return_lse=True, impl="cuda"),
                    q, k, v, dout)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, expected):
        assert not a.isnan().any(), name
        if name in ("dk", "dv"):
            assert torch.equal(a[:, 128:256], torch.zeros_like(a[:, 128:256])), name
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


def test_unsupported_head_dim_raises_with_impl_cuda():
    q, k, v, _ = _inputs((1, 256, 2, 192), (1, 256, 2, 192), torch.bfloat16)
    mask = torch.ones(2, 2, dtype=torch.bool, device="cuda")
    with pytest.raises(RuntimeError, match="block-sparse CUDA kernels.*head_dim <= 128"):
        flash_attn_func(q, k, v, block_mask=mask, impl="cuda")
    with pytest.warns(UserWarning, match="head_dim <= 128"):  # impl="auto": the reference, with a warning
        flash_attn_func(q, k, v, block_mask=mask)


def test_opcheck_block_sparse():
    ops = _ops()
    q, k, v, _ = _inputs((2, 300, 4, 64), (2, 260, 2, 64), torch.float16)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    bs_rows, bs_cols = ops.block_sparse_lists(_random_mask((4, 3, 3)))
    torch.library.opcheck(ops.flash_attn_fwd, (q, k, v, None, None, 300, 260, 0.0, 0.125, True, None, False, bs_rows,
                                               bs_cols))


def _sanitizer_grid() -> None:
    """Small block-sparse forward + backward calls over every kernel path, for compute-sanitizer:
    compute-sanitizer --tool memcheck --report-api-errors no python tests/test_block_sparse_cuda.py"""
    for head_dim, dtype, causal, dropout_p in [(64, torch.float16, False, 0.0), (128, torch.bfloat16, True, 0.1),
                                                (40, torch.bfloat16, True, 0.0), (96, torch.float16, False, 0.2)]:
        q, k, v, dout = _inputs((2, 300, 4, head_dim), (2, 390, 2, head_dim), dtype)
        mask = _random_mask((4, *_blocks(300, 390)))
        _run(lambda q, k, v: flash_attn_func(q, k, v, dropout_p, causal=causal, block_mask=mask, return_lse=True,
                                             impl="cuda"), q, k, v, dout)
        lengths = torch.tensor([0, 1, 170, 300, 33])
        cu = torch.tensor([0, *lengths.cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        q, k, v, dout = _inputs((int(lengths.sum()), 4, head_dim), (int(lengths.sum()), 1, head_dim), dtype)
        _run(lambda q, k, v: flash_attn_varlen_func(q, k, v, cu, cu, 300, 300, dropout_p, causal=causal,
                                                    block_mask=_random_mask(_blocks(300, 300), seed=1),
                                                    return_lse=True, impl="cuda"), q, k, v, dout)
    torch.cuda.synchronize()
    print("sanitizer grid done")


if __name__ == "__main__":
    _sanitizer_grid()
