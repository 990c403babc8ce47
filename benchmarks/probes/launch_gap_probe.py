"""Probe: how much of a short attention call's measured time is its kernels, flashtrain's forward against cuDNN's,
calls interleaved as benchmarks/attention.py times them (stream launches, no CUDA graph). Per implementation: the
median time between CUDA events around one call, and the mean device time of its kernels in the same loop (torch
profiler, CUPTI); their difference is what a launch costs on the GPU's timeline beyond the kernel (launch latency,
a queue that ran dry). bf16, batch x seqlen = 16K tokens, 2048 / head_dim heads.

    PYTHONPATH=$PWD python3 benchmarks/probes/launch_gap_probe.py --configs 64:512:causal 128:512:full
"""
import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from flashtrain.kernels import flash_attn_func

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from train_gpt2 import time_interleaved  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", nargs="+", default=["64:512:causal", "64:512:full", "128:512:full",
                                                         "128:512:causal", "128:4096:full"])
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for config in args.configs:
        head_dim, seqlen, mask = config.split(":")
        head_dim, seqlen, causal = int(head_dim), int(seqlen), mask == "causal"
        batch, nheads = 16384 // seqlen, 2048 // head_dim
        q, k, v = (torch.randn(batch, seqlen, nheads, head_dim, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        qt, kt, vt = (torch.randn(batch, nheads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16)
                      for _ in range(3))

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

        calls = {"flashtrain": lambda: flash_attn_func(q, k, v, causal=causal, impl="cuda"), "cudnn": cudnn}
        for profiled in (False, True):
            with torch.no_grad():
                for call in calls.values():
                    for _ in range(3):
                        call()
                with profile(activities=[ProfilerActivity.CUDA]) if profiled else contextlib.nullcontext() as prof:
                    seconds = time_interleaved(calls, args.repeats)
            ms = {name: 1000 * statistics.median(values) for name, values in seconds.items()}
            line = f"{config:<16} {'profiled' if profiled else 'plain   '} event ms: " + "  ".join(
                f"{name} {ms[name]:.4f}" for name in calls) + f"  ratio cudnn/flashtrain {ms['cudnn'] / ms['flashtrain']:.3f}"
            if profiled:
                kernel_us = {"flashtrain": 0.0, "cudnn": 0.0}
                for item in prof.key_averages():
                    total = getattr(item, "device_time_total", 0.0) or getattr(item, "cuda_time_total", 0.0)
                    if not total or item.count == 0 or "Memcpy" in item.key or "Memset" in item.key:
                        continue
                    owner = "flashtrain" if item.key.startswith("flash_fwd") else "cudnn"
                    kernel_us[owner] += total / args.repeats
                    print(f"    kernel {item.key[:90]:<90} x{item.count:<4} {total / item.count:9.1f} us", flush=True)
                line += "  kernel ms: " + "  ".join(f"{n} {kernel_us[n] / 1000:.4f}" for n in calls)
                line += "  gap ms: " + "  ".join(f"{n} {ms[n] - kernel_us[n] / 1000:.4f}" for n in calls)
            print(line, flush=True)


if __name__ == "__main__":
    main()
