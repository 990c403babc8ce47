"""Probe: SM clock and board power while one attention call repeats for a few seconds, per implementation (bf16,
forward or forward + backward), sampled by `nvidia-smi -lms`. Tells a kernel that is slower because the GPU clocks
down under it (power) from one that is slower per clock.

    PYTHONPATH=$PWD python3 benchmarks/probes/clock_probe.py --head-dim 128 --seqlen 16384 [--causal] [--backward] \
        [--impls flashtrain fa4 cudnn]

Implementations: flashtrain, fa4 (FlashAttention-4 where installed: benchmarks/fa4_baseline.py), cudnn, fa2.
"""
import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtrain.kernels import flash_attn_func

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fa4_baseline  # noqa: E402
from gpu_clocks import smi_samples, steady_state  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--impls", nargs="+", default=["flashtrain", "cudnn"])
    args = parser.parse_args()
    fa4_baseline.require_if_named(args.impls)
    nheads, batch = 2048 // args.head_dim, max(1, 16384 // args.seqlen)
    shape = (batch, args.seqlen, nheads, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=args.backward) for _ in range(3))
    flops = 4 * batch * nheads * args.seqlen**2 * args.head_dim / (2 if args.causal else 1)
    flops *= 3.5 if args.backward else 1  # forward + backward: 3.5 forwards
    print(torch.cuda.get_device_name(), torch.__version__, f"hd{args.head_dim} S{args.seqlen} causal={args.causal} "
          f"{'fwd+bwd' if args.backward else 'fwd'}", flush=True)
    for name in args.impls:
        if name == "flashtrain":
            call = lambda: flash_attn_func(q, k, v, causal=args.causal, impl="cuda")  # noqa: E731
        elif name == "fa4":
            fa4 = fa4_baseline.attention(args.causal)
            call = lambda: fa4(q, k, v)  # noqa: E731
        else:
            qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_(args.backward) for x in (q, k, v))

            def call():
                with sdpa_kernel({"cudnn": SDPBackend.CUDNN_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION}[name]):
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal)

        def fn():
            out = call()
            if args.backward:
                out.backward(torch.ones_like(out))
        with torch.set_grad_enabled(args.backward):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            time.sleep(1.0)  # cool down between implementations
            with smi_samples() as rows:
                start, calls = time.time(), 0
                ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                ev0.record()
                while time.time() - start < args.seconds:
                    for _ in range(5):
                        fn()
                    calls += 5
                    torch.cuda.synchronize()
                ev1.record()
                torch.cuda.synchronize()
        ms = ev0.elapsed_time(ev1) / calls
        clock, power, temp = steady_state(rows)
        print(f"{name:<11} {flops / ms / 1e9:7.1f} TFLOP/s  SM clock {clock:6.0f} MHz  power {power:5.0f} W  "
              f"temp {temp:3.0f} C  ({len(rows) - len(rows) // 4} samples, {calls} calls)", flush=True)


if __name__ == "__main__":
    main()
