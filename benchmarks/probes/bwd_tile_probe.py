"""Probe: backward-only speed of several BWD_TILES variants (plus optional extra -D macros, for source variants
guarded by #ifndef) against SDPA's FA2 backend (bf16), one process:

    PYTHONPATH=$PWD FLASHTRAIN_KERNEL_CACHE=/tmp/ftk python3 benchmarks/probes/bwd_tile_probe.py
"""
import concurrent.futures
import dataclasses
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtrain.kernels import build, flash_attn_func, launch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
import attention  # noqa: E402  (benchmarks/attention.py: the timer)

B = build.BwdTiles
VARIANTS = {  # name: (tiles, extra -D macros appended to the backward's spec)
    64: {"64x128": (B(64, 128, 8, 2, 4, 4, 2), ()), "128x128": (B(128, 128, 8, 2, 4, 4, 2), ())},
    128: {"64x128": (B(64, 128, 8, 2, 4, 2, 2), ())},
}
MASK_END = {64: (), 128: ()}  # the current variant's extra macros per head dim
_bwd_kernel = build.bwd_kernel


def bwd_kernel(head_dim, dtype, causal, dropout):
    spec = _bwd_kernel(head_dim, dtype, causal, dropout)
    return dataclasses.replace(spec, defines=spec.defines + MASK_END[head_dim])


build.bwd_kernel = bwd_kernel
CONFIGS = [(64, s, False) for s in (1024, 4096, 16384)] + [(128, s, False) for s in (2048, 8192, 16384)] + \
          [(64, 4096, True), (128, 8192, True), (64, 4095, False)]
DROPOUT = {4095: 0.1}  # the S=4095 row: dropout 0.1 (and a partial last key block)
DROPOUT.update({s: 0.0 for s in (1024, 2048, 4096, 8192, 16384)})


def use(head_dim, variant):
    build.BWD_TILES[head_dim], MASK_END[head_dim] = variant
    for key in [k for k in launch._kernels if k[1].startswith(f"flash_bwd_hdim{head_dim}_")]:
        del launch._kernels[key]
    for key in [k for k in launch._modules if k[1].startswith(f"flash_bwd_hdim{head_dim}_")]:
        del launch._modules[key]


def median_ms(fn, repeats=20):
    return attention.median_ms(fn, 3, repeats)


def main():
    arch = build.arch_of_capability(*torch.cuda.get_device_capability())
    specs = []
    for hd, variants in VARIANTS.items():
        for variant in variants.values():
            build.BWD_TILES[hd], MASK_END[hd] = variant
            specs += [build.bwd_kernel(hd, "bf16", c, d) for c in (False, True) for d in (False, True)]
        specs += [build.fwd_kernel(hd, "bf16", c, d) for c in (False, True) for d in (False, True)]
    specs.append(build.aux_kernels("bf16"))
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda s: build.compile_kernel(s, arch), specs))
    print("compiled", len(specs), flush=True)
    # correctness of every variant against FA2 at one shape per head dim / causal
    for hd, variants in VARIANTS.items():
        for causal in (False, True):
            g = torch.Generator("cuda").manual_seed(0)
            q, k, v, do = (torch.randn(2, 1000, 2048 // hd, hd, device="cuda", generator=g, dtype=torch.bfloat16)
                           for _ in range(4))
            qt, kt, vt, dot = (x.transpose(1, 2).float().requires_grad_() for x in (q, k, v, do))
            ref = torch.autograd.grad(F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal), (qt, kt, vt), dot)
            for name, variant in variants.items():
                use(hd, variant)
                qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
                got = torch.autograd.grad(flash_attn_func(qq, kk, vv, causal=causal, impl="cuda"), (qq, kk, vv), do)
                errs = [((a.float().transpose(1, 2) - r).norm() / r.norm()).item() for a, r in zip(got, ref)]
                print(f"check hd{hd} causal={causal} {name}: rel err dq dk dv " + " ".join(f"{e:.2e}" for e in errs))
                assert max(errs) < 1e-2, (hd, causal, name, errs)
    best = {}
    for rnd in range(2):
        for hd, s, causal in CONFIGS:
            batch, nh = 16384 // s, 2048 // hd
            flops = 2.5 * 4 * batch * nh * s * s * hd / (2 if causal else 1)
            q, k, v, do = (torch.randn(batch, s, nh, hd, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            qq, kk, vv = (x.requires_grad_() for x in (q, k, v))
            for name, variant in VARIANTS[hd].items():
                use(hd, variant)
                out = flash_attn_func(qq, kk, vv, causal=causal, impl="cuda", dropout_p=DROPOUT[s])
                ms = median_ms(lambda: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True))
                key = (hd, s, causal, name)
                best[key] = max(best.get(key, 0), flops / ms / 1e9)
                del out
            qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
            dot = do.transpose(1, 2)
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, dropout_p=DROPOUT[s])
            ms = median_ms(lambda: torch.autograd.grad(out, (qt, kt, vt), dot, retain_graph=True))
            key = (hd, s, causal, "FA2")
            best[key] = max(best.get(key, 0), flops / ms / 1e9)
            del out, q, k, v, do, qq, kk, vv, qt, kt, vt, dot
            torch.cuda.empty_cache()
        print("round", rnd, "done", flush=True)
    print("bwd TFLOP/s (best of 2 rounds, median of 20)")
    for hd, s, causal in CONFIGS:
        names = list(VARIANTS[hd]) + ["FA2"]
        fa2 = best[(hd, s, causal, "FA2")]
        print(f"hd{hd} S{s:<6}{'causal' if causal else 'full  '} " +
              " ".join(f"{n}={best[(hd, s, causal, n)]:.0f}({best[(hd, s, causal, n)] / fa2:.2f})" for n in names))


if __name__ == "__main__":
    sys.exit(main())
