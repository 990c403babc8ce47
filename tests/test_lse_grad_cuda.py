"""GPU: the log-sum-exp of both CUDA kernel families is differentiable. Gradients of a loss on out and lse together
(out * dout + lse * dlse + a square of lse, as tests/test_lse_grad.py) against the fp32 reference, by FlashAttention-2's
rule (tests/test_cuda_kernels.py: at most twice plain PyTorch's error in the same low precision); and the lse term is
not lost (the gradients differ from those of the out term alone by far more than that error).

    pytest -m cuda tests/test_lse_grad_cuda.py
"""

import math

import pytest
import torch

from flashtrain.kernels import flash_attn_func, flash_attn_varlen_func, naive_attention
from test_cuda_kernels import _assert_fa2_rule

pytestmark = pytest.mark.cuda


def _loss(out, lse, dout, dlse):
    finite = torch.where(lse > -math.inf, lse.float(), torch.zeros_like(lse, dtype=torch.float32))
    return (out.float() * dout.float()).sum() + (finite * dlse).sum() + 1e-2 * finite.square().sum()


def _grads(fn, q, k, v, dout, dlse, lse_term=True):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out, lse = fn(q, k, v)
    loss = _loss(out, lse, dout, dlse) if lse_term else (out.float() * dout.float()).sum()
    return torch.autograd.grad(loss, (q, k, v))


# (batch, seqlen, nheads, nheads_kv, head_dim, causal, deterministic)
CASES = [
    (2, 1000, 4, 4, 64, True, False),
    (1, 1536, 4, 4, 128, False, False),
    (2, 777, 8, 2, 128, True, False),  # GQA
    (1, 1024, 4, 4, 128, True, True),  # deterministic backward
    (2, 300, 4, 4, 256, False, False),
    (2, 200, 2, 2, 40, True, False),   # head dim padded to 48 / 64
]


@pytest.mark.parametrize("sm90", ["1", "0"], ids=["hopper-family", "mma-sync-family"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}-s{}-h{}/{}-d{}-c{}-det{}".format(*map(int, c)))
def test_lse_gradient_batch(case, sm90, monkeypatch):
    monkeypatch.setenv("FLASHTRAIN_SM90", sm90)
    batch, seqlen, nheads, nheads_kv, head_dim, causal, deterministic = case
    gen = torch.Generator("cuda").manual_seed(0)
    q, dout = (torch.randn(batch, seqlen, nheads, head_dim, device="cuda", generator=gen).bfloat16() for _ in "ab")
    k, v = (torch.randn(batch, seqlen, nheads_kv, head_dim, device="cuda", generator=gen).bfloat16() for _ in "ab")
    dlse = torch.randn(batch, nheads, seqlen, device="cuda", generator=gen)

    def ours(q, k, v):
        return flash_attn_func(q, k, v, causal=causal, deterministic=deterministic, return_lse=True, impl="cuda")

    kernel = _grads(ours, q, k, v, dout, dlse)
    fp32 = [x.float() for x in (q, k, v)]
    reference = _grads(lambda *x: flash_attn_func(*x, causal=causal, return_lse=True, impl="reference"),
                       *fp32, dout, dlse)
    lowp = _grads(lambda *x: naive_attention(*x, causal=causal), q, k, v, dout, dlse)
    for name, a, r, l in zip(("dq", "dk", "dv"), kernel, reference, lowp):
        _assert_fa2_rule(a, r, l, torch.bfloat16, name)
    out_only = _grads(ours, q, k, v, dout, dlse, lse_term=False)
    error = (kernel[0].float() - reference[0]).abs().max()
    assert (out_only[0].float() - reference[0]).abs().max() > 10 * error  # the lse term reached dq


@pytest.mark.parametrize("sm90", ["1", "0"], ids=["hopper-family", "mma-sync-family"])
def test_lse_gradient_varlen(sm90, monkeypatch):
    """Packed sequences 300, 0, 1, 1000 (an empty and a one-token sequence), GQA 8/2, causal, head dim 128."""
    monkeypatch.setenv("FLASHTRAIN_SM90", sm90)
    lengths = [300, 0, 1, 1000]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total = sum(lengths)
    gen = torch.Generator("cuda").manual_seed(1)
    q, dout = (torch.randn(total, 8, 128, device="cuda", generator=gen).bfloat16() for _ in "ab")
    k, v = (torch.randn(total, 2, 128, device="cuda", generator=gen).bfloat16() for _ in "ab")
    dlse = torch.randn(8, total, device="cuda", generator=gen)

    def attn(impl):
        return lambda q, k, v: flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True,
                                                      return_lse=True, impl=impl)

    kernel = _grads(attn("cuda"), q, k, v, dout, dlse)
    reference = _grads(attn("reference"), *[x.float() for x in (q, k, v)], dout, dlse)
    lowp = _grads(lambda *x: naive_attention(*x, cu, cu, causal=True), q, k, v, dout, dlse)
    for name, a, r, l in zip(("dq", "dk", "dv"), kernel, reference, lowp):
        _assert_fa2_rule(a, r, l, torch.bfloat16, name)


@pytest.mark.parametrize("sm90", ["1", "0"], ids=["hopper-family", "mma-sync-family"])
def test_lse_only_loss_broadcast_gradient(sm90, monkeypatch):
    """lse.sum() alone: dout is zeros, dlse arrives broadcast (stride 0) and is laid out like lse; dv is 0."""
    monkeypatch.setenv("FLASHTRAIN_SM90", sm90)
    gen = torch.Generator("cuda").manual_seed(2)
    q, k, v = (torch.randn(2, 512, 4, 64, device="cuda", generator=gen).bfloat16().requires_grad_() for _ in "abc")
    _, lse = flash_attn_func(q, k, v, causal=True, return_lse=True, impl="cuda")
    dq, dk, dv = torch.autograd.grad(lse.sum(), (q, k, v))
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    _, lse32 = flash_attn_func(q32, k32, v32, causal=True, return_lse=True, impl="reference")
    rq, rk = torch.autograd.grad(lse32.sum(), (q32, k32))
    assert torch.count_nonzero(dv) == 0
    for name, a, r in (("dq", dq, rq), ("dk", dk, rk)):
        err = (a.float() - r).abs().max().item()
        assert err <= 1e-2 * r.abs().max().item(), f"{name}: {err}"
