"""Probe: does a kernel variant compute exactly what the default kernels compute? A variant that only moves work
(which thread issues a copy, where a wait sits, how tiles are handed out) must give bitwise-equal outputs and
gradients; run this before timing one with ab_probe.py. The variant is named as in ab_probe.py:
flashtrain+FT_MACRO=v (kernels compiled with the macro), flashtrain@ENV=v / @build.NAME=v / @ops.NAME=v (dispatch
settings), or both.

Cases per head dim (bf16): full and partial query / key tiles, causal and not, a short causal batch (the small-L2
kernels at 512-1K rows), GQA (32 query heads on 8 key / value heads), and variable-length sequences (one of a single
token), forward only or forward + backward (--pass fb: dQ, dK, dV compared too, from the deterministic backward:
the default one sums dQ, and dK / dV across GQA heads, with atomics, so two runs of the same kernels differ in the last
bits).

    PYTHONPATH=$PWD python3 benchmarks/probes/variant_equal_probe.py --variant flashtrain+FT_FWD_X=1 \
        [--head-dims 64 128] [--pass fwd|fb] [--json out.json]

Writes: one line per case (bitwise equal, or the largest difference) and, with --json, the same as a record; exits 1
when any case differs.
"""
import argparse
import json
import sys

import torch

import ab_probe

# (batch, seqlen, heads, kv heads, causal)
DENSE_CASES = [(1, 16384, 16, 16, False), (4, 4096, 16, 16, False), (3, 1000, 7, 7, False), (4, 4096, 16, 16, True),
               (2, 777, 5, 5, True), (16, 1024, 16, 16, True), (32, 512, 8, 8, True), (2, 2048, 32, 8, True),
               (2, 2048, 32, 8, False)]
VARLEN_LENGTHS = [300, 1200, 1, 2599]


def outputs(name: str, fn, inputs, grad_out):
    """The variant's output (and with grad_out, the gradients of its inputs) for one call."""
    with ab_probe.variant(name):
        out = fn(*inputs)
        if grad_out is None:
            return [out]
        return [out, *torch.autograd.grad(out, inputs, grad_out)]


def compare(label: str, variant: str, fn, inputs, backward: bool) -> dict:
    grad_out = torch.randn_like(fn(*inputs)) if backward else None
    base = outputs("flashtrain", fn, inputs, grad_out)
    other = outputs(variant, fn, inputs, grad_out)
    names = ["out", "dq", "dk", "dv"][:len(base)]
    diffs = {n: (a - b).abs().max().item() for n, a, b in zip(names, base, other) if not torch.equal(a, b)}
    print(f"{label}: " + ("bitwise equal" if not diffs else "DIFFERS " + json.dumps(diffs)), flush=True)
    return {"case": label, "equal": not diffs, "max_abs_diff": diffs}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", required=True, help="as ab_probe.py names one, e.g. flashtrain+FT_FWD_X=1")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--pass", dest="kind", choices=("fwd", "fb"), default="fwd")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if not args.variant.startswith("flashtrain") or args.variant == "flashtrain":
        parser.error(f"--variant: a flashtrain variant such as flashtrain+FT_FWD_X=1 (got {args.variant!r})")
    from flashtrain.kernels import flash_attn_func, flash_attn_varlen_func

    backward = args.kind == "fb"
    torch.manual_seed(0)
    rows = []
    for hd in args.head_dims:
        for b, s, h, hk, causal in DENSE_CASES:
            q = torch.randn(b, s, h, hd, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
            k, v = (torch.randn(b, s, hk, hd, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
                    for _ in range(2))
            rows.append(compare(f"hd{hd} B{b} S{s} H{h}/{hk} {'causal' if causal else 'full'}", args.variant,
                                lambda q, k, v, c=causal: flash_attn_func(q, k, v, causal=c, impl="cuda",
                                                                         deterministic=backward),
                                (q, k, v), backward))
        total = sum(VARLEN_LENGTHS)
        cu = torch.tensor([0] + VARLEN_LENGTHS, device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
        q, k, v = (torch.randn(total, 16, hd, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
                   for _ in range(3))
        for causal in (False, True):
            rows.append(compare(
                f"hd{hd} varlen {VARLEN_LENGTHS} {'causal' if causal else 'full'}", args.variant,
                lambda q, k, v, c=causal: flash_attn_varlen_func(q, k, v, cu, cu, max(VARLEN_LENGTHS),
                                                                 max(VARLEN_LENGTHS), causal=c, impl="cuda",
                                                                 deterministic=backward),
                (q, k, v), backward))
    equal = all(r["equal"] for r in rows)
    print("all cases bitwise equal" if equal else "SOME CASES DIFFER")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "variant": args.variant,
                       "pass": args.kind, "rows": rows}, f, indent=1)
    sys.exit(0 if equal else 1)


if __name__ == "__main__":
    main()
