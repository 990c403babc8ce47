"""Probe: forward GPU time of the Hopper forward (flash_fwd_sm90.cuh) under other tile shapes, against SDPA's cuDNN
backend, bf16. Each tile variant runs in a process of its own (FLASHTRAIN_FWD_SM90_TILES is read at import); cuDNN is
timed in every process, so each line carries its own scale. The variants' cubins are compiled in parallel first.

    PYTHONPATH=$PWD python3 benchmarks/probes/sm90_fwd_tiles_probe.py [--variants 64=192x128x2 128=128x64x2 ...]

A variant may add compile-time macros after '+' (FLASHTRAIN_EXTRA_DEFINES), e.g. 64=128x128x2+FT_SOME_MACRO=1, and
the causal tile order's group size after '@waves=' (ops.CAUSAL_GROUP_WAVES; inf: longest first over all (batch, head)
units, the order before the groups), e.g. 128=128x128x2@waves=inf.

--masks causal full: also (or only) the non-causal rows. Shapes: the benchmark grid's rows at 512 / 1K / 4K (16384
tokens, 2048 / head_dim heads; --seqlens picks others) and GPT-2 small's attention as the model calls it (16 x 1K x
12 heads x 64, q / k / v strided views of one packed qkv tensor).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def child(head_dim: int, causal: bool) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashtrain.kernels import flash_attn_func, ops

    if "FLASHTRAIN_PROBE_CAUSAL_WAVES" in os.environ:  # (at every head dim)
        ops.CAUSAL_GROUP_WAVES = float(os.environ["FLASHTRAIN_PROBE_CAUSAL_WAVES"])
        ops.FWD_CAUSAL_GROUP_HEAD_DIM = 0

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from train_gpt2 import time_calls

    def gpu_ms(fn):
        return 1000 * statistics.median(time_calls(fn, torch.device("cuda"), warmup=5, repeats=30))

    seqlens = [int(s) for s in os.environ.get("FLASHTRAIN_PROBE_SEQLENS", "512,1024,4096").split(",")]
    shapes = [(16384 // s, s, 2048 // head_dim, False) for s in seqlens]
    if head_dim == 64 and "FLASHTRAIN_PROBE_SEQLENS" not in os.environ:
        shapes.append((16, 1024, 12, True))  # GPT-2 small, packed qkv
    rows = []
    for batch, seqlen, heads, packed in shapes:
        if packed:
            qkv = torch.randn(batch, seqlen, 3, heads, head_dim, device="cuda", dtype=torch.bfloat16)
            q, k, v = qkv.unbind(2)
        else:
            q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))
        flops = 4 * batch * heads * seqlen**2 * head_dim / (2 if causal else 1)
        best = {}
        for _ in range(2):
            ft = gpu_ms(lambda: flash_attn_func(q, k, v, causal=causal, impl="cuda"))
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                cd = gpu_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
            best["ft"], best["cudnn"] = min(best.get("ft", 1e9), ft), min(best.get("cudnn", 1e9), cd)
        rows.append({"shape": f"{batch}x{seqlen}x{heads}{' packed' if packed else ''}",
                     "ft_tflops": flops / best["ft"] / 1e9, "cudnn_tflops": flops / best["cudnn"] / 1e9})
    print(json.dumps(rows))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", nargs="+", default=[
        "64=128x128x2", "64=192x128x2", "64=128x64x2", "64=128x96x2",
        "128=128x128x2", "128=128x112x2", "128=128x96x2", "128=128x64x2"])
    parser.add_argument("--masks", nargs="+", default=["causal"], choices=["causal", "full"])
    parser.add_argument("--seqlens", nargs="+", type=int, help="sequence lengths of the grid rows (default 512 1K "
                        "4K and, at head dim 64, GPT-2 small's shape)")
    parser.add_argument("--child", type=int)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.masks == ["causal"])
    env = dict(os.environ)
    if args.seqlens:
        env["FLASHTRAIN_PROBE_SEQLENS"] = ",".join(map(str, args.seqlens))

    def variant_env(variant):
        variant, *waves = variant.split("@waves=")
        tiles, *macros = variant.split("+")
        extra = {"FLASHTRAIN_PROBE_CAUSAL_WAVES": waves[0]} if waves else {}
        return {**env, "FLASHTRAIN_FWD_SM90_TILES": tiles, "FLASHTRAIN_EXTRA_DEFINES": ",".join(macros), **extra}

    def prebuild(variant):
        head_dim = variant.split("=")[0]
        code = ("from flashtrain.kernels import build\nfor causal in (True, False):\n"
                f"    build.compile_kernel(build.fwd_kernel({head_dim}, 'bf16', causal, False, arch='sm_90a'), 'sm_90a')")
        return subprocess.run([sys.executable, "-c", code], env=variant_env(variant), capture_output=True, text=True)

    with ThreadPoolExecutor(8) as pool:
        for variant, result in zip(args.variants, pool.map(prebuild, args.variants)):
            if result.returncode:
                print(f"{variant}: build failed\n{result.stderr[-2000:]}", flush=True)
    for mask in args.masks:
        for variant in args.variants:
            head_dim = int(variant.split("=")[0])
            result = subprocess.run([sys.executable, __file__, "--child", str(head_dim), "--masks", mask],
                                    env=variant_env(variant), capture_output=True, text=True)
            if result.returncode:
                print(f"{variant}: failed\n{result.stderr[-2000:]}", flush=True)
                continue
            rows = json.loads(result.stdout.strip().splitlines()[-1])
            print(f"{mask:<7}{variant:<48}" + "  ".join(
                f"{r['shape']} {r['ft_tflops']:5.0f}/{r['cudnn_tflops']:3.0f} "
                f"({r['ft_tflops'] / r['cudnn_tflops']:.2f})" for r in rows), flush=True)

if __name__ == "__main__":
    main()
