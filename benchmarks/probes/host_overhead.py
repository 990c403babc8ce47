"""Probe: host (CPU) time per call of flashtrain's attention against SDPA's FA2 backend, on a shape small enough that
the GPU never is the bottleneck, plus a cProfile of flashtrain's forward and forward+backward calls.

    PYTHONPATH=$PWD FLASHTRAIN_KERNEL_CACHE=/tmp/ftk python3 benchmarks/probes/host_overhead.py
"""
import cProfile
import io
import pstats
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtrain.kernels import flash_attn_func


def host_us(fn, n=300) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * host / n


def main() -> None:
    q, k, v, do = (torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(4))
    qt, kt, vt, dot = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v, do))

    def ft_fwd():
        with torch.no_grad():
            flash_attn_func(q, k, v, causal=True, impl="cuda")

    def ft_fb():
        torch.autograd.grad(flash_attn_func(q, k, v, causal=True, impl="cuda"), (q, k, v), do)

    def fa2_fwd():
        with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

    def fa2_fb():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        torch.autograd.grad(out, (qt, kt, vt), dot)

    for name, fn in (("flashtrain fwd", ft_fwd), ("fa2 fwd", fa2_fwd), ("flashtrain fwd+bwd", ft_fb),
                     ("fa2 fwd+bwd", fa2_fb)):
        print(f"{name:20s} host us/call {host_us(fn):7.1f}", flush=True)
    for name, fn in (("flashtrain fwd", ft_fwd), ("flashtrain fwd+bwd", ft_fb)):
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(200):
            fn()
        profile.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
        print(f"==== {name} (200 calls)\n" + "\n".join(text.getvalue().splitlines()[:45]), flush=True)


if __name__ == "__main__":
    main()
