"""Probe: forward TFLOP/s of the Hopper warpgroup-MMA forward (flash_fwd_sm90.cuh) against the mma.sync forward
(FLASHTRAIN_SM90=0) and SDPA's FA2 backend, bf16, the 24 configurations of benchmarks/attention.py (--dropout P: with
attention dropout), in one process; first a correctness check of both forwards against fp32 attention on one shape
per head dim (without dropout). --impls adds cuDNN and compile-time variants of the kernels
("flashtrain+FT_MACRO=1", as in sm90_bwd_probe.py), e.g. --impls flashtrain flashtrain+FT_FWD_ROTATE=1 cudnn.

    PYTHONPATH=$PWD FLASHTRAIN_KERNEL_CACHE=/tmp/ftk python3 benchmarks/probes/sm90_fwd_probe.py
"""
import argparse
import contextlib
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtrain.kernels import flash_attn_func

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from train_gpt2 import time_calls  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sm90_bwd_probe import kernel_variant  # noqa: E402


def check(head_dim: int, causal: bool) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 1000, 4, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ref = F.scaled_dot_product_attention(*(x.float().transpose(1, 2) for x in (q, k, v)), is_causal=causal)
    ref = ref.transpose(1, 2)
    for flag in ("1", "0"):
        os.environ["FLASHTRAIN_SM90"] = flag
        out = flash_attn_func(q, k, v, causal=causal, impl="cuda").float()
        err = (out - ref).abs()
        print(f"check hd{head_dim} causal={causal} sm90={flag}: max err {err.max().item():.3g}, per 64-col block "
              f"{[round(err[..., c:c + 64].max().item(), 3) for c in range(0, head_dim, 64)]}, rows>=500 "
              f"{err[:, 500:].max().item():.3g}", flush=True)
    os.environ["FLASHTRAIN_SM90"] = "1"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--masks", nargs="+", default=["full", "causal"], choices=["full", "causal"])
    parser.add_argument("--impls", nargs="+", default=["flashtrain", "mma.sync", "fa2"],
                        help="flashtrain, flashtrain+FT_MACRO=v[+...] (kernels built with those macros), mma.sync "
                             "(FLASHTRAIN_SM90=0), cudnn, fa2")
    parser.add_argument("--no-check", action="store_true")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    if not args.no_check:
        for head_dim in (64, 128):
            for causal in (False, True):
                check(head_dim, causal)
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION}
    for head_dim in args.head_dims:
        nheads = 2048 // head_dim
        for seqlen in args.seqlens:
            batch = 16384 // seqlen
            for causal in [m == "causal" for m in args.masks]:
                flops = 4 * batch * nheads * seqlen**2 * head_dim / (2 if causal else 1)
                q, k, v = (torch.randn(batch, seqlen, nheads, head_dim, device="cuda", dtype=torch.bfloat16)
                           for _ in range(3))
                qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
                best = {}
                for round_index in range(args.rounds):  # odd rounds in reverse order: the first
                    # implementation of a round measured up to 5% faster than the same kernel later (H200, 2026-11-25)
                    for name in args.impls[::-1] if round_index % 2 else args.impls:
                        if name in backends:
                            def fn():
                                with sdpa_kernel(backends[name]):
                                    F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                                   dropout_p=args.dropout)
                            variant = contextlib.nullcontext()
                        else:
                            os.environ["FLASHTRAIN_SM90"] = "0" if name == "mma.sync" else "1"
                            variant = kernel_variant(name if name.startswith("flashtrain") else "flashtrain")

                            def fn():
                                flash_attn_func(q, k, v, args.dropout, causal=causal, impl="cuda")
                        with torch.no_grad(), variant:
                            ms = 1000 * statistics.median(time_calls(fn, torch.device("cuda"), 3, args.repeats))
                        best[name] = max(best.get(name, 0), flops / ms / 1e9)
                os.environ["FLASHTRAIN_SM90"] = "1"
                line = "  ".join(f"{n} {best[n]:6.1f}" for n in args.impls)
                ratios = "".join(f"  {n}/{base} {best[n] / best[base]:.3f}" for base in ("cudnn", "flashtrain")
                                 if base in best for n in args.impls if n != base and n.startswith("flashtrain"))
                print(f"hd{head_dim} S{seqlen:<6} {'causal' if causal else 'full  '} p={args.dropout} fwd TFLOP/s "
                      f"{line}{ratios}", flush=True)


if __name__ == "__main__":
    main()
