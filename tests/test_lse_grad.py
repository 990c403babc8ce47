"""The log-sum-exp is differentiable: a loss on out and lse together (a z-loss, a merge of partial attention
results written in autograd) gets the gradients of the float64 oracle (naive_attention, plain autograd through
logsumexp). The reference on CPU here; both CUDA kernel families in test_lse_grad_cuda.py.

Tolerances: float64 1e-10 and float32 2e-5 relative to the largest magnitude (at least 1), as tests/test_attention.py.
"""

import math

import pytest
import torch

from flashtrain.kernels import flash_attn_func, flash_attn_varlen_func, naive_attention
from tests.test_attention import RELATIVE_TOLERANCE, assert_close, float64_copies, make_inputs


def lse_loss(out, lse, dout, dlse):
    """(out * dout).sum() + (lse * dlse).sum() over the rows that see a key (-inf rows carry no gradient), plus a
    z-loss-like square so that dlse depends on lse."""
    seen = lse > -math.inf
    finite = torch.where(seen, lse, torch.zeros_like(lse))
    return (out * dout).sum() + (finite * dlse).sum() + 1e-2 * finite.square().sum()


def grads(attention, q, k, v, dout, dlse):
    out, lse = attention(q, k, v)
    assert lse.requires_grad
    loss = lse_loss(out.double(), lse.double(), dout.double(), dlse.double())
    return torch.autograd.grad(loss, (q, k, v))


# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, causal, options)
CASES = [
    (2, 33, 33, 4, 4, 16, False, {}),
    (2, 70, 70, 4, 2, 32, True, {}),                       # GQA, causal
    (1, 50, 20, 2, 1, 24, True, {}),                       # MQA, causal with rows that see no key
    (2, 40, 64, 4, 4, 16, False, {"window_size": (8, 4)}),
    (2, 40, 40, 4, 4, 16, True, {"softcap": 5.0}),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}-{c[1]}x{c[2]}-h{c[3]}/{c[4]}-d{c[5]}-c{int(c[6])}-{c[7]}")
def test_lse_gradient_batch(case, dtype):
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, causal, options = case
    q, k, v, dout = make_inputs((batch, seqlen_q, nheads, head_dim), (batch, seqlen_k, nheads_kv, head_dim), dtype)
    dlse = torch.randn(batch, nheads, seqlen_q, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    actual = grads(lambda *x: flash_attn_func(*x, causal=causal, return_lse=True, **options), q, k, v, dout, dlse)
    q64, k64, v64 = float64_copies(q, k, v)
    expected = grads(lambda *x: naive_attention(*x, causal=causal, **options), q64, k64, v64, dout, dlse)
    for name, a, e in zip(("dq", "dk", "dv"), actual, expected):
        assert_close(a, e, RELATIVE_TOLERANCE[dtype], name)
    # the lse term is not negligible: without it the gradients differ
    out_only = torch.autograd.grad((naive_attention(q64, k64, v64, causal=causal, **options)[0] * dout).sum(),
                                   (q64, k64))
    assert (expected[0] - out_only[0]).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_lse_gradient_varlen(dtype):
    """Packed sequences of lengths 5, 0, 1, 37 (an empty and a one-token sequence), GQA, causal."""
    lengths = [5, 0, 1, 37]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    total = cu[-1].item()
    q, k, v, dout = make_inputs((total, 4, 16), (total, 2, 16), dtype)
    dlse = torch.randn(4, total, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def ours(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True, return_lse=True)

    actual = grads(ours, q, k, v, dout, dlse)
    q64, k64, v64 = float64_copies(q, k, v)
    expected = grads(lambda *x: naive_attention(*x, cu, cu, causal=True), q64, k64, v64, dout, dlse)
    for name, a, e in zip(("dq", "dk", "dv"), actual, expected):
        assert_close(a, e, RELATIVE_TOLERANCE[dtype], name)


def test_lse_only_loss():
    """A loss on lse alone (out unused): dv is 0, dq and dk those of the oracle."""
    q, k, v, _ = make_inputs((1, 24, 2, 8), (1, 24, 2, 8))
    _, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    actual = torch.autograd.grad(lse.square().sum(), (q, k, v))
    q64, k64, v64 = float64_copies(q, k, v)
    expected = torch.autograd.grad(naive_attention(q64, k64, v64, causal=True)[1].square().sum(), (q64, k64, v64),
                                   allow_unused=True)
    assert_close(actual[0], expected[0], 1e-10, "dq")
    assert_close(actual[1], expected[1], 1e-10, "dk")
    assert torch.count_nonzero(actual[2]) == 0
