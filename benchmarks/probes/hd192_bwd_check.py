"""Probe: the head-dim-192 Hopper backward (96-key tiles, build.BWD_SM90_HD192_N96 = 1, and the 64-key split kernel,
= 0) against fp32 PyTorch SDPA (math backend) at benchmark-sized shapes the unit tests do not reach (4K-8K tokens,
many key tiles per CTA, partial last tiles, GQA). Per shape and variant: the max error of out / dq / dk / dv against
the fp32 result, the error of the same attention written out in bf16, and FlashAttention-2's rule (kernel error <= 2 x bf16 error + 2 x
rounding + 1e-5, tests/test_cuda_kernels.py); the two variants' gradients against each other too. Exit status 1 if a
rule fails or a value is not finite.

    PYTHONPATH=$PWD python3 benchmarks/probes/hd192_bwd_check.py [--shapes 2:4096:16:16:causal ...]

A shape is batch:seqlen:heads:kv_heads:causal|full (head dim 192, bf16).
"""
import argparse
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtrain.kernels import build, flash_attn_func, ops

SHAPES = ["2:4096:16:16:causal", "2:4096:16:16:full", "1:8192:16:2:causal", "1:4133:16:16:full",
          "4:1025:8:8:causal", "1:3001:16:4:full"]


def sdpa(q, k, v, causal):
    """(b, s, h, d) inputs; fp32 SDPA (math backend), GQA by repeating K / V heads; causal bottom-right."""
    group = q.shape[2] // k.shape[2]
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_mask(q, k, causal)).transpose(1, 2)


def naive(q, k, v, causal):
    """The same attention written out in the inputs' dtype (bf16 products and softmax): the low-precision error
    FlashAttention-2's rule compares against (PyTorch's math SDPA upcasts bf16 to fp32 inside, so it is not one)."""
    group = q.shape[2] // k.shape[2]
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    mask = _mask(q, k, causal)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def _mask(q, k, causal):
    if not causal:
        return None
    sq, sk = q.shape[2], k.shape[2]
    return torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)


def grads(fn, q, k, v, dout):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout.to(out.dtype))
    return [out.detach(), q.grad, k.grad, v.grad]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=SHAPES)
    args = parser.parse_args()
    ok = True
    for shape in args.shapes:
        batch, seqlen, heads, kv_heads, mode = shape.split(":")
        batch, seqlen, heads, kv_heads, causal = int(batch), int(seqlen), int(heads), int(kv_heads), mode == "causal"
        gen = torch.Generator("cuda").manual_seed(0)
        q, k, v, dout = (torch.randn(batch, seqlen, h, 192, device="cuda", generator=gen).to(torch.bfloat16)
                         for h in (heads, kv_heads, kv_heads, heads))
        # (fp32 leaves: the reference's gradients stay fp32)
        ref = grads(lambda q, k, v: sdpa(q, k, v, causal), q.float(), k.float(), v.float(), dout.float())
        low = grads(lambda q, k, v: naive(q, k, v, causal), q, k, v, dout)
        results = {}
        for n96 in (1, 0):
            build.BWD_SM90_HD192_N96 = n96
            ops.clear_plans()
            results[n96] = grads(lambda q, k, v: flash_attn_func(q, k, v, causal=causal, impl="cuda"), q, k, v, dout)
        build.BWD_SM90_HD192_N96 = 1
        ops.clear_plans()
        for n96, got in results.items():
            line = []
            for name, g, r, lo in zip(("out", "dq", "dk", "dv"), got, ref, low):
                err = (g.float() - r).abs().max().item()
                low_err = (lo.float() - r).abs().max().item()
                rounding = (r.to(torch.bfloat16).float() - r).abs().max().item()
                good = torch.isfinite(g).all().item() and err <= 2 * low_err + 2 * rounding + 1e-5
                ok &= good
                line.append(f"{name} {err:.3g} (bf16 {low_err:.3g}){'' if good else ' FAIL'}")
            print(f"{shape} {'n96' if n96 else 'n64'}: " + ", ".join(line), flush=True)
        diff = ", ".join(f"{name} {(a.float() - b.float()).abs().max().item():.3g}"
                         for name, a, b in zip(("out", "dq", "dk", "dv"), results[1], results[0]))
        print(f"{shape} n96 vs n64: {diff}", flush=True)
    print("all within FlashAttention-2's rule" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
