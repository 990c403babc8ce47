"""Probe: forward-only and backward-only speed of tile variants (build.FWD_TILES_NONCAUSAL / build.BWD_TILES /
build.FWD_SM90_TILES entries; sm90 variant None = the mma.sync forward) against SDPA's FA2 backend (bf16), in one
process, best of --rounds x median of 20:

    PYTHONPATH=$PWD FLASHTRAIN_KERNEL_CACHE=/tmp/ftk python3 benchmarks/probes/ab_probe.py
"""
import argparse
import concurrent.futures
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtrain.kernels import build, flash_attn_func, launch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
import attention  # noqa: E402  (benchmarks/attention.py: the timer)

Fw, Bw, Hw = build.FwdTiles, build.BwdTiles, build.FwdSm90Tiles
# (kind, head dim): {variant name: tiles}; fwd tiles go to FWD_TILES_NONCAUSAL (None: FWD_TILES), bwd to BWD_TILES
Bh = build.BwdSm90Tiles
# kinds: fwd / bwd (mma.sync tiles), sm90 / sm90bwd (Hopper kernels; variant None = the mma.sync kernel)
VARIANTS = {
    ("sm90bwd", 64): {"mma.sync": None, "sm90": Bh(3, 2)},
    ("sm90bwd", 128): {"mma.sync": None, "sm90": Bh(2, 2)},
}
ALL = [(s, c) for s in (512, 1024, 2048, 4096, 8192, 16384) for c in (False, True)]
# (kind, head dim): [(seqlen, causal)]
CONFIGS = {("sm90bwd", 64): ALL, ("sm90bwd", 128): ALL}


def use(kind, head_dim, tiles):
    if kind in ("sm90", "sm90bwd"):
        os.environ["FLASHTRAIN_SM90"] = "0" if tiles is None else "1"
        if tiles is not None:
            (build.FWD_SM90_TILES if kind == "sm90" else build.BWD_SM90_TILES)[head_dim] = tiles
    elif kind == "fwd":
        if tiles is None:
            build.FWD_TILES_NONCAUSAL.pop(head_dim, None)
        else:
            build.FWD_TILES_NONCAUSAL[head_dim] = tiles
    else:
        build.BWD_TILES[head_dim] = tiles
    prefix = f"flash_{dict(sm90='fwd_sm90', sm90bwd='bwd_sm90').get(kind, kind)}_hdim{head_dim}_"
    for cache in (launch._kernels, launch._modules):
        for key in [k for k in cache if k[1].startswith(prefix)]:
            del cache[key]


def median_ms(fn, repeats=20):
    return attention.median_ms(fn, 3, repeats)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dropout", type=float, default=0.0, help="attention dropout (skips the correctness check)")
    args = parser.parse_args()
    arch = build.arch_of_capability(*torch.cuda.get_device_capability())
    specs = [build.aux_kernels("bf16")]
    for (kind, hd), variants in VARIANTS.items():
        for tiles in variants.values():
            use(kind, hd, tiles)
            specs += [build.fwd_kernel(hd, "bf16", c, False, arch=arch) for c in (False, True)]
            if kind != "sm90":
                specs += [build.bwd_kernel(hd, "bf16", c, False, arch=arch) for c in (False, True)]
        use(kind, hd, next(iter(variants.values())))
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda s: build.compile_kernel(s, arch), specs))
    print("compiled", len(specs), flush=True)
    for (kind, hd), variants in VARIANTS.items() if not args.dropout else ():  # correctness vs fp32 SDPA
        for causal in (False, True):
            g = torch.Generator("cuda").manual_seed(0)
            q, k, v, do = (torch.randn(2, 1000, 2048 // hd, hd, device="cuda", generator=g, dtype=torch.bfloat16)
                           for _ in range(4))
            qt, kt, vt, dot = (x.transpose(1, 2).float().requires_grad_() for x in (q, k, v, do))
            ref_out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            ref = [ref_out] + list(torch.autograd.grad(ref_out, (qt, kt, vt), dot))
            for name, tiles in variants.items():
                use(kind, hd, tiles)
                qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
                out = flash_attn_func(qq, kk, vv, causal=causal, impl="cuda")
                got = [out] + list(torch.autograd.grad(out, (qq, kk, vv), do))
                errs = [((a.float().transpose(1, 2) - r).norm() / r.norm()).item() for a, r in zip(got, ref)]
                print(f"check {kind} hd{hd} causal={causal} {name}: rel err out dq dk dv " +
                      " ".join(f"{e:.2e}" for e in errs), flush=True)
                if max(errs) > 1e-2:
                    print(f"WRONG: {kind} hd{hd} causal={causal} {name}", flush=True)
            use(kind, hd, next(iter(variants.values())))
    best = {}
    for rnd in range(args.rounds):
        for (kind, hd), configs in CONFIGS.items():
            for s, causal in configs:
                batch, nh = 16384 // s, 2048 // hd
                flops = 4 * batch * nh * s * s * hd / (2 if causal else 1)
                flops *= 2.5 if kind in ("bwd", "sm90bwd") else 1
                q, k, v, do = (torch.randn(batch, s, nh, hd, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                qq, kk, vv = (x.requires_grad_() for x in (q, k, v))
                for name, tiles in VARIANTS[(kind, hd)].items():
                    use(kind, hd, tiles)
                    if kind in ("fwd", "sm90"):
                        with torch.no_grad():
                            ms = median_ms(lambda: flash_attn_func(qq, kk, vv, args.dropout, causal=causal,
                                                                   impl="cuda"))
                    else:
                        out = flash_attn_func(qq, kk, vv, args.dropout, causal=causal, impl="cuda")
                        ms = median_ms(lambda: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True))
                        del out
                    key = (kind, hd, s, causal, name)
                    best[key] = max(best.get(key, 0), flops / ms / 1e9)
                use(kind, hd, next(iter(VARIANTS[(kind, hd)].values())))
                qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
                dot = do.transpose(1, 2)
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    if kind in ("fwd", "sm90"):
                        with torch.no_grad():
                            ms = median_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                                                  dropout_p=args.dropout))
                    else:
                        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, dropout_p=args.dropout)
                        ms = median_ms(lambda: torch.autograd.grad(out, (qt, kt, vt), dot, retain_graph=True))
                        del out
                key = (kind, hd, s, causal, "FA2")
                best[key] = max(best.get(key, 0), flops / ms / 1e9)
                del q, k, v, do, qq, kk, vv, qt, kt, vt, dot
                torch.cuda.empty_cache()
        print("round", rnd, "done", flush=True)
    print(f"TFLOP/s (best of {args.rounds} rounds, median of 20), (ratio to FA2)")
    for (kind, hd), configs in CONFIGS.items():
        for s, causal in configs:
            names = list(VARIANTS[(kind, hd)]) + ["FA2"]
            fa2 = best[(kind, hd, s, causal, "FA2")]
            print(f"{kind} hd{hd} S{s:<6}{'causal' if causal else 'full  '} " + " ".join(
                f"{n}={best[(kind, hd, s, causal, n)]:.0f}({best[(kind, hd, s, causal, n)] / fa2:.3f})" for n in names))


if __name__ == "__main__":
    sys.exit(main())
