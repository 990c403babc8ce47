"""flash_attn_func / flash_attn_varlen_func (the plain-PyTorch reference) against the naive oracle.

The oracle is naive_attention run on float64 copies of the inputs. Tolerances: float64 1e-10 and float32 2e-5,
relative to the largest magnitude of the compared tensor (at least 1); fp16/bf16 follow FlashAttention-2's test criterion (error at
most twice that of naive attention run in the same low precision).
"""

import math

import pytest
import torch

from flashtrain.kernels import BLOCK_SPARSE_SIZE, flash_attn_func, flash_attn_varlen_func, naive_attention

RELATIVE_TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5}


def make_inputs(q_shape, kv_shape, dtype=torch.float64, seed=0, requires_grad=True):
    """Random q, k, v and an output gradient dout of q's shape."""
    generator = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in (q_shape, kv_shape, kv_shape)]
    dout = torch.randn(q_shape, generator=generator, dtype=torch.float64).to(dtype)
    return [x.to(dtype).requires_grad_(requires_grad) for x in tensors] + [dout]


def out_lse_grads(attention, q, k, v, dout):
    """attention(q, k, v) -> (out, lse); returns out, lse and the gradients of (out * dout).sum() w.r.t. q, k, v."""
    out, lse = attention(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return out, lse, grads


def float64_copies(*tensors):
    return [x.detach().double().requires_grad_(x.requires_grad) for x in tensors]


def assert_close(actual, expected, relative_tolerance, name):
    """max |actual - expected| <= tolerance * max(max |expected|, 1), the 1 for tensors that are 0 in exact arithmetic
    (dq when each query sees one key); -inf (lse of a row that sees no key) must match exactly."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    expected_inf = expected == -math.inf
    assert torch.equal(actual == -math.inf, expected_inf), f"{name}: -inf entries differ"
    actual, expected = actual[~expected_inf].double(), expected[~expected_inf].double()
    if expected.numel() == 0:
        return
    error = (actual - expected).abs().max().item()
    scale = max(expected.abs().max().item(), 1.0)
    assert error <= relative_tolerance * scale, f"{name}: max error {error:.3e} > {relative_tolerance} * {scale:.3e}"


def assert_all_close(results, oracle, relative_tolerance):
    for name, actual, expected in zip(("out", "lse", "dq", "dk", "dv"), (*results[:2], *results[2]), (*oracle[:2], *oracle[2])):
        assert_close(actual, expected, relative_tolerance, name)


# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, causal): awkward lengths, head dims not powers of two,
# seqlen_q != seqlen_k both ways (causal with seqlen_q > seqlen_k has rows that see no key), GQA and MQA.
BATCH_CASES = [
    (2, 17, 17, 4, 4, 16, False),
    (2, 97, 97, 4, 4, 40, True),
    (1, 1025, 1025, 2, 2, 64, True),
    (1, 300, 1025, 2, 1, 32, False),
    (3, 1, 1, 2, 2, 72, False),
    (2, 1, 97, 2, 2, 24, True),
    (1, 17, 1025, 8, 2, 72, True),
    (1, 1025, 97, 4, 1, 128, True),
    (2, 97, 17, 2, 2, 200, False),
    (1, 33, 300, 8, 2, 256, True),
    (1, 300, 130, 6, 3, 48, True),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", BATCH_CASES, ids=lambda case: "-".join(map(str, case)))
def test_batch_matches_oracle(case, dtype):
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, causal = case
    q, k, v, dout = make_inputs((batch, seqlen_q, nheads, head_dim), (batch, seqlen_k, nheads_kv, head_dim), dtype)
    results = out_lse_grads(
        lambda q, k, v: flash_attn_func(q, k, v, causal=causal, return_lse=True, impl="reference"), q, k, v, dout
    )
    oracle = out_lse_grads(lambda q, k, v: naive_attention(q, k, v, causal=causal), *float64_copies(q, k, v, dout))
    assert results[0].dtype == dtype and results[1].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_all_close(results, oracle, RELATIVE_TOLERANCE[dtype])


def random_cu_seqlens(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


# per-sequence (seqlen_q, seqlen_k): includes empty and single-token sequences, a query sequence with no keys
VARLEN_LENGTHS = [(0, 5), (1, 1), (130, 300), (17, 17), (300, 97), (5, 0), (129, 1)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nheads,nheads_kv", [(4, 4), (4, 1)])
def test_varlen_matches_oracle(nheads, nheads_kv, causal, dtype):
    lengths_q, lengths_k = zip(*VARLEN_LENGTHS)
    cu_seqlens_q, cu_seqlens_k = random_cu_seqlens(lengths_q), random_cu_seqlens(lengths_k)
    q, k, v, dout = make_inputs((sum(lengths_q), nheads, 40), (sum(lengths_k), nheads_kv, 40), dtype)
    results = out_lse_grads(
        lambda q, k, v: flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max(lengths_q), max(lengths_k), causal=causal, return_lse=True,
            impl="reference",
        ),
        q, k, v, dout,
    )
    oracle = out_lse_grads(
        lambda q, k, v: naive_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal),
        *float64_copies(q, k, v, dout),
    )
    assert_all_close(results, oracle, RELATIVE_TOLERANCE[dtype])


def test_varlen_with_equal_lengths_equals_batch_form():
    q, k, v, _ = make_inputs((3, 150, 4, 32), (3, 200, 2, 32), requires_grad=False)
    out_batch, lse_batch = flash_attn_func(q, k, v, causal=True, return_lse=True)
    cu_seqlens_q, cu_seqlens_k = random_cu_seqlens([150] * 3), random_cu_seqlens([200] * 3)
    out_varlen, lse_varlen = flash_attn_varlen_func(
        q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_seqlens_q, cu_seqlens_k, 150, 200, causal=True,
        return_lse=True,
    )
    assert torch.equal(out_varlen, out_batch.flatten(0, 1))
    assert torch.equal(lse_varlen, lse_batch.transpose(0, 1).flatten(1))


def test_strided_inputs_from_packed_qkv():
    """q, k, v as views of one (batch, seqlen, 3, nheads, head_dim) tensor, as a fused projection produces them."""
    qkv = torch.randn(2, 97, 3, 4, 40, dtype=torch.float64)
    q, k, v = qkv.unbind(2)
    out = flash_attn_func(q, k, v, causal=True)
    expected, _ = naive_attention(q, k, v, causal=True)
    assert_close(out, expected, 1e-10, "out")


def test_softmax_scale():
    q, k, v, _ = make_inputs((2, 97, 2, 16), (2, 97, 2, 16), requires_grad=False)
    out = flash_attn_func(q, k, v, softmax_scale=0.37)
    expected, _ = naive_attention(q, k, v, softmax_scale=0.37)
    assert_close(out, expected, 1e-10, "out")


def test_rows_that_see_no_key():
    """Causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k queries see no key."""
    q, k, v, dout = make_inputs((2, 300, 4, 32), (2, 100, 2, 32))
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert torch.equal(out[:, :200], torch.zeros_like(out[:, :200]))
    assert (lse[:, :, :200] == -math.inf).all() and torch.isfinite(lse[:, :, 200:]).all()
    assert torch.equal(dq[:, :200], torch.zeros_like(dq[:, :200]))
    assert all(torch.isfinite(grad).all() for grad in (dq, dk, dv))


# ---- dropout -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_explicit_dropout_mask_matches_oracle(causal):
    q, k, v, dout = make_inputs((2, 150, 4, 32), (2, 200, 2, 32))
    keep = torch.rand(2, 4, 150, 200, generator=torch.Generator().manual_seed(1)) >= 0.3
    options = dict(dropout_p=0.3, dropout_mask=keep, causal=causal)
    results = out_lse_grads(lambda q, k, v: flash_attn_func(q, k, v, return_lse=True, **options), q, k, v, dout)
    oracle = out_lse_grads(lambda q, k, v: naive_attention(q, k, v, **options), q, k, v, dout)
    assert_all_close(results, oracle, 1e-10)


def test_explicit_dropout_mask_varlen_matches_oracle():
    lengths_q, lengths_k = zip(*VARLEN_LENGTHS)
    cu_seqlens_q, cu_seqlens_k = random_cu_seqlens(lengths_q), random_cu_seqlens(lengths_k)
    q, k, v, dout = make_inputs((sum(lengths_q), 4, 24), (sum(lengths_k), 2, 24))
    keep = torch.rand(4, sum(lengths_q), max(lengths_k), generator=torch.Generator().manual_seed(1)) >= 0.2
    options = dict(dropout_p=0.2, dropout_mask=keep, causal=True)
    results = out_lse_grads(
        lambda q, k, v: flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max(lengths_q), max(lengths_k), return_lse=True, **options
        ),
        q, k, v, dout,
    )
    oracle = out_lse_grads(lambda q, k, v: naive_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, **options), q, k, v, dout)
    assert_all_close(results, oracle, 1e-10)


def identity_values(batch, seqlen_k, nheads_kv):
    """v with head_dim = seqlen_k and v[b, j, h] = e_j, so that out = the dropped-out probabilities themselves."""
    eye = torch.eye(seqlen_k, dtype=torch.float64)
    return eye[None, :, None, :].expand(batch, seqlen_k, nheads_kv, seqlen_k).contiguous()


def test_generated_dropout_mask_is_reproducible_and_backward_uses_it():
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, dropout_p = 2, 150, 200, 4, 2, 0.25  # several tiles each way
    q, k, v, dout = make_inputs((batch, seqlen_q, nheads, seqlen_k), (batch, seqlen_k, nheads_kv, seqlen_k))

    def attention(q, k, v, seed):
        generator = torch.Generator().manual_seed(seed)
        return flash_attn_func(q, k, v, dropout_p, causal=True, return_lse=True, generator=generator)

    # with v = identity, out is softmax(S) * keep / (1 - p): every visible probability is > 0, so keep = out != 0
    probs_dropped, _ = attention(q.detach(), k.detach(), identity_values(batch, seqlen_k, nheads_kv), seed=7)
    keep = (probs_dropped != 0).permute(0, 2, 1, 3)  # (batch, nheads, seqlen_q, seqlen_k)
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool).tril(seqlen_k - seqlen_q)
    kept_fraction = keep[..., visible].double().mean().item()
    samples = batch * nheads * visible.sum().item()
    assert abs(kept_fraction - (1 - dropout_p)) < 4 * math.sqrt(dropout_p * (1 - dropout_p) / samples)

    results = out_lse_grads(lambda q, k, v: attention(q, k, v, seed=7), q, k, v, dout)
    again = out_lse_grads(lambda q, k, v: attention(q, k, v, seed=7), q, k, v, dout)
    other_seed, _ = attention(q, k, v, seed=8)
    oracle = out_lse_grads(
        lambda q, k, v: naive_attention(q, k, v, causal=True, dropout_p=dropout_p, dropout_mask=keep), q, k, v, dout
    )
    assert_all_close(results, oracle, 1e-10)  # forward and backward both used the recovered mask
    assert all(torch.equal(a, b) for a, b in zip((*results[:2], *results[2]), (*again[:2], *again[2])))
    assert not torch.allclose(other_seed, results[0])


def test_generated_dropout_masks_of_tiles_heads_and_batches_agree_at_chance_rate():
    """Each (batch row, head, query tile, key tile) draws its own keep-mask: with p = 0.5 two independent masks agree
    on half their entries (+- 5 sigma = 0.02 over a 128 x 128 tile); a mask repeated across tiles, heads or batch rows
    would agree everywhere."""
    batch, seqlen, nheads, nheads_kv, dropout_p, tile = 2, 2 * BLOCK_SPARSE_SIZE, 4, 2, 0.5, BLOCK_SPARSE_SIZE
    q, k, _, _ = make_inputs((batch, seqlen, nheads, seqlen), (batch, seqlen, nheads_kv, seqlen), requires_grad=False)
    out = flash_attn_func(q, k, identity_values(batch, seqlen, nheads_kv), dropout_p,
                          generator=torch.Generator().manual_seed(11))
    keep = (out != 0).permute(0, 2, 1, 3)  # (batch, nheads, seqlen_q, seqlen_k): non-causal, every probability > 0
    assert abs(keep.double().mean().item() - (1 - dropout_p)) < 0.01

    def block(b, h, q_tile, k_tile):
        return keep[b, h, q_tile * tile:(q_tile + 1) * tile, k_tile * tile:(k_tile + 1) * tile]

    pairs = {"query tiles": ((0, 0, 0, 0), (0, 0, 1, 0)), "key tiles": ((0, 0, 1, 0), (0, 0, 1, 1)),
             "heads sharing k/v (GQA)": ((1, 0, 0, 1), (1, 1, 0, 1)), "heads": ((1, 1, 1, 1), (1, 2, 1, 1)),
             "batch rows": ((0, 3, 1, 0), (1, 3, 1, 0))}
    for what, (a, b) in pairs.items():
        agreement = (block(*a) == block(*b)).double().mean().item()
        assert abs(agreement - 0.5) < 5 * math.sqrt(0.25 / tile ** 2), (what, agreement)


def test_generated_dropout_same_mask_in_float32_and_float64():
    q, k, v, _ = make_inputs((1, 200, 2, 32), (1, 200, 2, 32), requires_grad=False)
    out64 = flash_attn_func(q, k, v, 0.5, generator=torch.Generator().manual_seed(3))
    out32 = flash_attn_func(q.float(), k.float(), v.float(), 0.5, generator=torch.Generator().manual_seed(3))
    assert_close(out32, out64, 2e-5, "out")


# ---- block sparsity ----------------------------------------------------------------------------------------------


def random_block_mask(shape, seed):
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < 0.5
    mask[..., 1, :] = False  # a query block that sees nothing
    return mask


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("per_head", [False, True])
def test_block_sparse_matches_oracle(per_head, causal):
    seqlen_q, seqlen_k, nheads = 400, 520, 4
    blocks = (math.ceil(seqlen_q / BLOCK_SPARSE_SIZE), math.ceil(seqlen_k / BLOCK_SPARSE_SIZE))
    block_mask = random_block_mask((nheads, *blocks) if per_head else blocks, seed=int(per_head) + 2 * int(causal))
    q, k, v, dout = make_inputs((2, seqlen_q, nheads, 24), (2, seqlen_k, 2, 24))
    options = dict(block_mask=block_mask, causal=causal)
    results = out_lse_grads(lambda q, k, v: flash_attn_func(q, k, v, return_lse=True, **options), q, k, v, dout)
    oracle = out_lse_grads(lambda q, k, v: naive_attention(q, k, v, **options), q, k, v, dout)
    assert_all_close(results, oracle, 1e-10)
    assert (results[1][:, :, BLOCK_SPARSE_SIZE : 2 * BLOCK_SPARSE_SIZE] == -math.inf).all()
    assert torch.equal(results[0][:, BLOCK_SPARSE_SIZE : 2 * BLOCK_SPARSE_SIZE], torch.zeros(2, 128, nheads, 24, dtype=q.dtype))


def test_block_sparse_varlen_matches_oracle():
    lengths_q, lengths_k = zip(*VARLEN_LENGTHS)
    cu_seqlens_q, cu_seqlens_k = random_cu_seqlens(lengths_q), random_cu_seqlens(lengths_k)
    block_mask = random_block_mask((4, 3, 3), seed=5)
    q, k, v, dout = make_inputs((sum(lengths_q), 4, 16), (sum(lengths_k), 4, 16))
    options = dict(block_mask=block_mask, causal=True)
    results = out_lse_grads(
        lambda q, k, v: flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max(lengths_q), max(lengths_k), return_lse=True, **options
        ),
        q, k, v, dout,
    )
    oracle = out_lse_grads(lambda q, k, v: naive_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, **options), q, k, v, dout)
    assert_all_close(results, oracle, 1e-10)


def test_block_mask_of_ones_equals_dense():
    q, k, v, dout = make_inputs((2, 300, 4, 32), (2, 260, 4, 32))
    dense = out_lse_grads(lambda q, k, v: flash_attn_func(q, k, v, causal=True, return_lse=True), q, k, v, dout)
    ones = torch.ones(3, 3, dtype=torch.bool)
    sparse = out_lse_grads(
        lambda q, k, v: flash_attn_func(q, k, v, causal=True, block_mask=ones, return_lse=True), q, k, v, dout
    )
    assert all(torch.equal(a, b) for a, b in zip((*dense[:2], *dense[2]), (*sparse[:2], *sparse[2])))


def test_skipped_blocks_are_never_computed():
    """NaN keys/values in blocks that must be skipped (block_mask 0, or entirely in the causal future) would reach
    out through 0 * NaN if those blocks were computed and masked instead of skipped."""
    q, k, v, dout = make_inputs((1, 256, 2, 16), (1, 384, 2, 16))
    poisoned = torch.zeros(384, dtype=torch.bool)
    poisoned[128:256] = True  # key block 1
    k_poisoned = k.detach().masked_fill(poisoned[None, :, None, None], math.nan).requires_grad_()
    v_poisoned = v.detach().masked_fill(poisoned[None, :, None, None], math.nan).requires_grad_()
    block_mask = torch.tensor([[True, False, True], [True, False, True]])
    out, lse = flash_attn_func(q, k_poisoned, v_poisoned, block_mask=block_mask, return_lse=True)
    expected, expected_lse = naive_attention(q, k, v, block_mask=block_mask)
    assert_close(out, expected, 1e-10, "out")
    dq, dk, dv = torch.autograd.grad(out, (q, k_poisoned, v_poisoned), dout)
    assert all(torch.isfinite(grad).all() for grad in (dq, dk, dv))
    assert torch.equal(dk[:, 128:256], torch.zeros_like(dk[:, 128:256]))

    # causal, seqlen_q == seqlen_k: key block 1 is entirely in the future of query block 0
    q0 = q[:, :256].detach()
    out = flash_attn_func(q0, k_poisoned[:, :256], v_poisoned[:, :256], causal=True)
    expected, _ = naive_attention(q0[:, :128], k[:, :128], v[:, :128], causal=True)
    assert_close(out[:, :128], expected, 1e-10, "out of query block 0")


# ---- low precision -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_low_precision_error_at_most_twice_naive(dtype, causal):
    q, k, v, dout = make_inputs((2, 257, 4, 64), (2, 257, 2, 64), dtype)
    results = out_lse_grads(lambda q, k, v: flash_attn_func(q, k, v, causal=causal, return_lse=True), q, k, v, dout)
    naive_low = out_lse_grads(lambda q, k, v: naive_attention(q, k, v, causal=causal), q, k, v, dout)
    oracle = out_lse_grads(lambda q, k, v: naive_attention(q, k, v, causal=causal), *float64_copies(q, k, v, dout))
    assert results[0].dtype == dtype and results[1].dtype == torch.float32
    for name, actual, low, expected in zip(
        ("out", "dq", "dk", "dv"), (results[0], *results[2]), (naive_low[0], *naive_low[2]), (oracle[0], *oracle[2])
    ):
        error = (actual.double() - expected).abs().max().item()
        naive_error = (low.double() - expected).abs().max().item()
        assert error <= 2 * naive_error, f"{name}: error {error:.3e} > 2 x naive {dtype} error {naive_error:.3e}"


# ---- gradcheck ---------------------------------------------------------------------------------------------------


def gradcheck(attention, q, k, v, fast_mode=False):
    assert torch.autograd.gradcheck(lambda q, k, v: attention(q, k, v)[0], (q, k, v), fast_mode=fast_mode)


def test_gradcheck_causal_gqa_with_dropout():
    q, k, v, _ = make_inputs((1, 5, 4, 4), (1, 7, 2, 4))
    gradcheck(lambda q, k, v: flash_attn_func(q, k, v, causal=True, return_lse=True), q, k, v)
    # a fresh generator with the same seed per call: the mask is re-derived identically in every forward/backward
    gradcheck(
        lambda q, k, v: flash_attn_func(
            q, k, v, 0.3, causal=True, return_lse=True, generator=torch.Generator().manual_seed(11)
        ),
        q, k, v,
    )


def test_gradcheck_varlen():
    cu_seqlens_q, cu_seqlens_k = random_cu_seqlens([3, 0, 7, 1]), random_cu_seqlens([5, 2, 4, 1])
    q, k, v, _ = make_inputs((11, 2, 8), (12, 1, 8))
    gradcheck(
        lambda q, k, v: flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, 7, 5, causal=True, return_lse=True),
        q, k, v,
    )


def test_gradcheck_block_sparse():
    q, k, v, _ = make_inputs((1, 260, 2, 4), (1, 140, 2, 4))
    block_mask = torch.tensor([[[True, False], [False, True], [True, True]], [[False, True], [True, True], [False, False]]])
    gradcheck(lambda q, k, v: flash_attn_func(q, k, v, block_mask=block_mask, return_lse=True), q, k, v, fast_mode=True)


# ---- validation --------------------------------------------------------------------------------------------------


def _batch_inputs(**overrides):
    q = torch.randn(2, 130, 4, 32)
    k = torch.randn(2, 140, 2, 32)
    v = torch.randn(2, 140, 2, 32)
    return {"q": q, "k": k, "v": v} | overrides


def _varlen_inputs(**overrides):
    inputs = {
        "q": torch.randn(30, 4, 32),
        "k": torch.randn(20, 2, 32),
        "v": torch.randn(20, 2, 32),
        "cu_seqlens_q": torch.tensor([0, 10, 30], dtype=torch.int32),
        "cu_seqlens_k": torch.tensor([0, 5, 20], dtype=torch.int32),
        "max_seqlen_q": 20,
        "max_seqlen_k": 15,
    }
    return inputs | overrides


BAD_BATCH_CALLS = [
    (dict(k=torch.randn(2, 140, 2, 32, dtype=torch.float64)), TypeError, "k.dtype"),
    (dict(q=torch.randint(0, 3, (2, 130, 4, 32))), TypeError, "q.dtype"),
    (dict(v=torch.randn(2, 140, 2, 32, device="meta")), ValueError, "v is on"),
    (dict(q=torch.randn(2, 130, 128)), ValueError, "q must have 4 dims"),
    (dict(k=torch.randn(2, 140, 32, 2).transpose(2, 3)), ValueError, "k must be contiguous in its last dim"),
    (dict(q=torch.randn(1, 8, 4, 520), k=torch.randn(1, 8, 2, 520), v=torch.randn(1, 8, 2, 520)), ValueError, "head_dim"),
    (dict(q=torch.randn(2, 130, 6, 32), k=torch.randn(2, 140, 4, 32), v=torch.randn(2, 140, 4, 32)), ValueError, "nheads_kv"),
    (dict(v=torch.randn(2, 139, 2, 32)), ValueError, "v must have k's shape"),
    (dict(k=torch.randn(3, 140, 2, 32), v=torch.randn(3, 140, 2, 32)), ValueError, "k: batch"),
    (dict(block_mask=torch.ones(2, 3, dtype=torch.bool)), ValueError, "block_mask"),
    (dict(block_mask=torch.ones(3, 2, 2, dtype=torch.bool)), ValueError, "block_mask"),
    (dict(block_mask=torch.ones(2, 2)), TypeError, "block_mask"),
    (dict(dropout_p=1.0), ValueError, "dropout_p"),
    (dict(dropout_p=-0.1), ValueError, "dropout_p"),
    (dict(dropout_p=0.1, dropout_mask=torch.ones(2, 4, 130, 141, dtype=torch.bool)), ValueError, "dropout_mask"),
    (dict(dropout_p=0.1, dropout_mask=torch.ones(2, 4, 130, 140)), TypeError, "dropout_mask"),
    (dict(dropout_mask=torch.ones(2, 4, 130, 140, dtype=torch.bool)), ValueError, "dropout_mask"),
    (dict(softmax_scale="0.1"), TypeError, "softmax_scale"),
    (dict(causal=1), TypeError, "causal"),
    (dict(generator=0), TypeError, "generator"),
    (dict(impl="triton"), ValueError, "impl"),
    # every other branch of the validation, each by its own message
    (dict(q=[[1.0]]), TypeError, "q must be a torch.Tensor, got list"),
    (dict(k=torch.randn(2, 140, 2, 16), v=torch.randn(2, 140, 2, 16)), ValueError, "k: head_dim 16 differs from q's 32"),
    (dict(k=torch.randn(2, 140, 0, 32), v=torch.randn(2, 140, 0, 32)), ValueError, r"nheads_kv \(k.shape\[-2\] = 0\)"),
    (dict(dropout_p="0.1"), TypeError, "dropout_p must be a float, got str"),
    (dict(dropout_p=True), TypeError, "dropout_p must be a float, got bool"),
    (dict(softmax_scale=float("nan")), ValueError, "softmax_scale must be finite, got nan"),
    (dict(softmax_scale=float("inf")), ValueError, "softmax_scale must be finite, got inf"),
    (dict(softmax_scale=True), TypeError, "softmax_scale must be a float or None, got bool"),
    (dict(return_lse=None), TypeError, "return_lse must be a bool, got NoneType"),
    (dict(block_mask=[[True]]), TypeError, "block_mask must be a torch.Tensor or None, got list"),
    (dict(block_mask=torch.ones(2, 2, dtype=torch.bool, device="meta")), ValueError,
     "block_mask is on meta but q is on cpu"),  # a mask on another device than q (a CPU mask with CUDA tensors)
    (dict(dropout_p=0.1, dropout_mask=[[True]]), TypeError, "dropout_mask must be a torch.Tensor or None, got list"),
    (dict(dropout_p=0.1, dropout_mask=torch.ones(2, 4, 130, 140, dtype=torch.bool, device="meta")), ValueError,
     "dropout_mask is on meta but q is on cpu"),
    (dict(return_lse=1), TypeError, "return_lse"),
    (dict(deterministic="yes"), TypeError, "deterministic"),
    (dict(sliding_window=128), TypeError, "unexpected keyword argument 'sliding_window'"),  # not our name
    (dict(window_size=3), TypeError, r"window_size must be a pair of ints \(left, right\), got 3"),
    (dict(window_size=(2.5, 0)), TypeError, "window_size must be a pair of ints"),
    (dict(window_size=(-2, 4)), ValueError, r"window_size entries must be >= -1"),
    (dict(window_size=(8, 4), causal=True), ValueError, "causal is right = 0, so right must be -1 or 0"),
    (dict(softcap=-1.0), ValueError, "softcap must be finite and >= 0"),
    (dict(softcap="30"), TypeError, "softcap must be a float, got str"),
    (dict(alibi_slopes=torch.ones(4, dtype=torch.float64)), TypeError, "alibi_slopes must be float32"),
    (dict(alibi_slopes=torch.ones(3)), ValueError, r"alibi_slopes must be \(4,\) or \(2, 4\)"),
    (dict(alibi_slopes=[0.5] * 4), TypeError, "alibi_slopes must be a float32 tensor, got list"),
]


@pytest.mark.parametrize("overrides,error,argument", BAD_BATCH_CALLS, ids=[case[2] for case in BAD_BATCH_CALLS])
def test_batch_validation_names_the_argument(overrides, error, argument):
    with pytest.raises(error, match=argument):
        flash_attn_func(**_batch_inputs(**overrides))


BAD_VARLEN_CALLS = [
    (dict(cu_seqlens_q=torch.tensor([0, 10, 30])), TypeError, "cu_seqlens_q must be int32"),
    (dict(cu_seqlens_k=torch.tensor([0, 15, 5, 20], dtype=torch.int32)), ValueError, "cu_seqlens_k must be non-decreasing"),
    (dict(cu_seqlens_k=torch.tensor([0, 5, 10, 20], dtype=torch.int32)), ValueError, "cu_seqlens_k has length"),
    (dict(cu_seqlens_q=torch.tensor([0, 10, 29], dtype=torch.int32)), ValueError, r"cu_seqlens_q\[-1\]"),
    (dict(cu_seqlens_q=torch.tensor([1, 10, 30], dtype=torch.int32)), ValueError, "cu_seqlens_q must start at 0"),
    (dict(cu_seqlens_q=torch.tensor([[0, 10, 30]], dtype=torch.int32)), ValueError, "cu_seqlens_q must be 1-D"),
    (dict(max_seqlen_q=19), ValueError, "max_seqlen_q"),
    (dict(max_seqlen_k=15.0), TypeError, "max_seqlen_k"),
    (dict(q=torch.randn(2, 15, 4, 32)), ValueError, "q must have 3 dims"),
    (dict(block_mask=torch.ones(2, 1, dtype=torch.bool)), ValueError, "block_mask"),
    (dict(dropout_p=0.1, dropout_mask=torch.ones(4, 30, 20, dtype=torch.bool)), ValueError, "dropout_mask"),
    (dict(cu_seqlens_k=[0, 5, 20]), TypeError, "cu_seqlens_k must be a torch.Tensor, got list"),
    (dict(cu_seqlens_q=torch.tensor([0, 10, 30], dtype=torch.int32, device="meta")), ValueError,
     "cu_seqlens_q is on meta but q is on cpu"),
    (dict(max_seqlen_q=-1), ValueError, "max_seqlen_q must be >= 0, got -1"),
    (dict(max_seqlen_k=True), TypeError, "max_seqlen_k must be an int, got bool"),
    (dict(impl="triton"), ValueError, "impl"),
    (dict(logit_cap=30.0), TypeError, r"flash_attn_varlen_func\(\) got an unexpected keyword argument 'logit_cap'"),
    (dict(alibi_slopes=torch.ones(3, 4)), ValueError, r"alibi_slopes must be \(4,\) or \(2, 4\)"),  # 2 sequences
]


@pytest.mark.parametrize("overrides,error,argument", BAD_VARLEN_CALLS, ids=[case[2] for case in BAD_VARLEN_CALLS])
def test_varlen_validation_names_the_argument(overrides, error, argument):
    with pytest.raises(error, match=argument):
        flash_attn_varlen_func(**_varlen_inputs(**overrides))


BAD_OFFSETS = [
    ([1, 10, 30], 30, 20, "cu_seqlens_q must start at 0"),
    ([0, 10, 29], 30, 20, "end at the number of packed rows 30"),
    ([0, 15, 5, 30], 30, 20, "non-decreasing"),
    ([0, 10, 30], 30, 19, "max_seqlen_q = 19"),
]


@pytest.mark.parametrize("offsets,total,max_seqlen,message", BAD_OFFSETS, ids=[case[3] for case in BAD_OFFSETS])
def test_device_offset_assert_names_the_argument(offsets, total, max_seqlen, message):
    """The check that CUDA cu_seqlens get instead of a host sync (torch._assert_async; on a CPU tensor it raises at
    once, which lets the CPU run the same code)."""
    from flashtrain.kernels import interface

    cu_seqlens = torch.tensor(offsets, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=message):
        interface._assert_offsets_on_device("cu_seqlens_q", cu_seqlens, total, "max_seqlen_q", max_seqlen)


def test_device_offset_assert_runs_once_per_tensor_version():
    """Layers sharing one cu_seqlens check it once; an in-place change (a new version) is checked again."""
    from flashtrain.kernels import interface

    cu_seqlens = torch.tensor([0, 10, 30], dtype=torch.int32)
    interface._assert_offsets_on_device("cu_seqlens_k", cu_seqlens, 30, "max_seqlen_k", 20)
    assert interface._asserted_offsets[cu_seqlens] == {(cu_seqlens._version, 30, 20)}
    interface._assert_offsets_on_device("cu_seqlens_k", cu_seqlens, 30, "max_seqlen_k", 20)
    assert len(interface._asserted_offsets[cu_seqlens]) == 1
    cu_seqlens[1] = 25
    with pytest.raises(RuntimeError, match="cu_seqlens_k"):
        interface._assert_offsets_on_device("cu_seqlens_k", cu_seqlens, 30, "max_seqlen_k", 20)


def test_flash_attn_positional_arguments():
    """flash-attn's positional order (q, k, v, [cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,] dropout_p,
    softmax_scale, causal); every other option is keyword-only."""
    inputs = _batch_inputs()
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    positional = flash_attn_func(q, k, v, 0.0, 0.3, True)
    assert torch.equal(positional, flash_attn_func(q, k, v, softmax_scale=0.3, causal=True))
    assert not torch.equal(positional, flash_attn_func(q, k, v, 0.0, 0.3, False))
    varlen = _varlen_inputs()
    args = [varlen[name] for name in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")]
    assert torch.equal(flash_attn_varlen_func(*args, 0.0, 0.3, True),
                       flash_attn_varlen_func(*args, softmax_scale=0.3, causal=True))
    with pytest.raises(TypeError, match="positional"):
        flash_attn_func(q, k, v, 0.0, 0.3, True, None)  # block_mask is keyword-only


def test_cuda_impl_on_cpu_tensors_raises():
    with pytest.raises(RuntimeError, match="impl='cuda' cannot run: the tensors are on cpu"):
        flash_attn_func(**_batch_inputs(), impl="cuda")


@pytest.mark.cuda
def test_reference_on_cuda_matches_oracle():
    q, k, v, dout = (x.detach().cuda() for x in make_inputs((2, 300, 4, 40), (2, 200, 2, 40)))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    keep = torch.rand(2, 4, 300, 200, device="cuda") >= 0.2
    options = dict(causal=True, dropout_p=0.2, dropout_mask=keep)
    results = out_lse_grads(
        lambda q, k, v: flash_attn_func(q, k, v, return_lse=True, impl="reference", **options), q, k, v, dout
    )
    oracle = out_lse_grads(lambda q, k, v: naive_attention(q, k, v, **options), q, k, v, dout)
    assert_all_close(results, oracle, 1e-10)
    generated = flash_attn_func(q, k, v, 0.2, generator=torch.Generator("cuda").manual_seed(0), impl="reference")
    again = flash_attn_func(q, k, v, 0.2, generator=torch.Generator("cuda").manual_seed(0), impl="reference")
    assert torch.equal(generated, again)


@pytest.mark.cuda
def test_reference_per_head_block_mask_on_cuda_matches_oracle():
    # the reference builds its per-head skip masks from the CPU copy of block_mask: they must reach the GPU scores
    q, k, v, dout = (x.detach().cuda() for x in make_inputs((2, 400, 4, 24), (2, 520, 2, 24)))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    options = dict(block_mask=random_block_mask((4, 4, 5), seed=3).cuda(), causal=True)
    results = out_lse_grads(
        lambda q, k, v: flash_attn_func(q, k, v, return_lse=True, impl="reference", **options), q, k, v, dout
    )
    oracle = out_lse_grads(lambda q, k, v: naive_attention(q, k, v, **options), q, k, v, dout)
    assert_all_close(results, oracle, 1e-10)


def test_numbers_of_any_numeric_type_are_accepted():
    """dropout_p, softmax_scale and max_seqlen_q/k given as numpy scalars or 0-d tensors act as the Python numbers
    (robustness: numbers of any numeric type are accepted where a number is meant)."""
    import numpy as np

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 20, 2, 16) for _ in range(3))
    expected = flash_attn_func(q, k, v, 0.0, 0.25, causal=True)
    for dropout_p, scale in ((np.float32(0.0), np.float64(0.25)), (torch.tensor(0.0), torch.tensor(0.25)),
                             (0, np.float16(0.25))):
        torch.testing.assert_close(flash_attn_func(q, k, v, dropout_p, scale, causal=True), expected, rtol=0, atol=0)
    cu = torch.tensor([0, 12, 20], dtype=torch.int32)
    packed = [x.reshape(40, 2, 16)[:20] for x in (q, k, v)]
    expected = flash_attn_varlen_func(*packed, cu, cu, 12, 12)
    for max_len in (np.int64(12), torch.tensor(12)):
        torch.testing.assert_close(flash_attn_varlen_func(*packed, cu, cu, max_len, max_len), expected, rtol=0, atol=0)
    with pytest.raises(TypeError, match="dropout_p must be a float, got ndarray"):
        flash_attn_func(q, k, v, np.array([0.0, 0.1]))
    with pytest.raises(TypeError, match="max_seqlen_q must be an int, got float"):
        flash_attn_varlen_func(*packed, cu, cu, np.float64(12.0), 12)
