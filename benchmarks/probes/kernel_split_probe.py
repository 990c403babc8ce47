"""Probe: where one forward, backward or forward + backward spends its GPU time, kernel by kernel, for flashtrain and
SDPA's cuDNN backend (torch.profiler; bf16, the benchmark grid's shapes: batch * seqlen = 16K tokens, hidden 2048).

    python benchmarks/probes/kernel_split_probe.py --configs 128:causal:512 128:full:1024 --calls 20

Prints per implementation and pass the mean time per call of each kernel (us) and their sum; the sum against the
wall time per call (CUDA events) shows the gaps between kernels (launches, host work).
"""
import argparse
import collections
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from flashtrain.kernels import flash_attn_func


def calls(impl: str, hd: int, causal: bool, seqlen: int):
    batch, nheads = 16384 // seqlen, 2048 // hd
    q, k, v, dout = (torch.randn(batch, seqlen, nheads, hd, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    if impl == "cudnn":
        q, k, v, dout = (x.transpose(1, 2) for x in (q, k, v, dout))

        def fwd(q, k, v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    else:
        def fwd(q, k, v):
            return flash_attn_func(q, k, v, causal=causal, impl="cuda")
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fwd(q, k, v)
    return {
        "fwd": lambda: fwd(q, k, v),
        "bwd": lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
        "fb": lambda: torch.autograd.grad(fwd(q, k, v), (q, k, v), dout),
    }


def split(fn, n: int) -> tuple[dict, float]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    wall_us = start.elapsed_time(end) * 1000 / n
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    kernels = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name[:90]] += event.device_time / n
    return kernels, wall_us


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["128:causal:512"], help="head_dim:full|causal:seqlen")
    parser.add_argument("--impls", nargs="+", default=["flashtrain", "cudnn"])
    parser.add_argument("--passes", nargs="+", default=["fwd", "bwd", "fb"])
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args(argv)
    print(torch.cuda.get_device_name(), torch.__version__, "cuDNN", torch.backends.cudnn.version())
    for config in args.configs:
        hd, mask, seqlen = config.split(":")
        for impl in args.impls:
            fns = calls(impl, int(hd), mask == "causal", int(seqlen))
            for name in args.passes:
                kernels, wall_us = split(fns[name], args.calls)
                total = sum(kernels.values())
                print(f"hd{hd} {mask} S{seqlen} {impl} {name}: wall {wall_us:.1f} us per call, kernels {total:.1f} us")
                for kernel, us in sorted(kernels.items(), key=lambda item: -item[1]):
                    print(f"    {us:8.1f} us  {kernel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
